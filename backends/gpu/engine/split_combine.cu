// The split-KV combine kernel (split_combine.h).
#include "split_combine.h"

#include "forward_common.cuh"

#include <cmath>

SPARSA_GPU_NAMESPACE_BEGIN
namespace {

constexpr int kCombineThreads = 256;
constexpr int kCombineVector = 4;            // dims per fp32 vector load
constexpr int kCombineSplitsInFlight = 16;   // splits a thread loads before it uses any: one round trip serves up
                                             // to 16 x (threads / dim vectors) splits (128 at head_dim 128)

// One block per (flat row, query head); the threads are (split slice, dim vector) pairs. Slice j merges splits
// j, j + slices, ... of its dims: each round issues the lse and output loads of up to kCombineSplitsInFlight of
// them before using any, then folds them into a running (max, sum, output) state (§0, natural log); the slices'
// states are merged through shared memory. The whole merge is one round of loads for up to 128 splits at head_dim
// 128. (The previous form reduced the max and the weights over the block before it loaded any output, three round
// trips and four barriers: 5.7 µs for a 66-split decode on an H100; this one takes 4.7 µs.)
__global__ void __launch_bounds__(kCombineThreads) combine_splits_kernel(const ForwardParams p) {
  __shared__ float slice_max[kCombineThreads], slice_sum[kCombineThreads];
  __shared__ float slice_out[kCombineThreads * kCombineVector];
  // Before anything, in every block (also those that leave at once): the split kernel's partial states are read
  // below, and a block that left without waiting could let the grid end before the split kernel does.
  wait_for_previous_kernel();
  const int64_t flat_row = blockIdx.x;
  const int32_t h = blockIdx.y;
  int32_t b = 0;
  int64_t i = flat_row;
  if (p.cu_seqlens_q != nullptr) {
    while (b + 1 < p.batch && p.cu_seqlens_q[(b + 1) * p.cu_seqlens_q_stride] <= flat_row) ++b;
    i = flat_row - p.cu_seqlens_q[b * p.cu_seqlens_q_stride];
    if (i >= p.cu_seqlens_q[(b + 1) * p.cu_seqlens_q_stride] - p.cu_seqlens_q[b * p.cu_seqlens_q_stride]) return;
  } else {
    b = int32_t(flat_row / p.padded_seq_q);
    i = flat_row % p.padded_seq_q;
  }
  const SequenceView seq = make_sequence_view(p, b, h);
  const int64_t split_stride = int64_t(p.flat_rows) * p.num_q_heads;
  const int64_t state0 = flat_row * p.num_q_heads + h;

  const int vector = p.head_dim % kCombineVector == 0 ? kCombineVector : 1;
  const int dim_threads = p.head_dim / vector;  // <= kCombineThreads (head_dim <= 256)
  const int slices = int(blockDim.x) / dim_threads;
  const int slice = int(threadIdx.x) / dim_threads;
  const int d0 = (int(threadIdx.x) % dim_threads) * vector;
  float run_max = -INFINITY, run_sum = 0.f;
  float acc[kCombineVector] = {0.f, 0.f, 0.f, 0.f};
  if (slice < slices) {
    for (int32_t s0 = slice; s0 < p.num_splits; s0 += slices * kCombineSplitsInFlight) {
      float lse[kCombineSplitsInFlight];
      float x[kCombineSplitsInFlight][kCombineVector];
#pragma unroll
      for (int u = 0; u < kCombineSplitsInFlight; ++u) {
        const int32_t s = s0 + u * slices;
        const bool present = s < p.num_splits;
        lse[u] = present ? p.partial_lse[state0 + s * split_stride] : -INFINITY;
        const float* src = p.partial_out + (state0 + (present ? s : 0) * split_stride) * p.head_dim + d0;
        if (vector == kCombineVector) {
          const float4 v = present ? *reinterpret_cast<const float4*>(src) : make_float4(0.f, 0.f, 0.f, 0.f);
          x[u][0] = v.x;
          x[u][1] = v.y;
          x[u][2] = v.z;
          x[u][3] = v.w;
        } else {
          x[u][0] = present ? src[0] : 0.f;
          x[u][1] = x[u][2] = x[u][3] = 0.f;
        }
      }
      float round_max = -INFINITY;
#pragma unroll
      for (int u = 0; u < kCombineSplitsInFlight; ++u) round_max = fmaxf(round_max, lse[u]);
      const float new_max = fmaxf(run_max, round_max);
      const float reference = new_max == -INFINITY ? 0.f : new_max;  // nothing seen yet: every weight is 0
      const float rescale = expf(run_max - reference);
      run_sum *= rescale;
#pragma unroll
      for (int e = 0; e < kCombineVector; ++e) acc[e] *= rescale;
      const int32_t present = (p.num_splits - s0 + slices - 1) / slices;  // splits of this round (more: all)
#pragma unroll
      for (int u = 0; u < kCombineSplitsInFlight; ++u) {
        if (u >= present) break;  // absent splits weigh 0: no exponentials for them
        const float weight = expf(lse[u] - reference);  // 0 for an empty split, whose output is not read
        run_sum += weight;
#pragma unroll
        for (int e = 0; e < kCombineVector; ++e) acc[e] = weight > 0.f ? fmaf(weight, x[u][e], acc[e]) : acc[e];
      }
      run_max = new_max;
    }
    if (threadIdx.x % dim_threads == 0) {
      slice_max[slice] = run_max;
      slice_sum[slice] = run_sum;
    }
#pragma unroll
    for (int e = 0; e < kCombineVector; ++e) {
      if (e < vector) slice_out[slice * p.head_dim + d0 + e] = acc[e];
    }
  }
  __syncthreads();
  // One warp turns the slices' (max, sum) pairs into each slice's weight in the result, 1 / total folded in, and
  // the LSE, so that the output loop below does no exponential and no division.
  __shared__ float slice_weight[kCombineThreads];
  if (int(threadIdx.x) < kWarpLanes) {
    float max_lse = -INFINITY;
    for (int j = threadIdx.x; j < slices; j += kWarpLanes) max_lse = fmaxf(max_lse, slice_max[j]);
    max_lse = warp_max(max_lse);
    const bool empty = max_lse == -INFINITY;
    float total = 0.f;
    for (int j = threadIdx.x; j < slices; j += kWarpLanes) {
      slice_weight[j] = empty ? 0.f : expf(slice_max[j] - max_lse);  // 0 for a slice that saw nothing
      total += slice_weight[j] * slice_sum[j];
    }
    total = warp_sum(total);
    for (int j = threadIdx.x; j < slices; j += kWarpLanes) slice_weight[j] = empty ? 0.f : slice_weight[j] / total;
    if (p.lse != nullptr && threadIdx.x == 0) {
      p.lse[seq.b * p.lse_strides.b + int64_t(h) * p.lse_strides.h + (seq.q_row_base + i) * p.lse_strides.s] =
          empty ? -INFINITY : max_lse + logf(total);
    }
  }
  __syncthreads();
  for (int32_t d = threadIdx.x; d < p.head_dim; d += blockDim.x) {
    float value = 0.f;
    for (int j = 0; j < slices; ++j) {
      const float weight = slice_weight[j];
      value = weight > 0.f ? fmaf(weight, slice_out[j * p.head_dim + d], value) : value;
    }
    store_value(p.out, query_row_offset(p.out_strides, seq, i) + d, p.element_type, value);
  }
}

}  // namespace

cudaError_t combine_splits_launch(const ForwardParams& p, cudaStream_t stream) {
  return launch_overlapping(p.overlap_launches, combine_splits_kernel, dim3(p.flat_rows, p.num_q_heads),
                            dim3(kCombineThreads), stream, p);
}

SPARSA_GPU_NAMESPACE_END
