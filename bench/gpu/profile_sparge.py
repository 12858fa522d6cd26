"""One SPARGE run at N=32K, density 0.5 (bf16, H=32, D=128, block 128×64), unquantized and quantized, for ncu:

    ncu -k regex:'sage_attention|forward_mma|forward_wgmma' --launch-count 2 ... python3 profile_sparge.py LIB

Nothing is timed; bench_sparge.py times the same configuration against FlexAttention.
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
    for quantized in (False, True):
        sparge_call(sp, q, k, v, out, mask, 0.5, quantized=quantized)()
    torch.cuda.synchronize()


if __name__ == "__main__":
    main()
