// TOKEN_SELECT (§6) on the CPU: head soft vote over candidate tokens, a shared (or per-kv-head) index set, attention
// over it; plus the selection cache of §6.5 (CpuSelectionCache, make_cpu_selection_cache).
//
// A run goes in phases, each parallel over independent items, so results never depend on the thread count:
//   0. per sequence: sizes, dense fallback, every check that can fail (nothing is written before it ends);
//   1. q̄_h = mean of the call's query rows, float64, per (b, h);
//   2. selection-cache lookups per sequence (serial, O(B·Hq·D));
//   3. sequences without a cache hit: scores, per-head softmax over the candidates, vote, top-k → T. A decode on a
//      16-bit cache first goes through the fp32 screen (select_screen.h), which certifies the float64 T from fp32
//      scores; the float64 steps (parallel over kv heads, then candidate chunks, then sets) take what it cannot;
//   4. cache stores and counts (serial);
//   5. selected_indices per (b, set);
//   6. attention per (b, h) over I = sinks ∪ T ∪ local, causal (bottom-right).
#include "cpu_token_select.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <memory>
#include <numeric>
#include <vector>

#include "../../src/common/policy_sizes.h"
#include "../../src/error.h"
#include "../../src/tensor_util.h"  // ceil_div
#include "attention_loop.h"
#include "cache_prefetch.h"
#include "cpu_convert.h"
#include "cpu_select_util.h"
#include "cpu_utilities.h"
#include "../../src/common/fixed_point_sum.h"
#include "select_scores.h"
#include "select_screen.h"
#include "select_softmax.h"

namespace sparsa::cpu {
namespace {

// ---------------------------------------------------------------------------------------------------------------
// The selection cache (§6.5): one slot per batch row holding the last concat_h q̄_h and the T it produced.
// ---------------------------------------------------------------------------------------------------------------

class CpuSelectionCache final : public SelectionCacheState {
 public:
  explicit CpuSelectionCache(const SelectionCacheDims& dims)
      : dims_(dims),
        qbar_capacity_(int64_t(dims.num_q_heads) * dims.head_dim),
        selection_capacity_(int64_t(std::max(dims.num_kv_heads, 1)) * dims.max_top_k),
        slots_(size_t(dims.max_batch)),
        qbars_(size_t(dims.max_batch) * size_t(qbar_capacity_)),
        selections_(size_t(dims.max_batch) * size_t(selection_capacity_)) {}

  const SelectionCacheDims& dims() const override { return dims_; }
  void reset() override {
    for (Slot& slot : slots_) slot = Slot{};
    total_ = SelectionCacheRunCounts{};
    last_run_ = SelectionCacheRunCounts{};
  }
  void counts(int64_t* hits, int64_t* misses) const override {
    if (hits) *hits = total_.hits;
    if (misses) *misses = total_.misses;
  }

  int64_t qbar_capacity() const { return qbar_capacity_; }
  int64_t selection_capacity() const { return selection_capacity_; }
  const SelectionCacheRunCounts& last_run() const { return last_run_; }
  void begin_run() { last_run_ = SelectionCacheRunCounts{}; }
  void count(bool hit) {
    int64_t& counter = hit ? last_run_.hits : last_run_.misses;
    int64_t& total = hit ? total_.hits : total_.misses;
    ++counter;
    ++total;
  }

  // True when slot b holds a selection this call may reuse: filled with the same layout (q̄ length, number of sets,
  // top_k), cos(concat q̄, cached) >= theta (a zero vector has no direction: never similar), and every cached id a
  // candidate of the current call, in [candidate_begin, candidate_end). Anything else is a miss.
  bool can_reuse(int32_t b, const double* qbar, int64_t qbar_len, int32_t n_sets, int64_t top_k, double theta,
                 int64_t candidate_begin, int64_t candidate_end) const {
    const Slot& slot = slots_[size_t(b)];
    if (!slot.filled || slot.qbar_len != qbar_len || slot.n_sets != n_sets || slot.top_k != top_k) return false;
    const double* cached = slot_qbar(b);
    double dot = 0.0, norm_now = 0.0, norm_cached = 0.0;
    for (int64_t i = 0; i < qbar_len; ++i) {
      dot += qbar[i] * cached[i];
      norm_now += qbar[i] * qbar[i];
      norm_cached += cached[i] * cached[i];
    }
    if (norm_now <= 0.0 || norm_cached <= 0.0) return false;
    if (dot / (std::sqrt(norm_now) * std::sqrt(norm_cached)) < theta) return false;
    const int32_t* ids = slot_selections(b);
    for (int64_t i = 0; i < int64_t(n_sets) * top_k; ++i) {
      if (ids[i] < candidate_begin || ids[i] >= candidate_end) return false;
    }
    return true;
  }
  // Copies slot b's T (n_sets × top_k, ascending per set) into `selections`.
  void load(int32_t b, int32_t n_sets, int64_t top_k, int64_t* selections) const {
    const int32_t* ids = slot_selections(b);
    std::copy(ids, ids + int64_t(n_sets) * top_k, selections);
  }
  void store(int32_t b, const double* qbar, int64_t qbar_len, int32_t n_sets, int64_t top_k,
             const int64_t* selections) {
    Slot& slot = slots_[size_t(b)];
    slot.filled = true;
    slot.qbar_len = qbar_len;
    slot.n_sets = n_sets;
    slot.top_k = top_k;
    std::copy(qbar, qbar + qbar_len, slot_qbar(b));
    int32_t* ids = slot_selections(b);
    for (int64_t i = 0; i < int64_t(n_sets) * top_k; ++i) ids[i] = int32_t(selections[i]);
  }

 private:
  struct Slot {
    bool filled = false;
    int64_t qbar_len = 0;
    int32_t n_sets = 0;
    int64_t top_k = 0;
  };
  double* slot_qbar(int32_t b) { return qbars_.data() + int64_t(b) * qbar_capacity_; }
  const double* slot_qbar(int32_t b) const { return qbars_.data() + int64_t(b) * qbar_capacity_; }
  int32_t* slot_selections(int32_t b) { return selections_.data() + int64_t(b) * selection_capacity_; }
  const int32_t* slot_selections(int32_t b) const { return selections_.data() + int64_t(b) * selection_capacity_; }

