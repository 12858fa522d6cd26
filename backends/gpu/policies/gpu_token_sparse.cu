// §5 TOKEN_SPARSE on the device: any batch, no host synchronisation. Mirrors backends/cpu/cpu_token_sparse.cpp (the
// float64 oracle).
//
// Per (sequence b, query head h) of length L (= min(Sq, Skv): the core checks Sq == Skv where it can read the
// lengths; device lengths are not checked), with W = window and n = L − W candidates:
//   0. dense fallback (§5.1) when L <= min_tokens + W or τ == 0: decided on the device per sequence — the head's list
//      becomes [0, L), so the one attention launch serves dense and sparse sequences alike;
//   1. score pass 1 (token_sparse_score.cu): S = scale · Q[L−W, L) · Kᵀ, one block per kKeysPerBlock keys, a
//      (max, Σexp) partial per window row under the causal bound; row_lse_kernel merges them into each window row's
//      log-sum-exp;
//   2. score pass 2 (token_sparse_score.cu): recomputes S over the candidates and p_h[j] = (1/W) Σ_r exp(S[r, j] −
//      lse_r) (the causal softmax of §5.2; every window row sees every candidate). The W × L score matrix is
//      recomputed instead of stored: it would be B·Hq·W·L values (1 GiB at L = 32K, Hq = 32 in float64).
//      fp16/bf16 inputs score on tensor cores in fp32 within a documented bound of the oracle (ALGORITHMS.md §0;
//      the bound and its derivation head token_sparse_score.cu); fp32 inputs, other head dims and HIP in float64;
//   3. pool_kernel + normalize_kernel: avg_pool1d(kernel, zero padding counted) and per-head normalisation ŝ_h
//      (§5.3–4), float64, one candidate per thread;
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
// Every step after the scores is deterministic (fixed reduction orders, no atomics on values), so the same inputs
// give the same selection every time; the coverage count compares exact 2^-62 fixed-point sums with τ.
#include "../../../src/error.h"
#include "../engine/forward_common.cuh"
#include "../runtime/gpu_policies.h"
#include "device_topk.h"
#include "token_sparse_common.cuh"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <string>

