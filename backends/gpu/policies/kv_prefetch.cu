// sparsa_kv_prefetch on a GPU context (§7; semantics = cpu_prefetch.cpp): per sequence b, the union U_b of its
// valid indices, ascending, becomes compact rows: positions[b, c] = U_b[c] (-1 past |U_b|), remapped = each index's
// compact row, counts[b] = |U_b|, and K/V rows of U_b copied from the host sources into k_dst/v_dst. Everything is
// enqueued on the context's stream; nothing waits for the device.
//
// The sources are read by the gather kernel itself, through unified addressing: they must be device-accessible —
// pinned host memory (cudaMallocHost, cudaHostRegister), device or managed memory, or pageable memory on a system
// whose device can access it (HMM). Plain pageable memory is refused (UNSUPPORTED) with a message that says so,
// since copying it would need a staging buffer and a host synchronisation. The indices are small: pageable ones are
// staged into scratch with one cudaMemcpyAsync (which returns once the runtime has taken its copy).
//
// Kernels: mark (a bitmap of selected tokens per sequence, atomicOr), scan (one block per sequence: per-word prefix
// counts, positions, counts), remap (rank of each index = prefix of its word + popcount below its bit), gather (one
// block per compact row: every kv head's K and V row, 16-byte vectors when aligned).
#include "../../../src/error.h"
#include "../runtime/gpu_policies.h"

#include <algorithm>
#include <string>

