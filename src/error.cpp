// Thread-local error message storage and the static status names.
//
// The slot is a fixed-size char array so that recording an error can never fail (no allocation while we are
// already handling a failure, possibly std::bad_alloc itself).
#include <cstring>

#include "error_state.h"

namespace sparsa {
namespace {

// Longest message kept; longer ones are truncated (messages are one line naming an argument).
constexpr size_t kMessageCapacity = 1024;

thread_local char t_last_message[kMessageCapacity] = {0};

}  // namespace

void clear_last_error() noexcept { t_last_message[0] = '\0'; }

sparsa_status record_last_error(sparsa_status status, const char* message) noexcept {
  if (message == nullptr) message = "";
  std::strncpy(t_last_message, message, kMessageCapacity - 1);
  t_last_message[kMessageCapacity - 1] = '\0';
  return status;
}

const char* last_error_message() noexcept { return t_last_message; }

const char* status_name(sparsa_status status) noexcept {
  switch (status) {
    case SPARSA_STATUS_SUCCESS:
      return "SPARSA_STATUS_SUCCESS";
    case SPARSA_STATUS_INVALID_ARGUMENT:
      return "SPARSA_STATUS_INVALID_ARGUMENT";
    case SPARSA_STATUS_NULL_POINTER:
      return "SPARSA_STATUS_NULL_POINTER";
    case SPARSA_STATUS_DTYPE_MISMATCH:
      return "SPARSA_STATUS_DTYPE_MISMATCH";
    case SPARSA_STATUS_SHAPE_MISMATCH:
      return "SPARSA_STATUS_SHAPE_MISMATCH";
    case SPARSA_STATUS_INDEX_OUT_OF_RANGE:
      return "SPARSA_STATUS_INDEX_OUT_OF_RANGE";
    case SPARSA_STATUS_DEVICE_MISMATCH:
      return "SPARSA_STATUS_DEVICE_MISMATCH";
    case SPARSA_STATUS_STRUCT_SIZE:
      return "SPARSA_STATUS_STRUCT_SIZE";
    case SPARSA_STATUS_UNSUPPORTED:
      return "SPARSA_STATUS_UNSUPPORTED";
    case SPARSA_STATUS_BACKEND_UNAVAILABLE:
      return "SPARSA_STATUS_BACKEND_UNAVAILABLE";
    case SPARSA_STATUS_OUT_OF_MEMORY:
      return "SPARSA_STATUS_OUT_OF_MEMORY";
    case SPARSA_STATUS_DEVICE_ERROR:
      return "SPARSA_STATUS_DEVICE_ERROR";
    case SPARSA_STATUS_INTERNAL:
      return "SPARSA_STATUS_INTERNAL";
  }
  return "unknown status";
}

}  // namespace sparsa
