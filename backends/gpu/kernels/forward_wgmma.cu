// Hopper forward (sm_90a): FlashAttention-3-style warp specialisation on warpgroup MMA. fp16/bf16 inputs, fp32
// accumulation, head dims 64 and 128, every layout and visibility rule of forward_common.cuh, and the query-row maps
// of forward_params.h (Δ's rows, TOKEN_SPARSE's position lists; dense rule, unsplit), no PV skip. One thread block =
// 3 warpgroups for one 128-row query tile (launch rows) of one (sequence, query head):
//
//   warpgroup 0 (producer, few registers)   cp.async Q once, then K/V tiles into a kStages-deep ring, K one tile
//                                           ahead of V: through the tensor copy engine (TMA, one thread issues
//                                           the box loads) wherever a tile's rows are contiguous runs inside the
//                                           sequence, through cp.async otherwise (the partial last tile, paged or
//                                           listed rows). Each copy completes on an mbarrier (transaction bytes,
//                                           or cp.async.mbarrier.arrive.noinc), so the producer never blocks on its
//                                           own copies, only on a free K or V slot.
//   warpgroups 1, 2 (consumers, 64 rows each, many registers), per key tile:
//     S  = Q·Kᵀ       wgmma m64n128k16, A = Q and B = K both from shared memory (K-major descriptors)
//     S  = mask(S)    only on tiles that need it: per-row key limits, sink/window intervals, or the full predicate
//     online softmax  m, l, O rescaled in registers; base-2 exponentials, fp32
//     O += P·V        wgmma m64n{64|128}k16, A = P from registers (the S accumulators re-packed to 16 bit),
//                     B = V from shared memory (MN-major descriptor: V rows are read transposed by the hardware)
//   software-pipelined: S of tile n+1 and P·V of tile n are in flight together while the softmax of tile n+1
//   runs, and the two consumer warpgroups take turns issuing their products (named barriers), as in FA3.
//
// Shared-memory tiles use the 128-byte swizzle the descriptors name: a tile of R rows × D elements is stored as
// D/64 column blocks of R rows × 128 bytes, and the 16-byte chunk c of row r sits at chunk position c ^ (r % 8).
// The copies place every chunk there themselves (cp.async has no swizzle of its own). Tiles start on 1024-byte
// boundaries (the swizzle pattern repeats every 8 rows × 128 bytes and the hardware applies it to the address).
//
// The key tiles walked are the same as forward_mma.cu's (tile_has_visible_key in ascending order, here checked 32
// at a time by a warp ballot); split-KV writes partial states exactly like it. Block masks whose cells are finer
// than a tile along the keys but hold each consumer warpgroup's 64 rows in one cell row (wgmma_gathers_mask_cells:
// SPARGE's default 128 × 64, 64 × 64, 128 × 32, ...) are walked in 64-key halves instead: the visible halves, two
// per tile wherever they lie (a gathered tile; the producer copies each half from its own keys), and each thread
// masks its key columns by the few mask cells they lie in, plus the sequence end and the causal bound.
// A row map changes only where rows are read and written (per-row copies and stores through forward_common.cuh's
// launch_* offsets) and each row's causal horizon (its position, not its launch index); the tile loop is the same.
// Compiled to a stub for every target other than sm_90a (sm_80, HIP); forward_wgmma_supports() asks the runtime
// whether sm_90a code was loaded.
//
// What each step bought (H100 80GB HBM3, 2026-11-28, bf16, B 1, H 32, D 128, dense prefill 4K non-causal / causal,
// 16K non-causal / causal; bench/gpu/compare_builds.py, each build in its own process beside cuDNN):
//   cp.async K/V from the producer warpgroup     0.697 / 0.421 / 10.31 / 5.16 ms (394 / 327 / 427 / 426 TFLOP/s)
//   K/V through TMA                              0.505 / 0.305 / 7.44 / 3.99 ms (ncu, H200: the producer's 4,096
//                                                16-byte copies per tile and their address arithmetic are gone)
//   + tile max and sum in four chains            0.497 / 0.302 / 7.45 / 3.88 ms (553 / 454 / 590 / 567 TFLOP/s)
// cuDNN in the same calls: 0.408 / 0.262 / 6.90–7.10 / 3.68–3.81 ms.
// Measured and rejected (H100, same day, same four shapes): a persistent grid (one block per SM stepping through the
// work items, the next item's first K tile and Q loaded while this one's tail runs; a q_empty barrier; causal
// launches kept one block per item) ran 0.591 / 0.367 / 8.71 / 4.53 ms against 0.503 / 0.305 / 7.81 / 3.87 in the
// same call: the item loop around both roles made ptxas spill (136 bytes at D = 64, 332 at D = 128), and the
// causal rows, which ran the same code one item per block, lost as much as the others. A persistent grid needs
// the item state out of the consumers' registers first.
#include "forward_wgmma.h"

#include "../engine/forward_common.cuh"
#include "../engine/online_softmax.cuh"
#include "../engine/split_combine.h"
#include "../runtime/gpu_runtime.h"

#if !SPARSA_GPU_IS_HIP
#include <cuda.h>  // CUtensorMap and its enums (the encoder itself is reached through the runtime)
#include <cudaTypedefs.h>

#include "mma_primitives.cuh"
#include "wgmma_primitives.cuh"
// The device helpers below are referenced only by the kernel body, which the host pass and the sm_80 pass do not
// compile (#177: declared but never referenced).
#pragma nv_diag_suppress 177
#endif

// The kernel body exists only in the sm_90a device pass (wgmma, setmaxnreg need the arch-specific target).
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ == 900 && defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define SPARSA_WGMMA_DEVICE 1
#else
#define SPARSA_WGMMA_DEVICE 0
#endif

#include <cmath>

SPARSA_GPU_NAMESPACE_BEGIN

