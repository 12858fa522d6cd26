// What cpu_token_select.cpp exposes beyond attention_loop.h / cpu_utilities.h: the selection-cache counts of one
// run, which cpu_backend.cpp adds to the run's stats (SPARSA_STAT_CACHE_HITS / SPARSA_STAT_CACHE_MISSES).
#pragma once

#include <cstdint>

#include "../../src/backend.h"

namespace sparsa::cpu {

// Hits and misses the most recent run_token_select counted on `cache` (zeros for a null cache, a cache no run has
// used yet, or a cache of another backend). run_token_select resets them when it starts, so read them right after
// the run. Rows that fell back to dense attention (n_init + top_k + n_local >= N), rows with no query, and runs with
// select_cache_theta >= 1 (cache disabled) consult nothing and count nothing.
struct SelectionCacheRunCounts {
  int64_t hits = 0;
  int64_t misses = 0;
};
SelectionCacheRunCounts selection_cache_run_counts(const SelectionCacheState* cache);

// TOKEN_SELECT's scores of keys [first_key, first_key + n_keys) of sequence b for every kv head, as the single run
// and the context-parallel steps (cpu_context_parallel.cpp) both compute them:
// out[hk · out_stride + j · g + l] = scale · Σ_c q̄_{hk·g+l}[c] · K[first_key + j, hk][c] (select_scores.h's kernel,
// bit-identical to the channel-order loop), g = Hq / Hkv, concat_qbar [Hq · D]. A tile of keys for all kv heads
// before the next tile (in the [B, S, Hkv, D] layout one key's rows are adjacent, so K is read front to back once),
// the K rows two tiles ahead fetched into L2 while a tile is scored. transposed: score_tile_scratch_floats(D) floats.
void score_keys_all_kv_heads(const AttentionProblem& problem, int32_t b, int64_t first_key, int64_t n_keys,
                             const double* concat_qbar, double score_scale, float* transposed, double* out,
                             int64_t out_stride);

}  // namespace sparsa::cpu
