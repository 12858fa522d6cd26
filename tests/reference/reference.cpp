// Float64 reference of ALGORITHMS.md. See reference.h for layouts. Every function follows the numbered steps of its
// section literally; nothing here is shared with the library.
#include "reference/reference.h"

#include <algorithm>
#include <cmath>
#include <numeric>
#include <stdexcept>

namespace ref {

namespace {

// Sparge int8 quantisation (§4 quantized path).
constexpr double kInt8Max = 127.0;
constexpr double kQuantEpsilon = 1e-7;

int ceil_div(int a, int b) { return (a + b - 1) / b; }

// One output row from (score, key) pairs: softmax·V and log-sum-exp; no pair → 0 and -inf.
void finish_row(const Problem& p, int b, int kv_head, const std::vector<std::pair<double, int>>& entries, double* o,
                double* lse) {
  std::fill(o, o + p.D, 0.0);
  if (entries.empty()) {
    *lse = -kInf;
    return;
  }
  double m = -kInf;
  for (const auto& e : entries) m = std::max(m, e.first);
  double sum = 0;
  for (const auto& e : entries) {
    const double w = std::exp(e.first - m);
    sum += w;
    const double* vr = p.v_row(b, e.second, kv_head);
    for (int d = 0; d < p.D; ++d) o[d] += w * vr[d];
  }
  for (int d = 0; d < p.D; ++d) o[d] /= sum;
  *lse = m + std::log(sum);
}

Output empty_output(const Problem& p) {
  Output out;
  out.o.resize(p.B);
  out.lse.resize(p.B);
  for (int b = 0; b < p.B; ++b) {
    out.o[b].assign(size_t(p.sq[b]) * p.Hq * p.D, 0.0);
    out.lse[b].assign(size_t(p.Hq) * p.sq[b], -kInf);
  }
  return out;
}

// Descending order of `score` with the smaller index first among equals (§0).
// Larger first, ties in index order (stable); a NaN ranks below every number (sparsa.h's top-k), which also keeps
// the comparison a strict weak order when scores hold NaN.
std::vector<int> descending_order(const std::vector<double>& score) {
  std::vector<int> order(score.size());
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(), [&](int a, int b) {
    const bool nan_a = std::isnan(score[a]), nan_b = std::isnan(score[b]);
    if (nan_a || nan_b) return !nan_a;
    return score[a] > score[b];
  });
  return order;
}

double relative_gap(double a, double b) {
  const double scale = std::max(std::fabs(a), std::fabs(b));
  return scale == 0 ? 0 : std::fabs(a - b) / scale;
}

// Softmax of a vector that may hold -inf entries; all -inf gives all zeros.
std::vector<double> softmax(const std::vector<double>& x) {
  double m = -kInf;
  for (double s : x) m = std::max(m, s);
  std::vector<double> out(x.size(), 0.0);
  if (m == -kInf) return out;
  double sum = 0;
  for (size_t i = 0; i < x.size(); ++i) sum += (out[i] = std::exp(x[i] - m));
  for (double& e : out) e /= sum;
  return out;
}

IndexSet all_tokens(int n) {
  IndexSet s(n);
  std::iota(s.begin(), s.end(), 0);
  return s;
}

}  // namespace

double dot(const double* a, const double* b, int n) {
  double s = 0;
  for (int i = 0; i < n; ++i) s += a[i] * b[i];
  return s;
}

double Problem::softmax_scale() const { return scale > 0 ? scale : 1.0 / std::sqrt(double(D)); }

double Problem::score(int b, int h, int i, int j) const {
  return softmax_scale() * dot(q_row(b, i, h), k_row(b, j, h / group()), D);
}

void Problem::allocate() {
  q.assign(B, {});
  k.assign(B, {});
  v.assign(B, {});
  for (int b = 0; b < B; ++b) {
    q[b].assign(size_t(sq[b]) * Hq * D, 0.0);
    k[b].assign(size_t(skv[b]) * Hkv * D, 0.0);
    v[b].assign(size_t(skv[b]) * Hkv * D, 0.0);
  }
}

int Problem::max_sq() const { return sq.empty() ? 0 : *std::max_element(sq.begin(), sq.end()); }
int Problem::max_skv() const { return skv.empty() ? 0 : *std::max_element(skv.begin(), skv.end()); }

