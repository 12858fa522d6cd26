/* llama.cpp's CPU attention (ggml's FLASH_ATTN_EXT) timed on the shapes sparsa_cpu_bench times, the CPU peer of
 * docs/performance.md. It is built against a ggml built outside this repository (none of ggml's code is here):
 *
 *   cmake -S ggml -B ggml/build -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON -DGGML_BUILD_TESTS=OFF \
 *         -DGGML_BUILD_EXAMPLES=OFF -DBUILD_SHARED_LIBS=OFF && cmake --build ggml/build -j2
 *   cc -O2 bench/peers/ggml_flash_attn.c -Iggml/include ggml/build/src/libggml.a ggml/build/src/libggml-cpu.a \
 *      ggml/build/src/libggml-base.a -lstdc++ -lm -lpthread -fopenmp -o ggml_flash_attn
 *   ./ggml_flash_attn THREADS SQ SKV HQ HKV D REPEATS
 *
 * One graph: q f32 [D, Sq, Hq], k and v f16 [D, Skv, Hkv] (each head contiguous: the layout that suits ggml best),
 * no mask, scale 1/sqrt(D); planned once on a THREADS-thread ggml_threadpool, run once to warm up, then REPEATS timed
 * runs of ggml_graph_compute. Prints the median and the best wall time in ms. */
#include <ggml-cpu.h>
#include <ggml.h>

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>

static double now_ms(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return t.tv_sec * 1e3 + t.tv_nsec * 1e-6;
}

static int by_value(const void* a, const void* b) {
  const double x = *(const double*)a, y = *(const double*)b;
  return (x > y) - (x < y);
}

static void fill(struct ggml_tensor* t, unsigned* seed) {
  const int64_t n = ggml_nelements(t);
  float* values = malloc(sizeof(float) * (size_t)n);
  for (int64_t i = 0; i < n; ++i) {
    *seed = *seed * 1664525u + 1013904223u;
    values[i] = (float)((*seed >> 8) & 0xffff) / 65536.f * 2.f - 1.f;
  }
  if (t->type == GGML_TYPE_F16) {
    ggml_fp32_to_fp16_row(values, t->data, n);
  } else {
    for (int64_t i = 0; i < n; ++i) ((float*)t->data)[i] = values[i];
  }
  free(values);
}

int main(int argc, char** argv) {
  if (argc != 8) {
    fprintf(stderr, "usage: %s THREADS SQ SKV HQ HKV D REPEATS\n", argv[0]);
    return 2;
  }
  const int threads = atoi(argv[1]), repeats = atoi(argv[7]);
  const int64_t sq = atoll(argv[2]), skv = atoll(argv[3]), hq = atoll(argv[4]), hkv = atoll(argv[5]),
                d = atoll(argv[6]);
  if (threads < 1 || repeats < 1 || sq < 1 || skv < 1 || hq < 1 || hkv < 1 || hq % hkv != 0 || d < 1) {
    fprintf(stderr, "bad arguments\n");
    return 2;
  }
  const size_t bytes = (size_t)(d * sq * hq * 4 * 2 + d * skv * hkv * 2 * 2) + ((size_t)64 << 20);
  struct ggml_init_params params = {bytes, NULL, false};
  struct ggml_context* ctx = ggml_init(params);
  struct ggml_tensor* q = ggml_new_tensor_3d(ctx, GGML_TYPE_F32, d, sq, hq);
  struct ggml_tensor* k = ggml_new_tensor_3d(ctx, GGML_TYPE_F16, d, skv, hkv);
  struct ggml_tensor* v = ggml_new_tensor_3d(ctx, GGML_TYPE_F16, d, skv, hkv);
  unsigned seed = 1;
  fill(q, &seed);
  fill(k, &seed);
  fill(v, &seed);
  struct ggml_tensor* out = ggml_flash_attn_ext(ctx, q, k, v, NULL, 1.f / sqrtf((float)d), 0.f, 0.f);
  struct ggml_cgraph* graph = ggml_new_graph(ctx);
  ggml_build_forward_expand(graph, out);

  struct ggml_threadpool_params pool_params = ggml_threadpool_params_default(threads);
  struct ggml_threadpool* pool = ggml_threadpool_new(&pool_params);
  struct ggml_cplan plan = ggml_graph_plan(graph, threads, pool);
  plan.work_data = malloc(plan.work_size ? plan.work_size : 1);
  if (ggml_graph_compute(graph, &plan) != GGML_STATUS_SUCCESS) {
    fprintf(stderr, "ggml_graph_compute failed\n");
    return 1;
  }
  double* times = malloc(sizeof(double) * (size_t)repeats);
  for (int r = 0; r < repeats; ++r) {
    const double start = now_ms();
    ggml_graph_compute(graph, &plan);
    times[r] = now_ms() - start;
  }
  qsort(times, (size_t)repeats, sizeof(double), by_value);
  printf("ggml FLASH_ATTN_EXT threads=%d Sq=%lld Skv=%lld Hq=%lld Hkv=%lld D=%lld: median %.3f ms, best %.3f ms\n",
         threads, (long long)sq, (long long)skv, (long long)hq, (long long)hkv, (long long)d, times[repeats / 2],
         times[0]);
  free(times);
  free(plan.work_data);
  ggml_threadpool_free(pool);
  ggml_free(ctx);
  return 0;
}
