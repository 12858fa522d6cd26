// §4 SPARGE's quantized (Sage) path on the CUDA backend, whose P·V precision depends on the device (FP8 e4m3 on
// sm_89+, fp16/bf16 below), and a CUDA-graph replay. The other SPARGE rows on smooth inputs run on every backend as
// the shared SpargeSmoothCases table (tests/test_attention_case_tables.cpp).
//
// GpuSparge compares the CUDA backend with the CPU backend (the project's oracle) on the same inputs: the predicted
// block mask (block_mask_out) must be equal, the stats equal, the outputs and LSE close (the Sage rows' FP8 P·V puts
// them outside the float64 reference's tolerances, hence here). Every GPU output is poisoned before the run (NaN for
// out/lse, 0xAB for the mask) so an unwritten element fails.
//
// Inputs are "smooth" (slow sinusoidal position features plus noise, periods a few blocks long): neighbouring
// tokens are alike, so blocks are self-similar and the prediction actually drops blocks; an optional sink direction
// makes key block 0 dominate (exercises the λ PV skip). Skips cleanly without a CUDA device.
#include <cuda_runtime.h>
#include <gtest/gtest.h>
#include <sparsa/sparsa.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <deque>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "gpu_test_util.h"

namespace {

using namespace sparsa_gpu_test;

constexpr double kTwoPi = 6.28318530717958647692;
constexpr uint8_t kMaskPoison = 0xAB;
constexpr double kPeriodBlocks = 4.0;  // slowest feature period, in max(block_q, block_k) units

struct Case {
  std::string name;
  int32_t dtype = SPARSA_DTYPE_F16;
  int32_t head_dim = 64;
  int32_t q_heads = 4, kv_heads = 2;
  std::vector<int32_t> seq_q{512}, seq_k{512};  // per sequence
  bool causal = true;
  bool packed = false;  // packed q/out and k/v with cu_seqlens (else padded, with seq_lens_k)
  int32_t block_q = 64, block_k = 64;
  float theta = 0.3f, tau = 0.9f, topk_fraction = 0.f, lambda = -INFINITY;
  bool quantized = false;
  double sink_strength = 0.0;  // > 0: key block 0 and every query share a strong direction
  double out_tol = 0.0;        // 0: by dtype
};

void PrintTo(const Case& c, std::ostream* os) { *os << c.name; }

// ---- FP8 P·V (§4 quantized path: V in e4m3 with per-channel scale on sm89+, fp16/bf16 otherwise) ----

constexpr double kFp8Max = 448.0;          // largest finite e4m3
constexpr double kFp8OutTolerance = 8e-2;  // max |gpu - cpu| / max(1, max |cpu|) of a Sage case with FP8 P·V
// rms(gpu - cpu) / rms(cpu) of a Sage case with FP8 P·V: e4m3 rounds P and V to 3 mantissa bits (~2.4 % rms
// each), and on zero-mean random V the output shrinks as fast as the averaged error does (measured: 2.9 %).
constexpr double kFp8RelativeRms = 5e-2;

// Which P·V the GPU's Sage path runs on this device: FP8 where the device (compute capability >= 8.9) runs an image
// built for sm_89+, which this build has for Hopper when its architectures include 90a (SPARSA_TEST_CUDA_ARCHS).
enum class PvPrecision { kFp8, kHalf, kEither };
PvPrecision expected_pv_precision() {
  int device = 0, major = 0, minor = 0;
  if (cudaGetDevice(&device) != cudaSuccess ||
      cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device) != cudaSuccess ||
      cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, device) != cudaSuccess) {
    (void)cudaGetLastError();
    return PvPrecision::kEither;
  }
  if (major * 10 + minor < 89) return PvPrecision::kHalf;
  const std::string archs = SPARSA_TEST_CUDA_ARCHS;
  if (major == 9 && archs.find("90a") != std::string::npos) return PvPrecision::kFp8;
  return PvPrecision::kEither;
}

