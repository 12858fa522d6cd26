// HIP build of gpu_token_select.cu: the same source, compiled by hipcc (cmake/sparsa_gpu.cmake). Do not add code here.
#include "../gpu_token_select.cu"
