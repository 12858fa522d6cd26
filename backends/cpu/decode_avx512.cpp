// AVX-512F dense decode kernels (see decode_kernels.h). A K or V row of d = 16·kChunks 16-bit values is widened into
// kChunks zmm registers with one vcvtph2ps (fp16) or zero-extend + shift (bf16) per 16 values. Scores: blocks of
// 16 / group keys and one kv head, whose 16 scores one transpose-and-add tree reduces, each q chunk loaded once per
// block. P·V: a block of output row slices held in registers across a run of keys. Before, each score took its own
// horizontal sum and each key loaded, fused and stored every output row slice: fp16 decode at Skv = 32768, GQA 32/8,
// D = 128, one thread (Zen 4, 2026-11-29, alternating runs) took 14.3–14.7 ms before and 13.1–13.7 ms after; at
// Skv = 8192 4.0–4.3 against 3.2–3.5 ms. Scoring a key at a time (16 heads, four kv heads, per reduction) loaded every
// q chunk once per key: with the rows in L2 62 cycles per key and kv head against 42 in blocks of keys (Zen 4,
// 2026-11-30; dense decode's figures are in docs/performance.md).
// Only functions with the avx512f target attribute touch AVX-512, and avx512_decode_kernels() hands them out only on
// a CPU that has it.
#include "cpu_features.h"
#include "decode_kernel_table.h"
#include "decode_kernels.h"
#include "decode_magnitudes.h"

#include <sparsa/sparsa.h>

#if defined(__x86_64__)
#include <immintrin.h>
// GCC 12's avx512fintrin.h starts several intrinsics (lane extracts and shuffles) from an undefined register and
// then warns -Wmaybe-uninitialized at every use; the warning is about the header, not this code.
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#endif
#endif

