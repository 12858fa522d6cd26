// §8 Δ on the GPU (gpu_delta.cu), the GPU-only check: a run captured in a CUDA graph replays to the CPU backend's
// result. The Δ cases over each base policy, layout and kernel path, Δ over DENSE on a long sequence included, are
// rows of the backend-parameterised case table (tests/test_attention_case_tables.cpp, DeltaCases). Skips cleanly
// without a device.
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

// ---- one case ----

enum class Layout { kPadded, kPacked };

// Δ over SINK_WINDOW, causal, no LSE.
struct Case {
  std::string name;
  int32_t dtype = SPARSA_DTYPE_BF16;
  int32_t head_dim = 128;
  int32_t q_heads = 4, kv_heads = 4;
  std::vector<int32_t> seq_q{256}, seq_k{256};
  Layout q_layout = Layout::kPadded;
  Layout kv_layout = Layout::kPadded;
  int32_t sink_tokens = 4, sink_window = 48;
  int32_t gamma = 64, tail_min = 128;
};

struct Inputs {
  int32_t batch = 0, max_q = 0, max_k = 0;
  std::vector<float> q, k, v;  // logical [b][i][h][d] at the max lengths
  // Physical tensors.
  std::vector<uint8_t> q_bytes, k_bytes, v_bytes;
  std::vector<int32_t> cu_q, cu_k, seq_lens_k;
  std::vector<int64_t> q_shape, kv_shape;
  int64_t q_rows = 0;
};

Inputs make_inputs(const Case& c) {
  std::mt19937 rng(4321);
  std::normal_distribution<float> normal(0.f, 1.f);
  Inputs in;
  const int32_t D = c.head_dim, Hq = c.q_heads, Hkv = c.kv_heads;
  in.batch = int32_t(c.seq_q.size());
  in.max_q = *std::max_element(c.seq_q.begin(), c.seq_q.end());
  in.max_k = *std::max_element(c.seq_k.begin(), c.seq_k.end());
  auto fill = [&](std::vector<float>& x, size_t n) {
    x.resize(n);
    for (float& e : x) e = std::clamp(normal(rng), -3.f, 3.f);
  };
  fill(in.q, size_t(in.batch) * in.max_q * Hq * D);
  fill(in.k, size_t(in.batch) * in.max_k * Hkv * D);
  fill(in.v, size_t(in.batch) * in.max_k * Hkv * D);
  // Physical layouts.
  std::vector<float> q_phys, k_phys, v_phys;
  if (c.q_layout == Layout::kPacked) {
    in.cu_q.push_back(0);
    for (int32_t b = 0; b < in.batch; ++b) {
      const float* row = &in.q[(size_t(b) * in.max_q * Hq) * D];
      q_phys.insert(q_phys.end(), row, row + size_t(c.seq_q[b]) * Hq * D);
      in.cu_q.push_back(in.cu_q.back() + c.seq_q[b]);
    }
    in.q_rows = in.cu_q.back();
    in.q_shape = {in.q_rows, Hq, D};
  } else {
    q_phys = in.q;
    in.q_rows = int64_t(in.batch) * in.max_q;
    in.q_shape = {in.batch, in.max_q, Hq, D};
  }
  const size_t row_elems = size_t(Hkv) * D;
  auto kv_row = [&](const std::vector<float>& src, int32_t b, int32_t t) {
    return &src[(size_t(b) * in.max_k + t) * row_elems];
  };
  if (c.kv_layout == Layout::kPadded) {
    k_phys = in.k;
    v_phys = in.v;
    in.kv_shape = {in.batch, in.max_k, Hkv, D};
    in.seq_lens_k.assign(c.seq_k.begin(), c.seq_k.end());
  } else {
    in.cu_k.push_back(0);
    for (int32_t b = 0; b < in.batch; ++b) {
      k_phys.insert(k_phys.end(), kv_row(in.k, b, 0), kv_row(in.k, b, 0) + c.seq_k[b] * row_elems);
      v_phys.insert(v_phys.end(), kv_row(in.v, b, 0), kv_row(in.v, b, 0) + c.seq_k[b] * row_elems);
      in.cu_k.push_back(in.cu_k.back() + c.seq_k[b]);
    }
    in.kv_shape = {in.cu_k.back(), Hkv, D};
  }
  in.q_bytes = encode(q_phys, c.dtype);
  in.k_bytes = encode(k_phys, c.dtype);
  in.v_bytes = encode(v_phys, c.dtype);
  return in;
}

