// GPU backend tests: every case runs through the public C API on a CUDA context and is checked against a float64
// brute-force reference of ALGORITHMS.md §0-§3 computed here, and against the CPU backend (the project's oracle) on
// the same inputs. Outputs are poisoned with NaN before each run so an unwritten element fails. Skips cleanly when
// no CUDA device/driver is present.
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

constexpr float kNegInf = -std::numeric_limits<float>::infinity();

// ---- element conversions (host) ----

// ---- device memory ----

// ---- one test case ----

enum class Layout { kPadded, kPacked, kPaged };

struct Case {
  std::string name;
  int32_t dtype = SPARSA_DTYPE_F16;
  int32_t head_dim = 64;
  int32_t q_heads = 4, kv_heads = 4;
  std::vector<int32_t> seq_q{64}, seq_k{64};  // per sequence; padded layouts use the max and seq_lens_k
  bool causal = false;
  Layout q_layout = Layout::kPadded;  // kPadded or kPacked
  Layout kv_layout = Layout::kPadded;
  int32_t page_size = 16;
  bool lse = true;
  int32_t policy = SPARSA_POLICY_DENSE;
  int32_t sink_tokens = 8, sink_window = 32;
  int32_t block_q = 64, block_k = 64;
  float mask_density = 0.5f;
};

void PrintTo(const Case& c, std::ostream* os) { *os << c.name; }

struct Inputs {
  int32_t batch = 0, max_q = 0, max_k = 0;
  std::vector<float> q, k, v;  // logical [b][i][h][d] with per-batch max lengths (padded logical layout)
  std::vector<uint8_t> mask;   // [B, Hq, ceil(max_q/bq), ceil(max_k/bk)]
};

bool visible(const Case& c, const Inputs& in, int32_t b, int32_t h, int32_t i, int32_t j) {
  const int64_t diagonal = int64_t(i) + c.seq_k[b] - c.seq_q[b];
  if (c.causal && j > diagonal) return false;
  if (c.policy == SPARSA_POLICY_SINK_WINDOW) {
    if (j < c.sink_tokens) return true;
    const int64_t distance = c.causal ? diagonal - j : std::llabs(diagonal - j);
    return distance < c.sink_window;
  }
  if (c.policy == SPARSA_POLICY_BLOCK_SPARSE) {
    const int64_t rows = (in.max_q + c.block_q - 1) / c.block_q, cols = (in.max_k + c.block_k - 1) / c.block_k;
    return in.mask[((int64_t(b) * c.q_heads + h) * rows + i / c.block_q) * cols + j / c.block_k] != 0;
  }
  return true;
}

// float64 reference: out [b][i][h][d] (padded logical), lse [b][h][i].
void reference(const Case& c, const Inputs& in, std::vector<double>* out, std::vector<double>* lse) {
  const int32_t D = c.head_dim, Hq = c.q_heads, Hkv = c.kv_heads, g = Hq / Hkv;
  const double scale = 1.0 / std::sqrt(double(D));
  out->assign(size_t(in.batch) * in.max_q * Hq * D, 0.0);
  lse->assign(size_t(in.batch) * Hq * in.max_q, -std::numeric_limits<double>::infinity());
  std::vector<double> scores;
  for (int32_t b = 0; b < in.batch; ++b) {
    for (int32_t h = 0; h < Hq; ++h) {
      for (int32_t i = 0; i < c.seq_q[b]; ++i) {
        const float* qrow = &in.q[((size_t(b) * in.max_q + i) * Hq + h) * D];
        scores.assign(c.seq_k[b], -std::numeric_limits<double>::infinity());
        double m = -std::numeric_limits<double>::infinity();
        for (int32_t j = 0; j < c.seq_k[b]; ++j) {
          if (!visible(c, in, b, h, i, j)) continue;
          const float* krow = &in.k[((size_t(b) * in.max_k + j) * Hkv + h / g) * D];
          double dot = 0;
          for (int32_t d = 0; d < D; ++d) dot += double(qrow[d]) * krow[d];
          scores[j] = dot * scale;
          m = std::max(m, scores[j]);
        }
        if (m == -std::numeric_limits<double>::infinity()) continue;
        double sum = 0;
        double* orow = &(*out)[((size_t(b) * in.max_q + i) * Hq + h) * D];
        for (int32_t j = 0; j < c.seq_k[b]; ++j) {
          if (scores[j] == -std::numeric_limits<double>::infinity()) continue;
          const double p = std::exp(scores[j] - m);
          sum += p;
          const float* vrow = &in.v[((size_t(b) * in.max_k + j) * Hkv + h / g) * D];
          for (int32_t d = 0; d < D; ++d) orow[d] += p * vrow[d];
        }
        for (int32_t d = 0; d < D; ++d) orow[d] /= sum;
        (*lse)[(size_t(b) * Hq + h) * in.max_q + i] = m + std::log(sum);
      }
    }
  }
}

double tolerance(int32_t dtype) {
  return dtype == SPARSA_DTYPE_F32 ? 2e-4 : dtype == SPARSA_DTYPE_F16 ? 4e-3 : 3e-2;
}

