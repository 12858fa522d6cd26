// The CUDA (and, compiled by hipcc through backends/gpu/hip/, the HIP) implementation of sparsa::Backend.
//
// Reads top to bottom: error checking, the device guard, turning an AttentionProblem into ForwardParams, the one
// function that says both whether a case is supported and which kernel runs it (choose_kernel), the Backend class,
// and the factories src/registry.cpp calls.
//
// Contract kept here (ABI.md rule 9): run() only enqueues on the context's stream — no host synchronisation, no
// allocation once planned — so it can be captured in a CUDA graph. The only scratch is split-KV's fp32 partial
// states (decode and other small launches) and TOKEN_INDICES' key lists, grown by plan() or, unplanned, by the
// first run that needs it.
#include "../../src/backend.h"
#include "../../src/error.h"
#include "../../src/registry.h"
#include "attention_stats.h"
#include "forward_mma.h"
#include "forward_params.h"
#include "forward_decode.h"
#include "forward_simt.h"
#include "gpu_runtime.h"
#include "merge_states.h"
#include "token_indices.h"

#include <cmath>
#include <algorithm>
#include <cstdint>
#include <limits>
#include <memory>
#include <string>

SPARSA_GPU_NAMESPACE_BEGIN
namespace {

#if SPARSA_GPU_IS_HIP
constexpr const char* kBackendName = "hip";
constexpr int32_t kDeviceType = SPARSA_DEVICE_ROCM;
#else
constexpr const char* kBackendName = "cuda";
constexpr int32_t kDeviceType = SPARSA_DEVICE_CUDA;
#endif

constexpr int64_t kRowAlignmentElems = 8;     // 16-byte cp.async chunks of 2-byte elements
constexpr uintptr_t kRowAlignmentBytes = 16;
constexpr int64_t kMaxGridZ = 65535;          // batch rides on gridDim.z
constexpr int64_t kMaxGridY = 65535;          // query heads ride on gridDim.y
constexpr int32_t kTensorCoreBlockRows = 64;  // query rows per tensor-core thread block (forward_mma.cu)
constexpr int32_t kTensorCoreBlockKeys = 64;  // keys per tensor-core tile
constexpr int32_t kMinTilesPerSplit = 8;      // a split-KV share below this costs more in merging than it saves
constexpr int32_t kMaxSplits = 64;
constexpr int32_t kBlocksPerSmTarget = 2;     // split until about this many thread blocks per multiprocessor
constexpr uint64_t kMaxSplitScratchBytes = uint64_t(256) << 20;
constexpr int32_t kDecodeKeysPerTile = 256;       // a decode split walks at least this many keys (2 chunks a warp)
constexpr int32_t kDecodeBlocksPerSmTarget = 4;
constexpr int32_t kDecodeMaxSplits = 128;
constexpr int32_t kIndexBlocksPerSmTarget = 16;   // index-driven attention: blocks of 1-4 warps, latency-bound
constexpr uint64_t kScratchAlignment = 256;
constexpr uint64_t kMaxIndexListBytes = uint64_t(1) << 30;

// Every runtime call goes through here: a failure becomes SPARSA_STATUS_DEVICE_ERROR naming the call.
void check(cudaError_t status, const char* call) {
  if (status == cudaSuccess) return;
  if (status == cudaErrorMemoryAllocation) {
    fail(SPARSA_STATUS_OUT_OF_MEMORY, call, " failed: ", cudaGetErrorString(status));
  }
  fail(SPARSA_STATUS_DEVICE_ERROR, call, " failed: ", cudaGetErrorString(status));
}

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

ElementType element_type_of(int32_t dtype) {
  switch (dtype) {
    case SPARSA_DTYPE_F16:
      return ElementType::kF16;
    case SPARSA_DTYPE_BF16:
      return ElementType::kBF16;
    default:
      return ElementType::kF32;
  }
}

// [.., S, H, D] strides of q/out (rank 4 padded [B, S, H, D] or rank 3 packed [T, H, D]).
TensorStrides row_strides(const TensorArg& t) {
  if (t.t.ndim == 3) return TensorStrides{0, t.stride(0), t.stride(1)};
  return TensorStrides{t.stride(0), t.stride(1), t.stride(2)};
}

// Strides of an lse tensor ([B, Hq, Sq] or packed [Hq, Tq]) in TensorStrides' (b, s, h) order.
TensorStrides lse_strides(const TensorArg& lse, bool packed) {
  return packed ? TensorStrides{0, lse.stride(1), lse.stride(0)}
                : TensorStrides{lse.stride(0), lse.stride(2), lse.stride(1)};
}

// Does every row of `t` start on a 16-byte boundary (base aligned, every non-last stride a multiple of 8)?
bool rows_aligned_16(const TensorArg& t) {
  if (reinterpret_cast<uintptr_t>(t.t.data) % kRowAlignmentBytes != 0) return false;
  for (int d = 0; d + 1 < t.t.ndim; ++d) {
    if (t.stride(d) % kRowAlignmentElems != 0) return false;
  }
  return true;
}

ForwardParams make_forward_params(const AttentionProblem& problem, const PolicyParams& policy) {
  ForwardParams p;
  p.q = problem.q.t.data;
  p.k = problem.k.t.data;
  p.v = problem.v.t.data;
  p.out = problem.out.t.data;
  p.q_strides = row_strides(problem.q);
  p.out_strides = row_strides(problem.out);
  p.k_strides = row_strides(problem.k);  // paged: b = page stride, s = slot stride
  p.v_strides = row_strides(problem.v);
  if (problem.lse.present) {
    p.lse = problem.lse.ptr<float>();
    p.lse_strides = lse_strides(problem.lse, problem.q_packed);
  }
  p.element_type = element_type_of(problem.dtype);
  p.kv_rows_aligned16 = rows_aligned_16(problem.k) && rows_aligned_16(problem.v);
  p.batch = problem.batch;
  p.num_q_heads = problem.num_q_heads;
  p.group_size = problem.num_q_heads / problem.num_kv_heads;
  p.head_dim = problem.head_dim;
  p.padded_seq_q = problem.q_packed ? 0 : int32_t(problem.q.extent(1));
  p.padded_seq_k = problem.kv_layout == KvLayout::kPadded ? int32_t(problem.k.extent(1)) : 0;
  if (problem.q_packed) {
    p.cu_seqlens_q = problem.cu_seqlens_q.ptr<const int32_t>();
    p.cu_seqlens_q_stride = problem.cu_seqlens_q.stride(0);
  }
  if (problem.kv_layout == KvLayout::kPacked) {
    p.cu_seqlens_k = problem.cu_seqlens_k.ptr<const int32_t>();
    p.cu_seqlens_k_stride = problem.cu_seqlens_k.stride(0);
  }
  if (problem.seq_lens_k.present) {
    p.seq_lens_k = problem.seq_lens_k.ptr<const int32_t>();
    p.seq_lens_k_stride = problem.seq_lens_k.stride(0);
  }
  if (problem.kv_layout == KvLayout::kPaged) {
    p.page_table = problem.page_table.ptr<const int32_t>();
    p.page_table_stride_b = problem.page_table.stride(0);
    p.page_table_stride_p = problem.page_table.stride(1);
    p.page_size = problem.page_size;
  }
  p.causal = problem.causal;
  p.scale_log2 = problem.scale * 1.4426950408889634f;  // log2(e): kernels use exp2

  switch (policy.p.kind) {
    case SPARSA_POLICY_SINK_WINDOW:
      p.rule = VisibilityRule::kSinkWindow;
      p.sink_tokens = policy.p.sink_tokens;
      p.sink_window = policy.p.sink_window;
      break;
    case SPARSA_POLICY_BLOCK_SPARSE:
      p.rule = VisibilityRule::kBlockMask;
      p.block_mask = policy.block_mask.ptr<const uint8_t>();
      for (int d = 0; d < 4; ++d) p.block_mask_strides[d] = policy.block_mask.stride(d);
      p.mask_block_q = policy.p.block_q;
      p.mask_block_k = policy.p.block_k;
      break;
    default:
      p.rule = VisibilityRule::kDense;
      break;
  }
  return p;
}


// Fastest first (oneDNN-style list): decode for a few rows per kv head, tensor cores, then the portable kernel;
// TOKEN_INDICES has its own index-driven pair of kernels (token_indices.cu).
enum class ForwardKernel { kNone, kDecode, kTensorCore, kPortable, kTokenIndices };

// The one place that answers "can this backend run it?" and "with which kernel?" (STYLE.md point 7).
ForwardKernel choose_kernel(const AttentionProblem& problem, const PolicyParams& policy, std::string* reason) {
  auto refuse = [&](const std::string& why) {
    if (reason != nullptr) *reason = std::string(kBackendName) + " backend: " + why;
    return ForwardKernel::kNone;
  };
  const int32_t kind = policy.p.kind;
  if (kind != SPARSA_POLICY_DENSE && kind != SPARSA_POLICY_SINK_WINDOW && kind != SPARSA_POLICY_BLOCK_SPARSE &&
      kind != SPARSA_POLICY_TOKEN_INDICES) {
    return refuse(std::string("policy ") + sparsa_policy_kind_name(kind) +
                  " is not implemented on this backend yet (DENSE, SINK_WINDOW, BLOCK_SPARSE and TOKEN_INDICES are)");
  }
  if (policy.delta) return refuse("the DELTA flag is not implemented on this backend yet");
  if (problem.block_mask_out.present) return refuse("block_mask_out (SPARGE) is not implemented on this backend");
  if (problem.selected_indices.present && kind != SPARSA_POLICY_TOKEN_INDICES) {
    return refuse("selected_indices is implemented for TOKEN_INDICES only on this backend");
  }
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
  if (kind == SPARSA_POLICY_TOKEN_INDICES) {
    if (problem.max_seq_k > kIndexMaxKeys) {
      return refuse("TOKEN_INDICES needs Skv <= " + std::to_string(kIndexMaxKeys) + " (shared-memory key bitmap)");
    }
    if (uint64_t(problem.batch) * problem.num_q_heads * uint64_t(problem.max_seq_k) * sizeof(int32_t) >
        kMaxIndexListBytes) {
      return refuse("TOKEN_INDICES key lists (B x Hq x Skv int32, Skv = Tk for packed k/v) exceed 1 GiB of scratch");
    }
    return ForwardKernel::kTokenIndices;
  }
  const ForwardParams params = make_forward_params(problem, policy);
  if (forward_decode_supports(params, problem.max_seq_q)) return ForwardKernel::kDecode;
  const char* mma_reason = nullptr;
  if (forward_mma_supports(params, &mma_reason) && rows_aligned_16(problem.q) &&
      rows_aligned_16(problem.k) && rows_aligned_16(problem.v) && rows_aligned_16(problem.out)) {
    return ForwardKernel::kTensorCore;
  }
  return ForwardKernel::kPortable;
}

// How many key splits a decode or tensor-core launch uses (1 = none) and the fp32 scratch its partial states need:
// split only when the launch has fewer blocks than the GPU holds, and never below a useful share of keys.
struct SplitPlan {
  int32_t num_splits = 1;
  int32_t flat_rows = 0;
  uint64_t scratch_bytes = 0;
};

SplitPlan plan_splits(ForwardKernel kernel, const AttentionProblem& problem, int32_t multiprocessors) {
  SplitPlan plan;
  int64_t blocks = 0, key_tiles = 0, min_tiles_per_split = 0, blocks_per_sm = 0, max_splits = 0;
  if (kernel == ForwardKernel::kTensorCore) {
    const int64_t query_tiles = (problem.max_seq_q + kTensorCoreBlockRows - 1) / kTensorCoreBlockRows;
    blocks = query_tiles * problem.num_q_heads * problem.batch;
    key_tiles = (problem.max_seq_k + kTensorCoreBlockKeys - 1) / kTensorCoreBlockKeys;
    min_tiles_per_split = kMinTilesPerSplit;
    blocks_per_sm = kBlocksPerSmTarget;
    max_splits = kMaxSplits;
  } else if (kernel == ForwardKernel::kTokenIndices) {
    // One warp per query row and no reuse across rows: latency-bound, so aim for many resident warps per SM.
    const int64_t rows_per_block = index_rows_per_block(problem.max_seq_q);
    blocks = (problem.max_seq_q + rows_per_block - 1) / rows_per_block * problem.num_q_heads * problem.batch;
    key_tiles = (problem.max_seq_k + kDecodeKeysPerTile - 1) / kDecodeKeysPerTile;
    min_tiles_per_split = 1;
    blocks_per_sm = kIndexBlocksPerSmTarget;
    max_splits = kDecodeMaxSplits;
  } else if (kernel == ForwardKernel::kDecode) {
    blocks = int64_t(problem.num_kv_heads) * problem.batch;
    key_tiles = (problem.max_seq_k + kDecodeKeysPerTile - 1) / kDecodeKeysPerTile;
    min_tiles_per_split = 1;
    blocks_per_sm = kDecodeBlocksPerSmTarget;
    max_splits = kDecodeMaxSplits;
  } else {
    return plan;
  }
  if (blocks == 0 || blocks >= blocks_per_sm * multiprocessors || key_tiles < 2 * min_tiles_per_split) return plan;
  const int64_t wanted = (blocks_per_sm * multiprocessors + blocks - 1) / blocks;
  const int64_t splits = std::min<int64_t>({wanted, key_tiles / min_tiles_per_split, max_splits});
  if (splits < 2) return plan;
  const int64_t flat_rows = problem.q_packed ? problem.q.extent(0) : int64_t(problem.batch) * problem.max_seq_q;
  const uint64_t bytes = uint64_t(splits) * flat_rows * problem.num_q_heads * (problem.head_dim + 1) * sizeof(float);
  if (bytes > kMaxSplitScratchBytes) return plan;  // (also keeps flat_rows far inside int32)
  plan.num_splits = int32_t(splits);
  plan.flat_rows = int32_t(flat_rows);
  plan.scratch_bytes = bytes;
  return plan;
}

class GpuBackend final : public Backend {
 public:
  GpuBackend(int32_t device, void* stream) : device_(device), stream_(static_cast<cudaStream_t>(stream)) {
    DeviceGuard guard(device_);
    check(cudaDeviceGetAttribute(&max_shared_optin_, cudaDevAttrMaxSharedMemoryPerBlockOptin, device_),
          "cudaDeviceGetAttribute");
    check(cudaDeviceGetAttribute(&multiprocessors_, cudaDevAttrMultiProcessorCount, device_),
          "cudaDeviceGetAttribute");
    // Kernel attributes are set here, not in run(), so that a run contains nothing but launches (graph capture).
    check(forward_mma_prepare(), "cudaFuncSetAttribute (tensor-core forward)");
    if (forward_simt_shared_bytes(kSimtMaxHeadDim) <= static_cast<size_t>(max_shared_optin_)) {
      check(forward_simt_prepare(), "cudaFuncSetAttribute (portable forward)");
    }
    check(token_indices_prepare(size_t(max_shared_optin_), &index_set_max_shared_),
          "cudaFuncSetAttribute (TOKEN_INDICES key sets)");
  }

