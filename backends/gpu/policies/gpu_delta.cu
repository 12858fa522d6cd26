// §8 Δ-Attention on the device, around any base policy (mirrors backends/cpu/cpu_delta.cpp).
//
// Per sequence with Sq rows: cut = Sq mod gamma + max(tail_min, gamma), s_p = max(0, Sq - cut).
//   1. the base policy writes every row into `out` (skipped when no sequence can have s_p > 0, as on the CPU);
//   2. ONE forward launch with row_map = kDeltaRows (dense rule, causal) computes the anchor rows {0, gamma, ...
//      < s_p} and the tail rows [s_p, Sq) into a compact scratch buffer [B, max_rows, Hq, D] in out's dtype
//      (every forward kernel already writes that dtype, and the sparse rows it corrects are stored in it anyway,
//      so fp32 here would not remove a rounding step; it also halves the scratch for fp16/bf16);
//   3. the correction: rows i < s_p get out[i] + (dense[anchor] - out[r]) with r = floor(i/gamma)·gamma, rows
//      i >= s_p get the dense row. One thread block per (b, h, compact row): an anchor's block owns the rows
//      [r, r + gamma) and each thread one column, so out[r] is read before the same thread overwrites it.
// Stats: the dense pass adds its pairs to PAIRS_COMPUTED (docs/performance.md "Stats conventions"); when the base
// was skipped this file also adds what the base's count would have (PAIRS_DENSE, BLOCKS_TOTAL).
#include <algorithm>

#include "../../../src/common/policy_sizes.h"
#include "../../../src/error.h"
#include "../engine/forward_common.cuh"
#include "../runtime/gpu_policies.h"

SPARSA_GPU_NAMESPACE_BEGIN
namespace {

constexpr int kCorrectThreads = 128;  // columns of a row per pass (head_dim <= 256: at most two passes)
constexpr int kStatsThreads = 256;

enum StatIndex { kPairsComputed = 0, kPairsDense = 1, kBlocksComputed = 2, kBlocksTotal = 3 };

int64_t sparse_prefix(int64_t seq_q, int64_t gamma, int64_t tail_min) {
  return delta_sparse_prefix(seq_q, gamma, tail_min);  // src/common/policy_sizes.h
}

// Upper bound of any sequence's compact row count anchors + (Sq - s_p) for Sq <= max_seq_q: Sq - s_p <= gamma - 1 +
// max(tail_min, gamma) and anchors <= ceil(Sq / gamma) when s_p > 0, and rows = Sq when s_p <= 0.
int64_t max_dense_rows(int64_t max_seq_q, int64_t gamma, int64_t tail_min) {
  const int64_t bound = (max_seq_q + gamma - 1) / gamma + gamma - 1 + std::max(tail_min, gamma);
  return std::min(max_seq_q, bound);
}

size_t element_size(ElementType type) { return type == ElementType::kF32 ? sizeof(float) : sizeof(uint16_t); }

// Where the compact dense rows live: row a of (b, h) at b·stride_b + a·stride_s + h·head_dim.
struct DenseRows {
  const void* base = nullptr;
  int64_t stride_b = 0, stride_s = 0;
};

// The dense pass's ForwardParams: the problem's q/k/v, dense causal rule, kDeltaRows, compact output (no lse).
ForwardParams dense_rows_params(const AttentionProblem& problem, const PolicyParams& policy, int64_t max_rows) {
  ForwardParams p = make_forward_params(problem, policy);
  p.rule = VisibilityRule::kDense;
  p.block_mask = nullptr;
  p.lse = nullptr;  // the core rejects LSE together with Δ
  p.row_map = QueryRowMap::kDeltaRows;
  p.delta_gamma = policy.p.delta_gamma;
  p.delta_tail_min = policy.p.delta_tail_min;
  const int64_t row_stride = int64_t(problem.num_q_heads) * problem.head_dim;
  p.out_strides = TensorStrides{max_rows * row_stride, row_stride, problem.head_dim};
  return p;
}

bool tensors_aligned16(const AttentionProblem& problem) {
  // The compact output's rows are head_dim apart from a 256-byte aligned base.
  return rows_aligned_16(problem.q) && rows_aligned_16(problem.k) && rows_aligned_16(problem.v) &&
         (problem.head_dim * element_size(element_type_of(problem.dtype))) % 16 == 0;
}

// Grid (compact row a, h, b). Anchor a < anchors: rows [a·gamma, min((a+1)·gamma, s_p)) of out get
// dense[a] - out[a·gamma] added; tail row a: out[s_p + a - anchors] = dense[a].
__global__ void __launch_bounds__(kCorrectThreads) delta_correct_kernel(const ForwardParams p, const DenseRows dense,
                                                                        void* out, const TensorStrides out_strides) {
  const SequenceView seq = make_sequence_view(p, blockIdx.z, blockIdx.y);
  const int32_t a = blockIdx.x;
  if (a >= seq.rows) return;
  const int64_t dense_row = seq.b * dense.stride_b + int64_t(a) * dense.stride_s + int64_t(seq.h) * p.head_dim;
  if (a >= seq.delta_anchors) {
    const int64_t out_row = query_row_offset(out_strides, seq, row_position(p, seq, a));
    for (int d = threadIdx.x; d < p.head_dim; d += blockDim.x) {
      store_value(out, out_row + d, p.element_type, load_value(dense.base, dense_row + d, p.element_type));
    }
    return;
  }
  const int32_t first = a * p.delta_gamma;
  const int32_t last = min(first + p.delta_gamma, seq.delta_prefix);
  const int64_t anchor_row = query_row_offset(out_strides, seq, first);
  for (int d = threadIdx.x; d < p.head_dim; d += blockDim.x) {
    const float difference =
        load_value(dense.base, dense_row + d, p.element_type) - load_value(out, anchor_row + d, p.element_type);
    for (int32_t i = first; i < last; ++i) {
      const int64_t at = query_row_offset(out_strides, seq, i) + d;
      store_value(out, at, p.element_type, load_value(out, at, p.element_type) + difference);
    }
  }
}

__device__ __forceinline__ int64_t causal_keys(const SequenceView& s, int64_t position) {
  const int64_t end = position + s.causal_offset + 1;
  return end < 0 ? 0 : (end > s.seq_k ? s.seq_k : end);
}

// One block per (h, b): PAIRS_COMPUTED of the dense rows; with `base_skipped`, also the base's PAIRS_DENSE and
// BLOCKS_TOTAL (Δ is causal, so both are the causal closed forms of attention_stats.cu).
__global__ void __launch_bounds__(kStatsThreads) delta_stats_kernel(const ForwardParams p, const StatsParams st,
                                                                    const bool base_skipped) {
  __shared__ unsigned long long block_sums[3];
  if (threadIdx.x < 3) block_sums[threadIdx.x] = 0;
  __syncthreads();
  const SequenceView s = make_sequence_view(p, blockIdx.y, blockIdx.x);
  int64_t pairs = 0, dense = 0, tiles = 0;
  for (int32_t a = threadIdx.x; a < s.rows; a += blockDim.x) pairs += causal_keys(s, row_position(p, s, a));
  if (base_skipped) {
    for (int32_t i = threadIdx.x; i < s.seq_q; i += blockDim.x) dense += causal_keys(s, i);
    if (st.tile_rows > 0) {
      for (int32_t row0 = threadIdx.x * st.tile_rows; row0 < s.seq_q; row0 += blockDim.x * st.tile_rows) {
        const int32_t last = min(s.seq_q, row0 + st.tile_rows) - 1;
        tiles += (causal_keys(s, last) + st.tile_keys - 1) / st.tile_keys;
      }
    }
  }
  if (pairs != 0) atomicAdd(&block_sums[0], static_cast<unsigned long long>(pairs));
  if (dense != 0) atomicAdd(&block_sums[1], static_cast<unsigned long long>(dense));
  if (tiles != 0) atomicAdd(&block_sums[2], static_cast<unsigned long long>(tiles));
  __syncthreads();
  if (threadIdx.x == 0) {
    stats_add(st, kPairsComputed, static_cast<int64_t>(block_sums[0]));
    stats_add(st, kPairsDense, static_cast<int64_t>(block_sums[1]));
    stats_add(st, kBlocksTotal, static_cast<int64_t>(block_sums[2]));
  }
}

}  // namespace

