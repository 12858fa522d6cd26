// The C API boundary: every exported sparsa_* function.
//
// Each fallible function clears this thread's message, then runs its body inside `guarded`, which turns
// sparsa::Error into its status + message, std::bad_alloc into SPARSA_STATUS_OUT_OF_MEMORY and anything else into
// SPARSA_STATUS_INTERNAL, so no exception crosses the ABI. Bodies validate everything (src/validate.cpp) before
// they write an out-parameter or call a backend, so a failed call writes nothing.
// Infallible getters (version, names, sizes, the message itself) leave the message alone, so a binding may call them
// between a failure and reading the message.
#include <sparsa/sparsa.h>

#include <cstdio>
#include <new>
#include <string>

#include "caller_struct.h"
#include "error.h"
#include "error_state.h"
#include "handles.h"
#include "host_utilities.h"
#include "policy_table.h"
#include "registry.h"
#include "tensor_util.h"
#include "validate.h"
#include "validate_context_parallel.h"

namespace sparsa {
namespace {

constexpr size_t kInternalMessageCapacity = 512;

template <typename Body>
sparsa_status guarded(Body&& body) noexcept {
  clear_last_error();
  try {
    body();
    return SPARSA_STATUS_SUCCESS;
  } catch (const Error& e) {
    return record_last_error(e.status(), e.what());
  } catch (const std::bad_alloc&) {
    return record_last_error(SPARSA_STATUS_OUT_OF_MEMORY, "out of memory (host allocation failed)");
  } catch (const std::exception& e) {
    char message[kInternalMessageCapacity];  // no allocation while handling a failure
    std::snprintf(message, sizeof message, "internal error: %s", e.what());
    return record_last_error(SPARSA_STATUS_INTERNAL, message);
  } catch (...) {
    return record_last_error(SPARSA_STATUS_INTERNAL, "internal error: unknown exception");
  }
}

template <typename T>
void require(const T* pointer, const char* name) {
  if (pointer == nullptr) fail(SPARSA_STATUS_NULL_POINTER, name, ": NULL");
}

DeviceRule device_rule(const sparsa_context& ctx) { return {ctx.options.device_type, ctx.options.device_id}; }

// Validation + supports(): what run and plan share.
void prepare_attention(sparsa_context* ctx, const sparsa_attention_args* args, const sparsa_policy* policy,
                       AttentionProblem* problem, PolicyParams* params) {
  require(ctx, "ctx");
  validate_attention(*ctx, args, policy, problem, params);  // the caller holds ctx (ContextUse)
  std::string reason;
  if (!ctx->backend->supports(*problem, *params, &reason)) {
    fail(SPARSA_STATUS_UNSUPPORTED, "the ", ctx->backend->name(), " backend does not support this run: ", reason);
  }
}

}  // namespace
}  // namespace sparsa

using namespace sparsa;

// ---- Version, status, message ----------------------------------------------------------------------------------

extern "C" SPARSA_API uint32_t sparsa_version(void) { return SPARSA_VERSION; }

#define SPARSA_STRINGIFY_(x) #x
#define SPARSA_STRINGIFY(x) SPARSA_STRINGIFY_(x)
extern "C" SPARSA_API const char* sparsa_version_string(void) {
  return SPARSA_STRINGIFY(SPARSA_VERSION_MAJOR) "." SPARSA_STRINGIFY(SPARSA_VERSION_MINOR) "." SPARSA_STRINGIFY(
      SPARSA_VERSION_PATCH);
}

extern "C" SPARSA_API const char* sparsa_status_string(sparsa_status status) { return status_name(status); }

extern "C" SPARSA_API const char* sparsa_last_error_message(void) { return last_error_message(); }

// ---- Tensors -----------------------------------------------------------------------------------------------------

