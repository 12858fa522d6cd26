// TOKEN_SELECT's fp32 scores on the tensor cores (NVIDIA sm_80+): fp16/bf16 keys in 16-byte aligned rows, head_dim a
// multiple of 8 up to 128. Same outputs as score_f32_kernel (token_select_score.cu): s itself to scores32 and one
// (max, Σ exp) partial per head and block, merged into m_h and Z_h by the grid column's last block alike.
//
// Why: score_f32_kernel multiplies on the CUDA cores (32 FMAs, the widening and a 16-lane shuffle tree per key row
// and lane) and is instruction-bound at ~2.6 TB/s of K on an H200 (840 µs over 1M keys, GQA 32/8, D 128), while the
// floor is reading K once. Here one mma.sync m16n8k16 multiplies 16 keys by 16 dims of 8 columns of q̄, the key rows
// go straight from global memory into A fragments, and each lane ends with whole scores: no shuffle at all. Measured
// on the H200 (same shape): 582 µs over 1M keys (3.7 TB/s of K), 86 µs over 128K. What limits it now is L2, not the
// SMs (ncu: L2 88 % busy, DRAM 78 %, 2.55 sectors per L2 read request, since a warp's load reads 64 bytes of each of
// 8 rows): whole-line requests need K staged through shared memory. Tried and not kept: B fragments in registers
// (128 registers, 2 blocks per SM: 600 µs, and 124 against 100 µs at 128K), two steps of rows in flight at 2 blocks
// per SM (640 µs) against one at 3, and each warp staging its rows through a 3-step cp.async ring in shared memory,
// whole rows per copy instruction (567 µs at 1M but 89 at 128K, with 46 % more instructions; its L2 requests carried
// 2.0 sectors each, so whole-line requests need the bulk copy engine, not 16-byte copies).
//
// q̄ (float64) is split into three parts of the key's 16-bit type, q̄' = 2^σ_h·q̄_h ≈ hi + mid + lo, each part the
// rounding of what the parts before it leave (the residual is formed in float64, exactly). σ_h = 0 for bf16 (fp32's
// range); for fp16 it lifts the head's largest |q̄'| into [2^14, 2^15), inside fp16's range, and the score is scaled
// back by 2^-σ_h (exact). Columns of the MMAs: with a 4-head chunk, MMA "hm" holds (hi, mid) of head n/2 in column n
// and MMA "lo" holds lo of head n/2 in the even columns; with 8 heads, two hm MMAs (heads 0-3, 4-7) and lo's column
// n holds head (n % 2)·4 + n/2. Lane (r, c) = (lane / 4, lane % 4) thus ends with the three parts of heads c (and
// 4 + c) for key rows r and r + 8 of its warp's 16.
//
// A fragments without shared memory: the order of d inside a dot product is free, so lane (r, c) loads the 16 bytes
// at dims [32p + 8c, 32p + 8c + 8) of rows r and r + 8 for pair p of MMAs; words 2m, 2m + 1 of those pieces are its
// k-slots (2c, 2c + 1) and (2c + 8, 2c + 9) of MMA 2p + m, and its B fragment holds q̄'s parts at the same dims.
//
// Error bound against the float64 oracle (ALGORITHMS.md §0), with S = Σ_d |q̄_d·k_d| <= ‖q̄_h‖·‖k_t‖:
//  - the split leaves |q̄' - hi - mid - lo| <= 2^-27·|q̄'| (bf16: 8 significant bits a part; fp16 2^-33), and fp16's
//    subnormal floor at most 2^-25 absolute per element against a head maximum >= 2^14;
//  - products of 16-bit elements are exact in fp32. Every MMA is issued with C = 0 (no chained accumulator) and sums
//    its 16 products as the tensor-core literature measures for fp32 accumulation (Fasi, Higham, Mikaitis and
//    Pranesh, PeerJ Computer Science, 2021): significands aligned to the largest and truncated to 24 bits, then one
//    rounding; at most 17·2^-23 of the largest product, <= 2^-18.9 of the MMA's Σ|p|;
//  - the (<= 8) MMA sums of a part and the three parts are added in fp32 (<= 10 roundings, u = 2^-24), and the
//    product with score_scale·2^-σ_h rounds once more.
// Altogether |ŝ - s| <= score_scale·2^-18.3·S, and the bound of token_select_score.cu holds with
//     E = score_scale · 2^-17 · ‖q̄_h‖ · max_t ‖k_t‖
// (2.5 times the derivation, for hardware that rounds coarser than the model); eps = 10E + 2^-16 follows as there.
#include "../../../src/error.h"
#include "token_select_common.cuh"