// x rounded to the nearest e4m3 value (ties to even), saturated to ±448: what cvt.rn.satfinite.e4m3 gives.
double round_e4m3(double x) {
  constexpr int kMantissaBits = 3, kMinExponent = -6;  // normals from 2^-6; subnormal spacing 2^-9
  if (x == 0.0 || std::isnan(x)) return x;
  const double magnitude = std::fabs(x);
  const int exponent = std::max(kMinExponent, int(std::floor(std::log2(magnitude))));
  const double spacing = std::ldexp(1.0, exponent - kMantissaBits);
  const double rounded = std::min(kFp8Max, std::nearbyint(magnitude / spacing) * spacing);
  return std::copysign(rounded, x);
}

double out_tolerance(const Case& c) {
  if (c.quantized && expected_pv_precision() != PvPrecision::kHalf) return kFp8OutTolerance;
  if (c.out_tol > 0) return c.out_tol;
  return c.dtype == SPARSA_DTYPE_F32 ? 2e-4 : c.dtype == SPARSA_DTYPE_F16 ? 4e-3 : 3e-2;
}

struct Inputs {
  int32_t batch = 0, max_q = 0, max_k = 0;
  std::vector<float> q, k, v;  // logical padded [b][i][h][d]
};

Inputs make_inputs(const Case& c, std::mt19937_64& gen) {
  Inputs in;
  in.batch = int32_t(c.seq_q.size());
  in.max_q = *std::max_element(c.seq_q.begin(), c.seq_q.end());
  in.max_k = *std::max_element(c.seq_k.begin(), c.seq_k.end());
  const int D = c.head_dim;
  std::normal_distribution<double> normal(0.0, 1.0);
  constexpr int kFrequencies = 4;
  const double amplitude = std::sqrt(2.0 * D / kFrequencies);
  const double period = kPeriodBlocks * std::max(c.block_q, c.block_k);
  std::vector<double> sink(D);
  for (double& x : sink) x = normal(gen);
  double sink_norm = 0;
  for (double x : sink) sink_norm += x * x;
  sink_norm = std::sqrt(sink_norm);
  auto features = [&](float* x, double pos, bool with_sink) {
    for (int d = 0; d < D; ++d) x[d] = float(normal(gen));
    for (int f = 0; f < kFrequencies; ++f) {
      const double omega = kTwoPi / (period * (f + 1));
      x[2 * f] += float(amplitude * std::cos(omega * pos));
      x[2 * f + 1] += float(amplitude * std::sin(omega * pos));
    }
    if (with_sink)
      for (int d = 0; d < D; ++d) x[d] += float(c.sink_strength * sink[d] / sink_norm);
  };
  in.q.assign(size_t(in.batch) * in.max_q * c.q_heads * D, 0.f);
  in.k.assign(size_t(in.batch) * in.max_k * c.kv_heads * D, 0.f);
  in.v.assign(in.k.size(), 0.f);
  for (int b = 0; b < in.batch; ++b) {
    const int o = c.seq_k[b] - c.seq_q[b];
    for (int i = 0; i < c.seq_q[b]; ++i)
      for (int h = 0; h < c.q_heads; ++h)
        features(&in.q[((size_t(b) * in.max_q + i) * c.q_heads + h) * D], i + o, c.sink_strength > 0);
    for (int j = 0; j < c.seq_k[b]; ++j)
      for (int h = 0; h < c.kv_heads; ++h)
        features(&in.k[((size_t(b) * in.max_k + j) * c.kv_heads + h) * D], j, c.sink_strength > 0 && j < c.block_k);
  }
  for (float& x : in.v) x = float(normal(gen));
  return in;
}

struct Physical {
  std::vector<uint8_t> q, k, v;
  std::vector<int32_t> cu_q, cu_k, seq_lens_k;
  std::vector<int64_t> q_shape, kv_shape, lse_shape;
  int64_t q_rows = 0;
};

