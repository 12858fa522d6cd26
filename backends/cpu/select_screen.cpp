// TOKEN_SELECT's fp32 screen: the float64 oracle's T (§6.3) from fp32 scores and proven bounds (select_screen.h).
//
// Why: scoring every candidate in float64 in channel order (the oracle's bits) costs Hq·D float64 multiply-adds per
// key, as much as all of dense decode's fp32 arithmetic, so a selection scored that way cannot be cheaper than dense
// attention. The dense decode kernels score in fp32 at twice the lanes and without the transpose that sequential
// float64 sums need. fp32 scores decide most candidates outright; the rest are scored in float64 exactly as the
// oracle does, and whatever is still undecided sends the sequence back to the float64 pass.
//
// The bounds, per query head h (kv head hk; s the oracle's score, ŝ this file's, m and m̂ their maxima over C):
//   |ŝ − s| <= B_h = |scale| · Σ_c |q̄_h[c]| · max|K[·, hk, ·]| · (γ32(D+8) + γ64(D+8) + 2^-22) + underflow,
//   the classic bound for a dot product in any summation order (γ_n = n·u / (1 − n·u)), both dot products' roundings
//   and fp32(scale · q̄) included. So |(s − m) − (ŝ − m̂)| <= w_h = 2·B_h, and the oracle's e = exp(s − m) lies in
//   [ê·(1 − w)(1 − ε), ê·(1 + w + w²)(1 + ε)] with ê = screen_exp(ŝ − m̂) (ε: its error and its fp32 argument's).
//   Summing those bounds Z_h, and each candidate's vote Σ_h e/Z_h lies in an interval [lo, hi].
// With λ the top_k-th largest lo and μ the (top_k+1)-th largest hi, a candidate with lo > μ is in T whatever the
// exact values (at most top_k − 1 others can reach it) and one with hi < λ is out (top_k others beat it). The band
// U between is resolved with the oracle's own float64 scores of U and of every candidate whose ê exceeds a
// kHeavyShare share of Z_h ("heavy"): they give m_h exactly (the maximum is heavy), Z_h's heavy terms exactly and
// its light rest within its interval, so U's votes get intervals narrow enough to pick U's share of T — or the
// sequence falls back. Every float64 rounding of the oracle's pipeline (its exp, the fixed-point Z_h, the vote's
// divides and adds) and of this file's sums is covered by kRoundingSlack. Exact ties cannot be certified and fall
// back, so the smaller-index rule stays the float64 pass's.
#include "select_screen.h"

#include <sparsa/sparsa.h>

#include <algorithm>
#include <cmath>
#include <functional>
#include <limits>

#include "../../src/tensor_util.h"  // ceil_div
#include "cpu_convert.h"
#include "cpu_engine.h"
#include "cpu_select_util.h"
#include "decode_kernels.h"
#include "select_scores.h"
#include "select_screen_rows.h"