// Physical tensors of one case on one device kind (host memory for the CPU context).
struct Physical {
  std::vector<uint8_t> q, k, v;
  std::vector<int32_t> cu_q, cu_k, page_table, seq_lens_k;
  std::vector<int64_t> q_shape, kv_shape, out_shape, lse_shape, page_table_shape;
  int64_t q_rows = 0;  // rows of q/out (padded: B*max_q, packed: Tq)
};

Physical build_physical(const Case& c, Inputs& in, std::mt19937& rng) {
  Physical ph;
  const int32_t D = c.head_dim, Hq = c.q_heads, Hkv = c.kv_heads, B = in.batch;
  std::vector<float> q_phys, k_phys, v_phys;
  if (c.q_layout == Layout::kPacked) {
    ph.cu_q.push_back(0);
    for (int32_t b = 0; b < B; ++b) {
      for (int32_t i = 0; i < c.seq_q[b]; ++i) {
        const float* row = &in.q[((size_t(b) * in.max_q + i) * Hq) * D];
        q_phys.insert(q_phys.end(), row, row + size_t(Hq) * D);
      }
      ph.cu_q.push_back(ph.cu_q.back() + c.seq_q[b]);
    }
    ph.q_rows = ph.cu_q.back();
    ph.q_shape = {ph.q_rows, Hq, D};
    ph.lse_shape = {Hq, ph.q_rows};
  } else {
    q_phys = in.q;
    ph.q_rows = int64_t(B) * in.max_q;
    ph.q_shape = {B, in.max_q, Hq, D};
    ph.lse_shape = {B, Hq, in.max_q};
  }
  ph.out_shape = ph.q_shape;
  auto kv_row = [&](const std::vector<float>& src, int32_t b, int32_t t) {
    return &src[((size_t(b) * in.max_k + t) * Hkv) * D];
  };
  const size_t row_elems = size_t(Hkv) * D;
  if (c.kv_layout == Layout::kPadded) {
    k_phys = in.k;
    v_phys = in.v;
    ph.kv_shape = {B, in.max_k, Hkv, D};
    ph.seq_lens_k.assign(c.seq_k.begin(), c.seq_k.end());
  } else if (c.kv_layout == Layout::kPacked) {
    ph.cu_k.push_back(0);
    for (int32_t b = 0; b < B; ++b) {
      for (int32_t t = 0; t < c.seq_k[b]; ++t) {
        k_phys.insert(k_phys.end(), kv_row(in.k, b, t), kv_row(in.k, b, t) + row_elems);
        v_phys.insert(v_phys.end(), kv_row(in.v, b, t), kv_row(in.v, b, t) + row_elems);
      }
      ph.cu_k.push_back(ph.cu_k.back() + c.seq_k[b]);
    }
    ph.kv_shape = {ph.cu_k.back(), Hkv, D};
  } else {
    const int32_t ps = c.page_size;
    const int32_t max_pages = (in.max_k + ps - 1) / ps;
    const int32_t pages = B * max_pages + 3;  // a few spare pages so ids are not the identity
    std::vector<int32_t> order(pages);
    for (int32_t i = 0; i < pages; ++i) order[i] = i;
    std::shuffle(order.begin(), order.end(), rng);
    k_phys.assign(size_t(pages) * ps * row_elems, 7.f);  // unused slots hold junk that must never be read
    v_phys.assign(size_t(pages) * ps * row_elems, 7.f);
    ph.page_table.assign(size_t(B) * max_pages, 0);
    for (int32_t b = 0; b < B; ++b) {
      for (int32_t pg = 0; pg < max_pages; ++pg) ph.page_table[size_t(b) * max_pages + pg] = order[b * max_pages + pg];
      for (int32_t t = 0; t < c.seq_k[b]; ++t) {
        const size_t slot = (size_t(ph.page_table[size_t(b) * max_pages + t / ps]) * ps + t % ps) * row_elems;
        std::copy(kv_row(in.k, b, t), kv_row(in.k, b, t) + row_elems, k_phys.begin() + slot);
        std::copy(kv_row(in.v, b, t), kv_row(in.v, b, t) + row_elems, v_phys.begin() + slot);
      }
    }
    ph.kv_shape = {pages, ps, Hkv, D};
    ph.page_table_shape = {B, max_pages};
    ph.seq_lens_k.assign(c.seq_k.begin(), c.seq_k.end());
  }
  ph.q = encode_rounded(q_phys, c.dtype);
  ph.k = encode_rounded(k_phys, c.dtype);
  ph.v = encode_rounded(v_phys, c.dtype);
  return ph;
}

Inputs make_inputs(const Case& c, std::mt19937& rng) {
  Inputs in;
  in.batch = int32_t(c.seq_q.size());
  in.max_q = *std::max_element(c.seq_q.begin(), c.seq_q.end());
  in.max_k = *std::max_element(c.seq_k.begin(), c.seq_k.end());
  std::normal_distribution<float> normal(0.f, 1.f);
  auto fill = [&](std::vector<float>& x, size_t n) {
    x.resize(n);
    for (auto& e : x) e = std::clamp(normal(rng), -4.f, 4.f);
  };
  fill(in.q, size_t(in.batch) * in.max_q * c.q_heads * c.head_dim);
  fill(in.k, size_t(in.batch) * in.max_k * c.kv_heads * c.head_dim);
  fill(in.v, size_t(in.batch) * in.max_k * c.kv_heads * c.head_dim);
  if (c.policy == SPARSA_POLICY_BLOCK_SPARSE) {
    const int64_t rows = (in.max_q + c.block_q - 1) / c.block_q, cols = (in.max_k + c.block_k - 1) / c.block_k;
    std::bernoulli_distribution keep(c.mask_density);
    in.mask.resize(size_t(in.batch) * c.q_heads * rows * cols);
    for (auto& m : in.mask) m = keep(rng) ? 1 : 0;
  }
  return in;
}

