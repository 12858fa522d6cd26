// §5 TOKEN_SPARSE score passes 1 and 2 (token_sparse_common.cuh says what each computes), in two precisions:
//
// fp32 (score_fp32_kernel; NVIDIA, fp16/bf16 q/k, head_dim a multiple of 16 up to 128, 16-byte aligned rows): the
// window rows' Q fragments stay in registers (ldmatrix once per 128-row tile), K tiles of 64 keys arrive through a
// two-stage cp.async ring, mma.sync m16n8k16 accumulates in fp32, and the softmax statistics are fp32 in log2
// units (one ex2.approx per score). Each warp owns 16 whole rows of the tile, so pass 1's row max/sum need only
// quad shuffles; pass 2's column sums go through one shared-memory step per tile, added in a fixed order
// (deterministic). The float64 arrays downstream (partials, p_h) keep their layout: pooling, the budget and the
// top-k are unchanged.
//
// Error bound (ALGORITHMS.md §0, "Precision of selections"): products of fp16/bf16 values are exact in fp32 and D
// of them are accumulated, so a score S = scale·q·k is off by at most
//     E = scale · D · 2^-22 · max_r ‖q_r‖ · max_j ‖k_j‖        (over the (sequence, head)'s window rows and keys)
// (2^-22: twice fp32's unit roundoff, for the tensor core's accumulation). exp(S − lse) is then off by a relative
// 2E (S and lse each by E) plus rounding (ex2.approx 2^-22, fp32 sums of <= 256 terms, the lse's conversion);
// normalising p_h into ŝ_h doubles the relative error and the layer score's normalisation doubles it again, so
//     |ŝ_h − ŝ_h*| <= eps · ŝ_h*   and   |s_l − s_l*| <= eps · s_l*,   eps = 8E + 2^-12,
// against the float64 oracle (*). Every top-budget decision whose oracle score is farther than eps (relative) from
// the threshold, and every coverage count whose cumulative sum is farther than eps·τ from τ, agrees with the CPU.
// tests/case_table.cpp (audit_sparse_sets, the TokenSparseCases rows) checks exactly that, on inputs with decisions
// on both sides of eps.
//
// float64 (score_f64_kernel; everything else, HIP included): dot products, exponentials and sums in float64 as on
// the CPU (tensor-core DMMA m8n8k4 on sm_80+, FMAs elsewhere); scores agree with the CPU's to ~1e-15 relative.
#include "../../../src/error.h"
#include "../runtime/gpu_launch.h"
#include "token_sparse_common.cuh"

#if SPARSA_GPU_HAS_MMA_SYNC
#include "../kernels/mma_primitives.cuh"
#endif

