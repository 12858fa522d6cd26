// Decode forward (forward_decode.cu): few query rows per kv head (Sq·g <= kDecodeMaxRows), any of f32/f16/bf16,
// head_dim a multiple of 64 up to 256; split-KV over many thread blocks, K/V read once per kv-head group.
#pragma once

#include "forward_params.h"
#include "gpu_runtime.h"

SPARSA_GPU_NAMESPACE_BEGIN

constexpr int32_t kDecodeMaxRows = 8;        // query rows × group size handled by one thread block
constexpr int32_t kDecodeMaxHeadDim = 256;
constexpr int32_t kDecodeDimMultiple = 64;   // each lane of a 32- or 64-wide warp owns whole dims

// True when the decode kernel can run `p` with at most `max_seq_q` query rows per sequence.
bool forward_decode_supports(const ForwardParams& p, int64_t max_seq_q);

// Enqueues the kernel (and, with p.num_splits > 1, the combine kernel that merges the partial states).
cudaError_t forward_decode_launch(const ForwardParams& p, int32_t max_seq_q, cudaStream_t stream);

// Enqueues only the combine kernel: merges p.num_splits partial states (layout in forward_params.h) into out/lse.
// Shared by every split-KV kernel (token_indices.cu too).
cudaError_t combine_splits_launch(const ForwardParams& p, cudaStream_t stream);

SPARSA_GPU_NAMESPACE_END
