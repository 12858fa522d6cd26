// The CPU backend's one attention loop (see attention_loop.h).
//
// A call loads a tile of query rows once (fp32, pre-scaled, transposed to Qᵀ), then streams key tiles through:
//   1. visibility  — classify the tile against the row predicate (all / none / partial) from position bounds;
//   2. Sᵀ = K·Qᵀ   — K rows converted (gathered) once per tile into a contiguous tile,
//                    register-blocked microkernel (or, on SPARGE's quantized path, int8 Q·Kᵀ with block scales);
//   3. softmax     — block maxima per row, optional λ PV skip for the whole block (§4.7), rescale, exp, sum,
//                    all vertical SIMD across query rows;
//   4. O += P·V    — V rows converted once, register-blocked microkernel.
// The unnormalised output accumulates directly in the caller's out_rows; the running (m, l) pairs are
// SoftmaxState (src/common/softmax_state.h), finalised at the end. Nothing here allocates once scratch is warm.
//
// Non-finite inputs (docs/algorithms.md, "NaN and Inf"): a row whose q, or the K or V row of a key it sees, holds a
// NaN or ±Inf is marked poisoned and finishes as an all-NaN row with LSE NaN. The offending K/V tile row is zeroed
// after the check, so a key that is loaded with a tile but masked for a row (causal, window, block edges) cannot
// reach that row through 0 · NaN in the microkernels.
#include "attention_loop.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <optional>

#include "../../src/common/softmax_state.h"
#include "../../src/error.h"
#include "cache_prefetch.h"
#include "cpu_convert.h"
#include "cpu_engine.h"
#include "microkernels.h"
#include "thread_pool.h"

