"""torch / cupy integration: DLPack views of their tensors, and the sparsa::attention custom op under torch.compile.
Skipped where torch (or a GPU, or cupy) is absent; runs on the GPU machine."""
import pytest

import sparsa

torch = pytest.importorskip("torch")
needs_custom_op = pytest.mark.skipif(sparsa.torch_ops is None, reason="torch older than 2.4: no custom_op")
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")

def _qkv(device="cpu"):
    generator = torch.Generator().manual_seed(0)
    shapes = ((1, 16, 4, 8), (1, 16, 2, 8), (1, 16, 2, 8))
    return [torch.randn(s, generator=generator).to(device) for s in shapes]


def test_torch_cpu_tensors_are_viewed_without_copy():
    q, _, _ = _qkv()
    view = sparsa.as_tensor(q[:, 2:], "q")
    assert view.data_ptr == q[:, 2:].data_ptr()
    assert view.shape == (1, 14, 4, 8) and view.dtype == sparsa.F32


def _descriptor(view):
    """What a descriptor means: a stride of a dimension of extent 0 or 1 is never used (exporters differ there)."""
    c = view.c
    strides = tuple(c.strides[i] if c.shape[i] > 1 else None for i in range(c.ndim))
    return (c.dtype, c.device_type, c.device_id, c.ndim, tuple(c.shape[:c.ndim]), strides, c.data or 0)


def _through_dlpack(x, name):
    """The DLPack path's view of x (what the attribute path must reproduce)."""
    from sparsa import tensor as sparsa_tensor
    return sparsa_tensor._from_capsule(x.__dlpack__(), name, x)


def test_torch_tensors_are_described_as_their_dlpack_capsule_describes_them():
    """Torch tensors are described from their attributes where no stream ordering is needed; the descriptor must be
    the DLPack capsule's for every layout, dtype and offset, and conjugated views (which DLPack refuses) must still
    take the DLPack path and fail there."""
    base = torch.arange(2 * 6 * 4 * 8, dtype=torch.float32).reshape(2, 6, 4, 8)
    cases = {
        "contiguous": base,
        "offset slice": base[:, 2:],
        "transposed": base.transpose(1, 2),
        "strided": base[:, ::2, :, 1::3],
        "scalar": torch.tensor(3.0),
        "bfloat16": base.to(torch.bfloat16),
        "float16": base.to(torch.float16)[1],
        "int32": base.to(torch.int32),
        "int64": base.to(torch.int64),
        "uint8": base.to(torch.uint8),
        "int8": base.to(torch.int8),
        "bool": base > 10,
        "requires grad": base.clone().requires_grad_(True),
        "empty": base[:, :0],
    }
    for name, x in cases.items():
        fast = sparsa.as_tensor(x, name)
        if x.requires_grad:
            x = x.detach()
        if x.dtype == torch.bool:  # as uint8 (older torch exports no bool through DLPack; newer ones as kDLBool)
            x = x.view(torch.uint8)
        assert _descriptor(fast) == _descriptor(_through_dlpack(x, name)), name
    conjugated = torch.ones(2, dtype=torch.complex64).conj()
    with pytest.raises(sparsa.DtypeError):
        sparsa.as_tensor(conjugated, "conjugated")


def _causal_attention(q, k, v):
    """torch's SDPA (torch >= 2.0), or the same softmax written out (Debian's torch 1.13 has no SDPA)."""
    q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
    if hasattr(torch.nn.functional, "scaled_dot_product_attention"):
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2)
    scores = (q @ k.transpose(-1, -2)) / q.shape[-1] ** 0.5
    future = torch.ones(q.shape[2], k.shape[2], dtype=torch.bool).triu(1)
    return (scores.masked_fill(future, float("-inf")).softmax(-1) @ v).transpose(1, 2)


def test_torch_cpu_attention_matches_sdpa():
    q, k, v = _qkv()
    with sparsa.Context() as ctx:
        out = sparsa.attention(ctx, q, k, v, causal=True)
    reference = _causal_attention(q, k.repeat_interleave(2, dim=2), v.repeat_interleave(2, dim=2))
    torch.testing.assert_close(out, reference, rtol=1e-4, atol=1e-5)


