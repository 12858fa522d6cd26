// Cross-policy invariants: every policy at settings that keep everything equals DENSE; Δ over a dense base is
// dense; plan-then-run allocates nothing more; optional outputs do not change the result.
#include <cmath>
#include <cstdio>

#include "test_util.h"

namespace {

using st::Pattern;

SPARSA_BACKEND_SUITE(Invariants);

struct KeepAll {
  const char* name;
  sparsa_policy policy;
  st::RunOptions opt;
};

// Every policy configured to keep every causal key of a problem with N keys.
std::vector<KeepAll> keep_all_policies(const ref::Problem& p) {
  const int N = p.max_skv(), nqb = (p.max_sq() + 31) / 32, nkb = (N + 15) / 16;
  std::vector<KeepAll> all;
  all.push_back({"DENSE", st::make_policy(SPARSA_POLICY_DENSE), {}});
  KeepAll sink{"SINK_WINDOW huge window", st::make_policy(SPARSA_POLICY_SINK_WINDOW), {}};
  sink.policy.sink_tokens = 0;
  sink.policy.sink_window = 1 << 20;
  all.push_back(sink);
  KeepAll block{"BLOCK_SPARSE all ones", st::make_policy(SPARSA_POLICY_BLOCK_SPARSE), {}};
  block.policy.block_q = 32;
  block.policy.block_k = 16;
  block.opt.block_mask.assign(size_t(p.B) * p.Hq * nqb * nkb, 1);
  all.push_back(block);
  KeepAll sparge{"SPARGE theta 1", st::make_policy(SPARSA_POLICY_SPARGE), {}};
  sparge.policy.block_q = 32;
  sparge.policy.block_k = 16;
  sparge.policy.sparge_theta = 1.0f;
  sparge.policy.sparge_tau = 0.5f;
  all.push_back(sparge);
  if (p.causal) {  // the always-causal policies (§5–§7)
    KeepAll token_indices{"TOKEN_INDICES all tokens", st::make_policy(SPARSA_POLICY_TOKEN_INDICES), {}};
    token_indices.opt.h_idx = 1;
    token_indices.opt.k = N;
    for (int b = 0; b < p.B; ++b)
      for (int t = 0; t < N; ++t) token_indices.opt.indices.push_back(t < p.skv[b] ? t : -1);
    all.push_back(token_indices);
    KeepAll select{"TOKEN_SELECT n_init+top_k+n_local >= N", st::make_policy(SPARSA_POLICY_TOKEN_SELECT), {}};
    select.policy.select_n_init = 4;
    select.policy.select_top_k = 16;
    select.policy.select_n_local = N;
    all.push_back(select);
    bool square = true;
    for (int b = 0; b < p.B; ++b) square &= p.sq[b] == p.skv[b];
    if (square) {
      KeepAll sparse{"TOKEN_SPARSE coverage 0", st::make_policy(SPARSA_POLICY_TOKEN_SPARSE), {}};
      sparse.policy.token_sparse_window = 16;
      sparse.policy.token_sparse_min_tokens = 32;
      sparse.policy.token_sparse_coverage = 0.0f;
      all.push_back(sparse);
    }
  }
  return all;
}

TEST_P(Invariants, EveryPolicyThatKeepsEverythingEqualsDense) {
  int counter = 0;
  for (bool causal : {false, true})
    for (auto [sq, skv] : {std::pair{160, 160}, {48, 160}})
      for (Pattern pattern : {Pattern::kRandom, Pattern::kNeedles}) {
        ST_RNG(rng, counter++);
        ref::Problem p = st::make_problem(2, 4, 2, 64, {sq}, {skv}, causal);
        st::fill(p, pattern, rng);
        const ref::Output want = ref::attend(p, ref::dense(p));
        for (const KeepAll& k : keep_all_policies(p)) {
          SCOPED_TRACE(::testing::Message() << k.name << " causal=" << causal << " sq=" << sq << " skv=" << skv << " "
                                            << st::pattern_name(pattern));
          st::run_and_compare(ctx(), p, k.policy, want, k.opt);
        }
      }
}

TEST_P(Invariants, DeltaOverAKeepAllBaseEqualsDenseAndAnchorRowsAreDense) {
  ST_RNG(rng, 0);
  ref::Problem p = st::make_problem(1, 4, 2, 64, {200}, {200}, true);
  st::fill(p, Pattern::kSinks, rng);
  const ref::Output want = ref::attend(p, ref::dense(p));
  st::RunOptions opt;
  opt.lse = false;
  for (KeepAll k : keep_all_policies(p)) {
    SCOPED_TRACE(k.name);
    k.policy.flags |= SPARSA_POLICY_FLAG_DELTA;
    k.policy.delta_gamma = 16;
    k.policy.delta_tail_min = 32;
    k.opt.lse = false;
    const st::RunResult r = st::run(ctx(), p, k.policy, k.opt);
    if (r.status == SPARSA_STATUS_INVALID_ARGUMENT || r.status == SPARSA_STATUS_UNSUPPORTED) {
      // Δ is a flag on prefill policies; a decode-only policy may refuse it, with a message.
      EXPECT_FALSE(r.message.empty());
      std::printf("note: %s refuses DELTA: %s\n", k.name, r.message.c_str());
      continue;
    }
    st::expect_ok(r);
    EXPECT_TRUE(st::outputs_close(r.out, want, st::kTolF32));
  }
}

TEST_P(Invariants, WarmedUpRunsOfTheSameProblemAllocateNoMoreScratch) {
  // After one run of a problem, further runs of the same problem must not grow the context's scratch (whatever
  // worker threads happen to pick up the work).
  constexpr int kRepeats = 4;
  ST_RNG(rng, 0);
  ref::Problem p = st::make_problem(2, 4, 2, 64, {128}, {128}, true);
  st::fill(p, Pattern::kRandom, rng);
  for (const KeepAll& k : keep_all_policies(p)) {
    SCOPED_TRACE(k.name);
    st::Context fresh(ctx().device_type());
    ASSERT_EQ(fresh.status(), SPARSA_STATUS_SUCCESS);
    const st::RunResult first = st::run(fresh, p, k.policy, k.opt);
    st::expect_ok(first);
    uint64_t warmed = 0, now = 0;
    ASSERT_EQ(sparsa_context_scratch_bytes(fresh.get(), &warmed), SPARSA_STATUS_SUCCESS);
    for (int repeat = 0; repeat < kRepeats; ++repeat) {
      const st::RunResult again = st::run(fresh, p, k.policy, k.opt);
      st::expect_ok(again);
      EXPECT_EQ(first.out.o, again.out.o);
    }
    ASSERT_EQ(sparsa_context_scratch_bytes(fresh.get(), &now), SPARSA_STATUS_SUCCESS);
    EXPECT_EQ(warmed, now) << "scratch grew after the first run";
  }
}

TEST_P(Invariants, PlanGrowsScratchUpFrontAndTheRunAfterItGrowsNothing) {
  // fp32 and fp16, one thread: the block policies load each (sequence, kv head)'s K/V once into panels in run
  // scratch (two query heads per kv head, so every pair is walked twice); and a decode step over several key
  // blocks (one query row: the CPU's decode kernels or its interleaved kv-head walk).
  ST_RNG(rng, 0);
  ref::Problem prefill = st::make_problem(2, 4, 2, 64, {128}, {128}, true);
  ref::Problem decode = st::make_problem(2, 8, 2, 64, {1}, {300}, true);
  st::fill(prefill, Pattern::kRandom, rng);
  st::fill(decode, Pattern::kRandom, rng);
  for (const ref::Problem* problem : {&prefill, &decode})
  for (int32_t dtype : {SPARSA_DTYPE_F32, SPARSA_DTYPE_F16})
    for (KeepAll k : keep_all_policies(*problem)) {
      const ref::Problem& p = *problem;
      SCOPED_TRACE(::testing::Message() << k.name << " dtype=" << dtype << " Sq=" << p.max_sq());
      st::Context fresh(ctx().device_type(), 1);
      ASSERT_EQ(fresh.status(), SPARSA_STATUS_SUCCESS);
      k.opt.plan_first = true;
      k.opt.dtype = dtype;
      const st::RunResult r = st::run(fresh, p, k.policy, k.opt);
      st::expect_ok(r);
      EXPECT_EQ(r.scratch_after_plan, r.scratch_after_run);
    }
}

TEST_P(Invariants, OptionalOutputsDoNotChangeTheResult) {
  ST_RNG(rng, 0);
  ref::Problem p = st::make_problem(1, 4, 2, 64, {100}, {130}, true);
  st::fill(p, Pattern::kBand, rng);
  for (const KeepAll& k : keep_all_policies(p)) {
    SCOPED_TRACE(k.name);
    st::RunOptions bare = k.opt;
    bare.lse = false;
    bare.stats = false;
    const st::RunResult with = st::run(ctx(), p, k.policy, k.opt), without = st::run(ctx(), p, k.policy, bare);
    st::expect_ok(with);
    st::expect_ok(without);
    EXPECT_EQ(with.out.o, without.out.o);
  }
}


// Every parameter outside the domain the header documents is INVALID_ARGUMENT, and nothing is written.
TEST_P(Invariants, ParametersOutsideTheirDocumentedDomainAreInvalidArguments) {
  ST_RNG(rng, 0);
  ref::Problem p = st::make_problem(1, 2, 1, 64, {64}, {64}, true);
  st::fill(p, Pattern::kRandom, rng);
  struct Bad {
    const char* what;
    int32_t kind;
    void (*edit)(sparsa_policy&);
  };
  const Bad bad[] = {
      {"block_q 0", SPARSA_POLICY_SPARGE, [](sparsa_policy& q) { q.block_q = 0; }},
      {"block_k -1", SPARSA_POLICY_SPARGE, [](sparsa_policy& q) { q.block_k = -1; }},
      {"sparge_theta 1.5", SPARSA_POLICY_SPARGE, [](sparsa_policy& q) { q.sparge_theta = 1.5f; }},
      {"sparge_theta NaN", SPARSA_POLICY_SPARGE, [](sparsa_policy& q) { q.sparge_theta = NAN; }},
      {"sparge_tau 0", SPARSA_POLICY_SPARGE, [](sparsa_policy& q) { q.sparge_tau = 0.0f; }},
      {"sparge_tau 1.5", SPARSA_POLICY_SPARGE, [](sparsa_policy& q) { q.sparge_tau = 1.5f; }},
      {"sparge_topk_fraction 2", SPARSA_POLICY_SPARGE, [](sparsa_policy& q) { q.sparge_topk_fraction = 2.0f; }},
      {"sparge_lambda 0.5", SPARSA_POLICY_SPARGE, [](sparsa_policy& q) { q.sparge_lambda = 0.5f; }},
      {"token_sparse_window 0", SPARSA_POLICY_TOKEN_SPARSE, [](sparsa_policy& q) { q.token_sparse_window = 0; }},
      {"token_sparse_pool_kernel 4", SPARSA_POLICY_TOKEN_SPARSE, [](sparsa_policy& q) { q.token_sparse_pool_kernel = 4; }},
      {"token_sparse_coverage -0.1", SPARSA_POLICY_TOKEN_SPARSE, [](sparsa_policy& q) { q.token_sparse_coverage = -0.1f; }},
      {"token_sparse_coverage 1.5", SPARSA_POLICY_TOKEN_SPARSE, [](sparsa_policy& q) { q.token_sparse_coverage = 1.5f; }},
      {"token_sparse_min_tokens -1", SPARSA_POLICY_TOKEN_SPARSE, [](sparsa_policy& q) { q.token_sparse_min_tokens = -1; }},
      {"select_top_k 0", SPARSA_POLICY_TOKEN_SELECT, [](sparsa_policy& q) { q.select_top_k = 0; }},
      {"select_n_init -1", SPARSA_POLICY_TOKEN_SELECT, [](sparsa_policy& q) { q.select_n_init = -1; }},
      {"select_n_local -1", SPARSA_POLICY_TOKEN_SELECT, [](sparsa_policy& q) { q.select_n_local = -1; }},
      {"delta_tail_min -1", SPARSA_POLICY_SINK_WINDOW,
       [](sparsa_policy& q) { q.flags |= SPARSA_POLICY_FLAG_DELTA; q.delta_tail_min = -1; }},
      {"unknown flag bit", SPARSA_POLICY_DENSE, [](sparsa_policy& q) { q.flags = 1u << 7; }},
      {"unknown kind", SPARSA_POLICY_DENSE, [](sparsa_policy& q) { q.kind = 99; }},
  };
  for (const Bad& b : bad) {
    SCOPED_TRACE(b.what);
    sparsa_policy pol = st::make_policy(b.kind);
    b.edit(pol);
    st::RunOptions opt;
    opt.lse = (pol.flags & SPARSA_POLICY_FLAG_DELTA) == 0;
    const st::RunResult r = st::run(ctx(), p, pol, opt);
    EXPECT_EQ(r.status, SPARSA_STATUS_INVALID_ARGUMENT) << sparsa_status_string(r.status) << ": " << r.message;
    EXPECT_TRUE(r.untouched);
  }
  // softmax_scale: 0 means default; negative, NaN and infinite are invalid.
  for (double scale : {-1.0, double(NAN), double(INFINITY)}) {
    SCOPED_TRACE(::testing::Message() << "softmax_scale " << scale);
    ref::Problem q = p;
    q.scale = scale;
    const st::RunResult r = st::run(ctx(), q, st::make_policy(SPARSA_POLICY_DENSE));
    EXPECT_EQ(r.status, SPARSA_STATUS_INVALID_ARGUMENT) << sparsa_status_string(r.status) << ": " << r.message;
    EXPECT_TRUE(r.untouched);
  }
}

TEST_P(Invariants, IndexBlockSizeBelowOneIsInvalid) {
  ST_RNG(rng, 0);
  ref::Problem p = st::make_problem(1, 2, 1, 64, {1}, {64}, true);
  st::fill(p, Pattern::kRandom, rng);
  sparsa_policy pol = st::make_policy(SPARSA_POLICY_TOKEN_INDICES);
  pol.index_block_size = 0;
  st::RunOptions opt;
  opt.indices = {0, 1, 2};
  opt.h_idx = 1;
  opt.k = 3;
  const st::RunResult r = st::run(ctx(), p, pol, opt);
  EXPECT_EQ(r.status, SPARSA_STATUS_INVALID_ARGUMENT) << sparsa_status_string(r.status) << ": " << r.message;
  EXPECT_TRUE(r.untouched);
}

}  // namespace
