// §5 TOKEN_SPARSE on the device: any batch, no host synchronisation. Mirrors backends/cpu/cpu_token_sparse.cpp,
// whose selection scores are float64 so that selections are exact; the device scores in float64 too.
//
// Per (sequence b, query head h) of length L (= min(Sq, Skv): the core checks Sq == Skv where it can read the
// lengths; device lengths are not checked), with W = window and n = L − W candidates:
//   0. dense fallback (§5.1) when L <= min_tokens + W or τ == 0: decided on the device per sequence — the head's list
//      becomes [0, L), so the one attention launch serves dense and sparse sequences alike;
//   1. score pass 1 (score_kernel<false>): S = scale · Q[L−W, L) · Kᵀ in float64 (tensor-core DMMA m8n8k4 on sm_80+,
//      FMAs elsewhere), one block per kKeysPerBlock keys, a (max, Σexp) partial per window row under the causal
//      bound; row_lse_kernel merges them into each window row's log-sum-exp;
//   2. score pass 2 (score_kernel<true>): recomputes S over the candidates and p_h[j] = (1/W) Σ_r exp(S[r, j] − lse_r)
//      (the causal softmax of §5.2; every window row sees every candidate). The W × L score matrix is recomputed
//      instead of stored: it would be B·Hq·W·L doubles (1 GiB at L = 32K, Hq = 32);
//   3. pool_kernel: avg_pool1d(kernel, zero padding counted) and per-head normalisation ŝ_h (§5.3–4);
//   4. layer_kernel + budget_kernel: s_l = mean over heads, normalised; n_drop = #(ascending cumsum < τ) (+1 when
//      > 0) found by a radix descent over the scores' bit patterns with exact fixed-point partial sums instead of
//      a sort; budget = max(min_tokens, n − n_drop) (§5.4–5);
//   5. device_topk: per head the top-budget of ŝ_h (ties to the smaller position), ascending; finish_kernel appends
//      the window [L − W, L) (or writes [0, L) for a dense sequence), the counts, selected_indices and
//      PAIRS_COMPUTED (|S_h|(|S_h|+1)/2, as the CPU counts);
//   6. zero_kernel writes the rows outside S_h: exactly 0 and LSE −inf (§5.8). It walks the complement (only the
//      dropped rows are written, once) rather than zeroing all of `out` before a scatter, which would write the
//      kept rows twice;
//   7. attention: the shared forward launch with QueryRowMap::kTokenLists (forward_params.h) — causal attention
//      inside each head's compressed sequence, reading q/k/v through the list and scattering rows back (§5.7).
//
// Exactness: dot products, exponentials and sums are float64 as on the CPU; only summation orders differ (block
// reductions), i.e. scores agree to ~1e-15 relative and selections match wherever the CPU's own ranking is not
// decided by such a difference. The coverage count compares exact 2^-62 fixed-point sums with τ.
#include "../../src/error.h"
#include "device_topk.h"
#include "forward_common.cuh"
#include "gpu_policies.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <string>

