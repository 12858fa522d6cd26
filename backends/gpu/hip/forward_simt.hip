// HIP build of forward_simt.cu: the same source, compiled by hipcc (cmake/sparsa_gpu.cmake). Do not add code here.
#include "../forward_simt.cu"
