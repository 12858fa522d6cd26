// §6 TOKEN_SELECT on the device, mirroring cpu_token_select.cpp (the oracle): per sequence the mean query q̄_h of
// the call's rows, a dense fallback when n_init + top_k + n_local >= N, otherwise float64 scores
// s[h, t] = q̄_h·K[t, h/g] over the candidates C = [n_init, N - n_local), a softmax per head over C, the head soft
// vote, T = top_k of the vote (device_topk), and attention of every row and head over
// I = [0, n_init) ∪ T ∪ [N - n_local, N) (token_indices.h: index_attention_launch on prebuilt lists).
// The selection cache (§6.5) lives in device memory; hits and misses are decided on the device, so a run never
// waits for the host and can be captured in a CUDA graph.
//
// A run's launches, in stream order (nothing is decided on the host beyond the shapes):
//   prepare   (Hq × B)      per-sequence mode (no rows / dense / selects), candidate counts, q̄ (float64)
//   lookup    (B)           [cache only] cosine vs the cached concat q̄ and the cached ids' range: hit → skip flag,
//                           miss → store q̄; counts both
//   score     (tiles, Hkv·chunks, B)  float64 dot products of a 256-candidate tile for a chunk of the group's
//                           heads, the tile's softmax max/sum per head, exp(s - tile max) kept in scratch; on
//                           sm_90 with groups >= 4 and head_dim <= 128 on FP64 tensor cores (score_mma_kernel),
//                           elsewhere with FMAs (score_kernel)
//   merge     (Hq × B)      per head: max and denominator over the tiles
//   vote      (tiles, sets, B) vote[t] = Σ_h exp(s - m_h) / Z_h over the set's heads
//   device_topk             T (token ids, ascending) straight into the cache slot (or scratch); skipped on a hit
//   lists     (sets × B)    I per set, selected_indices, PAIRS_COMPUTED
//   attention               index_attention_launch over I (or the dense forward when every sequence is dense)
// Score, merge, vote and top-k exit at once for sequences that do not select or hit the cache.
//
// Float64 scores without conversion instructions: a 16-bit (or fp32) key element placed bit by bit into a
// double's exponent/mantissa fields is the element times 2^-1008 (f16) or 2^-896 (bf16, f32) exactly, subnormals
// included; q̄ is pre-multiplied by the inverse power of two (exact, and it cannot overflow: |q̄| is at most the
// type's largest finite value). Every product and FMA is therefore the one of the unscaled values. (An inf/NaN key
// element becomes a finite value: such inputs give garbage either way.) The dot products use FMA (or the tensor
// cores' float64 MMA, whose partial sums round differently again) and the sums of the softmax run in tree order, so
// votes equal the CPU's to a few ulps, not bit for bit: selections agree unless two votes at the top-k boundary are
// that close.
#include "../../src/error.h"
#include "device_topk.h"
#include "forward_common.cuh"
#include "gpu_policies.h"
#include "token_indices.h"

#include <algorithm>
#include <cmath>
#include <memory>
#include <string>

