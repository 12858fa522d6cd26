// §3 BLOCK_SPARSE: the caller's uint8 mask [B, Hq, ceil(Sq/bq), ceil(Skv/bk)] ∧ causal.
#include <functional>

#include "attention_loop.h"
#include "cpu_engine.h"

namespace sparsa::cpu {

void run_block_sparse(const AttentionProblem& problem, const PolicyParams& policy, const OutputSink& sink,
                      const ExecContext& exec) {
  const int32_t block_q = policy.p.block_q;
  const int32_t block_k = policy.p.block_k;
  const TensorArg& mask = policy.block_mask;
  const uint8_t* mask_data = mask.ptr<const uint8_t>();
  const auto list_blocks = [&](int32_t b, int32_t h, int64_t q_block, int32_t* ids) {
    const int64_t seq_k = problem.seq_len_k(b);
    const int64_t key_blocks = (seq_k + block_k - 1) / block_k;
    // An offset, not a pointer: a mask with no key block may have no data, and null + offset is undefined.
    const int64_t row = b * mask.stride(0) + h * mask.stride(1) + q_block * mask.stride(2);
    int64_t n = 0;
    for (int64_t j = 0; j < key_blocks; ++j)
      if (mask_data[row + j * mask.stride(3)] != 0) ids[n++] = int32_t(j);
    return n;
  };
  run_query_blocks(problem, sink, exec, block_q, block_k, RowVisibility{problem.causal, 0, -1, 0},
                   std::ref(list_blocks));
}

}  // namespace sparsa::cpu
