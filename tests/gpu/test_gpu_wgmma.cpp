// Hopper wgmma forward (backends/gpu/kernels/forward_wgmma.cu) via the public C API: fp16/bf16, head_dim 64/128
// take that kernel on an sm_90 device (forward_dispatch.cu tries it before mma.sync). Its attention cases (tiles,
// ring, causal alignments, GQA, layouts, masks, sink/window, large scores, Δ's row map) are rows of the case table
// WgmmaCases (tests/test_attention_case_tables.cpp). Here: TOKEN_SPARSE's query-row map (§5: queries and keys
// gathered through per-head position lists, outputs scattered), checked against the CPU backend; GpuWgmmaCells and
// GpuWgmmaSparge, block masks whose cells the kernel walks as gathered 64-key halves (forward_wgmma.h:
// wgmma_gathers_mask_cells), SPARGE's default cells included, against the float64 reference (tests/reference,
// through attention_case.h) and the CPU backend. Outputs are poisoned with NaN first. Skips cleanly without a CUDA
// device (on pre-Hopper devices the same cases exercise the mma.sync kernel).
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


// ---- Block masks walked as gathered 64-key halves (forward_wgmma.h: wgmma_gathers_mask_cells) ----
// Cells whose rows hold each 64-row consumer warpgroup (block_q a multiple of 64) and whose keys fill 64-key halves
// (block_k 8, 16, 32 or a multiple of 64, not both multiples of 128): the kernel walks the visible halves, packs two
// per 128-key tile wherever they lie, and masks by the cells of each thread's columns plus the sequence end and the
// causal bound. Random masks, then structured ones that put visible cells where a tile-based walk would not: one
// cell per row, a diagonal band, only the second half of every 128-key tile, and whole cell rows invisible (their
// rows must be exact zeros with LSE -inf, as the CPU writes them).
enum class MaskPattern { kRandom, kOneCellPerRow, kBand, kSecondHalfOnly, kEmptyRows };

struct CellCase : Case {
  MaskPattern pattern = MaskPattern::kRandom;
};

void PrintTo(const CellCase& c, std::ostream* os) { *os << c.name; }

constexpr int32_t kTileKeys = 128;  // keys of one wgmma tile
constexpr int32_t kHalfTileKeys = 64;

// Rewrites the random mask of make_inputs() by the case's pattern. Cell row r / column k of (b, h).
void apply_pattern(const CellCase& c, Inputs& in) {
  if (c.pattern == MaskPattern::kRandom) return;
  const int64_t rows = (in.max_q + c.block_q - 1) / c.block_q, cols = (in.max_k + c.block_k - 1) / c.block_k;
  for (int32_t b = 0; b < in.batch; ++b) {
    for (int32_t h = 0; h < c.q_heads; ++h) {
      for (int64_t r = 0; r < rows; ++r) {
        for (int64_t k = 0; k < cols; ++k) {
          uint8_t& cell = in.mask[((int64_t(b) * c.q_heads + h) * rows + r) * cols + k];
          const int64_t first_key = k * c.block_k, first_row = r * c.block_q;
          switch (c.pattern) {
            case MaskPattern::kOneCellPerRow:  // a different column per row and head, anywhere in the keys
              cell = k == (r * 7 + h * 3 + b) % cols ? 1 : 0;
              break;
            case MaskPattern::kBand:  // keys within about one cell of the row block's diagonal
              cell = first_key + c.block_k > first_row - c.block_k && first_key < first_row + c.block_q + c.block_k;
              break;
            case MaskPattern::kSecondHalfOnly:  // only keys 64..127 of every 128-key tile, a few dropped
              cell = (first_key % kTileKeys) >= kHalfTileKeys && (r + k + h) % 5 != 0 ? 1 : 0;
              break;
            case MaskPattern::kEmptyRows:  // every third cell row of a head sees nothing; the rest random
              if ((r + h) % 3 == 1) cell = 0;
              break;
            case MaskPattern::kRandom:
              break;
          }
        }
      }
    }
  }
}

class GpuWgmmaCells : public ::testing::TestWithParam<CellCase> {};

