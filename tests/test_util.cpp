// Test utilities; see test_util.h for what each piece is for and the tolerances.
#include "test_util.h"

#include "expected_skips.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <numeric>
#include <sstream>

#include <gtest/gtest-spi.h>

#ifdef SPARSA_TESTS_WITH_CUDA
#include <cuda_runtime.h>
#endif

namespace st {

namespace {

constexpr double kPi = 3.14159265358979323846;
// Poison patterns written into every output before a run; any survivor means "not written".
constexpr uint32_t kF32Poison = 0x7FC0DEADu;  // a quiet NaN
constexpr uint16_t kF16Poison = 0x7E5Au;      // a quiet NaN
constexpr uint16_t kBF16Poison = 0x7FDAu;     // a quiet NaN
constexpr int32_t kIndexPoison = 0x5A5A5A5A;
constexpr uint8_t kMaskPoison = 0xA5;
constexpr int64_t kStatPoison = -0x5A5A5A5A5A5A5A5ALL;
// RunOptions::second_poison: negative NaNs, a negative id, a mask byte that is neither 0 nor 1.
constexpr uint32_t kF32Poison2 = 0xFFABABABu;
constexpr uint16_t kF16Poison2 = 0xFEABu;
constexpr uint16_t kBF16Poison2 = 0xFFABu;
constexpr int32_t kIndexPoison2 = int32_t(0xABABABABu);
constexpr uint8_t kMaskPoison2 = 0xAB;
constexpr int64_t kStatPoison2 = int64_t(0xABABABABABABABABull);
// Finite garbage placed in in-bounds padding the library must not attend to (large enough to show if used).
constexpr double kPaddingGarbage = 300.0;
// CPU worker threads of test contexts (the machine is shared).
constexpr int kTestThreads = 2;
// Structured patterns: the scaled score of a planted match, and the number of sink keys / band frequencies.
constexpr double kPlantedScore = 10.0;
constexpr int kSinkKeys = 4;
constexpr int kBandFrequencies = 8;

uint64_t fnv1a(const std::string& s) {
  uint64_t h = 1469598103934665603ull;
  for (unsigned char c : s) {
    h ^= c;
    h *= 1099511628211ull;
  }
  return h;
}

std::vector<double> random_unit(Rng& rng, int D) {
  std::vector<double> u(D);
  double n = 0;
  for (double& x : u) {
    x = rng.normal();
    n += x * x;
  }
  for (double& x : u) x /= std::sqrt(n);
  return u;
}

int64_t storage_span(const std::vector<int64_t>& shape, const std::vector<int64_t>& strides) {
  int64_t last = 0;
  for (size_t i = 0; i < shape.size(); ++i) {
    if (shape[i] == 0) return 0;
    last += (shape[i] - 1) * strides[i];
  }
  return last + 1;
}

// Strides of an [outer..., H, D] view with `gap` extra elements after each head, row and outer entry.
// With `head_major`, the storage order of an [outer..., S, H, D] view swaps S and H (the head axis, second to last,
// becomes outer to the token axis), which a caller gets from a [B, H, S, D] tensor.
std::vector<int64_t> gapped_strides(const std::vector<int64_t>& shape, int64_t gap, bool head_major = false) {
  std::vector<size_t> order(shape.size());  // dims from innermost to outermost
  for (size_t i = 0; i < shape.size(); ++i) order[i] = shape.size() - 1 - i;
  if (head_major && shape.size() >= 3) std::swap(order[1], order[2]);
  std::vector<int64_t> strides(shape.size());
  int64_t s = 1;
  for (size_t dim : order) {
    strides[dim] = s;
    s = s * shape[dim] + gap;
  }
  return strides;
}

}  // namespace

double tolerance(int32_t dtype) { return dtype == SPARSA_DTYPE_F32 ? kTolF32 : kTolHalf; }

uint64_t test_seed(int counter) {
  const ::testing::TestInfo* info = ::testing::UnitTest::GetInstance()->current_test_info();
  std::string name = info ? std::string(info->test_suite_name()) + "." + info->name() : "no-test";
  return fnv1a(name + "#" + std::to_string(counter));
}

// ------------------------------------------------------------------------------------------------------ inputs
const char* pattern_name(Pattern p) {
  switch (p) {
    case Pattern::kRandom: return "random";
    case Pattern::kSinks: return "sinks";
    case Pattern::kBand: return "band";
    case Pattern::kNeedles: return "needles";
  }
  return "?";
}

const std::vector<Pattern>& all_patterns() {
  static const std::vector<Pattern> patterns = {Pattern::kRandom, Pattern::kSinks, Pattern::kBand, Pattern::kNeedles};
  return patterns;
}

ref::Problem make_problem(int B, int Hq, int Hkv, int D, std::vector<int> sq, std::vector<int> skv, bool causal) {
  ref::Problem p;
  p.B = B;
  p.Hq = Hq;
  p.Hkv = Hkv;
  p.D = D;
  p.sq = std::move(sq);
  p.skv = std::move(skv);
  if (int(p.sq.size()) == 1 && B > 1) p.sq.assign(B, p.sq[0]);
  if (int(p.skv.size()) == 1 && B > 1) p.skv.assign(B, p.skv[0]);
  p.causal = causal;
  p.allocate();
  return p;
}

void fill(ref::Problem& p, Pattern pattern, Rng& rng) {
  const int D = p.D;
  const double planted = kPlantedScore * std::sqrt(double(D));  // unscaled dot product of a planted match
  for (int b = 0; b < p.B; ++b) {
    for (double& x : p.q[b]) x = rng.normal();
    for (double& x : p.k[b]) x = rng.normal();
    for (double& x : p.v[b]) x = rng.normal();
    const int sq = p.sq[b], skv = p.skv[b], o = skv - sq;
    if (pattern == Pattern::kSinks) {
      for (int kh = 0; kh < p.Hkv; ++kh) {
        const std::vector<double> u = random_unit(rng, D);
        const double c = std::sqrt(planted);
        for (int j = 0; j < std::min(kSinkKeys, skv); ++j)
          for (int d = 0; d < D; ++d) p.k[b][(size_t(j) * p.Hkv + kh) * D + d] += c * u[d];
        for (int i = 0; i < sq; ++i)
          for (int h = kh * p.group(); h < (kh + 1) * p.group(); ++h)
            for (int d = 0; d < D; ++d) p.q[b][(size_t(i) * p.Hq + h) * D + d] += c * u[d];
      }
    } else if (pattern == Pattern::kBand) {
      const double amplitude = std::sqrt(planted / kBandFrequencies);
      const int features = std::min(kBandFrequencies, D / 2);
      for (int f = 0; f < features; ++f) {
        const double omega = kPi / (2.0 + 3.0 * f);
        for (int i = 0; i < sq; ++i)
          for (int h = 0; h < p.Hq; ++h) {
            double* q = &p.q[b][(size_t(i) * p.Hq + h) * D];
            q[2 * f] = amplitude * std::cos(omega * (i + o));
            q[2 * f + 1] = amplitude * std::sin(omega * (i + o));
          }
        for (int j = 0; j < skv; ++j)
          for (int kh = 0; kh < p.Hkv; ++kh) {
            double* k = &p.k[b][(size_t(j) * p.Hkv + kh) * D];
            k[2 * f] = amplitude * std::cos(omega * j);
            k[2 * f + 1] = amplitude * std::sin(omega * j);
          }
      }
    } else if (pattern == Pattern::kNeedles) {
      for (int i = 0; i < sq; ++i)
        for (int h = 0; h < p.Hq; ++h) {
          const int last = p.causal ? std::min(skv - 1, i + o) : skv - 1;
          if (last < 0) continue;
          const int j = rng.integer(0, last);
          const double* k = p.k_row(b, j, h / p.group());
          const double beta = planted / ref::dot(k, k, D);
          double* q = &p.q[b][(size_t(i) * p.Hq + h) * D];
          for (int d = 0; d < D; ++d) q[d] = 0.3 * q[d] + beta * k[d];
        }
    }
  }
}

ref::Problem rounded(const ref::Problem& p, int32_t dtype) {
  ref::Problem r = p;
  for (auto* t : {&r.q, &r.k, &r.v})
    for (auto& rows : *t)
      for (double& x : rows) x = round_to_dtype(x, dtype);
  return r;
}

double round_to_dtype(double x, int32_t dtype) {
  switch (dtype) {
    case SPARSA_DTYPE_F16: return f16_to_float(float_to_f16(float(x)));
    case SPARSA_DTYPE_BF16: return bf16_to_float(float_to_bf16(float(x)));
    case SPARSA_DTYPE_F32: return float(x);
    default: return x;
  }
}

// ------------------------------------------------------------------------------------------------------ C API
Context::Context(int32_t device_type, int num_threads) : device_type_(device_type) {
  sparsa_context_options options;
  sparsa_context_options_init(&options, sizeof options);
  options.device_type = device_type;
  options.num_threads = num_threads > 0 ? num_threads : kTestThreads;
  status_ = sparsa_context_create(&options, &ctx_);
}

SelectionCache::SelectionCache(const Context& ctx, int max_batch, int hq, int hkv, int d, int max_top_k) {
  const sparsa_status s = sparsa_selection_cache_create(ctx.get(), max_batch, hq, hkv, d, max_top_k, &cache_);
  if (s == SPARSA_STATUS_UNSUPPORTED && ctx.device_type() != SPARSA_DEVICE_CPU) {
    skip_unsupported(sparsa_last_error_message());
    return;
  }
  EXPECT_EQ(s, SPARSA_STATUS_SUCCESS) << sparsa_last_error_message();
}

void SelectionCache::counts(int64_t* hits, int64_t* misses) const {
  EXPECT_EQ(sparsa_selection_cache_counts(cache_, hits, misses), SPARSA_STATUS_SUCCESS) << sparsa_last_error_message();
}

Buffer::Buffer(const Context& ctx, int32_t dtype, std::vector<int64_t> shape, std::vector<int64_t> strides)
    : ctx_(ctx), dtype_(dtype), elem_size_(sparsa_dtype_size(dtype)), shape_(std::move(shape)) {
  strides_ = strides.empty() ? gapped_strides(shape_, 0) : std::move(strides);
  // At least one element, so that an empty tensor still has a non-null data pointer.
  host_.assign(size_t(std::max<int64_t>(1, storage_span(shape_, strides_))) * elem_size_, 0);
}

sparsa_tensor Buffer::tensor() const {
  sparsa_tensor t;
  void* data = device_data_ ? device_data_ : const_cast<uint8_t*>(host_.data());
  EXPECT_EQ(sparsa_tensor_init(&t, sizeof t, data, dtype_, int32_t(shape_.size()), shape_.data()),
            SPARSA_STATUS_SUCCESS);
  for (size_t i = 0; i < strides_.size(); ++i) t.strides[i] = strides_[i];
  t.device_type = ctx_.device_type() == SPARSA_DEVICE_CPU ? SPARSA_DEVICE_CPU : ctx_.device_type();
  return t;
}

// Device seam: CPU tensors are the host mirror itself; CUDA tensors get a cudaMalloc'd copy (synchronous copies:
// the library runs on the default stream of the test's contexts, so a copy after the run sees its results).
#ifdef SPARSA_TESTS_WITH_CUDA
namespace {
void check_cuda(cudaError_t status, const char* call) {
  if (status != cudaSuccess) ADD_FAILURE() << call << " failed: " << cudaGetErrorString(status);
}
}  // namespace

Buffer::~Buffer() {
  if (device_data_ != nullptr) check_cuda(cudaFree(device_data_), "cudaFree");
}
void Buffer::upload() {
  if (ctx_.device_type() != SPARSA_DEVICE_CUDA) return;
  if (device_data_ == nullptr) check_cuda(cudaMalloc(&device_data_, host_.size()), "cudaMalloc");
  if (device_data_ != nullptr)
    check_cuda(cudaMemcpy(device_data_, host_.data(), host_.size(), cudaMemcpyHostToDevice), "cudaMemcpy (upload)");
}
void Buffer::download() {
  if (device_data_ == nullptr) return;
  check_cuda(cudaDeviceSynchronize(), "cudaDeviceSynchronize");
  check_cuda(cudaMemcpy(host_.data(), device_data_, host_.size(), cudaMemcpyDeviceToHost), "cudaMemcpy (download)");
}
bool device_memory_supported(int32_t device_type) {
  return device_type == SPARSA_DEVICE_CPU || device_type == SPARSA_DEVICE_CUDA;
}
#else
Buffer::~Buffer() {}
void Buffer::upload() {}
void Buffer::download() {}
bool device_memory_supported(int32_t device_type) { return device_type == SPARSA_DEVICE_CPU; }
#endif

double Buffer::get(size_t e) const {
  const uint8_t* at = host_.data() + e * elem_size_;
  switch (dtype_) {
    case SPARSA_DTYPE_F32: { float x; std::memcpy(&x, at, 4); return x; }
    case SPARSA_DTYPE_F64: { double x; std::memcpy(&x, at, 8); return x; }
    case SPARSA_DTYPE_F16: { uint16_t x; std::memcpy(&x, at, 2); return f16_to_float(x); }
    case SPARSA_DTYPE_BF16: { uint16_t x; std::memcpy(&x, at, 2); return bf16_to_float(x); }
    case SPARSA_DTYPE_I32: { int32_t x; std::memcpy(&x, at, 4); return x; }
    case SPARSA_DTYPE_I64: { int64_t x; std::memcpy(&x, at, 8); return double(x); }
    case SPARSA_DTYPE_U8: return *at;
    default: return 0;
  }
}

void Buffer::set(size_t e, double x) {
  uint8_t* at = host_.data() + e * elem_size_;
  switch (dtype_) {
    case SPARSA_DTYPE_F32: { const float y = float(x); std::memcpy(at, &y, 4); break; }
    case SPARSA_DTYPE_F64: std::memcpy(at, &x, 8); break;
    case SPARSA_DTYPE_F16: { const uint16_t y = float_to_f16(float(x)); std::memcpy(at, &y, 2); break; }
    case SPARSA_DTYPE_BF16: { const uint16_t y = float_to_bf16(float(x)); std::memcpy(at, &y, 2); break; }
    case SPARSA_DTYPE_I32: { const int32_t y = int32_t(x); std::memcpy(at, &y, 4); break; }
    case SPARSA_DTYPE_I64: { const int64_t y = int64_t(x); std::memcpy(at, &y, 8); break; }
    case SPARSA_DTYPE_U8: *at = uint8_t(x); break;
    default: break;
  }
}

namespace {
// Set by host_tensor(): a test that hands host memory to a context is CPU-only by design (test_util.h); BackendTest
// fails a non-CPU instance that sets it (the listed ones never run there). Per thread, like gtest's own state.
thread_local bool host_memory_used = false;
}  // namespace

sparsa_tensor host_tensor(void* data, int32_t dtype, std::vector<int64_t> shape) {
  host_memory_used = true;
  sparsa_tensor t;
  EXPECT_EQ(sparsa_tensor_init(&t, sizeof t, data, dtype, int32_t(shape.size()), shape.data()), SPARSA_STATUS_SUCCESS);
  return t;
}

// Holds a non-CPU test's assertion results back (see BackendTest in test_util.h).
class UnsupportedFilter : public ::testing::ScopedFakeTestPartResultReporter {
 public:
  UnsupportedFilter()
      : ::testing::ScopedFakeTestPartResultReporter(INTERCEPT_ONLY_CURRENT_THREAD, &results_) {}
  const ::testing::TestPartResultArray& results() const { return results_; }

