// AVX2 + FMA + F16C dense decode kernels (see decode_kernels.h): the AVX-512F kernels' walk for CPUs without AVX-512.
// With 16 ymm registers a row of d = 8·kChunks values does not fit in registers as it does in zmm, so the loops run
// chunk by chunk instead: each 8-value chunk of a K row is widened once (vcvtph2ps, or zero-extend + shift for bf16)
// and feeds up to kHeadBlock query rows' FMA chains (two keys at a time where the group is a multiple of kHeadBlock,
// one chain per score; else key by key, two chains per row); each chunk of a V row is widened once and added into the
// output row slice of every head with a nonzero probability.
// Only functions with the avx2/fma/f16c target attribute touch those instructions, and avx2_decode_kernels() hands them
// out only on a CPU that has them.
#include "cpu_features.h"
#include "decode_kernel_table.h"
#include "decode_kernels.h"
#include "decode_magnitudes.h"

#include <sparsa/sparsa.h>

#include <algorithm>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

namespace sparsa::cpu {

#if defined(__x86_64__)
namespace {

constexpr int kLanes = 8;          // floats per ymm
constexpr int kHeadBlock = 4;      // query rows per pass over a K row: 8 accumulators, a K chunk, a q chunk
constexpr int kMaxHeadList = 16;   // heads per list of nonzero probabilities (a whole group up to kMaxStackedRows)

template <int32_t kDtype>
__attribute__((target("avx2,f16c"))) inline __m256 widen8(const unsigned char* p) {
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  if constexpr (kDtype == SPARSA_DTYPE_F16) {
    return _mm256_cvtph_ps(h);
  } else {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
  }
}

__attribute__((target("avx2"))) inline float horizontal_sum(__m256 x) {
  __m128 four = _mm_add_ps(_mm256_castps256_ps128(x), _mm256_extractf128_ps(x, 1));
  four = _mm_add_ps(four, _mm_movehl_ps(four, four));
  four = _mm_add_ss(four, _mm_shuffle_ps(four, four, 1));
  return _mm_cvtss_f32(four);
}

// st_row[h] = q_h · K_row for kHeads consecutive query heads starting at h (q rows of kChunks·8 floats).
template <int32_t kDtype, int kChunks, int kHeads>
__attribute__((target("avx2,fma,f16c"))) inline void score_heads(const unsigned char* k_row, const float* q, int h,
                                                                 float* st_row) {
  constexpr int kBytes = 2 * kLanes;  // bytes of 8 values
  const float* q_rows = q + int64_t(h) * kChunks * kLanes;
  __m256 even[kHeads], odd[kHeads];
#pragma GCC unroll 4
  for (int l = 0; l < kHeads; ++l) even[l] = odd[l] = _mm256_setzero_ps();
#pragma GCC unroll 32
  for (int x = 0; x < kChunks; x += 2) {
    const __m256 k_even = widen8<kDtype>(k_row + x * kBytes);
    const __m256 k_odd = widen8<kDtype>(k_row + (x + 1) * kBytes);
#pragma GCC unroll 4
    for (int l = 0; l < kHeads; ++l) {
      const float* q_row = q_rows + int64_t(l) * kChunks * kLanes;
      even[l] = _mm256_fmadd_ps(_mm256_loadu_ps(q_row + x * kLanes), k_even, even[l]);
      odd[l] = _mm256_fmadd_ps(_mm256_loadu_ps(q_row + (x + 1) * kLanes), k_odd, odd[l]);
    }
  }
#pragma GCC unroll 4
  for (int l = 0; l < kHeads; ++l) st_row[h + l] = horizontal_sum(_mm256_add_ps(even[l], odd[l]));
}

// The kernels, as DecodeKernelTable (decode_kernel_table.h) reads them.
struct Avx2 {
  static constexpr int kLanes = sparsa::cpu::kLanes;
  static constexpr const char* kName = "avx2";

