// What only CUDA has in the selection machinery: the device selection cache under CUDA-graph replay against the CPU
// backend (the oracle) on identical inputs, TOKEN_SELECT's index sets composed inside the decode walk against the
// listed run, and sparsa_kv_prefetch from pinned (CUDA_HOST) and device sources. The
// device top-k is the backend-parameterised table TopKCases (tests/test_topk_prefetch.cpp), the TOKEN_SELECT cases
// without a cache are rows of SelectCases (tests/test_attention_case_tables.cpp). Outputs are poisoned before every
// run; everything skips cleanly without a CUDA device.
#include <cuda_runtime.h>
#include <gtest/gtest.h>
#include <sparsa/sparsa.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "gpu_test_util.h"

namespace {

using namespace sparsa_gpu_test;

// ---- memory and contexts ----

struct Context {
  explicit Context(int32_t device_type, cudaStream_t stream = nullptr) {
    sparsa_context_options options;
    sparsa_context_options_init(&options, sizeof options);
    options.device_type = device_type;
    options.stream = stream;
    status = sparsa_context_create(&options, &ctx);
  }
  ~Context() { sparsa_context_destroy(ctx); }
  Context(const Context&) = delete;
  Context& operator=(const Context&) = delete;
  sparsa_context* ctx = nullptr;
  sparsa_status status = SPARSA_STATUS_SUCCESS;
};

// =====================================================================================================================
// TOKEN_SELECT: the same inputs on the CPU backend and on the device
// =====================================================================================================================

enum class KvLayout { kPadded, kPacked, kPaged };

struct SelectCase {
  std::string name;
  int32_t dtype = SPARSA_DTYPE_BF16;
  int32_t head_dim = 128, q_heads = 32, kv_heads = 8;
  std::vector<int32_t> seq_q{1}, seq_k{3000};
  bool q_packed = false;
  KvLayout kv_layout = KvLayout::kPadded;
  int32_t page_size = 16;
  int32_t kv_row_pad = 0;  // extra elements after every k/v row: unaligned rows (padded layout only)
  int32_t n_init = 16, top_k = 128, n_local = 32;
  bool per_kv_head = false, scale_scores = false;
  float theta = 0.9f;
  int32_t needles = 0;  // per sequence: candidate keys made to match the mean query (must be selected)
};

struct SelectInputs {
  int32_t batch = 0, max_q = 0, max_k = 0;
  std::vector<float> q, k, v;  // logical [b][i][h][d] / [b][t][hk][d], padded to the max lengths
  std::vector<std::vector<int32_t>> needles;
};

SelectInputs make_select_inputs(const SelectCase& c, std::mt19937& rng) {
  SelectInputs in;
  in.batch = int32_t(c.seq_q.size());
  in.max_q = *std::max_element(c.seq_q.begin(), c.seq_q.end());
  in.max_k = *std::max_element(c.seq_k.begin(), c.seq_k.end());
  const int32_t D = c.head_dim, Hq = c.q_heads, Hkv = c.kv_heads;
  std::normal_distribution<float> normal;
  in.q.resize(size_t(in.batch) * in.max_q * Hq * D);
  in.k.resize(size_t(in.batch) * in.max_k * Hkv * D);
  in.v.resize(in.k.size());
  for (float& x : in.q) x = normal(rng);
  for (float& x : in.k) x = normal(rng);
  for (float& x : in.v) x = normal(rng);
  // A needle: at a random candidate position, every kv head's key points along the sum of its group's query rows
  // (3·sqrt(D) long), far above what random keys score.
  in.needles.resize(in.batch);
  const int32_t g = Hq / Hkv;
  for (int32_t b = 0; b < in.batch; ++b) {
    const int32_t rows = c.q_packed ? c.seq_q[b] : in.max_q;  // padded q: every sequence has max_q rows
    const int32_t first = c.n_init, last = c.seq_k[b] - c.n_local;
    for (int32_t n = 0; n < c.needles && last > first; ++n) {
      const int32_t t = first + int32_t(rng() % uint32_t(last - first));
      in.needles[b].push_back(t);
      for (int32_t hk = 0; hk < Hkv; ++hk) {
        std::vector<double> u(D, 0.0);
        double norm = 0.0;
        for (int32_t d = 0; d < D; ++d) {
          for (int32_t i = 0; i < rows; ++i)
            for (int32_t l = 0; l < g; ++l) u[d] += in.q[((size_t(b) * in.max_q + i) * Hq + hk * g + l) * D + d];
          norm += u[d] * u[d];
        }
        for (int32_t d = 0; d < D; ++d)
          in.k[((size_t(b) * in.max_k + t) * Hkv + hk) * D + d] = float(3.0 * std::sqrt(double(D)) * u[d] / std::sqrt(norm));
      }
    }
  }
  return in;
}

// Host images of the physical tensors (the CPU context reads them directly; the device gets copies).
struct SelectTensors {
  std::vector<uint8_t> q, k, v;
  std::vector<int32_t> cu_q, cu_k, page_table, seq_lens_k;
  std::vector<int64_t> q_shape, kv_shape, kv_strides, lse_shape, page_table_shape;
  size_t out_bytes = 0, lse_count = 0;
  int64_t sets = 1, cap = 0;
};

SelectTensors build_select_tensors(const SelectCase& c, SelectInputs& in, std::mt19937& rng) {
  SelectTensors t;
  const int32_t D = c.head_dim, Hq = c.q_heads, Hkv = c.kv_heads, B = in.batch;
  std::vector<float> q, k, v;
  if (c.q_packed) {
    t.cu_q.push_back(0);
    for (int32_t b = 0; b < B; ++b) {
      q.insert(q.end(), in.q.begin() + size_t(b) * in.max_q * Hq * D,
               in.q.begin() + (size_t(b) * in.max_q + c.seq_q[b]) * Hq * D);
      t.cu_q.push_back(t.cu_q.back() + c.seq_q[b]);
    }
    t.q_shape = {t.cu_q.back(), Hq, D};
    t.lse_shape = {Hq, t.cu_q.back()};
  } else {
    q = in.q;
    t.q_shape = {B, in.max_q, Hq, D};
    t.lse_shape = {B, Hq, in.max_q};
  }
  const size_t row = size_t(Hkv) * D;
  auto kv_row = [&](const std::vector<float>& src, int32_t b, int32_t tok) { return src.begin() + (size_t(b) * in.max_k + tok) * row; };
  if (c.kv_layout == KvLayout::kPadded) {
    const int32_t pitch = D + c.kv_row_pad;
    k.assign(size_t(B) * in.max_k * Hkv * pitch, 9.f);
    v.assign(k.size(), 9.f);
    for (size_t r = 0; r < size_t(B) * in.max_k * Hkv; ++r) {
      std::copy(in.k.begin() + r * D, in.k.begin() + (r + 1) * D, k.begin() + r * pitch);
      std::copy(in.v.begin() + r * D, in.v.begin() + (r + 1) * D, v.begin() + r * pitch);
    }
    t.kv_shape = {B, in.max_k, Hkv, D};
    t.kv_strides = {int64_t(in.max_k) * Hkv * pitch, int64_t(Hkv) * pitch, pitch, 1};
    t.seq_lens_k = c.seq_k;
  } else if (c.kv_layout == KvLayout::kPacked) {
    t.cu_k.push_back(0);
    for (int32_t b = 0; b < B; ++b) {
      k.insert(k.end(), kv_row(in.k, b, 0), kv_row(in.k, b, c.seq_k[b]));
      v.insert(v.end(), kv_row(in.v, b, 0), kv_row(in.v, b, c.seq_k[b]));
      t.cu_k.push_back(t.cu_k.back() + c.seq_k[b]);
    }
    t.kv_shape = {t.cu_k.back(), Hkv, D};
  } else {
    const int32_t ps = c.page_size, max_pages = (in.max_k + ps - 1) / ps, pages = B * max_pages + 2;
    std::vector<int32_t> order(pages);
    std::iota(order.begin(), order.end(), 0);
    std::shuffle(order.begin(), order.end(), rng);
    k.assign(size_t(pages) * ps * row, 9.f);
    v.assign(k.size(), 9.f);
    t.page_table.assign(size_t(B) * max_pages, 0);
    for (int32_t b = 0; b < B; ++b) {
      for (int32_t pg = 0; pg < max_pages; ++pg) t.page_table[size_t(b) * max_pages + pg] = order[b * max_pages + pg];
      for (int32_t tok = 0; tok < c.seq_k[b]; ++tok) {
        const size_t slot = (size_t(t.page_table[size_t(b) * max_pages + tok / ps]) * ps + tok % ps) * row;
        std::copy(kv_row(in.k, b, tok), kv_row(in.k, b, tok) + row, k.begin() + slot);
        std::copy(kv_row(in.v, b, tok), kv_row(in.v, b, tok) + row, v.begin() + slot);
      }
    }
    t.kv_shape = {pages, ps, Hkv, D};
    t.page_table_shape = {B, max_pages};
    t.seq_lens_k = c.seq_k;
  }
  t.q = encode_rounded(q, c.dtype);
  t.k = encode_rounded(k, c.dtype);
  t.v = encode_rounded(v, c.dtype);
  // The device must see what the CPU sees: read the rounded values back into the logical inputs.
  t.out_bytes = t.q.size();
  t.lse_count = size_t(Hq) * (c.q_packed ? t.cu_q.back() : int64_t(B) * in.max_q);
  t.sets = c.per_kv_head ? Hkv : 1;
  t.cap = int64_t(c.n_init) + c.top_k + c.n_local + 5;
  return t;
}

struct SelectResult {
  sparsa_status status = SPARSA_STATUS_SUCCESS;
  std::string message;
  std::vector<float> out, lse;
  std::vector<int32_t> selected;
  std::vector<int64_t> stats;
};

// Runs a case on one context. For a CUDA context every tensor is copied to the device and the outputs poisoned.
class SelectRunner {
 public:
  SelectRunner(const SelectCase& c, const SelectTensors& t, Context& ctx, int32_t device_type)
      : c_(c), t_(t), ctx_(ctx), device_(device_type) {
    auto host_or_device = [&](const void* host, size_t bytes) -> void* {
      if (device_ == SPARSA_DEVICE_CPU) {
        host_copies_.emplace_back(static_cast<const uint8_t*>(host), static_cast<const uint8_t*>(host) + bytes);
        return host_copies_.back().data();
      }
      buffers_.push_back(std::make_unique<DeviceBuffer>(bytes));
      buffers_.back()->upload(host);
      return buffers_.back()->data();
    };
    q_ = host_or_device(t.q.data(), t.q.size());
    k_ = host_or_device(t.k.data(), t.k.size());
    v_ = host_or_device(t.v.data(), t.v.size());
    if (!t.cu_q.empty()) cu_q_ = host_or_device(t.cu_q.data(), t.cu_q.size() * 4);
    if (!t.cu_k.empty()) cu_k_ = host_or_device(t.cu_k.data(), t.cu_k.size() * 4);
    if (!t.page_table.empty()) pages_ = host_or_device(t.page_table.data(), t.page_table.size() * 4);
    if (!t.seq_lens_k.empty()) lens_ = host_or_device(t.seq_lens_k.data(), t.seq_lens_k.size() * 4);
    const int32_t B = int32_t(c.seq_q.size());
    selected_count_ = size_t(B) * t.sets * t.cap;
    std::vector<uint8_t> zeros(t.out_bytes + t.lse_count * 4 + selected_count_ * 4 + 8 * 8, 0);
    out_ = host_or_device(zeros.data(), t.out_bytes);
    lse_ = host_or_device(zeros.data(), t.lse_count * 4);
    selected_ = host_or_device(zeros.data(), selected_count_ * 4);
    stats_ = host_or_device(zeros.data(), 7 * 8);
    if (device_ != SPARSA_DEVICE_CPU) outputs_ = {buffers_.end() - 4, buffers_.end()};
  }

