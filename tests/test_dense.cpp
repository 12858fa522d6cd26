// §0 common conventions and §1 DENSE, against the float64 reference.
#include <cmath>
#include <cstring>
#include <limits>

#include "test_util.h"

namespace {

using st::Pattern;

SPARSA_BACKEND_SUITE(Common);
SPARSA_BACKEND_SUITE(Dense);

TEST_P(Dense, MatchesReferenceOnRandomAndStructuredInputs) {
  int counter = 0;
  for (int D : {64, 128, 256})
    for (bool causal : {false, true})
      for (Pattern pattern : st::all_patterns()) {
        ST_RNG(rng, counter++);
        SCOPED_TRACE(::testing::Message() << "D=" << D << " causal=" << causal << " " << st::pattern_name(pattern));
        ref::Problem p = st::make_problem(2, 4, 2, D, {45}, {70}, causal);
        st::fill(p, pattern, rng);
        const ref::Output want = ref::attend(p, ref::dense(p));
        st::run_and_compare(ctx(), p, st::make_policy(SPARSA_POLICY_DENSE), want);
      }
}

TEST_P(Dense, NullPolicyMeansDense) {
  ST_RNG(rng, 0);
  ref::Problem p = st::make_problem(1, 2, 2, 64, {33}, {33}, true);
  st::fill(p, Pattern::kRandom, rng);
  // The harness always passes a policy; a DENSE policy is what NULL means, so compare a direct NULL call's output.
  const ref::Output want = ref::attend(p, ref::dense(p));
  std::vector<float> q(33 * 2 * 64), k(q.size()), v(q.size()), out(q.size(), NAN);
  for (size_t e = 0; e < q.size(); ++e) {
    q[e] = float(p.q[0][e]);
    k[e] = float(p.k[0][e]);
    v[e] = float(p.v[0][e]);
  }
  sparsa_tensor tq = st::host_tensor(q.data(), SPARSA_DTYPE_F32, {1, 33, 2, 64});
  sparsa_tensor tk = st::host_tensor(k.data(), SPARSA_DTYPE_F32, {1, 33, 2, 64});
  sparsa_tensor tv = st::host_tensor(v.data(), SPARSA_DTYPE_F32, {1, 33, 2, 64});
  sparsa_tensor to = st::host_tensor(out.data(), SPARSA_DTYPE_F32, {1, 33, 2, 64});
  sparsa_attention_args args;
  sparsa_attention_args_init(&args, sizeof args);
  args.q = &tq;
  args.k = &tk;
  args.v = &tv;
  args.out = &to;
  args.causal = 1;
  ASSERT_EQ(sparsa_attention_run(ctx().get(), &args, nullptr), SPARSA_STATUS_SUCCESS) << sparsa_last_error_message();
  ref::Output got;
  got.o = {std::vector<double>(out.begin(), out.end())};
  EXPECT_TRUE(st::outputs_close(got, want, st::kTolF32));
}

TEST_P(Common, CausalIsBottomRightWhenSkvExceedsSq) {
  int counter = 0;
  for (Pattern pattern : st::all_patterns()) {
    ST_RNG(rng, counter++);
    SCOPED_TRACE(st::pattern_name(pattern));
    ref::Problem p = st::make_problem(1, 2, 1, 64, {37}, {100}, true);
    st::fill(p, pattern, rng);
    // Oracle self-check: row 0 sees keys 0..63 (o = 63).
    const ref::Visibility vis = ref::dense(p);
    int row0 = 0;
    for (int j = 0; j < 100; ++j) row0 += vis[0][0][j];
    ASSERT_EQ(row0, 64);
    st::run_and_compare(ctx(), p, st::make_policy(SPARSA_POLICY_DENSE), ref::attend(p, vis));
  }
}

TEST_P(Common, RowThatSeesNoKeyGetsZeroAndLseMinusInf) {
  ST_RNG(rng, 0);
  // Sq > Skv, causal: o = -30, rows 0..29 see no key.
  ref::Problem p = st::make_problem(1, 2, 2, 64, {50}, {20}, true);
  st::fill(p, Pattern::kRandom, rng);
  const ref::Output want = ref::attend(p, ref::dense(p));
  const st::RunResult r = st::run_and_compare(ctx(), p, st::make_policy(SPARSA_POLICY_DENSE), want);
  ASSERT_EQ(r.status, SPARSA_STATUS_SUCCESS);
  for (int h = 0; h < 2; ++h)
    for (int i = 0; i < 50; ++i) {
      if (i < 30) {
        EXPECT_TRUE(st::row_is_zero(r.out, 0, i, h, 2, 64)) << "row " << i << " head " << h;
        EXPECT_EQ(r.out.lse[0][h * 50 + i], -INFINITY) << "row " << i << " head " << h;
      } else {
        EXPECT_FALSE(st::row_is_zero(r.out, 0, i, h, 2, 64)) << "row " << i << " head " << h;
      }
    }
}

TEST_P(Common, LseIsNaturalLogOfSumOfExpScores) {
  // Zero queries: every score is 0, so LSE = log(Skv) and the output is the mean of V.
  ST_RNG(rng, 0);
  ref::Problem p = st::make_problem(1, 1, 1, 64, {5}, {40}, false);
  st::fill(p, Pattern::kRandom, rng);
  for (double& x : p.q[0]) x = 0;
  const st::RunResult r = st::run_and_compare(ctx(), p, st::make_policy(SPARSA_POLICY_DENSE), ref::attend(p, ref::dense(p)));
  ASSERT_EQ(r.status, SPARSA_STATUS_SUCCESS);
  for (int i = 0; i < 5; ++i) EXPECT_NEAR(r.out.lse[0][i], std::log(40.0), 1e-5);
  for (int d = 0; d < 64; ++d) {
    double mean = 0;
    for (int j = 0; j < 40; ++j) mean += p.v[0][j * 64 + d] / 40;
    EXPECT_NEAR(r.out.o[0][d], mean, 1e-5);
  }
}

TEST_P(Common, ScaleDefaultsToInverseSqrtHeadDimAndCallerScaleIsUsed) {
  int counter = 0;
  for (double scale : {0.0, 0.37, 1.5}) {
    ST_RNG(rng, counter++);
    SCOPED_TRACE(::testing::Message() << "scale=" << scale);
    ref::Problem p = st::make_problem(1, 2, 1, 128, {30}, {30}, true);
    st::fill(p, Pattern::kRandom, rng);
    p.scale = scale;
    st::run_and_compare(ctx(), p, st::make_policy(SPARSA_POLICY_DENSE), ref::attend(p, ref::dense(p)));
  }
}

TEST_P(Common, StatsReportPairsComputedAndDensePairs) {
  int counter = 0;
  for (bool causal : {false, true}) {
    ST_RNG(rng, counter++);
    ref::Problem p = st::make_problem(2, 2, 1, 64, {40}, {55}, causal);
    st::fill(p, Pattern::kRandom, rng);
    const st::RunResult r = st::run_and_compare(ctx(), p, st::make_policy(SPARSA_POLICY_DENSE), ref::attend(p, ref::dense(p)));
    ASSERT_EQ(r.stats.size(), size_t(SPARSA_STAT_COUNT));
    EXPECT_EQ(r.stats[SPARSA_STAT_PAIRS_DENSE], ref::dense_pairs(p)) << "causal=" << causal;
    EXPECT_EQ(r.stats[SPARSA_STAT_PAIRS_COMPUTED], ref::dense_pairs(p)) << "causal=" << causal;
    EXPECT_EQ(r.stats[SPARSA_STAT_CACHE_HITS], 0);
  }
}

TEST_P(Common, RunsAreDeterministic) {
  ST_RNG(rng, 0);
  ref::Problem p = st::make_problem(2, 4, 2, 64, {90}, {90}, true);
  st::fill(p, Pattern::kNeedles, rng);
  const st::RunResult a = st::run(ctx(), p, st::make_policy(SPARSA_POLICY_DENSE));
  const st::RunResult b = st::run(ctx(), p, st::make_policy(SPARSA_POLICY_DENSE));
  ASSERT_EQ(a.status, SPARSA_STATUS_SUCCESS) << a.message;
  ASSERT_EQ(b.status, SPARSA_STATUS_SUCCESS) << b.message;
  EXPECT_EQ(a.out.o, b.out.o);
  EXPECT_EQ(a.out.lse, b.out.lse);
}

// An argument error writes nothing and names the argument.
TEST_P(Common, ErrorsWriteNothingAndNameTheArgument) {
  std::vector<float> q(1 * 8 * 2 * 64, 0.5f), k(1 * 8 * 2 * 32, 0.5f), v(q.size(), 0.5f), out(q.size(), NAN);
  sparsa_tensor tq = st::host_tensor(q.data(), SPARSA_DTYPE_F32, {1, 8, 2, 64});
  sparsa_tensor tk = st::host_tensor(k.data(), SPARSA_DTYPE_F32, {1, 8, 2, 32});  // wrong head_dim
  sparsa_tensor tv = st::host_tensor(v.data(), SPARSA_DTYPE_F32, {1, 8, 2, 64});
  sparsa_tensor to = st::host_tensor(out.data(), SPARSA_DTYPE_F32, {1, 8, 2, 64});
  sparsa_attention_args args;
  sparsa_attention_args_init(&args, sizeof args);
  args.q = &tq;
  args.k = &tk;
  args.v = &tv;
  args.out = &to;
  const sparsa_policy dense = st::make_policy(SPARSA_POLICY_DENSE);
  EXPECT_EQ(sparsa_attention_run(ctx().get(), &args, &dense), SPARSA_STATUS_SHAPE_MISMATCH);
  EXPECT_NE(std::strstr(sparsa_last_error_message(), "k"), nullptr) << sparsa_last_error_message();
  for (float x : out) ASSERT_TRUE(std::isnan(x)) << "out written on error";

  // Hq % Hkv != 0.
  std::vector<float> k3(1 * 8 * 3 * 64, 0.5f);
  sparsa_tensor tk3 = st::host_tensor(k3.data(), SPARSA_DTYPE_F32, {1, 8, 3, 64});
  sparsa_tensor tv3 = st::host_tensor(k3.data(), SPARSA_DTYPE_F32, {1, 8, 3, 64});
  args.k = &tk3;
  args.v = &tv3;
  EXPECT_EQ(sparsa_attention_run(ctx().get(), &args, &dense), SPARSA_STATUS_SHAPE_MISMATCH);
  EXPECT_GT(std::strlen(sparsa_last_error_message()), 0u);
  for (float x : out) ASSERT_TRUE(std::isnan(x)) << "out written on error";

  // Missing out.
  args.k = &tk3;
  args.out = nullptr;
  EXPECT_EQ(sparsa_attention_run(ctx().get(), &args, &dense), SPARSA_STATUS_NULL_POINTER);

  // Dtype mismatch between q and k.
  std::vector<uint16_t> k16(1 * 8 * 2 * 64, 0);
  sparsa_tensor tk16 = st::host_tensor(k16.data(), SPARSA_DTYPE_F16, {1, 8, 2, 64});
  args.k = &tk16;
  args.v = &tv;
  args.out = &to;
  EXPECT_EQ(sparsa_attention_run(ctx().get(), &args, &dense), SPARSA_STATUS_DTYPE_MISMATCH);
  for (float x : out) ASSERT_TRUE(std::isnan(x)) << "out written on error";

  // A successful call clears the message.
  args.k = &tv;
  EXPECT_EQ(sparsa_attention_run(ctx().get(), &args, &dense), SPARSA_STATUS_SUCCESS) << sparsa_last_error_message();
  EXPECT_STREQ(sparsa_last_error_message(), "");
}


TEST_P(Dense, LongSequencesAcrossManyTiles) {
  ST_RNG(rng, 0);
  ref::Problem p = st::make_problem(1, 2, 1, 128, {600}, {600}, true);
  st::fill(p, Pattern::kBand, rng);
  st::run_and_compare(ctx(), p, st::make_policy(SPARSA_POLICY_DENSE), ref::attend(p, ref::dense(p)));
}

TEST_P(Common, ResultsDoNotDependOnTheThreadCount) {
  ST_RNG(rng, 0);
  ref::Problem p = st::make_problem(2, 4, 2, 64, {130}, {130}, true);
  st::fill(p, Pattern::kNeedles, rng);
  sparsa_policy select = st::make_policy(SPARSA_POLICY_TOKEN_SELECT);
  select.select_n_init = 4;
  select.select_top_k = 16;
  select.select_n_local = 8;
  for (const sparsa_policy& pol : {st::make_policy(SPARSA_POLICY_DENSE), select}) {
    SCOPED_TRACE(sparsa_policy_kind_name(pol.kind));
    std::vector<std::vector<double>> outputs;
    for (int threads : {1, 2, 3}) {
      st::Context c(GetParam(), threads);
      ASSERT_EQ(c.status(), SPARSA_STATUS_SUCCESS);
      const st::RunResult r = st::run(c, p, pol);
      st::expect_ok(r);
      outputs.push_back(r.out.o[0]);
    }
    EXPECT_EQ(outputs[0], outputs[1]);
    EXPECT_EQ(outputs[0], outputs[2]);
  }
}


TEST_P(Common, LargeScoresDoNotOverflow) {
  // Scaled scores in the hundreds: a softmax without max subtraction overflows exp.
  ST_RNG(rng, 0);
  ref::Problem p = st::make_problem(1, 2, 1, 64, {40}, {90}, true);
  st::fill(p, Pattern::kNeedles, rng);
  p.scale = 8.0;
  st::run_and_compare(ctx(), p, st::make_policy(SPARSA_POLICY_DENSE), ref::attend(p, ref::dense(p)));
}

}  // namespace

