// The dense decode kernels on 16-bit KV caches (cpu_decode.cpp drives them): one tile of keys against the query row
// of every head, reading each key's K and V rows straight from the cache (widened in registers, never stored as
// fp32), all kv heads of a key before the next key, so a thread walks its key range front to back.
//   scores      Sᵀ[j, h] = Σ_c q[h, c] · K[key j, kv head of h][c]
//   accumulate  o[h, :] += Σ_j Sᵀ[j, h] · V[key j, kv head of h][:]
// Two versions, head dims 64/128/256: AVX-512F (decode_avx512.cpp) and AVX2 + FMA + F16C (decode_avx2.cpp); on other
// CPUs (and other head dims) dense decode keeps the tile loop with the portable kernels.
#pragma once

#include <cstdint>

#include "cache_prefetch.h"

namespace sparsa::cpu {

// One tile of keys: k_rows[j] / v_rows[j] is key j's row of kv head 0; kv head hk's row is head_bytes · hk further.
// v_rows may be null for scores alone (TOKEN_SELECT's fp32 screen), which then fetches nothing ahead.
struct DecodeTile {
  const unsigned char* const* k_rows = nullptr;
  const unsigned char* const* v_rows = nullptr;
  int64_t k_head_bytes = 0, v_head_bytes = 0;
  int nk = 0;           // keys in the tile
  int n_kv_heads = 0;   // kv heads; query head h = hk · group + l reads kv head hk
  int group = 0;
  int d = 0;
  int32_t dtype = 0;    // SPARSA_DTYPE_F16 or SPARSA_DTYPE_BF16
  // Scattered rows (key lists, which the hardware prefetchers do not follow): scores also prefetches each key's K
  // rows kPrefetchKeysAhead keys ahead into L1 (see prefetch_for_key).
  bool prefetch_rows = false;
  // Non-zero: the keys are a range, key j + 1's K row k_key_bytes after key j's, past the tile's end as well, so
  // that K can be fetched ahead across tiles (see prefetch_for_block_head). Zero: only the tile's own rows.
  int64_t k_key_bytes = 0;
  // Non-null: scores also maxes each kv head's largest |K| over the tile's rows into k_magnitudes[hk], as the 16-bit
  // magnitude bits (fp16 and bf16 magnitudes order like their bits), from the K bits it loads for the scores (the
  // fp32 screen's separate pass over a tile's rows took 0.2-0.3 ms of TOKEN_SELECT's 2.5 at 8K keys, one thread,
  // Zen 4).
  uint16_t* k_magnitudes = nullptr;
  // Non-null: accumulate also fetches these rows into L2 (rows_ahead[j] for j < nk, every kv head: the next tile's V
  // rows), key j's row of a kv head as it adds key j's row of that head, so that the fetches spread over the P·V
  // (see prefetch_row_ahead).
  const unsigned char* const* rows_ahead = nullptr;
};
constexpr int kPrefetchKeysAhead = 4;

// Prefetches one key's rows, every kv head of the tile (row: kv head 0's row; head_bytes: K's or V's kv head stride),
// with prefetch_line (prefetch_line_to_l1 or _l2).
inline void prefetch_key_rows(const unsigned char* row, int64_t head_bytes, const DecodeTile& tile,
                              void (*prefetch_line)(const void*)) {
  for (int hk = 0; hk < tile.n_kv_heads; ++hk, row += head_bytes)
    prefetch_span(row, tile.d * 2, prefetch_line);  // 16-bit elements
}

// What the scores kernel prefetches before key j of a tile. Each key's V rows go to L2 while the tile is scored, so
// that accumulate finds them there (a tile's V rows, 256 KiB at 128 keys × 8 kv heads × D 128, would not stay in L1):
// dense fp16 decode at 32K keys, one thread, Zen 4, 13.1-14.0 -> 10.1-10.8 ms. On a key range the hardware
// prefetchers stream K (fetching it as well measured slower: 2-8 keys ahead into L1 11.9-13.6 ms, 16 or 32 ahead
// into L2 10.9-11.1 ms, against 10.0); on a key list each key's K rows are fetched kPrefetchKeysAhead keys ahead.
inline void prefetch_for_key(const DecodeTile& tile, int j) {
  if (tile.v_rows) prefetch_key_rows(tile.v_rows[j], tile.v_head_bytes, tile, prefetch_line_to_l2);
  if (tile.prefetch_rows && j + kPrefetchKeysAhead < tile.nk)
    prefetch_key_rows(tile.k_rows[j + kPrefetchKeysAhead], tile.k_head_bytes, tile, prefetch_line_to_l1);
}

// What accumulate prefetches as it adds key j's row of kv head hk, where tile.rows_ahead is set: key j's row of that
// head in tile.rows_ahead. A tile whose scores the caller already holds (KnownScores, cpu_engine.h) has no scoring for
// its V fetches to hide behind; fetched all at once before the P·V, the core waited on them and the memory then idled
// through the P·V (TOKEN_SELECT at 8K keys, N/4 kept, one thread, Zen 4: the known tiles' V fetch and P·V 450-515 us);
// spread over it, 380-405 us.
inline void prefetch_row_ahead(const DecodeTile& tile, int j, int hk) {
  prefetch_span(tile.rows_ahead[j] + hk * tile.v_head_bytes, tile.d * 2, prefetch_line_to_l2);
}

// What a scores kernel that takes blocks of keys (AVX-512F) prefetches before kv head hk of keys [j, j + n): those
// rows of V into L2, and K rows ahead, one kv head at a time so that the fetches spread over the block. On a key range
// the hardware prefetchers do not follow a block's order (kv head by kv head, each key's row 2 KiB from the next at 8
// kv heads and D = 128: a plain loop of loads in that order read 11 GB/s on Zen 4, the same loop in address order
// 27-30), so K goes to L2 kBlockPrefetchKeysAhead keys ahead, across tiles where DecodeTile::k_key_bytes allows (a
// stand-alone loop of the kernel over 64 MiB of K, Zen 4: 14 ns per key and kv head, 16 to 64 keys ahead alike;
// into L1 28-29; without 29, against 19 for the kernel that scored a key at a time). On a key list K goes to L1
// kPrefetchKeysAhead keys ahead, as prefetch_for_key does.
constexpr int kBlockPrefetchKeysAhead = 16;
inline void prefetch_for_block_head(const DecodeTile& tile, int j, int n, int hk) {
  const int64_t row_bytes = int64_t(tile.d) * 2;  // 16-bit elements
  if (tile.v_rows)
    for (int t = j; t < j + n; ++t)
      prefetch_span(tile.v_rows[t] + hk * tile.v_head_bytes, row_bytes, prefetch_line_to_l2);
  if (!tile.prefetch_rows && tile.k_key_bytes != 0) {
    // Past the tile's end the rows may lie past the cache's end too: addresses as integers (a prefetch never faults).
    uintptr_t ahead = reinterpret_cast<uintptr_t>(tile.k_rows[j] + hk * tile.k_head_bytes) +
                      uintptr_t(kBlockPrefetchKeysAhead * tile.k_key_bytes);
    for (int t = 0; t < n; ++t, ahead += uintptr_t(tile.k_key_bytes))
      prefetch_span(reinterpret_cast<const void*>(ahead), row_bytes, prefetch_line_to_l2);
    return;
  }
  const int ahead = tile.prefetch_rows ? kPrefetchKeysAhead : kBlockPrefetchKeysAhead;
  const int end = j + ahead + n < tile.nk ? j + ahead + n : tile.nk;
  for (int t = j + ahead; t < end; ++t) {
    const unsigned char* row = tile.k_rows[t] + hk * tile.k_head_bytes;
    if (tile.prefetch_rows) {
      prefetch_span(row, row_bytes, prefetch_line_to_l1);
    } else {
      prefetch_span(row, row_bytes, prefetch_line_to_l2);
    }
  }
}

struct DecodeKernels {
  // st[j * st_stride + h] for j < nk, h < n_kv_heads · group; q is [Hq, d] fp32 (scale folded in).
  void (*scores)(const DecodeTile& tile, const float* q, float* st, int st_stride);
  // o[h * d + c] += Σ_j st[j * st_stride + h] · V_j[c] (terms with a zero probability skipped).
  void (*accumulate)(const DecodeTile& tile, const float* st, int st_stride, float* o);
  const char* name;  // "avx512f" or "avx2"
};

// The AVX-512F (AVX2 + FMA + F16C) table when this CPU has those instructions, the library was built for x86-64 (and
// not with SPARSA_CPU_PORTABLE_KERNELS) and d is 64, 128 or 256; else null.
const DecodeKernels* avx512_decode_kernels(int d);
const DecodeKernels* avx2_decode_kernels(int d);
// The one the backend uses: AVX-512F, else AVX2; null where neither applies (the caller keeps the tile loop).
inline const DecodeKernels* select_decode_kernels(int d) {
  if (const DecodeKernels* kernels = avx512_decode_kernels(d)) return kernels;
  return avx2_decode_kernels(d);
}

}  // namespace sparsa::cpu
