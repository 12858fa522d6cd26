// CUDA-graph replay of decode-shaped attention (forward_decode.cu's split-KV and combine kernels, token_indices.cu):
// a planned run captured in a graph and replayed twice gives exactly the eager result, through the public C API with
// outputs poisoned with NaN. The decode cases themselves (paged, packed and padded layouts, odd row strides, GQA,
// long sequences, structured inputs, TOKEN_INDICES lists) are rows of the backend-parameterised case table,
// tests/test_attention_case_tables.cpp. Skips cleanly without a device.
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
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "gpu_test_util.h"

namespace {

using namespace sparsa_gpu_test;

// ---- one case ----

enum class KvLayout { kPadded, kPacked, kPaged, kPaddedOddStride };
enum class Structure { kRandom, kNeedle, kSinks };

struct Case {
  std::string name;
  int32_t dtype = SPARSA_DTYPE_BF16;
  int32_t head_dim = 128;
  int32_t q_heads = 8, kv_heads = 2;
  std::vector<int32_t> seq_q{1}, seq_k{1000};  // per sequence; padded q needs one Sq for all
  bool packed_q = false;
  KvLayout kv = KvLayout::kPadded;
  int32_t page_size = 16;
  bool causal = true;
  Structure structure = Structure::kRandom;
  int32_t policy = SPARSA_POLICY_DENSE;
  int32_t sink_tokens = 4, sink_window = 100;
  int32_t block_q = 64, block_k = 64;
  // TOKEN_INDICES: index rows H_idx (Hq: a list per query head, Hkv: per kv group, 1: per sequence), slots, ...
  int32_t index_heads = 0;
  int32_t index_slots = 0;
  int32_t index_block_size = 1;
  int32_t index_n_init = 0, index_n_local = 0;
  bool head_map = false;  // a permuted head_map over H_idx rows
  bool sorted_rows = false;  // rows strictly ascending and duplicate-free (the key-set fast path), except row 0 of b 0
};


// Logical inputs: q [b][i][h][d] and k/v [b][t][hk][d] with per-batch max lengths, plus the policy's tensors.
struct Inputs {
  int32_t batch = 0, max_q = 0, max_k = 0;
  std::vector<float> q, k, v;  // rounded to the case's dtype
  std::vector<uint8_t> mask;   // BLOCK_SPARSE [B, Hq, ceil(max_q/bq), ceil(max_k/bk)]
  std::vector<int32_t> indices, head_map;
};

float round_to(float x, int32_t dtype) {
  if (dtype == SPARSA_DTYPE_F16) return f16_to_float(float_to_f16(x));
  if (dtype == SPARSA_DTYPE_BF16) return bf16_to_float(float_to_bf16(x));
  return x;
}

Inputs make_inputs(const Case& c, std::mt19937& rng) {
  Inputs in;
  in.batch = int32_t(c.seq_q.size());
  in.max_q = *std::max_element(c.seq_q.begin(), c.seq_q.end());
  in.max_k = *std::max_element(c.seq_k.begin(), c.seq_k.end());
  const int32_t D = c.head_dim, Hq = c.q_heads, Hkv = c.kv_heads, g = Hq / Hkv;
  std::normal_distribution<float> normal(0.f, 1.f);
  auto fill = [&](std::vector<float>& x, size_t n) {
    x.resize(n);
    for (float& e : x) e = std::clamp(normal(rng), -4.f, 4.f);
  };
  fill(in.q, size_t(in.batch) * in.max_q * Hq * D);
  fill(in.k, size_t(in.batch) * in.max_k * Hkv * D);
  fill(in.v, size_t(in.batch) * in.max_k * Hkv * D);
  auto k_row = [&](int32_t b, int32_t t, int32_t hk) { return &in.k[((size_t(b) * in.max_k + t) * Hkv + hk) * D]; };
  auto v_row = [&](int32_t b, int32_t t, int32_t hk) { return &in.v[((size_t(b) * in.max_k + t) * Hkv + hk) * D]; };
  for (int32_t b = 0; b < in.batch && c.structure != Structure::kRandom; ++b) {
    for (int32_t hk = 0; hk < Hkv; ++hk) {
      const float* q_last = &in.q[((size_t(b) * in.max_q + c.seq_q[b] - 1) * Hq + hk * g) * D];
      if (c.structure == Structure::kNeedle) {
        // One key late in the sequence points along the group's first head's last query: a sharply peaked row.
        const int32_t t = c.seq_k[b] * 7 / 9;
        for (int32_t d = 0; d < D; ++d) {
          k_row(b, t, hk)[d] = std::clamp(0.6f * q_last[d], -4.f, 4.f);
          v_row(b, t, hk)[d] = 3.f;
        }
      } else {
        // The first 4 keys score high for every query (attention sinks) and carry distinct values.
        for (int32_t t = 0; t < std::min(4, c.seq_k[b]); ++t) {
          for (int32_t d = 0; d < D; ++d) {
            k_row(b, t, hk)[d] = std::clamp(0.4f * q_last[d], -4.f, 4.f);
            v_row(b, t, hk)[d] = float(t) - 1.5f;
          }
        }
      }
    }
  }
  for (auto* x : {&in.q, &in.k, &in.v})
    for (float& e : *x) e = round_to(e, c.dtype);
  if (c.policy == SPARSA_POLICY_BLOCK_SPARSE) {
    const int64_t rows = (in.max_q + c.block_q - 1) / c.block_q, cols = (in.max_k + c.block_k - 1) / c.block_k;
    std::bernoulli_distribution keep(0.35);
    in.mask.resize(size_t(in.batch) * Hq * rows * cols);
    for (auto& m : in.mask) m = keep(rng) ? 1 : 0;
  }
  if (c.policy == SPARSA_POLICY_TOKEN_INDICES) {
    in.indices.resize(size_t(in.batch) * c.index_heads * c.index_slots);
    for (int32_t b = 0; b < in.batch; ++b) {
      const int32_t n_ids = (c.seq_k[b] + c.index_block_size - 1) / c.index_block_size;
      for (int32_t s = 0; s < c.index_heads * c.index_slots; ++s) {
        const size_t at = size_t(b) * c.index_heads * c.index_slots + s;
        const int r = int(rng() % 100);
        in.indices[at] = r < 8 ? -1 : (r < 16 && s > 0 ? in.indices[at - 1] : int32_t(rng() % n_ids));
      }
    }
    for (int32_t b = 0; b < in.batch && c.sorted_rows; ++b) {
      const int32_t n_ids = (c.seq_k[b] + c.index_block_size - 1) / c.index_block_size;
      for (int32_t row = (b == 0 ? 1 : 0); row < c.index_heads; ++row) {
        std::vector<int32_t> pool(n_ids);
        std::iota(pool.begin(), pool.end(), 0);
        std::shuffle(pool.begin(), pool.end(), rng);
        const int32_t taken = std::min(n_ids, c.index_slots);
        std::sort(pool.begin(), pool.begin() + taken);
        if (c.index_block_size > 1 && taken > 0) pool[taken - 1] = n_ids - 1;  // the last block may be partial
        int32_t* slots = &in.indices[(size_t(b) * c.index_heads + row) * c.index_slots];
        for (int32_t s = 0; s < c.index_slots; ++s) slots[s] = s < taken ? pool[s] : -1;
      }
    }
    if (c.head_map) {
      in.head_map.resize(Hq);
      for (int32_t h = 0; h < Hq; ++h) in.head_map[h] = (h * 3 + 1) % c.index_heads;
    }
  }
  return in;
}

// Outputs of one run, in logical form: out [b][i][h][d] and lse [b][h][i] over the valid rows (others NaN).
struct Result {
  std::vector<float> out, lse;
  std::vector<int64_t> stats;
  std::vector<int32_t> selected;  // [B, Hq, max_k]
};

// Runs the case on one context kind in the case's layouts and reads the outputs
// back into logical form. graph = true: captures the planned run in a CUDA graph and replays it twice.
void run_case(const Case& c, const Inputs& in, int32_t device, bool graph, Result* result) {
  const bool gpu = device == SPARSA_DEVICE_CUDA;
  const int32_t D = c.head_dim, Hq = c.q_heads, Hkv = c.kv_heads, B = in.batch;
  const bool packed_q = c.packed_q;
  const KvLayout kv = c.kv;
  const size_t eb = element_bytes(c.dtype);

  // Physical q/out rows and k/v rows.
  std::vector<float> q_phys;
  std::vector<int32_t> cu_q{0};
  int64_t q_rows = 0;
  for (int32_t b = 0; b < B; ++b) {
    const int32_t rows = packed_q ? c.seq_q[b] : in.max_q;
    for (int32_t i = 0; i < rows; ++i) {
      const float* row = &in.q[(size_t(b) * in.max_q + i) * Hq * D];
      q_phys.insert(q_phys.end(), row, row + size_t(Hq) * D);
    }
    q_rows += rows;
    cu_q.push_back(cu_q.back() + c.seq_q[b]);
  }
  const size_t kv_row = size_t(Hkv) * D;
  auto logical_kv = [&](const std::vector<float>& src, int32_t b, int32_t t) {
    return &src[(size_t(b) * in.max_k + t) * kv_row];
  };
  std::vector<float> k_phys, v_phys;
  std::vector<int32_t> cu_k{0}, page_table;
  std::vector<int64_t> kv_shape, kv_strides;
  int32_t max_pages = 0;
  const int64_t odd_pitch = int64_t(kv_row) + 4;  // rows 8 bytes past a 16-byte boundary: CUDA-core path
  if (kv == KvLayout::kPadded || kv == KvLayout::kPaddedOddStride) {
    const int64_t pitch = kv == KvLayout::kPadded ? int64_t(kv_row) : odd_pitch;
    k_phys.assign(size_t(B) * in.max_k * pitch, 5.f);
    v_phys.assign(k_phys.size(), 5.f);
    for (int32_t b = 0; b < B; ++b) {
      for (int32_t t = 0; t < in.max_k; ++t) {
        std::copy_n(logical_kv(in.k, b, t), kv_row, k_phys.begin() + (size_t(b) * in.max_k + t) * pitch);
        std::copy_n(logical_kv(in.v, b, t), kv_row, v_phys.begin() + (size_t(b) * in.max_k + t) * pitch);
      }
    }
    kv_shape = {B, in.max_k, Hkv, D};
    kv_strides = {in.max_k * pitch, pitch, D, 1};
  } else if (kv == KvLayout::kPacked) {
    for (int32_t b = 0; b < B; ++b) {
      for (int32_t t = 0; t < c.seq_k[b]; ++t) {
        k_phys.insert(k_phys.end(), logical_kv(in.k, b, t), logical_kv(in.k, b, t) + kv_row);
        v_phys.insert(v_phys.end(), logical_kv(in.v, b, t), logical_kv(in.v, b, t) + kv_row);
      }
      cu_k.push_back(cu_k.back() + c.seq_k[b]);
    }
    kv_shape = {cu_k.back(), Hkv, D};
    kv_strides = {int64_t(kv_row), D, 1};
  } else {
    const int32_t ps = c.page_size;
    max_pages = (in.max_k + ps - 1) / ps;
    const int32_t pages = B * max_pages + 3;  // spare pages, shuffled: ids are not the identity
    std::vector<int32_t> order(pages);
    for (int32_t i = 0; i < pages; ++i) order[i] = (i * 7 + 3) % pages;
    if (std::gcd(7, pages) != 1) std::iota(order.begin(), order.end(), 0);
    k_phys.assign(size_t(pages) * ps * kv_row, 7.f);  // slots no sequence owns hold junk
    v_phys.assign(k_phys.size(), 7.f);
    page_table.assign(size_t(B) * max_pages, 0);
    for (int32_t b = 0; b < B; ++b) {
      for (int32_t pg = 0; pg < max_pages; ++pg) page_table[size_t(b) * max_pages + pg] = order[b * max_pages + pg];
      for (int32_t t = 0; t < c.seq_k[b]; ++t) {
        const size_t slot = (size_t(page_table[size_t(b) * max_pages + t / ps]) * ps + t % ps) * kv_row;
        std::copy_n(logical_kv(in.k, b, t), kv_row, k_phys.begin() + slot);
        std::copy_n(logical_kv(in.v, b, t), kv_row, v_phys.begin() + slot);
      }
    }
    kv_shape = {pages, ps, Hkv, D};
    kv_strides = {int64_t(ps) * int64_t(kv_row), int64_t(kv_row), D, 1};
  }
  const std::vector<uint8_t> qb = encode(q_phys, c.dtype), kb = encode(k_phys, c.dtype), vb = encode(v_phys, c.dtype);
  const size_t out_bytes = size_t(q_rows) * Hq * D * eb;
  const size_t lse_count = size_t(q_rows) * Hq;
  std::vector<uint8_t> out_host(out_bytes, 0xff);  // NaN in f32/f16/bf16
  std::vector<float> lse_host(lse_count, std::numeric_limits<float>::quiet_NaN());
  std::vector<int64_t> stats_host(SPARSA_STAT_COUNT, -1);
  const bool token_indices = c.policy == SPARSA_POLICY_TOKEN_INDICES;
  std::vector<int32_t> selected_host(token_indices ? size_t(B) * Hq * in.max_k : 0, 0x5a5a5a5a);
  std::vector<int32_t> seq_lens(c.seq_k.begin(), c.seq_k.end());

  sparsa_context_options options;
  sparsa_context_options_init(&options, sizeof options);
  options.device_type = device;
  ScopedStream owned_stream;
  if (graph) {
    CUDA_OK(cudaStreamCreate(owned_stream.out()));
  }
  const cudaStream_t stream = owned_stream.get();
  options.stream = stream;
  ScopedContext context(options);
  SPARSA_OK(context.status());
  sparsa_context* const ctx = context.get();
  std::deque<DeviceBuffer> buffers;
  auto place = [&](const void* host, size_t bytes) -> void* {
    if (!gpu) return const_cast<void*>(host);
    buffers.emplace_back(bytes);
    EXPECT_EQ(cudaMemcpy(buffers.back().data(), host, bytes, cudaMemcpyHostToDevice), cudaSuccess);
    return buffers.back().data();
  };
  auto tensor = [&](void* data, int32_t dtype, std::vector<int64_t> shape) {
    sparsa_tensor t;
    EXPECT_EQ(sparsa_tensor_init(&t, sizeof t, data, dtype, int32_t(shape.size()), shape.data()),
              SPARSA_STATUS_SUCCESS);
    t.device_type = device;
    return t;
  };
  const std::vector<int64_t> q_shape = packed_q ? std::vector<int64_t>{q_rows, Hq, D}
                                                : std::vector<int64_t>{B, in.max_q, Hq, D};
  void* out_ptr = place(out_host.data(), out_bytes);
  void* lse_ptr = place(lse_host.data(), lse_count * 4);
  void* stats_ptr = place(stats_host.data(), stats_host.size() * 8);
  void* selected_ptr = token_indices ? place(selected_host.data(), selected_host.size() * 4) : nullptr;
  sparsa_tensor tq = tensor(place(qb.data(), qb.size()), c.dtype, q_shape);
  sparsa_tensor tk = tensor(place(kb.data(), kb.size()), c.dtype, kv_shape);
  sparsa_tensor tv = tensor(place(vb.data(), vb.size()), c.dtype, kv_shape);
  for (size_t d = 0; d < kv_strides.size(); ++d) tk.strides[d] = tv.strides[d] = kv_strides[d];
  sparsa_tensor tout = tensor(out_ptr, c.dtype, q_shape);
  sparsa_tensor tlse = tensor(lse_ptr, SPARSA_DTYPE_F32,
                              packed_q ? std::vector<int64_t>{Hq, q_rows} : std::vector<int64_t>{B, Hq, in.max_q});
  sparsa_tensor tstats = tensor(stats_ptr, SPARSA_DTYPE_I64, {SPARSA_STAT_COUNT});
  sparsa_tensor tcu_q, tcu_k, tpages, tlens, tmask, tindices, tmap, tselected;
  sparsa_attention_args args;
  sparsa_attention_args_init(&args, sizeof args);
  args.q = &tq;
  args.k = &tk;
  args.v = &tv;
  args.out = &tout;
  args.lse = &tlse;
  args.causal = c.causal ? 1 : 0;
  if (packed_q) {
    tcu_q = tensor(place(cu_q.data(), cu_q.size() * 4), SPARSA_DTYPE_I32, {int64_t(cu_q.size())});
    args.cu_seqlens_q = &tcu_q;
  }
  if (kv == KvLayout::kPacked) {
    tcu_k = tensor(place(cu_k.data(), cu_k.size() * 4), SPARSA_DTYPE_I32, {int64_t(cu_k.size())});
    args.cu_seqlens_k = &tcu_k;
  } else {
    tlens = tensor(place(seq_lens.data(), seq_lens.size() * 4), SPARSA_DTYPE_I32, {B});
    args.seq_lens_k = &tlens;
  }
  if (kv == KvLayout::kPaged) {
    tpages = tensor(place(page_table.data(), page_table.size() * 4), SPARSA_DTYPE_I32, {B, max_pages});
    args.page_table = &tpages;
  }
  sparsa_policy policy;
  sparsa_policy_init(&policy, sizeof policy, c.policy);
  policy.sink_tokens = c.sink_tokens;
  policy.sink_window = c.sink_window;
  policy.block_q = c.block_q;
  policy.block_k = c.block_k;
  if (c.policy == SPARSA_POLICY_BLOCK_SPARSE) {
    const int64_t rows = (in.max_q + c.block_q - 1) / c.block_q, cols = (in.max_k + c.block_k - 1) / c.block_k;
    tmask = tensor(place(in.mask.data(), in.mask.size()), SPARSA_DTYPE_U8, {B, Hq, rows, cols});
    policy.block_mask = &tmask;
  }
  if (token_indices) {
    tindices = tensor(place(in.indices.data(), in.indices.size() * 4), SPARSA_DTYPE_I32,
                      {B, c.index_heads, c.index_slots});
    policy.indices = &tindices;
    if (c.head_map) {
      tmap = tensor(place(in.head_map.data(), in.head_map.size() * 4), SPARSA_DTYPE_I32, {Hq});
      policy.head_map = &tmap;
    }
    policy.index_block_size = c.index_block_size;
    policy.index_n_init = c.index_n_init;
    policy.index_n_local = c.index_n_local;
    tselected = tensor(selected_ptr, SPARSA_DTYPE_I32, {B, Hq, in.max_k});
    args.selected_indices = &tselected;
    args.stats = &tstats;
  }
  if (graph) {
    SPARSA_OK(sparsa_attention_plan(ctx, &args, &policy));
    ScopedGraph captured;
    CUDA_OK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal));
    const sparsa_status status = sparsa_attention_run(ctx, &args, &policy);
    CUDA_OK(cudaStreamEndCapture(stream, captured.out()));
    ASSERT_EQ(status, SPARSA_STATUS_SUCCESS) << sparsa_last_error_message();
    ScopedGraphExec exec;
    CUDA_OK(cudaGraphInstantiate(exec.out(), captured.get(), 0));
    for (int replay = 0; replay < 2; ++replay) CUDA_OK(cudaGraphLaunch(exec.get(), stream));
    CUDA_OK(cudaStreamSynchronize(stream));
  } else {
    SPARSA_OK(sparsa_attention_run(ctx, &args, &policy));
  }
  if (gpu) {
    CUDA_OK(cudaDeviceSynchronize());
    CUDA_OK(cudaMemcpy(out_host.data(), out_ptr, out_bytes, cudaMemcpyDeviceToHost));
    CUDA_OK(cudaMemcpy(lse_host.data(), lse_ptr, lse_count * 4, cudaMemcpyDeviceToHost));
    CUDA_OK(cudaMemcpy(stats_host.data(), stats_ptr, stats_host.size() * 8, cudaMemcpyDeviceToHost));
    if (token_indices) {
      CUDA_OK(cudaMemcpy(selected_host.data(), selected_ptr, selected_host.size() * 4, cudaMemcpyDeviceToHost));
    }
  }

  // Logical form.
  const std::vector<float> out_values = decode(out_host, c.dtype);
  result->out.assign(size_t(B) * in.max_q * Hq * D, std::numeric_limits<float>::quiet_NaN());
  result->lse.assign(size_t(B) * Hq * in.max_q, std::numeric_limits<float>::quiet_NaN());
  for (int32_t b = 0; b < B; ++b) {
    for (int32_t i = 0; i < c.seq_q[b]; ++i) {
      const int64_t row = packed_q ? cu_q[b] + i : int64_t(b) * in.max_q + i;
      for (int32_t h = 0; h < Hq; ++h) {
        std::copy_n(&out_values[(size_t(row) * Hq + h) * D], D,
                    &result->out[((size_t(b) * in.max_q + i) * Hq + h) * D]);
        result->lse[(size_t(b) * Hq + h) * in.max_q + i] =
            packed_q ? lse_host[size_t(h) * q_rows + row] : lse_host[(size_t(b) * Hq + h) * in.max_q + i];
      }
    }
  }
  result->stats = stats_host;
  result->selected = selected_host;
}

