// The sm_90a PTX wrappers of the Hopper kernels (forward_wgmma.cu, forward_sage_wgmma.cu): the 128- and 64-byte
// swizzles of shared-memory tiles and their wgmma descriptors, mbarrier wait/arrive (cp.async and copy-engine
// completion included), the tensor copy engine's 4-d tile load, the generic-to-async proxy fence, setmaxnreg, and
// wgmma.mma_async (fp16/bf16 m64nNk16; int8 and e4m3 m64n128k32) with its fence / commit / wait and the register
// fences around its asynchronous window. Valid only in the sm_90a device pass; NVIDIA only: include it inside
// `#if !SPARSA_GPU_IS_HIP`, as forward_wgmma.cu does (mma_primitives.cuh holds the sm_80 wrappers, cp.async
// included, and the element tags).
#pragma once

#include <cstdint>

#include "../runtime/gpu_runtime.h"
#include "mma_primitives.cuh"

SPARSA_GPU_NAMESPACE_BEGIN
namespace hopper {

// ---- Swizzled shared-memory tiles and their wgmma descriptors ----
// A K-major tile of 128-byte rows is stored with the 128-byte swizzle: D/64 column blocks (16-bit elements; one
// block of 128 int8/e4m3 elements) of R rows × 128 bytes, the 16-byte chunk c of row r at chunk position c ^ (r % 8).
// A tile of 64-byte rows uses the 64-byte swizzle: chunk c of row r at c ^ ((r / 2) % 4) (the hardware XORs address
// bits 4-5 with bits 7-8). The copies place every chunk there themselves (cp.async has no swizzle of its own); tiles
// start on kTileAlignment boundaries, where both patterns start over.
constexpr int kSwizzleChunkBytes = 16;  // the unit the swizzle permutes
constexpr int kSwizzleBytes = 128;      // row width of a 128-byte-swizzled column block
constexpr int kSwizzle64Bytes = 64;     // row width of a 64-byte-swizzled tile
constexpr int kSwizzleRows = 8;         // both patterns repeat every 8 rows
constexpr int kTileAlignment = 1024;    // kSwizzleRows × kSwizzleBytes

// Byte offset of 16-byte chunk `chunk` of row `row` in a 128-byte-swizzled tile of kRows rows.
template <int kRows>
__device__ __forceinline__ uint32_t swizzled_offset(int row, int chunk) {
  constexpr int kChunksPerBlock = kSwizzleBytes / kSwizzleChunkBytes;
  return uint32_t((chunk / kChunksPerBlock) * kRows * kSwizzleBytes + row * kSwizzleBytes +
                  ((chunk % kChunksPerBlock) ^ (row % kSwizzleRows)) * kSwizzleChunkBytes);
}
// Byte offset of chunk `chunk` (0-3) of row `row` in a 64-byte-swizzled tile.
__device__ __forceinline__ uint32_t swizzled64_offset(int row, int chunk) {
  return uint32_t(row * kSwizzle64Bytes + (chunk ^ ((row / 2) % 4)) * kSwizzleChunkBytes);
}

// wgmma shared-memory matrix descriptor (PTX ISA "matrix descriptor"), 64 bits: start address >> 4 (bits 0-13),
// leading byte offset >> 4 (16-29), stride byte offset >> 4 (32-45), base offset (49-51, 0: tiles are aligned to
// their pattern), swizzle mode (62-63: 1 = 128 bytes, 2 = 64 bytes). Every tile of one swizzle has the same high
// word (stride: one 8-row group), so only the low word varies and the kernels keep 32-bit halves (fewer live
// registers than 64-bit descriptors hoisted out of the loop); the wgmma wrappers join them.
constexpr uint32_t kSwizzle128Mode = 1;
constexpr uint32_t kSwizzle64Mode = 2;
constexpr uint32_t kDescriptorHigh = ((kSwizzleRows * kSwizzleBytes) >> 4) | (kSwizzle128Mode << 30);
constexpr uint32_t kDescriptorHigh64 = ((kSwizzleRows * kSwizzle64Bytes) >> 4) | (kSwizzle64Mode << 30);
__device__ __forceinline__ uint32_t descriptor_low(uint32_t address, uint32_t leading_bytes) {
  return ((address & 0x3FFFF) >> 4) | (((leading_bytes >> 4) & 0x3FFF) << 16);
}
// K-major operand (the reduction dimension contiguous in each row): a k-step's 32 bytes inside a row are addressed
// through the start address; the leading byte offset is unused by swizzled K-major layouts (16 by convention).
__device__ __forceinline__ uint32_t k_major_descriptor(uint32_t address) {
  return descriptor_low(address, kSwizzleChunkBytes);
}
// Moving a descriptor by a 16-byte multiple adds to its start-address field.
__device__ __forceinline__ uint32_t advance_descriptor(uint32_t low, uint32_t bytes) { return low + (bytes >> 4); }

// ---- mbarrier, proxy fence, register reallocation ----

__device__ __forceinline__ void barrier_init(uint32_t barrier, int arrivals) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(barrier), "r"(arrivals) : "memory");
}
__device__ __forceinline__ void barrier_arrive(uint32_t barrier) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(barrier) : "memory");
}
// Blocks until the barrier's phase of parity `parity` has completed.
__device__ __forceinline__ void barrier_wait(uint32_t barrier, uint32_t parity) {
  uint32_t done = 0;
  do {
    asm volatile(
        "{\n.reg .pred p;\nmbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\nselp.u32 %0, 1, 0, p;\n}\n"
        : "=r"(done)
        : "r"(barrier), "r"(parity)
        : "memory");
  } while (done == 0);
}
// The barrier counts this thread's arrival once all of its earlier cp.async copies have landed.
__device__ __forceinline__ void barrier_arrive_on_copies(uint32_t barrier) {
  asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];\n" ::"r"(barrier) : "memory");
}
// cp.async writes through the generic proxy, wgmma reads through the async proxy: a consumer that has seen a full
// barrier fences before its wgmma reads the tile.
__device__ __forceinline__ void fence_async_shared() { asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory"); }

// ---- The tensor copy engine (TMA: cp.async.bulk.tensor, completing on an mbarrier) ----

// One arrival that also tells the barrier to expect `bytes` more from the copy engine: its phase completes once
// every arrival is in and those bytes have landed.
__device__ __forceinline__ void barrier_arrive_expect_bytes(uint32_t barrier, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(barrier), "r"(bytes) : "memory");
}
// Copies the box at element coordinates (c0 innermost .. c3) of the 4-d tensor map `map` (a __grid_constant__
// kernel parameter) to shared address `destination`, laid out and swizzled as the map says; the bytes count
// against `barrier`'s expected transaction count. Coordinates past the tensor's extent read as zeros.
__device__ __forceinline__ void tensor_load_4d(uint32_t destination, const void* map, int32_t c0, int32_t c1,
                                               int32_t c2, int32_t c3, uint32_t barrier) {
  asm volatile(
      "cp.async.bulk.tensor.4d.shared::cluster.global.tile.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3, %4, %5}], "
      "[%6];\n" ::"r"(destination),
      "l"(reinterpret_cast<uint64_t>(map)), "r"(c0), "r"(c1), "r"(c2), "r"(c3), "r"(barrier)
      : "memory");
}

