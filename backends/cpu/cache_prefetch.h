// Cache prefetch hints the compiler keeps. GCC treats __builtin_prefetch as free of side effects and deletes a loop
// whose body is nothing but prefetches (GCC 12: the decode kernels' and the attention loop's row prefetches compiled
// to no instruction at all), so where the instruction set is known the hint is a volatile asm statement.
#pragma once

#include <cstdint>

namespace sparsa::cpu {

constexpr int kCacheLineBytes = 64;

// Asks for the line holding p in L1 (and the levels below).
inline void prefetch_line_to_l1(const void* p) {
#if defined(__x86_64__) || defined(__i386__)
  asm volatile("prefetcht0 %0" : : "m"(*static_cast<const char*>(p)));
#elif defined(__aarch64__)
  asm volatile("prfm pldl1keep, %0" : : "Q"(*static_cast<const char*>(p)));
#else
  __builtin_prefetch(p, 0, 3);
#endif
}

// Asks for the line holding p in L2, not L1.
inline void prefetch_line_to_l2(const void* p) {
#if defined(__x86_64__) || defined(__i386__)
  asm volatile("prefetcht1 %0" : : "m"(*static_cast<const char*>(p)));
#elif defined(__aarch64__)
  asm volatile("prfm pldl2keep, %0" : : "Q"(*static_cast<const char*>(p)));
#else
  __builtin_prefetch(p, 0, 2);
#endif
}

// Asks for every line of [p, p + bytes) with prefetch_line (prefetch_line_to_l1 or _l2).
inline void prefetch_span(const void* p, int64_t bytes, void (*prefetch_line)(const void*)) {
  const char* first = static_cast<const char*>(p);
  for (int64_t byte = 0; byte < bytes; byte += kCacheLineBytes) prefetch_line(first + byte);
}

}  // namespace sparsa::cpu
