"""Turns the rows bench_gpu.py measured ($OUT/bench_gpu.json) into the project's results file,
bench/results/<card>.json, one row per workload and peer:

  {"commit": "<sha>", "date": "YYYY-MM-DD", "card": "<nvidia-smi name>",
   "rows": [{"workload": "<name>", "sparsa_ms": x, "peer": "<name>", "peer_ms": y, "speedup": y / x, "bar": b}]}

`speedup` > 1 means sparsa is faster; `bar` is the speedup the project's performance goals ask for (a goal of
"<= 0.8x the peer's time" is a bar of 1.25; 0 where there is none). Workload names start with the policy in lower
case. Usage: python3 results_file.py BENCH_JSON COMMIT [OUT_DIR] (prints the table; writes OUT_DIR/<card>.json,
default bench/results).
"""
import datetime
import json
import os
import sys

# Bars (speedup asked for against each peer), by the workload's family.
BARS = {
    ("dense", "cudnn"): 1.0, ("dense", "flash"): 1.0,
    ("decode", "cudnn"): 1.0,
    ("block_sparse", "flex"): 1.25,
    ("sparge", "flex"): 1 / 0.85,
    ("sink_window", "flex"): 1.25,
    ("delta", "cudnn_causal"): 4.0,  # at 32K; 12 at 128K (set per row below)
    ("token_indices", "cudnn_dense_decode"): 5.0,
    ("token_sparse", "recipe_with_select"): 1 / 0.66, ("token_sparse", "recipe"): 1.0,
    ("token_select_miss", "cudnn_dense_decode"): 1.0,  # at 128K; 1/0.6 at 1M (set per row below)
}


def _k(n):
    return f"{n // 1024}k" if n % 1024 == 0 else str(n)


def rows_of(measured):
    """(workload, sparsa_ms, peer, peer_ms, bar) for every measured row that has a peer."""
    out = []
    for r in measured:
        kind, n = r.get("kind"), r.get("N", 0)
        ms = r.get("sparsa_ms")
        if ms is None:
            continue
        if kind == "dense_prefill":
            name = f"dense_prefill_{_k(n)}_{'causal' if r.get('causal') else 'noncausal'}_d128"
            out += [(name, ms, "cudnn", r["cudnn_ms"], BARS[("dense", "cudnn")]),
                    (name, ms, "flash", r["flash_ms"], BARS[("dense", "flash")])]
        elif kind == "decode_gqa":
            out.append((f"decode_gqa32x8_{_k(n)}", ms, "cudnn", r["cudnn_ms"], BARS[("decode", "cudnn")]))
        elif kind == "indices_decode":
            out.append((f"token_indices_decode_{_k(n)}_rows_per_{r['index_rows_per']}", ms, "cudnn_dense_decode",
                        r["cudnn_ms"], BARS[("token_indices", "cudnn_dense_decode")] if n >= 131072 else 0.0))
        elif kind == "block_sparse" and "flex_ms" in r:
            out.append((f"block_sparse_{_k(n)}_density_{r['density']:.2f}", ms, "flex", r["flex_ms"],
                        BARS[("block_sparse", "flex")]))
        elif kind == "sink_window" and "flex_ms" in r:
            out.append((f"sink_window_{_k(n)}", ms, "flex", r["flex_ms"], BARS[("sink_window", "flex")]))
        elif kind == "sparge" and "flex_ms" in r:
            name = f"sparge_{_k(n)}_topk_{r['topk_fraction']}"
            out.append((name, ms, "flex", r["flex_ms"], BARS[("sparge", "flex")]))
            if "sage_ms" in r:  # the Sage path against sparsa's own bf16 path on the same mask
                out.append((f"sage_{_k(n)}_topk_{r['topk_fraction']}", r["sage_ms"], "sparsa_bf16", ms, 1.4))
        elif kind == "delta_sink_window":
            bar = 4.0 if n <= 32768 else 12.0
            out.append((f"delta_sink_window_{_k(n)}", ms, "cudnn_causal", r["cudnn_causal_ms"], bar))
        elif kind == "token_sparse":
            name = f"token_sparse_{_k(n)}_keep_{r['keep']}"
            out += [(name, ms, "recipe_with_select", r["recipe_with_select_ms"],
                     BARS[("token_sparse", "recipe_with_select")]),
                    (name, ms, "recipe", r["recipe_ms"], BARS[("token_sparse", "recipe")])]
        elif kind == "select_miss":
            bar = 1.0 if n <= 131072 else 1 / 0.6
            out.append((f"token_select_miss_{_k(n)}", ms, "cudnn_dense_decode", r["cudnn_ms"], bar))
        elif kind == "select_hit":
            out.append((f"token_select_hit_{_k(n)}", ms, "cudnn_dense_decode", r["cudnn_ms"], 0.0))
        elif kind == "select_miss_batch8":
            out.append((f"token_select_miss_batch8_ragged_{_k(n)}", ms, "cudnn_dense_decode_per_sequence",
                        r["cudnn_ms"], 3.0))
    return out


def main():
    bench_json, commit = sys.argv[1], sys.argv[2]
    out_dir = sys.argv[3] if len(sys.argv) > 3 else os.path.join(os.path.dirname(__file__), "..", "results")
    with open(bench_json) as f:
        measured = json.load(f)
    card = measured["device"]
    rows = [dict(workload=w, sparsa_ms=round(s, 5), peer=p, peer_ms=round(pm, 5), speedup=round(pm / s, 4),
                 bar=round(b, 4)) for w, s, p, pm, b in rows_of(measured["rows"])]
    doc = dict(commit=commit, date=datetime.date.today().isoformat(), card=card, rows=rows)
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, card.replace(" ", "_") + ".json")
    with open(path, "w") as f:
        json.dump(doc, f, indent=1)
    print(f"{path}: {len(rows)} rows")
    for r in rows:
        met = "" if not r["bar"] else ("met" if r["speedup"] >= r["bar"] else f"MISSED (bar {r['bar']:.2f})")
        print(f"  {r['workload']:44s} {r['sparsa_ms']:9.3f} ms  vs {r['peer']:20s} {r['peer_ms']:9.3f} ms"
              f"  speedup {r['speedup']:6.2f}  {met}")


if __name__ == "__main__":
    main()
