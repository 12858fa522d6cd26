// Hopper wgmma forward: not written yet; forward_wgmma_supports says so and the dispatcher moves on to mma.sync.
#include "forward_wgmma.h"

SPARSA_GPU_NAMESPACE_BEGIN

bool forward_wgmma_supports(const ForwardParams& p, int32_t compute_major, const char** reason) {
  (void)p;
  (void)compute_major;
  *reason = "wgmma path not implemented";
  return false;
}

cudaError_t forward_wgmma_prepare() { return cudaSuccess; }

cudaError_t forward_wgmma_launch(const ForwardParams& p, int32_t max_seq_q, cudaStream_t stream) {
  (void)p;
  (void)max_seq_q;
  (void)stream;
  return cudaErrorInvalidValue;
}

SPARSA_GPU_NAMESPACE_END
