// §3 BLOCK_SPARSE: the caller's [B, Hq, ceil(Sq/bq), ceil(Skv/bk)] mask, element-wise causal inside blocks.
#include "test_util.h"

namespace {

using st::Pattern;

SPARSA_BACKEND_SUITE(BlockSparse);

std::vector<uint8_t> random_mask(st::Rng& rng, const ref::Problem& p, int bq, int bk, double density) {
  const int nqb = (p.max_sq() + bq - 1) / bq, nkb = (p.max_skv() + bk - 1) / bk;
  std::vector<uint8_t> mask(size_t(p.B) * p.Hq * nqb * nkb);
  for (auto& m : mask) m = rng.uniform(0, 1) < density ? 1 : 0;
  return mask;
}

sparsa_policy block_policy(int bq, int bk) {
  sparsa_policy pol = st::make_policy(SPARSA_POLICY_BLOCK_SPARSE);
  pol.block_q = bq;
  pol.block_k = bk;
  return pol;
}

void check(const st::Context& ctx, const ref::Problem& p, int bq, int bk, const std::vector<uint8_t>& mask) {
  st::RunOptions opt;
  opt.block_mask = mask;
  const ref::Visibility vis = ref::block_sparse(p, bq, bk, mask);
  const st::RunResult r = st::run_and_compare(ctx, p, block_policy(bq, bk), ref::attend(p, vis), opt);
  if (r.status != SPARSA_STATUS_SUCCESS) return;
  const ref::BlockCounts blocks = ref::block_counts(p, bq, bk, mask);
  EXPECT_EQ(r.stats[SPARSA_STAT_BLOCKS_COMPUTED], blocks.computed);
  EXPECT_EQ(r.stats[SPARSA_STAT_BLOCKS_TOTAL], blocks.total);
  EXPECT_EQ(r.stats[SPARSA_STAT_PAIRS_DENSE], ref::dense_pairs(p));
  // Pairs computed: at least every visible pair, at most every pair of the computed tiles.
  EXPECT_GE(r.stats[SPARSA_STAT_PAIRS_COMPUTED], ref::count_pairs(vis));
  EXPECT_LE(r.stats[SPARSA_STAT_PAIRS_COMPUTED], blocks.computed * bq * bk);
}

TEST_P(BlockSparse, KeyVisibleIffMaskBitAndCausalAllowed) {
  int counter = 0;
  for (bool causal : {false, true})
    for (Pattern pattern : st::all_patterns()) {
      ST_RNG(rng, counter++);
      SCOPED_TRACE(::testing::Message() << "causal=" << causal << " " << st::pattern_name(pattern));
      // Tail blocks on both axes, GQA, Sq != Skv.
      ref::Problem p = st::make_problem(2, 4, 2, 64, {200}, {230}, causal);
      st::fill(p, pattern, rng);
      check(ctx(), p, 32, 16, random_mask(rng, p, 32, 16, 0.5));
    }
}

TEST_P(BlockSparse, ElementwiseCausalMaskInsideDiagonalBlocks) {
  int counter = 0;
  for (auto [bq, bk] : {std::pair{64, 64}, {32, 64}, {64, 16}, {1, 1}}) {
    ST_RNG(rng, counter++);
    SCOPED_TRACE(::testing::Message() << "bq=" << bq << " bk=" << bk);
    ref::Problem p = st::make_problem(1, 2, 1, 64, {130}, {130}, true);
    st::fill(p, Pattern::kBand, rng);
    check(ctx(), p, bq, bk, random_mask(rng, p, bq, bk, 1.0));
  }
}

TEST_P(BlockSparse, EmptyMaskRowGivesZeroAndLseMinusInf) {
  ST_RNG(rng, 0);
  ref::Problem p = st::make_problem(1, 2, 2, 64, {64}, {64}, false);
  st::fill(p, Pattern::kRandom, rng);
  std::vector<uint8_t> mask = {1, 1, 0, 0,   // head 0, query block 0: keys 0..31
                               0, 0, 0, 0,   // head 0, query block 1: nothing
                               0, 0, 0, 1,   // head 1, query block 0
                               0, 0, 0, 0};  // head 1, query block 1: nothing
  st::RunOptions opt;
  opt.block_mask = mask;
  const st::RunResult r = st::run_and_compare(ctx(), p, block_policy(32, 16), ref::attend(p, ref::block_sparse(p, 32, 16, mask)), opt);
  ASSERT_EQ(r.status, SPARSA_STATUS_SUCCESS);
  for (int h = 0; h < 2; ++h)
    for (int i = 32; i < 64; ++i) {
      EXPECT_TRUE(st::row_is_zero(r.out, 0, i, h, 2, 64));
      EXPECT_EQ(r.out.lse[0][h * 64 + i], -INFINITY);
    }
}

TEST_P(BlockSparse, AllOnesMaskEqualsDense) {
  int counter = 0;
  for (bool causal : {false, true}) {
    ST_RNG(rng, counter++);
    ref::Problem p = st::make_problem(2, 2, 2, 128, {100}, {120}, causal);
    st::fill(p, Pattern::kNeedles, rng);
    st::RunOptions opt;
    opt.block_mask = random_mask(rng, p, 64, 32, 1.0);
    st::run_and_compare(ctx(), p, block_policy(64, 32), ref::attend(p, ref::dense(p)), opt);
  }
}

TEST_P(BlockSparse, MaskIsRequiredAndMustHaveTheBlockGridShape) {
  ST_RNG(rng, 0);
  ref::Problem p = st::make_problem(1, 2, 2, 64, {64}, {64}, false);
  st::fill(p, Pattern::kRandom, rng);
  const st::RunResult missing = st::run(ctx(), p, block_policy(32, 16));
  EXPECT_EQ(missing.status, SPARSA_STATUS_NULL_POINTER) << missing.message;
  EXPECT_TRUE(missing.untouched);
  // A mask built for block_q = 16 (4 query blocks) passed with block_q = 32 (2 expected).
  sparsa_policy wrong = block_policy(16, 16);
  std::vector<uint8_t> data(2 * 4 * 4, 1);
  sparsa_tensor mask = st::host_tensor(data.data(), SPARSA_DTYPE_U8, {1, 2, 4, 4});
  wrong.block_q = 32;
  wrong.block_mask = &mask;
  std::vector<float> q(64 * 2 * 64, 0.1f), out(q.size(), NAN);
  sparsa_tensor tq = st::host_tensor(q.data(), SPARSA_DTYPE_F32, {1, 64, 2, 64});
  sparsa_tensor to = st::host_tensor(out.data(), SPARSA_DTYPE_F32, {1, 64, 2, 64});
  sparsa_attention_args args;
  sparsa_attention_args_init(&args, sizeof args);
  args.q = &tq;
  args.k = &tq;
  args.v = &tq;
  args.out = &to;
  EXPECT_EQ(sparsa_attention_run(ctx().get(), &args, &wrong), SPARSA_STATUS_SHAPE_MISMATCH) << sparsa_last_error_message();
  for (float x : out) ASSERT_TRUE(std::isnan(x));
}

TEST_P(BlockSparse, SparsityStatsCountComputedTiles) {
  ST_RNG(rng, 0);
  ref::Problem p = st::make_problem(2, 4, 1, 64, {256}, {256}, true);
  st::fill(p, Pattern::kSinks, rng);
  check(ctx(), p, 64, 64, random_mask(rng, p, 64, 64, 0.3));
}


TEST_P(BlockSparse, BlocksLargerThanTheSequence) {
  ST_RNG(rng, 0);
  ref::Problem p = st::make_problem(1, 2, 1, 64, {20}, {45}, true);
  st::fill(p, Pattern::kBand, rng);
  check(ctx(), p, 64, 128, {1, 1});
}

}  // namespace
