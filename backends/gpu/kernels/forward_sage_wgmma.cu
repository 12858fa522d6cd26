// SPARGE's quantized (Sage) attention on Hopper warpgroup MMA (sm_90a), FP8 P·V, head dim 128 (forward_sage.h).
// It reads the pre-passes' quantized copies like forward_sage.cu's mma.sync kernel and walks the same 64-key tiles
// in the same order with the same per-thread arithmetic (sage_tile.cuh: scales and mask, λ test, online softmax,
// e4m3 P, epilogue); what differs is how the operands reach the tensor cores:
//   one thread block = 2 warpgroups × 64 query rows (one 128-row query block of the λ test) of one (sequence,
//   query head); every thread copies (cp.async) Q once, and K (int8) and V^T (e4m3) tiles into a ring of kStages
//   slots, kAhead tiles ahead; each step takes the next two visible tiles (a pair of adjacent slots):
//   S  = Q_i8·[K_a; K_b]ᵀ  wgmma m64n128k32 s8 → s32 (exact), A = Q and B = the pair's K slots, both K-major in
//                          shared memory (128-byte rows, 128-byte swizzle);
//   each tile scaled, masked and λ-tested on its own, then one online-softmax update for the pair;
//   O += P·V               wgmma m64n128k32 e4m3, A = P·448 packed from the S registers (their layout matches the
//                          8-bit A fragment once the pre-pass has permuted V^T's keys in every 32-key step), B = each
//                          tile's V^T rows (one per channel, 64 keys = 64 bytes, 64-byte swizzle); the pair's product
//                          lands in a fresh accumulator (scale-d = 0 on its first step) and is added to O in fp32,
//                          because the tensor core's own FP8 accumulation is not full fp32.
// Int8 and e4m3 operands have no transposed wgmma form, hence K-major tiles only (V^T is the pre-pass's copy).
// Compiled to a stub for every target other than sm_90a; sage_wgmma_supports() asks whether sm_90a code was loaded
// (hopper_code_loaded, forward_wgmma.h).
//
// What each step bought (H200, 2026-11-28, bf16 SPARGE N = 32K, H 32, D 128, top-k 0.5, the attention kernel alone,
// torch profiler; bench/gpu/profile_sparge.py --kernels): the whole Sage run on the mma.sync kernel took 49.7 ms
// (bench_gpu.py, ab36e94; bf16 SPARGE 19.1 ms); this kernel on 64-key steps 31.3 ms; S of the next tile in flight
// during the softmax (software pipeline) 31.9 ms, dropped (the kernel is bound by instruction issue, not by the tensor
// cores: ncu 13.4 G warp instructions against 7.1 G for the bf16 engine on the same mask, 1.8 issued per cycle);
// the mask-cell tests and the row factors worked out once per block instead of per tile 26.8 ms; 128-key steps
// (pairs of tiles) 22.4 ms; the scale applied inside the exponent's fused multiply-add 22.1 ms (7.7 G warp
// instructions, 1.5 per cycle; barrier stalls 18 % of the cycles: the ring's block-wide barrier each step).
// Measured and dropped: the ring on mbarriers instead of that barrier (each slot's copies completing on a "full"
// barrier, each pair released by the warps on an "empty" one and refilled at the end of the next step) 24.2 ms with
// the K scales read from global memory, 24.6 ms with them copied into the slots; S of the next pair in flight is
// out of reach at 255 registers.
// The pre-passes (Q, K, V^T quantization) add ~1.7 ms per run at this size and the prediction ~0.6–1.0 ms.
#include "forward_sage.h"

#include "../engine/forward_common.cuh"
#include "../runtime/gpu_runtime.h"
#include "forward_wgmma.h"

#if !SPARSA_GPU_IS_HIP
#include "mma_primitives.cuh"
#include "sage_tile.cuh"
#include "wgmma_primitives.cuh"
// The device helpers are referenced only by the kernel body, which the host pass and the sm_80 pass do not compile.
#pragma nv_diag_suppress 177
#endif

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ == 900 && defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define SPARSA_SAGE_WGMMA_DEVICE 1
#else
#define SPARSA_SAGE_WGMMA_DEVICE 0
#endif

SPARSA_GPU_NAMESPACE_BEGIN

