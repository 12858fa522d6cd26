// The one table of policy kinds: for each sparsa_policy_kind its name, the ALGORITHMS.md section, which sparsa_policy
// fields it reads, what it may output, how its stats count blocks, which backends run it, and the documented defaults
// of the fields it reads. Validation (validate.cpp), the public names and init (api.cpp, policy_defaults.cpp), the
// stats and every backend's dispatch read it; the CLI reads it through sparsa_policy_kind_name. Adding a kind: a row
// here (and the header's enum), its validation by field group, and its entry in each backend that runs it
// (docs/architecture.md).
// Header-only and constexpr so that the GPU sources can read it too; no CUDA include.
#pragma once

#include <sparsa/sparsa.h>

#include <cstdint>
#include <limits>

namespace sparsa {

// Groups of sparsa_policy fields (include/sparsa/sparsa.h); a kind reads the groups its row names. The Δ fields
// (delta_gamma, delta_tail_min) are read by any kind with SPARSA_POLICY_FLAG_DELTA.
enum PolicyFields : uint32_t {
  kFieldsNone = 0,
  kFieldsSinkWindow = 1u << 0,   // sink_tokens, sink_window
  kFieldsBlockMask = 1u << 1,    // block_q, block_k, block_mask
  kFieldsSparge = 1u << 2,       // block_q, block_k, sparge_*
  kFieldsTokenSparse = 1u << 3,  // token_sparse_*
  kFieldsTokenSelect = 1u << 4,  // select_*
  kFieldsTokenIndices = 1u << 5, // indices, head_map, index_*
};

// Backends that run a kind (a backend not named answers SPARSA_STATUS_UNSUPPORTED with its reason).
enum PolicyBackends : uint32_t {
  kRunsOnCpu = 1u << 0,
  kRunsOnCuda = 1u << 1,
  kRunsOnRocm = 1u << 2,
  kRunsEverywhere = kRunsOnCpu | kRunsOnCuda | kRunsOnRocm,
};

// The tiling at which a kind reports SPARSA_STAT_BLOCKS_* (include/sparsa/sparsa.h).
enum class StatBlocks : uint8_t {
  kNone,           // token policies: no block tiling, BLOCKS_* are 0
  kDefaultTiling,  // the 128 × 64 tiling (kStatTileRows × kStatTileKeys)
  kPolicyBlocks,   // the policy's block_q × block_k
};

// The tiling of StatBlocks::kDefaultTiling.
constexpr int32_t kStatTileRows = 128;
constexpr int32_t kStatTileKeys = 64;

// The documented defaults (include/sparsa/sparsa.h) of the fields a kind reads, by field group; the groups a row does
// not read stay 0 in it. sparsa_policy_init fills every group from the row that reads it (policy_defaults.cpp), so a
// policy of any kind starts with every documented default. Pointers default to NULL and are not listed.
struct PolicyDefaults {
  int32_t sink_tokens, sink_window;  // kFieldsSinkWindow
  int32_t block_q, block_k;          // kFieldsBlockMask, kFieldsSparge
  float sparge_theta, sparge_tau, sparge_topk_fraction, sparge_lambda;  // kFieldsSparge
  int32_t sparge_attention_sink, sparge_quantized;
  int32_t token_sparse_window, token_sparse_pool_kernel;  // kFieldsTokenSparse
  float token_sparse_coverage;
  int32_t token_sparse_min_tokens;
  int32_t select_n_init, select_n_local, select_top_k, select_scale_scores;  // kFieldsTokenSelect
  float select_cache_theta;
  int32_t select_per_kv_head;
  int32_t index_block_size, index_n_init, index_n_local;  // kFieldsTokenIndices
};

constexpr float kLambdaOff = -std::numeric_limits<float>::infinity();  // SPARGE's λ skip off

constexpr PolicyDefaults no_defaults() { return PolicyDefaults{}; }
constexpr PolicyDefaults sink_window_defaults(int32_t sink_tokens, int32_t sink_window) {
  PolicyDefaults d{};
  d.sink_tokens = sink_tokens;
  d.sink_window = sink_window;
  return d;
}
constexpr PolicyDefaults block_mask_defaults(int32_t block_q, int32_t block_k) {
  PolicyDefaults d{};
  d.block_q = block_q;
  d.block_k = block_k;
  return d;
}
constexpr PolicyDefaults sparge_defaults(int32_t block_q, int32_t block_k, float theta, float tau, float topk_fraction,
                                         float lambda, int32_t attention_sink, int32_t quantized) {
  PolicyDefaults d{};
  d.block_q = block_q;
  d.block_k = block_k;
  d.sparge_theta = theta;
  d.sparge_tau = tau;
  d.sparge_topk_fraction = topk_fraction;
  d.sparge_lambda = lambda;
  d.sparge_attention_sink = attention_sink;
  d.sparge_quantized = quantized;
  return d;
}
constexpr PolicyDefaults token_sparse_defaults(int32_t window, int32_t pool_kernel, float coverage,
                                               int32_t min_tokens) {
  PolicyDefaults d{};
  d.token_sparse_window = window;
  d.token_sparse_pool_kernel = pool_kernel;
  d.token_sparse_coverage = coverage;
  d.token_sparse_min_tokens = min_tokens;
  return d;
}
constexpr PolicyDefaults token_select_defaults(int32_t n_init, int32_t n_local, int32_t top_k, int32_t scale_scores,
                                               float cache_theta, int32_t per_kv_head) {
  PolicyDefaults d{};
  d.select_n_init = n_init;
  d.select_n_local = n_local;
  d.select_top_k = top_k;
  d.select_scale_scores = scale_scores;
  d.select_cache_theta = cache_theta;
  d.select_per_kv_head = per_kv_head;
  return d;
}
constexpr PolicyDefaults token_indices_defaults(int32_t block_size, int32_t n_init, int32_t n_local) {
  PolicyDefaults d{};
  d.index_block_size = block_size;
  d.index_n_init = n_init;
  d.index_n_local = n_local;
  return d;
}

// §8 Δ is a flag on any kind, not a kind: its fields' defaults.
struct DeltaDefaults {
  int32_t gamma, tail_min;
};
constexpr DeltaDefaults kDeltaDefaults = {/*gamma=*/64, /*tail_min=*/128};

struct PolicyKindInfo {
  int32_t kind;
  const char* name;      // sparsa_policy_kind_name
  const char* section;   // ALGORITHMS.md
  uint32_t fields;       // PolicyFields
  bool always_causal;    // the spec defines it as causal: args.causal cannot turn that off
  bool index_sets;       // may write selected_indices
  bool predicts_mask;    // may write block_mask_out
  StatBlocks stat_blocks;
  uint32_t backends;     // PolicyBackends
  PolicyDefaults defaults;  // of the fields groups `fields` names
};

constexpr PolicyKindInfo kPolicyKinds[] = {
    {SPARSA_POLICY_DENSE, "DENSE", "§1", kFieldsNone, false, false, false, StatBlocks::kDefaultTiling,
     kRunsEverywhere, no_defaults()},
    {SPARSA_POLICY_SINK_WINDOW, "SINK_WINDOW", "§2", kFieldsSinkWindow, false, false, false,
     StatBlocks::kDefaultTiling, kRunsEverywhere,
     sink_window_defaults(/*sink_tokens=*/128, /*sink_window=*/2048)},
    {SPARSA_POLICY_BLOCK_SPARSE, "BLOCK_SPARSE", "§3", kFieldsBlockMask, false, false, false,
     StatBlocks::kPolicyBlocks, kRunsEverywhere, block_mask_defaults(/*block_q=*/128, /*block_k=*/64)},
    {SPARSA_POLICY_SPARGE, "SPARGE", "§4", kFieldsSparge, false, false, true, StatBlocks::kPolicyBlocks,
     kRunsEverywhere,
     sparge_defaults(/*block_q=*/128, /*block_k=*/64, /*theta=*/0.6f, /*tau=*/0.98f, /*topk_fraction=*/0.f,
                     /*lambda=*/kLambdaOff, /*attention_sink=*/0, /*quantized=*/0)},
    {SPARSA_POLICY_TOKEN_SPARSE, "TOKEN_SPARSE", "§5", kFieldsTokenSparse, true, true, false, StatBlocks::kNone,
     kRunsEverywhere,
     token_sparse_defaults(/*window=*/128, /*pool_kernel=*/7, /*coverage=*/0.005f, /*min_tokens=*/1024)},
    {SPARSA_POLICY_TOKEN_SELECT, "TOKEN_SELECT", "§6", kFieldsTokenSelect, true, true, false, StatBlocks::kNone,
     kRunsEverywhere,
     token_select_defaults(/*n_init=*/128, /*n_local=*/512, /*top_k=*/2048, /*scale_scores=*/0,
                           /*cache_theta=*/0.9f, /*per_kv_head=*/0)},
    {SPARSA_POLICY_TOKEN_INDICES, "TOKEN_INDICES", "§7", kFieldsTokenIndices, true, true, false, StatBlocks::kNone,
     kRunsEverywhere, token_indices_defaults(/*block_size=*/1, /*n_init=*/0, /*n_local=*/0)},
};
constexpr int32_t kPolicyKindCount = int32_t(sizeof(kPolicyKinds) / sizeof(kPolicyKinds[0]));

// The kinds are numbered 0 .. kPolicyKindCount - 1 in table order.
constexpr bool policy_table_is_ordered() {
  for (int32_t i = 0; i < kPolicyKindCount; ++i) {
    if (kPolicyKinds[i].kind != i) return false;
  }
  return true;
}
static_assert(policy_table_is_ordered(), "kPolicyKinds: one row per sparsa_policy_kind, in enum order");

// Fields shared by several kinds (block_q, block_k) have one default: every row that reads them agrees.
constexpr bool policy_table_block_defaults_agree() {
  const PolicyDefaults* first = nullptr;
  for (int32_t i = 0; i < kPolicyKindCount; ++i) {
    if ((kPolicyKinds[i].fields & (kFieldsBlockMask | kFieldsSparge)) == 0) continue;
    const PolicyDefaults& d = kPolicyKinds[i].defaults;
    if (first != nullptr && (d.block_q != first->block_q || d.block_k != first->block_k)) return false;
    if (first == nullptr) first = &d;
  }
  return first != nullptr;
}
static_assert(policy_table_block_defaults_agree(), "kPolicyKinds: every kind that reads block_q/block_k agrees");

// The row of `kind`, or nullptr for a value that is no sparsa_policy_kind.
constexpr const PolicyKindInfo* policy_kind_info(int32_t kind) {
  return kind >= 0 && kind < kPolicyKindCount ? &kPolicyKinds[kind] : nullptr;
}

// The PolicyBackends bit of a SPARSA_DEVICE_* value (0 for an unknown device).
constexpr uint32_t policy_backend_bit(int32_t device_type) {
  return device_type == SPARSA_DEVICE_CPU    ? kRunsOnCpu
         : device_type == SPARSA_DEVICE_CUDA ? kRunsOnCuda
         : device_type == SPARSA_DEVICE_ROCM ? kRunsOnRocm
                                             : 0u;
}

// True when `kind` is a known kind that the backend of `device_type` runs.
constexpr bool policy_runs_on(int32_t kind, int32_t device_type) {
  const PolicyKindInfo* info = policy_kind_info(kind);
  return info != nullptr && (info->backends & policy_backend_bit(device_type)) != 0;
}

}  // namespace sparsa
