// §2 SINK_WINDOW: attention sinks plus a local window, bottom-right aligned.
#include "test_util.h"

namespace {

using st::Pattern;

SPARSA_BACKEND_SUITE(SinkWindow);

sparsa_policy sink_window_policy(int n_sink, int window) {
  sparsa_policy pol = st::make_policy(SPARSA_POLICY_SINK_WINDOW);
  pol.sink_tokens = n_sink;
  pol.sink_window = window;
  return pol;
}

void check(const st::Context& ctx, ref::Problem& p, int n_sink, int window, st::Rng& rng, Pattern pattern) {
  st::fill(p, pattern, rng);
  const ref::Visibility vis = ref::sink_window(p, n_sink, window);
  const st::RunResult r = st::run_and_compare(ctx, p, sink_window_policy(n_sink, window), ref::attend(p, vis));
  if (r.status == SPARSA_STATUS_SUCCESS) {
    EXPECT_EQ(r.stats[SPARSA_STAT_PAIRS_COMPUTED], ref::count_pairs(vis));
    EXPECT_EQ(r.stats[SPARSA_STAT_PAIRS_DENSE], ref::dense_pairs(p));
  }
}

TEST_P(SinkWindow, CausalKeySeenIffSinkOrWithinWindowBehindTheAlignedRow) {
  int counter = 0;
  for (Pattern pattern : st::all_patterns())
    for (auto [n_sink, window] : {std::pair{4, 16}, {0, 32}, {8, 1}, {16, 0}}) {
      ST_RNG(rng, counter++);
      SCOPED_TRACE(::testing::Message() << st::pattern_name(pattern) << " n_sink=" << n_sink << " window=" << window);
      ref::Problem p = st::make_problem(2, 4, 2, 64, {150}, {150}, true);
      check(ctx(), p, n_sink, window, rng, pattern);
    }
}

TEST_P(SinkWindow, NonCausalWindowIsSymmetricAroundTheAlignedRow) {
  int counter = 0;
  for (Pattern pattern : st::all_patterns()) {
    ST_RNG(rng, counter++);
    SCOPED_TRACE(st::pattern_name(pattern));
    ref::Problem p = st::make_problem(1, 2, 1, 128, {60}, {130}, false);
    check(ctx(), p, 5, 20, rng, pattern);
  }
}

TEST_P(SinkWindow, BottomRightAlignmentWhenSkvExceedsSq) {
  int counter = 0;
  for (Pattern pattern : st::all_patterns()) {
    ST_RNG(rng, counter++);
    SCOPED_TRACE(st::pattern_name(pattern));
    ref::Problem p = st::make_problem(1, 4, 4, 64, {24}, {200}, true);
    check(ctx(), p, 4, 30, rng, pattern);
  }
}

TEST_P(SinkWindow, DecodeRowSeesSinksAndLastWindowKeys) {
  ST_RNG(rng, 0);
  ref::Problem p = st::make_problem(3, 8, 2, 64, {1}, {257}, true);
  check(ctx(), p, 4, 64, rng, Pattern::kSinks);
}

TEST_P(SinkWindow, NoSinkAndZeroWindowSeesNothing) {
  ST_RNG(rng, 0);
  ref::Problem p = st::make_problem(1, 2, 2, 64, {20}, {20}, true);
  st::fill(p, Pattern::kRandom, rng);
  const st::RunResult r = st::run(ctx(), p, sink_window_policy(0, 0));
  st::expect_ok(r);
  ASSERT_EQ(r.status, SPARSA_STATUS_SUCCESS);
  for (int i = 0; i < 20; ++i)
    for (int h = 0; h < 2; ++h) {
      EXPECT_TRUE(st::row_is_zero(r.out, 0, i, h, 2, 64));
      EXPECT_EQ(r.out.lse[0][h * 20 + i], -INFINITY);
    }
  EXPECT_EQ(r.stats[SPARSA_STAT_PAIRS_COMPUTED], 0);
}

TEST_P(SinkWindow, NegativeParametersAreInvalidArguments) {
  ST_RNG(rng, 0);
  ref::Problem p = st::make_problem(1, 1, 1, 64, {8}, {8}, true);
  st::fill(p, Pattern::kRandom, rng);
  for (auto [n_sink, window] : {std::pair{-1, 4}, {4, -1}}) {
    const st::RunResult r = st::run(ctx(), p, sink_window_policy(n_sink, window));
    EXPECT_EQ(r.status, SPARSA_STATUS_INVALID_ARGUMENT) << n_sink << " " << window;
    EXPECT_TRUE(r.untouched);
  }
}


TEST_P(SinkWindow, CausalWithSqExceedingSkvLeavesEarlyRowsEmpty) {
  ST_RNG(rng, 0);
  ref::Problem p = st::make_problem(1, 2, 1, 64, {80}, {50}, true);
  check(ctx(), p, 4, 10, rng, Pattern::kBand);
}


TEST_P(SinkWindow, MoreSinksThanKeys) {
  ST_RNG(rng, 0);
  ref::Problem p = st::make_problem(1, 2, 2, 64, {30}, {30}, true);
  check(ctx(), p, 100, 3, rng, Pattern::kRandom);
}

}  // namespace
