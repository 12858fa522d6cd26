"""Where one shard's context-parallel TOKEN_SELECT steps spend their time (sparsa_cp_select_*, gpu_cp_select.cu):

    python3 profile_cp_select.py LIB [--n N] [--shards G]

One GPU, one shard of N / G keys (the last shard of a cache of N keys; bf16, GQA 32/8, D = 128, B = 1, top_k 2048,
n_init 128, n_local 512, as bench_context_parallel.py): each step's wall time per call with the host waiting
(steps 3 and 4 read small arrays back), and the device time of each kernel (torch.profiler). The combined inputs of
steps 2-4 are this shard's own outputs (one shard standing in for the all-reduce / all-gather): the work is the same.
"""
import argparse
import os
import sys
import time

import torch

from profile_decode import kernel_table

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "bindings", "python"))

REPS = 10


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("library")
    parser.add_argument("--n", type=int, default=1 << 20)
    parser.add_argument("--shards", type=int, default=4)
    options = parser.parse_args()
    os.environ["SPARSA_LIBRARY"] = options.library
    import sparsa
    from sparsa import ops

    device = torch.device("cuda", 0)
    length = options.n // options.shards
    gen = torch.Generator(device=device).manual_seed(3)
    q = torch.randn(1, 1, 32, 128, generator=gen, device=device, dtype=torch.bfloat16)
    k = torch.randn(1, length, 8, 128, generator=gen, device=device, dtype=torch.bfloat16)
    policy = sparsa.TokenSelect(n_init=128, n_local=512, top_k=2048)
    start = torch.tensor([options.n - length], dtype=torch.int32)
    total = torch.tensor([options.n], dtype=torch.int32)
    with sparsa.Context(device="cuda") as ctx:
        state = {}

        def step_max():
            state["max"] = ops.cp_select_max(ctx, q, k, k, policy, start, total)

        def step_sum():
            state["sum"] = ops.cp_select_sum(ctx, q, k, k, policy, start, total, state["max"])

        def step_topk():
            state["votes"], state["positions"] = ops.cp_select_topk(ctx, q, k, k, policy, start, total,
                                                                    state["max"], state["sum"])

        def step_indices():
            ops.cp_select_indices(ctx, q, k, k, policy, start, total, state["votes"].unsqueeze(0),
                                  state["positions"].unsqueeze(0))

        steps = [("max", step_max), ("sum", step_sum), ("topk", step_topk), ("indices", step_indices)]
        for _, step in steps:
            step()
        torch.cuda.synchronize()
        print(f"one shard of {length} keys (cache of {options.n}), {torch.cuda.get_device_name(0)}")
        for name, step in steps:
            t0 = time.perf_counter()
            for _ in range(REPS):
                step()
                torch.cuda.synchronize()
            print(f"step {name:8s} {(time.perf_counter() - t0) / REPS * 1e3:8.3f} ms per call (host waiting)")
        kernel_table("kernels of one round of the four steps", lambda: [step() for _, step in steps])


if __name__ == "__main__":
    main()
