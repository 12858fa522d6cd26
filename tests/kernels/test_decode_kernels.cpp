// The dense decode kernels (backends/cpu/decode_kernels.h), every version this CPU and build have:
// - `accumulate` (the P·V step) against the plain loop bit for bit: for each key in order and each head with a
//   nonzero probability, o[h][c] = fma(p, V[c], o[h][c]) (a zero probability adds nothing, so an Inf in that V row
//   cannot reach the row). The tiles mix keys whose heads all have a probability (the AVX2 kernel's
//   two-keys-at-a-time path) with keys where some or all are zero, odd key counts, groups that do not fill its head
//   blocks, and fp16 and bf16 rows; with DecodeTile::rows_ahead set as well (the rows it fetches for the next tile).
// - `scores` against the float64 dot product, within the bound of any fp32 summation order,
//   d·2⁻²⁴·Σ|q_c·K_c|: a score written to another head's column or left out is far outside it. Groups that fill
//   the AVX-512 kernel's 16-head reductions, groups that leave its last block part-full, and groups it takes one
//   head at a time; the columns past the heads must stay untouched.
// - `scores` with DecodeTile::k_magnitudes and no V rows: the same scores bit for
//   bit, and each kv head's largest magnitude bits maxed into what was there, a large negative value included.
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

struct Shape {
  int d, n_kv, group, nk;
};

// One tile of nk keys over a cache of random 16-bit rows (K and V the same rows; kv heads d + 8 elements apart, like a
// padded cache), for one shape, dtype and kernel version.
struct TileCase {
  const Shape& s;
  int32_t dtype;
  const DecodeKernels& kernels;
  std::mt19937 rng;
  int hq;
  int64_t head_elems;
  std::vector<uint16_t> cache;
  std::vector<const unsigned char*> rows;
  DecodeTile tile;

  TileCase(const Shape& shape, int32_t dtype_, const DecodeKernels& kernels_, uint32_t seed)
      : s(shape), dtype(dtype_), kernels(kernels_), rng(seed), hq(shape.n_kv * shape.group), head_elems(shape.d + 8),
        cache(size_t(shape.nk) * shape.n_kv * size_t(head_elems)), rows(size_t(shape.nk)) {
    std::normal_distribution<float> normal;
    for (uint16_t& x : cache) x = to_half(normal(rng), dtype);
    for (int j = 0; j < s.nk; ++j)
      rows[size_t(j)] = reinterpret_cast<const unsigned char*>(cache.data() + size_t(j) * s.n_kv * head_elems);
    tile.k_rows = tile.v_rows = rows.data();
    tile.k_head_bytes = tile.v_head_bytes = head_elems * 2;
    tile.nk = s.nk;
    tile.n_kv_heads = s.n_kv;
    tile.group = s.group;
    tile.d = s.d;
    tile.dtype = dtype;
  }
  // Key j's row for query head h (its kv head's).
  uint16_t* row_for_head(int j, int h) {
    return cache.data() + size_t(j) * s.n_kv * head_elems + size_t(h / s.group) * head_elems;
  }
};

// Runs check(TileCase&) for every shape, dtype and kernel version present; skips when there is none.
template <typename Check>
void for_every_case(const std::vector<Shape>& shapes, uint32_t seed_offset, Check check) {
  int tested = 0;
  for (const Shape& s : shapes)
    for (int32_t dtype : {SPARSA_DTYPE_F16, SPARSA_DTYPE_BF16})
      for (const DecodeKernels* kernels : kernels_present(s.d)) {
        SCOPED_TRACE(::testing::Message() << kernels->name << " d=" << s.d << " n_kv=" << s.n_kv << " group="
                                          << s.group << " nk=" << s.nk << " dtype=" << dtype);
        TileCase c(s, dtype, *kernels,
                   uint32_t(s.d * 1000 + s.n_kv * 100 + s.group * 10 + s.nk + dtype) + seed_offset);
        check(c);
        if (::testing::Test::HasFatalFailure()) return;
        ++tested;
      }
  if (tested == 0) GTEST_SKIP() << "no decode kernel version on this CPU or build";
}

TEST(DecodeAccumulate, EveryVersionMatchesTheKeyByKeyFmaLoopBitForBit) {
  const std::vector<Shape> shapes = {{128, 8, 4, 128}, {128, 2, 4, 37}, {64, 3, 1, 9},  {256, 1, 8, 16},
                                     {128, 2, 5, 21},  {64, 1, 16, 7},  {128, 1, 2, 1}, {256, 2, 6, 33}};
  for_every_case(shapes, 0, [](TileCase& c) {
    const Shape& s = c.s;
    std::normal_distribution<float> normal;
    std::uniform_real_distribution<float> unit(0.f, 1.f);
    // Probabilities: most keys nonzero for every head; some keys zero for a few heads or for all of them, and
    // then an Inf in that key's V row, which must not reach the output.
    const int st_stride = c.hq + 3;
    std::vector<float> st(size_t(s.nk) * st_stride, 0.f);
    for (int j = 0; j < s.nk; ++j) {
      const float kind = unit(c.rng);
      for (int h = 0; h < c.hq; ++h) {
        const bool zero = kind < 0.1f || (kind < 0.3f && unit(c.rng) < 0.4f);
        st[size_t(j) * st_stride + h] = zero ? 0.f : unit(c.rng);
      }
      if (kind < 0.1f) c.row_for_head(j, 0)[0] = to_half(std::numeric_limits<float>::infinity(), c.dtype);
    }
    std::vector<float> o(size_t(c.hq) * s.d), want;
    for (float& x : o) x = normal(c.rng);
    want = o;
    for (int j = 0; j < s.nk; ++j)
      for (int h = 0; h < c.hq; ++h) {
        const float p = st[size_t(j) * st_stride + h];
        if (p == 0.f) continue;
        const uint16_t* v = c.row_for_head(j, h);
        for (int col = 0; col < s.d; ++col)
          want[size_t(h) * s.d + col] = std::fma(p, from_half(v[col], c.dtype), want[size_t(h) * s.d + col]);
      }
    // With the next tile's rows to fetch as well (here the same rows backwards), the same bits.
    std::vector<float> o_fetching = o;
    std::vector<const unsigned char*> ahead(c.rows.rbegin(), c.rows.rend());
    c.kernels.accumulate(c.tile, st.data(), st_stride, o.data());
    c.tile.rows_ahead = ahead.data();
    c.kernels.accumulate(c.tile, st.data(), st_stride, o_fetching.data());
    for (size_t e = 0; e < o.size(); ++e) {
      ASSERT_EQ(std::memcmp(&o[e], &want[e], sizeof(float)), 0)
          << "head " << e / s.d << " col " << e % s.d << ": " << o[e] << " vs " << want[e];
      ASSERT_EQ(std::memcmp(&o_fetching[e], &want[e], sizeof(float)), 0)
          << "fetching ahead, head " << e / s.d << " col " << e % s.d;
    }
  });
}

