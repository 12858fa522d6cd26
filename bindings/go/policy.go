package sparsa

/*
#include "cwrappers.h"
*/
import "C"

import "unsafe"

// PolicyKind says which keys each query row attends to (values of sparsa_policy_kind; §1–§7).
type PolicyKind int32

// Policy kinds.
const (
	PolicyDense        PolicyKind = C.SPARSA_POLICY_DENSE
	PolicySinkWindow   PolicyKind = C.SPARSA_POLICY_SINK_WINDOW
	PolicyBlockSparse  PolicyKind = C.SPARSA_POLICY_BLOCK_SPARSE
	PolicySparge       PolicyKind = C.SPARSA_POLICY_SPARGE
	PolicyTokenSparse  PolicyKind = C.SPARSA_POLICY_TOKEN_SPARSE
	PolicyTokenSelect  PolicyKind = C.SPARSA_POLICY_TOKEN_SELECT
	PolicyTokenIndices PolicyKind = C.SPARSA_POLICY_TOKEN_INDICES
)

// String returns the library's name for the kind ("SPARGE").
func (k PolicyKind) String() string { return C.GoString(C.sparsa_policy_kind_name(C.int32_t(k))) }

// PolicyFlag is a bit of Policy.Flags.
type PolicyFlag uint32

// FlagDelta adds the Δ-Attention correction (§8; prefill, causal only, no LSE output).
const FlagDelta PolicyFlag = C.SPARSA_POLICY_FLAG_DELTA

// Policy mirrors sparsa_policy field by field (see sparsa.h for each field's range). Make one with NewPolicy,
// which fills the library's defaults, then change what you need. Tensor fields are borrowed for each call.
type Policy struct {
	Kind  PolicyKind
	Flags PolicyFlag

	// SINK_WINDOW (§2).
	SinkTokens int32
	SinkWindow int32

	// BLOCK_SPARSE (§3) and SPARGE (§4).
	BlockQ    int32
	BlockK    int32
	BlockMask *Tensor // BLOCK_SPARSE: uint8 [B, Hq, ceil(Sq/BlockQ), ceil(Skv/BlockK)]

	// SPARGE (§4).
	SpargeTheta         float32
	SpargeTau           float32
	SpargeTopkFraction  float32
	SpargeLambda        float32 // -Inf = PV skip off
	SpargeAttentionSink bool
	SpargeQuantized     bool
	SpargeHeadParams    *Tensor // optional f32 [Hq, 4]: (theta, tau, topk_fraction, lambda); NaN = scalar field

	// TOKEN_SPARSE (§5).
	TokenSparseWindow     int32
	TokenSparsePoolKernel int32
	TokenSparseCoverage   float32
	TokenSparseMinTokens  int32

	// TOKEN_SELECT (§6).
	SelectNInit       int32
	SelectNLocal      int32
	SelectTopK        int32
	SelectScaleScores bool
	SelectCacheTheta  float32
	SelectPerKVHead   bool

	// TOKEN_INDICES (§7).
	Indices        *Tensor // int32 [B, H_idx, k]; -1 = unused slot
	HeadMap        *Tensor // optional int32 [Hq]
	IndexBlockSize int32
	IndexNInit     int32
	IndexNLocal    int32

	// DELTA (§8), read when Flags has FlagDelta.
	DeltaGamma   int32
	DeltaTailMin int32
}

