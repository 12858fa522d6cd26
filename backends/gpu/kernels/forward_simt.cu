// Portable forward attention: one thread block = a query tile of one (sequence, query head); it walks the visible
// key tiles in ascending order with the same online softmax as the tensor-core kernel, in plain fp32. Only
// __syncthreads is used between stages, so the wavefront width never matters.
//
// Per key tile:  K -> shared (fp32)  |  S = mask(Q·Kᵀ)·scale·log2(e)  |  per-row max, [PV-skip test], rescale,
//                P = exp2(S - m)  |  V -> shared (same buffer)  |  O = O·rescale + P·V  (fixed (row, dim) per thread)
//
// Tiling: 16 rows × 32 keys with 128 threads, except under SpargeAttn's PV skip (§4 step 7), whose decision for a
// (row block, key block) needs the maxima of every row of the mask's block: there a thread block is exactly one
// mask cell row (block_q rows, 128 threads per 16 rows so each thread still owns <= D/8 outputs) walking key tiles
// of exactly block_k keys.
#include "forward_simt.h"

#include "../engine/forward_common.cuh"
#include "../engine/online_softmax.cuh"

#include <cmath>

SPARSA_GPU_NAMESPACE_BEGIN
namespace {

constexpr int kRows = 16;     // query rows per block (plain tiling)
constexpr int kKeys = 32;     // keys per tile (plain tiling)
constexpr int kThreads = 128;  // per kRows rows
constexpr int kMaxOutputsPerThread = kRows * kSimtMaxHeadDim / kThreads;
constexpr int kSkipMaxRows = 128;  // PV skip: block_q up to this (1024 threads, the block limit of every vendor)
constexpr int kSkipMaxThreads = kThreads * kSkipMaxRows / kRows;

struct Tiling {
  int32_t rows = kRows, keys = kKeys, threads = kThreads;
};

Tiling tiling_of(const ForwardParams& p) {
  Tiling t;
  if (p.pv_skip_log2 == nullptr) return t;
  t.rows = p.mask_block_q;
  t.keys = p.mask_block_k;
  t.threads = kThreads * ((p.mask_block_q + kRows - 1) / kRows);
  return t;
}

size_t shared_bytes_of(const Tiling& t, int32_t head_dim) {
  // q tile, K/V tile, scores, per-row max / sum / rescale / tile max, the skip decision.
  return sizeof(float) * (size_t(t.rows + t.keys) * (head_dim + 1) + size_t(t.rows) * t.keys + 4 * size_t(t.rows) + 1);
}

template <int kMaxThreads>
__global__ void __launch_bounds__(kMaxThreads) forward_simt_kernel(const ForwardParams p, const int32_t tile_rows,
                                                                   const int32_t tile_keys) {
  const int32_t dim = p.head_dim;
  const int32_t pitch = dim + 1;  // padded row: consecutive rows fall in different banks
  const int threads = blockDim.x;
  extern __shared__ float shared_floats[];
  float* q_tile = shared_floats;                  // [tile_rows][pitch]
  float* kv_tile = q_tile + tile_rows * pitch;    // [tile_keys][pitch], K then V
  float* scores = kv_tile + tile_keys * pitch;    // [tile_rows][tile_keys]
  float* row_max = scores + tile_rows * tile_keys;  // [tile_rows], base-2 domain
  float* row_sum = row_max + tile_rows;           // [tile_rows]
  float* row_rescale = row_sum + tile_rows;       // [tile_rows]
  float* row_tile_max = row_rescale + tile_rows;  // [tile_rows]
  float* skip_block = row_tile_max + tile_rows;   // [1]: 1 when the λ test drops the current key tile

  const SequenceView seq = make_sequence_view(p, blockIdx.z, blockIdx.y);
  const int32_t row_begin = blockIdx.x * tile_rows;
  if (row_begin >= seq.rows) return;
  const int32_t row_end = min(row_begin + tile_rows, seq.rows);
  const int32_t key_end = key_end_for_rows(p, seq, row_end);
  // §4 step 7: threshold of this head (base 2); the first computed key tile is never tested.
  const float skip_threshold = p.pv_skip_log2 != nullptr ? p.pv_skip_log2[seq.h] : -INFINITY;
  bool skip_test = false;

  for (int index = threadIdx.x; index < tile_rows * dim; index += threads) {
    const int r = index / dim, d = index % dim;
    const bool inside = row_begin + r < row_end;
    q_tile[r * pitch + d] =
        inside ? load_value(p.q, launch_query_offset(p, p.q_strides, seq, row_begin + r) + d, p.element_type) : 0.f;
  }
  if (int32_t(threadIdx.x) < tile_rows) {
    row_max[threadIdx.x] = -INFINITY;
    row_sum[threadIdx.x] = 0.f;
  }
  float o_acc[kMaxOutputsPerThread];
#pragma unroll
  for (int t = 0; t < kMaxOutputsPerThread; ++t) o_acc[t] = 0.f;

  for (int32_t key_begin = 0; key_begin < key_end; key_begin += tile_keys) {
    const int32_t tile_key_end = min(key_begin + tile_keys, key_end);
    if (!tile_has_visible_key(p, seq, row_begin, row_end, key_begin, tile_key_end)) continue;  // block-uniform
    __syncthreads();  // the previous tile's V (and skip flag) is consumed
    for (int index = threadIdx.x; index < tile_keys * dim; index += threads) {
      const int c = index / dim, d = index % dim;
      const bool inside = key_begin + c < seq.seq_k;
      kv_tile[c * pitch + d] =
          inside ? load_value(p.k, launch_key_offset(p, p.k_strides, seq, key_begin + c) + d, p.element_type) : 0.f;
    }
    __syncthreads();
    for (int index = threadIdx.x; index < tile_rows * tile_keys; index += threads) {
      const int r = index / tile_keys, c = index % tile_keys;
      const int32_t key = key_begin + c;
      float score = -INFINITY;
      if (key < tile_key_end && row_begin + r < row_end &&
          key_visible(p, seq, row_position(p, seq, row_begin + r), key)) {
        float dot = 0.f;
        for (int d = 0; d < dim; ++d) dot += q_tile[r * pitch + d] * kv_tile[c * pitch + d];
        score = dot * p.scale_log2;
      }
      scores[r * tile_keys + c] = score;
    }
    __syncthreads();
    if (int32_t(threadIdx.x) < tile_rows) {
      const int r = threadIdx.x;
      float tile_max = -INFINITY;
      for (int c = 0; c < tile_keys; ++c) tile_max = fmaxf(tile_max, scores[r * tile_keys + c]);
      row_tile_max[r] = tile_max;
    }
    if (skip_test) {  // block-uniform: max over the block's rows of (m_local - m_new) < λ drops the whole tile
      __syncthreads();
      if (threadIdx.x == 0) {
        float best_gain = -INFINITY;
        for (int r = 0; r < row_end - row_begin; ++r) {
          const float local = row_tile_max[r];
          if (local != -INFINITY) best_gain = fmaxf(best_gain, local - fmaxf(row_max[r], local));
        }
        const bool skip = best_gain < skip_threshold;
        skip_block[0] = skip ? 1.f : 0.f;
        if (skip && p.pv_skip_count != nullptr) {
          atomicAdd(reinterpret_cast<unsigned long long*>(p.pv_skip_count), 1ull);
        }
      }
      __syncthreads();
      if (skip_block[0] != 0.f) continue;
    }
    skip_test = skip_threshold > -INFINITY;  // every later computed tile is tested
    if (int32_t(threadIdx.x) < tile_rows) {
      const int r = threadIdx.x;
      const softmax::MaxUpdate step = softmax::update_max(row_max[r], row_tile_max[r], softmax::ExactExp2{});
      float tile_sum = 0.f;
      for (int c = 0; c < tile_keys; ++c) {
        const float probability = exp2f(scores[r * tile_keys + c] - step.reference);  // scores already scaled
        scores[r * tile_keys + c] = probability;
        tile_sum += probability;
      }
      row_max[r] = step.max;
      row_sum[r] = softmax::rescaled_sum(row_sum[r], step.rescale, tile_sum);
      row_rescale[r] = step.rescale;
    }
    for (int index = threadIdx.x; index < tile_keys * dim; index += threads) {  // V over K: S no longer needs K
      const int c = index / dim, d = index % dim;
      const bool inside = key_begin + c < seq.seq_k;
      kv_tile[c * pitch + d] =
          inside ? load_value(p.v, launch_key_offset(p, p.v_strides, seq, key_begin + c) + d, p.element_type) : 0.f;
    }
    __syncthreads();
#pragma unroll
    for (int t = 0; t < kMaxOutputsPerThread; ++t) {
      const int index = threadIdx.x + t * threads;
      if (index < tile_rows * dim) {
        const int r = index / dim, d = index % dim;
        float acc = o_acc[t] * row_rescale[r];
        for (int c = 0; c < tile_keys; ++c) acc += scores[r * tile_keys + c] * kv_tile[c * pitch + d];
        o_acc[t] = acc;
      }
    }
  }
  __syncthreads();

#pragma unroll
  for (int t = 0; t < kMaxOutputsPerThread; ++t) {
    const int index = threadIdx.x + t * threads;
    if (index < tile_rows * dim) {
      const int r = index / dim, d = index % dim;
      if (row_begin + r < row_end) {
        // O / l by a division, not softmax::finish_row's reciprocal and a multiply: one rounding per element
        // instead of two (switching would move this kernel's results in the last bit).
        const float total = row_sum[r];
        store_value(p.out, launch_output_offset(p, seq, row_begin + r) + d, p.element_type,
                    total > 0.f ? o_acc[t] / total : 0.f);
      }
    }
  }
  if (p.lse != nullptr && int32_t(threadIdx.x) < tile_rows && row_begin + int32_t(threadIdx.x) < row_end) {
    const int r = threadIdx.x;
    p.lse[launch_lse_offset(p, seq, row_begin + r)] = softmax::finish_row(row_max[r], row_sum[r]).lse;
  }
}

// Opt-in shared memory of the current device (the PV-skip tiling may need more than the plain one).
size_t device_shared_optin() {
  int device = 0, bytes = 0;
  if (cudaGetDevice(&device) != cudaSuccess ||
      cudaDeviceGetAttribute(&bytes, cudaDevAttrMaxSharedMemoryPerBlockOptin, device) != cudaSuccess) {
    (void)cudaGetLastError();
    return 0;
  }
  return size_t(bytes);
}

}  // namespace

