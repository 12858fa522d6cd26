// HIP build of forward_decode.cu: the same source, compiled by hipcc (cmake/sparsa_gpu.cmake). Do not add code here.
#include "../forward_decode.cu"