extern "C" SPARSA_API sparsa_status sparsa_tensor_init(sparsa_tensor* t, size_t size, void* data, int32_t dtype,
                                                       int32_t ndim, const int64_t* shape) {
  return guarded([&] {
    require(t, "t");
    check_struct_size<sparsa_tensor>(size, "t");
    require(shape, "shape");
    if (ndim < 1 || ndim > SPARSA_MAX_DIMS) {
      fail(SPARSA_STATUS_SHAPE_MISMATCH, "ndim: expected 1..", SPARSA_MAX_DIMS, ", got ", ndim);
    }
    for (int32_t i = 0; i < ndim; ++i) {
      if (shape[i] < 0) fail(SPARSA_STATUS_SHAPE_MISMATCH, "shape[", i, "]: expected >= 0, got ", shape[i]);
    }
    if (dtype_size(dtype) == 0) fail(SPARSA_STATUS_DTYPE_MISMATCH, "dtype: unknown sparsa_dtype ", dtype);
    sparsa_tensor result{};
    result.dtype = dtype;
    result.device_type = SPARSA_DEVICE_CPU;
    result.device_id = 0;
    result.ndim = ndim;
    result.data = data;
    int64_t stride = 1;
    bool overflow = false;  // every row-major stride, and the element count, must fit int64
    for (int32_t i = ndim - 1; i >= 0; --i) {
      result.shape[i] = shape[i];
      result.strides[i] = stride;
      if (i > 0) overflow = overflow || __builtin_mul_overflow(stride, shape[i], &stride);
    }
    int64_t elements = 0;
    if (overflow || !checked_element_count(result, &elements)) {
      fail(SPARSA_STATUS_SHAPE_MISMATCH, "shape: ", shape_string(shape, ndim),
           " has more than INT64_MAX elements (its row-major strides overflow)");
    }
    write_caller_struct(t, size, "t", result);
  });
}

extern "C" SPARSA_API size_t sparsa_dtype_size(int32_t dtype) { return dtype_size(dtype); }

// ---- Context -----------------------------------------------------------------------------------------------------

extern "C" SPARSA_API sparsa_status sparsa_context_options_init(sparsa_context_options* options, size_t size) {
  return guarded([&] {
    require(options, "options");
    write_caller_struct(options, size, "options", default_context_options());
  });
}

extern "C" SPARSA_API sparsa_status sparsa_context_create(const sparsa_context_options* options, sparsa_context** out) {
  return guarded([&] {
    require(out, "out");
    const sparsa_context_options defaults = default_context_options();
    const sparsa_context_options resolved =
        options ? read_caller_struct(*options, "options", defaults) : defaults;
    if (resolved.num_threads < 0 || resolved.num_threads > SPARSA_MAX_NUM_THREADS) {
      fail(SPARSA_STATUS_INVALID_ARGUMENT, "options.num_threads: expected 0..", SPARSA_MAX_NUM_THREADS,
           " (0 = one per core), got ", resolved.num_threads);
    }
    if (resolved.device_type != SPARSA_DEVICE_CPU && resolved.device_id < 0) {
      fail(SPARSA_STATUS_INVALID_ARGUMENT, "options.device_id: expected >= 0, got ", resolved.device_id);
    }
    auto ctx = std::make_unique<sparsa_context>();
    ctx->options = resolved;
    if (ctx->options.device_type == SPARSA_DEVICE_CPU) ctx->options.device_id = 0;
    ctx->backend = create_backend(ctx->options);
    if (!ctx->backend) fail(SPARSA_STATUS_INTERNAL, "create_backend returned no backend");
    *out = ctx.release();
  });
}

extern "C" SPARSA_API void sparsa_context_destroy(sparsa_context* ctx) {
  guarded([&] { delete ctx; });
}

extern "C" SPARSA_API sparsa_status sparsa_context_set_stream(sparsa_context* ctx, void* stream) {
  return guarded([&] {
    require(ctx, "ctx");
    const ContextUse use(*ctx);
    ctx->backend->set_stream(stream);
    ctx->options.stream = stream;
  });
}

extern "C" SPARSA_API sparsa_status sparsa_context_device_type(const sparsa_context* ctx, int32_t* device_type) {
  return guarded([&] {
    require(ctx, "ctx");
    require(device_type, "device_type");
    const ContextUse use(*ctx);
    *device_type = ctx->backend->device_type();
  });
}

extern "C" SPARSA_API sparsa_status sparsa_context_scratch_bytes(const sparsa_context* ctx, uint64_t* bytes) {
  return guarded([&] {
    require(ctx, "ctx");
    require(bytes, "bytes");
    const ContextUse use(*ctx);
    *bytes = ctx->backend->scratch_bytes();
  });
}

// ---- Selection cache ---------------------------------------------------------------------------------------------

