// The fp32 screen's row loops (select_screen_rows.h).
#include "select_screen_rows.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <type_traits>

#include "cpu_features.h"

#if defined(__x86_64__)
#include <immintrin.h>
#endif

namespace sparsa::cpu::screen_rows {
namespace {

// exp(x) for x <= 0 (clamped at kLowestArgument): x = n·ln2 + r, |r| <= ln2/2, e^r by its Taylor polynomial to r^6
// (truncation below 1.3e-7 relative), 2^n from the exponent bits. Branch-free, so the row loops vectorise it.
inline float exp_nonpositive(float x) {
  constexpr float kLog2e = 1.44269504088896341f;
  constexpr float kLn2High = 0.693145751953125f;  // 15 significant bits: n · kLn2High is exact for |n| <= 2^8
  constexpr float kLn2Low = 1.42860682030941723212e-6f;
  constexpr float kRoundingShift = 12582912.f;  // 1.5 · 2^23: adding it rounds to an integer
  x = x < kLowestArgument ? kLowestArgument : x;
  const float n = (x * kLog2e + kRoundingShift) - kRoundingShift;
  const float r = (x - n * kLn2High) - n * kLn2Low;
  const float p =
      1.f + r * (1.f + r * (0.5f + r * (1.f / 6 + r * (1.f / 24 + r * (1.f / 120 + r * (1.f / 720))))));
  const int32_t scale_bits = (int32_t(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &scale_bits, sizeof scale);
  return p * scale;
}

// A finite float value (±inf, NaN and doubles between or past the floats are not): scaled_floats' test.
inline bool is_float_value(double x) {
  return std::fabs(x) <= double(std::numeric_limits<float>::max()) && double(float(x)) == x;
}

}  // namespace

// AVX2 + FMA where the CPU has them; the plain loops after #else only keep other targets building.
#if defined(__x86_64__)
namespace {

constexpr int kLanes = 8;

// exp_nonpositive on eight lanes, the same operations (the FMAs round less, within the same bound).
__attribute__((target("avx2,fma"))) inline __m256 exp_nonpositive8(__m256 x) {
  x = _mm256_max_ps(x, _mm256_set1_ps(kLowestArgument));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693145751953125f), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(1.42860682030941723212e-6f), r);
  __m256 p = _mm256_set1_ps(1.f / 720);
  for (const float c : {1.f / 120, 1.f / 24, 1.f / 6, 0.5f, 1.f, 1.f}) p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(c));
  const __m256i scale = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(scale));
}
__attribute__((target("avx2,fma"))) float exp_nonpositive_lane(float x) {
  return _mm256_cvtss_f32(exp_nonpositive8(_mm256_set1_ps(x)));
}

// Lanes [0, count) of a block of kLanes heads (count in [1, kLanes]). A block of heads is read and written whole
// (kWhole) or, for the last heads of a count that is not a multiple of kLanes, through this mask: masked moves are
// slow on some CPUs (AMD's vmaskmovps store is microcoded), so only the tail block takes them.
__attribute__((target("avx2"))) inline __m256i lanes_below(int32_t count) {
  return _mm256_cmpgt_epi32(_mm256_set1_epi32(count), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}
template <bool kWhole>
__attribute__((target("avx2"))) inline __m256 load_heads(const float* p, __m256i lanes) {
  if constexpr (kWhole) return _mm256_loadu_ps(p);
  return _mm256_maskload_ps(p, lanes);  // 0 in the lanes past the block's heads
}
template <bool kWhole>
__attribute__((target("avx2"))) inline void store_heads(float* p, __m256i lanes, __m256 x) {
  if constexpr (kWhole) {
    _mm256_storeu_ps(p, x);
  } else {
    _mm256_maskstore_ps(p, lanes, x);
  }
}
// Calls body(whole, h, lanes) for each block of kLanes heads in [0, n), whole a std::bool_constant: true for the
// full blocks, false for the tail.
template <typename Body>
__attribute__((target("avx2,fma"))) inline void for_head_blocks(int32_t n, const Body& body) {
  int32_t h = 0;
  for (; h + kLanes <= n; h += kLanes) body(std::true_type{}, h, _mm256_set1_epi32(-1));
  if (h < n) body(std::false_type{}, h, lanes_below(n - h));
}

}  // namespace

