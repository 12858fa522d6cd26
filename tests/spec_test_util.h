// Shared helpers of the spec tests (test_spec_*.cpp): small policy builders, thin wrappers over the float64 reference
// (tests/reference, the one oracle), and the checks of the token policies' selections. Header-only with internal
// linkage: the helpers hold no state.
#pragma once

#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>
#include <cstdio>
#include <set>

#include "test_util.h"

namespace {

constexpr double kInfD = std::numeric_limits<double>::infinity();

struct Cpu {
  st::Context ctx{SPARSA_DEVICE_CPU};
};

ref::Problem random_problem(int B, int Hq, int Hkv, int D, std::vector<int> sq, std::vector<int> skv, bool causal,
                            st::Rng& rng, st::Pattern pattern = st::Pattern::kRandom) {
  ref::Problem p = st::make_problem(B, Hq, Hkv, D, std::move(sq), std::move(skv), causal);
  st::fill(p, pattern, rng);
  return p;
}

// Thin wrappers over the float64 reference (tests/reference), the one oracle: hand-derived visible sets, dense, a
// block mask.
ref::Output attend_where(const ref::Problem& p, const std::function<bool(int, int, int, int)>& visible) {
  return ref::attend(p, ref::make_visibility(p, visible));
}
ref::Output dense_of(const ref::Problem& p) { return ref::attend(p, ref::dense(p)); }

void compare(const st::Context& ctx, const ref::Problem& p, const sparsa_policy& pol, const ref::Output& want,
             st::RunOptions opt = {}) {
  st::run_and_compare(ctx, p, pol, want, opt);
}

// ================================================================================================ §4 SPARGE
sparsa_policy sparge(int bq, int bk, float theta, float tau) {
  sparsa_policy pol = st::make_policy(SPARSA_POLICY_SPARGE);
  pol.block_q = bq;
  pol.block_k = bk;
  pol.sparge_theta = theta;
  pol.sparge_tau = tau;
  return pol;
}

// Keys visible under a block mask [B, Hq, nqb, nkb] ∧ element-wise causal (§3).
ref::Output attend_mask(const ref::Problem& p, const std::vector<uint8_t>& mask, int bq, int bk) {
  return ref::attend(p, ref::block_sparse(p, bq, bk, mask));
}

// Counts, per (h, I), the kept blocks of a non-causal run with theta −1 (nothing forced).
std::vector<int> kept_per_row(const st::RunResult& r, int H, int nqb, int nkb) {
  std::vector<int> counts(size_t(H) * nqb, 0);
  for (int h = 0; h < H; ++h)
    for (int I = 0; I < nqb; ++I)
      for (int J = 0; J < nkb; ++J) counts[size_t(h) * nqb + I] += r.block_mask[(size_t(h) * nqb + I) * nkb + J];
  return counts;
}

// SPARGE with every causal block computed and the λ PV skip of §4 step 7 (batch 1): the reference's sparge() with
// theta above any similarity, so every block is forced (what theta 1 gives the library, sim <= 1). `skipped`
// receives PV_BLOCKS_SKIPPED; `pairs` the computed pairs (λ-skipped blocks' pairs count: every causal pair).
ref::Output pv_skip(const ref::Problem& p, int bq, int bk, double lambda, int64_t* skipped = nullptr,
                    int64_t* pairs = nullptr) {
  ref::SpargeParams sp;
  sp.bq = bq;
  sp.bk = bk;
  sp.theta = kInfD;
  sp.lambda = lambda;
  const ref::SpargeResult r = ref::sparge(p, std::vector<ref::SpargeParams>(p.Hq, sp));
  if (skipped) *skipped = r.pv_blocks_skipped;
  if (pairs) *pairs = ref::dense_pairs(p);
  return r.out;
}

sparsa_policy token_sparse(int window, int min_tokens, float coverage) {
  sparsa_policy pol = st::make_policy(SPARSA_POLICY_TOKEN_SPARSE);
  pol.token_sparse_window = window;
  pol.token_sparse_min_tokens = min_tokens;
  pol.token_sparse_coverage = coverage;
  return pol;
}

void check_token_sparse(const st::Context& ctx, const ref::Problem& p, const sparsa_policy& pol,
                        st::RunOptions opt = {}) {
  ref::TokenSparseParams tp;
  tp.window = pol.token_sparse_window;
  tp.pool_kernel = pol.token_sparse_pool_kernel;
  tp.min_tokens = pol.token_sparse_min_tokens;
  tp.coverage = pol.token_sparse_coverage;
  const ref::TokenSparseResult want = ref::token_sparse(p, tp);
  if (want.coverage_margin < 1e-9 || want.topk_margin < 1e-9) {
    std::printf("[ note     ] TOKEN_SPARSE case skipped: decision too close to call\n");
    return;
  }
  opt.selected_sets = p.Hq;
  opt.selected_cap = p.max_skv();
  const st::RunResult r = st::run_and_compare(ctx, p, pol, want.out, opt);
  EXPECT_TRUE(st::sets_equal(r.selected, opt.selected_cap, want.selected));
  // Dropped rows: exactly 0 and LSE −inf (§5.8).
  for (int b = 0; b < p.B; ++b)
    for (int h = 0; h < p.Hq; ++h) {
      const std::set<int> kept(want.selected[b][h].begin(), want.selected[b][h].end());
      for (int i = 0; i < p.sq[b]; ++i)
        if (!kept.count(i)) {
          EXPECT_TRUE(st::row_is_zero(r.out, b, i, h, p.Hq, p.D));
          if (!r.out.lse.empty()) {
            EXPECT_EQ(r.out.lse[b][size_t(h) * p.sq[b] + i], -kInfD);
          }
        }
    }
}

// ================================================================================================ §6 TOKEN_SELECT
sparsa_policy token_select(int n_init, int top_k, int n_local) {
  sparsa_policy pol = st::make_policy(SPARSA_POLICY_TOKEN_SELECT);
  pol.select_n_init = n_init;
  pol.select_top_k = top_k;
  pol.select_n_local = n_local;
  pol.select_cache_theta = 1.f;
  return pol;
}

ref::TokenSelectParams select_params(const sparsa_policy& pol) {
  ref::TokenSelectParams sp;
  sp.n_init = pol.select_n_init;
  sp.n_local = pol.select_n_local;
  sp.top_k = pol.select_top_k;
  sp.scale_scores = pol.select_scale_scores != 0;
  sp.per_kv_head = pol.select_per_kv_head != 0;
  sp.cache_theta = pol.select_cache_theta;
  return sp;
}

void check_select(const st::Context& ctx, const ref::Problem& p, const sparsa_policy& pol, st::RunOptions opt = {}) {
  const ref::TokenSelectResult want = ref::token_select(p, select_params(pol), nullptr);
  if (want.topk_margin < 1e-9) {
    std::printf("[ note     ] TOKEN_SELECT case skipped: vote too close to call\n");
    return;
  }
  opt.selected_sets = pol.select_per_kv_head ? p.Hkv : 1;
  opt.selected_cap = p.max_skv();
  const st::RunResult r = st::run_and_compare(ctx, p, pol, want.out, opt);
  EXPECT_TRUE(st::sets_equal(r.selected, opt.selected_cap, want.selected));
}

}  // namespace
