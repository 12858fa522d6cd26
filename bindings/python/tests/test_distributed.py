"""sparsa.distributed (docs/context_parallel.md): G = 2 and 4 ranks simulated as threads of this process
(ThreadGroup, numpy on the CPU backend), compared with one context over the whole sequence: TOKEN_SELECT index sets
exactly, outputs within fp32 rounding. With torch, the torchrun example runs on two gloo processes and checks the
same on its own."""
import os
import socket
import subprocess
import sys

import numpy as np
import pytest

import sparsa
from sparsa import distributed as cp

RTOL = 1e-5  # max |got - want| / max |want| over the output (fp32 rounding of the merge)
EXAMPLE = os.path.join(os.path.dirname(__file__), "..", "examples", "context_parallel_torchrun.py")


def _relative(got, want):
    return float(np.max(np.abs(np.asarray(got, np.float64) - want)) / max(np.max(np.abs(want)), 1e-30))


def _split(lengths, size, rng):
    """Per rank, (start, length) of every sequence: random cuts, sorted (a rank may get no key of a sequence)."""
    cuts = [np.sort(np.concatenate([[0], rng.integers(0, n + 1, size - 1), [n]])) for n in lengths]
    return [(np.array([c[r] for c in cuts], np.int32), np.array([c[r + 1] - c[r] for c in cuts], np.int32))
            for r in range(size)]


