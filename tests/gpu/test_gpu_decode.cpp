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
#include <deque>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "gpu_test_util.h"

namespace {

using namespace sparsa_gpu_test;

// ---- one case: decode rows (Sq = 1) over a paged K/V cache ----

struct Case {
  std::string name;
  int32_t dtype = SPARSA_DTYPE_BF16;
  int32_t head_dim = 128;
  int32_t q_heads = 8, kv_heads = 2;
  std::vector<int32_t> seq_k;  // per sequence, one query row each
  int32_t page_size = 16;
  int32_t policy = SPARSA_POLICY_DENSE;
  // TOKEN_INDICES: H_idx rows of `index_slots` ids (8 % unused, 8 % repeats of the previous slot), blocks, ...
  int32_t index_heads = 0;
  int32_t index_slots = 0;
  int32_t index_block_size = 1;
  int32_t index_n_init = 0, index_n_local = 0;
};

// Logical inputs: q [b][h][d] and k/v [b][t][hk][d] (t < max_k), plus TOKEN_INDICES' ids.
struct Inputs {
  int32_t batch = 0, max_k = 0;
  std::vector<float> q, k, v;  // rounded to the case's dtype
  std::vector<int32_t> indices;
};

float round_to(float x, int32_t dtype) {
  if (dtype == SPARSA_DTYPE_F16) return f16_to_float(float_to_f16(x));
  if (dtype == SPARSA_DTYPE_BF16) return bf16_to_float(float_to_bf16(x));
  return x;
}

Inputs make_inputs(const Case& c, std::mt19937& rng) {
  Inputs in;
  in.batch = int32_t(c.seq_k.size());
  in.max_k = *std::max_element(c.seq_k.begin(), c.seq_k.end());
  const int32_t D = c.head_dim;
  std::normal_distribution<float> normal(0.f, 1.f);
  auto fill = [&](std::vector<float>& x, size_t n) {
    x.resize(n);
    for (float& e : x) e = round_to(std::clamp(normal(rng), -4.f, 4.f), c.dtype);
  };
  fill(in.q, size_t(in.batch) * c.q_heads * D);
  fill(in.k, size_t(in.batch) * in.max_k * c.kv_heads * D);
  fill(in.v, size_t(in.batch) * in.max_k * c.kv_heads * D);
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
  }
  return in;
}

// Outputs of one run: out [b][h][d], lse [b][h]; TOKEN_INDICES: selected [B, Hq, max_k] and the stats.
struct Result {
  std::vector<float> out, lse;
  std::vector<int32_t> selected;
  std::vector<int64_t> stats;
};

