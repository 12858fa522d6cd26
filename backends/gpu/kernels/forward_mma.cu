// FlashAttention-2-style forward on NVIDIA tensor cores (sm_80+): fp16/bf16 inputs, fp32 accumulation, head dims
// 64 and 128. One thread block = 4 warps = one query tile of one (sequence, query head); each warp owns 16 rows (one
// m16 fragment, 64-row tiles) or 32 rows (two fragments, 128-row tiles: every K/V fragment loaded feeds twice the
// mma). The block walks the key tiles its rows may see (forward_common.cuh) in ascending order (MmaTiling below says
// how K/V loads overlap the math: double-buffered, or FlashAttention-2's single-buffered order):
//
//   cp.async  K/V tiles -> shared             (overlapping the previous tile's math)
//   S  = Q·Kᵀ                                 mma.sync m16n8k16, A = Q (ldmatrix), B = K rows (ldmatrix)
//   S  = mask(S) · scale·log2(e)              exact element predicate, only on tiles that need it
//   [PV skip: block-wide max of m_local - m_new vs λ; a dropped tile stops here]
//   online softmax: m, l, O rescaled          base-2 exponentials, fp32
//   O += P·V                                  P re-packed from the S accumulators, B = V (ldmatrix.trans)
//
// Query-row maps (forward_params.h) change only where rows are read and written and each row's causal horizon.
// Shared-memory rows are XOR-swizzled in 16-byte chunks (chunk ^ (row % 8)) so that ldmatrix's eight row reads hit
// eight different bank groups. HIP builds compile this file to a launcher that reports "unsupported" (no mma.sync).
#include "forward_mma.h"

#include "../engine/forward_common.cuh"
#include "../engine/online_softmax.cuh"
#include "../engine/split_combine.h"
#include "../runtime/gpu_runtime.h"

#if SPARSA_GPU_HAS_MMA_SYNC
#include "mma_primitives.cuh"
// nvcc's front end reports the device helpers below as unreferenced (#177) in the pass that only sees the kernel
// template through the launcher; they are referenced by the kernel body.
#pragma nv_diag_suppress 177
#endif

#include <cmath>

SPARSA_GPU_NAMESPACE_BEGIN

