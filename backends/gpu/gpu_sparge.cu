// §SPARGE on the device: not written yet (UNSUPPORTED with a reason).
#include "../../src/error.h"
#include "gpu_policies.h"

SPARSA_GPU_NAMESPACE_BEGIN

bool sparge_supports(const GpuDevice&, const AttentionProblem&, const PolicyParams&, std::string* reason) {
  if (reason != nullptr) *reason = std::string(backend_name()) + " backend: policy SPARGE is not implemented yet";
  return false;
}

void sparge_run(const GpuDevice&, const AttentionProblem&, const PolicyParams&, ScratchCarver&) {
  fail(SPARSA_STATUS_UNSUPPORTED, backend_name(), " backend: policy SPARGE is not implemented yet");
}

SPARSA_GPU_NAMESPACE_END
