package sparsa

/*
#include "cwrappers.h"
*/
import "C"

import "runtime"

// CPSumDigits is the number of fixed-point digits of one partial normaliser in CPSelectSum's output
// (SPARSA_CP_SUM_DIGITS).
const CPSumDigits = int(C.SPARSA_CP_SUM_DIGITS)

// Context-parallel TOKEN_SELECT decode (docs/context_parallel.md): a sequence's keys are split by position over G
// shards, and four calls per shard, with the caller's collectives between them, make every shard's selection the
// single-context one. Each call takes the arguments of the shard's run (args.Q: every query row, the same on every
// shard; args.K, args.V: the shard's keys, any KV layout; args.Out may be nil and is not written) and a
// TOKEN_SELECT policy; a selection cache is refused. kvStart, kvTotal: int32 [B] in host memory, the shard's first
// global key position and each sequence's full key count. On error nothing is written. The CPU backend implements
// them; the GPU backends return ErrUnsupported (run the calls on a CPU context over host copies of q and k).

// CPSelectMax is step 1: outMax F64 [B, Hq] receives the largest selection score over the shard's candidates
// (-Inf where it has none). Combine across shards with an element-wise max.
func (c *Context) CPSelectMax(args *AttentionArgs, policy *Policy, kvStart, kvTotal, outMax *Tensor) error {
	return c.cpSelect(C.GS_CP_SELECT_MAX, args, policy, kvStart, kvTotal, nil, nil, outMax, nil)
}

// CPSelectSum is step 2: from globalMax F64 [B, Hq] (the max over shards), outSum I64 [B, Hq, CPSumDigits]
// receives the shard's normaliser as fixed-point digits. Combine across shards with an element-wise int64 sum.
func (c *Context) CPSelectSum(args *AttentionArgs, policy *Policy, kvStart, kvTotal, globalMax,
	outSum *Tensor) error {
	return c.cpSelect(C.GS_CP_SELECT_SUM, args, policy, kvStart, kvTotal, globalMax, nil, outSum, nil)
}

// CPSelectTopK is step 3: from globalMax and globalSum I64 [B, Hq, CPSumDigits] (the sum over shards), the
// shard's best candidates: outVotes F64 and outPositions int32 [B, nSets, topK] (global positions; -Inf and -1
// past the shard's candidates). nSets is 1, or Hkv with Policy.SelectPerKVHead. All-gather both to
// [G, B, nSets, topK] (any shard order).
func (c *Context) CPSelectTopK(args *AttentionArgs, policy *Policy, kvStart, kvTotal, globalMax, globalSum,
	outVotes, outPositions *Tensor) error {
	return c.cpSelect(C.GS_CP_SELECT_TOPK, args, policy, kvStart, kvTotal, globalMax, globalSum, outVotes,
		outPositions)
}

// CPSelectIndices is step 4: from every shard's gathered votes F64 and positions int32 [G, B, nSets, topK],
// outIndices int32 [B, nSets, cap] receives the shard's part of the index set as local key ids (ascending,
// -1-padded; cap must hold min(L_b, n_init + top_k + n_local) ids). A TOKEN_INDICES run with
// Policy.Indices = outIndices and an LSE output then gives the shard's partial state; merge the shards' states
// with MergeStates.
func (c *Context) CPSelectIndices(args *AttentionArgs, policy *Policy, kvStart, kvTotal, allVotes, allPositions,
	outIndices *Tensor) error {
	return c.cpSelect(C.GS_CP_SELECT_INDICES, args, policy, kvStart, kvTotal, allVotes, allPositions, outIndices,
		nil)
}

func (c *Context) cpSelect(step C.int32_t, args *AttentionArgs, policy *Policy, kvStart, kvTotal, inA, inB,
	outA, outB *Tensor) error {
	in, err := c.runInputs(args, policy) // a selection cache is handed on for the library to refuse
	if err != nil {
		return err
	}
	slots := &in.slots
	slots.set(C.GS_CP_KV_START, kvStart)
	slots.set(C.GS_CP_KV_TOTAL, kvTotal)
	slots.set(C.GS_CP_IN_A, inA)
	slots.set(C.GS_CP_IN_B, inB)
	slots.set(C.GS_CP_OUT_A, outA)
	slots.set(C.GS_CP_OUT_B, outB)
	d := &slots.goData
	result := C.gs_cp_select(step, in.ctx, &slots.c, cBool(args.Causal), C.float(args.SoftmaxScale), in.cache,
		in.policy, d[0], d[1], d[2], d[3], d[4], d[5], d[6], d[7], d[8], d[9], d[10], d[11], d[12], d[13], d[14],
		d[15], d[16], d[C.GS_CP_KV_START], d[C.GS_CP_KV_TOTAL], d[C.GS_CP_IN_A], d[C.GS_CP_IN_B], d[C.GS_CP_OUT_A],
		d[C.GS_CP_OUT_B])
	runtime.KeepAlive(c)
	runtime.KeepAlive(args)
	return check(result)
}
