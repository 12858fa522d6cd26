// TOKEN_SPARSE (§5) on the CPU: score tokens with the last W queries, drop the least-attended ones per head, and run
// causal attention inside each head's compressed sequence; rows a head dropped come out exactly 0.
//
// Phases, each parallel over independent items (results never depend on the thread count):
//   0. per sequence: length L, dense fallback (§5.1), the selected_indices capacity check (nothing is written
//      before it ends);
//   1. per (b, h): ŝ_h over the candidates [0, L − W) (§5.2–4), float64, O(W·L) memory per worker;
//   2. per sequence: layer score, n_drop and the budget (§5.4–5);
//   3. per (b, h): S_h = top-budget candidates ∪ the window (§5.6), selected_indices, zero rows for the dropped
//      positions and attention of rows S_h over keys S_h, causal by position (§5.7–8).
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <numeric>

#include "../../src/error.h"
#include "attention_loop.h"
#include "cpu_select_util.h"

namespace sparsa::cpu {
namespace {

struct SparseParams {
  int64_t window = 0;       // W
  int64_t pool_kernel = 0;  // odd; padding pool_kernel / 2, zeros counted
  double coverage = 0.0;    // τ
  int64_t min_tokens = 0;
};

struct SequencePlan {
  int64_t length = 0;        // L (Sq == Skv, checked by the core)
  bool dense = true;         // §5.1
  int64_t n_candidates = 0;  // L − W: the positions that can be dropped
  int64_t budget = 0;        // candidates kept per head (§5.5)
  int64_t scores_offset = 0;  // start of this sequence's [Hq, n_candidates] block in the score buffer
};

// Phase 1 for one (b, h): writes ŝ_h[0 .. L − W) to `normalised` (§5.2–4). Keeps the W × L score matrix of the
// window rows (O(W·L) per worker) so every score is computed once.
void score_candidates(const AttentionProblem& problem, int32_t b, int32_t h, const SequencePlan& plan,
                      const SparseParams& params, ThreadScratch& scratch, double* normalised) {
  const int32_t d = problem.head_dim;
  const int32_t hk = kv_head_of(problem, h);
  const int64_t length = plan.length;
  const int64_t n_candidates = plan.n_candidates;
  const int64_t window = params.window;
  const int64_t first_row = length - window;
  const size_t queries_size = interleaved_size(window, d);
  const size_t matrix_size = size_t(length) * size_t(window);
  ScratchLayout layout;
  const size_t queries_at = layout.add<double>(queries_size);
  const size_t row_at = layout.add<float>(size_t(kDotKeys) * size_t(d));
  const size_t matrix_at = layout.add<double>(matrix_size);
  const size_t max_at = layout.add<double>(size_t(window));
  const size_t sum_at = layout.add<double>(size_t(window));
  const size_t attention_at = layout.add<double>(size_t(n_candidates));
  layout.bind(scratch);
  double* queries = layout.get<double>(queries_at, queries_size);  // the window rows, interleaved
  float* row = layout.get<float>(row_at, size_t(kDotKeys) * size_t(d));  // kDotKeys key rows
  double* matrix = layout.get<double>(matrix_at, matrix_size);  // [L, W]: key j's scores against every window row
  double* row_max = layout.get<double>(max_at, size_t(window));
  double* row_sum = layout.get<double>(sum_at, size_t(window));
  double* attention = layout.get<double>(attention_at, size_t(n_candidates));  // p_h
  // Window row r = L − W + w sees key j iff j <= r, i.e. w >= first_visible(j).
  const auto first_visible = [first_row](int64_t j) { return std::max<int64_t>(0, j - first_row); };

  // §5.2: scale · q_r·k_j in float64 for every window row and key, then the causal softmax of each row (max,
  // denominator, probabilities) and p_h[j] = (1/W) Σ_r P_h[r, j] over the candidates.
  std::fill(queries, queries + queries_size, 0.0);
  for (int64_t w = 0; w < window; ++w) {
    load_row_f32(problem.dtype, problem.q.t.data, problem.q_offset(problem.q, b, first_row + w, h), d, row);
    interleave_vector(queries, w, row, d);
  }
  const float* key_rows[kDotKeys];
  for (int key = 0; key < kDotKeys; ++key) key_rows[key] = row + int64_t(key) * d;
  for (int64_t j0 = 0; j0 < length; j0 += kDotKeys) {
    const int n_keys = int(std::min<int64_t>(kDotKeys, length - j0));
    for (int key = 0; key < n_keys; ++key)
      load_row_f32(problem.dtype, problem.k.t.data, problem.kv_offset(problem.k, b, j0 + key, hk), d, row + key * d);
    interleaved_dots_keys(queries, window, key_rows, n_keys, d, problem.scale, matrix + j0 * window, window);
  }
  std::fill(row_max, row_max + window, -INFINITY);
  std::fill(row_sum, row_sum + window, 0.0);
  for (int64_t j = 0; j < length; ++j) {
    for (int64_t w = first_visible(j); w < window; ++w) row_max[w] = std::max(row_max[w], matrix[j * window + w]);
  }
  for (int64_t j = 0; j < length; ++j) {
    for (int64_t w = first_visible(j); w < window; ++w) {
      double& score = matrix[j * window + w];
      score = std::exp(score - row_max[w]);  // from here on the matrix holds exp(s − m_r)
      row_sum[w] += score;
    }
  }
  for (int64_t j = 0; j < n_candidates; ++j) {  // candidates are visible to every window row
    double sum = 0.0;
    for (int64_t w = 0; w < window; ++w) sum += matrix[j * window + w] / row_sum[w];
    attention[j] = sum / double(window);
  }

  // §5.3: avg_pool1d(kernel, stride 1, padding kernel/2), zero padding counted in the divisor.
  const int64_t half = params.pool_kernel / 2;
  double total = 0.0;
  for (int64_t j = 0; j < n_candidates; ++j) {
    double window_sum = 0.0;
    for (int64_t t = std::max<int64_t>(0, j - half); t <= std::min(n_candidates - 1, j + half); ++t) {
      window_sum += attention[t];
    }
    normalised[j] = window_sum / double(params.pool_kernel);
    total += normalised[j];
  }
  // §5.4: normalise to sum 1 (an all-zero head, possible only through underflow, stays zero).
  if (total > 0.0) {
    for (int64_t j = 0; j < n_candidates; ++j) normalised[j] /= total;
  }
}

// Phase 2 for one sequence: s_l = mean over heads of ŝ_h, normalised; n_drop = #(ascending cumsum < τ), +1 if
// that count is > 0; budget = max(min_tokens, (L − W) − n_drop) (§5.4–5).
int64_t budget_of(const SequencePlan& plan, const SparseParams& params, int32_t n_heads, const double* scores,
                  ThreadScratch& scratch) {
  const int64_t n_candidates = plan.n_candidates;
  ScratchLayout layout;
  const size_t layer_at = layout.add<double>(size_t(n_candidates));
  layout.bind(scratch);
  double* layer = layout.get<double>(layer_at, size_t(n_candidates));
  double* layer_end = layer + n_candidates;
  std::fill(layer, layer_end, 0.0);
  for (int32_t h = 0; h < n_heads; ++h) {
    const double* head_scores = scores + int64_t(h) * n_candidates;
    for (int64_t j = 0; j < n_candidates; ++j) layer[j] += head_scores[j];
  }
  double total = 0.0;
  for (double* s = layer; s != layer_end; ++s) {
    *s /= double(n_heads);
    total += *s;
  }
  if (total > 0.0) {
    for (double* s = layer; s != layer_end; ++s) *s /= total;
  }
  std::sort(layer, layer_end);
  int64_t below_coverage = 0;
  double cumulative = 0.0;
  for (const double* s = layer; s != layer_end; ++s) {
    cumulative += *s;
    if (cumulative < params.coverage) ++below_coverage;
  }
  const int64_t n_drop = below_coverage + (below_coverage > 0 ? 1 : 0);
  return std::min(n_candidates, std::max(params.min_tokens, n_candidates - n_drop));
}

// Phase 3 for one (b, h): writes S_h (ascending) to kept (room for L ids) and returns its size. `order` is scratch
// for L − W ids.
int64_t select_kept_tokens(const SequencePlan& plan, const double* head_scores, int64_t* order, int64_t* kept) {
  if (plan.dense) {
    std::iota(kept, kept + plan.length, int64_t{0});
    return plan.length;
  }
  top_k_ids_ascending(head_scores, plan.n_candidates, plan.budget, order, kept);
  std::iota(kept + plan.budget, kept + plan.budget + (plan.length - plan.n_candidates), plan.n_candidates);
  return plan.budget + (plan.length - plan.n_candidates);  // the window is always kept
}

}  // namespace

void plan_token_sparse(const AttentionProblem& problem, const PolicyParams& policy, const ExecContext& exec) {
  // Plans [B] and, at worst, ŝ_h of every sequence at the longest length: B · Hq · (max Skv − W) doubles.
  const int64_t worst_candidates = std::max<int64_t>(0, problem.max_seq_k - policy.p.token_sparse_window);
  run_scratch(exec, kRunScratchSelection).reserve(scratch_floats<SequencePlan>(size_t(problem.batch)));
  run_scratch(exec, kRunScratchSelectionVotes)
      .reserve(scratch_floats<double>(size_t(problem.batch) * size_t(problem.num_q_heads) * size_t(worst_candidates)));
}

void run_token_sparse(const AttentionProblem& problem, const PolicyParams& policy, const OutputSink& sink,
                      const ExecContext& exec) {
  SparseParams params;
  params.window = policy.p.token_sparse_window;
  params.pool_kernel = policy.p.token_sparse_pool_kernel;
  params.coverage = policy.p.token_sparse_coverage;
  params.min_tokens = policy.p.token_sparse_min_tokens;
  const int32_t batch = problem.batch;
  const int32_t n_heads = problem.num_q_heads;

  // Phase 0: plans and checks; nothing is written before this ends. Plans and scores live in run scratch (kept run
  // after run, so a warmed-up run allocates nothing).
  SequencePlan* plans = scratch_array<SequencePlan>(run_scratch(exec, kRunScratchSelection), 0, size_t(batch));
  int64_t scores_size = 0;
  for (int32_t b = 0; b < batch; ++b) {
    SequencePlan& plan = plans[size_t(b)];
    plan.length = problem.seq_len_k(b);
    if (problem.seq_len_q(b) != plan.length) {
      fail(SPARSA_STATUS_SHAPE_MISMATCH, "q: TOKEN_SPARSE needs Sq == Skv per sequence, but sequence ", b, " has Sq ",
           problem.seq_len_q(b), " and Skv ", plan.length);
    }
    plan.dense = plan.length <= params.min_tokens + params.window || params.coverage == 0.0;
    if (!plan.dense) {
      plan.n_candidates = plan.length - params.window;
      plan.scores_offset = scores_size;
      scores_size += int64_t(n_heads) * plan.n_candidates;
    }
    require_selected_capacity(problem, plan.length, b, "TOKEN_SPARSE");
  }
  // ŝ_h per sparse sequence: [Hq, L − W]
  double* scores = scratch_array<double>(run_scratch(exec, kRunScratchSelectionVotes), 0, size_t(scores_size));

  // Phase 1: ŝ_h per (b, h).
  parallel_items(exec, int64_t(batch) * n_heads, [&](int64_t item, int worker) {
    const int32_t b = int32_t(item / n_heads);
    const int32_t h = int32_t(item % n_heads);
    const SequencePlan& plan = plans[size_t(b)];
    if (plan.dense) return;
    score_candidates(problem, b, h, plan, params, policy_scratch(exec, worker),
                     scores + plan.scores_offset + int64_t(h) * plan.n_candidates);
  });

  // Phase 2: the budget per sequence.
  parallel_items(exec, batch, [&](int64_t item, int worker) {
    SequencePlan& plan = plans[size_t(item)];
    if (plan.dense) return;
    plan.budget = budget_of(plan, params, n_heads, scores + plan.scores_offset, policy_scratch(exec, worker));
  });

  // Phase 3: S_h, selected_indices, dropped rows = 0, attention inside the compressed sequence.
  parallel_items(exec, int64_t(batch) * n_heads, [&](int64_t item, int worker) {
    const int32_t b = int32_t(item / n_heads);
    const int32_t h = int32_t(item % n_heads);
    const SequencePlan& plan = plans[size_t(b)];
    const size_t length = size_t(plan.length);
    ScratchLayout layout;
    const size_t kept_at = layout.add<int64_t>(length);
    const size_t order_at = layout.add<int64_t>(size_t(plan.n_candidates));
    const size_t out_at = layout.add<float>(out_rows_count(problem));
    const size_t lse_at = layout.add<float>(lse_rows_count());
    layout.bind(policy_scratch(exec, worker));
    int64_t* kept = layout.get<int64_t>(kept_at, length);
    const double* head_scores =
        plan.dense ? nullptr : scores + plan.scores_offset + int64_t(h) * plan.n_candidates;
    const int64_t n_kept =
        select_kept_tokens(plan, head_scores, layout.get<int64_t>(order_at, size_t(plan.n_candidates)), kept);
    if (problem.selected_indices.present) write_selected_set(problem.selected_indices, b, h, kept, n_kept);
    int64_t next_kept = 0;
    for (int64_t i = 0; i < plan.length; ++i) {
      if (next_kept < n_kept && kept[next_kept] == i) {
        ++next_kept;
      } else {
        sink.write_zero_row(problem, b, i, h);
      }
    }
    RowVisibility visibility;
    visibility.causal = true;
    visibility.offset = 0;  // Sq == Skv
    attend_rows_over_keys(problem, b, h, kept, n_kept, kept, n_kept, visibility, /*causal_prefix=*/true, sink,
                          layout.get<float>(out_at, out_rows_count(problem)),
                          layout.get<float>(lse_at, lse_rows_count()), &(*exec.counters)[size_t(worker)],
                          loop_scratch(exec, worker));
  });
}

}  // namespace sparsa::cpu
