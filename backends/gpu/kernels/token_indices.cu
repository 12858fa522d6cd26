// TOKEN_INDICES (§7) kernels; token_indices.h says what they do and what is not validated.
//
// Key-set kernel: one thread block per key list. Query heads that read the same row of indices (no head_map: the
// Hq / H_idx heads of a row) have the same key set, so token_indices_launch builds one list for all of them
// (heads_per_list = Hq / H_idx) and the attention reads each K/V row once for the heads of a kv group that share
// it. The block sets, word by word, the bits of a shared bitmap for every key of the union (the always-included
// ranges as plain stores, each slot's id or block with atomicOr: duplicates and overlaps cost nothing; a thread
// reads kIdsInFlight slots before marking any, so their loads overlap); then each thread counts the bits of a
// contiguous run of words, a block scan (xor-shuffle warp scans) gives each run its output offset, and the keys are
// written in ascending order.
//
// Attention: f16/bf16 with 16-byte K/V rows on NVIDIA go to the tensor-core decode kernel walking the lists
// (forward_decode.h: forward_decode_lists_launch; any Sq). Otherwise (f32, HIP, unaligned) the kernel below: one
// warp per query row (any warp width: dims are dealt round-robin to lanes, scores reduced by xor shuffles over
// kWarpLanes), keys taken kKeysPerStep at a time for independent loads, online softmax in base 2. A row sees the
// prefix of its list up to its causal horizon (binary search); with splits, split s takes the s-th share of that
// prefix and writes a normalised partial state.
#include "token_indices.h"

#include "../engine/forward_common.cuh"
#include "../engine/online_softmax.cuh"
#include "../engine/split_combine.h"
#include "forward_decode.h"

#include <cmath>

