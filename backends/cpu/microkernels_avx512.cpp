// AVX-512F versions of the two matrix microkernels (see microkernels.h); the softmax stages stay AVX2. Every output
// element is the same FMA chain as in the AVX2 kernels (a score starts at 0 and takes one FMA per channel c in
// order; an output value starts from o and takes one FMA per key j in order), only more of them run side by side,
// so results are bit-identical to the AVX2 table (the shared test vectors check this on an AVX-512 machine).
// Only functions with the avx512f target attribute use AVX-512; select_microkernels() picks this table only on a
// CPU that has it.
#include "microkernels.h"

#if defined(__x86_64__)
#include <immintrin.h>
// GCC 12's avx512fintrin.h starts some intrinsics from an undefined register and warns -Wmaybe-uninitialized.
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#endif
#endif

namespace sparsa::cpu {

#if defined(__x86_64__)
namespace {

constexpr int kLanes = 16;       // floats per zmm register
constexpr int kQkKeys = 12;      // keys per register tile of Sᵀ (12 × 2 zmm accumulators)
constexpr int kQkRowBlock = 32;  // query rows per Sᵀ strip (two zmm)
constexpr int kPvRows = 6;       // query rows per O register tile (6 × 4 zmm accumulators)
constexpr int kPvColumns = 64;   // output columns per O register tile (four zmm)

#define SPARSA_AVX512 __attribute__((target("avx512f,fma")))

template <int kKeys, int kVectors>
SPARSA_AVX512 inline void qk_register_tile(const float* k, int64_t k_stride, const float* qt, int qt_stride, int d,
                                           float* st, int st_stride) {
  __m512 acc[kKeys][kVectors];
#pragma GCC unroll 16
  for (int j = 0; j < kKeys; ++j)
#pragma GCC unroll 2
    for (int x = 0; x < kVectors; ++x) acc[j][x] = _mm512_setzero_ps();
  for (int c = 0; c < d; ++c) {
    __m512 q[kVectors];
#pragma GCC unroll 2
    for (int x = 0; x < kVectors; ++x) q[x] = _mm512_loadu_ps(qt + int64_t(c) * qt_stride + x * kLanes);
#pragma GCC unroll 16
    for (int j = 0; j < kKeys; ++j) {
      const __m512 k_jc = _mm512_set1_ps(k[j * k_stride + c]);
#pragma GCC unroll 2
      for (int x = 0; x < kVectors; ++x) acc[j][x] = _mm512_fmadd_ps(k_jc, q[x], acc[j][x]);
    }
  }
#pragma GCC unroll 16
  for (int j = 0; j < kKeys; ++j)
#pragma GCC unroll 2
    for (int x = 0; x < kVectors; ++x) _mm512_storeu_ps(st + int64_t(j) * st_stride + x * kLanes, acc[j][x]);
}

template <int kVectors>
SPARSA_AVX512 void qk_strip(const float* k, int64_t k_stride, int nk, const float* qt, int qt_stride, int d,
                            float* st, int st_stride) {
  int j0 = 0;
  for (; j0 + kQkKeys <= nk; j0 += kQkKeys)
    qk_register_tile<kQkKeys, kVectors>(k + j0 * k_stride, k_stride, qt, qt_stride, d, st + int64_t(j0) * st_stride,
                                        st_stride);
  const float* k_rest = k + j0 * k_stride;
  float* st_rest = st + int64_t(j0) * st_stride;
  for (int left = nk - j0; left > 0;) {
    switch (left) {
      case 5: qk_register_tile<5, kVectors>(k_rest, k_stride, qt, qt_stride, d, st_rest, st_stride); return;
      case 3: qk_register_tile<3, kVectors>(k_rest, k_stride, qt, qt_stride, d, st_rest, st_stride); return;
      case 2: qk_register_tile<2, kVectors>(k_rest, k_stride, qt, qt_stride, d, st_rest, st_stride); return;
      case 1: qk_register_tile<1, kVectors>(k_rest, k_stride, qt, qt_stride, d, st_rest, st_stride); return;
      default:
        qk_register_tile<4, kVectors>(k_rest, k_stride, qt, qt_stride, d, st_rest, st_stride);
        k_rest += 4 * k_stride;
        st_rest += int64_t(4) * st_stride;
        left -= 4;
    }
  }
}

// 32-row strips, then a 16-row strip, then the last 8 rows (nr_pad is a multiple of 8) with the AVX2 kernel.
void qk_tile_avx512(const float* k, int64_t k_stride, int nk, const float* qt, int qt_stride, int nr_pad, int d,
                    float* st, int st_stride) {
  int r0 = 0;
  for (; r0 + kQkRowBlock <= nr_pad; r0 += kQkRowBlock)
    qk_strip<2>(k, k_stride, nk, qt + r0, qt_stride, d, st + r0, st_stride);
  if (r0 + kLanes <= nr_pad) {
    qk_strip<1>(k, k_stride, nk, qt + r0, qt_stride, d, st + r0, st_stride);
    r0 += kLanes;
  }
  if (r0 < nr_pad)
    avx2_microkernels().qk_tile(k, k_stride, nk, qt + r0, qt_stride, nr_pad - r0, d, st + r0, st_stride);
}

template <int kRows, int kVectors>
SPARSA_AVX512 inline void pv_register_tile(const float* pt, int pt_stride, int nk, const float* v, int64_t v_stride,
                                           int d, float* o) {
  __m512 acc[kRows][kVectors];
#pragma GCC unroll 8
  for (int r = 0; r < kRows; ++r)
#pragma GCC unroll 8
    for (int x = 0; x < kVectors; ++x) acc[r][x] = _mm512_loadu_ps(o + int64_t(r) * d + x * kLanes);
  for (int j = 0; j < nk; ++j) {
    __m512 v_j[kVectors];
#pragma GCC unroll 8
    for (int x = 0; x < kVectors; ++x) v_j[x] = _mm512_loadu_ps(v + j * v_stride + x * kLanes);
#pragma GCC unroll 8
    for (int r = 0; r < kRows; ++r) {
      const __m512 p_rj = _mm512_set1_ps(pt[int64_t(j) * pt_stride + r]);
#pragma GCC unroll 8
      for (int x = 0; x < kVectors; ++x) acc[r][x] = _mm512_fmadd_ps(p_rj, v_j[x], acc[r][x]);
    }
  }
#pragma GCC unroll 8
  for (int r = 0; r < kRows; ++r)
#pragma GCC unroll 8
    for (int x = 0; x < kVectors; ++x) _mm512_storeu_ps(o + int64_t(r) * d + x * kLanes, acc[r][x]);
}

template <int kVectors>
SPARSA_AVX512 void pv_columns(const float* pt, int pt_stride, int nr, int nk, const float* v, int64_t v_stride, int d,
                              float* o) {
  int r0 = 0;
  for (; r0 + kPvRows <= nr; r0 += kPvRows)
    pv_register_tile<kPvRows, kVectors>(pt + r0, pt_stride, nk, v, v_stride, d, o + int64_t(r0) * d);
  const float* pt_rest = pt + r0;
  float* o_rest = o + int64_t(r0) * d;
  switch (nr - r0) {
    case 5: pv_register_tile<5, kVectors>(pt_rest, pt_stride, nk, v, v_stride, d, o_rest); break;
    case 4: pv_register_tile<4, kVectors>(pt_rest, pt_stride, nk, v, v_stride, d, o_rest); break;
    case 3: pv_register_tile<3, kVectors>(pt_rest, pt_stride, nk, v, v_stride, d, o_rest); break;
    case 2: pv_register_tile<2, kVectors>(pt_rest, pt_stride, nk, v, v_stride, d, o_rest); break;
    case 1: pv_register_tile<1, kVectors>(pt_rest, pt_stride, nk, v, v_stride, d, o_rest); break;
    default: break;
  }
}

// Head dims that are not a multiple of 16 go to the AVX2 kernel whole (its scalar tail is not an FMA chain).
void pv_tile_avx512(const float* pt, int pt_stride, int nr, int nk, const float* v, int64_t v_stride, int d,
                    float* o) {
  if (d % kLanes != 0) {
    avx2_microkernels().pv_tile(pt, pt_stride, nr, nk, v, v_stride, d, o);
    return;
  }
  int c0 = 0;
  for (; c0 + kPvColumns <= d; c0 += kPvColumns) pv_columns<4>(pt, pt_stride, nr, nk, v + c0, v_stride, d, o + c0);
  for (; c0 + 2 * kLanes <= d; c0 += 2 * kLanes) pv_columns<2>(pt, pt_stride, nr, nk, v + c0, v_stride, d, o + c0);
  for (; c0 < d; c0 += kLanes) pv_columns<1>(pt, pt_stride, nr, nk, v + c0, v_stride, d, o + c0);
}

#undef SPARSA_AVX512

}  // namespace

const Microkernels& avx512_microkernels() {
  static const Microkernels table = [] {
    Microkernels t = avx2_microkernels();
    t.qk_tile = qk_tile_avx512;
    t.pv_tile = pv_tile_avx512;
    t.name = "avx512f+avx2";
    return t;
  }();
  return table;
}

#else

const Microkernels& avx512_microkernels() { return avx2_microkernels(); }

#endif

}  // namespace sparsa::cpu
