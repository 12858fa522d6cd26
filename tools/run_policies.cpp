// `sparsa run --policies LIST --qkv-dir DIR`: several policies on Q/K/V dumps of several layers (every head of a
// layer in one dump), each compared with dense attention on the same dump; prints one quality table (docs/cli.md).
#include <sparsa/sparsa.h>

#include <algorithm>
#include <cctype>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <iomanip>
#include <iostream>
#include <string>
#include <vector>

#include "cli_common.h"
#include "cli_options.h"
#include "npy.h"
#include "policy_eval.h"

namespace sparsa_cli {

// The policy-parameter options of `sparsa run` (run_command.cpp), without its input/output options.
std::vector<Option> run_policy_field_options(sparsa_policy& p);

namespace {

constexpr const char* kQSuffix = ".q.npy";
constexpr const char* kDeltaSuffix = "+DELTA";
constexpr size_t kMaxDumpColumns = 12;  // per-dump error columns printed; more go to --json only

struct PoliciesSettings {
  std::string policies, qkv_dir, json_path;
  bool causal = false;
  bool bf16 = false;
  float softmax_scale = 0.f;
  int32_t threads = 0;
  EvalSettings eval;
};

struct PolicyChoice {
  std::string label;  // "SINK_WINDOW+DELTA"
  int32_t kind = SPARSA_POLICY_DENSE;
  bool delta = false;
};

std::vector<PolicyChoice> parse_policy_list(const std::string& list) {
  std::vector<PolicyChoice> choices;
  size_t start = 0;
  while (start <= list.size()) {
    const size_t comma = std::min(list.find(',', start), list.size());
    std::string name = canonical_policy_name(list.substr(start, comma - start));
    start = comma + 1;
    if (name.empty()) continue;
    PolicyChoice choice;
    if (name.size() > std::string(kDeltaSuffix).size() &&
        name.compare(name.size() - std::string(kDeltaSuffix).size(), std::string::npos, kDeltaSuffix) == 0) {
      choice.delta = true;
      name.resize(name.size() - std::string(kDeltaSuffix).size());
    }
    const int32_t kind = policy_kind_from_name("--policies", name);
    if (kind == SPARSA_POLICY_BLOCK_SPARSE || kind == SPARSA_POLICY_TOKEN_INDICES) {
      throw UsageError("--policies: " + name + " needs per-dump tensors; run it with --policy on one dump");
    }
    choice.kind = kind;
    choice.label = name + (choice.delta ? kDeltaSuffix : "");
    choices.push_back(choice);
  }
  if (choices.empty()) throw UsageError("--policies: expected a comma-separated list, e.g. dense,sink_window+delta");
  return choices;
}

HostTensor load_dump_tensor(const std::string& path, bool bf16) {
  NpyArray array = read_npy(path);
  if (array.shape.size() == 3) array.shape.insert(array.shape.begin(), 1);
  if (array.shape.size() != 4) throw UsageError(path + ": expected [B, S, H, D] or [S, H, D]");
  HostTensor t;
  if (array.descr == "<f4") {
    t.dtype = SPARSA_DTYPE_F32;
  } else if (array.descr == "<f2") {
    t.dtype = SPARSA_DTYPE_F16;
  } else if (array.descr == "<u2" && bf16) {
    t.dtype = SPARSA_DTYPE_BF16;
  } else {
    throw UsageError(path + ": dtype " + array.descr + " (expected <f4, <f2, or <u2 with --bf16)");
  }
  t.shape = array.shape;
  t.bytes = std::move(array.bytes);
  return t;
}

// Every DIR/<name>.q.npy with its .k.npy and .v.npy, sorted by name.
std::vector<std::string> dump_names(const std::string& dir) {
  namespace fs = std::filesystem;
  std::error_code error;
  if (!fs::is_directory(dir, error)) throw UsageError("--qkv-dir: '" + dir + "' is not a directory");
  std::vector<std::string> names;
  for (const auto& entry : fs::directory_iterator(dir)) {
    const std::string file = entry.path().filename().string();
    const size_t suffix = std::string(kQSuffix).size();
    if (file.size() > suffix && file.compare(file.size() - suffix, suffix, kQSuffix) == 0) {
      names.push_back(file.substr(0, file.size() - suffix));
    }
  }
  std::sort(names.begin(), names.end());
  if (names.empty()) throw UsageError("--qkv-dir: no <name>.q.npy (with .k.npy, .v.npy) in '" + dir + "'");
  return names;
}

struct Row {
  PolicyChoice choice;
  std::vector<double> sparsity, error;
};

double mean(const std::vector<double>& xs) {
  double sum = 0;
  for (double x : xs) sum += x;
  return xs.empty() ? 0.0 : sum / double(xs.size());
}

void print_table(std::ostream& os, const std::vector<Row>& rows, const std::vector<std::string>& dumps) {
  const size_t shown = std::min(dumps.size(), kMaxDumpColumns);
  os << std::left << std::setw(22) << "policy" << std::right << std::setw(10) << "sparsity" << std::setw(12)
     << "mean err" << std::setw(12) << "max err";
  for (size_t d = 0; d < shown; ++d) os << "  " << std::setw(10) << dumps[d].substr(0, 10);
  os << "\n";
  for (const Row& row : rows) {
    os << std::left << std::setw(22) << row.choice.label << std::right << std::fixed << std::setprecision(3)
       << std::setw(10) << mean(row.sparsity) << std::setprecision(5) << std::setw(12) << mean(row.error)
       << std::setw(12) << *std::max_element(row.error.begin(), row.error.end());
    for (size_t d = 0; d < shown; ++d) os << "  " << std::setw(10) << row.error[d];
    os << "\n";
  }
  if (shown < dumps.size()) os << "(" << dumps.size() - shown << " more dumps in --json)\n";
  os << "sparsity: mean over dumps of 1 − computed/dense pairs; err: ‖o − o_dense‖/‖o_dense‖ per dump "
        "(TOKEN_SPARSE: over the rows it computes)\n";
}

void write_json(const std::string& path, const std::vector<Row>& rows, const std::vector<std::string>& dumps) {
  std::ofstream f(path);
  if (!f) throw RuntimeError("--json: cannot write '" + path + "'");
  f << std::setprecision(8) << "{\"dumps\": [";
  for (size_t d = 0; d < dumps.size(); ++d) f << (d ? ", " : "") << '"' << dumps[d] << '"';
  f << "],\n \"results\": [";
  for (size_t r = 0; r < rows.size(); ++r) {
    const Row& row = rows[r];
    f << (r ? ",\n  " : "\n  ") << "{\"policy\": \"" << row.choice.label << "\", \"sparsity\": " << mean(row.sparsity)
      << ", \"rel_error_mean\": " << mean(row.error) << ", \"rel_error\": [";
    for (size_t d = 0; d < row.error.size(); ++d) f << (d ? ", " : "") << row.error[d];
    f << "], \"sparsity_per_dump\": [";
    for (size_t d = 0; d < row.sparsity.size(); ++d) f << (d ? ", " : "") << row.sparsity[d];
    f << "]}";
  }
  f << "\n]}\n";
  if (!f) throw RuntimeError("--json: writing '" + path + "' failed");
}

std::vector<Option> policies_options(PoliciesSettings& s) {
  return {
      {"--policies", "LIST", "comma-separated policies, each optionally +delta",
       [&](const std::string& v) { s.policies = v; }},
      {"--qkv-dir", "DIR", "folder of <name>.q.npy/.k.npy/.v.npy dumps", [&](const std::string& v) { s.qkv_dir = v; }},
      {"--json", "FILE", "also write the results as JSON", [&](const std::string& v) { s.json_path = v; }},
      {"--causal", "", "bottom-right causal mask", [&](const std::string&) { s.causal = true; }},
      {"--bf16", "", "read <u2 arrays as bfloat16 bits", [&](const std::string&) { s.bf16 = true; }},
      {"--scale", "S", "softmax scale (default 1/sqrt(D))",
       [&](const std::string& v) { s.softmax_scale = parse_float("--scale", v, 1e-30, 1e30); }},
      {"--threads", "T", "CPU worker threads (default 0 = one per core)",
       [&](const std::string& v) { s.threads = int32_t(parse_int("--threads", v, 0, 1 << 16)); }},
      {"--quiet", "", "no progress lines on stderr", [&](const std::string&) { s.eval.progress = false; }},
  };
}

}  // namespace

void print_run_policies_help(std::ostream& os) {
  PoliciesSettings s;
  os << "\nusage: sparsa run --policies LIST --qkv-dir DIR [--causal] [--json FILE] [policy options above]\n\n"
        "Runs each listed policy on every dump DIR/<name>.q.npy, <name>.k.npy, <name>.v.npy (one layer, all heads:\n"
        "[B, S, H, D] or [S, H, D]) and prints sparsity and relative error vs dense attention per dump. LIST: dense,\n"
        "sink_window, sparge, token_sparse, token_select, each optionally with +delta (e.g. sink_window+delta).\n"
        "The policy options above apply to every listed policy of their kind.\n\n"
        "options of --policies:\n";
  print_options(os, policies_options(s));
}

int run_policies_command(const std::vector<std::string>& args) {
  PoliciesSettings s;
  sparsa_policy base;
  check(sparsa_policy_init(&base, sizeof base, SPARSA_POLICY_DENSE), "sparsa_policy_init");
  std::vector<Option> options = policies_options(s);
  for (Option& o : run_policy_field_options(base)) options.push_back(std::move(o));
  parse_options(args, options, "run");
  if (s.qkv_dir.empty()) throw UsageError("run: --policies needs --qkv-dir DIR");
  const std::vector<PolicyChoice> choices = parse_policy_list(s.policies);
  const std::vector<std::string> dumps = dump_names(s.qkv_dir);

  const ContextPtr ctx = make_context(s.threads);
  std::vector<Row> rows;
  for (const PolicyChoice& choice : choices) rows.push_back(Row{choice, {}, {}});
  for (const std::string& name : dumps) {
    const std::string prefix = (std::filesystem::path(s.qkv_dir) / name).string();
    AttentionInputs inputs;
    inputs.causal = s.causal;
    inputs.softmax_scale = s.softmax_scale;
    inputs.q = load_dump_tensor(prefix + ".q.npy", s.bf16);
    inputs.k = load_dump_tensor(prefix + ".k.npy", s.bf16);
    inputs.v = load_dump_tensor(prefix + ".v.npy", s.bf16);
    if (inputs.k.dtype != inputs.q.dtype || inputs.v.dtype != inputs.q.dtype) {
      throw UsageError(prefix + ": q, k and v must share one dtype");
    }
    const std::string all_rows = "all " + std::to_string(inputs.q.shape[1]);
    const DenseReference dense = run_dense_reference(ctx.get(), inputs, s.eval, all_rows);
    for (Row& row : rows) {
      sparsa_policy policy = base;
      policy.kind = row.choice.kind;
      policy.flags = row.choice.delta ? (base.flags | SPARSA_POLICY_FLAG_DELTA)
                                      : (base.flags & ~SPARSA_POLICY_FLAG_DELTA);
      const PolicyResult result =
          evaluate_policy(ctx.get(), inputs, dense, name + " " + row.choice.label, all_rows, policy,
                          row.choice.kind == SPARSA_POLICY_TOKEN_SPARSE, s.eval);
      row.sparsity.push_back(result.sparsity);
      row.error.push_back(result.rel_error);
    }
  }
  std::cout << "sparsa " << sparsa_version_string() << " run: " << dumps.size() << " dumps from " << s.qkv_dir
            << (s.causal ? ", causal" : ", non-causal") << "\n";
  print_table(std::cout, rows, dumps);
  if (!s.json_path.empty()) {
    write_json(s.json_path, rows, dumps);
    std::cout << "wrote " << s.json_path << "\n";
  }
  return 0;
}

}  // namespace sparsa_cli
