// TOKEN_INDICES (§7, STS) on the CPU: each query head attends to the deduplicated union of its row of the caller's
// indices (token ids or blocks of ids), the first n_init and the last n_local tokens; always causal (§7): the core
// forces problem.causal on.
//
// Work items are (b, h): each builds its key set as merged id ranges (O(k log k + |I|), no O(N) mask), writes its
// row of selected_indices and attends every query row. Checks that can fail run over the whole batch first.
#include <algorithm>
#include <cstdint>
#include <numeric>

#include "../../src/error.h"
#include "attention_loop.h"
#include "cpu_engine.h"
#include "cpu_select_util.h"

namespace sparsa::cpu {
namespace {

// Marks an unused slot of `indices`.
constexpr int32_t kUnusedSlot = -1;

struct IndexParams {
  int64_t block_size = 1;  // 1 = token ids, > 1 = block ids
  int64_t n_init = 0;
  int64_t n_local = 0;
  int32_t n_index_heads = 0;  // H_idx
  int64_t slots = 0;          // k
};

// A half-open range [begin, end) of key ids.
struct IdRange {
  int64_t begin;
  int64_t end;
};
constexpr int64_t kAlwaysIncludedRanges = 2;  // [0, n_init) and [N − n_local, N)

// Ranges one key set over at most max_keys keys keeps at once: one per slot while there are fewer slots than
// distinct blocks of ids (ceil(max_keys / block_size)), else one per distinct block — build_key_set merges its
// ranges whenever they fill this room, so a huge or repetitive slot count needs no more scratch — plus the
// always-included ranges and one free entry.
int64_t range_capacity(int64_t slots, int64_t max_keys, int64_t block_size) {
  const int64_t blocks = (max_keys + block_size - 1) / std::max<int64_t>(block_size, 1);
  return std::min(slots, blocks) + kAlwaysIncludedRanges + 1;
}

// Row of `indices` query head h reads: head_map[h], or h / (Hq / H_idx) without a map.
int32_t index_row_of(const AttentionProblem& problem, const PolicyParams& policy, const IndexParams& params,
                     int32_t h) {
  if (policy.head_map.present) return policy.head_map.ptr<const int32_t>()[h * policy.head_map.stride(0)];
  return h / (problem.num_q_heads / params.n_index_heads);
}

int32_t index_at(const PolicyParams& policy, int32_t b, int32_t row, int64_t slot) {
  const TensorArg& indices = policy.indices;
  return indices.ptr<const int32_t>()[b * indices.stride(0) + row * indices.stride(1) + slot * indices.stride(2)];
}

// The core checks index contents of host tensors; this repeats the check when it could not (before any output).
void check_contents(const AttentionProblem& problem, const PolicyParams& policy, const IndexParams& params) {
  for (int32_t h = 0; h < problem.num_q_heads; ++h) {
    const int32_t row = index_row_of(problem, policy, params, h);
    if (row < 0 || row >= params.n_index_heads) {
      fail(SPARSA_STATUS_INDEX_OUT_OF_RANGE, "head_map: entry ", h, " is ", row, ", expected a row of indices in [0, ",
           params.n_index_heads, ")");
    }
  }
  for (int32_t b = 0; b < problem.batch; ++b) {
    const int64_t n_ids = (problem.seq_len_k(b) + params.block_size - 1) / params.block_size;
    for (int32_t row = 0; row < params.n_index_heads; ++row) {
      for (int64_t slot = 0; slot < params.slots; ++slot) {
        const int32_t id = index_at(policy, b, row, slot);
        if (id != kUnusedSlot && (id < 0 || id >= n_ids)) {
          fail(SPARSA_STATUS_INDEX_OUT_OF_RANGE, "indices: entry [", b, ", ", row, ", ", slot, "] is ", id,
               ", expected -1 or a ", params.block_size == 1 ? "token" : "block", " id in [0, ", n_ids, ")");
        }
      }
    }
  }
}

// Key set of (b, h) over a sequence of n_keys keys: the union of [0, n_init), every listed token or block
// [id·bs, min((id+1)·bs, N)) and [N − n_local, N), ascending and deduplicated, written to keys (room for N ids);
// returns its size. `ranges` is scratch for `capacity` ranges (range_capacity over at least n_keys keys).
int64_t build_key_set(const AttentionProblem& problem, const PolicyParams& policy, const IndexParams& params,
                      int32_t b, int32_t h, int64_t n_keys, IdRange* ranges, int64_t capacity, int64_t* keys) {
  const auto by_begin = [](const IdRange& x, const IdRange& y) { return x.begin < y.begin; };
  int64_t n_ranges = 0;
  // Sorts and merges overlapping or touching ranges in place: at most one range per distinct block remains.
  const auto merge_ranges = [&] {
    std::sort(ranges, ranges + n_ranges, by_begin);
    int64_t merged = 0;
    for (int64_t r = 0; r < n_ranges; ++r) {
      if (merged > 0 && ranges[r].begin <= ranges[merged - 1].end) {
        ranges[merged - 1].end = std::max(ranges[merged - 1].end, ranges[r].end);
      } else {
        ranges[merged++] = ranges[r];
      }
    }
    n_ranges = merged;
  };
  if (params.n_init > 0) ranges[n_ranges++] = {0, std::min(params.n_init, n_keys)};
  if (params.n_local > 0) ranges[n_ranges++] = {std::max<int64_t>(0, n_keys - params.n_local), n_keys};
  const int32_t row = index_row_of(problem, policy, params, h);
  for (int64_t slot = 0; slot < params.slots; ++slot) {
    const int32_t id = index_at(policy, b, row, slot);
    if (id == kUnusedSlot) continue;
    if (n_ranges == capacity) merge_ranges();
    ranges[n_ranges++] = {id * params.block_size, std::min((id + 1) * params.block_size, n_keys)};
  }
  std::sort(ranges, ranges + n_ranges, by_begin);
  int64_t n = 0;
  int64_t covered_end = 0;  // every id below it is already in `keys`
  for (int64_t r = 0; r < n_ranges; ++r) {
    for (int64_t t = std::max(ranges[r].begin, covered_end); t < ranges[r].end; ++t) keys[n++] = t;
    covered_end = std::max(covered_end, ranges[r].end);
  }
  return n;
}

// The decode path's key lists in run scratch (slot kRunScratchSelection): [B, n_lists, max_seq_k] ids, then the
// lists' sizes [B, n_lists].
struct DecodeKeyLists {
  ScratchLayout layout;
  size_t keys_at, sizes_at;
  DecodeKeyLists(const AttentionProblem& problem, int32_t n_lists) {
    const size_t n_entries = size_t(problem.batch) * size_t(n_lists);
    keys_at = layout.add<int64_t>(n_entries * size_t(problem.max_seq_k));
    sizes_at = layout.add<int64_t>(n_entries);
  }
};

// A work item's arrays in its worker's policy scratch on the tile path: ranges, its key set, its rows, output rows.
struct ItemArrays {
  ScratchLayout layout;
  size_t ranges_at, keys_at, rows_at, out_at, lse_at;
  int64_t range_room;
  ItemArrays(const AttentionProblem& problem, int64_t range_room_, int64_t seq_q, int64_t seq_k)
      : range_room(range_room_) {
    ranges_at = layout.add<IdRange>(size_t(range_room));
    keys_at = layout.add<int64_t>(size_t(seq_k));
    rows_at = layout.add<int64_t>(size_t(seq_q));
    out_at = layout.add<float>(out_rows_count(problem));
    lse_at = layout.add<float>(lse_rows_count());
  }
};

}  // namespace

void plan_token_indices(const AttentionProblem& problem, const PolicyParams& policy, const ExecContext& exec) {
  const size_t item_floats =
      ItemArrays(problem,
                 range_capacity(policy.indices.present ? policy.indices.extent(2) : 0, problem.max_seq_k,
                                policy.p.index_block_size),
                 problem.max_seq_q, problem.max_seq_k)
          .layout.floats();
  for (int w = 0; w < worker_count(exec); ++w) policy_scratch(exec, w).reserve(item_floats);
  if (!decode_lists_apply(problem)) return;
  run_scratch(exec, kRunScratchSelection).reserve(DecodeKeyLists(problem, problem.num_kv_heads).layout.floats());
  reserve_decode_lists_scratch(problem, problem.max_seq_k, exec);
}

void run_token_indices(const AttentionProblem& problem, const PolicyParams& policy, const OutputSink& sink,
                       const ExecContext& exec) {
  IndexParams params;
  params.block_size = policy.p.index_block_size;
  params.n_init = policy.p.index_n_init;
  params.n_local = policy.p.index_n_local;
  params.n_index_heads = int32_t(policy.indices.extent(1));
  params.slots = policy.indices.extent(2);
  const int32_t batch = problem.batch;
  const int32_t n_heads = problem.num_q_heads;

  // Checks first: nothing is written before they end.
  if (!problem.contents_validated) check_contents(problem, policy, params);
  for (int32_t b = 0; b < batch; ++b) require_selected_capacity(problem, problem.seq_len_k(b), b, "TOKEN_INDICES");

  const int32_t group = n_heads / problem.num_kv_heads;
  bool groups_share_rows = true;  // every head of a kv group reads its group's first head's row of indices
  bool all_share_row = true;      // every head reads head 0's row
  for (int32_t h = 0; h < n_heads; ++h) {
    const int32_t row = index_row_of(problem, policy, params, h);
    groups_share_rows = groups_share_rows && row == index_row_of(problem, policy, params, h - h % group);
    all_share_row = all_share_row && row == index_row_of(problem, policy, params, 0);
  }

  // Decode on a 16-bit cache: one key list per kv group (or one for all heads when they share a row of indices),
  // attended with the dense decode kernels (run_decode_lists: each listed key's K and V read once for the list's
  // kv heads). The lists live in run scratch.
  if (groups_share_rows && decode_lists_apply(problem)) {
    const int32_t n_lists = all_share_row ? 1 : problem.num_kv_heads;
    const int32_t heads_per_list = n_heads / n_lists;
    DecodeKeyLists lists(problem, n_lists);
    lists.layout.bind(run_scratch(exec, kRunScratchSelection));
    const size_t n_entries = size_t(batch) * size_t(n_lists);
    int64_t* keys = lists.layout.get<int64_t>(lists.keys_at, n_entries * size_t(problem.max_seq_k));
    int64_t* sizes = lists.layout.get<int64_t>(lists.sizes_at, n_entries);
    parallel_items(exec, int64_t(n_entries), [&](int64_t item, int worker) {
      const int32_t b = int32_t(item / n_lists);
      const int32_t h_first = int32_t(item % n_lists) * heads_per_list;
      ScratchLayout layout;
      const int64_t room = range_capacity(params.slots, problem.max_seq_k, params.block_size);
      const size_t ranges_at = layout.add<IdRange>(size_t(room));
      layout.bind(policy_scratch(exec, worker));
      int64_t* list = keys + item * problem.max_seq_k;
      sizes[item] = build_key_set(problem, policy, params, b, h_first, problem.seq_len_k(b),
                                  layout.get<IdRange>(ranges_at, size_t(room)), room, list);
      if (problem.selected_indices.present)
        for (int32_t l = 0; l < heads_per_list; ++l)
          write_selected_set(problem.selected_indices, b, h_first + l, list, sizes[item]);
    });
    run_decode_lists(problem, DecodeLists{keys, sizes, problem.max_seq_k, n_lists}, sink, exec);
    return;
  }

  // Decode-sized sequences stack the query heads of a kv group into one tile (each K/V tile converted once per
  // group; bit-identical results) when every head of every group reads the same row of indices (so the same key
  // set) and there is still a work item per worker.
  const bool stack = group > 1 && groups_share_rows && problem.max_seq_q > 0 &&
                     int64_t(problem.max_seq_q) * group <= kMaxStackedRows &&
                     int64_t(batch) * problem.num_kv_heads >= worker_count(exec);
  const int32_t heads_per_item = stack ? group : 1;
  const int32_t head_items = n_heads / heads_per_item;

  parallel_items(exec, int64_t(batch) * head_items, [&](int64_t item, int worker) {
    const int32_t b = int32_t(item / head_items);
    const int32_t h_first = int32_t(item % head_items) * heads_per_item;
    const int64_t seq_q = problem.seq_len_q(b);
    const int64_t seq_k = problem.seq_len_k(b);
    ItemArrays arrays(problem, range_capacity(params.slots, problem.max_seq_k, params.block_size), seq_q, seq_k);
    ScratchLayout& layout = arrays.layout;
    layout.bind(policy_scratch(exec, worker));
    int64_t* keys = layout.get<int64_t>(arrays.keys_at, size_t(seq_k));
    int64_t* rows = layout.get<int64_t>(arrays.rows_at, size_t(seq_q));
    float* out_rows = layout.get<float>(arrays.out_at, out_rows_count(problem));
    float* lse_rows = layout.get<float>(arrays.lse_at, lse_rows_count());
    const int64_t n_keys = build_key_set(
        problem, policy, params, b, h_first, seq_k,
        layout.get<IdRange>(arrays.ranges_at, size_t(arrays.range_room)), arrays.range_room, keys);
    if (problem.selected_indices.present)
      for (int32_t l = 0; l < heads_per_item; ++l)
        write_selected_set(problem.selected_indices, b, h_first + l, keys, n_keys);
    std::iota(rows, rows + seq_q, int64_t{0});
    RowVisibility visibility;
    visibility.causal = problem.causal;
    visibility.offset = problem.causal_offset(b);
    attend_heads_over_keys(problem, b, h_first, heads_per_item, rows, seq_q, keys, n_keys, visibility,
                           /*causal_prefix=*/problem.causal, sink, out_rows, lse_rows,
                           &(*exec.counters)[size_t(worker)], loop_scratch(exec, worker));
  });
}

}  // namespace sparsa::cpu
