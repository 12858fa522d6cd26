// The host-side parts of the context-parallel TOKEN_SELECT steps (sparsa_cp_select_*, docs/context_parallel.md) that
// every backend shares, so that a CPU shard and a GPU shard decide alike: the resolved parameters, what a sequence
// looks like on a shard (its candidates C ∩ shard), the normalisers Z_h from step 2's combined digits (step 3), and
// step 4 whole (the global top_k from the gathered lists, then this shard's index set). Step 4 is small (G · top_k
// entries per selection set) and its errors must reach the caller before anything is written, so it runs on the
// host on every backend; a GPU backend copies the gathered lists in and the index sets out.
#pragma once

#include <cstdint>
#include <functional>
#include <vector>

#include "backend.h"
#include "common/host_device.h"
#include "common/policy_sizes.h"

namespace sparsa {

struct CpSelectParams {
  int64_t n_init = 0, n_local = 0, top_k = 0;
  int32_t n_sets = 1, heads_per_set = 1;
  double score_scale = 1.0;  // the factor of every score (§6.3: the softmax scale, or 1)
};
CpSelectParams cp_select_params(const CpSelectCall& call);

// One sequence on this shard (host and device: gpu_cp_select.cu builds it in a kernel from device lengths).
struct CpShardSequence {
  int64_t seq_q = 0;
  int64_t start = 0;      // global position of the shard's first key (kv_start[b])
  int64_t length = 0;     // keys on this shard (L_b)
  int64_t total = 0;      // N = kv_total[b]
  bool dense = false;     // §6.2 on the full length
  int64_t candidate_begin = 0, candidate_end = 0;  // C ∩ shard, global positions
  SPARSA_HOST_DEVICE bool selects() const { return seq_q > 0 && !dense; }
  SPARSA_HOST_DEVICE int64_t n_candidates() const {
    return selects() && candidate_end > candidate_begin ? candidate_end - candidate_begin : 0;
  }
};
SPARSA_HOST_DEVICE inline CpShardSequence cp_shard_sequence(int64_t n_init, int64_t top_k, int64_t n_local,
                                                            int64_t seq_q, int64_t start, int64_t length,
                                                            int64_t total) {
  CpShardSequence s;
  s.seq_q = seq_q;
  s.start = start;
  s.length = length;
  s.total = total;
  s.dense = token_select_set_size(n_init, top_k, n_local) >= total;
  s.candidate_begin = n_init > start ? n_init : start;
  s.candidate_end = total - n_local < start + length ? total - n_local : start + length;
  return s;
}

// Z_h of every (b, h), [B · Hq], from the combined digits digit(b, h, i) (i < SPARSA_CP_SUM_DIGITS); throws
// INVALID_ARGUMENT for a negative digit (not a sum of step-2 outputs). Checked for every entry before returning.
using CpDigitReader = std::function<int64_t(int32_t b, int32_t h, int digit)>;
std::vector<double> cp_normalisers(int32_t batch, int32_t heads, const CpDigitReader& digit);

// Step 4. entry(g, b, set, i, &vote, &position) reads slot i of shard g's gathered step-3 lists. Checks every
// sequence first (the cap, the gathered candidates; the documented SHAPE_MISMATCH / INVALID_ARGUMENT /
// INDEX_OUT_OF_RANGE), then returns, per (b, set) at b · n_sets + set, the shard's index set I ∩ shard as local key
// ids, ascending (sinks, selected tokens, local window; every key of a dense sequence; nothing without query rows).
using CpGatheredReader =
    std::function<void(int64_t g, int32_t b, int32_t set, int64_t i, double* vote, int64_t* position)>;
std::vector<std::vector<int64_t>> cp_shard_index_sets(const CpSelectParams& params,
                                                      const std::vector<CpShardSequence>& sequences, int64_t shards,
                                                      int64_t cap, const CpGatheredReader& entry);

}  // namespace sparsa
