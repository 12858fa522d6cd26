// §0 merge: with m = max(lse_a, lse_b), w_x = exp(lse_x - m): out = (w_a o_a + w_b o_b) / (w_a + w_b),
// out_lse = m + log(w_a + w_b); both -inf gives a zero row and -inf (softmax::merge_weights,
// engine/online_softmax.cuh).
#include "merge_states.h"

#include "../engine/forward_common.cuh"
#include "../engine/online_softmax.cuh"

#include <cmath>

SPARSA_GPU_NAMESPACE_BEGIN
namespace {

constexpr int kThreads = 128;
constexpr int kThreadsPerRow = 32;  // a fixed group, not the hardware warp: the launch is the same on every vendor
constexpr int kRowsPerBlock = kThreads / kThreadsPerRow;

__device__ __forceinline__ int64_t o_offset(const TensorStrides& st, int64_t b, int64_t s, int64_t h) {
  return b * st.b + s * st.s + h * st.h;
}

// kThreadsPerRow threads per (b, s, h) row, across the head dimension (coalesced; a decode merge has few rows and
// the row's elements are the parallelism). Every thread reads both LSEs before the block barrier and the row's
// first thread writes out_lse after it, so out / out_lse may alias o_a / lse_a (in place): only this group reads
// this row.
__global__ void __launch_bounds__(kThreads) merge_states_kernel(const MergeParams p) {
  const int32_t lane = int32_t(threadIdx.x) % kThreadsPerRow;
  const int64_t row = int64_t(blockIdx.x) * kRowsPerBlock + threadIdx.x / kThreadsPerRow;
  const int64_t rows = int64_t(p.batch) * p.seq * p.heads;
  const bool active = row < rows;
  const int64_t h = active ? row % p.heads : 0;
  const int64_t s = active ? (row / p.heads) % p.seq : 0;
  const int64_t b = active ? row / (int64_t(p.heads) * p.seq) : 0;
  const float lse_a = active ? p.lse_a[o_offset(p.lse_a_strides, b, s, h)] : -INFINITY;
  const float lse_b = active ? p.lse_b[o_offset(p.lse_b_strides, b, s, h)] : -INFINITY;
  const softmax::MergeWeights w = softmax::merge_weights(lse_a, lse_b);
  if (active) {
    const int64_t a_at = o_offset(p.o_a_strides, b, s, h), b_at = o_offset(p.o_b_strides, b, s, h);
    const int64_t out_at = o_offset(p.out_strides, b, s, h);
    for (int32_t d = lane; d < p.head_dim; d += kThreadsPerRow) {
      const float a = w.weight_a > 0.f ? load_value(p.o_a, a_at + d, p.element_type) : 0.f;
      const float c = w.weight_b > 0.f ? load_value(p.o_b, b_at + d, p.element_type) : 0.f;
      store_value(p.out, out_at + d, p.element_type, (w.weight_a * a + w.weight_b * c) * w.inverse);
    }
  }
  __syncthreads();  // every thread of the row has read lse_a / lse_b
  if (active && lane == 0 && p.out_lse != nullptr) {
    p.out_lse[o_offset(p.out_lse_strides, b, s, h)] = w.lse();
  }
}

}  // namespace

cudaError_t merge_states_launch(const MergeParams& p, cudaStream_t stream) {
  const int64_t rows = int64_t(p.batch) * p.seq * p.heads;
  if (rows == 0) return cudaSuccess;
  merge_states_kernel<<<unsigned((rows + kRowsPerBlock - 1) / kRowsPerBlock), kThreads, 0, stream>>>(p);
  return cudaGetLastError();
}

SPARSA_GPU_NAMESPACE_END