SPARSA_GPU_NAMESPACE_BEGIN
namespace {

constexpr int kPrepareThreads = 128;
constexpr int kReduceThreads = 1024;  // lookup and merge: one block per sequence or head, few loads per thread
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
enum CacheSlotField : int32_t { kSlotFilled = 0, kSlotQbarLength = 1, kSlotSets = 2, kSlotTopK = 3, kSlotFields = 4 };

struct SequenceInfo {
  int32_t mode = kNoRows;
  int32_t candidates = 0;  // |C| when the sequence selects
};

// The selection cache's device memory as the kernels see it (null slots = no cache consulted this run).
struct CacheView {
  int32_t* slots = nullptr;                // [max_batch, kSlotFields]
  unsigned long long* totals = nullptr;    // hits, misses since creation or reset
  double* qbars = nullptr;                 // [max_batch, qbar_capacity]
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
  double* tile_max = nullptr;          // [B, Hq, tiles]
  double* tile_sum = nullptr;
  double* head_max = nullptr;          // [B, Hq]
  double* head_sum = nullptr;
  double* scores = nullptr;            // [B, Hq, score_stride]: exp(s - tile max)
  double* votes = nullptr;             // [B * n_sets, score_stride]
  int32_t tiles = 0;                   // tiles per score row
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

__device__ __forceinline__ int32_t* selection_of(const SelectParams& sp, int32_t b, int32_t set) {
  return sp.selections + b * sp.selection_stride + int64_t(set) * sp.top_k;
}

// ---- Kernels ----

// Block (h, b): the sequence's mode and candidate count (h = 0), q̄_h = mean of the call's rows of head h.
__global__ void __launch_bounds__(kPrepareThreads) prepare_kernel(const SelectParams sp) {
  const int32_t h = blockIdx.x, b = blockIdx.y;
  const SequenceView s = make_sequence_view(sp.p, b, h);
  const int64_t always_kept = int64_t(sp.n_init) + sp.n_local;
  const int32_t mode = s.seq_q <= 0 ? kNoRows : (always_kept + sp.top_k >= s.seq_k ? kDense : kSelects);
  const int32_t candidates = mode == kSelects ? int32_t(s.seq_k - always_kept) : 0;
  if (h == 0) {
    if (threadIdx.x == 0) {
      sp.sequences[b] = SequenceInfo{mode, candidates};
      sp.skip[b] = mode != kSelects;
    }
    for (int32_t set = threadIdx.x; set < sp.n_sets; set += blockDim.x) sp.segment_lengths[b * sp.n_sets + set] = candidates;
  }
  if (mode != kSelects) return;
  double* qbar = sp.qbar + (int64_t(b) * sp.p.num_q_heads + h) * sp.p.head_dim;
  for (int32_t d = threadIdx.x; d < sp.p.head_dim; d += blockDim.x) {
    double sum = 0.0;
    for (int32_t i = 0; i < s.seq_q; ++i) sum += double(load_value(sp.p.q, query_row_offset(sp.p.q_strides, s, i) + d, sp.p.element_type));
    qbar[d] = sum / double(s.seq_q);
  }
}

// Block b: may the cached T of slot b be reused (§6.5, the CPU's can_reuse)? Hit: skip the selection. Miss: the
// slot takes this call's q̄ and layout now and its T from device_topk later. Counts both.
__global__ void __launch_bounds__(kReduceThreads) cache_lookup_kernel(const SelectParams sp) {
  __shared__ double scratch[3 * kReduceThreads / kWarpLanes], sums[3];
  __shared__ int32_t ids_outside;
  const int32_t b = blockIdx.x;
  const SequenceInfo info = sp.sequences[b];
  if (info.mode != kSelects) return;  // dense and empty sequences leave their slot alone and count nothing
  const SequenceView s = make_sequence_view(sp.p, b, 0);
  const int64_t qbar_len = int64_t(sp.p.num_q_heads) * sp.p.head_dim;
  int32_t* slot = sp.cache.slots + int64_t(b) * kSlotFields;
  const double* now = sp.qbar + b * qbar_len;
  double* cached = sp.cache.qbars + b * sp.cache.qbar_capacity;
  const bool same_layout = slot[kSlotFilled] != 0 && slot[kSlotQbarLength] == qbar_len &&
                           slot[kSlotSets] == sp.n_sets && slot[kSlotTopK] == sp.top_k;
  if (threadIdx.x == 0) ids_outside = 0;
  double v[3] = {0.0, 0.0, 0.0};  // q̄·cached, |q̄|², |cached|²
  if (same_layout) {
    for (int64_t i = threadIdx.x; i < qbar_len; i += blockDim.x) {
      v[0] = fma(now[i], cached[i], v[0]);
      v[1] = fma(now[i], now[i], v[1]);
      v[2] = fma(cached[i], cached[i], v[2]);
    }
  }
  __syncthreads();
  if (same_layout) {
    const int32_t* ids = sp.cache.selections + b * sp.cache.selection_capacity;
    const int64_t first = sp.n_init, last = int64_t(s.seq_k) - sp.n_local;
    for (int64_t i = threadIdx.x; i < int64_t(sp.n_sets) * sp.top_k; i += blockDim.x) {
      if (ids[i] < first || ids[i] >= last) ids_outside = 1;
    }
  }
  block_reduce<3, false>(v, scratch, sums);  // also orders ids_outside
  const bool hit = same_layout && ids_outside == 0 && sums[1] > 0.0 && sums[2] > 0.0 &&
                   sums[0] / (sqrt(sums[1]) * sqrt(sums[2])) >= sp.cache_theta;
  if (hit) {
    if (threadIdx.x == 0) {
      sp.skip[b] = 1;
      atomicAdd(&sp.cache.totals[0], 1ull);
      stats_add(sp.stats, SPARSA_STAT_CACHE_HITS, 1);
    }
    return;
  }
  for (int64_t i = threadIdx.x; i < qbar_len; i += blockDim.x) cached[i] = now[i];  // reads finished above
  if (threadIdx.x == 0) {
    slot[kSlotFilled] = 1;
    slot[kSlotQbarLength] = int32_t(qbar_len);
    slot[kSlotSets] = sp.n_sets;
    slot[kSlotTopK] = sp.top_k;
    atomicAdd(&sp.cache.totals[1], 1ull);
    stats_add(sp.stats, SPARSA_STAT_CACHE_MISSES, 1);
  }
}

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

