"""The fidelity model: a byte-level Llama-style causal LM (RoPE, RMSNorm, SwiGLU, GQA with Hq/Hkv = 4).

Attention is pluggable: `model(tokens, attention=fn)` calls `fn(layer, q, k, v)` with q [B, S, Hq, D] and k/v
[B, S, Hkv, D] (sparsa's layout, RoPE applied) and expects [B, S, Hq, D] back; `attention=None` is causal dense
attention (torch's scaled_dot_product_attention where it exists, torch >= 2.0; a plain softmax otherwise).

Works with torch 1.13 (Debian, CPU) and torch 2.x (the device). The checkpoint is an .npz of fp16 weights plus the
config as JSON (`save_checkpoint` / `load_checkpoint`), which numpy_model.py reads without torch.

Size (docs/fidelity.md): d_model 384, 6 layers, 8 query heads and 2 kv heads of dim 64, SwiGLU hidden 640, vocab 256:
about 7.6 M parameters, 14.4 MiB in fp16.
"""
import json
import math

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

DEFAULT_CONFIG = dict(vocab=256, d_model=384, n_layers=6, n_q_heads=8, n_kv_heads=2, head_dim=64, ffn_hidden=640,
                      rope_base=50000.0, norm_eps=1e-5)
TINY_CONFIG = dict(vocab=256, d_model=64, n_layers=2, n_q_heads=4, n_kv_heads=1, head_dim=16, ffn_hidden=128,
                   rope_base=50000.0, norm_eps=1e-5)
HAS_SDPA = hasattr(F, "scaled_dot_product_attention")


def rope_tables(seq_len, head_dim, base, device=None, dtype=torch.float32):
    """cos, sin [S, D/2] of rotary position embedding (half-split pairing: x[:D/2] rotates with x[D/2:])."""
    inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
    angles = torch.arange(seq_len, dtype=torch.float64)[:, None] * inv_freq[None, :]
    return angles.cos().to(device=device, dtype=dtype), angles.sin().to(device=device, dtype=dtype)


def apply_rope(x, cos, sin):
    """x [B, S, H, D]; cos/sin [S, D/2]."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    c, s = cos[None, :, None, :].to(x.dtype), sin[None, :, None, :].to(x.dtype)
    return torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1)


def dense_causal_attention(q, k, v):
    """Causal attention in sparsa's layout: q [B, S, Hq, D], k/v [B, S, Hkv, D] -> [B, S, Hq, D]."""
    group = q.shape[2] // k.shape[2]
    qt = q.transpose(1, 2)
    kt = k.transpose(1, 2).repeat_interleave(group, dim=1)
    vt = v.transpose(1, 2).repeat_interleave(group, dim=1)
    if HAS_SDPA:
        out = F.scaled_dot_product_attention(qt, kt, vt, is_causal=True)
    else:
        seq = q.shape[1]
        scores = (qt @ kt.transpose(-1, -2)).float() / math.sqrt(q.shape[-1])
        mask = torch.ones(seq, seq, dtype=torch.bool, device=q.device).triu(1)
        scores = scores.masked_fill(mask, float("-inf"))
        out = (scores.softmax(-1).to(vt.dtype) @ vt)
    return out.transpose(1, 2)


class RMSNorm(nn.Module):
    def __init__(self, dim, eps):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        xf = x.float()
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype) * self.weight.to(x.dtype)