#if !SPARSA_GPU_IS_HIP
namespace {

using mma::BFloat16Tag;  // element tags and helpers shared with the mma.sync kernels (mma_primitives.cuh)
using mma::cp_async_16;
using mma::cp_async_wait_all;
using mma::FastExp2;
using mma::HalfTag;
using mma::pack_pair;
using mma::quad_max;
using mma::quad_sum;
using mma::shared_address;
using namespace hopper;  // the sm_90a PTX wrappers (wgmma_primitives.cuh)

constexpr int kWarpgroupThreads = 128;  // 4 consecutive warps issue one wgmma together
constexpr int kConsumerWarpgroups = 2;
constexpr int kThreads = (1 + kConsumerWarpgroups) * kWarpgroupThreads;
constexpr int kBlockRows = kWgmmaBlockRows;                     // query rows per thread block
constexpr int kBlockKeys = kWgmmaBlockKeys;                     // keys per tile (the N of S = Q·Kᵀ)
constexpr int kHalfKeys = kWgmmaHalfKeys;                       // keys of a gathered half tile
constexpr int kRowsPerConsumer = kBlockRows / kConsumerWarpgroups;  // the M of every wgmma: 64
constexpr int kConsumerWarps = kConsumerWarpgroups * kWarpgroupThreads / 32;
static_assert(kRowsPerConsumer == 64, "wgmma's M is 64 rows per warpgroup");
static_assert(kBlockKeys == 128, "S = Q·Kᵀ is one m64n128 accumulator");

// Registers per thread after the split (setmaxnreg): the producer only computes addresses, the consumers hold
// S (64), P (32) and O (32 or 64) fp32/packed values. A launch of kThreads threads with __launch_bounds__(.., 1)
// starts every thread at kLaunchRegisters; setmaxnreg.inc only draws on what setmaxnreg.dec released in the same
// block, so the split must balance exactly (else the consumers' increase waits forever).
constexpr int kLaunchRegisters = 168;  // 65536 / 384 rounded down to the allocation granule of 8
constexpr int kProducerRegisters = 56;
constexpr int kConsumerRegisters = 224;
static_assert(kProducerRegisters + kConsumerWarpgroups * kConsumerRegisters ==
                  (1 + kConsumerWarpgroups) * kLaunchRegisters,
              "setmaxnreg split must hand the consumers exactly what the producer gives up");

constexpr int kChunkBytes = kSwizzleChunkBytes;  // one cp.async / one swizzle unit
constexpr int kChunkElems = 8;                   // 2-byte elements per chunk
constexpr int kBlockElems = kSwizzleBytes / 2;   // elements per column block
constexpr int kMmaK = 16;                        // K of one wgmma (16-bit inputs)

// ---- wgmma descriptors of the tiles (the swizzle and the descriptor fields: wgmma_primitives.cuh) ----

// Byte offset of k-step kk (16 elements of the head dim) inside a K-major tile of kRows rows.
template <int kRows>
__device__ __forceinline__ uint32_t k_step_offset(int kk) {
  constexpr int kStepsPerBlock = kBlockElems / kMmaK;  // 4
  return uint32_t((kk / kStepsPerBlock) * kRows * kSwizzleBytes + (kk % kStepsPerBlock) * kMmaK * 2);
}

// MN-major operand (V as B of O = P·V: N = head dim is contiguous, K = keys are rows): the leading byte offset
// steps from one 64-element column block to the next (N), the stride byte offset from one 8-key group to the next.
// The k-step kk (16 keys) starts 16 rows down.
__device__ __forceinline__ uint32_t v_descriptor(uint32_t tile_address) {
  return descriptor_low(tile_address, kBlockKeys * kSwizzleBytes);
}
__device__ __forceinline__ uint32_t v_step_offset(int kk) { return uint32_t(kk * kMmaK * kSwizzleBytes); }

// S(64 rows × 128 keys) = Q·Kᵀ of one consumer warpgroup: kHeadDim/16 k-steps over shared Q and K.
template <typename Tag, int kHeadDim>
__device__ __forceinline__ void multiply_qk(float (&s)[64], uint32_t q_rows_address, uint32_t k_tile_address) {
  const uint32_t q_descriptor = k_major_descriptor(q_rows_address);
  const uint32_t k_descriptor = k_major_descriptor(k_tile_address);
  fence_registers(s);
  wgmma_fence();
#pragma unroll
  for (int kk = 0; kk < kHeadDim / kMmaK; ++kk) {
    wgmma_ss_n128(Tag{}, s, advance_descriptor(q_descriptor, k_step_offset<kBlockRows>(kk)),
                  advance_descriptor(k_descriptor, k_step_offset<kBlockKeys>(kk)), kDescriptorHigh, kk > 0 ? 1 : 0);
  }
  wgmma_commit();
}

// O(64 rows × kHeadDim) += P·V: kBlockKeys/16 k-steps, A = P fragments in registers, B = V tile in shared memory.
template <typename Tag, int kHeadDim>
__device__ __forceinline__ void multiply_pv(float (&o)[kHeadDim / 2], const uint32_t (&p)[kBlockKeys / kMmaK][4],
                                            uint32_t v_tile_address) {
  const uint32_t descriptor = v_descriptor(v_tile_address);
  fence_registers(o);
  wgmma_fence();
#pragma unroll
  for (int kk = 0; kk < kBlockKeys / kMmaK; ++kk) {
    wgmma_rs(Tag{}, o, p[kk], advance_descriptor(descriptor, v_step_offset(kk)), kDescriptorHigh, 1);
  }
  wgmma_commit();
}

// ---- The copy engine's view of K and V ----

// K and V as 4-d tensors for the tensor copy engine: (head dim, rows, kv head, batch), innermost first, 16-bit
// elements; a box is 64 elements × kHalfKeys rows, one 128-byte-swizzled column block of a half tile (a gathered
// tile's halves lie anywhere, a plain tile's two follow each other). Packed K/V have a batch extent of 1 (rows are
// cu_seqlens_k[b] + t). `present` is false where the maps could not be made (paged or listed rows, strides the
// engine cannot take, a driver without the entry point): every tile then takes cp.async.
struct KvTensorMaps {
  CUtensorMap k, v;
  bool present = false;
};

// ---- One thread block: its query tile, its key-tile walk, its shared memory ----

// Shared-memory plan: Q tile, kStages K tiles, kStages V tiles, then the barriers (q_full; per stage k_full,
// v_full, k_empty, v_empty). kBytes includes the slack that aligns the base to kTileAlignment.
template <int kHeadDim, int kStages>
struct SharedPlan {
  static constexpr uint32_t kQBytes = kBlockRows * kHeadDim * 2;
  static constexpr uint32_t kTileBytes = kBlockKeys * kHeadDim * 2;
  static constexpr uint32_t kKOffset = kQBytes;
  static constexpr uint32_t kVOffset = kKOffset + kStages * kTileBytes;
  static constexpr uint32_t kBarrierOffset = kVOffset + kStages * kTileBytes;
  static constexpr uint32_t kBarriersPerStage = 4;
  static constexpr uint32_t kBarrierCount = 1 + kBarriersPerStage * kStages;
  static constexpr uint32_t kBytes = kBarrierOffset + kBarrierCount * 8 + kTileAlignment;
};

template <int kHeadDim, int kStages>
struct BlockTile {
  using Plan = SharedPlan<kHeadDim, kStages>;
  const ForwardParams& p;
  const KvTensorMaps& maps;
  SequenceView seq;
  int32_t split = 0;
  int32_t row_begin = 0, row_end = 0;  // query rows of the block
  int32_t key_end = 0;                 // causal bound of the block's last row
  bool gather = false;                 // walk 64-key halves of mask cells, two per tile (wgmma_gathers_mask_cells)
  int32_t unit_keys = kBlockKeys;      // keys of one walked unit: a whole tile, or a half when gathering
  int32_t first_unit = 0, unit_count = 0;  // this split's share of the walked units: [first_unit, unit_count)
  uint32_t base = 0;                   // shared address of the aligned plan

  __device__ uint32_t q_tile() const { return base; }
  __device__ uint32_t k_tile(int stage) const { return base + Plan::kKOffset + stage * Plan::kTileBytes; }
  __device__ uint32_t v_tile(int stage) const { return base + Plan::kVOffset + stage * Plan::kTileBytes; }
  __device__ uint32_t q_full() const { return base + Plan::kBarrierOffset; }
  __device__ uint32_t stage_barrier(int stage, int which) const {
    return base + Plan::kBarrierOffset + 8 * (1 + Plan::kBarriersPerStage * stage + which);
  }
  __device__ uint32_t k_full(int stage) const { return stage_barrier(stage, 0); }   // K copies landed
  __device__ uint32_t v_full(int stage) const { return stage_barrier(stage, 1); }   // V copies landed
  __device__ uint32_t k_empty(int stage) const { return stage_barrier(stage, 2); }  // both halves done with K
  __device__ uint32_t v_empty(int stage) const { return stage_barrier(stage, 3); }  // both halves done with V

