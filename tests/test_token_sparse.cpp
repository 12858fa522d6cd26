// §5 TOKEN_SPARSE: scoring by the last W queries, pooling, coverage budget, per-head top-budget plus the window,
// causal attention inside the compressed sequence, dropped rows exactly 0. Parameters scaled down: W 16,
// min_tokens 32, pool 7.
#include "test_util.h"

namespace {

using st::Pattern;

SPARSA_BACKEND_SUITE(TokenSparse);

constexpr int kWindow = 16;
constexpr int kMinTokens = 32;
constexpr int kPool = 7;
// Selections near a tie or a τ boundary could flip under fp32 rounding; inputs must keep these margins (relative
// score gap at the top-budget boundary; absolute distance of τ from every cumulative layer score).
constexpr double kSelectionMargin = 2e-5;
constexpr double kCoverageMargin = 2e-6;

sparsa_policy token_sparse_policy(const ref::TokenSparseParams& tp) {
  sparsa_policy pol = st::make_policy(SPARSA_POLICY_TOKEN_SPARSE);
  pol.token_sparse_window = tp.window;
  pol.token_sparse_pool_kernel = tp.pool_kernel;
  pol.token_sparse_coverage = float(tp.coverage);
  pol.token_sparse_min_tokens = tp.min_tokens;
  return pol;
}

ref::TokenSparseParams small_params(double coverage) {
  ref::TokenSparseParams tp;
  tp.window = kWindow;
  tp.min_tokens = kMinTokens;
  tp.pool_kernel = kPool;
  tp.coverage = double(float(coverage));  // the value the library receives
  return tp;
}

// τ halfway between the m-th and (m+1)-th ascending cumulative layer scores of sequence 0 (count of cumsum < τ is
// then exactly m); m = 0 puts τ below the first value.
double coverage_for_count(const ref::Problem& p, int m) {
  const ref::TokenSparseResult probe = ref::token_sparse(p, small_params(0.5));
  const std::vector<double>& c = probe.cumsum.at(0);
  return m == 0 ? c[0] / 2 : (c[m - 1] + c[m]) / 2;
}

// Runs and compares output, LSE, the selected sets exactly, and the zero rows; returns the reference.
ref::TokenSparseResult check(const st::Context& ctx, const ref::Problem& p, const ref::TokenSparseParams& tp,
                             st::RunOptions opt = {}) {
  const ref::TokenSparseResult want = ref::token_sparse(p, tp);
  EXPECT_GT(want.topk_margin, kSelectionMargin) << "input too close to a top-budget tie";
  EXPECT_GT(want.coverage_margin, kCoverageMargin) << "τ too close to a cumulative score";
  opt.selected_sets = p.Hq;
  opt.selected_cap = p.max_skv();
  const st::RunResult r = st::run_and_compare(ctx, p, token_sparse_policy(tp), want.out, opt);
  if (r.status != SPARSA_STATUS_SUCCESS) return want;
  EXPECT_TRUE(st::sets_equal(r.selected, opt.selected_cap, want.selected));
  for (int b = 0; b < p.B; ++b)
    for (int h = 0; h < p.Hq; ++h) {
      std::vector<uint8_t> kept(p.sq[b], 0);
      for (int t : want.selected[b][h]) kept[t] = 1;
      for (int i = 0; i < p.sq[b]; ++i)
        if (!kept[i]) {
          EXPECT_TRUE(st::row_is_zero(r.out, b, i, h, p.Hq, p.D)) << "dropped row b=" << b << " i=" << i << " h=" << h;
          if (opt.lse) {
            EXPECT_EQ(r.out.lse[b][size_t(h) * p.sq[b] + i], -INFINITY);
          }
        }
    }
  EXPECT_EQ(r.stats[SPARSA_STAT_PAIRS_DENSE], ref::dense_pairs(p));
  return want;
}

ref::Problem causal_problem(int B, int Hq, int Hkv, int D, std::vector<int> lengths) {
  return st::make_problem(B, Hq, Hkv, D, lengths, lengths, true);
}

TEST_P(TokenSparse, SequenceNoLongerThanMinTokensPlusWindowRunsDense) {
  int counter = 0;
  for (int L : {20, kMinTokens + kWindow}) {
    ST_RNG(rng, counter++);
    ref::Problem p = causal_problem(1, 2, 1, 64, {L});
    st::fill(p, Pattern::kNeedles, rng);
    const ref::TokenSparseResult want = check(ctx(), p, small_params(0.3));
    EXPECT_TRUE(want.ran_dense[0]);
    EXPECT_TRUE(st::outputs_close(want.out, ref::attend(p, ref::dense(p)), 1e-12));
  }
}

TEST_P(TokenSparse, ZeroCoverageRunsDense) {
  ST_RNG(rng, 0);
  ref::Problem p = causal_problem(1, 2, 2, 64, {200});
  st::fill(p, Pattern::kRandom, rng);
  const ref::TokenSparseResult want = check(ctx(), p, small_params(0.0));
  EXPECT_TRUE(want.ran_dense[0]);
}

TEST_P(TokenSparse, BudgetIsMaxOfMinTokensAndLMinusWMinusNDrop) {
  int counter = 0;
  // count of cumsum < τ = m: n_drop = m + (m > 0); budget = max(32, 184 - n_drop).
  for (int m : {0, 1, 50, 170}) {
    ST_RNG(rng, counter++);
    SCOPED_TRACE(::testing::Message() << "m=" << m);
    ref::Problem p = causal_problem(1, 2, 1, 64, {200});
    st::fill(p, Pattern::kRandom, rng);
    const ref::TokenSparseResult want = check(ctx(), p, small_params(coverage_for_count(p, m)));
    const int n_drop = m + (m > 0 ? 1 : 0);
    ASSERT_EQ(want.n_drop[0], n_drop) << "oracle";
    EXPECT_EQ(want.budget[0], std::max(kMinTokens, 184 - n_drop));
    for (int h = 0; h < 2; ++h) EXPECT_EQ(int(want.selected[0][h].size()), want.budget[0] + kWindow);
  }
}

TEST_P(TokenSparse, SelectionIsPerHeadTopBudgetOfPooledScoresPlusTheWindow) {
  int counter = 0;
  for (Pattern pattern : st::all_patterns()) {
    ST_RNG(rng, counter++);
    SCOPED_TRACE(st::pattern_name(pattern));
    ref::Problem p = causal_problem(1, 4, 2, 64, {240});
    st::fill(p, pattern, rng);
    check(ctx(), p, small_params(coverage_for_count(p, 90)));
  }
}

TEST_P(TokenSparse, DroppedRowsAreExactlyZero) {
  ST_RNG(rng, 0);
  ref::Problem p = causal_problem(1, 2, 1, 128, {300});
  st::fill(p, Pattern::kSinks, rng);
  const ref::TokenSparseResult want = check(ctx(), p, small_params(coverage_for_count(p, 200)));
  EXPECT_LT(int(want.selected[0][0].size()), 300) << "oracle: rows must be dropped";
}

TEST_P(TokenSparse, PoolKernelAveragesWithZeroPaddingCounted) {
  int counter = 0;
  for (int kernel : {1, 3, 9}) {
    ST_RNG(rng, counter++);
    SCOPED_TRACE(::testing::Message() << "kernel=" << kernel);
    ref::Problem p = causal_problem(1, 2, 1, 64, {180});
    st::fill(p, Pattern::kBand, rng);
    ref::TokenSparseParams tp = small_params(coverage_for_count(p, 60));
    tp.pool_kernel = kernel;
    check(ctx(), p, tp);
  }
}

TEST_P(TokenSparse, GqaQueryHeadsSelectIndependently) {
  ST_RNG(rng, 0);
  ref::Problem p = causal_problem(1, 8, 1, 64, {200});
  st::fill(p, Pattern::kNeedles, rng);
  const ref::TokenSparseResult want = check(ctx(), p, small_params(coverage_for_count(p, 100)));
  bool differ = false;
  for (int h = 1; h < 8; ++h) differ |= want.selected[0][h] != want.selected[0][0];
  EXPECT_TRUE(differ) << "oracle: needles should give different per-head sets";
}

TEST_P(TokenSparse, BatchOfDifferentLengthsSelectsPerSequence) {
  ST_RNG(rng, 0);
  ref::Problem p = causal_problem(3, 2, 1, 64, {150, 40, 230});
  st::fill(p, Pattern::kRandom, rng);
  st::RunOptions opt;
  opt.layout = st::Layout::kVarlen;
  const ref::TokenSparseResult want = check(ctx(), p, small_params(0.05), opt);
  EXPECT_FALSE(want.ran_dense[0]);
  EXPECT_TRUE(want.ran_dense[1]);
}

TEST_P(TokenSparse, RequiresSqEqualsSkv) {
  ST_RNG(rng, 0);
  ref::Problem p = st::make_problem(1, 2, 1, 64, {100}, {120}, true);
  st::fill(p, Pattern::kRandom, rng);
  const st::RunResult r = st::run(ctx(), p, token_sparse_policy(small_params(0.1)));
  EXPECT_TRUE(r.status == SPARSA_STATUS_SHAPE_MISMATCH || r.status == SPARSA_STATUS_INVALID_ARGUMENT)
      << sparsa_status_string(r.status) << " " << r.message;
  EXPECT_TRUE(r.untouched);
}


TEST_P(TokenSparse, PaddedBatchOfEqualLengths) {
  ST_RNG(rng, 0);
  ref::Problem p = causal_problem(2, 2, 2, 64, {160});
  st::fill(p, Pattern::kNeedles, rng);
  check(ctx(), p, small_params(coverage_for_count(p, 40)));
}

TEST_P(TokenSparse, DeltaOnTopOfTokenSparseCorrectsDroppedRowsToo) {
  // Dropped rows are 0 in the sparse output, so a corrected dropped row is O_dense[r] - O_sparse[r].
  ST_RNG(rng, 0);
  ref::Problem p = causal_problem(1, 2, 1, 64, {220});
  st::fill(p, Pattern::kRandom, rng);
  const ref::TokenSparseParams tp = small_params(coverage_for_count(p, 120));
  const ref::TokenSparseResult sparse = ref::token_sparse(p, tp);
  sparsa_policy pol = token_sparse_policy(tp);
  pol.flags |= SPARSA_POLICY_FLAG_DELTA;
  pol.delta_gamma = 16;
  pol.delta_tail_min = 32;
  st::RunOptions opt;
  opt.lse = false;
  st::run_and_compare(ctx(), p, pol, ref::delta(p, sparse.out, 16, 32), opt);
}

TEST_P(TokenSparse, Fp16MatchesTheRoundedReference) {
  ST_RNG(rng, 0);
  ref::Problem p = causal_problem(1, 2, 1, 64, {200});
  st::fill(p, Pattern::kSinks, rng);
  p = st::rounded(p, SPARSA_DTYPE_F16);
  st::RunOptions opt;
  opt.dtype = SPARSA_DTYPE_F16;
  check(ctx(), p, small_params(coverage_for_count(p, 60)), opt);
}


TEST_P(TokenSparse, ZeroMinTokensCanLeaveOnlyTheWindow) {
  // min_tokens 0: budget = max(0, (L - W) - n_drop) reaches 0 when every candidate is dropped but one
  // (count m = L - W - 1, n_drop = L - W), leaving only the window.
  int counter = 0;
  for (int m : {10, 23}) {
    ST_RNG(rng, counter++);
    SCOPED_TRACE(::testing::Message() << "m=" << m);
    ref::Problem p = causal_problem(1, 2, 1, 64, {40});  // 24 candidates
    st::fill(p, Pattern::kRandom, rng);
    ref::TokenSparseParams tp = small_params(0.5);
    tp.min_tokens = 0;
    const ref::TokenSparseResult probe = ref::token_sparse(p, tp);
    const std::vector<double>& c = probe.cumsum[0];
    tp.coverage = double(float((c[m - 1] + c[m]) / 2));
    const ref::TokenSparseResult want = check(ctx(), p, tp);
    EXPECT_EQ(want.budget[0], std::max(0, 24 - (m + 1))) << "oracle";
  }
}

}  // namespace
