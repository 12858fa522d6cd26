// libFuzzer target: sparsa_attention_plan + sparsa_attention_run on the CPU backend with shapes, strides, dtypes,
// layouts, policy fields, flags and optional outputs decoded from the input. Small sizes, now and then a huge or
// negative extent or parameter. Checks: no crash, leak or undefined behaviour (ASan/UBSan), no INTERNAL status, and
// a failed call writes no output.
#include <algorithm>
#include <memory>
#include <vector>

#include "fuzz_common.h"

namespace {

using sparsa_fuzz::Context;
using sparsa_fuzz::make_ids;
using sparsa_fuzz::make_tensor;
using sparsa_fuzz::Tensor;

int64_t ceil_div(int64_t a, int64_t b) { return b > 0 ? (a + b - 1) / b : 0; }

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  FuzzedDataProvider in(data, size);
  static Context context;  // one context for every input: scratch reuse across runs is part of what is tested

  // Problem sizes.
  const int64_t B = in.ConsumeIntegralInRange<int64_t>(0, 3);
  const int64_t Sq = in.ConsumeIntegralInRange<int64_t>(0, 40);
  const int64_t Skv = in.ConsumeIntegralInRange<int64_t>(0, 40);
  const int64_t Hkv = in.ConsumeIntegralInRange<int64_t>(1, 3);
  const int64_t Hq = Hkv * in.ConsumeIntegralInRange<int64_t>(1, 3);
  const int64_t D = in.ConsumeIntegralInRange<int64_t>(1, 16);
  static const int32_t kDtypes[] = {SPARSA_DTYPE_F32, SPARSA_DTYPE_F16, SPARSA_DTYPE_BF16, SPARSA_DTYPE_F32,
                                    SPARSA_DTYPE_I32, 99};
  const int32_t dtype = in.PickValueInArray(kDtypes);
  const int layout = in.ConsumeIntegralInRange<int>(0, 3);  // 0 padded, 1 packed q, 2 packed k/v, 3 paged

  std::vector<std::unique_ptr<Tensor>> keep;
  auto hold = [&keep](std::unique_ptr<Tensor> t) {
    keep.push_back(std::move(t));
    return keep.back().get();
  };
  sparsa_attention_args args;
  sparsa_attention_args_init(&args, sizeof args);

  const int64_t Tq = B * Sq, Tk = B * Skv;
  std::vector<const Tensor*> outputs;
  Tensor* q = hold(make_tensor(in, dtype, layout == 1 ? std::vector<int64_t>{Tq, Hq, D} : std::vector<int64_t>{B, Sq, Hq, D}, true));
  Tensor* out = hold(make_tensor(in, in.ConsumeIntegralInRange<int>(0, 15) ? dtype : SPARSA_DTYPE_F16, q->t.ndim == 3 ? std::vector<int64_t>{Tq, Hq, D} : std::vector<int64_t>{B, Sq, Hq, D}, false));
  args.q = q->get();
  args.out = out->get();
  outputs.push_back(out);
  const int64_t page_size = in.ConsumeIntegralInRange<int64_t>(1, 8);
  const int64_t max_pages = ceil_div(Skv, page_size);
  std::vector<int64_t> kv_shape = {B, Skv, Hkv, D};
  if (layout == 2) kv_shape = {Tk, Hkv, D};
  if (layout == 3) kv_shape = {B * max_pages + 1, page_size, Hkv, D};
  Tensor* k = hold(make_tensor(in, dtype, kv_shape, true));
  Tensor* v = hold(make_tensor(in, dtype, in.ConsumeIntegralInRange<int>(0, 15) ? kv_shape : std::vector<int64_t>{B, Skv + 1, Hkv, D}, true));
  args.k = k->get();
  args.v = v->get();

