// §6 TOKEN_SELECT: mean query, head soft vote over the candidates, index set = sinks ∪ top-k ∪ local window,
// causal attention over it, and the selection cache. Parameters scaled down: n_init 4, top_k 16, n_local 8.
#include <cmath>

#include "test_util.h"

namespace {

using st::Pattern;

SPARSA_BACKEND_SUITE(TokenSelect);

constexpr int kInit = 4;
constexpr int kTopK = 16;
constexpr int kLocal = 8;
constexpr double kVoteMargin = 2e-5;  // relative vote gap at the top-k boundary the inputs must keep

ref::TokenSelectParams small_params() {
  ref::TokenSelectParams tp;
  tp.n_init = kInit;
  tp.top_k = kTopK;
  tp.n_local = kLocal;
  return tp;
}

sparsa_policy select_policy(const ref::TokenSelectParams& tp) {
  sparsa_policy pol = st::make_policy(SPARSA_POLICY_TOKEN_SELECT);
  pol.select_n_init = tp.n_init;
  pol.select_n_local = tp.n_local;
  pol.select_top_k = tp.top_k;
  pol.select_scale_scores = tp.scale_scores ? 1 : 0;
  pol.select_cache_theta = float(tp.cache_theta);
  pol.select_per_kv_head = tp.per_kv_head ? 1 : 0;
  return pol;
}

// Runs once and compares output, LSE, the index sets exactly and the cache counters of the run.
st::RunResult check(const st::Context& ctx, const ref::Problem& p, const ref::TokenSelectParams& tp,
                    const ref::TokenSelectResult& want, st::RunOptions opt = {}) {
  EXPECT_GT(want.topk_margin, kVoteMargin) << "input too close to a vote tie";
  opt.selected_sets = tp.per_kv_head ? p.Hkv : 1;
  opt.selected_cap = p.max_skv();
  st::RunResult r = st::run_and_compare(ctx, p, select_policy(tp), want.out, opt);
  if (r.status != SPARSA_STATUS_SUCCESS) return r;
  EXPECT_TRUE(st::sets_equal(r.selected, opt.selected_cap, want.selected));
  EXPECT_EQ(r.stats[SPARSA_STAT_PAIRS_COMPUTED], want.pairs_computed);
  if (opt.cache) {
    EXPECT_EQ(r.stats[SPARSA_STAT_CACHE_HITS], want.hits);
    EXPECT_EQ(r.stats[SPARSA_STAT_CACHE_MISSES], want.misses);
  }
  return r;
}

st::RunResult check(const st::Context& ctx, const ref::Problem& p, const ref::TokenSelectParams& tp,
                    st::RunOptions opt = {}) {
  return check(ctx, p, tp, ref::token_select(p, tp, nullptr), opt);
}

TEST_P(TokenSelect, DenseWhenNInitPlusTopKPlusNLocalCoversN) {
  int counter = 0;
  for (int N : {kInit + kTopK + kLocal - 5, kInit + kTopK + kLocal, kInit + kTopK + kLocal + 1}) {
    ST_RNG(rng, counter++);
    SCOPED_TRACE(::testing::Message() << "N=" << N);
    ref::Problem p = st::make_problem(1, 4, 2, 64, {1}, {N}, true);
    st::fill(p, Pattern::kRandom, rng);
    const ref::TokenSelectResult want = ref::token_select(p, small_params(), nullptr);
    EXPECT_EQ(want.ran_dense[0], N <= kInit + kTopK + kLocal) << "oracle";
    check(ctx(), p, small_params(), want);
  }
}

TEST_P(TokenSelect, DecodeIndexSetIsSinksTopKOfHeadSoftVoteAndLocalWindow) {
  int counter = 0;
  for (Pattern pattern : st::all_patterns()) {
    ST_RNG(rng, counter++);
    SCOPED_TRACE(st::pattern_name(pattern));
    ref::Problem p = st::make_problem(2, 8, 2, 64, {1}, {257}, true);
    st::fill(p, pattern, rng);
    check(ctx(), p, small_params());
  }
}

TEST_P(TokenSelect, DecodeCallersMayLeaveCausalZero) {
  ST_RNG(rng, 0);
  ref::Problem p = st::make_problem(1, 4, 1, 64, {1}, {200}, false);  // the reference is causal regardless
  st::fill(p, Pattern::kNeedles, rng);
  check(ctx(), p, small_params());
}

TEST_P(TokenSelect, ChunkedPrefillScoresWithTheMeanQueryAndAttendsCausally) {
  int counter = 0;
  for (Pattern pattern : st::all_patterns()) {
    ST_RNG(rng, counter++);
    SCOPED_TRACE(st::pattern_name(pattern));
    // A chunk of 16 rows at the end of 230 keys; n_local 8 < 16, so early chunk rows see only part of the window.
    ref::Problem p = st::make_problem(1, 4, 2, 128, {16}, {230}, true);
    st::fill(p, pattern, rng);
    check(ctx(), p, small_params());
  }
}

TEST_P(TokenSelect, ScoresAreRawDotProductsUnlessScaleScoresIsSet) {
  int counter = 0;
  for (bool scale_scores : {false, true})
    for (Pattern pattern : {Pattern::kRandom, Pattern::kNeedles}) {
      ST_RNG(rng, counter++);
      SCOPED_TRACE(::testing::Message() << "scale_scores=" << scale_scores << " " << st::pattern_name(pattern));
      ref::Problem p = st::make_problem(1, 8, 2, 64, {1}, {300}, true);
      st::fill(p, pattern, rng);
      ref::TokenSelectParams tp = small_params();
      tp.scale_scores = scale_scores;
      check(ctx(), p, tp);
    }
}

TEST_P(TokenSelect, PerKvHeadSelectionVotesOverItsGroup) {
  int counter = 0;
  for (Pattern pattern : {Pattern::kRandom, Pattern::kNeedles}) {
    ST_RNG(rng, counter++);
    SCOPED_TRACE(st::pattern_name(pattern));
    ref::Problem p = st::make_problem(2, 8, 4, 64, {4}, {250}, true);
    st::fill(p, pattern, rng);
    ref::TokenSelectParams tp = small_params();
    tp.per_kv_head = true;
    check(ctx(), p, tp);
  }
}

TEST_P(TokenSelect, TiesPreferSmallerIndex) {
  // Every candidate key identical: all votes tie, so T = the first top_k candidates.
  ST_RNG(rng, 0);
  ref::Problem p = st::make_problem(1, 4, 2, 64, {1}, {100}, true);
  st::fill(p, Pattern::kRandom, rng);
  for (int j = 1; j < 100; ++j)
    for (int h = 0; h < 2; ++h)
      for (int d = 0; d < 64; ++d) p.k[0][(j * 2 + h) * 64 + d] = p.k[0][h * 64 + d];
  ref::TokenSelectResult want = ref::token_select(p, small_params(), nullptr);
  ref::IndexSet expected;
  for (int t = 0; t < kInit + kTopK; ++t) expected.push_back(t);
  for (int t = 100 - kLocal; t < 100; ++t) expected.push_back(t);
  ASSERT_EQ(want.selected[0][0], expected) << "oracle";
  want.topk_margin = ref::kInf;  // ties are the point here
  check(ctx(), p, small_params(), want);
}

TEST_P(TokenSelect, RepeatedQueryHitsTheSelectionCache) {
  ST_RNG(rng, 0);
  ref::Problem p = st::make_problem(2, 4, 2, 64, {1}, {200}, true);
  st::fill(p, Pattern::kNeedles, rng);
  const ref::TokenSelectParams tp = small_params();
  st::SelectionCache cache(ctx(), 2, 4, 2, 64, kTopK);
  ref::SelectionCache ref_cache(2);
  st::RunOptions opt;
  opt.cache = cache.get();
  for (int call = 0; call < 3; ++call) {
    SCOPED_TRACE(::testing::Message() << "call " << call);
    const ref::TokenSelectResult want = ref::token_select(p, tp, &ref_cache);
    EXPECT_EQ(want.hits, call == 0 ? 0 : 2) << "oracle";
    check(ctx(), p, tp, want, opt);
    int64_t hits = -1, misses = -1;
    cache.counts(&hits, &misses);
    EXPECT_EQ(hits, ref_cache.hits);
    EXPECT_EQ(misses, ref_cache.misses);
  }
  ASSERT_EQ(sparsa_selection_cache_reset(cache.get()), SPARSA_STATUS_SUCCESS);
  int64_t hits = -1, misses = -1;
  cache.counts(&hits, &misses);
  EXPECT_EQ(hits, 0);
  EXPECT_EQ(misses, 0);
  ref::SelectionCache fresh(2);
  const ref::TokenSelectResult after_reset = ref::token_select(p, tp, &fresh);
  check(ctx(), p, tp, after_reset, opt);  // a miss again
}

TEST_P(TokenSelect, CacheHitReusesTopKButRecomputesSinksAndLocalWindow) {
  // Decode step at N = 240, then at N = 241 with a nearby query (cos >= theta): T comes from the cache although a
  // fresh vote would choose differently, and the local window moves with N.
  ST_RNG(rng, 0);
  ref::Problem p1 = st::make_problem(1, 4, 1, 64, {1}, {241}, true);
  st::fill(p1, Pattern::kRandom, rng);
  ref::Problem p0 = p1;
  p0.skv = {240};
  p0.k[0].resize(240 * 64);
  p0.v[0].resize(240 * 64);
  for (double& x : p1.q[0]) x += 0.4 * rng.normal();  // nearby, not equal
  ref::TokenSelectParams tp = small_params();
  tp.cache_theta = 0.5;
  st::SelectionCache cache(ctx(), 1, 4, 1, 64, kTopK);
  ref::SelectionCache ref_cache(1);
  st::RunOptions opt;
  opt.cache = cache.get();
  check(ctx(), p0, tp, ref::token_select(p0, tp, &ref_cache), opt);
  const ref::TokenSelectResult second = ref::token_select(p1, tp, &ref_cache);
  ASSERT_EQ(second.hits, 1) << "oracle: the second query must hit";
  EXPECT_NE(second.selected[0][0], ref::token_select(p1, tp, nullptr).selected[0][0])
      << "oracle: a fresh vote should differ, otherwise the test cannot see the reuse";
  check(ctx(), p1, tp, second, opt);
}

TEST_P(TokenSelect, DissimilarQueryMissesAndRefreshesTheCache) {
  ST_RNG(rng, 0);
  ref::Problem a = st::make_problem(1, 4, 2, 64, {1}, {200}, true);
  st::fill(a, Pattern::kRandom, rng);
  ref::Problem b = a;
  for (double& x : b.q[0]) x = rng.normal();  // unrelated query: cos ≈ 0 < 0.9
  const ref::TokenSelectParams tp = small_params();
  st::SelectionCache cache(ctx(), 1, 4, 2, 64, kTopK);
  ref::SelectionCache ref_cache(1);
  st::RunOptions opt;
  opt.cache = cache.get();
  for (const ref::Problem* p : {&a, &b, &b, &a}) check(ctx(), *p, tp, ref::token_select(*p, tp, &ref_cache), opt);
  EXPECT_EQ(ref_cache.hits, 1);
  EXPECT_EQ(ref_cache.misses, 3);
  int64_t hits = -1, misses = -1;
  cache.counts(&hits, &misses);
  EXPECT_EQ(hits, 1);
  EXPECT_EQ(misses, 3);
}

TEST_P(TokenSelect, CacheThetaOneDisablesTheCache) {
  ST_RNG(rng, 0);
  ref::Problem p = st::make_problem(1, 4, 2, 64, {1}, {200}, true);
  st::fill(p, Pattern::kRandom, rng);
  ref::TokenSelectParams tp = small_params();
  tp.cache_theta = 1.0;
  st::SelectionCache cache(ctx(), 1, 4, 2, 64, kTopK);
  st::RunOptions opt;
  opt.cache = cache.get();
  for (int call = 0; call < 2; ++call) {
    const st::RunResult r = check(ctx(), p, tp, ref::token_select(p, tp, nullptr), st::RunOptions{});
    const st::RunResult rc = st::run(ctx(), p, select_policy(tp), opt);
    ASSERT_EQ(rc.status, SPARSA_STATUS_SUCCESS) << rc.message;
    EXPECT_EQ(rc.stats[SPARSA_STAT_CACHE_HITS], 0);
    EXPECT_EQ(rc.out.o, r.out.o);
  }
  int64_t hits = -1;
  cache.counts(&hits, nullptr);
  EXPECT_EQ(hits, 0);
}

TEST_P(TokenSelect, CacheSmallerThanTheRunIsAShapeMismatch) {
  ST_RNG(rng, 0);
  ref::Problem p = st::make_problem(2, 4, 2, 64, {1}, {200}, true);
  st::fill(p, Pattern::kRandom, rng);
  st::SelectionCache cache(ctx(), 1, 4, 2, 64, kTopK);  // max_batch 1 < B 2
  st::RunOptions opt;
  opt.cache = cache.get();
  const st::RunResult r = st::run(ctx(), p, select_policy(small_params()), opt);
  EXPECT_EQ(r.status, SPARSA_STATUS_SHAPE_MISMATCH) << r.message;
  EXPECT_TRUE(r.untouched);
}


TEST_P(TokenSelect, PerKvHeadSelectionWithTheCacheAndAChunk) {
  ST_RNG(rng, 0);
  ref::Problem p = st::make_problem(2, 4, 2, 64, {12}, {220}, true);
  st::fill(p, Pattern::kNeedles, rng);
  ref::TokenSelectParams tp = small_params();
  tp.per_kv_head = true;
  st::SelectionCache cache(ctx(), 2, 4, 2, 64, kTopK);
  ref::SelectionCache ref_cache(2);
  st::RunOptions opt;
  opt.cache = cache.get();
  for (int call = 0; call < 2; ++call) {
    SCOPED_TRACE(::testing::Message() << "call " << call);
    check(ctx(), p, tp, ref::token_select(p, tp, &ref_cache), opt);
  }
}

TEST_P(TokenSelect, CacheRowsHitAndMissIndependently) {
  ST_RNG(rng, 0);
  ref::Problem p = st::make_problem(2, 4, 1, 64, {1}, {180}, true);
  st::fill(p, Pattern::kRandom, rng);
  const ref::TokenSelectParams tp = small_params();
  st::SelectionCache cache(ctx(), 2, 4, 1, 64, kTopK);
  ref::SelectionCache ref_cache(2);
  st::RunOptions opt;
  opt.cache = cache.get();
  check(ctx(), p, tp, ref::token_select(p, tp, &ref_cache), opt);
  for (double& x : p.q[1]) x = rng.normal();  // sequence 1 changes its query, sequence 0 does not
  const ref::TokenSelectResult want = ref::token_select(p, tp, &ref_cache);
  ASSERT_EQ(want.hits, 1);
  ASSERT_EQ(want.misses, 1);
  check(ctx(), p, tp, want, opt);
}

TEST_P(TokenSelect, RaggedBatchWhereOneSequenceFallsBackToDense) {
  ST_RNG(rng, 0);
  ref::Problem p = st::make_problem(2, 4, 2, 64, {1}, {150, kInit + kTopK + kLocal}, true);
  st::fill(p, Pattern::kSinks, rng);
  const ref::TokenSelectResult want = ref::token_select(p, small_params(), nullptr);
  ASSERT_FALSE(want.ran_dense[0]);
  ASSERT_TRUE(want.ran_dense[1]);
  st::RunOptions opt;
  opt.layout = st::Layout::kPaged;
  opt.page_size = 16;
  check(ctx(), p, small_params(), want, opt);
}

TEST_P(TokenSelect, ScaleScoresUsesTheCallersSoftmaxScale) {
  ST_RNG(rng, 0);
  ref::Problem p = st::make_problem(1, 8, 2, 64, {1}, {240}, true);
  st::fill(p, Pattern::kNeedles, rng);
  p.scale = 0.02;
  ref::TokenSelectParams tp = small_params();
  tp.scale_scores = true;
  check(ctx(), p, tp);
}


TEST_P(TokenSelect, NoSinksNoLocalWindowChunkRowsMaySeeNothing) {
  // n_init = n_local = 0: I = T only; early rows of a chunk may see no selected key (0 and LSE -inf).
  ST_RNG(rng, 0);
  ref::Problem p = st::make_problem(1, 4, 2, 64, {24}, {64}, true);
  st::fill(p, Pattern::kRandom, rng);
  // Make the chunk's own keys (40..63) the strongest matches of the mean query.
  for (int j = 40; j < 64; ++j)
    for (int h = 0; h < 2; ++h)
      for (int d = 0; d < 64; ++d) p.k[0][(j * 2 + h) * 64 + d] += 0.5 * p.q[0][(23 * 4 + h * 2) * 64 + d];
  ref::TokenSelectParams tp;
  tp.n_init = 0;
  tp.n_local = 0;
  tp.top_k = 8;
  check(ctx(), p, tp);
}

TEST_P(TokenSelect, SingleKeySequence) {
  ST_RNG(rng, 0);
  ref::Problem p = st::make_problem(2, 2, 1, 64, {1}, {1}, true);
  st::fill(p, Pattern::kRandom, rng);
  check(ctx(), p, small_params());
}


TEST_P(TokenSelect, CacheHitOnAShorterSequenceStaysInBounds) {
  // The spec leaves a cached T that reaches past a shorter sequence's N undefined; it must still not read past the
  // keys (run under ASan) and must either succeed with finite outputs or fail with a message.
  ST_RNG(rng, 0);
  ref::Problem long_seq = st::make_problem(1, 4, 2, 64, {1}, {240}, true);
  st::fill(long_seq, Pattern::kRandom, rng);
  // Keys near the end match the query, so the cached T holds large token ids.
  for (int j = 200; j < 230; ++j)
    for (int h = 0; h < 2; ++h)
      for (int d = 0; d < 64; ++d) long_seq.k[0][(j * 2 + h) * 64 + d] += 2.0 * long_seq.q[0][(h * 2) * 64 + d];
  ref::Problem short_seq = long_seq;
  short_seq.skv = {100};
  short_seq.k[0].resize(100 * 2 * 64);
  short_seq.v[0].resize(100 * 2 * 64);
  const ref::TokenSelectParams tp = small_params();
  st::SelectionCache cache(ctx(), 1, 4, 2, 64, kTopK);
  st::RunOptions opt;
  opt.cache = cache.get();
  const st::RunResult first = st::run(ctx(), long_seq, select_policy(tp), opt);
  st::expect_ok(first);
  const st::RunResult second = st::run(ctx(), short_seq, select_policy(tp), opt);
  if (second.status == SPARSA_STATUS_SUCCESS) {
    EXPECT_TRUE(second.unwritten.empty());
    for (double x : second.out.o[0]) ASSERT_TRUE(std::isfinite(x));
  } else {
    EXPECT_FALSE(second.message.empty());
    EXPECT_TRUE(second.untouched);
  }
}

}  // namespace

