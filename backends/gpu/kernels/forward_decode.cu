// Decode forward (few query rows per kv head): memory-bound, so the aim is K/V streamed at HBM bandwidth with as
// many thread blocks in flight as the GPU holds (split-KV), every K/V row read once for all the query heads that
// share it, and as little work per byte as possible.
//
// Tensor-core kernel (decode_mma_kernel: NVIDIA sm_80+, f16/bf16, K/V rows on 16-byte boundaries). One thread block
// = one (sequence, set of query heads sharing a kv head, 8-row tile, key split); its 8 rows are the (query row,
// head) pairs of the set — for dense decode the GQA group — so one K/V row read serves them all. The block's share
// of keys is dealt tile by tile to its warps; each warp streams its tiles of 16 keys through its own cp.async ring
// in shared memory (16-byte copies, rows XOR-swizzled in 16-byte chunks as in forward_mma.cu so that ldmatrix's
// eight row reads hit eight bank groups). Keys are the mma M (16), rows the N (8), so no tensor-core work is spent
// on padding rows and Oᵀ takes 4 registers per 16 dims:
//
//   cp.async  K/V rows of tile j + kStages - 1 -> ring       (earlier tiles already in flight)
//   Sᵀ = K·Qᵀ                   mma m16n8k16: A = 16 K rows (ldmatrix), B = Qᵀ (registers, read once)
//   Sᵀ = mask(Sᵀ)·scale·log2(e) only on tiles that need it
//   online softmax              per row = per column of Sᵀ (base 2)
//   Oᵀ += Vᵀ·Pᵀ                 A = V rows (ldmatrix.trans), B = Pᵀ: the Sᵀ accumulators, each 8×8 half moved
//                               into the B layout by one movmatrix
//
// then the warps' states are merged in shared memory and written with coalesced stores. The keys are either a range
// (dense decode, sink/window, block mask; a tile no row can see is never loaded) or a prebuilt ascending list
// (TOKEN_INDICES / TOKEN_SELECT, forward_decode_lists_launch: the key ids of a tile are read before its copies are
// issued and kept beside it for the causal test), or TOKEN_SELECT's sink + selection + window composed position by
// position (no list kernel before the walk: a launch less on every decode step).
//
// CUDA-core kernel (forward_decode_simt_kernel: f32, HIP, unaligned rows): plain fp32 on CUDA cores; one thread
// block = one (sequence, kv head, key split), its rows the R = Sq·g pairs of the group. Each warp walks its own
// chunks of kWarpLanes keys:
//
//   scores:  lane j owns key (chunk + j): s[r] = q_r·k_j for every row r            (K rows read once)
//   softmax: per row, chunk max and sum across lanes; running (m, l) rescaled        (base 2)
//   P·V:     lane owns D/kWarpLanes dims; O[r][dims] += Σ_j p[r][j] · v_j[dims]      (P through shared memory)
//
// then the warps' states are merged in shared memory. Only kWarpLanes-generic warp operations are used, so this
// kernel is the same on 32-lane warps and 64-lane wavefronts.
//
// Both write either out/lse (one split) or a normalised fp32 partial state per split that the combine kernel
// merges (split_combine.h, §0).
//
// Where the device runs code compiled for sm_90+ (gpu_launch.h: launch_overlap_supported), the tensor-core kernel
// and the combine are programmatic dependent launches (gpu_runtime.h): the kernel's blocks are scheduled while the
// kernel before it ends and wait for it first thing; the combine's blocks may start once this kernel's blocks are
// past their walk. Measured on an H200 (2026-11-29, against the plain
// launches of 0835d6e): dense GQA decode 0.0534 -> 0.0516 ms at 32K keys and TOKEN_INDICES 0.0427 -> 0.0403 ms
// (128K, lists per kv head) in bench_gpu.py; TOKEN_SELECT's cache hit 0.0303 -> 0.0292 ms per graph replay at 1M
// keys in bench_select.py --timeline (both builds in one call).
//
// (Measured and dropped: the last block of a row tile to finish merging the tile's splits itself, instead of a
// combine launch: one block then reads every split's partial state, 66 of them for 4 rows, and the hit's attention
// took 18.0 µs where attention and combine had taken 8.3 + 4.7.)
#include "forward_decode.h"

#include "../engine/forward_common.cuh"
#include "../engine/split_combine.h"

#if SPARSA_GPU_HAS_MMA_SYNC
#include "mma_primitives.cuh"
// nvcc's front end reports the device helpers below as unreferenced (#177) in the pass that only sees the kernel
// templates through the launchers; the kernel bodies reference them.
#pragma nv_diag_suppress 177
#endif

#include <cmath>
#include <limits>
#include <numeric>

