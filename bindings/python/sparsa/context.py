"""Context and SelectionCache: owners of native handles, closed explicitly, by `with`, or when collected."""
import ctypes
import weakref

from . import _library as L
from .errors import InvalidArgumentError

_DEVICE_BY_NAME = {"cpu": L.DEVICE_CPU, "cuda": L.DEVICE_CUDA, "rocm": L.DEVICE_ROCM, "hip": L.DEVICE_ROCM}


class Context:
    """A sparsa_context on one backend: "cpu" (default), "cuda" or "rocm"/"hip" (or a sparsa device-type code).

    `stream` is the CUDA/HIP stream handle (an int, e.g. torch's `stream.cuda_stream`) every GPU run enqueues on;
    None = the default stream. `num_threads` = CPU worker threads (0 = one per core). Not thread-safe: use one
    context per thread. Close it with close() or a `with` block; closing twice is safe.
    """

    def __init__(self, device="cpu", device_id=0, stream=None, num_threads=0):
        options = L.CContextOptions()
        L.call("sparsa_context_options_init", ctypes.byref(options), ctypes.sizeof(options))
        options.device_type = _DEVICE_BY_NAME[device] if isinstance(device, str) else int(device)
        options.device_id = device_id
        options.stream = stream
        options.num_threads = num_threads
        handle = ctypes.c_void_p()
        L.call("sparsa_context_create", ctypes.byref(options), ctypes.byref(handle))
        self._handle = handle.value
        self.stream = stream
        self._caches = weakref.WeakSet()  # closed before the context (sparsa.h: caches go first)

    @property
    def handle(self):
        if not self._handle:
            raise InvalidArgumentError("ctx: the context is closed")
        return self._handle

    @property
    def device_type(self):
        value = ctypes.c_int32()
        L.call("sparsa_context_device_type", self.handle, ctypes.byref(value))
        return value.value

    @property
    def scratch_bytes(self):
        value = ctypes.c_uint64()
        L.call("sparsa_context_scratch_bytes", self.handle, ctypes.byref(value))
        return value.value

    def set_stream(self, stream):
        """Later runs enqueue on `stream` (GPU backends; ignored on CPU)."""
        L.call("sparsa_context_set_stream", self.handle, stream)
        self.stream = stream

    @property
    def closed(self):
        return not self._handle

    def close(self):
        """Destroys the context, closing its selection caches first. Safe to call twice."""
        handle, self._handle = getattr(self, "_handle", None), None
        if handle:
            for cache in list(self._caches):
                cache.close()
            L.lib.sparsa_context_destroy(handle)

    def __enter__(self):
        return self

    def __exit__(self, *exc_info):
        self.close()

    def __del__(self):
        self.close()


class SelectionCache:
    """TokenSelect's per-layer selection cache (§6.5) for up to `max_batch` sequences. Keep one per layer, pass
    sequences in the same order every call. It belongs to `ctx`'s device; closing the context closes it too."""

    def __init__(self, ctx, max_batch, num_q_heads, num_kv_heads, head_dim, max_top_k):
        handle = ctypes.c_void_p()
        L.call("sparsa_selection_cache_create", ctx.handle, max_batch, num_q_heads, num_kv_heads, head_dim,
               max_top_k, ctypes.byref(handle))
        self._handle = handle.value
        self._ctx = ctx  # the context must outlive the cache
        ctx._caches.add(self)

    @property
    def handle(self):
        if not self._handle:
            raise InvalidArgumentError("selection_cache: the cache is closed")
        return self._handle

    def reset(self):
        """Empties every slot and zeroes the counts."""
        L.call("sparsa_selection_cache_reset", self.handle)

    def counts(self):
        """(hits, misses) since creation or the last reset."""
        hits, misses = ctypes.c_int64(), ctypes.c_int64()
        L.call("sparsa_selection_cache_counts", self.handle, ctypes.byref(hits), ctypes.byref(misses))
        return hits.value, misses.value

    def close(self):
        handle, self._handle = getattr(self, "_handle", None), None
        if handle:
            L.lib.sparsa_selection_cache_destroy(handle)

    def __enter__(self):
        return self

    def __exit__(self, *exc_info):
        self.close()

    def __del__(self):
        self.close()
