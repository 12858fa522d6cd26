// The one ranking every top-k of the library uses (§0): larger value first, ties to the smaller id, NaN after every
// number, so that the order is a strict weak order whatever the input holds and no result depends on a sort's
// implementation, the thread count or the shard split. Host code (the CPU backend, the context-parallel steps'
// host part, src/cp_select_host.cpp); the GPU's device_topk ranks the same way by construction.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

#include "host_device.h"

namespace sparsa {

// True when (value_a, id_a) ranks before (value_b, id_b) in a descending top-k.
inline bool ranks_before(double value_a, int64_t id_a, double value_b, int64_t id_b) {
  const bool a_is_nan = std::isnan(value_a);
  const bool b_is_nan = std::isnan(value_b);
  if (a_is_nan != b_is_nan) return b_is_nan;
  if (!a_is_nan && value_a != value_b) return value_a > value_b;
  return id_a < id_b;
}

// An unsigned integer that sorts like ranks_before's values (a larger value, a larger key): a positive value's bits
// with the sign bit set, a negative value's bits all flipped, -0 folded onto +0 and every NaN onto 0, below -inf. A
// top-k is then "the k largest keys, ties to the smaller id": the CPU's top_k_ids_ascending and the GPU's device_topk.
SPARSA_HOST_DEVICE inline uint64_t order_key(double value) {
  if (value != value) return 0;
  constexpr uint64_t kSign = uint64_t{1} << 63;
#if defined(__CUDA_ARCH__) || defined(__HIP_DEVICE_COMPILE__)
  uint64_t bits = static_cast<uint64_t>(__double_as_longlong(value));
#else
  uint64_t bits;
  std::memcpy(&bits, &value, sizeof bits);
#endif
  if (bits == kSign) bits = 0;
  return (bits & kSign) ? ~bits : (bits | kSign);
}
SPARSA_HOST_DEVICE inline uint64_t order_key(float value) {
  if (value != value) return 0;
  constexpr uint32_t kSign = 0x80000000u;
#if defined(__CUDA_ARCH__) || defined(__HIP_DEVICE_COMPILE__)
  uint32_t bits = __float_as_uint(value);
#else
  uint32_t bits;
  std::memcpy(&bits, &value, sizeof bits);
#endif
  if (bits == kSign) bits = 0;
  return (bits & kSign) ? uint64_t(~bits) : uint64_t(bits | kSign);
}

}  // namespace sparsa
