// The only core file that knows which backends exist.
#include "registry.h"

#include "error.h"

namespace sparsa {

std::unique_ptr<Backend> create_backend(const sparsa_context_options& options) {
  switch (options.device_type) {
    case SPARSA_DEVICE_CPU:
      return create_cpu_backend(options);
    case SPARSA_DEVICE_CUDA:
#if defined(SPARSA_WITH_CUDA)
      return create_cuda_backend(options);
#else
      fail(SPARSA_STATUS_BACKEND_UNAVAILABLE,
           "options.device_type: CUDA, but sparsa was built without CUDA (configure with -DSPARSA_CUDA=ON)");
#endif
    case SPARSA_DEVICE_ROCM:
#if defined(SPARSA_WITH_HIP)
      return create_hip_backend(options);
#else
      fail(SPARSA_STATUS_BACKEND_UNAVAILABLE,
           "options.device_type: ROCM, but sparsa was built without HIP (configure with -DSPARSA_HIP=ON)");
#endif
    default:
      fail(SPARSA_STATUS_INVALID_ARGUMENT, "options.device_type: expected SPARSA_DEVICE_CPU (1), ",
           "SPARSA_DEVICE_CUDA (2) or SPARSA_DEVICE_ROCM (10), got ", options.device_type);
  }
}

}  // namespace sparsa
