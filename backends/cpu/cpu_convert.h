// fp16 / bf16 <-> fp32 conversion for the CPU backend. Widening is exact; narrowing rounds to nearest, ties to
// even, keeps infinities, turns NaN into a quiet NaN and overflows to infinity (IEEE 754 semantics, what
// torch/numpy do). load_row_f32 / store_row (declared in attention_loop.h) move one row of D elements.
#pragma once

#include <cstdint>
#include <cstring>

#include "attention_loop.h"

namespace sparsa::cpu {

inline float bits_to_float(uint32_t bits) {
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}
inline uint32_t float_to_bits(float f) {
  uint32_t bits;
  std::memcpy(&bits, &f, sizeof bits);
  return bits;
}

inline float bf16_to_float(uint16_t h) { return bits_to_float(uint32_t(h) << 16); }

inline uint16_t float_to_bf16(float f) {
  const uint32_t bits = float_to_bits(f);
  if ((bits & 0x7fffffffu) > 0x7f800000u) return uint16_t((bits >> 16) | 0x0040u);  // quiet NaN, sign kept
  const uint32_t rounding_bias = 0x7fffu + ((bits >> 16) & 1u);                     // ties to even
  return uint16_t((bits + rounding_bias) >> 16);
}

inline float f16_to_float(uint16_t h) {
  const uint32_t sign = uint32_t(h & 0x8000u) << 16;
  const uint32_t exponent = (h >> 10) & 0x1fu;
  uint32_t mantissa = h & 0x3ffu;
  if (exponent == 0x1fu) return bits_to_float(sign | 0x7f800000u | (mantissa << 13));  // inf / NaN
  if (exponent != 0) return bits_to_float(sign | ((exponent + 112u) << 23) | (mantissa << 13));
  if (mantissa == 0) return bits_to_float(sign);  // ±0
  // Subnormal: value = mantissa · 2^-24, exact in fp32.
  int shift = 0;
  while ((mantissa & 0x400u) == 0) {
    mantissa <<= 1;
    ++shift;
  }
  mantissa &= 0x3ffu;
  return bits_to_float(sign | (uint32_t(113 - shift) << 23) | (mantissa << 13));
}

inline uint16_t float_to_f16(float f) {
  const uint32_t bits = float_to_bits(f);
  const uint16_t sign = uint16_t((bits >> 16) & 0x8000u);
  const uint32_t magnitude = bits & 0x7fffffffu;
  if (magnitude > 0x7f800000u) return uint16_t(sign | 0x7e00u | ((magnitude >> 13) & 0x3ffu));  // NaN
  if (magnitude >= 0x477ff000u) return uint16_t(sign | 0x7c00u);  // rounds to >= 65520: infinity
  if (magnitude >= 0x38800000u) {                                 // normal half (>= 2^-14)
    const uint32_t rounded = magnitude + 0xfffu + ((magnitude >> 13) & 1u) - (112u << 23);
    return uint16_t(sign | (rounded >> 13));
  }
  if (magnitude < 0x33000000u) return sign;  // below half of the smallest subnormal (2^-25): ±0
  // Subnormal half: shift the full significand right, rounding ties to even.
  const uint32_t exponent = magnitude >> 23;
  const uint32_t significand = (magnitude & 0x7fffffu) | 0x800000u;
  const uint32_t shift = 126u - exponent;  // 14..24 for exponents 102..112
  const uint32_t halfway = 1u << (shift - 1);
  uint32_t result = significand >> shift;
  const uint32_t remainder = significand & ((1u << shift) - 1u);
  if (remainder > halfway || (remainder == halfway && (result & 1u))) ++result;
  return uint16_t(sign | result);
}

// Row widening of fp16 / bf16 to fp32 with the best vector instructions of this CPU (widen_rows.cpp): AVX-512F, or
// F16C + AVX2, else a portable loop. Every version is exact, so they agree bit for bit; src may be unaligned.
struct RowWideners {
  void (*f16)(const void* src, int64_t n, float* dst);
  void (*bf16)(const void* src, int64_t n, float* dst);
  const char* name;  // "avx512f", "f16c+avx2" or "portable"
};
const RowWideners& portable_row_wideners();
const RowWideners& select_row_wideners();

// Widens n elements of `dtype` (F32/F16/BF16) at src to fp32.
void convert_to_f32(int32_t dtype, const void* src, int64_t n, float* dst);
// Narrows n fp32 values to `dtype` at dst.
void convert_from_f32(int32_t dtype, const float* src, int64_t n, void* dst);

// Bytes of one element of an attention dtype.
inline int64_t element_bytes(int32_t dtype) { return dtype == SPARSA_DTYPE_F32 ? 4 : 2; }

}  // namespace sparsa::cpu
