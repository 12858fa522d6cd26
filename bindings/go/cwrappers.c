// C side of the Go binding; see cwrappers.h for why it exists. cgo compiles this file with the package's
// `#cgo pkg-config: sparsa` flags.
#include "cwrappers.h"

#include <stdlib.h>
#include <string.h>

// A failure with a malloc'd copy of `message` (NULL when out of memory).
static gs_result gs_fail(sparsa_status status, const char* message) {
  gs_result result = {status, NULL};
  size_t length = strlen(message);
  result.message = (char*)malloc(length + 1);
  if (result.message != NULL) memcpy(result.message, message, length + 1);
  return result;
}

// Finishes a call: on failure, copies the thread-local message while still on the thread that failed.
static gs_result gs_finish(sparsa_status status) {
  if (status != SPARSA_STATUS_SUCCESS) return gs_fail(status, sparsa_last_error_message());
  gs_result result = {status, NULL};
  return result;
}

// Copies the Go-filled descriptors onto the caller's (C) stack and points each present one at its data: the Go
// address in `go_data[i]` when there is one, else the raw address. `views[i]` is NULL for an absent tensor.
static void gs_resolve(const gs_tensors* tensors, void* const* go_data, int count, sparsa_tensor* local,
                       const sparsa_tensor** views) {
  for (int i = 0; i < count; ++i) {
    views[i] = NULL;
    if (!tensors->present[i]) continue;
    local[i] = tensors->desc[i];
    local[i].data = go_data[i] != NULL ? go_data[i] : (void*)tensors->address[i];
    views[i] = &local[i];
  }
}

gs_result gs_policy_init(sparsa_policy* policy, int32_t kind) {
  return gs_finish(sparsa_policy_init(policy, sizeof *policy, kind));
}

gs_result gs_sparge_tune_options_init(sparsa_sparge_tune_options* options) {
  return gs_finish(sparsa_sparge_tune_options_init(options, sizeof *options));
}

gs_result gs_context_create(const sparsa_context_options* options, sparsa_context** out) {
  return gs_finish(sparsa_context_create(options, out));
}

gs_result gs_context_set_stream(sparsa_context* ctx, uintptr_t stream) {
  return gs_finish(sparsa_context_set_stream(ctx, (void*)stream));
}

gs_result gs_context_device_type(const sparsa_context* ctx, int32_t* device_type) {
  return gs_finish(sparsa_context_device_type(ctx, device_type));
}

gs_result gs_context_scratch_bytes(const sparsa_context* ctx, uint64_t* bytes) {
  return gs_finish(sparsa_context_scratch_bytes(ctx, bytes));
}

gs_result gs_selection_cache_create(sparsa_context* ctx, int32_t max_batch, int32_t num_q_heads, int32_t num_kv_heads,
                                    int32_t head_dim, int32_t max_top_k, sparsa_selection_cache** out) {
  return gs_finish(
      sparsa_selection_cache_create(ctx, max_batch, num_q_heads, num_kv_heads, head_dim, max_top_k, out));
}

gs_result gs_selection_cache_reset(sparsa_selection_cache* cache) {
  return gs_finish(sparsa_selection_cache_reset(cache));
}

gs_result gs_selection_cache_counts(const sparsa_selection_cache* cache, int64_t* hits, int64_t* misses) {
  return gs_finish(sparsa_selection_cache_counts(cache, hits, misses));
}

// Builds the attention arguments and the policy (with its tensor fields) from resolved views.
static void gs_build_attention(const sparsa_tensor* const* views, int32_t causal, float softmax_scale,
                               sparsa_selection_cache* cache, sparsa_attention_args* args,
                               const sparsa_policy* policy, sparsa_policy* local_policy) {
  sparsa_attention_args_init(args, sizeof *args);
  args->q = views[GS_Q];
  args->k = views[GS_K];
  args->v = views[GS_V];
  args->out = views[GS_OUT];
  args->lse = views[GS_LSE];
  args->causal = causal;
  args->softmax_scale = softmax_scale;
  args->cu_seqlens_q = views[GS_CU_SEQLENS_Q];
  args->cu_seqlens_k = views[GS_CU_SEQLENS_K];
  args->page_table = views[GS_PAGE_TABLE];
  args->seq_lens_k = views[GS_SEQ_LENS_K];
  args->selection_cache = cache;
  args->selected_indices = views[GS_SELECTED_INDICES];
  args->block_mask_out = views[GS_BLOCK_MASK_OUT];
  args->stats = views[GS_STATS];
  args->query_offsets = views[GS_QUERY_OFFSETS];
  if (policy != NULL) {
    *local_policy = *policy;
    local_policy->block_mask = views[GS_POLICY_BLOCK_MASK];
    local_policy->sparge_head_params = views[GS_POLICY_SPARGE_HEAD_PARAMS];
    local_policy->indices = views[GS_POLICY_INDICES];
    local_policy->head_map = views[GS_POLICY_HEAD_MAP];
  }
}