// Runs the case on a context; all tensors in host memory for the CPU context, copied to the device otherwise.
struct RunResult {
  sparsa_status status = SPARSA_STATUS_INTERNAL;
  std::string message;
  std::vector<float> out;  // physical out layout
  std::vector<float> lse;  // physical lse layout
};

RunResult run_case(const Case& c, const Inputs& in, const Physical& ph, bool on_gpu) {
  RunResult result;
  sparsa_context_options options;
  sparsa_context_options_init(&options);
  options.device_type = on_gpu ? SPARSA_DEVICE_CUDA : SPARSA_DEVICE_CPU;
  sparsa_context* ctx = nullptr;
  result.status = sparsa_context_create(&options, &ctx);
  if (result.status != SPARSA_STATUS_SUCCESS) {
    result.message = sparsa_last_error_message();
    return result;
  }
  const int32_t dev = on_gpu ? SPARSA_DEVICE_CUDA : SPARSA_DEVICE_CPU;
  const size_t out_bytes = size_t(ph.q_rows) * c.q_heads * c.head_dim * element_bytes(c.dtype);
  const size_t lse_count = size_t(ph.q_rows) * c.q_heads;
  // Host mirrors (CPU run) or device buffers (GPU run).
  std::vector<uint8_t> host_out(out_bytes, 0xff);
  std::vector<float> host_lse(lse_count, std::numeric_limits<float>::quiet_NaN());
  std::deque<DeviceBuffer> buffers;  // stable addresses; DeviceBuffer is not movable
  auto place = [&](const void* host, size_t bytes) -> void* {
    if (!on_gpu) return const_cast<void*>(host);
    buffers.emplace_back(bytes);
    buffers.back().upload(host, bytes);
    return buffers.back().data();
  };
  void* q = place(ph.q.data(), ph.q.size());
  void* k = place(ph.k.data(), ph.k.size());
  void* v = place(ph.v.data(), ph.v.size());
  void* out = place(host_out.data(), out_bytes);  // poisoned (0xff = NaN)
  void* lse = place(host_lse.data(), lse_count * 4);
  sparsa_tensor tq = make_tensor(q, c.dtype, ph.q_shape, dev), tk = make_tensor(k, c.dtype, ph.kv_shape, dev),
                tv = make_tensor(v, c.dtype, ph.kv_shape, dev), tout = make_tensor(out, c.dtype, ph.out_shape, dev),
                tlse = make_tensor(lse, SPARSA_DTYPE_F32, ph.lse_shape, dev);
  sparsa_tensor tcu_q, tcu_k, tpage, tlens, tmask;
  sparsa_attention_args args;
  sparsa_attention_args_init(&args);
  args.q = &tq;
  args.k = &tk;
  args.v = &tv;
  args.out = &tout;
  args.lse = c.lse ? &tlse : nullptr;
  args.causal = c.causal ? 1 : 0;
  if (!ph.cu_q.empty()) {
    tcu_q = make_tensor(place(ph.cu_q.data(), ph.cu_q.size() * 4), SPARSA_DTYPE_I32, {int64_t(ph.cu_q.size())}, dev);
    args.cu_seqlens_q = &tcu_q;
  }
  if (!ph.cu_k.empty()) {
    tcu_k = make_tensor(place(ph.cu_k.data(), ph.cu_k.size() * 4), SPARSA_DTYPE_I32, {int64_t(ph.cu_k.size())}, dev);
    args.cu_seqlens_k = &tcu_k;
  }
  if (!ph.page_table.empty()) {
    void* table = place(ph.page_table.data(), ph.page_table.size() * 4);
    tpage = make_tensor(table, SPARSA_DTYPE_I32, ph.page_table_shape, dev);
    args.page_table = &tpage;
  }
  if (!ph.seq_lens_k.empty()) {
    tlens = make_tensor(place(ph.seq_lens_k.data(), ph.seq_lens_k.size() * 4), SPARSA_DTYPE_I32,
                        {int64_t(ph.seq_lens_k.size())}, dev);
    args.seq_lens_k = &tlens;
  }
  sparsa_policy policy;
  sparsa_policy_init(&policy, c.policy);
  policy.sink_tokens = c.sink_tokens;
  policy.sink_window = c.sink_window;
  policy.block_q = c.block_q;
  policy.block_k = c.block_k;
  if (c.policy == SPARSA_POLICY_BLOCK_SPARSE) {
    const int64_t rows = (in.max_q + c.block_q - 1) / c.block_q, cols = (in.max_k + c.block_k - 1) / c.block_k;
    tmask = make_tensor(place(in.mask.data(), in.mask.size()), SPARSA_DTYPE_U8, {in.batch, c.q_heads, rows, cols}, dev);
    policy.block_mask = &tmask;
  }
  result.status = sparsa_attention_run(ctx, &args, &policy);
  result.message = sparsa_last_error_message();
  if (result.status == SPARSA_STATUS_SUCCESS) {
    if (on_gpu) {
      EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
      std::vector<uint8_t> out_back = buffers[3].download<uint8_t>(out_bytes);
      result.out = decode(out_back, c.dtype);
      result.lse = buffers[4].download<float>(lse_count);
    } else {
      result.out = decode(host_out, c.dtype);
      result.lse = host_lse;
    }
  }
  sparsa_context_destroy(ctx);
  return result;
}

