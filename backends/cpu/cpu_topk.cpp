// sparsa_topk_from_scores on the CPU (§7): draft attention scores → the k best token or block ids per (b, h),
// ascending. Block scores are float64 sums over the block's real tokens; ties go to the smaller id (§0).
#include <algorithm>
#include <cstdint>

#include "../../src/tensor_util.h"
#include "cpu_select_util.h"
#include "cpu_utilities.h"

namespace sparsa::cpu {

void cpu_topk_from_scores(const TensorArg& scores, int32_t k, int32_t block_size, const TensorArg& out_indices,
                          const ExecContext& exec) {
  const int64_t batch = scores.extent(0);
  const int64_t n_heads = scores.extent(1);
  const int64_t n_tokens = scores.extent(2);
  const int64_t n_ids = ceil_div(n_tokens, block_size);  // overflow-safe: n_tokens may be huge when B·H = 0
  if (k < 1 || k > n_ids) {  // the core checks this; repeated here because nothing may be written otherwise
    fail(SPARSA_STATUS_SHAPE_MISMATCH, "k: expected a value in [1, ", n_ids, "] (number of ",
         block_size == 1 ? "tokens" : "blocks", "), got ", k);
  }

  parallel_items(exec, batch * n_heads, [&](int64_t item, int worker) {
    const int64_t b = item / n_heads;
    const int64_t h = item % n_heads;
    ScratchLayout layout;
    const size_t id_scores_at = layout.add<double>(size_t(n_ids));
    const size_t order_at = layout.add<int64_t>(size_t(n_ids));
    const size_t ids_at = layout.add<int64_t>(size_t(k));
    layout.bind(policy_scratch(exec, worker));
    double* id_scores = layout.get<double>(id_scores_at, size_t(n_ids));
    int64_t* ids = layout.get<int64_t>(ids_at, size_t(k));
    const float* row = scores.ptr<const float>() + b * scores.stride(0) + h * scores.stride(1);
    std::fill(id_scores, id_scores + n_ids, 0.0);
    for (int64_t t = 0; t < n_tokens; ++t) id_scores[t / block_size] += row[t * scores.stride(2)];
    top_k_ids_ascending(id_scores, n_ids, k, layout.get<int64_t>(order_at, size_t(n_ids)), ids);
    int32_t* out = out_indices.ptr<int32_t>() + b * out_indices.stride(0) + h * out_indices.stride(1);
    for (int64_t i = 0; i < k; ++i) out[i * out_indices.stride(2)] = int32_t(ids[i]);
  });
}

}  // namespace sparsa::cpu
