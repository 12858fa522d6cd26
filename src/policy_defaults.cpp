// The documented defaults of every caller-filled struct (include/sparsa/sparsa.h): a policy's from the policy table
// (policy_table.h), the others here.
#include "policy_table.h"
#include "validate.h"

namespace sparsa {

bool is_known_policy_kind(int32_t kind) { return policy_kind_info(kind) != nullptr; }

namespace {

// The defaults of the field groups `row` reads, from its row of the policy table.
void apply_row_defaults(const PolicyKindInfo& row, sparsa_policy* p) {
  const PolicyDefaults& d = row.defaults;
  if (row.fields & kFieldsSinkWindow) {
    p->sink_tokens = d.sink_tokens;
    p->sink_window = d.sink_window;
  }
  if (row.fields & (kFieldsBlockMask | kFieldsSparge)) {
    p->block_q = d.block_q;
    p->block_k = d.block_k;
  }
  if (row.fields & kFieldsSparge) {
    p->sparge_theta = d.sparge_theta;
    p->sparge_tau = d.sparge_tau;
    p->sparge_topk_fraction = d.sparge_topk_fraction;
    p->sparge_lambda = d.sparge_lambda;
    p->sparge_attention_sink = d.sparge_attention_sink;
    p->sparge_quantized = d.sparge_quantized;
  }
  if (row.fields & kFieldsTokenSparse) {
    p->token_sparse_window = d.token_sparse_window;
    p->token_sparse_pool_kernel = d.token_sparse_pool_kernel;
    p->token_sparse_coverage = d.token_sparse_coverage;
    p->token_sparse_min_tokens = d.token_sparse_min_tokens;
  }
  if (row.fields & kFieldsTokenSelect) {
    p->select_n_init = d.select_n_init;
    p->select_n_local = d.select_n_local;
    p->select_top_k = d.select_top_k;
    p->select_scale_scores = d.select_scale_scores;
    p->select_cache_theta = d.select_cache_theta;
    p->select_per_kv_head = d.select_per_kv_head;
  }
  if (row.fields & kFieldsTokenIndices) {
    p->index_block_size = d.index_block_size;
    p->index_n_init = d.index_n_init;
    p->index_n_local = d.index_n_local;
  }
}

}  // namespace

// Every field of every group gets its documented default, whatever the kind (a caller may switch kinds after init):
// each group from the row of the table that reads it; pointers NULL, flags 0.
sparsa_policy default_policy(int32_t kind) {
  sparsa_policy p{};
  p.struct_size = sizeof(sparsa_policy);
  p.kind = kind;
  p.flags = 0;
  for (const PolicyKindInfo& row : kPolicyKinds) apply_row_defaults(row, &p);
  p.delta_gamma = kDeltaDefaults.gamma;
  p.delta_tail_min = kDeltaDefaults.tail_min;
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
