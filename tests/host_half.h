// The one host f16/bf16 converter of the tests (CPU suite, GPU tests, vector generator): round to nearest even,
// subnormals, infinities and NaN included. Header-only and dependency-free so every test target can include it.
#pragma once

#include <cstdint>
#include <cstring>

namespace host_half {

inline uint16_t float_to_f16(float x) {
  uint32_t f;
  std::memcpy(&f, &x, 4);
  const uint32_t sign = (f >> 16) & 0x8000u;
  const int32_t exponent = int32_t((f >> 23) & 0xFF) - 127 + 15;
  uint32_t mantissa = f & 0x7FFFFFu;
  if (((f >> 23) & 0xFF) == 0xFF) return uint16_t(sign | 0x7C00u | (mantissa ? 0x200u : 0));  // inf, NaN
  if (exponent >= 31) return uint16_t(sign | 0x7C00u);                                         // overflow
  if (exponent <= 0) {                                                                         // subnormal or zero
    if (exponent < -10) return uint16_t(sign);
    mantissa |= 0x800000u;
    const int shift = 14 - exponent;
    uint32_t half = mantissa >> shift;
    const uint32_t rest = mantissa & ((1u << shift) - 1), halfway = 1u << (shift - 1);
    if (rest > halfway || (rest == halfway && (half & 1))) ++half;
    return uint16_t(sign | half);
  }
  uint32_t half = (uint32_t(exponent) << 10) | (mantissa >> 13);
  const uint32_t rest = mantissa & 0x1FFFu;
  if (rest > 0x1000u || (rest == 0x1000u && (half & 1))) ++half;  // a carry moves into the exponent correctly
  return uint16_t(sign | half);
}

inline float f16_to_float(uint16_t h) {
  const uint32_t sign = uint32_t(h & 0x8000u) << 16;
  uint32_t exponent = (h >> 10) & 0x1F, mantissa = h & 0x3FFu, f;
  if (exponent == 0x1F) {
    f = sign | 0x7F800000u | (mantissa << 13);
  } else if (exponent == 0) {
    if (mantissa == 0) {
      f = sign;
    } else {
      int e = -1;
      do {
        ++e;
        mantissa <<= 1;
      } while (!(mantissa & 0x400u));
      f = sign | (uint32_t(127 - 15 - e) << 23) | ((mantissa & 0x3FFu) << 13);
    }
  } else {
    f = sign | ((exponent - 15 + 127) << 23) | (mantissa << 13);
  }
  float x;
  std::memcpy(&x, &f, 4);
  return x;
}

inline uint16_t float_to_bf16(float x) {
  uint32_t f;
  std::memcpy(&f, &x, 4);
  if ((f & 0x7FFFFFFFu) > 0x7F800000u) return uint16_t((f >> 16) | 0x40u);  // NaN stays a quiet NaN
  f += 0x7FFFu + ((f >> 16) & 1u);
  return uint16_t(f >> 16);
}

inline float bf16_to_float(uint16_t h) {
  const uint32_t f = uint32_t(h) << 16;
  float x;
  std::memcpy(&x, &f, 4);
  return x;
}

}  // namespace host_half
