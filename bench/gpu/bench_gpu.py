"""sparsa CUDA backend vs its peers, measured in one process on one GPU (ratios, not absolute times, travel).

Calls libsparsa through the Python binding's ctypes layer (bindings/python/sparsa/_library.py, the header's structs
field by field) on torch tensors (zero copy: the tensors' device pointers and strides go straight
into sparsa_tensor), checks each sparsa output against PyTorch SDPA / a masked reference first, then times with
triton's do_bench (CUDA events, median). Peers: SDPA flash (FA2) and cuDNN for dense prefill and decode,
FlexAttention for block-sparse and sink+window. Usage: python3 bench_gpu.py path/to/libsparsa.so [--quick]
Prints a table; writes $OUT/bench_gpu.json.
"""
import ctypes
import importlib
import json
import math
import os
import sys

import torch
import torch.nn.functional as F
import triton.testing as tt
from torch.nn.attention import SDPBackend, sdpa_kernel

from binding_runs import c_api


class Sparsa:
    """libsparsa at `path` through the Python binding's ctypes layer (`self.L` = sparsa._library: the header's
    structs, constants and typed functions), with one context on torch's current CUDA stream (device "cpu": a CPU
    context, for checking the scripts without a GPU)."""

    def __init__(self, path, device="cuda"):
        self.path = path
        self.L = L = c_api(path)
        self.lib = L.lib
        self.device = device
        options = L.CContextOptions()
        L.call("sparsa_context_options_init", ctypes.byref(options), ctypes.sizeof(options))
        if device == "cuda":
            options.device_type = L.DEVICE_CUDA
            options.stream = torch.cuda.current_stream().cuda_stream
        self.stream = options.stream
        self.ctx = ctypes.c_void_p()
        self.check(self.lib.sparsa_context_create(ctypes.byref(options), ctypes.byref(self.ctx)), "context_create")

    def check(self, status, what):
        if status != 0:
            raise RuntimeError(f"sparsa {what} failed ({status}): {self.lib.sparsa_last_error_message().decode()}")

    def to_tensor(self, t, dtype_code):
        """A sparsa_tensor over torch tensor `t` (zero copy: its data pointer and strides)."""
        d = self.L.CTensor()
        d.struct_size = ctypes.sizeof(d)
        d.dtype, d.ndim = dtype_code, t.dim()
        d.device_type = self.L.DEVICE_CUDA if t.device.type == "cuda" else self.L.DEVICE_CPU
        d.device_id = (t.device.index or 0) if t.device.type == "cuda" else 0
        d.data = t.data_ptr()
        for i in range(t.dim()):
            d.shape[i], d.strides[i] = t.shape[i], t.stride(i)
        return d

    def new_args(self):
        args = self.L.CAttentionArgs()
        self.L.call("sparsa_attention_args_init", ctypes.byref(args), ctypes.sizeof(args))
        return args

    def new_policy(self, kind):
        policy = self.L.CPolicy()
        self.L.call("sparsa_policy_init", ctypes.byref(policy), ctypes.sizeof(policy), kind)
        return policy

    def prepare(self, q, k, v, out, causal, kind=None, mask=None, block=(128, 128), sink=(128, 2048),
                indices=None):
        """Returns a zero-argument callable that enqueues one run (descriptors built once, as a caller would)."""
        L = self.L
        keep = [self.to_tensor(x, L.DTYPE_BF16) for x in (q, k, v, out)]
        args = self.new_args()
        args.q, args.k, args.v, args.out = (ctypes.pointer(x) for x in keep)
        args.causal = 1 if causal else 0
        pol = self.new_policy(L.POLICY_DENSE if kind is None else kind)
        pol.sink_tokens, pol.sink_window = sink
        pol.block_q, pol.block_k = block
        if mask is not None:
            keep.append(self.to_tensor(mask, L.DTYPE_U8))
            pol.block_mask = ctypes.pointer(keep[-1])
        if indices is not None:  # TOKEN_INDICES: int32 [B, H_idx, k] token ids
            keep.append(self.to_tensor(indices, L.DTYPE_I32))
            pol.indices = ctypes.pointer(keep[-1])
        run = self.lib.sparsa_attention_run
        ctx = self.ctx

        def fn():
            status = run(ctx, ctypes.byref(args), ctypes.byref(pol))
            if status != 0:
                self.check(status, "attention_run")
        fn.keep = (keep, args, pol)
        return fn


