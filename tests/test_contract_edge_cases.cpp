// Regression tests for the inputs a fuzzer and hand-made edge cases found (issue 11, section 2): each case is the
// reproducer, a plain C call, with the status the contract promises. Sizes overflow, parameters ask for huge
// scratch, outputs Δ once left unwritten, and NaN/Inf sit in rows a query cannot see.
#include <gtest/gtest.h>
#include <sparsa/sparsa.h>

#include <algorithm>
#include <sys/resource.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <limits>
#include <string>
#include <vector>

#include "test_util.h"

namespace {

constexpr int64_t kHuge62 = int64_t{1} << 62;
constexpr int64_t kTwoTo32Plus1 = (int64_t{1} << 32) + 1;
constexpr uint64_t kSmallScratchBytes = uint64_t{64} << 20;  // what a 6-token problem may keep at most

struct OwnedContext {
  sparsa_context* ctx = nullptr;
  explicit OwnedContext(int32_t threads = 2) {
    sparsa_context_options o = st::make_context_options();
    o.num_threads = threads;
    EXPECT_EQ(sparsa_context_create(&o, &ctx), SPARSA_STATUS_SUCCESS);
  }
  ~OwnedContext() { sparsa_context_destroy(ctx); }
  uint64_t scratch() const {
    uint64_t bytes = 0;
    EXPECT_EQ(sparsa_context_scratch_bytes(ctx, &bytes), SPARSA_STATUS_SUCCESS);
    return bytes;
  }
};

// A small attention problem in plain buffers: q/out [B, Sq, H, D], k/v [B, Skv, H, D], f32, filled deterministically.
struct SmallRun {
  int64_t B = 1, Sq = 4, Skv = 8, H = 1, D = 4;
  std::vector<float> q, k, v, out, lse;
  sparsa_tensor tq{}, tk{}, tv{}, tout{}, tlse{};
  sparsa_attention_args args{};

