// Helpers every GPU test file shares: device presence and skipping, host-side f16/bf16 conversions, raw byte
// encoding of test data, owners of device memory, contexts, caches, streams and graphs, and tensor descriptors. Host
// code only (cudart), so the tests build wherever the CUDA backend does and skip without a driver.
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

#include "host_half.h"

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

// ---- element conversions (host): the tests' one converter, tests/host_half.h ----

using host_half::bf16_to_float;
using host_half::f16_to_float;
using host_half::float_to_bf16;
using host_half::float_to_f16;

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

// ---- owners: a failed ASSERT returns from the test body early, and every owner below frees on the way out ----

// Options for a context on `device_type` (SPARSA_DEVICE_*) that enqueues on `stream` (null: the default stream).
inline sparsa_context_options context_options(int32_t device_type, void* stream = nullptr) {
  sparsa_context_options options;
  sparsa_context_options_init(&options, sizeof options);
  options.device_type = device_type;
  options.stream = stream;
  return options;
}

// A sparsa context; status() says whether creation worked (get() is null otherwise).
class ScopedContext {
 public:
  explicit ScopedContext(const sparsa_context_options& options) { status_ = sparsa_context_create(&options, &ctx_); }
  ~ScopedContext() { sparsa_context_destroy(ctx_); }
  ScopedContext(const ScopedContext&) = delete;
  ScopedContext& operator=(const ScopedContext&) = delete;
  sparsa_context* get() const { return ctx_; }
  sparsa_status status() const { return status_; }

 private:
  sparsa_context* ctx_ = nullptr;
  sparsa_status status_ = SPARSA_STATUS_INTERNAL;
};

// A selection cache; declare it after its context so it is destroyed first (the header's order).
class ScopedSelectionCache {
 public:
  ScopedSelectionCache() = default;
  ~ScopedSelectionCache() { sparsa_selection_cache_destroy(cache_); }
  ScopedSelectionCache(const ScopedSelectionCache&) = delete;
  ScopedSelectionCache& operator=(const ScopedSelectionCache&) = delete;
  sparsa_selection_cache** out() { return &cache_; }  // for sparsa_selection_cache_create
  sparsa_selection_cache* get() const { return cache_; }

 private:
  sparsa_selection_cache* cache_ = nullptr;
};

// A cudart handle (stream, graph, executable graph) destroyed by `Destroy` when set.
template <typename Handle, cudaError_t (*Destroy)(Handle)>
class CudaHandle {
 public:
  CudaHandle() = default;
  ~CudaHandle() {
    if (handle_ != nullptr) (void)Destroy(handle_);
  }
  CudaHandle(const CudaHandle&) = delete;
  CudaHandle& operator=(const CudaHandle&) = delete;
  Handle* out() { return &handle_; }  // for the create call
  Handle get() const { return handle_; }

 private:
  Handle handle_ = nullptr;
};
using ScopedStream = CudaHandle<cudaStream_t, cudaStreamDestroy>;
using ScopedGraph = CudaHandle<cudaGraph_t, cudaGraphDestroy>;
using ScopedGraphExec = CudaHandle<cudaGraphExec_t, cudaGraphExecDestroy>;

// Page-locked host memory (cudaMallocHost); data() is null when the allocation failed.
class PinnedBuffer {
 public:
  explicit PinnedBuffer(size_t bytes) {
    if (cudaMallocHost(&data_, bytes) != cudaSuccess) data_ = nullptr;
  }
  ~PinnedBuffer() {
    if (data_ != nullptr) (void)cudaFreeHost(data_);
  }
  PinnedBuffer(const PinnedBuffer&) = delete;
  PinnedBuffer& operator=(const PinnedBuffer&) = delete;
  void* data() const { return data_; }

 private:
  void* data_ = nullptr;
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
