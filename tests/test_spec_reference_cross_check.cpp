// The float64 reference (tests/reference) against spec-literal forms of ALGORITHMS.md written here independently of
// reference.cpp: §0 bottom-right causal visibility (dense), §2 sink/window, §3 block masks, §4 block-level causal
// pruning and the λ PV skip of step 7, §8 Δ. Every other test uses the reference as its oracle; this one checks
// that oracle against a second reading of the spec.
#include "spec_test_util.h"

namespace {

constexpr double kSameFloat64 = 1e-12;  // two float64 evaluations of the same sums in different orders

// §0: key j is visible to row i when j <= i + (Skv − Sq).
bool literal_causal(const ref::Problem& p, int b, int i, int j) { return !p.causal || j <= i + (p.skv[b] - p.sq[b]); }

// §2 with a = i + o: causal, j <= a and (j < sinks or a − j < window); otherwise j < sinks or |a − j| < window.
bool literal_sink_window(const ref::Problem& p, int b, int i, int j, int sinks, int window) {
  const int a = i + p.skv[b] - p.sq[b];
  if (p.causal) return j <= a && (j < sinks || a - j < window);
  return j < sinks || std::abs(a - j) < window;
}

// §4 step 6: key block J's first key J·bk is not in the future of query block I's last row.
bool literal_block_visible(bool causal, int I, int J, int bq, int bk, int sq, int skv) {
  const int last = std::min(sq, (I + 1) * bq) - 1;
  return !causal || J * bk <= last + (skv - sq);
}

// §4 step 7 (batch 1, every causal block computed): ascending key blocks; a computed block after the first adds
// nothing when max over rows of (m_local − m_new) < λ.
ref::Output literal_pv_skip(const ref::Problem& p, int bq, int bk, double lambda, int64_t* skipped) {
  *skipped = 0;
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
          ++*skipped;
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

// §8: rows from s_p = Sq − (Sq mod γ + max(tail_min, γ)) on are dense; a row i above takes sparse_i + (dense_r −
// sparse_r) with anchor r = ⌊i/γ⌋·γ.
ref::Output literal_delta(const ref::Problem& p, const ref::Output& sparse, const ref::Output& dense, int gamma,
                          int tail_min) {
  ref::Output out = sparse;
  for (int b = 0; b < p.B; ++b) {
    const int sq = p.sq[b];
    const int s_p = sq - (sq % gamma + std::max(tail_min, gamma));
    for (int i = 0; i < sq; ++i)
      for (int h = 0; h < p.Hq; ++h)
        for (int d = 0; d < p.D; ++d) {
          const size_t at = (size_t(i) * p.Hq + h) * p.D + d;
          const size_t r = (size_t(i / gamma * gamma) * p.Hq + h) * p.D + d;
          out.o[b][at] = i >= s_p ? dense.o[b][at] : sparse.o[b][at] + (dense.o[b][r] - sparse.o[b][r]);
        }
  }
  out.lse.clear();
  return out;
}

TEST(SpecReference, AgreesWithSpecLiteralForms) {
  ST_RNG(rng, 61);
  // (Sq, Skv): equal, fewer queries than keys, more queries than keys (rows that see nothing when causal).
  for (auto [sq, skv] : std::vector<std::pair<int, int>>{{24, 24}, {13, 40}, {30, 12}}) {
    for (bool causal : {false, true}) {
      SCOPED_TRACE(::testing::Message() << "sq " << sq << " skv " << skv << " causal " << causal);
      const ref::Problem p = random_problem(1, 4, 2, 8, {sq}, {skv}, causal, rng, st::Pattern::kSinks);
      const ref::Output dense = dense_of(p);
      const ref::Output literal_dense =
          attend_where(p, [&](int b, int, int i, int j) { return literal_causal(p, b, i, j); });
      EXPECT_TRUE(st::outputs_close(dense, literal_dense, kSameFloat64));
      EXPECT_TRUE(st::lse_close(dense, literal_dense, kSameFloat64));

      for (const auto& [sink_count, window_size] :
           std::vector<std::pair<int, int>>{{0, 0}, {3, 0}, {0, 5}, {2, 7}, {50, 100}}) {
        const int sinks = sink_count, window = window_size;  // plain locals: a lambda may not capture a binding (C++17)
        const ref::Output literal =
            attend_where(p, [&](int b, int, int i, int j) { return literal_sink_window(p, b, i, j, sinks, window); });
        EXPECT_TRUE(st::outputs_close(ref::attend(p, ref::sink_window(p, sinks, window)), literal, kSameFloat64))
            << "sinks " << sinks << " window " << window;
      }

      const int bq = 5, bk = 7, nqb = (sq + bq - 1) / bq, nkb = (skv + bk - 1) / bk;
      std::vector<uint8_t> mask(size_t(4) * nqb * nkb);
      for (auto& m : mask) m = rng.integer(0, 1);
      const ref::Output literal_mask = attend_where(p, [&](int b, int h, int i, int j) {
        return literal_causal(p, b, i, j) && mask[((size_t(b) * 4 + h) * nqb + i / bq) * nkb + j / bk] != 0;
      });
      EXPECT_TRUE(st::outputs_close(attend_mask(p, mask, bq, bk), literal_mask, kSameFloat64));
      for (int I = 0; I < nqb; ++I)
        for (int J = 0; J < nkb; ++J)
          EXPECT_EQ(ref::block_causal_allowed(p, 0, I, J, bq, bk), literal_block_visible(causal, I, J, bq, bk, sq, skv))
              << "block " << I << ", " << J;

      for (double lambda : {-kInfD, -8.0, -2.0, 0.0}) {
        int64_t want_skipped = 0, got_skipped = 0;
        const ref::Output literal = literal_pv_skip(p, bq, bk, lambda, &want_skipped);
        const ref::Output got = pv_skip(p, bq, bk, lambda, &got_skipped);
        EXPECT_TRUE(st::outputs_close(got, literal, kSameFloat64)) << "lambda " << lambda;
        EXPECT_TRUE(st::lse_close(got, literal, kSameFloat64)) << "lambda " << lambda;
        EXPECT_EQ(got_skipped, want_skipped) << "lambda " << lambda;
      }

      if (!causal) continue;  // §8 is defined for causal attention
      const ref::Output sparse = attend_mask(p, mask, bq, bk);
      for (auto [gamma, tail_min] : std::vector<std::pair<int, int>>{{4, 3}, {4, 16}, {64, 0}, {1, 0}, {7, 8}})
        EXPECT_TRUE(st::outputs_close(ref::delta(p, sparse, gamma, tail_min),
                                      literal_delta(p, sparse, dense, gamma, tail_min), kSameFloat64))
            << "gamma " << gamma << " tail_min " << tail_min;
    }
  }
}

}  // namespace
