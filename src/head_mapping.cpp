// §7 STS head mapping: for each target head, the draft head whose per-trace top-k sets overlap it most.
// Host memory, F32, any strides. Ties everywhere: the smaller index wins.
#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>
#include <vector>

#include "host_utilities.h"
#include "tensor_util.h"
#include "validate.h"

namespace sparsa {
namespace {

// Marks in `selected` (size N) the k largest entries of the strided row (NaN ranks lowest; ties: smaller index).
void mark_top_k(const TensorArg& traces, int64_t t, int64_t head, int64_t k, std::vector<int64_t>& order,
                std::vector<uint8_t>& selected) {
  const float* base = traces.ptr<const float>() + t * traces.stride(0) + head * traces.stride(1);
  const int64_t stride = traces.stride(2);
  auto score = [&](int64_t j) {
    const float s = base[j * stride];
    return std::isnan(s) ? -std::numeric_limits<float>::infinity() : s;
  };
  std::iota(order.begin(), order.end(), int64_t{0});
  std::partial_sort(order.begin(), order.begin() + k, order.end(), [&](int64_t a, int64_t b) {
    const float sa = score(a), sb = score(b);
    return sa > sb || (sa == sb && a < b);
  });
  std::fill(selected.begin(), selected.end(), uint8_t{0});
  for (int64_t i = 0; i < k; ++i) selected[size_t(order[size_t(i)])] = 1;
}

}  // namespace

void head_mapping(const sparsa_tensor* draft_t, const sparsa_tensor* target_t, int32_t k,
                  const sparsa_tensor* out_map_t) {
  const TensorArg draft = read_tensor(draft_t, "draft", true);
  const TensorArg target = read_tensor(target_t, "target", true);
  const TensorArg out_map = read_tensor(out_map_t, "out_map", true);
  expect_host(draft, "draft");
  expect_host(target, "target");
  expect_host(out_map, "out_map");
  expect_dtype(draft, "draft", SPARSA_DTYPE_F32);
  expect_dtype(target, "target", SPARSA_DTYPE_F32);
  expect_dtype(out_map, "out_map", SPARSA_DTYPE_I32);
  expect_rank(draft, "draft", 3, "[T, Hd, N]");
  expect_rank(target, "target", 3, "[T, Ht, N]");
  const int64_t traces = draft.extent(0), draft_heads = draft.extent(1), n = draft.extent(2);
  const int64_t target_heads = target.extent(1);
  if (target.extent(0) != traces || target.extent(2) != n) {
    fail(SPARSA_STATUS_SHAPE_MISMATCH, "target: shape ", shape_string(target.t), " but draft has shape ",
         shape_string(draft.t), " (T and N must match)");
  }
  if (draft_heads < 1) fail(SPARSA_STATUS_SHAPE_MISMATCH, "draft: shape ", shape_string(draft.t), " has Hd = 0");
  expect_shape(out_map, "out_map", {target_heads}, "[Ht] from target");
  expect_distinct_elements(out_map, "out_map");
  if (k < 1 || k > n) fail(SPARSA_STATUS_SHAPE_MISMATCH, "k: expected 1 <= k <= N = ", n, ", got ", k);

  if (traces == 0) {  // no trace: every overlap is 0 and the tie goes to draft head 0; nothing to size from N
    for (int64_t ht = 0; ht < target_heads; ++ht) out_map.ptr<int32_t>()[ht * out_map.stride(0)] = 0;
    return;
  }
  // overlap[ht * Hd + hd] = Σ_t |topk(draft[t, hd]) ∩ topk(target[t, ht])|
  std::vector<int64_t> overlap(static_cast<size_t>(target_heads * draft_heads), 0);
  std::vector<int64_t> order(static_cast<size_t>(n));
  std::vector<uint8_t> target_set(static_cast<size_t>(n));
  std::vector<std::vector<uint8_t>> draft_sets(static_cast<size_t>(draft_heads),
                                               std::vector<uint8_t>(static_cast<size_t>(n)));
  for (int64_t t = 0; t < traces; ++t) {
    for (int64_t hd = 0; hd < draft_heads; ++hd) mark_top_k(draft, t, hd, k, order, draft_sets[size_t(hd)]);
    for (int64_t ht = 0; ht < target_heads; ++ht) {
      mark_top_k(target, t, ht, k, order, target_set);
      for (int64_t hd = 0; hd < draft_heads; ++hd) {
        const std::vector<uint8_t>& ds = draft_sets[size_t(hd)];
        int64_t common = 0;
        for (int64_t j = 0; j < n; ++j) common += ds[size_t(j)] & target_set[size_t(j)];
        overlap[size_t(ht * draft_heads + hd)] += common;
      }
    }
  }
  for (int64_t ht = 0; ht < target_heads; ++ht) {
    int64_t best = 0;
    for (int64_t hd = 1; hd < draft_heads; ++hd) {
      if (overlap[size_t(ht * draft_heads + hd)] > overlap[size_t(ht * draft_heads + best)]) best = hd;
    }
    out_map.ptr<int32_t>()[ht * out_map.stride(0)] = int32_t(best);
  }
}

}  // namespace sparsa
