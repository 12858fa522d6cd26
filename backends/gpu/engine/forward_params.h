// The plain description of one forward-attention launch: device pointers, element strides and the key-visibility
// rule, filled on the host from a validated AttentionProblem (make_forward_params, runtime/forward_dispatch.cu) and
// read by every forward kernel (kernels/).
//
// Layout unification (so kernels have no per-layout branches except the paged lookup):
//   q/out row (b, i, h)   at  b*stride_b + (row_base(b) + i)*stride_s + h*stride_h,
//                             row_base(b) = cu_seqlens_q[b] when packed (stride_b = 0), else 0;
//   k/v row (b, t, hk)    at  padded:  b*stride_b + t*stride_s + hk*stride_h
//                             packed:  (cu_seqlens_k[b] + t)*stride_s + hk*stride_h          (stride_b = 0)
//                             paged:   page_table[b][t / page_size]*stride_b + (t % page_size)*stride_s + hk*stride_h
//   lse (b, h, i)         at  b*stride_b + h*stride_h + (row_base(b) + i)*stride_s           (packed: stride_b = 0).
#pragma once

#include <cstdint>

#include "../runtime/gpu_runtime.h"

SPARSA_GPU_NAMESPACE_BEGIN

// Element type of q/k/v/out.
enum class ElementType : int32_t { kF32 = 0, kF16 = 1, kBF16 = 2 };

// Which keys a query row sees (§1-§3); the causal flag is applied on top of every rule.
enum class VisibilityRule : int32_t {
  kDense = 0,        // every key (§1)
  kSinkWindow = 1,   // j < sink_tokens or distance(i + o, j) < window (§2)
  kBlockMask = 2,    // mask[b, h, i / mask_block_q, j / mask_block_k] != 0 (§3)
};

// Which query rows a launch computes and where their outputs go. kAll everywhere except the passes below.
enum class QueryRowMap : int32_t {
  kAll = 0,         // row i of the sequence, written to out row i
  kDeltaRows = 1,   // Δ's dense rows (§8), compact: see ForwardParams::delta_gamma
  kTokenLists = 2,  // TOKEN_SPARSE (§5 step 7): queries AND keys read through a per-(b, h) position list
};

struct TensorStrides {
  int64_t b = 0, s = 0, h = 0;  // in elements; the last dimension is contiguous
};

struct ForwardParams {
  // Tensors.
  const void* q = nullptr;
  const void* k = nullptr;
  const void* v = nullptr;
  void* out = nullptr;
  float* lse = nullptr;  // null: not requested
  TensorStrides q_strides, k_strides, v_strides, out_strides, lse_strides;
  ElementType element_type = ElementType::kF16;
  bool kv_rows_aligned16 = false;  // k/v base pointers 16-byte aligned and every row stride a multiple of 8 elements

  // Sizes.
  int32_t batch = 0;
  int32_t num_q_heads = 0;
  int32_t group_size = 1;  // Hq / Hkv
  int32_t head_dim = 0;
  int32_t padded_seq_q = 0;  // Sq of padded q (ignored when packed)
  int32_t padded_seq_k = 0;  // Skv of padded k/v (ignored when packed or paged)
  int64_t kv_rows_extent = 0;  // k/v rows along the sequence: padded Skv, packed total rows; 0 when paged

  // Variable lengths (null when absent) and their element strides.
  const int32_t* cu_seqlens_q = nullptr;
  int64_t cu_seqlens_q_stride = 1;
  const int32_t* cu_seqlens_k = nullptr;
  int64_t cu_seqlens_k_stride = 1;
  const int32_t* seq_lens_k = nullptr;
  int64_t seq_lens_k_stride = 1;
  const int32_t* page_table = nullptr;  // non-null selects the paged layout
  int64_t page_table_stride_b = 0, page_table_stride_p = 1;
  int32_t page_size = 0;
  const int32_t* query_offsets = nullptr;  // §0's o per sequence (args.query_offsets); null = Skv - Sq
  int64_t query_offsets_stride = 1;

  // Semantics.
  bool causal = false;
  float scale_log2 = 0.f;  // softmax scale × log2(e): scores are kept in the base-2 domain

