// Context-parallel TOKEN_SELECT on the device (sparsa_cp_select_*, docs/context_parallel.md): the four steps with the
// bits of the CPU backend's (cpu_context_parallel.cpp), so that a shard on a GPU and a shard on a CPU (and the
// single-device CPU run, the oracle) select the same tokens.
//
// Every quantity is computed as the CPU computes it, one IEEE operation at a time (explicit __dmul_rn / __dadd_rn /
// __ddiv_rn, so nvcc's FMA contraction cannot fuse them):
//   q̄_h      the float64 mean of the call's query rows (sequential sum over rows, then one divide);
//   s[h, t]   0, then for c = 0..D-1 one product q̄_h[c]·K[t, c] and one add, then the product with the score scale:
//             the CPU's sequential channel-order sum (select_scores.cpp), each key element widened exactly (with one
//             query row per sequence the products are exact and one fma per channel gives the same bits);
//   max       the first (by position) of the largest scores, NaN skipped: the std::max fold's value, bit for bit;
//   exp       src/common/glibc_exp.h: glibc's exp, the function std::exp is on the CPU;
//   Z_h       FixedPointSum digits summed as integers (exact: any grouping gives the same digits);
//   vote      0 + e_0/Z_0 + e_1/Z_1 + ... over the set's heads in ascending order;
//   top_k     device_topk: the same total order as ranks_before (larger vote, smaller position, NaN last).
// Step 3 reads the combined digits back to the host to check them and to form Z_h with FixedPointSum (a
// synchronisation on the context's stream), and step 4 runs on the host (cp_select_host.cpp) over the gathered lists
// read back the same way: both are small, and their argument errors must reach the caller before anything is written.
// Steps 1-3 rescore the shard's candidates, as the CPU steps do (the calls are stateless).
//
// Launches: sequences (shard ranges from device lengths), q̄, then one score kernel per step with the step fused in
// (a thread per candidate reads its key row once per kv head, 16 bytes at a time, and keeps nothing per candidate
// and head in memory): step 1 partial maxima of 32 candidates, folded per head; step 2 partial digit sums, added per
// head; step 3 the votes, then device_topk and the outputs.
// The GPU runtime first: the shared host/device headers below use its bit-cast intrinsics in device code.
#include "../engine/forward_common.cuh"
#include "../runtime/gpu_policies.h"
#include "device_topk.h"
#include "../../../src/common/fixed_point_sum.h"
#include "../../../src/common/glibc_exp.h"
#include "../../../src/cp_select_host.h"
#include "../../../src/error.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

