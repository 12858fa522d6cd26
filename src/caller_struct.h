// The extensible-struct rules of include/sparsa/sparsa.h ("Caller-filled structs"), the Linux kernel's
// copy_struct_from_user applied to every struct a caller fills. The one place that
//   - reads a caller struct: only its first struct_size bytes, defaults for what an older caller lacks, and a newer
//     caller's bytes past our sizeof accepted only when all zero (read_caller_struct);
//   - writes one for an init function: exactly the caller's size, defaults then zero (write_caller_struct).
// Both take the caller's memory as bytes: a struct from an older or newer caller is not a full `Struct` here.
#pragma once

#include <sparsa/sparsa.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstring>

#include "error.h"

namespace sparsa {

// Each caller-filled struct's name in messages and its smallest accepted size (its layout in sparsa 0.1).
template <typename Struct>
struct CallerStructTraits;
template <>
struct CallerStructTraits<sparsa_tensor> {
  static constexpr const char* type_name = "sparsa_tensor";
  static constexpr uint32_t first_size = SPARSA_TENSOR_SIZE_V0_1;
};
template <>
struct CallerStructTraits<sparsa_context_options> {
  static constexpr const char* type_name = "sparsa_context_options";
  static constexpr uint32_t first_size = SPARSA_CONTEXT_OPTIONS_SIZE_V0_1;
};
template <>
struct CallerStructTraits<sparsa_policy> {
  static constexpr const char* type_name = "sparsa_policy";
  static constexpr uint32_t first_size = SPARSA_POLICY_SIZE_V0_1;
};
template <>
struct CallerStructTraits<sparsa_attention_args> {
  static constexpr const char* type_name = "sparsa_attention_args";
  static constexpr uint32_t first_size = SPARSA_ATTENTION_ARGS_SIZE_V0_1;
};
template <>
struct CallerStructTraits<sparsa_sparge_tune_options> {
  static constexpr const char* type_name = "sparsa_sparge_tune_options";
  static constexpr uint32_t first_size = SPARSA_SPARGE_TUNE_OPTIONS_SIZE_V0_1;
};

// Every struct_size the library accepts: [first release's size, SPARSA_STRUCT_SIZE_MAX]. `name` is the argument
// ("policy", "q", "options", ...).
template <typename Struct>
void check_struct_size(uint64_t size, const char* name) {
  using Traits = CallerStructTraits<Struct>;
  if (size < Traits::first_size) {
    fail(SPARSA_STATUS_STRUCT_SIZE, name, ".struct_size: ", size, " is below the smallest ", Traits::type_name,
         " (", Traits::first_size, " bytes, sparsa 0.1; this sparsa's is ", sizeof(Struct),
         "): fill it with the matching sparsa_*_init and sizeof");
  }
  if (size > SPARSA_STRUCT_SIZE_MAX) {
    fail(SPARSA_STATUS_STRUCT_SIZE, name, ".struct_size: ", size, " is above SPARSA_STRUCT_SIZE_MAX (",
         SPARSA_STRUCT_SIZE_MAX, ") for ", Traits::type_name, " (this sparsa's is ", sizeof(Struct), " bytes)");
  }
}

// Reads the caller's struct at `caller` through its struct_size: the result holds `defaults` overwritten by the
// first min(struct_size, sizeof) bytes of the caller's, a complete struct of this version (struct_size = sizeof, so
// it may be passed on inside the library and read again). A newer caller's struct (struct_size > sizeof) is accepted
// only when every byte this sparsa does not know is zero.
template <typename Struct>
Struct read_caller_struct(const Struct& caller, const char* name, const Struct& defaults) {
  using Traits = CallerStructTraits<Struct>;
  const auto* bytes = reinterpret_cast<const unsigned char*>(&caller);
  uint32_t size = 0;
  std::memcpy(&size, bytes, sizeof size);  // struct_size is the first field of every caller struct
  check_struct_size<Struct>(size, name);
  for (uint32_t i = sizeof(Struct); i < size; ++i) {
    if (bytes[i] != 0) {
      fail(SPARSA_STATUS_STRUCT_SIZE, name, ".struct_size: ", size, " is larger than this sparsa's ", Traits::type_name,
           " (", sizeof(Struct), " bytes) and byte ", i,
           " past it is not zero: the caller was built against a newer sparsa and set a field the loaded ",
           SPARSA_VERSION_MAJOR, ".", SPARSA_VERSION_MINOR, ".", SPARSA_VERSION_PATCH, " does not know");
    }
  }
  Struct result = defaults;
  std::memcpy(static_cast<void*>(&result), bytes, std::min<size_t>(size, sizeof(Struct)));
  result.struct_size = sizeof(Struct);
  return result;
}

// An init function's write: exactly `size` bytes at `destination` (the caller's sizeof): struct_size = size, the
// first min(size, sizeof) bytes of `defaults`, zero beyond. Nothing is written when the size is refused.
template <typename Struct>
void write_caller_struct(void* destination, size_t size, const char* name, Struct defaults) {
  check_struct_size<Struct>(size, name);
  defaults.struct_size = static_cast<uint32_t>(size);
  auto* bytes = static_cast<unsigned char*>(destination);
  const size_t known = std::min(size, sizeof(Struct));
  std::memcpy(bytes, &defaults, known);
  if (size > known) std::memset(bytes + known, 0, size - known);
}

}  // namespace sparsa
