// HIP build of forward_sage.cu: the same source, compiled by hipcc (cmake/sparsa_gpu.cmake). Do not add code here.
#include "../forward_sage.cu"
