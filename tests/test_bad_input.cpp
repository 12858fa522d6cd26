// Every bad-input class the C API must reject: one table, each row mutates a valid baseline and expects the exact
// status, a message naming the argument, and outputs (poisoned with a sentinel byte pattern before the call) left
// byte-for-byte untouched.
#include <gtest/gtest.h>
#include <sparsa/sparsa.h>

#include <cmath>
#include <cstring>
#include <functional>
#include <limits>
#include <string>
#include <vector>

namespace {

constexpr unsigned char kPoison = 0xA5;
// Baseline sizes: small, GQA (Hq = 4, Hkv = 2), two sequences.
constexpr int64_t kB = 2, kS = 16, kHq = 4, kHkv = 2, kD = 8;
constexpr int64_t kPageSize = 8, kPages = 4;  // paged variant: 4 pages of 8 tokens hold both sequences
constexpr int64_t kDraftN = 8;                // top-k scores: [1, 2, kDraftN]

sparsa_tensor make_tensor(void* data, int32_t dtype, std::vector<int64_t> shape) {
  sparsa_tensor t;
  EXPECT_EQ(sparsa_tensor_init(&t, sizeof t, data, dtype, int32_t(shape.size()), shape.data()), SPARSA_STATUS_SUCCESS);
  return t;
}

// A valid DENSE causal run plus every optional tensor a row may switch on; rows mutate a fresh copy.
struct Baseline {
  sparsa_context* ctx = nullptr;
  sparsa_context* other_ctx = nullptr;
  sparsa_selection_cache* foreign_cache = nullptr;  // made with other_ctx

  std::vector<float> q = std::vector<float>(kB * kS * kHq * kD, 0.25f);
  std::vector<float> k = std::vector<float>(2 * kB * kS * kHq * kD, 0.5f);  // room for reshaped variants
  std::vector<float> v = std::vector<float>(2 * kB * kS * kHq * kD, 1.0f);
  std::vector<float> out = std::vector<float>(kB * kS * kHq * kD);
  std::vector<float> lse = std::vector<float>(kB * kHq * kS);
  std::vector<int32_t> cu_q = {0, int32_t(kS), int32_t(2 * kS)};
  std::vector<int32_t> page_table = {0, 1, 2, 3};
  std::vector<int32_t> seq_lens = {int32_t(kS), int32_t(kS)};
  std::vector<int32_t> query_offsets = {0, 0};
  std::vector<int32_t> indices = std::vector<int32_t>(kB * kHkv * 4, 1);
  std::vector<int32_t> head_map = {0, 0, 1, 1};
  std::vector<uint8_t> mask = std::vector<uint8_t>(kB * kHq * 1 * 1, 1);
  std::vector<uint8_t> mask_out = std::vector<uint8_t>(kB * kHq);
  std::vector<int64_t> stats = std::vector<int64_t>(4);
  std::vector<float> scores = std::vector<float>(2 * kDraftN, 1.f);
  std::vector<int32_t> topk_out = std::vector<int32_t>(2 * kDraftN);
  std::vector<float> head_params = std::vector<float>(kHq * 4, std::numeric_limits<float>::quiet_NaN());
  std::vector<float> lse_in = std::vector<float>(kB * kHq * kS, 0.f);  // merge inputs
  std::vector<float> v_dst = std::vector<float>(kB * kS * kHkv * kD);  // prefetch outputs (k_dst = out)
  std::vector<int32_t> positions = std::vector<int32_t>(kB * kS);
  std::vector<int32_t> remapped = std::vector<int32_t>(kB * kHkv * 4);

  sparsa_tensor tq, tk, tv, tout, tlse, tcu_q, tpage, tseq, tidx, thead_map, tmask, tmask_out, tstats, tscores, ttopk,
      thead_params, tlse_in, tk_dst, tv_dst, tpositions, tremapped, toffsets;
  sparsa_attention_args args;
  sparsa_policy policy;
  int32_t topk_k = 2;
  // The call a row makes; default: sparsa_attention_run(ctx, &args, &policy).
  std::function<sparsa_status(Baseline&)> call = [](Baseline& b) {
    return sparsa_attention_run(b.ctx, &b.args, &b.policy);
  };