#if SPARSA_GPU_HAS_MMA_SYNC
namespace {

using namespace mma;  // the shared PTX wrappers (mma_primitives.cuh)

constexpr int kWarps = 4;        // each warp owns 16 rows (one mma M fragment) or 32 (two)
constexpr int kThreads = kWarps * 32;
constexpr int kChunkElems = 8;   // 16-byte chunk of 2-byte elements
constexpr int kSwizzleRows = 8;  // swizzle period: ldmatrix reads 8 rows at once

// ---- Shared-memory tiles: [rows][kHeadDim] 2-byte elements, 16-byte chunks swizzled per row ----

template <int kHeadDim>
__device__ __forceinline__ int swizzled_offset(int row, int chunk) {
  return row * kHeadDim + ((chunk ^ (row % kSwizzleRows)) * kChunkElems);
}

// Copies `rows` rows starting at global row offsets given by row_offset(r) into a swizzled shared tile.
template <int kHeadDim, int kRows, typename RowOffset>
__device__ __forceinline__ void load_tile_async(uint16_t* tile, const uint16_t* base, RowOffset row_offset,
                                                int valid_rows) {
  constexpr int kChunksPerRow = kHeadDim / kChunkElems;
  constexpr int kChunks = kRows * kChunksPerRow;
  static_assert(kChunks % kThreads == 0, "tile chunks must divide evenly among threads");
  for (int index = threadIdx.x; index < kChunks; index += kThreads) {
    const int row = index / kChunksPerRow;
    const int chunk = index % kChunksPerRow;
    const bool valid = row < valid_rows;
    const uint16_t* src = valid ? base + row_offset(row) + chunk * kChunkElems : base;
    cp_async_16(shared_address(tile + swizzled_offset<kHeadDim>(row, chunk)), src, valid ? 16 : 0);
  }
}

// A thread block's tiling: kWarps warps × kFrags m16 row fragments each, kKeys keys per tile, K/V in kStages buffers:
//   kStages 2: tile n+1's K and V load while tile n computes;
//   kStages 1: FlashAttention-2's order, V(n) loading during S(n) and K(n+1) during P·V(n), in half the memory.
// kQInRegisters keeps the Q fragments for the whole walk (one fragment per warp only: two would not fit beside their
// O accumulators in 255 registers); otherwise Q is re-read from shared memory per key tile. kMinBlocks: resident
// blocks per multiprocessor the register allocation must allow (__launch_bounds__).
template <int kFrags_, int kKeys_, int kStages_, bool kQInRegisters_, int kMinBlocks_>
struct MmaTiling {
  static constexpr int kFrags = kFrags_, kKeys = kKeys_, kStages = kStages_, kMinBlocks = kMinBlocks_;
  static constexpr bool kQInRegisters = kQInRegisters_;
  static constexpr int kRows = kWarps * 16 * kFrags;
  static_assert(kFrags == 1 || !kQInRegisters, "two Q fragments per warp do not fit in registers");
  template <int kHeadDim>
  static constexpr size_t kSharedBytes = size_t(kRows + 2 * kStages * kKeys) * kHeadDim * sizeof(uint16_t);
};

// The tiling of plain and row-map launches: 128 x 64 in FlashAttention-2's single-buffered order (measured on an H200,
// bf16 D=128 N=16K: 222 TFLOP/s non-causal vs 191 for 64x64 double-buffered with Q in registers, 216 for 128x64
// double-buffered, 214 for 64x64 single-buffered at 3 blocks/SM). PV-skip launches use the tile of the mask's cell.
using PlainTiling = MmaTiling<2, 64, 1, false, 1>;
using SkipTiling64 = MmaTiling<1, 64, 2, true, 1>;    // PV skip, block_q 64
using SkipTiling128 = MmaTiling<2, 64, 2, false, 1>;  // PV skip, block_q 128
constexpr int kSkipBlockKeys = 64;
static_assert(PlainTiling::kRows == kMmaBlockRows && PlainTiling::kKeys == kMmaBlockKeys,
              "forward_mma.h must describe the plain tiling");
static_assert(SkipTiling64::kKeys == kSkipBlockKeys && SkipTiling128::kKeys == kSkipBlockKeys, "");

// kMapped: the launch has a query-row map or the PV skip. A plain launch is compiled without either (the copy below
// pins row_map and pv_skip_log2 to constants), which keeps their state out of the registers the tiles need.
template <typename Tag, int kHeadDim, typename Tiling, bool kMapped>
__global__ void __launch_bounds__(kThreads, Tiling::kMinBlocks) forward_mma_kernel(const ForwardParams params) {
#if SPARSA_GPU_DEVICE_HAS_MMA_SYNC
  ForwardParams p = params;
  if (!kMapped) {
    p.row_map = QueryRowMap::kAll;
    p.pv_skip_log2 = nullptr;
  }
  constexpr int kFrags = Tiling::kFrags;
  constexpr int kBlockKeys = Tiling::kKeys;
  constexpr int kBlockRows = Tiling::kRows;
  constexpr bool kQInRegisters = Tiling::kQInRegisters;
  constexpr bool kDoubleBuffered = Tiling::kStages == 2;
  constexpr int kTileElems = kBlockKeys * kHeadDim;
  constexpr int kKeyBlocks8 = kBlockKeys / 8;   // n-blocks of the S tile
  constexpr int kDimBlocks8 = kHeadDim / 8;     // n-blocks of the O tile
  extern __shared__ uint4 shared_storage[];
  uint16_t* q_tile = reinterpret_cast<uint16_t*>(shared_storage);
  uint16_t* k_tiles = q_tile + kBlockRows * kHeadDim;         // [kStages][kBlockKeys][kHeadDim]
  uint16_t* v_tiles = k_tiles + Tiling::kStages * kTileElems;  // [kStages][kBlockKeys][kHeadDim]
  __shared__ float warp_gain[kWarps];                         // PV skip: each warp's max of (m_local - m_new)

  const SequenceView seq = make_sequence_view(p, blockIdx.z, blockIdx.y);
  const int32_t split = blockIdx.x % p.num_splits;
  // Causal: the last query tiles see the most keys; blocks start in index order, so they take those first (the
  // last wave then holds the short tiles).
  const int32_t query_tiles = gridDim.x / p.num_splits;
  const int32_t query_tile = p.causal ? query_tiles - 1 - int32_t(blockIdx.x / p.num_splits)
                                      : int32_t(blockIdx.x / p.num_splits);
  const int32_t row_begin = query_tile * kBlockRows;
  if (row_begin >= seq.rows) return;
  const int32_t row_end = min(row_begin + kBlockRows, seq.rows);
  const int32_t key_end = key_end_for_rows(p, seq, row_end);
  // This block's share of the key tiles: [first_tile, tile_count).
  const int32_t all_tiles = (key_end + kBlockKeys - 1) / kBlockKeys;
  const int32_t tiles_per_split = (all_tiles + p.num_splits - 1) / p.num_splits;
  const int32_t first_tile = min(all_tiles, split * tiles_per_split);
  const int32_t tile_count = min(all_tiles, first_tile + tiles_per_split);
  // §4 step 7 (the launcher guarantees one mask cell per tile and no split): the first computed tile is never tested.
  const float skip_threshold = p.pv_skip_log2 != nullptr ? p.pv_skip_log2[seq.h] : -INFINITY;
  bool skip_test = false;

  const int warp = threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  const uint16_t* q_base = static_cast<const uint16_t*>(p.q);

  VisibleTileWalk walk;
  auto next_visible_tile = [&](int32_t tile) {
    return walk.next(tile, tile_count, [&](int32_t candidate) {
      const int32_t key_begin = candidate * kBlockKeys;
      return tile_has_visible_key(p, seq, row_begin, row_end, key_begin, min(key_begin + kBlockKeys, key_end));
    });
  };
  // K or V rows of key tile `tile` into `dst`.
  auto issue_rows = [&](int32_t tile, uint16_t* dst, const void* src, const TensorStrides& st) {
    const uint16_t* base = static_cast<const uint16_t*>(src);
    const int32_t key_begin = tile * kBlockKeys;
    const int valid = min(kBlockKeys, seq.seq_k - key_begin);
    if (p.page_table == nullptr && p.row_map != QueryRowMap::kTokenLists) {
      // padded/packed rows are evenly spaced: one offset, then a stride
      const int64_t first = key_row_offset(p, st, seq, key_begin);
      load_tile_async<kHeadDim, kBlockKeys>(dst, base, [&](int r) { return first + r * st.s; }, valid);
    } else {
      load_tile_async<kHeadDim, kBlockKeys>(
          dst, base, [&](int r) { return launch_key_offset(p, st, seq, key_begin + r); }, valid);
    }
  };

  // Stage 0: the Q tile and the first key tile's K (and V when double-buffered) in one cp.async group.
  if (p.row_map == QueryRowMap::kAll) {
    const int64_t q_first = query_row_offset(p.q_strides, seq, row_begin);
    load_tile_async<kHeadDim, kBlockRows>(
        q_tile, q_base, [&](int r) { return q_first + r * p.q_strides.s; }, row_end - row_begin);
  } else {
    load_tile_async<kHeadDim, kBlockRows>(
        q_tile, q_base, [&](int r) { return launch_query_offset(p, p.q_strides, seq, row_begin + r); },
        row_end - row_begin);
  }
  int32_t tile = next_visible_tile(first_tile);
  if (tile < tile_count) {
    issue_rows(tile, k_tiles, p.k, p.k_strides);
    if (kDoubleBuffered) issue_rows(tile, v_tiles, p.v, p.v_strides);
  }
  cp_async_commit();

  // Per-thread state, per fragment f: rows (lane/4) and (lane/4 + 8) of the fragment's 16; O per 8-wide dim block.
  float o_acc[kFrags][kDimBlocks8][4];
#pragma unroll
  for (int f = 0; f < kFrags; ++f) {
#pragma unroll
    for (int nd = 0; nd < kDimBlocks8; ++nd) o_acc[f][nd][0] = o_acc[f][nd][1] = o_acc[f][nd][2] = o_acc[f][nd][3] = 0.f;
  }
  float row_max[kFrags][2];  // base-2 domain
  float row_sum[kFrags][2];  // this thread's partial; quad-reduced at the end
  const int warp_row0 = warp * 16 * kFrags;
  // Launch row of (fragment f, half r); recomputed where needed rather than held (registers are the limit).
  auto my_row = [&](int f, int r) { return row_begin + warp_row0 + f * 16 + lane / 4 + 8 * r; };
#pragma unroll
  for (int f = 0; f < kFrags; ++f) {
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      row_max[f][r] = -INFINITY;
      row_sum[f][r] = 0.f;
    }
  }

