"""The attention run and the utilities. Every tensor argument is any DLPack object (numpy, torch, cupy), read and
written in place with zero copies; an output left as None is allocated like the first input (numpy or torch)."""
import collections
import ctypes

from . import _library as L
from .policy import Dense
from .tensor import as_tensor, check_same_device, empty_like
from .errors import InvalidArgumentError

AttentionOutputs = collections.namedtuple("AttentionOutputs", "out lse selected_indices block_mask_out stats")


class _Views:
    """Converts the arguments of one call to sparsa tensors and keeps every view alive until the call returns."""

    def __init__(self, stream=None):
        self.stream = stream
        self.keep = []
        self.named = []
        self._current_streams = {}  # torch's current stream per device, looked up once per call

    def __call__(self, obj, name, writable=False):
        if obj is None:
            return None
        tensor = as_tensor(obj, name, self.stream, writable, self._current_streams)
        self.keep.append(tensor)
        self.named.append((name, tensor))
        return tensor

    def ptr(self, obj, name):
        tensor = self(obj, name)
        return tensor.pointer() if tensor is not None else None

    def out_ptr(self, obj, name):
        """Like ptr, for an output the library writes."""
        tensor = self(obj, name, writable=True)
        return tensor.pointer() if tensor is not None else None


def _attention_args(views, ctx, q, k, v, out, lse, causal, softmax_scale, cu_seqlens_q, cu_seqlens_k, page_table,
                    seq_lens_k, selection_cache, selected_indices, block_mask_out, stats, query_offsets=None):
    args = L.CAttentionArgs()
    L.call("sparsa_attention_args_init", ctypes.byref(args), ctypes.sizeof(args))
    args.q, args.k, args.v = views.ptr(q, "q"), views.ptr(k, "k"), views.ptr(v, "v")
    args.out, args.lse = views.out_ptr(out, "out"), views.out_ptr(lse, "lse")
    args.causal = 1 if causal else 0
    args.softmax_scale = softmax_scale
    args.cu_seqlens_q, args.cu_seqlens_k = views.ptr(cu_seqlens_q, "cu_seqlens_q"), views.ptr(cu_seqlens_k,
                                                                                             "cu_seqlens_k")
    args.page_table, args.seq_lens_k = views.ptr(page_table, "page_table"), views.ptr(seq_lens_k, "seq_lens_k")
    args.selection_cache = selection_cache.handle if selection_cache is not None else None
    args.selected_indices = views.out_ptr(selected_indices, "selected_indices")
    args.block_mask_out = views.out_ptr(block_mask_out, "block_mask_out")
    args.stats = views.out_ptr(stats, "stats")
    args.query_offsets = views.ptr(query_offsets, "query_offsets")
    check_same_device(views.named)
    return args


def _lse_shape(q_shape):
    """[B, Hq, Sq] for padded q [B, Sq, Hq, D]; [Hq, Tq] for packed q [Tq, Hq, D]."""
    if len(q_shape) == 4:
        return (q_shape[0], q_shape[2], q_shape[1])
    if len(q_shape) == 3:
        return (q_shape[1], q_shape[0])
    return None  # the library reports the rank error on q


def attention(ctx, q, k, v, out=None, *, policy=None, causal=False, softmax_scale=0.0, lse=None,
              cu_seqlens_q=None, cu_seqlens_k=None, page_table=None, seq_lens_k=None, selection_cache=None,
              selected_indices=None, block_mask_out=None, stats=None, query_offsets=None):
    """One attention run (sparsa_attention_run) under `policy` (default Dense()).

    q [B, Sq, Hq, D], k/v [B, Skv, Hkv, D] (packed [T, H, D] with cu_seqlens_*; paged caches with page_table +
    seq_lens_k). `out` defaults to a new tensor like q. `lse=True` / `stats=True` allocate those outputs; or pass
    tensors for lse, stats, selected_indices, block_mask_out. `query_offsets` (int32 [B], the run's device): row i
    of sequence b is aligned with key i + query_offsets[b] (default: bottom-right). Returns `out`, or an
    AttentionOutputs named tuple when any optional output was asked for.
    """
    views = _Views(ctx.stream)
    q_view = views(q, "q")
    if out is None:
        out = empty_like(q, q_view.shape, q_view.dtype, "out")
    lse = None if lse is False else lse  # False, like None: no LSE output
    stats = None if stats is False else stats
    if lse is True:
        lse_shape = _lse_shape(q_view.shape)
        lse = empty_like(q, lse_shape, L.DTYPE_F32, "lse") if lse_shape else None
    if stats is True:
        stats = empty_like(q, (L.STAT_COUNT,), L.DTYPE_I64, "stats")
    args = _attention_args(views, ctx, q_view, k, v, out, lse, causal, softmax_scale, cu_seqlens_q, cu_seqlens_k,
                           page_table, seq_lens_k, selection_cache, selected_indices, block_mask_out, stats,
                           query_offsets)
    c_policy = (policy if policy is not None else Dense()).to_c(views.keep, ctx.stream)
    L.call("sparsa_attention_run", ctx.handle, ctypes.byref(args), ctypes.byref(c_policy))
    if lse is None and selected_indices is None and block_mask_out is None and stats is None:
        return out
    return AttentionOutputs(out, lse, selected_indices, block_mask_out, stats)


