"""numpy's own attention for the CLI tests (cli_run_test.py, cli_run_policies_test.py): the visibility rule of
docs/algorithms.md §0 and §2 and float64 attention with GQA. Imported after the tests have checked numpy exists."""
import numpy as np


def visible_mask(sq, skv, causal, sink_tokens=None, window=None):
    """[sq, skv] bool: which keys each row sees (docs/algorithms.md §0, §2)."""
    i = np.arange(sq)[:, None] + (skv - sq)
    j = np.arange(skv)[None, :]
    mask = np.ones((sq, skv), dtype=bool)
    if causal:
        mask &= j <= i
    if sink_tokens is not None:
        distance = (i - j) if causal else np.abs(i - j)
        mask &= (j < sink_tokens) | (distance < window)
    return mask


def attention(q, k, v, mask):
    """q [B, Sq, Hq, D], k/v [B, Skv, Hkv, D], float64, GQA with contiguous groups."""
    group = q.shape[2] // k.shape[2]
    k = np.repeat(k.astype(np.float64), group, axis=2)
    v = np.repeat(v.astype(np.float64), group, axis=2)
    scores = np.einsum("bihd,bjhd->bhij", q.astype(np.float64), k) / np.sqrt(q.shape[-1])
    scores = np.where(mask[None, None], scores, -np.inf)
    weights = np.exp(scores - scores.max(axis=-1, keepdims=True))
    weights /= weights.sum(axis=-1, keepdims=True)
    return np.einsum("bhij,bjhd->bihd", weights, v)