  SmallRun(int64_t sq, int64_t skv, int64_t d = 4) : Sq(sq), Skv(skv), D(d) {
    q.resize(size_t(B * Sq * H * D));
    k.resize(size_t(B * Skv * H * D));
    v.resize(k.size());
    for (size_t i = 0; i < q.size(); ++i) q[i] = 0.1f * float(int(i % 7) - 3);
    for (size_t i = 0; i < k.size(); ++i) k[i] = 0.05f * float(int(i % 11) - 5);
    for (size_t i = 0; i < v.size(); ++i) v[i] = 0.2f * float(int(i % 5) - 2);
  }
  // (Re)describes the buffers; call after changing sizes.
  sparsa_attention_args& describe() {
    out.assign(q.size(), -7.f);
    lse.assign(size_t(B * H * Sq), -7.f);
    tq = st::host_tensor(q.data(), SPARSA_DTYPE_F32, {B, Sq, H, D});
    tk = st::host_tensor(k.data(), SPARSA_DTYPE_F32, {B, Skv, H, D});
    tv = st::host_tensor(v.data(), SPARSA_DTYPE_F32, {B, Skv, H, D});
    tout = st::host_tensor(out.data(), SPARSA_DTYPE_F32, {B, Sq, H, D});
    tlse = st::host_tensor(lse.data(), SPARSA_DTYPE_F32, {B, H, Sq});
    args = st::make_args();
    args.q = &tq;
    args.k = &tk;
    args.v = &tv;
    args.out = &tout;
    args.lse = &tlse;
    args.causal = 1;
    return args;
  }
  float* k_row(int64_t key) { return k.data() + key * H * D; }
  float* v_row(int64_t key) { return v.data() + key * H * D; }
  float* q_row(int64_t i) { return q.data() + i * H * D; }
};

// ------------------------------------------------------------------------------------------------------------
// Sizes: counts computed once with overflow detection, 64-bit shapes never truncated.

TEST(ContractEdgeCases, ElementCountOverflowIsRefusedNotDereferenced) {
  // q/out [1, 2^62, 2, 1] with stride 0 and data NULL: the count wraps; it once skipped the NULL check and crashed.
  OwnedContext c;
  SmallRun r(4, 8);
  sparsa_attention_args& args = r.describe();
  sparsa_tensor huge = r.tq;
  const int64_t shape[] = {1, kHuge62, 2, 1};
  for (int i = 0; i < 4; ++i) {
    huge.shape[i] = shape[i];
    huge.strides[i] = 0;
  }
  huge.strides[3] = 1;
  huge.data = nullptr;
  args.q = &huge;
  args.out = &huge;
  EXPECT_EQ(sparsa_attention_run(c.ctx, &args, nullptr), SPARSA_STATUS_SHAPE_MISMATCH);
  EXPECT_NE(std::string(sparsa_last_error_message()).find("INT64_MAX"), std::string::npos)
      << sparsa_last_error_message();
}

TEST(ContractEdgeCases, SpargeTuneSizesItsOwnBuffersWithOverflowDetection) {
  // The tuner allocates its output in q's shape before the call is validated. Found by the fuzzer: q of shape
  // [2^40, 2^40, 0, 1] (empty, so valid as a tensor) overflowed the product of its extents there (UB); q [1, 2^61, 2, 1]
  // broadcast by zero strides is 2^62 elements, a valid tensor whose contiguous fp32 copy would be 2^64 bytes.
  OwnedContext c;
  SmallRun r(4, 8);
  std::vector<float> params(4), metrics(2);
  const sparsa_tensor t_params = st::host_tensor(params.data(), SPARSA_DTYPE_F32, {1, 4});
  const sparsa_tensor t_metrics = st::host_tensor(metrics.data(), SPARSA_DTYPE_F32, {1, 2});
  struct Case {
    int64_t shape[4];
    const char* message;  // what the error must say
  };
  const Case cases[] = {{{int64_t{1} << 40, int64_t{1} << 40, 0, 1}, "Hq = 0"},
                        {{1, int64_t{1} << 61, 2, 1}, "INT64_MAX bytes"}};
  for (const Case& cs : cases) {
    sparsa_attention_args& args = r.describe();
    sparsa_tensor q = r.tq;
    for (int i = 0; i < 4; ++i) {
      q.shape[i] = cs.shape[i];
      q.strides[i] = 0;
    }
    q.strides[3] = 1;
    args.q = &q;
    const sparsa_status status = sparsa_sparge_tune(c.ctx, &args, nullptr, nullptr, &t_params, &t_metrics);
    EXPECT_EQ(status, SPARSA_STATUS_SHAPE_MISMATCH) << sparsa_last_error_message();
    EXPECT_NE(std::string(sparsa_last_error_message()).find(cs.message), std::string::npos)
        << sparsa_last_error_message();
  }
}

TEST(ContractEdgeCases, ExtentsAboveInt32AreRefusedNotTruncated) {
  // B or Hq = 2^32 + 1 over stride-0 (broadcast) data once became 1 and the run succeeded.
  struct Case {
    const char* name;
    int dim;  // 0 = batch, 2 = heads
  };
  const Case cases[] = {{"batch 2^32+1", 0}, {"Sq and Skv 2^32+1 (token positions are int32)", 1}, {"heads 2^32+1", 2}};
  for (const Case& cs : cases) {
    SCOPED_TRACE(cs.name);
    OwnedContext c;
    SmallRun r(1, 1);
    sparsa_attention_args& args = r.describe();
    sparsa_tensor tensors[4] = {r.tq, r.tk, r.tv, r.tout};
    for (sparsa_tensor& t : tensors) {
      t.shape[cs.dim] = kTwoTo32Plus1;
      t.strides[cs.dim] = 0;
    }
    args.q = &tensors[0];
    args.k = &tensors[1];
    args.v = &tensors[2];
    args.out = &tensors[3];
    args.lse = nullptr;
    EXPECT_EQ(sparsa_attention_run(c.ctx, &args, nullptr), SPARSA_STATUS_SHAPE_MISMATCH);
    EXPECT_NE(std::string(sparsa_last_error_message()).find("INT32_MAX"), std::string::npos)
        << sparsa_last_error_message();
  }
}

TEST(ContractEdgeCases, PagedCapacityAndTopkBlockCountsDoNotOverflow) {
  OwnedContext c;
  // Paged KV: max_pages · page_size overflowed int64 during validation (found by the fuzz target).
  SmallRun r(1, 1);
  sparsa_attention_args& args = r.describe();
  args.lse = nullptr;
  sparsa_tensor cache = st::host_tensor(r.k.data(), SPARSA_DTYPE_F32, {1, 1, 1, r.D});
  cache.shape[1] = int64_t{1} << 31;  // page_size, broadcast over one stored token
  cache.strides[1] = 0;
  std::vector<int32_t> table = {0}, lengths = {1};
  sparsa_tensor ttable = st::host_tensor(table.data(), SPARSA_DTYPE_I32, {1, 1});
  ttable.shape[1] = int64_t{1} << 31;  // max_pages
  ttable.strides[1] = 0;
  sparsa_tensor tlengths = st::host_tensor(lengths.data(), SPARSA_DTYPE_I32, {1});
  args.k = &cache;
  args.v = &cache;
  args.page_table = &ttable;
  args.seq_lens_k = &tlengths;
  EXPECT_EQ(sparsa_attention_run(c.ctx, &args, nullptr), SPARSA_STATUS_SHAPE_MISMATCH);
  // Top-k over scores [0, 1, INT64_MAX]: ceil(N / block_size) once computed N + block_size - 1.
  sparsa_tensor scores = st::host_tensor(nullptr, SPARSA_DTYPE_F32, {0, 1, 1});
  scores.shape[2] = INT64_MAX;
  sparsa_tensor out = st::host_tensor(nullptr, SPARSA_DTYPE_I32, {0, 1, 2});
  EXPECT_EQ(sparsa_topk_from_scores(c.ctx, &scores, 2, 7, &out), SPARSA_STATUS_SUCCESS) << sparsa_last_error_message();
}

TEST(ContractEdgeCases, MergeWithNoHeadsAndAHugeHeadDim) {
  // o [1, 1, 0, 2^32 + 1]: D was cast to int and a row buffer of 2·D floats sized from it (INTERNAL).
  OwnedContext c;
  sparsa_tensor o = st::host_tensor(nullptr, SPARSA_DTYPE_F32, {1, 1, 0, 1});
  o.shape[3] = kTwoTo32Plus1;
  sparsa_tensor lse = st::host_tensor(nullptr, SPARSA_DTYPE_F32, {1, 0, 1});
  EXPECT_EQ(sparsa_merge_states(c.ctx, &o, &lse, &o, &lse, &o, nullptr), SPARSA_STATUS_SHAPE_MISMATCH);
  o.shape[3] = 4;  // the same with an ordinary D: nothing to do, success
  EXPECT_EQ(sparsa_merge_states(c.ctx, &o, &lse, &o, &lse, &o, nullptr), SPARSA_STATUS_SUCCESS)
      << sparsa_last_error_message();
}

TEST(ContractEdgeCases, TensorInitRefusesStridesThatOverflow) {
  struct Case {
    std::vector<int64_t> shape;
    sparsa_status want;
  };
  const Case cases[] = {
      {{173, kHuge62}, SPARSA_STATUS_SHAPE_MISMATCH},           // count wraps (it returned SUCCESS)
      {{0, kHuge62, 4}, SPARSA_STATUS_SHAPE_MISMATCH},          // stride of dim 0 wraps though the tensor is empty
      {{3, int64_t{1} << 31, int64_t{1} << 30}, SPARSA_STATUS_SUCCESS},  // 3 · 2^61 elements: fits
      {{kHuge62, 2}, SPARSA_STATUS_SHAPE_MISMATCH},             // 2^63 elements
  };
  for (const Case& cs : cases) {
    sparsa_tensor t;
    std::memset(&t, 0x5A, sizeof t);
    const sparsa_tensor before = t;
    const sparsa_status status =
        sparsa_tensor_init(&t, sizeof t, nullptr, SPARSA_DTYPE_U8, int32_t(cs.shape.size()), cs.shape.data());
    EXPECT_EQ(status, cs.want) << "ndim " << cs.shape.size() << ", shape[0] " << cs.shape[0];
    if (status != SPARSA_STATUS_SUCCESS) EXPECT_EQ(std::memcmp(&t, &before, sizeof t), 0);
  }
}

TEST(ContractEdgeCases, HilbertGridThatOverflowsIsRefusedPromptly) {
  int32_t perm[16], inverse[16];
  std::fill(perm, perm + 16, -5);
  const auto start = std::chrono::steady_clock::now();
  // (2^21)^3 wrapped and hung; 2^20 · 2^20 · 2^24 wrapped to a small n and wrote past perm[16].
  EXPECT_EQ(sparsa_hilbert_permutation(1 << 21, 1 << 21, 1 << 21, perm, inverse, 16), SPARSA_STATUS_INVALID_ARGUMENT);
  EXPECT_EQ(sparsa_hilbert_permutation(1 << 20, 1 << 20, 1 << 24, perm, inverse, 16), SPARSA_STATUS_INVALID_ARGUMENT);
  EXPECT_EQ(sparsa_hilbert_permutation(INT32_MAX, INT32_MAX, INT32_MAX, perm, nullptr, 16),
            SPARSA_STATUS_INVALID_ARGUMENT);
  EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(1));
  for (int32_t p : perm) EXPECT_EQ(p, -5);
}

