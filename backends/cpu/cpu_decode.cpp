// Dense decode over a key range on a 16-bit KV cache (attend_decode_keys, cpu_engine.h) with the AVX-512F or AVX2
// decode kernels (decode_kernels.h); run_dense uses it only where they exist. The same loop over an explicit key list
// (attend_decode_list) serves the selection policies' decode (run_decode_lists: lists cut into slices, merged by
// LSE like dense decode's ranges); there a caller may hand over scores it already holds (KnownScores: TOKEN_SELECT's
// fp32 screen scored every candidate), and a tile of such keys reads V alone.
//
// One call keeps every query head's state (q, o, m, l) for sequence b and streams the range's keys in tiles of
// kDecodeTileKeys: all kv heads of a key are read before the next key, so the K and V bytes of the range are read
// front to back once (measured on this backend's default [B, S, Hkv, D] layout: one kv head at a time over the same
// keys reads memory several times slower than front to back; the hardware prefetchers follow the front-to-back K
// stream, while the scores kernel fetches each key's V rows into L2 for the tile's P·V: decode_kernels.h,
// prefetch_for_key). Per tile: Sᵀ = K·qᵀ for every head, the online softmax with the fp32 tile microkernels (column
// max, exp, rescale), then o += P·V.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>

#include "../../src/common/softmax_state.h"
#include "../../src/error.h"
#include "attention_loop.h"
#include "cpu_convert.h"
#include "cpu_engine.h"
#include "decode_kernels.h"
#include "microkernels.h"

