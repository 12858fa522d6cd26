"""Tensors in through DLPack with zero copies: any object with __dlpack__/__dlpack_device__ (numpy, torch, cupy).

The capsule from `obj.__dlpack__()` is named "dltensor" and points at a DLManagedTensor. We read the DLTensor in it
and describe the same memory to sparsa; we never rename the capsule, so the capsule's own destructor calls the
producer's deleter when we drop it (nothing leaks, nothing is freed twice). The capsule (which keeps the producer's
array alive) is held by the Tensor view for as long as the view lives. Torch tensors that need no stream ordering
are described from their own attributes instead (_from_torch), which is the same view at less host cost.
"""
import ctypes
import sys

from . import _library as L
from .errors import DtypeError, ShapeError, DeviceMismatchError, InvalidArgumentError

# ---- DLPack structs (dlpack.h, v0.x legacy capsule) -------------------------------------------------------------


class _DLDevice(ctypes.Structure):
    _fields_ = [("device_type", ctypes.c_int32), ("device_id", ctypes.c_int32)]


class _DLDataType(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint8), ("bits", ctypes.c_uint8), ("lanes", ctypes.c_uint16)]


class _DLTensor(ctypes.Structure):
    _fields_ = [
        ("data", ctypes.c_void_p),
        ("device", _DLDevice),
        ("ndim", ctypes.c_int32),
        ("dtype", _DLDataType),
        ("shape", ctypes.POINTER(ctypes.c_int64)),
        ("strides", ctypes.POINTER(ctypes.c_int64)),
        ("byte_offset", ctypes.c_uint64),
    ]


class _DLManagedTensor(ctypes.Structure):
    _fields_ = [("dl_tensor", _DLTensor), ("manager_ctx", ctypes.c_void_p), ("deleter", ctypes.c_void_p)]


_CAPSULE_NAME = b"dltensor"
_capsule_is_valid = ctypes.pythonapi.PyCapsule_IsValid
_capsule_is_valid.restype = ctypes.c_int
_capsule_is_valid.argtypes = [ctypes.py_object, ctypes.c_char_p]
_capsule_get_pointer = ctypes.pythonapi.PyCapsule_GetPointer
_capsule_get_pointer.restype = ctypes.c_void_p
_capsule_get_pointer.argtypes = [ctypes.py_object, ctypes.c_char_p]

# DLDataTypeCode: kDLInt 0, kDLUInt 1, kDLFloat 2, kDLBfloat 4, kDLBool 6.
_FROM_DLPACK_DTYPE = {
    (2, 32): L.DTYPE_F32, (2, 16): L.DTYPE_F16, (4, 16): L.DTYPE_BF16, (2, 64): L.DTYPE_F64,
    (0, 32): L.DTYPE_I32, (0, 64): L.DTYPE_I64, (1, 8): L.DTYPE_U8, (0, 8): L.DTYPE_I8, (6, 8): L.DTYPE_U8,
}
_GPU_DEVICES = (L.DEVICE_CUDA, L.DEVICE_ROCM)
# DLPack's consumer-stream codes (the array API's __dlpack__(stream=...)). CUDA: None or 1 = the legacy default
# stream, 2 = the per-thread default stream, any other value a cudaStream_t; 0 is forbidden (ambiguous) and torch
# asserts on it. ROCm: None or 0 = the default stream, any other value a hipStream_t.
_CUDA_LEGACY_DEFAULT_STREAM = 1
_RAW_DEFAULT_STREAM = 0  # the null stream handle: what torch's current_stream().cuda_stream is on the default stream

DTYPE_NAMES = {L.DTYPE_F32: "float32", L.DTYPE_F16: "float16", L.DTYPE_BF16: "bfloat16", L.DTYPE_F64: "float64",
               L.DTYPE_I32: "int32", L.DTYPE_I64: "int64", L.DTYPE_U8: "uint8", L.DTYPE_I8: "int8"}


class Reinterpret:
    """Views `base` (any DLPack object) as another sparsa dtype of the same element size, e.g. a numpy uint16 array
    holding bfloat16 bits: `sparsa.Reinterpret(bits, sparsa.BF16)` (numpy has no bfloat16)."""

    def __init__(self, base, dtype):
        self.base = base
        self.dtype = dtype