  // q changes between decode steps (the cache tests): new host bytes of the same size.
  void set_q(const std::vector<uint8_t>& bytes) {
    if (device_ == SPARSA_DEVICE_CPU) {
      std::memcpy(q_, bytes.data(), bytes.size());
    } else {
      EXPECT_EQ(cudaMemcpy(q_, bytes.data(), bytes.size(), cudaMemcpyHostToDevice), cudaSuccess);
    }
  }

  sparsa_attention_args args() {
    const int32_t dev = device_;
    tq_ = make_tensor(q_, c_.dtype, t_.q_shape, dev);
    tk_ = make_tensor(k_, c_.dtype, t_.kv_shape, dev, t_.kv_strides);
    tv_ = make_tensor(v_, c_.dtype, t_.kv_shape, dev, t_.kv_strides);
    tout_ = make_tensor(out_, c_.dtype, t_.q_shape, dev);
    tlse_ = make_tensor(lse_, SPARSA_DTYPE_F32, t_.lse_shape, dev);
    const int64_t B = int64_t(c_.seq_q.size());
    tsel_ = make_tensor(selected_, SPARSA_DTYPE_I32, {B, t_.sets, t_.cap}, dev);
    tstats_ = make_tensor(stats_, SPARSA_DTYPE_I64, {7}, dev);
    sparsa_attention_args a;
    sparsa_attention_args_init(&a, sizeof a);
    a.q = &tq_;
    a.k = &tk_;
    a.v = &tv_;
    a.out = &tout_;
    a.lse = &tlse_;
    a.selected_indices = index_outputs_ ? &tsel_ : nullptr;
    a.stats = index_outputs_ ? &tstats_ : nullptr;
    if (cu_q_ != nullptr) a.cu_seqlens_q = &(tcu_q_ = make_tensor(cu_q_, SPARSA_DTYPE_I32, {B + 1}, dev));
    if (cu_k_ != nullptr) a.cu_seqlens_k = &(tcu_k_ = make_tensor(cu_k_, SPARSA_DTYPE_I32, {B + 1}, dev));
    if (pages_ != nullptr) a.page_table = &(tpages_ = make_tensor(pages_, SPARSA_DTYPE_I32, t_.page_table_shape, dev));
    if (lens_ != nullptr) a.seq_lens_k = &(tlens_ = make_tensor(lens_, SPARSA_DTYPE_I32, {B}, dev));
    a.selection_cache = cache_;
    return a;
  }

