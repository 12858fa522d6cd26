// Where normalised rows go: the caller's out/lse tensors (converted to out's dtype) or Δ's fp32 staging buffer.
#include <limits>

#include "attention_loop.h"
#include "cpu_engine.h"

namespace sparsa::cpu {

void OutputSink::write_row(const AttentionProblem& problem, int32_t b, int64_t i, int32_t h, const float* row,
                           float lse) const {
  const int d = problem.head_dim;
  if (staging) {
    const int64_t slot = staging_row(problem, b, i) * problem.num_q_heads + h;
    float* dst = staging + slot * d;
    for (int c = 0; c < d; ++c) dst[c] = row[c];
    if (staging_lse) staging_lse[slot] = lse;
    return;
  }
  store_row(problem.dtype, problem.out.t.data, problem.q_offset(problem.out, b, i, h), d, row);
  if (problem.lse.present) problem.lse.ptr<float>()[problem.lse_offset(b, i, h)] = lse;
}

void OutputSink::write_zero_row(const AttentionProblem& problem, int32_t b, int64_t i, int32_t h) const {
  const int d = problem.head_dim;
  constexpr int kChunk = 64;
  const float zeros[kChunk] = {};
  const float lse = -std::numeric_limits<float>::infinity();
  if (staging) {
    const int64_t slot = staging_row(problem, b, i) * problem.num_q_heads + h;
    float* dst = staging + slot * d;
    for (int c = 0; c < d; ++c) dst[c] = 0.f;
    if (staging_lse) staging_lse[slot] = lse;
    return;
  }
  const int64_t offset = problem.q_offset(problem.out, b, i, h);
  for (int c = 0; c < d; c += kChunk) {
    const int n = d - c < kChunk ? d - c : kChunk;
    store_row(problem.dtype, problem.out.t.data, offset + c, n, zeros);
  }
  if (problem.lse.present) problem.lse.ptr<float>()[problem.lse_offset(b, i, h)] = lse;
}

}  // namespace sparsa::cpu
