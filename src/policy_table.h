// The one table of policy kinds: for each sparsa_policy_kind its name, the ALGORITHMS.md section, which sparsa_policy
// fields it reads, what it may output, how its stats count blocks, and which backends run it. Validation
// (validate.cpp), the public names and init (api.cpp, policy_defaults.cpp), the stats and every backend's dispatch
// read it; the CLI reads it through sparsa_policy_kind_name. Adding a kind: a row here (and the header's enum),
// its validation and defaults by field group, and its entry in each backend that runs it (docs/architecture.md).
// Header-only and constexpr so that the GPU sources can read it too; no CUDA include.
#pragma once

#include <sparsa/sparsa.h>

#include <cstdint>

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
};

constexpr PolicyKindInfo kPolicyKinds[] = {
    {SPARSA_POLICY_DENSE, "DENSE", "§1", kFieldsNone, false, false, false, StatBlocks::kDefaultTiling,
     kRunsEverywhere},
    {SPARSA_POLICY_SINK_WINDOW, "SINK_WINDOW", "§2", kFieldsSinkWindow, false, false, false,
     StatBlocks::kDefaultTiling, kRunsEverywhere},
    {SPARSA_POLICY_BLOCK_SPARSE, "BLOCK_SPARSE", "§3", kFieldsBlockMask, false, false, false,
     StatBlocks::kPolicyBlocks, kRunsEverywhere},
    {SPARSA_POLICY_SPARGE, "SPARGE", "§4", kFieldsSparge, false, false, true, StatBlocks::kPolicyBlocks,
     kRunsEverywhere},
    {SPARSA_POLICY_TOKEN_SPARSE, "TOKEN_SPARSE", "§5", kFieldsTokenSparse, true, true, false, StatBlocks::kNone,
     kRunsEverywhere},
    {SPARSA_POLICY_TOKEN_SELECT, "TOKEN_SELECT", "§6", kFieldsTokenSelect, true, true, false, StatBlocks::kNone,
     kRunsEverywhere},
    {SPARSA_POLICY_TOKEN_INDICES, "TOKEN_INDICES", "§7", kFieldsTokenIndices, true, true, false, StatBlocks::kNone,
     kRunsEverywhere},
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
