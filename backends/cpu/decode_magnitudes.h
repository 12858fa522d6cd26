// The largest |K| of a kv head's 16-bit rows as the decode kernels keep it for DecodeTile::k_magnitudes: the
// magnitude bits (the bits without the sign; fp16 and bf16 magnitudes order like their bits), 16 lanes at a time.
// x86-64 only; the functions need AVX2, which every caller's target (the AVX2 and AVX-512F kernels) includes.
#pragma once

#if defined(__x86_64__)
#include <immintrin.h>

#include <cstdint>

#include "decode_kernels.h"

namespace sparsa::cpu {

// Kv heads whose running maxima a scores kernel keeps as it scores (on the stack, one 256-bit vector each); a tile
// with more takes max_tile_magnitudes after its scores.
constexpr int kMaxMagnitudeHeads = 16;

// Lane by lane, the larger magnitude of so_far and of bits.
__attribute__((target("avx2"))) inline __m256i max_magnitude(__m256i so_far, __m256i bits) {
  return _mm256_max_epu16(so_far, _mm256_and_si256(bits, _mm256_set1_epi16(0x7fff)));
}

// Lane by lane, the largest magnitude of so_far and of a row of kValues 16-bit values (a multiple of 16).
template <int kValues>
__attribute__((target("avx2"))) inline __m256i row_magnitudes(const unsigned char* row, __m256i so_far) {
  constexpr int kVectorBytes = 32;
#pragma GCC unroll 16
  for (int x = 0; x < kValues * 2 / kVectorBytes; ++x)
    so_far = max_magnitude(so_far, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(row + kVectorBytes * x)));
  return so_far;
}

// The largest of the lanes, maxed into *largest.
__attribute__((target("avx2"))) inline void store_magnitude(__m256i lanes, uint16_t* largest) {
  alignas(32) uint16_t values[16];
  _mm256_store_si256(reinterpret_cast<__m256i*>(values), lanes);
  for (uint16_t value : values) *largest = value > *largest ? value : *largest;
}

// tile.k_magnitudes from a pass over the tile's rows of kValues values, where the scores kernel did not keep them.
template <int kValues>
__attribute__((target("avx2"))) inline void max_tile_magnitudes(const DecodeTile& tile) {
  for (int hk = 0; hk < tile.n_kv_heads; ++hk) {
    __m256i lanes = _mm256_setzero_si256();
    for (int j = 0; j < tile.nk; ++j) lanes = row_magnitudes<kValues>(tile.k_rows[j] + hk * tile.k_head_bytes, lanes);
    store_magnitude(lanes, &tile.k_magnitudes[hk]);
  }
}

}  // namespace sparsa::cpu
#endif
