// The attention case table's check (case_table.h).
#include "case_table.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <limits>
#include <numeric>

namespace st {

namespace {

constexpr double kKernelTolF32 = 2e-4, kKernelTolF16 = 4e-3, kKernelTolBF16 = 3e-2;
constexpr double kLseAbs = 1e-3;                 // prefill rows: 1e-3 + 1e-4·|ref|
constexpr double kLseRelPrefill = 1e-4;
constexpr double kLseRelDecode = 1e-3;           // decode rows: 1e-3·max(1, |ref|)
constexpr double kCpuFactorPrefill = 2.0;        // prefill rows: |o − o_cpu| within twice `out`
constexpr double kDeltaTolF32 = 4e-4, kDeltaTolF16 = 8e-3, kDeltaTolBF16 = 6e-2;
constexpr double kSelectTolF32 = 1e-4, kSelectLse = 2e-3;
constexpr double kSpargeLse = 2e-3;  // SPARGE rows on smooth inputs: 2e-3·max(1, |ref|)
// A selection decision closer than this (relative gap at the top-k boundary) is too close to call: the CPU backend
// scores in float64 like the reference, but summation orders differ (the spec tests use the same bound).
constexpr double kSelectionMargin = 1e-9;
constexpr double kNeedleLength = 3.0;  // a needle key is kNeedleLength·sqrt(D) long
constexpr int kUnusedSlotPercent = 8, kRepeatSlotPercent = 16;  // TOKEN_INDICES ids: -1, then repeats
constexpr double kSinkBlockScore = 30;  // natural-log score of a sink-block row against key 0
constexpr double kSinkBlockNoise = 0.5;
constexpr double kNoiseClamp = 3;
// AttentionCase::sparse_inputs (case_table.h).
constexpr double kSparseNoise = 0.7, kSparseLean = 0.5, kSparseKeyAlongU = 1.2, kSparseKeyNoise = 0.05;
constexpr double kDirectionClamp = 2;
constexpr int kPlantedKeys = 4, kTieRun = 24;
// TOKEN_SPARSE scored in float64 (the CPU backend; a device off its fp32 path) agrees with the oracle to rounding.
constexpr double kFloat64SparseBound = 1e-12;

// AttentionCase::sink_blocks: replaces the pattern's values.
void plant_sink_blocks(ref::Problem& p, int block_q, Rng& rng) {
  for (auto* t : {&p.q, &p.k, &p.v})
    for (auto& rows : *t)
      for (double& x : rows) x = kSinkBlockNoise * std::clamp(rng.normal(), -kNoiseClamp, kNoiseClamp);
  const double a = std::sqrt(kSinkBlockScore * std::sqrt(double(p.D)));  // scale·a·a = kSinkBlockScore
  for (int b = 0; b < p.B; ++b) {
    for (int h = 0; h < p.Hkv; ++h) p.k[b][size_t(h) * p.D] = a;
    for (int i = 0; i < p.sq[b]; ++i) {
      if ((i / block_q) % 2 != 0) continue;
      for (int h = 0; h < p.Hq; ++h) p.q[b][(size_t(i) * p.Hq + h) * p.D] = a;
    }
  }
}

// AttentionCase::smooth: replaces the pattern's values (case_table.h).
constexpr int kSmoothFrequencies = 4;
constexpr double kTwoPi = 6.28318530717958647692;
constexpr double kNoisyBlockNoise = 3;
void plant_smooth_inputs(ref::Problem& p, const AttentionCase& c, Rng& rng) {
  const int D = p.D;
  // Each sinusoid pair carries 2·D/kSmoothFrequencies of variance: together as much as the noise's D.
  const double amplitude = std::sqrt(2.0 * D / kSmoothFrequencies);
  const double period = c.smooth_period_blocks * std::max(c.block_q, c.block_k);
  std::vector<double> sink(D);
  for (double& x : sink) x = rng.normal();
  const double sink_norm = std::sqrt(ref::dot(sink.data(), sink.data(), D));
  const auto listed = [](const std::vector<int>& blocks, int block) {
    return std::find(blocks.begin(), blocks.end(), block) != blocks.end();
  };
  const auto features = [&](double* x, double pos, double noise, bool with_sink) {
    for (int d = 0; d < D; ++d) x[d] = noise * rng.normal();
    for (int f = 0; f < kSmoothFrequencies; ++f) {
      const double omega = kTwoPi / (period * (f + 1));
      x[2 * f] += amplitude * std::cos(omega * pos);
      x[2 * f + 1] += amplitude * std::sin(omega * pos);
    }
    if (with_sink)
      for (int d = 0; d < D; ++d) x[d] += c.sink_strength * sink[d] / sink_norm;
  };
  const bool with_sink = c.sink_strength > 0;
  for (int b = 0; b < p.B; ++b) {
    const int shift = p.skv[b] - p.sq[b];  // bottom-right: query i sits at key position i + shift
    for (int i = 0; i < p.sq[b]; ++i)
      for (int h = 0; h < p.Hq; ++h)
        features(&p.q[b][(size_t(i) * p.Hq + h) * D], i + shift,
                 listed(c.noisy_q_blocks, i / c.block_q) ? kNoisyBlockNoise : 1.0, with_sink);
    for (int j = 0; j < p.skv[b]; ++j)
      for (int h = 0; h < p.Hkv; ++h)
        features(&p.k[b][(size_t(j) * p.Hkv + h) * D], j,
                 listed(c.noisy_k_blocks, j / c.block_k) ? kNoisyBlockNoise : 1.0, with_sink && j < c.block_k);
    for (double& x : p.v[b]) x = rng.normal();
  }
}

// AttentionCase::sparse_inputs: replaces the pattern's values. Returns the planted keys per sequence and kv head.
std::vector<std::vector<std::vector<int>>> plant_sparse_inputs(ref::Problem& p, const AttentionCase& c, Rng& rng) {
  std::vector<std::vector<std::vector<int>>> planted(p.B, std::vector<std::vector<int>>(p.Hkv));
  for (auto* t : {&p.q, &p.k, &p.v})
    for (auto& rows : *t)
      for (double& x : rows) x = kSparseNoise * std::clamp(rng.normal(), -kNoiseClamp, kNoiseClamp);
  const int g = p.group(), D = p.D;
  const size_t key_row = size_t(p.Hkv) * D;
  for (int b = 0; b < p.B; ++b) {
    const int L = p.sq[b];
    if (c.sparse_inputs == SparseInputs::kTiedRuns) {
      for (int t = 0; t < L; ++t)
        if (t % kTieRun != 0) std::copy_n(&p.k[b][size_t(t - t % kTieRun) * key_row], key_row, &p.k[b][t * key_row]);
      continue;
    }
    if (c.sparse_inputs != SparseInputs::kNeedles && c.sparse_inputs != SparseInputs::kSinks) continue;
    const int first_window_row = std::max(0, L - c.sparse_window);
    for (int hk = 0; hk < p.Hkv; ++hk) {
      std::vector<double> u(D);
      for (double& e : u) e = std::clamp(rng.normal(), -kDirectionClamp, kDirectionClamp);
      for (int i = first_window_row; i < L; ++i)
        for (int h = hk * g; h < (hk + 1) * g; ++h)
          for (int d = 0; d < D; ++d) p.q[b][(size_t(i) * p.Hq + h) * D + d] += kSparseLean * u[d];
      std::vector<int>& keys = planted[b][hk];
      if (c.sparse_inputs == SparseInputs::kSinks) {
        for (int t = 0; t < std::min(kPlantedKeys, first_window_row); ++t) keys.push_back(t);
      } else {
        // Candidates only (keys 1 .. first window row − 2): the window is kept whatever the scores.
        for (int n = 0; n < kPlantedKeys && first_window_row > 2 * kPlantedKeys; ++n)
          keys.push_back(rng.integer(1, first_window_row - 2));
      }
      for (int t : keys)
        for (int d = 0; d < D; ++d)
          p.k[b][(size_t(t) * p.Hkv + hk) * D + d] = kSparseKeyAlongU * u[d] + kSparseKeyNoise * rng.normal();
    }
  }
  return planted;
}

void round_in_place(ref::Problem& p, int32_t dtype) {
  for (auto* t : {&p.q, &p.k, &p.v})
    for (auto& rows : *t)
      for (double& x : rows) x = round_to_dtype(x, dtype);
}

constexpr int kTileKeys = 128, kHalfTileKeys = 64;  // MaskPattern::kSecondHalfOnly: the keys of a 128-key tile

// The case's BLOCK_SPARSE mask [B, Hq, row blocks, key blocks] (MaskPattern, case_table.h).
std::vector<uint8_t> block_mask(const AttentionCase& c, const ref::Problem& p, Rng& rng) {
  const int nqb = (p.max_sq() + c.block_q - 1) / c.block_q, nkb = (p.max_skv() + c.block_k - 1) / c.block_k;
  std::vector<uint8_t> mask(size_t(p.B) * p.Hq * nqb * nkb);
  for (auto& m : mask) m = rng.uniform(0, 1) < c.mask_density ? 1 : 0;
  for (int b = 0; b < p.B; ++b) {
    for (int h = 0; h < p.Hq; ++h) {
      for (int r = 0; r < nqb; ++r) {
        for (int k = 0; k < nkb; ++k) {
          uint8_t& cell = mask[((size_t(b) * p.Hq + h) * nqb + r) * nkb + k];
          const int first_key = k * c.block_k, first_row = r * c.block_q;
          switch (c.mask_pattern) {
            case MaskPattern::kOneCellPerRow: cell = k == (r * 7 + h * 3 + b) % nkb; break;
            case MaskPattern::kBand:
              cell = first_key + c.block_k > first_row - c.block_k && first_key < first_row + c.block_q + c.block_k;
              break;
            case MaskPattern::kSecondHalfOnly:
              cell = first_key % kTileKeys >= kHalfTileKeys && (r + k + h) % 5 != 0;
              break;
            case MaskPattern::kEmptyRows:
              if ((r + h) % 3 == 1) cell = 0;
              break;
            case MaskPattern::kRandom: break;
          }
        }
      }
    }
  }
  return mask;
}

std::vector<int32_t> random_indices(const AttentionCase& c, const ref::Problem& p, Rng& rng) {
  const int slots = c.index_heads * c.index_slots;
  std::vector<int32_t> ids(size_t(p.B) * slots);
  for (int b = 0; b < p.B; ++b) {
    const int n_ids = (p.skv[b] + c.index_block_size - 1) / c.index_block_size;
    for (int s = 0; s < slots; ++s) {
      const size_t at = size_t(b) * slots + s;
      const int r = rng.integer(0, 99);
      ids[at] = r < kUnusedSlotPercent                  ? -1
                : r < kRepeatSlotPercent && s > 0 ? ids[at - 1]
                                                  : rng.integer(0, n_ids - 1);
    }
    if (!c.sorted_rows) continue;
    for (int row = (b == 0 ? 1 : 0); row < c.index_heads; ++row) {  // row 0 of sequence 0 stays unsorted
      std::vector<int32_t> pool(n_ids);
      std::iota(pool.begin(), pool.end(), 0);
      std::shuffle(pool.begin(), pool.end(), rng.gen);
      const int taken = std::min(n_ids, c.index_slots);
      std::sort(pool.begin(), pool.begin() + taken);
      if (c.index_block_size > 1 && taken > 0) pool[taken - 1] = n_ids - 1;  // the last block may be partial
      int32_t* row_ids = &ids[(size_t(b) * c.index_heads + row) * c.index_slots];
      for (int s = 0; s < c.index_slots; ++s) row_ids[s] = s < taken ? pool[s] : -1;
    }
  }
  return ids;
}

// Per-element comparison over every row of every sequence; LSE when both sides have it. A row that sees no key
// (want's LSE −inf) must be exactly 0 (§0), whatever the tolerance.
void expect_close(const AttentionCase& c, const ref::Output& got, const ref::Output& want, double out_tol,
                  const char* who) {
  int64_t bad = 0, not_zero = 0;
  double worst = 0, worst_lse = 0;
  for (size_t b = 0; b < want.o.size(); ++b) {
    if (want.lse.size() > b) {
      const size_t hq = size_t(c.q_heads), d = size_t(c.head_dim), sq = want.o[b].size() / (hq * d);
      for (size_t h = 0; h < hq && want.lse[b].size() == hq * sq; ++h) {
        for (size_t i = 0; i < sq; ++i) {
          if (want.lse[b][h * sq + i] != -std::numeric_limits<double>::infinity()) continue;
          for (size_t e = 0; e < d; ++e) not_zero += got.o[b][(i * hq + h) * d + e] != 0.0;
        }
      }
    }
    for (size_t e = 0; e < want.o[b].size(); ++e) {
      const double err = std::fabs(got.o[b][e] - want.o[b][e]);
      if (!(err <= out_tol + c.tol.out_rel * std::fabs(want.o[b][e]))) ++bad;  // NaN counts as bad
      worst = std::max(worst, std::isnan(err) ? 1e30 : err);
    }
    if (!c.lse || want.lse.size() <= b || got.lse.size() <= b) continue;
    for (size_t e = 0; e < want.lse[b].size(); ++e) {
      const double g = got.lse[b][e], w = want.lse[b][e];
      if (std::isinf(w) || std::isinf(g)) {
        if (g != w) ++bad;
        continue;
      }
      const double err = std::fabs(g - w);
      if (!(err <= c.tol.lse_bound(w))) ++bad;
      worst_lse = std::max(worst_lse, std::isnan(err) ? 1e30 : err);
    }
  }
  EXPECT_EQ(bad, 0) << who << " " << c.name << ": max |out - want| = " << worst << " (tol " << out_tol
                    << "), max |lse - want| = " << worst_lse;
  EXPECT_EQ(not_zero, 0) << who << " " << c.name << ": elements of rows that see no key are not exactly 0";
}

// AttentionCase::needles: per sequence, `needles` candidate positions (between the sinks and the local window) whose
// keys, in every kv head, point along the sum of the group's query rows. Returns the positions per sequence.
std::vector<std::vector<int>> plant_needles(ref::Problem& p, const AttentionCase& c, Rng& rng) {
  std::vector<std::vector<int>> planted(p.B);
  const int g = p.group();
  for (int b = 0; b < p.B; ++b) {
    const int first = c.select_n_init, last = p.skv[b] - c.select_n_local;
    for (int n = 0; n < c.needles && last > first; ++n) {
      const int t = rng.integer(first, last - 1);
      planted[b].push_back(t);
      for (int hk = 0; hk < p.Hkv; ++hk) {
        std::vector<double> u(p.D, 0.0);
        for (int i = 0; i < p.sq[b]; ++i)
          for (int h = hk * g; h < (hk + 1) * g; ++h)
            for (int d = 0; d < p.D; ++d) u[d] += p.q_row(b, i, h)[d];
        const double norm = std::sqrt(ref::dot(u.data(), u.data(), p.D));
        for (int d = 0; d < p.D; ++d)
          p.k[b][(size_t(t) * p.Hkv + hk) * p.D + d] = kNeedleLength * std::sqrt(double(p.D)) * u[d] / norm;
      }
    }
  }
  return planted;
}

// §0 "Precision of selections" for TOKEN_SELECT off the CPU. The relative vote bound for sequence b: eps = 10E +
// 2^-16, E = score_scale · 2^-17 · max_h ‖q̄_h‖ · max_t ‖k_t‖, where the device scores in fp32 (fp16/bf16 keys in
// 16-byte aligned rows, head_dim a multiple of 8 up to 256): the bound of the tensor-core kernel
// (token_select_score_tc.cu), which also covers the FMA kernel's 2^-20 (token_select_score.cu); float64 scoring
// elsewhere agrees with the oracle to rounding (1e-12).
double select_vote_bound(const AttentionCase& c, const ref::Problem& p, int b) {
  const bool fp32_scores = c.dtype != SPARSA_DTYPE_F32 && c.kv_row_pad == 0 && c.kv_head_pad == 0 && p.D % 8 == 0 &&
                           p.D <= 256;
  if (!fp32_scores) return 1e-12;
  double max_q = 0.0, max_k = 0.0;
  for (int h = 0; h < p.Hq; ++h) {
    double norm = 0.0;
    for (int d = 0; d < p.D; ++d) {
      double mean = 0.0;
      for (int i = 0; i < p.sq[b]; ++i) mean += p.q_row(b, i, h)[d] / p.sq[b];
      norm += mean * mean;
    }
    max_q = std::max(max_q, std::sqrt(norm));
  }
  for (int t = 0; t < p.skv[b]; ++t)
    for (int hk = 0; hk < p.Hkv; ++hk) max_k = std::max(max_k, std::sqrt(ref::dot(p.k_row(b, t, hk), p.k_row(b, t, hk), p.D)));
  const double score_scale = c.select_scale_scores ? p.softmax_scale() : 1.0;
  return 10.0 * score_scale * std::ldexp(1.0, -17) * max_q * max_k + std::ldexp(1.0, -16);
}

struct SelectionAudit {
  int64_t decided = 0;        // decisions whose oracle vote is farther than eps from the k-th: must agree
  int64_t within_bound = 0;   // decisions inside eps: either way is correct
  int64_t disagreements = 0;  // decided ones the backend got wrong
};

// Every (sequence, set): a candidate that fewer than top_k others could outvote (by more than eps) is kept, one that
// at least top_k others outvote for certain is dropped, the rest may go either way.
SelectionAudit audit_selection(const AttentionCase& c, const ref::Problem& p, const ref::TokenSelectResult& oracle,
                               const std::vector<int32_t>& selected, int sets, int64_t cap) {
  SelectionAudit audit;
  for (int b = 0; b < p.B; ++b) {
    if (oracle.ran_dense[b]) continue;
    const double eps = select_vote_bound(c, p, b);
    const int first = c.select_n_init, last = p.skv[b] - c.select_n_local;
    for (int set = 0; set < sets; ++set) {
      const std::vector<double>& vote = oracle.vote[b][set];
      const int32_t* row = &selected[(size_t(b) * sets + set) * cap];
      std::vector<uint8_t> kept(vote.size(), 0);
      int64_t count = 0;
      for (int64_t j = 0; j < cap; ++j) {
        if (row[j] >= first && row[j] < last) {
          kept[row[j] - first] = 1;
          ++count;
        }
      }
      EXPECT_EQ(count, c.select_top_k) << c.name << ": b=" << b << " set=" << set << " keeps top_k candidates";
      std::vector<double> sorted = vote;
      std::sort(sorted.begin(), sorted.end());
      const auto at_least = [&](double x) { return int64_t(sorted.end() - std::lower_bound(sorted.begin(), sorted.end(), x)); };
      const auto above = [&](double x) { return int64_t(sorted.end() - std::upper_bound(sorted.begin(), sorted.end(), x)); };
      for (size_t j = 0; j < vote.size(); ++j) {
        const int64_t may_beat = at_least(vote[j] * (1 - eps) / (1 + eps)) - 1;  // others that could outvote j
        const int64_t sure_beat = above(vote[j] * (1 + eps) / (1 - eps));        // others that outvote j for certain
        if (may_beat < c.select_top_k || sure_beat >= c.select_top_k) {
          ++audit.decided;
          if (bool(kept[j]) != (may_beat < c.select_top_k)) ++audit.disagreements;
        } else {
          ++audit.within_bound;
        }
      }
    }
  }
  return audit;
}

using Sets = std::vector<std::vector<ref::IndexSet>>;  // [b][h]

// §0 "Precision of selections" for TOKEN_SPARSE: the relative bound eps for sequence b of token_sparse_score.cu's
// header, 8E + 2^-12 with E = scale · D · 2^-22 · max ‖q_r‖ (window rows) · max ‖k_j‖, where a device scores in
// fp32 (fp16/bf16, head_dim a multiple of 16 up to 128); float64 scoring agrees with the oracle to rounding.
double sparse_score_bound(const AttentionCase& c, const ref::Problem& p, int b, bool on_device) {
  const bool fp32_scores = on_device && c.dtype != SPARSA_DTYPE_F32 && p.D % 16 == 0 && p.D <= 128;
  if (!fp32_scores) return kFloat64SparseBound;
  const int L = p.sq[b];
  double max_q = 0.0, max_k = 0.0;
  for (int i = std::max(0, L - c.sparse_window); i < L; ++i)
    for (int h = 0; h < p.Hq; ++h)
      max_q = std::max(max_q, std::sqrt(ref::dot(p.q_row(b, i, h), p.q_row(b, i, h), p.D)));
  for (int t = 0; t < L; ++t)
    for (int hk = 0; hk < p.Hkv; ++hk)
      max_k = std::max(max_k, std::sqrt(ref::dot(p.k_row(b, t, hk), p.k_row(b, t, hk), p.D)));
  const double E = p.softmax_scale() * p.D * std::ldexp(1.0, -22) * max_q * max_k;
  return 8.0 * E + std::ldexp(1.0, -12);
}

// The backend's TOKEN_SPARSE sets from selected_indices [B, Hq, cap]: ascending ids below L, then -1 padding.
Sets sparse_sets(const AttentionCase& c, const ref::Problem& p, const std::vector<int32_t>& selected, int64_t cap) {
  Sets sets(p.B, std::vector<ref::IndexSet>(p.Hq));
  for (int b = 0; b < p.B; ++b) {
    for (int h = 0; h < p.Hq; ++h) {
      const int32_t* row = &selected[(size_t(b) * p.Hq + h) * cap];
      ref::IndexSet& set = sets[b][h];
      for (int64_t s = 0; s < cap && row[s] >= 0; ++s) {
        const bool ascending = set.empty() || row[s] > set.back();
        EXPECT_TRUE(row[s] < p.sq[b] && ascending) << c.name << ": b=" << b << " h=" << h << " slot " << s << " holds "
                                                   << row[s] << " (sets are ascending ids below L)";
        if (row[s] < p.sq[b] && ascending) set.push_back(row[s]);
      }
    }
  }
  return sets;
}

// Every (sequence, head) of the backend's sets against the oracle's scores: the window is kept, the budget is one the
// coverage count can give within eps, and every candidate whose score is farther than eps from the top-budget
// threshold is kept or dropped as the oracle does; a dense sequence keeps every row.
SelectionAudit audit_sparse_sets(const AttentionCase& c, const ref::Problem& p, const ref::TokenSparseResult& oracle,
                                 const Sets& sets, bool on_device) {
  SelectionAudit audit;
  const double tau = double(float(c.sparse_coverage));  // the value the library receives
  for (int b = 0; b < p.B; ++b) {
    const int L = p.sq[b], n = L - c.sparse_window;
    if (oracle.ran_dense[b]) {
      for (int h = 0; h < p.Hq; ++h) EXPECT_EQ(sets[b][h].size(), size_t(L)) << c.name << ": b=" << b << " runs dense";
      continue;
    }
    const double eps = sparse_score_bound(c, p, b, on_device);
    int count_lo = 0, count_hi = 0;  // coverage counts certainly reached / possibly reached
    for (double cum : oracle.cumsum[b]) {
      count_lo += cum * (1 + eps) < tau;
      count_hi += cum * (1 - eps) < tau;
    }
    audit.within_bound += count_hi - count_lo;
    audit.decided += n - (count_hi - count_lo);
    const auto budget_of = [&](int count) { return std::max(c.sparse_min_tokens, n - (count + (count > 0 ? 1 : 0))); };
    for (int h = 0; h < p.Hq; ++h) {
      std::vector<uint8_t> kept(L, 0);
      for (int t : sets[b][h]) kept[t] = 1;
      const int budget = int(std::count(kept.begin(), kept.begin() + n, uint8_t(1)));
      for (int t = n; t < L; ++t) EXPECT_TRUE(kept[t]) << c.name << ": b=" << b << " h=" << h << " window row " << t;
      EXPECT_GE(budget, budget_of(count_hi)) << c.name << ": b=" << b << " h=" << h << " budget below the bound";
      EXPECT_LE(budget, budget_of(count_lo)) << c.name << ": b=" << b << " h=" << h << " budget above the bound";
      const std::vector<double>& score = oracle.head_score[b][h];
      std::vector<double> sorted = score;
      std::sort(sorted.begin(), sorted.end());
      const auto at_least = [&](double x) {
        return int64_t(sorted.end() - std::lower_bound(sorted.begin(), sorted.end(), x));
      };
      const auto above = [&](double x) {
        return int64_t(sorted.end() - std::upper_bound(sorted.begin(), sorted.end(), x));
      };
      for (int j = 0; j < n; ++j) {
        const int64_t may_beat = at_least(score[j] * (1 - eps) / (1 + eps)) - 1;  // others that could rank above j
        const int64_t sure_beat = above(score[j] * (1 + eps) / (1 - eps));  // others that rank above j for certain
        const bool must_keep = may_beat < budget, must_drop = sure_beat >= budget;
        if (!must_keep && !must_drop) {
          ++audit.within_bound;
          continue;
        }
        ++audit.decided;
        if ((must_keep && !kept[j]) || (must_drop && kept[j])) ++audit.disagreements;
      }
    }
  }
  return audit;
}

// §5 steps 7-8 over the given sets (the oracle's attention, ref::attend): causal attention inside each head's
// compressed sequence, every other row exactly 0.
ref::Visibility sparse_visibility(const ref::Problem& p, const Sets& sets) {
  std::vector<std::vector<std::vector<uint8_t>>> member(p.B);
  for (int b = 0; b < p.B; ++b) {
    member[b].assign(p.Hq, std::vector<uint8_t>(p.sq[b], 0));
    for (int h = 0; h < p.Hq; ++h)
      for (int t : sets[b][h]) member[b][h][t] = 1;
  }
  return ref::make_visibility(p,
                              [&](int b, int h, int i, int j) { return member[b][h][i] && member[b][h][j] && j <= i; });
}

}  // namespace

double Tolerance::lse_bound(double want) const { return std::max(lse_floor, lse_abs + lse_rel * std::fabs(want)); }

double kernel_out_tolerance(int32_t dtype) {
  return dtype == SPARSA_DTYPE_F32 ? kKernelTolF32 : dtype == SPARSA_DTYPE_F16 ? kKernelTolF16 : kKernelTolBF16;
}

Tolerance prefill_tolerance(int32_t dtype) {
  Tolerance t;
  t.out = kernel_out_tolerance(dtype);
  t.out_vs_cpu = kCpuFactorPrefill * t.out;
  t.lse_abs = kLseAbs;
  t.lse_rel = kLseRelPrefill;
  return t;
}

Tolerance decode_tolerance(int32_t dtype) {
  Tolerance t;
  t.out = t.out_vs_cpu = kernel_out_tolerance(dtype);
  t.lse_floor = kLseAbs;
  t.lse_rel = kLseRelDecode;
  return t;
}

Tolerance delta_tolerance(int32_t dtype) {
  Tolerance t;
  t.out = dtype == SPARSA_DTYPE_F32 ? kDeltaTolF32 : dtype == SPARSA_DTYPE_F16 ? kDeltaTolF16 : kDeltaTolBF16;
  t.out_vs_cpu = t.out;
  return t;
}

Tolerance token_sparse_tolerance(int32_t dtype) {
  Tolerance t;
  t.out = t.out_vs_cpu = 2 * kernel_out_tolerance(dtype);
  t.lse_abs = kLseAbs;
  t.lse_rel = kLseRelPrefill;
  return t;
}

Tolerance select_tolerance(int32_t dtype) {
  Tolerance t;
  t.out = t.out_vs_cpu = t.out_rel = dtype == SPARSA_DTYPE_F32 ? kSelectTolF32 : kernel_out_tolerance(dtype);
  t.lse_abs = t.lse_rel = kSelectLse;
  return t;
}

Tolerance sparge_tolerance(int32_t dtype) {
  Tolerance t;
  t.out = t.out_vs_cpu = kernel_out_tolerance(dtype);
  t.lse_floor = t.lse_rel = kSpargeLse;
  return t;
}

AttentionCase sparge_row(std::string name, int32_t dtype) {
  constexpr int kBlock = 64;
  constexpr double kTheta = 0.3, kTau = 0.9;
  AttentionCase c;
  c.name = std::move(name);
  c.dtype = dtype;
  c.q_heads = 4;
  c.kv_heads = 2;
  c.seq_q = {512};
  c.seq_k = {512};
  c.is_causal = true;
  c.policy = SPARSA_POLICY_SPARGE;
  c.block_q = c.block_k = kBlock;
  c.sparge_predicts = true;
  c.sparge_theta = kTheta;
  c.sparge_tau = kTau;
  c.smooth = true;
  c.stats_vs_cpu = true;
  c.tol = sparge_tolerance(dtype);
  return c;
}

AttentionCase prefill_row(std::string name, int32_t dtype) {
  AttentionCase c;
  c.name = std::move(name);
  c.dtype = dtype;
  c.tol = prefill_tolerance(dtype);
  return c;
}

AttentionCase decode_row(std::string name, int32_t dtype) {
  AttentionCase c;
  c.name = std::move(name);
  c.dtype = dtype;
  c.q_heads = 8;
  c.kv_heads = 2;
  c.head_dim = 128;
  c.seq_q = {1};
  c.seq_k = {1000};
  c.is_causal = true;
  c.sink_tokens = 4;
  c.sink_window = 100;
  c.tol = decode_tolerance(dtype);
  return c;
}

AttentionCase delta_row(std::string name, int32_t dtype) {
  AttentionCase c;
  c.name = std::move(name);
  c.dtype = dtype;
  c.head_dim = 128;
  c.seq_q = {256};
  c.seq_k = {256};
  c.is_causal = true;
  c.lse = false;
  c.policy = SPARSA_POLICY_SINK_WINDOW;
  c.sink_tokens = 4;
  c.sink_window = 48;
  c.delta = true;
  c.stats_vs_cpu = true;
  c.tol = delta_tolerance(dtype);
  return c;
}

AttentionCase select_row(std::string name, int32_t dtype) {
  AttentionCase c;
  c.name = std::move(name);
  c.dtype = dtype;
  c.q_heads = 32;
  c.kv_heads = 8;
  c.head_dim = 128;
  c.seq_q = {1};
  c.seq_k = {3000};
  c.is_causal = true;
  c.policy = SPARSA_POLICY_TOKEN_SELECT;
  c.stats_vs_cpu = true;
  c.tol = select_tolerance(dtype);
  return c;
}

AttentionCase sparse_row(std::string name, int32_t dtype) {
  AttentionCase c;
  c.name = std::move(name);
  c.dtype = dtype;
  c.q_heads = 4;
  c.kv_heads = 2;
  c.seq_q = {512};
  c.seq_k = {512};
  c.is_causal = true;
  c.kv_lengths = false;
  c.policy = SPARSA_POLICY_TOKEN_SPARSE;
  c.stats_vs_cpu = true;
  c.tol = token_sparse_tolerance(dtype);
  return c;
}

void check_case(const Context& ctx, const AttentionCase& c, uint64_t seed) {
  Rng rng(seed);
  SCOPED_TRACE(::testing::Message() << c.name << ", rng seed " << seed);
  const int B = int(c.seq_q.size());
  ref::Problem p = make_problem(B, c.q_heads, c.kv_heads, c.head_dim, c.seq_q, c.seq_k, c.is_causal);
  p.query_offset = c.query_offsets;
  if (c.smooth) {
    plant_smooth_inputs(p, c, rng);  // instead of the pattern's values: SPARGE's long rows need no second fill
  } else {
    fill(p, c.pattern, rng);
  }
  if (c.sink_blocks) plant_sink_blocks(p, c.block_q, rng);
  for (auto& rows : p.q)
    for (double& x : rows) x *= c.q_scale;
  const std::vector<std::vector<int>> needles = plant_needles(p, c, rng);
  const bool token_sparse = c.policy == SPARSA_POLICY_TOKEN_SPARSE;
  std::vector<std::vector<std::vector<int>>> sparse_planted;  // [b][kv head]
  if (token_sparse) sparse_planted = plant_sparse_inputs(p, c, rng);
  round_in_place(p, c.dtype);  // the kernels read dtype-rounded inputs; so does the reference

  sparsa_policy policy = make_policy(c.policy);
  RunOptions opt;
  opt.dtype = c.dtype;
  opt.layout = c.layout;
  opt.q_packed = c.q_packed;
  opt.kv_packed = c.kv_packed;
  opt.page_size = c.page_size;
  opt.kv_row_pad = c.kv_row_pad;
  opt.kv_head_pad = c.kv_head_pad;
  opt.seq_lens_k = c.kv_lengths;
  opt.lse = c.lse;
  ref::Output want;
  ref::TokenIndicesResult indices_want;
  ref::SpargeResult sparge_want;
  std::vector<ref::SpargeParams> per_head;  // SPARGE's parameters per query head
  const bool sparge = c.policy == SPARSA_POLICY_SPARGE;
  ref::TokenSelectResult select_want;
  const bool token_select = c.policy == SPARSA_POLICY_TOKEN_SELECT;
  bool reference_decides = true;  // false: a selection too close to call, compared with the CPU backend only
  const bool token_indices = c.policy == SPARSA_POLICY_TOKEN_INDICES;
  ref::TokenSparseResult sparse_want;
  if (c.policy == SPARSA_POLICY_SINK_WINDOW) {
    policy.sink_tokens = c.sink_tokens;
    policy.sink_window = c.sink_window;
    want = ref::attend(p, ref::sink_window(p, c.sink_tokens, c.sink_window));
  } else if (c.policy == SPARSA_POLICY_BLOCK_SPARSE) {
    policy.block_q = c.block_q;
    policy.block_k = c.block_k;
    opt.block_mask = block_mask(c, p, rng);
    want = ref::attend(p, ref::block_sparse(p, c.block_q, c.block_k, opt.block_mask));
    if (c.mask_pattern == MaskPattern::kEmptyRows) {  // the pattern must empty some rows, or it tests nothing
      int64_t empty_rows = 0;
      for (const auto& lse : want.lse) empty_rows += std::count(lse.begin(), lse.end(), -ref::kInf);
      EXPECT_GT(empty_rows, 0) << c.name << ": no row sees nothing";
    }
  } else if (sparge) {
    policy.block_q = c.block_q;
    policy.block_k = c.block_k;
    ref::SpargeParams sp;
    sp.bq = c.block_q;
    sp.bk = c.block_k;
    if (c.sparge_predicts) {
      // The reference reads the float values the library reads.
      policy.sparge_theta = float(c.sparge_theta);
      policy.sparge_tau = float(c.sparge_tau);
      policy.sparge_topk_fraction = float(c.sparge_topk_fraction);
      policy.sparge_lambda = float(c.sparge_lambda);
      policy.sparge_attention_sink = c.sparge_attention_sink ? 1 : 0;
      sp.theta = policy.sparge_theta;
      sp.tau = policy.sparge_tau;
      sp.topk_fraction = policy.sparge_topk_fraction;
      sp.lambda = policy.sparge_lambda;
      sp.attention_sink = c.sparge_attention_sink;
      opt.block_mask_out = true;
      opt.sparge_head_params = c.sparge_head_params;
      per_head.assign(p.Hq, sp);
      for (size_t e = 0; e < c.sparge_head_params.size(); ++e) {  // [Hq, 4]: theta, tau, top-k fraction, λ
        const float x = c.sparge_head_params[e];
        if (std::isnan(x)) continue;
        ref::SpargeParams& hp = per_head[e / 4];
        (e % 4 == 0 ? hp.theta : e % 4 == 1 ? hp.tau : e % 4 == 2 ? hp.topk_fraction : hp.lambda) = x;
      }
    } else {
      policy.sparge_theta = 1.f;  // every block computed: only the λ test decides
      policy.sparge_lambda = float(c.sparge_lambda);
      sp.theta = ref::kInf;  // above any similarity: every block forced, as theta 1 gives the library (sim <= 1)
      sp.lambda = c.sparge_lambda;
      per_head.assign(p.Hq, sp);
    }
    sparge_want = ref::sparge(p, per_head);
    want = sparge_want.out;
    if (c.sparge_predicts) {
      reference_decides = sparge_want.topk_margin >= kSelectionMargin && sparge_want.theta_margin >= kSelectionMargin &&
                          sparge_want.tau_margin >= kSelectionMargin;
      if (!reference_decides) std::printf("[ note     ] %s: prediction too close to call, CPU backend only\n", c.name.c_str());
      // The prediction must drop cells and keep some, or the row tests no prediction.
      const int64_t kept = std::count(sparge_want.mask.begin(), sparge_want.mask.end(), uint8_t(1));
      std::printf("[ sparge   ] %s: %lld of %zu cells kept, %lld PV blocks skipped\n", c.name.c_str(),
                  static_cast<long long>(kept), sparge_want.mask.size(),
                  static_cast<long long>(sparge_want.pv_blocks_skipped));
      EXPECT_GT(kept, 0) << c.name;
      EXPECT_LT(size_t(kept), sparge_want.mask.size() / 2) << c.name << ": the prediction must drop cells";
    }
  } else if (token_select) {
    policy.select_n_init = c.select_n_init;
    policy.select_top_k = c.select_top_k;
    policy.select_n_local = c.select_n_local;
    policy.select_per_kv_head = c.select_per_kv_head ? 1 : 0;
    policy.select_scale_scores = c.select_scale_scores ? 1 : 0;
    ref::TokenSelectParams sp;
    sp.n_init = c.select_n_init;
    sp.top_k = c.select_top_k;
    sp.n_local = c.select_n_local;
    sp.per_kv_head = c.select_per_kv_head;
    sp.scale_scores = c.select_scale_scores;
    sp.cache_theta = policy.select_cache_theta;
    select_want = ref::token_select(p, sp, nullptr);
    opt.selected_sets = c.select_per_kv_head ? c.kv_heads : 1;
    opt.selected_cap = p.max_skv();
    want = select_want.out;
    reference_decides = select_want.topk_margin >= kSelectionMargin;
    if (!reference_decides) std::printf("[ note     ] %s: top-k vote too close to call, CPU backend only\n", c.name.c_str());
  } else if (token_sparse) {
    policy.token_sparse_window = c.sparse_window;
    policy.token_sparse_pool_kernel = c.sparse_pool;
    policy.token_sparse_min_tokens = c.sparse_min_tokens;
    policy.token_sparse_coverage = float(c.sparse_coverage);
    ref::TokenSparseParams tp;
    tp.window = c.sparse_window;
    tp.pool_kernel = c.sparse_pool;
    tp.min_tokens = c.sparse_min_tokens;
    tp.coverage = double(policy.token_sparse_coverage);
    sparse_want = ref::token_sparse(p, tp);
    opt.selected_sets = c.q_heads;
    opt.selected_cap = p.max_skv();
    want = sparse_want.out;
  } else if (token_indices) {
    ref::TokenIndicesParams tp;
    tp.h_idx = c.index_heads;
    tp.k = c.index_slots;
    const std::vector<int32_t> ids = random_indices(c, p, rng);
    tp.indices.assign(ids.begin(), ids.end());
    if (c.head_map)
      for (int h = 0; h < c.q_heads; ++h) tp.head_map.push_back((h * 3 + 1) % c.index_heads);
    tp.block_size = c.index_block_size;
    tp.n_init = c.index_n_init;
    tp.n_local = c.index_n_local;
    policy.index_block_size = c.index_block_size;
    policy.index_n_init = c.index_n_init;
    policy.index_n_local = c.index_n_local;
    opt.indices = ids;
    opt.h_idx = c.index_heads;
    opt.k = c.index_slots;
    opt.head_map.assign(tp.head_map.begin(), tp.head_map.end());
    opt.selected_sets = c.q_heads;
    opt.selected_cap = p.max_skv();
    indices_want = ref::token_indices(p, tp);
    want = indices_want.out;
  } else {
    want = ref::attend(p, ref::dense(p));
  }

  if (c.delta) {
    policy.flags |= SPARSA_POLICY_FLAG_DELTA;
    policy.delta_gamma = c.gamma;
    policy.delta_tail_min = c.tail_min;
    want = ref::delta(p, want, c.gamma, c.tail_min);
  }

  const RunResult r = run(ctx, p, policy, opt);
  expect_ok(r);
  if (r.status != SPARSA_STATUS_SUCCESS) return;
  const bool on_device = ctx.device_type() != SPARSA_DEVICE_CPU;
  bool own_selection = false;  // a device TOKEN_SELECT chose other sets than the oracle, inside the §0 bound
  if (token_select && on_device) {
    // §0: decisions outside the bound agree with the oracle; the output is the oracle's attention over the
    // device's own sets. This replaces the margin rule above off the CPU.
    const SelectionAudit audit = audit_selection(c, p, select_want, r.selected, opt.selected_sets, opt.selected_cap);
    std::printf("[ AUDIT    ] %s: %lld decisions outside the bound, %lld inside\n", c.name.c_str(),
                static_cast<long long>(audit.decided), static_cast<long long>(audit.within_bound));
    EXPECT_EQ(audit.disagreements, 0) << c.name << ": decisions outside the bound differ from the oracle";
    if (std::count(select_want.ran_dense.begin(), select_want.ran_dense.end(), false) > 0) {
      EXPECT_GT(audit.decided, 0) << c.name << ": no decision outside the bound";
    }
    if (c.decisions_inside_bound) {
      EXPECT_GT(audit.within_bound, 0) << c.name << ": no decision inside the bound";
    }
    own_selection = !sets_equal(r.selected, opt.selected_cap, select_want.selected);
    if (own_selection) {
      ref::TokenIndicesParams own;
      own.h_idx = opt.selected_sets;
      own.k = int(opt.selected_cap);
      own.indices.assign(r.selected.begin(), r.selected.end());
      want = ref::token_indices(p, own).out;
    }
    reference_decides = true;
  }
  if (token_sparse) {
    // §0 on every backend (the CPU's float64 scores within rounding of the oracle's): decisions outside the bound
    // agree with the oracle, the output is the oracle's attention over the backend's own sets.
    const Sets sets = sparse_sets(c, p, r.selected, opt.selected_cap);
    const SelectionAudit audit = audit_sparse_sets(c, p, sparse_want, sets, on_device);
    std::printf("[ AUDIT    ] %s: %lld decisions outside the bound, %lld inside\n", c.name.c_str(),
                static_cast<long long>(audit.decided), static_cast<long long>(audit.within_bound));
    EXPECT_EQ(audit.disagreements, 0) << c.name << ": decisions outside the bound differ from the oracle";
    if (c.rows_dropped) EXPECT_GT(audit.decided, 0) << c.name << ": no decision outside the bound";
    if (c.decisions_inside_bound) EXPECT_GT(audit.within_bound, 0) << c.name << ": no decision inside the bound";
    int64_t dropped = 0;
    for (int b = 0; b < p.B; ++b) {
      for (int h = 0; h < p.Hq; ++h) {
        const ref::IndexSet& set = sets[b][h];
        dropped += p.sq[b] - int64_t(set.size());
        for (int t : sparse_planted[b][h / p.group()]) {
          EXPECT_TRUE(std::binary_search(set.begin(), set.end(), t))
              << c.name << ": planted key " << t << " of b=" << b << " dropped by head " << h;
        }
      }
    }
    EXPECT_EQ(dropped > 0, c.rows_dropped) << c.name << ": " << dropped << " rows dropped";
    int64_t pairs = sparse_want.pairs_computed;
    if (sets != sparse_want.selected) {
      const ref::Visibility own = sparse_visibility(p, sets);
      want = ref::attend(p, own);
      pairs = ref::count_pairs(own);
    }
    EXPECT_EQ(r.stats[SPARSA_STAT_PAIRS_COMPUTED], pairs) << "pairs of the backend's own sets";
    EXPECT_EQ(r.stats[SPARSA_STAT_PAIRS_DENSE], ref::dense_pairs(p));
  }
  if (reference_decides) expect_close(c, r.out, want, c.tol.out, "vs the float64 reference:");
  if (token_select) {
    if (reference_decides && !own_selection) {
      EXPECT_TRUE(sets_equal(r.selected, opt.selected_cap, select_want.selected));
    }
    if (reference_decides) EXPECT_EQ(r.stats[SPARSA_STAT_PAIRS_COMPUTED], select_want.pairs_computed);
    for (int b = 0; b < p.B && c.needles <= c.select_top_k; ++b)  // every set selects the planted keys
      for (int needle : needles[b])
        for (int set = 0; set < opt.selected_sets; ++set) {
          const int32_t* row = &r.selected[(size_t(b) * opt.selected_sets + set) * opt.selected_cap];
          EXPECT_TRUE(std::find(row, row + opt.selected_cap, needle) != row + opt.selected_cap)
              << "needle " << needle << " of sequence " << b << ", set " << set;
        }
  }
  if (sparge && c.sparge_predicts) {
    if (reference_decides) {
      EXPECT_EQ(r.block_mask, sparge_want.mask) << "predicted mask";
      EXPECT_EQ(r.stats[SPARSA_STAT_PV_BLOCKS_SKIPPED], sparge_want.pv_blocks_skipped);
    }
    const bool any_lambda = std::any_of(per_head.begin(), per_head.end(),
                                        [](const ref::SpargeParams& hp) { return hp.lambda > -ref::kInf; });
    // A row with λ must skip PV blocks, or it tests no skip.
    if (any_lambda) EXPECT_GT(sparge_want.pv_blocks_skipped, 0) << "inputs";
  } else if (sparge) {
    EXPECT_EQ(r.stats[SPARSA_STAT_PV_BLOCKS_SKIPPED], sparge_want.pv_blocks_skipped);
    // The row's inputs must make λ skip some blocks and keep others.
    EXPECT_GT(sparge_want.pv_blocks_skipped, 0) << "inputs";
    EXPECT_LT(sparge_want.pv_blocks_skipped, sparge_want.blocks_computed) << "inputs";
  }
  if (token_indices) {
    EXPECT_TRUE(sets_equal(r.selected, opt.selected_cap, indices_want.selected));
    EXPECT_EQ(r.stats[SPARSA_STAT_PAIRS_COMPUTED], indices_want.pairs_computed);
  }
  if (ctx.device_type() == SPARSA_DEVICE_CPU) return;
  // The same inputs on the CPU backend, the project's reference implementation.
  const Context cpu(SPARSA_DEVICE_CPU);
  const RunResult on_cpu = run(cpu, p, policy, opt);
  expect_ok(on_cpu);
  if (on_cpu.status != SPARSA_STATUS_SUCCESS) return;
  if (token_sparse) {  // whatever the sets, the backends count the same dense pairs and blocks
    for (int stat : {SPARSA_STAT_PAIRS_DENSE, SPARSA_STAT_BLOCKS_COMPUTED})
      EXPECT_EQ(r.stats[stat], on_cpu.stats[stat]) << "stat " << stat;
  }
  if ((token_select || token_sparse) && r.selected != on_cpu.selected) {
    std::printf("[ note     ] %s: sets differ from the CPU backend's inside the §0 bound (audited above)\n",
                c.name.c_str());
    return;
  }
  expect_close(c, r.out, on_cpu.out, c.tol.out_vs_cpu, "vs the CPU backend:");
  if (token_indices || c.stats_vs_cpu) {
    EXPECT_EQ(r.stats, on_cpu.stats) << "stats";
  }
  if (sparge) {
    EXPECT_EQ(r.stats[SPARSA_STAT_PV_BLOCKS_SKIPPED], on_cpu.stats[SPARSA_STAT_PV_BLOCKS_SKIPPED]);
    EXPECT_EQ(r.block_mask, on_cpu.block_mask) << "predicted mask";
  }
  if (token_indices || token_select || token_sparse) {
    EXPECT_EQ(r.selected, on_cpu.selected) << "selected_indices";
  }
}

}  // namespace st
