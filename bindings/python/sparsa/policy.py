"""Selection policies (ALGORITHMS.md §1–§8): one class per kind, keyword defaults as in the spec.

Each class maps its Python keywords onto sparsa_policy fields (`_PARAMS`: keyword → C field); `to_c` fills a
sparsa_policy from sparsa_policy_init(kind) and those values. Δ (§8) composes with any prefill policy:
`SinkWindow(sink_tokens=4, window=1024, delta=Delta(gamma=64))`.
"""
import ctypes
import math

from . import _library as L
from .tensor import as_tensor


class Delta:
    """§8 Δ-Attention correction: dense anchor rows every `gamma` rows and a dense tail of at least `tail_min`."""

    def __init__(self, gamma=64, tail_min=128):
        self.gamma = gamma
        self.tail_min = tail_min

    def __repr__(self):
        return f"Delta(gamma={self.gamma}, tail_min={self.tail_min})"


class Policy:
    """Base of the policy classes. Subclasses set KIND, _PARAMS (scalar keyword → C field) and _TENSORS (tensor
    keyword → C field)."""

    KIND = None
    _PARAMS = {}
    _TENSORS = {}

    def __init__(self, delta=None, **values):
        self.delta = delta
        self._values = values

    def __getattr__(self, name):
        values = self.__dict__.get("_values", {})
        if name in values:
            return values[name]
        raise AttributeError(name)

    def __repr__(self):
        shown = ", ".join(f"{k}={v!r}" for k, v in self._values.items() if k not in self._TENSORS)
        delta = f", delta={self.delta!r}" if self.delta else ""
        return f"{type(self).__name__}({shown}{delta})"

    def _scalars_to_c(self):
        c = L.CPolicy()
        L.call("sparsa_policy_init", ctypes.byref(c), ctypes.sizeof(c), self.KIND)
        for name, value in self.scalar_fields().items():
            setattr(c, name, value)
        return c

    def to_c(self, keep, stream=None):
        """The sparsa_policy for this policy. Tensor views are appended to `keep`, which must outlive the call."""
        c = self._scalars_to_c()
        for keyword, field in self._TENSORS.items():
            value = self._values.get(keyword)
            if value is not None:
                tensor = as_tensor(value, f"policy.{keyword}", stream)
                keep.append(tensor)
                setattr(c, field, tensor.pointer())
        return c

    def scalar_fields(self):
        """Every scalar sparsa_policy field as {C name: value}, tensors left out (the torch op carries these).
        Pure Python over the defaults read once at import, so torch.compile can trace it."""
        fields = dict(_DEFAULT_FIELDS[self.KIND])
        for keyword, field in self._PARAMS.items():
            value = self._values[keyword]
            fields[field] = float(value) if field in L.POLICY_FLOAT_FIELDS else int(value)
        if self.delta is not None:
            fields["flags"] |= L.POLICY_FLAG_DELTA
            fields["delta_gamma"], fields["delta_tail_min"] = int(self.delta.gamma), int(self.delta.tail_min)
        return fields

    def tensor_fields(self):
        """The policy's tensors as {C field name: tensor or None}."""
        return {field: self._values.get(keyword) for keyword, field in self._TENSORS.items()}

    @staticmethod
    def from_c_fields(fields, tensors=None):
        """The policy object for {C field name: value} (`kind` required; absent fields keep the defaults) and
        {C tensor field name: tensor}. Used to replay the shared test vectors."""
        tensors = tensors or {}
        cls = _CLASS_BY_KIND[int(fields["kind"])]
        kwargs = {}
        for keyword, field in cls._PARAMS.items():
            if field in fields:
                kwargs[keyword] = fields[field]
        for keyword, field in cls._TENSORS.items():
            if field in tensors:
                kwargs[keyword] = tensors[field]
        known = set(cls._PARAMS.values()) | {"kind", "flags", "delta_gamma", "delta_tail_min"}
        unknown = set(fields) - known
        if unknown:
            raise ValueError(f"{cls.__name__} has no parameter for fields {sorted(unknown)}")
        if int(fields.get("flags", 0)) & L.POLICY_FLAG_DELTA:
            defaults = Delta()
            kwargs["delta"] = Delta(int(fields.get("delta_gamma", defaults.gamma)),
                                    int(fields.get("delta_tail_min", defaults.tail_min)))
        return cls(**kwargs)


class Dense(Policy):
    """§1 every (causal-)allowed key."""
    KIND = L.POLICY_DENSE

    def __init__(self, delta=None):
        super().__init__(delta)


class SinkWindow(Policy):
    """§2 the first `sink_tokens` keys plus a local window of `window` keys (StreamingLLM, Δ's base)."""
    KIND = L.POLICY_SINK_WINDOW
    _PARAMS = {"sink_tokens": "sink_tokens", "window": "sink_window"}

    def __init__(self, sink_tokens=128, window=2048, delta=None):
        super().__init__(delta, sink_tokens=sink_tokens, window=window)


