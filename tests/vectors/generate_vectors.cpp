// generate_vectors — writes the shared test vectors every binding runs (format: FORMAT.md beside this file).
//
//   generate_vectors <dir>          writes one <case>.spv per case into <dir>
//   generate_vectors --check <dir>  regenerates every case in memory and fails (exit 1) if a file in <dir> differs,
//                                   is missing, or is a .spv this program no longer writes
//
// Only the public C API is used, on the CPU backend. Inputs come from a fixed-seed generator and take values
// k/128 (|k| <= 128), which F32, F16 and BF16 all represent exactly, so a case reads the same in every dtype.
#include <sparsa/sparsa.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <limits>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "../host_half.h"

namespace {

constexpr char kMagic[8] = {'S', 'P', 'A', 'R', 'S', 'A', 'V', '1'};
constexpr uint8_t kPoisonByte = 0xA5;  // every expected output is produced over (and compared against) this fill
constexpr uint64_t kSeed = 0x5EED5A25A0000001ull;
constexpr int32_t kValueSteps = 128;  // inputs are k / kValueSteps, exact in F32, F16 and BF16
constexpr const char* kExtension = ".spv";

enum EntryType : uint8_t { kTensorEntry = 1, kI64Entry = 2, kF64Entry = 3, kStringEntry = 4 };

// ---- Deterministic inputs --------------------------------------------------------------------------------------

// splitmix64: tiny, portable and identical on every platform.
class Rng {
 public:
  explicit Rng(uint64_t seed) : state_(seed) {}
  uint64_t next() {
    uint64_t z = (state_ += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
  }
  int64_t below(int64_t n) { return int64_t(next() % uint64_t(n)); }  // in [0, n)
  // A value k / kValueSteps with |k| <= amplitude_steps.
  float value(int32_t amplitude_steps = kValueSteps) {
    return float(below(2 * amplitude_steps + 1) - amplitude_steps) / float(kValueSteps);
  }

 private:
  uint64_t state_;
};

// Round-to-nearest-even conversions (the tests' one converter); inputs here are exact in both formats, so rounding
// never happens in practice.
using host_half::float_to_bf16;
using host_half::float_to_f16;

// ---- Tensors ---------------------------------------------------------------------------------------------------

struct Tensor {
  int32_t dtype = SPARSA_DTYPE_INVALID;
  std::vector<int64_t> shape;
  std::vector<uint8_t> bytes;

  int64_t numel() const {
    int64_t n = 1;
    for (int64_t extent : shape) n *= extent;
    return n;
  }
  // A contiguous CPU descriptor over this tensor's bytes (valid while the tensor lives and is not resized).
  sparsa_tensor view() {
    sparsa_tensor t;
    const sparsa_status status =
        sparsa_tensor_init(&t, sizeof t, bytes.data(), dtype, int32_t(shape.size()), shape.data());
    if (status != SPARSA_STATUS_SUCCESS) throw std::runtime_error("sparsa_tensor_init failed");
    return t;
  }
  template <typename T>
  T* as() { return reinterpret_cast<T*>(bytes.data()); }
};

Tensor filled(int32_t dtype, std::vector<int64_t> shape, uint8_t byte) {
  Tensor t{dtype, std::move(shape), {}};
  t.bytes.assign(size_t(t.numel()) * sparsa_dtype_size(dtype), byte);
  return t;
}
Tensor poisoned(int32_t dtype, std::vector<int64_t> shape) { return filled(dtype, std::move(shape), kPoisonByte); }

Tensor from_floats(int32_t dtype, std::vector<int64_t> shape, const std::vector<float>& values) {
  Tensor t = filled(dtype, std::move(shape), 0);
  for (size_t i = 0; i < values.size(); ++i) {
    switch (dtype) {
      case SPARSA_DTYPE_F32: t.as<float>()[i] = values[i]; break;
      case SPARSA_DTYPE_F16: t.as<uint16_t>()[i] = float_to_f16(values[i]); break;
      case SPARSA_DTYPE_BF16: t.as<uint16_t>()[i] = float_to_bf16(values[i]); break;
      default: throw std::runtime_error("from_floats: not a float dtype");
    }
  }
  return t;
}

Tensor random_floats(Rng& rng, int32_t dtype, std::vector<int64_t> shape) {
  int64_t n = 1;
  for (int64_t extent : shape) n *= extent;
  std::vector<float> values(static_cast<size_t>(n));
  for (float& x : values) x = rng.value();
  return from_floats(dtype, std::move(shape), values);
}

// [.., S, H, D] rows built from a few shared directions plus small noise, so consecutive tokens form self-similar
// blocks (SPARGE's prediction then has something to keep and something to drop).
Tensor clustered_floats(Rng& rng, int32_t dtype, std::vector<int64_t> shape, int64_t tokens_per_cluster) {
  const int64_t d = shape.back(), h = shape[shape.size() - 2], s = shape[shape.size() - 3];
  const int64_t outer = Tensor{dtype, shape, {}}.numel() / (s * h * d);
  constexpr int32_t kNoiseSteps = 16;  // noise amplitude 1/8 against directions of amplitude 1
  std::vector<float> values;
  for (int64_t o = 0; o < outer; ++o) {
    std::vector<float> direction(size_t(h * d));
    for (int64_t t = 0; t < s; ++t) {
      if (t % tokens_per_cluster == 0)
        for (float& x : direction) x = rng.value();
      for (int64_t i = 0; i < h * d; ++i)
        values.push_back(std::clamp(direction[size_t(i)] + rng.value(kNoiseSteps), -1.f, 1.f));
    }
  }
  return from_floats(dtype, std::move(shape), values);
}

Tensor from_i32(std::vector<int64_t> shape, const std::vector<int32_t>& values) {
  Tensor t = filled(SPARSA_DTYPE_I32, std::move(shape), 0);
  if (int64_t(values.size()) != t.numel()) throw std::runtime_error("from_i32: value count differs from shape");
  std::memcpy(t.bytes.data(), values.data(), t.bytes.size());
  return t;
}

// ---- The file writer -------------------------------------------------------------------------------------------

class VectorFile {
 public:
  void add_string(const std::string& name, const std::string& value) {
    header(name, kStringEntry);
    put<uint32_t>(uint32_t(value.size()));
    body_.insert(body_.end(), value.begin(), value.end());
  }
  void add_i64(const std::string& name, int64_t value) {
    header(name, kI64Entry);
    put<int64_t>(value);
  }
  void add_f64(const std::string& name, double value) {
    header(name, kF64Entry);
    put<double>(value);
  }
  void add_tensor(const std::string& name, const Tensor& t) {
    header(name, kTensorEntry);
    put<int32_t>(t.dtype);
    put<uint8_t>(uint8_t(t.shape.size()));
    for (int64_t extent : t.shape) put<int64_t>(extent);
    put<uint64_t>(uint64_t(t.bytes.size()));
    body_.insert(body_.end(), t.bytes.begin(), t.bytes.end());
  }
  std::vector<uint8_t> bytes() const {
    std::vector<uint8_t> file(std::begin(kMagic), std::end(kMagic));
    const uint32_t count = uint32_t(names_.size());
    for (size_t i = 0; i < sizeof count; ++i) file.push_back(uint8_t(count >> (8 * i)));
    file.insert(file.end(), body_.begin(), body_.end());
    return file;
  }