// Compares a run's physical outputs (written rows only) with the float64 reference.
void expect_matches(const Case& c, const Inputs& in, const Physical& ph, const RunResult& run,
                    const std::vector<double>& ref_out, const std::vector<double>& ref_lse, const char* who) {
  const int32_t D = c.head_dim, Hq = c.q_heads;
  const double tol = tolerance(c.dtype);
  double worst = 0, worst_lse = 0;
  int64_t bad = 0;
  for (int32_t b = 0; b < in.batch; ++b) {
    for (int32_t i = 0; i < c.seq_q[b]; ++i) {
      const int64_t phys_row = c.q_layout == Layout::kPacked ? ph.cu_q[b] + i : int64_t(b) * in.max_q + i;
      for (int32_t h = 0; h < Hq; ++h) {
        for (int32_t d = 0; d < D; ++d) {
          const double got = run.out[(size_t(phys_row) * Hq + h) * D + d];
          const double want = ref_out[((size_t(b) * in.max_q + i) * Hq + h) * D + d];
          const double err = std::fabs(got - want);
          if (!(err <= tol)) ++bad;  // NaN counts as bad
          worst = std::max(worst, std::isnan(err) ? 1e30 : err);
        }
        if (c.lse) {
          const size_t li = c.q_layout == Layout::kPacked ? size_t(h) * ph.q_rows + phys_row
                                                          : (size_t(b) * Hq + h) * in.max_q + i;
          const double got = run.lse[li];
          const double want = ref_lse[(size_t(b) * Hq + h) * in.max_q + i];
          if (std::isinf(want)) {
            if (!(std::isinf(got) && got < 0)) ++bad;
          } else {
            const double err = std::fabs(got - want);
            if (!(err <= 1e-3 + 1e-4 * std::fabs(want))) ++bad;
            worst_lse = std::max(worst_lse, std::isnan(err) ? 1e30 : err);
          }
        }
      }
    }
  }
  EXPECT_EQ(bad, 0) << who << " " << c.name << ": max |out - ref| = " << worst << " (tol " << tol
                    << "), max |lse - ref| = " << worst_lse;
}

class GpuAttention : public ::testing::TestWithParam<Case> {};

