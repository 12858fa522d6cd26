// §7 utilities: top-k from draft scores (token and block ids; a case table on every backend), STS head mapping, and
// the KV prefetch whose compact buffer a TOKEN_INDICES decode run can use in place of the full cache.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <numeric>
#include <ostream>
#include <set>
#include <string>
#include <vector>

#include "test_util.h"

namespace {

using st::Pattern;

SPARSA_BACKEND_SUITE(TopK);
SPARSA_BACKEND_SUITE(KvPrefetch);
SPARSA_BACKEND_SUITE(HeadMapping);

// ------------------------------------------------------------------------------------------------------ top-k
// sparsa_topk_from_scores as a case table, one row per case, on every backend (device memory through st::Buffer):
// random rows with every k and block size, ties, NaN and signed zeros, a million values keeping 2048 and many
// segments of 32K keeping half, each compared exactly with a host reference of the header's contract.
enum class Scores {
  kNormal,             // N(0, 1)
  kCoarseNormal,       // N(0, 1) rounded to multiples of 1/64: exact ties at the threshold
  kTailBlockWins,      // U(0, 1), the last 4 tokens of every row 3: a short tail block wins only summed over them
  kOneAboveEqual,      // 1 everywhere, token 40 2: every other decision is a tie
  kSpecialValues,      // 1 everywhere; 40: 2, 7: NaN, 250: +inf, 100..139: alternating -0 / +0 around 120: -inf
  kAllEqual,           // 0.5 everywhere
  kClusteredWithTies,  // U(0, 1e-3) (few exponents: most digits of a radix pass in few bins), 5000 ties at 7 above
};

struct TopKRow {
  std::string name;
  Scores scores = Scores::kNormal;
  int batch = 1, heads = 1, count = 1, k = 1, block_size = 1;
  int out_stride = 1;  // > 1: out_indices strided by this in its last dimension (the device's strided writes)

