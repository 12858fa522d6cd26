"""Where the decode paths' time goes, kernel by kernel (torch.profiler), beside the copy bandwidth of the same bytes:

    python3 profile_decode.py LIB              per-kernel device time of dense decode (sparsa, cuDNN) at 128K and
                                               of TOKEN_SELECT miss / hit steps at 128K and 1M (bench_select.py's
                                               shapes: bf16, GQA 32/8, D = 128, B = 1)
    python3 profile_decode.py LIB --ncu        one launch of each, nothing timed (for ncu -k ...)
    python3 profile_decode.py LIB --dense      dense decode only (sparsa, cuDNN, the copy)

bench_gpu.py / bench_select.py time the same configurations against the peers; this script only explains them.
"""
import sys

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.profiler import ProfilerActivity, profile

from bench_gpu import Sparsa
from bench_select import N_INIT, N_LOCAL, TOP_K, SelectRunner

STEPS = 20  # profiled repetitions of each step (after a warm-up)


def kernel_table(label, step):
    """Runs `step` STEPS times under the profiler and prints each kernel's mean device time per step."""
    step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(STEPS):
            step()
        torch.cuda.synchronize()
    totals = {}
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            totals[event.name] = totals.get(event.name, 0.0) + event.device_time
    total = sum(totals.values()) / STEPS
    print(f"--- {label}: {total:.1f} us of kernels per step")
    for name, us in sorted(totals.items(), key=lambda item: -item[1]):
        print(f"  {us / STEPS:8.1f} us  {name[:110]}")


def main():
    sp = Sparsa(sys.argv[1])
    ncu = "--ncu" in sys.argv
    dense_only = "--dense" in sys.argv
    B, H, Hkv, D = 1, 32, 8, 128
    for N in (131072, 1048576):
        torch.manual_seed(0)
        q = torch.randn(B, 1, H, D, device="cuda", dtype=torch.bfloat16)
        q_first, q_other = q.clone(), torch.randn_like(q)
        k = torch.randn(B, N, Hkv, D, device="cuda", dtype=torch.bfloat16)
        v = torch.randn_like(k)
        out = torch.empty_like(q)
        selected = torch.full((B, 1, N_INIT + TOP_K + N_LOCAL), -7, device="cuda", dtype=torch.int32)
        dense = sp.prepare(q, k, v, out, True)
        runner = SelectRunner(sp, q, k, v, out, selected)
        qt, kt, vt = (x.transpose(1, 2) for x in (q, k, v))
        state = {"flip": False}

        def miss():
            state["flip"] = not state["flip"]
            q.copy_(q_other if state["flip"] else q_first)
            runner.run()

        def hit():
            runner.run()

        def cudnn():
            with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
                F.scaled_dot_product_attention(qt, kt, vt, enable_gqa=True)
        if ncu:
            for step in (dense, miss, cudnn):
                step()
            torch.cuda.synchronize()
        else:
            copy_dst = torch.empty_like(k)
            kernel_table(f"copy of K ({k.numel() * 2 / 1e6:.0f} MB read + written)", lambda: copy_dst.copy_(k))
            del copy_dst
            kernel_table(f"sparsa dense decode N={N}", dense)
            kernel_table(f"cuDNN dense decode N={N}", cudnn)
            if dense_only:
                runner.close()
                continue
            kernel_table(f"TOKEN_SELECT miss N={N} (q copy included)", miss)
            q.copy_(q_first)
            runner.run()
            kernel_table(f"TOKEN_SELECT hit N={N}", hit)
        runner.close()
        del q, q_first, q_other, k, v, out, qt, kt, vt
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