  int32_t device_type() const override { return kDeviceType; }
  const char* name() const override { return kBackendName; }
  void set_stream(void* stream) override { stream_ = static_cast<cudaStream_t>(stream); }
  uint64_t scratch_bytes() const override { return scratch_bytes_; }

  ~GpuBackend() override {
    if (scratch_ != nullptr) (void)cudaFree(scratch_);  // destroy waits for nothing (sparsa.h): caller syncs first
  }
  GpuBackend(const GpuBackend&) = delete;
  GpuBackend& operator=(const GpuBackend&) = delete;

  bool supports(const AttentionProblem& problem, const PolicyParams& policy, std::string* reason) const override {
    return supported_kernel(problem, policy, reason) != ForwardKernel::kNone;
  }

  void plan(const AttentionProblem& problem, const PolicyParams& policy) override {
    std::string reason;
    const ForwardKernel kernel = supported_kernel(problem, policy, &reason);
    if (kernel == ForwardKernel::kNone) fail(SPARSA_STATUS_UNSUPPORTED, reason);
    grow_scratch(scratch_layout(kernel, problem, plan_splits(kernel, problem, multiprocessors_)).total);
  }

  void run(const AttentionProblem& problem, const PolicyParams& policy) override {
    std::string reason;
    const ForwardKernel kernel = supported_kernel(problem, policy, &reason);
    if (kernel == ForwardKernel::kNone) fail(SPARSA_STATUS_UNSUPPORTED, reason);
    DeviceGuard guard(device_);
    ForwardParams params = make_forward_params(problem, policy);
    const StatsParams stats = stats_params(problem, policy);
    if (stats.out != nullptr) {
      check(stats_zero_launch(stats, stream_), "stats_zero_kernel launch");
      if (problem.batch > 0 && problem.num_q_heads > 0) {
        check(stats_count_launch(params, stats, stream_), "stats_count_kernel launch");
      }
    }
    if (problem.batch == 0 || problem.num_q_heads == 0 || problem.max_seq_q == 0) return;
    const SplitPlan split = plan_splits(kernel, problem, multiprocessors_);
    const ScratchLayout layout = scratch_layout(kernel, problem, split);
    grow_scratch(layout.total);  // allocates only on a first, unplanned run
    char* scratch = static_cast<char*>(scratch_);
    if (split.num_splits > 1) {
      params.num_splits = split.num_splits;
      params.flat_rows = split.flat_rows;
      params.partial_out = reinterpret_cast<float*>(scratch);  // first: its float2 stores need 8-byte alignment
      params.partial_lse =
          params.partial_out + int64_t(split.num_splits) * split.flat_rows * problem.num_q_heads * problem.head_dim;
    }
    if (kernel == ForwardKernel::kTokenIndices) {
      IndexSetParams ix = index_set_params(problem, policy);
      ix.key_lists = reinterpret_cast<int32_t*>(scratch + layout.key_lists_at);
      ix.key_counts = reinterpret_cast<int32_t*>(scratch + layout.key_counts_at);
      check(token_indices_launch(params, ix, stats, int32_t(problem.max_seq_q), stream_), "token_indices launch");
    } else if (kernel == ForwardKernel::kDecode) {
      check(forward_decode_launch(params, int32_t(problem.max_seq_q), stream_), "forward_decode_kernel launch");
    } else if (kernel == ForwardKernel::kTensorCore) {
      check(forward_mma_launch(params, int32_t(problem.max_seq_q), stream_), "forward_mma_kernel launch");
    } else {
      check(forward_simt_launch(params, int32_t(problem.max_seq_q), stream_), "forward_simt_kernel launch");
    }
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
    DeviceGuard guard(device_);
    check(merge_states_launch(p, stream_), "merge_states_kernel launch");
  }

