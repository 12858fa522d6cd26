// §0 merge of partial attention states (sparsa_merge_states), and the exactness of merging disjoint key sets.
#include <cmath>
#include <cstring>
#include <limits>
#include <ostream>
#include <string>
#include <vector>

#include "test_util.h"

namespace {

using st::Pattern;

SPARSA_BACKEND_SUITE(Merge);

struct State {
  std::vector<float> o;    // [B, S, H, D]
  std::vector<float> lse;  // [B, H, S]
};

State random_state(st::Rng& rng, int B, int S, int H, int D, double minus_inf_fraction) {
  State s;
  s.o.resize(size_t(B) * S * H * D);
  s.lse.resize(size_t(B) * H * S);
  for (float& x : s.o) x = float(rng.normal());
  for (float& x : s.lse) x = rng.uniform(0, 1) < minus_inf_fraction ? -INFINITY : float(3.0 * rng.normal());
  return s;
}

// Reference merge over [B, S, H, D] / [B, H, S].
State reference_merge(const State& a, const State& b, int B, int S, int H, int D) {
  State m{std::vector<float>(a.o.size()), std::vector<float>(a.lse.size())};
  std::vector<double> oa(D), ob(D), o(D);
  for (int bb = 0; bb < B; ++bb)
    for (int s = 0; s < S; ++s)
      for (int h = 0; h < H; ++h) {
        const size_t row = ((size_t(bb) * S + s) * H + h) * D, l = (size_t(bb) * H + h) * S + s;
        for (int d = 0; d < D; ++d) {
          oa[d] = a.o[row + d];
          ob[d] = b.o[row + d];
        }
        double lse;
        ref::merge_row(oa.data(), a.lse[l], ob.data(), b.lse[l], D, o.data(), &lse);
        for (int d = 0; d < D; ++d) m.o[row + d] = float(o[d]);
        m.lse[l] = float(lse);
      }
  return m;
}

// sparsa_merge_states of the host states a and b into `out` ([B, S, H, D] / [B, H, S], f32).
sparsa_status merge_states(sparsa_context* ctx, State& a, State& b, State& out, int B, int S, int H, int D) {
  sparsa_tensor oa = st::host_tensor(a.o.data(), SPARSA_DTYPE_F32, {B, S, H, D});
  sparsa_tensor ob = st::host_tensor(b.o.data(), SPARSA_DTYPE_F32, {B, S, H, D});
  sparsa_tensor la = st::host_tensor(a.lse.data(), SPARSA_DTYPE_F32, {B, H, S});
  sparsa_tensor lb = st::host_tensor(b.lse.data(), SPARSA_DTYPE_F32, {B, H, S});
  sparsa_tensor o = st::host_tensor(out.o.data(), SPARSA_DTYPE_F32, {B, S, H, D});
  sparsa_tensor l = st::host_tensor(out.lse.data(), SPARSA_DTYPE_F32, {B, H, S});
  return sparsa_merge_states(ctx, &oa, &la, &ob, &lb, &o, &l);
}

void expect_close(const std::vector<float>& got, const std::vector<float>& want, double tol, const char* what) {
  ASSERT_EQ(got.size(), want.size());
  for (size_t e = 0; e < got.size(); ++e) {
    if (std::isinf(want[e])) {
      ASSERT_EQ(got[e], want[e]) << what << " element " << e;
    } else {
      ASSERT_NEAR(got[e], want[e], tol * std::max(1.0f, std::fabs(want[e]))) << what << " element " << e;
    }
  }
}

TEST_P(Merge, MatchesTheFormulaIncludingMinusInfStates) {
  ST_RNG(rng, 0);
  const int B = 2, S = 17, H = 3, D = 64;
  State a = random_state(rng, B, S, H, D, 0.2), b = random_state(rng, B, S, H, D, 0.2);
  // Force some rows where both are -inf.
  for (int s = 0; s < 3; ++s) a.lse[s] = b.lse[s] = -INFINITY;
  const State want = reference_merge(a, b, B, S, H, D);
  State got{std::vector<float>(a.o.size(), NAN), std::vector<float>(a.lse.size(), NAN)};
  ASSERT_EQ(merge_states(ctx().get(), a, b, got, B, S, H, D), SPARSA_STATUS_SUCCESS)
      << sparsa_last_error_message();
  expect_close(got.o, want.o, st::kTolF32, "o");
  expect_close(got.lse, want.lse, st::kTolF32, "lse");
  for (int s = 0; s < 3; ++s)
    for (int d = 0; d < D; ++d) EXPECT_EQ(got.o[size_t(s) * H * D + d], 0.0f) << "both -inf gives 0";
}

TEST_P(Merge, InPlaceAliasingAndNullOutLse) {
  ST_RNG(rng, 0);
  const int B = 1, S = 9, H = 2, D = 128;
  State a = random_state(rng, B, S, H, D, 0.1), b = random_state(rng, B, S, H, D, 0.1);
  const State want = reference_merge(a, b, B, S, H, D);
  State copy = a;
  sparsa_tensor oa = st::host_tensor(a.o.data(), SPARSA_DTYPE_F32, {B, S, H, D});
  sparsa_tensor ob = st::host_tensor(b.o.data(), SPARSA_DTYPE_F32, {B, S, H, D});
  sparsa_tensor la = st::host_tensor(a.lse.data(), SPARSA_DTYPE_F32, {B, H, S});
  sparsa_tensor lb = st::host_tensor(b.lse.data(), SPARSA_DTYPE_F32, {B, H, S});
  ASSERT_EQ(sparsa_merge_states(ctx().get(), &oa, &la, &ob, &lb, &oa, &la), SPARSA_STATUS_SUCCESS)
      << sparsa_last_error_message();
  expect_close(a.o, want.o, st::kTolF32, "o in place");
  expect_close(a.lse, want.lse, st::kTolF32, "lse in place");
  std::vector<float> out(copy.o.size(), NAN);
  sparsa_tensor oc = st::host_tensor(copy.o.data(), SPARSA_DTYPE_F32, {B, S, H, D});
  sparsa_tensor lc = st::host_tensor(copy.lse.data(), SPARSA_DTYPE_F32, {B, H, S});
  sparsa_tensor o = st::host_tensor(out.data(), SPARSA_DTYPE_F32, {B, S, H, D});
  ASSERT_EQ(sparsa_merge_states(ctx().get(), &oc, &lc, &ob, &lb, &o, nullptr), SPARSA_STATUS_SUCCESS)
      << sparsa_last_error_message();
  expect_close(out, want.o, st::kTolF32, "o with null out_lse");
}

TEST_P(Merge, PackedLayoutUsesLseOfShapeHeadsByTokens) {
  ST_RNG(rng, 0);
  const int T = 23, H = 4, D = 64;
  // A packed [T, H, D] state is a [1, T, H, D] one with lse [H, T] = [1, H, T].
  State a = random_state(rng, 1, T, H, D, 0.1), b = random_state(rng, 1, T, H, D, 0.1);
  const State want = reference_merge(a, b, 1, T, H, D);
  State got{std::vector<float>(a.o.size(), NAN), std::vector<float>(a.lse.size(), NAN)};
  sparsa_tensor oa = st::host_tensor(a.o.data(), SPARSA_DTYPE_F32, {T, H, D});
  sparsa_tensor ob = st::host_tensor(b.o.data(), SPARSA_DTYPE_F32, {T, H, D});
  sparsa_tensor la = st::host_tensor(a.lse.data(), SPARSA_DTYPE_F32, {H, T});
  sparsa_tensor lb = st::host_tensor(b.lse.data(), SPARSA_DTYPE_F32, {H, T});
  sparsa_tensor o = st::host_tensor(got.o.data(), SPARSA_DTYPE_F32, {T, H, D});
  sparsa_tensor l = st::host_tensor(got.lse.data(), SPARSA_DTYPE_F32, {H, T});
  ASSERT_EQ(sparsa_merge_states(ctx().get(), &oa, &la, &ob, &lb, &o, &l), SPARSA_STATUS_SUCCESS)
      << sparsa_last_error_message();
  expect_close(got.o, want.o, st::kTolF32, "o");
  expect_close(got.lse, want.lse, st::kTolF32, "lse");
}

TEST_P(Merge, ShapeMismatchWritesNothing) {
  std::vector<float> a(2 * 3 * 4 * 8, 1.0f), lse(2 * 4 * 3, 0.0f), b(2 * 3 * 4 * 8, 1.0f), out(a.size(), NAN);
  sparsa_tensor oa = st::host_tensor(a.data(), SPARSA_DTYPE_F32, {2, 3, 4, 8});
  sparsa_tensor ob = st::host_tensor(b.data(), SPARSA_DTYPE_F32, {2, 4, 3, 8});  // S and H swapped
  sparsa_tensor l = st::host_tensor(lse.data(), SPARSA_DTYPE_F32, {2, 4, 3});
  sparsa_tensor o = st::host_tensor(out.data(), SPARSA_DTYPE_F32, {2, 3, 4, 8});
  EXPECT_EQ(sparsa_merge_states(ctx().get(), &oa, &l, &ob, &l, &o, nullptr), SPARSA_STATUS_SHAPE_MISMATCH);
  for (float x : out) ASSERT_TRUE(std::isnan(x));
}

// sparsa_merge_states on every backend (device memory through st::Buffer), one row per case: head dims below, at
// and past one 32-thread row group of the device kernel, the merged state written in place into o_a, its LSE into
// its own buffer, in place into lse_a, or not at all (out_lse NULL). Rows where both states or only a are empty
// (-inf) are planted; the result is compared with the float64 formula (ref::merge_row) within 1e-5.
enum class MergedLse { kOwnBuffer, kInPlace, kNotRequested };

struct MergeRow {
  std::string name;
  int head_dim = 64;
  MergedLse lse = MergedLse::kOwnBuffer;
};
inline void PrintTo(const MergeRow& r, std::ostream* os) { *os << r.name; }

const std::vector<MergeRow> kMergeRows = {
    {"f32_d16_lse_own_buffer", 16, MergedLse::kOwnBuffer},
    {"f32_d32_lse_in_place", 32, MergedLse::kInPlace},
    {"f32_d64_lse_not_requested", 64, MergedLse::kNotRequested},
    {"f32_d80_lse_in_place", 80, MergedLse::kInPlace},
    {"f32_d128_lse_own_buffer", 128, MergedLse::kOwnBuffer},
};

SPARSA_BACKEND_TABLE(MergeCases, MergeRow, kMergeRows);

TEST_P(MergeCases, InPlaceMatchesTheFormula) {
  const MergeRow& r = row();
  constexpr double kTol = 1e-5;  // absolute, outputs and LSE
  ST_RNG(rng, 0);
  const int B = 2, S = 5, H = 3, D = r.head_dim;
  State a = random_state(rng, B, S, H, D, 0.2), b = random_state(rng, B, S, H, D, 0.2);
  a.lse[0] = b.lse[0] = -INFINITY;  // (b0, h0, s0): both empty
  a.lse[1] = -INFINITY;             // (b0, h0, s1): only b
  b.lse[1] = 0.5f;
  const State want = reference_merge(a, b, B, S, H, D);
  st::Buffer oa(ctx(), SPARSA_DTYPE_F32, {B, S, H, D}), ob(ctx(), SPARSA_DTYPE_F32, {B, S, H, D});
  st::Buffer la(ctx(), SPARSA_DTYPE_F32, {B, H, S}), lb(ctx(), SPARSA_DTYPE_F32, {B, H, S});
  st::Buffer lo(ctx(), SPARSA_DTYPE_F32, {B, H, S});
  std::memcpy(oa.host().data(), a.o.data(), a.o.size() * 4);
  std::memcpy(ob.host().data(), b.o.data(), b.o.size() * 4);
  std::memcpy(la.host().data(), a.lse.data(), a.lse.size() * 4);
  std::memcpy(lb.host().data(), b.lse.data(), b.lse.size() * 4);
  std::fill(lo.as<float>(), lo.as<float>() + lo.elements(), std::numeric_limits<float>::quiet_NaN());
  for (st::Buffer* buf : {&oa, &ob, &la, &lb, &lo}) buf->upload();
  const sparsa_tensor toa = oa.tensor(), tob = ob.tensor(), tla = la.tensor(), tlb = lb.tensor(), tlo = lo.tensor();
  const sparsa_tensor* out_lse = r.lse == MergedLse::kInPlace ? &tla : r.lse == MergedLse::kOwnBuffer ? &tlo : nullptr;
  ASSERT_EQ(sparsa_merge_states(ctx().get(), &toa, &tla, &tob, &tlb, &toa, out_lse), SPARSA_STATUS_SUCCESS)
      << sparsa_last_error_message();
  for (st::Buffer* buf : {&oa, &la, &lo}) buf->download();
  for (size_t e = 0; e < want.o.size(); ++e) {
    ASSERT_NEAR(oa.as<float>()[e], want.o[e], kTol) << "out element " << e;
  }
  for (int d = 0; d < D; ++d) ASSERT_EQ(oa.as<float>()[d], 0.0f) << "both states -inf gives 0, d " << d;
  const float* lse = r.lse == MergedLse::kInPlace ? la.as<float>() : lo.as<float>();
  for (size_t e = 0; e < want.lse.size(); ++e) {
    if (r.lse == MergedLse::kNotRequested) {
      ASSERT_TRUE(std::isnan(lse[e])) << "out_lse is NULL, yet lse element " << e << " was written";
      EXPECT_EQ(la.as<float>()[e], a.lse[e]) << "lse_a changed without out_lse";
    } else if (std::isinf(want.lse[e])) {
      ASSERT_EQ(lse[e], want.lse[e]) << "lse element " << e;
    } else {
      ASSERT_NEAR(lse[e], want.lse[e], kTol) << "lse element " << e;
    }
  }
}

// Attention over two disjoint key sets, merged, equals attention over their union (§0: exact for disjoint sets).
TEST_P(Merge, TwoKeyHalvesMergedEqualDense) {
  int counter = 0;
  for (Pattern pattern : st::all_patterns()) {
    ST_RNG(rng, counter++);
    SCOPED_TRACE(st::pattern_name(pattern));
    const int B = 2, S = 40, N = 96, H = 4, Hkv = 2, D = 64;
    ref::Problem full = st::make_problem(B, H, Hkv, D, {S}, {N}, false);
    st::fill(full, pattern, rng);
    // First half through seq_lens_k (padded k shortened to N/2), second half as a separate problem.
    ref::Problem first = full, second = st::make_problem(B, H, Hkv, D, {S}, {N / 2}, false);
    second.q = full.q;
    for (int b = 0; b < B; ++b) {
      first.skv[b] = N / 2;
      first.k[b].resize(size_t(N / 2) * Hkv * D);
      first.v[b].resize(size_t(N / 2) * Hkv * D);
      second.k[b].assign(full.k[b].begin() + size_t(N / 2) * Hkv * D, full.k[b].end());
      second.v[b].assign(full.v[b].begin() + size_t(N / 2) * Hkv * D, full.v[b].end());
    }
    st::RunOptions shortened;
    shortened.seq_lens_k = true;
    const st::RunResult ra = st::run(ctx(), first, st::make_policy(SPARSA_POLICY_DENSE), shortened);
    const st::RunResult rb = st::run(ctx(), second, st::make_policy(SPARSA_POLICY_DENSE));
    st::expect_ok(ra);
    st::expect_ok(rb);
    if (ra.status != SPARSA_STATUS_SUCCESS || rb.status != SPARSA_STATUS_SUCCESS) continue;
    State a, b;
    for (int bb = 0; bb < B; ++bb) {
      a.o.insert(a.o.end(), ra.out.o[bb].begin(), ra.out.o[bb].end());
      a.lse.insert(a.lse.end(), ra.out.lse[bb].begin(), ra.out.lse[bb].end());
      b.o.insert(b.o.end(), rb.out.o[bb].begin(), rb.out.o[bb].end());
      b.lse.insert(b.lse.end(), rb.out.lse[bb].begin(), rb.out.lse[bb].end());
    }
    State got{std::vector<float>(a.o.size(), NAN), std::vector<float>(a.lse.size(), NAN)};
    ASSERT_EQ(merge_states(ctx().get(), a, b, got, B, S, H, D), SPARSA_STATUS_SUCCESS)
        << sparsa_last_error_message();
    const ref::Output want = ref::attend(full, ref::dense(full));
    ref::Output merged;
    for (int bb = 0; bb < B; ++bb) {
      merged.o.emplace_back(got.o.begin() + size_t(bb) * S * H * D, got.o.begin() + size_t(bb + 1) * S * H * D);
      merged.lse.emplace_back(got.lse.begin() + size_t(bb) * H * S, got.lse.begin() + size_t(bb + 1) * H * S);
    }
    EXPECT_TRUE(st::outputs_close(merged, want, st::kTolF32));
    EXPECT_TRUE(st::lse_close(merged, want, st::kTolF32));
  }
}

TEST_P(Merge, TwoComplementaryBlockMasksMergedEqualCausalDense) {
  ST_RNG(rng, 0);
  ref::Problem p = st::make_problem(1, 2, 1, 64, {128}, {160}, true);
  st::fill(p, Pattern::kSinks, rng);
  sparsa_policy pol = st::make_policy(SPARSA_POLICY_BLOCK_SPARSE);
  pol.block_q = 32;
  pol.block_k = 32;
  st::RunOptions ma, mb;
  ma.block_mask.resize(2 * 4 * 5);
  for (auto& m : ma.block_mask) m = rng.uniform(0, 1) < 0.5;
  for (uint8_t m : ma.block_mask) mb.block_mask.push_back(1 - m);
  const st::RunResult ra = st::run(ctx(), p, pol, ma), rb = st::run(ctx(), p, pol, mb);
  st::expect_ok(ra);
  st::expect_ok(rb);
  if (ra.status != SPARSA_STATUS_SUCCESS || rb.status != SPARSA_STATUS_SUCCESS) return;
  State a{std::vector<float>(ra.out.o[0].begin(), ra.out.o[0].end()), std::vector<float>(ra.out.lse[0].begin(), ra.out.lse[0].end())};
  State b{std::vector<float>(rb.out.o[0].begin(), rb.out.o[0].end()), std::vector<float>(rb.out.lse[0].begin(), rb.out.lse[0].end())};
  const State merged = reference_merge(a, b, 1, 128, 2, 64);  // the formula itself is tested above
  ref::Output got;
  got.o = {std::vector<double>(merged.o.begin(), merged.o.end())};
  got.lse = {std::vector<double>(merged.lse.begin(), merged.lse.end())};
  const ref::Output want = ref::attend(p, ref::dense(p));
  EXPECT_TRUE(st::outputs_close(got, want, st::kTolF32));
  EXPECT_TRUE(st::lse_close(got, want, st::kTolF32));
}

}  // namespace
