#!/usr/bin/env python3
"""The fidelity harness: the fidelity model (model.py / numpy_model.py) with its attention computed by sparsa under
each policy, measured against dense attention (docs/fidelity.md).

    SPARSA_LIBRARY=build/dev/libsparsa.so python3 bench/fidelity/harness.py --backend cuda \
        --checkpoint bench/fidelity/checkpoint.npz --out results.json                  # the device sweep
    SPARSA_LIBRARY=build/cpu/libsparsa.so /usr/bin/python3 bench/fidelity/harness.py --backend cpu --quick ...

Backends: `cuda` runs model.py (torch, bf16 autocast as in training) and sparsa on torch tensors through DLPack
(sparsa.attention on a Context("cuda") bound to torch's stream: the torch custom op sparsa.torch_ops returns no run
statistics, so it is only used to cross-check the DENSE output); `cpu` runs numpy_model.py (fp32) and sparsa on
numpy arrays.

For every policy configuration it reports: achieved sparsity (1 − pairs computed / pairs dense, summed over every
sparsa call of the run, from the runs' stats), byte-level perplexity on held-out text at 4K and 8K, passkey and
multi-key retrieval accuracy by depth, and per layer the relative error ‖o − o_dense‖/‖o_dense‖ of the attention
output against dense attention on the same q/k/v (the layer's inputs under the policy, so the error is that layer's
own). Policies whose selection is per call of a chunk of queries (TOKEN_SELECT and the head-vote baselines built on
TOKEN_INDICES) run as chunked prefill: CHUNK query rows at a time against the whole prefix.
"""
import argparse
import json
import math
import os
import platform
import subprocess
import sys
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(ROOT, "bindings", "python"))
import sparsa  # noqa: E402
import tasks  # noqa: E402

CHUNK = 512                   # query rows per call of the chunked policies (TokenSelect's chunked prefill)
SINKS = 64                    # SINK_WINDOW's sink tokens in every sweep point
SELECT_INIT, SELECT_LOCAL = 64, 256
DELTA = dict(gamma=64, tail_min=128)
DEPTHS = (0.05, 0.25, 0.5, 0.75, 0.95)
INDEX_BLOCK = 64              # TOKEN_INDICES sweep: block ids of 64 tokens
PV_L1_OVER_L1 = 0.08 / 0.07   # sparge_tune's PV-skip target relative to its L1 target (the defaults' ratio)


# ---- array operations on numpy arrays or torch tensors ------------------------------------------------------------

def is_torch(x):
    return type(x).__module__.split(".")[0] == "torch"


class Ops:
    """The few operations the selection baselines need, on numpy arrays or torch tensors alike."""

    @staticmethod
    def f32(x):
        return x.float() if is_torch(x) else x.astype(np.float32)

    @staticmethod
    def topk_sorted(scores, k):
        """Indices of the k largest entries along the last axis (ties: smaller index), ascending, int32."""
        if is_torch(scores):
            import torch
            n = scores.shape[-1]
            # a tiny index-decreasing offset makes the smaller index win ties, as the spec's top-k does
            bias = -torch.arange(n, device=scores.device, dtype=torch.float64) * 1e-12
            idx = torch.topk(scores.double() + bias, k, dim=-1).indices
            return torch.sort(idx, dim=-1).values.to(torch.int32).contiguous()
        idx = np.argsort(-scores, axis=-1, kind="stable")[..., :k]
        return np.sort(idx, axis=-1).astype(np.int32)

    @staticmethod
    def softmax(x):
        if is_torch(x):
            return x.double().softmax(-1)
        e = np.exp(x - x.max(-1, keepdims=True))
        return e / e.sum(-1, keepdims=True)

    @staticmethod
    def rel_error(a, b):
        if is_torch(a):
            a, b = a.double(), b.double()
            return float((a - b).norm() / b.norm().clamp(min=1e-30))
        a, b = a.astype(np.float64), b.astype(np.float64)
        return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def candidate_scores(q_chunk, k_prefix, group):
    """s[b, h, t] = q̄_h · K[t, h/g] (TokenSelect's raw dot product) over the whole prefix."""
    if is_torch(q_chunk):
        import torch
        qbar = q_chunk.float().mean(1)                                   # [B, Hq, D]
        kk = k_prefix.float().repeat_interleave(group, dim=2)             # [B, N, Hq, D]
        return torch.einsum("bhd,bnhd->bhn", qbar, kk)
    qbar = q_chunk.astype(np.float64).mean(1)
    kk = np.repeat(k_prefix.astype(np.float64), group, axis=2)
    return np.einsum("bhd,bnhd->bhn", qbar, kk)


