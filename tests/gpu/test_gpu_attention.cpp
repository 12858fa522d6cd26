// GPU-only properties of attention through the public C API on a CUDA context: CUDA-graph capture and replay, a
// case beyond the backend's limits refused with a reason, TOKEN_INDICES split-KV against the CPU backend and device
// ids out of range, and merge_states against its formula. Outputs are poisoned before each run. The attention cases
// themselves (§1-§3 over the kernel paths and layouts) are rows of the backend-parameterised case table,
// tests/test_attention_case_tables.cpp. Skips cleanly when no CUDA device/driver is present.
#include <cuda_runtime.h>
#include <gtest/gtest.h>
#include <sparsa/sparsa.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "attention_case.h"
#include "gpu_test_util.h"

namespace {

using namespace sparsa_gpu_test;

constexpr float kNegInf = -std::numeric_limits<float>::infinity();

// A run is captured in a CUDA graph after plan() and replays to the same result (ABI.md rule 9).
TEST(GpuAttentionGraph, CaptureAndReplay) {
  SKIP_WITHOUT_GPU();
  Case c;
  c.name = "graph";
  c.head_dim = 128;
  c.seq_q = {200};
  c.seq_k = {200};
  c.causal = true;
  std::mt19937 rng(7);
  Inputs in = make_inputs(c, rng);
  Physical ph = build_physical(c, in, rng);
  const RunResult eager = run_case(c, in, ph, true);
  ASSERT_EQ(eager.status, SPARSA_STATUS_SUCCESS) << eager.message;

  ScopedStream owned_stream;
  CUDA_OK(cudaStreamCreate(owned_stream.out()));
  const cudaStream_t stream = owned_stream.get();
  ScopedContext context(context_options(SPARSA_DEVICE_CUDA, stream));
  SPARSA_OK(context.status());
  sparsa_context* const ctx = context.get();
  DeviceBuffer q(ph.q.size()), k(ph.k.size()), v(ph.v.size()), out(ph.q.size());
  q.upload(ph.q.data(), ph.q.size());
  k.upload(ph.k.data(), ph.k.size());
  v.upload(ph.v.data(), ph.v.size());
  out.poison();
  sparsa_tensor tq = make_tensor(q.data(), c.dtype, ph.q_shape, SPARSA_DEVICE_CUDA);
  sparsa_tensor tk = make_tensor(k.data(), c.dtype, ph.kv_shape, SPARSA_DEVICE_CUDA);
  sparsa_tensor tv = make_tensor(v.data(), c.dtype, ph.kv_shape, SPARSA_DEVICE_CUDA);
  sparsa_tensor tout = make_tensor(out.data(), c.dtype, ph.out_shape, SPARSA_DEVICE_CUDA);
  sparsa_attention_args args;
  sparsa_attention_args_init(&args, sizeof args);
  args.q = &tq;
  args.k = &tk;
  args.v = &tv;
  args.out = &tout;
  args.causal = 1;
  SPARSA_OK(sparsa_attention_plan(ctx, &args, nullptr));
  ScopedGraph graph;
  CUDA_OK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal));
  const sparsa_status captured = sparsa_attention_run(ctx, &args, nullptr);
  CUDA_OK(cudaStreamEndCapture(stream, graph.out()));
  ASSERT_EQ(captured, SPARSA_STATUS_SUCCESS) << sparsa_last_error_message();
  ScopedGraphExec exec;
  CUDA_OK(cudaGraphInstantiate(exec.out(), graph.get(), 0));
  for (int replay = 0; replay < 3; ++replay) CUDA_OK(cudaGraphLaunch(exec.get(), stream));
  CUDA_OK(cudaStreamSynchronize(stream));
  const std::vector<float> replayed = decode(out.download<uint8_t>(ph.q.size()), c.dtype);
  ASSERT_EQ(replayed.size(), eager.out.size());
  for (size_t i = 0; i < replayed.size(); ++i) ASSERT_EQ(replayed[i], eager.out[i]) << "element " << i;
}

