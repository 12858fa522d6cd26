package sparsa

// Runs every shared test vector (tests/vectors/*.spv, format in tests/vectors/FORMAT.md) and compares every output
// byte for byte.

import (
	"bytes"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"sort"
	"strings"
	"testing"
	"unsafe"
)

const (
	vectorMagic      = "SPARSAV1"
	entryTensor      = 1
	entryInt         = 2
	entryFloat       = 3
	entryString      = 4
	poisonByte       = 0xA5
	maxVectorEntries = 1 << 16
)

// vectorEntry is one named entry of a vector file; which fields are set depends on kind.
type vectorEntry struct {
	kind  byte
	dtype DType
	shape []int64
	data  []byte
	i     int64
	f     float64
	s     string
}

type vectorFile struct {
	entries map[string]*vectorEntry
}

func readVectorFile(path string) (*vectorFile, error) {
	raw, err := os.ReadFile(path)
	if err != nil {
		return nil, err
	}
	r := bytes.NewReader(raw)
	magic := make([]byte, len(vectorMagic))
	if _, err := io.ReadFull(r, magic); err != nil || string(magic) != vectorMagic {
		return nil, fmt.Errorf("%s: expected magic %q", path, vectorMagic)
	}
	var count uint32
	if err := binary.Read(r, binary.LittleEndian, &count); err != nil || count > maxVectorEntries {
		return nil, fmt.Errorf("%s: bad entry count", path)
	}
	file := &vectorFile{entries: map[string]*vectorEntry{}}
	for n := uint32(0); n < count; n++ {
		name, entry, err := readVectorEntry(r)
		if err != nil {
			return nil, fmt.Errorf("%s: entry %d: %w", path, n, err)
		}
		if _, dup := file.entries[name]; dup {
			return nil, fmt.Errorf("%s: duplicate entry %q", path, name)
		}
		file.entries[name] = entry
	}
	if r.Len() != 0 {
		return nil, fmt.Errorf("%s: %d trailing bytes", path, r.Len())
	}
	return file, nil
}

func readVectorEntry(r *bytes.Reader) (string, *vectorEntry, error) {
	le := binary.LittleEndian
	var nameLen uint16
	if err := binary.Read(r, le, &nameLen); err != nil {
		return "", nil, err
	}
	name := make([]byte, nameLen)
	if _, err := io.ReadFull(r, name); err != nil {
		return "", nil, err
	}
	e := &vectorEntry{}
	var err error
	if e.kind, err = r.ReadByte(); err != nil {
		return "", nil, err
	}
	switch e.kind {
	case entryTensor:
		var dtype int32
		var ndim uint8
		if err := binary.Read(r, le, &dtype); err != nil {
			return "", nil, err
		}
		if err := binary.Read(r, le, &ndim); err != nil {
			return "", nil, err
		}
		e.dtype = DType(dtype)
		e.shape = make([]int64, ndim)
		if err := binary.Read(r, le, e.shape); err != nil {
			return "", nil, err
		}
		var nbytes uint64
		if err := binary.Read(r, le, &nbytes); err != nil {
			return "", nil, err
		}
		if nbytes > uint64(r.Len()) {
			return "", nil, fmt.Errorf("%s: %d data bytes but %d left", name, nbytes, r.Len())
		}
		e.data = make([]byte, nbytes)
		_, err = io.ReadFull(r, e.data)
	case entryInt:
		err = binary.Read(r, le, &e.i)
	case entryFloat:
		err = binary.Read(r, le, &e.f)
	case entryString:
		var length uint32
		if err = binary.Read(r, le, &length); err == nil {
			if uint64(length) > uint64(r.Len()) {
				return "", nil, fmt.Errorf("%s: string of %d bytes but %d left", name, length, r.Len())
			}
			text := make([]byte, length)
			_, err = io.ReadFull(r, text)
			e.s = string(text)
		}
	default:
		err = fmt.Errorf("%s: unknown entry type %d", name, e.kind)
	}
	return string(name), e, err
}

func vectorsDir() string {
	if dir := os.Getenv("SPARSA_VECTORS_DIR"); dir != "" {
		return dir
	}
	return filepath.Join("..", "..", "tests", "vectors")
}