  auto offsets = [&](int64_t per_seq) {
    auto t = make_ids(in, {B + 1}, 0, int32_t(per_seq));
    if (t->t.data && t->bytes >= size_t(4 * (B + 1)) && in.ConsumeBool()) {
      auto* ids = reinterpret_cast<int32_t*>(t->storage.data());  // sorted prefix sums most of the time
      ids[0] = 0;
      for (int64_t b = 1; b <= B; ++b) ids[b] = int32_t(b * per_seq);
    }
    return t;
  };
  if (layout == 1) args.cu_seqlens_q = hold(offsets(Sq))->get();
  if (layout == 2) args.cu_seqlens_k = hold(offsets(Skv))->get();
  if (layout == 3) {
    auto table = make_ids(in, {B, max_pages}, 0, int32_t(B * max_pages));
    args.page_table = hold(std::move(table))->get();
  }
  if (layout == 3 || in.ConsumeIntegralInRange<int>(0, 3) == 0) args.seq_lens_k = hold(make_ids(in, {B}, 0, int32_t(Skv)))->get();

  // Policy.
  sparsa_policy p;
  const int32_t kind = in.ConsumeIntegralInRange<int32_t>(0, 7);  // 7: unknown kind (init refuses; use DENSE's)
  if (sparsa_policy_init(&p, sizeof p, kind) != SPARSA_STATUS_SUCCESS) {
    sparsa_policy_init(&p, sizeof p, SPARSA_POLICY_DENSE);
    p.kind = kind;
  }
  if (in.ConsumeIntegralInRange<int>(0, 3) == 0) p.flags = in.ConsumeIntegralInRange<int>(0, 7) ? SPARSA_POLICY_FLAG_DELTA : 0x80;
  p.sink_tokens = sparsa_fuzz::interesting_int(in, 48);
  p.sink_window = sparsa_fuzz::interesting_int(in, 48);
  p.block_q = in.ConsumeBool() ? sparsa_fuzz::interesting_int(in, 48) : 16;
  p.block_k = in.ConsumeBool() ? sparsa_fuzz::interesting_int(in, 48) : 16;
  const int64_t nqb = ceil_div(Sq, p.block_q), nkb = ceil_div(Skv, p.block_k);
  auto mask_like = [&]() {
    return make_tensor(in, SPARSA_DTYPE_U8, {B, Hq, nqb, nkb}, false);
  };
  Tensor* mask = hold(mask_like());
  if (mask->t.data) {
    auto* m = reinterpret_cast<uint8_t*>(mask->storage.data());
    for (size_t i = 0; i < mask->bytes; ++i) m[i] = in.ConsumeIntegralInRange<uint8_t>(0, 2) ? 1 : 0;
  }
  p.block_mask = mask->get();
  p.sparge_theta = sparsa_fuzz::interesting_float(in, -1.f, 1.f);
  p.sparge_tau = sparsa_fuzz::interesting_float(in, 0.f, 1.f);
  p.sparge_topk_fraction = in.ConsumeBool() ? 0.f : sparsa_fuzz::interesting_float(in, 0.f, 1.f);
  p.sparge_lambda = in.ConsumeBool() ? -__builtin_inff() : sparsa_fuzz::interesting_float(in, -20.f, 0.f);
  p.sparge_attention_sink = in.ConsumeIntegralInRange<int32_t>(0, 2) == 2 ? 5 : in.ConsumeBool();
  p.sparge_quantized = in.ConsumeBool();
  if (in.ConsumeIntegralInRange<int>(0, 3) == 0) {
    Tensor* hp = hold(make_tensor(in, SPARSA_DTYPE_F32, {Hq, 4}, true));
    p.sparge_head_params = hp->get();
  }
  p.token_sparse_window = sparsa_fuzz::interesting_int(in, 48);
  p.token_sparse_pool_kernel = sparsa_fuzz::interesting_int(in, 9);
  p.token_sparse_coverage = sparsa_fuzz::interesting_float(in, 0.f, 1.f);
  p.token_sparse_min_tokens = sparsa_fuzz::interesting_int(in, 48);
  p.select_n_init = sparsa_fuzz::interesting_int(in, 16);
  p.select_n_local = sparsa_fuzz::interesting_int(in, 16);
  p.select_top_k = sparsa_fuzz::interesting_int(in, 48);
  p.select_scale_scores = in.ConsumeBool();
  p.select_cache_theta = sparsa_fuzz::interesting_float(in, -1.f, 1.f);
  p.select_per_kv_head = in.ConsumeBool();
  const int64_t h_idx = in.ConsumeBool() ? Hkv : Hq;
  p.index_block_size = in.ConsumeBool() ? 1 : sparsa_fuzz::interesting_int(in, 8);
  p.indices = hold(make_ids(in, {B, h_idx, in.ConsumeIntegralInRange<int64_t>(0, 12)}, -1, int32_t(Skv)))->get();
  if (in.ConsumeIntegralInRange<int>(0, 3) == 0) p.head_map = hold(make_ids(in, {Hq}, 0, int32_t(h_idx - 1)))->get();
  p.index_n_init = sparsa_fuzz::interesting_int(in, 8);
  p.index_n_local = sparsa_fuzz::interesting_int(in, 8);
  p.delta_gamma = in.ConsumeBool() ? 4 : sparsa_fuzz::interesting_int(in, 16);
  p.delta_tail_min = in.ConsumeBool() ? 4 : sparsa_fuzz::interesting_int(in, 16);