# ---- policies -----------------------------------------------------------------------------------------------------

def policy_label(spec):
    parts = [spec["policy"]] + [f"{k}={v}" for k, v in spec.items() if k not in ("policy", "delta")]
    return " ".join(parts) + (" +delta" if spec.get("delta") else "")


def make_policy(spec, head_params=None):
    """The sparsa policy of a whole-sequence spec (None for the chunked ones)."""
    delta = sparsa.Delta(**DELTA) if spec.get("delta") else None
    kind = spec["policy"]
    if kind == "dense":
        return sparsa.Dense()
    if kind == "sink_window":
        return sparsa.SinkWindow(sink_tokens=SINKS, window=spec["window"], delta=delta)
    if kind in ("sparge", "sage"):
        return sparsa.Sparge(theta=spec.get("theta", -1.0), tau=spec.get("tau", 0.98), attention_sink=True,
                             quantized=kind == "sage", delta=delta)
    if kind == "sparge_tuned":
        return sparsa.Sparge(attention_sink=True, head_params=head_params, delta=delta)
    if kind == "token_sparse":
        return sparsa.TokenSparse(window=128, coverage=spec["coverage"], min_tokens=spec.get("min_tokens", 256),
                                  delta=delta)
    return None


CHUNKED = ("token_select", "token_select_kv", "topk_per_head", "vote01", "token_indices", "softvote_indices")


def chunk_policy(spec, q, k, group):
    """The sparsa policy of one chunk (q: the chunk's rows, k: the whole prefix) for the chunked kinds."""
    kind, n = spec["policy"], k.shape[1]
    if kind in ("token_select", "token_select_kv"):
        return sparsa.TokenSelect(n_init=SELECT_INIT, n_local=SELECT_LOCAL, top_k=spec["top_k"], cache_theta=1.0,
                                  per_kv_head=kind == "token_select_kv")
    if kind == "token_indices":
        blocks = (n + INDEX_BLOCK - 1) // INDEX_BLOCK
        keep = max(1, min(blocks, int(round(spec["density"] * blocks))))
        # the draft: q̄ of the chunk against each block's mean key, per kv head, summed over the group's heads
        s = candidate_scores(q, k, group)                                  # [B, Hq, N]
        pad = blocks * INDEX_BLOCK - n
        if is_torch(s):
            import torch.nn.functional as F
            p = Ops.softmax(s)
            p = F.pad(p, (0, pad)).reshape(p.shape[0], p.shape[1], blocks, INDEX_BLOCK).sum(-1)
            p = p.reshape(p.shape[0], -1, group, blocks).sum(2)
        else:
            p = np.pad(Ops.softmax(s), ((0, 0), (0, 0), (0, pad))).reshape(s.shape[0], s.shape[1], blocks, -1).sum(-1)
            p = p.reshape(p.shape[0], -1, group, blocks).sum(2)
        return sparsa.TokenIndices(Ops.topk_sorted(p, keep), block_size=INDEX_BLOCK, n_init=SELECT_INIT,
                                   n_local=SELECT_LOCAL)
    # head-vote baselines of TokenSelect at TokenSelect's budget, through TOKEN_INDICES (not in the C API)
    top_k = spec["top_k"]
    if SELECT_INIT + top_k + SELECT_LOCAL >= n:
        return sparsa.Dense()  # TokenSelect goes dense here too (§6 step 2)
    s = candidate_scores(q, k, group)[..., SELECT_INIT:n - SELECT_LOCAL]
    if kind == "topk_per_head":
        idx = Ops.topk_sorted(s, top_k) + SELECT_INIT                     # [B, Hq, top_k]
    elif kind == "softvote_indices":  # TokenSelect's own soft vote (§6 step 3): checks this construction
        idx = Ops.topk_sorted(Ops.softmax(s).sum(1), top_k)[:, None, :] + SELECT_INIT
        idx = idx.contiguous() if is_torch(idx) else np.ascontiguousarray(idx)
    else:  # vote01: each head votes for its own top_k; the top_k most voted win (ties: larger soft vote)
        own = Ops.topk_sorted(s, top_k)
        soft = Ops.softmax(s).sum(1)                                       # [B, C]
        hq = s.shape[1]
        if is_torch(s):
            import torch
            votes = torch.zeros_like(soft)
            votes.scatter_add_(1, own.reshape(own.shape[0], -1).long(),
                               torch.ones(own.shape[0], own.shape[1] * top_k, device=s.device, dtype=soft.dtype))
        else:
            votes = np.zeros_like(soft)
            for b in range(own.shape[0]):
                np.add.at(votes[b], own[b].reshape(-1), 1.0)
        idx = Ops.topk_sorted(votes * (hq + 1) + soft, top_k)[:, None, :] + SELECT_INIT   # [B, 1, top_k]
        idx = idx.contiguous() if is_torch(idx) else np.ascontiguousarray(idx)
    return sparsa.TokenIndices(idx, n_init=SELECT_INIT, n_local=SELECT_LOCAL)


