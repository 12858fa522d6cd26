// Runs one attention policy on host tensors and measures it against dense attention: achieved sparsity (from the
// run's stats), relative error ‖o − o_dense‖ / ‖o_dense‖, wall time and speedup. Shared by `sparsa demo` and
// `sparsa run`, which print the same table.
#pragma once

#include <sparsa/sparsa.h>

#include <cstdint>
#include <iosfwd>
#include <string>
#include <vector>

#include "cli_common.h"

namespace sparsa_cli {

// One attention problem: q [B, Sq, Hq, D], k/v [B, Skv, Hkv, D], all of one dtype.
struct AttentionInputs {
  HostTensor q, k, v;
  bool causal = true;
  float softmax_scale = 0.f;  // 0 = 1/sqrt(D)
};

// Timing: the fastest of `repeat` runs counts. A speedup is marked as noise when fewer than kMinRepeatsForSpeedup
// runs were timed, or when the median run of the policy or of dense is more than kNoisySpread slower than its fastest.
inline constexpr int kMinRepeatsForSpeedup = 3;
inline constexpr double kNoisySpread = 0.10;

struct EvalSettings {
  int repeat = kMinRepeatsForSpeedup;  // timed runs per policy; the fastest counts
  bool progress = true;  // one line per run on stderr
};

// What dense attention gives on the inputs: the reference of every policy run on the same inputs.
struct DenseReference {
  std::vector<float> out;  // [B, Sq, Hq, D] as floats
  HostTensor native_out;   // the same in q's dtype
  double ms = 0.0;
  double spread = 0.0;  // (median run − fastest run) / fastest run
  int runs = 0;
};

struct PolicyResult {
  std::string label;                // e.g. "SINK_WINDOW+DELTA"
  std::string rows;                 // which query rows ran, e.g. "all 4096" or "last 64"
  double sparsity = 0.0;            // 1 − PAIRS_COMPUTED / PAIRS_DENSE
  double rel_error = 0.0;           // over the rows the policy computes
  int64_t zero_rows = 0;            // (b, i, h) rows the policy left exactly 0 where dense is not
  int64_t rows_total = 0;           // (b, i, h) rows of the output
  bool zero_rows_excluded = false;  // TOKEN_SPARSE: zero rows are by design, not counted in rel_error
  double ms = 0.0;
  double speedup = 0.0;  // dense ms / ms
  bool speedup_noisy = false;  // too few runs, or this policy's or dense's runs spread more than kNoisySpread
  HostTensor out;        // the policy's output, inputs.q's dtype and shape
};

// Runs `policy` (plan, then settings.repeat timed runs) and returns its output and the run's stats counters; `ms` is
// the fastest run, `spread` (optional) the median run's excess over it, relative.
HostTensor run_policy(sparsa_context* ctx, const AttentionInputs& inputs, const sparsa_policy& policy,
                      const EvalSettings& settings, const std::string& label, double* ms, std::vector<int64_t>* stats,
                      double* spread = nullptr);

// Dense attention on `inputs` (the reference).
DenseReference run_dense_reference(sparsa_context* ctx, const AttentionInputs& inputs, const EvalSettings& settings,
                                   const std::string& rows);

// Runs `policy` and compares it with `reference`. `exclude_zero_rows`: rows left exactly 0 are by design (TOKEN_SPARSE
// §5.8) and kept out of the error; they are counted either way.
PolicyResult evaluate_policy(sparsa_context* ctx, const AttentionInputs& inputs, const DenseReference& reference,
                             const std::string& label, const std::string& rows, const sparsa_policy& policy,
                             bool exclude_zero_rows, const EvalSettings& settings);

// The result row of the dense reference itself (sparsity 0, error 0, speedup 1).
PolicyResult dense_result(const DenseReference& reference, const std::string& rows, int64_t rows_total);

// Prints the table: policy, rows, sparsity, rel. error, zero rows, time, speedup vs dense.
void print_results(std::ostream& os, const std::vector<PolicyResult>& results);

}  // namespace sparsa_cli
