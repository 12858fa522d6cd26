package sparsa

import (
	"errors"
	"fmt"
	"math"
	"runtime"
	"strings"
	"sync"
	"testing"
	"unsafe"
)

func newTestContext(t *testing.T) *Context {
	t.Helper()
	ctx, err := NewContext(nil)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(ctx.Close)
	return ctx
}

// mustStatus checks that err is a *Error of the given class with a non-empty message containing every word.
func mustStatus(t *testing.T, err error, want *Error, words ...string) *Error {
	t.Helper()
	var sparsaErr *Error
	if !errors.As(err, &sparsaErr) {
		t.Fatalf("expected a *sparsa.Error of %s, got %v", want.Status, err)
	}
	if !errors.Is(err, want) {
		t.Fatalf("expected %s, got %v", want.Status, err)
	}
	if sparsaErr.Message == "" {
		t.Fatalf("%s without a message", sparsaErr.Status)
	}
	for _, word := range words {
		if !strings.Contains(sparsaErr.Message, word) {
			t.Errorf("message %q does not mention %q", sparsaErr.Message, word)
		}
	}
	return sparsaErr
}

// mustTensor unwraps a tensor constructor's result in tests where it cannot fail (a panic fails the test).
func mustTensor(tensor *Tensor, err error) *Tensor {
	if err != nil {
		panic(err)
	}
	return tensor
}

func TestVersion(t *testing.T) {
	if Version() != HeaderVersion {
		t.Errorf("library version %d, header %d", Version(), HeaderVersion)
	}
	want := fmt.Sprintf("%d.%d.%d", HeaderVersion/10000, HeaderVersion/100%100, HeaderVersion%100)
	if VersionString() != want {
		t.Errorf("VersionString %q, want %q", VersionString(), want)
	}
	if StatusShapeMismatch.String() != "SPARSA_STATUS_SHAPE_MISMATCH" {
		t.Errorf("status name %q", StatusShapeMismatch.String())
	}
	if PolicySparge.String() != "SPARGE" || DTypeBF16.String() != "BF16" || DTypeBF16.Size() != 2 {
		t.Errorf("names: %s %s %d", PolicySparge, DTypeBF16, DTypeBF16.Size())
	}
}

func TestCloseTwiceAndUseAfterClose(t *testing.T) {
	ctx, err := NewContext(nil)
	if err != nil {
		t.Fatal(err)
	}
	if device, err := ctx.DeviceType(); err != nil || device != DeviceCPU {
		t.Fatalf("DeviceType = %v, %v", device, err)
	}
	if _, err := ctx.ScratchBytes(); err != nil {
		t.Fatal(err)
	}
	if err := ctx.SetStream(0); err != nil {
		t.Fatal(err)
	}
	cache, err := ctx.NewSelectionCache(1, 2, 1, 4, 8)
	if err != nil {
		t.Fatal(err)
	}
	if err := cache.Reset(); err != nil {
		t.Fatal(err)
	}
	if hits, misses, err := cache.Counts(); err != nil || hits != 0 || misses != 0 {
		t.Fatalf("Counts = %d, %d, %v", hits, misses, err)
	}
	cache.Close()
	cache.Close()
	_, _, err = cache.Counts()
	mustStatus(t, err, ErrNullPointer, "closed")
	ctx.Close()
	ctx.Close()
	_, err = ctx.ScratchBytes()
	mustStatus(t, err, ErrNullPointer, "closed")
	err = ctx.Attention(&AttentionArgs{}, nil)
	mustStatus(t, err, ErrNullPointer, "closed")
}

func TestBackendUnavailable(t *testing.T) {
	ctx, err := NewContext(&ContextOptions{Device: DeviceROCm})
	if err == nil {
		ctx.Close()
		t.Skip("a ROCm backend and device are present")
	}
	mustStatus(t, err, ErrBackendUnavailable)
}

func TestPolicyDefaults(t *testing.T) {
	p, err := NewPolicy(PolicySparge)
	if err != nil {
		t.Fatal(err)
	}
	if p.Kind != PolicySparge || p.SpargeTheta != 0.6 || p.BlockQ != 128 || p.BlockK != 64 ||
		!math.IsInf(float64(p.SpargeLambda), -1) || p.SelectTopK != 2048 || p.IndexBlockSize != 1 {
		t.Errorf("defaults differ from sparsa.h: %+v", p)
	}
	_, err = NewPolicy(PolicyKind(99))
	mustStatus(t, err, ErrInvalidArgument)
}

