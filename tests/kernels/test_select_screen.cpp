// TOKEN_SELECT's fp32 screen (backends/cpu/select_screen.h) against the float64 pipeline it stands in for, written
// here from §6.3 with the CPU's float64 conventions: s = scale · (0 + q̄[0]·K[0] + ...) rounded step by step in
// channel order, m_h = max s, e = std::exp(s − m_h), Z_h = the FixedPointSum of the e, vote = 0 + e_0/Z_0 + ... in
// head order, T = the top_k votes (ties: smaller id). Wherever the screen certifies a sequence its T must be that
// T exactly; the table says where it must certify (peaked attention), so a screen that stopped engaging fails too.
// Cases aim at its edges: exact ties and one-ulp near-ties at the boundary, flat softmaxes, magnitudes that make the
// bounds useless, non-finite keys, head counts that fill the eight-head blocks or leave them part-full, every group
// size and set layout.
#include <gtest/gtest.h>
#include <sparsa/sparsa.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "../../src/common/fixed_point_sum.h"
#include "cpu_convert.h"
#include "cpu_engine.h"
#include "cpu_features.h"
#include "decode_kernels.h"
#include "select_screen.h"
#include "select_screen_rows.h"

namespace sparsa::cpu {
// This executable builds the screen without the attention loop: one worker, items in order.
void ExecContext::parallel_for(int64_t n, const std::function<void(int64_t item, int worker)>& fn) const {
  for (int64_t item = 0; item < n; ++item) fn(item, 0);
}
}  // namespace sparsa::cpu