SPARSA_GPU_NAMESPACE_BEGIN
namespace {

// ================================ CUDA-core kernel (any element type, any warp width) ================================

constexpr int kSimtThreads = 128;

__global__ void __launch_bounds__(kSimtThreads) forward_decode_simt_kernel(const ForwardParams p,
                                                                                 int32_t rows_per_block) {
  constexpr int kWarps = kSimtThreads / kWarpLanes;
  constexpr int kDimsPerLane = kDecodeMaxHeadDim / kWarpLanes;
  const int32_t dim = p.head_dim;
  const int32_t dims_per_lane = dim / kWarpLanes;
  const int32_t rows = rows_per_block;  // R = query rows × group size, <= kDecodeSimtMaxRows
  const int32_t split = blockIdx.x;
  const int32_t kv_head = blockIdx.y;
  const int32_t b = blockIdx.z;
  const int warp = threadIdx.x / kWarpLanes;
  const int lane = threadIdx.x % kWarpLanes;

  __shared__ float q_rows[kDecodeSimtMaxRows * kDecodeMaxHeadDim];             // scaled by scale·log2(e)
  __shared__ float probabilities[kWarps][kDecodeSimtMaxRows][kWarpLanes];     // P of the warp's current chunk
  __shared__ float warp_max_state[kWarps][kDecodeSimtMaxRows];
  __shared__ float warp_sum_state[kWarps][kDecodeSimtMaxRows];
  __shared__ float warp_out[kWarps][kDecodeSimtMaxRows * kDecodeMaxHeadDim / 2];  // merged in two halves of rows

  // Row r of this block is query row i = r / g of query head kv_head·g + r % g.
  const SequenceView seq0 = make_sequence_view(p, b, kv_head * p.group_size);
  auto row_query = [&](int32_t r) { return r / p.group_size; };
  auto row_head = [&](int32_t r) { return kv_head * p.group_size + r % p.group_size; };
  auto row_view = [&](int32_t r) {
    SequenceView s = seq0;
    s.h = row_head(r);
    return s;
  };

  for (int index = threadIdx.x; index < rows * dim; index += kSimtThreads) {
    const int32_t r = index / dim, d = index % dim;
    const int32_t i = row_query(r);
    q_rows[r * kDecodeMaxHeadDim + d] =
        i < seq0.seq_q ? load_value(p.q, query_row_offset(p.q_strides, row_view(r), i) + d, p.element_type) *
                             p.scale_log2
                       : 0.f;
  }
  __syncthreads();

  // This split's keys, clipped to what the last row may see.
  const int32_t last_row = min(seq0.seq_q, (rows + p.group_size - 1) / p.group_size);
  const int32_t key_end = last_row > 0 ? key_end_for_rows(p, seq0, last_row) : 0;
  const int32_t keys_per_split = (key_end + p.num_splits - 1) / p.num_splits;
  const int32_t split_begin = min(key_end, split * keys_per_split);
  const int32_t split_end = min(key_end, split_begin + keys_per_split);

  // 2-byte K rows on 16-byte boundaries are read 16 bytes at a time (head_dim is a multiple of 64).
  constexpr int kElemsPer16B = 8;
  constexpr int kLoadsInFlight = 4;
  const bool bf16 = p.element_type == ElementType::kBF16;
  const bool vector_loads = p.kv_rows_aligned16 && p.element_type != ElementType::kF32;

  float row_max[kDecodeSimtMaxRows], row_sum[kDecodeSimtMaxRows], out[kDecodeSimtMaxRows][kDimsPerLane];
#pragma unroll
  for (int r = 0; r < kDecodeSimtMaxRows; ++r) {
    row_max[r] = -INFINITY;
    row_sum[r] = 0.f;
#pragma unroll
    for (int j = 0; j < kDimsPerLane; ++j) out[r][j] = 0.f;
  }

  for (int32_t chunk = split_begin + warp * kWarpLanes; chunk < split_end; chunk += kWarps * kWarpLanes) {
    const int32_t key = chunk + lane;
    const bool key_inside = key < split_end;
    const int64_t k_offset = key_inside ? key_row_offset(p, p.k_strides, seq0, key) : 0;
    float score[kDecodeSimtMaxRows];
#pragma unroll
    for (int r = 0; r < kDecodeSimtMaxRows; ++r) score[r] = 0.f;
    if (key_inside && vector_loads) {
      // 16-byte loads, kLoadsInFlight at a time, so each lane's K row streams instead of one element per trip.
      const uint4* k_row = reinterpret_cast<const uint4*>(static_cast<const uint16_t*>(p.k) + k_offset);
      for (int32_t chunk16 = 0; chunk16 < dim / kElemsPer16B; chunk16 += kLoadsInFlight) {
        uint4 loaded[kLoadsInFlight];
#pragma unroll
        for (int u = 0; u < kLoadsInFlight; ++u) loaded[u] = k_row[chunk16 + u];
#pragma unroll
        for (int u = 0; u < kLoadsInFlight; ++u) {
          const uint32_t words[4] = {loaded[u].x, loaded[u].y, loaded[u].z, loaded[u].w};
#pragma unroll
          for (int e = 0; e < kElemsPer16B; ++e) {
            const uint16_t bits = static_cast<uint16_t>(e % 2 == 0 ? words[e / 2] & 0xffffu : words[e / 2] >> 16);
            const float k_value = bf16 ? bf16_bits_to_float(bits) : f16_bits_to_float(bits);
            const int32_t d = (chunk16 + u) * kElemsPer16B + e;
#pragma unroll
            for (int r = 0; r < kDecodeSimtMaxRows; ++r) {
              if (r < rows) score[r] = fmaf(q_rows[r * kDecodeMaxHeadDim + d], k_value, score[r]);
            }
          }
        }
      }
    } else if (key_inside) {
      for (int32_t d = 0; d < dim; ++d) {
        const float k_value = load_value(p.k, k_offset + d, p.element_type);
#pragma unroll
        for (int r = 0; r < kDecodeSimtMaxRows; ++r) {
          if (r < rows) score[r] = fmaf(q_rows[r * kDecodeMaxHeadDim + d], k_value, score[r]);
        }
      }
    }
#pragma unroll
    for (int r = 0; r < kDecodeSimtMaxRows; ++r) {
      if (r >= rows) continue;  // (continue, not break: the loop must unroll so score/out stay in registers)
      const int32_t i = row_query(r);
      const bool visible = key_inside && i < seq0.seq_q && key_visible(p, row_view(r), i, key);
      const float s = visible ? score[r] : -INFINITY;
      const float new_max = fmaxf(row_max[r], warp_max(s));
      const float reference = new_max == -INFINITY ? 0.f : new_max;
      const float rescale = exp2f(row_max[r] - reference);
      const float probability = exp2f(s - reference);
      row_max[r] = new_max;
      row_sum[r] = row_sum[r] * rescale + warp_sum(probability);
      probabilities[warp][r][lane] = probability;
#pragma unroll
      for (int j = 0; j < kDimsPerLane; ++j) out[r][j] *= rescale;
    }
    warp_sync();
    const int32_t chunk_keys = min(kWarpLanes, split_end - chunk);
    // P·V: lane owns dims [lane·dims_per_lane, +dims_per_lane); 2-byte V in aligned rows comes two dims per 4-byte
    // load (pairs stay aligned only for an even share). Batching several keys' loads raised registers past what
    // keeps 4 blocks per SM and measured slower (0.40 vs 0.22 ms at N=32K), so keys go one at a time.
    const bool value_pairs = vector_loads && dims_per_lane % 2 == 0;
    for (int32_t c = 0; c < chunk_keys; ++c) {
      const int64_t v_offset = key_row_offset(p, p.v_strides, seq0, chunk + c) + lane * dims_per_lane;
      const uint32_t* v_pairs = reinterpret_cast<const uint32_t*>(static_cast<const uint16_t*>(p.v) + v_offset);
#pragma unroll
      for (int j = 0; j < kDimsPerLane; ++j) {
        if (j >= dims_per_lane) continue;
        float v_value;
        if (value_pairs) {
          const uint32_t pair = v_pairs[j / 2];
          const uint16_t bits = static_cast<uint16_t>(j % 2 == 0 ? pair & 0xffffu : pair >> 16);
          v_value = bf16 ? bf16_bits_to_float(bits) : f16_bits_to_float(bits);
        } else {
          v_value = load_value(p.v, v_offset + j, p.element_type);
        }
#pragma unroll
        for (int r = 0; r < kDecodeSimtMaxRows; ++r) {
          if (r < rows) out[r][j] = fmaf(probabilities[warp][r][c], v_value, out[r][j]);
        }
      }
    }
    warp_sync();  // the next chunk overwrites this warp's probabilities
  }

  // Merge the warps' states: m = max_w m_w, O = Σ_w 2^(m_w - m) O_w / Σ_w 2^(m_w - m) l_w.
  if (lane == 0) {
#pragma unroll
    for (int r = 0; r < kDecodeSimtMaxRows; ++r) {
      warp_max_state[warp][r] = row_max[r];
      warp_sum_state[warp][r] = row_sum[r];
    }
  }
  constexpr int kRowsPerHalf = kDecodeSimtMaxRows / 2;
  for (int half = 0; half < 2; ++half) {
    __syncthreads();  // states visible; the previous half's outputs consumed
#pragma unroll
    for (int rr = 0; rr < kRowsPerHalf; ++rr) {
      const int r = half * kRowsPerHalf + rr;
      if (r >= rows) continue;
#pragma unroll
      for (int j = 0; j < kDimsPerLane; ++j) {
        if (j < dims_per_lane) warp_out[warp][rr * kDecodeMaxHeadDim + lane * dims_per_lane + j] = out[r][j];
      }
    }
    __syncthreads();
    for (int index = threadIdx.x; index < kRowsPerHalf * dim; index += kSimtThreads) {
      const int rr = index / dim, d = index % dim;
      const int r = half * kRowsPerHalf + rr;
      if (r >= rows) break;
      const int32_t i = row_query(r);
      if (i >= seq0.seq_q) continue;
      float m = -INFINITY;
      for (int w = 0; w < kWarps; ++w) m = fmaxf(m, warp_max_state[w][r]);
      const float reference = m == -INFINITY ? 0.f : m;
      float total = 0.f, acc = 0.f;
      for (int w = 0; w < kWarps; ++w) {
        const float weight = exp2f(warp_max_state[w][r] - reference);
        total += weight * warp_sum_state[w][r];
        acc += weight * warp_out[w][rr * kDecodeMaxHeadDim + d];
      }
      const float value = total > 0.f ? acc / total : 0.f;
      const float lse = total > 0.f ? (m + log2f(total)) * kLn2 : -INFINITY;
      const SequenceView s = row_view(r);
      if (p.num_splits > 1) {
        const int64_t state = (int64_t(split) * p.flat_rows + flat_query_row(p, s, i)) * p.num_q_heads + s.h;
        p.partial_out[state * dim + d] = value;
        if (d == 0) p.partial_lse[state] = lse;
      } else {
        store_value(p.out, query_row_offset(p.out_strides, s, i) + d, p.element_type, value);
        if (d == 0 && p.lse != nullptr) {
          p.lse[s.b * p.lse_strides.b + int64_t(s.h) * p.lse_strides.h + (s.q_row_base + i) * p.lse_strides.s] = lse;
        }
      }
    }
  }
}

// ================================ Tensor-core kernel (NVIDIA sm_80+, f16/bf16) ================================

#if SPARSA_GPU_HAS_MMA_SYNC

using namespace mma;  // the shared PTX wrappers (mma_primitives.cuh)

constexpr int kBlockRows = 8;   // (query row, head) pairs of a block: the mma N of Sᵀ = K·Qᵀ and Oᵀ = Vᵀ·Pᵀ
constexpr int kTileKeys = 16;   // keys per ring stage: the mma M of Sᵀ and the k-step of Oᵀ
constexpr int kLanes = 32;      // the mma.sync fragment layouts assume 32-lane warps
constexpr int kChunkElems = 8;  // 16-byte chunk of 2-byte elements
constexpr int kSwizzleRows = 8;  // swizzle period: ldmatrix reads 8 rows at once
constexpr size_t kRingBudget = 40 * 1024;  // the rings stay under the 48 KB of static shared memory (no opt-in)
constexpr int kMaxStages = 4;

// Warps per block, each walking every kWarps-th tile of the block's share with its own ring: two at head_dim <= 128
// (8 warps per SM at 4 blocks per SM), one at 256 (a ring of two 16 KB stages is all that fits).
template <int kHeadDim>
constexpr int kWarpsPerBlock = kHeadDim <= 128 ? 2 : 1;
template <int kHeadDim>
constexpr size_t kStageBytes = 2 * kTileKeys * kHeadDim * sizeof(uint16_t) + kTileKeys * sizeof(int32_t);
// Ring depth per warp: 4 stages at head_dim 64, 2 at 128 and 256. (Measured on H200, 32K keys, older code: 5 stages
// at 4 one-warp blocks per SM took 67 µs, 2 stages at 10 blocks per SM 45 µs: warps in flight matter more than depth.)
template <int kHeadDim>
constexpr int kRingStages = kRingBudget / (kWarpsPerBlock<kHeadDim> * kStageBytes<kHeadDim>) < size_t(kMaxStages)
                                ? int(kRingBudget / (kWarpsPerBlock<kHeadDim> * kStageBytes<kHeadDim>))
                                : kMaxStages;

enum class KeySource { kRange, kList, kComposed };

// How a warp's lanes share a tile's copies. kRowSpans: 16 lanes per key row (head dim 128), each copy whole rows of
// contiguous bytes, so long walks stream at the memory's pace, but each lane looks up and addresses 8 keys per
// tile. kRowPairs: 2 lanes per key row, each lane one key per tile, far fewer instructions before a warp's first
// tile lands, which is what a walk of one or two tiles per warp waits on. Measured (H200, 2026-11-29): TOKEN_SELECT's
// 2,688 keys over 66 splits 9.8 -> 8.2 µs with kRowPairs, but dense decode at 128K keys 0.145 -> 0.186 ms.
enum class CopyLayout { kRowSpans, kRowPairs };
constexpr int32_t kRowPairsMaxWarpTiles = 2;  // kRowPairs for walks of at most this many tiles per warp

// A composed key list (DecodeKeyLists with key_lists null): position j's key, the [0, n_init) head, T, then the
// window [tail_begin, tail_begin + n_local). A sequence that reads every key has head = count = N and no T.
struct ComposedList {
  const int32_t* middle = nullptr;
  int32_t head = 0, middle_count = 0, tail_begin = 0, count = 0;

