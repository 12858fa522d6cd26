// One kernel source for CUDA (nvcc) and HIP (hipcc): the spellings that differ, mapped in one place.
//
// Code in backends/gpu is written with CUDA names (cudaMalloc, __shfl_xor_sync, ...). Under HIP this header maps
// them to their HIP equivalents, so no second source tree exists (ggml's vendors/hip.h does the same; ONNX Runtime's
// text-rewriting hipify needs a list of "undo" fixes instead).
//
// Lane-count rules every kernel here follows:
//   - kWarpLanes is the hardware warp/wavefront width *of the code being compiled*: 32 on NVIDIA, 64 on gfx90a and
//     gfx940 (CDNA), 32 on RDNA.
//   - Code laid out over 32-lane mma fragments is NVIDIA-only (compiled under SPARSA_GPU_HAS_MMA_SYNC or for sm_90a
//     only, a stub or an FMA path elsewhere) and asserts kWarpLanes == 32: forward_mma.cu, forward_wgmma.cu,
//     forward_sage.cu, the tensor-core decode kernel of forward_decode.cu (through mma_primitives.cuh), the float64
//     MMA score kernel of token_select_score.cu and the MMA paths of token_sparse_score.cu.
//   - Every kernel compiled for HIP either reduces over kWarpLanes lanes (warp_shfl_xor, warp_ballot:
//     sparge_predict.cu, token_indices.cu, the CUDA-core decode kernel, gpu_token_select.cu, the FMA score kernels
//     (float64 and fp32) of token_select_score.cu), or works in groups of 32 lanes that a 64-wide wavefront holds
//     twice (VisibleTileWalk in forward_common.cuh, the float64 FMA scoring of token_sparse_score.cu), or uses no
//     warp primitive at all (forward_simt.cu, merge_states.cu, attention_stats.cu, device_topk.cu, kv_prefetch.cu,
//     gpu_sparge.cu, gpu_delta.cu).
//   - ballots are returned as 64-bit masks (lane_mask_t) so the same code holds on 64-wide wavefronts.
#pragma once

#if defined(__HIP_PLATFORM_AMD__) || defined(__HIPCC__) || defined(SPARSA_GPU_HIP)
#define SPARSA_GPU_IS_HIP 1
#else
#define SPARSA_GPU_IS_HIP 0
#endif

#if SPARSA_GPU_IS_HIP
#include <hip/hip_fp16.h>
#include <hip/hip_runtime.h>
#else
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#endif

#include <cstdint>