namespace {

using sparsa::AttentionProblem;
using sparsa::FixedPointSum;
using sparsa::KvLayout;
namespace cpu = sparsa::cpu;

enum class Pattern {
  kRandom,       // N(0, σ) q and K: raw dot products spread ~ σ²·sqrt(D), a peaked softmax
  kSinks,        // random, plus a few keys aligned with every head's query
  kDuplicates,   // random keys in identical pairs: exact ties everywhere, at the boundary too
  kNearTies,     // random keys in pairs one ulp apart in one channel
  kNonFinite,    // random, one key +inf
};

struct ScreenCase {
  const char* name;
  int32_t hq, hkv, d;
  int64_t n;       // candidates
  int64_t top_k;
  bool per_kv_head;
  int32_t dtype;
  Pattern pattern;
  float sigma;
  double scale;
  bool must_certify;  // peaked and well inside the bounds: the screen has to decide it
};

const ScreenCase kCases[] = {
    {"random_g4_d128", 32, 8, 128, 12000, 1500, false, SPARSA_DTYPE_F16, Pattern::kRandom, 1.f, 1.0, true},
    {"random_g4_d128_quarter", 32, 8, 128, 12000, 3000, false, SPARSA_DTYPE_F16, Pattern::kRandom, 1.f, 1.0, true},
    {"random_bf16", 32, 8, 128, 9000, 1100, false, SPARSA_DTYPE_BF16, Pattern::kRandom, 1.f, 1.0, true},
    {"random_g1_d64", 8, 8, 64, 6000, 700, false, SPARSA_DTYPE_F16, Pattern::kRandom, 1.5f, 1.0, true},
    {"random_g2_d256", 16, 8, 256, 5000, 600, false, SPARSA_DTYPE_F16, Pattern::kRandom, 1.f, 1.0, true},
    {"random_g8", 16, 2, 128, 7000, 900, false, SPARSA_DTYPE_F16, Pattern::kRandom, 1.f, 1.0, true},
    {"random_g16", 32, 2, 128, 7000, 900, false, SPARSA_DTYPE_F16, Pattern::kRandom, 1.f, 1.0, true},
    {"per_kv_head_g8", 16, 2, 128, 8000, 1000, true, SPARSA_DTYPE_F16, Pattern::kRandom, 1.f, 1.0, true},
    {"per_kv_head_g4", 32, 8, 128, 6000, 700, true, SPARSA_DTYPE_F16, Pattern::kRandom, 1.f, 1.0, true},
    {"g7_hq28", 28, 4, 128, 6000, 700, false, SPARSA_DTYPE_BF16, Pattern::kRandom, 1.f, 1.0, true},
    {"g6_hq12_per_kv_head", 12, 2, 64, 5000, 600, true, SPARSA_DTYPE_F16, Pattern::kRandom, 1.5f, 1.0, true},
    {"g3_hq12_near_ties", 12, 4, 128, 5000, 601, false, SPARSA_DTYPE_F16, Pattern::kNearTies, 1.f, 1.0, false},
    {"g1_hq4", 4, 4, 256, 4000, 500, false, SPARSA_DTYPE_F16, Pattern::kRandom, 1.f, 1.0, true},
    {"scaled_scores", 32, 8, 128, 8000, 1000, false, SPARSA_DTYPE_F16, Pattern::kRandom, 3.f, 0.08838834764831845,
     true},
    // Scaled scores of spread ~4: a softmax too flat for the heavy lists, which overflow; the float64 pass decides.
    {"scaled_flatter", 32, 8, 128, 8000, 1000, false, SPARSA_DTYPE_F16, Pattern::kRandom, 2.f, 0.08838834764831845,
     false},
    {"sinks", 32, 8, 128, 8000, 1000, false, SPARSA_DTYPE_F16, Pattern::kSinks, 1.f, 1.0, true},
    {"top_1", 16, 4, 128, 4000, 1, false, SPARSA_DTYPE_F16, Pattern::kRandom, 1.f, 1.0, false},
    {"all_but_one", 16, 4, 128, 3000, 2999, false, SPARSA_DTYPE_F16, Pattern::kRandom, 1.f, 1.0, false},
    {"duplicates", 16, 4, 128, 6000, 701, false, SPARSA_DTYPE_F16, Pattern::kDuplicates, 1.f, 1.0, false},
    {"duplicates_even", 16, 4, 128, 6000, 700, false, SPARSA_DTYPE_F16, Pattern::kDuplicates, 1.f, 1.0, false},
    {"near_ties", 16, 4, 128, 6000, 701, false, SPARSA_DTYPE_F16, Pattern::kNearTies, 1.f, 1.0, false},
    {"near_ties_bf16", 16, 4, 64, 6000, 701, false, SPARSA_DTYPE_BF16, Pattern::kNearTies, 1.f, 1.0, false},
    {"flat", 16, 4, 128, 6000, 700, false, SPARSA_DTYPE_F16, Pattern::kRandom, 0.05f, 1.0, false},
    {"huge", 16, 4, 128, 3000, 300, false, SPARSA_DTYPE_F16, Pattern::kRandom, 200.f, 1.0, false},
    {"non_finite", 16, 4, 128, 3000, 300, false, SPARSA_DTYPE_F16, Pattern::kNonFinite, 1.f, 1.0, false},
};

uint16_t to_bits(int32_t dtype, float x) { return dtype == SPARSA_DTYPE_F16 ? cpu::float_to_f16(x) : cpu::float_to_bf16(x); }
float from_bits(int32_t dtype, uint16_t h) { return dtype == SPARSA_DTYPE_F16 ? cpu::f16_to_float(h) : cpu::bf16_to_float(h); }

struct Inputs {
  std::vector<uint16_t> k;   // [n, hkv, d]
  std::vector<double> qbar;  // [hq, d], every element a 16-bit value widened (a decode's q̄)
};

Inputs make_inputs(const ScreenCase& c, std::mt19937_64& rng) {
  std::normal_distribution<float> normal(0.f, c.sigma);
  Inputs in;
  in.k.resize(size_t(c.n) * c.hkv * c.d);
  in.qbar.resize(size_t(c.hq) * c.d);
  for (double& x : in.qbar) x = from_bits(c.dtype, to_bits(c.dtype, normal(rng)));
  for (uint16_t& x : in.k) x = to_bits(c.dtype, normal(rng));
  const auto key = [&](int64_t t, int32_t hk) { return in.k.data() + (size_t(t) * c.hkv + hk) * c.d; };
  switch (c.pattern) {
    case Pattern::kRandom:
      break;
    case Pattern::kSinks:
      for (int64_t t : {int64_t(0), int64_t(1), c.n / 2})
        for (int32_t hk = 0; hk < c.hkv; ++hk)
          for (int32_t i = 0; i < c.d; ++i)
            key(t, hk)[i] = to_bits(c.dtype, float(2.0 * in.qbar[size_t(hk) * (c.hq / c.hkv) * c.d + i]));
      break;
    case Pattern::kDuplicates:
      for (int64_t t = 1; t < c.n; t += 2) std::copy(key(t - 1, 0), key(t, 0), key(t, 0));
      break;
    case Pattern::kNearTies:
      for (int64_t t = 1; t < c.n; t += 2) {
        std::copy(key(t - 1, 0), key(t, 0), key(t, 0));
        for (int32_t hk = 0; hk < c.hkv; ++hk) key(t, hk)[rng() % c.d] ^= 1;  // one ulp in one channel
      }
      break;
    case Pattern::kNonFinite:
      key(c.n / 3, 0)[0] = c.dtype == SPARSA_DTYPE_F16 ? 0x7c00 : 0x7f80;
      break;
  }
  return in;
}

// The float64 pipeline's T per set (ascending).
std::vector<std::vector<int64_t>> float64_selection(const ScreenCase& c, const Inputs& in) {
  const int32_t g = c.hq / c.hkv;
  std::vector<double> s(size_t(c.hq) * c.n);
  for (int32_t h = 0; h < c.hq; ++h)
    for (int64_t t = 0; t < c.n; ++t) {
      const uint16_t* k = in.k.data() + (size_t(t) * c.hkv + h / g) * c.d;
      double sum = 0.0;
      for (int32_t i = 0; i < c.d; ++i) sum = sum + in.qbar[size_t(h) * c.d + i] * double(from_bits(c.dtype, k[i]));
      s[size_t(h) * c.n + t] = c.scale * sum;
    }
  std::vector<double> z(c.hq);
  for (int32_t h = 0; h < c.hq; ++h) {
    double* row = s.data() + size_t(h) * c.n;
    double m = -std::numeric_limits<double>::infinity();
    for (int64_t t = 0; t < c.n; ++t) m = std::max(m, row[t]);
    FixedPointSum sum;
    for (int64_t t = 0; t < c.n; ++t) {
      row[t] = std::exp(row[t] - m);
      sum.add(row[t]);
    }
    z[h] = sum.value();
  }
  const int32_t n_sets = c.per_kv_head ? c.hkv : 1, nh = c.hq / n_sets;
  std::vector<std::vector<int64_t>> sets;
  for (int32_t set = 0; set < n_sets; ++set) {
    std::vector<double> vote(c.n, 0.0);
    for (int64_t t = 0; t < c.n; ++t)
      for (int32_t h = set * nh; h < (set + 1) * nh; ++h) vote[t] = vote[t] + s[size_t(h) * c.n + t] / z[h];
    std::vector<int64_t> order(c.n);
    std::iota(order.begin(), order.end(), int64_t{0});
    std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t b) { return vote[a] > vote[b]; });
    order.resize(c.top_k);
    std::sort(order.begin(), order.end());
    sets.push_back(order);
  }
  return sets;
}