  const int32_t b = blockIdx.z;
  const SequenceInfo info = sp.sequences[b];
  if (info.mode != kSelects || sp.skip[b] != 0) return;
  const int32_t group = sp.p.group_size, chunks_per_group = (group + kHeads - 1) / kHeads;
  const int32_t kv_head = blockIdx.y / chunks_per_group;
  const int32_t head0 = kv_head * group + (blockIdx.y % chunks_per_group) * kHeads;
  const int32_t heads = min(kHeads, (kv_head + 1) * group - head0);
  const int32_t tiles = (info.candidates + kScoreTile - 1) / kScoreTile;
  if (int32_t(blockIdx.x) >= tiles) return;
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
constexpr int kMmaBlocksPerSm = 3;  // 164 registers a thread: 3 blocks (12 warps, 72 KB of copies in flight) per SM
constexpr int kMmaMinGroup = 4;     // below this most of every MMA would multiply zeros: the FMA kernel serves it
static_assert(kMmaCopyRows == kHalfCandidates, "copy pass k stages warp k's rows of the half");
static_assert(kWarpLanes == 32 || !SPARSA_GPU_DEVICE_HAS_MMA_SYNC, "m8n8k4 fragments are laid out over 32 lanes");

#if SPARSA_GPU_HAS_MMA_SYNC
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

