// §8 Δ-Attention correction around any base policy entry.
//
// Per sequence with Sq rows: cut = Sq mod gamma + max(tail_min, gamma), s_p = Sq − cut.
//   rows i >= s_p (all rows when s_p <= 0): dense causal attention;
//   rows i <  s_p: O[i] = O_sparse[i] + (O_dense[r] − O_sparse[r]), r = floor(i / gamma) · gamma.
// The base policy writes into an fp32 staging buffer (OutputSink), then one work item per (b, h) computes only the
// anchor rows {0, gamma, 2·gamma, ... < s_p} and the tail densely (one attend_index_list call over every key) and
// writes every row through the caller's sink. LSE is undefined for corrected rows (the core forbids asking for it).
#include <algorithm>
#include <limits>

#include "../../src/common/policy_sizes.h"
#include "attention_loop.h"
#include "cpu_engine.h"

namespace sparsa::cpu {
namespace {

int64_t sparse_prefix(int64_t seq_q, int64_t gamma, int64_t tail_min) {
  return delta_sparse_prefix(seq_q, gamma, tail_min);  // src/common/policy_sizes.h
}

}  // namespace

void run_delta(PolicyEntry base, const AttentionProblem& problem, const PolicyParams& policy, const OutputSink& sink,
               const ExecContext& exec) {
  const int d = problem.head_dim;
  const int64_t gamma = policy.p.delta_gamma;
  const int64_t tail_min = policy.p.delta_tail_min;

  bool any_sparse_rows = false;
  for (int32_t b = 0; b < problem.batch; ++b)
    any_sparse_rows = any_sparse_rows || sparse_prefix(problem.seq_len_q(b), gamma, tail_min) > 0;

  // The base policy's rows, staged in fp32 (only read for rows < s_p). The base also runs when every row is dense
  // but the caller asked for an output only it writes (selected_indices, block_mask_out): Δ writes every output.
  const bool base_outputs_requested = problem.selected_indices.present || problem.block_mask_out.present;
  const size_t slots = size_t(staging_rows(problem)) * size_t(problem.num_q_heads);
  float* staging = nullptr;
  if (any_sparse_rows || base_outputs_requested) {
    staging = run_scratch(exec, kRunScratchDeltaStaging).reserve(slots * (size_t(d) + 1));
    base(problem, policy, OutputSink{staging, staging + slots * size_t(d)}, exec);
  }

  // Every key position, shared read-only by the dense passes.
  int64_t* all_keys = scratch_array<int64_t>(run_scratch(exec, kRunScratchDeltaKeys), 0, size_t(problem.max_seq_k));
  for (int64_t t = 0; t < problem.max_seq_k; ++t) all_keys[t] = t;

  const float undefined_lse = std::numeric_limits<float>::quiet_NaN();
  const int64_t items = int64_t(problem.batch) * problem.num_q_heads;
  const auto work_item = [&](int64_t item, int worker) {
    const int32_t b = int32_t(item / problem.num_q_heads);
    const int32_t h = int32_t(item % problem.num_q_heads);
    const int64_t seq_q = problem.seq_len_q(b);
    const int64_t seq_k = problem.seq_len_k(b);
    const int64_t s_p = std::max<int64_t>(0, sparse_prefix(seq_q, gamma, tail_min));
    const int64_t anchors = (s_p + gamma - 1) / gamma;
    const int64_t n_dense = anchors + (seq_q - s_p);

    // Policy scratch: dense row positions (int64) | dense rows | their lse | one combined row.
    ThreadScratch& mine = policy_scratch(exec, worker);
    const size_t rows_floats = scratch_floats<int64_t>(size_t(n_dense));
    mine.reserve(rows_floats + size_t(n_dense) * (d + 1) + size_t(d));
    int64_t* dense_rows = scratch_array<int64_t>(mine, 0, size_t(n_dense));
    float* dense_out = mine.buffer.data() + rows_floats;
    float* dense_lse = dense_out + size_t(n_dense) * d;
    float* combined = dense_lse + n_dense;
    for (int64_t a = 0; a < anchors; ++a) dense_rows[a] = a * gamma;
    for (int64_t i = s_p; i < seq_q; ++i) dense_rows[anchors + (i - s_p)] = i;

    const RowVisibility dense_vis{true, seq_k - seq_q, -1, 0};
    attend_index_list(problem, b, h, dense_rows, n_dense, all_keys, seq_k, dense_vis, dense_out, dense_lse,
                      &(*exec.counters)[worker], loop_scratch(exec, worker));

    for (int64_t i = 0; i < s_p; ++i) {
      const int64_t a = i / gamma;
      const float* sparse_row = staging + (staging_row(problem, b, i) * problem.num_q_heads + h) * d;
      const float* sparse_anchor = staging + (staging_row(problem, b, a * gamma) * problem.num_q_heads + h) * d;
      const float* dense_anchor = dense_out + a * d;
      for (int c = 0; c < d; ++c) combined[c] = sparse_row[c] + (dense_anchor[c] - sparse_anchor[c]);
      sink.write_row(problem, b, i, h, combined, i == a * gamma ? dense_lse[a] : undefined_lse);
    }
    for (int64_t i = s_p; i < seq_q; ++i)
      sink.write_row(problem, b, i, h, dense_out + (anchors + i - s_p) * d, dense_lse[anchors + i - s_p]);
  };
  parallel_items(exec, items, work_item);
}

}  // namespace sparsa::cpu
