// The resolved, validated description of one attention run that the core hands to a backend.
//
// src/validate.cpp builds it from the caller's sparsa_attention_args + sparsa_policy after checking every argument,
// so a backend never re-validates shapes, dtypes or parameter ranges. Tensor contents (cu_seqlens, page tables,
// index tensors) of host-visible tensors are validated too; for device tensors the backend is told by
// `contents_validated == false`.
#pragma once

#include <sparsa/sparsa.h>

#include <cstdint>

namespace sparsa {

class SelectionCacheState;

// How k/v are laid out (§0).
enum class KvLayout : int32_t {
  kPadded = 0,  // k, v [B, Skv, Hkv, D]; optional seq_lens_k shortens each sequence
  kPacked = 1,  // k, v [Tk, Hkv, D] with cu_seqlens_k [B+1]
  kPaged = 2,   // k, v caches [P, page_size, Hkv, D] with page_table [B, max_pages] and seq_lens_k [B]
};

// A tensor argument after validation: `present` is false when the caller passed NULL.
struct TensorArg {
  bool present = false;
  sparsa_tensor t{};  // a copy of the caller's descriptor (data still points at caller memory)

  template <typename T>
  T* ptr() const { return static_cast<T*>(t.data); }
  int64_t stride(int dim) const { return t.strides[dim]; }
  int64_t extent(int dim) const { return t.shape[dim]; }
};

struct AttentionProblem {
  // Sizes.
  int32_t batch = 0;         // B
  int32_t num_q_heads = 0;   // Hq
  int32_t num_kv_heads = 0;  // Hkv; Hq % Hkv == 0
  int32_t head_dim = 0;      // D
  int32_t dtype = SPARSA_DTYPE_INVALID;  // shared by q, k, v, out
  int32_t device_type = SPARSA_DEVICE_CPU;
  int32_t device_id = 0;
  int64_t max_seq_q = 0;  // padded Sq, or the largest packed sequence
  int64_t max_seq_k = 0;  // padded Skv, or the largest sequence length (packed/paged)

  // Semantics.
  bool causal = false;  // effective flag (TOKEN_SPARSE/TOKEN_SELECT/DELTA force it to true)
  float scale = 0.f;    // resolved: never 0

  // Layout.
  bool q_packed = false;  // q/out [Tq, Hq, D] with cu_seqlens_q
  KvLayout kv_layout = KvLayout::kPadded;
  int32_t page_size = 0;  // paged only

  // Tensors (validated). q/out rank 4 padded or 3 packed; k/v rank 4 (padded, paged) or 3 (packed).
  TensorArg q, k, v, out, lse;
  TensorArg cu_seqlens_q, cu_seqlens_k, page_table, seq_lens_k;
  TensorArg selected_indices, block_mask_out, stats;
  TensorArg query_offsets;  // int32 [B]: §0's o per sequence; absent = bottom-right (Skv - Sq)

  SelectionCacheState* selection_cache = nullptr;  // backend state behind args->selection_cache, or null

  // True when the index/offset tensors above live in host memory and their contents were checked by the core.
  bool contents_validated = false;

  // ---- Host-side helpers (valid when the tensors are host-readable, i.e. on the CPU backend) ----

  int64_t seq_len_q(int32_t b) const {
    if (!q_packed) return q.t.shape[1];
    const int32_t* cu = cu_seqlens_q.ptr<const int32_t>();
    return int64_t(cu[(b + 1) * cu_seqlens_q.t.strides[0]]) - cu[b * cu_seqlens_q.t.strides[0]];
  }
  int64_t seq_len_k(int32_t b) const {
    if (seq_lens_k.present) return seq_lens_k.ptr<const int32_t>()[b * seq_lens_k.t.strides[0]];
    if (kv_layout == KvLayout::kPacked) {
      const int32_t* cu = cu_seqlens_k.ptr<const int32_t>();
      return int64_t(cu[(b + 1) * cu_seqlens_k.t.strides[0]]) - cu[b * cu_seqlens_k.t.strides[0]];
    }
    return k.t.shape[1];
  }
  // §0's o of sequence b: row i is aligned with key i + o. The caller's value (the core checked it lies in
  // [-Sq, Skv]), else bottom-right.
  int64_t causal_offset(int32_t b) const {
    if (query_offsets.present) return query_offsets.ptr<const int32_t>()[b * query_offsets.t.strides[0]];
    return seq_len_k(b) - seq_len_q(b);
  }
  // Element offset of q/out row (b, i, h) from the tensor's data pointer.
  int64_t q_offset(const TensorArg& qo, int32_t b, int64_t i, int32_t h) const {
    if (!q_packed) return b * qo.t.strides[0] + i * qo.t.strides[1] + h * qo.t.strides[2];
    const int32_t* cu = cu_seqlens_q.ptr<const int32_t>();
    return (cu[b * cu_seqlens_q.t.strides[0]] + i) * qo.t.strides[0] + h * qo.t.strides[1];
  }
  // Element offset of k/v row (b, token t, kv head hk) from the tensor's data pointer, for any KV layout.
  int64_t kv_offset(const TensorArg& kv, int32_t b, int64_t t, int32_t hk) const {
    switch (kv_layout) {
      case KvLayout::kPadded:
        return b * kv.t.strides[0] + t * kv.t.strides[1] + hk * kv.t.strides[2];
      case KvLayout::kPacked: {
        const int32_t* cu = cu_seqlens_k.ptr<const int32_t>();
        return (cu[b * cu_seqlens_k.t.strides[0]] + t) * kv.t.strides[0] + hk * kv.t.strides[1];
      }
      case KvLayout::kPaged: {
        const int32_t* table = page_table.ptr<const int32_t>();
        const int64_t page = table[b * page_table.t.strides[0] + (t / page_size) * page_table.t.strides[1]];
        return page * kv.t.strides[0] + (t % page_size) * kv.t.strides[1] + hk * kv.t.strides[2];
      }
    }
    return 0;
  }
  // Element offset of lse entry (b, h, i): [B, Hq, Sq] padded, [Hq, Tq] packed.
  int64_t lse_offset(int32_t b, int64_t i, int32_t h) const {
    if (!q_packed) return b * lse.t.strides[0] + h * lse.t.strides[1] + i * lse.t.strides[2];
    const int32_t* cu = cu_seqlens_q.ptr<const int32_t>();
    return h * lse.t.strides[0] + (cu[b * cu_seqlens_q.t.strides[0]] + i) * lse.t.strides[1];
  }
};

// The policy after validation: a full-size sparsa_policy (fields past the caller's struct_size hold defaults) and
// its tensors resolved. Parameter ranges were checked by the core.
struct PolicyParams {
  sparsa_policy p{};
  bool delta = false;                 // p.flags & SPARSA_POLICY_FLAG_DELTA
  TensorArg block_mask;               // BLOCK_SPARSE input
  TensorArg sparge_head_params;       // SPARGE optional [Hq, 4] f32
  TensorArg indices;                  // TOKEN_INDICES [B, H_idx, k] int32
  TensorArg head_map;                 // TOKEN_INDICES optional [Hq] int32
};

}  // namespace sparsa
