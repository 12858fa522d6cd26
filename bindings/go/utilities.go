package sparsa

/*
#include "cwrappers.h"
*/
import "C"

import (
	"math"
	"runtime"
)

// MergeStates merges two partial attention states over disjoint key sets (§0). oA, oB, out: [B, S, H, D] (or
// packed [T, H, D]) of F32/F16/BF16; lseA, lseB, outLSE: F32 [B, H, S] (packed [H, T]). out/outLSE may be oA/lseA
// (in place); outLSE may be nil.
func (c *Context) MergeStates(oA, lseA, oB, lseB, out, outLSE *Tensor) error {
	ctx, err := c.handle()
	if err != nil {
		return err
	}
	var slots tensorSlots
	for i, t := range []*Tensor{oA, lseA, oB, lseB, out, outLSE} {
		slots.set(i, t)
	}
	d := &slots.goData
	result := C.gs_merge_states(ctx, &slots.c, d[0], d[1], d[2], d[3], d[4], d[5])
	runtime.KeepAlive(c)
	return check(result)
}

// TopKFromScores picks the k largest draft scores per (batch, head) (§7): scores F32 [B, H, N]; blockSize 1 =
// token ids, > 1 = ids of blocks of blockSize tokens (scores summed per block). outIndices: int32 [B, H, k], each
// row ascending; ties go to the smaller id.
func (c *Context) TopKFromScores(scores *Tensor, k, blockSize int32, outIndices *Tensor) error {
	ctx, err := c.handle()
	if err != nil {
		return err
	}
	var slots tensorSlots
	slots.set(0, scores)
	slots.set(1, outIndices)
	d := &slots.goData
	result := C.gs_topk_from_scores(ctx, &slots.c, C.int32_t(k), C.int32_t(blockSize), d[0], d[1])
	runtime.KeepAlive(c)
	return check(result)
}

// HeadMapping is STS's head mapping (§7), host memory: draft F32 [T, Hd, N] and target F32 [T, Ht, N] attention
// traces; outMap int32 [Ht] receives, per target head, the draft head whose top-k overlaps it most.
func HeadMapping(draft, target *Tensor, k int32, outMap *Tensor) error {
	var slots tensorSlots
	slots.set(0, draft)
	slots.set(1, target)
	slots.set(2, outMap)
	d := &slots.goData
	return check(C.gs_head_mapping(&slots.c, C.int32_t(k), d[0], d[1], d[2]))
}

// KVPrefetch gathers the K/V rows that indices select from host memory into compact buffers on the context's
// device (§7). kSrc, vSrc [B, N, Hkv, D]; indices int32 [B, H_idx, k]; kDst, vDst [B, C, Hkv, D] (rows past each
// union are left untouched); positions int32 [B, C]; remapped int32 [B, H_idx, k]; counts (optional) int32 [B].
func (c *Context) KVPrefetch(kSrc, vSrc, indices, kDst, vDst, positions, remapped, counts *Tensor) error {
	ctx, err := c.handle()
	if err != nil {
		return err
	}
	var slots tensorSlots
	for i, t := range []*Tensor{kSrc, vSrc, indices, kDst, vDst, positions, remapped, counts} {
		slots.set(i, t)
	}
	d := &slots.goData
	result := C.gs_kv_prefetch(ctx, &slots.c, d[0], d[1], d[2], d[3], d[4], d[5], d[6], d[7])
	runtime.KeepAlive(c)
	return check(result)
}

// HilbertPermutation returns SpargeAttn's 3-D Hilbert order of a t×h×w token grid (§4): perm[i] is the token id
// visited i-th, inverse[perm[i]] = i.
func HilbertPermutation(t, h, w int32) (perm, inverse []int32, err error) {
	count, ok := hilbertCount(t, h, w)
	if !ok {
		return nil, nil, hilbertRejected(t, h, w)
	}
	perm = make([]int32, count)
	inverse = make([]int32, count)
	if err := HilbertPermutationInto(t, h, w, perm, inverse); err != nil {
		return nil, nil, err
	}
	return perm, inverse, nil
}

// HilbertPermutationInto writes the permutation into caller slices of exactly t*h*w entries; either may be nil.
func HilbertPermutationInto(t, h, w int32, perm, inverse []int32) error {
	count, ok := hilbertCount(t, h, w)
	if !ok {
		return hilbertRejected(t, h, w)
	}
	for _, out := range []struct {
		name  string
		slice []int32
	}{{"perm", perm}, {"inverse", inverse}} {
		if out.slice != nil && int64(len(out.slice)) != count {
			return errorf(StatusShapeMismatch, "%s: expected t*h*w = %d entries, the slice holds %d",
				out.name, count, len(out.slice))
		}
	}
	return check(C.gs_hilbert_permutation(C.int32_t(t), C.int32_t(h), C.int32_t(w),
		(*C.int32_t)(sliceData(perm)), (*C.int32_t)(sliceData(inverse)), C.int64_t(count)))
}

// hilbertCount returns t*h*w and whether the grid is one Go can size (no negative extent, fits in int32).
func hilbertCount(t, h, w int32) (int64, bool) {
	count := int64(t) * int64(h) * int64(w)
	return count, t >= 0 && h >= 0 && w >= 0 && count <= math.MaxInt32
}

// hilbertRejected reports a grid Go cannot size: the library names the bad extent (it validates before writing,
// and is given no output to write).
func hilbertRejected(t, h, w int32) error {
	if err := check(C.gs_hilbert_permutation(C.int32_t(t), C.int32_t(h), C.int32_t(w), nil, nil, 0)); err != nil {
		return err
	}
	return errorf(StatusInvalidArgument, "t, h, w: a %d x %d x %d grid does not fit in int32 token ids", t, h, w)
}

// DriftSelectLayers is the drift-based layer selection (§5): hIn, hOut [L, T, D] (F32/F16/BF16, host memory);
// outRatio F32 [L] and outSparse uint8 [L] are optional outputs. delta in [0, 1]. A NaN ratio (from a NaN or
// infinite input) makes the quantile NaN, as numpy's: no layer is then sparse.
func DriftSelectLayers(hIn, hOut *Tensor, delta float32, outRatio, outSparse *Tensor) error {
	var slots tensorSlots
	for i, t := range []*Tensor{hIn, hOut, outRatio, outSparse} {
		slots.set(i, t)
	}
	d := &slots.goData
	return check(C.gs_drift_select_layers(&slots.c, C.float(delta), d[0], d[1], d[2], d[3]))
}