def attention_plan(ctx, q, k, v, out, *, policy=None, causal=False, softmax_scale=0.0, lse=None,
                   cu_seqlens_q=None, cu_seqlens_k=None, page_table=None, seq_lens_k=None, selection_cache=None,
                   selected_indices=None, block_mask_out=None, stats=None, query_offsets=None):
    """Validates like attention() and grows the context's scratch for this problem, computing nothing; later runs
    of the same shapes allocate nothing (needed before CUDA graph capture)."""
    views = _Views(ctx.stream)
    args = _attention_args(views, ctx, q, k, v, out, lse, causal, softmax_scale, cu_seqlens_q, cu_seqlens_k,
                           page_table, seq_lens_k, selection_cache, selected_indices, block_mask_out, stats,
                           query_offsets)
    c_policy = (policy if policy is not None else Dense()).to_c(views.keep, ctx.stream)
    L.call("sparsa_attention_plan", ctx.handle, ctypes.byref(args), ctypes.byref(c_policy))


def merge_states(ctx, o_a, lse_a, o_b, lse_b, out=None, out_lse=None):
    """Merges two partial attention states over disjoint key sets (§0). Returns (out, out_lse); out/out_lse may be
    o_a/lse_a (in place)."""
    views = _Views(ctx.stream)
    a = views(o_a, "o_a")
    if out is None:
        out = empty_like(o_a, a.shape, a.dtype, "out")
    if out_lse is None:
        la = views(lse_a, "lse_a")
        out_lse = empty_like(lse_a, la.shape, L.DTYPE_F32, "out_lse")
    pointers = [views.ptr(x, n) for x, n in ((a, "o_a"), (lse_a, "lse_a"), (o_b, "o_b"), (lse_b, "lse_b"))]
    pointers += [views.out_ptr(out, "out"), views.out_ptr(out_lse, "out_lse")]
    check_same_device(views.named)
    L.call("sparsa_merge_states", ctx.handle, *pointers)
    return out, out_lse


def topk_from_scores(ctx, scores, k, block_size=1, out=None):
    """§7 the k best token ids (block_size 1) or block ids per (batch, head) of F32 scores [B, H, N], each row
    ascending. Returns int32 [B, H, k]."""
    views = _Views(ctx.stream)
    s = views(scores, "scores")
    if out is None:
        shape = s.shape[:-1] + (k,) if len(s.shape) == 3 else (k,)
        out = empty_like(scores, shape, L.DTYPE_I32, "out")
    L.call("sparsa_topk_from_scores", ctx.handle, s.pointer(), k, block_size, views.out_ptr(out, "out"))
    return out


def head_mapping(draft, target, k, out=None):
    """§7 STS head mapping on host traces draft F32 [T, Hd, N], target F32 [T, Ht, N]: int32 [Ht] draft head per
    target head."""
    views = _Views()
    d, t = views(draft, "draft"), views(target, "target")
    if out is None:
        out = empty_like(target, (t.shape[1] if len(t.shape) == 3 else 1,), L.DTYPE_I32, "out")
    L.call("sparsa_head_mapping", d.pointer(), t.pointer(), k, views.out_ptr(out, "out"))
    return out


def hilbert_permutation(t, h, w):
    """§4 the 3-D Hilbert order of a t×h×w token grid: (perm, inverse), numpy int32 arrays of t*h*w entries."""
    import numpy
    n = max(int(t) * int(h) * int(w), 0)
    perm, inverse = numpy.empty(n, numpy.int32), numpy.empty(n, numpy.int32)
    L.call("sparsa_hilbert_permutation", t, h, w, perm.ctypes.data, inverse.ctypes.data, perm.size)
    return perm, inverse