  const int32_t b = blockIdx.z;
  const SequenceInfo info = sp.sequences[b];
  if (info.mode != kSelects || sp.skip[b] != 0) return;
  const int32_t group = sp.p.group_size, chunks_per_group = (group + kMmaHeads - 1) / kMmaHeads;
  const int32_t kv_head = blockIdx.y / chunks_per_group;
  const int32_t head0 = kv_head * group + (blockIdx.y % chunks_per_group) * kMmaHeads;
  const int32_t heads = min(kMmaHeads, (kv_head + 1) * group - head0);
  const int32_t tiles = (info.candidates + kScoreTile - 1) / kScoreTile;
  if (int32_t(blockIdx.x) >= tiles) return;
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

// Block (h, b): m_h = max over the tiles, Z_h = Σ_tiles sum_tile · exp(max_tile - m_h).
__global__ void __launch_bounds__(kReduceThreads) merge_kernel(const SelectParams sp) {
  __shared__ double scratch[kReduceThreads / kWarpLanes], result[1];
  const int32_t h = blockIdx.x, b = blockIdx.y;
  const SequenceInfo info = sp.sequences[b];
  if (info.mode != kSelects || sp.skip[b] != 0) return;
  const int32_t tiles = (info.candidates + kScoreTile - 1) / kScoreTile;
  const int64_t row = int64_t(b) * sp.p.num_q_heads + h;
  const double* maxima = sp.tile_max + row * sp.tiles;
  const double* sums = sp.tile_sum + row * sp.tiles;
  double v[1] = {-INFINITY};
  for (int32_t t = threadIdx.x; t < tiles; t += blockDim.x) v[0] = fmax(v[0], maxima[t]);
  block_reduce<1, true>(v, scratch, result);
  const double head_max = result[0];
  v[0] = 0.0;
  for (int32_t t = threadIdx.x; t < tiles; t += blockDim.x) v[0] += sums[t] * exp(maxima[t] - head_max);
  block_reduce<1, false>(v, scratch, result);
  if (threadIdx.x == 0) {
    sp.head_max[row] = head_max;
    sp.head_sum[row] = result[0];
  }
}

// Block (x, set, b) walks candidate tiles: vote[c] = Σ over the set's heads, in head order, of
// exp(s - tile max) · exp(tile max - m_h) / Z_h.
__global__ void __launch_bounds__(kScoreTile) vote_kernel(const SelectParams sp) {
  __shared__ double factor[kVoteHeadsPerPass];
  const int32_t set = blockIdx.y, b = blockIdx.z;
  const SequenceInfo info = sp.sequences[b];
  if (info.mode != kSelects || sp.skip[b] != 0) return;
  const int32_t tiles = (info.candidates + kScoreTile - 1) / kScoreTile;
  const int64_t first_row = int64_t(b) * sp.p.num_q_heads + int64_t(set) * sp.heads_per_set;
  for (int32_t tile = blockIdx.x; tile < tiles; tile += gridDim.x) {
    const int32_t c = tile * kScoreTile + threadIdx.x;
    double vote = 0.0;
    for (int32_t h0 = 0; h0 < sp.heads_per_set; h0 += kVoteHeadsPerPass) {
      const int32_t n = min(kVoteHeadsPerPass, sp.heads_per_set - h0);
      __syncthreads();  // the previous pass's factors are read
      if (int32_t(threadIdx.x) < n) {
        const int64_t row = first_row + h0 + threadIdx.x;
        factor[threadIdx.x] = exp(sp.tile_max[row * sp.tiles + tile] - sp.head_max[row]) / sp.head_sum[row];
      }
      __syncthreads();
      if (c < info.candidates) {
        for (int32_t j = 0; j < n; ++j) vote += sp.scores[(first_row + h0 + j) * sp.score_stride + c] * factor[j];
      }
    }
    if (c < info.candidates) sp.votes[(int64_t(b) * sp.n_sets + set) * sp.score_stride + c] = vote;
  }
}

// Block (set, b): I = [0, n_init) ∪ T ∪ [N - n_local, N) (or [0, N) when dense) as the set's key list, the
// selected_indices row, and PAIRS_COMPUTED (every head of the set, every row up to its causal horizon).
__global__ void __launch_bounds__(kListThreads) list_kernel(const SelectParams sp) {
  __shared__ unsigned long long pairs_sum;
  const int32_t set = blockIdx.x, b = blockIdx.y;
  const SequenceInfo info = sp.sequences[b];
  const SequenceView s = make_sequence_view(sp.p, b, 0);
  const IndexSetParams& ix = sp.ix;
  const int32_t n = info.mode == kNoRows ? 0 : (info.mode == kDense ? s.seq_k : sp.n_init + sp.top_k + sp.n_local);
  const int64_t list_at = int64_t(b) * sp.n_sets + set;
  int32_t* list = ix.key_lists + list_at * ix.list_capacity;
  const int32_t* selection = selection_of(sp, b, set);
  int32_t* selected = ix.selected != nullptr ? ix.selected + b * ix.selected_strides[0] + set * ix.selected_strides[1]
                                             : nullptr;
  for (int32_t j = threadIdx.x; j < n; j += blockDim.x) {
    int32_t key = j;
    if (info.mode == kSelects && j >= sp.n_init) {
      key = j < sp.n_init + sp.top_k ? selection[j - sp.n_init] : s.seq_k - sp.n_local + (j - sp.n_init - sp.top_k);
    }
    list[j] = key;
    if (selected != nullptr && j < ix.selected_cap) selected[j * ix.selected_strides[2]] = key;
  }
  if (selected != nullptr) {
    for (int32_t j = n + threadIdx.x; j < ix.selected_cap; j += blockDim.x) selected[j * ix.selected_strides[2]] = -1;
  }
  if (threadIdx.x == 0) {
    ix.key_counts[list_at] = n;
    pairs_sum = 0;
  }
  if (sp.stats.out == nullptr) return;
  __syncthreads();  // the list is complete
  unsigned long long pairs = 0;
  for (int32_t i = threadIdx.x; i < s.seq_q; i += blockDim.x) pairs += keys_up_to(list, n, int64_t(i) + s.causal_offset);
  if (pairs != 0) atomicAdd(&pairs_sum, pairs);
  __syncthreads();
  if (threadIdx.x == 0) stats_add(sp.stats, SPARSA_STAT_PAIRS_COMPUTED, int64_t(pairs_sum) * sp.heads_per_set);
}

// ---- The selection cache ----

// Makes a device current for a scope (the cache's queries may come while another device is current).
class CurrentDevice {
 public:
  explicit CurrentDevice(int32_t device) {
    if (cudaGetDevice(&previous_) != cudaSuccess) previous_ = device;
    if (previous_ != device) (void)cudaSetDevice(device);
  }
  ~CurrentDevice() {
    int current = previous_;
    if (cudaGetDevice(&current) == cudaSuccess && current != previous_) (void)cudaSetDevice(previous_);
  }
  CurrentDevice(const CurrentDevice&) = delete;
  CurrentDevice& operator=(const CurrentDevice&) = delete;

