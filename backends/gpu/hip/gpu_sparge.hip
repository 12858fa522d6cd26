// HIP build of gpu_sparge.cu: the same source, compiled by hipcc (cmake/sparsa_gpu.cmake). Do not add code here.
#include "../gpu_sparge.cu"