SPARSA_GPU_NAMESPACE_BEGIN
namespace {

constexpr int kSetThreads = 1024;
constexpr int kIdsInFlight = 8;  // index slots a key-set thread reads before marking them
constexpr int kMinWarpLanes = 32;  // sizes per-warp scratch for 32- and 64-lane warps alike
constexpr int kAttendThreads = 128;
constexpr int kKeysPerStep = 4;
constexpr int kBitsPerWord = 32;
constexpr int kMaxDimsPerLane = (kIndexMaxHeadDim + kWarpLanes - 1) / kWarpLanes;

// The bits of word w that lie in [begin, end).
__device__ __forceinline__ uint32_t range_bits(int64_t w, int64_t begin, int64_t end) {
  const int64_t first = w * kBitsPerWord;
  const int64_t lo = (begin > first ? begin : first) - first;
  const int64_t hi = (end < first + kBitsPerWord ? end : first + kBitsPerWord) - first;
  if (hi <= lo) return 0u;
  const uint32_t below_hi = hi >= kBitsPerWord ? ~0u : (1u << hi) - 1u;
  return below_hi & ~((1u << lo) - 1u);  // lo < hi <= 32, so lo <= 31
}

// Sets the bits of [begin, end), one atomicOr per word it touches.
__device__ __forceinline__ void set_bits(uint32_t* bitmap, int64_t begin, int64_t end) {
  for (int64_t w = begin / kBitsPerWord; w * kBitsPerWord < end; ++w) atomicOr(&bitmap[w], range_bits(w, begin, end));
}

// Exclusive prefix sum of one count per thread over the block; *total gets the block's sum. A warp scans with xor
// shuffles (lane's inclusive prefix grows by the partner group's total when the partner is below it); warp totals
// go through `warp_sums` (one int per warp). Ends with the warp totals read: the caller syncs before reusing it.
__device__ __forceinline__ int32_t block_exclusive_scan(int32_t count, int32_t* warp_sums, int32_t* total) {
  const int lane = threadIdx.x % kWarpLanes, warp = threadIdx.x / kWarpLanes;
  const int warps = int(blockDim.x) / kWarpLanes;
  int32_t inclusive = count, group_total = count;
  for (int offset = 1; offset < kWarpLanes; offset *= 2) {
    const int32_t other = warp_shfl_xor(group_total, offset);
    if (lane & offset) inclusive += other;
    group_total += other;
  }
  if (lane == 0) warp_sums[warp] = group_total;
  __syncthreads();
  int32_t before = 0, all = 0;
  for (int w = 0; w < warps; ++w) {
    const int32_t sum = warp_sums[w];
    before += w < warp ? sum : 0;
    all += sum;
  }
  *total = all;
  return before + inclusive - count;
}

__global__ void __launch_bounds__(kSetThreads) index_set_kernel(const ForwardParams p, const IndexSetParams ix,
                                                                const StatsParams stats) {
  extern __shared__ uint32_t bitmap[];
  __shared__ int32_t warp_sums[kSetThreads / kMinWarpLanes];
  __shared__ unsigned long long pairs_sum;
  const int32_t list_head = blockIdx.x, b = blockIdx.y;
  const int32_t lists_per_sequence = p.num_q_heads / ix.heads_per_list;
  const int32_t head0 = list_head * ix.heads_per_list;  // the list's first query head
  const SequenceView s = make_sequence_view(p, b, head0);
  // Key ids stay below 2^30 (gpu_backend.cu's limits), so 32-bit arithmetic holds for them and for block starts.
  const int32_t n_keys = s.seq_k < ix.list_capacity ? s.seq_k : ix.list_capacity;
  const int32_t words = (n_keys + kBitsPerWord - 1) / kBitsPerWord;
  const int32_t block_size = int32_t(ix.block_size);
  const int32_t n_ids = (n_keys + block_size - 1) / block_size;
  const int32_t row = ix.head_map != nullptr ? ix.head_map[head0 * ix.head_map_stride]
                                             : head0 / (p.num_q_heads / ix.index_heads);
  const bool row_valid = row >= 0 && row < ix.index_heads;
  const int32_t* ids = ix.indices + b * ix.index_strides[0] + (row_valid ? row : 0) * ix.index_strides[1];
  const int64_t id_stride = ix.index_strides[2];
  const int64_t list_index = int64_t(b) * lists_per_sequence + list_head;
  int32_t* list = ix.key_lists + list_index * ix.list_capacity;
  if (threadIdx.x == 0) pairs_sum = 0;

  // 0. An index row that is strictly ascending with every id valid, and no always-included range, is its own key
  // list (block ids expanded): no bitmap. (Rows from topk_from_scores are sorted.) Each thread reads kIdsInFlight
  // slots (and their predecessors) before testing any: one memory latency per batch, not per slot.
  bool ascending = row_valid && ix.n_init == 0 && ix.n_local == 0;
  for (int32_t first = threadIdx.x; ascending && first < ix.slots; first += int32_t(blockDim.x) * kIdsInFlight) {
    int32_t id[kIdsInFlight], previous[kIdsInFlight];
#pragma unroll
    for (int u = 0; u < kIdsInFlight; ++u) {
      const int32_t slot = first + u * int32_t(blockDim.x);
      id[u] = slot < ix.slots ? ids[slot * id_stride] : n_ids - 1;
      previous[u] = slot > 0 && slot < ix.slots ? ids[(slot - 1) * id_stride] : -1;
    }
#pragma unroll
    for (int u = 0; u < kIdsInFlight; ++u) ascending = ascending && id[u] >= 0 && id[u] < n_ids && previous[u] < id[u];
  }
  int32_t total = 0;
  if (__syncthreads_and(ascending ? 1 : 0) != 0) {
    const int32_t last_id = ix.slots > 0 ? ids[(ix.slots - 1) * id_stride] : 0;
    total = ix.slots == 0 ? 0 : (ix.slots - 1) * block_size + min(block_size, n_keys - last_id * block_size);
    for (int32_t at = threadIdx.x; at < total; at += blockDim.x) {
      list[at] = block_size == 1 ? ids[at * id_stride]
                                 : ids[(at / block_size) * id_stride] * block_size + at % block_size;
    }
  } else {
    // 1. Mark: the always-included ranges as each word's initial value, then every valid slot (ids out of range
    // are ignored: token_indices.h).
    const int32_t init_end = ix.n_init < n_keys ? int32_t(ix.n_init) : n_keys;
    const int32_t local_begin = n_keys - ix.n_local > 0 ? int32_t(n_keys - ix.n_local) : 0;
    for (int32_t w = threadIdx.x; w < words; w += blockDim.x) {
      bitmap[w] = range_bits(w, 0, init_end) | range_bits(w, local_begin, n_keys);
    }
    __syncthreads();
    if (row_valid) {  // slots read kIdsInFlight at a time, as above
      for (int32_t first = threadIdx.x; first < ix.slots; first += int32_t(blockDim.x) * kIdsInFlight) {
        int32_t id[kIdsInFlight];
#pragma unroll
        for (int u = 0; u < kIdsInFlight; ++u) {
          const int32_t slot = first + u * int32_t(blockDim.x);
          id[u] = slot < ix.slots ? ids[slot * id_stride] : -1;
        }
#pragma unroll
        for (int u = 0; u < kIdsInFlight; ++u) {
          if (id[u] < 0 || id[u] >= n_ids) continue;
          const int32_t end = (id[u] + 1) * block_size;
          set_bits(bitmap, id[u] * block_size, end < n_keys ? end : n_keys);
        }
      }
    }
    __syncthreads();

    // 2. Compact: warp w owns a contiguous range of words and walks it kWarpLanes words per round (lane l takes
    // word l of the round), so a round's keys are written by neighbouring lanes to neighbouring places. Offsets:
    // block scan of the warps' counts, then a warp scan per round.
    const int lane = threadIdx.x % kWarpLanes, warp = threadIdx.x / kWarpLanes;
    const int warps = int(blockDim.x) / kWarpLanes;
    const int32_t words_per_warp = (words + warps - 1) / warps;
    const int32_t warp_begin = min(words, warp * words_per_warp);
    const int32_t warp_end = min(words, warp_begin + words_per_warp);
    int32_t count = 0;
    for (int32_t w = warp_begin + lane; w < warp_end; w += kWarpLanes) count += __popc(bitmap[w]);
    // Each lane's exclusive offset; the warp's start is its lane 0's, the smallest of its lanes'.
    int32_t warp_at = block_exclusive_scan(count, warp_sums, &total);
    for (int offset = 1; offset < kWarpLanes; offset *= 2) {
      const int32_t other = warp_shfl_xor(warp_at, offset);
      warp_at = other < warp_at ? other : warp_at;
    }
    for (int32_t round = warp_begin; round < warp_end; round += kWarpLanes) {
      const int32_t w = round + lane;
      const uint32_t word = w < warp_end ? bitmap[w] : 0u;
      const int32_t bits = __popc(word);
      int32_t inclusive = bits, round_total = bits;
      for (int offset = 1; offset < kWarpLanes; offset *= 2) {
        const int32_t other = warp_shfl_xor(round_total, offset);
        if (lane & offset) inclusive += other;
        round_total += other;
      }
      int32_t out = warp_at + inclusive - bits;
      for (uint32_t rest = word; rest != 0; rest &= rest - 1) list[out++] = w * kBitsPerWord + __ffs(rest) - 1;
      warp_at += round_total;
    }
  }
  if (threadIdx.x == 0) ix.key_counts[list_index] = total;
  __syncthreads();  // the list is complete (global writes of this block are visible to it after the barrier)

  // 3. selected_indices of every head of the list (sorted, -1 padded).
  if (ix.selected != nullptr) {
    for (int32_t j = 0; j < ix.heads_per_list; ++j) {
      int32_t* selected = ix.selected + b * ix.selected_strides[0] + (head0 + j) * ix.selected_strides[1];
      for (int32_t slot = threadIdx.x; slot < ix.selected_cap; slot += blockDim.x) {
        selected[slot * ix.selected_strides[2]] = slot < total ? list[slot] : -1;
      }
    }
  }

  // 4. PAIRS_COMPUTED: row i of each head of the list computes the list entries up to its causal horizon.
  if (stats.out != nullptr) {
    int64_t pairs = 0;
    for (int64_t i = threadIdx.x; i < s.seq_q; i += blockDim.x) pairs += keys_up_to(list, total, i + s.causal_offset);
    if (pairs != 0) atomicAdd(&pairs_sum, static_cast<unsigned long long>(pairs * ix.heads_per_list));
    __syncthreads();
    if (threadIdx.x == 0) stats_add(stats, 0, static_cast<int64_t>(pairs_sum));
  }
}

__global__ void __launch_bounds__(kAttendThreads) index_attention_kernel(const ForwardParams p,
                                                                         const IndexSetParams ix, int32_t row_tiles) {
  const int32_t warps = blockDim.x / kWarpLanes;  // = query rows per block (1 for decode: no idle warps)
  const int32_t split = blockIdx.x / row_tiles;
  const int32_t i = (blockIdx.x % row_tiles) * warps + threadIdx.x / kWarpLanes;
  const int32_t lane = threadIdx.x % kWarpLanes;
  const int32_t h = blockIdx.y, b = blockIdx.z;
  const SequenceView s = make_sequence_view(p, b, h);
  if (i >= s.seq_q) return;  // no block-wide barrier below: a warp may leave alone

  const int64_t list_at = int64_t(b) * (p.num_q_heads / ix.heads_per_list) + h / ix.heads_per_list;
  const int32_t* list = ix.key_lists + list_at * ix.list_capacity;
  const int32_t visible = keys_up_to(list, ix.key_counts[list_at], int64_t(i) + s.causal_offset);
  const int32_t share = (visible + p.num_splits - 1) / p.num_splits;
  const int32_t first = split * share;
  const int32_t last = first + share < visible ? first + share : visible;

  const int32_t dim = p.head_dim;
  float q[kMaxDimsPerLane], acc[kMaxDimsPerLane];
  const int64_t q_row = query_row_offset(p.q_strides, s, i);
#pragma unroll
  for (int t = 0; t < kMaxDimsPerLane; ++t) {
    const int32_t d = lane + t * kWarpLanes;
    q[t] = d < dim ? load_value(p.q, q_row + d, p.element_type) * p.scale_log2 : 0.f;
    acc[t] = 0.f;
  }
  float m = -INFINITY, l = 0.f;
  for (int32_t pos = first; pos < last; pos += kKeysPerStep) {
    int64_t k_rows[kKeysPerStep], v_rows[kKeysPerStep];
    float score[kKeysPerStep];
#pragma unroll
    for (int u = 0; u < kKeysPerStep; ++u) {
      const int32_t key = pos + u < last ? list[pos + u] : list[first];
      k_rows[u] = key_row_offset(p, p.k_strides, s, key);
      v_rows[u] = key_row_offset(p, p.v_strides, s, key);
      float partial = 0.f;
#pragma unroll
      for (int t = 0; t < kMaxDimsPerLane; ++t) {
        const int32_t d = lane + t * kWarpLanes;
        if (d < dim) partial += q[t] * load_value(p.k, k_rows[u] + d, p.element_type);
      }
      score[u] = partial;
    }
#pragma unroll
    for (int offset = kWarpLanes / 2; offset > 0; offset /= 2) {
#pragma unroll
      for (int u = 0; u < kKeysPerStep; ++u) score[u] += warp_shfl_xor(score[u], offset);
    }
    float step_max = m;
#pragma unroll
    for (int u = 0; u < kKeysPerStep; ++u) {
      if (pos + u >= last) score[u] = -INFINITY;
      step_max = fmaxf(step_max, score[u]);
    }
    // Not softmax::update_max: every step holds a real key (pos < last), so step_max is finite and needs no
    // empty-row reference; m = -inf on the first step gives 0, and acc/l are 0 anyway.
    const float correction = exp2f(m - step_max);
    l *= correction;
#pragma unroll
    for (int t = 0; t < kMaxDimsPerLane; ++t) acc[t] *= correction;
#pragma unroll
    for (int u = 0; u < kKeysPerStep; ++u) {
      const float weight = exp2f(score[u] - step_max);  // 0 for padded slots
      l += weight;
#pragma unroll
      for (int t = 0; t < kMaxDimsPerLane; ++t) {
        const int32_t d = lane + t * kWarpLanes;
        if (d < dim) acc[t] += weight * load_value(p.v, v_rows[u] + d, p.element_type);
      }
    }
    m = step_max;
  }

  const softmax::RowOutput result = softmax::finish_row(m, l);
  const float inverse = result.inverse;
  const float lse = result.lse;
  if (p.num_splits > 1) {
    const int64_t state = softmax::partial_state_index(p, s, split, i);
#pragma unroll
    for (int t = 0; t < kMaxDimsPerLane; ++t) {
      const int32_t d = lane + t * kWarpLanes;
      if (d < dim) p.partial_out[state * dim + d] = acc[t] * inverse;
    }
    if (lane == 0) p.partial_lse[state] = lse;
    return;
  }
  const int64_t out_row = query_row_offset(p.out_strides, s, i);
#pragma unroll
  for (int t = 0; t < kMaxDimsPerLane; ++t) {
    const int32_t d = lane + t * kWarpLanes;
    if (d < dim) store_value(p.out, out_row + d, p.element_type, acc[t] * inverse);
  }
  if (lane == 0 && p.lse != nullptr) {
    p.lse[s.b * p.lse_strides.b + int64_t(h) * p.lse_strides.h + (s.q_row_base + i) * p.lse_strides.s] = lse;
  }
}

}  // namespace

