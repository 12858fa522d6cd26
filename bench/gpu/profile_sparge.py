"""One SPARGE run at N=32K, density 0.5 (bf16, H=32, D=128, block 128×64), unquantized and quantized, for ncu:

    ncu -k regex:'sage_attention|forward_mma|forward_wgmma' --launch-count 2 ... python3 profile_sparge.py LIB

Nothing is timed by default; bench_sparge.py times the same configuration against FlexAttention. With
`--kernels`, the torch profiler prints each kernel's time over three runs of each path instead.
"""
import sys

import torch

from bench_gpu import Sparsa
from bench_sparge import sparge_call


def main():
    sp = Sparsa(sys.argv[1])
    B, N, H, D = 1, 32768, 32, 128
    g = torch.Generator(device="cuda").manual_seed(1)
    q, k, v = (torch.randn(B, N, H, D, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(3))
    out = torch.empty_like(q)
    mask = torch.zeros(B, H, N // 128, N // 64, device="cuda", dtype=torch.uint8)
    calls = [sparge_call(sp, q, k, v, out, mask, 0.5, quantized=quantized) for quantized in (False, True)]
    if "--kernels" not in sys.argv:
        for call in calls:
            call()
        torch.cuda.synchronize()
        return
    for quantized, call in zip((False, True), calls):
        call()
        torch.cuda.synchronize()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            for _ in range(3):
                call()
            torch.cuda.synchronize()
        print(f"quantized={quantized}: kernel time over 3 runs")
        print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=15, max_name_column_width=70))


if __name__ == "__main__":
    main()
