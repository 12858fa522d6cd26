// The header's selection utilities as ALGORITHMS.md defines their parts: top-k from scores (ties, tail block
// sums), head mapping, the drift quantile, the Hilbert order.
// The edges the spec names and the ones it implies, on the CPU backend (the library's oracle). Expected outputs come
// from the float64 reference (tests/reference) through spec_test_util.h.
#include "spec_test_util.h"

namespace {

TEST(SpecUtilities, TopkFromScoresTiesAndTailBlockSums) {
  Cpu c;
  std::vector<float> scores = {1, 3, 3, 0, 3, 2, 2, 2, 5};  // [1, 1, 9]
  sparsa_tensor ts = st::host_tensor(scores.data(), SPARSA_DTYPE_F32, {1, 1, 9});
  std::vector<int32_t> out(3, -7);
  sparsa_tensor to = st::host_tensor(out.data(), SPARSA_DTYPE_I32, {1, 1, 3});
  ASSERT_EQ(sparsa_topk_from_scores(c.ctx.get(), &ts, 3, 1, &to), SPARSA_STATUS_SUCCESS);
  EXPECT_EQ(out, (std::vector<int32_t>{1, 2, 8}));  // 5, then 3 (ids 1, 2, 4 tie: 1 and 2 win)
  // Blocks of 4: sums 7, 9, 5 (tail block = 5 over its one real token); k = 2 → {0, 1}.
  std::vector<int32_t> out2(2, -7);
  sparsa_tensor to2 = st::host_tensor(out2.data(), SPARSA_DTYPE_I32, {1, 1, 2});
  ASSERT_EQ(sparsa_topk_from_scores(c.ctx.get(), &ts, 2, 4, &to2), SPARSA_STATUS_SUCCESS);
  EXPECT_EQ(out2, (std::vector<int32_t>{0, 1}));
  // Blocks of 3: sums 7, 5, 9 → k = 1 → {2}; blocks of 2: 4, 3, 5, 4, 5 → k = 2: ties of 5 → {2, 4}.
  std::vector<int32_t> out3(2, -7);
  sparsa_tensor to3 = st::host_tensor(out3.data(), SPARSA_DTYPE_I32, {1, 1, 2});
  ASSERT_EQ(sparsa_topk_from_scores(c.ctx.get(), &ts, 2, 2, &to3), SPARSA_STATUS_SUCCESS);
  EXPECT_EQ(out3, (std::vector<int32_t>{2, 4}));
  // Equal-sum blocks tie → smaller block id: blocks of 2 over {1,1,2,0,1,1}: sums 2, 2, 2; k = 2 → {0, 1}.
  std::vector<float> flat = {1, 1, 2, 0, 1, 1};
  sparsa_tensor tf = st::host_tensor(flat.data(), SPARSA_DTYPE_F32, {1, 1, 6});
  ASSERT_EQ(sparsa_topk_from_scores(c.ctx.get(), &tf, 2, 2, &to3), SPARSA_STATUS_SUCCESS);
  EXPECT_EQ(out3, (std::vector<int32_t>{0, 1}));
}

TEST(SpecUtilities, HeadMappingTiesGoToTheSmallerDraftHead) {
  // T = 1, N = 4, k = 2. Draft heads 0 and 1 both overlap target head 0 in one token; draft 2 in two.
  std::vector<float> draft = {4, 3, 0, 0,   // hd 0: {0, 1}
                              0, 4, 0, 3,   // hd 1: {1, 3}
                              0, 0, 4, 3};  // hd 2: {2, 3}
  std::vector<float> target = {0, 3, 4, 0,   // ht 0: {1, 2} → hd0 1, hd1 1, hd2 1: tie → 0
                               1, 1, 1, 1};  // ht 1: all tie → topk {0, 1} → hd0 2 → 0
  std::vector<int32_t> map(2, -7);
  sparsa_tensor td = st::host_tensor(draft.data(), SPARSA_DTYPE_F32, {1, 3, 4});
  sparsa_tensor tt = st::host_tensor(target.data(), SPARSA_DTYPE_F32, {1, 2, 4});
  sparsa_tensor tm = st::host_tensor(map.data(), SPARSA_DTYPE_I32, {2});
  ASSERT_EQ(sparsa_head_mapping(&td, &tt, 2, &tm), SPARSA_STATUS_SUCCESS);
  EXPECT_EQ(map, (std::vector<int32_t>{0, 0}));
  // ht = {2, 3}: hd2 overlaps 2, hd1 1 → 2.
  std::vector<float> target2 = {0, 0, 4, 3};
  sparsa_tensor tt2 = st::host_tensor(target2.data(), SPARSA_DTYPE_F32, {1, 1, 4});
  sparsa_tensor tm2 = st::host_tensor(map.data(), SPARSA_DTYPE_I32, {1});
  ASSERT_EQ(sparsa_head_mapping(&td, &tt2, 2, &tm2), SPARSA_STATUS_SUCCESS);
  EXPECT_EQ(map[0], 2);
}

TEST(SpecUtilities, DriftQuantileLinearInterpolation) {
  // L = 4 layers, T = 1, D = 1: h_in = 1, h_out = 1 + r → R = r. R = {0.4, 0.1, 0.3, 0.2}.
  std::vector<float> h_in = {1, 1, 1, 1}, h_out = {1.4f, 1.1f, 1.3f, 1.2f};
  std::vector<float> ratio(4);
  std::vector<uint8_t> sparse(4, 9);
  sparsa_tensor ti = st::host_tensor(h_in.data(), SPARSA_DTYPE_F32, {4, 1, 1});
  sparsa_tensor to = st::host_tensor(h_out.data(), SPARSA_DTYPE_F32, {4, 1, 1});
  sparsa_tensor tr = st::host_tensor(ratio.data(), SPARSA_DTYPE_F32, {4});
  sparsa_tensor ts = st::host_tensor(sparse.data(), SPARSA_DTYPE_U8, {4});
  // δ = 0.5: numpy quantile of {0.1, 0.2, 0.3, 0.4} = 0.25 → layers with R <= 0.25: 0.1, 0.2.
  ASSERT_EQ(sparsa_drift_select_layers(&ti, &to, 0.5f, &tr, &ts), SPARSA_STATUS_SUCCESS);
  EXPECT_EQ(sparse, (std::vector<uint8_t>{0, 1, 0, 1}));
  EXPECT_NEAR(ratio[0], 0.4, 1e-6);
  // δ = 1/3: position 1 exactly → 0.2 → {0.1, 0.2} (<=).
  ASSERT_EQ(sparsa_drift_select_layers(&ti, &to, 1.f / 3.f, &tr, &ts), SPARSA_STATUS_SUCCESS);
  EXPECT_EQ(sparse, (std::vector<uint8_t>{0, 1, 0, 1}));
  // δ = 0: min → only 0.1; δ = 1: max → all.
  ASSERT_EQ(sparsa_drift_select_layers(&ti, &to, 0.f, &tr, &ts), SPARSA_STATUS_SUCCESS);
  EXPECT_EQ(sparse, (std::vector<uint8_t>{0, 1, 0, 0}));
  ASSERT_EQ(sparsa_drift_select_layers(&ti, &to, 1.f, &tr, &ts), SPARSA_STATUS_SUCCESS);
  EXPECT_EQ(sparse, (std::vector<uint8_t>{1, 1, 1, 1}));
}

TEST(SpecUtilities, HilbertSingleCellAndLine) {
  int32_t perm[8] = {-1, -1, -1, -1, -1, -1, -1, -1}, inverse[8] = {-1, -1, -1, -1, -1, -1, -1, -1};
  ASSERT_EQ(sparsa_hilbert_permutation(1, 1, 1, perm, inverse, 8), SPARSA_STATUS_SUCCESS);
  EXPECT_EQ(perm[0], 0);
  EXPECT_EQ(inverse[0], 0);
  EXPECT_EQ(perm[1], -1);  // n = 1: nothing else written
  // A 1×1×3 grid: a permutation of {0, 1, 2} whose consecutive cells are grid neighbours (Hilbert locality).
  ASSERT_EQ(sparsa_hilbert_permutation(1, 1, 3, perm, inverse, 8), SPARSA_STATUS_SUCCESS);
  std::vector<int32_t> seen(perm, perm + 3);
  std::sort(seen.begin(), seen.end());
  EXPECT_EQ(seen, (std::vector<int32_t>{0, 1, 2}));
  for (int i = 0; i < 3; ++i) EXPECT_EQ(inverse[perm[i]], i);
}

}  // namespace