SPARSA_GPU_NAMESPACE_BEGIN
namespace token_sparse {
namespace {

// ================================================================================== float64 scores
// ---- tiles ----
// A block computes kTileRows window rows × kTileKeys keys; its 8 warps each own kWarpRows × kWarpKeys (4 × 4 DMMA
// m8n8k4 fragments). The fragment layout is that of 32 lanes; on a 64-wide HIP wavefront each half plays one warp
// (the FMA fallback runs there, and every shuffle below stays inside a 32-lane half).
constexpr int kScoreThreads = 256;
static_assert(kWarpLanes % kLanes == 0, "a warp or wavefront holds whole 32-lane groups");
static_assert(kWarpLanes == kLanes || !SPARSA_GPU_DEVICE_HAS_MMA_SYNC, "m8n8k4 fragments are laid out over 32 lanes");
constexpr int kTileRows = 128;
constexpr int kTileKeys = 64;
constexpr int kWarpRows = 32;
constexpr int kWarpKeys = 32;
constexpr int kWarpsAlongKeys = kTileKeys / kWarpKeys;  // 2
constexpr int kWarpsAlongRows = kTileRows / kWarpRows;  // 4
constexpr int kMmaM = 8, kMmaN = 8;                      // mma.sync m8n8k4 .f64 (the FMA path keeps its layout)
[[maybe_unused]] constexpr int kMmaK = 4;                 // the MMA path only (not compiled for HIP)
constexpr int kFragsM = kWarpRows / kMmaM;                // 4
constexpr int kFragsN = kWarpKeys / kMmaN;                // 4
constexpr int kStageDims = 16;                            // head dims staged in shared memory per step
// Doubles per staged row: a fragment read touches rows lane/4 (8 rows) × columns lane%4; a pitch of 20 (≡ 4 mod 16
// double-banks) puts each half-warp's 16 reads in 16 distinct banks.
constexpr int kStagePitch = kStageDims + 4;
constexpr int kStageGroup = 8;  // dims one thread stages at a time (one 16-byte load of a 16-bit row)
constexpr int kGroupsPerRow = kStageDims / kStageGroup;
static_assert(kKeysPerBlock % kTileKeys == 0, "a key chunk is whole tiles");
static_assert(kWarpsAlongKeys * kWarpsAlongRows * kLanes == kScoreThreads, "8 warps cover the tile");



// Dims [d, d + 8) of the row at element offset `row`, as float64 (zeros past the head dim).
__device__ __forceinline__ void load_group(const void* base, int64_t row, int32_t d, int32_t dim, ElementType type,
                                           bool aligned16, double (&out)[kStageGroup]) {
  if (aligned16 && d + kStageGroup <= dim) {  // row and d are multiples of 8 elements: 16-byte (f32: 32-byte) aligned
    if (type == ElementType::kF32) {
      const float4* src = reinterpret_cast<const float4*>(static_cast<const float*>(base) + row + d);
      const float4 lo = src[0], hi = src[1];
      const float values[kStageGroup] = {lo.x, lo.y, lo.z, lo.w, hi.x, hi.y, hi.z, hi.w};
#pragma unroll
      for (int t = 0; t < kStageGroup; ++t) out[t] = values[t];
      return;
    }
    const uint4 raw = *reinterpret_cast<const uint4*>(static_cast<const uint16_t*>(base) + row + d);
    const uint32_t words[kStageGroup / 2] = {raw.x, raw.y, raw.z, raw.w};
#pragma unroll
    for (int t = 0; t < kStageGroup; ++t) {
      const uint16_t bits = static_cast<uint16_t>(words[t / 2] >> (16 * (t % 2)));
      out[t] = type == ElementType::kF16 ? f16_bits_to_float(bits) : bf16_bits_to_float(bits);
    }
    return;
  }
#pragma unroll
  for (int t = 0; t < kStageGroup; ++t) out[t] = d + t < dim ? double(load_value(base, row + d + t, type)) : 0.0;
}

// Stages dims [d0, d0 + kStageDims) of window rows [w0, w0 + rows) and of keys [key0, key0 + keys) as float64;
// rows and keys past those ranges are zero.
__device__ void stage_dims(const SparseParams& sp, const SequenceView& s, const SparseSequence& seq, int32_t w0,
                           int32_t rows, int32_t key0, int32_t keys, int32_t d0,
                           double (*q_tile)[kStagePitch], double (*k_tile)[kStagePitch]) {
  const ForwardParams& p = sp.fw;
  for (int item = threadIdx.x; item < (kTileRows + kTileKeys) * kGroupsPerRow; item += blockDim.x) {
    const int r = item / kGroupsPerRow;
    const int column = (item % kGroupsPerRow) * kStageGroup;
    double values[kStageGroup] = {};
    double* dst;
    if (r < kTileRows) {
      dst = &q_tile[r][column];
      if (r < rows) {
        const int64_t row = query_row_offset(p.q_strides, s, seq.candidates + w0 + r);  // window row = L − W + w
        load_group(p.q, row, d0 + column, p.head_dim, p.element_type, sp.q_aligned16, values);
      }
    } else {
      const int key = r - kTileRows;
      dst = &k_tile[key][column];
      if (key < keys) {
        const int64_t row = key_row_offset(p, p.k_strides, s, key0 + key);
        load_group(p.k, row, d0 + column, p.head_dim, p.element_type, p.kv_rows_aligned16, values);
      }
    }
#pragma unroll
    for (int t = 0; t < kStageGroup; ++t) dst[t] = values[t];
  }
}

// Fragment coordinates of this thread: accumulator (i, j, c) holds tile row warp_row0 + 8i + lane/4 and tile key
// warp_key0 + 8j + 2(lane%4) + c (the m8n8k4 accumulator layout; the FMA fallback computes the same elements).
struct FragmentPlace {
  int32_t row0 = 0;  // tile row of i = 0
  int32_t key0 = 0;  // tile key of j = 0, c = 0
};
using Accumulators = double[kFragsM][kFragsN][2];

__device__ __forceinline__ FragmentPlace fragment_place() {
  const int warp = threadIdx.x / kLanes, lane = threadIdx.x % kLanes;
  FragmentPlace f;
  f.row0 = (warp / kWarpsAlongKeys) * kWarpRows + lane / 4;
  f.key0 = (warp % kWarpsAlongKeys) * kWarpKeys + 2 * (lane % 4);
  return f;
}

// acc += Q_tile · K_tileᵀ over the staged dims.
__device__ __forceinline__ void tile_product(const double (*q_tile)[kStagePitch], const double (*k_tile)[kStagePitch],
                                             Accumulators& acc) {
  const int warp = threadIdx.x / kLanes, lane = threadIdx.x % kLanes;
  const int warp_row0 = (warp / kWarpsAlongKeys) * kWarpRows;
  const int warp_key0 = (warp % kWarpsAlongKeys) * kWarpKeys;
#if SPARSA_GPU_DEVICE_HAS_MMA_SYNC
  // A (8 rows × 4 dims, row-major): lane holds row lane/4, dim lane%4; B (4 dims × 8 keys, col-major): lane holds
  // dim lane%4, key lane/4 — i.e. both read [row or key][dim] of the staged tiles.
#pragma unroll
  for (int k = 0; k < kStageDims; k += kMmaK) {
    double a[kFragsM], b[kFragsN];
#pragma unroll
    for (int i = 0; i < kFragsM; ++i) a[i] = q_tile[warp_row0 + kMmaM * i + lane / 4][k + lane % 4];
#pragma unroll
    for (int j = 0; j < kFragsN; ++j) b[j] = k_tile[warp_key0 + kMmaN * j + lane / 4][k + lane % 4];
#pragma unroll
    for (int i = 0; i < kFragsM; ++i) {
#pragma unroll
      for (int j = 0; j < kFragsN; ++j) {
        asm("mma.sync.aligned.m8n8k4.row.col.f64.f64.f64.f64 {%0,%1}, {%2}, {%3}, {%0,%1};\n"
            : "+d"(acc[i][j][0]), "+d"(acc[i][j][1])
            : "d"(a[i]), "d"(b[j]));
      }
    }
  }
#else
  const int row0 = warp_row0 + lane / 4, key0 = warp_key0 + 2 * (lane % 4);
  for (int k = 0; k < kStageDims; ++k) {
    double a[kFragsM], b[kFragsN][2];
#pragma unroll
    for (int i = 0; i < kFragsM; ++i) a[i] = q_tile[row0 + kMmaM * i][k];
#pragma unroll
    for (int j = 0; j < kFragsN; ++j) {
      b[j][0] = k_tile[key0 + kMmaN * j][k];
      b[j][1] = k_tile[key0 + kMmaN * j + 1][k];
    }
#pragma unroll
    for (int i = 0; i < kFragsM; ++i) {
#pragma unroll
      for (int j = 0; j < kFragsN; ++j) {
        acc[i][j][0] = fma(a[i], b[j][0], acc[i][j][0]);
        acc[i][j][1] = fma(a[i], b[j][1], acc[i][j][1]);
      }
    }
  }
#endif
}

// Pass 1 epilogue: merges the tile's scores (−inf where masked) into the running (max, Σexp) of each tile row.
// `reduce` slots 0..1 take the two key-warps' partials, slot 2 the new running max.
__device__ void merge_row_stats(const Accumulators& scores, double (*reduce)[kTileRows], double* row_max,
                                double* row_sum) {
  const FragmentPlace f = fragment_place();
  const int key_warp = (threadIdx.x / kLanes) % kWarpsAlongKeys;
  const bool writer = threadIdx.x % 4 == 0;
#pragma unroll
  for (int i = 0; i < kFragsM; ++i) {
    double m = kNegInf;
#pragma unroll
    for (int j = 0; j < kFragsN; ++j) m = fmax(m, fmax(scores[i][j][0], scores[i][j][1]));
    m = fmax(m, warp_shfl_xor(m, 1));  // the 4 lanes of one row
    m = fmax(m, warp_shfl_xor(m, 2));
    if (writer) reduce[key_warp][f.row0 + kMmaM * i] = m;
  }
  __syncthreads();
  for (int r = threadIdx.x; r < kTileRows; r += blockDim.x) {
    reduce[2][r] = fmax(row_max[r], fmax(reduce[0][r], reduce[1][r]));
  }
  __syncthreads();
#pragma unroll
  for (int i = 0; i < kFragsM; ++i) {
    const double m = reduce[2][f.row0 + kMmaM * i];
    double sum = 0.0;
#pragma unroll
    for (int j = 0; j < kFragsN; ++j) {
#pragma unroll
      for (int c = 0; c < 2; ++c) sum += scores[i][j][c] == kNegInf ? 0.0 : exp(scores[i][j][c] - m);
    }
    sum += warp_shfl_xor(sum, 1);
    sum += warp_shfl_xor(sum, 2);
    if (writer) reduce[key_warp][f.row0 + kMmaM * i] = sum;
  }
  __syncthreads();
  for (int r = threadIdx.x; r < kTileRows; r += blockDim.x) {
    const double m = reduce[2][r];
    const double rescale = row_max[r] == kNegInf ? 0.0 : exp(row_max[r] - m);
    row_sum[r] = row_sum[r] * rescale + reduce[0][r] + reduce[1][r];
    row_max[r] = m;
  }
}

// Pass 2 epilogue: column_sum[tile key] += Σ_rows exp(S[r, key] − lse_r) over the valid rows (masked scores are
// −inf and add 0). `reduce` slots 0..3 take the four row-warps' partials.
__device__ void add_column_sums(const Accumulators& scores, const double* lse, double (*reduce)[kTileRows],
                                double* column_sum) {
  const FragmentPlace f = fragment_place();
  const int row_warp = (threadIdx.x / kLanes) / kWarpsAlongKeys;
#pragma unroll
  for (int j = 0; j < kFragsN; ++j) {
#pragma unroll
    for (int c = 0; c < 2; ++c) {
      double sum = 0.0;
#pragma unroll
      for (int i = 0; i < kFragsM; ++i) {
        const double s = scores[i][j][c];
        sum += s == kNegInf ? 0.0 : exp(s - lse[f.row0 + kMmaM * i]);
      }
      sum += warp_shfl_xor(sum, 4);  // the 8 lanes of one key column
      sum += warp_shfl_xor(sum, 8);
      sum += warp_shfl_xor(sum, 16);
      if (threadIdx.x % kLanes < 4) reduce[row_warp][f.key0 + kMmaN * j + c] = sum;
    }
  }
  __syncthreads();
  for (int k = threadIdx.x; k < kTileKeys; k += blockDim.x) {
    double sum = 0.0;
    for (int w = 0; w < kWarpsAlongRows; ++w) sum += reduce[w][k];
    column_sum[k] += sum;
  }
}

// One block per (kKeysPerBlock keys, query head, sequence). kCandidateSums = false: pass 1 over keys [0, L), the
// window rows' (max, Σexp) partials. true: pass 2 over the candidates [0, L − W), p_h[j].
template <bool kCandidateSums>
__global__ void __launch_bounds__(kScoreThreads) score_f64_kernel(const SparseParams sp) {
  __shared__ double q_tile[kTileRows][kStagePitch];
  __shared__ double k_tile[kTileKeys][kStagePitch];
  __shared__ double reduce[kWarpsAlongRows][kTileRows];
  __shared__ double row_max[kTileRows];  // pass 1: running max; pass 2: the rows' lse
  __shared__ double row_sum[kTileRows];
  __shared__ double column_sum[kKeysPerBlock];

  const int32_t chunk = blockIdx.x, h = blockIdx.y, b = blockIdx.z;
  const SequenceView s = make_sequence_view(sp.fw, b, h);
  const SparseSequence seq = sparse_sequence(sp, s);
  const int32_t key_limit = kCandidateSums ? seq.candidates : seq.length;
  const int32_t chunk_begin = chunk * kKeysPerBlock;
  if (seq.dense || chunk_begin >= key_limit) return;  // uniform over the block
  const int32_t chunk_end = min(chunk_begin + kKeysPerBlock, key_limit);
  const int64_t head = int64_t(b) * sp.fw.num_q_heads + h;
  const FragmentPlace f = fragment_place();
  for (int k = threadIdx.x; k < kKeysPerBlock; k += blockDim.x) column_sum[k] = 0.0;

  for (int32_t w0 = 0; w0 < sp.window; w0 += kTileRows) {
    const int32_t rows = min(kTileRows, sp.window - w0);
    for (int r = threadIdx.x; r < kTileRows; r += blockDim.x) {
      row_max[r] = kCandidateSums ? (r < rows ? sp.row_lse[head * sp.window + w0 + r] : 0.0) : kNegInf;
      row_sum[r] = 0.0;
    }
    for (int32_t key0 = chunk_begin; key0 < chunk_end; key0 += kTileKeys) {
      const int32_t keys = min(kTileKeys, chunk_end - key0);
      Accumulators acc = {};
      for (int32_t d0 = 0; d0 < sp.fw.head_dim; d0 += kStageDims) {
        __syncthreads();  // the previous step's tiles (and epilogue) are done with
        stage_dims(sp, s, seq, w0, rows, key0, keys, d0, q_tile, k_tile);
        __syncthreads();
        tile_product(q_tile, k_tile, acc);
      }
      // scale, and −inf outside the tile's rows/keys or (pass 1) past the row's causal bound j <= L − W + w.
#pragma unroll
      for (int i = 0; i < kFragsM; ++i) {
        const int32_t row = f.row0 + kMmaM * i;
#pragma unroll
        for (int j = 0; j < kFragsN; ++j) {
#pragma unroll
          for (int c = 0; c < 2; ++c) {
            const int32_t key = f.key0 + kMmaN * j + c;
            const bool visible =
                row < rows && key < keys && (kCandidateSums || key0 + key <= seq.candidates + w0 + row);
            acc[i][j][c] = visible ? acc[i][j][c] * sp.scale : kNegInf;
          }
        }
      }
      if (kCandidateSums) {
        add_column_sums(acc, row_max, reduce, column_sum + (key0 - chunk_begin));
      } else {
        merge_row_stats(acc, reduce, row_max, row_sum);
      }
    }
    if (!kCandidateSums) {
      __syncthreads();
      const int64_t at = (head * sp.key_chunks + chunk) * sp.window + w0;
      for (int r = threadIdx.x; r < rows; r += blockDim.x) {
        sp.partial_max[at + r] = row_max[r];
        sp.partial_sum[at + r] = row_sum[r];
      }
    }
  }
  if (kCandidateSums) {
    __syncthreads();
    double* p = sp.attention + head * sp.cand_stride;
    for (int k = threadIdx.x; k < chunk_end - chunk_begin; k += blockDim.x) {
      p[chunk_begin + k] = column_sum[k] / double(sp.window);
    }
  }
}

// ================================================================================== fp32 scores (tensor cores)

#if SPARSA_GPU_HAS_MMA_SYNC  // NVIDIA only (mma.sync, ldmatrix, cp.async)
constexpr int kFp32Threads = 256;                  // 8 warps × 16 window rows
constexpr int kFp32Rows = 128;                     // window rows per pass over the chunk
constexpr int kFp32Keys = 64;                      // keys per K tile: 8 mma n-fragments per warp
constexpr int kFp32MaxDim = 128;                   // Q fragments in registers: head_dim / 16 × 4 words
constexpr int kFp32Pitch = kFp32MaxDim + 8;        // halves per staged row: 272 bytes, an odd multiple of 16
                                                   // bytes, so each 8-row ldmatrix phase hits 8 distinct bank groups
constexpr int kFp32KeyTileHalves = kFp32Keys * kFp32Pitch;
constexpr int kFp32StageHalves = kFp32Rows * kFp32Pitch;  // the Q tile, then two K tiles in the same space
constexpr int kFp32Fragments = kFp32Keys / 8;
constexpr int kChunkLoads = 8;                     // halves per 16-byte load
constexpr float kLog2e = 1.4426950408889634f;
static_assert(2 * kFp32KeyTileHalves == kFp32StageHalves, "two K stages fill the Q tile's space");
static_assert(kKeysPerBlock % kFp32Keys == 0, "a key chunk is whole tiles");
static_assert(kFp32Rows == (kFp32Threads / kLanes) * 16, "one 16-row mma tile per warp");

template <typename Tag, bool kCandidateSums>
__global__ void __launch_bounds__(kFp32Threads) score_fp32_kernel(const SparseParams sp) {
#if SPARSA_GPU_DEVICE_HAS_MMA_SYNC
  __shared__ __align__(16) uint16_t stage[kFp32StageHalves];
  __shared__ float column_partial[kFp32Threads / kLanes][kFp32Keys];
  __shared__ double column_sum[kKeysPerBlock];

  const int32_t chunk = blockIdx.x, h = blockIdx.y, b = blockIdx.z;
  const ForwardParams& p = sp.fw;
  const SequenceView s = make_sequence_view(p, b, h);
  const SparseSequence seq = sparse_sequence(sp, s);
  const int32_t key_limit = kCandidateSums ? seq.candidates : seq.length;
  const int32_t chunk_begin = chunk * kKeysPerBlock;
  if (seq.dense || chunk_begin >= key_limit) return;  // uniform over the block
  const int32_t chunk_end = min(chunk_begin + kKeysPerBlock, key_limit);
  const int32_t tiles = (chunk_end - chunk_begin + kFp32Keys - 1) / kFp32Keys;
  const int64_t head = int64_t(b) * p.num_q_heads + h;
  const int warp = threadIdx.x / kLanes, lane = threadIdx.x % kLanes;
  const int32_t dim = p.head_dim, ksteps = dim / 16, row_loads = dim / kChunkLoads;
  const float scale2 = float(sp.scale) * kLog2e;  // scores in log2 units
  const uint16_t* q = static_cast<const uint16_t*>(p.q);
  const uint16_t* k = static_cast<const uint16_t*>(p.k);
  const int row_lo = warp * 16 + lane / 4;  // tile rows of accumulator elements 0–1 (and +8: elements 2–3)
  for (int i = threadIdx.x; i < kKeysPerBlock; i += blockDim.x) column_sum[i] = 0.0;

  for (int32_t w0 = 0; w0 < sp.window; w0 += kFp32Rows) {
    const int32_t rows = min(kFp32Rows, sp.window - w0);
    // The Q tile (rows past `rows` zero), then this warp's fragments into registers.
    __syncthreads();  // the previous row tile's K stages are done with
    for (int item = threadIdx.x; item < kFp32Rows * row_loads; item += blockDim.x) {
      const int r = item / row_loads, column = (item % row_loads) * kChunkLoads;
      uint4 value = make_uint4(0, 0, 0, 0);
      if (r < rows) {
        value = *reinterpret_cast<const uint4*>(q + query_row_offset(p.q_strides, s, seq.candidates + w0 + r) + column);
      }
      *reinterpret_cast<uint4*>(&stage[r * kFp32Pitch + column]) = value;
    }
    __syncthreads();
    uint32_t q_frag[kFp32MaxDim / 16][4];
#pragma unroll
    for (int ks = 0; ks < kFp32MaxDim / 16; ++ks) {
      if (ks < ksteps) {
        const int r = warp * 16 + (lane % 8) + ((lane / 8) % 2) * 8, column = ks * 16 + (lane / 16) * 8;
        mma::ldmatrix_x4(q_frag[ks], mma::shared_address(&stage[r * kFp32Pitch + column]));
      }
    }
    __syncthreads();  // the stage space becomes the K ring

    float row_stat[2];  // pass 1: running max (log2 units); pass 2: lse (log2 units; +inf for rows past `rows`)
    float row_sum[2] = {0.f, 0.f};  // pass 1: this lane's part of Σ 2^(S − max)
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const int r = row_lo + 8 * half;
      row_stat[half] = kCandidateSums ? (r < rows ? float(sp.row_lse[head * sp.window + w0 + r]) * kLog2e : INFINITY)
                                      : -INFINITY;
    }

    auto load_tile = [&](int32_t tile) {
      uint16_t* dst = &stage[(tile % 2) * kFp32KeyTileHalves];
      const int32_t key0 = chunk_begin + tile * kFp32Keys;
      for (int item = threadIdx.x; item < kFp32Keys * row_loads; item += blockDim.x) {
        const int r = item / row_loads, column = (item % row_loads) * kChunkLoads;
        const bool valid = key0 + r < chunk_end;
        const uint16_t* src = valid ? k + key_row_offset(p, p.k_strides, s, key0 + r) + column : k;
        mma::cp_async_16(mma::shared_address(&dst[r * kFp32Pitch + column]), src, valid ? 16 : 0);
      }
      mma::cp_async_commit();
    };
    load_tile(0);
    for (int32_t tile = 0; tile < tiles; ++tile) {
      if (tile + 1 < tiles) {
        load_tile(tile + 1);
        mma::cp_async_wait<1>();
      } else {
        mma::cp_async_wait<0>();
      }
      __syncthreads();
      const uint16_t* k_tile = &stage[(tile % 2) * kFp32KeyTileHalves];
      float acc[kFp32Fragments][4] = {};
#pragma unroll
      for (int ks = 0; ks < kFp32MaxDim / 16; ++ks) {
        if (ks < ksteps) {
#pragma unroll
          for (int nf = 0; nf < kFp32Fragments; nf += 2) {
            uint32_t b_frag[4];
            const int key = nf * 8 + (lane % 8) + (lane / 16) * 8, column = ks * 16 + ((lane / 8) % 2) * 8;
            mma::ldmatrix_x4(b_frag, mma::shared_address(&k_tile[key * kFp32Pitch + column]));
            mma::mma_16816(Tag{}, acc[nf], q_frag[ks], b_frag[0], b_frag[1]);
            mma::mma_16816(Tag{}, acc[nf + 1], q_frag[ks], b_frag[2], b_frag[3]);
          }
        }
      }
      const int32_t key0 = chunk_begin + tile * kFp32Keys;
      if (!kCandidateSums) {
        // Element (nf, e): row row_lo + 8·(e / 2), key key0 + 8·nf + 2·(lane % 4) + e % 2; −inf where masked.
#pragma unroll
        for (int half = 0; half < 2; ++half) {
          const int r = row_lo + 8 * half;
          const int32_t bound = seq.candidates + w0 + r;  // causal: key <= the row's position
          float tile_max = -INFINITY;
#pragma unroll
          for (int nf = 0; nf < kFp32Fragments; ++nf) {
#pragma unroll
            for (int e = 0; e < 2; ++e) {
              const int32_t key = key0 + nf * 8 + 2 * (lane % 4) + e;
              const bool visible = r < rows && key < chunk_end && key <= bound;
              float& score = acc[nf][2 * half + e];
              score = visible ? score * scale2 : -INFINITY;
              tile_max = fmaxf(tile_max, score);
            }
          }
          tile_max = fmaxf(tile_max, warp_shfl_xor(tile_max, 1));  // the 4 lanes of one row
          tile_max = fmaxf(tile_max, warp_shfl_xor(tile_max, 2));
          const float new_max = fmaxf(row_stat[half], tile_max);
          if (new_max == -INFINITY) continue;  // nothing visible yet (quad-uniform)
          float sum = row_stat[half] == -INFINITY ? 0.f : row_sum[half] * mma::fast_exp2(row_stat[half] - new_max);
#pragma unroll
          for (int nf = 0; nf < kFp32Fragments; ++nf) {
#pragma unroll
            for (int e = 0; e < 2; ++e) sum += mma::fast_exp2(acc[nf][2 * half + e] - new_max);  // 2^-inf = 0
          }
          row_sum[half] = sum;
          row_stat[half] = new_max;
        }
      } else {
        // Every window row sees every candidate: p_h[j] += Σ_r 2^(S − lse_r) (rows past `rows` have lse +inf).
#pragma unroll
        for (int nf = 0; nf < kFp32Fragments; ++nf) {
#pragma unroll
          for (int e = 0; e < 2; ++e) {
            float sum = mma::fast_exp2(acc[nf][e] * scale2 - row_stat[0]) +
                        mma::fast_exp2(acc[nf][2 + e] * scale2 - row_stat[1]);
            sum += warp_shfl_xor(sum, 4);  // the 8 lanes of one key column: the warp's 16 rows
            sum += warp_shfl_xor(sum, 8);
            sum += warp_shfl_xor(sum, 16);
            if (lane < 4) column_partial[warp][nf * 8 + 2 * lane + e] = sum;
          }
        }
        __syncthreads();
        for (int key = threadIdx.x; key < kFp32Keys; key += blockDim.x) {
          float sum = 0.f;
          for (int w = 0; w < kFp32Threads / kLanes; ++w) sum += column_partial[w][key];
          if (key0 + key < chunk_end) column_sum[key0 - chunk_begin + key] += double(sum);
        }
      }
      __syncthreads();  // this stage is refilled by the load two tiles on, and column_partial reused
    }
    if (!kCandidateSums) {
      const int64_t at = (head * sp.key_chunks + chunk) * sp.window + w0;
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        float sum = row_sum[half];
        sum += warp_shfl_xor(sum, 1);
        sum += warp_shfl_xor(sum, 2);
        const int r = row_lo + 8 * half;
        if (lane % 4 == 0 && r < rows) {
          sp.partial_max[at + r] = row_stat[half] == -INFINITY ? kNegInf : double(row_stat[half]) / double(kLog2e);
          sp.partial_sum[at + r] = double(sum);
        }
      }
    }
  }
  if (kCandidateSums) {
    __syncthreads();
    double* attention = sp.attention + head * sp.cand_stride;
    for (int i = threadIdx.x; i < chunk_end - chunk_begin; i += blockDim.x) {
      attention[chunk_begin + i] = column_sum[i] / double(sp.window);
    }
  }
#endif
}
#endif  // SPARSA_GPU_HAS_MMA_SYNC

}  // namespace

