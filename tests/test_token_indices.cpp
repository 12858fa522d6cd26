// §7 TOKEN_INDICES: each query head attends (causally) to the deduplicated union of its index row, optional block
// expansion, n_init and n_local; out-of-range indices are errors in host memory and unused slots in device memory.
#include <cstdint>
#include <limits>
#include <vector>

#include "test_util.h"

namespace {

using st::Pattern;

SPARSA_BACKEND_SUITE(TokenIndices);

sparsa_policy indices_policy(const ref::TokenIndicesParams& tp) {
  sparsa_policy pol = st::make_policy(SPARSA_POLICY_TOKEN_INDICES);
  pol.index_block_size = tp.block_size;
  pol.index_n_init = tp.n_init;
  pol.index_n_local = tp.n_local;
  return pol;
}

// Random ids in [0, n_ids) with some duplicates and some -1 slots.
ref::TokenIndicesParams random_indices(st::Rng& rng, const ref::Problem& p, int h_idx, int k, int block_size) {
  ref::TokenIndicesParams tp;
  tp.h_idx = h_idx;
  tp.k = k;
  tp.block_size = block_size;
  tp.indices.resize(size_t(p.B) * h_idx * k);
  for (int b = 0; b < p.B; ++b) {
    const int n_ids = (p.skv[b] + block_size - 1) / block_size;
    for (int r = 0; r < h_idx; ++r)
      for (int s = 0; s < k; ++s) {
        const double u = rng.uniform(0, 1);
        int32_t& id = tp.indices[(size_t(b) * h_idx + r) * k + s];
        id = u < 0.15 ? -1 : rng.integer(0, n_ids - 1);
        if (u > 0.9 && s > 0) id = tp.indices[(size_t(b) * h_idx + r) * k + s - 1];  // duplicate
      }
  }
  return tp;
}

st::RunResult check(const st::Context& ctx, const ref::Problem& p, const ref::TokenIndicesParams& tp,
                    st::RunOptions opt = {}) {
  const ref::TokenIndicesResult want = ref::token_indices(p, tp);
  opt.indices = tp.indices;
  opt.h_idx = tp.h_idx;
  opt.k = tp.k;
  opt.head_map = tp.head_map;
  opt.selected_sets = p.Hq;
  opt.selected_cap = p.max_skv();
  st::RunResult r = st::run_and_compare(ctx, p, indices_policy(tp), want.out, opt);
  if (r.status != SPARSA_STATUS_SUCCESS) return r;
  EXPECT_TRUE(st::sets_equal(r.selected, opt.selected_cap, want.selected));
  EXPECT_EQ(r.stats[SPARSA_STAT_PAIRS_COMPUTED], want.pairs_computed);
  return r;
}

TEST_P(TokenIndices, AttendsToTheDeduplicatedUnionCausally) {
  int counter = 0;
  for (int sq : {1, 24})
    for (Pattern pattern : st::all_patterns()) {
      ST_RNG(rng, counter++);
      SCOPED_TRACE(::testing::Message() << "sq=" << sq << " " << st::pattern_name(pattern));
      ref::Problem p = st::make_problem(2, 8, 2, 64, {sq}, {180}, true);
      st::fill(p, pattern, rng);
      check(ctx(), p, random_indices(rng, p, 2, 40, 1));
    }
}

TEST_P(TokenIndices, MinusOneSlotsAreIgnored) {
  ST_RNG(rng, 0);
  ref::Problem p = st::make_problem(1, 2, 1, 64, {1}, {100}, true);
  st::fill(p, Pattern::kRandom, rng);
  ref::TokenIndicesParams tp;
  tp.h_idx = 1;
  tp.k = 6;
  tp.indices = {-1, 7, -1, 3, 99, -1};
  check(ctx(), p, tp);
  tp.indices.assign(6, -1);  // nothing selected: zero rows, LSE -inf
  const st::RunResult r = check(ctx(), p, tp);
  if (r.status == SPARSA_STATUS_SUCCESS) {
    EXPECT_TRUE(st::row_is_zero(r.out, 0, 0, 0, 2, 64));
    EXPECT_EQ(r.out.lse[0][0], -INFINITY);
  }
}

TEST_P(TokenIndices, BlockIdsCoverWholeBlocksIncludingTheTailBlock) {
  int counter = 0;
  for (int bs : {16, 64}) {
    ST_RNG(rng, counter++);
    SCOPED_TRACE(::testing::Message() << "block_size=" << bs);
    ref::Problem p = st::make_problem(2, 4, 2, 64, {8}, {200}, true);  // 200 = 12·16 + 8 = 3·64 + 8
    st::fill(p, Pattern::kBand, rng);
    ref::TokenIndicesParams tp = random_indices(rng, p, 2, 5, bs);
    tp.indices[4] = (200 + bs - 1) / bs - 1;  // the tail block
    check(ctx(), p, tp);
  }
}

TEST_P(TokenIndices, DefaultHeadMapIsContiguousGroupsAndHeadMapOverridesIt) {
  int counter = 0;
  for (bool explicit_map : {false, true}) {
    ST_RNG(rng, counter++);
    ref::Problem p = st::make_problem(1, 8, 2, 64, {4}, {160}, true);
    st::fill(p, Pattern::kNeedles, rng);
    ref::TokenIndicesParams tp = random_indices(rng, p, 4, 20, 1);
    if (explicit_map) tp.head_map = {3, 0, 0, 2, 1, 3, 2, 1};
    check(ctx(), p, tp);
  }
}

TEST_P(TokenIndices, NInitAndNLocalAreAlwaysIncluded) {
  ST_RNG(rng, 0);
  ref::Problem p = st::make_problem(1, 4, 4, 64, {12}, {150}, true);
  st::fill(p, Pattern::kSinks, rng);
  ref::TokenIndicesParams tp = random_indices(rng, p, 1, 10, 1);
  tp.n_init = 4;
  tp.n_local = 20;
  check(ctx(), p, tp);
}

TEST_P(TokenIndices, AllTokensEqualsDense) {
  ST_RNG(rng, 0);
  ref::Problem p = st::make_problem(1, 4, 2, 64, {30}, {90}, true);
  st::fill(p, Pattern::kNeedles, rng);
  ref::TokenIndicesParams tp;
  tp.h_idx = 1;
  tp.k = 90;
  for (int t = 89; t >= 0; --t) tp.indices.push_back(t);  // unsorted on purpose
  const st::RunResult r = check(ctx(), p, tp);
  if (r.status == SPARSA_STATUS_SUCCESS) {
    EXPECT_TRUE(st::outputs_close(r.out, ref::attend(p, ref::dense(p)), st::kTolF32));
  }
}

TEST_P(TokenIndices, IndexOutsideItsRangeIsAnErrorNotACrash) {
  // The CPU backend must refuse them. GPU backends do not check index contents in device memory (listed in
  // tests/expected_skips.cpp with the reason).
  ST_RNG(rng, 0);
  ref::Problem p = st::make_problem(1, 2, 1, 64, {1}, {100}, true);
  st::fill(p, Pattern::kRandom, rng);
  for (auto [bs, bad] : {std::pair{1, 100}, {1, -2}, {1, 1 << 30}, {16, 7}, {16, -5}}) {
    SCOPED_TRACE(::testing::Message() << "block_size=" << bs << " id=" << bad);
    ref::TokenIndicesParams tp;
    tp.h_idx = 1;
    tp.k = 3;
    tp.block_size = bs;
    tp.indices = {0, bad, 1};
    st::RunOptions opt;
    opt.indices = tp.indices;
    opt.h_idx = 1;
    opt.k = 3;
    const st::RunResult r = st::run(ctx(), p, indices_policy(tp), opt);
    EXPECT_EQ(r.status, SPARSA_STATUS_INDEX_OUT_OF_RANGE) << r.message;
    EXPECT_TRUE(r.untouched);
  }
  // head_map entry outside [0, H_idx).
  ref::TokenIndicesParams tp;
  st::RunOptions opt;
  opt.indices = {0, 1, 2};
  opt.h_idx = 1;
  opt.k = 3;
  opt.head_map = {0, 1};
  const st::RunResult r = st::run(ctx(), p, indices_policy(tp), opt);
  EXPECT_EQ(r.status, SPARSA_STATUS_INDEX_OUT_OF_RANGE) << r.message;
  EXPECT_TRUE(r.untouched);
}

// The header's promise for index tensors in device memory (sparsa.h, TOKEN_INDICES `indices`): their contents are
// not read by the host (that would need a synchronisation inside the run), so an id outside its range is ignored like
// a -1 slot: no error, no out-of-bounds read (bench/gpu/run_device.sh runs the suite under compute-sanitizer
// memcheck). Bad ids planted in every seventh slot (past N, far past it, below -1) must give bit for bit the run with
// those slots -1. Host memory refuses such ids instead (IndexOutsideItsRangeIsAnErrorNotACrash), so the CPU instance
// is listed as not run in tests/expected_skips.cpp.
TEST_P(TokenIndices, IdsOutsideTheirRangeInDeviceMemoryActAsUnusedSlots) {
  ST_RNG(rng, 0);
  const int Hq = 4, Skv = 3000, k = 96;
  ref::Problem p = st::make_problem(1, Hq, 2, 128, {1}, {Skv}, true);
  st::fill(p, Pattern::kRandom, rng);
  p = st::rounded(p, SPARSA_DTYPE_BF16);
  ref::TokenIndicesParams clean;
  clean.h_idx = Hq;
  clean.k = k;
  for (int e = 0; e < Hq * k; ++e) clean.indices.push_back(rng.integer(0, Skv - 1));
  std::vector<int32_t> planted(clean.indices.begin(), clean.indices.end());
  const int32_t bad[] = {Skv, Skv + 5, 1 << 30, -7, std::numeric_limits<int32_t>::min()};
  for (size_t e = 0; e < planted.size(); e += 7) {
    planted[e] = bad[(e / 7) % (sizeof bad / sizeof bad[0])];
    clean.indices[e] = -1;
  }
  st::RunOptions opt;
  opt.dtype = SPARSA_DTYPE_BF16;
  const st::RunResult want = check(ctx(), p, clean, opt);  // the -1 run, against the reference
  ASSERT_EQ(want.status, SPARSA_STATUS_SUCCESS) << want.message;
  opt.indices = planted;
  opt.h_idx = Hq;
  opt.k = k;
  opt.selected_sets = Hq;
  opt.selected_cap = Skv;
  const st::RunResult got = st::run(ctx(), p, indices_policy(clean), opt);
  st::expect_ok(got);
  ASSERT_EQ(got.status, SPARSA_STATUS_SUCCESS) << got.message;
  EXPECT_EQ(got.out.o, want.out.o) << "out-of-range device ids must act as -1 slots";
  EXPECT_EQ(got.out.lse, want.out.lse);
  EXPECT_EQ(got.selected, want.selected);
  EXPECT_EQ(got.stats, want.stats);
}

TEST_P(TokenIndices, MissingIndicesIsANullPointer) {
  ST_RNG(rng, 0);
  ref::Problem p = st::make_problem(1, 2, 1, 64, {1}, {50}, true);
  st::fill(p, Pattern::kRandom, rng);
  const st::RunResult r = st::run(ctx(), p, indices_policy(ref::TokenIndicesParams{}));
  EXPECT_EQ(r.status, SPARSA_STATUS_NULL_POINTER) << r.message;
  EXPECT_TRUE(r.untouched);
}

}  // namespace

