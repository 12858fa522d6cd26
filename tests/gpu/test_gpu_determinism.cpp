// Run-to-run determinism of the GPU selection policies: the same inputs must give bit-identical outputs, LSE,
// selections (selected_indices / block_mask_out) and stats on every run — in one context, after runs of another
// problem in that context (stale scratch), and in fresh contexts (fresh scratch). The selection kernels promise
// fixed reduction orders and no order-dependent atomics, so any difference is a race: e.g. a global-memory
// read-after-write between threads or blocks that normal scheduling happens to hide (device_topk's digit pick read
// its segment's `remaining` after another warp of the same block could have rewritten it; compute-sanitizer
// racecheck, which serialises warps, exposed it as varying TOKEN_SPARSE selections).
//
// Outputs are poisoned before every run, alternately with two different byte patterns, so an element a run does
// not write shows up as a difference too. SPARSA_GPU_DETERMINISM_RUNS overrides the number of runs (e.g. fewer
// under compute-sanitizer). Skips cleanly without a CUDA device.
#include <cuda_runtime.h>
#include <gtest/gtest.h>
#include <sparsa/sparsa.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "gpu_test_util.h"

namespace {

using namespace sparsa_gpu_test;

constexpr int kDefaultRuns = 20;
constexpr int kFreshContexts = 2;        // extra runs, each in a new context
constexpr uint8_t kPoison[2] = {0xff, 0xab};  // NaN / a large negative int in every output dtype

int runs_requested() {
  const char* text = std::getenv("SPARSA_GPU_DETERMINISM_RUNS");
  const int runs = text != nullptr ? std::atoi(text) : kDefaultRuns;
  return std::max(2, runs);
}

class Context {
 public:
  Context() {
    sparsa_context_options options;
    sparsa_context_options_init(&options, sizeof options);
    options.device_type = SPARSA_DEVICE_CUDA;
    status = sparsa_context_create(&options, &ctx);
  }
  ~Context() {
    if (ctx != nullptr) sparsa_context_destroy(ctx);
  }
  Context(const Context&) = delete;
  Context& operator=(const Context&) = delete;
  sparsa_context* ctx = nullptr;
  sparsa_status status = SPARSA_STATUS_SUCCESS;
};

// ---- one packed (varlen) attention problem on the device ----

struct Shape {
  int32_t dtype = SPARSA_DTYPE_F16;
  int32_t head_dim = 64;
  int32_t q_heads = 4, kv_heads = 2;
  std::vector<int32_t> seq_q, seq_k;  // per sequence; q and k/v are packed (cu_seqlens)
  bool smooth = false;                // low-frequency position features (SPARGE finds self-similar blocks)
  int64_t selected_sets = 0, selected_cap = 0;  // selected_indices [B, sets, cap] when sets > 0
  int32_t mask_block_q = 0, mask_block_k = 0;   // block_mask_out when > 0
};

// Every output of one run, as raw bytes.
struct Snapshot {
  sparsa_status status = SPARSA_STATUS_INTERNAL;
  std::string message;
  std::vector<uint8_t> out, lse, selected, mask, stats;
};

class DeviceProblem {
 public:
  DeviceProblem(const Shape& s, uint32_t seed) {
    const int32_t B = int32_t(s.seq_q.size()), D = s.head_dim;
    std::vector<int32_t> cu_q{0}, cu_k{0};
    for (int32_t b = 0; b < B; ++b) {
      cu_q.push_back(cu_q.back() + s.seq_q[b]);
      cu_k.push_back(cu_k.back() + s.seq_k[b]);
    }
    const int64_t tq = cu_q.back(), tk = cu_k.back();
    std::mt19937 rng(seed);
    std::normal_distribution<float> normal(0.f, 1.f);
    std::vector<float> q(size_t(tq) * s.q_heads * D), k(size_t(tk) * s.kv_heads * D), v(k.size());
    for (auto* x : {&q, &k, &v}) {
      for (float& e : *x) e = std::clamp(normal(rng), -3.f, 3.f) * 0.7f;
    }
    if (s.smooth) {  // slow sinusoids of the position on the first 8 dims, so neighbouring blocks look alike
      auto add = [&](std::vector<float>& x, const std::vector<int32_t>& cu, int32_t heads) {
        for (int32_t b = 0; b < B; ++b) {
          for (int32_t t = 0; t < cu[b + 1] - cu[b]; ++t) {
            for (int32_t h = 0; h < heads; ++h) {
              for (int32_t f = 0; f < 4; ++f) {
                const double omega = 6.283185307179586 / (512.0 * (f + 1));
                float* row = &x[(size_t(cu[b] + t) * heads + h) * D];
                row[2 * f] += float(4.0 * std::cos(omega * t));
                row[2 * f + 1] += float(4.0 * std::sin(omega * t));
              }
            }
          }
        }
      };
      add(q, cu_q, s.q_heads);
      add(k, cu_k, s.kv_heads);
    }
    q_ = upload(encode(q, s.dtype));
    k_ = upload(encode(k, s.dtype));
    v_ = upload(encode(v, s.dtype));
    cu_q_ = upload(cu_q);
    cu_k_ = upload(cu_k);
    out_ = &buffers_.emplace_back(size_t(tq) * s.q_heads * D * 2);
    lse_ = &buffers_.emplace_back(size_t(tq) * s.q_heads * 4);
    stats_ = &buffers_.emplace_back(size_t(SPARSA_STAT_COUNT) * 8);
    const int32_t max_q = *std::max_element(s.seq_q.begin(), s.seq_q.end());
    const int32_t max_k = *std::max_element(s.seq_k.begin(), s.seq_k.end());
    if (s.selected_sets > 0) selected_ = &buffers_.emplace_back(size_t(B) * s.selected_sets * s.selected_cap * 4);
    if (s.mask_block_q > 0) {
      mask_shape_ = {B, s.q_heads, (max_q + s.mask_block_q - 1) / s.mask_block_q,
                     (max_k + s.mask_block_k - 1) / s.mask_block_k};
      mask_ = &buffers_.emplace_back(size_t(mask_shape_[0] * mask_shape_[1] * mask_shape_[2] * mask_shape_[3]));
    }
    tq_ = make_tensor(q_->data(), s.dtype, {tq, s.q_heads, D}, SPARSA_DEVICE_CUDA);
    tk_ = make_tensor(k_->data(), s.dtype, {tk, s.kv_heads, D}, SPARSA_DEVICE_CUDA);
    tv_ = make_tensor(v_->data(), s.dtype, {tk, s.kv_heads, D}, SPARSA_DEVICE_CUDA);
    tout_ = make_tensor(out_->data(), s.dtype, {tq, s.q_heads, D}, SPARSA_DEVICE_CUDA);
    tlse_ = make_tensor(lse_->data(), SPARSA_DTYPE_F32, {s.q_heads, tq}, SPARSA_DEVICE_CUDA);
    tstats_ = make_tensor(stats_->data(), SPARSA_DTYPE_I64, {SPARSA_STAT_COUNT}, SPARSA_DEVICE_CUDA);
    tcu_q_ = make_tensor(cu_q_->data(), SPARSA_DTYPE_I32, {B + 1}, SPARSA_DEVICE_CUDA);
    tcu_k_ = make_tensor(cu_k_->data(), SPARSA_DTYPE_I32, {B + 1}, SPARSA_DEVICE_CUDA);
    sparsa_attention_args_init(&args_, sizeof args_);
    args_.q = &tq_;
    args_.k = &tk_;
    args_.v = &tv_;
    args_.out = &tout_;
    args_.lse = &tlse_;
    args_.causal = 1;
    args_.cu_seqlens_q = &tcu_q_;
    args_.cu_seqlens_k = &tcu_k_;
    args_.stats = &tstats_;
    if (selected_ != nullptr) {
      tselected_ = make_tensor(selected_->data(), SPARSA_DTYPE_I32, {B, s.selected_sets, s.selected_cap}, SPARSA_DEVICE_CUDA);
      args_.selected_indices = &tselected_;
    }
    if (mask_ != nullptr) {
      tmask_ = make_tensor(mask_->data(), SPARSA_DTYPE_U8, mask_shape_, SPARSA_DEVICE_CUDA);
      args_.block_mask_out = &tmask_;
    }
  }

