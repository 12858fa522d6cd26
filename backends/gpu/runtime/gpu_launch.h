// What every policy file of the GPU backend (gpu_<policy>.cu) works with: the device it runs on, the scratch
// carver, error checking, and the one forward-attention launch every policy ends in (kernel choice + split-KV).
//
// gpu_backend.cu owns the Backend class and calls the policy entry points (gpu_policies.h); forward_dispatch.cu
// implements the functions declared here. A policy's run function is called twice with the same arguments: once by
// plan() with a sizing carver (carve scratch, launch nothing) and once by run() with the real scratch, so the
// scratch a run uses is exactly what plan() reserved and a planned run allocates nothing.
#pragma once

#include <cstdint>
#include <string>

#include "../../../src/backend.h"
#include "../../../src/problem.h"
#include "../engine/forward_params.h"
#include "../policies/attention_stats.h"
#include "gpu_runtime.h"

SPARSA_GPU_NAMESPACE_BEGIN

// The device and stream of one backend (filled at context creation; the stream follows set_stream).
struct GpuDevice {
  int32_t device = 0;
  cudaStream_t stream = nullptr;
  int32_t multiprocessors = 1;
  size_t max_shared_optin = 0;      // opt-in dynamic shared memory per block, bytes
  size_t index_set_max_shared = 0;  // dynamic shared memory the TOKEN_INDICES key-set kernel may use
  int32_t compute_major = 0, compute_minor = 0;
  bool overlap_launches = false;  // launch_overlap_supported()
};

// True when the kernels this device runs were compiled for sm_90 or newer, so that they wait for the kernel before
// them (gpu_runtime.h: wait_for_previous_kernel) and may be launched overlapping it. Not on a GPU newer than the
// build's architectures (it runs the compute_80 PTX, which has no wait), nor on HIP or before sm_90.
bool launch_overlap_supported();

// Hands out aligned sub-ranges of the backend's one scratch buffer. A measuring carver (plan()) only adds up sizes
// and every pointer it returns is null; policies check sizing() before launching anything. (A real carver may have
// a null base too: a run that needs no scratch.)
class ScratchCarver {
 public:
  static constexpr uint64_t kAlignment = 256;
  static ScratchCarver measuring() { return ScratchCarver(nullptr, true); }
  static ScratchCarver over(char* base) { return ScratchCarver(base, false); }
  bool sizing() const { return sizing_; }
  uint64_t bytes() const { return used_; }
  template <typename T>
  T* take(uint64_t count) {
    used_ = (used_ + kAlignment - 1) / kAlignment * kAlignment;
    T* result = sizing_ ? nullptr : reinterpret_cast<T*>(base_ + used_);
    used_ += count * sizeof(T);
    return result;
  }

 private:
  ScratchCarver(char* base, bool sizing) : base_(base), sizing_(sizing) {}
  char* base_;
  bool sizing_;
  uint64_t used_ = 0;
};

// Every runtime call goes through here: a failure becomes SPARSA_STATUS_DEVICE_ERROR (OUT_OF_MEMORY for an
// allocation) naming the call.
void check(cudaError_t status, const char* call);

// "cuda" or "hip": prefix of every UNSUPPORTED reason.
const char* backend_name();

ElementType element_type_of(int32_t dtype);
// [.., S, H, D] strides of q/out (rank 4 padded [B, S, H, D] or rank 3 packed [T, H, D]).
TensorStrides row_strides(const TensorArg& t);
// Strides of an lse tensor ([B, Hq, Sq] or packed [Hq, Tq]) in TensorStrides' (b, s, h) order.
TensorStrides lse_strides(const TensorArg& lse, bool packed);
// Does every row of `t` start on a 16-byte boundary (base aligned, every non-last stride a multiple of 8)?
bool rows_aligned_16(const TensorArg& t);

// Rows of the split-KV partial-state index (forward_params.h) of a run's q: Tq packed, B·Sq padded.
int64_t flat_rows_of(const AttentionProblem& problem);
// Do the rows of q, k, v and out all start on 16-byte boundaries (the cp.async kernels' requirement)?
bool all_rows_aligned_16(const AttentionProblem& problem);

// ForwardParams of a run: tensors, layouts, sizes, causal flag and scale; the visibility rule of DENSE,
// SINK_WINDOW and BLOCK_SPARSE (any other policy gets kDense and sets its own fields).
ForwardParams make_forward_params(const AttentionProblem& problem, const PolicyParams& policy);

// What the stats kernels count for this policy (out = null when stats were not asked for).
StatsParams make_stats_params(const AttentionProblem& problem, const PolicyParams& policy);

// Fastest first (oneDNN-style list).
enum class ForwardKernel { kNone, kDecode, kWgmma, kTensorCore, kPortable, kTokenIndices };

// One planned forward launch: the kernel and its split-KV share.
struct ForwardLaunch {
  ForwardKernel kernel = ForwardKernel::kNone;
  int32_t max_seq_q = 0;  // rows of the largest (b, h) of the launch: sizes the grid
  int32_t num_splits = 1;
  int32_t flat_rows = 0;
  bool overlap_launches = false;  // forward_params.h
};

// Chooses the kernel for `p` — the fastest whose supports() accepts it; kPortable otherwise, or kNone (with
// *reason) when even that cannot run it — and the split-KV share. `max_seq_q`/`max_seq_k`: the longest query rows
// and key range of any (b, h) of the launch; `flat_rows`: rows of the partial-state index (forward_params.h);
// `tensors_aligned16`: q, k, v and out rows all start on 16-byte boundaries.
ForwardLaunch plan_forward(const GpuDevice& device, const ForwardParams& p, int64_t max_seq_q, int64_t max_seq_k,
                           int64_t flat_rows, bool tensors_aligned16, std::string* reason);
// The split-KV share of an index-driven attention launch (token_indices.h: TOKEN_INDICES, TOKEN_SELECT) whose
// key lists hold at most `max_list_keys` keys.
ForwardLaunch plan_index_attention(const GpuDevice& device, const ForwardParams& p, int64_t max_seq_q,
                                   int64_t max_list_keys, int64_t flat_rows);
// Carves the launch's split-KV partial states and points `p` at them (sets p.num_splits / flat_rows).
void carve_forward(ScratchCarver& carver, const ForwardLaunch& launch, ForwardParams& p);
// Enqueues the launch (and the split combine); failures throw through check().
void launch_forward(const GpuDevice& device, const ForwardLaunch& launch, const ForwardParams& p);

SPARSA_GPU_NAMESPACE_END