namespace sparsa::cpu {
namespace {

constexpr float kNegInf = -std::numeric_limits<float>::infinity();
constexpr int64_t kIndexTileRows = 128;  // query rows per tile of attend_index_list
constexpr int64_t kIndexTileKeys = 64;   // keys per tile of attend_index_list
constexpr float kInt8Max = 127.f;        // §4 quantized path: symmetric int8
constexpr float kQuantEpsilon = 1e-7f;   // §4: scale = max|x| / 127 + 1e-7

// In 64 bits: tile sizes come from caller parameters (block_q up to INT32_MAX) and must not wrap.
int64_t round_up(int64_t n, int64_t multiple) { return (n + multiple - 1) / multiple * multiple; }

// Positions of a tile's rows or keys within their sequence: an explicit list, or first, first+1, ...
struct Positions {
  const int64_t* list = nullptr;
  int64_t first = 0;
  int64_t at(int64_t index) const { return list ? list[index] : first + index; }
};

bool visible(const RowVisibility& vis, int64_t row, int64_t key) {
  const int64_t aligned_row = row + vis.offset;
  if (vis.causal && key > aligned_row) return false;
  if (vis.sink_tokens < 0) return true;
  if (key < vis.sink_tokens) return true;
  const int64_t distance = vis.causal ? aligned_row - key : std::llabs(aligned_row - key);
  return distance < vis.window;
}

enum class TileCoverage { kNone, kAll, kPartial };

// Classifies every (row, key) pair of a tile from the bounds of its positions; kPartial means "look closer".
TileCoverage classify(const RowVisibility& vis, int64_t row_min, int64_t row_max, int64_t key_min, int64_t key_max) {
  const int64_t first_aligned = row_min + vis.offset;
  const int64_t last_aligned = row_max + vis.offset;
  if (vis.causal && key_min > last_aligned) return TileCoverage::kNone;
  const bool causal_all = !vis.causal || key_max <= first_aligned;
  if (vis.sink_tokens < 0) return causal_all ? TileCoverage::kAll : TileCoverage::kPartial;
  if (key_max < vis.sink_tokens) return causal_all ? TileCoverage::kAll : TileCoverage::kPartial;
  // Distance bounds over the tile: (aligned row) − key ranges over [first_aligned − key_max, last_aligned − key_min].
  const int64_t signed_min = first_aligned - key_max;
  const int64_t signed_max = last_aligned - key_min;
  const int64_t far_abs = std::max(std::llabs(signed_min), std::llabs(signed_max));
  if (vis.causal) {
    if (key_min >= vis.sink_tokens && signed_min >= vis.window) return TileCoverage::kNone;
    return (causal_all && signed_max < vis.window) ? TileCoverage::kAll : TileCoverage::kPartial;
  }
  const int64_t near_abs =
      (signed_min <= 0 && signed_max >= 0) ? 0 : std::min(std::llabs(signed_min), std::llabs(signed_max));
  if (key_min >= vis.sink_tokens && near_abs >= vis.window) return TileCoverage::kNone;
  return far_abs < vis.window ? TileCoverage::kAll : TileCoverage::kPartial;
}

// Under a plain causal predicate (no sink/window) the keys a row sees among a tile's ascending keys are a prefix:
// its length by binary search.
bool causal_prefix_only(const RowVisibility& vis) { return vis.causal && vis.sink_tokens < 0; }
int visible_prefix(const RowVisibility& vis, int64_t row, Positions keys, int nk) {
  const int64_t horizon = row + vis.offset;
  int lo = 0, hi = nk;  // keys [0, lo) are visible, keys [hi, nk) are not
  while (lo < hi) {
    const int mid = (lo + hi) / 2;
    if (keys.at(mid) <= horizon) {
      lo = mid + 1;
    } else {
      hi = mid;
    }
  }
  return lo;
}

int64_t count_visible(const RowVisibility& vis, Positions rows, int nr, Positions keys, int nk) {
  int64_t count = 0;
  if (causal_prefix_only(vis)) {
    for (int r = 0; r < nr; ++r) count += visible_prefix(vis, rows.at(r), keys, nk);
    return count;
  }
  for (int r = 0; r < nr; ++r)
    for (int j = 0; j < nk; ++j) count += visible(vis, rows.at(r), keys.at(j)) ? 1 : 0;
  return count;
}

// Symmetric int8 quantization with round-half-to-even (nearbyint under the default rounding mode).
float quant_scale(float max_abs) { return max_abs / kInt8Max + kQuantEpsilon; }
int8_t quantize(float x, float scale) {
  const float q = std::nearbyint(x / scale);
  return int8_t(std::max(-kInt8Max, std::min(kInt8Max, q)));
}

// NaN and ±Inf are the values whose exponent field is all ones. An integer OR over the row vectorises; a float
// probe (Σ x − x) does not, since its adds may not be reordered, and as a serial chain it cost more than the
// widening of the tile it checked.
bool all_finite(const float* row, int d) {
  constexpr uint32_t kExponentMask = 0x7f800000u;
  uint32_t non_finite = 0;
  for (int c = 0; c < d; ++c) {
    uint32_t bits;
    std::memcpy(&bits, row + c, sizeof bits);
    non_finite |= uint32_t((bits & kExponentMask) == kExponentMask);
  }
  return non_finite == 0;
}

// Loads key `key`'s row of kv head hk in sequence b of `kv` as fp32 into row (D floats). A row holding NaN/Inf is
// stored as zeros, so that 0 · NaN cannot carry it into rows that do not see the key; returns whether it was finite.
bool load_kv_row(const AttentionProblem& problem, const TensorArg& kv, int32_t b, int64_t key, int32_t hk,
                 float* row) {
  load_row_f32(problem.dtype, kv.t.data, problem.kv_offset(kv, b, key, hk), problem.head_dim, row);
  if (all_finite(row, problem.head_dim)) return true;
  std::fill(row, row + problem.head_dim, 0.f);
  return false;
}

// Where a key tile's K and V rows are read from.
struct KvRows {
  const float* base = nullptr;
  int64_t stride = 0;  // floats between consecutive keys
};

// One tile of query rows and everything it accumulates. Scores live transposed, Sᵀ [keys, nr_pad].
// The tile stacks the same `rows_per_head` positions of `heads` consecutive query heads h, h+1, ... of one kv group
// (tile row r = head (r / rows_per_head), position (r % rows_per_head)), so a decode step converts each K/V tile once
// for the whole group. Every row's arithmetic is independent of the others in the tile, so a row's result is
// bit-identical whether its head is stacked or not.
class RowTile {
 public:
  // `own`: tile_state_floats(...) floats only this tile uses; `work`: tile_work_floats(...) floats that hold
  // nothing between process_keys calls, so tiles walked in turn by one thread may share them.
  RowTile(const AttentionProblem& problem, int32_t b, int32_t h, int heads, Positions rows, int rows_per_head,
          int max_keys, const BlockWalk* quantized_walk, const KvPanel* panel, float* out_rows, float* own,
          float* work)
      : problem_(problem),
        b_(b),
        h_(h),
        hk_(kv_head_of(problem, h)),
        d_(problem.head_dim),
        rows_(rows),
        heads_(heads),
        nr_head_(rows_per_head),
        nr_(heads * rows_per_head),
        nr_pad_(int(round_up(std::max(nr_, 1), kRowAlign))),
        row_stride_(nr_pad_ + kStridePad),
        kv_stride_(d_ + kStridePad),
        max_keys_(std::max(max_keys, 1)),
        kernels_(select_microkernels()),
        quant_(quantized_walk),
        panel_(panel),
        o_(out_rows) {
    const size_t qt_floats = size_t(d_) * row_stride_;
    const size_t st_floats = size_t(max_keys_) * row_stride_;
    const size_t kv_floats = size_t(max_keys_) * kv_stride_;
    auto carver = [](float* next) {
      return [next](size_t floats) mutable {
        float* region = next;
        next += floats;
        return region;
      };
    };
    auto carve_own = carver(own);
    qt_ = carve_own(qt_floats);
    m_ = carve_own(nr_pad_);
    l_ = carve_own(nr_pad_);
    local_max_ = carve_own(nr_pad_);
    shift_ = carve_own(nr_pad_);
    block_sum_ = carve_own(nr_pad_);
    poisoned_ = carve_own(nr_pad_);
    if (quant_) {
      q_rows_ = carve_own(size_t(nr_) * d_);
      q_scale_ = carve_own(nr_);
      qk_mean_ = carve_own(nr_);
      row_tmp_ = carve_own(d_);
      q_i8_ = reinterpret_cast<int8_t*>(carve_own(scratch_floats<int8_t>(size_t(nr_) * d_)));
      k_i8_ = reinterpret_cast<int8_t*>(carve_own(scratch_floats<int8_t>(kv_floats)));
    }
    auto carve_work = carver(work);
    st_ = carve_work(st_floats);
    k_tile_ = carve_work(kv_floats);
    v_tile_ = carve_work(kv_floats);

    row_min_ = row_max_ = rows_per_head > 0 ? rows.at(0) : 0;
    for (int r = 0; r < rows_per_head; ++r) {
      row_min_ = std::min(row_min_, rows.at(r));
      row_max_ = std::max(row_max_, rows.at(r));
    }
    load_queries();
  }

