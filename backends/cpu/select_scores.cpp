// TOKEN_SELECT's float64 scoring kernel (see select_scores.h). Three versions, bit-identical by construction: every
// score is 0, then for c = 0, 1, ..., d-1 one multiply q̄[c]·K[c] rounded to float64 and one add rounded to float64,
// then the product with `scale`; only the number of sums in flight differs.
//   portable  one sum at a time;
//   AVX2      4 heads × 2 vectors of 4 keys = 8 sums per pass, 4 passes per 32-key tile;
//   AVX-512   4 heads × 4 vectors of 8 keys = 16 sums per pass over the tile (AVX-512F and BW);
// both with score_tile_exact_products take one FMA per channel and sum instead of a multiply and an add (the same
// bits: the products are exact).
// A sequential sum is a chain of dependent adds, so it runs at one add per add latency; the register blocks keep
// enough chains in flight to fill both the multiply and the add pipes. Keys are transposed once per tile (8×8 fp32
// blocks; the AVX-512 version transposes 16-bit rows as words, 8 keys × 32 channels at a time), and every head block
// of the call reads the same transposed tile.
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
// and warns -Wmaybe-uninitialized (or -Wuninitialized) at every use; the warning is about the header, not this code.
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#pragma GCC diagnostic ignored "-Wuninitialized"
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

// ---- AVX-512: kHeads heads × the whole 32-key tile (4 zmm of 8 keys) per pass ----

constexpr int kZmmDoubles = 8;
constexpr int kZmmVectors = kScoreTileKeys / kZmmDoubles;

