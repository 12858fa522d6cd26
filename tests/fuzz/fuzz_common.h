// Shared pieces of the libFuzzer targets: decoding tensors (shape, strides, dtype, contents) from the fuzzer's bytes
// with small, bounded sizes and now and then a huge or negative value, and the check every target applies: a call
// that fails leaves every output byte-for-byte untouched.
#pragma once

#include <fuzzer/FuzzedDataProvider.h>
#include <sparsa/sparsa.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <vector>

namespace sparsa_fuzz {

// A CPU context with two workers, made once per target and kept for every input (scratch reuse across runs is part
// of what is fuzzed).
struct Context {
  sparsa_context* ctx = nullptr;
  Context() {
    sparsa_context_options o;
    sparsa_context_options_init(&o, sizeof o);
    o.num_threads = 2;
    if (sparsa_context_create(&o, &ctx) != SPARSA_STATUS_SUCCESS) std::abort();
  }
  ~Context() { sparsa_context_destroy(ctx); }
  Context(const Context&) = delete;
  Context& operator=(const Context&) = delete;
};

// Storage larger than this (elements) is not allocated: the tensor gets data = NULL, which the library must refuse
// unless the tensor is empty. Keeps every execution small and fast.
constexpr int64_t kMaxStorageElements = int64_t{1} << 16;
constexpr uint8_t kPoisonByte = 0xA5;

// Values that probe boundaries: what a hand-written edge case would try.
inline int64_t interesting_extent(FuzzedDataProvider& in) {
  static const int64_t kValues[] = {0, 1, 2, -1, (int64_t{1} << 31) - 1, int64_t{1} << 31, (int64_t{1} << 32) + 1,
                                    int64_t{1} << 40, int64_t{1} << 62, INT64_MAX};
  return in.PickValueInArray(kValues);
}
inline int32_t interesting_int(FuzzedDataProvider& in, int32_t small_max) {
  switch (in.ConsumeIntegralInRange<int>(0, 7)) {
    case 0: {
      static const int32_t kValues[] = {0, -1, 1, INT32_MAX, INT32_MIN, INT32_MAX - 1, 1 << 24, 1 << 28};
      return in.PickValueInArray(kValues);
    }
    default:
      return in.ConsumeIntegralInRange<int32_t>(0, small_max);
  }
}
inline float interesting_float(FuzzedDataProvider& in, float lo, float hi) {
  switch (in.ConsumeIntegralInRange<int>(0, 5)) {
    case 0: {
      static const float kValues[] = {0.f, 1.f, -1.f, 0.5f, __builtin_nanf(""), __builtin_inff(), -__builtin_inff(),
                                      1e-30f, 1e30f};
      return in.PickValueInArray(kValues);
    }
    default:
      return in.ConsumeFloatingPointInRange<float>(lo, hi);
  }
}

inline size_t element_size(int32_t dtype) {
  const size_t size = sparsa_dtype_size(dtype);
  return size ? size : 1;
}

// A tensor decoded from the input, owning its storage (8-byte aligned; the fuzzer may ask for an odd offset).
struct Tensor {
  sparsa_tensor t{};
  std::vector<uint64_t> storage;
  size_t bytes = 0;
  const sparsa_tensor* get() const { return &t; }
  void poison() {
    if (bytes) std::memset(storage.data(), kPoisonByte, bytes);
  }
  bool untouched() const {
    const auto* p = reinterpret_cast<const uint8_t*>(storage.data());
    for (size_t i = 0; i < bytes; ++i)
      if (p[i] != kPoisonByte) return false;
    return true;
  }
};

// Builds a tensor of `dtype` and (nominal) `shape`: strides contiguous, with gaps or broadcast (0), sometimes one
// extent replaced by a boundary value, sometimes misaligned data. Contents: the input's bytes, then a pattern.
// `fill` false: storage is poisoned (an output).
inline std::unique_ptr<Tensor> make_tensor(FuzzedDataProvider& in, int32_t dtype, std::vector<int64_t> shape,
                                           bool fill) {
  auto r = std::make_unique<Tensor>();
  sparsa_tensor& t = r->t;
  t.struct_size = sizeof(sparsa_tensor);
  t.dtype = dtype;
  t.device_type = SPARSA_DEVICE_CPU;
  t.ndim = int32_t(shape.size());
  const int mode = in.ConsumeIntegralInRange<int>(0, 15);
  if (mode == 15 && !shape.empty()) shape[in.ConsumeIntegralInRange<size_t>(0, shape.size() - 1)] = interesting_extent(in);
  int64_t stride = 1;
  bool overflow = false;
  for (int i = t.ndim - 1; i >= 0; --i) {
    t.shape[i] = shape[size_t(i)];
    int64_t s = stride;
    if (mode == 13 && i < t.ndim - 1) s = 0;                              // broadcast
    if (mode == 14 && i < t.ndim - 1) overflow |= __builtin_mul_overflow(stride, int64_t{2}, &s);  // gaps
    t.strides[i] = s;
    overflow |= __builtin_mul_overflow(std::max<int64_t>(s, 1), std::max<int64_t>(shape[size_t(i)], 1), &stride);
  }
  // Storage: one past the last element the strides reach.
  int64_t span = 1;
  bool empty = false;
  for (int i = 0; i < t.ndim; ++i) {
    if (t.shape[i] <= 0) empty = true;
    int64_t reach = 0;
    if (t.shape[i] > 0) {
      overflow |= __builtin_mul_overflow(t.shape[i] - 1, t.strides[i], &reach);
      overflow |= __builtin_add_overflow(span, reach, &span);
    }
  }
  if (empty) span = 0;
  if (overflow || span > kMaxStorageElements) {
    t.data = nullptr;
    return r;
  }
  const size_t esize = element_size(dtype);
  const bool misaligned = mode == 12 && esize > 1;
  r->bytes = size_t(span) * esize + (misaligned ? 1 : 0);
  r->storage.resize((r->bytes + 7) / 8 + 1);
  auto* base = reinterpret_cast<uint8_t*>(r->storage.data());
  if (fill) {
    const std::vector<uint8_t> bytes = in.ConsumeBytes<uint8_t>(r->bytes);
    if (!bytes.empty()) std::memcpy(base, bytes.data(), bytes.size());
    for (size_t i = bytes.size(); i < r->bytes; ++i) base[i] = uint8_t(0x3C + (i * 7) % 3);  // small finite values
  } else {
    r->poison();
  }
  t.data = span == 0 && in.ConsumeBool() ? nullptr : base + (misaligned ? 1 : 0);
  return r;
}

// An int32 tensor whose entries are small ids in [lo, hi] (plus, rarely, boundary values).
inline std::unique_ptr<Tensor> make_ids(FuzzedDataProvider& in, std::vector<int64_t> shape, int32_t lo, int32_t hi) {
  auto r = make_tensor(in, SPARSA_DTYPE_I32, std::move(shape), false);
  if (!r->t.data || r->bytes < 4) return r;
  auto* ids = reinterpret_cast<int32_t*>(reinterpret_cast<uint8_t*>(r->storage.data()));
  for (size_t i = 0; i < r->bytes / 4; ++i) {
    ids[i] = in.ConsumeIntegralInRange<int>(0, 31) == 0 ? interesting_int(in, hi)
                                                          : in.ConsumeIntegralInRange<int32_t>(lo, std::max(lo, hi));
  }
  return r;
}

// The contract for failed calls: nothing written.
inline void expect_untouched(sparsa_status status, const std::vector<const Tensor*>& outputs, const char* call) {
  if (status == SPARSA_STATUS_SUCCESS) return;
  for (const Tensor* t : outputs) {
    if (t && !t->untouched()) {
      std::fprintf(stderr, "%s failed with %s (%s) but wrote an output\n", call, sparsa_status_string(status),
                   sparsa_last_error_message());
      std::abort();
    }
  }
}

// Statuses a fuzzed call may return; INTERNAL is a bug by the header's own words.
inline void expect_no_internal(sparsa_status status, const char* call) {
  if (status == SPARSA_STATUS_INTERNAL) {
    std::fprintf(stderr, "%s returned SPARSA_STATUS_INTERNAL: %s\n", call, sparsa_last_error_message());
    std::abort();
  }
}

}  // namespace sparsa_fuzz