TEST(ContractEdgeCases, SelectionCacheWhoseSizeWrapsIsRefused) {
  OwnedContext c;
  sparsa_selection_cache* cache = reinterpret_cast<sparsa_selection_cache*>(uintptr_t{0x1234});
  // 16 · 2^30 · 2^30 doubles wrapped to 0 bytes; the next TOKEN_SELECT run crashed.
  EXPECT_EQ(sparsa_selection_cache_create(c.ctx, 16, 1 << 30, 1, 1 << 30, 1, &cache), SPARSA_STATUS_INVALID_ARGUMENT);
  EXPECT_EQ(cache, reinterpret_cast<sparsa_selection_cache*>(uintptr_t{0x1234}));
}

TEST(ContractEdgeCases, NumThreadsIsBounded) {
  struct Case {
    int32_t threads;
    sparsa_status want;
  };
  const Case cases[] = {{100000, SPARSA_STATUS_INVALID_ARGUMENT},
                        {SPARSA_MAX_NUM_THREADS + 1, SPARSA_STATUS_INVALID_ARGUMENT},
                        {-1, SPARSA_STATUS_INVALID_ARGUMENT},
                        {3, SPARSA_STATUS_SUCCESS}};
  for (const Case& cs : cases) {
    sparsa_context_options o = st::make_context_options();
    o.num_threads = cs.threads;
    sparsa_context* ctx = nullptr;
    EXPECT_EQ(sparsa_context_create(&o, &ctx), cs.want) << cs.threads;
    sparsa_context_destroy(ctx);
  }
}

// Sanitizers reserve terabytes of address space up front, so an address-space limit cannot single out threads there.
#if defined(__SANITIZE_ADDRESS__) || defined(__SANITIZE_THREAD__)
constexpr bool kAddressSpaceLimitWorks = false;
#elif defined(__has_feature)
#if __has_feature(address_sanitizer) || __has_feature(thread_sanitizer)
constexpr bool kAddressSpaceLimitWorks = false;
#else
constexpr bool kAddressSpaceLimitWorks = true;
#endif
#else
constexpr bool kAddressSpaceLimitWorks = true;
#endif