  void topk_from_scores(const TensorArg&, int32_t, int32_t, const TensorArg&) override {
    fail(SPARSA_STATUS_UNSUPPORTED, kBackendName, " backend: topk_from_scores is not implemented yet");
  }
  void kv_prefetch(const PrefetchProblem&) override {
    fail(SPARSA_STATUS_UNSUPPORTED, kBackendName, " backend: kv_prefetch is not implemented yet");
  }
  std::unique_ptr<SelectionCacheState> create_selection_cache(const SelectionCacheDims&) override {
    fail(SPARSA_STATUS_UNSUPPORTED, kBackendName,
         " backend: selection caches are not implemented yet (TOKEN_SELECT is unsupported here)");
  }

 private:
  // choose_kernel plus the limits of this device's shared memory; kNone (with *reason) when it cannot run.
  ForwardKernel supported_kernel(const AttentionProblem& problem, const PolicyParams& policy,
                                 std::string* reason) const {
    const ForwardKernel kernel = choose_kernel(problem, policy, reason);
    if (kernel == ForwardKernel::kPortable &&
        forward_simt_shared_bytes(problem.head_dim) > static_cast<size_t>(max_shared_optin_)) {
      if (reason != nullptr) *reason = std::string(kBackendName) + " backend: head_dim too large for shared memory";
      return ForwardKernel::kNone;
    }
    if (kernel == ForwardKernel::kTokenIndices &&
        index_set_shared_bytes(problem.max_seq_k) > index_set_max_shared_) {
      if (reason != nullptr) {
        *reason = std::string(kBackendName) + " backend: TOKEN_INDICES key bitmap of Skv = " +
                  std::to_string(problem.max_seq_k) + " keys exceeds this device's shared memory";
      }
      return ForwardKernel::kNone;
    }
    return kernel;
  }

