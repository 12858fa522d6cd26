// ALGORITHMS.md §0, "results must be deterministic", on every backend: the same inputs give bit-identical out, LSE,
// selections (selected_indices / block_mask_out) and stats on every run — repeated in one context, after a run of
// another problem in that context (its scratch then holds other contents), and in fresh contexts (fresh scratch).
// The selection policies promise fixed reduction orders and no order-dependent atomics, so any difference is a race:
// e.g. a global-memory read-after-write between threads or blocks that normal scheduling happens to hide (the GPU
// device_topk's digit pick once read its segment's `remaining` after another warp of the same block could have
// rewritten it; compute-sanitizer racecheck, which serialises warps, exposed it as varying TOKEN_SPARSE selections).
// The CPU backend splits the same work over its threads, so it is held to the same rule.
//
// Outputs are poisoned before every run, alternately with the harness's two sets of patterns (NaNs of other payloads,
// other sentinels: RunOptions::second_poison), so an element a run does not write, or a result that depends on an
// output's earlier contents, shows up as a difference.
//
// Runs per row in the test's context: 20 on a GPU (a race shows only under some schedules), 3 on the CPU (its ctest
// suite runs on two cores), every other one after a run of the other problem; then one run in each of 2 fresh
// contexts. SPARSA_DETERMINISM_RUNS=n sets n on every backend (at least 2): fewer under compute-sanitizer, more when
// hunting a race. (It was SPARSA_GPU_DETERMINISM_RUNS while these checks were GPU-only.)
//
// The sizes are the smallest that still reach the GPU paths named in each row's comment (tests/gpu's old rows were
// longer), so a row stays near a second on the CPU.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <numeric>
#include <ostream>
#include <string>
#include <vector>

#include "test_util.h"

