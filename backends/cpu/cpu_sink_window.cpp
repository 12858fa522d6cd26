// §2 SINK_WINDOW: the first sink_tokens keys plus a window of sink_window keys around (causal: before) each row.
// Walks only the key blocks that hold a sink key or fall inside the query block's window span.
#include <algorithm>

#include "attention_loop.h"
#include "cpu_engine.h"

namespace sparsa::cpu {

void run_sink_window(const AttentionProblem& problem, const PolicyParams& policy, const OutputSink& sink,
                     const ExecContext& exec) {
  const int32_t block_q = kDefaultBlockQ;
  const int32_t block_k = kDefaultBlockK;
  const int64_t sink_tokens = policy.p.sink_tokens;
  const int64_t window = policy.p.sink_window;
  RowVisibility vis{problem.causal, 0, sink_tokens, window};
  const auto list_blocks = [&](int32_t b, int32_t, int64_t q_block, int32_t* ids) {
    const int64_t seq_q = problem.seq_len_q(b);
    const int64_t seq_k = problem.seq_len_k(b);
    const int64_t offset = problem.causal_offset(b);
    const int64_t first_aligned = q_block * block_q + offset;
    const int64_t last_aligned = std::min(seq_q, (q_block + 1) * block_q) - 1 + offset;
    // Keys any row of the block may see: [0, sink) ∪ (first − window, last + window) (causal: up to last).
    const int64_t window_begin = std::max<int64_t>(0, first_aligned - window + 1);
    const int64_t window_end = std::min<int64_t>(seq_k, problem.causal ? last_aligned + 1 : last_aligned + window);
    const int64_t sink_end =
        std::min<int64_t>(seq_k, problem.causal ? std::min(sink_tokens, last_aligned + 1) : sink_tokens);
    const int64_t key_blocks = (seq_k + block_k - 1) / block_k;
    int64_t n = 0;
    for (int64_t j = 0; j < key_blocks; ++j) {
      const int64_t k0 = j * block_k;
      const int64_t k1 = std::min(seq_k, k0 + block_k);
      const bool has_sink = k0 < sink_end;
      const bool has_window = window > 0 && k0 < window_end && k1 > window_begin;
      if (has_sink || has_window) ids[n++] = int32_t(j);
    }
    return n;
  };
  run_query_blocks(problem, sink, exec, block_q, block_k, vis, std::ref(list_blocks));
}

}  // namespace sparsa::cpu
