// §4 SPARGE, the run: for each (sequence b, query head h) predict the block mask (sparge_predict_mask, another
// file), optionally write it to block_mask_out, then walk each query block's kept key blocks in ascending order
// with the element-wise causal mask inside diagonal blocks, the per-head λ PV skip (§4.7) and, when asked, the
// int8 Q·Kᵀ emulation of the quantized path (K centred by its per-sequence mean). Memory per item is
// O(nqb·nkb + D + block_q·D): block masks, never token pairs.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>

#include "attention_loop.h"
#include "cpu_engine.h"

namespace sparsa::cpu {
namespace {

// Mean over the sequence's tokens of kv head hk's keys (§4.1), accumulated in float64.
void key_mean(const AttentionProblem& problem, int32_t b, int32_t hk, float* row, double* sum, float* mean) {
  const int d = problem.head_dim;
  const int64_t seq_k = problem.seq_len_k(b);
  for (int c = 0; c < d; ++c) sum[c] = 0.0;
  // The mean only centres K (any centre gives the same softmax; q·mean goes back into the LSE), so rows holding
  // NaN/Inf are left out: they poison only the rows that see them, not the centre every row uses.
  int64_t finite_rows = 0;
  for (int64_t t = 0; t < seq_k; ++t) {
    load_row_f32(problem.dtype, problem.k.t.data, problem.kv_offset(problem.k, b, t, hk), d, row);
    bool finite = true;
    for (int c = 0; c < d; ++c) finite = finite && std::isfinite(row[c]);
    if (!finite) continue;
    for (int c = 0; c < d; ++c) sum[c] += row[c];
    ++finite_rows;
  }
  for (int c = 0; c < d; ++c) mean[c] = finite_rows > 0 ? float(sum[c] / double(finite_rows)) : 0.f;
}

// Copies sequence b's mask [nqb, nkb] into block_mask_out [B, Hq, max_nqb, max_nkb], zero outside the sequence.
void write_block_mask(const TensorArg& out, int32_t b, int32_t h, const uint8_t* mask, int64_t nqb, int64_t nkb) {
  // Offsets, not pointers: an output with no element may have no data, and null + offset is undefined.
  uint8_t* data = out.ptr<uint8_t>();
  const int64_t base = b * out.stride(0) + h * out.stride(1);
  for (int64_t i = 0; i < out.extent(2); ++i)
    for (int64_t j = 0; j < out.extent(3); ++j)
      data[base + i * out.stride(2) + j * out.stride(3)] = (i < nqb && j < nkb) ? mask[i * nkb + j] : 0;
}

}  // namespace

void run_sparge(const AttentionProblem& problem, const PolicyParams& policy, const OutputSink& sink,
                const ExecContext& exec) {
  const int d = problem.head_dim;
  const int32_t block_q = policy.p.block_q;
  const int32_t block_k = policy.p.block_k;
  const bool quantized = policy.p.sparge_quantized != 0;
  const int64_t items = int64_t(problem.batch) * problem.num_q_heads;
  const auto work_item = [&](int64_t item, int worker) {
    const int32_t b = int32_t(item / problem.num_q_heads);
    const int32_t h = int32_t(item % problem.num_q_heads);
    const int64_t seq_q = problem.seq_len_q(b);
    const int64_t seq_k = problem.seq_len_k(b);
    const int64_t nqb = (seq_q + block_q - 1) / block_q;
    const int64_t nkb = (seq_k + block_k - 1) / block_k;

    // Policy scratch: mask | ids | key-mean sums (f64) | key mean | a K row | output rows | lse.
    ThreadScratch& mine = policy_scratch(exec, worker);
    const size_t mask_floats = scratch_floats<uint8_t>(size_t(nqb * nkb));
    const size_t ids_floats = scratch_floats<int32_t>(size_t(nkb));
    const size_t sum_floats = scratch_floats<double>(size_t(d));
    const size_t row_floats = scratch_floats<float>(size_t(d));
    const size_t head = mask_floats + ids_floats + sum_floats + 2 * row_floats;
    const int64_t block_rows = std::min<int64_t>(block_q, seq_q);  // scratch follows the problem, not block_q
    mine.reserve(head + size_t(block_rows) * (d + 1));
    uint8_t* mask = scratch_array<uint8_t>(mine, 0, size_t(nqb * nkb));
    int32_t* ids = scratch_array<int32_t>(mine, mask_floats, size_t(nkb));
    double* sums = scratch_array<double>(mine, mask_floats + ids_floats, size_t(d));
    float* mean = mine.buffer.data() + mask_floats + ids_floats + sum_floats;
    float* k_row = mean + row_floats;
    float* rows = mine.buffer.data() + head;
    float* lse = rows + size_t(block_rows) * d;

    if (nqb > 0 && nkb > 0) sparge_predict_mask(problem, policy, b, h, mask, loop_scratch(exec, worker));
    if (problem.block_mask_out.present) write_block_mask(problem.block_mask_out, b, h, mask, nqb, nkb);
    if (quantized) key_mean(problem, b, kv_head_of(problem, h), k_row, sums, mean);

    BlockWalk walk;
    walk.key_blocks = ids;
    walk.block_k = block_k;
    walk.pv_skip_lambda = float(sparge_head_params(policy, h).lambda);
    walk.quantized_qk = quantized;
    walk.quant_block_q = block_q;
    walk.k_mean = quantized ? mean : nullptr;
    const RowVisibility vis = causal_visibility(problem, b);
    for (int64_t q_block = 0; q_block < nqb; ++q_block) {
      walk.n_key_blocks = 0;
      for (int64_t j = 0; j < nkb; ++j)
        if (mask[q_block * nkb + j]) ids[walk.n_key_blocks++] = int32_t(j);
      const int64_t row_begin = q_block * block_q;
      const int64_t row_end = std::min(seq_q, row_begin + block_q);
      attend_block_walk(problem, b, h, row_begin, row_end, walk, vis, rows, lse, &(*exec.counters)[worker],
                        loop_scratch(exec, worker));
      for (int64_t r = 0; r < row_end - row_begin; ++r)
        sink.write_row(problem, b, row_begin + r, h, rows + r * d, lse[r]);
    }
  };
  parallel_items(exec, items, work_item);
}

}  // namespace sparsa::cpu
