"""Where users call the torch op on a GPU: CUDA tensors on torch's default stream, on a side stream, under
torch.compile(fullgraph=True) and inside CUDA-graph capture. Each GPU case compares with the CPU backend's result.

The DLPack stream rule (the array API's __dlpack__): on CUDA, None or 1 is the legacy default stream, 2 the
per-thread default stream, and 0 is forbidden; torch's `current_stream().cuda_stream` is 0 on the default stream, so
the binding must translate it. The first tests check that translation without a GPU; the rest need torch built with
CUDA, a CUDA device and a libsparsa built with its CUDA backend, and skip (saying which is missing) elsewhere.
"""
import numpy as np
import pytest

import sparsa
from sparsa import _library as L
from sparsa.tensor import as_tensor, dlpack_stream

CUDA_LEGACY_DEFAULT, CUDA_PER_THREAD_DEFAULT = 1, 2
SIDE_STREAM_HANDLE = 0x7F00_1234_5670

# (device type, raw stream handle given to sparsa, DLPack code expected in __dlpack__(stream=...))
STREAM_CODE_CASES = [
    (L.DEVICE_CUDA, None, CUDA_LEGACY_DEFAULT),
    (L.DEVICE_CUDA, 0, CUDA_LEGACY_DEFAULT),  # torch's default stream: never hand 0 on
    (L.DEVICE_CUDA, 1, CUDA_LEGACY_DEFAULT),
    (L.DEVICE_CUDA, 2, CUDA_PER_THREAD_DEFAULT),
    (L.DEVICE_CUDA, SIDE_STREAM_HANDLE, SIDE_STREAM_HANDLE),
    (L.DEVICE_ROCM, None, None),
    (L.DEVICE_ROCM, 0, 0),  # ROCm's DLPack code for the default stream is 0
    (L.DEVICE_ROCM, SIDE_STREAM_HANDLE, SIDE_STREAM_HANDLE),
]


@pytest.mark.parametrize("device_type,raw,expected", STREAM_CODE_CASES)
def test_dlpack_stream_code_follows_the_standard(device_type, raw, expected):
    assert dlpack_stream(device_type, raw) == expected


class _RecordingGpuArray:
    """A DLPack producer that says it lives on a GPU and records the consumer stream it is asked for (its capsule
    is a numpy array's, so the view can still be built without a GPU)."""

    def __init__(self, device_type):
        self.device_type, self.streams = device_type, []
        self.array = np.zeros((2, 3), dtype=np.float32)

    def __dlpack_device__(self):
        return (self.device_type, 0)

    def __dlpack__(self, stream=None):
        if self.device_type == L.DEVICE_CUDA and stream == 0:
            raise AssertionError("unsupported stream on CUDA: 0")  # what torch does
        self.streams.append(stream)
        return self.array.__dlpack__()


@pytest.mark.parametrize("raw,expected", [(None, CUDA_LEGACY_DEFAULT), (0, CUDA_LEGACY_DEFAULT),
                                          (SIDE_STREAM_HANDLE, SIDE_STREAM_HANDLE)])
def test_as_tensor_hands_dlpack_a_legal_cuda_stream(raw, expected):
    producer = _RecordingGpuArray(L.DEVICE_CUDA)
    as_tensor(producer, "q", stream=raw)
    assert producer.streams == [expected]


# ---- On a GPU -----------------------------------------------------------------------------------------------------

try:  # not importorskip: that would skip the GPU-free tests above too
    import torch
except ImportError:
    torch = None
_why_no_gpu = None
if torch is None:
    _why_no_gpu = "torch is not installed (these cases need torch with CUDA)"
elif sparsa.torch_ops is None:
    _why_no_gpu = "torch older than 2.4 (no torch.library.custom_op): sparsa.torch_ops is disabled"
elif not torch.cuda.is_available():
    _why_no_gpu = "torch sees no CUDA device"
elif getattr(torch.version, "hip", None):
    _why_no_gpu = "torch is a ROCm build; these cases are written for CUDA streams and CUDA graphs"
else:
    try:
        sparsa.Context("cuda").close()
    except sparsa.BackendUnavailableError as err:
        _why_no_gpu = f"libsparsa was built without its CUDA backend ({err.message})"
