// The plain description of one forward-attention launch: device pointers, element strides and the key-visibility
// rule, filled on the host from a validated AttentionProblem (gpu_backend.cu) and read by every forward kernel.
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

#include "gpu_runtime.h"

SPARSA_GPU_NAMESPACE_BEGIN

// Element type of q/k/v/out.
enum class ElementType : int32_t { kF32 = 0, kF16 = 1, kBF16 = 2 };

// Which keys a query row sees (§1-§3); the causal flag is applied on top of every rule.
enum class VisibilityRule : int32_t {
  kDense = 0,        // every key (§1)
  kSinkWindow = 1,   // j < sink_tokens or distance(i + o, j) < window (§2)
  kBlockMask = 2,    // mask[b, h, i / mask_block_q, j / mask_block_k] != 0 (§3)
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

  // Semantics.
  bool causal = false;
  float scale_log2 = 0.f;  // softmax scale × log2(e): scores are kept in the base-2 domain

  VisibilityRule rule = VisibilityRule::kDense;
  int32_t sink_tokens = 0;
  int32_t sink_window = 0;
  const uint8_t* block_mask = nullptr;  // [B, Hq, ceil(Sq/bq), ceil(Skv/bk)]
  int64_t block_mask_strides[4] = {0, 0, 0, 0};
  int32_t mask_block_q = 1, mask_block_k = 1;

  // Split-KV (decode and other launches too small to fill the GPU): each of `num_splits` thread blocks of a query
  // tile walks one contiguous share of its key tiles and writes a normalised fp32 partial state; a combine kernel
  // merges them (§0 merge). Partial rows are indexed by flat query row r = padded ? b*Sq + i : cu_seqlens_q[b] + i:
  //   partial_out[((split * flat_rows + r) * Hq + h) * D + d],  partial_lse[(split * flat_rows + r) * Hq + h].
  int32_t num_splits = 1;
  int32_t flat_rows = 0;
  float* partial_out = nullptr;
  float* partial_lse = nullptr;
};

SPARSA_GPU_NAMESPACE_END
