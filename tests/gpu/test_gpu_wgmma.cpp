// Hopper wgmma forward (backends/gpu/forward_wgmma.cu) through the public C API: fp16/bf16 with head_dim 64/128
// take that kernel on an sm_90 device (forward_dispatch.cu tries it before mma.sync). Shapes stress what is new in
// it: 128-row query tiles split over two consumer warpgroups (odd row counts, tails inside either half), 128-key
// tiles through a 3-deep ring (many tiles, so the ring wraps), bottom-right causal with Sq < Skv and Sq > Skv, GQA
// 1/4/8, packed and paged (page sizes 1 and 16) K/V, LSE, block masks whose cells cut tiles, sink/window, and
// large scores (online-softmax rescaling across tiles). Each case is checked against a float64 reference and the
// CPU backend; outputs are poisoned with NaN first. The query-row maps take the same kernel: Δ (§8, the flag over
// DENSE and SINK_WINDOW: its dense pass reads anchor + tail rows at their positions and writes them compact) and
// TOKEN_SPARSE (§5: queries and keys gathered through per-head position lists, outputs scattered) are checked
// against the CPU backend only (the float64 reference here knows neither). The harness is attention_case.h,
// shared with test_gpu_attention.cpp. Skips cleanly without a CUDA device (on pre-Hopper devices the same cases exercise the
// mma.sync kernel).
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
  std::mt19937 rng(1234);
  Inputs in = make_inputs(c, rng);
  Physical ph = build_physical(c, in, rng);
  // encode_rounded() rounded the physical copies; round the logical ones the same way for the reference.
  encode_rounded(in.q, c.dtype);
  encode_rounded(in.k, c.dtype);
  encode_rounded(in.v, c.dtype);
  std::vector<double> ref_out, ref_lse;
  reference(c, in, &ref_out, &ref_lse);

  const RunResult cpu = run_case(c, in, ph, /*on_gpu=*/false);
  if (cpu.status != SPARSA_STATUS_SUCCESS) {
    ADD_FAILURE() << "CPU backend failed on " << c.name << ": " << cpu.message;
  } else {
    expect_matches(c, in, ph, cpu, ref_out, ref_lse, "cpu");
  }
  if (!gpu_present) return;

  const RunResult gpu = run_case(c, in, ph, /*on_gpu=*/true);
  ASSERT_EQ(gpu.status, SPARSA_STATUS_SUCCESS) << gpu.message;
  expect_matches(c, in, ph, gpu, ref_out, ref_lse, "cuda");
  if (cpu.status != SPARSA_STATUS_SUCCESS) return;
  // GPU vs CPU directly, on the written rows.
  double worst = 0;
  for (size_t i = 0; i < gpu.out.size(); ++i) {
    if (std::isnan(cpu.out[i])) continue;  // padding rows past a sequence end are not outputs
    worst = std::max(worst, double(std::fabs(gpu.out[i] - cpu.out[i])));
  }
  EXPECT_LE(worst, 2 * tolerance(c.dtype)) << "cuda vs cpu " << c.name;
}

