// HIP build of kv_prefetch.cu: the same source, compiled by hipcc (cmake/sparsa_gpu.cmake). Do not add code here.
#include "../kv_prefetch.cu"