// scores[j * score_stride + first_head + h] = scale · acc[h][j / 8] lane j % 8, for keys j < n_keys.
template <int kHeads>
__attribute__((target("avx512f"))) inline void store_head_block(const __m512d (&acc)[kHeads][kZmmVectors],
                                                                int n_keys, double scale, int first_head,
                                                                double* scores, int64_t score_stride) {
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

// One channel of the head block: acc[h][x] += q̄_h[c] · k[x] for 4 vectors of 8 keys. kFused: each multiply and add
// as one FMA, for q̄ whose products with K are exact (score_tile_exact_products): it rounds once, like the add.
template <int kHeads, bool kFused>
__attribute__((target("avx512f"))) inline void accumulate_channel(__m512d (&acc)[kHeads][kZmmVectors],
                                                                  const __m512d (&k)[kZmmVectors],
                                                                  const double* qbars, int32_t d, int32_t c) {
#pragma GCC unroll 4
  for (int h = 0; h < kHeads; ++h) {
    const __m512d q = _mm512_set1_pd(qbars[int64_t(h) * d + c]);
#pragma GCC unroll 4
    for (int x = 0; x < kZmmVectors; ++x) {
      if constexpr (kFused) {
        acc[h][x] = _mm512_fmadd_pd(q, k[x], acc[h][x]);
      } else {
        acc[h][x] = _mm512_add_pd(acc[h][x], _mm512_mul_pd(q, k[x]));
      }
    }
  }
}

template <int kHeads>
__attribute__((target("avx512f"))) inline void zero_accumulators(__m512d (&acc)[kHeads][kZmmVectors]) {
#pragma GCC unroll 4
  for (int h = 0; h < kHeads; ++h)
#pragma GCC unroll 4
    for (int x = 0; x < kZmmVectors; ++x) acc[h][x] = _mm512_setzero_pd();
}

// kHeads heads over a tile transposed to fp32 columns (transpose_keys), widened to float64 as they are read.
template <int kHeads, bool kFused>
__attribute__((target("avx512f"))) void head_block_avx512(const double* qbars, const float* transposed, int n_keys,
                                                          int32_t d, double scale, int first_head, double* scores,
                                                          int64_t score_stride) {
  __m512d acc[kHeads][kZmmVectors];
  zero_accumulators<kHeads>(acc);
  for (int32_t c = 0; c < d; ++c) {
    const float* column = transposed + int64_t(c) * kScoreTileKeys;
    __m512d k[kZmmVectors];
#pragma GCC unroll 4
    for (int x = 0; x < kZmmVectors; ++x) k[x] = _mm512_cvtps_pd(_mm256_loadu_ps(column + x * kZmmDoubles));
    accumulate_channel<kHeads, kFused>(acc, k, qbars, d, c);
  }
  store_head_block<kHeads>(acc, n_keys, scale, first_head, scores, score_stride);
}

// ---- AVX-512BW, 16-bit keys with d % 32 == 0: the rows transposed as the words they are ----
//
// transpose_keys widens the rows to fp32 before its 8×8 transposes: a conversion and three shuffles per 8 elements
// on the vector ports, about as many operations as a group of 4 heads' FMAs. Transposing the 16-bit words as loaded
// moves 32 channels of 8 keys per 24 in-lane unpacks, a quarter of the shuffles per element, and each 8-key column
// is widened to float64 where the head block reads it. (Measured and dropped, Emerald Rapids: widening the whole tile
// to float64 first, 32 KiB of stores per tile and kv head, and AVX512-FP16's one-step fp16-to-float64 conversion;
// both made the flat-softmax row slower than before.)
constexpr int kBlockChannels = 32;                       // one zmm of a 16-bit row
constexpr int kBlockWords = kKeyGroup * kBlockChannels;  // a block of 32 channels of one 8-key group

// 32 channels of 8 keys (blocks[i]: key i's 32 words, any alignment) transposed: on return words[j * 32 + L * 8 + i] is channel
// 8L + j of key i (the order three stages of in-lane unpacks leave: register j's lane L).
__attribute__((target("avx512f,avx512bw"))) inline void transpose_block_words(const unsigned char* const* blocks,
                                                                              uint16_t* words) {
  __m512i r[kKeyGroup], a[kKeyGroup], b[kKeyGroup];
  for (int i = 0; i < kKeyGroup; ++i) r[i] = _mm512_loadu_si512(blocks[i]);
  for (int i = 0; i < kKeyGroup; i += 2) {  // per lane, keys i and i+1: channels 0-3, then 4-7
    a[i] = _mm512_unpacklo_epi16(r[i], r[i + 1]);
    a[i + 1] = _mm512_unpackhi_epi16(r[i], r[i + 1]);
  }
  for (int half = 0; half < 2; ++half) {  // keys 0-3 and 4-7: channels (0-1, 2-3) of half 0, (4-5, 6-7) of half 1
    b[4 * half] = _mm512_unpacklo_epi32(a[half], a[2 + half]);
    b[4 * half + 1] = _mm512_unpackhi_epi32(a[half], a[2 + half]);
    b[4 * half + 2] = _mm512_unpacklo_epi32(a[4 + half], a[6 + half]);
    b[4 * half + 3] = _mm512_unpackhi_epi32(a[4 + half], a[6 + half]);
  }
  for (int p = 0; p < 4; ++p) {  // channels 2p and 2p+1 of all 8 keys: keys 0-3 from b[low], keys 4-7 from b[low + 2]
    const int low = (p / 2) * 4 + p % 2;
    _mm512_storeu_si512(words + (2 * p) * kBlockChannels, _mm512_unpacklo_epi64(b[low], b[low + 2]));
    _mm512_storeu_si512(words + (2 * p + 1) * kBlockChannels, _mm512_unpackhi_epi64(b[low], b[low + 2]));
  }
}

// The tile's rows transposed into words, block by block: (channels c0..c0+31, key group g) at
// (c0 / 32 · kKeyGroups + g) · kBlockWords. Keys past n_keys read as zeros.
__attribute__((target("avx512f,avx512bw"))) void transpose_tile_words(const void* const* keys, int n_keys, int32_t d,
                                                                       uint16_t* words) {
  alignas(64) static constexpr unsigned char kZeroBlock[2 * kBlockChannels] = {};
  for (int32_t c0 = 0; c0 < d; c0 += kBlockChannels)
    for (int g = 0; g < kKeyGroups; ++g) {
      const unsigned char* blocks[kKeyGroup];
      for (int i = 0; i < kKeyGroup; ++i) {
        const int key = g * kKeyGroup + i;
        blocks[i] = key < n_keys ? static_cast<const unsigned char*>(keys[key]) + 2 * int64_t(c0) : kZeroBlock;
      }
      transpose_block_words(blocks, words + (int64_t(c0 / kBlockChannels) * kKeyGroups + g) * kBlockWords);
    }
}

// Where channel c of key group 0 lies in the words (group g: + g · kBlockWords).
inline int64_t word_column(int32_t c) {
  return int64_t(c / kBlockChannels) * kKeyGroups * kBlockWords + (c % kKeyGroup) * kBlockChannels +
         (c % kBlockChannels) / kKeyGroup * kKeyGroup;
}

inline __m128i load_column_words(const uint16_t* words) {
  return _mm_loadu_si128(reinterpret_cast<const __m128i*>(words));
}

// kHeads heads over the words of fp16 (kDtype F16) or bf16 keys, each column widened through fp32.
template <int kHeads, bool kFused, int32_t kDtype>
__attribute__((target("avx512f,f16c"))) void head_block_words(const double* qbars, const uint16_t* words, int n_keys,
                                                              int32_t d, double scale, int first_head, double* scores,
                                                              int64_t score_stride) {
  __m512d acc[kHeads][kZmmVectors];
  zero_accumulators<kHeads>(acc);
  for (int32_t c = 0; c < d; ++c) {
    const uint16_t* column = words + word_column(c);
    __m512d k[kZmmVectors];
#pragma GCC unroll 4
    for (int x = 0; x < kZmmVectors; ++x) {
      const __m128i h = load_column_words(column + x * kBlockWords);
      if constexpr (kDtype == SPARSA_DTYPE_F16) {
        k[x] = _mm512_cvtps_pd(_mm256_cvtph_ps(h));
      } else {
        k[x] = _mm512_cvtps_pd(_mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16)));
      }
    }
    accumulate_channel<kHeads, kFused>(acc, k, qbars, d, c);
  }
  store_head_block<kHeads>(acc, n_keys, scale, first_head, scores, score_stride);
}

