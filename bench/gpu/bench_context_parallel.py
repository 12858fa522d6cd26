"""Context-parallel attention on G GPUs of one host against the same problem on one GPU (docs/context_parallel.md).

    python3 bench/gpu/bench_context_parallel.py LIBSPARSA [--ranks G] [--decode-n N] [--prefill-n N] [--out DIR]

Starts G processes (one per GPU, NCCL through torch.distributed, the environment torchrun would set) and times, in
the same processes and on the same cards:

- decode, bf16, GQA 32/8, D = 128, B = 1, N keys split evenly by position: DENSE, SINK_WINDOW 128 + 2048,
  TOKEN_INDICES (one row per kv head, 10 % of the keys, n_init 128, n_local 512) and TOKEN_SELECT (top_k 2048; its
  four selection steps on each rank's GPU, three collectives in between), each through
  sparsa.distributed.cp_decode (the run on the shard, the all-gather of the partial states, the merge), against one
  sparsa run over the whole cache on rank 0's GPU;
- causal prefill, bf16, H = 32 (GQA 32/8), D = 128, N tokens split zig-zag: DENSE, SINK_WINDOW 128 + 2048 and
  BLOCK_SPARSE (128 x 128 blocks, 20 % of the causal blocks kept) and SPARGE (top-k 20 % of the key blocks, its
  prediction included) through sparsa.distributed.prefill (DENSE and SPARGE K/V all-gathered, the others sent where
  read: prefill_exchange_plan), against one sparsa run over the whole prompt on rank 0's GPU.

Each figure is the slowest rank's, the host work of the Python path included, taken two ways: "steady" = steps
enqueued back to back, per step (a serving loop's rate: host work counts where it exceeds the GPU's), and
"latency" = the median of single steps each waited for. The one-GPU figures are taken the same way. Strong-scaling
efficiency = t_1 / (G * t_G) on the steady figures. Bytes: what each rank sends per step, and what the policy needs
a rank to receive at the least (the remote keys it attends to, or the remote partial states). Every figure is
checked: rank 0 compares its result with the one-GPU run's.

Writes DIR/context_parallel_<card>_x<G>.json (default bench/results), rows in the form of results_file.py with
the one-GPU sparsa run as the peer.
"""
import argparse
import datetime
import json
import os
import socket
import statistics
import subprocess
import sys
import time

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
HQ, HKV, D = 32, 8, 128
DECODE_BAR = 0.85  # strong-scaling efficiency asked for at G = 2, decode at 1M (the goal)


def parse():
    p = argparse.ArgumentParser()
    p.add_argument("library")
    p.add_argument("--ranks", type=int, default=0, help="G (default: every visible GPU)")
    p.add_argument("--decode-n", type=int, default=1 << 20)
    p.add_argument("--prefill-n", type=int, default=1 << 18)
    p.add_argument("--reps", type=int, default=10)
    p.add_argument("--prefill-reps", type=int, default=3)
    p.add_argument("--profile-host", action="store_true", help="cProfile the SINK_WINDOW decode steps")
    p.add_argument("--out", default=os.path.join(ROOT, "bench", "results"))
    p.add_argument("--commit", default=os.environ.get("SPARSA_COMMIT", "unknown"))
    return p.parse_args()


def launch(options):
    """Starts G copies of this script with the variables torchrun sets; returns the worst exit status."""
    import torch
    size = options.ranks or torch.cuda.device_count()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = []
    for rank in range(size):
        env = dict(os.environ, RANK=str(rank), WORLD_SIZE=str(size), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                   MASTER_PORT=str(port), SPARSA_LIBRARY=options.library, NCCL_NVLS_ENABLE="0",
                   TORCH_SYMM_MEM_DISABLE_MULTICAST="1", NVSHMEM_DISABLE_NVLS="1")
        procs.append(subprocess.Popen([sys.executable, __file__] + sys.argv[1:], env=env))
    return max(p.wait() for p in procs)


