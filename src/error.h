// Internal error type. Code inside the library reports a failure by throwing sparsa::Error; the API boundary
// (src/api.cpp) is the only place that catches, stores the message in the thread-local slot and returns the status.
// No exception ever crosses the C ABI.
#pragma once

#include <sparsa/sparsa.h>

#include <sstream>
#include <stdexcept>
#include <string>
#include <utility>

namespace sparsa {

class Error : public std::runtime_error {
 public:
  Error(sparsa_status status, std::string message) : std::runtime_error(std::move(message)), status_(status) {}
  sparsa_status status() const { return status_; }

 private:
  sparsa_status status_;
};

// Builds a message from streamable pieces: fail(SPARSA_STATUS_SHAPE_MISMATCH, "k: expected rank 4, got ", n).
template <typename... Parts>
[[noreturn]] inline void fail(sparsa_status status, const Parts&... parts) {
  std::ostringstream message;
  (message << ... << parts);
  throw Error(status, message.str());
}

}  // namespace sparsa
