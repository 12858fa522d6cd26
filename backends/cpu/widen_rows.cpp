// Vector widening of fp16 / bf16 rows to fp32 (see cpu_convert.h): AVX-512F, or F16C / AVX2, chosen at run time
// like the microkernels; the portable loop elsewhere (aarch64 included). Widening is exact in every version, so the
// choice never changes a result (a signalling fp16 NaN comes back quiet from F16C / AVX-512F; NaN stays NaN).
// Loads are unaligned vector loads or memcpy: a row may start at any byte.
#include <cstdint>
#include <cstring>

#include "cpu_convert.h"
#include "cpu_features.h"

#if defined(__x86_64__)
#include <immintrin.h>
#endif

namespace sparsa::cpu {
namespace {

uint16_t load_u16(const unsigned char* p) {
  uint16_t h;
  std::memcpy(&h, p, sizeof h);
  return h;
}

void widen_f16_portable(const void* src, int64_t n, float* dst) {
  const unsigned char* s = static_cast<const unsigned char*>(src);
  for (int64_t c = 0; c < n; ++c) dst[c] = f16_to_float(load_u16(s + 2 * c));
}

void widen_bf16_portable(const void* src, int64_t n, float* dst) {
  const unsigned char* s = static_cast<const unsigned char*>(src);
  for (int64_t c = 0; c < n; ++c) dst[c] = bf16_to_float(load_u16(s + 2 * c));
}

constexpr RowWideners kPortable = {widen_f16_portable, widen_bf16_portable, "portable"};

#if defined(__x86_64__)
constexpr int64_t kZmmFloats = 16;  // fp32 lanes of a zmm register
constexpr int64_t kYmmFloats = 8;   // fp32 lanes of a ymm register
// The zero-masked (all lanes kept) forms of the AVX-512 conversions: GCC 12's plain forms start from an undefined
// register and warn -Wmaybe-uninitialized.
constexpr __mmask16 kAllLanes = 0xffff;

__attribute__((target("avx512f"))) void widen_f16_avx512(const void* src, int64_t n, float* dst) {
  const unsigned char* s = static_cast<const unsigned char*>(src);
  int64_t c = 0;
  for (; c + kZmmFloats <= n; c += kZmmFloats)
    _mm512_storeu_ps(dst + c, _mm512_maskz_cvtph_ps(kAllLanes, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(s + 2 * c))));
  for (; c < n; ++c) dst[c] = f16_to_float(load_u16(s + 2 * c));
}

__attribute__((target("avx512f"))) void widen_bf16_avx512(const void* src, int64_t n, float* dst) {
  const unsigned char* s = static_cast<const unsigned char*>(src);
  int64_t c = 0;
  for (; c + kZmmFloats <= n; c += kZmmFloats) {
    const __m512i h = _mm512_maskz_cvtepu16_epi32(kAllLanes, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(s + 2 * c)));
    _mm512_storeu_ps(dst + c, _mm512_castsi512_ps(_mm512_maskz_slli_epi32(kAllLanes, h, 16)));
  }
  for (; c < n; ++c) dst[c] = bf16_to_float(load_u16(s + 2 * c));
}

__attribute__((target("avx,f16c"))) void widen_f16_f16c(const void* src, int64_t n, float* dst) {
  const unsigned char* s = static_cast<const unsigned char*>(src);
  int64_t c = 0;
  for (; c + kYmmFloats <= n; c += kYmmFloats)
    _mm256_storeu_ps(dst + c, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(s + 2 * c))));
  for (; c < n; ++c) dst[c] = f16_to_float(load_u16(s + 2 * c));
}

__attribute__((target("avx2"))) void widen_bf16_avx2(const void* src, int64_t n, float* dst) {
  const unsigned char* s = static_cast<const unsigned char*>(src);
  int64_t c = 0;
  for (; c + kYmmFloats <= n; c += kYmmFloats) {
    const __m256i h = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(s + 2 * c)));
    _mm256_storeu_ps(dst + c, _mm256_castsi256_ps(_mm256_slli_epi32(h, 16)));
  }
  for (; c < n; ++c) dst[c] = bf16_to_float(load_u16(s + 2 * c));
}

constexpr RowWideners kAvx512 = {widen_f16_avx512, widen_bf16_avx512, "avx512f"};
constexpr RowWideners kF16cAvx2 = {widen_f16_f16c, widen_bf16_avx2, "f16c+avx2"};
#endif

const RowWideners& pick_row_wideners() {
#if defined(__x86_64__) && !defined(SPARSA_CPU_PORTABLE_KERNELS)
  const CpuFeatures& cpu = cpu_features();
  if (cpu.avx512f) return kAvx512;
  if (cpu.avx2 && cpu.f16c) return kF16cAvx2;
#endif
  return kPortable;
}

}  // namespace

const RowWideners& portable_row_wideners() { return kPortable; }

const RowWideners& select_row_wideners() {
  static const RowWideners& chosen = pick_row_wideners();  // constant once chosen
  return chosen;
}

}  // namespace sparsa::cpu
