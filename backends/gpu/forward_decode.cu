// Decode forward (few query rows per kv head): memory-bound, so plain fp32 arithmetic on CUDA cores and as many
// thread blocks in flight as the GPU holds (split-KV). One thread block = one (sequence, kv head, key split); its
// rows are the R = Sq·g (query row, query head of the group) pairs that share the kv head, so K/V are read once per
// group. Each warp walks its own chunks of kWarpLanes keys:
//
//   scores:  lane j owns key (chunk + j): s[r] = q_r·k_j for every row r            (K rows read once)
//   softmax: per row, chunk max and sum across lanes; running (m, l) rescaled        (base 2)
//   P·V:     lane owns D/kWarpLanes dims; O[r][dims] += Σ_j p[r][j] · v_j[dims]      (P through shared memory)
//
// then the warps' states are merged in shared memory and either written out (one split) or stored as a normalised
// fp32 partial state that combine_decode_splits_kernel merges (§0). Only kWarpLanes-generic warp operations are
// used, so the kernel is the same on 32-lane warps and 64-lane wavefronts.
#include "forward_decode.h"

#include "forward_common.cuh"

#include <cmath>

SPARSA_GPU_NAMESPACE_BEGIN
namespace {

constexpr int kThreads = 128;

__device__ __forceinline__ float warp_max(float value) {
  for (int offset = kWarpLanes / 2; offset > 0; offset /= 2) value = fmaxf(value, warp_shfl_xor(value, offset));
  return value;
}
__device__ __forceinline__ float warp_sum(float value) {
  for (int offset = kWarpLanes / 2; offset > 0; offset /= 2) value += warp_shfl_xor(value, offset);
  return value;
}

__global__ void __launch_bounds__(kThreads) forward_decode_kernel(const ForwardParams p, int32_t rows_per_block) {
  constexpr int kWarps = kThreads / kWarpLanes;
  constexpr int kDimsPerLane = kDecodeMaxHeadDim / kWarpLanes;
  const int32_t dim = p.head_dim;
  const int32_t dims_per_lane = dim / kWarpLanes;
  const int32_t rows = rows_per_block;  // R = query rows × group size, <= kDecodeMaxRows
  const int32_t split = blockIdx.x;
  const int32_t kv_head = blockIdx.y;
  const int32_t b = blockIdx.z;
  const int warp = threadIdx.x / kWarpLanes;
  const int lane = threadIdx.x % kWarpLanes;

  __shared__ float q_rows[kDecodeMaxRows * kDecodeMaxHeadDim];             // scaled by scale·log2(e)
  __shared__ float probabilities[kWarps][kDecodeMaxRows][kWarpLanes];     // P of the warp's current chunk
  __shared__ float warp_max_state[kWarps][kDecodeMaxRows];
  __shared__ float warp_sum_state[kWarps][kDecodeMaxRows];
  __shared__ float warp_out[kWarps][kDecodeMaxRows * kDecodeMaxHeadDim / 2];  // merged in two halves of rows

  // Row r of this block is query row i = r / g of query head kv_head·g + r % g.
  const SequenceView seq0 = make_sequence_view(p, b, kv_head * p.group_size);
  auto row_query = [&](int32_t r) { return r / p.group_size; };
  auto row_head = [&](int32_t r) { return kv_head * p.group_size + r % p.group_size; };
  auto row_view = [&](int32_t r) {
    SequenceView s = seq0;
    s.h = row_head(r);
    return s;
  };

  for (int index = threadIdx.x; index < rows * dim; index += kThreads) {
    const int32_t r = index / dim, d = index % dim;
    const int32_t i = row_query(r);
    q_rows[r * kDecodeMaxHeadDim + d] =
        i < seq0.seq_q ? load_value(p.q, query_row_offset(p.q_strides, row_view(r), i) + d, p.element_type) *
                             p.scale_log2
                       : 0.f;
  }
  __syncthreads();

  // This split's keys, clipped to what the last row may see.
  const int32_t last_row = min(seq0.seq_q, (rows + p.group_size - 1) / p.group_size);
  const int32_t key_end = last_row > 0 ? key_end_for_rows(p, seq0, last_row) : 0;
  const int32_t keys_per_split = (key_end + p.num_splits - 1) / p.num_splits;
  const int32_t split_begin = min(key_end, split * keys_per_split);
  const int32_t split_end = min(key_end, split_begin + keys_per_split);

  // 2-byte K rows on 16-byte boundaries are read 16 bytes at a time (head_dim is a multiple of 64).
  constexpr int kElemsPer16B = 8;
  constexpr int kLoadsInFlight = 4;
  const bool bf16 = p.element_type == ElementType::kBF16;
  const bool vector_loads = p.kv_rows_aligned16 && p.element_type != ElementType::kF32;

  float row_max[kDecodeMaxRows], row_sum[kDecodeMaxRows], out[kDecodeMaxRows][kDimsPerLane];
#pragma unroll
  for (int r = 0; r < kDecodeMaxRows; ++r) {
    row_max[r] = -INFINITY;
    row_sum[r] = 0.f;
#pragma unroll
    for (int j = 0; j < kDimsPerLane; ++j) out[r][j] = 0.f;
  }

  for (int32_t chunk = split_begin + warp * kWarpLanes; chunk < split_end; chunk += kWarps * kWarpLanes) {
    const int32_t key = chunk + lane;
    const bool key_inside = key < split_end;
    const int64_t k_offset = key_inside ? key_row_offset(p, p.k_strides, seq0, key) : 0;
    float score[kDecodeMaxRows];
#pragma unroll
    for (int r = 0; r < kDecodeMaxRows; ++r) score[r] = 0.f;
    if (key_inside && vector_loads) {
      // 16-byte loads, kLoadsInFlight at a time, so each lane's K row streams instead of one element per trip.
      const uint4* k_row = reinterpret_cast<const uint4*>(static_cast<const uint16_t*>(p.k) + k_offset);
      for (int32_t chunk16 = 0; chunk16 < dim / kElemsPer16B; chunk16 += kLoadsInFlight) {
        uint4 loaded[kLoadsInFlight];
#pragma unroll
        for (int u = 0; u < kLoadsInFlight; ++u) loaded[u] = k_row[chunk16 + u];
#pragma unroll
        for (int u = 0; u < kLoadsInFlight; ++u) {
          const uint32_t words[4] = {loaded[u].x, loaded[u].y, loaded[u].z, loaded[u].w};
#pragma unroll
          for (int e = 0; e < kElemsPer16B; ++e) {
            const uint16_t bits = static_cast<uint16_t>(e % 2 == 0 ? words[e / 2] & 0xffffu : words[e / 2] >> 16);
            const float k_value = bf16 ? bf16_bits_to_float(bits) : f16_bits_to_float(bits);
            const int32_t d = (chunk16 + u) * kElemsPer16B + e;
#pragma unroll
            for (int r = 0; r < kDecodeMaxRows; ++r) {
              if (r < rows) score[r] = fmaf(q_rows[r * kDecodeMaxHeadDim + d], k_value, score[r]);
            }
          }
        }
      }
    } else if (key_inside) {
      for (int32_t d = 0; d < dim; ++d) {
        const float k_value = load_value(p.k, k_offset + d, p.element_type);
#pragma unroll
        for (int r = 0; r < kDecodeMaxRows; ++r) {
          if (r < rows) score[r] = fmaf(q_rows[r * kDecodeMaxHeadDim + d], k_value, score[r]);
        }
      }
    }
#pragma unroll
    for (int r = 0; r < kDecodeMaxRows; ++r) {
      if (r >= rows) continue;  // (continue, not break: the loop must unroll so score/out stay in registers)
      const int32_t i = row_query(r);
      const bool visible = key_inside && i < seq0.seq_q && key_visible(p, row_view(r), i, key);
      const float s = visible ? score[r] : -INFINITY;
      const float new_max = fmaxf(row_max[r], warp_max(s));
      const float reference = new_max == -INFINITY ? 0.f : new_max;
      const float rescale = exp2f(row_max[r] - reference);
      const float probability = exp2f(s - reference);
      row_max[r] = new_max;
      row_sum[r] = row_sum[r] * rescale + warp_sum(probability);
      probabilities[warp][r][lane] = probability;
#pragma unroll
      for (int j = 0; j < kDimsPerLane; ++j) out[r][j] *= rescale;
    }
    warp_sync();
    const int32_t chunk_keys = min(kWarpLanes, split_end - chunk);
    // P·V: lane owns dims [lane·dims_per_lane, +dims_per_lane); 2-byte V in aligned rows comes two dims per 4-byte
    // load (pairs stay aligned only for an even share). Batching several keys' loads raised registers past what
    // keeps 4 blocks per SM and measured slower (0.40 vs 0.22 ms at N=32K), so keys go one at a time.
    const bool value_pairs = vector_loads && dims_per_lane % 2 == 0;
    for (int32_t c = 0; c < chunk_keys; ++c) {
      const int64_t v_offset = key_row_offset(p, p.v_strides, seq0, chunk + c) + lane * dims_per_lane;
      const uint32_t* v_pairs = reinterpret_cast<const uint32_t*>(static_cast<const uint16_t*>(p.v) + v_offset);
#pragma unroll
      for (int j = 0; j < kDimsPerLane; ++j) {
        if (j >= dims_per_lane) continue;
        float v_value;
        if (value_pairs) {
          const uint32_t pair = v_pairs[j / 2];
          const uint16_t bits = static_cast<uint16_t>(j % 2 == 0 ? pair & 0xffffu : pair >> 16);
          v_value = bf16 ? bf16_bits_to_float(bits) : f16_bits_to_float(bits);
        } else {
          v_value = load_value(p.v, v_offset + j, p.element_type);
        }
#pragma unroll
        for (int r = 0; r < kDecodeMaxRows; ++r) {
          if (r < rows) out[r][j] = fmaf(probabilities[warp][r][c], v_value, out[r][j]);
        }
      }
    }
    warp_sync();  // the next chunk overwrites this warp's probabilities
  }

  // Merge the warps' states: m = max_w m_w, O = Σ_w 2^(m_w - m) O_w / Σ_w 2^(m_w - m) l_w.
  if (lane == 0) {
#pragma unroll
    for (int r = 0; r < kDecodeMaxRows; ++r) {
      warp_max_state[warp][r] = row_max[r];
      warp_sum_state[warp][r] = row_sum[r];
    }
  }
  constexpr int kRowsPerHalf = kDecodeMaxRows / 2;
  for (int half = 0; half < 2; ++half) {
    __syncthreads();  // states visible; the previous half's outputs consumed
#pragma unroll
    for (int rr = 0; rr < kRowsPerHalf; ++rr) {
      const int r = half * kRowsPerHalf + rr;
      if (r >= rows) continue;
#pragma unroll
      for (int j = 0; j < kDimsPerLane; ++j) {
        if (j < dims_per_lane) warp_out[warp][rr * kDecodeMaxHeadDim + lane * dims_per_lane + j] = out[r][j];
      }
    }
    __syncthreads();
    for (int index = threadIdx.x; index < kRowsPerHalf * dim; index += kThreads) {
      const int rr = index / dim, d = index % dim;
      const int r = half * kRowsPerHalf + rr;
      if (r >= rows) break;
      const int32_t i = row_query(r);
      if (i >= seq0.seq_q) continue;
      float m = -INFINITY;
      for (int w = 0; w < kWarps; ++w) m = fmaxf(m, warp_max_state[w][r]);
      const float reference = m == -INFINITY ? 0.f : m;
      float total = 0.f, acc = 0.f;
      for (int w = 0; w < kWarps; ++w) {
        const float weight = exp2f(warp_max_state[w][r] - reference);
        total += weight * warp_sum_state[w][r];
        acc += weight * warp_out[w][rr * kDecodeMaxHeadDim + d];
      }
      const float value = total > 0.f ? acc / total : 0.f;
      const float lse = total > 0.f ? (m + log2f(total)) * kLn2 : -INFINITY;
      const SequenceView s = row_view(r);
      if (p.num_splits > 1) {
        const int64_t state = (int64_t(split) * p.flat_rows + flat_query_row(p, s, i)) * p.num_q_heads + s.h;
        p.partial_out[state * dim + d] = value;
        if (d == 0) p.partial_lse[state] = lse;
      } else {
        store_value(p.out, query_row_offset(p.out_strides, s, i) + d, p.element_type, value);
        if (d == 0 && p.lse != nullptr) {
          p.lse[s.b * p.lse_strides.b + int64_t(s.h) * p.lse_strides.h + (s.q_row_base + i) * p.lse_strides.s] = lse;
        }
      }
    }
  }
}

// §0 merge of the split partial states: one block per (flat row, query head), threads over dims.
__global__ void __launch_bounds__(kThreads) combine_decode_splits_kernel(const ForwardParams p) {
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
  float max_lse = -INFINITY;
  for (int32_t s = 0; s < p.num_splits; ++s) max_lse = fmaxf(max_lse, p.partial_lse[state0 + s * split_stride]);
  const bool empty = max_lse == -INFINITY;
  float weight_sum = 0.f;
  for (int32_t s = 0; s < p.num_splits; ++s) {
    weight_sum += empty ? 0.f : expf(p.partial_lse[state0 + s * split_stride] - max_lse);
  }
  for (int32_t d = threadIdx.x; d < p.head_dim; d += blockDim.x) {
    float acc = 0.f;
    for (int32_t s = 0; s < p.num_splits; ++s) {
      const float lse = p.partial_lse[state0 + s * split_stride];
      if (lse != -INFINITY) acc += expf(lse - max_lse) * p.partial_out[(state0 + s * split_stride) * p.head_dim + d];
    }
    store_value(p.out, query_row_offset(p.out_strides, seq, i) + d, p.element_type, empty ? 0.f : acc / weight_sum);
  }
  if (p.lse != nullptr && threadIdx.x == 0) {
    p.lse[seq.b * p.lse_strides.b + int64_t(h) * p.lse_strides.h + (seq.q_row_base + i) * p.lse_strides.s] =
        empty ? -INFINITY : max_lse + logf(weight_sum);
  }
}

}  // namespace

bool forward_decode_supports(const ForwardParams& p, int64_t max_seq_q) {
  return max_seq_q * p.group_size <= kDecodeMaxRows && p.head_dim % kDecodeDimMultiple == 0 &&
         p.head_dim <= kDecodeMaxHeadDim;
}

cudaError_t forward_decode_launch(const ForwardParams& p, int32_t max_seq_q, cudaStream_t stream) {
  const dim3 grid(p.num_splits, p.num_q_heads / p.group_size, p.batch);
  forward_decode_kernel<<<grid, kThreads, 0, stream>>>(p, max_seq_q * p.group_size);
  cudaError_t status = cudaGetLastError();
  if (status != cudaSuccess || p.num_splits == 1) return status;
  return combine_splits_launch(p, stream);
}

cudaError_t combine_splits_launch(const ForwardParams& p, cudaStream_t stream) {
  combine_decode_splits_kernel<<<dim3(p.flat_rows, p.num_q_heads), kThreads, 0, stream>>>(p);
  return cudaGetLastError();
}

SPARSA_GPU_NAMESPACE_END