struct ScreenRun {
  bool certified = false;
  std::vector<std::vector<int64_t>> sets;
  std::vector<float> scores;  // [n, hq]: the scores the screen hands on (certified runs)
};

// The screen on one sequence: padded K [1, n, hkv, d], candidates starting at first_candidate.
ScreenRun run_screen(const ScreenCase& c, const Inputs& in, int64_t first_candidate) {
  const int64_t total = first_candidate + c.n;
  std::vector<uint16_t> k(size_t(total) * c.hkv * c.d, 0);
  std::copy(in.k.begin(), in.k.end(), k.begin() + size_t(first_candidate) * c.hkv * c.d);
  AttentionProblem p;
  p.batch = 1;
  p.num_q_heads = c.hq;
  p.num_kv_heads = c.hkv;
  p.head_dim = c.d;
  p.dtype = c.dtype;
  p.max_seq_q = 1;
  p.max_seq_k = total;
  p.kv_layout = KvLayout::kPadded;
  p.k.present = true;
  p.k.t.data = k.data();
  p.k.t.ndim = 4;
  const int64_t shape[4] = {1, total, c.hkv, c.d};
  const int64_t strides[4] = {total * c.hkv * c.d, int64_t(c.hkv) * c.d, c.d, 1};
  for (int i = 0; i < 4; ++i) {
    p.k.t.shape[i] = shape[i];
    p.k.t.strides[i] = strides[i];
  }
  cpu::ScreenRequest request;
  request.top_k = c.top_k;
  request.n_sets = c.per_kv_head ? c.hkv : 1;
  request.heads_per_set = c.hq / request.n_sets;
  request.score_scale = c.scale;
  cpu::ScreenSequence seq{first_candidate, c.n, true};
  std::vector<cpu::ThreadScratch> scratch(cpu::scratch_slots_for(1));
  std::vector<cpu::RunCounters> counters(1);
  cpu::ExecContext exec;
  exec.scratch = &scratch;
  exec.counters = &counters;
  std::vector<int64_t> selections(size_t(request.n_sets) * c.top_k, -7);
  unsigned char certified = 2;
  const float* scores = reinterpret_cast<const float*>(&certified);  // overwritten: null or the scores
  cpu::screen_selections(p, request, &seq, in.qbar.data(), exec, selections.data(), request.n_sets * c.top_k,
                         c.top_k, &certified, &scores);
  ScreenRun run;
  EXPECT_LE(certified, 1);
  run.certified = certified == 1;
  EXPECT_EQ(scores != nullptr, run.certified);
  if (run.certified && scores) run.scores.assign(scores, scores + size_t(c.n) * c.hq);
  for (int32_t set = 0; set < request.n_sets; ++set) {
    std::vector<int64_t> ids(selections.begin() + set * c.top_k, selections.begin() + (set + 1) * c.top_k);
    for (int64_t& id : ids) id -= first_candidate;
    run.sets.push_back(ids);
  }
  return run;
}

