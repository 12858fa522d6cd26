// Device-side helpers shared by the forward kernels (kernels/) and the policy passes that read q/k/v (policies/):
// where a row lives (forward_params.h explains the layouts), how long each sequence is, and which keys a query row
// sees (§0-§3). The tiled kernels (forward_mma.cu, forward_wgmma.cu, forward_sage.cu, forward_simt.cu, the decode
// kernels) walk key tiles in ascending order, skip a tile that no row of their query tile can see, and apply the exact
// element predicate inside the tiles they compute. The row's softmax state is online_softmax.cuh's.
#pragma once

#include "../../../src/common/policy_sizes.h"
#include "../runtime/gpu_runtime.h"
#include "forward_params.h"

SPARSA_GPU_NAMESPACE_BEGIN

constexpr float kLn2 = 0.6931471805599453f;    // ln(2): converts base-2 LSE back to natural log
constexpr float kLog2e = 1.4426950408889634f;  // log2(e): base-2 exponentials instead of exp

// Every lane of a warp (kWarpLanes of them) gets the maximum / the sum of the warp's values.
__device__ __forceinline__ float warp_max(float value) {
  for (int offset = kWarpLanes / 2; offset > 0; offset /= 2) value = fmaxf(value, warp_shfl_xor(value, offset));
  return value;
}
__device__ __forceinline__ float warp_sum(float value) {
  for (int offset = kWarpLanes / 2; offset > 0; offset /= 2) value += warp_shfl_xor(value, offset);
  return value;
}

// Everything about one (sequence b, query head h) that the walk needs, computed once per thread block.
// With a query-row map (forward_params.h) the walk runs over `rows` launch rows a = 0, 1, ...; row a sits at
// row_position(a) in the key domain [0, seq_k) (causal horizon row_position(a) + causal_offset). kTokenLists makes
// the domain the compressed sequence: seq_q = seq_k = rows = the list length, causal_offset = 0.
struct SequenceView {
  int32_t b = 0, h = 0, kv_head = 0;
  int32_t seq_q = 0;       // Sq of this sequence
  int32_t seq_k = 0;       // Skv of this sequence
  int32_t q_row_base = 0;  // cu_seqlens_q[b] when packed, else 0
  int32_t k_row_base = 0;  // cu_seqlens_k[b] when packed, else 0
  int32_t causal_offset = 0;  // §0's o: Skv - Sq (bottom-right alignment) unless args.query_offsets sets it
  int32_t rows = 0;           // launch rows of this (b, h): seq_q unless a row map says otherwise
  int32_t delta_prefix = 0;   // kDeltaRows: s_p
  int32_t delta_anchors = 0;  // kDeltaRows: ceil(s_p / gamma)
  const int32_t* token_list = nullptr;  // kTokenLists: the (b, h) list of positions
};

__device__ __forceinline__ SequenceView make_sequence_view(const ForwardParams& p, int32_t b, int32_t h) {
  SequenceView s;
  s.b = b;
  s.h = h;
  s.kv_head = h / p.group_size;
  if (p.cu_seqlens_q != nullptr) {
    s.q_row_base = p.cu_seqlens_q[b * p.cu_seqlens_q_stride];
    s.seq_q = p.cu_seqlens_q[(b + 1) * p.cu_seqlens_q_stride] - s.q_row_base;
  } else {
    s.seq_q = p.padded_seq_q;
  }
  if (p.cu_seqlens_k != nullptr) {
    s.k_row_base = p.cu_seqlens_k[b * p.cu_seqlens_k_stride];
    s.seq_k = p.cu_seqlens_k[(b + 1) * p.cu_seqlens_k_stride] - s.k_row_base;
  } else {
    s.seq_k = p.padded_seq_k;
  }
  if (p.seq_lens_k != nullptr) s.seq_k = p.seq_lens_k[b * p.seq_lens_k_stride];
  s.causal_offset = s.seq_k - s.seq_q;
  if (p.query_offsets != nullptr) {  // the host checked host values; a device value is clamped (sparsa.h)
    s.causal_offset = min(max(p.query_offsets[b * p.query_offsets_stride], -s.seq_q), s.seq_k);
  }
  s.rows = s.seq_q;
  if (p.row_map == QueryRowMap::kDeltaRows) {
    s.delta_prefix = max(0, delta_sparse_prefix(s.seq_q, p.delta_gamma, p.delta_tail_min));
    s.delta_anchors = (s.delta_prefix + p.delta_gamma - 1) / p.delta_gamma;
    s.rows = s.delta_anchors + (s.seq_q - s.delta_prefix);
  } else if (p.row_map == QueryRowMap::kTokenLists) {
    const int64_t list = int64_t(b) * p.num_q_heads + h;
    s.token_list = p.token_lists + list * p.token_list_capacity;
    s.rows = s.seq_q = s.seq_k = p.token_counts[list];
    s.causal_offset = 0;
  }
  return s;
}

