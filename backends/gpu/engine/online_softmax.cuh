// The online-softmax state of one query row as the GPU kernels keep it, and the epilogue that turns it into outputs
// (ALGORITHMS.md §0). A kernel holds per row m, the running maximum of the scores seen, in the base-2 domain (scores
// multiplied by scale·log2(e), so every exponential is an exp2), l = Σ 2^(s − m), and O = Σ 2^(s − m)·v. Where these
// live (accumulator fragments, shared memory, one warp per row) and how a tile's maximum is reduced stay with each
// kernel; the formulas on one row's scalars are these, so every kernel computes the same operations in the same
// order:
//   update_max / scaled_probability / rescaled_sum   one key tile: the new maximum, P, l
//   merge_weights                                    §0 merge of two states given by their natural-log LSEs
//   finish_row / partial_state_index                 the epilogue: O / l and the LSE, a split-KV partial state
// A kernel whose arithmetic differs keeps its own line and says why next to it (forward_simt.cu's O / l,
// forward_sage.cu's LSE, token_indices.cu's per-step update); forward_decode.cu writes these formulas out itself.
// The CPU backend keeps the same state in natural log with its vector (src/common/softmax_state.h).
#pragma once

#include <cmath>

#include "../runtime/gpu_runtime.h"
#include "forward_common.cuh"
#include "forward_params.h"

SPARSA_GPU_NAMESPACE_BEGIN
namespace softmax {

// exp2 computed exactly (exp2f). The NVIDIA tensor-core kernels pass mma::FastExp2 (one MUFU op) instead.
struct ExactExp2 {
  __device__ __forceinline__ float operator()(float x) const { return exp2f(x); }
};

// One key tile raised a row's running maximum from `running_max` to `max`. The tile's exponentials and the old state
// are measured against `reference`: the new maximum, or 0 for a row that has seen no visible key yet (max = −inf),
// so that 2^(−inf − reference) = 0 instead of NaN. l and O are multiplied by `rescale` = 2^(running_max − reference)
// before the tile's terms are added (0 while the row was empty).
struct MaxUpdate {
  float max;
  float reference;
  float rescale;
};
template <typename Exp2>
__device__ __forceinline__ MaxUpdate update_max(float running_max, float tile_max, Exp2 exp2) {
  const float new_max = fmaxf(running_max, tile_max);  // tile_max already in the base-2 domain
  const float reference = new_max == -INFINITY ? 0.f : new_max;
  return {new_max, reference, exp2(running_max - reference)};
}

// P of a raw score s: 2^(s·scale_log2 − reference), one fused multiply-add before the exp2.
template <typename Exp2>
__device__ __forceinline__ float scaled_probability(float score, float scale_log2, float reference, Exp2 exp2) {
  return exp2(fmaf(score, scale_log2, -reference));
}

// l after a tile: the old sum rescaled, plus the tile's Σ P.
__device__ __forceinline__ float rescaled_sum(float sum, float rescale, float tile_sum) {
  return sum * rescale + tile_sum;
}

// §0 merge of two states given by their natural-log LSEs: m = max(lse_a, lse_b), w_x = e^(lse_x − m),
// out = (w_a·o_a + w_b·o_b)·inverse with inverse = 1 / (w_a + w_b), out_lse = m + ln(w_a + w_b). Two empty states
// (both −inf) give weights 0, a zero row and −inf.
struct MergeWeights {
  float max;
  bool empty;
  float weight_a, weight_b;
  float inverse;
  __device__ __forceinline__ float lse() const { return empty ? -INFINITY : max + logf(weight_a + weight_b); }
};
__device__ __forceinline__ MergeWeights merge_weights(float lse_a, float lse_b) {
  MergeWeights w;
  w.max = fmaxf(lse_a, lse_b);
  w.empty = w.max == -INFINITY;
  w.weight_a = w.empty ? 0.f : expf(lse_a - w.max);
  w.weight_b = w.empty ? 0.f : expf(lse_b - w.max);
  w.inverse = w.empty ? 0.f : 1.f / (w.weight_a + w.weight_b);
  return w;
}

// ---- Epilogue ----

// What the epilogue writes for one row: `inverse`, the factor that normalises O (0 for a row that saw no key, whose
// output is an exact zero row), and the natural-log LSE (m + log2 l)·ln 2 (−inf for that row). One function for both:
// the kernels test l once for the pair (a kernel that needs one of them ignores the other, which is not computed).
struct RowOutput {
  float inverse;
  float lse;
};
__device__ __forceinline__ RowOutput finish_row(float max_log2, float sum) {
  const float inverse = sum > 0.f ? 1.f / sum : 0.f;
  const float lse = sum > 0.f ? (max_log2 + log2f(sum)) * kLn2 : -INFINITY;
  return {inverse, lse};
}

// Split-KV partial states (forward_params.h): the state of (split, query row i of sequence s, head s.h) is
// partial_lse[index] and the head_dim floats at partial_out + index·head_dim, O already normalised by its own l;
// combine_splits_launch merges them (§0).
__device__ __forceinline__ int64_t partial_state_index(const ForwardParams& p, const SequenceView& s, int32_t split,
                                                       int32_t i) {
  return (int64_t(split) * p.flat_rows + flat_query_row(p, s, i)) * p.num_q_heads + s.h;
}

}  // namespace softmax
SPARSA_GPU_NAMESPACE_END