  __device__ __forceinline__ int32_t key(int32_t j) const {
    if (j < head) return j;
    if (j < head + middle_count) return middle[j - head];
    return tail_begin + (j - head - middle_count);
  }
  __device__ __forceinline__ int32_t keys_up_to(int64_t horizon) const {
    return entries_up_to([this](int32_t j) { return key(j); }, count, horizon);
  }
};

__device__ __forceinline__ ComposedList composed_list(const DecodeKeyLists& lists, int64_t list_index, int32_t b,
                                                      int32_t list_in_sequence, int32_t seq_k) {
  ComposedList c;
  if (lists.candidate_counts[list_index] == 0) {
    c.head = c.count = seq_k;
    return c;
  }
  c.middle = lists.selections + b * lists.selection_stride + int64_t(list_in_sequence) * lists.top_k;
  c.head = lists.n_init;
  c.middle_count = lists.top_k;
  c.tail_begin = seq_k - lists.n_local;
  c.count = lists.n_init + lists.top_k + lists.n_local;
  return c;
}

// Transposes an 8x8 matrix of 2-byte elements held in the standard fragment layout (lane t: row t/4, columns
// 2(t%4), 2(t%4)+1) across the warp.
__device__ __forceinline__ uint32_t transpose_8x8(uint32_t fragment) {
  uint32_t transposed;
  asm volatile("movmatrix.sync.aligned.m8n8.trans.b16 %0, %1;\n" : "=r"(transposed) : "r"(fragment));
  return transposed;
}

__device__ __forceinline__ uint16_t to_bits(HalfTag, float value) { return float_to_f16_bits(value); }
__device__ __forceinline__ uint16_t to_bits(BFloat16Tag, float value) { return float_to_bf16_bits(value); }

// Element offset of [rows][kHeadDim] shared tiles, 16-byte chunks swizzled per row.
template <int kHeadDim>
__device__ __forceinline__ int swizzled_offset(int row, int chunk) {
  return row * kHeadDim + ((chunk ^ (row % kSwizzleRows)) * kChunkElems);
}

// Page of key t (paged layouts; 0 otherwise): a separate step so that a tile's page lookups overlap.
__device__ __forceinline__ int32_t key_page(const ForwardParams& p, const SequenceView& s, int32_t t) {
  if (p.page_table == nullptr) return 0;
  return p.page_table[s.b * p.page_table_stride_b + (t / p.page_size) * p.page_table_stride_p];
}

template <typename Tag, int kHeadDim, KeySource kSource, CopyLayout kLayout>
__global__ void __launch_bounds__(kWarpsPerBlock<kHeadDim> * kLanes)
    decode_mma_kernel(const ForwardParams p, const DecodeKeyLists lists, int32_t heads_per_block) {
#if SPARSA_GPU_DEVICE_HAS_MMA_SYNC
  constexpr int kWarps = kWarpsPerBlock<kHeadDim>;
  constexpr int kStages = kRingStages<kHeadDim>;
  static_assert(kStages >= 2, "the ring needs a stage in flight while one computes");
  constexpr int kTileElems = kTileKeys * kHeadDim;
  constexpr int kChunksPerRow = kHeadDim / kChunkElems;
  constexpr int kKeySteps = kHeadDim / 16;                  // k-steps of Sᵀ = K·Qᵀ
  constexpr int kDimBlocks = kHeadDim / 16;                 // m-blocks of Oᵀ = Vᵀ·Pᵀ
  // Per warp: kStages stages of [K tile, V tile]; reused at the end for the warps' merge (fits: see the asserts).
  __shared__ __align__(16) uint16_t ring[kWarps][kStages][2][kTileElems];
  __shared__ int32_t ring_keys[kWarps][kStages][kTileKeys];  // key id of each position (-1: past the share)
  wait_for_previous_kernel();  // its outputs may be this kernel's inputs (q, k, v, the lists)

  const int warp = threadIdx.x / kLanes, lane = threadIdx.x % kLanes;
  const int32_t split = blockIdx.x % p.num_splits;
  const int64_t row_begin = int64_t(blockIdx.x / p.num_splits) * kBlockRows;
  const int32_t head0 = blockIdx.y * heads_per_block;
  const SequenceView seq = make_sequence_view(p, blockIdx.z, head0);
  // Row r of the set is query row r / heads_per_block of head head0 + r % heads_per_block.
  const int64_t rows = int64_t(seq.seq_q) * heads_per_block;
  if (row_begin >= rows) return;
  const int64_t row_end = rows < row_begin + kBlockRows ? rows : row_begin + kBlockRows;
  const int32_t first_query = int32_t(row_begin / heads_per_block);
  const int32_t last_query = int32_t((row_end - 1) / heads_per_block);

  // Positions the block's last query row may see (keys of the range, or entries of the list), and this split's
  // share of them in whole tiles: [begin, end). Warp w takes tiles w, w + kWarps, ...
  const int32_t* list = nullptr;
  ComposedList composed;
  int32_t positions = 0;
  if constexpr (kSource != KeySource::kRange) {
    const int32_t list_in_sequence = head0 / lists.heads_per_list;
    const int64_t list_index = int64_t(seq.b) * (p.num_q_heads / lists.heads_per_list) + list_in_sequence;
    const int64_t horizon = int64_t(last_query) + seq.causal_offset;
    if constexpr (kSource == KeySource::kList) {
      list = lists.key_lists + list_index * lists.list_capacity;
      positions = keys_up_to(list, lists.key_counts[list_index], horizon);
    } else {
      composed = composed_list(lists, list_index, seq.b, list_in_sequence, seq.seq_k);
      positions = composed.keys_up_to(horizon);
    }
  } else {
    positions = key_end_for_rows(p, seq, last_query + 1);
  }
  const int64_t share = (int64_t(positions) + p.num_splits - 1) / p.num_splits;
  const int64_t share_tiles = (share + kTileKeys - 1) / kTileKeys * kTileKeys;
  const int32_t begin = int32_t(min(int64_t(positions), split * share_tiles));
  const int32_t end = int32_t(min(int64_t(positions), begin + share_tiles));
  const int32_t tiles = (end - begin + kTileKeys - 1) / kTileKeys;
  const int32_t warp_tiles = tiles > warp ? (tiles - warp + kWarps - 1) / kWarps : 0;
  auto tile_begin = [&](int32_t j) { return begin + (warp + j * kWarps) * kTileKeys; };  // j-th tile of this warp

  // Qᵀ as the B operand of every Sᵀ k-step, straight from global memory: lane holds row lane / 4, dims
  // 16kk + 2(lane % 4) + {0, 1} and + {8, 9}. Rows past the set stay zero.
  uint32_t q_frag[kKeySteps][2];
  {
    const int64_t row = row_begin + lane / 4;
    const uint16_t* q_row = nullptr;
    if (row < row_end) {
      SequenceView s = seq;
      s.h = head0 + int32_t(row % heads_per_block);
      q_row = static_cast<const uint16_t*>(p.q) + query_row_offset(p.q_strides, s, row / heads_per_block);
    }
    const bool q_pairs = reinterpret_cast<uintptr_t>(q_row) % sizeof(uint32_t) == 0;  // d is even: 4-byte loads
#pragma unroll
    for (int kk = 0; kk < kKeySteps; ++kk) {
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        const int d = 16 * kk + 8 * half + 2 * (lane % 4);
        q_frag[kk][half] = q_row == nullptr ? 0u
                           : q_pairs    ? *reinterpret_cast<const uint32_t*>(q_row + d)
                                        : uint32_t(q_row[d]) | (uint32_t(q_row[d + 1]) << 16);
      }
    }
  }