// alignedBytes returns n zeroed bytes on an 8-byte boundary (the library reads typed elements from them).
func alignedBytes(n int) []byte {
	if n == 0 {
		return []byte{}
	}
	words := make([]uint64, (n+7)/8)
	return unsafe.Slice((*byte)(unsafe.Pointer(&words[0])), n)
}

// vectorCase is one vector being run: its entries, the inputs as tensors, and the outputs it compares.
type vectorCase struct {
	t       *testing.T
	file    *vectorFile
	outputs map[string][]byte
}

func (vc *vectorCase) has(name string) bool { _, ok := vc.file.entries[name]; return ok }

func (vc *vectorCase) entry(name string, kind byte) *vectorEntry {
	e, ok := vc.file.entries[name]
	if !ok {
		vc.t.Fatalf("missing entry %q", name)
	}
	if e.kind != kind {
		vc.t.Fatalf("entry %q: type %d, expected %d", name, e.kind, kind)
	}
	return e
}

func (vc *vectorCase) int(name string, fallback int64) int64 {
	if !vc.has(name) {
		return fallback
	}
	return vc.entry(name, entryInt).i
}

func (vc *vectorCase) float(name string, fallback float64) float64 {
	if !vc.has(name) {
		return fallback
	}
	return vc.entry(name, entryFloat).f
}

// tensorOf wraps a copy of the entry's bytes (aligned) as a tensor.
func (vc *vectorCase) tensorOf(name string, data []byte) *Tensor {
	e := vc.entry(name, entryTensor)
	tensor, err := Bytes(e.dtype, data, e.shape...)
	if err != nil {
		vc.t.Fatalf("%s: %v", name, err)
	}
	return tensor
}

// input returns in.<name> as a tensor, nil when absent.
func (vc *vectorCase) input(name string) *Tensor {
	full := "in." + name
	if !vc.has(full) {
		return nil
	}
	e := vc.entry(full, entryTensor)
	data := alignedBytes(len(e.data))
	copy(data, e.data)
	return vc.tensorOf(full, data)
}

// output allocates out.<name> filled with the poison (or zeros), nil when absent.
func (vc *vectorCase) output(name string) *Tensor {
	full := "out." + name
	if !vc.has(full) {
		return nil
	}
	e := vc.entry(full, entryTensor)
	data := alignedBytes(len(e.data))
	if name != "k_dst" && name != "v_dst" {
		for i := range data {
			data[i] = poisonByte
		}
	}
	vc.outputs[full] = data
	return vc.tensorOf(full, data)
}

// compareOutputs checks every allocated output against its expected bytes.
func (vc *vectorCase) compareOutputs() {
	names := make([]string, 0, len(vc.outputs))
	for name := range vc.outputs {
		names = append(names, name)
	}
	sort.Strings(names)
	for _, name := range names {
		got, want := vc.outputs[name], vc.file.entries[name].data
		if bytes.Equal(got, want) {
			continue
		}
		first := 0
		for first < len(got) && got[first] == want[first] {
			first++
		}
		vc.t.Errorf("%s: bytes differ from byte %d of %d (got % x, want % x)", name, first, len(got),
			got[first:minInt(first+8, len(got))], want[first:minInt(first+8, len(want))])
	}
}

func minInt(a, b int) int {
	if a < b {
		return a
	}
	return b
}