class BlockSparse(Policy):
    """§3 the caller's uint8 block mask [B, Hq, ceil(Sq/block_q), ceil(Skv/block_k)]."""
    KIND = L.POLICY_BLOCK_SPARSE
    _PARAMS = {"block_q": "block_q", "block_k": "block_k"}
    _TENSORS = {"mask": "block_mask"}

    def __init__(self, mask, block_q=128, block_k=64, delta=None):
        super().__init__(delta, mask=mask, block_q=block_q, block_k=block_k)


class Sparge(Policy):
    """§4 SpargeAttn: predicted block mask (TopCdf `tau`, or `topk_fraction` > 0), PV skip when `lambda_` > -inf,
    optional int8 path (`quantized`), optional per-head f32 [Hq, 4] `head_params` (theta, tau, topk_fraction,
    lambda; NaN = use the scalar)."""
    KIND = L.POLICY_SPARGE
    _PARAMS = {"block_q": "block_q", "block_k": "block_k", "theta": "sparge_theta", "tau": "sparge_tau",
               "topk_fraction": "sparge_topk_fraction", "lambda_": "sparge_lambda",
               "attention_sink": "sparge_attention_sink", "quantized": "sparge_quantized"}
    _TENSORS = {"head_params": "sparge_head_params"}

    def __init__(self, block_q=128, block_k=64, theta=0.6, tau=0.98, topk_fraction=0.0, lambda_=-math.inf,
                 attention_sink=False, quantized=False, head_params=None, delta=None):
        super().__init__(delta, block_q=block_q, block_k=block_k, theta=theta, tau=tau, topk_fraction=topk_fraction,
                         lambda_=lambda_, attention_sink=attention_sink, quantized=quantized, head_params=head_params)


class TokenSparse(Policy):
    """§5 Token Sparse Attention (prefill, Sq == Skv per sequence; always causal)."""
    KIND = L.POLICY_TOKEN_SPARSE
    _PARAMS = {"window": "token_sparse_window", "pool_kernel": "token_sparse_pool_kernel",
               "coverage": "token_sparse_coverage", "min_tokens": "token_sparse_min_tokens"}

    def __init__(self, window=128, pool_kernel=7, coverage=0.005, min_tokens=1024, delta=None):
        super().__init__(delta, window=window, pool_kernel=pool_kernel, coverage=coverage, min_tokens=min_tokens)


class TokenSelect(Policy):
    """§6 TokenSelect (decode / chunked prefill; always causal). Pass a SelectionCache to attention() to reuse
    selections while the mean query stays within cosine `cache_theta`."""
    KIND = L.POLICY_TOKEN_SELECT
    _PARAMS = {"n_init": "select_n_init", "n_local": "select_n_local", "top_k": "select_top_k",
               "scale_scores": "select_scale_scores", "cache_theta": "select_cache_theta",
               "per_kv_head": "select_per_kv_head"}

    def __init__(self, n_init=128, n_local=512, top_k=2048, scale_scores=False, cache_theta=0.9,
                 per_kv_head=False):
        super().__init__(None, n_init=n_init, n_local=n_local, top_k=top_k, scale_scores=scale_scores,
                         cache_theta=cache_theta, per_kv_head=per_kv_head)


class TokenIndices(Policy):
    """§7 STS, always causal: int32 `indices` [B, H_idx, k] known in advance (-1 = unused); `block_size` > 1 makes
    them block ids; optional int32 `head_map` [Hq]."""
    KIND = L.POLICY_TOKEN_INDICES
    _PARAMS = {"block_size": "index_block_size", "n_init": "index_n_init", "n_local": "index_n_local"}
    _TENSORS = {"indices": "indices", "head_map": "head_map"}

    def __init__(self, indices, head_map=None, block_size=1, n_init=0, n_local=0, delta=None):
        super().__init__(delta, indices=indices, head_map=head_map, block_size=block_size, n_init=n_init,
                         n_local=n_local)


def _library_defaults(kind):
    c = L.CPolicy()
    L.call("sparsa_policy_init", ctypes.byref(c), ctypes.sizeof(c), kind)
    return {name: getattr(c, name) for name in L.POLICY_SCALAR_FIELDS}


_CLASS_BY_KIND = {cls.KIND: cls for cls in (Dense, SinkWindow, BlockSparse, Sparge, TokenSparse, TokenSelect,
                                            TokenIndices)}
# sparsa_policy_init's scalar defaults per kind, read once; never modified afterwards.
_DEFAULT_FIELDS = {kind: _library_defaults(kind) for kind in _CLASS_BY_KIND}
