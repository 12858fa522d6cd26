// The CPU backend's tile microkernels: the stages of one attention tile, in a transposed score layout.
//
// Scores are kept as Sᵀ [keys, query rows]: the online-softmax bookkeeping is then vertical SIMD across query rows
// (no horizontal reductions), K and V tiles stay row-major as converted, and only the query tile — loaded once per
// call and reused for every key tile — is transposed.
//   Sᵀ = K · Qᵀ      (qk_tile)
//   softmax          (column_max, exp_columns, scale_row)
//   O += P · V       (pv_tile, reading P from Sᵀ)
// Each stage has a portable version and an AVX2+FMA version (microkernels_avx2.cpp), and the two matrix stages an
// AVX-512F version (microkernels_avx512.cpp, bit-identical to AVX2); select_microkernels() picks a table at run time
// from cpu_features(), so the library is built for plain x86-64 and still uses AVX2 / AVX-512 where
// present. The tables are constant once built.
#pragma once

#include <cstdint>

namespace sparsa::cpu {

// Query tiles are padded to a multiple of this many rows (one AVX2 vector); padding rows hold zeros.
constexpr int kRowAlign = 8;
// Tile row strides get this many floats (one cache line) on top of their width: with power-of-two strides (128
// floats = 512 B) a tile's rows fall into 1/8 of the L1 sets and evict each other (measured: P·V 65 -> 84 GFLOP/s).
constexpr int kStridePad = 16;

struct Microkernels {
  // st[j * st_stride + r] = Σ_c k[j * k_stride + c] · qt[c * qt_stride + r] for j < nk, r < nr_pad.
  void (*qk_tile)(const float* k, int64_t k_stride, int nk, const float* qt, int qt_stride, int nr_pad, int d,
                  float* st, int st_stride);
  // o[r * d + c] += Σ_j pt[j * pt_stride + r] · v[j * v_stride + c] for r < nr, c < d, j < nk.
  void (*pv_tile)(const float* pt, int pt_stride, int nr, int nk, const float* v, int64_t v_stride, int d, float* o);
  // col_max[r] = max_j st[j * st_stride + r] for r < nr_pad (−inf when nk == 0).
  void (*column_max)(const float* st, int st_stride, int nk, int nr_pad, float* col_max);
  // st[j * st_stride + r] = exp(st[...] − shift[r]) (exactly 0 for −inf scores), col_sum[r] = Σ_j of the new values,
  // for r < nr_pad. Every shift[r] is finite.
  void (*exp_columns)(float* st, int st_stride, int nk, int nr_pad, const float* shift, float* col_sum);
  // x[j] *= a for j < n.
  void (*scale_row)(float* x, int n, float a);
  // Σ_c a[c] · b[c] over n int8 values, exact in int32 (SPARGE's quantized path).
  int32_t (*dot_i8)(const int8_t* a, const int8_t* b, int n);
  const char* name;  // "avx512f+avx2", "avx2+fma" or "portable"
};

// The portable table, the AVX2 table (valid only on a CPU with AVX2 and FMA), and the best one for this CPU.
const Microkernels& portable_microkernels();
const Microkernels& avx2_microkernels();
// The AVX2 table with the two matrix kernels in AVX-512F (microkernels_avx512.cpp): bit-identical results, valid
// only on a CPU that has AVX-512F, AVX2 and FMA.
const Microkernels& avx512_microkernels();
const Microkernels& select_microkernels();

}  // namespace sparsa::cpu