// policyFieldSetters sets a Policy field from its C name (policy.<field> entries).
var policyFieldSetters = map[string]func(p *Policy, e *vectorEntry){
	"flags":                    func(p *Policy, e *vectorEntry) { p.Flags = PolicyFlag(e.i) },
	"sink_tokens":              func(p *Policy, e *vectorEntry) { p.SinkTokens = int32(e.i) },
	"sink_window":              func(p *Policy, e *vectorEntry) { p.SinkWindow = int32(e.i) },
	"block_q":                  func(p *Policy, e *vectorEntry) { p.BlockQ = int32(e.i) },
	"block_k":                  func(p *Policy, e *vectorEntry) { p.BlockK = int32(e.i) },
	"sparge_theta":             func(p *Policy, e *vectorEntry) { p.SpargeTheta = float32(e.f) },
	"sparge_tau":               func(p *Policy, e *vectorEntry) { p.SpargeTau = float32(e.f) },
	"sparge_topk_fraction":     func(p *Policy, e *vectorEntry) { p.SpargeTopkFraction = float32(e.f) },
	"sparge_lambda":            func(p *Policy, e *vectorEntry) { p.SpargeLambda = float32(e.f) },
	"sparge_attention_sink":    func(p *Policy, e *vectorEntry) { p.SpargeAttentionSink = e.i != 0 },
	"sparge_quantized":         func(p *Policy, e *vectorEntry) { p.SpargeQuantized = e.i != 0 },
	"token_sparse_window":      func(p *Policy, e *vectorEntry) { p.TokenSparseWindow = int32(e.i) },
	"token_sparse_pool_kernel": func(p *Policy, e *vectorEntry) { p.TokenSparsePoolKernel = int32(e.i) },
	"token_sparse_coverage":    func(p *Policy, e *vectorEntry) { p.TokenSparseCoverage = float32(e.f) },
	"token_sparse_min_tokens":  func(p *Policy, e *vectorEntry) { p.TokenSparseMinTokens = int32(e.i) },
	"select_n_init":            func(p *Policy, e *vectorEntry) { p.SelectNInit = int32(e.i) },
	"select_n_local":           func(p *Policy, e *vectorEntry) { p.SelectNLocal = int32(e.i) },
	"select_top_k":             func(p *Policy, e *vectorEntry) { p.SelectTopK = int32(e.i) },
	"select_scale_scores":      func(p *Policy, e *vectorEntry) { p.SelectScaleScores = e.i != 0 },
	"select_cache_theta":       func(p *Policy, e *vectorEntry) { p.SelectCacheTheta = float32(e.f) },
	"select_per_kv_head":       func(p *Policy, e *vectorEntry) { p.SelectPerKVHead = e.i != 0 },
	"index_block_size":         func(p *Policy, e *vectorEntry) { p.IndexBlockSize = int32(e.i) },
	"index_n_init":             func(p *Policy, e *vectorEntry) { p.IndexNInit = int32(e.i) },
	"index_n_local":            func(p *Policy, e *vectorEntry) { p.IndexNLocal = int32(e.i) },
	"delta_gamma":              func(p *Policy, e *vectorEntry) { p.DeltaGamma = int32(e.i) },
	"delta_tail_min":           func(p *Policy, e *vectorEntry) { p.DeltaTailMin = int32(e.i) },
}

func (vc *vectorCase) policy() *Policy {
	if !vc.has("policy.kind") {
		return nil
	}
	policy, err := NewPolicy(PolicyKind(vc.entry("policy.kind", entryInt).i))
	if err != nil {
		vc.t.Fatalf("policy.kind: %v", err)
	}
	for name, e := range vc.file.entries {
		field := strings.TrimPrefix(name, "policy.")
		if field == name || field == "kind" {
			continue
		}
		setter, ok := policyFieldSetters[field]
		if !ok {
			vc.t.Fatalf("%s: no Policy field for this C field", name)
		}
		setter(&policy, e)
	}
	policy.BlockMask = vc.input("block_mask")
	policy.SpargeHeadParams = vc.input("sparge_head_params")
	policy.Indices = vc.input("indices")
	policy.HeadMap = vc.input("head_map")
	return &policy
}

// call runs the vector's op once per run (several runs only for selection-cache cases) and returns the error of
// the last run.
func (vc *vectorCase) call(ctx *Context, op string) error {
	switch op {
	case "attention":
		return vc.callAttention(ctx)
	case "merge_states":
		return ctx.MergeStates(vc.input("o_a"), vc.input("lse_a"), vc.input("o_b"), vc.input("lse_b"),
			vc.output("out"), vc.output("out_lse"))
	case "topk_from_scores":
		return ctx.TopKFromScores(vc.input("scores"), int32(vc.int("arg.k", 0)), int32(vc.int("arg.block_size", 1)),
			vc.output("indices"))
	case "head_mapping":
		return HeadMapping(vc.input("draft"), vc.input("target"), int32(vc.int("arg.k", 0)), vc.output("map"))
	case "hilbert_permutation":
		return HilbertPermutationInto(int32(vc.int("arg.t", 0)), int32(vc.int("arg.h", 0)),
			int32(vc.int("arg.w", 0)), vc.int32Output("perm"), vc.int32Output("inverse"))
	case "drift_select_layers":
		return DriftSelectLayers(vc.input("h_in"), vc.input("h_out"), float32(vc.float("arg.delta", 0)),
			vc.output("ratio"), vc.output("sparse"))
	case "kv_prefetch":
		return ctx.KVPrefetch(vc.input("k_src"), vc.input("v_src"), vc.input("indices"), vc.output("k_dst"),
			vc.output("v_dst"), vc.output("positions"), vc.output("remapped"), vc.output("counts"))
	}
	vc.t.Fatalf("unknown op %q", op)
	return nil
}

