// sparsa_kv_prefetch on a GPU context: not written yet (UNSUPPORTED).
#include "../../src/error.h"
#include "gpu_policies.h"

SPARSA_GPU_NAMESPACE_BEGIN

void kv_prefetch_run(const GpuDevice&, const PrefetchProblem&, ScratchCarver&) {
  fail(SPARSA_STATUS_UNSUPPORTED, backend_name(), " backend: kv_prefetch is not implemented yet");
}

SPARSA_GPU_NAMESPACE_END