Visibility make_visibility(const Problem& p, const std::function<bool(int, int, int, int)>& visible) {
  Visibility vis(p.B, std::vector<std::vector<uint8_t>>(p.Hq));
  for (int b = 0; b < p.B; ++b)
    for (int h = 0; h < p.Hq; ++h) {
      auto& m = vis[b][h];
      m.assign(size_t(p.sq[b]) * p.skv[b], 0);
      for (int i = 0; i < p.sq[b]; ++i)
        for (int j = 0; j < p.skv[b]; ++j) m[size_t(i) * p.skv[b] + j] = visible(b, h, i, j) ? 1 : 0;
    }
  return vis;
}

Output attend(const Problem& p, const Visibility& vis) {
  Output out = empty_output(p);
  std::vector<std::pair<double, int>> entries;
  for (int b = 0; b < p.B; ++b)
    for (int h = 0; h < p.Hq; ++h)
      for (int i = 0; i < p.sq[b]; ++i) {
        entries.clear();
        for (int j = 0; j < p.skv[b]; ++j)
          if (vis[b][h][size_t(i) * p.skv[b] + j]) entries.emplace_back(p.score(b, h, i, j), j);
        finish_row(p, b, h / p.group(), entries, &out.o[b][(size_t(i) * p.Hq + h) * p.D],
                   &out.lse[b][size_t(h) * p.sq[b] + i]);
      }
  return out;
}

int64_t count_pairs(const Visibility& vis) {
  int64_t n = 0;
  for (const auto& per_b : vis)
    for (const auto& m : per_b)
      for (uint8_t x : m) n += x;
  return n;
}

Visibility dense(const Problem& p) {
  return make_visibility(p, [&](int b, int, int i, int j) { return !p.causal || causal_allowed(i, j, p.o(b)); });
}

int64_t dense_pairs(const Problem& p) { return count_pairs(dense(p)); }

Visibility sink_window(const Problem& p, int n_sink, int window) {
  return make_visibility(p, [&](int b, int, int i, int j) {
    const long aligned = long(i) + p.o(b);  // i + o
    if (p.causal) return j <= aligned && (j < n_sink || aligned - j < window);
    return j < n_sink || std::labs(aligned - j) < window;
  });
}

Visibility block_sparse(const Problem& p, int bq, int bk, const std::vector<uint8_t>& mask) {
  const int nqb = ceil_div(p.max_sq(), bq), nkb = ceil_div(p.max_skv(), bk);
  return make_visibility(p, [&](int b, int h, int i, int j) {
    if (p.causal && !causal_allowed(i, j, p.o(b))) return false;
    return mask[((size_t(b) * p.Hq + h) * nqb + i / bq) * nkb + j / bk] != 0;
  });
}

bool block_causal_allowed(const Problem& p, int b, int I, int J, int bq, int bk) {
  if (!p.causal) return true;
  const int last_row = std::min((I + 1) * bq, p.sq[b]) - 1;
  return causal_allowed(last_row, J * bk, p.o(b));
}

BlockCounts block_counts(const Problem& p, int bq, int bk, const std::vector<uint8_t>& mask) {
  const int nqb = ceil_div(p.max_sq(), bq), nkb = ceil_div(p.max_skv(), bk);
  BlockCounts c;
  for (int b = 0; b < p.B; ++b)
    for (int h = 0; h < p.Hq; ++h)
      for (int I = 0; I < ceil_div(p.sq[b], bq); ++I)
        for (int J = 0; J < ceil_div(p.skv[b], bk); ++J) {
          if (!block_causal_allowed(p, b, I, J, bq, bk)) continue;
          ++c.total;
          if (mask[((size_t(b) * p.Hq + h) * nqb + I) * nkb + J]) ++c.computed;
        }
  return c;
}

double self_similarity(const std::vector<const double*>& rows, int D) {
  std::vector<double> sum(D, 0.0);
  for (const double* x : rows) {
    const double norm = std::sqrt(dot(x, x, D));
    if (norm == 0.0) continue;  // a zero row is a zero unit vector (docs/algorithms.md, "Readings")
    for (int d = 0; d < D; ++d) sum[d] += x[d] / norm;
  }
  const double n = double(rows.size());
  return dot(sum.data(), sum.data(), D) / (n * n);
}