std::vector<Case> cases() {
  std::vector<Case> list;
  auto add = [&](Case c) { list.push_back(c); };
  Case c;
  // Dense, one 128-row tile with a tail in the second consumer half, several key tiles.
  c.name = "dense_bf16_d128_noncausal_tail";
  c.dtype = SPARSA_DTYPE_BF16;
  c.head_dim = 128;
  c.q_heads = 2;
  c.kv_heads = 2;
  c.seq_q = {100};
  c.seq_k = {700};
  add(c);
  c = Case{};
  c.name = "dense_f16_d64_noncausal_many_tiles";  // 9 key tiles: the 3-slot ring wraps three times
  c.head_dim = 64;
  c.q_heads = 2;
  c.kv_heads = 2;
  c.seq_q = {257};
  c.seq_k = {1100};
  add(c);
  c = Case{};
  c.name = "dense_bf16_d64_causal_square_gqa8";
  c.dtype = SPARSA_DTYPE_BF16;
  c.q_heads = 8;
  c.kv_heads = 1;
  c.seq_q = {389};
  c.seq_k = {389};
  c.causal = true;
  add(c);
  c = Case{};
  c.name = "dense_f16_d128_causal_sq_lt_skv_gqa4";  // bottom-right: row i sees keys <= i + 500
  c.head_dim = 128;
  c.q_heads = 8;
  c.kv_heads = 2;
  c.seq_q = {130};
  c.seq_k = {630};
  c.causal = true;
  add(c);
  c = Case{};
  c.name = "dense_bf16_d128_causal_sq_gt_skv_empty_rows";  // the first 171 rows see nothing
  c.dtype = SPARSA_DTYPE_BF16;
  c.head_dim = 128;
  c.q_heads = 2;
  c.kv_heads = 1;
  c.seq_q = {300};
  c.seq_k = {129};
  c.causal = true;
  add(c);
  c = Case{};
  c.name = "dense_bf16_d128_large_scores";  // |q| ~ 6: the running max changes between tiles
  c.dtype = SPARSA_DTYPE_BF16;
  c.head_dim = 128;
  c.q_heads = 2;
  c.kv_heads = 2;
  c.seq_q = {200};
  c.seq_k = {600};
  c.q_scale = 6.f;
  add(c);
  c = Case{};
  c.name = "dense_f16_d64_causal_large_scores_batch3";
  c.head_dim = 64;
  c.q_heads = 4;
  c.kv_heads = 4;
  c.q_layout = Layout::kPacked;
  c.kv_layout = Layout::kPacked;
  c.seq_q = {129, 200, 64};
  c.seq_k = {129, 450, 64};
  c.causal = true;
  c.q_scale = 5.f;
  add(c);
  c = Case{};
  c.name = "varlen_packed_bf16_d128_causal_gqa4";
  c.dtype = SPARSA_DTYPE_BF16;
  c.head_dim = 128;
  c.q_heads = 8;
  c.kv_heads = 2;
  c.q_layout = Layout::kPacked;
  c.kv_layout = Layout::kPacked;
  c.seq_q = {5, 130, 257, 1, 64};
  c.seq_k = {5, 200, 257, 90, 400};
  c.causal = true;
  add(c);
  c = Case{};
  c.name = "varlen_packed_f16_d64_noncausal";
  c.head_dim = 64;
  c.q_layout = Layout::kPacked;
  c.kv_layout = Layout::kPacked;
  c.seq_q = {33, 140, 9};
  c.seq_k = {300, 17, 129};
  add(c);
  c = Case{};
  c.name = "paged_ps16_bf16_d128_gqa4_causal";
  c.dtype = SPARSA_DTYPE_BF16;
  c.head_dim = 128;
  c.q_heads = 8;
  c.kv_heads = 2;
  c.q_layout = Layout::kPacked;
  c.kv_layout = Layout::kPaged;
  c.page_size = 16;
  c.seq_q = {140, 30};
  c.seq_k = {500, 30};
  c.causal = true;
  add(c);
  c = Case{};
  c.name = "paged_ps1_f16_d64_prefill";
  c.head_dim = 64;
  c.q_layout = Layout::kPacked;
  c.kv_layout = Layout::kPaged;
  c.page_size = 1;
  c.q_heads = 4;
  c.kv_heads = 1;
  c.seq_q = {150, 40};
  c.seq_k = {333, 41};
  c.causal = true;
  add(c);
  c = Case{};
  c.name = "padded_seq_lens_bf16_d64_no_lse";
  c.dtype = SPARSA_DTYPE_BF16;
  c.head_dim = 64;
  c.seq_q = {200, 200};
  c.seq_k = {30, 333};
  c.lse = false;
  add(c);
  c = Case{};
  c.name = "block_sparse_bf16_d128_causal_128x128";
  c.dtype = SPARSA_DTYPE_BF16;
  c.head_dim = 128;
  c.q_heads = 2;
  c.kv_heads = 2;
  c.policy = SPARSA_POLICY_BLOCK_SPARSE;
  c.block_q = 128;
  c.block_k = 128;
  c.seq_q = {700};
  c.seq_k = {700};
  c.causal = true;
  add(c);
  c = Case{};
  c.name = "block_sparse_f16_d64_odd_cells_48x80";  // cells cut tiles: element predicate inside tiles
  c.head_dim = 64;
  c.q_heads = 2;
  c.kv_heads = 1;
  c.policy = SPARSA_POLICY_BLOCK_SPARSE;
  c.block_q = 48;
  c.block_k = 80;
  c.mask_density = 0.3f;
  c.seq_q = {301};
  c.seq_k = {517};
  add(c);
  c = Case{};
  c.name = "sink_window_bf16_d128_causal_long";
  c.dtype = SPARSA_DTYPE_BF16;
  c.head_dim = 128;
  c.q_heads = 2;
  c.kv_heads = 2;
  c.policy = SPARSA_POLICY_SINK_WINDOW;
  c.sink_tokens = 20;
  c.sink_window = 150;
  c.seq_q = {900};
  c.seq_k = {900};
  c.causal = true;
  add(c);
  c = Case{};
  c.name = "sink_window_f16_d64_noncausal";
  c.head_dim = 64;
  c.policy = SPARSA_POLICY_SINK_WINDOW;
  c.sink_tokens = 3;
  c.sink_window = 200;
  c.seq_q = {260};
  c.seq_k = {700};
  add(c);
  c = Case{};
  c.name = "short_prefill_f16_d128_long_keys";  // 2 thread blocks, 40 key tiles
  c.head_dim = 128;
  c.q_heads = 2;
  c.kv_heads = 2;
  c.seq_q = {9};
  c.seq_k = {5000};
  c.causal = true;
  add(c);
  return list;
}