class Tensor:
    """A borrowed sparsa_tensor over a DLPack object's memory. `c` is the C descriptor; `shape` a tuple."""

    def __init__(self, c_tensor, keepalive):
        self.c = c_tensor
        self._keepalive = keepalive  # the capsule (and through it the producer's array)

    @property
    def shape(self):
        return tuple(self.c.shape[i] for i in range(self.c.ndim))

    @property
    def dtype(self):
        return self.c.dtype

    @property
    def device(self):
        return (self.c.device_type, self.c.device_id)

    @property
    def data_ptr(self):
        return self.c.data or 0

    def pointer(self):
        return ctypes.pointer(self.c)


def _described(dtype, device_type, device_id, shape, strides, data, keepalive):
    """A Tensor whose C descriptor says: `dtype` elements on (device_type, device_id) at address `data` (0 or None:
    no address), extents `shape` and element strides `strides`; a rank-0 shape is described as one element."""
    if len(shape) == 0:
        shape, strides = (1,), (1,)
    c = L.CTensor()
    c.struct_size = ctypes.sizeof(L.CTensor)
    c.dtype, c.device_type, c.device_id = dtype, device_type, device_id
    c.ndim = len(shape)
    for i, (extent, stride) in enumerate(zip(shape, strides)):
        c.shape[i], c.strides[i] = extent, stride
    c.data = data or None
    return Tensor(c, keepalive)


def _from_capsule(capsule, name, owner, reinterpret_as=None):
    if not _capsule_is_valid(capsule, _CAPSULE_NAME):
        raise DtypeError(f"{name}: __dlpack__() did not return an unused 'dltensor' capsule")
    managed = _DLManagedTensor.from_address(_capsule_get_pointer(capsule, _CAPSULE_NAME))
    dl = managed.dl_tensor
    key = (dl.dtype.code, dl.dtype.bits)
    if reinterpret_as is not None:
        bits = 8 * L.lib.sparsa_dtype_size(reinterpret_as)
        if dl.dtype.lanes != 1 or dl.dtype.bits != bits:
            raise DtypeError(f"{name}: cannot view {dl.dtype.bits}-bit elements as "
                             f"{DTYPE_NAMES.get(reinterpret_as, reinterpret_as)} ({bits} bits)")
    elif dl.dtype.lanes != 1 or key not in _FROM_DLPACK_DTYPE:
        raise DtypeError(f"{name}: DLPack dtype (code {key[0]}, {key[1]} bits, {dl.dtype.lanes} lanes) "
                         "has no sparsa dtype (expected float32/16, bfloat16, float64, int32/64, uint8, int8)")
    if not 0 <= dl.ndim <= L.MAX_DIMS:
        raise ShapeError(f"{name}: rank {dl.ndim}, but sparsa tensors have at most {L.MAX_DIMS} dims")
    shape = [dl.shape[i] for i in range(dl.ndim)]
    if dl.strides:
        strides = [dl.strides[i] for i in range(dl.ndim)]
    else:  # NULL strides = compact row-major
        strides, running = [0] * dl.ndim, 1
        for i in reversed(range(dl.ndim)):
            strides[i], running = running, running * shape[i]
    dtype = reinterpret_as if reinterpret_as is not None else _FROM_DLPACK_DTYPE[key]
    data = (dl.data or 0) + dl.byte_offset if (dl.data or dl.byte_offset) else None
    return _described(dtype, dl.device.device_type, dl.device.device_id, shape, strides, data, (capsule, owner))


# numpy (kind, itemsize) → sparsa dtype, for read-only arrays that numpy refuses to export through DLPack.
_FROM_NUMPY_KIND = {("f", 4): L.DTYPE_F32, ("f", 2): L.DTYPE_F16, ("f", 8): L.DTYPE_F64, ("i", 4): L.DTYPE_I32,
                    ("i", 8): L.DTYPE_I64, ("u", 1): L.DTYPE_U8, ("i", 1): L.DTYPE_I8, ("b", 1): L.DTYPE_U8}


def _is_numpy_array(obj):
    return type(obj).__module__.split(".")[0] == "numpy" and hasattr(obj, "__array_interface__")