  const bool warp_active = row_begin + warp_row0 < row_end;
  uint32_t q_frag[kQInRegisters ? kHeadDim / 16 : 1][4];
  bool q_in_registers = false;

  int buffer = 0;
  while (tile < tile_count) {
    const int32_t next = next_visible_tile(tile + 1);
    if (kDoubleBuffered) {
      if (next < tile_count) {
        issue_rows(next, k_tiles + (buffer ^ 1) * kTileElems, p.k, p.k_strides);
        issue_rows(next, v_tiles + (buffer ^ 1) * kTileElems, p.v, p.v_strides);
        cp_async_commit();
        cp_async_wait<1>();
      } else {
        cp_async_wait<0>();
      }
      __syncthreads();
    } else {
      cp_async_wait<0>();  // K of this tile
      __syncthreads();     // ... visible to all; every warp is past the previous tile's P·V, so V may be refilled
      issue_rows(tile, v_tiles, p.v, p.v_strides);
      cp_async_commit();
    }
    const uint16_t* k_tile = k_tiles + buffer * kTileElems;
    const uint16_t* v_tile = v_tiles + buffer * kTileElems;
    const int32_t key_begin = tile * kBlockKeys;

    float s_acc[kFrags][kKeyBlocks8][4];
    float tile_max[kFrags][2];  // raw (unscaled) row maxima of this tile, quad-reduced
    if (warp_active) {  // a warp whose rows all lie past the sequence end only helps load tiles
      if (kQInRegisters && !q_in_registers) {
#pragma unroll
        for (int kk = 0; kk < kHeadDim / 16; ++kk) {
          ldmatrix_x4(q_frag[kk],
                      shared_address(q_tile + swizzled_offset<kHeadDim>(warp_row0 + lane % 16, 2 * kk + lane / 16)));
        }
        q_in_registers = true;
      }

      // S = Q·Kᵀ for this warp's rows × the tile's keys: each K fragment feeds 2·kFrags mma.
#pragma unroll
      for (int f = 0; f < kFrags; ++f) {
#pragma unroll
        for (int nb = 0; nb < kKeyBlocks8; ++nb) s_acc[f][nb][0] = s_acc[f][nb][1] = s_acc[f][nb][2] = s_acc[f][nb][3] = 0.f;
      }
#pragma unroll
      for (int kk = 0; kk < kHeadDim / 16; ++kk) {
        uint32_t a[kFrags][4];
#pragma unroll
        for (int f = 0; f < kFrags; ++f) {
          if (kQInRegisters) {
#pragma unroll
            for (int x = 0; x < 4; ++x) a[f][x] = q_frag[kQInRegisters ? kk : 0][x];
          } else {
            ldmatrix_x4(a[f], shared_address(q_tile + swizzled_offset<kHeadDim>(warp_row0 + f * 16 + lane % 16,
                                                                               2 * kk + lane / 16)));
          }
        }
#pragma unroll
        for (int nb = 0; nb < kKeyBlocks8; nb += 2) {
          uint32_t b[4];
          const int key_row = nb * 8 + lane % 8 + (lane / 16) * 8;
          ldmatrix_x4(b, shared_address(k_tile + swizzled_offset<kHeadDim>(key_row, 2 * kk + (lane / 8) % 2)));
#pragma unroll
          for (int f = 0; f < kFrags; ++f) {
            mma_16816(Tag{}, s_acc[f][nb], a[f], b[0], b[1]);
            mma_16816(Tag{}, s_acc[f][nb + 1], a[f], b[2], b[3]);
          }
        }
      }

      // Mask (raw scores; the scale is folded into the exponent below). Fully visible tiles skip this; rule-uniform
      // tiles (inside one mask cell, the sinks or the window) check only the sequence end and the causal bound.
      if (!tile_fully_visible(p, seq, row_begin, seq.seq_k, key_begin + kBlockKeys)) {
        const int32_t tile_key_end = min(key_begin + kBlockKeys, key_end);
        const bool uniform = tile_rule_uniform(p, seq, row_begin, row_end, key_begin, tile_key_end);
#pragma unroll
        for (int f = 0; f < kFrags; ++f) {
#pragma unroll
          for (int r = 0; r < 2; ++r) {
            const int32_t row = my_row(f, r);
            const int64_t horizon = int64_t(row_position(p, seq, row)) + seq.causal_offset;  // last causal key
#pragma unroll
            for (int nb = 0; nb < kKeyBlocks8; ++nb) {
#pragma unroll
              for (int e = 2 * r; e < 2 * r + 2; ++e) {
                const int32_t key = key_begin + nb * 8 + 2 * (lane % 4) + e % 2;
                const bool visible = key < seq.seq_k && (!p.causal || int64_t(key) <= horizon) &&
                                     (uniform || key_visible(p, seq, row, key));
                if (!visible) s_acc[f][nb][e] = -INFINITY;
              }
            }
          }
        }
      }

#pragma unroll
      for (int f = 0; f < kFrags; ++f) {
#pragma unroll
        for (int r = 0; r < 2; ++r) {
          float m = -INFINITY;
#pragma unroll
          for (int nb = 0; nb < kKeyBlocks8; ++nb) m = fmaxf(m, fmaxf(s_acc[f][nb][2 * r], s_acc[f][nb][2 * r + 1]));
          tile_max[f][r] = quad_max(m);
        }
      }
    }  // warp_active

    // §4 step 7: max over the tile's real rows of (m_local - m_new) < λ drops the tile (block-uniform decision).
    bool skipped = false;
    if (skip_test) {
      float gain = -INFINITY;
      if (warp_active) {
#pragma unroll
        for (int f = 0; f < kFrags; ++f) {
#pragma unroll
          for (int r = 0; r < 2; ++r) {
            const float local = tile_max[f][r] * p.scale_log2;  // scale > 0 keeps the arg max
            if (my_row(f, r) < row_end && local != -INFINITY) gain = fmaxf(gain, local - fmaxf(row_max[f][r], local));
          }
        }
        gain = fmaxf(gain, warp_shfl_xor(gain, 4));
        gain = fmaxf(gain, warp_shfl_xor(gain, 8));
        gain = fmaxf(gain, warp_shfl_xor(gain, 16));
      }
      if (lane == 0) warp_gain[warp] = gain;
      __syncthreads();  // (the next write to warp_gain follows this tile's last barrier)
      float best_gain = warp_gain[0];
#pragma unroll
      for (int w = 1; w < kWarps; ++w) best_gain = fmaxf(best_gain, warp_gain[w]);
      skipped = best_gain < skip_threshold;
      if (skipped && threadIdx.x == 0 && p.pv_skip_count != nullptr) {
        atomicAdd(reinterpret_cast<unsigned long long*>(p.pv_skip_count), 1ull);
      }
    }
    skip_test = skip_threshold > -INFINITY;  // every later computed tile is tested

    if (warp_active && !skipped) {
      // Online softmax in base 2: m = max(m, scale·log2e·max S), rescale O and l, P = 2^(S·scale·log2e - m).
#pragma unroll
      for (int f = 0; f < kFrags; ++f) {
#pragma unroll
        for (int r = 0; r < 2; ++r) {
          // scale > 0 keeps the arg max
          const softmax::MaxUpdate step =
              softmax::update_max(row_max[f][r], tile_max[f][r] * p.scale_log2, FastExp2{});
          const float rescale = step.rescale;
          row_max[f][r] = step.max;
          float tile_sum = 0.f;
#pragma unroll
          for (int nb = 0; nb < kKeyBlocks8; ++nb) {
            s_acc[f][nb][2 * r] =
                softmax::scaled_probability(s_acc[f][nb][2 * r], p.scale_log2, step.reference, FastExp2{});
            s_acc[f][nb][2 * r + 1] =
                softmax::scaled_probability(s_acc[f][nb][2 * r + 1], p.scale_log2, step.reference, FastExp2{});
            tile_sum += s_acc[f][nb][2 * r] + s_acc[f][nb][2 * r + 1];
          }
          row_sum[f][r] = softmax::rescaled_sum(row_sum[f][r], rescale, tile_sum);
#pragma unroll
          for (int nd = 0; nd < kDimBlocks8; ++nd) {
            o_acc[f][nd][2 * r] *= rescale;
            o_acc[f][nd][2 * r + 1] *= rescale;
          }
        }
      }
    }

    if (!kDoubleBuffered) {
      cp_async_wait<0>();  // V of this tile
      __syncthreads();     // ... visible to all; every warp is done reading K, so K may be refilled
      if (next < tile_count) {
        issue_rows(next, k_tiles, p.k, p.k_strides);
        cp_async_commit();
      }
    }

    if (warp_active && !skipped) {
      // O += P·V: the S accumulators of key blocks (2kk, 2kk+1) are exactly the A fragment of k-step kk; each V
      // fragment feeds 2·kFrags mma.
#pragma unroll
      for (int kk = 0; kk < kBlockKeys / 16; ++kk) {
        uint32_t a[kFrags][4];
#pragma unroll
        for (int f = 0; f < kFrags; ++f) {
          a[f][0] = pack_pair(Tag{}, s_acc[f][2 * kk][0], s_acc[f][2 * kk][1]);
          a[f][1] = pack_pair(Tag{}, s_acc[f][2 * kk][2], s_acc[f][2 * kk][3]);
          a[f][2] = pack_pair(Tag{}, s_acc[f][2 * kk + 1][0], s_acc[f][2 * kk + 1][1]);
          a[f][3] = pack_pair(Tag{}, s_acc[f][2 * kk + 1][2], s_acc[f][2 * kk + 1][3]);
        }
#pragma unroll
        for (int nd = 0; nd < kDimBlocks8; nd += 2) {
          uint32_t b[4];
          const int key_row = kk * 16 + lane % 8 + ((lane / 8) % 2) * 8;
          ldmatrix_x4_trans(b, shared_address(v_tile + swizzled_offset<kHeadDim>(key_row, nd + lane / 16)));
#pragma unroll
          for (int f = 0; f < kFrags; ++f) {
            mma_16816(Tag{}, o_acc[f][nd], a[f], b[0], b[1]);
            mma_16816(Tag{}, o_acc[f][nd + 1], a[f], b[2], b[3]);
          }
        }
      }
    }
    if (kDoubleBuffered) {
      __syncthreads();  // every warp is done with this buffer before it is refilled
      buffer ^= 1;
    }
    tile = next;
  }
  cp_async_wait<0>();  // no group may stay in flight past the kernel (Q-only group when no tile was visible)

