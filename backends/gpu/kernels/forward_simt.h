// Portable forward (forward_simt.cu): any of f32/f16/bf16, head_dim up to 256, plain fp32 arithmetic and block-wide
// barriers only, so it runs unchanged on 32-lane warps and 64-lane wavefronts. The reference path on HIP and for
// fp32; the tensor-core kernel is preferred on NVIDIA when it supports the case.
#pragma once

#include "../engine/forward_params.h"
#include "../runtime/gpu_runtime.h"

SPARSA_GPU_NAMESPACE_BEGIN

constexpr int32_t kSimtMaxHeadDim = 256;

// True when the portable kernel can run `p` (dtype, head_dim <= kSimtMaxHeadDim, the ForwardParams features it
// implements); otherwise false with a static reason.
bool forward_simt_supports(const ForwardParams& p, const char** reason);

// Bytes of dynamic shared memory the portable kernel needs for `head_dim`.
size_t forward_simt_shared_bytes(int32_t head_dim);

// Raises the kernel's dynamic shared-memory limit to what head_dim 256 needs; once per device, before any launch.
cudaError_t forward_simt_prepare();

// Enqueues the kernel on `stream`; `max_seq_q` bounds every sequence's query count (sizes the grid).
cudaError_t forward_simt_launch(const ForwardParams& p, int32_t max_seq_q, cudaStream_t stream);

SPARSA_GPU_NAMESPACE_END
