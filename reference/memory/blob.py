r"""State blobs: the bytes in which every memory is saved and restored.

llama.cpp writes a memory's state through ``llama_io_write_i`` and reads it back through
``llama_io_read_i`` (``src/llama-io.h``; the in-memory forms are ``llama_io_write_buffer`` and
``llama_io_read_buffer`` of ``src/llama-context.cpp``): little-endian scalars, strings and
arrays, one after the other, with no framing. Three memories write their state with these
tools: the KV cache ([`reference.memory.state`][reference.memory.state]), the recurrent memory
([`reference.memory.recurrent`][reference.memory.recurrent]) and the pair of caches of iSWA
([`reference.memory.kv_cache_iswa`][reference.memory.kv_cache_iswa]):

- [`BlobWriter`][] and [`BlobReader`][]: the scalars, strings and arrays; a read past the end
  is refused;
- [`seal`][] and [`unseal`][]: the frame llama.cpp does not have,
  ``magic | version | total size | body | sha256(everything before)``, so that a blob of
  another kind, another version, cut short or corrupted is refused before anything is read;
- [`ggml_type_of`][] and [`ggml_type_name`][]: a row dtype as the ggml type id a blob stores;
- [`check_int32`][], [`check_tokens`][] and [`write_atomic`][]: the token list of a state
  file, and the file replaced in one rename, so that a crash never leaves half a file.

Every refusal is a [`StateError`][], raised before the memory changes.
"""

from __future__ import annotations

import hashlib
import os
import struct
import tempfile
from pathlib import Path

import numpy as np
from numpy.typing import ArrayLike

from reference.common import DTYPE_OF_GGML_TYPE, GGML_TYPE_OF_DTYPE, LlamarefError

CHECKSUM_SIZE = 32  # SHA-256, the last bytes of a sealed blob


# --8<-- [start:StateError]
class StateError(LlamarefError, ValueError):
    """A state blob or file that cannot be restored into this memory.

    The message says what is wrong: bad magic, unknown version, truncated, checksum
    mismatch, another architecture or hyperparameters, another cache dtype, a stream count,
    a sequence id out of range, no room in the cache. Raised before the memory changes.
    """
# --8<-- [end:StateError]


# ---------------------------------------------------------------------------------------------
# bytes in and out (llama_io_write_i / llama_io_read_i)
# ---------------------------------------------------------------------------------------------


class BlobWriter:
    """``llama_io_write_buffer``: little-endian scalars, strings and arrays, in order.

    Examples:
        >>> io = BlobWriter()
        >>> io.write("Ii", 2, -1)
        >>> io.write_string("ab")
        >>> io.getvalue().hex()
        '02000000ffffffff020000006162'
    """

    def __init__(self) -> None:
        self.parts: list[bytes] = []

    def write(self, fmt: str, *values) -> None:
        """``values`` packed little-endian by the ``struct`` format ``fmt``."""
        self.parts.append(struct.pack("<" + fmt, *values))

    def write_bytes(self, b: bytes) -> None:
        """``b`` as it is."""
        self.parts.append(bytes(b))

    def write_string(self, s: str) -> None:
        """A uint32 byte count, then the UTF-8 bytes."""
        b = s.encode("utf-8")
        self.write("I", len(b))
        self.write_bytes(b)

    def write_array(self, a: np.ndarray) -> None:
        """The elements of ``a`` in C order, little-endian; no shape (the reader knows it)."""
        self.parts.append(np.ascontiguousarray(a).astype(a.dtype.newbyteorder("<")).tobytes())

    def getvalue(self) -> bytes:
        """Everything written so far."""
        return b"".join(self.parts)


class BlobReader:
    """``llama_io_read_buffer``: reads past the end raise [`StateError`][].

    Args:
        data: the bytes to read.
        what: what they are, for the messages (``"state blob"``).

    Examples:
        >>> io = BlobReader(bytes.fromhex("02000000ffffffff"), "blob")
        >>> io.read("Ii")
        (2, -1)
        >>> io.read("I")
        Traceback (most recent call last):
        ...
        reference.memory.blob.StateError: blob truncated at byte 8: 4 bytes needed at offset 8
    """

    def __init__(self, data: bytes, what: str) -> None:
        self.data = memoryview(data)
        self.off = 0
        self.what = what

    def read_bytes(self, n: int) -> bytes:
        """The next ``n`` bytes."""
        if n < 0 or self.off + n > len(self.data):
            raise StateError(f"{self.what} truncated at byte {len(self.data)}: {n} bytes needed "
                             f"at offset {self.off}")
        b = bytes(self.data[self.off: self.off + n])
        self.off += n
        return b

    def read(self, fmt: str):
        """The values of the ``struct`` format ``fmt`` (one value alone, not in a tuple)."""
        values = struct.unpack("<" + fmt, self.read_bytes(struct.calcsize("<" + fmt)))
        return values[0] if len(values) == 1 else values

    def read_string(self) -> str:
        """A string of [`BlobWriter.write_string`][] (invalid UTF-8 replaced)."""
        return self.read_bytes(self.read("I")).decode("utf-8", errors="replace")

    def read_array(self, dtype: np.dtype, shape: tuple[int, ...]) -> np.ndarray:
        """An array of [`BlobWriter.write_array`][] of this dtype and shape, in native order."""
        n = int(np.prod(shape)) * dtype.itemsize
        a = np.frombuffer(self.read_bytes(n), dtype.newbyteorder("<"))
        return a.astype(dtype).reshape(shape)


