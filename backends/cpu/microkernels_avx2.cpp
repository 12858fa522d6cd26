// AVX2 + FMA microkernels (see microkernels.h). Only this file is compiled for AVX2 (a target pragma after every
// include, so no inline function of a shared header is emitted with AVX2 code); select_microkernels() calls into it
// only on a CPU that has AVX2 and FMA, so the library still runs on any x86-64. GCC takes the target from
// `#pragma GCC target`; clang ignores that pragma, so under clang the same region gets a target("avx2,fma") attribute
// on every function (`#pragma clang attribute`). Off x86 the file only aliases the portable kernels.
//
// Register blocking: both matrix kernels keep a kRowBlock × 16 tile of fp32 accumulators in 12 ymm registers and
// stream the shared operand one 16-float row at a time (2 loads, kRowBlock broadcasts, 2·kRowBlock FMAs per step),
// the classic 6×16 AVX2 GEMM shape.
#include <cstdint>

#include "microkernels.h"

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>

#if defined(__clang__)
// clang ignores `#pragma GCC target`; its equivalent gives every function below the same target attribute.
#pragma clang attribute push(__attribute__((target("avx2,fma"))), apply_to = function)
#else
#pragma GCC push_options
#pragma GCC target("avx2,fma")
#endif

namespace sparsa::cpu {
namespace {

constexpr int kRowBlock = 6;   // rows of the broadcast operand per register tile (keys of K, query rows of P)
constexpr int kLanes = 8;      // floats per ymm register
constexpr int kColBlock = 16;  // columns of the loaded operand per register tile (two registers)

// ---- Sᵀ = K · Qᵀ ----

// kKeys keys × 8·kVectors query rows of Sᵀ: per step c, kVectors loads of Qᵀ[c] and kKeys broadcasts of K[j][c].
// Every score is the same FMA chain over c whatever the tile shape, so results do not depend on the blocking.
template <int kKeys, int kVectors>
inline void qk_register_tile(const float* k, int64_t k_stride, const float* qt, int qt_stride, int d, float* st,
                             int st_stride) {
  __m256 acc[kKeys][kVectors];
#pragma GCC unroll 16
  for (int j = 0; j < kKeys; ++j)
#pragma GCC unroll 2
    for (int x = 0; x < kVectors; ++x) acc[j][x] = _mm256_setzero_ps();
  for (int c = 0; c < d; ++c) {
    __m256 q[kVectors];
#pragma GCC unroll 2
    for (int x = 0; x < kVectors; ++x) q[x] = _mm256_loadu_ps(qt + int64_t(c) * qt_stride + x * kLanes);
#pragma GCC unroll 16
    for (int j = 0; j < kKeys; ++j) {
      const __m256 k_jc = _mm256_broadcast_ss(k + j * k_stride + c);
#pragma GCC unroll 2
      for (int x = 0; x < kVectors; ++x) acc[j][x] = _mm256_fmadd_ps(k_jc, q[x], acc[j][x]);
    }
  }
#pragma GCC unroll 16
  for (int j = 0; j < kKeys; ++j)
#pragma GCC unroll 2
    for (int x = 0; x < kVectors; ++x) _mm256_storeu_ps(st + int64_t(j) * st_stride + x * kLanes, acc[j][x]);
}

// One column strip of 8·kVectors query rows, kKeysPerTile keys per register tile (the rest one switch away).
template <int kVectors, int kKeysPerTile>
void qk_strip(const float* k, int64_t k_stride, int nk, const float* qt, int qt_stride, int d, float* st,
              int st_stride) {
  int j0 = 0;
  for (; j0 + kKeysPerTile <= nk; j0 += kKeysPerTile)
    qk_register_tile<kKeysPerTile, kVectors>(k + j0 * k_stride, k_stride, qt, qt_stride, d,
                                             st + int64_t(j0) * st_stride, st_stride);
  const float* k_rest = k + j0 * k_stride;
  float* st_rest = st + int64_t(j0) * st_stride;
  for (int left = nk - j0; left > 0;) {  // at most two steps: 4 then the remaining 1–3 (or 1–5 directly)
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

// 16-row strips (6 keys per tile, 12 accumulators), then a last 8-row strip when nr_pad is an odd multiple of 8
// (decode: 1–8 stacked rows need one vector of Qᵀ, not two). The 8-row strip takes 12 keys per tile.
constexpr int kKeysPerNarrowTile = 12;

void qk_tile_avx2(const float* k, int64_t k_stride, int nk, const float* qt, int qt_stride, int nr_pad, int d,
                  float* st, int st_stride) {
  int r0 = 0;
  for (; r0 + kColBlock <= nr_pad; r0 += kColBlock)
    qk_strip<2, kRowBlock>(k, k_stride, nk, qt + r0, qt_stride, d, st + r0, st_stride);
  if (r0 < nr_pad) qk_strip<1, kKeysPerNarrowTile>(k, k_stride, nk, qt + r0, qt_stride, d, st + r0, st_stride);
}

// ---- O += P · V ----

// kRows query rows × 8·kVectors output columns: per key j, kVectors loads of V[j] and kRows broadcasts of P.
template <int kRows, int kVectors>
inline void pv_register_tile(const float* pt, int pt_stride, int nk, const float* v, int64_t v_stride, int d,
                             float* o) {
  __m256 acc[kRows][kVectors];
#pragma GCC unroll 8
  for (int r = 0; r < kRows; ++r)
#pragma GCC unroll 8
    for (int x = 0; x < kVectors; ++x) acc[r][x] = _mm256_loadu_ps(o + int64_t(r) * d + x * kLanes);
  for (int j = 0; j < nk; ++j) {
    __m256 v_j[kVectors];
#pragma GCC unroll 8
    for (int x = 0; x < kVectors; ++x) v_j[x] = _mm256_loadu_ps(v + j * v_stride + x * kLanes);
#pragma GCC unroll 8
    for (int r = 0; r < kRows; ++r) {
      const __m256 p_rj = _mm256_broadcast_ss(pt + int64_t(j) * pt_stride + r);
#pragma GCC unroll 8
      for (int x = 0; x < kVectors; ++x) acc[r][x] = _mm256_fmadd_ps(p_rj, v_j[x], acc[r][x]);
    }
  }
#pragma GCC unroll 8
  for (int r = 0; r < kRows; ++r)
#pragma GCC unroll 8
    for (int x = 0; x < kVectors; ++x) _mm256_storeu_ps(o + int64_t(r) * d + x * kLanes, acc[r][x]);
}

template <int kVectors>
void pv_columns(const float* pt, int pt_stride, int nr, int nk, const float* v, int64_t v_stride, int d, float* o) {
  int r0 = 0;
  for (; r0 + kRowBlock <= nr; r0 += kRowBlock)
    pv_register_tile<kRowBlock, kVectors>(pt + r0, pt_stride, nk, v, v_stride, d, o + int64_t(r0) * d);
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

void pv_tile_avx2(const float* pt, int pt_stride, int nr, int nk, const float* v, int64_t v_stride, int d, float* o) {
  int c0 = 0;
  for (; c0 + kColBlock <= d; c0 += kColBlock) pv_columns<2>(pt, pt_stride, nr, nk, v + c0, v_stride, d, o + c0);
  for (; c0 + kLanes <= d; c0 += kLanes) pv_columns<1>(pt, pt_stride, nr, nk, v + c0, v_stride, d, o + c0);
  for (; c0 < d; ++c0) {  // fewer than 8 columns left: scalar
    for (int r = 0; r < nr; ++r) {
      float sum = o[int64_t(r) * d + c0];
      for (int j = 0; j < nk; ++j) sum += pt[int64_t(j) * pt_stride + r] * v[j * v_stride + c0];
      o[int64_t(r) * d + c0] = sum;
    }
  }
}

// ---- softmax bookkeeping ----

void column_max_avx2(const float* st, int st_stride, int nk, int nr_pad, float* col_max) {
  for (int r = 0; r < nr_pad; r += kLanes) {
    __m256 m = _mm256_set1_ps(-__builtin_inff());
    for (int j = 0; j < nk; ++j) m = _mm256_max_ps(m, _mm256_loadu_ps(st + int64_t(j) * st_stride + r));
    _mm256_storeu_ps(col_max + r, m);
  }
}

// exp(x) for x <= 0 (Cephes' range reduction exp(x) = 2^n · exp(r), |r| <= ln2/2, degree-5 polynomial, ~1 ulp).
// Inputs below about −87.3 (−inf included) give exactly 0: the rebuilt exponent field is 0.
inline __m256 exp_nonpositive(__m256 x) {
  const __m256 kLowest = _mm256_set1_ps(-88.3762626647949f);
  const __m256 kLog2e = _mm256_set1_ps(1.44269504088896341f);
  const __m256 kLn2Hi = _mm256_set1_ps(0.693359375f);
  const __m256 kLn2Lo = _mm256_set1_ps(-2.12194440e-4f);
  x = _mm256_max_ps(x, kLowest);
  const __m256 n = _mm256_floor_ps(_mm256_fmadd_ps(x, kLog2e, _mm256_set1_ps(0.5f)));
  __m256 r = _mm256_fnmadd_ps(n, kLn2Hi, x);
  r = _mm256_fnmadd_ps(n, kLn2Lo, r);
  __m256 poly = _mm256_set1_ps(1.9875691500e-4f);
  poly = _mm256_fmadd_ps(poly, r, _mm256_set1_ps(1.3981999507e-3f));
  poly = _mm256_fmadd_ps(poly, r, _mm256_set1_ps(8.3334519073e-3f));
  poly = _mm256_fmadd_ps(poly, r, _mm256_set1_ps(4.1665795894e-2f));
  poly = _mm256_fmadd_ps(poly, r, _mm256_set1_ps(1.6666665459e-1f));
  poly = _mm256_fmadd_ps(poly, r, _mm256_set1_ps(5.0000001201e-1f));
  poly = _mm256_fmadd_ps(poly, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.f)));
  const __m256i exponent = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvttps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(poly, _mm256_castsi256_ps(exponent));
}

void exp_columns_avx2(float* st, int st_stride, int nk, int nr_pad, const float* shift, float* col_sum) {
  for (int r = 0; r < nr_pad; r += kLanes) {
    const __m256 shift_r = _mm256_loadu_ps(shift + r);
    __m256 sum = _mm256_setzero_ps();
    for (int j = 0; j < nk; ++j) {
      float* x = st + int64_t(j) * st_stride + r;
      const __m256 e = exp_nonpositive(_mm256_sub_ps(_mm256_loadu_ps(x), shift_r));
      _mm256_storeu_ps(x, e);
      sum = _mm256_add_ps(sum, e);
    }
    _mm256_storeu_ps(col_sum + r, sum);
  }
}

void scale_row_avx2(float* x, int n, float a) {
  const __m256 factor = _mm256_set1_ps(a);
  int j = 0;
  for (; j + kLanes <= n; j += kLanes) _mm256_storeu_ps(x + j, _mm256_mul_ps(_mm256_loadu_ps(x + j), factor));
  for (; j < n; ++j) x[j] *= a;
}

int32_t dot_i8_avx2(const int8_t* a, const int8_t* b, int n) {
  constexpr int kBytes = 16;  // int8 values widened to one register of int16 per step
  __m256i sum = _mm256_setzero_si256();
  int c = 0;
  for (; c + kBytes <= n; c += kBytes) {
    const __m256i a16 = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(a + c)));
    const __m256i b16 = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(b + c)));
    sum = _mm256_add_epi32(sum, _mm256_madd_epi16(a16, b16));  // |a·b| <= 2·127² per lane: no overflow
  }
  __m128i half = _mm_add_epi32(_mm256_castsi256_si128(sum), _mm256_extracti128_si256(sum, 1));
  half = _mm_add_epi32(half, _mm_shuffle_epi32(half, 0x4e));
  half = _mm_add_epi32(half, _mm_shuffle_epi32(half, 0xb1));
  int32_t total = _mm_cvtsi128_si32(half);
  for (; c < n; ++c) total += int32_t(a[c]) * int32_t(b[c]);
  return total;
}

constexpr Microkernels kAvx2 = {qk_tile_avx2,     pv_tile_avx2,   column_max_avx2,
                                exp_columns_avx2, scale_row_avx2, dot_i8_avx2, "avx2+fma"};

}  // namespace

const Microkernels& avx2_microkernels() { return kAvx2; }

}  // namespace sparsa::cpu

#if defined(__clang__)
#pragma clang attribute pop
#else
#pragma GCC pop_options
#endif
#else
namespace sparsa::cpu {
const Microkernels& avx2_microkernels() { return portable_microkernels(); }
}  // namespace sparsa::cpu
#endif