TEST_P(GpuAttention, MatchesReferenceAndCpuBackend) {
  const bool gpu_present = cuda_device_present();
  if (!gpu_present && !cpu_selfcheck_requested()) GTEST_SKIP() << "no CUDA device/driver";
  const Case& c = GetParam();
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
  c.name = "dense_f16_d64_noncausal";
  c.seq_q = {300, 300};
  c.seq_k = {300, 300};
  add(c);
  c = Case{};
  c.name = "dense_bf16_d128_causal_sq_lt_skv_gqa4";
  c.dtype = SPARSA_DTYPE_BF16;
  c.head_dim = 128;
  c.q_heads = 8;
  c.kv_heads = 2;
  c.seq_q = {77};
  c.seq_k = {301};
  c.causal = true;
  add(c);
  c = Case{};
  c.name = "dense_f16_d128_causal_sq_gt_skv_empty_rows";
  c.head_dim = 128;
  c.seq_q = {300};
  c.seq_k = {129};
  c.causal = true;
  add(c);
  c = Case{};
  c.name = "decode_f16_d64_gqa8";
  c.q_heads = 8;
  c.kv_heads = 1;
  c.seq_q = {1, 1, 1};
  c.seq_k = {1000, 17, 333};
  c.causal = true;
  add(c);
  c = Case{};
  c.name = "sink_window_bf16_d128_causal";
  c.dtype = SPARSA_DTYPE_BF16;
  c.head_dim = 128;
  c.policy = SPARSA_POLICY_SINK_WINDOW;
  c.sink_tokens = 16;
  c.sink_window = 100;
  c.seq_q = {333};
  c.seq_k = {333};
  c.causal = true;
  add(c);
  c = Case{};
  c.name = "sink_window_f16_d64_noncausal";
  c.policy = SPARSA_POLICY_SINK_WINDOW;
  c.sink_tokens = 3;
  c.sink_window = 70;
  c.seq_q = {200};
  c.seq_k = {260};
  add(c);
  c = Case{};
  c.name = "block_sparse_f16_d128_causal_64x64";
  c.head_dim = 128;
  c.policy = SPARSA_POLICY_BLOCK_SPARSE;
  c.seq_q = {257, 257};
  c.seq_k = {257, 300};
  c.causal = true;
  add(c);
  c = Case{};
  c.name = "block_sparse_bf16_d64_odd_blocks_32x48";
  c.dtype = SPARSA_DTYPE_BF16;
  c.policy = SPARSA_POLICY_BLOCK_SPARSE;
  c.block_q = 32;
  c.block_k = 48;
  c.mask_density = 0.3f;
  c.seq_q = {190};
  c.seq_k = {250};
  add(c);
  c = Case{};
  c.name = "dense_f32_d64_causal_portable";
  c.dtype = SPARSA_DTYPE_F32;
  c.seq_q = {150};
  c.seq_k = {150};
  c.causal = true;
  add(c);
  c = Case{};
  c.name = "dense_bf16_d256_portable";
  c.dtype = SPARSA_DTYPE_BF16;
  c.head_dim = 256;
  c.q_heads = 2;
  c.kv_heads = 1;
  c.seq_q = {70};
  c.seq_k = {90};
  c.causal = true;
  add(c);
  c = Case{};
  c.name = "dense_f16_d96_portable";
  c.head_dim = 96;
  c.seq_q = {40};
  c.seq_k = {65};
  add(c);
  c = Case{};
  c.name = "varlen_packed_f16_d128_causal";
  c.head_dim = 128;
  c.q_layout = Layout::kPacked;
  c.kv_layout = Layout::kPacked;
  c.seq_q = {5, 130, 64, 1};
  c.seq_k = {5, 200, 64, 90};
  c.causal = true;
  add(c);
  c = Case{};
  c.name = "paged_ps16_bf16_d128_gqa4_prefill";
  c.dtype = SPARSA_DTYPE_BF16;
  c.head_dim = 128;
  c.q_heads = 8;
  c.kv_heads = 2;
  c.q_layout = Layout::kPacked;
  c.kv_layout = Layout::kPaged;
  c.page_size = 16;
  c.seq_q = {40, 7};
  c.seq_k = {100, 7};
  c.causal = true;
  add(c);
  c = Case{};
  c.name = "paged_ps1_f16_d64_decode";
  c.kv_layout = Layout::kPaged;
  c.page_size = 1;
  c.q_heads = 4;
  c.kv_heads = 1;
  c.seq_q = {1, 1};
  c.seq_k = {77, 200};
  c.causal = true;
  add(c);
  c = Case{};
  c.name = "decode_split_kv_bf16_d128_gqa4";  // few thread blocks, long keys: split-KV + combine
  c.dtype = SPARSA_DTYPE_BF16;
  c.head_dim = 128;
  c.q_heads = 8;
  c.kv_heads = 2;
  c.seq_q = {1, 1, 1};
  c.seq_k = {5000, 3000, 77};
  c.causal = true;
  add(c);
  c = Case{};
  c.name = "varlen_split_kv_f16_d64";
  c.q_layout = Layout::kPacked;
  c.kv_layout = Layout::kPacked;
  c.seq_q = {3, 1};
  c.seq_k = {4000, 2500};
  c.causal = true;
  add(c);
  c = Case{};
  c.name = "short_prefill_split_kv_f16_d128";  // tensor-core kernel with split-KV (9 rows: too many for decode)
  c.head_dim = 128;
  c.q_heads = 2;
  c.kv_heads = 2;
  c.seq_q = {9};
  c.seq_k = {5000};
  c.causal = true;
  add(c);
  c = Case{};
  c.name = "decode_f32_d128_sink_window_gqa2";
  c.dtype = SPARSA_DTYPE_F32;
  c.head_dim = 128;
  c.q_heads = 4;
  c.kv_heads = 2;
  c.policy = SPARSA_POLICY_SINK_WINDOW;
  c.sink_tokens = 5;
  c.sink_window = 300;
  c.seq_q = {2, 2};
  c.seq_k = {3000, 700};
  c.causal = true;
  add(c);
  c = Case{};
  c.name = "padded_seq_lens_f16_d64_no_lse";
  c.seq_q = {64, 64};
  c.seq_k = {30, 129};
  c.lse = false;
  add(c);
  return list;
}

INSTANTIATE_TEST_SUITE_P(Cases, GpuAttention, ::testing::ValuesIn(cases()),
                         [](const ::testing::TestParamInfo<Case>& info) { return info.param.name; });