  // A tile is loaded only if some row of the block may see some of its keys (always for lists and dense).
  auto tile_visible = [&](int32_t key_begin) {
    if constexpr (kSource != KeySource::kRange) return true;
    if (p.rule == VisibilityRule::kDense) return true;
    const int32_t key_end = min(end, key_begin + kTileKeys);
    for (int32_t j = 0; j < heads_per_block; ++j) {
      SequenceView s = seq;
      s.h = head0 + j;
      if (tile_has_visible_key(p, s, first_query, last_query + 1, key_begin, key_end)) return true;
    }
    return false;
  };
  // Copies one tile's K and V rows into a ring stage (CopyLayout). kRowSpans: lane owns chunk lane % kChunksPerRow
  // of rows lane / kChunksPerRow + u·(kLanes / kChunksPerRow); key ids (lists) and pages are all read before the
  // first copy, so their loads overlap. kRowPairs: lane owns key row lane / 2 and its chunks 2u + lane % 2; one
  // copy's 32 lanes cover the swizzle's eight 16-byte bank groups four times each (no conflicts). Positions past
  // the share copy nothing and are zero-filled (their P is 0, and 0·V must stay finite).
  const bool paged = p.page_table != nullptr;
  const int64_t k_lane = int64_t(seq.kv_head) * p.k_strides.h +
                         (paged ? 0 : seq.b * p.k_strides.b + int64_t(seq.k_row_base) * p.k_strides.s);
  const int64_t v_lane = int64_t(seq.kv_head) * p.v_strides.h +
                         (paged ? 0 : seq.b * p.v_strides.b + int64_t(seq.k_row_base) * p.v_strides.s);
  const uint16_t* k_base = static_cast<const uint16_t*>(p.k);
  const uint16_t* v_base = static_cast<const uint16_t*>(p.v);
  auto key_at = [&](int32_t pos) {
    if constexpr (kSource == KeySource::kList) return pos < end ? list[pos] : -1;
    if constexpr (kSource == KeySource::kComposed) return pos < end ? composed.key(pos) : -1;
    return pos < end ? pos : -1;
  };
  auto page_of = [&](int32_t key) { return paged && key >= 0 ? key_page(p, seq, key) : 0; };
  // The K and V rows of `key`, `page` = page_of(key) (the tensors' first rows for -1, from which nothing is
  // copied). The page is looked up apart so that a tile's lookups are all issued before its first copy.
  auto row_sources = [&](int32_t key, int32_t page, const uint16_t*& k_row, const uint16_t*& v_row) {
    k_row = k_base;
    v_row = v_base;
    if (key < 0) return;
    if (paged) {
      const int64_t slot = key % p.page_size;
      k_row += k_lane + int64_t(page) * p.k_strides.b + slot * p.k_strides.s;
      v_row += v_lane + int64_t(page) * p.v_strides.b + slot * p.v_strides.s;
    } else {
      k_row += k_lane + int64_t(key) * p.k_strides.s;
      v_row += v_lane + int64_t(key) * p.v_strides.s;
    }
  };
  auto issue_tile = [&](int32_t pos0, int stage) {
    uint16_t* k_stage = ring[warp][stage][0];
    uint16_t* v_stage = ring[warp][stage][1];
    if constexpr (kLayout == CopyLayout::kRowPairs) {
      static_assert(kLanes == 2 * kTileKeys, "two lanes per key row of a tile");
      const int row = lane / 2, half = lane % 2;
      const int32_t key = key_at(pos0 + row);
      const uint16_t *k_row, *v_row;
      row_sources(key, page_of(key), k_row, v_row);
      const int bytes = key >= 0 ? 16 : 0;
#pragma unroll
      for (int u = 0; u < kChunksPerRow / 2; ++u) {
        const int chunk = 2 * u + half;
        const int at = swizzled_offset<kHeadDim>(row, chunk);
        cp_async_16(shared_address(k_stage + at), k_row + chunk * kChunkElems, bytes);
        cp_async_16(shared_address(v_stage + at), v_row + chunk * kChunkElems, bytes);
      }
      if (half == 0) ring_keys[warp][stage][row] = key;
    } else {
      constexpr int kRowsPerCopy = kLanes / kChunksPerRow;      // key rows one warp-wide 16-byte copy covers
      constexpr int kCopiesPerLane = kTileKeys / kRowsPerCopy;  // per tile, of each of K and V
      const int chunk = lane % kChunksPerRow, row0 = lane / kChunksPerRow;
      if constexpr (kSource == KeySource::kRange) {
        // Consecutive keys in one tensor: a lane's rows are a fixed stride apart, so its copies take one address
        // step each instead of a key's lookup and offset. The kernel issues its copies on few warps (the ring holds
        // 12 per SM), so their instructions count: H200, dense decode, GQA 32/8, D 128, alternating builds in one
        // call, the kernel 127.6–128.2 -> 125.3–125.6 µs at 128K keys and 955 -> 947–950 µs at 1M.
        if (!paged) {
          const int32_t first_key = pos0 + row0;
          const uint16_t* k_row = k_base + k_lane + int64_t(first_key) * p.k_strides.s + chunk * kChunkElems;
          const uint16_t* v_row = v_base + v_lane + int64_t(first_key) * p.v_strides.s + chunk * kChunkElems;
          const int64_t k_step = int64_t(kRowsPerCopy) * p.k_strides.s;
          const int64_t v_step = int64_t(kRowsPerCopy) * p.v_strides.s;
#pragma unroll
          for (int u = 0; u < kCopiesPerLane; ++u) {
            const bool inside = first_key + u * kRowsPerCopy < end;
            const int at = swizzled_offset<kHeadDim>(row0 + u * kRowsPerCopy, chunk);
            cp_async_16(shared_address(k_stage + at), inside ? k_row : k_base, inside ? 16 : 0);
            cp_async_16(shared_address(v_stage + at), inside ? v_row : v_base, inside ? 16 : 0);
            k_row += k_step;
            v_row += v_step;
          }
          return;
        }
      }
      int32_t keys[kCopiesPerLane];
#pragma unroll
      for (int u = 0; u < kCopiesPerLane; ++u) keys[u] = key_at(pos0 + row0 + u * kRowsPerCopy);
      int32_t pages[kCopiesPerLane];
#pragma unroll
      for (int u = 0; u < kCopiesPerLane; ++u) pages[u] = page_of(keys[u]);
#pragma unroll
      for (int u = 0; u < kCopiesPerLane; ++u) {
        const int row = row0 + u * kRowsPerCopy;
        const uint16_t *k_row, *v_row;
        row_sources(keys[u], pages[u], k_row, v_row);
        const int at = swizzled_offset<kHeadDim>(row, chunk);
        const int bytes = keys[u] >= 0 ? 16 : 0;
        cp_async_16(shared_address(k_stage + at), k_row + chunk * kChunkElems, bytes);
        cp_async_16(shared_address(v_stage + at), v_row + chunk * kChunkElems, bytes);
        if (chunk == 0) ring_keys[warp][stage][row] = keys[u];
      }
    }
  };
  uint32_t skipped = 0;  // bit s: ring stage s holds a tile that was not loaded (no row sees it)
  auto stage_tile = [&](int32_t j, int stage) {
    if (j >= warp_tiles) return;
    if (tile_visible(tile_begin(j))) {
      issue_tile(tile_begin(j), stage);
      skipped &= ~(1u << stage);
    } else {
      skipped |= 1u << stage;
    }
  };
#pragma unroll
  for (int stage = 0; stage < kStages - 1; ++stage) {
    stage_tile(stage, stage);
    cp_async_commit();
  }

