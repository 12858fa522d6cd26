// What the running CPU offers the vector kernels, asked in one place. The library is built for plain x86-64 (or
// aarch64); each kernel family (microkernels, widen_rows, the decode kernels, select_dots, select_scores,
// select_softmax) picks its AVX2 or AVX-512 version at run time from these answers (AVX-512F; select_scores' also
// needs BW), so every family reads the same CPUID bits and one build runs on any x86-64 CPU.
#pragma once

namespace sparsa::cpu {

struct CpuFeatures {
  bool avx2 = false;
  bool fma = false;      // FMA3
  bool f16c = false;     // half <-> float conversions (vcvtph2ps / vcvtps2ph)
  bool avx512f = false;  // AVX-512 Foundation (its 512-bit half conversions included)
  bool avx512bw = false;  // AVX-512 byte and word instructions (16-bit unpacks of zmm)
};

// Read once (CPUID) and constant for the life of the process. All false off x86-64 and in builds with
// -DSPARSA_CPU_PORTABLE_KERNELS, which exist to run the portable kernels on a machine that has the vector ones.
const CpuFeatures& cpu_features();

}  // namespace sparsa::cpu
