"""The Python API beyond the shared vectors: struct layouts, defaults, zero copy, errors, handles, the README."""
import ctypes
import gc
import math
import os
import re
import struct
import sys

import numpy
import pytest

import sparsa
from sparsa import _library as L

README = os.path.join(os.path.dirname(__file__), "..", "README.md")


@pytest.fixture
def ctx():
    with sparsa.Context(num_threads=2) as context:
        yield context


def _qkv(b=1, s=16, hq=4, hkv=2, d=8, dtype=numpy.float32, seed=0):
    rng = numpy.random.default_rng(seed)
    q = rng.standard_normal((b, s, hq, d)).astype(dtype)
    k = rng.standard_normal((b, s, hkv, d)).astype(dtype)
    v = rng.standard_normal((b, s, hkv, d)).astype(dtype)
    return q, k, v


def _reference(q, k, v, causal):
    """float64 softmax attention with bottom-right causal alignment and GQA (ALGORITHMS.md §0)."""
    b, sq, hq, d = q.shape
    skv, hkv = k.shape[1], k.shape[2]
    out = numpy.zeros(q.shape)
    for h in range(hq):
        kh = h // (hq // hkv)
        scores = numpy.einsum("bid,bjd->bij", q[:, :, h].astype(numpy.float64), k[:, :, kh]) / math.sqrt(d)
        if causal:
            allowed = numpy.arange(skv)[None, :] <= numpy.arange(sq)[:, None] + (skv - sq)
            scores = numpy.where(allowed, scores, -numpy.inf)
        p = numpy.exp(scores - scores.max(axis=-1, keepdims=True))
        out[:, :, h] = numpy.einsum("bij,bjd->bid", p / p.sum(axis=-1, keepdims=True), v[:, :, kh])
    return out


# ---- Layouts and defaults agree with the C library ------------------------------------------------------------

def test_struct_sizes_match_the_library():
    """The ctypes layouts are the header's (no tail padding, at least the 0.1 sizes); each *_init takes the
    binding's sizeof, writes it into struct_size, and refuses a size below sparsa 0.1's."""
    shape = (ctypes.c_int64 * 1)(4)
    for cls, first_size, init in (
            (L.CPolicy, L.POLICY_SIZE_V0_1, lambda p, n: L.lib.sparsa_policy_init(p, n, 0)),
            (L.CAttentionArgs, L.ATTENTION_ARGS_SIZE_V0_1, L.lib.sparsa_attention_args_init),
            (L.CContextOptions, L.CONTEXT_OPTIONS_SIZE_V0_1, L.lib.sparsa_context_options_init),
            (L.CSpargeTuneOptions, L.SPARGE_TUNE_OPTIONS_SIZE_V0_1, L.lib.sparsa_sparge_tune_options_init),
            (L.CTensor, L.TENSOR_SIZE_V0_1,
             lambda t, n: L.lib.sparsa_tensor_init(t, n, None, sparsa.F32, 1, shape))):
        last_name, last_type = cls._fields_[-1]
        assert ctypes.sizeof(cls) == getattr(cls, last_name).offset + ctypes.sizeof(last_type), cls.__name__
        assert ctypes.sizeof(cls) >= first_size and ctypes.sizeof(cls) % 8 == 0, cls.__name__
        c = cls()
        assert init(ctypes.byref(c), ctypes.sizeof(cls)) == 0
        assert c.struct_size == ctypes.sizeof(cls), cls.__name__
        assert init(ctypes.byref(c), first_size - 4) == sparsa.StructSizeError.status, cls.__name__
        assert c.struct_size == ctypes.sizeof(cls), "a refused init wrote the struct"


