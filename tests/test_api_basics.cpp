// The C API's basic contract: versions, status names, documented defaults, handles, and the messages of failures.
#include <gtest/gtest.h>
#include <sparsa/sparsa.h>

#include <cmath>
#include <cstring>
#include <string>
#include <thread>

namespace {

TEST(ApiVersion, MacrosMatchTheLoadedLibrary) {
  EXPECT_EQ(sparsa_version(), uint32_t(SPARSA_VERSION));
  EXPECT_EQ(uint32_t(SPARSA_VERSION),
            uint32_t(SPARSA_VERSION_MAJOR * 10000 + SPARSA_VERSION_MINOR * 100 + SPARSA_VERSION_PATCH));
  const std::string expected = std::to_string(SPARSA_VERSION_MAJOR) + "." + std::to_string(SPARSA_VERSION_MINOR) + "." +
                               std::to_string(SPARSA_VERSION_PATCH);
  EXPECT_EQ(std::string(sparsa_version_string()), expected);
}

TEST(ApiStatus, EveryStatusHasItsOwnName) {
  const std::pair<sparsa_status, const char*> statuses[] = {
      {SPARSA_STATUS_SUCCESS, "SPARSA_STATUS_SUCCESS"},
      {SPARSA_STATUS_INVALID_ARGUMENT, "SPARSA_STATUS_INVALID_ARGUMENT"},
      {SPARSA_STATUS_NULL_POINTER, "SPARSA_STATUS_NULL_POINTER"},
      {SPARSA_STATUS_DTYPE_MISMATCH, "SPARSA_STATUS_DTYPE_MISMATCH"},
      {SPARSA_STATUS_SHAPE_MISMATCH, "SPARSA_STATUS_SHAPE_MISMATCH"},
      {SPARSA_STATUS_INDEX_OUT_OF_RANGE, "SPARSA_STATUS_INDEX_OUT_OF_RANGE"},
      {SPARSA_STATUS_DEVICE_MISMATCH, "SPARSA_STATUS_DEVICE_MISMATCH"},
      {SPARSA_STATUS_STRUCT_SIZE, "SPARSA_STATUS_STRUCT_SIZE"},
      {SPARSA_STATUS_UNSUPPORTED, "SPARSA_STATUS_UNSUPPORTED"},
      {SPARSA_STATUS_BACKEND_UNAVAILABLE, "SPARSA_STATUS_BACKEND_UNAVAILABLE"},
      {SPARSA_STATUS_OUT_OF_MEMORY, "SPARSA_STATUS_OUT_OF_MEMORY"},
      {SPARSA_STATUS_DEVICE_ERROR, "SPARSA_STATUS_DEVICE_ERROR"},
      {SPARSA_STATUS_INTERNAL, "SPARSA_STATUS_INTERNAL"},
  };
  for (const auto& [status, name] : statuses) EXPECT_STREQ(sparsa_status_string(status), name);
  EXPECT_STREQ(sparsa_status_string(13), "unknown status");
  EXPECT_STREQ(sparsa_status_string(-1), "unknown status");
}

TEST(ApiDtype, SizesAndTensorInit) {
  EXPECT_EQ(sparsa_dtype_size(SPARSA_DTYPE_F32), 4u);
  EXPECT_EQ(sparsa_dtype_size(SPARSA_DTYPE_F16), 2u);
  EXPECT_EQ(sparsa_dtype_size(SPARSA_DTYPE_BF16), 2u);
  EXPECT_EQ(sparsa_dtype_size(SPARSA_DTYPE_F64), 8u);
  EXPECT_EQ(sparsa_dtype_size(SPARSA_DTYPE_I32), 4u);
  EXPECT_EQ(sparsa_dtype_size(SPARSA_DTYPE_I64), 8u);
  EXPECT_EQ(sparsa_dtype_size(SPARSA_DTYPE_U8), 1u);
  EXPECT_EQ(sparsa_dtype_size(SPARSA_DTYPE_I8), 1u);
  EXPECT_EQ(sparsa_dtype_size(SPARSA_DTYPE_INVALID), 0u);

  float data[24];
  const int64_t shape[3] = {2, 3, 4};
  sparsa_tensor t;
  ASSERT_EQ(sparsa_tensor_init(&t, sizeof t, data, SPARSA_DTYPE_F32, 3, shape), SPARSA_STATUS_SUCCESS);
  EXPECT_EQ(t.struct_size, sizeof(sparsa_tensor));
  EXPECT_EQ(t.device_type, SPARSA_DEVICE_CPU);
  EXPECT_EQ(t.device_id, 0);
  EXPECT_EQ(t.strides[0], 12);
  EXPECT_EQ(t.strides[1], 4);
  EXPECT_EQ(t.strides[2], 1);
  EXPECT_EQ(t.data, static_cast<void*>(data));

  sparsa_tensor untouched;
  std::memset(&untouched, 0x5A, sizeof untouched);
  sparsa_tensor copy = untouched;
  EXPECT_EQ(sparsa_tensor_init(&untouched, sizeof untouched, data, 77, 3, shape), SPARSA_STATUS_DTYPE_MISMATCH);
  EXPECT_NE(std::string(sparsa_last_error_message()).find("dtype"), std::string::npos);
  EXPECT_EQ(sparsa_tensor_init(&untouched, sizeof untouched, data, SPARSA_DTYPE_F32, 9, shape),
            SPARSA_STATUS_SHAPE_MISMATCH);
  EXPECT_EQ(sparsa_tensor_init(&untouched, sizeof untouched, data, SPARSA_DTYPE_F32, 3, nullptr),
            SPARSA_STATUS_NULL_POINTER);
  EXPECT_EQ(std::memcmp(&untouched, &copy, sizeof copy), 0) << "a failed init wrote its out-parameter";
  EXPECT_EQ(sparsa_tensor_init(nullptr, sizeof(sparsa_tensor), data, SPARSA_DTYPE_F32, 3, shape),
            SPARSA_STATUS_NULL_POINTER);
}

TEST(ApiMessage, IsThreadLocalClearedOnSuccessAndNamesTheArgument) {
  sparsa_policy p;
  EXPECT_EQ(sparsa_policy_init(&p, sizeof p, 42), SPARSA_STATUS_INVALID_ARGUMENT);
  const std::string message = sparsa_last_error_message();
  EXPECT_NE(message.find("kind"), std::string::npos) << message;
  // Infallible getters leave the message for the binding to read.
  (void)sparsa_status_string(SPARSA_STATUS_INVALID_ARGUMENT);
  (void)sparsa_version();
  EXPECT_EQ(std::string(sparsa_last_error_message()), message);
  // Another thread has its own (empty) message and does not disturb this one.
  std::string other_thread_message = "unset";
  std::thread([&] { other_thread_message = sparsa_last_error_message(); }).join();
  EXPECT_EQ(other_thread_message, "");
  EXPECT_EQ(std::string(sparsa_last_error_message()), message);
  EXPECT_EQ(sparsa_policy_init(&p, sizeof p, SPARSA_POLICY_DENSE), SPARSA_STATUS_SUCCESS);
  EXPECT_STREQ(sparsa_last_error_message(), "");
}

// Each kind's documented defaults (include/sparsa/sparsa.h), which are the same fields for every kind.
void expect_documented_defaults(const sparsa_policy& p, int32_t kind) {
  EXPECT_EQ(p.struct_size, sizeof(sparsa_policy));
  EXPECT_EQ(p.kind, kind);
  EXPECT_EQ(p.flags, 0u);
  EXPECT_EQ(p.sink_tokens, 128);
  EXPECT_EQ(p.sink_window, 2048);
  EXPECT_EQ(p.block_q, 128);
  EXPECT_EQ(p.block_k, 64);
  EXPECT_EQ(p.block_mask, nullptr);
  EXPECT_FLOAT_EQ(p.sparge_theta, 0.6f);
  EXPECT_FLOAT_EQ(p.sparge_tau, 0.98f);
  EXPECT_EQ(p.sparge_topk_fraction, 0.f);
  EXPECT_TRUE(std::isinf(p.sparge_lambda) && p.sparge_lambda < 0);
  EXPECT_EQ(p.sparge_attention_sink, 0);
  EXPECT_EQ(p.sparge_quantized, 0);
  EXPECT_EQ(p.sparge_head_params, nullptr);
  EXPECT_EQ(p.token_sparse_window, 128);
  EXPECT_EQ(p.token_sparse_pool_kernel, 7);
  EXPECT_FLOAT_EQ(p.token_sparse_coverage, 0.005f);
  EXPECT_EQ(p.token_sparse_min_tokens, 1024);
  EXPECT_EQ(p.select_n_init, 128);
  EXPECT_EQ(p.select_n_local, 512);
  EXPECT_EQ(p.select_top_k, 2048);
  EXPECT_EQ(p.select_scale_scores, 0);
  EXPECT_FLOAT_EQ(p.select_cache_theta, 0.9f);
  EXPECT_EQ(p.select_per_kv_head, 0);
  EXPECT_EQ(p.indices, nullptr);
  EXPECT_EQ(p.head_map, nullptr);
  EXPECT_EQ(p.index_block_size, 1);
  EXPECT_EQ(p.index_n_init, 0);
  EXPECT_EQ(p.index_n_local, 0);
  EXPECT_EQ(p.delta_gamma, 64);
  EXPECT_EQ(p.delta_tail_min, 128);
}

TEST(ApiDefaults, PolicyInitSetsTheDocumentedDefaultsForEveryKind) {
  const char* names[] = {"DENSE",        "SINK_WINDOW",  "BLOCK_SPARSE", "SPARGE",
                         "TOKEN_SPARSE", "TOKEN_SELECT", "TOKEN_INDICES"};
  for (int32_t kind = SPARSA_POLICY_DENSE; kind <= SPARSA_POLICY_TOKEN_INDICES; ++kind) {
    SCOPED_TRACE(names[kind]);
    sparsa_policy p;
    std::memset(&p, 0x7F, sizeof p);
    ASSERT_EQ(sparsa_policy_init(&p, sizeof p, kind), SPARSA_STATUS_SUCCESS);
    expect_documented_defaults(p, kind);
    EXPECT_STREQ(sparsa_policy_kind_name(kind), names[kind]);
  }
  EXPECT_STREQ(sparsa_policy_kind_name(7), "unknown");
  sparsa_policy untouched;
  std::memset(&untouched, 0x11, sizeof untouched);
  EXPECT_EQ(sparsa_policy_init(&untouched, sizeof untouched, 7), SPARSA_STATUS_INVALID_ARGUMENT);
  EXPECT_EQ(untouched.kind, 0x11111111);
  EXPECT_EQ(sparsa_policy_init(nullptr, sizeof(sparsa_policy), 0), SPARSA_STATUS_NULL_POINTER);
}

TEST(ApiDefaults, ArgsOptionsAndTuneOptions) {
  sparsa_attention_args a;
  std::memset(&a, 0x7F, sizeof a);
  ASSERT_EQ(sparsa_attention_args_init(&a, sizeof a), SPARSA_STATUS_SUCCESS);
  EXPECT_EQ(a.struct_size, sizeof(sparsa_attention_args));
  EXPECT_EQ(a.q, nullptr);
  EXPECT_EQ(a.k, nullptr);
  EXPECT_EQ(a.v, nullptr);
  EXPECT_EQ(a.out, nullptr);
  EXPECT_EQ(a.lse, nullptr);
  EXPECT_EQ(a.causal, 0);
  EXPECT_EQ(a.softmax_scale, 0.f);
  EXPECT_EQ(a.cu_seqlens_q, nullptr);
  EXPECT_EQ(a.cu_seqlens_k, nullptr);
  EXPECT_EQ(a.page_table, nullptr);
  EXPECT_EQ(a.seq_lens_k, nullptr);
  EXPECT_EQ(a.selection_cache, nullptr);
  EXPECT_EQ(a.selected_indices, nullptr);
  EXPECT_EQ(a.block_mask_out, nullptr);
  EXPECT_EQ(a.stats, nullptr);

  sparsa_context_options o;
  std::memset(&o, 0x7F, sizeof o);
  ASSERT_EQ(sparsa_context_options_init(&o, sizeof o), SPARSA_STATUS_SUCCESS);
  EXPECT_EQ(o.struct_size, sizeof(sparsa_context_options));
  EXPECT_EQ(o.device_type, SPARSA_DEVICE_CPU);
  EXPECT_EQ(o.device_id, 0);
  EXPECT_EQ(o.stream, nullptr);
  EXPECT_EQ(o.num_threads, 0);

  sparsa_sparge_tune_options t;
  std::memset(&t, 0x7F, sizeof t);
  ASSERT_EQ(sparsa_sparge_tune_options_init(&t, sizeof t), SPARSA_STATUS_SUCCESS);
  EXPECT_EQ(t.struct_size, sizeof(sparsa_sparge_tune_options));
  EXPECT_FLOAT_EQ(t.l1, 0.07f);
  EXPECT_FLOAT_EQ(t.pv_l1, 0.08f);
  EXPECT_EQ(t.search_steps, 10);
  EXPECT_FLOAT_EQ(t.dense_below, 0.1f);
  EXPECT_FLOAT_EQ(t.lambda_min, -20.f);
}

TEST(ApiContext, CpuCreateQueryDestroy) {
  sparsa_context* ctx = nullptr;
  ASSERT_EQ(sparsa_context_create(nullptr, &ctx), SPARSA_STATUS_SUCCESS) << sparsa_last_error_message();
  ASSERT_NE(ctx, nullptr);
  int32_t device = -1;
  EXPECT_EQ(sparsa_context_device_type(ctx, &device), SPARSA_STATUS_SUCCESS);
  EXPECT_EQ(device, SPARSA_DEVICE_CPU);
  uint64_t bytes = ~uint64_t{0};
  EXPECT_EQ(sparsa_context_scratch_bytes(ctx, &bytes), SPARSA_STATUS_SUCCESS);
  EXPECT_NE(bytes, ~uint64_t{0});
  EXPECT_EQ(sparsa_context_set_stream(ctx, nullptr), SPARSA_STATUS_SUCCESS);
  EXPECT_EQ(sparsa_context_device_type(ctx, nullptr), SPARSA_STATUS_NULL_POINTER);
  EXPECT_EQ(sparsa_context_device_type(nullptr, &device), SPARSA_STATUS_NULL_POINTER);
  sparsa_context_destroy(ctx);
  sparsa_context_destroy(nullptr);  // no-op

  sparsa_context_options o;
  ASSERT_EQ(sparsa_context_options_init(&o, sizeof o), SPARSA_STATUS_SUCCESS);
  o.num_threads = 1;
  ASSERT_EQ(sparsa_context_create(&o, &ctx), SPARSA_STATUS_SUCCESS);
  sparsa_context_destroy(ctx);

  sparsa_context* untouched = reinterpret_cast<sparsa_context*>(0x1);
  o.struct_size = 4;
  EXPECT_EQ(sparsa_context_create(&o, &untouched), SPARSA_STATUS_STRUCT_SIZE);
  EXPECT_NE(std::string(sparsa_last_error_message()).find("options.struct_size"), std::string::npos);
  o.struct_size = sizeof o;
  o.device_type = 55;
  EXPECT_EQ(sparsa_context_create(&o, &untouched), SPARSA_STATUS_INVALID_ARGUMENT);
  EXPECT_EQ(untouched, reinterpret_cast<sparsa_context*>(0x1));
  EXPECT_EQ(sparsa_context_create(nullptr, nullptr), SPARSA_STATUS_NULL_POINTER);
}

// Without a CUDA build or device, a CUDA context is unavailable with a message; with one, it works.
TEST(ApiContext, CudaWithoutCudaIsUnavailableWithAMessage) {
  sparsa_context_options o;
  ASSERT_EQ(sparsa_context_options_init(&o, sizeof o), SPARSA_STATUS_SUCCESS);
  o.device_type = SPARSA_DEVICE_CUDA;
  sparsa_context* ctx = nullptr;
  const sparsa_status status = sparsa_context_create(&o, &ctx);
  if (status == SPARSA_STATUS_SUCCESS) {
    sparsa_context_destroy(ctx);
    GTEST_SKIP() << "this build and machine have CUDA";
  }
  EXPECT_EQ(status, SPARSA_STATUS_BACKEND_UNAVAILABLE);
  EXPECT_EQ(ctx, nullptr);
  EXPECT_NE(std::string(sparsa_last_error_message()).find("CUDA"), std::string::npos) << sparsa_last_error_message();
}

TEST(ApiSelectionCache, CreateResetCountsDestroy) {
  sparsa_context* ctx = nullptr;
  ASSERT_EQ(sparsa_context_create(nullptr, &ctx), SPARSA_STATUS_SUCCESS);
  sparsa_selection_cache* cache = nullptr;
  ASSERT_EQ(sparsa_selection_cache_create(ctx, 2, 8, 2, 64, 256, &cache), SPARSA_STATUS_SUCCESS)
      << sparsa_last_error_message();
  int64_t hits = -1, misses = -1;
  EXPECT_EQ(sparsa_selection_cache_counts(cache, &hits, &misses), SPARSA_STATUS_SUCCESS);
  EXPECT_EQ(hits, 0);
  EXPECT_EQ(misses, 0);
  EXPECT_EQ(sparsa_selection_cache_counts(cache, nullptr, nullptr), SPARSA_STATUS_SUCCESS);
  EXPECT_EQ(sparsa_selection_cache_reset(cache), SPARSA_STATUS_SUCCESS);
  EXPECT_EQ(sparsa_selection_cache_reset(nullptr), SPARSA_STATUS_NULL_POINTER);
  EXPECT_EQ(sparsa_selection_cache_counts(nullptr, &hits, &misses), SPARSA_STATUS_NULL_POINTER);
  sparsa_selection_cache_destroy(cache);
  sparsa_selection_cache_destroy(nullptr);

  sparsa_selection_cache* untouched = nullptr;
  EXPECT_EQ(sparsa_selection_cache_create(ctx, 0, 8, 2, 64, 256, &untouched), SPARSA_STATUS_INVALID_ARGUMENT);
  EXPECT_NE(std::string(sparsa_last_error_message()).find("max_batch"), std::string::npos);
  EXPECT_EQ(sparsa_selection_cache_create(ctx, 1, 8, 3, 64, 256, &untouched), SPARSA_STATUS_SHAPE_MISMATCH);
  EXPECT_EQ(sparsa_selection_cache_create(nullptr, 1, 8, 2, 64, 256, &untouched), SPARSA_STATUS_NULL_POINTER);
  EXPECT_EQ(untouched, nullptr);
  sparsa_context_destroy(ctx);
}

}  // namespace
