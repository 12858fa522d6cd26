// One 64-key tile of the Sage attention walk as a thread sees it (forward_sage.cu's mma.sync kernel and
// forward_sage_wgmma.cu's Hopper kernel): both hold S and O in the same fragment layout (thread (g, t) = (lane / 4,
// lane % 4) of a warp owns rows g and g + 8 of the warp's 16, columns 8n + 2t and 8n + 2t + 1 of every 8-column
// block n), so the arithmetic between the products is written once here: the scores' scales and mask, §4 step 7's
// gain, the online softmax, P packed as e4m3 and the epilogue. The kernels differ only in how Q, K and V reach the
// tensor cores. NVIDIA only: include it inside `#if SPARSA_GPU_HAS_MMA_SYNC`.
#pragma once

#include <cmath>
#include <cstdint>

#include "../engine/forward_common.cuh"
#include "../engine/online_softmax.cuh"
#include "forward_sage.h"
#include "mma_primitives.cuh"

// FP8 conversions and mma exist from sm_89 on; the host pass parses the same code.
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 890
#define SPARSA_SAGE_FP8_DEVICE 0
#else
#define SPARSA_SAGE_FP8_DEVICE 1
#endif

SPARSA_GPU_NAMESPACE_BEGIN
namespace sage {

constexpr int kTileKeys = kSageTileKeys;
constexpr int kKeyBlocks = kTileKeys / 8;          // 8-column blocks of an S tile
constexpr float kFp8Max = 448.f;                   // largest finite e4m3: V per channel and P are scaled onto ±448
constexpr float kLog2Fp8Max = 8.807354922057604f;  // log2(448): P·448 = 2^(S − m + log2 448)
constexpr int kFp8StepKeys = 32;                   // keys per 8-bit k-step (the unit of the V^T key permutation)

// Two floats → e4m3 pair (round to nearest even, saturating to ±448): `low` in bits 0-7, `high` in bits 8-15.
__device__ __forceinline__ uint32_t e4m3_pair(float low, float high) {
#if SPARSA_SAGE_FP8_DEVICE
  uint16_t pair;
  asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;\n" : "=h"(pair) : "f"(high), "f"(low));
  return pair;
#else
  (void)low;
  (void)high;
  __trap();
  return 0;
#endif
}
__device__ __forceinline__ uint32_t pack_e4m3x4(float x0, float x1, float x2, float x3) {
  return e4m3_pair(x0, x1) | (e4m3_pair(x2, x3) << 16);
}

// The scale of one V channel from its max |V| (as float bits); an all-zero channel keeps scale 1.
__device__ __forceinline__ float fp8_channel_scale(uint32_t abs_max_bits) {
  const float abs_max = __uint_as_float(abs_max_bits);
  return abs_max > 0.f ? abs_max / kFp8Max : 1.f;
}

// This thread's two query rows (−: past the block's last row they are never stored) and their Q scales.
struct FragmentRows {
  int32_t row[2];
  float q_scale[2];
};
__device__ __forceinline__ FragmentRows fragment_rows(const SageParams& s, int64_t q_row0, int32_t warp_first_row,
                                                      int32_t row_end, int lane) {
  FragmentRows rows;
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    rows.row[r] = warp_first_row + lane / 4 + 8 * r;
    rows.q_scale[r] = rows.row[r] < row_end ? s.q_scale[q_row0 + rows.row[r]] : 0.f;
  }
  return rows;
}

// What every tile of a thread block shares: its rows, where its keys end, its head's λ (§4 step 7, −inf: off), and
// whether its rows lie in one mask cell row (then a tile inside one cell column needs no per-element mask lookup).
// Worked out once per block: the integer divisions by the cell sizes stay out of the tile loop.
struct BlockRows {
  int32_t row_begin, row_end, key_end;
  int32_t tile_count;      // key tiles up to key_end
  float skip_threshold;    // λ of the block's head in the base-2 domain
  bool rows_in_one_cell;   // every row of the block in one block_q cell row (the mask rule)
  bool tiles_in_one_cell;  // block_k a multiple of the tile: every tile lies in one cell column, under one key scale
};
__device__ __forceinline__ BlockRows block_rows(const ForwardParams& p, const SequenceView& seq, int32_t row_begin,
                                                int32_t rows) {
  BlockRows block;
  block.row_begin = row_begin;
  block.row_end = min(row_begin + rows, seq.seq_q);
  block.key_end = key_end_for_rows(p, seq, block.row_end);
  block.tile_count = (block.key_end + kTileKeys - 1) / kTileKeys;
  block.skip_threshold = p.pv_skip_log2 != nullptr ? p.pv_skip_log2[seq.h] : -INFINITY;
  block.rows_in_one_cell =
      p.rule == VisibilityRule::kBlockMask && row_begin / p.mask_block_q == (block.row_end - 1) / p.mask_block_q;
  block.tiles_in_one_cell = p.mask_block_k % kTileKeys == 0;
  return block;
}

