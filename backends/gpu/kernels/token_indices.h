// TOKEN_INDICES (§7) on the device: a key-set kernel builds, per sequence and key list (the query heads that read
// one index row share a list: IndexSetParams::heads_per_list), the deduplicated union of the index row (token ids or id blocks), [0, n_init) and [N - n_local, N) as an ascending key list (a shared
// memory bitmap, then a compaction), and an index-driven attention kernel reads K/V rows through that list (no
// gathered copy), causal (bottom-right), split over keys with the shared combine kernel when the launch is small.
//
// Index contents are not validated on the device (no host sync): an id outside [0, ceil(N / block_size)) or a
// head_map entry outside [0, H_idx) is ignored (it adds no key) instead of failing with INDEX_OUT_OF_RANGE.
#pragma once

#include <cstddef>
#include <cstdint>

#include "../engine/forward_params.h"
#include "../policies/attention_stats.h"
#include "../runtime/gpu_runtime.h"

SPARSA_GPU_NAMESPACE_BEGIN

constexpr int32_t kIndexMaxHeadDim = 256;
// The key-set bitmap of one sequence lives in shared memory: at most this many keys per sequence.
constexpr int64_t kIndexMaxKeys = int64_t(1) << 20;

struct IndexSetParams {
  const int32_t* indices = nullptr;  // [B, H_idx, k]
  int64_t index_strides[3] = {0, 0, 0};
  int32_t index_heads = 1;  // H_idx
  int32_t slots = 0;        // k
  const int32_t* head_map = nullptr;  // [Hq] or null: h / (Hq / H_idx)
  int64_t head_map_stride = 1;
  int64_t block_size = 1;
  int64_t n_init = 0, n_local = 0;
  // Scratch written by the key-set kernel, read by the attention kernel.
  int32_t list_capacity = 0;     // keys per list: >= every list's length
  int32_t* key_lists = nullptr;  // [B, Hq / heads_per_list, list_capacity]
  int32_t* key_counts = nullptr; // [B, Hq / heads_per_list]
  // Query heads sharing one list: 1 (TOKEN_INDICES: a list per query head), the GQA group (a list per kv head) or
  // Hq (one list per sequence, TOKEN_SELECT). Head h reads list b * (Hq / heads_per_list) + h / heads_per_list.
  // token_indices_launch chooses it itself (Hq / H_idx without a head_map, 1 with one); index_attention_launch
  // uses the caller's value.
  int32_t heads_per_list = 1;
  // Optional selected_indices output [B, Hq, cap] (sorted, -1 padded).
  int32_t* selected = nullptr;
  int64_t selected_strides[3] = {0, 0, 0};
  int32_t selected_cap = 0;
};

// Query rows (one warp each) per attention thread block: up to 4 (CUDA) / 2 (64-wide wavefronts), fewer for decode.
int32_t index_rows_per_block(int64_t max_seq_q);
// Dynamic shared memory of the key-set kernel for lists of `list_capacity` keys.
size_t index_set_shared_bytes(int64_t list_capacity);
// Sets the key-set kernel's shared-memory attribute (context creation, so runs contain only launches) from the
// device's opt-in limit and returns the largest dynamic size it may now launch with.
cudaError_t token_indices_prepare(size_t max_shared_bytes, size_t* max_dynamic_bytes);

// Key sets (and selected_indices, and PAIRS_COMPUTED into `stats` when present), then attention (and the combine
// kernel with p.num_splits > 1). `max_seq_q` sizes the grid.
cudaError_t token_indices_launch(const ForwardParams& p, const IndexSetParams& ix, const StatsParams& stats,
                                 int32_t max_seq_q, cudaStream_t stream);

// Attention only, over key lists already in ix.key_lists / ix.key_counts (built on the device by another kernel,
// e.g. TOKEN_SELECT's selection): every query row of (b, h) attends to the keys of its list up to its causal
// horizon. Then the combine kernel with p.num_splits > 1.
cudaError_t index_attention_launch(const ForwardParams& p, const IndexSetParams& ix, int32_t max_seq_q,
                                   cudaStream_t stream);

SPARSA_GPU_NAMESPACE_END