  // Where the group is a multiple of kHeadBlock, pairs of keys (score_key_pair); else, and for a tile's last key of
  // an odd count, key by key. With tile.k_magnitudes each kv head's largest magnitude is kept from its rows as they
  // are scored, while they are in L1.
  template <int32_t kDtype, int kChunks>
  __attribute__((target("avx2,fma,f16c"))) static void scores(const DecodeTile& tile, const float* q, float* st,
                                                            int st_stride) {
    constexpr int kRowValues = kChunks * kLanes;
    const bool kept = tile.k_magnitudes && tile.n_kv_heads <= kMaxMagnitudeHeads;
    __m256i magnitudes[kMaxMagnitudeHeads];
    if (kept)
      for (int hk = 0; hk < tile.n_kv_heads; ++hk) magnitudes[hk] = _mm256_setzero_si256();
    int j = 0;
    if (tile.group % kHeadBlock == 0) {
      if (kept) {
        for (; j + 2 <= tile.nk; j += 2) score_key_pair<kDtype, kChunks, true>(tile, q, st, st_stride, j, magnitudes);
      } else {
        for (; j + 2 <= tile.nk; j += 2) score_key_pair<kDtype, kChunks, false>(tile, q, st, st_stride, j, nullptr);
      }
    }
    for (; j < tile.nk; ++j) {
      prefetch_for_key(tile, j);
      float* st_row = st + int64_t(j) * st_stride;
      for (int hk = 0; hk < tile.n_kv_heads; ++hk) {
        const unsigned char* k_row = tile.k_rows[j] + hk * tile.k_head_bytes;
        const int first = hk * tile.group, end = first + tile.group;
        int h = first;
        for (; h + kHeadBlock <= end; h += kHeadBlock) score_heads<kDtype, kChunks, kHeadBlock>(k_row, q, h, st_row);
        if (end - h >= 2) {
          score_heads<kDtype, kChunks, 2>(k_row, q, h, st_row);
          h += 2;
        }
        if (h < end) score_heads<kDtype, kChunks, 1>(k_row, q, h, st_row);
        if (kept) magnitudes[hk] = row_magnitudes<kRowValues>(k_row, magnitudes[hk]);
      }
    }
    if (kept) {
      for (int hk = 0; hk < tile.n_kv_heads; ++hk) store_magnitude(magnitudes[hk], &tile.k_magnitudes[hk]);
    } else if (tile.k_magnitudes) {
      max_tile_magnitudes<kRowValues>(tile);
    }
  }

  // Two keys at a time where every head of a block has a nonzero probability for both: their broadcasts stay in
  // registers across the row's chunks and each output chunk is loaded and stored once per pair instead of once per
  // key. Per output element the FMAs still run key by key in order, so the bits are those of one key at a time.
  template <int32_t kDtype, int kChunks>
  __attribute__((target("avx2,fma,f16c"))) static void accumulate(const DecodeTile& tile, const float* st,
                                                                int st_stride, float* o) {
    if (tile.rows_ahead) {
      accumulate_keys<kDtype, kChunks, true>(tile, st, st_stride, o);
    } else {
      accumulate_keys<kDtype, kChunks, false>(tile, st, st_stride, o);
    }
  }