 private:
  int previous_ = 0;
};

// One device allocation: totals, slot records, q̄ and T per batch slot. The backend's GpuDevice outlives every cache
// (caches are destroyed before their context), so the cache follows its current stream.
class DeviceSelectionCache final : public SelectionCacheState {
 public:
  DeviceSelectionCache(const GpuDevice& device, const SelectionCacheDims& dims) : device_(&device), dims_(dims) {
    view_.qbar_capacity = int64_t(dims.num_q_heads) * dims.head_dim;
    view_.selection_capacity = int64_t(std::max(dims.num_kv_heads, 1)) * dims.max_top_k;
    const uint64_t slots = uint64_t(std::max(dims.max_batch, 0));
    const uint64_t slots_at = 2 * sizeof(unsigned long long);
    const uint64_t qbars_at = align(slots_at + slots * kSlotFields * sizeof(int32_t));
    const uint64_t selections_at = qbars_at + slots * uint64_t(view_.qbar_capacity) * sizeof(double);
    bytes_ = selections_at + slots * uint64_t(view_.selection_capacity) * sizeof(int32_t);
    check(cudaMalloc(&memory_, bytes_), "cudaMalloc (selection cache)");
    const cudaError_t cleared = cudaMemsetAsync(memory_, 0, qbars_at, device_->stream);
    const cudaError_t synced = cleared == cudaSuccess ? cudaStreamSynchronize(device_->stream) : cleared;
    if (synced != cudaSuccess) {
      (void)cudaFree(memory_);
      check(synced, "clearing a new selection cache");
    }
    char* base = static_cast<char*>(memory_);
    view_.totals = reinterpret_cast<unsigned long long*>(base);
    view_.slots = reinterpret_cast<int32_t*>(base + slots_at);
    view_.qbars = reinterpret_cast<double*>(base + qbars_at);
    view_.selections = reinterpret_cast<int32_t*>(base + selections_at);
  }
  ~DeviceSelectionCache() override {
    CurrentDevice current(device_->device);
    (void)cudaFree(memory_);
  }
  DeviceSelectionCache(const DeviceSelectionCache&) = delete;
  DeviceSelectionCache& operator=(const DeviceSelectionCache&) = delete;

