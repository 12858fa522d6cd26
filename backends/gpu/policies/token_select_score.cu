// TOKEN_SELECT's scores (§6): s[h, t] = q̄_h·K[t, h/g] over a sequence's candidates, with each tile's softmax max
// and sum per head, for the vote that follows (gpu_token_select.cu: the run). fp16/bf16 keys in 16-byte aligned rows
// with head_dim a multiple of 8 (<= 256) are scored in fp32: on NVIDIA tensor cores up to head_dim 128
// (token_select_score_tc.cu), else with FMAs (score_f32_kernel, with the error bound of §0 stated above it);
// everything else in float64 as on the CPU, with FMAs (score_kernel) or float64 tensor-core MMA on Hopper
// (score_mma_kernel), both on the exact widening described in gpu_token_select.cu. launch_scores chooses.
#include "../../../src/error.h"
#include "token_select_common.cuh"

#include <algorithm>
#include <cmath>

SPARSA_GPU_NAMESPACE_BEGIN
namespace token_select {
namespace {

// Block (x, y = kv head · head chunk, b) walks candidate tiles x, x + gridDim.x, ...; a tile's 256 key rows come in
// steps of 32 bytes per row (one DRAM sector each), copied with cp.async into a ring of kStages stages, so that
// kStages - 1 steps (16 or 24 KB per block) are in flight while one is computed. The ring runs across tiles (the next
// tile's first steps are fetched during this tile's last ones and its softmax). Each thread accumulates rows r and
// r + 128 of the tile against the chunk's kHeads query heads (float64 FMA over d in order), then the tile's max and
// Σ exp per head, and exp(s - max) to scratch.
template <ElementType kType, int kHeads>
__global__ void __launch_bounds__(kScoreThreads, kScoreBlocksPerSm) score_kernel(const SelectParams sp) {
  static_assert(kHeads % 2 == 0, "heads are read from shared memory in pairs");
  static_assert(kPiecesPerRow == 2, "staged_offset swaps two pieces");
  constexpr int kStages = kHeads >= 8 ? 3 : 4;  // the ring and q̄ stay under the 48 KB of static shared memory
  constexpr int kElementBytes = kType == ElementType::kF32 ? 4 : 2;
  constexpr int kPerPiece = kPieceBytes / kElementBytes;
  constexpr int kChunkDims = kChunkBytes / kElementBytes;
  constexpr double kRescale = kType == ElementType::kF16 ? kF16Rescale : kWideRescale;
  static_assert(kMaxHeadDim % kChunkDims == 0, "q̄ covers every staged dimension");
  __shared__ __align__(16) unsigned char rows[kStages][kStageBytes];
  __shared__ __align__(16) double qbar[kMaxHeadDim * kHeads];  // [d][head], rescaled
  __shared__ double scratch[kScoreThreads / kWarpLanes * kHeads], maxima[kHeads], sums[kHeads];

  const ScoreBlock block = score_block<kHeads>(sp);
  if (!block.active) return;
  const int32_t b = block.b, head0 = block.head0, heads = block.heads, tiles = block.tiles;
  const SequenceInfo info = block.info;
  const SequenceView s = make_sequence_view(sp.p, b, head0);
  const int32_t dim = sp.p.head_dim;
  const int64_t row0 = int64_t(b) * sp.p.num_q_heads + head0;  // (b, head0) row of q̄ / scores / tile stats
  for (int32_t e = threadIdx.x; e < kMaxHeadDim * kHeads; e += blockDim.x) {
    const int32_t d = e / kHeads, j = e % kHeads;
    qbar[e] = d < dim && j < heads ? sp.qbar[(row0 + j) * dim + d] * kRescale : 0.0;
  }
  const char* keys = static_cast<const char*>(sp.p.k);
  const int32_t chunks = (dim + kChunkDims - 1) / kChunkDims;
  const int32_t part = threadIdx.x % kPiecesPerRow;
  const int32_t first_row = threadIdx.x / kPiecesPerRow;  // this thread copies rows first_row + j·kRowsPerCopyPass
  const bool vector_rows = sp.p.kv_rows_aligned16 != 0;

  // The copier: the step it fetches next (tile, chunk), element offsets of its key rows (-1 past the candidates).
  int32_t copy_tile = blockIdx.x, copy_chunk = 0;
  int64_t key_at[kCopyPasses];
  auto issue = [&](unsigned char* stage) {
    if (copy_tile < tiles) {
      if (copy_chunk == 0) {
#pragma unroll
        for (int j = 0; j < kCopyPasses; ++j) {
          const int32_t c = copy_tile * kScoreTile + first_row + j * kRowsPerCopyPass;
          key_at[j] = c < info.candidates ? key_row_offset(sp.p, sp.p.k_strides, s, sp.n_init + c) : -1;
        }
      }
      const int32_t first_dim = copy_chunk * kChunkDims + part * kPerPiece;
#pragma unroll
      for (int j = 0; j < kCopyPasses; ++j) {
        unsigned char* to = stage + staged_offset(first_row + j * kRowsPerCopyPass, part);
        const char* from = keys + (key_at[j] >= 0 ? key_at[j] + first_dim : 0) * kElementBytes;
        if (key_at[j] >= 0 && vector_rows && first_dim + kPerPiece <= dim) {
          copy_16(to, from);
          continue;
        }
        uint32_t words[4] = {0, 0, 0, 0};  // past the candidates, unaligned rows or the tail of D: zeros past D
        if (key_at[j] >= 0) {
#pragma unroll
          for (int e = 0; e < kPerPiece; ++e) {
            if (first_dim + e >= dim) break;
            const uint32_t bits = kElementBytes == 4 ? reinterpret_cast<const uint32_t*>(from)[e]
                                                     : reinterpret_cast<const uint16_t*>(from)[e];
            words[e * kElementBytes / 4] |= bits << (8 * (e * kElementBytes % 4));
          }
        }
        *reinterpret_cast<uint4*>(to) = make_uint4(words[0], words[1], words[2], words[3]);
      }
    }
    copy_commit();  // one group per step, empty past the last tile: the wait below counts steps
    if (++copy_chunk == chunks) {
      copy_chunk = 0;
      copy_tile += gridDim.x;
    }
  };

#pragma unroll
  for (int stage = 0; stage < kStages - 1; ++stage) issue(rows[stage]);
  int32_t compute_stage = 0, copy_stage = kStages - 1;
  int32_t tile = blockIdx.x;
  while (true) {
    const int32_t c0 = tile * kScoreTile;
    double acc[2][kHeads];
#pragma unroll
    for (int j = 0; j < kHeads; ++j) acc[0][j] = acc[1][j] = 0.0;
    for (int32_t chunk = 0; chunk < chunks; ++chunk) {
      copy_wait<kStages - 2>();  // this thread's copies of this step have landed ...
      __syncthreads();           // ... and everyone's; every thread is done with the stage refilled next
      issue(rows[copy_stage]);
      copy_stage = copy_stage + 1 == kStages ? 0 : copy_stage + 1;
      const unsigned char* stage = rows[compute_stage];
      compute_stage = compute_stage + 1 == kStages ? 0 : compute_stage + 1;
#pragma unroll
      for (int p = 0; p < kPiecesPerRow; ++p) {
        const uint4 a = *reinterpret_cast<const uint4*>(stage + staged_offset(threadIdx.x, p));
        const uint4 z = *reinterpret_cast<const uint4*>(stage + staged_offset(threadIdx.x + kScoreThreads, p));
        const uint32_t wa[4] = {a.x, a.y, a.z, a.w}, wz[4] = {z.x, z.y, z.z, z.w};
        const double* q = qbar + (chunk * kChunkDims + p * kPerPiece) * kHeads;
#pragma unroll
        for (int w = 0; w < 4; ++w) {
          if (kElementBytes == 4) {
            accumulate<kHeads>(q + w * kHeads, widen_f32(wa[w]), widen_f32(wz[w]), acc);
          } else {
            double a_low, a_high, z_low, z_high;
            widen_pair<kType>(wa[w], a_low, a_high);
            widen_pair<kType>(wz[w], z_low, z_high);
            accumulate<kHeads>(q + (2 * w) * kHeads, a_low, z_low, acc);
            accumulate<kHeads>(q + (2 * w + 1) * kHeads, a_high, z_high, acc);
          }
        }
      }
    }

    // The tile's softmax statistics per head, then exp(s - tile max) for the vote.
    const bool valid0 = c0 + int32_t(threadIdx.x) < info.candidates;
    const bool valid1 = c0 + int32_t(threadIdx.x) + kScoreThreads < info.candidates;
    double v[kHeads];
#pragma unroll
    for (int j = 0; j < kHeads; ++j) {
      acc[0][j] *= sp.score_scale;
      acc[1][j] *= sp.score_scale;
      v[j] = fmax(valid0 ? acc[0][j] : -INFINITY, valid1 ? acc[1][j] : -INFINITY);
    }
    block_reduce<kHeads, true>(v, scratch, maxima);
#pragma unroll
    for (int j = 0; j < kHeads; ++j) {
      acc[0][j] = valid0 ? exp(acc[0][j] - maxima[j]) : 0.0;
      acc[1][j] = valid1 ? exp(acc[1][j] - maxima[j]) : 0.0;
      v[j] = acc[0][j] + acc[1][j];
    }
    block_reduce<kHeads, false>(v, scratch, sums);
#pragma unroll
    for (int j = 0; j < kHeads; ++j) {
      if (j >= heads) break;
      double* row = sp.scores + (row0 + j) * sp.score_stride + c0;
      if (valid0) row[threadIdx.x] = acc[0][j];
      if (valid1) row[threadIdx.x + kScoreThreads] = acc[1][j];
    }
    if (int32_t(threadIdx.x) < heads) {
      sp.tile_max[(row0 + threadIdx.x) * sp.tiles + tile] = maxima[threadIdx.x];
      sp.tile_sum[(row0 + threadIdx.x) * sp.tiles + tile] = sums[threadIdx.x];
    }
    tile += gridDim.x;
    if (tile >= tiles) break;
  }
  copy_wait<0>();  // the groups still open are empty; no copy outlives the block
}

// ---- The tensor-core score kernel (NVIDIA; used on sm_90): float64 MMA (DMMA) ----
// The FMA kernel above issues one instruction per 32 FMAs plus the shared loads and widening around them, so it is
// bound by instruction issue, far from the memory floor of reading K once. One m8n8k4 DMMA does 8 candidates × 8
// heads × 4 dims (256 FMAs) per instruction (the sm_90 m16n8k16 below: two of them × 4 dims at once). A = 8 candidates × 4 dims of widened K, B = 4 dims × 8 heads of q̄ (a chunk of
// the group; with a group of 4 half of every MMA multiplies zeros, which still leaves the tensor pipe under the
// memory floor), C = the 8 × 8 scores. The order of d inside a dot product is free, so a lane's 16-byte piece of
// its candidate row (8 or 4 consecutive dims) feeds 8 or 4 consecutive MMAs: lane (r = lane/4, c = lane%4) holds
// candidate r and, in MMA i of round p, dim p·kRoundDims + c·kPerPiece + i; B's lane (k = c, n = r) then holds the
// q̄ of head r at the same dims, which therefore sit in registers for the whole block (head_dim/4 doubles a lane).
// Products are the exact ones of the FMA kernel (same widening, same pre-scaled q̄); only how the MMA's partial
// sums round differs, a few ulps (see the file comment).
constexpr int kMmaBlocksPerSm = 3;  // 164 registers a thread: 3 blocks (12 warps, 72 KB of copies in flight) per SM

// The MMA kernel and its layout constants: NVIDIA only.
#if SPARSA_GPU_HAS_MMA_SYNC
constexpr int kMmaThreads = 128;  // 4 warps; warp w owns candidates [64w, 64w + 64) of every tile
constexpr int kMmaWarps = kMmaThreads / 32;
constexpr int kMmaM = 8, kMmaN = 8, kMmaK = 4;  // candidates × heads × dims of one m8n8k4
constexpr int kMmaHeads = kMmaN;                 // query heads per block: a chunk of the group
constexpr int kWarpCandidates = kScoreTile / kMmaWarps;
constexpr int kWarpGroups = kWarpCandidates / kMmaM;  // accumulators per lane: 8 candidates × 8 heads each
constexpr int kHalves = 2;                            // a tile's rows are staged half by half (shared memory)
constexpr int kHalfGroups = kWarpGroups / kHalves;
constexpr int kHalfCandidates = kHalfGroups * kMmaM;  // of one warp in one half
constexpr int kRoundBytes = kMmaK * kPieceBytes;       // one round: the 4 lanes of a candidate read 16 bytes each
constexpr int kMmaStageRows = kScoreTile / kHalves;
constexpr int kMmaStageBytes = kMmaStageRows * kRoundBytes;  // 8 KB: one round of half a tile
constexpr int kMmaStages = 4;                                // 3 steps (24 KB) in flight per block
constexpr int kMmaCopiesPerRow = kRoundBytes / kPieceBytes;
constexpr int kMmaCopyRows = kMmaThreads / kMmaCopiesPerRow;  // rows one copy pass covers (one per warp's half)
constexpr int kMmaMaxHeadDim = 128;                           // q̄ fragments stay in registers up to here
constexpr int kQbarSlots = kMmaMaxHeadDim / kMmaK;            // doubles of q̄ per lane
constexpr int kMmaMinGroup = 4;     // below this most of every MMA would multiply zeros: the FMA kernel serves it
static_assert(kMmaCopyRows == kHalfCandidates, "copy pass k stages warp k's rows of the half");
static_assert(kWarpLanes == 32 || !SPARSA_GPU_DEVICE_HAS_MMA_SYNC, "m8n8k4 fragments are laid out over 32 lanes");

// Piece `part` of the round at `first_dim` of key row `key_at` (-1: past the candidates) into `to` without a
// 16-byte load: unaligned rows and the tail of D (zeros past D). Kept out of line: the copier is unrolled per round.
template <ElementType kType>
__device__ __noinline__ void stage_piece_slowly(unsigned char* to, const char* keys, int64_t key_at, int32_t first_dim,
                                                int32_t dim) {
  constexpr int kElementBytes = kType == ElementType::kF32 ? 4 : 2;
  constexpr int kPerPiece = kPieceBytes / kElementBytes;
  uint32_t words[4] = {0, 0, 0, 0};
  if (key_at >= 0) {
    const char* from = keys + (key_at + first_dim) * kElementBytes;
    for (int e = 0; e < kPerPiece && first_dim + e < dim; ++e) {
      const uint32_t bits = kElementBytes == 4 ? reinterpret_cast<const uint32_t*>(from)[e]
                                               : reinterpret_cast<const uint16_t*>(from)[e];
      words[e * kElementBytes / 4] |= bits << (8 * (e * kElementBytes % 4));
    }
  }
  *reinterpret_cast<uint4*>(to) = make_uint4(words[0], words[1], words[2], words[3]);
}

#if !defined(__CUDA_ARCH__) || __CUDA_ARCH__ < 900
__device__ __forceinline__ void dmma(double (&acc)[2], double a, double b) {
#if SPARSA_GPU_DEVICE_HAS_MMA_SYNC
  asm("mma.sync.aligned.m8n8k4.row.col.f64.f64.f64.f64 {%0,%1}, {%2}, {%3}, {%0,%1};\n"
      : "+d"(acc[0]), "+d"(acc[1])
      : "d"(a), "d"(b));
#endif
}
#endif

// Hopper runs the m8n8k4 shape at half its FP64 tensor rate (ncu on an H200: 43 % of the DMMA pipe's peak was only
// 14 TFLOPS, the kernel 1.24 ms); the sm_90 shape does 16 candidates × 8 heads × 16 dims per instruction (0.85 ms). Fragments (the PTX
// layout): a[v0 + 2·v1] = A[r + 8·v0][c + 4·v1], b[v] = B[c + 4·v][r], {low, high} = C rows r and r + 8, columns
// 2c, 2c + 1.
#if !defined(__CUDA_ARCH__) || __CUDA_ARCH__ >= 900
__device__ __forceinline__ void dmma_16x8x16(double (&low)[2], double (&high)[2], const double (&a)[8],
                                             const double (&b)[4]) {
#if defined(__CUDA_ARCH__)
  asm("mma.sync.aligned.m16n8k16.row.col.f64.f64.f64.f64 {%0,%1,%2,%3}, {%4,%5,%6,%7,%8,%9,%10,%11}, "
      "{%12,%13,%14,%15}, {%0,%1,%2,%3};\n"
      : "+d"(low[0]), "+d"(low[1]), "+d"(high[0]), "+d"(high[1])
      : "d"(a[0]), "d"(a[1]), "d"(a[2]), "d"(a[3]), "d"(a[4]), "d"(a[5]), "d"(a[6]), "d"(a[7]), "d"(b[0]), "d"(b[1]),
        "d"(b[2]), "d"(b[3]));
#endif
}
#endif

// The elements of a staged 16-byte piece as the exactly scaled doubles of the file comment, in order.
template <ElementType kType, int kCount>
__device__ __forceinline__ void widen_piece(const uint4& piece, double (&out)[kCount]) {
  const uint32_t words[4] = {piece.x, piece.y, piece.z, piece.w};
#pragma unroll
  for (int w = 0; w < 4; ++w) {
    if constexpr (kType == ElementType::kF32) {
      out[w] = widen_f32(words[w]);
    } else {
      widen_pair<kType>(words[w], out[2 * w], out[2 * w + 1]);
    }
  }
}

// Block (x, y = kv head · chunk of 8 heads, b) walks candidate tiles x, x + gridDim.x, ... like score_kernel. A step
// stages one round (64 bytes of each row) of half a tile with cp.async into a ring of kMmaStages stages that runs
// across tiles; warp w reads the rows of its candidates from it (one 16-byte shared load per 8 or 4 MMAs). Then the
// tile's softmax statistics per head and exp(s - tile max) to scratch, from the accumulators' own layout.
template <ElementType kType>
__global__ void __launch_bounds__(kMmaThreads, kMmaBlocksPerSm) score_mma_kernel(const SelectParams sp) {
#if SPARSA_GPU_DEVICE_HAS_MMA_SYNC
  constexpr int kElementBytes = kType == ElementType::kF32 ? 4 : 2;
  constexpr int kPerPiece = kPieceBytes / kElementBytes;  // MMAs one 16-byte piece feeds
  constexpr int kRoundDims = kMmaK * kPerPiece;
  constexpr int kMaxRounds = kMmaMaxHeadDim / kRoundDims;
  constexpr double kRescale = kType == ElementType::kF16 ? kF16Rescale : kWideRescale;
  static_assert(kMaxRounds * kPerPiece == kQbarSlots, "one q̄ slot per (round, MMA)");
  __shared__ __align__(16) unsigned char ring[kMmaStages][kMmaStageBytes];
  __shared__ double warp_max[kMmaWarps][kMmaHeads], warp_sum[kMmaWarps][kMmaHeads];

  const ScoreBlock block = score_block<kMmaHeads>(sp);
  if (!block.active) return;
  const int32_t b = block.b, head0 = block.head0, heads = block.heads, tiles = block.tiles;
  const SequenceInfo info = block.info;
  const SequenceView s = make_sequence_view(sp.p, b, head0);
  const int32_t dim = sp.p.head_dim;
  const int32_t rounds = (dim + kRoundDims - 1) / kRoundDims;
  const int64_t row0 = int64_t(b) * sp.p.num_q_heads + head0;  // (b, head0) row of q̄ / scores / tile stats
  const int warp = threadIdx.x / kWarpLanes, lane = threadIdx.x % kWarpLanes;
  const int r = lane / 4, c = lane % 4;  // fragment row (candidate; B: head) and column (k)

  // B fragments: q̄ of head r at the dims lane c multiplies in every (round, MMA); zero past the heads and D.
  double qf[kQbarSlots];
#pragma unroll
  for (int p = 0; p < kMaxRounds; ++p) {
#pragma unroll
    for (int i = 0; i < kPerPiece; ++i) {
      const int32_t d = p * kRoundDims + c * kPerPiece + i;
      qf[p * kPerPiece + i] = r < heads && d < dim ? sp.qbar[(row0 + r) * dim + d] * kRescale : 0.0;
    }
  }

  // The copier: thread t stages piece t % 4 of rows t / 4 + kMmaCopyRows·k, i.e. candidate
  // 64k + 32·half + t / 4 of the tile (warp k's candidates of the half); it runs kMmaStages - 1 steps ahead.
  const char* keys = static_cast<const char*>(sp.p.k);
  const int32_t part = threadIdx.x % kMmaCopiesPerRow, copy_row = threadIdx.x / kMmaCopiesPerRow;
  const bool vector_rows = sp.p.kv_rows_aligned16 != 0;
  int32_t copy_tile = blockIdx.x, copy_half = 0, copy_round = 0;
  int64_t key_at[kMmaWarps];
  auto issue = [&](unsigned char* stage) {
    if (copy_tile < tiles) {
      if (copy_round == 0) {
#pragma unroll
        for (int k = 0; k < kMmaWarps; ++k) {
          const int32_t cand = copy_tile * kScoreTile + k * kWarpCandidates + copy_half * kHalfCandidates + copy_row;
          key_at[k] = cand < info.candidates ? key_row_offset(sp.p, sp.p.k_strides, s, sp.n_init + cand) : -1;
        }
      }
      const int32_t first_dim = copy_round * kRoundDims + part * kPerPiece;
#pragma unroll
      for (int k = 0; k < kMmaWarps; ++k) {
        unsigned char* to = stage + (copy_row + k * kMmaCopyRows) * kRoundBytes + part * kPieceBytes;
        if (key_at[k] >= 0 && vector_rows && first_dim + kPerPiece <= dim) {
          copy_16(to, keys + (key_at[k] + first_dim) * kElementBytes);
        } else {
          stage_piece_slowly<kType>(to, keys, key_at[k], first_dim, dim);
        }
      }
    }
    copy_commit();  // one group per step, empty past the last tile: the wait below counts steps
    if (++copy_round == rounds) {
      copy_round = 0;
      if (++copy_half == kHalves) {
        copy_half = 0;
        copy_tile += gridDim.x;
      }
    }
  };

#pragma unroll
  for (int stage = 0; stage < kMmaStages - 1; ++stage) issue(ring[stage]);
  int32_t compute_stage = 0, copy_stage = kMmaStages - 1;
  for (int32_t tile = blockIdx.x; tile < tiles; tile += gridDim.x) {
    double acc[kWarpGroups][2];
#pragma unroll
    for (int g = 0; g < kWarpGroups; ++g) acc[g][0] = acc[g][1] = 0.0;
#pragma unroll
    for (int half = 0; half < kHalves; ++half) {
#pragma unroll
      for (int p = 0; p < kMaxRounds; ++p) {
        if (p >= rounds) break;
        copy_wait<kMmaStages - 2>();  // this thread's copies of this step have landed ...
        __syncthreads();              // ... and everyone's; every thread is done with the stage refilled next
        issue(ring[copy_stage]);
        copy_stage = copy_stage + 1 == kMmaStages ? 0 : copy_stage + 1;
        const unsigned char* stage = ring[compute_stage];
        compute_stage = compute_stage + 1 == kMmaStages ? 0 : compute_stage + 1;
        uint4 pieces[kHalfGroups];
#pragma unroll
        for (int j = 0; j < kHalfGroups; ++j) {
          const int row = warp * kHalfCandidates + j * kMmaM + r;
          pieces[j] = *reinterpret_cast<const uint4*>(stage + row * kRoundBytes + c * kPieceBytes);
        }
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
        // m16n8k16: rows r and r + 8 of a 16-candidate pair of groups are pieces 2j and 2j + 1; k-slot c + 4v of
        // MMA i is element 4i + v of lane c's piece (the dims qf holds for that lane).
        double low[kHalfGroups / 2][kPerPiece], high[kHalfGroups / 2][kPerPiece];
#pragma unroll
        for (int j = 0; j < kHalfGroups / 2; ++j) {
          widen_piece<kType>(pieces[2 * j], low[j]);
          widen_piece<kType>(pieces[2 * j + 1], high[j]);
        }
#pragma unroll
        for (int i = 0; i < kPerPiece / kMmaK; ++i) {
          const double b_frag[4] = {qf[p * kPerPiece + 4 * i], qf[p * kPerPiece + 4 * i + 1],
                                    qf[p * kPerPiece + 4 * i + 2], qf[p * kPerPiece + 4 * i + 3]};
#pragma unroll
          for (int j = 0; j < kHalfGroups / 2; ++j) {
            const double a_frag[8] = {low[j][4 * i],     high[j][4 * i],     low[j][4 * i + 1], high[j][4 * i + 1],
                                      low[j][4 * i + 2], high[j][4 * i + 2], low[j][4 * i + 3], high[j][4 * i + 3]};
            dmma_16x8x16(acc[half * kHalfGroups + 2 * j], acc[half * kHalfGroups + 2 * j + 1], a_frag, b_frag);
          }
        }
#else
#pragma unroll
        for (int w = 0; w < 4; ++w) {
#pragma unroll
          for (int j = 0; j < kHalfGroups; ++j) {
            const uint32_t word = w == 0 ? pieces[j].x : w == 1 ? pieces[j].y : w == 2 ? pieces[j].z : pieces[j].w;
            double (&into)[2] = acc[half * kHalfGroups + j];
            if (kElementBytes == 4) {
              dmma(into, widen_f32(word), qf[p * kPerPiece + w]);
            } else {
              double low, high;
              widen_pair<kType>(word, low, high);
              dmma(into, low, qf[p * kPerPiece + 2 * w]);
              dmma(into, high, qf[p * kPerPiece + 2 * w + 1]);
            }
          }
        }
#endif
      }
    }

    // Softmax statistics of the tile per head. Lane (r, c) holds candidates first + 8g and heads 2c, 2c + 1.
    const int32_t first = tile * kScoreTile + warp * kWarpCandidates + r;
    double m[2] = {-INFINITY, -INFINITY};
#pragma unroll
    for (int g = 0; g < kWarpGroups; ++g) {
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        acc[g][e] *= sp.score_scale;
        if (first + g * kMmaM < info.candidates) m[e] = fmax(m[e], acc[g][e]);
      }
    }
#pragma unroll
    for (int e = 0; e < 2; ++e) {
#pragma unroll
      for (int offset = 4; offset < kWarpLanes; offset *= 2) m[e] = fmax(m[e], warp_shfl_xor(m[e], offset));
      if (r == 0) warp_max[warp][2 * c + e] = m[e];
    }
    __syncthreads();
    // exp(s - tile max) to scratch and its sums. With at most 4 heads in the chunk (a group of 4) lanes c >= 2 hold
    // no head; instead of idling through the exponentials they take the odd groups of lane c - 2 (a shuffle), so
    // every lane computes 8 of them instead of half the lanes 16.
    const bool fold = heads <= kMmaHeads / 2;
    const int pair = fold ? (c & 1) : c;  // this lane finishes heads 2·pair, 2·pair + 1
    const bool pair_ok[2] = {2 * pair < heads, 2 * pair + 1 < heads};
    double sum[2] = {0.0, 0.0};
#pragma unroll
    for (int e = 0; e < 2; ++e) {
      m[e] = warp_max[0][2 * pair + e];
#pragma unroll
      for (int w = 1; w < kMmaWarps; ++w) m[e] = fmax(m[e], warp_max[w][2 * pair + e]);
    }
    auto finish = [&](double score, int g, int e) {  // candidate group g, head 2·pair + e
      const int32_t candidate = first + g * kMmaM;
      if (candidate >= info.candidates) return;
      const double value = exp(score - m[e]);
      sp.scores[(row0 + 2 * pair + e) * sp.score_stride + candidate] = value;
      sum[e] += value;
    };
    if (fold) {
#pragma unroll
      for (int g = 0; g < kWarpGroups; g += 2) {
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          const double odd = warp_shfl_xor(acc[g + 1][e], 2);  // lane c ^ 2's group g + 1
          if (pair_ok[e]) finish(c < 2 ? acc[g][e] : odd, c < 2 ? g : g + 1, e);
        }
      }
    } else {
#pragma unroll
      for (int g = 0; g < kWarpGroups; ++g) {
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          if (pair_ok[e]) finish(acc[g][e], g, e);
        }
      }
    }
    const bool sum_writer = r == 0 && (!fold || c < 2);
#pragma unroll
    for (int e = 0; e < 2; ++e) {
      if (fold) sum[e] += warp_shfl_xor(sum[e], 2);
#pragma unroll
      for (int offset = 4; offset < kWarpLanes; offset *= 2) sum[e] += warp_shfl_xor(sum[e], offset);
      if (sum_writer) warp_sum[warp][2 * pair + e] = sum[e];
    }
    __syncthreads();  // the next writes of warp_max / warp_sum follow at least one more ring barrier
    if (warp == 0 && sum_writer) {
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        if (!pair_ok[e]) continue;
        double total = warp_sum[0][2 * pair + e];
#pragma unroll
        for (int w = 1; w < kMmaWarps; ++w) total += warp_sum[w][2 * pair + e];
        sp.tile_max[(row0 + 2 * pair + e) * sp.tiles + tile] = m[e];
        sp.tile_sum[(row0 + 2 * pair + e) * sp.tiles + tile] = total;
      }
    }
  }
  copy_wait<0>();  // the groups still open are empty; no copy outlives the block
