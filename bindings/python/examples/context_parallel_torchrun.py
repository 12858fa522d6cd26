"""Context-parallel attention with torch.distributed (docs/context_parallel.md).

    torchrun --nproc-per-node 2 bindings/python/examples/context_parallel_torchrun.py [--check]

Each rank holds 1/G of a KV cache (decode) or two zig-zag chunks of a prompt (prefill); sparsa computes each rank's
part and torch.distributed (NCCL on GPUs, gloo on CPUs) carries the small exchanges. With --check, every rank also
runs the whole problem on one context and the script fails unless the results agree (index sets exactly, outputs
within fp32 rounding).
"""
import argparse
import os
import sys

import torch
import torch.distributed as dist

import sparsa
from sparsa import distributed as cp

RTOL = 1e-5


def relative(got, want):
    return ((got.double() - want.double()).abs().max() / want.double().abs().max().clamp_min(1e-30)).item()


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--check", action="store_true", help="compare with one context over the whole problem")
    parser.add_argument("--kv-len", type=int, default=4096)
    options = parser.parse_args()

    use_cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if use_cuda else "gloo")
    rank, size = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if use_cuda else torch.device("cpu")
    if use_cuda:
        torch.cuda.set_device(device)
    group = cp.TorchGroup()  # the default process group; pass your own to TorchGroup(group)

    # ---- Decode: the KV cache split by position; every rank has the same query. -------------------------------
    generator = torch.Generator().manual_seed(0)  # the same full problem on every rank, for the check
    batch, hq, hkv, d, n = 2, 8, 2, 64, options.kv_len
    q = torch.randn(batch, 1, hq, d, generator=generator)
    k = torch.randn(batch, n, hkv, d, generator=generator)
    v = torch.randn(batch, n, hkv, d, generator=generator)
    per_rank = n // size
    start, end = rank * per_rank, (rank + 1) * per_rank if rank < size - 1 else n
    kv_start = torch.full((batch,), start, dtype=torch.int32)  # host tensors: positions of this shard
    kv_total = torch.full((batch,), n, dtype=torch.int32)
    policy = sparsa.TokenSelect(n_init=64, n_local=256, top_k=512, cache_theta=1.0)
    context = sparsa.Context("cuda", device_id=device.index) if use_cuda else sparsa.Context()
    failures = 0
    with context as ctx:
        local_q = q.to(device)
        local_k, local_v = k[:, start:end].contiguous().to(device), v[:, start:end].contiguous().to(device)
        out, lse = cp.cp_decode(ctx, group, local_q, local_k, local_v, policy, kv_start=kv_start,
                                kv_total=kv_total)
        # A step of three query rows (speculative decoding: the sequences' last three positions, causal among them).
        step_q = torch.randn(batch, 3, hq, d, generator=generator)
        step_out, _ = cp.cp_decode(ctx, group, step_q.to(device), local_k, local_v, policy, kv_start=kv_start,
                                   kv_total=kv_total)

        # ---- Prefill: zig-zag chunks of one prompt, causal; DENSE all-gathers K/V, SINK_WINDOW sends each rank
        # only the keys its rows read (sparsa.distributed.prefill_exchange_plan). ------------------------------
        total = 256 * 2 * size
        prompt = [torch.randn(batch, total, h, d, generator=generator) for h in (hq, hkv, hkv)]
        ranges = cp.zigzag_ranges(total, size, rank)
        mine = [torch.cat([x[:, a:e] for a, e in ranges], dim=1).contiguous().to(device) for x in prompt]
        prefill_policies = [sparsa.Dense(), sparsa.SinkWindow(sink_tokens=16, window=100)]
        prefill_outs = [cp.prefill(ctx, group, *mine, policy_p, total=total) for policy_p in prefill_policies]

        if options.check:
            errors = []
            with sparsa.Context() as host:
                selected = torch.full((batch, 1, n), -1, dtype=torch.int32)
                want = sparsa.attention(host, q, k, v, policy=policy, lse=True, selected_indices=selected)
                indices = cp.token_select_indices(ctx, group, local_q, local_k, local_v, policy, kv_start, kv_total)
                mine_selected = [sorted(int(t) + start for t in indices[b, 0].cpu() if t >= 0) for b in range(batch)]
                for b in range(batch):
                    expected = [int(t) for t in selected[b, 0] if start <= t < end]
                    if mine_selected[b] != expected:
                        errors.append(f"rank {rank}: sequence {b} index set differs from one device's")
                if relative(out.cpu(), want.out) > RTOL or relative(lse.cpu(), want.lse) > RTOL:
                    errors.append(f"rank {rank}: decode output differs: {relative(out.cpu(), want.out):.3g}")
                step_want = sparsa.attention(host, step_q, k, v, policy=policy, causal=True)
                if relative(step_out.cpu(), step_want) > RTOL:
                    errors.append(f"rank {rank}: three-row step differs: {relative(step_out.cpu(), step_want):.3g}")
                for policy_p, prefill_out in zip(prefill_policies, prefill_outs):
                    whole = sparsa.attention(host, *prompt, policy=policy_p, causal=True)
                    expected = torch.cat([whole[:, a:e] for a, e in ranges], dim=1)
                    if relative(prefill_out.cpu(), expected) > RTOL:
                        errors.append(f"rank {rank}: {type(policy_p).__name__} prefill output differs: "
                                      f"{relative(prefill_out.cpu(), expected):.3g}")
            flag = torch.tensor([len(errors)], dtype=torch.int64, device=device)
            dist.all_reduce(flag)
            for line in errors:
                print(line, flush=True)
            failures = int(flag.item())
            if failures == 0 and rank == 0:
                print(f"context-parallel decode, a three-row step and prefill match one device on {size} ranks",
                      flush=True)
    dist.destroy_process_group()
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