// What the backend does not implement is refused with UNSUPPORTED and a reason, never computed wrongly.
// Every policy runs on the GPU now; a case beyond the backend's limits (head_dim > 256) must still be refused up
// front with UNSUPPORTED and a reason naming the limit, with the output untouched.
TEST(GpuAttentionSupport, CaseBeyondTheLimitsIsUnsupportedWithAReason) {
  SKIP_WITHOUT_GPU();
  constexpr int64_t kTooLargeHeadDim = 320;
  ScopedContext context(context_options(SPARSA_DEVICE_CUDA));
  SPARSA_OK(context.status());
  sparsa_context* const ctx = context.get();
  const int64_t shape[4] = {1, 1, 2, kTooLargeHeadDim};
  const size_t bytes = 2 * kTooLargeHeadDim * 2;
  DeviceBuffer buf(bytes);
  sparsa_tensor t;
  sparsa_tensor_init(&t, sizeof t, buf.data(), SPARSA_DTYPE_F16, 4, shape);
  t.device_type = SPARSA_DEVICE_CUDA;
  sparsa_attention_args args;
  sparsa_attention_args_init(&args, sizeof args);
  DeviceBuffer out(bytes);
  const std::vector<uint8_t> poison(bytes, 0xAB);
  CUDA_OK(cudaMemcpy(out.data(), poison.data(), bytes, cudaMemcpyHostToDevice));
  sparsa_tensor tout = t;
  tout.data = out.data();
  args.q = &t;
  args.k = &t;
  args.v = &t;
  args.out = &tout;
  sparsa_policy policy;
  sparsa_policy_init(&policy, sizeof policy, SPARSA_POLICY_DENSE);
  EXPECT_EQ(sparsa_attention_run(ctx, &args, &policy), SPARSA_STATUS_UNSUPPORTED);
  EXPECT_NE(std::string(sparsa_last_error_message()).find("head_dim"), std::string::npos)
      << sparsa_last_error_message();
  std::vector<uint8_t> after(bytes);
  CUDA_OK(cudaMemcpy(after.data(), out.data(), bytes, cudaMemcpyDeviceToHost));
  EXPECT_EQ(after, poison);
}