// S = Q_i8·K_i8ᵀ · (s_q · s_k · scale · log2 e), the base-2 domain, −inf where the key is not visible to the row,
// held as s_acc · factor: on a tile every row sees whole under one key scale, s_acc keeps the exact integer sums and
// `factor` the row's positive multiplier, applied inside the softmax's exponent (one fused multiply-add); elsewhere
// s_acc is S itself and factor 1. Returns each row's tile maximum of S (quad-reduced). `key_scale` holds the tile's
// per-key scales (0 past the sequence end).
__device__ __forceinline__ void scale_and_mask(float (&s_acc)[kKeyBlocks][4], float (&factor)[2],
                                               const int32_t (&dots)[kKeyBlocks][4], const SageParams& s,
                                               const SequenceView& seq, const BlockRows& block, int32_t warp_first_row,
                                               int32_t key_begin, const float* key_scale, const FragmentRows& rows,
                                               int lane, float (&tile_max)[2]) {
  const ForwardParams& p = s.fwd;
  const int32_t tile_key_end = min(key_begin + kTileKeys, block.key_end);
  const bool uniform = block.rows_in_one_cell &&
                       (block.tiles_in_one_cell || key_begin / p.mask_block_k == (tile_key_end - 1) / p.mask_block_k);
  // Interior tile: the rule admits the whole tile, every key exists and lies inside the causal horizon of the
  // warp's first row; then no element needs a visibility test (warp-uniform).
  const bool interior =
      uniform && key_begin + kTileKeys <= seq.seq_k &&
      (!p.causal || int64_t(key_begin + kTileKeys - 1) <= int64_t(warp_first_row) + seq.causal_offset);
  const float row_factor[2] = {rows.q_scale[0] * s.scale * kLog2e, rows.q_scale[1] * s.scale * kLog2e};
  if (interior && block.tiles_in_one_cell) {  // one key scale for the tile: one factor per row
#pragma unroll
    for (int r = 0; r < 2; ++r) factor[r] = row_factor[r] * key_scale[0];
#pragma unroll
    for (int nb = 0; nb < kKeyBlocks; ++nb) {
#pragma unroll
      for (int e = 0; e < 4; ++e) s_acc[nb][e] = float(dots[nb][e]);
    }
  } else {
    factor[0] = factor[1] = 1.f;
#pragma unroll
    for (int nb = 0; nb < kKeyBlocks; ++nb) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int32_t row = rows.row[e / 2];
        const int col = nb * 8 + 2 * (lane % 4) + e % 2;
        const int32_t key = key_begin + col;
        // (A row past the block's last is never stored; the test keeps its mask lookup inside the mask.)
        const bool visible = interior || (row < block.row_end && key < seq.seq_k &&
                                          (!p.causal || int64_t(key) <= int64_t(row) + seq.causal_offset) &&
                                          (uniform || key_visible(p, seq, row, key)));
        s_acc[nb][e] = visible ? float(dots[nb][e]) * (row_factor[e / 2] * key_scale[col]) : -INFINITY;
      }
    }
  }
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    float m = -INFINITY;
#pragma unroll
    for (int nb = 0; nb < kKeyBlocks; ++nb) m = fmaxf(m, fmaxf(s_acc[nb][2 * r], s_acc[nb][2 * r + 1]));
    tile_max[r] = mma::quad_max(m) * factor[r];  // factor > 0 keeps the order (0 only on rows never stored)
  }
}

// §4 step 7: this warp's max over its real rows of (m_local − m_new); the caller takes the max over the warps of a
// query block and drops the tile's P·V when it is below λ.
__device__ __forceinline__ float pv_skip_gain(const float (&tile_max)[2], const float (&row_max)[2],
                                              const FragmentRows& rows, int32_t row_end) {
  float gain = -INFINITY;
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    if (rows.row[r] < row_end && tile_max[r] != -INFINITY)
      gain = fmaxf(gain, tile_max[r] - fmaxf(row_max[r], tile_max[r]));
  }
  for (int offset = 4; offset < 32; offset <<= 1) gain = fmaxf(gain, warp_shfl_xor(gain, offset));
  return gain;
}

