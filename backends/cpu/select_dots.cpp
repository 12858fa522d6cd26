// The float64 dot products of the selection policies (cpu_select_util.h: interleaved_dots, interleaved_dots_keys).
//
// Selection scores stay float64 so the CPU backend is an exact oracle, and every score must be the plain sequential
// Σ_c v[c]·k[c] (a rounded multiply, then a rounded add, in c order) whatever the machine: the shared test vectors
// are byte-exact. So the AVX2 version below vectorises across vectors and keys only — four independent sums per
// register, several keys per pass so the add chains overlap — and is compiled for "avx2" WITHOUT "fma", which keeps
// the compiler from contracting a multiply and an add into one differently rounded FMA. It is therefore
// bit-identical to the portable version, which is the same loop in scalar code.
#include <algorithm>
#include <cstdint>

#include "cpu_select_util.h"
#include "cpu_features.h"

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif

namespace sparsa::cpu {
namespace {

constexpr int kDoubleLanes = 4;  // doubles per ymm register

void dots_keys_portable(const double* interleaved, int64_t n_vectors, const float* const* keys, int n_keys,
                        int32_t d, double scale, double* dots, int64_t dots_stride) {
  for (int key = 0; key < n_keys; ++key) {
    for (int64_t first = 0; first < n_vectors; first += kInterleavedDots) {
      const double* block = interleaved + first * d;
      double sums[kInterleavedDots] = {};
      for (int32_t c = 0; c < d; ++c) {
        const double k = keys[key][c];
        const double* v = block + int64_t(c) * kInterleavedDots;
        for (int32_t l = 0; l < kInterleavedDots; ++l) sums[l] += v[l] * k;
      }
      const int64_t lanes = std::min<int64_t>(kInterleavedDots, n_vectors - first);
      for (int64_t l = 0; l < lanes; ++l) dots[key * dots_stride + first + l] = scale * sums[l];
    }
  }
}

#if defined(__x86_64__) || defined(__i386__)
// kKeys keys against one block of kVectors·4 interleaved vectors (kVectors = 1 when only the first 4 lanes hold
// vectors). Multiply and add stay separate instructions (no "fma" in the target).
template <int kKeys, int kVectors>
__attribute__((target("avx2"))) inline void dots_block_avx2(const double* block, const float* const* keys,
                                                            int32_t d, double scale, int64_t lanes, double* dots,
                                                            int64_t dots_stride) {
  __m256d sums[kKeys][kVectors];
#pragma GCC unroll 4
  for (int key = 0; key < kKeys; ++key)
#pragma GCC unroll 2
    for (int x = 0; x < kVectors; ++x) sums[key][x] = _mm256_setzero_pd();
  for (int32_t c = 0; c < d; ++c) {
    __m256d v[kVectors];
#pragma GCC unroll 2
    for (int x = 0; x < kVectors; ++x) v[x] = _mm256_loadu_pd(block + int64_t(c) * kInterleavedDots + x * kDoubleLanes);
#pragma GCC unroll 4
    for (int key = 0; key < kKeys; ++key) {
      const __m256d k = _mm256_set1_pd(double(keys[key][c]));
#pragma GCC unroll 2
      for (int x = 0; x < kVectors; ++x) sums[key][x] = _mm256_add_pd(sums[key][x], _mm256_mul_pd(v[x], k));
    }
  }
  const __m256d factor = _mm256_set1_pd(scale);
  for (int key = 0; key < kKeys; ++key) {
    alignas(32) double out[kInterleavedDots];
    for (int x = 0; x < kVectors; ++x) _mm256_store_pd(out + x * kDoubleLanes, _mm256_mul_pd(factor, sums[key][x]));
    std::copy(out, out + lanes, dots + key * dots_stride);
  }
}

template <int kKeys>
__attribute__((target("avx2"))) void dots_keys_avx2(const double* interleaved, int64_t n_vectors,
                                                    const float* const* keys, int32_t d, double scale, double* dots,
                                                    int64_t dots_stride) {
  for (int64_t first = 0; first < n_vectors; first += kInterleavedDots) {
    const int64_t lanes = std::min<int64_t>(kInterleavedDots, n_vectors - first);
    const double* block = interleaved + first * d;
    if (lanes <= kDoubleLanes) {
      dots_block_avx2<kKeys, 1>(block, keys, d, scale, lanes, dots + first, dots_stride);
    } else {
      dots_block_avx2<kKeys, 2>(block, keys, d, scale, lanes, dots + first, dots_stride);
    }
  }
}
#endif

}  // namespace

void interleaved_dots_keys(const double* interleaved, int64_t n_vectors, const float* const* keys, int n_keys,
                           int32_t d, double scale, double* dots, int64_t dots_stride) {
#if defined(__x86_64__) || defined(__i386__)
  if (cpu_features().avx2) {
    for (int first = 0; first < n_keys; first += kDotKeys) {
      const float* const* group = keys + first;
      double* out = dots + first * dots_stride;
      switch (std::min(kDotKeys, n_keys - first)) {
        case 4: dots_keys_avx2<4>(interleaved, n_vectors, group, d, scale, out, dots_stride); break;
        case 3: dots_keys_avx2<3>(interleaved, n_vectors, group, d, scale, out, dots_stride); break;
        case 2: dots_keys_avx2<2>(interleaved, n_vectors, group, d, scale, out, dots_stride); break;
        default: dots_keys_avx2<1>(interleaved, n_vectors, group, d, scale, out, dots_stride); break;
      }
    }
    return;
  }
#endif
  dots_keys_portable(interleaved, n_vectors, keys, n_keys, d, scale, dots, dots_stride);
}

}  // namespace sparsa::cpu
