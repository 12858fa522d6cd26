// Row conversions between the problem dtype and fp32 (see cpu_convert.h).
#include "cpu_convert.h"

#include "../../src/error.h"

namespace sparsa::cpu {

void convert_to_f32(int32_t dtype, const void* src, int64_t n, float* dst) {
  if (n <= 0) return;  // an empty row may come with null pointers, which memcpy must not see
  switch (dtype) {
    case SPARSA_DTYPE_F32: std::memcpy(dst, src, size_t(n) * sizeof(float)); return;
    case SPARSA_DTYPE_F16: select_row_wideners().f16(src, n, dst); return;
    case SPARSA_DTYPE_BF16: select_row_wideners().bf16(src, n, dst); return;
    default: fail(SPARSA_STATUS_INTERNAL, "cpu convert: dtype ", dtype, " is not F32/F16/BF16");
  }
}

void convert_from_f32(int32_t dtype, const float* src, int64_t n, void* dst) {
  if (n <= 0) return;
  switch (dtype) {
    case SPARSA_DTYPE_F32: std::memcpy(dst, src, size_t(n) * sizeof(float)); return;
    case SPARSA_DTYPE_F16: {
      uint16_t* h = static_cast<uint16_t*>(dst);
      for (int64_t c = 0; c < n; ++c) h[c] = float_to_f16(src[c]);
      return;
    }
    case SPARSA_DTYPE_BF16: {
      uint16_t* h = static_cast<uint16_t*>(dst);
      for (int64_t c = 0; c < n; ++c) h[c] = float_to_bf16(src[c]);
      return;
    }
    default: fail(SPARSA_STATUS_INTERNAL, "cpu convert: dtype ", dtype, " is not F32/F16/BF16");
  }
}

void load_row_f32(int32_t dtype, const void* base, int64_t element_offset, int32_t d, float* dst) {
  if (d <= 0) return;  // no element: base may be null, and null + offset is undefined
  const char* row = static_cast<const char*>(base) + element_offset * element_bytes(dtype);
  convert_to_f32(dtype, row, d, dst);
}

void store_row(int32_t dtype, void* base, int64_t element_offset, int32_t d, const float* src) {
  if (d <= 0) return;
  char* row = static_cast<char*>(base) + element_offset * element_bytes(dtype);
  convert_from_f32(dtype, src, d, row);
}

}  // namespace sparsa::cpu