// A run is captured in a CUDA graph after plan() and replays to the same result (ABI.md rule 9).
TEST(GpuAttentionGraph, CaptureAndReplay) {
  SKIP_WITHOUT_GPU();
  Case c;
  c.name = "graph";
  c.head_dim = 128;
  c.seq_q = {200};
  c.seq_k = {200};
  c.causal = true;
  std::mt19937 rng(7);
  Inputs in = make_inputs(c, rng);
  Physical ph = build_physical(c, in, rng);
  const RunResult eager = run_case(c, in, ph, true);
  ASSERT_EQ(eager.status, SPARSA_STATUS_SUCCESS) << eager.message;

  cudaStream_t stream;
  CUDA_OK(cudaStreamCreate(&stream));
  sparsa_context_options options;
  sparsa_context_options_init(&options);
  options.device_type = SPARSA_DEVICE_CUDA;
  options.stream = stream;
  sparsa_context* ctx = nullptr;
  SPARSA_OK(sparsa_context_create(&options, &ctx));
  DeviceBuffer q(ph.q.size()), k(ph.k.size()), v(ph.v.size()), out(ph.q.size());
  q.upload(ph.q.data(), ph.q.size());
  k.upload(ph.k.data(), ph.k.size());
  v.upload(ph.v.data(), ph.v.size());
  out.poison();
  sparsa_tensor tq = make_tensor(q.data(), c.dtype, ph.q_shape, SPARSA_DEVICE_CUDA);
  sparsa_tensor tk = make_tensor(k.data(), c.dtype, ph.kv_shape, SPARSA_DEVICE_CUDA);
  sparsa_tensor tv = make_tensor(v.data(), c.dtype, ph.kv_shape, SPARSA_DEVICE_CUDA);
  sparsa_tensor tout = make_tensor(out.data(), c.dtype, ph.out_shape, SPARSA_DEVICE_CUDA);
  sparsa_attention_args args;
  sparsa_attention_args_init(&args);
  args.q = &tq;
  args.k = &tk;
  args.v = &tv;
  args.out = &tout;
  args.causal = 1;
  SPARSA_OK(sparsa_attention_plan(ctx, &args, nullptr));
  cudaGraph_t graph;
  CUDA_OK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal));
  const sparsa_status captured = sparsa_attention_run(ctx, &args, nullptr);
  CUDA_OK(cudaStreamEndCapture(stream, &graph));
  ASSERT_EQ(captured, SPARSA_STATUS_SUCCESS) << sparsa_last_error_message();
  cudaGraphExec_t exec;
  CUDA_OK(cudaGraphInstantiate(&exec, graph, 0));
  for (int replay = 0; replay < 3; ++replay) CUDA_OK(cudaGraphLaunch(exec, stream));
  CUDA_OK(cudaStreamSynchronize(stream));
  const std::vector<float> replayed = decode(out.download<uint8_t>(ph.q.size()), c.dtype);
  ASSERT_EQ(replayed.size(), eager.out.size());
  for (size_t i = 0; i < replayed.size(); ++i) ASSERT_EQ(replayed[i], eager.out[i]) << "element " << i;
  CUDA_OK(cudaGraphExecDestroy(exec));
  CUDA_OK(cudaGraphDestroy(graph));
  sparsa_context_destroy(ctx);
  CUDA_OK(cudaStreamDestroy(stream));
}

// What the backend does not implement is refused with UNSUPPORTED and a reason, never computed wrongly.
// Every policy runs on the GPU now; a case beyond the backend's limits (head_dim > 256) must still be refused up
// front with UNSUPPORTED and a reason naming the limit, with the output untouched.
TEST(GpuAttentionSupport, CaseBeyondTheLimitsIsUnsupportedWithAReason) {
  SKIP_WITHOUT_GPU();
  constexpr int64_t kTooLargeHeadDim = 320;
  sparsa_context_options options;
  sparsa_context_options_init(&options);
  options.device_type = SPARSA_DEVICE_CUDA;
  sparsa_context* ctx = nullptr;
  SPARSA_OK(sparsa_context_create(&options, &ctx));
  const int64_t shape[4] = {1, 1, 2, kTooLargeHeadDim};
  const size_t bytes = 2 * kTooLargeHeadDim * 2;
  DeviceBuffer buf(bytes);
  sparsa_tensor t;
  sparsa_tensor_init(&t, buf.data(), SPARSA_DTYPE_F16, 4, shape);
  t.device_type = SPARSA_DEVICE_CUDA;
  sparsa_attention_args args;
  sparsa_attention_args_init(&args);
  DeviceBuffer out(bytes);
  const std::vector<uint8_t> poison(bytes, 0xAB);
  CUDA_OK(cudaMemcpy(out.data(), poison.data(), bytes, cudaMemcpyHostToDevice));
  sparsa_tensor tout = t;
  tout.data = out.data();
  args.q = &t;
  args.k = &t;
  args.v = &t;
  args.out = &tout;
  sparsa_policy policy;
  sparsa_policy_init(&policy, SPARSA_POLICY_DENSE);
  EXPECT_EQ(sparsa_attention_run(ctx, &args, &policy), SPARSA_STATUS_UNSUPPORTED);
  EXPECT_NE(std::string(sparsa_last_error_message()).find("head_dim"), std::string::npos)
      << sparsa_last_error_message();
  std::vector<uint8_t> after(bytes);
  CUDA_OK(cudaMemcpy(after.data(), out.data(), bytes, cudaMemcpyDeviceToHost));
  EXPECT_EQ(after, poison);
  sparsa_context_destroy(ctx);
}

