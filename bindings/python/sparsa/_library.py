"""Loads libsparsa and declares the C API for ctypes: structs mirror include/sparsa/sparsa.h field by field.

The library is found through, in order: the SPARSA_LIBRARY environment variable (a path to the shared library),
a libsparsa.so* inside this package's folder, then the system loader (ctypes.util.find_library, "libsparsa.so.0").
"""
import ctypes
import ctypes.util
import glob
import os

from . import errors

# ---- Constants of sparsa.h --------------------------------------------------------------------------------------

MAX_DIMS = 8
LIBRARY_ENV_VAR = "SPARSA_LIBRARY"
SYSTEM_LIBRARY_NAME = "libsparsa.so.0"

DTYPE_INVALID, DTYPE_F32, DTYPE_F16, DTYPE_BF16, DTYPE_F64, DTYPE_I32, DTYPE_I64, DTYPE_U8, DTYPE_I8 = range(9)
DEVICE_CPU, DEVICE_CUDA, DEVICE_CUDA_HOST, DEVICE_ROCM = 1, 2, 3, 10

POLICY_DENSE, POLICY_SINK_WINDOW, POLICY_BLOCK_SPARSE, POLICY_SPARGE = 0, 1, 2, 3
POLICY_TOKEN_SPARSE, POLICY_TOKEN_SELECT, POLICY_TOKEN_INDICES = 4, 5, 6
POLICY_FLAG_DELTA = 1 << 0
STAT_COUNT = 7
STRUCT_SIZE_MAX = 4096
CP_SUM_DIGITS = 6  # SPARSA_CP_SUM_DIGITS: fixed-point digits of one partial normaliser (sparsa_cp_select_sum)
# sizeof of each caller-filled struct in sparsa 0.1, the smallest struct_size the library accepts.
TENSOR_SIZE_V0_1, CONTEXT_OPTIONS_SIZE_V0_1, POLICY_SIZE_V0_1 = 160, 32, 152
ATTENTION_ARGS_SIZE_V0_1, SPARGE_TUNE_OPTIONS_SIZE_V0_1 = 120, 24

# ---- Structs ----------------------------------------------------------------------------------------------------


class CTensor(ctypes.Structure):
    _fields_ = [
        ("struct_size", ctypes.c_uint32),
        ("dtype", ctypes.c_int32),
        ("device_type", ctypes.c_int32),
        ("device_id", ctypes.c_int32),
        ("ndim", ctypes.c_int32),
        ("data", ctypes.c_void_p),
        ("shape", ctypes.c_int64 * MAX_DIMS),
        ("strides", ctypes.c_int64 * MAX_DIMS),
    ]


TensorPtr = ctypes.POINTER(CTensor)


class CContextOptions(ctypes.Structure):
    _fields_ = [
        ("struct_size", ctypes.c_uint32),
        ("device_type", ctypes.c_int32),
        ("device_id", ctypes.c_int32),
        ("stream", ctypes.c_void_p),
        ("num_threads", ctypes.c_int32),
        ("reserved0", ctypes.c_int32),
    ]


class CPolicy(ctypes.Structure):
    _fields_ = [
        ("struct_size", ctypes.c_uint32),
        ("kind", ctypes.c_int32),
        ("flags", ctypes.c_uint32),
        ("sink_tokens", ctypes.c_int32),
        ("sink_window", ctypes.c_int32),
        ("block_q", ctypes.c_int32),
        ("block_k", ctypes.c_int32),
        ("block_mask", TensorPtr),
        ("sparge_theta", ctypes.c_float),
        ("sparge_tau", ctypes.c_float),
        ("sparge_topk_fraction", ctypes.c_float),
        ("sparge_lambda", ctypes.c_float),
        ("sparge_attention_sink", ctypes.c_int32),
        ("sparge_quantized", ctypes.c_int32),
        ("sparge_head_params", TensorPtr),
        ("token_sparse_window", ctypes.c_int32),
        ("token_sparse_pool_kernel", ctypes.c_int32),
        ("token_sparse_coverage", ctypes.c_float),
        ("token_sparse_min_tokens", ctypes.c_int32),
        ("select_n_init", ctypes.c_int32),
        ("select_n_local", ctypes.c_int32),
        ("select_top_k", ctypes.c_int32),
        ("select_scale_scores", ctypes.c_int32),
        ("select_cache_theta", ctypes.c_float),
        ("select_per_kv_head", ctypes.c_int32),
        ("indices", TensorPtr),
        ("head_map", TensorPtr),
        ("index_block_size", ctypes.c_int32),
        ("index_n_init", ctypes.c_int32),
        ("index_n_local", ctypes.c_int32),
        ("delta_gamma", ctypes.c_int32),
        ("delta_tail_min", ctypes.c_int32),
        ("reserved0", ctypes.c_int32),
    ]