TEST_P(TokenIndices, HalfPrecisionDecodeOverLongIndexListsMatchesTheReference) {
  // One query row per sequence on fp16/bf16 caches with index lists longer than one decode slice (rows merged by
  // LSE): one row of indices per kv group, one row for every head, a head map that splits a group (each head its own
  // list), token and block ids, padded and paged caches, and a plan that sizes the scratch up front.
  struct Case {
    int h_idx, k, block_size;
    std::vector<int> head_map;
  };
  const Case cases[] = {{2, 2600, 1, {}}, {1, 2400, 1, {}}, {2, 500, 4, {}}, {2, 1200, 1, {0, 1, 0, 1, 1, 0, 1, 0}}};
  int counter = 0;
  for (const Case& c : cases)
    for (int32_t dtype : {SPARSA_DTYPE_F16, SPARSA_DTYPE_BF16})
      for (st::Layout layout : {st::Layout::kPadded, st::Layout::kPaged}) {
        ST_RNG(rng, counter++);
        SCOPED_TRACE(::testing::Message() << "h_idx=" << c.h_idx << " k=" << c.k << " block_size=" << c.block_size
                                          << " head_map=" << !c.head_map.empty() << " dtype=" << dtype
                                          << " layout=" << int(layout));
        ref::Problem p = st::make_problem(2, 8, 2, 128, {1}, {2600, 1700}, true);
        st::fill(p, Pattern::kNeedles, rng);
        p = st::rounded(p, dtype);
        ref::TokenIndicesParams tp = random_indices(rng, p, c.h_idx, c.k, c.block_size);
        tp.head_map = c.head_map;
        tp.n_init = 3;
        tp.n_local = 20;
        st::RunOptions opt;
        opt.dtype = dtype;
        opt.layout = layout;
        opt.plan_first = true;
        const st::RunResult r = check(ctx(), p, tp, opt);
        EXPECT_EQ(r.scratch_after_plan, r.scratch_after_run) << "the run after sparsa_attention_plan grew scratch";
      }
}
