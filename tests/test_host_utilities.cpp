// Host utilities: Hilbert permutation (§4), drift layer selection (§5), STS head mapping (§7) and the SpargeAttn
// tuner (§4, needs the CPU backend).
#include <gtest/gtest.h>
#include <sparsa/sparsa.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <limits>
#include <random>
#include <vector>

namespace {

sparsa_tensor make_tensor(void* data, int32_t dtype, std::vector<int64_t> shape) {
  sparsa_tensor t;
  EXPECT_EQ(sparsa_tensor_init(&t, sizeof t, data, dtype, int32_t(shape.size()), shape.data()), SPARSA_STATUS_SUCCESS);
  return t;
}

// ---- Hilbert ----------------------------------------------------------------------------------------------------

std::vector<int32_t> hilbert(int32_t t, int32_t h, int32_t w, std::vector<int32_t>* inverse = nullptr) {
  std::vector<int32_t> perm(size_t(t) * h * w, -1), inv(perm.size(), -1);
  EXPECT_EQ(sparsa_hilbert_permutation(t, h, w, perm.data(), inv.data(), int64_t(perm.size())), SPARSA_STATUS_SUCCESS)
      << sparsa_last_error_message();
  if (inverse) *inverse = inv;
  return perm;
}

TEST(Hilbert, IsAPermutationWithItsInverse) {
  const int32_t grids[][3] = {
      {1, 1, 1}, {2, 2, 2}, {3, 5, 2},    {4, 4, 4},   {1, 7, 3},
      {6, 1, 1}, {5, 6, 7}, {1, 1, 5000}, {2, 3, 1000}};  // thin grids: sub-cubes outside are pruned
  for (const auto& g : grids) {
    SCOPED_TRACE(testing::Message() << g[0] << "x" << g[1] << "x" << g[2]);
    std::vector<int32_t> inverse;
    const std::vector<int32_t> perm = hilbert(g[0], g[1], g[2], &inverse);
    std::vector<int32_t> sorted = perm;
    std::sort(sorted.begin(), sorted.end());
    for (size_t i = 0; i < sorted.size(); ++i) ASSERT_EQ(sorted[i], int32_t(i));
    for (size_t i = 0; i < perm.size(); ++i) ASSERT_EQ(inverse[size_t(perm[i])], int32_t(i));
  }
}

TEST(Hilbert, ConsecutiveCellsOfAFullCubeAreFaceAdjacent) {
  for (int32_t side : {2, 4, 8, 16}) {
    SCOPED_TRACE(side);
    const std::vector<int32_t> perm = hilbert(side, side, side);
    for (size_t i = 1; i < perm.size(); ++i) {
      const int32_t a = perm[i - 1], b = perm[i];
      const int32_t dt = std::abs(a / (side * side) - b / (side * side));
      const int32_t dh = std::abs((a / side) % side - (b / side) % side);
      const int32_t dw = std::abs(a % side - b % side);
      ASSERT_EQ(dt + dh + dw, 1) << "cells " << a << " and " << b << " at step " << i;
    }
  }
}

TEST(Hilbert, TwoByTwoByTwoIsTheGrayCodeOrder) {
  // Skilling's curve with axes (t, h, w) visits (t,h,w) = 000, 001, 011, 010, 110, 111, 101, 100.
  EXPECT_EQ(hilbert(2, 2, 2), (std::vector<int32_t>{0, 1, 3, 2, 6, 7, 5, 4}));
}

TEST(Hilbert, NullOutputsAndBadExtents) {
  EXPECT_EQ(sparsa_hilbert_permutation(2, 3, 4, nullptr, nullptr, 0), SPARSA_STATUS_SUCCESS);
  int32_t perm[4] = {-7, -7, -7, -7};
  EXPECT_EQ(sparsa_hilbert_permutation(0, 2, 2, perm, nullptr, 4), SPARSA_STATUS_INVALID_ARGUMENT);
  EXPECT_NE(std::string(sparsa_last_error_message()).find("t:"), std::string::npos);
  EXPECT_EQ(perm[0], -7);
}

// Each buffer holds `capacity` entries: a grid larger than that is refused before anything is written, whichever
// buffer is given; the exact capacity is enough.
TEST(Hilbert, CapacityIsChecked) {
  struct Case {
    int32_t t, h, w;
    bool give_perm, give_inverse;
    int64_t capacity;
    sparsa_status expected;
    const char* message;
  };
  const Case cases[] = {
      {2, 2, 2, true, true, 8, SPARSA_STATUS_SUCCESS, ""},
      {2, 2, 2, true, true, 7, SPARSA_STATUS_SHAPE_MISMATCH,
       "capacity: the buffers hold 7 int32 entries but the 2x2x2 grid needs 8"},
      {2, 2, 2, true, false, 4, SPARSA_STATUS_SHAPE_MISMATCH, "needs 8"},
      {2, 2, 2, false, true, 0, SPARSA_STATUS_SHAPE_MISMATCH, "needs 8"},
      {2, 2, 2, false, false, 0, SPARSA_STATUS_SUCCESS, ""},
      {2, 2, 2, true, true, -1, SPARSA_STATUS_INVALID_ARGUMENT, "capacity: expected >= 0, got -1"},
  };
  constexpr int kGuard = 4;
  for (const Case& c : cases) {
    SCOPED_TRACE(testing::Message() << c.t << "x" << c.h << "x" << c.w << " capacity " << c.capacity);
    const size_t room = size_t(std::max<int64_t>(c.capacity, 0)) + kGuard;
    std::vector<int32_t> perm(room, -7), inverse(room, -7);
    const sparsa_status status = sparsa_hilbert_permutation(c.t, c.h, c.w, c.give_perm ? perm.data() : nullptr,
                                                            c.give_inverse ? inverse.data() : nullptr, c.capacity);
    EXPECT_EQ(status, c.expected) << sparsa_last_error_message();
    const std::string message = sparsa_last_error_message();
    EXPECT_NE(message.find(c.message), std::string::npos) << message;
    const size_t written = status == SPARSA_STATUS_SUCCESS ? size_t(c.t) * c.h * c.w : 0;
    for (size_t i = written; i < room; ++i) {
      EXPECT_EQ(perm[i], -7) << "perm[" << i << "]";
      EXPECT_EQ(inverse[i], -7) << "inverse[" << i << "]";
    }
  }
}

// ---- Drift ------------------------------------------------------------------------------------------------------

// Poisoned outputs for L layers, with their descriptors.
struct DriftOutputs {
  std::vector<float> ratio;
  std::vector<uint8_t> sparse;
  sparsa_tensor t_ratio, t_sparse;
  explicit DriftOutputs(int64_t layers) : ratio(size_t(layers), -1.f), sparse(size_t(layers), 9) {
    t_ratio = make_tensor(ratio.data(), SPARSA_DTYPE_F32, {layers});
    t_sparse = make_tensor(sparse.data(), SPARSA_DTYPE_U8, {layers});
  }
};

TEST(Drift, MatchesAHandComputedExample) {
  // L = 3 layers, T = 2 tokens, D = 2. Per-token ratios ‖out − in‖ / ‖in‖:
  //   layer 0: out == in → 0, 0 → R = 0
  //   layer 1: in (3,4) → out (3,9): 5/5 = 1; in (1,0) → out (1,0.5): 0.5 → R = 0.75
  //   layer 2: out = 2·in → 1, 1 → R = 1
  std::vector<float> h_in = {1, 0, 0, 1, /**/ 3, 4, 1, 0, /**/ 2, 0, 0, 2};
  std::vector<float> h_out = {1, 0, 0, 1, /**/ 3, 9, 1, 0.5f, /**/ 4, 0, 0, 4};
  sparsa_tensor t_in = make_tensor(h_in.data(), SPARSA_DTYPE_F32, {3, 2, 2});
  sparsa_tensor t_out = make_tensor(h_out.data(), SPARSA_DTYPE_F32, {3, 2, 2});
  DriftOutputs out(3);

  // δ = 0.5: numpy.quantile([0, 0.75, 1], 0.5) = 0.75 → layers 0 and 1 are sparse.
  ASSERT_EQ(sparsa_drift_select_layers(&t_in, &t_out, 0.5f, &out.t_ratio, &out.t_sparse), SPARSA_STATUS_SUCCESS)
      << sparsa_last_error_message();
  EXPECT_NEAR(out.ratio[0], 0.f, 1e-6);
  EXPECT_NEAR(out.ratio[1], 0.75f, 1e-6);
  EXPECT_NEAR(out.ratio[2], 1.f, 1e-6);
  EXPECT_EQ(out.sparse, (std::vector<uint8_t>{1, 1, 0}));
  // δ = 0.25: quantile = 0 + (0.75 − 0)·0.5 = 0.375 → only layer 0.
  ASSERT_EQ(sparsa_drift_select_layers(&t_in, &t_out, 0.25f, nullptr, &out.t_sparse), SPARSA_STATUS_SUCCESS);
  EXPECT_EQ(out.sparse, (std::vector<uint8_t>{1, 0, 0}));
  // δ = 1: everything is <= the maximum.
  ASSERT_EQ(sparsa_drift_select_layers(&t_in, &t_out, 1.f, nullptr, &out.t_sparse), SPARSA_STATUS_SUCCESS);
  EXPECT_EQ(out.sparse, (std::vector<uint8_t>{1, 1, 1}));

  EXPECT_EQ(sparsa_drift_select_layers(&t_in, &t_out, 1.5f, &out.t_ratio, &out.t_sparse),
            SPARSA_STATUS_INVALID_ARGUMENT);
  EXPECT_NE(std::string(sparsa_last_error_message()).find("delta"), std::string::npos);
  t_out.shape[1] = 1;
  EXPECT_EQ(sparsa_drift_select_layers(&t_in, &t_out, 0.5f, &out.t_ratio, &out.t_sparse), SPARSA_STATUS_SHAPE_MISMATCH);
  EXPECT_NE(std::string(sparsa_last_error_message()).find("h_out"), std::string::npos);
}

// A NaN ratio makes the quantile NaN (numpy's answer; sorting a NaN would also break std::sort's ordering): no
// layer is sparse, every ratio is still written.
TEST(Drift, ANanRatioMakesNoLayerSparse) {
  const float nan = std::numeric_limits<float>::quiet_NaN(), inf = std::numeric_limits<float>::infinity();
  // Layer 1's h_in is NaN (R NaN); layer 3's h_out is infinite (R inf); the others finite.
  std::vector<float> h_in = {1, 0, /**/ nan, 1, /**/ 2, 0, /**/ 1, 1, /**/ 0, 3, /**/ 1, 2};
  std::vector<float> h_out = {1, 0, /**/ 1, 1, /**/ 4, 0, /**/ inf, 1, /**/ 0, 3, /**/ 1, 2};
  sparsa_tensor t_in = make_tensor(h_in.data(), SPARSA_DTYPE_F32, {6, 1, 2});
  sparsa_tensor t_out = make_tensor(h_out.data(), SPARSA_DTYPE_F32, {6, 1, 2});
  DriftOutputs out(6);
  for (float delta : {0.f, 0.5f, 1.f}) {
    SCOPED_TRACE(delta);
    ASSERT_EQ(sparsa_drift_select_layers(&t_in, &t_out, delta, &out.t_ratio, &out.t_sparse), SPARSA_STATUS_SUCCESS)
        << sparsa_last_error_message();
    EXPECT_EQ(out.sparse, std::vector<uint8_t>(6, 0));
    EXPECT_EQ(out.ratio[0], 0.f);
    EXPECT_TRUE(std::isnan(out.ratio[1]));
    EXPECT_NEAR(out.ratio[2], 1.f, 1e-6);
    EXPECT_EQ(out.ratio[3], inf);
  }
  // Without the NaN the infinite ratio sorts last like any value: δ = 0.5 over {0, 0, 1, inf, 0, 0} gives 0.
  h_in[2] = 1;
  ASSERT_EQ(sparsa_drift_select_layers(&t_in, &t_out, 0.5f, &out.t_ratio, &out.t_sparse), SPARSA_STATUS_SUCCESS);
  EXPECT_EQ(out.sparse, (std::vector<uint8_t>{1, 1, 0, 0, 1, 1}));
}

// D = 0: every ratio is 0 (empty norms), whatever T the empty tensors declare; T = 2^32 + 1 took a minute when the
// tokens were walked (found by fuzz_utilities: tests/fuzz/corpus/fuzz_utilities/drift-empty-hidden-dimension).
TEST(Drift, AnEmptyHiddenDimensionGivesZeroRatiosWithoutWalkingTheTokens) {
  float storage = 0.f;
  const int64_t tokens = (int64_t(1) << 32) + 1;
  sparsa_tensor t_in = make_tensor(&storage, SPARSA_DTYPE_F32, {2, tokens, 0});
  sparsa_tensor t_out = make_tensor(&storage, SPARSA_DTYPE_F32, {2, tokens, 0});
  DriftOutputs out(2);
  ASSERT_EQ(sparsa_drift_select_layers(&t_in, &t_out, 0.5f, &out.t_ratio, &out.t_sparse), SPARSA_STATUS_SUCCESS)
      << sparsa_last_error_message();
  EXPECT_EQ(out.ratio, (std::vector<float>{0.f, 0.f}));
  EXPECT_EQ(out.sparse, (std::vector<uint8_t>{1, 1}));
}

// ---- Head mapping -----------------------------------------------------------------------------------------------

TEST(HeadMapping, FindsPlantedHeadsAndBreaksTiesTowardsTheSmallerIndex) {
  constexpr int64_t kTraces = 3, kDraftHeads = 3, kTargetHeads = 3, kN = 16, kTop = 4;
  std::vector<float> draft(kTraces * kDraftHeads * kN), target(kTraces * kTargetHeads * kN);
  std::mt19937 gen(7);
  std::uniform_real_distribution<float> noise(0.f, 0.1f);
  for (float& x : draft) x = noise(gen);
  for (float& x : target) x = noise(gen);
  // Draft head d peaks on tokens {(4d + t) mod N .. +3} in trace t.
  auto peak = [](int64_t head, int64_t t, int64_t j) { return (j - 4 * head - t + 4 * kN) % kN < 4; };
  for (int64_t t = 0; t < kTraces; ++t) {
    for (int64_t d = 0; d < kDraftHeads; ++d) {
      for (int64_t j = 0; j < kN; ++j) {
        if (peak(d, t, j)) draft[size_t((t * kDraftHeads + d) * kN + j)] += 1.f;
      }
    }
    for (int64_t j = 0; j < kN; ++j) {
      if (peak(2, t, j)) target[size_t((t * kTargetHeads + 0) * kN + j)] += 1.f;  // target 0 ~ draft 2
      if (peak(0, t, j)) target[size_t((t * kTargetHeads + 1) * kN + j)] += 1.f;  // target 1 ~ draft 0
      target[size_t((t * kTargetHeads + 2) * kN + j)] = 0.5f;  // target 2: all ties → tokens 0..3 → draft 0
    }
  }
  sparsa_tensor t_draft = make_tensor(draft.data(), SPARSA_DTYPE_F32, {kTraces, kDraftHeads, kN});
  sparsa_tensor t_target = make_tensor(target.data(), SPARSA_DTYPE_F32, {kTraces, kTargetHeads, kN});
  std::vector<int32_t> map(kTargetHeads, -1);
  sparsa_tensor t_map = make_tensor(map.data(), SPARSA_DTYPE_I32, {kTargetHeads});
  ASSERT_EQ(sparsa_head_mapping(&t_draft, &t_target, kTop, &t_map), SPARSA_STATUS_SUCCESS)
      << sparsa_last_error_message();
  EXPECT_EQ(map, (std::vector<int32_t>{2, 0, 0}));

  map.assign(kTargetHeads, -1);
  EXPECT_EQ(sparsa_head_mapping(&t_draft, &t_target, kN + 1, &t_map), SPARSA_STATUS_SHAPE_MISMATCH);
  EXPECT_NE(std::string(sparsa_last_error_message()).find("k:"), std::string::npos);
  EXPECT_EQ(map, (std::vector<int32_t>(kTargetHeads, -1)));
}

// ---- SpargeAttn tuner (needs the CPU backend) -------------------------------------------------------------------

// A structured calibration call: each query block attends almost only to one key block whose keys are nearly
// parallel (self-similar), so a sparse mask meets the L1 target.
struct TuneProblem {
  static constexpr int64_t kS = 256, kHq = 2, kHkv = 1, kD = 32, kBlockQ = 64, kBlockK = 32;
  std::vector<float> q = std::vector<float>(kS * kHq * kD), k = std::vector<float>(kS * kHkv * kD),
                     v = std::vector<float>(kS * kHkv * kD), out = std::vector<float>(kS * kHq * kD);
  sparsa_tensor tq, tk, tv, tout;
  sparsa_attention_args args;

