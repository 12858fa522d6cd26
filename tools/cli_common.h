// Shared pieces of the sparsa command-line tool: its two error kinds, a CPU context, host tensors that own their
// bytes, and the conversions the tool needs to compare outputs of any dtype (src/common/half_bits.h, header-only).
#pragma once

#include <sparsa/sparsa.h>

#include <cctype>
#include <cstdint>
#include <cstring>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

#include "../src/common/half_bits.h"

namespace sparsa_cli {

// A bad command line or a bad input file: printed as one line, exit status 2.
struct UsageError : std::runtime_error {
  using std::runtime_error::runtime_error;
};
// A failure while running (library error, I/O): printed as one line, exit status 1.
struct RuntimeError : std::runtime_error {
  using std::runtime_error::runtime_error;
};

inline constexpr int kExitRuntimeError = 1;
inline constexpr int kExitUsage = 2;

// Throws RuntimeError("<what>: <status name>: <library message>") unless status is success.
inline void check(sparsa_status status, const std::string& what) {
  if (status != SPARSA_STATUS_SUCCESS) {
    throw RuntimeError(what + ": " + sparsa_status_string(status) + ": " + sparsa_last_error_message());
  }
}

// A policy name as the library spells it: upper case, '-' as '_' ("sink-window" -> "SINK_WINDOW").
inline std::string canonical_policy_name(std::string name) {
  for (char& c : name) c = c == '-' ? '_' : char(std::toupper(static_cast<unsigned char>(c)));
  return name;
}

// The kind `name` names (any case, '-' or '_'), among every kind the library knows (sparsa_policy_kind_name answers
// "unknown" past the last one); otherwise UsageError("<option>: unknown policy ...") listing the known names.
inline int32_t policy_kind_from_name(const std::string& option, const std::string& name) {
  const std::string wanted = canonical_policy_name(name);
  std::string known;
  for (int32_t kind = 0; std::string(sparsa_policy_kind_name(kind)) != "unknown"; ++kind) {
    if (wanted == sparsa_policy_kind_name(kind)) return kind;
    known += std::string(kind ? ", " : "") + sparsa_policy_kind_name(kind);
  }
  throw UsageError(option + ": unknown policy '" + name + "' (expected one of " + known + ", any case)");
}

// A CPU context with `threads` worker threads (0 = one per core), destroyed with the pointer.
using ContextPtr = std::unique_ptr<sparsa_context, void (*)(sparsa_context*)>;
inline ContextPtr make_context(int32_t threads) {
  sparsa_context_options options;
  check(sparsa_context_options_init(&options, sizeof options), "sparsa_context_options_init");
  options.num_threads = threads;
  sparsa_context* raw_ctx = nullptr;
  check(sparsa_context_create(&options, &raw_ctx), "sparsa_context_create");
  return ContextPtr(raw_ctx, sparsa_context_destroy);
}

// A contiguous host tensor that owns its bytes; `view()` describes it to the library.
struct HostTensor {
  int32_t dtype = SPARSA_DTYPE_INVALID;
  std::vector<int64_t> shape;
  std::vector<uint8_t> bytes;

  HostTensor() = default;
  HostTensor(int32_t dtype_, std::vector<int64_t> shape_) : dtype(dtype_), shape(std::move(shape_)) {
    bytes.assign(static_cast<size_t>(element_count()) * sparsa_dtype_size(dtype), 0);
  }
  int64_t element_count() const {
    int64_t n = 1;
    for (int64_t extent : shape) n *= extent;
    return n;
  }
  template <typename T>
  T* data() {
    return reinterpret_cast<T*>(bytes.data());
  }
  template <typename T>
  const T* data() const {
    return reinterpret_cast<const T*>(bytes.data());
  }

  sparsa_tensor view() const {
    sparsa_tensor t;
    check(sparsa_tensor_init(&t, sizeof t, const_cast<uint8_t*>(bytes.data()), dtype,
                             static_cast<int32_t>(shape.size()), shape.data()),
          "sparsa_tensor_init");
    return t;
  }
};

// The library's exact f16/bf16 widening (header-only: the tool still links only the public API).
using ::sparsa::bf16_to_float;
using ::sparsa::half_to_float;

// The elements of a F32/F16/BF16 tensor as floats.
inline std::vector<float> to_floats(const HostTensor& t) {
  const size_t n = static_cast<size_t>(t.element_count());
  std::vector<float> out(n);
  switch (t.dtype) {
    case SPARSA_DTYPE_F32:
      std::memcpy(out.data(), t.bytes.data(), n * sizeof(float));
      break;
    case SPARSA_DTYPE_F16:
      for (size_t i = 0; i < n; ++i) out[i] = half_to_float(t.data<uint16_t>()[i]);
      break;
    case SPARSA_DTYPE_BF16:
      for (size_t i = 0; i < n; ++i) out[i] = bf16_to_float(t.data<uint16_t>()[i]);
      break;
    default:
      throw RuntimeError("to_floats: dtype " + std::to_string(t.dtype) + " is not a floating-point attention dtype");
  }
  return out;
}

}  // namespace sparsa_cli