SPARSA_GPU_NAMESPACE_BEGIN
namespace {

constexpr int kTileKeys = 128;      // candidates per score block, one per thread
constexpr int kPartKeys = 32;       // candidates per partial maximum / digit sum (a warp, or half a 64-wide wavefront)
constexpr int kHeadChains = 4;      // independent sums per score thread (heads of its kv group at a time)
constexpr int kKeyBatch = 64;       // key channels a score thread holds in registers at a time
constexpr int kReduceThreads = 256;  // blocks that fold the partial maxima and digit sums
constexpr int kElementThreads = 256;  // element-wise kernels
constexpr int kDigits = SPARSA_CP_SUM_DIGITS;  // nan count, whole part, four 32-bit fraction digits
constexpr int64_t kMaxGridX = 65535;

struct MaxPart {
  double value;      // the largest score of the part (−inf if none counts)
  int64_t position;  // the first candidate holding it (INT64_MAX if none)
};

struct StepParams {
  ForwardParams p;
  int32_t num_kv_heads = 1;
  int64_t n_init = 0, n_local = 0, top_k = 0;
  int32_t n_sets = 1, heads_per_set = 1;
  double score_scale = 1.0;
  int64_t max_candidates = 0;  // row stride of votes
  const int64_t* positions = nullptr;  // [B, 2]: kv_start, kv_total
  CpShardSequence* sequences = nullptr;  // [B]
  int32_t* segment_lengths = nullptr;    // [B · n_sets]: candidates of (b, set)
  double* qbar = nullptr;                // [B, Hq, D]
  bool vector_keys = false;              // k and its row strides 16-byte aligned: 16-byte key loads
  bool single_query_rows = false;        // every sequence has at most one query row (decode): exact products
  int64_t parts = 0;                     // row stride of max_parts and digit_parts: ceil(max_candidates / kPartKeys)
  MaxPart* max_parts = nullptr;          // step 1: [B, Hq, parts]
  unsigned long long* digit_parts = nullptr;  // step 2: [B, Hq, parts, kDigits]
  const double* z = nullptr;             // step 3: [B, Hq], Z_h
  double* votes = nullptr;               // step 3: [B · n_sets, max_candidates]
};

// Strided view of a small F64/I64/I32 tensor of the call (rank <= 4), for the element-wise kernels.
struct Strided {
  void* data = nullptr;
  int64_t stride[4] = {0, 0, 0, 0};
};
Strided strided(const TensorArg& t) {
  Strided s;
  s.data = const_cast<void*>(t.t.data);
  for (int d = 0; d < t.t.ndim && d < 4; ++d) s.stride[d] = t.stride(d);
  return s;
}

// ---- Kernels ----

__global__ void sequences_kernel(const StepParams sp) {
  const int32_t b = int32_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (b >= sp.p.batch) return;
  const SequenceView s = make_sequence_view(sp.p, b, 0);
  const CpShardSequence seq = cp_shard_sequence(sp.n_init, sp.top_k, sp.n_local, s.seq_q, sp.positions[2 * b],
                                                s.seq_k, sp.positions[2 * b + 1]);
  sp.sequences[b] = seq;
  for (int32_t set = 0; set < sp.n_sets; ++set) sp.segment_lengths[b * sp.n_sets + set] = int32_t(seq.n_candidates());
}

// Block (h, b): q̄_h, the mean of the sequence's query rows, as cpu_context_parallel.cpp's mean_queries.
__global__ void qbar_kernel(const StepParams sp) {
  const int32_t h = blockIdx.x, b = blockIdx.y;
  if (!sp.sequences[b].selects()) return;
  const SequenceView s = make_sequence_view(sp.p, b, h);
  double* qbar = sp.qbar + (int64_t(b) * sp.p.num_q_heads + h) * sp.p.head_dim;
  for (int32_t c = threadIdx.x; c < sp.p.head_dim; c += blockDim.x) {
    double sum = 0.0;
    for (int32_t i = 0; i < s.seq_q; ++i) {
      sum = __dadd_rn(sum, double(load_value(sp.p.q, query_row_offset(sp.p.q_strides, s, i) + c, sp.p.element_type)));
    }
    qbar[c] = __ddiv_rn(sum, double(s.seq_q));
  }
}

// Channels [c0, c0 + kKeyBatch) of the key row at element `offset`, widened to fp32 (exact); channels past D are 0.
// With `vector_keys` (16-byte aligned rows, launcher) a whole batch is 8 or 16 independent 16-byte loads in flight.
__device__ __forceinline__ void load_key_batch(const StepParams& sp, int64_t offset, int32_t c0,
                                               float (&key)[kKeyBatch]) {
  const int32_t n = min(kKeyBatch, sp.p.head_dim - c0);
  if (sp.vector_keys && n == kKeyBatch) {
    if (sp.p.element_type == ElementType::kF32) {
      const float4* src = reinterpret_cast<const float4*>(static_cast<const float*>(sp.p.k) + offset + c0);
      float4 raw[kKeyBatch / 4];
#pragma unroll
      for (int i = 0; i < kKeyBatch / 4; ++i) raw[i] = src[i];
#pragma unroll
      for (int i = 0; i < kKeyBatch / 4; ++i) {
        key[4 * i] = raw[i].x;
        key[4 * i + 1] = raw[i].y;
        key[4 * i + 2] = raw[i].z;
        key[4 * i + 3] = raw[i].w;
      }
      return;
    }
    const uint4* src = reinterpret_cast<const uint4*>(static_cast<const uint16_t*>(sp.p.k) + offset + c0);
    uint4 raw[kKeyBatch / 8];
#pragma unroll
    for (int i = 0; i < kKeyBatch / 8; ++i) raw[i] = src[i];
    const bool f16 = sp.p.element_type == ElementType::kF16;
#pragma unroll
    for (int i = 0; i < kKeyBatch / 8; ++i) {
      const uint32_t words[4] = {raw[i].x, raw[i].y, raw[i].z, raw[i].w};
#pragma unroll
      for (int w = 0; w < 4; ++w) {
        const uint16_t low = uint16_t(words[w] & 0xffffu), high = uint16_t(words[w] >> 16);
        key[8 * i + 2 * w] = f16 ? f16_bits_to_float(low) : bf16_bits_to_float(low);
        key[8 * i + 2 * w + 1] = f16 ? f16_bits_to_float(high) : bf16_bits_to_float(high);
      }
    }
    return;
  }
#pragma unroll
  for (int i = 0; i < kKeyBatch; ++i) key[i] = i < n ? load_value(sp.p.k, offset + c0 + i, sp.p.element_type) : 0.f;
}

// sum[i] = q̄_{l0+i} · key over the channels in order, one rounded product and one rounded add per channel (the CPU's
// sequential sum, select_scores.cpp). `qbar` is the kv group's rows in shared memory (every thread reads the same
// element: a broadcast); chains past the group repeat the last head and are not used.
// kExactProducts (every sequence has at most one query row): q̄ is then a query element widened, so it and the key
// element each carry at most 24 significant bits and lie within fp32's exponent range; their product is exact in
// float64 (at most 48 bits, never subnormal: |product| >= 2^-298), and fma(q̄, k, sum) rounds once what
// sum + (q̄·k) rounds once: the same bits as the rounded product and add, zeros' signs, infinities and NaN included,
// for half the float64 instructions.
template <bool kExactProducts>
__device__ __forceinline__ void score_chains(const StepParams& sp, const double* qbar, int32_t l0, int64_t offset,
                                             bool valid, double (&sum)[kHeadChains]) {
  const int32_t d = sp.p.head_dim, last = sp.p.group_size - 1;
  const double* q[kHeadChains];
#pragma unroll
  for (int i = 0; i < kHeadChains; ++i) {
    q[i] = qbar + min(l0 + i, last) * d;
    sum[i] = 0.0;
  }
  if (!valid) return;
  for (int32_t c0 = 0; c0 < d; c0 += kKeyBatch) {
    float key[kKeyBatch];
    load_key_batch(sp, offset, c0, key);
    const int32_t n = min(kKeyBatch, d - c0);
#pragma unroll
    for (int c = 0; c < kKeyBatch; ++c) {
      if (c >= n) break;
      const double k = double(key[c]);
#pragma unroll
      for (int i = 0; i < kHeadChains; ++i) {
        sum[i] = kExactProducts ? __fma_rn(q[i][c0 + c], k, sum[i]) : __dadd_rn(sum[i], __dmul_rn(q[i][c0 + c], k));
      }
    }
  }
}

// The first (by position) of the largest scores over a part of kPartKeys candidates: the std::max fold's value, NaN
// skipped (a NaN or −inf score is the fold's start value, ranked after any score).
__device__ __forceinline__ void store_max_part(const StepParams& sp, int64_t row, int64_t t, bool valid,
                                               double score) {
  const bool counts = valid && -INFINITY < score;
  double value = counts ? score : -INFINITY;
  int64_t at = counts ? t : INT64_MAX;
#pragma unroll
  for (int offset = kPartKeys / 2; offset > 0; offset /= 2) {
    const double other = warp_shfl_xor(value, offset);
    const int64_t other_at = warp_shfl_xor(at, offset);
    if (value < other || (!(other < value) && other_at < at)) value = other, at = other_at;
  }
  if (valid && t % kPartKeys == 0) sp.max_parts[row * sp.parts + t / kPartKeys] = MaxPart{value, at};
}

// The fixed-point digits of exp(s − m) summed over a part of kPartKeys candidates (exact integers).
__device__ __forceinline__ void store_digit_part(const StepParams& sp, int64_t row, int64_t t, bool valid, double e) {
  unsigned long long digits[kDigits] = {0, 0, 0, 0, 0, 0};
  if (valid && isnan(e)) {
    digits[0] = 1;
  } else if (valid) {
    const double whole = floor(e);
    digits[1] = static_cast<unsigned long long>(whole);
    const FixedPointUnits units = fixed_point_units(__dsub_rn(e, whole));
    digits[2] = units.high >> 32;
    digits[3] = units.high & 0xffffffffull;
    digits[4] = units.low >> 32;
    digits[5] = units.low & 0xffffffffull;
  }
#pragma unroll
  for (int i = 0; i < kDigits; ++i) {
#pragma unroll
    for (int offset = kPartKeys / 2; offset > 0; offset /= 2) digits[i] += warp_shfl_xor(digits[i], offset);
  }
  if (valid && t % kPartKeys == 0) {
    unsigned long long* out = sp.digit_parts + (row * sp.parts + t / kPartKeys) * kDigits;
#pragma unroll
    for (int i = 0; i < kDigits; ++i) out[i] = digits[i];
  }
}

// Block (tile, kv head, b) for steps 1 and 2, (tile, 0, b) for step 3, a thread per candidate: the candidate's scores
// s[h, t] for the query heads of the kv group (step 3: of every kv head in turn, so that each set's vote adds its
// heads in ascending order), then
//   step 1: the partial maxima of kPartKeys candidates;
//   step 2: e = exp(s − m_h) (m_h the global maximum) and the partial digit sums of kPartKeys candidates;
//   step 3: vote[t] = 0 + e_0[t]/Z_0 + e_1[t]/Z_1 + ... over each set's heads.
// Nothing per candidate and head is stored: each step rescores (the calls are stateless).
template <CpSelectStep kStep, bool kExactProducts>
__global__ void __launch_bounds__(kTileKeys) tile_kernel(const StepParams sp, Strided global_max) {
  extern __shared__ double qbar[];  // [group][D]: the q̄ rows of the kv head in hand
  const int32_t b = blockIdx.z;
  const CpShardSequence seq = sp.sequences[b];
  const int64_t n = seq.n_candidates();
  const int64_t t = int64_t(blockIdx.x) * kTileKeys + threadIdx.x;  // this thread's candidate
  if (int64_t(blockIdx.x) * kTileKeys >= n) return;                  // the whole block: no candidate
  const bool valid = t < n;
  const int64_t local = seq.candidate_begin - seq.start + t;  // shard-local key id
  const int32_t d = sp.p.head_dim, group = sp.p.group_size;
  const int32_t kv_begin = kStep == CpSelectStep::kTopk ? 0 : int32_t(blockIdx.y);
  const int32_t kv_end = kStep == CpSelectStep::kTopk ? sp.num_kv_heads : kv_begin + 1;
  double vote = 0.0;
  for (int32_t hk = kv_begin; hk < kv_end; ++hk) {
    if (hk != kv_begin) __syncthreads();  // every thread is done with the previous group's rows
    const double* group_qbar = sp.qbar + (int64_t(b) * sp.p.num_q_heads + int64_t(hk) * group) * d;
    for (int32_t e = threadIdx.x; e < group * d; e += blockDim.x) qbar[e] = group_qbar[e];
    __syncthreads();
    const SequenceView s = make_sequence_view(sp.p, b, hk * group);
    const int64_t offset = valid ? key_row_offset(sp.p, sp.p.k_strides, s, local) : 0;
    for (int32_t l0 = 0; l0 < group; l0 += kHeadChains) {
      double sum[kHeadChains];
      score_chains<kExactProducts>(sp, qbar, l0, offset, valid, sum);
#pragma unroll
      for (int i = 0; i < kHeadChains; ++i) {
        if (l0 + i >= group) continue;
        const int32_t h = hk * group + l0 + i;
        const int64_t row = int64_t(b) * sp.p.num_q_heads + h;
        const double score = __dmul_rn(sp.score_scale, sum[i]);
        if constexpr (kStep == CpSelectStep::kMax) {
          store_max_part(sp, row, t, valid, score);
        } else {
          const double m =
              static_cast<const double*>(global_max.data)[b * global_max.stride[0] + h * global_max.stride[1]];
          const double e = valid ? glibc_exp(__dsub_rn(score, m)) : 0.0;
          if constexpr (kStep == CpSelectStep::kSum) {
            store_digit_part(sp, row, t, valid, e);
          } else {
            vote = __dadd_rn(vote, __ddiv_rn(e, sp.z[row]));
            if ((h + 1) % sp.heads_per_set == 0) {
              if (valid) sp.votes[(int64_t(b) * sp.n_sets + h / sp.heads_per_set) * sp.max_candidates + t] = vote;
              vote = 0.0;
            }
          }
        }
      }
    }
  }
}

// Block (h, b), step 1: the partial maxima folded into the head's maximum (values[0] after the tree: the first of the
// largest over the whole shard, the fold's value bit for bit).
__global__ void __launch_bounds__(kReduceThreads) max_parts_kernel(const StepParams sp, Strided out) {
  __shared__ double values[kReduceThreads];
  __shared__ int64_t positions[kReduceThreads];
  const int32_t h = blockIdx.x, b = blockIdx.y;
  const int64_t parts = (sp.sequences[b].n_candidates() + kPartKeys - 1) / kPartKeys;
  const MaxPart* row = sp.max_parts + (int64_t(b) * sp.p.num_q_heads + h) * sp.parts;
  double best = -INFINITY;
  int64_t at = INT64_MAX;
  for (int64_t i = threadIdx.x; i < parts; i += blockDim.x) {
    const MaxPart part = row[i];
    if (best < part.value || (!(part.value < best) && part.position < at)) best = part.value, at = part.position;
  }
  values[threadIdx.x] = best;
  positions[threadIdx.x] = at;
  __syncthreads();
  for (int width = kReduceThreads / 2; width > 0; width /= 2) {
    if (int(threadIdx.x) < width) {
      const double other = values[threadIdx.x + width];
      const int64_t other_at = positions[threadIdx.x + width];
      const double mine = values[threadIdx.x];
      if (mine < other || (!(other < mine) && other_at < positions[threadIdx.x])) {
        values[threadIdx.x] = other;
        positions[threadIdx.x] = other_at;
      }
    }
    __syncthreads();
  }
  if (threadIdx.x == 0) static_cast<double*>(out.data)[b * out.stride[0] + h * out.stride[1]] = values[0];
}

// Block (h, b), step 2's output: the partial digit sums added (exact integers), their carries moved up as
// FixedPointSum::to_digits does.
__global__ void __launch_bounds__(kReduceThreads) digit_parts_kernel(const StepParams sp, Strided out) {
  __shared__ unsigned long long totals[kDigits];
  const int32_t h = blockIdx.x, b = blockIdx.y;
  if (threadIdx.x < kDigits) totals[threadIdx.x] = 0;
  __syncthreads();
  const int64_t parts = (sp.sequences[b].n_candidates() + kPartKeys - 1) / kPartKeys;
  const unsigned long long* row = sp.digit_parts + (int64_t(b) * sp.p.num_q_heads + h) * sp.parts * kDigits;
  unsigned long long sums[kDigits] = {0, 0, 0, 0, 0, 0};
  for (int64_t i = threadIdx.x; i < parts; i += blockDim.x)
    for (int j = 0; j < kDigits; ++j) sums[j] += row[i * kDigits + j];
  for (int j = 0; j < kDigits; ++j)
    if (sums[j] != 0) atomicAdd(&totals[j], sums[j]);
  __syncthreads();
  if (threadIdx.x != 0) return;
  int64_t* o = static_cast<int64_t*>(out.data) + b * out.stride[0] + h * out.stride[1];
  unsigned long long carry = 0;
  for (int i = kDigits - 1; i >= 2; --i) {
    const unsigned long long value = totals[i] + carry;
    o[i * out.stride[2]] = int64_t(value & 0xffffffffull);
    carry = value >> 32;
  }
  o[out.stride[2]] = int64_t(totals[1] + carry);
  o[0] = int64_t(totals[0]);
}

// Thread per (slot, set, b), step 3's outputs: the chosen candidates' votes and global positions (ascending, as
// device_topk orders the ids), −inf and −1 past the shard's candidate count.
__global__ void topk_outputs_kernel(const StepParams sp, const int32_t* ids, Strided votes, Strided positions) {
  const int32_t set = blockIdx.y, b = blockIdx.z;
  const int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= sp.top_k) return;
  const int64_t segment = int64_t(b) * sp.n_sets + set;
  const int32_t id = ids[segment * sp.top_k + i];
  const double vote = id >= 0 ? sp.votes[segment * sp.max_candidates + id] : -INFINITY;
  const int64_t position = id >= 0 ? sp.sequences[b].candidate_begin + id : -1;
  static_cast<double*>(votes.data)[b * votes.stride[0] + set * votes.stride[1] + i * votes.stride[2]] = vote;
  static_cast<int32_t*>(positions.data)[b * positions.stride[0] + set * positions.stride[1] + i * positions.stride[2]] =
      int32_t(position);
}

