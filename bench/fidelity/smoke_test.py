#!/usr/bin/env python3
"""CPU smoke test of the fidelity harness (ctest fidelity.smoke; docs/fidelity.md): the committed checkpoint, the
numpy model, sparsa's CPU backend through the Python binding, a short context of repository text.

1. DENSE through sparsa reproduces the model's own attention (float64 reference) within fp32 noise, at every layer,
   and the logits agree.
2. Δ on SINK_WINDOW computes what ALGORITHMS.md §8 says at every layer: O[i] = O_sparse[i] + (O_dense[r] −
   O_sparse[r]) for rows before the dense tail (r = the row's anchor, itself dense) and O_dense[i] in the tail, within
   fp32 noise; both runs report a sparsity in (0, 1) from their stats. Whether Δ lowers the error is printed, not
   asserted: on the trained checkpoint it does not (docs/fidelity.md, question 1).
3. The harness's head-vote baselines are built right: TokenSelect's soft vote rebuilt on TOKEN_INDICES (the way the
   per-head top-k and 0/1-vote baselines are) gives TOKEN_SELECT's output at every layer.

Exit 77 (skipped) when numpy is missing. Needs SPARSA_LIBRARY (ctest sets it).
"""
import glob
import os
import sys

try:
    import numpy as np
except ImportError:
    print("skipped: numpy is not importable")
    sys.exit(77)

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, HERE)
import harness  # noqa: E402
import numpy_model  # noqa: E402
import sparsa  # noqa: E402  (harness put bindings/python on the path)

SEQ = 512
BATCH = 1
FP32_NOISE = 1e-5             # relative error of an fp32 attention against the float64 reference
LOGIT_TOLERANCE = 1e-4        # relative, over the whole logits tensor
SINK_WINDOW = dict(sink_tokens=4, window=32)
DELTA = dict(gamma=16, tail_min=32)
SELECT_TOP_K = 32             # with the harness's n_init 64 + n_local 256: sparse only past 352 keys



def repository_text():
    """Deterministic bytes to run on: the repository's docs (the held-out split is not committed)."""
    paths = sorted(glob.glob(os.path.join(ROOT, "docs", "*.md"))) + [os.path.join(ROOT, "README.md")]
    return np.frombuffer(b"".join(open(p, "rb").read() for p in paths), dtype=np.uint8)