__attribute__((target("avx2,fma"))) bool row_maxima(const float* rows, int64_t n_rows, int32_t hq, float* maxes) {
  const __m256 largest_finite = _mm256_set1_ps(std::numeric_limits<float>::max());
  const __m256 sign = _mm256_set1_ps(-0.f);
  __m256 bad = _mm256_setzero_ps();
  for_head_blocks(hq, [&](auto whole, int32_t h, __m256i lanes) __attribute__((target("avx2,fma"))) {
    constexpr bool kWhole = decltype(whole)::value;
    __m256 m = load_heads<kWhole>(maxes + h, lanes);
    for (int64_t t = 0; t < n_rows; ++t) {
      const __m256 x = load_heads<kWhole>(rows + t * hq + h, lanes);
      m = _mm256_max_ps(m, x);
      bad = _mm256_or_ps(bad, _mm256_cmp_ps(_mm256_andnot_ps(sign, x), largest_finite, _CMP_NLE_UQ));
    }
    store_heads<kWhole>(maxes + h, lanes, m);
  });
  return _mm256_movemask_ps(bad) == 0;
}

// Blocks of kExpRowBlock rows, each block's heads in turn: walking all of a chunk's rows per block of heads read and
// wrote the rows once per head block from L2 (32 heads, 512 rows: 64 KiB of ŝ and 64 KiB of ê). TOKEN_SELECT at 8K
// keys, one thread, Zen 4: the step took 110-160 us, 80-95 us in blocks. Each head's sum still adds its rows in order.
constexpr int64_t kExpRowBlock = 32;
__attribute__((target("avx2,fma"))) void row_exps(const float* rows, float* exps, int64_t n_rows, int32_t hq,
                                                  const float* maxes, float* sums) {
  std::fill(sums, sums + hq, 0.f);
  for (int64_t first = 0; first < n_rows; first += kExpRowBlock) {
    const int64_t last = std::min(n_rows, first + kExpRowBlock);
    for_head_blocks(hq, [&](auto whole, int32_t h, __m256i lanes) __attribute__((target("avx2,fma"))) {
      constexpr bool kWhole = decltype(whole)::value;
      const __m256 m = load_heads<kWhole>(maxes + h, lanes);
      __m256 sum = load_heads<kWhole>(sums + h, lanes);
      for (int64_t t = first; t < last; ++t) {
        const __m256 e = exp_nonpositive8(_mm256_sub_ps(load_heads<kWhole>(rows + t * hq + h, lanes), m));
        store_heads<kWhole>(exps + t * hq + h, lanes, e);
        sum = _mm256_add_ps(sum, e);
      }
      store_heads<kWhole>(sums + h, lanes, sum);
    });
  }
}

__attribute__((target("avx2,fma"))) void row_counts_reaching(const float* rows, int64_t n_rows, int32_t hq,
                                                             const float* cuts, int64_t* counts) {
  for_head_blocks(hq, [&](auto whole, int32_t h, __m256i lanes) __attribute__((target("avx2,fma"))) {
    constexpr bool kWhole = decltype(whole)::value;
    const int32_t n_lanes = std::min(kLanes, hq - h);
    const __m256 cut = load_heads<kWhole>(cuts + h, lanes);
    __m256i count = _mm256_setzero_si256();
    for (int64_t t = 0; t < n_rows; ++t)
      count = _mm256_sub_epi32(
          count, _mm256_castps_si256(_mm256_cmp_ps(load_heads<kWhole>(rows + t * hq + h, lanes), cut, _CMP_GE_OQ)));
    alignas(32) int32_t found[kLanes];
    _mm256_store_si256(reinterpret_cast<__m256i*>(found), count);
    for (int l = 0; l < n_lanes; ++l) counts[h + l] = found[l];
  });
}

