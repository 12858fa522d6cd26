// What the CPU policies share on top of the attention-loop API (attention_loop.h): the scratch layout and its
// slots, the GQA-stacked walks, parallel_items and the plan functions.
//
// Scratch layout. ExecContext::scratch holds 2·W + kRunScratchSlots entries for a pool of W workers:
//   [0, W)        loop scratch of worker w: attend_block_walk / attend_index_list own it during a call (a caller
//                 must not keep anything there across such a call);
//   [W, 2W)       policy scratch of worker w: free for a policy's per-item data (masks, id lists, gathered rows)
//                 that must survive attend_* calls;
//   [2W, 2W + kRunScratchSlots)  run-wide buffers used outside parallel_for items or read-only inside them
//                 (Δ's staging output).
// Everything grows on demand and is reused run after run, so a warmed-up run allocates nothing.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <new>

#include "attention_loop.h"

namespace sparsa::cpu {

constexpr int kRunScratchSlots = 7;
constexpr int kRunScratchDeltaStaging = 0;  // Δ: the base policy's fp32 output [rows, Hq, D] + lse
constexpr int kRunScratchDeltaKeys = 1;     // Δ: the list 0..Skv−1 as int64, shared read-only by all workers
constexpr int kRunScratchSelection = 2;     // selection policies: per-run plans, q̄, selections; TOKEN_INDICES'
                                            // decode key lists
constexpr int kRunScratchSelectionVotes = 3;  // selection policies: softmax stats, kept scores, votes; then
                                              // TOKEN_SELECT's decode key lists
constexpr int kRunScratchDecodeRanges = 4;  // dense decode: each key range's rows + LSE (items write disjoint
                                            // parts); selection policies' decode: each list slice's rows + LSE
constexpr int kRunScratchKvPanels = 5;  // run_query_blocks: the K/V panels of the (b, kv head) pairs of one phase
constexpr int kRunScratchSelectionScreen = 6;  // TOKEN_SELECT's fp32 screen (select_screen.cpp): scores, bounds

// Tiling DENSE and SINK_WINDOW run at (and report BLOCKS_* at): query rows per work item × keys per tile.
constexpr int32_t kDefaultBlockQ = 128;
constexpr int32_t kDefaultBlockK = 64;

inline size_t scratch_slots_for(int num_workers) { return 2 * size_t(num_workers) + kRunScratchSlots; }
inline int worker_count(const ExecContext& exec) { return int((exec.scratch->size() - kRunScratchSlots) / 2); }
inline ThreadScratch& loop_scratch(const ExecContext& exec, int worker) { return (*exec.scratch)[size_t(worker)]; }
inline ThreadScratch& policy_scratch(const ExecContext& exec, int worker) {
  return (*exec.scratch)[size_t(worker_count(exec) + worker)];
}
inline ThreadScratch& run_scratch(const ExecContext& exec, int slot) {
  return (*exec.scratch)[size_t(2 * worker_count(exec) + slot)];
}

// Views `count` elements of a trivial type T inside a scratch buffer, starting `float_offset` floats in (keep
// offsets multiples of 2 for 8-byte types, of 4 for 16-byte ones: scratch_floats). The buffer is grown first;
// contents are unspecified.
template <typename T>
T* scratch_array(ThreadScratch& scratch, size_t float_offset, size_t count) {
  const size_t floats = (count * sizeof(T) + sizeof(float) - 1) / sizeof(float);
  // At least one float, so that `base` is never null (an empty vector's data() may be; placement new needs an
  // object address even for T[0]).
  float* base = scratch.reserve(std::max<size_t>(float_offset + floats, 1)) + float_offset;
  return new (static_cast<void*>(base)) T[count];
}
// Floats a scratch_array<T>(count) occupies, rounded up to a 16-byte multiple so the next array stays aligned for
// any T up to 16-byte alignment (FixedPointSum's __int128) on the buffer's base, which operator new aligns to 16.
constexpr size_t kScratchAlignFloats = 16 / sizeof(float);
template <typename T>
size_t scratch_floats(size_t count) {
  static_assert(alignof(T) <= kScratchAlignFloats * sizeof(float), "scratch arrays are 16-byte aligned");
  const size_t floats = (count * sizeof(T) + sizeof(float) - 1) / sizeof(float);
  return (floats + kScratchAlignFloats - 1) & ~(kScratchAlignFloats - 1);
}

// Decode-sized query blocks of a GQA group are stacked into one tile (each K/V tile converted once for the group)
// when the group's rows fit this many tile rows (run_query_blocks, TOKEN_SELECT).
constexpr int64_t kMaxStackedRows = 16;

// attend_block_walk for the same rows of n_heads consecutive query heads h_first, h_first + 1, ... of one kv group,
// stacked into one tile so each K/V tile is converted once for all of them (decode). out_rows [n_heads · nr, D] and
// lse_rows [n_heads · nr] are head-major; results are bit-identical to n_heads separate attend_block_walk calls.
// Not for walks with the λ PV skip or int8 scoring (both decide per head).
void attend_block_walk_heads(const AttentionProblem& problem, int32_t b, int32_t h_first, int32_t n_heads,
                             int64_t row_begin, int64_t row_end, const BlockWalk& walk, const RowVisibility& vis,
                             float* out_rows, float* lse_rows, RunCounters* counters, ThreadScratch& scratch);

// attend_block_walk_heads for the whole groups of n_kv consecutive kv heads hk_first, ... (every query head of each),
// their walks interleaved block by block: the K/V rows of a block are read for every kv head in turn instead of one
// kv head over all keys, whose rows lie a key's width apart (4 KiB at 8 kv heads × D 128 × fp32: a new page per row).
// out_rows [n_kv · g · nr, D] and lse_rows [n_kv · g · nr] are head-major; results are bit-identical to
// attend_block_walk_heads per kv head (each tile's arithmetic is unchanged; only the order of the tiles' steps
// differs). Plain walks only (no panel, λ PV skip or int8 scoring); n_kv <= kMaxWalkedKvHeads.
constexpr int32_t kMaxWalkedKvHeads = 16;
void attend_block_walk_kv_heads(const AttentionProblem& problem, int32_t b, int32_t hk_first, int32_t n_kv,
                                int64_t row_begin, int64_t row_end, const BlockWalk& walk, const RowVisibility& vis,
                                float* out_rows, float* lse_rows, RunCounters* counters, ThreadScratch& scratch);

// exec.parallel_for with the callable passed by reference: a std::function built from a std::reference_wrapper
// never allocates, while one built from a lambda with several captures does (on every call).
template <typename Fn>
void parallel_items(const ExecContext& exec, int64_t n, const Fn& fn) {
  exec.parallel_for(n, std::cref(fn));
}

// Grow the run scratch the selection policies use (cpu_token_select.cpp, cpu_token_sparse.cpp) for this problem,
// so that the run after plan() allocates nothing; and the loop scratch sparge_predict_mask needs.
void plan_token_select(const AttentionProblem& problem, const PolicyParams& policy, const ExecContext& exec);
void plan_token_sparse(const AttentionProblem& problem, const PolicyParams& policy, const ExecContext& exec);
// TOKEN_INDICES: every worker's policy scratch for a work item's key set and rows, and when its decode runs over key
// lists (decode_lists_apply), their run scratch and the loop and policy scratch they use.
void plan_token_indices(const AttentionProblem& problem, const PolicyParams& policy, const ExecContext& exec);
// DENSE: when the 16-bit decode ranges apply (cpu_dense.cpp), grow the run scratch of their rows and every worker's
// loop and policy scratch they use.
void plan_dense(const AttentionProblem& problem, const ExecContext& exec);
size_t sparge_predict_scratch_floats(int32_t head_dim, int64_t n_key_blocks);

// attend_index_list for the same n_rows rows of n_heads consecutive query heads of one kv group over one key list,
// stacked into one tile (n_heads · n_rows <= 128). Outputs head-major as above; bit-identical to separate calls.
void attend_index_list_heads(const AttentionProblem& problem, int32_t b, int32_t h_first, int32_t n_heads,
                             const int64_t* rows, int64_t n_rows, const int64_t* keys, int64_t n_keys,
                             const RowVisibility& vis, float* out_rows, float* lse_rows, RunCounters* counters,
                             ThreadScratch& scratch);

// Dense decode (§1 with one query row per sequence, every key visible) on a 16-bit KV cache (cpu_decode.cpp): keys
// [key_begin, key_end) of sequence b for every query head at once, all kv heads of a key before the next key, so the
// range's K and V are read front to back once. out_rows [Hq, D] and lse_rows [Hq] get each head's normalised row and
// LSE over these keys (cpu_dense.cpp merges the ranges).
constexpr int64_t kDecodeTileKeys = 128;  // keys per tile (measured: 16 -> 128 keys cut the CPU time by 1/4)
size_t decode_keys_floats(int head_dim, int num_q_heads);  // loop scratch attend_decode_keys needs
void attend_decode_keys(const AttentionProblem& problem, int32_t b, int64_t key_begin, int64_t key_end,
                        float* out_rows, float* lse_rows, RunCounters* counters, ThreadScratch& scratch);
// Scores a caller already holds for a range of keys of one sequence (TOKEN_SELECT's fp32 screen): key t in
// [first_key, first_key + n_keys) has rows[(t − first_key) · num_q_heads + h] for query head h, and the attention's
// score scale·q·K is factor times that. A list's tile whose keys all lie in the range takes them instead of reading
// K; the other tiles are scored as usual.
struct KnownScores {
  const float* rows = nullptr;  // null: none
  int64_t first_key = 0, n_keys = 0;
  float factor = 1.f;
};
// The same over an explicit list of n_keys key positions (any order; all visible), for the query heads of the kv
// heads [hk_first, hk_first + n_kv) only: out_rows [n_kv·g, D], lse_rows [n_kv·g]. known: null, or scores of this
// sequence it may use.
void attend_decode_list(const AttentionProblem& problem, int32_t b, int32_t hk_first, int32_t n_kv,
                        const int64_t* keys, int64_t n_keys, const KnownScores* known, float* out_rows,
                        float* lse_rows, RunCounters* counters, ThreadScratch& scratch);
// Keys per work item of a decode cut into parts (dense: key ranges; selection policies: slices of a key list).
constexpr int64_t kDecodeRangeKeys = 1024;  // a multiple of kDefaultBlockK, so BLOCKS_COMPUTED counts the same
// Merges n_parts normalised rows of (b, h) (each D floats then its LSE, part_stride floats apart) by LSE:
// O = Σ_r w_r·O_r / Σ_r w_r with w_r = exp(lse_r − max lse), LSE = max lse + log Σ_r w_r (one part: its row
// unchanged), and hands the row to `sink`. merged: D floats of scratch.
void merge_decode_parts(const AttentionProblem& problem, const OutputSink& sink, int32_t b, int32_t h,
                        const float* first_part, int64_t n_parts, size_t part_stride, float* merged);

// Decode of the selection policies (TOKEN_SELECT, TOKEN_INDICES) over explicit key lists on a 16-bit KV cache, the
// same kernels as dense decode (decode_lists_apply: one query row per sequence, fp16/bf16, the AVX-512F or AVX2 decode
// kernels exist for D): list l of sequence b is shared by the query heads of kv heads [l·Hkv/n_lists, (l+1)·Hkv/n_lists)
// and every listed key is visible to them. Each list is cut into slices of kDecodeRangeKeys keys (a fixed size, so
// results do not depend on the thread count); a slice is one work item that reads each listed key's K and V rows of
// all its kv heads once (adjacent in the [B, S, Hkv, D] layout), and the slices' rows are merged by LSE. Where the
// slices are fewer than the workers, each is cut into blocks of its kv heads as well (the same bits: every head is
// computed on its own). A sequence without query rows gets nothing written, an empty list zero rows with LSE −inf.
bool decode_lists_apply(const AttentionProblem& problem);
struct DecodeLists {
  const int64_t* keys = nullptr;   // [B, n_lists, stride] key positions
  const int64_t* sizes = nullptr;  // [B, n_lists] entries used of each list
  int64_t stride = 0;
  int32_t n_lists = 1;             // divides Hkv
  const KnownScores* known = nullptr;  // [B] or null: scores already held (attend_decode_list)
};
// Run scratch (slot kRunScratchDecodeRanges) run_decode_lists uses for lists of up to max_list_size keys.
size_t decode_lists_partial_floats(const AttentionProblem& problem, int64_t max_list_size);
// Grows everything run_decode_lists uses for lists of up to max_list_size keys (its run scratch, every worker's loop
// and policy scratch), so that a run after plan() allocates nothing.
void reserve_decode_lists_scratch(const AttentionProblem& problem, int64_t max_list_size, const ExecContext& exec);
void run_decode_lists(const AttentionProblem& problem, const DecodeLists& lists, const OutputSink& sink,
                      const ExecContext& exec);

// Floats of loop scratch one attend_* call needs for a tile of `rows` query rows and `keys` keys.
size_t attention_tile_floats(int head_dim, int64_t rows, int64_t keys, bool quantized);
// Floats of loop scratch attend_block_walk_kv_heads needs for n_kv kv heads of rows_per_kv_head stacked rows each.
size_t kv_head_walk_floats(int head_dim, int64_t rows_per_kv_head, int64_t keys, int32_t n_kv);

// The kv head query head h reads (§0 GQA: contiguous groups).
inline int32_t kv_head_of(const AttentionProblem& problem, int32_t h) {
  return h / (problem.num_q_heads / problem.num_kv_heads);
}

// Row index of (b, i) in an OutputSink staging buffer (b · max_seq_q + i padded, cu_seqlens_q[b] + i packed) and
// the number of such rows.
int64_t staging_row(const AttentionProblem& problem, int32_t b, int64_t i);
int64_t staging_rows(const AttentionProblem& problem);

// Dense pairs of sequence b with the problem's causal flag: Σ over rows of the keys each may see.
int64_t dense_pairs(const AttentionProblem& problem, int32_t b);
// Tiles of a block_q × block_k tiling of sequence b that hold at least one (causal-)allowed pair.
int64_t dense_tiles(const AttentionProblem& problem, int32_t b, int32_t block_q, int32_t block_k);

}  // namespace sparsa::cpu

