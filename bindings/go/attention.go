package sparsa

/*
#include "cwrappers.h"
*/
import "C"

import (
	"runtime"
	"unsafe"
)

// Stat indices into the optional AttentionArgs.Stats output (values of sparsa_stat_index).
const (
	StatPairsComputed   = int(C.SPARSA_STAT_PAIRS_COMPUTED)
	StatPairsDense      = int(C.SPARSA_STAT_PAIRS_DENSE)
	StatBlocksComputed  = int(C.SPARSA_STAT_BLOCKS_COMPUTED)
	StatBlocksTotal     = int(C.SPARSA_STAT_BLOCKS_TOTAL)
	StatPVBlocksSkipped = int(C.SPARSA_STAT_PV_BLOCKS_SKIPPED)
	StatCacheHits       = int(C.SPARSA_STAT_CACHE_HITS)
	StatCacheMisses     = int(C.SPARSA_STAT_CACHE_MISSES)
	StatCount           = int(C.SPARSA_STAT_COUNT)
)

// AttentionArgs mirrors sparsa_attention_args; nil tensors are absent. Shapes (§0): Q [B, Sq, Hq, D]; K, V
// [B, Skv, Hkv, D]; Out like Q. See sparsa.h for the varlen, paged and introspection tensors.
type AttentionArgs struct {
	Q, K, V *Tensor // inputs (required)
	Out     *Tensor // output (required), Q's shape and dtype
	LSE     *Tensor // optional f32 [B, Hq, Sq] natural-log LSE output

	Causal       bool    // bottom-right causal mask
	SoftmaxScale float32 // 0 = 1/sqrt(D)

	CuSeqlensQ *Tensor // optional int32 [B+1]: packed q/out
	CuSeqlensK *Tensor // optional int32 [B+1]: packed k/v
	PageTable  *Tensor // optional int32 [B, max_pages]: paged k/v caches
	SeqLensK   *Tensor // optional int32 [B]

	SelectionCache *SelectionCache // TOKEN_SELECT's cache; nil = none

	SelectedIndices *Tensor // optional int32 [B, H_sel, cap] output
	BlockMaskOut    *Tensor // optional uint8 SPARGE mask output
	Stats           *Tensor // optional int64 [n] counters output (StatPairsComputed, ...)

	// QueryOffsets: optional int32 [B], §0's offset o per sequence (row i aligned with key i + o); nil =
	// bottom-right. DENSE, SINK_WINDOW, BLOCK_SPARSE, SPARGE and TOKEN_INDICES without Δ.
	QueryOffsets *Tensor
}

// fill puts the arguments' tensors in their slots.
func (a *AttentionArgs) fill(slots *tensorSlots) {
	slots.set(C.GS_Q, a.Q)
	slots.set(C.GS_K, a.K)
	slots.set(C.GS_V, a.V)
	slots.set(C.GS_OUT, a.Out)
	slots.set(C.GS_LSE, a.LSE)
	slots.set(C.GS_CU_SEQLENS_Q, a.CuSeqlensQ)
	slots.set(C.GS_CU_SEQLENS_K, a.CuSeqlensK)
	slots.set(C.GS_PAGE_TABLE, a.PageTable)
	slots.set(C.GS_SEQ_LENS_K, a.SeqLensK)
	slots.set(C.GS_SELECTED_INDICES, a.SelectedIndices)
	slots.set(C.GS_BLOCK_MASK_OUT, a.BlockMaskOut)
	slots.set(C.GS_STATS, a.Stats)
	slots.set(C.GS_QUERY_OFFSETS, a.QueryOffsets)
}

// Attention computes args.Out (and the optional outputs) under policy (nil = DENSE defaults). Every argument is
// validated first; on error nothing is written.
func (c *Context) Attention(args *AttentionArgs, policy *Policy) error {
	return c.attention(false, args, policy)
}

// Plan validates like Attention and grows the context's scratch memory for this problem, computing nothing; later
// runs of the same shapes allocate nothing.
func (c *Context) Plan(args *AttentionArgs, policy *Policy) error {
	return c.attention(true, args, policy)
}

// runInputs is what an attention run and a context-parallel step hand to C: the context, the selection cache (nil
// when absent; a present one is handed on, so the library says what it accepts), and args' tensors and the
// policy's in their slots.
type runInputs struct {
	ctx    *C.sparsa_context
	cache  *C.sparsa_selection_cache
	slots  tensorSlots
	policy *C.sparsa_policy
}