// NewPolicy returns a policy of the given kind with every default of sparsa_policy_init. An unknown kind fails
// with ErrInvalidArgument.
func NewPolicy(kind PolicyKind) (Policy, error) {
	var c C.sparsa_policy
	if err := check(C.gs_policy_init(&c, C.int32_t(kind))); err != nil {
		return Policy{}, err
	}
	return Policy{
		Kind:                  PolicyKind(c.kind),
		Flags:                 PolicyFlag(c.flags),
		SinkTokens:            int32(c.sink_tokens),
		SinkWindow:            int32(c.sink_window),
		BlockQ:                int32(c.block_q),
		BlockK:                int32(c.block_k),
		SpargeTheta:           float32(c.sparge_theta),
		SpargeTau:             float32(c.sparge_tau),
		SpargeTopkFraction:    float32(c.sparge_topk_fraction),
		SpargeLambda:          float32(c.sparge_lambda),
		SpargeAttentionSink:   c.sparge_attention_sink != 0,
		SpargeQuantized:       c.sparge_quantized != 0,
		TokenSparseWindow:     int32(c.token_sparse_window),
		TokenSparsePoolKernel: int32(c.token_sparse_pool_kernel),
		TokenSparseCoverage:   float32(c.token_sparse_coverage),
		TokenSparseMinTokens:  int32(c.token_sparse_min_tokens),
		SelectNInit:           int32(c.select_n_init),
		SelectNLocal:          int32(c.select_n_local),
		SelectTopK:            int32(c.select_top_k),
		SelectScaleScores:     c.select_scale_scores != 0,
		SelectCacheTheta:      float32(c.select_cache_theta),
		SelectPerKVHead:       c.select_per_kv_head != 0,
		IndexBlockSize:        int32(c.index_block_size),
		IndexNInit:            int32(c.index_n_init),
		IndexNLocal:           int32(c.index_n_local),
		DeltaGamma:            int32(c.delta_gamma),
		DeltaTailMin:          int32(c.delta_tail_min),
	}, nil
}

// cPointer is toC for an optional policy: nil gives NULL (the called function picks its default policy).
func (p *Policy) cPointer(slots *tensorSlots) *C.sparsa_policy {
	if p == nil {
		return nil
	}
	c := p.toC(slots)
	return &c
}

// toC fills a C policy (tensor fields left NULL: the wrapper sets them from the slots) and puts the policy's
// tensors in their slots. The kind is copied as is, so an unknown kind is reported by the call that uses it.
func (p *Policy) toC(slots *tensorSlots) C.sparsa_policy {
	var c C.sparsa_policy
	// struct_size; every field is overwritten below
	C.sparsa_policy_init(&c, C.size_t(unsafe.Sizeof(c)), C.SPARSA_POLICY_DENSE)
	c.kind = C.int32_t(p.Kind)
	c.flags = C.uint32_t(p.Flags)
	c.sink_tokens = C.int32_t(p.SinkTokens)
	c.sink_window = C.int32_t(p.SinkWindow)
	c.block_q = C.int32_t(p.BlockQ)
	c.block_k = C.int32_t(p.BlockK)
	c.sparge_theta = C.float(p.SpargeTheta)
	c.sparge_tau = C.float(p.SpargeTau)
	c.sparge_topk_fraction = C.float(p.SpargeTopkFraction)
	c.sparge_lambda = C.float(p.SpargeLambda)
	c.sparge_attention_sink = cBool(p.SpargeAttentionSink)
	c.sparge_quantized = cBool(p.SpargeQuantized)
	c.token_sparse_window = C.int32_t(p.TokenSparseWindow)
	c.token_sparse_pool_kernel = C.int32_t(p.TokenSparsePoolKernel)
	c.token_sparse_coverage = C.float(p.TokenSparseCoverage)
	c.token_sparse_min_tokens = C.int32_t(p.TokenSparseMinTokens)
	c.select_n_init = C.int32_t(p.SelectNInit)
	c.select_n_local = C.int32_t(p.SelectNLocal)
	c.select_top_k = C.int32_t(p.SelectTopK)
	c.select_scale_scores = cBool(p.SelectScaleScores)
	c.select_cache_theta = C.float(p.SelectCacheTheta)
	c.select_per_kv_head = cBool(p.SelectPerKVHead)
	c.index_block_size = C.int32_t(p.IndexBlockSize)
	c.index_n_init = C.int32_t(p.IndexNInit)
	c.index_n_local = C.int32_t(p.IndexNLocal)
	c.delta_gamma = C.int32_t(p.DeltaGamma)
	c.delta_tail_min = C.int32_t(p.DeltaTailMin)
	slots.set(C.GS_POLICY_BLOCK_MASK, p.BlockMask)
	slots.set(C.GS_POLICY_SPARGE_HEAD_PARAMS, p.SpargeHeadParams)
	slots.set(C.GS_POLICY_INDICES, p.Indices)
	slots.set(C.GS_POLICY_HEAD_MAP, p.HeadMap)
	return c
}
