// What the §5 TOKEN_SPARSE kernels share: the parameter block, the per-sequence view, and the score passes' launch
// (token_sparse_score.cu), which gpu_token_sparse.cu chains with pooling, the budget, the top-k and the attention.
#pragma once

#include <cmath>
#include <cstdint>

#include "../engine/forward_common.cuh"
#include "attention_stats.h"

SPARSA_GPU_NAMESPACE_BEGIN
namespace token_sparse {

constexpr int kLanes = 32;  // the kernels' warp layout; on a 64-wide HIP wavefront each half plays one warp
// Keys one scoring block walks: pass 1 writes one (max, Σexp) partial per window row per kKeysPerBlock keys.
constexpr int kKeysPerBlock = 256;
constexpr double kNegInf = -INFINITY;

// Everything the selection kernels read (filled on the host by token_sparse_run).
struct SparseParams {
  ForwardParams fw;          // tensors, layouts and sizes (row_map kAll)
  double scale = 0.0;        // softmax scale, float64 as the CPU multiplies it
  int32_t window = 0;        // W
  int32_t pool_kernel = 0;   // odd; padding pool_kernel / 2, zeros counted
  int32_t min_tokens = 0;
  double coverage = 0.0;     // τ as the CPU reads it: double(float)
  bool q_aligned16 = false;  // q rows start on 16-byte boundaries (vector staging)
  bool out_aligned16 = false;  // out rows start on 16-byte boundaries and span whole 16-byte chunks (zeroed rows)
  int32_t key_chunks = 0;    // kKeysPerBlock chunks of the longest sequence
  int64_t cand_stride = 0;   // row stride of the per-(b, h) candidate arrays: >= every L − W
  double* partial_max = nullptr;  // [B·Hq, key_chunks, W]
  double* partial_sum = nullptr;  // [B·Hq, key_chunks, W]
  double* row_lse = nullptr;      // [B·Hq, W]
  double* attention = nullptr;    // p_h: [B·Hq, cand_stride]
  double* scores = nullptr;       // ŝ_h: [B·Hq, cand_stride]
  double* layer = nullptr;        // s_l: [B, cand_stride]
  double* pool_totals = nullptr;  // [B·Hq, pool_blocks]: block sums of the pooled scores
  int32_t pool_blocks = 0;        // blocks along the candidates of the pooling launch
  int32_t* lengths = nullptr;     // [B·Hq]: L − W, 0 for a dense sequence (device_topk's segment lengths)
  int32_t* budget = nullptr;      // [B]: candidates kept per head, 0 for a dense sequence
  int32_t* lists = nullptr;       // S_h: [B·Hq, capacity] ascending positions
  int32_t* counts = nullptr;      // |S_h|: [B·Hq]
  int32_t capacity = 0;           // >= every L
  int32_t* selected = nullptr;    // optional selected_indices [B, Hq, cap]
  int64_t selected_strides[3] = {0, 0, 0};
  int32_t selected_cap = 0;
  StatsParams stats;
};

// One sequence as §5 sees it.
struct SparseSequence {
  int32_t length = 0;      // L
  bool dense = true;       // §5.1
  int32_t candidates = 0;  // L − W when sparse, else 0
};

__device__ __forceinline__ SparseSequence sparse_sequence(const SparseParams& sp, const SequenceView& s) {
  SparseSequence q;
  q.length = s.seq_q < s.seq_k ? s.seq_q : s.seq_k;
  q.dense = int64_t(q.length) <= int64_t(sp.min_tokens) + sp.window || sp.coverage == 0.0;
  q.candidates = q.dense ? 0 : q.length - sp.window;
  return q;
}

// Which arithmetic scores the window rows (§0 "Precision of selections").
enum class ScorePrecision {
  kFp32,     // fp16/bf16 tensor cores, fp32 accumulation and softmax statistics (NVIDIA, head_dim % 16 == 0,
             // head_dim <= 128, 16-byte aligned rows); relative error of ŝ_h and s_l bounded by score_error_bound
  kFloat64,  // float64 products and sums, as the CPU oracle (fp32 inputs, other head dims, unaligned rows, HIP)
};
ScorePrecision score_precision(const SparseParams& sp);

// Score pass 1 (candidate_sums = false): per window row and key chunk, the (max, Σexp) partials over keys [0, L).
// Score pass 2 (candidate_sums = true): p_h[j] = (1/W) Σ_r exp(S[r, j] − lse_r) over the candidates [0, L − W).
// Grid: (key_chunks, Hq, B).
void launch_score_pass(const SparseParams& sp, ScorePrecision precision, bool candidate_sums, cudaStream_t stream);

}  // namespace token_sparse
SPARSA_GPU_NAMESPACE_END