class Timer:
    """Time of a step, the slowest rank's (every rank calls it the same way): `latency` = median wall time of one
    step waited for on its own; `steady` = wall time of `reps` steps enqueued back to back, per step (the host
    runs ahead as a serving loop's does, so host work counts only where it exceeds the GPU's)."""

    def __init__(self, dist, torch, device):
        self.dist, self.torch, self.device = dist, torch, device

    def sync(self, collective=True):
        """Waits for this GPU's work and, when collective, for every rank to get here."""
        self.torch.cuda.synchronize()
        if collective:
            self.dist.barrier()
            self.torch.cuda.synchronize()

    def __call__(self, step, reps, warmup=2, collective=True):
        torch = self.torch
        for _ in range(warmup):
            step()
        times = []
        for _ in range(reps):
            self.sync(collective)
            t0 = time.perf_counter()
            step()
            torch.cuda.synchronize()
            times.append(time.perf_counter() - t0)
        self.sync(collective)
        t0 = time.perf_counter()
        for _ in range(reps):
            step()
        torch.cuda.synchronize()
        steady = (time.perf_counter() - t0) / reps
        ms = torch.tensor([statistics.median(times) * 1e3, steady * 1e3], dtype=torch.float64, device=self.device)
        if collective:
            self.dist.all_reduce(ms, op=self.dist.ReduceOp.MAX)
        return Timing(float(ms[0].item()), float(ms[1].item()))


class Timing:
    def __init__(self, latency, steady):
        self.latency, self.steady = latency, steady


def relative(got, want):
    got, want = got.double(), want.double()
    return ((got - want).abs().max() / want.abs().max().clamp_min(1e-30)).item()


def decode_rows(options, ctx, group, timer, torch, sparsa, cp, device):
    rank, size, n = group.rank, group.size, options.decode_n
    gen = torch.Generator(device=device).manual_seed(1)
    per_rank = n // size
    start = rank * per_rank
    # the whole cache on every rank (rank 0 times the one-GPU run on it; the others only slice their shard)
    q = torch.randn(1, 1, HQ, D, generator=gen, device=device, dtype=torch.bfloat16)
    k = torch.randn(1, n, HKV, D, generator=gen, device=device, dtype=torch.bfloat16)
    v = torch.randn(1, n, HKV, D, generator=gen, device=device, dtype=torch.bfloat16)
    k_shard, v_shard = k[:, start:start + per_rank].contiguous(), v[:, start:start + per_rank].contiguous()
    kv_start = torch.tensor([start], dtype=torch.int32)
    kv_total = torch.tensor([n], dtype=torch.int32)
    index_count = n // 10
    indices = torch.stack([torch.randperm(n, generator=gen, device=device)[:index_count].sort().values
                           for _ in range(HKV)]).to(torch.int32).unsqueeze(0).contiguous()
    policies = [
        ("dense", sparsa.Dense(), options.reps),
        ("sink_window", sparsa.SinkWindow(128, 2048), options.reps),
        ("token_indices", sparsa.TokenIndices(indices, n_init=128, n_local=512), options.reps),
        ("token_select", sparsa.TokenSelect(n_init=128, n_local=512, top_k=2048), options.reps),
    ]
    state_bytes = HQ * D * 2 + HQ * 4  # one rank's partial (out bf16, lse f32) per decode row
    rows = []
    for name, policy, reps in policies:
        single_ms, want = None, None
        if rank == 0:
            want = sparsa.attention(ctx, q, k, v, policy=policy)
            single_ms = timer(lambda: sparsa.attention(ctx, q, k, v, policy=policy), reps, collective=False)
        timer.sync()

        def step():
            return cp.cp_decode(ctx, group, q, k_shard, v_shard, policy, kv_start=kv_start, kv_total=kv_total)

        cp_ms = timer(step, reps)
        out, _ = step()
        if options.profile_host and name == "token_indices":
            profile_device(torch, rank, f"{size} GPUs, {name}", step)
        if options.profile_host and name == "sink_window":
            profile_host(rank, "one GPU", lambda: sparsa.attention(ctx, q, k, v, policy=policy), rank == 0)
            profile_host(rank, f"{size} GPUs", step, True)
        sent = state_bytes
        if name == "token_select":
            sent += 8 * HQ + 48 * HQ + 12 * 1 * 2048  # max, fixed-point sums, local top-k votes and positions
        row = dict(workload=f"{name}_decode_{n // 1024}k_cp", g=size, cp=cp_ms, bytes_sent_per_rank=sent,
                   bytes_needed_per_rank=state_bytes * (size - 1), selection="device")
        if rank == 0:
            row.update(single=single_ms, check_relative=relative(out, want))
            report("decode", name, n, size, row)
        rows.append(row)
    del k, v, k_shard, v_shard
    return rows


