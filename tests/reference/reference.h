// Float64 brute-force reference of ALGORITHMS.md (the spec), written from the spec and the public header only.
// It is the independent oracle of the test suite: straightforward loops, O(N²) memory, speed irrelevant.
//
// Layout of every per-sequence array (no padding, no strides):
//   q[b]   [sq[b],  Hq,  D]      k[b], v[b]  [skv[b], Hkv, D]
//   o[b]   [sq[b],  Hq,  D]      lse[b]      [Hq, sq[b]]
// Section numbers (§n) are those of ALGORITHMS.md.
#pragma once

#include <cstdint>
#include <functional>
#include <limits>
#include <vector>

namespace ref {

constexpr double kInf = std::numeric_limits<double>::infinity();

using Rows = std::vector<double>;
using IndexSet = std::vector<int>;  // sorted ascending, unique

struct Problem {
  int B = 1, Hq = 1, Hkv = 1, D = 64;
  std::vector<int> sq, skv;  // per sequence
  std::vector<Rows> q, k, v;
  bool causal = false;
  double scale = 0;  // 0 = 1/sqrt(D) (§0)
  std::vector<int> query_offset;  // §0's o per sequence when the run sets args.query_offsets; empty = skv - sq

  // §0's o: row i of sequence b is aligned with key i + o(b).
  int o(int b) const { return query_offset.empty() ? skv[b] - sq[b] : query_offset[b]; }