// attentionProblem returns q, k, v, out tensors of [1, s, 2, 4] (F32) and their data.
func attentionProblem(t *testing.T, s int64) (args *AttentionArgs, out []float32) {
	const heads, dim = 2, 4
	n := s * heads * dim
	q, k, v := make([]float32, n), make([]float32, n), make([]float32, n)
	for i := range q {
		q[i], k[i], v[i] = float32(i%7)*0.25, float32(i%5)*0.5, float32(i%3)
	}
	out = make([]float32, n)
	for i := range out {
		out[i] = -7
	}
	return &AttentionArgs{
		Q:   mustTensor(Float32(q, 1, s, heads, dim)),
		K:   mustTensor(Float32(k, 1, s, heads, dim)),
		V:   mustTensor(Float32(v, 1, s, heads, dim)),
		Out: mustTensor(Float32(out, 1, s, heads, dim)),
	}, out
}

func untouched(t *testing.T, out []float32) {
	t.Helper()
	for i, x := range out {
		if x != -7 {
			t.Fatalf("out[%d] = %v was written by a failed call", i, x)
		}
	}
}

func TestWrongDType(t *testing.T) {
	ctx := newTestContext(t)
	args, out := attentionProblem(t, 4)
	halfK := make([]uint16, 4*2*4)
	args.K = mustTensor(Half(DTypeF16, halfK, 1, 4, 2, 4))
	mustStatus(t, ctx.Attention(args, nil), ErrDTypeMismatch, "k")
	untouched(t, out)

	// Found in Go: a slice type that does not hold the dtype's elements.
	_, err := Half(DTypeF32, halfK, 1, 4, 2, 4)
	mustStatus(t, err, ErrDTypeMismatch, "[]uint16")
	_, err = Bytes(DType(42), make([]byte, 4), 4)
	mustStatus(t, err, ErrDTypeMismatch, "dtype")
}

func TestWrongSize(t *testing.T) {
	_, err := Float32(make([]float32, 5), 2, 3)
	mustStatus(t, err, ErrShapeMismatch, "[2 3]", "5")
	_, err = Int32(make([]int32, 1), make([]int64, MaxDims+1)...)
	mustStatus(t, err, ErrShapeMismatch, "dims")
	tensor := mustTensor(Float32(make([]float32, 6), 2, 3))
	_, err = tensor.WithStrides(4, 1)
	mustStatus(t, err, ErrShapeMismatch, "reaches")
	if view, err := tensor.WithStrides(1, 2); err != nil || view.Strides()[1] != 2 {
		t.Fatalf("transposed view: %v", err)
	}

	// Found by the library: k larger than the number of tokens.
	ctx := newTestContext(t)
	scores := mustTensor(Float32([]float32{1, 2, 3}, 1, 1, 3))
	indices := []int32{-9, -9, -9, -9}
	err = ctx.TopKFromScores(scores, 4, 1, mustTensor(Int32(indices, 1, 1, 4)))
	mustStatus(t, err, ErrShapeMismatch, "k")
	for _, x := range indices {
		if x != -9 {
			t.Fatal("a failed call wrote its output")
		}
	}
	// And an attention output of the wrong shape.
	args, _ := attentionProblem(t, 4)
	args.Out = mustTensor(Float32(make([]float32, 3*2*4), 1, 3, 2, 4))
	mustStatus(t, ctx.Attention(args, nil), ErrShapeMismatch, "out")
}

func TestIndexOutOfRange(t *testing.T) {
	ctx := newTestContext(t)
	args, out := attentionProblem(t, 4)
	policy, err := NewPolicy(PolicyTokenIndices)
	if err != nil {
		t.Fatal(err)
	}
	// [B=1, H_idx=1, k=2]; token 99 is outside [0, 4).
	policy.Indices = mustTensor(Int32([]int32{0, 99}, 1, 1, 2))
	mustStatus(t, ctx.Attention(args, &policy), ErrIndexOutOfRange, "indices")
	untouched(t, out)
}

func TestAttentionRunsAndPlans(t *testing.T) {
	ctx := newTestContext(t)
	args, out := attentionProblem(t, 4)
	stats := make([]int64, StatCount)
	args.Stats = mustTensor(Int64(stats, int64(StatCount)))
	args.Causal = true
	if err := ctx.Plan(args, nil); err != nil {
		t.Fatal(err)
	}
	untouched(t, out)
	policy, err := NewPolicy(PolicyDense)
	if err != nil {
		t.Fatal(err)
	}
	if err := ctx.Attention(args, &policy); err != nil {
		t.Fatal(err)
	}
	for i, x := range out {
		if x == -7 || math.IsNaN(float64(x)) {
			t.Fatalf("out[%d] = %v", i, x)
		}
	}
	// Causal, 4 rows of 2 heads: 1+2+3+4 pairs per head.
	if stats[StatPairsComputed] != 20 || stats[StatPairsDense] != 20 {
		t.Errorf("stats %v", stats)
	}
}

