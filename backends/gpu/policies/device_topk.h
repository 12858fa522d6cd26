// Segmented top-k on the device, shared by TOKEN_SELECT (the head vote), TOKEN_SPARSE (each head's budget) and
// sparsa_topk_from_scores: for every segment, the k largest values — ties to the smaller index (§0) — written as
// their indices in ascending index order. A radix select over the values' order-preserving bit patterns, so the
// result is exact and deterministic; no host synchronisation (k and lengths may live on the device; the grids are
// sized for the worst case and segments with nothing to do exit early).
//
// How (device_topk_kernel.cuh): 11-bit digit passes from the most significant end (3 for F32, 6 for F64) narrow each
// segment's threshold key and how many of the elements equal to it are taken; the last block of a pass to finish a
// segment picks the digit. A segment is done early when the chosen digit's elements are all taken. Then a count
// pass and a stable compaction in index order keep every element above the threshold and the first `remaining`
// equal ones — ascending indices without a sort. All of it is one cooperative launch (every block resident, grid
// barriers between the passes); the digit passes stop once no segment is left undecided, and when every segment is
// skipped the blocks leave at once.
#pragma once

#include <cstddef>
#include <cstdint>

#include "../runtime/gpu_runtime.h"

SPARSA_GPU_NAMESPACE_BEGIN

enum class TopkValueType : int32_t { kF32 = 0, kF64 = 1 };

struct TopkArgs {
  // Input: segment s is values[s * row_stride + t] for t < length_s (element type value_type).
  const void* values = nullptr;
  TopkValueType value_type = TopkValueType::kF64;
  int64_t row_stride = 0;       // elements
  int32_t segments = 0;
  int64_t max_length = 0;       // length_s when `lengths` is null; an upper bound otherwise (sizes grids/scratch)
  const int32_t* lengths = nullptr;  // device [segments], or null (a length above max_length counts as max_length)

  // How many to keep: k_s = min(length_s, k_device ? k_device[s / segments_per_k] : k). A NaN value ranks below
  // every number (it is selected only when nothing else is left); -0 and +0 tie.
  int32_t k = 0;
  const int32_t* k_device = nullptr;
  int32_t segments_per_k = 1;

  // Segments whose skip flag is non-zero are left untouched (output and count): a selection-cache hit.
  const int32_t* skip = nullptr;  // device [segments / segments_per_skip], or null
  int32_t segments_per_skip = 1;

  // Output: out[s * out_stride + j], j < k_s, ascending indices; slots k_s..out_capacity-1 set to -1.
  int32_t* out = nullptr;
  int64_t out_stride = 0;
  int32_t out_capacity = 0;   // >= every k_s (writes past it are dropped)
  int32_t* counts = nullptr;  // device [segments] = k_s, or null

  // Optional output refinements (the defaults keep the layout above):
  // with out_segments_per_group > 0, segment s starts at (s / out_segments_per_group) * out_group_stride +
  // (s % out_segments_per_group) * out_stride (e.g. [B, H, k] with any strides, or a cache slot per sequence);
  // entry j is at j * out_element_stride from there; index_base is added to every index written (not to -1).
  int32_t out_segments_per_group = 0;
  int64_t out_group_stride = 0;
  int64_t out_element_stride = 1;
  int32_t index_base = 0;
};

// Scratch bytes device_topk needs for `segments` segments of at most `max_length` values.
size_t device_topk_scratch_bytes(int32_t segments, int64_t max_length);

// Enqueues the selection on `stream` (one cooperative launch sized for `multiprocessors` SMs; a device without
// cooperative launches returns the runtime's error). `scratch` holds device_topk_scratch_bytes(...) bytes, 256-byte
// aligned.
cudaError_t device_topk(const TopkArgs& args, void* scratch, int32_t multiprocessors, cudaStream_t stream);

SPARSA_GPU_NAMESPACE_END