 private:
  ::testing::TestPartResultArray results_;
};

BackendSetup::BackendSetup() = default;
BackendSetup::~BackendSetup() = default;

void BackendSetup::set_up(int32_t backend) {
  // The CPU backend too: a property of device memory has no CPU instance (tests/expected_skips.cpp).
  const ExpectedSkip* by_design = not_run_here(test_id(*::testing::UnitTest::GetInstance()->current_test_info()));
  if (by_design != nullptr) GTEST_SKIP() << by_design->reason << ": " << by_design->why;
  ctx_ = std::make_unique<Context>(backend);
  if (backend == SPARSA_DEVICE_CPU) {
    ASSERT_EQ(ctx_->status(), SPARSA_STATUS_SUCCESS) << sparsa_last_error_message();
    return;
  }
  if (ctx_->status() != SPARSA_STATUS_SUCCESS) GTEST_SKIP() << "no context for this backend: " << sparsa_last_error_message();
  if (!device_memory_supported(backend)) GTEST_SKIP() << "test device-memory seam not wired for this backend yet";
  filter_ = std::make_unique<UnsupportedFilter>();
  host_memory_used = false;
}

void BackendSetup::tear_down() {
  if (!filter_) return;
  ::testing::TestPartResultArray held;
  for (int i = 0; i < filter_->results().size(); ++i) held.Append(filter_->results().GetTestPartResult(i));
  filter_.reset();  // restores the real reporter
  // Failures are re-reported before any skip: a skip ends TearDown, and whatever it left unreported would be lost.
  for (int i = 0; i < held.size(); ++i) {
    const ::testing::TestPartResult& r = held.GetTestPartResult(i);
    if (r.skipped()) GTEST_SKIP() << r.message();
    if (r.failed()) {
      ADD_FAILURE_AT(r.file_name() ? r.file_name() : "unknown", r.line_number()) << r.message();
    }
  }
  if (host_memory_used) {
    ADD_FAILURE() << "passes host memory (host_tensor) to a non-CPU context: use st::Buffer, or list the test as "
                     "CPU-only in tests/expected_skips.cpp";
  }
}

void skip_unsupported(const std::string& reason) { GTEST_SKIP() << "unsupported on this backend: " << reason; }

std::string backend_name(const ::testing::TestParamInfo<int32_t>& info) { return backend_label(info.param); }

std::string backend_label(int32_t backend) {
  switch (backend) {
    case SPARSA_DEVICE_CPU: return "CPU";
    case SPARSA_DEVICE_CUDA: return "CUDA";
    case SPARSA_DEVICE_ROCM: return "ROCM";
    default: return "device" + std::to_string(backend);
  }
}

sparsa_policy make_policy(int32_t kind) {
  sparsa_policy p;
  EXPECT_EQ(sparsa_policy_init(&p, sizeof p, kind), SPARSA_STATUS_SUCCESS);
  return p;
}

sparsa_attention_args make_args() {
  sparsa_attention_args args;
  EXPECT_EQ(sparsa_attention_args_init(&args, sizeof args), SPARSA_STATUS_SUCCESS);
  return args;
}

sparsa_context_options make_context_options() {
  sparsa_context_options options;
  EXPECT_EQ(sparsa_context_options_init(&options, sizeof options), SPARSA_STATUS_SUCCESS);
  return options;
}

// ------------------------------------------------------------------------------------------------------ harness
namespace {

// Storage offsets of a [B, S, H, D] (padded) or [T, H, D] (packed) attention tensor.
struct AttentionView {
  bool packed = false;
  std::vector<int> row_offset;  // packed: first row of each sequence
  std::unique_ptr<Buffer> buf;
  size_t at(int b, int i, int h, int d) const {
    const auto& s = buf->strides();
    if (packed) return size_t((row_offset[b] + i) * s[0] + h * s[1] + d);
    return size_t(b * s[0] + i * s[1] + h * s[2] + d);
  }
};

AttentionView make_view(const Context& ctx, int32_t dtype, bool packed, const std::vector<int>& lens, int padded_len,
                        int H, int D, int64_t gap, bool head_major, int64_t row_pad = 0, int64_t head_pad = 0) {
  AttentionView v;
  v.packed = packed;
  std::vector<int64_t> shape;
  if (packed) {
    v.row_offset.assign(lens.size() + 1, 0);
    std::partial_sum(lens.begin(), lens.end(), v.row_offset.begin() + 1);
    shape = {v.row_offset.back(), H, D};
  } else {
    shape = {int64_t(lens.size()), padded_len, H, D};
  }
  std::vector<int64_t> strides = gapped_strides(shape, gap, head_major);
  if (row_pad > 0 || head_pad > 0) {  // heads, then rows (tokens) further apart; gap 0, token-major storage only
    EXPECT_TRUE(gap == 0 && !head_major) << "row_pad and head_pad combine with neither gap nor head_major";
    const int64_t head_stride = D + head_pad, row_stride = H * head_stride + row_pad;
    if (packed) {
      strides = {row_stride, head_stride, 1};
    } else {
      strides = {row_stride * padded_len, row_stride, head_stride, 1};
    }
  }
  v.buf = std::make_unique<Buffer>(ctx, dtype, shape, strides);
  return v;
}

// The bytes of the dtype's poison (NaN for floats) in the first or the second set; null for other dtypes.
const void* poison_of(int32_t dtype, bool second) {
  switch (dtype) {
    case SPARSA_DTYPE_F32: return second ? &kF32Poison2 : &kF32Poison;
    case SPARSA_DTYPE_F16: return second ? &kF16Poison2 : &kF16Poison;
    case SPARSA_DTYPE_BF16: return second ? &kBF16Poison2 : &kBF16Poison;
    case SPARSA_DTYPE_I32: return second ? &kIndexPoison2 : &kIndexPoison;
    case SPARSA_DTYPE_I64: return second ? &kStatPoison2 : &kStatPoison;
    case SPARSA_DTYPE_U8: return second ? &kMaskPoison2 : &kMaskPoison;
    default: return nullptr;
  }
}

// Sets every storage element of `buf` to the dtype's poison.
void poison(Buffer& buf, bool second = false) {
  const void* pattern = poison_of(buf.dtype(), second);
  if (pattern == nullptr) return;
  const size_t size = sparsa_dtype_size(buf.dtype());
  for (size_t e = 0; e < buf.elements(); ++e) std::memcpy(buf.host().data() + e * size, pattern, size);
}

bool is_poison(const Buffer& buf, size_t e, bool second = false) {
  const void* pattern = poison_of(buf.dtype(), second);
  const size_t size = sparsa_dtype_size(buf.dtype());
  return pattern != nullptr && std::memcmp(const_cast<Buffer&>(buf).host().data() + e * size, pattern, size) == 0;
}

bool all_poison(const Buffer& buf, bool second = false) {
  for (size_t e = 0; e < buf.elements(); ++e)
    if (!is_poison(buf, e, second)) return false;
  return true;
}

}  // namespace

RunResult run(const Context& ctx, const ref::Problem& p, const sparsa_policy& policy_in, const RunOptions& opt) {
  RunResult r;
  const bool q_packed = opt.q_packed || opt.layout == Layout::kVarlen;
  const int B = p.B, Hq = p.Hq, Hkv = p.Hkv, D = p.D, sq_max = p.max_sq(), skv_max = p.max_skv();
  if (!q_packed && std::any_of(p.sq.begin(), p.sq.end(), [&](int s) { return s != sq_max; }))
    ADD_FAILURE() << "padded q needs equal query lengths; use Layout::kVarlen";
  const bool ragged_k = std::any_of(p.skv.begin(), p.skv.end(), [&](int s) { return s != skv_max; });

  // Inputs, with NaN in every stride gap (never to be read) and finite garbage in in-bounds padding.
  AttentionView q = make_view(ctx, opt.dtype, q_packed, p.sq, sq_max, Hq, D, opt.gap, opt.head_major);
  poison(*q.buf);
  for (int b = 0; b < B; ++b)
    for (int i = 0; i < p.sq[b]; ++i)
      for (int h = 0; h < Hq; ++h)
        for (int d = 0; d < D; ++d) q.buf->set(q.at(b, i, h, d), p.q_row(b, i, h)[d]);

  std::unique_ptr<Buffer> k_buf, v_buf, cu_q, cu_k, page_table, seq_lens;
  std::vector<int32_t> page_of;  // paged: page id of (b, page)
  int max_pages = 0;
  AttentionView kv_view[2];
  if (opt.layout == Layout::kPaged) {
    const int ps = opt.page_size;
    for (int b = 0; b < B; ++b) max_pages = std::max(max_pages, (p.skv[b] + ps - 1) / ps);
    int needed = 0;
    for (int b = 0; b < B; ++b) needed += (p.skv[b] + ps - 1) / ps;
    const int spare = 2, P = needed + spare;
    std::vector<int32_t> order(P);
    std::iota(order.begin(), order.end(), 0);
    std::shuffle(order.begin(), order.end(), std::mt19937_64(opt.page_shuffle_seed));
    page_table = std::make_unique<Buffer>(ctx, SPARSA_DTYPE_I32, std::vector<int64_t>{B, max_pages + 1});
    int next = 0;
    for (int b = 0; b < B; ++b)
      for (int pg = 0; pg <= max_pages; ++pg) {
        const bool used = pg < (p.skv[b] + ps - 1) / ps;
        page_table->as<int32_t>()[b * (max_pages + 1) + pg] = used ? order[next++] : order[P - 1];
      }
    std::vector<int64_t> shape = {P, ps, Hkv, D};
    k_buf = std::make_unique<Buffer>(ctx, opt.dtype, shape, gapped_strides(shape, opt.gap, opt.head_major));
    v_buf = std::make_unique<Buffer>(ctx, opt.dtype, shape, gapped_strides(shape, opt.gap, opt.head_major));
    for (Buffer* buf : {k_buf.get(), v_buf.get()}) {
      poison(*buf);
      const auto& s = buf->strides();
      for (int64_t pg = 0; pg < P; ++pg)
        for (int t = 0; t < ps; ++t)
          for (int h = 0; h < Hkv; ++h)
            for (int d = 0; d < D; ++d) buf->set(size_t(pg * s[0] + t * s[1] + h * s[2] + d), kPaddingGarbage);
      for (int b = 0; b < B; ++b)
        for (int j = 0; j < p.skv[b]; ++j) {
          const int64_t pg = page_table->as<int32_t>()[b * (max_pages + 1) + j / ps];
          for (int h = 0; h < Hkv; ++h)
            for (int d = 0; d < D; ++d) {
              const size_t e = size_t(pg * s[0] + (j % ps) * s[1] + h * s[2] + d);
              buf->set(e, buf == k_buf.get() ? p.k_row(b, j, h)[d] : p.v_row(b, j, h)[d]);
            }
        }
    }
  } else {
    const bool packed = opt.layout == Layout::kVarlen || opt.kv_packed;
    for (int which = 0; which < 2; ++which) {
      kv_view[which] =
          make_view(ctx, opt.dtype, packed, p.skv, skv_max, Hkv, D, opt.gap, opt.head_major, opt.kv_row_pad,
                    opt.kv_head_pad);
      Buffer& buf = *kv_view[which].buf;
      poison(buf);
      for (int b = 0; b < B; ++b)
        for (int j = 0; j < (packed ? p.skv[b] : skv_max); ++j)
          for (int h = 0; h < Hkv; ++h)
            for (int d = 0; d < D; ++d) {
              const double x = j >= p.skv[b] ? kPaddingGarbage : which == 0 ? p.k_row(b, j, h)[d] : p.v_row(b, j, h)[d];
              buf.set(kv_view[which].at(b, j, h, d), x);
            }
    }
    if (packed) {
      cu_k = std::make_unique<Buffer>(ctx, SPARSA_DTYPE_I32, std::vector<int64_t>{B + 1});
      for (int b = 0; b <= B; ++b) cu_k->as<int32_t>()[b] = kv_view[0].row_offset[b];
    }
  }
  if (q_packed) {
    cu_q = std::make_unique<Buffer>(ctx, SPARSA_DTYPE_I32, std::vector<int64_t>{B + 1});
    for (int b = 0; b <= B; ++b) cu_q->as<int32_t>()[b] = q.row_offset[b];
  }
  if (opt.layout == Layout::kPaged ||
      (opt.layout == Layout::kPadded && !opt.kv_packed && (opt.seq_lens_k || ragged_k))) {
    seq_lens = std::make_unique<Buffer>(ctx, SPARSA_DTYPE_I32, std::vector<int64_t>{B});
    for (int b = 0; b < B; ++b) seq_lens->as<int32_t>()[b] = p.skv[b];
  }
  std::unique_ptr<Buffer> query_offsets;
  if (!p.query_offset.empty()) {
    query_offsets = std::make_unique<Buffer>(ctx, SPARSA_DTYPE_I32, std::vector<int64_t>{B});
    std::copy(p.query_offset.begin(), p.query_offset.end(), query_offsets->as<int32_t>());
  }

  // Outputs, poisoned.
  AttentionView out = make_view(ctx, opt.dtype, q_packed, p.sq, sq_max, Hq, D, opt.gap, opt.head_major);
  poison(*out.buf, opt.second_poison);
  std::unique_ptr<Buffer> lse, stats, selected, mask_out;
  if (opt.lse) {
    const std::vector<int64_t> shape = q_packed ? std::vector<int64_t>{Hq, q.row_offset.back()}
                                                : std::vector<int64_t>{B, Hq, sq_max};
    lse = std::make_unique<Buffer>(ctx, SPARSA_DTYPE_F32, shape);
    poison(*lse, opt.second_poison);
  }
  if (opt.stats) {
    stats = std::make_unique<Buffer>(ctx, SPARSA_DTYPE_I64, std::vector<int64_t>{SPARSA_STAT_COUNT});
    poison(*stats, opt.second_poison);
  }
  if (opt.selected_sets > 0) {
    selected = std::make_unique<Buffer>(ctx, SPARSA_DTYPE_I32,
                                        std::vector<int64_t>{B, opt.selected_sets, opt.selected_cap});
    poison(*selected, opt.second_poison);
  }
  const int nqb = (sq_max + policy_in.block_q - 1) / std::max(1, policy_in.block_q);
  const int nkb = (skv_max + policy_in.block_k - 1) / std::max(1, policy_in.block_k);
  if (opt.block_mask_out) {
    mask_out = std::make_unique<Buffer>(ctx, SPARSA_DTYPE_U8, std::vector<int64_t>{B, Hq, nqb, nkb});
    poison(*mask_out, opt.second_poison);
  }

  // Policy inputs.
  sparsa_policy policy = policy_in;
  std::unique_ptr<Buffer> mask_in, head_params, indices, head_map;
  sparsa_tensor mask_t, head_params_t, indices_t, head_map_t;
  if (!opt.block_mask.empty()) {
    mask_in = std::make_unique<Buffer>(ctx, SPARSA_DTYPE_U8, std::vector<int64_t>{B, Hq, nqb, nkb});
    std::copy(opt.block_mask.begin(), opt.block_mask.end(), mask_in->host().begin());
    mask_in->upload();  // tensor() points at device memory only once it exists
    mask_t = mask_in->tensor();
    policy.block_mask = &mask_t;
  }
  if (!opt.sparge_head_params.empty()) {
    head_params = std::make_unique<Buffer>(ctx, SPARSA_DTYPE_F32, std::vector<int64_t>{Hq, 4});
    std::copy(opt.sparge_head_params.begin(), opt.sparge_head_params.end(), head_params->as<float>());
    head_params->upload();  // tensor() points at device memory only once it exists
    head_params_t = head_params->tensor();
    policy.sparge_head_params = &head_params_t;
  }
  if (!opt.indices.empty()) {
    indices = std::make_unique<Buffer>(ctx, SPARSA_DTYPE_I32, std::vector<int64_t>{B, opt.h_idx, opt.k});
    std::copy(opt.indices.begin(), opt.indices.end(), indices->as<int32_t>());
    indices->upload();  // tensor() points at device memory only once it exists
    indices_t = indices->tensor();
    policy.indices = &indices_t;
  }
  if (!opt.head_map.empty()) {
    head_map = std::make_unique<Buffer>(ctx, SPARSA_DTYPE_I32, std::vector<int64_t>{Hq});
    std::copy(opt.head_map.begin(), opt.head_map.end(), head_map->as<int32_t>());
    head_map->upload();  // tensor() points at device memory only once it exists
    head_map_t = head_map->tensor();
    policy.head_map = &head_map_t;
  }

  // Arguments.
  Buffer* all[] = {q.buf.get(), k_buf ? k_buf.get() : kv_view[0].buf.get(), v_buf ? v_buf.get() : kv_view[1].buf.get(),
                   out.buf.get(), lse.get(), stats.get(), selected.get(), mask_out.get(), cu_q.get(), cu_k.get(),
                   page_table.get(), seq_lens.get(), mask_in.get(), head_params.get(), indices.get(), head_map.get(),
                   query_offsets.get()};
  for (Buffer* b : all)
    if (b) b->upload();
  sparsa_tensor t[13];
  auto describe = [&](int slot, Buffer* b) -> const sparsa_tensor* {
    if (!b) return nullptr;
    t[slot] = b->tensor();
    return &t[slot];
  };
  sparsa_attention_args args;
  sparsa_attention_args_init(&args, sizeof args);
  args.q = describe(0, all[0]);
  args.k = describe(1, all[1]);
  args.v = describe(2, all[2]);
  args.out = describe(3, all[3]);
  args.lse = describe(4, lse.get());
  args.stats = describe(5, stats.get());
  args.selected_indices = describe(6, selected.get());
  args.block_mask_out = describe(7, mask_out.get());
  args.cu_seqlens_q = describe(8, cu_q.get());
  args.cu_seqlens_k = describe(9, cu_k.get());
  args.page_table = describe(10, page_table.get());
  args.seq_lens_k = describe(11, seq_lens.get());
  args.query_offsets = describe(12, query_offsets.get());
  args.causal = p.causal ? 1 : 0;
  args.softmax_scale = float(p.scale);
  args.selection_cache = opt.cache;

  if (opt.plan_first) {
    r.plan_status = sparsa_attention_plan(ctx.get(), &args, &policy);
    if (r.plan_status == SPARSA_STATUS_UNSUPPORTED && ctx.device_type() != SPARSA_DEVICE_CPU)
      skip_unsupported(sparsa_last_error_message());
    EXPECT_EQ(r.plan_status, SPARSA_STATUS_SUCCESS) << sparsa_last_error_message();
    sparsa_context_scratch_bytes(ctx.get(), &r.scratch_after_plan);
    for (Buffer* b : {out.buf.get(), lse.get(), stats.get(), selected.get(), mask_out.get()})
      if (b && !all_poison(*b, opt.second_poison)) ADD_FAILURE() << "sparsa_attention_plan wrote an output";
  }
  r.status = sparsa_attention_run(ctx.get(), &args, &policy);
  r.message = sparsa_last_error_message();
  if (r.status == SPARSA_STATUS_UNSUPPORTED && ctx.device_type() != SPARSA_DEVICE_CPU) {
    // The test is skipped (BackendTest), but its body runs on: give it zero-filled results of the right sizes so
    // that reading them is safe (its checks are discarded).
    skip_unsupported(r.message);
    r.out.o.resize(B);
    r.out.lse.resize(B);
    for (int b = 0; b < B; ++b) {
      r.out.o[b].assign(size_t(p.sq[b]) * Hq * D, 0);
      r.out.lse[b].assign(size_t(Hq) * p.sq[b], 0);
    }
    r.stats.assign(SPARSA_STAT_COUNT, 0);
    r.selected.assign(size_t(B) * std::max(1, opt.selected_sets) * std::max(1, opt.selected_cap), -1);
    r.block_mask.assign(size_t(B) * Hq * nqb * nkb, 0);
    return r;
  }
  if (opt.plan_first) sparsa_context_scratch_bytes(ctx.get(), &r.scratch_after_run);
  for (Buffer* b : {out.buf.get(), lse.get(), stats.get(), selected.get(), mask_out.get()})
    if (b) b->download();

  // Which outputs were written (every element in view) and left alone (stride gaps).
  std::vector<uint8_t> in_view(out.buf->elements(), 0);
  for (int b = 0; b < B; ++b)
    for (int i = 0; i < (q_packed ? p.sq[b] : sq_max); ++i)
      for (int h = 0; h < Hq; ++h)
        for (int d = 0; d < D; ++d) in_view[out.at(b, i, h, d)] = 1;
  for (Buffer* b : {out.buf.get(), lse.get(), stats.get(), selected.get(), mask_out.get()})
    if (b && !all_poison(*b, opt.second_poison)) r.untouched = false;
  if (r.status != SPARSA_STATUS_SUCCESS) return r;

  size_t unwritten = 0, gap_written = 0;
  for (size_t e = 0; e < in_view.size(); ++e) {
    if (in_view[e] && is_poison(*out.buf, e, opt.second_poison)) ++unwritten;
    if (!in_view[e] && !is_poison(*out.buf, e, opt.second_poison)) ++gap_written;
  }
  if (unwritten) r.unwritten.push_back("out: " + std::to_string(unwritten) + " elements not written");
  if (gap_written) r.unwritten.push_back("out: " + std::to_string(gap_written) + " stride-gap elements written");
  for (auto [name, buf] : {std::pair<const char*, Buffer*>{"lse", lse.get()}, {"stats", stats.get()},
                           {"selected_indices", selected.get()}, {"block_mask_out", mask_out.get()}}) {
    if (!buf) continue;
    size_t n = 0;
    for (size_t e = 0; e < buf->elements(); ++e) n += is_poison(*buf, e, opt.second_poison);
    if (n) r.unwritten.push_back(std::string(name) + ": " + std::to_string(n) + " elements not written");
  }

  // Back to the reference layout.
  r.out.o.resize(B);
  r.out.lse.resize(B);
  for (int b = 0; b < B; ++b) {
    r.out.o[b].assign(size_t(p.sq[b]) * Hq * D, 0);
    for (int i = 0; i < p.sq[b]; ++i)
      for (int h = 0; h < Hq; ++h)
        for (int d = 0; d < D; ++d) r.out.o[b][(size_t(i) * Hq + h) * D + d] = out.buf->get(out.at(b, i, h, d));
    if (lse) {
      r.out.lse[b].assign(size_t(Hq) * p.sq[b], 0);
      for (int h = 0; h < Hq; ++h)
        for (int i = 0; i < p.sq[b]; ++i)
          r.out.lse[b][size_t(h) * p.sq[b] + i] =
              q_packed ? lse->get(size_t(h) * q.row_offset.back() + q.row_offset[b] + i)
                       : lse->get((size_t(b) * Hq + h) * sq_max + i);
    }
  }
  if (stats) r.stats.assign(stats->as<int64_t>(), stats->as<int64_t>() + SPARSA_STAT_COUNT);
  if (selected) r.selected.assign(selected->as<int32_t>(), selected->as<int32_t>() + selected->elements());
  if (mask_out) r.block_mask.assign(mask_out->host().begin(), mask_out->host().end());
  return r;
}

void expect_ok(const RunResult& r) {
  ASSERT_EQ(r.status, SPARSA_STATUS_SUCCESS) << sparsa_status_string(r.status) << ": " << r.message;
  for (const auto& s : r.unwritten) ADD_FAILURE() << s;
}

RunResult run_and_compare(const Context& ctx, const ref::Problem& p, const sparsa_policy& policy,
                          const ref::Output& want, const RunOptions& opt) {
  RunResult r = run(ctx, p, policy, opt);
  expect_ok(r);
  if (r.status != SPARSA_STATUS_SUCCESS) return r;
  EXPECT_TRUE(outputs_close(r.out, want, tolerance(opt.dtype)));
  if (opt.lse && !want.lse.empty() && !want.lse[0].empty()) {
    EXPECT_TRUE(lse_close(r.out, want, tolerance(opt.dtype)));
  }
  return r;
}

// ------------------------------------------------------------------------------------------------------ compare
double relative_error(const ref::Output& got, const ref::Output& want, std::string* where) {
  double max_ref = 0, max_diff = 0;
  for (size_t b = 0; b < want.o.size(); ++b)
    for (size_t e = 0; e < want.o[b].size(); ++e) {
      max_ref = std::max(max_ref, std::fabs(want.o[b][e]));
      const double diff = std::fabs(got.o[b][e] - want.o[b][e]);
      if (!(diff <= max_diff)) {  // NaN counts as the worst
        max_diff = std::isnan(diff) ? std::numeric_limits<double>::infinity() : diff;
        if (where) {
          std::ostringstream s;
          s << "b=" << b << " flat=" << e << " got " << got.o[b][e] << " want " << want.o[b][e];
          *where = s.str();
        }
      }
    }
  return max_ref > 0 ? max_diff / max_ref : max_diff;
}

::testing::AssertionResult outputs_close(const ref::Output& got, const ref::Output& want, double tol) {
  if (got.o.size() != want.o.size()) return ::testing::AssertionFailure() << "batch size differs";
  for (size_t b = 0; b < want.o.size(); ++b)
    if (got.o[b].size() != want.o[b].size()) return ::testing::AssertionFailure() << "sequence " << b << " size differs";
  std::string where;
  const double err = relative_error(got, want, &where);
  if (err <= tol) return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure() << "relative error " << err << " > " << tol << " (worst at " << where << ")";
}

::testing::AssertionResult lse_close(const ref::Output& got, const ref::Output& want, double tol) {
  for (size_t b = 0; b < want.lse.size(); ++b) {
    if (got.lse.size() <= b || got.lse[b].size() != want.lse[b].size())
      return ::testing::AssertionFailure() << "lse of sequence " << b << " missing or of the wrong size";
    for (size_t e = 0; e < want.lse[b].size(); ++e) {
      const double g = got.lse[b][e], w = want.lse[b][e];
      const bool ok = std::isinf(w) ? g == w : std::fabs(g - w) <= tol * std::max(1.0, std::fabs(w));
      if (!ok) return ::testing::AssertionFailure() << "lse b=" << b << " [h*sq+i]=" << e << ": got " << g << " want " << w;
    }
  }
  return ::testing::AssertionSuccess();
}

::testing::AssertionResult sets_equal(const std::vector<int32_t>& got, int cap,
                                      const std::vector<std::vector<ref::IndexSet>>& want) {
  for (size_t b = 0; b < want.size(); ++b)
    for (size_t h = 0; h < want[b].size(); ++h) {
      const int32_t* row = got.data() + (b * want[b].size() + h) * cap;
      std::vector<int32_t> expected(want[b][h].begin(), want[b][h].end());
      expected.resize(cap, -1);
      for (int c = 0; c < cap; ++c)
        if (row[c] != expected[c]) {
          std::ostringstream s;
          s << "selected b=" << b << " set=" << h << " slot " << c << ": got " << row[c] << " want " << expected[c]
            << " (reference set size " << want[b][h].size() << "; got:";
          for (int x = 0; x < std::min(cap, 40); ++x) s << " " << row[x];
          s << (cap > 40 ? " ...)" : ")");
          return ::testing::AssertionFailure() << s.str();
        }
    }
  return ::testing::AssertionSuccess();
}

::testing::AssertionResult masks_equal(const std::vector<uint8_t>& got, const std::vector<uint8_t>& want, int B,
                                       int H, int nqb, int nkb) {
  if (got.size() != want.size()) return ::testing::AssertionFailure() << "mask sizes differ";
  int mismatches = 0;
  std::ostringstream s;
  for (int b = 0; b < B; ++b)
    for (int h = 0; h < H; ++h)
      for (int I = 0; I < nqb; ++I)
        for (int J = 0; J < nkb; ++J) {
          const size_t e = ((size_t(b) * H + h) * nqb + I) * nkb + J;
          if (got[e] != want[e] && mismatches++ < 8)
            s << " [b=" << b << " h=" << h << " I=" << I << " J=" << J << " got " << int(got[e]) << " want "
              << int(want[e]) << "]";
        }
  if (!mismatches) return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure() << mismatches << " mask entries differ:" << s.str();
}

bool row_is_zero(const ref::Output& out, int b, int i, int h, int Hq, int D) {
  for (int d = 0; d < D; ++d)
    if (out.o[b][(size_t(i) * Hq + h) * D + d] != 0.0) return false;
  return true;
}

}  // namespace st