#endif
}
#endif  // SPARSA_GPU_HAS_MMA_SYNC

// ---- The fp32 score kernel (fp16/bf16 keys; §0 "Precision of selections") ----
// Reading K once is the floor of a miss: the float64 kernels above stay compute-bound over it (widening, DMMA), while
// fp32 FMAs on the CUDA cores leave the load pipe the limit. A key row is read by kLanesPerKey lanes, 16 bytes
// (8 elements) each, straight from global memory into registers (the next step's rows load while this step computes);
// each lane keeps its 8 dims of q̄ (rounded to fp32) for the chunk's kHeads heads, multiplies them in with FMAs, and
// the row's dot products are summed over its lanes with xor shuffles (reduce_heads; the tree's shape is fixed: the
// same inputs give the same bits). Each s goes to scratch (fp32) from the lane that holds it, which also keeps a
// running max and Σ exp(s - max) of its head; the grid column's last block makes m_h and Z_h of the blocks' partials
// (merge_partials_if_last), and the log vote (gpu_token_select.cu, LogVotePrologue) ranks candidates by log vote =
// log Σ_h exp(s_h - lse_h), lse_h = m_h + log Z_h: in the log domain no vote underflows fp32, however far a needle
// lifts a head's maximum.
//
// Error bound against the float64 oracle (ALGORITHMS.md §0). A score is a sum of <= 8 FMAs per lane and <= 5 tree
// additions (<= 13 roundings, u = 2^-24) of products of a key element (exact in fp32) and q̄ rounded to fp32
// (one more rounding), so for every candidate of a (sequence, head)
//     |ŝ - s| <= E = score_scale · 2^-20 · ‖q̄_h‖ · max_t ‖k_t‖        (2^-20 = 16u >= 15u/(1 - 13u)).
// m_h is a maximum of scores (off by <= E) and every exp(ŝ - m) in Z_h by a relative 2E, so lse_h is off by <= 3E plus
// roundings; each x_h = ŝ_h - lse_h by <= 4E plus roundings, and the log-sum-exp over the heads (its terms positive)
// keeps that absolute error. The roundings (fp32 subtraction and conversion of |x| <= 2·score_scale·‖q̄‖‖k‖ + log N,
// expf, the float64 running sums of Z_h, the fp32 running sum over the Hq heads) stay below E/4 + 2^-17 for
// Hq <= 128. A log vote off by δ is a vote off by a
// relative e^δ - 1, so
//     |vote - vote*| <= eps · vote*,   eps = 10E + 2^-16
// (E over the run's heads; more than twice the derivation's 4.5E + 2^-17).
// Every top-k decision whose oracle vote is farther than eps (relative) from the k-th largest agrees with the CPU;
// tests/case_table.cpp (audit_selection, over the SelectCases rows of tests/test_attention_case_tables.cpp) audits
// exactly that, with candidates on both sides of eps.
constexpr int kF32ScoreThreads = 256;
constexpr int kF32ScoreWarps = kF32ScoreThreads / kWarpLanes;
constexpr int kF32DimsPerLane = kPieceBytes / 2;  // 16-bit elements in one 16-byte load
// Key rows a lane has in flight. With a 4-head chunk, 8 rows at 2 blocks per SM keep 64 KB of K in flight per SM
// (4 rows at 3 blocks kept 48 KB, and spilled 8 bytes): 862.9 against 885.8 µs over 1M keys, the same 122 µs over
// 128K (H100, GQA 32/8, D 128), so bytes in flight are not what limits this kernel. An 8-head chunk's q̄ fills the
// registers that 8 rows would need.
constexpr int kF32SmallChunkUnroll = 8;
constexpr int kF32LargeChunkUnroll = 4;
template <int kHeads>
constexpr int kF32Unroll = kHeads <= 4 ? kF32SmallChunkUnroll : kF32LargeChunkUnroll;
constexpr int kF32MaxHeads = 8;
// Blocks per SM the register budget allows (a 4-head chunk fits 80 registers a thread, an 8-head one needs 128).
constexpr int f32_blocks_per_sm(int heads) { return heads <= 4 && kF32SmallChunkUnroll <= 4 ? 3 : 2; }
// Query heads one block scores against each key row: the group, in chunks of 4 or 8.
constexpr int32_t f32_head_chunk(int32_t group) { return group > 4 ? kF32MaxHeads : 4; }
constexpr int kF32MaxLanesPerKey = 32;  // lanes of one key row: head_dim <= 8 · 32 = 256

