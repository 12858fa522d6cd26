// The CUDA (and, compiled by hipcc from the same sources, cmake/sparsa_gpu.cmake, the HIP) implementation of
// sparsa::Backend.
//
// Reads top to bottom: the device guard, the general limits every case must meet, the Backend class — whose
// supports/plan/run all go through one dispatch per policy (dispatch_policy) — and the factories
// src/registry.cpp calls. The kernels' choice and split-KV planning live in forward_dispatch.cu; policies with more
// than one launch in their own files (gpu_policies.h).
//
// Contract kept here (ABI.md rule 9): run() only enqueues on the context's stream — no host synchronisation, no
// allocation once planned — so it can be captured in a CUDA graph. All scratch is one buffer, carved by the
// policies (gpu_launch.h: ScratchCarver) identically in plan() and run(); plan() grows it, and an unplanned run
// grows it on first use.
#include "../../../src/backend.h"
#include "../../../src/error.h"
#include "../../../src/registry.h"
#include "../kernels/forward_mma.h"
#include "../kernels/forward_sage.h"
#include "../kernels/forward_simt.h"
#include "../kernels/forward_wgmma.h"
#include "../kernels/merge_states.h"
#include "../kernels/token_indices.h"
#include "../policies/attention_stats.h"
#include "gpu_launch.h"
#include "gpu_policies.h"
#include "gpu_runtime.h"

#include <algorithm>
#include <cstdint>
#include <limits>
#include <memory>
#include <string>

SPARSA_GPU_NAMESPACE_BEGIN
namespace {

#if SPARSA_GPU_IS_HIP
constexpr int32_t kDeviceType = SPARSA_DEVICE_ROCM;
#else
constexpr int32_t kDeviceType = SPARSA_DEVICE_CUDA;
#endif

constexpr int64_t kMaxGridZ = 65535;  // batch rides on gridDim.z
constexpr int64_t kMaxGridY = 65535;  // query heads ride on gridDim.y
constexpr uint64_t kMaxIndexListBytes = uint64_t(1) << 30;

// Makes the context's device current for the scope and restores the caller's device afterwards.
class DeviceGuard {
 public:
  explicit DeviceGuard(int32_t device) {
    check(cudaGetDevice(&previous_), "cudaGetDevice");
    if (previous_ != device) check(cudaSetDevice(device), "cudaSetDevice");
  }
  ~DeviceGuard() {
    int current = previous_;
    if (cudaGetDevice(&current) == cudaSuccess && current != previous_) (void)cudaSetDevice(previous_);
  }
  DeviceGuard(const DeviceGuard&) = delete;
  DeviceGuard& operator=(const DeviceGuard&) = delete;