gs_result gs_attention(int32_t plan, sparsa_context* ctx, const gs_tensors* tensors, int32_t causal,
                       float softmax_scale, sparsa_selection_cache* cache, const sparsa_policy* policy, void* d0,
                       void* d1, void* d2, void* d3, void* d4, void* d5, void* d6, void* d7, void* d8, void* d9,
                       void* d10, void* d11, void* d12, void* d13, void* d14, void* d15, void* d16) {
  void* const go_data[GS_POLICY_HEAD_MAP + 1] = {d0, d1, d2,  d3,  d4,  d5,  d6,  d7, d8,
                                                 d9, d10, d11, d12, d13, d14, d15, d16};
  sparsa_tensor local[GS_MAX_TENSORS];
  const sparsa_tensor* views[GS_MAX_TENSORS];
  gs_resolve(tensors, go_data, GS_POLICY_HEAD_MAP + 1, local, views);
  sparsa_attention_args args;
  sparsa_policy local_policy;
  gs_build_attention(views, causal, softmax_scale, cache, &args, policy, &local_policy);
  const sparsa_policy* used_policy = policy != NULL ? &local_policy : NULL;
  return gs_finish(plan ? sparsa_attention_plan(ctx, &args, used_policy)
                        : sparsa_attention_run(ctx, &args, used_policy));
}

gs_result gs_sparge_tune(sparsa_context* ctx, const gs_tensors* tensors, int32_t causal, float softmax_scale,
                         const sparsa_policy* policy, const sparsa_sparge_tune_options* options, void* d0, void* d1,
                         void* d2, void* d3, void* d4, void* d5, void* d6, void* d7, void* d8, void* d9, void* d10,
                         void* d11, void* d12, void* d13, void* d14, void* d15, void* d16, void* d17, void* d18) {
  void* const go_data[GS_TUNE_METRICS + 1] = {d0,  d1,  d2,  d3,  d4,  d5,  d6,  d7,  d8,  d9,
                                              d10, d11, d12, d13, d14, d15, d16, d17, d18};
  sparsa_tensor local[GS_MAX_TENSORS];
  const sparsa_tensor* views[GS_MAX_TENSORS];
  gs_resolve(tensors, go_data, GS_TUNE_METRICS + 1, local, views);
  sparsa_attention_args args;
  sparsa_policy local_policy;
  gs_build_attention(views, causal, softmax_scale, NULL, &args, policy, &local_policy);
  return gs_finish(sparsa_sparge_tune(ctx, &args, policy != NULL ? &local_policy : NULL, options,
                                      views[GS_TUNE_PARAMS], views[GS_TUNE_METRICS]));
}

gs_result gs_cp_select(int32_t step, sparsa_context* ctx, const gs_tensors* tensors, int32_t causal,
                       float softmax_scale, sparsa_selection_cache* cache, const sparsa_policy* policy, void* d0,
                       void* d1, void* d2, void* d3, void* d4, void* d5, void* d6, void* d7, void* d8, void* d9,
                       void* d10, void* d11, void* d12, void* d13, void* d14, void* d15, void* d16, void* kv_start,
                       void* kv_total, void* in_a, void* in_b, void* out_a, void* out_b) {
  // The tuner's slots stay NULL (absent): Go never fills them for these calls.
  void* const go_data[GS_MAX_TENSORS] = {d0, d1, d2, d3, d4, d5, d6, d7, d8, d9, d10, d11, d12, d13, d14, d15, d16,
                                         [GS_CP_KV_START] = kv_start, [GS_CP_KV_TOTAL] = kv_total,
                                         [GS_CP_IN_A] = in_a, [GS_CP_IN_B] = in_b, [GS_CP_OUT_A] = out_a,
                                         [GS_CP_OUT_B] = out_b};
  sparsa_tensor local[GS_MAX_TENSORS];
  const sparsa_tensor* views[GS_MAX_TENSORS];
  gs_resolve(tensors, go_data, GS_MAX_TENSORS, local, views);
  sparsa_attention_args args;
  sparsa_policy local_policy;
  gs_build_attention(views, causal, softmax_scale, cache, &args, policy, &local_policy);
  const sparsa_policy* used_policy = policy != NULL ? &local_policy : NULL;
  const sparsa_tensor* kv_start_view = views[GS_CP_KV_START];
  const sparsa_tensor* kv_total_view = views[GS_CP_KV_TOTAL];
  switch (step) {
    case GS_CP_SELECT_MAX:
      return gs_finish(sparsa_cp_select_max(ctx, &args, used_policy, kv_start_view, kv_total_view,
                                            views[GS_CP_OUT_A]));
    case GS_CP_SELECT_SUM:
      return gs_finish(sparsa_cp_select_sum(ctx, &args, used_policy, kv_start_view, kv_total_view,
                                            views[GS_CP_IN_A], views[GS_CP_OUT_A]));
    case GS_CP_SELECT_TOPK:
      return gs_finish(sparsa_cp_select_topk(ctx, &args, used_policy, kv_start_view, kv_total_view,
                                             views[GS_CP_IN_A], views[GS_CP_IN_B], views[GS_CP_OUT_A],
                                             views[GS_CP_OUT_B]));
    case GS_CP_SELECT_INDICES:
      return gs_finish(sparsa_cp_select_indices(ctx, &args, used_policy, kv_start_view, kv_total_view,
                                                views[GS_CP_IN_A], views[GS_CP_IN_B], views[GS_CP_OUT_A]));
    default:
      return gs_fail(SPARSA_STATUS_INVALID_ARGUMENT, "step: expected a gs_cp_step (1..4)");
  }
}