def test_bfloat16_tensors_pass_natively():
    q, k, v = (x.to(torch.bfloat16) for x in _qkv())
    with sparsa.Context() as ctx:
        out = sparsa.attention(ctx, q, k, v)
    assert out.dtype == torch.bfloat16


@needs_custom_op
def test_custom_op_keeps_one_graph_under_compile():
    q, k, v = _qkv()
    policy = sparsa.SinkWindow(sink_tokens=2, window=4)
    eager = sparsa.torch_ops.attention(q, k, v, policy=policy, causal=True)
    compiled = torch.compile(lambda a, b, c: sparsa.torch_ops.attention(a, b, c, policy=policy, causal=True) * 2,
                             fullgraph=True)
    torch.testing.assert_close(compiled(q, k, v), eager * 2)


@needs_custom_op
def test_custom_op_passes_opcheck():
    q, k, v = _qkv()
    fields = sparsa.Dense().scalar_fields()
    args = (q, k, v, True, 0.0, [float(fields[n]) for n in sparsa._library.POLICY_SCALAR_FIELDS], None, None, None,
            None)
    torch.library.opcheck(torch.ops.sparsa.attention.default, args,
                          test_utils=("test_schema", "test_faketensor", "test_aot_dispatch_static"))


@needs_cuda
def test_cuda_tensors_are_viewed_without_copy():
    q, _, _ = _qkv("cuda")
    view = sparsa.as_tensor(q, "q")
    assert view.device == (sparsa._library.DEVICE_CUDA, q.device.index or 0)
    assert view.data_ptr == q.data_ptr()


@needs_cuda
def test_cuda_tensors_on_a_cpu_context_are_refused():
    q, k, v = _qkv("cuda")
    with sparsa.Context() as ctx:
        with pytest.raises(sparsa.DeviceMismatchError):
            sparsa.attention(ctx, q, k, v)


@needs_cuda
def test_cupy_arrays_are_viewed_without_copy():
    cupy = pytest.importorskip("cupy")
    array = cupy.zeros((4, 8), dtype=cupy.float16)
    view = sparsa.as_tensor(array, "x")
    assert view.data_ptr == array.data.ptr and view.dtype == sparsa.F16
    assert view.device[0] == sparsa._library.DEVICE_CUDA


@needs_cuda
def test_cuda_context_runs_or_reports_backend_unavailable():
    try:
        ctx = sparsa.Context("cuda")
    except sparsa.BackendUnavailableError as err:
        pytest.skip(f"library built without CUDA: {err.message}")
    with ctx:
        q, k, v = _qkv("cuda")
        out = sparsa.attention(ctx, q, k, v, causal=True)
        torch.cuda.synchronize()
        with sparsa.Context() as cpu:
            expected = sparsa.attention(cpu, *(x.cpu() for x in (q, k, v)), causal=True)
        torch.testing.assert_close(out.cpu(), expected, rtol=2e-3, atol=2e-3)


@needs_cuda
@needs_custom_op
def test_custom_op_on_cuda_under_compile_uses_the_current_stream():
    try:
        sparsa.Context("cuda").close()
    except sparsa.BackendUnavailableError as err:
        pytest.skip(f"library built without CUDA: {err.message}")
    q, k, v = _qkv("cuda")
    policy = sparsa.SinkWindow(sink_tokens=2, window=4)
    side = torch.cuda.Stream()
    torch.cuda.synchronize()  # inputs were made on the default stream
    with torch.cuda.stream(side):
        compiled = torch.compile(lambda a, b, c: sparsa.torch_ops.attention(a, b, c, policy=policy, causal=True),
                                 fullgraph=True)
        out = compiled(q, k, v)
    side.synchronize()
    expected = sparsa.torch_ops.attention(q.cpu(), k.cpu(), v.cpu(), policy=policy, causal=True)
    torch.testing.assert_close(out.cpu(), expected, rtol=2e-3, atol=2e-3)