// Eight 16-bit elements of a 16-byte piece as fp32.
template <ElementType kType>
__device__ __forceinline__ void unpack_piece(const uint4& piece, float (&out)[kF32DimsPerLane]) {
  const uint32_t words[4] = {piece.x, piece.y, piece.z, piece.w};
#pragma unroll
  for (int w = 0; w < 4; ++w) {
    if constexpr (kType == ElementType::kBF16) {
      out[2 * w] = __uint_as_float(words[w] << 16);
      out[2 * w + 1] = __uint_as_float(words[w] & 0xffff0000u);
    } else {
      out[2 * w] = f16_bits_to_float(uint16_t(words[w] & 0xffffu));
      out[2 * w + 1] = f16_bits_to_float(uint16_t(words[w] >> 16));
    }
  }
}

// Sums v[0..kHeads) over the kLanes lanes of a key (xor partners inside the group) and leaves the total of one head
// in v[0]: each exchange step sends the half of the heads the partner keeps, so the kHeads sums cost
// kHeads - 1 + log2(kLanes / kHeads) shuffles instead of kHeads · log2(kLanes). Returns the head v[0] now holds.
template <int kHeads, int kLanes>
__device__ __forceinline__ int reduce_heads(float (&v)[kHeads], int lane_in_key) {
  int head = 0;
#pragma unroll
  for (int offset = kLanes / 2, count = kHeads; offset > 0; offset /= 2) {
    if (count > 1) {
      const int half = count / 2;
      const bool upper = (lane_in_key & offset) != 0;
#pragma unroll
      for (int i = 0; i < kHeads / 2; ++i) {
        if (i >= half) break;
        const float keep = upper ? v[half + i] : v[i];
        const float send = upper ? v[i] : v[half + i];
        v[i] = keep + warp_shfl_xor(send, offset);
      }
      head += upper ? half : 0;
      count = half;
    } else {
      v[0] += warp_shfl_xor(v[0], offset);
    }
  }
  return head;
}

