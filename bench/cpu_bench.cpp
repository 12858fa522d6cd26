// sparsa CPU benchmark.
//   1. Measures the machine's fp32 FMA peak: independent FMA chains on every thread (AVX2 when the CPU has it).
//   2. Dense fp32 attention, B=1, H=8, N=4096, D=128, non-causal and causal: achieved GFLOP/s (4·D·pairs flops,
//      pairs = N² non-causal) and the ratio to the measured peak.
//   3. Every policy at a moderate size (causal prefill N=2048, decode for TOKEN_SELECT): milliseconds and achieved
//      sparsity from the run's stats.
//   4. GQA decode at long context (Sq=1, Skv=32768, Hq=32, Hkv=8): DENSE, SINK_WINDOW, TOKEN_SELECT.
// Usage: sparsa_cpu_bench [--threads T] [--n N] [--policy-n N] [--decode-n N] [--repeats R]. Times are the best of
// R runs after one warm-up run. No assertion: numbers are for docs/performance.md.
#include <immintrin.h>
#include <sparsa/sparsa.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <random>
#include <string>
#include <thread>
#include <vector>

namespace {

using Clock = std::chrono::steady_clock;

constexpr int kFmaChains = 10;  // independent accumulators: enough to cover FMA latency × 2 pipes
constexpr int64_t kFmaIterations = 40'000'000;
constexpr int kFloatsPerVector = 8;
constexpr int kFlopsPerFma = 2;

double seconds_since(Clock::time_point start) { return std::chrono::duration<double>(Clock::now() - start).count(); }

// CPU seconds consumed by the whole process (all threads). On a shared machine wall-clock rates depend on what
// else runs; flops per CPU-second of the kernel against flops per CPU-second of the FMA loop do not (much).
double process_cpu_seconds() {
  timespec t{};
  clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &t);
  return double(t.tv_sec) + 1e-9 * double(t.tv_nsec);
}

// ---- 1. FMA peak ----

__attribute__((target("avx2,fma"))) float fma_loop_avx2(int64_t iterations, float seed) {
  __m256 acc[kFmaChains];
  for (int c = 0; c < kFmaChains; ++c) acc[c] = _mm256_set1_ps(seed + float(c));
  const __m256 a = _mm256_set1_ps(0.999999f);
  const __m256 b = _mm256_set1_ps(1e-7f);
  for (int64_t i = 0; i < iterations; ++i)
#pragma GCC unroll 16
    for (int c = 0; c < kFmaChains; ++c) acc[c] = _mm256_fmadd_ps(acc[c], a, b);
  __m256 sum = acc[0];
  for (int c = 1; c < kFmaChains; ++c) sum = _mm256_add_ps(sum, acc[c]);
  float lanes[kFloatsPerVector];
  _mm256_storeu_ps(lanes, sum);
  return lanes[0];
}

struct Peak {
  double wall = 0.0;     // flops per wall second, all threads
  double per_cpu = 0.0;  // flops per CPU second (one core's peak)
};

Peak measure_fma_peak_once(int threads) {
  Peak peak;
  std::vector<std::thread> pool;
  std::atomic<float> sink{0.f};
  const Clock::time_point start = Clock::now();
  const double cpu_start = process_cpu_seconds();
  for (int t = 0; t < threads; ++t)
    pool.emplace_back([&, t] { sink = sink + fma_loop_avx2(kFmaIterations, float(t)); });
  for (std::thread& th : pool) th.join();
  const double flops = double(threads) * kFmaIterations * kFmaChains * kFloatsPerVector * kFlopsPerFma;
  peak.wall = flops / seconds_since(start);
  peak.per_cpu = flops / (process_cpu_seconds() - cpu_start);
  return peak;
}

// The best of several trials: on a shared machine one short trial can land in another tenant's burst.
constexpr int kPeakTrials = 5;
Peak measure_fma_peak(int threads, bool* used_avx2) {
  __builtin_cpu_init();
  *used_avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  Peak best;
  if (!*used_avx2) return best;
  for (int trial = 0; trial < kPeakTrials; ++trial) {
    const Peak peak = measure_fma_peak_once(threads);
    best.wall = std::max(best.wall, peak.wall);
    best.per_cpu = std::max(best.per_cpu, peak.per_cpu);
  }
  return best;
}

// ---- attention runs ----

struct Problem {
  int64_t batch, seq_q, seq_k, heads_q, heads_kv, dim;
  std::vector<float> q, k, v, out;
};

