// Small host-side helpers about tensor descriptors: dtype names and sizes, shape formatting for messages, element
// counts, and scalar loads of the floating dtypes (used by the host utilities and the tuner).
#pragma once

#include <sparsa/sparsa.h>

#include <cstdint>
#include <cstring>
#include <sstream>
#include <string>
#include <vector>

#include "common/half_bits.h"

namespace sparsa {

inline const char* dtype_name(int32_t dtype) {
  switch (dtype) {
    case SPARSA_DTYPE_F32:
      return "F32";
    case SPARSA_DTYPE_F16:
      return "F16";
    case SPARSA_DTYPE_BF16:
      return "BF16";
    case SPARSA_DTYPE_F64:
      return "F64";
    case SPARSA_DTYPE_I32:
      return "I32";
    case SPARSA_DTYPE_I64:
      return "I64";
    case SPARSA_DTYPE_U8:
      return "U8";
    case SPARSA_DTYPE_I8:
      return "I8";
    default:
      return "INVALID";
  }
}

// Bytes per element; 0 for an unknown dtype.
inline size_t dtype_size(int32_t dtype) {
  switch (dtype) {
    case SPARSA_DTYPE_F32:
    case SPARSA_DTYPE_I32:
      return 4;
    case SPARSA_DTYPE_F16:
    case SPARSA_DTYPE_BF16:
      return 2;
    case SPARSA_DTYPE_F64:
    case SPARSA_DTYPE_I64:
      return 8;
    case SPARSA_DTYPE_U8:
    case SPARSA_DTYPE_I8:
      return 1;
    default:
      return 0;
  }
}

inline bool is_attention_dtype(int32_t dtype) {
  return dtype == SPARSA_DTYPE_F32 || dtype == SPARSA_DTYPE_F16 || dtype == SPARSA_DTYPE_BF16;
}

inline const char* device_name(int32_t device_type) {
  switch (device_type) {
    case SPARSA_DEVICE_CPU:
      return "CPU";
    case SPARSA_DEVICE_CUDA:
      return "CUDA";
    case SPARSA_DEVICE_CUDA_HOST:
      return "CUDA_HOST";
    case SPARSA_DEVICE_ROCM:
      return "ROCM";
    default:
      return "unknown device";
  }
}

// Memory the host CPU can read directly (plain or pinned).
inline bool is_host_memory(int32_t device_type) {
  return device_type == SPARSA_DEVICE_CPU || device_type == SPARSA_DEVICE_CUDA_HOST;
}

// "[2, 4096, 8, 128]"
inline std::string shape_string(const int64_t* shape, int ndim) {
  std::ostringstream s;
  s << '[';
  for (int i = 0; i < ndim; ++i) s << (i ? ", " : "") << shape[i];
  s << ']';
  return s.str();
}
inline std::string shape_string(const std::vector<int64_t>& shape) {
  return shape_string(shape.data(), static_cast<int>(shape.size()));
}
inline std::string shape_string(const sparsa_tensor& t) { return shape_string(t.shape, t.ndim); }

// Product of the extents of a tensor whose descriptor passed validation (read_tensor checks that it fits).
inline int64_t element_count(const sparsa_tensor& t) {
  int64_t n = 1;
  for (int i = 0; i < t.ndim; ++i) n *= t.shape[i];
  return n;
}

// Product of the extents with overflow detection: false when it does not fit int64. Extents must be >= 0.
inline bool checked_element_count(const sparsa_tensor& t, int64_t* count) {
  int64_t n = 1;
  bool overflow = false;
  for (int i = 0; i < t.ndim; ++i) {
    if (t.shape[i] == 0) {
      *count = 0;
      return true;  // an empty tensor is empty whatever its other extents
    }
    overflow = overflow || __builtin_mul_overflow(n, t.shape[i], &n);
  }
  *count = n;
  return !overflow;
}

// Bytes from the first element to one past the last one the strides reach (0 for an empty tensor), with overflow
// detection: false when it does not fit int64. Extents and strides must be >= 0 and the dtype known.
inline bool checked_span_bytes(const sparsa_tensor& t, size_t element_bytes, int64_t* bytes) {
  int64_t last = 0;  // element offset of the last element
  for (int i = 0; i < t.ndim; ++i) {
    if (t.shape[i] == 0) {
      *bytes = 0;
      return true;
    }
  }
  for (int i = 0; i < t.ndim; ++i) {
    int64_t reach = 0;
    if (__builtin_mul_overflow(t.shape[i] - 1, t.strides[i], &reach)) return false;
    if (__builtin_add_overflow(last, reach, &last)) return false;
  }
  int64_t elements = 0;
  if (__builtin_add_overflow(last, int64_t{1}, &elements)) return false;
  return !__builtin_mul_overflow(elements, static_cast<int64_t>(element_bytes), bytes);
}

// ceil(a / b) for a >= 0, b > 0, without forming a + b - 1 (which overflows for a near INT64_MAX).
inline int64_t ceil_div(int64_t a, int64_t b) { return a / b + (a % b != 0 ? 1 : 0); }

// Element `offset` (in elements) of a host F32/F16/BF16 buffer, as float.
inline float load_float(int32_t dtype, const void* base, int64_t offset) {
  switch (dtype) {
    case SPARSA_DTYPE_F16:
      return half_to_float(static_cast<const uint16_t*>(base)[offset]);
    case SPARSA_DTYPE_BF16:
      return bf16_to_float(static_cast<const uint16_t*>(base)[offset]);
    default:
      return static_cast<const float*>(base)[offset];
  }
}

}  // namespace sparsa
