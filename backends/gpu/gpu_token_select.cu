// §TOKEN_SELECT on the device: not written yet (UNSUPPORTED with a reason).
#include "../../src/error.h"
#include "gpu_policies.h"

SPARSA_GPU_NAMESPACE_BEGIN

bool token_select_supports(const GpuDevice&, const AttentionProblem&, const PolicyParams&, std::string* reason) {
  if (reason != nullptr) *reason = std::string(backend_name()) + " backend: policy TOKEN_SELECT is not implemented yet";
  return false;
}

void token_select_run(const GpuDevice&, const AttentionProblem&, const PolicyParams&, ScratchCarver&) {
  fail(SPARSA_STATUS_UNSUPPORTED, backend_name(), " backend: policy TOKEN_SELECT is not implemented yet");
}

std::unique_ptr<SelectionCacheState> create_device_selection_cache(const GpuDevice&, const SelectionCacheDims&) {
  fail(SPARSA_STATUS_UNSUPPORTED, backend_name(),
       " backend: selection caches are not implemented yet (TOKEN_SELECT is unsupported here)");
}

SPARSA_GPU_NAMESPACE_END
