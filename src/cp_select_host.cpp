// See cp_select_host.h.
#include "cp_select_host.h"

#include <algorithm>
#include <utility>

#include "common/fixed_point_sum.h"
#include "common/policy_sizes.h"
#include "common/selection_order.h"
#include "error.h"

namespace sparsa {

CpSelectParams cp_select_params(const CpSelectCall& call) {
  const sparsa_policy& p = call.policy.p;
  const AttentionProblem& pr = call.problem;
  CpSelectParams params;
  params.n_init = p.select_n_init;
  params.n_local = p.select_n_local;
  params.top_k = p.select_top_k;
  params.n_sets = p.select_per_kv_head ? pr.num_kv_heads : 1;
  params.heads_per_set = pr.num_q_heads / params.n_sets;
  params.score_scale = p.select_scale_scores ? double(pr.scale) : 1.0;
  return params;
}

std::vector<double> cp_normalisers(int32_t batch, int32_t heads, const CpDigitReader& digit) {
  std::vector<double> z(size_t(batch) * size_t(heads));
  for (int32_t b = 0; b < batch; ++b) {
    for (int32_t h = 0; h < heads; ++h) {
      int64_t digits[FixedPointSum::kDigits];
      for (int i = 0; i < FixedPointSum::kDigits; ++i) digits[i] = digit(b, h, i);
      FixedPointSum sum;
      if (!FixedPointSum::from_digits(digits, &sum)) {
        fail(SPARSA_STATUS_INVALID_ARGUMENT, "global_sum: a negative digit at [", b, ", ", h,
             "] (expected the element-wise sum of every shard's sparsa_cp_select_sum output)");
      }
      z[size_t(b) * size_t(heads) + size_t(h)] = sum.value();
    }
  }
  return z;
}

namespace {

// The largest index set a sequence can have on this shard (the cap out_indices must hold).
int64_t max_shard_set(const CpShardSequence& s, const CpSelectParams& params) {
  if (s.seq_q == 0) return 0;
  if (s.dense) return s.length;
  return std::min(s.length, token_select_set_size(params.n_init, params.top_k, params.n_local));
}

// The global selection T of (b, set), ascending, from every shard's gathered top_k list.
std::vector<int64_t> global_selection(const CpSelectParams& params, const CpShardSequence& s, int32_t b, int32_t set,
                                      int64_t shards, const CpGatheredReader& entry) {
  std::vector<std::pair<double, int64_t>> entries;
  for (int64_t g = 0; g < shards; ++g) {
    for (int64_t i = 0; i < params.top_k; ++i) {
      double vote = 0;
      int64_t position = -1;
      entry(g, b, set, i, &vote, &position);
      if (position < 0) continue;
      if (position < params.n_init || position >= s.total - params.n_local) {
        fail(SPARSA_STATUS_INDEX_OUT_OF_RANGE, "all_positions: ", position, " at shard ", g, ", sequence ", b,
             " is not a candidate (expected -1 or a position in [", params.n_init, ", ", s.total - params.n_local,
             "))");
      }
      entries.emplace_back(vote, position);
    }
  }
  if (int64_t(entries.size()) < params.top_k) {
    fail(SPARSA_STATUS_INVALID_ARGUMENT, "all_votes/all_positions: sequence ", b, " set ", set, " has ",
         entries.size(), " gathered candidates but top_k is ", params.top_k,
         " (expected every shard's sparsa_cp_select_topk output)");
  }
  const auto by_rank = [](const std::pair<double, int64_t>& a, const std::pair<double, int64_t>& c) {
    return ranks_before(a.first, a.second, c.first, c.second);
  };
  std::nth_element(entries.begin(), entries.begin() + (params.top_k - 1), entries.end(), by_rank);
  std::vector<int64_t> chosen;
  for (int64_t i = 0; i < params.top_k; ++i) chosen.push_back(entries[size_t(i)].second);
  std::sort(chosen.begin(), chosen.end());
  if (std::adjacent_find(chosen.begin(), chosen.end()) != chosen.end()) {
    fail(SPARSA_STATUS_INVALID_ARGUMENT, "all_positions: sequence ", b, " set ", set,
         " holds a position twice among the top_k (shards overlap or a list was gathered twice)");
  }
  return chosen;
}

}  // namespace

std::vector<std::vector<int64_t>> cp_shard_index_sets(const CpSelectParams& params,
                                                      const std::vector<CpShardSequence>& sequences, int64_t shards,
                                                      int64_t cap, const CpGatheredReader& entry) {
  const int32_t batch = int32_t(sequences.size());
  // Every check first; the global selection T of every selecting (b, set).
  std::vector<std::vector<int64_t>> selection(size_t(batch) * size_t(params.n_sets));
  for (int32_t b = 0; b < batch; ++b) {
    const CpShardSequence& s = sequences[size_t(b)];
    if (max_shard_set(s, params) > cap) {
      fail(SPARSA_STATUS_SHAPE_MISMATCH, "out_indices: cap (last extent) ", cap, " but sequence ", b,
           " can have up to ", max_shard_set(s, params), " of its ", s.length, " keys on this shard selected");
    }
    if (!s.selects()) continue;
    for (int32_t set = 0; set < params.n_sets; ++set) {
      selection[size_t(b) * size_t(params.n_sets) + size_t(set)] = global_selection(params, s, b, set, shards, entry);
    }
  }
  // I ∩ shard as local ids, ascending (sinks, T, window lie in that order).
  std::vector<std::vector<int64_t>> sets(selection.size());
  for (int32_t b = 0; b < batch; ++b) {
    const CpShardSequence& s = sequences[size_t(b)];
    const int64_t end = s.start + s.length;
    for (int32_t set = 0; set < params.n_sets; ++set) {
      std::vector<int64_t>& ids = sets[size_t(b) * size_t(params.n_sets) + size_t(set)];
      if (s.seq_q > 0 && s.dense) {
        for (int64_t t = 0; t < s.length; ++t) ids.push_back(t);
      } else if (s.selects()) {
        for (int64_t t = s.start; t < std::min(params.n_init, end); ++t) ids.push_back(t - s.start);
        for (int64_t t : selection[size_t(b) * size_t(params.n_sets) + size_t(set)])
          if (t >= s.start && t < end) ids.push_back(t - s.start);
        for (int64_t t = std::max(s.total - params.n_local, s.start); t < end; ++t) ids.push_back(t - s.start);
      }
    }
  }
  return sets;
}

}  // namespace sparsa
