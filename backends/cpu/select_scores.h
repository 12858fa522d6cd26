// TOKEN_SELECT's scoring kernel (select_scores.cpp): the float64 scores of one kv head's query heads against a tile
// of keys, s[j, l] = scale · Σ_c q̄_l[c] · K_j[c], each the plain sequential sum in channel order (a rounded multiply,
// then a rounded add, starting from 0), so every score is bit-identical to the float64 oracle's whatever the CPU.
//
// The vector versions get their speed from many independent sums, not from reassociation: the tile's keys are
// transposed once into [channel][key] (widened to fp32, or as 16-bit words), then a register block of (query heads ×
// 8-key vectors) accumulators takes one multiply and one add per channel, broadcasting q̄_l[c] and loading 8 keys'
// K[c] widened to float64 (exact). Multiply and add stay separate instructions: select_scores.cpp is compiled with -ffp-contract=off
// (CMakeLists.txt), because GCC contracts even _mm512_mul_pd + _mm512_add_pd into an FMA in an "avx512f" function.
// The one exception is score_tile_exact_products, for q̄ whose products with K are exact: there an FMA rounds once,
// exactly where the add did.
// This header depends on nothing else in the backend (tests/kernels builds the kernels on their own).
#pragma once

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <limits>

namespace sparsa::cpu {

// Keys per call of score_tile (four 8-lane float64 vectors).
constexpr int kScoreTileKeys = 32;

// Floats of the scratch one score_tile call needs: the transposed tile [d][kScoreTileKeys].
inline size_t score_tile_scratch_floats(int32_t d) { return size_t(d) * size_t(kScoreTileKeys); }

struct SelectScoreKernel {
  // scores[j * score_stride + l] = scale · Σ_{c < d} qbars[l * d + c] · K_j[c] (in c order, float64) for
  // j < n_keys (1..kScoreTileKeys), l < n_heads, where K_j is the row of d elements of `dtype` (SPARSA_DTYPE_F32,
  // F16 or BF16; widening is exact) at keys[j] (any alignment). transposed: scratch of
  // score_tile_scratch_floats(d) floats (any alignment).
  void (*score_tile)(const double* qbars, int n_heads, const void* const* keys, int32_t dtype, int n_keys, int32_t d,
                     double scale, float* transposed, double* scores, int64_t score_stride);
  // score_tile for callers that guarantee every product q̄_l[c]·K_j[c] is exact in float64 (qbars_are_floats): then
  // an FMA rounds q̄·K + sum exactly as the separate add does, so a version may fuse them (the AVX2 and AVX-512 ones
  // do, leaving the add pipes to the transpose) and the bits stay score_tile's.
  void (*score_tile_exact_products)(const double* qbars, int n_heads, const void* const* keys, int32_t dtype,
                                    int n_keys, int32_t d, double scale, float* transposed, double* scores,
                                    int64_t score_stride);
  const char* name;  // "avx512bw", "avx2" or "portable"
};

// True when every q̄ element is a float value (or NaN): then each product with a K element of F32, F16 or BF16 has
// at most 24 + 24 significant bits and an exponent within float64's normal range, so it is exact in float64. A
// decode's q̄ is its single query row widened, so this holds for every decode; the mean of several rows may not.
inline bool qbars_are_floats(const double* qbars, int64_t n) {
  for (int64_t i = 0; i < n; ++i) {
    const double x = qbars[i];
    if (std::isnan(x) || std::isinf(x)) continue;  // floats too
    if (!(std::fabs(x) <= double(std::numeric_limits<float>::max())) || double(float(x)) != x) return false;
  }
  return true;
}

// The plain loop (every CPU).
const SelectScoreKernel& portable_select_score_kernel();
// The AVX2 + FMA (4 float64 lanes) and AVX-512F + BW (8 lanes) versions (both widen 16-bit rows with F16C / AVX2):
// null where the CPU (or the build: non-x86, or SPARSA_CPU_PORTABLE_KERNELS) lacks them.
const SelectScoreKernel* avx2_select_score_kernel();
const SelectScoreKernel* avx512_select_score_kernel();
// The one the backend uses: AVX-512, else AVX2, else portable; chosen once per process.
const SelectScoreKernel& select_score_kernel();

}  // namespace sparsa::cpu