// ------------------------------------------------------------------------------------------------------------ §4
SpargeResult sparge(const Problem& p, const std::vector<SpargeParams>& per_head) {
  const SpargeParams& shape = per_head.at(0);
  const int bq = shape.bq, bk = shape.bk, D = p.D;
  SpargeResult r;
  r.nqb = ceil_div(p.max_sq(), bq);
  r.nkb = ceil_div(p.max_skv(), bk);
  r.mask.assign(size_t(p.B) * p.Hq * r.nqb * r.nkb, 0);
  r.q_sim.assign(size_t(p.B) * p.Hq * r.nqb, 0.0);
  r.k_sim.assign(size_t(p.B) * p.Hkv * r.nkb, 0.0);
  r.out = empty_output(p);
  const double scale = p.softmax_scale();

  for (int b = 0; b < p.B; ++b) {
    const int sq = p.sq[b], skv = p.skv[b], nqb = ceil_div(sq, bq), nkb = ceil_div(skv, bk);
    // Step 1: centre K per kv head over every token of the sequence.
    Rows kc(size_t(skv) * p.Hkv * D);
    for (int kh = 0; kh < p.Hkv; ++kh) {
      std::vector<double> mean(D, 0.0);
      for (int j = 0; j < skv; ++j)
        for (int d = 0; d < D; ++d) mean[d] += p.k_row(b, j, kh)[d] / skv;
      for (int j = 0; j < skv; ++j)
        for (int d = 0; d < D; ++d) kc[(size_t(j) * p.Hkv + kh) * D + d] = p.k_row(b, j, kh)[d] - mean[d];
    }
    auto kc_row = [&](int j, int kh) { return &kc[(size_t(j) * p.Hkv + kh) * D]; };
    // Steps 2–3 for key blocks: centred block means and self-similarity.
    std::vector<Rows> k_mean(size_t(p.Hkv) * nkb, Rows(D, 0.0));
    for (int kh = 0; kh < p.Hkv; ++kh)
      for (int J = 0; J < nkb; ++J) {
        std::vector<const double*> rows;
        for (int j = J * bk; j < std::min(skv, (J + 1) * bk); ++j) rows.push_back(kc_row(j, kh));
        for (const double* x : rows)
          for (int d = 0; d < D; ++d) k_mean[size_t(kh) * nkb + J][d] += x[d] / rows.size();
        r.k_sim[(size_t(b) * p.Hkv + kh) * r.nkb + J] = self_similarity(rows, D);
      }

    for (int h = 0; h < p.Hq; ++h) {
      const SpargeParams& hp = per_head[h];
      const int kh = h / p.group();
      auto mask_at = [&](int I, int J) -> uint8_t& { return r.mask[((size_t(b) * p.Hq + h) * r.nqb + I) * r.nkb + J]; };
      auto key_similar = [&](int J) {
        const double s = r.k_sim[(size_t(b) * p.Hkv + kh) * r.nkb + J];
        r.theta_margin = std::min(r.theta_margin, std::fabs(s - hp.theta));
        return s > hp.theta;
      };
      for (int I = 0; I < nqb; ++I) {
        std::vector<const double*> rows;
        Rows q_mean(D, 0.0);
        for (int i = I * bq; i < std::min(sq, (I + 1) * bq); ++i) rows.push_back(p.q_row(b, i, h));
        for (const double* x : rows)
          for (int d = 0; d < D; ++d) q_mean[d] += x[d] / rows.size();
        const double qs = self_similarity(rows, D);
        r.q_sim[(size_t(b) * p.Hq + h) * r.nqb + I] = qs;
        r.theta_margin = std::min(r.theta_margin, std::fabs(qs - hp.theta));
        const bool query_similar = qs > hp.theta;
        // Step 4: predicted block scores and their softmax.
        std::vector<double> s_hat(nkb);
        for (int J = 0; J < nkb; ++J) {
          const bool future = !block_causal_allowed(p, b, I, J, bq, bk);
          s_hat[J] = (!key_similar(J) || future) ? -kInf : scale * dot(q_mean.data(), k_mean[size_t(kh) * nkb + J].data(), D);
        }
        const std::vector<double> p_hat = softmax(s_hat);
        // Step 5: TopCdf or top-k.
        const std::vector<int> order = descending_order(p_hat);
        std::vector<uint8_t> kept(nkb, 0);
        if (hp.topk_fraction > 0) {
          const int keep = std::max(1, int(std::floor(hp.topk_fraction * nkb)));
          for (int n = 0; n < keep && n < nkb; ++n) kept[order[n]] = 1;
          if (keep < nkb && p_hat[order[keep]] > 0)
            r.topk_margin = std::min(r.topk_margin, relative_gap(p_hat[order[keep - 1]], p_hat[order[keep]]));
        } else {
          double cumsum = 0;
          for (int n = 0; n < nkb; ++n) {
            cumsum += p_hat[order[n]];
            if (p_hat[order[n]] > 0) r.tau_margin = std::min(r.tau_margin, std::fabs(cumsum - hp.tau));
            if (cumsum <= hp.tau || n == 0) kept[order[n]] = 1;
          }
        }
        // Step 6: forced rows/columns, sink column, then causal pruning.
        for (int J = 0; J < nkb; ++J) {
          bool on = kept[J] || !key_similar(J) || !query_similar || (hp.attention_sink && J == 0);
          mask_at(I, J) = (on && block_causal_allowed(p, b, I, J, bq, bk)) ? 1 : 0;
        }
      }
    }

    // Attention over the mask (element-wise causal inside blocks), optional int8 scores and PV skip (step 7).
    for (int h = 0; h < p.Hq; ++h) {
      const SpargeParams& hp = per_head[h];
      const int kh = h / p.group();
      for (int I = 0; I < nqb; ++I) {
        const int row0 = I * bq, rows = std::min(sq, (I + 1) * bq) - row0;
        std::vector<std::vector<std::pair<double, int>>> entries(rows);
        std::vector<double> running_max(rows, -kInf);
        // int8 emulation of the query block (per bq-row block of this head).
        std::vector<double> q_int(size_t(rows) * D), k_int;
        double q_step = 0;
        if (shape.quantized) {
          double amax = 0;
          for (int a = 0; a < rows; ++a)
            for (int d = 0; d < D; ++d) amax = std::max(amax, std::fabs(p.q_row(b, row0 + a, h)[d]));
          q_step = amax / kInt8Max + kQuantEpsilon;
          for (int a = 0; a < rows; ++a)
            for (int d = 0; d < D; ++d) q_int[size_t(a) * D + d] = std::nearbyint(p.q_row(b, row0 + a, h)[d] / q_step);
        }
        bool first = true;
        for (int J = 0; J < nkb; ++J) {
          if (!r.mask[((size_t(b) * p.Hq + h) * r.nqb + I) * r.nkb + J]) continue;
          ++r.blocks_computed;
          const int col0 = J * bk, cols = std::min(skv, (J + 1) * bk) - col0;
          double k_step = 0;
          if (shape.quantized) {
            double amax = 0;
            for (int c = 0; c < cols; ++c)
              for (int d = 0; d < D; ++d) amax = std::max(amax, std::fabs(kc_row(col0 + c, kh)[d]));
            k_step = amax / kInt8Max + kQuantEpsilon;
            k_int.assign(size_t(cols) * D, 0.0);
            for (int c = 0; c < cols; ++c)
              for (int d = 0; d < D; ++d) k_int[size_t(c) * D + d] = std::nearbyint(kc_row(col0 + c, kh)[d] / k_step);
          }
          std::vector<std::vector<std::pair<double, int>>> block(rows);
          double worst = -kInf;  // max over rows of (m_local - m_new)
          for (int a = 0; a < rows; ++a) {
            double local_max = -kInf;
            for (int c = 0; c < cols; ++c) {
              const int i = row0 + a, j = col0 + c;
              if (p.causal && !causal_allowed(i, j, p.o(b))) continue;
              const double s = shape.quantized
                                   ? dot(&q_int[size_t(a) * D], &k_int[size_t(c) * D], D) * q_step * k_step * scale
                                   : p.score(b, h, i, j);
              block[a].emplace_back(s, j);
              local_max = std::max(local_max, s);
            }
            if (local_max > -kInf) worst = std::max(worst, local_max - std::max(running_max[a], local_max));
          }
          const bool skip = !first && hp.lambda > -kInf && worst < hp.lambda;
          first = false;
          if (skip) {
            ++r.pv_blocks_skipped;
            continue;
          }
          for (int a = 0; a < rows; ++a)
            for (const auto& e : block[a]) {
              entries[a].push_back(e);
              running_max[a] = std::max(running_max[a], e.first);
            }
        }
        for (int a = 0; a < rows; ++a)
          finish_row(p, b, kh, entries[a], &r.out.o[b][(size_t(row0 + a) * p.Hq + h) * D],
                     &r.out.lse[b][size_t(h) * sq + row0 + a]);
      }
    }
  }
  std::vector<uint8_t> all_ones(r.mask.size(), 1);
  r.blocks_total = block_counts(p, bq, bk, all_ones).total;
  return r;
}

