"""Reader of the shared test vectors (tests/vectors/FORMAT.md) into numpy arrays and Python scalars."""
import os
import struct

import numpy

from sparsa.tensor import numpy_dtype

MAGIC = b"SPARSAV1"
TENSOR, I64, F64, STRING = 1, 2, 3, 4
REPO_ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", ".."))
VECTORS_DIR = os.environ.get("SPARSA_VECTORS_DIR", os.path.join(REPO_ROOT, "tests", "vectors"))


class TensorEntry:
    """A tensor entry: its sparsa dtype, shape and raw little-endian bytes."""

    def __init__(self, dtype, shape, data):
        self.dtype, self.shape, self.data = dtype, tuple(shape), data

    def array(self, fill=None):
        """A new writable numpy array with this entry's shape; its bytes are the entry's, or `fill` repeated."""
        raw = bytearray(self.data) if fill is None else bytearray(bytes([fill]) * len(self.data))
        return numpy.frombuffer(raw, dtype=numpy_dtype(self.dtype)).reshape(self.shape)


def read(path):
    """{entry name: TensorEntry | int | float | str}, in file order."""
    with open(path, "rb") as f:
        blob = f.read()
    if blob[:8] != MAGIC:
        raise ValueError(f"{path}: not a sparsa vector file (magic {blob[:8]!r})")
    pos = 8

    def take(fmt):
        nonlocal pos
        values = struct.unpack_from("<" + fmt, blob, pos)
        pos += struct.calcsize("<" + fmt)
        return values[0] if len(values) == 1 else values

    entries = {}
    for _ in range(take("I")):
        name_len = take("H")
        name = blob[pos:pos + name_len].decode("ascii")
        pos += name_len
        kind = take("B")
        if kind == TENSOR:
            dtype, ndim = take("i"), take("B")
            shape = [take("q") for _ in range(ndim)]
            nbytes = take("Q")
            entries[name] = TensorEntry(dtype, shape, blob[pos:pos + nbytes])
            pos += nbytes
        elif kind == I64:
            entries[name] = take("q")
        elif kind == F64:
            entries[name] = take("d")
        elif kind == STRING:
            length = take("I")
            entries[name] = blob[pos:pos + length].decode("ascii")
            pos += length
        else:
            raise ValueError(f"{path}: entry {name} has unknown type {kind}")
    if pos != len(blob):
        raise ValueError(f"{path}: {len(blob) - pos} trailing bytes")
    return entries


def vector_paths():
    return sorted(os.path.join(VECTORS_DIR, f) for f in os.listdir(VECTORS_DIR) if f.endswith(".spv"))