// Online softmax: m = max(m, tile max), l rescaled, s_acc replaced by P = 2^(S − m) with S = s_acc · factor (FP8:
// P·448 = 2^(S − m + log2 448), and l sums the same scaled P, so O / l needs no unscaling). The kParts tiles of s_acc
// (kBlocks / kParts blocks each) carry their own factors. `rescale` is what O must be multiplied by before these keys'
// P·V joins it (0 while the row had seen nothing).
template <bool kFp8, int kBlocks, int kParts>
__device__ __forceinline__ void softmax_tile(float (&s_acc)[kBlocks][4], const float (&factor)[kParts][2],
                                             const float (&tile_max)[2], float (&row_max)[2], float (&row_sum)[2],
                                             float (&rescale)[2]) {
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const softmax::MaxUpdate step = softmax::update_max(row_max[r], tile_max[r], mma::FastExp2{});
    rescale[r] = step.rescale;
    const float p_reference = kFp8 ? step.reference - kLog2Fp8Max : step.reference;
    row_max[r] = step.max;
    float tile_sum = 0.f;
#pragma unroll
    for (int nb = 0; nb < kBlocks; ++nb) {
      const float f = factor[nb / (kBlocks / kParts)][r];
      s_acc[nb][2 * r] = mma::fast_exp2(fmaf(s_acc[nb][2 * r], f, -p_reference));
      s_acc[nb][2 * r + 1] = mma::fast_exp2(fmaf(s_acc[nb][2 * r + 1], f, -p_reference));
      tile_sum += s_acc[nb][2 * r] + s_acc[nb][2 * r + 1];
    }
    row_sum[r] = softmax::rescaled_sum(row_sum[r], step.rescale, tile_sum);
  }
}

// O of this thread's two rows multiplied by their rescale factors.
template <int kDimBlocks>
__device__ __forceinline__ void rescale_rows(float (&o_acc)[kDimBlocks][4], const float (&rescale)[2]) {
#pragma unroll
  for (int nd = 0; nd < kDimBlocks; ++nd) {
#pragma unroll
    for (int e = 0; e < 4; ++e) o_acc[nd][e] *= rescale[e / 2];
  }
}

// P·448 as the A fragments of the 32-key e4m3 steps: step kk takes S blocks 4kk..4kk+3 in the permuted key order
// the V^T copy shares (forward_sage.cu's layout note). Registers: (row g, keys 0-15), (g+8, 0-15), (g, 16-31),
// (g+8, 16-31) of the step, in that permuted order.
template <int kBlocks>
__device__ __forceinline__ void pack_p_e4m3(uint32_t (&a)[kBlocks * 8 / kFp8StepKeys][4],
                                            const float (&s_acc)[kBlocks][4]) {
#pragma unroll
  for (int kk = 0; kk < kBlocks * 8 / kFp8StepKeys; ++kk) {
#pragma unroll
    for (int r = 0; r < 4; ++r) {
      const int nb = 4 * kk + 2 * (r / 2), e = 2 * (r % 2);
      a[kk][r] = pack_e4m3x4(s_acc[nb][e], s_acc[nb][e + 1], s_acc[nb + 1][e], s_acc[nb + 1][e + 1]);
    }
  }
}

// Normalise and write: O / l (0 for a row that saw nothing), and for FP8 × scale_c; LSE = (m + log2 l)·ln 2 +
// scale·q·mean(K) (FP8: l carries the factor 448, taken out of the log).
template <bool kFp8, int kHeadDim>
__device__ __forceinline__ void store_rows(const SageParams& s, const SequenceView& seq,
                                           const float (&o_acc)[kHeadDim / 8][4], const float (&row_max)[2],
                                           const float (&row_sum)[2], const FragmentRows& rows, int32_t row_end,
                                           int64_t q_row0, int64_t kv_head_index, int lane) {
  const ForwardParams& p = s.fwd;
  constexpr int kDimBlocks = kHeadDim / 8;
  float channel_scale[kDimBlocks][2];
#pragma unroll
  for (int nd = 0; nd < kDimBlocks; ++nd) {
#pragma unroll
    for (int e = 0; e < 2; ++e) {
      channel_scale[nd][e] = 1.f;
      if constexpr (kFp8) {
        const int col = nd * 8 + 2 * (lane % 4) + e;
        channel_scale[nd][e] = fp8_channel_scale(s.v_abs_max[kv_head_index * kHeadDim + col]);
      }
    }
  }
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const float total = mma::quad_sum(row_sum[r]);
    const int32_t row = rows.row[r];
    if (row >= row_end) continue;
    const float inverse = softmax::finish_row(row_max[r], total).inverse;
    const int64_t out_row = query_row_offset(p.out_strides, seq, row);
#pragma unroll
    for (int nd = 0; nd < kDimBlocks; ++nd) {
      const int col = nd * 8 + 2 * (lane % 4);
      store_value(p.out, out_row + col, p.element_type, o_acc[nd][2 * r] * (inverse * channel_scale[nd][0]));
      store_value(p.out, out_row + col + 1, p.element_type, o_acc[nd][2 * r + 1] * (inverse * channel_scale[nd][1]));
    }
    // Not softmax::finish_row's LSE: the FP8 scale of P and the row's smoothing shift enter inside its empty-row
    // branch.
    if (p.lse != nullptr && lane % 4 == 0) {
      p.lse[seq.b * p.lse_strides.b + int64_t(seq.h) * p.lse_strides.h + (seq.q_row_base + row) * p.lse_strides.s] =
          total > 0.f ? (row_max[r] + log2f(total) - (kFp8 ? kLog2Fp8Max : 0.f)) * kLn2 + s.q_shift[q_row0 + row]
                      : -INFINITY;
    }
  }
}

}  // namespace sage
SPARSA_GPU_NAMESPACE_END