def report(what, name, n, size, row):
    one, many = row["single"], row["cp"]
    print(f"{what} {name:14s} N={n}: steady one GPU {one.steady:9.3f} ms, {size} GPUs {many.steady:9.3f} ms, "
          f"efficiency {one.steady / (size * many.steady):.2f} | latency {one.latency:9.3f} / {many.latency:9.3f} ms"
          f" | sent {row['bytes_sent_per_rank'] / 2**20:.3g} MiB, needed {row['bytes_needed_per_rank'] / 2**20:.3g} "
          f"MiB | check {row['check_relative']:.2e}", flush=True)


def profile_host(rank, label, step, run, steps=30):
    """Where the host time of a step goes (cProfile, rank 0 prints); every rank must call it for collective steps."""
    import cProfile
    import pstats
    if not run:
        return
    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(steps):
        step()
    profiler.disable()
    if rank == 0:
        print(f"--- host profile, {label}, {steps} steps ---", flush=True)
        pstats.Stats(profiler).sort_stats("tottime").print_stats(12)


def profile_device(torch, rank, label, step, steps=10):
    """The CUDA runtime calls and kernels of a few steps (torch.profiler); every rank runs them, rank 0 prints."""
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
    if rank == 0:
        print(f"--- torch.profiler, {label}, {steps} steps ---", flush=True)
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=14), flush=True)
        print(prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=8), flush=True)


def causal_block_mask(torch, n, block, density, gen, device):
    blocks = n // block
    keep = torch.rand(1, HQ, blocks, blocks, generator=gen, device=device) < density
    keep |= torch.eye(blocks, dtype=torch.bool, device=device)  # every row keeps its diagonal block
    return (keep & torch.ones(blocks, blocks, dtype=torch.bool, device=device).tril()).to(torch.uint8).contiguous()