// Position of launch row a in the key domain: a, except for kDeltaRows (anchors a·gamma, then the tail from s_p).
// Increasing in a, so the last row of a tile has the tile's farthest causal horizon.
__device__ __forceinline__ int32_t row_position(const ForwardParams& p, const SequenceView& s, int32_t a) {
  if (p.row_map != QueryRowMap::kDeltaRows) return a;
  return a < s.delta_anchors ? a * p.delta_gamma : s.delta_prefix + (a - s.delta_anchors);
}

// Element offset of q/out row i of the sequence (strides of q or out).
__device__ __forceinline__ int64_t query_row_offset(const TensorStrides& st, const SequenceView& s, int64_t i) {
  return s.b * st.b + (s.q_row_base + i) * st.s + int64_t(s.h) * st.h;
}

// Flat query row (padded: b·Sq + i, packed: cu_seqlens_q[b] + i) that indexes split-KV partial states.
__device__ __forceinline__ int64_t flat_query_row(const ForwardParams& p, const SequenceView& s, int32_t i) {
  return p.cu_seqlens_q != nullptr ? int64_t(s.q_row_base) + i : int64_t(s.b) * p.padded_seq_q + i;
}

// Element offset of k/v row t of the sequence's kv head, for any KV layout.
__device__ __forceinline__ int64_t key_row_offset(const ForwardParams& p, const TensorStrides& st,
                                                  const SequenceView& s, int64_t t) {
  if (p.page_table != nullptr) {
    const int64_t page = p.page_table[s.b * p.page_table_stride_b + (t / p.page_size) * p.page_table_stride_p];
    return page * st.b + (t % p.page_size) * st.s + int64_t(s.kv_head) * st.h;
  }
  return s.b * st.b + (s.k_row_base + t) * st.s + int64_t(s.kv_head) * st.h;
}

// Element offset of key c of the launch's key domain (kTokenLists: compressed key c is position list[c]).
__device__ __forceinline__ int64_t launch_key_offset(const ForwardParams& p, const TensorStrides& st,
                                                     const SequenceView& s, int32_t c) {
  return key_row_offset(p, st, s, p.row_map == QueryRowMap::kTokenLists ? s.token_list[c] : c);
}

// Element offsets of launch row a (forward_params.h): q is read at the row's sequence position (kTokenLists: the
// list entry); out and lse are written there too, except kDeltaRows, whose outputs are compact (row a at a).
__device__ __forceinline__ int64_t launch_query_offset(const ForwardParams& p, const TensorStrides& st,
                                                       const SequenceView& s, int32_t a) {
  const int32_t i = p.row_map == QueryRowMap::kTokenLists ? s.token_list[a] : row_position(p, s, a);
  return query_row_offset(st, s, i);
}
__device__ __forceinline__ int64_t launch_output_offset(const ForwardParams& p, const SequenceView& s, int32_t a) {
  const TensorStrides& st = p.out_strides;
  if (p.row_map == QueryRowMap::kDeltaRows) return s.b * st.b + int64_t(a) * st.s + int64_t(s.h) * st.h;
  return query_row_offset(st, s, p.row_map == QueryRowMap::kTokenLists ? s.token_list[a] : a);
}
__device__ __forceinline__ int64_t launch_lse_offset(const ForwardParams& p, const SequenceView& s, int32_t a) {
  const TensorStrides& st = p.lse_strides;
  int64_t i = a;  // kDeltaRows: compact, no q_row_base
  if (p.row_map == QueryRowMap::kTokenLists) i = s.q_row_base + s.token_list[a];
  if (p.row_map == QueryRowMap::kAll) i = s.q_row_base + a;
  return s.b * st.b + int64_t(s.h) * st.h + i * st.s;
}

