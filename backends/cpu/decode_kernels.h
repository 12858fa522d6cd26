// The dense decode kernels on 16-bit KV caches (cpu_decode.cpp drives them): one tile of keys against the query row
// of every head, reading each key's K and V rows straight from the cache (widened in registers, never stored as
// fp32), all kv heads of a key before the next key, so a thread walks its key range front to back.
//   scores      Sᵀ[j, h] = Σ_c q[h, c] · K[key j, kv head of h][c]
//   accumulate  o[h, :] += Σ_j Sᵀ[j, h] · V[key j, kv head of h][:]
// AVX-512F only (decode_avx512.cpp, head dims 64/128/256): elsewhere dense decode keeps the tile loop, whose AVX2 /
// portable kernels already serve it (measured on AVX-512: the range path pays with these kernels).
#pragma once

#include <cstdint>

namespace sparsa::cpu {

// One tile of keys: k_rows[j] / v_rows[j] is key j's row of kv head 0; kv head hk's row is head_bytes · hk further.
struct DecodeTile {
  const unsigned char* const* k_rows = nullptr;
  const unsigned char* const* v_rows = nullptr;
  int64_t k_head_bytes = 0, v_head_bytes = 0;
  int nk = 0;           // keys in the tile
  int n_kv_heads = 0;   // kv heads; query head h = hk · group + l reads kv head hk
  int group = 0;
  int d = 0;
  int32_t dtype = 0;    // SPARSA_DTYPE_F16 or SPARSA_DTYPE_BF16
  // Scattered rows (key lists, which the hardware prefetchers do not follow): scores prefetches each key's V rows
  // (for accumulate, after the tile's softmax) and K rows kPrefetchKeysAhead keys ahead.
  bool prefetch_rows = false;
};
constexpr int kPrefetchKeysAhead = 4;

struct DecodeKernels {
  // st[j * st_stride + h] for j < nk, h < n_kv_heads · group; q is [Hq, d] fp32 (scale folded in).
  void (*scores)(const DecodeTile& tile, const float* q, float* st, int st_stride);
  // o[h * d + c] += Σ_j st[j * st_stride + h] · V_j[c] (terms with a zero probability skipped).
  void (*accumulate)(const DecodeTile& tile, const float* st, int st_stride, float* o);
  const char* name;  // "avx512f"
};

// The AVX-512F table when this CPU has AVX-512F, the library was built for x86-64 (and not with
// SPARSA_CPU_PORTABLE_KERNELS) and d is 64, 128 or 256; else null.
const DecodeKernels* avx512_decode_kernels(int d);

}  // namespace sparsa::cpu