def _problem(rng, batch, hq, hkv, d, lengths, duplicates=0, rows=1):
    q = rng.standard_normal((batch, rows, hq, d)).astype(np.float32)
    k = rng.standard_normal((batch, max(lengths), hkv, d)).astype(np.float32)
    v = rng.standard_normal((batch, max(lengths), hkv, d)).astype(np.float32)
    k[:, :4] *= 3.0  # attention sinks
    for b, n in enumerate(lengths):  # needles, and runs of identical keys (exact vote ties)
        k[b, rng.integers(4, n, 3)] = q[b, 0, ::hq // hkv] * 2.0
        for _ in range(duplicates):
            k[b, rng.integers(0, n, 4)] = k[b, rng.integers(0, n)]
    return q, k, v


def _run_ranks(size, q, k, v, lengths, shards, policy):
    """cp_decode on every simulated rank; returns per-rank (out, lse, token-select indices or None)."""
    total = np.array(lengths, np.int32)

    def rank_body(rank, group):
        start, length = shards[rank]
        local_k = np.zeros((len(lengths), max(1, int(length.max())), k.shape[2], k.shape[3]), np.float32)
        local_v = np.zeros_like(local_k)
        for b in range(len(lengths)):
            local_k[b, :length[b]] = k[b, start[b]:start[b] + length[b]]
            local_v[b, :length[b]] = v[b, start[b]:start[b] + length[b]]
        with sparsa.Context() as ctx:
            indices = None
            if isinstance(policy, sparsa.TokenSelect):
                indices = cp.token_select_indices(ctx, group, q, local_k, local_v, policy, start, total,
                                                  seq_lens_k=length)
            out, lse = cp.cp_decode(ctx, group, q, local_k, local_v, policy, kv_start=start, kv_total=total,
                                    seq_lens_k=length)
        return out, lse, indices

    return cp.ThreadGroup(size).run(rank_body)


TOKEN_SELECT_CASES = [
    # (batch, hq, hkv, d, lengths, policy, duplicates, ranks)
    (1, 4, 4, 32, [300], dict(n_init=8, n_local=16, top_k=32), 0, 2),
    (2, 8, 2, 32, [257, 400], dict(n_init=4, n_local=8, top_k=24), 0, 4),
    (3, 8, 1, 16, [300, 97, 513], dict(n_init=16, n_local=32, top_k=40), 20, 4),
    (2, 8, 2, 32, [350, 211], dict(n_init=8, n_local=16, top_k=30, per_kv_head=True), 20, 2),
    (3, 4, 2, 16, [60, 300, 5], dict(n_init=8, n_local=16, top_k=40), 0, 2),  # dense fallback rows mixed in
]


@pytest.mark.parametrize("batch,hq,hkv,d,lengths,params,duplicates,size", TOKEN_SELECT_CASES)
def test_token_select_decode_selection_and_output_equal_one_context(batch, hq, hkv, d, lengths, params,
                                                                    duplicates, size):
    rng = np.random.default_rng(len(lengths) * 100 + size)
    q, k, v = _problem(rng, batch, hq, hkv, d, lengths, duplicates)
    policy = sparsa.TokenSelect(cache_theta=1.0, **params)
    n_sets = hkv if params.get("per_kv_head") else 1
    selected = np.full((batch, n_sets, max(lengths)), -7, np.int32)
    with sparsa.Context() as ctx:
        want = sparsa.attention(ctx, q, k, v, policy=policy, lse=True, selected_indices=selected,
                                seq_lens_k=np.array(lengths, np.int32))
    shards = _split(lengths, size, rng)
    results = _run_ranks(size, q, k, v, lengths, shards, policy)
    for b in range(batch):
        for s in range(n_sets):
            got = sorted(int(t) + int(shards[r][0][b]) for r in range(size) for t in results[r][2][b, s] if t >= 0)
            assert got == sorted(int(t) for t in selected[b, s] if t >= 0), (b, s)
    for out, lse, _ in results:  # every rank holds the merged state
        assert _relative(out, want.out) <= RTOL
        assert _relative(lse, want.lse) <= RTOL


@pytest.mark.parametrize("size", [2, 4])
@pytest.mark.parametrize("kind", ["dense", "sink_window", "token_indices"])
def test_known_index_set_decode_equals_one_context(kind, size):
    rng = np.random.default_rng(size)
    lengths = [300, 123]
    q, k, v = _problem(rng, 2, 8, 2, 32, lengths)
    if kind == "dense":
        policy = sparsa.Dense()
    elif kind == "sink_window":
        policy = sparsa.SinkWindow(sink_tokens=8, window=64)
    else:
        indices = rng.integers(-1, 123, (2, 2, 40)).astype(np.int32)
        policy = sparsa.TokenIndices(indices, n_init=4, n_local=8)
    with sparsa.Context() as ctx:
        want = sparsa.attention(ctx, q, k, v, policy=policy, lse=True, seq_lens_k=np.array(lengths, np.int32))
    for out, lse, _ in _run_ranks(size, q, k, v, lengths, _split(lengths, size, rng), policy):
        assert _relative(out, want.out) <= RTOL
        assert _relative(lse, want.lse) <= RTOL


@pytest.mark.parametrize("size", [2, 4])
@pytest.mark.parametrize("kind", ["dense", "sink_window_same_cut", "token_indices", "token_indices_same_cut",
                                  "token_select"])
def test_several_query_rows_equal_one_context(kind, size):
    """Three query rows (a speculative or chunked step: the sequences' last three positions, causal among them):
    every shard's run places them with query_offsets, also shards that end before them (SINK_WINDOW's window then
    reaches back into some shards and not others)."""
    rng = np.random.default_rng(20 + size)
    same_cut = kind.endswith("same_cut")
    lengths = [300, 300] if same_cut else [300, 187]
    q, k, v = _problem(rng, 2, 8, 2, 32, lengths, rows=3)
    if kind == "dense":
        policy = sparsa.Dense()
    elif kind == "sink_window_same_cut":
        policy = sparsa.SinkWindow(sink_tokens=8, window=200)
    elif kind.startswith("token_indices"):
        indices = rng.integers(-1, min(lengths), (2, 2, 50)).astype(np.int32)
        policy = sparsa.TokenIndices(indices, n_init=4, n_local=90)
    else:
        policy = sparsa.TokenSelect(n_init=8, n_local=16, top_k=32)
    with sparsa.Context() as ctx:
        want = sparsa.attention(ctx, q, k, v, policy=policy, causal=True, lse=True,
                                seq_lens_k=np.array(lengths, np.int32))
    shards = _even_split(lengths[0], 2, size) if same_cut else _split(lengths, size, rng)
    for out, lse, _ in _run_ranks(size, q, k, v, lengths, shards, policy):
        assert _relative(out, want.out) <= RTOL
        assert _relative(lse, want.lse) <= RTOL


def test_several_query_rows_refused_where_a_host_list_cannot_hold_them():
    rng = np.random.default_rng(1)
    q, k, v = _problem(rng, 2, 4, 2, 16, [100, 60], rows=2)
    with pytest.raises(NotImplementedError):  # ragged cuts: SINK_WINDOW would need a window per row
        _run_ranks(2, q, k, v, [100, 60], _split([100, 60], 2, rng), sparsa.SinkWindow(sink_tokens=4, window=16))


def _even_split(length, batch, size):
    """Per rank, (start, length) of every sequence when all sequences have the same length and the same cuts."""
    cuts = np.linspace(0, length, size + 1).astype(np.int32)
    return [(np.full(batch, cuts[r], np.int32), np.full(batch, cuts[r + 1] - cuts[r], np.int32)) for r in range(size)]


@pytest.mark.parametrize("size", [2, 4])
@pytest.mark.parametrize("kind", ["sink_window", "token_indices", "dense_delta", "sink_window_delta"])
def test_same_cut_decode_equals_one_context(kind, size):
    """Every sequence cut at the same places: the shards run the policy itself (sink / window / n_init / n_local cut
    to the shard, indices made local), no host lists. With 4 ranks two shards see no key of SINK_WINDOW (0, -inf
    states in the merge). Δ makes a decode row dense (§8: s_p <= 0)."""
    rng = np.random.default_rng(7 + size)
    batch, length = 2, 300
    q, k, v = _problem(rng, batch, 8, 2, 32, [length] * batch)
    if kind == "sink_window":
        policy = sparsa.SinkWindow(sink_tokens=8, window=64)
    elif kind == "token_indices":
        indices = rng.integers(-1, length, (batch, 2, 60)).astype(np.int32)
        policy = sparsa.TokenIndices(indices, n_init=4, n_local=90)
    elif kind == "dense_delta":
        policy = sparsa.Dense(delta=sparsa.Delta())
    else:
        policy = sparsa.SinkWindow(sink_tokens=8, window=64, delta=sparsa.Delta())
    with sparsa.Context() as ctx:
        if policy.delta is None:
            want_out, want_lse = sparsa.attention(ctx, q, k, v, policy=policy, lse=True)[:2]
        else:  # the library gives no LSE for rows Δ may correct; a dense row's LSE is the dense run's
            want_out = sparsa.attention(ctx, q, k, v, policy=policy, causal=True)
            want_lse = sparsa.attention(ctx, q, k, v, lse=True).lse
    for out, lse, _ in _run_ranks(size, q, k, v, [length] * batch, _even_split(length, batch, size), policy):
        assert _relative(out, want_out) <= RTOL
        assert _relative(lse, want_lse) <= RTOL


PREFILL_KINDS = ["dense", "sink_window", "block_sparse", "sink_window_delta", "block_sparse_delta", "sparge_topk",
                 "sparge_tau"]


def _prefill_policy(kind, rng, batch, hq, total):
    delta = sparsa.Delta(gamma=32, tail_min=40) if kind.endswith("_delta") else None
    if kind.startswith("dense"):
        return sparsa.Dense()
    if kind.startswith("sink_window"):
        return sparsa.SinkWindow(sink_tokens=16, window=100, delta=delta)
    if kind.startswith("block_sparse"):
        mask = (rng.random((batch, hq, total // 32, total // 32)) < 0.4).astype(np.uint8)
        return sparsa.BlockSparse(mask, block_q=32, block_k=32, delta=delta)
    if kind == "sparge_topk":  # every block self-similar: the top-k of all key blocks decides (~47 % of causal cells)
        return sparsa.Sparge(block_q=32, block_k=16, theta=-1.0, topk_fraction=0.3)
    if kind == "sparge_tau":  # TopCdf; about a third of the query blocks fall below theta and are forced (~78 % kept)
        return sparsa.Sparge(block_q=32, block_k=16, theta=0.035, tau=0.5)
    raise ValueError(kind)


@pytest.mark.parametrize("size", [2, 4])
@pytest.mark.parametrize("kind", PREFILL_KINDS)
def test_zigzag_prefill_equals_one_context(kind, size):
    rng = np.random.default_rng(10 + size)
    batch, hq, hkv, d, total = 2, 4, 2, 32, 512
    q = rng.standard_normal((batch, total, hq, d)).astype(np.float32)
    k = rng.standard_normal((batch, total, hkv, d)).astype(np.float32)
    v = rng.standard_normal((batch, total, hkv, d)).astype(np.float32)
    policy = _prefill_policy(kind, rng, batch, hq, total)
    with sparsa.Context() as ctx:
        want = sparsa.attention(ctx, q, k, v, policy=policy, causal=True)

    def rank_body(rank, group):
        ranges = cp.zigzag_ranges(total, size, rank)
        take = lambda x: np.ascontiguousarray(np.concatenate([x[:, a:e] for a, e in ranges], axis=1))  # noqa: E731
        with sparsa.Context() as ctx:
            out = cp.prefill(ctx, group, take(q), take(k), take(v), policy, total=total)
        return out, take(want)

    for out, expected in cp.ThreadGroup(size).run(rank_body):
        assert _relative(out, expected) <= RTOL


def _rows_read(policy, rows, keys):
    """Brute force from §2 / §3 (causal, bottom-right = global positions here): key positions any of `rows` reads."""
    read = set()
    for i in rows:
        for j in range(min(i + 1, keys)):
            if isinstance(policy, sparsa.SinkWindow):
                visible = j < policy.sink_tokens or i - j < policy.window
            else:
                visible = bool(policy.mask[:, :, i // policy.block_q, j // policy.block_k].any())
            if visible:
                read.add(j)
    return read


@pytest.mark.parametrize("size", [2, 4])
@pytest.mark.parametrize("kind", ["sink_window", "block_sparse"])
def test_prefill_sends_only_what_the_policy_reads(kind, size):
    """SINK_WINDOW: exactly the remote keys some query row of the rank reads. BLOCK_SPARSE: those, plus the rest of
    their key blocks (the unit the mask keeps), nothing from a block no row of the rank keeps. DENSE and Δ: None
    (all-gather)."""
    rng = np.random.default_rng(3)
    total = 256
    policy = _prefill_policy(kind, rng, 1, 2, total)
    if kind == "block_sparse":
        policy.mask[:, :, :, 3] = 0  # a key block nobody keeps
    plan = cp.prefill_exchange_plan(total, size, policy)
    for dst in range(size):
        ranges = cp.zigzag_ranges(total, size, dst)
        own = {j for a, e in ranges for j in range(a, e)}
        read = set().union(*(_rows_read(policy, range(a, e), e) for a, e in ranges)) - own
        received = set()
        for src in range(size):
            sent = plan[src][dst].tolist()
            assert sent == sorted(sent) and all(j in {t for a, e in cp.zigzag_ranges(total, size, src)
                                                      for t in range(a, e)} for j in sent)
            received |= set(sent)
        if kind == "sink_window":
            assert received == read
        else:
            assert read <= received
            assert all(j // policy.block_k in {t // policy.block_k for t in read} for j in received)
            assert not any(3 * policy.block_k <= j < 4 * policy.block_k for j in received)
        assert sum(len(plan[src][dst]) for src in range(size)) < total - len(own)  # less than an all-gather
    assert cp.prefill_exchange_plan(total, size, sparsa.Dense()) is None
    assert cp.prefill_exchange_plan(total, size, sparsa.SinkWindow(delta=sparsa.Delta(gamma=32))) is None


def test_prefill_refuses_what_it_cannot_reproduce():
    group = cp.ThreadGroup(1).member(0)
    x = np.zeros((1, 64, 1, 16), np.float32)
    with sparsa.Context() as ctx:
        with pytest.raises(NotImplementedError):  # query_offsets excludes Δ
            cp.prefill(ctx, group, x, x, x, sparsa.Sparge(block_q=32, delta=sparsa.Delta(gamma=32)), total=64)
        with pytest.raises(ValueError):  # chunks of 32 rows, SPARGE blocks of 64
            cp.prefill(ctx, group, x, x, x, sparsa.Sparge(block_q=64), total=64)
        with pytest.raises(ValueError):  # chunks of 32 rows, blocks of 64
            mask = np.ones((1, 1, 1, 1), np.uint8)
            cp.prefill(ctx, group, x, x, x, sparsa.BlockSparse(mask, block_q=64, block_k=64), total=64)
        with pytest.raises(ValueError):  # Δ anchors every 64 rows cross the 32-row chunks
            cp.prefill(ctx, group, x, x, x, sparsa.SinkWindow(delta=sparsa.Delta(gamma=64)), total=64)


def test_zigzag_ranges_balance_causal_work():
    size, total = 4, 64
    work = []
    for rank in range(size):
        ranges = cp.zigzag_ranges(total, size, rank)
        work.append(sum(sum(range(a + 1, e + 1)) for a, e in ranges))  # causal pairs of the rank's rows
    assert len(set(work)) == 1
    with pytest.raises(ValueError):
        cp.zigzag_ranges(100, 4, 0)


def test_a_rank_failure_reaches_the_caller_and_releases_the_others():
    def rank_body(rank, group):
        if rank == 1:
            raise RuntimeError("planted")
        return group.all_gather(np.zeros(1))

    with pytest.raises(RuntimeError, match="planted"):
        cp.ThreadGroup(2).run(rank_body)


def _free_port():
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def test_torchrun_example_on_two_gloo_processes():
    """Starts the example's two ranks with the environment torchrun gives them (RANK, WORLD_SIZE, LOCAL_RANK,
    MASTER_ADDR, MASTER_PORT). Not through torchrun itself: Debian's torch 1.13 launcher fails under Python 3.11
    before starting any worker ("'NoneType' object has no attribute 'get'" in elastic/multiprocessing/api.py)."""
    torch = pytest.importorskip("torch")
    if not torch.distributed.is_available() or not torch.distributed.is_gloo_available():
        pytest.skip("torch.distributed with gloo is not available")
    size, port = 2, _free_port()
    processes = []
    for rank in range(size):
        env = dict(os.environ, PYTHONPATH=os.path.join(os.path.dirname(__file__), ".."), OMP_NUM_THREADS="1",
                   RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(size), MASTER_ADDR="127.0.0.1",
                   MASTER_PORT=str(port), CUDA_VISIBLE_DEVICES="")
        processes.append(subprocess.Popen([sys.executable, EXAMPLE, "--check", "--kv-len", "2048"], env=env,
                                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    outputs = []
    for process in processes:
        try:
            outputs.append(process.communicate(timeout=300)[0])
        finally:
            if process.poll() is None:
                process.kill()
    assert all(p.returncode == 0 for p in processes), "\n".join(outputs)
    assert "context-parallel decode, a three-row step and prefill match one device on 2 ranks" in outputs[0]