  TuneProblem() {
    std::mt19937 gen(11);
    std::normal_distribution<float> normal(0.f, 1.f);
    const int64_t key_blocks = kS / kBlockK;
    std::vector<std::vector<float>> direction(static_cast<size_t>(key_blocks), std::vector<float>(size_t{kD}));
    for (auto& u : direction) {
      float norm = 0;
      for (float& x : u) {
        x = normal(gen);
        norm += x * x;
      }
      for (float& x : u) x /= std::sqrt(norm);
    }
    constexpr float kMagnitude = 8.f, kNoise = 0.05f;
    for (int64_t j = 0; j < kS; ++j) {
      for (int64_t e = 0; e < kD; ++e) {
        k[size_t(j * kD + e)] = kMagnitude * direction[size_t(j / kBlockK)][size_t(e)] + kNoise * normal(gen);
        v[size_t(j * kD + e)] = normal(gen);
      }
    }
    for (int64_t i = 0; i < kS; ++i) {
      const int64_t target_block = 2 * (i / kBlockQ);  // causally visible to the whole query block
      for (int64_t h = 0; h < kHq; ++h) {
        for (int64_t e = 0; e < kD; ++e) {
          q[size_t((i * kHq + h) * kD + e)] =
              kMagnitude * direction[size_t(target_block)][size_t(e)] + kNoise * normal(gen);
        }
      }
    }
    tq = make_tensor(q.data(), SPARSA_DTYPE_F32, {1, kS, kHq, kD});
    tk = make_tensor(k.data(), SPARSA_DTYPE_F32, {1, kS, kHkv, kD});
    tv = make_tensor(v.data(), SPARSA_DTYPE_F32, {1, kS, kHkv, kD});
    tout = make_tensor(out.data(), SPARSA_DTYPE_F32, {1, kS, kHq, kD});
    sparsa_attention_args_init(&args, sizeof args);
    args.q = &tq;
    args.k = &tk;
    args.v = &tv;
    args.out = &tout;
    args.causal = 1;
  }
};

double relative_l1(const std::vector<float>& o, const std::vector<float>& ref, int64_t head, int64_t heads, int64_t d) {
  double diff = 0, norm = 0;
  for (size_t r = 0; r < ref.size() / size_t(heads * d); ++r) {
    for (int64_t e = 0; e < d; ++e) {
      const size_t at = (r * size_t(heads) + size_t(head)) * size_t(d) + size_t(e);
      diff += std::fabs(o[at] - ref[at]);
      norm += std::fabs(ref[at]);
    }
  }
  return diff / norm;
}

TEST(SpargeTune, ReturnsValidParametersThatMeetTheirL1) {
  sparsa_context* ctx = nullptr;
  ASSERT_EQ(sparsa_context_create(nullptr, &ctx), SPARSA_STATUS_SUCCESS);
  TuneProblem tp;
  sparsa_policy policy;
  ASSERT_EQ(sparsa_policy_init(&policy, sizeof policy, SPARSA_POLICY_SPARGE), SPARSA_STATUS_SUCCESS);
  policy.block_q = TuneProblem::kBlockQ;
  policy.block_k = TuneProblem::kBlockK;
  sparsa_sparge_tune_options options;
  ASSERT_EQ(sparsa_sparge_tune_options_init(&options, sizeof options), SPARSA_STATUS_SUCCESS);
  std::vector<float> params(TuneProblem::kHq * 4, -99.f), metrics(TuneProblem::kHq * 2, -99.f);
  sparsa_tensor t_params = make_tensor(params.data(), SPARSA_DTYPE_F32, {TuneProblem::kHq, 4});
  sparsa_tensor t_metrics = make_tensor(metrics.data(), SPARSA_DTYPE_F32, {TuneProblem::kHq, 2});
  ASSERT_EQ(sparsa_sparge_tune(ctx, &tp.args, &policy, &options, &t_params, &t_metrics), SPARSA_STATUS_SUCCESS)
      << sparsa_last_error_message();

  bool some_head_sparse = false;
  for (int64_t h = 0; h < TuneProblem::kHq; ++h) {
    SCOPED_TRACE(h);
    const float theta = params[size_t(h * 4)], tau = params[size_t(h * 4 + 1)];
    const float topk = params[size_t(h * 4 + 2)], lambda = params[size_t(h * 4 + 3)];
    EXPECT_GE(theta, -1.f);
    EXPECT_LE(theta, 1.f);
    EXPECT_GT(tau, 0.f);
    EXPECT_LE(tau, 1.f);
    EXPECT_EQ(topk, 0.f);
    EXPECT_LE(lambda, 0.f);
    EXPECT_LT(metrics[size_t(h * 2)], options.pv_l1);
    EXPECT_GE(metrics[size_t(h * 2 + 1)], 0.f);
    EXPECT_LE(metrics[size_t(h * 2 + 1)], 1.f);
    some_head_sparse |= metrics[size_t(h * 2 + 1)] > options.dense_below;
  }
  EXPECT_TRUE(some_head_sparse) << "a planted block-diagonal problem should tune sparse";

  // Running SPARGE with the tuned per-head parameters meets the L1 target against dense.
  sparsa_policy dense;
  ASSERT_EQ(sparsa_policy_init(&dense, sizeof dense, SPARSA_POLICY_DENSE), SPARSA_STATUS_SUCCESS);
  ASSERT_EQ(sparsa_attention_run(ctx, &tp.args, &dense), SPARSA_STATUS_SUCCESS) << sparsa_last_error_message();
  const std::vector<float> reference = tp.out;
  policy.sparge_head_params = &t_params;
  ASSERT_EQ(sparsa_attention_run(ctx, &tp.args, &policy), SPARSA_STATUS_SUCCESS) << sparsa_last_error_message();
  for (int64_t h = 0; h < TuneProblem::kHq; ++h) {
    const double l1 = relative_l1(tp.out, reference, h, TuneProblem::kHq, TuneProblem::kD);
    EXPECT_LT(l1, options.pv_l1) << "head " << h;
    EXPECT_NEAR(l1, metrics[size_t(h * 2)], 1e-4) << "head " << h;
  }

  // Bad options are rejected before anything is written.
  std::vector<float> before = params;
  options.pv_l1 = 0.01f;  // < l1
  EXPECT_EQ(sparsa_sparge_tune(ctx, &tp.args, &policy, &options, &t_params, &t_metrics),
            SPARSA_STATUS_INVALID_ARGUMENT);
  EXPECT_NE(std::string(sparsa_last_error_message()).find("options.pv_l1"), std::string::npos);
  EXPECT_EQ(params, before);
  sparsa_context_destroy(ctx);
}

}  // namespace
