// HIP build of sparge_predict.cu: the same source, compiled by hipcc (cmake/sparsa_gpu.cmake). Do not add code here.
#include "../sparge_predict.cu"
