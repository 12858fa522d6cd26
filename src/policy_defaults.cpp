// The documented defaults of every caller-filled struct (include/sparsa/sparsa.h), in one place.
#include <cmath>
#include <limits>

#include "policy_table.h"
#include "validate.h"

namespace sparsa {

bool is_known_policy_kind(int32_t kind) { return policy_kind_info(kind) != nullptr; }

sparsa_policy default_policy(int32_t kind) {
  sparsa_policy p{};
  p.struct_size = sizeof(sparsa_policy);
  p.kind = kind;
  p.flags = 0;
  // SINK_WINDOW (§2)
  p.sink_tokens = 128;
  p.sink_window = 2048;
  // BLOCK_SPARSE / SPARGE (§3, §4)
  p.block_q = 128;
  p.block_k = 64;
  p.block_mask = nullptr;
  p.sparge_theta = 0.6f;
  p.sparge_tau = 0.98f;
  p.sparge_topk_fraction = 0.f;
  p.sparge_lambda = -std::numeric_limits<float>::infinity();
  p.sparge_attention_sink = 0;
  p.sparge_quantized = 0;
  p.sparge_head_params = nullptr;
  // TOKEN_SPARSE (§5)
  p.token_sparse_window = 128;
  p.token_sparse_pool_kernel = 7;
  p.token_sparse_coverage = 0.005f;
  p.token_sparse_min_tokens = 1024;
  // TOKEN_SELECT (§6)
  p.select_n_init = 128;
  p.select_n_local = 512;
  p.select_top_k = 2048;
  p.select_scale_scores = 0;
  p.select_cache_theta = 0.9f;
  p.select_per_kv_head = 0;
  // TOKEN_INDICES (§7)
  p.indices = nullptr;
  p.head_map = nullptr;
  p.index_block_size = 1;
  p.index_n_init = 0;
  p.index_n_local = 0;
  // DELTA (§8)
  p.delta_gamma = 64;
  p.delta_tail_min = 128;
  return p;
}

sparsa_attention_args default_attention_args() {
  sparsa_attention_args a{};  // every pointer NULL, causal 0, softmax_scale 0
  a.struct_size = sizeof(sparsa_attention_args);
  return a;
}

sparsa_context_options default_context_options() {
  sparsa_context_options o{};
  o.struct_size = sizeof(sparsa_context_options);
  o.device_type = SPARSA_DEVICE_CPU;
  o.device_id = 0;
  o.stream = nullptr;
  o.num_threads = 0;
  return o;
}

sparsa_sparge_tune_options default_sparge_tune_options() {
  sparsa_sparge_tune_options o{};
  o.struct_size = sizeof(sparsa_sparge_tune_options);
  o.l1 = 0.07f;
  o.pv_l1 = 0.08f;
  o.search_steps = 10;
  o.dense_below = 0.1f;
  o.lambda_min = -20.f;
  return o;
}

}  // namespace sparsa
