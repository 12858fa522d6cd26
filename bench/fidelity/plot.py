#!/usr/bin/env python3
"""Quality against achieved sparsity from the harness's results JSON: one curve per policy, Δ dashed.

    /usr/bin/python3 bench/fidelity/plot.py fidelity_results.json --out docs/fidelity.png

Panels: perplexity at 4K and at 8K relative to dense (ratio), passkey and multi-key retrieval accuracy, and the mean
per-layer attention-output error. Also reads the JSON of `sparsa run --policies ... --json` (one panel: mean error
against sparsity, one point per policy).
"""
import argparse
import json

import matplotlib
matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

KNOB = {"sink_window": "window", "sparge": "tau", "sage": "tau", "token_sparse": "coverage", "token_select": "top_k",
        "token_select_kv": "top_k", "topk_per_head": "top_k", "vote01": "top_k", "token_indices": "density",
        "sparge_tuned": "l1"}
NAMES = {"sink_window": "SINK_WINDOW", "sparge": "SPARGE", "sage": "SPARGE (Sage int8)",
         "token_sparse": "TOKEN_SPARSE", "token_select": "TOKEN_SELECT (soft vote)",
         "token_select_kv": "TOKEN_SELECT per kv head", "topk_per_head": "per-head top-k",
         "vote01": "0/1 head vote", "token_indices": "TOKEN_INDICES (draft blocks)",
         "sparge_tuned": "SPARGE tuned (L1 target)"}
# Sage shares SPARGE's points almost exactly: crosses keep it visible on top of SPARGE's line.
MARKERS = {"sage": "x"}


def curves(results):
    """{(policy, delta): [(result), ...]} sorted by sparsity."""
    out = {}
    for r in results:
        if r["policy"] == "dense":
            continue
        out.setdefault((r["policy"], bool(r.get("delta"))), []).append(r)
    for key in out:
        out[key].sort(key=lambda r: r["sparsity_4k"])
    return out


def plot_harness(data, path):
    results = data["results"]
    dense = next(r for r in results if r["policy"] == "dense")
    panels = [("ppl_4k", "sparsity_4k", "perplexity / dense, 4K", True),
              ("ppl_8k", "sparsity_8k", "perplexity / dense, 8K", True),
              ("passkey_acc", "sparsity_passkey", "passkey accuracy", False),
              ("multikey_acc", "sparsity_multikey", "multi-key accuracy", False),
              ("layer_rel_error", "sparsity_4k", "mean per-layer attention rel. error (4K)", False)]
    panels = [p for p in panels if p[0] in dense]
    fig, grid = plt.subplots(2, 3, figsize=(15, 9))
    axes = list(grid.flat)[:len(panels)]
    legend_ax = grid.flat[-1]
    colors = {}
    for (policy, delta), rows in sorted(curves(results).items()):
        color = colors.setdefault(policy, f"C{len(colors) % 10}")
        label = NAMES.get(policy, policy) + (" + Δ" if delta else "")
        for ax, (metric, sparsity, title, relative) in zip(axes, panels):
            xs, ys = [], []
            for r in rows:
                if metric not in r or sparsity not in r:
                    continue
                value = r[metric]
                if metric == "layer_rel_error":
                    value = sum(value) / len(value)
                elif relative:
                    value = value / dense[metric]
                xs.append(r[sparsity])
                ys.append(value)
            marker = MARKERS.get(policy, "o")
            ax.plot(xs, ys, "--" if delta else "-", marker=marker, ms=6 if marker == "x" else 3, color=color,
                    label=label)
    for ax, (metric, _, title, relative) in zip(axes, panels):
        if relative:
            ax.axhline(1.01, color="grey", lw=0.8, ls=":")
            ax.set_yscale("log")
        elif metric != "layer_rel_error":
            ax.axhline(0.95 * dense[metric], color="grey", lw=0.8, ls=":")
        ax.set_xlabel("achieved sparsity")
        ax.set_title(title, fontsize=10)
        ax.grid(alpha=0.3)
    legend_ax.axis("off")
    legend_ax.legend(*axes[0].get_legend_handles_labels(), fontsize=8, loc="center")
    fig.suptitle(f"{data.get('device', '')} · commit {data.get('commit', '')[:10]} · {data.get('date', '')}",
                 fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def plot_cli(data, path):
    fig, ax = plt.subplots(figsize=(5.5, 4.5))
    for r in data["results"]:
        ax.scatter(r["sparsity"], r["rel_error_mean"], label=r["policy"])
    ax.set_xlabel("achieved sparsity (mean over dumps)")
    ax.set_ylabel("mean relative error vs dense")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("results")
    p.add_argument("--out", default="docs/fidelity.png")
    args = p.parse_args(argv)
    with open(args.results) as f:
        data = json.load(f)
    (plot_cli if "dumps" in data else plot_harness)(data, args.out)
    print(f"plot: wrote {args.out}")


if __name__ == "__main__":
    main()