  // This thread's accumulator columns: rows 2(lane % 4) and 2(lane % 4) + 1 of the block's 8.
  bool my_valid[2];
  int32_t my_query[2], my_head[2];
#pragma unroll
  for (int rr = 0; rr < 2; ++rr) {
    const int64_t row = row_begin + 2 * (lane % 4) + rr;
    my_valid[rr] = row < row_end;
    my_query[rr] = my_valid[rr] ? int32_t(row / heads_per_block) : 0;
    my_head[rr] = head0 + (my_valid[rr] ? int32_t(row % heads_per_block) : 0);
  }
  float o_acc[kDimBlocks][4];  // Oᵀ: dims 16nd + lane/4 (+8 for [2], [3]) × rows 2(lane%4) (+1 for [1], [3])
#pragma unroll
  for (int nd = 0; nd < kDimBlocks; ++nd) o_acc[nd][0] = o_acc[nd][1] = o_acc[nd][2] = o_acc[nd][3] = 0.f;
  float row_max[2] = {-INFINITY, -INFINITY};  // base-2 domain
  float row_sum[2] = {0.f, 0.f};              // this thread's keys; reduced over the 8 key lanes at the end

  for (int32_t j = 0; j < warp_tiles; ++j) {
    const int stage = j % kStages;
    stage_tile(j + kStages - 1, (j + kStages - 1) % kStages);  // refills the stage computed last round
    cp_async_commit();
    cp_async_wait<kStages - 1>();  // this thread's copies of tile j have landed ...
    __syncwarp();                  // ... and every lane's are visible
    if ((skipped >> stage) & 1u) {
      __syncwarp();
      continue;
    }
    const uint16_t* k_tile = ring[warp][stage][0];
    const uint16_t* v_tile = ring[warp][stage][1];
    const int32_t pos0 = tile_begin(j);

    // Sᵀ = K·Qᵀ: 16 keys × 8 rows; even and odd k-steps in two accumulators (half the dependent mma chain).
    // Lane holds keys lane/4 ([0], [1]) and lane/4 + 8 ([2], [3]) of rows 2(lane%4) + {0, 1}.
    float s_part[2][4] = {{0.f, 0.f, 0.f, 0.f}, {0.f, 0.f, 0.f, 0.f}};
#pragma unroll
    for (int kk = 0; kk < kKeySteps; ++kk) {
      uint32_t a[4];
      ldmatrix_x4(a, shared_address(k_tile + swizzled_offset<kHeadDim>(lane % 16, 2 * kk + lane / 16)));
      mma_16816(Tag{}, s_part[kk % 2], a, q_frag[kk][0], q_frag[kk][1]);
    }
    float s[4];
#pragma unroll
    for (int e = 0; e < 4; ++e) s[e] = s_part[0][e] + s_part[1][e];

    // Mask (raw scores; the scale is folded into the exponent below): positions past the share and keys a row may
    // not see. A tile every row sees whole skips it.
    bool whole_tile_visible = pos0 + kTileKeys <= end;
    if constexpr (kSource != KeySource::kRange) {
      whole_tile_visible = whole_tile_visible && int64_t(ring_keys[warp][stage][kTileKeys - 1]) <=
                                                     int64_t(first_query) + seq.causal_offset;
    } else {
      whole_tile_visible = whole_tile_visible && p.rule == VisibilityRule::kDense &&
                           (!p.causal || int64_t(pos0) + kTileKeys - 1 <= int64_t(first_query) + seq.causal_offset);
    }
    if (!whole_tile_visible) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int rr = e % 2;
        const int key_row = lane / 4 + 8 * (e / 2);
        const int32_t pos = pos0 + key_row;
        bool visible = my_valid[rr] && pos < end;
        if constexpr (kSource != KeySource::kRange) {
          visible = visible && int64_t(ring_keys[warp][stage][key_row]) <= int64_t(my_query[rr]) + seq.causal_offset;
        } else if (visible) {
          SequenceView sv = seq;
          sv.h = my_head[rr];
          visible = key_visible(p, sv, my_query[rr], pos);
        }
        if (!visible) s[e] = -INFINITY;
      }
    }

    // Online softmax in base 2 per row (column of Sᵀ): max over the 16 keys (2 per lane, 8 lanes), rescale O and l,
    // P = 2^(S·scale·log2e - m).
    float rescale[2];
