// Hopper wgmma forward (backends/gpu/kernels/forward_wgmma.cu) via the public C API: fp16/bf16, head_dim 64/128
// take that kernel on an sm_90 device (forward_dispatch.cu tries it before mma.sync). Its attention cases (tiles,
// ring, causal alignments, GQA, layouts, masks, sink/window, large scores, Δ's row map) are rows of the case table
// WgmmaCases (tests/test_attention_case_tables.cpp). Here: TOKEN_SPARSE's query-row map (§5: queries and keys
// gathered through per-head position lists, outputs scattered), checked against the CPU backend. (Masks whose cells
// the kernel walks as gathered 64-key halves, the caller's and SPARGE's predicted ones, are the rows of
// MaskCellCases and SpargePredictionCases.) Outputs are poisoned with NaN first. Skips cleanly without a CUDA device
// (on pre-Hopper devices the same cases exercise the mma.sync kernel).
#include <cuda_runtime.h>
#include <gtest/gtest.h>
#include <sparsa/sparsa.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
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

}  // namespace
