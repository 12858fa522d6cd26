// Segmented device top-k (device_topk.h): not written yet.
#include "device_topk.h"

SPARSA_GPU_NAMESPACE_BEGIN

size_t device_topk_scratch_bytes(int32_t, int64_t) { return 0; }

cudaError_t device_topk(const TopkArgs&, void*, cudaStream_t) { return cudaErrorNotSupported; }

SPARSA_GPU_NAMESPACE_END
