// The device policies and utilities that live in their own files (one file per policy, STYLE.md), called by
// gpu_backend.cu. DENSE, SINK_WINDOW and BLOCK_SPARSE are a single forward launch and TOKEN_INDICES is
// token_indices.h; everything else is here.
//
// Contract of every *_run: enqueue on device.stream only (no host sync, no allocation); take scratch only from
// `carver`, in the same order on every call; when carver.sizing() (plan()), carve and return without launching.
// Stats (problem.stats) are zeroed by the backend before the run; a policy adds its own counts.
// Every *_supports: answers before anything is written; false with `reason` (prefixed "<backend> backend: ") when
// the case cannot run here — the API turns it into SPARSA_STATUS_UNSUPPORTED.
#pragma once

#include <functional>
#include <memory>
#include <string>

#include "gpu_launch.h"

SPARSA_GPU_NAMESPACE_BEGIN

// §4 SPARGE: device prediction (gpu_sparge.cu), then the block-mask forward walk with the PV skip, or the Sage
// quantized path; writes block_mask_out when present.
bool sparge_supports(const GpuDevice& device, const AttentionProblem& problem, const PolicyParams& policy,
                     std::string* reason);
void sparge_run(const GpuDevice& device, const AttentionProblem& problem, const PolicyParams& policy,
                ScratchCarver& carver);

// §5 TOKEN_SPARSE: scoring, budget, per-head selection and the gathered attention (gpu_token_sparse.cu).
bool token_sparse_supports(const GpuDevice& device, const AttentionProblem& problem, const PolicyParams& policy,
                           std::string* reason);
void token_sparse_run(const GpuDevice& device, const AttentionProblem& problem, const PolicyParams& policy,
                      ScratchCarver& carver);

// §6 TOKEN_SELECT: scoring, head soft vote, device top-k, selection cache, index attention (gpu_token_select.cu).
bool token_select_supports(const GpuDevice& device, const AttentionProblem& problem, const PolicyParams& policy,
                           std::string* reason);
void token_select_run(const GpuDevice& device, const AttentionProblem& problem, const PolicyParams& policy,
                      ScratchCarver& carver);
// The selection cache in device memory (sparsa_selection_cache_create on a GPU context).
std::unique_ptr<SelectionCacheState> create_device_selection_cache(const GpuDevice& device,
                                                                   const SelectionCacheDims& dims);

// Context-parallel TOKEN_SELECT, sparsa_cp_select_* (gpu_cp_select.cu): the four steps with the CPU backend's bits.
// Steps 3 and 4 read small arrays back to the host (a synchronisation on device.stream); see the file comment.
bool cp_select_supports(const GpuDevice& device, const CpSelectCall& call, std::string* reason);
void cp_select_run(const GpuDevice& device, const CpSelectCall& call, ScratchCarver& carver);

// §8 Δ around any base policy (gpu_delta.cu). `run_base(carver)` runs the base policy as if the flag were absent,
// writing problem.out (and carving its own scratch from the carver it is given).
using BaseRun = std::function<void(ScratchCarver&)>;
bool delta_supports(const GpuDevice& device, const AttentionProblem& problem, const PolicyParams& policy,
                    std::string* reason);
void delta_run(const GpuDevice& device, const AttentionProblem& problem, const PolicyParams& policy,
               ScratchCarver& carver, const BaseRun& run_base);

// §7 utilities on device tensors (gpu_topk.cu, kv_prefetch.cu). The utilities are not planned: scratch is carved
// from a carver over the backend's buffer, grown before the call when needed (`carver.sizing()` = measure only).
void topk_from_scores_run(const GpuDevice& device, const TensorArg& scores, int32_t k, int32_t block_size,
                          const TensorArg& out_indices, ScratchCarver& carver);
void kv_prefetch_run(const GpuDevice& device, const PrefetchProblem& problem, ScratchCarver& carver);

SPARSA_GPU_NAMESPACE_END