// The two rows of the decode case table (tests/test_attention_case_tables.cpp) that graph replay covers: dense
// decode with many splits over a paged cache, and TOKEN_INDICES with lists per kv group, blocks, n_init and n_local.
std::vector<Case> graph_cases() {
  std::vector<Case> list;
  Case c;
  c.name = "gqa4_bf16_d128_paged16_b2";
  c.kv = KvLayout::kPaged;
  c.seq_k = {5000, 123};
  c.seq_q = {1, 1};
  list.push_back(c);
  c = Case{};
  c.name = "indices_list_per_group_f16_d64_blocks_init_local";  // H_idx = Hkv: heads of a group share a list
  c.dtype = SPARSA_DTYPE_F16;
  c.head_dim = 64;
  c.q_heads = 16;
  c.kv_heads = 2;
  c.policy = SPARSA_POLICY_TOKEN_INDICES;
  c.index_heads = 2;
  c.index_slots = 300;
  c.index_block_size = 16;
  c.index_n_init = 4;
  c.index_n_local = 64;
  c.kv = KvLayout::kPaged;
  c.seq_q = {1, 1, 1};
  c.seq_k = {50000, 31, 8000};
  list.push_back(c);
  return list;
}

// A planned decode run with many splits (and a TOKEN_INDICES run) captured in a CUDA graph replays to exactly the
// eager result (ABI.md rule 9: a run only enqueues).
TEST(GpuDecodeGraph, CaptureAndReplayMatchesEager) {
  if (!cuda_device_present()) GTEST_SKIP() << "no CUDA device/driver";
  for (const Case& c : graph_cases()) {
    SCOPED_TRACE(c.name);
    std::mt19937 rng(99);
    const Inputs in = make_inputs(c, rng);
    Result eager, replayed;
    run_case(c, in, SPARSA_DEVICE_CUDA, /*graph=*/false, &eager);
    run_case(c, in, SPARSA_DEVICE_CUDA, /*graph=*/true, &replayed);
    ASSERT_FALSE(HasFatalFailure());
    ASSERT_EQ(eager.out.size(), replayed.out.size());
    for (size_t e = 0; e < eager.out.size(); ++e) {
      if (std::isnan(eager.out[e]) && std::isnan(replayed.out[e])) continue;  // rows past a sequence
      ASSERT_EQ(eager.out[e], replayed.out[e]) << "element " << e;
    }
    EXPECT_EQ(eager.selected, replayed.selected);
  }
}

}  // namespace