  // May some row of the block see a key of walked unit `unit`?
  __device__ bool unit_visible(int32_t unit) const {
    const int32_t key_begin = unit * unit_keys;
    return tile_has_visible_key(p, seq, row_begin, row_end, key_begin, min(key_begin + unit_keys, key_end));
  }
};

// Keys of one computed tile: columns [0, 64) hold keys begin[0] .., columns [64, 128) keys begin[1] ... A plain tile
// t has begin = {128t, 128t + 64}; a gathered tile two visible halves wherever they lie, or one and kNoKeys (the odd
// half at the end of a walk). Keys at or past the sequence end are zero-filled by the copies and masked.
constexpr int32_t kNoKeys = 1 << 30;  // past every sequence (int32 lengths), with room for + kBlockKeys
struct KeyTile {
  int32_t begin[2] = {kNoKeys, kNoKeys};
  // (A select, not begin[column / 64]: a runtime index would put the pair in local memory.)
  __device__ int32_t key(int column) const {
    return column < kHalfKeys ? begin[0] + column : begin[1] + (column - kHalfKeys);
  }
};

// The tiles of the walk, in order: plain (one visible unit = one tile) or gathered (the next two visible halves).
struct TileCursor {
  VisibleTileWalk walk;  // the visible units (tiles, or halves when gathering), 32 per warp ballot
  int32_t unit = 0;  // first unit not yet taken
  template <typename Block>
  __device__ bool next(const Block& block, KeyTile& tile) {
    const auto visible = [&](int32_t u) { return block.unit_visible(u); };
    const int32_t first = walk.next(unit, block.unit_count, visible);
    if (first >= block.unit_count) return false;
    if (!block.gather) {
      tile.begin[0] = first * kBlockKeys;
      tile.begin[1] = tile.begin[0] + kHalfKeys;
      unit = first + 1;
      return true;
    }
    const int32_t second = walk.next(first + 1, block.unit_count, visible);
    tile.begin[0] = first * kHalfKeys;
    tile.begin[1] = second < block.unit_count ? second * kHalfKeys : kNoKeys;
    unit = second + 1;
    return true;
  }
};

// Ring position of the walk's i-th tile: slot and the parity of its barriers' current phase.
template <int kStages>
struct RingSlot {
  int stage = 0;
  uint32_t phase = 0;
  __device__ void advance() {
    if (++stage == kStages) {
      stage = 0;
      phase ^= 1;
    }
  }
};

// Copies rows [0, kRows) of a tile into its swizzled shared layout; rows r with !valid(r) are zero-filled (so
// masked keys multiply zeros, never stale data). Row r starts at element row_offset(r) of `base`. Each of the producer
// warpgroup's threads owns one 16-byte column of every kRowsPerPass-th row (a warp reads whole 256-byte rows).
template <int kHeadDim, int kRows, typename RowOffset, typename RowValid>
__device__ __forceinline__ void copy_rows(uint32_t tile_address, const uint16_t* base, RowOffset row_offset,
                                          RowValid valid_row, int thread) {
  constexpr int kChunksPerRow = kHeadDim / kChunkElems;
  constexpr int kRowsPerPass = kWarpgroupThreads / kChunksPerRow;
  static_assert(kRows % kRowsPerPass == 0, "tile rows must divide evenly among the producer threads");
  const int chunk = thread % kChunksPerRow;
#pragma unroll 4
  for (int row = thread / kChunksPerRow; row < kRows; row += kRowsPerPass) {
    const bool valid = valid_row(row);
    const uint16_t* src = valid ? base + row_offset(row) + chunk * kChunkElems : base;
    cp_async_16(tile_address + swizzled_offset<kRows>(row, chunk), src, valid ? kChunkBytes : 0);
  }
}

// copy_rows for rows whose offsets come from memory (paged: the page table; position lists: the list). Looking a
// row up right before its copy serialises the lookups (each cp.async is a compiler memory barrier, so the next
// lookup cannot be issued early): one dependent global load per row, 16 per thread and tile. Instead every lane
// first looks up ONE row of its warp's share (all loads in flight together), and each pass takes its row's offset
// from the owning lane by a shuffle. A warp copies kWarpRowsPerPass rows per pass, kPasses passes: exactly 32 rows.
template <int kHeadDim, int kRows, typename RowOffset, typename RowValid>
__device__ __forceinline__ void copy_gathered_rows(uint32_t tile_address, const uint16_t* base, RowOffset row_offset,
                                                   RowValid valid_row, int thread) {
  constexpr int kChunksPerRow = kHeadDim / kChunkElems;
  constexpr int kRowsPerPass = kWarpgroupThreads / kChunksPerRow;
  constexpr int kWarpRowsPerPass = 32 / kChunksPerRow;
  constexpr int kPasses = kRows / kRowsPerPass;
  static_assert(kPasses * kWarpRowsPerPass == 32, "every lane looks up exactly one row of its warp");
  const int warp = thread / 32;
  const int lane = thread % 32;
  // Thread t copies row t / kChunksPerRow + pass·kRowsPerPass = warp·W + lane / kChunksPerRow + pass·kRowsPerPass
  // (W = kWarpRowsPerPass); lane l looks up that row for pass l / W and lane group l % W.
  const int owned_row = warp * kWarpRowsPerPass + lane % kWarpRowsPerPass + (lane / kWarpRowsPerPass) * kRowsPerPass;
  const long long owned = valid_row(owned_row) ? static_cast<long long>(row_offset(owned_row)) : 0;
  const int chunk = thread % kChunksPerRow;
#pragma unroll 4
  for (int pass = 0; pass < kPasses; ++pass) {
    const int row = thread / kChunksPerRow + pass * kRowsPerPass;
    const long long offset = __shfl_sync(0xffffffffu, owned, pass * kWarpRowsPerPass + lane / kChunksPerRow);
    const bool valid = valid_row(row);
    const uint16_t* src = valid ? base + offset + chunk * kChunkElems : base;
    cp_async_16(tile_address + swizzled_offset<kRows>(row, chunk), src, valid ? kChunkBytes : 0);
  }
}

// Producer warpgroup: Q once, then the walked tiles' K and V into the ring, K one tile ahead of V (the consumers
// need K of tile n+1 before V of tile n). Never waits on its own copies, only on free slots.
template <int kHeadDim, int kStages>
__device__ __forceinline__ void produce(const BlockTile<kHeadDim, kStages>& block, int thread) {
  const ForwardParams& p = block.p;
  const SequenceView& seq = block.seq;
  const uint16_t* q_base = static_cast<const uint16_t*>(p.q);
  const int q_rows = block.row_end - block.row_begin;
  auto q_valid = [&](int r) { return r < q_rows; };
  if (p.row_map == QueryRowMap::kAll) {  // consecutive rows: one offset, then a stride
    const int64_t q_first = query_row_offset(p.q_strides, seq, block.row_begin);
    copy_rows<kHeadDim, kBlockRows>(
        block.q_tile(), q_base, [&](int r) { return q_first + r * p.q_strides.s; }, q_valid, thread);
  } else {  // Δ's anchors and tail, or a position list: every row finds its own
    copy_gathered_rows<kHeadDim, kBlockRows>(
        block.q_tile(), q_base, [&](int r) { return launch_query_offset(p, p.q_strides, seq, block.row_begin + r); },
        q_valid, thread);
  }
  barrier_arrive_on_copies(block.q_full());

  // K or V rows of `tile` into ring slot `slot`; a fresh empty barrier counts as released. Row r of the tile is key
  // tile.key(r): one contiguous run of 128 keys for a plain tile, two runs of 64 for a gathered one. A tile whose
  // two halves lie wholly inside the sequence goes through the copy engine (one thread issues 2·D/64 box loads; the
  // others only arrive); the last, partial tile (and the odd half at the end of a gathered walk) and listed or paged
  // rows through cp.async, which zero-fills the rows past the sequence end (rows of a padded cache past seq_lens_k
  // may hold anything, NaN included).
  const int32_t batch_coordinate = p.cu_seqlens_k != nullptr ? 0 : seq.b;
  auto load = [&](const void* tensor, const CUtensorMap* map, const TensorStrides& strides, uint32_t empty,
                  uint32_t full, uint32_t tile_address, const KeyTile& tile, uint32_t phase) {
    barrier_wait(empty, phase ^ 1);
    if (block.maps.present && tile.begin[0] + kHalfKeys <= seq.seq_k && tile.begin[1] + kHalfKeys <= seq.seq_k) {
      if (thread == 0) {
        barrier_arrive_expect_bytes(full, kBlockKeys * kHeadDim * 2);
#pragma unroll
        for (int half = 0; half < 2; ++half) {
#pragma unroll
          for (int column_block = 0; column_block < kHeadDim / kBlockElems; ++column_block) {
            tensor_load_4d(tile_address + (column_block * kBlockKeys + half * kHalfKeys) * kSwizzleBytes, map,
                           column_block * kBlockElems, seq.k_row_base + tile.begin[half], seq.kv_head,
                           batch_coordinate, full);
          }
        }
      } else {
        barrier_arrive(full);
      }
      return;
    }
    const uint16_t* base = static_cast<const uint16_t*>(tensor);
    auto valid = [&](int r) { return tile.key(r) < seq.seq_k; };
    if (p.page_table == nullptr && p.row_map != QueryRowMap::kTokenLists) {
      // padded/packed rows are evenly spaced: one offset, then a stride
      const int64_t first = key_row_offset(p, strides, seq, 0);
      copy_rows<kHeadDim, kBlockKeys>(
          tile_address, base, [&](int r) { return first + int64_t(tile.key(r)) * strides.s; }, valid, thread);
    } else {  // paged or a position list: every row looks up its page / its position (a per-row gather)
      copy_gathered_rows<kHeadDim, kBlockKeys>(
          tile_address, base, [&](int r) { return launch_key_offset(p, strides, seq, tile.key(r)); }, valid, thread);
    }
    barrier_arrive_on_copies(full);
  };
  TileCursor cursor;
  cursor.unit = block.first_unit;
  RingSlot<kStages> slot;
  KeyTile tile, next;
  bool have = cursor.next(block, tile);
  if (have) load(p.k, &block.maps.k, p.k_strides, block.k_empty(0), block.k_full(0), block.k_tile(0), tile, 0);
  while (have) {
    const bool more = cursor.next(block, next);
    RingSlot<kStages> next_slot = slot;
    next_slot.advance();
    if (more) {
      load(p.k, &block.maps.k, p.k_strides, block.k_empty(next_slot.stage), block.k_full(next_slot.stage),
           block.k_tile(next_slot.stage), next, next_slot.phase);
    }
    load(p.v, &block.maps.v, p.v_strides, block.v_empty(slot.stage), block.v_full(slot.stage),
         block.v_tile(slot.stage), tile, slot.phase);
    tile = next;
    have = more;
    slot = next_slot;
  }
  cp_async_wait_all();  // no copy outlives its thread (the Q copy when no tile was visible)
}

// One consumer warpgroup's rows (row_begin + 64·consumer ..) and their running state: O, m, l.
// Accumulator fragment (PTX "wgmma D fragment"): register 4·n + j holds row 16·warp + lane/4 + 8·(j/2), column
// 8·n + 2·(lane % 4) + j % 2 — two rows per thread, two adjacent columns in every 8-column block.
template <typename Tag, int kHeadDim, int kStages>
struct Consumer {
  static constexpr int kOutRegisters = kHeadDim / 2;  // 64 rows × kHeadDim over 128 threads
  static constexpr int kPSteps = kBlockKeys / kMmaK;  // k-steps of O += P·V
  const BlockTile<kHeadDim, kStages>& block;
  int consumer = 0;       // 0 or 1: which half of the block's rows
  bool pingpong = false;  // take turns with the other half (both have rows)
  int lane = 0;
  int32_t wg_row_begin = 0, wg_row_end = 0, wg_key_end = 0;  // launch rows; wg_key_end: causal bound of the last
  int32_t wg_first_horizon = 0;  // last causal key of the warpgroup's first row (its smallest horizon)
  int32_t rows[2] = {0, 0};      // this thread's two launch rows
  int32_t horizon[2] = {0, 0};   // their last causal keys: position + causal_offset (a row map moves positions)
  uint32_t q_rows = 0;       // shared address of the warpgroup's 64 Q rows
  const uint8_t* mask_row = nullptr;  // gathered tiles: the mask cell row of the warpgroup's rows
  float o[kOutRegisters];
  float row_max[2] = {-INFINITY, -INFINITY};  // base-2 domain
  float row_sum[2] = {0.f, 0.f};              // this thread's partial; quad-reduced at the end