ScorePrecision score_precision(const SparseParams& sp) {
#if SPARSA_GPU_HAS_MMA_SYNC
  const ForwardParams& p = sp.fw;
  const bool sixteen_bit = p.element_type == ElementType::kF16 || p.element_type == ElementType::kBF16;
  if (sixteen_bit && p.head_dim % 16 == 0 && p.head_dim <= kFp32MaxDim && sp.q_aligned16 && p.kv_rows_aligned16) {
    return ScorePrecision::kFp32;
  }
#endif
  (void)sp;
  return ScorePrecision::kFloat64;
}

void launch_score_pass(const SparseParams& sp, ScorePrecision precision, bool candidate_sums, cudaStream_t stream) {
  const dim3 grid(uint32_t(sp.key_chunks), uint32_t(sp.fw.num_q_heads), uint32_t(sp.fw.batch));
  const char* what = candidate_sums ? "TOKEN_SPARSE score pass 2 launch" : "TOKEN_SPARSE score pass 1 launch";
#if SPARSA_GPU_HAS_MMA_SYNC
  if (precision == ScorePrecision::kFp32) {
    const bool half = sp.fw.element_type == ElementType::kF16;
    if (candidate_sums) {
      if (half) score_fp32_kernel<mma::HalfTag, true><<<grid, kFp32Threads, 0, stream>>>(sp);
      else score_fp32_kernel<mma::BFloat16Tag, true><<<grid, kFp32Threads, 0, stream>>>(sp);
    } else {
      if (half) score_fp32_kernel<mma::HalfTag, false><<<grid, kFp32Threads, 0, stream>>>(sp);
      else score_fp32_kernel<mma::BFloat16Tag, false><<<grid, kFp32Threads, 0, stream>>>(sp);
    }
    check(cudaGetLastError(), what);
    return;
  }
#endif
  (void)precision;
  if (candidate_sums) score_f64_kernel<true><<<grid, kScoreThreads, 0, stream>>>(sp);
  else score_f64_kernel<false><<<grid, kScoreThreads, 0, stream>>>(sp);
  check(cudaGetLastError(), what);
}

}  // namespace token_sparse
SPARSA_GPU_NAMESPACE_END