class Block(nn.Module):
    def __init__(self, c):
        super().__init__()
        d, hq, hkv, hd = c["d_model"], c["n_q_heads"], c["n_kv_heads"], c["head_dim"]
        self.hq, self.hkv, self.hd = hq, hkv, hd
        self.attn_norm = RMSNorm(d, c["norm_eps"])
        self.wq = nn.Linear(d, hq * hd, bias=False)
        self.wk = nn.Linear(d, hkv * hd, bias=False)
        self.wv = nn.Linear(d, hkv * hd, bias=False)
        self.wo = nn.Linear(hq * hd, d, bias=False)
        self.mlp_norm = RMSNorm(d, c["norm_eps"])
        self.w_gate = nn.Linear(d, c["ffn_hidden"], bias=False)
        self.w_up = nn.Linear(d, c["ffn_hidden"], bias=False)
        self.w_down = nn.Linear(c["ffn_hidden"], d, bias=False)

    def forward(self, x, cos, sin, attention, layer):
        b, s, _ = x.shape
        h = self.attn_norm(x)
        q = apply_rope(self.wq(h).view(b, s, self.hq, self.hd), cos, sin)
        k = apply_rope(self.wk(h).view(b, s, self.hkv, self.hd), cos, sin)
        v = self.wv(h).view(b, s, self.hkv, self.hd)
        o = attention(layer, q, k, v) if attention is not None else dense_causal_attention(q, k, v)
        x = x + self.wo(o.reshape(b, s, self.hq * self.hd).to(x.dtype))
        h = self.mlp_norm(x)
        return x + self.w_down(F.silu(self.w_gate(h)) * self.w_up(h))


class ByteLM(nn.Module):
    def __init__(self, config=None):
        super().__init__()
        self.config = dict(config or DEFAULT_CONFIG)
        c = self.config
        if c["n_q_heads"] % c["n_kv_heads"]:
            raise ValueError("n_q_heads must be a multiple of n_kv_heads")
        self.embed = nn.Embedding(c["vocab"], c["d_model"])
        self.layers = nn.ModuleList([Block(c) for _ in range(c["n_layers"])])
        self.norm = RMSNorm(c["d_model"], c["norm_eps"])
        self.head = nn.Linear(c["d_model"], c["vocab"], bias=False)
        self._rope_cache = {}
        self.reset_parameters()

    def reset_parameters(self):
        std = 0.02
        for name, p in self.named_parameters():
            if p.dim() == 2:
                nn.init.normal_(p, 0.0, std)
            if name.endswith("wo.weight") or name.endswith("w_down.weight"):  # GPT-2's residual scaling
                nn.init.normal_(p, 0.0, std / math.sqrt(2 * self.config["n_layers"]))

    def rope(self, seq_len, device):
        key = (seq_len, str(device))
        if key not in self._rope_cache:
            self._rope_cache = {key: rope_tables(seq_len, self.config["head_dim"], self.config["rope_base"], device)}
        return self._rope_cache[key]

    def forward(self, tokens, attention=None, rope=None):
        """tokens int64 [B, S] -> logits [B, S, vocab] (fp32). `rope`: the (cos, sin) of self.rope(S, device),
        passed in by the training loop so that a compiled forward does not build them."""
        cos, sin = rope if rope is not None else self.rope(tokens.shape[1], tokens.device)
        x = self.embed(tokens)
        for i, layer in enumerate(self.layers):
            x = layer(x, cos, sin, attention, i)
        x = self.norm(x).float()
        if x.is_cuda:  # the output layer in fp32 even under bf16 autocast: perplexity differences of 1 % are measured
            with torch.autocast("cuda", enabled=False):
                return self.head(x)
        return self.head(x)


def parameter_count(model):
    return sum(p.numel() for p in model.parameters())


def save_checkpoint(model, path, extra=None):
    """fp16 weights + the config (and `extra`, e.g. the training summary) as JSON, in one .npz."""
    arrays = {name: p.detach().float().cpu().numpy().astype(np.float16) for name, p in model.state_dict().items()}
    meta = {"config": model.config, "extra": extra or {}}
    arrays["__meta__"] = np.frombuffer(json.dumps(meta).encode(), dtype=np.uint8)
    np.savez(path, **arrays)


def read_checkpoint_arrays(path):
    """{name: fp16 array} and the metadata dict of a checkpoint (numpy only)."""
    with np.load(path) as data:
        arrays = {name: data[name] for name in data.files if name != "__meta__"}
        meta = json.loads(bytes(data["__meta__"]).decode())
    return arrays, meta


def load_checkpoint(path, device="cpu", dtype=torch.float32):
    arrays, meta = read_checkpoint_arrays(path)
    model = ByteLM(meta["config"])
    model.load_state_dict({name: torch.from_numpy(a.astype(np.float32)) for name, a in arrays.items()})
    return model.to(device=device, dtype=dtype).eval(), meta