  sparsa_policy policy() const {
    sparsa_policy p;
    sparsa_policy_init(&p, sizeof p, SPARSA_POLICY_TOKEN_SELECT);
    p.select_n_init = c_.n_init;
    p.select_top_k = c_.top_k;
    p.select_n_local = c_.n_local;
    p.select_per_kv_head = c_.per_kv_head;
    p.select_scale_scores = c_.scale_scores;
    p.select_cache_theta = c_.theta;
    return p;
  }

  void use_cache(sparsa_selection_cache* cache) { cache_ = cache; }
  // Runs without selected_indices and stats (what a serving loop passes): the device then composes each index set
  // inside the attention walk instead of building lists first.
  void omit_index_outputs() { index_outputs_ = false; }

  void poison() {
    for (auto it = outputs_.first; it != outputs_.second; ++it) (*it)->poison();
  }

  SelectResult run() {
    poison();
    sparsa_attention_args a = args();
    const sparsa_policy p = policy();
    SelectResult r;
    r.status = sparsa_attention_run(ctx_.ctx, &a, &p);
    if (r.status != SPARSA_STATUS_SUCCESS) r.message = sparsa_last_error_message();
    collect(r);
    return r;
  }

  void collect(SelectResult& r) {
    std::vector<uint8_t> out(t_.out_bytes);
    r.lse.resize(t_.lse_count);
    r.selected.resize(selected_count_);
    r.stats.resize(7);
    fetch(out_, out.data(), out.size());
    fetch(lse_, r.lse.data(), r.lse.size() * 4);
    fetch(selected_, r.selected.data(), r.selected.size() * 4);
    fetch(stats_, r.stats.data(), 7 * 8);
    r.out = decode(out, c_.dtype);
  }

