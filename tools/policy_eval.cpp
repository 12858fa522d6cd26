// Measuring a policy against dense attention (policy_eval.h).
#include "policy_eval.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <iostream>
#include <ostream>

namespace sparsa_cli {
namespace {

int64_t rows_of(const HostTensor& q) { return q.shape[0] * q.shape[1] * q.shape[2]; }  // B * Sq * Hq

}  // namespace

HostTensor run_policy(sparsa_context* ctx, const AttentionInputs& inputs, const sparsa_policy& policy,
                      const EvalSettings& settings, const std::string& label, double* ms, std::vector<int64_t>* stats,
                      double* spread) {
  HostTensor out(inputs.q.dtype, inputs.q.shape);
  HostTensor counters(SPARSA_DTYPE_I64, {SPARSA_STAT_COUNT});
  const sparsa_tensor q = inputs.q.view(), k = inputs.k.view(), v = inputs.v.view();
  const sparsa_tensor out_view = out.view(), stats_view = counters.view();

  sparsa_attention_args args;
  check(sparsa_attention_args_init(&args, sizeof args), "sparsa_attention_args_init");
  args.q = &q;
  args.k = &k;
  args.v = &v;
  args.out = &out_view;
  args.stats = &stats_view;
  args.causal = inputs.causal ? 1 : 0;
  args.softmax_scale = inputs.softmax_scale;

  if (settings.progress) std::fprintf(stderr, "sparsa: running %s ...\n", label.c_str());
  check(sparsa_attention_plan(ctx, &args, &policy), label + ": sparsa_attention_plan");
  std::vector<double> run_ms;
  for (int r = 0; r < std::max(1, settings.repeat); ++r) {
    const auto start = std::chrono::steady_clock::now();
    check(sparsa_attention_run(ctx, &args, &policy), label + ": sparsa_attention_run");
    const std::chrono::duration<double, std::milli> elapsed = std::chrono::steady_clock::now() - start;
    run_ms.push_back(elapsed.count());
  }
  std::sort(run_ms.begin(), run_ms.end());
  *ms = run_ms.front();
  if (spread) *spread = run_ms.front() > 0 ? (run_ms[run_ms.size() / 2] - run_ms.front()) / run_ms.front() : 0.0;
  stats->assign(counters.data<int64_t>(), counters.data<int64_t>() + SPARSA_STAT_COUNT);
  return out;
}

DenseReference run_dense_reference(sparsa_context* ctx, const AttentionInputs& inputs, const EvalSettings& settings,
                                   const std::string& rows) {
  sparsa_policy dense;
  check(sparsa_policy_init(&dense, sizeof dense, SPARSA_POLICY_DENSE), "sparsa_policy_init");
  DenseReference reference;
  std::vector<int64_t> stats;
  reference.native_out = run_policy(ctx, inputs, dense, settings, "DENSE reference (" + rows + ")", &reference.ms,
                                    &stats, &reference.spread);
  reference.runs = std::max(1, settings.repeat);
  reference.out = to_floats(reference.native_out);
  return reference;
}

PolicyResult evaluate_policy(sparsa_context* ctx, const AttentionInputs& inputs, const DenseReference& reference,
                             const std::string& label, const std::string& rows, const sparsa_policy& policy,
                             bool exclude_zero_rows, const EvalSettings& settings) {
  PolicyResult result;
  result.label = label;
  result.rows = rows;
  result.zero_rows_excluded = exclude_zero_rows;
  std::vector<int64_t> stats;
  double spread = 0.0;
  result.out = run_policy(ctx, inputs, policy, settings, label + " (" + rows + ")", &result.ms, &stats, &spread);
  const int64_t pairs_dense = stats[SPARSA_STAT_PAIRS_DENSE];
  result.sparsity = pairs_dense > 0 ? 1.0 - double(stats[SPARSA_STAT_PAIRS_COMPUTED]) / double(pairs_dense) : 0.0;
  result.speedup = result.ms > 0 ? reference.ms / result.ms : 0.0;
  result.speedup_noisy = std::max(1, settings.repeat) < kMinRepeatsForSpeedup || spread > kNoisySpread ||
                         reference.spread > kNoisySpread;

  // Relative error row by row, so rows the policy leaves at exactly 0 can be told apart.
  const std::vector<float> out = to_floats(result.out);
  const int64_t head_dim = inputs.q.shape[3];
  result.rows_total = rows_of(inputs.q);
  double diff_sq = 0.0, ref_sq = 0.0;
  for (int64_t row = 0; row < result.rows_total; ++row) {
    const float* o = out.data() + row * head_dim;
    const float* d = reference.out.data() + row * head_dim;
    double row_diff = 0.0, row_ref = 0.0;
    bool all_zero = true;
    for (int64_t c = 0; c < head_dim; ++c) {
      all_zero = all_zero && o[c] == 0.0f;
      row_diff += (double(o[c]) - d[c]) * (double(o[c]) - d[c]);
      row_ref += double(d[c]) * d[c];
    }
    const bool dropped = all_zero && row_ref > 0.0;
    result.zero_rows += dropped ? 1 : 0;
    if (dropped && exclude_zero_rows) continue;
    diff_sq += row_diff;
    ref_sq += row_ref;
  }
  result.rel_error = ref_sq > 0.0 ? std::sqrt(diff_sq / ref_sq) : std::sqrt(diff_sq);
  return result;
}

PolicyResult dense_result(const DenseReference& reference, const std::string& rows, int64_t rows_total) {
  PolicyResult result;
  result.label = "DENSE";
  result.rows = rows;
  result.rows_total = rows_total;
  result.ms = reference.ms;
  result.speedup = 1.0;
  return result;
}

void print_results(std::ostream& os, const std::vector<PolicyResult>& results) {
  char line[256];
  std::snprintf(line, sizeof line, "%-22s %-12s %9s %10s %12s %10s %8s\n", "policy", "rows", "sparsity", "rel.err",
                "zero rows", "time ms", "speedup");
  os << line;
  for (const PolicyResult& r : results) {
    const std::string zero = std::to_string(r.zero_rows) + (r.zero_rows_excluded && r.zero_rows ? "*" : "");
    std::snprintf(line, sizeof line, "%-22s %-12s %8.1f%% %10.2e %12s %10.1f %7.2fx%s\n", r.label.c_str(),
                  r.rows.c_str(), 100.0 * r.sparsity, r.rel_error, zero.c_str(), r.ms, r.speedup,
                  r.speedup_noisy ? " ~" : "");
    os << line;
  }
  const auto any = [&](auto predicate) { return std::any_of(results.begin(), results.end(), predicate); };
  const bool any_excluded = std::any_of(results.begin(), results.end(),
                                        [](const PolicyResult& r) { return r.zero_rows_excluded && r.zero_rows; });
  if (any_excluded) {
    os << "* rows TOKEN_SPARSE leaves at 0 by design (its §5.8: the residual carries them); rel.err is over the rows "
          "it computes\n";
  }
  os << "sparsity = 1 - computed/dense query-key pairs (run stats); rel.err = ||o - o_dense|| / ||o_dense||\n";
  if (any([](const PolicyResult& r) { return r.sparsity < 0.0; })) {
    os << "sparsity < 0: +DELTA computes the policy's pairs plus dense anchor rows (every gamma-th row and the "
          "tail), so it can compute more pairs than dense attention\n";
  }
  os << "zero rows = output rows the policy left exactly 0 where dense is not; a row is the D values of one query "
        "token of one query head (of one batch entry), so 'all N' rows are B*N*Hq of them\n";
  if (any([](const PolicyResult& r) { return r.speedup_noisy; })) {
    os << "~ speedup within timing noise: fewer than " << kMinRepeatsForSpeedup
       << " timed runs (--repeat), or the median run of the policy or of dense was more than "
       << int(kNoisySpread * 100) << "% slower than the fastest\n";
  }
}

}  // namespace sparsa_cli