 private:
  int previous_ = 0;
};

// Limits every GPU case meets, whatever the policy; false with *reason otherwise.
bool general_limits_met(const AttentionProblem& problem, std::string* reason) {
  auto refuse = [&](const std::string& why) {
    if (reason != nullptr) *reason = std::string(backend_name()) + " backend: " + why;
    return false;
  };
  if (problem.dtype != SPARSA_DTYPE_F32 && problem.dtype != SPARSA_DTYPE_F16 && problem.dtype != SPARSA_DTYPE_BF16) {
    return refuse("dtype must be F32, F16 or BF16");
  }
  if (problem.head_dim > kSimtMaxHeadDim) {
    return refuse("head_dim " + std::to_string(problem.head_dim) + " exceeds the largest supported, " +
                  std::to_string(kSimtMaxHeadDim));
  }
  if (problem.batch > kMaxGridZ || problem.num_q_heads > kMaxGridY) {
    return refuse("batch must be <= 65535 and num_q_heads <= 65535");
  }
  if (problem.max_seq_q > std::numeric_limits<int32_t>::max() / 2 ||
      problem.max_seq_k > std::numeric_limits<int32_t>::max() / 2) {
    return refuse("sequence lengths must stay below 2^30");
  }
  return true;
}

// DENSE, SINK_WINDOW, BLOCK_SPARSE: one forward launch (+ the analytic stats).
bool single_launch_supports(const GpuDevice& device, const AttentionProblem& problem, const PolicyParams& policy,
                            std::string* reason) {
  if (problem.selected_indices.present) {
    if (reason != nullptr) {
      *reason = std::string(backend_name()) + " backend: selected_indices is not produced by this policy here";
    }
    return false;
  }
  const ForwardParams p = make_forward_params(problem, policy);
  return plan_forward(device, p, problem.max_seq_q, problem.max_seq_k, flat_rows_of(problem),
                      all_rows_aligned_16(problem), reason)
             .kernel != ForwardKernel::kNone;
}

void single_launch_run(const GpuDevice& device, const AttentionProblem& problem, const PolicyParams& policy,
                       ScratchCarver& carver) {
  ForwardParams p = make_forward_params(problem, policy);
  const ForwardLaunch launch = plan_forward(device, p, problem.max_seq_q, problem.max_seq_k, flat_rows_of(problem),
                                            all_rows_aligned_16(problem), nullptr);
  carve_forward(carver, launch, p);
  if (carver.sizing()) return;
  const StatsParams stats = make_stats_params(problem, policy);
  if (stats.out != nullptr && problem.batch > 0 && problem.num_q_heads > 0) {
    check(stats_count_launch(p, stats, device.stream), "stats_count_kernel launch");
  }
  if (problem.batch == 0 || problem.num_q_heads == 0 || problem.max_seq_q == 0) return;
  launch_forward(device, launch, p);
}

// TOKEN_INDICES: the key-set kernel builds each (b, h)'s list, then index-driven attention (token_indices.h).
bool token_indices_supports(const GpuDevice& device, const AttentionProblem& problem, std::string* reason) {
  auto refuse = [&](const std::string& why) {
    if (reason != nullptr) *reason = std::string(backend_name()) + " backend: " + why;
    return false;
  };
  if (problem.max_seq_k > kIndexMaxKeys) {
    return refuse("TOKEN_INDICES needs Skv <= " + std::to_string(kIndexMaxKeys) + " (shared-memory key bitmap)");
  }
  if (uint64_t(problem.batch) * problem.num_q_heads * uint64_t(problem.max_seq_k) * sizeof(int32_t) >
      kMaxIndexListBytes) {
    return refuse("TOKEN_INDICES key lists (B x Hq x Skv int32, Skv = Tk for packed k/v) exceed 1 GiB of scratch");
  }
  if (index_set_shared_bytes(problem.max_seq_k) > device.index_set_max_shared) {
    return refuse("TOKEN_INDICES key bitmap of Skv = " + std::to_string(problem.max_seq_k) +
                  " keys exceeds this device's shared memory");
  }
  return true;
}

IndexSetParams index_set_params(const AttentionProblem& problem, const PolicyParams& policy) {
  IndexSetParams ix;
  ix.indices = policy.indices.ptr<const int32_t>();
  for (int d = 0; d < 3; ++d) ix.index_strides[d] = policy.indices.stride(d);
  ix.index_heads = int32_t(policy.indices.extent(1));
  ix.slots = int32_t(policy.indices.extent(2));
  if (policy.head_map.present) {
    ix.head_map = policy.head_map.ptr<const int32_t>();
    ix.head_map_stride = policy.head_map.stride(0);
  }
  ix.block_size = policy.p.index_block_size;
  ix.n_init = policy.p.index_n_init;
  ix.n_local = policy.p.index_n_local;
  ix.list_capacity = int32_t(problem.max_seq_k);
  if (problem.selected_indices.present) {
    ix.selected = problem.selected_indices.ptr<int32_t>();
    for (int d = 0; d < 3; ++d) ix.selected_strides[d] = problem.selected_indices.stride(d);
    ix.selected_cap = int32_t(problem.selected_indices.extent(2));
  }
  return ix;
}

void token_indices_run(const GpuDevice& device, const AttentionProblem& problem, const PolicyParams& policy,
                       ScratchCarver& carver) {
  ForwardParams p = make_forward_params(problem, policy);
  const ForwardLaunch launch =
      plan_index_attention(device, p, problem.max_seq_q, problem.max_seq_k, flat_rows_of(problem));
  carve_forward(carver, launch, p);
  IndexSetParams ix = index_set_params(problem, policy);
  const uint64_t lists = uint64_t(problem.batch) * problem.num_q_heads;
  ix.key_lists = carver.take<int32_t>(lists * uint64_t(problem.max_seq_k));
  ix.key_counts = carver.take<int32_t>(lists);
  if (carver.sizing() || problem.batch == 0 || problem.num_q_heads == 0 || problem.max_seq_q == 0) return;
  const StatsParams stats = make_stats_params(problem, policy);
  if (stats.out != nullptr) check(stats_count_launch(p, stats, device.stream), "stats_count_kernel launch");
  check(token_indices_launch(p, ix, stats, int32_t(problem.max_seq_q), device.stream), "token_indices launch");
}

class GpuBackend final : public Backend {
 public:
  GpuBackend(int32_t device, void* stream) {
    device_.device = device;
    device_.stream = static_cast<cudaStream_t>(stream);
    DeviceGuard guard(device);
    int value = 0;
    check(cudaDeviceGetAttribute(&value, cudaDevAttrMaxSharedMemoryPerBlockOptin, device), "cudaDeviceGetAttribute");
    device_.max_shared_optin = size_t(value);
    check(cudaDeviceGetAttribute(&device_.multiprocessors, cudaDevAttrMultiProcessorCount, device),
          "cudaDeviceGetAttribute");
    check(cudaDeviceGetAttribute(&device_.compute_major, cudaDevAttrComputeCapabilityMajor, device),
          "cudaDeviceGetAttribute");
    check(cudaDeviceGetAttribute(&device_.compute_minor, cudaDevAttrComputeCapabilityMinor, device),
          "cudaDeviceGetAttribute");
    device_.overlap_launches = launch_overlap_supported();
    // Kernel attributes are set here, not in run(), so that a run contains nothing but launches (graph capture).
    check(forward_mma_prepare(), "cudaFuncSetAttribute (tensor-core forward)");
    check(forward_wgmma_prepare(), "cudaFuncSetAttribute (wgmma forward)");
    check(sage_wgmma_prepare(device_.compute_major), "cudaFuncSetAttribute (Sage wgmma forward)");
    if (forward_simt_shared_bytes(kSimtMaxHeadDim) <= device_.max_shared_optin) {
      check(forward_simt_prepare(), "cudaFuncSetAttribute (portable forward)");
    }
    check(token_indices_prepare(device_.max_shared_optin, &device_.index_set_max_shared),
          "cudaFuncSetAttribute (TOKEN_INDICES key sets)");
  }

