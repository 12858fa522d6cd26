// The forward launch every GPU policy ends in (gpu_launch.h): ForwardParams from a validated problem, the one
// kernel choice (fastest first: decode, wgmma, mma.sync, portable), the split-KV plan and the launch.
#include "../../../src/error.h"
#include "../kernels/forward_decode.h"
#include "../kernels/forward_mma.h"
#include "../kernels/forward_simt.h"
#include "../kernels/forward_wgmma.h"
#include "../kernels/token_indices.h"
#include "gpu_launch.h"

#include <algorithm>
#include <limits>

SPARSA_GPU_NAMESPACE_BEGIN
namespace {

#if SPARSA_GPU_IS_HIP
constexpr const char* kBackendName = "hip";
#else
constexpr const char* kBackendName = "cuda";
#endif

constexpr float kLog2eHost = 1.4426950408889634f;  // log2(e)
constexpr int64_t kRowAlignmentElems = 8;  // 16-byte cp.async chunks of 2-byte elements
constexpr uintptr_t kRowAlignmentBytes = 16;
constexpr int32_t kMinTilesPerSplit = 8;   // a split-KV share below this costs more in merging than it saves
constexpr int32_t kMaxSplits = 64;
constexpr int32_t kBlocksPerSmTarget = 2;  // split until about this many thread blocks per multiprocessor
constexpr int32_t kWgmmaBlocksPerSmTarget = 1;  // the wgmma kernel runs one block per multiprocessor
constexpr uint64_t kMaxSplitScratchBytes = uint64_t(256) << 20;
constexpr int32_t kDecodeKeysPerTile = 256;  // a decode split walks at least this many keys (2 chunks a warp)
constexpr int32_t kDecodeBlocksPerSmTarget = 4;
constexpr int32_t kDecodeMaxSplits = 128;
constexpr int32_t kIndexBlocksPerSmTarget = 16;  // index-driven attention: blocks of 1-4 warps, latency-bound
// Key lists on the decode kernel (a TOKEN_SELECT set of 2,688 keys, a TOKEN_INDICES list): a split of a list walks
// at least this many keys. A short list's time is the latency of each warp's chain of tiles plus the combine of the
// splits, not bandwidth: 256-key splits gave a 2,688-key set 11 splits of 8 tiles a warp (18.3 µs on an H100), 32-key
// splits 84 of one (13.0 µs; the combine then takes 5.4 µs instead of 3.5). With the grid target below capping the
// set at 66 splits, 64 keys (42 splits) measured best for the TOKEN_SELECT hit's graph replay (H200, 2026-11-29,
// alternating builds: 0.0286–0.0289 ms at 128K and 1M keys against 0.0294–0.0297 for 32 keys, 0.0292–0.0293 for 48,
// 0.0291–0.0295 for 96). Long lists keep their split count (the grid target decides it): 128 splits of a
// TOKEN_INDICES list per kv head took 0.060 ms against 0.052 ms for 66.
constexpr int32_t kDecodeListKeysPerSplit = 64;

// Splits `blocks` thread blocks' `key_tiles` tiles until about blocks_per_sm blocks per multiprocessor.
ForwardLaunch split_launch(ForwardKernel kernel, const GpuDevice& device, int64_t blocks, int64_t key_tiles,
                           int64_t min_tiles_per_split, int64_t blocks_per_sm, int64_t max_splits, int64_t max_seq_q,
                           int64_t flat_rows, int64_t num_q_heads, int64_t head_dim) {
  ForwardLaunch launch;
  launch.kernel = kernel;
  launch.max_seq_q = int32_t(max_seq_q);
  launch.overlap_launches = device.overlap_launches;
  const int64_t target = blocks_per_sm * device.multiprocessors;
  if (blocks == 0 || blocks >= target || key_tiles < 2 * min_tiles_per_split) return launch;
  const int64_t wanted = (target + blocks - 1) / blocks;
  const int64_t splits = std::min<int64_t>({wanted, key_tiles / min_tiles_per_split, max_splits});
  if (splits < 2) return launch;
  const uint64_t bytes = uint64_t(splits) * flat_rows * num_q_heads * (head_dim + 1) * sizeof(float);
  if (bytes > kMaxSplitScratchBytes) return launch;  // (also keeps flat_rows far inside int32)
  launch.num_splits = int32_t(splits);
  launch.flat_rows = int32_t(flat_rows);
  return launch;
}

// Row-mapped and PV-skip launches run unsplit (their partial states would be indexed by launch row, and the PV skip
// is defined over a row block's whole ascending walk).
ForwardLaunch unsplit_launch(ForwardKernel kernel, int64_t max_seq_q) {
  ForwardLaunch launch;
  launch.kernel = kernel;
  launch.max_seq_q = int32_t(max_seq_q);
  return launch;
}

#if !SPARSA_GPU_IS_HIP
constexpr int kOverlapLaunchPtxVersion = 90;  // griddepcontrol (programmatic dependent launch): PTX for sm_90+
// Compiled like every kernel of the library: the PTX version the device runs it from is theirs.
__global__ void launch_overlap_probe_kernel() {}
#endif

}  // namespace