gs_result gs_merge_states(sparsa_context* ctx, const gs_tensors* tensors, void* o_a, void* lse_a, void* o_b,
                          void* lse_b, void* out, void* out_lse) {
  enum { kCount = 6 };
  void* const go_data[kCount] = {o_a, lse_a, o_b, lse_b, out, out_lse};
  sparsa_tensor local[kCount];
  const sparsa_tensor* v[kCount];
  gs_resolve(tensors, go_data, kCount, local, v);
  return gs_finish(sparsa_merge_states(ctx, v[0], v[1], v[2], v[3], v[4], v[5]));
}

gs_result gs_topk_from_scores(sparsa_context* ctx, const gs_tensors* tensors, int32_t k, int32_t block_size,
                              void* scores, void* out_indices) {
  enum { kCount = 2 };
  void* const go_data[kCount] = {scores, out_indices};
  sparsa_tensor local[kCount];
  const sparsa_tensor* v[kCount];
  gs_resolve(tensors, go_data, kCount, local, v);
  return gs_finish(sparsa_topk_from_scores(ctx, v[0], k, block_size, v[1]));
}

gs_result gs_head_mapping(const gs_tensors* tensors, int32_t k, void* draft, void* target, void* out_map) {
  enum { kCount = 3 };
  void* const go_data[kCount] = {draft, target, out_map};
  sparsa_tensor local[kCount];
  const sparsa_tensor* v[kCount];
  gs_resolve(tensors, go_data, kCount, local, v);
  return gs_finish(sparsa_head_mapping(v[0], v[1], k, v[2]));
}

gs_result gs_kv_prefetch(sparsa_context* ctx, const gs_tensors* tensors, void* k_src, void* v_src, void* indices,
                         void* k_dst, void* v_dst, void* positions, void* remapped, void* counts) {
  enum { kCount = 8 };
  void* const go_data[kCount] = {k_src, v_src, indices, k_dst, v_dst, positions, remapped, counts};
  sparsa_tensor local[kCount];
  const sparsa_tensor* v[kCount];
  gs_resolve(tensors, go_data, kCount, local, v);
  return gs_finish(sparsa_kv_prefetch(ctx, v[0], v[1], v[2], v[3], v[4], v[5], v[6], v[7]));
}

gs_result gs_hilbert_permutation(int32_t t, int32_t h, int32_t w, int32_t* perm, int32_t* inverse,
                                 int64_t capacity) {
  return gs_finish(sparsa_hilbert_permutation(t, h, w, perm, inverse, capacity));
}

gs_result gs_drift_select_layers(const gs_tensors* tensors, float delta, void* h_in, void* h_out, void* out_ratio,
                                 void* out_sparse) {
  enum { kCount = 4 };
  void* const go_data[kCount] = {h_in, h_out, out_ratio, out_sparse};
  sparsa_tensor local[kCount];
  const sparsa_tensor* v[kCount];
  gs_resolve(tensors, go_data, kCount, local, v);
  return gs_finish(sparsa_drift_select_layers(v[0], v[1], delta, v[2], v[3]));
}