  __device__ Consumer(const BlockTile<kHeadDim, kStages>& b, int half, int thread) : block(b), consumer(half) {
    const int warp = thread / 32;
    lane = thread % 32;
    wg_row_begin = block.row_begin + consumer * kRowsPerConsumer;
    wg_row_end = min(wg_row_begin + kRowsPerConsumer, block.seq.rows);
    wg_key_end = wg_row_begin < block.seq.rows ? key_end_for_rows(block.p, block.seq, wg_row_end) : 0;
    wg_first_horizon = row_position(block.p, block.seq, wg_row_begin) + block.seq.causal_offset;
    rows[0] = wg_row_begin + warp * 16 + lane / 4;
    rows[1] = rows[0] + 8;
#pragma unroll
    for (int r = 0; r < 2; ++r) horizon[r] = row_position(block.p, block.seq, rows[r]) + block.seq.causal_offset;
    q_rows = block.q_tile() + consumer * kRowsPerConsumer * kSwizzleBytes;
    if (block.gather) {  // rows are positions here (a row map runs with the dense rule only)
      const ForwardParams& p = block.p;
      mask_row = p.block_mask + block.seq.b * p.block_mask_strides[0] + block.seq.h * p.block_mask_strides[1] +
                 (wg_row_begin / p.mask_block_q) * p.block_mask_strides[2];
    }
#pragma unroll
    for (int i = 0; i < kOutRegisters; ++i) o[i] = 0.f;
  }

