// ALGORITHMS.md §5 TOKEN_SPARSE, §6 TOKEN_SELECT, §7 TOKEN_INDICES: dense fallbacks, budgets, ties, the selection
// cache, paged and ragged batches, index lists with duplicates, blocks and head maps.
// The edges the spec names and the ones it implies, on the CPU backend (the library's oracle). Expected outputs come
// from the float64 reference (tests/reference) through spec_test_util.h.
#include "spec_test_util.h"

namespace {

TEST(SpecTokenPolicies, TokenSparseDenseBoundaryAndTauZero) {
  Cpu c;
  ST_RNG(rng, 16);
  // L = min_tokens + W: dense; L = min_tokens + W + 1: sparse path (budget = max(min, L−W−n_drop)).
  ref::Problem dense_len = random_problem(1, 2, 1, 8, {24}, {24}, true, rng, st::Pattern::kNeedles);
  compare(c.ctx, dense_len, token_sparse(8, 16, 0.5f), dense_of(dense_len));
  ref::Problem tau0 = random_problem(1, 2, 1, 8, {60}, {60}, true, rng, st::Pattern::kNeedles);
  compare(c.ctx, tau0, token_sparse(8, 4, 0.f), dense_of(tau0));
  ref::Problem plus1 = random_problem(1, 2, 1, 8, {25}, {25}, true, rng, st::Pattern::kNeedles);
  check_token_sparse(c.ctx, plus1, token_sparse(8, 16, 0.5f));
}

TEST(SpecTokenPolicies, TokenSparseBudgetsGqaBatchAndPadding) {
  Cpu c;
  ST_RNG(rng, 17);
  for (float coverage : {0.001f, 0.05f, 0.3f, 1.f}) {
    for (int min_tokens : {0, 5}) {
      SCOPED_TRACE(::testing::Message() << "coverage " << coverage << " min_tokens " << min_tokens);
      ref::Problem p = random_problem(2, 8, 1, 8, {40, 33}, {40, 33}, true, rng, st::Pattern::kNeedles);
      st::RunOptions opt;
      opt.layout = st::Layout::kVarlen;
      sparsa_policy pol = token_sparse(6, min_tokens, coverage);
      pol.token_sparse_pool_kernel = 5;
      check_token_sparse(c.ctx, p, pol, opt);
    }
  }
}

TEST(SpecTokenPolicies, TokenSparseLongerSequenceMixedDenseBatch) {
  Cpu c;
  ST_RNG(rng, 51);
  // Sequence 0 sparse (L = 300 > 64 + 100), sequence 1 dense (L = 150 <= 164).
  ref::Problem p = random_problem(2, 4, 2, 16, {300, 150}, {300, 150}, true, rng, st::Pattern::kNeedles);
  st::RunOptions opt;
  opt.layout = st::Layout::kVarlen;
  check_token_sparse(c.ctx, p, token_sparse(64, 100, 0.05f), opt);
}

TEST(SpecTokenPolicies, TokenSparseTiesInTopBudgetGoToSmallerIndex) {
  Cpu c;
  // Q = 0: every window row attends uniformly; pooled scores of interior candidates tie (edges get less through
  // zero padding); the budget keeps the lowest-index ties.
  ref::Problem p = st::make_problem(1, 1, 1, 4, {30}, {30}, true);
  ST_RNG(rng, 18);
  for (double& x : p.k[0]) x = rng.normal();
  for (double& x : p.v[0]) x = rng.normal();
  sparsa_policy pol = token_sparse(4, 10, 0.2f);
  pol.token_sparse_pool_kernel = 3;
  st::RunOptions opt;
  opt.selected_sets = 1;
  opt.selected_cap = 30;
  const st::RunResult r = st::run(c.ctx, p, pol, opt);
  st::expect_ok(r);
  ref::TokenSparseParams tp;
  tp.window = 4;
  tp.pool_kernel = 3;
  tp.min_tokens = 10;
  tp.coverage = 0.2;
  const ref::TokenSparseResult want = ref::token_sparse(p, tp);
  EXPECT_TRUE(st::sets_equal(r.selected, 30, want.selected));
  EXPECT_TRUE(st::outputs_close(r.out, want.out, st::kTolF32));
}


// §5.5 with min_tokens = 0 and τ = 1: n_drop = #(cumsum < 1) + 1 is L − W or L − W + 1 (rounding of the last
// cumsum), so budget = max(0, (L−W) − n_drop) is 0 (or −1, which can only mean "none"): every head keeps only the
// window [L−W, L). A negative budget must not be used as a count.
TEST(SpecTokenPolicies, TokenSparseCoverageOneKeepsOnlyTheWindow) {
  Cpu c;
  ST_RNG(rng, 32);
  bool saw_minus_one = false, saw_zero = false;  // both roundings of the last cumsum
  for (int trial = 0; trial < 96; ++trial) {
    const int L = 20 + trial % 16, W = 4;
    ref::Problem p = random_problem(1, 2, 1, 8, {L}, {L}, true, rng);
    ref::TokenSparseParams tp;
    tp.window = W;
    tp.min_tokens = 0;
    tp.coverage = 1.0;
    const int n_drop = ref::token_sparse(p, tp).n_drop[0];
    (n_drop > L - W ? saw_minus_one : saw_zero) = true;
    sparsa_policy pol = token_sparse(W, 0, 1.f);
    st::RunOptions opt;
    opt.selected_sets = 2;
    opt.selected_cap = L;
    ref::IndexSet window(W);
    std::iota(window.begin(), window.end(), L - W);
    const ref::Output want = attend_where(p, [&](int, int, int i, int j) { return i >= L - W && j >= L - W && j <= i; });
    SCOPED_TRACE(::testing::Message() << "L " << L << " trial " << trial << " reference n_drop " << n_drop);
    const st::RunResult r = st::run_and_compare(c.ctx, p, pol, want, opt);
    EXPECT_TRUE(st::sets_equal(r.selected, L, {{window, window}}));
  }
  EXPECT_TRUE(saw_minus_one && saw_zero) << "only one rounding of the last cumsum was exercised";
}

TEST(SpecTokenPolicies, TokenSparsePagedPageSizeOne) {
  Cpu c;
  ST_RNG(rng, 33);
  ref::Problem p = random_problem(2, 4, 2, 8, {30, 26}, {30, 26}, true, rng, st::Pattern::kNeedles);
  st::RunOptions opt;
  opt.layout = st::Layout::kPaged;
  opt.q_packed = true;
  opt.page_size = 1;
  check_token_sparse(c.ctx, p, token_sparse(5, 6, 0.1f), opt);
}


// §5.5 counted directly: a τ below the smallest layer score gives count 0 → n_drop 0 → budget L − W → every token
// kept (dense causal); a τ between the first and second ascending cumsums gives count 1 → n_drop 2 (the "+1").
TEST(SpecTokenPolicies, TokenSparseNDropZeroVersusOne) {
  Cpu c;
  ST_RNG(rng, 41);
  const int L = 40, W = 5;
  ref::Problem p = random_problem(1, 2, 1, 8, {L}, {L}, true, rng, st::Pattern::kNeedles);
  ref::TokenSparseParams tp;
  tp.window = W;
  tp.min_tokens = 0;
  tp.coverage = 0.5;
  const std::vector<double> cumsum = ref::token_sparse(p, tp).cumsum[0];
  ASSERT_GE(cumsum.size(), 3u);
  ASSERT_GT(cumsum[1] - cumsum[0], 1e-6) << "oracle: the first two layer scores must be distinguishable";
  st::RunOptions opt;
  opt.selected_sets = 2;
  opt.selected_cap = L;
  {
    const st::RunResult r = st::run_and_compare(c.ctx, p, token_sparse(W, 0, float(cumsum[0] * 0.5)), dense_of(p), opt);
    for (int h = 0; h < 2; ++h) EXPECT_EQ(r.selected[size_t(h) * L + L - 1], L - 1);
  }
  {
    const float tau = float(0.5 * (cumsum[0] + cumsum[1]));
    const st::RunResult r = st::run(c.ctx, p, token_sparse(W, 0, tau), opt);
    st::expect_ok(r);
    for (int h = 0; h < 2; ++h) {
      int n = 0;
      for (int e = 0; e < L; ++e) n += r.selected[size_t(h) * L + e] >= 0 ? 1 : 0;
      EXPECT_EQ(n, L - 2) << "head " << h << ": budget (L−W) − n_drop with n_drop = 1 + 1, plus the window";
    }
  }
}

TEST(SpecTokenPolicies, TokenSelectDenseBoundaryChunkScaleAndPerKvHead) {
  Cpu c;
  ST_RNG(rng, 19);
  // n_init + top_k + n_local == N: dense (causal, bottom-right).
  ref::Problem eq = random_problem(1, 4, 2, 8, {3}, {20}, true, rng, st::Pattern::kNeedles);
  compare(c.ctx, eq, token_select(4, 10, 6), dense_of(eq));
  // N + 1: one candidate is dropped.
  ref::Problem plus1 = random_problem(1, 4, 2, 8, {1}, {21}, true, rng, st::Pattern::kNeedles);
  check_select(c.ctx, plus1, token_select(4, 10, 6));
  // Chunked prefill, Sq > 1: causal inside the index set with offset N − Sq.
  ref::Problem chunk = random_problem(2, 8, 2, 8, {9}, {60}, true, rng, st::Pattern::kNeedles);
  sparsa_policy pol = token_select(3, 7, 5);
  check_select(c.ctx, chunk, pol);
  pol.select_scale_scores = 1;
  check_select(c.ctx, chunk, pol);
  pol.select_per_kv_head = 1;
  check_select(c.ctx, chunk, pol);
  // Chunk longer than n_local: rows before the local window only see the part of I up to them.
  ref::Problem longer = random_problem(1, 2, 1, 8, {30}, {50}, true, rng, st::Pattern::kNeedles);
  check_select(c.ctx, longer, token_select(2, 5, 4));
  // n_init = n_local = 0.
  check_select(c.ctx, longer, token_select(0, 9, 0));
  // Sq > N: the first Sq − N rows see no key (0, LSE −inf).
  ref::Problem over = random_problem(1, 2, 1, 8, {30}, {20}, true, rng, st::Pattern::kNeedles);
  check_select(c.ctx, over, token_select(2, 5, 4));
}

// More candidates than one vote work item (2048) and a ragged batch: chunked voting must equal the whole vote.
TEST(SpecTokenPolicies, TokenSelectManyCandidatesRaggedBatch) {
  Cpu c;
  ST_RNG(rng, 50);
  ref::Problem p = random_problem(2, 4, 2, 8, {2}, {4500, 2300}, true, rng, st::Pattern::kNeedles);
  sparsa_policy pol = token_select(16, 64, 32);
  check_select(c.ctx, p, pol);
  pol.select_per_kv_head = 1;
  check_select(c.ctx, p, pol);
}

TEST(SpecTokenPolicies, TokenSelectVoteTiesGoToTheSmallerIndex) {
  Cpu c;
  // q = 0: s = 0 everywhere, every candidate ties; T = the first top_k candidates.
  ref::Problem p = st::make_problem(1, 2, 1, 4, {1}, {30}, true);
  ST_RNG(rng, 20);
  for (double& x : p.k[0]) x = rng.normal();
  for (double& x : p.v[0]) x = rng.normal();
  st::RunOptions opt;
  opt.selected_sets = 1;
  opt.selected_cap = 30;
  const st::RunResult r = st::run(c.ctx, p, token_select(2, 5, 3), opt);
  st::expect_ok(r);
  const ref::IndexSet want = {0, 1, 2, 3, 4, 5, 6, 27, 28, 29};
  EXPECT_TRUE(st::sets_equal(r.selected, 30, {{want}}));
}

// Decode runs with a cache: q rows given explicitly (Hq = 1, D = 4, Sq = 1).
TEST(SpecTokenPolicies, TokenSelectCacheCosineExactlyAtThetaHitsAndGrowingN) {
  Cpu c;
  ST_RNG(rng, 21);
  st::SelectionCache cache(c.ctx, 1, 1, 1, 4, 8);
  sparsa_policy pol = token_select(1, 3, 2);
  pol.select_cache_theta = 0.5f;
  auto decode = [&](std::vector<double> q, int n) {
    ref::Problem p = st::make_problem(1, 1, 1, 4, {1}, {n}, true);
    st::Rng local(7);  // the same keys for every N (a growing sequence)
    for (double& x : p.k[0]) x = local.normal();
    for (double& x : p.v[0]) x = local.normal();
    std::copy(q.begin(), q.end(), p.q[0].begin());
    st::RunOptions opt;
    opt.cache = cache.get();
    opt.selected_sets = 1;
    opt.selected_cap = n;
    return std::make_pair(p, st::run(c.ctx, p, pol, opt));
  };
  // First call fills the slot (miss).
  auto [p1, r1] = decode({1, 0, 0, 0}, 20);
  st::expect_ok(r1);
  EXPECT_EQ(r1.stats[SPARSA_STAT_CACHE_MISSES], 1);
  // cos((1,1,1,1), (1,0,0,0)) = 1/2 exactly = theta: a hit (>=), with T reused and the windows recomputed for N = 21.
  auto [p2, r2] = decode({1, 1, 1, 1}, 21);
  st::expect_ok(r2);
  EXPECT_EQ(r2.stats[SPARSA_STAT_CACHE_HITS], 1);
  EXPECT_EQ(r2.stats[SPARSA_STAT_CACHE_MISSES], 0);
  std::vector<int32_t> t1;  // T of the first call: I minus {0} minus {18, 19}
  for (int c0 = 0; c0 < 20; ++c0) {
    const int32_t id = r1.selected[size_t(c0)];
    if (id >= 1 && id < 18) t1.push_back(id);
  }
  ASSERT_EQ(t1.size(), 3u);
  ref::IndexSet want = {0};
  want.insert(want.end(), t1.begin(), t1.end());
  want.push_back(19);
  want.push_back(20);
  EXPECT_TRUE(st::sets_equal(r2.selected, 21, {{want}}));
  // The output of the hit is attention over that set.
  const std::set<int> in_set(want.begin(), want.end());
  EXPECT_TRUE(st::outputs_close(r2.out, attend_where(p2, [&](int, int, int, int j) { return in_set.count(j) > 0; }),
                                st::kTolF32));
  // Orthogonal query: cos = 0 < theta, a miss (the slot still holds the first call's q̄: a hit does not store).
  auto [p3, r3] = decode({0, 1, 0, 0}, 22);
  st::expect_ok(r3);
  EXPECT_EQ(r3.stats[SPARSA_STAT_CACHE_HITS], 0);
  EXPECT_EQ(r3.stats[SPARSA_STAT_CACHE_MISSES], 1);
  (void)p1;
  (void)p3;
}

// §6.5 reuses the cached T on cos >= theta and recomputes only the sinks and the local window for the current N. A
// cached T must still be a selection from the current candidates [n_init, N - n_local): here the slot is reused for a
// shorter N, so T = {33, 34, 35} now lies inside the local window [32, 36), and sparsa counts a miss and recomputes
// (docs/algorithms.md, "Readings"). A literal reading would reuse it.
TEST(SpecTokenPolicies, TokenSelectCacheMissesWhenTheCachedSelectionLeavesTheCandidates) {
  Cpu c;
  st::SelectionCache cache(c.ctx, 1, 1, 1, 4, 8);
  sparsa_policy pol = token_select(2, 3, 4);
  pol.select_cache_theta = 0.9f;
  auto decode = [&](int n) {
    ref::Problem p = st::make_problem(1, 1, 1, 4, {1}, {n}, true);
    p.q[0] = {1, 0, 0, 0};
    for (int j = 0; j < n; ++j) {
      p.k[0][size_t(j) * 4] = (j >= 33 && j <= 35) ? 5.0 : 0.0;  // tokens 33..35 win the vote
      p.v[0][size_t(j) * 4 + 1] = j;
    }
    st::RunOptions opt;
    opt.cache = cache.get();
    opt.selected_sets = 1;
    opt.selected_cap = n;
    return st::run(c.ctx, p, pol, opt);
  };
  const st::RunResult first = decode(40);
  st::expect_ok(first);
  EXPECT_TRUE(st::sets_equal(first.selected, 40, {{{0, 1, 33, 34, 35, 36, 37, 38, 39}}}));
  const st::RunResult second = decode(36);
  st::expect_ok(second);
  // Cached T = {33, 34, 35} lies outside the new candidates [2, 32): a miss (docs/algorithms.md, "Readings"), and T
  // is recomputed over zero scores, where ties go to the smaller index.
  EXPECT_EQ(second.stats[SPARSA_STAT_CACHE_HITS], 0);
  EXPECT_EQ(second.stats[SPARSA_STAT_CACHE_MISSES], 1);
  EXPECT_TRUE(st::sets_equal(second.selected, 36, {{{0, 1, 2, 3, 4, 32, 33, 34, 35}}}));
}

TEST(SpecTokenPolicies, TokenSelectCacheThetaOneDisables) {
  Cpu c;
  ST_RNG(rng, 22);
  st::SelectionCache cache(c.ctx, 1, 2, 1, 8, 8);
  ref::Problem p = random_problem(1, 2, 1, 8, {1}, {40}, true, rng, st::Pattern::kNeedles);
  sparsa_policy pol = token_select(2, 5, 3);
  pol.select_cache_theta = 1.f;
  st::RunOptions opt;
  opt.cache = cache.get();
  for (int call = 0; call < 2; ++call) {
    const ref::TokenSelectResult want = ref::token_select(p, select_params(pol), nullptr);
    const st::RunResult r = st::run_and_compare(c.ctx, p, pol, want.out, opt);
    EXPECT_EQ(r.stats[SPARSA_STAT_CACHE_HITS], 0);
  }
}


TEST(SpecTokenPolicies, TokenSelectPagedDecodeRaggedBatch) {
  Cpu c;
  ST_RNG(rng, 34);
  ref::Problem p = random_problem(3, 8, 1, 8, {1}, {40, 19, 64}, true, rng, st::Pattern::kNeedles);
  for (int ps : {1, 16}) {
    st::RunOptions opt;
    opt.layout = st::Layout::kPaged;
    opt.page_size = ps;
    SCOPED_TRACE(::testing::Message() << "page size " << ps);
    check_select(c.ctx, p, token_select(3, 8, 8), opt);  // sequence 1 (N = 19 = 3 + 8 + 8) runs dense
  }
}

// ================================================================================================ §7 TOKEN_INDICES
TEST(SpecTokenPolicies, TokenIndicesDuplicatesUnusedTailBlocksHeadMapAndOverlap) {
  Cpu c;
  ST_RNG(rng, 23);
  const int B = 2, Hq = 4, Hkv = 2, N = 23, sq = 5, D = 8;
  for (int block : {1, 4, 5}) {
    for (bool causal : {false, true}) {
      ref::Problem p = random_problem(B, Hq, Hkv, D, {sq}, {N}, causal, rng);
      const int n_ids = (N + block - 1) / block, h_idx = 3, k = 6;
      std::vector<int32_t> indices(size_t(B) * h_idx * k);
      for (auto& id : indices) id = rng.integer(-1, n_ids - 1);
      indices[0] = indices[1] = n_ids - 1;  // duplicate, and the partial tail block when block > 1
      indices[2] = -1;
      const std::vector<int32_t> head_map = {2, 0, 2, 1};
      const int n_init = 2, n_local = 3;
      std::vector<std::vector<ref::IndexSet>> sets(B, std::vector<ref::IndexSet>(Hq));
      for (int b = 0; b < B; ++b)
        for (int h = 0; h < Hq; ++h) {
          std::set<int> s;
          for (int t = 0; t < n_init; ++t) s.insert(t);
          for (int t = N - n_local; t < N; ++t) s.insert(t);
          for (int slot = 0; slot < k; ++slot) {
            const int id = indices[(size_t(b) * h_idx + head_map[h]) * k + slot];
            if (id < 0) continue;
            for (int t = id * block; t < std::min(N, (id + 1) * block); ++t) s.insert(t);
          }
          sets[b][h].assign(s.begin(), s.end());
        }
      sparsa_policy pol = st::make_policy(SPARSA_POLICY_TOKEN_INDICES);
      pol.index_block_size = block;
      pol.index_n_init = n_init;
      pol.index_n_local = n_local;
      st::RunOptions opt;
      opt.indices = indices;
      opt.h_idx = h_idx;
      opt.k = k;
      opt.head_map = head_map;
      opt.selected_sets = Hq;
      opt.selected_cap = N;
      // §7 "attends to the deduplicated union, causal": causal whatever the run's flag says.
      const ref::Output want = attend_where(p, [&](int b, int h, int i, int j) {
        if (j > i + N - sq) return false;
        return std::binary_search(sets[b][h].begin(), sets[b][h].end(), j);
      });
      SCOPED_TRACE(::testing::Message() << "block " << block << " causal " << causal);
      const st::RunResult r = st::run_and_compare(c.ctx, p, pol, want, opt);
      EXPECT_TRUE(st::sets_equal(r.selected, N, sets));
    }
  }
}

TEST(SpecTokenPolicies, TokenIndicesSqGreaterThanN) {
  Cpu c;
  ST_RNG(rng, 49);
  ref::Problem p = random_problem(1, 2, 1, 8, {12}, {7}, false, rng);  // causal by definition, o = −5
  const std::vector<int32_t> indices = {6, 2, -1};
  sparsa_policy pol = st::make_policy(SPARSA_POLICY_TOKEN_INDICES);
  pol.index_n_init = 1;
  st::RunOptions opt;
  opt.indices = indices;
  opt.h_idx = 1;
  opt.k = 3;
  compare(c.ctx, p, pol,
          attend_where(p, [&](int, int, int i, int j) { return j <= i - 5 && (j == 0 || j == 2 || j == 6); }), opt);
}

TEST(SpecTokenPolicies, TokenIndicesDefaultHeadMapIsHOverGroup) {
  Cpu c;
  ST_RNG(rng, 24);
  ref::Problem p = random_problem(1, 6, 3, 8, {4}, {16}, true, rng);
  const int h_idx = 2, k = 3;  // default map: h / (6 / 2) = h / 3
  std::vector<int32_t> indices = {1, 5, 9, 0, 14, 15};
  sparsa_policy pol = st::make_policy(SPARSA_POLICY_TOKEN_INDICES);
  st::RunOptions opt;
  opt.indices = indices;
  opt.h_idx = h_idx;
  opt.k = k;
  const ref::Output want = attend_where(p, [&](int, int h, int i, int j) {
    if (j > i + 12) return false;
    const int row = h / 3;
    return std::find(indices.begin() + row * k, indices.begin() + (row + 1) * k, j) != indices.begin() + (row + 1) * k;
  });
  compare(c.ctx, p, pol, want, opt);
}

}  // namespace
