// ALGORITHMS.md §0 and §1 DENSE, §2 SINK_WINDOW: rows that see nothing, tiny and large shapes, layouts, the sink
// and window edges.
// The edges the spec names and the ones it implies, on the CPU backend (the library's oracle). Expected outputs come
// from the float64 reference (tests/reference) through spec_test_util.h.
#include "spec_test_util.h"

namespace {

// ================================================================================================ §0 / §1 DENSE
TEST(SpecDenseSinkWindow, DenseSqGreaterThanSkvRowsSeeingNothingAreZeroWithLseMinusInf) {
  Cpu c;
  ST_RNG(rng, 1);
  // o = Skv − Sq = −3: rows 0..2 see no key.
  ref::Problem p = random_problem(1, 2, 1, 3, {6}, {3}, true, rng);
  const st::RunResult r = st::run(c.ctx, p, st::make_policy(SPARSA_POLICY_DENSE));
  st::expect_ok(r);
  for (int i = 0; i < 3; ++i)
    for (int h = 0; h < 2; ++h) {
      EXPECT_TRUE(st::row_is_zero(r.out, 0, i, h, 2, 3)) << "row " << i;
      EXPECT_EQ(r.out.lse[0][size_t(h) * 6 + i], -kInfD) << "row " << i;
    }
  EXPECT_TRUE(st::outputs_close(r.out, dense_of(p), st::kTolF32));
  EXPECT_TRUE(st::lse_close(r.out, dense_of(p), st::kTolF32));
}

TEST(SpecDenseSinkWindow, DenseTinyShapes) {
  Cpu c;
  ST_RNG(rng, 2);
  for (bool causal : {false, true}) {
    for (auto [sq, skv, d] : std::vector<std::tuple<int, int, int>>{{1, 1, 1}, {1, 7, 3}, {7, 1, 1}, {5, 131, 3}}) {
      SCOPED_TRACE(::testing::Message() << "sq " << sq << " skv " << skv << " D " << d << " causal " << causal);
      ref::Problem p = random_problem(1, 3, 1, d, {sq}, {skv}, causal, rng);
      compare(c.ctx, p, st::make_policy(SPARSA_POLICY_DENSE), dense_of(p));
    }
  }
}

TEST(SpecDenseSinkWindow, DenseD256Gqa8AndExplicitScale) {
  Cpu c;
  ST_RNG(rng, 3);
  ref::Problem p = random_problem(2, 8, 1, 256, {9}, {77}, true, rng);
  compare(c.ctx, p, st::make_policy(SPARSA_POLICY_DENSE), dense_of(p));
  p.scale = 0.37;
  compare(c.ctx, p, st::make_policy(SPARSA_POLICY_DENSE), dense_of(p));
}

TEST(SpecDenseSinkWindow, DenseLayoutsRaggedPackedPagedStridedHalf) {
  Cpu c;
  ST_RNG(rng, 4);
  ref::Problem p = random_problem(3, 8, 2, 16, {5, 1, 17}, {5, 33, 18}, true, rng);
  const ref::Output want = dense_of(p);
  const sparsa_policy pol = st::make_policy(SPARSA_POLICY_DENSE);
  for (int ps : {1, 16}) {
    st::RunOptions opt;
    opt.layout = st::Layout::kPaged;
    opt.q_packed = true;
    opt.page_size = ps;
    SCOPED_TRACE(::testing::Message() << "paged, page size " << ps);
    compare(c.ctx, p, pol, want, opt);
  }
  {
    st::RunOptions opt;
    opt.layout = st::Layout::kVarlen;
    opt.gap = 3;
    SCOPED_TRACE("varlen with gaps");
    compare(c.ctx, p, pol, want, opt);
  }
  for (int32_t dtype : {SPARSA_DTYPE_F16, SPARSA_DTYPE_BF16}) {
    st::RunOptions opt;
    opt.layout = st::Layout::kVarlen;
    opt.dtype = dtype;
    SCOPED_TRACE(::testing::Message() << "dtype " << dtype);
    const ref::Problem pr = st::rounded(p, dtype);
    compare(c.ctx, pr, pol, dense_of(pr), opt);
  }
  // A q that is a slice of a larger tensor, head-major storage.
  ref::Problem same = random_problem(2, 4, 4, 8, {13}, {13}, false, rng);
  st::RunOptions opt;
  opt.head_major = true;
  opt.gap = 5;
  compare(c.ctx, same, pol, dense_of(same), opt);
}

// ================================================================================================ §2 SINK_WINDOW
void check_sink_window(const st::Context& ctx, const ref::Problem& p, int sinks, int window) {
  SCOPED_TRACE(::testing::Message() << "sinks " << sinks << " window " << window << " causal " << p.causal);
  sparsa_policy pol = st::make_policy(SPARSA_POLICY_SINK_WINDOW);
  pol.sink_tokens = sinks;
  pol.sink_window = window;
  compare(ctx, p, pol, ref::attend(p, ref::sink_window(p, sinks, window)));
}

TEST(SpecDenseSinkWindow, SinkWindowEdges) {
  Cpu c;
  ST_RNG(rng, 5);
  for (bool causal : {false, true}) {
    ref::Problem p = random_problem(1, 2, 2, 8, {70}, {200}, causal, rng);  // o = 130
    check_sink_window(c.ctx, p, 0, 0);  // sees nothing (non-causal too)
    check_sink_window(c.ctx, p, 3, 0);
    check_sink_window(c.ctx, p, 0, 1);
    check_sink_window(c.ctx, p, 0, 17);
    check_sink_window(c.ctx, p, 5, 64);
    check_sink_window(c.ctx, p, 300, 0);   // sinks larger than N
    check_sink_window(c.ctx, p, 0, 5000);  // window larger than N
    ref::Problem q = random_problem(1, 1, 1, 4, {150}, {40}, causal, rng);  // o = −110
    check_sink_window(c.ctx, q, 2, 7);
    check_sink_window(c.ctx, q, 0, 200);
  }
}

}  // namespace