[[noreturn]] void create_context_under_address_space_limit() {
  long pages = 0;
  if (FILE* f = std::fopen("/proc/self/statm", "r")) {
    if (std::fscanf(f, "%ld", &pages) != 1) pages = 0;
    std::fclose(f);
  }
  const rlim_t limit = rlim_t(pages) * rlim_t(sysconf(_SC_PAGESIZE)) + (rlim_t{48} << 20);
  const rlimit cap{limit, limit};
  if (pages == 0 || setrlimit(RLIMIT_AS, &cap) != 0) std::_Exit(3);
  sparsa_context_options o = st::make_context_options();
  o.num_threads = SPARSA_MAX_NUM_THREADS;
  sparsa_context* ctx = nullptr;
  const sparsa_status status = sparsa_context_create(&o, &ctx);
  std::_Exit(status == SPARSA_STATUS_OUT_OF_MEMORY && ctx == nullptr ? 0 : 4);
}

TEST(ContractEdgeCases, ContextCreateReturnsWhenAThreadCannotStart) {
  if (!kAddressSpaceLimitWorks) GTEST_SKIP() << "address-space limits do not apply under ASan/TSan";
  // In a child process: cap the address space a little above what is mapped, so that worker stacks (8 MiB each) run
  // out after a few threads. The create must fail with OUT_OF_MEMORY and return (it once waited forever).
  // "threadsafe": the child re-executes the test binary instead of continuing a fork of a process whose other
  // threads (earlier tests' pools) may hold locks the child would wait on forever.
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  EXPECT_EXIT(create_context_under_address_space_limit(), ::testing::ExitedWithCode(0), "");
}

// ------------------------------------------------------------------------------------------------------------
// Scratch and temporaries follow the problem, never a block or top-k parameter.

TEST(ContractEdgeCases, ScratchFollowsTheProblemNotTheParameters) {
  struct Case {
    const char* name;
    int32_t kind;
    std::function<void(sparsa_policy&)> set;
  };
  std::vector<uint8_t> mask(1, 1);  // [1, 1, ceil(6/128), ceil(6/2^24)] = [1, 1, 1, 1]
  sparsa_tensor tmask = st::host_tensor(mask.data(), SPARSA_DTYPE_U8, {1, 1, 1, 1});
  const Case cases[] = {
      {"BLOCK_SPARSE block_k 2^24", SPARSA_POLICY_BLOCK_SPARSE,
       [&](sparsa_policy& p) {
         p.block_k = 1 << 24;
         p.block_mask = &tmask;
       }},
      {"SPARGE block_k 2^24", SPARSA_POLICY_SPARGE, [](sparsa_policy& p) { p.block_k = 1 << 24; }},
      {"SPARGE block_q INT32_MAX - 1", SPARSA_POLICY_SPARGE, [](sparsa_policy& p) { p.block_q = INT32_MAX - 1; }},
      {"TOKEN_SELECT top_k 2^28", SPARSA_POLICY_TOKEN_SELECT, [](sparsa_policy& p) { p.select_top_k = 1 << 28; }},
  };
  for (const Case& cs : cases) {
    SCOPED_TRACE(cs.name);
    OwnedContext c;
    SmallRun r(6, 6);
    sparsa_attention_args& args = r.describe();
    sparsa_policy p = st::make_policy(cs.kind);
    cs.set(p);
    const auto start = std::chrono::steady_clock::now();
    // plan once answered OUT_OF_MEMORY (or INTERNAL for block_q near INT32_MAX) where the run succeeded.
    EXPECT_EQ(sparsa_attention_plan(c.ctx, &args, &p), SPARSA_STATUS_SUCCESS) << sparsa_last_error_message();
    const uint64_t planned = c.scratch();
    EXPECT_EQ(sparsa_attention_run(c.ctx, &args, &p), SPARSA_STATUS_SUCCESS) << sparsa_last_error_message();
    EXPECT_EQ(c.scratch(), planned) << "the run after plan allocated";
    EXPECT_LT(planned, kSmallScratchBytes);
    EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(2));
  }
}

TEST(ContractEdgeCases, PrefetchAndHeadMappingSizeNothingFromAnUntouchedExtent) {
  OwnedContext c;
  // kv_prefetch with B = 0 and N = 2^40 tried to allocate 1 TiB.
  const int64_t n = int64_t{1} << 40;
  sparsa_tensor k_src = st::host_tensor(nullptr, SPARSA_DTYPE_F32, {0, n, 1, 4});
  sparsa_tensor idx = st::host_tensor(nullptr, SPARSA_DTYPE_I32, {0, 1, 2});
  sparsa_tensor k_dst = st::host_tensor(nullptr, SPARSA_DTYPE_F32, {0, 2, 1, 4});
  sparsa_tensor pos = st::host_tensor(nullptr, SPARSA_DTYPE_I32, {0, 2});
  sparsa_tensor remapped = st::host_tensor(nullptr, SPARSA_DTYPE_I32, {0, 1, 2});
  EXPECT_EQ(sparsa_kv_prefetch(c.ctx, &k_src, &k_src, &idx, &k_dst, &k_dst, &pos, &remapped, nullptr),
            SPARSA_STATUS_SUCCESS)
      << sparsa_last_error_message();
  EXPECT_LT(c.scratch(), kSmallScratchBytes);

  // head_mapping with T = 0 allocated Hd · N bytes (~4 GB here) before noticing there was nothing to compare.
  const int64_t heads = 1 << 16, tokens = 1 << 16;
  sparsa_tensor draft = st::host_tensor(nullptr, SPARSA_DTYPE_F32, {0, heads, tokens});
  std::vector<int32_t> map(4, -1);
  sparsa_tensor target = st::host_tensor(nullptr, SPARSA_DTYPE_F32, {0, 4, tokens});
  sparsa_tensor out_map = st::host_tensor(map.data(), SPARSA_DTYPE_I32, {4});
  EXPECT_EQ(sparsa_head_mapping(&draft, &target, 8, &out_map), SPARSA_STATUS_SUCCESS) << sparsa_last_error_message();
  EXPECT_EQ(map, std::vector<int32_t>(4, 0));  // no trace: every overlap 0, ties go to draft head 0
}