  // Normalise and write: O / l (0 for a row that saw nothing), LSE = (m + log2 l)·ln 2 (-inf likewise).
  uint16_t* out_base = static_cast<uint16_t*>(p.out);
#pragma unroll
  for (int f = 0; f < kFrags; ++f) {
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const float total = quad_sum(row_sum[f][r]);
      const int32_t row = my_row(f, r);
      if (row >= row_end) continue;
      const softmax::RowOutput result = softmax::finish_row(row_max[f][r], total);
      const float inverse = result.inverse;
      const float lse = result.lse;
      if (p.num_splits > 1) {  // fp32 partial state; combine_splits_launch writes out and lse
        const int64_t state = softmax::partial_state_index(p, seq, split, row);
        float* partial = p.partial_out + state * kHeadDim;
#pragma unroll
        for (int nd = 0; nd < kDimBlocks8; ++nd) {
          *reinterpret_cast<float2*>(partial + nd * 8 + 2 * (lane % 4)) =
              make_float2(o_acc[f][nd][2 * r] * inverse, o_acc[f][nd][2 * r + 1] * inverse);
        }
        if (lane % 4 == 0) p.partial_lse[state] = lse;
        continue;
      }
      uint16_t* out_row = out_base + launch_output_offset(p, seq, row);
#pragma unroll
      for (int nd = 0; nd < kDimBlocks8; ++nd) {
        *reinterpret_cast<uint32_t*>(out_row + nd * 8 + 2 * (lane % 4)) =
            pack_pair(Tag{}, o_acc[f][nd][2 * r] * inverse, o_acc[f][nd][2 * r + 1] * inverse);
      }
      if (p.lse != nullptr && lane % 4 == 0) p.lse[launch_lse_offset(p, seq, row)] = lse;
    }
  }