  const SelectionCacheDims& dims() const override { return dims_; }
  // Enqueued on the context's stream, so it is ordered with the runs around it.
  void reset() override {
    CurrentDevice current(device_->device);
    clear(reinterpret_cast<char*>(view_.qbars) - static_cast<char*>(memory_));
  }
  // An explicit query: waits for the context's stream.
  void counts(int64_t* hits, int64_t* misses) const override {
    CurrentDevice current(device_->device);
    unsigned long long totals[2] = {0, 0};
    check(cudaMemcpyAsync(totals, view_.totals, sizeof(totals), cudaMemcpyDeviceToHost, device_->stream),
          "cudaMemcpyAsync (selection cache counts)");
    check(cudaStreamSynchronize(device_->stream), "cudaStreamSynchronize (selection cache counts)");
    if (hits != nullptr) *hits = int64_t(totals[0]);
    if (misses != nullptr) *misses = int64_t(totals[1]);
  }
  const CacheView& view() const { return view_; }

 private:
  static uint64_t align(uint64_t bytes) { return (bytes + ScratchCarver::kAlignment - 1) / ScratchCarver::kAlignment * ScratchCarver::kAlignment; }
  // Zeroes the totals and slot records (an empty slot's q̄ and T are never read).
  void clear(uint64_t bytes) {
    check(cudaMemsetAsync(memory_, 0, bytes, device_->stream), "cudaMemsetAsync (selection cache)");
  }