Physical build_physical(const Case& c, const Inputs& in) {
  Physical ph;
  const size_t q_row = size_t(c.q_heads) * c.head_dim, kv_row = size_t(c.kv_heads) * c.head_dim;
  std::vector<float> q, k, v;
  if (c.packed) {
    ph.cu_q = {0};
    ph.cu_k = {0};
    for (int b = 0; b < in.batch; ++b) {
      for (int i = 0; i < c.seq_q[b]; ++i) {
        const float* row = &in.q[(size_t(b) * in.max_q + i) * q_row];
        q.insert(q.end(), row, row + q_row);
      }
      for (int j = 0; j < c.seq_k[b]; ++j) {
        const size_t at = (size_t(b) * in.max_k + j) * kv_row;
        k.insert(k.end(), in.k.begin() + at, in.k.begin() + at + kv_row);
        v.insert(v.end(), in.v.begin() + at, in.v.begin() + at + kv_row);
      }
      ph.cu_q.push_back(ph.cu_q.back() + c.seq_q[b]);
      ph.cu_k.push_back(ph.cu_k.back() + c.seq_k[b]);
    }
    ph.q_rows = ph.cu_q.back();
    ph.q_shape = {ph.q_rows, c.q_heads, c.head_dim};
    ph.kv_shape = {ph.cu_k.back(), c.kv_heads, c.head_dim};
    ph.lse_shape = {c.q_heads, ph.q_rows};
  } else {
    q = in.q;
    k = in.k;
    v = in.v;
    ph.q_rows = int64_t(in.batch) * in.max_q;
    ph.q_shape = {in.batch, in.max_q, c.q_heads, c.head_dim};
    ph.kv_shape = {in.batch, in.max_k, c.kv_heads, c.head_dim};
    ph.lse_shape = {in.batch, c.q_heads, in.max_q};
    ph.seq_lens_k.assign(c.seq_k.begin(), c.seq_k.end());
  }
  ph.q = encode(q, c.dtype);
  ph.k = encode(k, c.dtype);
  ph.v = encode(v, c.dtype);
  return ph;
}

struct RunResult {
  sparsa_status status = SPARSA_STATUS_INTERNAL;
  std::string message;
  std::vector<float> out, lse;
  std::vector<uint8_t> mask;
  std::vector<int64_t> stats;
};

constexpr int kStats = SPARSA_STAT_PV_BLOCKS_SKIPPED + 1;

