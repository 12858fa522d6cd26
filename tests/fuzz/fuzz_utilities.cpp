// libFuzzer target: the utilities (top-k, head mapping, Hilbert permutation, drift, merge, KV prefetch, selection
// cache, the SpargeAttn tuner's options) and the descriptor/context entry points, one chosen by the first byte.
// Checks as in fuzz_attention_run.cpp: no crash, leak, undefined behaviour or INTERNAL, failed calls write nothing.
#include <algorithm>
#include <memory>
#include <vector>

#include "fuzz_common.h"

namespace {

using sparsa_fuzz::Context;
using sparsa_fuzz::make_ids;
using sparsa_fuzz::make_tensor;
using sparsa_fuzz::Tensor;

int32_t float_dtype(FuzzedDataProvider& in) {
  static const int32_t kDtypes[] = {SPARSA_DTYPE_F32, SPARSA_DTYPE_F16, SPARSA_DTYPE_BF16, SPARSA_DTYPE_I8};
  return in.PickValueInArray(kDtypes);
}

void check(sparsa_status status, const std::vector<const Tensor*>& outputs, const char* call) {
  sparsa_fuzz::expect_no_internal(status, call);
  sparsa_fuzz::expect_untouched(status, outputs, call);
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  FuzzedDataProvider in(data, size);
  static Context context;
  const int which = in.ConsumeIntegralInRange<int>(0, 9);
  switch (which) {
    case 0: {  // top-k
      const int64_t B = in.ConsumeIntegralInRange<int64_t>(0, 3), H = in.ConsumeIntegralInRange<int64_t>(0, 3);
      const int64_t N = in.ConsumeIntegralInRange<int64_t>(0, 64);
      const int32_t k = sparsa_fuzz::interesting_int(in, 16), block = sparsa_fuzz::interesting_int(in, 8);
      auto scores = make_tensor(in, SPARSA_DTYPE_F32, {B, H, N}, true);
      auto out = make_tensor(in, SPARSA_DTYPE_I32, {B, H, k}, false);
      check(sparsa_topk_from_scores(context.ctx, scores->get(), k, block, out->get()), {out.get()}, "topk");
      break;
    }
    case 1: {  // head mapping
      const int64_t T = in.ConsumeIntegralInRange<int64_t>(0, 3), N = in.ConsumeIntegralInRange<int64_t>(0, 32);
      const int64_t Hd = in.ConsumeIntegralInRange<int64_t>(0, 4), Ht = in.ConsumeIntegralInRange<int64_t>(0, 4);
      auto draft = make_tensor(in, SPARSA_DTYPE_F32, {T, Hd, N}, true);
      auto target = make_tensor(in, SPARSA_DTYPE_F32, {T, Ht, N}, true);
      auto out = make_tensor(in, SPARSA_DTYPE_I32, {Ht}, false);
      check(sparsa_head_mapping(draft->get(), target->get(), sparsa_fuzz::interesting_int(in, 32), out->get()),
            {out.get()}, "head_mapping");
      break;
    }
    case 2: {  // Hilbert permutation
      int32_t t = sparsa_fuzz::interesting_int(in, 9), h = sparsa_fuzz::interesting_int(in, 9);
      int32_t w = sparsa_fuzz::interesting_int(in, 9);
      if (in.ConsumeBool()) t = 1 << in.ConsumeIntegralInRange<int>(0, 30);
      std::vector<int32_t> perm(1024, -7), inverse(1024, -7);
      const sparsa_status status = sparsa_hilbert_permutation(t, h, w, nullptr, nullptr, 0);  // size check, no output
      sparsa_fuzz::expect_no_internal(status, "hilbert");
      if (status == SPARSA_STATUS_SUCCESS && int64_t(t) * h * w <= int64_t(perm.size())) {
        sparsa_fuzz::expect_no_internal(sparsa_hilbert_permutation(t, h, w, perm.data(), inverse.data(), int64_t(perm.size())), "hilbert");
      }
      break;
    }
    case 3: {  // drift
      const int64_t L = in.ConsumeIntegralInRange<int64_t>(0, 6), T = in.ConsumeIntegralInRange<int64_t>(0, 8);
      const int64_t D = in.ConsumeIntegralInRange<int64_t>(0, 16);
      const int32_t dtype = float_dtype(in);
      auto h_in = make_tensor(in, dtype, {L, T, D}, true);
      auto h_out = make_tensor(in, in.ConsumeIntegralInRange<int>(0, 7) ? dtype : SPARSA_DTYPE_F32, {L, T, D}, true);
      auto ratio = make_tensor(in, SPARSA_DTYPE_F32, {L}, false);
      auto sparse = make_tensor(in, SPARSA_DTYPE_U8, {L}, false);
      check(sparsa_drift_select_layers(h_in->get(), h_out->get(), sparsa_fuzz::interesting_float(in, 0.f, 1.f),
                                       in.ConsumeBool() ? ratio->get() : nullptr, sparse->get()),
            {ratio.get(), sparse.get()}, "drift");
      break;
    }
    case 4: {  // merge
      const int64_t B = in.ConsumeIntegralInRange<int64_t>(0, 2), S = in.ConsumeIntegralInRange<int64_t>(0, 8);
      const int64_t H = in.ConsumeIntegralInRange<int64_t>(0, 3), D = in.ConsumeIntegralInRange<int64_t>(0, 8);
      const int32_t dtype = float_dtype(in);
      const bool packed = in.ConsumeBool();
      const std::vector<int64_t> o_shape = packed ? std::vector<int64_t>{B * S, H, D} : std::vector<int64_t>{B, S, H, D};
      const std::vector<int64_t> l_shape = packed ? std::vector<int64_t>{H, B * S} : std::vector<int64_t>{B, H, S};
      auto o_a = make_tensor(in, dtype, o_shape, true);
      auto o_b = make_tensor(in, dtype, o_shape, true);
      auto l_a = make_tensor(in, SPARSA_DTYPE_F32, l_shape, true);
      auto l_b = make_tensor(in, SPARSA_DTYPE_F32, l_shape, true);
      auto out = make_tensor(in, dtype, o_shape, false);
      auto out_lse = make_tensor(in, SPARSA_DTYPE_F32, l_shape, false);
      check(sparsa_merge_states(context.ctx, o_a->get(), l_a->get(), o_b->get(), l_b->get(), out->get(),
                                in.ConsumeBool() ? out_lse->get() : nullptr),
            {out.get(), out_lse.get()}, "merge");
      break;
    }
    case 5: {  // KV prefetch
      const int64_t B = in.ConsumeIntegralInRange<int64_t>(0, 2), N = in.ConsumeIntegralInRange<int64_t>(0, 32);
      const int64_t Hkv = in.ConsumeIntegralInRange<int64_t>(0, 2), D = in.ConsumeIntegralInRange<int64_t>(0, 8);
      const int64_t H_idx = in.ConsumeIntegralInRange<int64_t>(0, 3), k = in.ConsumeIntegralInRange<int64_t>(0, 8);
      const int64_t C = in.ConsumeIntegralInRange<int64_t>(0, 16);
      const int32_t dtype = float_dtype(in);
      auto k_src = make_tensor(in, dtype, {B, N, Hkv, D}, true);
      auto v_src = make_tensor(in, dtype, {B, N, Hkv, D}, true);
      auto ids = make_ids(in, {B, H_idx, k}, -1, int32_t(N));
      auto k_dst = make_tensor(in, dtype, {B, C, Hkv, D}, false);
      auto v_dst = make_tensor(in, dtype, {B, C, Hkv, D}, false);
      auto positions = make_tensor(in, SPARSA_DTYPE_I32, {B, C}, false);
      auto remapped = make_tensor(in, SPARSA_DTYPE_I32, {B, H_idx, k}, false);
      auto counts = make_tensor(in, SPARSA_DTYPE_I32, {B}, false);
      check(sparsa_kv_prefetch(context.ctx, k_src->get(), v_src->get(), ids->get(), k_dst->get(), v_dst->get(),
                               positions->get(), remapped->get(), in.ConsumeBool() ? counts->get() : nullptr),
            {k_dst.get(), v_dst.get(), positions.get(), remapped.get(), counts.get()}, "kv_prefetch");
      break;
    }
    case 6: {  // selection cache
      sparsa_selection_cache* cache = nullptr;
      const int32_t batch = sparsa_fuzz::interesting_int(in, 8), hq = sparsa_fuzz::interesting_int(in, 8);
      const int32_t hkv = sparsa_fuzz::interesting_int(in, 8), d = sparsa_fuzz::interesting_int(in, 64);
      const int32_t top_k = sparsa_fuzz::interesting_int(in, 64);
      // The cache allocates what it is asked for (documented): skip sizes that fit int64 but not this machine,
      // keep the ones whose size overflows (the library must refuse them).
      const __int128 bytes = __int128(batch) * (__int128(hq) * d * 8 + __int128(hkv) * top_k * 4);
      if (bytes > (__int128{64} << 20) && bytes <= INT64_MAX) break;
      const sparsa_status status = sparsa_selection_cache_create(context.ctx, batch, hq, hkv, d, top_k, &cache);
      sparsa_fuzz::expect_no_internal(status, "selection_cache_create");
      if (status == SPARSA_STATUS_SUCCESS) {
        int64_t hits = -1, misses = -1;
        sparsa_selection_cache_reset(cache);
        sparsa_selection_cache_counts(cache, &hits, &misses);
        if (hits != 0 || misses != 0) std::abort();
        sparsa_selection_cache_destroy(cache);
      }
      break;
    }
    case 7: {  // the tuner on a tiny problem, with fuzzed options
      const int64_t S = in.ConsumeIntegralInRange<int64_t>(0, 12), H = in.ConsumeIntegralInRange<int64_t>(1, 2);
      const int64_t D = in.ConsumeIntegralInRange<int64_t>(1, 4);
      auto q = make_tensor(in, SPARSA_DTYPE_F32, {1, S, H, D}, true);
      auto kv = make_tensor(in, SPARSA_DTYPE_F32, {1, S, H, D}, true);
      auto out = make_tensor(in, SPARSA_DTYPE_F32, {1, S, H, D}, false);
      auto params = make_tensor(in, SPARSA_DTYPE_F32, {H, 4}, false);
      auto metrics = make_tensor(in, SPARSA_DTYPE_F32, {H, 2}, false);
      sparsa_attention_args args;
      sparsa_attention_args_init(&args, sizeof args);
      args.q = q->get();
      args.k = kv->get();
      args.v = kv->get();
      args.out = out->get();
      args.causal = in.ConsumeBool();
      sparsa_policy p;
      sparsa_policy_init(&p, sizeof p, SPARSA_POLICY_SPARGE);
      p.block_q = in.ConsumeIntegralInRange<int32_t>(1, 8);
      p.block_k = in.ConsumeIntegralInRange<int32_t>(1, 8);
      sparsa_sparge_tune_options o;
      sparsa_sparge_tune_options_init(&o, sizeof o);
      o.l1 = sparsa_fuzz::interesting_float(in, 0.f, 0.5f);
      o.pv_l1 = sparsa_fuzz::interesting_float(in, 0.f, 0.5f);
      o.search_steps = in.ConsumeIntegralInRange<int>(0, 7) ? in.ConsumeIntegralInRange<int32_t>(1, 3)
                                                           : sparsa_fuzz::interesting_int(in, 3);
      o.dense_below = sparsa_fuzz::interesting_float(in, 0.f, 1.f);
      o.lambda_min = sparsa_fuzz::interesting_float(in, -30.f, 0.f);
      if (o.search_steps > 4) o.search_steps = in.ConsumeBool() ? 0 : -1;  // keep each input fast
      check(sparsa_sparge_tune(context.ctx, &args, &p, &o, params->get(), in.ConsumeBool() ? metrics->get() : nullptr),
            {params.get(), metrics.get()}, "sparge_tune");
      break;
    }
    case 8: {  // tensor descriptors
      sparsa_tensor t;
      std::vector<int64_t> shape(size_t(in.ConsumeIntegralInRange<int>(0, 9)));
      for (int64_t& e : shape) e = in.ConsumeBool() ? sparsa_fuzz::interesting_extent(in) : in.ConsumeIntegral<int64_t>();
      sparsa_fuzz::expect_no_internal(
          sparsa_tensor_init(&t, sizeof t, nullptr, in.ConsumeIntegralInRange<int32_t>(-1, 9), int32_t(shape.size()),
                             shape.empty() ? nullptr : shape.data()),
          "tensor_init");
      break;
    }
    default: {  // contexts: bounded num_threads (only small pools are actually started)
      static const int32_t kThreads[] = {-1, 0, 1, 2, 3, SPARSA_MAX_NUM_THREADS + 1, 100000, INT32_MAX};
      sparsa_context_options o;
      sparsa_context_options_init(&o, sizeof o);
      o.num_threads = in.PickValueInArray(kThreads);
      o.device_type = in.ConsumeIntegralInRange<int>(0, 15) ? SPARSA_DEVICE_CPU : in.ConsumeIntegral<int32_t>();
      sparsa_context* ctx = nullptr;
      const sparsa_status status = sparsa_context_create(&o, &ctx);
      sparsa_fuzz::expect_no_internal(status, "context_create");
      if ((status == SPARSA_STATUS_SUCCESS) != (o.num_threads >= 0 && o.num_threads <= SPARSA_MAX_NUM_THREADS &&
                                                 o.device_type == SPARSA_DEVICE_CPU)) {
        if (o.device_type == SPARSA_DEVICE_CPU) std::abort();
      }
      sparsa_context_destroy(ctx);
      break;
    }
  }
  return 0;
}
