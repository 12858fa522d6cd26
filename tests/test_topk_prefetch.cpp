// §7 utilities: top-k from draft scores (token and block ids), STS head mapping, and the KV prefetch whose compact
// buffer a TOKEN_INDICES decode run can use in place of the full cache.
#include <algorithm>
#include <cmath>
#include <set>

#include "test_util.h"

namespace {

using st::Pattern;

SPARSA_BACKEND_SUITE(TopK);
SPARSA_BACKEND_SUITE(KvPrefetch);
SPARSA_BACKEND_SUITE(HeadMapping);

// Reference of sparsa_topk_from_scores for one row: block sums (tail over its real tokens), top-k, ascending ids.
ref::IndexSet reference_topk(const float* scores, int N, int k, int block_size) {
  const int n_blocks = (N + block_size - 1) / block_size;
  std::vector<double> block(n_blocks, 0.0);
  for (int t = 0; t < N; ++t) block[t / block_size] += scores[t];
  return ref::top_k(block, k);
}

// Runs sparsa_topk_from_scores and compares every row with the reference.
void check_topk(const st::Context& ctx, const std::vector<float>& scores, int B, int H, int N, int k, int block_size) {
  std::vector<int32_t> out(size_t(B) * H * k, -7);
  sparsa_tensor s = st::host_tensor(const_cast<float*>(scores.data()), SPARSA_DTYPE_F32, {B, H, N});
  sparsa_tensor o = st::host_tensor(out.data(), SPARSA_DTYPE_I32, {B, H, k});
  ASSERT_EQ(sparsa_topk_from_scores(ctx.get(), &s, k, block_size, &o), SPARSA_STATUS_SUCCESS) << sparsa_last_error_message();
  for (int row = 0; row < B * H; ++row) {
    const ref::IndexSet want = reference_topk(scores.data() + size_t(row) * N, N, k, block_size);
    const std::vector<int32_t> got(out.begin() + size_t(row) * k, out.begin() + size_t(row + 1) * k);
    EXPECT_EQ(got, std::vector<int32_t>(want.begin(), want.end())) << "row " << row;
  }
}

TEST_P(TopK, TokenIdsOfTheKLargestScoresSortedAscending) {
  ST_RNG(rng, 0);
  const int B = 2, H = 3, N = 300;
  std::vector<float> scores(size_t(B) * H * N);
  for (float& x : scores) x = float(rng.normal());
  for (int k : {1, 17, 300}) check_topk(ctx(), scores, B, H, N, k, 1);
}

TEST_P(TopK, BlockIdsRankBlockSumsAndTheTailBlockSumsItsRealTokens) {
  ST_RNG(rng, 0);
  const int B = 1, H = 2, N = 100;  // 16-token blocks: 6 full + a tail of 4
  std::vector<float> scores(size_t(B) * H * N);
  for (float& x : scores) x = float(rng.uniform(0, 1));
  // Make the 4-token tail block win only if summed over its real tokens (no averaging, no padding).
  for (int h = 0; h < H; ++h)
    for (int t = 96; t < 100; ++t) scores[size_t(h) * N + t] = 3.0f;
  for (int k : {1, 3, 7}) check_topk(ctx(), scores, B, H, N, k, 16);
}

TEST_P(TopK, TiesPreferSmallerIndex) {
  const int N = 64;
  std::vector<float> scores(N, 1.0f);
  scores[40] = 2.0f;
  check_topk(ctx(), scores, 1, 1, N, 5, 1);  // {0, 1, 2, 3, 40}
  check_topk(ctx(), scores, 1, 1, N, 3, 8);  // block 5 holds 40, then blocks 0 and 1
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
