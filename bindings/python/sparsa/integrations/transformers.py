"""sparsa as a Hugging Face transformers attention implementation.

    import sparsa, sparsa.integrations.transformers as sparsa_hf
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(name, torch_dtype="bfloat16").cuda()
    sparsa_hf.register(policy=sparsa.SinkWindow(sink_tokens=4, window=1024))
    model.set_attn_implementation("sparsa")  # or from_pretrained(..., attn_implementation="sparsa")

Every attention layer then runs `torch.ops.sparsa.attention` (sparsa.torch_ops: one graph node under torch.compile,
torch's current stream on CUDA) for prefill and for cached decode. transformers hands the function query
[B, Hq, Sq, D] and the cache's key/value [B, Hkv, Skv, D]; sparsa reads them as strided [B, S, H, D] views (no copy,
no repeat of the kv heads: GQA is sparsa's own Hq/Hkv) and returns [B, Sq, Hq, D], what transformers expects.
Causality is sparsa's bottom-right rule, so a decode step (Sq < Skv) sees the whole cache.

`policy` is a sparsa.Policy used by every layer, or a callable `policy(module, query, key) -> sparsa.Policy`
(query/key as transformers passes them) for per-layer policies, policies whose tensors depend on the lengths
(BlockSparse masks, TokenIndices indices), or a different policy for decode (TokenSparse is prefill-only).

Limits, each refused with an error that says so: padded batches (a 2D attention mask with zeros), custom 4D masks,
sliding-window layers, attention sinks (`s_aux`), dropout in training, and output_attentions (no weights are
returned). Needs torch >= 2.4 (torch.library.custom_op) and transformers with AttentionInterface and
AttentionMaskInterface (4.53 or newer).
"""
try:
    import torch
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface
except ImportError as exc:
    raise ImportError("sparsa.integrations.transformers needs torch and transformers >= 4.53 "
                      f"(AttentionInterface, AttentionMaskInterface): {exc}") from exc

from .. import torch_ops
from ..policy import Dense, Policy

if torch_ops is None:
    raise ImportError("sparsa.integrations.transformers needs sparsa.torch_ops (torch >= 2.4)")

DEFAULT_NAME = "sparsa"


def _no_mask(*args, attention_mask=None, **kwargs):
    """transformers' mask hook for this implementation: sparsa applies its causal rule itself, so no mask tensor is
    built. A 2D padding mask is passed on only when it pads something, so the attention function can refuse it."""
    if attention_mask is None:
        return None
    if attention_mask.ndim == 2 and not torch.compiler.is_compiling() and bool(attention_mask.all()):
        return None  # every token real (generate() passes an all-ones mask): nothing to apply
    return attention_mask


def _refuse(what):
    raise NotImplementedError(f"sparsa attention: {what} is not supported; use attn_implementation='sdpa' here")


def make_attention_function(policy=None):
    """The attention function for `AttentionInterface.register`, with `policy` (a sparsa.Policy, a callable
    `(module, query, key) -> sparsa.Policy`, or None = Dense) fixed in it."""
    if policy is not None and not isinstance(policy, Policy) and not callable(policy):
        raise TypeError(f"policy must be a sparsa.Policy or a callable returning one, got {type(policy).__name__}")

    def sparsa_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
        if attention_mask is not None:
            _refuse("an attention mask (padded batch or custom mask)")
        if dropout and getattr(module, "training", False):
            _refuse("attention dropout in training")
        if kwargs.get("sliding_window") is not None or getattr(module, "sliding_window", None) is not None:
            _refuse("a sliding-window layer")
        if kwargs.get("s_aux") is not None:
            _refuse("attention sinks (s_aux)")
        if kwargs.get("output_attentions"):
            _refuse("output_attentions")
        chosen = policy(module, query, key) if callable(policy) and not isinstance(policy, Policy) else policy
        causal = kwargs.get("is_causal")
        if causal is None:
            causal = getattr(module, "is_causal", True)
        # [B, H, S, D] -> [B, S, H, D] views (last stride 1, as sparsa requires); the op returns [B, Sq, Hq, D].
        out = torch_ops.attention(query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2),
                                  policy=chosen if chosen is not None else Dense(), causal=bool(causal),
                                  softmax_scale=float(scaling) if scaling is not None else 0.0)
        return out, None

    return sparsa_attention


def register(policy=None, name=DEFAULT_NAME):
    """Registers sparsa under `name` in transformers' AttentionInterface (and a mask hook under the same name in
    AttentionMaskInterface), with `policy` for every layer. Registering again replaces the policy; a model picks
    it up at its next forward. Returns `name`, for `model.set_attn_implementation(name)`."""
    AttentionInterface.register(name, make_attention_function(policy))
    AttentionMaskInterface.register(name, _no_mask)
    return name