namespace {

using st::Layout;

constexpr int kGpuRuns = 20, kCpuRuns = 3;
constexpr int kFreshContexts = 2;  // extra runs, each in a new context

int runs_requested(int32_t backend) {
  const char* text = std::getenv("SPARSA_DETERMINISM_RUNS");
  const int runs = text != nullptr ? std::atoi(text) : backend == SPARSA_DEVICE_CPU ? kCpuRuns : kGpuRuns;
  return std::max(2, runs);
}

// One row: a problem (shape, layout, inputs) under a policy, and the policy of the run that disturbs the context's
// scratch between runs (on other inputs of the same shape).
struct DeterminismCase {
  std::string name;
  int32_t dtype = SPARSA_DTYPE_F16;
  int q_heads = 4, kv_heads = 2, head_dim = 64;
  std::vector<int> seq_q, seq_k;
  bool causal = true;
  Layout layout = Layout::kVarlen;  // q and k/v packed (cu_seqlens)
  bool q_packed = false;            // kPaged: packed q
  int page_size = 16;
  bool smooth = false;  // slow sinusoids of the position on the first 8 dims: neighbouring blocks look alike (SPARGE)
  sparsa_policy policy{}, other{};
  int selected_sets = 0, selected_cap = 0;  // selected_indices [B, sets, cap] when sets > 0
  bool block_mask_out = false;              // SPARGE's predicted mask
};
inline void PrintTo(const DeterminismCase& c, std::ostream* os) { *os << c.name; }

// The rows are built before main: no gtest assertions here (st::make_policy has them).
sparsa_policy policy_of(int32_t kind) {
  sparsa_policy p;
  if (sparsa_policy_init(&p, sizeof p, kind) != SPARSA_STATUS_SUCCESS) std::abort();
  return p;
}

DeterminismCase make_case(std::string name, int32_t dtype, int32_t policy, int hq, int hkv, int d,
                          std::vector<int> seq_q, std::vector<int> seq_k) {
  DeterminismCase c;
  c.name = std::move(name);
  c.dtype = dtype;
  c.q_heads = hq;
  c.kv_heads = hkv;
  c.head_dim = d;
  c.seq_q = std::move(seq_q);
  c.seq_k = std::move(seq_k);
  c.policy = c.other = policy_of(policy);
  return c;
}

// TOKEN_SPARSE (§5, Sq == Skv): one selected set per query head over the whole sequence.
DeterminismCase token_sparse_row(std::string name, int32_t dtype, int hq, int hkv, int d, std::vector<int> lengths,
                                 int window, int pool_kernel, int min_tokens, float coverage) {
  DeterminismCase c = make_case(std::move(name), dtype, SPARSA_POLICY_TOKEN_SPARSE, hq, hkv, d, lengths, lengths);
  c.policy.token_sparse_window = window;
  c.policy.token_sparse_pool_kernel = pool_kernel;
  c.policy.token_sparse_min_tokens = min_tokens;
  c.policy.token_sparse_coverage = coverage;
  c.other = c.policy;
  c.selected_sets = hq;
  c.selected_cap = *std::max_element(lengths.begin(), lengths.end());
  return c;
}

// TOKEN_SELECT (§6) without the selection cache, so every run selects.
DeterminismCase token_select_row(std::string name, int32_t dtype, int hq, int hkv, int d, std::vector<int> seq_q,
                                 std::vector<int> seq_k, int n_init, int top_k, int n_local, bool per_kv_head) {
  DeterminismCase c = make_case(std::move(name), dtype, SPARSA_POLICY_TOKEN_SELECT, hq, hkv, d, seq_q, seq_k);
  c.policy.select_n_init = n_init;
  c.policy.select_top_k = top_k;
  c.policy.select_n_local = n_local;
  c.policy.select_per_kv_head = per_kv_head ? 1 : 0;
  c.policy.select_cache_theta = 1.0f;
  c.other = c.policy;
  c.other.select_top_k = top_k / 2;  // a shorter selection fills the tensor's rows only partly, and scratch differently
  c.selected_sets = per_kv_head ? hkv : 1;
  c.selected_cap = n_init + top_k + n_local;
  return c;
}

constexpr int32_t kF16 = SPARSA_DTYPE_F16, kBF16 = SPARSA_DTYPE_BF16;

std::vector<DeterminismCase> cases() {
  std::vector<DeterminismCase> list;
  // The two varlen TOKEN_SPARSE batches racecheck caught: dense sequences (L <= min_tokens + W, and L = 1) next to
  // sparse ones of ragged lengths straddling the fallback threshold (96), GQA 4. Two sequences longer than the
  // 256-key score chunks.
  DeterminismCase c = token_sparse_row("token_sparse_ragged_varlen_f16_d64_gqa4", kF16, 4, 1, 64,
                                       {600, 90, 413, 1, 96, 97, 98, 103, 95}, 32, 7, 64, 0.3f);
  c.other.token_sparse_window = 48;
  c.other.token_sparse_coverage = 0.6f;
  list.push_back(c);
  // Several score chunks per head, W > 128 (two window-row tiles), budgets decided by the coverage count, and a
  // sequence longer than 2048 keys: device_topk's passes split its segments over several blocks.
  c = token_sparse_row("token_sparse_longer_bf16_d128_gqa2", kBF16, 4, 2, 128, {2100, 300}, 160, 7, 256, 0.05f);
  c.other.token_sparse_window = 64;
  list.push_back(c);
  // SPARGE's prediction (forced and self-similar blocks, the TopCdf cut) and the sparse pass over its mask.
  c = make_case("sparge_bf16_d128_gqa2_smooth", kBF16, SPARSA_POLICY_SPARGE, 4, 2, 128, {700, 333, 130},
                {700, 333, 130});
  c.smooth = true;
  c.policy.block_q = 128;
  c.policy.block_k = 64;
  c.policy.sparge_theta = 0.3f;
  c.policy.sparge_tau = 0.9f;
  c.other = c.policy;
  c.other.sparge_tau = 0.5f;
  c.block_mask_out = true;
  list.push_back(c);
  // Chunked-prefill rows over long key sequences: more than 2048 candidates (one block's share in device_topk), so
  // each segment spreads over up to three blocks and the last one to finish picks the digit.
  list.push_back(token_select_row("token_select_per_kv_head_multi_block_topk_f16_d64", kF16, 8, 2, 64, {4, 1, 7},
                                  {6000, 3000, 2500}, 64, 2048, 256, /*per_kv_head=*/true));
  // One set per sequence over a paged cache (page ids shuffled), packed q.
  c = token_select_row("token_select_shared_set_paged16_bf16_d128", kBF16, 8, 2, 128, {2, 1}, {5000, 2500}, 16, 1024,
                       64, /*per_kv_head=*/false);
  c.layout = Layout::kPaged;
  c.q_packed = true;
  list.push_back(c);
  // Dense decode over a paged cache with many splits: split-KV and its combine, whose order must not vary.
  c = make_case("dense_decode_split_kv_paged16_bf16_d128", kBF16, SPARSA_POLICY_DENSE, 8, 2, 128, {1, 1}, {3000, 123});
  c.layout = Layout::kPaged;
  c.other = policy_of(SPARSA_POLICY_SINK_WINDOW);
  list.push_back(c);
  return list;
}
const std::vector<DeterminismCase> kCases = cases();

// Low-frequency position features (periods 512 to 2048 positions) added to the first 8 dims of q and k.
void add_smooth_features(ref::Problem& p) {
  constexpr int kFeatures = 4;
  constexpr double kAmplitude = 4.0, kBasePeriod = 512.0, kTwoPi = 6.283185307179586;
  for (int b = 0; b < p.B; ++b) {
    auto add = [&](std::vector<double>& x, int length, int heads) {
      for (int t = 0; t < length; ++t)
        for (int h = 0; h < heads; ++h)
          for (int f = 0; f < kFeatures && 2 * f + 1 < p.D; ++f) {
            const double omega = kTwoPi / (kBasePeriod * (f + 1));
            double* r = &x[(size_t(t) * heads + h) * p.D];
            r[2 * f] += kAmplitude * std::cos(omega * t);
            r[2 * f + 1] += kAmplitude * std::sin(omega * t);
          }
    };
    add(p.q[b], p.sq[b], p.Hq);
    add(p.k[b], p.skv[b], p.Hkv);
  }
}

ref::Problem make_inputs(const DeterminismCase& c, uint64_t seed) {
  st::Rng rng(seed);
  ref::Problem p = st::make_problem(int(c.seq_q.size()), c.q_heads, c.kv_heads, c.head_dim, c.seq_q, c.seq_k, c.causal);
  st::fill(p, st::Pattern::kRandom, rng);
  if (c.smooth) add_smooth_features(p);
  return p;
}

st::RunOptions run_options(const DeterminismCase& c, bool second_poison) {
  st::RunOptions opt;
  opt.dtype = c.dtype;
  opt.layout = c.layout;
  opt.q_packed = c.q_packed;
  opt.page_size = c.page_size;
  opt.selected_sets = c.selected_sets;
  opt.selected_cap = c.selected_cap;
  opt.block_mask_out = c.block_mask_out;
  opt.second_poison = second_poison;
  return opt;
}

// Elements of `got` whose bytes differ from `want`'s (element_bytes wide), with the first one's index.
template <typename T>
void expect_same_bits(const std::vector<T>& want, const std::vector<T>& got, const std::string& what) {
  ASSERT_EQ(want.size(), got.size()) << what;
  int64_t differing = 0, first = -1;
  for (size_t e = 0; e < want.size(); ++e) {
    if (std::memcmp(&want[e], &got[e], sizeof(T)) != 0) {
      if (first < 0) first = int64_t(e);
      ++differing;
    }
  }
  EXPECT_EQ(differing, 0) << what << ": " << differing << " of " << want.size()
                          << " elements differ from the first run (first at element " << first << ")";
}

// out and LSE per sequence, flattened: the harness converts them to double, which keeps every bit of f32/f16/bf16.
std::vector<double> flat(const std::vector<std::vector<double>>& per_sequence) {
  std::vector<double> all;
  for (const auto& s : per_sequence) all.insert(all.end(), s.begin(), s.end());
  return all;
}

void expect_same_run(const st::RunResult& want, const st::RunResult& got, const std::string& where) {
  st::expect_ok(got);
  if (got.status != SPARSA_STATUS_SUCCESS) return;
  expect_same_bits(want.selected, got.selected, where + " selected_indices");
  expect_same_bits(want.block_mask, got.block_mask, where + " block_mask_out");
  expect_same_bits(want.stats, got.stats, where + " stats");
  expect_same_bits(flat(want.out.o), flat(got.out.o), where + " out");
  expect_same_bits(flat(want.out.lse), flat(got.out.lse), where + " lse");
}

SPARSA_BACKEND_TABLE(RunDeterminism, DeterminismCase, kCases);

// `runs` runs in the test's context (every other one preceded by a run of the other problem, which leaves different
// contents in the context's scratch), then kFreshContexts runs in new contexts: all equal to the first, bit for bit.
TEST_P(RunDeterminism, BitIdenticalAcrossRunsStaleScratchAndFreshContexts) {
  const DeterminismCase& c = row();
  const ref::Problem problem = make_inputs(c, st::test_seed(0));
  ref::Problem other_problem = problem;  // other inputs of the same shape, without drawing them again
  for (auto* t : {&other_problem.q, &other_problem.v})
    for (auto& rows : *t)
      for (double& x : rows) x = -x;
  const st::RunResult first = st::run(ctx(), problem, c.policy, run_options(c, false));
  st::expect_ok(first);
  if (first.status != SPARSA_STATUS_SUCCESS) return;
  if (c.selected_sets > 0) {  // the selection must not be empty or everything, or it tests little
    EXPECT_TRUE(std::any_of(first.selected.begin(), first.selected.end(), [](int32_t i) { return i >= 0; }));
  }
  const int runs = runs_requested(ctx().device_type());
  for (int r = 1; r < runs; ++r) {
    if (r % 2 == 1) {
      const st::RunResult disturbance = st::run(ctx(), other_problem, c.other, run_options(c, false));
      ASSERT_EQ(disturbance.status, SPARSA_STATUS_SUCCESS) << disturbance.message;
    }
    expect_same_run(first, st::run(ctx(), problem, c.policy, run_options(c, r % 2 == 1)), "run " + std::to_string(r));
    if (HasFailure()) return;  // one report is enough
  }
  for (int f = 0; f < kFreshContexts; ++f) {
    const st::Context fresh(ctx().device_type());
    ASSERT_EQ(fresh.status(), SPARSA_STATUS_SUCCESS) << sparsa_last_error_message();
    expect_same_run(first, st::run(fresh, problem, c.policy, run_options(c, f % 2 == 0)),
                    "fresh context " + std::to_string(f));
  }
}

// sparsa_topk_from_scores on its own (the GPU's device_topk): coarse values (many exact ties at the threshold),
// segments longer than one block's share, k inside a tie run; every run, in one context and in fresh ones, equals
// the host reference (ties: the smaller index wins, ids ascending).
struct TopkCase {
  std::string name;
  int batch = 1, heads = 1, count = 1, k = 1;
  double step = 0;  // scores rounded to multiples of step
};
inline void PrintTo(const TopkCase& c, std::ostream* os) { *os << c.name; }

// 50000 candidates: several blocks per segment in every device_topk pass.
const std::vector<TopkCase> kTopkCases = {
    {"ties_across_blocks_b2_h3_n50000_k20000", 2, 3, 50000, 20000, 1.0 / 8},
};

SPARSA_BACKEND_TABLE(TopkDeterminism, TopkCase, kTopkCases);

std::vector<int32_t> reference_topk(const std::vector<float>& scores, int rows, int count, int k) {
  std::vector<int32_t> want(size_t(rows) * k);
  for (int r = 0; r < rows; ++r) {
    std::vector<int32_t> order(count);
    std::iota(order.begin(), order.end(), 0);
    const float* v = &scores[size_t(r) * count];
    std::stable_sort(order.begin(), order.end(), [&](int32_t a, int32_t b) { return v[a] > v[b]; });
    std::sort(order.begin(), order.begin() + k);
    std::copy(order.begin(), order.begin() + k, want.begin() + size_t(r) * k);
  }
  return want;
}

// One call on ctx, its output poisoned with `poison` in every byte first; the indices it wrote.
std::vector<int32_t> topk_once(const st::Context& ctx, const TopkCase& c, const std::vector<float>& scores,
                               uint8_t poison) {
  st::Buffer in(ctx, SPARSA_DTYPE_F32, {c.batch, c.heads, c.count});
  st::Buffer out(ctx, SPARSA_DTYPE_I32, {c.batch, c.heads, c.k});
  std::memcpy(in.host().data(), scores.data(), scores.size() * sizeof(float));
  std::fill(out.host().begin(), out.host().end(), poison);
  in.upload();
  out.upload();
  const sparsa_tensor ts = in.tensor(), to = out.tensor();
  const sparsa_status status = sparsa_topk_from_scores(ctx.get(), &ts, c.k, 1, &to);
  EXPECT_EQ(status, SPARSA_STATUS_SUCCESS) << sparsa_last_error_message();
  if (status != SPARSA_STATUS_SUCCESS) return {};
  out.download();
  return std::vector<int32_t>(out.as<int32_t>(), out.as<int32_t>() + out.elements());
}

TEST_P(TopkDeterminism, EveryRunEqualsTheReference) {
  const TopkCase& c = row();
  st::Rng rng(st::test_seed(0));
  std::vector<float> scores(size_t(c.batch) * c.heads * c.count);
  for (float& x : scores) x = float(std::round(rng.normal() / c.step) * c.step);
  const std::vector<int32_t> want = reference_topk(scores, c.batch * c.heads, c.count, c.k);
  const uint8_t poisons[2] = {0xff, 0xab};  // ids -1 and 0xabababab, neither a top-k answer
  const int runs = runs_requested(ctx().device_type());
  for (int r = 0; r < runs + kFreshContexts; ++r) {
    std::unique_ptr<st::Context> fresh;
    if (r >= runs) {
      fresh = std::make_unique<st::Context>(ctx().device_type());
      ASSERT_EQ(fresh->status(), SPARSA_STATUS_SUCCESS) << sparsa_last_error_message();
    }
    const std::vector<int32_t> got = topk_once(fresh ? *fresh : ctx(), c, scores, poisons[r % 2]);
    expect_same_bits(want, got, (fresh ? "fresh context, run " : "run ") + std::to_string(r));
    if (HasFailure()) return;
  }
}

}  // namespace
