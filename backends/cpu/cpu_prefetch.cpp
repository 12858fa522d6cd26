// sparsa_kv_prefetch on the CPU (§7): gather the K/V rows of each sequence's selected tokens into compact buffers.
//
// Per sequence b the union U_b of its valid indices (all H_idx rows) is sorted, so compact row c holds token U_b[c]
// and order is kept: positions[b, c] = U_b[c] (-1 past |U_b|), remapped[b, r, s] = the compact row of
// indices[b, r, s] (-1 stays -1), counts[b] = |U_b|. Rows of k_dst/v_dst past |U_b| are left untouched.
// validate_prefetch has already checked every index and every union against C, so nothing here can fail once
// the first output is written; each work item rebuilds its sequence's union in thread scratch (O(H_idx·k log),
// cheap against the O(|U|·Hkv·D) copy). An empty batch binds no scratch at all: H_idx·k may then be any extent.
// The outputs' elements are distinct (validate_prefetch), so the O(C) and O(H_idx·k) walks stay within memory the
// caller owns.
#include <algorithm>
#include <cstdint>
#include <cstring>

#include "cpu_select_util.h"
#include "cpu_utilities.h"

namespace sparsa::cpu {
namespace {

constexpr int32_t kUnusedSlot = -1;

int32_t index_at(const TensorArg& indices, int64_t b, int64_t row, int64_t slot) {
  return indices.ptr<const int32_t>()[b * indices.stride(0) + row * indices.stride(1) + slot * indices.stride(2)];
}

// Copies D elements of token `token`, kv head hk of sequence b in `src` to compact row `row` of `dst`.
void copy_row(const TensorArg& src, const TensorArg& dst, size_t row_bytes, int64_t b, int64_t token, int64_t row,
              int64_t hk) {
  if (row_bytes == 0) return;  // D = 0: the tensors may have no data at all
  const size_t element_size = sparsa_dtype_size(src.t.dtype);
  const char* from = static_cast<const char*>(src.t.data) +
                     (b * src.stride(0) + token * src.stride(1) + hk * src.stride(2)) * int64_t(element_size);
  char* to = static_cast<char*>(dst.t.data) +
             (b * dst.stride(0) + row * dst.stride(1) + hk * dst.stride(2)) * int64_t(element_size);
  std::memcpy(to, from, row_bytes);
}

// Writes the ascending, deduplicated valid ids of sequence b (rows x slots entries) to ids (room for rows·slots)
// and returns their count. Every entry is -1 or a token id (validate_prefetch).
int64_t sequence_union(const TensorArg& indices, int64_t b, int64_t rows, int64_t slots, int64_t* ids) {
  int64_t n = 0;
  for (int64_t row = 0; row < rows; ++row) {
    for (int64_t slot = 0; slot < slots; ++slot) {
      const int32_t id = index_at(indices, b, row, slot);
      if (id == kUnusedSlot) continue;
      ids[n++] = id;
    }
  }
  std::sort(ids, ids + n);
  return std::unique(ids, ids + n) - ids;
}

}  // namespace

void cpu_kv_prefetch(const PrefetchProblem& problem, const ExecContext& exec) {
  const TensorArg& indices = problem.indices;
  const int64_t batch = indices.extent(0);
  const int64_t slots = indices.extent(2);
  // With k = 0 there is no entry: H_idx may then be any extent (remapped is empty too), so walk no row.
  const int64_t n_index_heads = slots == 0 ? 0 : indices.extent(1);
  const int64_t n_kv_heads = problem.k_src.extent(2);
  const int64_t head_dim = problem.k_src.extent(3);
  const int64_t capacity = problem.k_dst.extent(1);
  const size_t row_bytes = size_t(head_dim) * sparsa_dtype_size(problem.k_src.t.dtype);

  const size_t max_ids = size_t(n_index_heads * slots);

  // Per sequence: positions, remapped, counts and the gather.
  parallel_items(exec, batch, [&](int64_t b, int worker) {
    ScratchLayout layout;
    const size_t ids_at = layout.add<int64_t>(max_ids);
    layout.bind(policy_scratch(exec, worker));
    int64_t* ids = layout.get<int64_t>(ids_at, max_ids);
    const int64_t n_ids = sequence_union(indices, b, n_index_heads, slots, ids);

    const TensorArg& positions = problem.positions;
    for (int64_t c = 0; c < capacity; ++c) {
      positions.ptr<int32_t>()[b * positions.stride(0) + c * positions.stride(1)] = c < n_ids ? int32_t(ids[c]) : -1;
    }
    const TensorArg& remapped = problem.remapped;
    for (int64_t row = 0; row < n_index_heads; ++row) {
      for (int64_t slot = 0; slot < slots; ++slot) {
        const int32_t id = index_at(indices, b, row, slot);
        const int32_t compact_row =
            id == kUnusedSlot ? kUnusedSlot : int32_t(std::lower_bound(ids, ids + n_ids, int64_t(id)) - ids);
        remapped.ptr<int32_t>()[b * remapped.stride(0) + row * remapped.stride(1) + slot * remapped.stride(2)] =
            compact_row;
      }
    }
    if (problem.counts.present) problem.counts.ptr<int32_t>()[b * problem.counts.stride(0)] = int32_t(n_ids);
    for (int64_t c = 0; c < n_ids; ++c) {
      for (int64_t hk = 0; hk < n_kv_heads; ++hk) {
        copy_row(problem.k_src, problem.k_dst, row_bytes, b, ids[c], c, hk);
        copy_row(problem.v_src, problem.v_dst, row_bytes, b, ids[c], c, hk);
      }
    }
  });
}

}  // namespace sparsa::cpu
