// Validation of the backend utilities: sparsa_merge_states, sparsa_topk_from_scores, sparsa_kv_prefetch.
// Same rules as validate.cpp: every check throws sparsa::Error naming the argument; nothing is written.
#include <algorithm>
#include <limits>
#include <vector>

#include "tensor_util.h"
#include "validate.h"

namespace sparsa {
namespace {

void expect_float_dtype(const TensorArg& a, const char* name) {
  if (!is_attention_dtype(a.t.dtype)) {
    fail(SPARSA_STATUS_DTYPE_MISMATCH, name, ": dtype ", dtype_name(a.t.dtype), ", expected F32, F16 or BF16");
  }
}

void expect_same_dtype_as(const TensorArg& a, const char* name, const TensorArg& ref, const char* ref_name) {
  if (a.t.dtype != ref.t.dtype) {
    fail(SPARSA_STATUS_DTYPE_MISMATCH, name, ": dtype ", dtype_name(a.t.dtype), " but ", ref_name, " is ",
         dtype_name(ref.t.dtype));
  }
}

ShapeSpec shape_of(const TensorArg& a) { return ShapeSpec::of(a.t); }

}  // namespace

MergeProblem validate_merge(const DeviceRule& rule, const sparsa_tensor* o_a, const sparsa_tensor* lse_a,
                            const sparsa_tensor* o_b, const sparsa_tensor* lse_b, const sparsa_tensor* out,
                            const sparsa_tensor* out_lse) {
  MergeProblem m;
  m.o_a = read_tensor(o_a, "o_a", true);
  m.lse_a = read_tensor(lse_a, "lse_a", true);
  m.o_b = read_tensor(o_b, "o_b", true);
  m.lse_b = read_tensor(lse_b, "lse_b", true);
  m.out = read_tensor(out, "out", true);
  m.out_lse = read_tensor(out_lse, "out_lse", false);
  const std::pair<const TensorArg*, const char*> all[] = {{&m.o_a, "o_a"}, {&m.lse_a, "lse_a"},
                                                          {&m.o_b, "o_b"}, {&m.lse_b, "lse_b"},
                                                          {&m.out, "out"}, {&m.out_lse, "out_lse"}};
  for (const auto& [arg, name] : all) {
    if (arg->present) expect_on_device(*arg, name, rule);
  }
  expect_float_dtype(m.o_a, "o_a");
  expect_same_dtype_as(m.o_b, "o_b", m.o_a, "o_a");
  expect_same_dtype_as(m.out, "out", m.o_a, "o_a");
  expect_dtype(m.lse_a, "lse_a", SPARSA_DTYPE_F32);
  expect_dtype(m.lse_b, "lse_b", SPARSA_DTYPE_F32);
  if (m.out_lse.present) expect_dtype(m.out_lse, "out_lse", SPARSA_DTYPE_F32);

  m.packed = m.o_a.t.ndim == 3;
  if (m.o_a.t.ndim != 3 && m.o_a.t.ndim != 4) {
    fail(SPARSA_STATUS_SHAPE_MISMATCH, "o_a: expected rank 4 [B, S, H, D] or rank 3 [T, H, D], got shape ",
         shape_string(m.o_a.t));
  }
  const int64_t head_dim = m.o_a.t.shape[m.o_a.t.ndim - 1];
  if (head_dim > std::numeric_limits<int32_t>::max()) {  // rows are handled as int32 D elements
    fail(SPARSA_STATUS_SHAPE_MISMATCH, "o_a: shape ", shape_string(m.o_a.t), " has D = ", head_dim,
         ", more than INT32_MAX");
  }
  expect_shape(m.o_b, "o_b", shape_of(m.o_a), "o_a's shape");
  expect_shape(m.out, "out", shape_of(m.o_a), "o_a's shape");
  expect_last_stride_one(m.o_a, "o_a");
  expect_last_stride_one(m.o_b, "o_b");
  expect_last_stride_one(m.out, "out");
  const auto& s = m.o_a.t.shape;
  const ShapeSpec lse_shape = m.packed ? ShapeSpec{s[1], s[0]} : ShapeSpec{s[0], s[2], s[1]};
  const char* why = m.packed ? "[H, T] from o_a" : "[B, H, S] from o_a";
  expect_shape(m.lse_a, "lse_a", lse_shape, why);
  expect_shape(m.lse_b, "lse_b", lse_shape, why);
  if (m.out_lse.present) expect_shape(m.out_lse, "out_lse", lse_shape, why);
  expect_distinct_elements(m.out, "out");
  if (m.out_lse.present) expect_distinct_elements(m.out_lse, "out_lse");
  return m;
}

TopkCall validate_topk(const DeviceRule& rule, const sparsa_tensor* scores, int32_t k, int32_t block_size,
                       const sparsa_tensor* out_indices) {
  TopkCall c;
  c.scores = read_tensor(scores, "scores", true);
  c.out_indices = read_tensor(out_indices, "out_indices", true);
  expect_on_device(c.scores, "scores", rule);
  expect_on_device(c.out_indices, "out_indices", rule);
  expect_dtype(c.scores, "scores", SPARSA_DTYPE_F32);
  expect_dtype(c.out_indices, "out_indices", SPARSA_DTYPE_I32);
  expect_rank(c.scores, "scores", 3, "[B, H, N]");
  if (block_size < 1) fail(SPARSA_STATUS_INVALID_ARGUMENT, "block_size: expected >= 1, got ", block_size);
  const int64_t n = c.scores.extent(2);
  const int64_t candidates = block_size == 1 ? n : ceil_div(n, block_size);
  if (k < 1 || k > candidates) {
    fail(SPARSA_STATUS_SHAPE_MISMATCH, "k: expected 1 <= k <= ", candidates,
         block_size == 1 ? " (N tokens of scores)" : " (blocks of scores at this block_size)", ", got ", k);
  }
  expect_shape(c.out_indices, "out_indices", {c.scores.extent(0), c.scores.extent(1), k}, "[B, H, k]");
  expect_distinct_elements(c.out_indices, "out_indices");
  return c;
}

PrefetchProblem validate_prefetch(const DeviceRule& rule, const sparsa_tensor* k_src, const sparsa_tensor* v_src,
                                  const sparsa_tensor* indices, const sparsa_tensor* k_dst, const sparsa_tensor* v_dst,
                                  const sparsa_tensor* positions, const sparsa_tensor* remapped,
                                  const sparsa_tensor* counts) {
  PrefetchProblem p;
  p.k_src = read_tensor(k_src, "k_src", true);
  p.v_src = read_tensor(v_src, "v_src", true);
  p.indices = read_tensor(indices, "indices", true);
  p.k_dst = read_tensor(k_dst, "k_dst", true);
  p.v_dst = read_tensor(v_dst, "v_dst", true);
  p.positions = read_tensor(positions, "positions", true);
  p.remapped = read_tensor(remapped, "remapped", true);
  p.counts = read_tensor(counts, "counts", false);

  // Sources and indices are host memory (the point of prefetch); destinations live on the context's device.
  expect_host(p.k_src, "k_src");
  expect_host(p.v_src, "v_src");
  expect_host(p.indices, "indices");
  expect_on_device(p.k_dst, "k_dst", rule);
  expect_on_device(p.v_dst, "v_dst", rule);
  expect_on_device(p.positions, "positions", rule);
  expect_on_device(p.remapped, "remapped", rule);
  if (p.counts.present) expect_on_device(p.counts, "counts", rule);

  expect_float_dtype(p.k_src, "k_src");
  expect_same_dtype_as(p.v_src, "v_src", p.k_src, "k_src");
  expect_same_dtype_as(p.k_dst, "k_dst", p.k_src, "k_src");
  expect_same_dtype_as(p.v_dst, "v_dst", p.k_src, "k_src");
  expect_dtype(p.indices, "indices", SPARSA_DTYPE_I32);
  expect_dtype(p.positions, "positions", SPARSA_DTYPE_I32);
  expect_dtype(p.remapped, "remapped", SPARSA_DTYPE_I32);
  if (p.counts.present) expect_dtype(p.counts, "counts", SPARSA_DTYPE_I32);

  expect_rank(p.k_src, "k_src", 4, "[B, N, Hkv, D]");
  expect_shape(p.v_src, "v_src", shape_of(p.k_src), "k_src's shape");
  expect_last_stride_one(p.k_src, "k_src");
  expect_last_stride_one(p.v_src, "v_src");
  const int64_t batch = p.k_src.extent(0), n = p.k_src.extent(1);
  const int64_t hkv = p.k_src.extent(2), d = p.k_src.extent(3);
  expect_rank(p.indices, "indices", 3, "[B, H_idx, k]");
  if (p.indices.extent(0) != batch) {
    fail(SPARSA_STATUS_SHAPE_MISMATCH, "indices: shape ", shape_string(p.indices.t),
         " but k_src has batch B = ", batch);
  }
  expect_rank(p.k_dst, "k_dst", 4, "[B, C, Hkv, D]");
  const int64_t capacity = p.k_dst.extent(1);
  expect_shape(p.k_dst, "k_dst", {batch, capacity, hkv, d}, "[B, C, Hkv, D] from k_src");
  expect_shape(p.v_dst, "v_dst", shape_of(p.k_dst), "k_dst's shape");
  expect_last_stride_one(p.k_dst, "k_dst");
  expect_last_stride_one(p.v_dst, "v_dst");
  expect_shape(p.positions, "positions", {batch, capacity}, "[B, C] from k_dst");
  expect_shape(p.remapped, "remapped", shape_of(p.indices), "indices' shape");
  if (p.counts.present) expect_shape(p.counts, "counts", {batch}, "[B] from k_src");
  // Every element of positions (all of C) and remapped (every slot) is written: with outputs that do not overlap,
  // that work is bounded by memory the caller owns.
  expect_distinct_elements(p.k_dst, "k_dst");
  expect_distinct_elements(p.v_dst, "v_dst");
  expect_distinct_elements(p.positions, "positions");
  expect_distinct_elements(p.remapped, "remapped");
  if (p.counts.present) expect_distinct_elements(p.counts, "counts");

  // Index range and the per-sequence union size, which must fit C. The union is sorted out of the ids themselves,
  // so the memory it takes follows the index tensor, never N (which may be huge and only touched where selected).
  const int64_t h_idx = p.indices.extent(1), k = p.indices.extent(2);
  if (batch == 0 || h_idx == 0 || k == 0) return p;
  std::vector<int32_t> selected;
  selected.reserve(static_cast<size_t>(h_idx * k));
  const int32_t* ids = p.indices.ptr<const int32_t>();
  const int64_t* st = p.indices.t.strides;
  for (int64_t b = 0; b < batch; ++b) {
    selected.clear();
    for (int64_t h = 0; h < h_idx; ++h) {
      for (int64_t s = 0; s < k; ++s) {
        const int32_t id = ids[b * st[0] + h * st[1] + s * st[2]];
        if (id < -1 || id >= n) {
          fail(SPARSA_STATUS_INDEX_OUT_OF_RANGE, "indices[", b, "][", h, "][", s, "] = ", id, " outside [-1, ", n,
               ") (N tokens of k_src)");
        }
        if (id >= 0) selected.push_back(id);
      }
    }
    std::sort(selected.begin(), selected.end());
    const int64_t union_size = std::unique(selected.begin(), selected.end()) - selected.begin();
    if (union_size > capacity) {
      fail(SPARSA_STATUS_SHAPE_MISMATCH, "k_dst: capacity C = ", capacity, " but sequence ", b, " selects ", union_size,
           " distinct tokens");
    }
  }
  return p;
}

}  // namespace sparsa
