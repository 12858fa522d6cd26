// Portable forward attention: one thread block = a 16-row query tile of one (sequence, query head); it walks the
// visible 32-key tiles in ascending order with the same online softmax as the tensor-core kernel, in plain fp32.
// Only __syncthreads is used between stages, so the wavefront width never matters.
//
// Per key tile:  K -> shared (fp32)  |  S = mask(Q·Kᵀ)·scale·log2(e)  |  per-row max, rescale, P = exp2(S - m)
//                V -> shared (same buffer)  |  O = O·rescale + P·V   (each thread owns fixed (row, dim) outputs)
#include "forward_simt.h"

#include "forward_common.cuh"

#include <cmath>

SPARSA_GPU_NAMESPACE_BEGIN
namespace {

constexpr int kRows = 16;     // query rows per block
constexpr int kKeys = 32;     // keys per tile
constexpr int kThreads = 128;
constexpr int kMaxOutputsPerThread = kRows * kSimtMaxHeadDim / kThreads;

__global__ void __launch_bounds__(kThreads) forward_simt_kernel(const ForwardParams p) {
  const int32_t dim = p.head_dim;
  const int32_t pitch = dim + 1;  // padded row: consecutive rows fall in different banks
  extern __shared__ float shared_floats[];
  float* q_tile = shared_floats;             // [kRows][pitch]
  float* kv_tile = q_tile + kRows * pitch;   // [kKeys][pitch], K then V
  float* scores = kv_tile + kKeys * pitch;   // [kRows][kKeys]
  float* row_max = scores + kRows * kKeys;   // [kRows], base-2 domain
  float* row_sum = row_max + kRows;          // [kRows]
  float* row_rescale = row_sum + kRows;      // [kRows]

  const SequenceView seq = make_sequence_view(p, blockIdx.z, blockIdx.y);
  const int32_t row_begin = blockIdx.x * kRows;
  if (row_begin >= seq.seq_q) return;
  const int32_t row_end = min(row_begin + kRows, seq.seq_q);
  const int32_t key_end = key_end_for_rows(p, seq, row_end);

  for (int index = threadIdx.x; index < kRows * dim; index += kThreads) {
    const int r = index / dim, d = index % dim;
    const bool inside = row_begin + r < row_end;
    q_tile[r * pitch + d] =
        inside ? load_value(p.q, query_row_offset(p.q_strides, seq, row_begin + r) + d, p.element_type) : 0.f;
  }
  if (threadIdx.x < kRows) {
    row_max[threadIdx.x] = -INFINITY;
    row_sum[threadIdx.x] = 0.f;
  }
  float o_acc[kMaxOutputsPerThread];
#pragma unroll
  for (int t = 0; t < kMaxOutputsPerThread; ++t) o_acc[t] = 0.f;

  for (int32_t key_begin = 0; key_begin < key_end; key_begin += kKeys) {
    const int32_t tile_key_end = min(key_begin + kKeys, key_end);
    if (!tile_has_visible_key(p, seq, row_begin, row_end, key_begin, tile_key_end)) continue;  // block-uniform
    __syncthreads();  // the previous tile's V is consumed
    for (int index = threadIdx.x; index < kKeys * dim; index += kThreads) {
      const int c = index / dim, d = index % dim;
      const bool inside = key_begin + c < seq.seq_k;
      kv_tile[c * pitch + d] =
          inside ? load_value(p.k, key_row_offset(p, p.k_strides, seq, key_begin + c) + d, p.element_type) : 0.f;
    }
    __syncthreads();
    for (int index = threadIdx.x; index < kRows * kKeys; index += kThreads) {
      const int r = index / kKeys, c = index % kKeys;
      const int32_t key = key_begin + c;
      float score = -INFINITY;
      if (key < tile_key_end && row_begin + r < row_end && key_visible(p, seq, row_begin + r, key)) {
        float dot = 0.f;
        for (int d = 0; d < dim; ++d) dot += q_tile[r * pitch + d] * kv_tile[c * pitch + d];
        score = dot * p.scale_log2;
      }
      scores[r * kKeys + c] = score;
    }
    __syncthreads();
    if (threadIdx.x < kRows) {
      const int r = threadIdx.x;
      float tile_max = -INFINITY;
      for (int c = 0; c < kKeys; ++c) tile_max = fmaxf(tile_max, scores[r * kKeys + c]);
      const float new_max = fmaxf(row_max[r], tile_max);
      const float reference = new_max == -INFINITY ? 0.f : new_max;
      const float rescale = exp2f(row_max[r] - reference);
      float tile_sum = 0.f;
      for (int c = 0; c < kKeys; ++c) {
        const float probability = exp2f(scores[r * kKeys + c] - reference);
        scores[r * kKeys + c] = probability;
        tile_sum += probability;
      }
      row_max[r] = new_max;
      row_sum[r] = row_sum[r] * rescale + tile_sum;
      row_rescale[r] = rescale;
    }
    for (int index = threadIdx.x; index < kKeys * dim; index += kThreads) {  // V over K: S no longer needs K
      const int c = index / dim, d = index % dim;
      const bool inside = key_begin + c < seq.seq_k;
      kv_tile[c * pitch + d] =
          inside ? load_value(p.v, key_row_offset(p, p.v_strides, seq, key_begin + c) + d, p.element_type) : 0.f;
    }
    __syncthreads();
#pragma unroll
    for (int t = 0; t < kMaxOutputsPerThread; ++t) {
      const int index = threadIdx.x + t * kThreads;
      if (index < kRows * dim) {
        const int r = index / dim, d = index % dim;
        float acc = o_acc[t] * row_rescale[r];
        for (int c = 0; c < kKeys; ++c) acc += scores[r * kKeys + c] * kv_tile[c * pitch + d];
        o_acc[t] = acc;
      }
    }
  }
  __syncthreads();

#pragma unroll
  for (int t = 0; t < kMaxOutputsPerThread; ++t) {
    const int index = threadIdx.x + t * kThreads;
    if (index < kRows * dim) {
      const int r = index / dim, d = index % dim;
      if (row_begin + r < row_end) {
        const float total = row_sum[r];
        store_value(p.out, query_row_offset(p.out_strides, seq, row_begin + r) + d, p.element_type,
                      total > 0.f ? o_acc[t] / total : 0.f);
      }
    }
  }
  if (p.lse != nullptr && threadIdx.x < kRows && row_begin + int32_t(threadIdx.x) < row_end) {
    const int r = threadIdx.x;
    const int64_t i = row_begin + r;
    p.lse[seq.b * p.lse_strides.b + int64_t(seq.h) * p.lse_strides.h + (seq.q_row_base + i) * p.lse_strides.s] =
        row_sum[r] > 0.f ? (row_max[r] + log2f(row_sum[r])) * kLn2 : -INFINITY;
  }
}

}  // namespace