// One past the last key any of the rows [row_begin, row_end) may see (causal bound), clamped to Skv.
__device__ __forceinline__ int32_t key_end_for_rows(const ForwardParams& p, const SequenceView& s, int32_t row_end) {
  if (!p.causal) return s.seq_k;
  const int64_t last_visible = int64_t(row_position(p, s, row_end - 1)) + s.causal_offset;  // of the last row
  return int32_t(last_visible + 1 < s.seq_k ? (last_visible + 1 < 0 ? 0 : last_visible + 1) : s.seq_k);
}

// The rule helpers below take sequence positions for rows (launch rows only differ from positions under a row map,
// and row maps use the dense rule, for which only the causal bound matters).

// Exact §0-§3 predicate: may query row i see key j (0 <= j < Skv assumed by the caller)?
__device__ __forceinline__ bool key_visible(const ForwardParams& p, const SequenceView& s, int32_t i, int32_t j) {
  const int64_t diagonal = int64_t(i) + s.causal_offset;  // the key aligned with row i
  if (p.causal && j > diagonal) return false;
  switch (p.rule) {
    case VisibilityRule::kDense:
      return true;
    case VisibilityRule::kSinkWindow: {
      if (j < p.sink_tokens) return true;
      const int64_t distance = p.causal ? diagonal - j : (diagonal > j ? diagonal - j : j - diagonal);
      return distance < p.sink_window;
    }
    case VisibilityRule::kBlockMask:
      return p.block_mask[s.b * p.block_mask_strides[0] + s.h * p.block_mask_strides[1] +
                          (i / p.mask_block_q) * p.block_mask_strides[2] +
                          (j / p.mask_block_k) * p.block_mask_strides[3]] != 0;
  }
  return false;
}

// May any row of [row_begin, row_end) see any key of [key_begin, key_end)? Exact for the causal bound and the
// sink/window ranges; for a block mask, true when any covered mask cell is set. A false answer skips the tile.
__device__ __forceinline__ bool tile_has_visible_key(const ForwardParams& p, const SequenceView& s, int32_t row_begin,
                                                     int32_t row_end, int32_t key_begin, int32_t key_end) {
  switch (p.rule) {
    case VisibilityRule::kDense:
      return true;
    case VisibilityRule::kSinkWindow: {
      if (key_begin < p.sink_tokens) return true;
      if (p.sink_window <= 0) return false;
      const int64_t first_diagonal = int64_t(row_begin) + s.causal_offset;
      const int64_t last_diagonal = int64_t(row_end - 1) + s.causal_offset;
      const int64_t window_begin = first_diagonal - p.sink_window + 1;
      const int64_t window_end = (p.causal ? last_diagonal : last_diagonal + p.sink_window - 1) + 1;
      return key_begin < window_end && key_end > window_begin;
    }
    case VisibilityRule::kBlockMask: {
      const int64_t base = s.b * p.block_mask_strides[0] + s.h * p.block_mask_strides[1];
      for (int32_t mr = row_begin / p.mask_block_q; mr <= (row_end - 1) / p.mask_block_q; ++mr) {
        for (int32_t mc = key_begin / p.mask_block_k; mc <= (key_end - 1) / p.mask_block_k; ++mc) {
          if (p.block_mask[base + mr * p.block_mask_strides[2] + mc * p.block_mask_strides[3]] != 0) return true;
        }
      }
      return false;
    }
  }
  return true;
}

// The visible key tiles of a thread block's walk, ascending: a warp checks kWindow tiles at once (one per lane) and
// keeps the answers as bits, so a sparse block mask costs one dependent load per 32 tiles instead of one per tile.
// Warp-collective: every lane calls next() with the same arguments, so every warp of a block walks the same tiles.
// (On 64-wide wavefronts lanes 32-63 repeat lanes 0-31.)
struct VisibleTileWalk {
  static constexpr int kWindow = 32;
  int32_t window = -kWindow;  // first tile of the checked window (none yet: every tile >= 0 lies past it)
  uint32_t bits = 0;          // bit j: tile window + j is visible
  template <typename IsVisible>
  __device__ int32_t next(int32_t tile, int32_t tile_count, const IsVisible& visible) {
    const int lane = int(threadIdx.x % kWindow);
    while (tile < tile_count) {
      if (tile < window || tile >= window + kWindow) {
        window = tile;
        const int32_t mine = tile + lane;
        bits = uint32_t(warp_ballot(mine < tile_count && visible(mine)));
      }
      const uint32_t ahead = bits >> (tile - window);
      if (ahead != 0) return tile + __ffs(int(ahead)) - 1;
      tile = window + kWindow;
    }
    return tile_count;
  }
};