def delta_oracle(sparse, dense, gamma, tail_min):
    """ALGORITHMS.md §8 from a sparse and a dense output [B, S, H, D]: the Δ-corrected output."""
    rows = sparse.shape[1]
    cut = rows % gamma + max(tail_min, gamma)
    corrected_rows = max(rows - cut, 0)
    out = dense.copy()
    anchors = (np.arange(corrected_rows) // gamma) * gamma
    out[:, :corrected_rows] = sparse[:, :corrected_rows] + (dense[:, anchors] - sparse[:, anchors])
    return out


class DeltaChecker:
    """Attention hook for SINK_WINDOW + Δ: records the error against the float64 dense reference and the difference
    from delta_oracle() built from SINK_WINDOW's own output on the same q/k/v."""

    def __init__(self, ctx):
        self.ctx = ctx
        self.policy = sparsa.SinkWindow(**SINK_WINDOW, delta=sparsa.Delta(**DELTA))
        self.sparse_policy = sparsa.SinkWindow(**SINK_WINDOW)
        self.errors, self.oracle_gaps, self.pairs = [], [], [0, 0]

    def __call__(self, layer, q, k, v):
        res = sparsa.attention(self.ctx, q, k, v, policy=self.policy, causal=True, stats=True)
        sparse = sparsa.attention(self.ctx, q, k, v, policy=self.sparse_policy, causal=True)
        reference = numpy_model.dense_causal_attention(q, k, v)
        self.errors.append(harness.Ops.rel_error(res.out, reference))
        expected = delta_oracle(np.asarray(sparse), reference, DELTA["gamma"], DELTA["tail_min"])
        self.oracle_gaps.append(harness.Ops.rel_error(res.out, expected))
        self.pairs[0] += int(res.stats[sparsa.STAT_PAIRS_COMPUTED])
        self.pairs[1] += int(res.stats[sparsa.STAT_PAIRS_DENSE])
        return res.out

    def sparsity(self):
        return 1.0 - self.pairs[0] / self.pairs[1]


class Recorder:
    """Attention hook: runs sparsa under `policy` and records, per layer, the error against the float64 reference
    on the same q/k/v, and the run's pair counts."""

    def __init__(self, ctx, policy):
        self.ctx, self.policy = ctx, policy
        self.errors, self.pairs = [], [0, 0]

    def __call__(self, layer, q, k, v):
        res = sparsa.attention(self.ctx, q, k, v, policy=self.policy, causal=True, stats=True)
        reference = numpy_model.dense_causal_attention(q, k, v)
        self.errors.append(harness.Ops.rel_error(res.out, reference))
        self.pairs[0] += int(res.stats[sparsa.STAT_PAIRS_COMPUTED])
        self.pairs[1] += int(res.stats[sparsa.STAT_PAIRS_DENSE])
        return res.out

    def sparsity(self):
        return 1.0 - self.pairs[0] / self.pairs[1]


def main():
    checkpoint = os.environ.get("FIDELITY_CHECKPOINT", os.path.join(HERE, "checkpoint.npz"))
    model = numpy_model.NumpyByteLM(checkpoint)
    text = repository_text()
    tokens = harness.heldout_windows(text, SEQ, BATCH)[:, :SEQ].astype(np.int64)
    failures = []
    with sparsa.Context("cpu", num_threads=2) as ctx:
        own_logits = model.forward(tokens)
        dense = Recorder(ctx, sparsa.Dense())
        dense_logits = model.forward(tokens, attention=dense)
        logit_error = harness.Ops.rel_error(dense_logits, own_logits)
        print(f"DENSE via sparsa: per-layer rel. error vs the model's attention {max(dense.errors):.2e} (max), "
              f"logits {logit_error:.2e}")
        if not max(dense.errors) < FP32_NOISE:
            failures.append(f"DENSE per-layer error {max(dense.errors):.3e} >= {FP32_NOISE}")
        if not logit_error < LOGIT_TOLERANCE:
            failures.append(f"DENSE logits error {logit_error:.3e} >= {LOGIT_TOLERANCE}")

        for label, rec in (("SINK_WINDOW", Recorder(ctx, sparsa.SinkWindow(**SINK_WINDOW))),
                           ("SINK_WINDOW+DELTA", DeltaChecker(ctx))):
            model.forward(tokens, attention=rec)
            print(f"{label}: mean per-layer rel. error {np.mean(rec.errors):.4f}, sparsity {rec.sparsity():.3f}, "
                  f"per layer {' '.join(f'{e:.4f}' for e in rec.errors)}")
            if not 0.0 < rec.sparsity() < 1.0:
                failures.append(f"{label} sparsity {rec.sparsity():.3f} outside (0, 1)")
        print(f"SINK_WINDOW+DELTA vs ALGORITHMS.md §8 built from SINK_WINDOW's output: max per-layer rel. difference "
              f"{max(rec.oracle_gaps):.2e}")
        if not max(rec.oracle_gaps) < FP32_NOISE:
            failures.append(f"Δ output differs from the §8 formula by {max(rec.oracle_gaps):.3e}")
        # 3. TOKEN_SELECT vs its soft vote rebuilt on TOKEN_INDICES, chunked as in the harness
        outputs = {}
        for kind in ("token_select", "softvote_indices"):
            captured = outputs.setdefault(kind, [])
            hook = harness.SparsaAttention(ctx, {"policy": kind, "top_k": SELECT_TOP_K})

            def capture(layer, q, k, v, hook=hook, captured=captured):
                out = hook(layer, q, k, v)
                captured.append(out)
                return out
            model.forward(tokens, attention=capture)
            if not 0.0 < hook.sparsity() < 1.0:
                failures.append(f"{kind} sparsity {hook.sparsity():.3f} outside (0, 1)")
        gap = max(harness.Ops.rel_error(a, b) for a, b in zip(outputs["softvote_indices"], outputs["token_select"]))
        print(f"TOKEN_SELECT vs its soft vote on TOKEN_INDICES: max per-layer rel. difference {gap:.2e}")
        if not gap < FP32_NOISE:
            failures.append(f"soft vote on TOKEN_INDICES differs from TOKEN_SELECT by {gap:.3e}")
    for failure in failures:
        print("FAILED:", failure)
    print("fidelity smoke test:", "FAILED" if failures else "passed")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