namespace sparsa::cpu {

#if defined(__x86_64__)
namespace {

constexpr int kLanes = 16;           // floats per zmm
constexpr __mmask16 kAllLanes = 0xffff;  // zero-masked forms: GCC 12 warns on the plain ones' undefined start

template <int32_t kDtype>
__attribute__((target("avx512f"))) inline __m512 widen16_bits(__m256i h) {
  if constexpr (kDtype == SPARSA_DTYPE_F16) {
    return _mm512_maskz_cvtph_ps(kAllLanes, h);
  } else {
    return _mm512_castsi512_ps(_mm512_maskz_slli_epi32(kAllLanes, _mm512_maskz_cvtepu16_epi32(kAllLanes, h), 16));
  }
}
template <int32_t kDtype>
__attribute__((target("avx512f"))) inline __m512 widen16(const unsigned char* p) {
  return widen16_bits<kDtype>(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}

// Σ of the 16 lanes (GCC 12's _mm512_reduce_add_ps warns -Wmaybe-uninitialized; this is the same tree).
__attribute__((target("avx512f"))) inline float horizontal_sum(__m512 x) {
  constexpr int kSwapHalves = 0x4e;  // 128-bit lanes (2, 3, 0, 1)
  const __m256 eight = _mm512_castps512_ps256(_mm512_add_ps(x, _mm512_shuffle_f32x4(x, x, kSwapHalves)));
  __m128 four = _mm_add_ps(_mm256_castps256_ps128(eight), _mm256_extractf128_ps(eight, 1));
  four = _mm_add_ps(four, _mm_movehl_ps(four, four));
  four = _mm_add_ss(four, _mm_shuffle_ps(four, four, 1));
  return _mm_cvtss_f32(four);
}

// The kernels, as DecodeKernelTable (decode_kernel_table.h) reads them.
struct Avx512 {
  static constexpr int kLanes = sparsa::cpu::kLanes;
  static constexpr const char* kName = "avx512f";

  // With groups of 1, 2, 4, 8 or 16 query heads, blocks of 16 / group keys of one kv head (scores_reduced): their 16
  // partial-sum vectors are reduced together by one transpose-and-add tree (45 instructions for 16 scores, against
  // about 9 per score for a horizontal sum each); other groups take one horizontal sum per score. With
  // tile.k_magnitudes the scoring loop also keeps each kv head's largest magnitude from the K bits it loads.
  template <int32_t kDtype, int kChunks>
  __attribute__((target("avx512f"))) static void scores(const DecodeTile& tile, const float* q, float* st,
                                                        int st_stride) {
    if (tile.k_magnitudes && tile.n_kv_heads <= kMaxMagnitudeHeads) {
      switch (tile.group) {
        case 1: return scores_reduced<kDtype, kChunks, 1, true>(tile, q, st, st_stride);
        case 2: return scores_reduced<kDtype, kChunks, 2, true>(tile, q, st, st_stride);
        case 4: return scores_reduced<kDtype, kChunks, 4, true>(tile, q, st, st_stride);
        case 8: return scores_reduced<kDtype, kChunks, 8, true>(tile, q, st, st_stride);
        case 16: return scores_reduced<kDtype, kChunks, 16, true>(tile, q, st, st_stride);
        default: break;
      }
    }
    switch (tile.group) {
      case 1: scores_reduced<kDtype, kChunks, 1, false>(tile, q, st, st_stride); break;
      case 2: scores_reduced<kDtype, kChunks, 2, false>(tile, q, st, st_stride); break;
      case 4: scores_reduced<kDtype, kChunks, 4, false>(tile, q, st, st_stride); break;
      case 8: scores_reduced<kDtype, kChunks, 8, false>(tile, q, st, st_stride); break;
      case 16: scores_reduced<kDtype, kChunks, 16, false>(tile, q, st, st_stride); break;
      default: scores_by_key<kDtype, kChunks>(tile, q, st, st_stride);
    }
    if (tile.k_magnitudes) max_tile_magnitudes<kChunks * kLanes>(tile);
  }
  // The tile's keys in runs of kAccumulateKeys; per run, kv head and block of kHeads query heads × kBlockChunks row
  // chunks, the output block stays in registers across the run's keys and is loaded and stored once. Per output
  // element the FMAs still run key by key in order, so the bits are those of one key at a time.
  template <int32_t kDtype, int kChunks>
  __attribute__((target("avx512f"))) static void accumulate(const DecodeTile& tile, const float* st, int st_stride,
                                                            float* o) {
    if (tile.rows_ahead) {
      accumulate_grouped<kDtype, kChunks, true>(tile, st, st_stride, o);
    } else {
      accumulate_grouped<kDtype, kChunks, false>(tile, st, st_stride, o);
    }
  }

 private:
  // Keys per run: a run's V rows, every kv head, are 16 KiB at 8 kv heads and D = 128. Measured on Zen 4, 2 threads,
  // fp16 decode at Skv = 32768, GQA 32/8, alternating runs: 4 / 8 / 16 keys 7.7–8.2 / 6.7–7.0 / 7.1–7.4 ms; 32 keys
  // 8.6–9.0, the whole 128-key tile 10.6–11.0 (docs/performance.md).
  static constexpr int kAccumulateKeys = 8;
  static constexpr int kOutputRegisters = 16;  // of the 32 zmm: the rest hold the broadcasts and a V chunk

  // kFetchAhead: tile.rows_ahead is set. A version of its own, so that dense decode's P·V is the loop it was (with a
  // test of rows_ahead per key, dense fp16 decode at 8K keys, one thread, Zen 4, took 2.65-2.96 ms against 2.22-2.52).
  template <int32_t kDtype, int kChunks, bool kFetchAhead>
  __attribute__((target("avx512f"))) static void accumulate_grouped(const DecodeTile& tile, const float* st,
                                                                    int st_stride, float* o) {
    if (tile.group % 8 == 0) {
      accumulate_heads<kDtype, kChunks, 8, kFetchAhead>(tile, st, st_stride, o);
    } else if (tile.group % 4 == 0) {
      accumulate_heads<kDtype, kChunks, 4, kFetchAhead>(tile, st, st_stride, o);
    } else if (tile.group % 2 == 0) {
      accumulate_heads<kDtype, kChunks, 2, kFetchAhead>(tile, st, st_stride, o);
    } else {
      accumulate_heads<kDtype, kChunks, 1, kFetchAhead>(tile, st, st_stride, o);
    }
  }

  // kHeads divides tile.group.
  template <int32_t kDtype, int kChunks, int kHeads, bool kFetchAhead>
  __attribute__((target("avx512f"))) static void accumulate_heads(const DecodeTile& tile, const float* st,
                                                                  int st_stride, float* o) {
    constexpr int kBlockChunks = kChunks < kOutputRegisters / kHeads ? kChunks : kOutputRegisters / kHeads;
    for (int j_begin = 0; j_begin < tile.nk; j_begin += kAccumulateKeys) {
      const int j_end = j_begin + kAccumulateKeys < tile.nk ? j_begin + kAccumulateKeys : tile.nk;
      for (int hk = 0; hk < tile.n_kv_heads; ++hk)
        for (int h = hk * tile.group; h < (hk + 1) * tile.group; h += kHeads)
          for (int x0 = 0; x0 < kChunks; x0 += kBlockChunks)
            accumulate_block<kDtype, kChunks, kHeads, kBlockChunks, kFetchAhead>(
                tile, st, st_stride, j_begin, j_end, hk, h, x0, h == hk * tile.group && x0 == 0, o);
    }
  }

  // o[h + l][chunks x0 ...] += Σ_j st[j][h + l] · V_j[chunks x0 ...] over keys [j_begin, j_end) of kv head hk; a zero
  // probability adds nothing (and 0·inf would be NaN), so its FMA is masked off. With kFetchAhead, fetch_ahead marks
  // the first block of kv head hk, which fetches that head's rows_ahead.
  template <int32_t kDtype, int kChunks, int kHeads, int kBlockChunks, bool kFetchAhead>
  __attribute__((target("avx512f"))) static void accumulate_block(const DecodeTile& tile, const float* st,
                                                                  int st_stride, int j_begin, int j_end, int hk,
                                                                  int h, int x0, bool fetch_ahead, float* o) {
    constexpr int kBytes = 2 * kLanes;
    constexpr int kRowFloats = kChunks * kLanes;
    float* o_block = o + int64_t(h) * kRowFloats + x0 * kLanes;
    __m512 acc[kHeads][kBlockChunks];
#pragma GCC unroll 8
    for (int l = 0; l < kHeads; ++l)
#pragma GCC unroll 16
      for (int x = 0; x < kBlockChunks; ++x) acc[l][x] = _mm512_loadu_ps(o_block + l * kRowFloats + x * kLanes);
    const __m512 zero = _mm512_setzero_ps();
    for (int j = j_begin; j < j_end; ++j) {
      const float* p = st + int64_t(j) * st_stride + h;
      const unsigned char* v_row = tile.v_rows[j] + hk * tile.v_head_bytes + x0 * kBytes;
      if constexpr (kFetchAhead)
        if (fetch_ahead) prefetch_row_ahead(tile, j, hk);
      __m512 pb[kHeads];
      __mmask16 live[kHeads];
#pragma GCC unroll 8
      for (int l = 0; l < kHeads; ++l) {
        pb[l] = _mm512_set1_ps(p[l]);
        live[l] = _mm512_cmp_ps_mask(pb[l], zero, _CMP_NEQ_UQ);
      }
#pragma GCC unroll 16
      for (int x = 0; x < kBlockChunks; ++x) {
        const __m512 v = widen16<kDtype>(v_row + x * kBytes);
#pragma GCC unroll 8
        for (int l = 0; l < kHeads; ++l) acc[l][x] = _mm512_mask3_fmadd_ps(pb[l], v, acc[l][x], live[l]);
      }
    }
#pragma GCC unroll 8
    for (int l = 0; l < kHeads; ++l)
#pragma GCC unroll 16
      for (int x = 0; x < kBlockChunks; ++x) _mm512_storeu_ps(o_block + l * kRowFloats + x * kLanes, acc[l][x]);
  }

  // Σ_c q_row[c] · K[c] as a 16-lane vector of partial sums (two FMA chains, even and odd chunks).
  template <int kChunks>
  __attribute__((target("avx512f"))) static __m512 dot_partials(const float* q_row, const __m512* k) {
    __m512 even = _mm512_mul_ps(_mm512_loadu_ps(q_row), k[0]);
    __m512 odd = _mm512_mul_ps(_mm512_loadu_ps(q_row + kLanes), k[1]);
#pragma GCC unroll 16
    for (int x = 2; x < kChunks; x += 2) {
      even = _mm512_fmadd_ps(_mm512_loadu_ps(q_row + x * kLanes), k[x], even);
      odd = _mm512_fmadd_ps(_mm512_loadu_ps(q_row + (x + 1) * kLanes), k[x + 1], odd);
    }
    return _mm512_add_ps(even, odd);
  }

  template <int32_t kDtype, int kChunks>
  __attribute__((target("avx512f"))) static void widen_row(const unsigned char* row, __m512* out) {
    constexpr int kBytes = 2 * kLanes;  // bytes of 16 values
#pragma GCC unroll 16
    for (int x = 0; x < kChunks; ++x) out[x] = widen16<kDtype>(row + x * kBytes);
  }

  // One horizontal sum per score.
  template <int32_t kDtype, int kChunks>
  __attribute__((target("avx512f"))) static void scores_by_key(const DecodeTile& tile, const float* q, float* st,
                                                               int st_stride) {
    for (int j = 0; j < tile.nk; ++j) {
      prefetch_for_key(tile, j);
      float* st_row = st + int64_t(j) * st_stride;
      for (int hk = 0; hk < tile.n_kv_heads; ++hk) {
        __m512 k[kChunks];
        widen_row<kDtype, kChunks>(tile.k_rows[j] + hk * tile.k_head_bytes, k);
        for (int l = 0; l < tile.group; ++l) {
          const int h = hk * tile.group + l;
          st_row[h] = horizontal_sum(dot_partials<kChunks>(q + int64_t(h) * kChunks * kLanes, k));
        }
      }
    }
  }

  // Lane m of the result is the sum of the lanes of partials[reduction_slot(m)]. The tree halves 16 vectors into 8
  // (256-bit halves), 4 (128-bit quarters), 2 and 1 (within quarters); slot(m) is where its shuffles leave lane m.
  static constexpr int reduction_slot(int m) {
    constexpr int kQuarterSlot[4] = {0, 8, 4, 12};  // lane quarter m / 4
    constexpr int kLaneSlot[4] = {0, 2, 1, 3};      // lane m % 4 within it
    return kQuarterSlot[m / 4] + kLaneSlot[m % 4];
  }
  __attribute__((target("avx512f"))) static __m512 reduce16(const __m512* partials) {
    __m512 halves[8], quarters[4], pairs[2];
#pragma GCC unroll 8
    for (int i = 0; i < 8; ++i) {
      const __m512 a = partials[i], b = partials[i + 8];
      halves[i] = _mm512_add_ps(_mm512_maskz_shuffle_f32x4(kAllLanes, a, b, _MM_SHUFFLE(1, 0, 1, 0)),
                                _mm512_maskz_shuffle_f32x4(kAllLanes, a, b, _MM_SHUFFLE(3, 2, 3, 2)));
    }
#pragma GCC unroll 4
    for (int i = 0; i < 4; ++i) {
      const __m512 a = halves[i], b = halves[i + 4];
      quarters[i] = _mm512_add_ps(_mm512_maskz_shuffle_f32x4(kAllLanes, a, b, _MM_SHUFFLE(2, 0, 2, 0)),
                                  _mm512_maskz_shuffle_f32x4(kAllLanes, a, b, _MM_SHUFFLE(3, 1, 3, 1)));
    }
#pragma GCC unroll 2
    for (int i = 0; i < 2; ++i) {
      const __m512 a = quarters[i], b = quarters[i + 2];
      pairs[i] = _mm512_add_ps(_mm512_maskz_shuffle_ps(kAllLanes, a, b, _MM_SHUFFLE(1, 0, 1, 0)),
                               _mm512_maskz_shuffle_ps(kAllLanes, a, b, _MM_SHUFFLE(3, 2, 3, 2)));
    }
    return _mm512_add_ps(_mm512_maskz_shuffle_ps(kAllLanes, pairs[0], pairs[1], _MM_SHUFFLE(2, 0, 2, 0)),
                         _mm512_maskz_shuffle_ps(kAllLanes, pairs[0], pairs[1], _MM_SHUFFLE(3, 1, 3, 1)));
  }

  // kGroup == tile.group. Blocks of kBlockKeys = 16 / kGroup keys and one kv head: lane t·kGroup + l of the reduction
  // is key t's score of head l, and each q chunk, loaded once per block, serves every key of it (one chain of FMAs
  // per score, channel chunks in order). A tile's last nk % kBlockKeys keys take blocks of one key.
  template <int32_t kDtype, int kChunks, int kGroup, bool kMagnitudes>
  __attribute__((target("avx512f"))) static void scores_reduced(const DecodeTile& tile, const float* q, float* st,
                                                                int st_stride) {
    constexpr int kBlockKeys = kLanes / kGroup;
    __m256i magnitudes[kMagnitudes ? kMaxMagnitudeHeads : 1];
    if constexpr (kMagnitudes)
      for (int hk = 0; hk < tile.n_kv_heads; ++hk) magnitudes[hk] = _mm256_setzero_si256();
    int j = 0;
    for (; j + kBlockKeys <= tile.nk; j += kBlockKeys)
      scores_block<kDtype, kChunks, kGroup, kBlockKeys, kMagnitudes>(tile, q, st, st_stride, j, magnitudes);
    for (; j < tile.nk; ++j)
      scores_block<kDtype, kChunks, kGroup, 1, kMagnitudes>(tile, q, st, st_stride, j, magnitudes);
    if constexpr (kMagnitudes)
      for (int hk = 0; hk < tile.n_kv_heads; ++hk) store_magnitude(magnitudes[hk], &tile.k_magnitudes[hk]);
  }

  // Scores of keys [j, j + kKeys) (kKeys · kGroup <= 16), every kv head.
  template <int32_t kDtype, int kChunks, int kGroup, int kKeys, bool kMagnitudes>
  __attribute__((target("avx512f"))) static void scores_block(const DecodeTile& tile, const float* q, float* st,
                                                              int st_stride, int j, __m256i* magnitudes) {
    constexpr int kRowFloats = kChunks * kLanes;
    constexpr int kBytes = 2 * kLanes;  // bytes of 16 values
    for (int hk = 0; hk < tile.n_kv_heads; ++hk) {
      prefetch_for_block_head(tile, j, kKeys, hk);
      const float* q_head = q + int64_t(hk) * kGroup * kRowFloats;
      const unsigned char* rows[kKeys];
#pragma GCC unroll 16
      for (int t = 0; t < kKeys; ++t) rows[t] = tile.k_rows[j + t] + hk * tile.k_head_bytes;
      __m256i magnitude = _mm256_setzero_si256();
      if constexpr (kMagnitudes) magnitude = magnitudes[hk];
      __m512 partials[kLanes];
#pragma GCC unroll 16
      for (int x = 0; x < kChunks; ++x) {
#pragma GCC unroll 16
        for (int t = 0; t < kKeys; ++t) {
          const __m256i bits = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(rows[t] + x * kBytes));
          if constexpr (kMagnitudes) magnitude = max_magnitude(magnitude, bits);
          const __m512 key = widen16_bits<kDtype>(bits);
#pragma GCC unroll 16
          for (int l = 0; l < kGroup; ++l) {
            const __m512 q_chunk = _mm512_loadu_ps(q_head + l * kRowFloats + x * kLanes);
            __m512& partial = partials[reduction_slot(t * kGroup + l)];
            partial = x == 0 ? _mm512_mul_ps(q_chunk, key) : _mm512_fmadd_ps(q_chunk, key, partial);
          }
        }
      }
      if constexpr (kMagnitudes) magnitudes[hk] = magnitude;
#pragma GCC unroll 16
      for (int m = kKeys * kGroup; m < kLanes; ++m) partials[reduction_slot(m)] = _mm512_setzero_ps();
      store_block_scores<kGroup, kKeys>(reduce16(partials), st + int64_t(j) * st_stride + hk * kGroup, st_stride);
    }
  }

  // Lane t·kGroup + l of scores to st[t · st_stride + l], for t < kKeys.
  template <int kGroup, int kKeys>
  __attribute__((target("avx512f"))) static void store_block_scores(__m512 scores, float* st, int st_stride) {
    if constexpr (kGroup == 16) {
      _mm512_storeu_ps(st, scores);
    } else if constexpr (kGroup == 8) {
      _mm256_storeu_ps(st, _mm512_castps512_ps256(scores));
      if constexpr (kKeys > 1)
        _mm256_storeu_ps(st + st_stride,
                         _mm256_castpd_ps(_mm512_maskz_extractf64x4_pd(0xf, _mm512_castps_pd(scores), 1)));
    } else if constexpr (kGroup == 4) {
      _mm_storeu_ps(st, _mm512_castps512_ps128(scores));
      if constexpr (kKeys > 1) _mm_storeu_ps(st + st_stride, _mm512_maskz_extractf32x4_ps(0xf, scores, 1));
      if constexpr (kKeys > 2) _mm_storeu_ps(st + 2 * st_stride, _mm512_maskz_extractf32x4_ps(0xf, scores, 2));
      if constexpr (kKeys > 3) _mm_storeu_ps(st + 3 * st_stride, _mm512_maskz_extractf32x4_ps(0xf, scores, 3));
    } else {
      alignas(64) float lanes[kLanes];
      _mm512_store_ps(lanes, scores);
#pragma GCC unroll 16
      for (int t = 0; t < kKeys; ++t)
#pragma GCC unroll 2
        for (int l = 0; l < kGroup; ++l) st[t * st_stride + l] = lanes[t * kGroup + l];
    }
  }
};

}  // namespace

const DecodeKernels* avx512_decode_kernels(int d) {
#if defined(SPARSA_CPU_PORTABLE_KERNELS)
  return nullptr;
#endif
  if (!cpu_features().avx512f) return nullptr;
  return DecodeKernelTable<Avx512>::for_head_dim(d);
}

#else

const DecodeKernels* avx512_decode_kernels(int) { return nullptr; }

#endif

}  // namespace sparsa::cpu
