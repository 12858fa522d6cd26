// An order-independent sum of softmax numerators exp(s − max), each in [0, 1] (or NaN): TOKEN_SELECT's per-head
// normaliser Z_h (§6.3), on one device and across context-parallel shards (sparsa_cp_select_sum).
//
// A float64 running sum depends on the order of its terms, so shards that each sum their part and add the parts
// would be rounded differently from one sequential sum, and a near-tie in the vote could flip. Here every term is
// truncated to a multiple of 2^-128 (exactly, from its bits) and added as an integer, which is exact and
// associative: any order and any split gives the same integer, and one fixed conversion gives the same double.
// The truncation drops less than 2^-128 per term; Z_h >= 1 (the maximum's own term is exp(0) = 1), so the relative
// error is below N · 2^-128, far under one float64 ulp.
#pragma once

#include <sparsa/sparsa.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>

#include "host_device.h"

namespace sparsa {

// A term's fraction part ∈ [0, 1) in units of 2^-128, truncated, as two 64-bit halves: what FixedPointSum::add adds,
// computed from the double's bits alone so that the GPU kernels (gpu_cp_select.cu) sum the same units. A normal
// part = m · 2^(E − 1075) (m the 53-bit significand, E the biased exponent <= 1022) is m · 2^(E − 947) units; a
// subnormal one is below 2^-1022, far under one unit.
struct FixedPointUnits {
  uint64_t high = 0, low = 0;
};
SPARSA_HOST_DEVICE inline FixedPointUnits fixed_point_units(double part) {
#if defined(__CUDA_ARCH__) || defined(__HIP_DEVICE_COMPILE__)
  const uint64_t bits = uint64_t(__double_as_longlong(part));
#else
  uint64_t bits;
  std::memcpy(&bits, &part, sizeof bits);
#endif
  const int exponent = int((bits >> 52) & 0x7ff);
  FixedPointUnits u;
  if (exponent == 0) return u;  // zero or subnormal: 0 units
  const uint64_t significand = (bits & ((uint64_t{1} << 52) - 1)) | (uint64_t{1} << 52);
  const int shift = exponent - 947;  // <= 75
  if (shift >= 64) {
    u.high = significand << (shift - 64);
  } else if (shift > 0) {
    u.low = significand << shift;
    u.high = significand >> (64 - shift);
  } else if (shift > -64) {
    u.low = significand >> -shift;
  }
  return u;
}

class FixedPointSum {
 public:
  // Digit layout of to_digits/from_digits (SPARSA_CP_SUM_DIGITS): NaN count, integer part, then the 128 fraction
  // bits as four 32-bit digits, most significant first.
  static constexpr int kDigits = SPARSA_CP_SUM_DIGITS;
  static constexpr int kFractionBits = 128;
  static constexpr int kDigitBits = 32;
  static constexpr uint64_t kDigitMask = (uint64_t{1} << kDigitBits) - 1;

  // Adds a term; NaN is counted (the sum is then NaN), anything else must be >= 0 (finite).
  void add(double term) {
    if (std::isnan(term)) {
      ++nan_count_;
      return;
    }
    const double whole = std::floor(term);
    whole_ += uint64_t(whole);
    const FixedPointUnits units = fixed_point_units(term - whole);  // the part is exact, in [0, 1)
    add_units((static_cast<unsigned __int128>(units.high) << 64) | units.low);
  }

  // Adds another sum, exactly (a split of the terms summed part by part gives the same sum).
  void add(const FixedPointSum& other) {
    nan_count_ += other.nan_count_;
    whole_ += other.whole_;
    add_units(other.fraction_);
  }

  // Adds sum_i digit_sums[i] · 2^(32·(3 − i) − 128) for i < 4 (most significant first), exactly: the fraction digits of
  // many terms summed digit by digit (select_softmax.cpp's vector loops; each sum below 2^63).
  void add_fraction_digits(const uint64_t* digit_sums) {
    uint64_t carry = 0;
    unsigned __int128 units = 0;
    for (int i = kFractionDigits - 1; i >= 0; --i) {
      const uint64_t value = digit_sums[i] + carry;
      units |= static_cast<unsigned __int128>(value & kDigitMask) << (kFractionBits - kDigitBits * (i + 1));
      carry = value >> kDigitBits;
    }
    whole_ += carry;
    add_units(units);
  }

  // This sum as SPARSA_CP_SUM_DIGITS digits, each in [0, 2^32) (the integer part below 2^31 for N <= INT32_MAX).
  void to_digits(int64_t* digits) const {
    digits[0] = int64_t(nan_count_);
    digits[1] = int64_t(whole_);
    for (int i = 0; i < kFractionDigits; ++i) {
      const int low_bit = kFractionBits - kDigitBits * (i + 1);
      digits[2 + i] = int64_t(uint64_t(fraction_ >> low_bit) & kDigitMask);
    }
  }

  // The sum whose digits (each >= 0, possibly past 2^32 after an element-wise add over shards) are given: carries
  // move up from the least significant digit, so every representation of one value gives the same FixedPointSum.
  // Returns false for a negative digit.
  static bool from_digits(const int64_t* digits, FixedPointSum* out) {
    for (int i = 0; i < kDigits; ++i)
      if (digits[i] < 0) return false;
    FixedPointSum sum;
    sum.nan_count_ = uint64_t(digits[0]);
    uint64_t carry = 0;
    for (int i = kFractionDigits - 1; i >= 0; --i) {
      const uint64_t value = uint64_t(digits[2 + i]) + carry;
      const int low_bit = kFractionBits - kDigitBits * (i + 1);
      sum.fraction_ |= static_cast<unsigned __int128>(value & kDigitMask) << low_bit;
      carry = value >> kDigitBits;
    }
    sum.whole_ = uint64_t(digits[1]) + carry;
    *out = sum;
    return true;
  }

  // The sum as a double: NaN when a NaN term was added; otherwise a fixed sequence of roundings of the unique
  // (whole, fraction) pair, so equal sums give equal doubles.
  double value() const {
    if (nan_count_ > 0) return std::numeric_limits<double>::quiet_NaN();
    const double low = std::ldexp(double(uint64_t(fraction_)), -kFractionBits);
    const double high = std::ldexp(double(uint64_t(fraction_ >> 64)), 64 - kFractionBits);
    return double(whole_) + (high + low);
  }

 private:
  static constexpr int kFractionDigits = kFractionBits / kDigitBits;         // 4

  void add_units(unsigned __int128 units) {
    const unsigned __int128 before = fraction_;
    fraction_ += units;
    if (fraction_ < before) ++whole_;  // wrapped past 2^128: one whole unit
  }

  uint64_t nan_count_ = 0;
  uint64_t whole_ = 0;
  unsigned __int128 fraction_ = 0;  // units of 2^-128
};

}  // namespace sparsa
