// TOKEN_SELECT's device state, shared by its files: gpu_token_select.cu (prepare, cache lookup, merge, vote, lists
// and the run; its file comment describes the whole chain), token_select_score.cu (the fp32 FMA and float64 score
// kernels, and the choice among them) and token_select_score_tc.cu (fp32 scores on the tensor cores). Parameters,
// launch constants and the device helpers they use.
#pragma once

#include <algorithm>
#include <cstdint>

#include "../engine/forward_common.cuh"
#include "../kernels/token_indices.h"
#include "../runtime/gpu_policies.h"

SPARSA_GPU_NAMESPACE_BEGIN
namespace token_select {

constexpr int kPrepareThreads = 128;
constexpr int kReduceThreads = 1024;  // merge: one block per head, few loads per thread
constexpr int kScoreThreads = 128;
constexpr int kScoreTile = 2 * kScoreThreads;  // candidates per score/vote tile: two rows per score thread
constexpr int kPieceBytes = 16;                // one vector load / one cp.async
constexpr int kChunkBytes = 32;                // bytes of each key row per pipeline stage: one whole DRAM sector
constexpr int kPiecesPerRow = kChunkBytes / kPieceBytes;
constexpr int kRowsPerCopyPass = kScoreThreads / kPiecesPerRow;
constexpr int kCopyPasses = kScoreTile / kRowsPerCopyPass;  // 16-byte copies per thread per stage
constexpr int kStageBytes = kScoreTile * kChunkBytes;
constexpr int kMaxHeadDim = 256;
constexpr int kVoteHeadsPerPass = 64;
constexpr int kListThreads = 1024;    // one block per key list: few entries per thread (decode hit path)
constexpr int kScoreBlocksPerSm = 4;  // score/vote grids: blocks walking tiles in a loop, all resident at once (no tail wave)
constexpr uint64_t kMaxScoreBytes = uint64_t(16) << 30;
// Powers of two that undo the bit placement of widen_*(): exact, see the file comment.
constexpr double kF16Rescale = 0x1p1008;
constexpr double kWideRescale = 0x1p896;  // bf16 and f32

enum SequenceMode : int32_t { kNoRows = 0, kDense = 1, kSelects = 2 };
// A slot's fields. kSlotArrivals counts the prepare blocks of the current run that finished their lookup share;
// kSlotQbarCopy says which of the slot's two q̄ copies is the cached one (the run writes its q̄ into the other, and
// a miss makes that one current: no copy after the decision).
enum CacheSlotField : int32_t {
  kSlotFilled = 0,
  kSlotQbarLength = 1,
  kSlotSets = 2,
  kSlotTopK = 3,
  kSlotArrivals = 4,
  kSlotQbarCopy = 5,
  kSlotFields = 6
};
constexpr int kLookupSums = 4;  // per head: q̄·cached, |q̄|², |cached|², cached ids outside the candidates

struct SequenceInfo {
  int32_t mode = kNoRows;
  int32_t candidates = 0;  // |C| when the sequence selects
};

// The selection cache's device memory as the kernels see it (null slots = no cache consulted this run).
struct CacheView {
  int32_t* slots = nullptr;                // [max_batch, kSlotFields]
  unsigned long long* totals = nullptr;    // hits, misses since creation or reset
  double* qbars = nullptr;                 // [max_batch, 2, qbar_capacity]: the cached q̄ and the next one
  int32_t* selections = nullptr;           // [max_batch, selection_capacity]
  int64_t qbar_capacity = 0, selection_capacity = 0;
};

struct SelectParams {
  ForwardParams p;
  IndexSetParams ix;  // key lists (written by the list kernel), selected_indices
  StatsParams stats;
  CacheView cache;
  int32_t n_init = 0, n_local = 0, top_k = 0;
  int32_t n_sets = 1, heads_per_set = 1;
  double score_scale = 1.0;
  double cache_theta = 1.0;
  // Scratch.
  SequenceInfo* sequences = nullptr;  // [B]
  int32_t* segment_lengths = nullptr;  // [B * n_sets]: |C| per top-k segment
  int32_t* skip = nullptr;             // [B]: nothing to select (no rows, dense or a cache hit)
  double* qbar = nullptr;              // [B, Hq, D]
  double* lookup_partials = nullptr;   // [B, Hq, kLookupSums]: each head's share of the cache lookup
  double* tile_max = nullptr;          // [B, Hq, tiles]: per tile (float64 scoring) or per score block (fp32)
  double* tile_sum = nullptr;
  unsigned int* merge_arrivals = nullptr;  // [B, Hq]: fp32 scoring, score blocks of a grid column done (prepare zeroes)
  double* head_max = nullptr;          // [B, Hq]
  double* head_sum = nullptr;
  double* scores = nullptr;            // [B, Hq, score_stride]: exp(s - tile max) (float64 scoring)
  float* scores32 = nullptr;           // fp32 scoring: s itself; exactly one of scores / scores32 is set
  double* votes = nullptr;             // [B * n_sets, score_stride] (float64 scoring)
  float* log_votes = nullptr;          // [B * n_sets, score_stride]: log of the vote (fp32 scoring)
  int32_t tiles = 0;                   // tiles per score row
  int32_t stat_partials = 0;           // fp32 scoring: (max, sum) partials per head (one per score block along x)
  int64_t score_stride = 0;
  int32_t* selections = nullptr;       // T of (b, set) at b * selection_stride + set * top_k (token ids)
  int64_t selection_stride = 0;
};

// ---- Device helpers ----

// Reduces v[0..kN) over the block (max or sum) into result[0..kN) (shared), in a fixed order. Every thread calls it.
template <int kN, bool kMax>
__device__ void block_reduce(double (&v)[kN], double* scratch, double* result) {
  const int warps = blockDim.x / kWarpLanes, warp = threadIdx.x / kWarpLanes, lane = threadIdx.x % kWarpLanes;
#pragma unroll
  for (int offset = kWarpLanes / 2; offset > 0; offset /= 2) {
#pragma unroll
    for (int j = 0; j < kN; ++j) {
      const double other = warp_shfl_xor(v[j], offset);
      v[j] = kMax ? fmax(v[j], other) : v[j] + other;
    }
  }
  if (lane == 0) {
#pragma unroll
    for (int j = 0; j < kN; ++j) scratch[warp * kN + j] = v[j];
  }
  __syncthreads();
  if (threadIdx.x < kN) {
    double r = scratch[threadIdx.x];
    for (int w = 1; w < warps; ++w) r = kMax ? fmax(r, scratch[w * kN + threadIdx.x]) : r + scratch[w * kN + threadIdx.x];
    result[threadIdx.x] = r;
  }
  __syncthreads();
}

// Key elements as the exactly scaled doubles of the file comment. An f32 word holds one element; a 16-bit word pair
// two (low half first): the 5- or 8-bit exponent's lowest bit lands on bit 20 of the high word, the sign on bit 31.
__device__ __forceinline__ double widen_f32(uint32_t w) {
  return __hiloint2double(int(((w & 0x7fffffffu) >> 3) | (w & 0x80000000u)), int(w << 29));
}
// An arithmetic shift moves the 15 magnitude bits into place and copies the sign over the bits above them; the
// mask keeps the magnitude and bit 31 (same bits as shifting magnitude and sign separately, in fewer instructions).
template <ElementType kType>
__device__ __forceinline__ void widen_pair(uint32_t w, double& low, double& high) {
  constexpr int kShift = kType == ElementType::kF16 ? 10 : 13;
  constexpr int kDown = 16 - kShift;
  constexpr uint32_t kKeep = (0x7fffu << kShift) | 0x80000000u;
  low = __hiloint2double(int(uint32_t(int(w << 16) >> kDown) & kKeep), 0);
  high = __hiloint2double(int(uint32_t(int(w) >> kDown) & kKeep), 0);
}

// 16-byte asynchronous global -> shared copies (sm_80+); elsewhere a plain load and store (visible after the
// __syncthreads that follows either way), with commit and wait doing nothing.
__device__ __forceinline__ void copy_16(void* dst, const void* src) {
#if SPARSA_GPU_DEVICE_HAS_MMA_SYNC
  const uint32_t to = static_cast<uint32_t>(__cvta_generic_to_shared(dst));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(to), "l"(src));
#else
  *static_cast<uint4*>(dst) = *static_cast<const uint4*>(src);
#endif
}
__device__ __forceinline__ void copy_commit() {
#if SPARSA_GPU_DEVICE_HAS_MMA_SYNC
  asm volatile("cp.async.commit_group;\n" ::);
#endif
}
template <int kPending>
__device__ __forceinline__ void copy_wait() {
#if SPARSA_GPU_DEVICE_HAS_MMA_SYNC
  asm volatile("cp.async.wait_group %0;\n" ::"n"(kPending));
#endif
}

