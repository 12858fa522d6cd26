// TOKEN_SELECT's softmax statistics and vote kernels (see select_softmax.h). Three versions with the same bits:
//   portable  std::max, std::exp and FixedPointSum::add per term, one divide and add at a time per vote;
//   AVX2      4 lanes: glibc's exp evaluated in vector registers, the fixed-point terms as four 32-bit digit sums per
//             lane, the vote over 4 candidates at once (each still a sum in head order);
//   AVX-512F  the same with 8 lanes.
// exp(x) for x in the main range of glibc's exp (2^-54 <= |x| < 512, here only x < 0, so 0 < exp(x) < 1):
//   kd = fma(x, 128/ln2, 0x1.8p52) (round to nearest integer k in its low bits), kd −= 0x1.8p52;
//   r = fma(kd, −ln2hi/128, x), r = fma(kd, −ln2lo/128, r);
//   tail, sbits = table[k mod 128], sbits += k << 45 (scale = 2^(k/128) as the double with bits sbits);
//   tmp = fma(r4, C4 + r·C5 (fma), fma(C2 + r·C3 (fma), r², r + tail)), r² = r·r, r4 = r²·r²;
//   exp(x) = fma(scale, tmp, scale).
// That is glibc's __exp_fma instruction for instruction (x86_64 glibc 2.28+, read from its disassembly), so each lane
// rounds exactly as one std::exp call on a CPU with FMA and AVX2. The table holds, for k < 128, the bits of
// tail_k = (2^(k/128) − H_k) / H_k and of H_k minus k << 45, with H_k = 2^(k/128) rounded to the nearest double and
// tail_k rounded to the nearest double, both from 2^(k/128) to 60 digits (Python's decimal:
// `y = (Decimal(2).ln() * k / 128).exp()`); they equal glibc's table. The polynomial's coefficients are glibc's.
// This file is compiled with -ffp-contract=off (CMakeLists.txt): the divides and adds of the vote and the
// subtraction x = s − m must round on their own, as in the plain loops; the FMAs above are explicit intrinsics.
#include "select_softmax.h"
#include "cpu_features.h"
#include "../../src/common/glibc_exp.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <iterator>
#include <limits>
#include <numeric>
#include <vector>

#if defined(__x86_64__)
#include <immintrin.h>
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#endif
#endif

