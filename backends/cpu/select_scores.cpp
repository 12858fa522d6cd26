// TOKEN_SELECT's float64 scoring kernel (see select_scores.h). Three versions, bit-identical by construction: every
// score is 0, then for c = 0, 1, ..., d-1 one multiply q̄[c]·K[c] rounded to float64 and one add rounded to float64,
// then the product with `scale`; only the number of sums in flight differs.
//   portable  one sum at a time;
//   AVX2      4 heads × 2 vectors of 4 keys = 8 sums per pass, 4 passes per 32-key tile;
//   AVX-512F  4 heads × 4 vectors of 8 keys = 16 sums per pass over the tile;
// both with score_tile_exact_products take one FMA per channel and sum instead of a multiply and an add (the same
// bits: the products are exact).
// A sequential sum is a chain of dependent adds, so it runs at one add per add latency; the register blocks keep
// enough chains in flight to fill both the multiply and the add pipes. Keys are transposed once per tile (8×8 fp32
// blocks), and every head block of the call reads the same transposed tile.
// This file is compiled with -ffp-contract=off (CMakeLists.txt): GCC enables FMA with "avx512f" and would otherwise
// fuse _mm512_mul_pd + _mm512_add_pd into one differently rounded FMA.
#include "select_scores.h"
#include "cpu_features.h"

#include <sparsa/sparsa.h>

#include <algorithm>
#include <cstring>

#if defined(__x86_64__)
#include <immintrin.h>
// GCC 12's avx512fintrin.h starts some intrinsics (unpacks, lane shuffles, conversions) from an undefined register
// and warns -Wmaybe-uninitialized at every use; the warning is about the header, not this code.
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#endif
#endif

namespace sparsa::cpu {
namespace {

uint16_t load_u16(const unsigned char* p) {
  uint16_t h;
  std::memcpy(&h, p, sizeof h);
  return h;
}
float bits_to_float(uint32_t bits) {
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}
float f16_bits_to_float(uint16_t h) {  // exact, as cpu_convert.h's f16_to_float (this file stands alone)
  const uint32_t sign = uint32_t(h & 0x8000u) << 16;
  const uint32_t exponent = (h >> 10) & 0x1fu;
  uint32_t mantissa = h & 0x3ffu;
  if (exponent == 0x1fu) return bits_to_float(sign | 0x7f800000u | (mantissa << 13));  // inf / NaN
  if (exponent != 0) return bits_to_float(sign | ((exponent + 112u) << 23) | (mantissa << 13));
  if (mantissa == 0) return bits_to_float(sign);
  int shift = 0;  // subnormal: mantissa · 2^-24
  while ((mantissa & 0x400u) == 0) {
    mantissa <<= 1;
    ++shift;
  }
  return bits_to_float(sign | (uint32_t(113 - shift) << 23) | ((mantissa & 0x3ffu) << 13));
}

// Element c of a row of `dtype`, widened to fp32 (exact).
float element(const void* row, int32_t dtype, int64_t c) {
  const unsigned char* p = static_cast<const unsigned char*>(row);
  if (dtype == SPARSA_DTYPE_F16) return f16_bits_to_float(load_u16(p + 2 * c));
  if (dtype == SPARSA_DTYPE_BF16) return bits_to_float(uint32_t(load_u16(p + 2 * c)) << 16);
  float f;
  std::memcpy(&f, p + 4 * c, sizeof f);
  return f;
}

void score_tile_portable(const double* qbars, int n_heads, const void* const* keys, int32_t dtype, int n_keys,
                         int32_t d, double scale, float*, double* scores, int64_t score_stride) {
  for (int j = 0; j < n_keys; ++j) {
    for (int l = 0; l < n_heads; ++l) {
      const double* q = qbars + int64_t(l) * d;
      double sum = 0.0;
      for (int32_t c = 0; c < d; ++c) sum += q[c] * double(element(keys[j], dtype, c));
      scores[j * score_stride + l] = scale * sum;
    }
  }
}

constexpr SelectScoreKernel kPortable = {score_tile_portable, score_tile_portable, "portable"};

#if defined(__x86_64__) && !defined(SPARSA_CPU_PORTABLE_KERNELS)

constexpr int kHeadBlock = 4;  // query heads per register block
constexpr int kKeyGroup = 8;   // keys per transposed group (one 8×8 fp32 transpose wide)
constexpr int kKeyGroups = kScoreTileKeys / kKeyGroup;

// Eight values of a row from element c, widened to fp32.
template <int32_t kDtype>
__attribute__((target("avx2,f16c"))) inline __m256 load8(const void* row, int64_t c) {
  const unsigned char* p = static_cast<const unsigned char*>(row);
  if constexpr (kDtype == SPARSA_DTYPE_F16) {
    return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 2 * c)));
  } else if constexpr (kDtype == SPARSA_DTYPE_BF16) {
    const __m256i h = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 2 * c)));
    return _mm256_castsi256_ps(_mm256_slli_epi32(h, 16));
  } else {
    return _mm256_loadu_ps(reinterpret_cast<const float*>(p + 4 * c));
  }
}

