// `sparsa run`: one policy on the caller's .npy tensors, compared with dense attention on the same tensors.
#include <sparsa/sparsa.h>

#include <algorithm>
#include <cctype>
#include <cmath>
#include <iostream>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "cli_common.h"
#include "cli_options.h"
#include "npy.h"
#include "policy_eval.h"

namespace sparsa_cli {

// `sparsa run --policies` (run_policies.cpp).
int run_policies_command(const std::vector<std::string>& args);
void print_run_policies_help(std::ostream& os);

namespace {

constexpr int32_t kMaxInt32Option = 1 << 30;

struct RunSettings {
  std::string policy_name, q_path, k_path, v_path, out_path;
  bool causal = false;
  bool bf16 = false;  // read <u2 arrays as bfloat16
  float softmax_scale = 0.f;
  int32_t threads = 0;
  EvalSettings eval;
  // Optional policy inputs (.npy paths).
  std::string block_mask_path, indices_path, head_map_path, sparge_head_params_path;
};

// The options of `sparsa run`. Policy fields are written into `policy`, already initialised for its kind.
std::vector<Option> run_options(RunSettings& s, sparsa_policy& p) {
  auto int_field = [](int32_t& field, const char* name, int32_t min) {
    return [&field, name, min](const std::string& v) { field = int32_t(parse_int(name, v, min, kMaxInt32Option)); };
  };
  auto float_field = [](float& field, const char* name, double min, double max) {
    return [&field, name, min, max](const std::string& v) { field = parse_float(name, v, min, max); };
  };
  auto flag_field = [](int32_t& field) { return [&field](const std::string&) { field = 1; }; };
  auto path = [](std::string& field) { return [&field](const std::string& v) { field = v; }; };
  return {
      {"--policy", "NAME", "dense, sink_window, block_sparse, sparge, token_sparse, token_select, token_indices",
       path(s.policy_name)},
      {"--q", "FILE", "queries .npy [B, Sq, Hq, D] or [Sq, Hq, D] (<f4, <f2, or <u2 with --bf16)", path(s.q_path)},
      {"--k", "FILE", "keys .npy [B, Skv, Hkv, D] or [Skv, Hkv, D]", path(s.k_path)},
      {"--v", "FILE", "values .npy, k's shape", path(s.v_path)},
      {"--out", "FILE", "write the policy's output here (q's dtype and shape)", path(s.out_path)},
      {"--causal", "", "bottom-right causal mask", [&](const std::string&) { s.causal = true; }},
      {"--bf16", "", "read <u2 arrays as bfloat16 bits", [&](const std::string&) { s.bf16 = true; }},
      {"--scale", "S", "softmax scale (default 1/sqrt(D))", float_field(s.softmax_scale, "--scale", 1e-30, 1e30)},
      {"--threads", "T", "CPU worker threads (default 0 = one per core)", int_field(s.threads, "--threads", 0)},
      {"--repeat", "R", "timed runs, fastest counts (default 3; fewer marks the speedup as noise)",
       [&](const std::string& v) { s.eval.repeat = int(parse_int("--repeat", v, 1, 1000)); }},
      {"--quiet", "", "no progress lines on stderr", [&](const std::string&) { s.eval.progress = false; }},
      // SINK_WINDOW (§2)
      {"--sink-tokens", "N", "SINK_WINDOW: leading keys every row sees", int_field(p.sink_tokens, "--sink-tokens", 0)},
      {"--sink-window", "N", "SINK_WINDOW: local window", int_field(p.sink_window, "--sink-window", 0)},
      // BLOCK_SPARSE / SPARGE (§3, §4)
      {"--block-q", "N", "BLOCK_SPARSE/SPARGE: query rows per block", int_field(p.block_q, "--block-q", 1)},
      {"--block-k", "N", "BLOCK_SPARSE/SPARGE: keys per block", int_field(p.block_k, "--block-k", 1)},
      {"--block-mask", "FILE", "BLOCK_SPARSE: u1 .npy [B, Hq, ceil(Sq/bq), ceil(Skv/bk)]", path(s.block_mask_path)},
      {"--theta", "X", "SPARGE: self-similarity threshold", float_field(p.sparge_theta, "--theta", -1, 1)},
      {"--tau", "X", "SPARGE: TopCdf mass", float_field(p.sparge_tau, "--tau", 0, 1)},
      {"--topk-fraction", "X", "SPARGE: top-k variant fraction (0 = TopCdf)",
       float_field(p.sparge_topk_fraction, "--topk-fraction", 0, 1)},
      {"--lambda", "X", "SPARGE: PV-skip threshold (<= 0; -inf = off)",
       float_field(p.sparge_lambda, "--lambda", -INFINITY, 0)},
      {"--attention-sink", "", "SPARGE: always keep key block 0", flag_field(p.sparge_attention_sink)},
      {"--quantized", "", "SPARGE: int8 Sage path", flag_field(p.sparge_quantized)},
      {"--sparge-head-params", "FILE", "SPARGE: <f4 .npy [Hq, 4] per-head (theta, tau, topk_fraction, lambda)",
       path(s.sparge_head_params_path)},
      // TOKEN_SPARSE (§5)
      {"--ts-window", "N", "TOKEN_SPARSE: scoring window W", int_field(p.token_sparse_window, "--ts-window", 1)},
      {"--ts-pool-kernel", "N", "TOKEN_SPARSE: odd pooling kernel",
       int_field(p.token_sparse_pool_kernel, "--ts-pool-kernel", 1)},
      {"--ts-coverage", "X", "TOKEN_SPARSE: dropped score mass tau",
       float_field(p.token_sparse_coverage, "--ts-coverage", 0, 1)},
      {"--ts-min-tokens", "N", "TOKEN_SPARSE: minimum budget",
       int_field(p.token_sparse_min_tokens, "--ts-min-tokens", 0)},
      // TOKEN_SELECT (§6)
      {"--select-n-init", "N", "TOKEN_SELECT: leading tokens kept", int_field(p.select_n_init, "--select-n-init", 0)},
      {"--select-n-local", "N", "TOKEN_SELECT: trailing tokens kept",
       int_field(p.select_n_local, "--select-n-local", 0)},
      {"--select-top-k", "N", "TOKEN_SELECT: selected candidates", int_field(p.select_top_k, "--select-top-k", 1)},
      {"--select-scale-scores", "", "TOKEN_SELECT: score with scale * q.k", flag_field(p.select_scale_scores)},
      {"--select-per-kv-head", "", "TOKEN_SELECT: one selection per kv head", flag_field(p.select_per_kv_head)},
      // TOKEN_INDICES (§7)
      {"--indices", "FILE", "TOKEN_INDICES: <i4 .npy [B, H_idx, k] (-1 = unused)", path(s.indices_path)},
      {"--head-map", "FILE", "TOKEN_INDICES: <i4 .npy [Hq]", path(s.head_map_path)},
      {"--index-block-size", "N", "TOKEN_INDICES: 1 = token ids, > 1 = block ids",
       int_field(p.index_block_size, "--index-block-size", 1)},
      {"--index-n-init", "N", "TOKEN_INDICES: leading tokens included", int_field(p.index_n_init, "--index-n-init", 0)},
      {"--index-n-local", "N", "TOKEN_INDICES: trailing tokens included",
       int_field(p.index_n_local, "--index-n-local", 0)},
      // DELTA (§8)
      {"--delta", "", "Δ-Attention correction on top of the policy (needs --causal)",
       [&](const std::string&) { p.flags |= SPARSA_POLICY_FLAG_DELTA; }},
      {"--delta-gamma", "N", "DELTA: anchor row stride", int_field(p.delta_gamma, "--delta-gamma", 1)},
      {"--delta-tail-min", "N", "DELTA: minimum dense tail rows", int_field(p.delta_tail_min, "--delta-tail-min", 0)},
  };
}

int32_t attention_dtype(const NpyArray& array, bool bf16, const std::string& path) {
  if (array.descr == "<f4") return SPARSA_DTYPE_F32;
  if (array.descr == "<f2") return SPARSA_DTYPE_F16;
  if (array.descr == "<u2" && bf16) return SPARSA_DTYPE_BF16;
  if (array.descr == "<u2") throw UsageError(path + ": dtype <u2; pass --bf16 to read it as bfloat16 bits");
  throw UsageError(path + ": dtype " + array.descr + " (expected <f4, <f2, or <u2 with --bf16)");
}

// Loads q/k/v: rank 3 [S, H, D] gets a batch dimension of 1.
HostTensor load_attention_tensor(const std::string& option, const std::string& path, bool bf16,
                                 size_t* file_rank = nullptr) {
  if (path.empty()) throw UsageError("run: " + option + " FILE is required");
  NpyArray array = read_npy(path);
  if (file_rank) *file_rank = array.shape.size();
  if (array.shape.size() == 3) array.shape.insert(array.shape.begin(), 1);
  if (array.shape.size() != 4) {
    throw UsageError(path + ": rank " + std::to_string(array.shape.size()) + " (expected [B, S, H, D] or [S, H, D])");
  }
  HostTensor t;
  t.dtype = attention_dtype(array, bf16, path);
  t.shape = array.shape;
  t.bytes = std::move(array.bytes);
  return t;
}

// Loads an optional policy input of the given descr.
std::optional<HostTensor> load_policy_tensor(const std::string& path, const std::string& descr, int32_t dtype) {
  if (path.empty()) return std::nullopt;
  NpyArray array = read_npy(path);
  if (array.descr != descr) throw UsageError(path + ": dtype " + array.descr + " (expected " + descr + ")");
  HostTensor t;
  t.dtype = dtype;
  t.shape = array.shape;
  t.bytes = std::move(array.bytes);
  return t;
}

std::string npy_descr(int32_t dtype) {
  switch (dtype) {
    case SPARSA_DTYPE_F16:
      return "<f2";
    case SPARSA_DTYPE_BF16:
      return "<u2";
    default:
      return "<f4";
  }
}

std::string scan_policy_name(const std::vector<std::string>& args) {
  for (size_t i = 0; i < args.size(); ++i) {
    if (args[i] == "--policy" && i + 1 < args.size()) return args[i + 1];
    if (args[i].rfind("--policy=", 0) == 0) return args[i].substr(9);
  }
  throw UsageError("run: --policy NAME is required (see sparsa run --help)");
}

// What the library would refuse only after the dense reference has run: checked before anything is loaded or run.
void check_run_settings(const RunSettings& s, int32_t kind, const sparsa_policy& policy) {
  if (kind == SPARSA_POLICY_BLOCK_SPARSE && s.block_mask_path.empty()) {
    throw UsageError("run: --policy block_sparse needs --block-mask FILE (u1 .npy [B, Hq, ceil(Sq/bq), ceil(Skv/bk)])");
  }
  if (kind == SPARSA_POLICY_TOKEN_INDICES && s.indices_path.empty()) {
    throw UsageError("run: --policy token_indices needs --indices FILE (<i4 .npy [B, H_idx, k])");
  }
  if ((policy.flags & SPARSA_POLICY_FLAG_DELTA) && !s.causal) {
    throw UsageError("run: --delta needs --causal (the Δ-Attention correction is defined for causal prefill)");
  }
  if (!s.out_path.empty()) check_output_path(s.out_path);
}

}  // namespace

void print_run_help(std::ostream& os) {
  RunSettings s;
  sparsa_policy p{};
  os << "usage: sparsa run --policy NAME --q q.npy --k k.npy --v v.npy [--out o.npy] [--causal] [options]\n\n"
        "Runs one policy on your tensors and prints sparsity, relative error vs dense attention on the same\n"
        "tensors, time and speedup. Policy parameters default to sparsa_policy_init's (docs/algorithms.md).\n\n"
        "options:\n";
  print_options(os, run_options(s, p));
  print_run_policies_help(os);
}

std::vector<Option> run_policy_field_options(sparsa_policy& p) {
  // The policy fields' options write only into `p`; the settings the other options write into live as long as the
  // options do (shared by every kept option's handler).
  static const std::vector<std::string> kNotPolicyFields = {
      "--policy", "--q", "--k", "--v", "--out", "--causal", "--bf16", "--scale", "--threads", "--repeat", "--quiet",
      "--block-mask", "--indices", "--head-map", "--sparge-head-params", "--delta"};  // Δ: per entry (+delta)
  auto settings = std::make_shared<RunSettings>();
  std::vector<Option> kept;
  for (Option& option : run_options(*settings, p)) {
    if (std::find(kNotPolicyFields.begin(), kNotPolicyFields.end(), option.name) != kNotPolicyFields.end()) continue;
    auto apply = std::move(option.apply);
    option.apply = [settings, apply](const std::string& value) { apply(value); };
    kept.push_back(std::move(option));
  }
  return kept;
}

int run_command(const std::vector<std::string>& args) {
  for (const std::string& arg : args) {
    if (arg == "--policies" || arg.rfind("--policies=", 0) == 0) return run_policies_command(args);
  }
  RunSettings s;
  sparsa_policy policy;
  const int32_t kind = policy_kind_from_name("--policy", scan_policy_name(args));
  check(sparsa_policy_init(&policy, sizeof policy, kind), "sparsa_policy_init");
  parse_options(args, run_options(s, policy), "run");
  check_run_settings(s, kind, policy);

  AttentionInputs inputs;
  inputs.causal = s.causal;
  inputs.softmax_scale = s.softmax_scale;
  size_t q_rank = 0;
  inputs.q = load_attention_tensor("--q", s.q_path, s.bf16, &q_rank);
  inputs.k = load_attention_tensor("--k", s.k_path, s.bf16);
  inputs.v = load_attention_tensor("--v", s.v_path, s.bf16);
  if (inputs.k.dtype != inputs.q.dtype || inputs.v.dtype != inputs.q.dtype) {
    throw UsageError("run: q, k and v must share one dtype (" + s.q_path + ", " + s.k_path + ", " + s.v_path + ")");
  }

  const auto block_mask = load_policy_tensor(s.block_mask_path, "|u1", SPARSA_DTYPE_U8);
  const auto indices = load_policy_tensor(s.indices_path, "<i4", SPARSA_DTYPE_I32);
  const auto head_map = load_policy_tensor(s.head_map_path, "<i4", SPARSA_DTYPE_I32);
  const auto head_params = load_policy_tensor(s.sparge_head_params_path, "<f4", SPARSA_DTYPE_F32);
  sparsa_tensor block_mask_view, indices_view, head_map_view, head_params_view;
  if (block_mask) policy.block_mask = &(block_mask_view = block_mask->view());
  if (indices) policy.indices = &(indices_view = indices->view());
  if (head_map) policy.head_map = &(head_map_view = head_map->view());
  if (head_params) policy.sparge_head_params = &(head_params_view = head_params->view());

  const ContextPtr ctx = make_context(s.threads);

  const std::string rows = "all " + std::to_string(inputs.q.shape[1]);
  const int64_t rows_total = inputs.q.shape[0] * inputs.q.shape[1] * inputs.q.shape[2];
  const DenseReference dense = run_dense_reference(ctx.get(), inputs, s.eval, rows);
  std::vector<PolicyResult> results = {dense_result(dense, rows, rows_total)};
  const std::string label =
      std::string(sparsa_policy_kind_name(kind)) + ((policy.flags & SPARSA_POLICY_FLAG_DELTA) ? "+DELTA" : "");
  if (kind != SPARSA_POLICY_DENSE || policy.flags != 0) {
    results.push_back(
        evaluate_policy(ctx.get(), inputs, dense, label, rows, policy, kind == SPARSA_POLICY_TOKEN_SPARSE, s.eval));
  }

  if (!s.out_path.empty()) {
    NpyArray out;
    out.descr = npy_descr(inputs.q.dtype);
    out.shape = inputs.q.shape;
    if (q_rank == 3) out.shape.erase(out.shape.begin());
    out.bytes = results.size() > 1 ? results.back().out.bytes : dense.native_out.bytes;  // DENSE: the reference
    write_npy(s.out_path, out);
  }

  std::cout << "sparsa " << sparsa_version_string() << " run: q [" << inputs.q.shape[0] << ", " << inputs.q.shape[1]
            << ", " << inputs.q.shape[2] << ", " << inputs.q.shape[3] << "], k/v [" << inputs.k.shape[0] << ", "
            << inputs.k.shape[1] << ", " << inputs.k.shape[2] << ", " << inputs.k.shape[3] << "] "
            << npy_descr(inputs.q.dtype) << (s.bf16 ? " (bf16)" : "") << (s.causal ? " causal" : " non-causal") << "\n";
  print_results(std::cout, results);
  if (!s.out_path.empty()) std::cout << "wrote " << s.out_path << "\n";
  return 0;
}

}  // namespace sparsa_cli
