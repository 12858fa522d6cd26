// The opaque handles of the C API. Only the core (api.cpp, validate.cpp, sparge_tune.cpp) sees their insides.
#pragma once

#include <sparsa/sparsa.h>

#include <memory>

#include "backend.h"

struct sparsa_context {
  sparsa_context_options options{};          // as resolved at creation
  std::unique_ptr<sparsa::Backend> backend;  // never null after creation
};

struct sparsa_selection_cache {
  const sparsa_context* owner = nullptr;  // runs with any other context are rejected
  std::unique_ptr<sparsa::SelectionCacheState> state;
};
