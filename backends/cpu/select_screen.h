// TOKEN_SELECT's fp32 screen (select_screen.cpp): the oracle's selection T (§6.3, scored in float64, §0) for a decode
// on a 16-bit KV cache, found from fp32 scores with certified error bounds, with float64 only where the bounds
// cannot decide. A sequence the screen cannot certify is left to the float64 pass (cpu_token_select.cpp), so the
// selection is always the float64 one, bit for bit; the screen only makes it cheaper.
#pragma once

#include <cstddef>
#include <cstdint>

#include "../../src/problem.h"
#include "attention_loop.h"

namespace sparsa::cpu {

// What TOKEN_SELECT asks for: top_k candidates per set; n_sets sets of heads_per_set consecutive query heads;
// s = score_scale · q̄·k.
struct ScreenRequest {
  int64_t top_k = 0;
  int32_t n_sets = 1;
  int32_t heads_per_set = 1;
  double score_scale = 1.0;
};

// One sequence: its candidates C = [first_candidate, first_candidate + n_candidates) and whether T is wanted.
struct ScreenSequence {
  int64_t first_candidate = 0;
  int64_t n_candidates = 0;
  bool wanted = false;
};

// True when the screen can run on this problem: fp16 or bf16 K with the dense decode kernels for its head dim (so
// AVX2 + FMA at least), at most 64 kv heads and 4096 query heads, and its fp32 scores ([B, Hq, max_candidates])
// within 64 MiB (their exps take as much again).
bool selection_screen_applies(const AttentionProblem& problem, const ScreenRequest& request, int64_t max_candidates);

// Floats of run scratch (slot kRunScratchSelectionScreen) screen_selections needs.
size_t selection_screen_scratch_floats(const AttentionProblem& problem, const ScreenRequest& request,
                                       int64_t max_candidates);

// Floats of policy scratch each worker needs.
size_t selection_screen_worker_floats(const AttentionProblem& problem, int64_t max_candidates);

// For every wanted sequence b whose q̄ are floats (every decode): tries to certify T. On success writes, for each
// set, its top_k candidate ids (ascending, positions in the sequence: first_candidate added) to
// selections[b * selection_len + set * set_stride ...] and sets certified[b] = 1; otherwise certified[b] = 0 and
// b's selections hold nothing of use (some sets may have been written). concat_qbars: [B, Hq·D] float64.
// scores [B]: for a certified b, the fp32 scores the screen computed, fp32(score_scale · q̄)·K by the dense decode
// kernels, row t − first_candidate holding candidate t's Hq values; null for the others. They stay in the run
// scratch until the next call, so the attention over T need not score its candidates again.
void screen_selections(const AttentionProblem& problem, const ScreenRequest& request,
                       const ScreenSequence* sequences, const double* concat_qbars, const ExecContext& exec,
                       int64_t* selections, int64_t selection_len, int64_t set_stride, unsigned char* certified,
                       const float** scores);

// The screen's exp (the eight-lane AVX2 + FMA version where the CPU has it, as the row loops use it) for x <= 0,
// clamped at -87: relative error below kScreenExpError, which tests/kernels checks against std::exp in float64 (the
// screen's bounds assume 2^-12, with room for the fp32 argument's rounding).
float screen_exp(float x);
constexpr double kScreenExpError = 1.0 / (1 << 16);

}  // namespace sparsa::cpu
