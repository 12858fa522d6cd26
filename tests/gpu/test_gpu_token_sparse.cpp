// TOKEN_SPARSE (§5) on the GPU, the GPU-only check: a planned run captures in a CUDA graph and its replays reproduce
// the eager result bit for bit. The cases of each shape, layout, dtype and input structure, with the §0 audit of
// their selections, are rows of the backend-parameterised case table (tests/test_attention_case_tables.cpp,
// TokenSparseCases). Skips cleanly when no CUDA device/driver is present.
#include <cuda_runtime.h>
#include <gtest/gtest.h>
#include <sparsa/sparsa.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <deque>
#include <limits>
#include <random>
#include <vector>

#include "gpu_test_util.h"

namespace {

using namespace sparsa_gpu_test;

// A packed (varlen) batch, Sq == Skv per sequence, f16, D 64, Hq 4, Hkv 2, W 32, min_tokens 64, τ 0.3.
constexpr int32_t kDtype = SPARSA_DTYPE_F16, kHeadDim = 64, kQHeads = 4, kKvHeads = 2;
constexpr int32_t kWindow = 32, kPoolKernel = 7, kMinTokens = 64;
constexpr float kCoverage = 0.3f;
const std::vector<int32_t> kLengths = {700, 90, 400};  // sequence 1 runs dense (90 <= 64 + 32)

// Packed q/k/v bytes with a needle per kv head (a key the window queries of its group lean on), so the captured run
// takes the sparse path with sets that differ between heads.
struct PackedInputs {
  std::vector<uint8_t> q, k, v;
  std::vector<int32_t> cu;
  int32_t rows = 0, max_len = 0;
};

PackedInputs make_inputs(std::mt19937& rng) {
  std::normal_distribution<float> normal(0.f, 1.f);
  const auto append_noise = [&](std::vector<float>& x, size_t count) {
    for (size_t e = 0; e < count; ++e) x.push_back(std::clamp(normal(rng), -3.f, 3.f) * 0.7f);
  };
  const int32_t group = kQHeads / kKvHeads;
  std::vector<float> q, k, v;
  PackedInputs in;
  in.cu.push_back(0);
  for (int32_t L : kLengths) {
    const size_t q_at = q.size(), k_at = k.size();
    append_noise(q, size_t(L) * kQHeads * kHeadDim);
    append_noise(k, size_t(L) * kKvHeads * kHeadDim);
    append_noise(v, size_t(L) * kKvHeads * kHeadDim);
    const int32_t first_window_row = std::max(0, L - kWindow);
    for (int32_t kh = 0; kh < kKvHeads && first_window_row > 8; ++kh) {
      std::vector<float> u(kHeadDim);
      for (auto& e : u) e = std::clamp(normal(rng), -2.f, 2.f);
      for (int32_t t = first_window_row; t < L; ++t)
        for (int32_t g = 0; g < group; ++g)
          for (int32_t d = 0; d < kHeadDim; ++d)
            q[q_at + (size_t(t) * kQHeads + kh * group + g) * kHeadDim + d] += 0.5f * u[d];
      const int32_t needle = std::uniform_int_distribution<int32_t>(1, first_window_row - 2)(rng);
      for (int32_t d = 0; d < kHeadDim; ++d) k[k_at + (size_t(needle) * kKvHeads + kh) * kHeadDim + d] = 1.2f * u[d];
    }
    in.cu.push_back(in.cu.back() + L);
    in.max_len = std::max(in.max_len, L);
  }
  in.rows = in.cu.back();
  in.q = encode(q, kDtype);
  in.k = encode(k, kDtype);
  in.v = encode(v, kDtype);
  return in;
}

sparsa_policy token_sparse_policy() {
  sparsa_policy policy;
  sparsa_policy_init(&policy, sizeof policy, SPARSA_POLICY_TOKEN_SPARSE);
  policy.token_sparse_window = kWindow;
  policy.token_sparse_pool_kernel = kPoolKernel;
  policy.token_sparse_min_tokens = kMinTokens;
  policy.token_sparse_coverage = kCoverage;
  return policy;
}

struct Outputs {
  std::vector<uint8_t> out;
  std::vector<float> lse;
  std::vector<int32_t> selected;  // [B, Hq, max_len]
  std::vector<int64_t> stats;     // [SPARSA_STAT_COUNT]
};

// The tensors of one run in device memory; the buffers free themselves when a failed ASSERT leaves the test.
class DeviceRun {
 public:
  explicit DeviceRun(const PackedInputs& in)
      : q_(in.q.size()),
        k_(in.k.size()),
        v_(in.v.size()),
        out_(in.q.size()),
        lse_(size_t(in.rows) * kQHeads * 4),
        selected_(kLengths.size() * kQHeads * in.max_len * 4),
        stats_(SPARSA_STAT_COUNT * 8),
        cu_(in.cu.size() * 4) {
    q_.upload(in.q.data());
    k_.upload(in.k.data());
    v_.upload(in.v.data());
    cu_.upload(in.cu.data());
    poison();
    const int32_t dev = SPARSA_DEVICE_CUDA, B = int32_t(kLengths.size());
    tq_ = make_tensor(q_.data(), kDtype, {in.rows, kQHeads, kHeadDim}, dev);
    tk_ = make_tensor(k_.data(), kDtype, {in.rows, kKvHeads, kHeadDim}, dev);
    tv_ = make_tensor(v_.data(), kDtype, {in.rows, kKvHeads, kHeadDim}, dev);
    tout_ = make_tensor(out_.data(), kDtype, {in.rows, kQHeads, kHeadDim}, dev);
    tlse_ = make_tensor(lse_.data(), SPARSA_DTYPE_F32, {kQHeads, in.rows}, dev);
    tselected_ = make_tensor(selected_.data(), SPARSA_DTYPE_I32, {B, kQHeads, in.max_len}, dev);
    tstats_ = make_tensor(stats_.data(), SPARSA_DTYPE_I64, {SPARSA_STAT_COUNT}, dev);
    tcu_ = make_tensor(cu_.data(), SPARSA_DTYPE_I32, {int64_t(in.cu.size())}, dev);
    sparsa_attention_args_init(&args_, sizeof args_);
    args_.q = &tq_;
    args_.k = &tk_;
    args_.v = &tv_;
    args_.out = &tout_;
    args_.lse = &tlse_;
    args_.causal = 1;
    args_.selected_indices = &tselected_;
    args_.stats = &tstats_;
    args_.cu_seqlens_q = &tcu_;
    args_.cu_seqlens_k = &tcu_;
  }