TEST(DecodeScores, EveryVersionMatchesTheFloat64DotWithinTheFp32Bound) {
  const std::vector<Shape> shapes = {{128, 8, 4, 19}, {128, 2, 4, 5}, {64, 3, 1, 9},  {256, 1, 8, 16},
                                     {128, 2, 5, 7},  {64, 1, 16, 7}, {128, 3, 2, 3}, {256, 2, 6, 4},
                                     {64, 5, 8, 2},   {128, 17, 1, 3}};
  for_every_case(shapes, 7, [](TileCase& c) {
    constexpr float kUntouched = -12345.f;
    const Shape& s = c.s;
    std::normal_distribution<float> normal;
    std::vector<float> q(size_t(c.hq) * s.d);
    for (float& x : q) x = normal(c.rng);
    const int st_stride = c.hq + 5;
    std::vector<float> st(size_t(s.nk) * st_stride, kUntouched);
    c.kernels.scores(c.tile, q.data(), st.data(), st_stride);
    for (int j = 0; j < s.nk; ++j) {
      for (int h = 0; h < c.hq; ++h) {
        const uint16_t* k = c.row_for_head(j, h);
        double exact = 0.0, magnitude = 0.0;
        for (int col = 0; col < s.d; ++col) {
          const double term = double(q[size_t(h) * s.d + col]) * double(from_half(k[col], c.dtype));
          exact += term;
          magnitude += std::fabs(term);
        }
        const double bound = s.d * std::ldexp(1.0, -24) * magnitude;
        ASSERT_LE(std::fabs(double(st[size_t(j) * st_stride + h]) - exact), bound) << "key " << j << " head " << h;
      }
      for (int col = c.hq; col < st_stride; ++col)
        ASSERT_EQ(st[size_t(j) * st_stride + col], kUntouched) << "key " << j << " column " << col;
    }
  });
}

TEST(DecodeScores, MagnitudesAreEachKvHeadsLargestAbsKAndLeaveTheScoresAlone) {
  // Groups the AVX-512 kernel reduces 16 heads at a time (4, 1, 16) and takes one head at a time (5), groups the AVX2
  // kernel scores two keys at a time (4, 8; an odd key count leaves it a key alone), more kv heads than either keeps
  // running magnitudes for (17).
  const std::vector<Shape> shapes = {{128, 8, 4, 19}, {64, 3, 1, 9}, {64, 1, 16, 7}, {128, 2, 5, 7},
                                     {256, 2, 8, 6},  {128, 17, 1, 3}, {64, 17, 4, 5}};
  for_every_case(shapes, 11, [](TileCase& c) {
    const Shape& s = c.s;
    c.row_for_head(s.nk - 1, 0)[s.d - 1] = to_half(-30000.f, c.dtype);  // the largest magnitude, negative
    std::normal_distribution<float> normal;
    std::vector<float> q(size_t(c.hq) * s.d);
    for (float& x : q) x = normal(c.rng);
    const int st_stride = c.hq;
    std::vector<float> plain(size_t(s.nk) * st_stride), with(plain.size());
    c.kernels.scores(c.tile, q.data(), plain.data(), st_stride);
    std::vector<uint16_t> got(size_t(s.n_kv)), want(size_t(s.n_kv));
    for (int hk = 0; hk < s.n_kv; ++hk) got[size_t(hk)] = want[size_t(hk)] = hk % 2 ? 0x7bff : 0;  // odd: kept, larger
    for (int j = 0; j < s.nk; ++j)
      for (int hk = 0; hk < s.n_kv; ++hk)
        for (int col = 0; col < s.d; ++col)
          want[size_t(hk)] = std::max<uint16_t>(want[size_t(hk)], c.row_for_head(j, hk * s.group)[col] & 0x7fff);
    c.tile.k_magnitudes = got.data();
    c.tile.v_rows = nullptr;  // as the fp32 screen calls it: scores alone, nothing fetched ahead
    c.kernels.scores(c.tile, q.data(), with.data(), st_stride);
    EXPECT_EQ(got, want);
    ASSERT_EQ(std::memcmp(plain.data(), with.data(), plain.size() * sizeof(float)), 0);
  });
}

}  // namespace
