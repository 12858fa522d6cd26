// §4 SPARGE on the device: the block mask is predicted on the device (sparge_predict.h: block statistics, Ŝ,
// softmax, TopCdf / top-k, forced rows and columns; float64 like the CPU backend), written to block_mask_out when
// asked, and walked by the forward kernels as a BLOCK_SPARSE mask — element-wise causal inside diagonal blocks and,
// when λ > −inf for some head, the PV skip (§4.7). The quantized (Sage) path walks the same mask with int8 Q·Kᵀ
// (forward_sage.h). Everything is enqueued on the context's stream; nothing is read back.
//
// Scratch (one carve order for plan() and run(), gpu_launch.h): the block statistics, Ŝ (float64) and the mask
// [B, Hq, ceil(max Sq / bq), ceil(max Skv / bk)], the per-head λ table, the select kernel's global sort space
// (rows of more than kSpargeSharedSortEntries key blocks only), then the forward launch's split-KV partials and the
// Sage path's quantized operands.
#include "../../../src/error.h"
#include "../kernels/forward_sage.h"
#include "../runtime/gpu_policies.h"
#include "sparge_predict.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <string>

SPARSA_GPU_NAMESPACE_BEGIN
namespace {

// Prediction scratch above this is refused (it grows with (Sq / bq) · (Skv / bk) per head; the mask itself is an
// eighth of the float64 scores next to it).
constexpr uint64_t kMaxPredictScratchBytes = uint64_t(4) << 30;

// Sizes of one run's prediction.
struct SpargeDims {
  int64_t q_blocks = 0;  // ceil(max Sq / bq)
  int64_t k_blocks = 0;  // ceil(max Skv / bk)
  int64_t rows = 0;      // B · Hq · q_blocks: mask rows
  int64_t cells = 0;     // rows · k_blocks
  int64_t sort_capacity = 0;  // > 0: the select kernel sorts in global scratch, this many entries per thread block
  int64_t select_grid = 0;
};

SpargeDims sparge_dims(const GpuDevice& device, const AttentionProblem& problem, const PolicyParams& policy) {
  SpargeDims d;
  d.q_blocks = (problem.max_seq_q + policy.p.block_q - 1) / policy.p.block_q;
  d.k_blocks = (problem.max_seq_k + policy.p.block_k - 1) / policy.p.block_k;
  if (problem.block_mask_out.present) {  // every cell of block_mask_out gets written, even past these bounds
    d.q_blocks = std::max(d.q_blocks, problem.block_mask_out.extent(2));
    d.k_blocks = std::max(d.k_blocks, problem.block_mask_out.extent(3));
  }
  d.rows = int64_t(problem.batch) * problem.num_q_heads * d.q_blocks;
  d.cells = d.rows * d.k_blocks;
  d.select_grid = d.rows;
  if (d.k_blocks > 0 && sparge_pow2_at_least(d.k_blocks) > kSpargeSharedSortEntries) {
    d.sort_capacity = sparge_pow2_at_least(d.k_blocks);
    d.select_grid = std::min<int64_t>(d.rows, int64_t(device.multiprocessors) * kSpargeGlobalSortBlocksPerSm);
  }
  return d;
}

uint64_t predict_scratch_bytes(const SpargeDims& d, const AttentionProblem& problem) {
  const uint64_t kv_blocks = uint64_t(problem.batch) * problem.num_kv_heads * d.k_blocks;
  const uint64_t dim = uint64_t(problem.head_dim);
  return sizeof(double) * (kv_blocks * (dim + 1) + uint64_t(d.rows) * (dim + 1) + uint64_t(d.cells)) +
         uint64_t(d.cells) + uint64_t(d.select_grid) * d.sort_capacity * (sizeof(double) + sizeof(uint64_t) + 1);
}

// Without a host read of sparge_head_params (device memory), any override may set λ: the table is then built.
bool pv_skip_possible(const PolicyParams& policy) {
  return policy.sparge_head_params.present || policy.p.sparge_lambda > -std::numeric_limits<float>::infinity();
}

// The forward launch over the predicted mask (§4 step 6: BLOCK_SPARSE with the element-wise causal mask).
ForwardParams masked_forward_params(const AttentionProblem& problem, const PolicyParams& policy, const SpargeDims& d,
                                    const uint8_t* mask, const float* pv_skip_log2) {
  ForwardParams p = make_forward_params(problem, policy);
  p.rule = VisibilityRule::kBlockMask;
  p.block_mask = mask;
  p.block_mask_strides[0] = int64_t(problem.num_q_heads) * d.q_blocks * d.k_blocks;
  p.block_mask_strides[1] = d.q_blocks * d.k_blocks;
  p.block_mask_strides[2] = d.k_blocks;
  p.block_mask_strides[3] = 1;
  p.mask_block_q = policy.p.block_q;
  p.mask_block_k = policy.p.block_k;
  p.pv_skip_log2 = pv_skip_log2;
  return p;
}

}  // namespace

bool sparge_supports(const GpuDevice& device, const AttentionProblem& problem, const PolicyParams& policy,
                     std::string* reason) {
  auto refuse = [&](const std::string& why) {
    if (reason != nullptr) *reason = std::string(backend_name()) + " backend: " + why;
    return false;
  };
  if (problem.selected_indices.present) return refuse("selected_indices is not produced by SPARGE");
  const SpargeDims d = sparge_dims(device, problem, policy);
  if (predict_scratch_bytes(d, problem) > kMaxPredictScratchBytes) {
    return refuse("SPARGE prediction scratch (float64 block scores, B x Hq x ceil(Sq/block_q) x ceil(Skv/block_k)) "
                  "exceeds 4 GiB; use larger blocks");
  }
  // plan_forward only asks whether a λ table exists; any non-null address stands for the one run() carves.
  const float table_stand_in = 0.f;
  const ForwardParams p = masked_forward_params(problem, policy, d, nullptr,
                                                pv_skip_possible(policy) ? &table_stand_in : nullptr);
  if (policy.p.sparge_quantized != 0) {
    return sage_supports(device, p, reason);
  }
  return plan_forward(device, p, problem.max_seq_q, problem.max_seq_k, flat_rows_of(problem),
                      all_rows_aligned_16(problem), reason)
             .kernel != ForwardKernel::kNone;
}

