// SPARGE block-mask prediction on the device (§4 steps 1–6), in float64 like the CPU backend
// (backends/cpu/cpu_sparge_predict.cpp), so that the selections of both backends agree wherever the float64
// reference is not within rounding of a threshold. Every launch is enqueued on one stream with no host
// synchronisation; sequence lengths are read on the device (varlen, seq_lens_k).
//
// The launches, in order (sparge_predict.cu):
//   1. key block sums       Σ k over each key block (raw), per kv head          -> key_block_means (temporarily)
//   2. key mean             Σ over blocks / Skv, per kv head                      -> key_mean
//   3. key block stats      centred block means and self-similarity           -> key_block_means, key_sim
//   4. query block stats    block means and self-similarity (raw Q)            -> query_block_means, query_sim
//   5. block scores         Ŝ = scale · q̄·k̄ (a small float64 GEMM per head)        -> scores
//   6. select               −inf for non-self-similar / future key blocks, softmax, sort, TopCdf or top-k, forced
//                           rows/columns, sink column, ∧ causal                    -> mask (+ block_mask_out)
//   (+ the per-head λ·log2(e) table of the PV skip, when asked)
#pragma once

#include <cstddef>
#include <cstdint>

#include "../engine/forward_params.h"
#include "../runtime/gpu_runtime.h"

SPARSA_GPU_NAMESPACE_BEGIN

// Key blocks per row that the select kernel sorts in shared memory; longer rows sort in global scratch.
constexpr int32_t kSpargeSharedSortEntries = 2048;
// Thread blocks per multiprocessor of the select kernel when it sorts in global scratch (bounds that scratch).
constexpr int32_t kSpargeGlobalSortBlocksPerSm = 4;

struct SpargePredictParams {
  // Tensors, layouts and sequence lengths of the run (make_forward_params; the visibility rule is not read).
  ForwardParams fwd;
  bool q_rows_aligned16 = false;  // q base and row strides allow 16-byte loads (k's: fwd.kv_rows_aligned16)
  int32_t num_kv_heads = 0;
  int32_t block_q = 0, block_k = 0;
  int32_t max_q_blocks = 0;  // ceil(max Sq / block_q): rows of the mask
  int32_t max_k_blocks = 0;  // ceil(max Skv / block_k): columns of the mask
  double scale = 0.0;        // the softmax scale (§0), as the CPU's double(problem.scale)

  // Scalar parameters and the optional per-head overrides [Hq, 4] (theta, tau, topk_fraction, lambda; NaN = scalar).
  double theta = 0.0, tau = 0.0, topk_fraction = 0.0;
  float lambda = 0.f;
  bool attention_sink = false;
  const float* head_params = nullptr;
  int64_t head_params_strides[2] = {0, 0};

  // Scratch (carved by gpu_sparge.cu).
  double* key_block_means = nullptr;    // [B, Hkv, max_k_blocks, D]: raw block sums after launch 1, centred means after 3
  double* key_mean = nullptr;           // [B, Hkv, D]
  double* key_sim = nullptr;            // [B, Hkv, max_k_blocks]
  double* query_block_means = nullptr;  // [B, Hq, max_q_blocks, D]
  double* query_sim = nullptr;          // [B, Hq, max_q_blocks]
  double* scores = nullptr;             // [B, Hq, max_q_blocks, max_k_blocks]
  uint8_t* mask = nullptr;              // [B, Hq, max_q_blocks, max_k_blocks], 0 outside each sequence
  float* pv_skip_log2 = nullptr;        // [Hq] λ_h · log2(e), or null (not computed)

  // block_mask_out (null when absent), its element strides and its last two extents (the caller's maximum block
  // counts; with device-resident varlen lengths the mask above is sized by the totals Tq, Tk instead).
  uint8_t* mask_out = nullptr;
  int64_t mask_out_strides[4] = {0, 0, 0, 0};
  int32_t mask_out_rows = 0, mask_out_cols = 0;

  // Select kernel: grid size and, when a row's key blocks do not fit in shared memory, its global sort scratch
  // (sort_capacity entries per thread block: P̂ values, rank keys, kept flags).
  int32_t select_grid = 0;
  int32_t sort_capacity = 0;  // 0 = shared-memory sort
  double* sort_values = nullptr;
  uint64_t* sort_keys = nullptr;
  uint8_t* sort_flags = nullptr;
};

// Smallest power of two >= n (n >= 1): the bitonic sort's length for n key blocks.
__host__ __device__ inline int64_t sparge_pow2_at_least(int64_t n) {
  int64_t value = 1;
  while (value < n) value <<= 1;
  return value;
}

// Enqueues the prediction launches on `stream`. Requires max_q_blocks, max_k_blocks, batch and heads > 0.
cudaError_t sparge_predict_launch(const SpargePredictParams& p, cudaStream_t stream);

SPARSA_GPU_NAMESPACE_END
