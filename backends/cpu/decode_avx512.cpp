// AVX-512F dense decode kernels (see decode_kernels.h). A K or V row of d = 16·kChunks 16-bit values is widened into
// kChunks zmm registers with one vcvtph2ps (fp16) or zero-extend + shift (bf16) per 16 values; scores are two FMA
// chains per query row and one horizontal sum; the P·V update loads, fuses and stores each output row in L1.
// Only functions with the avx512f target attribute touch AVX-512, and avx512_decode_kernels() hands them out only on
// a CPU that has it.
#include "cpu_features.h"
#include "decode_kernel_table.h"
#include "decode_kernels.h"

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
__attribute__((target("avx512f"))) inline __m512 widen16(const unsigned char* p) {
  const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  if constexpr (kDtype == SPARSA_DTYPE_F16) {
    return _mm512_maskz_cvtph_ps(kAllLanes, h);
  } else {
    return _mm512_castsi512_ps(_mm512_maskz_slli_epi32(kAllLanes, _mm512_maskz_cvtepu16_epi32(kAllLanes, h), 16));
  }
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

  template <int32_t kDtype, int kChunks>
  __attribute__((target("avx512f"))) static void scores(const DecodeTile& tile, const float* q, float* st,
                                                        int st_stride) {
    constexpr int kBytes = 2 * kLanes;  // bytes of 16 values
    for (int j = 0; j < tile.nk; ++j) {
      prefetch_for_key(tile, j);
      float* st_row = st + int64_t(j) * st_stride;
      for (int hk = 0; hk < tile.n_kv_heads; ++hk) {
        const unsigned char* k_row = tile.k_rows[j] + hk * tile.k_head_bytes;
        __m512 k[kChunks];
#pragma GCC unroll 16
        for (int x = 0; x < kChunks; ++x) k[x] = widen16<kDtype>(k_row + x * kBytes);
        for (int l = 0; l < tile.group; ++l) {
          const int h = hk * tile.group + l;
          const float* q_row = q + int64_t(h) * kChunks * kLanes;
          __m512 even = _mm512_mul_ps(_mm512_loadu_ps(q_row), k[0]);
          __m512 odd = _mm512_mul_ps(_mm512_loadu_ps(q_row + kLanes), k[1]);
#pragma GCC unroll 16
          for (int x = 2; x < kChunks; x += 2) {
            even = _mm512_fmadd_ps(_mm512_loadu_ps(q_row + x * kLanes), k[x], even);
            odd = _mm512_fmadd_ps(_mm512_loadu_ps(q_row + (x + 1) * kLanes), k[x + 1], odd);
          }
          st_row[h] = horizontal_sum(_mm512_add_ps(even, odd));
        }
      }
    }
  }

  template <int32_t kDtype, int kChunks>
  __attribute__((target("avx512f"))) static void accumulate(const DecodeTile& tile, const float* st, int st_stride,
                                                            float* o) {
    constexpr int kBytes = 2 * kLanes;
    for (int j = 0; j < tile.nk; ++j) {
      const float* st_row = st + int64_t(j) * st_stride;
      for (int hk = 0; hk < tile.n_kv_heads; ++hk) {
        const unsigned char* v_row = tile.v_rows[j] + hk * tile.v_head_bytes;
        __m512 v[kChunks];
#pragma GCC unroll 16
        for (int x = 0; x < kChunks; ++x) v[x] = widen16<kDtype>(v_row + x * kBytes);
        for (int l = 0; l < tile.group; ++l) {
          const int h = hk * tile.group + l;
          const float p = st_row[h];
          if (p == 0.f) continue;
          const __m512 pb = _mm512_set1_ps(p);
          float* o_row = o + int64_t(h) * kChunks * kLanes;
#pragma GCC unroll 16
          for (int x = 0; x < kChunks; ++x)
            _mm512_storeu_ps(o_row + x * kLanes, _mm512_fmadd_ps(pb, v[x], _mm512_loadu_ps(o_row + x * kLanes)));
        }
      }
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
