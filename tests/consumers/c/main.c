/* A user's program: links libsparsa, checks the loaded library matches the header it was compiled with. */
#include <sparsa/sparsa.h>
#include <stdio.h>

int main(void) {
  if (sparsa_version() != SPARSA_VERSION) {
    fprintf(stderr, "header %u but library %u\n", (unsigned)SPARSA_VERSION, (unsigned)sparsa_version());
    return 1;
  }
  printf("sparsa %s, policy %s, status %s\n", sparsa_version_string(), sparsa_policy_kind_name(SPARSA_POLICY_DENSE),
         sparsa_status_string(SPARSA_STATUS_SUCCESS));
  return 0;
}
