#define _POSIX_C_SOURCE 200809L /* clock_gettime */
/*
 * Runs the engine example examples/context_parallel_nccl.c (cp_token_select_decode: one TOKEN_SELECT decode step
 * over a KV cache sharded by position, with the engine's NCCL communicator) on the GPUs of one machine, one host
 * thread per rank, and compares the merged output every rank holds with one CPU context's TOKEN_SELECT over the
 * whole cache (the oracle: the context-parallel selection equals the CPU's exactly, docs/context_parallel.md).
 *
 *   cp_example_check [--n N] [--gpus G] [--reps R]
 *
 * bf16 q/k/v, B = 1, GQA 32/8, D = 128, TOKEN_SELECT n_init 128, top_k 2048, n_local 512; 16 needle keys (copies
 * of a query head's row, spread over the cache) so that a wrong selection moves the output. Prints each rank's
 * worst relative difference from the oracle and the wall time of one call of the example function (it allocates
 * and frees its buffers on every call, as written for reading, not for speed). Exit status 0 when every rank is
 * within 2e-2 (bf16 partial states and outputs). Needs NCCL; bench/CMakeLists.txt builds it where NCCL is found.
 */
#include "../../examples/context_parallel_nccl.c"

#include <math.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

enum { kHeadsQ = 32, kHeadsKv = 8, kHeadDim = 128, kNeedles = 16, kMaxGpus = 8 };
static const double kTolerance = 2e-2;

static uint16_t bf16_of(float x) {
  uint32_t bits;
  memcpy(&bits, &x, 4);
  return (uint16_t)((bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16);
}
static float float_of(uint16_t bits) {
  const uint32_t wide = (uint32_t)bits << 16;
  float x;
  memcpy(&x, &wide, 4);
  return x;
}
static uint64_t next_random(uint64_t* state) {  /* splitmix64 */
  uint64_t z = (*state += 0x9e3779b97f4a7c15ull);
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}
static void fill_uniform(uint16_t* x, size_t count, uint64_t seed) {
  for (size_t i = 0; i < count; ++i) x[i] = bf16_of((float)((double)(next_random(&seed) >> 11) * 0x1p-52 - 1.0));
}
static double now_ms(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return (double)t.tv_sec * 1e3 + (double)t.tv_nsec * 1e-6;
}

typedef struct rank_job {
  int32_t rank, gpus, reps;
  int64_t n;
  const uint16_t *q, *k, *v;  /* host: the whole cache */
  ncclComm_t comm;
  uint16_t* out;  /* host: the merged output, [Hq · D] */
  double ms_per_call;
  int status;
} rank_job;

static void* run_rank(void* arg) {
  rank_job* job = (rank_job*)arg;
  const int64_t length = job->n / job->gpus, first = (int64_t)job->rank * length;
  const size_t q_count = (size_t)kHeadsQ * kHeadDim, shard_count = (size_t)length * kHeadsKv * kHeadDim;
  void *q = NULL, *k = NULL, *v = NULL, *seq_lens = NULL, *out = NULL, *lse = NULL;
  cudaStream_t stream = NULL;
  sparsa_context* ctx = NULL;
  int32_t start32 = (int32_t)first, total32 = (int32_t)job->n, length32 = (int32_t)length;
  job->status = -2;
  if (cudaSetDevice(job->rank) != cudaSuccess || cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking) ||
      cudaMalloc(&q, q_count * 2) || cudaMalloc(&k, shard_count * 2) || cudaMalloc(&v, shard_count * 2) ||
      cudaMalloc(&seq_lens, 4) || cudaMalloc(&out, q_count * 2) || cudaMalloc(&lse, kHeadsQ * 4) ||
      cudaMemcpy(q, job->q, q_count * 2, cudaMemcpyHostToDevice) ||
      cudaMemcpy(k, job->k + (size_t)first * kHeadsKv * kHeadDim, shard_count * 2, cudaMemcpyHostToDevice) ||
      cudaMemcpy(v, job->v + (size_t)first * kHeadsKv * kHeadDim, shard_count * 2, cudaMemcpyHostToDevice) ||
      cudaMemcpy(seq_lens, &length32, 4, cudaMemcpyHostToDevice)) {
    goto done;
  }
  {
    sparsa_context_options options;
    SPARSA_CONTEXT_OPTIONS_INIT(&options);
    options.device_type = SPARSA_DEVICE_CUDA;
    options.device_id = job->rank;
    options.stream = stream;
    if ((job->status = sparsa_context_create(&options, &ctx)) != SPARSA_STATUS_SUCCESS) goto done;
    const int64_t q_shape[4] = {1, 1, kHeadsQ, kHeadDim}, kv_shape[4] = {1, length, kHeadsKv, kHeadDim};
    const int64_t one[1] = {1}, lse_shape[3] = {1, kHeadsQ, 1};
    sparsa_tensor tq, tk, tv, tlens, tout, tlse;
    SPARSA_TENSOR_INIT(&tq, q, SPARSA_DTYPE_BF16, 4, q_shape);
    SPARSA_TENSOR_INIT(&tk, k, SPARSA_DTYPE_BF16, 4, kv_shape);
    SPARSA_TENSOR_INIT(&tv, v, SPARSA_DTYPE_BF16, 4, kv_shape);
    SPARSA_TENSOR_INIT(&tlens, seq_lens, SPARSA_DTYPE_I32, 1, one);
    SPARSA_TENSOR_INIT(&tout, out, SPARSA_DTYPE_BF16, 4, q_shape);
    SPARSA_TENSOR_INIT(&tlse, lse, SPARSA_DTYPE_F32, 3, lse_shape);
    sparsa_tensor* on_device[] = {&tq, &tk, &tv, &tlens, &tout, &tlse};
    for (size_t i = 0; i < sizeof on_device / sizeof on_device[0]; ++i) on_gpu(on_device[i], job->rank);
    cp_rank r;
    memset(&r, 0, sizeof r);
    r.rank = job->rank;
    r.num_ranks = job->gpus;
    r.batch = 1;
    r.num_q_heads = kHeadsQ;
    r.head_dim = kHeadDim;
    r.max_shard_len = length;
    r.q_dev = &tq;
    r.k_dev = &tk;
    r.v_dev = &tv;
    r.seq_lens_dev = &tlens;
    SPARSA_TENSOR_INIT(&r.kv_start, &start32, SPARSA_DTYPE_I32, 1, one);
    SPARSA_TENSOR_INIT(&r.kv_total, &total32, SPARSA_DTYPE_I32, 1, one);
    sparsa_policy policy;
    SPARSA_POLICY_INIT(&policy, SPARSA_POLICY_TOKEN_SELECT);
    policy.select_n_init = 128;
    policy.select_top_k = 2048;
    policy.select_n_local = 512;
    if ((job->status = cp_token_select_decode(&r, ctx, &policy, job->comm, stream, &tout, &tlse)) != 0) goto done;
    const double t0 = now_ms();
    for (int i = 0; i < job->reps; ++i) {
      if ((job->status = cp_token_select_decode(&r, ctx, &policy, job->comm, stream, &tout, &tlse)) != 0) goto done;
    }
    job->ms_per_call = (now_ms() - t0) / job->reps;
    job->status = cudaMemcpy(job->out, out, q_count * 2, cudaMemcpyDeviceToHost) == cudaSuccess ? 0 : -2;
  }
done:
  sparsa_context_destroy(ctx);
  cudaFree(q);
  cudaFree(k);
  cudaFree(v);
  cudaFree(seq_lens);
  cudaFree(out);
  cudaFree(lse);
  if (stream != NULL) cudaStreamDestroy(stream);
  return NULL;
}

