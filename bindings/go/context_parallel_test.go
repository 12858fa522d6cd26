package sparsa

import (
	"math"
	"sort"
	"testing"
)

// Context-parallel TOKEN_SELECT decode (docs/context_parallel.md) on two simulated shards of one sequence: the
// shards' index sets together equal the single-context selection, and the merged state its output. The same
// problem as bindings/rust/sparsa/tests/context_parallel.rs.
const (
	cpKeys    = 200 // N
	cpQHeads  = 4
	cpKVHeads = 2
	cpDim     = 8
	cpTopK    = 20
	cpShards  = 2
)

// cpCuts splits the keys into the shards [0, 77) and [77, 200).
var cpCuts = [cpShards + 1]int{0, 77, cpKeys}

// cpValues are deterministic inputs in [-1, 1).
func cpValues(n int, seed uint32) []float32 {
	values := make([]float32, n)
	for i := range values {
		values[i] = float32((uint32(i)*2654435761+seed)>>16%200)/100 - 1
	}
	return values
}

func cpPolicy(t *testing.T) *Policy {
	t.Helper()
	policy, err := NewPolicy(PolicyTokenSelect)
	if err != nil {
		t.Fatal(err)
	}
	policy.SelectNInit, policy.SelectNLocal, policy.SelectTopK, policy.SelectCacheTheta = 4, 8, cpTopK, 1
	return &policy
}

// cpShard is one shard's keys and the arguments of its calls (Out is a scratch buffer the selection calls do not
// write; the shard's TOKEN_INDICES run writes it).
type cpShard struct {
	args     AttentionArgs
	keys     int64
	kvStart  *Tensor
	out, lse []float32
}

func newCPShards(q, k, v []float32) []*cpShard {
	rowSize := cpKVHeads * cpDim
	shards := make([]*cpShard, cpShards)
	for g := range shards {
		keys := int64(cpCuts[g+1] - cpCuts[g])
		shape := []int64{1, keys, cpKVHeads, cpDim}
		shard := &cpShard{keys: keys, out: make([]float32, cpQHeads*cpDim), lse: make([]float32, cpQHeads)}
		shard.args = AttentionArgs{
			Q:   mustTensor(Float32(q, 1, 1, cpQHeads, cpDim)),
			K:   mustTensor(Float32(k[cpCuts[g]*rowSize:cpCuts[g+1]*rowSize], shape...)),
			V:   mustTensor(Float32(v[cpCuts[g]*rowSize:cpCuts[g+1]*rowSize], shape...)),
			Out: mustTensor(Float32(shard.out, 1, 1, cpQHeads, cpDim)),
			LSE: mustTensor(Float32(shard.lse, 1, cpQHeads, 1)),
		}
		shard.kvStart = mustTensor(Int32([]int32{int32(cpCuts[g])}, 1))
		shards[g] = shard
	}
	return shards
}