// ------------------------------------------------------------------------------------------------------------ §5
TokenSparseResult token_sparse(const Problem& p, const TokenSparseParams& tp) {
  TokenSparseResult r;
  r.selected.resize(p.B);
  r.ran_dense.assign(p.B, false);
  r.budget.assign(p.B, 0);
  r.n_drop.assign(p.B, 0);
  r.cumsum.resize(p.B);
  r.head_score.resize(p.B);
  std::vector<std::vector<IndexSet>>& sel = r.selected;
  for (int b = 0; b < p.B; ++b) {
    if (p.sq[b] != p.skv[b]) throw std::invalid_argument("token_sparse: sq != skv");
    const int L = p.sq[b], W = tp.window;
    sel[b].assign(p.Hq, {});
    // Step 1.
    if (L <= tp.min_tokens + W || tp.coverage == 0) {
      r.ran_dense[b] = true;
      for (int h = 0; h < p.Hq; ++h) sel[b][h] = all_tokens(L);
      continue;
    }
    const int n_cand = L - W;
    std::vector<std::vector<double>> head_score(p.Hq, std::vector<double>(n_cand, 0.0));
    for (int h = 0; h < p.Hq; ++h) {
      // Step 2: mean over the last W queries of their causal softmax rows.
      std::vector<double> acc(n_cand, 0.0);
      for (int row = L - W; row < L; ++row) {
        std::vector<double> s(row + 1);
        for (int j = 0; j <= row; ++j) s[j] = p.score(b, h, row, j);
        const std::vector<double> prob = softmax(s);
        for (int j = 0; j < n_cand; ++j) acc[j] += prob[j] / W;
      }
      // Step 3: avg_pool1d, zero padding counted.
      const int half = tp.pool_kernel / 2;
      std::vector<double> pooled(n_cand, 0.0);
      for (int j = 0; j < n_cand; ++j) {
        for (int t = j - half; t <= j + half; ++t)
          if (t >= 0 && t < n_cand) pooled[j] += acc[t];
        pooled[j] /= tp.pool_kernel;
      }
      // Step 4: per-head normalisation.
      const double total = std::accumulate(pooled.begin(), pooled.end(), 0.0);
      for (int j = 0; j < n_cand; ++j) head_score[h][j] = pooled[j] / total;
    }
    std::vector<double> layer(n_cand, 0.0);
    for (int h = 0; h < p.Hq; ++h)
      for (int j = 0; j < n_cand; ++j) layer[j] += head_score[h][j] / p.Hq;
    const double layer_total = std::accumulate(layer.begin(), layer.end(), 0.0);
    for (double& x : layer) x /= layer_total;
    // Step 5: n_drop and budget.
    std::sort(layer.begin(), layer.end());
    double cumsum = 0;
    int count = 0;
    for (double x : layer) {
      cumsum += x;
      r.cumsum[b].push_back(cumsum);
      r.coverage_margin = std::min(r.coverage_margin, std::fabs(cumsum - tp.coverage));
      if (cumsum < tp.coverage) ++count;
    }
    r.n_drop[b] = count + (count > 0 ? 1 : 0);
    r.budget[b] = std::max(tp.min_tokens, n_cand - r.n_drop[b]);
    r.head_score[b] = head_score;
    // Step 6: per-head top-budget plus the window.
    for (int h = 0; h < p.Hq; ++h) {
      double margin = kInf;
      IndexSet s = top_k(head_score[h], std::min(r.budget[b], n_cand), &margin);
      r.topk_margin = std::min(r.topk_margin, margin);
      for (int j = n_cand; j < L; ++j) s.push_back(j);
      sel[b][h] = s;
    }
  }
  if (tp.selection_only) return r;
  // Steps 7–8: causal attention inside each head's compressed sequence; other rows exactly 0.
  std::vector<std::vector<std::vector<uint8_t>>> member(p.B);
  for (int b = 0; b < p.B; ++b) {
    member[b].assign(p.Hq, std::vector<uint8_t>(p.sq[b], 0));
    for (int h = 0; h < p.Hq; ++h)
      for (int t : sel[b][h]) member[b][h][t] = 1;
  }
  const Visibility vis = make_visibility(
      p, [&](int b, int h, int i, int j) { return member[b][h][i] && member[b][h][j] && j <= i; });
  r.out = attend(p, vis);
  r.pairs_computed = count_pairs(vis);
  return r;
}