  // One run: poison every output with `poison`, run, wait, read everything back.
  Snapshot run(sparsa_context* ctx, const sparsa_policy& policy, uint8_t poison) {
    for (DeviceBuffer* b : {out_, lse_, stats_, selected_, mask_}) {
      if (b != nullptr) b->fill(poison);
    }
    Snapshot s;
    s.status = sparsa_attention_run(ctx, &args_, &policy);
    s.message = sparsa_last_error_message();
    if (s.status != SPARSA_STATUS_SUCCESS) return s;
    EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    s.out = out_->download();
    s.lse = lse_->download();
    s.stats = stats_->download();
    if (selected_ != nullptr) s.selected = selected_->download();
    if (mask_ != nullptr) s.mask = mask_->download();
    return s;
  }

 private:
  template <typename T>
  DeviceBuffer* upload(const std::vector<T>& host) {
    DeviceBuffer* b = &buffers_.emplace_back(host.size() * sizeof(T));
    b->upload(host.data());
    return b;
  }

  std::deque<DeviceBuffer> buffers_;
  DeviceBuffer *q_ = nullptr, *k_ = nullptr, *v_ = nullptr, *cu_q_ = nullptr, *cu_k_ = nullptr;
  DeviceBuffer *out_ = nullptr, *lse_ = nullptr, *stats_ = nullptr, *selected_ = nullptr, *mask_ = nullptr;
  std::vector<int64_t> mask_shape_;
  sparsa_tensor tq_, tk_, tv_, tout_, tlse_, tstats_, tcu_q_, tcu_k_, tselected_, tmask_;
  sparsa_attention_args args_;
};

// Differing elements of one output (element_bytes wide), with the first one's index.
void expect_same_bytes(const std::vector<uint8_t>& want, const std::vector<uint8_t>& got, size_t element_bytes,
                       const std::string& what) {
  ASSERT_EQ(want.size(), got.size()) << what;
  int64_t differing = 0, first = -1;
  for (size_t e = 0; e + element_bytes <= want.size(); e += element_bytes) {
    if (std::memcmp(&want[e], &got[e], element_bytes) != 0) {
      if (first < 0) first = int64_t(e / element_bytes);
      ++differing;
    }
  }
  EXPECT_EQ(differing, 0) << what << ": " << differing << " of " << want.size() / element_bytes
                          << " elements differ from the first run (first at element " << first << ")";
}

void expect_same_snapshot(const Snapshot& want, const Snapshot& got, const std::string& where) {
  ASSERT_EQ(got.status, SPARSA_STATUS_SUCCESS) << where << ": " << got.message;
  expect_same_bytes(want.selected, got.selected, 4, where + " selected_indices");
  expect_same_bytes(want.mask, got.mask, 1, where + " block_mask_out");
  expect_same_bytes(want.stats, got.stats, 8, where + " stats");
  expect_same_bytes(want.out, got.out, 2, where + " out");
  expect_same_bytes(want.lse, got.lse, 4, where + " lse");
}

// `runs` runs in one context (every other one preceded by a run of `other`, which leaves different contents in
// the context's scratch), then kFreshContexts runs in new contexts: all equal to the first, bit for bit.
void expect_deterministic(const Shape& shape, const sparsa_policy& policy, const sparsa_policy& other) {
  DeviceProblem problem(shape, 2026);
  Context ctx;
  ASSERT_EQ(ctx.status, SPARSA_STATUS_SUCCESS) << sparsa_last_error_message();
  const Snapshot first = problem.run(ctx.ctx, policy, kPoison[0]);
  ASSERT_EQ(first.status, SPARSA_STATUS_SUCCESS) << first.message;
  const int runs = runs_requested();
  for (int r = 1; r < runs; ++r) {
    if (r % 2 == 1) {
      const Snapshot disturbance = problem.run(ctx.ctx, other, kPoison[0]);
      ASSERT_EQ(disturbance.status, SPARSA_STATUS_SUCCESS) << disturbance.message;
    }
    expect_same_snapshot(first, problem.run(ctx.ctx, policy, kPoison[r % 2]), "run " + std::to_string(r));
    if (::testing::Test::HasFailure()) return;  // one report is enough
  }
  for (int f = 0; f < kFreshContexts; ++f) {
    Context fresh;
    ASSERT_EQ(fresh.status, SPARSA_STATUS_SUCCESS) << sparsa_last_error_message();
    expect_same_snapshot(first, problem.run(fresh.ctx, policy, kPoison[(f + 1) % 2]),
                         "fresh context " + std::to_string(f));
  }
}

// ---- the policies ----

TEST(GpuDeterminism, TokenSparseRaggedVarlen) {
  SKIP_WITHOUT_GPU();
  // The two varlen cases racecheck caught in one batch: dense (L <= min_tokens + W, and L = 1) and sparse sequences
  // of ragged lengths, straddling the fallback threshold, GQA 4 and 1.
  Shape s;
  s.dtype = SPARSA_DTYPE_F16;
  s.head_dim = 64;
  s.q_heads = 4;
  s.kv_heads = 1;
  s.seq_q = {900, 90, 613, 1, 96, 97, 98, 103, 95};
  s.seq_k = s.seq_q;
  s.selected_sets = s.q_heads;
  s.selected_cap = 900;
  sparsa_policy policy;
  sparsa_policy_init(&policy, sizeof policy, SPARSA_POLICY_TOKEN_SPARSE);
  policy.token_sparse_window = 32;
  policy.token_sparse_pool_kernel = 7;
  policy.token_sparse_min_tokens = 64;
  policy.token_sparse_coverage = 0.3f;
  sparsa_policy other = policy;
  other.token_sparse_window = 48;
  other.token_sparse_coverage = 0.6f;
  expect_deterministic(s, policy, other);
}

TEST(GpuDeterminism, TokenSparseLongerSequencesGqa2) {
  SKIP_WITHOUT_GPU();
  // Several score chunks per head, W > 128 (two window-row tiles) and budgets decided by the coverage count.
  Shape s;
  s.dtype = SPARSA_DTYPE_BF16;
  s.head_dim = 128;
  s.q_heads = 4;
  s.kv_heads = 2;
  s.seq_q = {3000, 1777};
  s.seq_k = s.seq_q;
  s.selected_sets = s.q_heads;
  s.selected_cap = 3000;
  sparsa_policy policy;
  sparsa_policy_init(&policy, sizeof policy, SPARSA_POLICY_TOKEN_SPARSE);
  policy.token_sparse_window = 160;
  policy.token_sparse_min_tokens = 256;
  policy.token_sparse_coverage = 0.05f;
  sparsa_policy other = policy;
  other.token_sparse_window = 64;
  expect_deterministic(s, policy, other);
}

TEST(GpuDeterminism, Sparge) {
  SKIP_WITHOUT_GPU();
  Shape s;
  s.dtype = SPARSA_DTYPE_BF16;
  s.head_dim = 128;
  s.q_heads = 4;
  s.kv_heads = 2;
  s.seq_q = {1500, 777, 130};
  s.seq_k = s.seq_q;
  s.smooth = true;
  s.mask_block_q = 128;
  s.mask_block_k = 64;
  sparsa_policy policy;
  sparsa_policy_init(&policy, sizeof policy, SPARSA_POLICY_SPARGE);
  policy.block_q = s.mask_block_q;
  policy.block_k = s.mask_block_k;
  policy.sparge_theta = 0.3f;
  policy.sparge_tau = 0.9f;
  sparsa_policy other = policy;
  other.sparge_tau = 0.5f;
  expect_deterministic(s, policy, other);
}

TEST(GpuDeterminism, TokenSelectPerKvHeadMultiBlockTopk) {
  SKIP_WITHOUT_GPU();
  // Chunked-prefill rows over long key sequences: > 8192 candidates, so device_topk splits each segment over
  // several blocks and the last one to finish picks the digit.
  Shape s;
  s.dtype = SPARSA_DTYPE_F16;
  s.head_dim = 64;
  s.q_heads = 8;
  s.kv_heads = 2;
  s.seq_q = {4, 1, 7};
  s.seq_k = {30000, 9000, 3000};
  sparsa_policy policy;
  sparsa_policy_init(&policy, sizeof policy, SPARSA_POLICY_TOKEN_SELECT);
  policy.select_n_init = 64;
  policy.select_n_local = 256;
  policy.select_top_k = 2048;
  policy.select_per_kv_head = 1;
  policy.select_cache_theta = 1.0f;  // no cache: every run selects
  s.selected_sets = s.kv_heads;
  s.selected_cap = policy.select_n_init + policy.select_top_k + policy.select_n_local;
  sparsa_policy other = policy;
  other.select_top_k = 1000;  // a shorter selection: fills the tensor's rows only partly, and scratch differently
  expect_deterministic(s, policy, other);
}

// sparsa_topk_from_scores straight on device_topk: coarse values (many exact ties at the threshold), segments
// of several blocks, k inside a tie run; every run must equal the host reference.
TEST(GpuDeterminism, DeviceTopkTiesAcrossBlocks) {
  SKIP_WITHOUT_GPU();
  const int B = 2, H = 3, N = 50000, k = 20000;
  std::mt19937 rng(5);
  std::normal_distribution<float> normal;
  std::vector<float> scores(size_t(B) * H * N);
  for (float& x : scores) x = std::round(normal(rng) * 8.0f) / 8.0f;
  std::vector<int32_t> want(size_t(B) * H * k);
  for (int row = 0; row < B * H; ++row) {
    std::vector<int32_t> order(N);
    std::iota(order.begin(), order.end(), 0);
    const float* v = &scores[size_t(row) * N];
    std::stable_sort(order.begin(), order.end(), [&](int32_t a, int32_t c) { return v[a] > v[c]; });
    std::sort(order.begin(), order.begin() + k);
    std::copy(order.begin(), order.begin() + k, want.begin() + size_t(row) * k);
  }
  DeviceBuffer in(scores.size() * 4), out(want.size() * 4);
  in.upload(scores.data());
  sparsa_tensor ts = make_tensor(in.data(), SPARSA_DTYPE_F32, {B, H, N}, SPARSA_DEVICE_CUDA);
  sparsa_tensor to = make_tensor(out.data(), SPARSA_DTYPE_I32, {B, H, k}, SPARSA_DEVICE_CUDA);
  Context ctx;
  ASSERT_EQ(ctx.status, SPARSA_STATUS_SUCCESS) << sparsa_last_error_message();
  const int runs = runs_requested();
  for (int r = 0; r < runs; ++r) {
    out.fill(kPoison[r % 2]);
    ASSERT_EQ(sparsa_topk_from_scores(ctx.ctx, &ts, k, 1, &to), SPARSA_STATUS_SUCCESS) << sparsa_last_error_message();
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    std::vector<int32_t> got(want.size());
    const std::vector<uint8_t> bytes = out.download();
    std::memcpy(got.data(), bytes.data(), bytes.size());
    int64_t differing = 0;
    for (size_t i = 0; i < want.size(); ++i) differing += got[i] != want[i];
    ASSERT_EQ(differing, 0) << "run " << r << ": " << differing << " of " << want.size() << " indices differ";
  }
}

}  // namespace