#pragma unroll
    for (int rr = 0; rr < 2; ++rr) {
      float tile_max = fmaxf(s[rr], s[rr + 2]);
      tile_max = fmaxf(tile_max, warp_shfl_xor(tile_max, 4));
      tile_max = fmaxf(tile_max, warp_shfl_xor(tile_max, 8));
      tile_max = fmaxf(tile_max, warp_shfl_xor(tile_max, 16));
      const float new_max = fmaxf(row_max[rr], tile_max * p.scale_log2);  // scale > 0 keeps the arg max
      const float reference = new_max == -INFINITY ? 0.f : new_max;  // a row with nothing visible yet stays at 0
      rescale[rr] = fast_exp2(row_max[rr] - reference);
      row_max[rr] = new_max;
      s[rr] = fast_exp2(fmaf(s[rr], p.scale_log2, -reference));
      s[rr + 2] = fast_exp2(fmaf(s[rr + 2], p.scale_log2, -reference));
      row_sum[rr] = row_sum[rr] * rescale[rr] + (s[rr] + s[rr + 2]);
    }
#pragma unroll
    for (int nd = 0; nd < kDimBlocks; ++nd) {
#pragma unroll
      for (int e = 0; e < 4; ++e) o_acc[nd][e] *= rescale[e % 2];
    }

    // Oᵀ += Vᵀ·Pᵀ: Pᵀ (16 keys × 8 rows) is the B operand; its two 8×8 halves sit in the Sᵀ accumulators in the
    // transposed layout, so one movmatrix each puts them in place. A = Vᵀ from the V tile (ldmatrix.trans).
    const uint32_t p_frag0 = transpose_8x8(pack_pair(Tag{}, s[0], s[1]));  // keys 0-7
    const uint32_t p_frag1 = transpose_8x8(pack_pair(Tag{}, s[2], s[3]));  // keys 8-15