// transposed[c * kScoreTileKeys + j] = K_j[c] for j < n_keys, 0 for n_keys <= j < kScoreTileKeys: rows widened and
// transposed in 8×8 blocks straight from the cache.
template <int32_t kDtype>
__attribute__((target("avx2,f16c"))) void transpose_keys(const void* const* keys, int n_keys, int32_t d,
                                                         float* transposed) {
  for (int group = 0; group < kKeyGroups; ++group) {
    const int first = group * kKeyGroup;
    const int in_group = std::clamp(n_keys - first, 0, kKeyGroup);
    int32_t c0 = 0;
    if (in_group == kKeyGroup) {
      const void* const* rows = keys + first;
      for (; c0 + kKeyGroup <= d; c0 += kKeyGroup) {
        __m256 r[kKeyGroup];
        for (int i = 0; i < kKeyGroup; ++i) r[i] = load8<kDtype>(rows[i], c0);
        const __m256 t0 = _mm256_unpacklo_ps(r[0], r[1]), t1 = _mm256_unpackhi_ps(r[0], r[1]);
        const __m256 t2 = _mm256_unpacklo_ps(r[2], r[3]), t3 = _mm256_unpackhi_ps(r[2], r[3]);
        const __m256 t4 = _mm256_unpacklo_ps(r[4], r[5]), t5 = _mm256_unpackhi_ps(r[4], r[5]);
        const __m256 t6 = _mm256_unpacklo_ps(r[6], r[7]), t7 = _mm256_unpackhi_ps(r[6], r[7]);
        constexpr int kLow = _MM_SHUFFLE(1, 0, 1, 0), kHigh = _MM_SHUFFLE(3, 2, 3, 2);
        const __m256 u0 = _mm256_shuffle_ps(t0, t2, kLow), u1 = _mm256_shuffle_ps(t0, t2, kHigh);
        const __m256 u2 = _mm256_shuffle_ps(t1, t3, kLow), u3 = _mm256_shuffle_ps(t1, t3, kHigh);
        const __m256 u4 = _mm256_shuffle_ps(t4, t6, kLow), u5 = _mm256_shuffle_ps(t4, t6, kHigh);
        const __m256 u6 = _mm256_shuffle_ps(t5, t7, kLow), u7 = _mm256_shuffle_ps(t5, t7, kHigh);
        constexpr int kLowHalves = 0x20, kHighHalves = 0x31;
        const __m256 columns[kKeyGroup] = {
            _mm256_permute2f128_ps(u0, u4, kLowHalves),  _mm256_permute2f128_ps(u1, u5, kLowHalves),
            _mm256_permute2f128_ps(u2, u6, kLowHalves),  _mm256_permute2f128_ps(u3, u7, kLowHalves),
            _mm256_permute2f128_ps(u0, u4, kHighHalves), _mm256_permute2f128_ps(u1, u5, kHighHalves),
            _mm256_permute2f128_ps(u2, u6, kHighHalves), _mm256_permute2f128_ps(u3, u7, kHighHalves)};
        for (int i = 0; i < kKeyGroup; ++i)
          _mm256_storeu_ps(transposed + int64_t(c0 + i) * kScoreTileKeys + first, columns[i]);
      }
    }
    for (int32_t c = c0; c < d; ++c)
      for (int i = 0; i < kKeyGroup; ++i)
        transposed[int64_t(c) * kScoreTileKeys + first + i] = i < in_group ? element(keys[first + i], kDtype, c) : 0.f;
  }
}

void transpose_any(const void* const* keys, int32_t dtype, int n_keys, int32_t d, float* transposed) {
  if (dtype == SPARSA_DTYPE_F16) {
    transpose_keys<SPARSA_DTYPE_F16>(keys, n_keys, d, transposed);
  } else if (dtype == SPARSA_DTYPE_BF16) {
    transpose_keys<SPARSA_DTYPE_BF16>(keys, n_keys, d, transposed);
  } else {
    transpose_keys<SPARSA_DTYPE_F32>(keys, n_keys, d, transposed);
  }
}