template <int kRegisters>
__device__ __forceinline__ void registers_increase() {
  asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(kRegisters));
}
template <int kRegisters>
__device__ __forceinline__ void registers_decrease() {
  asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(kRegisters));
}

// ---- wgmma (PTX: wgmma.mma_async; every thread of the warpgroup issues the same instruction) ----

__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
template <int kPending>
__device__ __forceinline__ void wgmma_wait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(kPending) : "memory");
}
// Keeps the compiler from moving reads/writes of accumulator registers across the asynchronous window (between a
// wgmma's issue and its wait_group, the registers belong to the tensor cores).
template <int kCount>
__device__ __forceinline__ void fence_registers(float (&r)[kCount]) {
#pragma unroll
  for (int i = 0; i < kCount; ++i) asm volatile("" : "+f"(r[i])::"memory");
}
template <int kCount>
__device__ __forceinline__ void fence_registers(int32_t (&r)[kCount]) {
#pragma unroll
  for (int i = 0; i < kCount; ++i) asm volatile("" : "+r"(r[i])::"memory");
}
template <int kRowsA, int kCount>
__device__ __forceinline__ void fence_registers(uint32_t (&r)[kRowsA][kCount]) {
#pragma unroll
  for (int i = 0; i < kRowsA; ++i) {
#pragma unroll
    for (int j = 0; j < kCount; ++j) asm volatile("" : "+r"(r[i][j])::"memory");
  }
}