TEST_P(TokenSelect, HalfPrecisionDecodeOverThousandsOfCandidatesSelectsLikeTheOracle) {
  // One query row per sequence on fp16/bf16 caches over thousands of keys: the scoring kernel's key tiles (the last
  // one partial), index sets longer than one decode slice (their rows merged by LSE), shared and per-kv-head sets,
  // GQA 4/1/8, head dims 64/128/256, padded and paged caches, and a plan that sizes the scratch up front.
  struct Case {
    int B, Hq, Hkv, D;
    std::vector<int> skv;
  };
  const Case cases[] = {{1, 8, 2, 128, {3000}}, {2, 4, 4, 64, {2100, 1500}}, {1, 8, 1, 256, {1800}}};
  ref::TokenSelectParams tp;
  tp.n_init = 16;
  tp.n_local = 64;
  int counter = 0;
  for (const Case& c : cases)
    for (bool per_kv_head : {false, true})
      for (int32_t dtype : {SPARSA_DTYPE_F16, SPARSA_DTYPE_BF16})
        for (st::Layout layout : {st::Layout::kPadded, st::Layout::kPaged}) {
          ST_RNG(rng, counter++);
          SCOPED_TRACE(::testing::Message() << "B=" << c.B << " Hq=" << c.Hq << " Hkv=" << c.Hkv << " D=" << c.D
                                            << " per_kv_head=" << per_kv_head << " dtype=" << dtype
                                            << " layout=" << int(layout));
          ref::Problem p = st::make_problem(c.B, c.Hq, c.Hkv, c.D, {1}, c.skv, true);
          st::fill(p, Pattern::kRandom, rng);
          p = st::rounded(p, dtype);
          tp.per_kv_head = per_kv_head;
          // top_k near 1100 where the oracle's votes leave a gap at the boundary (thousands of random candidates
          // sit close together).
          ref::TokenSelectResult want;
          for (int top_k : {1100, 1090, 1110, 1080, 1120}) {
            tp.top_k = top_k;
            want = ref::token_select(p, tp, nullptr);
            if (want.topk_margin > kVoteMargin) break;
          }
          st::RunOptions opt;
          opt.dtype = dtype;
          opt.layout = layout;
          opt.plan_first = true;
          const st::RunResult r = check(ctx(), p, tp, want, opt);
          EXPECT_EQ(r.scratch_after_plan, r.scratch_after_run) << "the run after sparsa_attention_plan grew scratch";
        }
}