// Runs the case through the C API on the CPU (host memory) or the CUDA backend (device copies, poisoned outputs).
// `stream` (CUDA only) is given to the context; `capture` replays the run from a CUDA graph instead (after a plan).
RunResult run_case(const Case& c, const Inputs& in, const Physical& ph, bool on_gpu, bool capture = false) {
  RunResult result;
  sparsa_context_options options;
  sparsa_context_options_init(&options, sizeof options);
  options.device_type = on_gpu ? SPARSA_DEVICE_CUDA : SPARSA_DEVICE_CPU;
  ScopedStream owned_stream;
  if (capture) {
    EXPECT_EQ(cudaStreamCreate(owned_stream.out()), cudaSuccess);
  }
  const cudaStream_t stream = owned_stream.get();
  options.stream = stream;
  ScopedContext context(options);
  result.status = context.status();
  sparsa_context* const ctx = context.get();
  if (result.status != SPARSA_STATUS_SUCCESS) {
    result.message = sparsa_last_error_message();
    return result;
  }
  const int32_t dev = on_gpu ? SPARSA_DEVICE_CUDA : SPARSA_DEVICE_CPU;
  const int64_t q_blocks = (in.max_q + c.block_q - 1) / c.block_q, k_blocks = (in.max_k + c.block_k - 1) / c.block_k;
  const size_t out_bytes = size_t(ph.q_rows) * c.q_heads * c.head_dim * element_bytes(c.dtype);
  const size_t lse_count = size_t(ph.q_rows) * c.q_heads;
  const size_t mask_count = size_t(in.batch) * c.q_heads * q_blocks * k_blocks;
  std::vector<uint8_t> host_out(out_bytes, 0xff);  // NaN in every dtype
  std::vector<float> host_lse(lse_count, std::numeric_limits<float>::quiet_NaN());
  std::vector<uint8_t> host_mask(mask_count, kMaskPoison);
  std::vector<int64_t> host_stats(kStats, -1);
  std::deque<DeviceBuffer> buffers;
  auto place = [&](void* host, size_t bytes) -> void* {
    if (!on_gpu) return host;
    buffers.emplace_back(bytes);
    buffers.back().upload(host);
    return buffers.back().data();
  };
  std::vector<uint8_t> q = ph.q, k = ph.k, v = ph.v;
  sparsa_tensor tq = make_tensor(place(q.data(), q.size()), c.dtype, ph.q_shape, dev);
  sparsa_tensor tk = make_tensor(place(k.data(), k.size()), c.dtype, ph.kv_shape, dev);
  sparsa_tensor tv = make_tensor(place(v.data(), v.size()), c.dtype, ph.kv_shape, dev);
  void* out = place(host_out.data(), out_bytes);
  void* lse = place(host_lse.data(), lse_count * 4);
  void* mask = place(host_mask.data(), mask_count);
  void* stats = place(host_stats.data(), kStats * 8);
  sparsa_tensor tout = make_tensor(out, c.dtype, ph.q_shape, dev);
  sparsa_tensor tlse = make_tensor(lse, SPARSA_DTYPE_F32, ph.lse_shape, dev);
  sparsa_tensor tmask = make_tensor(mask, SPARSA_DTYPE_U8, {in.batch, c.q_heads, q_blocks, k_blocks}, dev);
  sparsa_tensor tstats = make_tensor(stats, SPARSA_DTYPE_I64, {kStats}, dev);
  sparsa_attention_args args;
  sparsa_attention_args_init(&args, sizeof args);
  args.q = &tq;
  args.k = &tk;
  args.v = &tv;
  args.out = &tout;
  args.lse = &tlse;
  args.causal = c.causal ? 1 : 0;
  args.block_mask_out = &tmask;
  args.stats = &tstats;
  std::vector<int32_t> cu_q = ph.cu_q, cu_k = ph.cu_k, lens = ph.seq_lens_k;
  sparsa_tensor tcu_q, tcu_k, tlens;
  if (!cu_q.empty()) {
    tcu_q = make_tensor(place(cu_q.data(), cu_q.size() * 4), SPARSA_DTYPE_I32, {int64_t(cu_q.size())}, dev);
    tcu_k = make_tensor(place(cu_k.data(), cu_k.size() * 4), SPARSA_DTYPE_I32, {int64_t(cu_k.size())}, dev);
    args.cu_seqlens_q = &tcu_q;
    args.cu_seqlens_k = &tcu_k;
  }
  if (!lens.empty()) {
    tlens = make_tensor(place(lens.data(), lens.size() * 4), SPARSA_DTYPE_I32, {int64_t(lens.size())}, dev);
    args.seq_lens_k = &tlens;
  }
  sparsa_policy policy;
  sparsa_policy_init(&policy, sizeof policy, SPARSA_POLICY_SPARGE);
  policy.block_q = c.block_q;
  policy.block_k = c.block_k;
  policy.sparge_theta = c.theta;
  policy.sparge_tau = c.tau;
  policy.sparge_topk_fraction = c.topk_fraction;
  policy.sparge_lambda = c.lambda;
  policy.sparge_quantized = c.quantized ? 1 : 0;

  if (capture) {
    result.status = sparsa_attention_plan(ctx, &args, &policy);
    if (result.status == SPARSA_STATUS_SUCCESS) {
      ScopedGraph graph;
      ScopedGraphExec exec;
      EXPECT_EQ(cudaStreamBeginCapture(stream, cudaStreamCaptureModeGlobal), cudaSuccess);
      result.status = sparsa_attention_run(ctx, &args, &policy);
      EXPECT_EQ(cudaStreamEndCapture(stream, graph.out()), cudaSuccess);
      if (result.status == SPARSA_STATUS_SUCCESS && graph.get() != nullptr) {
        EXPECT_EQ(cudaGraphInstantiate(exec.out(), graph.get(), 0), cudaSuccess);
        for (int replay = 0; replay < 2; ++replay) {
          EXPECT_EQ(cudaMemset(out, 0xff, out_bytes), cudaSuccess);  // each replay must write everything again
          EXPECT_EQ(cudaMemset(mask, kMaskPoison, mask_count), cudaSuccess);
          EXPECT_EQ(cudaGraphLaunch(exec.get(), stream), cudaSuccess);
          EXPECT_EQ(cudaStreamSynchronize(stream), cudaSuccess);
        }
      }
    }
  } else {
    result.status = sparsa_attention_run(ctx, &args, &policy);
  }
  result.message = sparsa_last_error_message();
  if (result.status == SPARSA_STATUS_SUCCESS && on_gpu) {
    EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    buffers[3].download(host_out.data());
    buffers[4].download(host_lse.data());
    buffers[5].download(host_mask.data());
    buffers[6].download(host_stats.data());
  }
  if (result.status == SPARSA_STATUS_SUCCESS) {
    result.out = decode(host_out, c.dtype);
    result.lse = host_lse;
    result.mask = host_mask;
    result.stats = host_stats;
  }
  return result;
}