void sparge_run(const GpuDevice& device, const AttentionProblem& problem, const PolicyParams& policy,
                ScratchCarver& carver) {
  const SpargeDims d = sparge_dims(device, problem, policy);
  const bool quantized = policy.p.sparge_quantized != 0;

  SpargePredictParams pp;
  pp.fwd = make_forward_params(problem, policy);
  pp.q_rows_aligned16 = rows_aligned_16(problem.q);
  pp.num_kv_heads = problem.num_kv_heads;
  pp.block_q = policy.p.block_q;
  pp.block_k = policy.p.block_k;
  pp.max_q_blocks = int32_t(d.q_blocks);
  pp.max_k_blocks = int32_t(d.k_blocks);
  pp.scale = double(problem.scale);
  pp.theta = double(policy.p.sparge_theta);
  pp.tau = double(policy.p.sparge_tau);
  pp.topk_fraction = double(policy.p.sparge_topk_fraction);
  pp.lambda = policy.p.sparge_lambda;
  pp.attention_sink = policy.p.sparge_attention_sink != 0;
  if (policy.sparge_head_params.present) {
    pp.head_params = policy.sparge_head_params.ptr<const float>();
    pp.head_params_strides[0] = policy.sparge_head_params.stride(0);
    pp.head_params_strides[1] = policy.sparge_head_params.stride(1);
  }
  if (problem.block_mask_out.present) {
    pp.mask_out = problem.block_mask_out.ptr<uint8_t>();
    for (int dim = 0; dim < 4; ++dim) pp.mask_out_strides[dim] = problem.block_mask_out.stride(dim);
    pp.mask_out_rows = int32_t(problem.block_mask_out.extent(2));
    pp.mask_out_cols = int32_t(problem.block_mask_out.extent(3));
  }

  // Scratch, in one fixed order.
  const uint64_t kv_blocks = uint64_t(problem.batch) * problem.num_kv_heads * d.k_blocks;
  const uint64_t dim = uint64_t(problem.head_dim);
  pp.key_block_means = carver.take<double>(kv_blocks * dim);
  pp.key_mean = carver.take<double>(uint64_t(problem.batch) * problem.num_kv_heads * dim);
  pp.key_sim = carver.take<double>(kv_blocks);
  pp.query_block_means = carver.take<double>(uint64_t(d.rows) * dim);
  pp.query_sim = carver.take<double>(uint64_t(d.rows));
  pp.scores = carver.take<double>(uint64_t(d.cells));
  pp.mask = carver.take<uint8_t>(uint64_t(d.cells));
  if (pv_skip_possible(policy)) pp.pv_skip_log2 = carver.take<float>(uint64_t(problem.num_q_heads));
  pp.select_grid = int32_t(d.select_grid);
  pp.sort_capacity = int32_t(d.sort_capacity);
  if (d.sort_capacity > 0) {
    const uint64_t entries = uint64_t(d.select_grid) * d.sort_capacity;
    pp.sort_values = carver.take<double>(entries);
    pp.sort_keys = carver.take<uint64_t>(entries);
    pp.sort_flags = carver.take<uint8_t>(entries);
  }
  ForwardParams p = masked_forward_params(problem, policy, d, pp.mask, pp.pv_skip_log2);
  const bool aligned16 = all_rows_aligned_16(problem);
  ForwardLaunch launch;
  SageParams sage;
  if (quantized) {
    sage = sage_plan(device, p, problem.num_kv_heads, problem.scale, problem.max_seq_q, problem.max_seq_k, d.k_blocks);
    sage_carve(carver, sage);
  } else {
    launch = plan_forward(device, p, problem.max_seq_q, problem.max_seq_k, flat_rows_of(problem), aligned16, nullptr);
    carve_forward(carver, launch, p);
  }
  if (carver.sizing() || problem.batch == 0 || problem.num_q_heads == 0) return;

  if (d.q_blocks > 0 && d.k_blocks > 0) check(sparge_predict_launch(pp, device.stream), "SPARGE prediction launch");
  // Stats: pairs and blocks from the predicted mask (λ-skipped tiles count as computed, docs/performance.md),
  // PV_BLOCKS_SKIPPED from the attention kernel.
  const StatsParams stats = make_stats_params(problem, policy);
  int64_t* pv_skip_count = nullptr;
  if (stats.out != nullptr) {
    check(stats_count_launch(p, stats, device.stream), "stats_count_kernel launch");
    if (stats.count > SPARSA_STAT_PV_BLOCKS_SKIPPED) {
      pv_skip_count = stats.out + SPARSA_STAT_PV_BLOCKS_SKIPPED * stats.stride;
    }
  }
  if (problem.max_seq_q == 0) return;
  if (quantized) {
    sage.fwd = p;
    sage.key_mean = pp.key_mean;
    sage.pv_skip_count = pv_skip_count;
    check(sage_launch(sage, device.stream), "SPARGE quantized (Sage) launch");
  } else {
    p.pv_skip_count = pv_skip_count;
    launch_forward(device, launch, p);
  }
}

SPARSA_GPU_NAMESPACE_END