namespace {

// One query row per sequence over a 16-bit cache, and TOKEN_SELECT's parameters and run options for it: the shape of
// the CPU-only tests below.
struct HalfDecodeCase {
  int B, Hq, Hkv, D;
  std::vector<int> skv;
  int top_k;
};
struct HalfDecodeRun {
  ref::Problem p;
  ref::TokenSelectParams tp;
  st::RunOptions opt;
};
HalfDecodeRun half_decode_run(const HalfDecodeCase& c, st::Pattern pattern, int32_t dtype, bool per_kv_head,
                              bool scale_scores, st::Rng& rng) {
  HalfDecodeRun run;
  run.p = st::make_problem(c.B, c.Hq, c.Hkv, c.D, std::vector<int>(size_t(c.B), 1), c.skv, true);
  st::fill(run.p, pattern, rng);
  run.p = st::rounded(run.p, dtype);
  run.tp.n_init = 16;
  run.tp.n_local = 64;
  run.tp.top_k = c.top_k;
  run.tp.per_kv_head = per_kv_head;
  run.tp.scale_scores = scale_scores;
  run.opt.selected_sets = per_kv_head ? run.p.Hkv : 1;
  run.opt.selected_cap = run.p.max_skv();
  run.opt.dtype = dtype;
  return run;
}

}  // namespace