// Thread per entry: the gathered [G, B, n_sets, top_k] lists into contiguous buffers (for the copy to the host).
__global__ void pack_gathered_kernel(Strided votes, Strided positions, int64_t b_sets_k, int64_t sets_k,
                                     int64_t top_k, int64_t entries, double* votes_out, int32_t* positions_out) {
  for (int64_t e = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; e < entries; e += int64_t(gridDim.x) * blockDim.x) {
    const int64_t g = e / b_sets_k, b = e % b_sets_k / sets_k, set = e % sets_k / top_k, i = e % top_k;
    votes_out[e] = static_cast<const double*>(votes.data)[g * votes.stride[0] + b * votes.stride[1] +
                                                          set * votes.stride[2] + i * votes.stride[3]];
    positions_out[e] = static_cast<const int32_t*>(positions.data)[g * positions.stride[0] + b * positions.stride[1] +
                                                                   set * positions.stride[2] + i * positions.stride[3]];
  }
}

// Thread per entry: step 4's index sets (contiguous [B, n_sets, cap]) into out_indices with its strides.
__global__ void scatter_indices_kernel(const int32_t* sets, int64_t sets_cap, int64_t cap, int64_t entries,
                                       Strided out) {
  for (int64_t e = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; e < entries; e += int64_t(gridDim.x) * blockDim.x) {
    const int64_t b = e / sets_cap, set = e % sets_cap / cap, i = e % cap;
    static_cast<int32_t*>(out.data)[b * out.stride[0] + set * out.stride[1] + i * out.stride[2]] = sets[e];
  }
}