namespace sparsa::cpu {
namespace {

// ---- portable ----

void exp_and_sum_portable(double* values, int64_t n, int32_t group, const double* maxes, FixedPointSum* sums) {
  int32_t l = 0;
  for (int64_t i = 0; i < n; ++i) {
    const double e = std::exp(values[i] - maxes[l]);
    values[i] = e;
    sums[l].add(e);
    if (++l == group) l = 0;
  }
}

void max_per_head_portable(const double* values, int64_t n, int32_t group, double* maxes) {
  for (int32_t l = 0; l < group; ++l) {
    double max_score = -INFINITY;
    for (int64_t i = l; i < n; i += group) max_score = std::max(max_score, values[i]);
    maxes[l] = max_score;
  }
}

void vote_portable(const double* kept, int64_t kept_stride, int32_t group, int32_t n_heads, const double* head_sum,
                   int64_t first, int64_t last, double* votes) {
  for (int64_t c = first; c < last; ++c) {
    double vote = 0.0;
    for (int32_t k = 0; k < n_heads; ++k) vote += kept[(k / group) * kept_stride + c * group + k % group] / head_sum[k];
    votes[c] = vote;
  }
}

constexpr SelectSoftmaxKernel kPortable = {max_per_head_portable, exp_and_sum_portable, vote_portable, "portable"};

#if defined(__x86_64__) && !defined(SPARSA_CPU_PORTABLE_KERNELS)

// ---- glibc's exp: constants and table from src/common/glibc_exp.h (which also holds the scalar function) ----

using namespace glibc_exp_detail;
// The main range of glibc's exp: 2^-54 <= |x| < 512, i.e. top12(|x|) − top12(2^-54) < top12(512) − top12(2^-54).
constexpr int64_t kTop12Span = kTop12Big - kTop12Tiny;

// ---- the fixed-point terms (FixedPointSum::add for 0 < e < 1, lane by lane) ----

// A term e = bits · 2^(E − 1075) (normal, E its biased exponent) is bits · 2^shift units of 2^-128 with
// shift = E − 947; truncated to a whole unit it is lo + 2^64 · hi with (shifts of 64 or more, or negative, give 0):
//   lo = (bits << shift) | (bits >> −shift),  hi = (bits >> (64 − shift)) | (bits << (shift − 64)).
// The sums keep four 32-bit digits apiece (FixedPointSum's digits 2..5), which cannot overflow below 2^32 terms.
constexpr int64_t kUnitExponentBias = 947;
constexpr uint64_t kMantissaMask = (uint64_t{1} << 52) - 1;
constexpr uint64_t kImplicitBit = uint64_t{1} << 52;
constexpr uint64_t kDigitMask = 0xffffffffu;
constexpr int kFractionDigits = 4;            // FixedPointSum's digits 2..5, most significant first
constexpr int32_t kMaxVectorGroup = 64;       // heads per kv head the vector loops take; larger groups run portable

// Adds the per-lane digit sums digits[kFractionDigits][positions] (lane p of the pattern belongs to head p % group)
// into sums, exactly.
void fold_digits(const uint64_t* digits, int positions, int32_t group, FixedPointSum* sums) {
  for (int32_t l = 0; l < group; ++l) {
    uint64_t total[kFractionDigits] = {};
    for (int p = l; p < positions; p += group)
      for (int i = 0; i < kFractionDigits; ++i) total[i] += digits[i * positions + p];
    sums[l].add_fraction_digits(total);
  }
}

// Folds the per-lane maxima lanes[positions] (lane p belongs to head p % group) into maxes; a zero result (which
// zero the order-dependent fold picks differs) is taken again in order.
void fold_maxima(const double* lanes, int positions, const double* values, int64_t n, int32_t group, double* maxes) {
  for (int32_t l = 0; l < group; ++l) {
    double max_score = -INFINITY;
    for (int p = l; p < positions; p += group) max_score = std::max(max_score, lanes[p]);
    if (max_score == 0.0) {
      max_score = -INFINITY;
      for (int64_t i = l; i < n; i += group) max_score = std::max(max_score, values[i]);
    }
    maxes[l] = max_score;
  }
}

// ---- AVX-512F ----

constexpr int kZmmLanes = 8;
constexpr int32_t kVoteGroupOfFour = 4;  // GQA groups of 4 (Hq = 4·Hkv): the vote transposes instead of gathering

// kBlocks: the number of vectors after which the lanes' heads repeat, when known at compile time (0: from group).
template <int kBlocks>
__attribute__((target("avx512f"))) void max_per_head_avx512_blocks(const double* values, int64_t n, int32_t group,
                                                             double* maxes) {
  if (group > kMaxVectorGroup) return max_per_head_portable(values, n, group, maxes);
  const int blocks = kBlocks > 0 ? kBlocks : group / std::gcd(group, kZmmLanes);
  const int positions = blocks * kZmmLanes;
  __m512d acc[kMaxVectorGroup];
  for (int b = 0; b < blocks; ++b) acc[b] = _mm512_set1_pd(-INFINITY);
  int64_t i = 0;
  int block = 0;
  for (; i + kZmmLanes <= n; i += kZmmLanes) {
    acc[block] = _mm512_max_pd(_mm512_loadu_pd(values + i), acc[block]);  // a NaN value keeps acc, as std::max
    if (++block == blocks) block = 0;
  }
  alignas(64) double lanes[kMaxVectorGroup * kZmmLanes];
  for (int b = 0; b < blocks; ++b) _mm512_store_pd(lanes + b * kZmmLanes, acc[b]);
  for (; i < n; ++i) {  // the tail: position i % positions holds head i % group
    double& lane = lanes[i % positions];
    lane = std::max(lane, values[i]);
  }
  fold_maxima(lanes, positions, values, n, group, maxes);
}

__attribute__((target("avx512f"))) void max_per_head_avx512(const double* values, int64_t n, int32_t group,
                                                             double* maxes) {
  if (group <= kZmmLanes && kZmmLanes % group == 0) return max_per_head_avx512_blocks<1>(values, n, group, maxes);
  return max_per_head_avx512_blocks<0>(values, n, group, maxes);
}


__attribute__((target("avx512f,fma"))) inline __m512d exp_main_avx512(__m512d x) {
  const __m512d shifted = _mm512_fmadd_pd(x, _mm512_set1_pd(kInvLn2N), _mm512_set1_pd(kShift));
  const __m512i ki = _mm512_castpd_si512(shifted);
  const __m512d kd = _mm512_sub_pd(shifted, _mm512_set1_pd(kShift));
  __m512d r = _mm512_fmadd_pd(kd, _mm512_set1_pd(kNegLn2HiN), x);
  r = _mm512_fmadd_pd(kd, _mm512_set1_pd(kNegLn2LoN), r);
  const __m512i idx = _mm512_slli_epi64(_mm512_and_si512(ki, _mm512_set1_epi64(int64_t(kIndexMask))), 1);
  const __m512d tail = _mm512_i64gather_pd(idx, kTable, 8);
  const __m512i sbits = _mm512_add_epi64(_mm512_i64gather_epi64(idx, kTable + 1, 8),
                                         _mm512_slli_epi64(ki, kScaleShift));
  const __m512d r2 = _mm512_mul_pd(r, r);
  const __m512d c23 = _mm512_fmadd_pd(r, _mm512_set1_pd(kC3), _mm512_set1_pd(kC2));
  const __m512d c45 = _mm512_fmadd_pd(r, _mm512_set1_pd(kC5), _mm512_set1_pd(kC4));
  __m512d tmp = _mm512_fmadd_pd(c23, r2, _mm512_add_pd(r, tail));
  tmp = _mm512_fmadd_pd(_mm512_mul_pd(r2, r2), c45, tmp);
  const __m512d scale = _mm512_castsi512_pd(sbits);
  return _mm512_fmadd_pd(scale, tmp, scale);
}

// Lanes where x < 0 and 2^-54 <= |x| < 512 (glibc's main range, negative half).
__attribute__((target("avx512f"))) inline __mmask8 main_range_avx512(__m512d x) {
  const __m512i bits = _mm512_castpd_si512(x);
  const __m512i top = _mm512_and_si512(_mm512_srli_epi64(bits, 52), _mm512_set1_epi64(0x7ff));
  const __mmask8 in_range =
      _mm512_cmplt_epu64_mask(_mm512_sub_epi64(top, _mm512_set1_epi64(kTop12Tiny)), _mm512_set1_epi64(kTop12Span));
  return in_range & _mm512_cmplt_epi64_mask(bits, _mm512_setzero_si512());
}

// kBlocks: the number of vectors after which the lanes' heads repeat, when known at compile time (0: from group).
template <int kBlocks>
__attribute__((target("avx512f,fma"))) void exp_and_sum_avx512_blocks(double* values, int64_t n, int32_t group,
                                                                const double* maxes, FixedPointSum* sums) {
  if (group > kMaxVectorGroup) return exp_and_sum_portable(values, n, group, maxes, sums);
  // Vector v covers values [8v, 8v + 8); its lanes' heads repeat every `blocks` vectors.
  const int blocks = kBlocks > 0 ? kBlocks : group / std::gcd(group, kZmmLanes);
  const int positions = blocks * kZmmLanes;
  alignas(64) double pattern[kMaxVectorGroup * kZmmLanes];
  for (int p = 0; p < positions; ++p) pattern[p] = maxes[p % group];
  __m512i acc[kFractionDigits][kMaxVectorGroup];
  for (int b = 0; b < blocks; ++b)
    for (int i = 0; i < kFractionDigits; ++i) acc[i][b] = _mm512_setzero_si512();
  const __m512i mantissa_mask = _mm512_set1_epi64(int64_t(kMantissaMask));
  const __m512i implicit_bit = _mm512_set1_epi64(int64_t(kImplicitBit));
  const __m512i digit_mask = _mm512_set1_epi64(int64_t(kDigitMask));
  const __m512i bias = _mm512_set1_epi64(kUnitExponentBias);
  const __m512i sixty_four = _mm512_set1_epi64(64);
  int64_t i = 0;
  int block = 0;
  for (; i + kZmmLanes <= n; i += kZmmLanes) {
    const __m512d x = _mm512_sub_pd(_mm512_loadu_pd(values + i), _mm512_load_pd(pattern + block * kZmmLanes));
    const __m512d e = exp_main_avx512(x);
    // The fixed-point digits below take 0 < e < 1; |x| just above 2^-54 gives e = 1.
    const __mmask8 main = main_range_avx512(x) & _mm512_cmp_pd_mask(e, _mm512_set1_pd(1.0), _CMP_LT_OQ);
    if (main != 0xff) {
      alignas(64) double xs[kZmmLanes];
      _mm512_store_pd(xs, x);
      for (int lane = 0; lane < kZmmLanes; ++lane) {
        if (main & (1u << lane)) continue;
        const double term = std::exp(xs[lane]);
        sums[(block * kZmmLanes + lane) % group].add(term);
        xs[lane] = term;
      }
      _mm512_storeu_pd(values + i, _mm512_mask_blend_pd(main, _mm512_load_pd(xs), e));
    } else {
      _mm512_storeu_pd(values + i, e);
    }
    const __m512i term = _mm512_castpd_si512(e);
    const __m512i mantissa = _mm512_or_si512(_mm512_and_si512(term, mantissa_mask), implicit_bit);
    const __m512i shift = _mm512_sub_epi64(_mm512_srli_epi64(term, 52), bias);
    const __m512i lo = _mm512_or_si512(_mm512_sllv_epi64(mantissa, shift),
                                       _mm512_srlv_epi64(mantissa, _mm512_sub_epi64(_mm512_setzero_si512(), shift)));
    const __m512i hi = _mm512_or_si512(_mm512_srlv_epi64(mantissa, _mm512_sub_epi64(sixty_four, shift)),
                                       _mm512_sllv_epi64(mantissa, _mm512_sub_epi64(shift, sixty_four)));
    acc[0][block] = _mm512_mask_add_epi64(acc[0][block], main, acc[0][block], _mm512_srli_epi64(hi, 32));
    acc[1][block] = _mm512_mask_add_epi64(acc[1][block], main, acc[1][block], _mm512_and_si512(hi, digit_mask));
    acc[2][block] = _mm512_mask_add_epi64(acc[2][block], main, acc[2][block], _mm512_srli_epi64(lo, 32));
    acc[3][block] = _mm512_mask_add_epi64(acc[3][block], main, acc[3][block], _mm512_and_si512(lo, digit_mask));
    if (++block == blocks) block = 0;
  }
  for (; i < n; ++i) {
    const int32_t l = int32_t(i % group);
    const double term = std::exp(values[i] - maxes[l]);
    values[i] = term;
    sums[l].add(term);
  }
  alignas(64) uint64_t digits[kFractionDigits * kMaxVectorGroup * kZmmLanes];
  for (int d = 0; d < kFractionDigits; ++d)
    for (int b = 0; b < blocks; ++b) _mm512_store_si512(digits + d * positions + b * kZmmLanes, acc[d][b]);
  fold_digits(digits, positions, group, sums);
}

__attribute__((target("avx512f,fma"))) void exp_and_sum_avx512(double* values, int64_t n, int32_t group,
                                                                const double* maxes, FixedPointSum* sums) {
  if (group <= kZmmLanes && kZmmLanes % group == 0) return exp_and_sum_avx512_blocks<1>(values, n, group, maxes, sums);
  return exp_and_sum_avx512_blocks<0>(values, n, group, maxes, sums);
}

__attribute__((target("avx512f"))) void vote_avx512(const double* kept, int64_t kept_stride, int32_t group,
                                                     int32_t n_heads, const double* head_sum, int64_t first,
                                                     int64_t last, double* votes) {
  const int64_t g = group;
  const __m512i lane_offsets = _mm512_set_epi64(7 * g, 6 * g, 5 * g, 4 * g, 3 * g, 2 * g, g, 0);
  int64_t c = first;
  if (group == kVoteGroupOfFour) {
    // A kv head's 8 candidates × 4 heads are 32 consecutive doubles: four loads and a transpose instead of gathers.
    const __m512i pairs_low = _mm512_set_epi64(13, 9, 5, 1, 12, 8, 4, 0);  // heads 0, 1 of candidates 0-3
    const __m512i pairs_high = _mm512_set_epi64(15, 11, 7, 3, 14, 10, 6, 2);  // heads 2, 3
    const __m512i low_halves = _mm512_set_epi64(11, 10, 9, 8, 3, 2, 1, 0);
    const __m512i high_halves = _mm512_set_epi64(15, 14, 13, 12, 7, 6, 5, 4);
    for (; c + kZmmLanes <= last; c += kZmmLanes) {
      __m512d vote = _mm512_setzero_pd();
      for (int32_t k0 = 0; k0 < n_heads; k0 += kVoteGroupOfFour) {
        const double* block = kept + (k0 / kVoteGroupOfFour) * kept_stride + c * kVoteGroupOfFour;
        const __m512d c01 = _mm512_loadu_pd(block), c23 = _mm512_loadu_pd(block + 8);
        const __m512d c45 = _mm512_loadu_pd(block + 16), c67 = _mm512_loadu_pd(block + 24);
        // [h0 of c0-3, h1 of c0-3] for candidates 0-3 and 4-7, then [h2 ..., h3 ...].
        const __m512d h01_first = _mm512_permutex2var_pd(c01, pairs_low, c23);
        const __m512d h01_second = _mm512_permutex2var_pd(c45, pairs_low, c67);
        const __m512d h23_first = _mm512_permutex2var_pd(c01, pairs_high, c23);
        const __m512d h23_second = _mm512_permutex2var_pd(c45, pairs_high, c67);
        const __m512d heads[kVoteGroupOfFour] = {_mm512_permutex2var_pd(h01_first, low_halves, h01_second),
                                                 _mm512_permutex2var_pd(h01_first, high_halves, h01_second),
                                                 _mm512_permutex2var_pd(h23_first, low_halves, h23_second),
                                                 _mm512_permutex2var_pd(h23_first, high_halves, h23_second)};
        for (int l = 0; l < kVoteGroupOfFour; ++l)
          vote = _mm512_add_pd(vote, _mm512_div_pd(heads[l], _mm512_set1_pd(head_sum[k0 + l])));
      }
      _mm512_storeu_pd(votes + c, vote);
    }
  }
  for (; c + kZmmLanes <= last; c += kZmmLanes) {
    __m512d vote = _mm512_setzero_pd();
    for (int32_t k = 0; k < n_heads; ++k) {
      const double* column = kept + (k / group) * kept_stride + c * group + k % group;
      const __m512d e = _mm512_i64gather_pd(lane_offsets, column, 8);
      vote = _mm512_add_pd(vote, _mm512_div_pd(e, _mm512_set1_pd(head_sum[k])));
    }
    _mm512_storeu_pd(votes + c, vote);
  }
  vote_portable(kept, kept_stride, group, n_heads, head_sum, c, last, votes);
}

// ---- AVX2 ----

constexpr int kYmmLanes = 4;

// kBlocks: the number of vectors after which the lanes' heads repeat, when known at compile time (0: from group).
template <int kBlocks>
__attribute__((target("avx2"))) void max_per_head_avx2_blocks(const double* values, int64_t n, int32_t group,
                                                              double* maxes) {
  if (group > kMaxVectorGroup) return max_per_head_portable(values, n, group, maxes);
  const int blocks = kBlocks > 0 ? kBlocks : group / std::gcd(group, kYmmLanes);
  const int positions = blocks * kYmmLanes;
  __m256d acc[kMaxVectorGroup];
  for (int b = 0; b < blocks; ++b) acc[b] = _mm256_set1_pd(-INFINITY);
  int64_t i = 0;
  int block = 0;
  for (; i + kYmmLanes <= n; i += kYmmLanes) {
    acc[block] = _mm256_max_pd(_mm256_loadu_pd(values + i), acc[block]);  // a NaN value keeps acc, as std::max
    if (++block == blocks) block = 0;
  }
  alignas(32) double lanes[kMaxVectorGroup * kYmmLanes];
  for (int b = 0; b < blocks; ++b) _mm256_store_pd(lanes + b * kYmmLanes, acc[b]);
  for (; i < n; ++i) {
    double& lane = lanes[i % positions];
    lane = std::max(lane, values[i]);
  }
  fold_maxima(lanes, positions, values, n, group, maxes);
}

__attribute__((target("avx2"))) void max_per_head_avx2(const double* values, int64_t n, int32_t group, double* maxes) {
  if (group <= kYmmLanes && kYmmLanes % group == 0) return max_per_head_avx2_blocks<1>(values, n, group, maxes);
  return max_per_head_avx2_blocks<0>(values, n, group, maxes);
}


__attribute__((target("avx2,fma"))) inline __m256d exp_main_avx2(__m256d x) {
  const __m256d shifted = _mm256_fmadd_pd(x, _mm256_set1_pd(kInvLn2N), _mm256_set1_pd(kShift));
  const __m256i ki = _mm256_castpd_si256(shifted);
  const __m256d kd = _mm256_sub_pd(shifted, _mm256_set1_pd(kShift));
  __m256d r = _mm256_fmadd_pd(kd, _mm256_set1_pd(kNegLn2HiN), x);
  r = _mm256_fmadd_pd(kd, _mm256_set1_pd(kNegLn2LoN), r);
  const __m256i idx = _mm256_slli_epi64(_mm256_and_si256(ki, _mm256_set1_epi64x(int64_t(kIndexMask))), 1);
  const __m256d tail = _mm256_i64gather_pd(reinterpret_cast<const double*>(kTable), idx, 8);
  const __m256i sbits =
      _mm256_add_epi64(_mm256_i64gather_epi64(reinterpret_cast<const long long*>(kTable + 1), idx, 8),
                       _mm256_slli_epi64(ki, kScaleShift));
  const __m256d r2 = _mm256_mul_pd(r, r);
  const __m256d c23 = _mm256_fmadd_pd(r, _mm256_set1_pd(kC3), _mm256_set1_pd(kC2));
  const __m256d c45 = _mm256_fmadd_pd(r, _mm256_set1_pd(kC5), _mm256_set1_pd(kC4));
  __m256d tmp = _mm256_fmadd_pd(c23, r2, _mm256_add_pd(r, tail));
  tmp = _mm256_fmadd_pd(_mm256_mul_pd(r2, r2), c45, tmp);
  const __m256d scale = _mm256_castsi256_pd(sbits);
  return _mm256_fmadd_pd(scale, tmp, scale);
}

// All-ones lanes where x < 0 and 2^-54 <= |x| < 512.
__attribute__((target("avx2"))) inline __m256i main_range_avx2(__m256d x) {
  const __m256i bits = _mm256_castpd_si256(x);
  const __m256i top = _mm256_and_si256(_mm256_srli_epi64(bits, 52), _mm256_set1_epi64x(0x7ff));
  const __m256i offset = _mm256_sub_epi64(top, _mm256_set1_epi64x(kTop12Tiny));  // in [−0x3c9, 0x436]
  const __m256i in_range = _mm256_and_si256(_mm256_cmpgt_epi64(offset, _mm256_set1_epi64x(-1)),
                                            _mm256_cmpgt_epi64(_mm256_set1_epi64x(kTop12Span), offset));
  return _mm256_and_si256(in_range, _mm256_cmpgt_epi64(_mm256_setzero_si256(), bits));
}

// kBlocks: the number of vectors after which the lanes' heads repeat, when known at compile time (0: from group).
template <int kBlocks>
__attribute__((target("avx2,fma"))) void exp_and_sum_avx2_blocks(double* values, int64_t n, int32_t group,
                                                          const double* maxes, FixedPointSum* sums) {
  if (group > kMaxVectorGroup) return exp_and_sum_portable(values, n, group, maxes, sums);
  const int blocks = kBlocks > 0 ? kBlocks : group / std::gcd(group, kYmmLanes);
  const int positions = blocks * kYmmLanes;
  alignas(32) double pattern[kMaxVectorGroup * kYmmLanes];
  for (int p = 0; p < positions; ++p) pattern[p] = maxes[p % group];
  __m256i acc[kFractionDigits][kMaxVectorGroup];
  for (int b = 0; b < blocks; ++b)
    for (int i = 0; i < kFractionDigits; ++i) acc[i][b] = _mm256_setzero_si256();
  const __m256i mantissa_mask = _mm256_set1_epi64x(int64_t(kMantissaMask));
  const __m256i implicit_bit = _mm256_set1_epi64x(int64_t(kImplicitBit));
  const __m256i digit_mask = _mm256_set1_epi64x(int64_t(kDigitMask));
  const __m256i bias = _mm256_set1_epi64x(kUnitExponentBias);
  const __m256i sixty_four = _mm256_set1_epi64x(64);
  int64_t i = 0;
  int block = 0;
  for (; i + kYmmLanes <= n; i += kYmmLanes) {
    const __m256d x = _mm256_sub_pd(_mm256_loadu_pd(values + i), _mm256_load_pd(pattern + block * kYmmLanes));
    const __m256d e = exp_main_avx2(x);
    // The fixed-point digits below take 0 < e < 1; |x| just above 2^-54 gives e = 1.
    const __m256i main = _mm256_and_si256(main_range_avx2(x),
                                          _mm256_castpd_si256(_mm256_cmp_pd(e, _mm256_set1_pd(1.0), _CMP_LT_OQ)));
    const int main_bits = _mm256_movemask_pd(_mm256_castsi256_pd(main));
    if (main_bits != 0xf) {
      alignas(32) double xs[kYmmLanes];
      _mm256_store_pd(xs, x);
      for (int lane = 0; lane < kYmmLanes; ++lane) {
        if (main_bits & (1 << lane)) continue;
        const double term = std::exp(xs[lane]);
        sums[(block * kYmmLanes + lane) % group].add(term);
        xs[lane] = term;
      }
      _mm256_storeu_pd(values + i, _mm256_blendv_pd(_mm256_load_pd(xs), e, _mm256_castsi256_pd(main)));
    } else {
      _mm256_storeu_pd(values + i, e);
    }
    const __m256i term = _mm256_castpd_si256(e);
    const __m256i mantissa = _mm256_or_si256(_mm256_and_si256(term, mantissa_mask), implicit_bit);
    const __m256i shift = _mm256_sub_epi64(_mm256_srli_epi64(term, 52), bias);
    const __m256i lo = _mm256_or_si256(_mm256_sllv_epi64(mantissa, shift),
                                       _mm256_srlv_epi64(mantissa, _mm256_sub_epi64(_mm256_setzero_si256(), shift)));
    const __m256i hi = _mm256_or_si256(_mm256_srlv_epi64(mantissa, _mm256_sub_epi64(sixty_four, shift)),
                                       _mm256_sllv_epi64(mantissa, _mm256_sub_epi64(shift, sixty_four)));
    acc[0][block] = _mm256_add_epi64(acc[0][block], _mm256_and_si256(main, _mm256_srli_epi64(hi, 32)));
    acc[1][block] = _mm256_add_epi64(acc[1][block], _mm256_and_si256(main, _mm256_and_si256(hi, digit_mask)));
    acc[2][block] = _mm256_add_epi64(acc[2][block], _mm256_and_si256(main, _mm256_srli_epi64(lo, 32)));
    acc[3][block] = _mm256_add_epi64(acc[3][block], _mm256_and_si256(main, _mm256_and_si256(lo, digit_mask)));
    if (++block == blocks) block = 0;
  }
  for (; i < n; ++i) {
    const int32_t l = int32_t(i % group);
    const double term = std::exp(values[i] - maxes[l]);
    values[i] = term;
    sums[l].add(term);
  }
  alignas(32) uint64_t digits[kFractionDigits * kMaxVectorGroup * kYmmLanes];
  for (int d = 0; d < kFractionDigits; ++d)
    for (int b = 0; b < blocks; ++b)
      _mm256_store_si256(reinterpret_cast<__m256i*>(digits + d * positions + b * kYmmLanes), acc[d][b]);
  fold_digits(digits, positions, group, sums);
}

__attribute__((target("avx2,fma"))) void exp_and_sum_avx2(double* values, int64_t n, int32_t group,
                                                          const double* maxes, FixedPointSum* sums) {
  if (group <= kYmmLanes && kYmmLanes % group == 0) return exp_and_sum_avx2_blocks<1>(values, n, group, maxes, sums);
  return exp_and_sum_avx2_blocks<0>(values, n, group, maxes, sums);
}

__attribute__((target("avx2"))) void vote_avx2(const double* kept, int64_t kept_stride, int32_t group,
                                                int32_t n_heads, const double* head_sum, int64_t first, int64_t last,
                                                double* votes) {
  const __m256i lane_offsets = _mm256_set_epi64x(3 * int64_t(group), 2 * int64_t(group), group, 0);
  int64_t c = first;
  for (; c + kYmmLanes <= last; c += kYmmLanes) {
    __m256d vote = _mm256_setzero_pd();
    for (int32_t k = 0; k < n_heads; ++k) {
      const double* column = kept + (k / group) * kept_stride + c * group + k % group;
      const __m256d e = _mm256_i64gather_pd(column, lane_offsets, 8);
      vote = _mm256_add_pd(vote, _mm256_div_pd(e, _mm256_set1_pd(head_sum[k])));
    }
    _mm256_storeu_pd(votes + c, vote);
  }
  vote_portable(kept, kept_stride, group, n_heads, head_sum, c, last, votes);
}

constexpr SelectSoftmaxKernel kAvx2 = {max_per_head_avx2, exp_and_sum_avx2, vote_avx2, "avx2"};
constexpr SelectSoftmaxKernel kAvx512 = {max_per_head_avx512, exp_and_sum_avx512, vote_avx512, "avx512f"};

// ---- the check that this process's std::exp is the function the vector versions evaluate ----

// True when kernel.exp_and_sum gives std::exp's bits and FixedPointSum::add's sum on inputs that reach every table
// entry, both sides of each rounding of k, the ends of the main range and the special cases. glibc chooses its FMA
// variant where the CPU has FMA and AVX2 (the vector versions need both anyway); another C library, an older glibc
// or a tuned-off FMA fails here.
bool matches_std_exp(const SelectSoftmaxKernel& kernel) {
  constexpr int kSamples = 4096;
  std::vector<double> inputs;
  inputs.reserve(kSamples + 16);
  uint64_t state = 0x9e3779b97f4a7c15u;
  for (int s = 0; s < kSamples; ++s) {
    state = state * 6364136223846793005u + 1442695040888963407u;
    const double unit = double(state >> 11) * 0x1p-53;                   // [0, 1)
    const double magnitude = (s % 4 == 0) ? unit * 600.0 : unit * 40.0;  // mostly where softmax terms live
    inputs.push_back(-magnitude);
  }
  const double edges[] = {0.0,   -0.0,     -0x1p-54, -0x1.fffffffffffffp-55,       -511.99999999999994, -512.0,
                          -745.2, -1e300, -HUGE_VAL, std::numeric_limits<double>::quiet_NaN(), 1e-3, 3.0};
  inputs.insert(inputs.end(), std::begin(edges), std::end(edges));
  std::vector<double> values = inputs;
  const double zero = 0.0;
  FixedPointSum vector_sum;
  kernel.exp_and_sum(values.data(), int64_t(values.size()), 1, &zero, &vector_sum);
  FixedPointSum plain_sum;
  for (size_t i = 0; i < inputs.size(); ++i) {
    const double want = std::exp(inputs[i]);
    if (std::memcmp(&want, &values[i], sizeof want) != 0 && !(std::isnan(want) && std::isnan(values[i]))) return false;
    plain_sum.add(want);
  }
  int64_t a[FixedPointSum::kDigits], b[FixedPointSum::kDigits];
  vector_sum.to_digits(a);
  plain_sum.to_digits(b);
  return std::memcmp(a, b, sizeof a) == 0;
}

bool has_avx2_fma() { return cpu_features().avx2 && cpu_features().fma; }
bool has_avx512f() { return has_avx2_fma() && cpu_features().avx512f; }

#endif

}  // namespace

const SelectSoftmaxKernel& portable_select_softmax_kernel() { return kPortable; }

#if defined(__x86_64__) && !defined(SPARSA_CPU_PORTABLE_KERNELS)
const SelectSoftmaxKernel* avx2_select_softmax_kernel() {
  static const bool usable = has_avx2_fma() && matches_std_exp(kAvx2);  // a CPU and C library property: once
  return usable ? &kAvx2 : nullptr;
}
const SelectSoftmaxKernel* avx512_select_softmax_kernel() {
  static const bool usable = has_avx512f() && matches_std_exp(kAvx512);
  return usable ? &kAvx512 : nullptr;
}
#else
const SelectSoftmaxKernel* avx2_select_softmax_kernel() { return nullptr; }
const SelectSoftmaxKernel* avx512_select_softmax_kernel() { return nullptr; }
#endif

const SelectSoftmaxKernel& select_softmax_kernel() {
  static const SelectSoftmaxKernel& chosen = []() -> const SelectSoftmaxKernel& {
    if (const SelectSoftmaxKernel* k = avx512_select_softmax_kernel()) return *k;
    if (const SelectSoftmaxKernel* k = avx2_select_softmax_kernel()) return *k;
    return kPortable;
  }();
  return chosen;
}

}  // namespace sparsa::cpu