// ------------------------------------------------------------------------------------------------------------ §6
TokenSelectResult token_select(const Problem& p, const TokenSelectParams& tp, SelectionCache* cache) {
  TokenSelectResult r;
  r.selected.resize(p.B);
  r.ran_dense.assign(p.B, false);
  r.vote.resize(p.B);
  const int n_sets = tp.per_kv_head ? p.Hkv : 1;
  const bool use_cache = cache != nullptr && tp.cache_theta < 1.0;
  for (int b = 0; b < p.B; ++b) {
    const int N = p.skv[b], sq = p.sq[b];
    r.selected[b].assign(n_sets, {});
    // Step 2.
    if (long(tp.n_init) + tp.top_k + tp.n_local >= N) {
      r.ran_dense[b] = true;
      for (auto& s : r.selected[b]) s = all_tokens(N);
      continue;
    }
    // Step 1: mean query per head, concatenated.
    Rows mean_query(size_t(p.Hq) * p.D, 0.0);
    for (int h = 0; h < p.Hq; ++h)
      for (int i = 0; i < sq; ++i)
        for (int d = 0; d < p.D; ++d) mean_query[size_t(h) * p.D + d] += p.q_row(b, i, h)[d] / sq;
    // Step 5: the selection cache decides whether T is reused.
    bool hit = false;
    if (use_cache && !cache->mean_query[b].empty()) {
      const Rows& old = cache->mean_query[b];
      const double cosine = dot(old.data(), mean_query.data(), int(old.size())) /
                            std::sqrt(dot(old.data(), old.data(), int(old.size())) *
                                      dot(mean_query.data(), mean_query.data(), int(old.size())));
      hit = cosine >= tp.cache_theta;
    }
    std::vector<IndexSet> top(n_sets);
    if (hit) {
      top = cache->top[b];
      ++r.hits;
    } else {
      // Step 3: per-head softmax over the candidates, soft vote, top-k.
      const int c0 = tp.n_init, c1 = N - tp.n_local, n_cand = c1 - c0;
      std::vector<std::vector<double>> vote(n_sets, std::vector<double>(n_cand, 0.0));
      for (int h = 0; h < p.Hq; ++h) {
        std::vector<double> s(n_cand);
        for (int t = c0; t < c1; ++t) {
          const double raw = dot(&mean_query[size_t(h) * p.D], p.k_row(b, t, h / p.group()), p.D);
          s[t - c0] = tp.scale_scores ? raw * p.softmax_scale() : raw;
        }
        const std::vector<double> prob = softmax(s);
        auto& v = vote[tp.per_kv_head ? h / p.group() : 0];
        for (int t = 0; t < n_cand; ++t) v[t] += prob[t];
      }
      for (int set = 0; set < n_sets; ++set) {
        double margin = kInf;
        top[set] = top_k(vote[set], tp.top_k, &margin);
        r.topk_margin = std::min(r.topk_margin, margin);
        for (int& t : top[set]) t += c0;
      }
      r.vote[b] = vote;
      if (use_cache) {
        cache->mean_query[b] = mean_query;
        cache->top[b] = top;
        ++r.misses;
      }
    }
    // Step 4: I = sinks ∪ T ∪ local window, sorted.
    for (int set = 0; set < n_sets; ++set) {
      std::vector<uint8_t> in(N, 0);
      for (int t = 0; t < std::min(tp.n_init, N); ++t) in[t] = 1;
      for (int t : top[set]) in[t] = 1;
      for (int t = std::max(0, N - tp.n_local); t < N; ++t) in[t] = 1;
      for (int t = 0; t < N; ++t)
        if (in[t]) r.selected[b][set].push_back(t);
    }
  }
  if (cache) {
    cache->hits += r.hits;
    cache->misses += r.misses;
  }
  std::vector<std::vector<std::vector<uint8_t>>> member(p.B);
  for (int b = 0; b < p.B; ++b) {
    member[b].assign(n_sets, std::vector<uint8_t>(p.skv[b], 0));
    for (int set = 0; set < n_sets; ++set)
      for (int t : r.selected[b][set]) member[b][set][t] = 1;
  }
  const Visibility vis = make_visibility(p, [&](int b, int h, int i, int j) {
    const int set = tp.per_kv_head ? h / p.group() : 0;
    return member[b][set][j] && causal_allowed(i, j, p.o(b));
  });
  r.out = attend(p, vis);
  r.pairs_computed = count_pairs(vis);
  return r;
}