# ---- sparsa as the model's attention ------------------------------------------------------------------------------

class SparsaAttention:
    """The model's attention hook: runs sparsa under `spec`, accumulates the runs' stats, and (when `compare`) the
    per-layer relative error against sparsa's DENSE on the same inputs."""

    def __init__(self, ctx, spec, compare=False, head_params=None):
        self.ctx, self.spec, self.compare = ctx, spec, compare
        self.head_params = head_params or {}
        self.pairs = [0, 0]
        self.layer_errors = {}

    def _run(self, q, k, v, policy):
        res = sparsa.attention(self.ctx, q, k, v, policy=policy, causal=True, stats=True)
        st = res.stats
        st = st.cpu().numpy() if is_torch(st) else st
        self.pairs[0] += int(st[sparsa.STAT_PAIRS_COMPUTED])
        self.pairs[1] += int(st[sparsa.STAT_PAIRS_DENSE])
        return res.out

    def __call__(self, layer, q, k, v):
        q, k, v = (t.contiguous() if is_torch(t) else np.ascontiguousarray(t) for t in (q, k, v))
        kind = self.spec["policy"]
        if kind in CHUNKED:
            out = q.new_empty(q.shape) if is_torch(q) else np.empty_like(q)
            group = q.shape[2] // k.shape[2]
            for c0 in range(0, q.shape[1], CHUNK):
                c1 = min(c0 + CHUNK, q.shape[1])
                qc, kc, vc = q[:, c0:c1], k[:, :c1], v[:, :c1]
                if is_torch(q):
                    qc, kc, vc = qc.contiguous(), kc.contiguous(), vc.contiguous()
                else:
                    qc, kc, vc = (np.ascontiguousarray(t) for t in (qc, kc, vc))
                out[:, c0:c1] = self._run(qc, kc, vc, chunk_policy(self.spec, qc, kc, group))
        else:
            out = self._run(q, k, v, make_policy(self.spec, self.head_params.get(layer)))
        if self.compare:
            dense = sparsa.attention(self.ctx, q, k, v, causal=True)
            errs = self.layer_errors.setdefault(layer, [])
            errs.append(Ops.rel_error(out, dense))
        return out

    def sparsity(self):
        return 1.0 - self.pairs[0] / self.pairs[1] if self.pairs[1] else 0.0


# ---- models -------------------------------------------------------------------------------------------------------

