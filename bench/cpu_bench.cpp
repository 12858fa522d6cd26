// sparsa CPU benchmark.
//   1. Measures the machine's fp32 FMA peak: independent FMA chains on every thread (AVX2 when the CPU has it, and
//      AVX-512F too when it has that: the ratios then use the AVX-512 peak, the kernels' own instruction set).
//   2. Dense fp32 attention, B=1, H=8, N=4096, D=128, non-causal and causal: achieved GFLOP/s (4·D·pairs flops,
//      pairs = N² non-causal) and the ratio to the measured peak.
//   3. Every policy at a moderate size (causal prefill N=2048, decode for TOKEN_SELECT): milliseconds and achieved
//      sparsity from the run's stats.
//   4. GQA decode at long context (Sq=1, Skv=32768, Hq=32, Hkv=8): DENSE, SINK_WINDOW, TOKEN_SELECT.
//   5. fp16 / bf16 K/V (Q and output in the same dtype): the machine's measured read bandwidth (every thread
//      streaming its share of a buffer far larger than the caches), then dense prefill (H=8, N, non-causal), dense
//      decode (Sq=1, GQA 8/2 at Skv=4096 and GQA 32/8 at Skv=decode-n) with the K/V bytes moved per second against
//      that bandwidth, and the selection policies' decode (f16, GQA 32/8, keeping N/8 and N/4 of the keys) against
//      dense at the same N, wall and CPU time.
// Usage: sparsa_cpu_bench [--threads T] [--n N] [--policy-n N] [--decode-n N] [--repeats R] [--half-only 1]
//                         [--select-only 1 [--evict-mib M]].
// Times are the best of R runs after one warm-up run (--half-only: sections 1 and 5 only; --select-only: the
// selection policies' decode only, with --evict-mib M reading M MiB before each timed run so that it starts with
// cold caches). No assertion: numbers are for docs/performance.md.
#if defined(__x86_64__)
#include <immintrin.h>
#endif
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

#if defined(__x86_64__)
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

__attribute__((target("avx512f"))) float fma_loop_avx512(int64_t iterations, float seed) {
  __m512 acc[kFmaChains];
  for (int c = 0; c < kFmaChains; ++c) acc[c] = _mm512_set1_ps(seed + float(c));
  const __m512 a = _mm512_set1_ps(0.999999f);
  const __m512 b = _mm512_set1_ps(1e-7f);
  for (int64_t i = 0; i < iterations; ++i)
#pragma GCC unroll 16
    for (int c = 0; c < kFmaChains; ++c) acc[c] = _mm512_fmadd_ps(acc[c], a, b);
  __m512 sum = acc[0];
  for (int c = 1; c < kFmaChains; ++c) sum = _mm512_add_ps(sum, acc[c]);
  float lanes[2 * kFloatsPerVector];
  _mm512_storeu_ps(lanes, sum);
  return lanes[0];
}
#else
float fma_loop_avx2(int64_t, float seed) { return seed; }    // never called: no AVX2 off x86-64
float fma_loop_avx512(int64_t, float seed) { return seed; }  // never called: no AVX-512 off x86-64
#endif

struct Peak {
  double wall = 0.0;     // flops per wall second, all threads
  double per_cpu = 0.0;  // flops per CPU second (one core's peak)
};

Peak measure_fma_peak_once(int threads, bool avx512) {
  Peak peak;
  const int lanes = avx512 ? 2 * kFloatsPerVector : kFloatsPerVector;
  std::vector<std::thread> pool;
  std::atomic<float> sink{0.f};
  const Clock::time_point start = Clock::now();
  const double cpu_start = process_cpu_seconds();
  for (int t = 0; t < threads; ++t)
    pool.emplace_back([&, t] {
      sink = sink + (avx512 ? fma_loop_avx512(kFmaIterations, float(t)) : fma_loop_avx2(kFmaIterations, float(t)));
    });
  for (std::thread& th : pool) th.join();
  const double flops = double(threads) * kFmaIterations * kFmaChains * lanes * kFlopsPerFma;
  peak.wall = flops / seconds_since(start);
  peak.per_cpu = flops / (process_cpu_seconds() - cpu_start);
  return peak;
}