  int32_t device_type() const override { return kDeviceType; }
  const char* name() const override { return backend_name(); }
  void set_stream(void* stream) override { device_.stream = static_cast<cudaStream_t>(stream); }
  uint64_t scratch_bytes() const override { return scratch_bytes_; }

  ~GpuBackend() override {
    if (scratch_ != nullptr) (void)cudaFree(scratch_);  // destroy waits for nothing (sparsa.h): caller syncs first
  }
  GpuBackend(const GpuBackend&) = delete;
  GpuBackend& operator=(const GpuBackend&) = delete;

  bool supports(const AttentionProblem& problem, const PolicyParams& policy, std::string* reason) const override {
    if (!general_limits_met(problem, reason)) return false;
    if (problem.block_mask_out.present && policy.p.kind != SPARSA_POLICY_SPARGE) {
      if (reason != nullptr) *reason = std::string(backend_name()) + " backend: block_mask_out is SPARGE's output";
      return false;
    }
    if (policy.delta && !delta_supports(device_, problem, policy, reason)) return false;
    return base_supports(problem, policy, reason);
  }

  // plan() and run() come after the API's supports() check (backend.h): it is asked once per call, not again here.
  void plan(const AttentionProblem& problem, const PolicyParams& policy) override {
    ScratchCarver sizing = ScratchCarver::measuring();
    dispatch_policy(problem, policy, sizing);
    grow_scratch(sizing.bytes());
  }

