// sparsa_topk_from_scores on device tensors: not written yet (UNSUPPORTED).
#include "../../src/error.h"
#include "gpu_policies.h"

SPARSA_GPU_NAMESPACE_BEGIN

void topk_from_scores_run(const GpuDevice&, const TensorArg&, int32_t, int32_t, const TensorArg&, ScratchCarver&) {
  fail(SPARSA_STATUS_UNSUPPORTED, backend_name(), " backend: topk_from_scores is not implemented yet");
}

SPARSA_GPU_NAMESPACE_END
