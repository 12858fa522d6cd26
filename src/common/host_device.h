// SPARSA_HOST_DEVICE: __host__ __device__ when compiled by nvcc or hipcc, empty otherwise, for the small functions
// that the CPU backend and the GPU kernels share (src/common/). No CUDA include.
#pragma once

#ifndef SPARSA_HOST_DEVICE
#if defined(__CUDACC__) || defined(__HIPCC__)
#define SPARSA_HOST_DEVICE __host__ __device__
#else
#define SPARSA_HOST_DEVICE
#endif
#endif
