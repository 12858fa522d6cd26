// Validation of the context-parallel TOKEN_SELECT steps (sparsa_cp_select_*, docs/context_parallel.md): the shard's
// attention arguments as for a run, the shard positions, and each step's combined inputs and outputs.
#include "validate_context_parallel.h"

#include "handles.h"
#include "validate.h"

namespace sparsa {
namespace {

// The run arguments of the shard: what sparsa_attention_run would accept, with out, lse and the introspection
// outputs ignored (out may be NULL: q stands in for its shape, nothing is written to it).
void validate_shard_run(const sparsa_context& ctx, const sparsa_attention_args* args_in,
                        const sparsa_policy* policy, CpSelectCall* call) {
  if (args_in == nullptr) {
    fail(SPARSA_STATUS_NULL_POINTER, "args: NULL (fill a sparsa_attention_args with sparsa_attention_args_init)");
  }
  sparsa_attention_args args = read_caller_struct(*args_in, "args", default_attention_args());
  if (args.selection_cache != nullptr) {
    fail(SPARSA_STATUS_INVALID_ARGUMENT,
         "args.selection_cache: must be NULL for context-parallel selection (each shard would cache a different "
         "part of the selection)");
  }
  if (args.out == nullptr) args.out = args.q;
  args.lse = nullptr;
  args.selected_indices = nullptr;
  args.block_mask_out = nullptr;
  args.stats = nullptr;
  if (policy == nullptr) fail(SPARSA_STATUS_NULL_POINTER, "policy: NULL (expected a TOKEN_SELECT policy)");
  validate_attention(ctx, &args, policy, &call->problem, &call->policy);
  if (call->policy.p.kind != SPARSA_POLICY_TOKEN_SELECT) {
    fail(SPARSA_STATUS_INVALID_ARGUMENT, "policy.kind: context-parallel selection is defined for TOKEN_SELECT (",
         SPARSA_POLICY_TOKEN_SELECT, "), got ", call->policy.p.kind);
  }
}

TensorArg read_batch_positions(const sparsa_tensor* t, const char* name, int32_t batch) {
  TensorArg a = read_tensor(t, name, true);
  expect_dtype(a, name, SPARSA_DTYPE_I32);
  expect_shape(a, name, ShapeSpec({batch}), "[B] (one entry per sequence)");
  expect_host(a, name);
  return a;
}

// 0 <= kv_start[b] and kv_start[b] + L_b <= kv_total[b] for every sequence (when its key counts are host-readable).
void check_shard_positions(const CpSelectCall& call) {
  const AttentionProblem& pr = call.problem;
  if (!pr.contents_validated) return;
  for (int32_t b = 0; b < pr.batch; ++b) {
    const int64_t start = call.kv_start.ptr<const int32_t>()[b * call.kv_start.stride(0)];
    const int64_t total = call.kv_total.ptr<const int32_t>()[b * call.kv_total.stride(0)];
    const int64_t length = pr.seq_len_k(b);
    if (start < 0 || start + length > total) {
      fail(SPARSA_STATUS_INDEX_OUT_OF_RANGE, "kv_start/kv_total: sequence ", b, " has kv_start ", start,
           ", kv_total ", total, " and ", length, " keys on this shard; expected 0 <= kv_start and kv_start + ",
           "keys <= kv_total");
    }
  }
}

TensorArg read_typed(const sparsa_tensor* t, const char* name, int32_t dtype, const ShapeSpec& shape,
                     const char* why, const DeviceRule& rule) {
  TensorArg a = read_tensor(t, name, true);
  expect_dtype(a, name, dtype);
  expect_shape(a, name, shape, why);
  expect_on_device(a, name, rule);
  return a;
}

}  // namespace

CpSelectCall validate_cp_select(const sparsa_context& ctx, CpSelectStep step, const sparsa_attention_args* args,
                                const sparsa_policy* policy, const sparsa_tensor* kv_start,
                                const sparsa_tensor* kv_total, const CpSelectTensors& tensors) {
  CpSelectCall call;
  call.step = step;
  validate_shard_run(ctx, args, policy, &call);
  const AttentionProblem& pr = call.problem;
  call.kv_start = read_batch_positions(kv_start, "kv_start", pr.batch);
  call.kv_total = read_batch_positions(kv_total, "kv_total", pr.batch);
  check_shard_positions(call);

  const DeviceRule rule{ctx.options.device_type, ctx.options.device_id};
  const int64_t batch = pr.batch, heads = pr.num_q_heads;
  const int64_t n_sets = call.policy.p.select_per_kv_head ? pr.num_kv_heads : 1;
  const int64_t top_k = call.policy.p.select_top_k;
  const ShapeSpec stats_shape({batch, heads});
  const ShapeSpec sum_shape({batch, heads, SPARSA_CP_SUM_DIGITS});
  const ShapeSpec topk_shape({batch, n_sets, top_k});
  const char* out_name = "out_indices";  // what this step calls its output
  switch (step) {
    case CpSelectStep::kMax:
      out_name = "out_max";
      call.out = read_typed(tensors.out, out_name, SPARSA_DTYPE_F64, stats_shape, "[B, Hq]", rule);
      break;
    case CpSelectStep::kSum:
      call.global_max = read_typed(tensors.global_max, "global_max", SPARSA_DTYPE_F64, stats_shape, "[B, Hq]", rule);
      out_name = "out_sum";
      call.out = read_typed(tensors.out, out_name, SPARSA_DTYPE_I64, sum_shape, "[B, Hq, SPARSA_CP_SUM_DIGITS]",
                            rule);
      break;
    case CpSelectStep::kTopk:
      call.global_max = read_typed(tensors.global_max, "global_max", SPARSA_DTYPE_F64, stats_shape, "[B, Hq]", rule);
      call.global_sum = read_typed(tensors.global_sum, "global_sum", SPARSA_DTYPE_I64, sum_shape,
                                   "[B, Hq, SPARSA_CP_SUM_DIGITS]", rule);
      out_name = "out_votes";
      call.out = read_typed(tensors.out, out_name, SPARSA_DTYPE_F64, topk_shape, "[B, n_sets, top_k]", rule);
      call.out_positions =
          read_typed(tensors.out_positions, "out_positions", SPARSA_DTYPE_I32, topk_shape, "[B, n_sets, top_k]", rule);
      break;
    case CpSelectStep::kIndices: {
      call.all_votes = read_tensor(tensors.all_votes, "all_votes", true);
      expect_dtype(call.all_votes, "all_votes", SPARSA_DTYPE_F64);
      expect_rank(call.all_votes, "all_votes", 4, "[G, B, n_sets, top_k]");
      const int64_t shards = call.all_votes.extent(0);
      if (shards < 1) fail(SPARSA_STATUS_SHAPE_MISMATCH, "all_votes: expected at least one shard (G >= 1), got 0");
      const ShapeSpec gathered({shards, batch, n_sets, top_k});
      expect_shape(call.all_votes, "all_votes", gathered, "[G, B, n_sets, top_k]");
      expect_on_device(call.all_votes, "all_votes", rule);
      call.all_positions =
          read_typed(tensors.all_positions, "all_positions", SPARSA_DTYPE_I32, gathered, "all_votes' shape", rule);
      call.out = read_tensor(tensors.out, "out_indices", true);
      expect_dtype(call.out, "out_indices", SPARSA_DTYPE_I32);
      expect_rank(call.out, "out_indices", 3, "[B, n_sets, cap]");
      expect_shape(call.out, "out_indices", ShapeSpec({batch, n_sets, call.out.extent(2)}), "[B, n_sets, cap]");
      expect_on_device(call.out, "out_indices", rule);
      break;
    }
  }
  expect_distinct_elements(call.out, out_name);
  if (call.out_positions.present) expect_distinct_elements(call.out_positions, "out_positions");
  return call;
}

}  // namespace sparsa