// TOKEN_INDICES (§7) at decode and short-chunk shapes with long sequences, so the index-driven kernel splits the
// key list (split-KV + combine): the GPU against the CPU backend on the same bf16 inputs, with LSE, stats and
// selected_indices. Indices hold duplicates and -1 slots; block ids and n_init/n_local are exercised too.
TEST(GpuTokenIndices, SplitKvMatchesCpuBackend) {
  SKIP_WITHOUT_GPU();
  std::mt19937 rng(7);
  std::normal_distribution<float> normal(0.f, 1.f);
  struct Shape { int sq, skv, block_size, n_init, n_local; };
  for (const Shape shape : {Shape{1, 20000, 1, 0, 0}, Shape{3, 9000, 1, 4, 64}, Shape{1, 50000, 16, 16, 128}}) {
    SCOPED_TRACE(::testing::Message() << "sq=" << shape.sq << " skv=" << shape.skv << " bs=" << shape.block_size);
    const int B = 2, Hq = 8, Hkv = 2, D = 128, k = 600;
    const int n_ids = (shape.skv + shape.block_size - 1) / shape.block_size;
    std::vector<float> q(size_t(B) * shape.sq * Hq * D), kv(size_t(B) * shape.skv * Hkv * D), v(kv.size());
    for (auto* x : {&q, &kv, &v})
      for (float& e : *x) e = normal(rng);
    std::vector<int32_t> ids(size_t(B) * Hq * k);
    for (size_t e = 0; e < ids.size(); ++e) {
      const int r = int(rng() % 100);
      ids[e] = r < 10 ? -1 : (r < 20 && e > 0 ? ids[e - 1] : int32_t(rng() % n_ids));
    }
    const std::vector<uint8_t> qb = encode_rounded(q, SPARSA_DTYPE_BF16), kb = encode_rounded(kv, SPARSA_DTYPE_BF16),
                               vb = encode_rounded(v, SPARSA_DTYPE_BF16);
    struct Result { std::vector<uint8_t> out; std::vector<float> lse; std::vector<int64_t> stats;
                    std::vector<int32_t> selected; };
    auto run = [&](int32_t device, Result* res) {
      sparsa_context_options options;
      sparsa_context_options_init(&options);
      options.device_type = device;
      sparsa_context* ctx = nullptr;
      SPARSA_OK(sparsa_context_create(&options, &ctx));
      const bool gpu = device == SPARSA_DEVICE_CUDA;
      std::vector<uint8_t> out_host(qb.size(), 0xff);
      std::vector<float> lse_host(size_t(B) * Hq * shape.sq, std::nanf(""));
      std::vector<int64_t> stats_host(SPARSA_STAT_COUNT, -1);
      std::vector<int32_t> sel_host(size_t(B) * Hq * shape.skv, 0x5a5a5a5a);
      DeviceBuffer dq(qb.size()), dk(kb.size()), dv(vb.size()), dout(qb.size()), dlse(lse_host.size() * 4),
          dstats(stats_host.size() * 8), dsel(sel_host.size() * 4), dids(ids.size() * 4);
      auto place = [&](DeviceBuffer& d, const void* host, size_t bytes) -> void* {
        if (!gpu) return const_cast<void*>(host);
        d.upload(host, bytes);
        return d.data();
      };
      sparsa_tensor tq = make_tensor(place(dq, qb.data(), qb.size()), SPARSA_DTYPE_BF16, {B, shape.sq, Hq, D}, device);
      sparsa_tensor tk = make_tensor(place(dk, kb.data(), kb.size()), SPARSA_DTYPE_BF16, {B, shape.skv, Hkv, D}, device);
      sparsa_tensor tv = make_tensor(place(dv, vb.data(), vb.size()), SPARSA_DTYPE_BF16, {B, shape.skv, Hkv, D}, device);
      sparsa_tensor tout =
          make_tensor(place(dout, out_host.data(), out_host.size()), SPARSA_DTYPE_BF16, {B, shape.sq, Hq, D}, device);
      sparsa_tensor tlse = make_tensor(place(dlse, lse_host.data(), lse_host.size() * 4), SPARSA_DTYPE_F32,
                                       {B, Hq, shape.sq}, device);
      sparsa_tensor tstats = make_tensor(place(dstats, stats_host.data(), stats_host.size() * 8), SPARSA_DTYPE_I64,
                                         {SPARSA_STAT_COUNT}, device);
      sparsa_tensor tsel = make_tensor(place(dsel, sel_host.data(), sel_host.size() * 4), SPARSA_DTYPE_I32,
                                       {B, Hq, shape.skv}, device);
      sparsa_tensor tids = make_tensor(place(dids, ids.data(), ids.size() * 4), SPARSA_DTYPE_I32, {B, Hq, k}, device);
      sparsa_attention_args args;
      sparsa_attention_args_init(&args);
      args.q = &tq; args.k = &tk; args.v = &tv; args.out = &tout; args.lse = &tlse; args.stats = &tstats;
      args.selected_indices = &tsel;
      sparsa_policy policy;
      sparsa_policy_init(&policy, SPARSA_POLICY_TOKEN_INDICES);
      policy.indices = &tids;
      policy.index_block_size = shape.block_size;
      policy.index_n_init = shape.n_init;
      policy.index_n_local = shape.n_local;
      SPARSA_OK(sparsa_attention_run(ctx, &args, &policy));
      if (gpu) {
        CUDA_OK(cudaDeviceSynchronize());
        out_host = dout.download<uint8_t>(out_host.size());
        lse_host = dlse.download<float>(lse_host.size());
        stats_host = dstats.download<int64_t>(stats_host.size());
        sel_host = dsel.download<int32_t>(sel_host.size());
      }
      res->out = out_host;
      res->lse = lse_host;
      res->stats = stats_host;
      res->selected = sel_host;
      sparsa_context_destroy(ctx);
    };
    Result cpu, gpu;
    run(SPARSA_DEVICE_CPU, &cpu);
    run(SPARSA_DEVICE_CUDA, &gpu);
    ASSERT_FALSE(HasFatalFailure());
    EXPECT_EQ(gpu.selected, cpu.selected);
    EXPECT_EQ(gpu.stats, cpu.stats);
    const std::vector<float> og = decode(gpu.out, SPARSA_DTYPE_BF16), oc = decode(cpu.out, SPARSA_DTYPE_BF16);
    double max_diff = 0, max_ref = 0;
    for (size_t e = 0; e < og.size(); ++e) {
      ASSERT_FALSE(std::isnan(og[e])) << "output element " << e << " not written";
      max_diff = std::max(max_diff, double(std::fabs(og[e] - oc[e])));
      max_ref = std::max(max_ref, double(std::fabs(oc[e])));
    }
    EXPECT_LE(max_diff, 1e-2 * max_ref) << "max |gpu - cpu| " << max_diff << ", max |cpu| " << max_ref;
    for (size_t e = 0; e < gpu.lse.size(); ++e) {
      EXPECT_NEAR(gpu.lse[e], cpu.lse[e], 1e-3 * std::max(1.f, std::fabs(cpu.lse[e]))) << "lse " << e;
    }
  }
}