// int32Output allocates out.<name> (int32) as a poisoned []int32, nil when absent.
func (vc *vectorCase) int32Output(name string) []int32 {
	tensor := vc.output(name)
	if tensor == nil {
		return nil
	}
	data := vc.outputs["out."+name]
	if len(data) == 0 {
		return []int32{}
	}
	return unsafe.Slice((*int32)(unsafe.Pointer(&data[0])), len(data)/4)
}

func (vc *vectorCase) callAttention(ctx *Context) error {
	args := &AttentionArgs{
		Q: vc.input("q"), K: vc.input("k"), V: vc.input("v"),
		Out: vc.output("out"), LSE: vc.output("lse"),
		Causal:       vc.int("arg.causal", 0) != 0,
		SoftmaxScale: float32(vc.float("arg.softmax_scale", 0)),
		CuSeqlensQ:   vc.input("cu_seqlens_q"), CuSeqlensK: vc.input("cu_seqlens_k"),
		PageTable: vc.input("page_table"), SeqLensK: vc.input("seq_lens_k"),
		SelectedIndices: vc.output("selected_indices"), BlockMaskOut: vc.output("block_mask_out"),
		Stats: vc.output("stats"),
	}
	policy := vc.policy()
	runs := vc.int("arg.cache_runs", 0)
	if runs == 0 {
		return ctx.Attention(args, policy)
	}
	dims := vc.entry("in.cache_dims", entryTensor)
	if dims.dtype != DTypeI32 || len(dims.data) != 5*4 {
		vc.t.Fatalf("in.cache_dims: expected int32 [5]")
	}
	d := make([]int32, 5)
	if err := binary.Read(bytes.NewReader(dims.data), binary.LittleEndian, d); err != nil {
		vc.t.Fatal(err)
	}
	cache, err := ctx.NewSelectionCache(d[0], d[1], d[2], d[3], d[4])
	if err != nil {
		vc.t.Fatalf("NewSelectionCache: %v", err)
	}
	defer cache.Close()
	args.SelectionCache = cache
	for run := int64(0); run < runs; run++ {
		if err = ctx.Attention(args, policy); err != nil {
			return err
		}
	}
	hits, misses, err := cache.Counts()
	if err != nil {
		vc.t.Fatalf("Counts: %v", err)
	}
	if want := vc.int("out.cache_hits", hits); hits != want {
		vc.t.Errorf("cache hits: got %d, want %d", hits, want)
	}
	if want := vc.int("out.cache_misses", misses); misses != want {
		vc.t.Errorf("cache misses: got %d, want %d", misses, want)
	}
	return nil
}

func TestVectors(t *testing.T) {
	paths, err := filepath.Glob(filepath.Join(vectorsDir(), "*.spv"))
	if err != nil {
		t.Fatal(err)
	}
	if len(paths) == 0 {
		t.Skipf("no *.spv vectors in %s (set SPARSA_VECTORS_DIR)", vectorsDir())
	}
	ctx, err := NewContext(nil)
	if err != nil {
		t.Fatal(err)
	}
	defer ctx.Close()
	for _, path := range paths {
		path := path
		t.Run(strings.TrimSuffix(filepath.Base(path), ".spv"), func(t *testing.T) {
			file, err := readVectorFile(path)
			if err != nil {
				t.Fatal(err)
			}
			runVector(t, ctx, file)
		})
	}
}

func runVector(t *testing.T, ctx *Context, file *vectorFile) {
	vc := &vectorCase{t: t, file: file, outputs: map[string][]byte{}}
	op := vc.entry("op", entryString).s
	if op == "error" {
		op = vc.entry("call", entryString).s
	}
	err := vc.call(ctx, op)
	if !vc.has("expect.status") {
		if err != nil {
			t.Fatalf("%s: %v", op, err)
		}
		vc.compareOutputs()
		return
	}
	wantStatus := Status(vc.entry("expect.status", entryInt).i)
	var sparsaErr *Error
	if !errors.As(err, &sparsaErr) {
		t.Fatalf("%s: expected a *sparsa.Error with %s, got %v", op, wantStatus, err)
	}
	if sparsaErr.Status != wantStatus || !errors.Is(err, &Error{Status: wantStatus}) {
		t.Errorf("%s: status %s, want %s (%v)", op, sparsaErr.Status, wantStatus, err)
	}
	if vc.has("expect.message") {
		if want := vc.entry("expect.message", entryString).s; !strings.Contains(sparsaErr.Message, want) {
			t.Errorf("%s: message %q does not contain %q", op, sparsaErr.Message, want)
		}
	}
	vc.compareOutputs() // a failed call writes nothing: the outputs still hold the poison
}

