// cpu_features.h: CPUID through the compiler's builtins, once.
#include "cpu_features.h"

#if defined(__x86_64__) && !defined(SPARSA_CPU_PORTABLE_KERNELS)
#include <cpuid.h>
#endif

namespace sparsa::cpu {
namespace {

CpuFeatures read_cpu_features() {
  CpuFeatures features;
#if defined(__x86_64__) && !defined(SPARSA_CPU_PORTABLE_KERNELS)
  __builtin_cpu_init();
  features.avx2 = __builtin_cpu_supports("avx2");
  features.fma = __builtin_cpu_supports("fma");
  features.avx512f = __builtin_cpu_supports("avx512f");
  features.avx512bw = __builtin_cpu_supports("avx512bw");
  // F16C from CPUID leaf 1 (clang's __builtin_cpu_supports does not know "f16c").
  unsigned eax = 0, ebx = 0, ecx = 0, edx = 0;
  features.f16c = __get_cpuid(1, &eax, &ebx, &ecx, &edx) && (ecx & bit_F16C) != 0;
#endif
  return features;
}

}  // namespace

const CpuFeatures& cpu_features() {
  static const CpuFeatures features = read_cpu_features();  // a property of the CPU: read once, never written again
  return features;
}

}  // namespace sparsa::cpu