class TorchRunner:
    """model.py as trained on the GPU: fp32 weights and residual stream under bf16 autocast (so q/k/v reach sparsa
    in bf16); `device="cpu"` runs it in fp32 without autocast on torch's CPU tensors (to test this path)."""

    def __init__(self, checkpoint, device="cuda"):
        import contextlib
        import torch
        import model as model_lib
        self.torch, self.device = torch, device
        self.model, self.meta = model_lib.load_checkpoint(checkpoint, device=device, dtype=torch.float32)
        self.config = self.meta["config"]
        self.autocast = ((lambda: torch.autocast("cuda", dtype=torch.bfloat16)) if device == "cuda"
                         else contextlib.nullcontext)

    def context(self):
        if self.device != "cuda":
            return sparsa.Context("cpu")
        # torch's default stream is handle 0, which DLPack cannot name: None = the legacy default stream
        return sparsa.Context("cuda", stream=self.torch.cuda.current_stream().cuda_stream or None)

    def nll_and_pred(self, tokens, attention):
        """tokens uint8 [B, S] -> (nll float64 [B, S-1], argmax int [B, S-1]) of predicting byte t+1 at t."""
        torch = self.torch
        with torch.no_grad(), self.autocast():
            t = torch.from_numpy(tokens.astype(np.int64)).to(self.device)
            logits = self.model(t[:, :-1], attention=attention).float()
            logp = torch.log_softmax(logits, -1)
            nll = -logp.gather(-1, t[:, 1:, None])[..., 0]
            return nll.double().cpu().numpy(), logits.argmax(-1).cpu().numpy()


class NumpyRunner:
    def __init__(self, checkpoint):
        import numpy_model
        self.model = numpy_model.NumpyByteLM(checkpoint)
        self.config = self.model.config
        self.meta = self.model.meta

    def context(self):
        return sparsa.Context("cpu")

    def nll_and_pred(self, tokens, attention):
        logits = self.model.forward(tokens[:, :-1].astype(np.int64), attention=attention).astype(np.float64)
        m = logits.max(-1, keepdims=True)
        logz = (m + np.log(np.exp(logits - m).sum(-1, keepdims=True)))[..., 0]
        target = tokens[:, 1:].astype(np.int64)
        nll = logz - np.take_along_axis(logits, target[..., None], -1)[..., 0]
        return nll, logits.argmax(-1)


# ---- evaluation ---------------------------------------------------------------------------------------------------

def heldout_windows(text, length, count):
    """`count` fixed, evenly spaced windows of length+1 bytes of held-out text."""
    stride = (len(text) - length - 1) // max(count, 1)
    return np.stack([text[i * stride:i * stride + length + 1] for i in range(count)])


def retrieval_set(text, length, per_depth, maker, seed):
    rng = np.random.default_rng(seed)
    samples = {}
    for depth in DEPTHS:
        rows = [maker(rng, text, length + 1, depth=depth) for _ in range(per_depth)]
        samples[depth] = (np.stack([np.frombuffer(s, np.uint8) for s, _ in rows]), np.stack([m for _, m in rows]))
    return samples


def evaluate(runner, ctx, spec, data, args, head_params=None):
    result = {"label": policy_label(spec), **spec}
    t0 = time.time()
    for name, windows in (("4k", data["ppl_4k"]), ("8k", data["ppl_8k"])):
        if windows is None:
            continue
        attn = SparsaAttention(ctx, spec, compare=name == "4k", head_params=head_params)
        nll, _ = runner.nll_and_pred(windows, attn)
        result[f"bits_per_byte_{name}"] = float(nll.mean() / math.log(2))
        result[f"ppl_{name}"] = float(math.exp(nll.mean()))
        result[f"sparsity_{name}"] = attn.sparsity()
        if name == "4k":
            result["layer_rel_error"] = [float(np.mean(attn.layer_errors[i])) for i in sorted(attn.layer_errors)]
    for task in ("passkey", "multikey"):
        by_depth = {}
        attn = SparsaAttention(ctx, spec, head_params=head_params)
        for depth, (tokens, masks) in data[task].items():
            correct = []
            for b0 in range(0, len(tokens), args.batch):
                tok, mask = tokens[b0:b0 + args.batch], masks[b0:b0 + args.batch]
                _, pred = runner.nll_and_pred(tok, attn)
                ok = (pred == tok[:, 1:]) | ~mask[:, 1:]
                correct += list(ok.all(-1))
            by_depth[str(depth)] = float(np.mean(correct))
        result[f"{task}_by_depth"] = by_depth
        result[f"{task}_acc"] = float(np.mean(list(by_depth.values())))
        result[f"sparsity_{task}"] = attn.sparsity()
    result["seconds"] = round(time.time() - t0, 2)
    return result