TEST(ContractEdgeCases, PrefetchWorkIsBoundedByTheOutputsItWrites) {
  OwnedContext c;
  std::vector<float> kv(4 * 2, 1.f);
  sparsa_tensor k_src = st::host_tensor(kv.data(), SPARSA_DTYPE_F32, {1, 4, 1, 2});
  std::vector<float> dst(3 * 2, -7.f);
  sparsa_tensor k_dst = st::host_tensor(dst.data(), SPARSA_DTYPE_F32, {1, 3, 1, 2});
  std::vector<int32_t> positions(6, -7), counts(1, -7), remapped(4, -7);
  const auto start = std::chrono::steady_clock::now();

  // k = 0 with H_idx = 2^31: no entry, yet the union and remap walks once visited every row (a fuzzer timeout).
  sparsa_tensor no_ids = st::host_tensor(nullptr, SPARSA_DTYPE_I32, {1, int64_t{1} << 31, 0});
  sparsa_tensor pos = st::host_tensor(positions.data(), SPARSA_DTYPE_I32, {1, 3});
  sparsa_tensor cnt = st::host_tensor(counts.data(), SPARSA_DTYPE_I32, {1});
  EXPECT_EQ(sparsa_kv_prefetch(c.ctx, &k_src, &k_src, &no_ids, &k_dst, &k_dst, &pos, &no_ids, &cnt),
            SPARSA_STATUS_SUCCESS)
      << sparsa_last_error_message();
  EXPECT_EQ(positions, (std::vector<int32_t>{-1, -1, -1, -7, -7, -7}));
  EXPECT_EQ(counts[0], 0);
  EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(2));

  // Outputs whose elements overlap are refused before anything is read or written: a stride-0 positions of
  // C = 2^40 would be written 2^40 times, a broadcast remapped walked over all its (absent) elements.
  std::vector<int32_t> ids = {2, 0};
  sparsa_tensor idx = st::host_tensor(ids.data(), SPARSA_DTYPE_I32, {1, 1, 2});
  sparsa_tensor rem = st::host_tensor(remapped.data(), SPARSA_DTYPE_I32, {1, 1, 2});
  sparsa_tensor rowless_src = st::host_tensor(nullptr, SPARSA_DTYPE_F32, {1, 4, 1, 0});
  sparsa_tensor huge_dst = st::host_tensor(nullptr, SPARSA_DTYPE_F32, {1, int64_t{1} << 40, 1, 0});
  sparsa_tensor broadcast_pos = st::host_tensor(positions.data(), SPARSA_DTYPE_I32, {1, int64_t{1} << 40});
  broadcast_pos.strides[1] = 0;
  sparsa_tensor broadcast_ids = st::host_tensor(ids.data(), SPARSA_DTYPE_I32, {1, int64_t{1} << 40, 2});
  broadcast_ids.strides[1] = 0;
  sparsa_tensor broadcast_rem = st::host_tensor(remapped.data(), SPARSA_DTYPE_I32, {1, int64_t{1} << 40, 2});
  broadcast_rem.strides[1] = 0;
  sparsa_tensor interleaved_rem = st::host_tensor(remapped.data(), SPARSA_DTYPE_I32, {1, 2, 2});
  interleaved_rem.strides[1] = 1;  // [0][1][0] and [0][0][1] share an address
  std::vector<int32_t> four_ids = {0, 1, 2, 3};
  sparsa_tensor interleaved_ids = st::host_tensor(four_ids.data(), SPARSA_DTYPE_I32, {1, 2, 2});
  std::fill(positions.begin(), positions.end(), -7);
  std::fill(remapped.begin(), remapped.end(), -7);
  const std::vector<int32_t> untouched_positions = positions, untouched_remapped = remapped;
  struct Case {
    const char* what;
    const sparsa_tensor *k_src, *indices, *k_dst, *positions, *remapped;
    const char* named;
  };
  const Case cases[] = {
      {"stride-0 positions", &rowless_src, &idx, &huge_dst, &broadcast_pos, &rem, "positions"},
      {"broadcast remapped", &k_src, &broadcast_ids, &k_dst, &pos, &broadcast_rem, "remapped"},
      {"interleaved remapped", &k_src, &interleaved_ids, &k_dst, &pos, &interleaved_rem, "remapped"},
  };
  for (const Case& cs : cases) {
    SCOPED_TRACE(cs.what);
    const auto case_start = std::chrono::steady_clock::now();
    EXPECT_EQ(sparsa_kv_prefetch(c.ctx, cs.k_src, cs.k_src, cs.indices, cs.k_dst, cs.k_dst, cs.positions,
                                 cs.remapped, nullptr),
              SPARSA_STATUS_SHAPE_MISMATCH);
    EXPECT_NE(std::string(sparsa_last_error_message()).find(cs.named), std::string::npos)
        << sparsa_last_error_message();
    EXPECT_LT(std::chrono::steady_clock::now() - case_start, std::chrono::seconds(2));
    EXPECT_EQ(positions, untouched_positions);
    EXPECT_EQ(remapped, untouched_remapped);
  }

  // Gaps are fine: positions every other element.
  sparsa_tensor gapped_pos = st::host_tensor(positions.data(), SPARSA_DTYPE_I32, {1, 3});
  gapped_pos.strides[1] = 2;
  ASSERT_EQ(sparsa_kv_prefetch(c.ctx, &k_src, &k_src, &idx, &k_dst, &k_dst, &gapped_pos, &rem, nullptr),
            SPARSA_STATUS_SUCCESS)
      << sparsa_last_error_message();
  EXPECT_EQ(positions, (std::vector<int32_t>{0, -7, 2, -7, -1, -7}));
  EXPECT_EQ(std::vector<int32_t>(remapped.begin(), remapped.begin() + 2), (std::vector<int32_t>{1, 0}));
}