bool forward_simt_supports(const ForwardParams& p, const char** reason) {
  if (p.head_dim > kSimtMaxHeadDim) {
    *reason = "head_dim exceeds the largest supported, 256";
    return false;
  }
  if (p.row_map != QueryRowMap::kAll && (p.rule != VisibilityRule::kDense || p.pv_skip_log2 != nullptr)) {
    *reason = "query-row maps run with the dense rule only";
    return false;
  }
  if (p.row_map == QueryRowMap::kDeltaRows && p.delta_gamma <= 0) {
    *reason = "delta rows need gamma > 0";
    return false;
  }
  if (p.pv_skip_log2 != nullptr) {
    if (p.rule != VisibilityRule::kBlockMask) {
      *reason = "PV skip needs the block-mask rule";
      return false;
    }
    if (p.mask_block_q < 1 || p.mask_block_q > kSkipMaxRows || p.mask_block_k < 1) {
      *reason = "portable PV skip needs 1 <= block_q <= 128 (one thread block owns a whole query block)";
      return false;
    }
    const size_t bytes = shared_bytes_of(tiling_of(p), p.head_dim);
    if (bytes > forward_simt_shared_bytes(kSimtMaxHeadDim) && bytes > device_shared_optin()) {
      *reason = "portable PV skip: block_q x block_k x head_dim tiles exceed this device's shared memory";
      return false;
    }
  }
  return true;
}

