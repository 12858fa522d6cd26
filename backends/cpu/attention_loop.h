// The CPU backend's one attention loop and the hooks policies drive it with.
//
// Every policy reduces to one of two walks over keys for a set of query rows of one (sequence b, query head h):
//   attend_block_walk  — key blocks of size block_k listed in ascending order, with an element mask
//                        (DENSE, SINK_WINDOW, BLOCK_SPARSE, SPARGE incl. its λ PV skip and int8 scoring);
//   attend_index_list  — an explicit ascending list of key positions (TOKEN_SPARSE, TOKEN_SELECT, TOKEN_INDICES,
//                        and the dense rows of Δ).
// Both run the same tiled microkernels and the same online-softmax state (src/common/softmax_state.h).
// Results are normalised fp32 rows handed to an OutputSink, so Δ can intercept a base policy's output.
#pragma once

#include <cmath>
#include <cstdint>
#include <functional>
#include <limits>
#include <vector>

#include "../../src/backend.h"
#include "../../src/problem.h"

namespace sparsa::cpu {

class ThreadPool;

// Which keys inside the walked set a query row at position i (0-based within its sequence) may see.
struct RowVisibility {
  bool causal = false;   // key j visible only if j <= i + offset
  int64_t offset = 0;    // Skv - Sq of the sequence (bottom-right alignment)
  // SINK_WINDOW predicate (§2) when sink_tokens >= 0: j < sink_tokens or distance(i + offset, j) < window, where
  // distance is (i+offset) - j when causal and |i+offset-j| otherwise.
  int64_t sink_tokens = -1;
  int64_t window = 0;
};

// Per-walk counters, summed into the run's stats.
struct RunCounters {
  int64_t pairs_computed = 0;     // (row, key) scores computed after the element mask
  int64_t blocks_computed = 0;    // (query block, key block) tiles visited by block walks
  int64_t pv_blocks_skipped = 0;  // tiles the λ test skipped
  void add(const RunCounters& o) {
    pairs_computed += o.pairs_computed;
    blocks_computed += o.blocks_computed;
    pv_blocks_skipped += o.pv_blocks_skipped;
  }
};

// Per-thread scratch, reused across work items (no allocation in the hot path once warm).
struct ThreadScratch {
  std::vector<float> buffer;  // grows on demand; the loop carves tiles out of it
  float* reserve(size_t n_floats) {
    if (buffer.size() < n_floats) buffer.resize(n_floats);
    return buffer.data();
  }
};

// K and V rows of one (sequence, kv head), converted to fp32 once for every key of the sequence, `stride` floats
// apart (fill_kv_panel, cpu_engine.h). A block walk that has one reads its key tiles in place: without it, each
// query block that walks a key tile converts (gathers, widens) the tile's rows again. A K or V row that holds NaN/Inf
// is stored as zeros and flagged, so the walk poisons exactly the rows it would have poisoned converting the tile
// itself.
struct KvPanel {
  float* k = nullptr;
  float* v = nullptr;
  uint8_t* k_non_finite = nullptr;  // per key: 1 when its K row holds NaN/Inf
  uint8_t* v_non_finite = nullptr;  // per key: 1 when its V row holds NaN/Inf
  int64_t stride = 0;               // floats between consecutive keys' rows
};

// Block walk parameters (SPARGE-specific fields are inert for other policies).
struct BlockWalk {
  const int32_t* key_blocks = nullptr;  // ascending key block ids
  int64_t n_key_blocks = 0;
  const KvPanel* panel = nullptr;       // the walk's (b, kv head) already widened; null: widen each tile
  int32_t block_k = 64;
  float pv_skip_lambda = -std::numeric_limits<float>::infinity();  // §4.7; -inf = off
  // §4 quantized path: int8 Q (per quant_block_q-row block of the sequence) and int8 centred K (per block_k-row
  // block), k_mean = per-kv-head mean of K over the sequence (D floats). LSE stays that of the uncentred scores.
  bool quantized_qk = false;
  int32_t quant_block_q = 128;
  const float* k_mean = nullptr;
};

// Attention of query rows [row_begin, row_end) of (b, h) over the listed key blocks with the element mask `vis`.
// Writes normalised fp32 rows to out_rows [row_end - row_begin, D] (row stride D) and natural-log LSE to lse_rows
// (-inf and a zero row for a row that sees no key).
void attend_block_walk(const AttentionProblem& problem, int32_t b, int32_t h, int64_t row_begin, int64_t row_end,
                       const BlockWalk& walk, const RowVisibility& vis, float* out_rows, float* lse_rows,
                       RunCounters* counters, ThreadScratch& scratch);

// Attention of the query rows at positions rows[0..n_rows) of (b, h) over keys at the ascending positions
// keys[0..n_keys), each visible to row i iff the visibility predicate allows (i, key). Same outputs as above.
void attend_index_list(const AttentionProblem& problem, int32_t b, int32_t h, const int64_t* rows, int64_t n_rows,
                       const int64_t* keys, int64_t n_keys, const RowVisibility& vis, float* out_rows,
                       float* lse_rows, RunCounters* counters, ThreadScratch& scratch);

// Where a policy's normalised rows go: straight into problem.out/lse (converted to out's dtype), or into an fp32
// staging buffer [rows of all sequences, Hq, D] (+ lse) that Δ combines afterwards.
struct OutputSink {
  float* staging = nullptr;      // null = write to problem.out
  float* staging_lse = nullptr;  // [rows of all sequences, Hq] when staging
  // Row index of (b, i) among all sequences' rows: b * max_seq_q + i padded, cu_seqlens_q[b] + i packed.
  void write_row(const AttentionProblem& problem, int32_t b, int64_t i, int32_t h, const float* row,
                 float lse) const;
  // Writes an exact zero row and lse = -inf.
  void write_zero_row(const AttentionProblem& problem, int32_t b, int64_t i, int32_t h) const;
};

// What a policy entry is given: the worker pool, one scratch per worker, one counter set per worker.
struct ExecContext {
  ThreadPool* pool = nullptr;
  std::vector<ThreadScratch>* scratch = nullptr;  // indexed by worker id
  std::vector<RunCounters>* counters = nullptr;   // indexed by worker id
  // Runs fn(item, worker) for item in [0, n) across the pool and waits.
  void parallel_for(int64_t n, const std::function<void(int64_t item, int worker)>& fn) const;
};

// Every policy entry has this shape: compute every row of every (b, h) and hand it to `sink`.
using PolicyEntry = void (*)(const AttentionProblem& problem, const PolicyParams& policy, const OutputSink& sink,
                             const ExecContext& exec);

// Policy entries (one file each: cpu_dense.cpp, cpu_sink_window.cpp, cpu_block_sparse.cpp, cpu_sparge.cpp,
// cpu_token_sparse.cpp, cpu_token_select.cpp, cpu_token_indices.cpp). Δ (cpu_delta.cpp) wraps any of them.
void run_dense(const AttentionProblem&, const PolicyParams&, const OutputSink&, const ExecContext&);
void run_sink_window(const AttentionProblem&, const PolicyParams&, const OutputSink&, const ExecContext&);
void run_block_sparse(const AttentionProblem&, const PolicyParams&, const OutputSink&, const ExecContext&);
void run_sparge(const AttentionProblem&, const PolicyParams&, const OutputSink&, const ExecContext&);
void run_token_sparse(const AttentionProblem&, const PolicyParams&, const OutputSink&, const ExecContext&);
void run_token_select(const AttentionProblem&, const PolicyParams&, const OutputSink&, const ExecContext&);
void run_token_indices(const AttentionProblem&, const PolicyParams&, const OutputSink&, const ExecContext&);
void run_delta(PolicyEntry base, const AttentionProblem&, const PolicyParams&, const OutputSink&,
               const ExecContext&);

// SPARGE prediction (§4 steps 1–6) for sequence b, query head h: writes the uint8 mask
// [ceil(Sq/block_q), ceil(Skv/block_k)] (row stride n_key_blocks) using the effective per-head parameters.
// Lives in cpu_sparge_predict.cpp; computed in float64 so the CPU backend is an exact oracle. Its working arrays
// (O((nkb + 1) · D)) come from `scratch`, which must not hold anything the caller needs afterwards.
struct SpargeHeadParams {
  double theta, tau, topk_fraction, lambda;
};
SpargeHeadParams sparge_head_params(const PolicyParams& policy, int32_t h);
void sparge_predict_mask(const AttentionProblem& problem, const PolicyParams& policy, int32_t b, int32_t h,
                         uint8_t* mask, ThreadScratch& scratch);

// Element conversion helpers (cpu_convert.h) are used by both sides: load_row_f32 reads D elements of the
// problem dtype into fp32.
void load_row_f32(int32_t dtype, const void* base, int64_t element_offset, int32_t d, float* dst);
void store_row(int32_t dtype, void* base, int64_t element_offset, int32_t d, const float* src);

}  // namespace sparsa::cpu