namespace sparsa::cpu {
namespace {

constexpr float kNegInf = -std::numeric_limits<float>::infinity();

int round_up(int n, int multiple) { return (n + multiple - 1) / multiple * multiple; }

}  // namespace

size_t decode_keys_floats(int head_dim, int num_q_heads) {
  const size_t hq = size_t(num_q_heads);
  const size_t st_stride = size_t(round_up(std::max(num_q_heads, 1), kRowAlign) + kStridePad);
  const size_t pointers = scratch_floats<const unsigned char*>(3 * size_t(kDecodeTileKeys));
  return pointers + hq * size_t(head_dim) + size_t(kDecodeTileKeys) * st_stride + 5 * st_stride;
}

namespace {

// The kv heads [hk_first, hk_first + n_kv) of sequence b (query heads hk_first·g ... ) over n_keys keys, key j at
// position key_at(j). out_rows [n_kv·g, D], lse_rows [n_kv·g].
// scattered: the keys are a list (their rows prefetched by the kernels), not a range the hardware streams.
// known: null, or scores held for some of the keys (KnownScores).
template <typename KeyAt>
void attend_decode(const AttentionProblem& problem, int32_t b, int32_t hk_first, int32_t n_kv, KeyAt key_at,
                   int64_t n_keys, bool scattered, const KnownScores* known, float* out_rows, float* lse_rows,
                   RunCounters* counters, ThreadScratch& scratch) {
  const int d = problem.head_dim;
  const int group = problem.num_q_heads / problem.num_kv_heads;
  const int hq = n_kv * group;  // query heads of this call
  const int h_first = hk_first * group;
  const int nr_pad = round_up(std::max(hq, 1), kRowAlign);
  const int st_stride = nr_pad + kStridePad;
  const int64_t eb = element_bytes(problem.dtype);
  const Microkernels& kernels = select_microkernels();
  const DecodeKernels* kernels_or_null = select_decode_kernels(d);
  if (!kernels_or_null) fail(SPARSA_STATUS_INTERNAL, "attend_decode_keys: no decode kernels for head_dim ", d);
  const DecodeKernels& decode = *kernels_or_null;

  float* next = scratch.reserve(decode_keys_floats(d, problem.num_q_heads));
  auto carve = [&next](size_t floats) {
    float* carved = next;
    next += floats;
    return carved;
  };
  // The row pointers first (8-byte aligned at the start of the buffer), then the floats.
  auto** rows = reinterpret_cast<const unsigned char**>(
      carve(scratch_floats<const unsigned char*>(3 * size_t(kDecodeTileKeys))));
  const unsigned char** k_rows = rows;
  const unsigned char** v_rows = rows + kDecodeTileKeys;
  const unsigned char** v_rows_ahead = rows + 2 * kDecodeTileKeys;
  float* q = carve(size_t(hq) * d);
  float* o = out_rows;  // unnormalised accumulator, normalised at the end
  float* st = carve(size_t(kDecodeTileKeys) * st_stride);
  float* m = carve(size_t(st_stride));
  float* l = carve(size_t(st_stride));
  float* local_max = carve(size_t(st_stride));
  float* shift = carve(size_t(st_stride));
  float* block_sum = carve(size_t(st_stride));

  for (int h = 0; h < hq; ++h) {
    load_row_f32(problem.dtype, problem.q.t.data, problem.q_offset(problem.q, b, 0, h_first + h), d,
                 q + int64_t(h) * d);
    for (int c = 0; c < d; ++c) q[int64_t(h) * d + c] *= problem.scale;
  }
  std::memset(o, 0, sizeof(float) * size_t(hq) * size_t(d));
  for (int r = 0; r < st_stride; ++r) {
    m[r] = kNegInf;
    l[r] = 0.f;
  }
  for (int j = 0; j < int(kDecodeTileKeys); ++j)
    for (int r = hq; r < st_stride; ++r) st[int64_t(j) * st_stride + r] = 0.f;  // padding columns stay finite

  const unsigned char* k_base = static_cast<const unsigned char*>(problem.k.t.data);
  const unsigned char* v_base = static_cast<const unsigned char*>(problem.v.t.data);
  const auto k_row = [&](int64_t t, int32_t hk) { return k_base + problem.kv_offset(problem.k, b, t, hk) * eb; };
  const auto v_row = [&](int64_t t, int32_t hk) { return v_base + problem.kv_offset(problem.v, b, t, hk) * eb; };
  DecodeTile tile;
  tile.k_rows = k_rows;
  tile.v_rows = v_rows;
  if (n_keys > 0 && n_kv > 1) {
    tile.k_head_bytes = k_row(key_at(0), hk_first + 1) - k_row(key_at(0), hk_first);
    tile.v_head_bytes = v_row(key_at(0), hk_first + 1) - v_row(key_at(0), hk_first);
  }
  tile.n_kv_heads = n_kv;
  tile.group = group;
  tile.d = d;
  tile.dtype = problem.dtype;
  tile.prefetch_rows = scattered;
  if (!scattered && problem.kv_layout != KvLayout::kPaged && n_keys > 1)
    tile.k_key_bytes = k_row(key_at(1), hk_first) - k_row(key_at(0), hk_first);
  const auto is_known = [known](int64_t t) {
    return known && known->rows && t >= known->first_key && t - known->first_key < known->n_keys;
  };

  bool v_fetched_ahead = false;  // the tile's V rows went to L2 during the tile before
  for (int64_t key0 = 0; key0 < n_keys; key0 += kDecodeTileKeys) {
    const int nk = int(std::min(kDecodeTileKeys, n_keys - key0));
    bool all_known = true;
    for (int j = 0; j < nk; ++j) {
      const int64_t t = key_at(key0 + j);
      k_rows[j] = k_row(t, hk_first);
      v_rows[j] = v_row(t, hk_first);
      all_known = all_known && is_known(t);
    }
    tile.nk = nk;
    tile.rows_ahead = nullptr;
    if (all_known) {
      // K is not read. V rows go to L2 one tile ahead, fetched by accumulate as it goes (DecodeTile::rows_ahead;
      // this tile's at once when the tile before did not fetch them): the scores kernel would fetch them during the
      // tile's scoring, which no longer hides their latency (8K keys N/4 on Zen 4, one thread, the list attention
      // 0.50-0.54 ms with this tile's rows fetched at once, 0.43-0.51 with the next tile's).
      if (!v_fetched_ahead)
        for (int j = 0; j < nk; ++j) prefetch_key_rows(v_rows[j], tile.v_head_bytes, tile, prefetch_line_to_l2);
      if (key0 + kDecodeTileKeys < n_keys) {
        for (int j = 0; j < nk; ++j)  // past the list's end: this tile's rows again, already in cache
          v_rows_ahead[j] = key0 + kDecodeTileKeys + j < n_keys ? v_row(key_at(key0 + kDecodeTileKeys + j), hk_first)
                                                                 : v_rows[j];
        tile.rows_ahead = v_rows_ahead;
      }
      for (int j = 0; j < nk; ++j) {
        const float* from = known->rows + (key_at(key0 + j) - known->first_key) * problem.num_q_heads + h_first;
        float* to = st + int64_t(j) * st_stride;
        for (int r = 0; r < hq; ++r) to[r] = from[r] * known->factor;
      }
    } else {
      decode.scores(tile, q, st, st_stride);
    }
    v_fetched_ahead = all_known;
    kernels.column_max(st, st_stride, nk, nr_pad, local_max);
    for (int r = 0; r < nr_pad; ++r) {
      const float m_new = std::max(m[r], local_max[r]);
      shift[r] = m_new == kNegInf ? 0.f : m_new;
    }
    kernels.exp_columns(st, st_stride, nk, nr_pad, shift, block_sum);
    for (int r = 0; r < hq; ++r) {
      if (local_max[r] == kNegInf) continue;
      const SoftmaxState state{m[r], l[r]};
      const float alpha = state.rescale_to(shift[r]);
      if (alpha != 1.f) kernels.scale_row(o + int64_t(r) * d, d, alpha);
      m[r] = shift[r];
      l[r] = state.l * alpha + block_sum[r];
    }
    decode.accumulate(tile, st, st_stride, o);
    if (counters) counters->pairs_computed += int64_t(hq) * nk;
  }
  for (int r = 0; r < hq; ++r) {
    const SoftmaxState state{m[r], l[r]};
    lse_rows[r] = state.finalize(o + int64_t(r) * d, d);
  }
}

}  // namespace

void attend_decode_keys(const AttentionProblem& problem, int32_t b, int64_t key_begin, int64_t key_end,
                        float* out_rows, float* lse_rows, RunCounters* counters, ThreadScratch& scratch) {
  attend_decode(problem, b, 0, problem.num_kv_heads, [key_begin](int64_t j) { return key_begin + j; },
                key_end - key_begin, /*scattered=*/false, /*known=*/nullptr, out_rows, lse_rows, counters, scratch);
}

void attend_decode_list(const AttentionProblem& problem, int32_t b, int32_t hk_first, int32_t n_kv,
                        const int64_t* keys, int64_t n_keys, const KnownScores* known, float* out_rows,
                        float* lse_rows, RunCounters* counters, ThreadScratch& scratch) {
  attend_decode(problem, b, hk_first, n_kv, [keys](int64_t j) { return keys[j]; }, n_keys, /*scattered=*/true, known,
                out_rows, lse_rows, counters, scratch);
}

void merge_decode_parts(const AttentionProblem& problem, const OutputSink& sink, int32_t b, int32_t h,
                        const float* first_part, int64_t n_parts, size_t part_stride, float* merged) {
  const int d = problem.head_dim;
  const auto part = [&](int64_t r) { return first_part + size_t(r) * part_stride; };
  std::fill(merged, merged + d, 0.f);
  float max_lse = kNegInf;
  for (int64_t r = 0; r < n_parts; ++r) max_lse = std::max(max_lse, part(r)[d]);
  if (max_lse == kNegInf) {
    sink.write_row(problem, b, 0, h, merged, max_lse);
    return;
  }
  float weight_sum = 0.f;
  for (int64_t r = 0; r < n_parts; ++r) {
    const float* row = part(r);
    const float w = std::exp(row[d] - max_lse);
    weight_sum += w;
    for (int c = 0; c < d; ++c) merged[c] += w * row[c];
  }
  const float inverse = 1.f / weight_sum;
  for (int c = 0; c < d; ++c) merged[c] *= inverse;
  sink.write_row(problem, b, 0, h, merged, max_lse + std::log(weight_sum));
}

bool decode_lists_apply(const AttentionProblem& problem) {
  return problem.max_seq_q == 1 && problem.dtype != SPARSA_DTYPE_F32 && problem.num_q_heads > 0 &&
         problem.num_q_heads / problem.num_kv_heads <= kMaxStackedRows &&
         select_decode_kernels(problem.head_dim) != nullptr;
}

namespace {

int64_t list_chunks(int64_t max_list_size) { return (max_list_size + kDecodeRangeKeys - 1) / kDecodeRangeKeys; }

// Into how many blocks of kv heads each list slice is cut, when the slices alone would leave workers idle: the count
// (a divisor of kv_per_list) with the fewest rounds of items per slice's worth of work, the fewest blocks among
// equals. A shared TOKEN_SELECT set is one list: at 8K keys two slices, two items for 8-16 workers (its attention
// over I took 0.36-0.43 ms with 8 threads on the 16-core Xeon, dense decode of all 8K keys 0.5 ms); at 32K five,
// where two blocks would leave 6 of 8 workers idle while the last two items ran.
// A head's bits do not depend on the cut (the kernels compute each head's scores and row on their own), so results
// stay the same on any thread count.
int32_t kv_blocks_for(int32_t kv_per_list, int64_t items, int workers) {
  int32_t best = 1;
  double best_rounds = double(items);  // rounds per block's share of the work, in units of one worker's
  for (int32_t blocks = 1; blocks <= kv_per_list; ++blocks) {
    if (kv_per_list % blocks != 0) continue;
    const double rounds = double((items * blocks + workers - 1) / workers) / double(blocks);
    if (rounds < best_rounds) {
      best = blocks;
      best_rounds = rounds;
    }
  }
  return best;
}

}  // namespace

size_t decode_lists_partial_floats(const AttentionProblem& problem, int64_t max_list_size) {
  return size_t(problem.batch) * size_t(std::max<int64_t>(1, list_chunks(max_list_size))) *
         size_t(problem.num_q_heads) * (size_t(problem.head_dim) + 1);
}

void reserve_decode_lists_scratch(const AttentionProblem& problem, int64_t max_list_size, const ExecContext& exec) {
  run_scratch(exec, kRunScratchDecodeRanges).reserve(decode_lists_partial_floats(problem, max_list_size));
  for (int w = 0; w < worker_count(exec); ++w) {
    loop_scratch(exec, w).reserve(decode_keys_floats(problem.head_dim, problem.num_q_heads));
    policy_scratch(exec, w).reserve(size_t(problem.num_q_heads) * (size_t(problem.head_dim) + 1));
  }
}

void run_decode_lists(const AttentionProblem& problem, const DecodeLists& lists, const OutputSink& sink,
                      const ExecContext& exec) {
  const int d = problem.head_dim;
  const int32_t group = problem.num_q_heads / problem.num_kv_heads;
  const int32_t kv_per_list = problem.num_kv_heads / lists.n_lists;
  const int32_t list_heads = kv_per_list * group;
  const size_t row_floats = size_t(d) + 1;  // a row, then its LSE
  const size_t part_floats = size_t(list_heads) * row_floats;
  int64_t max_size = 0;
  for (int64_t i = 0; i < int64_t(problem.batch) * lists.n_lists; ++i) max_size = std::max(max_size, lists.sizes[i]);
  const int64_t chunks = std::max<int64_t>(1, list_chunks(max_size));
  const size_t total = size_t(problem.batch) * size_t(lists.n_lists) * size_t(chunks) * part_floats;
  float* partial = run_scratch(exec, kRunScratchDecodeRanges).reserve(total);
  const auto part_of = [&](int32_t b, int32_t list, int64_t chunk) {
    return partial + ((size_t(b) * lists.n_lists + size_t(list)) * size_t(chunks) + size_t(chunk)) * part_floats;
  };
  const int64_t list_items = int64_t(problem.batch) * lists.n_lists * chunks;
  const int32_t kv_blocks = kv_blocks_for(kv_per_list, list_items, worker_count(exec));
  const int32_t kv_per_block = kv_per_list / kv_blocks, block_heads = kv_per_block * group;
  const auto chunk_item = [&](int64_t item, int worker) {
    const int64_t chunk = item % chunks;
    const int32_t block = int32_t(item / chunks % kv_blocks);
    const int32_t list = int32_t(item / chunks / kv_blocks % lists.n_lists);
    const int32_t b = int32_t(item / chunks / kv_blocks / lists.n_lists);
    const int64_t list_index = int64_t(b) * lists.n_lists + list;
    const int64_t first = chunk * kDecodeRangeKeys;
    const int64_t last = std::min(lists.sizes[list_index], first + kDecodeRangeKeys);
    if (problem.seq_len_q(b) == 0 || first >= last) return;
    ThreadScratch& mine = policy_scratch(exec, worker);
    float* rows = mine.reserve(part_floats);
    float* lse = rows + size_t(block_heads) * d;
    attend_decode_list(problem, b, list * kv_per_list + block * kv_per_block, kv_per_block,
                       lists.keys + list_index * lists.stride + first, last - first,
                       lists.known ? &lists.known[b] : nullptr, rows, lse, &(*exec.counters)[size_t(worker)],
                       loop_scratch(exec, worker));
    float* out = part_of(b, list, chunk) + size_t(block) * size_t(block_heads) * row_floats;
    for (int32_t h = 0; h < block_heads; ++h) {
      std::copy(rows + size_t(h) * d, rows + size_t(h + 1) * d, out + size_t(h) * row_floats);
      out[size_t(h) * row_floats + d] = lse[h];
    }
  };
  parallel_items(exec, list_items * kv_blocks, chunk_item);
  const auto merge_item = [&](int64_t item, int worker) {
    const int32_t b = int32_t(item / problem.num_q_heads);
    const int32_t h = int32_t(item % problem.num_q_heads);
    if (problem.seq_len_q(b) == 0) return;
    const int32_t list = h / list_heads;
    const int64_t size = lists.sizes[int64_t(b) * lists.n_lists + list];
    if (size == 0) {
      sink.write_zero_row(problem, b, 0, h);
      return;
    }
    merge_decode_parts(problem, sink, b, h, part_of(b, list, 0) + size_t(h % list_heads) * row_floats,
                       list_chunks(size), part_floats, policy_scratch(exec, worker).reserve(size_t(d)));
  };
  parallel_items(exec, int64_t(problem.batch) * problem.num_q_heads, merge_item);
}

}  // namespace sparsa::cpu
