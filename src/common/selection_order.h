// The one ranking every top-k of the library uses (§0): larger value first, ties to the smaller id, NaN after every
// number, so that the order is a strict weak order whatever the input holds and no result depends on a sort's
// implementation, the thread count or the shard split. Host code (the CPU backend, the context-parallel steps'
// host part, src/cp_select_host.cpp); the GPU's device_topk ranks the same way by construction.
#pragma once

#include <cmath>
#include <cstdint>

namespace sparsa {

// True when (value_a, id_a) ranks before (value_b, id_b) in a descending top-k.
inline bool ranks_before(double value_a, int64_t id_a, double value_b, int64_t id_b) {
  const bool a_is_nan = std::isnan(value_a);
  const bool b_is_nan = std::isnan(value_b);
  if (a_is_nan != b_is_nan) return b_is_nan;
  if (!a_is_nan && value_a != value_b) return value_a > value_b;
  return id_a < id_b;
}

}  // namespace sparsa