TEST_P(Dense, HalfPrecisionDecodeOverLongKeyRangesMatchesTheRoundedReference) {
  // One query row per sequence over thousands of keys on fp16/bf16 caches: several key ranges merged by LSE (the
  // last one partial), grouped query heads, head dims with and without the vector decode kernels, padded and paged
  // caches, a sequence with no keys, stats that count every pair, and a plan that sizes the scratch up front.
  struct Case {
    int B, Hq, Hkv, D;
    std::vector<int> skv;
    bool causal;
  };
  const Case cases[] = {
      {1, 8, 2, 128, {2500}, true},       {2, 4, 4, 64, {1100, 3000}, false}, {1, 6, 3, 40, {2100}, true},
      {3, 8, 1, 256, {1500, 0, 700}, true}, {1, 16, 2, 128, {1030}, false},
  };
  int counter = 0;
  for (const Case& c : cases)
    for (int32_t dtype : {SPARSA_DTYPE_F16, SPARSA_DTYPE_BF16})
      for (st::Layout layout : {st::Layout::kPadded, st::Layout::kPaged}) {
        ST_RNG(rng, counter++);
        SCOPED_TRACE(::testing::Message() << "B=" << c.B << " Hq=" << c.Hq << " Hkv=" << c.Hkv << " D=" << c.D
                                          << " dtype=" << dtype << " layout=" << int(layout));
        ref::Problem p = st::make_problem(c.B, c.Hq, c.Hkv, c.D, {1}, c.skv, c.causal);
        st::fill(p, Pattern::kNeedles, rng);
        p = st::rounded(p, dtype);
        st::RunOptions opt;
        opt.layout = layout;
        opt.dtype = dtype;
        opt.plan_first = true;
        const st::RunResult r =
            st::run_and_compare(ctx(), p, st::make_policy(SPARSA_POLICY_DENSE), ref::attend(p, ref::dense(p)), opt);
        EXPECT_EQ(r.scratch_after_plan, r.scratch_after_run) << "the run after sparsa_attention_plan grew scratch";
        int64_t pairs = 0;
        for (int b = 0; b < c.B; ++b) pairs += int64_t(c.Hq) * c.skv[size_t(b) % c.skv.size()];
        EXPECT_EQ(r.stats[SPARSA_STAT_PAIRS_COMPUTED], pairs);
        EXPECT_EQ(r.stats[SPARSA_STAT_PAIRS_DENSE], pairs);
      }
}