// Where piece p of staged row r lies in a stage: rows of kChunkBytes, the two pieces swapped in every other group of
// 4 rows, so that 8 threads reading the same piece of 8 consecutive rows hit 8 different 16-byte bank groups.
__device__ __forceinline__ int staged_offset(int row, int piece) {
  return row * kChunkBytes + ((piece ^ (row >> 2)) & (kPiecesPerRow - 1)) * kPieceBytes;
}

// acc[r][j] += q̄'[d][j] · k_r[d] for the two dims of `pair` (q̄' rows d, d + 1 at `q`, kHeads doubles each).
template <int kHeads>
__device__ __forceinline__ void accumulate(const double* q, double k0, double k1, double (&acc)[2][kHeads]) {
  const double2* pairs = reinterpret_cast<const double2*>(q);
#pragma unroll
  for (int j = 0; j < kHeads; j += 2) {
    const double2 qj = pairs[j / 2];
    acc[0][j] = fma(qj.x, k0, acc[0][j]);
    acc[1][j] = fma(qj.x, k1, acc[1][j]);
    acc[0][j + 1] = fma(qj.y, k0, acc[0][j + 1]);
    acc[1][j + 1] = fma(qj.y, k1, acc[1][j + 1]);
  }
}

// The work of a score block: sequence b = blockIdx.z, query heads [head0, head0 + heads) (blockIdx.y = kv head ·
// chunk of kHeads), candidate tiles blockIdx.x, blockIdx.x + gridDim.x, ... of `tiles`. Inactive: the sequence does
// not select, hit the cache, or has no tile for this block.
struct ScoreBlock {
  int32_t b = 0, head0 = 0, heads = 0, tiles = 0;
  SequenceInfo info;
  bool active = false;
};

