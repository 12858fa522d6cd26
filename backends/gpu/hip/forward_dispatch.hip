// HIP build of forward_dispatch.cu: the same source, compiled by hipcc (cmake/sparsa_gpu.cmake). Do not add code here.
#include "../forward_dispatch.cu"