TEST(CpuBackend, PrefillGivesTheSameBitsWhetherOrNotItsKeysAreLoadedOnceIntoPanels) {
  // The CPU backend's own choice, so a CPU test. It converts a (sequence, kv head)'s K and V once into a panel for
  // all the query blocks that walk them when there is enough work per worker, and per key tile otherwise
  // (cpu_engine.h, QueryBlockPlan). One thread (every pair in a panel) and three (two blocks per pair are too few for
  // three workers: per tile) must agree bit for bit, non-finite K/V rows included: rows that see them are NaN, the
  // others match the reference.
  constexpr int kSq = 256, kSkv = 300, kD = 128;
  constexpr int kNanKey = 200, kInfKey = 250;  // causal, offset 44: rows >= 156 see the first, rows >= 206 the second
  struct Case {
    const char* name;
    int32_t kind;
    bool causal;
  };
  const Case cases[] = {{"DENSE causal", SPARSA_POLICY_DENSE, true},
                        {"DENSE", SPARSA_POLICY_DENSE, false},
                        {"SINK_WINDOW causal", SPARSA_POLICY_SINK_WINDOW, true}};
  int counter = 0;
  for (const Case& cs : cases)
    for (int32_t dtype : {SPARSA_DTYPE_F32, SPARSA_DTYPE_F16, SPARSA_DTYPE_BF16})
      for (bool non_finite : {false, true}) {
        ST_RNG(rng, counter++);
        SCOPED_TRACE(::testing::Message() << cs.name << " dtype=" << dtype << " non-finite K/V=" << non_finite);
        ref::Problem p = st::make_problem(1, 1, 1, kD, {kSq}, {kSkv}, cs.causal);
        st::fill(p, Pattern::kNeedles, rng);
        p = st::rounded(p, dtype);
        sparsa_policy policy = st::make_policy(cs.kind);
        policy.sink_tokens = 4;
        policy.sink_window = 96;
        const ref::Output want = ref::attend(p, cs.kind == SPARSA_POLICY_DENSE ? ref::dense(p)
                                                                                 : ref::sink_window(p, 4, 96));
        if (non_finite) {
          p.k[0][size_t(kNanKey) * kD + 3] = std::numeric_limits<double>::quiet_NaN();
          p.v[0][size_t(kInfKey) * kD + 5] = std::numeric_limits<double>::infinity();
        }
        st::RunOptions opt;
        opt.dtype = dtype;
        std::vector<st::RunResult> runs;
        for (int threads : {1, 3}) {
          st::Context c(SPARSA_DEVICE_CPU, threads);
          ASSERT_EQ(c.status(), SPARSA_STATUS_SUCCESS);
          runs.push_back(st::run(c, p, policy, opt));
          st::expect_ok(runs.back());
          if (threads == 1) {
            // The panel of one pair (K and V, kSkv fp32 rows each) lives in the context's scratch: proof it was used.
            uint64_t bytes = 0;
            ASSERT_EQ(sparsa_context_scratch_bytes(c.get(), &bytes), SPARSA_STATUS_SUCCESS);
            EXPECT_GE(bytes, uint64_t(2) * kSkv * kD * sizeof(float));
          }
        }
        ASSERT_EQ(runs[0].out.o[0].size(), runs[1].out.o[0].size());
        EXPECT_EQ(std::memcmp(runs[0].out.o[0].data(), runs[1].out.o[0].data(), runs[0].out.o[0].size() * sizeof(double)),
                  0);
        EXPECT_EQ(std::memcmp(runs[0].out.lse[0].data(), runs[1].out.lse[0].data(),
                              runs[0].out.lse[0].size() * sizeof(double)),
                  0);
        const int offset = kSkv - kSq;
        for (int i = 0; i < kSq; ++i) {
          const auto sees = [&](int key) {
            if (cs.causal && key > i + offset) return false;
            if (cs.kind == SPARSA_POLICY_DENSE) return true;
            return key < 4 || i + offset - key < 96;
          };
          const bool poisoned = non_finite && (sees(kNanKey) || sees(kInfKey));
          const double* got = &runs[0].out.o[0][size_t(i) * kD];
          const double* ref_row = &want.o[0][size_t(i) * kD];
          for (int c = 0; c < kD; ++c) {
            if (poisoned) {
              ASSERT_TRUE(std::isnan(got[c])) << "row " << i << " sees a non-finite key and must be NaN";
            } else {
              ASSERT_NEAR(got[c], ref_row[c], st::kTolHalf * std::max(1.0, std::fabs(ref_row[c])))
                  << "row " << i << " col " << c;
            }
          }
        }
      }
}