TEST(ContractEdgeCases, HostUtilitiesRefuseOutputsWhoseElementsOverlap) {
  // The attention run, merge, top-k and prefetch rows are in test_bad_input.cpp; these are the host-only utilities.
  OwnedContext c;
  constexpr int32_t kSentinel = -7;
  std::vector<float> traces(2 * 2 * 4, 1.f);
  const sparsa_tensor draft = st::host_tensor(traces.data(), SPARSA_DTYPE_F32, {2, 2, 4});
  std::vector<int32_t> map(2, kSentinel);
  sparsa_tensor out_map = st::host_tensor(map.data(), SPARSA_DTYPE_I32, {2});
  out_map.strides[0] = 0;
  EXPECT_EQ(sparsa_head_mapping(&draft, &draft, 2, &out_map), SPARSA_STATUS_SHAPE_MISMATCH);
  EXPECT_NE(std::string(sparsa_last_error_message()).find("out_map: an output's elements must not overlap"),
            std::string::npos)
      << sparsa_last_error_message();
  EXPECT_EQ(map, std::vector<int32_t>(2, kSentinel));

  std::vector<float> ratio(2, -7.f);
  sparsa_tensor out_ratio = st::host_tensor(ratio.data(), SPARSA_DTYPE_F32, {2});
  out_ratio.strides[0] = 0;
  EXPECT_EQ(sparsa_drift_select_layers(&draft, &draft, 0.5f, &out_ratio, nullptr), SPARSA_STATUS_SHAPE_MISMATCH);
  EXPECT_NE(std::string(sparsa_last_error_message()).find("out_ratio"), std::string::npos)
      << sparsa_last_error_message();
  EXPECT_EQ(ratio, std::vector<float>(2, -7.f));

  SmallRun r(4, 8);
  std::vector<float> params(4, -7.f);
  sparsa_tensor out_params = st::host_tensor(params.data(), SPARSA_DTYPE_F32, {1, 4});
  out_params.strides[1] = 0;
  EXPECT_EQ(sparsa_sparge_tune(c.ctx, &r.describe(), nullptr, nullptr, &out_params, nullptr),
            SPARSA_STATUS_SHAPE_MISMATCH);
  EXPECT_NE(std::string(sparsa_last_error_message()).find("out_params"), std::string::npos)
      << sparsa_last_error_message();
  EXPECT_EQ(params, std::vector<float>(4, -7.f));
}

TEST(ContractEdgeCases, EmptyRowsAndMisalignedDataAreSafe) {
  OwnedContext c;
  // kv_prefetch with D = 0 and NULL data: memcpy(NULL, NULL, 0) and NULL + offset once ran here.
  std::vector<int32_t> ids = {1, 2}, positions(2), remapped(2);
  sparsa_tensor k_src = st::host_tensor(nullptr, SPARSA_DTYPE_F16, {1, 4, 1, 0});
  sparsa_tensor k_dst = st::host_tensor(nullptr, SPARSA_DTYPE_F16, {1, 2, 1, 0});
  sparsa_tensor idx = st::host_tensor(ids.data(), SPARSA_DTYPE_I32, {1, 1, 2});
  sparsa_tensor pos = st::host_tensor(positions.data(), SPARSA_DTYPE_I32, {1, 2});
  sparsa_tensor rem = st::host_tensor(remapped.data(), SPARSA_DTYPE_I32, {1, 1, 2});
  EXPECT_EQ(sparsa_kv_prefetch(c.ctx, &k_src, &k_src, &idx, &k_dst, &k_dst, &pos, &rem, nullptr),
            SPARSA_STATUS_SUCCESS)
      << sparsa_last_error_message();
  EXPECT_EQ(positions, (std::vector<int32_t>{1, 2}));

  // fp16 data at an odd address: loads of uint16_t from it are undefined; refused.
  std::vector<uint16_t> storage(64);
  void* odd = reinterpret_cast<char*>(storage.data()) + 1;
  sparsa_tensor q = st::host_tensor(odd, SPARSA_DTYPE_F16, {1, 2, 1, 4});
  sparsa_tensor kv = st::host_tensor(storage.data() + 16, SPARSA_DTYPE_F16, {1, 2, 1, 4});
  sparsa_tensor out = st::host_tensor(storage.data() + 32, SPARSA_DTYPE_F16, {1, 2, 1, 4});
  sparsa_attention_args args = st::make_args();
  args.q = &q;
  args.k = &kv;
  args.v = &kv;
  args.out = &out;
  EXPECT_EQ(sparsa_attention_run(c.ctx, &args, nullptr), SPARSA_STATUS_INVALID_ARGUMENT);
  EXPECT_NE(std::string(sparsa_last_error_message()).find("aligned"), std::string::npos);
}