// The scores a certified run hands on (for the attention over T) are fp32 dot products of scale·q̄ with K: each
// within the classic bound of the float64 score, |ŝ − s| <= |scale|·Σ|q̄·K|·(D + 8)·2^-23 (and below the normal
// range an absolute 2^-148 per term).
void expect_scores_within_their_bound(const ScreenCase& c, const Inputs& in, const std::vector<float>& scores) {
  const int32_t g = c.hq / c.hkv;
  ASSERT_EQ(scores.size(), size_t(c.n) * c.hq);
  int64_t outside = 0;
  for (int64_t t = 0; t < c.n; ++t)
    for (int32_t h = 0; h < c.hq; ++h) {
      const uint16_t* k = in.k.data() + (size_t(t) * c.hkv + h / g) * c.d;
      double sum = 0.0, magnitude = 0.0;
      for (int32_t i = 0; i < c.d; ++i) {
        const double product = in.qbar[size_t(h) * c.d + i] * double(from_bits(c.dtype, k[i]));
        sum += product;
        magnitude += std::fabs(product);
      }
      const double bound = std::fabs(c.scale) * magnitude * double(c.d + 8) * 0x1p-23 + double(c.d + 8) * 0x1p-148;
      if (!(std::fabs(double(scores[size_t(t) * c.hq + h]) - c.scale * sum) <= bound)) ++outside;
    }
  EXPECT_EQ(outside, 0);
}