TEST(CpuBackend, DecodeGivesTheLastRowOfTheSamePrefillBitForBit) {
  // The CPU backend's own choice, so a CPU test. A decode step without the 16-bit decode kernels (fp32 caches, every
  // CPU) walks the kv heads of a work item interleaved block by block (attend_block_walk_kv_heads), each head's
  // tile doing exactly what the prefill's tile does for its row: the decode row must equal the last row of a causal
  // two-row prefill over the same keys bit for bit (that row sees every key), at any thread count, with groups of
  // 1, 4 and 8, ragged lengths across several key blocks, and rows that see a non-finite K or V entry (NaN).
  constexpr int kD = 64;
  struct Shape {
    int hq, hkv;
  };
  int counter = 0;
  for (const Shape shape : {Shape{4, 4}, Shape{8, 2}, Shape{8, 1}})
    for (bool non_finite : {false, true}) {
      ST_RNG(rng, counter++);
      SCOPED_TRACE(::testing::Message() << "Hq=" << shape.hq << " Hkv=" << shape.hkv << " non-finite=" << non_finite);
      const std::vector<int> skv = {300, 1000};
      ref::Problem prefill = st::make_problem(2, shape.hq, shape.hkv, kD, {2, 2}, skv, true);
      st::fill(prefill, Pattern::kNeedles, rng);
      prefill = st::rounded(prefill, SPARSA_DTYPE_F32);
      if (non_finite) prefill.v[1][(size_t(700) * shape.hkv + 0) * kD + 5] = std::numeric_limits<double>::quiet_NaN();
      ref::Problem decode = st::make_problem(2, shape.hq, shape.hkv, kD, {1, 1}, skv, true);
      for (int b = 0; b < 2; ++b) {
        decode.k[b] = prefill.k[b];
        decode.v[b] = prefill.v[b];
        const size_t row = size_t(shape.hq) * kD;
        std::copy(prefill.q[b].begin() + row, prefill.q[b].end(), decode.q[b].begin());  // the prefill's row 1
      }
      const sparsa_policy dense = st::make_policy(SPARSA_POLICY_DENSE);
      for (int threads : {1, 3}) {
        SCOPED_TRACE(::testing::Message() << threads << " threads");
        st::Context c(SPARSA_DEVICE_CPU, threads);
        ASSERT_EQ(c.status(), SPARSA_STATUS_SUCCESS);
        const st::RunResult step = st::run(c, decode, dense), whole = st::run(c, prefill, dense);
        st::expect_ok(step);
        st::expect_ok(whole);
        for (int b = 0; b < 2; ++b) {
          const size_t row = size_t(shape.hq) * kD;
          ASSERT_EQ(step.out.o[b].size(), row);
          EXPECT_EQ(std::memcmp(step.out.o[b].data(), whole.out.o[b].data() + row, row * sizeof(double)), 0)
              << "sequence " << b;
          for (int h = 0; h < shape.hq; ++h) {
            const double got = step.out.lse[b][size_t(h)], want = whole.out.lse[b][size_t(h) * 2 + 1];
            EXPECT_EQ(std::memcmp(&got, &want, sizeof got), 0) << "sequence " << b << " head " << h;
          }
          if (non_finite && b == 1) EXPECT_TRUE(std::isnan(step.out.o[b][5]));  // head 0 reads kv head 0
        }
      }
    }
}
