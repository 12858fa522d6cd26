// Layouts and shapes: varlen packed, paged KV (page sizes 1, 16 and odd, ragged batches), seq_lens_k, strided
// non-contiguous views, GQA ratios 1/4/8 and MQA, head dims 64/128/256, fp16/bf16. Every layout must give the
// per-sequence reference result.
#include "test_util.h"

namespace {

using st::Layout;
using st::Pattern;

SPARSA_BACKEND_SUITE(Layouts);

// A policy plus the reference output it must produce on `p`.
struct Case {
  std::string name;
  sparsa_policy policy;
  st::RunOptions opt;
  ref::Output want;
  std::vector<std::vector<ref::IndexSet>> selected;  // checked when non-empty
};

std::vector<Case> cases_for(const ref::Problem& p, bool decode_only_policies) {
  std::vector<Case> cases;
  cases.push_back({"DENSE", st::make_policy(SPARSA_POLICY_DENSE), {}, ref::attend(p, ref::dense(p)), {}});
  Case sink{"SINK_WINDOW", st::make_policy(SPARSA_POLICY_SINK_WINDOW), {}, {}, {}};
  sink.policy.sink_tokens = 3;
  sink.policy.sink_window = 17;
  sink.want = ref::attend(p, ref::sink_window(p, 3, 17));
  cases.push_back(sink);
  // TOKEN_INDICES: a few ids per sequence, valid for its own length.
  Case indices{"TOKEN_INDICES", st::make_policy(SPARSA_POLICY_TOKEN_INDICES), {}, {}, {}};
  ref::TokenIndicesParams tp;
  tp.h_idx = 1;
  tp.k = 6;
  for (int b = 0; b < p.B; ++b)
    for (int s = 0; s < tp.k; ++s) tp.indices.push_back(s < p.skv[b] ? (s * 7 + b) % p.skv[b] : -1);
  indices.policy.index_n_local = 2;
  tp.n_local = 2;
  const ref::TokenIndicesResult ti = ref::token_indices(p, tp);
  indices.opt.indices = tp.indices;
  indices.opt.h_idx = 1;
  indices.opt.k = tp.k;
  indices.opt.selected_sets = p.Hq;
  indices.opt.selected_cap = p.max_skv();
  indices.want = ti.out;
  indices.selected = ti.selected;
  cases.push_back(indices);
  if (p.causal && decode_only_policies) {
    Case select{"TOKEN_SELECT", st::make_policy(SPARSA_POLICY_TOKEN_SELECT), {}, {}, {}};
    ref::TokenSelectParams sp;
    sp.n_init = 2;
    sp.top_k = 8;
    sp.n_local = 4;
    select.policy.select_n_init = 2;
    select.policy.select_top_k = 8;
    select.policy.select_n_local = 4;
    const ref::TokenSelectResult ts = ref::token_select(p, sp, nullptr);
    select.want = ts.out;
    select.selected = ts.selected;
    select.opt.selected_sets = 1;
    select.opt.selected_cap = p.max_skv();
    cases.push_back(select);
  }
  return cases;
}

void run_cases(const st::Context& ctx, const ref::Problem& p, const st::RunOptions& layout, bool decode_policies = true) {
  for (Case& c : cases_for(p, decode_policies)) {
    SCOPED_TRACE(c.name);
    st::RunOptions opt = c.opt;
    opt.layout = layout.layout;
    opt.q_packed = layout.q_packed;
    opt.page_size = layout.page_size;
    opt.seq_lens_k = layout.seq_lens_k;
    opt.gap = layout.gap;
    opt.head_major = layout.head_major;
    opt.dtype = layout.dtype;
    const ref::Output want = c.want;
    const st::RunResult r = st::run_and_compare(ctx, p, c.policy, want, opt);
    if (r.status == SPARSA_STATUS_SUCCESS && !c.selected.empty()) {
      EXPECT_TRUE(st::sets_equal(r.selected, opt.selected_cap, c.selected));
    }
  }
}

TEST_P(Layouts, VarlenPackedEqualsPerSequenceResults) {
  int counter = 0;
  for (bool causal : {false, true}) {
    ST_RNG(rng, counter++);
    SCOPED_TRACE(::testing::Message() << "causal=" << causal);
    // Sequence 1 has more queries than keys (negative causal offset: its first rows see nothing).
    ref::Problem p = st::make_problem(3, 4, 2, 64, {50, 30, 80}, {60, 17, 120}, causal);
    st::fill(p, Pattern::kNeedles, rng);
    st::RunOptions opt;
    opt.layout = Layout::kVarlen;
    run_cases(ctx(), p, opt, /*decode_policies=*/false);
  }
}

TEST_P(Layouts, EmptySequenceInAVarlenBatch) {
  ST_RNG(rng, 0);
  ref::Problem p = st::make_problem(3, 2, 1, 64, {20, 0, 9}, {20, 0, 30}, true);
  st::fill(p, Pattern::kRandom, rng);
  st::RunOptions opt;
  opt.layout = Layout::kVarlen;
  run_cases(ctx(), p, opt, false);
}

TEST_P(Layouts, PagedKvWithPageSizes1And16AndOddEqualsContiguous) {
  int counter = 0;
  for (int page_size : {1, 16, 7})
    for (int sq : {1, 6}) {
      ST_RNG(rng, counter++);
      SCOPED_TRACE(::testing::Message() << "page_size=" << page_size << " sq=" << sq);
      ref::Problem p = st::make_problem(3, 4, 2, 64, {sq}, {100, 37, 64}, true);  // ragged batch
      st::fill(p, Pattern::kSinks, rng);
      st::RunOptions opt;
      opt.layout = Layout::kPaged;
      opt.page_size = page_size;
      opt.page_shuffle_seed = rng.seed;
      run_cases(ctx(), p, opt);
    }
}

TEST_P(Layouts, PagedKvWithPackedRaggedQueries) {
  ST_RNG(rng, 0);
  ref::Problem p = st::make_problem(2, 4, 1, 64, {5, 1}, {90, 41}, true);
  st::fill(p, Pattern::kNeedles, rng);
  st::RunOptions opt;
  opt.layout = Layout::kPaged;
  opt.q_packed = true;
  opt.page_size = 16;
  run_cases(ctx(), p, opt);
}

TEST_P(Layouts, SeqLensKShortensPaddedSequences) {
  ST_RNG(rng, 0);
  ref::Problem p = st::make_problem(3, 4, 4, 64, {1}, {120, 33, 1}, true);
  st::fill(p, Pattern::kBand, rng);
  st::RunOptions opt;
  opt.seq_lens_k = true;
  run_cases(ctx(), p, opt);
}

TEST_P(Layouts, NonContiguousStridesAreRespected) {
  int counter = 0;
  for (Layout layout : {Layout::kPadded, Layout::kVarlen, Layout::kPaged}) {
    ST_RNG(rng, counter++);
    SCOPED_TRACE(::testing::Message() << "layout=" << int(layout));
    const bool padded_q = layout != Layout::kVarlen;
    ref::Problem p = st::make_problem(2, 4, 2, 64, {padded_q ? 8 : 13, 8}, {70, 45}, true);
    st::fill(p, Pattern::kRandom, rng);
    st::RunOptions opt;
    opt.layout = layout;
    opt.gap = 3;  // stride gaps hold NaN; out's gaps must stay untouched
    run_cases(ctx(), p, opt, layout != Layout::kVarlen);
  }
}

TEST_P(Layouts, GqaRatios1And4And8AndMqa) {
  int counter = 0;
  for (auto [hq, hkv] : {std::pair{4, 4}, {8, 2}, {8, 1}, {16, 2}}) {
    ST_RNG(rng, counter++);
    SCOPED_TRACE(::testing::Message() << "Hq=" << hq << " Hkv=" << hkv);
    ref::Problem p = st::make_problem(1, hq, hkv, 64, {12}, {90}, true);
    st::fill(p, Pattern::kNeedles, rng);
    run_cases(ctx(), p, st::RunOptions{});
  }
}

TEST_P(Layouts, HeadDims64And128And256) {
  int counter = 0;
  for (int D : {64, 128, 256}) {
    ST_RNG(rng, counter++);
    SCOPED_TRACE(::testing::Message() << "D=" << D);
    ref::Problem p = st::make_problem(2, 4, 2, D, {9}, {77}, true);
    st::fill(p, Pattern::kSinks, rng);
    run_cases(ctx(), p, st::RunOptions{});
  }
}

TEST_P(Layouts, Fp16AndBf16MatchTheReferenceOnRoundedInputs) {
  int counter = 0;
  for (int32_t dtype : {SPARSA_DTYPE_F16, SPARSA_DTYPE_BF16})
    for (Layout layout : {Layout::kPadded, Layout::kPaged}) {
      ST_RNG(rng, counter++);
      SCOPED_TRACE(::testing::Message() << "dtype=" << dtype << " layout=" << int(layout));
      ref::Problem p = st::make_problem(2, 4, 2, 128, {6}, {110, 70}, true);
      st::fill(p, Pattern::kNeedles, rng);
      p = st::rounded(p, dtype);
      st::RunOptions opt;
      opt.layout = layout;
      opt.dtype = dtype;
      run_cases(ctx(), p, opt);
    }
}

TEST_P(Layouts, Fp16BlockSparseAndSpargeMatchTheRoundedReference) {
  ST_RNG(rng, 0);
  ref::Problem p = st::make_problem(1, 2, 1, 64, {130}, {130}, true);
  st::fill(p, Pattern::kBand, rng);
  p = st::rounded(p, SPARSA_DTYPE_BF16);
  sparsa_policy block = st::make_policy(SPARSA_POLICY_BLOCK_SPARSE);
  block.block_q = 32;
  block.block_k = 32;
  st::RunOptions opt;
  opt.dtype = SPARSA_DTYPE_BF16;
  opt.block_mask.resize(2 * 5 * 5);
  for (auto& m : opt.block_mask) m = rng.uniform(0, 1) < 0.6;
  st::run_and_compare(ctx(), p, block, ref::attend(p, ref::block_sparse(p, 32, 32, opt.block_mask)), opt);
  sparsa_policy sparge = st::make_policy(SPARSA_POLICY_SPARGE);
  sparge.block_q = 32;
  sparge.block_k = 32;
  sparge.sparge_theta = 1.0f;
  st::RunOptions sparge_opt;
  sparge_opt.dtype = SPARSA_DTYPE_BF16;
  st::run_and_compare(ctx(), p, sparge, ref::attend(p, ref::dense(p)), sparge_opt);
}

TEST_P(Layouts, NonUnitLastStrideIsAShapeMismatch) {
  std::vector<float> q(2 * 4 * 1 * 64, 1.0f), out(q.size(), NAN);
  sparsa_tensor tq = st::host_tensor(q.data(), SPARSA_DTYPE_F32, {1, 4, 1, 32});
  tq.strides[3] = 2;
  tq.strides[2] = 64;
  tq.strides[1] = 64;
  tq.strides[0] = 256;
  sparsa_tensor tk = st::host_tensor(q.data(), SPARSA_DTYPE_F32, {1, 4, 1, 32});
  sparsa_tensor to = st::host_tensor(out.data(), SPARSA_DTYPE_F32, {1, 4, 1, 32});
  sparsa_attention_args args;
  sparsa_attention_args_init(&args, sizeof args);
  args.q = &tq;
  args.k = &tk;
  args.v = &tk;
  args.out = &to;
  EXPECT_EQ(sparsa_attention_run(ctx().get(), &args, nullptr), SPARSA_STATUS_SHAPE_MISMATCH) << sparsa_last_error_message();
  for (float x : out) ASSERT_TRUE(std::isnan(x));
}

TEST_P(Layouts, PageIdOutsideTheCacheIsAnIndexError) {
  std::vector<float> cache(2 * 4 * 1 * 64, 1.0f), q(1 * 1 * 1 * 64, 1.0f), out(64, NAN);
  std::vector<int32_t> table = {0, 5}, lens = {8};  // page 5 of a 2-page cache
  sparsa_tensor tc = st::host_tensor(cache.data(), SPARSA_DTYPE_F32, {2, 4, 1, 64});
  sparsa_tensor tq = st::host_tensor(q.data(), SPARSA_DTYPE_F32, {1, 1, 1, 64});
  sparsa_tensor to = st::host_tensor(out.data(), SPARSA_DTYPE_F32, {1, 1, 1, 64});
  sparsa_tensor tt = st::host_tensor(table.data(), SPARSA_DTYPE_I32, {1, 2});
  sparsa_tensor tl = st::host_tensor(lens.data(), SPARSA_DTYPE_I32, {1});
  sparsa_attention_args args;
  sparsa_attention_args_init(&args, sizeof args);
  args.q = &tq;
  args.k = &tc;
  args.v = &tc;
  args.out = &to;
  args.page_table = &tt;
  args.seq_lens_k = &tl;
  EXPECT_EQ(sparsa_attention_run(ctx().get(), &args, nullptr), SPARSA_STATUS_INDEX_OUT_OF_RANGE) << sparsa_last_error_message();
  for (float x : out) ASSERT_TRUE(std::isnan(x));
}


TEST_P(Layouts, HeadMajorStridesAreJustStrides) {
  int counter = 0;
  for (Layout layout : {Layout::kPadded, Layout::kVarlen, Layout::kPaged})
    for (int64_t gap : {0, 5}) {
      ST_RNG(rng, counter++);
      SCOPED_TRACE(::testing::Message() << "layout=" << int(layout) << " gap=" << gap);
      const bool padded_q = layout != Layout::kVarlen;
      ref::Problem p = st::make_problem(2, 4, 2, 64, {padded_q ? 7 : 11, 7}, {66, 40}, true);
      st::fill(p, Pattern::kNeedles, rng);
      st::RunOptions opt;
      opt.layout = layout;
      opt.gap = gap;
      opt.head_major = true;
      run_cases(ctx(), p, opt, layout != Layout::kVarlen);
    }
}

}  // namespace