extern "C" SPARSA_API sparsa_status sparsa_selection_cache_create(sparsa_context* ctx, int32_t max_batch,
                                                                  int32_t num_q_heads, int32_t num_kv_heads,
                                                                  int32_t head_dim, int32_t max_top_k,
                                                                  sparsa_selection_cache** out) {
  return guarded([&] {
    require(ctx, "ctx");
    require(out, "out");
    const std::pair<int32_t, const char*> sizes[] = {{max_batch, "max_batch"},
                                                     {num_q_heads, "num_q_heads"},
                                                     {num_kv_heads, "num_kv_heads"},
                                                     {head_dim, "head_dim"},
                                                     {max_top_k, "max_top_k"}};
    for (const auto& [value, name] : sizes) {
      if (value < 1) fail(SPARSA_STATUS_INVALID_ARGUMENT, name, ": expected >= 1, got ", value);
    }
    if (num_q_heads % num_kv_heads != 0) {
      fail(SPARSA_STATUS_SHAPE_MISMATCH, "num_kv_heads: ", num_kv_heads,
           " does not divide num_q_heads = ", num_q_heads);
    }
    // The cache holds max_batch slots of Hq·D doubles (mean queries) and Hkv·max_top_k int32 ids: its byte size
    // must be representable, else it would wrap to a small allocation that runs then overflow.
    int64_t qbar_bytes = 0, selection_bytes = 0, total_bytes = 0;
    const bool overflow =
        __builtin_mul_overflow(int64_t(max_batch) * num_q_heads, int64_t(head_dim) * int64_t(sizeof(double)),
                               &qbar_bytes) ||
        __builtin_mul_overflow(int64_t(max_batch) * num_kv_heads, int64_t(max_top_k) * int64_t(sizeof(int32_t)),
                               &selection_bytes) ||
        __builtin_add_overflow(qbar_bytes, selection_bytes, &total_bytes);
    if (overflow) {
      fail(SPARSA_STATUS_INVALID_ARGUMENT, "max_batch * (num_q_heads * head_dim * 8 + num_kv_heads * max_top_k * 4)",
           ": the cache's size overflows int64 (max_batch ", max_batch, ", num_q_heads ", num_q_heads,
           ", num_kv_heads ", num_kv_heads, ", head_dim ", head_dim, ", max_top_k ", max_top_k, ")");
    }
    const ContextUse use(*ctx);
    SelectionCacheDims dims;
    dims.max_batch = max_batch;
    dims.num_q_heads = num_q_heads;
    dims.num_kv_heads = num_kv_heads;
    dims.head_dim = head_dim;
    dims.max_top_k = max_top_k;
    auto cache = std::make_unique<sparsa_selection_cache>();
    cache->owner = ctx;
    cache->state = ctx->backend->create_selection_cache(dims);
    if (!cache->state) fail(SPARSA_STATUS_INTERNAL, "backend returned no selection cache");
    *out = cache.release();
  });
}

extern "C" SPARSA_API sparsa_status sparsa_selection_cache_reset(sparsa_selection_cache* cache) {
  return guarded([&] {
    require(cache, "cache");
    const ContextUse use(*cache->owner);
    cache->state->reset();
  });
}

extern "C" SPARSA_API void sparsa_selection_cache_destroy(sparsa_selection_cache* cache) {
  guarded([&] { delete cache; });
}

extern "C" SPARSA_API sparsa_status sparsa_selection_cache_counts(const sparsa_selection_cache* cache, int64_t* hits,
                                                                  int64_t* misses) {
  return guarded([&] {
    require(cache, "cache");
    int64_t h = 0, m = 0;
    const ContextUse use(*cache->owner);
    cache->state->counts(&h, &m);
    if (hits) *hits = h;
    if (misses) *misses = m;
  });
}

// ---- Policies and the run ----------------------------------------------------------------------------------------

extern "C" SPARSA_API sparsa_status sparsa_policy_init(sparsa_policy* policy, size_t size, int32_t kind) {
  return guarded([&] {
    require(policy, "policy");
    check_struct_size<sparsa_policy>(size, "policy");
    if (!is_known_policy_kind(kind)) {
      fail(SPARSA_STATUS_INVALID_ARGUMENT, "kind: expected a sparsa_policy_kind in [0, ", kPolicyKindCount - 1,
           "], got ", kind);
    }
    write_caller_struct(policy, size, "policy", default_policy(kind));
  });
}