// Writes lanes [0, n) of `values` (keys first_key, first_key + 1, ...) of head `head` into scores.
inline void store_lanes(const double* values, int n, int first_key, int head, double* scores, int64_t score_stride) {
  for (int i = 0; i < n; ++i) scores[(first_key + i) * score_stride + head] = values[i];
}

// ---- AVX-512F: kHeads heads × the whole 32-key tile (4 zmm of 8 keys) per pass ----

constexpr int kZmmDoubles = 8;
constexpr int kZmmVectors = kScoreTileKeys / kZmmDoubles;

// kFused: each multiply and add as one FMA, for q̄ whose products with K are exact (score_tile_exact_products).
template <int kHeads, bool kFused>
__attribute__((target("avx512f"))) void head_block_avx512(const double* qbars, const float* transposed, int n_keys,
                                                          int32_t d, double scale, int first_head, double* scores,
                                                          int64_t score_stride) {
  __m512d acc[kHeads][kZmmVectors];
#pragma GCC unroll 4
  for (int h = 0; h < kHeads; ++h)
#pragma GCC unroll 4
    for (int x = 0; x < kZmmVectors; ++x) acc[h][x] = _mm512_setzero_pd();
  for (int32_t c = 0; c < d; ++c) {
    const float* column = transposed + int64_t(c) * kScoreTileKeys;
    __m512d k[kZmmVectors];
#pragma GCC unroll 4
    for (int x = 0; x < kZmmVectors; ++x) k[x] = _mm512_cvtps_pd(_mm256_loadu_ps(column + x * kZmmDoubles));
#pragma GCC unroll 4
    for (int h = 0; h < kHeads; ++h) {
      const __m512d q = _mm512_set1_pd(qbars[int64_t(h) * d + c]);
#pragma GCC unroll 4
      for (int x = 0; x < kZmmVectors; ++x) {
        if constexpr (kFused) {
          acc[h][x] = _mm512_fmadd_pd(q, k[x], acc[h][x]);  // rounds once, like the add: the product is exact
        } else {
          acc[h][x] = _mm512_add_pd(acc[h][x], _mm512_mul_pd(q, k[x]));
        }
      }
    }
  }
  const __m512d factor = _mm512_set1_pd(scale);
  if constexpr (kHeads == 4) {
    if (n_keys == kScoreTileKeys && score_stride == kHeads) {
      // Scores rows of exactly these 4 heads, [key][4]: transpose each 4 heads × 8 keys block in registers and store
      // it as 4 vectors of 2 keys instead of 32 single doubles.
      const __m512i pairs_low = _mm512_set_epi64(11, 10, 3, 2, 9, 8, 1, 0);    // [a.l0, b.l0, a.l1, b.l1]
      const __m512i pairs_high = _mm512_set_epi64(15, 14, 7, 6, 13, 12, 5, 4);  // [a.l2, b.l2, a.l3, b.l3]
      const __m512i halves_low = _mm512_set_epi64(11, 10, 9, 8, 3, 2, 1, 0);
      const __m512i halves_high = _mm512_set_epi64(15, 14, 13, 12, 7, 6, 5, 4);
      double* out = scores + int64_t(first_head);
      for (int x = 0; x < kZmmVectors; ++x) {
        const __m512d h0 = _mm512_mul_pd(factor, acc[0][x]), h1 = _mm512_mul_pd(factor, acc[1][x]);
        const __m512d h2 = _mm512_mul_pd(factor, acc[2][x]), h3 = _mm512_mul_pd(factor, acc[3][x]);
        // Per 128-bit lane, heads 0-1 (and 2-3) of the even keys 0, 2, 4, 6 and of the odd keys 1, 3, 5, 7.
        const __m512d even01 = _mm512_unpacklo_pd(h0, h1), odd01 = _mm512_unpackhi_pd(h0, h1);
        const __m512d even23 = _mm512_unpacklo_pd(h2, h3), odd23 = _mm512_unpackhi_pd(h2, h3);
        const __m512d keys02 = _mm512_permutex2var_pd(even01, pairs_low, even23);   // keys 0, 2: heads 0-3
        const __m512d keys46 = _mm512_permutex2var_pd(even01, pairs_high, even23);  // keys 4, 6
        const __m512d keys13 = _mm512_permutex2var_pd(odd01, pairs_low, odd23);     // keys 1, 3
        const __m512d keys57 = _mm512_permutex2var_pd(odd01, pairs_high, odd23);    // keys 5, 7
        double* block = out + int64_t(x) * kZmmDoubles * kHeads;
        _mm512_storeu_pd(block, _mm512_permutex2var_pd(keys02, halves_low, keys13));        // keys 0, 1
        _mm512_storeu_pd(block + 8, _mm512_permutex2var_pd(keys02, halves_high, keys13));   // keys 2, 3
        _mm512_storeu_pd(block + 16, _mm512_permutex2var_pd(keys46, halves_low, keys57));   // keys 4, 5
        _mm512_storeu_pd(block + 24, _mm512_permutex2var_pd(keys46, halves_high, keys57));  // keys 6, 7
      }
      return;
    }
  }
  for (int h = 0; h < kHeads; ++h)
    for (int x = 0; x < kZmmVectors; ++x) {
      const int first_key = x * kZmmDoubles;
      if (first_key >= n_keys) break;
      alignas(64) double lanes[kZmmDoubles];
      _mm512_store_pd(lanes, _mm512_mul_pd(factor, acc[h][x]));
      store_lanes(lanes, std::min(kZmmDoubles, n_keys - first_key), first_key, first_head + h, scores, score_stride);
    }
}