#if !SPARSA_GPU_IS_HIP
namespace {

using namespace mma;
using namespace sage;
using namespace hopper;

constexpr int kHeadDim = 128;  // an int8 row is 128 bytes: one 128-byte-swizzled column block
constexpr int kWarpgroupThreads = 128;
constexpr int kWarpgroups = 2;
constexpr int kThreads = kWarpgroups * kWarpgroupThreads;
constexpr int kWarps = kThreads / 32;
constexpr int kRowsPerWarpgroup = 64;  // the M of every wgmma
constexpr int kRows = kWarpgroups * kRowsPerWarpgroup;
constexpr int kPairTiles = 2;  // 64-key tiles per step: S is one m64n128 product over two ring slots
constexpr int kStages = 6;     // ring slots: the step's pair, and two pairs in flight
constexpr int kAhead = 4;      // tiles copied ahead of the step: the slots the previous step freed are refilled
static_assert(kStages % kPairTiles == 0 && (kAhead + kPairTiles) % kStages == 0,
              "a step refills exactly the pair of slots the step before it read");
constexpr int kI8StepBytes = 32;  // K of one 8-bit wgmma: 32 elements
constexpr int kSteps = kHeadDim / kI8StepBytes;
constexpr int kStepKeys = kPairTiles * kTileKeys;
constexpr int kStepBlocks = kStepKeys / 8;  // 8-column blocks of a step's S
constexpr int kPvSteps = kStepKeys / kFp8StepKeys;
constexpr int kPvStepsPerTile = kTileKeys / kFp8StepKeys;
constexpr int kDimBlocks = kHeadDim / 8;
constexpr int kChunk = kSwizzleChunkBytes;
constexpr int kRowChunks = kHeadDim / kChunk;                        // 16-byte chunks per Q/K row
constexpr int kVtChunks = kTileKeys / kChunk;                        // 16-byte chunks per V^T channel row of a tile
constexpr int kCopiesPerThread = kTileKeys * kRowChunks / kThreads;  // of K chunks, and of V^T chunks, per tile
static_assert(kTileKeys == kSwizzle64Bytes, "a V^T tile row is one 64-byte-swizzled row");
static_assert(kTileKeys * kRowChunks % kThreads == 0 && kHeadDim * kVtChunks == kTileKeys * kRowChunks,
              "every thread copies the same number of K and V^T chunks");

// Shared memory (offsets from the kTileAlignment-aligned base): Q, the K slots (adjacent, so that a pair is one
// 128-row operand), the V^T slots, then the slots' key scales and the λ test's per-warp gains.
constexpr uint32_t kQBytes = kRows * kHeadDim;
constexpr uint32_t kKBytes = kTileKeys * kHeadDim;
constexpr uint32_t kVBytes = kHeadDim * kTileKeys;
constexpr uint32_t kKRingOffset = kQBytes;
constexpr uint32_t kVRingOffset = kKRingOffset + kStages * kKBytes;
constexpr uint32_t kScaleOffset = kVRingOffset + kStages * kVBytes;
constexpr int kGains = 3;  // per warp: tile a's gain, and tile b's with and without tile a kept
constexpr uint32_t kGainOffset = kScaleOffset + kStages * kTileKeys * sizeof(float);
constexpr uint32_t kSharedBytes = kGainOffset + kWarps * kGains * sizeof(float) + kTileAlignment;
static_assert(kQBytes % kTileAlignment == 0 && kKBytes % kTileAlignment == 0 && kVBytes % kTileAlignment == 0,
              "every tile starts on a swizzle-pattern boundary");

__global__ void __launch_bounds__(kThreads, 1) sage_wgmma_kernel(const SageParams s) {
#if SPARSA_SAGE_WGMMA_DEVICE
  extern __shared__ __align__(16) uint8_t shared_raw[];
  // Dynamic shared memory is only 16-byte aligned by contract; the swizzle needs kTileAlignment.
  const uint32_t raw_address = shared_address(shared_raw);
  const uint32_t base = (raw_address + kTileAlignment - 1) / kTileAlignment * kTileAlignment;
  uint8_t* const base_pointer = shared_raw + (base - raw_address);
  float* const slot_key_scales = reinterpret_cast<float*>(base_pointer + kScaleOffset);
  float* const warp_gains = reinterpret_cast<float*>(base_pointer + kGainOffset);
  auto k_slot = [&](int slot) { return base + kKRingOffset + uint32_t(slot) * kKBytes; };
  auto v_slot = [&](int slot) { return base + kVRingOffset + uint32_t(slot) * kVBytes; };

  const ForwardParams& p = s.fwd;
  const SequenceView seq = make_sequence_view(p, blockIdx.z, blockIdx.y);
  const int32_t row_begin = blockIdx.x * kRows;
  if (row_begin >= seq.seq_q) return;
  const BlockRows block = block_rows(p, seq, row_begin, kRows);
  const int32_t row_end = block.row_end, key_end = block.key_end, tile_count = block.tile_count;
  // §4 step 7 (supports() guarantees one mask cell per tile and block_q = kRows): the first computed tile is never
  // tested, and the decision covers the whole block.
  const float skip_threshold = block.skip_threshold;
  bool skip_test = false;

  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, warpgroup = warp / 4;
  const int64_t q_row0 = (int64_t(seq.b) * p.num_q_heads + seq.h) * s.max_seq_q;
  const int64_t kv_head_index = int64_t(seq.b) * s.num_kv_heads + seq.kv_head;
  const int8_t* const k_rows = s.k_i8 + kv_head_index * s.max_seq_k * kHeadDim;
  const uint8_t* const v_rows = s.v_fp8 + kv_head_index * kHeadDim * s.fp8_keys;
  const float* const key_scales = s.k_scale + kv_head_index * s.k_blocks;

  auto tile_visible = [&](int32_t candidate) {
    const int32_t key_begin = candidate * kTileKeys;
    return tile_has_visible_key(p, seq, row_begin, row_end, key_begin, min(key_begin + kTileKeys, key_end));
  };
  VisibleTileWalk fetch_walk, compute_walk;  // the copies' walk runs ahead of the products'

  // K rows (zero past the sequence end), the tile's V^T rows (zero there: written so by the pre-pass) and its
  // per-key scales into `slot`.
  auto load_tile = [&](int32_t tile, int slot) {
    const int32_t key_begin = tile * kTileKeys;
    const int valid_keys = min(kTileKeys, seq.seq_k - key_begin);
#pragma unroll
    for (int copy = 0; copy < kCopiesPerThread; ++copy) {
      const int index = threadIdx.x + copy * kThreads;
      const int r = index / kRowChunks, c = index % kRowChunks;
      const bool valid = r < valid_keys;
      cp_async_16(k_slot(slot) + swizzled_offset<kTileKeys>(r, c),
                  k_rows + (valid ? int64_t(key_begin + r) * kHeadDim + c * kChunk : 0), valid ? kChunk : 0);
    }
#pragma unroll
    for (int copy = 0; copy < kCopiesPerThread; ++copy) {
      const int index = threadIdx.x + copy * kThreads;
      const int c = index / kVtChunks, chunk = index % kVtChunks;
      cp_async_16(v_slot(slot) + swizzled64_offset(c, chunk),
                  v_rows + int64_t(c) * s.fp8_keys + key_begin + chunk * kChunk, kChunk);
    }
    float* key_scale = slot_key_scales + slot * kTileKeys;
    for (int r = threadIdx.x; r < kTileKeys; r += kThreads) {
      key_scale[r] = r < valid_keys ? key_scales[(key_begin + r) / p.mask_block_k] : 0.f;
    }
  };

  // A step whose second tile does not exist multiplies that slot's V^T by P = 0: the slots start as zeros (finite),
  // so that the product is 0 and not NaN.
  for (uint32_t offset = threadIdx.x * kChunk; offset < kStages * kVBytes; offset += kThreads * kChunk) {
    *reinterpret_cast<uint4*>(base_pointer + kVRingOffset + offset) = make_uint4(0u, 0u, 0u, 0u);
  }
  __syncthreads();  // the zeros are written before any copy lands in the slots

  // Q (int8, zero past the block's last row) joins the first copy group; the ring starts kAhead tiles deep.
  for (int index = threadIdx.x; index < kRows * kRowChunks; index += kThreads) {
    const int r = index / kRowChunks, c = index % kRowChunks;
    const bool valid = row_begin + r < row_end;
    const int8_t* src = s.q_i8 + (q_row0 + (valid ? row_begin + r : 0)) * kHeadDim + c * kChunk;
    cp_async_16(base + swizzled_offset<kRows>(r, c), src, valid ? kChunk : 0);
  }
  int32_t fetch = fetch_walk.next(0, tile_count, tile_visible);
  int fetch_slot = 0;
  auto fetch_next = [&]() {  // one copy group per call, empty or not, so that the waits below count tiles
    if (fetch < tile_count) {
      load_tile(fetch, fetch_slot);
      fetch = fetch_walk.next(fetch + 1, tile_count, tile_visible);
    }
    cp_async_commit();
    fetch_slot = (fetch_slot + 1) % kStages;
  };
#pragma unroll 1
  for (int t = 0; t < kAhead; ++t) fetch_next();

  const FragmentRows rows = fragment_rows(s, q_row0, row_begin + warp * 16, row_end, lane);
  const uint32_t q_descriptor = k_major_descriptor(base + warpgroup * kRowsPerWarpgroup * kHeadDim);
  float o_acc[kDimBlocks][4];
#pragma unroll
  for (int nd = 0; nd < kDimBlocks; ++nd) o_acc[nd][0] = o_acc[nd][1] = o_acc[nd][2] = o_acc[nd][3] = 0.f;
  float row_max[2] = {-INFINITY, -INFINITY};  // base-2 domain
  float row_sum[2] = {0.f, 0.f};              // this thread's partial; quad-reduced at the end

  int slot = 0;  // the step's first slot (its pair: slot, slot + 1)
#pragma unroll 1
  for (int32_t tile_a = compute_walk.next(0, tile_count, tile_visible); tile_a < tile_count;) {
    const int32_t tile_b = compute_walk.next(tile_a + 1, tile_count, tile_visible);  // tile_count: none
    cp_async_wait<kAhead - kPairTiles>();  // the pair has landed (later tiles may be in flight)
    fence_async_shared();  // cp.async wrote through the generic proxy; wgmma reads through the async one
    __syncthreads();       // every thread's copies are in, and every thread is done with the previous pair's slots
    fetch_next();
    fetch_next();

    // S = Q_i8·[K_a; K_b]ᵀ (exact int32): the pair's adjacent K slots are one 128-row operand.
    int32_t dots[kStepBlocks][4];
    int32_t(&dots_flat)[kStepBlocks * 4] = reinterpret_cast<int32_t(&)[kStepBlocks * 4]>(dots);
    const uint32_t k_descriptor = k_major_descriptor(k_slot(slot));
    fence_registers(dots_flat);
    wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < kSteps; ++kk) {
      wgmma_ss_s8_n128(dots_flat, advance_descriptor(q_descriptor, kk * kI8StepBytes),
                       advance_descriptor(k_descriptor, kk * kI8StepBytes), kDescriptorHigh, kk > 0 ? 1 : 0);
    }
    wgmma_commit();
    wgmma_wait<0>();
    fence_registers(dots_flat);

    // Each tile scaled and masked on its own (its keys and scales); an absent second tile sees nothing.
    float s_acc[kStepBlocks][4];
    float factor[kPairTiles][2] = {{1.f, 1.f}, {1.f, 1.f}};
    float max_a[2], max_b[2] = {-INFINITY, -INFINITY};
    auto& s_a = reinterpret_cast<float(&)[kKeyBlocks][4]>(s_acc[0]);
    auto& s_b = reinterpret_cast<float(&)[kKeyBlocks][4]>(s_acc[kKeyBlocks]);
    scale_and_mask(s_a, factor[0], reinterpret_cast<const int32_t(&)[kKeyBlocks][4]>(dots[0]), s, seq, block,
                   row_begin + warp * 16, tile_a * kTileKeys, slot_key_scales + slot * kTileKeys, rows, lane, max_a);
    if (tile_b < tile_count) {
      scale_and_mask(s_b, factor[1], reinterpret_cast<const int32_t(&)[kKeyBlocks][4]>(dots[kKeyBlocks]), s, seq, block,
                     row_begin + warp * 16, tile_b * kTileKeys, slot_key_scales + (slot + 1) * kTileKeys, rows, lane,
                     max_b);
    } else {
#pragma unroll
      for (int nb = 0; nb < kKeyBlocks; ++nb) s_b[nb][0] = s_b[nb][1] = s_b[nb][2] = s_b[nb][3] = -INFINITY;
    }

    // §4 step 7, tile by tile: max over the block's real rows of (m_local − m_new) < λ drops a tile's P·V, tile b
    // measured against the maximum that includes tile a when a is kept. One barrier serves both decisions.
    bool keep_a = true, keep_b = tile_b < tile_count;
    if (skip_threshold > -INFINITY) {
      float after_a[2];
#pragma unroll
      for (int r = 0; r < 2; ++r) after_a[r] = fmaxf(row_max[r], max_a[r]);
      const float gains[kGains] = {pv_skip_gain(max_a, row_max, rows, row_end),
                                   pv_skip_gain(max_b, after_a, rows, row_end),
                                   pv_skip_gain(max_b, row_max, rows, row_end)};
      if (lane < kGains) warp_gains[warp * kGains + lane] = gains[lane];
      __syncthreads();
      float best[kGains];
#pragma unroll
      for (int g = 0; g < kGains; ++g) {
        best[g] = warp_gains[g];
#pragma unroll
        for (int w = 1; w < kWarps; ++w) best[g] = fmaxf(best[g], warp_gains[w * kGains + g]);
      }
      keep_a = !skip_test || !(best[0] < skip_threshold);
      if (keep_b) keep_b = !((keep_a ? best[1] : best[2]) < skip_threshold);
      if (threadIdx.x == 0 && s.pv_skip_count != nullptr) {
        const unsigned long long dropped = (keep_a ? 0 : 1) + (tile_b < tile_count && !keep_b ? 1 : 0);
        if (dropped != 0) atomicAdd(reinterpret_cast<unsigned long long*>(s.pv_skip_count), dropped);
      }
      skip_test = true;  // every later computed tile is tested
      if (!keep_a) {
#pragma unroll
        for (int nb = 0; nb < kKeyBlocks; ++nb) s_a[nb][0] = s_a[nb][1] = s_a[nb][2] = s_a[nb][3] = -INFINITY;
        max_a[0] = max_a[1] = -INFINITY;
        factor[0][0] = factor[0][1] = 1.f;
      }
      if (!keep_b) {
#pragma unroll
        for (int nb = 0; nb < kKeyBlocks; ++nb) s_b[nb][0] = s_b[nb][1] = s_b[nb][2] = s_b[nb][3] = -INFINITY;
        max_b[0] = max_b[1] = -INFINITY;
        factor[1][0] = factor[1][1] = 1.f;
      }
    }

    // Online softmax over the pair, P·V into a fresh accumulator, O = O·rescale + P·V (rows that have still seen
    // nothing keep O = 0: their P is 0).
    const float step_max[2] = {fmaxf(max_a[0], max_b[0]), fmaxf(max_a[1], max_b[1])};
    float rescale[2];
    softmax_tile<true>(s_acc, factor, step_max, row_max, row_sum, rescale);
    uint32_t p_frag[kPvSteps][4];
    pack_p_e4m3(p_frag, s_acc);
    float tile_pv[kDimBlocks * 4];
    fence_registers(tile_pv);
    wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < kPvSteps; ++kk) {
      const uint32_t v_descriptor = k_major_descriptor(v_slot(slot + kk / kPvStepsPerTile));
      wgmma_rs_e4m3_n128(tile_pv, p_frag[kk], advance_descriptor(v_descriptor, (kk % kPvStepsPerTile) * kFp8StepKeys),
                         kDescriptorHigh64, kk > 0 ? 1 : 0);
    }
    wgmma_commit();
    wgmma_wait<0>();
    fence_registers(tile_pv);
    fence_registers(p_frag);
#pragma unroll
    for (int nd = 0; nd < kDimBlocks; ++nd) {
#pragma unroll
      for (int e = 0; e < 4; ++e) o_acc[nd][e] = fmaf(o_acc[nd][e], rescale[e / 2], tile_pv[4 * nd + e]);
    }
    slot = (slot + kPairTiles) % kStages;
    tile_a = tile_b < tile_count ? compute_walk.next(tile_b + 1, tile_count, tile_visible) : tile_count;
  }
  cp_async_wait<0>();  // no copy outlives the block
  store_rows<true, kHeadDim>(s, seq, o_acc, row_max, row_sum, rows, row_end, q_row0, kv_head_index, lane);