def prefill_rows(options, ctx, group, timer, torch, sparsa, cp, device):
    rank, size, n = group.rank, group.size, options.prefill_n
    gen = torch.Generator(device=device).manual_seed(2)
    q = torch.randn(1, n, HQ, D, generator=gen, device=device, dtype=torch.bfloat16)
    k = torch.randn(1, n, HKV, D, generator=gen, device=device, dtype=torch.bfloat16)
    v = torch.randn(1, n, HKV, D, generator=gen, device=device, dtype=torch.bfloat16)
    ranges = cp.zigzag_ranges(n, size, rank)
    mine = [torch.cat([x[:, a:e] for a, e in ranges], dim=1).contiguous() for x in (q, k, v)]
    block = 128
    mask = causal_block_mask(torch, n, block, 0.2, gen, device)
    policies = [("dense", sparsa.Dense()), ("sink_window", sparsa.SinkWindow(128, 2048)),
                ("block_sparse", sparsa.BlockSparse(mask, block_q=block, block_k=block)),
                # every block self-similar on random inputs (theta -1), so the top-k keeps 20 % of the key blocks
                ("sparge_topk", sparsa.Sparge(block_q=128, block_k=64, theta=-1.0, topk_fraction=0.2))]
    row_bytes = HKV * D * 2 * 2  # one token's K and V
    own = torch.zeros(n, dtype=torch.bool, device=device)
    for a, e in ranges:
        own[a:e] = True
    rows = []
    for name, policy in policies:
        # the remote key rows this rank's query rows attend to under the policy (what it must receive at the least)
        needed = torch.zeros(n, dtype=torch.bool, device=device)
        for a, e in ranges:
            if name == "dense":
                needed[:e] = True
            elif name.startswith("sparge"):  # the prediction pools every key of the sequence
                needed[:] = True
            elif name == "sink_window":
                needed[:128] = True
                needed[max(0, a - 2047):e] = True
            else:
                cols = mask[0, :, a // block:e // block].amax(dim=(0, 1)).bool()
                needed |= cols.repeat_interleave(block)
        needed_bytes = int((needed & ~own).sum().item()) * row_bytes
        single_ms, want = None, None
        if rank == 0:
            want = sparsa.attention(ctx, q, k, v, policy=policy, causal=True)
            single_ms = timer(lambda: sparsa.attention(ctx, q, k, v, policy=policy, causal=True),
                              options.prefill_reps, warmup=1, collective=False)
        timer.sync()

        def step():
            return cp.prefill(ctx, group, *mine, policy, total=n)

        cp_ms = timer(step, options.prefill_reps, warmup=1)
        out = step()
        plan = cp.prefill_exchange_plan(n, size, policy)  # None: K/V all-gathered
        sent_rows = (n // size) * (size - 1) if plan is None else sum(len(p) for p in plan[rank])
        row = dict(workload=f"{name}_prefill_causal_{n // 1024}k_cp", g=size, cp=cp_ms,
                   bytes_sent_per_rank=sent_rows * row_bytes, bytes_needed_per_rank=needed_bytes)
        if rank == 0:
            expected = torch.cat([want[:, a:e] for a, e in ranges], dim=1)
            row.update(single=single_ms, check_relative=relative(out, expected))
            report("prefill", name, n, size, row)
        rows.append(row)
    return rows


def worker(options):
    import torch
    import torch.distributed as dist
    sys.path.insert(0, os.path.join(ROOT, "bindings", "python"))
    import sparsa
    from sparsa import distributed as cp

    rank = int(os.environ["RANK"])
    device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
    torch.cuda.set_device(device)
    dist.init_process_group("nccl", device_id=device)
    group = cp.TorchGroup()
    timer = Timer(dist, torch, device)
    with sparsa.Context("cuda", device_id=device.index) as ctx:
        rows = decode_rows(options, ctx, group, timer, torch, sparsa, cp, device)
        torch.cuda.empty_cache()
        rows += prefill_rows(options, ctx, group, timer, torch, sparsa, cp, device)
    if rank == 0:
        card = torch.cuda.get_device_name(device)
        results = []
        for r in rows:
            speedup = r["single"].steady / r["cp"].steady
            decode_1m = r["workload"].startswith("dense_decode_1024k")
            results.append(dict(workload=r["workload"], sparsa_ms=round(r["cp"].steady, 5), peer="sparsa_one_gpu",
                                peer_ms=round(r["single"].steady, 5), speedup=round(speedup, 4),
                                sparsa_latency_ms=round(r["cp"].latency, 5),
                                peer_latency_ms=round(r["single"].latency, 5),
                                bar=DECODE_BAR * r["g"] if decode_1m and r["g"] == 2 else 0.0, gpus=r["g"],
                                efficiency=round(speedup / r["g"], 4), bytes_sent_per_rank=r["bytes_sent_per_rank"],
                                bytes_needed_per_rank=r["bytes_needed_per_rank"],
                                check_relative=float(f"{r['check_relative']:.3g}"),
                                **({"selection": r["selection"]} if "selection" in r else {})))
        document = dict(commit=options.commit, date=datetime.date.today().isoformat(), card=card,
                        gpus=group.size, rows=results)
        os.makedirs(options.out, exist_ok=True)
        path = os.path.join(options.out, f"context_parallel_{card.replace(' ', '_')}_x{group.size}.json")
        with open(path, "w") as f:
            json.dump(document, f, indent=1)
        print(f"wrote {path}", flush=True)
    dist.destroy_process_group()
    return 0


def main():
    options = parse()
    if "RANK" not in os.environ:
        return launch(options)
    return worker(options)


if __name__ == "__main__":
    sys.exit(main())
