"""Where a TOKEN_INDICES decode step's time goes: bench_gpu.py's indices case (bf16, GQA 32/8, D = 128, 10 % of the
keys as sorted random token ids, one index row per query head or per kv head), timed as bench_gpu.py times it, with
the kernel timeline of one call, the copy bandwidth of the card and a torch gather of the same K/V rows.

    python3 profile_indices.py LIB [N ...] [--no-timeline]     (default N: 32768 131072; --no-timeline under ncu)
"""
import sys

import torch
import triton.testing as tt

from bench_gpu import Sparsa, bench, indices_case
from bench_select import kernel_timeline


def copy_bandwidth_gbs():
    """Device-to-device copy of 1 GiB: bytes read + written per second."""
    src = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    ms = tt.do_bench(lambda: dst.copy_(src), warmup=5, rep=50, return_mode="median")
    return 2 * src.numel() / (ms * 1e-3) / 1e9


def main():
    sp = Sparsa(sys.argv[1])
    sizes = [int(a) for a in sys.argv[2:] if not a.startswith("--")] or [32768, 131072]
    timeline = "--no-timeline" not in sys.argv
    B, H, Hkv, D = 1, 32, 8, 128
    print(f"device {torch.cuda.get_device_properties(0).name}; copy bandwidth {copy_bandwidth_gbs():.0f} GB/s",
          flush=True)
    torch.manual_seed(0)
    for N in sizes:
        for rows_per in ("kv_head", "q_head"):
            q, k, v, out, idx = indices_case(N, rows_per, B, H, Hkv, D)
            h_idx = idx.shape[1]
            fn = sp.prepare(q, k, v, out, True, kind=sp.L.POLICY_TOKEN_INDICES, indices=idx)
            ms = bench(fn)
            # The same rows gathered by torch (K and V of each list's kv head): bytes moved / time.
            kv_of_row = torch.arange(h_idx, device="cuda") * Hkv // h_idx
            flat = (idx[0].long() * Hkv + kv_of_row[:, None]).reshape(-1)
            k_rows, v_rows = k.view(-1, D), v.view(-1, D)
            gather_ms = bench(lambda: (k_rows.index_select(0, flat), v_rows.index_select(0, flat)))
            gathered = 2 * flat.numel() * D * 2
            print(f"N={N} rows_per={rows_per} sparsa_ms={ms:.4f} ({gathered / (ms * 1e-3) / 1e9:.0f} GB/s of "
                  f"gathered K/V) torch_gather_ms={gather_ms:.4f} ({2 * gathered / (gather_ms * 1e-3) / 1e9:.0f} "
                  f"GB/s read + written)", flush=True)
            if timeline:
                kernel_timeline(fn, f"N={N} rows per {rows_per} (eager)")
            del q, k, v, out
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