 private:
  void fetch(const void* from, void* to, size_t bytes) {
    if (device_ == SPARSA_DEVICE_CPU) {
      std::memcpy(to, from, bytes);
    } else {
      EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
      EXPECT_EQ(cudaMemcpy(to, from, bytes, cudaMemcpyDeviceToHost), cudaSuccess);
    }
  }

  const SelectCase& c_;
  const SelectTensors& t_;
  Context& ctx_;
  int32_t device_;
  std::vector<std::vector<uint8_t>> host_copies_;
  std::vector<std::unique_ptr<DeviceBuffer>> buffers_;
  std::pair<std::vector<std::unique_ptr<DeviceBuffer>>::iterator, std::vector<std::unique_ptr<DeviceBuffer>>::iterator>
      outputs_;
  void *q_ = nullptr, *k_ = nullptr, *v_ = nullptr, *cu_q_ = nullptr, *cu_k_ = nullptr, *pages_ = nullptr,
       *lens_ = nullptr, *out_ = nullptr, *lse_ = nullptr, *selected_ = nullptr, *stats_ = nullptr;
  size_t selected_count_ = 0;
  sparsa_selection_cache* cache_ = nullptr;
  bool index_outputs_ = true;
  sparsa_tensor tq_, tk_, tv_, tout_, tlse_, tsel_, tstats_, tcu_q_, tcu_k_, tpages_, tlens_;
};

double output_tolerance(int32_t dtype) {
  return dtype == SPARSA_DTYPE_F32 ? 1e-4 : dtype == SPARSA_DTYPE_F16 ? 4e-3 : 3e-2;
}

// Device vs CPU: identical index sets and counters, outputs within the dtype's rounding. (The seeded inputs of the
// graph-replay case select the same sets with fp32 and float64 scores; a different draw could put a decision inside
// the fp32 scores' §0 bound, which the case tables' audit allows for.)
void expect_same(const SelectCase& c, const SelectResult& gpu, const SelectResult& cpu) {
  ASSERT_EQ(cpu.status, SPARSA_STATUS_SUCCESS) << cpu.message;
  ASSERT_EQ(gpu.status, SPARSA_STATUS_SUCCESS) << gpu.message;
  ASSERT_EQ(gpu.selected.size(), cpu.selected.size());
  for (int s = 0; s < 7; ++s) EXPECT_EQ(gpu.stats[s], cpu.stats[s]) << "stat " << s;
  ASSERT_EQ(gpu.selected, cpu.selected) << c.name << ": selected_indices";
  const double tol = output_tolerance(c.dtype);
  for (size_t i = 0; i < cpu.out.size(); ++i) {
    ASSERT_NEAR(gpu.out[i], cpu.out[i], tol * (1 + std::fabs(cpu.out[i]))) << "out " << i;
  }
  for (size_t i = 0; i < cpu.lse.size(); ++i) {
    if (std::isinf(cpu.lse[i])) {
      ASSERT_EQ(gpu.lse[i], cpu.lse[i]) << "lse " << i;
      continue;
    }
    ASSERT_NEAR(gpu.lse[i], cpu.lse[i], 2e-3 * (1 + std::fabs(cpu.lse[i]))) << "lse " << i;
  }
}

// The selection cache under CUDA-graph replay: one captured decode step replayed with a new query each time —
// a miss (empty cache), a hit (a nearby query reuses T although a fresh vote differs), a miss (unrelated query), and
// sequence 0 hitting while sequence 1 misses — each compared with the CPU backend running the same steps on its own
// cache.
TEST(GpuTokenSelectCache, GraphReplayHitThenMiss) {
  SKIP_WITHOUT_GPU();
  SelectCase c;
  c.seq_q = {1, 1};
  c.seq_k = {3000, 2400};
  c.theta = 0.5f;
  std::mt19937 rng(5);
  SelectInputs in = make_select_inputs(c, rng);
  const SelectTensors t = build_select_tensors(c, in, rng);
  std::vector<std::vector<uint8_t>> queries;  // q0, q0 + noise (cos > 0.5), unrelated, then half of each
  std::normal_distribution<float> normal;
  std::vector<float> unrelated;
  for (int step = 0; step < 3; ++step) {
    std::vector<float> q = in.q;
    for (float& x : q) x = step == 0 ? x : step == 1 ? x + 0.4f * normal(rng) : normal(rng);
    if (step == 2) unrelated = q;
    queries.push_back(encode_rounded(q, c.dtype));
  }
  {  // [B = 2, Sq = 1, Hq, D]: sequence 0 near step 2's query (a hit), sequence 1 unrelated to it (a miss)
    std::vector<float> q = unrelated;
    const size_t half = q.size() / 2;
    for (size_t i = 0; i < q.size(); ++i) q[i] = i < half ? q[i] + 0.05f * normal(rng) : normal(rng);
    queries.push_back(encode_rounded(q, c.dtype));
  }

  ScopedStream owned_stream;
  CUDA_OK(cudaStreamCreate(owned_stream.out()));
  const cudaStream_t stream = owned_stream.get();
  {
    Context cpu_ctx(SPARSA_DEVICE_CPU), gpu_ctx(SPARSA_DEVICE_CUDA, stream);
    ASSERT_EQ(gpu_ctx.status, SPARSA_STATUS_SUCCESS) << sparsa_last_error_message();
    ScopedSelectionCache cpu_owned, gpu_owned;
    SPARSA_OK(
        sparsa_selection_cache_create(cpu_ctx.ctx, 2, c.q_heads, c.kv_heads, c.head_dim, c.top_k, cpu_owned.out()));
    SPARSA_OK(
        sparsa_selection_cache_create(gpu_ctx.ctx, 2, c.q_heads, c.kv_heads, c.head_dim, c.top_k, gpu_owned.out()));
    sparsa_selection_cache* const cpu_cache = cpu_owned.get();
    sparsa_selection_cache* const gpu_cache = gpu_owned.get();
    SelectRunner cpu(c, t, cpu_ctx, SPARSA_DEVICE_CPU), gpu(c, t, gpu_ctx, SPARSA_DEVICE_CUDA);
    cpu.use_cache(cpu_cache);
    gpu.use_cache(gpu_cache);
    sparsa_attention_args args = gpu.args();
    const sparsa_policy policy = gpu.policy();
    SPARSA_OK(sparsa_attention_plan(gpu_ctx.ctx, &args, &policy));
    ScopedGraph graph;
    CUDA_OK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal));
    const sparsa_status captured = sparsa_attention_run(gpu_ctx.ctx, &args, &policy);
    CUDA_OK(cudaStreamEndCapture(stream, graph.out()));
    ASSERT_EQ(captured, SPARSA_STATUS_SUCCESS) << sparsa_last_error_message();
    ScopedGraphExec exec;
    CUDA_OK(cudaGraphInstantiate(exec.out(), graph.get(), 0));
    const int64_t want_hits[4] = {0, 2, 0, 1}, want_misses[4] = {2, 0, 2, 1};
    std::vector<int32_t> first_selection;
    for (int step = 0; step < 4; ++step) {
      SCOPED_TRACE("step " + std::to_string(step));
      cpu.set_q(queries[step]);
      const SelectResult want = cpu.run();
      gpu.set_q(queries[step]);
      gpu.poison();
      CUDA_OK(cudaGraphLaunch(exec.get(), stream));
      CUDA_OK(cudaStreamSynchronize(stream));
      SelectResult got;
      gpu.collect(got);
      ASSERT_EQ(want.stats[SPARSA_STAT_CACHE_HITS], want_hits[step]) << "oracle";
      ASSERT_EQ(want.stats[SPARSA_STAT_CACHE_MISSES], want_misses[step]) << "oracle";
      expect_same(c, got, want);
      if (step == 0) first_selection = got.selected;
      if (step == 1) {
        EXPECT_EQ(got.selected, first_selection) << "a hit reuses T (same N: same sinks and window)";
      }
    }
    int64_t hits = -1, misses = -1;
    SPARSA_OK(sparsa_selection_cache_counts(gpu_cache, &hits, &misses));
    EXPECT_EQ(hits, 3);
    EXPECT_EQ(misses, 5);
    SPARSA_OK(sparsa_selection_cache_reset(gpu_cache));
    SPARSA_OK(sparsa_selection_cache_counts(gpu_cache, &hits, &misses));
    EXPECT_EQ(hits + misses, 0);
  }
}

