// SPARGE block-mask prediction (§4 steps 1–6) for one (sequence b, query head h), in float64.
//
// Memory is O((nqb + nkb) · D + nkb) per call — block statistics, never token pairs. The mask covers this
// sequence only: [ceil(Sq_b / block_q), ceil(Skv_b / block_k)] with row stride ceil(Skv_b / block_k), where Sq_b and
// Skv_b are the sequence's own lengths (problem.seq_len_q(b), seq_len_k(b)).
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#include "attention_loop.h"
#include "cpu_select_util.h"

namespace sparsa::cpu {
namespace {

constexpr double kNegInf = -std::numeric_limits<double>::infinity();

// Number of columns of the per-head override tensor sparge_head_params [Hq, 4].
constexpr int kHeadParamColumns = 4;

int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

// Running sums of one block of rows: Σ x_a (for the block mean) and Σ x_a/‖x_a‖ (for the self-similarity).
struct BlockSums {
  std::vector<double> sum;
  std::vector<double> unit_sum;
  void clear(int32_t d) {
    sum.assign(size_t(d), 0.0);
    unit_sum.assign(size_t(d), 0.0);
  }
  // Adds row x (float64, length d). A zero row adds a zero unit vector (§4.3).
  void add(const double* x, int32_t d) {
    double norm_sq = 0.0;
    for (int32_t i = 0; i < d; ++i) norm_sq += x[i] * x[i];
    const double inv_norm = norm_sq > 0.0 ? 1.0 / std::sqrt(norm_sq) : 0.0;
    for (int32_t i = 0; i < d; ++i) {
      sum[size_t(i)] += x[i];
      unit_sum[size_t(i)] += x[i] * inv_norm;
    }
  }
  // sim(X) = ‖Σ x_a/‖x_a‖‖² / n², clamped to [0, 1] (rounding may leave it a hair outside).
  double similarity(int64_t n_rows) const {
    double norm_sq = 0.0;
    for (double u : unit_sum) norm_sq += u * u;
    const double sim = norm_sq / (double(n_rows) * double(n_rows));
    return std::min(1.0, std::max(0.0, sim));
  }
};

// Key block J is causally visible to query block I iff its first key J·bk is <= the last row of I plus the
// bottom-right offset (§0): otherwise no key of J is visible to any row of I.
bool key_block_visible(bool causal, int64_t key_block, int64_t block_k, int64_t last_row, int64_t offset) {
  return !causal || key_block * block_k <= last_row + offset;
}

}  // namespace

SpargeHeadParams sparge_head_params(const PolicyParams& policy, int32_t h) {
  SpargeHeadParams params{policy.p.sparge_theta, policy.p.sparge_tau, policy.p.sparge_topk_fraction,
                          policy.p.sparge_lambda};
  if (!policy.sparge_head_params.present) return params;
  const TensorArg& table = policy.sparge_head_params;
  const float* row = table.ptr<const float>() + h * table.stride(0);
  double* fields[kHeadParamColumns] = {&params.theta, &params.tau, &params.topk_fraction, &params.lambda};
  for (int c = 0; c < kHeadParamColumns; ++c) {
    const float value = row[c * table.stride(1)];
    if (!std::isnan(value)) *fields[c] = value;  // NaN falls back to the scalar field
  }
  return params;
}

void sparge_predict_mask(const AttentionProblem& problem, const PolicyParams& policy, int32_t b, int32_t h,
                         uint8_t* mask) {
  const int32_t d = problem.head_dim;
  const int32_t hk = kv_head_of(problem, h);
  const int64_t seq_q = problem.seq_len_q(b);
  const int64_t seq_k = problem.seq_len_k(b);
  const int64_t block_q = policy.p.block_q;
  const int64_t block_k = policy.p.block_k;
  const int64_t n_query_blocks = ceil_div(seq_q, block_q);
  const int64_t n_key_blocks = ceil_div(seq_k, block_k);
  const int64_t causal_offset = seq_k - seq_q;
  const bool causal = problem.causal;
  const SpargeHeadParams params = sparge_head_params(policy, h);
  if (n_query_blocks == 0 || n_key_blocks == 0) return;
  std::fill(mask, mask + n_query_blocks * n_key_blocks, uint8_t{0});

  std::vector<float> row_f32(static_cast<size_t>(d));
  std::vector<double> row_f64(static_cast<size_t>(d));
  const auto load_key = [&](int64_t t) {
    load_row_f32(problem.dtype, problem.k.t.data, problem.kv_offset(problem.k, b, t, hk), d, row_f32.data());
  };

  // Step 1: the mean of K over every token of the sequence (this kv head); the prediction uses centred keys.
  std::vector<double> key_mean(size_t(d), 0.0);
  for (int64_t t = 0; t < seq_k; ++t) {
    load_key(t);
    for (int32_t i = 0; i < d; ++i) key_mean[size_t(i)] += row_f32[size_t(i)];
  }
  for (double& m : key_mean) m /= double(seq_k);

  // Steps 2–3 for key blocks: mean of the centred rows (tail block over its real rows) and self-similarity.
  std::vector<double> key_block_means(size_t(n_key_blocks) * size_t(d));
  std::vector<uint8_t> key_self_similar(static_cast<size_t>(n_key_blocks));
  BlockSums sums;
  for (int64_t j = 0; j < n_key_blocks; ++j) {
    const int64_t first = j * block_k;
    const int64_t n_rows = std::min(block_k, seq_k - first);
    sums.clear(d);
    for (int64_t t = first; t < first + n_rows; ++t) {
      load_key(t);
      for (int32_t i = 0; i < d; ++i) row_f64[size_t(i)] = double(row_f32[size_t(i)]) - key_mean[size_t(i)];
      sums.add(row_f64.data(), d);
    }
    for (int32_t i = 0; i < d; ++i) key_block_means[size_t(j * d + i)] = sums.sum[size_t(i)] / double(n_rows);
    key_self_similar[size_t(j)] = sums.similarity(n_rows) > params.theta;
  }

  std::vector<double> query_mean(static_cast<size_t>(d));
  std::vector<double> block_scores(static_cast<size_t>(n_key_blocks));
  std::vector<int64_t> rank_order(static_cast<size_t>(n_key_blocks));
  for (int64_t qi = 0; qi < n_query_blocks; ++qi) {
    const int64_t first_row = qi * block_q;
    const int64_t n_rows = std::min(block_q, seq_q - first_row);
    const int64_t last_row = first_row + n_rows - 1;
    uint8_t* mask_row = mask + qi * n_key_blocks;

    // Steps 2–3 for this query block (raw, uncentred Q).
    sums.clear(d);
    for (int64_t i = first_row; i <= last_row; ++i) {
      load_row_f32(problem.dtype, problem.q.t.data, problem.q_offset(problem.q, b, i, h), d, row_f32.data());
      for (int32_t c = 0; c < d; ++c) row_f64[size_t(c)] = row_f32[size_t(c)];
      sums.add(row_f64.data(), d);
    }
    for (int32_t c = 0; c < d; ++c) query_mean[size_t(c)] = sums.sum[size_t(c)] / double(n_rows);
    const bool query_self_similar = sums.similarity(n_rows) > params.theta;

    // Step 4: Ŝ[I, :] with -inf for non-self-similar key blocks and causally invisible ones, then P̂ = softmax.
    double row_max = kNegInf;
    for (int64_t j = 0; j < n_key_blocks; ++j) {
      double score = kNegInf;
      if (key_self_similar[size_t(j)] && key_block_visible(causal, j, block_k, last_row, causal_offset)) {
        double dot = 0.0;
        const double* key_block_mean = key_block_means.data() + j * d;
        for (int32_t c = 0; c < d; ++c) dot += query_mean[size_t(c)] * key_block_mean[c];
        score = double(problem.scale) * dot;
      }
      block_scores[size_t(j)] = score;
      row_max = std::max(row_max, score);
    }

    // Step 5: TopCdf or top-k over P̂. A row whose Ŝ is all -inf has no distribution: it keeps nothing here and
    // gets only its forced blocks below.
    if (row_max != kNegInf) {
      double total = 0.0;
      for (double& s : block_scores) {
        s = std::exp(s - row_max);
        total += s;
      }
      for (double& s : block_scores) s /= total;
      for (int64_t j = 0; j < n_key_blocks; ++j) rank_order[size_t(j)] = j;
      std::sort(rank_order.begin(), rank_order.end(), [&](int64_t a, int64_t c) {
        return ranks_before(block_scores[size_t(a)], a, block_scores[size_t(c)], c);
      });
      int64_t n_kept = 0;
      if (params.topk_fraction > 0.0) {
        n_kept = int64_t(std::floor(params.topk_fraction * double(n_key_blocks)));
      } else {
        double cumulative = 0.0;
        for (int64_t r = 0; r < n_key_blocks; ++r) {
          cumulative += block_scores[size_t(rank_order[size_t(r)])];
          if (cumulative > params.tau) break;  // the cumulative sum only grows: the kept blocks are a prefix
          n_kept = r + 1;
        }
      }
      n_kept = std::min(n_key_blocks, std::max<int64_t>(1, n_kept));
      for (int64_t r = 0; r < n_kept; ++r) mask_row[rank_order[size_t(r)]] = 1;
    }

    // Step 6: forced columns (non-self-similar key blocks), forced rows (non-self-similar query block), the
    // attention-sink column, then ∧ causal (a block with no visible key is dropped).
    for (int64_t j = 0; j < n_key_blocks; ++j) {
      if (!key_self_similar[size_t(j)] || !query_self_similar) mask_row[j] = 1;
    }
    if (policy.p.sparge_attention_sink) mask_row[0] = 1;
    for (int64_t j = 0; j < n_key_blocks; ++j) {
      if (!key_block_visible(causal, j, block_k, last_row, causal_offset)) mask_row[j] = 0;
    }
  }
}

}  // namespace sparsa::cpu
