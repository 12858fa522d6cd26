// Inputs for the CUDA-graph test of test_gpu_attention.cpp: a case (policy, shapes, layouts, dtype), its random
// inputs, the physical tensors in the case's layout (padded, packed varlen, paged with shuffled pages and junk in
// unused slots) and one run through the public C API on the CPU or CUDA backend with NaN-poisoned outputs. Outputs
// are checked against the float64 reference by the case tables of the shared suite (tests/case_table.h); this file
// has no oracle of its own.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <deque>
#include <limits>
#include <ostream>
#include <random>
#include <string>
#include <vector>

#include "gpu_test_util.h"

namespace sparsa_gpu_test {

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
  float q_scale = 1.f;  // multiplies q: large scores make the running max move across tiles
};

inline void PrintTo(const Case& c, std::ostream* os) { *os << c.name; }

struct Inputs {
  int32_t batch = 0, max_q = 0, max_k = 0;
  std::vector<float> q, k, v;  // logical [b][i][h][d] with per-batch max lengths (padded logical layout)
  std::vector<uint8_t> mask;   // [B, Hq, ceil(max_q/bq), ceil(max_k/bk)]
};

// Physical tensors of one case on one device kind (host memory for the CPU context).
struct Physical {
  std::vector<uint8_t> q, k, v;
  std::vector<int32_t> cu_q, cu_k, page_table, seq_lens_k;
  std::vector<int64_t> q_shape, kv_shape, out_shape, lse_shape, page_table_shape;
  int64_t q_rows = 0;  // rows of q/out (padded: B*max_q, packed: Tq)
};

inline Physical build_physical(const Case& c, Inputs& in, std::mt19937& rng) {
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

inline Inputs make_inputs(const Case& c, std::mt19937& rng) {
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
  for (auto& e : in.q) e *= c.q_scale;
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

inline RunResult run_case(const Case& c, const Inputs& in, const Physical& ph, bool on_gpu) {
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
  sparsa_attention_args_init(&args, sizeof args);
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
  sparsa_policy_init(&policy, sizeof policy, c.policy);
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
  return result;
}

}  // namespace sparsa_gpu_test
