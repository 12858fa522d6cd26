// The segmented top-k's kernel and launcher (device_topk.h says what the selection does). Reads top to bottom:
// order keys, per-segment state, the phases (init, digit pass, count, ordered write), the one cooperative kernel
// that runs them, the launcher. A header so that a caller can hand the kernel a prologue: device code that every
// block runs before the selection's first barrier and that produces the values it selects from (TOKEN_SELECT's head
// vote), which saves that producer a launch of its own. device_topk.cu instantiates it without one.
//
// Order keys: a value's bits mapped to an unsigned integer that sorts like the value (sign flipped for positives,
// all bits flipped for negatives), -0 folded onto +0 and every NaN onto key 0, below -inf. The top-k is then "the k
// largest keys, ties to the smaller index": a threshold key K and a count r such that every key > K is taken and
// the r equal keys with the smallest indices.
//
// A segment's state (prefix, mask, remaining) says which high bits of K are known: elements whose masked key is
// above the prefix are certainly taken, those equal to it are still undecided, and `remaining` of those are taken.
// Each digit pass histograms the next 11 bits of the undecided elements; the last item to finish the segment
// walks the histogram from the top and extends the prefix. When the chosen bin holds exactly `remaining` elements,
// they are all taken and the segment is resolved without further passes.
#pragma once

#include "device_topk.h"

#include "../../../src/common/selection_order.h"  // order_key

#if SPARSA_GPU_IS_HIP
#include <hip/hip_cooperative_groups.h>
#else
#include <cooperative_groups.h>
#endif

#include <cstdint>
#include <type_traits>

