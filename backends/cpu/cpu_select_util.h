// Small helpers shared by the CPU selection policies (cpu_sparge_predict.cpp, cpu_token_sparse.cpp,
// cpu_token_select.cpp, cpu_token_indices.cpp, cpu_topk.cpp, cpu_prefetch.cpp).
//
// Everything here is deterministic: every ranking is a total order (larger value first, the smaller index wins a
// tie, NaN ranks last), so results never depend on the thread count or on the standard library's sort.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <numeric>

#include "../../src/common/selection_order.h"  // ranks_before, order_key
#include "../../src/error.h"
#include "../../src/problem.h"
#include "attention_loop.h"
#include "cpu_engine.h"  // kv_head_of, worker_count

namespace sparsa::cpu {

// Query rows handed to one attend_index_list call: bounds the per-worker output buffer and gives the pool work
// items of a useful size.
constexpr int64_t kSelectRowsPerCall = 64;

// One step of top_k_ids_ascending's radix select over keys[0..n), which lie in [lo, hi] (lo < hi): the bucket of
// the kRadixBits bits below lo and hi's common high bits that holds the rank-th largest key, and how many keys lie
// in higher buckets.
constexpr int kRadixBits = 11;
constexpr int64_t kRadixBuckets = int64_t(1) << kRadixBits;
struct RadixStep {
  int shift;
  int64_t bucket, above;
};
inline RadixStep radix_step(const uint64_t* keys, int64_t n, int64_t rank, uint64_t lo, uint64_t hi) {
  uint32_t counts[kRadixBuckets] = {};
  const int shift = std::max(0, 64 - __builtin_clzll(lo ^ hi) - kRadixBits);
  for (int64_t i = 0; i < n; ++i) ++counts[(keys[i] >> shift) & (kRadixBuckets - 1)];
  RadixStep step{shift, kRadixBuckets - 1, 0};
  while (step.above + counts[step.bucket] < rank) step.above += counts[step.bucket--];
  return step;
}

// Writes the ids of the k highest-ranked entries of values[0..n) (ranks_before) into ids_out[0..k), ascending.
// `order` is scratch for n ids (used for n keys). Requires 0 <= k <= n.
// The k-th largest order_key splits them: every id whose key is larger is kept, then the smallest ids among those
// equal to it until k are kept, one pass in id order, so the ids come out ascending without a sort (the same set as
// sorting by ranks_before). The k-th key comes from a radix select: each step keeps the keys of the one bucket of
// 11 bits (below the bits all remaining keys share) that holds it, a few passes in all where nth_element over the
// values took twice as long (8K votes) or more (32K).
inline void top_k_ids_ascending(const double* values, int64_t n, int64_t k, int64_t* order, int64_t* ids_out) {
  if (k <= 0) return;
  if (k >= n) {
    std::iota(ids_out, ids_out + n, int64_t{0});
    return;
  }
  static_assert(sizeof(uint64_t) == sizeof(int64_t), "order holds the keys");
  uint64_t* keys = reinterpret_cast<uint64_t*>(order);
  uint64_t lo = ~uint64_t{0}, hi = 0;
  for (int64_t i = 0; i < n; ++i) {
    keys[i] = order_key(values[i]);
    lo = std::min(lo, keys[i]);
    hi = std::max(hi, keys[i]);
  }
  int64_t rank = k, m = n;  // the k-th largest key is the rank-th largest of keys[0..m)
  while (lo != hi) {
    const RadixStep step = radix_step(keys, m, rank, lo, hi);
    int64_t kept = 0;
    lo = ~uint64_t{0};
    hi = 0;
    for (int64_t i = 0; i < m; ++i) {
      const uint64_t key = keys[i];
      keys[kept] = key;
      if (int64_t((key >> step.shift) & (kRadixBuckets - 1)) == step.bucket) {
        ++kept;
        lo = std::min(lo, key);
        hi = std::max(hi, key);
      }
    }
    m = kept;
    rank -= step.above;
  }
  const uint64_t kth = lo;
  int64_t ties_left = rank;  // every key above kth is taken, then the first `rank` equal to it
  int64_t written = 0;
  for (int64_t i = 0; i < n && written < k; ++i) {
    const uint64_t key = order_key(values[i]);
    const bool tie = key == kth;
    const bool take = key > kth || (tie && ties_left > 0);
    ties_left -= tie && take;
    ids_out[written] = i;
    written += take;
  }
}

// Typed arrays laid out one after another in a worker's policy scratch (cpu_engine.h), which grows on demand and is
// kept run after run, so a warmed-up run allocates nothing. Growing may move the buffer, so every array is declared
// first (add), the scratch grown once (bind), and only then are pointers taken (get).
class ScratchLayout {
 public:
  template <typename T>
  size_t add(size_t count) {
    const size_t offset = floats_;
    floats_ += scratch_floats<T>(count);
    return offset;
  }
  size_t floats() const { return floats_; }  // what bind() reserves
  void bind(ThreadScratch& scratch) {
    scratch.reserve(floats_);
    scratch_ = &scratch;
  }
  template <typename T>
  T* get(size_t offset, size_t count) const {
    return scratch_array<T>(*scratch_, offset, count);
  }