  Baseline() {
    tq = make_tensor(q.data(), SPARSA_DTYPE_F32, {kB, kS, kHq, kD});
    tk = make_tensor(k.data(), SPARSA_DTYPE_F32, {kB, kS, kHkv, kD});
    tv = make_tensor(v.data(), SPARSA_DTYPE_F32, {kB, kS, kHkv, kD});
    tout = make_tensor(out.data(), SPARSA_DTYPE_F32, {kB, kS, kHq, kD});
    tlse = make_tensor(lse.data(), SPARSA_DTYPE_F32, {kB, kHq, kS});
    tcu_q = make_tensor(cu_q.data(), SPARSA_DTYPE_I32, {kB + 1});
    tpage = make_tensor(page_table.data(), SPARSA_DTYPE_I32, {kB, 2});
    tseq = make_tensor(seq_lens.data(), SPARSA_DTYPE_I32, {kB});
    toffsets = make_tensor(query_offsets.data(), SPARSA_DTYPE_I32, {kB});
    tidx = make_tensor(indices.data(), SPARSA_DTYPE_I32, {kB, kHkv, 4});
    thead_map = make_tensor(head_map.data(), SPARSA_DTYPE_I32, {kHq});
    tmask = make_tensor(mask.data(), SPARSA_DTYPE_U8, {kB, kHq, 1, 1});
    tmask_out = make_tensor(mask_out.data(), SPARSA_DTYPE_U8, {kB, kHq, 1, 1});
    tstats = make_tensor(stats.data(), SPARSA_DTYPE_I64, {4});
    tscores = make_tensor(scores.data(), SPARSA_DTYPE_F32, {1, 2, kDraftN});
    ttopk = make_tensor(topk_out.data(), SPARSA_DTYPE_I32, {1, 2, topk_k});
    thead_params = make_tensor(head_params.data(), SPARSA_DTYPE_F32, {kHq, 4});
    tlse_in = make_tensor(lse_in.data(), SPARSA_DTYPE_F32, {kB, kHq, kS});
    tk_dst = make_tensor(out.data(), SPARSA_DTYPE_F32, {kB, kS, kHkv, kD});
    tv_dst = make_tensor(v_dst.data(), SPARSA_DTYPE_F32, {kB, kS, kHkv, kD});
    tpositions = make_tensor(positions.data(), SPARSA_DTYPE_I32, {kB, kS});
    tremapped = make_tensor(remapped.data(), SPARSA_DTYPE_I32, {kB, kHkv, 4});
    EXPECT_EQ(sparsa_attention_args_init(&args, sizeof args), SPARSA_STATUS_SUCCESS);
    args.q = &tq;
    args.k = &tk;
    args.v = &tv;
    args.out = &tout;
    args.lse = &tlse;
    args.causal = 1;
    EXPECT_EQ(sparsa_policy_init(&policy, sizeof policy, SPARSA_POLICY_DENSE), SPARSA_STATUS_SUCCESS);
    EXPECT_EQ(sparsa_context_create(nullptr, &ctx), SPARSA_STATUS_SUCCESS);
    EXPECT_EQ(sparsa_context_create(nullptr, &other_ctx), SPARSA_STATUS_SUCCESS);
    EXPECT_EQ(sparsa_selection_cache_create(other_ctx, kB, kHq, kHkv, kD, 64, &foreign_cache), SPARSA_STATUS_SUCCESS);
  }
  ~Baseline() {
    sparsa_selection_cache_destroy(foreign_cache);
    sparsa_context_destroy(other_ctx);
    sparsa_context_destroy(ctx);
  }
  Baseline(const Baseline&) = delete;
  Baseline& operator=(const Baseline&) = delete;

  // Switches q/out to packed [Tq, Hq, D] with cu_seqlens_q (lse becomes [Hq, Tq]).
  void pack_q() {
    tq = make_tensor(q.data(), SPARSA_DTYPE_F32, {kB * kS, kHq, kD});
    tout = make_tensor(out.data(), SPARSA_DTYPE_F32, {kB * kS, kHq, kD});
    tlse = make_tensor(lse.data(), SPARSA_DTYPE_F32, {kHq, kB * kS});
    args.cu_seqlens_q = &tcu_q;
  }
  // Switches k/v to paged caches [P, page_size, Hkv, D] with page_table and seq_lens_k.
  void page_kv() {
    tk = make_tensor(k.data(), SPARSA_DTYPE_F32, {kPages, kPageSize, kHkv, kD});
    tv = make_tensor(v.data(), SPARSA_DTYPE_F32, {kPages, kPageSize, kHkv, kD});
    args.page_table = &tpage;
    args.seq_lens_k = &tseq;
  }
  void use_policy(int32_t kind) { ASSERT_EQ(sparsa_policy_init(&policy, sizeof policy, kind), SPARSA_STATUS_SUCCESS); }
  void run_merge() {
    call = [](Baseline& b) {
      return sparsa_merge_states(b.ctx, &b.tq, &b.tlse_in, &b.tq, &b.tlse_in, &b.tout, &b.tlse);
    };
  }
  void run_prefetch() {
    call = [](Baseline& b) {
      return sparsa_kv_prefetch(b.ctx, &b.tk, &b.tv, &b.tidx, &b.tk_dst, &b.tv_dst, &b.tpositions, &b.tremapped,
                                nullptr);
    };
  }
  void run_topk() {
    call = [](Baseline& b) { return sparsa_topk_from_scores(b.ctx, &b.tscores, b.topk_k, 1, &b.ttopk); };
  }

