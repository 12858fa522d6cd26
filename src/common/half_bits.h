// Exact widening of IEEE binary16 and bfloat16 bit patterns to float, header-only and dependency-free: the core
// (src/tensor_util.h) and the command-line tool (tools/cli_common.h, which links only the public API) share it.
#pragma once

#include <cstdint>
#include <cstring>

namespace sparsa {

// IEEE binary16 bits → float (exact; subnormals renormalised, inf and NaN kept).
inline float half_to_float(uint16_t h) {
  const uint32_t sign = uint32_t(h & 0x8000u) << 16;
  const uint32_t exponent = (h >> 10) & 0x1fu;
  uint32_t mantissa = h & 0x3ffu;
  uint32_t bits;
  if (exponent == 0) {
    if (mantissa == 0) {
      bits = sign;
    } else {  // subnormal: renormalise
      int shift = 0;
      while ((mantissa & 0x400u) == 0) {
        mantissa <<= 1;
        ++shift;
      }
      mantissa &= 0x3ffu;
      bits = sign | (uint32_t(127 - 15 + 1 - shift) << 23) | (mantissa << 13);
    }
  } else if (exponent == 0x1f) {
    bits = sign | 0x7f800000u | (mantissa << 13);
  } else {
    bits = sign | ((exponent + (127 - 15)) << 23) | (mantissa << 13);
  }
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

// bfloat16 bits → float (exact: the top half of a float).
inline float bf16_to_float(uint16_t b) {
  const uint32_t bits = uint32_t(b) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

}  // namespace sparsa