// Compares the GPU run with the CPU run: mask and stats exactly, outputs and LSE of the written rows closely.
void expect_gpu_matches_cpu(const Case& c, const Inputs& in, const Physical& ph, const RunResult& cpu,
                            const RunResult& gpu) {
  const int64_t q_blocks = (in.max_q + c.block_q - 1) / c.block_q, k_blocks = (in.max_k + c.block_k - 1) / c.block_k;
  int64_t mask_diffs = 0, ones = 0;
  for (size_t i = 0; i < cpu.mask.size(); ++i) {
    mask_diffs += cpu.mask[i] != gpu.mask[i] ? 1 : 0;
    ones += cpu.mask[i];
  }
  EXPECT_EQ(mask_diffs, 0) << "block_mask_out differs in " << mask_diffs << " of " << cpu.mask.size() << " cells";
  EXPECT_LT(ones, int64_t(cpu.mask.size())) << "the prediction kept every block (input not structured enough)";
  for (int s = 0; s < kStats; ++s) EXPECT_EQ(gpu.stats[s], cpu.stats[s]) << "stat " << s;

  const int D = c.head_dim, Hq = c.q_heads;
  double worst = 0, worst_lse = 0, reference_max = 0, error_squares = 0, reference_squares = 0;
  int64_t lse_bad = 0, nan_rows = 0;
  for (int b = 0; b < in.batch; ++b)
    for (int i = 0; i < c.seq_q[b]; ++i) {
      const int64_t row = c.packed ? ph.cu_q[b] + i : int64_t(b) * in.max_q + i;
      for (int h = 0; h < Hq; ++h) {
        for (int d = 0; d < D; ++d) {
          const size_t e = (size_t(row) * Hq + h) * D + d;
          reference_max = std::max(reference_max, double(std::fabs(cpu.out[e])));
          const double err = std::fabs(double(gpu.out[e]) - cpu.out[e]);
          error_squares += std::isnan(err) ? 0.0 : err * err;
          reference_squares += double(cpu.out[e]) * cpu.out[e];
          if (std::isnan(err)) ++nan_rows;
          worst = std::max(worst, std::isnan(err) ? 1e30 : err);
        }
        const size_t l = c.packed ? size_t(h) * ph.q_rows + row : (size_t(b) * Hq + h) * in.max_q + i;
        const double want = cpu.lse[l], got = gpu.lse[l];
        if (std::isinf(want)) {
          lse_bad += (std::isinf(got) && got < 0) ? 0 : 1;
        } else {
          const double err = std::fabs(got - want);
          lse_bad += err <= 2e-3 * std::max(1.0, std::fabs(want)) ? 0 : 1;
          worst_lse = std::max(worst_lse, std::isnan(err) ? 1e30 : err);
        }
      }
    }
  EXPECT_EQ(nan_rows, 0) << "unwritten (NaN) output elements";
  EXPECT_LE(worst, out_tolerance(c) * std::max(1.0, reference_max))
      << "max |gpu - cpu| (|cpu| <= " << reference_max << ")";
  const double relative_rms = std::sqrt(error_squares / std::max(reference_squares, 1e-300));
  if (c.quantized) {
    std::printf("[ sage ] %s: max |gpu - cpu| %.3g (|cpu| <= %.3g), relative rms %.3g\n", c.name.c_str(), worst,
                reference_max, relative_rms);
    if (expected_pv_precision() != PvPrecision::kHalf) {
      EXPECT_LE(relative_rms, kFp8RelativeRms);
    }
  }
  EXPECT_EQ(lse_bad, 0) << "LSE mismatches; max |gpu - cpu| = " << worst_lse;
  (void)q_blocks;
  (void)k_blocks;
}

class GpuSparge : public ::testing::TestWithParam<Case> {};