extern "C" SPARSA_API const char* sparsa_policy_kind_name(int32_t kind) {
  const PolicyKindInfo* info = policy_kind_info(kind);
  return info != nullptr ? info->name : "unknown";
}

extern "C" SPARSA_API sparsa_status sparsa_attention_args_init(sparsa_attention_args* args, size_t size) {
  return guarded([&] {
    require(args, "args");
    write_caller_struct(args, size, "args", default_attention_args());
  });
}

extern "C" SPARSA_API sparsa_status sparsa_attention_run(sparsa_context* ctx, const sparsa_attention_args* args,
                                                         const sparsa_policy* policy) {
  return guarded([&] {
    AttentionProblem problem;
    PolicyParams params;
    require(ctx, "ctx");
    const ContextUse use(*ctx);
    prepare_attention(ctx, args, policy, &problem, &params);
    ctx->backend->run(problem, params);
  });
}

extern "C" SPARSA_API sparsa_status sparsa_attention_plan(sparsa_context* ctx, const sparsa_attention_args* args,
                                                          const sparsa_policy* policy) {
  return guarded([&] {
    AttentionProblem problem;
    PolicyParams params;
    require(ctx, "ctx");
    const ContextUse use(*ctx);
    prepare_attention(ctx, args, policy, &problem, &params);
    ctx->backend->plan(problem, params);
  });
}

// ---- Utilities ---------------------------------------------------------------------------------------------------

extern "C" SPARSA_API sparsa_status sparsa_merge_states(sparsa_context* ctx, const sparsa_tensor* o_a,
                                                        const sparsa_tensor* lse_a, const sparsa_tensor* o_b,
                                                        const sparsa_tensor* lse_b, const sparsa_tensor* out,
                                                        const sparsa_tensor* out_lse) {
  return guarded([&] {
    require(ctx, "ctx");
    const ContextUse use(*ctx);
    const MergeProblem problem = validate_merge(device_rule(*ctx), o_a, lse_a, o_b, lse_b, out, out_lse);
    ctx->backend->merge_states(problem);
  });
}

extern "C" SPARSA_API sparsa_status sparsa_topk_from_scores(sparsa_context* ctx, const sparsa_tensor* scores, int32_t k,
                                                            int32_t block_size, const sparsa_tensor* out_indices) {
  return guarded([&] {
    require(ctx, "ctx");
    const ContextUse use(*ctx);
    const TopkCall call = validate_topk(device_rule(*ctx), scores, k, block_size, out_indices);
    ctx->backend->topk_from_scores(call.scores, k, block_size, call.out_indices);
  });
}

extern "C" SPARSA_API sparsa_status sparsa_head_mapping(const sparsa_tensor* draft, const sparsa_tensor* target,
                                                        int32_t k, const sparsa_tensor* out_map) {
  return guarded([&] { head_mapping(draft, target, k, out_map); });
}

extern "C" SPARSA_API sparsa_status sparsa_kv_prefetch(sparsa_context* ctx, const sparsa_tensor* k_src,
                                                       const sparsa_tensor* v_src, const sparsa_tensor* indices,
                                                       const sparsa_tensor* k_dst, const sparsa_tensor* v_dst,
                                                       const sparsa_tensor* positions, const sparsa_tensor* remapped,
                                                       const sparsa_tensor* counts) {
  return guarded([&] {
    require(ctx, "ctx");
    const ContextUse use(*ctx);
    const PrefetchProblem problem =
        validate_prefetch(device_rule(*ctx), k_src, v_src, indices, k_dst, v_dst, positions, remapped, counts);
    ctx->backend->kv_prefetch(problem);
  });
}

extern "C" SPARSA_API sparsa_status sparsa_hilbert_permutation(int32_t t, int32_t h, int32_t w, int32_t* perm,
                                                               int32_t* inverse, int64_t capacity) {
  return guarded([&] { hilbert_permutation(t, h, w, perm, inverse, capacity); });
}

