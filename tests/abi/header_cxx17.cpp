// The public header compiles alone as C++17 (built with -Wall -Wextra -Werror -pedantic), and the layout rules of
// docs/abi.md hold: every caller-filled struct starts with its struct_size, and enum values never move.
#include <sparsa/sparsa.h>

#include <cstddef>
#include <cstdio>
#include <type_traits>

static_assert(std::is_standard_layout_v<sparsa_tensor> && std::is_trivially_copyable_v<sparsa_tensor>);
static_assert(offsetof(sparsa_tensor, struct_size) == 0);
static_assert(offsetof(sparsa_context_options, struct_size) == 0);
static_assert(offsetof(sparsa_policy, struct_size) == 0);
static_assert(offsetof(sparsa_attention_args, struct_size) == 0);
static_assert(offsetof(sparsa_sparge_tune_options, struct_size) == 0);

// Released values: an ABI break if any of these moves.
static_assert(SPARSA_STATUS_SUCCESS == 0 && SPARSA_STATUS_INTERNAL == 12);
static_assert(SPARSA_DTYPE_F32 == 1 && SPARSA_DTYPE_BF16 == 3 && SPARSA_DTYPE_I8 == 8);
static_assert(SPARSA_DEVICE_CPU == 1 && SPARSA_DEVICE_CUDA == 2 && SPARSA_DEVICE_ROCM == 10);  // DLPack codes
static_assert(SPARSA_POLICY_DENSE == 0 && SPARSA_POLICY_TOKEN_INDICES == 6);
static_assert(SPARSA_POLICY_FLAG_DELTA == 1);
static_assert(SPARSA_STAT_PAIRS_COMPUTED == 0 && SPARSA_STAT_COUNT == 7);
static_assert(std::is_same_v<sparsa_status, int32_t>);

int main() {
  sparsa_attention_args args{};
  if (sparsa_attention_args_init(&args, sizeof args) != SPARSA_STATUS_SUCCESS || args.struct_size != sizeof(args) ||
      args.q != nullptr || args.causal != 0) {
    std::fprintf(stderr, "sparsa_attention_args_init did not fill the defaults\n");
    return 1;
  }
  std::printf("sparsa %s from C++17\n", sparsa_version_string());
  return 0;
}
