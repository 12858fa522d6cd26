// The opaque handles of the C API. Only the core (api.cpp, validate.cpp, sparge_tune.cpp) sees their insides.
#pragma once

#include <sparsa/sparsa.h>

#include <atomic>
#include <memory>

#include "backend.h"
#include "error.h"

struct sparsa_context {
  sparsa_context_options options{};          // as resolved at creation
  std::unique_ptr<sparsa::Backend> backend;  // never null after creation
  // Set while a call uses the context (sparsa::ContextUse): a second thread's call fails instead of racing.
  mutable std::atomic<bool> in_use{false};
};

struct sparsa_selection_cache {
  const sparsa_context* owner = nullptr;  // runs with any other context are rejected
  std::unique_ptr<sparsa::SelectionCacheState> state;
};

namespace sparsa {

// Holds a context for the length of one API call. The header allows one thread at a time per context; a call that
// finds the context held by another thread fails with INVALID_ARGUMENT (and touches nothing) instead of corrupting
// the context's scratch and results.
class ContextUse {
 public:
  explicit ContextUse(const sparsa_context& ctx) : in_use_(ctx.in_use) {
    if (in_use_.exchange(true, std::memory_order_acquire)) {
      fail(SPARSA_STATUS_INVALID_ARGUMENT, "ctx: in use by a call on another thread (a sparsa_context and its ",
           "selection caches serve one thread at a time; use one context per thread)");
    }
  }
  ~ContextUse() { in_use_.store(false, std::memory_order_release); }
  ContextUse(const ContextUse&) = delete;
  ContextUse& operator=(const ContextUse&) = delete;

 private:
  std::atomic<bool>& in_use_;
};

}  // namespace sparsa