func TestContextParallelTwoShardsSelectWhatOneContextSelects(t *testing.T) {
	ctx := newTestContext(t)
	q := cpValues(cpQHeads*cpDim, 1)
	k := cpValues(cpKeys*cpKVHeads*cpDim, 2)
	v := cpValues(cpKeys*cpKVHeads*cpDim, 3)
	policy := cpPolicy(t)

	// One context over the whole cache.
	wantOut, wantLSE := make([]float32, cpQHeads*cpDim), make([]float32, cpQHeads)
	selected := make([]int32, cpKeys)
	for i := range selected {
		selected[i] = -7
	}
	kvShape := []int64{1, cpKeys, cpKVHeads, cpDim}
	single := AttentionArgs{
		Q:               mustTensor(Float32(q, 1, 1, cpQHeads, cpDim)),
		K:               mustTensor(Float32(k, kvShape...)),
		V:               mustTensor(Float32(v, kvShape...)),
		Out:             mustTensor(Float32(wantOut, 1, 1, cpQHeads, cpDim)),
		LSE:             mustTensor(Float32(wantLSE, 1, cpQHeads, 1)),
		SelectedIndices: mustTensor(Int32(selected, 1, 1, cpKeys)),
	}
	if err := ctx.Attention(&single, policy); err != nil {
		t.Fatal(err)
	}
	var wantSet []int32
	for _, id := range selected {
		if id >= 0 {
			wantSet = append(wantSet, id)
		}
	}

	// The four steps on every shard, the collectives done by hand in between.
	shards := newCPShards(q, k, v)
	kvTotal := mustTensor(Int32([]int32{cpKeys}, 1))
	globalMax := make([]float64, cpQHeads)
	for i := range globalMax {
		globalMax[i] = math.Inf(-1)
	}
	for _, shard := range shards { // step 1, all-reduce max
		localMax := make([]float64, cpQHeads)
		if err := ctx.CPSelectMax(&shard.args, policy, shard.kvStart, kvTotal,
			mustTensor(Float64(localMax, 1, cpQHeads))); err != nil {
			t.Fatal(err)
		}
		for h, m := range localMax {
			globalMax[h] = math.Max(globalMax[h], m)
		}
	}
	globalMaxT := mustTensor(Float64(globalMax, 1, cpQHeads))
	globalSum := make([]int64, cpQHeads*CPSumDigits)
	for _, shard := range shards { // step 2, all-reduce sum
		localSum := make([]int64, len(globalSum))
		if err := ctx.CPSelectSum(&shard.args, policy, shard.kvStart, kvTotal, globalMaxT,
			mustTensor(Int64(localSum, 1, cpQHeads, int64(CPSumDigits)))); err != nil {
			t.Fatal(err)
		}
		for i, s := range localSum {
			globalSum[i] += s
		}
	}
	globalSumT := mustTensor(Int64(globalSum, 1, cpQHeads, int64(CPSumDigits)))
	allVotes := make([]float64, cpShards*cpTopK)
	allPositions := make([]int32, cpShards*cpTopK)
	for g, shard := range shards { // step 3, all-gather: each shard writes its slot of the gathered lists
		slot := allVotes[g*cpTopK : (g+1)*cpTopK]
		positions := allPositions[g*cpTopK : (g+1)*cpTopK]
		if err := ctx.CPSelectTopK(&shard.args, policy, shard.kvStart, kvTotal, globalMaxT, globalSumT,
			mustTensor(Float64(slot, 1, 1, cpTopK)), mustTensor(Int32(positions, 1, 1, cpTopK))); err != nil {
			t.Fatal(err)
		}
	}
	allVotesT := mustTensor(Float64(allVotes, cpShards, 1, 1, cpTopK))
	allPositionsT := mustTensor(Int32(allPositions, cpShards, 1, 1, cpTopK))
	var gotSet []int32
	for g, shard := range shards { // step 4, then the shard's TOKEN_INDICES run with LSE
		ids := make([]int32, shard.keys)
		for i := range ids {
			ids[i] = -7
		}
		idsT := mustTensor(Int32(ids, 1, 1, shard.keys))
		if err := ctx.CPSelectIndices(&shard.args, policy, shard.kvStart, kvTotal, allVotesT, allPositionsT,
			idsT); err != nil {
			t.Fatal(err)
		}
		for _, id := range ids {
			if id >= 0 {
				gotSet = append(gotSet, id+int32(cpCuts[g]))
			}
		}
		indices, err := NewPolicy(PolicyTokenIndices)
		if err != nil {
			t.Fatal(err)
		}
		indices.Indices = idsT
		if err := ctx.Attention(&shard.args, &indices); err != nil {
			t.Fatal(err)
		}
	}
	sort.Slice(gotSet, func(i, j int) bool { return gotSet[i] < gotSet[j] })
	if len(gotSet) != len(wantSet) {
		t.Fatalf("the shards selected %d keys %v, one context %d %v", len(gotSet), gotSet, len(wantSet), wantSet)
	}
	for i := range wantSet {
		if gotSet[i] != wantSet[i] {
			t.Fatalf("the shards selected %v, one context %v", gotSet, wantSet)
		}
	}

	out, lse := make([]float32, cpQHeads*cpDim), make([]float32, cpQHeads)
	if err := ctx.MergeStates(shards[0].args.Out, shards[0].args.LSE, shards[1].args.Out, shards[1].args.LSE,
		mustTensor(Float32(out, 1, 1, cpQHeads, cpDim)), mustTensor(Float32(lse, 1, cpQHeads, 1))); err != nil {
		t.Fatal(err)
	}
	const tolerance = 1e-5 // relative: the merge reorders the fp32 softmax sums
	scale := 0.0
	for _, x := range wantOut {
		scale = math.Max(scale, math.Abs(float64(x)))
	}
	for i := range out {
		if diff := math.Abs(float64(out[i] - wantOut[i])); diff > tolerance*scale {
			t.Errorf("out[%d] = %g, one context %g (scale %g)", i, out[i], wantOut[i], scale)
		}
	}
	for h := range lse {
		if diff := math.Abs(float64(lse[h] - wantLSE[h])); diff > tolerance*math.Max(math.Abs(float64(wantLSE[h])), 1) {
			t.Errorf("lse[%d] = %g, one context %g", h, lse[h], wantLSE[h])
		}
	}
}