/* The oracle: TOKEN_SELECT over the whole cache on one CPU context. */
static int cpu_oracle(const uint16_t* q, const uint16_t* k, const uint16_t* v, int64_t n, uint16_t* out) {
  sparsa_context* ctx = NULL;
  sparsa_context_options options;
  SPARSA_CONTEXT_OPTIONS_INIT(&options);
  int status = sparsa_context_create(&options, &ctx);
  if (status != SPARSA_STATUS_SUCCESS) return status;
  const int64_t q_shape[4] = {1, 1, kHeadsQ, kHeadDim}, kv_shape[4] = {1, n, kHeadsKv, kHeadDim};
  sparsa_tensor tq, tk, tv, tout;
  SPARSA_TENSOR_INIT(&tq, (void*)q, SPARSA_DTYPE_BF16, 4, q_shape);
  SPARSA_TENSOR_INIT(&tk, (void*)k, SPARSA_DTYPE_BF16, 4, kv_shape);
  SPARSA_TENSOR_INIT(&tv, (void*)v, SPARSA_DTYPE_BF16, 4, kv_shape);
  SPARSA_TENSOR_INIT(&tout, out, SPARSA_DTYPE_BF16, 4, q_shape);
  sparsa_attention_args args;
  SPARSA_ATTENTION_ARGS_INIT(&args);
  args.q = &tq;
  args.k = &tk;
  args.v = &tv;
  args.out = &tout;
  sparsa_policy policy;
  SPARSA_POLICY_INIT(&policy, SPARSA_POLICY_TOKEN_SELECT);
  policy.select_n_init = 128;
  policy.select_top_k = 2048;
  policy.select_n_local = 512;
  status = sparsa_attention_run(ctx, &args, &policy);
  sparsa_context_destroy(ctx);
  return status;
}