// Block (x, y = kv head · head chunk, b) walks candidate tiles x, x + gridDim.x, ... (as score_kernel). The block's
// steps (kKeysPerStep keys each) run as one sequence across its tiles, and the next step's rows are loaded before this
// one is computed, so loads stay in flight through the arithmetic. Each score goes straight from the lane that holds
// it to scratch; that lane also keeps a running softmax max and sum of its head, so the block writes one (max, Σexp)
// partial per head at its end (slot blockIdx.x of tile_max / tile_sum) and needs no barrier before then.
template <ElementType kType, int kLanesPerKey, int kHeads>
__global__ void __launch_bounds__(kF32ScoreThreads, f32_blocks_per_sm(kHeads)) score_f32_kernel(const SelectParams sp) {
  static_assert(kHeads <= kLanesPerKey, "every head ends in at least one lane of a key");
  wait_for_previous_kernel();  // prepare_kernel's q̄ and lookup (gpu_token_select.cu)
  constexpr int kKeysPerWarp = kWarpLanes / kLanesPerKey;
  constexpr int kUnroll = kF32Unroll<kHeads>;
  constexpr int kKeysPerStep = kF32ScoreWarps * kKeysPerWarp * kUnroll;
  constexpr int kStepsPerTile = kScoreTile / kKeysPerStep;
  constexpr int kLanesPerHead = kLanesPerKey / kHeads;  // lanes that end with the same head's total
  constexpr int kHolders = kF32ScoreWarps * kKeysPerWarp;  // lanes per block that keep statistics of one head
  static_assert(kScoreTile % kKeysPerStep == 0, "a tile is whole steps");
  __shared__ float holder_max[kHeads][kHolders];
  __shared__ double holder_sum[kHeads][kHolders];

  const ScoreBlock block = score_block<kHeads>(sp);
  if (!block.active) return;
  const int32_t b = block.b, head0 = block.head0, heads = block.heads, tiles = block.tiles;
  const SequenceInfo info = block.info;
  const SequenceView s = make_sequence_view(sp.p, b, head0);
  const int32_t dim = sp.p.head_dim;
  const int64_t row0 = int64_t(b) * sp.p.num_q_heads + head0;
  const int warp = threadIdx.x / kWarpLanes, lane = threadIdx.x % kWarpLanes;
  const int slice = lane % kLanesPerKey;  // this lane's 8 dims: [8·slice, 8·slice + 8)
  const int first_dim = slice * kF32DimsPerLane;
  const bool lane_has_dims = first_dim < dim;  // head_dim is a multiple of 8 on this path
  const int key_in_warp = lane / kLanesPerKey;

  float qf[kHeads][kF32DimsPerLane];
#pragma unroll
  for (int j = 0; j < kHeads; ++j) {
#pragma unroll
    for (int e = 0; e < kF32DimsPerLane; ++e) {
      const int32_t d = first_dim + e;
      qf[j][e] = j < heads && d < dim ? float(sp.qbar[(row0 + j) * dim + d]) : 0.0f;
    }
  }
  const uint4* keys = static_cast<const uint4*>(sp.p.k);  // 16-byte aligned rows (the path's precondition)
  const float scale = float(sp.score_scale);
  const int32_t my_tiles = (tiles - int32_t(blockIdx.x) + int32_t(gridDim.x) - 1) / int32_t(gridDim.x);
  const int32_t steps = my_tiles * kStepsPerTile;
  // Candidate of key u of step `it` for this lane.
  auto candidate = [&](int32_t it, int u) {
    const int32_t tile = int32_t(blockIdx.x) + (it / kStepsPerTile) * int32_t(gridDim.x);
    return tile * kScoreTile + (it % kStepsPerTile) * kKeysPerStep + (warp * kUnroll + u) * kKeysPerWarp + key_in_warp;
  };
  auto load_step = [&](int32_t it, uint4 (&pieces)[kUnroll]) {
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int32_t c = candidate(it, u);
      pieces[u] = make_uint4(0, 0, 0, 0);
      if (c < info.candidates && lane_has_dims) {
        const int64_t at = key_row_offset(sp.p, sp.p.k_strides, s, sp.n_init + c) + first_dim;
        pieces[u] = __ldg(keys + at / kF32DimsPerLane);
      }
    }
  };

  const bool holder = slice % kLanesPerHead == 0;  // one lane per (key, head) keeps the head's statistics
  float run_max = -INFINITY;
  double run_sum = 0.0;  // float64: a lane adds up to thousands of terms, which fp32 would round off by ~n·2^-24
  int head = 0;
  uint4 current[kUnroll], next[kUnroll];
  load_step(0, current);
  for (int32_t it = 0; it < steps; ++it) {
    if (it + 1 < steps) load_step(it + 1, next);
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      float k[kF32DimsPerLane];
      unpack_piece<kType>(current[u], k);
      float dot[kHeads];
#pragma unroll
      for (int j = 0; j < kHeads; ++j) {
        float acc = 0.0f;
#pragma unroll
        for (int e = 0; e < kF32DimsPerLane; ++e) acc = fmaf(qf[j][e], k[e], acc);
        dot[j] = acc;
      }
      head = reduce_heads<kHeads, kLanesPerKey>(dot, slice);
      const int32_t c = candidate(it, u);
      if (holder && head < heads && c < info.candidates) {
        const float score = dot[0] * scale;
        sp.scores32[(row0 + head) * sp.score_stride + c] = score;
        if (score > run_max) {
          run_sum = run_sum * double(expf(run_max - score)) + 1.0;
          run_max = score;
        } else {
          run_sum += double(expf(score - run_max));
        }
      }
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) current[u] = next[u];
  }

  // The block's partial per head: the holders' (max, sum) pairs combined in a fixed order.
  if (holder) {
    holder_max[head][warp * kKeysPerWarp + key_in_warp] = run_max;
    holder_sum[head][warp * kKeysPerWarp + key_in_warp] = run_sum;
  }
  __syncthreads();
  if (int32_t(threadIdx.x) < heads) {
    const int j = threadIdx.x;
    write_block_partial(sp, row0, j, holder_max[j], holder_sum[j], kHolders);
  }
  merge_partials_if_last(sp, block, row0);
}