#else
  (void)s;
#endif  // SPARSA_SAGE_WGMMA_DEVICE
}

}  // namespace
#endif  // !SPARSA_GPU_IS_HIP

bool sage_wgmma_supports(const GpuDevice& device, const ForwardParams& p) {
#if !SPARSA_GPU_IS_HIP
  return device.compute_major == kHopperMajor && p.head_dim == kHeadDim &&
         (p.pv_skip_log2 == nullptr || p.mask_block_q == kRows) && hopper_code_loaded();
#else
  (void)device;
  (void)p;
  return false;
#endif
}

cudaError_t sage_wgmma_prepare(int32_t compute_major) {
#if !SPARSA_GPU_IS_HIP
  if (compute_major != kHopperMajor) return cudaSuccess;  // only a Hopper device launches it (and has the room)
  return cudaFuncSetAttribute(sage_wgmma_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(kSharedBytes));
#else
  (void)compute_major;
  return cudaSuccess;
#endif
}

cudaError_t sage_wgmma_launch(const SageParams& s, cudaStream_t stream) {
#if !SPARSA_GPU_IS_HIP
  const dim3 grid((s.max_seq_q + kRows - 1) / kRows, s.fwd.num_q_heads, s.fwd.batch);
  sage_wgmma_kernel<<<grid, kThreads, kSharedBytes, stream>>>(s);
  return cudaGetLastError();
#else
  (void)s;
  (void)stream;
  return cudaErrorInvalidValue;
#endif
}

SPARSA_GPU_NAMESPACE_END