namespace sparsa::cpu {
namespace {

using screen_rows::kHeavyShare;
using screen_rows::kMaxHeadsPerSet;
using screen_rows::kMaxKvHeads;
using screen_rows::row_counts_reaching;
using screen_rows::row_exps;
using screen_rows::row_maxima;
using screen_rows::row_split;
using screen_rows::row_votes;
using screen_rows::scaled_floats;

constexpr int kTileKeys = 64;                       // keys per call of the decode scores kernel
// Candidates per work item of the row steps: 2048 left most of 8 or 16 workers idle at 8K candidates (TOKEN_SELECT
// 8K keys N/8 on the 16-core Xeon, 8 threads: 2.2-2.4 ms with 2048, 1.5-1.8 with 512).
constexpr int64_t kChunkCandidates = 512;
// Step 6 finds the k-th place among the candidates whose upper bound reaches a value v that every
// kSampleStride-th lower bound puts below the k-th largest lower bound (boundary_set).
constexpr int64_t kSampleStride = 16;
constexpr double kMaxHeavyCut = 0.5;                // the cut stays below the maximum's ê (> 7/8)
constexpr int64_t kProbeCandidates = 512;           // step 1 scores these first, to tell a flat softmax early
// The probe in tiles, one work item each: as one item it held every other worker idle for its 0.2 ms (the 16-core
// Xeon, 8 threads), as long as dense decode takes at 8K keys there.
constexpr int64_t kProbePieces = kProbeCandidates / kTileKeys;
constexpr int64_t kFlatFraction = 4;                // a probe with more than 1/4 of a head heavy: flat
constexpr double kRoundingSlack = 1.0 / (1 << 30);  // every float64 rounding (ours and the oracle's), over-covered
constexpr double kExpSlack = 1.0 / (1 << 12);       // screen_exp's error and its fp32 argument's, over-covered
constexpr double kChunkSumSlack = 1.0 / (1 << 11);  // an fp32 sum of <= kChunkCandidates terms, over-covered
constexpr double kClampedTermBound = 0x1p-125;      // >= screen_exp(screen_rows::kLowestArgument)
constexpr double kUnderflowBound = 0x1p-148;        // an fp32 product's rounding below the normal range
constexpr double kMaxWidth = 0.125;                 // w_h beyond this: the bounds would decide nothing
constexpr size_t kMaxScreenBytes = size_t(64) << 20;
constexpr int64_t kMaxCandidates = int64_t(1) << 22;  // keeps every float64 sum's error under kRoundingSlack

// γ_n = n·u / (1 − n·u): the relative error factor of an n-term dot product in precision u, any summation order.
double gamma_factor(int64_t n, double unit_roundoff) {
  const double nu = double(n) * unit_roundoff;
  return nu / (1.0 - nu);
}

// Per query head, the bounds steps 2 and 4 derive.
struct HeadBounds {
  float max_score = 0.f;  // m̂
  float cut = 0.f;        // ê >= cut: heavy
  double lo_factor = 0.0, hi_factor = 0.0;  // e / ê within [(1 − w)(1 − ε), (1 + w + w²)(1 + ε)]
  float lo_coef = 0.f, hi_coef = 0.f;       // lo_factor / Z_hi, hi_factor / Z_lo: step 5's vote bounds
  bool ok = false;
};

// Room for U among n candidates; more undecided: the sequence falls back.
int64_t undecided_capacity_for(int64_t n) { return std::max<int64_t>(64, n / 8); }

// A set's place of the k-th candidate in step 6: v (when sampled), then λ (the k-th largest lo) and μ (the
// (k+1)-th largest hi).
struct Boundary {
  float v = 0.f, lambda = 0.f, mu = 0.f;
  bool sampled = false;
};

// The run's arrays (run scratch slot kRunScratchSelectionScreen).
struct ScreenArrays {
  ScratchLayout layout;
  int64_t chunks = 0, max_candidates = 0, scores_stride = 0, undecided_capacity = 0;
  int32_t kv_per_set = 0;
  size_t q_count, scores_count, chunk_heads, chunk_kv, heads_count, votes_count, sets_count, undecided_count,
      heavy_count, heavy_counts_count, light_count, kv_count;
  size_t q_at, scores_at, exps_at, chunk_max_at, chunk_sum_at, chunk_kmax_at, chunk_bad_at, probe_max_at,
      probe_sum_at, probe_kmax_at, probe_bad_at, heads_at, lo_at, hi_at, set_state_at, set_counts_at, in_at,
      undecided_at, heavy_at, heavy_counts_at, light_at, u_terms_at, kv_ok_at, boundary_at, order_lo_at, order_hi_at,
      chunk_counts_at, chunk_undecided_at;
  ScreenArrays(const AttentionProblem& problem, const ScreenRequest& request, int64_t max_c) {
    const size_t batch = size_t(problem.batch), hq = size_t(problem.num_q_heads);
    max_candidates = max_c;
    undecided_capacity = undecided_capacity_for(max_c);
    kv_per_set = request.heads_per_set / (problem.num_q_heads / problem.num_kv_heads);
    chunks = ceil_div(max_c, kChunkCandidates);
    scores_stride = max_c * int64_t(hq) + 16;  // + the last row's vector overhang
    q_count = batch * hq * size_t(problem.head_dim);
    scores_count = batch * size_t(scores_stride);
    chunk_heads = batch * size_t(chunks) * hq;
    chunk_kv = batch * size_t(chunks) * size_t(problem.num_kv_heads);
    heads_count = batch * hq;
    sets_count = batch * size_t(request.n_sets);
    votes_count = sets_count * size_t(max_c);
    q_at = layout.add<float>(q_count);
    scores_at = layout.add<float>(scores_count);
    exps_at = layout.add<float>(scores_count);
    chunk_max_at = layout.add<float>(chunk_heads);
    chunk_sum_at = layout.add<float>(chunk_heads);
    chunk_kmax_at = layout.add<uint16_t>(chunk_kv);
    chunk_bad_at = layout.add<unsigned char>(batch * size_t(chunks));
    probe_max_at = layout.add<float>(batch * size_t(kProbePieces) * hq);
    probe_sum_at = layout.add<float>(batch * size_t(kProbePieces) * hq);
    probe_kmax_at = layout.add<uint16_t>(batch * size_t(kProbePieces) * size_t(problem.num_kv_heads));
    probe_bad_at = layout.add<unsigned char>(batch * size_t(kProbePieces));
    heads_at = layout.add<HeadBounds>(heads_count);
    lo_at = layout.add<float>(votes_count);
    hi_at = layout.add<float>(votes_count);
    set_state_at = layout.add<unsigned char>(sets_count);
    // Step 6's, per set: its counts (decided in, undecided), the decided ids and U, each kv head's heavy lists (a
    // chunk's at the chunk's offset), the chunks' light sums per head, and each kv head's terms of U's votes.
    undecided_count = sets_count * size_t(undecided_capacity);
    heavy_count = votes_count * size_t(kv_per_set);
    heavy_counts_count = sets_count * size_t(chunks) * size_t(kv_per_set);
    light_count = sets_count * size_t(chunks) * size_t(request.heads_per_set);
    kv_count = sets_count * size_t(kv_per_set);
    set_counts_at = layout.add<int64_t>(2 * sets_count);
    in_at = layout.add<int32_t>(votes_count);
    undecided_at = layout.add<int32_t>(undecided_count);
    heavy_at = layout.add<int32_t>(heavy_count);
    heavy_counts_at = layout.add<int64_t>(heavy_counts_count);
    light_at = layout.add<float>(light_count);
    u_terms_at = layout.add<double>(2 * kv_count * size_t(undecided_capacity));
    kv_ok_at = layout.add<unsigned char>(kv_count);
    // classify's, per set: its boundary values, both bounds of the candidates that can reach the k-th place
    // (chunk c's at c · kChunkCandidates, then gathered), each chunk's counts and its undecided ids.
    boundary_at = layout.add<Boundary>(sets_count);
    order_lo_at = layout.add<float>(votes_count);
    order_hi_at = layout.add<float>(votes_count);
    chunk_counts_at = layout.add<int64_t>(4 * sets_count * size_t(chunks));
    chunk_undecided_at = layout.add<int32_t>(votes_count);
  }
};

// A worker's scratch in step 1: the tile's row pointers.
struct ScoreChunkLayout {
  ScratchLayout layout;
  size_t rows_at;
  ScoreChunkLayout() { rows_at = layout.add<const unsigned char*>(kTileKeys); }
};

// A worker's scratch in step 6: sample_set's sample; resolve_kv's heavy list, union list, its exact scores
// ([list, g]) and the transposed tile; choose_set's vote intervals of U, their ends in order and U's chosen ids.
struct SampleLayout {
  ScratchLayout layout;
  size_t sample_at;
  explicit SampleLayout(int64_t n) { sample_at = layout.add<float>(size_t(n / kSampleStride + 1)); }
};
struct ResolveLayout {
  ScratchLayout layout;
  size_t heavy_at, list_at, exact_at, transposed_at;
  ResolveLayout(int64_t n, int32_t g, int32_t d) {
    heavy_at = layout.add<int32_t>(size_t(n));
    list_at = layout.add<int32_t>(size_t(n));
    exact_at = layout.add<double>(size_t(n) * size_t(g));
    transposed_at = layout.add<float>(score_tile_scratch_floats(d));
  }
};
struct ChooseLayout {
  ScratchLayout layout;
  size_t u_lo_at, u_hi_at, order_at, chosen_at;
  explicit ChooseLayout(int64_t undecided_capacity) {
    u_lo_at = layout.add<double>(size_t(undecided_capacity));
    u_hi_at = layout.add<double>(size_t(undecided_capacity));
    order_at = layout.add<double>(2 * size_t(undecided_capacity));
    chosen_at = layout.add<int32_t>(size_t(undecided_capacity));
  }
};

bool magnitude_is_finite(int32_t dtype, uint16_t bits) {
  return dtype == SPARSA_DTYPE_F16 ? bits < 0x7c00 : bits < 0x7f80;
}
double magnitude_value(int32_t dtype, uint16_t bits) {
  return dtype == SPARSA_DTYPE_F16 ? double(f16_to_float(bits)) : double(bf16_to_float(bits));
}

struct Screen {
  const AttentionProblem& problem;
  const ScreenRequest& request;
  const ScreenSequence* sequences;
  const double* concat_qbars;
  ScreenArrays& arrays;
  const DecodeKernels& decode;
  float* q;                  // [B, Hq·D]: fp32(scale · q̄)
  float* scores;             // [B][max C, Hq] (+ overhang): ŝ, kept for the attention over T
  float* exps;               // the same shape: ê
  float* chunk_max;          // [B, chunks, Hq]
  float* chunk_sum;          // [B, chunks, Hq]
  uint16_t* chunk_kmax;      // [B, chunks, Hkv]
  unsigned char* chunk_bad;  // [B, chunks]
  float* probe_max;          // [B, kProbePieces, Hq]: the probe's pieces' statistics, as a chunk's
  float* probe_sum;          // [B, kProbePieces, Hq]: each piece's Σ exp(ŝ − its own maximum)
  uint16_t* probe_kmax;      // [B, kProbePieces, Hkv]
  unsigned char* probe_bad;  // [B, kProbePieces]
  HeadBounds* heads;         // [B, Hq]
  float* vote_lo;            // [B, n_sets, max C]
  float* vote_hi;
  unsigned char* set_state;  // [B, n_sets]: SetState
  int64_t* set_counts;       // [B, n_sets, 2]: decided in, undecided
  int32_t* in_ids;           // [B, n_sets, max C]: the decided ids, ascending
  int32_t* undecided;        // [B, n_sets, U's capacity]: U, ascending
  int32_t* heavy;            // [B, n_sets, kv per set, max C]: chunk c's heavy ids from c · kChunkCandidates
  int64_t* heavy_counts;     // [B, n_sets, chunks, kv per set]
  float* light;              // [B, n_sets, chunks, heads per set]: fp32 Σ of the light ê
  double* u_terms;           // [B, n_sets, kv per set, 2, U's capacity]: a kv head's Σ e/Z_hi and Σ e/Z_lo of U
  unsigned char* kv_ok;      // [B, n_sets, kv per set]
  Boundary* boundaries;      // [B, n_sets]
  float* order_lo;           // [B, n_sets, max C]
  float* order_hi;
  int64_t* chunk_counts;     // [B, n_sets, chunks, 4]: kept and reaching (boundary_chunk), in and undecided
  int32_t* chunk_undecided;  // [B, n_sets, max C]: chunk c's undecided ids from c · kChunkCandidates

