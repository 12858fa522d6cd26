// The one internal interface every backend implements (CPU in backends/cpu, CUDA/HIP in backends/gpu).
//
// The core (src/) owns validation, the C API boundary and the host-only utilities; a backend owns compute on its
// device and its scratch memory. A backend reports failure by throwing sparsa::Error (src/error.h). src/registry.cpp
// is the only core file that knows which backends exist. Nothing here includes a GPU header.
#pragma once

#include <sparsa/sparsa.h>

#include <cstdint>
#include <memory>
#include <string>

#include "error.h"
#include "problem.h"

namespace sparsa {

// Sizes a selection cache is created for (sparsa_selection_cache_create).
struct SelectionCacheDims {
  int32_t max_batch = 0;
  int32_t num_q_heads = 0;
  int32_t num_kv_heads = 0;
  int32_t head_dim = 0;
  int32_t max_top_k = 0;
};

// TokenSelect's per-layer selection cache, in the backend's memory. Created by Backend::create_selection_cache.
class SelectionCacheState {
 public:
  virtual ~SelectionCacheState() = default;
  virtual const SelectionCacheDims& dims() const = 0;
  virtual void reset() = 0;                                    // empty every slot, zero the counts
  virtual void counts(int64_t* hits, int64_t* misses) const = 0;  // totals since creation/reset
};

// Validated arguments of sparsa_merge_states.
struct MergeProblem {
  TensorArg o_a, lse_a, o_b, lse_b, out, out_lse;  // out_lse may be absent
  bool packed = false;                              // o rank 3 [T, H, D], lse [H, T]
};

// Validated arguments of sparsa_kv_prefetch.
struct PrefetchProblem {
  TensorArg k_src, v_src, indices, k_dst, v_dst, positions, remapped, counts;  // counts may be absent
};

// Validated arguments of the context-parallel TOKEN_SELECT steps (sparsa_cp_select_*, src/validate_context_parallel.cpp).
enum class CpSelectStep : int32_t { kMax = 1, kSum = 2, kTopk = 3, kIndices = 4 };
struct CpSelectCall {
  CpSelectStep step = CpSelectStep::kMax;
  AttentionProblem problem;  // q: every query row; k/v: this shard's keys (out is not written)
  PolicyParams policy;       // TOKEN_SELECT
  TensorArg kv_start, kv_total;  // I32 [B], host-readable, contents checked against the shard's key counts
  TensorArg global_max;          // kSum, kTopk: F64 [B, Hq]
  TensorArg global_sum;          // kTopk: I64 [B, Hq, SPARSA_CP_SUM_DIGITS]
  TensorArg all_votes, all_positions;  // kIndices: F64 / I32 [G, B, n_sets, top_k]
  TensorArg out, out_positions;  // kMax: F64 [B, Hq]; kSum: I64 [B, Hq, digits]; kTopk: votes + positions;
                                 // kIndices: I32 [B, n_sets, cap]
};

class Backend {
 public:
  virtual ~Backend() = default;

  virtual int32_t device_type() const = 0;  // sparsa_device_type this backend computes on
  virtual const char* name() const = 0;     // "cpu", "cuda", "hip"
  virtual void set_stream(void* stream) = 0;  // GPU: stream later work enqueues on; CPU: ignored
  virtual uint64_t scratch_bytes() const = 0;

  // Answers, before anything is written, whether this backend can run the case; when it cannot, returns false and
  // fills `reason` (the API turns it into SPARSA_STATUS_UNSUPPORTED). (ggml fattn.cu / oneDNN style.)
  virtual bool supports(const AttentionProblem& problem, const PolicyParams& policy, std::string* reason) const = 0;

  // Grows scratch for this problem; computes nothing. Called only after validation and supports() == true (the
  // API asks supports() once per call; plan and run need not ask again).
  virtual void plan(const AttentionProblem& problem, const PolicyParams& policy) = 0;

  // Computes every requested output of the run. Called only after validation and supports() == true.
  virtual void run(const AttentionProblem& problem, const PolicyParams& policy) = 0;

  // Utilities whose data lives on the backend's device.
  virtual void merge_states(const MergeProblem& problem) = 0;
  virtual void topk_from_scores(const TensorArg& scores, int32_t k, int32_t block_size,
                                const TensorArg& out_indices) = 0;
  virtual void kv_prefetch(const PrefetchProblem& problem) = 0;
  virtual std::unique_ptr<SelectionCacheState> create_selection_cache(const SelectionCacheDims& dims) = 0;

  // Context-parallel TOKEN_SELECT (docs/context_parallel.md): one step of sparsa_cp_select_*, with the CPU
  // backend's bits (the CPU and GPU backends implement it; cp_select_host.h holds their shared host parts).
  virtual void cp_select(const CpSelectCall& call) = 0;
};

}  // namespace sparsa
