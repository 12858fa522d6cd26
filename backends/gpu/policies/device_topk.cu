// Segmented device top-k (device_topk.h says what and how): the kernel without a prologue
// (device_topk_kernel.cuh holds the kernel, its phases and the launcher).
#include "device_topk_kernel.cuh"

SPARSA_GPU_NAMESPACE_BEGIN

size_t device_topk_scratch_bytes(int32_t segments, int64_t max_length) {
  return size_t(topk_detail::ScratchParts(segments, max_length).total);
}

cudaError_t device_topk(const TopkArgs& args, void* scratch, int32_t multiprocessors, cudaStream_t stream) {
  return device_topk_with(args, NoTopkPrologue{}, scratch, multiprocessors, stream);
}

SPARSA_GPU_NAMESPACE_END