// Each tensor reaches the C argument of its name: a wrong dtype in one of them is reported under that name, and the
// failed call writes nothing.
func TestContextParallelArgumentsReachTheirParameters(t *testing.T) {
	ctx := newTestContext(t)
	q := cpValues(cpQHeads*cpDim, 1)
	k := cpValues(cpKeys*cpKVHeads*cpDim, 2)
	shard := newCPShards(q, k, k)[1]
	policy := cpPolicy(t)
	kvTotal := mustTensor(Int32([]int32{cpKeys}, 1))
	wrong := mustTensor(Float32(make([]float32, 1), 1)) // F32 where every parameter wants another dtype
	poisoned := make([]float64, cpShards*cpTopK)
	for i := range poisoned {
		poisoned[i] = -7
	}
	out := mustTensor(Float64(poisoned[:cpTopK], 1, 1, cpTopK))
	maxT := mustTensor(Float64(make([]float64, cpQHeads), 1, cpQHeads))
	sumT := mustTensor(Int64(make([]int64, cpQHeads*CPSumDigits), 1, cpQHeads, int64(CPSumDigits)))
	positions := mustTensor(Int32(make([]int32, cpTopK), 1, 1, cpTopK))
	gathered := mustTensor(Float64(make([]float64, cpShards*cpTopK), cpShards, 1, 1, cpTopK))
	gatheredPositions := mustTensor(Int32(make([]int32, cpShards*cpTopK), cpShards, 1, 1, cpTopK))
	cases := []struct {
		name string
		call func() error
	}{
		{"kv_start", func() error { return ctx.CPSelectMax(&shard.args, policy, wrong, kvTotal, maxT) }},
		{"kv_total", func() error { return ctx.CPSelectMax(&shard.args, policy, shard.kvStart, wrong, maxT) }},
		{"out_max", func() error { return ctx.CPSelectMax(&shard.args, policy, shard.kvStart, kvTotal, wrong) }},
		{"global_max", func() error {
			return ctx.CPSelectSum(&shard.args, policy, shard.kvStart, kvTotal, wrong, sumT)
		}},
		{"out_sum", func() error {
			return ctx.CPSelectSum(&shard.args, policy, shard.kvStart, kvTotal, maxT, wrong)
		}},
		{"global_sum", func() error {
			return ctx.CPSelectTopK(&shard.args, policy, shard.kvStart, kvTotal, maxT, wrong, out, positions)
		}},
		{"out_votes", func() error {
			return ctx.CPSelectTopK(&shard.args, policy, shard.kvStart, kvTotal, maxT, sumT, wrong, positions)
		}},
		{"out_positions", func() error {
			return ctx.CPSelectTopK(&shard.args, policy, shard.kvStart, kvTotal, maxT, sumT, out, wrong)
		}},
		{"all_votes", func() error {
			return ctx.CPSelectIndices(&shard.args, policy, shard.kvStart, kvTotal, wrong, gatheredPositions,
				positions)
		}},
		{"all_positions", func() error {
			return ctx.CPSelectIndices(&shard.args, policy, shard.kvStart, kvTotal, gathered, wrong, positions)
		}},
		{"out_indices", func() error {
			return ctx.CPSelectIndices(&shard.args, policy, shard.kvStart, kvTotal, gathered, gatheredPositions,
				wrong)
		}},
	}
	for _, c := range cases {
		mustStatus(t, c.call(), ErrDTypeMismatch, c.name)
	}
	for i, x := range poisoned {
		if x != -7 {
			t.Fatalf("element %d written by a failed call", i)
		}
	}

	// The protocol's own refusals: another policy, and a selection cache (each shard would keep a different part).
	dense, err := NewPolicy(PolicyDense)
	if err != nil {
		t.Fatal(err)
	}
	mustStatus(t, ctx.CPSelectTopK(&shard.args, &dense, shard.kvStart, kvTotal, maxT, sumT, out, positions),
		ErrInvalidArgument)
	cache, err := ctx.NewSelectionCache(1, cpQHeads, cpKVHeads, cpDim, cpTopK)
	if err != nil {
		t.Fatal(err)
	}
	defer cache.Close()
	cached := shard.args
	cached.SelectionCache = cache
	mustStatus(t, ctx.CPSelectTopK(&cached, policy, shard.kvStart, kvTotal, maxT, sumT, out, positions),
		ErrInvalidArgument, "selection_cache")
	for i, x := range poisoned {
		if x != -7 {
			t.Fatalf("element %d written by a refused call", i)
		}
	}
}
