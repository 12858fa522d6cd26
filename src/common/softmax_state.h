// The CPU backend's online-softmax state: running maximum m, denominator l = Σ exp(s - m) and the unnormalised
// output o = Σ exp(s - m) · v of one query row, in natural log:
//   * rescale_to()       — the factor o and l take when a key tile raises the maximum (the tile loop,
//                          attention_loop.cpp, and the decode loop, cpu_decode.cpp);
//   * lse()/finalize()   — the normalised row and its natural-log LSE (the same two loops);
//   * merge()/from_lse() — two states over disjoint key sets combined (sparsa_merge_states on host memory,
//                          cpu_merge.cpp).
// A state that saw no key (l == 0) finalises to an exact zero row and LSE −inf, never NaN.
// No GPU code includes this header. The GPU kernels keep m in base 2 (scale·log2(e) folded into the scores) and l per
// row as scalars in registers or shared memory, with the same rules in backends/gpu/engine/online_softmax.cuh (the
// update of a tile, the §0 merge of sparsa_merge_states, the epilogue); forward_decode.cu's warp merge and split-KV
// combine still write them out themselves. SPARSA_HOST_DEVICE marks the functions for a device compiler only so that
// a kernel could include the header (no CUDA include); none does.
#pragma once

#include <cmath>

#include "host_device.h"

namespace sparsa {

// Scalar part of one row's state; the D-float vector `o` lives with the caller (registers, a tile, a staging row)
// so that the same type serves every tile shape.
struct SoftmaxState {
  float m = -INFINITY;  // running maximum of the scores seen
  float l = 0.f;                                      // Σ exp(s − m) over the scores seen

  SPARSA_HOST_DEVICE bool empty() const { return !(l > 0.f); }

  // Natural-log LSE of the scores seen; −inf when none was.
  SPARSA_HOST_DEVICE float lse() const { return empty() ? -INFINITY : m + logf(l); }

  // Factor by which o and l must be multiplied when the running maximum moves from m to new_max (>= m).
  // exp(−inf − x) is 0, and a state that has seen nothing keeps factor 0 instead of exp(NaN).
  SPARSA_HOST_DEVICE float rescale_to(float new_max) const {
    if (m == -INFINITY) return 0.f;
    return expf(m - new_max);
  }

  // Merges `other` (with vector o_other) into this state (with vector o), both over d floats; disjoint key sets.
  SPARSA_HOST_DEVICE void merge(float* o, const SoftmaxState& other, const float* o_other, int d) {
    if (other.empty()) return;
    if (empty()) {
      m = other.m;
      l = other.l;
      for (int c = 0; c < d; ++c) o[c] = o_other[c];
      return;
    }
    const float new_max = m > other.m ? m : other.m;
    const float self_weight = expf(m - new_max);
    const float other_weight = expf(other.m - new_max);
    for (int c = 0; c < d; ++c) o[c] = o[c] * self_weight + o_other[c] * other_weight;
    l = l * self_weight + other.l * other_weight;
    m = new_max;
  }

  // Normalises o in place (an exact zero row when nothing was seen) and returns the LSE.
  SPARSA_HOST_DEVICE float finalize(float* o, int d) const {
    if (empty()) {
      for (int c = 0; c < d; ++c) o[c] = 0.f;
      return -INFINITY;
    }
    const float inv_l = 1.f / l;
    for (int c = 0; c < d; ++c) o[c] *= inv_l;
    return lse();
  }

  // A normalised row with its LSE seen as a state: m = lse, l = 1, o = the row (so merge() applies unchanged).
  SPARSA_HOST_DEVICE static SoftmaxState from_lse(float lse_value) {
    SoftmaxState s;
    if (lse_value == -INFINITY || lse_value != lse_value) return s;
    s.m = lse_value;
    s.l = 1.f;
    return s;
  }
};

}  // namespace sparsa
