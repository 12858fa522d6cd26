// The optional int64 `stats` output of a run (sparsa_stat_index), computed on the device without a host sync:
// analytically from the visibility rule for DENSE / SINK_WINDOW / BLOCK_SPARSE (attention_stats.cu), plus the
// counters other kernels add atomically (TOKEN_INDICES adds its pairs from the key-set kernel, token_indices.cu).
#pragma once

#include <cstdint>

#include "../../../src/policy_table.h"
#include "../engine/forward_params.h"
#include "../runtime/gpu_runtime.h"

SPARSA_GPU_NAMESPACE_BEGIN

// DENSE and SINK_WINDOW report BLOCKS_COMPUTED / BLOCKS_TOTAL at sparsa::kStatTileRows × kStatTileKeys
// (src/policy_table.h).
using ::sparsa::kStatTileKeys;
using ::sparsa::kStatTileRows;

struct StatsParams {
  int64_t* out = nullptr;  // int64 [n] with element stride `stride`
  int64_t stride = 1;
  int32_t count = 0;       // min(n, SPARSA_STAT_COUNT)
  // What the analytic kernel counts.
  bool pairs_computed = true;  // PAIRS_COMPUTED from the visibility rule (false: another kernel adds it)
  int32_t tile_rows = 0;       // BLOCKS_* tiling; 0 = the policy reports no blocks
  int32_t tile_keys = 0;
};

// Zeroes the first `count` counters (enqueued before every kernel that adds to them).
cudaError_t stats_zero_launch(const StatsParams& s, cudaStream_t stream);

// Adds PAIRS_DENSE, and PAIRS_COMPUTED / BLOCKS_COMPUTED / BLOCKS_TOTAL as `s` asks, for the rule in `p`.
cudaError_t stats_count_launch(const ForwardParams& p, const StatsParams& s, cudaStream_t stream);

// Device function for other kernels: adds `value` to counter `index` when the output has it.
__device__ __forceinline__ void stats_add(const StatsParams& s, int32_t index, int64_t value) {
  if (s.out != nullptr && index < s.count && value != 0) {
    atomicAdd(reinterpret_cast<unsigned long long*>(s.out + index * s.stride), static_cast<unsigned long long>(value));
  }
}

SPARSA_GPU_NAMESPACE_END
