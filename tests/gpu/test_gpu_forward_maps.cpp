// The forward kernels' SpargeAttn PV skip (§4 step 7) on the GPU, through the public SPARGE API, against the CPU
// backend on the same inputs: outputs (NaN-poisoned first) and PV_BLOCKS_SKIPPED. theta = 1 keeps every block, so the
// predicted mask is the causal one and only the λ test decides; the inputs give it wide margins: the query blocks of
// even index hold rows that score ~30 (natural-log units) against key 0, so every later key block of theirs falls ~29
// below the running maximum (skipped at λ = -10), while odd blocks' gains stay within a few units of 0 (kept).
// Covers the tensor-core tiles (block_q 64 and 128 x block_k 64, fp16/bf16) and the portable kernel (fp32, and
// fp16/bf16 block sizes the tensor cores do not take), causal and not, Sq != Skv, GQA. The query-row maps (kDeltaRows)
// are covered by test_gpu_delta.cpp; kTokenLists by TOKEN_SPARSE's tests. Skips while SPARGE is unsupported here.
#include <cuda_runtime.h>
#include <gtest/gtest.h>
#include <sparsa/sparsa.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "gpu_test_util.h"

namespace {

using namespace sparsa_gpu_test;

struct Case {
  std::string name;
  int32_t dtype = SPARSA_DTYPE_BF16;
  int32_t head_dim = 128;
  int32_t q_heads = 4, kv_heads = 1;
  int32_t batch = 1, seq_q = 300, seq_k = 300;
  bool causal = true;
  int32_t block_q = 128, block_k = 64;
  float lambda = -10.f;
};

void PrintTo(const Case& c, std::ostream* os) { *os << c.name; }

constexpr float kSinkScore = 30.f;  // natural-log score of a sink row against key 0
constexpr float kNoise = 0.5f;

// q, k, v [B, S, H, D] (padded), rounded to the dtype by the caller's encode.
struct Inputs {
  std::vector<float> q, k, v;
};

Inputs make_inputs(const Case& c) {
  std::mt19937 rng(97);
  std::normal_distribution<float> normal(0.f, 1.f);
  const int32_t D = c.head_dim;
  Inputs in;
  auto fill = [&](std::vector<float>& x, size_t n) {
    x.resize(n);
    for (float& e : x) e = kNoise * std::clamp(normal(rng), -3.f, 3.f);
  };
  fill(in.q, size_t(c.batch) * c.seq_q * c.q_heads * D);
  fill(in.k, size_t(c.batch) * c.seq_k * c.kv_heads * D);
  fill(in.v, size_t(c.batch) * c.seq_k * c.kv_heads * D);
  // Key 0 and the sink rows share a large first coordinate: scale·a·a = kSinkScore.
  const float a = std::sqrt(kSinkScore * std::sqrt(float(D)));
  for (int32_t b = 0; b < c.batch; ++b) {
    for (int32_t h = 0; h < c.kv_heads; ++h) in.k[((size_t(b) * c.seq_k) * c.kv_heads + h) * D] = a;
    for (int32_t i = 0; i < c.seq_q; ++i) {
      if ((i / c.block_q) % 2 != 0) continue;
      for (int32_t h = 0; h < c.q_heads; ++h) in.q[((size_t(b) * c.seq_q + i) * c.q_heads + h) * D] = a;
    }
  }
  return in;
}

struct RunResult {
  sparsa_status status = SPARSA_STATUS_INTERNAL;
  std::string message;
  std::vector<float> out;
  std::vector<int64_t> stats;
};

RunResult run_case(const Case& c, const Inputs& in, bool on_gpu) {
  RunResult result;
  sparsa_context_options options;
  sparsa_context_options_init(&options, sizeof options);
  options.device_type = on_gpu ? SPARSA_DEVICE_CUDA : SPARSA_DEVICE_CPU;
  ScopedContext context(options);
  result.status = context.status();
  sparsa_context* const ctx = context.get();
  if (result.status != SPARSA_STATUS_SUCCESS) {
    result.message = sparsa_last_error_message();
    return result;
  }
  const int32_t dev = on_gpu ? SPARSA_DEVICE_CUDA : SPARSA_DEVICE_CPU;
  const std::vector<uint8_t> q = encode(in.q, c.dtype), k = encode(in.k, c.dtype), v = encode(in.v, c.dtype);
  std::vector<uint8_t> host_out(in.q.size() * element_bytes(c.dtype), 0xff);  // NaN in every dtype
  std::vector<int64_t> host_stats(SPARSA_STAT_COUNT, -1);
  std::deque<DeviceBuffer> buffers;
  auto place = [&](const void* host, size_t bytes) -> void* {
    if (!on_gpu) return const_cast<void*>(host);
    buffers.emplace_back(bytes);
    EXPECT_EQ(cudaMemcpy(buffers.back().data(), host, bytes, cudaMemcpyHostToDevice), cudaSuccess);
    return buffers.back().data();
  };
  void* out = place(host_out.data(), host_out.size());
  void* stats = place(host_stats.data(), host_stats.size() * 8);
  const std::vector<int64_t> q_shape{c.batch, c.seq_q, c.q_heads, c.head_dim};
  const std::vector<int64_t> kv_shape{c.batch, c.seq_k, c.kv_heads, c.head_dim};
  sparsa_tensor tq = make_tensor(place(q.data(), q.size()), c.dtype, q_shape, dev);
  sparsa_tensor tk = make_tensor(place(k.data(), k.size()), c.dtype, kv_shape, dev);
  sparsa_tensor tv = make_tensor(place(v.data(), v.size()), c.dtype, kv_shape, dev);
  sparsa_tensor tout = make_tensor(out, c.dtype, q_shape, dev);
  sparsa_tensor tstats = make_tensor(stats, SPARSA_DTYPE_I64, {SPARSA_STAT_COUNT}, dev);
  sparsa_attention_args args;
  sparsa_attention_args_init(&args, sizeof args);
  args.q = &tq;
  args.k = &tk;
  args.v = &tv;
  args.out = &tout;
  args.stats = &tstats;
  args.causal = c.causal ? 1 : 0;
  sparsa_policy policy;
  sparsa_policy_init(&policy, sizeof policy, SPARSA_POLICY_SPARGE);
  policy.block_q = c.block_q;
  policy.block_k = c.block_k;
  policy.sparge_theta = 1.f;  // every block kept: only the λ test decides
  policy.sparge_lambda = c.lambda;
  result.status = sparsa_attention_run(ctx, &args, &policy);
  result.message = sparsa_last_error_message();
  if (result.status == SPARSA_STATUS_SUCCESS) {
    if (on_gpu) {
      EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
      EXPECT_EQ(cudaMemcpy(host_out.data(), out, host_out.size(), cudaMemcpyDeviceToHost), cudaSuccess);
      EXPECT_EQ(cudaMemcpy(host_stats.data(), stats, host_stats.size() * 8, cudaMemcpyDeviceToHost), cudaSuccess);
    }
    result.out = decode(host_out, c.dtype);
    result.stats = host_stats;
  }
  return result;
}

double tolerance(int32_t dtype) { return dtype == SPARSA_DTYPE_F32 ? 4e-4 : dtype == SPARSA_DTYPE_F16 ? 8e-3 : 6e-2; }

class GpuPvSkip : public ::testing::TestWithParam<Case> {};

TEST_P(GpuPvSkip, MatchesCpuBackendIncludingSkippedBlocks) {
  const bool gpu_present = cuda_device_present();
  if (!gpu_present && !cpu_selfcheck_requested()) GTEST_SKIP() << "no CUDA device/driver";
  const Case& c = GetParam();
  const Inputs in = make_inputs(c);
  const RunResult cpu = run_case(c, in, /*on_gpu=*/false);
  ASSERT_EQ(cpu.status, SPARSA_STATUS_SUCCESS) << cpu.message;
  // The oracle: the input must make the test skip some blocks and keep others.
  EXPECT_GT(cpu.stats[SPARSA_STAT_PV_BLOCKS_SKIPPED], 0) << "oracle";
  EXPECT_LT(cpu.stats[SPARSA_STAT_PV_BLOCKS_SKIPPED], cpu.stats[SPARSA_STAT_BLOCKS_COMPUTED]) << "oracle";
  if (!gpu_present) return;
  const RunResult gpu = run_case(c, in, /*on_gpu=*/true);
  if (gpu.status == SPARSA_STATUS_UNSUPPORTED) GTEST_SKIP() << "SPARGE unsupported on this build: " << gpu.message;
  ASSERT_EQ(gpu.status, SPARSA_STATUS_SUCCESS) << gpu.message;
  double worst = 0;
  int64_t bad = 0;
  for (size_t i = 0; i < gpu.out.size(); ++i) {
    const double err = std::fabs(double(gpu.out[i]) - double(cpu.out[i]));
    if (!(err <= tolerance(c.dtype))) ++bad;
    worst = std::max(worst, std::isnan(err) ? 1e30 : err);
  }
  EXPECT_EQ(bad, 0) << c.name << ": max |gpu - cpu| = " << worst;
  EXPECT_EQ(gpu.stats[SPARSA_STAT_PV_BLOCKS_SKIPPED], cpu.stats[SPARSA_STAT_PV_BLOCKS_SKIPPED]) << c.name;
}

std::vector<Case> cases() {
  std::vector<Case> list;
  Case c;
  c.name = "tensor_cores_bf16_bq128_bk64_causal_gqa4";
  list.push_back(c);
  c = Case{};
  c.name = "tensor_cores_f16_bq64_bk64_noncausal_sq_lt_skv";
  c.dtype = SPARSA_DTYPE_F16;
  c.head_dim = 64;
  c.q_heads = 2;
  c.kv_heads = 2;
  c.block_q = 64;
  c.causal = false;
  c.seq_q = 200;
  c.seq_k = 333;
  list.push_back(c);
  c = Case{};
  c.name = "tensor_cores_bf16_bq128_bk64_causal_batch2_sq_lt_skv";
  c.batch = 2;
  c.seq_q = 257;
  c.seq_k = 400;
  list.push_back(c);
  c = Case{};
  c.name = "portable_f32_bq32_bk16_causal";
  c.dtype = SPARSA_DTYPE_F32;
  c.head_dim = 64;
  c.block_q = 32;
  c.block_k = 16;
  c.seq_q = 190;
  c.seq_k = 190;
  list.push_back(c);
  c = Case{};
  c.name = "portable_bf16_bq48_bk40_noncausal";  // block sizes the tensor-core tiles do not take
  c.head_dim = 64;
  c.q_heads = 4;
  c.kv_heads = 2;
  c.block_q = 48;
  c.block_k = 40;
  c.causal = false;
  c.seq_q = 230;
  c.seq_k = 250;
  list.push_back(c);
  return list;
}

INSTANTIATE_TEST_SUITE_P(Cases, GpuPvSkip, ::testing::ValuesIn(cases()),
                         [](const ::testing::TestParamInfo<Case>& info) { return info.param.name; });

}  // namespace