def drift_select_layers(h_in, h_out, delta=0.5, out_ratio=None, out_sparse=None):
    """§5 drift-based layer selection on host states [L, T, D]: (ratio F32 [L], sparse uint8 [L])."""
    views = _Views()
    a, b = views(h_in, "h_in"), views(h_out, "h_out")
    layers = (a.shape[0],)
    if out_ratio is None:
        out_ratio = empty_like(h_in, layers, L.DTYPE_F32, "out_ratio")
    if out_sparse is None:
        out_sparse = empty_like(h_in, layers, L.DTYPE_U8, "out_sparse")
    L.call("sparsa_drift_select_layers", a.pointer(), b.pointer(), delta, views.out_ptr(out_ratio, "out_ratio"),
           views.out_ptr(out_sparse, "out_sparse"))
    return out_ratio, out_sparse


def kv_prefetch(ctx, k_src, v_src, indices, k_dst, v_dst, positions=None, remapped=None, counts=None):
    """§7 gathers the K/V rows `indices` selects from host k_src/v_src [B, N, Hkv, D] into compact k_dst/v_dst
    [B, C, Hkv, D] on the context's device. Returns (positions [B, C], remapped [B, H_idx, k], counts [B]);
    rows of k_dst/v_dst past each union are untouched."""
    views = _Views(ctx.stream)
    kd, ix = views(k_dst, "k_dst", writable=True), views(indices, "indices")
    if positions is None:
        positions = empty_like(k_dst, kd.shape[:2], L.DTYPE_I32, "positions")
    if remapped is None:
        remapped = empty_like(k_dst, ix.shape, L.DTYPE_I32, "remapped")
    if counts is None:
        counts = empty_like(k_dst, kd.shape[:1], L.DTYPE_I32, "counts")
    pointers = [views.ptr(x, n) for x, n in ((k_src, "k_src"), (v_src, "v_src"), (ix, "indices"), (kd, "k_dst"))]
    pointers += [views.out_ptr(x, n) for x, n in ((v_dst, "v_dst"), (positions, "positions"), (remapped, "remapped"),
                                                  (counts, "counts"))]
    L.call("sparsa_kv_prefetch", ctx.handle, *pointers)
    return positions, remapped, counts


def sparge_tune(ctx, q, k, v, *, policy=None, causal=False, softmax_scale=0.0, cu_seqlens_q=None,
                cu_seqlens_k=None, l1=0.07, pv_l1=0.08, search_steps=10, dense_below=0.1, lambda_min=-20.0):
    """§4 tunes SPARGE per query head on one calibration call. Returns (params F32 [Hq, 4] ready for
    Sparge(head_params=...), metrics F32 [Hq, 2] = (relative L1, sparsity))."""
    if policy is not None and policy.KIND != L.POLICY_SPARGE:
        raise InvalidArgumentError("policy: sparge_tune needs a Sparge policy (or None for the defaults)")
    views = _Views(ctx.stream)
    q_view = views(q, "q")
    heads = q_view.shape[-2] if len(q_view.shape) >= 3 else 0
    params = empty_like(q, (heads, 4), L.DTYPE_F32, "params")
    metrics = empty_like(q, (heads, 2), L.DTYPE_F32, "metrics")
    args = _attention_args(views, ctx, q_view, k, v, None, None, causal, softmax_scale, cu_seqlens_q, cu_seqlens_k,
                           None, None, None, None, None, None)
    options = L.CSpargeTuneOptions()
    L.call("sparsa_sparge_tune_options_init", ctypes.byref(options), ctypes.sizeof(options))
    options.l1, options.pv_l1, options.search_steps = l1, pv_l1, search_steps
    options.dense_below, options.lambda_min = dense_below, lambda_min
    c_policy = policy.to_c(views.keep, ctx.stream) if policy is not None else None
    L.call("sparsa_sparge_tune", ctx.handle, ctypes.byref(args), ctypes.byref(c_policy) if c_policy else None,
           ctypes.byref(options), views.out_ptr(params, "params"), views.out_ptr(metrics, "metrics"))
    return params, metrics


# ---- Context-parallel TOKEN_SELECT (sparsa_cp_select_*; docs/context_parallel.md) ------------------------------
# Each step takes the shard's run arguments (q: every query row; k/v: this shard's keys) and kv_start / kv_total,
# int32 [B] host arrays: the global position of the shard's first key and the full KV length of each sequence.
# sparsa.distributed runs the whole protocol with torch.distributed (or any object with the same three collectives).