template <ElementType kType, int kLanesPerKey>
void launch_score_f32_lanes(const SelectParams& sp, dim3 grid, int32_t head_chunk, cudaStream_t stream) {
  if (head_chunk < kF32MaxHeads) {
    check(launch_overlapping(sp.p.overlap_launches, score_f32_kernel<kType, kLanesPerKey, 4>, grid,
                             dim3(kF32ScoreThreads), stream, sp),
          "token_select score_f32_kernel launch");
  } else {
    check(launch_overlapping(sp.p.overlap_launches, score_f32_kernel<kType, kLanesPerKey, kF32MaxHeads>, grid,
                             dim3(kF32ScoreThreads), stream, sp),
          "token_select score_f32_kernel launch");
  }
}

template <ElementType kType>
void launch_score_f32(const SelectParams& sp, dim3 grid, int32_t head_chunk, cudaStream_t stream) {
  const int32_t lanes = (sp.p.head_dim + kF32DimsPerLane - 1) / kF32DimsPerLane;
  if (lanes <= 8) {
    launch_score_f32_lanes<kType, 8>(sp, grid, head_chunk, stream);
  } else if (lanes <= 16) {
    launch_score_f32_lanes<kType, 16>(sp, grid, head_chunk, stream);
  } else {
    launch_score_f32_lanes<kType, kF32MaxLanesPerKey>(sp, grid, head_chunk, stream);
  }
}