// The CPU's TOKEN_SELECT decode on a 16-bit cache runs an fp32 screen first (backends/cpu/select_screen.h) and takes
// the float64 pass only where the screen cannot certify; a float32 cache always takes the float64 pass. The same
// values in both must give the same index sets, bit for bit, even where votes nearly tie (no margin asked here):
// padded and paged caches, batches of different lengths, shared and per-kv-head sets, scaled scores, every pattern;
// and the outputs agree. (sparsa_cpu_kernel_tests checks the screen alone, including that it certifies where it should.)
TEST(TokenSelectCpu, HalfDecodeSelectsExactlyAsTheSameValuesInFloat32) {
  st::Context context(SPARSA_DEVICE_CPU);
  ASSERT_EQ(context.status(), SPARSA_STATUS_SUCCESS);
  const HalfDecodeCase cases[] = {{1, 32, 8, 128, {3000}, 380}, {2, 16, 2, 64, {2400, 1700}, 301},
                                  {1, 8, 1, 256, {2000}, 250},  {2, 16, 16, 128, {1500, 2100}, 200},
                                  {1, 28, 4, 128, {2500}, 300}, {1, 12, 2, 64, {2000}, 260}};
  int counter = 0;
  for (const HalfDecodeCase& c : cases)
    for (st::Pattern pattern : st::all_patterns())
      for (int32_t dtype : {SPARSA_DTYPE_F16, SPARSA_DTYPE_BF16}) {
        const bool per_kv_head = counter % 2 == 1, scale_scores = counter % 3 == 2;
        const st::Layout layout = counter % 4 < 2 ? st::Layout::kPaged : st::Layout::kPadded;
        ST_RNG(rng, counter++);
        SCOPED_TRACE(::testing::Message() << "B=" << c.B << " Hq=" << c.Hq << " Hkv=" << c.Hkv << " D=" << c.D
                                          << " " << st::pattern_name(pattern) << " dtype=" << dtype
                                          << " per_kv_head=" << per_kv_head << " scale_scores=" << scale_scores);
        HalfDecodeRun run = half_decode_run(c, pattern, dtype, per_kv_head, scale_scores, rng);
        run.opt.layout = layout;
        const st::RunResult half = st::run(context, run.p, select_policy(run.tp), run.opt);
        run.opt.dtype = SPARSA_DTYPE_F32;
        const st::RunResult single = st::run(context, run.p, select_policy(run.tp), run.opt);
        ASSERT_EQ(half.status, SPARSA_STATUS_SUCCESS) << half.message;
        ASSERT_EQ(single.status, SPARSA_STATUS_SUCCESS) << single.message;
        EXPECT_EQ(half.selected, single.selected);
        // The 16-bit decode attends over I with the screen's fp32 scores of T (KnownScores in backends/cpu), the
        // float32 one scores I again: the same attention within the 16-bit tolerance.
        EXPECT_TRUE(st::outputs_close(half.out, single.out, st::tolerance(dtype)));
      }
}