SPARSA_GPU_NAMESPACE_BEGIN
namespace {

using namespace token_sparse;

// ---- Other kernels ----
constexpr int kRowThreads = 256;      // row_lse_kernel, pool_kernel, normalize_kernel, finish_kernel, layer_kernel
constexpr int kRowsPerLseBlock = kRowThreads / kLanes;  // row_lse_kernel: one warp per window row
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

using Fixed = unsigned long long;  // fixed-point scores (the shuffle overloads take unsigned long long)

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

// lse of every window row from pass 1's partials: one warp per row, its lanes over the key chunks (grid: row groups
// of kRowsPerLseBlock, heads, sequences; the shuffle reductions run in a fixed order, so the result is deterministic).
__global__ void __launch_bounds__(kRowThreads) row_lse_kernel(const SparseParams sp) {
  const int32_t h = blockIdx.y, b = blockIdx.z;
  const int32_t w = blockIdx.x * kRowsPerLseBlock + int32_t(threadIdx.x) / kLanes, lane = threadIdx.x % kLanes;
  const SparseSequence seq = sparse_sequence(sp, make_sequence_view(sp.fw, b, h));
  if (seq.dense || w >= sp.window) return;  // whole warps
  const int64_t head = int64_t(b) * sp.fw.num_q_heads + h;
  const int32_t chunks = (seq.length + kKeysPerBlock - 1) / kKeysPerBlock;
  const int64_t first = head * sp.key_chunks * sp.window + w;  // chunk c at first + c · W
  double m = kNegInf;
  for (int32_t c = lane; c < chunks; c += kLanes) m = fmax(m, sp.partial_max[first + int64_t(c) * sp.window]);
  for (int offset = kLanes / 2; offset > 0; offset /= 2) m = fmax(m, warp_shfl_xor(m, offset));
  double sum = 0.0;
  for (int32_t c = lane; c < chunks; c += kLanes) {
    const int64_t at = first + int64_t(c) * sp.window;
    if (sp.partial_max[at] != kNegInf) sum += sp.partial_sum[at] * exp(sp.partial_max[at] - m);
  }
  for (int offset = kLanes / 2; offset > 0; offset /= 2) sum += warp_shfl_xor(sum, offset);
  if (lane == 0) sp.row_lse[head * sp.window + w] = m + log(sum);  // key 0 is visible to every row: m finite
}

// ================================================================================== pooling, layer score, budget

// avg_pool1d(p_h) (§5.3; zero padding counted), one candidate per thread (grid: candidate blocks, heads, sequences),
// and each block's sum of its pooled values for the normalisation.
__global__ void __launch_bounds__(kRowThreads) pool_kernel(const SparseParams sp) {
  __shared__ double warp_totals[kRowThreads / kLanes];
  const int32_t h = blockIdx.y, b = blockIdx.z;
  const SparseSequence seq = sparse_sequence(sp, make_sequence_view(sp.fw, b, h));
  const int64_t head = int64_t(b) * sp.fw.num_q_heads + h;
  const int32_t n = seq.candidates, half = sp.pool_kernel / 2;
  const int32_t j = blockIdx.x * blockDim.x + threadIdx.x;
  if (seq.dense || int32_t(blockIdx.x * blockDim.x) >= n) return;  // uniform over the block
  const double* p = sp.attention + head * sp.cand_stride;
  double pooled = 0.0;
  if (j < n) {
    double window_sum = 0.0;  // ascending t, as the CPU adds them
    for (int32_t t = max(0, j - half); t <= min(n - 1, j + half); ++t) window_sum += p[t];
    pooled = window_sum / double(sp.pool_kernel);
    sp.scores[head * sp.cand_stride + j] = pooled;
  }
  const double total = block_sum(pooled, warp_totals);
  if (threadIdx.x == 0) sp.pool_totals[head * sp.pool_blocks + blockIdx.x] = total;
}

// ŝ_h = pooled / Σ pooled (§5.4; the head's total summed from pool_kernel's block sums in ascending order by every
// block alike), and device_topk's segment length (grid as pool_kernel's).
__global__ void __launch_bounds__(kRowThreads) normalize_kernel(const SparseParams sp) {
  __shared__ double head_total;
  const int32_t h = blockIdx.y, b = blockIdx.z;
  const SparseSequence seq = sparse_sequence(sp, make_sequence_view(sp.fw, b, h));
  const int64_t head = int64_t(b) * sp.fw.num_q_heads + h;
  if (blockIdx.x == 0 && threadIdx.x == 0) sp.lengths[head] = seq.candidates;
  const int32_t n = seq.candidates;
  if (seq.dense || int32_t(blockIdx.x * blockDim.x) >= n) return;
  if (threadIdx.x == 0) {
    const int32_t blocks = (n + kRowThreads - 1) / kRowThreads;
    double total = 0.0;
    for (int32_t i = 0; i < blocks; ++i) total += sp.pool_totals[head * sp.pool_blocks + i];
    head_total = total;
  }
  __syncthreads();
  const int32_t j = blockIdx.x * blockDim.x + threadIdx.x;
  if (j < n && head_total > 0.0) sp.scores[head * sp.cand_stride + j] /= head_total;  // an all-zero head stays zero
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
    if (sp.out_aligned16) {  // +0 has all bits clear in f32, f16 and bf16: 16-byte stores of zeros
      const int32_t element_bytes = p.element_type == ElementType::kF32 ? 4 : 2;
      uint4* row = reinterpret_cast<uint4*>(static_cast<char*>(p.out) + out_row * element_bytes);
      for (int32_t c = lane; c < p.head_dim * element_bytes / 16; c += kLanes) row[c] = make_uint4(0, 0, 0, 0);
    } else {
      for (int32_t d = lane; d < p.head_dim; d += kLanes) store_value(p.out, out_row + d, p.element_type, 0.f);
    }
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

// Blocks of pool_kernel / normalize_kernel along the candidates.
int32_t pool_blocks_of(const SparseShape& shape) { return int32_t((shape.cand_stride + kRowThreads - 1) / kRowThreads); }

uint64_t selection_scratch_bytes(const SparseShape& shape, int32_t batch, int32_t window) {
  uint64_t bytes = uint64_t(shape.heads) * shape.capacity * sizeof(int32_t);  // lists
  if (shape.any_sparse) {
    bytes += 2 * uint64_t(shape.heads) * shape.key_chunks * window * sizeof(double);    // partials
    bytes += (2 * uint64_t(shape.heads) + batch) * shape.cand_stride * sizeof(double);  // p, ŝ, s_l
    bytes += uint64_t(shape.heads) * pool_blocks_of(shape) * sizeof(double);            // pooled block sums
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
  const int64_t row_bytes = int64_t(problem.head_dim) * (sp.fw.element_type == ElementType::kF32 ? 4 : 2);
  sp.out_aligned16 = rows_aligned_16(problem.out) && row_bytes % 16 == 0;
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
    sp.pool_blocks = pool_blocks_of(shape);
    sp.pool_totals = carver.take<double>(heads * uint64_t(sp.pool_blocks));
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
    const ScorePrecision precision = score_precision(sp);
    launch_score_pass(sp, precision, false, stream);
    const dim3 lse_grid(uint32_t((sp.window + kRowsPerLseBlock - 1) / kRowsPerLseBlock), n_heads, batch);
    row_lse_kernel<<<lse_grid, kRowThreads, 0, stream>>>(sp);
    check(cudaGetLastError(), "TOKEN_SPARSE row_lse_kernel launch");
    launch_score_pass(sp, precision, true, stream);
    const dim3 pool_grid(uint32_t(sp.pool_blocks), n_heads, batch);
    pool_kernel<<<pool_grid, kRowThreads, 0, stream>>>(sp);
    check(cudaGetLastError(), "TOKEN_SPARSE pool_kernel launch");
    normalize_kernel<<<pool_grid, kRowThreads, 0, stream>>>(sp);
    check(cudaGetLastError(), "TOKEN_SPARSE normalize_kernel launch");
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
    check(device_topk(topk, topk_scratch, device.multiprocessors, stream), "TOKEN_SPARSE device_topk");
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