template <bool kFused>
__attribute__((target("avx512f"))) void score_tile_avx512_blocks(const double* qbars, int n_heads,
                                                                 const void* const* keys, int32_t dtype, int n_keys,
                                                                 int32_t d, double scale, float* transposed,
                                                                 double* scores, int64_t score_stride) {
  transpose_any(keys, dtype, n_keys, d, transposed);
  for (int h = 0; h < n_heads; h += kHeadBlock) {
    const double* q = qbars + int64_t(h) * d;
    switch (std::min(kHeadBlock, n_heads - h)) {
      case 4: head_block_avx512<4, kFused>(q, transposed, n_keys, d, scale, h, scores, score_stride); break;
      case 3: head_block_avx512<3, kFused>(q, transposed, n_keys, d, scale, h, scores, score_stride); break;
      case 2: head_block_avx512<2, kFused>(q, transposed, n_keys, d, scale, h, scores, score_stride); break;
      default: head_block_avx512<1, kFused>(q, transposed, n_keys, d, scale, h, scores, score_stride); break;
    }
  }
}

void score_tile_avx512(const double* qbars, int n_heads, const void* const* keys, int32_t dtype, int n_keys,
                       int32_t d, double scale, float* transposed, double* scores, int64_t score_stride) {
  score_tile_avx512_blocks<false>(qbars, n_heads, keys, dtype, n_keys, d, scale, transposed, scores, score_stride);
}

void score_tile_avx512_exact_products(const double* qbars, int n_heads, const void* const* keys, int32_t dtype,
                                      int n_keys, int32_t d, double scale, float* transposed, double* scores,
                                      int64_t score_stride) {
  score_tile_avx512_blocks<true>(qbars, n_heads, keys, dtype, n_keys, d, scale, transposed, scores, score_stride);
}

// ---- AVX2: kHeads heads × 8 keys (2 ymm of 4 keys) per pass, one pass per 8-key group ----

constexpr int kYmmDoubles = 4;
constexpr int kYmmVectors = kKeyGroup / kYmmDoubles;