// The best of several trials: on a shared machine one short trial can land in another tenant's burst.
constexpr int kPeakTrials = 5;
Peak measure_fma_peak(int threads, bool* used_avx2, bool avx512 = false) {
#if defined(__x86_64__)
  __builtin_cpu_init();
  *used_avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
#else
  *used_avx2 = false;
#endif
  Peak best;
  if (!*used_avx2) return best;
  for (int trial = 0; trial < kPeakTrials; ++trial) {
    const Peak peak = measure_fma_peak_once(threads, avx512);
    best.wall = std::max(best.wall, peak.wall);
    best.per_cpu = std::max(best.per_cpu, peak.per_cpu);
  }
  return best;
}

// ---- attention runs ----

struct Problem {
  int64_t batch, seq_q, seq_k, heads_q, heads_kv, dim;
  std::vector<float> q, k, v, out;
  int32_t dtype = SPARSA_DTYPE_F32;           // F16 / BF16: q16, k16, v16, out16 hold the tensors instead
  std::vector<uint16_t> q16, k16, v16, out16;
  bool kv_head_major = false;  // K/V memory ordered [B, Hkv, Skv, D] (strides say so) instead of [B, Skv, Hkv, D]
};

uint16_t float_to_bf16(float f) {
  uint32_t bits;
  std::memcpy(&bits, &f, sizeof bits);
  return uint16_t((bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16);  // round to nearest even (no NaN in the data)
}
uint16_t float_to_f16(float f) {  // round to nearest even; the data hold no NaN
  uint32_t bits;
  std::memcpy(&bits, &f, sizeof bits);
  const uint16_t sign = uint16_t((bits >> 16) & 0x8000u);
  const uint32_t magnitude = bits & 0x7fffffffu;
  if (magnitude >= 0x47800000u) return uint16_t(sign | 0x7c00u);  // >= 65536: infinity
  if (magnitude < 0x38800000u) {                                  // below 2^-14: a multiple of 2^-24
    float a;
    std::memcpy(&a, &magnitude, sizeof a);
    return uint16_t(sign | uint16_t(std::nearbyint(a * 16777216.f)));
  }
  return uint16_t(sign | ((magnitude + 0xfffu + ((magnitude >> 13) & 1u) - (112u << 23)) >> 13));
}

// The same problem with Q, K, V and the output in a 16-bit dtype (the fp32 vectors are released).
void to_half(Problem& p, int32_t dtype) {
  auto narrow = [dtype](std::vector<float>& from, std::vector<uint16_t>& to) {
    to.resize(from.size());
    for (size_t i = 0; i < from.size(); ++i)
      to[i] = dtype == SPARSA_DTYPE_F16 ? float_to_f16(from[i]) : float_to_bf16(from[i]);
    std::vector<float>().swap(from);
  };
  narrow(p.q, p.q16);
  narrow(p.k, p.k16);
  narrow(p.v, p.v16);
  narrow(p.out, p.out16);
  p.dtype = dtype;
}

Problem make_problem(int64_t batch, int64_t seq_q, int64_t seq_k, int64_t heads_q, int64_t heads_kv, int64_t dim) {
  Problem p{batch, seq_q, seq_k, heads_q, heads_kv, dim, {}, {}, {}, {}, SPARSA_DTYPE_F32, {}, {}, {}, {}, false};
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
  double median_seconds = 0.0;  // median wall time of the R runs
  double seconds = 0.0;      // best wall time of one run
  double cpu_seconds = 0.0;  // CPU time of that run (all threads)
  double median_cpu_seconds = 0.0;  // median CPU time of the R runs (all threads)
  int64_t stats[SPARSA_STAT_COUNT] = {};
  bool ok = false;
};

// Reads every cache line of `buffer` (far larger than the last-level cache), so that the next run finds none of its
// inputs in the caches; returns a sum the caller publishes so the reads are not optimised away.
uint64_t evict_caches(const std::vector<uint64_t>& buffer) {
  uint64_t sum = 0;
  constexpr size_t kLineWords = 64 / sizeof(uint64_t);
  for (size_t i = 0; i < buffer.size(); i += kLineWords) sum += buffer[i];
  return sum;
}

// evict: null, or a buffer evict_caches reads before every timed run (outside the timing).
Timing time_run(sparsa_context* ctx, Problem& p, bool causal, const sparsa_policy& policy, int repeats,
                const sparsa_tensor* block_mask = nullptr, const std::vector<uint64_t>* evict = nullptr) {
  sparsa_tensor q, k, v, out, stats;
  const int64_t q_shape[4] = {p.batch, p.seq_q, p.heads_q, p.dim};
  const int64_t kv_shape[4] = {p.batch, p.seq_k, p.heads_kv, p.dim};
  const int64_t stats_shape[1] = {SPARSA_STAT_COUNT};
  Timing timing;
  const bool half = p.dtype != SPARSA_DTYPE_F32;
  sparsa_tensor_init(&q, sizeof q, half ? (void*)p.q16.data() : (void*)p.q.data(), p.dtype, 4, q_shape);
  sparsa_tensor_init(&k, sizeof k, half ? (void*)p.k16.data() : (void*)p.k.data(), p.dtype, 4, kv_shape);
  sparsa_tensor_init(&v, sizeof v, half ? (void*)p.v16.data() : (void*)p.v.data(), p.dtype, 4, kv_shape);
  sparsa_tensor_init(&out, sizeof out, half ? (void*)p.out16.data() : (void*)p.out.data(), p.dtype, 4, q_shape);
  if (p.kv_head_major)
    for (sparsa_tensor* t : {&k, &v}) {
      t->strides[1] = p.dim;
      t->strides[2] = p.seq_k * p.dim;
    }
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
  std::vector<double> walls, cpus;
  uint64_t evicted = 0;
  for (int r = 0; r < repeats; ++r) {
    if (evict) evicted += evict_caches(*evict);
    const Clock::time_point start = Clock::now();
    const double cpu_start = process_cpu_seconds();
    sparsa_attention_run(ctx, &args, &run_policy);
    const double wall = seconds_since(start);
    const double cpu = process_cpu_seconds() - cpu_start;
    walls.push_back(wall);
    cpus.push_back(cpu);
    if (wall < timing.seconds) {
      timing.seconds = wall;
      timing.cpu_seconds = cpu;
    }
  }
  std::sort(walls.begin(), walls.end());
  std::sort(cpus.begin(), cpus.end());
  timing.median_seconds = walls.empty() ? 0.0 : walls[walls.size() / 2];
  timing.median_cpu_seconds = cpus.empty() ? 0.0 : cpus[cpus.size() / 2];
  if (evicted == 1) std::printf("(eviction checksum %llu)\n", (unsigned long long)evicted);  // keeps the reads
  timing.ok = true;
  return timing;
}

// ---- read bandwidth ----

// Bytes per second that `threads` threads reading disjoint parts of one buffer far larger than the last-level cache
// achieve (the best of several trials). Four independent 64-bit sums per thread keep the loads from waiting on each
// other; the result is published so the reads cannot be optimised away.
constexpr size_t kBandwidthBytes = size_t(512) << 20;
constexpr int kBandwidthTrials = 5;
struct Bandwidth {
  double wall = 0.0;     // bytes per wall second, all threads
  double per_cpu = 0.0;  // bytes per CPU-second × threads: the wall rate the threads would reach with the cores alone
};
Bandwidth measure_read_bandwidth(int threads) {
  std::vector<uint64_t> buffer(kBandwidthBytes / sizeof(uint64_t));
  for (size_t i = 0; i < buffer.size(); ++i) buffer[i] = i;  // touch every page before timing
  std::atomic<uint64_t> sink{0};
  Bandwidth best;
  const size_t share = buffer.size() / size_t(threads);
  for (int trial = 0; trial < kBandwidthTrials; ++trial) {
    std::vector<std::thread> pool;
    const Clock::time_point start = Clock::now();
    const double cpu_start = process_cpu_seconds();
    for (int t = 0; t < threads; ++t)
      pool.emplace_back([&, t] {
        const uint64_t* part = buffer.data() + size_t(t) * share;
        uint64_t s0 = 0, s1 = 0, s2 = 0, s3 = 0;
        for (size_t i = 0; i + 4 <= share; i += 4) {
          s0 += part[i];
          s1 += part[i + 1];
          s2 += part[i + 2];
          s3 += part[i + 3];
        }
        sink += s0 ^ s1 ^ s2 ^ s3;
      });
    for (std::thread& th : pool) th.join();
    const double bytes = double(share * size_t(threads) * sizeof(uint64_t));
    best.wall = std::max(best.wall, bytes / seconds_since(start));
    best.per_cpu = std::max(best.per_cpu, bytes * threads / (process_cpu_seconds() - cpu_start));
  }
  return best;
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


// ---- 5. fp16 / bf16 K/V ----

const char* dtype_name(int32_t dtype) { return dtype == SPARSA_DTYPE_F16 ? "f16" : "bf16"; }

// Bytes of K and V a decode run reads: every visited key's K and V row once per kv head.
double decode_kv_bytes(const Timing& t, const Problem& p) {
  const double rows = double(t.stats[SPARSA_STAT_PAIRS_COMPUTED]) / double(p.heads_q / p.heads_kv);
  return rows * 2.0 * double(p.dim) * 2.0;
}

// Selection policies' decode against dense at the same N (f16, GQA 32/8, D=128): TOKEN_SELECT with top_k N/8 and
// N/4, TOKEN_INDICES with N/8 and N/4 indices per kv head (every 8th / 4th key), median wall and CPU time. With
// evict_bytes > 0 every timed run starts with caches holding none of its inputs (a buffer of that size is read
// first, outside the timing): otherwise a selection whose rows fit the last-level cache finds them there, run
// after run, while dense decode's K and V do not fit.
void run_selection_decode(sparsa_context* ctx, int decode_n, int repeats, size_t evict_bytes) {
  constexpr int kDim = 128;
  std::vector<uint64_t> evict_buffer(evict_bytes / sizeof(uint64_t));
  for (size_t i = 0; i < evict_buffer.size(); ++i) evict_buffer[i] = i;
  const std::vector<uint64_t>* evict = evict_bytes > 0 ? &evict_buffer : nullptr;
  for (int64_t seq_k : {int64_t(8192), int64_t(decode_n)}) {
    if (seq_k <= 0) continue;
    Problem decode = make_problem(1, 1, seq_k, 32, 8, kDim);
    to_half(decode, SPARSA_DTYPE_F16);
    std::printf("\nf16 decode Sq=1 Skv=%lld GQA 32/8 D=%d; median of %d runs%s: wall (best), CPU time all threads\n",
                (long long)seq_k, kDim, repeats, evict ? ", caches evicted before each" : "");
    sparsa_policy dense_policy;
    sparsa_policy_init(&dense_policy, sizeof dense_policy, SPARSA_POLICY_DENSE);
    const Timing dense = time_run(ctx, decode, true, dense_policy, repeats, nullptr, evict);
    if (dense.ok)
      std::printf("%-44s %9.3f ms (best %.3f)  CPU %8.3f ms\n", "DENSE", dense.median_seconds * 1e3,
                  dense.seconds * 1e3, dense.median_cpu_seconds * 1e3);
    for (int keep_divisor : {8, 4}) {
      const int32_t keep = int32_t(seq_k / keep_divisor);
      std::vector<int32_t> index_data(size_t(8) * size_t(keep));
      for (size_t i = 0; i < index_data.size(); ++i) index_data[i] = int32_t((i % size_t(keep)) * keep_divisor);
      sparsa_tensor indices;
      const int64_t index_shape[3] = {1, 8, keep};
      sparsa_tensor_init(&indices, sizeof indices, index_data.data(), SPARSA_DTYPE_I32, 3, index_shape);
      // TOKEN_SELECT's scores are raw dot products by default (§6), a peaked softmax here; scaled by 1/sqrt(D) the
      // softmax over these random keys is flat, where the CPU's fp32 screen cannot certify T and the float64 pass
      // decides (the screen's cost is then added). TOKEN_SELECT also attends its n_init + n_local always-kept keys,
      // so top_k = N/4 attends more than a quarter of the keys; the `share` row takes top_k = N/4 − those, a
      // quarter in all.
      enum Variant { kSelectRaw, kSelectScaled, kSelectShare, kIndices };
      for (Variant variant : {kSelectRaw, kSelectScaled, kSelectShare, kIndices}) {
        if (variant == kSelectScaled && keep_divisor != 8) continue;
        if (variant == kSelectShare && keep_divisor != 4) continue;
        const int32_t kind = variant == kIndices ? SPARSA_POLICY_TOKEN_INDICES : SPARSA_POLICY_TOKEN_SELECT;
        sparsa_policy policy;
        sparsa_policy_init(&policy, sizeof policy, kind);
        if (kind == SPARSA_POLICY_TOKEN_SELECT) policy.select_top_k = keep;
        if (variant == kSelectShare) policy.select_top_k = keep - policy.select_n_init - policy.select_n_local;
        if (variant == kSelectScaled) policy.select_scale_scores = 1;
        if (kind == SPARSA_POLICY_TOKEN_INDICES) policy.indices = &indices;
        const Timing t = time_run(ctx, decode, true, policy, repeats, nullptr, evict);
        if (!t.ok) continue;
        const std::string name =
            variant == kSelectShare
                ? "TOKEN_SELECT keys N/4, top_k = " + std::to_string(policy.select_top_k)
                : std::string(kind == SPARSA_POLICY_TOKEN_SELECT ? "TOKEN_SELECT" : "TOKEN_INDICES") + " keep N/" +
                      std::to_string(keep_divisor) + " = " + std::to_string(keep) +
                      (variant == kSelectScaled ? " scaled" : "");
        std::printf("%-44s %9.3f ms (best %.3f)  CPU %8.3f ms  sparsity %.3f  vs dense: wall %.2fx, CPU %.2fx\n",
                    name.c_str(), t.median_seconds * 1e3, t.seconds * 1e3, t.median_cpu_seconds * 1e3, sparsity(t),
                    dense.ok ? t.median_seconds / dense.median_seconds : 0.0,
                    dense.ok ? t.median_cpu_seconds / dense.median_cpu_seconds : 0.0);
      }
    }
  }
}

void run_half_sections(sparsa_context* ctx, int threads, int n, int decode_n, int repeats) {
  constexpr int kHeads = 8;
  constexpr int kDim = 128;
  const Bandwidth bandwidth = measure_read_bandwidth(threads);
  std::printf("\nmeasured read bandwidth (%d threads, %zu MiB buffer, best of %d): %.1f GB/s wall, %.1f GB/s per "
              "CPU-second x threads\n",
              threads, kBandwidthBytes >> 20, kBandwidthTrials, bandwidth.wall * 1e-9, bandwidth.per_cpu * 1e-9);
  sparsa_policy dense_policy;
  sparsa_policy_init(&dense_policy, sizeof dense_policy, SPARSA_POLICY_DENSE);
  for (int32_t dtype : {SPARSA_DTYPE_F16, SPARSA_DTYPE_BF16}) {
    std::printf("\n%s K/V (Q, output the same dtype), D=%d; median and best of %d runs\n", dtype_name(dtype), kDim,
                repeats);
    {
      Problem prefill = make_problem(1, n, n, kHeads, kHeads, kDim);
      to_half(prefill, dtype);
      const Timing t = time_run(ctx, prefill, false, dense_policy, repeats);
      if (t.ok)
        std::printf("%-44s %9.2f ms (best %.2f)  %6.1f GFLOP/s\n",
                    (std::string("dense prefill non-causal H=8 N=") + std::to_string(n)).c_str(),
                    t.median_seconds * 1e3, t.seconds * 1e3,
                    4.0 * kDim * double(t.stats[SPARSA_STAT_PAIRS_COMPUTED]) / t.median_seconds * 1e-9);
    }
    struct DecodeShape {
      int64_t seq_k, heads_q, heads_kv;
    };
    const DecodeShape shapes[] = {{4096, 8, 2}, {decode_n, 32, 8}};
    for (const DecodeShape& shape : shapes) {
      if (shape.seq_k <= 0) continue;
      Problem decode = make_problem(1, 1, shape.seq_k, shape.heads_q, shape.heads_kv, kDim);
      to_half(decode, dtype);
      decode.kv_head_major = std::getenv("SPARSA_BENCH_HEAD_MAJOR") != nullptr;
      const Timing t = time_run(ctx, decode, true, dense_policy, repeats);
      if (!t.ok) continue;
      // Rates from the best run's wall time, and from its CPU time (what the threads would take with the cores
      // alone, the same measure as the bandwidth's per-CPU figure).
      const double bytes = decode_kv_bytes(t, decode);
      const double rate = bytes / t.seconds;
      const double rate_cpu = bytes * threads / t.cpu_seconds;
      std::printf("dense decode Sq=1 Skv=%-6lld GQA %lld/%lld %14s %9.3f ms (best %.3f)  K+V %.1f GB/s = %.2f of "
                  "read bandwidth; per CPU-second %.1f GB/s = %.2f\n",
                  (long long)shape.seq_k, (long long)shape.heads_q, (long long)shape.heads_kv, "",
                  t.median_seconds * 1e3, t.seconds * 1e3, rate * 1e-9, rate / bandwidth.wall, rate_cpu * 1e-9,
                  rate_cpu / bandwidth.per_cpu);
    }
  }
  run_selection_decode(ctx, decode_n, repeats, 0);
}

}  // namespace

int main(int argc, char** argv) {
  const int threads = int_option(argc, argv, "--threads", int(std::max(1u, std::thread::hardware_concurrency())));
  const int n = int_option(argc, argv, "--n", 4096);
  const int policy_n = int_option(argc, argv, "--policy-n", 2048);
  const int repeats = int_option(argc, argv, "--repeats", 3);
  const int decode_n = int_option(argc, argv, "--decode-n", 32768);  // 0 skips the long decode cases
  const bool half_only = int_option(argc, argv, "--half-only", 0) != 0;
  const bool select_only = int_option(argc, argv, "--select-only", 0) != 0;
  const int evict_mib = int_option(argc, argv, "--evict-mib", 0);  // with --select-only
  constexpr int kHeads = 8;
  constexpr int kDim = 128;

  std::printf("sparsa %s CPU benchmark, %d threads\n", sparsa_version_string(), threads);
  if (select_only) {
    sparsa_context_options options;
    sparsa_context_options_init(&options, sizeof options);
    options.num_threads = threads;
    sparsa_context* ctx = nullptr;
    if (sparsa_context_create(&options, &ctx) != SPARSA_STATUS_SUCCESS) {
      std::printf("context: %s\n", sparsa_last_error_message());
      return 1;
    }
    run_selection_decode(ctx, decode_n, repeats, size_t(std::max(0, evict_mib)) << 20);
    sparsa_context_destroy(ctx);
    return 0;
  }
  bool avx2 = false;
  Peak peak = measure_fma_peak(threads, &avx2);
  if (avx2) {
    std::printf("measured fp32 FMA peak (AVX2, %d threads): %.1f GFLOP/s wall, %.1f GFLOP per CPU-second\n", threads,
                peak.wall * 1e-9, peak.per_cpu * 1e-9);
  } else {
    std::printf("no AVX2+FMA on this CPU: peak not measured\n");
  }
#if defined(__x86_64__)
  // With AVX-512F the library's matrix kernels use it (microkernels_avx512.cpp): the ratios below are then taken
  // against the AVX-512 peak.
  if (avx2 && __builtin_cpu_supports("avx512f")) {
    peak = measure_fma_peak(threads, &avx2, /*avx512=*/true);
    std::printf("measured fp32 FMA peak (AVX-512F, %d threads): %.1f GFLOP/s wall, %.1f GFLOP per CPU-second (the "
                "ratios below use this one)\n",
                threads, peak.wall * 1e-9, peak.per_cpu * 1e-9);
  }
#endif

  sparsa_context_options options;
  sparsa_context_options_init(&options, sizeof options);
  options.num_threads = threads;
  sparsa_context* ctx = nullptr;
  if (sparsa_context_create(&options, &ctx) != SPARSA_STATUS_SUCCESS) {
    std::printf("context: %s\n", sparsa_last_error_message());
    return 1;
  }
  if (half_only) {
    run_half_sections(ctx, threads, n, decode_n, repeats);
    sparsa_context_destroy(ctx);
    return 0;
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
  run_half_sections(ctx, threads, n, decode_n, repeats);
  sparsa_context_destroy(ctx);
  return 0;
}