  // Which 8-key column blocks of `tile` the policy's rule lets this warpgroup's rows see (bit n: columns 8n ..
  // 8n + 7), before the sequence end and the causal bound, which mask() applies per element. Global reads only:
  // called while the products are in flight. A plain tile is all or nothing (may any row see any of its keys? A
  // walked tile may still be invisible to one half). A gathered tile: the warpgroup's rows lie in one mask cell
  // row, so each key's cell decides for all of them; a 64-key half lies in one cell (block_k >= 64) or holds
  // 64 / block_k whole cells of 8, 16 or 32 keys, and this thread reads one byte per cell of each half.
  static constexpr uint32_t kAllBlocks = (1u << (kBlockKeys / 8)) - 1u;
  __device__ uint32_t visible_blocks(const KeyTile& tile) const {
    const ForwardParams& p = block.p;
    if (!block.gather) {
      const int32_t key_begin = tile.begin[0];
      const bool seen = key_begin < wg_key_end && tile_has_visible_key(p, block.seq, wg_row_begin, wg_row_end,
                                                                       key_begin, min(key_begin + kBlockKeys,
                                                                                      wg_key_end));
      return seen ? kAllBlocks : 0u;
    }
    constexpr int kBlocksPerHalf = kHalfKeys / 8;
    const int blocks_per_cell = min(kBlocksPerHalf, p.mask_block_k / 8);
    const uint32_t cell_bits = (1u << blocks_per_cell) - 1u;
    uint32_t visible = 0u;
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int32_t begin = tile.begin[h];
      // Cells from the causal bound of the last row (or the sequence end) on are not read: their keys are masked
      // anyway, and a half's last cells may lie past the mask's columns (kNoKeys: no half at all).
#pragma unroll 1
      for (int n = 0; n < kBlocksPerHalf && begin + 8 * n < wg_key_end; n += blocks_per_cell) {
        const int64_t cell = (begin + 8 * n) / p.mask_block_k;
        if (mask_row[cell * p.block_mask_strides[3]] != 0) visible |= cell_bits << (h * kBlocksPerHalf + n);
      }
    }
    return visible;
  }

  // S = -inf where a key is invisible; `blocks` = visible_blocks(tile). Gathered tiles: mask_gathered. Plain tiles,
  // cheapest case first: a tile this half cannot see at all (blocks == 0) becomes all -inf (P = 0). A rule-uniform
  // tile (every dense tile; block-mask tiles inside one cell; sink/window tiles inside the sinks or the window)
  // needs only the sequence end and the causal bound: nothing when the tile lies inside both, else one key limit
  // per row. Other tiles (mask cells or window edges cutting the
  // tile) take a rolled loop that collects one visibility bit per key and row (few live registers: this runs while
  // the previous tile's P and O are held for its P·V) and then applies the bits.
  __device__ void mask(float (&s)[64], const KeyTile& tile, uint32_t blocks) const {
    if (block.gather) {
      mask_gathered(s, tile, blocks);
    } else {
      mask_plain(s, tile.begin[0], blocks != 0u);
    }
  }

  __device__ void mask_plain(float (&s)[64], int32_t key_begin, bool seen) const {
    const ForwardParams& p = block.p;
    const SequenceView& seq = block.seq;
    const int32_t key_column = key_begin + 2 * (lane % 4);  // key of accumulator 0; register i adds 8·(i/4) + i%2
    uint32_t visible_bits[2] = {0u, 0u};  // bit 2·n + e: key key_column + 8·n + e
    if (seen) {
      const int32_t tile_key_end = min(key_begin + kBlockKeys, wg_key_end);
      if (tile_rule_uniform(p, seq, wg_row_begin, wg_row_end, key_begin, tile_key_end)) {
        if (key_begin + kBlockKeys <= seq.seq_k && (!p.causal || key_begin + kBlockKeys - 1 <= wg_first_horizon)) {
          return;
        }
        int32_t limit[2];  // row r sees register i iff 8·(i/4) + i%2 < limit[r]
#pragma unroll
        for (int r = 0; r < 2; ++r) {
          int64_t end = seq.seq_k;
          if (p.causal) end = min(end, int64_t(horizon[r]) + 1);
          limit[r] = int32_t(max(int64_t(-1), min(int64_t(kBlockKeys), end - key_column)));
        }
#pragma unroll
        for (int i = 0; i < 64; ++i) {
          if ((i / 4) * 8 + i % 2 >= limit[(i / 2) % 2]) s[i] = -INFINITY;
        }
        return;
      }
      if (p.rule == VisibilityRule::kSinkWindow) {  // window edges: per row, the sinks and one key interval
        mask_sink_window(s, key_column);
        return;
      }
#pragma unroll 1
      for (int c = 0; c < kBlockKeys / 4; ++c) {
        const int32_t key = key_column + (c / 2) * 8 + c % 2;
#pragma unroll
        for (int r = 0; r < 2; ++r) {
          const bool visible = key < seq.seq_k && (!p.causal || key <= horizon[r]) &&
                               key_visible(p, seq, rows[r], key);
          visible_bits[r] |= uint32_t(visible) << c;
        }
      }
    }
#pragma unroll
    for (int i = 0; i < 64; ++i) {
      if (((visible_bits[(i / 2) % 2] >> (2 * (i / 4) + i % 2)) & 1u) == 0) s[i] = -INFINITY;
    }
  }

  // A gathered tile: the column blocks that visible_blocks() let through, each half cut by the sequence end and
  // every row's causal bound (one key limit per half and row, as a rule-uniform plain tile has one per row).
  // Nothing to do when every block is visible and both halves lie inside the sequence and every row's horizon.
  __device__ void mask_gathered(float (&s)[64], const KeyTile& tile, uint32_t blocks) const {
    const ForwardParams& p = block.p;
    const SequenceView& seq = block.seq;
    const int32_t column = 2 * (lane % 4);  // column of accumulator 0 in its 8-column block
    bool inside = blocks == kAllBlocks;
    int32_t limit[2][2];  // [half][row r]: register i of half i / 32 sees its key iff 8·(i/4 % 8) + i%2 < limit
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int32_t begin = tile.begin[h];
      inside = inside && begin + kHalfKeys <= seq.seq_k && (!p.causal || begin + kHalfKeys - 1 <= wg_first_horizon);
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        int64_t end = seq.seq_k;
        if (p.causal) end = min(end, int64_t(horizon[r]) + 1);
        limit[h][r] = int32_t(max(int64_t(-1), min(int64_t(kHalfKeys), end - (int64_t(begin) + column))));
      }
    }
    if (inside) return;
#pragma unroll
    for (int i = 0; i < 64; ++i) {
      const int n = i / 4;  // column block
      if (((blocks >> n) & 1u) == 0u || 8 * (n % 8) + i % 2 >= limit[n / 8][(i / 2) % 2]) s[i] = -INFINITY;
    }
  }

  // Sink/window rule (§2) on a tile it does not cover uniformly: row r sees key k iff k < end_r and (k is a sink
  // or window_begin_r <= k < window_end_r), with end_r the sequence end (and the diagonal + 1 when causal). All
  // bounds are taken relative to the thread's first key column and clamped to the tile.
  __device__ void mask_sink_window(float (&s)[64], int32_t key_column) const {
    const ForwardParams& p = block.p;
    const SequenceView& seq = block.seq;
    auto relative = [&](int64_t key) { return int32_t(max(int64_t(-1), min(int64_t(kBlockKeys), key - key_column))); };
    const int32_t sink_end = relative(p.sink_tokens);
    int32_t end[2], window_begin[2], window_end[2];
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const int64_t diagonal = horizon[r];
      end[r] = relative(p.causal ? min(int64_t(seq.seq_k), diagonal + 1) : int64_t(seq.seq_k));
      window_begin[r] = relative(diagonal - p.sink_window + 1);
      window_end[r] = relative(p.causal ? diagonal + 1 : diagonal + p.sink_window);
    }
