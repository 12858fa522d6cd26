// §4 SpargeAttn tuner (after the official autotune.py), per query head, on one calibration call.
//
// Heads are independent under SPARGE (each predicts its own mask from its own parameters), so every head is tuned
// at once: each backend run carries per-head parameters through policy.sparge_head_params (a host buffer owned
// here) and each head reads its own relative L1 from the output and its own sparsity from the predicted block mask.
//   1. one DENSE run (the reference O);
//   2. for each theta in {-1 + 2i/16}: bisect tau in (0, 1] for relative L1 < l1, remembering per head the passing
//      setting of largest sparsity;
//   3. for each head's best (theta, tau): bisect lambda in [lambda_min, 0) for relative L1 < pv_l1 (the largest
//      passing lambda skips the most PV products);
//   4. a head whose best sparsity is <= dense_below goes dense (theta = 1, tau = 1, lambda = -inf).
// The backend runs through the same validation and supports() path as sparsa_attention_run.
#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "handles.h"
#include "host_utilities.h"
#include "tensor_util.h"
#include "validate.h"

namespace sparsa {
namespace {

constexpr int kThetaSteps = 16;     // theta ∈ {-1 + 2i/16, i = 0..16}
constexpr int kHeadParamCount = 4;  // (theta, tau, topk_fraction, lambda) per head
constexpr int kMetricCount = 2;     // (relative L1, sparsity) per head
constexpr float kNoPvSkip = -std::numeric_limits<float>::infinity();

// Per-head parameters of the best setting found so far.
struct HeadChoice {
  bool found = false;
  float theta = 1.f, tau = 1.f, lambda = kNoPvSkip;
  double l1 = 0.0, sparsity = 0.0;
};

// A host buffer with a tensor descriptor over it (contiguous). Its shape comes from the caller's tensors (q's, for
// the tuner's own output), whose element count validation bounds but whose contiguous size it does not (q may
// broadcast with zero strides, and an empty q may have huge other extents): sizes are computed with overflow
// detection, and a buffer that would not fit is SHAPE_MISMATCH (one that fits but cannot be allocated,
// OUT_OF_MEMORY).
struct OwnedTensor {
  std::vector<unsigned char> bytes;
  sparsa_tensor t{};
  OwnedTensor(int32_t dtype, const ShapeSpec& shape, const char* what) {
    t.struct_size = sizeof(sparsa_tensor);
    t.dtype = dtype;
    t.device_type = SPARSA_DEVICE_CPU;
    t.ndim = shape.rank;
    for (int i = 0; i < t.ndim; ++i) t.shape[i] = shape.dims[i];
    int64_t elements = 0, buffer_bytes = 0;
    if (!checked_element_count(t, &elements) ||
        __builtin_mul_overflow(elements, static_cast<int64_t>(dtype_size(dtype)), &buffer_bytes)) {
      fail(SPARSA_STATUS_SHAPE_MISMATCH, what, ": a contiguous buffer of shape ", shape_string(t.shape, t.ndim),
           " would need more than INT64_MAX bytes");
    }
    bytes.assign(static_cast<size_t>(buffer_bytes) + 1, 0);  // +1: never a NULL data pointer
    t.data = bytes.data();
    // Row-major strides; an empty tensor's may not fit int64 and are never used: 0 then.
    int64_t stride = elements > 0 ? 1 : 0;
    for (int i = t.ndim - 1; i >= 0; --i) {
      t.strides[i] = stride;
      if (elements > 0) stride *= shape.dims[i];  // a suffix product of a count that fits
    }
  }
};

sparsa_sparge_tune_options resolve_options(const sparsa_sparge_tune_options* in) {
  const sparsa_sparge_tune_options defaults = default_sparge_tune_options();
  const sparsa_sparge_tune_options o =
      in ? read_caller_struct(*in, "options", defaults) : defaults;
  if (!(o.l1 > 0.f) || !std::isfinite(o.l1)) {
    fail(SPARSA_STATUS_INVALID_ARGUMENT, "options.l1: expected a finite value > 0, got ", o.l1);
  }
  if (!(o.pv_l1 >= o.l1) || !std::isfinite(o.pv_l1)) {
    fail(SPARSA_STATUS_INVALID_ARGUMENT, "options.pv_l1: expected a finite value >= l1 = ", o.l1, ", got ", o.pv_l1);
  }
  if (o.search_steps < 1) {
    fail(SPARSA_STATUS_INVALID_ARGUMENT, "options.search_steps: expected >= 1, got ", o.search_steps);
  }
  if (!(o.dense_below >= 0.f && o.dense_below <= 1.f)) {
    fail(SPARSA_STATUS_INVALID_ARGUMENT, "options.dense_below: expected a sparsity in [0, 1], got ", o.dense_below);
  }
  if (!(o.lambda_min < 0.f) || !std::isfinite(o.lambda_min)) {
    fail(SPARSA_STATUS_INVALID_ARGUMENT, "options.lambda_min: expected a finite value < 0, got ", o.lambda_min);
  }
  return o;
}

// Query·key pairs of sequence b that the mask's kept tiles compute, and that dense attention computes.
struct PairCounts {
  int64_t computed = 0, dense = 0;
};

int64_t visible_keys_in(int64_t row, int64_t key_begin, int64_t key_end, bool causal, int64_t offset) {
  const int64_t last = causal ? std::min(key_end, row + offset + 1) : key_end;
  return std::max<int64_t>(0, last - key_begin);
}

PairCounts count_pairs(const AttentionProblem& pr, const sparsa_policy& p, const TensorArg& mask, int32_t b,
                       int32_t h) {
  PairCounts c;
  const int64_t sq = pr.seq_len_q(b), skv = pr.seq_len_k(b), offset = pr.causal_offset(b);
  for (int64_t i = 0; i < sq; ++i) c.dense += visible_keys_in(i, 0, skv, pr.causal, offset);
  const uint8_t* m = mask.ptr<const uint8_t>();  // indexed by offsets: an empty mask may have no data
  const int64_t head = b * mask.stride(0) + h * mask.stride(1);
  for (int64_t qb = 0; qb * p.block_q < sq; ++qb) {
    for (int64_t kb = 0; kb * p.block_k < skv; ++kb) {
      if (!m[head + qb * mask.stride(2) + kb * mask.stride(3)]) continue;
      const int64_t key_begin = kb * p.block_k, key_end = std::min<int64_t>(skv, key_begin + p.block_k);
      const int64_t row_end = std::min<int64_t>(sq, (qb + 1) * p.block_q);
      for (int64_t i = qb * p.block_q; i < row_end; ++i) {
        c.computed += visible_keys_in(i, key_begin, key_end, pr.causal, offset);
      }
    }
  }
  return c;
}

// Runs the backend after the shared supports() check.
void run_backend(Backend& backend, const AttentionProblem& pr, const PolicyParams& pp) {
  std::string reason;
  if (!backend.supports(pr, pp, &reason)) {
    fail(SPARSA_STATUS_UNSUPPORTED, "the ", backend.name(), " backend cannot run the tuner's ",
         sparsa_policy_kind_name(pp.p.kind), " calibration: ", reason);
  }
  backend.run(pr, pp);
}

// The calibration call: one problem, a reference output and per-head measurements of a candidate setting.
class Calibration {
 public:
  Calibration(const AttentionProblem& pr, const OwnedTensor& out, const std::vector<float>& reference)
      : pr_(pr), out_(out), reference_(reference) {}

