"""TOKEN_SELECT decode on the CUDA backend vs dense cuDNN decode (a bench_gpu.py module: run(sp, record, quick)).

The shape of the performance goal (issue 3): GQA 32/8, D = 128, bf16, B = 1, one query row, I = 128 sinks + top_k
2048 + 512 local tokens, at N = 128K and 1M keys. Timed in the same process against SDPA's cuDNN backend (enable_gqa) on the same K/V:
  - miss: a decode step whose query is unrelated to the cached one (the cache misses: scoring all N keys, bf16 in fp32,
    the head vote, the device top-k, the index attention); two captured CUDA graphs (each copies its own query into
    q, then runs) replayed alternately, and the same eagerly (host launch cost included);
  - hit: the same query again (cos = 1 >= theta): the selection is reused, only the index attention runs; a captured
    graph replayed, and eagerly.
Timed steps pass no selected_indices (what a serving loop passes: the device then composes each index set inside the
attention walk); the hit is also timed with selected_indices requested (a list kernel writes them first), and the
two runs' outputs must be bit-identical.
Batch 8 of ragged lengths (128K down to 72K) misses every step, against cuDNN dense decode of each sequence.
Bars: miss <= 1.0x dense cuDNN decode at 128K and <= 0.6x at 1M, hit <= 0.03 ms, batch 8 >= 3x dense per sequence.
Checks first: the selection against a float64 torch reference of the head vote (overlap of the top-k sets), and the
output against SDPA over sparsa's own index set (read back from selected_indices).
"""
import ctypes

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from bench_gpu import bench, rel_err

N_INIT, TOP_K, N_LOCAL = 128, 2048, 512
THETA = 0.9


class SelectRunner:
    """Its own context (so its stream can follow graph capture) and selection cache; run() enqueues one decode."""

    def __init__(self, sp, q, k, v, out, selected, seq_lens=None):
        L = sp.L  # the binding's ctypes layer: structs field by field, typed functions
        self.lib = lib = L.lib
        options = L.CContextOptions()
        L.call("sparsa_context_options_init", ctypes.byref(options), ctypes.sizeof(options))
        if sp.device == "cuda":
            options.device_type = L.DEVICE_CUDA
            options.stream = torch.cuda.current_stream().cuda_stream
        self.ctx = ctypes.c_void_p()
        self.check(lib.sparsa_context_create(ctypes.byref(options), ctypes.byref(self.ctx)), "context_create")
        B, _, H, D = q.shape
        Hkv = k.shape[2]
        self.cache = ctypes.c_void_p()
        self.check(lib.sparsa_selection_cache_create(self.ctx, B, H, Hkv, D, TOP_K, ctypes.byref(self.cache)),
                   "selection_cache_create")
        self.keep = [sp.to_tensor(x, L.DTYPE_BF16) for x in (q, k, v, out)] + [sp.to_tensor(selected, L.DTYPE_I32)]
        self.args = sp.new_args()
        self.args.q, self.args.k, self.args.v, self.args.out, self.selected = (ctypes.pointer(x) for x in self.keep)
        self.args.selected_indices = self.selected
        if seq_lens is not None:  # a ragged batch over padded K/V
            self.keep.append(sp.to_tensor(seq_lens, L.DTYPE_I32))
            self.args.seq_lens_k = ctypes.pointer(self.keep[-1])
        self.args.causal = 1
        self.args.selection_cache = self.cache
        self.policy = sp.new_policy(L.POLICY_TOKEN_SELECT)
        self.policy.select_n_init, self.policy.select_n_local, self.policy.select_top_k = N_INIT, N_LOCAL, TOP_K
        self.policy.select_cache_theta = THETA
        self.check(lib.sparsa_attention_plan(self.ctx, ctypes.byref(self.args), ctypes.byref(self.policy)),
                   "attention_plan")

    def check(self, status, what):
        if status != 0:
            raise RuntimeError(f"sparsa {what} failed ({status}): {self.lib.sparsa_last_error_message().decode()}")

    def set_stream(self, stream):
        self.check(self.lib.sparsa_context_set_stream(self.ctx, ctypes.c_void_p(stream.cuda_stream)), "set_stream")

    def request_selected(self, on):
        """Whether later runs (and graphs captured from now on) write selected_indices."""
        self.args.selected_indices = self.selected if on else None

    def run(self):
        self.check(self.lib.sparsa_attention_run(self.ctx, ctypes.byref(self.args), ctypes.byref(self.policy)),
                   "attention_run")

    def counts(self):
        hits, misses = ctypes.c_int64(), ctypes.c_int64()
        self.check(self.lib.sparsa_selection_cache_counts(self.cache, ctypes.byref(hits), ctypes.byref(misses)),
                   "cache_counts")
        return hits.value, misses.value

    def close(self):
        self.lib.sparsa_selection_cache_destroy(self.cache)
        self.lib.sparsa_context_destroy(self.ctx)