def test_newer_callers_unknown_tail_must_be_zero():
    """A policy from a newer caller (bigger struct) runs when its unknown tail is zero and is refused otherwise."""
    tail = 16

    class NewerPolicy(ctypes.Structure):
        _fields_ = [("known", L.CPolicy), ("tail", ctypes.c_uint8 * tail)]

    newer = NewerPolicy()
    policy = ctypes.cast(ctypes.pointer(newer), ctypes.POINTER(L.CPolicy))
    L.call("sparsa_policy_init", policy, ctypes.sizeof(newer), L.POLICY_DENSE)
    assert newer.known.struct_size == ctypes.sizeof(L.CPolicy) + tail and bytes(newer.tail) == bytes(tail)
    q = numpy.ones((1, 2, 1, 4), numpy.float32)
    out = numpy.zeros_like(q)
    views = sparsa.ops._Views()
    args = L.CAttentionArgs()
    L.call("sparsa_attention_args_init", ctypes.byref(args), ctypes.sizeof(args))
    args.q = args.k = args.v = views(q, "q").pointer()
    args.out = views.out_ptr(out, "out")
    with sparsa.Context() as ctx:
        L.call("sparsa_attention_run", ctx.handle, ctypes.byref(args), policy)
        assert numpy.array_equal(out, q)
        newer.tail[3] = 1
        with pytest.raises(sparsa.StructSizeError, match="sparsa_policy"):
            L.call("sparsa_attention_run", ctx.handle, ctypes.byref(args), policy)


@pytest.mark.parametrize("policy", [sparsa.Dense(), sparsa.SinkWindow(), sparsa.BlockSparse(None), sparsa.Sparge(),
                                    sparsa.TokenSparse(), sparsa.TokenSelect(), sparsa.TokenIndices(None)],
                         ids=lambda p: type(p).__name__)
def test_keyword_defaults_are_the_library_defaults(policy):
    c = L.CPolicy()
    L.call("sparsa_policy_init", ctypes.byref(c), ctypes.sizeof(c), policy.KIND)
    for name, value in policy.scalar_fields().items():
        expected = getattr(c, name)
        assert struct.pack("<f" if name in L.POLICY_FLOAT_FIELDS else "<q", value) == \
            struct.pack("<f" if name in L.POLICY_FLOAT_FIELDS else "<q", expected), name


def test_delta_sets_the_flag_and_fields():
    fields = sparsa.SinkWindow(delta=sparsa.Delta(gamma=16, tail_min=32)).scalar_fields()
    assert fields["flags"] & L.POLICY_FLAG_DELTA
    assert (fields["delta_gamma"], fields["delta_tail_min"]) == (16, 32)


def test_version():
    assert sparsa.version() == tuple(int(x) for x in sparsa.__version__.split("."))


# ---- Zero copy --------------------------------------------------------------------------------------------------