  int64_t row_max_position() const { return row_max_; }

  // Streams one tile of nk <= max_keys keys (ascending positions) through S, softmax and PV. `pv_skip_test`
  // enables §4.7's λ test for this tile. Returns false when no pair of the tile is visible (nothing computed,
  // nothing counted).
  bool process_keys(Positions keys, int nk, const RowVisibility& vis, bool pv_skip_test, float lambda,
                    RunCounters* counters) {
    const TileCoverage coverage = classify(vis, row_min_, row_max_, keys.at(0), keys.at(nk - 1));
    if (coverage == TileCoverage::kNone) return false;
    const int64_t pairs = coverage == TileCoverage::kAll ? int64_t(nr_) * nk
                                                         : heads_ * count_visible(vis, rows_, nr_head_, keys, nk);
    if (pairs == 0) return false;
    if (counters) counters->pairs_computed += pairs;

    // 1. Sᵀ = K · Qᵀ (scale already folded into Q), or the int8 emulation.
    if (quant_) {
      scores_quantized(keys, nk, vis, coverage);
    } else {
      const KvRows k = kv_rows(false, keys, nk, vis, coverage);
      kernels_.qk_tile(k.base, k.stride, nk, qt_, row_stride_, nr_pad_, d_, st_, row_stride_);
    }
    if (coverage == TileCoverage::kPartial) apply_mask(vis, keys, nk);

    // 2. Block row maxima; the λ test compares them with the running maxima after this block (§4.7).
    kernels_.column_max(st_, row_stride_, nk, nr_pad_, local_max_);
    if (pv_skip_test) {
      float best_gain = kNegInf;  // max over rows of (m_local − m_new)
      for (int r = 0; r < nr_; ++r) {
        if (local_max_[r] == kNegInf) continue;
        best_gain = std::max(best_gain, local_max_[r] - std::max(m_[r], local_max_[r]));
      }
      if (best_gain < lambda) {
        if (counters) ++counters->pv_blocks_skipped;
        return true;
      }
    }

    // 3. Online softmax: P = exp(S − m_new) column by column, rescale what was accumulated.
    for (int r = 0; r < nr_pad_; ++r) {
      const float m_new = std::max(m_[r], local_max_[r]);
      shift_[r] = m_new == kNegInf ? 0.f : m_new;  // a row with nothing visible yet: every P is exp(−inf) = 0
    }
    kernels_.exp_columns(st_, row_stride_, nk, nr_pad_, shift_, block_sum_);
    for (int r = 0; r < nr_; ++r) {
      if (local_max_[r] == kNegInf) continue;  // nothing visible in this tile: state unchanged
      const SoftmaxState state{m_[r], l_[r]};
      const float alpha = state.rescale_to(shift_[r]);
      if (alpha != 1.f) kernels_.scale_row(o_ + size_t(r) * d_, d_, alpha);
      m_[r] = shift_[r];
      l_[r] = state.l * alpha + block_sum_[r];
    }

    // 4. O += P · V.
    const KvRows v = kv_rows(true, keys, nk, vis, coverage);
    kernels_.pv_tile(st_, row_stride_, nr_, nk, v.base, v.stride, d_, o_);
    return true;
  }

  // Asks L2 for the K and V rows of a tile that comes later (the rows are 4 KiB-strided, which the hardware
  // prefetchers do not follow), so its conversion does not wait on memory. Every position must be < seq_len_k.
  // fp32 dense decode at 32K keys, 2 threads, Zen 4: 65.3-70.8 ms without it (when it was written with
  // __builtin_prefetch, which GCC compiled to nothing), 60.3-69.6 with the rows fetched into L1, 42.9-48.1 into L2.
  // A block is up to 128 keys, 2,048 lines of fp32 K and V rows at D = 128: more than L1 holds.
  void prefetch_keys(Positions keys, int nk) const {
    if (panel_) return;  // panel rows are consecutive: the hardware prefetchers follow them
    const int64_t row_bytes = int64_t(d_) * element_bytes(problem_.dtype);
    for (int j = 0; j < nk; ++j) {
      const char* k_row = static_cast<const char*>(problem_.k.t.data) +
                          problem_.kv_offset(problem_.k, b_, keys.at(j), hk_) * element_bytes(problem_.dtype);
      const char* v_row = static_cast<const char*>(problem_.v.t.data) +
                          problem_.kv_offset(problem_.v, b_, keys.at(j), hk_) * element_bytes(problem_.dtype);
      for (int64_t byte = 0; byte < row_bytes; byte += kCacheLineBytes) {
        prefetch_line_to_l2(k_row + byte);
        prefetch_line_to_l2(v_row + byte);
      }
    }
  }