 private:
  size_t floats_ = 0;
  ThreadScratch* scratch_ = nullptr;
};

// Writes ids[0..n) into row (b, set) of the int32 selected_indices output [B, H_sel, cap], -1-padded to cap.
// The caller checked n <= cap before any output was written (require_selected_capacity).
inline void write_selected_set(const TensorArg& selected, int32_t b, int64_t set, const int64_t* ids, int64_t n) {
  // Offsets, not pointers: with cap 0 the output may have no data, and null + offset is undefined.
  int32_t* data = selected.ptr<int32_t>();
  const int64_t row = b * selected.stride(0) + set * selected.stride(1);
  const int64_t cap = selected.extent(2);
  const int64_t step = selected.stride(2);
  for (int64_t c = 0; c < cap; ++c) data[row + c * step] = c < n ? int32_t(ids[c]) : -1;
}

// Throws SHAPE_MISMATCH unless the selected_indices output (when present) has room for `needed` ids per row.
// Called for every sequence before any output is written.
inline void require_selected_capacity(const AttentionProblem& problem, int64_t needed, int32_t b,
                                      const char* what) {
  if (!problem.selected_indices.present) return;
  const int64_t cap = problem.selected_indices.extent(2);
  if (cap < needed) {
    fail(SPARSA_STATUS_SHAPE_MISMATCH, "selected_indices: cap (last extent) ", cap, " but sequence ", b,
         " can select up to ", needed, " tokens (", what, ")");
  }
}

// Many float64 dot products against one key row (TOKEN_SELECT's heads, TOKEN_SPARSE's window rows). Selection scores
// are float64 so the CPU backend is an exact oracle. The vectors are stored in blocks of kInterleavedDots, each block
// [d][kInterleavedDots] (zero-padded), so a block's independent sums overlap in the pipeline; every sum is still a
// plain sequential Σ_c in c order, so a result does not depend on which vectors share its block.
constexpr int32_t kInterleavedDots = 8;

// Doubles the interleaved layout of n_vectors vectors of length d takes.
inline size_t interleaved_size(int64_t n_vectors, int32_t d) {
  const size_t blocks = size_t((n_vectors + kInterleavedDots - 1) / kInterleavedDots);
  return blocks * size_t(kInterleavedDots) * size_t(d);
}

// Stores vector `index` (d values of any arithmetic type) into the interleaved layout. Zero the layout first
// (std::fill over interleaved_size) so the padding lanes stay 0.
template <typename T>
void interleave_vector(double* interleaved, int64_t index, const T* values, int32_t d) {
  double* block = interleaved + (index / kInterleavedDots) * kInterleavedDots * d;
  const int64_t lane = index % kInterleavedDots;
  for (int32_t c = 0; c < d; ++c) block[c * kInterleavedDots + lane] = double(values[c]);
}

// Keys interleaved_dots_keys scores per pass over a block of vectors (their sums overlap in the pipeline).
constexpr int kDotKeys = 4;

// dots[k · dots_stride + i] = scale · Σ_c v_i[c]·keys[k][c] for i < n_vectors, k < n_keys: the sequential sum in c
// order, bit-identical on every CPU (select_dots.cpp: AVX2 without FMA contraction where available).
void interleaved_dots_keys(const double* interleaved, int64_t n_vectors, const float* const* keys, int n_keys,
                           int32_t d, double scale, double* dots, int64_t dots_stride);

// dots[i] = scale · Σ_c v_i[c]·key[c] for i < n_vectors.
inline void interleaved_dots(const double* interleaved, int64_t n_vectors, const float* key, int32_t d, double scale,
                             double* dots) {
  interleaved_dots_keys(interleaved, n_vectors, &key, 1, d, scale, dots, 0);
}

// Sizes of the output buffers attend_rows_over_keys needs.
inline size_t out_rows_count(const AttentionProblem& problem) { return size_t(kSelectRowsPerCall) * problem.head_dim; }
inline size_t lse_rows_count() { return size_t(kSelectRowsPerCall); }

// Attends query rows rows[0..n_rows) of (b, h) over keys[0..n_keys) in chunks of kSelectRowsPerCall rows and hands
// each normalised row to `sink`. When `causal_prefix` is set, the keys of a chunk stop at the first key after its
// last row (rows and keys are ascending positions and visibility is causal with offset `vis.offset`), so no
// invisible key is gathered. out_rows/lse_rows hold kSelectRowsPerCall rows (out_rows_count, lse_rows_count).
inline void attend_rows_over_keys(const AttentionProblem& problem, int32_t b, int32_t h, const int64_t* rows,
                                  int64_t n_rows, const int64_t* keys, int64_t n_keys, const RowVisibility& vis,
                                  bool causal_prefix, const OutputSink& sink, float* out_rows, float* lse_rows,
                                  RunCounters* counters, ThreadScratch& scratch) {
  const int32_t d = problem.head_dim;
  for (int64_t first = 0; first < n_rows; first += kSelectRowsPerCall) {
    const int64_t count = std::min(kSelectRowsPerCall, n_rows - first);
    int64_t keys_used = n_keys;
    if (causal_prefix) {
      const int64_t last_visible = rows[first + count - 1] + vis.offset;
      keys_used = std::upper_bound(keys, keys + n_keys, last_visible) - keys;
    }
    attend_index_list(problem, b, h, rows + first, count, keys, keys_used, vis, out_rows, lse_rows, counters,
                      scratch);
    for (int64_t r = 0; r < count; ++r) sink.write_row(problem, b, rows[first + r], h, out_rows + r * d, lse_rows[r]);
  }
}

// attend_rows_over_keys for n_heads consecutive query heads h_first, h_first + 1, ... of one kv group that share
// one key list: n_heads == 1 is that call; n_heads > 1 stacks the heads' rows into one attend_index_list_heads tile
// (decode-sized: n_heads · n_rows <= kMaxStackedRows, so out_rows/lse_rows hold them) and hands every row to
// `sink`. Bit-identical either way.
inline void attend_heads_over_keys(const AttentionProblem& problem, int32_t b, int32_t h_first, int32_t n_heads,
                                   const int64_t* rows, int64_t n_rows, const int64_t* keys, int64_t n_keys,
                                   const RowVisibility& vis, bool causal_prefix, const OutputSink& sink,
                                   float* out_rows, float* lse_rows, RunCounters* counters, ThreadScratch& scratch) {
  if (n_heads == 1) {
    attend_rows_over_keys(problem, b, h_first, rows, n_rows, keys, n_keys, vis, causal_prefix, sink, out_rows,
                          lse_rows, counters, scratch);
    return;
  }
  attend_index_list_heads(problem, b, h_first, n_heads, rows, n_rows, keys, n_keys, vis, out_rows, lse_rows, counters,
                          scratch);
  const int32_t d = problem.head_dim;
  for (int32_t l = 0; l < n_heads; ++l)
    for (int64_t r = 0; r < n_rows; ++r)
      sink.write_row(problem, b, rows[r], h_first + l, out_rows + (l * n_rows + r) * d, lse_rows[l * n_rows + r]);
}

}  // namespace sparsa::cpu
