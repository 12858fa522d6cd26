// §6 TOKEN_SELECT on the device, mirroring cpu_token_select.cpp (the oracle): per sequence the mean query q̄_h of
// the call's rows, a dense fallback when n_init + top_k + n_local >= N, otherwise scores s[h, t] = q̄_h·K[t, h/g]
// (fp32 for fp16/bf16 keys, else float64: token_select_score.cu) over the candidates C = [n_init, N - n_local), a
// softmax per head over C, the head soft
// vote, T = top_k of the vote (device_topk), and attention of every row and head over
// I = [0, n_init) ∪ T ∪ [N - n_local, N) (token_indices.h: index_attention_launch on prebuilt lists).
// The selection cache (§6.5) lives in device memory; hits and misses are decided on the device, so a run never
// waits for the host and can be captured in a CUDA graph.
//
// A run's launches, in stream order (nothing is decided on the host beyond the shapes):
//   prepare   (Hq × B)      per-sequence mode (no rows / dense / selects), candidate counts, q̄ (float64); with a
//                           cache, each head's share of the lookup, and the sequence's last block decides: cosine vs
//                           the cached concat q̄ and the cached ids' range: hit → skip flag, miss → store q̄; counts
//   score     (tiles, Hkv·chunks, B)  dot products of a 256-candidate tile for a chunk of the group's heads, the
//                           tile's softmax max/sum per head, exp(s - tile max) kept in scratch (token_select_score.cu):
//                           fp32 for fp16/bf16 keys (score_tc_kernel on tensor cores, else score_f32_kernel), else
//                           float64 (score_mma_kernel on sm_90 with groups >= 4 and head_dim <= 128, elsewhere
//                           score_kernel)
//   merge     (Hq × B)      per head: max and denominator over the tiles (float64 scoring; with fp32 scoring the
//                           last score block of each grid column merges its heads' partials: no launch)
//   vote      (tiles, sets, B) vote[t] = Σ_h exp(s - m_h) / Z_h over the set's heads (float64 scoring); with fp32
//                           scoring its log, as a running log-sum-exp, inside the top-k's launch (LogVotePrologue)
//   device_topk             T (token ids, ascending) straight into the cache slot (or scratch); skipped on a hit
//   lists     (sets × B)    I per set, selected_indices, PAIRS_COMPUTED; left out when none of them is wanted and
//                           the tensor-core decode walk composes I from T itself (forward_decode.h)
//   attention               index_attention_launch over I (or the dense forward when every sequence is dense)
// Score, merge, vote and top-k exit at once for sequences that do not select or hit the cache.
//
// Selections follow ALGORITHMS.md §0: with fp32 scores, every top-k decision farther than the documented bound eps
// from the threshold agrees with the CPU (token_select_score.cu states eps). The float64 path:
// float64 scores without conversion instructions: a 16-bit (or fp32) key element placed bit by bit into a
// double's exponent/mantissa fields is the element times 2^-1008 (f16) or 2^-896 (bf16, f32) exactly, subnormals
// included; q̄ is pre-multiplied by the inverse power of two (exact, and it cannot overflow: |q̄| is at most the
// type's largest finite value). Every product and FMA is therefore the one of the unscaled values. (An inf/NaN key
// element becomes a finite value: such inputs give garbage either way.) The dot products use FMA (or the tensor
// cores' float64 MMA, whose partial sums round differently again) and the sums of the softmax run in tree order, so
// votes equal the CPU's to a few ulps, not bit for bit: selections agree unless two votes at the top-k boundary are
// that close.
#include "../../../src/common/policy_sizes.h"
#include "../../../src/error.h"
#include "../kernels/forward_decode.h"
#include "device_topk_kernel.cuh"
#include "token_select_common.cuh"

#include <algorithm>
#include <cmath>
#include <memory>
#include <string>