// ------------------------------------------------------------------------------------------------------------
// Δ writes every requested output, also when every row is dense (Sq <= delta_tail_min + gamma).

TEST(ContractEdgeCases, DeltaWithEveryRowDenseStillWritesIntrospection) {
  constexpr int32_t kPoisonIndex = -77;
  constexpr uint8_t kPoisonMask = 0xEE;
  struct Case {
    const char* name;
    int32_t kind;
  };
  for (const Case cs : {Case{"TOKEN_INDICES selected_indices", SPARSA_POLICY_TOKEN_INDICES},
                        Case{"SPARGE block_mask_out", SPARSA_POLICY_SPARGE}}) {
    SCOPED_TRACE(cs.name);
    OwnedContext c;
    SmallRun r(16, 16);
    sparsa_attention_args& args = r.describe();
    args.lse = nullptr;  // Δ forbids LSE
    sparsa_policy p = st::make_policy(cs.kind);
    p.flags = SPARSA_POLICY_FLAG_DELTA;  // defaults: gamma 64, tail 128, so all 16 rows are dense
    std::vector<int32_t> indices = {0, 3, 5, -1};
    sparsa_tensor tidx = st::host_tensor(indices.data(), SPARSA_DTYPE_I32, {1, 1, 4});
    std::vector<int32_t> selected(16, kPoisonIndex);
    sparsa_tensor tsel = st::host_tensor(selected.data(), SPARSA_DTYPE_I32, {1, 1, 16});
    std::vector<uint8_t> mask(1, kPoisonMask);
    sparsa_tensor tmask = st::host_tensor(mask.data(), SPARSA_DTYPE_U8, {1, 1, 1, 1});
    if (cs.kind == SPARSA_POLICY_TOKEN_INDICES) {
      p.indices = &tidx;
      args.selected_indices = &tsel;
    } else {
      args.block_mask_out = &tmask;
    }
    ASSERT_EQ(sparsa_attention_run(c.ctx, &args, &p), SPARSA_STATUS_SUCCESS) << sparsa_last_error_message();
    if (cs.kind == SPARSA_POLICY_TOKEN_INDICES) {
      EXPECT_EQ(selected[0], 0);
      EXPECT_EQ(selected[1], 3);
      EXPECT_EQ(selected[2], 5);
      for (int32_t id : selected) EXPECT_NE(id, kPoisonIndex);
    } else {
      EXPECT_NE(mask[0], kPoisonMask);
    }
  }
}

// ------------------------------------------------------------------------------------------------------------
// TOKEN_INDICES sizes its key-set scratch by the keys, not by the slot count (a fuzzer finding: a broadcast row of
// 2^40 slots made plan ask for 16 TiB of ranges). The key set merges its ranges whenever they fill the room, so
// 2^24 slots over 16 keys plan into scratch of a few KiB (one 16-byte range per slot would be 256 MiB a worker).

TEST(ContractEdgeCases, TokenIndicesScratchDoesNotGrowWithTheSlotCount) {
  constexpr int64_t kBroadcastSlots = int64_t(1) << 24;
  constexpr uint64_t kScratchCeiling = uint64_t(1) << 20;
  OwnedContext c;
  SmallRun r(16, 16);
  sparsa_attention_args& args = r.describe();
  sparsa_policy p = st::make_policy(SPARSA_POLICY_TOKEN_INDICES);
  int32_t unused_slot = -1;
  sparsa_tensor tidx = st::host_tensor(&unused_slot, SPARSA_DTYPE_I32, {1, 1, kBroadcastSlots});
  tidx.strides[0] = tidx.strides[1] = tidx.strides[2] = 0;  // every slot reads the same -1
  p.indices = &tidx;
  ASSERT_EQ(sparsa_attention_plan(c.ctx, &args, &p), SPARSA_STATUS_SUCCESS) << sparsa_last_error_message();
  uint64_t bytes = 0;
  ASSERT_EQ(sparsa_context_scratch_bytes(c.ctx, &bytes), SPARSA_STATUS_SUCCESS);
  EXPECT_LT(bytes, kScratchCeiling);
  ASSERT_EQ(sparsa_attention_run(c.ctx, &args, &p), SPARSA_STATUS_SUCCESS) << sparsa_last_error_message();
}

// ------------------------------------------------------------------------------------------------------------
// NaN / Inf: a query's output depends only on the keys it may see (docs/algorithms.md, "NaN and Inf").

enum class Tensor { kQ, kK, kV };
const char* tensor_name(Tensor t) { return t == Tensor::kQ ? "q" : t == Tensor::kK ? "k" : "v"; }

