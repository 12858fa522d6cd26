"""The fidelity model's forward pass in numpy (fp32), reading the same checkpoint as model.py: for CPU runs without
torch (the smoke test, `harness.py --backend cpu`). Same attention hook: `forward(tokens, attention=fn)` calls
`fn(layer, q, k, v)` with q [B, S, Hq, D], k/v [B, S, Hkv, D] float32 arrays and expects [B, S, Hq, D] back.
"""
import json

import numpy as np


def read_checkpoint(path):
    with np.load(path) as data:
        arrays = {name: data[name].astype(np.float32) for name in data.files if name != "__meta__"}
        meta = json.loads(bytes(data["__meta__"]).decode())
    return arrays, meta


def rms_norm(x, weight, eps):
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * weight


def rope_tables(seq_len, head_dim, base):
    inv_freq = 1.0 / (base ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim))
    angles = np.arange(seq_len, dtype=np.float64)[:, None] * inv_freq[None, :]
    return np.cos(angles).astype(np.float32), np.sin(angles).astype(np.float32)


def apply_rope(x, cos, sin):
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    c, s = cos[None, :, None, :], sin[None, :, None, :]
    return np.concatenate([x1 * c - x2 * s, x2 * c + x1 * s], axis=-1)


def dense_causal_attention(q, k, v):
    """Reference causal attention in float64: q [B, S, Hq, D], k/v [B, S, Hkv, D] -> float32 [B, S, Hq, D]."""
    b, s, hq, d = q.shape
    group = hq // k.shape[2]
    kk = np.repeat(k, group, axis=2).astype(np.float64)
    vv = np.repeat(v, group, axis=2).astype(np.float64)
    scores = np.einsum("bihd,bjhd->bhij", q.astype(np.float64), kk) / np.sqrt(d)
    scores = np.where(np.tril(np.ones((s, s), dtype=bool))[None, None], scores, -np.inf)
    scores -= scores.max(axis=-1, keepdims=True)
    p = np.exp(scores)
    p /= p.sum(axis=-1, keepdims=True)
    return np.einsum("bhij,bjhd->bihd", p, vv).astype(np.float32)


def silu(x):
    return x / (1.0 + np.exp(-x))


class NumpyByteLM:
    def __init__(self, path):
        self.w, meta = read_checkpoint(path)
        self.config = meta["config"]
        self.meta = meta

    def forward(self, tokens, attention=None):
        """tokens int [B, S] -> logits float32 [B, S, vocab]."""
        c, w = self.config, self.w
        hq, hkv, hd, eps = c["n_q_heads"], c["n_kv_heads"], c["head_dim"], c["norm_eps"]
        b, s = tokens.shape
        cos, sin = rope_tables(s, hd, c["rope_base"])
        x = w["embed.weight"][tokens]
        for i in range(c["n_layers"]):
            p = f"layers.{i}."
            h = rms_norm(x, w[p + "attn_norm.weight"], eps)
            q = apply_rope((h @ w[p + "wq.weight"].T).reshape(b, s, hq, hd), cos, sin)
            k = apply_rope((h @ w[p + "wk.weight"].T).reshape(b, s, hkv, hd), cos, sin)
            v = (h @ w[p + "wv.weight"].T).reshape(b, s, hkv, hd)
            q, k, v = (np.ascontiguousarray(t, dtype=np.float32) for t in (q, k, v))
            o = attention(i, q, k, v) if attention is not None else dense_causal_attention(q, k, v)
            x = x + o.reshape(b, s, hq * hd) @ w[p + "wo.weight"].T
            h = rms_norm(x, w[p + "mlp_norm.weight"], eps)
            x = x + (silu(h @ w[p + "w_gate.weight"].T) * (h @ w[p + "w_up.weight"].T)) @ w[p + "w_down.weight"].T
        return rms_norm(x, w["norm.weight"], eps) @ w["head.weight"].T
