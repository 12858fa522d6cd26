"""The Python binding (bindings/python) for the GPU benchmarks: its ctypes layer for bench_gpu.py's own calls, and
prepared runs for the area benchmark modules bench_<group>.py.

`c_api(path)` is sparsa._library loaded on the libsparsa at `path`: the header's structs (field by field, so no
script computes an offset), constants and typed functions. `prepared(...)` builds the attention arguments and the
policy struct once, as a serving engine would, and returns a zero-argument callable that only calls
sparsa_attention_run, so Python marshalling stays out of the timings. It uses the binding's argument builders
(sparsa.ops._attention_args, _Views) on the same libsparsa as bench_gpu.py.
"""
import ctypes
import os
import sys

_HERE = os.path.dirname(os.path.abspath(__file__))
_BINDING_DIR = os.path.join(_HERE, "..", "..", "bindings", "python")


def _package(path):
    """The sparsa Python package, loaded on the libsparsa at `path` (the first call decides the library)."""
    os.environ["SPARSA_LIBRARY"] = path
    if _BINDING_DIR not in sys.path:
        sys.path.insert(0, _BINDING_DIR)
    import sparsa  # noqa: E402  (path set just above)
    return sparsa


def c_api(path):
    """sparsa._library on the libsparsa at `path`: CTensor, CAttentionArgs, CPolicy, CContextOptions, the enums
    and `lib` with every function's argtypes."""
    _package(path)
    from sparsa import _library
    return _library


def binding(sp):
    """The sparsa Python package, loaded on the library `sp` (bench_gpu.Sparsa) was opened with."""
    return _package(sp.path)


def context(sp):
    """A context of the binding on `sp`'s device, on torch's current stream for CUDA (shared by every module of one
    benchmark run)."""
    if getattr(sp, "binding_ctx", None) is None:
        sparsa = binding(sp)
        if sp.device == "cuda":
            import torch
            sp.binding_ctx = sparsa.Context("cuda", stream=torch.cuda.current_stream().cuda_stream or None)
        else:
            sp.binding_ctx = sparsa.Context(sp.device)
    return sp.binding_ctx


def prepared(sp, q, k, v, out, policy, causal, **optional):
    """One run's callable: optional = lse, cu_seqlens_q, cu_seqlens_k, page_table, seq_lens_k, selection_cache,
    selected_indices, block_mask_out, stats (tensors or objects, as sparsa.attention takes them)."""
    sparsa = binding(sp)
    from sparsa import _library as L
    from sparsa import ops
    ctx = context(sp)
    names = ("lse", "cu_seqlens_q", "cu_seqlens_k", "page_table", "seq_lens_k", "selection_cache",
             "selected_indices", "block_mask_out", "stats")
    values = [optional.get(n) for n in names]
    views = ops._Views(ctx.stream)
    args = ops._attention_args(views, ctx, q, k, v, out, values[0], causal, 0.0, *values[1:])
    c_policy = policy.to_c(views.keep, ctx.stream)
    L.call("sparsa_attention_plan", ctx.handle, ctypes.byref(args), ctypes.byref(c_policy))
    run = L.lib.sparsa_attention_run
    handle, args_ref, policy_ref = ctx.handle, ctypes.byref(args), ctypes.byref(c_policy)

    def fn():
        status = run(handle, args_ref, policy_ref)
        if status != 0:
            sp.check(status, "attention_run")
    fn.keep = (views, args, c_policy)
    return fn, sparsa