func (c *Context) runInputs(args *AttentionArgs, policy *Policy) (*runInputs, error) {
	ctx, err := c.handle()
	if err != nil {
		return nil, err
	}
	if args == nil {
		return nil, errorf(StatusNullPointer, "args: expected attention arguments, got nil")
	}
	in := &runInputs{ctx: ctx}
	if args.SelectionCache != nil {
		if in.cache, err = args.SelectionCache.handle(); err != nil {
			return nil, err
		}
	}
	args.fill(&in.slots)
	in.policy = policy.cPointer(&in.slots)
	return in, nil
}

func (c *Context) attention(plan bool, args *AttentionArgs, policy *Policy) error {
	in, err := c.runInputs(args, policy)
	if err != nil {
		return err
	}
	d := &in.slots.goData
	result := C.gs_attention(cBool(plan), in.ctx, &in.slots.c, cBool(args.Causal), C.float(args.SoftmaxScale),
		in.cache, in.policy, d[0], d[1], d[2], d[3], d[4], d[5], d[6], d[7], d[8], d[9], d[10], d[11], d[12], d[13],
		d[14], d[15], d[16])
	runtime.KeepAlive(c)
	runtime.KeepAlive(args)
	return check(result)
}

// SpargeTuneOptions mirror sparsa_sparge_tune_options (targets of the SpargeAttn tuner, §4).
type SpargeTuneOptions struct {
	L1          float32 // relative-L1 target of the (theta, tau) search
	PVL1        float32 // relative-L1 target of the lambda search; >= L1
	SearchSteps int32   // bisection steps for tau and for lambda
	DenseBelow  float32 // a head whose best sparsity is <= this goes dense
	LambdaMin   float32 // most negative lambda tried; < 0
}

// DefaultSpargeTuneOptions returns the library's defaults.
func DefaultSpargeTuneOptions() SpargeTuneOptions {
	var c C.sparsa_sparge_tune_options
	C.sparsa_sparge_tune_options_init(&c, C.size_t(unsafe.Sizeof(c)))
	return SpargeTuneOptions{L1: float32(c.l1), PVL1: float32(c.pv_l1), SearchSteps: int32(c.search_steps),
		DenseBelow: float32(c.dense_below), LambdaMin: float32(c.lambda_min)}
}

// SpargeTune tunes SPARGE per query head on one calibration call (args as for Attention; Out, LSE and the
// introspection outputs are not read). outParams: f32 [Hq, 4] ready for Policy.SpargeHeadParams; outMetrics
// (optional): f32 [Hq, 2]. policy nil = SPARGE defaults; options nil = DefaultSpargeTuneOptions().
func (c *Context) SpargeTune(args *AttentionArgs, policy *Policy, options *SpargeTuneOptions, outParams,
	outMetrics *Tensor) error {
	ctx, err := c.handle()
	if err != nil {
		return err
	}
	if args == nil {
		return errorf(StatusNullPointer, "args: expected attention arguments, got nil")
	}
	var slots tensorSlots
	args.fill(&slots)
	policyPtr := policy.cPointer(&slots)
	var cOptions C.sparsa_sparge_tune_options
	if err := check(C.gs_sparge_tune_options_init(&cOptions)); err != nil {
		return err
	}
	if options != nil {
		cOptions.l1 = C.float(options.L1)
		cOptions.pv_l1 = C.float(options.PVL1)
		cOptions.search_steps = C.int32_t(options.SearchSteps)
		cOptions.dense_below = C.float(options.DenseBelow)
		cOptions.lambda_min = C.float(options.LambdaMin)
	}
	slots.set(C.GS_TUNE_PARAMS, outParams)
	slots.set(C.GS_TUNE_METRICS, outMetrics)
	d := &slots.goData
	result := C.gs_sparge_tune(ctx, &slots.c, cBool(args.Causal), C.float(args.SoftmaxScale), policyPtr, &cOptions,
		d[0], d[1], d[2], d[3], d[4], d[5], d[6], d[7], d[8], d[9], d[10], d[11], d[12], d[13], d[14], d[15], d[16],
		d[17], d[18])
	runtime.KeepAlive(c)
	runtime.KeepAlive(args)
	runtime.KeepAlive(outParams)
	runtime.KeepAlive(outMetrics)
	return check(result)
}