__attribute__((target("avx2"))) bool scaled_floats(const double* values, int64_t n, double scale, float* scaled) {
  constexpr int kDoubles = 4;
  const __m256d largest = _mm256_set1_pd(double(std::numeric_limits<float>::max()));
  const __m256d magnitude_bits = _mm256_castsi256_pd(_mm256_set1_epi64x(0x7fffffffffffffff));
  const __m256d factor = _mm256_set1_pd(scale);
  __m256d all = _mm256_castsi256_pd(_mm256_set1_epi64x(-1));
  int64_t i = 0;
  for (; i + kDoubles <= n; i += kDoubles) {
    const __m256d x = _mm256_loadu_pd(values + i);
    const __m256d narrowed = _mm256_cvtps_pd(_mm256_cvtpd_ps(x));  // finite beyond the float range: ±inf
    const __m256d is_float = _mm256_and_pd(_mm256_cmp_pd(narrowed, x, _CMP_EQ_OQ),
                                           _mm256_cmp_pd(_mm256_and_pd(x, magnitude_bits), largest, _CMP_LE_OQ));
    all = _mm256_and_pd(all, is_float);
    _mm_storeu_ps(scaled + i, _mm256_cvtpd_ps(_mm256_mul_pd(factor, x)));
  }
  bool floats = _mm256_movemask_pd(all) == (1 << kDoubles) - 1;
  for (; i < n; ++i) {
    floats = floats && is_float_value(values[i]);
    scaled[i] = float(scale * (floats ? values[i] : 0.0));
  }
  return floats;
}

// Eight lanes of partial sums, then their sum.
__attribute__((target("avx2,fma"))) void row_votes(const float* rows, int64_t n_rows, int32_t hq, int32_t first,
                                                   int32_t nh, const float* lo_coef, const float* hi_coef, float* lo,
                                                   float* hi) {
  for (int64_t t = 0; t < n_rows; ++t) {
    const float* row = rows + t * hq + first;
    __m256 lo_sum = _mm256_setzero_ps(), hi_sum = _mm256_setzero_ps();
    for_head_blocks(nh, [&](auto whole, int32_t h, __m256i lanes) __attribute__((target("avx2,fma"))) {
    constexpr bool kWhole = decltype(whole)::value;
      const __m256 e = load_heads<kWhole>(row + h, lanes);
      lo_sum = _mm256_fmadd_ps(e, load_heads<kWhole>(lo_coef + h, lanes), lo_sum);
      hi_sum = _mm256_fmadd_ps(e, load_heads<kWhole>(hi_coef + h, lanes), hi_sum);
    });
    alignas(32) float sums[2][kLanes];
    _mm256_store_ps(sums[0], lo_sum);
    _mm256_store_ps(sums[1], hi_sum);
    float l = 0.f, u = 0.f;
    for (int i = 0; i < kLanes; ++i) {
      l += sums[0][i];
      u += sums[1][i];
    }
    lo[t] = l;
    hi[t] = u;
  }
}

