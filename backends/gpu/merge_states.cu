// §0 merge: with m = max(lse_a, lse_b), w_x = exp(lse_x - m): out = (w_a o_a + w_b o_b) / (w_a + w_b),
// out_lse = m + log(w_a + w_b); both -inf gives a zero row and -inf.
#include "merge_states.h"

#include "forward_common.cuh"

#include <cmath>

SPARSA_GPU_NAMESPACE_BEGIN
namespace {

constexpr int kThreads = 128;

__device__ __forceinline__ int64_t o_offset(const TensorStrides& st, int64_t b, int64_t s, int64_t h) {
  return b * st.b + s * st.s + h * st.h;
}

__global__ void __launch_bounds__(kThreads) merge_states_kernel(const MergeParams p) {
  const int64_t row = int64_t(blockIdx.x) * kThreads + threadIdx.x;
  const int64_t rows = int64_t(p.batch) * p.seq * p.heads;
  if (row >= rows) return;
  const int64_t h = row % p.heads;
  const int64_t s = (row / p.heads) % p.seq;
  const int64_t b = row / (int64_t(p.heads) * p.seq);
  const float lse_a = p.lse_a[o_offset(p.lse_a_strides, b, s, h)];
  const float lse_b = p.lse_b[o_offset(p.lse_b_strides, b, s, h)];
  const float m = fmaxf(lse_a, lse_b);
  const bool empty = m == -INFINITY;
  const float w_a = empty ? 0.f : expf(lse_a - m);
  const float w_b = empty ? 0.f : expf(lse_b - m);
  const float inverse = empty ? 0.f : 1.f / (w_a + w_b);
  for (int32_t d = 0; d < p.head_dim; ++d) {
    const float a = w_a > 0.f ? load_value(p.o_a, o_offset(p.o_a_strides, b, s, h) + d, p.element_type) : 0.f;
    const float c = w_b > 0.f ? load_value(p.o_b, o_offset(p.o_b_strides, b, s, h) + d, p.element_type) : 0.f;
    store_value(p.out, o_offset(p.out_strides, b, s, h) + d, p.element_type, (w_a * a + w_b * c) * inverse);
  }
  if (p.out_lse != nullptr) p.out_lse[o_offset(p.out_lse_strides, b, s, h)] = empty ? -INFINITY : m + logf(w_a + w_b);
}

}  // namespace

cudaError_t merge_states_launch(const MergeParams& p, cudaStream_t stream) {
  const int64_t rows = int64_t(p.batch) * p.seq * p.heads;
  if (rows == 0) return cudaSuccess;
  merge_states_kernel<<<unsigned((rows + kThreads - 1) / kThreads), kThreads, 0, stream>>>(p);
  return cudaGetLastError();
}

SPARSA_GPU_NAMESPACE_END
