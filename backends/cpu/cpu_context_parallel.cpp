// Context-parallel TOKEN_SELECT on the CPU (sparsa_cp_select_*, docs/context_parallel.md).
//
// Each step recomputes, on this shard's keys only, exactly the quantities run_token_select computes over the whole
// cache (cpu_token_select.cpp, phase 3): q̄_h the same float64 mean, s[h, t] the same plain channel-order sums (its
// score_keys_all_kv_heads, bit-identical to the sequential loop), exp(s − m_h) with the same global m_h, Z_h the
// same FixedPointSum (order-independent), vote[t] the same sum over the set's heads in ascending order, and the same
// ranking (ranks_before: larger vote, then smaller position). So the index set the four steps produce is the
// single-device one, bit for bit. The maxima, exponentials, sums and votes run through the single run's softmax
// kernels (select_softmax.h: the plain loops' bits in vector lanes). Work within a sequence runs in parallel
// (candidate chunks for the scores and votes, kv heads for the statistics: every result is independent of the
// split); the steps allocate their working arrays per call (decode-sized: B · Hq · |C ∩ shard| float64 scores).
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "../../src/backend.h"
#include "../../src/cp_select_host.h"
#include "../../src/common/policy_sizes.h"
#include "../../src/error.h"
#include "attention_loop.h"
#include "cpu_engine.h"
#include "cpu_select_util.h"
#include "cpu_token_select.h"
#include "cpu_utilities.h"
#include "../../src/common/fixed_point_sum.h"
#include "select_scores.h"
#include "select_softmax.h"