  SelectionCacheDims dims_;
  int64_t qbar_capacity_;      // Hq · D of the dims
  int64_t selection_capacity_;  // max(Hkv, 1) · max_top_k of the dims
  std::vector<Slot> slots_;
  std::vector<double> qbars_;       // [max_batch, qbar_capacity]
  std::vector<int32_t> selections_;  // [max_batch, selection_capacity]
  SelectionCacheRunCounts total_;    // since creation or reset
  SelectionCacheRunCounts last_run_;  // of the most recent run
};

// ---------------------------------------------------------------------------------------------------------------
// The policy.
// ---------------------------------------------------------------------------------------------------------------

struct SelectParams {
  int64_t n_init = 0;
  int64_t n_local = 0;
  int64_t top_k = 0;
  // Room per set for T: min(top_k, longest N). A sequence selects only when top_k < its N, so T always fits, and a
  // huge top_k (which makes every sequence dense) sizes nothing.
  int64_t top_k_stride = 0;
  bool scale_scores = false;
  double cache_theta = 1.0;
  int32_t n_sets = 1;         // 1 shared set, or Hkv with per_kv_head
  int32_t heads_per_set = 1;  // query heads voting for one set
};

// The selection's s = score_scale · q̄·k: the attention's scale with select_scale_scores, else 1.
double selection_score_scale(const AttentionProblem& problem, const SelectParams& params) {
  return params.scale_scores ? double(problem.scale) : 1.0;
}

// What phase 0 decided for one sequence.
struct SequencePlan {
  int64_t seq_q = 0;
  int64_t seq_k = 0;
  bool dense = false;        // §6.2: n_init + top_k + n_local >= N
  bool cache_hit = false;    // T comes from the selection cache
  bool cache_miss = false;   // T computed and stored into the cache afterwards
  int64_t candidate_begin = 0;  // C = [n_init, N - n_local)
  int64_t candidate_end = 0;
  int64_t n_candidates() const { return candidate_end - candidate_begin; }
  bool has_rows() const { return seq_q > 0; }
  bool selects() const { return has_rows() && !dense; }
};

// Size of I for a sequence: [0, N) when dense, else n_init + top_k + n_local.
int64_t index_set_size(const SequencePlan& plan, const SelectParams& params) {
  return plan.dense ? plan.seq_k : token_select_set_size(params.n_init, params.top_k, params.n_local);
}

// Writes I = [0, n_init) ∪ T ∪ [N - n_local, N) to ids (ascending, because T lies inside the candidates), or
// [0, N) when dense; returns its size (index_set_size).
int64_t build_index_set(const SequencePlan& plan, const SelectParams& params, const int64_t* selection,
                        int64_t* ids) {
  if (plan.dense) {
    std::iota(ids, ids + plan.seq_k, int64_t{0});
    return plan.seq_k;
  }
  int64_t n = 0;
  for (int64_t t = 0; t < plan.candidate_begin; ++t) ids[n++] = t;
  for (int64_t i = 0; i < params.top_k; ++i) ids[n++] = selection[i];
  for (int64_t t = plan.candidate_end; t < plan.seq_k; ++t) ids[n++] = t;
  return n;
}

// Candidates one vote work item covers: about two items per worker, so that even one decode sequence keeps every
// worker busy, within [kMinCandidatesPerVoteItem, kMaxCandidatesPerVoteItem]. Items of 2048 left half of 8 workers
// idle in the float64 scoring at 8K keys (TOKEN_SELECT on a flat softmax, fp16 decode, GQA 32/8, the H200 host's
// Xeon: 1.72 ms with 8 threads, 1.03 with items of 512); with one thread, items of 512 made that scoring at 32K keys
// about a fifth slower (each item starts its fetches ahead afresh). Where the items end changes no result: each
// candidate's scores and vote are its own, and Z_h is a FixedPointSum.
constexpr int64_t kMinCandidatesPerVoteItem = 512;
constexpr int64_t kMaxCandidatesPerVoteItem = 2048;
int64_t candidates_per_vote_item(int64_t max_candidates, int32_t batch, int workers) {
  const int64_t chunks_wanted = ceil_div(2 * int64_t(workers), std::max<int32_t>(1, batch));
  const int64_t per_item = ceil_div(ceil_div(max_candidates, chunks_wanted), kScoreTileKeys) * kScoreTileKeys;
  return std::clamp(per_item, kMinCandidatesPerVoteItem, kMaxCandidatesPerVoteItem);
}
// The scoring pass fetches K this many tiles ahead, into L2: with fetches into L1 one tile ahead (the rows of a
// tile's kv head at once) a 32K-key fp16 decode scored at 61 ns per key and kv head, with these at 42 (Zen 4, one
// thread); L1 fetches stall once the core's miss buffers are full.
constexpr int64_t kPrefetchTilesAhead = 2;

// Phase 3 works on s[h, t] = q̄_h·K[t, h/g] (· scale when asked) over the candidates t ∈ C, in three steps:
//   3a the softmax max m_h and denominator Z_h = Σ_t exp(s − m_h) of each query head (a FixedPointSum: the same bits
//      in any order and any split, which context-parallel selection relies on too);
//   3b per (b, set, chunk of C): vote[t] = Σ_h exp(s[h, t] − m_h) / Z_h over the set's heads, ascending;
//   3c per (b, set): T = the top_k candidates by vote (ties: smaller id), ascending.
// When the run's [B, Hq, |C|] float64 scores fit kMaxKeptScoreBytes they are kept ([|C|, g] per (b, kv head)) and
// 3a runs per chunk of candidates: each scoring item takes its chunk's maxima, and after m_h each (b, kv head, chunk)
// turns its scores into exp(s − m_h) and sums them, so every score and every exp is computed once and 3a spreads
// over every worker (as one item per kv head it left half of 16 workers idle). Above that, 3a runs per (b, kv head)
// and 3b recomputes the scores (bit-identical). Both give the same m_h and Z_h: the std::max fold keeps the first of
// equal maxima and never takes NaN, so the fold of the chunks' folds is the whole fold, and Z_h is a FixedPointSum.
constexpr size_t kMaxKeptScoreBytes = size_t(64) << 20;
struct VoteInputs {
  const AttentionProblem& problem;
  const SelectParams& params;
  double score_scale;
};

// 3a without kept scores, kv head hk of sequence b: scores its candidates into scratch and writes m_h, Z_h of its g
// query heads to head_max/head_sum (indexed by h).
void head_softmax_stats(const VoteInputs& in, const SequencePlan& plan, int32_t b, int32_t hk,
                        const double* concat_qbar, ThreadScratch& scratch, double* head_max, double* head_sum) {
  const AttentionProblem& problem = in.problem;
  const int32_t d = problem.head_dim;
  const int32_t group = problem.num_q_heads / problem.num_kv_heads;
  const int32_t first_head = hk * group;
  const int64_t n_candidates = plan.candidate_end - plan.candidate_begin;
  const double* qbars = concat_qbar + int64_t(first_head) * d;  // the group's q̄, [g, d]
  ScratchLayout layout;
  const size_t transposed_at = layout.add<float>(score_tile_scratch_floats(d));
  const size_t scores_at = layout.add<double>(size_t(group) * size_t(n_candidates));  // [C, g]
  const size_t sums_at = layout.add<FixedPointSum>(size_t(group));
  layout.bind(scratch);
  float* transposed = layout.get<float>(transposed_at, score_tile_scratch_floats(d));
  FixedPointSum* sums = layout.get<FixedPointSum>(sums_at, size_t(group));
  double* scores = layout.get<double>(scores_at, size_t(group) * size_t(n_candidates));
  const SelectScoreKernel& kernel = select_score_kernel();
  const unsigned char* k_base = static_cast<const unsigned char*>(problem.k.t.data);
  const int64_t eb = element_bytes(problem.dtype);
  const void* rows[kScoreTileKeys];
  const auto score_tile = qbars_are_floats(qbars, int64_t(group) * d) ? kernel.score_tile_exact_products
                                                                       : kernel.score_tile;
  for (int64_t c0 = 0; c0 < n_candidates; c0 += kScoreTileKeys) {
    const int n_keys = int(std::min<int64_t>(kScoreTileKeys, n_candidates - c0));
    for (int key = 0; key < n_keys; ++key)
      rows[key] = k_base + problem.kv_offset(problem.k, b, plan.candidate_begin + c0 + key, hk) * eb;
    score_tile(qbars, group, rows, problem.dtype, n_keys, d, in.score_scale, transposed, scores + c0 * group, group);
  }
  const SelectSoftmaxKernel& softmax = select_softmax_kernel();
  softmax.max_per_head(scores, n_candidates * group, group, head_max + first_head);
  for (int32_t l = 0; l < group; ++l) sums[l] = FixedPointSum{};
  softmax.exp_and_sum(scores, n_candidates * group, group, head_max + first_head, sums);
  for (int32_t l = 0; l < group; ++l) head_sum[first_head + l] = sums[l].value();
}

// 3a's first part with kept scores, candidates [first, last) of sequence b: their scores for every kv head
// (score_keys_all_kv_heads) into kept ([Hkv][|C|, g] of b), and each query head's maximum over them into chunk_max
// (indexed by h).
void score_candidates_all_heads(const VoteInputs& in, const SequencePlan& plan, int32_t b, int64_t first,
                                int64_t last, const double* concat_qbar, ThreadScratch& scratch, double* kept,
                                int64_t kept_stride, double* chunk_max) {
  const int32_t d = in.problem.head_dim;
  const int32_t group = in.problem.num_q_heads / in.problem.num_kv_heads;
  ScratchLayout layout;
  const size_t transposed_at = layout.add<float>(score_tile_scratch_floats(d));
  layout.bind(scratch);
  float* transposed = layout.get<float>(transposed_at, score_tile_scratch_floats(d));
  score_keys_all_kv_heads(in.problem, b, plan.candidate_begin + first, last - first, concat_qbar, in.score_scale,
                          transposed, kept + first * group, kept_stride);
  const SelectSoftmaxKernel& softmax = select_softmax_kernel();
  for (int32_t hk = 0; hk < in.problem.num_kv_heads; ++hk)
    softmax.max_per_head(kept + hk * kept_stride + first * group, (last - first) * group, group,
                         chunk_max + hk * group);
}

// 3b for candidates [first, last) (offsets into C) of (b, set): votes[c] for each.
// kept_scores: null (recompute), or 3a's exp(s − m_h) of sequence b, [Hkv][|C|, g] with kv head stride kept_stride.
void vote_candidates(const VoteInputs& in, const SequencePlan& plan, int32_t b, int32_t set, int64_t first,
                     int64_t last, const double* concat_qbar, const double* kept_scores, int64_t kept_stride,
                     const double* head_max, const double* head_sum, ThreadScratch& scratch, double* votes) {
  const AttentionProblem& problem = in.problem;
  const int32_t d = problem.head_dim;
  const int32_t group = problem.num_q_heads / problem.num_kv_heads;
  const int32_t first_head = set * in.params.heads_per_set;
  const int32_t n_heads = in.params.heads_per_set;
  const int32_t first_kv_head = first_head / group;
  const int32_t n_kv_heads = n_heads / group;
  const size_t group_qbars = interleaved_size(group, d);
  ScratchLayout layout;
  const size_t row_at = layout.add<float>(size_t(d));
  const size_t qbars_at = layout.add<double>(group_qbars * size_t(n_kv_heads));
  const size_t scores_at = layout.add<double>(size_t(n_heads));
  layout.bind(scratch);
  float* key_row = layout.get<float>(row_at, size_t(d));
  double* qbars = layout.get<double>(qbars_at, group_qbars * size_t(n_kv_heads));
  double* scores = layout.get<double>(scores_at, size_t(n_heads));
  std::fill(qbars, qbars + group_qbars * size_t(n_kv_heads), 0.0);
  for (int32_t l = 0; l < n_heads; ++l) {
    interleave_vector(qbars + (l / group) * group_qbars, l % group, concat_qbar + int64_t(first_head + l) * d, d);
  }
  if (kept_scores) {
    select_softmax_kernel().vote(kept_scores + first_kv_head * kept_stride, kept_stride, group, n_heads,
                                 head_sum + first_head, first, last, votes);
    return;
  }
  for (int64_t c = first; c < last; ++c) {
    for (int32_t g = 0; g < n_kv_heads; ++g) {
      load_row_f32(problem.dtype, problem.k.t.data,
                   problem.kv_offset(problem.k, b, plan.candidate_begin + c, first_kv_head + g), d, key_row);
      interleaved_dots(qbars + g * group_qbars, group, key_row, d, in.score_scale, scores + g * group);
    }
    double vote = 0.0;
    for (int32_t l = 0; l < n_heads; ++l) {
      const int32_t h = first_head + l;
      const double e = std::exp(scores[l] - head_max[h]);
      vote += e / head_sum[h];
    }
    votes[c] = vote;
  }
}

// 3a with kept scores, every sequence that selects (selects(b)): the chunks' scores and maxima, m_h, then each
// (b, kv head, chunk)'s exps and sums, and Z_h. chunk_max / chunk_sum: [B, chunks, Hq]; kept: [B, Hkv][|C|, g].
template <typename Selects>
void kept_softmax_stats(const VoteInputs& in, const SequencePlan* plans, const Selects& selects,
                        const double* concat_qbars, const ExecContext& exec, int64_t chunks, int64_t per_item,
                        double* kept, int64_t kept_stride, double* chunk_max, FixedPointSum* chunk_sum,
                        double* head_max, double* head_sum) {
  const int32_t batch = in.problem.batch, n_heads = in.problem.num_q_heads, n_kv_heads = in.problem.num_kv_heads;
  const int32_t group = n_heads / n_kv_heads;
  const int64_t qbar_len = int64_t(n_heads) * in.problem.head_dim;
  const auto chunk_range = [&](int32_t b, int64_t chunk) {
    const int64_t first = chunk * per_item;
    return std::make_pair(first, std::min(plans[size_t(b)].n_candidates(), first + per_item));
  };
  const auto n_chunks = [&](int32_t b) { return ceil_div(plans[size_t(b)].n_candidates(), per_item); };
  const auto chunk_stats_at = [&](int32_t b, int64_t chunk) { return (int64_t(b) * chunks + chunk) * n_heads; };
  const auto kept_of = [&](int32_t b, int32_t hk) { return kept + (int64_t(b) * n_kv_heads + hk) * kept_stride; };
  parallel_items(exec, int64_t(batch) * chunks, [&](int64_t item, int worker) {
    const int32_t b = int32_t(item / chunks);
    const auto [first, last] = chunk_range(b, item % chunks);
    if (!selects(b) || first >= last) return;
    score_candidates_all_heads(in, plans[size_t(b)], b, first, last, concat_qbars + b * qbar_len,
                               policy_scratch(exec, worker), kept_of(b, 0), kept_stride,
                               chunk_max + chunk_stats_at(b, item % chunks));
  });
  for (int32_t b = 0; b < batch; ++b) {
    if (!selects(b)) continue;
    for (int32_t h = 0; h < n_heads; ++h) {
      double m = -std::numeric_limits<double>::infinity();
      for (int64_t chunk = 0; chunk < n_chunks(b); ++chunk) m = std::max(m, chunk_max[chunk_stats_at(b, chunk) + h]);
      head_max[int64_t(b) * n_heads + h] = m;
    }
  }
  const SelectSoftmaxKernel& softmax = select_softmax_kernel();
  parallel_items(exec, int64_t(batch) * n_kv_heads * chunks, [&](int64_t item, int) {
    const int32_t b = int32_t(item / (int64_t(n_kv_heads) * chunks));
    const int32_t hk = int32_t(item / chunks % n_kv_heads);
    const int64_t chunk = item % chunks;
    const auto [first, last] = chunk_range(b, chunk);
    if (!selects(b) || first >= last) return;
    FixedPointSum* sums = chunk_sum + chunk_stats_at(b, chunk) + hk * group;
    std::fill(sums, sums + group, FixedPointSum{});
    softmax.exp_and_sum(kept_of(b, hk) + first * group, (last - first) * group, group,
                        head_max + int64_t(b) * n_heads + hk * group, sums);
  });
  for (int32_t b = 0; b < batch; ++b) {
    if (!selects(b)) continue;
    for (int32_t h = 0; h < n_heads; ++h) {
      FixedPointSum z;
      for (int64_t chunk = 0; chunk < n_chunks(b); ++chunk) z.add(chunk_sum[chunk_stats_at(b, chunk) + h]);
      head_sum[int64_t(b) * n_heads + h] = z.value();
    }
  }
}

// Phase 3's run-scratch arrays (slot kRunScratchSelectionVotes): softmax stats [B, Hq] twice, votes
// [B, n_sets, max |C|], and when the scores fit kMaxKeptScoreBytes, the kept scores [B, Hkv][|C|, g] and 3a's
// per-chunk maxima and sums [B, chunks, Hq].
struct VoteArrays {
  ScratchLayout layout;
  size_t stats_count, votes_count, kept_count, chunk_count;
  size_t max_at, sum_at, votes_at, kept_at, chunk_max_at, chunk_sum_at;
  bool keep_scores;
  VoteArrays(const AttentionProblem& problem, const SelectParams& params, int64_t max_candidates, int64_t chunks) {
    stats_count = size_t(problem.batch) * size_t(problem.num_q_heads);
    votes_count = size_t(problem.batch) * size_t(params.n_sets) * size_t(max_candidates);
    kept_count = stats_count * size_t(max_candidates);
    keep_scores = kept_count * sizeof(double) <= kMaxKeptScoreBytes;
    chunk_count = keep_scores ? stats_count * size_t(chunks) : 0;
    max_at = layout.add<double>(stats_count);
    sum_at = layout.add<double>(stats_count);
    votes_at = layout.add<double>(votes_count);
    kept_at = layout.add<double>(keep_scores ? kept_count : 0);
    chunk_max_at = layout.add<double>(chunk_count);
    chunk_sum_at = layout.add<FixedPointSum>(chunk_count);
  }
};

// The run's per-sequence arrays (slot kRunScratchSelection): plans [B], concat q̄ [B, Hq·D], T [B, n_sets, top_k],
// and the fp32 screen's view of the sequences and its verdicts [B].
struct RunArrays {
  ScratchLayout layout;
  size_t batch, qbars_count, selections_count;
  size_t plans_at, qbars_at, selections_at, screen_at, certified_at, screen_scores_at, known_at;
  RunArrays(const AttentionProblem& problem, const SelectParams& params) {
    batch = size_t(problem.batch);
    qbars_count = batch * size_t(problem.num_q_heads) * size_t(problem.head_dim);
    selections_count = batch * size_t(params.n_sets) * size_t(params.top_k_stride);
    plans_at = layout.add<SequencePlan>(batch);
    qbars_at = layout.add<double>(qbars_count);
    selections_at = layout.add<int64_t>(selections_count);
    screen_at = layout.add<ScreenSequence>(batch);
    certified_at = layout.add<unsigned char>(batch);
    screen_scores_at = layout.add<const float*>(batch);
    known_at = layout.add<KnownScores>(batch);
  }
};

ScreenRequest screen_request(const SelectParams& params, double score_scale) {
  ScreenRequest request;
  request.top_k = params.top_k;
  request.n_sets = params.n_sets;
  request.heads_per_set = params.heads_per_set;
  request.score_scale = score_scale;
  return request;
}

// Phase 6's key lists on the decode path (run scratch slot kRunScratchSelectionVotes, after phase 3): I per
// (b, set), [B, n_sets, stride], and their sizes [B, n_sets].
struct DecodeListArrays {
  ScratchLayout layout;
  int64_t stride = 0;
  size_t keys_count, sizes_count, keys_at, sizes_at;
  // plans: null sizes the lists for the longest I any sequence of the problem can have (plan_token_select).
  DecodeListArrays(const AttentionProblem& problem, const SelectParams& params, const SequencePlan* plans) {
    for (int32_t b = 0; b < problem.batch; ++b) {
      if (plans && !plans[size_t(b)].has_rows()) continue;
      SequencePlan worst;
      worst.seq_k = problem.max_seq_k;
      worst.dense = true;
      stride = std::max(stride, index_set_size(plans ? plans[size_t(b)] : worst, params));
    }
    sizes_count = size_t(problem.batch) * size_t(params.n_sets);
    keys_count = sizes_count * size_t(stride);
    keys_at = layout.add<int64_t>(keys_count);
    sizes_at = layout.add<int64_t>(sizes_count);
  }
};

// Phase 3 of a run (see head_softmax_stats): T for every sequence that selects without a cache hit, written to
// selections [B, n_sets, top_k]. concat_qbars: [B, Hq·D]. The fp32 screen (select_screen.h) goes first; the float64
// steps below take the sequences it could not certify. screen / certified / screen_scores: the run's [B] arrays for
// it (screen_selections).
void compute_selections(const AttentionProblem& problem, const SelectParams& params,
                        const SequencePlan* plans, const double* concat_qbars, const ExecContext& exec,
                        int64_t* selections, ScreenSequence* screen, unsigned char* certified,
                        const float** screen_scores) {
  const int32_t batch = problem.batch;
  const int32_t n_heads = problem.num_q_heads;
  const int64_t qbar_len = int64_t(n_heads) * problem.head_dim;
  const int64_t selection_len = int64_t(params.n_sets) * params.top_k_stride;
  const VoteInputs vote_inputs{problem, params, selection_score_scale(problem, params)};
  for (int32_t b = 0; b < batch; ++b) {
    const SequencePlan& plan = plans[size_t(b)];
    screen[b] = ScreenSequence{plan.candidate_begin, plan.n_candidates(), plan.selects() && !plan.cache_hit};
  }
  screen_selections(problem, screen_request(params, vote_inputs.score_scale), screen, concat_qbars, exec, selections,
                    selection_len, params.top_k_stride, certified, screen_scores);
  const auto computes_selection = [&](int32_t b) {
    return plans[size_t(b)].selects() && !plans[size_t(b)].cache_hit && !certified[b];
  };
  int64_t max_candidates = 0;
  for (int32_t b = 0; b < batch; ++b) {
    if (computes_selection(b)) max_candidates = std::max(max_candidates, plans[size_t(b)].n_candidates());
  }
  const int32_t n_kv_heads = problem.num_kv_heads;
  const int32_t group = n_heads / n_kv_heads;
  const int64_t per_item = candidates_per_vote_item(max_candidates, batch, worker_count(exec));
  const int64_t chunks = ceil_div(max_candidates, per_item);
  // Run scratch (kept run after run, grown by plan_token_select).
  VoteArrays arrays(problem, params, max_candidates, chunks);
  arrays.layout.bind(run_scratch(exec, kRunScratchSelectionVotes));
  double* head_max = arrays.layout.get<double>(arrays.max_at, arrays.stats_count);
  double* head_sum = arrays.layout.get<double>(arrays.sum_at, arrays.stats_count);
  double* votes = arrays.layout.get<double>(arrays.votes_at, arrays.votes_count);
  double* kept = arrays.keep_scores ? arrays.layout.get<double>(arrays.kept_at, arrays.kept_count) : nullptr;
  double* chunk_max = arrays.layout.get<double>(arrays.chunk_max_at, arrays.chunk_count);     // [B, chunks, Hq]
  FixedPointSum* chunk_sum = arrays.layout.get<FixedPointSum>(arrays.chunk_sum_at, arrays.chunk_count);
  const int64_t kept_stride = int64_t(group) * max_candidates;  // doubles per (b, kv head)
  const auto votes_of = [&](int32_t b, int32_t set) {
    return votes + (int64_t(b) * params.n_sets + set) * max_candidates;
  };
  const auto kept_of = [&](int32_t b) { return kept ? kept + int64_t(b) * n_kv_heads * kept_stride : kept; };
  const auto chunk_range = [&](int32_t b, int64_t chunk) {
    const int64_t first = chunk * per_item;
    return std::make_pair(first, std::min(plans[size_t(b)].n_candidates(), first + per_item));
  };
  if (kept) {
    kept_softmax_stats(vote_inputs, plans, computes_selection, concat_qbars, exec, chunks, per_item, kept,
                       kept_stride, chunk_max, chunk_sum, head_max, head_sum);
  } else {
    parallel_items(exec, int64_t(batch) * n_kv_heads, [&](int64_t item, int worker) {
      const int32_t b = int32_t(item / n_kv_heads);
      if (!computes_selection(b)) return;
      head_softmax_stats(vote_inputs, plans[size_t(b)], b, int32_t(item % n_kv_heads), concat_qbars + b * qbar_len,
                         policy_scratch(exec, worker), head_max + int64_t(b) * n_heads,
                         head_sum + int64_t(b) * n_heads);
    });
  }
  parallel_items(exec, int64_t(batch) * params.n_sets * chunks, [&](int64_t item, int worker) {
    const int32_t b = int32_t(item / (int64_t(params.n_sets) * chunks));
    const int32_t set = int32_t(item / chunks % params.n_sets);
    const SequencePlan& plan = plans[size_t(b)];
    const auto [first, last] = chunk_range(b, item % chunks);
    if (!computes_selection(b) || first >= last) return;
    vote_candidates(vote_inputs, plan, b, set, first, last, concat_qbars + b * qbar_len, kept_of(b), kept_stride,
                    head_max + int64_t(b) * n_heads, head_sum + int64_t(b) * n_heads, policy_scratch(exec, worker),
                    votes_of(b, set));
  });
  parallel_items(exec, int64_t(batch) * params.n_sets, [&](int64_t item, int worker) {
    const int32_t b = int32_t(item / params.n_sets);
    const int32_t set = int32_t(item % params.n_sets);
    const SequencePlan& plan = plans[size_t(b)];
    if (!computes_selection(b)) return;
    const int64_t n_candidates = plan.n_candidates();
    ScratchLayout layout;
    const size_t order_at = layout.add<int64_t>(size_t(n_candidates));
    layout.bind(policy_scratch(exec, worker));
    int64_t* selection = selections + b * selection_len + set * params.top_k_stride;
    top_k_ids_ascending(votes_of(b, set), n_candidates, params.top_k,
                        layout.get<int64_t>(order_at, size_t(n_candidates)), selection);
    for (int64_t i = 0; i < params.top_k; ++i) selection[i] += plan.candidate_begin;
  });
}

SelectParams resolve_params(const AttentionProblem& problem, const PolicyParams& policy) {
  SelectParams params;
  params.n_init = policy.p.select_n_init;
  params.n_local = policy.p.select_n_local;
  params.top_k = policy.p.select_top_k;
  params.top_k_stride = std::min<int64_t>(params.top_k, problem.max_seq_k);
  params.scale_scores = policy.p.select_scale_scores != 0;
  params.cache_theta = policy.p.select_cache_theta;
  params.n_sets = policy.p.select_per_kv_head ? problem.num_kv_heads : 1;
  params.heads_per_set = problem.num_q_heads / params.n_sets;
  return params;
}

// The CPU cache behind problem.selection_cache, or null when there is none or it is disabled (theta >= 1).
// Checks that it can hold this run's selections.
CpuSelectionCache* active_cache(const AttentionProblem& problem, const SelectParams& params) {
  if (!problem.selection_cache) return nullptr;
  auto* cache = dynamic_cast<CpuSelectionCache*>(problem.selection_cache);
  if (!cache) fail(SPARSA_STATUS_INVALID_ARGUMENT, "selection_cache: expected a cache made by a CPU context");
  cache->begin_run();
  if (params.cache_theta >= 1.0) return nullptr;
  const SelectionCacheDims& dims = cache->dims();
  const int64_t qbar_len = int64_t(problem.num_q_heads) * problem.head_dim;
  if (problem.batch > dims.max_batch || qbar_len > cache->qbar_capacity() || params.top_k > dims.max_top_k ||
      int64_t(params.n_sets) * params.top_k > cache->selection_capacity()) {
    fail(SPARSA_STATUS_SHAPE_MISMATCH, "selection_cache: made for max_batch ", dims.max_batch, ", Hq ",
         dims.num_q_heads, ", Hkv ", dims.num_kv_heads, ", D ", dims.head_dim, ", max_top_k ", dims.max_top_k,
         " but the run has B ", problem.batch, ", Hq ", problem.num_q_heads, ", D ", problem.head_dim, ", ",
         params.n_sets, " selection set(s) of top_k ", params.top_k);
  }
  return cache;
}

}  // namespace

void score_keys_all_kv_heads(const AttentionProblem& problem, int32_t b, int64_t first_key, int64_t n_keys,
                             const double* concat_qbar, double score_scale, float* transposed, double* out,
                             int64_t out_stride) {
  const int32_t d = problem.head_dim;
  const int32_t n_kv_heads = problem.num_kv_heads;
  const int32_t group = problem.num_q_heads / n_kv_heads;
  const SelectScoreKernel& kernel = select_score_kernel();
  const unsigned char* k_base = static_cast<const unsigned char*>(problem.k.t.data);
  const int64_t eb = element_bytes(problem.dtype);
  const int64_t row_bytes = int64_t(d) * eb;
  const auto k_row = [&](int64_t j, int32_t hk) {
    return k_base + problem.kv_offset(problem.k, b, first_key + j, hk) * eb;
  };
  const auto score_tile = qbars_are_floats(concat_qbar, int64_t(n_kv_heads) * group * d)
                              ? kernel.score_tile_exact_products  // every decode: q̄ is a widened query row
                              : kernel.score_tile;
  const void* rows[kScoreTileKeys];
  for (int64_t j0 = 0; j0 < n_keys; j0 += kScoreTileKeys) {
    const int n_tile = int(std::min<int64_t>(kScoreTileKeys, n_keys - j0));
    // The tile kPrefetchTilesAhead ahead is fetched into L2, one share per kv head so that the fetches spread over
    // the tile's work. Where its rows of every kv head form one span (the [B, S, Hkv, D] layout), the shares are
    // consecutive pieces of the span, read in address order; otherwise each kv head fetches its own rows.
    const int64_t ahead = j0 + kPrefetchTilesAhead * kScoreTileKeys;
    const int64_t ahead_keys = std::clamp<int64_t>(n_keys - ahead, 0, kScoreTileKeys);
    const unsigned char* span = ahead_keys > 0 ? k_row(ahead, 0) : nullptr;
    const bool one_span = span && k_row(ahead + ahead_keys - 1, n_kv_heads - 1) + row_bytes - span ==
                                      ahead_keys * n_kv_heads * row_bytes;
    const int64_t share_bytes = one_span ? ahead_keys * row_bytes : 0;  // of the span, per kv head
    for (int32_t hk = 0; hk < n_kv_heads; ++hk) {
      if (one_span) {
        const unsigned char* share = span + hk * share_bytes;
        for (int64_t byte = 0; byte < share_bytes; byte += kCacheLineBytes) prefetch_line_to_l2(share + byte);
      } else {
        for (int64_t j = ahead; j < ahead + ahead_keys; ++j) {
          const unsigned char* row = k_row(j, hk);
          for (int64_t byte = 0; byte < row_bytes; byte += kCacheLineBytes) prefetch_line_to_l2(row + byte);
        }
      }
      for (int key = 0; key < n_tile; ++key) rows[key] = k_row(j0 + key, hk);
      score_tile(concat_qbar + int64_t(hk) * group * d, group, rows, problem.dtype, n_tile, d, score_scale,
                 transposed, out + hk * out_stride + j0 * group, group);
    }
  }
}


std::unique_ptr<SelectionCacheState> make_cpu_selection_cache(const SelectionCacheDims& dims) {
  return std::make_unique<CpuSelectionCache>(dims);
}

SelectionCacheRunCounts selection_cache_run_counts(const SelectionCacheState* cache) {
  const auto* cpu_cache = dynamic_cast<const CpuSelectionCache*>(cache);
  return cpu_cache ? cpu_cache->last_run() : SelectionCacheRunCounts{};
}

void plan_token_select(const AttentionProblem& problem, const PolicyParams& policy, const ExecContext& exec) {
  const SelectParams params = resolve_params(problem, policy);
  run_scratch(exec, kRunScratchSelection).reserve(RunArrays(problem, params).layout.floats());
  // The largest candidate set any sequence can have, and the largest whose scores are still kept.
  const int64_t worst = std::max<int64_t>(0, problem.max_seq_k - params.n_init - params.n_local);
  const size_t per_candidate = size_t(problem.batch) * size_t(problem.num_q_heads) * sizeof(double);
  const int64_t largest_kept =
      std::min<int64_t>(worst, int64_t(kMaxKeptScoreBytes / std::max<size_t>(per_candidate, 1)));
  // The most chunks a run's vote items can make (candidates_per_vote_item: about 2·workers / B, more only where
  // items reach kMaxCandidatesPerVoteItem).
  const int64_t most_chunks = std::max(ceil_div(2 * int64_t(worker_count(exec)), std::max<int32_t>(1, problem.batch)),
                                       ceil_div(worst, kMaxCandidatesPerVoteItem));
  run_scratch(exec, kRunScratchSelectionVotes)
      .reserve(std::max({VoteArrays(problem, params, worst, most_chunks).layout.floats(),
                         VoteArrays(problem, params, largest_kept, most_chunks).layout.floats(),
                         decode_lists_apply(problem) ? DecodeListArrays(problem, params, nullptr).layout.floats() : 0}));
  if (decode_lists_apply(problem)) reserve_decode_lists_scratch(problem, problem.max_seq_k, exec);
  const ScreenRequest request = screen_request(params, selection_score_scale(problem, params));
  if (selection_screen_applies(problem, request, worst)) {
    run_scratch(exec, kRunScratchSelectionScreen).reserve(selection_screen_scratch_floats(problem, request, worst));
    const size_t worker_floats = selection_screen_worker_floats(problem, worst);
    for (int w = 0; w < worker_count(exec); ++w) policy_scratch(exec, w).reserve(worker_floats);
  }
}

void run_token_select(const AttentionProblem& problem, const PolicyParams& policy, const OutputSink& sink,
                      const ExecContext& exec) {
  const SelectParams params = resolve_params(problem, policy);
  const int32_t batch = problem.batch;
  const int32_t n_heads = problem.num_q_heads;
  const int32_t d = problem.head_dim;
  const int64_t qbar_len = int64_t(n_heads) * d;
  const int64_t kept_always = params.n_init + params.n_local;

  // Phase 0: plans and checks; nothing is written before this ends.
  CpuSelectionCache* cache = active_cache(problem, params);
  // Per-run arrays live in run scratch (kept run after run, grown by plan_token_select).
  const int64_t selection_len = int64_t(params.n_sets) * params.top_k_stride;
  RunArrays arrays(problem, params);
  arrays.layout.bind(run_scratch(exec, kRunScratchSelection));
  SequencePlan* plans = arrays.layout.get<SequencePlan>(arrays.plans_at, arrays.batch);
  double* concat_qbars = arrays.layout.get<double>(arrays.qbars_at, arrays.qbars_count);
  int64_t* selections = arrays.layout.get<int64_t>(arrays.selections_at, arrays.selections_count);
  ScreenSequence* screen = arrays.layout.get<ScreenSequence>(arrays.screen_at, arrays.batch);
  unsigned char* certified = arrays.layout.get<unsigned char>(arrays.certified_at, arrays.batch);
  const float** screen_scores = arrays.layout.get<const float*>(arrays.screen_scores_at, arrays.batch);
  std::fill(concat_qbars, concat_qbars + arrays.qbars_count, 0.0);
  std::fill(selections, selections + arrays.selections_count, int64_t{0});
  for (int32_t b = 0; b < batch; ++b) {
    SequencePlan& plan = plans[size_t(b)];
    plan.seq_q = problem.seq_len_q(b);
    plan.seq_k = problem.seq_len_k(b);
    plan.dense = kept_always + params.top_k >= plan.seq_k;
    plan.candidate_begin = params.n_init;
    plan.candidate_end = plan.seq_k - params.n_local;
    if (plan.has_rows()) require_selected_capacity(problem, index_set_size(plan, params), b, "TOKEN_SELECT");
  }

  // Phase 1: q̄_h per (b, h) in float64, laid out as concat_h q̄_h per sequence (the cache's key).
  parallel_items(exec, int64_t(batch) * n_heads, [&](int64_t item, int worker) {
    const int32_t b = int32_t(item / n_heads);
    const int32_t h = int32_t(item % n_heads);
    const SequencePlan& plan = plans[size_t(b)];
    if (!plan.selects()) return;
    ScratchLayout layout;
    const size_t row_at = layout.add<float>(size_t(d));
    layout.bind(policy_scratch(exec, worker));
    float* row = layout.get<float>(row_at, size_t(d));
    double* qbar = concat_qbars + b * qbar_len + int64_t(h) * d;
    for (int64_t i = 0; i < plan.seq_q; ++i) {
      load_row_f32(problem.dtype, problem.q.t.data, problem.q_offset(problem.q, b, i, h), d, row);
      for (int32_t c = 0; c < d; ++c) qbar[c] += double(row[c]);
    }
    for (int32_t c = 0; c < d; ++c) qbar[c] /= double(plan.seq_q);
  });

  // Phase 2: cache lookups. T is [B, n_sets, top_k], ascending per set.
  for (int32_t b = 0; b < batch; ++b) {
    SequencePlan& plan = plans[size_t(b)];
    if (!cache || !plan.selects()) continue;
    plan.cache_hit = cache->can_reuse(b, concat_qbars + b * qbar_len, qbar_len, params.n_sets, params.top_k,
                                      params.cache_theta, plan.candidate_begin, plan.candidate_end);
    plan.cache_miss = !plan.cache_hit;
    if (plan.cache_hit) cache->load(b, params.n_sets, params.top_k, selections + b * selection_len);
  }

  // Phase 3: head soft vote and top-k for every selecting sequence without a hit.
  compute_selections(problem, params, plans, concat_qbars, exec, selections, screen, certified, screen_scores);

  // Phase 4: store what was computed and count.
  for (int32_t b = 0; b < batch; ++b) {
    const SequencePlan& plan = plans[size_t(b)];
    if (!cache || !plan.selects()) continue;
    if (plan.cache_miss) {
      cache->store(b, concat_qbars + b * qbar_len, qbar_len, params.n_sets, params.top_k,
                   selections + b * selection_len);
    }
    cache->count(plan.cache_hit);
  }

  // Phase 5: selected_indices [B, n_sets, cap]: I per (b, set); all -1 for a sequence with no query row.
  if (problem.selected_indices.present) {
    parallel_items(exec, int64_t(batch) * params.n_sets, [&](int64_t item, int worker) {
      const int32_t b = int32_t(item / params.n_sets);
      const int32_t set = int32_t(item % params.n_sets);
      const SequencePlan& plan = plans[size_t(b)];
      const int64_t max_ids = plan.has_rows() ? index_set_size(plan, params) : 0;
      ScratchLayout layout;
      const size_t ids_at = layout.add<int64_t>(size_t(max_ids));
      layout.bind(policy_scratch(exec, worker));
      int64_t* ids = layout.get<int64_t>(ids_at, size_t(max_ids));
      const int64_t n_ids =
          plan.has_rows() ? build_index_set(plan, params, selections + b * selection_len + set * params.top_k_stride,
                                            ids)
                          : 0;
      write_selected_set(problem.selected_indices, b, set, ids, n_ids);
    });
  }

  // Phase 6, decode on a 16-bit cache: the sets' I as key lists (in the vote arrays' run scratch, which phase 3 no
  // longer needs), attended with the dense decode kernels, every key of a list read once for all its kv heads. Where
  // the screen certified T, its fp32 scores of the candidates stand in for reading their K again.
  if (decode_lists_apply(problem)) {
    KnownScores* known = arrays.layout.get<KnownScores>(arrays.known_at, arrays.batch);
    const float factor = float(double(problem.scale) / selection_score_scale(problem, params));
    for (int32_t b = 0; b < batch; ++b) {
      const SequencePlan& plan = plans[size_t(b)];
      const bool screened = plan.selects() && !plan.cache_hit && certified[b];
      known[b] = KnownScores{screened ? screen_scores[b] : nullptr, plan.candidate_begin, plan.n_candidates(),
                             factor};
    }
    DecodeListArrays lists(problem, params, plans);
    lists.layout.bind(run_scratch(exec, kRunScratchSelectionVotes));
    int64_t* keys = lists.layout.get<int64_t>(lists.keys_at, lists.keys_count);
    int64_t* sizes = lists.layout.get<int64_t>(lists.sizes_at, lists.sizes_count);
    parallel_items(exec, int64_t(batch) * params.n_sets, [&](int64_t item, int) {
      const int32_t b = int32_t(item / params.n_sets);
      const int32_t set = int32_t(item % params.n_sets);
      const SequencePlan& plan = plans[size_t(b)];
      sizes[item] = plan.has_rows() ? build_index_set(plan, params,
                                                      selections + b * selection_len + set * params.top_k_stride,
                                                      keys + item * lists.stride)
                                    : 0;
    });
    run_decode_lists(problem, DecodeLists{keys, sizes, lists.stride, params.n_sets, known}, sink, exec);
    return;
  }

  // Phase 6: every row of every head attends over its set's I, causal with the bottom-right offset N - Sq. The
  // heads of a kv group share a set (sets are per kv head or shared), so decode-sized sequences stack the group's
  // rows into one tile (each K/V tile converted once per group; bit-identical results) when that still leaves a
  // work item per worker.
  const int32_t group = n_heads / problem.num_kv_heads;
  const bool stack = group > 1 && problem.max_seq_q > 0 && int64_t(problem.max_seq_q) * group <= kMaxStackedRows &&
                     int64_t(batch) * problem.num_kv_heads >= worker_count(exec);
  const int32_t heads_per_item = stack ? group : 1;
  const int32_t head_items = n_heads / heads_per_item;
  parallel_items(exec, int64_t(batch) * head_items, [&](int64_t item, int worker) {
    const int32_t b = int32_t(item / head_items);
    const int32_t h_first = int32_t(item % head_items) * heads_per_item;
    const SequencePlan& plan = plans[size_t(b)];
    if (!plan.has_rows()) return;
    const int32_t set = h_first / params.heads_per_set;
    const int64_t max_ids = index_set_size(plan, params);
    ScratchLayout layout;
    const size_t ids_at = layout.add<int64_t>(size_t(max_ids));
    const size_t rows_at = layout.add<int64_t>(size_t(plan.seq_q));
    const size_t out_at = layout.add<float>(out_rows_count(problem));
    const size_t lse_at = layout.add<float>(lse_rows_count());
    layout.bind(policy_scratch(exec, worker));
    int64_t* ids = layout.get<int64_t>(ids_at, size_t(max_ids));
    int64_t* rows = layout.get<int64_t>(rows_at, size_t(plan.seq_q));
    float* out_rows = layout.get<float>(out_at, out_rows_count(problem));
    float* lse_rows = layout.get<float>(lse_at, lse_rows_count());
    const int64_t* selection = selections + b * selection_len + set * params.top_k_stride;
    const int64_t n_ids = build_index_set(plan, params, selection, ids);
    std::iota(rows, rows + plan.seq_q, int64_t{0});
    RowVisibility visibility;
    visibility.causal = true;
    visibility.offset = plan.seq_k - plan.seq_q;
    attend_heads_over_keys(problem, b, h_first, heads_per_item, rows, plan.seq_q, ids, n_ids, visibility,
                           /*causal_prefix=*/true, sink, out_rows, lse_rows, &(*exec.counters)[size_t(worker)],
                           loop_scratch(exec, worker));
  });
}

}  // namespace sparsa::cpu