namespace {

// `run` with 1, 2, 3, 5 and 8 workers: the same bits of out, LSE and the index sets every time.
void expect_the_same_bits_on_any_thread_count(const HalfDecodeRun& run) {
  st::RunResult first;
  for (int threads : {1, 2, 3, 5, 8}) {
    SCOPED_TRACE(::testing::Message() << threads << " workers");
    st::Context context(SPARSA_DEVICE_CPU, threads);
    ASSERT_EQ(context.status(), SPARSA_STATUS_SUCCESS);
    st::RunResult r = st::run(context, run.p, select_policy(run.tp), run.opt);
    st::expect_ok(r);
    if (threads == 1) {
      first = std::move(r);
      continue;
    }
    EXPECT_EQ(r.out.o, first.out.o);
    EXPECT_EQ(r.out.lse, first.out.lse);
    EXPECT_EQ(r.selected, first.selected);
  }
}

}  // namespace

// The float64 pass (every float32 cache, and what the screen cannot certify) cuts the candidates into items by the
// number of workers (about two per worker, 512 to 2048 candidates each), and the results must not depend on it: the
// same bits of out, LSE and the index sets with 1, 2, 3, 5 and 8 workers, whose items end at different candidates.
TEST(TokenSelectCpu, Float64PassGivesTheSameBitsOnAnyThreadCount) {
  const HalfDecodeCase cases[] = {{1, 32, 8, 128, {3000}, 380}, {2, 8, 8, 128, {2100, 1700}, 200}};
  int counter = 0;
  for (const HalfDecodeCase& c : cases)
    for (bool scale_scores : {false, true}) {
      ST_RNG(rng, counter++);
      SCOPED_TRACE(::testing::Message() << "B=" << c.B << " Hq=" << c.Hq << " Hkv=" << c.Hkv << " D=" << c.D
                                        << " scale_scores=" << scale_scores);
      HalfDecodeRun run = half_decode_run(c, st::Pattern::kRandom, SPARSA_DTYPE_F16, false, scale_scores, rng);
      run.opt.dtype = SPARSA_DTYPE_F32;
      expect_the_same_bits_on_any_thread_count(run);
    }
}