// One head block of kHeads heads on the tile as prepared by score_tile_avx512_blocks.
enum class TileForm { kFloats, kF16Words, kBf16Words };
template <int kHeads, bool kFused>
void head_block_on(TileForm form, const double* qbars, const float* scratch, int n_keys, int32_t d, double scale,
                   int first_head, double* scores, int64_t score_stride) {
  const uint16_t* words = reinterpret_cast<const uint16_t*>(scratch);
  switch (form) {
    case TileForm::kFloats:
      head_block_avx512<kHeads, kFused>(qbars, scratch, n_keys, d, scale, first_head, scores, score_stride);
      break;
    case TileForm::kF16Words:
      head_block_words<kHeads, kFused, SPARSA_DTYPE_F16>(qbars, words, n_keys, d, scale, first_head, scores,
                                                         score_stride);
      break;
    case TileForm::kBf16Words:
      head_block_words<kHeads, kFused, SPARSA_DTYPE_BF16>(qbars, words, n_keys, d, scale, first_head, scores,
                                                          score_stride);
      break;
  }
}

template <bool kFused>
void score_tile_avx512_blocks(const double* qbars, int n_heads, const void* const* keys, int32_t dtype, int n_keys,
                              int32_t d, double scale, float* scratch, double* scores, int64_t score_stride) {
  TileForm form = TileForm::kFloats;
  if (d % kBlockChannels != 0 || dtype == SPARSA_DTYPE_F32) {
    transpose_any(keys, dtype, n_keys, d, scratch);
  } else {
    transpose_tile_words(keys, n_keys, d, reinterpret_cast<uint16_t*>(scratch));
    form = dtype == SPARSA_DTYPE_BF16 ? TileForm::kBf16Words : TileForm::kF16Words;
  }
  for (int h = 0; h < n_heads; h += kHeadBlock) {
    const double* q = qbars + int64_t(h) * d;
    switch (std::min(kHeadBlock, n_heads - h)) {
      case 4: head_block_on<4, kFused>(form, q, scratch, n_keys, d, scale, h, scores, score_stride); break;
      case 3: head_block_on<3, kFused>(form, q, scratch, n_keys, d, scale, h, scores, score_stride); break;
      case 2: head_block_on<2, kFused>(form, q, scratch, n_keys, d, scale, h, scores, score_stride); break;
      default: head_block_on<1, kFused>(form, q, scratch, n_keys, d, scale, h, scores, score_stride); break;
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

// kFused: as accumulate_channel's.
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
constexpr SelectScoreKernel kAvx512 = {score_tile_avx512, score_tile_avx512_exact_products, "avx512bw"};

bool has_avx2() { return cpu_features().avx2 && cpu_features().fma && cpu_features().f16c; }
bool has_avx512bw() { return has_avx2() && cpu_features().avx512f && cpu_features().avx512bw; }

#endif

}  // namespace

const SelectScoreKernel& portable_select_score_kernel() { return kPortable; }

#if defined(__x86_64__) && !defined(SPARSA_CPU_PORTABLE_KERNELS)
const SelectScoreKernel* avx2_select_score_kernel() { return has_avx2() ? &kAvx2 : nullptr; }
const SelectScoreKernel* avx512_select_score_kernel() { return has_avx512bw() ? &kAvx512 : nullptr; }
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