def test_dlpack_views_share_memory_and_strides():
    base = numpy.arange(2 * 6 * 3 * 8, dtype=numpy.float32).reshape(2, 6, 3, 8)
    view = base[:, 1:5]  # a strided slice
    t = sparsa.as_tensor(view, "x")
    assert t.data_ptr == view.ctypes.data
    assert t.shape == view.shape
    assert [t.c.strides[i] for i in range(4)] == [s // 4 for s in view.strides]
    assert t.dtype == sparsa.F32


def test_output_is_written_in_place(ctx):
    q, k, v = _qkv()
    out = numpy.full(q.shape, numpy.nan, dtype=numpy.float32)
    returned = sparsa.attention(ctx, q, k, v, out, causal=True)
    assert returned is out
    numpy.testing.assert_allclose(out, _reference(q, k, v, True), rtol=1e-4, atol=1e-5)


def test_strided_inputs_match_contiguous(ctx):
    q, k, v = _qkv(s=12)
    wide = numpy.zeros((1, 12, 4, 16), numpy.float32)
    wide[..., :8] = q
    strided = sparsa.attention(ctx, wide[..., :8], k, v, causal=False)
    numpy.testing.assert_array_equal(strided, sparsa.attention(ctx, q, k, v, causal=False))


def test_read_only_inputs_are_read_in_place_and_read_only_outputs_refused(ctx):
    q, k, v = _qkv()
    expected = sparsa.attention(ctx, q, k, v, causal=True)
    for array in (q, k, v):
        array.flags.writeable = False
    assert sparsa.as_tensor(q, "q").data_ptr == q.ctypes.data
    numpy.testing.assert_array_equal(sparsa.attention(ctx, q, k, v, causal=True), expected)
    frozen = numpy.zeros_like(q)
    frozen.flags.writeable = False
    with pytest.raises(sparsa.InvalidArgumentError):
        sparsa.attention(ctx, q, k, v, frozen)


def test_views_release_their_capsule():
    """The capsule we read (never renamed) frees the DLManagedTensor and its array reference when dropped."""
    array = numpy.zeros((4, 4), numpy.float32)
    baseline = sys.getrefcount(array)
    for _ in range(100):
        sparsa.as_tensor(array, "x")
    gc.collect()
    assert sys.getrefcount(array) == baseline


def test_float16_and_bfloat16_inputs(ctx):
    q, k, v = _qkv()
    half = sparsa.attention(ctx, q.astype(numpy.float16), k.astype(numpy.float16), v.astype(numpy.float16))
    assert half.dtype == numpy.float16
    to_bf16 = lambda x: sparsa.Reinterpret((x.view(numpy.uint32) >> 16).astype(numpy.uint16), sparsa.BF16)
    bf = sparsa.attention(ctx, to_bf16(q), to_bf16(k), to_bf16(v))
    assert isinstance(bf, sparsa.Reinterpret) and bf.base.dtype == numpy.uint16


# ---- Errors -----------------------------------------------------------------------------------------------------

def test_dtype_mismatch_raises_dtype_error_with_the_c_message(ctx):
    q, k, v = _qkv()
    with pytest.raises(sparsa.DtypeError) as raised:
        sparsa.attention(ctx, q, k.astype(numpy.float16), v)
    err = raised.value
    assert err.status == 3 and isinstance(err, TypeError)
    assert err.function == "sparsa_attention_run" and err.message


def test_wrong_size_raises_shape_error(ctx):
    q, k, v = _qkv()
    out = numpy.zeros((1, 16, 4, 4), numpy.float32)
    with pytest.raises(sparsa.ShapeError) as raised:
        sparsa.attention(ctx, q, k, v, out)
    assert raised.value.status == 4 and "out" in raised.value.message
    assert not out.any()  # nothing written on failure


def test_index_out_of_range_raises(ctx):
    q, k, v = _qkv(s=8)
    indices = numpy.array([[[0, 3, 8]]], numpy.int32)  # 8 == N
    with pytest.raises(sparsa.IndexOutOfRangeError) as raised:
        sparsa.attention(ctx, q, k, v, policy=sparsa.TokenIndices(indices))
    assert raised.value.status == 5 and isinstance(raised.value, IndexError)


def test_unsupported_output_raises(ctx):
    q, k, v = _qkv()
    with pytest.raises(sparsa.UnsupportedError):
        sparsa.attention(ctx, q, k, v, selected_indices=numpy.zeros((1, 4, 16), numpy.int32))


def test_invalid_argument(ctx):
    q, k, v = _qkv()
    with pytest.raises(sparsa.InvalidArgumentError):
        sparsa.attention(ctx, q, k, v, policy=sparsa.SinkWindow(sink_tokens=-1))


def test_non_dlpack_input_is_refused_before_the_call(ctx):
    q, k, v = _qkv()
    with pytest.raises(sparsa.DtypeError) as raised:
        sparsa.attention(ctx, q.tolist(), k, v)
    assert raised.value.function is None and "q" in raised.value.message


def test_unknown_backend_raises_backend_unavailable():
    with pytest.raises(sparsa.Error) as raised:
        sparsa.Context(device=99)
    assert raised.value.status in (1, 9)


# ---- Handles ----------------------------------------------------------------------------------------------------

def test_closing_a_context_twice_is_safe():
    context = sparsa.Context()
    context.close()
    context.close()
    assert context.closed
    q, k, v = _qkv()
    with pytest.raises(sparsa.Error):
        sparsa.attention(context, q, k, v)


def test_closing_the_context_closes_its_caches_first():
    context = sparsa.Context()
    cache = sparsa.SelectionCache(context, 1, 4, 2, 8, 4)
    context.close()
    with pytest.raises(sparsa.Error):
        cache.counts()
    cache.close()


def test_with_block_closes():
    with sparsa.Context() as context:
        assert context.device_type == L.DEVICE_CPU
    assert context.closed


def test_selection_cache_counts_hits(ctx):
    q, k, v = _qkv(b=1, s=1, hq=4, hkv=2, d=8)
    k = numpy.random.default_rng(1).standard_normal((1, 64, 2, 8)).astype(numpy.float32)
    v = k.copy()
    policy = sparsa.TokenSelect(n_init=2, n_local=4, top_k=4)
    with sparsa.SelectionCache(ctx, 1, 4, 2, 8, 4) as cache:
        for _ in range(3):
            sparsa.attention(ctx, q, k, v, policy=policy, selection_cache=cache)
        assert cache.counts() == (2, 1)
        cache.reset()
        assert cache.counts() == (0, 0)
        cache.close()
        cache.close()


def test_hilbert_permutation_is_a_permutation():
    perm, inverse = sparsa.hilbert_permutation(2, 3, 5)
    assert sorted(perm) == list(range(30))
    assert (inverse[perm] == numpy.arange(30)).all()


def test_lse_and_stats_outputs(ctx):
    q, k, v = _qkv()
    result = sparsa.attention(ctx, q, k, v, causal=True, lse=True, stats=True)
    assert result.lse.shape == (1, 4, 16) and result.stats.shape == (sparsa.STAT_COUNT,)
    assert result.stats[sparsa.STAT_PAIRS_COMPUTED] == result.stats[sparsa.STAT_PAIRS_DENSE]
    plain = sparsa.attention(ctx, q, k, v, causal=True, lse=False, stats=False)  # False asks for none, like None
    assert isinstance(plain, numpy.ndarray) and numpy.array_equal(plain, result.out)


# ---- README -----------------------------------------------------------------------------------------------------

def test_readme_example_runs(capsys):
    with open(README) as f:
        blocks = re.findall(r"```python\n(.*?)```", f.read(), re.S)
    assert blocks
    exec(compile(blocks[0], "README.md", "exec"), {})
    printed = capsys.readouterr().out
    assert "sparsity" in printed and "refused:" in printed


def test_sparge_tune_returns_parameters_the_policy_runs_with(ctx):
    # A local band (each query matches the keys near it) so the tuner finds block sparsity.
    s, hq, d = 256, 2, 16
    t = numpy.arange(s)[:, None] / 32.0 + numpy.arange(d)[None, :]
    k = numpy.sin(0.7 * t).astype(numpy.float32)[None, :, None, :]
    q = numpy.repeat(3.0 * k, hq, axis=2).astype(numpy.float32)
    v = numpy.random.default_rng(3).standard_normal((1, s, 1, d)).astype(numpy.float32)
    params, metrics = sparsa.sparge_tune(ctx, q, k, v, policy=sparsa.Sparge(block_q=32, block_k=16))
    assert params.shape == (hq, 4) and metrics.shape == (hq, 2)
    assert not numpy.isnan(params).any()
    assert ((params[:, 0] >= -1) & (params[:, 0] <= 1)).all()
    assert (metrics[:, 0] <= 0.08 + 1e-6).all()
    out = sparsa.attention(ctx, q, k, v, policy=sparsa.Sparge(block_q=32, block_k=16, head_params=params))
    assert out.shape == q.shape and numpy.isfinite(out).all()


def test_attention_plan_then_run_grows_no_scratch(ctx):
    q, k, v = _qkv(s=64)
    out = numpy.empty_like(q)
    sparsa.attention_plan(ctx, q, k, v, out, causal=True)
    planned = ctx.scratch_bytes
    sparsa.attention(ctx, q, k, v, out=out, causal=True)
    assert ctx.scratch_bytes == planned
