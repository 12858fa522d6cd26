// TOKEN_SELECT's softmax statistics and vote kernels (backends/cpu/select_softmax.h), every version this CPU, build
// and C library allow, against the plain loops bit for bit: m_h = the std::max fold, e = std::exp(s − m_h), Z_h as a
// FixedPointSum (all its digits), vote[c] = 0 + e/Z + ... in head order. The inputs reach every entry of the exp
// table, the ends of glibc's main range (|x| near 2^-54 and 512), underflow to 0, exact maxima (exp(0) = 1), NaN
// scores, and groups whose heads do not line up with the vector lanes.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <random>
#include <vector>

#include "select_softmax.h"
#include "../../src/common/glibc_exp.h"

namespace {

using sparsa::FixedPointSum;
using sparsa::cpu::SelectSoftmaxKernel;

// Every version this process can run: the portable loops always (trivially their own oracle, so the tests also run
// where no vector version exists), then AVX2 and AVX-512F where the CPU, the build and the C library allow them.
std::vector<const SelectSoftmaxKernel*> kernels_present() {
  std::vector<const SelectSoftmaxKernel*> kernels = {&sparsa::cpu::portable_select_softmax_kernel()};
  if (const SelectSoftmaxKernel* k = sparsa::cpu::avx2_select_softmax_kernel()) kernels.push_back(k);
  if (const SelectSoftmaxKernel* k = sparsa::cpu::avx512_select_softmax_kernel()) kernels.push_back(k);
  return kernels;
}

bool same_bits(double a, double b) { return std::memcmp(&a, &b, sizeof a) == 0; }

void expect_same_sum(const FixedPointSum& got, const FixedPointSum& want, const char* what) {
  int64_t a[FixedPointSum::kDigits], b[FixedPointSum::kDigits];
  got.to_digits(a);
  want.to_digits(b);
  for (int i = 0; i < FixedPointSum::kDigits; ++i) EXPECT_EQ(a[i], b[i]) << what << ", digit " << i;
}

// Scores of one kv head's `group` query heads, [n_candidates, group], with their maxima (as the backend takes them).
struct HeadScores {
  std::vector<double> scores;
  std::vector<double> maxes;
};

HeadScores make_scores(std::mt19937_64& rng, int32_t group, int64_t n_candidates, double spread, bool specials) {
  HeadScores h;
  h.scores.resize(size_t(group * n_candidates));
  std::uniform_real_distribution<double> uniform(-spread, spread);
  for (double& s : h.scores) s = uniform(rng);
  if (specials) {
    const double nan = std::numeric_limits<double>::quiet_NaN();
    const int64_t n = int64_t(h.scores.size());
    for (int64_t i = 0; i < n; i += 97) h.scores[size_t(i)] = h.scores[size_t(i) % size_t(group)];  // ties the max
    if (n > 5) h.scores[5] = nan;
    if (n > 11) h.scores[11] = -std::numeric_limits<double>::infinity();
  }
  h.maxes.assign(size_t(group), -INFINITY);
  for (size_t i = 0; i < h.scores.size(); ++i) {
    double& m = h.maxes[i % size_t(group)];
    m = std::max(m, h.scores[i]);
  }
  if (specials) {  // values just off each max: |x| near 2^-54 (where exp rounds to 1) and near 512
    const int64_t n = int64_t(h.scores.size());
    for (int64_t i = 3; i < n; i += 61) {
      const double m = h.maxes[size_t(i % group)];
      const double offsets[] = {0x1p-54, 0x1.8p-54, 0x1p-53, 511.99999999999994, 512.0, 700.0, 800.0};
      h.scores[size_t(i)] = m - offsets[size_t(i / 61) % std::size(offsets)];
    }
  }
  return h;
}

TEST(SelectSoftmax, ExpAndSumMatchTheStdExpLoopBitForBit) {
  const std::vector<const SelectSoftmaxKernel*> kernels = kernels_present();
  std::mt19937_64 rng(20261125);
  struct Case {
    int32_t group;
    int64_t n_candidates;
    double spread;  // scores uniform in ±spread: from softmax-like to deep underflow
    bool specials;
  };
  const Case cases[] = {{4, 4096, 8.0, false},  {4, 4099, 40.0, true}, {1, 1001, 30.0, true},
                        {2, 517, 300.0, true},  {3, 999, 20.0, true},  {5, 333, 50.0, true},
                        {6, 128, 5.0, true},    {7, 777, 400.0, true}, {8, 1000, 60.0, true},
                        {12, 257, 15.0, true},  {16, 64, 10.0, true},  {65, 40, 10.0, true},
                        {4, 3, 10.0, false},    {4, 0, 1.0, false}};
  for (const Case& c : cases) {
    const HeadScores h = make_scores(rng, c.group, c.n_candidates, c.spread, c.specials);
    std::vector<double> want = h.scores;
    std::vector<FixedPointSum> want_sums(size_t(c.group));
    sparsa::cpu::portable_select_softmax_kernel().exp_and_sum(want.data(), int64_t(want.size()), c.group,
                                                              h.maxes.data(), want_sums.data());
    for (size_t i = 0; i < want.size(); ++i) {  // the portable loop is the plain one
      const double plain = std::exp(h.scores[i] - h.maxes[i % size_t(c.group)]);
      ASSERT_TRUE(same_bits(want[i], plain) || (std::isnan(plain) && std::isnan(want[i])));
    }
    for (const SelectSoftmaxKernel* kernel : kernels) {
      SCOPED_TRACE(testing::Message() << kernel->name << " group " << c.group << " candidates " << c.n_candidates);
      std::vector<double> got = h.scores;
      std::vector<FixedPointSum> got_sums(size_t(c.group));
      kernel->exp_and_sum(got.data(), int64_t(got.size()), c.group, h.maxes.data(), got_sums.data());
      int64_t differing = 0;
      for (size_t i = 0; i < got.size(); ++i)
        differing += !(same_bits(got[i], want[i]) || (std::isnan(got[i]) && std::isnan(want[i])));
      EXPECT_EQ(differing, 0);
      for (int32_t l = 0; l < c.group; ++l) expect_same_sum(got_sums[size_t(l)], want_sums[size_t(l)], "Z_h");
    }
  }
}

// The maxima, bit for bit with the std::max fold in index order: NaN never wins, and where a head's maximum is a zero
// the fold's own zero (the first of −0 / +0 it meets keeps its place against the other) is kept.
TEST(SelectSoftmax, MaxPerHeadMatchesTheStdMaxFold) {
  const std::vector<const SelectSoftmaxKernel*> kernels = kernels_present();
  std::mt19937_64 rng(3);
  std::uniform_real_distribution<double> uniform(-50.0, 50.0);
  const double nan = std::numeric_limits<double>::quiet_NaN();
  const double inf = std::numeric_limits<double>::infinity();
  for (int32_t group : {1, 2, 3, 4, 5, 7, 8, 12, 16, 65}) {
    for (int64_t n_candidates : {int64_t(0), int64_t(1), int64_t(13), int64_t(1000)}) {
      for (int variant = 0; variant < 4; ++variant) {
        std::vector<double> values(size_t(group * n_candidates));
        for (size_t i = 0; i < values.size(); ++i) {
          switch (variant) {
            case 0: values[i] = uniform(rng); break;
            case 1: values[i] = (i % 7 == 0) ? (i % 2 ? 0.0 : -0.0) : -std::abs(uniform(rng)); break;
            case 2: values[i] = (i % 5 == 0) ? nan : uniform(rng); break;
            default: values[i] = (i % 3 == 0) ? -inf : ((i % 3 == 1) ? nan : -0.0); break;
          }
        }
        std::vector<double> want(static_cast<size_t>(group));
        for (int32_t l = 0; l < group; ++l) {
          double m = -INFINITY;
          for (size_t i = size_t(l); i < values.size(); i += size_t(group)) m = std::max(m, values[i]);
          want[size_t(l)] = m;
        }
        for (const SelectSoftmaxKernel* kernel : kernels) {
          std::vector<double> got(static_cast<size_t>(group), 1.0);
          kernel->max_per_head(values.data(), int64_t(values.size()), group, got.data());
          for (int32_t l = 0; l < group; ++l)
            EXPECT_TRUE(same_bits(got[size_t(l)], want[size_t(l)]))
                << kernel->name << " group " << group << " candidates " << n_candidates << " variant " << variant
                << " head " << l << ": " << got[size_t(l)] << " vs " << want[size_t(l)];
        }
      }
    }
  }
}

// Millions of arguments over the whole negative main range and below: each exp is std::exp's bits.
TEST(SelectSoftmax, ExpEqualsStdExpOverTheNegativeRange) {
  const std::vector<const SelectSoftmaxKernel*> kernels = kernels_present();
  constexpr int64_t kArguments = int64_t(1) << 21;
  std::vector<double> x(static_cast<size_t>(kArguments));
  std::mt19937_64 rng(7);
  for (int64_t i = 0; i < kArguments; ++i) {
    const double unit = double(rng() >> 11) * 0x1p-53;
    // a quarter log-uniform over [2^-60, 2^10), the rest uniform over [−64, 0]
    x[size_t(i)] = i % 4 == 0 ? -std::exp2(-60.0 + 70.0 * unit) : -64.0 * unit;
  }
  std::vector<double> want(x.size());
  for (size_t i = 0; i < x.size(); ++i) want[i] = std::exp(x[i]);
  const double zero = 0.0;
  for (const SelectSoftmaxKernel* kernel : kernels) {
    std::vector<double> got = x;
    FixedPointSum sum;
    kernel->exp_and_sum(got.data(), kArguments, 1, &zero, &sum);
    int64_t differing = 0;
    for (size_t i = 0; i < x.size(); ++i) differing += !same_bits(got[i], want[i]);
    EXPECT_EQ(differing, 0) << kernel->name;
  }
}

TEST(SelectSoftmax, VoteMatchesTheHeadOrderLoopBitForBit) {
  std::mt19937_64 rng(11);
  std::uniform_real_distribution<double> unit(0.0, 1.0);
  struct Case {
    int32_t group, n_heads;
    int64_t n_candidates, first, last;
  };
  const Case cases[] = {{4, 32, 4096, 0, 2048}, {4, 32, 4096, 2048, 4096}, {4, 4, 1003, 5, 1003},
                        {3, 9, 517, 1, 500},    {8, 8, 64, 0, 64},         {1, 7, 99, 3, 98}};
  for (const Case& c : cases) {
    const int64_t stride = int64_t(c.group) * c.n_candidates;
    std::vector<double> kept(size_t(stride * (c.n_heads / c.group)));
    for (double& e : kept) e = unit(rng) * unit(rng);  // exp terms in [0, 1]
    std::vector<double> head_sum(size_t(c.n_heads));
    for (double& z : head_sum) z = 1.0 + 1000.0 * unit(rng);
    std::vector<double> want(size_t(c.n_candidates), -1.0);
    for (int64_t t = c.first; t < c.last; ++t) {
      double vote = 0.0;
      for (int32_t k = 0; k < c.n_heads; ++k)
        vote += kept[size_t((k / c.group) * stride + t * c.group + k % c.group)] / head_sum[size_t(k)];
      want[size_t(t)] = vote;
    }
    const std::vector<const SelectSoftmaxKernel*> kernels = kernels_present();
    for (const SelectSoftmaxKernel* kernel : kernels) {
      std::vector<double> got(size_t(c.n_candidates), -1.0);  // outside [first, last) stays untouched
      kernel->vote(kept.data(), stride, c.group, c.n_heads, head_sum.data(), c.first, c.last, got.data());
      int64_t differing = 0;
      for (size_t t = 0; t < got.size(); ++t) differing += !same_bits(got[t], want[t]);
      EXPECT_EQ(differing, 0) << kernel->name << " group " << c.group << " heads " << c.n_heads;
    }
  }
}

// src/common/glibc_exp.h, the scalar copy the GPU's context-parallel steps evaluate, against std::exp over every
// range of glibc's exp (main range both signs, the rescaled 512 <= |x| < 1024 side with its subnormal results,
// tiny, huge, ±0, ±inf, NaN). Where the C library is glibc on an x86-64 CPU with FMA (the variant the port copies)
// every bit must agree; elsewhere the CPU's std::exp may round otherwise and only the pinned values are checked.
TEST(SelectSoftmax, GlibcExpPortEqualsStdExpEverywhere) {
#if defined(__x86_64__) && defined(__GLIBC__)
  __builtin_cpu_init();
  const bool glibc_fma_variant = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
#else
  const bool glibc_fma_variant = false;
#endif
  std::mt19937_64 rng(11);
  const double ranges[][2] = {{-1100, 0}, {-746, -700}, {-720, -500}, {-512.5, -511.5}, {0, 710},  {500, 720},
                              {-50, 0},   {-1, 1},      {-1e-10, 1e-10}, {-1030, -1020}, {1020, 1030}};
  std::vector<double> x = {0.0, -0.0, INFINITY, -INFINITY, std::nan(""), 0x1p-54, -0x1p-54, 0x1p-55, -0x1p-55,
                           512.0, -512.0, 1024.0, -1024.0, -745.1332191019411, -745.1332191019412, 709.782712893384,
                           709.7827128933841, 5e-324, -5e-324};
  for (const auto& range : ranges) {
    for (int i = 0; i < 200000; ++i) x.push_back(range[0] + (range[1] - range[0]) * (double(rng() >> 11) * 0x1p-53));
  }
  for (int e = -1074; e < 11; ++e)
    for (double sign : {1.0, -1.0}) x.push_back(sign * std::ldexp(1.5, e));
  int64_t differing = 0;
  for (double v : x) {
    const double got = sparsa::glibc_exp(v), want = std::exp(v);
    differing += !(same_bits(got, want) || (std::isnan(got) && std::isnan(want)));
  }
  if (glibc_fma_variant) EXPECT_EQ(differing, 0) << "of " << x.size();
  // On every platform: the port's own bits at one argument of each branch (read from glibc 2.36 on x86-64 + FMA),
  // so the function the device evaluates is pinned even where std::exp rounds otherwise.
  const std::pair<double, uint64_t> pinned[] = {
      {-0x1p-1, 0x3fe368b2fc6f960aull},     {-0x1.ap+1, 0x3fa3da368521902dull},  {-0x1.288p+5, 0x3c971ace3e6415f1ull},
      {-0x1p-40, 0x3fefffffffffe000ull},    {-0x1.2c4p+9, 0x09c94f535b837056ull}, {-0x1.626p+9, 0x000b3c15564d094bull},
      {-0x1.744p+9, 0x0000000000000001ull}, {-0x1.018p+10, 0x0000000000000000ull}, {0x1p+0, 0x4005bf0a8b145769ull},
      {0x1.908p+6, 0x48f5daaf24221d5eull},  {0x1.2c2p+9, 0x760f8256bde4abacull}, {-0x1.79ca10c924223p-67, 0x3ff0000000000000ull}};
  for (const auto& [argument, bits] : pinned) {
    const double got = sparsa::glibc_exp(argument);
    uint64_t got_bits;
    std::memcpy(&got_bits, &got, sizeof got_bits);
    EXPECT_EQ(got_bits, bits) << "glibc_exp(" << argument << ")";
  }
}

// On x86-64 glibc with FMA and AVX2 (this project's machines) a vector version must be in use: a check at first use
// that wrongly refused them would fall back to the slow loop silently. Elsewhere the backend uses the widest present.
TEST(SelectSoftmax, VectorVersionIsChosenWhereGlibcUsesItsFmaExp) {
  const std::vector<const SelectSoftmaxKernel*> kernels = kernels_present();
  EXPECT_EQ(&sparsa::cpu::select_softmax_kernel(), kernels.back());
#if defined(__x86_64__) && defined(__GLIBC__) && !defined(SPARSA_CPU_PORTABLE_KERNELS)
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) {
    EXPECT_NE(sparsa::cpu::avx2_select_softmax_kernel(), nullptr);
    EXPECT_STRNE(sparsa::cpu::select_softmax_kernel().name, "portable");
  }
#endif
}

}  // namespace