 private:
  // Keys j and j + 1, every kv head, in blocks of kHeadBlock heads: the block's 8 scores are 8 accumulators (one FMA
  // chain each, channel chunks in order), each q chunk loaded once for both keys, reduced together by one
  // horizontal-add tree. Key by key with two chains and a horizontal sum per score, the H200 host's Xeon took 32-37 ns
  // per key and kv head over 64 MiB of K (GQA 32/8, D = 128), 20-22 this way with K fetched ahead (a stand-alone loop,
  // 2026-11-30).
  // kMagnitudes: magnitudes[hk] keeps kv head hk's largest magnitude bits, from the two rows after their scores (in
  // the FMA loop, with the 8 sums, 2 keys, a q chunk and the bits in the 16 ymm registers, the running maximum and its
  // mask spilled to the stack).
  template <int32_t kDtype, int kChunks, bool kMagnitudes>
  __attribute__((target("avx2,fma,f16c"))) static void score_key_pair(const DecodeTile& tile, const float* q,
                                                                    float* st, int st_stride, int j,
                                                                    __m256i* magnitudes) {
    constexpr int kBytes = 2 * kLanes;  // bytes of 8 values
    constexpr int kRowFloats = kChunks * kLanes;
    float* st_first = st + int64_t(j) * st_stride;
    for (int hk = 0; hk < tile.n_kv_heads; ++hk) {
      prefetch_for_block_head(tile, j, 2, hk);
      const unsigned char* row0 = tile.k_rows[j] + hk * tile.k_head_bytes;
      const unsigned char* row1 = tile.k_rows[j + 1] + hk * tile.k_head_bytes;
      for (int h = hk * tile.group; h < (hk + 1) * tile.group; h += kHeadBlock) {
        const float* q_block = q + int64_t(h) * kRowFloats;
        __m256 sums[2 * kHeadBlock];  // key t, head l: sums[t · kHeadBlock + l]
#pragma GCC unroll 32
        for (int x = 0; x < kChunks; ++x) {
          const __m256 key0 = widen8<kDtype>(row0 + x * kBytes), key1 = widen8<kDtype>(row1 + x * kBytes);
#pragma GCC unroll 4
          for (int l = 0; l < kHeadBlock; ++l) {
            const __m256 q_chunk = _mm256_loadu_ps(q_block + l * kRowFloats + x * kLanes);
            sums[l] = x == 0 ? _mm256_mul_ps(q_chunk, key0) : _mm256_fmadd_ps(q_chunk, key0, sums[l]);
            sums[kHeadBlock + l] =
                x == 0 ? _mm256_mul_ps(q_chunk, key1) : _mm256_fmadd_ps(q_chunk, key1, sums[kHeadBlock + l]);
          }
        }
        const __m256 scores = reduce8(sums);
        _mm_storeu_ps(st_first + h, _mm256_castps256_ps128(scores));
        _mm_storeu_ps(st_first + st_stride + h, _mm256_extractf128_ps(scores, 1));
      }
      if constexpr (kMagnitudes)
        magnitudes[hk] = row_magnitudes<kRowFloats>(row1, row_magnitudes<kRowFloats>(row0, magnitudes[hk]));
    }
  }

  // Lane i: the sum of v[i]'s lanes.
  __attribute__((target("avx2"))) static __m256 reduce8(const __m256* v) {
    const __m256 pairs01 = _mm256_hadd_ps(v[0], v[1]), pairs23 = _mm256_hadd_ps(v[2], v[3]);
    const __m256 pairs45 = _mm256_hadd_ps(v[4], v[5]), pairs67 = _mm256_hadd_ps(v[6], v[7]);
    const __m256 low = _mm256_hadd_ps(pairs01, pairs23), high = _mm256_hadd_ps(pairs45, pairs67);
    return _mm256_add_ps(_mm256_permute2f128_ps(low, high, 0x20), _mm256_permute2f128_ps(low, high, 0x31));
  }

  static constexpr int kPairHeads = 4;  // 8 broadcasts + 2 V chunks + the output chunk in the 16 ymm registers

  // kFetchAhead: tile.rows_ahead is set (a version of its own, so that dense decode's P·V is the loop it was).
  template <int32_t kDtype, int kChunks, bool kFetchAhead>
  __attribute__((target("avx2,fma,f16c"))) static void accumulate_keys(const DecodeTile& tile, const float* st,
                                                                     int st_stride, float* o) {
    int j = 0;
    for (; j + 2 <= tile.nk; j += 2) {
      const float* p0 = st + int64_t(j) * st_stride;
      const float* p1 = p0 + st_stride;
      for (int hk = 0; hk < tile.n_kv_heads; ++hk) {
        const unsigned char* v0 = tile.v_rows[j] + hk * tile.v_head_bytes;
        const unsigned char* v1 = tile.v_rows[j + 1] + hk * tile.v_head_bytes;
        if constexpr (kFetchAhead) {
          prefetch_row_ahead(tile, j, hk);
          prefetch_row_ahead(tile, j + 1, hk);
        }
        const int first = hk * tile.group, end = first + tile.group;
        for (int h = first; h < end; h += kPairHeads) {
          const int n = std::min(kPairHeads, end - h);
          bool all_nonzero = true;
          for (int l = 0; l < n; ++l) all_nonzero &= p0[h + l] != 0.f && p1[h + l] != 0.f;
          if (all_nonzero && n == kPairHeads) {
            accumulate_pair<kDtype, kChunks, kPairHeads>(v0, v1, p0 + h, p1 + h, o + int64_t(h) * kChunks * kLanes);
          } else {
            accumulate_key<kDtype, kChunks>(v0, p0, h, h + n, o);
            accumulate_key<kDtype, kChunks>(v1, p1, h, h + n, o);
          }
        }
      }
    }
    for (; j < tile.nk; ++j) {
      const float* p = st + int64_t(j) * st_stride;
      for (int hk = 0; hk < tile.n_kv_heads; ++hk) {
        if constexpr (kFetchAhead) prefetch_row_ahead(tile, j, hk);
        accumulate_key<kDtype, kChunks>(tile.v_rows[j] + hk * tile.v_head_bytes, p, hk * tile.group,
                                        (hk + 1) * tile.group, o);
      }
    }
  }

