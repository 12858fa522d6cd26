// Host-only utilities of the C API (hilbert.cpp, drift.cpp, head_mapping.cpp) and the SpargeAttn tuner
// (sparge_tune.cpp). Each validates its own arguments and throws sparsa::Error; api.cpp only wraps them.
#pragma once

#include <sparsa/sparsa.h>

#include <cstdint>

struct sparsa_context;

namespace sparsa {

// §4 Hilbert permutation of a t×h×w grid; perm/inverse may be NULL, each holds `capacity` entries.
void hilbert_permutation(int32_t t, int32_t h, int32_t w, int32_t* perm, int32_t* inverse, int64_t capacity);

// §5 drift-based layer selection.
void drift_select_layers(const sparsa_tensor* h_in, const sparsa_tensor* h_out, float delta,
                         const sparsa_tensor* out_ratio, const sparsa_tensor* out_sparse);

// §7 STS head mapping.
void head_mapping(const sparsa_tensor* draft, const sparsa_tensor* target, int32_t k, const sparsa_tensor* out_map);

// §4 SpargeAttn tuner, running the context's backend.
void sparge_tune(sparsa_context& ctx, const sparsa_attention_args* args, const sparsa_policy* policy,
                 const sparsa_sparge_tune_options* options, const sparsa_tensor* out_params,
                 const sparsa_tensor* out_metrics);

}  // namespace sparsa