 private:
  void header(const std::string& name, EntryType type) {
    if (!names_.insert(name).second) throw std::runtime_error("duplicate entry name " + name);
    put<uint16_t>(uint16_t(name.size()));
    body_.insert(body_.end(), name.begin(), name.end());
    put<uint8_t>(type);
  }
  // Little-endian on every host: bytes are emitted from the value, not memcpy'd.
  template <typename T>
  void put(T value) {
    uint64_t bits = 0;
    std::memcpy(&bits, &value, sizeof value);
    for (size_t i = 0; i < sizeof value; ++i) body_.push_back(uint8_t(bits >> (8 * i)));
  }

  std::set<std::string> names_;
  std::vector<uint8_t> body_;
};

void check(sparsa_status status, const std::string& what) {
  if (status != SPARSA_STATUS_SUCCESS)
    throw std::runtime_error(what + " failed: " + sparsa_status_string(status) + ": " + sparsa_last_error_message());
}

// ---- Policies --------------------------------------------------------------------------------------------------

// Every scalar field of sparsa_policy by its C name (pointers are carried as in.* tensors).
struct PolicyField {
  const char* name;
  size_t offset;
  bool is_float;  // float fields; all others are 32-bit integers
};
#define SPARSA_INT_FIELD(f) PolicyField{#f, offsetof(sparsa_policy, f), false}
#define SPARSA_FLOAT_FIELD(f) PolicyField{#f, offsetof(sparsa_policy, f), true}
const PolicyField kPolicyFields[] = {
    SPARSA_INT_FIELD(sink_tokens),          SPARSA_INT_FIELD(sink_window),
    SPARSA_INT_FIELD(block_q),              SPARSA_INT_FIELD(block_k),
    SPARSA_FLOAT_FIELD(sparge_theta),       SPARSA_FLOAT_FIELD(sparge_tau),
    SPARSA_FLOAT_FIELD(sparge_topk_fraction), SPARSA_FLOAT_FIELD(sparge_lambda),
    SPARSA_INT_FIELD(sparge_attention_sink), SPARSA_INT_FIELD(sparge_quantized),
    SPARSA_INT_FIELD(token_sparse_window),  SPARSA_INT_FIELD(token_sparse_pool_kernel),
    SPARSA_FLOAT_FIELD(token_sparse_coverage), SPARSA_INT_FIELD(token_sparse_min_tokens),
    SPARSA_INT_FIELD(select_n_init),        SPARSA_INT_FIELD(select_n_local),
    SPARSA_INT_FIELD(select_top_k),         SPARSA_INT_FIELD(select_scale_scores),
    SPARSA_FLOAT_FIELD(select_cache_theta), SPARSA_INT_FIELD(select_per_kv_head),
    SPARSA_INT_FIELD(index_block_size),     SPARSA_INT_FIELD(index_n_init),
    SPARSA_INT_FIELD(index_n_local),        SPARSA_INT_FIELD(delta_gamma),
    SPARSA_INT_FIELD(delta_tail_min),
};
#undef SPARSA_INT_FIELD
#undef SPARSA_FLOAT_FIELD

sparsa_policy policy_of(int32_t kind) {
  sparsa_policy p;
  check(sparsa_policy_init(&p, sizeof p, kind), "sparsa_policy_init");
  return p;
}

// policy.kind, policy.flags, then the fields that differ (bitwise) from the kind's defaults.
void add_policy(VectorFile& file, const sparsa_policy& policy) {
  const sparsa_policy defaults = policy_of(policy.kind);
  file.add_i64("policy.kind", policy.kind);
  file.add_i64("policy.flags", policy.flags);
  for (const PolicyField& field : kPolicyFields) {
    const auto* value = reinterpret_cast<const uint8_t*>(&policy) + field.offset;
    const auto* fallback = reinterpret_cast<const uint8_t*>(&defaults) + field.offset;
    if (std::memcmp(value, fallback, 4) == 0) continue;
    if (field.is_float) {
      float f;
      std::memcpy(&f, value, sizeof f);
      file.add_f64(std::string("policy.") + field.name, double(f));
    } else {
      int32_t i;
      std::memcpy(&i, value, sizeof i);
      file.add_i64(std::string("policy.") + field.name, i);
    }
  }
}

// ---- Cases -----------------------------------------------------------------------------------------------------

struct Case {
  std::string name;
  std::vector<uint8_t> bytes;
};

// An error case expects this status; its message is recorded from the library.
using ExpectedError = std::optional<sparsa_status>;

// Records a call's outcome: nothing for a success, expect.* for an expected failure; anything else is a bug in the
// case (or in the library) and stops the generator.
void record_outcome(VectorFile& file, sparsa_status status, const ExpectedError& expected, const std::string& what) {
  if (!expected) {
    check(status, what);
    return;
  }
  if (status != *expected)
    throw std::runtime_error(what + ": expected " + sparsa_status_string(*expected) + ", got " +
                             sparsa_status_string(status) + ": " + sparsa_last_error_message());
  file.add_i64("expect.status", status);
  file.add_string("expect.message", sparsa_last_error_message());
}

void add_op(VectorFile& file, const std::string& op, const ExpectedError& expected) {
  if (expected) {
    file.add_string("op", "error");
    file.add_string("call", op);
  } else {
    file.add_string("op", op);
  }
}

// One attention call: inputs and poisoned output templates by their FORMAT.md names (without in./out.).
struct AttentionSpec {
  std::string name;
  std::map<std::string, Tensor> in;
  std::map<std::string, Tensor> out;
  int64_t causal = 0;
  float softmax_scale = 0.f;
  sparsa_policy policy = policy_of(SPARSA_POLICY_DENSE);
  int64_t cache_runs = 0;  // > 0: that many runs through one selection cache of `cache_dims`
  std::array<int32_t, 5> cache_dims{};
  ExpectedError expected;
};

Case run_attention(sparsa_context* ctx, AttentionSpec spec) {
  std::map<std::string, sparsa_tensor> views;
  for (auto& [name, t] : spec.in) views[name] = t.view();
  for (auto& [name, t] : spec.out) views[name] = t.view();
  auto find = [&](const char* name) -> const sparsa_tensor* {
    auto it = views.find(name);
    return it == views.end() ? nullptr : &it->second;
  };
  sparsa_attention_args args;
  check(sparsa_attention_args_init(&args, sizeof args), "sparsa_attention_args_init");
  args.q = find("q"), args.k = find("k"), args.v = find("v"), args.out = find("out"), args.lse = find("lse");
  args.causal = int32_t(spec.causal);
  args.softmax_scale = spec.softmax_scale;
  args.cu_seqlens_q = find("cu_seqlens_q"), args.cu_seqlens_k = find("cu_seqlens_k");
  args.page_table = find("page_table"), args.seq_lens_k = find("seq_lens_k");
  args.selected_indices = find("selected_indices"), args.block_mask_out = find("block_mask_out");
  args.stats = find("stats");
  sparsa_policy policy = spec.policy;
  policy.block_mask = find("block_mask"), policy.sparge_head_params = find("sparge_head_params");
  policy.indices = find("indices"), policy.head_map = find("head_map");

  VectorFile file;
  add_op(file, "attention", spec.expected);
  for (const auto& [name, t] : spec.in) file.add_tensor("in." + name, t);
  sparsa_selection_cache* cache = nullptr;
  if (spec.cache_runs > 0) {
    const auto& d = spec.cache_dims;
    check(sparsa_selection_cache_create(ctx, d[0], d[1], d[2], d[3], d[4], &cache), "selection_cache_create");
    args.selection_cache = cache;
    file.add_tensor("in.cache_dims", from_i32({5}, std::vector<int32_t>(d.begin(), d.end())));
  }
  file.add_i64("arg.causal", spec.causal);
  file.add_f64("arg.softmax_scale", double(spec.softmax_scale));
  if (spec.cache_runs > 0) file.add_i64("arg.cache_runs", spec.cache_runs);
  add_policy(file, spec.policy);

  sparsa_status status = SPARSA_STATUS_SUCCESS;
  const int64_t runs = std::max<int64_t>(spec.cache_runs, 1);
  for (int64_t run = 0; run < runs && status == SPARSA_STATUS_SUCCESS; ++run)
    status = sparsa_attention_run(ctx, &args, &policy);
  record_outcome(file, status, spec.expected, spec.name);
  for (const auto& [name, t] : spec.out) file.add_tensor("out." + name, t);
  if (cache) {
    int64_t hits = 0, misses = 0;
    check(sparsa_selection_cache_counts(cache, &hits, &misses), "selection_cache_counts");
    file.add_i64("out.cache_hits", hits);
    file.add_i64("out.cache_misses", misses);
    sparsa_selection_cache_destroy(cache);
  }
  return {spec.name, file.bytes()};
}

// Sizes of a padded attention case.
struct Dims {
  int64_t batch, seq_q, seq_k, q_heads, kv_heads, head_dim;
};

AttentionSpec padded_case(Rng& rng, const std::string& name, const Dims& d, int32_t dtype, bool with_lse) {
  AttentionSpec spec;
  spec.name = name;
  spec.in["q"] = random_floats(rng, dtype, {d.batch, d.seq_q, d.q_heads, d.head_dim});
  spec.in["k"] = random_floats(rng, dtype, {d.batch, d.seq_k, d.kv_heads, d.head_dim});
  spec.in["v"] = random_floats(rng, dtype, {d.batch, d.seq_k, d.kv_heads, d.head_dim});
  spec.out["out"] = poisoned(dtype, {d.batch, d.seq_q, d.q_heads, d.head_dim});
  if (with_lse) spec.out["lse"] = poisoned(SPARSA_DTYPE_F32, {d.batch, d.q_heads, d.seq_q});
  spec.out["stats"] = poisoned(SPARSA_DTYPE_I64, {SPARSA_STAT_COUNT});
  return spec;
}

int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

std::vector<AttentionSpec> dense_and_window_cases(Rng& rng) {
  std::vector<AttentionSpec> cases;
  const Dims small{2, 24, 24, 4, 2, 8};
  AttentionSpec causal = padded_case(rng, "dense_causal_f32", small, SPARSA_DTYPE_F32, true);
  causal.causal = 1;
  cases.push_back(causal);

  AttentionSpec rect = padded_case(rng, "dense_noncausal_rect_f32", {2, 8, 20, 4, 1, 8}, SPARSA_DTYPE_F32, true);
  rect.softmax_scale = 0.25f;
  cases.push_back(rect);

  AttentionSpec bottom_right = padded_case(rng, "dense_causal_rect_f32", {1, 6, 20, 2, 2, 8}, SPARSA_DTYPE_F32, true);
  bottom_right.causal = 1;
  cases.push_back(bottom_right);

  for (auto [dtype, name] : {std::pair{SPARSA_DTYPE_F16, "dense_causal_f16"}, std::pair{SPARSA_DTYPE_BF16, "dense_causal_bf16"}}) {
    AttentionSpec half = padded_case(rng, name, small, dtype, true);
    half.causal = 1;
    cases.push_back(half);
  }

  AttentionSpec window = padded_case(rng, "sink_window_causal_f32", {1, 32, 32, 2, 1, 8}, SPARSA_DTYPE_F32, true);
  window.causal = 1;
  window.policy = policy_of(SPARSA_POLICY_SINK_WINDOW);
  window.policy.sink_tokens = 4, window.policy.sink_window = 8;
  cases.push_back(window);

  AttentionSpec both_sides = padded_case(rng, "sink_window_noncausal_f32", {1, 16, 32, 2, 2, 8}, SPARSA_DTYPE_F32, true);
  both_sides.policy = policy_of(SPARSA_POLICY_SINK_WINDOW);
  both_sides.policy.sink_tokens = 2, both_sides.policy.sink_window = 5;
  cases.push_back(both_sides);

  AttentionSpec delta = padded_case(rng, "delta_sink_window_f32", {1, 48, 48, 2, 1, 8}, SPARSA_DTYPE_F32, false);
  delta.causal = 1;
  delta.policy = policy_of(SPARSA_POLICY_SINK_WINDOW);
  delta.policy.sink_tokens = 2, delta.policy.sink_window = 6;
  delta.policy.flags = SPARSA_POLICY_FLAG_DELTA;
  delta.policy.delta_gamma = 8, delta.policy.delta_tail_min = 8;
  cases.push_back(delta);
  return cases;
}

std::vector<AttentionSpec> block_cases(Rng& rng) {
  std::vector<AttentionSpec> cases;
  const Dims d{1, 32, 32, 2, 1, 8};
  AttentionSpec masked = padded_case(rng, "block_sparse_causal_f32", d, SPARSA_DTYPE_F32, true);
  masked.causal = 1;
  masked.policy = policy_of(SPARSA_POLICY_BLOCK_SPARSE);
  masked.policy.block_q = 8, masked.policy.block_k = 8;
  Tensor mask = filled(SPARSA_DTYPE_U8, {d.batch, d.q_heads, ceil_div(d.seq_q, 8), ceil_div(d.seq_k, 8)}, 0);
  for (uint8_t& bit : mask.bytes) bit = uint8_t(rng.below(2));
  masked.in["block_mask"] = mask;
  cases.push_back(masked);

  // SPARGE on clustered inputs (blocks of 16 tokens share a direction, so they are self-similar).
  const Dims sd{1, 64, 64, 2, 1, 16};
  constexpr int64_t kBlock = 16;
  auto sparge = [&](const std::string& name) {
    AttentionSpec spec = padded_case(rng, name, sd, SPARSA_DTYPE_F32, true);
    spec.in["q"] = clustered_floats(rng, SPARSA_DTYPE_F32, {sd.batch, sd.seq_q, sd.q_heads, sd.head_dim}, kBlock);
    spec.in["k"] = clustered_floats(rng, SPARSA_DTYPE_F32, {sd.batch, sd.seq_k, sd.kv_heads, sd.head_dim}, kBlock);
    spec.causal = 1;
    spec.policy = policy_of(SPARSA_POLICY_SPARGE);
    spec.policy.block_q = int32_t(kBlock), spec.policy.block_k = int32_t(kBlock);
    spec.policy.sparge_theta = 0.3f, spec.policy.sparge_tau = 0.5f;
    spec.out["block_mask_out"] =
        poisoned(SPARSA_DTYPE_U8, {sd.batch, sd.q_heads, ceil_div(sd.seq_q, kBlock), ceil_div(sd.seq_k, kBlock)});
    return spec;
  };
  cases.push_back(sparge("sparge_topcdf_f32"));
  AttentionSpec lambda = sparge("sparge_lambda_sink_f32");
  lambda.policy.sparge_lambda = -1.f, lambda.policy.sparge_attention_sink = 1, lambda.policy.sparge_tau = 0.9f;
  cases.push_back(lambda);
  AttentionSpec quantized = sparge("sparge_quantized_f32");
  quantized.policy.sparge_quantized = 1;
  cases.push_back(quantized);
  AttentionSpec per_head = sparge("sparge_topk_head_params_f32");
  per_head.policy.sparge_topk_fraction = 0.5f;
  const float nan = std::numeric_limits<float>::quiet_NaN();
  // head 0: scalar fields except theta; head 1: its own top-k fraction and a λ.
  per_head.in["sparge_head_params"] = from_floats(SPARSA_DTYPE_F32, {2, 4}, {0.2f, nan, nan, nan, nan, nan, 0.25f, -2.f});
  cases.push_back(per_head);
  return cases;
}

std::vector<AttentionSpec> token_cases(Rng& rng) {
  std::vector<AttentionSpec> cases;
  AttentionSpec sparse = padded_case(rng, "token_sparse_f32", {2, 48, 48, 4, 2, 8}, SPARSA_DTYPE_F32, true);
  sparse.policy = policy_of(SPARSA_POLICY_TOKEN_SPARSE);
  sparse.policy.token_sparse_window = 8, sparse.policy.token_sparse_min_tokens = 8;
  sparse.policy.token_sparse_coverage = 0.2f;
  sparse.out["selected_indices"] = poisoned(SPARSA_DTYPE_I32, {2, 4, 48});
  cases.push_back(sparse);

  // TOKEN_SELECT: N = 64 keys, 4 sinks + top 8 + 8 local = a set of at most 20.
  constexpr int32_t kInit = 4, kTop = 8, kLocal = 8, kSetCap = kInit + kTop + kLocal;
  auto select = [&](const std::string& name, const Dims& d) {
    AttentionSpec spec = padded_case(rng, name, d, SPARSA_DTYPE_F32, true);
    spec.policy = policy_of(SPARSA_POLICY_TOKEN_SELECT);
    spec.policy.select_n_init = kInit, spec.policy.select_n_local = kLocal, spec.policy.select_top_k = kTop;
    spec.out["selected_indices"] = poisoned(SPARSA_DTYPE_I32, {d.batch, 1, kSetCap});
    return spec;
  };
  cases.push_back(select("token_select_decode_f32", {2, 1, 64, 4, 2, 8}));
  AttentionSpec chunk = select("token_select_chunk_scaled_f32", {1, 4, 64, 4, 2, 8});
  chunk.policy.select_scale_scores = 1;
  cases.push_back(chunk);
  AttentionSpec per_kv = select("token_select_per_kv_head_f32", {2, 1, 64, 4, 2, 8});
  per_kv.policy.select_per_kv_head = 1;
  per_kv.out["selected_indices"] = poisoned(SPARSA_DTYPE_I32, {2, 2, kSetCap});
  cases.push_back(per_kv);
  AttentionSpec cached = select("token_select_cache_f32", {2, 1, 64, 4, 2, 8});
  cached.policy.select_cache_theta = 0.5f;
  cached.cache_runs = 3;
  cached.cache_dims = {2, 4, 2, 8, kTop};
  cases.push_back(cached);

  // TOKEN_INDICES: token ids with unused slots, then block ids with an explicit head map.
  const Dims d{2, 2, 40, 4, 2, 8};
  AttentionSpec tokens = padded_case(rng, "token_indices_f32", d, SPARSA_DTYPE_F32, true);
  tokens.causal = 1;
  tokens.policy = policy_of(SPARSA_POLICY_TOKEN_INDICES);
  tokens.policy.index_n_init = 2, tokens.policy.index_n_local = 3;
  std::vector<int32_t> ids;
  for (int i = 0; i < 2 * 2 * 6; ++i) ids.push_back(i % 5 == 4 ? -1 : int32_t(rng.below(40)));
  tokens.in["indices"] = from_i32({2, 2, 6}, ids);
  tokens.out["selected_indices"] = poisoned(SPARSA_DTYPE_I32, {2, 4, 40});
  cases.push_back(tokens);

  AttentionSpec blocks = padded_case(rng, "token_indices_blocks_head_map_f32", d, SPARSA_DTYPE_F32, true);
  blocks.causal = 1;
  blocks.policy = policy_of(SPARSA_POLICY_TOKEN_INDICES);
  blocks.policy.index_block_size = 4;
  ids.clear();
  for (int i = 0; i < 2 * 3 * 3; ++i) ids.push_back(i % 7 == 6 ? -1 : int32_t(rng.below(10)));
  blocks.in["indices"] = from_i32({2, 3, 3}, ids);
  blocks.in["head_map"] = from_i32({4}, {2, 0, 1, 0});
  blocks.out["selected_indices"] = poisoned(SPARSA_DTYPE_I32, {2, 4, 40});
  cases.push_back(blocks);
  return cases;
}

std::vector<AttentionSpec> layout_cases(Rng& rng) {
  std::vector<AttentionSpec> cases;
  // Varlen: three sequences packed, query lengths 5, 0, 7 over key lengths 9, 4, 7.
  constexpr int64_t kHq = 4, kHkv = 2, kD = 8;
  const std::vector<int32_t> cu_q{0, 5, 5, 12}, cu_k{0, 9, 13, 20};
  AttentionSpec varlen;
  varlen.name = "dense_varlen_causal_f32";
  varlen.causal = 1;
  varlen.in["q"] = random_floats(rng, SPARSA_DTYPE_F32, {cu_q.back(), kHq, kD});
  varlen.in["k"] = random_floats(rng, SPARSA_DTYPE_F32, {cu_k.back(), kHkv, kD});
  varlen.in["v"] = random_floats(rng, SPARSA_DTYPE_F32, {cu_k.back(), kHkv, kD});
  varlen.in["cu_seqlens_q"] = from_i32({4}, cu_q);
  varlen.in["cu_seqlens_k"] = from_i32({4}, cu_k);
  varlen.out["out"] = poisoned(SPARSA_DTYPE_F32, {cu_q.back(), kHq, kD});
  varlen.out["lse"] = poisoned(SPARSA_DTYPE_F32, {kHq, cu_q.back()});
  varlen.out["stats"] = poisoned(SPARSA_DTYPE_I64, {SPARSA_STAT_COUNT});
  cases.push_back(varlen);

  // Paged KV: 6 pages of 4 slots; sequence 0 has 10 tokens on pages 3, 0, 5; sequence 1 has 7 on pages 1, 4.
  constexpr int64_t kPages = 6, kPageSize = 4, kSq = 3;
  AttentionSpec paged;
  paged.name = "dense_paged_causal_f32";
  paged.causal = 1;
  paged.in["q"] = random_floats(rng, SPARSA_DTYPE_F32, {2, kSq, kHq, kD});
  paged.in["k"] = random_floats(rng, SPARSA_DTYPE_F32, {kPages, kPageSize, kHkv, kD});
  paged.in["v"] = random_floats(rng, SPARSA_DTYPE_F32, {kPages, kPageSize, kHkv, kD});
  paged.in["page_table"] = from_i32({2, 3}, {3, 0, 5, 1, 4, 2});
  paged.in["seq_lens_k"] = from_i32({2}, {10, 7});
  paged.out["out"] = poisoned(SPARSA_DTYPE_F32, {2, kSq, kHq, kD});
  paged.out["lse"] = poisoned(SPARSA_DTYPE_F32, {2, kHq, kSq});
  cases.push_back(paged);

  AttentionSpec paged_select = paged;
  paged_select.name = "token_select_paged_f32";
  paged_select.in["q"] = random_floats(rng, SPARSA_DTYPE_F32, {2, 1, kHq, kD});
  paged_select.out["out"] = poisoned(SPARSA_DTYPE_F32, {2, 1, kHq, kD});
  paged_select.out["lse"] = poisoned(SPARSA_DTYPE_F32, {2, kHq, 1});
  paged_select.policy = policy_of(SPARSA_POLICY_TOKEN_SELECT);
  paged_select.policy.select_n_init = 1, paged_select.policy.select_n_local = 2, paged_select.policy.select_top_k = 3;
  cases.push_back(paged_select);
  return cases;
}

std::vector<AttentionSpec> error_cases(Rng& rng) {
  std::vector<AttentionSpec> cases;
  const Dims d{1, 4, 8, 2, 1, 8};
  AttentionSpec dtype = padded_case(rng, "error_dtype_mismatch", d, SPARSA_DTYPE_F32, false);
  dtype.in["k"] = random_floats(rng, SPARSA_DTYPE_F16, {1, 8, 1, 8});
  dtype.expected = SPARSA_STATUS_DTYPE_MISMATCH;
  cases.push_back(dtype);

  AttentionSpec shape = padded_case(rng, "error_shape_head_dim", d, SPARSA_DTYPE_F32, false);
  shape.in["k"] = random_floats(rng, SPARSA_DTYPE_F32, {1, 8, 1, 4});  // head_dim 4 against q's 8
  shape.in["v"] = random_floats(rng, SPARSA_DTYPE_F32, {1, 8, 1, 4});
  shape.expected = SPARSA_STATUS_SHAPE_MISMATCH;
  cases.push_back(shape);

  AttentionSpec index = padded_case(rng, "error_index_out_of_range", d, SPARSA_DTYPE_F32, false);
  index.policy = policy_of(SPARSA_POLICY_TOKEN_INDICES);
  index.in["indices"] = from_i32({1, 1, 3}, {0, 8, 2});  // 8 == N
  index.expected = SPARSA_STATUS_INDEX_OUT_OF_RANGE;
  cases.push_back(index);
  return cases;
}

// ---- Utilities -------------------------------------------------------------------------------------------------

Case merge_states_case(Rng& rng, sparsa_context* ctx) {
  constexpr int64_t B = 2, S = 5, H = 3, D = 8;
  Tensor o_a = random_floats(rng, SPARSA_DTYPE_F32, {B, S, H, D}), o_b = random_floats(rng, SPARSA_DTYPE_F32, {B, S, H, D});
  std::vector<float> lse_a(B * H * S), lse_b(B * H * S);
  for (float& x : lse_a) x = 4.f * rng.value();
  for (float& x : lse_b) x = 4.f * rng.value();
  const float minus_inf = -std::numeric_limits<float>::infinity();
  lse_a[0] = minus_inf;                      // one side empty
  lse_a[1] = minus_inf, lse_b[1] = minus_inf;  // both empty: out 0, lse -inf
  Tensor la = from_floats(SPARSA_DTYPE_F32, {B, H, S}, lse_a), lb = from_floats(SPARSA_DTYPE_F32, {B, H, S}, lse_b);
  Tensor out = poisoned(SPARSA_DTYPE_F32, {B, S, H, D}), out_lse = poisoned(SPARSA_DTYPE_F32, {B, H, S});
  sparsa_tensor v[6] = {o_a.view(), la.view(), o_b.view(), lb.view(), out.view(), out_lse.view()};
  check(sparsa_merge_states(ctx, &v[0], &v[1], &v[2], &v[3], &v[4], &v[5]), "merge_states");
  VectorFile file;
  file.add_string("op", "merge_states");
  file.add_tensor("in.o_a", o_a), file.add_tensor("in.lse_a", la);
  file.add_tensor("in.o_b", o_b), file.add_tensor("in.lse_b", lb);
  file.add_tensor("out.out", out), file.add_tensor("out.out_lse", out_lse);
  return {"merge_states_f32", file.bytes()};
}

Case topk_case(Rng& rng, sparsa_context* ctx, const std::string& name, int32_t k, int32_t block_size,
               const ExpectedError& expected = std::nullopt) {
  constexpr int64_t B = 2, H = 2, N = 30;
  Tensor scores = random_floats(rng, SPARSA_DTYPE_F32, {B, H, N});
  scores.as<float>()[3] = scores.as<float>()[7];  // a tie: the smaller id must win
  Tensor out = poisoned(SPARSA_DTYPE_I32, {B, H, k});
  sparsa_tensor s = scores.view(), o = out.view();
  VectorFile file;
  add_op(file, "topk_from_scores", expected);
  file.add_tensor("in.scores", scores);
  file.add_i64("arg.k", k), file.add_i64("arg.block_size", block_size);
  record_outcome(file, sparsa_topk_from_scores(ctx, &s, k, block_size, &o), expected, name);
  file.add_tensor("out.indices", out);
  return {name, file.bytes()};
}

Case head_mapping_case(Rng& rng) {
  constexpr int64_t T = 3, Hd = 3, Ht = 4, N = 24;
  constexpr int32_t k = 6;
  Tensor draft = random_floats(rng, SPARSA_DTYPE_F32, {T, Hd, N}), target = random_floats(rng, SPARSA_DTYPE_F32, {T, Ht, N});
  Tensor map = poisoned(SPARSA_DTYPE_I32, {Ht});
  sparsa_tensor dv = draft.view(), tv = target.view(), mv = map.view();
  check(sparsa_head_mapping(&dv, &tv, k, &mv), "head_mapping");
  VectorFile file;
  file.add_string("op", "head_mapping");
  file.add_tensor("in.draft", draft), file.add_tensor("in.target", target);
  file.add_i64("arg.k", k);
  file.add_tensor("out.map", map);
  return {"head_mapping_f32", file.bytes()};
}

Case hilbert_case(int32_t t, int32_t h, int32_t w) {
  const int64_t n = int64_t(t) * h * w;
  Tensor perm = poisoned(SPARSA_DTYPE_I32, {n}), inverse = poisoned(SPARSA_DTYPE_I32, {n});
  check(sparsa_hilbert_permutation(t, h, w, perm.as<int32_t>(), inverse.as<int32_t>(), n), "hilbert_permutation");
  VectorFile file;
  file.add_string("op", "hilbert_permutation");
  file.add_i64("arg.t", t), file.add_i64("arg.h", h), file.add_i64("arg.w", w);
  file.add_tensor("out.perm", perm), file.add_tensor("out.inverse", inverse);
  return {"hilbert_" + std::to_string(t) + "x" + std::to_string(h) + "x" + std::to_string(w), file.bytes()};
}

Case drift_case(Rng& rng) {
  constexpr int64_t L = 6, T = 5, D = 8;
  constexpr float kDelta = 0.5f;
  Tensor h_in = random_floats(rng, SPARSA_DTYPE_F32, {L, T, D});
  std::vector<float> after(static_cast<size_t>(L * T * D));
  for (int64_t i = 0; i < L * T * D; ++i)  // layer l drifts by about l/8 of the input's size
    after[size_t(i)] = h_in.as<float>()[i] * (1.f + float(i / (T * D)) / 8.f) + rng.value(8);
  Tensor h_out = from_floats(SPARSA_DTYPE_F32, {L, T, D}, after);
  Tensor ratio = poisoned(SPARSA_DTYPE_F32, {L}), sparse = poisoned(SPARSA_DTYPE_U8, {L});
  sparsa_tensor v[4] = {h_in.view(), h_out.view(), ratio.view(), sparse.view()};
  check(sparsa_drift_select_layers(&v[0], &v[1], kDelta, &v[2], &v[3]), "drift_select_layers");
  VectorFile file;
  file.add_string("op", "drift_select_layers");
  file.add_tensor("in.h_in", h_in), file.add_tensor("in.h_out", h_out);
  file.add_f64("arg.delta", double(kDelta));
  file.add_tensor("out.ratio", ratio), file.add_tensor("out.sparse", sparse);
  return {"drift_select_layers_f32", file.bytes()};
}

Case kv_prefetch_case(Rng& rng, sparsa_context* ctx) {
  constexpr int64_t B = 2, N = 20, Hkv = 2, D = 8, H_idx = 2, K = 4, C = 10;  // C > any union (at most 8)
  Tensor k_src = random_floats(rng, SPARSA_DTYPE_F32, {B, N, Hkv, D}), v_src = random_floats(rng, SPARSA_DTYPE_F32, {B, N, Hkv, D});
  std::vector<int32_t> ids;
  for (int i = 0; i < B * H_idx * K; ++i) ids.push_back(i % 6 == 5 ? -1 : int32_t(rng.below(N)));
  Tensor indices = from_i32({B, H_idx, K}, ids);
  Tensor k_dst = filled(SPARSA_DTYPE_F32, {B, C, Hkv, D}, 0), v_dst = filled(SPARSA_DTYPE_F32, {B, C, Hkv, D}, 0);
  Tensor positions = poisoned(SPARSA_DTYPE_I32, {B, C}), remapped = poisoned(SPARSA_DTYPE_I32, {B, H_idx, K});
  Tensor counts = poisoned(SPARSA_DTYPE_I32, {B});
  sparsa_tensor v[8] = {k_src.view(), v_src.view(), indices.view(), k_dst.view(),
                        v_dst.view(), positions.view(), remapped.view(), counts.view()};
  check(sparsa_kv_prefetch(ctx, &v[0], &v[1], &v[2], &v[3], &v[4], &v[5], &v[6], &v[7]), "kv_prefetch");
  VectorFile file;
  file.add_string("op", "kv_prefetch");
  file.add_tensor("in.k_src", k_src), file.add_tensor("in.v_src", v_src), file.add_tensor("in.indices", indices);
  file.add_tensor("out.k_dst", k_dst), file.add_tensor("out.v_dst", v_dst);
  file.add_tensor("out.positions", positions), file.add_tensor("out.remapped", remapped);
  file.add_tensor("out.counts", counts);
  return {"kv_prefetch_f32", file.bytes()};
}

std::vector<Case> build_all_cases() {
  sparsa_context* ctx = nullptr;
  check(sparsa_context_create(nullptr, &ctx), "sparsa_context_create");
  std::unique_ptr<sparsa_context, void (*)(sparsa_context*)> owner(ctx, sparsa_context_destroy);
  Rng rng(kSeed);
  std::vector<Case> cases;
  for (auto builder : {dense_and_window_cases, block_cases, token_cases, layout_cases, error_cases})
    for (AttentionSpec& spec : builder(rng)) cases.push_back(run_attention(ctx, std::move(spec)));
  cases.push_back(merge_states_case(rng, ctx));
  cases.push_back(topk_case(rng, ctx, "topk_tokens_f32", 5, 1));
  cases.push_back(topk_case(rng, ctx, "topk_blocks_f32", 3, 4));
  cases.push_back(topk_case(rng, ctx, "error_topk_k_too_large", 31, 1, SPARSA_STATUS_SHAPE_MISMATCH));
  cases.push_back(head_mapping_case(rng));
  cases.push_back(hilbert_case(3, 4, 5));
  cases.push_back(drift_case(rng));
  cases.push_back(kv_prefetch_case(rng, ctx));
  return cases;
}

// ---- Main ------------------------------------------------------------------------------------------------------

std::vector<uint8_t> read_file(const std::filesystem::path& path) {
  std::ifstream in(path, std::ios::binary);
  return {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
}

int write_all(const std::filesystem::path& dir, const std::vector<Case>& cases) {
  std::filesystem::create_directories(dir);
  for (const Case& c : cases) {
    std::ofstream out(dir / (c.name + kExtension), std::ios::binary | std::ios::trunc);
    out.write(reinterpret_cast<const char*>(c.bytes.data()), std::streamsize(c.bytes.size()));
    if (!out) {
      std::fprintf(stderr, "cannot write %s\n", (dir / (c.name + kExtension)).c_str());
      return 1;
    }
  }
  std::printf("wrote %zu vectors to %s\n", cases.size(), dir.c_str());
  return 0;
}

int check_all(const std::filesystem::path& dir, const std::vector<Case>& cases) {
  int failures = 0;
  std::set<std::string> expected_files;
  for (const Case& c : cases) {
    const std::filesystem::path path = dir / (c.name + kExtension);
    expected_files.insert(path.filename().string());
    if (!std::filesystem::exists(path)) {
      std::fprintf(stderr, "missing: %s\n", path.c_str());
      ++failures;
      continue;
    }
    const std::vector<uint8_t> committed = read_file(path);
    if (committed != c.bytes) {
      const auto diff = std::mismatch(committed.begin(), committed.end(), c.bytes.begin(), c.bytes.end());
      std::fprintf(stderr, "differs: %s (first difference at byte %td; sizes %zu committed, %zu generated)\n",
                   path.c_str(), diff.first - committed.begin(), committed.size(), c.bytes.size());
      ++failures;
    }
  }
  for (const auto& entry : std::filesystem::directory_iterator(dir)) {
    const std::string file = entry.path().filename().string();
    if (entry.path().extension() == kExtension && !expected_files.count(file)) {
      std::fprintf(stderr, "no longer generated: %s\n", entry.path().c_str());
      ++failures;
    }
  }
  if (failures == 0) std::printf("all %zu vectors in %s are up to date\n", cases.size(), dir.c_str());
  return failures == 0 ? 0 : 1;
}

}  // namespace

int main(int argc, char** argv) {
  const bool check_mode = argc == 3 && std::string(argv[1]) == "--check";
  if (!(argc == 2 || check_mode)) {
    std::fprintf(stderr, "usage: %s <dir> | --check <dir>\n", argv[0]);
    return 2;
  }
  try {
    const std::vector<Case> cases = build_all_cases();
    return check_mode ? check_all(argv[2], cases) : write_all(argv[1], cases);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "generate_vectors: %s\n", e.what());
    return 1;
  }
}
