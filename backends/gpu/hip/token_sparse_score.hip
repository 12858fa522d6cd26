// HIP build of token_sparse_score.cu: the same source, compiled by hipcc (cmake/sparsa_gpu.cmake). Do not add code here.
#include "../token_sparse_score.cu"
