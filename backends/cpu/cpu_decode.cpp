// Dense decode over a key range on a 16-bit KV cache (attend_decode_keys, cpu_engine.h) with the AVX-512F decode
// kernels (decode_kernels.h); run_dense uses it only where they exist.
//
// One call keeps every query head's state (q, o, m, l) for sequence b and streams the range's keys in tiles of
// kDecodeTileKeys: all kv heads of a key are read before the next key, so the K and V bytes of the range are read
// front to back once (measured on this backend's default [B, S, Hkv, D] layout: one kv head at a time over the same
// keys reads memory several times slower than front to back; the hardware prefetchers follow the front-to-back
// stream, and software prefetching on top of it measured slower). Per tile: Sᵀ = K·qᵀ for every head, the online
// softmax with the fp32 tile microkernels (column max, exp, rescale), then o += P·V.
#include <algorithm>
#include <cstring>
#include <limits>

#include "../../src/common/softmax_state.h"
#include "../../src/error.h"
#include "attention_loop.h"
#include "cpu_convert.h"
#include "cpu_engine.h"
#include "decode_kernels.h"
#include "microkernels.h"

namespace sparsa::cpu {
namespace {

constexpr float kNegInf = -std::numeric_limits<float>::infinity();

int round_up(int n, int multiple) { return (n + multiple - 1) / multiple * multiple; }

}  // namespace

size_t decode_keys_floats(int head_dim, int num_q_heads) {
  const size_t hq = size_t(num_q_heads);
  const size_t st_stride = size_t(round_up(std::max(num_q_heads, 1), kRowAlign) + kStridePad);
  const size_t pointers = scratch_floats<const unsigned char*>(2 * size_t(kDecodeTileKeys));
  return pointers + hq * size_t(head_dim) + size_t(kDecodeTileKeys) * st_stride + 5 * st_stride;
}

void attend_decode_keys(const AttentionProblem& problem, int32_t b, int64_t key_begin, int64_t key_end,
                        float* out_rows, float* lse_rows, RunCounters* counters, ThreadScratch& scratch) {
  const int d = problem.head_dim;
  const int hq = problem.num_q_heads;
  const int hkv = problem.num_kv_heads;
  const int nr_pad = round_up(std::max(hq, 1), kRowAlign);
  const int st_stride = nr_pad + kStridePad;
  const int64_t eb = element_bytes(problem.dtype);
  const Microkernels& kernels = select_microkernels();
  const DecodeKernels* kernels_or_null = avx512_decode_kernels(d);
  if (!kernels_or_null) fail(SPARSA_STATUS_INTERNAL, "attend_decode_keys: no decode kernels for head_dim ", d);
  const DecodeKernels& decode = *kernels_or_null;

  float* next = scratch.reserve(decode_keys_floats(d, hq));
  auto carve = [&next](size_t floats) {
    float* carved = next;
    next += floats;
    return carved;
  };
  // The row pointers first (8-byte aligned at the start of the buffer), then the floats.
  auto** rows = reinterpret_cast<const unsigned char**>(
      carve(scratch_floats<const unsigned char*>(2 * size_t(kDecodeTileKeys))));
  const unsigned char** k_rows = rows;
  const unsigned char** v_rows = rows + kDecodeTileKeys;
  float* q = carve(size_t(hq) * d);
  float* o = out_rows;  // unnormalised accumulator, normalised at the end
  float* st = carve(size_t(kDecodeTileKeys) * st_stride);
  float* m = carve(size_t(st_stride));
  float* l = carve(size_t(st_stride));
  float* local_max = carve(size_t(st_stride));
  float* shift = carve(size_t(st_stride));
  float* block_sum = carve(size_t(st_stride));

  for (int h = 0; h < hq; ++h) {
    load_row_f32(problem.dtype, problem.q.t.data, problem.q_offset(problem.q, b, 0, h), d, q + int64_t(h) * d);
    for (int c = 0; c < d; ++c) q[int64_t(h) * d + c] *= problem.scale;
  }
  std::memset(o, 0, sizeof(float) * size_t(hq) * size_t(d));
  for (int r = 0; r < st_stride; ++r) {
    m[r] = kNegInf;
    l[r] = 0.f;
  }
  for (int j = 0; j < int(kDecodeTileKeys); ++j)
    for (int r = hq; r < st_stride; ++r) st[int64_t(j) * st_stride + r] = 0.f;  // padding columns stay finite

  const unsigned char* k_base = static_cast<const unsigned char*>(problem.k.t.data);
  const unsigned char* v_base = static_cast<const unsigned char*>(problem.v.t.data);
  const auto k_row = [&](int64_t t, int32_t hk) { return k_base + problem.kv_offset(problem.k, b, t, hk) * eb; };
  const auto v_row = [&](int64_t t, int32_t hk) { return v_base + problem.kv_offset(problem.v, b, t, hk) * eb; };
  DecodeTile tile;
  tile.k_rows = k_rows;
  tile.v_rows = v_rows;
  tile.k_head_bytes = hkv > 1 ? k_row(key_begin, 1) - k_row(key_begin, 0) : 0;
  tile.v_head_bytes = hkv > 1 ? v_row(key_begin, 1) - v_row(key_begin, 0) : 0;
  tile.n_kv_heads = hkv;
  tile.group = hq / hkv;
  tile.d = d;
  tile.dtype = problem.dtype;

  for (int64_t key0 = key_begin; key0 < key_end; key0 += kDecodeTileKeys) {
    const int nk = int(std::min(kDecodeTileKeys, key_end - key0));
    for (int j = 0; j < nk; ++j) {
      k_rows[j] = k_row(key0 + j, 0);
      v_rows[j] = v_row(key0 + j, 0);
    }
    tile.nk = nk;
    decode.scores(tile, q, st, st_stride);
    kernels.column_max(st, st_stride, nk, nr_pad, local_max);
    for (int r = 0; r < nr_pad; ++r) {
      const float m_new = std::max(m[r], local_max[r]);
      shift[r] = m_new == kNegInf ? 0.f : m_new;
    }
    kernels.exp_columns(st, st_stride, nk, nr_pad, shift, block_sum);
    for (int r = 0; r < hq; ++r) {
      if (local_max[r] == kNegInf) continue;
      const SoftmaxState state{m[r], l[r]};
      const float alpha = state.rescale_to(shift[r]);
      if (alpha != 1.f) kernels.scale_row(o + int64_t(r) * d, d, alpha);
      m[r] = shift[r];
      l[r] = state.l * alpha + block_sum[r];
    }
    decode.accumulate(tile, st, st_stride, o);
    if (counters) counters->pairs_computed += int64_t(hq) * nk;
  }
  for (int r = 0; r < hq; ++r) {
    const SoftmaxState state{m[r], l[r]};
    lse_rows[r] = state.finalize(o + int64_t(r) * d, d);
  }
}

}  // namespace sparsa::cpu