// Without selected_indices and stats the tensor-core decode walk composes I = sinks ∪ T ∪ window from the selection
// (no list kernel); with them it walks the lists the list kernel built. Same keys in the same positions and the same
// splits: the outputs must be bit-identical, and the listed run must match the CPU backend. Rows cover both key
// sources of a batch (a sequence that selects beside one that falls back to dense), page sizes 1/16/64, per-kv-head
// sets, speculative chunks (Sq 4, causal among the rows), head_dim 64, f16 and bf16, and two steps through a
// selection cache (a miss, then a hit).
struct ComposedCase {
  SelectCase c;
  bool cached = false;
};

std::vector<ComposedCase> composed_cases() {
  std::vector<ComposedCase> rows;
  auto add = [&](const std::string& name, bool cached, auto&& edit) {
    ComposedCase row;
    row.c.name = name;
    edit(row.c);
    row.cached = cached;
    rows.push_back(row);
  };
  add("bf16_decode_needles", false, [](SelectCase& c) { c.needles = 2; });
  add("f16_ragged_one_dense_packed", false, [](SelectCase& c) {
    c.dtype = SPARSA_DTYPE_F16;
    c.seq_q = {1, 1, 1};
    c.seq_k = {3000, 150, 2222};
    c.kv_layout = KvLayout::kPacked;
    c.needles = 1;
  });
  add("paged_ps1_per_kv_head", false, [](SelectCase& c) {
    c.kv_layout = KvLayout::kPaged;
    c.page_size = 1;
    c.per_kv_head = true;
    c.seq_q = {1, 1};
    c.seq_k = {2100, 1700};
    c.needles = 1;
  });
  add("paged_ps16_speculative_chunk_of_4", false, [](SelectCase& c) {
    c.kv_layout = KvLayout::kPaged;
    c.q_packed = true;
    c.seq_q = {4, 2};
    c.seq_k = {2600, 1900};
  });
  add("paged_ps64_d64_gqa4", false, [](SelectCase& c) {
    c.kv_layout = KvLayout::kPaged;
    c.page_size = 64;
    c.head_dim = 64;
    c.q_heads = 16;
    c.kv_heads = 4;
    c.seq_k = {5000};
    c.needles = 3;
  });
  add("default_shape_cache_miss_then_hit", true, [](SelectCase& c) {
    c.n_init = 128;
    c.top_k = 2048;
    c.n_local = 512;
    c.seq_k = {20000};
    c.theta = 0.5f;
    c.needles = 2;
  });
  return rows;
}