  void run(const AttentionProblem& problem, const PolicyParams& policy) override {
    DeviceGuard guard(device_.device);
    ScratchCarver sizing = ScratchCarver::measuring();
    dispatch_policy(problem, policy, sizing);
    grow_scratch(sizing.bytes());  // allocates only on a first, unplanned run
    const StatsParams stats = make_stats_params(problem, policy);
    if (stats.out != nullptr) check(stats_zero_launch(stats, device_.stream), "stats_zero_kernel launch");
    ScratchCarver carver = ScratchCarver::over(static_cast<char*>(scratch_));
    dispatch_policy(problem, policy, carver);
  }

  void merge_states(const MergeProblem& problem) override {
    MergeParams p;
    p.o_a = problem.o_a.t.data;
    p.o_b = problem.o_b.t.data;
    p.out = problem.out.t.data;
    p.lse_a = problem.lse_a.ptr<const float>();
    p.lse_b = problem.lse_b.ptr<const float>();
    p.out_lse = problem.out_lse.present ? problem.out_lse.ptr<float>() : nullptr;
    p.element_type = element_type_of(problem.o_a.t.dtype);
    p.o_a_strides = row_strides(problem.o_a);
    p.o_b_strides = row_strides(problem.o_b);
    p.out_strides = row_strides(problem.out);
    const int rank = problem.o_a.t.ndim;
    p.batch = problem.packed ? 1 : int32_t(problem.o_a.extent(0));
    p.seq = int32_t(problem.o_a.extent(rank - 3));
    p.heads = int32_t(problem.o_a.extent(rank - 2));
    p.head_dim = int32_t(problem.o_a.extent(rank - 1));
    p.lse_a_strides = lse_strides(problem.lse_a, problem.packed);
    p.lse_b_strides = lse_strides(problem.lse_b, problem.packed);
    if (problem.out_lse.present) p.out_lse_strides = lse_strides(problem.out_lse, problem.packed);
    DeviceGuard guard(device_.device);
    check(merge_states_launch(p, device_.stream), "merge_states_kernel launch");
  }

  void topk_from_scores(const TensorArg& scores, int32_t k, int32_t block_size,
                        const TensorArg& out_indices) override {
    run_with_scratch([&](ScratchCarver& carver) {
      topk_from_scores_run(device_, scores, k, block_size, out_indices, carver);
    });
  }

  void kv_prefetch(const PrefetchProblem& problem) override {
    run_with_scratch([&](ScratchCarver& carver) { kv_prefetch_run(device_, problem, carver); });
  }

  void cp_select(const CpSelectCall& call) override {
    std::string reason;
    if (!cp_select_supports(device_, call, &reason)) fail(SPARSA_STATUS_UNSUPPORTED, reason);
    run_with_scratch([&](ScratchCarver& carver) { cp_select_run(device_, call, carver); });
  }

  std::unique_ptr<SelectionCacheState> create_selection_cache(const SelectionCacheDims& dims) override {
    DeviceGuard guard(device_.device);
    return create_device_selection_cache(device_, dims);
  }

 private:
  // The policy itself, ignoring the Δ flag.
  bool base_supports(const AttentionProblem& problem, const PolicyParams& policy, std::string* reason) const {
    if (!policy_runs_on(policy.p.kind, device_type())) {  // src/policy_table.h
      if (reason != nullptr) *reason = std::string(backend_name()) + " backend: policy kind not implemented";
      return false;
    }
    switch (policy.p.kind) {
      case SPARSA_POLICY_DENSE:
      case SPARSA_POLICY_SINK_WINDOW:
      case SPARSA_POLICY_BLOCK_SPARSE:
        return single_launch_supports(device_, problem, policy, reason);
      case SPARSA_POLICY_TOKEN_INDICES:
        return token_indices_supports(device_, problem, reason);
      case SPARSA_POLICY_SPARGE:
        return sparge_supports(device_, problem, policy, reason);
      case SPARSA_POLICY_TOKEN_SPARSE:
        return token_sparse_supports(device_, problem, policy, reason);
      case SPARSA_POLICY_TOKEN_SELECT:
        return token_select_supports(device_, problem, policy, reason);
      default:
        if (reason != nullptr) *reason = std::string(backend_name()) + " backend: unknown policy kind";
        return false;
    }
  }