// The score kernel's shared memory: the kv group's q̄ rows (float64).
size_t score_shared_bytes(int64_t group, int64_t head_dim) { return size_t(group * head_dim) * sizeof(double); }

// Whether every key row starts on a 16-byte boundary (base and strides; the channels are contiguous).
bool keys_vector_aligned(const ForwardParams& p) {
  const int64_t bytes = p.element_type == ElementType::kF32 ? 4 : 2;
  const TensorStrides& st = p.k_strides;
  return reinterpret_cast<uintptr_t>(p.k) % 16 == 0 && (st.b * bytes) % 16 == 0 && (st.s * bytes) % 16 == 0 &&
         (st.h * bytes) % 16 == 0;
}

unsigned grid_for(int64_t items, int threads) {
  return unsigned(std::max<int64_t>(1, std::min<int64_t>((items + threads - 1) / threads, kMaxGridX)));
}

// Copies `count` elements device → host on the stream and waits for them (steps 3 and 4 read small arrays back).
template <typename T>
std::vector<T> read_back(const GpuDevice& device, const T* data, int64_t count) {
  std::vector<T> host(static_cast<size_t>(std::max<int64_t>(count, 0)));
  if (count > 0) {
    check(cudaMemcpyAsync(host.data(), data, size_t(count) * sizeof(T), cudaMemcpyDeviceToHost, device.stream),
          "cudaMemcpyAsync");
  }
  check(cudaStreamSynchronize(device.stream), "cudaStreamSynchronize");
  return host;
}