#pragma unroll
    for (int nd = 0; nd < kDimBlocks; ++nd) {
      uint32_t a[4];
      const int key_row = lane % 8 + (lane / 16) * 8;
      ldmatrix_x4_trans(a, shared_address(v_tile + swizzled_offset<kHeadDim>(key_row, 2 * nd + (lane / 8) % 2)));
      mma_16816(Tag{}, o_acc[nd], a, p_frag0, p_frag1);
    }
    __syncwarp();  // every lane is done with this stage before it is refilled
  }
  cp_async_wait<0>();  // no copy may stay in flight past the kernel
  allow_next_kernel_start();  // the combine kernel's blocks may take SM slots this grid's started blocks free

  // Merge the warps' states through shared memory (the rings are free now): m = max_w m_w,
  // O = Σ_w 2^(m_w - m) O_w / Σ_w 2^(m_w - m) l_w; LSE = (m + log2 l)·ln 2 (-inf for a row that saw nothing).
#pragma unroll
  for (int rr = 0; rr < 2; ++rr) {
    row_sum[rr] += warp_shfl_xor(row_sum[rr], 4);
    row_sum[rr] += warp_shfl_xor(row_sum[rr], 8);
    row_sum[rr] += warp_shfl_xor(row_sum[rr], 16);
  }
  __syncthreads();
  // [kWarps][kBlockRows][kMergeStride] outputs, then [kWarps][kBlockRows] maxima and sums. The row stride's 4
  // padding floats put the accumulators' four rows of one store on different banks, and keep rows 16-byte aligned
  // for the float4 reads below.
  constexpr int kMergeStride = kHeadDim + 4;
  static_assert(sizeof(ring) >= kWarps * kBlockRows * (kMergeStride + 2) * sizeof(float), "merge storage");
  float* merge_out = reinterpret_cast<float*>(&ring[0][0][0][0]);
  float* merge_max = merge_out + kWarps * kBlockRows * kMergeStride;
  float* merge_sum = merge_max + kWarps * kBlockRows;
#pragma unroll
  for (int nd = 0; nd < kDimBlocks; ++nd) {
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int r = 2 * (lane % 4) + e % 2, d = 16 * nd + lane / 4 + 8 * (e / 2);
      merge_out[(warp * kBlockRows + r) * kMergeStride + d] = o_acc[nd][e];
    }
  }
  if (lane < 4) {
#pragma unroll
    for (int rr = 0; rr < 2; ++rr) {
      merge_max[warp * kBlockRows + 2 * lane + rr] = row_max[rr];
      merge_sum[warp * kBlockRows + 2 * lane + rr] = row_sum[rr];
    }
  }
  __syncthreads();
  // Per row (one thread each): the merged max, each warp's weight with 1 / total folded in, the LSE and where the
  // row goes, so that the loop over the row's dims below does no division and no exponential.
  __shared__ float row_weight[kWarps][kBlockRows];
  __shared__ int64_t row_destination[kBlockRows];  // partial state index, or the out element offset of dim 0
  const int32_t block_rows = int32_t(row_end - row_begin);
  if (int32_t(threadIdx.x) < block_rows) {
    const int r = threadIdx.x;
    float m = -INFINITY;
#pragma unroll
    for (int w = 0; w < kWarps; ++w) m = fmaxf(m, merge_max[w * kBlockRows + r]);
    const float reference = m == -INFINITY ? 0.f : m;
    float weight[kWarps];
    float total = 0.f;
#pragma unroll
    for (int w = 0; w < kWarps; ++w) {
      weight[w] = exp2f(merge_max[w * kBlockRows + r] - reference);
      total += weight[w] * merge_sum[w * kBlockRows + r];
    }
    const float inverse = total > 0.f ? 1.f / total : 0.f;
#pragma unroll
    for (int w = 0; w < kWarps; ++w) row_weight[w][r] = weight[w] * inverse;
    const float lse = total > 0.f ? (m + log2f(total)) * kLn2 : -INFINITY;
    const int64_t row = row_begin + r;
    SequenceView s = seq;
    s.h = head0 + int32_t(row % heads_per_block);
    const int32_t i = int32_t(row / heads_per_block);
    if (p.num_splits > 1) {
      const int64_t state = (int64_t(split) * p.flat_rows + flat_query_row(p, s, i)) * p.num_q_heads + s.h;
      row_destination[r] = state;
      p.partial_lse[state] = lse;
    } else {
      row_destination[r] = query_row_offset(p.out_strides, s, i);
      if (p.lse != nullptr) {
        p.lse[s.b * p.lse_strides.b + int64_t(s.h) * p.lse_strides.h + (s.q_row_base + i) * p.lse_strides.s] = lse;
      }
    }
  }
  __syncthreads();
  // Four dims per thread and step: float4 reads of the warps' outputs, one 16-byte partial-state store (its rows
  // are 16-byte aligned: head_dim floats from a 256-byte aligned base) or four output elements.
  constexpr int kVector = 4;
  constexpr int kRowVectors = kHeadDim / kVector;
  for (int index = threadIdx.x; index < block_rows * kRowVectors; index += blockDim.x) {
    const int r = index / kRowVectors, d = index % kRowVectors * kVector;
    float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll
    for (int w = 0; w < kWarps; ++w) {
      const float weight = row_weight[w][r];
      const float4 x = *reinterpret_cast<const float4*>(merge_out + (w * kBlockRows + r) * kMergeStride + d);
      acc.x = fmaf(weight, x.x, acc.x);
      acc.y = fmaf(weight, x.y, acc.y);
      acc.z = fmaf(weight, x.z, acc.z);
      acc.w = fmaf(weight, x.w, acc.w);
    }
    if (p.num_splits > 1) {
      *reinterpret_cast<float4*>(p.partial_out + row_destination[r] * kHeadDim + d) = acc;
    } else {
      uint16_t* destination = static_cast<uint16_t*>(p.out) + row_destination[r] + d;
      const uint32_t low = pack_pair(Tag{}, acc.x, acc.y), high = pack_pair(Tag{}, acc.z, acc.w);
      if (reinterpret_cast<uintptr_t>(destination) % sizeof(uint2) == 0) {
        *reinterpret_cast<uint2*>(destination) = make_uint2(low, high);
      } else {
        destination[0] = uint16_t(low & 0xffffu);
        destination[1] = uint16_t(low >> 16);
        destination[2] = uint16_t(high & 0xffffu);
        destination[3] = uint16_t(high >> 16);
      }
    }
  }
