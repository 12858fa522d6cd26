// §8 DELTA: rows >= s_p dense; rows < s_p corrected by their anchor row's (dense - sparse) difference. Parameters
// scaled down: gamma 16, tail_min 32.
#include "test_util.h"

namespace {

using st::Pattern;

SPARSA_BACKEND_SUITE(Delta);

constexpr int kGamma = 16;
constexpr int kTailMin = 32;

sparsa_policy with_delta(sparsa_policy pol, int gamma = kGamma, int tail_min = kTailMin) {
  pol.flags |= SPARSA_POLICY_FLAG_DELTA;
  pol.delta_gamma = gamma;
  pol.delta_tail_min = tail_min;
  return pol;
}

sparsa_policy sink_window(int n_sink, int window) {
  sparsa_policy pol = st::make_policy(SPARSA_POLICY_SINK_WINDOW);
  pol.sink_tokens = n_sink;
  pol.sink_window = window;
  return pol;
}

st::RunOptions no_lse(st::RunOptions opt = {}) {
  opt.lse = false;
  return opt;
}

TEST_P(Delta, SinkWindowBaseCorrectedByAnchorDifferences) {
  int counter = 0;
  for (Pattern pattern : st::all_patterns()) {
    ST_RNG(rng, counter++);
    SCOPED_TRACE(st::pattern_name(pattern));
    ref::Problem p = st::make_problem(2, 4, 2, 64, {200}, {200}, true);
    st::fill(p, pattern, rng);
    const ref::Output sparse = ref::attend(p, ref::sink_window(p, 4, 24));
    st::run_and_compare(ctx(), p, with_delta(sink_window(4, 24)), ref::delta(p, sparse, kGamma, kTailMin), no_lse());
  }
}

TEST_P(Delta, CutIsSqModGammaPlusMaxOfTailMinAndGammaAndRowsFromSpOnAreDense) {
  int counter = 0;
  for (auto [sq, gamma, tail_min] : {std::tuple{200, 16, 32}, {203, 16, 8}, {150, 64, 128}, {97, 10, 0}}) {
    ST_RNG(rng, counter++);
    SCOPED_TRACE(::testing::Message() << "sq=" << sq << " gamma=" << gamma << " tail_min=" << tail_min);
    ref::Problem p = st::make_problem(1, 2, 1, 64, {sq}, {sq}, true);
    st::fill(p, Pattern::kNeedles, rng);
    const ref::Output sparse = ref::attend(p, ref::sink_window(p, 2, 10));
    const ref::Output dense = ref::attend(p, ref::dense(p));
    const int s_p = ref::delta_sparse_rows(sq, gamma, tail_min);
    EXPECT_EQ(s_p, sq - (sq % gamma + std::max(tail_min, gamma))) << "oracle";
    const st::RunResult r =
        st::run_and_compare(ctx(), p, with_delta(sink_window(2, 10), gamma, tail_min), ref::delta(p, sparse, gamma, tail_min), no_lse());
    if (r.status != SPARSA_STATUS_SUCCESS) continue;
    // Rows >= s_p and anchor rows (multiples of gamma) equal dense rows.
    ref::Output got_rows = dense, want_rows = dense;
    for (int i = 0; i < sq; ++i) {
      const bool dense_row = i >= s_p || i % gamma == 0;
      for (int x = 0; x < 2 * 64; ++x) {
        got_rows.o[0][i * 128 + x] = dense_row ? r.out.o[0][i * 128 + x] : 0;
        want_rows.o[0][i * 128 + x] = dense_row ? dense.o[0][i * 128 + x] : 0;
      }
    }
    EXPECT_TRUE(st::outputs_close(got_rows, want_rows, st::kTolF32));
  }
}

TEST_P(Delta, ShortSequenceIsAllDense) {
  ST_RNG(rng, 0);
  ref::Problem p = st::make_problem(1, 2, 2, 64, {40}, {40}, true);  // cut = 8 + 32 = 40: s_p = 0
  st::fill(p, Pattern::kBand, rng);
  st::run_and_compare(ctx(), p, with_delta(sink_window(1, 4)), ref::attend(p, ref::dense(p)), no_lse());
}

TEST_P(Delta, BottomRightAlignmentWhenSkvExceedsSq) {
  ST_RNG(rng, 0);
  ref::Problem p = st::make_problem(1, 4, 1, 64, {120}, {180}, true);
  st::fill(p, Pattern::kSinks, rng);
  const ref::Output sparse = ref::attend(p, ref::sink_window(p, 4, 16));
  st::run_and_compare(ctx(), p, with_delta(sink_window(4, 16)), ref::delta(p, sparse, kGamma, kTailMin), no_lse());
}

TEST_P(Delta, BlockSparseBase) {
  ST_RNG(rng, 0);
  ref::Problem p = st::make_problem(1, 2, 2, 64, {192}, {192}, true);
  st::fill(p, Pattern::kRandom, rng);
  st::RunOptions opt = no_lse();
  opt.block_mask.resize(2 * 6 * 6);
  for (auto& m : opt.block_mask) m = rng.uniform(0, 1) < 0.4;
  sparsa_policy pol = st::make_policy(SPARSA_POLICY_BLOCK_SPARSE);
  pol.block_q = 32;
  pol.block_k = 32;
  const ref::Output sparse = ref::attend(p, ref::block_sparse(p, 32, 32, opt.block_mask));
  st::run_and_compare(ctx(), p, with_delta(pol), ref::delta(p, sparse, kGamma, kTailMin), opt);
}

TEST_P(Delta, VarlenSequencesEachGetTheirOwnCut) {
  ST_RNG(rng, 0);
  ref::Problem p = st::make_problem(3, 2, 1, 64, {150, 30, 97}, {150, 30, 97}, true);
  st::fill(p, Pattern::kNeedles, rng);
  const ref::Output sparse = ref::attend(p, ref::sink_window(p, 2, 12));
  st::RunOptions opt = no_lse();
  opt.layout = st::Layout::kVarlen;
  st::run_and_compare(ctx(), p, with_delta(sink_window(2, 12)), ref::delta(p, sparse, kGamma, kTailMin), opt);
}

TEST_P(Delta, AskingForLseIsAnArgumentError) {
  ST_RNG(rng, 0);
  ref::Problem p = st::make_problem(1, 2, 1, 64, {100}, {100}, true);
  st::fill(p, Pattern::kRandom, rng);
  const st::RunResult r = st::run(ctx(), p, with_delta(sink_window(4, 16)));  // lse requested by default
  EXPECT_EQ(r.status, SPARSA_STATUS_INVALID_ARGUMENT) << r.message;
  EXPECT_TRUE(r.untouched);
}

TEST_P(Delta, RequiresCausal) {
  ST_RNG(rng, 0);
  ref::Problem p = st::make_problem(1, 2, 1, 64, {100}, {100}, false);
  st::fill(p, Pattern::kRandom, rng);
  const st::RunResult r = st::run(ctx(), p, with_delta(sink_window(4, 16)), no_lse());
  EXPECT_EQ(r.status, SPARSA_STATUS_INVALID_ARGUMENT) << r.message;
  EXPECT_TRUE(r.untouched);
}

TEST_P(Delta, NonPositiveGammaIsInvalid) {
  ST_RNG(rng, 0);
  ref::Problem p = st::make_problem(1, 2, 1, 64, {100}, {100}, true);
  st::fill(p, Pattern::kRandom, rng);
  const st::RunResult r = st::run(ctx(), p, with_delta(sink_window(4, 16), 0, 32), no_lse());
  EXPECT_EQ(r.status, SPARSA_STATUS_INVALID_ARGUMENT) << r.message;
  EXPECT_TRUE(r.untouched);
}

}  // namespace