SPARSA_GPU_NAMESPACE_BEGIN
namespace {

constexpr int kThreads = 256;
constexpr int kBitsPerWord = 32;
constexpr int64_t kMaxGridBlocks = 65535;
constexpr int kVectorBytes = 16;

struct PrefetchParams {
  const char* k_src = nullptr;  // device-accessible addresses of the sources
  const char* v_src = nullptr;
  int64_t src_strides[3] = {0, 0, 0};  // b, t, hk in elements (k_src; v_src has the same shape)
  int64_t v_src_strides[3] = {0, 0, 0};
  const int32_t* indices = nullptr;  // device-accessible
  int64_t index_strides[3] = {0, 0, 0};
  int32_t index_heads = 0, slots = 0;
  char* k_dst = nullptr;
  char* v_dst = nullptr;
  int64_t dst_strides[3] = {0, 0, 0};
  int64_t v_dst_strides[3] = {0, 0, 0};
  int32_t* positions = nullptr;
  int64_t position_strides[2] = {0, 0};
  int32_t* remapped = nullptr;
  int64_t remapped_strides[3] = {0, 0, 0};
  int32_t* counts = nullptr;  // optional output
  int64_t counts_stride = 0;
  int32_t batch = 0, kv_heads = 0, head_dim = 0, capacity = 0;
  int64_t n_tokens = 0;  // marked tokens: min(N, 2^31), as ids are int32
  int32_t element_bytes = 2;
  bool vectors = false;  // every source/destination row starts on a 16-byte boundary and spans whole vectors
  // Scratch.
  uint32_t* bitmap = nullptr;         // [B, words]
  int32_t* word_offsets = nullptr;    // [B, words]: selected tokens before each word
  int32_t* union_sizes = nullptr;     // [B]
  int64_t words = 0;
};

__global__ void __launch_bounds__(kThreads) mark_kernel(const PrefetchParams p) {
  const int64_t per_sequence = int64_t(p.index_heads) * p.slots;
  const int64_t total = per_sequence * p.batch;
  for (int64_t e = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; e < total; e += int64_t(gridDim.x) * blockDim.x) {
    const int64_t b = e / per_sequence, row = e % per_sequence / p.slots, slot = e % p.slots;
    const int32_t id = p.indices[b * p.index_strides[0] + row * p.index_strides[1] + slot * p.index_strides[2]];
    if (id < 0 || id >= p.n_tokens) continue;  // -1 = unused; others were range-checked by the core
    atomicOr(&p.bitmap[b * p.words + id / kBitsPerWord], 1u << (id % kBitsPerWord));
  }
}

// One block per sequence: word prefix counts (per-thread runs of words, then a block scan), positions, sizes.
__global__ void __launch_bounds__(kThreads) scan_kernel(const PrefetchParams p) {
  __shared__ int32_t run_offsets[kThreads + 1];
  const int64_t b = blockIdx.x;
  const uint32_t* bitmap = p.bitmap + b * p.words;
  const int64_t words_per_run = (p.words + kThreads - 1) / kThreads;
  const int64_t first = threadIdx.x * words_per_run;
  const int64_t last = first + words_per_run < p.words ? first + words_per_run : p.words;
  int32_t count = 0;
  for (int64_t w = first; w < last; ++w) count += __popc(bitmap[w]);
  run_offsets[threadIdx.x + 1] = count;
  __syncthreads();
  if (threadIdx.x == 0) {
    run_offsets[0] = 0;
    for (int t = 1; t <= kThreads; ++t) run_offsets[t] += run_offsets[t - 1];
  }
  __syncthreads();
  int32_t at = run_offsets[threadIdx.x];
  int32_t* positions = p.positions + b * p.position_strides[0];
  for (int64_t w = first; w < last; ++w) {
    p.word_offsets[b * p.words + w] = at;
    for (uint32_t bits = bitmap[w]; bits != 0; bits &= bits - 1) {
      if (at < p.capacity) positions[int64_t(at) * p.position_strides[1]] = int32_t(w * kBitsPerWord + __ffs(bits) - 1);
      ++at;
    }
  }
  const int32_t total = run_offsets[kThreads];
  for (int64_t c = total + threadIdx.x; c < p.capacity; c += kThreads) positions[c * p.position_strides[1]] = -1;
  if (threadIdx.x == 0) {
    p.union_sizes[b] = total;
    if (p.counts != nullptr) p.counts[b * p.counts_stride] = total;
  }
}

__global__ void __launch_bounds__(kThreads) remap_kernel(const PrefetchParams p) {
  const int64_t per_sequence = int64_t(p.index_heads) * p.slots;
  const int64_t total = per_sequence * p.batch;
  for (int64_t e = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; e < total; e += int64_t(gridDim.x) * blockDim.x) {
    const int64_t b = e / per_sequence, row = e % per_sequence / p.slots, slot = e % p.slots;
    const int32_t id = p.indices[b * p.index_strides[0] + row * p.index_strides[1] + slot * p.index_strides[2]];
    int32_t compact = -1;
    if (id >= 0 && id < p.n_tokens) {
      const int64_t w = b * p.words + id / kBitsPerWord;
      compact = p.word_offsets[w] + __popc(p.bitmap[w] & ((1u << (id % kBitsPerWord)) - 1u));
    }
    p.remapped[b * p.remapped_strides[0] + row * p.remapped_strides[1] + slot * p.remapped_strides[2]] = compact;
  }
}

// One unit (16, 4 or 2 bytes) of a row copy.
__device__ __forceinline__ void copy_unit(const char* src, char* dst, int unit) {
  if (unit == kVectorBytes) {
    *reinterpret_cast<uint4*>(dst) = *reinterpret_cast<const uint4*>(src);
  } else if (unit == 4) {
    *reinterpret_cast<uint32_t*>(dst) = *reinterpret_cast<const uint32_t*>(src);
  } else {
    *reinterpret_cast<uint16_t*>(dst) = *reinterpret_cast<const uint16_t*>(src);
  }
}

// Block (b, c) copies compact row c of sequence b: every kv head of K and V, the block's threads dealt over
// (kv head, unit) pairs. Rows past the union stay untouched.
__global__ void __launch_bounds__(kThreads) gather_kernel(const PrefetchParams p) {
  const int64_t b = blockIdx.x / p.capacity, c = blockIdx.x % p.capacity;
  if (c >= p.union_sizes[b]) return;
  const int64_t token = p.positions[b * p.position_strides[0] + c * p.position_strides[1]];
  const int unit = p.vectors ? kVectorBytes : p.element_bytes;
  const int64_t units_per_row = int64_t(p.head_dim) * p.element_bytes / unit;
  for (int64_t u = threadIdx.x; u < units_per_row * p.kv_heads; u += blockDim.x) {
    const int64_t hk = u / units_per_row, offset = u % units_per_row * unit;
    const int64_t ks = (b * p.src_strides[0] + token * p.src_strides[1] + hk * p.src_strides[2]) * p.element_bytes;
    const int64_t vs =
        (b * p.v_src_strides[0] + token * p.v_src_strides[1] + hk * p.v_src_strides[2]) * p.element_bytes;
    const int64_t kd = (b * p.dst_strides[0] + c * p.dst_strides[1] + hk * p.dst_strides[2]) * p.element_bytes;
    const int64_t vd = (b * p.v_dst_strides[0] + c * p.v_dst_strides[1] + hk * p.v_dst_strides[2]) * p.element_bytes;
    copy_unit(p.k_src + ks + offset, p.k_dst + kd + offset, unit);
    copy_unit(p.v_src + vs + offset, p.v_dst + vd + offset, unit);
  }
}

// The address the device reads `t` through, or null with *why when it cannot read it.
const void* device_address(const GpuDevice& device, const TensorArg& t, std::string* why) {
  cudaPointerAttributes attributes{};
  const cudaError_t status = cudaPointerGetAttributes(&attributes, t.t.data);
  if (status != cudaSuccess) (void)cudaGetLastError();  // older runtimes: an unknown host pointer is an error
  const PointerKind kind = status == cudaSuccess ? pointer_kind(attributes) : PointerKind::kUnknown;
  if (kind == PointerKind::kHost && attributes.devicePointer != nullptr) {
    return attributes.devicePointer;  // pinned / registered host memory, mapped for the device
  }
  if (kind == PointerKind::kDevice || kind == PointerKind::kManaged) {
    if (kind == PointerKind::kDevice && attributes.device != device.device) {
      *why = "memory of another device (" + std::to_string(attributes.device) + ")";
      return nullptr;
    }
    return t.t.data;
  }
  int pageable_access = 0;
  if (cudaDeviceGetAttribute(&pageable_access, cudaDevAttrPageableMemoryAccess, device.device) != cudaSuccess) {
    (void)cudaGetLastError();
    pageable_access = 0;
  }
  if (pageable_access != 0) return t.t.data;
  *why = "pageable host memory, which this device cannot read; allocate it pinned (cudaMallocHost) or register it "
         "(cudaHostRegister)";
  return nullptr;
}

// Elements spanned by a tensor with non-negative strides (1 + Σ (extent - 1) · stride), 0 when it is empty.
int64_t span_elements(const TensorArg& t) {
  int64_t span = 1;
  for (int d = 0; d < t.t.ndim; ++d) {
    if (t.extent(d) == 0) return 0;
    span += (t.extent(d) - 1) * t.stride(d);
  }
  return span;
}

bool aligned16(const void* pointer, const TensorArg& t, int64_t element_bytes) {
  if (reinterpret_cast<uintptr_t>(pointer) % kVectorBytes != 0) return false;
  for (int d = 0; d + 1 < t.t.ndim; ++d) {
    if (t.stride(d) * element_bytes % kVectorBytes != 0) return false;
  }
  return t.extent(t.t.ndim - 1) * element_bytes % kVectorBytes == 0;
}

}  // namespace