// TOKEN_INDICES (§7) at decode and short-chunk shapes with long sequences, so the index-driven kernel splits the
// key list (split-KV + combine): the GPU against the CPU backend on the same bf16 inputs, with LSE, stats and
// selected_indices. Indices hold duplicates and -1 slots; block ids and n_init/n_local are exercised too.
TEST(GpuTokenIndices, SplitKvMatchesCpuBackend) {
  SKIP_WITHOUT_GPU();
  std::mt19937 rng(7);
  std::normal_distribution<float> normal(0.f, 1.f);
  struct Shape { int sq, skv, block_size, n_init, n_local; };
  for (const Shape shape : {Shape{1, 20000, 1, 0, 0}, Shape{3, 9000, 1, 4, 64}, Shape{1, 50000, 16, 16, 128}}) {
    SCOPED_TRACE(::testing::Message() << "sq=" << shape.sq << " skv=" << shape.skv << " bs=" << shape.block_size);
    const int B = 2, Hq = 8, Hkv = 2, D = 128, k = 600;
    const int n_ids = (shape.skv + shape.block_size - 1) / shape.block_size;
    std::vector<float> q(size_t(B) * shape.sq * Hq * D), kv(size_t(B) * shape.skv * Hkv * D), v(kv.size());
    for (auto* x : {&q, &kv, &v})
      for (float& e : *x) e = normal(rng);
    std::vector<int32_t> ids(size_t(B) * Hq * k);
    for (size_t e = 0; e < ids.size(); ++e) {
      const int r = int(rng() % 100);
      ids[e] = r < 10 ? -1 : (r < 20 && e > 0 ? ids[e - 1] : int32_t(rng() % n_ids));
    }
    const std::vector<uint8_t> qb = encode_rounded(q, SPARSA_DTYPE_BF16), kb = encode_rounded(kv, SPARSA_DTYPE_BF16),
                               vb = encode_rounded(v, SPARSA_DTYPE_BF16);
    struct Result { std::vector<uint8_t> out; std::vector<float> lse; std::vector<int64_t> stats;
                    std::vector<int32_t> selected; };
    auto run = [&](int32_t device, Result* res) {
      ScopedContext context(context_options(device));
      SPARSA_OK(context.status());
      sparsa_context* const ctx = context.get();
      const bool gpu = device == SPARSA_DEVICE_CUDA;
      std::vector<uint8_t> out_host(qb.size(), 0xff);
      std::vector<float> lse_host(size_t(B) * Hq * shape.sq, std::nanf(""));
      std::vector<int64_t> stats_host(SPARSA_STAT_COUNT, -1);
      std::vector<int32_t> sel_host(size_t(B) * Hq * shape.skv, 0x5a5a5a5a);
      DeviceBuffer dq(qb.size()), dk(kb.size()), dv(vb.size()), dout(qb.size()), dlse(lse_host.size() * 4),
          dstats(stats_host.size() * 8), dsel(sel_host.size() * 4), dids(ids.size() * 4);
      auto place = [&](DeviceBuffer& d, const void* host, size_t bytes) -> void* {
        if (!gpu) return const_cast<void*>(host);
        d.upload(host, bytes);
        return d.data();
      };
      sparsa_tensor tq = make_tensor(place(dq, qb.data(), qb.size()), SPARSA_DTYPE_BF16, {B, shape.sq, Hq, D}, device);
      sparsa_tensor tk = make_tensor(place(dk, kb.data(), kb.size()), SPARSA_DTYPE_BF16, {B, shape.skv, Hkv, D}, device);
      sparsa_tensor tv = make_tensor(place(dv, vb.data(), vb.size()), SPARSA_DTYPE_BF16, {B, shape.skv, Hkv, D}, device);
      sparsa_tensor tout =
          make_tensor(place(dout, out_host.data(), out_host.size()), SPARSA_DTYPE_BF16, {B, shape.sq, Hq, D}, device);
      sparsa_tensor tlse = make_tensor(place(dlse, lse_host.data(), lse_host.size() * 4), SPARSA_DTYPE_F32,
                                       {B, Hq, shape.sq}, device);
      sparsa_tensor tstats = make_tensor(place(dstats, stats_host.data(), stats_host.size() * 8), SPARSA_DTYPE_I64,
                                         {SPARSA_STAT_COUNT}, device);
      sparsa_tensor tsel = make_tensor(place(dsel, sel_host.data(), sel_host.size() * 4), SPARSA_DTYPE_I32,
                                       {B, Hq, shape.skv}, device);
      sparsa_tensor tids = make_tensor(place(dids, ids.data(), ids.size() * 4), SPARSA_DTYPE_I32, {B, Hq, k}, device);
      sparsa_attention_args args;
      sparsa_attention_args_init(&args, sizeof args);
      args.q = &tq; args.k = &tk; args.v = &tv; args.out = &tout; args.lse = &tlse; args.stats = &tstats;
      args.selected_indices = &tsel;
      sparsa_policy policy;
      sparsa_policy_init(&policy, sizeof policy, SPARSA_POLICY_TOKEN_INDICES);
      policy.indices = &tids;
      policy.index_block_size = shape.block_size;
      policy.index_n_init = shape.n_init;
      policy.index_n_local = shape.n_local;
      SPARSA_OK(sparsa_attention_run(ctx, &args, &policy));
      if (gpu) {
        CUDA_OK(cudaDeviceSynchronize());
        out_host = dout.download<uint8_t>(out_host.size());
        lse_host = dlse.download<float>(lse_host.size());
        stats_host = dstats.download<int64_t>(stats_host.size());
        sel_host = dsel.download<int32_t>(sel_host.size());
      }
      res->out = out_host;
      res->lse = lse_host;
      res->stats = stats_host;
      res->selected = sel_host;
    };
    Result cpu, gpu;
    run(SPARSA_DEVICE_CPU, &cpu);
    run(SPARSA_DEVICE_CUDA, &gpu);
    ASSERT_FALSE(HasFatalFailure());
    EXPECT_EQ(gpu.selected, cpu.selected);
    EXPECT_EQ(gpu.stats, cpu.stats);
    const std::vector<float> og = decode(gpu.out, SPARSA_DTYPE_BF16), oc = decode(cpu.out, SPARSA_DTYPE_BF16);
    double max_diff = 0, max_ref = 0;
    for (size_t e = 0; e < og.size(); ++e) {
      ASSERT_FALSE(std::isnan(og[e])) << "output element " << e << " not written";
      max_diff = std::max(max_diff, double(std::fabs(og[e] - oc[e])));
      max_ref = std::max(max_ref, double(std::fabs(oc[e])));
    }
    EXPECT_LE(max_diff, 1e-2 * max_ref) << "max |gpu - cpu| " << max_diff << ", max |cpu| " << max_ref;
    for (size_t e = 0; e < gpu.lse.size(); ++e) {
      EXPECT_NEAR(gpu.lse[e], cpu.lse[e], 1e-3 * std::max(1.f, std::fabs(cpu.lse[e]))) << "lse " << e;
    }
  }
}