template <int kHeads>
__device__ __forceinline__ ScoreBlock score_block(const SelectParams& sp) {
  ScoreBlock block;
  block.b = blockIdx.z;
  block.info = sp.sequences[block.b];
  const int32_t group = sp.p.group_size, chunks_per_group = (group + kHeads - 1) / kHeads;
  const int32_t kv_head = blockIdx.y / chunks_per_group;
  block.head0 = kv_head * group + (blockIdx.y % chunks_per_group) * kHeads;
  block.heads = min(kHeads, (kv_head + 1) * group - block.head0);
  block.tiles = (block.info.candidates + kScoreTile - 1) / kScoreTile;
  block.active = block.info.mode == kSelects && sp.skip[block.b] == 0 && int32_t(blockIdx.x) < block.tiles;
  return block;
}

// fp32 scoring's block partial of head row0 + j (slot blockIdx.x of tile_max / tile_sum): the running (max, Σ exp)
// pairs its `holders` lanes kept, combined in a fixed order. Called after a barrier, by thread j < heads.
__device__ __forceinline__ void write_block_partial(const SelectParams& sp, int64_t row0, int j, const float* holder_max,
                                                    const double* holder_sum, int holders) {
  float m = -INFINITY;
  for (int i = 0; i < holders; ++i) m = fmaxf(m, holder_max[i]);
  double total = 0.0;
  for (int i = 0; i < holders; ++i) {
    if (holder_sum[i] > 0.0) total += holder_sum[i] * exp(double(holder_max[i]) - double(m));
  }
  sp.tile_max[(row0 + j) * sp.tiles + blockIdx.x] = m;
  sp.tile_sum[(row0 + j) * sp.tiles + blockIdx.x] = total;
}

