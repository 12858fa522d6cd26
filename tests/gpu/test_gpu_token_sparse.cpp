// TOKEN_SPARSE (§5) on the GPU against the float64 oracle (tests/reference), through the public C API, as
// ALGORITHMS.md §0 "Precision of selections" states: every top-budget and coverage decision whose oracle margin
// exceeds the device's documented bound (token_sparse_score.cu) must agree with the oracle, the budget must be one
// the coverage count can give within the bound, kept rows must equal float64 attention over the GPU's own sets,
// dropped rows exactly 0 with LSE −inf, and the stats those of the GPU's sets. Inputs are structured (needles and
// sinks that must survive; runs of tied keys that put decisions inside the bound, so neither half of the audit is
// vacuous), sequences are ragged (varlen, paged) and straddle the dense-fallback threshold; outputs are poisoned
// with NaN before each run. Skips cleanly when no CUDA device/driver is present.
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

#include "../reference/reference.h"
#include "gpu_test_util.h"

namespace {

using namespace sparsa_gpu_test;

// ---- one case ----

enum class Layout { kPadded, kPacked, kPagedKv };  // kPagedKv: packed q, paged k/v with seq_lens_k
// kTiedRuns: keys constant over runs of kTieRun tokens, so pooled scores tie exactly inside a run and the
// top-budget threshold falls on tied candidates (decisions inside the §0 bound).
enum class Structure { kRandom, kNeedles, kSinks, kTiedRuns };
constexpr int32_t kTieRun = 24;

struct SparseCase {
  std::string name;
  int32_t dtype = SPARSA_DTYPE_F16;
  int32_t head_dim = 64;
  int32_t q_heads = 4, kv_heads = 2;
  std::vector<int32_t> lengths{512};  // per sequence, Sq == Skv (padded: all equal)
  Layout layout = Layout::kPadded;
  int32_t page_size = 16;
  Structure structure = Structure::kRandom;
  int32_t window = 32, pool_kernel = 7, min_tokens = 64;
  float coverage = 0.3f;
  bool lse = true;
  bool expect_dropped = true;  // the oracle drops rows (the case exercises the sparse path)
  bool expect_within_bound = false;  // the inputs put top-budget decisions inside the §0 bound (tied runs)
};

void PrintTo(const SparseCase& c, std::ostream* os) { *os << c.name; }

// Logical inputs [b][t][head][d] (rounded to the dtype) and the positions planted to survive selection.
struct Inputs {
  std::vector<std::vector<float>> q, k, v;
  std::vector<std::vector<std::vector<int32_t>>> must_keep;  // [b][kv head] positions
};

Inputs make_inputs(const SparseCase& c, std::mt19937& rng) {
  std::normal_distribution<float> normal(0.f, 1.f);
  const int32_t D = c.head_dim, Hq = c.q_heads, Hkv = c.kv_heads, group = Hq / Hkv;
  Inputs in;
  for (size_t b = 0; b < c.lengths.size(); ++b) {
    const int32_t L = c.lengths[b];
    std::vector<float> q(size_t(L) * Hq * D), k(size_t(L) * Hkv * D), v(size_t(L) * Hkv * D);
    for (auto* x : {&q, &k, &v}) {
      for (auto& e : *x) e = std::clamp(normal(rng), -3.f, 3.f) * 0.7f;
    }
    in.must_keep.emplace_back(size_t(Hkv));
    if (c.structure == Structure::kTiedRuns) {
      for (int32_t t = 0; t < L; ++t) {
        const size_t from = size_t(t - t % kTieRun) * Hkv * D, to = size_t(t) * Hkv * D;
        std::copy_n(k.begin() + from, size_t(Hkv) * D, k.begin() + to);
      }
    }
    if (c.structure == Structure::kNeedles || c.structure == Structure::kSinks) {
      // Per kv head a direction u (|u|² = D); the window queries of its group lean on it, so planted keys along u
      // get scale·0.5·1.2·D ≈ 4–5 more score than the rest and must be kept by every head of the group.
      for (int32_t kh = 0; kh < Hkv; ++kh) {
        std::vector<float> u(static_cast<size_t>(D));
        for (auto& e : u) e = std::clamp(normal(rng), -2.f, 2.f);
        const int32_t first_window_row = std::max(0, L - c.window);
        for (int32_t t = first_window_row; t < L; ++t) {
          for (int32_t g = 0; g < group; ++g) {
            for (int32_t d = 0; d < D; ++d) q[(size_t(t) * Hq + kh * group + g) * D + d] += 0.5f * u[d];
          }
        }
        std::vector<int32_t> planted;
        if (c.structure == Structure::kSinks) {
          for (int32_t t = 0; t < std::min(4, first_window_row); ++t) planted.push_back(t);
        } else {
          for (int n = 0; n < 4 && first_window_row > 8; ++n) {
            planted.push_back(int32_t(std::uniform_int_distribution<int32_t>(1, first_window_row - 2)(rng)));
          }
        }
        for (int32_t t : planted) {
          for (int32_t d = 0; d < D; ++d) k[(size_t(t) * Hkv + kh) * D + d] = 1.2f * u[d] + 0.05f * normal(rng);
        }
        in.must_keep.back()[static_cast<size_t>(kh)] = planted;
      }
    }
    for (auto* x : {&q, &k, &v}) {  // round to the dtype so both backends read identical values
      const std::vector<float> rounded = decode(encode(*x, c.dtype), c.dtype);
      *x = rounded;
    }
    in.q.push_back(std::move(q));
    in.k.push_back(std::move(k));
    in.v.push_back(std::move(v));
  }
  return in;
}

// Physical tensors of a case (host bytes; copied to the device for the GPU run).
struct Physical {
  std::vector<uint8_t> q, k, v;
  std::vector<int32_t> cu, page_table, seq_lens;
  std::vector<int64_t> q_shape, kv_shape, lse_shape, page_table_shape;
  int64_t q_rows = 0;
  int32_t max_len = 0;
  std::vector<int64_t> row_base;  // physical q row of (b, 0)
};

Physical build_physical(const SparseCase& c, const Inputs& in, std::mt19937& rng) {
  Physical ph;
  const int32_t B = int32_t(c.lengths.size()), Hq = c.q_heads, Hkv = c.kv_heads, D = c.head_dim;
  ph.max_len = *std::max_element(c.lengths.begin(), c.lengths.end());
  std::vector<float> q, k, v;
  const size_t kv_row = size_t(Hkv) * D;
  if (c.layout == Layout::kPadded) {
    for (int32_t b = 0; b < B; ++b) {
      EXPECT_EQ(c.lengths[b], ph.max_len) << "padded cases need equal lengths (Sq == Skv)";
      ph.row_base.push_back(int64_t(b) * ph.max_len);
      q.insert(q.end(), in.q[b].begin(), in.q[b].end());
      k.insert(k.end(), in.k[b].begin(), in.k[b].end());
      v.insert(v.end(), in.v[b].begin(), in.v[b].end());
    }
    ph.q_rows = int64_t(B) * ph.max_len;
    ph.q_shape = {B, ph.max_len, Hq, D};
    ph.kv_shape = {B, ph.max_len, Hkv, D};
    ph.lse_shape = {B, Hq, ph.max_len};
  } else {
    ph.cu.push_back(0);
    for (int32_t b = 0; b < B; ++b) {
      ph.row_base.push_back(ph.cu.back());
      q.insert(q.end(), in.q[b].begin(), in.q[b].end());
      ph.cu.push_back(ph.cu.back() + c.lengths[b]);
    }
    ph.q_rows = ph.cu.back();
    ph.q_shape = {ph.q_rows, Hq, D};
    ph.lse_shape = {Hq, ph.q_rows};
    if (c.layout == Layout::kPacked) {
      for (int32_t b = 0; b < B; ++b) {
        k.insert(k.end(), in.k[b].begin(), in.k[b].end());
        v.insert(v.end(), in.v[b].begin(), in.v[b].end());
      }
      ph.kv_shape = {ph.q_rows, Hkv, D};
    } else {
      const int32_t ps = c.page_size, max_pages = (ph.max_len + ps - 1) / ps, pages = B * max_pages + 2;
      std::vector<int32_t> order(static_cast<size_t>(pages));
      for (int32_t i = 0; i < pages; ++i) order[size_t(i)] = i;
      std::shuffle(order.begin(), order.end(), rng);
      k.assign(size_t(pages) * ps * kv_row, 5.f);  // junk in unused slots: must never be read
      v.assign(size_t(pages) * ps * kv_row, 5.f);
      ph.page_table.assign(size_t(B) * max_pages, 0);
      for (int32_t b = 0; b < B; ++b) {
        for (int32_t pg = 0; pg < max_pages; ++pg) ph.page_table[size_t(b) * max_pages + pg] = order[b * max_pages + pg];
        for (int32_t t = 0; t < c.lengths[b]; ++t) {
          const size_t slot = (size_t(ph.page_table[size_t(b) * max_pages + t / ps]) * ps + t % ps) * kv_row;
          std::copy_n(in.k[b].begin() + size_t(t) * kv_row, kv_row, k.begin() + slot);
          std::copy_n(in.v[b].begin() + size_t(t) * kv_row, kv_row, v.begin() + slot);
        }
      }
      ph.kv_shape = {pages, ps, Hkv, D};
      ph.page_table_shape = {B, max_pages};
      ph.seq_lens.assign(c.lengths.begin(), c.lengths.end());
    }
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
  std::vector<int32_t> selected;  // [B, Hq, max_len]
  std::vector<int64_t> stats;     // [SPARSA_STAT_COUNT]
};

sparsa_policy policy_of(const SparseCase& c) {
  sparsa_policy policy;
  sparsa_policy_init(&policy, sizeof policy, SPARSA_POLICY_TOKEN_SPARSE);
  policy.token_sparse_window = c.window;
  policy.token_sparse_pool_kernel = c.pool_kernel;
  policy.token_sparse_min_tokens = c.min_tokens;
  policy.token_sparse_coverage = c.coverage;
  return policy;
}

// Tensors of one run in host memory (CPU context) or device memory (GPU context); outputs start as NaN / -2.
class RunTensors {
 public:
  RunTensors(const SparseCase& c, const Physical& ph, bool on_gpu) : c_(c), ph_(ph), on_gpu_(on_gpu) {
    const int32_t dev = on_gpu ? SPARSA_DEVICE_CUDA : SPARSA_DEVICE_CPU;
    const int32_t B = int32_t(c.lengths.size());
    out_bytes_ = size_t(ph.q_rows) * c.q_heads * c.head_dim * element_bytes(c.dtype);
    lse_count_ = size_t(ph.q_rows) * c.q_heads;
    selected_count_ = size_t(B) * c.q_heads * ph.max_len;
    host_out_.assign(out_bytes_, 0xff);  // NaN in every dtype
    host_lse_.assign(lse_count_, std::numeric_limits<float>::quiet_NaN());
    host_selected_.assign(selected_count_, -2);
    host_stats_.assign(SPARSA_STAT_COUNT, -1);
    q_ = make_tensor(place(ph.q.data(), ph.q.size()), c.dtype, ph.q_shape, dev);
    k_ = make_tensor(place(ph.k.data(), ph.k.size()), c.dtype, ph.kv_shape, dev);
    v_ = make_tensor(place(ph.v.data(), ph.v.size()), c.dtype, ph.kv_shape, dev);
    out_ = make_tensor(place(host_out_.data(), out_bytes_), c.dtype, ph.q_shape, dev);
    lse_ = make_tensor(place(host_lse_.data(), lse_count_ * 4), SPARSA_DTYPE_F32, ph.lse_shape, dev);
    selected_ = make_tensor(place(host_selected_.data(), selected_count_ * 4), SPARSA_DTYPE_I32,
                            {B, c.q_heads, ph.max_len}, dev);
    stats_ = make_tensor(place(host_stats_.data(), SPARSA_STAT_COUNT * 8), SPARSA_DTYPE_I64, {SPARSA_STAT_COUNT}, dev);
    sparsa_attention_args_init(&args_, sizeof args_);
    args_.q = &q_;
    args_.k = &k_;
    args_.v = &v_;
    args_.out = &out_;
    args_.lse = c.lse ? &lse_ : nullptr;
    args_.causal = 1;
    args_.selected_indices = &selected_;
    args_.stats = &stats_;
    if (!ph.cu.empty()) {
      cu_ = make_tensor(place(ph.cu.data(), ph.cu.size() * 4), SPARSA_DTYPE_I32, {int64_t(ph.cu.size())}, dev);
      args_.cu_seqlens_q = &cu_;
      if (c.layout == Layout::kPacked) args_.cu_seqlens_k = &cu_;
    }
    if (!ph.page_table.empty()) {
      table_ = make_tensor(place(ph.page_table.data(), ph.page_table.size() * 4), SPARSA_DTYPE_I32,
                           ph.page_table_shape, dev);
      lens_ = make_tensor(place(ph.seq_lens.data(), ph.seq_lens.size() * 4), SPARSA_DTYPE_I32,
                          {int64_t(ph.seq_lens.size())}, dev);
      args_.page_table = &table_;
      args_.seq_lens_k = &lens_;
    }
  }

  const sparsa_attention_args* args() const { return &args_; }

  // Re-poisons the outputs (device runs).
  void poison() {
    if (!on_gpu_) return;
    EXPECT_EQ(cudaMemset(out_.data, 0xff, out_bytes_), cudaSuccess);
    EXPECT_EQ(cudaMemset(lse_.data, 0xff, lse_count_ * 4), cudaSuccess);
    EXPECT_EQ(cudaMemset(selected_.data, 0xff, selected_count_ * 4), cudaSuccess);
  }

  void collect(RunResult* r) {
    if (on_gpu_) {
      EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
      EXPECT_EQ(cudaMemcpy(host_out_.data(), out_.data, out_bytes_, cudaMemcpyDeviceToHost), cudaSuccess);
      EXPECT_EQ(cudaMemcpy(host_lse_.data(), lse_.data, lse_count_ * 4, cudaMemcpyDeviceToHost), cudaSuccess);
      EXPECT_EQ(cudaMemcpy(host_selected_.data(), selected_.data, selected_count_ * 4, cudaMemcpyDeviceToHost),
                cudaSuccess);
      EXPECT_EQ(cudaMemcpy(host_stats_.data(), stats_.data, SPARSA_STAT_COUNT * 8, cudaMemcpyDeviceToHost),
                cudaSuccess);
    }
    r->out = decode(host_out_, c_.dtype);
    r->lse = host_lse_;
    r->selected = host_selected_;
    r->stats = host_stats_;
  }

 private:
  void* place(const void* host, size_t bytes) {
    if (!on_gpu_) return const_cast<void*>(host);
    buffers_.emplace_back(bytes);
    buffers_.back().upload(host);
    return buffers_.back().data();
  }

  const SparseCase& c_;
  const Physical& ph_;
  bool on_gpu_;
  size_t out_bytes_ = 0, lse_count_ = 0, selected_count_ = 0;
  std::vector<uint8_t> host_out_;
  std::vector<float> host_lse_;
  std::vector<int32_t> host_selected_;
  std::vector<int64_t> host_stats_;
  std::deque<DeviceBuffer> buffers_;
  sparsa_tensor q_, k_, v_, out_, lse_, selected_, stats_, cu_, table_, lens_;
  sparsa_attention_args args_;
};

RunResult run_case(const SparseCase& c, const Physical& ph, bool on_gpu) {
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
  RunTensors tensors(c, ph, on_gpu);
  const sparsa_policy policy = policy_of(c);
  result.status = sparsa_attention_run(ctx, tensors.args(), &policy);
  result.message = sparsa_last_error_message();
  if (result.status == SPARSA_STATUS_SUCCESS) tensors.collect(&result);
  return result;
}

double tolerance(int32_t dtype) { return dtype == SPARSA_DTYPE_F32 ? 2e-4 : dtype == SPARSA_DTYPE_F16 ? 4e-3 : 3e-2; }

// ---- the §0 "Precision of selections" audit ----

// The inputs as the float64 oracle (tests/reference) reads them.
ref::Problem oracle_problem(const SparseCase& c, const Inputs& in) {
  ref::Problem p;
  p.B = int(c.lengths.size());
  p.Hq = c.q_heads;
  p.Hkv = c.kv_heads;
  p.D = c.head_dim;
  p.sq.assign(c.lengths.begin(), c.lengths.end());
  p.skv = p.sq;
  p.causal = true;
  p.allocate();
  for (int b = 0; b < p.B; ++b) {
    std::copy(in.q[size_t(b)].begin(), in.q[size_t(b)].end(), p.q[size_t(b)].begin());
    std::copy(in.k[size_t(b)].begin(), in.k[size_t(b)].end(), p.k[size_t(b)].begin());
    std::copy(in.v[size_t(b)].begin(), in.v[size_t(b)].end(), p.v[size_t(b)].begin());
  }
  return p;
}

double row_norm(const std::vector<float>& rows, size_t row, int32_t D) {
  double sum = 0.0;
  for (int32_t d = 0; d < D; ++d) sum += double(rows[row * size_t(D) + size_t(d)]) * rows[row * size_t(D) + size_t(d)];
  return std::sqrt(sum);
}

// The relative bound eps of token_sparse_score.cu's header for sequence b: 8E + 2^-12 with
// E = scale · D · 2^-22 · max ‖q_r‖ (window rows) · max ‖k_j‖, where the device scores in fp32 (fp16/bf16,
// head_dim % 16 == 0, <= 128); float64 scoring elsewhere agrees to rounding (1e-12).
double selection_bound(const SparseCase& c, const Inputs& in, size_t b) {
  const bool fp32_scores = c.dtype != SPARSA_DTYPE_F32 && c.head_dim % 16 == 0 && c.head_dim <= 128;
  if (!fp32_scores) return 1e-12;
  const int32_t L = c.lengths[b], D = c.head_dim;
  double max_q = 0.0, max_k = 0.0;
  for (int32_t t = std::max(0, L - c.window); t < L; ++t) {
    for (int32_t h = 0; h < c.q_heads; ++h) max_q = std::max(max_q, row_norm(in.q[b], size_t(t) * c.q_heads + h, D));
  }
  for (int32_t t = 0; t < L; ++t) {
    for (int32_t h = 0; h < c.kv_heads; ++h) max_k = std::max(max_k, row_norm(in.k[b], size_t(t) * c.kv_heads + h, D));
  }
  const double E = (1.0 / std::sqrt(double(D))) * D * std::ldexp(1.0, -22) * max_q * max_k;
  return 8.0 * E + std::ldexp(1.0, -12);
}

struct SelectionAudit {
  int64_t decided = 0;        // decisions whose oracle margin exceeds the bound: must agree with the oracle
  int64_t within_bound = 0;   // decisions inside the bound: either way is correct
  int64_t disagreements = 0;  // decided decisions the device got wrong
};

// The GPU's sets of one sequence against the oracle's scores: the budget must be one the coverage count can give
// within eps, and every candidate whose score is decided by more than eps must be kept or dropped as the oracle does.
void audit_sequence(const SparseCase& c, const ref::TokenSparseResult& oracle, size_t b, double eps,
                    const std::vector<std::vector<int32_t>>& sets, SelectionAudit* audit) {
  const int32_t L = c.lengths[b], W = c.window, n = L - W;
  if (oracle.ran_dense[b]) {
    for (const auto& set : sets) {
      EXPECT_EQ(set.size(), size_t(L)) << c.name << ": a dense sequence keeps every row";
    }
    return;
  }
  const double tau = double(c.coverage);
  int32_t count_lo = 0, count_hi = 0;  // coverage counts certainly reached / possibly reached
  for (double cum : oracle.cumsum[b]) {
    count_lo += cum * (1 + eps) < tau;
    count_hi += cum * (1 - eps) < tau;
  }
  audit->within_bound += count_hi - count_lo;
  audit->decided += n - (count_hi - count_lo);
  const auto budget_of = [&](int32_t count) { return std::max(c.min_tokens, n - (count + (count > 0 ? 1 : 0))); };
  for (int32_t h = 0; h < c.q_heads; ++h) {
    const std::vector<int32_t>& set = sets[size_t(h)];
    std::vector<uint8_t> kept(size_t(L), 0);
    for (int32_t t : set) kept[size_t(t)] = 1;
    int32_t budget = 0;
    for (int32_t t = 0; t < n; ++t) budget += kept[size_t(t)];
    for (int32_t t = n; t < L; ++t) EXPECT_TRUE(kept[size_t(t)]) << c.name << ": window row " << t << " dropped";
    EXPECT_GE(budget, budget_of(count_hi)) << c.name << ": b=" << b << " h=" << h << " budget below the bound";
    EXPECT_LE(budget, budget_of(count_lo)) << c.name << ": b=" << b << " h=" << h << " budget above the bound";
    const std::vector<double>& score = oracle.head_score[b][size_t(h)];
    std::vector<double> sorted(score);
    std::sort(sorted.begin(), sorted.end());
    const auto at_least = [&](double x) { return int64_t(sorted.end() - std::lower_bound(sorted.begin(), sorted.end(), x)); };
    const auto above = [&](double x) { return int64_t(sorted.end() - std::upper_bound(sorted.begin(), sorted.end(), x)); };
    for (int32_t j = 0; j < n; ++j) {
      const double x = score[size_t(j)];
      const int64_t may_beat = at_least(x * (1 - eps) / (1 + eps)) - 1;  // others that could rank above j
      const int64_t sure_beat = above(x * (1 + eps) / (1 - eps));        // others that rank above j for certain
      const bool must_keep = may_beat < budget, must_drop = sure_beat >= budget;
      if (!must_keep && !must_drop) {
        ++audit->within_bound;
        continue;
      }
      ++audit->decided;
      if ((must_keep && !kept[size_t(j)]) || (must_drop && kept[size_t(j)])) ++audit->disagreements;
    }
  }
}

// The GPU run against the oracle (§0): selections within the bound, kept rows equal to float64 attention over the
// GPU's own sets (§5.7), dropped rows exactly 0 with LSE −inf, and the stats of those sets.
void expect_matches_oracle(const SparseCase& c, const Inputs& in, const Physical& ph, const RunResult& cpu,
                           const RunResult& gpu, SelectionAudit* audit) {
  ASSERT_EQ(gpu.selected.size(), cpu.selected.size());
  const int32_t Hq = c.q_heads, D = c.head_dim, group = c.q_heads / c.kv_heads;
  const ref::TokenSparseResult oracle = ref::token_sparse(
      oracle_problem(c, in), ref::TokenSparseParams{c.window, c.pool_kernel, c.min_tokens, double(c.coverage), true});
  const double scale = 1.0 / std::sqrt(double(D));
  int64_t bad_kept = 0, bad_dropped = 0, dropped = 0, pairs = 0;
  double worst = 0.0;
  for (size_t b = 0; b < c.lengths.size(); ++b) {
    const int32_t L = c.lengths[b];
    std::vector<std::vector<int32_t>> sets(static_cast<size_t>(Hq));
    for (int32_t h = 0; h < Hq; ++h) {
      const size_t set_at = (b * Hq + h) * size_t(ph.max_len);
      for (int32_t s = 0; s < ph.max_len && gpu.selected[set_at + s] >= 0; ++s) {
        const int32_t id = gpu.selected[set_at + s];
        ASSERT_LT(id, L) << c.name << ": selected index out of range";
        if (!sets[size_t(h)].empty()) {
          ASSERT_GT(id, sets[size_t(h)].back()) << c.name << ": sets are ascending";
        }
        sets[size_t(h)].push_back(id);
      }
      pairs += int64_t(sets[size_t(h)].size()) * int64_t(sets[size_t(h)].size() + 1) / 2;
    }
    audit_sequence(c, oracle, b, selection_bound(c, in, b), sets, audit);
    for (int32_t h = 0; h < Hq; ++h) {
      const std::vector<int32_t>& set = sets[size_t(h)];
      std::vector<uint8_t> kept(size_t(L), 0);
      for (int32_t t : set) kept[size_t(t)] = 1;
      for (int32_t t : in.must_keep[b][size_t(h / group)]) {
        EXPECT_TRUE(kept[size_t(t)]) << c.name << ": planted position " << t << " of b=" << b << " h=" << h
                                     << " was dropped";
      }
      std::vector<double> weights;
      for (int32_t i = 0; i < L; ++i) {
        const size_t row = (size_t(ph.row_base[b] + i) * Hq + h) * D;
        const size_t lse_at = c.layout == Layout::kPadded ? (b * Hq + h) * size_t(ph.max_len) + i
                                                          : size_t(h) * ph.q_rows + ph.row_base[b] + i;
        if (!kept[size_t(i)]) {
          ++dropped;
          for (int32_t d = 0; d < D; ++d) bad_dropped += gpu.out[row + d] != 0.f;  // NaN counts too
          if (c.lse) bad_dropped += !(std::isinf(gpu.lse[lse_at]) && gpu.lse[lse_at] < 0);
          continue;
        }
        // float64 causal attention of row i over the set's keys j <= i (§5.7)
        const float* qi = &in.q[b][(size_t(i) * Hq + h) * D];
        weights.clear();
        double m = -std::numeric_limits<double>::infinity();
        for (int32_t j : set) {
          if (j > i) break;
          const float* kj = &in.k[b][(size_t(j) * c.kv_heads + h / group) * D];
          double dot = 0.0;
          for (int32_t d = 0; d < D; ++d) dot += double(qi[d]) * kj[d];
          weights.push_back(dot * scale);
          m = std::max(m, weights.back());
        }
        double sum = 0.0;
        for (double& w : weights) sum += (w = std::exp(w - m));
        for (int32_t d = 0; d < D; ++d) {
          double o = 0.0;
          for (size_t a = 0; a < weights.size(); ++a) {
            o += weights[a] * in.v[b][(size_t(set[a]) * c.kv_heads + h / group) * D + d];
          }
          const double err = std::fabs(double(gpu.out[row + d]) - o / sum);
          bad_kept += !(err <= 2 * tolerance(c.dtype));
          worst = std::max(worst, std::isnan(err) ? 1e30 : err);
        }
        if (c.lse) {
          const double lse = m + std::log(sum);
          const double err = std::fabs(double(gpu.lse[lse_at]) - lse);
          bad_kept += !(err <= 1e-3 + 1e-4 * std::fabs(lse));
        }
      }
    }
  }
  EXPECT_EQ(dropped > 0, c.expect_dropped) << c.name << ": " << dropped << " rows dropped";
  EXPECT_EQ(audit->disagreements, 0) << c.name << ": decisions outside the bound differ from the oracle";
  EXPECT_EQ(bad_kept, 0) << c.name << ": kept rows differ from attention over the GPU's sets; max |err| = " << worst;
  EXPECT_EQ(bad_dropped, 0) << c.name << ": dropped rows must be exactly 0 (LSE -inf)";
  EXPECT_EQ(gpu.stats[size_t(SPARSA_STAT_PAIRS_COMPUTED)], pairs) << c.name << ": pairs of the GPU's own sets";
  for (int s : {SPARSA_STAT_PAIRS_DENSE, SPARSA_STAT_BLOCKS_COMPUTED}) {
    EXPECT_EQ(gpu.stats[size_t(s)], cpu.stats[size_t(s)]) << c.name << ": stat " << s;
  }
}

class GpuTokenSparse : public ::testing::TestWithParam<SparseCase> {};

TEST_P(GpuTokenSparse, MatchesCpuBackend) {
  const bool gpu_present = cuda_device_present();
  if (!gpu_present && !cpu_selfcheck_requested()) GTEST_SKIP() << "no CUDA device/driver";
  const SparseCase& c = GetParam();
  std::mt19937 rng(2024);
  const Inputs in = make_inputs(c, rng);
  const Physical ph = build_physical(c, in, rng);
  const RunResult cpu = run_case(c, ph, false);
  ASSERT_EQ(cpu.status, SPARSA_STATUS_SUCCESS) << cpu.message;
  SelectionAudit audit;
  if (!gpu_present) {
    expect_matches_oracle(c, in, ph, cpu, cpu, &audit);
    return;
  }
  const RunResult gpu = run_case(c, ph, true);
  ASSERT_EQ(gpu.status, SPARSA_STATUS_SUCCESS) << gpu.message;
  expect_matches_oracle(c, in, ph, cpu, gpu, &audit);
  // Neither half of the audit may be vacuous where the case is built for it.
  if (c.expect_dropped) {
    EXPECT_GT(audit.decided, 0) << c.name << ": no decision outside the bound";
  }
  if (c.expect_within_bound) {
    EXPECT_GT(audit.within_bound, 0) << c.name << ": no decision inside the bound";
  }
  std::printf("[ AUDIT    ] %s: %lld decisions outside the bound, %lld inside\n", c.name.c_str(),
              static_cast<long long>(audit.decided), static_cast<long long>(audit.within_bound));
}

std::vector<SparseCase> cases() {
  std::vector<SparseCase> list;
  SparseCase c;
  c.name = "needles_f16_d64_gqa2";
  c.lengths = {900};
  c.structure = Structure::kNeedles;
  list.push_back(c);

  c = SparseCase{};
  c.name = "sinks_bf16_d128_gqa8";
  c.dtype = SPARSA_DTYPE_BF16;
  c.head_dim = 128;
  c.q_heads = 8;
  c.kv_heads = 1;
  c.lengths = {1000};
  c.window = 64;
  c.min_tokens = 100;
  c.coverage = 0.2f;
  c.structure = Structure::kSinks;
  list.push_back(c);

  c = SparseCase{};  // sequence 1 (90 <= 64 + 32) and 3 run dense; 0 and 2 sparse
  c.name = "ragged_varlen_needles_f16_d64_gqa4";
  c.q_heads = 4;
  c.kv_heads = 1;
  c.lengths = {900, 90, 613, 1};
  c.layout = Layout::kPacked;
  c.structure = Structure::kNeedles;
  list.push_back(c);

  c = SparseCase{};  // L = min_tokens + W runs dense; one more token and the policy is sparse
  c.name = "fallback_threshold_varlen_f16_d64";
  c.q_heads = 2;
  c.kv_heads = 2;
  c.lengths = {96, 97, 98, 103, 95};
  c.layout = Layout::kPacked;
  c.coverage = 0.5f;
  list.push_back(c);

  c = SparseCase{};
  c.name = "padded_batch2_f32_d40_no_lse";
  c.dtype = SPARSA_DTYPE_F32;
  c.head_dim = 40;
  c.q_heads = 2;
  c.kv_heads = 2;
  c.lengths = {500, 500};
  c.coverage = 0.1f;
  c.lse = false;
  list.push_back(c);

  c = SparseCase{};  // W > 128: two window-row tiles per scoring block
  c.name = "wide_window_bf16_d128_gqa2";
  c.dtype = SPARSA_DTYPE_BF16;
  c.head_dim = 128;
  c.q_heads = 2;
  c.kv_heads = 1;
  c.lengths = {1500};
  c.window = 160;
  c.min_tokens = 128;
  c.coverage = 0.05f;
  c.structure = Structure::kNeedles;
  list.push_back(c);

  c = SparseCase{};  // τ = 1: budget = min_tokens exactly (a fixed keep fraction, as the benchmark uses)
  c.name = "coverage_one_keeps_min_tokens_bf16_d128";
  c.dtype = SPARSA_DTYPE_BF16;
  c.head_dim = 128;
  c.q_heads = 4;
  c.kv_heads = 4;
  c.lengths = {2048};
  c.window = 64;
  c.min_tokens = 256;
  c.coverage = 1.f;
  list.push_back(c);

  c = SparseCase{};  // default W and τ, several scoring chunks and a long coverage descent
  c.name = "long_defaults_f16_d128";
  c.head_dim = 128;
  c.q_heads = 2;
  c.kv_heads = 1;
  c.lengths = {6000};
  c.window = 128;
  c.min_tokens = 1024;
  c.coverage = 0.005f;
  c.structure = Structure::kSinks;
  list.push_back(c);

  c = SparseCase{};
  c.name = "paged_kv_sinks_f16_d64";
  c.lengths = {700, 333};
  c.layout = Layout::kPagedKv;
  c.structure = Structure::kSinks;
  list.push_back(c);

  c = SparseCase{};  // the top-budget threshold falls among exactly tied candidates: decisions inside the bound
  c.name = "tied_runs_bf16_d128_gqa4";
  c.dtype = SPARSA_DTYPE_BF16;
  c.head_dim = 128;
  c.q_heads = 4;
  c.kv_heads = 1;
  c.lengths = {3000};
  c.window = 64;
  c.min_tokens = 256;
  c.coverage = 0.3f;
  c.structure = Structure::kTiedRuns;
  c.expect_within_bound = true;
  list.push_back(c);

  c = SparseCase{};  // the same on fp16 with several sequences (packed) and D = 64
  c.name = "tied_runs_varlen_f16_d64";
  c.q_heads = 4;
  c.kv_heads = 2;
  c.lengths = {1200, 700};
  c.layout = Layout::kPacked;
  c.window = 32;
  c.min_tokens = 128;
  c.coverage = 0.4f;
  c.structure = Structure::kTiedRuns;
  c.expect_within_bound = true;
  list.push_back(c);

  c = SparseCase{};  // τ = 0: dense causal attention everywhere
  c.name = "zero_coverage_dense_f16_d64";
  c.lengths = {300};
  c.coverage = 0.f;
  c.expect_dropped = false;
  list.push_back(c);
  return list;
}

INSTANTIATE_TEST_SUITE_P(Cases, GpuTokenSparse, ::testing::ValuesIn(cases()),
                         [](const ::testing::TestParamInfo<SparseCase>& info) { return info.param.name; });

// A planned run captures in a CUDA graph (no host synchronisation: device lengths are never read on the host) and
// its replays reproduce the eager result bit for bit.
TEST(GpuTokenSparseGraph, CaptureAndReplayVarlen) {
  SKIP_WITHOUT_GPU();
  SparseCase c;
  c.name = "graph";
  c.lengths = {700, 90, 400};
  c.layout = Layout::kPacked;
  c.structure = Structure::kNeedles;
  std::mt19937 rng(11);
  const Inputs in = make_inputs(c, rng);
  const Physical ph = build_physical(c, in, rng);
  const RunResult eager = run_case(c, ph, true);
  ASSERT_EQ(eager.status, SPARSA_STATUS_SUCCESS) << eager.message;

  ScopedStream owned_stream;
  CUDA_OK(cudaStreamCreate(owned_stream.out()));
  const cudaStream_t stream = owned_stream.get();
  sparsa_context_options options;
  sparsa_context_options_init(&options, sizeof options);
  options.device_type = SPARSA_DEVICE_CUDA;
  options.stream = stream;
  ScopedContext context(options);
  SPARSA_OK(context.status());
  sparsa_context* const ctx = context.get();
  {
    RunTensors tensors(c, ph, true);
    const sparsa_policy policy = policy_of(c);
    SPARSA_OK(sparsa_attention_plan(ctx, tensors.args(), &policy));
    ScopedGraph graph;
    CUDA_OK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal));
    const sparsa_status captured = sparsa_attention_run(ctx, tensors.args(), &policy);
    CUDA_OK(cudaStreamEndCapture(stream, graph.out()));
    ASSERT_EQ(captured, SPARSA_STATUS_SUCCESS) << sparsa_last_error_message();
    ScopedGraphExec exec;
    CUDA_OK(cudaGraphInstantiate(exec.out(), graph.get(), 0));
    for (int replay = 0; replay < 2; ++replay) {
      tensors.poison();
      CUDA_OK(cudaGraphLaunch(exec.get(), stream));
      CUDA_OK(cudaStreamSynchronize(stream));
      RunResult replayed;
      tensors.collect(&replayed);
      ASSERT_EQ(replayed.out.size(), eager.out.size());
      for (size_t i = 0; i < replayed.out.size(); ++i) {
        ASSERT_EQ(std::memcmp(&replayed.out[i], &eager.out[i], 4), 0) << "out element " << i;
      }
      EXPECT_EQ(replayed.selected, eager.selected);
      EXPECT_EQ(replayed.stats, eager.stats);
    }
  }
}

}  // namespace