  // Byte offsets in the scratch buffer: split-KV partial states, then (TOKEN_INDICES) the key lists and counts.
  struct ScratchLayout {
    uint64_t key_lists_at = 0, key_counts_at = 0, total = 0;
  };
  static ScratchLayout scratch_layout(ForwardKernel kernel, const AttentionProblem& problem, const SplitPlan& split) {
    ScratchLayout layout;
    layout.total = split.num_splits > 1 ? split.scratch_bytes : 0;
    if (kernel != ForwardKernel::kTokenIndices) return layout;
    const uint64_t lists = uint64_t(problem.batch) * problem.num_q_heads;
    layout.key_lists_at = (layout.total + kScratchAlignment - 1) / kScratchAlignment * kScratchAlignment;
    layout.key_counts_at = layout.key_lists_at + lists * uint64_t(problem.max_seq_k) * sizeof(int32_t);
    layout.total = layout.key_counts_at + lists * sizeof(int32_t);
    return layout;
  }

  static IndexSetParams index_set_params(const AttentionProblem& problem, const PolicyParams& policy) {
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

  // What the stats kernels count for this policy (sparsa_stat_index; out = null when stats were not asked for).
  static StatsParams stats_params(const AttentionProblem& problem, const PolicyParams& policy) {
    StatsParams st;
    if (!problem.stats.present) return st;
    st.out = problem.stats.ptr<int64_t>();
    st.stride = problem.stats.stride(0);
    st.count = int32_t(std::min<int64_t>(problem.stats.extent(0), SPARSA_STAT_COUNT));
    switch (policy.p.kind) {
      case SPARSA_POLICY_DENSE:
      case SPARSA_POLICY_SINK_WINDOW:
        st.tile_rows = kStatTileRows;
        st.tile_keys = kStatTileKeys;
        break;
      case SPARSA_POLICY_BLOCK_SPARSE:
        st.tile_rows = policy.p.block_q;
        st.tile_keys = policy.p.block_k;
        break;
      default:
        st.pairs_computed = false;  // TOKEN_INDICES: the key-set kernel adds its pairs
        break;
    }
    return st;
  }

  // Scratch only grows; plan() sizes it so that later runs allocate nothing.
  void grow_scratch(uint64_t bytes) {
    if (bytes <= scratch_bytes_) return;
    DeviceGuard guard(device_);
    if (scratch_ != nullptr) check(cudaFree(scratch_), "cudaFree");
    scratch_ = nullptr;
    scratch_bytes_ = 0;
    check(cudaMalloc(&scratch_, bytes), "cudaMalloc");
    scratch_bytes_ = bytes;
  }

  int32_t device_;
  cudaStream_t stream_;
  int max_shared_optin_ = 0;
  size_t index_set_max_shared_ = 0;  // dynamic shared memory the TOKEN_INDICES key-set kernel may use
  int multiprocessors_ = 1;
  void* scratch_ = nullptr;
  uint64_t scratch_bytes_ = 0;
};

std::unique_ptr<Backend> create_gpu_backend(const sparsa_context_options& options) {
  int count = 0;  // left untouched by cudaGetDeviceCount without a driver (TOOLCHAIN.md)
  const cudaError_t status = cudaGetDeviceCount(&count);
  if (status != cudaSuccess || count == 0) {
    (void)cudaGetLastError();  // clear the sticky "no driver" error
    fail(SPARSA_STATUS_BACKEND_UNAVAILABLE, kBackendName, " backend: no usable device (",
         status == cudaSuccess ? "0 devices" : cudaGetErrorString(status), ")");
  }
  if (options.device_id < 0 || options.device_id >= count) {
    fail(SPARSA_STATUS_BACKEND_UNAVAILABLE, "device_id: expected 0..", count - 1, " (", count, " ", kBackendName,
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