  // kSetClassifying from sample_set to gather_set, which leaves kSetWritten, kSetPending (U to resolve) or
  // kSetFailed.
  enum SetState : unsigned char { kSetFailed, kSetWritten, kSetPending, kSetClassifying };

  int32_t group() const { return problem.num_q_heads / problem.num_kv_heads; }
  int64_t set_index(int32_t b, int32_t set) const { return int64_t(b) * request.n_sets + set; }
  int64_t n_chunks(int32_t b) const { return ceil_div(sequences[b].n_candidates, kChunkCandidates); }
  float* rows(int32_t b) const { return scores + int64_t(b) * arrays.scores_stride; }
  float* exp_rows(int32_t b) const { return exps + int64_t(b) * arrays.scores_stride; }
  HeadBounds* head_bounds(int32_t b) const { return heads + int64_t(b) * problem.num_q_heads; }
  const unsigned char* k_row(int32_t b, int64_t t, int32_t hk) const {
    return static_cast<const unsigned char*>(problem.k.t.data) +
           problem.kv_offset(problem.k, b, t, hk) * element_bytes(problem.dtype);
  }

  // Step 1's statistics of a run of rows: each head's maximum, each kv head's largest |K|, and whether anything was
  // not finite.
  struct RowStats {
    float* maxes;
    uint16_t* kmax;
    unsigned char* bad;
  };
  RowStats chunk_stats(int32_t b, int64_t chunk) const {
    const int64_t at = int64_t(b) * arrays.chunks + chunk;
    return {chunk_max + at * problem.num_q_heads, chunk_kmax + at * problem.num_kv_heads, chunk_bad + at};
  }
  RowStats probe_stats(int32_t b, int64_t piece) const {
    const int64_t at = int64_t(b) * kProbePieces + piece;
    return {probe_max + at * problem.num_q_heads, probe_kmax + at * problem.num_kv_heads, probe_bad + at};
  }

  // Step 1, candidates [first, last) of sequence b: ŝ rows with the dense decode kernels, and their statistics into
  // stats (started afresh, or added to).
  void score_rows(int32_t b, int64_t first, int64_t last, const RowStats& stats, bool fresh,
                  ThreadScratch& scratch) const {
    const ScreenSequence& seq = sequences[b];
    const int32_t hq = problem.num_q_heads, n_kv = problem.num_kv_heads, d = problem.head_dim;
    float* maxes = stats.maxes;
    uint16_t* kmax = stats.kmax;
    unsigned char& bad = *stats.bad;
    if (fresh) {
      std::fill(maxes, maxes + hq, -std::numeric_limits<float>::infinity());
      std::fill(kmax, kmax + n_kv, uint16_t{0});
      bad = 0;
    }
    if (first >= last) return;
    ScoreChunkLayout layout;
    layout.layout.bind(scratch);
    const unsigned char** tile_rows = layout.layout.get<const unsigned char*>(layout.rows_at, kTileKeys);
    DecodeTile tile;
    tile.k_rows = tile_rows;
    // No V rows. K: the kernels fetch what their order needs (the AVX-512F one a few keys ahead, across this loop's
    // tiles through k_key_bytes); fetching K rows 8 tiles ahead into L2 as well made the step slower (TOKEN_SELECT,
    // one thread, Zen 4: 8K keys 1.28-1.40 ms against 1.19-1.31, 32K 6.3-6.8 against 5.5-5.8).
    tile.v_rows = nullptr;
    const int64_t t0 = seq.first_candidate + first;
    tile.k_head_bytes = n_kv > 1 ? k_row(b, t0, 1) - k_row(b, t0, 0) : 0;
    if (problem.kv_layout != KvLayout::kPaged) tile.k_key_bytes = k_row(b, t0 + 1, 0) - k_row(b, t0, 0);
    tile.n_kv_heads = n_kv;
    tile.group = group();
    tile.d = d;
    tile.dtype = problem.dtype;
    tile.k_magnitudes = kmax;
    const float* qb = q + int64_t(b) * hq * d;
    for (int64_t j0 = first; j0 < last; j0 += kTileKeys) {
      const int nk = int(std::min<int64_t>(kTileKeys, last - j0));
      for (int j = 0; j < nk; ++j) tile_rows[j] = k_row(b, seq.first_candidate + j0 + j, 0);
      tile.nk = nk;
      decode.scores(tile, qb, rows(b) + j0 * hq, hq);
    }
    if (!row_maxima(rows(b) + first * hq, last - first, hq, maxes)) bad = 1;
  }

  // After step 1's probe (the first kProbeCandidates rows) of sequence b: its pieces' statistics as chunk 0's.
  void gather_probe(int32_t b, int64_t n_pieces) const {
    const RowStats into = chunk_stats(b, 0);
    std::fill(into.maxes, into.maxes + problem.num_q_heads, -std::numeric_limits<float>::infinity());
    std::fill(into.kmax, into.kmax + problem.num_kv_heads, uint16_t{0});
    *into.bad = 0;
    for (int64_t piece = 0; piece < n_pieces; ++piece) {
      const RowStats from = probe_stats(b, piece);
      for (int32_t h = 0; h < problem.num_q_heads; ++h) into.maxes[h] = std::max(into.maxes[h], from.maxes[h]);
      for (int32_t hk = 0; hk < problem.num_kv_heads; ++hk) into.kmax[hk] = std::max(into.kmax[hk], from.kmax[hk]);
      *into.bad = *into.bad | *from.bad;
    }
  }

  // Step 1's probe, piece `piece` of sequence b (rows [first, last), scored and finite): each head's
  // Σ exp(ŝ − the piece's maximum), for predicts_flat. The exps it writes are scratch until step 3 writes chunk 0's.
  void probe_sums(int32_t b, int64_t piece, int64_t first, int64_t last) const {
    const int32_t hq = problem.num_q_heads;
    const int64_t at = (int64_t(b) * kProbePieces + piece) * hq;
    row_exps(rows(b) + first * hq, exp_rows(b) + first * hq, last - first, hq, probe_max + at, probe_sum + at);
  }

  // After gather_probe on finite rows: true when the probe's rows predict heavy lists past their capacity (a flat
  // softmax), where step 6 would fail after all the scoring; the float64 pass then takes the sequence at once. Each
  // head's cut, m̂ + ln(kHeavyShare · Σ exp(ŝ − m̂)) over the probe, comes from the pieces' sums rescaled to m̂ (the
  // pieces ran in parallel; a prediction only chooses the path, never the selection).
  bool predicts_flat(int32_t b, int64_t n_pieces) const {
    const int32_t hq = problem.num_q_heads;
    const int64_t n_rows = std::min(sequences[b].n_candidates, kProbeCandidates);
    const float* maxes = chunk_max + int64_t(b) * arrays.chunks * hq;
    float cuts[kMaxHeadsPerSet] = {};
    for (int32_t h = 0; h < hq; ++h) {
      double sum = 0.0;
      for (int64_t piece = 0; piece < n_pieces; ++piece) {
        const int64_t at = (int64_t(b) * kProbePieces + piece) * hq + h;
        sum += double(probe_sum[at]) * std::exp(double(probe_max[at]) - double(maxes[h]));
      }
      cuts[h] = float(double(maxes[h]) + std::log(kHeavyShare * sum));
    }
    int64_t counts[kMaxHeadsPerSet];
    row_counts_reaching(rows(b), n_rows, hq, cuts, counts);
    for (int32_t h = 0; h < hq; ++h)
      if (counts[h] * kFlatFraction > n_rows) return true;
    return false;
  }

