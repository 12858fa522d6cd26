// The sm_80 PTX wrappers the NVIDIA tensor-core kernels share (forward_mma.cu, forward_decode.cu, forward_sage.cu,
// token_sparse_score.cu, and the element helpers of forward_wgmma.cu): cp.async, ldmatrix, mma.sync m16n8k16,
// fp16/bf16 pair packing, a one-instruction exp2 and the quad reductions of an accumulator row. NVIDIA only: include
// it inside `#if SPARSA_GPU_HAS_MMA_SYNC`.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>

#include "../runtime/gpu_runtime.h"

SPARSA_GPU_NAMESPACE_BEGIN
namespace mma {

static_assert(kWarpLanes == 32, "mma.sync, ldmatrix and wgmma fragment layouts are those of 32-lane warps");

// Element types of the tensor-core paths, as overload tags.
struct HalfTag {};
struct BFloat16Tag {};

__device__ __forceinline__ uint32_t shared_address(const void* pointer) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(pointer));
}

// cp.async writes shared memory behind the compiler's back and its data appears only at a wait, so every cp.async
// statement clobbers "memory": no ordinary load or store of shared memory may be moved across the copy, the commit
// or the wait, and no shared value may stay cached in a register across them (volatile alone only orders asm).
// 16-byte asynchronous copy; src_bytes = 0 zero-fills the destination (rows past the sequence end).
__device__ __forceinline__ void cp_async_16(uint32_t dst, const void* src, int src_bytes) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(src_bytes) : "memory");
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
template <int kPendingGroups>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(kPendingGroups) : "memory");
}
// Every copy of this thread has landed, committed or not.
__device__ __forceinline__ void cp_async_wait_all() { asm volatile("cp.async.wait_all;\n" ::: "memory"); }

__device__ __forceinline__ void ldmatrix_x4(uint32_t (&r)[4], uint32_t address) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(address));
}
__device__ __forceinline__ void ldmatrix_x4_trans(uint32_t (&r)[4], uint32_t address) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(address));
}

// D(16x8, f32) += A(16x16) · B(16x8).
__device__ __forceinline__ void mma_16816(HalfTag, float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
      "{%0,%1,%2,%3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}
__device__ __forceinline__ void mma_16816(BFloat16Tag, float (&d)[4], const uint32_t (&a)[4], uint32_t b0,
                                          uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
      "{%0,%1,%2,%3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

__device__ __forceinline__ uint32_t pack_pair(HalfTag, float lo, float hi) {
  const __half2 pair = __floats2half2_rn(lo, hi);
  return *reinterpret_cast<const uint32_t*>(&pair);
}
__device__ __forceinline__ uint32_t pack_pair(BFloat16Tag, float lo, float hi) {
  const __nv_bfloat162 pair = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<const uint32_t*>(&pair);
}

// 2^x in one MUFU op (flush-to-zero; 2^-inf = 0), as the softmax needs no more accuracy than fp16/bf16 P carries.
__device__ __forceinline__ float fast_exp2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
  return y;
}
// fast_exp2 as the exp2 of engine/online_softmax.cuh's row-state functions.
struct FastExp2 {
  __device__ __forceinline__ float operator()(float x) const { return fast_exp2(x); }
};

// An m16n8 accumulator row is spread over the 4 lanes of a quad (lane / 4 picks the row, lane % 4 the column pair),
// in the mma.sync C fragment and in the wgmma D fragment alike: a row's maximum or sum is the quad's.
__device__ __forceinline__ float quad_max(float x) {
  x = fmaxf(x, warp_shfl_xor(x, 1));
  return fmaxf(x, warp_shfl_xor(x, 2));
}
__device__ __forceinline__ float quad_sum(float x) {
  x += warp_shfl_xor(x, 1);
  return x + warp_shfl_xor(x, 2);
}

}  // namespace mma
SPARSA_GPU_NAMESPACE_END
