// sparsa_topk_from_scores on device tensors (§7): draft attention scores → the k best token or block ids per (b, h),
// ascending, exactly as the CPU backend (cpu_topk.cpp) ranks them: block scores are float64 sums over the block's
// real tokens in token order, ties go to the smaller id, NaN ranks last.
//
// Token ids of rows laid out at a uniform stride go straight to device_topk on the float32 scores (the float64
// ranking of a float32 value is the same); anything else (block sums, other strides) first writes float64 id
// scores to scratch. device_topk writes [B, H, k] with the output's own strides.
#include "../../../src/error.h"
#include "../runtime/gpu_policies.h"
#include "device_topk.h"

#include <algorithm>

SPARSA_GPU_NAMESPACE_BEGIN
namespace {

constexpr int kSumThreads = 256;
constexpr int64_t kMaxSumBlocks = 65535;

// id_scores[s * n_ids + id] = Σ over the block's real tokens of scores[b, h, t], in token order (float64).
__global__ void __launch_bounds__(kSumThreads) block_sums_kernel(const float* scores, int64_t stride_b,
                                                                 int64_t stride_h, int64_t stride_t, int32_t heads,
                                                                 int64_t n_tokens, int64_t block_size, int64_t n_ids,
                                                                 int64_t total, double* id_scores) {
  for (int64_t e = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; e < total; e += int64_t(gridDim.x) * blockDim.x) {
    const int64_t s = e / n_ids, id = e % n_ids;
    const float* row = scores + (s / heads) * stride_b + (s % heads) * stride_h;
    const int64_t first = id * block_size;
    const int64_t last = first + block_size < n_tokens ? first + block_size : n_tokens;
    double sum = 0.0;
    for (int64_t t = first; t < last; ++t) sum += double(row[t * stride_t]);
    id_scores[e] = sum;
  }
}

}  // namespace

void topk_from_scores_run(const GpuDevice& device, const TensorArg& scores, int32_t k, int32_t block_size,
                          const TensorArg& out_indices, ScratchCarver& carver) {
  const int64_t batch = scores.extent(0), heads = scores.extent(1), n_tokens = scores.extent(2);
  const int64_t n_ids = (n_tokens + block_size - 1) / block_size;
  const int64_t segments = batch * heads;
  if (segments > 0x7fffffff || n_ids > 0x7fffffff) {
    fail(SPARSA_STATUS_UNSUPPORTED, backend_name(), " backend: topk_from_scores needs B*H and N below 2^31");
  }
  // Rows at one stride (s * stride(1)) with unit token stride can be ranked in place.
  const bool direct = block_size == 1 && scores.stride(2) == 1 && (batch <= 1 || scores.stride(0) == heads * scores.stride(1));
  double* id_scores = direct ? nullptr : carver.take<double>(uint64_t(segments) * n_ids);
  void* topk_scratch = carver.take<char>(device_topk_scratch_bytes(int32_t(segments), n_ids));
  if (carver.sizing() || segments == 0) return;

  TopkArgs a;
  if (direct) {
    a.values = scores.ptr<const float>();
    a.value_type = TopkValueType::kF32;
    a.row_stride = scores.stride(1);
  } else {
    const int64_t blocks = std::min<int64_t>((segments * n_ids + kSumThreads - 1) / kSumThreads, kMaxSumBlocks);
    block_sums_kernel<<<unsigned(blocks), kSumThreads, 0, device.stream>>>(
        scores.ptr<const float>(), scores.stride(0), scores.stride(1), scores.stride(2), int32_t(heads), n_tokens,
        block_size, n_ids, segments * n_ids, id_scores);
    check(cudaGetLastError(), "block_sums_kernel launch");
    a.values = id_scores;
    a.value_type = TopkValueType::kF64;
    a.row_stride = n_ids;
  }
  a.segments = int32_t(segments);
  a.max_length = n_ids;
  a.k = k;
  a.out = out_indices.ptr<int32_t>();
  a.out_capacity = k;
  a.out_segments_per_group = int32_t(heads);
  a.out_group_stride = out_indices.stride(0);
  a.out_stride = out_indices.stride(1);
  a.out_element_stride = out_indices.stride(2);
  check(device_topk(a, topk_scratch, device.multiprocessors, device.stream), "device_topk");
}

SPARSA_GPU_NAMESPACE_END