TEST(GpuTokenSelectComposedSets, BitIdenticalToTheListedRunWhichMatchesTheCpu) {
  SKIP_WITHOUT_GPU();
  for (const ComposedCase& row : composed_cases()) {
    SCOPED_TRACE(row.c.name);
    std::mt19937 rng(11);
    SelectInputs in = make_select_inputs(row.c, rng);
    const SelectTensors t = build_select_tensors(row.c, in, rng);
    Context cpu_ctx(SPARSA_DEVICE_CPU), listed_ctx(SPARSA_DEVICE_CUDA), composed_ctx(SPARSA_DEVICE_CUDA);
    ASSERT_EQ(listed_ctx.status, SPARSA_STATUS_SUCCESS) << sparsa_last_error_message();
    ASSERT_EQ(composed_ctx.status, SPARSA_STATUS_SUCCESS) << sparsa_last_error_message();
    SelectRunner cpu(row.c, t, cpu_ctx, SPARSA_DEVICE_CPU), listed(row.c, t, listed_ctx, SPARSA_DEVICE_CUDA),
        composed(row.c, t, composed_ctx, SPARSA_DEVICE_CUDA);
    composed.omit_index_outputs();
    const int32_t B = int32_t(row.c.seq_q.size());
    ScopedSelectionCache caches[3];
    if (row.cached) {
      Context* contexts[3] = {&cpu_ctx, &listed_ctx, &composed_ctx};
      SelectRunner* runners[3] = {&cpu, &listed, &composed};
      for (int i = 0; i < 3; ++i) {
        SPARSA_OK(sparsa_selection_cache_create(contexts[i]->ctx, B, row.c.q_heads, row.c.kv_heads, row.c.head_dim,
                                                row.c.top_k, caches[i].out()));
        runners[i]->use_cache(caches[i].get());
      }
    }
    for (int step = 0; step < (row.cached ? 2 : 1); ++step) {  // the same query twice: a miss, then a hit
      SCOPED_TRACE("step " + std::to_string(step));
      const SelectResult want = cpu.run();
      const SelectResult with_lists = listed.run();
      const SelectResult without = composed.run();
      expect_same(row.c, with_lists, want);
      ASSERT_EQ(without.status, SPARSA_STATUS_SUCCESS) << without.message;
      if (row.cached) {
        ASSERT_EQ(want.stats[SPARSA_STAT_CACHE_HITS], step == 0 ? 0 : B) << "oracle";
      }
      ASSERT_EQ(without.out.size(), with_lists.out.size());
      for (size_t i = 0; i < without.out.size(); ++i) {
        ASSERT_EQ(std::memcmp(&without.out[i], &with_lists.out[i], sizeof(float)), 0) << "out " << i;
      }
      ASSERT_EQ(std::memcmp(without.lse.data(), with_lists.lse.data(), without.lse.size() * sizeof(float)), 0) << "lse";
    }
    if (row.cached) {
      int64_t hits = -1, misses = -1;
      SPARSA_OK(sparsa_selection_cache_counts(caches[2].get(), &hits, &misses));
      EXPECT_EQ(hits, B);
      EXPECT_EQ(misses, B);
    }
  }
}