// The policies of the reproducer, each set so that (causal, Sq 4, Skv 8) key 7 is visible to row 3 only.
struct PolicySetup {
  const char* name;
  int32_t kind;
};
const PolicySetup kNanPolicies[] = {{"DENSE", SPARSA_POLICY_DENSE},
                                    {"SINK_WINDOW", SPARSA_POLICY_SINK_WINDOW},
                                    {"BLOCK_SPARSE", SPARSA_POLICY_BLOCK_SPARSE},
                                    {"SPARGE", SPARSA_POLICY_SPARGE},
                                    {"SPARGE quantized", SPARSA_POLICY_SPARGE},
                                    {"TOKEN_INDICES", SPARSA_POLICY_TOKEN_INDICES}};

struct NanRun {
  std::vector<float> out, lse;
};

NanRun run_nan_case(const PolicySetup& setup, Tensor where, int64_t position, float value) {
  OwnedContext c;
  SmallRun r(4, 8);
  if (where == Tensor::kQ) {
    std::fill(r.q_row(position), r.q_row(position) + r.D, 0.f);
    r.q_row(position)[1] = value;
  }
  if (where == Tensor::kK) r.k_row(position)[2] = value;
  if (where == Tensor::kV) r.v_row(position)[0] = value;
  sparsa_attention_args& args = r.describe();
  sparsa_policy p = st::make_policy(setup.kind);
  std::vector<uint8_t> mask(2, 1);  // [1, 1, 1, 2] at block 4 × 4
  sparsa_tensor tmask = st::host_tensor(mask.data(), SPARSA_DTYPE_U8, {1, 1, 1, 2});
  std::vector<int32_t> indices = {0, 1, 2, 3, 4, 5, 6, 7};
  sparsa_tensor tidx = st::host_tensor(indices.data(), SPARSA_DTYPE_I32, {1, 1, 8});
  p.block_q = 4;
  p.block_k = 4;
  p.sink_tokens = 1;
  p.sink_window = 8;
  p.block_mask = &tmask;
  p.sparge_theta = 1.f;  // keep every block, so the mask is the causal one
  p.sparge_quantized = std::string(setup.name) == "SPARGE quantized" ? 1 : 0;
  p.indices = &tidx;
  EXPECT_EQ(sparsa_attention_run(c.ctx, &args, &p), SPARSA_STATUS_SUCCESS) << sparsa_last_error_message();
  return {r.out, r.lse};
}

bool row_all_nan(const NanRun& run, int64_t row, int64_t d) {
  for (int64_t c = 0; c < d; ++c)
    if (!std::isnan(run.out[size_t(row * d + c)])) return false;
  return std::isnan(run.lse[size_t(row)]);
}

TEST(ContractEdgeCases, NonFiniteValuesReachOnlyTheRowsThatSeeThem) {
  constexpr int64_t kD = 4, kRows = 4;
  const float kNaN = std::numeric_limits<float>::quiet_NaN();
  const float kInf = std::numeric_limits<float>::infinity();
  struct Case {
    Tensor where;
    int64_t position;                // key (k, v) or query row (q)
    float value;
    std::vector<int64_t> poisoned;  // rows that must be all-NaN (out and LSE); the rest equal the clean run bitwise
  };
  const Case cases[] = {
      {Tensor::kV, 7, kNaN, {3}},           // the reproducer: only row 3 sees key 7 (causal, offset 4)
      {Tensor::kV, 7, kInf, {3}},
      {Tensor::kK, 7, kNaN, {3}},
      {Tensor::kK, 7, -kInf, {3}},
      {Tensor::kV, 0, kNaN, {0, 1, 2, 3}},  // key 0: every row sees it
      {Tensor::kQ, 1, kNaN, {1}},           // a query's own NaN stays in its row
      {Tensor::kQ, 2, kInf, {2}},
  };
  for (const PolicySetup& setup : kNanPolicies) {
    // The int8 path centres K by its mean over the finite rows and scales each key block by its largest |K|, so a
    // zeroed non-finite K row changes other rows' rounding: there the untouched rows are checked finite, not bitwise.
    const bool k_changes_rounding = std::string(setup.name) == "SPARGE quantized";
    for (const Case& cs : cases) {
      SCOPED_TRACE(std::string(setup.name) + ": " + tensor_name(cs.where) + "[" + std::to_string(cs.position) +
                   "] = " + std::to_string(cs.value));
      // The clean baseline of this case: the same slot holding an ordinary finite value (0 for q's row).
      const NanRun baseline = run_nan_case(setup, cs.where, cs.position, 0.f);
      const NanRun got = run_nan_case(setup, cs.where, cs.position, cs.value);
      for (int64_t row = 0; row < kRows; ++row) {
        const bool poisoned =
            std::find(cs.poisoned.begin(), cs.poisoned.end(), row) != cs.poisoned.end();
        if (poisoned) {
          EXPECT_TRUE(row_all_nan(got, row, kD)) << "row " << row << " should be NaN";
          continue;
        }
        for (int64_t c = 0; c < kD; ++c) {
          if (k_changes_rounding && cs.where == Tensor::kK) {
            EXPECT_TRUE(std::isfinite(got.out[size_t(row * kD + c)])) << "row " << row;
            continue;
          }
          EXPECT_EQ(std::memcmp(&got.out[size_t(row * kD + c)], &baseline.out[size_t(row * kD + c)], sizeof(float)), 0)
              << "row " << row << " col " << c << ": " << got.out[size_t(row * kD + c)] << " vs "
              << baseline.out[size_t(row * kD + c)];
        }
        EXPECT_TRUE(std::isfinite(got.lse[size_t(row)])) << "row " << row;
      }
    }
  }
}

}  // namespace