// ------------------------------------------------------------------------------------------------------------ §7
TokenIndicesResult token_indices(const Problem& p, const TokenIndicesParams& tp) {
  TokenIndicesResult r;
  r.selected.resize(p.B);
  std::vector<std::vector<std::vector<uint8_t>>> member(p.B);
  for (int b = 0; b < p.B; ++b) {
    const int N = p.skv[b];
    member[b].assign(p.Hq, std::vector<uint8_t>(N, 0));
    r.selected[b].assign(p.Hq, {});
    for (int h = 0; h < p.Hq; ++h) {
      const int row = tp.head_map.empty() ? h / (p.Hq / tp.h_idx) : tp.head_map[h];
      auto& in = member[b][h];
      for (int s = 0; s < tp.k; ++s) {
        const int id = tp.indices[(size_t(b) * tp.h_idx + row) * tp.k + s];
        if (id < 0) continue;
        for (int t = id * tp.block_size; t < std::min(N, (id + 1) * tp.block_size); ++t) in[t] = 1;
      }
      for (int t = 0; t < std::min(tp.n_init, N); ++t) in[t] = 1;
      for (int t = std::max(0, N - tp.n_local); t < N; ++t) in[t] = 1;
      for (int t = 0; t < N; ++t)
        if (in[t]) r.selected[b][h].push_back(t);
    }
  }
  const Visibility vis = make_visibility(p, [&](int b, int h, int i, int j) {
    // §7: "Each query head attends to the deduplicated union, causal" — causal by definition, like §6.
    return member[b][h][j] && causal_allowed(i, j, p.o(b));
  });
  r.out = attend(p, vis);
  r.pairs_computed = count_pairs(vis);
  return r;
}

