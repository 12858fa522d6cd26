// Hopper forward (forward_wgmma.cu): warpgroup MMA (wgmma.mma_async) for sm_90a, fp16/bf16, walking the same key
// tiles as the other forward kernels (forward_common.cuh). Compiled to a launcher that reports "unsupported" for
// every other target (sm_80, HIP).
#pragma once

#include "../engine/forward_params.h"
#include "../runtime/gpu_runtime.h"

SPARSA_GPU_NAMESPACE_BEGIN

// Tile of one thread block (split-KV planning in forward_dispatch.cu counts in these).
constexpr int32_t kWgmmaBlockRows = 128;  // query rows: 2 consumer warpgroups × 64
constexpr int32_t kWgmmaBlockKeys = 128;  // keys per tile
constexpr int32_t kWgmmaHalfKeys = 64;    // keys of one gathered half tile (the cell walk below)

// Block masks whose cells the wgmma kernel walks cell by cell: every consumer warpgroup's 64 rows lie in one mask
// cell row (block_q a multiple of 64) and a 64-key half tile lies in one cell or holds whole 8-key cells (block_k a
// multiple of 64, or 8, 16, 32). The kernel then walks 64-key halves that some row of the block may see and gathers
// two of them, wherever they lie, into each 128-key tile, and each thread reads only the mask cells of the key
// columns it holds. Masks of 128 × 128 multiples keep the plain 128-key walk (their cells cover whole tiles).
__host__ __device__ inline bool wgmma_gathers_mask_cells(int32_t block_q, int32_t block_k) {
  constexpr int32_t kConsumerRows = 64;  // query rows of one consumer warpgroup
  constexpr int32_t kColumnBlock = 8;    // keys of one accumulator column block (one thread holds 2 of them)
  if (block_q <= 0 || block_k <= 0 || block_q % kConsumerRows != 0) return false;
  if (block_q % kWgmmaBlockRows == 0 && block_k % kWgmmaBlockKeys == 0) return false;
  return block_k % kWgmmaHalfKeys == 0 || (kWgmmaHalfKeys % block_k == 0 && block_k % kColumnBlock == 0);
}

constexpr int32_t kHopperMajor = 9;  // compute capability 9.x: the devices the sm_90a kernels run on

// Was sm_90a machine code built into this library and picked for the current device? A query, no stream work:
// legal inside graph capture. Every sm_90a kernel of the library (this one, forward_sage_wgmma.cu's) is in the same
// image.
bool hopper_code_loaded();

// True when the wgmma kernel can run `p` on a device of compute capability `compute_major`.x (it needs 9.x and a
// build that contains sm_90a code); otherwise false with a static reason.
bool forward_wgmma_supports(const ForwardParams& p, int32_t compute_major, const char** reason);

// Raises the kernel's dynamic shared-memory limit; once per device, before any launch (and outside graph capture).
cudaError_t forward_wgmma_prepare();

// Enqueues the kernel on `stream`; `max_seq_q` bounds every sequence's query count (sizes the grid).
cudaError_t forward_wgmma_launch(const ForwardParams& p, int32_t max_seq_q, cudaStream_t stream);

SPARSA_GPU_NAMESPACE_END
