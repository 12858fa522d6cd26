/* The public header compiles alone as strict C99 (built with -std=c99 -pedantic -Wall -Wextra -Werror) and the
   library it declares links and answers from plain C. */
#include <sparsa/sparsa.h>
#include <stdio.h>
#include <string.h>

int main(void) {
  sparsa_tensor tensor;
  sparsa_policy policy;
  int64_t shape[2] = {2, 3};
  float data[6] = {0};

  if (sparsa_version() != SPARSA_VERSION) {
    fprintf(stderr, "sparsa_version() = %u but the header says %d\n", (unsigned)sparsa_version(), SPARSA_VERSION);
    return 1;
  }
  if (SPARSA_TENSOR_INIT(&tensor, data, SPARSA_DTYPE_F32, 2, shape) != SPARSA_STATUS_SUCCESS ||
      tensor.struct_size != sizeof(sparsa_tensor) || tensor.strides[0] != 3 || tensor.strides[1] != 1) {
    fprintf(stderr, "sparsa_tensor_init did not fill a contiguous [2, 3] descriptor\n");
    return 1;
  }
  if (SPARSA_POLICY_INIT(&policy, SPARSA_POLICY_SPARGE) != SPARSA_STATUS_SUCCESS ||
      strcmp(sparsa_policy_kind_name(policy.kind), "SPARGE") != 0) {
    fprintf(stderr, "sparsa_policy_init(SPARGE) failed: %s\n", sparsa_last_error_message());
    return 1;
  }
  printf("sparsa %s from C99\n", sparsa_version_string());
  return 0;
}