sparsa_policy make_policy(const Case& c) {
  sparsa_policy policy;
  sparsa_policy_init(&policy, sizeof policy, SPARSA_POLICY_SINK_WINDOW);
  policy.sink_tokens = c.sink_tokens;
  policy.sink_window = c.sink_window;
  policy.flags |= SPARSA_POLICY_FLAG_DELTA;
  policy.delta_gamma = c.gamma;
  policy.delta_tail_min = c.tail_min;
  return policy;
}

struct RunResult {
  sparsa_status status = SPARSA_STATUS_INTERNAL;
  std::string message;
  std::vector<float> out;  // physical out
  std::vector<int64_t> stats;
};

enum class Mode { kCpu, kGpuGraph };

RunResult run_case(const Case& c, const Inputs& in, Mode mode) {
  RunResult result;
  const bool on_gpu = mode != Mode::kCpu;
  ScopedStream owned_stream;
  if (mode == Mode::kGpuGraph && cudaStreamCreateWithFlags(owned_stream.out(), cudaStreamNonBlocking) != cudaSuccess) {
    result.message = "cudaStreamCreate failed";
    return result;
  }
  const cudaStream_t stream = owned_stream.get();
  sparsa_context_options options;
  sparsa_context_options_init(&options, sizeof options);
  options.device_type = on_gpu ? SPARSA_DEVICE_CUDA : SPARSA_DEVICE_CPU;
  options.stream = stream;
  ScopedContext context(options);
  result.status = context.status();
  sparsa_context* const ctx = context.get();
  if (result.status != SPARSA_STATUS_SUCCESS) {
    result.message = sparsa_last_error_message();
    return result;
  }
  const int32_t dev = on_gpu ? SPARSA_DEVICE_CUDA : SPARSA_DEVICE_CPU;
  const size_t out_bytes = size_t(in.q_rows) * c.q_heads * c.head_dim * element_bytes(c.dtype);
  std::vector<uint8_t> host_out(out_bytes, 0xff);  // NaN in every dtype
  std::vector<int64_t> host_stats(SPARSA_STAT_COUNT, -1);
  std::deque<DeviceBuffer> buffers;
  auto place = [&](const void* host, size_t bytes) -> void* {
    if (!on_gpu) return const_cast<void*>(host);
    buffers.emplace_back(bytes);
    EXPECT_EQ(cudaMemcpy(buffers.back().data(), host, bytes, cudaMemcpyHostToDevice), cudaSuccess);
    return buffers.back().data();
  };
  void* out = place(host_out.data(), out_bytes);
  void* stats = place(host_stats.data(), host_stats.size() * 8);
  sparsa_tensor tq = make_tensor(place(in.q_bytes.data(), in.q_bytes.size()), c.dtype, in.q_shape, dev);
  sparsa_tensor tk = make_tensor(place(in.k_bytes.data(), in.k_bytes.size()), c.dtype, in.kv_shape, dev);
  sparsa_tensor tv = make_tensor(place(in.v_bytes.data(), in.v_bytes.size()), c.dtype, in.kv_shape, dev);
  sparsa_tensor tout = make_tensor(out, c.dtype, in.q_shape, dev);
  sparsa_tensor tstats = make_tensor(stats, SPARSA_DTYPE_I64, {SPARSA_STAT_COUNT}, dev);
  sparsa_tensor tcu_q, tcu_k, tlens;
  sparsa_attention_args args;
  sparsa_attention_args_init(&args, sizeof args);
  args.q = &tq;
  args.k = &tk;
  args.v = &tv;
  args.out = &tout;
  args.stats = &tstats;
  args.causal = 1;
  if (!in.cu_q.empty()) {
    tcu_q = make_tensor(place(in.cu_q.data(), in.cu_q.size() * 4), SPARSA_DTYPE_I32, {int64_t(in.cu_q.size())}, dev);
    args.cu_seqlens_q = &tcu_q;
  }
  if (!in.cu_k.empty()) {
    tcu_k = make_tensor(place(in.cu_k.data(), in.cu_k.size() * 4), SPARSA_DTYPE_I32, {int64_t(in.cu_k.size())}, dev);
    args.cu_seqlens_k = &tcu_k;
  }
  if (!in.seq_lens_k.empty()) {
    tlens = make_tensor(place(in.seq_lens_k.data(), in.seq_lens_k.size() * 4), SPARSA_DTYPE_I32,
                        {int64_t(in.seq_lens_k.size())}, dev);
    args.seq_lens_k = &tlens;
  }
  const sparsa_policy policy = make_policy(c);
  if (mode == Mode::kGpuGraph) {
    // Plan, capture one run, poison the outputs, replay: the replay alone must produce everything.
    result.status = sparsa_attention_plan(ctx, &args, &policy);
    ScopedGraph graph;
    ScopedGraphExec exec;
    if (result.status == SPARSA_STATUS_SUCCESS) {
      EXPECT_EQ(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal), cudaSuccess);
      result.status = sparsa_attention_run(ctx, &args, &policy);
      EXPECT_EQ(cudaStreamEndCapture(stream, graph.out()), cudaSuccess);
    }
    if (result.status == SPARSA_STATUS_SUCCESS) {
      EXPECT_EQ(cudaGraphInstantiate(exec.out(), graph.get(), 0), cudaSuccess);
      EXPECT_EQ(cudaMemset(out, 0xff, out_bytes), cudaSuccess);
      EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);  // the capture stream does not wait for the legacy stream
      EXPECT_EQ(cudaGraphLaunch(exec.get(), stream), cudaSuccess);
      EXPECT_EQ(cudaStreamSynchronize(stream), cudaSuccess);
    }
  } else {
    result.status = sparsa_attention_run(ctx, &args, &policy);
  }
  result.message = sparsa_last_error_message();
  if (result.status == SPARSA_STATUS_SUCCESS) {
    if (on_gpu) {
      EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
      EXPECT_EQ(cudaMemcpy(host_out.data(), out, out_bytes, cudaMemcpyDeviceToHost), cudaSuccess);
      EXPECT_EQ(cudaMemcpy(host_stats.data(), stats, host_stats.size() * 8, cudaMemcpyDeviceToHost), cudaSuccess);
    }
    result.out = decode(host_out, c.dtype);
    result.stats = host_stats;
  }
  return result;
}

