// TOKEN_SELECT's float64 scoring kernels (backends/cpu/select_scores.h), every version this CPU and build have,
// against the plain channel-order loop, bit for bit: each score is 0, then one rounded multiply q̄[c]·K[c] and one
// rounded add per channel in c order, then the product with the scale. A kernel that reassociates the sum or fuses a
// multiply and an add into an FMA differs in the last bits on these inputs (cancelling sums of large terms).
#include <gtest/gtest.h>
#include <sparsa/sparsa.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "select_scores.h"

namespace {

using sparsa::cpu::kScoreTileKeys;
using sparsa::cpu::SelectScoreKernel;

// The kernels this process can run: portable always, AVX2 and AVX-512 where the CPU (and the build) have them.
std::vector<const SelectScoreKernel*> kernels_present() {
  std::vector<const SelectScoreKernel*> kernels = {&sparsa::cpu::portable_select_score_kernel()};
  if (const SelectScoreKernel* k = sparsa::cpu::avx2_select_score_kernel()) kernels.push_back(k);
  if (const SelectScoreKernel* k = sparsa::cpu::avx512_select_score_kernel()) kernels.push_back(k);
  return kernels;
}

// fp16 / bf16 bits to their exact value, written independently of the library's conversions.
double f16_value(uint16_t h) {
  const int sign = (h & 0x8000) ? -1 : 1;
  const int exponent = (h >> 10) & 0x1f;
  const int mantissa = h & 0x3ff;
  if (exponent == 0) return sign * std::ldexp(double(mantissa), -24);
  return sign * std::ldexp(double(1024 + mantissa), exponent - 25);
}
double bf16_value(uint16_t h) {
  const uint32_t bits = uint32_t(h) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return double(f);
}

// Keys of one dtype: n rows of d elements, stored as the kernel reads them, plus their exact values.
struct KeyRows {
  int32_t dtype;
  int32_t d;
  std::vector<uint16_t> half;  // F16 / BF16 storage
  std::vector<float> single;   // F32 storage
  std::vector<double> value;   // exact values, [n][d]
  const void* row(int j) const {
    return dtype == SPARSA_DTYPE_F32 ? static_cast<const void*>(single.data() + int64_t(j) * d)
                                     : static_cast<const void*>(half.data() + int64_t(j) * d);
  }
};

enum class Keys { kRandom, kCancelling, kDuplicates, kNeedle, kZeros };
const char* keys_name(Keys k) {
  switch (k) {
    case Keys::kRandom: return "random";
    case Keys::kCancelling: return "cancelling";
    case Keys::kDuplicates: return "duplicates";
    case Keys::kNeedle: return "needle";
    default: return "zeros";
  }
}

// A value of `dtype` near x (x rounded by truncating to the dtype's grid; finite).
void store(KeyRows& rows, size_t i, double x) {
  if (rows.dtype == SPARSA_DTYPE_F32) {
    rows.single[i] = float(x);
    rows.value[i] = double(rows.single[i]);
    return;
  }
  const float f = float(x);
  uint32_t bits;
  std::memcpy(&bits, &f, sizeof bits);
  uint16_t h;
  if (rows.dtype == SPARSA_DTYPE_BF16) {
    h = uint16_t(bits >> 16);
    rows.value[i] = bf16_value(h);
  } else {  // F16: clamp to the finite range, then the nearest value below in magnitude on the half grid
    const double magnitude = std::min(std::fabs(x), 65504.0);
    const int exponent = magnitude < std::ldexp(1.0, -14) ? -14 : std::ilogb(magnitude);
    const double step = std::ldexp(1.0, exponent - 10);
    const double rounded = std::floor(magnitude / step) * step;
    const int e = rounded < std::ldexp(1.0, -14) ? 0 : exponent + 15;
    const int mantissa = e == 0 ? int(rounded / std::ldexp(1.0, -24)) : int(rounded / step) - 1024;
    h = uint16_t((x < 0 ? 0x8000 : 0) | (e << 10) | mantissa);
    rows.value[i] = f16_value(h);
  }
  rows.half[i] = h;
}

KeyRows make_keys(int32_t dtype, int n, int32_t d, Keys kind, const std::vector<double>& qbar0, std::mt19937_64& rng) {
  KeyRows rows{dtype, d, {}, {}, {}};
  const size_t count = size_t(n) * size_t(d);
  rows.half.resize(count);
  rows.single.resize(count);
  rows.value.resize(count);
  std::normal_distribution<double> normal(0.0, 1.0);
  const double big = dtype == SPARSA_DTYPE_F16 ? 3000.0 : 1e6;
  for (int j = 0; j < n; ++j)
    for (int32_t c = 0; c < d; ++c) {
      const size_t i = size_t(j) * d + c;
      double x = normal(rng);
      switch (kind) {
        case Keys::kCancelling: x = (c % 2 ? -big : big) * (1.0 + 1e-3 * x); break;  // huge terms, small sum
        case Keys::kDuplicates: x = j % 3 == 0 ? x : rows.value[size_t(j - j % 3) * d + c]; break;
        case Keys::kNeedle: x = j == n / 2 ? 4.0 * qbar0[size_t(c)] : 0.1 * x; break;
        case Keys::kZeros: x = (j + c) % 4 == 0 ? -0.0 : (c % 5 == 0 ? x : 0.0); break;
        default: break;
      }
      store(rows, i, x);
    }
  return rows;
}

bool same_bits(double a, double b) { return std::memcmp(&a, &b, sizeof a) == 0; }

TEST(SelectScoreKernels, EveryVersionMatchesThePlainChannelOrderLoopBitForBit) {
  const std::vector<const SelectScoreKernel*> kernels = kernels_present();
  std::string names;
  for (const SelectScoreKernel* k : kernels) names += std::string(" ") + k->name;
  std::printf("score kernels tested:%s\n", names.c_str());
  ASSERT_FALSE(kernels.empty());
  constexpr double kPoison = -12345.678;  // written around the scores: must stay untouched
  std::mt19937_64 rng(20261125);
  int64_t compared = 0;
  for (int32_t dtype : {SPARSA_DTYPE_F32, SPARSA_DTYPE_F16, SPARSA_DTYPE_BF16})
    for (int32_t d : {64, 128, 256, 40, 72})
      for (int group : {1, 3, 4, 8})
        for (Keys kind : {Keys::kRandom, Keys::kCancelling, Keys::kDuplicates, Keys::kNeedle, Keys::kZeros})
          for (int n_keys : {1, 7, 8, 13, 31, kScoreTileKeys})
            for (double scale : {1.0, 0.125, 1.0 / std::sqrt(double(d))})
              for (bool padded : {true, false}) {
                SCOPED_TRACE(::testing::Message() << "dtype " << dtype << " d " << d << " group " << group << " keys "
                                                  << keys_name(kind) << " n_keys " << n_keys << " scale " << scale
                                                  << " padded " << padded);
                // q̄: means of fp32 query rows are arbitrary doubles; the cancelling keys get same-sign large q̄.
                std::normal_distribution<double> normal(0.0, 1.0);
                std::vector<double> qbars(size_t(group) * d);
                for (double& q : qbars) q = kind == Keys::kCancelling ? 100.0 + normal(rng) : normal(rng) / 3.0;
                const KeyRows rows = make_keys(dtype, n_keys, d, kind, qbars, rng);
                std::vector<const void*> pointers(static_cast<size_t>(n_keys));
                for (int j = 0; j < n_keys; ++j) pointers[size_t(j)] = rows.row(j);
                // The oracle: the plain loop on the exact values.
                // One padding column per key row (must stay untouched), or none (rows of exactly the group's heads,
                // which the AVX-512 version stores a block at a time).
                const int64_t stride = group + (padded ? 1 : 0);
                std::vector<double> want(size_t(kScoreTileKeys + 1) * stride, kPoison);
                for (int j = 0; j < n_keys; ++j)
                  for (int l = 0; l < group; ++l) {
                    double sum = 0.0;
                    for (int32_t c = 0; c < d; ++c) sum += qbars[size_t(l) * d + c] * rows.value[size_t(j) * d + c];
                    want[size_t(j) * stride + l] = scale * sum;
                  }
                for (const SelectScoreKernel* kernel : kernels) {
                  std::vector<double> got(want.size(), kPoison);
                  std::vector<float> transposed(sparsa::cpu::score_tile_scratch_floats(d), std::nanf(""));
                  kernel->score_tile(qbars.data(), group, pointers.data(), dtype, n_keys, d, scale, transposed.data(),
                                     got.data(), stride);
                  for (size_t i = 0; i < want.size(); ++i) {
                    if (!same_bits(got[i], want[i])) {
                      ADD_FAILURE() << kernel->name << ": entry " << i << " (key " << i / stride << ", head "
                                    << i % stride << ") is " << got[i] << ", the plain loop gives " << want[i];
                      break;
                    }
                  }
                  ++compared;
                }
                if (kind == Keys::kDuplicates)  // duplicate rows tie exactly
                  for (int j = 0; j < n_keys; ++j)
                    for (int l = 0; l < group; ++l)
                      EXPECT_TRUE(same_bits(want[size_t(j) * stride + l], want[size_t(j - j % 3) * stride + l]));
              }
  EXPECT_GT(compared, 0);
}

// score_tile_exact_products with q̄ made of float values (a decode's widened query row): the same bits as the plain
// loop. Where a version fuses (AVX2, AVX-512), the same call on arbitrary float64 q̄, whose products are not exact,
// must differ from the plain loop somewhere: otherwise the comparison above could not tell a fused kernel from an
// unfused one.
TEST(SelectScoreKernels, ExactProductsVersionMatchesThePlainLoopForFloatQbars) {
  const std::vector<const SelectScoreKernel*> kernels = kernels_present();
  std::mt19937_64 rng(7);
  std::normal_distribution<double> normal(0.0, 1.0);
  int64_t compared = 0, fused_differences = 0;
  for (int32_t dtype : {SPARSA_DTYPE_F32, SPARSA_DTYPE_F16, SPARSA_DTYPE_BF16})
    for (int32_t d : {64, 128, 40})
      for (int group : {1, 4, 8})
        for (Keys kind : {Keys::kRandom, Keys::kCancelling, Keys::kNeedle, Keys::kZeros})
          for (int n_keys : {7, kScoreTileKeys})
            for (bool float_qbars : {true, false}) {
              SCOPED_TRACE(::testing::Message() << "dtype " << dtype << " d " << d << " group " << group << " keys "
                                                << keys_name(kind) << " n_keys " << n_keys << " float q̄ "
                                                << float_qbars);
              std::vector<double> qbars(size_t(group) * d);
              for (double& q : qbars) {
                q = kind == Keys::kCancelling ? 100.0 + normal(rng) : normal(rng) / 3.0;
                if (float_qbars) q = double(float(q));
              }
              ASSERT_EQ(sparsa::cpu::qbars_are_floats(qbars.data(), int64_t(qbars.size())), float_qbars);
              const KeyRows rows = make_keys(dtype, n_keys, d, kind, qbars, rng);
              std::vector<const void*> pointers(static_cast<size_t>(n_keys));
              for (int j = 0; j < n_keys; ++j) pointers[size_t(j)] = rows.row(j);
              std::vector<double> want(size_t(n_keys) * group);
              for (int j = 0; j < n_keys; ++j)
                for (int l = 0; l < group; ++l) {
                  double sum = 0.0;
                  for (int32_t c = 0; c < d; ++c) sum += qbars[size_t(l) * d + c] * rows.value[size_t(j) * d + c];
                  want[size_t(j) * group + l] = sum;
                }
              for (const SelectScoreKernel* kernel : kernels) {
                std::vector<double> got(want.size());
                std::vector<float> transposed(sparsa::cpu::score_tile_scratch_floats(d));
                kernel->score_tile_exact_products(qbars.data(), group, pointers.data(), dtype, n_keys, d, 1.0,
                                                  transposed.data(), got.data(), group);
                int64_t differing = 0;
                for (size_t i = 0; i < want.size(); ++i) differing += !same_bits(got[i], want[i]);
                if (float_qbars) {
                  EXPECT_EQ(differing, 0) << kernel->name;
                  ++compared;
                } else if (kernel->score_tile_exact_products != kernel->score_tile) {
                  fused_differences += differing;
                }
              }
            }
  EXPECT_GT(compared, 0);
  const SelectScoreKernel* widest = kernels.back();
  if (widest->score_tile_exact_products != widest->score_tile)
    EXPECT_GT(fused_differences, 0) << "the fused version rounds like the unfused one even where products are inexact";
}

TEST(SelectScoreKernels, TheBackendPicksTheWidestVersionPresent) {
  const std::vector<const SelectScoreKernel*> kernels = kernels_present();
  EXPECT_EQ(&sparsa::cpu::select_score_kernel(), kernels.back());
}

}  // namespace