#endif  // SPARSA_GPU_DEVICE_HAS_MMA_SYNC
}

template <typename Tag, int kHeadDim, typename Tiling, bool kMapped>
cudaError_t allow_shared_memory() {
  return cudaFuncSetAttribute(forward_mma_kernel<Tag, kHeadDim, Tiling, kMapped>,
                              cudaFuncAttributeMaxDynamicSharedMemorySize,
                              int(Tiling::template kSharedBytes<kHeadDim>));
}

template <typename Tag, int kHeadDim, typename Tiling, bool kMapped>
cudaError_t launch(const ForwardParams& params, int32_t max_seq_q, cudaStream_t stream) {
  ForwardParams p = params;
  // A row map writes its own output rows and the PV skip decides in block order: neither can be split (the
  // partial states' combine writes plain rows), so such a launch runs whole whatever was planned.
  if (kMapped) p.num_splits = 1;
  const int32_t query_tiles = (max_seq_q + Tiling::kRows - 1) / Tiling::kRows;
  const dim3 grid(query_tiles * p.num_splits, p.num_q_heads, p.batch);
  forward_mma_kernel<Tag, kHeadDim, Tiling, kMapped>
      <<<grid, kThreads, Tiling::template kSharedBytes<kHeadDim>, stream>>>(p);
  cudaError_t status = cudaGetLastError();
  if (status != cudaSuccess || p.num_splits == 1) return status;
  return combine_splits_launch(p, stream);  // the merge split-KV kernels share (split_combine.h)
}