bool launch_overlap_supported() {
#if SPARSA_GPU_IS_HIP
  return false;
#else
  cudaFuncAttributes attributes;
  if (cudaFuncGetAttributes(&attributes, launch_overlap_probe_kernel) != cudaSuccess) return false;
  return attributes.ptxVersion >= kOverlapLaunchPtxVersion;
#endif
}

void check(cudaError_t status, const char* call) {
  if (status == cudaSuccess) return;
  if (status == cudaErrorMemoryAllocation) {
    fail(SPARSA_STATUS_OUT_OF_MEMORY, call, " failed: ", cudaGetErrorString(status));
  }
  fail(SPARSA_STATUS_DEVICE_ERROR, call, " failed: ", cudaGetErrorString(status));
}

const char* backend_name() { return kBackendName; }

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

TensorStrides row_strides(const TensorArg& t) {
  if (t.t.ndim == 3) return TensorStrides{0, t.stride(0), t.stride(1)};
  return TensorStrides{t.stride(0), t.stride(1), t.stride(2)};
}

TensorStrides lse_strides(const TensorArg& lse, bool packed) {
  return packed ? TensorStrides{0, lse.stride(1), lse.stride(0)}
                : TensorStrides{lse.stride(0), lse.stride(2), lse.stride(1)};
}

bool rows_aligned_16(const TensorArg& t) {
  if (reinterpret_cast<uintptr_t>(t.t.data) % kRowAlignmentBytes != 0) return false;
  for (int d = 0; d + 1 < t.t.ndim; ++d) {
    if (t.stride(d) % kRowAlignmentElems != 0) return false;
  }
  return true;
}

int64_t flat_rows_of(const AttentionProblem& problem) {
  return problem.q_packed ? problem.q.extent(0) : int64_t(problem.batch) * problem.max_seq_q;
}

