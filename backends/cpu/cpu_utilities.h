// CPU implementations of the backend utilities that live beside the policies (owned by the selection-policy
// files); cpu_backend.cpp forwards Backend's virtual calls here.
#pragma once

#include <memory>

#include "../../src/backend.h"
#include "attention_loop.h"

namespace sparsa::cpu {

// §7 top-k from draft scores (cpu_topk.cpp). Arguments already validated by the core.
void cpu_topk_from_scores(const TensorArg& scores, int32_t k, int32_t block_size, const TensorArg& out_indices,
                          const ExecContext& exec);

// §7 KV prefetch as a gather into compact buffers (cpu_prefetch.cpp). Arguments validated by the core, index
// contents included.
void cpu_kv_prefetch(const PrefetchProblem& problem, const ExecContext& exec);

// §6.5 TokenSelect's selection cache in host memory (cpu_token_select.cpp).
std::unique_ptr<SelectionCacheState> make_cpu_selection_cache(const SelectionCacheDims& dims);

// Context-parallel TOKEN_SELECT, one step of sparsa_cp_select_* (cpu_context_parallel.cpp).
void cpu_cp_select(const CpSelectCall& call, const ExecContext& exec);

}  // namespace sparsa::cpu