  VisibilityRule rule = VisibilityRule::kDense;
  int32_t sink_tokens = 0;
  int32_t sink_window = 0;
  const uint8_t* block_mask = nullptr;  // [B, Hq, ceil(Sq/bq), ceil(Skv/bk)]
  int64_t block_mask_strides[4] = {0, 0, 0, 0};
  int32_t mask_block_q = 1, mask_block_k = 1;

  // ---- Query-row maps (default kAll: the fields below are ignored) ----
  // A launch with a row map uses the dense rule (rule == kDense), no PV skip and no split-KV (supports() refuse
  // the first two; the launchers run such launches unsplit whatever num_splits says).
  // kDeltaRows: per sequence with Sq_b rows, s_p = max(0, delta_sparse_prefix(Sq_b, delta_gamma, delta_tail_min))
  //   (src/common/policy_sizes.h), anchors = ceil(s_p / delta_gamma). Launch row a < anchors is query position
  //   a * delta_gamma, row a >= anchors is position s_p + (a - anchors); rows_b = anchors + (Sq_b - s_p). Keys are
  //   the sequence's own (dense rule, causal by the row's position: key j visible iff j <= pos(a) + Skv_b - Sq_b).
  //   Output and lse rows are compact: out row a of (b, h) at b*out_strides.b + a*out_strides.s + h*out_strides.h
  //   (no q_row_base), lse likewise at b*lse_strides.b + h*lse_strides.h + a*lse_strides.s.
  // kTokenLists: list(b, h) = token_lists + (b * Hq + h) * token_list_capacity holds n = token_counts[b * Hq + h]
  //   ascending positions. The launch attends, for (b, h), the compressed sequence of length n in both q and k
  //   (seq_q = seq_k = n, causal offset 0: compressed key c visible to compressed row r iff c <= r when causal);
  //   q row r is read from position list[r], k/v row c from position list[c] (any KV layout), and the output/lse of
  //   row r are written at position list[r] (scatter). Rows not in the list are not written (the caller zeroes them).
  QueryRowMap row_map = QueryRowMap::kAll;
  int32_t delta_gamma = 0, delta_tail_min = 0;
  const int32_t* token_lists = nullptr;
  const int32_t* token_counts = nullptr;
  int32_t token_list_capacity = 0;

  // ---- SpargeAttn PV skip (§4 step 7); null = off ----
  // Per query head threshold λ_h · log2(e) (base-2 domain, <= 0; -inf = off for that head). Applies with
  // rule == kBlockMask to blocks of mask_block_q rows × mask_block_k keys: processing a row block's computed key
  // blocks in ascending order, a block after the first whose max over the block's rows of (m_local - m_new) < λ adds
  // nothing (no exp, no PV, nothing to the denominator).
  // The thread block that decides must own the whole mask row block, so the kernels accept it only for the
  // tilings they can match exactly (supports() says which) and never split such a launch.
  const float* pv_skip_log2 = nullptr;
  // Optional device counter (SPARGE's PV_BLOCKS_SKIPPED): +1 per skipped (row block, key block), atomically.
  int64_t* pv_skip_count = nullptr;

  // Split-KV (decode and other launches too small to fill the GPU): each of `num_splits` thread blocks of a query
  // tile walks one contiguous share of its key tiles and writes a normalised fp32 partial state; a combine kernel
  // merges them (§0 merge). Partial rows are indexed by flat query row r = padded ? b*Sq + i : cu_seqlens_q[b] + i:
  //   partial_out[((split * flat_rows + r) * Hq + h) * D + d],  partial_lse[(split * flat_rows + r) * Hq + h].
  int32_t num_splits = 1;
  int32_t flat_rows = 0;
  float* partial_out = nullptr;
  float* partial_lse = nullptr;

  // The decode kernel, the split combine and TOKEN_SELECT's score kernels are enqueued as programmatic dependent
  // launches (gpu_runtime.h: launch_overlapping), so that each starts while the kernel before it ends; set where
  // the device runs code compiled for sm_90+ (gpu_launch.h: launch_overlap_supported).
  bool overlap_launches = false;
};

SPARSA_GPU_NAMESPACE_END