TEST_P(GpuSparge, MatchesCpuBackend) {
  const bool gpu_present = cuda_device_present();
  if (!gpu_present && !cpu_selfcheck_requested()) GTEST_SKIP() << "no CUDA device/driver";
  const Case& c = GetParam();
  std::mt19937_64 gen(20261121);
  const Inputs in = make_inputs(c, gen);
  const Physical ph = build_physical(c, in);
  const RunResult cpu = run_case(c, in, ph, /*on_gpu=*/false);
  ASSERT_EQ(cpu.status, SPARSA_STATUS_SUCCESS) << "CPU backend: " << cpu.message;
  if (!gpu_present) {
    int64_t ones = 0;
    for (uint8_t m : cpu.mask) ones += m;
    EXPECT_LT(ones, int64_t(cpu.mask.size())) << "the prediction kept every block";
    std::printf("[ selfcheck ] %s: density %.3f, pv skipped %lld, blocks %lld/%lld\n", c.name.c_str(),
                double(ones) / double(cpu.mask.size()), (long long)cpu.stats[SPARSA_STAT_PV_BLOCKS_SKIPPED],
                (long long)cpu.stats[SPARSA_STAT_BLOCKS_COMPUTED], (long long)cpu.stats[SPARSA_STAT_BLOCKS_TOTAL]);
    return;
  }
  const RunResult gpu = run_case(c, in, ph, /*on_gpu=*/true);
  if (gpu.status == SPARSA_STATUS_UNSUPPORTED) GTEST_SKIP() << "unsupported on this build: " << gpu.message;
  ASSERT_EQ(gpu.status, SPARSA_STATUS_SUCCESS) << gpu.message;
  expect_gpu_matches_cpu(c, in, ph, cpu, gpu);
}

std::vector<Case> cases() {
  std::vector<Case> list;
  // Quantized (Sage): the CPU emulation keeps V in fp32; the GPU's P·V runs in FP8 or fp16/bf16 (PvPrecision).
  Case c;
  c.name = "sage_f32_d64_small_blocks";
  c.dtype = SPARSA_DTYPE_F32;
  c.seq_q = {256};
  c.seq_k = {256};
  c.block_q = 32;
  c.block_k = 16;
  c.quantized = true;
  c.out_tol = 5e-3;
  list.push_back(c);

  c = Case{};
  c.name = "sage_bf16_d128_causal_gqa4_varlen";
  c.dtype = SPARSA_DTYPE_BF16;
  c.head_dim = 128;
  c.q_heads = 8;
  c.kv_heads = 2;
  c.packed = true;
  c.seq_q = {500, 1300};
  c.seq_k = {600, 1300};
  c.block_q = 128;
  c.block_k = 64;
  c.quantized = true;
  list.push_back(c);

  c = Case{};
  c.name = "sage_f16_d128_pv_skip_bq128";
  c.head_dim = 128;
  c.seq_q = {2048};
  c.seq_k = {2048};
  c.block_q = 128;
  c.block_k = 64;
  c.topk_fraction = 0.5f;
  c.lambda = -4.f;
  c.sink_strength = 14.0;
  c.quantized = true;
  list.push_back(c);
  return list;
}

INSTANTIATE_TEST_SUITE_P(Cases, GpuSparge, ::testing::ValuesIn(cases()),
                         [](const ::testing::TestParamInfo<Case>& info) { return info.param.name; });