TEST_P(GpuWgmmaCells, MatchesReferenceAndCpuBackend) {
  const bool gpu_present = cuda_device_present();
  if (!gpu_present && !cpu_selfcheck_requested()) GTEST_SKIP() << "no CUDA device/driver";
  const CellCase& c = GetParam();
  std::mt19937 rng(2024);
  Inputs in = make_inputs(c, rng);
  apply_pattern(c, in);
  Physical ph = build_physical(c, in, rng);
  encode_rounded(in.q, c.dtype);
  encode_rounded(in.k, c.dtype);
  encode_rounded(in.v, c.dtype);
  std::vector<double> ref_out, ref_lse;
  reference(c, in, &ref_out, &ref_lse);
  const RunResult cpu = run_case(c, in, ph, /*on_gpu=*/false);
  ASSERT_EQ(cpu.status, SPARSA_STATUS_SUCCESS) << "CPU backend failed on " << c.name << ": " << cpu.message;
  expect_matches(c, in, ph, cpu, ref_out, ref_lse, "cpu");
  // Rows that see no key (whole cell row invisible, or the causal bound): the pattern must produce some, or the
  // exact-zero check below tests nothing.
  int64_t empty_rows = 0;
  for (int32_t b = 0; b < in.batch; ++b) {
    for (int32_t h = 0; h < c.q_heads; ++h) {
      for (int32_t i = 0; i < c.seq_q[b]; ++i) {
        empty_rows += std::isinf(ref_lse[(size_t(b) * c.q_heads + h) * in.max_q + i]);
      }
    }
  }
  if (c.pattern == MaskPattern::kEmptyRows) {
    EXPECT_GT(empty_rows, 0) << c.name;
  }
  if (!gpu_present) return;

  const RunResult gpu = run_case(c, in, ph, /*on_gpu=*/true);
  ASSERT_EQ(gpu.status, SPARSA_STATUS_SUCCESS) << gpu.message;
  expect_matches(c, in, ph, gpu, ref_out, ref_lse, "cuda");
  expect_matches_cpu(c, gpu, cpu);
  // A row that sees nothing is written as exact zeros with LSE -inf, as by the CPU backend.
  int64_t not_exact = 0;
  for (int32_t b = 0; b < in.batch; ++b) {
    for (int32_t i = 0; i < c.seq_q[b]; ++i) {
      const int64_t phys_row = c.q_layout == Layout::kPacked ? ph.cu_q[b] + i : int64_t(b) * in.max_q + i;
      for (int32_t h = 0; h < c.q_heads; ++h) {
        if (!std::isinf(ref_lse[(size_t(b) * c.q_heads + h) * in.max_q + i])) continue;
        for (int32_t d = 0; d < c.head_dim; ++d) {
          const size_t at = (size_t(phys_row) * c.q_heads + h) * c.head_dim + d;
          not_exact += !(gpu.out[at] == 0.f && cpu.out[at] == 0.f);
        }
      }
    }
  }
  EXPECT_EQ(not_exact, 0) << c.name << ": rows that see nothing must be exact zeros";
}