void kv_prefetch_run(const GpuDevice& device, const PrefetchProblem& problem, ScratchCarver& carver) {
  PrefetchParams p;
  std::string why;
  p.k_src = static_cast<const char*>(device_address(device, problem.k_src, &why));
  if (p.k_src == nullptr) fail(SPARSA_STATUS_UNSUPPORTED, backend_name(), " backend: kv_prefetch k_src is ", why);
  p.v_src = static_cast<const char*>(device_address(device, problem.v_src, &why));
  if (p.v_src == nullptr) fail(SPARSA_STATUS_UNSUPPORTED, backend_name(), " backend: kv_prefetch v_src is ", why);
  const void* indices = device_address(device, problem.indices, &why);  // null: staged below

  // The kernels count in int32. Token ids are int32, so a longer cache only needs its first 2^31 tokens marked;
  // with k = 0 there is no entry whatever H_idx is. Any other extent past int32 is refused, not truncated.
  const int64_t slots = problem.indices.extent(2);
  const int64_t index_heads = slots == 0 ? 0 : problem.indices.extent(1);
  const int64_t rows = problem.k_dst.extent(0) * problem.k_dst.extent(1);  // fits: positions' elements are distinct
  const int64_t int32_extents[] = {problem.k_src.extent(0), problem.k_src.extent(2), problem.k_src.extent(3),
                                   index_heads, slots, rows};
  for (const int64_t extent : int32_extents) {
    if (extent > 0x7fffffff) {
      fail(SPARSA_STATUS_UNSUPPORTED, backend_name(), " backend: kv_prefetch needs B, Hkv, D, H_idx, k and B*C ",
           "below 2^31, got ", extent);
    }
  }
  p.batch = int32_t(problem.k_src.extent(0));
  p.n_tokens = std::min<int64_t>(problem.k_src.extent(1), int64_t{1} << 31);
  p.kv_heads = int32_t(problem.k_src.extent(2));
  p.head_dim = int32_t(problem.k_src.extent(3));
  p.capacity = int32_t(problem.k_dst.extent(1));
  p.index_heads = int32_t(index_heads);
  p.slots = int32_t(slots);
  p.element_bytes = int32_t(sparsa_dtype_size(problem.k_src.t.dtype));
  p.words = (p.n_tokens + kBitsPerWord - 1) / kBitsPerWord;
  for (int d = 0; d < 3; ++d) {
    p.src_strides[d] = problem.k_src.stride(d);
    p.v_src_strides[d] = problem.v_src.stride(d);
    p.dst_strides[d] = problem.k_dst.stride(d);
    p.v_dst_strides[d] = problem.v_dst.stride(d);
    p.index_strides[d] = problem.indices.stride(d);
    p.remapped_strides[d] = problem.remapped.stride(d);
  }
  p.k_dst = problem.k_dst.ptr<char>();
  p.v_dst = problem.v_dst.ptr<char>();
  p.positions = problem.positions.ptr<int32_t>();
  p.position_strides[0] = problem.positions.stride(0);
  p.position_strides[1] = problem.positions.stride(1);
  p.remapped = problem.remapped.ptr<int32_t>();
  if (problem.counts.present) {
    p.counts = problem.counts.ptr<int32_t>();
    p.counts_stride = problem.counts.stride(0);
  }
  p.vectors = aligned16(p.k_src, problem.k_src, p.element_bytes) && aligned16(p.v_src, problem.v_src, p.element_bytes) &&
              aligned16(p.k_dst, problem.k_dst, p.element_bytes) && aligned16(p.v_dst, problem.v_dst, p.element_bytes);

  const uint64_t bitmap_words = uint64_t(p.batch) * uint64_t(p.words);
  p.bitmap = carver.take<uint32_t>(bitmap_words);
  p.word_offsets = carver.take<int32_t>(bitmap_words);
  p.union_sizes = carver.take<int32_t>(uint64_t(p.batch));
  const int64_t index_span = span_elements(problem.indices);
  int32_t* staged = indices == nullptr ? carver.take<int32_t>(uint64_t(index_span)) : nullptr;
  if (carver.sizing() || p.batch == 0) return;

  if (indices == nullptr && index_span > 0) {
    check(cudaMemcpyAsync(staged, problem.indices.t.data, uint64_t(index_span) * sizeof(int32_t),
                          cudaMemcpyHostToDevice, device.stream),
          "cudaMemcpyAsync (kv_prefetch indices)");
    indices = staged;
  }
  p.indices = static_cast<const int32_t*>(indices);
  if (bitmap_words > 0) {
    check(cudaMemsetAsync(p.bitmap, 0, bitmap_words * sizeof(uint32_t), device.stream), "cudaMemsetAsync");
  }
  const int64_t entries = int64_t(p.batch) * p.index_heads * p.slots;
  const unsigned entry_blocks = unsigned(std::max<int64_t>(1, std::min<int64_t>((entries + kThreads - 1) / kThreads,
                                                                                kMaxGridBlocks)));
  mark_kernel<<<entry_blocks, kThreads, 0, device.stream>>>(p);
  check(cudaGetLastError(), "kv_prefetch mark_kernel launch");
  scan_kernel<<<unsigned(p.batch), kThreads, 0, device.stream>>>(p);
  check(cudaGetLastError(), "kv_prefetch scan_kernel launch");
  remap_kernel<<<entry_blocks, kThreads, 0, device.stream>>>(p);
  check(cudaGetLastError(), "kv_prefetch remap_kernel launch");
  if (rows == 0 || p.kv_heads == 0 || p.head_dim == 0) return;
  gather_kernel<<<unsigned(rows), kThreads, 0, device.stream>>>(p);
  check(cudaGetLastError(), "kv_prefetch gather_kernel launch");
}

SPARSA_GPU_NAMESPACE_END
