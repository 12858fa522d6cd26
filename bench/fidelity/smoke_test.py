#!/usr/bin/env python3
"""CPU smoke test of the fidelity harness (ctest fidelity.smoke; docs/fidelity.md): the committed checkpoint, the
numpy model, sparsa's CPU backend through the Python binding, a short context of repository text.

1. DENSE through sparsa reproduces the model's own attention (float64 reference) within fp32 noise, at every layer,
   and the logits agree.
2. Δ lowers SINK_WINDOW's per-layer attention-output error against dense (the mean over layers), and both runs
   report a sparsity in (0, 1) from their stats.
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

        results = {}
        for label, policy in (("SINK_WINDOW", sparsa.SinkWindow(**SINK_WINDOW)),
                              ("SINK_WINDOW+DELTA", sparsa.SinkWindow(**SINK_WINDOW, delta=sparsa.Delta(**DELTA)))):
            rec = Recorder(ctx, policy)
            model.forward(tokens, attention=rec)
            results[label] = (float(np.mean(rec.errors)), rec.sparsity())
            print(f"{label}: mean per-layer rel. error {results[label][0]:.4f}, sparsity {results[label][1]:.3f}, "
                  f"per layer {' '.join(f'{e:.4f}' for e in rec.errors)}")
            if not 0.0 < rec.sparsity() < 1.0:
                failures.append(f"{label} sparsity {rec.sparsity():.3f} outside (0, 1)")
        if not results["SINK_WINDOW+DELTA"][0] < results["SINK_WINDOW"][0]:
            failures.append(f"Δ did not lower SINK_WINDOW's error: {results['SINK_WINDOW+DELTA'][0]:.4f} >= "
                            f"{results['SINK_WINDOW'][0]:.4f}")
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
