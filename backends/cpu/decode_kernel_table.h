// The DecodeKernels tables of one instruction set (decode_avx2.cpp, decode_avx512.cpp): the fp16/bf16 choice and one
// table per head dim, built from that file's kernel templates. Isa provides
//   static constexpr int kLanes;                 floats per vector register
//   static constexpr const char* kName;          DecodeKernels::name
//   template <int32_t kDtype, int kChunks> static void scores(tile, q, st, st_stride);
//   template <int32_t kDtype, int kChunks> static void accumulate(tile, st, st_stride, o);
// with a row of d values being kChunks = d / kLanes registers.
#pragma once

#include <sparsa/sparsa.h>

#include "decode_kernels.h"

namespace sparsa::cpu {

template <class Isa>
struct DecodeKernelTable {
  template <int kChunks>
  static void scores(const DecodeTile& tile, const float* q, float* st, int st_stride) {
    if (tile.dtype == SPARSA_DTYPE_F16) {
      Isa::template scores<SPARSA_DTYPE_F16, kChunks>(tile, q, st, st_stride);
    } else {
      Isa::template scores<SPARSA_DTYPE_BF16, kChunks>(tile, q, st, st_stride);
    }
  }
  template <int kChunks>
  static void accumulate(const DecodeTile& tile, const float* st, int st_stride, float* o) {
    if (tile.dtype == SPARSA_DTYPE_F16) {
      Isa::template accumulate<SPARSA_DTYPE_F16, kChunks>(tile, st, st_stride, o);
    } else {
      Isa::template accumulate<SPARSA_DTYPE_BF16, kChunks>(tile, st, st_stride, o);
    }
  }
  template <int kHeadDim>
  static constexpr DecodeKernels kFor = {scores<kHeadDim / Isa::kLanes>, accumulate<kHeadDim / Isa::kLanes>,
                                         Isa::kName};

  // The table for head dim d (64, 128 or 256), else null.
  static const DecodeKernels* for_head_dim(int d) {
    switch (d) {
      case 64: return &kFor<64>;
      case 128: return &kFor<128>;
      case 256: return &kFor<256>;
      default: return nullptr;
    }
  }
};

}  // namespace sparsa::cpu
