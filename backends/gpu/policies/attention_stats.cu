// Stats on the device (attention_stats.h). One thread block per (query head, sequence): threads stride over the
// sequence's query rows (pair counts, closed forms per row; a block mask costs one pass over the row's key blocks)
// and over its (query tile, key tile) grid (tile counts), reduce in shared memory and add once to global memory.
#include "attention_stats.h"

#include "../engine/forward_common.cuh"

SPARSA_GPU_NAMESPACE_BEGIN
namespace {

constexpr int kThreads = 256;

enum Counter { kPairsComputed = 0, kPairsDense = 1, kBlocksComputed = 2, kBlocksTotal = 3, kCounters = 4 };

__device__ __forceinline__ int64_t clamp64(int64_t x, int64_t lo, int64_t hi) { return x < lo ? lo : (x > hi ? hi : x); }

// Keys row i may see under the causal bound alone: [0, end).
__device__ __forceinline__ int64_t causal_key_end(const ForwardParams& p, const SequenceView& s, int64_t i) {
  return p.causal ? clamp64(i + s.causal_offset + 1, 0, s.seq_k) : s.seq_k;
}

// |{j : key_visible(i, j)}| in closed form (sink/window: union of [0, sink) and the window range, both cut by the
// causal bound) or by key blocks (mask).
__device__ int64_t visible_keys_of_row(const ForwardParams& p, const SequenceView& s, int64_t i) {
  const int64_t end = causal_key_end(p, s, i);
  switch (p.rule) {
    case VisibilityRule::kDense:
      return end;
    case VisibilityRule::kSinkWindow: {
      const int64_t diagonal = i + s.causal_offset;
      const int64_t sink_end = clamp64(p.sink_tokens, 0, end);
      int64_t window_begin = 0, window_end = 0;
      if (p.sink_window > 0) {
        window_begin = clamp64(diagonal - p.sink_window + 1, 0, end);
        window_end = p.causal ? end : clamp64(diagonal + p.sink_window, 0, end);
      }
      const int64_t window = window_end > window_begin ? window_end - window_begin : 0;
      const int64_t overlap_end = sink_end < window_end ? sink_end : window_end;
      const int64_t overlap = overlap_end > window_begin ? overlap_end - window_begin : 0;
      return sink_end + window - overlap;
    }
    case VisibilityRule::kBlockMask: {
      const int64_t row_cell = s.b * p.block_mask_strides[0] + s.h * p.block_mask_strides[1] +
                               (i / p.mask_block_q) * p.block_mask_strides[2];
      int64_t count = 0;
      for (int64_t key0 = 0; key0 < end; key0 += p.mask_block_k) {
        if (p.block_mask[row_cell + (key0 / p.mask_block_k) * p.block_mask_strides[3]] != 0) {
          count += (key0 + p.mask_block_k < end ? key0 + p.mask_block_k : end) - key0;
        }
      }
      return count;
    }
  }
  return 0;
}

__global__ void __launch_bounds__(kThreads) stats_zero_kernel(const StatsParams s) {
  for (int32_t c = threadIdx.x; c < s.count; c += blockDim.x) s.out[c * s.stride] = 0;
}

__global__ void __launch_bounds__(kThreads) stats_count_kernel(const ForwardParams p, const StatsParams st) {
  __shared__ unsigned long long block_sums[kCounters];
  if (threadIdx.x < kCounters) block_sums[threadIdx.x] = 0;
  __syncthreads();
  const SequenceView s = make_sequence_view(p, blockIdx.y, blockIdx.x);
  int64_t sums[kCounters] = {0, 0, 0, 0};
  for (int64_t i = threadIdx.x; i < s.seq_q; i += blockDim.x) {
    sums[kPairsDense] += causal_key_end(p, s, i);
    if (st.pairs_computed) sums[kPairsComputed] += visible_keys_of_row(p, s, i);
  }
  if (st.tile_rows > 0 && s.seq_q > 0 && s.seq_k > 0) {
    const int64_t row_tiles = (s.seq_q + st.tile_rows - 1) / st.tile_rows;
    const int64_t key_tiles = (s.seq_k + st.tile_keys - 1) / st.tile_keys;
    for (int64_t t = threadIdx.x; t < row_tiles * key_tiles; t += blockDim.x) {
      const int32_t row_begin = int32_t((t / key_tiles) * st.tile_rows);
      const int32_t key_begin = int32_t((t % key_tiles) * st.tile_keys);
      const int32_t row_end = int32_t(row_begin + st.tile_rows < s.seq_q ? row_begin + st.tile_rows : s.seq_q);
      const int32_t key_end = int32_t(key_begin + st.tile_keys < s.seq_k ? key_begin + st.tile_keys : s.seq_k);
      if (key_begin >= causal_key_end(p, s, row_end - 1)) continue;  // no causal-allowed pair
      sums[kBlocksTotal] += 1;
      if (tile_has_visible_key(p, s, row_begin, row_end, key_begin, key_end)) sums[kBlocksComputed] += 1;
    }
  }
  for (int c = 0; c < kCounters; ++c) {
    if (sums[c] != 0) atomicAdd(&block_sums[c], static_cast<unsigned long long>(sums[c]));
  }
  __syncthreads();
  if (threadIdx.x < kCounters) stats_add(st, threadIdx.x, static_cast<int64_t>(block_sums[threadIdx.x]));
}

}  // namespace

cudaError_t stats_zero_launch(const StatsParams& s, cudaStream_t stream) {
  stats_zero_kernel<<<1, kThreads, 0, stream>>>(s);
  return cudaGetLastError();
}

cudaError_t stats_count_launch(const ForwardParams& p, const StatsParams& s, cudaStream_t stream) {
  stats_count_kernel<<<dim3(p.num_q_heads, p.batch), kThreads, 0, stream>>>(p, s);
  return cudaGetLastError();
}

SPARSA_GPU_NAMESPACE_END