size_t forward_simt_shared_bytes(int32_t head_dim) { return shared_bytes_of(Tiling{}, head_dim); }

cudaError_t forward_simt_prepare() {
  const cudaError_t status =
      cudaFuncSetAttribute(reinterpret_cast<const void*>(&forward_simt_kernel<kThreads>),
                           cudaFuncAttributeMaxDynamicSharedMemorySize, int(forward_simt_shared_bytes(kSimtMaxHeadDim)));
  if (status != cudaSuccess) return status;
  const size_t optin = device_shared_optin();  // the PV-skip instance may use all of it (checked by supports())
  if (optin == 0) return cudaSuccess;
  return cudaFuncSetAttribute(reinterpret_cast<const void*>(&forward_simt_kernel<kSkipMaxThreads>),
                              cudaFuncAttributeMaxDynamicSharedMemorySize, int(optin));
}

cudaError_t forward_simt_launch(const ForwardParams& p, int32_t max_seq_q, cudaStream_t stream) {
  const Tiling t = tiling_of(p);
  const size_t shared_bytes = shared_bytes_of(t, p.head_dim);
  const dim3 grid((max_seq_q + t.rows - 1) / t.rows, p.num_q_heads, p.batch);
  if (p.pv_skip_log2 == nullptr) {
    forward_simt_kernel<kThreads><<<grid, t.threads, shared_bytes, stream>>>(p, t.rows, t.keys);
  } else {
    forward_simt_kernel<kSkipMaxThreads><<<grid, t.threads, shared_bytes, stream>>>(p, t.rows, t.keys);
  }
  return cudaGetLastError();
}

SPARSA_GPU_NAMESPACE_END