  // Normalises the rows and writes their LSE (−inf and a zero row where nothing was seen).
  void finish(float* lse_rows) {
    constexpr float kNaN = std::numeric_limits<float>::quiet_NaN();
    for (int r = 0; r < nr_; ++r) {
      if (poisoned_[r] != 0.f) {
        std::fill(o_ + size_t(r) * d_, o_ + size_t(r + 1) * d_, kNaN);
        if (lse_rows) lse_rows[r] = kNaN;
        continue;
      }
      const SoftmaxState state{m_[r], l_[r]};
      float lse = state.finalize(o_ + size_t(r) * d_, d_);
      if (quant_ && lse != kNegInf) lse += qk_mean_[r];  // back to the uncentred scores' LSE
      if (lse_rows) lse_rows[r] = lse;
    }
  }

 private:
  // Qᵀ [D, nr_pad], pre-scaled, zero padding rows; O rows zeroed; states empty.
  void load_queries() {
    float* row = quant_ ? nullptr : k_tile_;  // k_tile_ is free until the first key tile
    for (int r = 0; r < nr_pad_; ++r) {
      m_[r] = kNegInf;
      l_[r] = 0.f;
      poisoned_[r] = 0.f;
    }
    for (int r = 0; r < nr_; ++r) {
      float* q_row = quant_ ? q_rows_ + size_t(r) * d_ : row;
      load_row_f32(problem_.dtype, problem_.q.t.data, problem_.q_offset(problem_.q, b_, position(r), head(r)), d_,
                   q_row);
      if (!all_finite(q_row, d_)) {  // the row's result is NaN; compute it as a zero query so nothing else sees it
        poisoned_[r] = 1.f;
        std::fill(q_row, q_row + d_, 0.f);
      }
      for (int c = 0; c < d_; ++c) qt_[size_t(c) * row_stride_ + r] = q_row[c] * problem_.scale;
      std::memset(o_ + size_t(r) * d_, 0, sizeof(float) * size_t(d_));
    }
    for (int c = 0; c < d_; ++c)
      for (int r = nr_; r < nr_pad_; ++r) qt_[size_t(c) * row_stride_ + r] = 0.f;
    if (quant_) quantize_queries();
  }

  // The nk K or V rows of a tile, converted (and gathered) once into the contiguous `tile` [nk, D]. Reading fp32
  // rows in place is slower: tokens usually sit Hkv·D floats apart, a multiple of 4 KiB, so a tile's rows fight
  // over the same L1 sets; the copy costs ~2% of the tile's flops.
  // A row holding NaN/Inf poisons the tile rows that see its key and is then zeroed (see the file comment).
  // With a panel, a block walk's tile (consecutive keys) is read where the panel holds it.
  KvRows kv_rows(bool values, Positions keys, int nk, const RowVisibility& vis, TileCoverage coverage) {
    if (panel_ && !keys.list) {
      const uint8_t* non_finite = values ? panel_->v_non_finite : panel_->k_non_finite;
      for (int j = 0; j < nk; ++j)
        if (non_finite[keys.first + j]) poison_rows_seeing(keys.at(j), vis, coverage);
      return {(values ? panel_->v : panel_->k) + keys.first * panel_->stride, panel_->stride};
    }
    const TensorArg& kv = values ? problem_.v : problem_.k;
    float* tile = values ? v_tile_ : k_tile_;
    for (int j = 0; j < nk; ++j) {
      float* row = tile + size_t(j) * kv_stride_;
      if (!load_kv_row(problem_, kv, b_, keys.at(j), hk_, row)) poison_rows_seeing(keys.at(j), vis, coverage);
    }
    return {tile, kv_stride_};
  }

  void poison_rows_seeing(int64_t key, const RowVisibility& vis, TileCoverage coverage) {
    for (int r = 0; r < nr_; ++r) {
      if (coverage == TileCoverage::kAll || visible(vis, position(r), key)) poisoned_[r] = 1.f;
    }
  }

  void apply_mask(const RowVisibility& vis, Positions keys, int nk) {
    if (causal_prefix_only(vis)) {
      for (int r = 0; r < nr_; ++r)
        for (int j = visible_prefix(vis, position(r), keys, nk); j < nk; ++j) st_[size_t(j) * row_stride_ + r] = kNegInf;
      return;
    }
    for (int j = 0; j < nk; ++j) {
      float* st_row = st_ + size_t(j) * row_stride_;
      const int64_t key = keys.at(j);
      for (int r = 0; r < nr_; ++r)
        if (!visible(vis, position(r), key)) st_row[r] = kNegInf;
    }
  }