// TestRawAddress passes memory Go does not manage by address: C-like memory is simulated with a Go array kept
// alive by the test (the library only sees an address). A CUDA address on a CPU context is refused.
func TestRawAddress(t *testing.T) {
	ctx := newTestContext(t)
	scores := []float32{3, 1, 2}
	indices := []int32{-1}
	scoresAt := uintptr(unsafe.Pointer(&scores[0]))
	raw, err := FromAddress(scoresAt, DTypeF32, DeviceCPU, 0, 1, 1, 3)
	if err != nil {
		t.Fatal(err)
	}
	if err := ctx.TopKFromScores(raw, 1, 1, mustTensor(Int32(indices, 1, 1, 1))); err != nil || indices[0] != 0 {
		t.Fatalf("top-1 via a raw address: %v, %v", indices, err)
	}
	runtime.KeepAlive(scores)
	device, err := FromAddress(0x10000, DTypeF32, DeviceCUDA, 0, 1, 1, 3)
	if err != nil {
		t.Fatal(err)
	}
	err = ctx.TopKFromScores(device, 1, 1, mustTensor(Int32(indices, 1, 1, 1)))
	mustStatus(t, err, ErrDeviceMismatch)
}

func TestHilbertPermutation(t *testing.T) {
	perm, inverse, err := HilbertPermutation(2, 3, 5)
	if err != nil {
		t.Fatal(err)
	}
	seen := make([]bool, len(perm))
	for i, id := range perm {
		if id < 0 || int(id) >= len(perm) || seen[id] || inverse[id] != int32(i) {
			t.Fatalf("not a permutation with its inverse at %d: %v / %v", i, perm, inverse)
		}
		seen[id] = true
	}
	err = HilbertPermutationInto(2, 3, 5, make([]int32, 29), nil)
	mustStatus(t, err, ErrShapeMismatch, "perm")
	_, _, err = HilbertPermutation(-1, 3, 5)
	var sparsaErr *Error
	if !errors.As(err, &sparsaErr) || sparsaErr.Message == "" {
		t.Fatalf("negative extent: %v", err)
	}
}

// TestMessageReadInTheFailingCall fails different calls from many goroutines at once: each error must carry the
// message of its own failure, although goroutines move between OS threads and the library's message is
// thread-local.
func TestMessageReadInTheFailingCall(t *testing.T) {
	const goroutines, rounds = 8, 200
	var wg sync.WaitGroup
	failures := make(chan string, goroutines)
	for g := 0; g < goroutines; g++ {
		wg.Add(1)
		go func(g int) {
			defer wg.Done()
			for r := 0; r < rounds; r++ {
				var err error
				var want string
				if g%2 == 0 {
					err = HilbertPermutationInto(-1-int32(r), 1, 1, nil, nil)
					want = fmt.Sprint(-1 - r)
				} else {
					draft, _ := Float32(make([]float32, 4), 1, 1, 4)
					target, _ := Float32(make([]float32, 4), 1, 1, 4)
					outMap, _ := Int32(make([]int32, 1), 1)
					err = HeadMapping(draft, target, int32(100+r), outMap)
					want = fmt.Sprint(100 + r)
				}
				var sparsaErr *Error
				if !errors.As(err, &sparsaErr) || !strings.Contains(sparsaErr.Message, want) {
					failures <- fmt.Sprintf("goroutine %d round %d: %v does not mention %s", g, r, err, want)
					return
				}
				runtime.Gosched()
			}
		}(g)
	}
	wg.Wait()
	close(failures)
	for failure := range failures {
		t.Error(failure)
	}
}

func TestSpargeTune(t *testing.T) {
	ctx := newTestContext(t)
	args, _ := attentionProblem(t, 64)
	params := make([]float32, 2*4)
	metrics := make([]float32, 2*2)
	options := DefaultSpargeTuneOptions()
	if options.SearchSteps != 10 || options.L1 != 0.07 {
		t.Errorf("tune defaults differ from sparsa.h: %+v", options)
	}
	options.SearchSteps = 3
	err := ctx.SpargeTune(args, nil, &options, mustTensor(Float32(params, 2, 4)), mustTensor(Float32(metrics, 2, 2)))
	if err != nil {
		t.Fatal(err)
	}
	for head := 0; head < 2; head++ {
		if theta := params[head*4]; theta < -1 || theta > 1 {
			t.Errorf("head %d: theta %v outside [-1, 1]", head, theta)
		}
	}
	// A tuner output of the wrong shape.
	err = ctx.SpargeTune(args, nil, nil, mustTensor(Float32(make([]float32, 3), 3)), nil)
	mustStatus(t, err, ErrShapeMismatch)
}
