// Decode forward (forward_decode.cu): few query rows per kv head, split-KV over many thread blocks, K/V read once per
// group of query heads that share them. Two kernels behind one entry:
//   - tensor cores (NVIDIA sm_80+, f16/bf16, K/V rows on 16-byte boundaries, head_dim 64/128/256): Sq·g <=
//     kDecodeMaxRows rows in tiles of 8 per block, keys streamed through cp.async rings; also walks prebuilt key
//     lists (TOKEN_INDICES, TOKEN_SELECT: forward_decode_lists_launch) for any number of query rows;
//   - CUDA cores otherwise (f32, HIP, unaligned rows, head_dim a multiple of 64 up to 256): Sq·g <=
//     kDecodeSimtMaxRows.
#pragma once

#include "../engine/forward_params.h"
#include "../runtime/gpu_runtime.h"

SPARSA_GPU_NAMESPACE_BEGIN

constexpr int32_t kDecodeMaxRows = 16;       // query rows × group size for the tensor-core kernel (two 8-row tiles)
constexpr int32_t kDecodeSimtMaxRows = 8;    // the same for the CUDA-core kernel (rows live in registers)
constexpr int32_t kDecodeMaxHeadDim = 256;
constexpr int32_t kDecodeDimMultiple = 64;   // CUDA-core kernel: each lane of a 32- or 64-wide warp owns whole dims

// True when a decode kernel can run `p` with at most `max_seq_q` query rows per sequence.
bool forward_decode_supports(const ForwardParams& p, int64_t max_seq_q);

// Enqueues the kernel (and, with p.num_splits > 1, the combine kernel that merges the partial states).
cudaError_t forward_decode_launch(const ForwardParams& p, int32_t max_seq_q, cudaStream_t stream);

// Prebuilt ascending key lists (token_indices.h): list j of sequence b starts at
// key_lists + (b * (Hq / heads_per_list) + j) * list_capacity and holds key_counts[b * (Hq / heads_per_list) + j]
// keys; query head h reads list h / heads_per_list. Every query row i attends to the entries <= i + Skv - Sq.
//
// Or, with key_lists null, TOKEN_SELECT's index sets composed where they are read (no list kernel before the walk):
// list j of sequence b is [0, n_init) ∪ T ∪ [N - n_local, N), T the top_k ascending ids in [n_init, N - n_local) at
// selections + b * selection_stride + j * top_k; a list whose candidate_counts entry (b * lists + j) is 0 is
// [0, N) instead (a sequence too short to select).
struct DecodeKeyLists {
  const int32_t* key_lists = nullptr;
  const int32_t* key_counts = nullptr;
  int32_t list_capacity = 0;
  int32_t heads_per_list = 1;
  const int32_t* selections = nullptr;
  int64_t selection_stride = 0;
  const int32_t* candidate_counts = nullptr;
  int32_t n_init = 0, top_k = 0, n_local = 0;
};

// True when the tensor-core kernel can walk key lists for `p` (any Sq: rows beyond kDecodeMaxRows go to more
// blocks). The heads of one block share a list and a kv head: gcd(group size, heads_per_list) of them.
bool forward_decode_lists_supports(const ForwardParams& p);

// Enqueues the list walk over p.num_splits shares of each list (and the combine kernel with p.num_splits > 1).
cudaError_t forward_decode_lists_launch(const ForwardParams& p, const DecodeKeyLists& lists, int32_t max_seq_q,
                                        cudaStream_t stream);

SPARSA_GPU_NAMESPACE_END