// ------------------------------------------------------------------------------------------------------------ §8
int delta_sparse_rows(int sq, int gamma, int tail_min) {
  const int cut = sq % gamma + std::max(tail_min, gamma);
  return sq - cut;
}

Output delta(const Problem& p, const Output& sparse, int gamma, int tail_min) {
  if (!p.causal) throw std::invalid_argument("delta: the problem must be causal");
  const Output dense_out = attend(p, dense(p));
  Output out = empty_output(p);
  const int HD = p.Hq * p.D;
  for (int b = 0; b < p.B; ++b) {
    out.lse[b].clear();
    const int s_p = delta_sparse_rows(p.sq[b], gamma, tail_min);
    for (int i = 0; i < p.sq[b]; ++i) {
      const int r = (i / gamma) * gamma;
      for (int x = 0; x < HD; ++x) {
        const size_t at = size_t(i) * HD + x, anchor = size_t(r) * HD + x;
        out.o[b][at] = (i >= s_p) ? dense_out.o[b][at]
                                  : sparse.o[b][at] + (dense_out.o[b][anchor] - sparse.o[b][anchor]);
      }
    }
  }
  return out;
}

// ------------------------------------------------------------------------------------------------------------ §0
void merge_row(const double* o_a, double lse_a, const double* o_b, double lse_b, int D, double* o, double* lse) {
  const double m = std::max(lse_a, lse_b);
  if (m == -kInf) {
    std::fill(o, o + D, 0.0);
    *lse = -kInf;
    return;
  }
  const double w_a = std::exp(lse_a - m), w_b = std::exp(lse_b - m);
  for (int d = 0; d < D; ++d) o[d] = (w_a * o_a[d] + w_b * o_b[d]) / (w_a + w_b);
  *lse = m + std::log(w_a + w_b);
}

IndexSet top_k(const std::vector<double>& score, int k, double* margin) {
  const std::vector<int> order = descending_order(score);
  k = std::max(0, std::min<int>(k, int(score.size())));
  if (k == 0) {
    if (margin) *margin = kInf;
    return {};
  }
  IndexSet chosen(order.begin(), order.begin() + k);
  std::sort(chosen.begin(), chosen.end());
  if (margin) *margin = k < int(score.size()) ? relative_gap(score[order[k - 1]], score[order[k]]) : kInf;
  return chosen;
}

}  // namespace ref