#endif  // SPARSA_GPU_DEVICE_HAS_MMA_SYNC
}

template <typename Tag, int kHeadDim, KeySource kSource, CopyLayout kLayout>
cudaError_t launch_mma_kernel(const ForwardParams& p, const DecodeKeyLists& lists, int32_t heads_per_block,
                              int64_t max_rows, cudaStream_t stream) {
  const int64_t row_tiles = (max_rows + kBlockRows - 1) / kBlockRows;
  if (row_tiles * p.num_splits > std::numeric_limits<int32_t>::max()) return cudaErrorInvalidValue;
  const dim3 grid(uint32_t(row_tiles * p.num_splits), uint32_t(p.num_q_heads / heads_per_block), uint32_t(p.batch));
  return launch_overlapping(p.overlap_launches, decode_mma_kernel<Tag, kHeadDim, kSource, kLayout>, grid,
                            dim3(kWarpsPerBlock<kHeadDim> * kLanes), stream, p, lists, heads_per_block);
}

template <KeySource kSource, CopyLayout kLayout = CopyLayout::kRowSpans>
cudaError_t launch_mma(const ForwardParams& p, const DecodeKeyLists& lists, int32_t heads_per_block,
                       int64_t max_rows, cudaStream_t stream) {
  const bool bf16 = p.element_type == ElementType::kBF16;
  switch (p.head_dim) {
    case 64:
      return bf16 ? launch_mma_kernel<BFloat16Tag, 64, kSource, kLayout>(p, lists, heads_per_block, max_rows, stream)
                  : launch_mma_kernel<HalfTag, 64, kSource, kLayout>(p, lists, heads_per_block, max_rows, stream);
    case 128:
      return bf16 ? launch_mma_kernel<BFloat16Tag, 128, kSource, kLayout>(p, lists, heads_per_block, max_rows, stream)
                  : launch_mma_kernel<HalfTag, 128, kSource, kLayout>(p, lists, heads_per_block, max_rows, stream);
    default:
      return bf16 ? launch_mma_kernel<BFloat16Tag, 256, kSource, kLayout>(p, lists, heads_per_block, max_rows, stream)
                  : launch_mma_kernel<HalfTag, 256, kSource, kLayout>(p, lists, heads_per_block, max_rows, stream);
  }
}

// Does each warp of a composed-list walk (TOKEN_SELECT) get at most kRowPairsMaxWarpTiles tiles (CopyLayout)?
bool composed_walk_is_short(const ForwardParams& p, const DecodeKeyLists& lists) {
  const int64_t listed = int64_t(lists.n_init) + lists.top_k + lists.n_local;
  const int64_t share = (listed + p.num_splits - 1) / p.num_splits;
  const int64_t warps = p.head_dim <= 128 ? kWarpsPerBlock<128> : kWarpsPerBlock<256>;
  return ((share + kTileKeys - 1) / kTileKeys + warps - 1) / warps <= kRowPairsMaxWarpTiles;
}

#endif  // SPARSA_GPU_HAS_MMA_SYNC

// Can the tensor-core kernel take `p` (rows aside)?
bool mma_kernel_applies(const ForwardParams& p) {
#if SPARSA_GPU_HAS_MMA_SYNC
  return p.element_type != ElementType::kF32 && p.kv_rows_aligned16 &&
         (p.head_dim == 64 || p.head_dim == 128 || p.head_dim == 256);
#else
  (void)p;
  return false;
#endif
}

cudaError_t then_combine(cudaError_t status, const ForwardParams& p, cudaStream_t stream) {
  if (status != cudaSuccess || p.num_splits == 1) return status;
  return combine_splits_launch(p, stream);
}

}  // namespace

bool forward_decode_supports(const ForwardParams& p, int64_t max_seq_q) {
  const int64_t rows = max_seq_q * p.group_size;
  if (mma_kernel_applies(p)) return rows <= kDecodeMaxRows;
  return rows <= kDecodeSimtMaxRows && p.head_dim % kDecodeDimMultiple == 0 && p.head_dim <= kDecodeMaxHeadDim;
}

cudaError_t forward_decode_launch(const ForwardParams& p, int32_t max_seq_q, cudaStream_t stream) {
#if SPARSA_GPU_HAS_MMA_SYNC
  if (mma_kernel_applies(p)) {
    return then_combine(launch_mma<KeySource::kRange>(p, DecodeKeyLists{}, p.group_size,
                                                      int64_t(max_seq_q) * p.group_size, stream),
                        p, stream);
  }
#endif
  const dim3 grid(p.num_splits, p.num_q_heads / p.group_size, p.batch);
  forward_decode_simt_kernel<<<grid, kSimtThreads, 0, stream>>>(p, max_seq_q * p.group_size);
  return then_combine(cudaGetLastError(), p, stream);
}

bool forward_decode_lists_supports(const ForwardParams& p) { return mma_kernel_applies(p); }

cudaError_t forward_decode_lists_launch(const ForwardParams& p, const DecodeKeyLists& lists, int32_t max_seq_q,
                                        cudaStream_t stream) {
#if SPARSA_GPU_HAS_MMA_SYNC
  if (mma_kernel_applies(p) && lists.heads_per_list >= 1) {
    // The heads of a block share both their list and their kv head.
    const int32_t heads_per_block = std::gcd(p.group_size, lists.heads_per_list);
    const int64_t max_rows = int64_t(max_seq_q) * heads_per_block;
    if (lists.key_lists != nullptr) {
      return then_combine(launch_mma<KeySource::kList>(p, lists, heads_per_block, max_rows, stream), p, stream);
    }
    return then_combine(composed_walk_is_short(p, lists)
                            ? launch_mma<KeySource::kComposed, CopyLayout::kRowPairs>(p, lists, heads_per_block,
                                                                                     max_rows, stream)
                            : launch_mma<KeySource::kComposed>(p, lists, heads_per_block, max_rows, stream),
                        p, stream);
  }
#endif
  (void)p;
  (void)lists;
  (void)max_seq_q;
  (void)stream;
  return cudaErrorInvalidValue;
}


SPARSA_GPU_NAMESPACE_END
