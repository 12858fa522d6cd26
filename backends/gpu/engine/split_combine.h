// The split-KV combine (ALGORITHMS.md §0 merge): merges the p.num_splits normalised fp32 partial states of each
// (flat query row, head) (layout in forward_params.h) into out and lse. Shared by every split-KV kernel that does not
// merge its own splits (forward_mma.cu, forward_wgmma.cu, token_indices.cu, the CUDA-core decode kernel; the
// tensor-core decode kernel merges in its last block to finish, forward_decode.cu).
#pragma once

#include "../runtime/gpu_runtime.h"
#include "forward_params.h"

SPARSA_GPU_NAMESPACE_BEGIN

// Enqueues the combine kernel: one thread block per (flat query row, query head).
cudaError_t combine_splits_launch(const ForwardParams& p, cudaStream_t stream);

SPARSA_GPU_NAMESPACE_END
