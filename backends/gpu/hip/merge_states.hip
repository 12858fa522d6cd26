// HIP build of merge_states.cu: the same source, compiled by hipcc (cmake/sparsa_gpu.cmake). Do not add code here.
#include "../merge_states.cu"
