// The one place the core asks for a backend. src/registry.cpp is the only core file that knows which backends
// were compiled in; each backend exposes one factory declared here.
#pragma once

#include <sparsa/sparsa.h>

#include <memory>

#include "backend.h"

namespace sparsa {

// Creates the backend `options` names. Throws sparsa::Error(SPARSA_STATUS_BACKEND_UNAVAILABLE, ...) when it was not
// compiled in or no device/driver is present.
std::unique_ptr<Backend> create_backend(const sparsa_context_options& options);

// Factories of the individual backends (defined in backends/<name>/).
std::unique_ptr<Backend> create_cpu_backend(const sparsa_context_options& options);
#if defined(SPARSA_WITH_CUDA)
std::unique_ptr<Backend> create_cuda_backend(const sparsa_context_options& options);
#endif
#if defined(SPARSA_WITH_HIP)
std::unique_ptr<Backend> create_hip_backend(const sparsa_context_options& options);
#endif

}  // namespace sparsa