SPARSA_GPU_NAMESPACE_BEGIN
namespace {

using namespace token_select;  // the parameters, constants and device helpers shared with token_select_score.cu

// ---- Kernels ----

// The last prepare block of sequence b: may the cached T of slot b be reused (cos(q̄, cached) >= theta and every
// cached id still a candidate)? Hit: skip the selection. Miss: the slot takes this call's q̄ (already in its other
// copy) and layout now and its T from device_topk later. Counts both. The partials are summed in head order, so
// the decision is deterministic.
__device__ void decide_lookup(const SelectParams& sp, int32_t b, bool same_layout) {
  __shared__ int32_t hit;
  const int32_t heads = sp.p.num_q_heads;
  const int64_t qbar_len = int64_t(heads) * sp.p.head_dim;
  if (threadIdx.x < kWarpLanes) {  // one warp: lane l adds heads l, l + lanes, ..., then a fixed shuffle tree
    double v[kLookupSums] = {0.0, 0.0, 0.0, 0.0};
    for (int32_t h = threadIdx.x; h < heads; h += kWarpLanes) {
      const double* partial = sp.lookup_partials + (int64_t(b) * heads + h) * kLookupSums;
      for (int j = 0; j < kLookupSums; ++j) v[j] += load_written_by_other_blocks(partial + j);
    }
    for (int offset = kWarpLanes / 2; offset > 0; offset /= 2) {
      for (int j = 0; j < kLookupSums; ++j) v[j] += warp_shfl_xor(v[j], offset);
    }
    if (threadIdx.x == 0) {
      hit = same_layout && v[3] == 0.0 && v[1] > 0.0 && v[2] > 0.0 &&
            v[0] / (sqrt(v[1]) * sqrt(v[2])) >= sp.cache_theta;
    }
  }
  __syncthreads();
  int32_t* slot = sp.cache.slots + int64_t(b) * kSlotFields;
  if (hit) {
    if (threadIdx.x == 0) {
      sp.skip[b] = 1;
      atomicAdd(&sp.cache.totals[0], 1ull);
      stats_add(sp.stats, SPARSA_STAT_CACHE_HITS, 1);
    }
    return;
  }
  if (threadIdx.x == 0) {
    slot[kSlotFilled] = 1;
    slot[kSlotQbarCopy] ^= 1;  // this run's q̄, written beside the cached one by the prepare blocks
    slot[kSlotQbarLength] = int32_t(qbar_len);
    slot[kSlotSets] = sp.n_sets;
    slot[kSlotTopK] = sp.top_k;
    atomicAdd(&sp.cache.totals[1], 1ull);
    stats_add(sp.stats, SPARSA_STAT_CACHE_MISSES, 1);
  }
}

// Element d of q̄_h: the mean of the call's query rows of head h, in row order.
__device__ __forceinline__ double mean_query_element(const SelectParams& sp, const SequenceView& s, int32_t d) {
  double sum = 0.0;
  for (int32_t i = 0; i < s.seq_q; ++i) {
    sum += double(load_value(sp.p.q, query_row_offset(sp.p.q_strides, s, i) + d, sp.p.element_type));
  }
  return sum / double(s.seq_q);
}

// Block (h, b): the sequence's mode and candidate count (h = 0), q̄_h = mean of the call's rows of head h. With a
// selection cache, the block also adds up its head's share of the lookup (§6.5, the CPU's can_reuse): q̄_h·cached_h,
// |q̄_h|², |cached_h|² and whether its slice of the cached ids leaves the candidates; the sequence's last block to
// finish decides (decide_lookup). A separate lookup kernel would cost a launch and wait for all of q̄ anyway.
__global__ void __launch_bounds__(kPrepareThreads) prepare_kernel(const SelectParams sp) {
  __shared__ double scratch[kLookupSums * kPrepareThreads / kWarpLanes], sums[kLookupSums];
  __shared__ int32_t is_last;
  allow_next_kernel_start();  // a few blocks: the score kernel's may take the free SM slots and wait for them
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
  if (mode != kSelects) return;  // the same for every head: a sequence's blocks all arrive below, or none does
  if (threadIdx.x == 0 && sp.merge_arrivals != nullptr) sp.merge_arrivals[int64_t(b) * sp.p.num_q_heads + h] = 0;
  const bool lookup = sp.cache.slots != nullptr;
  const int64_t qbar_len = int64_t(sp.p.num_q_heads) * sp.p.head_dim;
  double* qbar = sp.qbar + (int64_t(b) * sp.p.num_q_heads + h) * sp.p.head_dim;
  if (!lookup) {
    for (int32_t d = threadIdx.x; d < sp.p.head_dim; d += blockDim.x) qbar[d] = mean_query_element(sp, s, d);
    return;
  }
  // Nothing loaded below waits for the slot's fields: both q̄ copies and this block's share of the cached ids are
  // read while the fields are in flight, and the fields only choose among them (one round trip, not three). The
  // slot is read before this block arrives: the deciding block rewrites it (and which q̄ copy is cached) only after
  // every block of the sequence has arrived; T changes later still (device_topk). The ids are read whatever the
  // layout (the slot's selection buffer holds n_sets · top_k of them; validation keeps that within its capacity)
  // and count only when the layout matches.
  const int32_t* slot = sp.cache.slots + int64_t(b) * kSlotFields;
  const int32_t filled = slot[kSlotFilled], cached_length = slot[kSlotQbarLength], cached_sets = slot[kSlotSets],
                cached_top_k = slot[kSlotTopK], copy = slot[kSlotQbarCopy] & 1;
  bool outside = false;  // a cached id of this block's share is no longer a candidate
  {
    const int32_t* ids = sp.cache.selections + b * sp.cache.selection_capacity;
    const int64_t first = sp.n_init, last = int64_t(s.seq_k) - sp.n_local;
    const int64_t count = int64_t(sp.n_sets) * sp.top_k, share = (count + sp.p.num_q_heads - 1) / sp.p.num_q_heads;
    const int64_t end = min(count, (h + 1) * share);
    for (int64_t i = h * share + threadIdx.x; i < end; i += blockDim.x) outside |= ids[i] < first || ids[i] >= last;
  }
  double* copies = sp.cache.qbars + (2 * int64_t(b)) * sp.cache.qbar_capacity + int64_t(h) * sp.p.head_dim;
  double v[kLookupSums] = {0.0, 0.0, 0.0, 0.0};  // q̄·cached, |q̄|², |cached|², cached ids outside C
  for (int32_t d = threadIdx.x; d < sp.p.head_dim; d += blockDim.x) {
    const double copy0 = copies[d], copy1 = copies[sp.cache.qbar_capacity + d];
    const double mean = mean_query_element(sp, s, d);
    const double cached = copy == 0 ? copy0 : copy1;
    qbar[d] = mean;
    copies[(copy ^ 1) * sp.cache.qbar_capacity + d] = mean;  // the slot's other copy: the cached one on a miss
    v[0] = fma(mean, cached, v[0]);
    v[1] = fma(mean, mean, v[1]);
    v[2] = fma(cached, cached, v[2]);
  }
  const bool same_layout = filled != 0 && cached_length == qbar_len && cached_sets == sp.n_sets &&
                           cached_top_k == sp.top_k;
  v[3] = outside ? 1.0 : 0.0;
  block_reduce<kLookupSums, false>(v, scratch, sums);
  if (threadIdx.x == 0) {
    double* partial = sp.lookup_partials + (int64_t(b) * sp.p.num_q_heads + h) * kLookupSums;
    for (int j = 0; j < kLookupSums; ++j) partial[j] = sums[j];
    __threadfence();  // the partial is visible before the arrival (q̄ is read by later launches only)
    // Wraps to 0 at the last arrival, so the counter is ready for the next run without a reset.
    is_last = atomicInc(reinterpret_cast<unsigned int*>(&sp.cache.slots[int64_t(b) * kSlotFields + kSlotArrivals]),
                        unsigned(sp.p.num_q_heads - 1)) == unsigned(sp.p.num_q_heads - 1);
  }
  __syncthreads();
  if (!is_last) return;
  __threadfence();
  decide_lookup(sp, b, same_layout);
}

// Float64 scoring, block (h, b): m_h = max over the tiles, Z_h = Σ sum · exp(max - m_h) (fp32 scoring merges in
// the score kernel: merge_partials_if_last).
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
// exp(s - tile max) · exp(tile max - m_h) / Z_h (float64 scoring).
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

// fp32 scoring: log vote[c] = log Σ_h exp(s_h[c] - lse_h) over the set's heads (lse_h = m_h + log Z_h), as a running
// log-sum-exp in fp32. The log domain keeps every candidate's vote representable: against a needle that dominates a
// head, the others' exp(s - m) fall far below fp32's range while their order still decides the top-k. The top-k of
// the log votes is that of the votes (log is increasing).
// Heads' scores a thread loads before using any: 8 floats, or 4 float4s (the top-k kernel's register budget of 64
// per thread, which the vote shares, holds no more without spilling).
template <int kColumns>
constexpr int kLogVoteLoads = kColumns == 1 ? 8 : 4;
// Consecutive candidates per thread: 4 (one 16-byte load per head, four chains to fold) where a grid of such tiles
// still fills the GPU, else 1 (at 128K candidates, 4 per thread leaves a quarter of the threads to hide the latency).
constexpr int kLogVoteWideColumns = 4;

// Folds x into the running log-sum-exp (max, Σ exp(x - max)).
__device__ __forceinline__ void fold_log_sum_exp(float x, float& running_max, float& running_sum) {
  if (x > running_max) {
    running_sum = running_sum * expf(running_max - x) + 1.0f;
    running_max = x;
  } else {
    running_sum += expf(x - running_max);
  }
}

// The block's tiles of segment (set, b): tiles first_tile, first_tile + tile_stride, ... of kScoreTile · kColumns
// candidates; a thread takes kColumns consecutive ones (one float4 per head when 4: a score row's stride is a
// multiple of kScoreTile, so the last group of a row stays inside it, and lanes past the candidates compute values
// nobody reads). Each candidate's fold runs over the heads in order, whatever kColumns is, so the votes do not
// depend on it.
template <int kColumns>
__device__ void log_vote_tiles(const SelectParams& sp, int32_t set, int32_t b, int32_t first_tile,
                               int32_t tile_stride) {
  static_assert(kColumns == 1 || kColumns == 4, "one float or one float4 per head");
  static_assert(kScoreTile % kColumns == 0, "score rows' strides keep every candidate group whole");
  constexpr int kTile = kScoreTile * kColumns;
  __shared__ float head_lse[kVoteHeadsPerPass];
  const SequenceInfo info = sp.sequences[b];
  if (info.mode != kSelects || sp.skip[b] != 0) return;
  const int32_t tiles = (info.candidates + kTile - 1) / kTile;
  const int64_t first_row = int64_t(b) * sp.p.num_q_heads + int64_t(set) * sp.heads_per_set;
  for (int32_t tile = first_tile; tile < tiles; tile += tile_stride) {
    const int32_t c = tile * kTile + threadIdx.x * kColumns;
    float running_max[kColumns], running_sum[kColumns];
#pragma unroll
    for (int k = 0; k < kColumns; ++k) {
      running_max[k] = -INFINITY;
      running_sum[k] = 0.0f;
    }
    for (int32_t h0 = 0; h0 < sp.heads_per_set; h0 += kVoteHeadsPerPass) {
      const int32_t n = min(kVoteHeadsPerPass, sp.heads_per_set - h0);
      __syncthreads();  // the previous pass's values are read
      if (int32_t(threadIdx.x) < n) {
        const int64_t row = first_row + h0 + threadIdx.x;
        head_lse[threadIdx.x] = float(sp.head_max[row] + log(sp.head_sum[row]));
      }
      __syncthreads();
      if (c < info.candidates) {
        for (int32_t j0 = 0; j0 < n; j0 += kLogVoteLoads<kColumns>) {
          float x[kLogVoteLoads<kColumns>][kColumns];  // loaded together, then folded in
#pragma unroll
          for (int i = 0; i < kLogVoteLoads<kColumns>; ++i) {
            if (j0 + i >= n) continue;
            const float* at = sp.scores32 + (first_row + h0 + j0 + i) * sp.score_stride + c;
            if constexpr (kColumns == 4) {
              const float4 v = *reinterpret_cast<const float4*>(at);
              x[i][0] = v.x;
              x[i][1] = v.y;
              x[i][2] = v.z;
              x[i][3] = v.w;
            } else {
              x[i][0] = *at;
            }
          }
#pragma unroll
          for (int i = 0; i < kLogVoteLoads<kColumns>; ++i) {
            if (j0 + i < n) {  // a condition, not a break: the loop stays unrollable
              const float lse = head_lse[j0 + i];
#pragma unroll
              for (int k = 0; k < kColumns; ++k) fold_log_sum_exp(x[i][k] - lse, running_max[k], running_sum[k]);
            }
          }
        }
      }
    }
    if (c < info.candidates) {
      float* out = sp.log_votes + (int64_t(b) * sp.n_sets + set) * sp.score_stride + c;
      if constexpr (kColumns == 4) {
        *reinterpret_cast<float4*>(out) =
            make_float4(running_max[0] + logf(running_sum[0]), running_max[1] + logf(running_sum[1]),
                        running_max[2] + logf(running_sum[2]), running_max[3] + logf(running_sum[3]));
      } else {
        *out = running_max[0] + logf(running_sum[0]);
      }
    }
  }
}

// The log vote as the top-k's prologue (device_topk_kernel.cuh): the top-k grid's blocks are spread evenly over the
// segments (set, b) (each segment's blocks walk its tiles in a stride), so the vote costs no launch of its own and a
// cache hit one exiting launch fewer. Segment s = b · n_sets + set, the top-k's order.
template <int kColumns>
struct LogVotePrologue {
  static_assert(topk_detail::kThreads == kScoreTile, "a top-k block has one vote tile's threads");
  SelectParams sp;
  int32_t segments = 0;
  __device__ void operator()(int64_t block, int64_t blocks) const {
    const int64_t per_segment = blocks >= segments ? blocks / segments : 1;
    for (int64_t virtual_block = block; virtual_block < segments * per_segment; virtual_block += blocks) {
      const int64_t segment = virtual_block / per_segment;
      log_vote_tiles<kColumns>(sp, int32_t(segment % sp.n_sets), int32_t(segment / sp.n_sets),
                               int32_t(virtual_block % per_segment), int32_t(per_segment));
    }
  }
};

// Block (set, b): I = [0, n_init) ∪ T ∪ [N - n_local, N) (or [0, N) when dense) as the set's key list, the
// selected_indices row, and PAIRS_COMPUTED (every head of the set, every row up to its causal horizon).
__global__ void __launch_bounds__(kListThreads) list_kernel(const SelectParams sp) {
  __shared__ unsigned long long pairs_sum;
  const int32_t set = blockIdx.x, b = blockIdx.y;
  const SequenceInfo info = sp.sequences[b];
  const SequenceView s = make_sequence_view(sp.p, b, 0);
  const IndexSetParams& ix = sp.ix;
  const int32_t n = info.mode == kNoRows ? 0 : (info.mode == kDense ? s.seq_k : token_select_set_size(sp.n_init, sp.top_k, sp.n_local));
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
    const uint64_t selections_at = qbars_at + 2 * slots * uint64_t(view_.qbar_capacity) * sizeof(double);
    bytes_ = selections_at + slots * uint64_t(view_.selection_capacity) * sizeof(int32_t);
    check(cudaMalloc(&memory_, bytes_), "cudaMalloc (selection cache)");
    // All of it, q̄ and T included: the lookup reads a slot's q̄ copies and ids before it knows whether the slot
    // is filled (and ignores them when it is not).
    const cudaError_t cleared = cudaMemsetAsync(memory_, 0, bytes_, device_->stream);
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
  // Zeroes the totals and slot records (an emptied slot's q̄ and T stay as they were: read, then ignored).
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
  const int64_t selected = token_select_set_size<int64_t>(pol.select_n_init, pol.select_top_k, pol.select_n_local);
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
  return plan_index_attention(device, p, problem.max_seq_q, shape.list_capacity, flat_rows_of(problem));
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
  sp.lookup_partials = carver.take<double>(uint64_t(batch * heads) * kLookupSums);
  const uint64_t tile_stats = uint64_t(batch * heads) * uint64_t(shape.tiles);
  sp.tile_max = carver.take<double>(tile_stats);
  sp.tile_sum = carver.take<double>(tile_stats);
  sp.head_max = carver.take<double>(uint64_t(batch * heads));
  sp.head_sum = carver.take<double>(uint64_t(batch * heads));
  if (scores_in_fp32(problem, sp.p)) {
    sp.scores32 = carver.take<float>(uint64_t(batch * heads) * uint64_t(shape.score_stride));
    sp.merge_arrivals = carver.take<unsigned int>(uint64_t(batch * heads));  // a score grid has <= Hq columns
    sp.stat_partials = stat_partials(device, problem, sp);
  } else {
    sp.scores = carver.take<double>(uint64_t(batch * heads) * uint64_t(shape.score_stride));
  }
  if (sp.scores32 != nullptr) {
    sp.log_votes = carver.take<float>(uint64_t(segments) * uint64_t(shape.score_stride));
  } else {
    sp.votes = carver.take<double>(uint64_t(segments) * uint64_t(shape.score_stride));
  }
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
  if (!shape.all_dense) {
    launch_scores(device, problem, sp, shape.tiles, batch);
    if (sp.scores32 == nullptr) {  // float64 scoring: m_h and Z_h merged, then the votes, before the top-k
      const dim3 vote_grid(tile_blocks(device, shape.tiles, segments), unsigned(shape.n_sets), unsigned(batch));
      merge_kernel<<<dim3(unsigned(heads), unsigned(batch)), kReduceThreads, 0, stream>>>(sp);
      check(cudaGetLastError(), "token_select merge_kernel launch");
      vote_kernel<<<vote_grid, kScoreTile, 0, stream>>>(sp);
      check(cudaGetLastError(), "token_select vote_kernel launch");
    }
    TopkArgs a;
    a.values = sp.scores32 != nullptr ? static_cast<const void*>(sp.log_votes) : static_cast<const void*>(sp.votes);
    a.value_type = sp.scores32 != nullptr ? TopkValueType::kF32 : TopkValueType::kF64;
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
    cudaError_t selected = cudaSuccess;
    if (sp.scores32 == nullptr) {
      selected = device_topk(a, topk_scratch, device.multiprocessors, stream);
    } else {  // fp32 scoring (m_h, Z_h merged by the score kernel's last blocks): the log vote runs inside the top-k
      constexpr int64_t kWideTile = int64_t(kScoreTile) * kLogVoteWideColumns;
      const int64_t wide_tiles = (shape.max_candidates + kWideTile - 1) / kWideTile;
      if (wide_tiles * segments >= int64_t(device.multiprocessors) * kScoreBlocksPerSm) {
        selected = device_topk_with(a, LogVotePrologue<kLogVoteWideColumns>{sp, int32_t(segments)}, topk_scratch,
                                    device.multiprocessors, stream);
      } else {
        selected = device_topk_with(a, LogVotePrologue<1>{sp, int32_t(segments)}, topk_scratch,
                                    device.multiprocessors, stream);
      }
    }
    check(selected, "token_select device_topk");
  }
  // The tensor-core decode walk composes I from the selection itself; the list kernel runs only where something
  // else needs the lists (selected_indices, PAIRS_COMPUTED, the CUDA-core walk).
  const bool composed = !shape.all_dense && ix.selected == nullptr && sp.stats.out == nullptr &&
                        problem.max_seq_q > 0 && forward_decode_lists_supports(sp.p);
  if (!composed) {
    list_kernel<<<dim3(unsigned(shape.n_sets), unsigned(batch)), kListThreads, 0, stream>>>(sp);
    check(cudaGetLastError(), "token_select list_kernel launch");
  }
  if (sp.stats.out != nullptr) check(stats_count_launch(sp.p, sp.stats, stream), "stats_count_kernel launch");
  if (problem.max_seq_q == 0) return;
  if (shape.all_dense) {
    launch_forward(device, launch, sp.p);
  } else if (composed) {
    DecodeKeyLists lists;
    lists.heads_per_list = shape.heads_per_set;
    lists.selections = sp.selections;
    lists.selection_stride = sp.selection_stride;
    lists.candidate_counts = sp.segment_lengths;  // |C| per set, 0 unless the sequence selects
    lists.n_init = sp.n_init;
    lists.top_k = sp.top_k;
    lists.n_local = sp.n_local;
    check(forward_decode_lists_launch(sp.p, lists, int32_t(problem.max_seq_q), stream), "token_select attention");
  } else {
    check(index_attention_launch(sp.p, ix, int32_t(problem.max_seq_q), stream), "token_select index attention");
  }
}

std::unique_ptr<SelectionCacheState> create_device_selection_cache(const GpuDevice& device,
                                                                   const SelectionCacheDims& dims) {
  return std::make_unique<DeviceSelectionCache>(device, dims);
}

SPARSA_GPU_NAMESPACE_END
