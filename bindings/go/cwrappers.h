// C side of the Go binding: one small wrapper per sparsa call.
//
// Why wrappers at all:
//   1. The error message is thread-local and a goroutine may move to another OS thread between two cgo calls, so
//      every wrapper copies sparsa_last_error_message() inside the very call that failed (gs_result.message, freed by
//      Go with C.free).
//   2. cgo forbids Go memory that holds Go pointers from being passed to C, and forbids storing Go pointers in C
//      memory. A sparsa_tensor whose `data` points at a Go slice is exactly that. So Go passes the descriptors with
//      data = NULL (gs_tensors), and every Go data pointer as a separate argument; the wrapper copies the
//      descriptors onto its own stack, sets `data` there and builds the argument structs there. Nothing of it
//      outlives the call. Go 1.19 has no runtime.Pinner, hence one argument per pointer.
#ifndef SPARSA_GO_CWRAPPERS_H
#define SPARSA_GO_CWRAPPERS_H

#include <sparsa/sparsa.h>

#include <stdint.h>

// Slots of gs_tensors. Attention uses the argument and policy slots (GS_Q..GS_POLICY_HEAD_MAP), the tuner those and
// GS_TUNE_*, the context-parallel selection calls those and GS_CP_*; the utilities use slots 0..n-1 in argument
// order.
enum gs_slot {
  GS_Q = 0,
  GS_K,
  GS_V,
  GS_OUT,
  GS_LSE,
  GS_CU_SEQLENS_Q,
  GS_CU_SEQLENS_K,
  GS_PAGE_TABLE,
  GS_SEQ_LENS_K,
  GS_SELECTED_INDICES,
  GS_BLOCK_MASK_OUT,
  GS_STATS,
  GS_QUERY_OFFSETS,
  GS_POLICY_BLOCK_MASK,
  GS_POLICY_SPARGE_HEAD_PARAMS,
  GS_POLICY_INDICES,
  GS_POLICY_HEAD_MAP,
  GS_TUNE_PARAMS,
  GS_TUNE_METRICS,
  // sparsa_cp_select_*: the shard's range, then the step's inputs and outputs in the C argument order (step 1 uses
  // GS_CP_OUT_A; step 2 GS_CP_IN_A, GS_CP_OUT_A; step 3 all four; step 4 GS_CP_IN_A, GS_CP_IN_B, GS_CP_OUT_A).
  GS_CP_KV_START,
  GS_CP_KV_TOTAL,
  GS_CP_IN_A,
  GS_CP_IN_B,
  GS_CP_OUT_A,
  GS_CP_OUT_B,
  GS_MAX_TENSORS
};

// Tensor descriptors as Go fills them: `desc[i].data` is always NULL; a raw (non-Go) address travels in
// `address[i]`, a Go address as the wrapper's data argument i.
typedef struct gs_tensors {
  sparsa_tensor desc[GS_MAX_TENSORS];
  uintptr_t address[GS_MAX_TENSORS];
  int32_t present[GS_MAX_TENSORS];
} gs_tensors;

// Status plus, on failure, a malloc'd copy of the message (NULL on success or when out of memory).
typedef struct gs_result {
  sparsa_status status;
  char* message;
} gs_result;

gs_result gs_policy_init(sparsa_policy* policy, int32_t kind);
gs_result gs_sparge_tune_options_init(sparsa_sparge_tune_options* options);

gs_result gs_context_create(const sparsa_context_options* options, sparsa_context** out);
gs_result gs_context_set_stream(sparsa_context* ctx, uintptr_t stream);
gs_result gs_context_device_type(const sparsa_context* ctx, int32_t* device_type);
gs_result gs_context_scratch_bytes(const sparsa_context* ctx, uint64_t* bytes);

gs_result gs_selection_cache_create(sparsa_context* ctx, int32_t max_batch, int32_t num_q_heads, int32_t num_kv_heads,
                                    int32_t head_dim, int32_t max_top_k, sparsa_selection_cache** out);
gs_result gs_selection_cache_reset(sparsa_selection_cache* cache);
gs_result gs_selection_cache_counts(const sparsa_selection_cache* cache, int64_t* hits, int64_t* misses);

// plan != 0 calls sparsa_attention_plan, else sparsa_attention_run. policy NULL = DENSE defaults; its tensor
// pointer fields are ignored and taken from the GS_POLICY_* slots.
gs_result gs_attention(int32_t plan, sparsa_context* ctx, const gs_tensors* tensors, int32_t causal,
                       float softmax_scale, sparsa_selection_cache* cache, const sparsa_policy* policy, void* d0,
                       void* d1, void* d2, void* d3, void* d4, void* d5, void* d6, void* d7, void* d8, void* d9,
                       void* d10, void* d11, void* d12, void* d13, void* d14, void* d15, void* d16);
gs_result gs_sparge_tune(sparsa_context* ctx, const gs_tensors* tensors, int32_t causal, float softmax_scale,
                         const sparsa_policy* policy, const sparsa_sparge_tune_options* options, void* d0, void* d1,
                         void* d2, void* d3, void* d4, void* d5, void* d6, void* d7, void* d8, void* d9, void* d10,
                         void* d11, void* d12, void* d13, void* d14, void* d15, void* d16, void* d17, void* d18);

// Steps of the context-parallel TOKEN_SELECT protocol (docs/context_parallel.md).
enum gs_cp_step { GS_CP_SELECT_MAX = 1, GS_CP_SELECT_SUM, GS_CP_SELECT_TOPK, GS_CP_SELECT_INDICES };

// Calls the sparsa_cp_select_* function of `step` (a gs_cp_step; any other value is INVALID_ARGUMENT). d0..d16 as
// for gs_attention, then the data of the GS_CP_* slots.
gs_result gs_cp_select(int32_t step, sparsa_context* ctx, const gs_tensors* tensors, int32_t causal,
                       float softmax_scale, sparsa_selection_cache* cache, const sparsa_policy* policy, void* d0,
                       void* d1, void* d2, void* d3, void* d4, void* d5, void* d6, void* d7, void* d8, void* d9,
                       void* d10, void* d11, void* d12, void* d13, void* d14, void* d15, void* d16, void* kv_start,
                       void* kv_total, void* in_a, void* in_b, void* out_a, void* out_b);

gs_result gs_merge_states(sparsa_context* ctx, const gs_tensors* tensors, void* o_a, void* lse_a, void* o_b,
                          void* lse_b, void* out, void* out_lse);
gs_result gs_topk_from_scores(sparsa_context* ctx, const gs_tensors* tensors, int32_t k, int32_t block_size,
                              void* scores, void* out_indices);
gs_result gs_head_mapping(const gs_tensors* tensors, int32_t k, void* draft, void* target, void* out_map);
gs_result gs_kv_prefetch(sparsa_context* ctx, const gs_tensors* tensors, void* k_src, void* v_src, void* indices,
                         void* k_dst, void* v_dst, void* positions, void* remapped, void* counts);
gs_result gs_hilbert_permutation(int32_t t, int32_t h, int32_t w, int32_t* perm, int32_t* inverse,
                                 int64_t capacity);
gs_result gs_drift_select_layers(const gs_tensors* tensors, float delta, void* h_in, void* h_out, void* out_ratio,
                                 void* out_sparse);

#endif  // SPARSA_GO_CWRAPPERS_H
