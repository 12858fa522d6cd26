// SPARGE's quantized (Sage) forward, NVIDIA sm_80+ (forward_sage.h); on sm_90a with FP8 P·V and head dim 128 the
// attention launch is forward_sage_wgmma.cu's instead (sage_plan picks). Reads top to bottom:
//   pre-passes   Q → int8 per block_q block (+ each row's scale and LSE shift), centred K → int8 per block_k block,
//                V → e4m3 transposed with per-channel scales (FP8 P·V), or V → fp16 when it cannot be read in
//                place;
//   attention    one thread block = 16·kWarps query rows of one (sequence, query head); it walks the key tiles of
//                64 keys that the predicted mask lets its rows see, in ascending order:
//                  cp.async  K (int8) and V tiles -> shared, K first (S starts while V is in flight)
//                  S  = Q_i8·K_i8ᵀ          mma.sync m16n8k32 s8 → s32 (exact), Q fragments kept in registers
//                  S  = S·s_q·s_k·scale      the CPU emulation's float product, then masked
//                  λ test (§4.7)            when the λ table is set: a tile is one mask cell (checked by supports)
//                  online softmax            base-2 exponentials, fp32
//                  O += P·V                  fp16/bf16: mma.sync m16n8k16, P re-packed from S, V by ldmatrix.trans
//                                            fp8: mma.sync m16n8k32 e4m3, P·448 packed from S, V^T by 32-bit loads
// Shared-memory rows are padded by 16 bytes so that the 8 rows a fragment load touches fall in distinct banks.
//
// FP8 operand layout. The A fragment of an m16n8k32 8-bit mma gives thread (g, t) = (lane / 4, lane % 4) the 4
// consecutive k positions 4t..4t+3 (and 16 + 4t..), but the S accumulators it holds are keys 2t, 2t+1, 8+2t, 9+2t
// (and 16 + those). A sum over keys does not care about their order, so V^T is stored with the keys of every
// 32-key step permuted to match: k position 4t+i holds key 2t+i (i < 2) or 8+2t+i-2 (i >= 2). Then P packs from
// registers with no shuffle and each B fragment is one aligned 32-bit shared load. (ldmatrix cannot transpose
// 8-bit elements before sm_100, hence the transposed copy.)
// The HIP build compiles this file to "unsupported" (no int8 mma.sync); the FP8 instructions exist in the sm_89+
// device passes only (the sm_80 pass compiles the FP8 kernels to a trap that is never launched).
#include "forward_sage.h"

#include "../engine/forward_common.cuh"
#include "../engine/online_softmax.cuh"

#if SPARSA_GPU_HAS_MMA_SYNC
#include "mma_primitives.cuh"
#include "sage_tile.cuh"
#endif

#include <cmath>
#include <type_traits>

SPARSA_GPU_NAMESPACE_BEGIN