template <typename Tag, int kHeadDim>
cudaError_t launch_for(const ForwardParams& p, int32_t max_seq_q, cudaStream_t stream) {
  if (p.pv_skip_log2 != nullptr) {  // the tile is exactly the mask's cell (supports() admits no other)
    return p.mask_block_q == SkipTiling128::kRows ? launch<Tag, kHeadDim, SkipTiling128, true>(p, max_seq_q, stream)
                                                  : launch<Tag, kHeadDim, SkipTiling64, true>(p, max_seq_q, stream);
  }
  if (p.row_map != QueryRowMap::kAll) return launch<Tag, kHeadDim, PlainTiling, true>(p, max_seq_q, stream);
  return launch<Tag, kHeadDim, PlainTiling, false>(p, max_seq_q, stream);
}

template <typename Tag, int kHeadDim>
cudaError_t allow_shared_memory_all() {
  for (cudaError_t status : {allow_shared_memory<Tag, kHeadDim, PlainTiling, false>(),
                             allow_shared_memory<Tag, kHeadDim, PlainTiling, true>(),
                             allow_shared_memory<Tag, kHeadDim, SkipTiling64, true>(),
                             allow_shared_memory<Tag, kHeadDim, SkipTiling128, true>()}) {
    if (status != cudaSuccess) return status;
  }
  return cudaSuccess;
}

}  // namespace
#endif  // SPARSA_GPU_HAS_MMA_SYNC