#pragma unroll
    for (int i = 0; i < 64; ++i) {
      const int r = (i / 2) % 2;
      const int32_t k = (i / 4) * 8 + i % 2;
      const bool visible = k < end[r] && (k < sink_end || (k >= window_begin[r] && k < window_end[r]));
      if (!visible) s[i] = -INFINITY;
    }
  }

  // Online softmax in base 2: m = max(m, scale·log2e·max S), l rescaled, S becomes P = 2^(S·scale·log2e - m).
  // Returns through `rescale` the factor O must be multiplied by before P·V is added. A row's 32 values are reduced
  // in kLanes independent chains joined at the end (a single chain of dependent max or add operations would sit on
  // the path between the products; the pairing changes the sum's rounding only, within fp32).
  static constexpr int kLanes = 4;
  static_assert(kLanes == 4 && (kBlockKeys / 8) % kLanes == 0, "the joins below name four chains");
  __device__ void softmax(float (&s)[64], float (&rescale)[2]) {
    const float scale_log2 = block.p.scale_log2;
    constexpr int kBlocksPerLane = kBlockKeys / 8 / kLanes;
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      float lane_max[kLanes];
#pragma unroll
      for (int c = 0; c < kLanes; ++c) {
        lane_max[c] = fmaxf(s[4 * c + 2 * r], s[4 * c + 2 * r + 1]);
#pragma unroll
        for (int k = 1; k < kBlocksPerLane; ++k) {
          const int n = c + kLanes * k;
          lane_max[c] = fmaxf(lane_max[c], fmaxf(s[4 * n + 2 * r], s[4 * n + 2 * r + 1]));
        }
      }
      const float tile_max = quad_max(fmaxf(fmaxf(lane_max[0], lane_max[1]), fmaxf(lane_max[2], lane_max[3])));
      // scale > 0 keeps the arg max
      const softmax::MaxUpdate step = softmax::update_max(row_max[r], tile_max * scale_log2, FastExp2{});
      rescale[r] = step.rescale;
      row_max[r] = step.max;
      float lane_sum[kLanes] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
      for (int n = 0; n < kBlockKeys / 8; ++n) {
        s[4 * n + 2 * r] = softmax::scaled_probability(s[4 * n + 2 * r], scale_log2, step.reference, FastExp2{});
        s[4 * n + 2 * r + 1] =
            softmax::scaled_probability(s[4 * n + 2 * r + 1], scale_log2, step.reference, FastExp2{});
        lane_sum[n % kLanes] += s[4 * n + 2 * r] + s[4 * n + 2 * r + 1];
      }
      const float tile_sum = (lane_sum[0] + lane_sum[1]) + (lane_sum[2] + lane_sum[3]);
      row_sum[r] = softmax::rescaled_sum(row_sum[r], rescale[r], tile_sum);
    }
  }

  __device__ void rescale_output(const float (&rescale)[2]) {
#pragma unroll
    for (int n = 0; n < kHeadDim / 8; ++n) {
#pragma unroll
      for (int j = 0; j < 4; ++j) o[4 * n + j] *= rescale[j / 2];
    }
  }

  // P as the A operand of k-step kk (keys 16·kk ..): exactly the accumulators of column blocks 2kk and 2kk+1.
  __device__ static void pack_p(const float (&s)[64], uint32_t (&p_frag)[kPSteps][4]) {
#pragma unroll
    for (int kk = 0; kk < kPSteps; ++kk) {
#pragma unroll
      for (int j = 0; j < 4; ++j) p_frag[kk][j] = pack_pair(Tag{}, s[8 * kk + 2 * j], s[8 * kk + 2 * j + 1]);
    }
  }

  // This warp is done with a K or V slot (every consumer warp arrives).
  __device__ void release(uint32_t empty) const {
    __syncwarp();
    if (lane == 0) barrier_arrive(empty);
  }

  // S = Q·Kᵀ for the tile in `stage` (raw scores; the scale is folded into the exponent).
  __device__ void issue_qk(float (&s)[64], int stage, uint32_t phase) const {
    barrier_wait(block.k_full(stage), phase);
    fence_async_shared();
    multiply_qk<Tag, kHeadDim>(s, q_rows, block.k_tile(stage));
  }
  // O += P·V for the tile in `stage`.
  __device__ void issue_pv(uint32_t (&p_frag)[kPSteps][4], int stage, uint32_t phase) {
    barrier_wait(block.v_full(stage), phase);
    fence_async_shared();
    fence_registers(p_frag);
    multiply_pv<Tag, kHeadDim>(o, p_frag, block.v_tile(stage));
  }

  // Ping-pong between the two consumer warpgroups (FlashAttention-3): each issues its wgmmas only in its turn and
  // then hands the turn over, so the tensor cores run one warpgroup's products while the other does its softmax.
  // Turns go through named barriers kTurnBarrier + consumer (id 0 is __syncthreads), each counted by both
  // warpgroups: the waiting one syncs, the other arrives.
  static constexpr int kTurnBarrier = 1;
  static constexpr int kConsumerThreads = kConsumerWarpgroups * kWarpgroupThreads;
  __device__ void wait_turn() const {
    if (pingpong) asm volatile("bar.sync %0, %1;\n" ::"r"(kTurnBarrier + consumer), "n"(kConsumerThreads) : "memory");
  }
  __device__ void pass_turn() const {
    if (pingpong) {
      asm volatile("bar.arrive %0, %1;\n" ::"r"(kTurnBarrier + (consumer ^ 1)), "n"(kConsumerThreads) : "memory");
    }
  }

  // The attention loop, software-pipelined (FlashAttention-3 "intra-warpgroup overlap"): S of the next tile and
  // P·V of this one are in flight together while the walk finds the tile after and the softmax of the next tile
  // runs; O is rescaled only once P·V has landed. Every walked tile is computed (one this half cannot see is
  // masked to P = 0). Warpgroup 0 takes the first turn; warpgroup 1 hands it over at the start and keeps its last.
  // Measured and rejected (H200, N = 16K, H = 32, D = 128): a loop that issues no products for a tile this
  // warpgroup cannot see (visible_blocks == 0, e.g. 64-row cells whose other cell row holds the tile) ran 12-17 %
  // slower on every shape, dense included (the per-tile branches around the products and the unpeeled first tile
  // cost more than the skipped products save); skipping the softmax as well spilled registers at D = 128.
  template <bool kPingpong>
  __device__ void run() {
    TileCursor cursor;
    cursor.unit = block.first_unit;
    KeyTile tile;  // the tile whose S is being masked
    KeyTile next;  // the one after it (found while products are in flight)
    bool more = cursor.next(block, tile);
    if (wg_row_begin >= block.seq.rows) {  // no rows here: only hand the slots back
      for (RingSlot<kStages> slot; more; more = cursor.next(block, tile)) {
        barrier_wait(block.v_full(slot.stage), slot.phase);  // V lands after K: both slots are written
        release(block.k_empty(slot.stage));
        release(block.v_empty(slot.stage));
        slot.advance();
      }
      return;
    }
    if (!more) return;
    pingpong = kPingpong && block.row_begin + kRowsPerConsumer < block.seq.rows;
    if (consumer == 1) pass_turn();
    barrier_wait(block.q_full(), 0);
    RingSlot<kStages> slot;
    float s[64];
    float rescale[2];
    uint32_t p_frag[kPSteps][4];
    wait_turn();
    issue_qk(s, slot.stage, slot.phase);
    pass_turn();
    uint32_t blocks = visible_blocks(tile);
    more = cursor.next(block, next);  // the walk overlaps the product in flight
    wgmma_wait<0>();
    fence_registers(s);
    release(block.k_empty(slot.stage));
    mask(s, tile, blocks);
    softmax(s, rescale);  // O is still zero: no rescale
    pack_p(s, p_frag);
    while (more) {
      RingSlot<kStages> next_slot = slot;
      next_slot.advance();
      wait_turn();
      issue_qk(s, next_slot.stage, next_slot.phase);
      issue_pv(p_frag, slot.stage, slot.phase);
      pass_turn();
      tile = next;
      blocks = visible_blocks(tile);  // overlaps the products in flight
      more = cursor.next(block, next);
      wgmma_wait<1>();  // S of the new tile has landed (groups complete in order); the last P·V may still run
      fence_registers(s);
      release(block.k_empty(next_slot.stage));
      mask(s, tile, blocks);
      softmax(s, rescale);
      wgmma_wait<0>();
      fence_registers(o);
      fence_registers(p_frag);  // read by the tensor cores until the wait
      release(block.v_empty(slot.stage));
      rescale_output(rescale);
      pack_p(s, p_frag);
      slot = next_slot;
    }
    wait_turn();
    issue_pv(p_frag, slot.stage, slot.phase);
    if (consumer == 0) pass_turn();  // warpgroup 1 keeps its last turn: every sync has exactly one arrival
    wgmma_wait<0>();
    fence_registers(o);
    fence_registers(p_frag);
    release(block.v_empty(slot.stage));
  }

  // Normalise and write: O / l (0 for a row that saw nothing), LSE = (m + log2 l)·ln 2 (-inf likewise); with
  // split-KV, the fp32 partial state that combine_splits_launch merges.
  __device__ void store() const {
    const ForwardParams& p = block.p;
    const SequenceView& seq = block.seq;
    uint16_t* out_base = static_cast<uint16_t*>(p.out);
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const float total = quad_sum(row_sum[r]);
      const int32_t row = rows[r];
      if (row >= wg_row_end) continue;
      const softmax::RowOutput result = softmax::finish_row(row_max[r], total);
      const float inverse = result.inverse;
      const float lse = result.lse;
      if (p.num_splits > 1) {
        const int64_t state = softmax::partial_state_index(p, seq, block.split, row);
        float* partial = p.partial_out + state * kHeadDim;
#pragma unroll
        for (int n = 0; n < kHeadDim / 8; ++n) {
          *reinterpret_cast<float2*>(partial + n * 8 + 2 * (lane % 4)) =
              make_float2(o[4 * n + 2 * r] * inverse, o[4 * n + 2 * r + 1] * inverse);
        }
        if (lane % 4 == 0) p.partial_lse[state] = lse;
        continue;
      }
      uint16_t* out_row = out_base + launch_output_offset(p, seq, row);
#pragma unroll
      for (int n = 0; n < kHeadDim / 8; ++n) {
        *reinterpret_cast<uint32_t*>(out_row + n * 8 + 2 * (lane % 4)) =
            pack_pair(Tag{}, o[4 * n + 2 * r] * inverse, o[4 * n + 2 * r + 1] * inverse);
      }
      if (p.lse != nullptr && lane % 4 == 0) p.lse[launch_lse_offset(p, seq, row)] = lse;
    }
  }
};