  // Step 2, sequence b: m̂_h and the width w_h of every head (false: the screen cannot bound them).
  bool bound_heads(int32_t b) const {
    const int32_t hq = problem.num_q_heads, n_kv = problem.num_kv_heads, d = problem.head_dim;
    const int64_t chunks = n_chunks(b);
    for (int64_t c = 0; c < chunks; ++c)
      if (chunk_bad[int64_t(b) * arrays.chunks + c]) return false;
    const double abs_scale = std::fabs(request.score_scale);
    const double coefficient = gamma_factor(d + 8, 0x1p-24) + gamma_factor(d + 8, 0x1p-53) + 0x1p-22;
    for (int32_t h = 0; h < hq; ++h) {
      HeadBounds& hb = head_bounds(b)[h];
      hb = HeadBounds{};
      float m = -std::numeric_limits<float>::infinity();
      uint16_t kbits = 0;
      for (int64_t c = 0; c < chunks; ++c) {
        m = std::max(m, chunk_max[(int64_t(b) * arrays.chunks + c) * hq + h]);
        kbits = std::max(kbits, chunk_kmax[(int64_t(b) * arrays.chunks + c) * n_kv + h / group()]);
      }
      if (!magnitude_is_finite(problem.dtype, kbits) || !std::isfinite(m)) return false;
      const double* qbar = concat_qbars + (int64_t(b) * hq + h) * d;
      double q_l1 = 0.0;
      for (int32_t c = 0; c < d; ++c) q_l1 += std::fabs(qbar[c]);
      const double terms = abs_scale * q_l1 * magnitude_value(problem.dtype, kbits);  // >= |scale|·Σ|q̄·K| per key
      if (!(terms <= 1e30)) return false;
      // Below the normal range fp32 rounds absolutely: fp32(scale · q̄) by up to 2^-150 per element (times |K|), each
      // FMA by up to 2^-150.
      const double underflow = double(d + 8) * kUnderflowBound * (1.0 + magnitude_value(problem.dtype, kbits));
      const double bound = terms * coefficient * (1.0 + 0x1p-10) + underflow;
      hb.max_score = m;
      const double width = 2.0 * bound;  // w_h
      if (width > kMaxWidth) return false;
      hb.lo_factor = (1.0 - width) * (1.0 - kExpSlack) * (1.0 - kRoundingSlack);
      hb.hi_factor = (1.0 + width + width * width) * (1.0 + kExpSlack) * (1.0 + kRoundingSlack);
    }
    return true;
  }

  // Step 3, one chunk: ê from ŝ, each head's fp32 sum over the chunk.
  void exp_chunk(int32_t b, int64_t chunk) const {
    const int32_t hq = problem.num_q_heads;
    const int64_t first = chunk * kChunkCandidates;
    const int64_t last = std::min(sequences[b].n_candidates, first + kChunkCandidates);
    float maxes[kMaxHeadsPerSet];
    for (int32_t h = 0; h < hq; ++h) maxes[h] = head_bounds(b)[h].max_score;
    float* sums = chunk_sum + (int64_t(b) * arrays.chunks + chunk) * hq;
    row_exps(rows(b) + first * hq, exp_rows(b) + first * hq, last - first, hq, maxes, sums);
  }

  // Step 4, sequence b: Z_h's first interval from Σ ê, the vote coefficients and the heavy cut.
  bool bound_sums(int32_t b) const {
    const int32_t hq = problem.num_q_heads;
    const int64_t n = sequences[b].n_candidates, chunks = n_chunks(b);
    for (int32_t h = 0; h < hq; ++h) {
      HeadBounds& hb = head_bounds(b)[h];
      double sum = 0.0;
      for (int64_t c = 0; c < chunks; ++c) sum += double(chunk_sum[(int64_t(b) * arrays.chunks + c) * hq + h]);
      const double z_lo = (sum * (1.0 - kChunkSumSlack) - double(n) * kClampedTermBound) * hb.lo_factor;
      const double z_hi = sum * (1.0 + kChunkSumSlack) * hb.hi_factor;
      if (!(z_lo > 0.0) || !std::isfinite(z_hi)) return false;
      // Stepped away from the bound by one more fp32 rounding, so that rounding to fp32 keeps them bounds.
      hb.lo_coef = float(hb.lo_factor / z_hi * (1.0 - kRoundingSlack) * (1.0 - 0x1p-23));
      hb.hi_coef = float(hb.hi_factor / z_lo * (1.0 + kRoundingSlack) * (1.0 + 0x1p-23));
      // Where the softmax is peaked the light candidates (ê < cut) hold a tiny share of Σ ê, which is what step 6
      // needs; where it is flat, the heavy lists overflow and the sequence falls back. At most kMaxHeavyCut, so that
      // the maximum (ê >= (1 − w)(1 − ε) > 7/8) is always heavy.
      hb.cut = float(std::min(sum * kHeavyShare, kMaxHeavyCut));
      hb.ok = true;
    }
    return true;
  }

  // Step 5, one chunk of a set: every candidate's vote interval [lo, hi].
  void vote_chunk(int32_t b, int32_t set, int64_t chunk) const {
    const int32_t hq = problem.num_q_heads, nh = request.heads_per_set, first_head = set * nh;
    const int64_t first = chunk * kChunkCandidates;
    const int64_t last = std::min(sequences[b].n_candidates, first + kChunkCandidates);
    float lo_coef[kMaxHeadsPerSet], hi_coef[kMaxHeadsPerSet];
    float largest_lo_coef = 0.f;
    for (int32_t l = 0; l < nh; ++l) {
      lo_coef[l] = head_bounds(b)[first_head + l].lo_coef;
      hi_coef[l] = head_bounds(b)[first_head + l].hi_coef;
      largest_lo_coef = std::max(largest_lo_coef, lo_coef[l]);
    }
    float* lo = vote_lo + (int64_t(b) * request.n_sets + set) * arrays.max_candidates;
    float* hi = vote_hi + (int64_t(b) * request.n_sets + set) * arrays.max_candidates;
    row_votes(exp_rows(b) + first * hq, last - first, hq, first_head, nh, lo_coef, hi_coef, lo + first, hi + first);
    // fp32 sums of nh positive products (γ, and underflow below the normal range); a clamped ê stands for a term
    // anywhere in [0, its bound], so its share leaves the lower bound.
    const double sum_error = gamma_factor(nh + 8, 0x1p-24);
    const double absolute = double(nh) * (kUnderflowBound + kClampedTermBound * double(largest_lo_coef));
    for (int64_t t = first; t < last; ++t) {
      lo[t] = float(std::max(0.0, double(lo[t]) * (1.0 - 2.0 * sum_error) - absolute) * (1.0 - kRoundingSlack));
      hi[t] = float((double(hi[t]) * (1.0 + 2.0 * sum_error) + double(nh) * kUnderflowBound) * (1.0 + kRoundingSlack));
    }
  }

