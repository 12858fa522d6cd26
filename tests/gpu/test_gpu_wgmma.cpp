// Hopper wgmma forward (backends/gpu/kernels/forward_wgmma.cu) via the public C API: fp16/bf16, head_dim 64/128
// take that kernel on an sm_90 device (forward_dispatch.cu tries it before mma.sync). Its attention cases (tiles,
// ring, causal alignments, GQA, layouts, masks, sink/window, large scores, Δ's row map) are rows of the case table
// WgmmaCases (tests/test_attention_case_tables.cpp). Here: TOKEN_SPARSE's query-row map (§5: queries and keys
// gathered through per-head position lists, outputs scattered), checked against the CPU backend; and GpuWgmmaSparge,
// SPARGE's predicted mask in its default cells, which the kernel walks as gathered 64-key halves (forward_wgmma.h:
// wgmma_gathers_mask_cells; the caller's block masks walked so are the rows of MaskCellCases), against the float64
// reference (tests/reference, through attention_case.h) and the CPU backend. Outputs are poisoned with NaN first.
// Skips cleanly without a CUDA device (on pre-Hopper devices the same cases exercise the mma.sync kernel).
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

#include "attention_case.h"
#include "gpu_test_util.h"

namespace {

using namespace sparsa_gpu_test;

class GpuWgmma : public ::testing::TestWithParam<Case> {};

// GPU vs CPU backend on every element the CPU wrote (padding rows past a sequence end stay NaN in both and are not
// outputs): NaN on the GPU where the CPU has a value counts as a mismatch; LSE likewise when requested.
void expect_matches_cpu(const Case& c, const RunResult& gpu, const RunResult& cpu) {
  const double tol = 2 * tolerance(c.dtype);
  double worst = 0;
  int64_t bad = 0, compared = 0;
  for (size_t i = 0; i < gpu.out.size(); ++i) {
    if (std::isnan(cpu.out[i])) continue;
    ++compared;
    const double err = std::fabs(double(gpu.out[i]) - cpu.out[i]);
    if (!(err <= tol)) ++bad;
    worst = std::max(worst, std::isnan(err) ? 1e30 : err);
  }
  int64_t bad_lse = 0;
  if (c.lse) {
    for (size_t i = 0; i < gpu.lse.size(); ++i) {
      if (std::isnan(cpu.lse[i])) continue;
      if (std::isinf(cpu.lse[i])) {
        bad_lse += !(std::isinf(gpu.lse[i]) && gpu.lse[i] < 0);
      } else {
        bad_lse += !(std::fabs(double(gpu.lse[i]) - cpu.lse[i]) <= 1e-3 + 1e-4 * std::fabs(cpu.lse[i]));
      }
    }
  }
  EXPECT_GT(compared, 0) << c.name;
  EXPECT_EQ(bad, 0) << "cuda vs cpu " << c.name << ": max |out - cpu| = " << worst << " (tol " << tol << ")";
  EXPECT_EQ(bad_lse, 0) << "cuda vs cpu " << c.name << ": lse";
}

TEST_P(GpuWgmma, MatchesReferenceAndCpuBackend) {
  const bool gpu_present = cuda_device_present();
  if (!gpu_present && !cpu_selfcheck_requested()) GTEST_SKIP() << "no CUDA device/driver";
  const Case& c = GetParam();
  if (c.cpu_oracle_only()) {
    std::mt19937 rng(4321);
    Inputs in = make_inputs(c, rng);
    Physical ph = build_physical(c, in, rng);
    const RunResult cpu = run_case(c, in, ph, /*on_gpu=*/false);
    ASSERT_EQ(cpu.status, SPARSA_STATUS_SUCCESS) << "CPU backend failed on " << c.name << ": " << cpu.message;
    if (c.policy == SPARSA_POLICY_TOKEN_SPARSE) {  // the lists must really drop rows (not the dense fallback)
      int64_t dropped = 0;
      for (size_t row = 0; row * c.head_dim < cpu.out.size(); ++row) {
        const auto first = cpu.out.begin() + int64_t(row * c.head_dim);
        dropped += std::all_of(first, first + c.head_dim, [](float x) { return x == 0.f; });
      }
      EXPECT_GT(dropped, 0) << c.name << ": no row dropped";
    }
    if (!gpu_present) return;
    const RunResult gpu = run_case(c, in, ph, /*on_gpu=*/true);
    if (c.policy == SPARSA_POLICY_TOKEN_SPARSE && gpu.status == SPARSA_STATUS_UNSUPPORTED) {
      GTEST_SKIP() << "this build's CUDA backend has no TOKEN_SPARSE: " << gpu.message;
    }
    ASSERT_EQ(gpu.status, SPARSA_STATUS_SUCCESS) << gpu.message;
    expect_matches_cpu(c, gpu, cpu);
    return;
  }
  expect_matches_reference_and_cpu(c, gpu_present);
}

// The query-row map of TOKEN_SPARSE's list attention (kTokenLists) on the wgmma kernel. (Δ's dense pass, kDeltaRows,
// is a row of the case table: WgmmaCases in tests/test_attention_case_tables.cpp.)
std::vector<Case> row_map_cases() {
  std::vector<Case> list;
  auto add = [&](Case c) { list.push_back(c); };
  Case c;
  // TOKEN_SPARSE above the dense-fallback threshold (L > min_tokens + W): the list attention gathers q and k/v
  // rows through each head's position list (causal in list order) and scatters its rows; dropped rows are 0.
  c.name = "token_sparse_bf16_d128_gqa2";
  c.dtype = SPARSA_DTYPE_BF16;
  c.head_dim = 128;
  c.q_heads = 4;
  c.kv_heads = 2;
  c.policy = SPARSA_POLICY_TOKEN_SPARSE;
  c.ts_window = 64;
  c.ts_min_tokens = 200;
  c.ts_coverage = 0.3f;
  c.seq_q = {1000};
  c.seq_k = {1000};
  c.causal = true;
  add(c);
  c.name = "token_sparse_bf16_d64_varlen";
  c.head_dim = 64;
  c.q_heads = 4;
  c.kv_heads = 4;
  c.q_layout = Layout::kPacked;
  c.kv_layout = Layout::kPacked;
  c.ts_min_tokens = 150;
  c.ts_coverage = 0.5f;
  c.seq_q = {700, 230, 1200};  // the middle one is just above the threshold (150 + 64 = 214)
  c.seq_k = {700, 230, 1200};
  add(c);
  c.name = "token_sparse_bf16_d128_paged";
  c.head_dim = 128;
  c.q_heads = 2;
  c.kv_heads = 1;
  c.kv_layout = Layout::kPaged;
  c.page_size = 16;
  c.ts_min_tokens = 256;
  c.ts_coverage = 1.f;  // budget = min_tokens: 320 of 900 rows kept
  c.seq_q = {900};
  c.seq_k = {900};
  add(c);
  return list;
}

INSTANTIATE_TEST_SUITE_P(RowMaps, GpuWgmma, ::testing::ValuesIn(row_map_cases()),
                         [](const ::testing::TestParamInfo<Case>& info) { return info.param.name; });


// SPARGE (§4) with its default cells (block_q 128 × block_k 64) and no λ: the predicted mask is walked as gathered
// halves by the wgmma kernel. θ = -1 makes every block self-similar (none forced), so the top-k fraction drops
// cells. Checked against the CPU backend on the same inputs: the predicted mask exactly, out and LSE closely.
struct SpargeResult {
  sparsa_status status = SPARSA_STATUS_INTERNAL;
  std::string message;
  std::vector<float> out, lse;
  std::vector<uint8_t> mask;
};

constexpr int32_t kSpargeBlockQ = 128, kSpargeBlockK = 64;
constexpr float kSpargeTopk = 0.3f;
constexpr uint8_t kMaskPoison = 0xAB;

SpargeResult run_sparge(const Case& c, const Inputs& in, const Physical& ph, bool on_gpu) {
  SpargeResult result;
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
  const int64_t q_blocks = (in.max_q + kSpargeBlockQ - 1) / kSpargeBlockQ;
  const int64_t k_blocks = (in.max_k + kSpargeBlockK - 1) / kSpargeBlockK;
  const size_t out_bytes = size_t(ph.q_rows) * c.q_heads * c.head_dim * element_bytes(c.dtype);
  const size_t lse_count = size_t(ph.q_rows) * c.q_heads;
  const size_t mask_count = size_t(in.batch) * c.q_heads * q_blocks * k_blocks;
  std::vector<uint8_t> host_out(out_bytes, 0xff);  // NaN in f16/bf16
  std::vector<float> host_lse(lse_count, std::numeric_limits<float>::quiet_NaN());
  std::vector<uint8_t> host_mask(mask_count, kMaskPoison);
  std::deque<DeviceBuffer> buffers;
  auto place = [&](const void* host, size_t bytes) -> void* {
    if (!on_gpu) return const_cast<void*>(host);
    buffers.emplace_back(bytes);
    buffers.back().upload(host, bytes);
    return buffers.back().data();
  };
  void* q = place(ph.q.data(), ph.q.size());
  void* k = place(ph.k.data(), ph.k.size());
  void* v = place(ph.v.data(), ph.v.size());
  void* out = place(host_out.data(), out_bytes);
  void* lse = place(host_lse.data(), lse_count * 4);
  void* mask = place(host_mask.data(), mask_count);
  sparsa_tensor tq = make_tensor(q, c.dtype, ph.q_shape, dev), tk = make_tensor(k, c.dtype, ph.kv_shape, dev),
                tv = make_tensor(v, c.dtype, ph.kv_shape, dev), tout = make_tensor(out, c.dtype, ph.out_shape, dev),
                tlse = make_tensor(lse, SPARSA_DTYPE_F32, ph.lse_shape, dev),
                tmask = make_tensor(mask, SPARSA_DTYPE_U8, {in.batch, c.q_heads, q_blocks, k_blocks}, dev), tlens;
  sparsa_attention_args args;
  sparsa_attention_args_init(&args, sizeof args);
  args.q = &tq;
  args.k = &tk;
  args.v = &tv;
  args.out = &tout;
  args.lse = &tlse;
  args.block_mask_out = &tmask;
  args.causal = c.causal ? 1 : 0;
  if (!ph.seq_lens_k.empty()) {
    tlens = make_tensor(place(ph.seq_lens_k.data(), ph.seq_lens_k.size() * 4), SPARSA_DTYPE_I32,
                        {int64_t(ph.seq_lens_k.size())}, dev);
    args.seq_lens_k = &tlens;
  }
  sparsa_policy policy;
  sparsa_policy_init(&policy, sizeof policy, SPARSA_POLICY_SPARGE);
  policy.block_q = kSpargeBlockQ;
  policy.block_k = kSpargeBlockK;
  policy.sparge_theta = -1.f;
  policy.sparge_topk_fraction = kSpargeTopk;
  result.status = sparsa_attention_run(ctx, &args, &policy);
  result.message = sparsa_last_error_message();
  if (result.status == SPARSA_STATUS_SUCCESS) {
    if (on_gpu) {
      EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
      result.out = decode(buffers[3].download<uint8_t>(out_bytes), c.dtype);
      result.lse = buffers[4].download<float>(lse_count);
      result.mask = buffers[5].download<uint8_t>(mask_count);
    } else {
      result.out = decode(host_out, c.dtype);
      result.lse = host_lse;
      result.mask = host_mask;
    }
  }
  return result;
}

class GpuWgmmaSparge : public ::testing::TestWithParam<Case> {};

TEST_P(GpuWgmmaSparge, DefaultCellsMatchCpuBackend) {
  const bool gpu_present = cuda_device_present();
  if (!gpu_present && !cpu_selfcheck_requested()) GTEST_SKIP() << "no CUDA device/driver";
  const Case& c = GetParam();
  std::mt19937 rng(77);
  Inputs in = make_inputs(c, rng);
  Physical ph = build_physical(c, in, rng);
  const SpargeResult cpu = run_sparge(c, in, ph, /*on_gpu=*/false);
  ASSERT_EQ(cpu.status, SPARSA_STATUS_SUCCESS) << cpu.message;
  const int64_t kept = std::count(cpu.mask.begin(), cpu.mask.end(), uint8_t(1));
  EXPECT_GT(kept, 0) << c.name;
  EXPECT_LT(size_t(kept), cpu.mask.size() / 2) << c.name << ": the prediction must drop cells";
  if (!gpu_present) return;
  const SpargeResult gpu = run_sparge(c, in, ph, /*on_gpu=*/true);
  ASSERT_EQ(gpu.status, SPARSA_STATUS_SUCCESS) << gpu.message;
  ASSERT_EQ(gpu.mask, cpu.mask) << c.name << ": predicted masks differ";
  RunResult g, cp;  // the comparison of expect_matches_cpu (written elements only, NaN counts)
  g.out = gpu.out;
  g.lse = gpu.lse;
  cp.out = cpu.out;
  cp.lse = cpu.lse;
  expect_matches_cpu(c, g, cp);
}

std::vector<Case> sparge_cases() {
  std::vector<Case> list;
  Case c;
  c.name = "sparge_bf16_d128_noncausal_gqa4";
  c.dtype = SPARSA_DTYPE_BF16;
  c.head_dim = 128;
  c.q_heads = 8;
  c.kv_heads = 2;
  c.seq_q = {1000};
  c.seq_k = {1000};
  list.push_back(c);
  c.name = "sparge_bf16_d128_causal_padded_batch2";
  c.q_heads = 4;
  c.kv_heads = 4;
  c.seq_q = {900, 900};
  c.seq_k = {900, 650};  // seq_lens_k: the second sequence is shorter (bottom-right causal)
  c.causal = true;
  list.push_back(c);
  c = Case{};
  c.name = "sparge_f16_d64_noncausal_odd";
  c.dtype = SPARSA_DTYPE_F16;
  c.head_dim = 64;
  c.q_heads = 4;
  c.kv_heads = 1;
  c.seq_q = {517};
  c.seq_k = {1111};
  list.push_back(c);
  c.name = "sparge_f16_d64_causal";
  c.seq_q = {777};
  c.seq_k = {777};
  c.causal = true;
  list.push_back(c);
  return list;
}

INSTANTIATE_TEST_SUITE_P(Sparge, GpuWgmmaSparge, ::testing::ValuesIn(sparge_cases()),
                         [](const ::testing::TestParamInfo<Case>& info) { return info.param.name; });

}  // namespace
