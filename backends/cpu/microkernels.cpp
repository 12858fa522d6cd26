// Portable microkernels and the run-time selection (see microkernels.h).
#include "microkernels.h"
#include "cpu_features.h"

#include <cmath>
#include <limits>

namespace sparsa::cpu {
namespace {

void qk_tile_portable(const float* k, int64_t k_stride, int nk, const float* qt, int qt_stride, int nr_pad, int d,
                      float* st, int st_stride) {
  for (int j = 0; j < nk; ++j) {
    float* st_row = st + int64_t(j) * st_stride;
    for (int r = 0; r < nr_pad; ++r) st_row[r] = 0.f;
    for (int c = 0; c < d; ++c) {
      const float k_jc = k[j * k_stride + c];
      const float* qt_row = qt + int64_t(c) * qt_stride;
      for (int r = 0; r < nr_pad; ++r) st_row[r] += k_jc * qt_row[r];
    }
  }
}

void pv_tile_portable(const float* pt, int pt_stride, int nr, int nk, const float* v, int64_t v_stride, int d,
                      float* o) {
  for (int j = 0; j < nk; ++j) {
    const float* v_row = v + j * v_stride;
    for (int r = 0; r < nr; ++r) {
      const float p_rj = pt[int64_t(j) * pt_stride + r];
      if (p_rj == 0.f) continue;
      float* o_row = o + int64_t(r) * d;
      for (int c = 0; c < d; ++c) o_row[c] += p_rj * v_row[c];
    }
  }
}

void column_max_portable(const float* st, int st_stride, int nk, int nr_pad, float* col_max) {
  for (int r = 0; r < nr_pad; ++r) col_max[r] = -std::numeric_limits<float>::infinity();
  for (int j = 0; j < nk; ++j)
    for (int r = 0; r < nr_pad; ++r) {
      const float x = st[int64_t(j) * st_stride + r];
      col_max[r] = x > col_max[r] ? x : col_max[r];
    }
}

void exp_columns_portable(float* st, int st_stride, int nk, int nr_pad, const float* shift, float* col_sum) {
  for (int r = 0; r < nr_pad; ++r) col_sum[r] = 0.f;
  for (int j = 0; j < nk; ++j)
    for (int r = 0; r < nr_pad; ++r) {
      float& x = st[int64_t(j) * st_stride + r];
      x = std::exp(x - shift[r]);
      col_sum[r] += x;
    }
}

void scale_row_portable(float* x, int n, float a) {
  for (int j = 0; j < n; ++j) x[j] *= a;
}

int32_t dot_i8_portable(const int8_t* a, const int8_t* b, int n) {
  int32_t sum = 0;
  for (int c = 0; c < n; ++c) sum += int32_t(a[c]) * int32_t(b[c]);
  return sum;
}

constexpr Microkernels kPortable = {qk_tile_portable,     pv_tile_portable,   column_max_portable,
                                    exp_columns_portable, scale_row_portable, dot_i8_portable, "portable"};

}  // namespace

const Microkernels& portable_microkernels() { return kPortable; }

// Building with -DSPARSA_CPU_PORTABLE_KERNELS forces the portable kernels (to test them on an AVX2 machine); off x86
// (aarch64) the portable kernels are the only ones.
const Microkernels& select_microkernels() {
#if defined(SPARSA_CPU_PORTABLE_KERNELS) || !(defined(__x86_64__) || defined(__i386__))
  return kPortable;
#else
  const CpuFeatures& cpu = cpu_features();
  if (cpu.avx2 && cpu.fma) {
    if (cpu.avx512f) return avx512_microkernels();
    return avx2_microkernels();
  }
  return kPortable;
#endif
}

}  // namespace sparsa::cpu