def _cp_select(function_name, ctx, q, k, v, policy, kv_start, kv_total, tensors, outputs, seq_lens_k, cu_seqlens_k,
               page_table, softmax_scale):
    views = _Views(ctx.stream)
    args = _attention_args(views, ctx, q, k, v, None, None, False, softmax_scale, None, cu_seqlens_k, page_table,
                           seq_lens_k, None, None, None, None)
    c_policy = policy.to_c(views.keep, ctx.stream)
    pointers = [views.ptr(kv_start, "kv_start"), views.ptr(kv_total, "kv_total")]
    pointers += [views.ptr(x, name) for x, name in tensors]
    pointers += [views.out_ptr(x, name) for x, name in outputs]
    L.call(function_name, ctx.handle, ctypes.byref(args), ctypes.byref(c_policy), *pointers)


def _n_sets(policy, k_view):
    return k_view.shape[-2] if policy.per_kv_head else 1


def cp_select_max(ctx, q, k, v, policy, kv_start, kv_total, *, out=None, seq_lens_k=None, cu_seqlens_k=None,
                  page_table=None, softmax_scale=0.0):
    """Step 1: float64 [B, Hq], the shard's largest selection score per head. Combine: element-wise max."""
    q_view = as_tensor(q, "q")
    if out is None:
        out = empty_like(q, (q_view.shape[0], q_view.shape[2]), L.DTYPE_F64, "out")
    _cp_select("sparsa_cp_select_max", ctx, q, k, v, policy, kv_start, kv_total, [], [(out, "out_max")],
               seq_lens_k, cu_seqlens_k, page_table, softmax_scale)
    return out


def cp_select_sum(ctx, q, k, v, policy, kv_start, kv_total, global_max, *, out=None, seq_lens_k=None,
                  cu_seqlens_k=None, page_table=None, softmax_scale=0.0):
    """Step 2: int64 [B, Hq, CP_SUM_DIGITS], the shard's part of each head's normaliser. Combine: element-wise
    int64 sum (any order gives the same normaliser)."""
    q_view = as_tensor(q, "q")
    if out is None:
        out = empty_like(q, (q_view.shape[0], q_view.shape[2], L.CP_SUM_DIGITS), L.DTYPE_I64, "out")
    _cp_select("sparsa_cp_select_sum", ctx, q, k, v, policy, kv_start, kv_total, [(global_max, "global_max")],
               [(out, "out_sum")], seq_lens_k, cu_seqlens_k, page_table, softmax_scale)
    return out


def cp_select_topk(ctx, q, k, v, policy, kv_start, kv_total, global_max, global_sum, *, out_votes=None,
                   out_positions=None, seq_lens_k=None, cu_seqlens_k=None, page_table=None, softmax_scale=0.0):
    """Step 3: (votes float64, positions int32) [B, n_sets, top_k], the shard's best candidates (-1 / -inf past
    its candidate count). Combine: all-gather to [G, B, n_sets, top_k]."""
    q_view, k_view = as_tensor(q, "q"), as_tensor(k, "k")
    shape = (q_view.shape[0], _n_sets(policy, k_view), policy.top_k)
    if out_votes is None:
        out_votes = empty_like(q, shape, L.DTYPE_F64, "out_votes")
    if out_positions is None:
        out_positions = empty_like(q, shape, L.DTYPE_I32, "out_positions")
    _cp_select("sparsa_cp_select_topk", ctx, q, k, v, policy, kv_start, kv_total,
               [(global_max, "global_max"), (global_sum, "global_sum")],
               [(out_votes, "out_votes"), (out_positions, "out_positions")], seq_lens_k, cu_seqlens_k, page_table,
               softmax_scale)
    return out_votes, out_positions


def cp_select_indices(ctx, q, k, v, policy, kv_start, kv_total, all_votes, all_positions, *, out=None, cap=None,
                      seq_lens_k=None, cu_seqlens_k=None, page_table=None, softmax_scale=0.0):
    """Step 4: int32 [B, n_sets, cap], this shard's part of the index set as local key ids (ascending, -1-padded),
    ready for TokenIndices(out). cap defaults to the shard's padded key count (k.shape[1])."""
    q_view, k_view = as_tensor(q, "q"), as_tensor(k, "k")
    if out is None:
        cap = cap if cap is not None else k_view.shape[1]
        out = empty_like(q, (q_view.shape[0], _n_sets(policy, k_view), cap), L.DTYPE_I32, "out")
    _cp_select("sparsa_cp_select_indices", ctx, q, k, v, policy, kv_start, kv_total,
               [(all_votes, "all_votes"), (all_positions, "all_positions")], [(out, "out_indices")], seq_lens_k,
               cu_seqlens_k, page_table, softmax_scale)
    return out