int32_t index_rows_per_block(int64_t max_seq_q) {
  constexpr int32_t kMaxRows = kAttendThreads / kWarpLanes;
  return max_seq_q < kMaxRows ? int32_t(max_seq_q < 1 ? 1 : max_seq_q) : kMaxRows;
}

size_t index_set_shared_bytes(int64_t list_capacity) {
  return size_t((list_capacity + kBitsPerWord - 1) / kBitsPerWord) * sizeof(uint32_t);
}

cudaError_t token_indices_prepare(size_t max_shared_bytes, size_t* max_dynamic_bytes) {
  cudaFuncAttributes attributes;
  const cudaError_t status = cudaFuncGetAttributes(&attributes, reinterpret_cast<const void*>(index_set_kernel));
  if (status != cudaSuccess) return status;
  // The opt-in limit covers static and dynamic shared memory together.
  *max_dynamic_bytes = max_shared_bytes > attributes.sharedSizeBytes ? max_shared_bytes - attributes.sharedSizeBytes : 0;
  return cudaFuncSetAttribute(reinterpret_cast<const void*>(index_set_kernel),
                              cudaFuncAttributeMaxDynamicSharedMemorySize, int(*max_dynamic_bytes));
}

cudaError_t token_indices_launch(const ForwardParams& p, const IndexSetParams& ix, const StatsParams& stats,
                                 int32_t max_seq_q, cudaStream_t stream) {
  // Heads that read the same row of indices share one key set: without a head_map, the Hq / H_idx heads of a row.
  IndexSetParams sets = ix;
  sets.heads_per_list = ix.head_map == nullptr ? p.num_q_heads / ix.index_heads : 1;
  index_set_kernel<<<dim3(p.num_q_heads / sets.heads_per_list, p.batch), kSetThreads,
                     index_set_shared_bytes(ix.list_capacity), stream>>>(p, sets, stats);
  const cudaError_t status = cudaGetLastError();
  if (status != cudaSuccess) return status;
  return index_attention_launch(p, sets, max_seq_q, stream);
}

cudaError_t index_attention_launch(const ForwardParams& p, const IndexSetParams& ix, int32_t max_seq_q,
                                   cudaStream_t stream) {
  if (forward_decode_lists_supports(p)) {
    DecodeKeyLists lists;
    lists.key_lists = ix.key_lists;
    lists.key_counts = ix.key_counts;
    lists.list_capacity = ix.list_capacity;
    lists.heads_per_list = ix.heads_per_list;
    return forward_decode_lists_launch(p, lists, max_seq_q, stream);
  }
  const int32_t rows_per_block = index_rows_per_block(max_seq_q);
  const int32_t row_tiles = (max_seq_q + rows_per_block - 1) / rows_per_block;
  index_attention_kernel<<<dim3(row_tiles * p.num_splits, p.num_q_heads, p.batch), rows_per_block * kWarpLanes, 0,
                           stream>>>(p, ix, row_tiles);
  const cudaError_t status = cudaGetLastError();
  if (status != cudaSuccess || p.num_splits == 1) return status;
  return combine_splits_launch(p, stream);
}

SPARSA_GPU_NAMESPACE_END