  TopKRow& shape(int b, int h, int n) {
    batch = b;
    heads = h;
    count = n;
    return *this;
  }
  TopKRow& keep(int kept) {
    k = kept;
    return *this;
  }
  TopKRow& blocks(int size) {
    block_size = size;
    return *this;
  }
  TopKRow& strided_out(int stride) {
    out_stride = stride;
    return *this;
  }
};
inline void PrintTo(const TopKRow& r, std::ostream* os) { *os << r.name; }
TopKRow topk_row(std::string name, Scores scores) {
  TopKRow r;
  r.name = std::move(name);
  r.scores = scores;
  return r;
}

const std::vector<TopKRow> kTopKRows = {
    // Random rows: every k, token and block ids (62 full 16-token blocks and a tail of 8), a strided output.
    topk_row("normal_b2_h3_n1000_k1", Scores::kNormal).shape(2, 3, 1000).keep(1),
    topk_row("normal_b2_h3_n1000_k17", Scores::kNormal).shape(2, 3, 1000).keep(17),
    topk_row("normal_b2_h3_n1000_k_all", Scores::kNormal).shape(2, 3, 1000).keep(1000),
    topk_row("normal_b2_h3_n1000_bs16_k1", Scores::kNormal).shape(2, 3, 1000).blocks(16).keep(1),
    topk_row("normal_b2_h3_n1000_bs16_k7", Scores::kNormal).shape(2, 3, 1000).blocks(16).keep(7),
    topk_row("normal_b2_h3_n1000_bs16_k_all", Scores::kNormal).shape(2, 3, 1000).blocks(16).keep(63),
    topk_row("normal_b2_h3_n1000_k33_out_stride3", Scores::kNormal).shape(2, 3, 1000).keep(33).strided_out(3),
    // The tail block is summed over its real tokens (no averaging, no padding).
    topk_row("tail_block_h2_n100_bs16_k1", Scores::kTailBlockWins).shape(1, 2, 100).blocks(16).keep(1),
    topk_row("tail_block_h2_n100_bs16_k3", Scores::kTailBlockWins).shape(1, 2, 100).blocks(16).keep(3),
    topk_row("tail_block_h2_n100_bs16_k_all", Scores::kTailBlockWins).shape(1, 2, 100).blocks(16).keep(7),
    // Ties: the smaller id wins, among tokens and among blocks (block 5 holds token 40, then blocks 0 and 1).
    topk_row("ties_n64_k5", Scores::kOneAboveEqual).shape(1, 1, 64).keep(5),
    topk_row("ties_n64_bs8_k3", Scores::kOneAboveEqual).shape(1, 1, 64).blocks(8).keep(3),
    // NaN below every number (-inf included), -0 == +0 (a tie: the smaller id), k through the zero run and the NaN.
    topk_row("special_n300_k1", Scores::kSpecialValues).shape(1, 1, 300).keep(1),
    topk_row("special_n300_k2", Scores::kSpecialValues).shape(1, 1, 300).keep(2),
    topk_row("special_n300_k5", Scores::kSpecialValues).shape(1, 1, 300).keep(5),
    topk_row("special_n300_k260_inside_zeros", Scores::kSpecialValues).shape(1, 1, 300).keep(260),
    topk_row("special_n300_k299_all_but_nan", Scores::kSpecialValues).shape(1, 1, 300).keep(299),
    topk_row("special_n300_k_all", Scores::kSpecialValues).shape(1, 1, 300).keep(300),
    topk_row("all_equal_n4096_k1000", Scores::kAllEqual).shape(1, 1, 4096).keep(1000),
    // Long segments: many blocks per segment in every radix pass of the device's top-k.
    topk_row("clustered_n1m_k2048", Scores::kClusteredWithTies).shape(1, 1, 1 << 20).keep(2048),
    topk_row("clustered_n1m_bs4_k2048", Scores::kClusteredWithTies).shape(1, 1, 1 << 20).blocks(4).keep(2048),
    topk_row("coarse_b2_h16_n32768_k_half", Scores::kCoarseNormal).shape(2, 16, 32768).keep(16384),
};

SPARSA_BACKEND_TABLE(TopKCases, TopKRow, kTopKRows);

std::vector<float> topk_scores(const TopKRow& r, st::Rng& rng) {
  const size_t rows = size_t(r.batch) * r.heads, n = size_t(r.count);
  std::vector<float> s(rows * n);
  switch (r.scores) {
    case Scores::kNormal:
      for (float& x : s) x = float(rng.normal());
      break;
    case Scores::kCoarseNormal:
      for (float& x : s) x = float(std::round(rng.normal() * 64.0) / 64.0);
      break;
    case Scores::kTailBlockWins:
      for (float& x : s) x = float(rng.uniform(0, 1));
      for (size_t row = 0; row < rows; ++row)
        for (size_t t = n - 4; t < n; ++t) s[row * n + t] = 3.0f;
      break;
    case Scores::kOneAboveEqual:
      std::fill(s.begin(), s.end(), 1.0f);
      s[40] = 2.0f;
      break;
    case Scores::kSpecialValues:
      std::fill(s.begin(), s.end(), 1.0f);
      s[40] = 2.0f;
      s[7] = std::numeric_limits<float>::quiet_NaN();
      s[250] = std::numeric_limits<float>::infinity();
      for (int t = 100; t < 140; ++t) s[t] = (t % 2) ? -0.0f : 0.0f;
      s[120] = -std::numeric_limits<float>::infinity();
      break;
    case Scores::kAllEqual:
      std::fill(s.begin(), s.end(), 0.5f);
      break;
    case Scores::kClusteredWithTies:
      for (float& x : s) x = float(rng.uniform(0, 1)) * 1e-3f;
      for (int i = 0; i < 5000; ++i) s[size_t(rng.integer(0, int(s.size()) - 1))] = 7.0f;
      break;
  }
  return s;
}

// The header's contract for one row (sparsa.h, sparsa_topk_from_scores; ALGORITHMS.md §0 and §7): block sums over
// [id·bs, (id+1)·bs) in float64 (the tail over its real tokens); larger first, NaN below every number, ties (-0 ==
// +0 included) to the smaller id; the k ids ascending.
std::vector<int32_t> reference_topk(const float* scores, int count, int k, int block_size) {
  std::vector<double> value((count + block_size - 1) / block_size, 0.0);
  for (int t = 0; t < count; ++t) value[t / block_size] += double(scores[t]);
  const ref::IndexSet kept = ref::top_k(value, k);
  return std::vector<int32_t>(kept.begin(), kept.end());
}

TEST_P(TopKCases, MatchesTheReferenceExactly) {
  const TopKRow& r = row();
  st::Rng rng(st::test_seed(0));
  const std::vector<float> scores = topk_scores(r, rng);
  const int64_t s = r.out_stride;
  st::Buffer in(ctx(), SPARSA_DTYPE_F32, {r.batch, r.heads, r.count});
  st::Buffer out(ctx(), SPARSA_DTYPE_I32, {r.batch, r.heads, r.k}, {int64_t(r.heads) * r.k * s, r.k * s, s});
  std::memcpy(in.host().data(), scores.data(), scores.size() * sizeof(float));
  constexpr int32_t kPoison = int32_t(0xabababab);  // negative: never an id
  std::fill(out.as<int32_t>(), out.as<int32_t>() + out.elements(), kPoison);
  in.upload();
  out.upload();
  const sparsa_tensor ts = in.tensor(), to = out.tensor();
  ASSERT_EQ(sparsa_topk_from_scores(ctx().get(), &ts, r.k, r.block_size, &to), SPARSA_STATUS_SUCCESS)
      << sparsa_last_error_message();
  out.download();
  const int32_t* got = out.as<int32_t>();
  for (size_t e = 0; e < out.elements(); ++e) {
    if (e % size_t(s) != 0) {
      ASSERT_EQ(got[e], kPoison) << "element " << e << " between the strided slots written";
    }
  }
  for (int row_id = 0; row_id < r.batch * r.heads; ++row_id) {
    const std::vector<int32_t> want = reference_topk(&scores[size_t(row_id) * r.count], r.count, r.k, r.block_size);
    for (int j = 0; j < r.k; ++j) {
      ASSERT_EQ(got[(size_t(row_id) * r.k + j) * s], want[j]) << "row " << row_id << ", slot " << j << " of " << r.k;
    }
  }
}

TEST_P(TopK, KOutsideOneToCountIsAShapeMismatch) {
  std::vector<float> scores(50, 0.5f);
  std::vector<int32_t> out(64, -7);
  sparsa_tensor s = st::host_tensor(scores.data(), SPARSA_DTYPE_F32, {1, 1, 50});
  for (auto [k, bs] : {std::pair{0, 1}, {51, 1}, {8, 8}}) {  // 50 tokens in 8-blocks: 7 blocks
    sparsa_tensor o = st::host_tensor(out.data(), SPARSA_DTYPE_I32, {1, 1, k});
    EXPECT_EQ(sparsa_topk_from_scores(ctx().get(), &s, k, bs, &o), SPARSA_STATUS_SHAPE_MISMATCH) << k << " " << bs;
    for (int32_t x : out) ASSERT_EQ(x, -7);
  }
}

// ------------------------------------------------------------------------------------------------------ prefetch
struct Prefetched {
  std::vector<float> k_dst, v_dst;
  std::vector<int32_t> positions, remapped, counts;
};

TEST_P(KvPrefetch, GathersTheSortedUnionAndRemapsIndicesThenDecodeMatchesTheFullCache) {
  ST_RNG(rng, 0);
  const int B = 2, N = 120, Hkv = 2, D = 64, Hq = 4, h_idx = 2, k = 12, C = 30;
  ref::Problem full = st::make_problem(B, Hq, Hkv, D, {1}, {N}, true);
  st::fill(full, Pattern::kNeedles, rng);
  ref::TokenIndicesParams tp;
  tp.h_idx = h_idx;
  tp.k = k;
  for (int e = 0; e < B * h_idx * k; ++e) tp.indices.push_back(rng.uniform(0, 1) < 0.1 ? -1 : rng.integer(0, N - 1));

  std::vector<float> k_src, v_src;
  for (int b = 0; b < B; ++b) {
    k_src.insert(k_src.end(), full.k[b].begin(), full.k[b].end());
    v_src.insert(v_src.end(), full.v[b].begin(), full.v[b].end());
  }
  constexpr float kUntouched = 12345.0f;
  Prefetched pf{std::vector<float>(size_t(B) * C * Hkv * D, kUntouched), std::vector<float>(size_t(B) * C * Hkv * D, kUntouched),
                std::vector<int32_t>(size_t(B) * C, -7), std::vector<int32_t>(tp.indices.size(), -7),
                std::vector<int32_t>(B, -7)};
  sparsa_tensor ks = st::host_tensor(k_src.data(), SPARSA_DTYPE_F32, {B, N, Hkv, D});
  sparsa_tensor vs = st::host_tensor(v_src.data(), SPARSA_DTYPE_F32, {B, N, Hkv, D});
  sparsa_tensor idx = st::host_tensor(tp.indices.data(), SPARSA_DTYPE_I32, {B, h_idx, k});
  sparsa_tensor kd = st::host_tensor(pf.k_dst.data(), SPARSA_DTYPE_F32, {B, C, Hkv, D});
  sparsa_tensor vd = st::host_tensor(pf.v_dst.data(), SPARSA_DTYPE_F32, {B, C, Hkv, D});
  sparsa_tensor pos = st::host_tensor(pf.positions.data(), SPARSA_DTYPE_I32, {B, C});
  sparsa_tensor rem = st::host_tensor(pf.remapped.data(), SPARSA_DTYPE_I32, {B, h_idx, k});
  sparsa_tensor cnt = st::host_tensor(pf.counts.data(), SPARSA_DTYPE_I32, {B});
  ASSERT_EQ(sparsa_kv_prefetch(ctx().get(), &ks, &vs, &idx, &kd, &vd, &pos, &rem, &cnt), SPARSA_STATUS_SUCCESS)
      << sparsa_last_error_message();

  ref::Problem compact = st::make_problem(B, Hq, Hkv, D, {1}, {1}, true);
  compact.q = full.q;
  for (int b = 0; b < B; ++b) {
    std::set<int> uni;
    for (int e = 0; e < h_idx * k; ++e)
      if (tp.indices[size_t(b) * h_idx * k + e] >= 0) uni.insert(tp.indices[size_t(b) * h_idx * k + e]);
    const std::vector<int> sorted(uni.begin(), uni.end());
    ASSERT_EQ(pf.counts[b], int(sorted.size()));
    for (int c = 0; c < C; ++c) {
      EXPECT_EQ(pf.positions[size_t(b) * C + c], c < int(sorted.size()) ? sorted[c] : -1) << "b=" << b << " c=" << c;
      for (int x = 0; x < Hkv * D; ++x) {
        const size_t dst = (size_t(b) * C + c) * Hkv * D + x;
        if (c < int(sorted.size())) {
          EXPECT_EQ(pf.k_dst[dst], k_src[(size_t(b) * N + sorted[c]) * Hkv * D + x]);
          EXPECT_EQ(pf.v_dst[dst], v_src[(size_t(b) * N + sorted[c]) * Hkv * D + x]);
        } else {
          EXPECT_EQ(pf.k_dst[dst], kUntouched) << "rows past the union must be left untouched";
        }
      }
    }
    for (int e = 0; e < h_idx * k; ++e) {
      const int id = tp.indices[size_t(b) * h_idx * k + e];
      const int want = id < 0 ? -1 : int(std::lower_bound(sorted.begin(), sorted.end(), id) - sorted.begin());
      EXPECT_EQ(pf.remapped[size_t(b) * h_idx * k + e], want);
    }
    compact.skv[b] = int(sorted.size());
    compact.k[b].assign(pf.k_dst.begin() + size_t(b) * C * Hkv * D, pf.k_dst.begin() + (size_t(b) * C + sorted.size()) * Hkv * D);
    compact.v[b].assign(pf.v_dst.begin() + size_t(b) * C * Hkv * D, pf.v_dst.begin() + (size_t(b) * C + sorted.size()) * Hkv * D);
  }

  // Decode over the compact buffer with the remapped indices equals decode over the full cache.
  const ref::TokenIndicesResult want = ref::token_indices(full, tp);
  sparsa_policy pol = st::make_policy(SPARSA_POLICY_TOKEN_INDICES);
  st::RunOptions opt;
  opt.indices = pf.remapped;
  opt.h_idx = h_idx;
  opt.k = k;
  opt.seq_lens_k = true;
  st::run_and_compare(ctx(), compact, pol, want.out, opt);
}

TEST_P(KvPrefetch, CompactBufferTooSmallIsAShapeMismatch) {
  const int B = 1, N = 40, Hkv = 1, D = 64, k = 10, C = 5;
  std::vector<float> src(size_t(B) * N * Hkv * D, 1.0f), dst(size_t(B) * C * Hkv * D, 7.0f);
  std::vector<int32_t> indices = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9}, positions(C, -7), remapped(k, -7);
  sparsa_tensor s = st::host_tensor(src.data(), SPARSA_DTYPE_F32, {B, N, Hkv, D});
  sparsa_tensor idx = st::host_tensor(indices.data(), SPARSA_DTYPE_I32, {B, 1, k});
  sparsa_tensor d = st::host_tensor(dst.data(), SPARSA_DTYPE_F32, {B, C, Hkv, D});
  sparsa_tensor pos = st::host_tensor(positions.data(), SPARSA_DTYPE_I32, {B, C});
  sparsa_tensor rem = st::host_tensor(remapped.data(), SPARSA_DTYPE_I32, {B, 1, k});
  const sparsa_status s1 = sparsa_kv_prefetch(ctx().get(), &s, &s, &idx, &d, &d, &pos, &rem, nullptr);
  EXPECT_TRUE(s1 == SPARSA_STATUS_SHAPE_MISMATCH || s1 == SPARSA_STATUS_INDEX_OUT_OF_RANGE) << sparsa_status_string(s1);
  for (float x : dst) ASSERT_EQ(x, 7.0f);
  for (int32_t x : positions) ASSERT_EQ(x, -7);
}

