// HIP build of device_topk.cu: the same source, compiled by hipcc (cmake/sparsa_gpu.cmake). Do not add code here.
#include "../device_topk.cu"