// =====================================================================================================================
// KV prefetch
// =====================================================================================================================

struct PrefetchOutputs {
  std::vector<float> k_dst, v_dst;
  std::vector<int32_t> positions, remapped, counts;
};

// kSources: 0 pinned host (CUDA_HOST), 1 device memory described as host, 2 pageable host.
sparsa_status prefetch_on_gpu(const std::vector<float>& k_src, const std::vector<float>& v_src,
                              const std::vector<int32_t>& indices, int B, int N, int Hkv, int D, int h_idx, int k,
                              int C, int sources, PrefetchOutputs* out, std::string* message) {
  Context gpu(SPARSA_DEVICE_CUDA);
  const size_t src_bytes = k_src.size() * 4;
  void *ks = nullptr, *vs = nullptr;
  std::unique_ptr<PinnedBuffer> k_pinned, v_pinned;
  std::unique_ptr<DeviceBuffer> kd_src, vd_src;
  std::vector<float> k_pageable = k_src, v_pageable = v_src;
  int32_t src_device = SPARSA_DEVICE_CUDA_HOST;
  if (sources == 0) {
    k_pinned = std::make_unique<PinnedBuffer>(src_bytes);
    v_pinned = std::make_unique<PinnedBuffer>(src_bytes);
    ks = k_pinned->data();
    vs = v_pinned->data();
    EXPECT_NE(ks, nullptr);
    EXPECT_NE(vs, nullptr);
    if (ks == nullptr || vs == nullptr) {
      *message = "cudaMallocHost failed";
      return SPARSA_STATUS_INTERNAL;
    }
    std::memcpy(ks, k_src.data(), src_bytes);
    std::memcpy(vs, v_src.data(), src_bytes);
  } else if (sources == 1) {
    kd_src = std::make_unique<DeviceBuffer>(src_bytes);
    vd_src = std::make_unique<DeviceBuffer>(src_bytes);
    kd_src->upload(k_src.data());
    vd_src->upload(v_src.data());
    ks = kd_src->data();
    vs = vd_src->data();
    src_device = SPARSA_DEVICE_CPU;
  } else {
    ks = k_pageable.data();
    vs = v_pageable.data();
    src_device = SPARSA_DEVICE_CPU;
  }
  std::vector<int32_t> idx = indices;
  const size_t dst_bytes = size_t(B) * C * Hkv * D * 4;
  DeviceBuffer kd(dst_bytes), vd(dst_bytes), pos(size_t(B) * C * 4), rem(idx.size() * 4), cnt(size_t(B) * 4);
  std::vector<float> untouched(dst_bytes / 4, 12345.0f);
  kd.upload(untouched.data());
  vd.upload(untouched.data());
  pos.poison();
  rem.poison();
  cnt.poison();
  sparsa_tensor tks = make_tensor(ks, SPARSA_DTYPE_F32, {B, N, Hkv, D}, src_device);
  sparsa_tensor tvs = make_tensor(vs, SPARSA_DTYPE_F32, {B, N, Hkv, D}, src_device);
  sparsa_tensor tidx = make_tensor(idx.data(), SPARSA_DTYPE_I32, {B, h_idx, k}, SPARSA_DEVICE_CPU);
  sparsa_tensor tkd = make_tensor(kd.data(), SPARSA_DTYPE_F32, {B, C, Hkv, D}, SPARSA_DEVICE_CUDA);
  sparsa_tensor tvd = make_tensor(vd.data(), SPARSA_DTYPE_F32, {B, C, Hkv, D}, SPARSA_DEVICE_CUDA);
  sparsa_tensor tpos = make_tensor(pos.data(), SPARSA_DTYPE_I32, {B, C}, SPARSA_DEVICE_CUDA);
  sparsa_tensor trem = make_tensor(rem.data(), SPARSA_DTYPE_I32, {B, h_idx, k}, SPARSA_DEVICE_CUDA);
  sparsa_tensor tcnt = make_tensor(cnt.data(), SPARSA_DTYPE_I32, {B}, SPARSA_DEVICE_CUDA);
  const sparsa_status status = sparsa_kv_prefetch(gpu.ctx, &tks, &tvs, &tidx, &tkd, &tvd, &tpos, &trem, &tcnt);
  *message = sparsa_last_error_message();
  if (status == SPARSA_STATUS_SUCCESS) {
    out->k_dst.resize(dst_bytes / 4);
    out->v_dst.resize(dst_bytes / 4);
    out->positions.resize(size_t(B) * C);
    out->remapped.resize(idx.size());
    out->counts.resize(B);
    kd.download(out->k_dst.data());
    vd.download(out->v_dst.data());
    pos.download(out->positions.data());
    rem.download(out->remapped.data());
    cnt.download(out->counts.data());
  }
  return status;
}

