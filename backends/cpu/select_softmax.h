// TOKEN_SELECT's softmax statistics and head vote (select_softmax.cpp), with the bits of the plain loops they replace:
//   max_per_head: m_h = max over the candidates of each head's score;
//   exp_and_sum: e = exp(s − m_h) of every kept score, in place, and Z_h = Σ e as a FixedPointSum;
//   vote:        vote[t] = Σ_h e[h, t] / Z_h over a set's heads, in ascending head order, starting from 0.
//
// exp is std::exp's value bit for bit. The vector versions evaluate glibc's exp (≥ 2.28, the algorithm of Arm's
// optimized-routines: x = k·ln2/128 + r, 2^(k/128) from a 128-entry table, a degree-5 polynomial in r) with the FMAs
// of the variant glibc runs on a CPU with FMA and AVX2 (its __exp_fma), eight or four lanes at a time; lanes outside
// its main range (|x| < 2^-54, |x| >= 512, x >= 0, NaN) call std::exp. Since that is a property of the C library,
// not of the CPU, the vector versions are used only after a check at first use finds them equal to std::exp on
// inputs covering every table entry (select_softmax_kernel); otherwise the plain loop runs.
// The sums are exact integers (FixedPointSum), so adding the terms lane by lane gives the sequential loop's bits; a
// maximum taken lane by lane is the sequential one too, except that it may pick the other zero of ±0, so a zero
// maximum is taken again in order.
// This header depends on nothing else in the backend but fixed_point_sum.h (tests/kernels builds it on its own).
#pragma once

#include <cstdint>

#include "../../src/common/fixed_point_sum.h"

namespace sparsa::cpu {

struct SelectSoftmaxKernel {
  // maxes[l] = the std::max fold, from −inf in index order, of values[i] over i % group == l, i < n (NaN never wins).
  void (*max_per_head)(const double* values, int64_t n, int32_t group, double* maxes);
  // For i < n: values[i] = std::exp(values[i] − maxes[i % group]), and sums[i % group] gets that term added
  // (sums: group accumulators, added to, not reset). values: the [|C|, g] scores of one kv head's g query heads.
  void (*exp_and_sum)(double* values, int64_t n, int32_t group, const double* maxes, FixedPointSum* sums);
  // For c in [first, last): votes[c] = 0.0 + e_0[c] / head_sum[0] + ... + e_{n_heads−1}[c] / head_sum[n_heads−1]
  // (rounded after each divide and add, in that order), where e_k[c] = kept[(k / group) * kept_stride + c * group
  // + k % group]: the exp_and_sum outputs of the set's kv heads, one [|C|, g] block per kv head.
  void (*vote)(const double* kept, int64_t kept_stride, int32_t group, int32_t n_heads, const double* head_sum,
               int64_t first, int64_t last, double* votes);
  const char* name;  // "avx512f", "avx2" or "portable"
};

// The plain loops (every CPU and C library).
const SelectSoftmaxKernel& portable_select_softmax_kernel();
// The AVX2 (4 lanes) and AVX-512F (8 lanes) versions: null where the CPU (or the build: non-x86, or
// SPARSA_CPU_PORTABLE_KERNELS) lacks them or their exp differs from this process's std::exp.
const SelectSoftmaxKernel* avx2_select_softmax_kernel();
const SelectSoftmaxKernel* avx512_select_softmax_kernel();
// The one the backend uses: AVX-512F, else AVX2, else portable; chosen once per process.
const SelectSoftmaxKernel& select_softmax_kernel();

}  // namespace sparsa::cpu