extern "C" SPARSA_API sparsa_status sparsa_drift_select_layers(const sparsa_tensor* h_in, const sparsa_tensor* h_out,
                                                               float delta, const sparsa_tensor* out_ratio,
                                                               const sparsa_tensor* out_sparse) {
  return guarded([&] { drift_select_layers(h_in, h_out, delta, out_ratio, out_sparse); });
}

extern "C" SPARSA_API sparsa_status sparsa_sparge_tune_options_init(sparsa_sparge_tune_options* options, size_t size) {
  return guarded([&] {
    require(options, "options");
    write_caller_struct(options, size, "options", default_sparge_tune_options());
  });
}

extern "C" SPARSA_API sparsa_status sparsa_sparge_tune(sparsa_context* ctx, const sparsa_attention_args* args,
                                                       const sparsa_policy* policy,
                                                       const sparsa_sparge_tune_options* options,
                                                       const sparsa_tensor* out_params,
                                                       const sparsa_tensor* out_metrics) {
  return guarded([&] {
    require(ctx, "ctx");
    const ContextUse use(*ctx);
    sparge_tune(*ctx, args, policy, options, out_params, out_metrics);
  });
}

// ---- Context-parallel TOKEN_SELECT (docs/context_parallel.md) ----------------------------------------------------

namespace sparsa {
namespace {

sparsa_status cp_select(sparsa_context* ctx, CpSelectStep step, const sparsa_attention_args* args,
                        const sparsa_policy* policy, const sparsa_tensor* kv_start, const sparsa_tensor* kv_total,
                        const CpSelectTensors& tensors) {
  return guarded([&] {
    require(ctx, "ctx");
    const ContextUse use(*ctx);
    const CpSelectCall call = validate_cp_select(*ctx, step, args, policy, kv_start, kv_total, tensors);
    ctx->backend->cp_select(call);
  });
}

}  // namespace
}  // namespace sparsa

extern "C" SPARSA_API sparsa_status sparsa_cp_select_max(sparsa_context* ctx, const sparsa_attention_args* args,
                                                         const sparsa_policy* policy, const sparsa_tensor* kv_start,
                                                         const sparsa_tensor* kv_total, const sparsa_tensor* out_max) {
  CpSelectTensors tensors;
  tensors.out = out_max;
  return cp_select(ctx, CpSelectStep::kMax, args, policy, kv_start, kv_total, tensors);
}

extern "C" SPARSA_API sparsa_status sparsa_cp_select_sum(sparsa_context* ctx, const sparsa_attention_args* args,
                                                         const sparsa_policy* policy, const sparsa_tensor* kv_start,
                                                         const sparsa_tensor* kv_total,
                                                         const sparsa_tensor* global_max,
                                                         const sparsa_tensor* out_sum) {
  CpSelectTensors tensors;
  tensors.global_max = global_max;
  tensors.out = out_sum;
  return cp_select(ctx, CpSelectStep::kSum, args, policy, kv_start, kv_total, tensors);
}

extern "C" SPARSA_API sparsa_status sparsa_cp_select_topk(sparsa_context* ctx, const sparsa_attention_args* args,
                                                          const sparsa_policy* policy, const sparsa_tensor* kv_start,
                                                          const sparsa_tensor* kv_total,
                                                          const sparsa_tensor* global_max,
                                                          const sparsa_tensor* global_sum,
                                                          const sparsa_tensor* out_votes,
                                                          const sparsa_tensor* out_positions) {
  CpSelectTensors tensors;
  tensors.global_max = global_max;
  tensors.global_sum = global_sum;
  tensors.out = out_votes;
  tensors.out_positions = out_positions;
  return cp_select(ctx, CpSelectStep::kTopk, args, policy, kv_start, kv_total, tensors);
}

extern "C" SPARSA_API sparsa_status sparsa_cp_select_indices(sparsa_context* ctx, const sparsa_attention_args* args,
                                                             const sparsa_policy* policy,
                                                             const sparsa_tensor* kv_start,
                                                             const sparsa_tensor* kv_total,
                                                             const sparsa_tensor* all_votes,
                                                             const sparsa_tensor* all_positions,
                                                             const sparsa_tensor* out_indices) {
  CpSelectTensors tensors;
  tensors.all_votes = all_votes;
  tensors.all_positions = all_positions;
  tensors.out = out_indices;
  return cp_select(ctx, CpSelectStep::kIndices, args, policy, kv_start, kv_total, tensors);
}