// The float64 pass keeps the run's [B, Hq, |C|] float64 scores when they fit 64 MiB; otherwise it scores each
// (sequence, kv head) for the softmax statistics and again for the votes (backends/cpu/cpu_token_select.cpp). Four
// sequences whose scores need about 70 MB take that second way, each of them alone (17 MB) the first: the same index
// sets and the same bits of out and LSE.
TEST(TokenSelectCpu, Float64PassWithoutRoomToKeepScoresSelectsAsWithIt) {
  const HalfDecodeCase c{4, 64, 1, 16, {34000, 33900, 33500, 34100}, 2048};
  ST_RNG(rng, 0);
  HalfDecodeRun batch = half_decode_run(c, st::Pattern::kRandom, SPARSA_DTYPE_F16, false, true, rng);
  batch.opt.dtype = SPARSA_DTYPE_F32;
  st::Context context(SPARSA_DEVICE_CPU);
  ASSERT_EQ(context.status(), SPARSA_STATUS_SUCCESS);
  const st::RunResult all = st::run(context, batch.p, select_policy(batch.tp), batch.opt);
  st::expect_ok(all);
  const size_t cap = size_t(batch.opt.selected_cap);
  for (int b = 0; b < c.B; ++b) {
    SCOPED_TRACE(::testing::Message() << "sequence " << b);
    HalfDecodeRun one = batch;
    one.p.B = 1;
    one.p.sq = {batch.p.sq[size_t(b)]};
    one.p.skv = {batch.p.skv[size_t(b)]};
    one.p.q = {batch.p.q[size_t(b)]};
    one.p.k = {batch.p.k[size_t(b)]};
    one.p.v = {batch.p.v[size_t(b)]};
    const st::RunResult alone = st::run(context, one.p, select_policy(one.tp), one.opt);
    st::expect_ok(alone);
    const std::vector<int32_t> in_batch(all.selected.begin() + ptrdiff_t(size_t(b) * cap),
                                        all.selected.begin() + ptrdiff_t(size_t(b + 1) * cap));
    EXPECT_EQ(alone.selected, in_batch);
    EXPECT_EQ(alone.out.o[0], all.out.o[size_t(b)]);
    EXPECT_EQ(alone.out.lse[0], all.out.lse[size_t(b)]);
  }
}