  // Relative L1 Σ|O' − O| / Σ|O| of head h over every row of the output.
  std::vector<double> relative_l1() const {
    const int64_t heads = pr_.num_q_heads, d = pr_.head_dim;
    const int64_t rows = static_cast<int64_t>(reference_.size()) / (heads * d);
    std::vector<double> diff(size_t(heads), 0.0), norm(size_t(heads), 0.0);
    for (int64_t r = 0; r < rows; ++r) {
      for (int64_t h = 0; h < heads; ++h) {
        for (int64_t e = 0; e < d; ++e) {
          const int64_t at = (r * heads + h) * d + e;
          const double o = reference_[size_t(at)];
          diff[size_t(h)] += std::fabs(load_float(pr_.dtype, out_.t.data, at) - o);
          norm[size_t(h)] += std::fabs(o);
        }
      }
    }
    for (int64_t h = 0; h < heads; ++h) diff[size_t(h)] = norm[size_t(h)] > 0 ? diff[size_t(h)] / norm[size_t(h)] : 0;
    return diff;
  }

  // Achieved sparsity 1 − computed/dense of head h, from the predicted block mask.
  std::vector<double> sparsity(const sparsa_policy& p, const TensorArg& mask) const {
    std::vector<double> result(size_t(pr_.num_q_heads), 0.0);
    for (int32_t h = 0; h < pr_.num_q_heads; ++h) {
      PairCounts total;
      for (int32_t b = 0; b < pr_.batch; ++b) {
        const PairCounts c = count_pairs(pr_, p, mask, b, h);
        total.computed += c.computed;
        total.dense += c.dense;
      }
      result[size_t(h)] = total.dense > 0 ? 1.0 - double(total.computed) / double(total.dense) : 0.0;
    }
    return result;
  }