// The shard's sequences and q̄ (steps 1-3), then the step's score kernel.
template <CpSelectStep kStep, bool kExactProducts>
void launch_tile_kernel(const GpuDevice& device, const StepParams& sp, dim3 grid, size_t shared,
                        const Strided& global_max) {
  check(cudaFuncSetAttribute(reinterpret_cast<const void*>(&tile_kernel<kStep, kExactProducts>),
                             cudaFuncAttributeMaxDynamicSharedMemorySize, int(shared)),
        "cudaFuncSetAttribute");
  tile_kernel<kStep, kExactProducts><<<grid, kTileKeys, shared, device.stream>>>(sp, global_max);
  check(cudaGetLastError(), "tile_kernel launch");
}

template <CpSelectStep kStep>
void launch_tiles(const GpuDevice& device, const StepParams& sp, int64_t batch, const Strided& global_max) {
  sequences_kernel<<<grid_for(batch, kElementThreads), kElementThreads, 0, device.stream>>>(sp);
  check(cudaGetLastError(), "sequences_kernel launch");
  qbar_kernel<<<dim3(unsigned(sp.p.num_q_heads), unsigned(batch)), 128, 0, device.stream>>>(sp);
  check(cudaGetLastError(), "qbar_kernel launch");
  if (sp.max_candidates == 0) return;
  const size_t shared = score_shared_bytes(sp.p.group_size, sp.p.head_dim);
  const dim3 grid(unsigned((sp.max_candidates + kTileKeys - 1) / kTileKeys),
                  kStep == CpSelectStep::kTopk ? 1u : unsigned(sp.num_kv_heads), unsigned(batch));
  if (sp.single_query_rows) {
    launch_tile_kernel<kStep, true>(device, sp, grid, shared, global_max);
  } else {
    launch_tile_kernel<kStep, false>(device, sp, grid, shared, global_max);
  }
}

}  // namespace