template <int kHeads>
void launch_score(const SelectParams& sp, dim3 grid, cudaStream_t stream) {
  switch (sp.p.element_type) {
    case ElementType::kF32:
      score_kernel<ElementType::kF32, kHeads><<<grid, kScoreThreads, 0, stream>>>(sp);
      break;
    case ElementType::kF16:
      score_kernel<ElementType::kF16, kHeads><<<grid, kScoreThreads, 0, stream>>>(sp);
      break;
    default:
      score_kernel<ElementType::kBF16, kHeads><<<grid, kScoreThreads, 0, stream>>>(sp);
      break;
  }
  check(cudaGetLastError(), "token_select score_kernel launch");
}

#if SPARSA_GPU_HAS_MMA_SYNC
void launch_score_mma(const SelectParams& sp, dim3 grid, cudaStream_t stream) {
  switch (sp.p.element_type) {
    case ElementType::kF32:
      score_mma_kernel<ElementType::kF32><<<grid, kMmaThreads, 0, stream>>>(sp);
      break;
    case ElementType::kF16:
      score_mma_kernel<ElementType::kF16><<<grid, kMmaThreads, 0, stream>>>(sp);
      break;
    default:
      score_mma_kernel<ElementType::kBF16><<<grid, kMmaThreads, 0, stream>>>(sp);
      break;
  }
  check(cudaGetLastError(), "token_select score_mma_kernel launch");
}
#endif