// The header's promise for device index tensors (sparsa.h, TOKEN_INDICES `indices`): contents in device memory are
// not validated (that would need a host sync); an id outside its range is ignored like a -1 slot — no error, no
// out-of-bounds read (run under compute-sanitizer memcheck by bench/gpu/run_device.sh). Planted bad ids (past N,
// far past it, below -1) must give bit for bit the run with those slots set to -1.
TEST(GpuTokenIndices, OutOfRangeDeviceIdsAreIgnoredLikeUnusedSlots) {
  SKIP_WITHOUT_GPU();
  std::mt19937 rng(17);
  std::normal_distribution<float> normal(0.f, 1.f);
  const int B = 1, Sq = 1, Skv = 3000, Hq = 4, Hkv = 2, D = 128, k = 96;
  std::vector<float> q(size_t(B) * Sq * Hq * D), kv(size_t(B) * Skv * Hkv * D), v(kv.size());
  for (auto* x : {&q, &kv, &v})
    for (float& e : *x) e = normal(rng);
  std::vector<int32_t> clean(size_t(B) * Hq * k), planted;
  for (int32_t& id : clean) id = int32_t(rng() % Skv);
  planted = clean;
  const int32_t bad[] = {Skv, Skv + 5, 1 << 30, -7, -2147483647 - 1};
  for (size_t e = 0; e < planted.size(); e += 7) {
    planted[e] = bad[(e / 7) % (sizeof bad / sizeof bad[0])];
    clean[e] = -1;
  }
  const std::vector<uint8_t> qb = encode_rounded(q, SPARSA_DTYPE_BF16), kb = encode_rounded(kv, SPARSA_DTYPE_BF16),
                             vb = encode_rounded(v, SPARSA_DTYPE_BF16);
  auto run = [&](const std::vector<int32_t>& ids, std::vector<uint8_t>* out, std::vector<int32_t>* selected) {
    ScopedContext context(context_options(SPARSA_DEVICE_CUDA));
    SPARSA_OK(context.status());
    sparsa_context* const ctx = context.get();
    DeviceBuffer dq(qb.size()), dk(kb.size()), dv(vb.size()), dout(qb.size()), dsel(size_t(B) * Hq * Skv * 4),
        dids(ids.size() * 4);
    dq.upload(qb.data(), qb.size());
    dk.upload(kb.data(), kb.size());
    dv.upload(vb.data(), vb.size());
    dids.upload(ids.data(), ids.size() * 4);
    CUDA_OK(cudaMemset(dout.data(), 0xff, qb.size()));
    sparsa_tensor tq = make_tensor(dq.data(), SPARSA_DTYPE_BF16, {B, Sq, Hq, D}, SPARSA_DEVICE_CUDA);
    sparsa_tensor tk = make_tensor(dk.data(), SPARSA_DTYPE_BF16, {B, Skv, Hkv, D}, SPARSA_DEVICE_CUDA);
    sparsa_tensor tv = make_tensor(dv.data(), SPARSA_DTYPE_BF16, {B, Skv, Hkv, D}, SPARSA_DEVICE_CUDA);
    sparsa_tensor tout = make_tensor(dout.data(), SPARSA_DTYPE_BF16, {B, Sq, Hq, D}, SPARSA_DEVICE_CUDA);
    sparsa_tensor tsel = make_tensor(dsel.data(), SPARSA_DTYPE_I32, {B, Hq, Skv}, SPARSA_DEVICE_CUDA);
    sparsa_tensor tids = make_tensor(dids.data(), SPARSA_DTYPE_I32, {B, Hq, k}, SPARSA_DEVICE_CUDA);
    sparsa_attention_args args;
    sparsa_attention_args_init(&args, sizeof args);
    args.q = &tq; args.k = &tk; args.v = &tv; args.out = &tout; args.selected_indices = &tsel;
    sparsa_policy policy;
    sparsa_policy_init(&policy, sizeof policy, SPARSA_POLICY_TOKEN_INDICES);
    policy.indices = &tids;
    SPARSA_OK(sparsa_attention_run(ctx, &args, &policy));
    CUDA_OK(cudaDeviceSynchronize());
    *out = dout.download<uint8_t>(qb.size());
    *selected = dsel.download<int32_t>(size_t(B) * Hq * Skv);
  };
  std::vector<uint8_t> out_planted, out_clean;
  std::vector<int32_t> sel_planted, sel_clean;
  run(planted, &out_planted, &sel_planted);
  run(clean, &out_clean, &sel_clean);
  ASSERT_FALSE(HasFatalFailure());
  EXPECT_EQ(out_planted, out_clean) << "out-of-range device ids must act as -1 slots";
  EXPECT_EQ(sel_planted, sel_clean);
  const std::vector<float> decoded = decode(out_planted, SPARSA_DTYPE_BF16);
  for (size_t e = 0; e < decoded.size(); ++e) ASSERT_FALSE(std::isnan(decoded[e])) << "output element " << e;
}