namespace sparsa::cpu {

// Lists the ascending key block ids (of block_k keys) query block `q_block` of (b, h) walks; returns the count.
using KeyBlockLister = std::function<int64_t(int32_t b, int32_t h, int64_t q_block, int32_t* ids)>;

// The shared driver of the block policies: for every (b, h, query block of block_q rows) — heaviest causal blocks
// first, spread over the pool — walks the listed key blocks with visibility `vis` (its offset set per sequence)
// and hands the rows to `sink`.
void run_query_blocks(const AttentionProblem& problem, const OutputSink& sink, const ExecContext& exec, int32_t block_q,
                      int32_t block_k, const RowVisibility& vis, const KeyBlockLister& lister);

// Visibility of the problem's causal flag for sequence b (bottom-right offset).
RowVisibility causal_visibility(const AttentionProblem& problem, int32_t b);

// How run_query_blocks lays out a problem's work. A work item is one query block of `heads_per_item` query heads
// (the GQA group, stacked, when its decode-sized rows fit one tile; else 1). When more than one item walks each
// (sequence, kv head), that pair's K and V are converted once into a KvPanel before its items run, fp32 rows
// included (copied: a tile's rows sit Hkv·D elements apart in the cache and stall on memory every time they are
// gathered): `panels_per_phase` pairs at a time (0: no panels — one item per pair, too few items per phase to
// keep every worker busy, or a panel over kKvPanelBudgetBytes).
constexpr size_t kKvPanelBudgetBytes = size_t(64) << 20;  // run scratch all panels of a phase may take together
constexpr int64_t kKvPanelChunkKeys = 256;                 // keys per panel-filling work item
struct QueryBlockPlan {
  int32_t heads_per_item = 1;
  int64_t q_blocks = 0;          // query blocks per (b, h): ceil(max_seq_q / block_q)
  int64_t panels_per_phase = 0;
  size_t panel_floats = 0;       // run scratch of one panel (kv_panel_floats of max_seq_k keys)
};
QueryBlockPlan query_block_plan(const AttentionProblem& problem, int32_t block_q, int workers);
// Grows the run scratch run_query_blocks' panels take for this problem (nothing when it uses none).
void plan_query_blocks(const AttentionProblem& problem, int32_t block_q, const ExecContext& exec);

// Floats of one KvPanel for `capacity` keys, its layout inside them, and the widening of keys [key_begin, key_end)
// of (b, kv head hk) into it (attention_loop.cpp).
size_t kv_panel_floats(int head_dim, int64_t capacity);
KvPanel kv_panel_in(float* base, int head_dim, int64_t capacity);
void fill_kv_panel(const AttentionProblem& problem, int32_t b, int32_t hk, int64_t key_begin, int64_t key_end,
                   const KvPanel& panel);

}  // namespace sparsa::cpu

namespace sparsa::cpu {

// sparsa_merge_states on host memory (cpu_merge.cpp): row by row through SoftmaxState::merge; out may alias o_a.
void cpu_merge_states(const MergeProblem& problem, const ExecContext& exec);

}  // namespace sparsa::cpu
