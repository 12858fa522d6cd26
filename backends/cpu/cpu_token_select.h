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

}  // namespace sparsa::cpu