  double softmax_scale() const;
  int group() const { return Hq / Hkv; }
  const double* q_row(int b, int i, int h) const { return &q[b][(size_t(i) * Hq + h) * D]; }
  const double* k_row(int b, int j, int kv_head) const { return &k[b][(size_t(j) * Hkv + kv_head) * D]; }
  const double* v_row(int b, int j, int kv_head) const { return &v[b][(size_t(j) * Hkv + kv_head) * D]; }
  // S_ij = scale · q_i·k_j with query head h reading kv head h / g.
  double score(int b, int h, int i, int j) const;
  // Allocates q/k/v (zeros) for the current B/Hq/Hkv/D/sq/skv.
  void allocate();
  int max_sq() const;
  int max_skv() const;
};

struct Output {
  std::vector<Rows> o;    // [b][sq, Hq, D]
  std::vector<Rows> lse;  // [b][Hq, sq]
  double& at(int b, int i, int h, int d, int Hq, int D) { return o[b][(size_t(i) * Hq + h) * D + d]; }
};

// Visibility per (b, h): vis[b][h][i * skv + j] = 1 when row i attends to key j.
using Visibility = std::vector<std::vector<std::vector<uint8_t>>>;

double dot(const double* a, const double* b, int n);
// §0 causal alignment: row i sees key j iff j <= i + o.
inline bool causal_allowed(int i, int j, int o) { return j <= i + o; }

Visibility make_visibility(const Problem& p, const std::function<bool(int b, int h, int i, int j)>& visible);
// softmax(S)·V and LSE over the visible keys; a row with no visible key gets 0 and LSE -inf (§0).
Output attend(const Problem& p, const Visibility& vis);
// The number of visible (b, h, i, j) pairs.
int64_t count_pairs(const Visibility& vis);

// §1
Visibility dense(const Problem& p);
// Pairs dense attention with the problem's causal flag would compute (SPARSA_STAT_PAIRS_DENSE).
int64_t dense_pairs(const Problem& p);
// §2
Visibility sink_window(const Problem& p, int n_sink, int window);

// §3. mask: uint8 [B, Hq, ceil(max_sq/bq), ceil(max_skv/bk)].
Visibility block_sparse(const Problem& p, int bq, int bk, const std::vector<uint8_t>& mask);
struct BlockCounts {
  int64_t computed = 0;  // mask tiles that hold at least one causal-allowed pair
  int64_t total = 0;     // tiles dense attention would compute
};
BlockCounts block_counts(const Problem& p, int bq, int bk, const std::vector<uint8_t>& mask);
// Block-level causal test: key block J holds a key visible to the last row of query block I.
bool block_causal_allowed(const Problem& p, int b, int I, int J, int bq, int bk);

// §4 SPARGE.
struct SpargeParams {
  int bq = 128, bk = 64;
  double theta = 0.6, tau = 0.98, topk_fraction = 0, lambda = -kInf;
  bool attention_sink = false, quantized = false;
};
struct SpargeResult {
  int nqb = 0, nkb = 0;
  std::vector<uint8_t> mask;     // [B, Hq, nqb, nkb], after forced rows/columns and causal pruning
  std::vector<double> q_sim;     // [B, Hq, nqb] sim of each query block
  std::vector<double> k_sim;     // [B, Hkv, nkb] sim of each centred key block
  Output out;
  int64_t blocks_computed = 0, blocks_total = 0, pv_blocks_skipped = 0;
  double tau_margin = kInf;   // smallest |cumsum - tau| over the TopCdf decisions on positive P̂ entries
  double topk_margin = kInf;  // smallest relative P̂ gap at a top-k boundary
  double theta_margin = kInf; // smallest |sim - theta|
};
// per_head: one SpargeParams per query head (bq, bk, attention_sink, quantized read from per_head[0]).
SpargeResult sparge(const Problem& p, const std::vector<SpargeParams>& per_head);
// sim(X) = ‖Σ_a x_a/‖x_a‖‖² / n² over rows x_a of length D.
double self_similarity(const std::vector<const double*>& rows, int D);

// §5 TOKEN_SPARSE (Sq == Skv per sequence).
struct TokenSparseParams {
  int window = 128, pool_kernel = 7, min_tokens = 1024;
  double coverage = 0.005;
  bool selection_only = false;  // steps 1–6 only (selected, budgets, scores): no attention output, no pair count
};
struct TokenSparseResult {
  Output out;
  std::vector<std::vector<IndexSet>> selected;  // [b][h]; every token when the sequence ran dense
  std::vector<bool> ran_dense;                  // [b]
  std::vector<int> budget, n_drop;              // [b] (0 when dense)
  std::vector<std::vector<double>> cumsum;      // [b] ascending-sorted cumulative layer score (for choosing τ)
  std::vector<std::vector<std::vector<double>>> head_score;  // [b][h] ŝ_h over the L − W candidates (empty: dense)
  double coverage_margin = kInf;                // smallest |cumsum - τ|
  double topk_margin = kInf;                    // smallest relative score gap at a top-budget boundary
  int64_t pairs_computed = 0;
};
TokenSparseResult token_sparse(const Problem& p, const TokenSparseParams& params);

// §6 TOKEN_SELECT.
struct TokenSelectParams {
  int n_init = 128, n_local = 512, top_k = 2048;
  bool scale_scores = false, per_kv_head = false;
  double cache_theta = 0.9;
};
struct SelectionCache {  // §6.5, one slot per sequence
  std::vector<Rows> mean_query;             // [b] concat_h q̄_h; empty = slot not filled
  std::vector<std::vector<IndexSet>> top;   // [b][set]
  int64_t hits = 0, misses = 0;
  explicit SelectionCache(int batch) : mean_query(batch), top(batch) {}
};
struct TokenSelectResult {
  Output out;
  std::vector<std::vector<IndexSet>> selected;  // [b][H_sel]: index set I, or every token when dense
  std::vector<bool> ran_dense;
  std::vector<std::vector<std::vector<double>>> vote;  // [b][set]: vote over C = [n_init, N - n_local) (empty: dense, hit)
  double topk_margin = kInf;  // smallest relative vote gap at a top-k boundary
  int64_t hits = 0, misses = 0, pairs_computed = 0;
};
// cache may be null; a cache with theta >= 1 is not consulted.
TokenSelectResult token_select(const Problem& p, const TokenSelectParams& params, SelectionCache* cache);

// §7 TOKEN_INDICES.
struct TokenIndicesParams {
  int h_idx = 1, k = 0;
  std::vector<int> indices;   // [B, h_idx, k], -1 = unused
  std::vector<int> head_map;  // [Hq]; empty = h / (Hq / h_idx)
  int block_size = 1, n_init = 0, n_local = 0;
};
struct TokenIndicesResult {
  Output out;
  std::vector<std::vector<IndexSet>> selected;  // [b][Hq]
  int64_t pairs_computed = 0;
};
TokenIndicesResult token_indices(const Problem& p, const TokenIndicesParams& params);

// §8 Δ correction of `sparse` (the base policy's output); the problem must be causal. LSE is left empty.
Output delta(const Problem& p, const Output& sparse, int gamma, int tail_min);
// s_p of §8 for a sequence of sq rows.
int delta_sparse_rows(int sq, int gamma, int tail_min);

// §0 merge of two partial states, one row: o_* of length D.
void merge_row(const double* o_a, double lse_a, const double* o_b, double lse_b, int D, double* o, double* lse);

// Top-k with the smaller index winning ties (§0) and NaN below every number; returns the chosen ids sorted ascending. `margin` (optional)
// receives the relative gap between the k-th and (k+1)-th largest scores (inf when k == n).
IndexSet top_k(const std::vector<double>& score, int k, double* margin = nullptr);

}  // namespace ref
