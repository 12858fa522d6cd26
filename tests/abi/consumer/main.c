/* A downstream program that knows sparsa only through an installed prefix: built once with find_package(sparsa)
   and once with pkg-config. It runs one small dense attention call on the CPU and checks the output. */
#include <math.h>
#include <sparsa/sparsa.h>
#include <stdio.h>

enum { kSeq = 4, kHeads = 2, kDim = 8 };

int main(void) {
  float q[kSeq * kHeads * kDim], k[kSeq * kHeads * kDim], v[kSeq * kHeads * kDim], out[kSeq * kHeads * kDim];
  const int64_t shape[4] = {1, kSeq, kHeads, kDim};
  sparsa_tensor tq, tk, tv, tout;
  sparsa_attention_args args;
  sparsa_context* ctx = NULL;
  int i;

  for (i = 0; i < kSeq * kHeads * kDim; ++i) {
    q[i] = (float)((i * 7) % 5) * 0.1f;
    k[i] = (float)((i * 3) % 7) * 0.1f;
    v[i] = 1.0f; /* every row of V is 1, so every output element must be 1 */
    out[i] = 0.0f;
  }
  SPARSA_TENSOR_INIT(&tq, q, SPARSA_DTYPE_F32, 4, shape);
  SPARSA_TENSOR_INIT(&tk, k, SPARSA_DTYPE_F32, 4, shape);
  SPARSA_TENSOR_INIT(&tv, v, SPARSA_DTYPE_F32, 4, shape);
  SPARSA_TENSOR_INIT(&tout, out, SPARSA_DTYPE_F32, 4, shape);
  SPARSA_ATTENTION_ARGS_INIT(&args);
  args.q = &tq;
  args.k = &tk;
  args.v = &tv;
  args.out = &tout;
  args.causal = 1;

  if (sparsa_context_create(NULL, &ctx) != SPARSA_STATUS_SUCCESS) {
    fprintf(stderr, "sparsa_context_create: %s\n", sparsa_last_error_message());
    return 1;
  }
  if (sparsa_attention_run(ctx, &args, NULL) != SPARSA_STATUS_SUCCESS) {
    fprintf(stderr, "sparsa_attention_run: %s\n", sparsa_last_error_message());
    sparsa_context_destroy(ctx);
    return 1;
  }
  sparsa_context_destroy(ctx);
  for (i = 0; i < kSeq * kHeads * kDim; ++i) {
    if (fabsf(out[i] - 1.0f) > 1e-5f) {
      fprintf(stderr, "out[%d] = %g, expected 1\n", i, (double)out[i]);
      return 1;
    }
  }
  printf("consumer: sparsa %s ran a dense causal attention correctly\n", sparsa_version_string());
  return 0;
}