// Query-row maps on the wgmma kernel: Δ's dense pass (kDeltaRows) and TOKEN_SPARSE's list attention (kTokenLists).
std::vector<Case> row_map_cases() {
  std::vector<Case> list;
  auto add = [&](Case c) { list.push_back(c); };
  Case c;
  // Δ over SINK_WINDOW, odd Sq: cut = 1111 % 8 + 40 = 47, s_p = 1064, 133 anchors + 47 tail rows = 180 launch rows
  // (two 128-row tiles; the second ends inside its first consumer half). Anchor tiles reach far past their launch
  // index, so the causal horizon must come from the row's position.
  c.name = "delta_sink_window_bf16_d128_odd";
  c.dtype = SPARSA_DTYPE_BF16;
  c.head_dim = 128;
  c.q_heads = 4;
  c.kv_heads = 2;
  c.policy = SPARSA_POLICY_SINK_WINDOW;
  c.sink_tokens = 16;
  c.sink_window = 200;
  c.delta = true;
  c.gamma = 8;
  c.tail_min = 40;
  c.seq_q = {1111};
  c.seq_k = {1111};
  c.causal = true;
  c.lse = false;
  add(c);
  c.name = "delta_sink_window_f16_d64_odd";
  c.dtype = SPARSA_DTYPE_F16;
  c.head_dim = 64;
  c.q_heads = 8;
  c.kv_heads = 1;
  c.gamma = 5;
  c.tail_min = 130;  // tail longer than a consumer half; 170 anchors
  c.seq_q = {987};
  c.seq_k = {987};
  add(c);
  c = Case{};
  // Δ over DENSE, varlen packed with Sq < Skv (bottom-right causal: positions shift by Skv - Sq) and sequences
  // too short for any sparse row (s_p = 0: every row is dense, launch row a = position a).
  c.name = "delta_dense_varlen_bf16_d64";
  c.dtype = SPARSA_DTYPE_BF16;
  c.head_dim = 64;
  c.q_heads = 4;
  c.kv_heads = 4;
  c.q_layout = Layout::kPacked;
  c.kv_layout = Layout::kPacked;
  c.delta = true;
  c.gamma = 7;
  c.tail_min = 33;
  c.seq_q = {517, 20, 901};
  c.seq_k = {700, 20, 901};
  c.causal = true;
  c.lse = false;
  add(c);
  c.name = "delta_dense_varlen_f16_d128_paged";
  c.dtype = SPARSA_DTYPE_F16;
  c.head_dim = 128;
  c.q_heads = 8;
  c.kv_heads = 2;
  c.kv_layout = Layout::kPaged;
  c.page_size = 16;
  c.gamma = 64;
  c.tail_min = 128;
  c.seq_q = {1500, 300};
  c.seq_k = {1600, 300};
  add(c);
  c = Case{};
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

INSTANTIATE_TEST_SUITE_P(Cases, GpuWgmma, ::testing::ValuesIn(cases()),
                         [](const ::testing::TestParamInfo<Case>& info) { return info.param.name; });

}  // namespace