def tune_sparge(runner, ctx, windows, l1):
    """Per-layer sparge_tune head parameters at relative-L1 target `l1`, calibrated on the first held-out window."""
    params, metrics = {}, {}

    def hook(layer, q, k, v):
        q, k, v = (t.contiguous() if is_torch(t) else np.ascontiguousarray(t) for t in (q, k, v))
        p, m = sparsa.sparge_tune(ctx, q, k, v, policy=sparsa.Sparge(attention_sink=True), causal=True, l1=l1,
                                  pv_l1=l1 * PV_L1_OVER_L1)
        params[layer] = p
        metrics[layer] = (m.cpu().numpy() if is_torch(m) else m).tolist()
        return sparsa.attention(ctx, q, k, v, causal=True)

    runner.nll_and_pred(windows[:1], hook)
    return params, metrics


def spread_order(values):
    """The sweep values, extremes and middle first, so that a sweep cut short by its time limit still spans the knob."""
    values = list(values)
    first = [values[0], values[-1], values[len(values) // 2]] if len(values) > 2 else values
    seen = []
    for v in first + values:
        if v not in seen:
            seen.append(v)
    return seen


def sweep_specs(quick, l1_targets=()):
    """Every configuration of the sweep: each policy's main knob, Δ off and on where Δ applies. Ordered round-robin
    over the curves (DENSE first), each curve's values spread_order'ed, so every curve gets points early."""
    windows = (128, 512) if quick else (128, 256, 512, 1024, 2048)
    taus = (0.5, 0.9) if quick else (0.3, 0.5, 0.7, 0.85, 0.95, 0.99)
    coverages = (0.05,) if quick else (0.001, 0.005, 0.02, 0.05, 0.1, 0.2)
    top_ks = (128,) if quick else (128, 256, 512, 1024, 2048)
    densities = (0.25,) if quick else (0.05, 0.1, 0.2, 0.3, 0.5)
    curves = []
    for delta in (False, True):
        curves.append([{"policy": "sink_window", "window": w, "delta": delta} for w in spread_order(windows)])
        curves.append([{"policy": "sparge", "tau": t, "delta": delta} for t in spread_order(taus)])
        curves.append([{"policy": "token_sparse", "coverage": c, "delta": delta} for c in spread_order(coverages)])
    curves.append([{"policy": "sage", "tau": t} for t in spread_order(taus)])
    for kind in ("token_select", "topk_per_head", "vote01", "token_select_kv"):
        curves.append([{"policy": kind, "top_k": k} for k in spread_order(top_ks)])
    curves.append([{"policy": "token_indices", "density": d} for d in spread_order(densities)])
    if l1_targets:
        curves.append([{"policy": "sparge_tuned", "l1": l1} for l1 in spread_order(l1_targets)])
    specs = [{"policy": "dense"}]
    for i in range(max(len(c) for c in curves)):
        specs += [c[i] for c in curves if i < len(c)]
    return specs


def summarize(results):
    """The numbers docs/fidelity.md's questions ask for, from the sweep's results."""
    dense = next((r for r in results if r["policy"] == "dense"), None)
    if dense is None:
        return {}
    summary = {"delta_recovery": [], "max_sparsity_within_budget": {}, "head_vote": [], "sage_vs_sparge": [],
               "sparge_tune": []}

    def retrieval_ok(r):
        return all(r[f"{t}_acc"] >= 0.95 * dense[f"{t}_acc"] for t in ("passkey", "multikey"))

    def find(policy, **knobs):
        return next((r for r in results if r["policy"] == policy and all(r.get(k) == v for k, v in knobs.items())),
                    None)

    for r in results:
        if r["policy"] == "sink_window" and not r.get("delta"):
            d = find("sink_window", window=r["window"], delta=True)
            if d is None:
                continue
            entry = {"window": r["window"], "sparsity_4k": r["sparsity_4k"], "sparsity_4k_delta": d["sparsity_4k"]}
            for metric, sign in (("ppl_4k", 1), ("ppl_8k", 1), ("passkey_acc", -1), ("multikey_acc", -1)):
                if metric in r and metric in d:
                    loss = sign * (r[metric] - dense[metric])
                    entry[f"{metric}_recovered"] = (sign * (r[metric] - d[metric]) / loss) if abs(loss) > 1e-12 \
                        else None
            summary["delta_recovery"].append(entry)
        key = r["policy"] + ("+delta" if r.get("delta") else "")
        if r["policy"] != "dense" and r["ppl_4k"] <= 1.01 * dense["ppl_4k"] and retrieval_ok(r):
            best = summary["max_sparsity_within_budget"].get(key)
            if best is None or r["sparsity_4k"] > best["sparsity_4k"]:
                summary["max_sparsity_within_budget"][key] = {"sparsity_4k": r["sparsity_4k"], "label": r["label"]}
        if r["policy"] == "token_select":
            row = {"top_k": r["top_k"]}
            for kind in ("token_select", "token_select_kv", "topk_per_head", "vote01"):
                other = find(kind, top_k=r["top_k"])
                if other is not None:
                    row[kind] = {m: other[m] for m in ("sparsity_4k", "ppl_4k", "ppl_8k", "passkey_acc", "multikey_acc")
                                 if m in other}
            summary["head_vote"].append(row)
        if r["policy"] == "sage":
            plain = find("sparge", tau=r["tau"], delta=False)
            if plain is not None:
                summary["sage_vs_sparge"].append({"tau": r["tau"], "ppl_4k_sage": r["ppl_4k"],
                                                  "ppl_4k_sparge": plain["ppl_4k"],
                                                  "sparsity_sage": r["sparsity_4k"],
                                                  "sparsity_sparge": plain["sparsity_4k"]})
        if r["policy"] == "sparge_tuned":
            summary["sparge_tune"].append({"l1_target": r["l1"], "sparsity_4k": r["sparsity_4k"],
                                           "ppl_ratio_4k": r["ppl_4k"] / dense["ppl_4k"],
                                           "mean_layer_rel_error": float(np.mean(r["layer_rel_error"]))})
    return summary


def git_commit():
    try:
        return subprocess.check_output(["git", "-C", ROOT, "rev-parse", "HEAD"], text=True).strip()
    except Exception:
        return "unknown"


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--backend", choices=("cuda", "cpu", "torch-cpu"), default="cuda",
                   help="cuda: torch model + GPU sparsa; cpu: numpy model; torch-cpu: the torch path on the CPU")
    p.add_argument("--checkpoint", default=os.path.join(HERE, "checkpoint.npz"))
    p.add_argument("--heldout", default=os.path.join(HERE, "data", "heldout.bin"))
    p.add_argument("--out", default="fidelity_results.json")
    p.add_argument("--len-4k", type=int, default=4096, help="perplexity context (the 4K column)")
    p.add_argument("--len-8k", type=int, default=8192, help="perplexity context (the 8K column; 0 = skip)")
    p.add_argument("--windows-4k", type=int, default=4)
    p.add_argument("--windows-8k", type=int, default=2)
    p.add_argument("--retrieval-len", type=int, default=4096)
    p.add_argument("--per-depth", type=int, default=8, help="retrieval samples per depth and task")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--l1-targets", default="0.03,0.07,0.15,0.3", help="sparge_tune targets ('' = skip)")
    p.add_argument("--quick", action="store_true", help="two points per knob (CPU runs)")
    p.add_argument("--only", default="", help="comma list of policy kinds to run (default all)")
    p.add_argument("--time-limit", type=float, default=0, help="stop starting new configurations after S seconds")
    args = p.parse_args(argv)

    runner = (NumpyRunner(args.checkpoint) if args.backend == "cpu" else
              TorchRunner(args.checkpoint, "cuda" if args.backend == "cuda" else "cpu"))
    text = tasks.load_bytes(args.heldout)
    data = {"ppl_4k": heldout_windows(text, args.len_4k, args.windows_4k),
            "ppl_8k": heldout_windows(text, args.len_8k, args.windows_8k) if args.len_8k else None,
            "passkey": retrieval_set(text, args.retrieval_len, args.per_depth, tasks.passkey_sample, 11),
            "multikey": retrieval_set(text, args.retrieval_len, args.per_depth, tasks.multikey_sample, 12)}
    only = set(filter(None, args.only.split(",")))
    l1_targets = [float(x) for x in args.l1_targets.split(",") if x]
    specs = [s for s in sweep_specs(args.quick, l1_targets)
             if not only or s["policy"] in only or s["policy"] == "dense"]
    out = {"device": platform.node(), "backend": args.backend, "commit": git_commit(),
           "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "checkpoint": args.checkpoint,
           "model": runner.config, "training": runner.meta.get("extra", {}), "settings": vars(args),
           "sparsa_version": sparsa.__version__, "results": [], "errors": []}
    if args.backend == "cuda":
        out["device"] = runner.torch.cuda.get_device_name(0) + " on " + platform.node()
    start = time.time()

    def save():
        with open(args.out, "w") as f:
            json.dump(out, f, indent=1)

    with runner.context() as ctx:
        if args.backend != "cpu":  # the model's own attention (SDPA) vs sparsa DENSE through the torch op
            out["model_attention"] = evaluate_model_attention(runner, data)
        for spec in specs:
            if args.time_limit and time.time() - start > args.time_limit:
                out["errors"].append(f"time limit: skipped {policy_label(spec)}")
                continue
            try:
                head_params = tune_metrics = None
                if spec["policy"] == "sparge_tuned":
                    head_params, tune_metrics = tune_sparge(runner, ctx, data["ppl_4k"], spec["l1"])
                res = evaluate(runner, ctx, spec, data, args, head_params=head_params)
                if tune_metrics is not None:
                    res["tune_metrics"] = tune_metrics
            except Exception as exc:  # one failing configuration must not lose the others
                out["errors"].append(f"{policy_label(spec)}: {type(exc).__name__}: {exc}")
                print(f"harness: FAILED {policy_label(spec)}: {exc}", flush=True)
                continue
            out["results"].append(res)
            print(f"harness: {res['label']:<42} sparsity {res['sparsity_4k']:.3f}  ppl4k {res['ppl_4k']:.4f}  "
                  f"passkey {res['passkey_acc']:.2f}  multikey {res['multikey_acc']:.2f}  ({res['seconds']} s)",
                  flush=True)
            save()
    out["seconds"] = round(time.time() - start, 1)
    out["summary"] = summarize(out["results"])
    save()
    print(f"harness: {len(out['results'])} configurations, {len(out['errors'])} errors, {out['seconds']} s; "
          f"wrote {args.out}")
    return out


def evaluate_model_attention(runner, data):
    """Perplexity with the model's own attention, and the largest gap between sparsa's DENSE through the torch custom
    op and the model's attention on one window's first layer."""
    import model as model_lib
    nll, _ = runner.nll_and_pred(data["ppl_4k"], None)
    info = {"ppl_4k": float(math.exp(nll.mean()))}
    try:
        from sparsa import torch_ops
        captured = {}

        def hook(layer, q, k, v):
            if layer == 0:
                ref = model_lib.dense_causal_attention(q, k, v)
                mine = torch_ops.attention(q.contiguous(), k.contiguous(), v.contiguous(), causal=True)
                captured["rel_error"] = Ops.rel_error(mine, ref)
            return model_lib.dense_causal_attention(q, k, v)

        runner.nll_and_pred(data["ppl_4k"][:1], hook)
        info["torch_op_dense_vs_sdpa_rel_error_layer0"] = captured.get("rel_error")
    except Exception as exc:
        info["torch_op_error"] = f"{type(exc).__name__}: {exc}"
    return info


if __name__ == "__main__":
    main()