  template <int32_t kDtype, int kChunks, int kHeads>
  __attribute__((target("avx2,fma,f16c"))) static void accumulate_pair(const unsigned char* v0,
                                                                     const unsigned char* v1, const float* p0,
                                                                     const float* p1, float* o) {
    constexpr int kBytes = 2 * kLanes;
    constexpr int kRowFloats = kChunks * kLanes;
    __m256 w0[kHeads], w1[kHeads];
#pragma GCC unroll 4
    for (int l = 0; l < kHeads; ++l) {
      w0[l] = _mm256_broadcast_ss(p0 + l);
      w1[l] = _mm256_broadcast_ss(p1 + l);
    }
#pragma GCC unroll 32
    for (int x = 0; x < kChunks; ++x) {
      const __m256 a = widen8<kDtype>(v0 + x * kBytes);
      const __m256 b = widen8<kDtype>(v1 + x * kBytes);
#pragma GCC unroll 4
      for (int l = 0; l < kHeads; ++l) {
        float* o_chunk = o + int64_t(l) * kRowFloats + x * kLanes;
        _mm256_storeu_ps(o_chunk, _mm256_fmadd_ps(w1[l], b, _mm256_fmadd_ps(w0[l], a, _mm256_loadu_ps(o_chunk))));
      }
    }
  }

  // One key's V row into the heads [h_begin, h_end) with a nonzero probability (a zero one adds nothing, and 0·inf
  // would be NaN).
  template <int32_t kDtype, int kChunks>
  __attribute__((target("avx2,fma,f16c"))) static void accumulate_key(const unsigned char* v_row, const float* p,
                                                                    int h_begin, int h_end, float* o) {
    constexpr int kBytes = 2 * kLanes;
    constexpr int kRowFloats = kChunks * kLanes;
    for (int l0 = h_begin; l0 < h_end; l0 += kMaxHeadList) {
      int heads[kMaxHeadList];
      int n_heads = 0;
      for (int l = l0; l < std::min(h_end, l0 + kMaxHeadList); ++l)
        if (p[l] != 0.f) heads[n_heads++] = l;
      if (n_heads == 0) continue;
#pragma GCC unroll 32
      for (int x = 0; x < kChunks; ++x) {
        const __m256 v = widen8<kDtype>(v_row + x * kBytes);
        for (int i = 0; i < n_heads; ++i) {
          float* o_chunk = o + int64_t(heads[i]) * kRowFloats + x * kLanes;
          _mm256_storeu_ps(o_chunk, _mm256_fmadd_ps(_mm256_broadcast_ss(p + heads[i]), v, _mm256_loadu_ps(o_chunk)));
        }
      }
    }
  }
};

}  // namespace

const DecodeKernels* avx2_decode_kernels(int d) {
#if defined(SPARSA_CPU_PORTABLE_KERNELS)
  return nullptr;
#endif
  const CpuFeatures& cpu = cpu_features();
  if (!(cpu.avx2 && cpu.fma && cpu.f16c)) return nullptr;
  return DecodeKernelTable<Avx2>::for_head_dim(d);
}

#else

const DecodeKernels* avx2_decode_kernels(int) { return nullptr; }

#endif

}  // namespace sparsa::cpu