namespace sparsa::cpu {
namespace {

using ShardSequence = CpShardSequence;
using Params = CpSelectParams;

ShardSequence shard_sequence(const CpSelectCall& call, const Params& params, int32_t b) {
  return cp_shard_sequence(params.n_init, params.top_k, params.n_local, call.problem.seq_len_q(b),
                           call.kv_start.ptr<const int32_t>()[b * call.kv_start.stride(0)],
                           call.problem.seq_len_k(b),
                           call.kv_total.ptr<const int32_t>()[b * call.kv_total.stride(0)]);
}

// q̄ of sequence b, concat over heads [Hq · D], as run_token_select's phase 1 computes it.
std::vector<double> mean_queries(const AttentionProblem& pr, int32_t b, int64_t seq_q) {
  const int32_t d = pr.head_dim;
  std::vector<double> qbar(size_t(pr.num_q_heads) * size_t(d), 0.0);
  std::vector<float> row(static_cast<size_t>(d));
  for (int32_t h = 0; h < pr.num_q_heads; ++h) {
    double* out = qbar.data() + int64_t(h) * d;
    for (int64_t i = 0; i < seq_q; ++i) {
      load_row_f32(pr.dtype, pr.q.t.data, pr.q_offset(pr.q, b, i, h), d, row.data());
      for (int32_t c = 0; c < d; ++c) out[c] += double(row[c]);
    }
    for (int32_t c = 0; c < d; ++c) out[c] /= double(seq_q);
  }
  return qbar;
}

// Candidates one work item scores or votes on (a multiple of the kernel's tile).
constexpr int64_t kChunkCandidates = 64 * kScoreTileKeys;

// s[h, t] for every query head and every candidate of the shard, laid out [Hkv][n][group] as the single run keeps
// them, computed by the same score_keys_all_kv_heads, chunks of candidates in parallel.
struct ShardScores {
  std::vector<double> values;
  int64_t n = 0;
  int32_t group = 1;
  // The [n, group] block of kv head hk's query heads: the layout select_softmax.h's kernels take.
  double* block(int32_t hk) { return values.data() + size_t(hk) * size_t(n) * size_t(group); }
  int64_t block_size() const { return n * group; }
};

ShardScores shard_scores(const CpSelectCall& call, const Params& params, int32_t b, const ShardSequence& s,
                         const ExecContext& exec) {
  const AttentionProblem& pr = call.problem;
  ShardScores scores;
  scores.group = pr.num_q_heads / pr.num_kv_heads;
  scores.n = s.n_candidates();
  scores.values.resize(size_t(pr.num_q_heads) * size_t(scores.n));
  if (scores.n == 0) return scores;
  const std::vector<double> concat_qbar = mean_queries(pr, b, s.seq_q);
  const int64_t out_stride = scores.n * scores.group;
  parallel_items(exec, (scores.n + kChunkCandidates - 1) / kChunkCandidates, [&](int64_t item, int) {
    const int64_t first = item * kChunkCandidates;
    const int64_t last = std::min(scores.n, first + kChunkCandidates);
    std::vector<float> transposed(score_tile_scratch_floats(pr.head_dim));
    score_keys_all_kv_heads(pr, b, s.candidate_begin - s.start + first, last - first, concat_qbar.data(),
                            params.score_scale, transposed.data(), scores.values.data() + first * scores.group,
                            out_stride);
  });
  return scores;
}

double read_f64(const TensorArg& a, int64_t i0, int64_t i1) {
  return a.ptr<const double>()[i0 * a.stride(0) + i1 * a.stride(1)];
}

void step_max(const CpSelectCall& call, const Params& params, const ExecContext& exec) {
  const AttentionProblem& pr = call.problem;
  const SelectSoftmaxKernel& softmax = select_softmax_kernel();
  double* out = call.out.ptr<double>();
  for (int32_t b = 0; b < pr.batch; ++b) {
    const ShardSequence s = shard_sequence(call, params, b);
    ShardScores scores = s.selects() ? shard_scores(call, params, b, s, exec) : ShardScores();
    // -inf for a head without candidates here; std::max skips NaN scores, as head_softmax_stats does.
    std::vector<double> maxes(size_t(pr.num_q_heads), -INFINITY);
    if (scores.n > 0) {
      for (int32_t hk = 0; hk < pr.num_kv_heads; ++hk) {
        softmax.max_per_head(scores.block(hk), scores.block_size(), scores.group,
                             maxes.data() + size_t(hk) * size_t(scores.group));
      }
    }
    for (int32_t h = 0; h < pr.num_q_heads; ++h) out[b * call.out.stride(0) + h * call.out.stride(1)] = maxes[size_t(h)];
  }
}

// exp(s − m_h) of every score of the shard, in place, with the global maxima m_h, and each head's terms added to
// sums[h] (one FixedPointSum per query head of the sequence).
void exponentiate(const CpSelectCall& call, int32_t b, ShardScores& scores, FixedPointSum* sums,
                  const ExecContext& exec) {
  const AttentionProblem& pr = call.problem;
  if (scores.n == 0) return;
  parallel_items(exec, pr.num_kv_heads, [&](int64_t item, int) {
    const int32_t hk = int32_t(item);
    std::vector<double> maxes(size_t(scores.group));
    for (int32_t l = 0; l < scores.group; ++l) maxes[size_t(l)] = read_f64(call.global_max, b, hk * scores.group + l);
    select_softmax_kernel().exp_and_sum(scores.block(hk), scores.block_size(), scores.group, maxes.data(),
                                        sums + size_t(hk) * size_t(scores.group));
  });
}

void step_sum(const CpSelectCall& call, const Params& params, const ExecContext& exec) {
  const AttentionProblem& pr = call.problem;
  int64_t* out = call.out.ptr<int64_t>();
  for (int32_t b = 0; b < pr.batch; ++b) {
    const ShardSequence s = shard_sequence(call, params, b);
    ShardScores scores = s.selects() ? shard_scores(call, params, b, s, exec) : ShardScores();
    std::vector<FixedPointSum> sums(size_t(pr.num_q_heads));
    exponentiate(call, b, scores, sums.data(), exec);
    for (int32_t h = 0; h < pr.num_q_heads; ++h) {
      int64_t digits[FixedPointSum::kDigits];
      sums[size_t(h)].to_digits(digits);
      for (int i = 0; i < FixedPointSum::kDigits; ++i)
        out[b * call.out.stride(0) + h * call.out.stride(1) + i * call.out.stride(2)] = digits[i];
    }
  }
}

// Z_h of every (b, h) from the combined digits (cp_select_host.h: checked before anything is written).
std::vector<double> normalisers(const CpSelectCall& call) {
  const TensorArg& g = call.global_sum;
  return cp_normalisers(call.problem.batch, call.problem.num_q_heads, [&](int32_t b, int32_t h, int i) {
    return g.ptr<const int64_t>()[b * g.stride(0) + h * g.stride(1) + i * g.stride(2)];
  });
}

void step_topk(const CpSelectCall& call, const Params& params, const ExecContext& exec) {
  const AttentionProblem& pr = call.problem;
  const std::vector<double> z = normalisers(call);
  double* out_votes = call.out.ptr<double>();
  int32_t* out_positions = call.out_positions.ptr<int32_t>();
  for (int32_t b = 0; b < pr.batch; ++b) {
    const ShardSequence s = shard_sequence(call, params, b);
    ShardScores scores = s.selects() ? shard_scores(call, params, b, s, exec) : ShardScores();
    const int64_t n = scores.n;
    std::vector<FixedPointSum> unused_sums(size_t(pr.num_q_heads));  // step 2 has Z_h; only the terms are needed
    exponentiate(call, b, scores, unused_sums.data(), exec);
    std::vector<double> votes(static_cast<size_t>(n));
    std::vector<int64_t> order(static_cast<size_t>(n)), ids(static_cast<size_t>(n));
    for (int32_t set = 0; set < params.n_sets; ++set) {
      const int32_t first_head = set * params.heads_per_set;
      const double* set_terms = scores.n > 0 ? scores.block(first_head / scores.group) : nullptr;
      const double* set_z = z.data() + size_t(b) * size_t(pr.num_q_heads) + size_t(first_head);
      parallel_items(exec, (n + kChunkCandidates - 1) / kChunkCandidates, [&](int64_t item, int) {
        const int64_t first = item * kChunkCandidates;
        select_softmax_kernel().vote(set_terms, scores.block_size(), scores.group, params.heads_per_set, set_z, first,
                                     std::min(n, first + kChunkCandidates), votes.data());
      });
      const int64_t k = std::min(params.top_k, n);
      top_k_ids_ascending(votes.data(), n, k, order.data(), ids.data());
      const int64_t votes_row = b * call.out.stride(0) + set * call.out.stride(1);
      const int64_t positions_row = b * call.out_positions.stride(0) + set * call.out_positions.stride(1);
      for (int64_t i = 0; i < params.top_k; ++i) {
        out_votes[votes_row + i * call.out.stride(2)] = i < k ? votes[size_t(ids[size_t(i)])] : -INFINITY;
        out_positions[positions_row + i * call.out_positions.stride(2)] =
            i < k ? int32_t(s.candidate_begin + ids[size_t(i)]) : -1;
      }
    }
  }
}

// Step 4 (cp_select_host.h): the global top_k from the gathered lists, then I ∩ shard as local ids.
void step_indices(const CpSelectCall& call, const Params& params) {
  const AttentionProblem& pr = call.problem;
  const TensorArg& av = call.all_votes;
  const TensorArg& ap = call.all_positions;
  std::vector<ShardSequence> sequences;
  for (int32_t b = 0; b < pr.batch; ++b) sequences.push_back(shard_sequence(call, params, b));
  const std::vector<std::vector<int64_t>> sets = cp_shard_index_sets(
      params, sequences, av.extent(0), call.out.extent(2),
      [&](int64_t g, int32_t b, int32_t set, int64_t i, double* vote, int64_t* position) {
        *vote = av.ptr<const double>()[g * av.stride(0) + b * av.stride(1) + set * av.stride(2) + i * av.stride(3)];
        *position =
            ap.ptr<const int32_t>()[g * ap.stride(0) + b * ap.stride(1) + set * ap.stride(2) + i * ap.stride(3)];
      });
  for (int32_t b = 0; b < pr.batch; ++b) {
    for (int32_t set = 0; set < params.n_sets; ++set) {
      const std::vector<int64_t>& ids = sets[size_t(b) * size_t(params.n_sets) + size_t(set)];
      write_selected_set(call.out, b, set, ids.data(), int64_t(ids.size()));
    }
  }
}

}  // namespace

void cpu_cp_select(const CpSelectCall& call, const ExecContext& exec) {
  const Params params = cp_select_params(call);
  switch (call.step) {
    case CpSelectStep::kMax:
      step_max(call, params, exec);
      break;
    case CpSelectStep::kSum:
      step_sum(call, params, exec);
      break;
    case CpSelectStep::kTopk:
      step_topk(call, params, exec);
      break;
    case CpSelectStep::kIndices:
      step_indices(call, params);
      break;
  }
}

}  // namespace sparsa::cpu
