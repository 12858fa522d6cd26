// Validation of sparsa_attention_run's arguments (and the per-tensor checks every call shares).
//
// Reads the caller's structs through their struct_size, checks every tensor (presence, descriptor, device, dtype,
// rank, extents, strides), every policy parameter's documented domain, and — when the index/offset tensors live in
// host memory (CPU backend) — their contents. Builds the AttentionProblem + PolicyParams a backend runs. Nothing is
// written to caller memory here, so a failure leaves every output untouched.
#include "validate.h"

#include <algorithm>
#include <cmath>
#include <limits>

#include "common/policy_sizes.h"
#include "handles.h"
#include "policy_table.h"
#include "tensor_util.h"

namespace sparsa {

// Largest head dimension accepted (the CPU backend handles any D; GPU backends refuse in supports()).
constexpr int64_t kMaxHeadDim = 512;
// Every flag bit this version knows.
constexpr uint32_t kKnownPolicyFlags = SPARSA_POLICY_FLAG_DELTA;

// ------------------------------------------------------------------------------------------------------------------
// Per-tensor checks
// ------------------------------------------------------------------------------------------------------------------

TensorArg read_tensor(const sparsa_tensor* t, const char* name, bool required) {
  TensorArg arg;
  if (t == nullptr) {
    if (required) fail(SPARSA_STATUS_NULL_POINTER, name, ": required tensor is NULL");
    return arg;
  }
  sparsa_tensor defaults{};
  defaults.device_type = SPARSA_DEVICE_CPU;
  arg.t = read_caller_struct(*t, name, defaults);
  arg.present = true;
  const sparsa_tensor& d = arg.t;
  if (d.ndim < 1 || d.ndim > SPARSA_MAX_DIMS) {
    fail(SPARSA_STATUS_SHAPE_MISMATCH, name, ": ndim must be in [1, ", SPARSA_MAX_DIMS, "], got ", d.ndim);
  }
  for (int i = 0; i < d.ndim; ++i) {
    if (d.shape[i] < 0) {
      fail(SPARSA_STATUS_SHAPE_MISMATCH, name, ": shape ", shape_string(d), " has a negative extent in dim ", i);
    }
    if (d.strides[i] < 0) {
      fail(SPARSA_STATUS_SHAPE_MISMATCH, name, ": strides ", shape_string(d.strides, d.ndim),
           " have a negative entry in dim ", i, " (strides must be >= 0)");
    }
  }
  // Counts and byte sizes are computed once here, with overflow detection, so every later product of extents or
  // offset (extent - 1) * stride of a validated tensor fits int64.
  int64_t elements = 0;
  if (!checked_element_count(d, &elements)) {
    fail(SPARSA_STATUS_SHAPE_MISMATCH, name, ": shape ", shape_string(d), " has more than INT64_MAX elements");
  }
  int64_t span_bytes = 0;
  if (!checked_span_bytes(d, std::max<size_t>(1, dtype_size(d.dtype)), &span_bytes)) {
    fail(SPARSA_STATUS_SHAPE_MISMATCH, name, ": shape ", shape_string(d), " with strides ",
         shape_string(d.strides, d.ndim), " spans more than INT64_MAX bytes");
  }
  if (d.data == nullptr && elements > 0) {
    fail(SPARSA_STATUS_NULL_POINTER, name, ": data is NULL for a tensor of shape ", shape_string(d));
  }
  // Kernels load elements as their type (fp16 as uint16_t, indices as int32_t): data must be aligned to it.
  const size_t alignment = std::max<size_t>(1, dtype_size(d.dtype));
  if (reinterpret_cast<uintptr_t>(d.data) % alignment != 0) {
    fail(SPARSA_STATUS_INVALID_ARGUMENT, name, ": data ", d.data, " is not aligned to its ", alignment,
         "-byte elements (", dtype_name(d.dtype), ")");
  }
  return arg;
}

void expect_dtype(const TensorArg& a, const char* name, int32_t dtype) {
  if (a.t.dtype != dtype) {
    fail(SPARSA_STATUS_DTYPE_MISMATCH, name, ": expected dtype ", dtype_name(dtype), ", got ", dtype_name(a.t.dtype),
         " (", a.t.dtype, ")");
  }
}

void expect_rank(const TensorArg& a, const char* name, int rank, const char* layout) {
  if (a.t.ndim != rank) {
    fail(SPARSA_STATUS_SHAPE_MISMATCH, name, ": expected rank ", rank, " ", layout, ", got rank ", a.t.ndim,
         " with shape ", shape_string(a.t));
  }
}

void expect_shape(const TensorArg& a, const char* name, const ShapeSpec& shape, const char* why) {
  bool same = a.t.ndim == shape.rank;
  for (int i = 0; same && i < a.t.ndim; ++i) same = a.t.shape[i] == shape.dims[i];
  if (!same) {
    fail(SPARSA_STATUS_SHAPE_MISMATCH, name, ": expected shape ", shape_string(shape.dims, shape.rank), " (", why,
         "), got ", shape_string(a.t));
  }
}

void expect_last_stride_one(const TensorArg& a, const char* name) {
  const int last = a.t.ndim - 1;
  if (a.t.shape[last] > 1 && a.t.strides[last] != 1) {
    fail(SPARSA_STATUS_SHAPE_MISMATCH, name, ": the last dimension must have stride 1, got strides ",
         shape_string(a.t.strides, a.t.ndim));
  }
}

void expect_distinct_elements(const TensorArg& a, const char* name) {
  int dims[SPARSA_MAX_DIMS];
  int n = 0;
  for (int d = 0; d < a.t.ndim; ++d) {
    if (a.t.shape[d] == 0) return;  // empty: no element at all
    if (a.t.shape[d] > 1) dims[n++] = d;
  }
  for (int i = 1; i < n; ++i) {  // insertion sort by ascending stride (at most SPARSA_MAX_DIMS entries)
    for (int j = i; j > 0 && a.t.strides[dims[j]] < a.t.strides[dims[j - 1]]; --j) std::swap(dims[j], dims[j - 1]);
  }
  int64_t reach = 1;  // elements spanned by the dimensions taken so far (fits: read_tensor bounded the span)
  for (int i = 0; i < n; ++i) {
    const int64_t stride = a.t.strides[dims[i]];
    if (stride < reach) {
      fail(SPARSA_STATUS_SHAPE_MISMATCH, name, ": an output's elements must not overlap (no stride 0, no ",
           "interleaved dimensions), got shape ", shape_string(a.t), " and strides ",
           shape_string(a.t.strides, a.t.ndim));
    }
    reach += (a.t.shape[dims[i]] - 1) * stride;
  }
}

void expect_on_device(const TensorArg& a, const char* name, const DeviceRule& rule) {
  const int32_t dev = a.t.device_type;
  const bool cpu_context = rule.device_type == SPARSA_DEVICE_CPU;
  const bool ok = cpu_context ? is_host_memory(dev) : (dev == rule.device_type && a.t.device_id == rule.device_id);
  if (!ok) {
    fail(SPARSA_STATUS_DEVICE_MISMATCH, name, ": tensor on ", device_name(dev), ":", a.t.device_id,
         " but the context runs on ", device_name(rule.device_type), cpu_context ? "" : ":",
         cpu_context ? std::string() : std::to_string(rule.device_id), cpu_context ? " (host memory expected)" : "");
  }
}

void expect_host(const TensorArg& a, const char* name) {
  if (!is_host_memory(a.t.device_type)) {
    fail(SPARSA_STATUS_DEVICE_MISMATCH, name, ": expected host memory (CPU or CUDA_HOST), got ",
         device_name(a.t.device_type));
  }
}

namespace {

// ------------------------------------------------------------------------------------------------------------------
// Small helpers
// ------------------------------------------------------------------------------------------------------------------

int32_t read_i32(const TensorArg& a, int64_t i0) { return a.ptr<const int32_t>()[i0 * a.t.strides[0]]; }
int32_t read_i32(const TensorArg& a, int64_t i0, int64_t i1) {
  return a.ptr<const int32_t>()[i0 * a.t.strides[0] + i1 * a.t.strides[1]];
}
int32_t read_i32(const TensorArg& a, int64_t i0, int64_t i1, int64_t i2) {
  return a.ptr<const int32_t>()[i0 * a.t.strides[0] + i1 * a.t.strides[1] + i2 * a.t.strides[2]];
}

void expect_attention_dtype(const TensorArg& a, const char* name) {
  if (!is_attention_dtype(a.t.dtype)) {
    fail(SPARSA_STATUS_DTYPE_MISMATCH, name, ": dtype ", dtype_name(a.t.dtype), " (", a.t.dtype,
         "), expected F32, F16 or BF16");
  }
}

void expect_same_dtype(const TensorArg& a, const char* name, const TensorArg& ref, const char* ref_name) {
  if (a.t.dtype != ref.t.dtype) {
    fail(SPARSA_STATUS_DTYPE_MISMATCH, name, ": dtype ", dtype_name(a.t.dtype), " but ", ref_name, " is ",
         dtype_name(ref.t.dtype));
  }
}

// An extent the run keeps as int32 (batch, head counts, page size): larger values are refused, never truncated.
int32_t narrow_extent(int64_t value, const char* name, const sparsa_tensor& t, const char* what) {
  if (value > std::numeric_limits<int32_t>::max()) {
    fail(SPARSA_STATUS_SHAPE_MISMATCH, name, ": shape ", shape_string(t), " has ", what, " = ", value,
         ", more than INT32_MAX");
  }
  return static_cast<int32_t>(value);
}

void expect_at_least(int64_t value, int64_t minimum, const char* name) {
  if (value < minimum) fail(SPARSA_STATUS_INVALID_ARGUMENT, name, ": expected >= ", minimum, ", got ", value);
}

void expect_flag(int32_t value, const char* name) {
  if (value != 0 && value != 1) fail(SPARSA_STATUS_INVALID_ARGUMENT, name, ": expected 0 or 1, got ", value);
}

void expect_in_closed(float value, float lo, float hi, const char* name) {
  if (!(value >= lo && value <= hi)) {
    fail(SPARSA_STATUS_INVALID_ARGUMENT, name, ": expected a value in [", lo, ", ", hi, "], got ", value);
  }
}

// A tensor that only the host reads the contents of here must be readable: true on the CPU backend only.
bool contents_readable(const DeviceRule& rule) { return rule.device_type == SPARSA_DEVICE_CPU; }

// ------------------------------------------------------------------------------------------------------------------
// Layout: q/out, k/v, offsets, lengths, pages
// ------------------------------------------------------------------------------------------------------------------

// cu_seqlens[b] start at 0, never decrease, end at `extent` rows of `packed_name`. Returns the longest sequence.
int64_t check_cu_seqlens(const TensorArg& cu, const char* name, int64_t extent, const char* packed_name,
                         const char* extent_name) {
  const int64_t batch = cu.t.shape[0] - 1;
  if (read_i32(cu, 0) != 0) {
    fail(SPARSA_STATUS_INDEX_OUT_OF_RANGE, name, "[0]: expected 0, got ", read_i32(cu, 0));
  }
  int64_t longest = 0;
  for (int64_t b = 0; b < batch; ++b) {
    const int64_t begin = read_i32(cu, b), end = read_i32(cu, b + 1);
    if (end < begin) {
      fail(SPARSA_STATUS_INDEX_OUT_OF_RANGE, name, "[", b + 1, "] = ", end, " < ", name, "[", b, "] = ", begin,
           ": offsets must be non-decreasing");
    }
    longest = std::max(longest, end - begin);
  }
  if (read_i32(cu, batch) != extent) {
    fail(SPARSA_STATUS_INDEX_OUT_OF_RANGE, name, "[", batch, "] = ", read_i32(cu, batch), " but ", packed_name, " has ",
         extent_name, " = ", extent, " rows");
  }
  return longest;
}

void validate_layout(const DeviceRule& rule, AttentionProblem& pr) {
  const bool readable = contents_readable(rule);

  // q / out.
  pr.q_packed = pr.cu_seqlens_q.present;
  const int q_rank = pr.q_packed ? 3 : 4;
  const char* q_layout = pr.q_packed ? "[Tq, Hq, D] (packed, cu_seqlens_q given)" : "[B, Sq, Hq, D]";
  expect_rank(pr.q, "q", q_rank, q_layout);
  expect_last_stride_one(pr.q, "q");
  pr.num_q_heads = narrow_extent(pr.q.extent(q_rank - 2), "q", pr.q.t, "Hq");
  const int64_t head_dim = pr.q.extent(q_rank - 1);
  if (head_dim < 1 || head_dim > kMaxHeadDim) {
    fail(SPARSA_STATUS_SHAPE_MISMATCH, "q: head_dim D = ", head_dim, " (shape ", shape_string(pr.q.t),
         "), expected 1..", kMaxHeadDim);
  }
  if (pr.num_q_heads < 1) fail(SPARSA_STATUS_SHAPE_MISMATCH, "q: shape ", shape_string(pr.q.t), " has Hq = 0");
  pr.head_dim = static_cast<int32_t>(head_dim);
  expect_shape(pr.out, "out", ShapeSpec::of(pr.q.t), "q's shape");
  expect_last_stride_one(pr.out, "out");

  if (pr.q_packed) {
    expect_rank(pr.cu_seqlens_q, "cu_seqlens_q", 1, "[B+1]");
    if (pr.cu_seqlens_q.extent(0) < 1) {
      fail(SPARSA_STATUS_SHAPE_MISMATCH, "cu_seqlens_q: expected shape [B+1] with B >= 0, got [0]");
    }
    pr.batch = narrow_extent(pr.cu_seqlens_q.extent(0) - 1, "cu_seqlens_q", pr.cu_seqlens_q.t, "B");
    pr.max_seq_q =
        readable ? check_cu_seqlens(pr.cu_seqlens_q, "cu_seqlens_q", pr.q.extent(0), "q", "Tq") : pr.q.extent(0);
  } else {
    pr.batch = narrow_extent(pr.q.extent(0), "q", pr.q.t, "B");
    pr.max_seq_q = pr.q.extent(1);
  }
  // Token positions are int32 wherever the API carries them (cu_seqlens, seq_lens_k, indices, page ids), so a
  // sequence or packed row count past INT32_MAX cannot be addressed: refused, which also keeps every block count
  // and key-block product below int64 overflow.
  narrow_extent(pr.q.extent(q_rank == 3 ? 0 : 1), "q", pr.q.t, q_rank == 3 ? "Tq" : "Sq");
  const int64_t batch = pr.batch;

  // k / v.
  if (pr.page_table.present && pr.cu_seqlens_k.present) {
    fail(SPARSA_STATUS_INVALID_ARGUMENT, "cu_seqlens_k: not allowed together with page_table (paged KV carries ",
         "its lengths in seq_lens_k)");
  }
  if (pr.page_table.present && !pr.seq_lens_k.present) {
    fail(SPARSA_STATUS_NULL_POINTER, "seq_lens_k: required with page_table");
  }
  pr.kv_layout = pr.page_table.present     ? KvLayout::kPaged
                 : pr.cu_seqlens_k.present ? KvLayout::kPacked
                                           : KvLayout::kPadded;
  const int kv_rank = pr.kv_layout == KvLayout::kPacked ? 3 : 4;
  const char* kv_layout = pr.kv_layout == KvLayout::kPacked  ? "[Tk, Hkv, D] (packed, cu_seqlens_k given)"
                          : pr.kv_layout == KvLayout::kPaged ? "[P, page_size, Hkv, D] (paged, page_table given)"
                                                             : "[B, Skv, Hkv, D]";
  expect_rank(pr.k, "k", kv_rank, kv_layout);
  expect_shape(pr.v, "v", ShapeSpec::of(pr.k.t), "k's shape");
  expect_last_stride_one(pr.k, "k");
  expect_last_stride_one(pr.v, "v");
  pr.num_kv_heads = narrow_extent(pr.k.extent(kv_rank - 2), "k", pr.k.t, "Hkv");
  narrow_extent(pr.k.extent(kv_rank == 3 ? 0 : 1), "k", pr.k.t, kv_rank == 3 ? "Tk" : "Skv (or page_size)");
  if (pr.k.extent(kv_rank - 1) != head_dim) {
    fail(SPARSA_STATUS_SHAPE_MISMATCH, "k: shape ", shape_string(pr.k.t), " but q has head_dim ", head_dim);
  }
  if (pr.num_kv_heads < 1 || pr.num_q_heads % pr.num_kv_heads != 0) {
    fail(SPARSA_STATUS_SHAPE_MISMATCH, "k: Hkv = ", pr.num_kv_heads, " (shape ", shape_string(pr.k.t),
         ") does not divide q's Hq = ", pr.num_q_heads, " (GQA/MQA needs Hq % Hkv == 0)");
  }

  int64_t capacity_per_seq = 0;  // largest legal key count of one sequence (bounds seq_lens_k)
  switch (pr.kv_layout) {
    case KvLayout::kPadded:
      if (pr.k.extent(0) != batch) {
        fail(SPARSA_STATUS_SHAPE_MISMATCH, "k: shape ", shape_string(pr.k.t), " but q has batch B = ", batch);
      }
      pr.max_seq_k = pr.k.extent(1);
      capacity_per_seq = pr.k.extent(1);
      break;
    case KvLayout::kPacked:
      expect_shape(pr.cu_seqlens_k, "cu_seqlens_k", {batch + 1}, "B+1 from q");
      pr.max_seq_k =
          readable ? check_cu_seqlens(pr.cu_seqlens_k, "cu_seqlens_k", pr.k.extent(0), "k", "Tk") : pr.k.extent(0);
      break;
    case KvLayout::kPaged: {
      pr.page_size = narrow_extent(pr.k.extent(1), "k", pr.k.t, "page_size");
      if (pr.page_size < 1)
        fail(SPARSA_STATUS_SHAPE_MISMATCH, "k: paged cache ", shape_string(pr.k.t), " has page_size 0");
      expect_rank(pr.page_table, "page_table", 2, "[B, max_pages]");
      if (pr.page_table.extent(0) != batch) {
        fail(SPARSA_STATUS_SHAPE_MISMATCH, "page_table: shape ", shape_string(pr.page_table.t),
             " but q has batch B = ", batch);
      }
      narrow_extent(pr.page_table.extent(1), "page_table", pr.page_table.t, "max_pages");
      capacity_per_seq = pr.page_table.extent(1) * pr.page_size;  // both <= INT32_MAX: no overflow
      if (capacity_per_seq > std::numeric_limits<int32_t>::max()) {
        fail(SPARSA_STATUS_SHAPE_MISMATCH, "page_table: max_pages ", pr.page_table.extent(1), " * page_size ",
             pr.page_size, " tokens per sequence exceed INT32_MAX (token positions are int32)");
      }
      pr.max_seq_k = capacity_per_seq;
      break;
    }
  }

  // seq_lens_k: shortens padded sequences, gives paged lengths (and, with packed k/v, must fit the packed rows).
  if (pr.seq_lens_k.present) {
    expect_shape(pr.seq_lens_k, "seq_lens_k", {batch}, "[B] from q");
    if (readable) {
      int64_t longest = 0;
      for (int64_t b = 0; b < batch; ++b) {
        const int64_t len = read_i32(pr.seq_lens_k, b);
        int64_t cap = capacity_per_seq;
        const char* cap_source = pr.kv_layout == KvLayout::kPaged ? "max_pages * page_size" : "k's Skv";
        if (pr.kv_layout == KvLayout::kPacked) {
          cap = int64_t(read_i32(pr.cu_seqlens_k, b + 1)) - read_i32(pr.cu_seqlens_k, b);
          cap_source = "the packed length from cu_seqlens_k";
        }
        if (len < 0 || len > cap) {
          fail(SPARSA_STATUS_INDEX_OUT_OF_RANGE, "seq_lens_k[", b, "] = ", len, " outside [0, ", cap, "] (", cap_source,
               ")");
        }
        longest = std::max(longest, len);
      }
      if (pr.kv_layout != KvLayout::kPadded) pr.max_seq_k = longest;
    }
  }

  // Page ids of the pages each sequence uses.
  if (pr.kv_layout == KvLayout::kPaged && readable) {
    const int64_t num_pages = pr.k.extent(0);
    for (int64_t b = 0; b < batch; ++b) {
      const int64_t used = ceil_div(read_i32(pr.seq_lens_k, b), pr.page_size);
      for (int64_t p = 0; p < used; ++p) {
        const int64_t id = read_i32(pr.page_table, b, p);
        if (id < 0 || id >= num_pages) {
          fail(SPARSA_STATUS_INDEX_OUT_OF_RANGE, "page_table[", b, "][", p, "] = ", id, " outside [0, ", num_pages,
               ") (the caches hold P = ", num_pages, " pages)");
        }
      }
    }
  }

  // lse: [B, Hq, Sq] padded, [Hq, Tq] packed.
  if (pr.lse.present) {
    if (pr.q_packed) {
      expect_shape(pr.lse, "lse", {pr.num_q_heads, pr.q.extent(0)}, "[Hq, Tq] from q");
    } else {
      expect_shape(pr.lse, "lse", {batch, pr.num_q_heads, pr.q.extent(1)}, "[B, Hq, Sq] from q");
    }
  }
}

// ------------------------------------------------------------------------------------------------------------------
// Policy parameters and tensors
// ------------------------------------------------------------------------------------------------------------------

int64_t block_rows(const AttentionProblem& pr, int32_t block_q) { return ceil_div(pr.max_seq_q, block_q); }
int64_t block_cols(const AttentionProblem& pr, int32_t block_k) { return ceil_div(pr.max_seq_k, block_k); }

// A block-mask tensor [B, Hq, ceil(Sq/block_q), ceil(Skv/block_k)] (max lengths for varlen). When the longest
// sequence lives in device memory (varlen on a GPU backend) only [B, Hq, *, *] can be checked without a host sync.
void expect_block_mask_shape(const AttentionProblem& pr, const TensorArg& mask, const char* name, int32_t block_q,
                             int32_t block_k) {
  const bool max_lengths_known = pr.contents_validated || (!pr.q_packed && pr.kv_layout == KvLayout::kPadded);
  const char* why = "[B, Hq, ceil(Sq/block_q), ceil(Skv/block_k)]";
  if (max_lengths_known) {
    expect_shape(mask, name, {pr.batch, pr.num_q_heads, block_rows(pr, block_q), block_cols(pr, block_k)}, why);
    return;
  }
  expect_rank(mask, name, 4, why);
  if (mask.extent(0) != pr.batch || mask.extent(1) != pr.num_q_heads) {
    fail(SPARSA_STATUS_SHAPE_MISMATCH, name, ": shape ", shape_string(mask.t), ", expected [B = ", pr.batch,
         ", Hq = ", pr.num_q_heads, ", ceil(Sq/block_q), ceil(Skv/block_k)]");
  }
}

void validate_block_sizes(const sparsa_policy& p) {
  if (p.block_q <= 0) fail(SPARSA_STATUS_INVALID_ARGUMENT, "policy.block_q: expected > 0, got ", p.block_q);
  if (p.block_k <= 0) fail(SPARSA_STATUS_INVALID_ARGUMENT, "policy.block_k: expected > 0, got ", p.block_k);
}

// Domains of SPARGE's four per-head values; `head` >= 0 names a row of policy.sparge_head_params, -1 the scalars.
void validate_sparge_values(float theta, float tau, float topk_fraction, float lambda, int32_t head) {
  auto reject = [head](const char* field, const char* expected, float got) {
    if (head < 0) fail(SPARSA_STATUS_INVALID_ARGUMENT, "policy.sparge_", field, ": expected ", expected, ", got ", got);
    fail(SPARSA_STATUS_INVALID_ARGUMENT, "policy.sparge_head_params[", head, "]: ", field, " expected ", expected,
         ", got ", got);
  };
  if (!(theta >= -1.f && theta <= 1.f)) reject("theta", "a value in [-1, 1]", theta);
  if (!(tau > 0.f && tau <= 1.f)) reject("tau", "a value in (0, 1]", tau);
  if (!(topk_fraction >= 0.f && topk_fraction <= 1.f)) reject("topk_fraction", "a value in [0, 1]", topk_fraction);
  if (!(lambda <= 0.f)) reject("lambda", "<= 0 (natural-log units; -INFINITY = off)", lambda);
}

void validate_sparge(const AttentionProblem& pr, const DeviceRule& rule, PolicyParams& pp) {
  const sparsa_policy& p = pp.p;
  validate_block_sizes(p);
  validate_sparge_values(p.sparge_theta, p.sparge_tau, p.sparge_topk_fraction, p.sparge_lambda, -1);
  expect_flag(p.sparge_attention_sink, "policy.sparge_attention_sink");
  expect_flag(p.sparge_quantized, "policy.sparge_quantized");
  pp.sparge_head_params = read_tensor(p.sparge_head_params, "policy.sparge_head_params", false);
  if (!pp.sparge_head_params.present) return;
  const TensorArg& hp = pp.sparge_head_params;
  expect_on_device(hp, "policy.sparge_head_params", rule);
  expect_dtype(hp, "policy.sparge_head_params", SPARSA_DTYPE_F32);
  expect_shape(hp, "policy.sparge_head_params", {pr.num_q_heads, 4}, "[Hq, 4]: theta, tau, topk_fraction, lambda");
  if (!contents_readable(rule)) return;
  for (int32_t h = 0; h < pr.num_q_heads; ++h) {
    const float* row = hp.ptr<const float>();
    auto at = [&](int c) { return row[h * hp.t.strides[0] + c * hp.t.strides[1]]; };
    const float theta = std::isnan(at(0)) ? p.sparge_theta : at(0);
    const float tau = std::isnan(at(1)) ? p.sparge_tau : at(1);
    const float topk = std::isnan(at(2)) ? p.sparge_topk_fraction : at(2);
    const float lambda = std::isnan(at(3)) ? p.sparge_lambda : at(3);
    validate_sparge_values(theta, tau, topk, lambda, h);
  }
}

void validate_block_mask(const AttentionProblem& pr, const DeviceRule& rule, PolicyParams& pp) {
  validate_block_sizes(pp.p);
  pp.block_mask = read_tensor(pp.p.block_mask, "policy.block_mask", true);
  expect_on_device(pp.block_mask, "policy.block_mask", rule);
  expect_dtype(pp.block_mask, "policy.block_mask", SPARSA_DTYPE_U8);
  expect_block_mask_shape(pr, pp.block_mask, "policy.block_mask", pp.p.block_q, pp.p.block_k);
}

void validate_token_sparse(const AttentionProblem& pr, const sparsa_policy& p, const DeviceRule& rule) {
  if (p.token_sparse_window <= 0) {
    fail(SPARSA_STATUS_INVALID_ARGUMENT, "policy.token_sparse_window: expected > 0, got ", p.token_sparse_window);
  }
  if (p.token_sparse_pool_kernel <= 0 || p.token_sparse_pool_kernel % 2 == 0) {
    fail(SPARSA_STATUS_INVALID_ARGUMENT, "policy.token_sparse_pool_kernel: expected an odd value > 0, got ",
         p.token_sparse_pool_kernel);
  }
  expect_in_closed(p.token_sparse_coverage, 0.f, 1.f, "policy.token_sparse_coverage");
  expect_at_least(p.token_sparse_min_tokens, 0, "policy.token_sparse_min_tokens");
  // §5 is defined for self-attention prefill: Sq == Skv for every sequence.
  const bool lengths_known =
      contents_readable(rule) || (!pr.q_packed && pr.kv_layout == KvLayout::kPadded && !pr.seq_lens_k.present);
  if (!lengths_known) return;
  for (int32_t b = 0; b < pr.batch; ++b) {
    const int64_t sq = pr.seq_len_q(b), skv = pr.seq_len_k(b);
    if (sq != skv) {
      fail(SPARSA_STATUS_SHAPE_MISMATCH, "q: TOKEN_SPARSE needs Sq == Skv per sequence (§5), but sequence ", b,
           " has Sq = ", sq, " and Skv = ", skv);
    }
  }
}

void validate_token_select(const sparsa_policy& p) {
  expect_at_least(p.select_n_init, 0, "policy.select_n_init");
  expect_at_least(p.select_n_local, 0, "policy.select_n_local");
  expect_at_least(p.select_top_k, 1, "policy.select_top_k");
  expect_flag(p.select_scale_scores, "policy.select_scale_scores");
  expect_flag(p.select_per_kv_head, "policy.select_per_kv_head");
  if (!(p.select_cache_theta >= -1.f)) {
    fail(SPARSA_STATUS_INVALID_ARGUMENT, "policy.select_cache_theta: expected a cosine in [-1, 1] (>= 1 disables ",
         "the cache), got ", p.select_cache_theta);
  }
}

void validate_token_indices(const AttentionProblem& pr, const DeviceRule& rule, PolicyParams& pp) {
  const sparsa_policy& p = pp.p;
  expect_at_least(p.index_block_size, 1, "policy.index_block_size");
  expect_at_least(p.index_n_init, 0, "policy.index_n_init");
  expect_at_least(p.index_n_local, 0, "policy.index_n_local");
  pp.indices = read_tensor(p.indices, "policy.indices", true);
  expect_on_device(pp.indices, "policy.indices", rule);
  expect_dtype(pp.indices, "policy.indices", SPARSA_DTYPE_I32);
  expect_rank(pp.indices, "policy.indices", 3, "[B, H_idx, k]");
  const int64_t h_idx = narrow_extent(pp.indices.extent(1), "policy.indices", pp.indices.t, "H_idx");
  if (pp.indices.extent(0) != pr.batch || h_idx < 1) {
    fail(SPARSA_STATUS_SHAPE_MISMATCH, "policy.indices: shape ", shape_string(pp.indices.t),
         ", expected [B = ", pr.batch, ", H_idx >= 1, k]");
  }
  pp.head_map = read_tensor(p.head_map, "policy.head_map", false);
  if (pp.head_map.present) {
    expect_on_device(pp.head_map, "policy.head_map", rule);
    expect_dtype(pp.head_map, "policy.head_map", SPARSA_DTYPE_I32);
    expect_shape(pp.head_map, "policy.head_map", {pr.num_q_heads}, "[Hq] from q");
  } else if (pr.num_q_heads % h_idx != 0) {
    fail(SPARSA_STATUS_SHAPE_MISMATCH, "policy.indices: H_idx = ", h_idx, " does not divide q's Hq = ", pr.num_q_heads,
         "; pass policy.head_map to say which row each query head uses");
  }
  if (!contents_readable(rule)) return;
  if (pp.head_map.present) {
    for (int64_t h = 0; h < pr.num_q_heads; ++h) {
      const int32_t row = read_i32(pp.head_map, h);
      if (row < 0 || row >= h_idx) {
        fail(SPARSA_STATUS_INDEX_OUT_OF_RANGE, "policy.head_map[", h, "] = ", row, " outside [0, ", h_idx,
             ") (H_idx of policy.indices)");
      }
    }
  }
  const int64_t k = pp.indices.extent(2);
  for (int32_t b = 0; b < pr.batch; ++b) {
    const int64_t n = pr.seq_len_k(b);
    const int64_t limit = p.index_block_size == 1 ? n : ceil_div(n, p.index_block_size);
    for (int64_t hi = 0; hi < h_idx; ++hi) {
      for (int64_t s = 0; s < k; ++s) {
        const int32_t id = read_i32(pp.indices, b, hi, s);
        if (id < -1 || id >= limit) {
          fail(SPARSA_STATUS_INDEX_OUT_OF_RANGE, "policy.indices[", b, "][", hi, "][", s, "] = ", id, " outside [-1, ",
               limit, ") (", p.index_block_size == 1 ? "token ids; N = " : "block ids; N = ", n,
               p.index_block_size == 1 ? "" : ", block size ",
               p.index_block_size == 1 ? std::string() : std::to_string(p.index_block_size), ")");
        }
      }
    }
  }
}

void validate_delta(const AttentionProblem& pr, const sparsa_policy& p) {
  if (pr.lse.present) {
    fail(SPARSA_STATUS_INVALID_ARGUMENT, "lse: not defined for rows Δ corrects (§8); pass lse = NULL");
  }
  if (!pr.causal) {
    fail(SPARSA_STATUS_INVALID_ARGUMENT, "args.causal: SPARSA_POLICY_FLAG_DELTA requires causal = 1 (§8), got 0");
  }
  expect_at_least(p.delta_gamma, 1, "policy.delta_gamma");
  expect_at_least(p.delta_tail_min, 0, "policy.delta_tail_min");
}

// ------------------------------------------------------------------------------------------------------------------
// Introspection outputs and the selection cache
// ------------------------------------------------------------------------------------------------------------------

// query_offsets: the block policies' and TOKEN_INDICES' visibility reads §0's o per sequence; TOKEN_SPARSE,
// TOKEN_SELECT and Δ define their rows relative to the sequence's end (scoring window, q̄'s rows, anchors), so they
// refuse it.
void validate_query_offsets(const AttentionProblem& pr, const sparsa_policy& p, bool delta) {
  if (p.kind == SPARSA_POLICY_TOKEN_SPARSE || p.kind == SPARSA_POLICY_TOKEN_SELECT || delta) {
    fail(SPARSA_STATUS_UNSUPPORTED,
         "query_offsets: read by DENSE, SINK_WINDOW, BLOCK_SPARSE, SPARGE and TOKEN_INDICES only, not by ",
         delta ? "SPARSA_POLICY_FLAG_DELTA" : sparsa_policy_kind_name(p.kind));
  }
  expect_shape(pr.query_offsets, "query_offsets", {pr.batch}, "[B] from q");
  if (!pr.contents_validated) return;
  for (int32_t b = 0; b < pr.batch; ++b) {
    const int64_t o = read_i32(pr.query_offsets, b), sq = pr.seq_len_q(b), sk = pr.seq_len_k(b);
    if (o < -sq || o > sk) {
      fail(SPARSA_STATUS_INDEX_OUT_OF_RANGE, "query_offsets[", b, "] = ", o, " outside [-Sq, Skv] = [", -sq, ", ", sk,
           "] of sequence ", b);
    }
  }
}

// The largest N over the batch (padded k/v shortened by seq_lens_k count their real keys only).
int64_t longest_key_count(const AttentionProblem& pr) {
  if (!pr.contents_validated) return pr.max_seq_k;
  int64_t longest = 0;
  for (int32_t b = 0; b < pr.batch; ++b) longest = std::max(longest, pr.seq_len_k(b));
  return longest;
}

void validate_outputs(AttentionProblem& pr, const DeviceRule& rule, const sparsa_policy& p) {
  const int32_t kind = p.kind;
  const std::pair<const TensorArg*, const char*> written[] = {{&pr.out, "out"},
                                                              {&pr.lse, "lse"},
                                                              {&pr.selected_indices, "selected_indices"},
                                                              {&pr.block_mask_out, "block_mask_out"},
                                                              {&pr.stats, "stats"}};
  for (const auto& [arg, name] : written) {
    if (arg->present) expect_distinct_elements(*arg, name);
  }
  if (pr.selected_indices.present) {
    const char* name = "selected_indices";
    if (!policy_kind_info(kind)->index_sets) {
      fail(SPARSA_STATUS_UNSUPPORTED, name, ": only TOKEN_SELECT, TOKEN_SPARSE and TOKEN_INDICES report index ",
           "sets; policy is ", sparsa_policy_kind_name(kind));
    }
    expect_on_device(pr.selected_indices, name, rule);
    expect_dtype(pr.selected_indices, name, SPARSA_DTYPE_I32);
    expect_rank(pr.selected_indices, name, 3, "[B, H_sel, cap]");
    int64_t heads = pr.num_q_heads;
    int64_t cap = longest_key_count(pr);
    if (kind == SPARSA_POLICY_TOKEN_SELECT) {
      heads = p.select_per_kv_head ? pr.num_kv_heads : 1;
      const int64_t selected = token_select_set_size<int64_t>(p.select_n_init, p.select_top_k, p.select_n_local);
      cap = std::min(selected, pr.max_seq_k);
    }
    // Varlen on a GPU backend: the longest sequence is in device memory, so the capacity is the caller's promise.
    const bool max_len_known = pr.contents_validated || pr.kv_layout == KvLayout::kPadded;
    if (!max_len_known) cap = 0;
    if (pr.selected_indices.extent(0) != pr.batch || pr.selected_indices.extent(1) != heads ||
        pr.selected_indices.extent(2) < cap) {
      fail(SPARSA_STATUS_SHAPE_MISMATCH, name, ": shape ", shape_string(pr.selected_indices.t), ", expected [",
           pr.batch, ", ", heads, ", cap >= ", cap, "] for ", sparsa_policy_kind_name(kind));
    }
  }
  if (pr.block_mask_out.present) {
    const char* name = "block_mask_out";
    if (!policy_kind_info(kind)->predicts_mask) {
      fail(SPARSA_STATUS_UNSUPPORTED, name, ": only SPARGE predicts a block mask; policy is ",
           sparsa_policy_kind_name(kind));
    }
    expect_on_device(pr.block_mask_out, name, rule);
    expect_dtype(pr.block_mask_out, name, SPARSA_DTYPE_U8);
    expect_block_mask_shape(pr, pr.block_mask_out, name, p.block_q, p.block_k);
  }
  if (pr.stats.present) {
    expect_on_device(pr.stats, "stats", rule);
    expect_dtype(pr.stats, "stats", SPARSA_DTYPE_I64);
    expect_rank(pr.stats, "stats", 1, "[n]");
    if (pr.stats.extent(0) < 1) fail(SPARSA_STATUS_SHAPE_MISMATCH, "stats: expected shape [n] with n >= 1, got [0]");
  }
}

void validate_selection_cache(const sparsa_context& ctx, sparsa_selection_cache* cache, const sparsa_policy& p,
                              AttentionProblem& pr) {
  if (cache == nullptr) return;
  if (cache->owner != &ctx || !cache->state) {
    fail(SPARSA_STATUS_INVALID_ARGUMENT, "args.selection_cache: created with another context; a cache lives on ",
         "the device of the context that made it");
  }
  if (p.kind != SPARSA_POLICY_TOKEN_SELECT) return;  // other policies ignore it
  const SelectionCacheDims& d = cache->state->dims();
  auto cover = [](int64_t need, int64_t have, const char* what) {
    if (need > have) {
      fail(SPARSA_STATUS_SHAPE_MISMATCH, "args.selection_cache: created for ", what, " = ", have, " but the run has ",
           need);
    }
  };
  cover(pr.batch, d.max_batch, "max_batch");
  cover(pr.num_q_heads, d.num_q_heads, "num_q_heads");
  cover(pr.num_kv_heads, d.num_kv_heads, "num_kv_heads");
  cover(pr.head_dim, d.head_dim, "head_dim");
  cover(p.select_top_k, d.max_top_k, "max_top_k");
  pr.selection_cache = cache->state.get();
}

}  // namespace

// ------------------------------------------------------------------------------------------------------------------
// sparsa_attention_run
// ------------------------------------------------------------------------------------------------------------------

void validate_attention(const sparsa_context& ctx, const sparsa_attention_args* args_in, const sparsa_policy* policy_in,
                        AttentionProblem* problem, PolicyParams* params) {
  if (args_in == nullptr) {
    fail(SPARSA_STATUS_NULL_POINTER, "args: NULL (fill a sparsa_attention_args with sparsa_attention_args_init)");
  }
  const sparsa_attention_args args =
      read_caller_struct(*args_in, "args", default_attention_args());
  PolicyParams pp;
  pp.p = policy_in ? read_caller_struct(*policy_in, "policy", default_policy(SPARSA_POLICY_DENSE))
                   : default_policy(SPARSA_POLICY_DENSE);
  const sparsa_policy& p = pp.p;
  if (!is_known_policy_kind(p.kind)) {
    fail(SPARSA_STATUS_INVALID_ARGUMENT, "policy.kind: expected a sparsa_policy_kind in [0, ",
         kPolicyKindCount - 1, "], got ", p.kind);
  }
  if (p.flags & ~kKnownPolicyFlags) {
    fail(SPARSA_STATUS_INVALID_ARGUMENT, "policy.flags: unknown bits ", (p.flags & ~kKnownPolicyFlags),
         " (this sparsa knows only SPARSA_POLICY_FLAG_DELTA = 1)");
  }
  pp.delta = (p.flags & SPARSA_POLICY_FLAG_DELTA) != 0;
  expect_flag(args.causal, "args.causal");
  if (!(args.softmax_scale == 0.f || (std::isfinite(args.softmax_scale) && args.softmax_scale > 0.f))) {
    fail(SPARSA_STATUS_INVALID_ARGUMENT, "args.softmax_scale: expected 0 (= 1/sqrt(D)) or a finite value > 0, got ",
         args.softmax_scale);
  }

  AttentionProblem pr;
  const DeviceRule rule{ctx.options.device_type, ctx.options.device_id};
  pr.device_type = rule.device_type;
  pr.device_id = rule.device_id;
  struct Slot {
    const sparsa_tensor* t;
    const char* name;
    bool required;
    TensorArg* arg;
  };
  const Slot slots[] = {
      {args.q, "q", true, &pr.q},
      {args.k, "k", true, &pr.k},
      {args.v, "v", true, &pr.v},
      {args.out, "out", true, &pr.out},
      {args.lse, "lse", false, &pr.lse},
      {args.cu_seqlens_q, "cu_seqlens_q", false, &pr.cu_seqlens_q},
      {args.cu_seqlens_k, "cu_seqlens_k", false, &pr.cu_seqlens_k},
      {args.page_table, "page_table", false, &pr.page_table},
      {args.seq_lens_k, "seq_lens_k", false, &pr.seq_lens_k},
      {args.selected_indices, "selected_indices", false, &pr.selected_indices},
      {args.block_mask_out, "block_mask_out", false, &pr.block_mask_out},
      {args.stats, "stats", false, &pr.stats},
      {args.query_offsets, "query_offsets", false, &pr.query_offsets},
  };
  for (const Slot& s : slots) *s.arg = read_tensor(s.t, s.name, s.required);
  for (const Slot& s : slots) {
    if (s.arg->present) expect_on_device(*s.arg, s.name, rule);
  }

  // Dtypes.
  expect_attention_dtype(pr.q, "q");
  expect_same_dtype(pr.k, "k", pr.q, "q");
  expect_same_dtype(pr.v, "v", pr.q, "q");
  expect_same_dtype(pr.out, "out", pr.q, "q");
  pr.dtype = pr.q.t.dtype;
  if (pr.lse.present) expect_dtype(pr.lse, "lse", SPARSA_DTYPE_F32);
  for (const Slot& s : slots) {
    const bool offsets =
        s.arg == &pr.cu_seqlens_q || s.arg == &pr.cu_seqlens_k || s.arg == &pr.page_table || s.arg == &pr.seq_lens_k ||
        s.arg == &pr.query_offsets;
    if (offsets && s.arg->present) expect_dtype(*s.arg, s.name, SPARSA_DTYPE_I32);
  }

  validate_layout(rule, pr);
  pr.contents_validated = contents_readable(rule);
  // §5, §6 and §7 define TOKEN_SPARSE, TOKEN_SELECT and TOKEN_INDICES as causal: the flag cannot turn that off.
  pr.causal = args.causal == 1 || policy_kind_info(p.kind)->always_causal;
  pr.scale = args.softmax_scale != 0.f ? args.softmax_scale : 1.f / std::sqrt(static_cast<float>(pr.head_dim));

  switch (p.kind) {
    case SPARSA_POLICY_DENSE:
      break;
    case SPARSA_POLICY_SINK_WINDOW:
      expect_at_least(p.sink_tokens, 0, "policy.sink_tokens");
      expect_at_least(p.sink_window, 0, "policy.sink_window");
      break;
    case SPARSA_POLICY_BLOCK_SPARSE:
      validate_block_mask(pr, rule, pp);
      break;
    case SPARSA_POLICY_SPARGE:
      validate_sparge(pr, rule, pp);
      break;
    case SPARSA_POLICY_TOKEN_SPARSE:
      validate_token_sparse(pr, p, rule);
      break;
    case SPARSA_POLICY_TOKEN_SELECT:
      validate_token_select(p);
      break;
    case SPARSA_POLICY_TOKEN_INDICES:
      validate_token_indices(pr, rule, pp);
      break;
  }
  if (pp.delta) validate_delta(pr, p);
  if (pr.query_offsets.present) validate_query_offsets(pr, p, pp.delta);
  validate_outputs(pr, rule, p);
  validate_selection_cache(ctx, args.selection_cache, p, pr);

  *problem = pr;
  *params = pp;
}

}  // namespace sparsa
