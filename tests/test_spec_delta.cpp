// ALGORITHMS.md §8 DELTA: the cut s_p and the anchors at their edges, over every base policy, ragged varlen.
// The edges the spec names and the ones it implies, on the CPU backend (the library's oracle). Expected outputs come
// from the float64 reference (tests/reference) through spec_test_util.h.
#include "spec_test_util.h"

namespace {

TEST(SpecDelta, DeltaCutEdgesOverSinkWindow) {
  Cpu c;
  ST_RNG(rng, 25);
  const int sinks = 2, window = 5;
  for (auto [sq, gamma, tail] : std::vector<std::tuple<int, int, int>>{
           {10, 4, 16}, {16, 4, 16}, {17, 4, 16}, {20, 4, 16}, {21, 4, 16}, {40, 64, 0}, {37, 4, 3}, {36, 4, 0}, {50, 1, 0}, {50, 7, 8}}) {
    SCOPED_TRACE(::testing::Message() << "sq " << sq << " gamma " << gamma << " tail_min " << tail);
    ref::Problem p = random_problem(1, 2, 1, 8, {sq}, {sq + 3}, true, rng, st::Pattern::kNeedles);
    sparsa_policy pol = st::make_policy(SPARSA_POLICY_SINK_WINDOW);
    pol.sink_tokens = sinks;
    pol.sink_window = window;
    pol.flags = SPARSA_POLICY_FLAG_DELTA;
    pol.delta_gamma = gamma;
    pol.delta_tail_min = tail;
    const ref::Output base = ref::attend(p, ref::sink_window(p, sinks, window));
    st::RunOptions opt;
    opt.lse = false;
    compare(c.ctx, p, pol, ref::delta(p, base, gamma, tail), opt);
  }
}

TEST(SpecDelta, DeltaOverDenseAndBlockSparse) {
  Cpu c;
  ST_RNG(rng, 52);
  ref::Problem p = random_problem(1, 2, 1, 8, {45}, {50}, true, rng);
  sparsa_policy dense = st::make_policy(SPARSA_POLICY_DENSE);
  dense.flags = SPARSA_POLICY_FLAG_DELTA;
  dense.delta_gamma = 6;
  dense.delta_tail_min = 5;
  st::RunOptions opt;
  opt.lse = false;
  compare(c.ctx, p, dense, dense_of(p), opt);  // Δ over dense is dense
  const int bq = 4, bk = 7, nqb = 12, nkb = 8;
  std::vector<uint8_t> mask(size_t(2) * nqb * nkb);
  for (auto& m : mask) m = rng.integer(0, 1);
  sparsa_policy bs = st::make_policy(SPARSA_POLICY_BLOCK_SPARSE);
  bs.block_q = bq;
  bs.block_k = bk;
  bs.flags = SPARSA_POLICY_FLAG_DELTA;
  bs.delta_gamma = 6;
  bs.delta_tail_min = 5;
  opt.block_mask = mask;
  compare(c.ctx, p, bs, ref::delta(p, attend_mask(p, mask, bq, bk), 6, 5), opt);
}

TEST(SpecDelta, DeltaOverTokenSparseDroppedRows) {
  Cpu c;
  ST_RNG(rng, 26);
  ref::Problem p = random_problem(1, 2, 1, 8, {48}, {48}, true, rng, st::Pattern::kNeedles);
  sparsa_policy pol = token_sparse(4, 8, 0.3f);
  ref::TokenSparseParams tp;
  tp.window = 4;
  tp.min_tokens = 8;
  tp.coverage = 0.3;
  const ref::TokenSparseResult base = ref::token_sparse(p, tp);
  if (base.coverage_margin < 1e-9 || base.topk_margin < 1e-9) GTEST_SKIP() << "decision too close to call";
  pol.flags = SPARSA_POLICY_FLAG_DELTA;
  pol.delta_gamma = 8;
  pol.delta_tail_min = 8;
  st::RunOptions opt;
  opt.lse = false;
  compare(c.ctx, p, pol, ref::delta(p, base.out, 8, 8), opt);
}

TEST(SpecDelta, DeltaOverTokenIndicesAndRaggedVarlen) {
  Cpu c;
  ST_RNG(rng, 27);
  ref::Problem p = random_problem(2, 2, 2, 8, {30, 5}, {30, 17}, true, rng);  // sequence 1: s_p <= 0, all dense
  std::vector<int32_t> indices = {0, 5, 9, 3, -1, 12};  // [B = 2, H_idx = 1, k = 3]
  sparsa_policy pol = st::make_policy(SPARSA_POLICY_TOKEN_INDICES);
  pol.flags = SPARSA_POLICY_FLAG_DELTA;
  pol.delta_gamma = 4;
  pol.delta_tail_min = 4;
  const ref::Output base = attend_where(p, [&](int b, int, int i, int j) {
    if (j > i + p.skv[b] - p.sq[b]) return false;
    return std::find(indices.begin() + 3 * b, indices.begin() + 3 * b + 3, j) != indices.begin() + 3 * b + 3;
  });
  st::RunOptions opt;
  opt.lse = false;
  opt.layout = st::Layout::kVarlen;
  opt.indices = indices;
  opt.h_idx = 1;
  opt.k = 3;
  compare(c.ctx, p, pol, ref::delta(p, base, 4, 4), opt);
}


TEST(SpecDelta, DeltaOverTokenSelectChunkAndSparge) {
  Cpu c;
  ST_RNG(rng, 35);
  ref::Problem p = random_problem(1, 4, 2, 8, {40}, {70}, true, rng, st::Pattern::kNeedles);
  {
    sparsa_policy pol = token_select(2, 9, 6);
    const ref::TokenSelectResult base = ref::token_select(p, select_params(pol), nullptr);
    pol.flags = SPARSA_POLICY_FLAG_DELTA;
    pol.delta_gamma = 8;
    pol.delta_tail_min = 4;
    st::RunOptions opt;
    opt.lse = false;
    if (base.topk_margin > 1e-9) compare(c.ctx, p, pol, ref::delta(p, base.out, 8, 4), opt);
  }
  {
    sparsa_policy pol = sparge(8, 8, 1.f, 0.9f);  // theta 1: dense mask; λ skips some blocks
    pol.sparge_lambda = -3.f;
    const ref::Output base = pv_skip(p, 8, 8, -3.0);
    pol.flags = SPARSA_POLICY_FLAG_DELTA;
    pol.delta_gamma = 5;
    pol.delta_tail_min = 6;
    st::RunOptions opt;
    opt.lse = false;
    compare(c.ctx, p, pol, ref::delta(p, base, 5, 6), opt);
  }
}

}  // namespace