std::vector<CellCase> cell_cases() {
  std::vector<CellCase> list;
  auto add = [&](const CellCase& c) { list.push_back(c); };
  auto block_sparse = [](const char* name, int32_t dtype, int32_t head_dim, int32_t bq, int32_t bk) {
    CellCase c;
    c.name = name;
    c.dtype = dtype;
    c.head_dim = head_dim;
    c.policy = SPARSA_POLICY_BLOCK_SPARSE;
    c.block_q = bq;
    c.block_k = bk;
    c.mask_density = 0.4f;
    return c;
  };
  CellCase c = block_sparse("cells_128x64_bf16_d128_noncausal_tail_gqa4", SPARSA_DTYPE_BF16, 128, 128, 64);
  c.q_heads = 8;
  c.kv_heads = 2;
  c.seq_q = {300};  // the last 128-row tile ends inside its first consumer half
  c.seq_k = {1001};
  add(c);
  c = block_sparse("cells_128x64_f16_d64_causal_square_gqa8", SPARSA_DTYPE_F16, 64, 128, 64);
  c.q_heads = 8;
  c.kv_heads = 1;
  c.seq_q = {777};
  c.seq_k = {777};
  c.causal = true;
  add(c);
  c = block_sparse("cells_64x64_bf16_d128_causal_sq_lt_skv", SPARSA_DTYPE_BF16, 128, 64, 64);
  c.seq_q = {200};  // bottom-right: row i sees keys <= i + 450
  c.seq_k = {650};
  c.causal = true;
  add(c);
  c = block_sparse("cells_64x64_f16_d64_noncausal_odd", SPARSA_DTYPE_F16, 64, 64, 64);
  c.q_heads = 4;
  c.kv_heads = 2;
  c.seq_q = {333};
  c.seq_k = {517};
  add(c);
  c = block_sparse("cells_64x64_bf16_d64_causal_sq_gt_skv", SPARSA_DTYPE_BF16, 64, 64, 64);
  c.q_heads = 2;
  c.kv_heads = 1;
  c.seq_q = {420};  // the first 150 rows see nothing
  c.seq_k = {270};
  c.causal = true;
  add(c);
  c = block_sparse("cells_256x64_bf16_d64_causal_gqa8", SPARSA_DTYPE_BF16, 64, 256, 64);
  c.q_heads = 8;
  c.kv_heads = 1;
  c.seq_q = {600};
  c.seq_k = {600};
  c.causal = true;
  add(c);
  c = block_sparse("cells_192x64_f16_d128_causal", SPARSA_DTYPE_F16, 128, 192, 64);
  c.seq_q = {500};
  c.seq_k = {530};
  c.causal = true;
  add(c);
  c = block_sparse("cells_128x32_f16_d128_noncausal", SPARSA_DTYPE_F16, 128, 128, 32);
  c.q_heads = 2;
  c.kv_heads = 2;
  c.seq_q = {257};
  c.seq_k = {901};
  add(c);
  c = block_sparse("cells_128x32_bf16_d64_causal", SPARSA_DTYPE_BF16, 64, 128, 32);
  c.seq_q = {400};
  c.seq_k = {400};
  c.causal = true;
  add(c);
  c = block_sparse("cells_64x16_f16_d64_noncausal", SPARSA_DTYPE_F16, 64, 64, 16);
  c.mask_density = 0.2f;
  c.seq_q = {190};
  c.seq_k = {430};
  add(c);
  c = block_sparse("cells_128x8_bf16_d128_causal", SPARSA_DTYPE_BF16, 128, 128, 8);
  c.mask_density = 0.3f;
  c.q_heads = 2;
  c.kv_heads = 1;
  c.seq_q = {130};
  c.seq_k = {300};
  c.causal = true;
  add(c);
  c = block_sparse("cells_64x128_f16_d128_noncausal", SPARSA_DTYPE_F16, 128, 64, 128);
  c.seq_q = {300};
  c.seq_k = {700};
  add(c);
  c = block_sparse("cells_128x64_bf16_d128_large_scores", SPARSA_DTYPE_BF16, 128, 128, 64);
  c.q_heads = 2;
  c.kv_heads = 2;
  c.seq_q = {256};
  c.seq_k = {1200};
  c.q_scale = 5.f;  // the running max moves between gathered tiles
  add(c);
  c = block_sparse("cells_128x64_varlen_packed_bf16_d128_causal_gqa4", SPARSA_DTYPE_BF16, 128, 128, 64);
  c.q_heads = 8;
  c.kv_heads = 2;
  c.q_layout = Layout::kPacked;
  c.kv_layout = Layout::kPacked;
  c.seq_q = {5, 130, 257, 1, 64};
  c.seq_k = {5, 200, 257, 90, 400};
  c.causal = true;
  add(c);
  c = block_sparse("cells_64x32_varlen_packed_f16_d64_noncausal", SPARSA_DTYPE_F16, 64, 64, 32);
  c.q_layout = Layout::kPacked;
  c.kv_layout = Layout::kPacked;
  c.seq_q = {33, 140, 9};
  c.seq_k = {300, 17, 129};
  add(c);
  c = block_sparse("cells_128x64_paged_ps16_bf16_d128_causal_gqa4", SPARSA_DTYPE_BF16, 128, 128, 64);
  c.q_heads = 8;
  c.kv_heads = 2;
  c.q_layout = Layout::kPacked;
  c.kv_layout = Layout::kPaged;
  c.page_size = 16;
  c.seq_q = {140, 30};
  c.seq_k = {500, 30};
  c.causal = true;
  add(c);
  c = block_sparse("cells_64x64_padded_seq_lens_f16_d64_no_lse", SPARSA_DTYPE_F16, 64, 64, 64);
  c.seq_q = {200, 200};
  c.seq_k = {30, 333};
  c.lse = false;
  add(c);
  c = block_sparse("cells_128x64_split_kv_f16_d128_causal", SPARSA_DTYPE_F16, 128, 128, 64);
  c.q_heads = 2;  // 2 thread blocks, 80 halves: split-KV shares of the gathered walk
  c.kv_heads = 2;
  c.seq_q = {9};
  c.seq_k = {5000};
  c.causal = true;
  add(c);
  // Structured masks.
  c = block_sparse("cells_128x64_one_cell_per_row_bf16_d128", SPARSA_DTYPE_BF16, 128, 128, 64);
  c.pattern = MaskPattern::kOneCellPerRow;
  c.q_heads = 4;
  c.kv_heads = 2;
  c.seq_q = {512};
  c.seq_k = {1000};
  add(c);
  c = block_sparse("cells_64x32_one_cell_per_row_f16_d64_causal", SPARSA_DTYPE_F16, 64, 64, 32);
  c.pattern = MaskPattern::kOneCellPerRow;
  c.seq_q = {450};
  c.seq_k = {450};
  c.causal = true;
  add(c);
  c = block_sparse("cells_64x64_band_f16_d64_causal", SPARSA_DTYPE_F16, 64, 64, 64);
  c.pattern = MaskPattern::kBand;
  c.seq_q = {700};
  c.seq_k = {700};
  c.causal = true;
  add(c);
  c = block_sparse("cells_128x32_band_bf16_d128_noncausal", SPARSA_DTYPE_BF16, 128, 128, 32);
  c.pattern = MaskPattern::kBand;
  c.q_heads = 2;
  c.kv_heads = 1;
  c.seq_q = {600};
  c.seq_k = {650};
  add(c);
  c = block_sparse("cells_128x64_second_half_only_bf16_d128", SPARSA_DTYPE_BF16, 128, 128, 64);
  c.pattern = MaskPattern::kSecondHalfOnly;
  c.q_heads = 4;
  c.kv_heads = 4;
  c.seq_q = {400};
  c.seq_k = {900};
  add(c);
  c = block_sparse("cells_64x16_second_half_only_f16_d64_causal", SPARSA_DTYPE_F16, 64, 64, 16);
  c.pattern = MaskPattern::kSecondHalfOnly;
  c.seq_q = {300};
  c.seq_k = {380};
  c.causal = true;
  add(c);
  c = block_sparse("cells_128x64_empty_rows_bf16_d128_causal", SPARSA_DTYPE_BF16, 128, 128, 64);
  c.pattern = MaskPattern::kEmptyRows;
  c.q_heads = 4;
  c.kv_heads = 2;
  c.seq_q = {500};
  c.seq_k = {500};
  c.causal = true;
  add(c);
  c = block_sparse("cells_64x64_empty_rows_f16_d64_noncausal", SPARSA_DTYPE_F16, 64, 64, 64);
  c.pattern = MaskPattern::kEmptyRows;
  c.seq_q = {333};
  c.seq_k = {600};
  add(c);
  return list;
}

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

INSTANTIATE_TEST_SUITE_P(Cells, GpuWgmmaCells, ::testing::ValuesIn(cell_cases()),
                         [](const ::testing::TestParamInfo<CellCase>& info) { return info.param.name; });

}  // namespace