def reference_selection(q, k, N):
    """float64 head soft vote of §6 (shared set): the top_k candidate ids, as a set."""
    H, D = q.shape[2], q.shape[3]
    Hkv = k.shape[2]
    g = H // Hkv
    qbar = q[0, 0].double()  # [H, D]; one query row: the mean is the row
    cand = slice(N_INIT, N - N_LOCAL)
    scores = torch.empty(H, N - N_INIT - N_LOCAL, dtype=torch.float64, device=q.device)
    chunk = 1 << 16
    for start in range(0, scores.shape[1], chunk):
        kc = k[0, cand][start:start + chunk].double()  # [n, Hkv, D]
        for hk in range(Hkv):
            scores[hk * g:(hk + 1) * g, start:start + chunk] = qbar[hk * g:(hk + 1) * g] @ kc[:, hk].T
    vote = torch.softmax(scores, dim=1).sum(0)
    del scores
    # ties to the smaller index: stable sort on -vote
    order = torch.sort(-vote, stable=True).indices[:TOP_K]
    return set((order + N_INIT).tolist())


def graph_of(runner, q, q_src, stream):
    """A CUDA graph that copies q_src into q and runs one decode step (captured on `stream`)."""
    graph = torch.cuda.CUDAGraph()
    runner.set_stream(stream)
    with torch.cuda.graph(graph, stream=stream):
        q.copy_(q_src)
        runner.run()
    runner.set_stream(torch.cuda.current_stream())
    return graph


def timed_misses(runner, q, q_other, q_first, stream):
    """Milliseconds per decode step when two captured graphs, each copying its own unrelated query into q, replay
    alternately (every step a cache miss), and the cache hits counted meanwhile (0 when every step missed)."""
    graph_a = graph_of(runner, q, q_other, stream)
    graph_b = graph_of(runner, q, q_first, stream)
    hits_before, _ = runner.counts()

    def miss_pair():
        graph_a.replay()
        graph_b.replay()
    ms = bench(miss_pair) / 2
    hits_after, _ = runner.counts()
    return ms, hits_after - hits_before


