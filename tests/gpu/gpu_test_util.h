// Helpers every GPU test file shares: device presence and skipping, host-side f16/bf16 conversions, raw byte
// encoding of test data, a device buffer, and tensor descriptors. Host code only (cudart), so the tests build
// wherever the CUDA backend does and skip without a driver.
#pragma once

#include <cuda_runtime.h>
#include <gtest/gtest.h>
#include <sparsa/sparsa.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <string>
#include <vector>

namespace sparsa_gpu_test {

inline bool cuda_device_present() {
  int count = 0;  // cudaGetDeviceCount leaves it untouched without a driver (error 35)
  const cudaError_t status = cudaGetDeviceCount(&count);
  if (status != cudaSuccess) (void)cudaGetLastError();
  return status == cudaSuccess && count > 0;
}

// SPARSA_GPU_TESTS_SELFCHECK=1: on a machine without a GPU, run the CPU half of each case (checks the harness and
// the reference against the CPU backend at no device cost).
inline bool cpu_selfcheck_requested() {
  const char* flag = std::getenv("SPARSA_GPU_TESTS_SELFCHECK");
  return flag != nullptr && std::string(flag) == "1";
}

// ---- element conversions (host) ----

inline uint16_t float_to_bf16(float f) {
  uint32_t bits;
  std::memcpy(&bits, &f, 4);
  bits += 0x7fffu + ((bits >> 16) & 1u);
  return static_cast<uint16_t>(bits >> 16);
}

inline float bf16_to_float(uint16_t h) {
  const uint32_t bits = uint32_t(h) << 16;
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

// Round-to-nearest-even, subnormals included (test data stays far inside the f16 range).
inline uint16_t float_to_f16(float f) {
  uint32_t x;
  std::memcpy(&x, &f, 4);
  const uint32_t sign = (x >> 16) & 0x8000u;
  const int32_t exponent = int32_t((x >> 23) & 0xff) - 127 + 15;
  uint32_t mantissa = x & 0x7fffffu;
  if (exponent <= 0) {  // subnormal or zero
    if (exponent < -10) return static_cast<uint16_t>(sign);
    mantissa |= 0x800000u;
    const int shift = 14 - exponent;
    uint32_t half_m = mantissa >> shift;
    const uint32_t rest = mantissa & ((1u << shift) - 1), halfway = 1u << (shift - 1);
    if (rest > halfway || (rest == halfway && (half_m & 1u))) ++half_m;
    return static_cast<uint16_t>(sign | half_m);
  }
  uint32_t half = sign | (uint32_t(exponent) << 10) | (mantissa >> 13);
  const uint32_t rest = mantissa & 0x1fffu;
  if (rest > 0x1000u || (rest == 0x1000u && (half & 1u))) ++half;
  return static_cast<uint16_t>(half);
}

inline float f16_to_float(uint16_t h) {
  const uint32_t sign = uint32_t(h & 0x8000u) << 16;
  const int32_t exponent = (h >> 10) & 0x1f;
  const uint32_t mantissa = h & 0x3ffu;
  float value;
  if (exponent == 0) {
    value = std::ldexp(float(mantissa), -24);
  } else if (exponent == 31) {
    value = mantissa ? std::numeric_limits<float>::quiet_NaN() : std::numeric_limits<float>::infinity();
  } else {
    value = std::ldexp(float(mantissa | 0x400u), exponent - 25);
  }
  return sign ? -value : value;
}

inline size_t element_bytes(int32_t dtype) { return dtype == SPARSA_DTYPE_F32 ? 4 : 2; }

// The raw bytes of `values` in `dtype` (F32, F16 or BF16).
inline std::vector<uint8_t> encode(const std::vector<float>& values, int32_t dtype) {
  std::vector<uint8_t> bytes(values.size() * element_bytes(dtype));
  for (size_t i = 0; i < values.size(); ++i) {
    if (dtype == SPARSA_DTYPE_F32) {
      std::memcpy(&bytes[i * 4], &values[i], 4);
    } else {
      const uint16_t h = dtype == SPARSA_DTYPE_F16 ? float_to_f16(values[i]) : float_to_bf16(values[i]);
      std::memcpy(&bytes[i * 2], &h, 2);
    }
  }
  return bytes;
}

// Like encode, and rounds `values` to `dtype` in place (so a float64 reference sees what the kernels read).
inline std::vector<uint8_t> encode_rounded(std::vector<float>& values, int32_t dtype) {
  std::vector<uint8_t> bytes = encode(values, dtype);
  if (dtype == SPARSA_DTYPE_F32) return bytes;
  for (size_t i = 0; i < values.size(); ++i) {
    uint16_t h;
    std::memcpy(&h, &bytes[i * 2], 2);
    values[i] = dtype == SPARSA_DTYPE_F16 ? f16_to_float(h) : bf16_to_float(h);
  }
  return bytes;
}

inline std::vector<float> decode(const std::vector<uint8_t>& bytes, int32_t dtype) {
  std::vector<float> values(bytes.size() / element_bytes(dtype));
  for (size_t i = 0; i < values.size(); ++i) {
    if (dtype == SPARSA_DTYPE_F32) {
      std::memcpy(&values[i], &bytes[i * 4], 4);
    } else {
      uint16_t h;
      std::memcpy(&h, &bytes[i * 2], 2);
      values[i] = dtype == SPARSA_DTYPE_F16 ? f16_to_float(h) : bf16_to_float(h);
    }
  }
  return values;
}

// ---- device memory ----

class DeviceBuffer {
 public:
  DeviceBuffer() = default;
  explicit DeviceBuffer(size_t bytes) { resize(bytes); }
  ~DeviceBuffer() {
    if (data_ != nullptr) (void)cudaFree(data_);
  }
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;

  void resize(size_t bytes) {
    if (data_ != nullptr) (void)cudaFree(data_);
    data_ = nullptr;
    bytes_ = bytes;
    if (cudaMalloc(&data_, std::max<size_t>(bytes, 16)) != cudaSuccess) data_ = nullptr;
  }
  void upload(const void* host, size_t bytes) {
    EXPECT_EQ(cudaMemcpy(data_, host, bytes, cudaMemcpyHostToDevice), cudaSuccess);
  }
  void upload(const void* host) { upload(host, bytes_); }
  void fill(uint8_t byte) { EXPECT_EQ(cudaMemset(data_, byte, bytes_), cudaSuccess); }
  void poison() { fill(0xff); }  // NaN in f32/f16/bf16, -1 in int32
  // Waits for the device (runs may be on any stream), then copies the whole buffer out.
  void download(void* host) const {
    EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    EXPECT_EQ(cudaMemcpy(host, data_, bytes_, cudaMemcpyDeviceToHost), cudaSuccess);
  }
  std::vector<uint8_t> download() const {
    std::vector<uint8_t> host(bytes_);
    download(host.data());
    return host;
  }
  template <typename T>
  std::vector<T> download(size_t count) const {
    std::vector<T> host(count);
    EXPECT_EQ(cudaMemcpy(host.data(), data_, count * sizeof(T), cudaMemcpyDeviceToHost), cudaSuccess);
    return host;
  }
  void* data() const { return data_; }
  size_t bytes() const { return bytes_; }

 private:
  void* data_ = nullptr;
  size_t bytes_ = 0;
};

// A descriptor with contiguous strides unless `strides` is given.
inline sparsa_tensor make_tensor(void* data, int32_t dtype, std::vector<int64_t> shape, int32_t device_type,
                                 std::vector<int64_t> strides = {}) {
  sparsa_tensor t;
  EXPECT_EQ(sparsa_tensor_init(&t, sizeof t, data, dtype, int32_t(shape.size()), shape.data()), SPARSA_STATUS_SUCCESS);
  for (size_t i = 0; i < strides.size(); ++i) t.strides[i] = strides[i];
  t.device_type = device_type;
  t.device_id = 0;
  return t;
}

}  // namespace sparsa_gpu_test

#define SKIP_WITHOUT_GPU()                                                              \
  do {                                                                                  \
    if (!::sparsa_gpu_test::cuda_device_present()) GTEST_SKIP() << "no CUDA device/driver"; \
  } while (0)

#define CUDA_OK(call) ASSERT_EQ((call), cudaSuccess) << #call
#define SPARSA_OK(call) ASSERT_EQ((call), SPARSA_STATUS_SUCCESS) << #call << ": " << sparsa_last_error_message()