// True when the tensor-core score kernel serves this run: Hopper or newer, q̄ fragments that fit the registers, and
// groups large enough that an 8-head MMA is at least half useful. Measured on an H200 (1M keys, GQA 32/8, D 128):
// m16n8k16 0.85 ms against 0.95 ms for score_kernel, but m8n8k4 1.24 ms; so sm_80 keeps score_kernel (m8n8k4 stays
// in score_mma_kernel only for code that was not compiled for sm_90, e.g. compute_80 PTX run on a Hopper GPU).
bool scores_on_tensor_cores(const GpuDevice& device, const AttentionProblem& problem) {
#if SPARSA_GPU_HAS_MMA_SYNC
  constexpr int32_t kHopperMajor = 9;
  const int32_t group = problem.num_q_heads / std::max(problem.num_kv_heads, 1);
  return device.compute_major >= kHopperMajor && problem.head_dim <= kMmaMaxHeadDim && group >= kMmaMinGroup;
#else
  (void)device;
  (void)problem;
  return false;
#endif
}

}  // namespace

int32_t stat_partials(const GpuDevice& device, const AttentionProblem& problem, const SelectParams& sp) {
  const int32_t head_chunk = f32_head_chunk(sp.p.group_size);
  const int64_t score_y = int64_t(problem.num_kv_heads) * ((sp.p.group_size + head_chunk - 1) / head_chunk);
  const int32_t blocks_per_sm =
      scores_on_fp32_tensor_cores(device, problem) ? tc_score_blocks_per_sm() : f32_blocks_per_sm(head_chunk);
  return int32_t(tile_blocks(device, sp.tiles, score_y * problem.batch, blocks_per_sm));
}

