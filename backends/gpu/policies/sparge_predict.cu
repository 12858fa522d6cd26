// SPARGE block-mask prediction (sparge_predict.h): block statistics, predicted scores and the per-row selection,
// all in float64 and deterministic (every reduction has a fixed order: a butterfly inside a warp, then the warps
// in index order), so a run gives the same mask every time and the CPU's mask wherever the float64 reference is
// not within rounding of a threshold.
//
// Where the time goes (H200, N = 32K, H = 32, D = 128, bf16, block 128 × 64): the block passes read Q once and K
// twice, so they use 16-byte loads with several rows in flight per lane; Ŝ is a register-tiled float64 GEMM; the
// select kernel sorts one 64-bit rank key per key block (rank_key) in shared memory.
//
// Threads and wavefronts: warp shuffles are used only through warp_shfl_xor with kWarpLanes (32 on NVIDIA, 64 on
// CDNA), so the same code holds on both.
#include "sparge_predict.h"

#include "../engine/forward_common.cuh"

#include <cmath>

SPARSA_GPU_NAMESPACE_BEGIN
namespace {

constexpr int kStatThreads = 128;   // block statistics: warps over rows, lanes over dimensions
constexpr int kMaxHeadDim = 256;    // the backend's largest head_dim (kSimtMaxHeadDim)
constexpr int kStatWarps = kStatThreads / kWarpLanes;
constexpr int kVectorBytes = 16;      // one load of the vector block passes
constexpr int kMaxVectorElems = 8;    // 16-bit elements in one load
// Doubles of per-slot partial sums in shared memory: [warps][D] (scalar passes) or [threads][elements per load]
// (vector passes).
constexpr int kStatSlots = kStatWarps * kMaxHeadDim > kStatThreads * kMaxVectorElems ? kStatWarps * kMaxHeadDim
                                                                                     : kStatThreads * kMaxVectorElems;
constexpr int kMeanDims = 32;         // key mean: dimensions per thread block
constexpr int kMeanThreads = 256;     // (part, dimension) threads
constexpr int kMeanParts = kMeanThreads / kMeanDims;
constexpr int kMeanAccumulators = 4;  // interleaved partial sums per thread
constexpr int kScoreTile = 64;      // block scores: 64 query blocks × 64 key blocks per thread block
constexpr int kScoreMicro = 4;      // 4 × 4 outputs per thread
constexpr int kScoreDimChunk = 16;  // dimensions staged in shared memory at a time
constexpr int kScoreThreads = (kScoreTile / kScoreMicro) * (kScoreTile / kScoreMicro);
constexpr int kSelectThreads = 256;
constexpr int kSelectWarps = kSelectThreads / kWarpLanes;
// Columns of sparge_head_params [Hq, 4].
constexpr int kThetaColumn = 0, kTauColumn = 1, kTopkColumn = 2, kLambdaColumn = 3;

__device__ __forceinline__ int64_t ceil_div64(int64_t a, int64_t b) { return (a + b - 1) / b; }

// The sequence view of kv head hk (make_sequence_view takes a query head; any head of the group maps to hk).
__device__ __forceinline__ SequenceView kv_head_view(const ForwardParams& p, int32_t b, int32_t hk) {
  return make_sequence_view(p, b, hk * p.group_size);
}

// Head h's value of one per-head parameter: the override unless absent or NaN, else the scalar.
__device__ __forceinline__ double head_param(const SpargePredictParams& p, int32_t h, int column, double scalar) {
  if (p.head_params == nullptr) return scalar;
  const float value = p.head_params[h * p.head_params_strides[0] + column * p.head_params_strides[1]];
  return isnan(value) ? scalar : double(value);
}

// Sum of `value` over the warp; every lane gets the same bits (each butterfly step adds a commutative pair).
__device__ __forceinline__ double warp_sum(double value) {
#pragma unroll
  for (int offset = kWarpLanes / 2; offset > 0; offset >>= 1) value += warp_shfl_xor(value, offset);
  return value;
}

// Block-wide reductions in a fixed order: warps first, then the warp results in index order by every thread.
// `partials` holds one entry per warp; the trailing barrier lets the caller reuse it.
template <int kWarps, typename Combine>
__device__ __forceinline__ double block_reduce(double value, double* partials, Combine combine) {
#pragma unroll
  for (int offset = kWarpLanes / 2; offset > 0; offset >>= 1) value = combine(value, warp_shfl_xor(value, offset));
  if (threadIdx.x % kWarpLanes == 0) partials[threadIdx.x / kWarpLanes] = value;
  __syncthreads();
  double total = partials[0];
#pragma unroll
  for (int w = 1; w < kWarps; ++w) total = combine(total, partials[w]);
  __syncthreads();
  return total;
}

// Element e of a 16-byte vector of F16/BF16 (Element = uint16_t) or F32 values, as fp32.
template <typename Element>
__device__ __forceinline__ float vector_element(const uint4& raw, int e, ElementType type);
template <>
__device__ __forceinline__ float vector_element<float>(const uint4& raw, int e, ElementType) {
  const uint32_t words[4] = {raw.x, raw.y, raw.z, raw.w};
  return __uint_as_float(words[e]);
}
template <>
__device__ __forceinline__ float vector_element<uint16_t>(const uint4& raw, int e, ElementType type) {
  const uint32_t words[4] = {raw.x, raw.y, raw.z, raw.w};
  const uint16_t bits = uint16_t(words[e / 2] >> (16 * (e % 2)));
  return type == ElementType::kF16 ? f16_bits_to_float(bits) : bf16_bits_to_float(bits);
}

// ---- 1., 3., 4. Block passes: warps take rows, lanes take dimensions ----
enum class BlockPass {
  kKeySums,     // 1. Σ of the raw keys of each key block (key_block_means holds sums until pass 3)
  kKeyStats,    // 3. centred key blocks: mean of the rows and sim = ‖Σ x/‖x‖‖² / n² (§4 steps 1–3)
  kQueryStats,  // 4. raw query blocks: the same
};

// The end of every block pass: per-slot partial sums [slots][dim] (slot = a warp, or a row group of a warp) added
// in slot order, then the block's mean (raw sum for kKeySums) and, with unit sums, sim clamped to [0, 1].
template <BlockPass kPass>
__device__ void finish_block(const SpargePredictParams& p, const double* row_sums, const double* unit_sums, int slots,
                             int64_t flat_head, int32_t block, double rows, double* partials) {
  constexpr bool kKeys = kPass != BlockPass::kQueryStats;
  constexpr bool kUnit = kPass != BlockPass::kKeySums;
  const int32_t dim = p.fwd.head_dim;
  const int64_t max_blocks = kKeys ? p.max_k_blocks : p.max_q_blocks;
  double* means = (kKeys ? p.key_block_means : p.query_block_means) + (flat_head * max_blocks + block) * dim;
  double unit_norm_sq = 0.0;
  for (int d = threadIdx.x; d < dim; d += blockDim.x) {
    double x_total = 0.0, u_total = 0.0;
    for (int slot = 0; slot < slots; ++slot) {
      x_total += row_sums[slot * dim + d];
      if (kUnit) u_total += unit_sums[slot * dim + d];
    }
    means[d] = kUnit ? x_total / rows : x_total;  // the tail block averages its real rows only
    unit_norm_sq += u_total * u_total;
  }
  if (!kUnit) return;
  unit_norm_sq = block_reduce<kStatWarps>(unit_norm_sq, partials, [](double a, double c) { return a + c; });
  if (threadIdx.x == 0) {
    const double sim = unit_norm_sq / (rows * rows);
    (kKeys ? p.key_sim : p.query_sim)[flat_head * max_blocks + block] = fmin(1.0, fmax(0.0, sim));
  }
}

// Scalar loads (any alignment, any head_dim; lane c of a row holds d = lane + c · kWarpLanes): a warp walks its
// rows (first + warp, + kStatWarps, ...) in groups of kWarpLanes rows: one pass adds the rows and leaves row j's
// squared norm in lane j, so that each lane takes one reciprocal square root for the whole group; a second pass
// (the rows again, from L1) adds the unit vectors.
template <BlockPass kPass, int kDimsPerLane>
__global__ void __launch_bounds__(kStatThreads) block_pass_kernel(const SpargePredictParams p) {
  constexpr bool kKeys = kPass != BlockPass::kQueryStats;
  constexpr bool kUnit = kPass != BlockPass::kKeySums;
  __shared__ double row_sums[kStatSlots];
  __shared__ double unit_sums[kUnit ? kStatSlots : 1];
  __shared__ double partials[kStatWarps];
  const ForwardParams& f = p.fwd;
  const int32_t block = blockIdx.x, head = blockIdx.y, b = blockIdx.z;
  const int32_t rows_per_block = kKeys ? p.block_k : p.block_q;
  const SequenceView seq = kKeys ? kv_head_view(f, b, head) : make_sequence_view(f, b, head);
  const int64_t seq_len = kKeys ? seq.seq_k : seq.seq_q;
  const int64_t first = int64_t(block) * rows_per_block;
  if (first >= seq_len) return;
  const int64_t end = min(first + rows_per_block, seq_len);
  const int32_t dim = f.head_dim;
  const int64_t flat_head = int64_t(b) * (kKeys ? p.num_kv_heads : f.num_q_heads) + head;
  const double* centre = kPass == BlockPass::kKeyStats ? p.key_mean + flat_head * dim : nullptr;
  const int lane = threadIdx.x % kWarpLanes, warp = threadIdx.x / kWarpLanes;

  auto load_row = [&](int64_t r, double (&x)[kDimsPerLane]) {
    const int64_t offset = kKeys ? key_row_offset(f, f.k_strides, seq, r) : query_row_offset(f.q_strides, seq, r);
#pragma unroll
    for (int c = 0; c < kDimsPerLane; ++c) {
      const int d = lane + c * kWarpLanes;
      x[c] = 0.0;
      if (d < dim) {
        x[c] = double(load_value(kKeys ? f.k : f.q, offset + d, f.element_type));
        if (centre != nullptr) x[c] -= centre[d];
      }
    }
  };
  double x_sum[kDimsPerLane], u_sum[kDimsPerLane];
#pragma unroll
  for (int c = 0; c < kDimsPerLane; ++c) x_sum[c] = u_sum[c] = 0.0;
  constexpr int64_t kGroupStride = int64_t(kStatWarps) * kWarpLanes;
  for (int64_t group = first + warp; group < end; group += kGroupStride) {
    double my_norm_sq = 0.0;  // of row `group + lane · kStatWarps`
    for (int j = 0; j < kWarpLanes && group + int64_t(j) * kStatWarps < end; ++j) {
      double x[kDimsPerLane];
      load_row(group + int64_t(j) * kStatWarps, x);
      double norm_sq = 0.0;
#pragma unroll
      for (int c = 0; c < kDimsPerLane; ++c) {
        x_sum[c] += x[c];
        norm_sq += x[c] * x[c];
      }
      if (kUnit) {
        norm_sq = warp_sum(norm_sq);
        if (lane == j) my_norm_sq = norm_sq;
      }
    }
    if (!kUnit) continue;
    const double my_inv_norm = my_norm_sq > 0.0 ? 1.0 / sqrt(my_norm_sq) : 0.0;  // a zero row adds a zero vector
    for (int j = 0; j < kWarpLanes && group + int64_t(j) * kStatWarps < end; ++j) {
      const double inv_norm = warp_shfl_xor(my_inv_norm, lane ^ j);  // lane j's value
      double x[kDimsPerLane];
      load_row(group + int64_t(j) * kStatWarps, x);
#pragma unroll
      for (int c = 0; c < kDimsPerLane; ++c) u_sum[c] += x[c] * inv_norm;
    }
  }
#pragma unroll
  for (int c = 0; c < kDimsPerLane; ++c) {
    const int d = lane + c * kWarpLanes;
    if (d < dim) {
      row_sums[warp * dim + d] = x_sum[c];
      if (kUnit) unit_sums[warp * dim + d] = u_sum[c];
    }
  }
  __syncthreads();
  finish_block<kPass>(p, row_sums, unit_sums, kStatWarps, flat_head, block, double(end - first), partials);
}

// 16-byte loads (rows 16-byte aligned; head_dim = kLanesPerRow · kElems): kLanesPerRow lanes share a row, each
// holding kElems consecutive dimensions, so a warp reads kWarpLanes / kLanesPerRow rows per load and kUnroll such
// steps are in flight before any is used. Each row's norm is a butterfly over its lanes; every lane of the row then
// has it, so no second pass is needed. Slot of a partial sum = (warp, row of the step).
template <BlockPass kPass, typename Element, int kLanesPerRow>
__global__ void __launch_bounds__(kStatThreads) block_pass_vector_kernel(const SpargePredictParams p) {
  constexpr bool kKeys = kPass != BlockPass::kQueryStats;
  constexpr bool kUnit = kPass != BlockPass::kKeySums;
  constexpr int kElems = kVectorBytes / int(sizeof(Element));
  constexpr int kRowsPerStep = kWarpLanes / kLanesPerRow;
  constexpr int kSlots = kStatWarps * kRowsPerStep;
  constexpr int kUnroll = 4;
  static_assert(kSlots * kLanesPerRow * kElems <= kStatSlots, "partial sums exceed the shared arrays");
  __shared__ double row_sums[kStatSlots];
  __shared__ double unit_sums[kUnit ? kStatSlots : 1];
  __shared__ double partials[kStatWarps];
  const ForwardParams& f = p.fwd;
  const int32_t block = blockIdx.x, head = blockIdx.y, b = blockIdx.z;
  const int32_t rows_per_block = kKeys ? p.block_k : p.block_q;
  const SequenceView seq = kKeys ? kv_head_view(f, b, head) : make_sequence_view(f, b, head);
  const int64_t seq_len = kKeys ? seq.seq_k : seq.seq_q;
  const int64_t first = int64_t(block) * rows_per_block;
  if (first >= seq_len) return;
  const int64_t end = min(first + rows_per_block, seq_len);
  const int32_t dim = f.head_dim;  // == kLanesPerRow · kElems (checked by the launcher)
  const int64_t flat_head = int64_t(b) * (kKeys ? p.num_kv_heads : f.num_q_heads) + head;
  const int lane = threadIdx.x % kWarpLanes, warp = threadIdx.x / kWarpLanes;
  const int step_row = lane / kLanesPerRow, d0 = (lane % kLanesPerRow) * kElems;
  const Element* base = static_cast<const Element*>(kKeys ? f.k : f.q);

  double centre[kElems];
#pragma unroll
  for (int e = 0; e < kElems; ++e) {
    centre[e] = kPass == BlockPass::kKeyStats ? p.key_mean[flat_head * dim + d0 + e] : 0.0;
  }
  double x_sum[kElems], u_sum[kElems];
#pragma unroll
  for (int e = 0; e < kElems; ++e) x_sum[e] = u_sum[e] = 0.0;
  constexpr int64_t kRowStride = int64_t(kStatWarps) * kRowsPerStep;  // rows between a warp's consecutive steps
  for (int64_t r0 = first + int64_t(warp) * kRowsPerStep; r0 < end; r0 += kUnroll * kRowStride) {
    uint4 raw[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {  // every load first: kUnroll rows in flight per lane
      const int64_t r = r0 + u * kRowStride + step_row;
      raw[u] = make_uint4(0u, 0u, 0u, 0u);
      if (r < end) {
        const int64_t offset = kKeys ? key_row_offset(f, f.k_strides, seq, r) : query_row_offset(f.q_strides, seq, r);
        raw[u] = *reinterpret_cast<const uint4*>(base + offset + d0);
      }
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const bool valid = r0 + u * kRowStride + step_row < end;
      double x[kElems];
      double norm_sq = 0.0;
#pragma unroll
      for (int e = 0; e < kElems; ++e) {
        x[e] = valid ? double(vector_element<Element>(raw[u], e, f.element_type)) - centre[e] : 0.0;
        norm_sq += x[e] * x[e];
      }
#pragma unroll
      for (int e = 0; e < kElems; ++e) x_sum[e] += x[e];
      if (kUnit) {
#pragma unroll
        for (int offset = kLanesPerRow / 2; offset > 0; offset >>= 1) norm_sq += warp_shfl_xor(norm_sq, offset);
        const double inv_norm = norm_sq > 0.0 ? 1.0 / sqrt(norm_sq) : 0.0;  // a zero row adds a zero unit vector
#pragma unroll
        for (int e = 0; e < kElems; ++e) u_sum[e] += x[e] * inv_norm;
      }
    }
  }
  const int slot = warp * kRowsPerStep + step_row;
#pragma unroll
  for (int e = 0; e < kElems; ++e) {
    row_sums[slot * dim + d0 + e] = x_sum[e];
    if (kUnit) unit_sums[slot * dim + d0 + e] = u_sum[e];
  }
  __syncthreads();
  finish_block<kPass>(p, row_sums, unit_sums, kSlots, flat_head, block, double(end - first), partials);
}

// ---- 2. Mean of K over the sequence (§4.1), per kv head: the block sums added in a fixed order, / Skv ----
// grid = (Hkv, B, ceil(D / kMeanDims)); thread (part, d) adds blocks part, part + kMeanParts, ... into
// kMeanAccumulators interleaved sums (several loads in flight), then the parts are added in order.
__global__ void __launch_bounds__(kMeanThreads) key_mean_kernel(const SpargePredictParams p) {
  __shared__ double part_sums[kMeanParts][kMeanDims];
  const ForwardParams& f = p.fwd;
  const int32_t hk = blockIdx.x, b = blockIdx.y;
  const SequenceView seq = kv_head_view(f, b, hk);
  const int64_t blocks = ceil_div64(seq.seq_k, p.block_k);
  const int64_t head = int64_t(b) * p.num_kv_heads + hk;
  const int32_t dim = f.head_dim;
  const double* sums = p.key_block_means + head * p.max_k_blocks * dim;
  const int32_t column = threadIdx.x % kMeanDims, part = threadIdx.x / kMeanDims;
  const int32_t d = blockIdx.z * kMeanDims + column;
  double total = 0.0;
  if (d < dim) {
    double acc[kMeanAccumulators];
#pragma unroll
    for (int a = 0; a < kMeanAccumulators; ++a) acc[a] = 0.0;
    int64_t block = part;
    for (; block + int64_t(kMeanAccumulators - 1) * kMeanParts < blocks; block += kMeanAccumulators * kMeanParts) {
#pragma unroll
      for (int a = 0; a < kMeanAccumulators; ++a) acc[a] += sums[(block + int64_t(a) * kMeanParts) * dim + d];
    }
#pragma unroll
    for (int a = 0; a + 1 < kMeanAccumulators; ++a) {  // the last (fewer than kMeanAccumulators) blocks
      if (block + int64_t(a) * kMeanParts < blocks) acc[a] += sums[(block + int64_t(a) * kMeanParts) * dim + d];
    }
#pragma unroll
    for (int a = 0; a < kMeanAccumulators; ++a) total += acc[a];
  }
  part_sums[part][column] = total;
  __syncthreads();
  if (part == 0 && d < dim) {
    double sum = 0.0;
#pragma unroll
    for (int q = 0; q < kMeanParts; ++q) sum += part_sums[q][column];
    p.key_mean[head * dim + d] = seq.seq_k > 0 ? sum / double(seq.seq_k) : 0.0;
  }
}

// ---- 5. Ŝ[I, J] = scale · q̄_I·k̄_J (§4 step 4) for one head: kScoreTile × kScoreTile outputs per thread block,
// kScoreMicro × kScoreMicro per thread (rows ty + 16·i, columns tx + 16·j), each summed over d in ascending order.
// grid = (key tiles × Hq, query tiles, B). ----
__global__ void __launch_bounds__(kScoreThreads) block_scores_kernel(const SpargePredictParams p) {
  __shared__ double q_tile[kScoreTile][kScoreDimChunk + 1];
  __shared__ double k_tile[kScoreTile][kScoreDimChunk + 1];
  const ForwardParams& f = p.fwd;
  const int32_t key_tiles = (p.max_k_blocks + kScoreTile - 1) / kScoreTile;
  const int32_t h = blockIdx.x / key_tiles;
  const int32_t key_tile = blockIdx.x % key_tiles;
  const int32_t b = blockIdx.z;
  const int32_t hk = h / f.group_size;
  const SequenceView seq = make_sequence_view(f, b, h);
  const int32_t q_blocks = int32_t(ceil_div64(seq.seq_q, p.block_q));
  const int32_t k_blocks = int32_t(ceil_div64(seq.seq_k, p.block_k));
  const int32_t q_first = blockIdx.y * kScoreTile, k_first = key_tile * kScoreTile;
  if (q_first >= q_blocks || k_first >= k_blocks) return;
  const int32_t dim = f.head_dim;
  const double* q_means = p.query_block_means + (int64_t(b) * f.num_q_heads + h) * p.max_q_blocks * dim;
  const double* k_means = p.key_block_means + (int64_t(b) * p.num_kv_heads + hk) * p.max_k_blocks * dim;
  constexpr int kLanes = kScoreTile / kScoreMicro;  // threads along each side of the tile
  const int tx = threadIdx.x % kLanes, ty = threadIdx.x / kLanes;
  double acc[kScoreMicro][kScoreMicro];
#pragma unroll
  for (int i = 0; i < kScoreMicro; ++i)
#pragma unroll
    for (int j = 0; j < kScoreMicro; ++j) acc[i][j] = 0.0;
  for (int d0 = 0; d0 < dim; d0 += kScoreDimChunk) {
    for (int index = threadIdx.x; index < kScoreTile * kScoreDimChunk; index += kScoreThreads) {
      const int r = index / kScoreDimChunk, d = index % kScoreDimChunk;
      const bool in_dim = d0 + d < dim;
      q_tile[r][d] = in_dim && q_first + r < q_blocks ? q_means[int64_t(q_first + r) * dim + d0 + d] : 0.0;
      k_tile[r][d] = in_dim && k_first + r < k_blocks ? k_means[int64_t(k_first + r) * dim + d0 + d] : 0.0;
    }
    __syncthreads();
    const int d_end = min(kScoreDimChunk, dim - d0);
    for (int d = 0; d < d_end; ++d) {
      double q[kScoreMicro], k[kScoreMicro];
#pragma unroll
      for (int i = 0; i < kScoreMicro; ++i) {
        q[i] = q_tile[ty + kLanes * i][d];
        k[i] = k_tile[tx + kLanes * i][d];
      }
#pragma unroll
      for (int i = 0; i < kScoreMicro; ++i)
#pragma unroll
        for (int j = 0; j < kScoreMicro; ++j) acc[i][j] += q[i] * k[j];
    }
    __syncthreads();
  }
#pragma unroll
  for (int i = 0; i < kScoreMicro; ++i) {
    const int32_t query_block = q_first + ty + kLanes * i;
    if (query_block >= q_blocks) continue;
    const int64_t row = (int64_t(b) * f.num_q_heads + h) * p.max_q_blocks + query_block;
#pragma unroll
    for (int j = 0; j < kScoreMicro; ++j) {
      const int32_t key_block = k_first + tx + kLanes * j;
      if (key_block < k_blocks) p.scores[row * p.max_k_blocks + key_block] = p.scale * acc[i][j];
    }
  }
}

// ---- 6. Selection, one mask row (b, h, I) at a time ----
//
// The rank order (§0: larger P̂ first, the smaller index wins a tie, NaN after every number) is sorted as one
// 64-bit key per key block: the top bits are P̂'s bit pattern (P̂ >= 0, so its bits order like its value) with its
// lowest id_bits bits dropped, plus 1 (0 marks NaN); the low id_bits bits hold id_span − 1 − index. Padding entries
// are 0 and sort last. Dropping id_bits (<= 16 for 32K key blocks) of the mantissa ranks two values within a relative
// 2^-36 of each other by index instead of by value: the CPU's choice there is decided by rounding anyway. The
// cumulative sum reads the exact P̂.

__device__ __forceinline__ uint64_t rank_key(double value, int32_t index, int id_bits) {
  const uint64_t id_span = uint64_t(1) << id_bits;
  const uint64_t value_key = isnan(value) ? 0 : (uint64_t(__double_as_longlong(value)) >> id_bits) + 1;
  return (value_key << id_bits) | (id_span - 1 - uint64_t(index));
}
__device__ __forceinline__ int32_t rank_key_index(uint64_t key, int id_bits) {
  const uint64_t id_span = uint64_t(1) << id_bits;
  return int32_t(id_span - 1 - (key & (id_span - 1)));
}

// Bitonic sort of n (a power of two) keys, descending, by the whole thread block.
__device__ void bitonic_sort_descending(uint64_t* keys, int32_t n) {
  for (int32_t size = 2; size <= n; size <<= 1) {
    for (int32_t stride = size >> 1; stride > 0; stride >>= 1) {
      for (int32_t pair = threadIdx.x; pair < n / 2; pair += blockDim.x) {
        const int32_t lo = (pair / stride) * 2 * stride + pair % stride;
        const int32_t hi = lo + stride;
        const uint64_t a = keys[lo], c = keys[hi];
        const bool descending = (lo & size) == 0;  // this run ends up descending (else ascending, to be merged)
        if ((c > a) == descending) {
          keys[lo] = c;
          keys[hi] = a;
        }
      }
      __syncthreads();
    }
  }
}

// TopCdf (§4 step 5): the number of leading ranks whose cumulative sum stays <= tau, i.e. the first rank r with
// Σ_{r' <= r} P̂ > tau (n when there is none). Each thread sums a contiguous run of ranks; an inclusive scan over
// the threads gives every run its starting sum.
__device__ int32_t top_cdf_count(const uint64_t* sorted, const double* values, int id_bits, int32_t n, double tau,
                                 double* thread_sums, double* partials) {
  const int32_t per_thread = (n + blockDim.x - 1) / blockDim.x;
  const int32_t begin = min(n, int32_t(threadIdx.x) * per_thread);
  const int32_t end = min(n, begin + per_thread);
  double run = 0.0;
  for (int32_t r = begin; r < end; ++r) run += values[rank_key_index(sorted[r], id_bits)];
  thread_sums[threadIdx.x] = run;
  __syncthreads();
  for (int32_t stride = 1; stride < int32_t(blockDim.x); stride <<= 1) {  // inclusive Hillis–Steele scan
    const double add = threadIdx.x >= uint32_t(stride) ? thread_sums[threadIdx.x - stride] : 0.0;
    __syncthreads();
    thread_sums[threadIdx.x] += add;
    __syncthreads();
  }
  double cumulative = threadIdx.x > 0 ? thread_sums[threadIdx.x - 1] : 0.0;  // the runs before this one
  int32_t first_over = n;
  for (int32_t r = begin; r < end; ++r) {
    cumulative += values[rank_key_index(sorted[r], id_bits)];
    if (cumulative > tau) {
      first_over = r;
      break;
    }
  }
  return int32_t(block_reduce<kSelectWarps>(double(first_over), partials,
                                            [](double a, double c) { return fmin(a, c); }));
}

__global__ void __launch_bounds__(kSelectThreads) select_kernel(const SpargePredictParams p) {
  __shared__ double shared_values[kSpargeSharedSortEntries];
  __shared__ uint64_t shared_keys[kSpargeSharedSortEntries];
  __shared__ uint8_t shared_flags[kSpargeSharedSortEntries];
  __shared__ double thread_sums[kSelectThreads];
  __shared__ double partials[kSelectWarps];
  const ForwardParams& f = p.fwd;
  const bool global_sort = p.sort_capacity > 0;
  double* values = global_sort ? p.sort_values + int64_t(blockIdx.x) * p.sort_capacity : shared_values;
  uint64_t* keys = global_sort ? p.sort_keys + int64_t(blockIdx.x) * p.sort_capacity : shared_keys;
  uint8_t* kept = global_sort ? p.sort_flags + int64_t(blockIdx.x) * p.sort_capacity : shared_flags;
  const int64_t total_rows = int64_t(f.batch) * f.num_q_heads * p.max_q_blocks;

  for (int64_t row = blockIdx.x; row < total_rows; row += gridDim.x) {
    const int32_t query_block = int32_t(row % p.max_q_blocks);
    const int32_t h = int32_t((row / p.max_q_blocks) % f.num_q_heads);
    const int32_t b = int32_t(row / (int64_t(p.max_q_blocks) * f.num_q_heads));
    const int32_t hk = h / f.group_size;
    const SequenceView seq = make_sequence_view(f, b, h);
    const int32_t q_blocks = int32_t(ceil_div64(seq.seq_q, p.block_q));
    const int32_t n = query_block < q_blocks ? int32_t(ceil_div64(seq.seq_k, p.block_k)) : 0;  // key blocks
    const double theta = head_param(p, h, kThetaColumn, p.theta);
    const int64_t last_row = min(int64_t(seq.seq_q), int64_t(query_block + 1) * p.block_q) - 1;
    const int64_t horizon = last_row + seq.causal_offset;  // key block J is causally visible iff J·bk <= horizon
    const double* key_sim = p.key_sim + (int64_t(b) * p.num_kv_heads + hk) * p.max_k_blocks;
    const double* scores = p.scores + row * p.max_k_blocks;
    auto visible = [&](int32_t j) { return !f.causal || int64_t(j) * p.block_k <= horizon; };

    // Step 4: Ŝ with −inf for non-self-similar and causally invisible key blocks; its row maximum.
    const int32_t padded = n > 0 ? int32_t(sparge_pow2_at_least(n)) : 0;
    double local_max = -INFINITY;
    for (int32_t j = threadIdx.x; j < n; j += blockDim.x) {
      double score = -INFINITY;
      if (key_sim[j] > theta && visible(j)) score = scores[j];
      values[j] = score;
      kept[j] = 0;
      local_max = fmax(local_max, score);  // like std::max on the CPU, a NaN score never becomes the maximum
    }
    const double row_max =
        block_reduce<kSelectWarps>(local_max, partials, [](double a, double c) { return fmax(a, c); });

    // Step 5 (a row whose Ŝ is all −inf keeps nothing here, only its forced blocks below).
    if (row_max != -INFINITY) {
      double local_sum = 0.0;
      for (int32_t j = threadIdx.x; j < n; j += blockDim.x) {
        values[j] = exp(values[j] - row_max);
        local_sum += values[j];
      }
      const double total = block_reduce<kSelectWarps>(local_sum, partials, [](double a, double c) { return a + c; });
      int id_bits = 0;  // id_span = 2^id_bits > every index
      while ((int64_t(1) << id_bits) <= n) ++id_bits;
      for (int32_t j = threadIdx.x; j < padded; j += blockDim.x) {
        if (j < n) values[j] /= total;
        keys[j] = j < n ? rank_key(values[j], j, id_bits) : 0;
      }
      __syncthreads();
      bitonic_sort_descending(keys, padded);
      const double topk_fraction = head_param(p, h, kTopkColumn, p.topk_fraction);
      const double tau = head_param(p, h, kTauColumn, p.tau);
      int32_t keep = 0;
      if (topk_fraction > 0.0) {
        keep = int32_t(floor(topk_fraction * double(n)));
      } else if (tau >= 1.0) {
        keep = n;  // the exact cumulative sum never exceeds 1 (the CPU's rule: a rounded sum could)
      } else {
        keep = top_cdf_count(keys, values, id_bits, n, tau, thread_sums, partials);
      }
      keep = min(n, max(1, keep));
      for (int32_t r = threadIdx.x; r < keep; r += blockDim.x) kept[rank_key_index(keys[r], id_bits)] = 1;
      __syncthreads();
    }

    // Step 6: forced columns and rows, the sink column, ∧ causal; zero outside the sequence.
    const bool query_similar = query_block < q_blocks && p.query_sim[row] > theta;
    uint8_t* mask_row = p.mask + row * p.max_k_blocks;
    uint8_t* out_row = p.mask_out != nullptr && query_block < p.mask_out_rows
                           ? p.mask_out + b * p.mask_out_strides[0] + h * p.mask_out_strides[1] +
                                 query_block * p.mask_out_strides[2]
                           : nullptr;
    for (int32_t j = threadIdx.x; j < p.max_k_blocks; j += blockDim.x) {
      uint8_t on = 0;
      if (j < n) {
        const bool forced = !(key_sim[j] > theta) || !query_similar || (p.attention_sink && j == 0);
        on = (kept[j] || forced) && visible(j) ? 1 : 0;
      }
      mask_row[j] = on;
      if (out_row != nullptr && j < p.mask_out_cols) out_row[j * p.mask_out_strides[3]] = on;
    }
    __syncthreads();  // the next row reuses values, keys and flags
  }
}

// The per-head PV-skip threshold λ_h · log2(e) (base-2 domain of the forward kernels; −inf stays −inf).
__global__ void pv_skip_table_kernel(const SpargePredictParams p) {
  for (int32_t h = blockIdx.x * blockDim.x + threadIdx.x; h < p.fwd.num_q_heads; h += gridDim.x * blockDim.x) {
    const float lambda = float(head_param(p, h, kLambdaColumn, double(p.lambda)));
    p.pv_skip_log2[h] = lambda == -INFINITY ? -INFINITY : lambda * kLog2e;
  }
}

// The three block passes with scalar loads, for head dimensions up to kDimsPerLane · kWarpLanes.
template <int kDimsPerLane>
void launch_scalar_passes(const SpargePredictParams& p, cudaStream_t stream) {
  const ForwardParams& f = p.fwd;
  const dim3 key_grid(p.max_k_blocks, p.num_kv_heads, f.batch);
  block_pass_kernel<BlockPass::kKeySums, kDimsPerLane><<<key_grid, kStatThreads, 0, stream>>>(p);
  key_mean_kernel<<<dim3(p.num_kv_heads, f.batch, (f.head_dim + kMeanDims - 1) / kMeanDims), kMeanThreads, 0,
                    stream>>>(p);
  block_pass_kernel<BlockPass::kKeyStats, kDimsPerLane><<<key_grid, kStatThreads, 0, stream>>>(p);
  block_pass_kernel<BlockPass::kQueryStats, kDimsPerLane>
      <<<dim3(p.max_q_blocks, f.num_q_heads, f.batch), kStatThreads, 0, stream>>>(p);
}

// The three block passes with 16-byte loads, kLanesPerRow = head_dim / (16 / sizeof(Element)).
template <typename Element, int kLanesPerRow>
void launch_vector_passes(const SpargePredictParams& p, cudaStream_t stream) {
  const ForwardParams& f = p.fwd;
  const dim3 key_grid(p.max_k_blocks, p.num_kv_heads, f.batch);
  block_pass_vector_kernel<BlockPass::kKeySums, Element, kLanesPerRow><<<key_grid, kStatThreads, 0, stream>>>(p);
  key_mean_kernel<<<dim3(p.num_kv_heads, f.batch, (f.head_dim + kMeanDims - 1) / kMeanDims), kMeanThreads, 0,
                    stream>>>(p);
  block_pass_vector_kernel<BlockPass::kKeyStats, Element, kLanesPerRow><<<key_grid, kStatThreads, 0, stream>>>(p);
  block_pass_vector_kernel<BlockPass::kQueryStats, Element, kLanesPerRow>
      <<<dim3(p.max_q_blocks, f.num_q_heads, f.batch), kStatThreads, 0, stream>>>(p);
}

// Vector passes when q and k rows are 16-byte aligned and head_dim fills a power-of-two number of lanes.
bool launch_vector_passes_if_possible(const SpargePredictParams& p, cudaStream_t stream) {
  const ForwardParams& f = p.fwd;
  if (!p.q_rows_aligned16 || !f.kv_rows_aligned16) return false;
  const bool f32 = f.element_type == ElementType::kF32;
  if (f32 && f.head_dim == 64) {
    launch_vector_passes<float, 16>(p, stream);
  } else if (f32 && f.head_dim == 128) {
    launch_vector_passes<float, 32>(p, stream);
  } else if (!f32 && f.head_dim == 64) {
    launch_vector_passes<uint16_t, 8>(p, stream);
  } else if (!f32 && f.head_dim == 128) {
    launch_vector_passes<uint16_t, 16>(p, stream);
  } else if (!f32 && f.head_dim == 256) {
    launch_vector_passes<uint16_t, 32>(p, stream);
  } else {
    return false;
  }
  return true;
}

}  // namespace

cudaError_t sparge_predict_launch(const SpargePredictParams& p, cudaStream_t stream) {
  const ForwardParams& f = p.fwd;
  constexpr int kMaxDimsPerLane = (kMaxHeadDim + kWarpLanes - 1) / kWarpLanes;
  const int dims_per_lane = (f.head_dim + kWarpLanes - 1) / kWarpLanes;
  if (!launch_vector_passes_if_possible(p, stream)) {
    if (dims_per_lane <= kMaxDimsPerLane / 4) {
      launch_scalar_passes<kMaxDimsPerLane / 4>(p, stream);
    } else if (dims_per_lane <= kMaxDimsPerLane / 2) {
      launch_scalar_passes<kMaxDimsPerLane / 2>(p, stream);
    } else {
      launch_scalar_passes<kMaxDimsPerLane>(p, stream);
    }
  }
  const int32_t key_tiles = (p.max_k_blocks + kScoreTile - 1) / kScoreTile;
  const int32_t query_tiles = (p.max_q_blocks + kScoreTile - 1) / kScoreTile;
  block_scores_kernel<<<dim3(key_tiles * f.num_q_heads, query_tiles, f.batch), kScoreThreads, 0, stream>>>(p);
  select_kernel<<<p.select_grid, kSelectThreads, 0, stream>>>(p);
  if (p.pv_skip_log2 != nullptr) {
    constexpr int kTableThreads = 128;
    pv_skip_table_kernel<<<(f.num_q_heads + kTableThreads - 1) / kTableThreads, kTableThreads, 0, stream>>>(p);
  }
  return cudaGetLastError();
}

SPARSA_GPU_NAMESPACE_END