SPARSA_GPU_NAMESPACE_BEGIN
namespace topk_detail {

constexpr int kThreads = 256;
constexpr int kDigitBits = 11;
constexpr int kBins = 1 << kDigitBits;
constexpr int kBinsPerThread = kBins / kThreads;
constexpr int kElementsPerThread = 8;  // write phase: each thread compacts a contiguous run, in index order
constexpr int kLoadsInFlight = 8;       // digit and count phases: loads a thread issues before using any
// Elements of one item (one block's share of a segment) in every phase: few enough that one long segment (a
// decode's vote over 128K candidates) spreads over many SMs.
constexpr int64_t kElementsPerBlock = int64_t(kThreads) * kElementsPerThread;
// Blocks per SM of the cooperative grid, which __launch_bounds__ makes resident (so no occupancy query per run).
// H200, TOKEN_SELECT's vote over 1M candidates (512 items): 28.7–33.8 µs with 4, 39.2–46.4 µs with 2 (two items per
// block); over 128K (64 items) the same.
constexpr int kBlocksPerSm = 4;
constexpr uint64_t kScratchAlignment = 256;
constexpr int kMaxDigitPasses = 6;  // F64: 64 bits in 11-bit digits
// The ordered write packs a block's (greater, equal) counts into one 32-bit scan value.
constexpr int kEqualBits = 16;
static_assert(kElementsPerBlock < (int64_t(1) << kEqualBits), "per-block counts must fit the packed scan");
static_assert(kBins % kThreads == 0, "every thread owns the same number of histogram bins");
static_assert(kThreads >= kMaxDigitPasses, "one thread zeroes each pass's count of segments left active");

enum SegmentStatus : int32_t { kActive = 0, kResolved = 1, kSkipped = 2 };

struct SegmentState {
  unsigned long long prefix;  // known high bits of the threshold key
  unsigned long long mask;    // which bits `prefix` fixes
  int32_t k;                  // k_s
  int32_t remaining;          // undecided elements ((key & mask) == prefix) to take, smallest indices first
  int32_t length;
  int32_t status;             // SegmentStatus
  unsigned int arrivals;      // blocks of the current pass that finished this segment
  int32_t unused;
};

// ---- Order keys (order_key: src/common/selection_order.h) ----

// The order keys of elements first, first + kThreads, ... (kLoadsInFlight of them; 0 at and past `end`), all
// loads issued before any key is used.
template <typename T>
__device__ __forceinline__ void load_order_keys(const T* row, int64_t first, int64_t end,
                                                uint64_t (&keys)[kLoadsInFlight]) {
#pragma unroll
  for (int u = 0; u < kLoadsInFlight; ++u) {
    const int64_t t = first + int64_t(u) * kThreads;
    keys[u] = t < end ? order_key(row[t]) : 0;
  }
}

// Exclusive prefix sum of `value` over the block's threads in thread order; every thread calls it. `buffer` holds
// 2 * kThreads entries of shared memory; *total receives the block's sum.
__device__ inline uint32_t block_exclusive_scan(uint32_t value, uint32_t* buffer, uint32_t* total) {
  const int t = threadIdx.x;
  int in = 0;
  buffer[t] = value;
  __syncthreads();
  for (int offset = 1; offset < kThreads; offset <<= 1) {
    uint32_t sum = buffer[in * kThreads + t];
    if (t >= offset) sum += buffer[in * kThreads + t - offset];
    buffer[(in ^ 1) * kThreads + t] = sum;
    in ^= 1;
    __syncthreads();
  }
  const uint32_t inclusive = buffer[in * kThreads + t];
  *total = buffer[in * kThreads + kThreads - 1];
  __syncthreads();  // the buffer may be reused right after
  return inclusive - value;
}

__device__ __forceinline__ int32_t* segment_output(const TopkArgs& a, int64_t s) {
  if (a.out_segments_per_group > 0) {
    return a.out + (s / a.out_segments_per_group) * a.out_group_stride + (s % a.out_segments_per_group) * a.out_stride;
  }
  return a.out + s * a.out_stride;
}

// ---- Phases ----
// Each phase is a loop of items over the grid (one cooperative launch: every block is resident, and a grid barrier
// separates the phases). An item is one block's share of one segment; every thread of the block takes part in it.

// Shared memory of one block, reused by every phase.
struct PhaseShared {
  uint32_t hist[kBins];
  uint32_t scan_buffer[2 * kThreads];
  unsigned int sums[2];
  int32_t is_last;
  uint32_t remaining_at_start;
};
// kBlocksPerSm blocks fit the 64 KiB of shared memory per SM that every supported GPU has at least.
static_assert(kBlocksPerSm * sizeof(PhaseShared) <= 64 * 1024, "the cooperative grid's blocks must be resident");

// Segment s: k_s, length and status; zeroes the segment's histogram.
__device__ inline void init_segment(const TopkArgs& a, SegmentState* states, uint32_t* histograms,
                                    unsigned int* still_active, int64_t s) {
  if (s == 0 && threadIdx.x < kMaxDigitPasses) still_active[threadIdx.x] = 0;
  const bool skipped = a.skip != nullptr && a.skip[s / a.segments_per_skip] != 0;
  if (threadIdx.x == 0) {
    int64_t length = a.max_length;
    if (a.lengths != nullptr) length = a.lengths[s] < 0 ? 0 : (a.lengths[s] < length ? a.lengths[s] : length);
    int64_t k = a.k_device != nullptr ? a.k_device[s / a.segments_per_k] : a.k;
    k = k < 0 ? 0 : (k < length ? k : length);
    SegmentState& st = states[s];
    st.prefix = 0;
    st.mask = 0;  // every element undecided; when k == length all of them are taken
    st.k = int32_t(k);
    st.remaining = int32_t(k);
    st.length = int32_t(length);
    st.status = skipped ? kSkipped : (k == length ? kResolved : kActive);
    st.arrivals = 0;
  }
  if (skipped) return;
  for (int i = threadIdx.x; i < kBins; i += kThreads) histograms[s * kBins + i] = 0;
}

// One digit pass over one item (kElementsPerBlock elements of segment item / blocks_per_segment): bits
// [shift, shift + digit_bits) of the undecided elements.
template <typename T>
__device__ void digit_pass_item(const TopkArgs& a, SegmentState* states, uint32_t* histograms,
                                unsigned int* still_active, int32_t blocks_per_segment, int32_t shift,
                                int32_t digit_bits, int64_t item, PhaseShared& sh) {
  const int64_t s = item / blocks_per_segment;
  const int64_t part = item % blocks_per_segment;
  SegmentState* st = states + s;
  if (st->status != kActive) return;  // uniform over the segment's items: only a pass's last item changes it
  // Every state field is read here, before the first barrier: the last item's picking thread rewrites prefix,
  // mask, remaining and status below, and a read after the barriers would race with that write (a global
  // read-after-write between warps that racecheck does not see: `remaining` used to be read after the scan, so a
  // warp scheduled late could read the picker's new value and pick a second, wrong digit).
  const uint64_t mask = st->mask, prefix = st->prefix;
  const int64_t length = st->length;
  if (threadIdx.x == 0) sh.remaining_at_start = uint32_t(st->remaining);  // shared: no register held over
  for (int i = threadIdx.x; i < kBins; i += kThreads) sh.hist[i] = 0;
  __syncthreads();

  // Histogram of this item's share. Clustered data (votes share their exponent bits) would serialise the shared
  // atomics on one bin, so each thread merges runs of equal digits first.
  const T* row = static_cast<const T*>(a.values) + s * a.row_stride;
  const int64_t begin = part * kElementsPerBlock;
  const int64_t end = begin + kElementsPerBlock < length ? begin + kElementsPerBlock : length;
  const uint32_t digit_mask = (1u << digit_bits) - 1u;
  uint32_t run_digit = 0, run_count = 0;
  for (int64_t first = begin + threadIdx.x; first < end; first += int64_t(kThreads) * kLoadsInFlight) {
    uint64_t keys[kLoadsInFlight];
    load_order_keys(row, first, end, keys);
#pragma unroll
    for (int u = 0; u < kLoadsInFlight; ++u) {
      if (first + int64_t(u) * kThreads >= end || (keys[u] & mask) != prefix) continue;
      const uint32_t digit = uint32_t(keys[u] >> shift) & digit_mask;
      if (digit != run_digit) {
        if (run_count != 0) atomicAdd(&sh.hist[run_digit], run_count);
        run_digit = digit;
        run_count = 0;
      }
      ++run_count;
    }
  }
  if (run_count != 0) atomicAdd(&sh.hist[run_digit], run_count);
  __syncthreads();
  uint32_t* global_hist = histograms + s * kBins;
  for (int i = threadIdx.x; i < kBins; i += kThreads) {
    if (sh.hist[i] != 0) atomicAdd(&global_hist[i], sh.hist[i]);
  }
  __threadfence();
  __syncthreads();
  if (threadIdx.x == 0) sh.is_last = atomicAdd(&st->arrivals, 1u) == unsigned(blocks_per_segment - 1);
  __syncthreads();
  if (!sh.is_last) return;
  __threadfence();

  // Last item of the segment: walk the bins from the top to the one holding the remaining-th undecided element.
  // Thread t owns bins kBins-1-t*kBinsPerThread downwards (bins above 2^digit_bits are empty).
  const volatile uint32_t* counts = global_hist;  // written by other blocks' atomics: bypass the L1 cache
  uint32_t own[kBinsPerThread];
  uint32_t own_sum = 0;
#pragma unroll
  for (int j = 0; j < kBinsPerThread; ++j) {
    own[j] = counts[kBins - 1 - (threadIdx.x * kBinsPerThread + j)];
    own_sum += own[j];
  }
  uint32_t total = 0;
  uint32_t above = block_exclusive_scan(own_sum, sh.scan_buffer, &total);
  const uint32_t remaining = sh.remaining_at_start;
  if (above < remaining && above + own_sum >= remaining) {
#pragma unroll
    for (int j = 0; j < kBinsPerThread; ++j) {
      if (above + own[j] >= remaining) {
        const uint32_t digit = uint32_t(kBins - 1 - (threadIdx.x * kBinsPerThread + j));
        const uint32_t left = remaining - above;
        st->prefix = prefix | (uint64_t(digit) << shift);
        st->mask = mask | (uint64_t(digit_mask) << shift);
        st->remaining = int32_t(left);
        const bool resolved = own[j] == left || shift == 0;
        st->status = resolved ? kResolved : kActive;
        if (!resolved) atomicAdd(still_active, 1u);
        break;
      }
      above += own[j];
    }
  }
  __syncthreads();  // every count read before the histogram is cleared for the next pass
  for (int i = threadIdx.x; i < kBins; i += kThreads) global_hist[i] = 0;
  if (threadIdx.x == 0) st->arrivals = 0;
}

// Per item: how many of its elements are taken for sure (greater) and how many equal the threshold.
template <typename T>
__device__ void count_item(const TopkArgs& a, const SegmentState* states, int32_t* block_counts,
                           int32_t blocks_per_segment, int64_t item, PhaseShared& sh) {
  const int64_t s = item / blocks_per_segment;
  const int64_t part = item % blocks_per_segment;
  const SegmentState& st = states[s];
  if (st.status == kSkipped) return;
  if (threadIdx.x < 2) sh.sums[threadIdx.x] = 0;
  __syncthreads();
  const uint64_t mask = st.mask, prefix = st.prefix;
  const T* row = static_cast<const T*>(a.values) + s * a.row_stride;
  const int64_t begin = part * kElementsPerBlock;
  const int64_t end = begin + kElementsPerBlock < st.length ? begin + kElementsPerBlock : st.length;
  unsigned int greater = 0, equal = 0;
  for (int64_t first = begin + threadIdx.x; first < end; first += int64_t(kThreads) * kLoadsInFlight) {
    uint64_t keys[kLoadsInFlight];
    load_order_keys(row, first, end, keys);
#pragma unroll
    for (int u = 0; u < kLoadsInFlight; ++u) {
      if (first + int64_t(u) * kThreads >= end) break;
      const uint64_t masked = keys[u] & mask;
      greater += masked > prefix;
      equal += masked == prefix;
    }
  }
  if (greater != 0) atomicAdd(&sh.sums[0], greater);
  if (equal != 0) atomicAdd(&sh.sums[1], equal);
  __syncthreads();
  if (threadIdx.x < 2) block_counts[(s * blocks_per_segment + part) * 2 + threadIdx.x] = int32_t(sh.sums[threadIdx.x]);
}

// Stable compaction: selected element t goes to slot (greater before t) + min(equal before t, remaining), so the
// output is in ascending index order. Item 0 of each segment also writes the count and the -1 padding.
template <typename T>
__device__ void write_item(const TopkArgs& a, const SegmentState* states, const int32_t* block_counts,
                           int32_t blocks_per_segment, int64_t item, PhaseShared& sh) {
  const int64_t s = item / blocks_per_segment;
  const int64_t part = item % blocks_per_segment;
  const SegmentState& st = states[s];
  if (st.status == kSkipped) return;
  int32_t* out = segment_output(a, s);
  if (part == 0) {
    for (int64_t j = int64_t(st.k) + threadIdx.x; j < a.out_capacity; j += kThreads) out[j * a.out_element_stride] = -1;
    if (threadIdx.x == 0 && a.counts != nullptr) a.counts[s] = st.k;
  }
  if (threadIdx.x < 2) sh.sums[threadIdx.x] = 0;
  __syncthreads();
  for (int64_t j = threadIdx.x; j < part; j += kThreads) {
    atomicAdd(&sh.sums[0], unsigned(block_counts[(s * blocks_per_segment + j) * 2]));
    atomicAdd(&sh.sums[1], unsigned(block_counts[(s * blocks_per_segment + j) * 2 + 1]));
  }
  const uint64_t mask = st.mask, prefix = st.prefix;
  const uint32_t remaining = uint32_t(st.remaining);
  const T* row = static_cast<const T*>(a.values) + s * a.row_stride;
  const int64_t begin = part * kElementsPerBlock + int64_t(threadIdx.x) * kElementsPerThread;
  const int64_t end = begin + kElementsPerThread < st.length ? begin + kElementsPerThread : st.length;
  // The run's masked keys, all loaded before any is used.
  const int32_t count = end > begin ? int32_t(end - begin) : 0;
  uint64_t masked[kElementsPerThread];
#pragma unroll
  for (int u = 0; u < kElementsPerThread; ++u) masked[u] = u < count ? order_key(row[begin + u]) & mask : 0;
  uint32_t packed = 0;  // greater << kEqualBits | equal, of this thread's run
#pragma unroll
  for (int u = 0; u < kElementsPerThread; ++u) {
    if (u < count) packed += masked[u] > prefix ? (1u << kEqualBits) : (masked[u] == prefix ? 1u : 0u);
  }
  uint32_t total = 0;
  const uint32_t before = block_exclusive_scan(packed, sh.scan_buffer, &total);  // also orders the sums above
  uint32_t greater_before = sh.sums[0] + (before >> kEqualBits);
  uint32_t equal_before = sh.sums[1] + (before & ((1u << kEqualBits) - 1u));
  __syncthreads();  // every thread has read the sums before the next item resets them
  if (packed == 0) return;
#pragma unroll
  for (int u = 0; u < kElementsPerThread; ++u) {
    if (u >= count) break;
    int64_t slot = -1;
    if (masked[u] > prefix) {
      slot = int64_t(greater_before) + (equal_before < remaining ? equal_before : remaining);
      ++greater_before;
    } else if (masked[u] == prefix) {
      if (equal_before < remaining) slot = int64_t(greater_before) + equal_before;
      ++equal_before;
    }
    if (slot >= 0 && slot < a.out_capacity) out[slot * a.out_element_stride] = int32_t(begin + u) + a.index_base;
  }
}

// ---- The kernel ----

// Every phase in one launch (cooperative: all blocks resident, grid barriers between phases): a barrier costs what a
// kernel boundary does, and a cache hit then costs one launch instead of one per phase. The prologue runs in every
// block beside the segments' initialisation, before the first barrier (it may write the values).
template <typename T, typename Prologue>
__global__ void __launch_bounds__(kThreads, kBlocksPerSm)
    topk_kernel(const TopkArgs a, const Prologue prologue, SegmentState* states, uint32_t* histograms,
                unsigned int* still_active, int32_t* block_counts, int32_t blocks_per_segment) {
  __shared__ PhaseShared sh;
  allow_next_kernel_start();  // every block is resident already (cooperative): the next kernel's may take the rest
  // A selection-cache hit skips every segment: every block sees the same flags, so all leave before any barrier.
  if (a.skip != nullptr) {
    bool any_left = false;
    for (int64_t g = 0; g * a.segments_per_skip < a.segments && !any_left; ++g) any_left = a.skip[g] == 0;
    if (!any_left) return;
  }
  cooperative_groups::grid_group grid = cooperative_groups::this_grid();
  const int64_t items = int64_t(a.segments) * blocks_per_segment;
  prologue(blockIdx.x, gridDim.x);
  for (int64_t s = blockIdx.x; s < a.segments; s += gridDim.x) init_segment(a, states, histograms, still_active, s);
  grid.sync();
  constexpr int kKeyBits = int(sizeof(T) * 8);
  int pass = 0;
  for (int high = kKeyBits; high > 0; high -= kDigitBits, ++pass) {
    const int low = high > kDigitBits ? high - kDigitBits : 0;
    for (int64_t item = blockIdx.x; item < items; item += gridDim.x) {
      digit_pass_item<T>(a, states, histograms, still_active + pass, blocks_per_segment, low, high - low, item, sh);
      __syncthreads();  // the item's shared state is read before the next item rewrites it
    }
    grid.sync();
    // No segment left active after this pass: the remaining passes would only wait at their barriers. Every block
    // reads the same count (only this pass's picks add to it), so all leave the loop together.
    if (*static_cast<volatile unsigned int*>(still_active + pass) == 0) break;
  }
  for (int64_t item = blockIdx.x; item < items; item += gridDim.x) {
    count_item<T>(a, states, block_counts, blocks_per_segment, item, sh);
    __syncthreads();
  }
  grid.sync();
  for (int64_t item = blockIdx.x; item < items; item += gridDim.x) {
    write_item<T>(a, states, block_counts, blocks_per_segment, item, sh);
    __syncthreads();
  }
}

// ---- Scratch layout ----

inline uint64_t align_up(uint64_t bytes) {
  return (bytes + kScratchAlignment - 1) / kScratchAlignment * kScratchAlignment;
}

inline int64_t blocks_per_segment_for(int64_t max_length) {
  const int64_t blocks = (max_length + kElementsPerBlock - 1) / kElementsPerBlock;
  return blocks < 1 ? 1 : blocks;
}

struct ScratchParts {
  uint64_t states = 0, histograms = 0, still_active = 0, block_counts = 0, total = 0;
  ScratchParts(int32_t segments, int64_t max_length) {
    const uint64_t n = segments > 0 ? uint64_t(segments) : 0;
    histograms = align_up(n * sizeof(SegmentState));
    still_active = histograms + align_up(n * kBins * sizeof(uint32_t));
    block_counts = still_active + align_up(kMaxDigitPasses * sizeof(unsigned int));
    total = block_counts + align_up(n * uint64_t(blocks_per_segment_for(max_length)) * 2 * sizeof(int32_t));
  }
};

template <typename T, typename Prologue>
cudaError_t launch_topk(const TopkArgs& args, const Prologue& prologue, bool whole_grid, SegmentState* states,
                        uint32_t* histograms, unsigned int* still_active, int32_t* block_counts,
                        int32_t blocks_per_segment, int32_t multiprocessors, cudaStream_t stream) {
  const void* kernel = reinterpret_cast<const void*>(&topk_kernel<T, Prologue>);
  const int64_t items = int64_t(args.segments) * blocks_per_segment;
  int64_t grid = int64_t(multiprocessors > 0 ? multiprocessors : 1) * kBlocksPerSm;
  if (items < grid && !whole_grid) grid = items;
  TopkArgs a = args;
  Prologue hook = prologue;
  void* kernel_args[] = {&a, &hook, &states, &histograms, &still_active, &block_counts, &blocks_per_segment};
  return cudaLaunchCooperativeKernel(kernel, dim3(unsigned(grid)), dim3(kThreads), kernel_args, 0, stream);
}

}  // namespace topk_detail