  // Run arguments and optional outputs.
  args.causal = in.ConsumeIntegralInRange<int32_t>(0, 8) == 8 ? 2 : in.ConsumeBool();
  args.softmax_scale = in.ConsumeBool() ? 0.f : sparsa_fuzz::interesting_float(in, 0.f, 2.f);
  if (in.ConsumeBool()) {
    Tensor* lse = hold(make_tensor(in, SPARSA_DTYPE_F32, layout == 1 ? std::vector<int64_t>{Hq, Tq} : std::vector<int64_t>{B, Hq, Sq}, false));
    args.lse = lse->get();
    outputs.push_back(lse);
  }
  if (in.ConsumeBool()) {
    Tensor* stats = hold(make_tensor(in, SPARSA_DTYPE_I64, {in.ConsumeIntegralInRange<int64_t>(0, 9)}, false));
    args.stats = stats->get();
    outputs.push_back(stats);
  }
  if (in.ConsumeIntegralInRange<int>(0, 3) == 0) {
    const int64_t sets = in.ConsumeBool() ? 1 : (in.ConsumeBool() ? Hkv : Hq);
    Tensor* sel = hold(make_tensor(in, SPARSA_DTYPE_I32, {B, sets, in.ConsumeIntegralInRange<int64_t>(0, 48)}, false));
    args.selected_indices = sel->get();
    outputs.push_back(sel);
  }
  if (in.ConsumeIntegralInRange<int>(0, 3) == 0) {
    Tensor* mask_out = hold(mask_like());
    args.block_mask_out = mask_out->get();
    outputs.push_back(mask_out);
  }
  sparsa_selection_cache* cache = nullptr;
  if (in.ConsumeIntegralInRange<int>(0, 3) == 0) {
    const int32_t top_k = std::max(1, std::min(p.select_top_k, 64));
    if (sparsa_selection_cache_create(context.ctx, int32_t(std::max<int64_t>(B, 1)), int32_t(Hq), int32_t(Hkv),
                                      int32_t(D), top_k, &cache) == SPARSA_STATUS_SUCCESS) {
      args.selection_cache = cache;
    }
  }

  const bool plan_first = in.ConsumeBool();
  if (plan_first) {
    const sparsa_status status = sparsa_attention_plan(context.ctx, &args, &p);
    sparsa_fuzz::expect_no_internal(status, "sparsa_attention_plan");
    sparsa_fuzz::expect_untouched(status, outputs, "sparsa_attention_plan");
  }
  const sparsa_status status = sparsa_attention_run(context.ctx, &args, &p);
  sparsa_fuzz::expect_no_internal(status, "sparsa_attention_run");
  sparsa_fuzz::expect_untouched(status, outputs, "sparsa_attention_run");
  if (cache) {
    int64_t hits = 0, misses = 0;
    sparsa_selection_cache_counts(cache, &hits, &misses);
    sparsa_selection_cache_destroy(cache);
  }
  return 0;
}