 private:
  const AttentionProblem& pr_;
  const OwnedTensor& out_;
  const std::vector<float>& reference_;
};

}  // namespace

void sparge_tune(sparsa_context& ctx, const sparsa_attention_args* args_in, const sparsa_policy* policy_in,
                 const sparsa_sparge_tune_options* options_in, const sparsa_tensor* out_params_t,
                 const sparsa_tensor* out_metrics_t) {
  if (args_in == nullptr) fail(SPARSA_STATUS_NULL_POINTER, "args: NULL");
  const sparsa_sparge_tune_options options = resolve_options(options_in);
  sparsa_attention_args args = read_caller_struct(*args_in, "args", default_attention_args());
  const sparsa_policy caller_policy =
      policy_in ? read_caller_struct(*policy_in, "policy", default_policy(SPARSA_POLICY_SPARGE))
                : default_policy(SPARSA_POLICY_SPARGE);
  if (ctx.options.device_type != SPARSA_DEVICE_CPU) {
    fail(SPARSA_STATUS_UNSUPPORTED, "sparsa_sparge_tune: the tuner measures outputs on the host and runs on CPU ",
         "contexts only for now; tune on a CPU context and pass the parameters to the GPU run");
  }

  // The tuner's own outputs: `out` in q's shape and dtype, and SPARGE's block mask; the caller's are not read.
  const TensorArg q = read_tensor(args.q, "q", true);
  if (!is_attention_dtype(q.t.dtype)) {
    fail(SPARSA_STATUS_DTYPE_MISMATCH, "q: dtype ", dtype_name(q.t.dtype), ", expected F32, F16 or BF16");
  }
  OwnedTensor out(q.t.dtype, ShapeSpec::of(q.t), "sparsa_sparge_tune's output (q's shape)");
  args.out = &out.t;
  args.lse = nullptr;
  args.selected_indices = nullptr;
  args.block_mask_out = nullptr;
  args.stats = nullptr;
  args.selection_cache = nullptr;

  // 1. Dense reference (validates the call's tensors).
  const sparsa_policy dense_policy = default_policy(SPARSA_POLICY_DENSE);
  AttentionProblem dense_problem;
  PolicyParams dense_params;
  validate_attention(ctx, &args, &dense_policy, &dense_problem, &dense_params);
  const int32_t heads = dense_problem.num_q_heads;

  sparsa_policy tune_policy = default_policy(SPARSA_POLICY_SPARGE);
  tune_policy.block_q = caller_policy.block_q;
  tune_policy.block_k = caller_policy.block_k;
  tune_policy.sparge_attention_sink = caller_policy.sparge_attention_sink;
  tune_policy.sparge_quantized = caller_policy.sparge_quantized;
  OwnedTensor head_params(SPARSA_DTYPE_F32, {heads, kHeadParamCount}, "sparsa_sparge_tune's head parameters");
  OwnedTensor mask(SPARSA_DTYPE_U8,
                   {dense_problem.batch, heads, ceil_div(dense_problem.max_seq_q, std::max(1, tune_policy.block_q)),
                    ceil_div(dense_problem.max_seq_k, std::max(1, tune_policy.block_k))},
                   "sparsa_sparge_tune's block mask");
  tune_policy.sparge_head_params = &head_params.t;
  args.block_mask_out = &mask.t;
  float* hp = reinterpret_cast<float*>(head_params.t.data);
  auto set_head = [&](int32_t h, float theta, float tau, float lambda) {
    hp[h * kHeadParamCount + 0] = theta;
    hp[h * kHeadParamCount + 1] = tau;
    hp[h * kHeadParamCount + 2] = 0.f;  // TopCdf, not the top-k variant
    hp[h * kHeadParamCount + 3] = lambda;
  };
  for (int32_t h = 0; h < heads; ++h) set_head(h, 1.f, 1.f, kNoPvSkip);
  AttentionProblem problem;
  PolicyParams params;
  validate_attention(ctx, &args, &tune_policy, &problem, &params);

  // Caller's outputs, checked before any compute so that a bad one fails fast and writes nothing.
  const TensorArg out_params = read_tensor(out_params_t, "out_params", true);
  const TensorArg out_metrics = read_tensor(out_metrics_t, "out_metrics", false);
  expect_host(out_params, "out_params");
  expect_dtype(out_params, "out_params", SPARSA_DTYPE_F32);
  expect_shape(out_params, "out_params", {heads, kHeadParamCount}, "[Hq, 4]: theta, tau, topk_fraction, lambda");
  expect_distinct_elements(out_params, "out_params");
  if (out_metrics.present) {
    expect_host(out_metrics, "out_metrics");
    expect_dtype(out_metrics, "out_metrics", SPARSA_DTYPE_F32);
    expect_shape(out_metrics, "out_metrics", {heads, kMetricCount}, "[Hq, 2]: relative L1, sparsity");
    expect_distinct_elements(out_metrics, "out_metrics");
  }

  Backend& backend = *ctx.backend;
  run_backend(backend, dense_problem, dense_params);
  const int64_t out_elements = element_count(out.t);
  std::vector<float> reference(static_cast<size_t>(out_elements));
  for (int64_t i = 0; i < out_elements; ++i) reference[size_t(i)] = load_float(out.t.dtype, out.t.data, i);
  const Calibration calibration(problem, out, reference);
  std::vector<HeadChoice> best(static_cast<size_t>(heads));

  // 2. theta sweep × tau bisection, every head at once.
  for (int i = 0; i <= kThetaSteps; ++i) {
    const float theta = -1.f + 2.f * float(i) / float(kThetaSteps);
    std::vector<float> lo(size_t(heads), 0.f), hi(size_t(heads), 1.f);
    for (int step = 0; step < options.search_steps; ++step) {
      for (int32_t h = 0; h < heads; ++h) set_head(h, theta, 0.5f * (lo[size_t(h)] + hi[size_t(h)]), kNoPvSkip);
      run_backend(backend, problem, params);
      const std::vector<double> l1 = calibration.relative_l1();
      const std::vector<double> sparsity = calibration.sparsity(tune_policy, problem.block_mask_out);
      for (int32_t h = 0; h < heads; ++h) {
        const size_t k = size_t(h);
        const float tau = hp[h * kHeadParamCount + 1];
        if (l1[k] < options.l1) {
          hi[k] = tau;  // passes: try a smaller mass (sparser)
          if (!best[k].found || sparsity[k] > best[k].sparsity)
            best[k] = {true, theta, tau, kNoPvSkip, l1[k], sparsity[k]};
        } else {
          lo[k] = tau;
        }
      }
    }
  }

  // 3. lambda bisection on each head's best setting (heads going dense keep PV skip off).
  std::vector<float> lo(size_t(heads), options.lambda_min), hi(size_t(heads), 0.f);
  std::vector<uint8_t> tuned(static_cast<size_t>(heads), uint8_t{0});
  for (int32_t h = 0; h < heads; ++h)
    tuned[size_t(h)] = best[size_t(h)].found && best[size_t(h)].sparsity > options.dense_below;
  for (int step = 0; step < options.search_steps; ++step) {
    for (int32_t h = 0; h < heads; ++h) {
      const HeadChoice& c = best[size_t(h)];
      if (tuned[size_t(h)])
        set_head(h, c.theta, c.tau, 0.5f * (lo[size_t(h)] + hi[size_t(h)]));
      else
        set_head(h, 1.f, 1.f, kNoPvSkip);
    }
    run_backend(backend, problem, params);
    const std::vector<double> l1 = calibration.relative_l1();
    for (int32_t h = 0; h < heads; ++h) {
      const size_t k = size_t(h);
      if (!tuned[k]) continue;
      const float lambda = hp[h * kHeadParamCount + 3];
      if (l1[k] < options.pv_l1) {
        lo[k] = lambda;  // passes: try skipping more
        best[k].lambda = lambda;
        best[k].l1 = l1[k];
      } else {
        hi[k] = lambda;
      }
    }
  }

  // 4. Write the result.
  float* params_out = out_params.ptr<float>();
  for (int32_t h = 0; h < heads; ++h) {
    const HeadChoice& c = best[size_t(h)];
    const bool sparse = tuned[size_t(h)] != 0;
    const float values[kHeadParamCount] = {sparse ? c.theta : 1.f, sparse ? c.tau : 1.f, 0.f,
                                           sparse ? c.lambda : kNoPvSkip};
    for (int j = 0; j < kHeadParamCount; ++j)
      params_out[h * out_params.stride(0) + j * out_params.stride(1)] = values[j];
    if (out_metrics.present) {
      float* metrics = out_metrics.ptr<float>() + h * out_metrics.stride(0);
      metrics[0] = sparse ? float(c.l1) : 0.f;
      metrics[out_metrics.stride(1)] = sparse ? float(c.sparsity) : 0.f;
    }
  }
}

}  // namespace sparsa