bool all_rows_aligned_16(const AttentionProblem& problem) {
  return rows_aligned_16(problem.q) && rows_aligned_16(problem.k) && rows_aligned_16(problem.v) &&
         rows_aligned_16(problem.out);
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
  p.kv_rows_extent = problem.kv_layout == KvLayout::kPadded   ? problem.k.extent(1)
                     : problem.kv_layout == KvLayout::kPacked ? problem.k.extent(0)
                                                              : 0;
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
  if (problem.query_offsets.present) {
    p.query_offsets = problem.query_offsets.ptr<const int32_t>();
    p.query_offsets_stride = problem.query_offsets.stride(0);
  }
  if (problem.kv_layout == KvLayout::kPaged) {
    p.page_table = problem.page_table.ptr<const int32_t>();
    p.page_table_stride_b = problem.page_table.stride(0);
    p.page_table_stride_p = problem.page_table.stride(1);
    p.page_size = problem.page_size;
  }
  p.causal = problem.causal;
  p.scale_log2 = problem.scale * kLog2eHost;  // kernels use exp2 (base-2 domain)

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

StatsParams make_stats_params(const AttentionProblem& problem, const PolicyParams& policy) {
  StatsParams st;
  if (!problem.stats.present) return st;
  st.out = problem.stats.ptr<int64_t>();
  st.stride = problem.stats.stride(0);
  st.count = int32_t(std::min<int64_t>(problem.stats.extent(0), SPARSA_STAT_COUNT));
  switch (policy_kind_info(policy.p.kind)->stat_blocks) {  // src/policy_table.h
    case StatBlocks::kDefaultTiling:
      st.tile_rows = kStatTileRows;
      st.tile_keys = kStatTileKeys;
      break;
    case StatBlocks::kPolicyBlocks:
      st.tile_rows = policy.p.block_q;
      st.tile_keys = policy.p.block_k;
      break;
    case StatBlocks::kNone:
      st.pairs_computed = false;  // token policies: their own kernels add their pairs
      break;
  }
  return st;
}

ForwardLaunch plan_forward(const GpuDevice& device, const ForwardParams& p, int64_t max_seq_q, int64_t max_seq_k,
                           int64_t flat_rows, bool tensors_aligned16, std::string* reason) {
  const bool plain_rows = p.row_map == QueryRowMap::kAll && p.pv_skip_log2 == nullptr;
  const int64_t heads = p.num_q_heads;
  if (plain_rows && forward_decode_supports(p, max_seq_q)) {
    const int64_t kv_heads = heads / p.group_size;
    return split_launch(ForwardKernel::kDecode, device, kv_heads * p.batch,
                        (max_seq_k + kDecodeKeysPerTile - 1) / kDecodeKeysPerTile, 1, kDecodeBlocksPerSmTarget,
                        kDecodeMaxSplits, max_seq_q, flat_rows, heads, p.head_dim);
  }
  const char* why_not = nullptr;
  // The wgmma kernel walks 128 × 128 tiles. Block-mask cells of 128 × 128 multiples cover whole tiles; cells whose
  // rows hold each 64-row warpgroup and whose keys fill 64-key halves (SPARGE's default 128 × 64, 64 × 64, 128 × 32,
  // ...: wgmma_gathers_mask_cells) are walked as gathered halves with a few mask reads per thread and tile. Any
  // other cell shape would put the per-element predicate, one mask read per element, in every tile: mma.sync.
  // SPARGE's PV skip (pv_skip_log2) stays on mma.sync (forward_wgmma_supports refuses it).
  const bool mask_cells_fit_wgmma =
      p.rule != VisibilityRule::kBlockMask ||
      (p.mask_block_q % kWgmmaBlockRows == 0 && p.mask_block_k % kWgmmaBlockKeys == 0) ||
      wgmma_gathers_mask_cells(p.mask_block_q, p.mask_block_k);
  if (tensors_aligned16 && mask_cells_fit_wgmma &&
      forward_wgmma_supports(p, device.compute_major, &why_not)) {
    if (!plain_rows) return unsplit_launch(ForwardKernel::kWgmma, max_seq_q);
    // One wgmma block per multiprocessor (its shared memory and registers take the whole SM): split the keys of
    // launches with fewer blocks than SMs, at least kMinTilesPerSplit / 2 tiles of kWgmmaBlockKeys keys per split.
    const int64_t query_tiles = (max_seq_q + kWgmmaBlockRows - 1) / kWgmmaBlockRows;
    return split_launch(ForwardKernel::kWgmma, device, query_tiles * heads * p.batch,
                        (max_seq_k + kWgmmaBlockKeys - 1) / kWgmmaBlockKeys, kMinTilesPerSplit / 2,
                        kWgmmaBlocksPerSmTarget, kMaxSplits, max_seq_q, flat_rows, heads, p.head_dim);
  }
  if (tensors_aligned16 && forward_mma_supports(p, &why_not)) {
    if (!plain_rows) return unsplit_launch(ForwardKernel::kTensorCore, max_seq_q);
    const int64_t query_tiles = (max_seq_q + kMmaBlockRows - 1) / kMmaBlockRows;
    return split_launch(ForwardKernel::kTensorCore, device, query_tiles * heads * p.batch,
                        (max_seq_k + kMmaBlockKeys - 1) / kMmaBlockKeys, kMinTilesPerSplit, kBlocksPerSmTarget,
                        kMaxSplits, max_seq_q, flat_rows, heads, p.head_dim);
  }
  if (!forward_simt_supports(p, &why_not) ||
      forward_simt_shared_bytes(p.head_dim) > device.max_shared_optin) {
    if (reason != nullptr) {
      *reason = std::string(kBackendName) + " backend: " +
                (why_not != nullptr ? why_not : "head_dim too large for this device's shared memory");
    }
    return ForwardLaunch{};
  }
  return unsplit_launch(ForwardKernel::kPortable, max_seq_q);
}

ForwardLaunch plan_index_attention(const GpuDevice& device, const ForwardParams& p, int64_t max_seq_q,
                                   int64_t max_list_keys, int64_t flat_rows) {
  // Blocks counted as index_attention_kernel's (one warp per query row of a head; latency-bound, so many resident
  // warps per SM); the decode kernel, which serves several heads of a list per block, splits as finely.
  const int64_t rows_per_block = index_rows_per_block(max_seq_q);
  const int64_t blocks = (max_seq_q + rows_per_block - 1) / rows_per_block * p.num_q_heads * p.batch;
  const int64_t keys_per_split = forward_decode_lists_supports(p) ? kDecodeListKeysPerSplit : kDecodeKeysPerTile;
  const int64_t key_tiles = (max_list_keys + keys_per_split - 1) / keys_per_split;
  return split_launch(ForwardKernel::kTokenIndices, device, blocks, key_tiles, 1, kIndexBlocksPerSmTarget,
                      kDecodeMaxSplits, max_seq_q, flat_rows, p.num_q_heads, p.head_dim);
}

void carve_forward(ScratchCarver& carver, const ForwardLaunch& launch, ForwardParams& p) {
  p.num_splits = launch.num_splits;
  p.flat_rows = launch.flat_rows;
  p.overlap_launches = launch.overlap_launches;
  if (launch.num_splits <= 1) return;
  const uint64_t states = uint64_t(launch.num_splits) * launch.flat_rows * p.num_q_heads;
  p.partial_out = carver.take<float>(states * p.head_dim);
  p.partial_lse = carver.take<float>(states);
}

void launch_forward(const GpuDevice& device, const ForwardLaunch& launch, const ForwardParams& p) {
  switch (launch.kernel) {
    case ForwardKernel::kDecode:
      check(forward_decode_launch(p, launch.max_seq_q, device.stream), "forward_decode_kernel launch");
      return;
    case ForwardKernel::kWgmma:
      check(forward_wgmma_launch(p, launch.max_seq_q, device.stream), "forward_wgmma_kernel launch");
      return;
    case ForwardKernel::kTensorCore:
      check(forward_mma_launch(p, launch.max_seq_q, device.stream), "forward_mma_kernel launch");
      return;
    case ForwardKernel::kPortable:
      check(forward_simt_launch(p, launch.max_seq_q, device.stream), "forward_simt_kernel launch");
      return;
    default:
      fail(SPARSA_STATUS_INTERNAL, kBackendName, " backend: launch_forward got no kernel");
  }
}

SPARSA_GPU_NAMESPACE_END