// The 16-bit decode cuts its work by the number of workers (the attention over I cuts a list's slices into blocks of
// kv heads when the slices alone are fewer than the workers; the screen's probe and chunks are items of their own),
// and the results must not depend on it: the same bits of out, LSE and the index sets with 1, 2, 3, 5 and 8 workers,
// shared and per-kv-head sets, lists of one slice and of several.
TEST(TokenSelectCpu, HalfDecodeGivesTheSameBitsOnAnyThreadCount) {
  const HalfDecodeCase cases[] = {
      {1, 32, 8, 128, {3000}, 380}, {1, 16, 4, 64, {2600}, 1200}, {2, 8, 8, 128, {2100, 1700}, 200}};
  int counter = 0;
  for (const HalfDecodeCase& c : cases)
    for (bool per_kv_head : {false, true}) {
      ST_RNG(rng, counter++);
      SCOPED_TRACE(::testing::Message() << "B=" << c.B << " Hq=" << c.Hq << " Hkv=" << c.Hkv << " D=" << c.D
                                        << " per_kv_head=" << per_kv_head);
      const HalfDecodeRun run = half_decode_run(c, st::Pattern::kRandom, SPARSA_DTYPE_F16, per_kv_head, false, rng);
      expect_the_same_bits_on_any_thread_count(run);
    }
}