template <typename Tag, int kHeadDim, int kStages, bool kPingpong>
__global__ void __launch_bounds__(kThreads, 1)
    forward_wgmma_kernel(const ForwardParams p, const __grid_constant__ KvTensorMaps maps) {
#if SPARSA_WGMMA_DEVICE
  extern __shared__ uint8_t shared_raw[];
  BlockTile<kHeadDim, kStages> block{p, maps};
  // Dynamic shared memory is only 16-byte aligned by contract; the swizzle needs kTileAlignment.
  block.base = (shared_address(shared_raw) + kTileAlignment - 1) / kTileAlignment * kTileAlignment;

  // Causal: heavy query tiles (most keys) first, so the light ones fill the tail of the launch.
  const int32_t query_tiles = gridDim.x / p.num_splits;
  const int32_t tile_slot = blockIdx.x / p.num_splits;
  const int32_t query_tile = p.causal ? query_tiles - 1 - tile_slot : tile_slot;
  block.split = blockIdx.x % p.num_splits;
  block.seq = make_sequence_view(p, blockIdx.z, blockIdx.y);
  block.row_begin = query_tile * kBlockRows;
  if (block.row_begin >= block.seq.rows) return;  // uniform over the block, before any barrier exists
  block.row_end = min(block.row_begin + kBlockRows, block.seq.rows);
  block.key_end = key_end_for_rows(p, block.seq, block.row_end);
  block.gather = p.rule == VisibilityRule::kBlockMask && wgmma_gathers_mask_cells(p.mask_block_q, p.mask_block_k);
  block.unit_keys = block.gather ? kHalfKeys : kBlockKeys;
  const int32_t all_units = (block.key_end + block.unit_keys - 1) / block.unit_keys;
  const int32_t units_per_split = (all_units + p.num_splits - 1) / p.num_splits;
  block.first_unit = min(all_units, block.split * units_per_split);
  block.unit_count = min(all_units, block.first_unit + units_per_split);

  if (threadIdx.x == 0) {
    barrier_init(block.q_full(), kWarpgroupThreads);  // every producer thread's copies
    for (int stage = 0; stage < kStages; ++stage) {
      barrier_init(block.k_full(stage), kWarpgroupThreads);
      barrier_init(block.v_full(stage), kWarpgroupThreads);
      barrier_init(block.k_empty(stage), kConsumerWarps);  // one arrival per consumer warp
      barrier_init(block.v_empty(stage), kConsumerWarps);
    }
  }
  __syncthreads();

  const int warpgroup = threadIdx.x / kWarpgroupThreads;
  const int thread = threadIdx.x % kWarpgroupThreads;
  if (warpgroup == 0) {
    registers_decrease<kProducerRegisters>();
    produce(block, thread);
  } else {
    registers_increase<kConsumerRegisters>();
    Consumer<Tag, kHeadDim, kStages> consumer(block, warpgroup - 1, thread);
    consumer.template run<kPingpong>();
    consumer.store();
  }
#endif  // SPARSA_WGMMA_DEVICE
}

// Ring depth: as many stages as fit beside the Q tile (D = 128: 32 KB + 3 × 64 KB; D = 64: 16 KB + 4 × 32 KB).
template <int kHeadDim>
constexpr int kStagesFor = kHeadDim == 64 ? 4 : 3;
// The consumer warpgroups take turns issuing their products (Consumer::wait_turn).
constexpr bool kPingpongTurns = true;

template <typename Tag, int kHeadDim, int kStages = kStagesFor<kHeadDim>, bool kPingpong = kPingpongTurns>
cudaError_t allow_shared_memory() {
  return cudaFuncSetAttribute(forward_wgmma_kernel<Tag, kHeadDim, kStages, kPingpong>,
                              cudaFuncAttributeMaxDynamicSharedMemorySize,
                              int(SharedPlan<kHeadDim, kStages>::kBytes));
}

// The driver's tensor-map encoder, found once through the runtime (the library does not link libcuda); null when
// the driver lacks it. Immutable after the first call.
PFN_cuTensorMapEncodeTiled_v12000 tensor_map_encoder() {
  static const PFN_cuTensorMapEncodeTiled_v12000 encoder = [] {
    constexpr unsigned kEntryPointVersion = 12000;  // the version of the typedef above
    void* function = nullptr;
    cudaDriverEntryPointQueryResult found = cudaDriverEntryPointSymbolNotFound;
    if (cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &function, kEntryPointVersion, cudaEnableDefault,
                                         &found) != cudaSuccess ||
        found != cudaDriverEntryPointSuccess) {
      (void)cudaGetLastError();
      return PFN_cuTensorMapEncodeTiled_v12000{nullptr};
    }
    return reinterpret_cast<PFN_cuTensorMapEncodeTiled_v12000>(function);
  }();
  return encoder;
}