bool forward_simt_supports(const ForwardParams& p, const char** reason) {
  if (p.head_dim > kSimtMaxHeadDim) {
    *reason = "head_dim exceeds the largest supported, 256";
    return false;
  }
  if (p.row_map != QueryRowMap::kAll || p.pv_skip_log2 != nullptr) {
    *reason = "portable path has no query-row maps or PV skip yet";
    return false;
  }
  return true;
}

size_t forward_simt_shared_bytes(int32_t head_dim) {
  return sizeof(float) * (size_t(kRows + kKeys) * (head_dim + 1) + kRows * kKeys + 3 * kRows);
}

cudaError_t forward_simt_prepare() {
  return cudaFuncSetAttribute(reinterpret_cast<const void*>(&forward_simt_kernel),
                              cudaFuncAttributeMaxDynamicSharedMemorySize,
                              int(forward_simt_shared_bytes(kSimtMaxHeadDim)));
}

cudaError_t forward_simt_launch(const ForwardParams& p, int32_t max_seq_q, cudaStream_t stream) {
  const size_t shared_bytes = forward_simt_shared_bytes(p.head_dim);
  const dim3 grid((max_seq_q + kRows - 1) / kRows, p.num_q_heads, p.batch);
  forward_simt_kernel<<<grid, kThreads, shared_bytes, stream>>>(p);
  return cudaGetLastError();
}

SPARSA_GPU_NAMESPACE_END