  // §4 quantized path, queries: int8 per quant_block_q-row block of the sequence (the scale spans the whole block,
  // rows outside this tile included), plus scale · q·k_mean per row to restore the uncentred LSE.
  void quantize_queries() {
    const int64_t block = std::max<int32_t>(1, quant_->quant_block_q);
    const int64_t seq_q = problem_.seq_len_q(b_);
    int64_t cached_block = -1;
    float cached_scale = 1.f;
    for (int r = 0; r < nr_; ++r) {
      const int64_t row = rows_.at(r);
      const int64_t block_id = row / block;
      if (block_id != cached_block) {
        float max_abs = 0.f;
        for (int64_t i = block_id * block; i < std::min(seq_q, (block_id + 1) * block); ++i) {
          load_row_f32(problem_.dtype, problem_.q.t.data, problem_.q_offset(problem_.q, b_, i, h_), d_, row_tmp_);
          // A non-finite q row is that row's own result (NaN); it must not set the scale of its block's rows.
          for (int c = 0; c < d_; ++c) {
            if (std::isfinite(row_tmp_[c])) max_abs = std::max(max_abs, std::fabs(row_tmp_[c]));
          }
        }
        cached_block = block_id;
        cached_scale = quant_scale(max_abs);
      }
      const float* q_row = q_rows_ + size_t(r) * d_;
      q_scale_[r] = cached_scale;
      double mean_dot = 0.0;
      for (int c = 0; c < d_; ++c) {
        q_i8_[size_t(r) * d_ + c] = quantize(q_row[c], cached_scale);
        mean_dot += double(q_row[c]) * quant_->k_mean[c];
      }
      qk_mean_[r] = float(mean_dot) * problem_.scale;
    }
  }

  // §4 quantized path, keys and scores: centred K of this block to int8 with one scale, then
  // S = (Q_i8·K_i8ᵀ) · sq · sk · scale.
  void scores_quantized(Positions keys, int nk, const RowVisibility& vis, TileCoverage coverage) {
    float* centred = k_tile_;
    float max_abs = 0.f;
    for (int j = 0; j < nk; ++j) {
      float* row = centred + size_t(j) * d_;
      // A non-finite row is zeroed, then centred like the others: it cannot widen the block's scale.
      if (!load_kv_row(problem_, problem_.k, b_, keys.at(j), hk_, row)) poison_rows_seeing(keys.at(j), vis, coverage);
      for (int c = 0; c < d_; ++c) {
        row[c] -= quant_->k_mean[c];
        max_abs = std::max(max_abs, std::fabs(row[c]));
      }
    }
    const float k_scale = quant_scale(max_abs);
    for (size_t e = 0; e < size_t(nk) * d_; ++e) k_i8_[e] = quantize(centred[e], k_scale);
    for (int j = 0; j < nk; ++j) {
      const int8_t* k_row = k_i8_ + size_t(j) * d_;
      float* st_row = st_ + size_t(j) * row_stride_;
      for (int r = 0; r < nr_; ++r) {
        const int8_t* q_row = q_i8_ + size_t(r) * d_;
        const int32_t dot = kernels_.dot_i8(q_row, k_row, d_);
        st_row[r] = float(dot) * (q_scale_[r] * k_scale * problem_.scale);
      }
      for (int r = nr_; r < nr_pad_; ++r) st_row[r] = 0.f;
    }
  }

  int64_t position(int r) const { return rows_.at(r % nr_head_); }
  int32_t head(int r) const { return h_ + r / nr_head_; }

