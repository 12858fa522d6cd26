// Validation of sparsa_cp_select_* (context-parallel TOKEN_SELECT, docs/context_parallel.md).
#pragma once

#include <sparsa/sparsa.h>

#include "backend.h"

struct sparsa_context;

namespace sparsa {

// The step's tensors as the caller passed them (NULL where a step has none).
struct CpSelectTensors {
  const sparsa_tensor* global_max = nullptr;
  const sparsa_tensor* global_sum = nullptr;
  const sparsa_tensor* all_votes = nullptr;
  const sparsa_tensor* all_positions = nullptr;
  const sparsa_tensor* out = nullptr;
  const sparsa_tensor* out_positions = nullptr;
};

// Checks everything a step reads or writes; throws sparsa::Error (nothing written) on the first problem.
CpSelectCall validate_cp_select(const sparsa_context& ctx, CpSelectStep step, const sparsa_attention_args* args,
                                const sparsa_policy* policy, const sparsa_tensor* kv_start,
                                const sparsa_tensor* kv_total, const CpSelectTensors& tensors);

}  // namespace sparsa