bool forward_mma_supports(const ForwardParams& p, const char** reason) {
#if SPARSA_GPU_HAS_MMA_SYNC
  if (p.element_type == ElementType::kF32) {
    *reason = "tensor-core path takes fp16/bf16 only";
    return false;
  }
  if (p.head_dim != 64 && p.head_dim != 128) {
    *reason = "tensor-core path has head_dim 64 and 128 only";
    return false;
  }
  if (p.row_map != QueryRowMap::kAll && (p.rule != VisibilityRule::kDense || p.pv_skip_log2 != nullptr)) {
    *reason = "query-row maps run with the dense rule only";
    return false;
  }
  if (p.row_map == QueryRowMap::kDeltaRows && p.delta_gamma <= 0) {
    *reason = "delta rows need gamma > 0";
    return false;
  }
  if (p.pv_skip_log2 != nullptr &&
      (p.rule != VisibilityRule::kBlockMask || p.mask_block_k != kSkipBlockKeys ||
       (p.mask_block_q != SkipTiling64::kRows && p.mask_block_q != SkipTiling128::kRows))) {
    *reason = "tensor-core PV skip needs the block-mask rule with block_q 64 or 128 and block_k 64";
    return false;
  }
  return true;
#else
  (void)p;
  *reason = "tensor-core path (mma.sync) exists on NVIDIA only";
  return false;
#endif
}

