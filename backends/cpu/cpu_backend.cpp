// The CPU backend: owns the worker pool, the per-worker scratch and counters, and maps a policy kind to its entry
// (one function says both whether a case runs and what runs it). Δ wraps any entry; stats are summed here.
#include <algorithm>
#include <memory>
#include <string>
#include <vector>

#include "../../src/backend.h"
#include "../../src/error.h"
#include "../../src/policy_table.h"
#include "../../src/registry.h"
#include "attention_loop.h"
#include "cpu_engine.h"
#include "cpu_token_select.h"
#include "cpu_utilities.h"
#include "microkernels.h"
#include "thread_pool.h"

namespace sparsa::cpu {
namespace {

// The entry running `kind`, or null with `reason` filled when this backend has none.
PolicyEntry policy_entry(int32_t kind, std::string* reason) {
  if (!policy_runs_on(kind, SPARSA_DEVICE_CPU)) {
    if (reason) *reason = "cpu backend: policy kind " + std::to_string(kind) + " is not implemented";
    return nullptr;
  }
  switch (kind) {
    case SPARSA_POLICY_DENSE: return run_dense;
    case SPARSA_POLICY_SINK_WINDOW: return run_sink_window;
    case SPARSA_POLICY_BLOCK_SPARSE: return run_block_sparse;
    case SPARSA_POLICY_SPARGE: return run_sparge;
    case SPARSA_POLICY_TOKEN_SPARSE: return run_token_sparse;
    case SPARSA_POLICY_TOKEN_SELECT: return run_token_select;
    case SPARSA_POLICY_TOKEN_INDICES: return run_token_indices;
    default:
      if (reason) *reason = "cpu backend: policy kind " + std::to_string(kind) + " is not implemented";
      return nullptr;
  }
}

// DENSE and SINK_WINDOW report blocks at the tiling they run at.
static_assert(kDefaultBlockQ == kStatTileRows && kDefaultBlockK == kStatTileKeys, "stats tiling = run tiling");

// Block sizes at which a kind reports SPARSA_STAT_BLOCKS_* (src/policy_table.h); {0, 0}: no block tiling.
std::pair<int32_t, int32_t> stat_block_sizes(const PolicyParams& policy) {
  switch (policy_kind_info(policy.p.kind)->stat_blocks) {
    case StatBlocks::kDefaultTiling: return {kStatTileRows, kStatTileKeys};
    case StatBlocks::kPolicyBlocks: return {policy.p.block_q, policy.p.block_k};
    case StatBlocks::kNone: break;
  }
  return {0, 0};
}

class CpuBackend final : public Backend {
 public:
  explicit CpuBackend(const sparsa_context_options& options) : pool_(options.num_threads) {
    scratch_.resize(scratch_slots_for(pool_.size()));
    counters_.resize(size_t(pool_.size()));
    exec_.pool = &pool_;
    exec_.scratch = &scratch_;
    exec_.counters = &counters_;
  }

  int32_t device_type() const override { return SPARSA_DEVICE_CPU; }
  const char* name() const override { return "cpu"; }
  void set_stream(void*) override {}
  uint64_t scratch_bytes() const override {
    uint64_t bytes = 0;
    for (const ThreadScratch& s : scratch_) bytes += s.buffer.capacity() * sizeof(float);
    return bytes;
  }

  bool supports(const AttentionProblem&, const PolicyParams& policy, std::string* reason) const override {
    return policy_entry(policy.p.kind, reason) != nullptr;
  }

  // Grows every worker's loop scratch for the largest tile this problem uses and Δ's staging; computes nothing.
  // (Policies' own per-item scratch grows on first use and is kept.)
  void plan(const AttentionProblem& problem, const PolicyParams& policy) override {
    const auto [bq, bk] = stat_block_sizes(policy);
    // At least the default tiling (what the token policies and Δ's dense rows use), and never more than the
    // problem holds: a block_q or block_k far above Sq or Skv must not size scratch (the run clamps tiles the same
    // way). Stacked decode heads put up to group · Sq rows in one tile.
    const int64_t group = problem.num_q_heads / problem.num_kv_heads;
    const int64_t problem_rows = std::min<int64_t>(problem.max_seq_q, INT32_MAX) * group;
    const int64_t rows = std::min<int64_t>(std::max<int32_t>(bq, kDefaultBlockQ),
                                           std::max<int64_t>(kDefaultBlockQ, problem_rows));
    const int64_t keys = std::min<int64_t>(std::max<int32_t>(bk, kDefaultBlockK),
                                           std::max<int64_t>(kDefaultBlockK, problem.max_seq_k));
    const size_t d = size_t(problem.head_dim);
    const size_t tile_floats = attention_tile_floats(
        problem.head_dim, rows, keys, policy.p.kind == SPARSA_POLICY_SPARGE && policy.p.sparge_quantized);
    size_t loop_floats = tile_floats;
    if (policy.p.kind == SPARSA_POLICY_SPARGE && policy.p.block_k > 0) {
      const int64_t key_blocks = (problem.max_seq_k + policy.p.block_k - 1) / policy.p.block_k;
      loop_floats = std::max(loop_floats, sparge_predict_scratch_floats(problem.head_dim, key_blocks));
    }
    if (policy.p.kind == SPARSA_POLICY_TOKEN_SELECT) plan_token_select(problem, policy, exec_);
    if (policy.p.kind == SPARSA_POLICY_TOKEN_SPARSE) plan_token_sparse(problem, policy, exec_);
    if (policy.p.kind == SPARSA_POLICY_TOKEN_INDICES) plan_token_indices(problem, policy, exec_);
    if (policy.p.kind == SPARSA_POLICY_DENSE) plan_dense(problem, exec_);
    if (policy.p.kind == SPARSA_POLICY_SINK_WINDOW) plan_query_blocks(problem, kDefaultBlockQ, exec_);
    if (policy.p.kind == SPARSA_POLICY_BLOCK_SPARSE) plan_query_blocks(problem, policy.p.block_q, exec_);
    for (int w = 0; w < pool_.size(); ++w) {
      loop_scratch(exec_, w).reserve(loop_floats);
      policy_scratch(exec_, w).reserve(size_t(rows) * (d + 1) + size_t(problem.max_seq_k) + 2);
    }
    if (policy.delta) {
      const size_t slots = size_t(staging_rows(problem)) * size_t(problem.num_q_heads);
      run_scratch(exec_, kRunScratchDeltaStaging).reserve(slots * (d + 1));
      run_scratch(exec_, kRunScratchDeltaKeys).reserve(2 * size_t(problem.max_seq_k));
    }
    equalise_worker_scratch();
  }

