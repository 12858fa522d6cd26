// HIP build of attention_stats.cu: the same source, compiled by hipcc (cmake/sparsa_gpu.cmake). Do not add code here.
#include "../attention_stats.cu"