cudaError_t forward_mma_prepare() {
#if SPARSA_GPU_HAS_MMA_SYNC
  for (cudaError_t status : {allow_shared_memory_all<HalfTag, 64>(), allow_shared_memory_all<HalfTag, 128>(),
                             allow_shared_memory_all<BFloat16Tag, 64>(), allow_shared_memory_all<BFloat16Tag, 128>()}) {
    if (status != cudaSuccess) return status;
  }
#endif
  return cudaSuccess;
}

cudaError_t forward_mma_launch(const ForwardParams& p, int32_t max_seq_q, cudaStream_t stream) {
#if SPARSA_GPU_HAS_MMA_SYNC
  const bool bf16 = p.element_type == ElementType::kBF16;
  if (p.head_dim == 64) {
    return bf16 ? launch_for<BFloat16Tag, 64>(p, max_seq_q, stream) : launch_for<HalfTag, 64>(p, max_seq_q, stream);
  }
  return bf16 ? launch_for<BFloat16Tag, 128>(p, max_seq_q, stream) : launch_for<HalfTag, 128>(p, max_seq_q, stream);
#else
  (void)p;
  (void)max_seq_q;
  (void)stream;
  return cudaErrorInvalidValue;
#endif
}

SPARSA_GPU_NAMESPACE_END