  void run_base(const AttentionProblem& problem, const PolicyParams& policy, ScratchCarver& carver) {
    switch (policy.p.kind) {
      case SPARSA_POLICY_TOKEN_INDICES:
        return token_indices_run(device_, problem, policy, carver);
      case SPARSA_POLICY_SPARGE:
        return sparge_run(device_, problem, policy, carver);
      case SPARSA_POLICY_TOKEN_SPARSE:
        return token_sparse_run(device_, problem, policy, carver);
      case SPARSA_POLICY_TOKEN_SELECT:
        return token_select_run(device_, problem, policy, carver);
      default:
        return single_launch_run(device_, problem, policy, carver);
    }
  }

  // The one path plan() (sizing carver) and run() share.
  void dispatch_policy(const AttentionProblem& problem, const PolicyParams& policy, ScratchCarver& carver) {
    if (!policy.delta) return run_base(problem, policy, carver);
    delta_run(device_, problem, policy, carver,
              [&](ScratchCarver& base_carver) { run_base(problem, policy, base_carver); });
  }

  // A utility (not planned): `run` once with a measuring carver, the buffer grown to fit, then `run` on it.
  template <typename Run>
  void run_with_scratch(const Run& run) {
    DeviceGuard guard(device_.device);
    ScratchCarver sizing = ScratchCarver::measuring();
    run(sizing);
    grow_scratch(sizing.bytes());
    ScratchCarver carver = ScratchCarver::over(static_cast<char*>(scratch_));
    run(carver);
  }

  // Scratch only grows; plan() sizes it so that later runs allocate nothing.
  void grow_scratch(uint64_t bytes) {
    if (bytes <= scratch_bytes_) return;
    DeviceGuard guard(device_.device);
    if (scratch_ != nullptr) check(cudaFree(scratch_), "cudaFree");
    scratch_ = nullptr;
    scratch_bytes_ = 0;
    check(cudaMalloc(&scratch_, bytes), "cudaMalloc");
    scratch_bytes_ = bytes;
  }

  GpuDevice device_;
  void* scratch_ = nullptr;
  uint64_t scratch_bytes_ = 0;
};

std::unique_ptr<Backend> create_gpu_backend(const sparsa_context_options& options) {
  int count = 0;  // left untouched by cudaGetDeviceCount without a driver (TOOLCHAIN.md)
  const cudaError_t status = cudaGetDeviceCount(&count);
  if (status != cudaSuccess || count == 0) {
    (void)cudaGetLastError();  // clear the sticky "no driver" error
    fail(SPARSA_STATUS_BACKEND_UNAVAILABLE, backend_name(), " backend: no usable device (",
         status == cudaSuccess ? "0 devices" : cudaGetErrorString(status), ")");
  }
  if (options.device_id < 0 || options.device_id >= count) {
    fail(SPARSA_STATUS_BACKEND_UNAVAILABLE, "device_id: expected 0..", count - 1, " (", count, " ", backend_name(),
         " devices), got ", options.device_id);
  }
  return std::make_unique<GpuBackend>(options.device_id, options.stream);
}

}  // namespace
SPARSA_GPU_NAMESPACE_END

namespace sparsa {
#if SPARSA_GPU_IS_HIP
std::unique_ptr<Backend> create_hip_backend(const sparsa_context_options& options) {
  return gpu::create_gpu_backend(options);
}
#else
std::unique_ptr<Backend> create_cuda_backend(const sparsa_context_options& options) {
  return gpu::create_gpu_backend(options);
}
#endif
}  // namespace sparsa
