// Sizes that a policy's formula fixes and that validation, the CPU backend and the GPU kernels all need, written
// once (host and device; no CUDA include).
#pragma once

#include "host_device.h"

namespace sparsa {

// §8 Δ: of a sequence's Sq query rows, the first Sq − (Sq mod γ + max(tail_min, γ)) are the sparse prefix the base
// policy serves; the rest are the dense tail. A result <= 0 means every row is dense.
template <typename Int>
SPARSA_HOST_DEVICE constexpr Int delta_sparse_prefix(Int seq_q, Int gamma, Int tail_min) {
  return seq_q - (seq_q % gamma + (tail_min > gamma ? tail_min : gamma));
}

// §6 TOKEN_SELECT: the size of a selected set, n_init + top_k + n_local (the dense fallback applies when it reaches
// the key count N).
template <typename Int>
SPARSA_HOST_DEVICE constexpr Int token_select_set_size(Int n_init, Int top_k, Int n_local) {
  return n_init + top_k + n_local;
}

}  // namespace sparsa