  const AttentionProblem& problem_;
  int32_t b_, h_, hk_;
  int d_;
  Positions rows_;  // positions of one head's rows
  int heads_;       // stacked query heads h_, h_ + 1, ...
  int nr_head_;     // rows per head
  int nr_, nr_pad_;
  int row_stride_;  // floats between rows of Qᵀ and Sᵀ (nr_pad + kStridePad)
  int kv_stride_;   // floats between rows of the K and V tiles (D + kStridePad)
  int max_keys_;
  const Microkernels& kernels_;
  const BlockWalk* quant_;
  const KvPanel* panel_;  // null: key tiles are converted (gathered) into k_tile_ / v_tile_
  float* o_;  // the caller's out_rows [nr, D], used as the unnormalised accumulator
  int64_t row_min_ = 0, row_max_ = 0;
  float *qt_ = nullptr, *st_ = nullptr, *k_tile_ = nullptr, *v_tile_ = nullptr;
  float *m_ = nullptr, *l_ = nullptr, *local_max_ = nullptr, *shift_ = nullptr, *block_sum_ = nullptr;
  float* poisoned_ = nullptr;  // per tile row: 1 when its q or a visible key's K/V row holds NaN/Inf
  float *q_rows_ = nullptr, *q_scale_ = nullptr, *qk_mean_ = nullptr, *row_tmp_ = nullptr;
  int8_t *q_i8_ = nullptr, *k_i8_ = nullptr;
};

size_t tile_state_floats(int head_dim, int64_t rows, int64_t keys, bool quantized) {
  const size_t nr_pad = size_t(round_up(std::max<int64_t>(rows, 1), kRowAlign));
  const size_t row_stride = nr_pad + kStridePad;
  const size_t d = size_t(head_dim);
  const size_t kv = size_t(std::max<int64_t>(keys, 1)) * (d + kStridePad);
  size_t floats = d * row_stride + 6 * nr_pad;
  if (quantized)
    floats +=
        size_t(rows) * d + 2 * size_t(rows) + d + scratch_floats<int8_t>(size_t(rows) * d) + scratch_floats<int8_t>(kv);
  return floats;
}

size_t tile_work_floats(int head_dim, int64_t rows, int64_t keys) {
  const size_t nr_pad = size_t(round_up(std::max<int64_t>(rows, 1), kRowAlign));
  const size_t row_stride = nr_pad + kStridePad;
  const size_t kv = size_t(std::max<int64_t>(keys, 1)) * (size_t(head_dim) + kStridePad);
  return size_t(std::max<int64_t>(keys, 1)) * row_stride + 2 * kv;
}

// One tile's own floats, then its work floats, from one reservation.
RowTile make_tile(const AttentionProblem& problem, int32_t b, int32_t h, int heads, Positions rows, int rows_per_head,
                  int max_keys, const BlockWalk* quantized_walk, const KvPanel* panel, float* out_rows,
                  ThreadScratch& scratch) {
  const size_t own = tile_state_floats(problem.head_dim, int64_t(heads) * rows_per_head, max_keys, quantized_walk);
  float* base = scratch.reserve(own + tile_work_floats(problem.head_dim, int64_t(heads) * rows_per_head, max_keys));
  return RowTile(problem, b, h, heads, rows, rows_per_head, max_keys, quantized_walk, panel, out_rows, base,
                 base + own);
}

// The key blocks of a walk over sequence b: block n's first key and its key count (clipped at the sequence's end,
// so a tile never holds more keys than the sequence has, whatever block_k says: scratch follows the problem).
struct WalkBlocks {
  const BlockWalk& walk;
  int64_t seq_k;
  WalkBlocks(const AttentionProblem& problem, int32_t b, const BlockWalk& w, const char* caller)
      : walk(w), seq_k(problem.seq_len_k(b)) {
    if (walk.block_k <= 0) fail(SPARSA_STATUS_INTERNAL, caller, ": block_k must be > 0, got ", walk.block_k);
  }
  int max_keys() const { return int(std::max<int64_t>(1, std::min<int64_t>(walk.block_k, seq_k))); }
  std::pair<int64_t, int> operator()(int64_t n) const {
    if (n >= walk.n_key_blocks) return {-1, 0};
    const int64_t key_begin = int64_t(walk.key_blocks[n]) * walk.block_k;
    return {key_begin, int(std::min<int64_t>(walk.block_k, seq_k - key_begin))};
  }
};

}  // namespace

size_t attention_tile_floats(int head_dim, int64_t rows, int64_t keys, bool quantized) {
  return tile_state_floats(head_dim, rows, keys, quantized) + tile_work_floats(head_dim, rows, keys);
}

size_t kv_head_walk_floats(int head_dim, int64_t rows_per_kv_head, int64_t keys, int32_t n_kv) {
  return size_t(std::max(n_kv, 0)) * tile_state_floats(head_dim, rows_per_kv_head, keys, false) +
         tile_work_floats(head_dim, rows_per_kv_head, keys);
}

size_t kv_panel_floats(int head_dim, int64_t capacity) {
  const size_t rows = size_t(std::max<int64_t>(capacity, 0));
  return 2 * rows * size_t(head_dim + kStridePad) + scratch_floats<uint8_t>(2 * rows);
}

KvPanel kv_panel_in(float* base, int head_dim, int64_t capacity) {
  KvPanel panel;
  panel.stride = head_dim + kStridePad;  // the tiles' row stride, for the same reason (microkernels.h)
  panel.k = base;
  panel.v = base + capacity * panel.stride;
  panel.k_non_finite = reinterpret_cast<uint8_t*>(base + 2 * capacity * panel.stride);
  panel.v_non_finite = panel.k_non_finite + capacity;
  return panel;
}

void fill_kv_panel(const AttentionProblem& problem, int32_t b, int32_t hk, int64_t key_begin, int64_t key_end,
                   const KvPanel& panel) {
  for (int64_t key = key_begin; key < key_end; ++key) {
    for (const bool values : {false, true}) {
      const TensorArg& kv = values ? problem.v : problem.k;
      const bool finite = load_kv_row(problem, kv, b, key, hk, (values ? panel.v : panel.k) + key * panel.stride);
      (values ? panel.v_non_finite : panel.k_non_finite)[key] = finite ? 0 : 1;
    }
  }
}

void attend_block_walk(const AttentionProblem& problem, int32_t b, int32_t h, int64_t row_begin, int64_t row_end,
                       const BlockWalk& walk, const RowVisibility& vis, float* out_rows, float* lse_rows,
                       RunCounters* counters, ThreadScratch& scratch) {
  attend_block_walk_heads(problem, b, h, 1, row_begin, row_end, walk, vis, out_rows, lse_rows, counters, scratch);
}

void attend_block_walk_heads(const AttentionProblem& problem, int32_t b, int32_t h_first, int32_t n_heads,
                             int64_t row_begin, int64_t row_end, const BlockWalk& walk, const RowVisibility& vis,
                             float* out_rows, float* lse_rows, RunCounters* counters, ThreadScratch& scratch) {
  const int nr = int(row_end - row_begin);
  if (nr <= 0 || n_heads <= 0) return;
  const WalkBlocks blocks(problem, b, walk, "attend_block_walk");
  if (walk.quantized_qk && !walk.k_mean)
    fail(SPARSA_STATUS_INTERNAL, "attend_block_walk: quantized walk needs k_mean, got null");
  const bool pv_skip = walk.pv_skip_lambda > -std::numeric_limits<float>::infinity();
  if (n_heads > 1 && (pv_skip || walk.quantized_qk))
    fail(SPARSA_STATUS_INTERNAL, "attend_block_walk_heads: λ skip and int8 scoring are per head, got ", n_heads,
         " stacked heads");
  RowTile tile = make_tile(problem, b, h_first, n_heads, Positions{nullptr, row_begin}, nr, blocks.max_keys(),
                           walk.quantized_qk ? &walk : nullptr, walk.panel, out_rows, scratch);
  bool first_computed = true;
  for (int64_t n = 0; n < walk.n_key_blocks; ++n) {
    const auto [key_begin, nk] = blocks(n);
    if (key_begin < 0 || nk <= 0) continue;
    const auto [next_begin, next_nk] = blocks(n + 1);
    if (next_begin >= 0 && next_nk > 0) tile.prefetch_keys(Positions{nullptr, next_begin}, next_nk);
    const bool computed = tile.process_keys(Positions{nullptr, key_begin}, nk, vis, pv_skip && !first_computed,
                                            walk.pv_skip_lambda, counters);
    if (computed) {
      first_computed = false;
      if (counters) counters->blocks_computed += n_heads;
    }
  }
  tile.finish(lse_rows);
}

void attend_block_walk_kv_heads(const AttentionProblem& problem, int32_t b, int32_t hk_first, int32_t n_kv,
                                int64_t row_begin, int64_t row_end, const BlockWalk& walk, const RowVisibility& vis,
                                float* out_rows, float* lse_rows, RunCounters* counters, ThreadScratch& scratch) {
  const int nr = int(row_end - row_begin);
  if (nr <= 0 || n_kv <= 0) return;
  const WalkBlocks blocks(problem, b, walk, "attend_block_walk_kv_heads");
  if (walk.quantized_qk || walk.panel || walk.pv_skip_lambda > -std::numeric_limits<float>::infinity())
    fail(SPARSA_STATUS_INTERNAL, "attend_block_walk_kv_heads: plain walks only (no int8 scoring, panel or λ skip)");
  if (n_kv > kMaxWalkedKvHeads)
    fail(SPARSA_STATUS_INTERNAL, "attend_block_walk_kv_heads: at most ", kMaxWalkedKvHeads, " kv heads, got ", n_kv);
  const int d = problem.head_dim;
  const int group = int(problem.num_q_heads / problem.num_kv_heads);
  const int64_t tile_rows = int64_t(group) * nr;
  const int max_keys = blocks.max_keys();
  const size_t own = tile_state_floats(d, tile_rows, max_keys, false);
  float* base = scratch.reserve(kv_head_walk_floats(d, tile_rows, max_keys, n_kv));
  float* work = base + size_t(n_kv) * own;
  std::optional<RowTile> tiles[kMaxWalkedKvHeads];
  for (int32_t i = 0; i < n_kv; ++i) {
    tiles[i].emplace(problem, b, (hk_first + i) * group, group, Positions{nullptr, row_begin}, nr, max_keys, nullptr,
                     nullptr, out_rows + size_t(i) * tile_rows * d, base + size_t(i) * own, work);
  }
  for (int64_t n = 0; n < walk.n_key_blocks; ++n) {
    const auto [key_begin, nk] = blocks(n);
    if (key_begin < 0 || nk <= 0) continue;
    const auto [next_begin, next_nk] = blocks(n + 1);
    for (int32_t i = 0; i < n_kv; ++i) {
      if (next_begin >= 0 && next_nk > 0) tiles[i]->prefetch_keys(Positions{nullptr, next_begin}, next_nk);
      if (tiles[i]->process_keys(Positions{nullptr, key_begin}, nk, vis, false, 0.f, counters) && counters)
        counters->blocks_computed += group;
    }
  }
  for (int32_t i = 0; i < n_kv; ++i) tiles[i]->finish(lse_rows + i * tile_rows);
}

namespace {

// One RowTile of attend_index_list: rows_per_head positions of n_heads stacked heads over the listed keys.
void attend_index_tile(const AttentionProblem& problem, int32_t b, int32_t h_first, int32_t n_heads, const int64_t* rows,
                       int rows_per_head, const int64_t* keys, int64_t n_keys, const RowVisibility& vis,
                       float* out_rows, float* lse_rows, RunCounters* counters, ThreadScratch& scratch) {
  RowTile tile = make_tile(problem, b, h_first, n_heads, Positions{rows, 0}, rows_per_head, int(kIndexTileKeys),
                           nullptr, nullptr, out_rows, scratch);
  // Keys are ascending: with a causal predicate nothing past the last row's horizon is visible.
  int64_t key_end = n_keys;
  if (vis.causal) {
    const int64_t horizon = tile.row_max_position() + vis.offset;
    key_end = std::upper_bound(keys, keys + n_keys, horizon) - keys;
  }
  for (int64_t key0 = 0; key0 < key_end; key0 += kIndexTileKeys) {
    const int nk = int(std::min(kIndexTileKeys, key_end - key0));
    const int64_t next0 = key0 + kIndexTileKeys;
    if (next0 < key_end) tile.prefetch_keys(Positions{keys + next0, 0}, int(std::min(kIndexTileKeys, key_end - next0)));
    tile.process_keys(Positions{keys + key0, 0}, nk, vis, false, 0.f, counters);
  }
  tile.finish(lse_rows);
}

}  // namespace

void attend_index_list(const AttentionProblem& problem, int32_t b, int32_t h, const int64_t* rows, int64_t n_rows,
                       const int64_t* keys, int64_t n_keys, const RowVisibility& vis, float* out_rows, float* lse_rows,
                       RunCounters* counters, ThreadScratch& scratch) {
  const int d = problem.head_dim;
  for (int64_t row0 = 0; row0 < n_rows; row0 += kIndexTileRows) {
    const int nr = int(std::min(kIndexTileRows, n_rows - row0));
    attend_index_tile(problem, b, h, 1, rows + row0, nr, keys, n_keys, vis, out_rows + row0 * d,
                      lse_rows ? lse_rows + row0 : nullptr, counters, scratch);
  }
}

void attend_index_list_heads(const AttentionProblem& problem, int32_t b, int32_t h_first, int32_t n_heads,
                             const int64_t* rows, int64_t n_rows, const int64_t* keys, int64_t n_keys,
                             const RowVisibility& vis, float* out_rows, float* lse_rows, RunCounters* counters,
                             ThreadScratch& scratch) {
  if (n_rows <= 0 || n_heads <= 0) return;
  if (n_heads * n_rows > kIndexTileRows)
    fail(SPARSA_STATUS_INTERNAL, "attend_index_list_heads: at most ", kIndexTileRows, " stacked rows, got ", n_heads,
         " heads of ", n_rows, " rows");
  attend_index_tile(problem, b, h_first, n_heads, rows, int(n_rows), keys, n_keys, vis, out_rows, lse_rows, counters,
                    scratch);
}

void ExecContext::parallel_for(int64_t n, const std::function<void(int64_t item, int worker)>& fn) const {
  if (pool) {
    pool->parallel_for(n, fn);
    return;
  }
  for (int64_t item = 0; item < n; ++item) fn(item, 0);
}

int64_t staging_row(const AttentionProblem& problem, int32_t b, int64_t i) {
  if (!problem.q_packed) return int64_t(b) * problem.max_seq_q + i;
  const int32_t* cu = problem.cu_seqlens_q.ptr<const int32_t>();
  return int64_t(cu[b * problem.cu_seqlens_q.t.strides[0]]) + i;
}

int64_t staging_rows(const AttentionProblem& problem) {
  if (!problem.q_packed) return int64_t(problem.batch) * problem.max_seq_q;
  const int32_t* cu = problem.cu_seqlens_q.ptr<const int32_t>();
  return cu[problem.batch * problem.cu_seqlens_q.t.strides[0]];
}

int64_t dense_pairs(const AttentionProblem& problem, int32_t b) {
  const int64_t seq_q = problem.seq_len_q(b);
  const int64_t seq_k = problem.seq_len_k(b);
  if (!problem.causal) return seq_q * seq_k;
  const int64_t offset = problem.causal_offset(b);
  int64_t pairs = 0;
  for (int64_t i = 0; i < seq_q; ++i) pairs += std::clamp<int64_t>(i + offset + 1, 0, seq_k);
  return pairs;
}

int64_t dense_tiles(const AttentionProblem& problem, int32_t b, int32_t block_q, int32_t block_k) {
  const int64_t seq_q = problem.seq_len_q(b);
  const int64_t seq_k = problem.seq_len_k(b);
  const int64_t key_blocks = (seq_k + block_k - 1) / block_k;
  const int64_t offset = problem.causal_offset(b);
  int64_t tiles = 0;
  for (int64_t row0 = 0; row0 < seq_q; row0 += block_q) {
    if (!problem.causal) {
      tiles += key_blocks;
      continue;
    }
    const int64_t last_row = std::min(seq_q, row0 + block_q) - 1;
    const int64_t visible_keys = std::clamp<int64_t>(last_row + offset + 1, 0, seq_k);
    tiles += (visible_keys + block_k - 1) / block_k;
  }
  return tiles;
}

}  // namespace sparsa::cpu