// Kernels and launchers live in sparsa::gpu; an inline namespace per vendor keeps the CUDA and the HIP objects of
// one library (both backends built) from defining the same symbols.
#if SPARSA_GPU_IS_HIP
#define SPARSA_GPU_NAMESPACE_BEGIN \
  namespace sparsa::gpu {          \
  inline namespace hip_build {
#else
#define SPARSA_GPU_NAMESPACE_BEGIN \
  namespace sparsa::gpu {          \
  inline namespace cuda_build {
#endif
#define SPARSA_GPU_NAMESPACE_END \
  }                              \
  }

// The NVIDIA tensor-core path (mma.sync m16n8k16, ldmatrix, cp.async) needs sm_80+ PTX. Kernels guard their
// bodies with SPARSA_GPU_DEVICE_HAS_MMA_SYNC: true in nvcc's host pass (__CUDA_ARCH__ undefined; the body is only
// parsed there) and in device passes for sm_80 and newer.
#if !SPARSA_GPU_IS_HIP
#define SPARSA_GPU_HAS_MMA_SYNC 1
#if !defined(__CUDA_ARCH__) || __CUDA_ARCH__ >= 800
#define SPARSA_GPU_DEVICE_HAS_MMA_SYNC 1
#else
#define SPARSA_GPU_DEVICE_HAS_MMA_SYNC 0
#endif
#else
#define SPARSA_GPU_HAS_MMA_SYNC 0
#define SPARSA_GPU_DEVICE_HAS_MMA_SYNC 0
#endif

#if SPARSA_GPU_IS_HIP
// ---- Runtime API spellings ----
#define cudaError_t hipError_t
#define cudaSuccess hipSuccess
#define cudaErrorInsufficientDriver hipErrorInsufficientDriver
#define cudaErrorNoDevice hipErrorNoDevice
#define cudaErrorInvalidValue hipErrorInvalidValue
#define cudaErrorMemoryAllocation hipErrorOutOfMemory
#define cudaGetErrorString hipGetErrorString
#define cudaGetLastError hipGetLastError
#define cudaGetDeviceCount hipGetDeviceCount
#define cudaGetDevice hipGetDevice
#define cudaSetDevice hipSetDevice
#define cudaDeviceGetAttribute hipDeviceGetAttribute
#define cudaDevAttrMaxSharedMemoryPerBlockOptin hipDeviceAttributeSharedMemPerBlockOptin
#define cudaDevAttrComputeCapabilityMajor hipDeviceAttributeComputeCapabilityMajor
#define cudaDevAttrComputeCapabilityMinor hipDeviceAttributeComputeCapabilityMinor
#define cudaDevAttrMultiProcessorCount hipDeviceAttributeMultiprocessorCount
#define cudaFuncSetAttribute hipFuncSetAttribute
#define cudaLaunchCooperativeKernel hipLaunchCooperativeKernel
#define cudaFuncGetAttributes hipFuncGetAttributes
#define cudaFuncAttributes hipFuncAttributes
#define cudaFuncAttributeMaxDynamicSharedMemorySize hipFuncAttributeMaxDynamicSharedMemorySize
#define cudaMalloc hipMalloc
#define cudaFree hipFree
#define cudaMemsetAsync hipMemsetAsync
#define cudaMemcpyAsync hipMemcpyAsync
#define cudaMemcpyDeviceToDevice hipMemcpyDeviceToDevice
#define cudaStream_t hipStream_t
#define cudaStreamSynchronize hipStreamSynchronize
#define cudaMemcpyHostToDevice hipMemcpyHostToDevice
#define cudaMemcpyDeviceToHost hipMemcpyDeviceToHost
#define cudaPointerAttributes hipPointerAttribute_t
#define cudaPointerGetAttributes hipPointerGetAttributes
#define cudaDevAttrPageableMemoryAccess hipDeviceAttributePageableMemoryAccess
#endif

SPARSA_GPU_NAMESPACE_BEGIN

#if SPARSA_GPU_IS_HIP
using lane_mask_t = uint64_t;
#if defined(__GFX9__) || defined(__gfx90a__) || defined(__gfx940__) || defined(__gfx942__)
constexpr int kWarpLanes = 64;  // CDNA wavefront
#else
constexpr int kWarpLanes = 32;  // RDNA wave32 (and the host pass, which never runs warp code)
#endif
#else
using lane_mask_t = uint64_t;  // 32 significant bits on NVIDIA; 64-bit so callers need no #if
constexpr int kWarpLanes = 32;
#endif

// Where a pointer lives (from cudaPointerGetAttributes), one spelling for both vendors: HIP 5.2 names the field
// `memoryType` and marks managed memory with `isManaged` instead of a kind of its own.
enum class PointerKind { kUnknown, kHost, kDevice, kManaged };
inline PointerKind pointer_kind(const cudaPointerAttributes& attributes) {
#if SPARSA_GPU_IS_HIP
  if (attributes.isManaged) return PointerKind::kManaged;
  if (attributes.memoryType == hipMemoryTypeHost) return PointerKind::kHost;
  if (attributes.memoryType == hipMemoryTypeDevice) return PointerKind::kDevice;
  return PointerKind::kUnknown;
#else
  switch (attributes.type) {
    case cudaMemoryTypeHost:
      return PointerKind::kHost;
    case cudaMemoryTypeDevice:
      return PointerKind::kDevice;
    case cudaMemoryTypeManaged:
      return PointerKind::kManaged;
    default:
      return PointerKind::kUnknown;
  }
#endif
}

// ---- Warp primitives (all lanes of the warp/wavefront participate) ----
template <typename T>
__device__ __forceinline__ T warp_shfl_xor(T value, int lane_mask) {
#if SPARSA_GPU_IS_HIP
  return __shfl_xor(value, lane_mask);
#else
  return __shfl_xor_sync(0xffffffffu, value, lane_mask);
#endif
}

__device__ __forceinline__ lane_mask_t warp_ballot(bool predicate) {
#if SPARSA_GPU_IS_HIP
  return static_cast<lane_mask_t>(__ballot(predicate));
#else
  return static_cast<lane_mask_t>(__ballot_sync(0xffffffffu, predicate));
#endif
}

__device__ __forceinline__ void warp_sync() {
#if SPARSA_GPU_IS_HIP
  // Wavefronts execute in lock-step on CDNA/RDNA; a compiler fence keeps shared-memory ordering.
  __builtin_amdgcn_fence(__ATOMIC_RELEASE, "wavefront");
  __builtin_amdgcn_wave_barrier();
  __builtin_amdgcn_fence(__ATOMIC_ACQUIRE, "wavefront");
#else
  __syncwarp();
#endif
}

// Programmatic dependent launch (NVIDIA sm_90+). A kernel enqueued by launch_overlapping may be scheduled while the
// kernel before it in the stream is still finishing; it calls wait_for_previous_kernel() before it touches memory,
// which returns once that kernel has completed and its writes are visible. The earlier kernel may call
// allow_next_kernel_start() once it no longer needs its SM slots for blocks not yet started (each block calls it;
// without it, the next kernel starts as the blocks exit). Both are no-ops on HIP, before sm_90, and for a kernel
// launched plainly.
__device__ __forceinline__ void wait_for_previous_kernel() {
#if !SPARSA_GPU_IS_HIP && defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}
__device__ __forceinline__ void allow_next_kernel_start() {
#if !SPARSA_GPU_IS_HIP && defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

// Enqueues kernel<<<grid, block, 0, stream>>>(args...), as a programmatic dependent launch (above) when `overlap`
// (the code the device runs was compiled for sm_90 or newer: gpu_launch.h, launch_overlap_supported); a plain
// launch on HIP.
template <typename... Params, typename... Args>
cudaError_t launch_overlapping(bool overlap, void (*kernel)(Params...), dim3 grid, dim3 block, cudaStream_t stream,
                               Args... args) {
#if SPARSA_GPU_IS_HIP
  (void)overlap;
  kernel<<<grid, block, 0, stream>>>(args...);
  return cudaGetLastError();
#else
  if (!overlap) {
    kernel<<<grid, block, 0, stream>>>(args...);
    return cudaGetLastError();
  }
  cudaLaunchAttribute attribute;
  attribute.id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attribute.val.programmaticStreamSerializationAllowed = 1;
  cudaLaunchConfig_t config = {};
  config.gridDim = grid;
  config.blockDim = block;
  config.dynamicSmemBytes = 0;
  config.stream = stream;
  config.attrs = &attribute;
  config.numAttrs = 1;
  return cudaLaunchKernelEx(&config, kernel, args...);
#endif
}

// A load of a value another thread block of the same kernel wrote before its __threadfence() and an atomic this
// block has since observed: past the per-SM L1, which is not coherent across blocks (a volatile load on HIP, as
// device_topk.cu reads its histograms).
template <typename T>
__device__ __forceinline__ T load_written_by_other_blocks(const T* address) {
#if SPARSA_GPU_IS_HIP
  return *reinterpret_cast<const volatile T*>(address);
#else
  return __ldcg(address);
#endif
}

// ---- Element conversions by raw bits (no dependency on the vendors' bf16 headers, identical on both) ----

__device__ __forceinline__ float bf16_bits_to_float(uint16_t bits) {
  return __uint_as_float(static_cast<uint32_t>(bits) << 16);
}

// Round to nearest even; NaN stays a (quiet) NaN.
__device__ __forceinline__ uint16_t float_to_bf16_bits(float value) {
  uint32_t bits = __float_as_uint(value);
  if ((bits & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((bits >> 16) | 0x40u);
  const uint32_t rounding_bias = 0x7fffu + ((bits >> 16) & 1u);
  return static_cast<uint16_t>((bits + rounding_bias) >> 16);
}

__device__ __forceinline__ float f16_bits_to_float(uint16_t bits) {
  __half h;
  *reinterpret_cast<uint16_t*>(&h) = bits;
  return __half2float(h);
}

__device__ __forceinline__ uint16_t float_to_f16_bits(float value) {
  __half h = __float2half_rn(value);
  return *reinterpret_cast<uint16_t*>(&h);
}

SPARSA_GPU_NAMESPACE_END
