"""Δ-Attention over SINK_WINDOW (§8 over §2), causal, bf16, B=1, H=32, D=128, against its own base and cuDNN dense
causal, all measured in this process. Bars of issue 3: Δ (gamma 64) adds <= 15 % over its base; base + Δ >= 4x
faster than cuDNN causal at 32K. Run by bench_gpu.py (--only=delta)."""
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from binding_runs import binding, prepared

SINK, WINDOW, GAMMA, TAIL = 128, 2048, 64, 128


def run(sp, record, quick):
    from bench_gpu import bench, rel_err
    B, H, D = 1, 32, 128
    for N in ([32768] if quick else [32768, 131072]):
        q = torch.randn(B, N, H, D, device="cuda", dtype=torch.bfloat16)
        k, v = torch.randn_like(q), torch.randn_like(q)
        out_base, out_delta = torch.empty_like(q), torch.empty_like(q)
        sparsa = binding(sp)
        base, _ = prepared(sp, q, k, v, out_base, sparsa.SinkWindow(sink_tokens=SINK, window=WINDOW), True)
        delta, _ = prepared(sp, q, k, v, out_delta,
                            sparsa.SinkWindow(sink_tokens=SINK, window=WINDOW,
                                              delta=sparsa.Delta(gamma=GAMMA, tail_min=TAIL)), True)
        base()
        delta()
        # Correctness: Δ's tail rows are dense rows: compare the last 64 with SDPA.
        qt, kt, vt = (x.transpose(1, 2) for x in (q, k, v))
        dense_last = F.scaled_dot_product_attention(qt[:, :, -64:], kt, vt, attn_mask=_causal_tail_mask(N, 64))
        err_tail = rel_err(out_delta[:, -64:].transpose(1, 2), dense_last)
        ms_base = bench(base)
        ms_delta = bench(delta)
        with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
            cudnn = bench(lambda: F.scaled_dot_product_attention(qt, kt, vt, is_causal=True), rep=20, warmup=5)
        record(kind="delta_sink_window", N=N, rel_err=err_tail, sparsa_ms=ms_delta, base_ms=ms_base,
               delta_overhead=ms_delta / ms_base - 1.0, cudnn_causal_ms=cudnn, vs_cudnn_causal=cudnn / ms_delta)
        del q, k, v, out_base, out_delta, qt, kt, vt, base, delta
        torch.cuda.empty_cache()


def _causal_tail_mask(n, rows):
    """Boolean mask of the last `rows` query rows over n keys, bottom-right causal."""
    i = torch.arange(n - rows, n, device="cuda").unsqueeze(1)
    j = torch.arange(n, device="cuda").unsqueeze(0)
    return j <= i