// §4 quantized path, "V in fp8 e4m3 with per-channel scale on sm89+, fp16/bf16 otherwise". Each query row is a
// multiple of one "needle" key, so its softmax puts weight ~1 (others < e^-30) on that key and its output is the
// needle's V row as the P·V product stores it: e4m3(V / scale_c) · scale_c with scale_c = max_j |V[j, c]| / 448
// under FP8, V itself under fp16. The needles cover every position of the 32-key steps (a wrong key order in the
// transposed V^T copy returns another key's row) and the channels have different ranges (a per-tensor scale loses
// the small channels). Non-causal, GQA 2, key count not a multiple of the tile, two sequences of different lengths.
// Under SPARSA_GPU_TESTS_SELFCHECK=1 without a device it runs the CPU backend, which keeps V unquantized (checks the
// references and the needles themselves).
TEST(GpuSpargeSage, PvPrecisionFollowsDevice) {
  const bool on_gpu = cuda_device_present();
  if (!on_gpu && !cpu_selfcheck_requested()) GTEST_SKIP() << "no CUDA device/driver";
  Case c;
  c.name = "sage_needles";
  c.dtype = SPARSA_DTYPE_F16;
  c.head_dim = 128;
  c.q_heads = 4;
  c.kv_heads = 2;
  c.seq_q = {256, 130};
  c.seq_k = {1000, 611};
  c.causal = false;
  c.block_q = 128;
  c.block_k = 64;
  c.topk_fraction = 1.f;  // every block: this test is about P·V, not the mask
  c.quantized = true;
  constexpr double kNeedleGain = 4.0;  // q = gain·k_needle: a score gap of ~30 nats over the other keys
  const int D = c.head_dim, group = c.q_heads / c.kv_heads;
  Inputs in;
  in.batch = 2;
  in.max_q = 256;
  in.max_k = 1000;
  std::mt19937_64 gen(20261122);
  std::normal_distribution<float> normal(0.f, 1.f);
  in.k.assign(size_t(in.batch) * in.max_k * c.kv_heads * D, 0.f);
  in.v.assign(in.k.size(), 0.f);
  in.q.assign(size_t(in.batch) * in.max_q * c.q_heads * D, 0.f);
  for (size_t e = 0; e < in.k.size(); ++e) {
    in.k[e] = normal(gen);
    in.v[e] = normal(gen) * float(1 + (e % D) % 5);  // channel ranges 1x..5x
  }
  (void)encode_rounded(in.k, c.dtype);
  (void)encode_rounded(in.v, c.dtype);
  auto needle_of = [&](int b, int i, int h) { return (i * 37 + h * 11 + b * 5) % c.seq_k[b]; };
  for (int b = 0; b < in.batch; ++b)
    for (int i = 0; i < c.seq_q[b]; ++i)
      for (int h = 0; h < c.q_heads; ++h) {
        const float* key = &in.k[((size_t(b) * in.max_k + needle_of(b, i, h)) * c.kv_heads + h / group) * D];
        float* query = &in.q[((size_t(b) * in.max_q + i) * c.q_heads + h) * D];
        for (int d = 0; d < D; ++d) query[d] = float(kNeedleGain) * key[d];
      }
  (void)encode_rounded(in.q, c.dtype);
  const Physical ph = build_physical(c, in);
  const RunResult gpu = run_case(c, in, ph, on_gpu);
  if (gpu.status == SPARSA_STATUS_UNSUPPORTED) GTEST_SKIP() << gpu.message;
  ASSERT_EQ(gpu.status, SPARSA_STATUS_SUCCESS) << gpu.message;

  // Float64 references: softmax over every key, with V as is and with V through e4m3 (per channel of each
  // sequence and kv head; the scale and the division in float, as the device computes them).
  const double scale = 1.0 / std::sqrt(double(D));
  double fp8_squares = 0, half_squares = 0, gap_squares = 0, fp8_worst = 0, value_max = 0;
  int64_t nan_count = 0;
  for (int b = 0; b < in.batch; ++b)
    for (int hk = 0; hk < c.kv_heads; ++hk) {
      std::vector<float> channel_scale(D, 0.f);
      for (int j = 0; j < c.seq_k[b]; ++j)
        for (int d = 0; d < D; ++d) {
          const float x = std::fabs(in.v[((size_t(b) * in.max_k + j) * c.kv_heads + hk) * D + d]);
          channel_scale[d] = std::max(channel_scale[d], x);
          value_max = std::max(value_max, double(x));
        }
      for (float& x : channel_scale) x = x > 0.f ? x / float(kFp8Max) : 1.f;
      for (int h = hk * group; h < (hk + 1) * group; ++h)
        for (int i = 0; i < c.seq_q[b]; ++i) {
          const float* q = &in.q[((size_t(b) * in.max_q + i) * c.q_heads + h) * D];
          std::vector<double> weight(c.seq_k[b]);
          double top = -INFINITY, sum = 0;
          for (int j = 0; j < c.seq_k[b]; ++j) {
            const float* k = &in.k[((size_t(b) * in.max_k + j) * c.kv_heads + hk) * D];
            double dot = 0;
            for (int d = 0; d < D; ++d) dot += double(q[d]) * k[d];
            weight[j] = dot * scale;
            top = std::max(top, weight[j]);
          }
          for (double& w : weight) sum += (w = std::exp(w - top));
          const int64_t row = int64_t(b) * in.max_q + i;
          for (int d = 0; d < D; ++d) {
            double plain = 0, fp8 = 0;
            for (int j = 0; j < c.seq_k[b]; ++j) {
              const float x = in.v[((size_t(b) * in.max_k + j) * c.kv_heads + hk) * D + d];
              plain += weight[j] * x;
              fp8 += weight[j] * round_e4m3(double(x / channel_scale[d])) * channel_scale[d];
            }
            plain /= sum;
            fp8 /= sum;
            const double got = gpu.out[(size_t(row) * c.q_heads + h) * D + d];
            if (std::isnan(got)) ++nan_count;
            fp8_squares += (got - fp8) * (got - fp8);
            half_squares += (got - plain) * (got - plain);
            gap_squares += (fp8 - plain) * (fp8 - plain);
            fp8_worst = std::max(fp8_worst, std::fabs(got - fp8));
          }
        }
    }
  EXPECT_EQ(nan_count, 0) << "unwritten (NaN) output elements";
  const double fp8_rms = std::sqrt(fp8_squares), half_rms = std::sqrt(half_squares), gap = std::sqrt(gap_squares);
  std::printf(
      "[ sage ] needles: |out - fp8 ref| %.3g, |out - fp16 ref| %.3g, |fp8 ref - fp16 ref| %.3g (root of summed "
      "squares); max |out - fp8 ref| %.3g\n",
      fp8_rms, half_rms, gap, fp8_worst);
  ASSERT_GT(gap, 0.0);
  constexpr double kDistinct = 0.1;  // the run must sit this much closer to one reference than their distance
  switch (on_gpu ? expected_pv_precision() : PvPrecision::kHalf) {
    case PvPrecision::kFp8:
      EXPECT_LE(fp8_rms, kDistinct * gap) << "expected FP8 P·V on this device";
      EXPECT_LE(fp8_worst, 1e-2 * value_max);
      break;
    case PvPrecision::kHalf:
      EXPECT_LE(half_rms, kDistinct * gap) << "expected fp16 P·V on this device";
      break;
    case PvPrecision::kEither:
      EXPECT_LE(std::min(fp8_rms, half_rms), kDistinct * gap);
      break;
  }
}