  void run(const AttentionProblem& problem, const PolicyParams& policy) override {
    std::string reason;
    const PolicyEntry entry = policy_entry(policy.p.kind, &reason);
    if (!entry) fail(SPARSA_STATUS_UNSUPPORTED, reason);
    std::fill(counters_.begin(), counters_.end(), RunCounters{});
    const OutputSink direct{};
    if (policy.delta) {
      run_delta(entry, problem, policy, direct, exec_);
    } else {
      entry(problem, policy, direct, exec_);
    }
    if (problem.stats.present) write_stats(problem, policy);
    equalise_worker_scratch();
  }

  void merge_states(const MergeProblem& problem) override { cpu_merge_states(problem, exec_); }
  void topk_from_scores(const TensorArg& scores, int32_t k, int32_t block_size, const TensorArg& out_indices) override {
    cpu_topk_from_scores(scores, k, block_size, out_indices, exec_);
  }
  void kv_prefetch(const PrefetchProblem& problem) override { cpu_kv_prefetch(problem, exec_); }
  void cp_select(const CpSelectCall& call) override { cpu_cp_select(call, exec_); }
  std::unique_ptr<SelectionCacheState> create_selection_cache(const SelectionCacheDims& dims) override {
    return make_cpu_selection_cache(dims);
  }

 private:
  // Work items go to whichever worker is free, so after a run only some workers' scratch may have grown for a
  // given item size. Growing every worker's buffers to the largest capacity makes the next run of the same problem
  // allocate nothing, whichever worker picks up which item.
  void equalise_worker_scratch() {
    using SlotOf = ThreadScratch& (*)(const ExecContext&, int);
    for (const SlotOf slot_of : {SlotOf(loop_scratch), SlotOf(policy_scratch)}) {
      size_t largest = 0;
      for (int w = 0; w < pool_.size(); ++w) largest = std::max(largest, slot_of(exec_, w).buffer.capacity());
      for (int w = 0; w < pool_.size(); ++w) slot_of(exec_, w).buffer.reserve(largest);
    }
  }

  void write_stats(const AttentionProblem& problem, const PolicyParams& policy) const {
    RunCounters total;
    for (const RunCounters& c : counters_) total.add(c);
    int64_t values[SPARSA_STAT_COUNT] = {};
    values[SPARSA_STAT_PAIRS_COMPUTED] = total.pairs_computed;
    const auto [bq, bk] = stat_block_sizes(policy);
    for (int32_t b = 0; b < problem.batch; ++b) {
      values[SPARSA_STAT_PAIRS_DENSE] += dense_pairs(problem, b) * problem.num_q_heads;
      if (bq > 0) values[SPARSA_STAT_BLOCKS_TOTAL] += dense_tiles(problem, b, bq, bk) * problem.num_q_heads;
    }
    values[SPARSA_STAT_BLOCKS_COMPUTED] = bq > 0 ? total.blocks_computed : 0;
    values[SPARSA_STAT_PV_BLOCKS_SKIPPED] = total.pv_blocks_skipped;
    if (policy.p.kind == SPARSA_POLICY_TOKEN_SELECT) {
      const SelectionCacheRunCounts cache = selection_cache_run_counts(problem.selection_cache);
      values[SPARSA_STAT_CACHE_HITS] = cache.hits;
      values[SPARSA_STAT_CACHE_MISSES] = cache.misses;
    }
    const int64_t n = std::min<int64_t>(problem.stats.extent(0), SPARSA_STAT_COUNT);
    int64_t* out = problem.stats.ptr<int64_t>();
    for (int64_t i = 0; i < n; ++i) out[i * problem.stats.stride(0)] = values[i];
  }

  ThreadPool pool_;
  std::vector<ThreadScratch> scratch_;
  std::vector<RunCounters> counters_;
  ExecContext exec_;
};

}  // namespace
}  // namespace sparsa::cpu

namespace sparsa {

std::unique_ptr<Backend> create_cpu_backend(const sparsa_context_options& options) {
  return std::make_unique<cpu::CpuBackend>(options);
}

}  // namespace sparsa
