// Compile-time checks of the caller-filled structs' layouts (include/sparsa/sparsa.h, "Caller-filled structs").
//   - No implicit tail padding: sizeof equals the end of the last field, so appending any field changes sizeof and
//     therefore struct_size, which is how the library tells an older or newer caller's struct apart.
//   - The first release's sizes (SPARSA_*_SIZE_V0_1) stay readable: a later layout only ever grows.
// Appending a field means updating the "last field" named here, and nothing else in this file.
#include <sparsa/sparsa.h>

#include <cstddef>

#include "caller_struct.h"

namespace sparsa {
namespace {

#define SPARSA_END_OF(type, field) (offsetof(type, field) + sizeof(static_cast<type*>(nullptr)->field))

static_assert(sizeof(sparsa_tensor) == SPARSA_END_OF(sparsa_tensor, strides), "sparsa_tensor has tail padding");
static_assert(sizeof(sparsa_context_options) == SPARSA_END_OF(sparsa_context_options, reserved0),
              "sparsa_context_options has tail padding");
static_assert(sizeof(sparsa_policy) == SPARSA_END_OF(sparsa_policy, reserved0), "sparsa_policy has tail padding");
static_assert(sizeof(sparsa_attention_args) == SPARSA_END_OF(sparsa_attention_args, query_offsets),
              "sparsa_attention_args has tail padding");
static_assert(sizeof(sparsa_sparge_tune_options) == SPARSA_END_OF(sparsa_sparge_tune_options, lambda_min),
              "sparsa_sparge_tune_options has tail padding");

#undef SPARSA_END_OF

// Every caller struct is a multiple of 8 bytes (explicit reserved fields pad to the boundary), so arrays of them and
// appended 8-byte fields need no hidden padding either.
constexpr size_t kStructAlignment = 8;

template <typename Struct>
constexpr bool layout_ok() {
  return sizeof(Struct) % kStructAlignment == 0 && sizeof(Struct) >= CallerStructTraits<Struct>::first_size &&
         CallerStructTraits<Struct>::first_size <= SPARSA_STRUCT_SIZE_MAX;
}
static_assert(layout_ok<sparsa_tensor>(), "sparsa_tensor: size below 0.1's or not a multiple of 8");
static_assert(layout_ok<sparsa_context_options>(), "sparsa_context_options: size below 0.1's or not a multiple of 8");
static_assert(layout_ok<sparsa_policy>(), "sparsa_policy: size below 0.1's or not a multiple of 8");
static_assert(layout_ok<sparsa_attention_args>(), "sparsa_attention_args: size below 0.1's or not a multiple of 8");
static_assert(layout_ok<sparsa_sparge_tune_options>(),
              "sparsa_sparge_tune_options: size below 0.1's or not a multiple of 8");

}  // namespace
}  // namespace sparsa
