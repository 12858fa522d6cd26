"""torch integration: `torch.ops.sparsa.attention` as a torch.library custom op with a fake (meta) implementation,
so torch.compile traces through it as one node instead of breaking the graph (SageAttention issue 74).

Imported by `sparsa/__init__.py` only when torch (>= 2.4, for torch.library.custom_op) imports; raises ImportError
otherwise, which the package treats as "no torch integration".

    import sparsa.torch_ops as sto
    out = sto.attention(q, k, v, policy=sparsa.SinkWindow(sink_tokens=4, window=256), causal=True)
"""
import threading
from typing import List, Optional

try:
    import torch
except Exception as exc:  # a missing or broken torch install only disables this module
    raise ImportError(f"torch is not usable: {exc}") from exc
if not hasattr(torch, "library") or not hasattr(torch.library, "custom_op"):
    raise ImportError("torch.library.custom_op needs torch >= 2.4")

from . import _library as L
from .context import Context
from .ops import attention as _attention
from .policy import Dense

_DEVICE_TYPE = {"cpu": L.DEVICE_CPU, "cuda": L.DEVICE_ROCM if getattr(torch.version, "hip", None) else L.DEVICE_CUDA}

# One context per (thread, device): a context is single-threaded (sparsa.h) and owns scratch that later runs reuse.
# Thread-local, so no state is shared between threads.
_per_thread = threading.local()


def _context_for(device):
    contexts = getattr(_per_thread, "contexts", None)
    if contexts is None:
        contexts = _per_thread.contexts = {}
    key = (device.type, device.index or 0)
    if key not in contexts:
        contexts[key] = Context(_DEVICE_TYPE[device.type], device_id=key[1])
    ctx = contexts[key]
    if device.type == "cuda":  # enqueue on torch's current stream, as torch's own ops do
        stream = torch.cuda.current_stream(device).cuda_stream
        if ctx.stream != stream:
            ctx.set_stream(stream)
    return ctx


class _FieldsPolicy:
    """A policy rebuilt inside the op from its flattened scalar fields and its tensors."""

    def __init__(self, fields, tensors):
        self.fields, self.tensors = fields, tensors

    def to_c(self, keep, stream=None):
        import ctypes
        from .tensor import as_tensor
        c = L.CPolicy()
        L.call("sparsa_policy_init", ctypes.byref(c), ctypes.sizeof(c), int(self.fields[0]))
        for name, value in zip(L.POLICY_SCALAR_FIELDS, self.fields):
            setattr(c, name, float(value) if name in L.POLICY_FLOAT_FIELDS else int(value))
        for name, tensor in self.tensors.items():
            if tensor is not None:
                view = as_tensor(tensor, f"policy.{name}", stream)
                keep.append(view)
                setattr(c, name, view.pointer())
        return c


@torch.library.custom_op("sparsa::attention", mutates_args=())
def _attention_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, softmax_scale: float,
                  policy_fields: List[float], block_mask: Optional[torch.Tensor],
                  sparge_head_params: Optional[torch.Tensor], indices: Optional[torch.Tensor],
                  head_map: Optional[torch.Tensor]) -> torch.Tensor:
    # sparsa computes the forward pass only (no autograd formula): inputs that require grad (a model traced
    # outside torch.no_grad, e.g. by torch._dynamo.explain) are read through detached views, as DLPack requires.
    q, k, v = q.detach(), k.detach(), v.detach()
    out = q.new_empty(q.shape)
    policy = _FieldsPolicy(policy_fields, {"block_mask": block_mask, "sparge_head_params": sparge_head_params,
                                           "indices": indices, "head_map": head_map})
    _attention(_context_for(q.device), q, k, v, out, policy=policy, causal=causal, softmax_scale=softmax_scale)
    return out


@_attention_op.register_fake
def _attention_fake(q, k, v, causal, softmax_scale, policy_fields, block_mask, sparge_head_params, indices,
                    head_map):
    return q.new_empty(q.shape)


def attention(q, k, v, policy=None, causal=False, softmax_scale=0.0):
    """sparsa attention on torch tensors through torch.ops.sparsa.attention (graph-safe under torch.compile).
    Runs on the tensors' device with a per-thread context, on torch's current stream. Returns a new tensor."""
    policy = policy if policy is not None else Dense()
    fields = policy.scalar_fields()
    tensors = policy.tensor_fields()
    return torch.ops.sparsa.attention(q, k, v, bool(causal), float(softmax_scale),
                                      [float(fields[name]) for name in L.POLICY_SCALAR_FIELDS],
                                      tensors.get("block_mask"), tensors.get("sparge_head_params"),
                                      tensors.get("indices"), tensors.get("head_map"))
