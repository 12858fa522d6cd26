// Shared helpers of the spec-audit tests (test_spec_audit_*.cpp): brute-force float64 oracles written from
// ALGORITHMS.md and small policy builders. Header-only, internal linkage: each test file gets its own copy.
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

// Spec-literal visibility (§0 bottom-right causal), written here independently of reference.cpp.
ref::Output attend_where(const ref::Problem& p, const std::function<bool(int, int, int, int)>& visible) {
  return ref::attend(p, ref::make_visibility(p, visible));
}
ref::Output dense_of(const ref::Problem& p) {
  return attend_where(p, [&](int b, int, int i, int j) { return !p.causal || j <= i + (p.skv[b] - p.sq[b]); });
}

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

// Block-level causal test of §4.4: key block J's first key J·bk is not in the future of query block I's last row.
bool block_visible(bool causal, int I, int J, int bq, int bk, int sq, int skv) {
  const int last = std::min(sq, (I + 1) * bq) - 1;
  return !causal || J * bk <= last + (skv - sq);
}

// Keys visible under a block mask [B, Hq, nqb, nkb] ∧ element-wise causal.
ref::Output attend_mask(const ref::Problem& p, const std::vector<uint8_t>& mask, int bq, int bk) {
  const int nqb = (p.max_sq() + bq - 1) / bq, nkb = (p.max_skv() + bk - 1) / bk;
  return attend_where(p, [&](int b, int h, int i, int j) {
    if (p.causal && j > i + p.skv[b] - p.sq[b]) return false;
    return mask[((size_t(b) * p.Hq + h) * nqb + i / bq) * nkb + j / bk] != 0;
  });
}

// Counts, per (h, I), the kept blocks of a non-causal run with theta −1 (nothing forced).
std::vector<int> kept_per_row(const st::RunResult& r, int H, int nqb, int nkb) {
  std::vector<int> counts(size_t(H) * nqb, 0);
  for (int h = 0; h < H; ++h)
    for (int I = 0; I < nqb; ++I)
      for (int J = 0; J < nkb; ++J) counts[size_t(h) * nqb + I] += r.block_mask[(size_t(h) * nqb + I) * nkb + J];
  return counts;
}

// λ PV skip, brute force from §4.7: ascending key blocks; a computed block after the first adds nothing when
// max over rows of (m_local − m_new) < λ. theta 1 forces every (causal) block.
ref::Output pv_skip_brute(const ref::Problem& p, int bq, int bk, double lambda, int64_t* skipped = nullptr,
                          int64_t* pairs = nullptr) {
  if (skipped) *skipped = 0;
  if (pairs) *pairs = 0;
  ref::Output out;
  const int sq = p.sq[0], skv = p.skv[0], o = skv - sq, D = p.D;
  out.o.assign(1, ref::Rows(size_t(sq) * p.Hq * D, 0.0));
  out.lse.assign(1, ref::Rows(size_t(p.Hq) * sq, -kInfD));
  for (int h = 0; h < p.Hq; ++h)
    for (int r0 = 0; r0 < sq; r0 += bq) {
      const int rows = std::min(bq, sq - r0);
      std::vector<double> m(rows, -kInfD);
      std::vector<std::vector<std::pair<double, int>>> kept(rows);
      bool first = true;
      for (int c0 = 0; c0 < skv; c0 += bk) {
        std::vector<std::vector<std::pair<double, int>>> blk(rows);
        double worst = -kInfD;
        bool any = false;
        for (int a = 0; a < rows; ++a) {
          double lm = -kInfD;
          for (int j = c0; j < std::min(skv, c0 + bk); ++j) {
            if (p.causal && j > r0 + a + o) continue;
            const double s = p.score(0, h, r0 + a, j);
            blk[a].push_back({s, j});
            if (pairs) ++*pairs;
            lm = std::max(lm, s);
          }
          if (lm > -kInfD) {
            any = true;
            worst = std::max(worst, lm - std::max(m[a], lm));
          }
        }
        if (!any) continue;
        const bool skip = !first && worst < lambda;
        first = false;
        if (skip) {
          if (skipped) ++*skipped;
          continue;
        }
        for (int a = 0; a < rows; ++a)
          for (auto& e : blk[a]) {
            kept[a].push_back(e);
            m[a] = std::max(m[a], e.first);
          }
      }
      for (int a = 0; a < rows; ++a) {
        if (kept[a].empty()) continue;
        double mx = -kInfD, sum = 0;
        for (auto& e : kept[a]) mx = std::max(mx, e.first);
        double* orow = &out.o[0][(size_t(r0 + a) * p.Hq + h) * D];
        for (auto& e : kept[a]) {
          const double w = std::exp(e.first - mx);
          sum += w;
          for (int d = 0; d < D; ++d) orow[d] += w * p.v_row(0, e.second, h / p.group())[d];
        }
        for (int d = 0; d < D; ++d) orow[d] /= sum;
        out.lse[0][size_t(h) * sq + r0 + a] = mx + std::log(sum);
      }
    }
  return out;
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