// vectorWriter writes the same format, for TestVectorReader's own tiny vectors.
type vectorWriter struct {
	body  bytes.Buffer
	count uint32
}

func (w *vectorWriter) header(name string, kind byte) {
	le := binary.LittleEndian
	_ = binary.Write(&w.body, le, uint16(len(name)))
	w.body.WriteString(name)
	w.body.WriteByte(kind)
	w.count++
}

func (w *vectorWriter) tensor(name string, dtype DType, shape []int64, data interface{}) {
	le := binary.LittleEndian
	w.header(name, entryTensor)
	var payload bytes.Buffer
	_ = binary.Write(&payload, le, data)
	_ = binary.Write(&w.body, le, int32(dtype))
	w.body.WriteByte(byte(len(shape)))
	_ = binary.Write(&w.body, le, shape)
	_ = binary.Write(&w.body, le, uint64(payload.Len()))
	w.body.Write(payload.Bytes())
}

func (w *vectorWriter) int(name string, v int64) {
	w.header(name, entryInt)
	_ = binary.Write(&w.body, binary.LittleEndian, v)
}

func (w *vectorWriter) str(name, v string) {
	w.header(name, entryString)
	_ = binary.Write(&w.body, binary.LittleEndian, uint32(len(v)))
	w.body.WriteString(v)
}

func (w *vectorWriter) save(t *testing.T, path string) {
	var file bytes.Buffer
	file.WriteString(vectorMagic)
	_ = binary.Write(&file, binary.LittleEndian, w.count)
	file.Write(w.body.Bytes())
	if err := os.WriteFile(path, file.Bytes(), 0o600); err != nil {
		t.Fatal(err)
	}
}

// TestVectorReader checks the reader and the runner on two vectors written here: a top-k and its error case.
func TestVectorReader(t *testing.T) {
	dir := t.TempDir()
	scores := []float32{1, 5, 3, 4}
	good := &vectorWriter{}
	good.str("op", "topk_from_scores")
	good.tensor("in.scores", DTypeF32, []int64{1, 1, 4}, scores)
	good.int("arg.k", 2)
	good.int("arg.block_size", 1)
	good.tensor("out.indices", DTypeI32, []int64{1, 1, 2}, []int32{1, 3})
	good.save(t, filepath.Join(dir, "topk.spv"))

	bad := &vectorWriter{}
	bad.str("op", "error")
	bad.str("call", "topk_from_scores")
	bad.tensor("in.scores", DTypeF32, []int64{1, 1, 4}, scores)
	bad.int("arg.k", 5)
	bad.int("expect.status", int64(StatusShapeMismatch))
	bad.str("expect.message", "k")
	poison := int32(-0x5A5A5A5B) // 0xA5A5A5A5
	bad.tensor("out.indices", DTypeI32, []int64{1, 1, 5}, []int32{poison, poison, poison, poison, poison})
	bad.save(t, filepath.Join(dir, "topk_error.spv"))

	ctx, err := NewContext(nil)
	if err != nil {
		t.Fatal(err)
	}
	defer ctx.Close()
	for _, name := range []string{"topk.spv", "topk_error.spv"} {
		file, err := readVectorFile(filepath.Join(dir, name))
		if err != nil {
			t.Fatal(err)
		}
		if got := file.entries["in.scores"]; got == nil || len(got.data) != 16 || got.shape[2] != 4 {
			t.Fatalf("%s: in.scores read back wrong: %+v", name, got)
		}
		t.Run(name, func(t *testing.T) { runVector(t, ctx, file) })
	}
	if _, err := readVectorFile(filepath.Join(dir, "missing.spv")); err == nil {
		t.Fatal("reading a missing file succeeded")
	}
}