#if SPARSA_GPU_HAS_MMA_SYNC
namespace {

using namespace mma;   // the shared PTX wrappers (mma_primitives.cuh)
using namespace sage;  // the per-thread tile arithmetic both Sage kernels share (sage_tile.cuh)

constexpr float kInt8Max = 127.f;       // §4 quantized path: symmetric int8
constexpr float kQuantEpsilon = 1e-7f;  // scale = max|x| / 127 + 1e-7
constexpr int kPrepThreads = 128;
constexpr int kPrepWarps = kPrepThreads / 32;
constexpr int kRowPadBytes = 16;  // shared-memory row padding (bank spread, keeps 16-byte alignment)
constexpr int kChunkBytes = 16;   // cp.async granule
constexpr int kConvertRows = 64;  // V rows per thread block of the conversion pre-pass
constexpr int kChannelMaxRows = 256;  // V rows per thread block of the channel-max pre-pass
constexpr int kMaxHeadDim = 128;
constexpr int kFp8TilePitch = kTileKeys + 4;  // bytes per channel row of the transposing pre-pass's shared tile

// Element tag of the FP8 P·V instances (HalfTag / BFloat16Tag are the 16-bit ones).
struct E4m3Tag {};

// ---- Quantization (the CPU emulation's arithmetic: float scale, IEEE division, round half to even) ----

__device__ __forceinline__ float quant_scale(float max_abs) { return max_abs / kInt8Max + kQuantEpsilon; }
__device__ __forceinline__ int8_t quantize(float x, float scale) {
  const float q = rintf(x / scale);
  return int8_t(fminf(kInt8Max, fmaxf(-kInt8Max, q)));
}

__device__ __forceinline__ float block_max(float value, float* partials) {
  for (int offset = 16; offset > 0; offset >>= 1) value = fmaxf(value, warp_shfl_xor(value, offset));
  if (threadIdx.x % 32 == 0) partials[threadIdx.x / 32] = value;
  __syncthreads();
  float result = partials[0];
  for (int w = 1; w < kPrepWarps; ++w) result = fmaxf(result, partials[w]);
  __syncthreads();
  return result;
}

// One block_q block of query head h: int8 rows, each row's scale, and scale·q·mean(K) (the LSE shift, summed in
// float64 like the CPU). grid = (query blocks, Hq, B).
__global__ void __launch_bounds__(kPrepThreads) quantize_queries_kernel(const SageParams s) {
  __shared__ float partials[kPrepWarps];
  const ForwardParams& p = s.fwd;
  const SequenceView seq = make_sequence_view(p, blockIdx.z, blockIdx.y);
  const int64_t first = int64_t(blockIdx.x) * p.mask_block_q;
  if (first >= seq.seq_q) return;
  const int32_t rows = int32_t(min(int64_t(p.mask_block_q), seq.seq_q - first));
  const int32_t dim = p.head_dim;
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;  // a warp per row, a lane per 32nd channel
  float max_abs = 0.f;
  for (int32_t r = warp; r < rows; r += kPrepWarps) {
    const int64_t offset = query_row_offset(p.q_strides, seq, first + r);
    for (int32_t d = lane; d < dim; d += 32) {
      max_abs = fmaxf(max_abs, fabsf(load_value(p.q, offset + d, p.element_type)));
    }
  }
  const float scale = quant_scale(block_max(max_abs, partials));
  const int64_t head_row0 = (int64_t(seq.b) * p.num_q_heads + seq.h) * s.max_seq_q;
  const double* mean = s.key_mean + (int64_t(seq.b) * s.num_kv_heads + seq.kv_head) * dim;
  for (int32_t r = warp; r < rows; r += kPrepWarps) {
    const int64_t offset = query_row_offset(p.q_strides, seq, first + r);
    int8_t* q_row = s.q_i8 + (head_row0 + first + r) * dim;
    double dot = 0.0;
    for (int32_t d = lane; d < dim; d += 32) {
      const float x = load_value(p.q, offset + d, p.element_type);
      q_row[d] = quantize(x, scale);
      dot += double(x) * double(float(mean[d]));
    }
    for (int o = 16; o > 0; o >>= 1) dot += warp_shfl_xor(dot, o);
    if (lane == 0) {
      s.q_scale[head_row0 + first + r] = scale;
      s.q_shift[head_row0 + first + r] = float(dot) * s.scale;
    }
  }
}

// One block_k block of kv head hk: K − mean (fp32, the mean rounded to fp32 like the CPU's) to int8 with the
// block's scale. grid = (key blocks, Hkv, B).
__global__ void __launch_bounds__(kPrepThreads) quantize_keys_kernel(const SageParams s) {
  __shared__ float partials[kPrepWarps];
  const ForwardParams& p = s.fwd;
  const int32_t hk = blockIdx.y;
  const SequenceView seq = make_sequence_view(p, blockIdx.z, hk * p.group_size);
  const int64_t first = int64_t(blockIdx.x) * p.mask_block_k;
  if (first >= seq.seq_k) return;
  const int32_t rows = int32_t(min(int64_t(p.mask_block_k), seq.seq_k - first));
  const int32_t dim = p.head_dim;
  const double* mean = s.key_mean + (int64_t(seq.b) * s.num_kv_heads + hk) * dim;
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;  // a warp per row, a lane per 32nd channel
  float max_abs = 0.f;
  for (int32_t r = warp; r < rows; r += kPrepWarps) {
    const int64_t offset = key_row_offset(p, p.k_strides, seq, first + r);
    for (int32_t d = lane; d < dim; d += 32) {
      max_abs = fmaxf(max_abs, fabsf(load_value(p.k, offset + d, p.element_type) - float(mean[d])));
    }
  }
  const float scale = quant_scale(block_max(max_abs, partials));
  const int64_t head_row0 = (int64_t(seq.b) * s.num_kv_heads + hk) * s.max_seq_k;
  for (int32_t r = warp; r < rows; r += kPrepWarps) {
    const int64_t offset = key_row_offset(p, p.k_strides, seq, first + r);
    int8_t* k_row = s.k_i8 + (head_row0 + first + r) * dim;
    for (int32_t d = lane; d < dim; d += 32) {
      k_row[d] = quantize(load_value(p.k, offset + d, p.element_type) - float(mean[d]), scale);
    }
  }
  if (threadIdx.x == 0) s.k_scale[(int64_t(seq.b) * s.num_kv_heads + hk) * s.k_blocks + blockIdx.x] = scale;
}

// V rows → fp16 [B, Hkv, max_seq_k, D] (fp32 inputs, or 16-bit rows cp.async cannot read in place).
__global__ void __launch_bounds__(kPrepThreads) convert_values_kernel(const SageParams s) {
  const ForwardParams& p = s.fwd;
  const int32_t hk = blockIdx.y;
  const SequenceView seq = make_sequence_view(p, blockIdx.z, hk * p.group_size);
  const int64_t first = int64_t(blockIdx.x) * kConvertRows;
  if (first >= seq.seq_k) return;
  const int32_t rows = int32_t(min(int64_t(kConvertRows), seq.seq_k - first));
  const int32_t dim = p.head_dim;
  const int64_t head_row0 = (int64_t(seq.b) * s.num_kv_heads + hk) * s.max_seq_k;
  for (int32_t e = threadIdx.x; e < rows * dim; e += blockDim.x) {
    const int32_t r = e / dim, d = e % dim;
    const float x = load_value(p.v, key_row_offset(p, p.v_strides, seq, first + r) + d, p.element_type);
    s.v_f16[(head_row0 + first + r) * dim + d] = float_to_f16_bits(x);
  }
}

// ---- FP8 (e4m3) helpers ----

// D(16x8, f32) += A(16x32, e4m3) · B(32x8, e4m3).
__device__ __forceinline__ void mma_e4m3(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
#if SPARSA_SAGE_FP8_DEVICE
  asm volatile(
      "mma.sync.aligned.m16n8k32.row.col.f32.e4m3.e4m3.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
      "{%0,%1,%2,%3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
#else
  (void)d;
  (void)a;
  (void)b0;
  (void)b1;
  __trap();
#endif
}

// Where key `key` of a tile sits in its V^T row: inside each 32-key step, key 2t+i (i < 2) and 8+2t+i (i < 2) go to
// positions 4t+i and 4t+2+i, for t < 4 and again 16 keys later (the layout note at the top of the file).
__device__ __forceinline__ int fp8_key_position(int key) {
  const int in_step = key % kFp8StepKeys;
  const int half = in_step / 16, q = in_step % 16;
  return key - in_step + half * 16 + 4 * ((q % 8) / 2) + (q % 2) + (q >= 8 ? 2 : 0);
}

// Max |V| per channel of each (sequence, kv head), as float bits by atomicMax (|x| orders like its bits; the
// buffer is zeroed first). grid = (ceil(max Skv / kChannelMaxRows), Hkv, B); blockDim.x is a multiple of D.
__global__ void __launch_bounds__(kPrepThreads) value_channel_max_kernel(const SageParams s) {
  __shared__ float partials[kPrepThreads];
  const ForwardParams& p = s.fwd;
  const int32_t hk = blockIdx.y;
  const SequenceView seq = make_sequence_view(p, blockIdx.z, hk * p.group_size);
  const int64_t first = int64_t(blockIdx.x) * kChannelMaxRows;
  if (first >= seq.seq_k) return;
  const int32_t rows = int32_t(min(int64_t(kChannelMaxRows), seq.seq_k - first));
  const int32_t dim = p.head_dim;
  const int32_t channel = threadIdx.x % dim, row_step = kPrepThreads / dim;
  float max_abs = 0.f;
  for (int32_t r = threadIdx.x / dim; r < rows; r += row_step) {
    max_abs = fmaxf(max_abs, fabsf(load_value(p.v, key_row_offset(p, p.v_strides, seq, first + r) + channel,
                                              p.element_type)));
  }
  partials[threadIdx.x] = max_abs;
  __syncthreads();
  if (threadIdx.x < dim) {
    for (int32_t t = threadIdx.x + dim; t < kPrepThreads; t += dim) max_abs = fmaxf(max_abs, partials[t]);
    atomicMax(s.v_abs_max + (int64_t(seq.b) * s.num_kv_heads + hk) * dim + channel, __float_as_uint(max_abs));
  }
}

// One tile of kTileKeys keys of kv head hk → e4m3 V^T rows [D][fp8_keys] (key order permuted, keys past the
// sequence end written as 0). Transposed through shared memory so both the V reads and the V^T writes are
// coalesced. grid = (fp8_keys / kTileKeys, Hkv, B).
__global__ void __launch_bounds__(kPrepThreads) quantize_values_fp8_kernel(const SageParams s) {
  __shared__ __align__(16) uint8_t tile[kMaxHeadDim * kFp8TilePitch];
  __shared__ float channel_scale[kMaxHeadDim];
  const ForwardParams& p = s.fwd;
  const int32_t hk = blockIdx.y;
  const SequenceView seq = make_sequence_view(p, blockIdx.z, hk * p.group_size);
  const int64_t first = int64_t(blockIdx.x) * kTileKeys;
  if (first >= seq.seq_k) return;  // the attention walk never reads a tile past the sequence end
  const int32_t dim = p.head_dim;
  const int64_t head = int64_t(seq.b) * s.num_kv_heads + hk;
  for (int32_t c = threadIdx.x; c < dim; c += blockDim.x) {
    channel_scale[c] = fp8_channel_scale(s.v_abs_max[head * dim + c]);
  }
  __syncthreads();
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;  // a warp per key, a lane per 32nd channel
  for (int32_t r = warp; r < kTileKeys; r += kPrepWarps) {
    const bool valid = first + r < seq.seq_k;
    const int64_t offset = valid ? key_row_offset(p, p.v_strides, seq, first + r) : 0;
    for (int32_t c = lane; c < dim; c += 32) {
      const float x = valid ? load_value(p.v, offset + c, p.element_type) : 0.f;
      tile[c * kFp8TilePitch + fp8_key_position(r)] = uint8_t(e4m3_pair(x / channel_scale[c], 0.f) & 0xffu);
    }
  }
  __syncthreads();
  constexpr int kWordsPerRow = kTileKeys / 4;
  uint8_t* rows = s.v_fp8 + head * dim * s.fp8_keys + first;
  for (int32_t e = threadIdx.x; e < dim * kWordsPerRow; e += blockDim.x) {
    const int32_t c = e / kWordsPerRow, w = e % kWordsPerRow;
    *reinterpret_cast<uint32_t*>(rows + int64_t(c) * s.fp8_keys + 4 * w) =
        *reinterpret_cast<const uint32_t*>(tile + c * kFp8TilePitch + 4 * w);
  }
}

// D(16x8, s32) += A(16x32, s8) · B(32x8, s8): exact integer sums.
__device__ __forceinline__ void mma_s8(int32_t (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k32.row.col.s32.s8.s8.s32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
      : "+r"(d[0]), "+r"(d[1]), "+r"(d[2]), "+r"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// ---- The attention walk ----

template <typename Tag, int kHeadDim, int kWarps>
__global__ void __launch_bounds__(kWarps * 32) sage_attention_kernel(const SageParams s) {
  constexpr int kThreads = kWarps * 32;
  constexpr int kRows = 16 * kWarps;                 // query rows per thread block
  constexpr int kI8Pitch = kHeadDim + kRowPadBytes;  // bytes per int8 row in shared memory
  constexpr int kVPitch = kHeadDim + kRowPadBytes / 2;  // 16-bit elements per V row
    constexpr int kDimBlocks8 = kHeadDim / 8;          // n-blocks of the O tile
  constexpr int kSteps32 = kHeadDim / 32;            // k-steps of the int8 mma
  constexpr int kI8Chunks = kHeadDim / kChunkBytes;  // cp.async chunks per int8 row
  constexpr int kVChunks = kHeadDim * 2 / kChunkBytes;
  constexpr bool kFp8 = std::is_same<Tag, E4m3Tag>::value;
  constexpr int kFp8Pitch = kTileKeys + kRowPadBytes;  // bytes per V^T channel row (FP8)
  constexpr int kFp8Chunks = kTileKeys / kChunkBytes;  // cp.async chunks per V^T channel row
  constexpr int kVTileBytes = kFp8 ? kHeadDim * kFp8Pitch : kTileKeys * kVPitch * 2;
  __shared__ __align__(16) int8_t q_tile[kRows * kI8Pitch];
  __shared__ __align__(16) int8_t k_tile[kTileKeys * kI8Pitch];
  __shared__ __align__(16) uint8_t v_bytes[kVTileBytes];
  uint16_t* const v_tile = reinterpret_cast<uint16_t*>(v_bytes);
  __shared__ float key_scale[kTileKeys];
  __shared__ float warp_gain[kWarps];

  const ForwardParams& p = s.fwd;
  const SequenceView seq = make_sequence_view(p, blockIdx.z, blockIdx.y);
  const int32_t row_begin = blockIdx.x * kRows;
  if (row_begin >= seq.seq_q) return;
  const BlockRows block = block_rows(p, seq, row_begin, kRows);
  const int32_t row_end = block.row_end, key_end = block.key_end, tile_count = block.tile_count;
  // §4 step 7 (supports() guarantees one mask cell per tile): the first computed tile is never tested.
  const float skip_threshold = block.skip_threshold;
  bool skip_test = false;

  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int64_t q_row0 = (int64_t(seq.b) * p.num_q_heads + seq.h) * s.max_seq_q;
  const int64_t kv_head_index = int64_t(seq.b) * s.num_kv_heads + seq.kv_head;
  const int64_t kv_row0 = kv_head_index * s.max_seq_k;
  const float* key_scales = s.k_scale + (int64_t(seq.b) * s.num_kv_heads + seq.kv_head) * s.k_blocks;

  VisibleTileWalk walk;
  auto next_visible_tile = [&](int32_t tile) {
    return walk.next(tile, tile_count, [&](int32_t candidate) {
      const int32_t key_begin = candidate * kTileKeys;
      return tile_has_visible_key(p, seq, row_begin, row_end, key_begin, min(key_begin + kTileKeys, key_end));
    });
  };

  // Q (int8) -> shared -> registers (the A operand of every S mma).
  for (int index = threadIdx.x; index < kRows * kI8Chunks; index += kThreads) {
    const int r = index / kI8Chunks, c = index % kI8Chunks;
    const bool valid = row_begin + r < row_end;
    const int8_t* src = s.q_i8 + (q_row0 + (valid ? row_begin + r : 0)) * kHeadDim + c * kChunkBytes;
    cp_async_16(shared_address(q_tile + r * kI8Pitch + c * kChunkBytes), src, valid ? kChunkBytes : 0);
  }
  cp_async_commit();
  cp_async_wait<0>();
  __syncthreads();
  const int warp_row0 = warp * 16;
  uint32_t q_frag[kSteps32][4];
#pragma unroll
  for (int kk = 0; kk < kSteps32; ++kk) {
    const int8_t* base = q_tile + (warp_row0 + lane / 4) * kI8Pitch + kk * 32 + (lane % 4) * 4;
    q_frag[kk][0] = *reinterpret_cast<const uint32_t*>(base);
    q_frag[kk][1] = *reinterpret_cast<const uint32_t*>(base + 8 * kI8Pitch);
    q_frag[kk][2] = *reinterpret_cast<const uint32_t*>(base + 16);
    q_frag[kk][3] = *reinterpret_cast<const uint32_t*>(base + 8 * kI8Pitch + 16);
  }
  const FragmentRows rows = fragment_rows(s, q_row0, row_begin + warp_row0, row_end, lane);
  const bool warp_active = row_begin + warp_row0 < row_end;

  float o_acc[kDimBlocks8][4];
#pragma unroll
  for (int nd = 0; nd < kDimBlocks8; ++nd) o_acc[nd][0] = o_acc[nd][1] = o_acc[nd][2] = o_acc[nd][3] = 0.f;
  float row_max[2] = {-INFINITY, -INFINITY};  // base-2 domain
  float row_sum[2] = {0.f, 0.f};              // this thread's partial; quad-reduced at the end

  for (int32_t tile = next_visible_tile(0); tile < tile_count; tile = next_visible_tile(tile + 1)) {
    const int32_t key_begin = tile * kTileKeys;
    const int valid_keys = min(kTileKeys, seq.seq_k - key_begin);
    // K (int8, from the quantized copy) and its per-key scales, then V, as two cp.async groups.
    for (int index = threadIdx.x; index < kTileKeys * kI8Chunks; index += kThreads) {
      const int r = index / kI8Chunks, c = index % kI8Chunks;
      const bool valid = r < valid_keys;
      const int8_t* src = s.k_i8 + (kv_row0 + (valid ? key_begin + r : 0)) * kHeadDim + c * kChunkBytes;
      cp_async_16(shared_address(k_tile + r * kI8Pitch + c * kChunkBytes), src, valid ? kChunkBytes : 0);
    }
    for (int r = threadIdx.x; r < kTileKeys; r += kThreads) {
      key_scale[r] = r < valid_keys ? key_scales[(key_begin + r) / p.mask_block_k] : 0.f;
    }
    cp_async_commit();
    if constexpr (kFp8) {  // V^T rows of this tile (zero past the sequence end: written so by the pre-pass)
      const uint8_t* v_rows = s.v_fp8 + kv_head_index * kHeadDim * s.fp8_keys + key_begin;
      for (int index = threadIdx.x; index < kHeadDim * kFp8Chunks; index += kThreads) {
        const int c = index / kFp8Chunks, chunk = index % kFp8Chunks;
        cp_async_16(shared_address(v_bytes + c * kFp8Pitch + chunk * kChunkBytes),
                    v_rows + int64_t(c) * s.fp8_keys + chunk * kChunkBytes, kChunkBytes);
      }
    } else {
      for (int index = threadIdx.x; index < kTileKeys * kVChunks; index += kThreads) {
        const int r = index / kVChunks, c = index % kVChunks;
        const bool valid = r < valid_keys;
        const uint16_t* src;
        if (s.convert_v) {
          src = s.v_f16 + (kv_row0 + (valid ? key_begin + r : 0)) * kHeadDim;
        } else {
          src = static_cast<const uint16_t*>(p.v) + key_row_offset(p, p.v_strides, seq, valid ? key_begin + r : 0);
        }
        cp_async_16(shared_address(v_tile + r * kVPitch + c * (kChunkBytes / 2)), src + c * (kChunkBytes / 2),
                    valid ? kChunkBytes : 0);
      }
    }
    cp_async_commit();
    cp_async_wait<1>();  // K has landed; V may still be in flight
    __syncthreads();

    // S = Q_i8·K_i8ᵀ · s_q · s_k · scale, in the base-2 domain, masked.
    float s_acc[kKeyBlocks][4];
    float factor[1][2];
    float tile_max[2] = {-INFINITY, -INFINITY};
    if (warp_active) {
      int32_t dots[kKeyBlocks][4];
#pragma unroll
      for (int nb = 0; nb < kKeyBlocks; ++nb) dots[nb][0] = dots[nb][1] = dots[nb][2] = dots[nb][3] = 0;
#pragma unroll
      for (int kk = 0; kk < kSteps32; ++kk) {
#pragma unroll
        for (int nb = 0; nb < kKeyBlocks; ++nb) {
          const int8_t* base = k_tile + (nb * 8 + lane / 4) * kI8Pitch + kk * 32 + (lane % 4) * 4;
          mma_s8(dots[nb], q_frag[kk], *reinterpret_cast<const uint32_t*>(base),
                 *reinterpret_cast<const uint32_t*>(base + 16));
        }
      }
      scale_and_mask(s_acc, factor[0], dots, s, seq, block, row_begin + warp_row0, key_begin, key_scale, rows, lane,
                     tile_max);
    }

    // §4 step 7: max over the tile's real rows of (m_local − m_new) < λ drops the tile (block-uniform decision).
    if (skip_test) {
      const float gain = warp_active ? pv_skip_gain(tile_max, row_max, rows, row_end) : -INFINITY;
      if (lane == 0) warp_gain[warp] = gain;
      __syncthreads();
      float best_gain = warp_gain[0];
#pragma unroll
      for (int w = 1; w < kWarps; ++w) best_gain = fmaxf(best_gain, warp_gain[w]);
      if (best_gain < skip_threshold) {
        if (threadIdx.x == 0 && s.pv_skip_count != nullptr) {
          atomicAdd(reinterpret_cast<unsigned long long*>(s.pv_skip_count), 1ull);
        }
        cp_async_wait<0>();
        __syncthreads();  // V has landed and every warp is done with the tiles (and warp_gain) before a refill
        continue;
      }
    }
    skip_test = skip_threshold > -INFINITY;  // every later computed tile is tested

    if (warp_active) {
      float rescale[2];
      softmax_tile<kFp8>(s_acc, factor, tile_max, row_max, row_sum, rescale);
      rescale_rows(o_acc, rescale);
    }
    cp_async_wait<0>();
    __syncthreads();  // V has landed

    // FP8 O += P·V: per 32-key step kk, S blocks 4kk..4kk+3 (P·448) are the A fragment (in the permuted key order
    // the V^T copy shares); each tile's products sum in a fresh accumulator before they join O.
    if constexpr (kFp8) {
      if (warp_active) {
        uint32_t a[kTileKeys / kFp8StepKeys][4];
        pack_p_e4m3(a, s_acc);
#pragma unroll
        for (int nd = 0; nd < kDimBlocks8; ++nd) {
          float tile_pv[4] = {0.f, 0.f, 0.f, 0.f};
          const uint8_t* row = v_bytes + (nd * 8 + lane / 4) * kFp8Pitch + (lane % 4) * 4;
#pragma unroll
          for (int kk = 0; kk < kTileKeys / kFp8StepKeys; ++kk) {
            mma_e4m3(tile_pv, a[kk], *reinterpret_cast<const uint32_t*>(row + kk * kFp8StepKeys),
                     *reinterpret_cast<const uint32_t*>(row + kk * kFp8StepKeys + 16));
          }
#pragma unroll
          for (int e = 0; e < 4; ++e) o_acc[nd][e] += tile_pv[e];
        }
      }
    } else if (warp_active) {  // O += P·V: the S accumulators of key blocks (2kk, 2kk+1) are the A fragment of kk
#pragma unroll
      for (int kk = 0; kk < kTileKeys / 16; ++kk) {
        const uint32_t a[4] = {pack_pair(Tag{}, s_acc[2 * kk][0], s_acc[2 * kk][1]),
                               pack_pair(Tag{}, s_acc[2 * kk][2], s_acc[2 * kk][3]),
                               pack_pair(Tag{}, s_acc[2 * kk + 1][0], s_acc[2 * kk + 1][1]),
                               pack_pair(Tag{}, s_acc[2 * kk + 1][2], s_acc[2 * kk + 1][3])};
#pragma unroll
        for (int nd = 0; nd < kDimBlocks8; nd += 2) {
          uint32_t b[4];
          const int key_row = kk * 16 + lane % 8 + ((lane / 8) % 2) * 8;
          ldmatrix_x4_trans(b, shared_address(v_tile + key_row * kVPitch + (nd + lane / 16) * 8));
          mma_16816(Tag{}, o_acc[nd], a, b[0], b[1]);
          mma_16816(Tag{}, o_acc[nd + 1], a, b[2], b[3]);
        }
      }
    }
    __syncthreads();  // every warp is done with the tiles before they are refilled
  }

  store_rows<kFp8, kHeadDim>(s, seq, o_acc, row_max, row_sum, rows, row_end, q_row0, kv_head_index, lane);
}

template <typename Tag, int kHeadDim, int kWarps>
cudaError_t launch_attention(const SageParams& s, cudaStream_t stream) {
  constexpr int kRows = 16 * kWarps;
  const dim3 grid((s.max_seq_q + kRows - 1) / kRows, s.fwd.num_q_heads, s.fwd.batch);
  sage_attention_kernel<Tag, kHeadDim, kWarps><<<grid, kWarps * 32, 0, stream>>>(s);
  return cudaGetLastError();
}

template <typename Tag, int kHeadDim>
cudaError_t launch_for_warps(const SageParams& s, cudaStream_t stream) {
  return s.warps == 8 ? launch_attention<Tag, kHeadDim, 8>(s, stream) : launch_attention<Tag, kHeadDim, 4>(s, stream);
}

template <typename Tag>
cudaError_t launch_for_dim(const SageParams& s, cudaStream_t stream) {
  return s.fwd.head_dim == 64 ? launch_for_warps<Tag, 64>(s, stream) : launch_for_warps<Tag, 128>(s, stream);
}

// FP8 pre-passes: zero the channel maxima, take them, then write the transposed e4m3 V.
cudaError_t quantize_values_fp8(const SageParams& s, cudaStream_t stream) {
  const ForwardParams& p = s.fwd;
  const cudaError_t zeroed = cudaMemsetAsync(
      s.v_abs_max, 0, size_t(p.batch) * s.num_kv_heads * p.head_dim * sizeof(uint32_t), stream);
  if (zeroed != cudaSuccess) return zeroed;
  const int32_t row_blocks = (s.max_seq_k + kChannelMaxRows - 1) / kChannelMaxRows;
  value_channel_max_kernel<<<dim3(row_blocks, s.num_kv_heads, p.batch), kPrepThreads, 0, stream>>>(s);
  quantize_values_fp8_kernel<<<dim3(s.fp8_keys / kTileKeys, s.num_kv_heads, p.batch), kPrepThreads, 0, stream>>>(s);
  return cudaGetLastError();
}

}  // namespace
#endif  // SPARSA_GPU_HAS_MMA_SYNC

bool sage_supports(const GpuDevice& device, const ForwardParams& p, std::string* reason) {
  auto refuse = [&](const char* why) {
    if (reason != nullptr) *reason = std::string(backend_name()) + " backend: SPARGE quantized path: " + why;
    return false;
  };
#if SPARSA_GPU_HAS_MMA_SYNC
  if (device.compute_major < 8) return refuse("needs int8 mma.sync (sm_80 or newer)");
  if (p.head_dim != 64 && p.head_dim != 128) return refuse("head_dim must be 64 or 128");
  if (p.pv_skip_log2 != nullptr && (p.mask_block_k != kTileKeys || (p.mask_block_q != 64 && p.mask_block_q != 128))) {
    return refuse("the PV skip (lambda or sparge_head_params) needs block_q 64 or 128 and block_k 64");
  }
  return true;
#else
  (void)device;
  (void)p;
  return refuse("int8 mma.sync exists on NVIDIA only");
#endif
}

bool sage_fp8_pv_available(const GpuDevice& device) {
#if SPARSA_GPU_HAS_MMA_SYNC
  constexpr int kFirstFp8Arch = 89;  // compute capability 8.9: FP8 mma.sync and cvt
  if (device.compute_major * 10 + device.compute_minor < kFirstFp8Arch) return false;
  // The device runs the image built for the highest compatible target; only sm_89+ images hold the FP8 kernels.
  cudaFuncAttributes attributes;
  if (cudaFuncGetAttributes(&attributes, sage_attention_kernel<E4m3Tag, 128, 4>) != cudaSuccess) {
    (void)cudaGetLastError();
    return false;
  }
  return attributes.binaryVersion >= kFirstFp8Arch;
#else
  (void)device;
  return false;
#endif
}

SageParams sage_plan(const GpuDevice& device, const ForwardParams& p, int32_t num_kv_heads, float scale,
                     int64_t max_seq_q, int64_t max_seq_k, int64_t k_blocks) {
  SageParams s;
  s.fwd = p;
  s.num_kv_heads = num_kv_heads;
  s.scale = scale;
  s.max_seq_q = int32_t(max_seq_q);
  s.max_seq_k = int32_t(max_seq_k);
  s.k_blocks = int32_t(k_blocks);
  s.warps = p.pv_skip_log2 != nullptr && p.mask_block_q == 128 ? 8 : 4;
  s.fp8_pv = sage_fp8_pv_available(device);
  s.hopper = s.fp8_pv && sage_wgmma_supports(device, p);
  s.convert_v = !s.fp8_pv && (p.element_type == ElementType::kF32 || !p.kv_rows_aligned16);
  s.fp8_keys = int32_t((max_seq_k + kSageTileKeys - 1) / kSageTileKeys * kSageTileKeys);
  return s;
}

void sage_carve(ScratchCarver& carver, SageParams& s) {
  const ForwardParams& p = s.fwd;
  const uint64_t q_rows = uint64_t(p.batch) * p.num_q_heads * s.max_seq_q;
  const uint64_t k_rows = uint64_t(p.batch) * s.num_kv_heads * s.max_seq_k;
  const uint64_t dim = uint64_t(p.head_dim);
  s.q_i8 = carver.take<int8_t>(q_rows * dim);
  s.q_scale = carver.take<float>(q_rows);
  s.q_shift = carver.take<float>(q_rows);
  s.k_i8 = carver.take<int8_t>(k_rows * dim);
  s.k_scale = carver.take<float>(uint64_t(p.batch) * s.num_kv_heads * s.k_blocks);
  s.v_f16 = s.convert_v ? carver.take<uint16_t>(k_rows * dim) : nullptr;
  if (s.fp8_pv) {
    const uint64_t kv_heads = uint64_t(p.batch) * s.num_kv_heads;
    s.v_fp8 = carver.take<uint8_t>(kv_heads * dim * uint64_t(s.fp8_keys));
    s.v_abs_max = carver.take<uint32_t>(kv_heads * dim);
  }
}

cudaError_t sage_launch(const SageParams& s, cudaStream_t stream) {
#if SPARSA_GPU_HAS_MMA_SYNC
  const ForwardParams& p = s.fwd;
  const int32_t q_blocks = (s.max_seq_q + p.mask_block_q - 1) / p.mask_block_q;
  quantize_queries_kernel<<<dim3(q_blocks, p.num_q_heads, p.batch), kPrepThreads, 0, stream>>>(s);
  if (s.k_blocks > 0) {
    quantize_keys_kernel<<<dim3(s.k_blocks, s.num_kv_heads, p.batch), kPrepThreads, 0, stream>>>(s);
    if (s.convert_v) {
      const int32_t row_blocks = (s.max_seq_k + kConvertRows - 1) / kConvertRows;
      convert_values_kernel<<<dim3(row_blocks, s.num_kv_heads, p.batch), kPrepThreads, 0, stream>>>(s);
    }
    if (s.fp8_pv) {
      const cudaError_t status = quantize_values_fp8(s, stream);
      if (status != cudaSuccess) return status;
    }
  }
  const cudaError_t status = cudaGetLastError();
  if (status != cudaSuccess) return status;
  if (s.hopper) return sage_wgmma_launch(s, stream);
  if (s.fp8_pv) return launch_for_dim<E4m3Tag>(s, stream);
  if (s.convert_v || p.element_type == ElementType::kF16) return launch_for_dim<HalfTag>(s, stream);
  return launch_for_dim<BFloat16Tag>(s, stream);
#else
  (void)s;
  (void)stream;
  return cudaErrorInvalidValue;
#endif
}

SPARSA_GPU_NAMESPACE_END