// The same run twice gives the same bits (every reduction has a fixed order), and a CUDA-graph replay of a
// planned run gives them too.
TEST(GpuSpargeRuns, DeterministicAndGraphReplay) {
  SKIP_WITHOUT_GPU();
  Case c;
  c.name = "replay";
  c.dtype = SPARSA_DTYPE_BF16;
  c.head_dim = 128;
  c.seq_q = {1500};
  c.seq_k = {1500};
  c.block_q = 128;
  c.block_k = 64;
  std::mt19937_64 gen(7);
  const Inputs in = make_inputs(c, gen);
  const Physical ph = build_physical(c, in);
  const RunResult first = run_case(c, in, ph, true);
  if (first.status == SPARSA_STATUS_UNSUPPORTED) GTEST_SKIP() << first.message;
  ASSERT_EQ(first.status, SPARSA_STATUS_SUCCESS) << first.message;
  const RunResult second = run_case(c, in, ph, true);
  ASSERT_EQ(second.status, SPARSA_STATUS_SUCCESS) << second.message;
  EXPECT_EQ(first.mask, second.mask);
  EXPECT_EQ(std::memcmp(first.out.data(), second.out.data(), first.out.size() * 4), 0) << "outputs differ";
  const RunResult replay = run_case(c, in, ph, true, /*capture=*/true);
  ASSERT_EQ(replay.status, SPARSA_STATUS_SUCCESS) << replay.message;
  EXPECT_EQ(first.mask, replay.mask);
  EXPECT_EQ(std::memcmp(first.out.data(), replay.out.data(), first.out.size() * 4), 0) << "graph replay differs";
}

}  // namespace