  // Step 6 for (b, set), in parts so that a single set spreads over the workers too:
  //   sample_set     (b, set)         v from a sample of the lower bounds
  //   boundary_chunk (b, set, chunk)  the chunk's candidates whose upper bound reaches v
  //   boundary_set   (b, set, which)  λ (which 0) or μ (which 1) over those candidates, or over all
  //   classify_chunk (b, set, chunk)  the chunk's intervals against the k-th place: decided in, or undecided
  //   gather_set     (b, set)         T's decided ids and U (U empty: T written)
  //   split_chunk    (b, set, chunk)  the chunk's heavy candidates per kv head and each head's light Σ ê
  //   resolve_kv     (b, set, kv)     the oracle's scores of U ∪ heavy for one kv head: m_h, Z_h and U's vote terms
  //   choose_set     (b, set)         U's vote intervals, U's share of T, and T written
  // A set ends kSetWritten (selection holds T, ascending) or kSetFailed.
  void sample_set(int32_t b, int32_t set, ThreadScratch& scratch) const;
  void boundary_chunk(int32_t b, int32_t set, int64_t chunk) const;
  void boundary_set(int32_t b, int32_t set, int which) const;
  void classify_chunk(int32_t b, int32_t set, int64_t chunk) const;
  void gather_set(int32_t b, int32_t set, int64_t* selection) const;
  void split_chunk(int32_t b, int32_t set, int64_t chunk) const;
  void resolve_kv(int32_t b, int32_t set, int32_t kv, ThreadScratch& scratch) const;
  void choose_set(int32_t b, int32_t set, int64_t* selection, ThreadScratch& scratch) const;
  // T = the decided ids and the chosen undecided ones (both ascending, disjoint), merged; false unless top_k in all.
  bool write_set(int32_t b, int32_t set, const int32_t* chosen, int64_t n_chosen, int64_t* selection) const;
};

bool Screen::write_set(int32_t b, int32_t set, const int32_t* chosen, int64_t n_chosen, int64_t* selection) const {
  const int64_t n_in = set_counts[2 * set_index(b, set)];
  const int32_t* in = in_ids + set_index(b, set) * arrays.max_candidates;
  if (n_in + n_chosen != request.top_k) return false;
  int64_t i = 0, j = 0, out = 0;
  while (i < n_in || j < n_chosen) {
    const bool take_in = j == n_chosen || (i < n_in && in[i] < chosen[j]);
    selection[out++] = sequences[b].first_candidate + (take_in ? in[i++] : chosen[j++]);
  }
  return true;
}

// λ and μ, the k-th and (k+1)-th largest of lo and hi, over the candidates that can matter: a sample of every
// kSampleStride-th lo gives a value v below the k-th largest lo with room to spare; when at least k + 1 lo reach v,
// no candidate with hi < v can be among the k largest lo or the k + 1 largest hi (lo <= hi), so the order statistics
// are taken over the candidates with hi >= v alone (a few more than k on a peaked softmax). Otherwise over all.
void Screen::sample_set(int32_t b, int32_t set, ThreadScratch& scratch) const {
  const int64_t n = sequences[b].n_candidates, k = request.top_k;
  const int32_t nh = request.heads_per_set, first_head = set * nh;
  for (int32_t l = 0; l < nh; ++l)
    if (!head_bounds(b)[first_head + l].ok) return;
  Boundary& boundary = boundaries[set_index(b, set)];
  boundary = Boundary{};
  set_state[set_index(b, set)] = kSetClassifying;
  if (n < 8 * kSampleStride || k + 1 >= n) return;
  SampleLayout c(n);
  c.layout.bind(scratch);
  float* sample = c.layout.get<float>(c.sample_at, size_t(n / kSampleStride + 1));
  const float* lo = vote_lo + set_index(b, set) * arrays.max_candidates;
  int64_t n_sample = 0;
  for (int64_t t = 0; t < n; t += kSampleStride) sample[n_sample++] = lo[t];
  // The sample's (k/stride · 5/4 + 8)-th largest: below the k-th largest lo unless the sample is far off.
  const int64_t rank = std::min(n_sample - 1, k / kSampleStride + k / (4 * kSampleStride) + 8);
  std::nth_element(sample, sample + rank, sample + n_sample, std::greater<float>());
  boundary.v = sample[rank];
  boundary.sampled = true;
}

void Screen::boundary_chunk(int32_t b, int32_t set, int64_t chunk) const {
  const int64_t n = sequences[b].n_candidates, first = chunk * kChunkCandidates;
  const Boundary& boundary = boundaries[set_index(b, set)];
  if (set_state[set_index(b, set)] != kSetClassifying || !boundary.sampled || first >= n) return;
  const int64_t last = std::min(n, first + kChunkCandidates);
  const float* lo = vote_lo + set_index(b, set) * arrays.max_candidates;
  const float* hi = vote_hi + set_index(b, set) * arrays.max_candidates;
  float* kept_lo = order_lo + set_index(b, set) * arrays.max_candidates + first;
  float* kept_hi = order_hi + set_index(b, set) * arrays.max_candidates + first;
  const float v = boundary.v;
  int64_t kept = 0, reaching = 0;
  for (int64_t t = first; t < last; ++t) {
    if (!(hi[t] >= v)) continue;
    reaching += lo[t] >= v;
    kept_lo[kept] = lo[t];
    kept_hi[kept++] = hi[t];
  }
  int64_t* counts = chunk_counts + (set_index(b, set) * arrays.chunks + chunk) * 4;
  counts[0] = kept;
  counts[1] = reaching;
}

void Screen::boundary_set(int32_t b, int32_t set, int which) const {
  if (set_state[set_index(b, set)] != kSetClassifying) return;
  const int64_t n = sequences[b].n_candidates, k = request.top_k, chunks = n_chunks(b);
  Boundary& boundary = boundaries[set_index(b, set)];
  const int64_t* counts = chunk_counts + set_index(b, set) * arrays.chunks * 4;
  int64_t reaching = 0;
  for (int64_t c = 0; boundary.sampled && c < chunks; ++c) reaching += counts[4 * c + 1];
  const float* bounds = (which == 0 ? vote_lo : vote_hi) + set_index(b, set) * arrays.max_candidates;
  float* order = (which == 0 ? order_lo : order_hi) + set_index(b, set) * arrays.max_candidates;
  int64_t m = 0;
  if (boundary.sampled && reaching >= k + 1) {
    for (int64_t c = 0; c < chunks; ++c) {  // the chunks' kept values, moved together (never to the right)
      std::copy(order + c * kChunkCandidates, order + c * kChunkCandidates + counts[4 * c], order + m);
      m += counts[4 * c];
    }
  } else {
    std::copy(bounds, bounds + n, order);
    m = n;
  }
  if (which == 0) {
    std::nth_element(order, order + (k - 1), order + m, std::greater<float>());
    boundary.lambda = order[k - 1];
  } else {
    std::nth_element(order, order + k, order + m, std::greater<float>());
    boundary.mu = order[k];
  }
}

// The chunk's candidates by interval against the k-th place: in (lo > μ), out (hi < λ), or undecided; the in ids
// at the chunk's offset of in_ids, the undecided at its offset of chunk_undecided, both ascending.
void Screen::classify_chunk(int32_t b, int32_t set, int64_t chunk) const {
  const int64_t n = sequences[b].n_candidates, first = chunk * kChunkCandidates;
  if (set_state[set_index(b, set)] != kSetClassifying || first >= n) return;
  const int64_t last = std::min(n, first + kChunkCandidates);
  const Boundary& boundary = boundaries[set_index(b, set)];
  const float* lo = vote_lo + set_index(b, set) * arrays.max_candidates;
  const float* hi = vote_hi + set_index(b, set) * arrays.max_candidates;
  int32_t* in = in_ids + set_index(b, set) * arrays.max_candidates + first;
  int32_t* undecided_here = chunk_undecided + set_index(b, set) * arrays.max_candidates + first;
  int64_t n_in = 0, n_undecided = 0;
  for (int64_t t = first; t < last; ++t) {
    if (lo[t] > boundary.mu) {
      in[n_in++] = int32_t(t);
    } else if (!(hi[t] < boundary.lambda)) {
      undecided_here[n_undecided++] = int32_t(t);
    }
  }
  int64_t* counts = chunk_counts + (set_index(b, set) * arrays.chunks + chunk) * 4;
  counts[2] = n_in;
  counts[3] = n_undecided;
}

void Screen::gather_set(int32_t b, int32_t set, int64_t* selection) const {
  unsigned char& state = set_state[set_index(b, set)];
  if (state != kSetClassifying) return;
  state = kSetFailed;
  const int64_t n = sequences[b].n_candidates, k = request.top_k, chunks = n_chunks(b);
  const int64_t* counts = chunk_counts + set_index(b, set) * arrays.chunks * 4;
  int64_t n_undecided = 0;
  for (int64_t c = 0; c < chunks; ++c) n_undecided += counts[4 * c + 3];
  if (n_undecided > undecided_capacity_for(n)) return;
  int32_t* in = in_ids + set_index(b, set) * arrays.max_candidates;
  int32_t* u = undecided + set_index(b, set) * arrays.undecided_capacity;
  const int32_t* undecided_here = chunk_undecided + set_index(b, set) * arrays.max_candidates;
  int64_t n_in = 0;
  n_undecided = 0;
  for (int64_t c = 0; c < chunks; ++c) {  // the chunks' ids, moved together (never to the right), so ascending
    std::copy(in + c * kChunkCandidates, in + c * kChunkCandidates + counts[4 * c + 2], in + n_in);
    n_in += counts[4 * c + 2];
    std::copy(undecided_here + c * kChunkCandidates, undecided_here + c * kChunkCandidates + counts[4 * c + 3],
              u + n_undecided);
    n_undecided += counts[4 * c + 3];
  }
  int64_t* set_count = set_counts + 2 * set_index(b, set);
  set_count[0] = n_in;
  set_count[1] = n_undecided;
  if (n_undecided == 0) {
    if (write_set(b, set, nullptr, 0, selection)) state = kSetWritten;
    return;
  }
  const int64_t r = k - n_in;  // U's share of T
  if (r >= 0 && r <= n_undecided) state = kSetPending;
}

void Screen::split_chunk(int32_t b, int32_t set, int64_t chunk) const {
  const int64_t n = sequences[b].n_candidates, first = chunk * kChunkCandidates;
  if (set_state[set_index(b, set)] != kSetPending || first >= n) return;
  const int32_t nh = request.heads_per_set, first_head = set * nh, n_kv = arrays.kv_per_set;
  float cut[kMaxHeadsPerSet];
  for (int32_t i = 0; i < nh; ++i) cut[i] = head_bounds(b)[first_head + i].cut;
  int64_t* counts = heavy_counts + (set_index(b, set) * arrays.chunks + chunk) * n_kv;
  std::fill(counts, counts + n_kv, int64_t{0});
  // A chunk's lists cannot pass kChunkCandidates; resolve_kv checks their total against its capacity.
  row_split(exp_rows(b), first, std::min(kChunkCandidates, n - first), problem.num_q_heads, first_head, nh, group(),
            cut, light + (set_index(b, set) * arrays.chunks + chunk) * nh,
            heavy + set_index(b, set) * n_kv * arrays.max_candidates + first, arrays.max_candidates, counts,
            kChunkCandidates);
}

void Screen::resolve_kv(int32_t b, int32_t set, int32_t kv, ThreadScratch& scratch) const {
  unsigned char& ok = kv_ok[set_index(b, set) * arrays.kv_per_set + kv];
  ok = 0;
  if (set_state[set_index(b, set)] != kSetPending) return;
  const ScreenSequence& seq = sequences[b];
  const int64_t n = seq.n_candidates, chunks = n_chunks(b), n_undecided = set_counts[2 * set_index(b, set) + 1];
  const int32_t hq = problem.num_q_heads, nh = request.heads_per_set, first_head = set * nh, g = group();
  const int32_t d = problem.head_dim, n_kv = arrays.kv_per_set, hk = first_head / g + kv;
  const int32_t* u_ids = undecided + set_index(b, set) * arrays.undecided_capacity;
  ResolveLayout c(n, g, d);
  c.layout.bind(scratch);
  int32_t* heavy_list = c.layout.get<int32_t>(c.heavy_at, size_t(n));
  int32_t* list = c.layout.get<int32_t>(c.list_at, size_t(n));
  double* exact = c.layout.get<double>(c.exact_at, size_t(n) * size_t(g));
  float* transposed = c.layout.get<float>(c.transposed_at, score_tile_scratch_floats(d));

  // The kv head's heavy candidates, the chunks' lists in order (so ascending); more than n / 4: too flat for the
  // screen to pay.
  const int32_t* kv_heavy = heavy + (set_index(b, set) * n_kv + kv) * arrays.max_candidates;
  int64_t n_heavy = 0;
  for (int64_t chunk = 0; chunk < chunks; ++chunk) {
    const int64_t count = heavy_counts[(set_index(b, set) * arrays.chunks + chunk) * n_kv + kv];
    if (n_heavy + count > n / 4) return;
    const int32_t* from = kv_heavy + chunk * kChunkCandidates;
    std::copy(from, from + count, heavy_list + n_heavy);
    n_heavy += count;
  }
  // The oracle's scores of list = U ∪ heavy (ascending); then per query head m_h (the maximum is heavy: its ê is near
  // 1, far above the cut, and the list holds only candidates, so the list's maximum is m_h), Z_h's interval (heavy
  // terms exact, the light rest within its factors) and U's terms e/Z_hi and e/Z_lo, summed over the kv head's heads.
  const int64_t n_list = std::set_union(u_ids, u_ids + n_undecided, heavy_list, heavy_list + n_heavy, list) - list;
  const SelectScoreKernel& kernel = select_score_kernel();
  const void* tile_rows[kScoreTileKeys];
  const double* qbars = concat_qbars + (int64_t(b) * hq + int64_t(hk) * g) * d;
  // The list's rows are scattered, where the hardware prefetchers do not follow: each tile fetches the next tile's
  // rows into L2 before it is scored (TOKEN_SELECT at 8K keys, one thread, Zen 4: medians of the step 155-170 us
  // without the fetches, 135-140 with them).
  const int64_t row_bytes = int64_t(d) * element_bytes(problem.dtype);
  const auto fetch_rows = [&](int64_t first) {
    for (int64_t i = first; i < std::min(n_list, first + kScoreTileKeys); ++i)
      prefetch_span(k_row(b, seq.first_candidate + list[i], hk), row_bytes, prefetch_line_to_l2);
  };
  fetch_rows(0);
  for (int64_t i0 = 0; i0 < n_list; i0 += kScoreTileKeys) {
    const int nk = int(std::min<int64_t>(kScoreTileKeys, n_list - i0));
    fetch_rows(i0 + kScoreTileKeys);
    for (int j = 0; j < nk; ++j) tile_rows[j] = k_row(b, seq.first_candidate + list[i0 + j], hk);
    kernel.score_tile_exact_products(qbars, g, tile_rows, problem.dtype, nk, d, request.score_scale, transposed,
                                     exact + i0 * g, g);
  }
  double* terms_lo = u_terms + (set_index(b, set) * n_kv + kv) * 2 * arrays.undecided_capacity;
  double* terms_hi = terms_lo + arrays.undecided_capacity;
  std::fill(terms_lo, terms_lo + n_undecided, 0.0);
  std::fill(terms_hi, terms_hi + n_undecided, 0.0);
  const float* all_rows = exp_rows(b);
  const double clamped_total = double(n) * kClampedTermBound;
  for (int32_t l = 0; l < g; ++l) {
    const int32_t i = kv * g + l;  // the head within the set
    const HeadBounds& hb = head_bounds(b)[first_head + i];
    double light_sum = 0.0;  // the light Σ ê, chunk by chunk
    for (int64_t chunk = 0; chunk < chunks; ++chunk)
      light_sum += double(light[(set_index(b, set) * arrays.chunks + chunk) * nh + i]);
    double m = -std::numeric_limits<double>::infinity();
    for (int64_t x = 0; x < n_list; ++x) m = std::max(m, exact[x * g + l]);
    double z_heavy = 0.0;
    for (int64_t x = 0; x < n_list; ++x)
      if (all_rows[int64_t(list[x]) * hq + first_head + i] >= hb.cut) z_heavy += std::exp(exact[x * g + l] - m);
    const double z_lo = (z_heavy * (1.0 - kRoundingSlack) +
                         std::max(0.0, light_sum * (1.0 - kChunkSumSlack) - clamped_total) * hb.lo_factor) *
                        (1.0 - kRoundingSlack);
    const double z_hi = (z_heavy * (1.0 + kRoundingSlack) + light_sum * (1.0 + kChunkSumSlack) * hb.hi_factor) *
                        (1.0 + kRoundingSlack);
    if (!(z_lo > 0.0) || !std::isfinite(z_hi)) return;
    // U is inside the list: walk both in ascending order.
    for (int64_t u = 0, x = 0; u < n_undecided; ++u, ++x) {
      while (list[x] != u_ids[u]) ++x;
      const double e = std::exp(exact[x * g + l] - m);
      terms_lo[u] += e / z_hi;
      terms_hi[u] += e / z_lo;
    }
  }
  ok = 1;
}

void Screen::choose_set(int32_t b, int32_t set, int64_t* selection, ThreadScratch& scratch) const {
  unsigned char& state = set_state[set_index(b, set)];
  if (state != kSetPending) return;
  state = kSetFailed;
  const int32_t n_kv = arrays.kv_per_set;
  for (int32_t kv = 0; kv < n_kv; ++kv)
    if (!kv_ok[set_index(b, set) * n_kv + kv]) return;
  const int64_t n_undecided = set_counts[2 * set_index(b, set) + 1];
  const int64_t r = request.top_k - set_counts[2 * set_index(b, set)];
  const int32_t* u_ids = undecided + set_index(b, set) * arrays.undecided_capacity;
  ChooseLayout c(arrays.undecided_capacity);
  c.layout.bind(scratch);
  double* u_lo = c.layout.get<double>(c.u_lo_at, size_t(arrays.undecided_capacity));
  double* u_hi = c.layout.get<double>(c.u_hi_at, size_t(arrays.undecided_capacity));
  double* order = c.layout.get<double>(c.order_at, 2 * size_t(arrays.undecided_capacity));
  int32_t* chosen = c.layout.get<int32_t>(c.chosen_at, size_t(arrays.undecided_capacity));
  // U's vote intervals: the kv heads' terms, summed in kv order.
  std::fill(u_lo, u_lo + n_undecided, 0.0);
  std::fill(u_hi, u_hi + n_undecided, 0.0);
  for (int32_t kv = 0; kv < n_kv; ++kv) {
    const double* terms_lo = u_terms + (set_index(b, set) * n_kv + kv) * 2 * arrays.undecided_capacity;
    const double* terms_hi = terms_lo + arrays.undecided_capacity;
    for (int64_t u = 0; u < n_undecided; ++u) {
      u_lo[u] += terms_lo[u];
      u_hi[u] += terms_hi[u];
    }
  }
  for (int64_t u = 0; u < n_undecided; ++u) {
    u_lo[u] *= 1.0 - kRoundingSlack;
    u_hi[u] *= 1.0 + kRoundingSlack;
  }
  // U's share: the same split as classify's, on U's narrow intervals; anything left undecided is a near-tie.
  int64_t n_chosen = 0;
  if (r == n_undecided) {
    std::copy(u_ids, u_ids + n_undecided, chosen);
    n_chosen = n_undecided;
  } else if (r > 0) {
    std::copy(u_lo, u_lo + n_undecided, order);
    std::copy(u_hi, u_hi + n_undecided, order + n_undecided);
    std::nth_element(order, order + (r - 1), order + n_undecided, std::greater<double>());
    std::nth_element(order + n_undecided, order + n_undecided + r, order + 2 * n_undecided, std::greater<double>());
    const double lambda = order[r - 1], mu = order[n_undecided + r];
    for (int64_t u = 0; u < n_undecided; ++u) {
      if (u_lo[u] > mu) {
        chosen[n_chosen++] = u_ids[u];
      } else if (!(u_hi[u] < lambda)) {
        return;
      }
    }
  }
  if (write_set(b, set, chosen, n_chosen, selection)) state = kSetWritten;
}

}  // namespace

float screen_exp(float x) { return screen_rows::exp_lane(x); }

bool selection_screen_applies(const AttentionProblem& problem, const ScreenRequest& request, int64_t max_candidates) {
  if (problem.dtype != SPARSA_DTYPE_F16 && problem.dtype != SPARSA_DTYPE_BF16) return false;
  if (!select_decode_kernels(problem.head_dim)) return false;
  if (max_candidates <= 0 || max_candidates > kMaxCandidates) return false;
  if (problem.num_q_heads > kMaxHeadsPerSet || request.heads_per_set > kMaxHeadsPerSet) return false;
  if (problem.num_kv_heads > kMaxKvHeads) return false;
  if (!std::isfinite(request.score_scale) || request.score_scale == 0.0) return false;
  const size_t bytes = size_t(problem.batch) * size_t(problem.num_q_heads) * size_t(max_candidates) * sizeof(float);
  return bytes <= kMaxScreenBytes;
}

size_t selection_screen_scratch_floats(const AttentionProblem& problem, const ScreenRequest& request,
                                       int64_t max_candidates) {
  return ScreenArrays(problem, request, max_candidates).layout.floats();
}

size_t selection_screen_worker_floats(const AttentionProblem& problem, int64_t max_candidates) {
  const int32_t g = problem.num_q_heads / problem.num_kv_heads;
  return std::max({ScoreChunkLayout().layout.floats(), SampleLayout(max_candidates).layout.floats(),
                   ResolveLayout(max_candidates, g, problem.head_dim).layout.floats(),
                   ChooseLayout(undecided_capacity_for(max_candidates)).layout.floats()});
}

void screen_selections(const AttentionProblem& problem, const ScreenRequest& request,
                       const ScreenSequence* sequences, const double* concat_qbars, const ExecContext& exec,
                       int64_t* selections, int64_t selection_len, int64_t set_stride, unsigned char* certified,
                       const float** scores) {
  const int32_t batch = problem.batch, hq = problem.num_q_heads, d = problem.head_dim;
  int64_t max_candidates = 0;
  for (int32_t b = 0; b < batch; ++b) {
    certified[b] = 0;
    scores[b] = nullptr;
    if (sequences[b].wanted) max_candidates = std::max(max_candidates, sequences[b].n_candidates);
  }
  if (max_candidates == 0 || !selection_screen_applies(problem, request, max_candidates)) return;
  ScreenArrays arrays(problem, request, max_candidates);
  arrays.layout.bind(run_scratch(exec, kRunScratchSelectionScreen));
  Screen screen{problem,
                request,
                sequences,
                concat_qbars,
                arrays,
                *select_decode_kernels(d),
                arrays.layout.get<float>(arrays.q_at, arrays.q_count),
                arrays.layout.get<float>(arrays.scores_at, arrays.scores_count),
                arrays.layout.get<float>(arrays.exps_at, arrays.scores_count),
                arrays.layout.get<float>(arrays.chunk_max_at, arrays.chunk_heads),
                arrays.layout.get<float>(arrays.chunk_sum_at, arrays.chunk_heads),
                arrays.layout.get<uint16_t>(arrays.chunk_kmax_at, arrays.chunk_kv),
                arrays.layout.get<unsigned char>(arrays.chunk_bad_at, size_t(batch) * size_t(arrays.chunks)),
                arrays.layout.get<float>(arrays.probe_max_at, size_t(batch) * size_t(kProbePieces) * size_t(hq)),
                arrays.layout.get<float>(arrays.probe_sum_at, size_t(batch) * size_t(kProbePieces) * size_t(hq)),
                arrays.layout.get<uint16_t>(arrays.probe_kmax_at,
                                            size_t(batch) * size_t(kProbePieces) * size_t(problem.num_kv_heads)),
                arrays.layout.get<unsigned char>(arrays.probe_bad_at, size_t(batch) * size_t(kProbePieces)),
                arrays.layout.get<HeadBounds>(arrays.heads_at, arrays.heads_count),
                arrays.layout.get<float>(arrays.lo_at, arrays.votes_count),
                arrays.layout.get<float>(arrays.hi_at, arrays.votes_count),
                arrays.layout.get<unsigned char>(arrays.set_state_at, arrays.sets_count),
                arrays.layout.get<int64_t>(arrays.set_counts_at, 2 * arrays.sets_count),
                arrays.layout.get<int32_t>(arrays.in_at, arrays.votes_count),
                arrays.layout.get<int32_t>(arrays.undecided_at, arrays.undecided_count),
                arrays.layout.get<int32_t>(arrays.heavy_at, arrays.heavy_count),
                arrays.layout.get<int64_t>(arrays.heavy_counts_at, arrays.heavy_counts_count),
                arrays.layout.get<float>(arrays.light_at, arrays.light_count),
                arrays.layout.get<double>(arrays.u_terms_at, 2 * arrays.kv_count * size_t(arrays.undecided_capacity)),
                arrays.layout.get<unsigned char>(arrays.kv_ok_at, arrays.kv_count),
                arrays.layout.get<Boundary>(arrays.boundary_at, arrays.sets_count),
                arrays.layout.get<float>(arrays.order_lo_at, arrays.votes_count),
                arrays.layout.get<float>(arrays.order_hi_at, arrays.votes_count),
                arrays.layout.get<int64_t>(arrays.chunk_counts_at, 4 * arrays.sets_count * size_t(arrays.chunks)),
                arrays.layout.get<int32_t>(arrays.chunk_undecided_at, arrays.votes_count)};
  // The screen takes a wanted sequence whose q̄ are floats (every decode: q̄ is the query row widened), so the
  // oracle's products with K are exact (score_tile_exact_products) and fp32(scale · q̄) is within the bound.
  unsigned char* taken = certified;  // marks the sequences in play until the verdicts at the end
  for (int32_t b = 0; b < batch; ++b) {
    const ScreenSequence& seq = sequences[b];
    const double* qbar = concat_qbars + int64_t(b) * hq * d;
    const bool wanted = seq.wanted && request.top_k > 0 && seq.n_candidates > request.top_k;
    taken[b] = wanted && scaled_floats(qbar, int64_t(hq) * d, request.score_scale, screen.q + int64_t(b) * hq * d);
  }
  const int64_t chunks = arrays.chunks;
  const auto in_range = [&](int32_t b, int64_t chunk) {
    return taken[b] && chunk * kChunkCandidates < sequences[b].n_candidates;
  };
  // Step 1 on each sequence's probe rows, which say whether its softmax looks peaked enough; then the rest.
  const auto chunk_end = [&](int32_t b, int64_t chunk) {
    return std::min(sequences[b].n_candidates, (chunk + 1) * kChunkCandidates);
  };
  const auto probe_end = [&](int32_t b) { return std::min(kProbeCandidates, chunk_end(b, 0)); };
  parallel_items(exec, int64_t(batch) * kProbePieces, [&](int64_t item, int worker) {
    const int32_t b = int32_t(item / kProbePieces);
    const int64_t piece = item % kProbePieces, first = piece * kTileKeys;
    if (!in_range(b, 0) || first >= probe_end(b)) return;
    const int64_t last = std::min(first + kTileKeys, probe_end(b));
    screen.score_rows(b, first, last, screen.probe_stats(b, piece), true, policy_scratch(exec, worker));
    if (!screen.probe_bad[int64_t(b) * kProbePieces + piece]) screen.probe_sums(b, piece, first, last);
  });
  for (int32_t b = 0; b < batch; ++b) {
    if (!taken[b]) continue;
    const int64_t n_pieces = ceil_div(probe_end(b), kTileKeys);
    screen.gather_probe(b, n_pieces);
    taken[b] = !screen.chunk_bad[int64_t(b) * chunks] && !screen.predicts_flat(b, n_pieces);
  }
  parallel_items(exec, int64_t(batch) * chunks, [&](int64_t item, int worker) {
    const int32_t b = int32_t(item / chunks);
    const int64_t chunk = item % chunks;
    if (!in_range(b, chunk)) return;
    const int64_t first = chunk == 0 ? probe_end(b) : chunk * kChunkCandidates;  // chunk 0 adds to the probe's
    screen.score_rows(b, first, chunk_end(b, chunk), screen.chunk_stats(b, chunk), chunk > 0,
                      policy_scratch(exec, worker));
  });
  for (int32_t b = 0; b < batch; ++b) taken[b] = taken[b] && screen.bound_heads(b);
  parallel_items(exec, int64_t(batch) * chunks, [&](int64_t item, int) {
    const int32_t b = int32_t(item / chunks);
    if (in_range(b, item % chunks)) screen.exp_chunk(b, item % chunks);
  });
  for (int32_t b = 0; b < batch; ++b) taken[b] = taken[b] && screen.bound_sums(b);
  parallel_items(exec, int64_t(batch) * request.n_sets * chunks, [&](int64_t item, int) {
    const int32_t b = int32_t(item / (int64_t(request.n_sets) * chunks));
    const int32_t set = int32_t(item / chunks % request.n_sets);
    if (in_range(b, item % chunks)) screen.vote_chunk(b, set, item % chunks);
  });
  const int64_t n_sets = request.n_sets, kv_per_set = arrays.kv_per_set;
  const auto selection_of = [&](int32_t b, int32_t set) {
    return selections + b * selection_len + set * set_stride;
  };
  parallel_items(exec, batch * n_sets, [&](int64_t item, int worker) {
    screen.set_state[item] = Screen::kSetFailed;
    if (taken[item / n_sets])
      screen.sample_set(int32_t(item / n_sets), int32_t(item % n_sets), policy_scratch(exec, worker));
  });
  parallel_items(exec, batch * n_sets * chunks, [&](int64_t item, int) {
    screen.boundary_chunk(int32_t(item / (n_sets * chunks)), int32_t(item / chunks % n_sets), item % chunks);
  });
  parallel_items(exec, batch * n_sets * 2, [&](int64_t item, int) {
    screen.boundary_set(int32_t(item / (n_sets * 2)), int32_t(item / 2 % n_sets), int(item % 2));
  });
  parallel_items(exec, batch * n_sets * chunks, [&](int64_t item, int) {
    screen.classify_chunk(int32_t(item / (n_sets * chunks)), int32_t(item / chunks % n_sets), item % chunks);
  });
  parallel_items(exec, batch * n_sets, [&](int64_t item, int) {
    const int32_t b = int32_t(item / n_sets), set = int32_t(item % n_sets);
    screen.gather_set(b, set, selection_of(b, set));
  });
  parallel_items(exec, batch * n_sets * chunks, [&](int64_t item, int) {
    screen.split_chunk(int32_t(item / (n_sets * chunks)), int32_t(item / chunks % n_sets), item % chunks);
  });
  parallel_items(exec, batch * n_sets * kv_per_set, [&](int64_t item, int worker) {
    screen.resolve_kv(int32_t(item / (n_sets * kv_per_set)), int32_t(item / kv_per_set % n_sets),
                      int32_t(item % kv_per_set), policy_scratch(exec, worker));
  });
  parallel_items(exec, batch * n_sets, [&](int64_t item, int worker) {
    const int32_t b = int32_t(item / n_sets), set = int32_t(item % n_sets);
    screen.choose_set(b, set, selection_of(b, set), policy_scratch(exec, worker));
  });
  for (int32_t b = 0; b < batch; ++b) {
    bool all = taken[b];
    for (int32_t set = 0; set < request.n_sets; ++set)
      all = all && screen.set_state[screen.set_index(b, set)] == Screen::kSetWritten;
    certified[b] = all;
    if (all) scores[b] = screen.rows(b);
  }
}

}  // namespace sparsa::cpu