def _from_readonly_numpy(array, name, reinterpret_as):
    """numpy < 2.1 refuses to export read-only arrays through DLPack; an input may still be read in place, so we
    describe it from its __array_interface__ (still zero copy)."""
    key = (array.dtype.kind, array.dtype.itemsize)
    if not array.dtype.isnative:
        raise DtypeError(f"{name}: byte-swapped numpy dtype {array.dtype} (sparsa reads native little-endian)")
    dtype = reinterpret_as if reinterpret_as is not None else _FROM_NUMPY_KIND.get(key)
    if dtype is None or L.lib.sparsa_dtype_size(dtype) != array.dtype.itemsize:
        raise DtypeError(f"{name}: numpy dtype {array.dtype} has no sparsa dtype")
    if array.ndim > L.MAX_DIMS or any(s % array.dtype.itemsize for s in array.strides):
        raise ShapeError(f"{name}: rank {array.ndim} or byte strides {array.strides} not expressible in elements")
    strides = [s // array.dtype.itemsize for s in array.strides]
    return _described(dtype, L.DEVICE_CPU, 0, array.shape, strides, array.__array_interface__["data"][0], array)


def dlpack_stream(device_type, stream):
    """The DLPack consumer-stream code for a raw stream handle (an int, e.g. torch's `stream.cuda_stream`, or None
    for the default stream) on a GPU of `device_type`. On CUDA the null handle becomes 1 (legacy default stream),
    never 0; handles 1 (cudaStreamLegacy) and 2 (cudaStreamPerThread) already mean what DLPack's codes 1 and 2 do."""
    if int(device_type) == L.DEVICE_CUDA:
        return _CUDA_LEGACY_DEFAULT_STREAM if stream is None or int(stream) == _RAW_DEFAULT_STREAM else int(stream)
    return None if stream is None else int(stream)


_torch_dtypes = None  # torch dtype -> sparsa dtype, built on first use (torch is optional)


def _torch_dtype_map(torch):
    global _torch_dtypes  # a constant table filled once; never modified afterwards
    if _torch_dtypes is None:
        _torch_dtypes = {torch.float32: L.DTYPE_F32, torch.float16: L.DTYPE_F16, torch.bfloat16: L.DTYPE_BF16,
                         torch.float64: L.DTYPE_F64, torch.int32: L.DTYPE_I32, torch.int64: L.DTYPE_I64,
                         torch.uint8: L.DTYPE_U8, torch.int8: L.DTYPE_I8, torch.bool: L.DTYPE_U8}
    return _torch_dtypes


def _from_torch(obj, name, stream, reinterpret_as, current_streams):
    """A torch tensor described from its own attributes: the memory, shape, element strides and device that its
    DLPack capsule would give, without the capsule (a decode step passes half a dozen tensors, and the export costs
    tens of microseconds each). Only where DLPack would not order streams either: a CPU tensor, or a CUDA tensor
    whose device's current torch stream is the consumer's stream (`current_streams`, a dict the caller keeps for
    the tensors of one call, remembers that stream per device). Returns None otherwise, and for what DLPack
    itself refuses or converts (conjugated or negated views, non-strided layouts, other devices), so that the
    caller exports through DLPack."""
    torch = sys.modules.get("torch")
    tensor_type = getattr(torch, "Tensor", None)  # (a stand-in module named torch may have none)
    if not isinstance(tensor_type, type) or not isinstance(obj, tensor_type) or obj.layout != torch.strided:
        return None
    if obj.is_conj() or obj.is_neg():
        return None
    device = obj.device
    if device.type == "cpu":
        device_type, device_id = L.DEVICE_CPU, 0
    elif device.type == "cuda" and not getattr(torch.version, "hip", None):
        consumer = _RAW_DEFAULT_STREAM if stream is None or int(stream) == _CUDA_LEGACY_DEFAULT_STREAM else int(stream)
        current = current_streams.get(device.index) if current_streams is not None else None
        if current is None:
            current = torch.cuda.current_stream(device).cuda_stream
            if current_streams is not None:
                current_streams[device.index] = current
        if current != consumer:
            return None  # DLPack makes the consumer's stream wait for torch's
        device_type, device_id = L.DEVICE_CUDA, device.index
    else:
        return None
    dtype = _torch_dtype_map(torch).get(obj.dtype)
    if reinterpret_as is not None:
        if L.lib.sparsa_dtype_size(reinterpret_as) != obj.element_size():
            raise DtypeError(f"{name}: cannot view {8 * obj.element_size()}-bit elements as "
                             f"{DTYPE_NAMES.get(reinterpret_as, reinterpret_as)}")
        dtype = reinterpret_as
    if dtype is None:
        return None  # DLPack's path gives the error message
    if obj.dim() > L.MAX_DIMS:
        raise ShapeError(f"{name}: rank {obj.dim()}, but sparsa tensors have at most {L.MAX_DIMS} dims")
    return _described(dtype, device_type, device_id, tuple(obj.shape), obj.stride(), obj.data_ptr(), obj)


def as_tensor(obj, name, stream=None, writable=False, current_streams=None):
    """A sparsa Tensor over `obj`'s memory (no copy). `name` is used in error messages; `stream` is the raw handle
    of the stream the consumer enqueues on (None or 0 = the default stream), translated to DLPack's code for
    __dlpack__ of GPU tensors by dlpack_stream; `writable` marks an output
    (a read-only numpy array is then refused); `current_streams` (optional, a dict) lets the tensors of one call
    look up torch's current stream once per device."""
    if isinstance(obj, Tensor):
        return obj
    reinterpret_as = None
    if isinstance(obj, Reinterpret):
        obj, reinterpret_as = obj.base, obj.dtype
        if not L.lib.sparsa_dtype_size(reinterpret_as):
            raise DtypeError(f"{name}: Reinterpret to unknown sparsa dtype {reinterpret_as}")
    if not hasattr(obj, "__dlpack__") or not hasattr(obj, "__dlpack_device__"):
        raise DtypeError(f"{name}: expected a DLPack tensor (numpy array, torch tensor, ...), "
                         f"got {type(obj).__name__}")
    fast = _from_torch(obj, name, stream, reinterpret_as, current_streams)
    if fast is not None:
        return fast
    readonly_numpy = _is_numpy_array(obj) and not obj.flags.writeable
    if readonly_numpy:
        if writable:
            raise InvalidArgumentError(f"{name}: output is a read-only numpy array")
        return _from_readonly_numpy(obj, name, reinterpret_as)
    device_type, _ = obj.__dlpack_device__()
    try:
        if int(device_type) in _GPU_DEVICES:
            capsule = obj.__dlpack__(stream=dlpack_stream(device_type, stream))
        else:
            capsule = obj.__dlpack__()
    except (BufferError, TypeError, ValueError, RuntimeError) as exc:
        raise DtypeError(f"{name}: cannot export through DLPack: {exc}") from exc
    return _from_capsule(capsule, name, obj, reinterpret_as)


def check_same_device(named_tensors):
    """All present tensors must live on one device (the library checks them against the context too)."""
    first = None
    for name, tensor in named_tensors:
        if tensor is None:
            continue
        if first is None:
            first = (name, tensor.device)
        elif tensor.device != first[1]:
            raise DeviceMismatchError(f"{name}: on device {tensor.device} but {first[0]} is on {first[1]}")


def numpy_dtype(sparsa_dtype):
    """The numpy dtype storing `sparsa_dtype` elements (bfloat16 → uint16 bits)."""
    import numpy
    return {L.DTYPE_F32: numpy.float32, L.DTYPE_F16: numpy.float16, L.DTYPE_BF16: numpy.uint16,
            L.DTYPE_F64: numpy.float64, L.DTYPE_I32: numpy.int32, L.DTYPE_I64: numpy.int64,
            L.DTYPE_U8: numpy.uint8, L.DTYPE_I8: numpy.int8}[sparsa_dtype]


def empty_like(template, shape, dtype, name):
    """A new, uninitialised output of `shape`/`dtype` of the same kind and device as `template` (numpy array or
    torch tensor; a Reinterpret of either). Other kinds: pass the output explicitly."""
    base = template.base if isinstance(template, Reinterpret) else template
    module = type(base).__module__.split(".")[0]
    if module == "numpy":
        import numpy
        array = numpy.empty(shape, dtype=numpy_dtype(dtype))
        return Reinterpret(array, dtype) if dtype == L.DTYPE_BF16 else array
    if module == "torch":
        import torch
        torch_dtype = {L.DTYPE_F32: torch.float32, L.DTYPE_F16: torch.float16, L.DTYPE_BF16: torch.bfloat16,
                       L.DTYPE_F64: torch.float64, L.DTYPE_I32: torch.int32, L.DTYPE_I64: torch.int64,
                       L.DTYPE_U8: torch.uint8, L.DTYPE_I8: torch.int8}[dtype]
        return torch.empty(shape, dtype=torch_dtype, device=base.device)
    raise DtypeError(f"{name}: cannot allocate an output like a {type(base).__name__}; pass {name}= explicitly")