# ---------------------------------------------------------------------------------------------
# the frame of a blob
# ---------------------------------------------------------------------------------------------


def seal(magic: bytes, version: int, body: bytes) -> bytes:
    """``magic | version | total size | body | sha256(everything before)``.

    Args:
        magic: 4 bytes that say what the blob is (``b"LRKV"``: a KV cache).
        version: the format version of the body.
        body: the bytes of a [`BlobWriter`][].

    Returns:
        The sealed blob, ``len(body) + 48`` bytes.

    Examples:
        >>> blob = seal(b"TEST", 1, b"abc")
        >>> len(blob), unseal(blob, b"TEST", 1, "test blob").read_bytes(3)
        (51, b'abc')
    """
    total = 4 + 4 + 8 + len(body) + CHECKSUM_SIZE
    head = magic + struct.pack("<IQ", version, total) + body
    return head + hashlib.sha256(head).digest()


def unseal(data: bytes, magic: bytes, version: int, what: str) -> BlobReader:
    """Check a [`seal`][]ed blob's magic, version, size and checksum, in that order.

    Args:
        data: the blob.
        magic: the magic it must have.
        version: the version this reader knows.
        what: what it is, for the messages.

    Returns:
        A reader on the body.

    Raises:
        StateError: the first check that fails, named (a blob of another kind or a newer
            version, truncated, with bytes after its end, or corrupted).

    Examples:
        >>> unseal(seal(b"TEST", 2, b""), b"TEST", 1, "test blob")  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        reference.memory.blob.StateError: test blob format version 2 (written by a newer ...
    """
    data = bytes(data)
    if len(data) < 16:
        raise StateError(f"{what} truncated at byte {len(data)}: the header needs 16 bytes")
    if data[:4] != magic:
        raise StateError(f"bad magic {data[:4]!r}: not a {what} (expected {magic!r})")
    v, total = struct.unpack("<IQ", data[4:16])
    if v != version:
        newer = " (written by a newer llamaref)" if v > version else ""
        raise StateError(f"{what} format version {v}{newer}: this reader knows version {version}")
    if len(data) < total:
        raise StateError(f"{what} truncated at byte {len(data)}: the header says {total} bytes")
    if len(data) > total:
        raise StateError(f"{what} has {len(data) - total} bytes after its end ({total} bytes)")
    if total < 16 + CHECKSUM_SIZE:
        raise StateError(f"{what} size {total} is smaller than its header and checksum")
    if hashlib.sha256(data[:-CHECKSUM_SIZE]).digest() != data[-CHECKSUM_SIZE:]:
        raise StateError(f"{what} checksum mismatch: the bytes are corrupted")
    return BlobReader(data[16:-CHECKSUM_SIZE], what)


# ---------------------------------------------------------------------------------------------
# row types, tokens, files
# ---------------------------------------------------------------------------------------------


def ggml_type_of(dtype: np.dtype) -> int:
    """The ggml type id a blob stores for rows of ``dtype``.

    Raises:
        StateError: a dtype with no ggml type here (float32, float16 and float64 have one).

    Examples:
        >>> ggml_type_of(np.float32), ggml_type_of(np.float16)
        (0, 1)
    """
    dtype = np.dtype(dtype)
    if dtype not in GGML_TYPE_OF_DTYPE:
        raise StateError(f"cache dtype {dtype} has no ggml type here (float32, float16, float64)")
    return GGML_TYPE_OF_DTYPE[dtype]


def ggml_type_name(t: int) -> str:
    """A ggml type id for a message: its dtype when it has one here.

    Examples:
        >>> ggml_type_name(0), ggml_type_name(99)
        ('float32 (ggml type 0)', 'ggml type 99')
    """
    d = DTYPE_OF_GGML_TYPE.get(t)
    return f"{d} (ggml type {t})" if d is not None else f"ggml type {t}"


def check_int32(values: ArrayLike, what: str) -> np.ndarray:
    """``values`` flattened to ``(n,)`` int64, each checked to fit an int32.

    Raises:
        StateError: ``"{what} must fit an int32"``: a value beyond int32, or one that is not
            an integer NumPy can hold (beyond int64, not a number).

    Examples:
        >>> check_int32([[1, 2], [3, 4]], "token ids").tolist()
        [1, 2, 3, 4]
        >>> check_int32([2**64], "output ids")
        Traceback (most recent call last):
        ...
        reference.memory.blob.StateError: output ids must fit an int32
    """
    try:
        v = np.asarray(values, dtype=np.int64).reshape(-1)
    except (OverflowError, TypeError, ValueError):
        raise StateError(f"{what} must fit an int32") from None
    if v.size and (v.min() < -(2**31) or v.max() >= 2**31):
        raise StateError(f"{what} must fit an int32")
    return v


def check_tokens(tokens: ArrayLike) -> np.ndarray:
    """The tokens of a state file, flattened to ``(n,)`` int64, each checked to fit an int32
    ([`check_int32`][]).

    Raises:
        StateError: a token id beyond int32.

    Examples:
        >>> check_tokens([[1, 2], [3, 4]]).tolist()
        [1, 2, 3, 4]
    """
    return check_int32(tokens, "token ids")


def write_atomic(path: str | Path, data: bytes) -> None:
    """Write ``data`` to a temporary file next to ``path``, then rename it over ``path``.

    A crash leaves either the old file or the new one, never half of one.

    Raises:
        OSError: the folder cannot be written (the temporary file is removed).
    """
    path = Path(path)
    fd, tmp = tempfile.mkstemp(prefix=path.name + ".", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