SPARSA_GPU_NAMESPACE_BEGIN
namespace {

// ---- Scoring tiles (float64) ----
// A block computes kTileRows window rows × kTileKeys keys; its 8 warps each own kWarpRows × kWarpKeys (4 × 4 DMMA
// m8n8k4 fragments). The fragment layout is that of 32 lanes; on a 64-wide HIP wavefront each half plays one warp
// (the FMA fallback runs there, and every shuffle below stays inside a 32-lane half).
constexpr int kScoreThreads = 256;
constexpr int kLanes = 32;
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
// Keys one scoring block walks: pass 1 writes one (max, Σexp) partial per window row per kKeysPerBlock keys.
constexpr int kKeysPerBlock = 4 * kTileKeys;
static_assert(kWarpsAlongKeys * kWarpsAlongRows * kLanes == kScoreThreads, "8 warps cover the tile");

// ---- Other kernels ----
constexpr int kRowThreads = 256;      // row_lse_kernel, pool_kernel, finish_kernel, layer_kernel
constexpr int kBudgetThreads = 1024;  // budget_kernel: one block per sequence
constexpr int kZeroThreads = 256;
constexpr int kZeroRows = 128;        // rows per zero_kernel block (their kept flags: a shared bitmap)
constexpr int kBitsPerWord = 32;
// The coverage count: scores in [0, 1] become exact integers at this scale (2^62: sums of up to ~2 stay below 2^63).
constexpr double kFixedScale = 4611686018427387904.0;  // 2^62
constexpr int kDigitBits = 2;                           // radix digits of the coverage descent
constexpr int kDigits = 1 << kDigitBits;
constexpr int kKeyBits = 64;
// Sizes above this are refused: the selection scratch grows with B · Hq · max Sq (packed: B · Hq · Tq).
constexpr uint64_t kMaxScratchBytes = uint64_t(4) << 30;

constexpr double kNegInf = -INFINITY;
using Fixed = unsigned long long;  // fixed-point scores (the shuffle overloads take unsigned long long)

// Everything the selection kernels read (filled on the host by make_sparse_params).
struct SparseParams {
  ForwardParams fw;          // tensors, layouts and sizes (row_map kAll)
  double scale = 0.0;        // softmax scale, float64 as the CPU multiplies it
  int32_t window = 0;        // W
  int32_t pool_kernel = 0;   // odd; padding pool_kernel / 2, zeros counted
  int32_t min_tokens = 0;
  double coverage = 0.0;     // τ as the CPU reads it: double(float)
  bool q_aligned16 = false;  // q rows start on 16-byte boundaries (vector staging)
  int32_t key_chunks = 0;    // kKeysPerBlock chunks of the longest sequence
  int64_t cand_stride = 0;   // row stride of the per-(b, h) candidate arrays: >= every L − W
  double* partial_max = nullptr;  // [B·Hq, key_chunks, W]
  double* partial_sum = nullptr;  // [B·Hq, key_chunks, W]
  double* row_lse = nullptr;      // [B·Hq, W]
  double* attention = nullptr;    // p_h: [B·Hq, cand_stride]
  double* scores = nullptr;       // ŝ_h: [B·Hq, cand_stride]
  double* layer = nullptr;        // s_l: [B, cand_stride]
  int32_t* lengths = nullptr;     // [B·Hq]: L − W, 0 for a dense sequence (device_topk's segment lengths)
  int32_t* budget = nullptr;      // [B]: candidates kept per head, 0 for a dense sequence
  int32_t* lists = nullptr;       // S_h: [B·Hq, capacity] ascending positions
  int32_t* counts = nullptr;      // |S_h|: [B·Hq]
  int32_t capacity = 0;           // >= every L
  int32_t* selected = nullptr;    // optional selected_indices [B, Hq, cap]
  int64_t selected_strides[3] = {0, 0, 0};
  int32_t selected_cap = 0;
  StatsParams stats;
};

// One sequence as §5 sees it.
struct SparseSequence {
  int32_t length = 0;      // L
  bool dense = true;       // §5.1
  int32_t candidates = 0;  // L − W when sparse, else 0
};

__device__ __forceinline__ SparseSequence sparse_sequence(const SparseParams& sp, const SequenceView& s) {
  SparseSequence q;
  q.length = s.seq_q < s.seq_k ? s.seq_q : s.seq_k;
  q.dense = int64_t(q.length) <= int64_t(sp.min_tokens) + sp.window || sp.coverage == 0.0;
  q.candidates = q.dense ? 0 : q.length - sp.window;
  return q;
}

// Sum over the block (every thread calls it; every thread gets the same total, summed in one fixed order).
template <typename T>
__device__ T block_sum(T value, T* warp_totals) {
#pragma unroll
  for (int offset = kLanes / 2; offset > 0; offset /= 2) value += warp_shfl_xor(value, offset);
  __syncthreads();  // warp_totals may still be read by a previous call
  if (threadIdx.x % kLanes == 0) warp_totals[threadIdx.x / kLanes] = value;
  __syncthreads();
  T total = 0;
  for (int w = 0; w < int(blockDim.x) / kLanes; ++w) total += warp_totals[w];
  return total;
}

// ================================================================================== score passes 1 and 2

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
__global__ void __launch_bounds__(kScoreThreads) score_kernel(const SparseParams sp) {
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

// lse of every window row from pass 1's partials (one block per (head, sequence)).
__global__ void __launch_bounds__(kRowThreads) row_lse_kernel(const SparseParams sp) {
  const int32_t h = blockIdx.x, b = blockIdx.y;
  const SparseSequence seq = sparse_sequence(sp, make_sequence_view(sp.fw, b, h));
  if (seq.dense) return;
  const int64_t head = int64_t(b) * sp.fw.num_q_heads + h;
  const int32_t chunks = (seq.length + kKeysPerBlock - 1) / kKeysPerBlock;
  for (int32_t w = threadIdx.x; w < sp.window; w += blockDim.x) {
    double m = kNegInf;
    for (int32_t c = 0; c < chunks; ++c) m = fmax(m, sp.partial_max[(head * sp.key_chunks + c) * sp.window + w]);
    double sum = 0.0;
    for (int32_t c = 0; c < chunks; ++c) {
      const int64_t at = (head * sp.key_chunks + c) * sp.window + w;
      if (sp.partial_max[at] != kNegInf) sum += sp.partial_sum[at] * exp(sp.partial_max[at] - m);
    }
    sp.row_lse[head * sp.window + w] = m + log(sum);  // key 0 is visible to every row: m finite, sum >= 1
  }
}

// ================================================================================== pooling, layer score, budget

// ŝ_h = avg_pool1d(p_h) normalised to sum 1 (§5.3–4), and device_topk's segment length (one block per (h, b)).
__global__ void __launch_bounds__(kRowThreads) pool_kernel(const SparseParams sp) {
  __shared__ double warp_totals[kRowThreads / kLanes];
  const int32_t h = blockIdx.x, b = blockIdx.y;
  const SparseSequence seq = sparse_sequence(sp, make_sequence_view(sp.fw, b, h));
  const int64_t head = int64_t(b) * sp.fw.num_q_heads + h;
  if (threadIdx.x == 0) sp.lengths[head] = seq.candidates;
  if (seq.dense) return;
  const int32_t n = seq.candidates, half = sp.pool_kernel / 2;
  const double* p = sp.attention + head * sp.cand_stride;
  double* scores = sp.scores + head * sp.cand_stride;
  double total = 0.0;
  for (int32_t j = threadIdx.x; j < n; j += blockDim.x) {
    double window_sum = 0.0;  // ascending t, as the CPU adds them
    for (int32_t t = max(0, j - half); t <= min(n - 1, j + half); ++t) window_sum += p[t];
    scores[j] = window_sum / double(sp.pool_kernel);
    total += scores[j];
  }
  total = block_sum(total, warp_totals);
  if (total > 0.0) {  // an all-zero head (underflow only) stays zero, as on the CPU
    for (int32_t j = threadIdx.x; j < n; j += blockDim.x) scores[j] /= total;  // this thread's own writes
  }
}

// s_l[j] = (Σ_h ŝ_h[j]) / Hq, heads added in ascending order as on the CPU (grid: candidate blocks × sequences).
__global__ void __launch_bounds__(kRowThreads) layer_kernel(const SparseParams sp) {
  const int32_t b = blockIdx.y;
  const int64_t j = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  const SparseSequence seq = sparse_sequence(sp, make_sequence_view(sp.fw, b, 0));
  if (seq.dense || j >= seq.candidates) return;
  const int32_t heads = sp.fw.num_q_heads;
  double sum = 0.0;
  for (int32_t h = 0; h < heads; ++h) sum += sp.scores[(int64_t(b) * heads + h) * sp.cand_stride + j];
  sp.layer[int64_t(b) * sp.cand_stride + j] = sum / double(heads);
}

// The bucket the coverage descent is in: keys whose bits above `shift + kDigitBits` equal `prefix`.
struct CoverageState {
  Fixed prefix = 0;
  Fixed base_sum = 0;    // fixed-point sum of every score below the bucket
  int64_t base_count = 0;
  Fixed bucket_sum = 0;  // ... and of the bucket itself
  int64_t bucket_count = 0;
};

// One block per sequence: normalises s_l, counts the ascending cumulative sums below τ and writes the budget (§5.5).
// Instead of sorting, a radix descent over the scores' bit patterns (non-negative doubles order like their bits):
// per kDigitBits-bit digit, the fixed-point sum and count of each sub-bucket of the current bucket decide whether
// the cumulative sum crosses τ inside it. The cumulative sum after a whole sub-bucket is exact (integers), so the
// count is that of the exact cumsum; equal scores at the crossing are resolved by division.
__global__ void __launch_bounds__(kBudgetThreads) budget_kernel(const SparseParams sp) {
  __shared__ double warp_totals[kBudgetThreads / kLanes];
  __shared__ Fixed warp_fixed_totals[kBudgetThreads / kLanes];
  __shared__ Fixed digit_totals[kBudgetThreads / kLanes][2 * (kDigits - 1)];
  const int32_t b = blockIdx.x;
  const SparseSequence seq = sparse_sequence(sp, make_sequence_view(sp.fw, b, 0));
  if (seq.dense) {
    if (threadIdx.x == 0) sp.budget[b] = 0;
    return;
  }
  const int32_t n = seq.candidates;
  double* layer = sp.layer + int64_t(b) * sp.cand_stride;
  double total = 0.0;
  for (int32_t j = threadIdx.x; j < n; j += blockDim.x) total += layer[j];
  total = block_sum(total, warp_totals);
  Fixed total_fixed = 0;
  for (int32_t j = threadIdx.x; j < n; j += blockDim.x) {
    if (total > 0.0) layer[j] /= total;  // this thread's own elements, as in every pass below
    total_fixed += static_cast<Fixed>(layer[j] * kFixedScale);
  }
  // τ below 2^-62 rounds to 0 and counts nothing (the CPU would count exact-zero scores there).
  const Fixed threshold = static_cast<Fixed>(sp.coverage * kFixedScale);
  CoverageState st;
  st.bucket_sum = block_sum(total_fixed, warp_fixed_totals);
  st.bucket_count = n;
  int64_t below = 0;  // count of ascending cumulative sums < τ
  if (threshold == 0) {
    below = 0;
  } else if (st.bucket_sum < threshold) {
    below = n;
  } else {
    // Invariant: base_sum < threshold <= base_sum + bucket_sum.
    bool resolved = false;
    for (int shift = kKeyBits - kDigitBits; shift >= 0 && !resolved; shift -= kDigitBits) {
      Fixed sums[kDigits - 1] = {}, counts[kDigits - 1] = {};
      for (int32_t j = threadIdx.x; j < n; j += blockDim.x) {
        const Fixed key = static_cast<Fixed>(__double_as_longlong(layer[j]));
        const Fixed above = shift + kDigitBits >= kKeyBits ? 0 : key >> (shift + kDigitBits);
        if (above != st.prefix) continue;
        const int digit = int((key >> shift) & (kDigits - 1));
        const Fixed fixed = static_cast<Fixed>(layer[j] * kFixedScale);
#pragma unroll
        for (int d = 0; d < kDigits - 1; ++d) {
          sums[d] += digit == d ? fixed : 0;
          counts[d] += digit == d ? 1 : 0;
        }
      }
#pragma unroll
      for (int d = 0; d < kDigits - 1; ++d) {
#pragma unroll
        for (int offset = kLanes / 2; offset > 0; offset /= 2) {
          sums[d] += warp_shfl_xor(sums[d], offset);
          counts[d] += warp_shfl_xor(counts[d], offset);
        }
      }
      __syncthreads();  // digit_totals of the previous digit are read
      if (threadIdx.x % kLanes == 0) {
        for (int d = 0; d < kDigits - 1; ++d) {
          digit_totals[threadIdx.x / kLanes][d] = sums[d];
          digit_totals[threadIdx.x / kLanes][kDigits - 1 + d] = counts[d];
        }
      }
      __syncthreads();
      Fixed bucket_sums[kDigits], bucket_counts[kDigits];
      Fixed rest_sum = st.bucket_sum, rest_count = Fixed(st.bucket_count);
      for (int d = 0; d < kDigits - 1; ++d) {
        bucket_sums[d] = bucket_counts[d] = 0;
        for (int w = 0; w < int(blockDim.x) / kLanes; ++w) {
          bucket_sums[d] += digit_totals[w][d];
          bucket_counts[d] += digit_totals[w][kDigits - 1 + d];
        }
        rest_sum -= bucket_sums[d];
        rest_count -= bucket_counts[d];
      }
      bucket_sums[kDigits - 1] = rest_sum;
      bucket_counts[kDigits - 1] = rest_count;
      for (int d = 0; d < kDigits; ++d) {
        if (st.base_sum + bucket_sums[d] < threshold) {  // the whole sub-bucket stays below τ
          st.base_sum += bucket_sums[d];
          st.base_count += int64_t(bucket_counts[d]);
          continue;
        }
        st.prefix = (st.prefix << kDigitBits) | Fixed(d);
        st.bucket_sum = bucket_sums[d];
        st.bucket_count = int64_t(bucket_counts[d]);
        break;
      }
      if (shift == 0) {
        // The bucket holds equal scores v (fixed-point v_f > 0 by the invariant): k of them stay below τ while
        // base + k·v_f < threshold.
        const Fixed value = st.bucket_count > 0 ? st.bucket_sum / Fixed(st.bucket_count) : 0;
        const int64_t ties = value > 0 ? int64_t((threshold - st.base_sum - 1) / value) : 0;
        below = st.base_count + min(ties, st.bucket_count);
        resolved = true;
      }
    }
  }
  if (threadIdx.x == 0) {
    const int64_t n_drop = below + (below > 0 ? 1 : 0);
    const int64_t kept = max(int64_t(sp.min_tokens), int64_t(n) - n_drop);
    sp.budget[b] = int32_t(min(int64_t(n), kept));
  }
}

// ================================================================================== lists, dropped rows

// S_h: device_topk wrote the top-budget candidates (ascending); append the window, or write [0, L) for a dense
// sequence; then the count, selected_indices and PAIRS_COMPUTED (one block per (h, b)).
__global__ void __launch_bounds__(kRowThreads) finish_kernel(const SparseParams sp, bool topk_ran) {
  const int32_t h = blockIdx.x, b = blockIdx.y;
  const SparseSequence seq = sparse_sequence(sp, make_sequence_view(sp.fw, b, h));
  const int64_t head = int64_t(b) * sp.fw.num_q_heads + h;
  int32_t* list = sp.lists + head * sp.capacity;
  int32_t n = seq.length;
  if (seq.dense || !topk_ran) {
    for (int32_t i = threadIdx.x; i < seq.length; i += blockDim.x) list[i] = i;
  } else {
    const int32_t kept = sp.budget[b];
    n = kept + sp.window;
    for (int32_t w = threadIdx.x; w < sp.window; w += blockDim.x) list[kept + w] = seq.candidates + w;
  }
  if (threadIdx.x == 0) {
    sp.counts[head] = n;
    stats_add(sp.stats, SPARSA_STAT_PAIRS_COMPUTED, int64_t(n) * (int64_t(n) + 1) / 2);
  }
  if (sp.selected != nullptr) {
    __syncthreads();  // this block's list writes are visible to the whole block
    int32_t* row = sp.selected + b * sp.selected_strides[0] + h * sp.selected_strides[1];
    for (int32_t c = threadIdx.x; c < sp.selected_cap; c += blockDim.x) {
      row[c * sp.selected_strides[2]] = c < n ? list[c] : -1;
    }
  }
}

// Rows [row0, row0 + kZeroRows) of (b, h) outside S_h: out = 0, lse = −inf (grid: row tiles × heads × sequences).
__global__ void __launch_bounds__(kZeroThreads) zero_kernel(const SparseParams sp) {
  __shared__ uint32_t kept[kZeroRows / kBitsPerWord];
  const int32_t h = blockIdx.y, b = blockIdx.z;
  const int32_t row0 = blockIdx.x * kZeroRows;
  const SequenceView s = make_sequence_view(sp.fw, b, h);
  if (row0 >= s.seq_q) return;
  const int32_t rows = min(kZeroRows, s.seq_q - row0);
  const int64_t head = int64_t(b) * sp.fw.num_q_heads + h;
  const int32_t* list = sp.lists + head * sp.capacity;
  const int32_t n = sp.counts[head];
  for (int w = threadIdx.x; w < kZeroRows / kBitsPerWord; w += blockDim.x) kept[w] = 0;
  __syncthreads();
  // The list entries in [row0, row0 + rows): entries <= row0 - 1 come before, entries <= row0 + rows - 1 end it.
  const int32_t first = keys_up_to(list, n, int64_t(row0) - 1), last = keys_up_to(list, n, int64_t(row0) + rows - 1);
  for (int32_t at = first + threadIdx.x; at < last; at += blockDim.x) {
    const int32_t r = list[at] - row0;
    atomicOr(&kept[r / kBitsPerWord], 1u << (r % kBitsPerWord));
  }
  __syncthreads();
  const ForwardParams& p = sp.fw;
  const int lane = threadIdx.x % kLanes;
  for (int32_t r = threadIdx.x / kLanes; r < rows; r += blockDim.x / kLanes) {
    if ((kept[r / kBitsPerWord] >> (r % kBitsPerWord)) & 1u) continue;
    const int32_t i = row0 + r;
    const int64_t out_row = query_row_offset(p.out_strides, s, i);
    for (int32_t d = lane; d < p.head_dim; d += kLanes) store_value(p.out, out_row + d, p.element_type, 0.f);
    if (lane == 0 && p.lse != nullptr) {
      p.lse[s.b * p.lse_strides.b + int64_t(h) * p.lse_strides.h + (s.q_row_base + i) * p.lse_strides.s] = kNegInf;
    }
  }
}

// ================================================================================== host side

// Sizes every run of a problem shares (plan and run carve the same).
struct SparseShape {
  int32_t capacity = 0;      // list capacity: max Sq (padded Sq or Tq)
  bool any_sparse = false;   // some sequence may take the sparse path (else no scoring is launched)
  int64_t cand_stride = 0;
  int32_t key_chunks = 0;
  int64_t heads = 0;         // B · Hq
  int64_t flat_rows = 0;     // rows of the split-KV partial-state index
};

SparseShape sparse_shape(const AttentionProblem& problem, const PolicyParams& policy) {
  SparseShape shape;
  shape.capacity = int32_t(problem.max_seq_q);
  shape.heads = int64_t(problem.batch) * problem.num_q_heads;
  shape.any_sparse = policy.p.token_sparse_coverage != 0.f &&
                     problem.max_seq_q > int64_t(policy.p.token_sparse_min_tokens) + policy.p.token_sparse_window;
  if (shape.any_sparse) {
    shape.cand_stride = problem.max_seq_q - policy.p.token_sparse_window;
    shape.key_chunks = int32_t((problem.max_seq_q + kKeysPerBlock - 1) / kKeysPerBlock);
  }
  shape.flat_rows = flat_rows_of(problem);
  return shape;
}

uint64_t selection_scratch_bytes(const SparseShape& shape, int32_t batch, int32_t window) {
  uint64_t bytes = uint64_t(shape.heads) * shape.capacity * sizeof(int32_t);  // lists
  if (shape.any_sparse) {
    bytes += 2 * uint64_t(shape.heads) * shape.key_chunks * window * sizeof(double);    // partials
    bytes += (2 * uint64_t(shape.heads) + batch) * shape.cand_stride * sizeof(double);  // p, ŝ, s_l
    bytes += device_topk_scratch_bytes(int32_t(shape.heads), shape.cand_stride);
  }
  return bytes;
}

// The attention launch over the lists (pointers filled by the caller).
ForwardParams list_attention_params(const AttentionProblem& problem, const PolicyParams& policy, int32_t capacity) {
  ForwardParams p = make_forward_params(problem, policy);
  p.row_map = QueryRowMap::kTokenLists;
  p.token_list_capacity = capacity;
  return p;
}

ForwardLaunch plan_list_attention(const GpuDevice& device, const AttentionProblem& problem, const ForwardParams& p,
                                  const SparseShape& shape, std::string* reason) {
  return plan_forward(device, p, shape.capacity, shape.capacity, shape.flat_rows, all_rows_aligned_16(problem),
                      reason);
}

}  // namespace

bool token_sparse_supports(const GpuDevice& device, const AttentionProblem& problem, const PolicyParams& policy,
                           std::string* reason) {
  const SparseShape shape = sparse_shape(problem, policy);
  const uint64_t bytes = selection_scratch_bytes(shape, problem.batch, policy.p.token_sparse_window);
  if (bytes > kMaxScratchBytes) {
    if (reason != nullptr) {
      *reason = std::string(backend_name()) + " backend: TOKEN_SPARSE selection scratch (" +
                std::to_string(bytes >> 20) + " MiB for B x Hq x max Sq; packed q: Tq) exceeds " +
                std::to_string(kMaxScratchBytes >> 20) + " MiB";
    }
    return false;
  }
  const ForwardParams p = list_attention_params(problem, policy, shape.capacity);
  return plan_list_attention(device, problem, p, shape, reason).kernel != ForwardKernel::kNone;
}

void token_sparse_run(const GpuDevice& device, const AttentionProblem& problem, const PolicyParams& policy,
                      ScratchCarver& carver) {
  const SparseShape shape = sparse_shape(problem, policy);
  SparseParams sp;
  sp.fw = make_forward_params(problem, policy);
  sp.scale = double(problem.scale);
  sp.window = policy.p.token_sparse_window;
  sp.pool_kernel = policy.p.token_sparse_pool_kernel;
  sp.min_tokens = policy.p.token_sparse_min_tokens;
  sp.coverage = double(policy.p.token_sparse_coverage);
  sp.q_aligned16 = rows_aligned_16(problem.q);
  sp.key_chunks = shape.key_chunks;
  sp.cand_stride = shape.cand_stride;
  sp.capacity = shape.capacity;
  sp.stats = make_stats_params(problem, policy);
  if (problem.selected_indices.present) {
    sp.selected = problem.selected_indices.ptr<int32_t>();
    for (int d = 0; d < 3; ++d) sp.selected_strides[d] = problem.selected_indices.stride(d);
    sp.selected_cap = int32_t(problem.selected_indices.extent(2));
  }

  // Scratch, carved identically by plan() (sizing) and run().
  const uint64_t heads = uint64_t(shape.heads);
  sp.lists = carver.take<int32_t>(heads * uint64_t(shape.capacity));
  sp.counts = carver.take<int32_t>(heads);
  void* topk_scratch = nullptr;
  if (shape.any_sparse) {
    const uint64_t partials = heads * uint64_t(shape.key_chunks) * uint64_t(sp.window);
    sp.partial_max = carver.take<double>(partials);
    sp.partial_sum = carver.take<double>(partials);
    sp.row_lse = carver.take<double>(heads * uint64_t(sp.window));
    sp.attention = carver.take<double>(heads * uint64_t(shape.cand_stride));
    sp.scores = carver.take<double>(heads * uint64_t(shape.cand_stride));
    sp.layer = carver.take<double>(uint64_t(problem.batch) * uint64_t(shape.cand_stride));
    sp.lengths = carver.take<int32_t>(heads);
    sp.budget = carver.take<int32_t>(uint64_t(problem.batch));
    topk_scratch = carver.take<char>(device_topk_scratch_bytes(int32_t(heads), shape.cand_stride));
  }
  ForwardParams attention = list_attention_params(problem, policy, shape.capacity);
  ForwardLaunch launch = plan_list_attention(device, problem, attention, shape, nullptr);
  launch.num_splits = 1;  // row-mapped launches never split (forward_params.h): carve no partial states
  launch.flat_rows = 0;
  carve_forward(carver, launch, attention);
  if (carver.sizing() || problem.batch == 0 || problem.num_q_heads == 0 || problem.max_seq_q == 0) return;

  cudaStream_t stream = device.stream;
  const int32_t batch = problem.batch, n_heads = problem.num_q_heads;
  if (sp.stats.out != nullptr) check(stats_count_launch(sp.fw, sp.stats, stream), "stats_count_kernel launch");
  if (shape.any_sparse) {
    const dim3 score_grid(shape.key_chunks, n_heads, batch), head_grid(n_heads, batch);
    score_kernel<false><<<score_grid, kScoreThreads, 0, stream>>>(sp);
    check(cudaGetLastError(), "TOKEN_SPARSE score_kernel (pass 1) launch");
    row_lse_kernel<<<head_grid, kRowThreads, 0, stream>>>(sp);
    check(cudaGetLastError(), "TOKEN_SPARSE row_lse_kernel launch");
    score_kernel<true><<<score_grid, kScoreThreads, 0, stream>>>(sp);
    check(cudaGetLastError(), "TOKEN_SPARSE score_kernel (pass 2) launch");
    pool_kernel<<<head_grid, kRowThreads, 0, stream>>>(sp);
    check(cudaGetLastError(), "TOKEN_SPARSE pool_kernel launch");
    const dim3 layer_grid(uint32_t((shape.cand_stride + kRowThreads - 1) / kRowThreads), batch);
    layer_kernel<<<layer_grid, kRowThreads, 0, stream>>>(sp);
    check(cudaGetLastError(), "TOKEN_SPARSE layer_kernel launch");
    budget_kernel<<<batch, kBudgetThreads, 0, stream>>>(sp);
    check(cudaGetLastError(), "TOKEN_SPARSE budget_kernel launch");
    TopkArgs topk;
    topk.values = sp.scores;
    topk.value_type = TopkValueType::kF64;
    topk.row_stride = shape.cand_stride;
    topk.segments = int32_t(heads);
    topk.max_length = shape.cand_stride;
    topk.lengths = sp.lengths;
    topk.k_device = sp.budget;
    topk.segments_per_k = n_heads;
    topk.out = sp.lists;
    topk.out_stride = shape.capacity;
    topk.out_capacity = shape.capacity;
    check(device_topk(topk, topk_scratch, stream), "TOKEN_SPARSE device_topk");
  }
  finish_kernel<<<dim3(n_heads, batch), kRowThreads, 0, stream>>>(sp, shape.any_sparse);
  check(cudaGetLastError(), "TOKEN_SPARSE finish_kernel launch");
  const dim3 zero_grid(uint32_t((shape.capacity + kZeroRows - 1) / kZeroRows), n_heads, batch);
  zero_kernel<<<zero_grid, kZeroThreads, 0, stream>>>(sp);
  check(cudaGetLastError(), "TOKEN_SPARSE zero_kernel launch");
  attention.token_lists = sp.lists;
  attention.token_counts = sp.counts;
  launch_forward(device, launch, attention);
}

SPARSA_GPU_NAMESPACE_END
