// HIP build of gpu_delta.cu: the same source, compiled by hipcc (cmake/sparsa_gpu.cmake). Do not add code here.
#include "../gpu_delta.cu"
