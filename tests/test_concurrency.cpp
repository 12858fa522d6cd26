// Threads: many contexts on many threads give exactly the single-threaded results, and one context used from two
// threads at once answers "in use" (INVALID_ARGUMENT) instead of racing (include/sparsa/sparsa.h, "Threads").
// Sized to take well under a second natively, so it also runs under ThreadSanitizer.
#include <gtest/gtest.h>
#include <sparsa/sparsa.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <functional>
#include <string>
#include <thread>
#include <vector>

#include "test_util.h"

namespace {

constexpr int kStressThreads = 8;
constexpr int kStressRounds = 20;

sparsa_context* make_context(int32_t threads) {
  sparsa_context_options o = st::make_context_options();
  o.num_threads = threads;
  sparsa_context* ctx = nullptr;
  EXPECT_EQ(sparsa_context_create(&o, &ctx), SPARSA_STATUS_SUCCESS);
  return ctx;
}

// Read-only inputs shared by every thread: q [B, S, Hq, D], k/v [B, S, Hkv, D] (f32 and f16 copies), a block mask,
// token indices and draft scores.
struct SharedInputs {
  static constexpr int64_t B = 2, S = 48, Hq = 4, Hkv = 2, D = 16, kBlock = 16, kIdx = 12;
  std::vector<float> q, k, v, scores;
  std::vector<uint16_t> q16, k16, v16;
  std::vector<uint8_t> mask;
  std::vector<int32_t> indices;
  SharedInputs() {
    uint64_t state = 0x9E3779B97F4A7C15ull;
    auto next = [&state] {
      state = state * 6364136223846793005ull + 1442695040888963407ull;
      return float(int64_t(state >> 40) % 2001 - 1000) / 1000.f;
    };
    for (auto* t : {&q, &k, &v}) t->resize(size_t(B * S * (t == &q ? Hq : Hkv) * D));
    for (auto* t : {&q, &k, &v})
      for (float& x : *t) x = next();
    for (auto [from, to] : {std::pair{&q, &q16}, std::pair{&k, &k16}, std::pair{&v, &v16}}) {
      to->resize(from->size());
      for (size_t i = 0; i < from->size(); ++i) (*to)[i] = st::float_to_f16((*from)[i]);
    }
    mask.resize(size_t(B * Hq * (S / kBlock) * (S / kBlock)));
    for (size_t i = 0; i < mask.size(); ++i) mask[i] = (i % 3) != 1;
    indices.resize(size_t(B * Hkv * kIdx));
    for (size_t i = 0; i < indices.size(); ++i) indices[i] = int32_t((i * 7) % S);
    scores.resize(size_t(B * Hq * S));
    for (float& x : scores) x = next();
  }
};

// One call of the API on `ctx`; returns the bytes of every output (poisoned before) and the status.
struct Outcome {
  sparsa_status status = SPARSA_STATUS_INTERNAL;
  std::vector<uint8_t> bytes;
};
using Call = std::function<Outcome(sparsa_context*)>;

Outcome attention(sparsa_context* ctx, const SharedInputs& in, int32_t kind, bool f16) {
  using I = SharedInputs;
  const int32_t dtype = f16 ? SPARSA_DTYPE_F16 : SPARSA_DTYPE_F32;
  const size_t esize = f16 ? 2 : 4;
  std::vector<uint8_t> out(size_t(I::B * I::S * I::Hq * I::D) * esize, 0xA5), lse(size_t(I::B * I::Hq * I::S) * 4, 0xA5);
  void* q = f16 ? (void*)in.q16.data() : (void*)in.q.data();
  void* k = f16 ? (void*)in.k16.data() : (void*)in.k.data();
  void* v = f16 ? (void*)in.v16.data() : (void*)in.v.data();
  sparsa_tensor tq = st::host_tensor(q, dtype, {I::B, I::S, I::Hq, I::D});
  sparsa_tensor tk = st::host_tensor(k, dtype, {I::B, I::S, I::Hkv, I::D});
  sparsa_tensor tv = st::host_tensor(v, dtype, {I::B, I::S, I::Hkv, I::D});
  sparsa_tensor tout = st::host_tensor(out.data(), dtype, {I::B, I::S, I::Hq, I::D});
  sparsa_tensor tlse = st::host_tensor(lse.data(), SPARSA_DTYPE_F32, {I::B, I::Hq, I::S});
  sparsa_tensor tmask = st::host_tensor(const_cast<uint8_t*>(in.mask.data()), SPARSA_DTYPE_U8,
                                        {I::B, I::Hq, I::S / I::kBlock, I::S / I::kBlock});
  sparsa_tensor tidx = st::host_tensor(const_cast<int32_t*>(in.indices.data()), SPARSA_DTYPE_I32, {I::B, I::Hkv, I::kIdx});
  sparsa_attention_args args = st::make_args();
  args.q = &tq;
  args.k = &tk;
  args.v = &tv;
  args.out = &tout;
  args.lse = &tlse;
  args.causal = 1;
  sparsa_policy p = st::make_policy(kind);
  p.block_q = p.block_k = int32_t(I::kBlock);
  p.block_mask = &tmask;
  p.sink_tokens = 4;
  p.sink_window = 8;
  p.select_n_init = 2;
  p.select_n_local = 4;
  p.select_top_k = 8;
  p.indices = &tidx;
  p.token_sparse_min_tokens = 8;
  p.token_sparse_window = 8;
  Outcome o;
  o.status = sparsa_attention_run(ctx, &args, &p);
  o.bytes = out;
  o.bytes.insert(o.bytes.end(), lse.begin(), lse.end());
  return o;
}

Outcome topk(sparsa_context* ctx, const SharedInputs& in) {
  using I = SharedInputs;
  std::vector<int32_t> ids(size_t(I::B * I::Hq * 5), -9);
  sparsa_tensor s = st::host_tensor(const_cast<float*>(in.scores.data()), SPARSA_DTYPE_F32, {I::B, I::Hq, I::S});
  sparsa_tensor o = st::host_tensor(ids.data(), SPARSA_DTYPE_I32, {I::B, I::Hq, 5});
  Outcome r;
  r.status = sparsa_topk_from_scores(ctx, &s, 5, 4, &o);
  const auto* first = reinterpret_cast<const uint8_t*>(ids.data());
  r.bytes.assign(first, first + ids.size() * sizeof(int32_t));
  return r;
}

std::vector<std::pair<std::string, Call>> stress_calls(const SharedInputs& in) {
  std::vector<std::pair<std::string, Call>> calls;
  const std::pair<const char*, int32_t> kinds[] = {{"DENSE", SPARSA_POLICY_DENSE},
                                                   {"SINK_WINDOW", SPARSA_POLICY_SINK_WINDOW},
                                                   {"BLOCK_SPARSE", SPARSA_POLICY_BLOCK_SPARSE},
                                                   {"SPARGE", SPARSA_POLICY_SPARGE},
                                                   {"TOKEN_SPARSE", SPARSA_POLICY_TOKEN_SPARSE},
                                                   {"TOKEN_SELECT", SPARSA_POLICY_TOKEN_SELECT},
                                                   {"TOKEN_INDICES", SPARSA_POLICY_TOKEN_INDICES}};
  for (const auto& [name, kind] : kinds) {
    const int32_t k = kind;
    calls.emplace_back(name, [&in, k](sparsa_context* ctx) { return attention(ctx, in, k, false); });
  }
  calls.emplace_back("DENSE f16", [&in](sparsa_context* ctx) { return attention(ctx, in, SPARSA_POLICY_DENSE, true); });
  calls.emplace_back("topk", [&in](sparsa_context* ctx) { return topk(ctx, in); });
  return calls;
}

TEST(Concurrency, ManyContextsOnManyThreadsMatchOneThreadBitwise) {
  const SharedInputs in;
  const auto calls = stress_calls(in);
  // The reference: every call on a one-worker context, on this thread.
  std::vector<Outcome> want;
  {
    sparsa_context* ctx = make_context(1);
    for (const auto& [name, call] : calls) {
      want.push_back(call(ctx));
      ASSERT_EQ(want.back().status, SPARSA_STATUS_SUCCESS) << name << ": " << sparsa_last_error_message();
    }
    sparsa_context_destroy(ctx);
  }
  // 8 threads, each with its own context: half single-worker, half with their own 2- or 3-worker pools (the API
  // has no pool shared between contexts), every call several times in a thread-specific order.
  std::atomic<int> mismatches{0};
  std::vector<std::string> reports(kStressThreads);
  std::vector<std::thread> threads;
  for (int t = 0; t < kStressThreads; ++t) {
    threads.emplace_back([&, t] {
      sparsa_context* ctx = make_context(t < kStressThreads / 2 ? 1 : 2 + t % 2);
      for (int round = 0; round < kStressRounds; ++round) {
        for (size_t n = 0; n < calls.size(); ++n) {
          const size_t c = (n + size_t(t) * 3 + size_t(round)) % calls.size();
          const Outcome got = calls[c].second(ctx);
          if (got.status != SPARSA_STATUS_SUCCESS || got.bytes != want[c].bytes) {
            ++mismatches;
            reports[size_t(t)] += calls[c].first + " (status " + sparsa_status_string(got.status) + ") ";
          }
        }
      }
      sparsa_context_destroy(ctx);
    });
  }
  for (std::thread& th : threads) th.join();
  EXPECT_EQ(mismatches.load(), 0);
  for (int t = 0; t < kStressThreads; ++t) EXPECT_EQ(reports[size_t(t)], "") << "thread " << t;
}

TEST(Concurrency, OneContextOnTwoThreadsAnswersInUse) {
  const SharedInputs in;
  sparsa_context* ctx = make_context(2);
  const Outcome want = attention(ctx, in, SPARSA_POLICY_DENSE, false);
  ASSERT_EQ(want.status, SPARSA_STATUS_SUCCESS);
  const Outcome want_topk = topk(ctx, in);
  std::atomic<int> busy{0}, wrong{0}, done{0};
  std::atomic<bool> stop{false};
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(5);
  // Thread 0 runs attention; thread 1 alternates attention, top-k and a scratch query, until both have met the
  // other inside the context a few times (or the deadline passes).
  auto hammer = [&](int who) {
    for (int i = 0; !stop.load(); ++i) {
      Outcome got;
      const bool use_topk = who == 1 && i % 3 == 1;
      if (who == 1 && i % 3 == 2) {
        uint64_t bytes = 0;
        got.status = sparsa_context_scratch_bytes(ctx, &bytes);
      } else {
        got = use_topk ? topk(ctx, in) : attention(ctx, in, SPARSA_POLICY_DENSE, false);
        if (got.status == SPARSA_STATUS_SUCCESS && got.bytes != (use_topk ? want_topk : want).bytes) ++wrong;
      }
      if (got.status == SPARSA_STATUS_INVALID_ARGUMENT) {
        if (std::string(sparsa_last_error_message()).find("in use") == std::string::npos) ++wrong;
        ++busy;
      } else if (got.status != SPARSA_STATUS_SUCCESS) {
        ++wrong;
      }
      ++done;
      if (busy.load() >= 20 || std::chrono::steady_clock::now() > deadline) stop = true;
    }
  };
  std::thread a(hammer, 0), b(hammer, 1);
  a.join();
  b.join();
  EXPECT_EQ(wrong.load(), 0) << "a call returned a wrong result or an unexpected status";
  EXPECT_GT(busy.load(), 0) << "the two threads never met inside the context in " << done.load() << " calls";
  // The flag is released: the context works again from this thread.
  EXPECT_EQ(attention(ctx, in, SPARSA_POLICY_DENSE, false).bytes, want.bytes);
  sparsa_context_destroy(ctx);
}

}  // namespace