// Does the policy's rule (sink/window or mask, not the causal bound) admit every (row, key) of a tile that
// tile_has_visible_key accepted? Then only the sequence end and the causal bound need checking per element.
__device__ __forceinline__ bool tile_rule_uniform(const ForwardParams& p, const SequenceView& s, int32_t row_begin,
                                                  int32_t row_end, int32_t key_begin, int32_t key_end) {
  switch (p.rule) {
    case VisibilityRule::kDense:
      return true;
    case VisibilityRule::kSinkWindow: {
      if (key_end <= p.sink_tokens) return true;
      const int64_t first_diagonal = int64_t(row_begin) + s.causal_offset;
      const int64_t last_diagonal = int64_t(row_end - 1) + s.causal_offset;
      const int64_t farthest_behind = last_diagonal - key_begin;
      if (p.causal) return farthest_behind < p.sink_window;  // keys ahead of the diagonal fail the causal test
      const int64_t farthest_ahead = int64_t(key_end - 1) - first_diagonal;
      return farthest_behind < p.sink_window && farthest_ahead < p.sink_window;
    }
    case VisibilityRule::kBlockMask:
      return row_begin / p.mask_block_q == (row_end - 1) / p.mask_block_q &&
             key_begin / p.mask_block_k == (key_end - 1) / p.mask_block_k;
  }
  return false;
}

// Is every key of the tile visible to every row (so the element predicate can be skipped)? Conservative.
// row_begin is a launch row (its position bounds the tile's nearest causal horizon).
__device__ __forceinline__ bool tile_fully_visible(const ForwardParams& p, const SequenceView& s, int32_t row_begin,
                                                   int32_t key_end, int32_t tile_key_end) {
  if (p.rule != VisibilityRule::kDense || tile_key_end > key_end) return false;
  return !p.causal || int64_t(tile_key_end - 1) <= int64_t(row_position(p, s, row_begin)) + s.causal_offset;
}

// Number of entries <= horizon of an ascending key list whose j-th key is key_at(j) (the index-driven paths:
// TOKEN_INDICES, TOKEN_SELECT, TOKEN_SPARSE): the whole list when its last key is visible (decode), else a binary
// search.
template <typename KeyAt>
__device__ __forceinline__ int32_t entries_up_to(const KeyAt& key_at, int32_t count, int64_t horizon) {
  if (count == 0 || key_at(count - 1) <= horizon) return count;
  int32_t lo = 0, hi = count - 1;
  while (lo < hi) {
    const int32_t mid = (lo + hi) / 2;
    if (key_at(mid) <= horizon) lo = mid + 1; else hi = mid;
  }
  return lo;
}

// The same for a list stored in memory.
__device__ __forceinline__ int32_t keys_up_to(const int32_t* list, int32_t count, int64_t horizon) {
  return entries_up_to([list](int32_t j) { return list[j]; }, count, horizon);
}

// One element of an F32/F16/BF16 tensor as fp32, and back (the scalar paths: portable, decode, merge, index-driven
// kernels).
__device__ __forceinline__ float load_value(const void* base, int64_t index, ElementType type) {
  if (type == ElementType::kF32) return static_cast<const float*>(base)[index];
  const uint16_t bits = static_cast<const uint16_t*>(base)[index];
  return type == ElementType::kF16 ? f16_bits_to_float(bits) : bf16_bits_to_float(bits);
}

__device__ __forceinline__ void store_value(void* base, int64_t index, ElementType type, float value) {
  if (type == ElementType::kF32) {
    static_cast<float*>(base)[index] = value;
    return;
  }
  static_cast<uint16_t*>(base)[index] =
      type == ElementType::kF16 ? float_to_f16_bits(value) : float_to_bf16_bits(value);
}

SPARSA_GPU_NAMESPACE_END
