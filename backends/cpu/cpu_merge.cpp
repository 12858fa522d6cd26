// sparsa_merge_states on the CPU (§0 merge): each (row, head) of the two partial states is read into fp32, merged
// with SoftmaxState::merge and normalised. A row is read completely before it is written, so out may alias o_a.
#include <limits>

#include "../../src/common/softmax_state.h"
#include "attention_loop.h"
#include "cpu_engine.h"

namespace sparsa::cpu {
namespace {

// Element offset of (row r, head h) in an o tensor and of the matching lse entry, padded [B, S, H, D] / [B, H, S]
// or packed [T, H, D] / [H, T]; `r` runs over B·S (padded) or T (packed).
struct MergeLayout {
  bool packed;
  int64_t seq;  // S (padded)
  int64_t o_offset(const TensorArg& o, int64_t r, int64_t h) const {
    if (packed) return r * o.stride(0) + h * o.stride(1);
    return (r / seq) * o.stride(0) + (r % seq) * o.stride(1) + h * o.stride(2);
  }
  int64_t lse_offset(const TensorArg& lse, int64_t r, int64_t h) const {
    if (packed) return h * lse.stride(0) + r * lse.stride(1);
    return (r / seq) * lse.stride(0) + h * lse.stride(1) + (r % seq) * lse.stride(2);
  }
};

}  // namespace

void cpu_merge_states(const MergeProblem& problem, const ExecContext& exec) {
  const TensorArg& o_a = problem.o_a;
  const int rank = o_a.t.ndim;
  const MergeLayout layout{problem.packed, problem.packed ? 1 : o_a.extent(1)};
  const int64_t rows = problem.packed ? o_a.extent(0) : o_a.extent(0) * o_a.extent(1);
  const int64_t heads = o_a.extent(rank - 2);
  const int d = int(o_a.extent(rank - 1));
  const int32_t dtype = o_a.t.dtype;
  if (heads == 0 || d == 0) return;  // nothing to merge; a row buffer of D floats would be sized for nothing
  const auto work_item = [&](int64_t r, int worker) {
    ThreadScratch& mine = policy_scratch(exec, worker);
    float* row_a = mine.reserve(2 * size_t(d));
    float* row_b = row_a + d;
    for (int64_t h = 0; h < heads; ++h) {
      load_row_f32(dtype, o_a.t.data, layout.o_offset(o_a, r, h), d, row_a);
      load_row_f32(dtype, problem.o_b.t.data, layout.o_offset(problem.o_b, r, h), d, row_b);
      const float lse_a = problem.lse_a.ptr<const float>()[layout.lse_offset(problem.lse_a, r, h)];
      const float lse_b = problem.lse_b.ptr<const float>()[layout.lse_offset(problem.lse_b, r, h)];
      SoftmaxState state = SoftmaxState::from_lse(lse_a);
      state.merge(row_a, SoftmaxState::from_lse(lse_b), row_b, d);
      const float lse = state.finalize(row_a, d);
      store_row(dtype, problem.out.t.data, layout.o_offset(problem.out, r, h), d, row_a);
      if (problem.out_lse.present) problem.out_lse.ptr<float>()[layout.lse_offset(problem.out_lse, r, h)] = lse;
    }
  };
  parallel_items(exec, rows, work_item);
}

}  // namespace sparsa::cpu