// ------------------------------------------------------------------------------------------------------ mapping
TEST_P(HeadMapping, PicksTheDraftHeadWithTheLargestSummedTopKOverlap) {
  ST_RNG(rng, 0);
  const int T = 3, Hd = 4, Ht = 6, N = 80, k = 10;
  std::vector<float> draft(size_t(T) * Hd * N), target(size_t(T) * Ht * N);
  for (float& x : draft) x = float(rng.uniform(0, 1));
  // Target head ht copies draft head (ht % Hd) plus noise, so the mapping is non-trivial but known.
  for (int t = 0; t < T; ++t)
    for (int ht = 0; ht < Ht; ++ht)
      for (int n = 0; n < N; ++n)
        target[(size_t(t) * Ht + ht) * N + n] = draft[(size_t(t) * Hd + ht % Hd) * N + n] + float(0.05 * rng.normal());
  std::vector<int32_t> map(Ht, -7);
  sparsa_tensor dt = st::host_tensor(draft.data(), SPARSA_DTYPE_F32, {T, Hd, N});
  sparsa_tensor tt = st::host_tensor(target.data(), SPARSA_DTYPE_F32, {T, Ht, N});
  sparsa_tensor mt = st::host_tensor(map.data(), SPARSA_DTYPE_I32, {Ht});
  ASSERT_EQ(sparsa_head_mapping(&dt, &tt, k, &mt), SPARSA_STATUS_SUCCESS) << sparsa_last_error_message();
  for (int ht = 0; ht < Ht; ++ht) {
    int best = -1, best_overlap = -1;
    for (int hd = 0; hd < Hd; ++hd) {
      int overlap = 0;
      for (int t = 0; t < T; ++t) {
        const std::vector<double> ds(draft.begin() + (size_t(t) * Hd + hd) * N, draft.begin() + (size_t(t) * Hd + hd + 1) * N);
        const std::vector<double> ts(target.begin() + (size_t(t) * Ht + ht) * N, target.begin() + (size_t(t) * Ht + ht + 1) * N);
        const ref::IndexSet a = ref::top_k(ds, k), b = ref::top_k(ts, k);
        std::vector<int> both;
        std::set_intersection(a.begin(), a.end(), b.begin(), b.end(), std::back_inserter(both));
        overlap += int(both.size());
      }
      if (overlap > best_overlap) {
        best_overlap = overlap;
        best = hd;
      }
    }
    EXPECT_EQ(map[ht], best) << "target head " << ht;
  }
}

}  // namespace