// kFused: as head_block_avx512's.
template <int kHeads, bool kFused>
__attribute__((target("avx2,fma"))) void head_block_avx2(const double* qbars, const float* transposed, int n_keys,
                                                         int32_t d, double scale, int first_head, double* scores,
                                                         int64_t score_stride) {
  for (int first_key = 0; first_key < n_keys; first_key += kKeyGroup) {
    __m256d acc[kHeads][kYmmVectors];
#pragma GCC unroll 4
    for (int h = 0; h < kHeads; ++h)
#pragma GCC unroll 2
      for (int x = 0; x < kYmmVectors; ++x) acc[h][x] = _mm256_setzero_pd();
    for (int32_t c = 0; c < d; ++c) {
      const float* column = transposed + int64_t(c) * kScoreTileKeys + first_key;
      __m256d k[kYmmVectors];
#pragma GCC unroll 2
      for (int x = 0; x < kYmmVectors; ++x) k[x] = _mm256_cvtps_pd(_mm_loadu_ps(column + x * kYmmDoubles));
#pragma GCC unroll 4
      for (int h = 0; h < kHeads; ++h) {
        const __m256d q = _mm256_set1_pd(qbars[int64_t(h) * d + c]);
#pragma GCC unroll 2
        for (int x = 0; x < kYmmVectors; ++x) {
          if constexpr (kFused) {
            acc[h][x] = _mm256_fmadd_pd(q, k[x], acc[h][x]);  // rounds once, like the add: the product is exact
          } else {
            acc[h][x] = _mm256_add_pd(acc[h][x], _mm256_mul_pd(q, k[x]));
          }
        }
      }
    }
    const __m256d factor = _mm256_set1_pd(scale);
    for (int h = 0; h < kHeads; ++h)
      for (int x = 0; x < kYmmVectors; ++x) {
        const int key = first_key + x * kYmmDoubles;
        if (key >= n_keys) break;
        alignas(32) double lanes[kYmmDoubles];
        _mm256_store_pd(lanes, _mm256_mul_pd(factor, acc[h][x]));
        store_lanes(lanes, std::min(kYmmDoubles, n_keys - key), key, first_head + h, scores, score_stride);
      }
  }
}

template <bool kFused>
void score_tile_avx2_blocks(const double* qbars, int n_heads, const void* const* keys, int32_t dtype, int n_keys,
                            int32_t d, double scale, float* transposed, double* scores, int64_t score_stride) {
  transpose_any(keys, dtype, n_keys, d, transposed);
  for (int h = 0; h < n_heads; h += kHeadBlock) {
    const double* q = qbars + int64_t(h) * d;
    switch (std::min(kHeadBlock, n_heads - h)) {
      case 4: head_block_avx2<4, kFused>(q, transposed, n_keys, d, scale, h, scores, score_stride); break;
      case 3: head_block_avx2<3, kFused>(q, transposed, n_keys, d, scale, h, scores, score_stride); break;
      case 2: head_block_avx2<2, kFused>(q, transposed, n_keys, d, scale, h, scores, score_stride); break;
      default: head_block_avx2<1, kFused>(q, transposed, n_keys, d, scale, h, scores, score_stride); break;
    }
  }
}

void score_tile_avx2(const double* qbars, int n_heads, const void* const* keys, int32_t dtype, int n_keys, int32_t d,
                     double scale, float* transposed, double* scores, int64_t score_stride) {
  score_tile_avx2_blocks<false>(qbars, n_heads, keys, dtype, n_keys, d, scale, transposed, scores, score_stride);
}

void score_tile_avx2_exact_products(const double* qbars, int n_heads, const void* const* keys, int32_t dtype,
                                    int n_keys, int32_t d, double scale, float* transposed, double* scores,
                                    int64_t score_stride) {
  score_tile_avx2_blocks<true>(qbars, n_heads, keys, dtype, n_keys, d, scale, transposed, scores, score_stride);
}

constexpr SelectScoreKernel kAvx2 = {score_tile_avx2, score_tile_avx2_exact_products, "avx2"};
constexpr SelectScoreKernel kAvx512 = {score_tile_avx512, score_tile_avx512_exact_products, "avx512f"};

bool has_avx2() { return cpu_features().avx2 && cpu_features().fma && cpu_features().f16c; }
bool has_avx512f() { return has_avx2() && cpu_features().avx512f; }

#endif

}  // namespace

const SelectScoreKernel& portable_select_score_kernel() { return kPortable; }

#if defined(__x86_64__) && !defined(SPARSA_CPU_PORTABLE_KERNELS)
const SelectScoreKernel* avx2_select_score_kernel() { return has_avx2() ? &kAvx2 : nullptr; }
const SelectScoreKernel* avx512_select_score_kernel() { return has_avx512f() ? &kAvx512 : nullptr; }
#else
const SelectScoreKernel* avx2_select_score_kernel() { return nullptr; }
const SelectScoreKernel* avx512_select_score_kernel() { return nullptr; }
#endif

const SelectScoreKernel& select_score_kernel() {
  static const SelectScoreKernel& chosen = []() -> const SelectScoreKernel& {  // a CPU property: chosen once
    if (const SelectScoreKernel* k = avx512_select_score_kernel()) return *k;
    if (const SelectScoreKernel* k = avx2_select_score_kernel()) return *k;
    return kPortable;
  }();
  return chosen;
}

}  // namespace sparsa::cpu