#if SPARSA_GPU_HAS_MMA_SYNC
#include "../kernels/mma_primitives.cuh"
#endif

#include <cmath>
#include <type_traits>

SPARSA_GPU_NAMESPACE_BEGIN
namespace token_select {

#if SPARSA_GPU_HAS_MMA_SYNC
namespace {

constexpr int kTcThreads = 256;
constexpr int kTcWarps = kTcThreads / kWarpLanes;
constexpr int kTcBlocksPerSm = 3;  // <= 85 registers a thread
constexpr int kTcMmaRows = 16;     // keys of one m16n8k16
constexpr int kTcKeysPerStep = kTcWarps * kTcMmaRows;
constexpr int kTcStepsPerTile = kScoreTile / kTcKeysPerStep;
constexpr int kTcPairDims = 32;         // dims of one pair of MMAs: 4 lanes × 16 bytes of a row
constexpr int kTcMaxHeadDim = 128;      // a step's A pieces stay in registers up to here
constexpr int kTcElementsPerPiece = 8;  // 16-bit elements in one 16-byte load
constexpr int kTcRowsPerLane = 2;       // rows r and r + 8
constexpr int kTcHolders = kTcWarps * (kTcMmaRows / kTcRowsPerLane);  // lanes per block that keep one head's stats
constexpr int kFp16ScaledExponent = 15;  // fp16 q̄' parts below 2^15: inside fp16's range (max 65504)
static_assert(kScoreTile % kTcKeysPerStep == 0, "a tile is whole steps");

template <ElementType kType>
using TcTag = std::conditional_t<kType == ElementType::kF16, mma::HalfTag, mma::BFloat16Tag>;

// Two float64 values rounded to the 16-bit type of kType, packed low first.
template <ElementType kType>
__device__ __forceinline__ uint32_t pack_part(double low, double high) {
  return mma::pack_pair(TcTag<kType>{}, float(low), float(high));
}
template <ElementType kType>
__device__ __forceinline__ double part_value(double x) {
  const uint32_t bits = pack_part<kType>(x, 0.0) & 0xffffu;
  if constexpr (kType == ElementType::kF16) return double(f16_bits_to_float(uint16_t(bits)));
  return double(__uint_as_float(bits << 16));
}

// A 16-byte load of K, which is read once: not kept in L1 (86 against 94 µs over 128K keys on the H200), whole
// 128-byte lines into L2 (the neighbouring pieces are the other lanes' of the same row).
__device__ __forceinline__ uint4 load_streaming(const uint4* at) {
  uint4 v;
  asm volatile("ld.global.nc.L1::no_allocate.L2::128B.v4.u32 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "l"(at));
  return v;
}

// The three parts of x (hi, mid, lo), each the 16-bit rounding of what the parts before it leave.
template <ElementType kType>
__device__ __forceinline__ void split3(double x, double (&parts)[3]) {
#pragma unroll
  for (int i = 0; i < 3; ++i) {
    parts[i] = part_value<kType>(x);
    x -= parts[i];  // exact: x and its rounding share the exponent range
  }
}

// Block (x, y = kv head · head chunk, b) walks candidate tiles x, x + gridDim.x, ... (as score_f32_kernel); warp w
// scores keys [16w, 16w + 16) of each step of 128. The next step's rows are loaded into the registers of this one as
// soon as its MMAs have consumed them, so the loads stay in flight through the scores' stores and statistics.
template <ElementType kType, int kHeads, int kPairs>
__global__ void __launch_bounds__(kTcThreads, kTcBlocksPerSm) score_tc_kernel(const SelectParams sp) {
#if SPARSA_GPU_DEVICE_HAS_MMA_SYNC
  static_assert(kHeads == 4 || kHeads == 8, "an hm MMA holds 4 heads, the lo MMA up to 8");
  constexpr int kHmMmas = kHeads / 4;
  constexpr int kHeadsPerLane = kHeads / 4;
  __shared__ float holder_max[kHeads][kTcHolders];
  __shared__ double holder_sum[kHeads][kTcHolders];
  __shared__ float head_factor[kHeads];
  wait_for_previous_kernel();  // prepare_kernel's q̄ and lookup (gpu_token_select.cu)
  constexpr int kTcFragments = kPairs * 2 * (kHmMmas + 1);  // (pair, half, MMA) entries of B
  __shared__ uint2 b_fragments[kTcFragments * kWarpLanes];

  const ScoreBlock block = score_block<kHeads>(sp);
  if (!block.active) return;
  const int32_t b = block.b, head0 = block.head0, heads = block.heads, tiles = block.tiles;
  const SequenceInfo info = block.info;
  const SequenceView s = make_sequence_view(sp.p, b, head0);
  const int32_t dim = sp.p.head_dim;
  const int64_t row0 = int64_t(b) * sp.p.num_q_heads + head0;
  const int warp = threadIdx.x / kWarpLanes, lane = threadIdx.x % kWarpLanes;
  const int r = lane / 4, c = lane % 4;

  // σ_h per head (fp16) and the factor score_scale · 2^-σ_h; warp j < kHeads finds head j's largest |q̄|.
  auto exponent_of = [&](int32_t j) {
    if (kType != ElementType::kF16 || j >= heads) return 0;
    double largest = 0.0;
    for (int32_t d = lane; d < dim; d += kWarpLanes) largest = fmax(largest, fabs(sp.qbar[(row0 + j) * dim + d]));
    for (int offset = kWarpLanes / 2; offset > 0; offset /= 2) largest = fmax(largest, warp_shfl_xor(largest, offset));
    int e = 0;
    if (largest > 0.0) frexp(largest, &e);  // largest < 2^e
    return kFp16ScaledExponent - e;
  };
  int sigma_of_warp = 0;
  if (warp < kHeads) sigma_of_warp = exponent_of(warp);
  __shared__ int sigma[kHeads];
  if (warp < kHeads && lane == 0) {
    sigma[warp] = sigma_of_warp;
    head_factor[warp] = float(ldexp(sp.score_scale, -sigma_of_warp));
  }
  __syncthreads();

  // B fragments, shared by the block's warps: entry (p, m, mma) of lane (r, c) holds column n = r of MMA "mma" of
  // pair p, half m, at dims 32p + 8c + 4m + {0, 1} (reg x) and {2, 3} (reg y).
  for (int32_t e = threadIdx.x; e < kTcFragments * kWarpLanes; e += kTcThreads) {
    const int frag_lane = e % kWarpLanes, frag = e / kWarpLanes;
    const int mma = frag % (kHmMmas + 1), m = (frag / (kHmMmas + 1)) % 2, p = frag / (2 * (kHmMmas + 1));
    const int n = frag_lane / 4, k_group = frag_lane % 4;
    int32_t j = mma * 4 + n / 2;  // hm: (hi, mid) of head n / 2 of the MMA's four
    int part = n % 2;
    if (mma == kHmMmas) {  // lo: head n / 2 in the even columns, head 4 + n / 2 in the odd ones (8 heads only)
      j = (n % 2) * 4 + n / 2;
      part = 2;
    }
    const bool real_head = j < heads && j < kHeads;
    uint32_t regs[2];
#pragma unroll
    for (int reg = 0; reg < 2; ++reg) {
      double value[2];
#pragma unroll
      for (int i = 0; i < 2; ++i) {
        const int32_t d = p * kTcPairDims + k_group * kTcElementsPerPiece + 4 * m + 2 * reg + i;
        double parts[3];
        split3<kType>(real_head && d < dim ? ldexp(sp.qbar[(row0 + j) * dim + d], sigma[real_head ? j : 0]) : 0.0,
                      parts);
        value[i] = parts[part];
      }
      regs[reg] = pack_part<kType>(value[0], value[1]);
    }
    b_fragments[e] = make_uint2(regs[0], regs[1]);
  }
  __syncthreads();

  const uint4* keys = static_cast<const uint4*>(sp.p.k);  // 16-byte aligned rows (the path's precondition)
  const int32_t my_tiles = (tiles - int32_t(blockIdx.x) + int32_t(gridDim.x) - 1) / int32_t(gridDim.x);
  const int32_t steps = my_tiles * kTcStepsPerTile;
  // Candidate of row `row` (0..15) of this warp in step `it`.
  auto candidate = [&](int32_t it, int row) {
    const int32_t tile = int32_t(blockIdx.x) + (it / kTcStepsPerTile) * int32_t(gridDim.x);
    return tile * kScoreTile + (it % kTcStepsPerTile) * kTcKeysPerStep + warp * kTcMmaRows + row;
  };
  uint4 pieces[kPairs][kTcRowsPerLane];  // this lane's pieces of one step
  auto load_step = [&](int32_t it) {
#pragma unroll
    for (int half = 0; half < kTcRowsPerLane; ++half) {
      const int32_t cand = candidate(it, r + 8 * half);
      const bool real = cand < info.candidates;
      const int64_t row = real ? key_row_offset(sp.p, sp.p.k_strides, s, sp.n_init + cand) : 0;
#pragma unroll
      for (int p = 0; p < kPairs; ++p) {
        const int32_t first_dim = p * kTcPairDims + c * kTcElementsPerPiece;
        pieces[p][half] = make_uint4(0, 0, 0, 0);
        if (real && first_dim < dim) pieces[p][half] = load_streaming(keys + (row + first_dim) / kTcElementsPerPiece);
      }
    }
  };

  float run_max[kHeadsPerLane];
  double run_sum[kHeadsPerLane];  // float64: a lane adds up to thousands of terms
#pragma unroll
  for (int i = 0; i < kHeadsPerLane; ++i) {
    run_max[i] = -INFINITY;
    run_sum[i] = 0.0;
  }
  float factor[kHeadsPerLane];
#pragma unroll
  for (int i = 0; i < kHeadsPerLane; ++i) factor[i] = head_factor[i * 4 + c];

  if (steps > 0) load_step(0);
  for (int32_t it = 0; it < steps; ++it) {
    // hm[mma][·] and lo[·] in the C layout: {row r col 2c, row r col 2c+1, row r+8 col 2c, row r+8 col 2c+1}.
    float hm[kHmMmas][4] = {}, lo[4] = {};
#pragma unroll
    for (int p = 0; p < kPairs; ++p) {
#pragma unroll
      for (int m = 0; m < 2; ++m) {
        const uint32_t a[4] = {(&pieces[p][0].x)[2 * m], (&pieces[p][1].x)[2 * m], (&pieces[p][0].x)[2 * m + 1],
                               (&pieces[p][1].x)[2 * m + 1]};
#pragma unroll
        for (int mma = 0; mma <= kHmMmas; ++mma) {
          float d[4] = {0.0f, 0.0f, 0.0f, 0.0f};  // C = 0: no chained accumulator (the bound above)
          const uint2 b_regs = b_fragments[((p * 2 + m) * (kHmMmas + 1) + mma) * kWarpLanes + lane];
          mma::mma_16816(TcTag<kType>{}, d, a, b_regs.x, b_regs.y);
          float* sum = mma < kHmMmas ? hm[mma] : lo;
#pragma unroll
          for (int v = 0; v < 4; ++v) sum[v] += d[v];
        }
      }
    }
    if (it + 1 < steps) load_step(it + 1);

    // Lane (r, c): head i·4 + c for keys r and r + 8; lo of head c sits in column 2c (and of head 4 + c in 2c + 1).
#pragma unroll
    for (int half = 0; half < kTcRowsPerLane; ++half) {
      const int32_t cand = candidate(it, r + 8 * half);
      if (cand >= info.candidates) continue;
#pragma unroll
      for (int i = 0; i < kHeadsPerLane; ++i) {
        const int32_t j = i * 4 + c;
        if (j >= heads) continue;
        const float part_lo = lo[2 * half + i];
        const float score = ((part_lo + hm[i][2 * half + 1]) + hm[i][2 * half]) * factor[i];
        sp.scores32[(row0 + j) * sp.score_stride + cand] = score;
        if (score > run_max[i]) {
          run_sum[i] = run_sum[i] * double(expf(run_max[i] - score)) + 1.0;
          run_max[i] = score;
        } else {
          run_sum[i] += double(expf(score - run_max[i]));
        }
      }
    }
  }

  // The block's partial per head: the holders' (max, sum) pairs combined in a fixed order.
#pragma unroll
  for (int i = 0; i < kHeadsPerLane; ++i) {
    holder_max[i * 4 + c][warp * (kTcMmaRows / kTcRowsPerLane) + r] = run_max[i];
    holder_sum[i * 4 + c][warp * (kTcMmaRows / kTcRowsPerLane) + r] = run_sum[i];
  }
  __syncthreads();
  if (int32_t(threadIdx.x) < heads) {
    const int j = threadIdx.x;
    write_block_partial(sp, row0, j, holder_max[j], holder_sum[j], kTcHolders);
  }
  merge_partials_if_last(sp, block, row0);
#endif
}

template <ElementType kType, int kHeads>
void launch_tc_heads(const SelectParams& sp, dim3 grid, cudaStream_t stream) {
  constexpr int kShortPairs = 2, kLongPairs = kTcMaxHeadDim / kTcPairDims;
  if (sp.p.head_dim <= kShortPairs * kTcPairDims) {
    check(launch_overlapping(sp.p.overlap_launches, score_tc_kernel<kType, kHeads, kShortPairs>, grid,
                             dim3(kTcThreads), stream, sp),
          "token_select score_tc_kernel launch");
  } else {
    check(launch_overlapping(sp.p.overlap_launches, score_tc_kernel<kType, kHeads, kLongPairs>, grid,
                             dim3(kTcThreads), stream, sp),
          "token_select score_tc_kernel launch");
  }
}

template <ElementType kType>
void launch_tc_type(const SelectParams& sp, dim3 grid, int32_t head_chunk, cudaStream_t stream) {
  constexpr int kSmallChunk = 4, kLargeChunk = 8;
  if (head_chunk <= kSmallChunk) {
    launch_tc_heads<kType, kSmallChunk>(sp, grid, stream);
  } else {
    launch_tc_heads<kType, kLargeChunk>(sp, grid, stream);
  }
}

}  // namespace
#endif

bool scores_on_fp32_tensor_cores(const GpuDevice& device, const AttentionProblem& problem) {
#if SPARSA_GPU_HAS_MMA_SYNC
  constexpr int32_t kAmpereMajor = 8;
  return device.compute_major >= kAmpereMajor && problem.head_dim <= kTcMaxHeadDim;
#else
  (void)device;
  (void)problem;
  return false;
#endif
}

int32_t tc_score_blocks_per_sm() {
#if SPARSA_GPU_HAS_MMA_SYNC
  return kTcBlocksPerSm;
#else
  return 1;
#endif
}

void launch_score_tc(const SelectParams& sp, dim3 grid, int32_t head_chunk, cudaStream_t stream) {
#if SPARSA_GPU_HAS_MMA_SYNC
  if (sp.p.element_type == ElementType::kF16) {
    launch_tc_type<ElementType::kF16>(sp, grid, head_chunk, stream);
  } else {
    launch_tc_type<ElementType::kBF16>(sp, grid, head_chunk, stream);
  }
#else
  (void)sp;
  (void)grid;
  (void)head_chunk;
  (void)stream;
  fail(SPARSA_STATUS_INTERNAL, "token_select score_tc_kernel: no tensor-core path in this build");
#endif
}

}  // namespace token_select
SPARSA_GPU_NAMESPACE_END
