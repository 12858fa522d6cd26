// SPARGE's quantized path (§4, "Sage") on NVIDIA tensor cores: the forward walk over the predicted block mask with
// S = (Q_i8·K_i8ᵀ)·s_q·s_k·scale from int8 tensor-core products (exact int32 sums: mma.sync m16n8k32, or wgmma
// m64n128k32 on sm_90a at head dim 128), the online softmax in fp32 and O += P·V, matching the CPU emulation
// (backends/cpu/attention_loop.cpp) up to the precision of P·V:
//   where FP8 code runs (a device of compute capability >= 8.9 executing this library's sm_90a kernels), P·V is
//   e4m3 × e4m3 (mma m16n8k32, or wgmma) as §4 asks: V per channel of each (sequence, kv head) scaled to ±448
//   (scale_c = max_j |V[j, c]| / 448), P scaled by 448; each tile's (wgmma: each pair of tiles') product is summed in
//   a fresh fp32 accumulator before it joins O (the tensor core's own fp8 accumulation is not full fp32), and O[:, c]
//   is multiplied by scale_c / (448 · l) at the end;
//   elsewhere P·V is fp16/bf16 (V's own type; fp32 inputs run PV in fp16 on a converted copy of V);
//   Q per block_q-row block of the sequence and centred K (K − mean over the sequence, fp32) per block_k-row block
//   are quantized with scale = max|x| / 127 + 1e-7 and x_i8 = round-half-even(x / scale);
//   the centring shifts every score of a row by scale·q·mean(K), which the softmax ignores; the LSE adds it back.
// The quantized operands are written to scratch by pre-pass kernels, then one attention launch reads them.
#pragma once

#include <cstdint>
#include <string>

#include "../runtime/gpu_launch.h"

SPARSA_GPU_NAMESPACE_BEGIN

constexpr int kSageTileKeys = 64;  // keys per tile of the attention walk (the PV skip needs block_k == this)

struct SageParams {
  ForwardParams fwd;  // the masked forward launch (rule kBlockMask, the predicted mask, optional λ table)
  int32_t num_kv_heads = 0;
  float scale = 0.f;                     // the softmax scale (§0)
  int32_t max_seq_q = 0, max_seq_k = 0;  // rows of the quantized Q and K copies per (b, head)
  int32_t k_blocks = 0;                  // ceil(max Skv / block_k)
  int32_t warps = 4;                     // 16 query rows per warp (8 when the PV skip needs block_q = 128 rows)
  bool convert_v = false;                // V copied to fp16 scratch (fp32 inputs, or rows not 16-byte aligned)
  bool fp8_pv = false;                   // P·V in e4m3 (sage_fp8_pv_available)
  bool hopper = false;                   // the attention runs on wgmma (forward_sage_wgmma.cu; FP8, D = 128)
  int32_t fp8_keys = 0;                  // keys per row of the transposed e4m3 V: max_seq_k rounded up to a tile
  const double* key_mean = nullptr;      // [B, Hkv, D] from the prediction (sparge_predict.h)
  int64_t* pv_skip_count = nullptr;      // PV_BLOCKS_SKIPPED (+1 per skipped tile), or null
  // Scratch.
  int8_t* q_i8 = nullptr;      // [B, Hq, max_seq_q, D]
  float* q_scale = nullptr;    // [B, Hq, max_seq_q]: the scale of each row's block_q block
  float* q_shift = nullptr;    // [B, Hq, max_seq_q]: scale·q·mean(K), added to the LSE
  int8_t* k_i8 = nullptr;      // [B, Hkv, max_seq_k, D], centred
  float* k_scale = nullptr;    // [B, Hkv, k_blocks]
  uint16_t* v_f16 = nullptr;   // [B, Hkv, max_seq_k, D] when convert_v
  // When fp8_pv: V transposed to [B, Hkv, D, fp8_keys] e4m3 (keys permuted inside each 32-key step so that a
  // thread's 4-byte load is the B fragment matching the P it already holds), and its per-channel scales.
  uint8_t* v_fp8 = nullptr;
  uint32_t* v_abs_max = nullptr;  // [B, Hkv, D]: max |V| per channel, as float bits (atomicMax on the bits)
};

// Whether this device runs the FP8 P·V kernels of this build (compute capability >= 8.9 and FP8 machine code
// loaded for it). A query without stream work (legal during graph capture).
bool sage_fp8_pv_available(const GpuDevice& device);

// Whether the Sage path can run the masked forward `p` here (false with *reason otherwise).
bool sage_supports(const GpuDevice& device, const ForwardParams& p, std::string* reason);

// Sizes of a run (everything but the scratch pointers and key_mean).
SageParams sage_plan(const GpuDevice& device, const ForwardParams& p, int32_t num_kv_heads, float scale,
                     int64_t max_seq_q, int64_t max_seq_k, int64_t k_blocks);
// Carves the quantized copies.
void sage_carve(ScratchCarver& carver, SageParams& s);
// Enqueues the quantization pre-passes and the attention launch.
cudaError_t sage_launch(const SageParams& s, cudaStream_t stream);

// The Hopper attention kernel (forward_sage_wgmma.cu), which sage_plan picks where it applies: an sm_90a image on a
// compute capability 9.x device, head dim 128, FP8 P·V, and a PV skip (if any) over 128-row query blocks.
bool sage_wgmma_supports(const GpuDevice& device, const ForwardParams& p);
// Sets its shared-memory size (at context creation, outside any capture); a no-op on other devices.
cudaError_t sage_wgmma_prepare(int32_t compute_major);
cudaError_t sage_wgmma_launch(const SageParams& s, cudaStream_t stream);

SPARSA_GPU_NAMESPACE_END