def run(sp, record, quick):
    B, H, Hkv, D = 1, 32, 8, 128
    capture_stream = torch.cuda.Stream()
    for N in ([131072] if quick else [131072, 1048576]):
        torch.manual_seed(0)
        q = torch.randn(B, 1, H, D, device="cuda", dtype=torch.bfloat16)
        q_other = torch.randn_like(q)  # unrelated: cos ~ 0 < theta, every switch misses
        q_first = q.clone()
        k = torch.randn(B, N, Hkv, D, device="cuda", dtype=torch.bfloat16)
        v = torch.randn_like(k)
        out = torch.empty_like(q)
        cap = N_INIT + TOP_K + N_LOCAL
        selected = torch.full((B, 1, cap), -7, device="cuda", dtype=torch.int32)
        runner = SelectRunner(sp, q, k, v, out, selected)

        # ---- correctness ----
        runner.run()
        torch.cuda.synchronize()
        ids = selected[0, 0].long()
        assert bool((ids >= 0).all()), "selected_indices not fully written"
        got = set(ids[N_INIT:N_INIT + TOP_K].tolist())
        overlap = len(got & reference_selection(q, k, N)) / TOP_K
        kh = k[0, ids].transpose(0, 1).repeat_interleave(H // Hkv, 0)  # [H, |I|, D]
        vh = v[0, ids].transpose(0, 1).repeat_interleave(H // Hkv, 0)
        ref = F.scaled_dot_product_attention(q[0].transpose(0, 1).unsqueeze(2), kh.unsqueeze(0).transpose(0, 1),
                                             vh.unsqueeze(0).transpose(0, 1))  # [H, 1, 1, D]
        err = rel_err(out[0, 0], ref[:, 0, 0])
        del kh, vh, ref
        listed_out = out.clone()
        runner.request_selected(False)  # the same query: a hit, its index set composed in the walk
        out.fill_(float("nan"))
        runner.run()
        torch.cuda.synchronize()
        assert torch.equal(out, listed_out), "outputs with and without selected_indices differ"

        # ---- peers: dense decode on the same K/V ----
        qt, kt, vt = (x.transpose(1, 2) for x in (q, k, v))
        with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
            cudnn = bench(lambda: F.scaled_dot_product_attention(qt, kt, vt, enable_gqa=True))
        dense = sp.prepare(q, k, v, out, True)
        dense_ms = bench(dense)

        # ---- miss: alternate two unrelated queries ----
        miss_graph, hits_during_miss = timed_misses(runner, q, q_other, q_first, capture_stream)
        state = {"flip": False}

        def miss_eager():
            state["flip"] = not state["flip"]
            q.copy_(q_other if state["flip"] else q_first)
            runner.run()
        miss_ms = bench(miss_eager)

        # ---- hit: the same query again ----
        q.copy_(q_first)
        runner.run()
        graph_hit = graph_of(runner, q, q_first, capture_stream)
        hits2, misses2 = runner.counts()
        hit_graph = bench(graph_hit.replay)
        hit_ms = bench(runner.run)
        hits3, misses3 = runner.counts()
        runner.request_selected(True)
        graph_listed = graph_of(runner, q, q_first, capture_stream)
        hit_listed = bench(graph_listed.replay)
        runner.request_selected(False)
        torch.cuda.synchronize()

        common = dict(N=N, n_init=N_INIT, top_k=TOP_K, n_local=N_LOCAL, rel_err=err, selection_overlap=overlap,
                      cudnn_ms=cudnn, sparsa_dense_ms=dense_ms)
        record(kind="select_miss", sparsa_ms=miss_graph, eager_ms=miss_ms, vs_cudnn=cudnn / miss_graph,
               cache_hits_during=hits_during_miss, bar_ok=miss_graph <= cudnn, **common)
        record(kind="select_hit", sparsa_ms=hit_graph, eager_ms=hit_ms, vs_cudnn=cudnn / hit_graph,
               with_selected_indices_ms=hit_listed, cache_misses_during=misses3 - misses2, bar_ok=hit_graph <= 0.03,
               **common)
        runner.close()
        del q, q_other, q_first, k, v, out, qt, kt, vt, graph_hit, graph_listed
        torch.cuda.empty_cache()
    if not quick:
        run_ragged_batch(sp, record)


def run_ragged_batch(sp, record):
    """Batch 8 of ragged lengths (128K down to 72K, padded K/V with seq_lens_k), every step a cache miss, against
    cuDNN dense decode of each sequence at its own length (8 SDPA calls) and sparsa's dense decode of the batch."""
    B, H, Hkv, D, N = 8, 32, 8, 128, 131072
    lengths = [N - 8192 * b for b in range(B)]
    torch.manual_seed(1)
    q = torch.randn(B, 1, H, D, device="cuda", dtype=torch.bfloat16)
    q_other, q_first = torch.randn_like(q), q.clone()
    k = torch.randn(B, N, Hkv, D, device="cuda", dtype=torch.bfloat16)
    v = torch.randn_like(k)
    out = torch.empty_like(q)
    selected = torch.full((B, 1, N_INIT + TOP_K + N_LOCAL), -7, device="cuda", dtype=torch.int32)
    lens = torch.tensor(lengths, device="cuda", dtype=torch.int32)
    runner = SelectRunner(sp, q, k, v, out, selected, seq_lens=lens)
    runner.run()
    torch.cuda.synchronize()
    assert bool((selected >= 0).all()), "selected_indices not fully written"
    runner.request_selected(False)
    # Sequence b's output against SDPA over its own index set (read back from selected_indices).
    errs = []
    for b in range(B):
        ids = selected[b, 0].long()
        kh = k[b, ids].transpose(0, 1).repeat_interleave(H // Hkv, 0)
        vh = v[b, ids].transpose(0, 1).repeat_interleave(H // Hkv, 0)
        ref = F.scaled_dot_product_attention(q[b].transpose(0, 1).unsqueeze(2), kh.unsqueeze(1), vh.unsqueeze(1))
        errs.append(rel_err(out[b, 0], ref[:, 0, 0]))
    views = [tuple(x[b:b + 1, :n].transpose(1, 2) for x in (k, v)) for b, n in enumerate(lengths)]
    qts = [q[b:b + 1].transpose(1, 2) for b in range(B)]

    def cudnn_per_sequence():
        for b in range(B):
            F.scaled_dot_product_attention(qts[b], views[b][0], views[b][1], enable_gqa=True)
    with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
        cudnn = bench(cudnn_per_sequence)
    miss, hits_during = timed_misses(runner, q, q_other, q_first, torch.cuda.Stream())
    record(kind="select_miss_batch8", N=N, lengths=lengths, sparsa_ms=miss, cudnn_ms=cudnn, vs_cudnn=cudnn / miss,
           cache_hits_during=hits_during, rel_err=max(errs), bar_ok=cudnn / miss >= 3.0)
    runner.close()
    del q, q_other, q_first, k, v, out, views
    torch.cuda.empty_cache()


def kernel_timeline(fn, label, replays=3):
    """Runs fn `replays` times under the torch profiler and prints the kernels of the last run: start offset from
    the first kernel, duration, name (the hit path's launches and gaps; the miss path's per-kernel costs)."""
    import json
    import os
    import tempfile
    from torch.profiler import ProfilerActivity, profile
    torch.cuda.synchronize()
    marks = []
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(replays):
            fn()
            torch.cuda.synchronize()
            marks.append(None)
    path = os.path.join(tempfile.mkdtemp(), "trace.json")
    prof.export_chrome_trace(path)
    events = [e for e in json.load(open(path))["traceEvents"] if e.get("cat") == "kernel"]
    events.sort(key=lambda e: e["ts"])
    runs, current = [], []
    for e in events:  # a gap of > 50 us separates two runs (each ends with a synchronize)
        if current and e["ts"] - (current[-1]["ts"] + current[-1]["dur"]) > 50:
            runs.append(current)
            current = []
        current.append(e)
    if current:
        runs.append(current)
    last = runs[-1]
    t0 = last[0]["ts"]
    end = last[-1]["ts"] + last[-1]["dur"]
    print(f"--- {label}: {len(last)} kernels, first start to last end {end - t0:.1f} us, "
          f"busy {sum(e['dur'] for e in last):.1f} us", flush=True)
    for e in last:
        print(f"  +{e['ts'] - t0:8.1f} us  {e['dur']:8.1f} us  {e['name'][:110]}", flush=True)


def profile_main():
    """python3 bench_select.py LIB --profile: one 1M-key miss (for ncu -k regex:score), nothing else.
    python3 bench_select.py LIB --timeline [N]: miss and hit graph replays timed, and their kernel timelines.
    --selected: the runs write selected_indices (the list kernel runs)."""
    import sys
    from bench_gpu import Sparsa
    sp = Sparsa(sys.argv[1])
    N = int(sys.argv[3]) if len(sys.argv) > 3 else 1048576
    B, H, Hkv, D = 1, 32, 8, 128
    torch.manual_seed(0)
    q = torch.randn(B, 1, H, D, device="cuda", dtype=torch.bfloat16)
    q_other, q_first = torch.randn_like(q), q.clone()
    k = torch.randn(B, N, Hkv, D, device="cuda", dtype=torch.bfloat16)
    v = torch.randn_like(k)
    out = torch.empty_like(q)
    selected = torch.full((B, 1, N_INIT + TOP_K + N_LOCAL), -7, device="cuda", dtype=torch.int32)
    runner = SelectRunner(sp, q, k, v, out, selected)
    runner.request_selected("--selected" in sys.argv)
    if "--profile" in sys.argv:
        runner.run()  # empty cache: a miss
        torch.cuda.synchronize()
        runner.close()
        return
    stream = torch.cuda.Stream()
    graph_a, graph_b = graph_of(runner, q, q_other, stream), graph_of(runner, q, q_first, stream)

    def miss_pair():
        graph_a.replay()
        graph_b.replay()
    miss = bench(miss_pair) / 2
    q.copy_(q_first)
    runner.run()
    graph_hit = graph_of(runner, q, q_first, stream)
    hit = bench(graph_hit.replay)
    qt, kt, vt = (x.transpose(1, 2) for x in (q, k, v))
    with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
        cudnn = bench(lambda: F.scaled_dot_product_attention(qt, kt, vt, enable_gqa=True))
    print(f"N={N} miss_graph_ms={miss:.4f} hit_graph_ms={hit:.4f} cudnn_ms={cudnn:.4f} "
          f"miss/cudnn={miss / cudnn:.3f}", flush=True)
    flip = {"a": False}

    def miss_one():  # alternating queries: every replay misses
        flip["a"] = not flip["a"]
        (graph_a if flip["a"] else graph_b).replay()
    kernel_timeline(miss_one, "miss (graph)")
    graph_hit.replay()
    kernel_timeline(graph_hit.replay, "hit (graph)")
    runner.close()


if __name__ == "__main__":
    profile_main()