// fp32 scoring, called by every thread of an active score block after its partials are written: the last active
// block of the grid's (y, b) column merges all of the column's partials of its heads into m_h = max and
// Z_h = Σ sum · exp(max - m_h) (head_max / head_sum), one warp per head in a fixed order. The float64 path's
// merge_kernel does the same in a launch of its own, which would wait for the whole grid.
__device__ __forceinline__ void merge_partials_if_last(const SelectParams& sp, const ScoreBlock& block, int64_t row0) {
  __shared__ int32_t is_last;
  const int32_t partials = min(int32_t(gridDim.x), block.tiles);  // the column's active blocks, one partial each
  __threadfence();  // this thread's partial writes are visible before the block's arrival
  __syncthreads();
  if (threadIdx.x == 0) {
    unsigned int* arrivals = sp.merge_arrivals + int64_t(block.b) * sp.p.num_q_heads + blockIdx.y;
    is_last = atomicAdd(arrivals, 1u) == unsigned(partials - 1);
  }
  __syncthreads();
  if (!is_last) return;
  __threadfence();
  const int warps = blockDim.x / kWarpLanes, warp = threadIdx.x / kWarpLanes, lane = threadIdx.x % kWarpLanes;
  for (int j = warp; j < block.heads; j += warps) {
    const double* maxima = sp.tile_max + (row0 + j) * sp.tiles;
    const double* sums = sp.tile_sum + (row0 + j) * sp.tiles;
    double m = -INFINITY;
    for (int32_t t = lane; t < partials; t += kWarpLanes) m = fmax(m, load_written_by_other_blocks(maxima + t));
    for (int offset = kWarpLanes / 2; offset > 0; offset /= 2) m = fmax(m, warp_shfl_xor(m, offset));
    double z = 0.0;
    for (int32_t t = lane; t < partials; t += kWarpLanes) {
      z += load_written_by_other_blocks(sums + t) * exp(load_written_by_other_blocks(maxima + t) - m);
    }
    for (int offset = kWarpLanes / 2; offset > 0; offset /= 2) z += warp_shfl_xor(z, offset);
    if (lane == 0) {
      sp.head_max[row0 + j] = m;
      sp.head_sum[row0 + j] = z;
    }
  }
}

__device__ __forceinline__ int32_t* selection_of(const SelectParams& sp, int32_t b, int32_t set) {
  return sp.selections + b * sp.selection_stride + int64_t(set) * sp.top_k;
}


// Blocks of a tile-walking grid: enough to keep every SM busy, no more (an early-exiting grid stays cheap).
inline unsigned tile_blocks(const GpuDevice& device, int32_t tiles, int64_t other_blocks,
                     int32_t blocks_per_sm = kScoreBlocksPerSm) {
  const int64_t target = int64_t(device.multiprocessors) * blocks_per_sm / std::max<int64_t>(other_blocks, 1);
  return unsigned(std::max<int64_t>(1, std::min<int64_t>(tiles, target)));
}


// Whether a run scores in fp32 (score_f32_kernel: fp16/bf16 keys, 16-byte aligned rows, head_dim a multiple of 8 up
// to 256) rather than float64; plan and run carve scores32 or scores by it.
bool scores_in_fp32(const AttentionProblem& problem, const ForwardParams& p);
// fp32 scoring: the score kernel's blocks along the candidates, each writing one (max, sum) partial per head.
int32_t stat_partials(const GpuDevice& device, const AttentionProblem& problem, const SelectParams& sp);

// fp32 scoring on the tensor cores (token_select_score_tc.cu): NVIDIA sm_80+, head_dim <= 128; its blocks per SM
// (the grid of stat_partials) and its launch over (partials, kv heads · head chunks, batch).
bool scores_on_fp32_tensor_cores(const GpuDevice& device, const AttentionProblem& problem);
int32_t tc_score_blocks_per_sm();
void launch_score_tc(const SelectParams& sp, dim3 grid, int32_t head_chunk, cudaStream_t stream);

// Enqueues the score step of a run (scores, tile maxima and sums into sp's scratch): when scores_in_fp32, the fp32
// tensor-core kernel where scores_on_fp32_tensor_cores, else the fp32 FMA kernel; otherwise the float64 tensor-core
// kernel where it pays (Hopper, groups of 4 or more, head_dim <= 128), else the float64 FMA kernel.
void launch_scores(const GpuDevice& device, const AttentionProblem& problem, const SelectParams& sp, int32_t tiles,
                   int64_t batch);

}  // namespace token_select
SPARSA_GPU_NAMESPACE_END