  const sparsa_attention_args* args() const { return &args_; }
  void poison() {
    for (DeviceBuffer* b : {&out_, &lse_, &selected_, &stats_}) b->poison();
  }
  Outputs collect() const {
    Outputs o;
    o.out = out_.download();
    const std::vector<uint8_t> lse = lse_.download(), selected = selected_.download(), stats = stats_.download();
    o.lse.resize(lse.size() / 4);
    o.selected.resize(selected.size() / 4);
    o.stats.resize(stats.size() / 8);
    std::memcpy(o.lse.data(), lse.data(), lse.size());
    std::memcpy(o.selected.data(), selected.data(), selected.size());
    std::memcpy(o.stats.data(), stats.data(), stats.size());
    return o;
  }

 private:
  DeviceBuffer q_, k_, v_, out_, lse_, selected_, stats_, cu_;
  sparsa_tensor tq_, tk_, tv_, tout_, tlse_, tselected_, tstats_, tcu_;
  sparsa_attention_args args_;
};

// A planned run captures in a CUDA graph (no host synchronisation: device lengths are never read on the host) and
// its replays reproduce the eager result bit for bit.
TEST(GpuTokenSparseGraph, CaptureAndReplayVarlen) {
  SKIP_WITHOUT_GPU();
  std::mt19937 rng(11);
  const PackedInputs in = make_inputs(rng);
  const sparsa_policy policy = token_sparse_policy();
  Outputs eager;
  {
    ScopedContext context(context_options(SPARSA_DEVICE_CUDA));
    SPARSA_OK(context.status());
    DeviceRun run(in);
    SPARSA_OK(sparsa_attention_run(context.get(), run.args(), &policy));
    eager = run.collect();
  }
  int64_t dropped = 0;  // rows left out of a head's set (-1 slots beyond the sequence's length do not count)
  for (size_t b = 0; b < kLengths.size(); ++b)
    for (int32_t h = 0; h < kQHeads; ++h) {
      const int32_t* set = &eager.selected[(b * kQHeads + h) * size_t(in.max_len)];
      dropped += kLengths[b] - std::count_if(set, set + in.max_len, [](int32_t id) { return id >= 0; });
    }
  ASSERT_GT(dropped, 0) << "the eager run must take the sparse path";

  ScopedStream owned_stream;
  CUDA_OK(cudaStreamCreate(owned_stream.out()));
  const cudaStream_t stream = owned_stream.get();
  ScopedContext context(context_options(SPARSA_DEVICE_CUDA, stream));
  SPARSA_OK(context.status());
  sparsa_context* const ctx = context.get();
  DeviceRun run(in);
  SPARSA_OK(sparsa_attention_plan(ctx, run.args(), &policy));
  ScopedGraph graph;
  CUDA_OK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal));
  const sparsa_status captured = sparsa_attention_run(ctx, run.args(), &policy);
  CUDA_OK(cudaStreamEndCapture(stream, graph.out()));
  ASSERT_EQ(captured, SPARSA_STATUS_SUCCESS) << sparsa_last_error_message();
  ScopedGraphExec exec;
  CUDA_OK(cudaGraphInstantiate(exec.out(), graph.get(), 0));
  for (int replay = 0; replay < 2; ++replay) {
    run.poison();
    CUDA_OK(cudaDeviceSynchronize());  // the poison is in place before the replay writes
    CUDA_OK(cudaGraphLaunch(exec.get(), stream));
    CUDA_OK(cudaStreamSynchronize(stream));
    const Outputs replayed = run.collect();
    EXPECT_EQ(replayed.out, eager.out) << "replay " << replay;  // bytes: NaN payloads compare too
    EXPECT_EQ(std::memcmp(replayed.lse.data(), eager.lse.data(), eager.lse.size() * 4), 0) << "replay " << replay;
    EXPECT_EQ(replayed.selected, eager.selected) << "replay " << replay;
    EXPECT_EQ(replayed.stats, eager.stats) << "replay " << replay;
  }
}

}  // namespace