TEST(SelectScreen, CertifiedSelectionsAreTheFloat64Ones) {
  int certified_cases = 0, ran = 0;
  for (const ScreenCase& c : kCases) {
    if (!cpu::select_decode_kernels(c.d)) continue;
    SCOPED_TRACE(c.name);
    for (int seed = 0; seed < 3; ++seed) {
      std::mt19937_64 rng(0x5e1ec7 + seed * 7919 + c.n);
      const Inputs in = make_inputs(c, rng);
      const ScreenRun run = run_screen(c, in, /*first_candidate=*/seed * 5);
      ++ran;
      if (c.must_certify) {
        EXPECT_TRUE(run.certified) << "seed " << seed;
      }
      if (c.pattern == Pattern::kNonFinite) {
        EXPECT_FALSE(run.certified) << "seed " << seed;
      }
      if (!run.certified) continue;
      ++certified_cases;
      const std::vector<std::vector<int64_t>> want = float64_selection(c, in);
      ASSERT_EQ(run.sets.size(), want.size());
      for (size_t set = 0; set < want.size(); ++set) EXPECT_EQ(run.sets[set], want[set]) << "seed " << seed << " set " << set;
      expect_scores_within_their_bound(c, in, run.scores);
    }
  }
  if (ran == 0) GTEST_SKIP() << "no decode kernel version on this CPU or build";
  EXPECT_GT(certified_cases, 0);
}

// The screen takes a sequence only when every q̄ element is a finite float value (then its products with K are
// exact in float64); scaled_floats decides it, four lanes at a time with a scalar tail on x86.
TEST(SelectScreen, ScaledFloatsTellsFloatValuesApart) {
#if defined(__x86_64__)
  if (!cpu::cpu_features().avx2) GTEST_SKIP() << "the x86 row loops need AVX2";
#endif
  const double kFloatMax = double(std::numeric_limits<float>::max());
  const double specials[] = {0.1,  std::nan(""), HUGE_VAL, -HUGE_VAL, 1e300,          3.5e38, 0x1p-150,
                             -0.0, kFloatMax,   -kFloatMax, 0x1p-149, double(0.1f)};
  const auto is_float = [&](double x) { return std::fabs(x) <= kFloatMax && double(float(x)) == x; };
  const double scale = 0.08838834764831845;
  std::mt19937_64 rng(11);
  std::normal_distribution<float> normal;
  for (int64_t n = 0; n <= 11; ++n)
    for (int64_t at = -1; at < n; ++at)
      for (const double special : specials) {
        std::vector<double> values(static_cast<size_t>(n));
        for (double& x : values) x = double(normal(rng));
        if (at >= 0) values[size_t(at)] = special;
        std::vector<float> scaled(static_cast<size_t>(n), -1.f);
        const bool want = std::all_of(values.begin(), values.end(), is_float);
        ASSERT_EQ(cpu::screen_rows::scaled_floats(values.data(), n, scale, scaled.data()), want)
            << "n " << n << " at " << at << " value " << special;
        if (!want) continue;
        for (int64_t i = 0; i < n; ++i) EXPECT_EQ(scaled[size_t(i)], float(scale * values[size_t(i)])) << i;
      }
}

TEST(SelectScreen, ExpIsWithinItsStatedError) {
  double worst = 0.0;
  for (int i = 0; i <= 2000000; ++i) {
    const float x = -87.f * float(i) / 2000000.f;
    const double want = std::exp(double(x));
    worst = std::max(worst, std::fabs(double(cpu::screen_exp(x)) - want) / want);
  }
  EXPECT_LT(worst, cpu::kScreenExpError);
  EXPECT_EQ(cpu::screen_exp(0.f), 1.f);
  EXPECT_GT(cpu::screen_exp(-1000.f), 0.f);  // clamped, never zero: an upper bound stays an upper bound
  EXPECT_LE(double(cpu::screen_exp(-87.f)), 0x1p-125);  // what the screen takes a clamped term to be at most
}

}  // namespace