  const GpuDevice* device_;
  SelectionCacheDims dims_;
  CacheView view_;
  void* memory_ = nullptr;
  uint64_t bytes_ = 0;
};

// ---- Host side ----

struct RunShape {
  int32_t n_sets = 1, heads_per_set = 1;
  int64_t max_candidates = 0;  // 0 when every sequence is dense
  int32_t tiles = 0;
  int64_t score_stride = 0;
  int32_t list_capacity = 0;
  bool all_dense = true;
};

RunShape run_shape(const AttentionProblem& problem, const PolicyParams& policy) {
  const sparsa_policy& pol = policy.p;
  RunShape shape;
  shape.n_sets = pol.select_per_kv_head ? problem.num_kv_heads : 1;
  shape.heads_per_set = problem.num_q_heads / std::max(shape.n_sets, 1);
  const int64_t selected = int64_t(pol.select_n_init) + pol.select_top_k + pol.select_n_local;
  shape.all_dense = problem.max_seq_k <= selected;
  shape.max_candidates = shape.all_dense ? 0 : problem.max_seq_k - pol.select_n_init - pol.select_n_local;
  shape.tiles = int32_t((shape.max_candidates + kScoreTile - 1) / kScoreTile);
  shape.score_stride = int64_t(shape.tiles) * kScoreTile;
  shape.list_capacity = int32_t(std::max<int64_t>(1, std::min(selected, problem.max_seq_k)));
  return shape;
}

ForwardLaunch plan_attention(const GpuDevice& device, const AttentionProblem& problem, const ForwardParams& p,
                             const RunShape& shape, std::string* reason) {
  if (shape.all_dense) {
    return plan_forward(device, p, problem.max_seq_q, problem.max_seq_k, flat_rows_of(problem),
                        all_rows_aligned_16(problem), reason);
  }
  return plan_index_attention(device, problem.batch, problem.num_q_heads, problem.head_dim, problem.max_seq_q,
                              shape.list_capacity, flat_rows_of(problem));
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

// Blocks of a tile-walking grid: enough to keep every SM busy, no more (an early-exiting grid stays cheap).
unsigned tile_blocks(const GpuDevice& device, int32_t tiles, int64_t other_blocks,
                     int32_t blocks_per_sm = kScoreBlocksPerSm) {
  const int64_t target = int64_t(device.multiprocessors) * blocks_per_sm / std::max<int64_t>(other_blocks, 1);
  return unsigned(std::max<int64_t>(1, std::min<int64_t>(tiles, target)));
}

}  // namespace

bool token_select_supports(const GpuDevice& device, const AttentionProblem& problem, const PolicyParams& policy,
                           std::string* reason) {
  auto refuse = [&](const std::string& why) {
    if (reason != nullptr) *reason = std::string(backend_name()) + " backend: TOKEN_SELECT " + why;
    return false;
  };
  if (problem.head_dim > kMaxHeadDim || problem.head_dim > kIndexMaxHeadDim) {
    return refuse("needs head_dim <= " + std::to_string(kMaxHeadDim));
  }
  const RunShape shape = run_shape(problem, policy);
  if (uint64_t(problem.batch) * problem.num_q_heads * uint64_t(shape.score_stride) * sizeof(double) > kMaxScoreBytes) {
    return refuse("keeps B x Hq x N float64 scores in scratch; this run would need more than 16 GiB");
  }
  const ForwardParams p = make_forward_params(problem, policy);
  if (plan_attention(device, problem, p, shape, reason).kernel == ForwardKernel::kNone) return false;
  return true;
}

void token_select_run(const GpuDevice& device, const AttentionProblem& problem, const PolicyParams& policy,
                      ScratchCarver& carver) {
  const sparsa_policy& pol = policy.p;
  const RunShape shape = run_shape(problem, policy);
  DeviceSelectionCache* cache = nullptr;
  if (problem.selection_cache != nullptr && pol.select_cache_theta < 1.0f) {
    cache = dynamic_cast<DeviceSelectionCache*>(problem.selection_cache);
    if (cache == nullptr) {
      fail(SPARSA_STATUS_INVALID_ARGUMENT, "selection_cache: expected a cache made by a ", backend_name(), " context");
    }
  }
  const int64_t batch = problem.batch, heads = problem.num_q_heads;
  SelectParams sp;
  sp.p = make_forward_params(problem, policy);
  const ForwardLaunch launch = plan_attention(device, problem, sp.p, shape, nullptr);
  carve_forward(carver, launch, sp.p);
  sp.stats = make_stats_params(problem, policy);
  sp.n_init = pol.select_n_init;
  sp.n_local = pol.select_n_local;
  sp.top_k = pol.select_top_k;
  sp.n_sets = shape.n_sets;
  sp.heads_per_set = shape.heads_per_set;
  sp.score_scale = pol.select_scale_scores != 0 ? double(problem.scale) : 1.0;
  sp.cache_theta = double(pol.select_cache_theta);
  sp.tiles = shape.tiles;
  sp.score_stride = shape.score_stride;

  // Scratch, carved in the same order by plan() and run().
  const int64_t segments = batch * shape.n_sets;
  sp.sequences = carver.take<SequenceInfo>(uint64_t(batch));
  sp.segment_lengths = carver.take<int32_t>(uint64_t(segments));
  sp.skip = carver.take<int32_t>(uint64_t(batch));
  sp.qbar = carver.take<double>(uint64_t(batch * heads * problem.head_dim));
  const uint64_t tile_stats = uint64_t(batch * heads) * uint64_t(shape.tiles);
  sp.tile_max = carver.take<double>(tile_stats);
  sp.tile_sum = carver.take<double>(tile_stats);
  sp.head_max = carver.take<double>(uint64_t(batch * heads));
  sp.head_sum = carver.take<double>(uint64_t(batch * heads));
  sp.scores = carver.take<double>(uint64_t(batch * heads) * uint64_t(shape.score_stride));
  sp.votes = carver.take<double>(uint64_t(segments) * uint64_t(shape.score_stride));
  void* topk_scratch = carver.take<char>(device_topk_scratch_bytes(int32_t(segments), shape.max_candidates));
  if (cache != nullptr) {
    sp.cache = cache->view();
    sp.selections = sp.cache.selections;
    sp.selection_stride = sp.cache.selection_capacity;
  } else {
    sp.selection_stride = int64_t(shape.n_sets) * sp.top_k;
    sp.selections = carver.take<int32_t>(uint64_t(batch) * uint64_t(sp.selection_stride));
  }
  IndexSetParams& ix = sp.ix;
  ix.list_capacity = shape.list_capacity;
  ix.heads_per_list = shape.heads_per_set;
  ix.key_lists = carver.take<int32_t>(uint64_t(segments) * uint64_t(shape.list_capacity));
  ix.key_counts = carver.take<int32_t>(uint64_t(segments));
  if (problem.selected_indices.present) {
    ix.selected = problem.selected_indices.ptr<int32_t>();
    for (int d = 0; d < 3; ++d) ix.selected_strides[d] = problem.selected_indices.stride(d);
    ix.selected_cap = int32_t(problem.selected_indices.extent(2));
  }
  if (carver.sizing() || batch == 0 || heads == 0) return;

  const cudaStream_t stream = device.stream;
  prepare_kernel<<<dim3(unsigned(heads), unsigned(batch)), kPrepareThreads, 0, stream>>>(sp);
  check(cudaGetLastError(), "token_select prepare_kernel launch");
  if (cache != nullptr) {
    cache_lookup_kernel<<<unsigned(batch), kReduceThreads, 0, stream>>>(sp);
    check(cudaGetLastError(), "token_select cache_lookup_kernel launch");
  }
  if (!shape.all_dense) {
    constexpr int kSmallHeadChunk = 4, kLargeHeadChunk = 8;
    const int32_t group = sp.p.group_size;
    const bool mma = scores_on_tensor_cores(device, problem);
    const int32_t head_chunk = mma || group > kSmallHeadChunk ? kLargeHeadChunk : kSmallHeadChunk;
    const int64_t score_y = int64_t(problem.num_kv_heads) * ((group + head_chunk - 1) / head_chunk);
    const int32_t blocks_per_sm = mma ? kMmaBlocksPerSm : kScoreBlocksPerSm;
    const dim3 score_grid(tile_blocks(device, shape.tiles, score_y * batch, blocks_per_sm), unsigned(score_y),
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
    merge_kernel<<<dim3(unsigned(heads), unsigned(batch)), kReduceThreads, 0, stream>>>(sp);
    check(cudaGetLastError(), "token_select merge_kernel launch");
    const dim3 vote_grid(tile_blocks(device, shape.tiles, segments), unsigned(shape.n_sets), unsigned(batch));
    vote_kernel<<<vote_grid, kScoreTile, 0, stream>>>(sp);
    check(cudaGetLastError(), "token_select vote_kernel launch");

    TopkArgs a;
    a.values = sp.votes;
    a.value_type = TopkValueType::kF64;
    a.row_stride = shape.score_stride;
    a.segments = int32_t(segments);
    a.max_length = shape.max_candidates;
    a.lengths = sp.segment_lengths;
    a.k = sp.top_k;
    a.skip = sp.skip;
    a.segments_per_skip = shape.n_sets;
    a.out = sp.selections;
    a.out_capacity = sp.top_k;
    a.out_segments_per_group = shape.n_sets;
    a.out_group_stride = sp.selection_stride;
    a.out_stride = sp.top_k;
    a.index_base = sp.n_init;  // candidate offsets -> token ids
    check(device_topk(a, topk_scratch, stream), "token_select device_topk");
  }
  list_kernel<<<dim3(unsigned(shape.n_sets), unsigned(batch)), kListThreads, 0, stream>>>(sp);
  check(cudaGetLastError(), "token_select list_kernel launch");
  if (sp.stats.out != nullptr) check(stats_count_launch(sp.p, sp.stats, stream), "stats_count_kernel launch");
  if (problem.max_seq_q == 0) return;
  if (shape.all_dense) {
    launch_forward(device, launch, sp.p);
  } else {
    check(index_attention_launch(sp.p, ix, int32_t(problem.max_seq_q), stream), "token_select index attention");
  }
}

std::unique_ptr<SelectionCacheState> create_device_selection_cache(const GpuDevice& device,
                                                                   const SelectionCacheDims& dims) {
  return std::make_unique<DeviceSelectionCache>(device, dims);
}

SPARSA_GPU_NAMESPACE_END