double tolerance(int32_t dtype) {
  // GPU vs CPU: each side's own rounding, plus the base rows that the GPU corrects in out's dtype (the CPU stages
  // them in fp32): a few units in the last place of values of magnitude ~1.
  return dtype == SPARSA_DTYPE_F32 ? 4e-4 : dtype == SPARSA_DTYPE_F16 ? 8e-3 : 6e-2;
}

// Every written row of `got` within tolerance of `want` (NaN fails); returns the worst error.
void expect_close(const Case& c, const Inputs& in, const std::vector<float>& got, const std::vector<float>& want,
                  const char* what) {
  const size_t row = size_t(c.q_heads) * c.head_dim;
  double worst = 0;
  int64_t bad = 0;
  for (int32_t b = 0; b < in.batch; ++b) {
    for (int32_t i = 0; i < c.seq_q[b]; ++i) {
      const int64_t phys = c.q_layout == Layout::kPacked ? in.cu_q[b] + i : int64_t(b) * in.max_q + i;
      for (size_t x = 0; x < row; ++x) {
        const double err = std::fabs(double(got[phys * row + x]) - double(want[phys * row + x]));
        if (!(err <= tolerance(c.dtype))) ++bad;
        worst = std::max(worst, std::isnan(err) ? 1e30 : err);
      }
    }
  }
  EXPECT_EQ(bad, 0) << what << " " << c.name << ": max error " << worst << " (tol " << tolerance(c.dtype) << ")";
}

// Plan, capture one run, poison the outputs, replay: the replay alone writes every row, as the CPU backend does.
TEST(GpuDeltaRows, GraphCaptureReplayMatchesCpu) {
  if (!cuda_device_present()) GTEST_SKIP() << "no CUDA device/driver";
  Case c;
  c.name = "graph_bf16_d128";
  c.q_layout = Layout::kPacked;
  c.kv_layout = Layout::kPacked;
  c.seq_q = {400, 77};
  c.seq_k = {400, 100};
  c.gamma = 16;
  c.tail_min = 32;
  const Inputs in = make_inputs(c);
  const RunResult cpu = run_case(c, in, Mode::kCpu);
  ASSERT_EQ(cpu.status, SPARSA_STATUS_SUCCESS) << cpu.message;
  const RunResult graph = run_case(c, in, Mode::kGpuGraph);
  ASSERT_EQ(graph.status, SPARSA_STATUS_SUCCESS) << graph.message;
  expect_close(c, in, graph.out, cpu.out, "graph replay vs cpu");
}

}  // namespace