// No prologue: the values are there before the launch.
struct NoTopkPrologue {
  __device__ void operator()(int64_t, int64_t) const {}
};

// device_topk (device_topk.h) whose blocks first run prologue(block, blocks) (every block of the grid, all threads;
// `blocks` is the grid's size) beside the segments' initialisation; the values are read only after the barrier
// that follows. A prologue must return early in a block exactly when the selection would (args.skip) or must not
// rely on the selection's phases running.
template <typename Prologue>
cudaError_t device_topk_with(const TopkArgs& args, const Prologue& prologue, void* scratch, int32_t multiprocessors,
                             cudaStream_t stream) {
  using namespace topk_detail;
  if (args.segments <= 0) return cudaSuccess;
  constexpr int64_t kMaxItems = 0x7fffffff;
  const int64_t blocks_per_segment = blocks_per_segment_for(args.max_length);
  if (args.max_length > kMaxItems || int64_t(args.segments) * blocks_per_segment > kMaxItems || scratch == nullptr) {
    return cudaErrorInvalidValue;
  }
  const ScratchParts parts(args.segments, args.max_length);
  char* base = static_cast<char*>(scratch);
  auto* states = reinterpret_cast<SegmentState*>(base + parts.states);
  auto* histograms = reinterpret_cast<uint32_t*>(base + parts.histograms);
  auto* still_active = reinterpret_cast<unsigned int*>(base + parts.still_active);
  auto* block_counts = reinterpret_cast<int32_t*>(base + parts.block_counts);
  // A prologue gets every resident block (its work need not follow the selection's items: one segment of 128K
  // values is 63 items, while its vote spreads over the whole GPU); the phases leave the extra blocks idle.
  const bool whole_grid = !std::is_same_v<Prologue, NoTopkPrologue>;
  if (args.value_type == TopkValueType::kF32) {
    return launch_topk<float>(args, prologue, whole_grid, states, histograms, still_active, block_counts,
                              int32_t(blocks_per_segment), multiprocessors, stream);
  }
  return launch_topk<double>(args, prologue, whole_grid, states, histograms, still_active, block_counts,
                             int32_t(blocks_per_segment), multiprocessors, stream);
}

SPARSA_GPU_NAMESPACE_END