__attribute__((target("avx2,fma"))) bool row_split(const float* rows, int64_t first_row, int64_t n_rows, int32_t hq,
                                                   int32_t first, int32_t nh, int32_t g, const float* cut,
                                                   float* light, int32_t* heavy, int64_t stride, int64_t* n_heavy,
                                                   int64_t capacity) {
  const int32_t n_kv = nh / g;
  alignas(32) float sums[kMaxHeadsPerSet];
  int64_t counts[kMaxKvHeads];
  std::fill(sums, sums + nh, 0.f);
  std::copy(n_heavy, n_heavy + n_kv, counts);
  bool heavy_in_kv[kMaxKvHeads];
  bool within = true;
  for (int64_t t = first_row; within && t < first_row + n_rows; ++t) {
    const float* row = rows + t * hq + first;
    int any = 0;
    for_head_blocks(nh, [&](auto whole, int32_t h, __m256i lanes) __attribute__((target("avx2,fma"))) {
    constexpr bool kWhole = decltype(whole)::value;
      const __m256 e = load_heads<kWhole>(row + h, lanes);
      __m256 is_heavy = _mm256_cmp_ps(e, load_heads<kWhole>(cut + h, lanes), _CMP_GE_OQ);
      if constexpr (!kWhole) is_heavy = _mm256_and_ps(is_heavy, _mm256_castsi256_ps(lanes));
      store_heads<kWhole>(sums + h, lanes, _mm256_add_ps(load_heads<kWhole>(sums + h, lanes),
                                                         _mm256_andnot_ps(is_heavy, e)));
      any |= _mm256_movemask_ps(is_heavy);
    });
    if (!any) continue;  // the common case: no head of the set finds this row heavy
    for (int32_t kv = 0; kv < n_kv; ++kv) heavy_in_kv[kv] = false;
    for (int32_t i = 0; i < nh; ++i) heavy_in_kv[i / g] = heavy_in_kv[i / g] || row[i] >= cut[i];
    for (int32_t kv = 0; within && kv < n_kv; ++kv) {
      if (!heavy_in_kv[kv]) continue;
      within = counts[kv] < capacity;
      if (within) heavy[kv * stride + counts[kv]++] = int32_t(t);
    }
  }
  std::copy(sums, sums + nh, light);
  std::copy(counts, counts + n_kv, n_heavy);
  return within;
}
#else
bool row_maxima(const float* rows, int64_t n_rows, int32_t hq, float* maxes) {
  bool finite = true;
  for (int64_t t = 0; t < n_rows; ++t)
    for (int32_t h = 0; h < hq; ++h) {
      maxes[h] = std::max(maxes[h], rows[t * hq + h]);
      finite = finite && std::fabs(rows[t * hq + h]) <= std::numeric_limits<float>::max();
    }
  return finite;
}
void row_exps(const float* rows, float* exps, int64_t n_rows, int32_t hq, const float* maxes, float* sums) {
  for (int32_t h = 0; h < hq; ++h) sums[h] = 0.f;
  for (int64_t t = 0; t < n_rows; ++t)
    for (int32_t h = 0; h < hq; ++h) {
      exps[t * hq + h] = exp_nonpositive(rows[t * hq + h] - maxes[h]);
      sums[h] += exps[t * hq + h];
    }
}
void row_counts_reaching(const float* rows, int64_t n_rows, int32_t hq, const float* cuts, int64_t* counts) {
  for (int32_t h = 0; h < hq; ++h) {
    counts[h] = 0;
    for (int64_t t = 0; t < n_rows; ++t) counts[h] += rows[t * hq + h] >= cuts[h];
  }
}
bool scaled_floats(const double* values, int64_t n, double scale, float* scaled) {
  bool floats = true;
  for (int64_t i = 0; i < n; ++i) {
    floats = floats && is_float_value(values[i]);
    scaled[i] = float(scale * (floats ? values[i] : 0.0));
  }
  return floats;
}
void row_votes(const float* rows, int64_t n_rows, int32_t hq, int32_t first, int32_t nh, const float* lo_coef,
               const float* hi_coef, float* lo, float* hi) {
  for (int64_t t = 0; t < n_rows; ++t) {
    float l = 0.f, u = 0.f;
    for (int32_t h = 0; h < nh; ++h) {
      l += rows[t * hq + first + h] * lo_coef[h];
      u += rows[t * hq + first + h] * hi_coef[h];
    }
    lo[t] = l;
    hi[t] = u;
  }
}
bool row_split(const float* rows, int64_t first_row, int64_t n_rows, int32_t hq, int32_t first, int32_t nh,
               int32_t g, const float* cut, float* light, int32_t* heavy, int64_t stride, int64_t* n_heavy,
               int64_t capacity) {
  float sums[kMaxHeadsPerSet];
  int64_t counts[kMaxKvHeads];
  std::fill(sums, sums + nh, 0.f);
  std::copy(n_heavy, n_heavy + nh / g, counts);
  bool within = true;
  for (int64_t t = first_row; within && t < first_row + n_rows; ++t)
    for (int32_t kv = 0; within && kv < nh / g; ++kv) {
      bool any = false;
      for (int32_t h = kv * g; h < (kv + 1) * g; ++h) {
        const float e = rows[t * hq + first + h];
        if (e >= cut[h]) {
          any = true;
        } else {
          sums[h] += e;
        }
      }
      if (!any) continue;
      within = counts[kv] < capacity;
      if (within) heavy[kv * stride + counts[kv]++] = int32_t(t);
    }
  std::copy(sums, sums + nh, light);
  std::copy(counts, counts + nh / g, n_heavy);
  return within;
}
#endif

float exp_lane(float x) {
#if defined(__x86_64__)
  if (cpu_features().avx2 && cpu_features().fma) return exp_nonpositive_lane(x);
#endif
  return exp_nonpositive(x);
}

}  // namespace sparsa::cpu::screen_rows