// K or V (forward_params.h's padded or packed layout) as KvTensorMaps describes it. False where the engine cannot
// take the tensor (an address or stride not a multiple of 16 bytes, a stride past 2^40 bytes): cp.async then.
bool encode_kv_map(const ForwardParams& p, const void* tensor, const TensorStrides& strides, CUtensorMap* map) {
  const PFN_cuTensorMapEncodeTiled_v12000 encode = tensor_map_encoder();
  if (encode == nullptr) return false;
  constexpr uint64_t kElementBytes = 2;
  const bool packed = p.cu_seqlens_k != nullptr;
  const cuuint64_t dims[4] = {cuuint64_t(p.head_dim), cuuint64_t(p.kv_rows_extent),
                              cuuint64_t(p.num_q_heads / p.group_size), packed ? 1u : cuuint64_t(p.batch)};
  // (A batch extent of 1 never steps its stride; the row stride stands in for packed layouts' 0.)
  const int64_t batch_stride = packed ? strides.s : strides.b;
  if (strides.s <= 0 || strides.h <= 0 || batch_stride <= 0) return false;
  const cuuint64_t byte_strides[3] = {cuuint64_t(strides.s) * kElementBytes, cuuint64_t(strides.h) * kElementBytes,
                                      cuuint64_t(batch_stride) * kElementBytes};
  const cuuint32_t box[4] = {cuuint32_t(kBlockElems), cuuint32_t(kHalfKeys), 1u, 1u};
  const cuuint32_t element_strides[4] = {1u, 1u, 1u, 1u};
  return encode(map, CU_TENSOR_MAP_DATA_TYPE_UINT16, 4, const_cast<void*>(tensor), dims, byte_strides, box,
                element_strides, CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B,
                CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE) == CUDA_SUCCESS;
}

// Tensor maps for launches whose key tiles are contiguous runs of rows (padded or packed K/V, keys not read through
// a position list); host work only, no stream operation (legal inside graph capture).
KvTensorMaps make_kv_tensor_maps(const ForwardParams& p) {
  KvTensorMaps maps;
  if (p.page_table != nullptr || p.row_map == QueryRowMap::kTokenLists || !p.kv_rows_aligned16 ||
      p.kv_rows_extent <= 0) {
    return maps;
  }
  maps.present = encode_kv_map(p, p.k, p.k_strides, &maps.k) && encode_kv_map(p, p.v, p.v_strides, &maps.v);
  return maps;
}

template <typename Tag, int kHeadDim, int kStages = kStagesFor<kHeadDim>, bool kPingpong = kPingpongTurns>
cudaError_t launch(const ForwardParams& params, int32_t max_seq_q, cudaStream_t stream) {
  ForwardParams p = params;
  // A row map writes its own output rows (the partial states' combine writes plain rows): such a launch runs
  // whole whatever was planned (forward_params.h), as in forward_mma.cu.
  if (p.row_map != QueryRowMap::kAll) p.num_splits = 1;
  const int32_t query_tiles = (max_seq_q + kBlockRows - 1) / kBlockRows;
  const dim3 grid(query_tiles * p.num_splits, p.num_q_heads, p.batch);
  const KvTensorMaps maps = make_kv_tensor_maps(p);
  forward_wgmma_kernel<Tag, kHeadDim, kStages, kPingpong>
      <<<grid, kThreads, SharedPlan<kHeadDim, kStages>::kBytes, stream>>>(p, maps);
  cudaError_t status = cudaGetLastError();
  if (status != cudaSuccess || p.num_splits == 1) return status;
  return combine_splits_launch(p, stream);  // the merge split-KV kernels share (split_combine.h)
}

}  // namespace
#endif  // !SPARSA_GPU_IS_HIP

bool hopper_code_loaded() {
#if !SPARSA_GPU_IS_HIP
  // The kernel of every other target is a stub, and its binary version says so (80 for the sm_80 build an sm_90
  // device would otherwise run). The module was loaded by forward_wgmma_prepare.
  cudaFuncAttributes attributes;
  if (cudaFuncGetAttributes(&attributes, forward_wgmma_kernel<BFloat16Tag, 128, kStagesFor<128>, kPingpongTurns>) !=
      cudaSuccess) {
    (void)cudaGetLastError();
    return false;
  }
  constexpr int kHopperBinaryVersion = 90;
  return attributes.binaryVersion == kHopperBinaryVersion;
#else
  return false;
#endif
}

bool forward_wgmma_supports(const ForwardParams& p, int32_t compute_major, const char** reason) {
#if !SPARSA_GPU_IS_HIP
  if (compute_major != kHopperMajor) {
    *reason = "wgmma path needs a Hopper (compute capability 9.x) device";
    return false;
  }
  if (p.element_type == ElementType::kF32) {
    *reason = "wgmma path takes fp16/bf16 only";
    return false;
  }
  if (p.head_dim != 64 && p.head_dim != 128) {
    *reason = "wgmma path has head_dim 64 and 128 only";
    return false;
  }
  if (p.pv_skip_log2 != nullptr) {
    *reason = "wgmma path has no PV skip (the mma.sync kernel serves it)";
    return false;
  }
  if (p.row_map != QueryRowMap::kAll && p.rule != VisibilityRule::kDense) {
    *reason = "query-row maps run with the dense rule only";
    return false;
  }
  if (p.row_map == QueryRowMap::kDeltaRows && p.delta_gamma <= 0) {
    *reason = "delta rows need gamma > 0";
    return false;
  }
  if (!hopper_code_loaded()) {
    *reason = "wgmma path needs a build with sm_90a device code (CMAKE_CUDA_ARCHITECTURES containing 90a)";
    return false;
  }
  return true;
#else
  (void)p;
  (void)compute_major;
  *reason = "wgmma path exists on NVIDIA Hopper only";
  return false;
#endif
}

cudaError_t forward_wgmma_prepare() {
#if !SPARSA_GPU_IS_HIP
  // Only a Hopper device ever launches the kernel (and only there does its shared-memory size fit).
  int device = 0, major = 0;
  cudaError_t status = cudaGetDevice(&device);
  if (status == cudaSuccess) status = cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device);
  if (status != cudaSuccess || major != kHopperMajor) return status;
  (void)tensor_map_encoder();  // the entry-point lookup happens here, outside any graph capture
  for (cudaError_t set : {allow_shared_memory<HalfTag, 64>(), allow_shared_memory<HalfTag, 128>(),
                          allow_shared_memory<BFloat16Tag, 64>(), allow_shared_memory<BFloat16Tag, 128>()}) {
    if (set != cudaSuccess) return set;
  }
#endif
  return cudaSuccess;
}

cudaError_t forward_wgmma_launch(const ForwardParams& p, int32_t max_seq_q, cudaStream_t stream) {
#if !SPARSA_GPU_IS_HIP
  const bool bf16 = p.element_type == ElementType::kBF16;
  if (p.head_dim == 64) {
    return bf16 ? launch<BFloat16Tag, 64>(p, max_seq_q, stream) : launch<HalfTag, 64>(p, max_seq_q, stream);
  }
  return bf16 ? launch<BFloat16Tag, 128>(p, max_seq_q, stream) : launch<HalfTag, 128>(p, max_seq_q, stream);
#else
  (void)p;
  (void)max_seq_q;
  (void)stream;
  return cudaErrorInvalidValue;
#endif
}

SPARSA_GPU_NAMESPACE_END