// Eight accumulator operands d[i..i+7] with the constraint C ("+f": fp32, "+r": int32), and 32 or 64 of them.
#define SPARSA_OPERANDS8(C, d, i) \
  C(d[i]), C(d[i + 1]), C(d[i + 2]), C(d[i + 3]), C(d[i + 4]), C(d[i + 5]), C(d[i + 6]), C(d[i + 7])
#define SPARSA_OPERANDS32(C, d) \
  SPARSA_OPERANDS8(C, d, 0), SPARSA_OPERANDS8(C, d, 8), SPARSA_OPERANDS8(C, d, 16), SPARSA_OPERANDS8(C, d, 24)
#define SPARSA_OPERANDS64(C, d)                                                                    \
  SPARSA_OPERANDS32(C, d), SPARSA_OPERANDS8(C, d, 32), SPARSA_OPERANDS8(C, d, 40), SPARSA_OPERANDS8(C, d, 48), \
      SPARSA_OPERANDS8(C, d, 56)
#define SPARSA_ACC32(d) SPARSA_OPERANDS32("+f", d)
#define SPARSA_ACC64(d) SPARSA_OPERANDS64("+f", d)
#define SPARSA_INT64(d) SPARSA_OPERANDS64("+r", d)
#define SPARSA_REGS32                                                                                           \
  "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, " \
  "%23, %24, %25, %26, %27, %28, %29, %30, %31}"
#define SPARSA_REGS64                                                                                           \
  "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, " \
  "%23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, "   \
  "%44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}"

// D(64×128) (+)= A(64×16, shared) · B(16×128, shared), both K-major; accumulate = 0 overwrites D.
// D(64×N)   (+)= A(64×16, registers) · B(16×N, shared, MN-major), N = 128 or 64.
// Descriptors arrive as low words plus the shared high word (kDescriptorHigh).
#define SPARSA_DEFINE_WGMMA(TAG, TYPE)                                                                          \
  __device__ __forceinline__ void wgmma_ss_n128(TAG, float(&d)[64], uint32_t a_low, uint32_t b_low,            \
                                                uint32_t high, int accumulate) {                                \
    asm volatile("{\n.reg .pred p;\n.reg .b64 da, db;\nsetp.ne.b32 p, %68, 0;\n"                                \
                 "mov.b64 da, {%64, %66};\nmov.b64 db, {%65, %67};\n"                                           \
                 "wgmma.mma_async.sync.aligned.m64n128k16.f32." TYPE "." TYPE " " SPARSA_REGS64                 \
                 ", da, db, p, 1, 1, 0, 0;\n}\n"                                                                \
                 : SPARSA_ACC64(d)                                                                              \
                 : "r"(a_low), "r"(b_low), "r"(high), "r"(high), "r"(accumulate));                              \
  }                                                                                                             \
  __device__ __forceinline__ void wgmma_rs(TAG, float(&d)[64], const uint32_t(&a)[4], uint32_t b_low,           \
                                           uint32_t high, int accumulate) {                                     \
    asm volatile("{\n.reg .pred p;\n.reg .b64 db;\nsetp.ne.b32 p, %70, 0;\nmov.b64 db, {%68, %69};\n"           \
                 "wgmma.mma_async.sync.aligned.m64n128k16.f32." TYPE "." TYPE " " SPARSA_REGS64                 \
                 ", {%64, %65, %66, %67}, db, p, 1, 1, 1;\n}\n"                                                 \
                 : SPARSA_ACC64(d)                                                                              \
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b_low), "r"(high), "r"(accumulate));         \
  }                                                                                                             \
  __device__ __forceinline__ void wgmma_rs(TAG, float(&d)[32], const uint32_t(&a)[4], uint32_t b_low,           \
                                           uint32_t high, int accumulate) {                                     \
    asm volatile("{\n.reg .pred p;\n.reg .b64 db;\nsetp.ne.b32 p, %38, 0;\nmov.b64 db, {%36, %37};\n"           \
                 "wgmma.mma_async.sync.aligned.m64n64k16.f32." TYPE "." TYPE " " SPARSA_REGS32                  \
                 ", {%32, %33, %34, %35}, db, p, 1, 1, 1;\n}\n"                                                 \
                 : SPARSA_ACC32(d)                                                                              \
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b_low), "r"(high), "r"(accumulate));         \
  }
