// The thread-local "last error" slot behind sparsa_last_error_message(), and the status names.
// Only src/api.cpp writes the slot (at the C boundary); everything else throws sparsa::Error.
#pragma once

#include <sparsa/sparsa.h>

namespace sparsa {

// Empties this thread's message (every exported function does this on entry).
void clear_last_error() noexcept;

// Stores `message` (truncated to the slot's fixed capacity; never allocates) and returns `status`.
sparsa_status record_last_error(sparsa_status status, const char* message) noexcept;

// This thread's message; "" when the last call succeeded.
const char* last_error_message() noexcept;

// "SPARSA_STATUS_SHAPE_MISMATCH", ...; "unknown status" otherwise.
const char* status_name(sparsa_status status) noexcept;

}  // namespace sparsa