# Scalar policy fields (everything but struct_size and the tensor pointers), in declaration order.
POLICY_SCALAR_FIELDS = tuple(
    name for name, ctype in CPolicy._fields_ if name not in ("struct_size", "reserved0") and ctype is not TensorPtr
)
POLICY_FLOAT_FIELDS = frozenset(name for name, ctype in CPolicy._fields_ if ctype is ctypes.c_float)


class CAttentionArgs(ctypes.Structure):
    _fields_ = [
        ("struct_size", ctypes.c_uint32),
        ("q", TensorPtr),
        ("k", TensorPtr),
        ("v", TensorPtr),
        ("out", TensorPtr),
        ("lse", TensorPtr),
        ("causal", ctypes.c_int32),
        ("softmax_scale", ctypes.c_float),
        ("cu_seqlens_q", TensorPtr),
        ("cu_seqlens_k", TensorPtr),
        ("page_table", TensorPtr),
        ("seq_lens_k", TensorPtr),
        ("selection_cache", ctypes.c_void_p),
        ("selected_indices", TensorPtr),
        ("block_mask_out", TensorPtr),
        ("stats", TensorPtr),
        ("query_offsets", TensorPtr),
    ]


class CSpargeTuneOptions(ctypes.Structure):
    _fields_ = [
        ("struct_size", ctypes.c_uint32),
        ("l1", ctypes.c_float),
        ("pv_l1", ctypes.c_float),
        ("search_steps", ctypes.c_int32),
        ("dense_below", ctypes.c_float),
        ("lambda_min", ctypes.c_float),
    ]


# ---- Loading ----------------------------------------------------------------------------------------------------


def _candidate_paths():
    explicit = os.environ.get(LIBRARY_ENV_VAR)
    if explicit:
        yield explicit
        return  # an explicit choice that fails must not silently fall back to another copy
    package_dir = os.path.dirname(os.path.abspath(__file__))
    yield from sorted(glob.glob(os.path.join(package_dir, "libsparsa.so*")))
    found = ctypes.util.find_library("sparsa")
    if found:
        yield found
    yield SYSTEM_LIBRARY_NAME


def _load():
    tried = []
    for path in _candidate_paths():
        try:
            return ctypes.CDLL(path)
        except OSError as exc:
            tried.append(f"{path} ({exc})")
    raise OSError("sparsa: cannot load libsparsa; set SPARSA_LIBRARY to its path. Tried: " + "; ".join(tried))


lib = _load()