// §0 merge on the device against the host formula.
TEST(GpuMergeStates, MatchesFormula) {
  SKIP_WITHOUT_GPU();
  const int64_t B = 2, S = 5, H = 3, D = 16;
  std::mt19937 rng(3);
  std::normal_distribution<float> normal(0.f, 1.f);
  std::vector<float> oa(B * S * H * D), ob(oa.size()), la(B * H * S), lb(la.size());
  for (auto& x : oa) x = normal(rng);
  for (auto& x : ob) x = normal(rng);
  for (auto& x : la) x = normal(rng);
  for (auto& x : lb) x = normal(rng);
  la[0] = lb[0] = kNegInf;  // (b0, h0, s0): both empty
  la[1] = kNegInf;          // (b0, h0, s1): only b
  sparsa_context_options options;
  sparsa_context_options_init(&options);
  options.device_type = SPARSA_DEVICE_CUDA;
  sparsa_context* ctx = nullptr;
  SPARSA_OK(sparsa_context_create(&options, &ctx));
  DeviceBuffer doa(oa.size() * 4), dob(ob.size() * 4), dla(la.size() * 4), dlb(lb.size() * 4), dlo(la.size() * 4);
  doa.upload(oa.data(), oa.size() * 4);
  dob.upload(ob.data(), ob.size() * 4);
  dla.upload(la.data(), la.size() * 4);
  dlb.upload(lb.data(), lb.size() * 4);
  dlo.poison();
  sparsa_tensor toa = make_tensor(doa.data(), SPARSA_DTYPE_F32, {B, S, H, D}, SPARSA_DEVICE_CUDA);
  sparsa_tensor tob = make_tensor(dob.data(), SPARSA_DTYPE_F32, {B, S, H, D}, SPARSA_DEVICE_CUDA);
  sparsa_tensor tla = make_tensor(dla.data(), SPARSA_DTYPE_F32, {B, H, S}, SPARSA_DEVICE_CUDA);
  sparsa_tensor tlb = make_tensor(dlb.data(), SPARSA_DTYPE_F32, {B, H, S}, SPARSA_DEVICE_CUDA);
  sparsa_tensor tlo = make_tensor(dlo.data(), SPARSA_DTYPE_F32, {B, H, S}, SPARSA_DEVICE_CUDA);
  SPARSA_OK(sparsa_merge_states(ctx, &toa, &tla, &tob, &tlb, &toa, &tlo));  // in place into o_a
  CUDA_OK(cudaDeviceSynchronize());
  const std::vector<float> out = doa.download<float>(oa.size());
  const std::vector<float> lse = dlo.download<float>(la.size());
  for (int64_t b = 0; b < B; ++b)
    for (int64_t s = 0; s < S; ++s)
      for (int64_t h = 0; h < H; ++h) {
        const int64_t li = (b * H + h) * S + s;
        const double m = std::max(la[li], lb[li]);
        const bool empty = std::isinf(m) && m < 0;
        const double wa = empty ? 0 : std::exp(la[li] - m), wb = empty ? 0 : std::exp(lb[li] - m);
        if (empty) {
          EXPECT_TRUE(std::isinf(lse[li]) && lse[li] < 0);
        } else {
          EXPECT_NEAR(lse[li], m + std::log(wa + wb), 1e-5);
        }
        for (int64_t d = 0; d < D; ++d) {
          const int64_t oi = ((b * S + s) * H + h) * D + d;
          const double want = empty ? 0.0 : (wa * oa[oi] + wb * ob[oi]) / (wa + wb);
          EXPECT_NEAR(out[oi], want, 1e-5) << "b" << b << " s" << s << " h" << h << " d" << d;
        }
      }
  sparsa_context_destroy(ctx);
}

}  // namespace
