// Test utilities: seeded generators of random and structured inputs, a small RAII layer over the C API, a
// backend-parameterised fixture, one run harness that lays a reference problem out in any supported layout (padded,
// varlen, paged, strided; f32/f16/bf16), poisons every output and checks it was written, and comparison helpers.
//
// Tolerances (documented once, used everywhere):
//   outputs: per-tensor relative error = max |o - ref| / max |ref| over the whole output; f32 <= 1e-5,
//            f16/bf16 <= 1e-2 against the reference computed on the dtype-rounded inputs.
//   LSE:     per element |lse - ref| <= tol * max(1, |ref|); -inf must match exactly.
//   selections (index sets, block masks): exact.
#pragma once

#include <gtest/gtest.h>
#include <sparsa/sparsa.h>

#include <cstdint>
#include <memory>
#include <random>
#include <string>
#include <tuple>
#include <vector>

#include "host_half.h"
#include "reference/reference.h"

namespace st {

constexpr double kTolF32 = 1e-5;
constexpr double kTolHalf = 1e-2;
double tolerance(int32_t dtype);

// ---------------------------------------------------------------------------------------------------------------
// Seeds: every case draws from a generator seeded by its full test name and a counter; the seed is printed on
// failure through SCOPED_TRACE.
struct Rng {
  explicit Rng(uint64_t s) : seed(s), gen(s) {}
  uint64_t seed;
  std::mt19937_64 gen;
  double normal() { return std::normal_distribution<double>(0.0, 1.0)(gen); }
  double uniform(double lo, double hi) { return std::uniform_real_distribution<double>(lo, hi)(gen); }
  int integer(int lo, int hi) { return std::uniform_int_distribution<int>(lo, hi)(gen); }  // inclusive
};
uint64_t test_seed(int counter);
#define ST_RNG(var, counter)                                                                            \
  const int var##_counter = (counter);                                                                  \
  ::st::Rng var(::st::test_seed(var##_counter));                                                        \
  SCOPED_TRACE(::testing::Message() << "rng seed " << var.seed << " (counter " << var##_counter << ")")

// ---------------------------------------------------------------------------------------------------------------
// Inputs. Random Q/K makes attention nearly uniform and hides selection bugs, so every policy is also run on
// structured inputs:
//   kSinks:   the first few keys match every query strongly (attention sinks);
//   kBand:    q_i·k_j peaks at |i + o - j| small (local attention), through sinusoidal position features;
//   kNeedles: each query row is planted on one random causal-allowed key (a strong match far from the diagonal).
enum class Pattern { kRandom, kSinks, kBand, kNeedles };
const char* pattern_name(Pattern p);
const std::vector<Pattern>& all_patterns();

ref::Problem make_problem(int B, int Hq, int Hkv, int D, std::vector<int> sq, std::vector<int> skv, bool causal);
void fill(ref::Problem& p, Pattern pattern, Rng& rng);
// The same problem with q/k/v rounded to dtype (the reference for f16/bf16 runs).
ref::Problem rounded(const ref::Problem& p, int32_t dtype);

// Host conversions (tests/host_half.h, shared with the GPU tests and the vector generator).
using host_half::bf16_to_float;
using host_half::f16_to_float;
using host_half::float_to_bf16;
using host_half::float_to_f16;
double round_to_dtype(double x, int32_t dtype);

// ---------------------------------------------------------------------------------------------------------------
// RAII over the C API.
class Context {
 public:
  // status() says whether creation worked; num_threads 0 = the test default.
  explicit Context(int32_t device_type, int num_threads = 0);
  ~Context() { sparsa_context_destroy(ctx_); }
  Context(const Context&) = delete;
  Context& operator=(const Context&) = delete;
  sparsa_context* get() const { return ctx_; }
  sparsa_status status() const { return status_; }
  int32_t device_type() const { return device_type_; }

 private:
  sparsa_context* ctx_ = nullptr;
  sparsa_status status_;
  int32_t device_type_;
};

class SelectionCache {
 public:
  SelectionCache(const Context& ctx, int max_batch, int hq, int hkv, int d, int max_top_k);
  ~SelectionCache() { sparsa_selection_cache_destroy(cache_); }
  SelectionCache(const SelectionCache&) = delete;
  SelectionCache& operator=(const SelectionCache&) = delete;
  sparsa_selection_cache* get() const { return cache_; }
  void counts(int64_t* hits, int64_t* misses) const;

 private:
  sparsa_selection_cache* cache_ = nullptr;
};

// A tensor whose host mirror the test fills and reads; tensor() describes it on the context's device.
// Device seam (the only place that knows about device memory): on CPU the host mirror *is* the tensor and
// upload()/download() do nothing. For a GPU context, upload() allocates device_data_ (same byte size) and copies
// the host mirror there, download() copies it back, the destructor frees it, and device_memory_supported() returns
// true for that device type; tensor() then points at device_data_. Utility tests that pass host pointers directly
// (host_tensor) stay CPU-only by design.
class Buffer {
 public:
  // strides empty = contiguous; otherwise in elements. The host mirror covers every element the strides can reach.
  Buffer(const Context& ctx, int32_t dtype, std::vector<int64_t> shape, std::vector<int64_t> strides = {});
  ~Buffer();
  Buffer(const Buffer&) = delete;
  Buffer& operator=(const Buffer&) = delete;
  sparsa_tensor tensor() const;
  void upload();
  void download();
  std::vector<uint8_t>& host() { return host_; }
  size_t elements() const { return host_.size() / elem_size_; }  // span of the storage, gaps included
  int32_t dtype() const { return dtype_; }
  const std::vector<int64_t>& shape() const { return shape_; }
  const std::vector<int64_t>& strides() const { return strides_; }
  // Typed access to storage element e (gaps included).
  double get(size_t e) const;
  void set(size_t e, double x);
  template <typename T>
  T* as() { return reinterpret_cast<T*>(host_.data()); }

 private:
  const Context& ctx_;
  int32_t dtype_;
  size_t elem_size_;
  std::vector<int64_t> shape_, strides_;
  std::vector<uint8_t> host_;
  void* device_data_ = nullptr;  // GPU contexts only (see the seam above)
};
// True when the backend's device memory can be filled by the seam above (CPU; CUDA when the library and the tests
// were built with it: SPARSA_TESTS_WITH_CUDA, set by tests/CMakeLists.txt).
bool device_memory_supported(int32_t device_type);

// Fills `t` for a host pointer (utilities that take host memory). CPU-only by design: a BackendTest that calls it
// is listed as not run on other backends in tests/expected_skips.cpp (skipped before its body runs); an unlisted
// instance on another backend that calls it fails.
sparsa_tensor host_tensor(void* data, int32_t dtype, std::vector<int64_t> shape);

// ---------------------------------------------------------------------------------------------------------------
// Backend-parameterised fixture: the same TEST_P runs on every backend; a backend whose context cannot be created
// (or whose device memory the seam cannot fill yet) is skipped, and so is a test that tests/expected_skips.cpp lists
// as not run on this backend (before its body runs).
// On a non-CPU backend a run answered SPARSA_STATUS_UNSUPPORTED (or a selection cache the backend cannot create)
// skips the test with the backend's reason: the fixture holds the test's assertion results back while it runs and,
// in TearDown, re-reports the failures that came before the first unsupported call and then skips (so the checks
// of a result that was never computed do not count as failures). Every skip must be listed with its reason in
// tests/expected_skips.cpp; the skip audit (tests/test_main.cpp) fails any other.
class UnsupportedFilter;
// What the fixture does for one backend (BackendTest: the parameter is the backend; BackendCaseTest: a backend and a
// row of a case table). set_up() may skip or fail; gtest then skips the body.
class BackendSetup {
 public:
  BackendSetup();
  ~BackendSetup();
  void set_up(int32_t backend);
  void tear_down();
  const Context& ctx() const { return *ctx_; }

 private:
  std::unique_ptr<Context> ctx_;
  std::unique_ptr<UnsupportedFilter> filter_;
};

class BackendTest : public ::testing::TestWithParam<int32_t> {
 protected:
  void SetUp() override { setup_.set_up(GetParam()); }
  void TearDown() override { setup_.tear_down(); }
  const Context& ctx() const { return setup_.ctx(); }

 private:
  BackendSetup setup_;
};

// A case table on every backend (ggml test-backend-ops style): one test per (row, backend), named
// "<row name>_<backend>"; Row has a `name`.
template <typename Row>
class BackendCaseTest : public ::testing::TestWithParam<std::tuple<int32_t, Row>> {
 protected:
  void SetUp() override { setup_.set_up(std::get<0>(this->GetParam())); }
  void TearDown() override { setup_.tear_down(); }
  const Context& ctx() const { return setup_.ctx(); }
  const Row& row() const { return std::get<1>(this->GetParam()); }

 private:
  BackendSetup setup_;
};

// Called by the harness when a non-CPU backend refuses a case; skips the current test (see BackendTest).
void skip_unsupported(const std::string& reason);
std::string backend_label(int32_t backend);  // "CPU", "CUDA", ...
std::string backend_name(const ::testing::TestParamInfo<int32_t>& info);
template <typename Row>
std::string backend_row_name(const ::testing::TestParamInfo<std::tuple<int32_t, Row>>& info) {
  return std::get<1>(info.param).name + "_" + backend_label(std::get<0>(info.param));
}

#define SPARSA_BACKEND_SUITE(Suite)                                                                      \
  class Suite : public ::st::BackendTest {};                                                              \
  INSTANTIATE_TEST_SUITE_P(Backends, Suite, ::testing::Values(SPARSA_DEVICE_CPU, SPARSA_DEVICE_CUDA), \
                           ::st::backend_name)

#define SPARSA_BACKEND_TABLE(Suite, Row, rows)                                                                 \
  class Suite : public ::st::BackendCaseTest<Row> {};                                                           \
  INSTANTIATE_TEST_SUITE_P(                                                                                     \
      Backends, Suite,                                                                                          \
      ::testing::Combine(::testing::Values(SPARSA_DEVICE_CPU, SPARSA_DEVICE_CUDA), ::testing::ValuesIn(rows)), \
      ::st::backend_row_name<Row>)

sparsa_policy make_policy(int32_t kind);
// sparsa_attention_args / sparsa_context_options filled by their init functions (every default).
sparsa_attention_args make_args();
sparsa_context_options make_context_options();

// ---------------------------------------------------------------------------------------------------------------
// The run harness.
enum class Layout { kPadded, kVarlen, kPaged };

struct RunOptions {
  int32_t dtype = SPARSA_DTYPE_F32;
  Layout layout = Layout::kPadded;
  bool q_packed = false;    // packed q/out with cu_seqlens_q (implied by kVarlen; combine with kPaged for ragged Sq)
  bool kv_packed = false;   // with kPadded: packed k/v with cu_seqlens_k, q as q_packed says (implied by kVarlen)
  int64_t kv_row_pad = 0;   // kPadded/kVarlen k/v: extra elements after each key row (rows off 16-byte boundaries)
  int64_t kv_head_pad = 0;  // kPadded/kVarlen k/v: extra elements after each head of a key row
  int page_size = 16;
  bool seq_lens_k = false;  // padded k/v with a seq_lens_k tensor (forced when key lengths differ)
  int64_t gap = 0;          // extra elements after each head, row and batch entry (strided, non-contiguous views)
  bool head_major = false;  // q/k/v/out stored head-major ([B, H, S, D] memory viewed as [B, S, H, D] by strides)
  bool lse = true;
  bool stats = true;
  int selected_sets = 0;    // H_sel of selected_indices; 0 = not requested
  int selected_cap = 0;
  bool block_mask_out = false;  // SPARGE introspection (policy.block_q / block_k)
  sparsa_selection_cache* cache = nullptr;
  // Inputs referenced by the policy.
  std::vector<uint8_t> block_mask;           // BLOCK_SPARSE [B, Hq, nqb, nkb]
  std::vector<float> sparge_head_params;     // [Hq, 4]
  std::vector<int32_t> indices;              // TOKEN_INDICES [B, h_idx, k]
  int h_idx = 0, k = 0;
  std::vector<int32_t> head_map;             // [Hq]
  uint64_t page_shuffle_seed = 1;
  bool plan_first = false;  // call sparsa_attention_plan before the run and record the scratch sizes
  // Outputs poisoned with a second set of patterns (other NaN payloads and sentinels), so that a result depending on
  // an output's earlier contents differs between runs; "not written" is judged by the same set.
  bool second_poison = false;
};

struct RunResult {
  sparsa_status status = SPARSA_STATUS_INTERNAL;
  std::string message;
  ref::Output out;                     // converted to double, per sequence (lse empty when not requested)
  std::vector<int64_t> stats;          // SPARSA_STAT_COUNT entries
  std::vector<int32_t> selected;       // [B, H_sel, cap]
  std::vector<uint8_t> block_mask;     // [B, Hq, nqb, nkb]
  std::vector<std::string> unwritten;  // outputs (or gaps) whose poison was left / overwritten wrongly
  bool untouched = true;               // every output still holds its poison exactly
  sparsa_status plan_status = SPARSA_STATUS_SUCCESS;
  uint64_t scratch_after_plan = 0, scratch_after_run = 0;  // with plan_first
};

RunResult run(const Context& ctx, const ref::Problem& p, const sparsa_policy& policy, const RunOptions& opt = {});
// Expects success and complete writes.
void expect_ok(const RunResult& r);
// run(), expect_ok(), then outputs (and LSE when requested and `want` has it) against `want` at the dtype's
// tolerance.
RunResult run_and_compare(const Context& ctx, const ref::Problem& p, const sparsa_policy& policy,
                          const ref::Output& want, const RunOptions& opt = {});

// ---------------------------------------------------------------------------------------------------------------
// Comparisons.
double relative_error(const ref::Output& got, const ref::Output& want, std::string* where = nullptr);
::testing::AssertionResult outputs_close(const ref::Output& got, const ref::Output& want, double tol);
::testing::AssertionResult lse_close(const ref::Output& got, const ref::Output& want, double tol);
// Compares selected_indices [B, H_sel, cap] with the reference sets exactly (sorted, -1 padded).
::testing::AssertionResult sets_equal(const std::vector<int32_t>& got, int cap,
                                      const std::vector<std::vector<ref::IndexSet>>& want);
::testing::AssertionResult masks_equal(const std::vector<uint8_t>& got, const std::vector<uint8_t>& want, int B,
                                       int H, int nqb, int nkb);
// Row (b, i, h) of `out` is exactly zero.
bool row_is_zero(const ref::Output& out, int b, int i, int h, int Hq, int D);

}  // namespace st