Problem make_problem(int64_t batch, int64_t seq_q, int64_t seq_k, int64_t heads_q, int64_t heads_kv, int64_t dim) {
  Problem p{batch, seq_q, seq_k, heads_q, heads_kv, dim, {}, {}, {}, {}};
  std::mt19937 rng(42);
  std::normal_distribution<float> normal(0.f, 1.f);
  p.q.resize(size_t(batch * seq_q * heads_q * dim));
  p.k.resize(size_t(batch * seq_k * heads_kv * dim));
  p.v.resize(p.k.size());
  p.out.resize(p.q.size());
  // Keys and queries are a per-channel offset plus a slow random walk over positions, so that neighbouring tokens
  // are similar (as in real prefill) and SpargeAttn's self-similarity test sees coherent blocks.
  for (auto* x : {&p.q, &p.k}) {
    std::vector<float> offset(static_cast<size_t>(dim), 0.f), walk(static_cast<size_t>(dim), 0.f);
    for (float& o : offset) o = normal(rng);
    for (size_t i = 0; i < x->size(); ++i) {
      float& w = walk[i % size_t(dim)];
      w = 0.99f * w + 0.1f * normal(rng);
      (*x)[i] = offset[i % size_t(dim)] + w;
    }
  }
  for (float& x : p.v) x = normal(rng);
  return p;
}

struct Timing {
  double seconds = 0.0;      // best wall time of one run
  double cpu_seconds = 0.0;  // CPU time of that run (all threads)
  int64_t stats[SPARSA_STAT_COUNT] = {};
  bool ok = false;
};

Timing time_run(sparsa_context* ctx, Problem& p, bool causal, const sparsa_policy& policy, int repeats,
                const sparsa_tensor* block_mask = nullptr) {
  sparsa_tensor q, k, v, out, stats;
  const int64_t q_shape[4] = {p.batch, p.seq_q, p.heads_q, p.dim};
  const int64_t kv_shape[4] = {p.batch, p.seq_k, p.heads_kv, p.dim};
  const int64_t stats_shape[1] = {SPARSA_STAT_COUNT};
  Timing timing;
  sparsa_tensor_init(&q, sizeof q, p.q.data(), SPARSA_DTYPE_F32, 4, q_shape);
  sparsa_tensor_init(&k, sizeof k, p.k.data(), SPARSA_DTYPE_F32, 4, kv_shape);
  sparsa_tensor_init(&v, sizeof v, p.v.data(), SPARSA_DTYPE_F32, 4, kv_shape);
  sparsa_tensor_init(&out, sizeof out, p.out.data(), SPARSA_DTYPE_F32, 4, q_shape);
  sparsa_tensor_init(&stats, sizeof stats, timing.stats, SPARSA_DTYPE_I64, 1, stats_shape);
  sparsa_attention_args args;
  sparsa_attention_args_init(&args, sizeof args);
  args.q = &q;
  args.k = &k;
  args.v = &v;
  args.out = &out;
  args.causal = causal ? 1 : 0;
  args.stats = &stats;
  sparsa_policy run_policy = policy;
  if (block_mask) run_policy.block_mask = block_mask;
  if (sparsa_attention_run(ctx, &args, &run_policy) != SPARSA_STATUS_SUCCESS) {
    std::printf("  run failed: %s\n", sparsa_last_error_message());
    return timing;
  }
  timing.seconds = 1e300;
  for (int r = 0; r < repeats; ++r) {
    const Clock::time_point start = Clock::now();
    const double cpu_start = process_cpu_seconds();
    sparsa_attention_run(ctx, &args, &run_policy);
    const double wall = seconds_since(start);
    if (wall < timing.seconds) {
      timing.seconds = wall;
      timing.cpu_seconds = process_cpu_seconds() - cpu_start;
    }
  }
  timing.ok = true;
  return timing;
}

double sparsity(const Timing& t) {
  const int64_t dense = t.stats[SPARSA_STAT_PAIRS_DENSE];
  return dense > 0 ? 1.0 - double(t.stats[SPARSA_STAT_PAIRS_COMPUTED]) / double(dense) : 0.0;
}

int int_option(int argc, char** argv, const char* name, int fallback) {
  for (int i = 1; i + 1 < argc; ++i)
    if (std::strcmp(argv[i], name) == 0) return std::atoi(argv[i + 1]);
  return fallback;
}

}  // namespace

