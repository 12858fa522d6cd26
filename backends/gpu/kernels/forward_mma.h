// Tensor-core forward (forward_mma.cu): fp16/bf16, head_dim 64/128, NVIDIA sm_80+ only.
#pragma once

#include "../engine/forward_params.h"
#include "../runtime/gpu_runtime.h"

SPARSA_GPU_NAMESPACE_BEGIN

// Tile of one thread block of a plain launch (split-KV planning in forward_dispatch.cu counts in these). A PV-skip
// launch uses the tile whose rows equal the mask's block_q (64 or 128) instead, and is never split.
constexpr int32_t kMmaBlockRows = 128;  // query rows
constexpr int32_t kMmaBlockKeys = 64;   // keys per tile

// True when the tensor-core kernel can run `p`; otherwise false with a static reason.
bool forward_mma_supports(const ForwardParams& p, const char** reason);

// Raises the kernels' dynamic shared-memory limit; once per device, before any launch (and outside graph capture).
cudaError_t forward_mma_prepare();

// Enqueues the kernel on `stream`; `max_seq_q` bounds every sequence's query count (sizes the grid).
// Requires 16-byte aligned q/k/v/out rows (checked by the caller). Returns the launch status.
cudaError_t forward_mma_launch(const ForwardParams& p, int32_t max_seq_q, cudaStream_t stream);

SPARSA_GPU_NAMESPACE_END
