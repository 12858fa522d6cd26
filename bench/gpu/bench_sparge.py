"""SPARGE on the CUDA backend vs FlexAttention on the same mask (a bench_gpu.py module: run(sp, record, quick)).

SPARGE runs with its prediction included (every call predicts the mask again), non-causal, bf16, B=1, H=32, D=128,
block_q=128, block_k=64. theta = -1 makes every block self-similar (nothing forced), so the top-k fraction sets the
density exactly: 0.5, 0.2, 0.1. FlexAttention gets a BlockMask built from the mask SPARGE predicted (read back from
block_mask_out), as bench_gpu.py does for block-sparse. Also timed: BLOCK_SPARSE on that mask (the attention alone,
so the difference is the prediction's cost) and the quantized (Sage) path.
"""
import ctypes

import torch

from bench_gpu import bench, rel_err

BLOCK_Q, BLOCK_K = 128, 64


def sparge_call(sp, q, k, v, out, mask_out, topk_fraction, quantized=False):
    """A zero-argument callable that enqueues one SPARGE run (prediction + attention) writing block_mask_out."""
    L, lib = sp.L, sp.lib  # the binding's ctypes layer: structs field by field, typed functions
    keep = [sp.to_tensor(x, L.DTYPE_BF16) for x in (q, k, v, out)] + [sp.to_tensor(mask_out, L.DTYPE_U8)]
    args = sp.new_args()
    args.q, args.k, args.v, args.out, args.block_mask_out = (ctypes.pointer(x) for x in keep)
    pol = sp.new_policy(L.POLICY_SPARGE)
    pol.block_q, pol.block_k = BLOCK_Q, BLOCK_K
    pol.sparge_theta = -1.0  # every block self-similar: the top-k fraction alone sets the density
    pol.sparge_topk_fraction = topk_fraction
    pol.sparge_quantized = 1 if quantized else 0
    ctx = sp.ctx

    def fn():
        status = lib.sparsa_attention_run(ctx, ctypes.byref(args), ctypes.byref(pol))
        if status != 0:
            raise RuntimeError(f"sparsa SPARGE run failed ({status}): {lib.sparsa_last_error_message().decode()}")
    fn.keep = (keep, args, pol, lib)
    return fn


def run(sp, record, quick):
    B, H, D = 1, 32, 128
    try:
        from torch.nn.attention.flex_attention import BlockMask, flex_attention
        flex = torch.compile(flex_attention, dynamic=False)
    except Exception as e:  # noqa: BLE001 - a missing peer is reported, not fatal
        print("FlexAttention unavailable:", e)
        flex = None
    N = 8192 if quick else 32768
    g = torch.Generator(device="cuda").manual_seed(1)
    q = torch.randn(B, N, H, D, device="cuda", dtype=torch.bfloat16, generator=g)
    k = torch.randn(B, N, H, D, device="cuda", dtype=torch.bfloat16, generator=g)
    v = torch.randn(B, N, H, D, device="cuda", dtype=torch.bfloat16, generator=g)
    out = torch.empty_like(q)
    out_quant = torch.empty_like(q)
    qt, kt, vt = (x.transpose(1, 2).contiguous() for x in (q, k, v))
    nqb, nkb = N // BLOCK_Q, N // BLOCK_K
    mask = torch.zeros(B, H, nqb, nkb, device="cuda", dtype=torch.uint8)
    for fraction in (0.5, 0.2, 0.1):
        fn = sparge_call(sp, q, k, v, out, mask, fraction)
        fn()
        torch.cuda.synchronize()
        keep = mask.bool()
        row = dict(kind="sparge", N=N, topk_fraction=fraction, density=keep.float().mean().item())
        row["sparsa_ms"] = bench(fn)
        # The attention alone on the predicted mask: SPARGE's cost over it is the prediction.
        mask_copy = mask.clone()
        bs = sp.prepare(q, k, v, torch.empty_like(q), False, kind=sp.L.POLICY_BLOCK_SPARSE, mask=mask_copy,
                        block=(BLOCK_Q, BLOCK_K))
        row["block_sparse_ms"] = bench(bs)
        row["predict_ms"] = row["sparsa_ms"] - row["block_sparse_ms"]
        try:
            quant = sparge_call(sp, q, k, v, out_quant, torch.zeros_like(mask), fraction, quantized=True)
            quant()
            torch.cuda.synchronize()
            row["sage_ms"] = bench(quant)
            row["sage_rel_err"] = rel_err(out_quant, out)
        except RuntimeError as e:
            print("SPARGE quantized:", e)
        if flex is not None:
            try:
                cnt = keep.sum(-1).to(torch.int32)
                idx = torch.argsort(keep.to(torch.int8), dim=-1, descending=True, stable=True).to(torch.int32)
                bm = BlockMask.from_kv_blocks(torch.zeros_like(cnt), idx, cnt, idx, BLOCK_SIZE=(BLOCK_Q, BLOCK_K))
                flex_out = flex(qt, kt, vt, block_mask=bm)
                row["rel_err_vs_flex"] = rel_err(out.transpose(1, 2), flex_out)
                del flex_out
                row["flex_ms"] = bench(lambda: flex(qt, kt, vt, block_mask=bm))
                row["vs_flex"] = row["flex_ms"] / row["sparsa_ms"]
                row["vs_flex_attention_only"] = row["flex_ms"] / row["block_sparse_ms"]
            except Exception as e:  # noqa: BLE001 - report and keep the SPARGE numbers
                print("FlexAttention on the SPARGE mask failed:", e)
        record(**row)
        del mask_copy, bs
    del q, k, v, out, out_quant, qt, kt, vt, mask
    torch.cuda.empty_cache()