int main(int argc, char** argv) {
  const int threads = int_option(argc, argv, "--threads", int(std::max(1u, std::thread::hardware_concurrency())));
  const int n = int_option(argc, argv, "--n", 4096);
  const int policy_n = int_option(argc, argv, "--policy-n", 2048);
  const int repeats = int_option(argc, argv, "--repeats", 3);
  const int decode_n = int_option(argc, argv, "--decode-n", 32768);  // 0 skips the long decode cases
  constexpr int kHeads = 8;
  constexpr int kDim = 128;

  std::printf("sparsa %s CPU benchmark, %d threads\n", sparsa_version_string(), threads);
  bool avx2 = false;
  const Peak peak = measure_fma_peak(threads, &avx2);
  if (avx2) {
    std::printf("measured fp32 FMA peak (AVX2, %d threads): %.1f GFLOP/s wall, %.1f GFLOP per CPU-second\n", threads,
                peak.wall * 1e-9, peak.per_cpu * 1e-9);
  } else {
    std::printf("no AVX2+FMA on this CPU: peak not measured\n");
  }

  sparsa_context_options options;
  sparsa_context_options_init(&options, sizeof options);
  options.num_threads = threads;
  sparsa_context* ctx = nullptr;
  if (sparsa_context_create(&options, &ctx) != SPARSA_STATUS_SUCCESS) {
    std::printf("context: %s\n", sparsa_last_error_message());
    return 1;
  }

  // ---- 2. dense fp32 against the peak ----
  Problem dense = make_problem(1, n, n, kHeads, kHeads, kDim);
  sparsa_policy dense_policy;
  sparsa_policy_init(&dense_policy, sizeof dense_policy, SPARSA_POLICY_DENSE);
  for (bool causal : {false, true}) {
    const Timing t = time_run(ctx, dense, causal, dense_policy, repeats);
    if (!t.ok) continue;
    const double flops = 4.0 * kDim * double(t.stats[SPARSA_STAT_PAIRS_COMPUTED]);
    const double achieved = flops / t.seconds;
    const double per_cpu = flops / t.cpu_seconds;
    std::printf("dense f32 B=1 H=%d N=%d D=%d %-10s %8.1f ms  %6.1f GFLOP/s", kHeads, n, kDim,
                causal ? "causal" : "non-causal", t.seconds * 1e3, achieved * 1e-9);
    if (avx2) {
      std::printf("  = %.2f of measured peak; %.1f GFLOP per CPU-second = %.2f of per-core peak", achieved / peak.wall,
                  per_cpu * 1e-9, per_cpu / peak.per_cpu);
    }
    std::printf("\n");
  }

  // ---- 3. every policy at a moderate size ----
  std::printf("\npolicies, f32, B=1, Hq=%d, Hkv=%d, D=%d, causal prefill N=%d (TOKEN_SELECT: decode over N keys)\n",
              kHeads, kHeads / 4, kDim, policy_n);
  Problem prefill = make_problem(1, policy_n, policy_n, kHeads, kHeads / 4, kDim);
  Problem decode = make_problem(1, 1, policy_n, kHeads, kHeads / 4, kDim);

  const int64_t block_q = 128, block_k = 64;
  const int64_t n_q_blocks = (policy_n + block_q - 1) / block_q, n_k_blocks = (policy_n + block_k - 1) / block_k;
  std::vector<uint8_t> mask_data(size_t(kHeads * n_q_blocks * n_k_blocks));
  std::mt19937 rng(7);
  for (uint8_t& m : mask_data) m = uint8_t(rng() % 4 == 0 ? 1 : 0);  // 25% of blocks
  sparsa_tensor mask;
  const int64_t mask_shape[4] = {1, kHeads, n_q_blocks, n_k_blocks};
  sparsa_tensor_init(&mask, sizeof mask, mask_data.data(), SPARSA_DTYPE_U8, 4, mask_shape);

  const int32_t index_k = policy_n / 8;
  std::vector<int32_t> index_data(size_t(kHeads / 4) * size_t(index_k));
  for (size_t i = 0; i < index_data.size(); ++i) index_data[i] = int32_t((i % size_t(index_k)) * 8);
  sparsa_tensor indices;
  const int64_t index_shape[3] = {1, kHeads / 4, index_k};
  sparsa_tensor_init(&indices, sizeof indices, index_data.data(), SPARSA_DTYPE_I32, 3, index_shape);

  struct Case {
    const char* name;
    int32_t kind;
    bool decode;
    void (*tweak)(sparsa_policy*);
  };
  const Case cases[] = {
      {"DENSE", SPARSA_POLICY_DENSE, false, nullptr},
      {"SINK_WINDOW (128 + 512)", SPARSA_POLICY_SINK_WINDOW, false, [](sparsa_policy* p) { p->sink_window = 512; }},
      {"BLOCK_SPARSE (25% blocks)", SPARSA_POLICY_BLOCK_SPARSE, false, nullptr},
      {"SPARGE (defaults)", SPARSA_POLICY_SPARGE, false, nullptr},
      {"SPARGE (topk 0.3, lambda -5)", SPARSA_POLICY_SPARGE, false,
       [](sparsa_policy* p) {
         p->sparge_topk_fraction = 0.3f;
         p->sparge_lambda = -5.f;
       }},
      {"SPARGE quantized (topk 0.3)", SPARSA_POLICY_SPARGE, false,
       [](sparsa_policy* p) {
         p->sparge_topk_fraction = 0.3f;
         p->sparge_quantized = 1;
       }},
      {"TOKEN_SPARSE (min_tokens 512)", SPARSA_POLICY_TOKEN_SPARSE, false,
       [](sparsa_policy* p) { p->token_sparse_min_tokens = 512; }},
      {"TOKEN_INDICES (N/8 tokens)", SPARSA_POLICY_TOKEN_INDICES, false, nullptr},
      {"DELTA over SINK_WINDOW", SPARSA_POLICY_SINK_WINDOW, false,
       [](sparsa_policy* p) {
         p->sink_window = 512;
         p->flags = SPARSA_POLICY_FLAG_DELTA;
       }},
      {"TOKEN_SELECT decode (top_k 256)", SPARSA_POLICY_TOKEN_SELECT, true,
       [](sparsa_policy* p) { p->select_top_k = 256; }},
      {"DENSE decode", SPARSA_POLICY_DENSE, true, nullptr},
  };
  for (const Case& c : cases) {
    sparsa_policy policy;
    sparsa_policy_init(&policy, sizeof policy, c.kind);
    if (c.tweak) c.tweak(&policy);
    if (c.kind == SPARSA_POLICY_TOKEN_INDICES) policy.indices = &indices;
    const Timing t = time_run(ctx, c.decode ? decode : prefill, true, policy, repeats,
                              c.kind == SPARSA_POLICY_BLOCK_SPARSE ? &mask : nullptr);
    if (!t.ok) {
      std::printf("%-34s failed\n", c.name);
      continue;
    }
    std::printf("%-34s %9.2f ms   sparsity %.3f   blocks %lld/%lld   pv skipped %lld\n", c.name, t.seconds * 1e3,
                sparsity(t), (long long)t.stats[SPARSA_STAT_BLOCKS_COMPUTED],
                (long long)t.stats[SPARSA_STAT_BLOCKS_TOTAL], (long long)t.stats[SPARSA_STAT_PV_BLOCKS_SKIPPED]);
  }

  // ---- 4. GQA decode at long context: one query row per sequence, Hq = 32 over Hkv = 8 ----
  constexpr int kDecodeHeadsQ = 32;
  constexpr int kDecodeHeadsKv = 8;
  if (decode_n > 0) {
    std::printf("\ndecode, f32, B=1, Sq=1, Skv=%d, Hq=%d, Hkv=%d, D=%d\n", decode_n, kDecodeHeadsQ, kDecodeHeadsKv,
                kDim);
    Problem long_decode = make_problem(1, 1, decode_n, kDecodeHeadsQ, kDecodeHeadsKv, kDim);
    const Case decode_cases[] = {
        {"DENSE decode", SPARSA_POLICY_DENSE, true, nullptr},
        {"SINK_WINDOW decode (128 + 4096)", SPARSA_POLICY_SINK_WINDOW, true,
         [](sparsa_policy* p) { p->sink_window = 4096; }},
        {"TOKEN_SELECT decode (top_k 2048)", SPARSA_POLICY_TOKEN_SELECT, true,
         [](sparsa_policy* p) { p->select_top_k = 2048; }},
    };
    for (const Case& c : decode_cases) {
      sparsa_policy policy;
      sparsa_policy_init(&policy, sizeof policy, c.kind);
      if (c.tweak) c.tweak(&policy);
      const Timing t = time_run(ctx, long_decode, true, policy, repeats);
      if (!t.ok) {
        std::printf("%-34s failed\n", c.name);
        continue;
      }
      // K and V rows of the visited keys, read once per kv head: pairs / (Hq/Hkv) rows of 2·D floats.
      const double rows = double(t.stats[SPARSA_STAT_PAIRS_COMPUTED]) / (kDecodeHeadsQ / kDecodeHeadsKv);
      const double bytes = rows * 2.0 * kDim * sizeof(float);
      std::printf("%-34s %9.2f ms   pairs %lld   (visited K+V read once: %.1f GB/s)\n", c.name, t.seconds * 1e3,
                  (long long)t.stats[SPARSA_STAT_PAIRS_COMPUTED], bytes / t.seconds * 1e-9);
    }
  }
  sparsa_context_destroy(ctx);
  return 0;
}
