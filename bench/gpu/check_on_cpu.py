"""A CPU check of the GPU benchmark scripts, for machines without a GPU (or torch):

    python3 check_on_cpu.py path/to/libsparsa.so path/to/bench/gpu

Every script must import (torch and triton are replaced by stubs, so only the scripts' own code is checked), and the
paths that build the C structs (bench_gpu.Sparsa.prepare, bench_select.SelectRunner, bench_sparge.sparge_call,
binding_runs.prepared) build them through the Python binding's ctypes layer and run one small call each on a CPU
context over numpy-backed tensors (V = 1, so every output element must be 1). Run by the Python binding's tests
(bindings/python/tests/test_bench_scripts.py).
"""
import importlib
import sys
import types
from unittest import mock

import numpy

lib_path, bench_dir = sys.argv[1], sys.argv[2]
for name in ("torch", "torch.nn", "torch.nn.functional", "torch.nn.attention", "torch.nn.attention.flex_attention",
             "torch.profiler", "triton", "triton.testing"):
    sys.modules[name] = mock.MagicMock(name=name)
sys.path.insert(0, bench_dir)

for module in ("binding_runs", "bench_gpu", "bench_select", "bench_sparge", "bench_tsparse", "bench_delta",
               "profile_sparge", "profile_decode"):
    importlib.import_module(module)
    print("imports:", module)

import bench_gpu  # noqa: E402
import bench_select  # noqa: E402
import bench_sparge  # noqa: E402
import binding_runs  # noqa: E402

BF16_ONE = 0x3F80


class CpuTensor:
    """The slice of torch.Tensor the scripts read, over a numpy array (bf16 as uint16 bit patterns)."""

    def __init__(self, array):
        self.array = array
        self.shape = array.shape
        self.device = types.SimpleNamespace(type="cpu", index=None)

    def dim(self):
        return self.array.ndim

    def stride(self, i):
        return self.array.strides[i] // self.array.itemsize

    def data_ptr(self):
        return self.array.ctypes.data


B, N, H, D = 1, 64, 2, 8
sp = bench_gpu.Sparsa(lib_path, device="cpu")
ones = lambda shape, dt=numpy.uint16, v=BF16_ONE: CpuTensor(numpy.full(shape, v, dt))  # noqa: E731
q, k, v = ones((B, N, H, D)), ones((B, N, H, D)), ones((B, N, H, D))


def check_out(out, what):
    assert (out.array == BF16_ONE).all(), f"{what}: V = 1 everywhere, so every output element must be 1"
    print("runs:", what)


for kind, extra in ((sp.L.POLICY_DENSE, {}), (sp.L.POLICY_SINK_WINDOW, dict(sink=(4, 16))),
                    (sp.L.POLICY_BLOCK_SPARSE, dict(mask=ones((B, H, 1, 1), numpy.uint8, 1), block=(64, 64))),
                    (sp.L.POLICY_TOKEN_INDICES, dict(indices=CpuTensor(numpy.tile(numpy.arange(4, dtype=numpy.int32), B * H)
                                                                       .reshape(B, H, 4))))):
    out = ones((B, N, H, D), v=0)
    sp.prepare(q, k, v, out, True, kind=kind, **extra)()
    check_out(out, f"bench_gpu.Sparsa.prepare kind {kind}")
    assert sp.new_policy(kind).kind == kind

out = ones((B, N, H, D), v=0)
mask = ones((B, H, 1, 1), numpy.uint8, 0)
bench_sparge.sparge_call(sp, q, k, v, out, mask, 0.5)()
check_out(out, "bench_sparge.sparge_call (SPARGE)")

q1, out1 = ones((B, 1, H, D)), ones((B, 1, H, D), v=0)
selected = ones((B, 1, bench_select.N_INIT + bench_select.TOP_K + bench_select.N_LOCAL), numpy.int32, 0)
kd = ones((B, 4096, H, D))
runner = bench_select.SelectRunner(sp, q1, kd, kd, out1, selected)
assert runner.policy.select_top_k == bench_select.TOP_K and abs(runner.policy.select_cache_theta - 0.9) < 1e-6
runner.run()
runner.run()
check_out(out1, "bench_select.SelectRunner (TOKEN_SELECT with a cache)")
assert runner.counts() == (1, 1), runner.counts()
runner.close()

sparsa = binding_runs.binding(sp)
qf = numpy.ones((B, N, H, D), numpy.float32)
outf = numpy.zeros_like(qf)
fn, _ = binding_runs.prepared(sp, qf, qf, qf, outf, sparsa.SinkWindow(sink_tokens=4, window=16), True)
fn()
assert (outf == 1).all()
print("runs: binding_runs.prepared (SINK_WINDOW)")
print("bench/gpu CPU check: OK")