// §0 merge on the device against the host formula, in place into o_a, with the LSE written to its own buffer or
// in place into lse_a; head dims below, at and past one 32-thread row group.
TEST(GpuMergeStates, MatchesFormula) {
  SKIP_WITHOUT_GPU();
  struct Case {
    int64_t head_dim;
    bool lse_in_place;
  };
  for (const Case c : {Case{16, false}, Case{32, true}, Case{80, true}, Case{128, false}}) {
    SCOPED_TRACE("head_dim " + std::to_string(c.head_dim) + (c.lse_in_place ? ", lse in place" : ""));
    const int64_t B = 2, S = 5, H = 3, D = c.head_dim;
    std::mt19937 rng(3);
    std::normal_distribution<float> normal(0.f, 1.f);
    std::vector<float> oa(B * S * H * D), ob(oa.size()), la(B * H * S), lb(la.size());
    for (auto& x : oa) x = normal(rng);
    for (auto& x : ob) x = normal(rng);
    for (auto& x : la) x = normal(rng);
    for (auto& x : lb) x = normal(rng);
    la[0] = lb[0] = kNegInf;  // (b0, h0, s0): both empty
    la[1] = kNegInf;          // (b0, h0, s1): only b
    ScopedContext context(context_options(SPARSA_DEVICE_CUDA));
    SPARSA_OK(context.status());
    sparsa_context* const ctx = context.get();
    DeviceBuffer doa(oa.size() * 4), dob(ob.size() * 4), dla(la.size() * 4), dlb(lb.size() * 4), dlo(la.size() * 4);
    doa.upload(oa.data(), oa.size() * 4);
    dob.upload(ob.data(), ob.size() * 4);
    dla.upload(la.data(), la.size() * 4);
    dlb.upload(lb.data(), lb.size() * 4);
    dlo.poison();
    sparsa_tensor toa = make_tensor(doa.data(), SPARSA_DTYPE_F32, {B, S, H, D}, SPARSA_DEVICE_CUDA);
    sparsa_tensor tob = make_tensor(dob.data(), SPARSA_DTYPE_F32, {B, S, H, D}, SPARSA_DEVICE_CUDA);
    sparsa_tensor tla = make_tensor(dla.data(), SPARSA_DTYPE_F32, {B, H, S}, SPARSA_DEVICE_CUDA);
    sparsa_tensor tlb = make_tensor(dlb.data(), SPARSA_DTYPE_F32, {B, H, S}, SPARSA_DEVICE_CUDA);
    sparsa_tensor tlo = make_tensor(dlo.data(), SPARSA_DTYPE_F32, {B, H, S}, SPARSA_DEVICE_CUDA);
    SPARSA_OK(sparsa_merge_states(ctx, &toa, &tla, &tob, &tlb, &toa, c.lse_in_place ? &tla : &tlo));
    CUDA_OK(cudaDeviceSynchronize());
    const std::vector<float> out = doa.download<float>(oa.size());
    const std::vector<float> lse = (c.lse_in_place ? dla : dlo).download<float>(la.size());
    for (int64_t b = 0; b < B; ++b)
      for (int64_t s = 0; s < S; ++s)
        for (int64_t h = 0; h < H; ++h) {
          const int64_t li = (b * H + h) * S + s;
          const double m = std::max(la[li], lb[li]);
          const bool empty = std::isinf(m) && m < 0;
          const double wa = empty ? 0 : std::exp(la[li] - m), wb = empty ? 0 : std::exp(lb[li] - m);
          if (empty) {
            EXPECT_TRUE(std::isinf(lse[li]) && lse[li] < 0);
          } else {
            EXPECT_NEAR(lse[li], m + std::log(wa + wb), 1e-5);
          }
          for (int64_t d = 0; d < D; ++d) {
            const int64_t oi = ((b * S + s) * H + h) * D + d;
            const double want = empty ? 0.0 : (wa * oa[oi] + wb * ob[oi]) / (wa + wb);
            EXPECT_NEAR(out[oi], want, 1e-5) << "b" << b << " s" << s << " h" << h << " d" << d;
          }
        }
  }
}

}  // namespace