int main(int argc, char** argv) {
  int64_t n = (int64_t)1 << 20;
  int gpus = 0, reps = 5;
  for (int i = 1; i + 1 < argc; i += 2) {
    if (strcmp(argv[i], "--n") == 0) n = atoll(argv[i + 1]);
    else if (strcmp(argv[i], "--gpus") == 0) gpus = atoi(argv[i + 1]);
    else if (strcmp(argv[i], "--reps") == 0) reps = atoi(argv[i + 1]);
    else { fprintf(stderr, "cp_example_check: unknown option %s\n", argv[i]); return 2; }
  }
  int available = 0;
  if (cudaGetDeviceCount(&available) != cudaSuccess) available = 0;
  if (gpus <= 0 || gpus > available) gpus = available;
  if (gpus > kMaxGpus) gpus = kMaxGpus;
  if (gpus < 2) { fprintf(stderr, "cp_example_check: needs two GPUs, found %d\n", available); return 2; }
  if (n % gpus != 0 || n < 8192 || reps < 1) { fprintf(stderr, "cp_example_check: bad --n or --reps\n"); return 2; }

  const size_t q_count = (size_t)kHeadsQ * kHeadDim, kv_count = (size_t)n * kHeadsKv * kHeadDim;
  uint16_t *q = malloc(q_count * 2), *k = malloc(kv_count * 2), *v = malloc(kv_count * 2);
  uint16_t* want = malloc(q_count * 2);
  uint16_t* got = malloc((size_t)gpus * q_count * 2);
  if (!q || !k || !v || !want || !got) { fprintf(stderr, "cp_example_check: out of host memory\n"); return 2; }
  fill_uniform(q, q_count, 1);
  fill_uniform(k, kv_count, 2);
  fill_uniform(v, kv_count, 3);
  for (int i = 0; i < kNeedles; ++i) {  /* key (position, kv head h) = query head h·group's row, doubled */
    const int64_t position = 128 + (int64_t)i * (n - 1024) / kNeedles + 37 * i;
    for (int h = 0; h < kHeadsKv; ++h)
      for (int c = 0; c < kHeadDim; ++c) {
        const size_t at = ((size_t)position * kHeadsKv + h) * kHeadDim + c;
        k[at] = bf16_of(2.0f * float_of(q[((size_t)h * (kHeadsQ / kHeadsKv)) * kHeadDim + c]));
        v[at] = bf16_of((float)(i + 1));
      }
  }
  const double t_oracle = now_ms();
  const int oracle_status = cpu_oracle(q, k, v, n, want);
  if (oracle_status != 0) { fprintf(stderr, "cp_example_check: CPU oracle failed: %d\n", oracle_status); return 1; }
  printf("CPU oracle: TOKEN_SELECT over %lld keys in %.0f ms\n", (long long)n, now_ms() - t_oracle);

  ncclComm_t comms[kMaxGpus];
  int devices[kMaxGpus];
  for (int g = 0; g < gpus; ++g) devices[g] = g;
  if (ncclCommInitAll(comms, gpus, devices) != ncclSuccess) { fprintf(stderr, "ncclCommInitAll failed\n"); return 1; }
  rank_job jobs[kMaxGpus];
  pthread_t threads[kMaxGpus];
  for (int g = 0; g < gpus; ++g) {
    rank_job job = {g, gpus, reps, n, q, k, v, comms[g], got + (size_t)g * q_count, 0.0, -1};
    jobs[g] = job;
    if (pthread_create(&threads[g], NULL, run_rank, &jobs[g]) != 0) {  /* the started ranks would wait forever */
      fprintf(stderr, "cp_example_check: cannot start the thread of rank %d\n", g);
      return 1;
    }
  }
  for (int g = 0; g < gpus; ++g) pthread_join(threads[g], NULL);
  int failed = 0;
  for (int g = 0; g < gpus; ++g) {
    double worst = 0, scale = 0;
    for (size_t i = 0; i < q_count; ++i) {
      const double w = float_of(want[i]), d = fabs((double)float_of(jobs[g].out[i]) - w);
      worst = d > worst || d != d ? d : worst;
      scale = fabs(w) > scale ? fabs(w) : scale;
    }
    const double relative = worst / (scale > 1e-30 ? scale : 1e-30);
    const int ok = jobs[g].status == 0 && relative <= kTolerance;
    failed |= !ok;
    printf("rank %d of %d: status %d, max relative difference from the CPU oracle %.2e, %.3f ms per call: %s\n", g,
           gpus, jobs[g].status, relative, jobs[g].ms_per_call, ok ? "ok" : "FAILED");
  }
  for (int g = 0; g < gpus; ++g) ncclCommDestroy(comms[g]);
  free(q);
  free(k);
  free(v);
  free(want);
  free(got);
  return failed;
}
