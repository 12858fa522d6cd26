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
  const int64_t items = int64_t(problem.batch) * problem.num_q_heads * max_q_blocks;
  // Passed by std::ref so that std::function stores a pointer instead of allocating a copy of the captures.
  const auto work_item = [&](int64_t item, int worker) {
    // Item order: the last query blocks first (under a causal mask they carry the most keys).
    const int64_t q_block = max_q_blocks - 1 - item % max_q_blocks;
    const int32_t h = int32_t(item / max_q_blocks % problem.num_q_heads);
    const int32_t b = int32_t(item / max_q_blocks / problem.num_q_heads);
    const int64_t seq_q = problem.seq_len_q(b);
    const int64_t row_begin = q_block * block_q;
    if (row_begin >= seq_q) return;
    const int64_t row_end = std::min<int64_t>(seq_q, row_begin + block_q);
    const int64_t nr = row_end - row_begin;

    ThreadScratch& mine = policy_scratch(exec, worker);
    const size_t ids_floats = scratch_floats<int32_t>(size_t(max_key_blocks));
    mine.reserve(ids_floats + size_t(nr) * (d + 1));
    int32_t* ids = scratch_array<int32_t>(mine, 0, size_t(max_key_blocks));
    float* rows = mine.buffer.data() + ids_floats;
    float* lse = rows + nr * d;

    BlockWalk walk;
    walk.key_blocks = ids;
    walk.n_key_blocks = lister(b, h, q_block, ids);
    walk.block_k = block_k;
    RowVisibility seq_vis = vis;
    seq_vis.offset = problem.seq_len_k(b) - seq_q;
    attend_block_walk(problem, b, h, row_begin, row_end, walk, seq_vis, rows, lse, &(*exec.counters)[worker],
                      loop_scratch(exec, worker));
    for (int64_t r = 0; r < nr; ++r) sink.write_row(problem, b, row_begin + r, h, rows + r * d, lse[r]);
  };
  exec.parallel_for(items, std::ref(work_item));
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