needs_gpu = pytest.mark.skipif(_why_no_gpu is not None, reason=_why_no_gpu or "")

POLICIES = {
    "dense": lambda: sparsa.Dense(),
    "sink_window": lambda: sparsa.SinkWindow(sink_tokens=4, window=32),
}
SHAPE_Q, SHAPE_KV = (2, 128, 8, 64), (2, 128, 2, 64)  # GQA 8:2, bf16
TOLERANCE = dict(rtol=2e-2, atol=2e-2)  # bf16 outputs against the CPU backend's bf16 outputs


def _qkv():
    generator = torch.Generator().manual_seed(12)
    make = lambda shape: torch.randn(shape, generator=generator).to(torch.bfloat16)  # noqa: E731
    return make(SHAPE_Q), make(SHAPE_KV), make(SHAPE_KV)


def _expected(q, k, v, policy):
    return sparsa.torch_ops.attention(q, k, v, policy=policy, causal=True).float()


@needs_gpu
@pytest.mark.parametrize("policy_name", sorted(POLICIES))
def test_op_on_the_default_stream(policy_name):
    policy = POLICIES[policy_name]()
    q, k, v = _qkv()
    assert torch.cuda.current_stream().cuda_stream == 0  # the case that used to raise in __dlpack__
    out = sparsa.torch_ops.attention(q.cuda(), k.cuda(), v.cuda(), policy=policy, causal=True)
    torch.cuda.synchronize()
    torch.testing.assert_close(out.float().cpu(), _expected(q, k, v, policy), **TOLERANCE)


@needs_gpu
def test_op_on_a_side_stream_orders_after_the_inputs():
    policy = POLICIES["sink_window"]()
    q, k, v = _qkv()
    side = torch.cuda.Stream()
    qc, kc, vc = q.cuda(), k.cuda(), v.cuda()  # written on the default stream; no synchronize on purpose:
    side.wait_stream(torch.cuda.current_stream())  # the caller orders the streams as torch requires
    with torch.cuda.stream(side):
        out = sparsa.torch_ops.attention(qc, kc, vc, policy=policy, causal=True)
        out_sum = out.float().sum()  # a torch op on the same stream consumes the output
    side.synchronize()
    torch.testing.assert_close(out.float().cpu(), _expected(q, k, v, policy), **TOLERANCE)
    assert torch.isfinite(out_sum).item()


@needs_gpu
@pytest.mark.parametrize("on_side_stream", [False, True])
def test_op_under_compile_fullgraph(on_side_stream):
    policy = POLICIES["sink_window"]()
    q, k, v = _qkv()
    qc, kc, vc = q.cuda(), k.cuda(), v.cuda()
    compiled = torch.compile(lambda a, b, c: sparsa.torch_ops.attention(a, b, c, policy=policy, causal=True) * 2,
                             fullgraph=True)
    if on_side_stream:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            out = compiled(qc, kc, vc)
        side.synchronize()
    else:
        out = compiled(qc, kc, vc)
        torch.cuda.synchronize()
    torch.testing.assert_close(out.float().cpu(), _expected(q, k, v, policy) * 2, **TOLERANCE)


@needs_gpu
def test_op_inside_cuda_graph_capture_replays_on_new_inputs():
    policy = POLICIES["sink_window"]()
    q, k, v = _qkv()
    static_q, static_k, static_v = q.cuda(), k.cuda(), v.cuda()
    warmup = torch.cuda.Stream()  # torch's recipe: warm up (scratch allocation, contexts) outside the capture
    warmup.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(warmup):
        for _ in range(2):
            sparsa.torch_ops.attention(static_q, static_k, static_v, policy=policy, causal=True)
    torch.cuda.current_stream().wait_stream(warmup)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = sparsa.torch_ops.attention(static_q, static_k, static_v, policy=policy, causal=True)
    q2, k2, v2 = (x.flip(1).contiguous() for x in (q, k, v))  # new values in the same buffers
    static_q.copy_(q2)
    static_k.copy_(k2)
    static_v.copy_(v2)
    static_out.fill_(float("nan"))  # poison: the replay must overwrite every element
    graph.replay()
    torch.cuda.synchronize()
    torch.testing.assert_close(static_out.float().cpu(), _expected(q2, k2, v2, policy), **TOLERANCE)