def indices_case(N, rows_per, B, H, Hkv, D):
    """TOKEN_INDICES decode inputs: bf16 q [B, 1, H, D], k/v [B, N, Hkv, D], out, and 10 % of the N keys as sorted
    random token ids, one row per query head (rows_per "q_head") or per kv head ("kv_head"): int32 [1, H_idx, N/10]."""
    q = torch.randn(B, 1, H, D, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(B, N, Hkv, D, device="cuda", dtype=torch.bfloat16)
    v = torch.randn_like(k)
    out = torch.empty_like(q)
    n_sel = N // 10
    h_idx = H if rows_per == "q_head" else Hkv
    idx = torch.stack([torch.randperm(N, device="cuda")[:n_sel].sort().values for _ in range(h_idx)])
    return q, k, v, out, idx.to(torch.int32).unsqueeze(0).contiguous()


def bench(fn, rep=100, warmup=20):
    fn()
    torch.cuda.synchronize()
    return tt.do_bench(fn, warmup=warmup, rep=rep, return_mode="median")


def rel_err(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def main():
    lib_path = sys.argv[1]
    quick = "--quick" in sys.argv
    # --only a,b: run only these groups (dense, decode, indices, sparse, and every bench/gpu/bench_<group>.py)
    only = None
    for arg in sys.argv[2:]:
        if arg.startswith("--only="):
            only = set(arg.split("=", 1)[1].split(","))

    def want(group):
        return only is None or group in only
    sp = Sparsa(lib_path)
    props = torch.cuda.get_device_properties(0)
    print(f"device {props.name} SMs {props.multi_processor_count} torch {torch.__version__}", flush=True)
    rows = []

    def record(**row):
        rows.append(row)
        items = " ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in row.items())
        print(items, flush=True)

    B, H, D = 1, 32, 128
    if "--profile" in sys.argv:  # one dense launch of each kernel kind for ncu, nothing timed
        q = torch.randn(B, 4096, H, D, device="cuda", dtype=torch.bfloat16)
        out = torch.empty_like(q)
        sp.prepare(q, q, q, out, False)()
        kd = torch.randn(B, 32768, 8, D, device="cuda", dtype=torch.bfloat16)
        sp.prepare(q[:, :1].contiguous(), kd, kd, out[:, :1].contiguous(), True)()
        torch.cuda.synchronize()
        return
    # ---- dense prefill vs SDPA flash (FA2) and cuDNN ----
    for N in ([] if not want("dense") else [4096] if quick else [4096, 16384]):
        q = torch.randn(B, N, H, D, device="cuda", dtype=torch.bfloat16)
        k, v = torch.randn_like(q), torch.randn_like(q)
        out = torch.empty_like(q)
        qt, kt, vt = (x.transpose(1, 2) for x in (q, k, v))  # [B, H, N, D] views for SDPA
        for causal in (False, True):
            fn = sp.prepare(q, k, v, out, causal)
            fn()
            with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
                ref = F.scaled_dot_product_attention(qt, kt, vt, is_causal=causal).transpose(1, 2)
            err = rel_err(out, ref)
            flops = 4 * N * N * H * D * B / (2 if causal else 1)
            ms = bench(fn)
            peers = {}
            for name, be in (("flash", SDPBackend.FLASH_ATTENTION), ("cudnn", SDPBackend.CUDNN_ATTENTION)):
                with sdpa_kernel([be]):
                    peers[name] = bench(lambda: F.scaled_dot_product_attention(qt, kt, vt, is_causal=causal))
            record(kind="dense_prefill", N=N, causal=causal, rel_err=err, sparsa_ms=ms,
                   sparsa_TFLOPs=flops / ms / 1e9, flash_ms=peers["flash"], cudnn_ms=peers["cudnn"],
                   vs_flash=peers["flash"] / ms, vs_cudnn=peers["cudnn"] / ms)
        del q, k, v, out, qt, kt, vt
        torch.cuda.empty_cache()

    # ---- decode, GQA 32/8 vs SDPA ----
    Hkv = 8
    for N in ([] if not want("decode") else [32768] if quick else [32768, 131072]):
        q = torch.randn(B, 1, H, D, device="cuda", dtype=torch.bfloat16)
        k = torch.randn(B, N, Hkv, D, device="cuda", dtype=torch.bfloat16)
        v = torch.randn_like(k)
        out = torch.empty_like(q)
        fn = sp.prepare(q, k, v, out, True)
        fn()
        qt, kt, vt = (x.transpose(1, 2) for x in (q, k, v))
        ref = F.scaled_dot_product_attention(qt, kt, vt, enable_gqa=True).transpose(1, 2)
        err = rel_err(out, ref)
        ms = bench(fn)
        with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
            cudnn = bench(lambda: F.scaled_dot_product_attention(qt, kt, vt, enable_gqa=True))
        with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
            flash = bench(lambda: F.scaled_dot_product_attention(qt, kt, vt, enable_gqa=True))
        record(kind="decode_gqa", N=N, rel_err=err, sparsa_ms=ms, KV_TBps=2 * N * Hkv * D * 2 / ms / 1e9,
               flash_ms=flash, cudnn_ms=cudnn, vs_flash=flash / ms, vs_cudnn=cudnn / ms)
        del q, k, v, out
        torch.cuda.empty_cache()

    # ---- TOKEN_INDICES decode (~90 % sparsity: 10 % of the keys, one index row per query head) vs dense decode ----
    # One index row per query head (each head gathers its own keys), and one per kv head (a GQA group shares its
    # keys: the K/V rows are read once per group).
    for N in ([] if not want("indices") else [32768] if quick else [32768, 131072]):
        for rows_per in ("q_head", "kv_head"):
            q, k, v, out, idx = indices_case(N, rows_per, B, H, Hkv, D)
            h_idx = idx.shape[1]
            fn = sp.prepare(q, k, v, out, True, kind=sp.L.POLICY_TOKEN_INDICES, indices=idx)
            fn()
            # Reference: dense attention over the gathered keys of each head.
            g = H // Hkv
            kh = k[0].transpose(0, 1).repeat_interleave(g, 0)  # [H, N, D]
            vh = v[0].transpose(0, 1).repeat_interleave(g, 0)
            sel = idx[0].long().repeat_interleave(H // h_idx, 0)  # [H, n_sel]
            ks = torch.gather(kh, 1, sel.unsqueeze(-1).expand(-1, -1, D))
            vs = torch.gather(vh, 1, sel.unsqueeze(-1).expand(-1, -1, D))
            ref = F.scaled_dot_product_attention(q[0].transpose(0, 1).unsqueeze(0), ks.unsqueeze(0),
                                                 vs.unsqueeze(0))
            err = rel_err(out[0].transpose(0, 1), ref[0])
            ms = bench(fn)
            qt, kt, vt = (x.transpose(1, 2) for x in (q, k, v))
            with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
                cudnn = bench(lambda: F.scaled_dot_product_attention(qt, kt, vt, enable_gqa=True))
            dense = sp.prepare(q, k, v, out, True)
            dense_ms = bench(dense)
            record(kind="indices_decode", N=N, index_rows_per=rows_per, rel_err=err, sparsa_ms=ms,
                   sparsa_dense_ms=dense_ms, cudnn_ms=cudnn, vs_cudnn_dense=cudnn / ms,
                   vs_sparsa_dense=dense_ms / ms)
            del q, k, v, out, kh, vh, ks, vs
            torch.cuda.empty_cache()

    # ---- block-sparse and sink+window vs FlexAttention ----
    if want("sparse"):
        bench_block_sparse_and_sink_window(sp, record, quick)

    # ---- one module per further area: bench/gpu/bench_<group>.py with run(sp, record, quick) ----
    here = os.path.dirname(os.path.abspath(__file__))
    sys.path.insert(0, here)
    for name in sorted(os.listdir(here)):
        if not (name.startswith("bench_") and name.endswith(".py")) or name == "bench_gpu.py":
            continue
        group = name[len("bench_"):-len(".py")]
        if not want(group):
            continue
        module = importlib.import_module(name[:-3])
        if hasattr(module, "run"):  # the others run on their own (bench_context_parallel.py starts one process per GPU)
            module.run(sp, record, quick)

    path = os.path.join(os.environ.get("OUT", "/tmp"), "bench_gpu.json")
    with open(path, "w") as f:
        json.dump(dict(device=props.name, torch=torch.__version__, rows=rows), f, indent=1)
    print("\nsummary (ratio > 1: sparsa faster)")
    for r in rows:
        ratios = " ".join(f"{k}={r[k]:.2f}" for k in r if k.startswith("vs_"))
        print(f"  {r['kind']:14s} N={r['N']:6d} {r['sparsa_ms']:9.3f} ms  err={r.get('rel_err', r.get('rel_err_vs_flex', 0)):.1e}  {ratios}")


def bench_block_sparse_and_sink_window(sp, record, quick):
    B, H, D = 1, 32, 128
    try:
        from torch.nn.attention.flex_attention import BlockMask, create_block_mask, flex_attention
        flex = torch.compile(flex_attention, dynamic=False)
    except Exception as e:  # noqa: BLE001 - a missing peer is reported, not fatal
        print("FlexAttention unavailable:", e)
        flex = None
    N, BS = (8192 if quick else 32768), 128
    q = torch.randn(B, N, H, D, device="cuda", dtype=torch.bfloat16)
    k, v = torch.randn_like(q), torch.randn_like(q)
    out = torch.empty_like(q)
    qt, kt, vt = (x.transpose(1, 2).contiguous() for x in (q, k, v))
    nb = N // BS
    for density in (0.5, 0.2, 0.1):
        g = torch.Generator(device="cuda").manual_seed(0)
        keep = torch.rand(1, H, nb, nb, device="cuda", generator=g) < density
        keep |= torch.eye(nb, dtype=torch.bool, device="cuda")
        mask_u8 = keep.to(torch.uint8).contiguous()
        fn = sp.prepare(q, k, v, out, False, kind=sp.L.POLICY_BLOCK_SPARSE, mask=mask_u8, block=(BS, BS))
        fn()
        # correctness on a slice of heads: SDPA with the expanded boolean mask
        rows_checked = min(N, 4096)  # head 0, first rows: keeps the dense boolean mask small
        dense_mask = keep[:, :1, : rows_checked // BS].repeat_interleave(BS, 2).repeat_interleave(BS, 3)
        ref = F.scaled_dot_product_attention(qt[:, :1, :rows_checked], kt[:, :1], vt[:, :1], attn_mask=dense_mask)
        err = rel_err(out[:, :rows_checked, :1].transpose(1, 2), ref)
        del dense_mask, ref
        ms = bench(fn)
        row = dict(kind="block_sparse", N=N, density=keep.float().mean().item(), rel_err=err, sparsa_ms=ms)
        if flex is not None:
            cnt = keep.sum(-1).to(torch.int32)
            idx = torch.argsort(keep.to(torch.int8), dim=-1, descending=True, stable=True).to(torch.int32)
            bm = BlockMask.from_kv_blocks(torch.zeros_like(cnt), idx, cnt, idx, BLOCK_SIZE=BS)
            row["flex_ms"] = bench(lambda: flex(qt, kt, vt, block_mask=bm))
            row["vs_flex"] = row["flex_ms"] / ms
        record(**row)
    SINK, W = 128, 2048
    fn = sp.prepare(q, k, v, out, True, kind=sp.L.POLICY_SINK_WINDOW, sink=(SINK, W))
    ms = bench(fn)
    row = dict(kind="sink_window", N=N, sink=SINK, window=W, sparsa_ms=ms)
    if flex is not None:
        def sw(b, h, qi, ki):
            return (ki <= qi) & ((qi - ki < W) | (ki < SINK))
        bm = create_block_mask(sw, B=None, H=None, Q_LEN=N, KV_LEN=N, BLOCK_SIZE=BS, _compile=True)
        flex_out = flex(qt, kt, vt, block_mask=bm)
        row["rel_err_vs_flex"] = rel_err(out.transpose(1, 2), flex_out)
        row["flex_ms"] = bench(lambda: flex(qt, kt, vt, block_mask=bm))
        row["vs_flex"] = row["flex_ms"] / ms
    with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
        row["cudnn_dense_causal_ms"] = bench(lambda: F.scaled_dot_product_attention(qt, kt, vt, is_causal=True))
    record(**row)


if __name__ == "__main__":
    main()
