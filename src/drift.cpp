// §5 drift-based layer selection: R_l = mean_t ‖h_out − h_in‖₂ / (‖h_in‖₂ + ε); sparse iff
// R_l <= quantile(R, δ) with numpy's default linear interpolation (NaN when some R_l is: then no layer is sparse).
// Host memory, any strides, F32/F16/BF16.
#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "host_utilities.h"
#include "tensor_util.h"
#include "validate.h"

namespace sparsa {
namespace {

constexpr double kNormEpsilon = 1e-8;  // ALGORITHMS.md §5

// numpy.quantile(values, q) with the default "linear" method; NaN when a value is NaN, as numpy's (and a NaN would
// break std::sort's ordering: it is not a strict weak order with NaN, and the sort may then read past the values).
double linear_quantile(std::vector<double> values, double q) {
  if (std::any_of(values.begin(), values.end(), [](double v) { return std::isnan(v); }))
    return std::numeric_limits<double>::quiet_NaN();
  std::sort(values.begin(), values.end());
  const double position = q * double(values.size() - 1);
  const size_t below = static_cast<size_t>(std::floor(position));
  const size_t above = std::min(below + 1, values.size() - 1);
  const double fraction = position - double(below);
  return values[below] + (values[above] - values[below]) * fraction;
}

}  // namespace

void drift_select_layers(const sparsa_tensor* h_in_t, const sparsa_tensor* h_out_t, float delta,
                         const sparsa_tensor* out_ratio_t, const sparsa_tensor* out_sparse_t) {
  const TensorArg h_in = read_tensor(h_in_t, "h_in", true);
  const TensorArg h_out = read_tensor(h_out_t, "h_out", true);
  const TensorArg out_ratio = read_tensor(out_ratio_t, "out_ratio", false);
  const TensorArg out_sparse = read_tensor(out_sparse_t, "out_sparse", false);
  expect_host(h_in, "h_in");
  expect_host(h_out, "h_out");
  if (out_ratio.present) expect_host(out_ratio, "out_ratio");
  if (out_sparse.present) expect_host(out_sparse, "out_sparse");
  if (!is_attention_dtype(h_in.t.dtype)) {
    fail(SPARSA_STATUS_DTYPE_MISMATCH, "h_in: dtype ", dtype_name(h_in.t.dtype), ", expected F32, F16 or BF16");
  }
  if (h_out.t.dtype != h_in.t.dtype) {
    fail(SPARSA_STATUS_DTYPE_MISMATCH, "h_out: dtype ", dtype_name(h_out.t.dtype), " but h_in is ",
         dtype_name(h_in.t.dtype));
  }
  if (out_ratio.present) expect_dtype(out_ratio, "out_ratio", SPARSA_DTYPE_F32);
  if (out_sparse.present) expect_dtype(out_sparse, "out_sparse", SPARSA_DTYPE_U8);
  expect_rank(h_in, "h_in", 3, "[L, T, D]");
  expect_shape(h_out, "h_out", {h_in.extent(0), h_in.extent(1), h_in.extent(2)}, "h_in's shape");
  const int64_t layers = h_in.extent(0), tokens = h_in.extent(1), dim = h_in.extent(2);
  if (layers < 1 || tokens < 1) {
    fail(SPARSA_STATUS_SHAPE_MISMATCH, "h_in: shape ", shape_string(h_in.t), ", expected L >= 1 and T >= 1");
  }
  if (out_ratio.present) expect_shape(out_ratio, "out_ratio", {layers}, "[L] from h_in");
  if (out_sparse.present) expect_shape(out_sparse, "out_sparse", {layers}, "[L] from h_in");
  if (out_ratio.present) expect_distinct_elements(out_ratio, "out_ratio");
  if (out_sparse.present) expect_distinct_elements(out_sparse, "out_sparse");
  if (!(delta >= 0.f && delta <= 1.f)) {
    fail(SPARSA_STATUS_INVALID_ARGUMENT, "delta: expected a quantile in [0, 1], got ", delta);
  }

  // With D = 0 every token's norms are 0, so every R_l is 0 / (0 + ε) = 0: the tokens are not walked (an empty
  // tensor may declare any T; fuzz_utilities found T = 2^32 + 1 taking a minute).
  std::vector<double> ratio(static_cast<size_t>(layers), 0.0);
  for (int64_t l = 0; l < layers && dim > 0; ++l) {
    double sum = 0.0;
    for (int64_t t = 0; t < tokens; ++t) {
      double diff_sq = 0.0, in_sq = 0.0;
      for (int64_t d = 0; d < dim; ++d) {
        const double in =
            load_float(h_in.t.dtype, h_in.t.data, l * h_in.stride(0) + t * h_in.stride(1) + d * h_in.stride(2));
        const double out =
            load_float(h_out.t.dtype, h_out.t.data, l * h_out.stride(0) + t * h_out.stride(1) + d * h_out.stride(2));
        diff_sq += (out - in) * (out - in);
        in_sq += in * in;
      }
      sum += std::sqrt(diff_sq) / (std::sqrt(in_sq) + kNormEpsilon);
    }
    ratio[size_t(l)] = sum / double(tokens);
  }
  const double threshold = linear_quantile(ratio, delta);

  for (int64_t l = 0; l < layers; ++l) {
    if (out_ratio.present) out_ratio.ptr<float>()[l * out_ratio.stride(0)] = float(ratio[size_t(l)]);
    if (out_sparse.present) out_sparse.ptr<uint8_t>()[l * out_sparse.stride(0)] = ratio[size_t(l)] <= threshold;
  }
}

}  // namespace sparsa
