// Argument validation of the C API. Every check throws sparsa::Error with a message that names the argument, says
// what was expected and what came. Nothing here writes caller memory, so a failed call leaves outputs untouched.
#pragma once

#include <sparsa/sparsa.h>

#include <cstdint>
#include <cstring>
#include <initializer_list>

#include "backend.h"
#include "caller_struct.h"
#include "error.h"
#include "problem.h"

struct sparsa_context;

namespace sparsa {

// Where a tensor must live.
struct DeviceRule {
  int32_t device_type = SPARSA_DEVICE_CPU;  // the context's backend
  int32_t device_id = 0;
};

// ---- Per-tensor checks (name = the argument's name in messages, e.g. "k" or "policy.indices") ----

// NULL (required → NULL_POINTER, else absent), struct_size, 1 <= ndim <= SPARSA_MAX_DIMS, extents >= 0,
// strides >= 0, data non-NULL when the tensor has elements.
TensorArg read_tensor(const sparsa_tensor* t, const char* name, bool required);
void expect_dtype(const TensorArg& a, const char* name, int32_t dtype);
void expect_rank(const TensorArg& a, const char* name, int rank, const char* layout);
// An expected shape, held inline so that validating a run allocates nothing.
struct ShapeSpec {
  int64_t dims[SPARSA_MAX_DIMS] = {};
  int rank = 0;
  ShapeSpec(std::initializer_list<int64_t> extents) {
    for (int64_t e : extents) {
      if (rank < SPARSA_MAX_DIMS) dims[rank++] = e;
    }
  }
  static ShapeSpec of(const sparsa_tensor& t) {
    ShapeSpec s({});
    for (int i = 0; i < t.ndim; ++i) s.dims[s.rank++] = t.shape[i];
    return s;
  }
};
// Shape must equal `shape`; `why` says where the expectation comes from (e.g. "q's shape").
void expect_shape(const TensorArg& a, const char* name, const ShapeSpec& shape, const char* why);
void expect_last_stride_one(const TensorArg& a, const char* name);
// No two elements share an address (no stride 0 on an extent above 1, no interleaved dimensions): an output's
// elements are then backed by real memory, so work that follows its extents is bounded by what the caller owns.
// Checked by nesting: taken by ascending stride, each dimension's stride must reach past everything before it.
void expect_distinct_elements(const TensorArg& a, const char* name);
// On the context's device (CPU contexts also accept pinned CUDA_HOST memory).
void expect_on_device(const TensorArg& a, const char* name, const DeviceRule& rule);
// Host-readable memory (CPU or CUDA_HOST).
void expect_host(const TensorArg& a, const char* name);

// ---- Whole calls ----

// sparsa_attention_run / plan / tune: validates everything and builds the backend's view of the run.
void validate_attention(const sparsa_context& ctx, const sparsa_attention_args* args, const sparsa_policy* policy,
                        AttentionProblem* problem, PolicyParams* params);

MergeProblem validate_merge(const DeviceRule& rule, const sparsa_tensor* o_a, const sparsa_tensor* lse_a,
                            const sparsa_tensor* o_b, const sparsa_tensor* lse_b, const sparsa_tensor* out,
                            const sparsa_tensor* out_lse);

struct TopkCall {
  TensorArg scores, out_indices;
};
TopkCall validate_topk(const DeviceRule& rule, const sparsa_tensor* scores, int32_t k, int32_t block_size,
                       const sparsa_tensor* out_indices);

PrefetchProblem validate_prefetch(const DeviceRule& rule, const sparsa_tensor* k_src, const sparsa_tensor* v_src,
                                  const sparsa_tensor* indices, const sparsa_tensor* k_dst, const sparsa_tensor* v_dst,
                                  const sparsa_tensor* positions, const sparsa_tensor* remapped,
                                  const sparsa_tensor* counts);

// ---- Defaults (policy_defaults.cpp) ----

bool is_known_policy_kind(int32_t kind);
// Every documented default of sparsa_policy for `kind` (struct_size set). Kind is not checked.
sparsa_policy default_policy(int32_t kind);
sparsa_attention_args default_attention_args();
sparsa_context_options default_context_options();
sparsa_sparge_tune_options default_sparge_tune_options();

}  // namespace sparsa
