// The row loops of TOKEN_SELECT's fp32 screen (select_screen.cpp): passes over its [candidates, Hq] fp32 rows of
// scores ŝ or exps ê, and the largest |K| of a tile of keys. AVX2 + FMA, eight heads at a time, where the CPU has
// them (the screen runs only where the decode kernels do, so on CPUs with both); plain loops elsewhere.
#pragma once

#include <cstdint>

namespace sparsa::cpu::screen_rows {

constexpr double kHeavyShare = 1.0 / (1 << 18);  // ê >= kHeavyShare · Σ ê: heavy, scored exactly in step 6
constexpr float kLowestArgument = -87.f;         // the exp's clamp: ê >= exp(-87), still a normal float
constexpr int32_t kMaxKvHeads = 64;
constexpr int32_t kMaxHeadsPerSet = 1 << 12;  // and query heads

// Rows [t][hq]: each head's maximum maxed into maxes; false when a score is not finite.
bool row_maxima(const float* rows, int64_t n_rows, int32_t hq, float* maxes);
// Rows [t][hq]: ê = exp(ŝ − m̂_h) into exps, each head's fp32 sum into sums.
void row_exps(const float* rows, float* exps, int64_t n_rows, int32_t hq, const float* maxes, float* sums);
// Whether every one of values[0..n) is a finite float value, and scaled[i] = fp32(scale · values[i]) (scaled is
// only meaningful where they all are).
bool scaled_floats(const double* values, int64_t n, double scale, float* scaled);
// Rows [t][hq]: per head, how many rows reach cuts[h].
void row_counts_reaching(const float* rows, int64_t n_rows, int32_t hq, const float* cuts, int64_t* counts);
// Rows [t][hq], heads [first, first + nh): lo[t] = Σ ê·lo_coef, hi[t] = Σ ê·hi_coef in fp32.
void row_votes(const float* rows, int64_t n_rows, int32_t hq, int32_t first, int32_t nh, const float* lo_coef,
               const float* hi_coef, float* lo, float* hi);
// Rows [first_row, first_row + n_rows) of [t][hq], heads [first, first + nh) in kv groups of g: light[i] = fp32 Σ
// of head first + i's ê below its cut, and each row with an ê at or above its head's cut appended to that head's kv
// list (heavy + kv · stride, count in n_heavy[kv]); false when a list would pass capacity. nh <= kMaxHeadsPerSet,
// nh / g <= kMaxKvHeads. light and n_heavy are written once, at the end: neighbouring chunks' sums share cache lines,
// and adding to them row by row made the workers of the 16-core Xeon fight over those lines (8 threads, 8K keys:
// the step took 430-620 us of work against about 80 us on one thread).
bool row_split(const float* rows, int64_t first_row, int64_t n_rows, int32_t hq, int32_t first, int32_t nh,
               int32_t g, const float* cut, float* light, int32_t* heavy, int64_t stride, int64_t* n_heavy,
               int64_t capacity);
// exp(x) for x <= 0 as the row loops compute it (clamped at kLowestArgument).
float exp_lane(float x);

}  // namespace sparsa::cpu::screen_rows