  // Every output buffer a call could write.
  std::vector<std::pair<void*, size_t>> outputs() {
    return {{out.data(), out.size() * sizeof(float)},
            {lse.data(), lse.size() * sizeof(float)},
            {mask_out.data(), mask_out.size()},
            {stats.data(), stats.size() * sizeof(int64_t)},
            {topk_out.data(), topk_out.size() * sizeof(int32_t)},
            {v_dst.data(), v_dst.size() * sizeof(float)},
            {positions.data(), positions.size() * sizeof(int32_t)},
            {remapped.data(), remapped.size() * sizeof(int32_t)}};
  }
};

struct Row {
  const char* name;
  std::function<void(Baseline&)> mutate;
  sparsa_status status;
  const char* message;  // substring the message must contain (it names the argument)
};

const float kNaN = std::numeric_limits<float>::quiet_NaN();

std::vector<Row> bad_input_rows() {
  return {
      // Null pointers.
      {"null ctx",
       [](Baseline& b) { b.call = [](Baseline& x) { return sparsa_attention_run(nullptr, &x.args, &x.policy); }; },
       SPARSA_STATUS_NULL_POINTER, "ctx"},
      {"null args",
       [](Baseline& b) { b.call = [](Baseline& x) { return sparsa_attention_run(x.ctx, nullptr, &x.policy); }; },
       SPARSA_STATUS_NULL_POINTER, "args"},
      {"null q", [](Baseline& b) { b.args.q = nullptr; }, SPARSA_STATUS_NULL_POINTER, "q: required"},
      {"null out", [](Baseline& b) { b.args.out = nullptr; }, SPARSA_STATUS_NULL_POINTER, "out: required"},
      {"null k data", [](Baseline& b) { b.tk.data = nullptr; }, SPARSA_STATUS_NULL_POINTER, "k: data is NULL"},
      {"block mask missing", [](Baseline& b) { b.use_policy(SPARSA_POLICY_BLOCK_SPARSE); }, SPARSA_STATUS_NULL_POINTER,
       "policy.block_mask"},
      {"paged without seq_lens_k",
       [](Baseline& b) {
         b.page_kv();
         b.args.seq_lens_k = nullptr;
       },
       SPARSA_STATUS_NULL_POINTER, "seq_lens_k"},
      // Dtypes.
      {"q dtype I32", [](Baseline& b) { b.tq.dtype = SPARSA_DTYPE_I32; }, SPARSA_STATUS_DTYPE_MISMATCH, "q: dtype I32"},
      {"k dtype differs from q", [](Baseline& b) { b.tk.dtype = SPARSA_DTYPE_F16; }, SPARSA_STATUS_DTYPE_MISMATCH,
       "k: dtype F16 but q is F32"},
      {"out dtype differs from q", [](Baseline& b) { b.tout.dtype = SPARSA_DTYPE_BF16; }, SPARSA_STATUS_DTYPE_MISMATCH,
       "out: dtype"},
      {"lse not F32", [](Baseline& b) { b.tlse.dtype = SPARSA_DTYPE_F16; }, SPARSA_STATUS_DTYPE_MISMATCH, "lse"},
      {"stats not I64",
       [](Baseline& b) {
         b.tstats.dtype = SPARSA_DTYPE_I32;
         b.args.stats = &b.tstats;
       },
       SPARSA_STATUS_DTYPE_MISMATCH, "stats"},
      {"cu_seqlens_q not I32",
       [](Baseline& b) {
         b.pack_q();
         b.tcu_q.dtype = SPARSA_DTYPE_I64;
       },
       SPARSA_STATUS_DTYPE_MISMATCH, "cu_seqlens_q"},
      // Ranks, shapes, strides.
      {"q rank 3 without cu_seqlens_q",
       [](Baseline& b) {
         b.tq = make_tensor(b.q.data(), SPARSA_DTYPE_F32, {kB * kS, kHq, kD});
       },
       SPARSA_STATUS_SHAPE_MISMATCH, "q: expected rank 4"},
      {"ndim 0", [](Baseline& b) { b.tv.ndim = 0; }, SPARSA_STATUS_SHAPE_MISMATCH, "v: ndim"},
      {"k head_dim differs",
       [](Baseline& b) {
         b.tk = make_tensor(b.k.data(), SPARSA_DTYPE_F32, {kB, kS, kHkv, 4});
         b.tv = make_tensor(b.v.data(), SPARSA_DTYPE_F32, {kB, kS, kHkv, 4});
       },
       SPARSA_STATUS_SHAPE_MISMATCH, "k: shape [2, 16, 2, 4] but q has head_dim 8"},
      {"v shape differs from k", [](Baseline& b) { b.tv.shape[1] = kS - 1; }, SPARSA_STATUS_SHAPE_MISMATCH,
       "v: expected shape"},
      {"out shape differs from q", [](Baseline& b) { b.tout.shape[1] = kS - 1; }, SPARSA_STATUS_SHAPE_MISMATCH,
       "out: expected shape"},
      {"k batch differs",
       [](Baseline& b) {
         b.tk.shape[0] = 1;
         b.tv.shape[0] = 1;
       },
       SPARSA_STATUS_SHAPE_MISMATCH, "k: shape [1, 16, 2, 8] but q has batch B = 2"},
      {"non-unit last stride",
       [](Baseline& b) {
         b.tv.strides[3] = 2;
         b.tv.strides[2] = 16;
       },
       SPARSA_STATUS_SHAPE_MISMATCH, "v: the last dimension must have stride 1"},
      {"negative stride", [](Baseline& b) { b.tq.strides[1] = -1; }, SPARSA_STATUS_SHAPE_MISMATCH, "q: strides"},
      // Outputs whose elements overlap: the result would depend on which write lands last.
      {"out broadcast over S", [](Baseline& b) { b.tout.strides[1] = 0; }, SPARSA_STATUS_SHAPE_MISMATCH,
       "out: an output's elements must not overlap"},
      {"out heads interleaved with D",
       [](Baseline& b) { b.tout.strides[2] = 1; },  // head h + 1 starts one element after head h
       SPARSA_STATUS_SHAPE_MISMATCH, "out: an output's elements must not overlap"},
      {"lse broadcast over heads",
       [](Baseline& b) {
         b.tlse.strides[1] = 0;
         b.args.lse = &b.tlse;
       },
       SPARSA_STATUS_SHAPE_MISMATCH, "lse: an output's elements must not overlap"},
      {"stats broadcast",
       [](Baseline& b) {
         b.tstats.strides[0] = 0;
         b.args.stats = &b.tstats;
       },
       SPARSA_STATUS_SHAPE_MISMATCH, "stats: an output's elements must not overlap"},
      {"top-k out_indices broadcast",
       [](Baseline& b) {
         b.run_topk();
         b.ttopk.strides[1] = 0;
       },
       SPARSA_STATUS_SHAPE_MISMATCH, "out_indices: an output's elements must not overlap"},
      {"merge out broadcast",
       [](Baseline& b) {
         b.run_merge();
         b.tout.strides[0] = 0;
       },
       SPARSA_STATUS_SHAPE_MISMATCH, "out: an output's elements must not overlap"},
      {"prefetch positions broadcast",
       [](Baseline& b) {
         b.run_prefetch();
         b.tpositions.strides[1] = 0;
       },
       SPARSA_STATUS_SHAPE_MISMATCH, "positions: an output's elements must not overlap"},
      {"Hq % Hkv != 0",
       [](Baseline& b) {
         b.tk = make_tensor(b.k.data(), SPARSA_DTYPE_F32, {kB, kS, 3, kD});
         b.tv = make_tensor(b.v.data(), SPARSA_DTYPE_F32, {kB, kS, 3, kD});
       },
       SPARSA_STATUS_SHAPE_MISMATCH, "does not divide q's Hq = 4"},
      {"head_dim too large",
       [](Baseline& b) {
         b.tq.shape[3] = 1024;
         b.tk.shape[3] = 1024;
         b.tv.shape[3] = 1024;
         b.tout.shape[3] = 1024;
       },
       SPARSA_STATUS_SHAPE_MISMATCH, "q: head_dim D = 1024"},
      {"lse shape", [](Baseline& b) { b.tlse.shape[2] = kS + 1; }, SPARSA_STATUS_SHAPE_MISMATCH, "lse: expected shape"},
      {"block mask shape",
       [](Baseline& b) {
         b.use_policy(SPARSA_POLICY_BLOCK_SPARSE);
         b.policy.block_mask = &b.tmask;
         b.tmask.shape[3] = 2;
       },
       SPARSA_STATUS_SHAPE_MISMATCH, "policy.block_mask: expected shape [2, 4, 1, 1]"},
      {"indices H_idx does not divide Hq",
       [](Baseline& b) {
         b.use_policy(SPARSA_POLICY_TOKEN_INDICES);
         b.tidx.shape[1] = 3;
         b.policy.indices = &b.tidx;
       },
       SPARSA_STATUS_SHAPE_MISMATCH, "policy.indices: H_idx = 3"},
      {"TOKEN_SPARSE with Sq != Skv",
       [](Baseline& b) {
         b.use_policy(SPARSA_POLICY_TOKEN_SPARSE);
         b.tk.shape[1] = kS - 4;
         b.tv.shape[1] = kS - 4;
       },
       SPARSA_STATUS_SHAPE_MISMATCH, "TOKEN_SPARSE needs Sq == Skv"},
      {"block_mask_out from a non-SPARGE policy", [](Baseline& b) { b.args.block_mask_out = &b.tmask_out; },
       SPARSA_STATUS_UNSUPPORTED, "block_mask_out"},
      // top_k > N in topk_from_scores.
      {"topk k > N",
       [](Baseline& b) {
         b.topk_k = kDraftN + 1;
         b.ttopk = make_tensor(b.topk_out.data(), SPARSA_DTYPE_I32, {1, 2, b.topk_k});
         b.run_topk();
       },
       SPARSA_STATUS_SHAPE_MISMATCH, "k: expected 1 <= k <= 8"},
      {"topk k = 0",
       [](Baseline& b) {
         b.topk_k = 0;
         b.run_topk();
       },
       SPARSA_STATUS_SHAPE_MISMATCH, "k: expected"},
      // Parameter domains.
      {"softmax_scale < 0", [](Baseline& b) { b.args.softmax_scale = -1.f; }, SPARSA_STATUS_INVALID_ARGUMENT,
       "args.softmax_scale"},
      {"softmax_scale NaN", [](Baseline& b) { b.args.softmax_scale = kNaN; }, SPARSA_STATUS_INVALID_ARGUMENT,
       "args.softmax_scale"},
      {"causal = 2", [](Baseline& b) { b.args.causal = 2; }, SPARSA_STATUS_INVALID_ARGUMENT, "args.causal"},
      {"unknown kind", [](Baseline& b) { b.policy.kind = 99; }, SPARSA_STATUS_INVALID_ARGUMENT, "policy.kind"},
      {"unknown flag bits", [](Baseline& b) { b.policy.flags = 1u << 7; }, SPARSA_STATUS_INVALID_ARGUMENT,
       "policy.flags"},
      {"negative sink window",
       [](Baseline& b) {
         b.use_policy(SPARSA_POLICY_SINK_WINDOW);
         b.policy.sink_window = -1;
       },
       SPARSA_STATUS_INVALID_ARGUMENT, "policy.sink_window"},
      {"sparge tau = 0",
       [](Baseline& b) {
         b.use_policy(SPARSA_POLICY_SPARGE);
         b.policy.sparge_tau = 0.f;
       },
       SPARSA_STATUS_INVALID_ARGUMENT, "policy.sparge_tau"},
      {"sparge tau > 1",
       [](Baseline& b) {
         b.use_policy(SPARSA_POLICY_SPARGE);
         b.policy.sparge_tau = 1.5f;
       },
       SPARSA_STATUS_INVALID_ARGUMENT, "policy.sparge_tau"},
      {"sparge lambda > 0",
       [](Baseline& b) {
         b.use_policy(SPARSA_POLICY_SPARGE);
         b.policy.sparge_lambda = 0.5f;
       },
       SPARSA_STATUS_INVALID_ARGUMENT, "policy.sparge_lambda"},
      {"sparge theta > 1",
       [](Baseline& b) {
         b.use_policy(SPARSA_POLICY_SPARGE);
         b.policy.sparge_theta = 2.f;
       },
       SPARSA_STATUS_INVALID_ARGUMENT, "policy.sparge_theta"},
      {"sparge_head_params row outside its domain",
       [](Baseline& b) {
         b.use_policy(SPARSA_POLICY_SPARGE);
         b.policy.sparge_head_params = &b.thead_params;
         b.head_params[1 * 4 + 1] = 0.f;  // head 1's tau
       },
       SPARSA_STATUS_INVALID_ARGUMENT, "policy.sparge_head_params[1]: tau"},
      {"block_k = 0",
       [](Baseline& b) {
         b.use_policy(SPARSA_POLICY_SPARGE);
         b.policy.block_k = 0;
       },
       SPARSA_STATUS_INVALID_ARGUMENT, "policy.block_k"},
      {"token sparse coverage < 0",
       [](Baseline& b) {
         b.use_policy(SPARSA_POLICY_TOKEN_SPARSE);
         b.policy.token_sparse_coverage = -0.1f;
       },
       SPARSA_STATUS_INVALID_ARGUMENT, "policy.token_sparse_coverage"},
      {"even pool kernel",
       [](Baseline& b) {
         b.use_policy(SPARSA_POLICY_TOKEN_SPARSE);
         b.policy.token_sparse_pool_kernel = 6;
       },
       SPARSA_STATUS_INVALID_ARGUMENT, "policy.token_sparse_pool_kernel"},
      {"select_top_k = 0",
       [](Baseline& b) {
         b.use_policy(SPARSA_POLICY_TOKEN_SELECT);
         b.policy.select_top_k = 0;
       },
       SPARSA_STATUS_INVALID_ARGUMENT, "policy.select_top_k"},
      {"delta gamma = 0",
       [](Baseline& b) {
         b.policy.flags = SPARSA_POLICY_FLAG_DELTA;
         b.args.lse = nullptr;
         b.policy.delta_gamma = 0;
       },
       SPARSA_STATUS_INVALID_ARGUMENT, "policy.delta_gamma"},
      {"LSE requested with delta", [](Baseline& b) { b.policy.flags = SPARSA_POLICY_FLAG_DELTA; },
       SPARSA_STATUS_INVALID_ARGUMENT, "lse: not defined for rows"},
      {"delta without causal",
       [](Baseline& b) {
         b.policy.flags = SPARSA_POLICY_FLAG_DELTA;
         b.args.lse = nullptr;
         b.args.causal = 0;
       },
       SPARSA_STATUS_INVALID_ARGUMENT, "args.causal"},
      {"selection cache of another context",
       [](Baseline& b) {
         b.use_policy(SPARSA_POLICY_TOKEN_SELECT);
         b.args.selection_cache = b.foreign_cache;
       },
       SPARSA_STATUS_INVALID_ARGUMENT, "args.selection_cache"},
      // query_offsets (§0's o per sequence).
      {"query_offsets below -Sq",
       [](Baseline& b) {
         b.query_offsets[1] = -int32_t(kS) - 1;
         b.args.query_offsets = &b.toffsets;
       },
       SPARSA_STATUS_INDEX_OUT_OF_RANGE, "query_offsets[1] = "},
      {"query_offsets above Skv",
       [](Baseline& b) {
         b.query_offsets[0] = int32_t(kS) + 1;
         b.args.query_offsets = &b.toffsets;
       },
       SPARSA_STATUS_INDEX_OUT_OF_RANGE, "query_offsets[0] = "},
      {"query_offsets of shape [1]",
       [](Baseline& b) {
         b.toffsets = make_tensor(b.query_offsets.data(), SPARSA_DTYPE_I32, {1});
         b.args.query_offsets = &b.toffsets;
       },
       SPARSA_STATUS_SHAPE_MISMATCH, "query_offsets"},
      {"query_offsets as int64",
       [](Baseline& b) {
         b.toffsets = make_tensor(b.query_offsets.data(), SPARSA_DTYPE_I64, {1});
         b.args.query_offsets = &b.toffsets;
       },
       SPARSA_STATUS_DTYPE_MISMATCH, "query_offsets"},
      {"query_offsets with TOKEN_SELECT",
       [](Baseline& b) {
         b.use_policy(SPARSA_POLICY_TOKEN_SELECT);
         b.args.query_offsets = &b.toffsets;
       },
       SPARSA_STATUS_UNSUPPORTED, "query_offsets: read by DENSE"},
      {"query_offsets with delta",
       [](Baseline& b) {
         b.policy.flags = SPARSA_POLICY_FLAG_DELTA;
         b.args.lse = nullptr;
         b.args.query_offsets = &b.toffsets;
       },
       SPARSA_STATUS_UNSUPPORTED, "SPARSA_POLICY_FLAG_DELTA"},
      // Devices.
      {"CUDA tensor to a CPU context", [](Baseline& b) { b.tk.device_type = SPARSA_DEVICE_CUDA; },
       SPARSA_STATUS_DEVICE_MISMATCH, "k: tensor on CUDA"},
      {"ROCm output to a CPU context", [](Baseline& b) { b.tout.device_type = SPARSA_DEVICE_ROCM; },
       SPARSA_STATUS_DEVICE_MISMATCH, "out: tensor on ROCM"},
      // struct_size.
      {"policy struct_size too small", [](Baseline& b) { b.policy.struct_size = 8; }, SPARSA_STATUS_STRUCT_SIZE,
       "policy.struct_size: 8 is below the smallest sparsa_policy"},
      // (A newer caller's larger struct needs real bytes behind it: tests/test_struct_size.cpp.)
      {"args struct_size above the maximum", [](Baseline& b) { b.args.struct_size = SPARSA_STRUCT_SIZE_MAX + 1; },
       SPARSA_STATUS_STRUCT_SIZE, "args.struct_size: 4097 is above SPARSA_STRUCT_SIZE_MAX"},
      {"tensor struct_size 0", [](Baseline& b) { b.tq.struct_size = 0; }, SPARSA_STATUS_STRUCT_SIZE, "q.struct_size"},
      // Contents: offsets, pages, indices.
      {"cu_seqlens_q not starting at 0",
       [](Baseline& b) {
         b.pack_q();
         b.cu_q = {3, 16, 32};
       },
       SPARSA_STATUS_INDEX_OUT_OF_RANGE, "cu_seqlens_q[0]"},
      {"cu_seqlens_q decreasing",
       [](Baseline& b) {
         b.pack_q();
         b.cu_q = {0, 20, 18};
       },
       SPARSA_STATUS_INDEX_OUT_OF_RANGE, "cu_seqlens_q[2] = 18"},
      {"cu_seqlens_q last != Tq",
       [](Baseline& b) {
         b.pack_q();
         b.cu_q = {0, 16, 30};
       },
       SPARSA_STATUS_INDEX_OUT_OF_RANGE, "cu_seqlens_q[2] = 30 but q has Tq = 32"},
      {"page id out of range",
       [](Baseline& b) {
         b.page_kv();
         b.page_table = {0, 1, 2, 7};
       },
       SPARSA_STATUS_INDEX_OUT_OF_RANGE, "page_table[1][1] = 7"},
      {"seq_lens_k past the pages",
       [](Baseline& b) {
         b.page_kv();
         b.seq_lens = {17, 16};
       },
       SPARSA_STATUS_INDEX_OUT_OF_RANGE, "seq_lens_k[0] = 17"},
      {"token index >= N",
       [](Baseline& b) {
         b.use_policy(SPARSA_POLICY_TOKEN_INDICES);
         b.policy.indices = &b.tidx;
         b.indices[5] = int32_t(kS);
       },
       SPARSA_STATUS_INDEX_OUT_OF_RANGE, "policy.indices[0][1][1] = 16"},
      {"token index < -1",
       [](Baseline& b) {
         b.use_policy(SPARSA_POLICY_TOKEN_INDICES);
         b.policy.indices = &b.tidx;
         b.indices[0] = -2;
       },
       SPARSA_STATUS_INDEX_OUT_OF_RANGE, "policy.indices[0][0][0] = -2"},
      // Utilities.
      {"merge lse shape",
       [](Baseline& b) {
         b.run_merge();
         b.tlse_in.shape[2] = kS - 1;
       },
       SPARSA_STATUS_SHAPE_MISMATCH, "lse_a: expected shape [2, 4, 16]"},
      {"merge o_b dtype",
       [](Baseline& b) {
         b.run_merge();
         b.call = [](Baseline& x) {
           sparsa_tensor o_b = x.tq;
           o_b.dtype = SPARSA_DTYPE_F16;
           return sparsa_merge_states(x.ctx, &x.tq, &x.tlse_in, &o_b, &x.tlse_in, &x.tout, &x.tlse);
         };
       },
       SPARSA_STATUS_DTYPE_MISMATCH, "o_b: dtype F16"},
      {"prefetch index out of range",
       [](Baseline& b) {
         b.run_prefetch();
         b.indices[0] = int32_t(kS);
       },
       SPARSA_STATUS_INDEX_OUT_OF_RANGE, "indices[0][0][0] = 16"},
      {"prefetch capacity below the union",
       [](Baseline& b) {
         b.run_prefetch();
         b.indices[1] = 2;  // sequence 0 now selects tokens {1, 2}
         b.tk_dst.shape[1] = 1;
         b.tv_dst.shape[1] = 1;
         b.tpositions.shape[1] = 1;
       },
       SPARSA_STATUS_SHAPE_MISMATCH, "k_dst: capacity C = 1 but sequence 0 selects 2"},
      {"head_map out of range",
       [](Baseline& b) {
         b.use_policy(SPARSA_POLICY_TOKEN_INDICES);
         b.policy.indices = &b.tidx;
         b.policy.head_map = &b.thead_map;
         b.head_map[3] = 2;
       },
       SPARSA_STATUS_INDEX_OUT_OF_RANGE, "policy.head_map[3] = 2"},
  };
}

TEST(BadInput, EveryClassReturnsItsStatusAndLeavesOutputsUntouched) {
  for (const Row& row : bad_input_rows()) {
    SCOPED_TRACE(row.name);
    Baseline b;
    ASSERT_NE(b.ctx, nullptr);
    row.mutate(b);
    for (auto [data, bytes] : b.outputs()) std::memset(data, kPoison, bytes);
    const sparsa_status status = b.call(b);
    const std::string message = sparsa_last_error_message();
    EXPECT_EQ(status, row.status) << sparsa_status_string(status) << ": " << message;
    EXPECT_NE(message.find(row.message), std::string::npos)
        << "message \"" << message << "\" lacks \"" << row.message << "\"";
    for (auto [data, bytes] : b.outputs()) {
      const auto* p = static_cast<const unsigned char*>(data);
      size_t touched = 0;
      for (size_t i = 0; i < bytes; ++i) touched += p[i] != kPoison;
      EXPECT_EQ(touched, 0u) << "an output was written by a failed call";
    }
  }
}

// The baseline itself is valid (so each row above fails because of its one mutation). Needs the CPU backend.
TEST(BadInput, BaselineIsValid) {
  Baseline b;
  ASSERT_NE(b.ctx, nullptr);
  EXPECT_EQ(b.call(b), SPARSA_STATUS_SUCCESS) << sparsa_last_error_message();
  EXPECT_STREQ(sparsa_last_error_message(), "");
  EXPECT_EQ(sparsa_attention_run(b.ctx, &b.args, nullptr), SPARSA_STATUS_SUCCESS) << "NULL policy = DENSE";
  b.tk.device_type = SPARSA_DEVICE_CUDA_HOST;  // pinned host memory is host memory to the CPU backend
  EXPECT_EQ(b.call(b), SPARSA_STATUS_SUCCESS) << sparsa_last_error_message();
  b.pack_q();
  b.page_kv();
  EXPECT_EQ(sparsa_attention_plan(b.ctx, &b.args, &b.policy), SPARSA_STATUS_SUCCESS) << sparsa_last_error_message();
  Baseline merge;
  merge.run_merge();
  EXPECT_EQ(merge.call(merge), SPARSA_STATUS_SUCCESS) << sparsa_last_error_message();
  Baseline prefetch;
  prefetch.run_prefetch();
  EXPECT_EQ(prefetch.call(prefetch), SPARSA_STATUS_SUCCESS) << sparsa_last_error_message();
  Baseline topk;
  topk.run_topk();
  EXPECT_EQ(topk.call(topk), SPARSA_STATUS_SUCCESS) << sparsa_last_error_message();
}

// page_table (sparsa.h): only the first ceil(seq_lens_k[b] / page_size) entries of a row are read, so -1 padding
// after a sequence's last page is accepted, while -1 among the pages a sequence uses is an index error.
TEST(BadInput, PageTablePaddingPastTheLastPageIsNeverRead) {
  Baseline padded;
  ASSERT_NE(padded.ctx, nullptr);
  padded.page_kv();
  padded.seq_lens = {int32_t(kPageSize), int32_t(kS)};  // sequence 0 uses one page
  padded.page_table = {0, -1, 2, 3};
  EXPECT_EQ(padded.call(padded), SPARSA_STATUS_SUCCESS) << sparsa_last_error_message();
  Baseline used;
  used.page_kv();
  used.page_table = {0, -1, 2, 3};  // sequence 0 uses both pages
  EXPECT_EQ(used.call(used), SPARSA_STATUS_INDEX_OUT_OF_RANGE);
  EXPECT_NE(std::string(sparsa_last_error_message()).find("page_table[0][1] = -1"), std::string::npos)
      << sparsa_last_error_message();
}

}  // namespace
