"""Dense prefill of one libsparsa build against cuDNN and FlashAttention-2's outputs, in one process.

    python3 bench/gpu/compare_builds.py LIBSPARSA            (times bf16, B 1, H 32, D 128, N 4K and 16K, causal
                                                            and not: sparsa and cuDNN SDPA, one line per shape)
    python3 bench/gpu/compare_builds.py LIBSPARSA --profile  (one 16K non-causal launch, nothing timed: for ncu)

For comparing builds of the forward kernels: run it once per build, in separate processes (two copies of the
library share one soname, so a second one loaded into the same process would be the first), on the same card in
one device call, and compare each build's ratio to the cuDNN run beside it. The full benchmark with every peer is
bench_gpu.py.
"""
import os
import sys

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_gpu import Sparsa, bench, rel_err  # noqa: E402

B, H, D = 1, 32, 128


def main():
    lib = sys.argv[1]
    sp = Sparsa(lib)
    name = os.path.basename(lib)
    if "--profile" in sys.argv:
        q = torch.randn(B, 16384, H, D, device="cuda", dtype=torch.bfloat16)
        sp.prepare(q, torch.randn_like(q), torch.randn_like(q), torch.empty_like(q), False)()
        torch.cuda.synchronize()
        return
    for n in (4096, 16384):
        q = torch.randn(B, n, H, D, device="cuda", dtype=torch.bfloat16)
        k, v = torch.randn_like(q), torch.randn_like(q)
        qt, kt, vt = (x.transpose(1, 2) for x in (q, k, v))  # [B, H, N, D] views for SDPA
        for causal in (False, True):
            flops = 4 * n * n * H * D * B / (2 if causal else 1)
            with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
                ref = F.scaled_dot_product_attention(qt, kt, vt, is_causal=causal).transpose(1, 2)
            with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
                cudnn = bench(lambda: F.scaled_dot_product_attention(qt, kt, vt, is_causal=causal))
            out = torch.full_like(q, float("nan"))  # poisoned: a row the kernel skips shows up in the error
            fn = sp.prepare(q, k, v, out, causal)
            fn()
            ms = bench(fn)
            print(f"N={n} causal={int(causal)} cudnn {cudnn:.3f} ms ({flops / cudnn / 1e9:.0f} TFLOP/s) | {name} "
                  f"{ms:.3f} ms ({flops / ms / 1e9:.0f} TFLOP/s) {cudnn / ms:.2f}x cuDNN, rel. err. vs FA2 "
                  f"{rel_err(out, ref):.1e}", flush=True)


if __name__ == "__main__":
    main()