SPARSA_DEFINE_WGMMA(mma::HalfTag, "f16")
SPARSA_DEFINE_WGMMA(mma::BFloat16Tag, "bf16")
#undef SPARSA_DEFINE_WGMMA

// S(64×128, s32) (+)= A(64×32, s8, shared) · B(32×128, s8, shared), both K-major (exact integer sums).
__device__ __forceinline__ void wgmma_ss_s8_n128(int32_t (&d)[64], uint32_t a_low, uint32_t b_low, uint32_t high,
                                                 int accumulate) {
  asm volatile("{\n.reg .pred p;\n.reg .b64 da, db;\nsetp.ne.b32 p, %68, 0;\n"
               "mov.b64 da, {%64, %66};\nmov.b64 db, {%65, %67};\n"
               "wgmma.mma_async.sync.aligned.m64n128k32.s32.s8.s8 " SPARSA_REGS64 ", da, db, p;\n}\n"
               : SPARSA_INT64(d)
               : "r"(a_low), "r"(b_low), "r"(high), "r"(high), "r"(accumulate));
}
// D(64×128, f32) (+)= A(64×32, e4m3, registers) · B(32×128, e4m3, shared, K-major; fp8 has no transposed form).
// The A fragment of thread (g, t) = (lane / 4, lane % 4) of warp w: rows 16w + g and 16w + g + 8, k positions
// 4t..4t+3 and 16 + 4t..16 + 4t + 3 (the layout of mma.sync m16n8k32's A).
__device__ __forceinline__ void wgmma_rs_e4m3_n128(float (&d)[64], const uint32_t (&a)[4], uint32_t b_low,
                                                   uint32_t b_high, int accumulate) {
  asm volatile("{\n.reg .pred p;\n.reg .b64 db;\nsetp.ne.b32 p, %70, 0;\nmov.b64 db, {%68, %69};\n"
               "wgmma.mma_async.sync.aligned.m64n128k32.f32.e4m3.e4m3 " SPARSA_REGS64
               ", {%64, %65, %66, %67}, db, p, 1, 1;\n}\n"
               : SPARSA_ACC64(d)
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b_low), "r"(b_high), "r"(accumulate));
}
#undef SPARSA_INT64
#undef SPARSA_REGS64
#undef SPARSA_REGS32
#undef SPARSA_ACC64
#undef SPARSA_ACC32
#undef SPARSA_OPERANDS64
#undef SPARSA_OPERANDS32
#undef SPARSA_OPERANDS8

}  // namespace hopper
SPARSA_GPU_NAMESPACE_END
