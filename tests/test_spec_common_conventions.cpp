// ALGORITHMS.md §0 common conventions and the header's general rules: pair and tile counts, empty sequences,
// varlen mask grids, half-precision outputs, the caller's scale, prefetch unions, per-sequence cache slots,
// zero strides, and the merge of partial states.
// The edges the spec names and the ones it implies, on the CPU backend (the library's oracle). Expected outputs come
// from the float64 reference (tests/reference) through spec_test_util.h.
#include "spec_test_util.h"

namespace {

// §0 "Achieved sparsity": PAIRS_DENSE counts what dense attention with the same causal flag computes, including
// rows that see nothing when Sq > Skv; PAIRS_COMPUTED of DENSE equals it; SINK_WINDOW computes its visible pairs.
TEST(SpecCommonConventions, StatsPairCountsAtTheEdges) {
  Cpu c;
  ST_RNG(rng, 36);
  ref::Problem p = random_problem(2, 3, 1, 4, {9}, {4}, true, rng);
  int64_t dense_pairs = 0;
  for (int i = 0; i < 9; ++i) dense_pairs += std::max(0, std::min(4, i + (4 - 9) + 1));
  dense_pairs *= 2 * 3;
  const st::RunResult r = st::run(c.ctx, p, st::make_policy(SPARSA_POLICY_DENSE));
  st::expect_ok(r);
  EXPECT_EQ(r.stats[SPARSA_STAT_PAIRS_DENSE], dense_pairs);
  EXPECT_EQ(r.stats[SPARSA_STAT_PAIRS_COMPUTED], dense_pairs);
  ref::Problem q = random_problem(1, 2, 2, 4, {50}, {200}, false, rng);
  sparsa_policy pol = st::make_policy(SPARSA_POLICY_SINK_WINDOW);
  pol.sink_tokens = 3;
  pol.sink_window = 10;
  int64_t visible = 0;
  for (int i = 0; i < 50; ++i)
    for (int j = 0; j < 200; ++j) visible += (j < 3 || std::abs(i + 150 - j) < 10) ? 1 : 0;
  const st::RunResult s = st::run(c.ctx, q, pol);
  st::expect_ok(s);
  EXPECT_EQ(s.stats[SPARSA_STAT_PAIRS_COMPUTED], 2 * visible);
  EXPECT_EQ(s.stats[SPARSA_STAT_PAIRS_DENSE], 2 * 50 * 200);
}


// ================================================================================================ layouts
// Varlen batches may hold empty sequences (cu_seqlens non-decreasing) and sequences without keys: nothing to write
// for the first, zero rows with LSE −inf for the second (§0).
TEST(SpecCommonConventions, EmptySequencesAndSequencesWithoutKeys) {
  Cpu c;
  ST_RNG(rng, 37);
  ref::Problem p = random_problem(3, 2, 1, 8, {0, 4, 6}, {5, 0, 9}, false, rng);
  st::RunOptions opt;
  opt.layout = st::Layout::kVarlen;
  const ref::Output want = dense_of(p);
  compare(c.ctx, p, st::make_policy(SPARSA_POLICY_DENSE), want, opt);
  sparsa_policy sw = st::make_policy(SPARSA_POLICY_SINK_WINDOW);
  sw.sink_tokens = 1;
  sw.sink_window = 100;
  compare(c.ctx, p, sw, want, opt);
  compare(c.ctx, p, sparge(4, 4, 1.f, 0.9f), want, opt);
  const std::vector<int32_t> indices = {0, 1, -1, -1, -1, -1, -1, -1, 2, 3, 4, 5};  // [B = 3, 1, 4]; seq 1: N = 0
  sparsa_policy ti = st::make_policy(SPARSA_POLICY_TOKEN_INDICES);
  ti.index_n_local = 100;  // clipped to [0, N): with the indices, every key; TOKEN_INDICES is causal (§7)
  opt.indices = indices;
  opt.h_idx = 1;
  opt.k = 4;
  compare(c.ctx, p, ti, attend_where(p, [&](int b, int, int i, int j) { return j <= i + p.skv[b] - p.sq[b]; }), opt);
  // Causal decode of TOKEN_SELECT over a batch with an empty sequence (it runs dense there: N = 0).
  ref::Problem d = random_problem(2, 2, 1, 8, {1, 1}, {0, 12}, true, rng);
  st::RunOptions dopt;
  dopt.layout = st::Layout::kVarlen;
  const sparsa_policy sel = token_select(2, 3, 2);
  compare(c.ctx, d, sel, ref::token_select(d, select_params(sel), nullptr).out, dopt);
}

TEST(SpecCommonConventions, BlockSparseVarlenMaskUsesMaxLengthGrid) {
  Cpu c;
  ST_RNG(rng, 38);
  ref::Problem p = random_problem(2, 2, 1, 4, {10, 23}, {31, 17}, true, rng);
  const int bq = 4, bk = 8, nqb = 6, nkb = 4;  // ceil(23/4), ceil(31/8)
  std::vector<uint8_t> mask(size_t(2) * 2 * nqb * nkb);
  for (auto& m : mask) m = rng.integer(0, 1);
  sparsa_policy pol = st::make_policy(SPARSA_POLICY_BLOCK_SPARSE);
  pol.block_q = bq;
  pol.block_k = bk;
  st::RunOptions opt;
  opt.layout = st::Layout::kVarlen;
  opt.block_mask = mask;
  compare(c.ctx, p, pol, attend_mask(p, mask, bq, bk), opt);
}

TEST(SpecCommonConventions, HalfPrecisionOutputsOfSelectionPolicies) {
  Cpu c;
  ST_RNG(rng, 39);
  for (int32_t dtype : {SPARSA_DTYPE_F16, SPARSA_DTYPE_BF16}) {
    SCOPED_TRACE(::testing::Message() << "dtype " << dtype);
    ref::Problem p = st::rounded(random_problem(1, 4, 2, 16, {33}, {33}, true, rng, st::Pattern::kNeedles), dtype);
    st::RunOptions opt;
    opt.dtype = dtype;
    opt.gap = 2;
    std::vector<int32_t> indices = {0, 3, 30, -1, 7, 7};
    sparsa_policy ti = st::make_policy(SPARSA_POLICY_TOKEN_INDICES);
    opt.indices = indices;
    opt.h_idx = 2;
    opt.k = 3;
    compare(c.ctx, p, ti, attend_where(p, [&](int, int h, int i, int j) {
              const int row = h / 2;
              return j <= i && std::find(indices.begin() + 3 * row, indices.begin() + 3 * row + 3, j) !=
                                   indices.begin() + 3 * row + 3;
            }),
            opt);
    compare(c.ctx, p, sparge(8, 8, 1.f, 0.5f), dense_of(p), opt);
  }
}


// A caller's softmax_scale reaches every score the spec scales: attention everywhere, SPARGE's Ŝ, TOKEN_SPARSE's
// window softmax, TOKEN_SELECT's vote with scale_scores.
TEST(SpecCommonConventions, CallerScaleReachesSelectionScores) {
  Cpu c;
  ST_RNG(rng, 40);
  ref::Problem p = random_problem(1, 4, 2, 16, {40}, {40}, true, rng, st::Pattern::kNeedles);
  p.scale = 0.61;
  {
    sparsa_policy pol = token_sparse(5, 6, 0.2f);
    check_token_sparse(c.ctx, p, pol);
  }
  {
    sparsa_policy pol = token_select(2, 6, 4);
    pol.select_scale_scores = 1;
    check_select(c.ctx, p, pol);
  }
  {
    ref::Problem band = random_problem(1, 2, 1, 16, {50}, {60}, true, rng, st::Pattern::kBand);
    band.scale = 0.03;
    ref::SpargeParams sp;
    sp.bq = 10;
    sp.bk = 6;
    sp.theta = 0.2;
    sp.tau = 0.7;
    const ref::SpargeResult want = ref::sparge(band, std::vector<ref::SpargeParams>(2, sp));
    if (want.theta_margin > 1e-4 && want.tau_margin > 1e-4) {
      st::RunOptions opt;
      opt.block_mask_out = true;
      const st::RunResult r = st::run_and_compare(c.ctx, band, sparge(10, 6, 0.2f, 0.7f), want.out, opt);
      EXPECT_TRUE(st::masks_equal(r.block_mask, want.mask, 1, 2, want.nqb, want.nkb));
    }
  }
}

// Prefetch (§7): a sequence whose slots are all −1 has an empty union (count 0, positions all −1); duplicates across
// heads collapse; remapped indices point at the compact rows.
TEST(SpecCommonConventions, PrefetchEmptyUnionAndDuplicatesAcrossHeads) {
  Cpu c;
  const int B = 2, N = 6, Hkv = 1, D = 2, Hi = 2, K = 2, C = 4;
  std::vector<float> src(size_t(B) * N * Hkv * D);
  for (size_t e = 0; e < src.size(); ++e) src[e] = float(e);
  std::vector<int32_t> idx = {4, 1, 1, -1,  // sequence 0: heads {4, 1} and {1}: union {1, 4}
                              -1, -1, -1, -1};
  std::vector<float> kd(size_t(B) * C * Hkv * D, -5.f), vd = kd;
  std::vector<int32_t> pos(size_t(B) * C, 99), rem(idx.size(), 99), cnt(B, 99);
  sparsa_tensor ts = st::host_tensor(src.data(), SPARSA_DTYPE_F32, {B, N, Hkv, D});
  sparsa_tensor ti = st::host_tensor(idx.data(), SPARSA_DTYPE_I32, {B, Hi, K});
  sparsa_tensor tk = st::host_tensor(kd.data(), SPARSA_DTYPE_F32, {B, C, Hkv, D});
  sparsa_tensor tv = st::host_tensor(vd.data(), SPARSA_DTYPE_F32, {B, C, Hkv, D});
  sparsa_tensor tp = st::host_tensor(pos.data(), SPARSA_DTYPE_I32, {B, C});
  sparsa_tensor tr = st::host_tensor(rem.data(), SPARSA_DTYPE_I32, {B, Hi, K});
  sparsa_tensor tc = st::host_tensor(cnt.data(), SPARSA_DTYPE_I32, {B});
  ASSERT_EQ(sparsa_kv_prefetch(c.ctx.get(), &ts, &ts, &ti, &tk, &tv, &tp, &tr, &tc), SPARSA_STATUS_SUCCESS)
      << sparsa_last_error_message();
  EXPECT_EQ(cnt, (std::vector<int32_t>{2, 0}));
  EXPECT_EQ(pos, (std::vector<int32_t>{1, 4, -1, -1, -1, -1, -1, -1}));
  EXPECT_EQ(rem, (std::vector<int32_t>{1, 0, 0, -1, -1, -1, -1, -1}));
  EXPECT_EQ(kd, (std::vector<float>{2, 3, 8, 9, -5, -5, -5, -5, -5, -5, -5, -5, -5, -5, -5, -5}));  // past: untouched
}


// BLOCKS_COMPUTED / BLOCKS_TOTAL (header): tiles with at least one visible pair, DENSE and SINK_WINDOW at 128 × 64,
// BLOCK_SPARSE at block_q × block_k; total = tiles dense attention with the same causal flag would compute.
TEST(SpecCommonConventions, StatsTileCountsAtTheEdges) {
  Cpu c;
  ST_RNG(rng, 44);
  const auto tiles = [](const ref::Problem& p, int bq, int bk, const std::function<bool(int, int, int, int)>& vis) {
    int64_t n = 0;
    for (int b = 0; b < p.B; ++b)
      for (int h = 0; h < p.Hq; ++h)
        for (int I = 0; I * bq < p.sq[b]; ++I)
          for (int J = 0; J * bk < p.skv[b]; ++J) {
            bool any = false;
            for (int i = I * bq; i < std::min(p.sq[b], (I + 1) * bq) && !any; ++i)
              for (int j = J * bk; j < std::min(p.skv[b], (J + 1) * bk) && !any; ++j) any = vis(b, h, i, j);
            n += any ? 1 : 0;
          }
    return n;
  };
  for (bool causal : {false, true}) {
    for (auto [sq, skv] : std::vector<std::pair<int, int>>{{300, 200}, {70, 400}, {129, 65}}) {
      SCOPED_TRACE(::testing::Message() << "causal " << causal << " sq " << sq << " skv " << skv);
      ref::Problem p = random_problem(1, 1, 1, 4, {sq}, {skv}, causal, rng);
      const int o = skv - sq;
      const auto allowed = [&](int, int, int i, int j) { return !causal || j <= i + o; };
      const int64_t total = tiles(p, 128, 64, allowed);
      const st::RunResult d = st::run(c.ctx, p, st::make_policy(SPARSA_POLICY_DENSE));
      st::expect_ok(d);
      EXPECT_EQ(d.stats[SPARSA_STAT_BLOCKS_COMPUTED], total);
      EXPECT_EQ(d.stats[SPARSA_STAT_BLOCKS_TOTAL], total);
      sparsa_policy sw = st::make_policy(SPARSA_POLICY_SINK_WINDOW);
      sw.sink_tokens = 3;
      sw.sink_window = 70;
      const st::RunResult s = st::run(c.ctx, p, sw);
      st::expect_ok(s);
      EXPECT_EQ(s.stats[SPARSA_STAT_BLOCKS_COMPUTED], tiles(p, 128, 64, [&](int, int, int i, int j) {
                  const int a = i + o;
                  if (causal) return j <= a && (j < 3 || a - j < 70);
                  return j < 3 || std::abs(a - j) < 70;
                }));
      EXPECT_EQ(s.stats[SPARSA_STAT_BLOCKS_TOTAL], total);
      const int bq = 7, bk = 33, nqb = (sq + bq - 1) / bq, nkb = (skv + bk - 1) / bk;
      std::vector<uint8_t> mask(size_t(nqb) * nkb);
      for (auto& m : mask) m = rng.integer(0, 1);
      sparsa_policy bs = st::make_policy(SPARSA_POLICY_BLOCK_SPARSE);
      bs.block_q = bq;
      bs.block_k = bk;
      st::RunOptions opt;
      opt.block_mask = mask;
      const st::RunResult m = st::run(c.ctx, p, bs, opt);
      st::expect_ok(m);
      EXPECT_EQ(m.stats[SPARSA_STAT_BLOCKS_COMPUTED], tiles(p, bq, bk, [&](int b, int h, int i, int j) {
                  return allowed(b, h, i, j) && mask[size_t(i / bq) * nkb + j / bk] != 0;
                }));
      EXPECT_EQ(m.stats[SPARSA_STAT_BLOCKS_TOTAL], tiles(p, bq, bk, allowed));
    }
  }
}

// §6.5 per batch row: one row hits while another misses in the same run.
TEST(SpecCommonConventions, TokenSelectCacheSlotsArePerSequence) {
  Cpu c;
  ST_RNG(rng, 45);
  st::SelectionCache cache(c.ctx, 2, 2, 1, 8, 8);
  ref::Problem p = random_problem(2, 2, 1, 8, {1}, {40}, true, rng, st::Pattern::kNeedles);
  sparsa_policy pol = token_select(2, 5, 3);
  pol.select_cache_theta = 0.9f;
  st::RunOptions opt;
  opt.cache = cache.get();
  const st::RunResult first = st::run(c.ctx, p, pol, opt);
  st::expect_ok(first);
  EXPECT_EQ(first.stats[SPARSA_STAT_CACHE_MISSES], 2);
  for (int h = 0; h < 2; ++h)
    for (int d = 0; d < 8; ++d) p.q[1][size_t(h) * 8 + d] = -p.q[1][size_t(h) * 8 + d];  // row 1: cos = −1
  const st::RunResult second = st::run(c.ctx, p, pol, opt);
  st::expect_ok(second);
  EXPECT_EQ(second.stats[SPARSA_STAT_CACHE_HITS], 1);
  EXPECT_EQ(second.stats[SPARSA_STAT_CACHE_MISSES], 1);
  int64_t hits = 0, misses = 0;
  cache.counts(&hits, &misses);
  EXPECT_EQ(hits, 1);
  EXPECT_EQ(misses, 3);
}


// Header: strides "may be any non-negative value" (last one 1). K/V broadcast over heads and batch with stride 0
// (a common MQA/GQA view) must read as the replicated tensor.
TEST(SpecCommonConventions, ZeroStrideBroadcastKeysAndValues) {
  Cpu c;
  ST_RNG(rng, 46);
  const int B = 2, S = 5, Sk = 7, H = 3, D = 4;
  ref::Problem p = random_problem(B, H, H, D, {S}, {Sk}, true, rng);
  // One K/V row set shared by every batch entry and head.
  std::vector<float> k_store(size_t(Sk) * D), v_store(size_t(Sk) * D);
  for (int j = 0; j < Sk; ++j)
    for (int d = 0; d < D; ++d) {
      k_store[size_t(j) * D + d] = float(rng.normal());
      v_store[size_t(j) * D + d] = float(rng.normal());
    }
  std::vector<float> q_store(size_t(B) * S * H * D), out(q_store.size(), -9.f);
  for (int b = 0; b < B; ++b)
    for (int i = 0; i < S; ++i)
      for (int h = 0; h < H; ++h)
        for (int d = 0; d < D; ++d) {
          const size_t e = ((size_t(b) * S + i) * H + h) * D + d;
          q_store[e] = float(p.q[b][(size_t(i) * H + h) * D + d]);
        }
  for (int b = 0; b < B; ++b)
    for (int j = 0; j < Sk; ++j)
      for (int h = 0; h < H; ++h)
        for (int d = 0; d < D; ++d) {
          p.k[b][(size_t(j) * H + h) * D + d] = k_store[size_t(j) * D + d];
          p.v[b][(size_t(j) * H + h) * D + d] = v_store[size_t(j) * D + d];
        }
  sparsa_tensor tq = st::host_tensor(q_store.data(), SPARSA_DTYPE_F32, {B, S, H, D});
  sparsa_tensor to = st::host_tensor(out.data(), SPARSA_DTYPE_F32, {B, S, H, D});
  sparsa_tensor tk = st::host_tensor(k_store.data(), SPARSA_DTYPE_F32, {B, Sk, H, D});
  sparsa_tensor tv = st::host_tensor(v_store.data(), SPARSA_DTYPE_F32, {B, Sk, H, D});
  for (sparsa_tensor* t : {&tk, &tv}) {
    t->strides[0] = 0;
    t->strides[1] = D;
    t->strides[2] = 0;
    t->strides[3] = 1;
  }
  sparsa_attention_args args;
  ASSERT_EQ(sparsa_attention_args_init(&args, sizeof args), SPARSA_STATUS_SUCCESS);
  args.q = &tq;
  args.k = &tk;
  args.v = &tv;
  args.out = &to;
  args.causal = 1;
  ASSERT_EQ(sparsa_attention_run(c.ctx.get(), &args, nullptr), SPARSA_STATUS_SUCCESS) << sparsa_last_error_message();
  const ref::Output want = dense_of(p);
  ref::Output got;
  got.o.assign(B, ref::Rows(size_t(S) * H * D));
  for (int b = 0; b < B; ++b)
    for (size_t e = 0; e < got.o[b].size(); ++e) got.o[b][e] = out[size_t(b) * S * H * D + e];
  EXPECT_TRUE(st::outputs_close(got, want, st::kTolF32));
}

// ================================================================================================ merge
TEST(SpecCommonConventions, MergeMinusInfCasesAndInPlace) {
  Cpu c;
  const int D = 3;
  // [B = 1, S = 3, H = 1, D]; rows: both −inf; a −inf; b −inf.
  std::vector<float> oa = {9, 9, 9, 1, 2, 3, 4, 5, 6};
  std::vector<float> ob = {7, 7, 7, -1, -2, -3, 8, 8, 8};
  const float ninf = -std::numeric_limits<float>::infinity();
  std::vector<float> la = {ninf, ninf, 0.5f}, lb = {ninf, 1.25f, ninf};
  sparsa_tensor toa = st::host_tensor(oa.data(), SPARSA_DTYPE_F32, {1, 3, 1, D});
  sparsa_tensor tob = st::host_tensor(ob.data(), SPARSA_DTYPE_F32, {1, 3, 1, D});
  sparsa_tensor tla = st::host_tensor(la.data(), SPARSA_DTYPE_F32, {1, 1, 3});
  sparsa_tensor tlb = st::host_tensor(lb.data(), SPARSA_DTYPE_F32, {1, 1, 3});
  ASSERT_EQ(sparsa_merge_states(c.ctx.get(), &toa, &tla, &tob, &tlb, &toa, &tla), SPARSA_STATUS_SUCCESS);
  const std::vector<float> want_o = {0, 0, 0, -1, -2, -3, 4, 5, 6};
  for (size_t e = 0; e < want_o.size(); ++e) EXPECT_EQ(oa[e], want_o[e]) << "element " << e;
  EXPECT_EQ(la[0], ninf);
  EXPECT_EQ(la[1], 1.25f);
  EXPECT_EQ(la[2], 0.5f);
}


TEST(SpecCommonConventions, MergePackedLayoutMatchesFormula) {
  Cpu c;
  ST_RNG(rng, 48);
  const int T = 5, H = 2, D = 3;
  std::vector<float> oa(size_t(T) * H * D), ob(oa.size()), out(oa.size(), -9.f), la(size_t(H) * T), lb(la.size()),
      lo(la.size(), -9.f);
  for (auto& x : oa) x = float(rng.normal());
  for (auto& x : ob) x = float(rng.normal());
  for (auto& x : la) x = float(rng.uniform(-30, 30));
  for (auto& x : lb) x = float(rng.uniform(-30, 30));
  la[3] = -std::numeric_limits<float>::infinity();
  sparsa_tensor toa = st::host_tensor(oa.data(), SPARSA_DTYPE_F32, {T, H, D});
  sparsa_tensor tob = st::host_tensor(ob.data(), SPARSA_DTYPE_F32, {T, H, D});
  sparsa_tensor tout = st::host_tensor(out.data(), SPARSA_DTYPE_F32, {T, H, D});
  sparsa_tensor tla = st::host_tensor(la.data(), SPARSA_DTYPE_F32, {H, T});
  sparsa_tensor tlb = st::host_tensor(lb.data(), SPARSA_DTYPE_F32, {H, T});
  sparsa_tensor tlo = st::host_tensor(lo.data(), SPARSA_DTYPE_F32, {H, T});
  ASSERT_EQ(sparsa_merge_states(c.ctx.get(), &toa, &tla, &tob, &tlb, &tout, &tlo), SPARSA_STATUS_SUCCESS)
      << sparsa_last_error_message();
  for (int t = 0; t < T; ++t)
    for (int h = 0; h < H; ++h) {
      const double a = la[size_t(h) * T + t], b = lb[size_t(h) * T + t], m = std::max(a, b);
      const double wa = std::exp(a - m), wb = std::exp(b - m);
      EXPECT_NEAR(lo[size_t(h) * T + t], m + std::log(wa + wb), 1e-5 * std::max(1.0, std::fabs(m)));
      for (int d = 0; d < D; ++d) {
        const size_t e = (size_t(t) * H + h) * D + d;
        EXPECT_NEAR(out[e], (wa * oa[e] + wb * ob[e]) / (wa + wb), 1e-5);
      }
    }
}

}  // namespace
