// §1 DENSE, and the query-block driver shared by the block policies (cpu_engine.h).
#include <algorithm>
#include <functional>

#include "attention_loop.h"
#include "cpu_engine.h"

namespace sparsa::cpu {

RowVisibility causal_visibility(const AttentionProblem& problem, int32_t b) {
  RowVisibility vis;
  vis.causal = problem.causal;
  vis.offset = problem.seq_len_k(b) - problem.seq_len_q(b);
  return vis;
}

void run_query_blocks(const AttentionProblem& problem, const OutputSink& sink, const ExecContext& exec, int32_t block_q,
                      int32_t block_k, const RowVisibility& vis, const KeyBlockLister& lister) {
  const int d = problem.head_dim;
  const int64_t max_q_blocks = (problem.max_seq_q + block_q - 1) / block_q;
  const int64_t max_key_blocks = (problem.max_seq_k + block_k - 1) / block_k;
  // Stack the g query heads of a kv group when their rows are few (decode) and there are still enough groups to
  // keep every worker busy. Stacking never changes a row's arithmetic, so the choice cannot change results.
  const int32_t group = problem.num_q_heads / problem.num_kv_heads;
  const bool stack = group > 1 && problem.max_seq_q > 0 && int64_t(problem.max_seq_q) * group <= kMaxStackedRows &&
                     int64_t(problem.batch) * problem.num_kv_heads * max_q_blocks >= worker_count(exec);
  const int32_t heads_per_item = stack ? group : 1;
  const int32_t head_items = problem.num_q_heads / heads_per_item;
  const int64_t items = int64_t(problem.batch) * head_items * max_q_blocks;
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
    seq_vis.offset = problem.seq_len_k(b) - seq_q;
    RunCounters* counters = &(*exec.counters)[size_t(worker)];
    BlockWalk walk;
    walk.block_k = block_k;
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
  parallel_items(exec, items, work_item);
}

void run_dense(const AttentionProblem& problem, const PolicyParams&, const OutputSink& sink, const ExecContext& exec) {
  const int32_t block_q = kDefaultBlockQ;
  const int32_t block_k = kDefaultBlockK;
  const auto list_blocks = [&](int32_t b, int32_t, int64_t q_block, int32_t* ids) {
    const int64_t seq_q = problem.seq_len_q(b);
    const int64_t seq_k = problem.seq_len_k(b);
    int64_t key_end = seq_k;
    if (problem.causal) {
      const int64_t last_row = std::min(seq_q, (q_block + 1) * block_q) - 1;
      key_end = std::clamp<int64_t>(last_row + seq_k - seq_q + 1, 0, seq_k);
    }
    const int64_t n = (key_end + block_k - 1) / block_k;
    for (int64_t j = 0; j < n; ++j) ids[j] = int32_t(j);
    return n;
  };
  run_query_blocks(problem, sink, exec, block_q, block_k, RowVisibility{problem.causal, 0, -1, 0},
                   std::ref(list_blocks));
}

}  // namespace sparsa::cpu
