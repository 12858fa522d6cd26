// Hopper forward (forward_wgmma.cu): warpgroup MMA (wgmma.mma_async) for sm_90a, fp16/bf16, walking the same key
// tiles as the other forward kernels (forward_common.cuh). Compiled to a launcher that reports "unsupported" for
// every other target (sm_80, HIP).
#pragma once

#include "forward_params.h"
#include "gpu_runtime.h"

SPARSA_GPU_NAMESPACE_BEGIN

// Tile of one thread block (split-KV planning in forward_dispatch.cu counts in these).
constexpr int32_t kWgmmaBlockRows = 128;  // query rows: 2 consumer warpgroups × 64
constexpr int32_t kWgmmaBlockKeys = 128;  // keys per tile

// True when the wgmma kernel can run `p` on a device of compute capability `compute_major`.x (it needs 9.x and a
// build that contains sm_90a code); otherwise false with a static reason.
bool forward_wgmma_supports(const ForwardParams& p, int32_t compute_major, const char** reason);

// Raises the kernel's dynamic shared-memory limit; once per device, before any launch (and outside graph capture).
cudaError_t forward_wgmma_prepare();

// Enqueues the kernel on `stream`; `max_seq_q` bounds every sequence's query count (sizes the grid).
cudaError_t forward_wgmma_launch(const ForwardParams& p, int32_t max_seq_q, cudaStream_t stream);

SPARSA_GPU_NAMESPACE_END