// Runs the case on a CUDA context through the public C API, outputs poisoned with NaN. graph = true: the planned run
// is captured in a CUDA graph on the context's own stream and the graph is replayed twice.
void run_case(const Case& c, const Inputs& in, bool graph, Result* result) {
  const int32_t D = c.head_dim, Hq = c.q_heads, Hkv = c.kv_heads, B = in.batch;
  const size_t kv_row = size_t(Hkv) * D;
  // Paged K/V: spare pages, ids shuffled (not the identity); slots no sequence owns hold junk.
  const int32_t ps = c.page_size;
  const int32_t max_pages = (in.max_k + ps - 1) / ps;
  const int32_t pages = B * max_pages + 3;
  std::vector<int32_t> order(pages);
  for (int32_t i = 0; i < pages; ++i) order[i] = (i * 7 + 3) % pages;
  if (std::gcd(7, pages) != 1) std::iota(order.begin(), order.end(), 0);
  std::vector<float> k_phys(size_t(pages) * ps * kv_row, 7.f), v_phys(k_phys.size(), 7.f);
  std::vector<int32_t> page_table(size_t(B) * max_pages, 0);
  for (int32_t b = 0; b < B; ++b) {
    for (int32_t pg = 0; pg < max_pages; ++pg) page_table[size_t(b) * max_pages + pg] = order[b * max_pages + pg];
    for (int32_t t = 0; t < c.seq_k[b]; ++t) {
      const size_t slot = (size_t(page_table[size_t(b) * max_pages + t / ps]) * ps + t % ps) * kv_row;
      const size_t logical = (size_t(b) * in.max_k + t) * kv_row;
      std::copy_n(&in.k[logical], kv_row, k_phys.begin() + slot);
      std::copy_n(&in.v[logical], kv_row, v_phys.begin() + slot);
    }
  }
  const std::vector<uint8_t> qb = encode(in.q, c.dtype), kb = encode(k_phys, c.dtype), vb = encode(v_phys, c.dtype);
  const size_t out_bytes = size_t(B) * Hq * D * element_bytes(c.dtype);
  const size_t lse_count = size_t(B) * Hq;
  const bool token_indices = c.policy == SPARSA_POLICY_TOKEN_INDICES;
  const size_t selected_count = token_indices ? size_t(B) * Hq * in.max_k : 0;
  std::vector<int32_t> seq_lens(c.seq_k.begin(), c.seq_k.end());

  ScopedStream owned_stream;
  if (graph) {
    CUDA_OK(cudaStreamCreate(owned_stream.out()));
  }
  const cudaStream_t stream = owned_stream.get();
  ScopedContext context(context_options(SPARSA_DEVICE_CUDA, stream));
  SPARSA_OK(context.status());
  sparsa_context* const ctx = context.get();
  std::deque<DeviceBuffer> buffers;
  auto place = [&](const void* host, size_t bytes) -> void* {
    buffers.emplace_back(bytes);
    if (host != nullptr) buffers.back().upload(host);
    return buffers.back().data();
  };
  auto tensor = [&](void* data, int32_t dtype, std::vector<int64_t> shape) {
    return make_tensor(data, dtype, std::move(shape), SPARSA_DEVICE_CUDA);
  };
  DeviceBuffer out(out_bytes), lse(lse_count * 4), selected(std::max<size_t>(selected_count, 1) * 4);
  DeviceBuffer stats(SPARSA_STAT_COUNT * 8);
  out.poison();  // NaN in f32/f16/bf16
  lse.poison();
  selected.fill(0x5a);  // not -1, the padding a list writes
  stats.fill(0x5a);
  const std::vector<int64_t> kv_shape = {pages, ps, Hkv, D};
  sparsa_tensor tq = tensor(place(qb.data(), qb.size()), c.dtype, {B, 1, Hq, D});
  sparsa_tensor tk = tensor(place(kb.data(), kb.size()), c.dtype, kv_shape);
  sparsa_tensor tv = tensor(place(vb.data(), vb.size()), c.dtype, kv_shape);
  sparsa_tensor tout = tensor(out.data(), c.dtype, {B, 1, Hq, D});
  sparsa_tensor tlse = tensor(lse.data(), SPARSA_DTYPE_F32, {B, Hq, 1});
  sparsa_tensor tlens = tensor(place(seq_lens.data(), seq_lens.size() * 4), SPARSA_DTYPE_I32, {B});
  sparsa_tensor tpages = tensor(place(page_table.data(), page_table.size() * 4), SPARSA_DTYPE_I32, {B, max_pages});
  sparsa_tensor tstats = tensor(stats.data(), SPARSA_DTYPE_I64, {SPARSA_STAT_COUNT});
  sparsa_tensor tindices, tselected;
  sparsa_attention_args args;
  sparsa_attention_args_init(&args, sizeof args);
  args.q = &tq;
  args.k = &tk;
  args.v = &tv;
  args.out = &tout;
  args.lse = &tlse;
  args.causal = 1;
  args.seq_lens_k = &tlens;
  args.page_table = &tpages;
  sparsa_policy policy;
  sparsa_policy_init(&policy, sizeof policy, c.policy);
  if (token_indices) {
    tindices =
        tensor(place(in.indices.data(), in.indices.size() * 4), SPARSA_DTYPE_I32, {B, c.index_heads, c.index_slots});
    policy.indices = &tindices;
    policy.index_block_size = c.index_block_size;
    policy.index_n_init = c.index_n_init;
    policy.index_n_local = c.index_n_local;
    tselected = tensor(selected.data(), SPARSA_DTYPE_I32, {B, Hq, in.max_k});
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
    for (int replay = 0; replay < 2; ++replay) {
      // Each replay writes every output again (the split-merge arrival counters are back at zero after each).
      out.poison();
      lse.poison();
      CUDA_OK(cudaGraphLaunch(exec.get(), stream));
      CUDA_OK(cudaStreamSynchronize(stream));
    }
  } else {
    SPARSA_OK(sparsa_attention_run(ctx, &args, &policy));
  }
  result->out = decode(out.download(), c.dtype);
  result->lse = lse.download<float>(lse_count);
  result->selected = selected.download<int32_t>(selected_count);
  if (token_indices) result->stats = stats.download<int64_t>(SPARSA_STAT_COUNT);
}

// The two rows of the decode case table (tests/test_attention_case_tables.cpp) that graph replay covers: dense
// decode with many splits over a paged cache, and TOKEN_INDICES with lists per kv group, blocks, n_init and n_local.
std::vector<Case> graph_cases() {
  std::vector<Case> list;
  Case c;
  c.name = "gqa4_bf16_d128_paged16_b2";
  c.seq_k = {5000, 123};
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
    run_case(c, in, /*graph=*/false, &eager);
    run_case(c, in, /*graph=*/true, &replayed);
    ASSERT_FALSE(HasFatalFailure());
    ASSERT_EQ(eager.out.size(), replayed.out.size());
    for (size_t e = 0; e < eager.out.size(); ++e) {
      ASSERT_FALSE(std::isnan(eager.out[e])) << "element " << e << " not written";
      ASSERT_EQ(eager.out[e], replayed.out[e]) << "element " << e;
    }
    for (size_t e = 0; e < eager.lse.size(); ++e) ASSERT_EQ(eager.lse[e], replayed.lse[e]) << "lse " << e;
    EXPECT_EQ(eager.selected, replayed.selected);
    EXPECT_EQ(eager.stats, replayed.stats);
  }
}

}  // namespace
