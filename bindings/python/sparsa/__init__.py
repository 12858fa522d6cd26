"""sparsa — sparse-attention kernels (pure-Python ctypes binding of libsparsa's C API).

    import numpy as np, sparsa
    with sparsa.Context() as ctx:
        out = sparsa.attention(ctx, q, k, v, policy=sparsa.SinkWindow(sink_tokens=4, window=64), causal=True)

Tensors are any DLPack objects (numpy arrays on CPU; torch/cupy tensors on GPU contexts), used with zero copies.
Errors are subclasses of sparsa.Error carrying .status and the library's .message. See README.md.
"""
from . import _library
from ._library import (DTYPE_F32 as F32, DTYPE_F16 as F16, DTYPE_BF16 as BF16, DTYPE_F64 as F64,
                       DTYPE_I32 as I32, DTYPE_I64 as I64, DTYPE_U8 as U8, DTYPE_I8 as I8, STAT_COUNT)
from .context import Context, SelectionCache
from .errors import (Error, InvalidArgumentError, NullPointerError, DtypeError, ShapeError, IndexOutOfRangeError,
                     DeviceMismatchError, StructSizeError, UnsupportedError, BackendUnavailableError,
                     OutOfMemoryError, DeviceError, InternalError)
from .ops import (AttentionOutputs, attention, attention_plan, merge_states, topk_from_scores, head_mapping,
                  hilbert_permutation, drift_select_layers, kv_prefetch, sparge_tune, cp_select_max, cp_select_sum,
                  cp_select_topk, cp_select_indices)
from .policy import (Policy, Dense, SinkWindow, BlockSparse, Sparge, TokenSparse, TokenSelect, TokenIndices,
                     Delta)
from .tensor import Reinterpret, Tensor, as_tensor

# Indices into the stats output of a run (sparsa_stat_index).
STAT_PAIRS_COMPUTED, STAT_PAIRS_DENSE, STAT_BLOCKS_COMPUTED, STAT_BLOCKS_TOTAL = 0, 1, 2, 3
STAT_PV_BLOCKS_SKIPPED, STAT_CACHE_HITS, STAT_CACHE_MISSES = 4, 5, 6


def version():
    """The loaded library's version as (major, minor, patch)."""
    encoded = _library.lib.sparsa_version()
    return encoded // 10000, encoded // 100 % 100, encoded % 100


__version__ = _library.lib.sparsa_version_string().decode()

try:  # registers torch.ops.sparsa.attention when torch is importable; nothing otherwise
    from . import torch_ops  # noqa: F401
except ImportError:
    torch_ops = None
