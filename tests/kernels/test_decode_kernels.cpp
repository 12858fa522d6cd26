// The dense decode kernels (backends/cpu/decode_kernels.h), every version this CPU and build have:
// - `accumulate` (the P·V step) against the plain loop bit for bit: for each key in order and each head with a
//   nonzero probability, o[h][c] = fma(p, V[c], o[h][c]) (a zero probability adds nothing, so an Inf in that V row
//   cannot reach the row). The tiles mix keys whose heads all have a probability (the AVX2 kernel's
//   two-keys-at-a-time path) with keys where some or all are zero, odd key counts, groups that do not fill its head
//   blocks, and fp16 and bf16 rows.
// - `scores` against the float64 dot product, within the bound of any fp32 summation order,
//   d·2⁻²⁴·Σ|q_c·K_c|: a score written to another head's column or left out is far outside it. Groups that fill
//   the AVX-512 kernel's 16-head reductions, groups that leave its last block part-full, and groups it takes one
//   head at a time; the columns past the heads must stay untouched.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <random>
#include <vector>

#include <sparsa/sparsa.h>

#include "../host_half.h"
#include "decode_kernels.h"

namespace {

using sparsa::cpu::DecodeKernels;
using sparsa::cpu::DecodeTile;

std::vector<const DecodeKernels*> kernels_present(int d) {
  std::vector<const DecodeKernels*> kernels;
  if (const DecodeKernels* k = sparsa::cpu::avx2_decode_kernels(d)) kernels.push_back(k);
  if (const DecodeKernels* k = sparsa::cpu::avx512_decode_kernels(d)) kernels.push_back(k);
  return kernels;
}

uint16_t to_half(float x, int32_t dtype) {
  if (dtype == SPARSA_DTYPE_F16) return host_half::float_to_f16(x);
  uint32_t bits;
  std::memcpy(&bits, &x, sizeof bits);
  return uint16_t(bits >> 16);  // truncation is a valid bf16 value, which is all the test needs
}
float from_half(uint16_t h, int32_t dtype) {
  if (dtype == SPARSA_DTYPE_F16) return host_half::f16_to_float(h);
  const uint32_t bits = uint32_t(h) << 16;
  float x;
  std::memcpy(&x, &bits, sizeof x);
  return x;
}

TEST(DecodeAccumulate, EveryVersionMatchesTheKeyByKeyFmaLoopBitForBit) {
  struct Shape {
    int d, n_kv, group, nk;
  };
  const Shape shapes[] = {{128, 8, 4, 128}, {128, 2, 4, 37}, {64, 3, 1, 9},  {256, 1, 8, 16},
                          {128, 2, 5, 21},  {64, 1, 16, 7},  {128, 1, 2, 1}, {256, 2, 6, 33}};
  int tested = 0;
  for (const Shape& s : shapes)
    for (int32_t dtype : {SPARSA_DTYPE_F16, SPARSA_DTYPE_BF16})
      for (const DecodeKernels* kernels : kernels_present(s.d)) {
        SCOPED_TRACE(::testing::Message() << kernels->name << " d=" << s.d << " n_kv=" << s.n_kv << " group="
                                          << s.group << " nk=" << s.nk << " dtype=" << dtype);
        std::mt19937 rng(uint32_t(s.d * 1000 + s.n_kv * 100 + s.group * 10 + s.nk + dtype));
        std::normal_distribution<float> normal;
        std::uniform_real_distribution<float> unit(0.f, 1.f);
        const int hq = s.n_kv * s.group;
        const int64_t head_elems = s.d + 8;  // rows of kv heads apart by more than d, like a padded cache
        std::vector<uint16_t> cache(size_t(s.nk) * s.n_kv * head_elems);
        for (uint16_t& x : cache) x = to_half(normal(rng), dtype);
        std::vector<const unsigned char*> rows(size_t(s.nk));
        for (int j = 0; j < s.nk; ++j)
          rows[size_t(j)] = reinterpret_cast<const unsigned char*>(cache.data() + size_t(j) * s.n_kv * head_elems);
        // Probabilities: most keys nonzero for every head; some keys zero for a few heads or for all of them, and
        // then an Inf in that key's V row, which must not reach the output.
        const int st_stride = hq + 3;
        std::vector<float> st(size_t(s.nk) * st_stride, 0.f);
        for (int j = 0; j < s.nk; ++j) {
          const float kind = unit(rng);
          for (int h = 0; h < hq; ++h) {
            const bool zero = kind < 0.1f || (kind < 0.3f && unit(rng) < 0.4f);
            st[size_t(j) * st_stride + h] = zero ? 0.f : unit(rng);
          }
          if (kind < 0.1f)
            cache[size_t(j) * s.n_kv * head_elems] = to_half(std::numeric_limits<float>::infinity(), dtype);
        }
        std::vector<float> o(size_t(hq) * s.d), want;
        for (float& x : o) x = normal(rng);
        want = o;
        for (int j = 0; j < s.nk; ++j)
          for (int h = 0; h < hq; ++h) {
            const float p = st[size_t(j) * st_stride + h];
            if (p == 0.f) continue;
            const uint16_t* v = cache.data() + size_t(j) * s.n_kv * head_elems + size_t(h / s.group) * head_elems;
            for (int c = 0; c < s.d; ++c)
              want[size_t(h) * s.d + c] = std::fma(p, from_half(v[c], dtype), want[size_t(h) * s.d + c]);
          }
        DecodeTile tile;
        tile.k_rows = rows.data();
        tile.v_rows = rows.data();
        tile.k_head_bytes = tile.v_head_bytes = head_elems * 2;
        tile.nk = s.nk;
        tile.n_kv_heads = s.n_kv;
        tile.group = s.group;
        tile.d = s.d;
        tile.dtype = dtype;
        kernels->accumulate(tile, st.data(), st_stride, o.data());
        for (size_t e = 0; e < o.size(); ++e)
          ASSERT_EQ(std::memcmp(&o[e], &want[e], sizeof(float)), 0)
              << "head " << e / s.d << " col " << e % s.d << ": " << o[e] << " vs " << want[e];
        ++tested;
      }
  if (tested == 0) GTEST_SKIP() << "no decode kernel version on this CPU or build";
}

TEST(DecodeScores, EveryVersionMatchesTheFloat64DotWithinTheFp32Bound) {
  struct Shape {
    int d, n_kv, group, nk;
  };
  const Shape shapes[] = {{128, 8, 4, 19}, {128, 2, 4, 5},  {64, 3, 1, 9},  {256, 1, 8, 16}, {128, 2, 5, 7},
                          {64, 1, 16, 7},  {128, 3, 2, 3},  {256, 2, 6, 4}, {64, 5, 8, 2},   {128, 17, 1, 3}};
  constexpr float kUntouched = -12345.f;
  int tested = 0;
  for (const Shape& s : shapes)
    for (int32_t dtype : {SPARSA_DTYPE_F16, SPARSA_DTYPE_BF16})
      for (const DecodeKernels* kernels : kernels_present(s.d)) {
        SCOPED_TRACE(::testing::Message() << kernels->name << " d=" << s.d << " n_kv=" << s.n_kv << " group="
                                          << s.group << " nk=" << s.nk << " dtype=" << dtype);
        std::mt19937 rng(uint32_t(s.d * 1000 + s.n_kv * 100 + s.group * 10 + s.nk + dtype + 7));
        std::normal_distribution<float> normal;
        const int hq = s.n_kv * s.group;
        const int64_t head_elems = s.d + 8;
        std::vector<uint16_t> cache(size_t(s.nk) * s.n_kv * head_elems);
        for (uint16_t& x : cache) x = to_half(normal(rng), dtype);
        std::vector<const unsigned char*> rows(size_t(s.nk));
        for (int j = 0; j < s.nk; ++j)
          rows[size_t(j)] = reinterpret_cast<const unsigned char*>(cache.data() + size_t(j) * s.n_kv * head_elems);
        std::vector<float> q(size_t(hq) * s.d);
        for (float& x : q) x = normal(rng);
        const int st_stride = hq + 5;
        std::vector<float> st(size_t(s.nk) * st_stride, kUntouched);
        DecodeTile tile;
        tile.k_rows = tile.v_rows = rows.data();
        tile.k_head_bytes = tile.v_head_bytes = head_elems * 2;
        tile.nk = s.nk;
        tile.n_kv_heads = s.n_kv;
        tile.group = s.group;
        tile.d = s.d;
        tile.dtype = dtype;
        kernels->scores(tile, q.data(), st.data(), st_stride);
        for (int j = 0; j < s.nk; ++j) {
          for (int h = 0; h < hq; ++h) {
            const uint16_t* k = cache.data() + size_t(j) * s.n_kv * head_elems + size_t(h / s.group) * head_elems;
            double exact = 0.0, magnitude = 0.0;
            for (int c = 0; c < s.d; ++c) {
              const double term = double(q[size_t(h) * s.d + c]) * double(from_half(k[c], dtype));
              exact += term;
              magnitude += std::fabs(term);
            }
            const double bound = s.d * std::ldexp(1.0, -24) * magnitude;
            ASSERT_LE(std::fabs(double(st[size_t(j) * st_stride + h]) - exact), bound) << "key " << j << " head " << h;
          }
          for (int col = hq; col < st_stride; ++col)
            ASSERT_EQ(st[size_t(j) * st_stride + col], kUntouched) << "key " << j << " column " << col;
        }
        ++tested;
      }
  if (tested == 0) GTEST_SKIP() << "no decode kernel version on this CPU or build";
}

}  // namespace