bool cp_select_supports(const GpuDevice& device, const CpSelectCall& call, std::string* reason) {
  const int64_t tiles = (call.problem.max_seq_k + kTileKeys - 1) / kTileKeys;
  const size_t shared =
      score_shared_bytes(call.problem.num_q_heads / call.problem.num_kv_heads, call.problem.head_dim);
  if (tiles > 0x7fffffff || call.problem.num_kv_heads > 65535 || call.problem.batch > 65535) {
    if (reason != nullptr) *reason = std::string(backend_name()) + " backend: context-parallel selection needs Hkv and B <= 65535";
    return false;
  }
  if (shared > device.max_shared_optin) {
    if (reason != nullptr) {
      *reason = std::string(backend_name()) + " backend: context-parallel selection needs " + std::to_string(shared) +
                " bytes of shared memory for head_dim " + std::to_string(call.problem.head_dim);
    }
    return false;
  }
  return true;
}

void cp_select_run(const GpuDevice& device, const CpSelectCall& call, ScratchCarver& carver) {
  const AttentionProblem& pr = call.problem;
  const CpSelectParams params = cp_select_params(call);
  const int64_t batch = pr.batch, heads = pr.num_q_heads, sets = params.n_sets;
  const bool scores_needed = call.step != CpSelectStep::kIndices;
  StepParams sp;
  sp.max_candidates = scores_needed ? pr.max_seq_k : 0;
  int64_t* positions = carver.take<int64_t>(uint64_t(2 * batch));
  sp.sequences = carver.take<CpShardSequence>(uint64_t(batch));
  sp.segment_lengths = carver.take<int32_t>(uint64_t(batch * sets));
  sp.parts = (sp.max_candidates + kPartKeys - 1) / kPartKeys;
  if (scores_needed) sp.qbar = carver.take<double>(uint64_t(batch * heads * pr.head_dim));
  if (call.step == CpSelectStep::kMax) sp.max_parts = carver.take<MaxPart>(uint64_t(batch * heads * sp.parts));
  if (call.step == CpSelectStep::kSum) {
    sp.digit_parts = carver.take<unsigned long long>(uint64_t(batch * heads * sp.parts * kDigits));
  }
  double* z = nullptr;
  int32_t* ids = nullptr;
  void* topk_scratch = nullptr;
  if (call.step == CpSelectStep::kTopk) {
    z = carver.take<double>(uint64_t(batch * heads));
    sp.votes = carver.take<double>(uint64_t(batch * sets * sp.max_candidates));
    ids = carver.take<int32_t>(uint64_t(batch * sets * params.top_k));
    topk_scratch = carver.take<char>(device_topk_scratch_bytes(int32_t(batch * sets), sp.max_candidates));
  }
  const int64_t shards = call.step == CpSelectStep::kIndices ? call.all_votes.extent(0) : 0;
  const int64_t gathered = shards * batch * sets * params.top_k;
  const int64_t cap = call.step == CpSelectStep::kIndices ? call.out.extent(2) : 0;
  double* gathered_votes = call.step == CpSelectStep::kIndices ? carver.take<double>(uint64_t(gathered)) : nullptr;
  int32_t* gathered_positions = call.step == CpSelectStep::kIndices ? carver.take<int32_t>(uint64_t(gathered)) : nullptr;
  int32_t* index_sets = call.step == CpSelectStep::kIndices ? carver.take<int32_t>(uint64_t(batch * sets * cap)) : nullptr;
  if (carver.sizing() || batch == 0) return;

  sp.p = make_forward_params(pr, call.policy);
  sp.num_kv_heads = pr.num_kv_heads;
  sp.n_init = params.n_init;
  sp.n_local = params.n_local;
  sp.top_k = params.top_k;
  sp.n_sets = params.n_sets;
  sp.heads_per_set = params.heads_per_set;
  sp.score_scale = params.score_scale;
  sp.positions = positions;
  sp.vector_keys = keys_vector_aligned(sp.p);
  sp.single_query_rows = pr.max_seq_q <= 1;
  sp.z = z;
  // kv_start and kv_total live in host memory. (Copies from pageable host memory are staged before
  // cudaMemcpyAsync returns, so the host vectors of this function may go out of scope while the copies are queued.)
  std::vector<int64_t> host_positions(size_t(2 * batch));
  for (int64_t b = 0; b < batch; ++b) {
    host_positions[size_t(2 * b)] = call.kv_start.ptr<const int32_t>()[b * call.kv_start.stride(0)];
    host_positions[size_t(2 * b + 1)] = call.kv_total.ptr<const int32_t>()[b * call.kv_total.stride(0)];
  }
  check(cudaMemcpyAsync(positions, host_positions.data(), host_positions.size() * sizeof(int64_t),
                        cudaMemcpyHostToDevice, device.stream),
        "cudaMemcpyAsync");

  if (call.step == CpSelectStep::kIndices) {
    sequences_kernel<<<grid_for(batch, kElementThreads), kElementThreads, 0, device.stream>>>(sp);
    check(cudaGetLastError(), "sequences_kernel launch");
    if (gathered > 0) {
      pack_gathered_kernel<<<grid_for(gathered, kElementThreads), kElementThreads, 0, device.stream>>>(
          strided(call.all_votes), strided(call.all_positions), batch * sets * params.top_k, sets * params.top_k,
          params.top_k, gathered, gathered_votes, gathered_positions);
      check(cudaGetLastError(), "pack_gathered_kernel launch");
    }
    const std::vector<double> votes = read_back(device, gathered_votes, gathered);
    const std::vector<int32_t> positions_host = read_back(device, gathered_positions, gathered);
    const std::vector<CpShardSequence> sequences = read_back(device, sp.sequences, batch);
    const std::vector<std::vector<int64_t>> index = cp_shard_index_sets(
        params, sequences, shards, cap, [&](int64_t g, int32_t b, int32_t set, int64_t i, double* vote, int64_t* at) {
          const size_t e = size_t(((g * batch + b) * sets + set) * params.top_k + i);
          *vote = votes[e];
          *at = positions_host[e];
        });
    std::vector<int32_t> flat(size_t(batch * sets * cap), -1);
    for (size_t row = 0; row < index.size(); ++row)
      for (size_t i = 0; i < index[row].size(); ++i) flat[row * size_t(cap) + i] = int32_t(index[row][i]);
    if (flat.empty()) return;
    check(cudaMemcpyAsync(index_sets, flat.data(), flat.size() * sizeof(int32_t), cudaMemcpyHostToDevice,
                          device.stream),
          "cudaMemcpyAsync");
    scatter_indices_kernel<<<grid_for(int64_t(flat.size()), kElementThreads), kElementThreads, 0, device.stream>>>(
        index_sets, sets * cap, cap, int64_t(flat.size()), strided(call.out));
    check(cudaGetLastError(), "scatter_indices_kernel launch");
    return;
  }

  std::vector<double> host_z;
  if (call.step == CpSelectStep::kTopk) {  // check the combined digits before anything is written
    const TensorArg& g = call.global_sum;
    std::vector<int64_t> digits(size_t(batch * heads * kDigits));
    if (g.stride(2) == 1 && g.stride(1) == kDigits && (batch == 1 || g.stride(0) == heads * kDigits)) {
      check(cudaMemcpyAsync(digits.data(), g.ptr<const int64_t>(), digits.size() * sizeof(int64_t),
                            cudaMemcpyDeviceToHost, device.stream),
            "cudaMemcpyAsync");
    } else {  // a strided view: element by element (B · Hq · 6 small copies)
      for (int64_t b = 0; b < batch; ++b)
        for (int64_t h = 0; h < heads; ++h)
          for (int i = 0; i < kDigits; ++i) {
            check(cudaMemcpyAsync(&digits[size_t((b * heads + h) * kDigits + i)],
                                  g.ptr<const int64_t>() + b * g.stride(0) + h * g.stride(1) + i * g.stride(2),
                                  sizeof(int64_t), cudaMemcpyDeviceToHost, device.stream),
                  "cudaMemcpyAsync");
          }
    }
    check(cudaStreamSynchronize(device.stream), "cudaStreamSynchronize");
    host_z = cp_normalisers(int32_t(batch), int32_t(heads), [&](int32_t b, int32_t h, int i) {
      return digits[size_t((int64_t(b) * heads + h) * kDigits + i)];
    });
    check(cudaMemcpyAsync(z, host_z.data(), host_z.size() * sizeof(double), cudaMemcpyHostToDevice, device.stream),
          "cudaMemcpyAsync");
  }

  switch (call.step) {
    case CpSelectStep::kMax:
      launch_tiles<CpSelectStep::kMax>(device, sp, batch, Strided{});
      max_parts_kernel<<<dim3(unsigned(heads), unsigned(batch)), kReduceThreads, 0, device.stream>>>(
          sp, strided(call.out));
      check(cudaGetLastError(), "max_parts_kernel launch");
      break;
    case CpSelectStep::kSum:
      launch_tiles<CpSelectStep::kSum>(device, sp, batch, strided(call.global_max));
      digit_parts_kernel<<<dim3(unsigned(heads), unsigned(batch)), kReduceThreads, 0, device.stream>>>(
          sp, strided(call.out));
      check(cudaGetLastError(), "digit_parts_kernel launch");
      break;
    case CpSelectStep::kTopk: {
      launch_tiles<CpSelectStep::kTopk>(device, sp, batch, strided(call.global_max));
      if (sp.max_candidates == 0) {  // no key on this shard: every slot −1 / −inf
        check(cudaMemsetAsync(ids, 0xff, size_t(batch * sets * params.top_k) * sizeof(int32_t), device.stream),
              "cudaMemsetAsync");
      }
      TopkArgs a;
      a.values = sp.votes;
      a.value_type = TopkValueType::kF64;
      a.row_stride = sp.max_candidates;
      a.segments = int32_t(batch * sets);
      a.max_length = sp.max_candidates;
      a.lengths = sp.segment_lengths;
      a.k = int32_t(params.top_k);
      a.out = ids;
      a.out_stride = params.top_k;
      a.out_capacity = int32_t(params.top_k);
      if (sp.max_candidates > 0) check(device_topk(a, topk_scratch, device.multiprocessors, device.stream), "device_topk");
      topk_outputs_kernel<<<dim3(grid_for(params.top_k, kElementThreads), unsigned(sets), unsigned(batch)),
                            kElementThreads, 0, device.stream>>>(sp, ids, strided(call.out),
                                                                 strided(call.out_positions));
      check(cudaGetLastError(), "topk_outputs_kernel launch");
      break;
    }
    case CpSelectStep::kIndices:
      break;
  }
}

SPARSA_GPU_NAMESPACE_END