bool delta_supports(const GpuDevice& device, const AttentionProblem& problem, const PolicyParams& policy,
                    std::string* reason) {
  const int64_t max_rows = max_dense_rows(problem.max_seq_q, policy.p.delta_gamma, policy.p.delta_tail_min);
  const ForwardParams p = dense_rows_params(problem, policy, max_rows);
  return plan_forward(device, p, max_rows, problem.max_seq_k, int64_t(problem.batch) * max_rows,
                      tensors_aligned16(problem), reason)
             .kernel != ForwardKernel::kNone;
}

void delta_run(const GpuDevice& device, const AttentionProblem& problem, const PolicyParams& policy,
               ScratchCarver& carver, const BaseRun& run_base) {
  const int64_t gamma = policy.p.delta_gamma;
  const int64_t tail_min = policy.p.delta_tail_min;
  // s_p grows with Sq, so the longest sequence (max_seq_q bounds it) decides whether any row is sparse.
  const bool base_skipped = sparse_prefix(problem.max_seq_q, gamma, tail_min) <= 0;
  if (!base_skipped) run_base(carver);

  const int64_t max_rows = max_dense_rows(problem.max_seq_q, gamma, tail_min);
  ForwardParams p = dense_rows_params(problem, policy, max_rows);
  ForwardLaunch launch = plan_forward(device, p, max_rows, problem.max_seq_k, int64_t(problem.batch) * max_rows,
                                      tensors_aligned16(problem), nullptr);
  if (launch.kernel == ForwardKernel::kNone) fail(SPARSA_STATUS_INTERNAL, backend_name(), " backend: Δ has no kernel");
  launch.num_splits = 1;  // a row map runs unsplit (forward_params.h)
  launch.flat_rows = 0;
  const uint64_t dense_elements = uint64_t(problem.batch) * max_rows * problem.num_q_heads * problem.head_dim;
  char* dense = carver.take<char>(dense_elements * element_size(p.element_type));
  if (carver.sizing() || problem.batch == 0 || problem.num_q_heads == 0 || max_rows == 0) return;

  p.out = dense;
  const StatsParams stats = make_stats_params(problem, policy);
  if (stats.out != nullptr) {
    delta_stats_kernel<<<dim3(problem.num_q_heads, problem.batch), kStatsThreads, 0, device.stream>>>(p, stats,
                                                                                                   base_skipped);
    check(cudaGetLastError(), "delta_stats_kernel launch");
  }
  launch_forward(device, launch, p);

  DenseRows rows;
  rows.base = dense;
  rows.stride_b = p.out_strides.b;
  rows.stride_s = p.out_strides.s;
  const dim3 grid(uint32_t(max_rows), problem.num_q_heads, problem.batch);
  delta_correct_kernel<<<grid, kCorrectThreads, 0, device.stream>>>(p, rows, problem.out.t.data,
                                                                     row_strides(problem.out));
  check(cudaGetLastError(), "delta_correct_kernel launch");
}

SPARSA_GPU_NAMESPACE_END