bool scores_in_fp32(const AttentionProblem& problem, const ForwardParams& p) {
  return p.element_type != ElementType::kF32 && p.kv_rows_aligned16 && problem.head_dim % kF32DimsPerLane == 0 &&
         problem.head_dim <= kF32DimsPerLane * kF32MaxLanesPerKey;
}

void launch_scores(const GpuDevice& device, const AttentionProblem& problem, const SelectParams& sp, int32_t tiles,
                   int64_t batch) {
  const cudaStream_t stream = device.stream;
  constexpr int kSmallHeadChunk = 4, kLargeHeadChunk = 8;
  const int32_t group = sp.p.group_size;
  if (sp.scores32 != nullptr) {
    const int32_t head_chunk = f32_head_chunk(group);
    const int64_t score_y = int64_t(problem.num_kv_heads) * ((group + head_chunk - 1) / head_chunk);
    const dim3 grid(unsigned(sp.stat_partials), unsigned(score_y), unsigned(batch));
    if (scores_on_fp32_tensor_cores(device, problem)) {
      launch_score_tc(sp, grid, head_chunk, stream);
    } else if (sp.p.element_type == ElementType::kF16) {
      launch_score_f32<ElementType::kF16>(sp, grid, head_chunk, stream);
    } else {
      launch_score_f32<ElementType::kBF16>(sp, grid, head_chunk, stream);
    }
    return;
  }
  const bool mma = scores_on_tensor_cores(device, problem);
  const int32_t head_chunk = mma || group > kSmallHeadChunk ? kLargeHeadChunk : kSmallHeadChunk;
  const int64_t score_y = int64_t(problem.num_kv_heads) * ((group + head_chunk - 1) / head_chunk);
  const int32_t blocks_per_sm = mma ? kMmaBlocksPerSm : kScoreBlocksPerSm;
  const dim3 score_grid(tile_blocks(device, tiles, score_y * batch, blocks_per_sm), unsigned(score_y),
                        unsigned(batch));
  if (mma) {
#if SPARSA_GPU_HAS_MMA_SYNC
    launch_score_mma(sp, score_grid, stream);
#endif
  } else if (head_chunk == kSmallHeadChunk) {
    launch_score<kSmallHeadChunk>(sp, score_grid, stream);
  } else {
    launch_score<kLargeHeadChunk>(sp, score_grid, stream);
  }
}

}  // namespace token_select
SPARSA_GPU_NAMESPACE_END
