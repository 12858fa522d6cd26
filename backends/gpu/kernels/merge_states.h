// §0 merge of two partial attention states over disjoint key sets, on the device (merge_states.cu).
#pragma once

#include "../engine/forward_params.h"
#include "../runtime/gpu_runtime.h"

SPARSA_GPU_NAMESPACE_BEGIN

struct MergeParams {
  const void* o_a = nullptr;
  const void* o_b = nullptr;
  void* out = nullptr;
  const float* lse_a = nullptr;
  const float* lse_b = nullptr;
  float* out_lse = nullptr;  // null: not requested
  ElementType element_type = ElementType::kF32;
  // o tensors as [B, S, H, D] (packed: B = 1, stride_b = 0); lse as [B, H, S] (packed: [H, T]).
  int32_t batch = 0, seq = 0, heads = 0, head_dim = 0;
  TensorStrides o_a_strides, o_b_strides, out_strides;       // b, s, h
  TensorStrides lse_a_strides, lse_b_strides, out_lse_strides;  // b, s, h
};

// 32 threads per (b, s, h) row: they read both rows and both LSEs before writing, so out may alias o_a (in place).
cudaError_t merge_states_launch(const MergeParams& p, cudaStream_t stream);

SPARSA_GPU_NAMESPACE_END