TEST(GpuKvPrefetch, PinnedAndDeviceSourcesMatchTheCpuBackend) {
  SKIP_WITHOUT_GPU();
  std::mt19937 rng(9);
  std::normal_distribution<float> normal;
  const int B = 3, N = 1000, Hkv = 2, D = 64, h_idx = 4, k = 40, C = 170;
  std::vector<float> k_src(size_t(B) * N * Hkv * D), v_src(k_src.size());
  for (float& x : k_src) x = normal(rng);
  for (float& x : v_src) x = normal(rng);
  std::vector<int32_t> indices(size_t(B) * h_idx * k);
  for (int32_t& id : indices) id = rng() % 10 == 0 ? -1 : int32_t(rng() % N);
  for (int j = 0; j < k; ++j) indices[size_t(2) * h_idx * k + j] = int32_t(N - 1 - j % 5);  // duplicates, last id

  PrefetchOutputs want{std::vector<float>(size_t(B) * C * Hkv * D, 12345.0f),
                       std::vector<float>(size_t(B) * C * Hkv * D, 12345.0f), std::vector<int32_t>(size_t(B) * C, -7),
                       std::vector<int32_t>(indices.size(), -7), std::vector<int32_t>(B, -7)};
  {
    Context cpu(SPARSA_DEVICE_CPU);
    std::vector<int32_t> idx = indices;
    sparsa_tensor tks = make_tensor(k_src.data(), SPARSA_DTYPE_F32, {B, N, Hkv, D}, SPARSA_DEVICE_CPU);
    sparsa_tensor tvs = make_tensor(v_src.data(), SPARSA_DTYPE_F32, {B, N, Hkv, D}, SPARSA_DEVICE_CPU);
    sparsa_tensor tidx = make_tensor(idx.data(), SPARSA_DTYPE_I32, {B, h_idx, k}, SPARSA_DEVICE_CPU);
    sparsa_tensor tkd = make_tensor(want.k_dst.data(), SPARSA_DTYPE_F32, {B, C, Hkv, D}, SPARSA_DEVICE_CPU);
    sparsa_tensor tvd = make_tensor(want.v_dst.data(), SPARSA_DTYPE_F32, {B, C, Hkv, D}, SPARSA_DEVICE_CPU);
    sparsa_tensor tpos = make_tensor(want.positions.data(), SPARSA_DTYPE_I32, {B, C}, SPARSA_DEVICE_CPU);
    sparsa_tensor trem = make_tensor(want.remapped.data(), SPARSA_DTYPE_I32, {B, h_idx, k}, SPARSA_DEVICE_CPU);
    sparsa_tensor tcnt = make_tensor(want.counts.data(), SPARSA_DTYPE_I32, {B}, SPARSA_DEVICE_CPU);
    SPARSA_OK(sparsa_kv_prefetch(cpu.ctx, &tks, &tvs, &tidx, &tkd, &tvd, &tpos, &trem, &tcnt));
  }
  for (int sources : {0, 1, 2}) {
    SCOPED_TRACE("sources " + std::to_string(sources));
    PrefetchOutputs got;
    std::string message;
    const sparsa_status status =
        prefetch_on_gpu(k_src, v_src, indices, B, N, Hkv, D, h_idx, k, C, sources, &got, &message);
    if (sources == 2 && status == SPARSA_STATUS_UNSUPPORTED) {
      EXPECT_NE(message.find("pageable"), std::string::npos) << message;
      continue;  // plain pageable memory: refused with a reason (unless the device can read it)
    }
    ASSERT_EQ(status, SPARSA_STATUS_SUCCESS) << message;
    EXPECT_EQ(got.positions, want.positions);
    EXPECT_EQ(got.remapped, want.remapped);
    EXPECT_EQ(got.counts, want.counts);
    EXPECT_EQ(got.k_dst, want.k_dst);  // rows past each union untouched on both
    EXPECT_EQ(got.v_dst, want.v_dst);
  }
}

}  // namespace