_status = ctypes.c_int32
_void_p = ctypes.c_void_p
_i32 = ctypes.c_int32
_size = ctypes.c_size_t
_PROTOTYPES = {
    "sparsa_version": (ctypes.c_uint32, []),
    "sparsa_version_string": (ctypes.c_char_p, []),
    "sparsa_status_string": (ctypes.c_char_p, [_status]),
    "sparsa_last_error_message": (ctypes.c_char_p, []),
    "sparsa_tensor_init": (_status, [TensorPtr, _size, _void_p, _i32, _i32, ctypes.POINTER(ctypes.c_int64)]),
    "sparsa_dtype_size": (ctypes.c_size_t, [_i32]),
    "sparsa_context_options_init": (_status, [ctypes.POINTER(CContextOptions), _size]),
    "sparsa_context_create": (_status, [ctypes.POINTER(CContextOptions), ctypes.POINTER(_void_p)]),
    "sparsa_context_destroy": (None, [_void_p]),
    "sparsa_context_set_stream": (_status, [_void_p, _void_p]),
    "sparsa_context_device_type": (_status, [_void_p, ctypes.POINTER(_i32)]),
    "sparsa_context_scratch_bytes": (_status, [_void_p, ctypes.POINTER(ctypes.c_uint64)]),
    "sparsa_selection_cache_create": (_status, [_void_p, _i32, _i32, _i32, _i32, _i32, ctypes.POINTER(_void_p)]),
    "sparsa_selection_cache_reset": (_status, [_void_p]),
    "sparsa_selection_cache_destroy": (None, [_void_p]),
    "sparsa_selection_cache_counts": (_status, [_void_p, ctypes.POINTER(ctypes.c_int64),
                                                ctypes.POINTER(ctypes.c_int64)]),
    "sparsa_policy_init": (_status, [ctypes.POINTER(CPolicy), _size, _i32]),
    "sparsa_policy_kind_name": (ctypes.c_char_p, [_i32]),
    "sparsa_attention_args_init": (_status, [ctypes.POINTER(CAttentionArgs), _size]),
    "sparsa_attention_run": (_status, [_void_p, ctypes.POINTER(CAttentionArgs), ctypes.POINTER(CPolicy)]),
    "sparsa_attention_plan": (_status, [_void_p, ctypes.POINTER(CAttentionArgs), ctypes.POINTER(CPolicy)]),
    "sparsa_merge_states": (_status, [_void_p] + [TensorPtr] * 6),
    "sparsa_topk_from_scores": (_status, [_void_p, TensorPtr, _i32, _i32, TensorPtr]),
    "sparsa_head_mapping": (_status, [TensorPtr, TensorPtr, _i32, TensorPtr]),
    "sparsa_kv_prefetch": (_status, [_void_p] + [TensorPtr] * 8),
    "sparsa_hilbert_permutation": (_status, [_i32, _i32, _i32, _void_p, _void_p, ctypes.c_int64]),
    "sparsa_drift_select_layers": (_status, [TensorPtr, TensorPtr, ctypes.c_float, TensorPtr, TensorPtr]),
    "sparsa_sparge_tune_options_init": (_status, [ctypes.POINTER(CSpargeTuneOptions), _size]),
    "sparsa_sparge_tune": (_status, [_void_p, ctypes.POINTER(CAttentionArgs), ctypes.POINTER(CPolicy),
                                     ctypes.POINTER(CSpargeTuneOptions), TensorPtr, TensorPtr]),
    "sparsa_cp_select_max": (_status, [_void_p, ctypes.POINTER(CAttentionArgs), ctypes.POINTER(CPolicy)]
                             + [TensorPtr] * 3),
    "sparsa_cp_select_sum": (_status, [_void_p, ctypes.POINTER(CAttentionArgs), ctypes.POINTER(CPolicy)]
                             + [TensorPtr] * 4),
    "sparsa_cp_select_topk": (_status, [_void_p, ctypes.POINTER(CAttentionArgs), ctypes.POINTER(CPolicy)]
                              + [TensorPtr] * 6),
    "sparsa_cp_select_indices": (_status, [_void_p, ctypes.POINTER(CAttentionArgs), ctypes.POINTER(CPolicy)]
                                 + [TensorPtr] * 5),
}
for _name, (_restype, _argtypes) in _PROTOTYPES.items():
    _function = getattr(lib, _name)
    _function.restype = _restype
    _function.argtypes = _argtypes


def call(function_name, *args):
    """Calls a status-returning C function; on failure raises the status's sparsa.Error subclass.

    The message is thread-local in the library; ctypes runs both calls on this Python thread's OS thread with
    nothing in between, so the message read is the one of the failing call.
    """
    status = getattr(lib, function_name)(*args)
    if status != 0:
        message = lib.sparsa_last_error_message().decode("utf-8", "replace")
        raise errors.error_for_status(status, message, function_name)


def status_string(status):
    return lib.sparsa_status_string(status).decode()
