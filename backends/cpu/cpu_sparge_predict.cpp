// SPARGE block-mask prediction (§4 steps 1–6) for one (sequence b, query head h), in float64.
//
// Memory is O((nqb + nkb) · D + nkb) per call — block statistics, never token pairs. The mask covers this
// sequence only: [ceil(Sq_b / block_q), ceil(Skv_b / block_k)] with row stride ceil(Skv_b / block_k), where Sq_b and
// Skv_b are the sequence's own lengths (problem.seq_len_q(b), seq_len_k(b)).
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>

#include "attention_loop.h"
#include "cpu_select_util.h"

namespace sparsa::cpu {
namespace {

constexpr double kNegInf = -std::numeric_limits<double>::infinity();

// Number of columns of the per-head override tensor sparge_head_params [Hq, 4].
constexpr int kHeadParamColumns = 4;

int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

// Running sums of one block of rows: Σ x_a (for the block mean) and Σ x_a/‖x_a‖ (for the self-similarity).
// The two d-long arrays live in the caller's scratch.
struct BlockSums {
  double* sum = nullptr;
  double* unit_sum = nullptr;
  int32_t d = 0;
  void clear() {
    std::fill(sum, sum + d, 0.0);
    std::fill(unit_sum, unit_sum + d, 0.0);
  }
  // Adds row x (float64, length d). A zero row adds a zero unit vector (§4.3).
  void add(const double* x, int32_t d) {
    double norm_sq = 0.0;
    for (int32_t i = 0; i < d; ++i) norm_sq += x[i] * x[i];
    const double inv_norm = norm_sq > 0.0 ? 1.0 / std::sqrt(norm_sq) : 0.0;
    for (int32_t i = 0; i < d; ++i) {
      sum[i] += x[i];
      unit_sum[i] += x[i] * inv_norm;
    }
  }
  // sim(X) = ‖Σ x_a/‖x_a‖‖² / n², clamped to [0, 1] (rounding may leave it a hair outside).
  double similarity(int64_t n_rows) const {
    double norm_sq = 0.0;
    for (int32_t i = 0; i < d; ++i) norm_sq += unit_sum[i] * unit_sum[i];
    const double sim = norm_sq / (double(n_rows) * double(n_rows));
    return std::min(1.0, std::max(0.0, sim));
  }
};

// Key block J is causally visible to query block I iff its first key J·bk is <= the last row of I plus the
// bottom-right offset (§0): otherwise no key of J is visible to any row of I.
bool key_block_visible(bool causal, int64_t key_block, int64_t block_k, int64_t last_row, int64_t offset) {
  return !causal || key_block * block_k <= last_row + offset;
}

// The working arrays of one prediction, in the caller's scratch: rows and d-long sums, then per key block its
// centred mean, self-similarity flag, score and rank.
struct PredictArrays {
  ScratchLayout layout;
  size_t row_f32_at, row_f64_at, key_mean_at, sum_at, unit_sum_at, query_mean_at;
  size_t block_means_at, similar_at, block_scores_at, rank_order_at;
  PredictArrays(int32_t d, int64_t n_key_blocks) {
    const size_t dim = size_t(d);
    const size_t n_blocks = size_t(n_key_blocks);
    row_f32_at = layout.add<float>(dim);
    row_f64_at = layout.add<double>(dim);
    key_mean_at = layout.add<double>(dim);
    sum_at = layout.add<double>(dim);
    unit_sum_at = layout.add<double>(dim);
    query_mean_at = layout.add<double>(dim);
    block_means_at = layout.add<double>(n_blocks * dim);
    similar_at = layout.add<uint8_t>(n_blocks);
    block_scores_at = layout.add<double>(n_blocks);
    rank_order_at = layout.add<int64_t>(n_blocks);
  }
};

}  // namespace

size_t sparge_predict_scratch_floats(int32_t head_dim, int64_t n_key_blocks) {
  return PredictArrays(head_dim, n_key_blocks).layout.floats();
}

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
                         uint8_t* mask, ThreadScratch& scratch) {
  const int32_t d = problem.head_dim;
  const int32_t hk = kv_head_of(problem, h);
  const int64_t seq_q = problem.seq_len_q(b);
  const int64_t seq_k = problem.seq_len_k(b);
  const int64_t block_q = policy.p.block_q;
  const int64_t block_k = policy.p.block_k;
  const int64_t n_query_blocks = ceil_div(seq_q, block_q);
  const int64_t n_key_blocks = ceil_div(seq_k, block_k);
  const int64_t causal_offset = problem.causal_offset(b);
  const bool causal = problem.causal;
  const SpargeHeadParams params = sparge_head_params(policy, h);
  if (n_query_blocks == 0 || n_key_blocks == 0) return;
  std::fill(mask, mask + n_query_blocks * n_key_blocks, uint8_t{0});

  // Every array lives in the caller's scratch (grown once, reused run after run).
  const size_t dim = size_t(d);
  const size_t n_blocks = size_t(n_key_blocks);
  PredictArrays arrays(d, n_key_blocks);
  const ScratchLayout& layout = arrays.layout;
  arrays.layout.bind(scratch);
  float* row_f32 = layout.get<float>(arrays.row_f32_at, dim);
  double* row_f64 = layout.get<double>(arrays.row_f64_at, dim);
  double* key_mean = layout.get<double>(arrays.key_mean_at, dim);
  BlockSums sums{layout.get<double>(arrays.sum_at, dim), layout.get<double>(arrays.unit_sum_at, dim), d};
  double* query_mean = layout.get<double>(arrays.query_mean_at, dim);
  double* key_block_means = layout.get<double>(arrays.block_means_at, n_blocks * dim);
  uint8_t* key_self_similar = layout.get<uint8_t>(arrays.similar_at, n_blocks);
  double* block_scores = layout.get<double>(arrays.block_scores_at, n_blocks);
  int64_t* rank_order = layout.get<int64_t>(arrays.rank_order_at, n_blocks);
  const auto load_key = [&](int64_t t) {
    load_row_f32(problem.dtype, problem.k.t.data, problem.kv_offset(problem.k, b, t, hk), d, row_f32);
  };

  // Step 1: the mean of K over every token of the sequence (this kv head); the prediction uses centred keys.
  std::fill(key_mean, key_mean + d, 0.0);
  for (int64_t t = 0; t < seq_k; ++t) {
    load_key(t);
    for (int32_t i = 0; i < d; ++i) key_mean[i] += row_f32[i];
  }
  for (int32_t i = 0; i < d; ++i) key_mean[i] /= double(seq_k);

  // Steps 2–3 for key blocks: mean of the centred rows (tail block over its real rows) and self-similarity.
  for (int64_t j = 0; j < n_key_blocks; ++j) {
    const int64_t first = j * block_k;
    const int64_t n_rows = std::min(block_k, seq_k - first);
    sums.clear();
    for (int64_t t = first; t < first + n_rows; ++t) {
      load_key(t);
      for (int32_t i = 0; i < d; ++i) row_f64[i] = double(row_f32[i]) - key_mean[i];
      sums.add(row_f64, d);
    }
    for (int32_t i = 0; i < d; ++i) key_block_means[j * d + i] = sums.sum[i] / double(n_rows);
    key_self_similar[j] = sums.similarity(n_rows) > params.theta;
  }

  for (int64_t qi = 0; qi < n_query_blocks; ++qi) {
    const int64_t first_row = qi * block_q;
    const int64_t n_rows = std::min(block_q, seq_q - first_row);
    const int64_t last_row = first_row + n_rows - 1;
    uint8_t* mask_row = mask + qi * n_key_blocks;

    // Steps 2–3 for this query block (raw, uncentred Q).
    sums.clear();
    for (int64_t i = first_row; i <= last_row; ++i) {
      load_row_f32(problem.dtype, problem.q.t.data, problem.q_offset(problem.q, b, i, h), d, row_f32);
      for (int32_t c = 0; c < d; ++c) row_f64[c] = row_f32[c];
      sums.add(row_f64, d);
    }
    for (int32_t c = 0; c < d; ++c) query_mean[c] = sums.sum[c] / double(n_rows);
    const bool query_self_similar = sums.similarity(n_rows) > params.theta;

    // Step 4: Ŝ[I, :] with -inf for non-self-similar key blocks and causally invisible ones, then P̂ = softmax.
    double row_max = kNegInf;
    for (int64_t j = 0; j < n_key_blocks; ++j) {
      double score = kNegInf;
      if (key_self_similar[j] && key_block_visible(causal, j, block_k, last_row, causal_offset)) {
        double dot = 0.0;
        const double* key_block_mean = key_block_means + j * d;
        for (int32_t c = 0; c < d; ++c) dot += query_mean[c] * key_block_mean[c];
        score = double(problem.scale) * dot;
      }
      block_scores[j] = score;
      row_max = std::max(row_max, score);
    }

    // Step 5: TopCdf or top-k over P̂. A row whose Ŝ is all -inf has no distribution: it keeps nothing here and
    // gets only its forced blocks below.
    if (row_max != kNegInf) {
      double total = 0.0;
      for (int64_t j = 0; j < n_key_blocks; ++j) {
        block_scores[j] = std::exp(block_scores[j] - row_max);
        total += block_scores[j];
      }
      for (int64_t j = 0; j < n_key_blocks; ++j) block_scores[j] /= total;
      for (int64_t j = 0; j < n_key_blocks; ++j) rank_order[j] = j;
      std::sort(rank_order, rank_order + n_key_blocks, [&](int64_t a, int64_t c) {
        return ranks_before(block_scores[a], a, block_scores[c], c);
      });
      int64_t n_kept = 0;
      if (params.topk_fraction > 0.0) {
        n_kept = int64_t(std::floor(params.topk_fraction * double(n_key_blocks)));
      } else if (params.tau >= 1.0) {
        // The exact cumulative sum of P̂ never exceeds 1, so every block is kept; summed in floating point it can
        // overshoot by an ulp and would drop the smallest blocks.
        n_kept = n_key_blocks;
      } else {
        double cumulative = 0.0;
        for (int64_t r = 0; r < n_key_blocks; ++r) {
          cumulative += block_scores[rank_order[r]];
          if (cumulative > params.tau) break;  // the cumulative sum only grows: the kept blocks are a prefix
          n_kept = r + 1;
        }
      }
      n_kept = std::min(n_key_blocks, std::max<int64_t>(1, n_kept));
      for (int64_t r = 0; r < n_kept; ++r) mask_row[rank_order[r]] = 1;
    }

    // Step 6: forced columns (non-self-similar key blocks), forced rows (non-self-similar query block), the
    // attention-sink column, then ∧ causal (a block with no visible key is dropped).
    for (int64_t j = 0; j < n_key_blocks; ++j) {
      if (!key_self_similar[j] || !query_self_similar) mask_row[j] = 1;
    }
    if (policy.p.sparge_attention_sink) mask_row[0] = 1;
    for (int64_t j = 0; j < n_key_blocks; ++j) {
      if (!key_block_visible(causal, j, block_k, last_row, causal_offset)) mask_row[j] = 0;
    }
  }
}

}  // namespace sparsa::cpu
