// §1 DENSE, and the query-block driver shared by the block policies (cpu_engine.h).
#include <algorithm>
#include <cmath>
#include <functional>
#include <limits>

#include "attention_loop.h"
#include "cpu_engine.h"
#include "decode_kernels.h"

namespace sparsa::cpu {

RowVisibility causal_visibility(const AttentionProblem& problem, int32_t b) {
  RowVisibility vis;
  vis.causal = problem.causal;
  vis.offset = problem.causal_offset(b);
  return vis;
}

QueryBlockPlan query_block_plan(const AttentionProblem& problem, int32_t block_q, int workers) {
  QueryBlockPlan plan;
  plan.q_blocks = (problem.max_seq_q + block_q - 1) / block_q;
  if (problem.num_kv_heads <= 0) return plan;
  // Stack the g query heads of a kv group when their rows are few (decode) and there are still enough groups to
  // keep every worker busy. Stacking never changes a row's arithmetic, so the choice cannot change results.
  const int32_t group = problem.num_q_heads / problem.num_kv_heads;
  const bool stack = group > 1 && problem.max_seq_q > 0 && int64_t(problem.max_seq_q) * group <= kMaxStackedRows &&
                     int64_t(problem.batch) * problem.num_kv_heads * plan.q_blocks >= workers;
  plan.heads_per_item = stack ? group : 1;
  // Panels: the converted rows are the ones each tile would get, read at the tiles' stride, so they change no bits.
  const int64_t items_per_pair = int64_t(group / plan.heads_per_item) * plan.q_blocks;
  if (items_per_pair < 2 || problem.max_seq_k <= 0) return plan;
  const size_t panel_floats = kv_panel_floats(problem.head_dim, problem.max_seq_k);
  const int64_t fit = int64_t(kKvPanelBudgetBytes / (panel_floats * sizeof(float)));
  const int64_t panels = std::min<int64_t>(fit, int64_t(problem.batch) * problem.num_kv_heads);
  if (panels < 1 || panels * items_per_pair < workers) return plan;
  plan.panels_per_phase = panels;
  plan.panel_floats = panel_floats;
  return plan;
}

void plan_query_blocks(const AttentionProblem& problem, int32_t block_q, const ExecContext& exec) {
  const QueryBlockPlan plan = query_block_plan(problem, block_q, worker_count(exec));
  if (plan.panels_per_phase > 0)
    run_scratch(exec, kRunScratchKvPanels).reserve(size_t(plan.panels_per_phase) * plan.panel_floats);
}

void run_query_blocks(const AttentionProblem& problem, const OutputSink& sink, const ExecContext& exec, int32_t block_q,
                      int32_t block_k, const RowVisibility& vis, const KeyBlockLister& lister) {
  const int d = problem.head_dim;
  const QueryBlockPlan plan = query_block_plan(problem, block_q, worker_count(exec));
  const int64_t max_q_blocks = plan.q_blocks;
  const int64_t max_key_blocks = (problem.max_seq_k + block_k - 1) / block_k;
  const int32_t heads_per_item = plan.heads_per_item;
  const int32_t head_items = problem.num_q_heads / heads_per_item;
  const int64_t items = int64_t(problem.batch) * head_items * max_q_blocks;
  // With panels, work runs in phases of panels_per_phase (b, kv head) pairs; these are the current phase's.
  float* panels = nullptr;
  int64_t phase_first_pair = 0;
  const auto work_item = [&](int64_t item, int worker) {
    // Item order: the last query blocks first (under a causal mask they carry the most keys).
    const int64_t q_block = max_q_blocks - 1 - item % max_q_blocks;
    const int32_t h_first = int32_t(item / max_q_blocks % head_items) * heads_per_item;
    const int32_t b = int32_t(item / max_q_blocks / head_items);
    const int64_t seq_q = problem.seq_len_q(b);
    const int64_t row_begin = q_block * block_q;
    if (row_begin >= seq_q) return;
    const int64_t row_end = std::min<int64_t>(seq_q, row_begin + block_q);
    const int64_t nr = row_end - row_begin;

    // Policy scratch: the key block lists of the item's heads, then their rows and LSEs (head-major).
    ThreadScratch& mine = policy_scratch(exec, worker);
    const size_t ids_floats = scratch_floats<int32_t>(size_t(max_key_blocks));
    const size_t rows_at = ids_floats * size_t(heads_per_item);
    mine.reserve(rows_at + size_t(heads_per_item) * size_t(nr) * (d + 1));
    float* rows = mine.buffer.data() + rows_at;
    float* lse = rows + int64_t(heads_per_item) * nr * d;
    const auto ids_of = [&](int32_t l) { return reinterpret_cast<int32_t*>(mine.buffer.data() + ids_floats * l); };
    for (int32_t l = 0; l < heads_per_item; ++l) scratch_array<int32_t>(mine, ids_floats * l, size_t(max_key_blocks));

    RowVisibility seq_vis = vis;
    seq_vis.offset = problem.causal_offset(b);
    RunCounters* counters = &(*exec.counters)[size_t(worker)];
    BlockWalk walk;
    walk.block_k = block_k;
    KvPanel panel;
    if (panels) {
      const int64_t pair = int64_t(b) * problem.num_kv_heads + kv_head_of(problem, h_first);
      panel = kv_panel_in(panels + size_t(pair - phase_first_pair) * plan.panel_floats, d, problem.max_seq_k);
      walk.panel = &panel;
    }
    // One stacked walk when every head lists the same key blocks, else one walk per head.
    bool same_blocks = true;
    int64_t n_blocks[kMaxStackedRows] = {};
    for (int32_t l = 0; l < heads_per_item; ++l) {
      n_blocks[l] = lister(b, h_first + l, q_block, ids_of(l));
      if (l > 0 && (n_blocks[l] != n_blocks[0] ||
                    !std::equal(ids_of(l), ids_of(l) + n_blocks[l], ids_of(0))))
        same_blocks = false;
    }
    if (same_blocks) {
      walk.key_blocks = ids_of(0);
      walk.n_key_blocks = n_blocks[0];
      attend_block_walk_heads(problem, b, h_first, heads_per_item, row_begin, row_end, walk, seq_vis, rows, lse,
                              counters, loop_scratch(exec, worker));
    } else {
      for (int32_t l = 0; l < heads_per_item; ++l) {
        walk.key_blocks = ids_of(l);
        walk.n_key_blocks = n_blocks[l];
        attend_block_walk(problem, b, h_first + l, row_begin, row_end, walk, seq_vis, rows + l * nr * d, lse + l * nr,
                          counters, loop_scratch(exec, worker));
      }
    }
    for (int32_t l = 0; l < heads_per_item; ++l)
      for (int64_t r = 0; r < nr; ++r)
        sink.write_row(problem, b, row_begin + r, h_first + l, rows + (l * nr + r) * d, lse[l * nr + r]);
  };
  if (plan.panels_per_phase == 0) {
    parallel_items(exec, items, work_item);
    return;
  }

  // Items are numbered (b, kv head)-pair-major, so a phase's items are one contiguous range.
  panels = run_scratch(exec, kRunScratchKvPanels).reserve(size_t(plan.panels_per_phase) * plan.panel_floats);
  const int64_t pairs = int64_t(problem.batch) * problem.num_kv_heads;
  const int64_t items_per_pair = items / pairs;
  const int64_t chunks = (problem.max_seq_k + kKvPanelChunkKeys - 1) / kKvPanelChunkKeys;
  const auto fill_item = [&](int64_t item, int) {
    const int64_t pair = phase_first_pair + item / chunks;
    const int32_t b = int32_t(pair / problem.num_kv_heads);
    const int32_t hk = int32_t(pair % problem.num_kv_heads);
    const int64_t key_begin = item % chunks * kKvPanelChunkKeys;
    const int64_t key_end = std::min(problem.seq_len_k(b), key_begin + kKvPanelChunkKeys);
    if (key_begin >= key_end) return;
    fill_kv_panel(problem, b, hk, key_begin, key_end,
                  kv_panel_in(panels + size_t(pair - phase_first_pair) * plan.panel_floats, d, problem.max_seq_k));
  };
  const auto phase_item = [&](int64_t item, int worker) { work_item(phase_first_pair * items_per_pair + item, worker); };
  for (phase_first_pair = 0; phase_first_pair < pairs; phase_first_pair += plan.panels_per_phase) {
    const int64_t phase_pairs = std::min(plan.panels_per_phase, pairs - phase_first_pair);
    parallel_items(exec, phase_pairs * chunks, fill_item);
    parallel_items(exec, phase_pairs * items_per_pair, phase_item);
  }
}

namespace {

// Dense decode on a 16-bit KV cache: the keys of every sequence are cut into ranges of kDecodeRangeKeys (a fixed
// size, so the result does not depend on the thread count), each range is one work item that reads its K and V once
// for all heads (attend_decode_keys), and the ranges' normalised rows are merged by LSE. fp32 problems keep the block
// walk (its arithmetic is what the shared test vectors pin), and so do CPUs without the decode kernels (AVX-512F, or
// AVX2 + FMA + F16C). A causal row placed by query_offsets may see only a prefix of the keys: the block walk then.

bool use_decode_ranges(const AttentionProblem& problem) {
  return problem.max_seq_q == 1 && problem.dtype != SPARSA_DTYPE_F32 && problem.num_q_heads > 0 &&
         !(problem.causal && problem.query_offsets.present) &&
         problem.num_q_heads / problem.num_kv_heads <= kMaxStackedRows &&
         select_decode_kernels(problem.head_dim) != nullptr;
}

// Floats of one range's rows + LSEs, and the number of ranges per sequence.
size_t decode_range_floats(const AttentionProblem& problem) {
  return size_t(problem.num_q_heads) * (size_t(problem.head_dim) + 1);
}
int64_t decode_ranges(const AttentionProblem& problem) {
  return std::max<int64_t>(1, (problem.max_seq_k + kDecodeRangeKeys - 1) / kDecodeRangeKeys);
}

void run_dense_decode(const AttentionProblem& problem, const OutputSink& sink, const ExecContext& exec) {
  const int d = problem.head_dim;
  const int32_t hq = problem.num_q_heads;
  const int64_t ranges = decode_ranges(problem);
  const size_t row_floats = size_t(d) + 1;  // a row, then its LSE
  const size_t range_floats = decode_range_floats(problem);
  float* partial = run_scratch(exec, kRunScratchDecodeRanges).reserve(size_t(problem.batch) * ranges * range_floats);
  const auto range_item = [&](int64_t item, int worker) {
    const int32_t b = int32_t(item / ranges);
    const int64_t key_begin = item % ranges * kDecodeRangeKeys;
    const int64_t key_end = std::min(problem.seq_len_k(b), key_begin + kDecodeRangeKeys);
    if (problem.seq_len_q(b) == 0 || key_begin >= key_end) return;
    ThreadScratch& mine = policy_scratch(exec, worker);
    float* rows = mine.reserve(range_floats);
    float* lse = rows + size_t(hq) * d;
    RunCounters* counters = &(*exec.counters)[size_t(worker)];
    attend_decode_keys(problem, b, key_begin, key_end, rows, lse, counters, loop_scratch(exec, worker));
    counters->blocks_computed += int64_t(hq) * ((key_end - key_begin + kDefaultBlockK - 1) / kDefaultBlockK);
    float* out = partial + size_t(item) * range_floats;
    for (int32_t h = 0; h < hq; ++h) {
      std::copy(rows + size_t(h) * d, rows + size_t(h + 1) * d, out + size_t(h) * row_floats);
      out[size_t(h) * row_floats + d] = lse[h];
    }
  };
  parallel_items(exec, int64_t(problem.batch) * ranges, range_item);

  // Merge by LSE (one range gives its row unchanged).
  const auto merge_item = [&](int64_t item, int worker) {
    const int32_t b = int32_t(item / hq);
    const int32_t h = int32_t(item % hq);
    if (problem.seq_len_q(b) == 0) return;
    const int64_t n_ranges = (problem.seq_len_k(b) + kDecodeRangeKeys - 1) / kDecodeRangeKeys;
    merge_decode_parts(problem, sink, b, h, partial + size_t(b) * ranges * range_floats + size_t(h) * row_floats,
                       n_ranges, range_floats, policy_scratch(exec, worker).reserve(size_t(d)));
  };
  parallel_items(exec, int64_t(problem.batch) * hq, merge_item);
}

// Dense decode without the decode kernels (fp32 caches, and 16-bit ones on CPUs without them): the block walk of
// run_query_blocks, but each work item walks several kv heads interleaved block by block
// (attend_block_walk_kv_heads), so a block's K/V rows are read front to back for all of them; one kv head at a time
// reads one row per key, a key's width apart. Same tiles, same arithmetic: the bits of run_query_blocks.
// fp32 dense decode at 32K keys, GQA 32/8, D 128, Zen 4: one thread 112 -> 77 ms, two 45-48 -> 39-42 ms.
bool use_kv_head_walks(const AttentionProblem& problem) {
  return problem.max_seq_q == 1 && problem.num_q_heads > 0 && problem.num_kv_heads > 0 &&
         problem.num_q_heads / problem.num_kv_heads <= kMaxStackedRows;
}

// How run_dense_kv_head_walks splits the kv heads: `chunks` items per sequence (enough for every worker, each at most
// kMaxWalkedKvHeads kv heads) of kv_per_chunk kv heads, and the scratch one item needs.
struct KvHeadWalkPlan {
  int32_t chunks = 1, kv_per_chunk = 1;
  int64_t max_key_blocks = 0;
  size_t ids_floats = 0, rows_floats = 0, loop_floats = 0;
};
KvHeadWalkPlan kv_head_walk_plan(const AttentionProblem& problem, int workers, int32_t block_k) {
  KvHeadWalkPlan plan;
  const int32_t group = problem.num_q_heads / problem.num_kv_heads;
  const int64_t per_sequence =
      std::max<int64_t>((workers + problem.batch - 1) / std::max<int32_t>(problem.batch, 1),
                        (problem.num_kv_heads + kMaxWalkedKvHeads - 1) / kMaxWalkedKvHeads);
  plan.chunks = int32_t(std::clamp<int64_t>(per_sequence, 1, problem.num_kv_heads));
  plan.kv_per_chunk = (problem.num_kv_heads + plan.chunks - 1) / plan.chunks;
  plan.max_key_blocks = (problem.max_seq_k + block_k - 1) / block_k;
  plan.ids_floats = scratch_floats<int32_t>(size_t(plan.max_key_blocks));
  plan.rows_floats = size_t(plan.kv_per_chunk) * size_t(group) * (size_t(problem.head_dim) + 1);
  plan.loop_floats = kv_head_walk_floats(problem.head_dim, group,
                                         std::max<int64_t>(1, std::min<int64_t>(block_k, problem.max_seq_k)),
                                         plan.kv_per_chunk);
  return plan;
}

template <typename Lister>
void run_dense_kv_head_walks(const AttentionProblem& problem, const OutputSink& sink, const ExecContext& exec,
                             int32_t block_k, const Lister& list_blocks) {
  const int d = problem.head_dim;
  const int32_t group = problem.num_q_heads / problem.num_kv_heads;
  const KvHeadWalkPlan plan = kv_head_walk_plan(problem, worker_count(exec), block_k);
  const int32_t chunks = plan.chunks, kv_per_chunk = plan.kv_per_chunk;
  const auto work_item = [&](int64_t item, int worker) {
    const int32_t b = int32_t(item / chunks);
    const int32_t hk_first = int32_t(item % chunks) * kv_per_chunk;
    const int32_t n_kv = std::min(kv_per_chunk, problem.num_kv_heads - hk_first);
    if (n_kv <= 0 || problem.seq_len_q(b) == 0) return;
    const int64_t heads = int64_t(n_kv) * group;
    float* base = policy_scratch(exec, worker).reserve(plan.ids_floats + plan.rows_floats);
    int32_t* ids = reinterpret_cast<int32_t*>(base);
    float* rows = base + plan.ids_floats;
    float* lse = rows + heads * d;
    BlockWalk walk;
    walk.block_k = block_k;
    walk.key_blocks = ids;
    walk.n_key_blocks = list_blocks(b, hk_first * group, 0, ids);  // the same blocks for every head
    attend_block_walk_kv_heads(problem, b, hk_first, n_kv, 0, 1, walk, causal_visibility(problem, b), rows, lse,
                               &(*exec.counters)[size_t(worker)], loop_scratch(exec, worker));
    for (int64_t l = 0; l < heads; ++l)
      sink.write_row(problem, b, 0, int32_t(hk_first * group + l), rows + l * d, lse[l]);
  };
  parallel_items(exec, int64_t(problem.batch) * chunks, work_item);
}

}  // namespace

void plan_dense(const AttentionProblem& problem, const ExecContext& exec) {
  if (!use_decode_ranges(problem) && use_kv_head_walks(problem)) {
    const KvHeadWalkPlan plan = kv_head_walk_plan(problem, worker_count(exec), kDefaultBlockK);
    for (int w = 0; w < worker_count(exec); ++w) {
      policy_scratch(exec, w).reserve(plan.ids_floats + plan.rows_floats);
      loop_scratch(exec, w).reserve(plan.loop_floats);
    }
    return;
  }
  if (!use_decode_ranges(problem)) {
    plan_query_blocks(problem, kDefaultBlockQ, exec);
    return;
  }
  const size_t range_floats = decode_range_floats(problem);
  run_scratch(exec, kRunScratchDecodeRanges).reserve(size_t(problem.batch) * decode_ranges(problem) * range_floats);
  for (int w = 0; w < worker_count(exec); ++w) {
    loop_scratch(exec, w).reserve(decode_keys_floats(problem.head_dim, problem.num_q_heads));
    policy_scratch(exec, w).reserve(std::max(range_floats, size_t(problem.head_dim)));
  }
}

void run_dense(const AttentionProblem& problem, const PolicyParams&, const OutputSink& sink, const ExecContext& exec) {
  if (use_decode_ranges(problem)) {
    run_dense_decode(problem, sink, exec);
    return;
  }
  const int32_t block_q = kDefaultBlockQ;
  const int32_t block_k = kDefaultBlockK;
  const auto list_blocks = [&](int32_t b, int32_t, int64_t q_block, int32_t* ids) {
    const int64_t seq_q = problem.seq_len_q(b);
    const int64_t seq_k = problem.seq_len_k(b);
    int64_t key_end = seq_k;
    if (problem.causal) {
      const int64_t last_row = std::min(seq_q, (q_block + 1) * block_q) - 1;
      key_end = std::clamp<int64_t>(last_row + problem.causal_offset(b) + 1, 0, seq_k);
    }
    const int64_t n = (key_end + block_k - 1) / block_k;
    for (int64_t j = 0; j < n; ++j) ids[j] = int32_t(j);
    return n;
  };
  if (use_kv_head_walks(problem)) {
    run_dense_kv_head_walks(problem, sink, exec, block_k, list_blocks);
    return;
  }
  run_query_blocks(problem, sink, exec, block_q, block_k, RowVisibility{problem.causal, 0, -1, 0},
                   std::ref(list_blocks));
}

}  // namespace sparsa::cpu
