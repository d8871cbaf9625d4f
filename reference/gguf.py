r"""GGUF files: read and write the container llama.cpp loads its models from.

This module mirrors ``gguf_init_from_file_impl`` and ``gguf_write_to_buf`` in
``ggml/src/gguf.cpp`` at the pinned commit. It is our own parser and our own writer: the
byte layout below *is* the specification, and every rule that llama.cpp enforces when it
opens a file is enforced here too, with a [`GGUFError`][] that says what is wrong and
where (byte offset, key or tensor name).

Everything is little-endian. A file is four sections, one after the other:

| section | content |
|---|---|
| header | ``b"GGUF"``, ``version: uint32`` (2 or 3), ``n_tensors: uint64``, ``n_kv: uint64`` |
| metadata | ``n_kv`` key/value pairs |
| tensor infos | ``n_tensors`` descriptions: name, shape, type, offset |
| data | padding up to a multiple of ``general.alignment`` (default 32), then the tensor bytes |

A *string* is ``uint64`` length + that many UTF-8 bytes (no terminator). A key/value pair is
a string key, a ``uint32`` value type (``gguf.GGUFValueType``), then the value. An array
value is its item type (``uint32``), its length (``uint64``) and the items; arrays may nest.

| id | type | bytes | | id | type | bytes |
|---|---|---|---|---|---|---|
| 0 | UINT8 | 1 | | 7 | BOOL | 1 (0 or 1) |
| 1 | INT8 | 1 | | 8 | STRING | 8 + length |
| 2 | UINT16 | 2 | | 9 | ARRAY | 4 + 8 + items |
| 3 | INT16 | 2 | | 10 | UINT64 | 8 |
| 4 | UINT32 | 4 | | 11 | INT64 | 8 |
| 5 | INT32 | 4 | | 12 | FLOAT64 | 8 |
| 6 | FLOAT32 | 4 | | | | |

A tensor info is the name (string, at most 63 bytes), ``n_dims: uint32`` (1 to 4),
``ne: uint64[n_dims]`` (ggml's dimensions, fastest-varying first; read as ``int64``
like llama.cpp, so values above ``INT64_MAX`` are refused), ``type: uint32``
(``gguf.GGMLQuantizationType``) and ``offset: uint64``, relative to the start of the data
section. NumPy shapes are ggml's ``ne`` reversed: ``token_embd.weight`` with
``ne = [n_embd, n_vocab]`` is the array of shape ``(n_vocab, n_embd)``, one row per token.
A tensor of type ``t`` with block size ``B`` and block bytes ``S``
(``gguf.constants.GGML_QUANT_SIZES[t]``) occupies

$$
\text{nbytes} = \frac{\prod_i ne_i}{B} \cdot S, \qquad ne_0 \bmod B = 0,
$$

and, as in llama.cpp, each tensor starts exactly where the previous one ends, padded up to a
multiple of the alignment: ``offset[0] = 0`` and
``offset[i+1] = offset[i] + pad(nbytes[i], alignment)``. That one rule refuses misaligned
offsets, overlapping tensors, gaps and tensors out of order.

Reading never trusts a count: every length (``n_kv``, ``n_tensors``, an array's length, a
string's length, a tensor's size) is checked against the bytes left in the file *before*
anything is allocated from it, so a corrupt or hostile file costs at most memory
proportional to its own size, and ends in a [`GGUFError`][], never in another exception.
Tensor data are not copied: F32 tensors are read-only views of a memory map, and every other
type is a [`reference.quants.QuantizedTensor`][reference.quants.QuantizedTensor] over the raw bytes.

This module is the container only: what a key means to a model (``llama.block_count`` is
``n_layer``) is [`reference.arch`][reference.arch]'s table, `reference.arch.GGUF_KEYS`,
which reads the hyperparameters of a file
([`reference.arch.hparams_from_file`][reference.arch.hparams_from_file]) and writes them as
metadata ([`reference.arch.llama_metadata`][reference.arch.llama_metadata]).
"""

from __future__ import annotations

import math
import os
import struct
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from gguf import GGMLQuantizationType, GGUFValueType
from gguf.constants import GGML_QUANT_SIZES

from reference.common import LlamarefError
from reference.quants import QuantizedTensor, row_size

# --8<-- [start:constants]
GGUF_MAGIC = b"GGUF"
GGUF_VERSIONS = (2, 3)  # v1 used 32-bit counts and is refused, as llama.cpp does
GGUF_DEFAULT_ALIGNMENT = 32
GGML_MAX_DIMS = 4
GGML_MAX_NAME = 64  # a tensor name has at most GGML_MAX_NAME - 1 bytes
GGUF_MAX_ARRAY_DEPTH = 8  # nested arrays (llama.cpp refuses them; gguf-py writes them)
INT64_MAX = 2**63 - 1

# Little-endian struct formats and NumPy dtypes of the fixed-size value types.
GGUF_SCALAR_FORMATS = {
    GGUFValueType.UINT8: "<B",
    GGUFValueType.INT8: "<b",
    GGUFValueType.UINT16: "<H",
    GGUFValueType.INT16: "<h",
    GGUFValueType.UINT32: "<I",
    GGUFValueType.INT32: "<i",
    GGUFValueType.FLOAT32: "<f",
    GGUFValueType.BOOL: "<B",
    GGUFValueType.UINT64: "<Q",
    GGUFValueType.INT64: "<q",
    GGUFValueType.FLOAT64: "<d",
}
GGUF_ARRAY_DTYPES = {
    GGUFValueType.UINT8: np.dtype("<u1"),
    GGUFValueType.INT8: np.dtype("<i1"),
    GGUFValueType.UINT16: np.dtype("<u2"),
    GGUFValueType.INT16: np.dtype("<i2"),
    GGUFValueType.UINT32: np.dtype("<u4"),
    GGUFValueType.INT32: np.dtype("<i4"),
    GGUFValueType.FLOAT32: np.dtype("<f4"),
    GGUFValueType.BOOL: np.dtype("<u1"),
    GGUFValueType.UINT64: np.dtype("<u8"),
    GGUFValueType.INT64: np.dtype("<i8"),
    GGUFValueType.FLOAT64: np.dtype("<f8"),
}
# The fewest bytes one item of each type can take: what a count is checked against.
GGUF_MIN_ITEM_SIZE = {
    **{t: np.dtype(f).itemsize for t, f in GGUF_ARRAY_DTYPES.items()},
    GGUFValueType.STRING: 8,  # the length, for an empty string
    GGUFValueType.ARRAY: 12,  # item type + length, for an empty array
}
# --8<-- [end:constants]


# --8<-- [start:GGUFError]
class GGUFError(LlamarefError, ValueError):
    """A GGUF file (or a request to write one) that is malformed or not supported.

    The message says what is wrong and where: the byte offset, the key or the tensor name.
    """


# --8<-- [end:GGUFError]


# --8<-- [start:GGUFValue]
@dataclass(frozen=True)
class GGUFValue:
    """A metadata value with an explicit GGUF type, for [`write_gguf`][].

    Without it the writer types a Python value deterministically (see [`gguf_value_type`][]).

    Attributes:
        value: a scalar, or a list / 1-D array for an array value.
        type: the type of the scalar, or of the items (the leaves) of an array.

    Examples:
        >>> GGUFValue(7, GGUFValueType.UINT8).type.name
        'UINT8'
    """

    value: Any
    type: GGUFValueType


# --8<-- [end:GGUFValue]


# --8<-- [start:GGUFFile]
@dataclass
class GGUFFile:
    """The content of a GGUF file, as [`read_gguf`][] returns it.

    Attributes:
        path: the file read.
        version: 2 or 3 (the layouts are identical).
        metadata: every key/value pair, as Python values: ``int``, ``float``, ``bool``,
            ``str``; numeric arrays as 1-D NumPy arrays of the stored dtype (BOOL arrays as
            ``bool``); string arrays as ``list[str]``; nested arrays as lists of those.
        tensors: tensor name (``"token_embd.weight"``, ``"blk.0.attn_q.weight"``) to its data,
            in file order, shapes in NumPy order (``ne`` reversed): F32 tensors as read-only
            ``float32`` arrays, every other type as a ``QuantizedTensor`` of raw bytes.
        value_types: key to its stored type (``ARRAY`` for arrays).
        alignment: ``general.alignment`` (32 when absent).
        data_offset: byte offset of the data section in the file.
    """

    path: str
    version: int
    metadata: dict[str, Any]
    tensors: dict[str, np.ndarray | QuantizedTensor]
    value_types: dict[str, GGUFValueType] = field(default_factory=dict)
    alignment: int = GGUF_DEFAULT_ALIGNMENT
    data_offset: int = 0

    @property
    def arch(self) -> str:
        """``general.architecture`` (for example ``"llama"``).

        Raises:
            GGUFError: the key is missing or is not a string.
        """
        arch = self.metadata.get("general.architecture")
        if not isinstance(arch, str):
            raise GGUFError(f"{self.path}: 'general.architecture' is missing or not a string")
        return arch


# --8<-- [end:GGUFFile]


# --8<-- [start:cursor]
class _Cursor:
    """A bounds-checked little-endian reader over the bytes of a file.

    Every read first checks that the bytes it needs are there (`need`); counts read
    from the file are checked against the bytes remaining before anything is allocated.
    """

    def __init__(self, buf: np.ndarray):
        self.buf = buf  # (file_size,) uint8, usually a read-only memory map
        self.size = int(buf.shape[0])
        self.pos = 0

    def remaining(self) -> int:
        return self.size - self.pos

    def need(self, n: int, what: str) -> None:
        if n > self.remaining():
            raise GGUFError(
                f"file truncated at byte {self.pos}: {what} needs {n} bytes, "
                f"{self.remaining()} left"
            )

    def scalar(self, vtype: GGUFValueType, what: str) -> int | float:
        fmt = GGUF_SCALAR_FORMATS[vtype]
        size = struct.calcsize(fmt)
        self.need(size, what)
        (value,) = struct.unpack_from(fmt, self.buf, self.pos)
        self.pos += size
        return value

    def u32(self, what: str) -> int:
        return int(self.scalar(GGUFValueType.UINT32, what))

    def u64(self, what: str) -> int:
        return int(self.scalar(GGUFValueType.UINT64, what))

    def count(self, min_item_size: int, what: str) -> int:
        """A ``uint64`` count of items of at least ``min_item_size`` bytes each."""
        at = self.pos
        n = self.u64(f"the length of {what}")
        if n * min_item_size > self.remaining():
            raise GGUFError(
                f"{what} at byte {at} claims {n} items of at least {min_item_size} bytes, "
                f"but only {self.remaining()} bytes are left in the file"
            )
        return n

    def string(self, what: str) -> str:
        at = self.pos
        n = self.count(1, what)
        raw = bytes(self.buf[self.pos : self.pos + n])
        self.pos += n
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError as e:
            raise GGUFError(f"{what} at byte {at} is not valid UTF-8: {e.reason}") from None

    def array(self, dtype: np.dtype, n: int, what: str) -> np.ndarray:
        nbytes = n * dtype.itemsize
        self.need(nbytes, what)
        out = np.frombuffer(self.buf, dtype=dtype, count=n, offset=self.pos)  # (n,)
        self.pos += nbytes
        return out.astype(dtype.newbyteorder("="))  # a copy, in native byte order


# --8<-- [end:cursor]


# --8<-- [start:gguf_read_header]
def gguf_read_header(cur: _Cursor) -> tuple[int, int, int]:
    """Read the header: magic, version, ``n_tensors``, ``n_kv``.

    Args:
        cur: a cursor at byte 0.

    Returns:
        ``(version, n_tensors, n_kv)``.

    Raises:
        GGUFError: bad magic, a big-endian file, version 1 or unknown, or counts that cannot
            fit in what is left of the file.

    Examples:
        >>> head = b"GGUF" + struct.pack("<IQQ", 3, 0, 0)
        >>> gguf_read_header(_Cursor(np.frombuffer(head, np.uint8)))
        (3, 0, 0)
    """
    cur.need(4, "the magic")
    magic = bytes(cur.buf[0:4])
    if magic != GGUF_MAGIC:
        raise GGUFError(f"bad magic at byte 0: {magic!r}, expected {GGUF_MAGIC!r}")
    cur.pos = 4
    version = cur.u32("the version")
    if version != 0 and version & 0xFFFF == 0:
        # a big-endian v3 file reads 0x03000000 here (the same test as llama.cpp)
        raise GGUFError(f"GGUF version {version:#x} at byte 4: a big-endian file, not supported")
    if version == 1:
        raise GGUFError("GGUF version 1 at byte 4 is not supported (32-bit counts)")
    if version not in GGUF_VERSIONS:
        raise GGUFError(f"unknown GGUF version {version} at byte 4, expected 2 or 3")
    n_tensors = cur.u64("n_tensors")
    n_kv = cur.u64("n_kv")
    # each KV pair takes at least 14 bytes (key length, a 1-byte key, type, a 1-byte value),
    # each tensor info at least 32 (name length, n_dims, one ne, type, offset)
    if n_kv * 14 + n_tensors * 32 > cur.remaining():
        raise GGUFError(
            f"header claims n_kv={n_kv} and n_tensors={n_tensors}, which need at least "
            f"{n_kv * 14 + n_tensors * 32} bytes, but only {cur.remaining()} follow"
        )
    return version, n_tensors, n_kv


# --8<-- [end:gguf_read_header]


# --8<-- [start:gguf_read_value]
def gguf_read_value(cur: _Cursor, vtype: int, key: str, depth: int = 0) -> Any:
    """Read one value of type ``vtype`` (arrays recursively).

    Args:
        cur: a cursor at the value.
        vtype: the ``uint32`` type id read before the value.
        key: the key, for messages.
        depth: nesting depth of arrays so far.

    Returns:
        A Python scalar, a 1-D NumPy array (numeric arrays), a ``list[str]`` or a list of
        arrays (nested arrays).

    Raises:
        GGUFError: unknown type, a BOOL other than 0 or 1, invalid UTF-8, truncation, or an
            array length larger than the bytes left.

    Examples:
        >>> raw = struct.pack("<IQ", GGUFValueType.UINT16, 2) + struct.pack("<HH", 7, 9)
        >>> gguf_read_value(_Cursor(np.frombuffer(raw, np.uint8)), GGUFValueType.ARRAY, "k")
        array([7, 9], dtype=uint16)
    """
    at = cur.pos
    if vtype not in GGUFValueType._value2member_map_:
        raise GGUFError(f"key {key!r}: unknown value type {vtype} (before byte {at})")
    vtype = GGUFValueType(vtype)
    if vtype == GGUFValueType.STRING:
        return cur.string(f"the value of {key!r}")
    if vtype == GGUFValueType.BOOL:
        b = cur.scalar(vtype, f"the value of {key!r}")
        if b > 1:
            raise GGUFError(f"key {key!r}: BOOL at byte {at} is {b}, expected 0 or 1")
        return bool(b)
    if vtype != GGUFValueType.ARRAY:
        value = cur.scalar(vtype, f"the value of {key!r}")
        return float(value) if isinstance(value, float) else int(value)
    if depth >= GGUF_MAX_ARRAY_DEPTH:
        raise GGUFError(f"key {key!r}: arrays nested deeper than {GGUF_MAX_ARRAY_DEPTH}")
    itype = cur.u32(f"the item type of {key!r}")
    if itype not in GGUFValueType._value2member_map_:
        raise GGUFError(f"key {key!r}: unknown array item type {itype} at byte {at}")
    itype = GGUFValueType(itype)
    n = cur.count(GGUF_MIN_ITEM_SIZE[itype], f"the array {key!r}")
    if itype in GGUF_ARRAY_DTYPES:
        items = cur.array(GGUF_ARRAY_DTYPES[itype], n, f"the array {key!r}")  # (n,)
        if itype == GGUFValueType.BOOL:
            if np.any(items > 1):
                raise GGUFError(f"key {key!r}: BOOL array at byte {at} holds a value > 1")
            items = items.astype(bool)  # (n,)
        return items
    return [gguf_read_value(cur, itype, key, depth + 1) for _ in range(n)]


# --8<-- [end:gguf_read_value]


# --8<-- [start:gguf_read_kv]
def gguf_read_kv(cur: _Cursor, n_kv: int) -> tuple[dict[str, Any], dict[str, GGUFValueType]]:
    """Read the ``n_kv`` key/value pairs.

    Args:
        cur: a cursor just after the header.
        n_kv: number of pairs, from the header.

    Returns:
        ``(metadata, value_types)``, both keyed by the key, in file order.

    Raises:
        GGUFError: an empty or duplicate key, a bad ``general.alignment`` (not a UINT32
            power of two), or any error of [`gguf_read_value`][].

    Examples:
        >>> raw = struct.pack("<Q", 1) + b"k" + struct.pack("<II", GGUFValueType.UINT32, 5)
        >>> gguf_read_kv(_Cursor(np.frombuffer(raw, np.uint8)), 1)[0]
        {'k': 5}
    """
    metadata: dict[str, Any] = {}
    value_types: dict[str, GGUFValueType] = {}
    for i in range(n_kv):
        at = cur.pos
        key = cur.string(f"key {i}")
        if not key:
            raise GGUFError(f"key {i} at byte {at} is empty")
        if key in metadata:
            raise GGUFError(f"duplicate key {key!r} at byte {at}")
        vtype = cur.u32(f"the type of {key!r}")
        metadata[key] = gguf_read_value(cur, vtype, key)
        value_types[key] = GGUFValueType(vtype)
    if "general.alignment" in metadata:
        alignment = metadata["general.alignment"]
        if value_types["general.alignment"] != GGUFValueType.UINT32:
            raise GGUFError("'general.alignment' must be a UINT32")
        if alignment == 0 or alignment & (alignment - 1):
            raise GGUFError(f"'general.alignment' is {alignment}, not a power of 2")
    return metadata, value_types


# --8<-- [end:gguf_read_kv]


# --8<-- [start:TensorInfo]
@dataclass(frozen=True)
class TensorInfo:
    """One tensor info of the file.

    Attributes:
        name: the GGUF tensor name.
        shape: NumPy shape, ``ne`` reversed.
        type: the ggml type.
        offset: byte offset from the start of the data section.
        nbytes: bytes the data take.
    """

    name: str
    shape: tuple[int, ...]
    type: GGMLQuantizationType
    offset: int
    nbytes: int


# --8<-- [end:TensorInfo]


# --8<-- [start:gguf_read_tensor_info]
def gguf_read_tensor_info(cur: _Cursor, i: int) -> TensorInfo:
    """Read one tensor info and check its shape and type.

    Args:
        cur: a cursor at the tensor info.
        i: the tensor's index, for messages.

    Returns:
        The [`TensorInfo`][], with the NumPy shape and the byte size.

    Raises:
        GGUFError: an empty name or one of 64 bytes or more, ``n_dims`` outside 1..4, a
            negative ``ne`` or one whose product exceeds ``INT64_MAX``, an unknown type, a row
            length that is not a multiple of the type's block size.

    Examples:
        >>> raw = (struct.pack("<Q", 1) + b"w" + struct.pack("<IQQ", 2, 4, 3)
        ...        + struct.pack("<IQ", GGMLQuantizationType.F32, 0))
        >>> gguf_read_tensor_info(_Cursor(np.frombuffer(raw, np.uint8)), 0).shape
        (3, 4)
    """
    at = cur.pos
    name = cur.string(f"the name of tensor {i}")
    if not name or len(name.encode("utf-8")) >= GGML_MAX_NAME:
        raise GGUFError(f"tensor {i} at byte {at}: name {name!r} is empty or too long")
    n_dims = cur.u32(f"n_dims of tensor {name!r}")
    if not 1 <= n_dims <= GGML_MAX_DIMS:
        raise GGUFError(f"tensor {name!r}: n_dims is {n_dims}, expected 1 to {GGML_MAX_DIMS}")
    ne = [int(cur.scalar(GGUFValueType.INT64, f"ne of tensor {name!r}")) for _ in range(n_dims)]
    if any(n < 0 for n in ne):
        raise GGUFError(f"tensor {name!r}: negative dimension in ne={ne}")
    if math.prod(ne) > INT64_MAX:
        raise GGUFError(f"tensor {name!r}: ne={ne} has more than INT64_MAX elements")
    ttype = cur.u32(f"the type of tensor {name!r}")
    if ttype not in GGMLQuantizationType._value2member_map_ or (
        GGMLQuantizationType(ttype) not in GGML_QUANT_SIZES
    ):
        raise GGUFError(f"tensor {name!r}: unknown ggml type {ttype}")
    ttype = GGMLQuantizationType(ttype)
    block_size, type_size = GGML_QUANT_SIZES[ttype]
    if ne[0] % block_size != 0:
        raise GGUFError(
            f"tensor {name!r}: row length ne[0]={ne[0]} is not a multiple of the block size "
            f"{block_size} of {ttype.name}"
        )
    offset = cur.u64(f"the offset of tensor {name!r}")
    nbytes = math.prod(ne) // block_size * type_size
    return TensorInfo(name, tuple(reversed(ne)), ttype, offset, nbytes)


# --8<-- [end:gguf_read_tensor_info]


# --8<-- [start:gguf_pad]
def gguf_pad(n: int, alignment: int) -> int:
    """``n`` rounded up to a multiple of ``alignment`` (ggml's ``GGML_PAD``).

    Examples:
        >>> gguf_pad(33, 32), gguf_pad(64, 32), gguf_pad(0, 32)
        (64, 64, 0)
    """
    return (n + alignment - 1) // alignment * alignment


# --8<-- [end:gguf_pad]


# --8<-- [start:gguf_check_layout]
def gguf_check_layout(infos: list[TensorInfo], alignment: int, data_size: int) -> None:
    """Check that the tensors are packed in order inside the data section.

    llama.cpp requires ``offset[0] = 0`` and ``offset[i+1] = offset[i] + pad(nbytes[i])``;
    this refuses misaligned offsets, overlaps, gaps and tensors out of order. The last
    tensor's data must end inside the file (its trailing padding may be missing).

    Args:
        infos: the tensor infos, in file order.
        alignment: ``general.alignment``.
        data_size: bytes from the start of the data section to the end of the file.

    Raises:
        GGUFError: the first tensor that breaks the rule, and how.

    Examples:
        >>> t = TensorInfo("a", (8,), GGMLQuantizationType.F32, 32, 32)
        >>> gguf_check_layout([t], 32, 64)
        Traceback (most recent call last):
        ...
        reference.gguf.GGUFError: tensor 'a' starts at data offset 32, expected 0 (tensors must be packed in order, each padded to 32 bytes)
    """  # noqa: E501
    expected = 0
    for info in infos:
        where = f"tensor {info.name!r} starts at data offset {info.offset}"
        if info.offset % alignment != 0:
            raise GGUFError(f"{where}: not a multiple of the alignment {alignment}")
        if info.offset < expected:
            raise GGUFError(f"{where}: it overlaps the tensor before it, which ends at {expected}")
        if info.offset != expected:
            raise GGUFError(
                f"{where}, expected {expected} (tensors must be packed in order, "
                f"each padded to {alignment} bytes)"
            )
        if info.offset + info.nbytes > data_size:
            raise GGUFError(
                f"{where}: its {info.nbytes} bytes end past the end of the file "
                f"({data_size} data bytes)"
            )
        expected = info.offset + gguf_pad(info.nbytes, alignment)


# --8<-- [end:gguf_check_layout]


def _tensor_view(buf: np.ndarray, start: int, info: TensorInfo) -> np.ndarray | QuantizedTensor:
    """The data of one tensor, without a copy: F32 as float32, others as raw bytes."""
    raw = buf[start : start + info.nbytes]  # (nbytes,) uint8
    if info.type == GGMLQuantizationType.F32:
        return raw.view("<f4").reshape(info.shape)  # shape
    data = raw.reshape(*info.shape[:-1], row_size(info.type, info.shape[-1]))  # (..., row_bytes)
    return QuantizedTensor(info.type, info.shape, data)  # dequantize() checks the type


# --8<-- [start:read_gguf]
def read_gguf(path: str | os.PathLike) -> GGUFFile:
    """Read a GGUF file: metadata as Python values, tensors as views of the file.

    Args:
        path: the file.

    Returns:
        The [`GGUFFile`][].

    Raises:
        GGUFError: the file is malformed or unsupported (every check of this module); the
            message names the byte offset, key or tensor.
        OSError: the file cannot be opened.

    Examples:
        >>> import tempfile, pathlib
        >>> p = pathlib.Path(tempfile.mkdtemp()) / "tiny.gguf"
        >>> write_gguf(p, {"general.architecture": "llama"}, {"w": np.ones((2, 3), np.float32)})
        >>> f = read_gguf(p)
        >>> f.arch, f.tensors["w"].shape, f.tensors["w"].dtype
        ('llama', (2, 3), dtype('float32'))
    """
    path = os.fspath(path)
    size = os.path.getsize(path)
    buf = np.memmap(path, dtype=np.uint8, mode="r") if size else np.zeros(0, np.uint8)
    cur = _Cursor(buf)
    version, n_tensors, n_kv = gguf_read_header(cur)
    metadata, value_types = gguf_read_kv(cur, n_kv)
    alignment = metadata.get("general.alignment", GGUF_DEFAULT_ALIGNMENT)
    infos: list[TensorInfo] = []
    seen: set[str] = set()
    for i in range(n_tensors):
        at = cur.pos
        info = gguf_read_tensor_info(cur, i)
        if info.name in seen:
            raise GGUFError(f"duplicate tensor name {info.name!r} at byte {at}")
        seen.add(info.name)
        infos.append(info)
    data_offset = gguf_pad(cur.pos, alignment) if n_tensors else cur.pos
    if data_offset > size:
        raise GGUFError(f"file truncated: the data section starts at {data_offset} > {size}")
    gguf_check_layout(infos, alignment, size - data_offset)
    tensors = {info.name: _tensor_view(buf, data_offset + info.offset, info) for info in infos}
    return GGUFFile(path, version, metadata, tensors, value_types, alignment, data_offset)


# --8<-- [end:read_gguf]


# ---------------------------------------------------------------------------------------------
# Writing
# ---------------------------------------------------------------------------------------------

_NUMPY_VALUE_TYPES = {
    d.newbyteorder("="): t for t, d in GGUF_ARRAY_DTYPES.items() if t != GGUFValueType.BOOL
}
_NUMPY_VALUE_TYPES[np.dtype(bool)] = GGUFValueType.BOOL
_INT_RANGES = {
    GGUFValueType.UINT8: (0, 2**8),
    GGUFValueType.INT8: (-(2**7), 2**7),
    GGUFValueType.UINT16: (0, 2**16),
    GGUFValueType.INT16: (-(2**15), 2**15),
    GGUFValueType.UINT32: (0, 2**32),
    GGUFValueType.INT32: (-(2**31), 2**31),
    GGUFValueType.UINT64: (0, 2**64),
    GGUFValueType.INT64: (-(2**63), 2**63),
}


# --8<-- [start:gguf_value_type]
def gguf_value_type(value: Any) -> GGUFValueType:
    """The GGUF type the writer gives a Python value (for arrays: the type of the items).

    The rule is deterministic: ``bool`` -> BOOL; ``int`` -> the first of UINT32, INT32,
    UINT64, INT64 that holds it; ``float`` -> FLOAT32; ``str`` -> STRING; NumPy scalars and
    arrays -> their dtype; a list -> the rule applied to all its items together (an empty
    list is a STRING array); a list of lists/arrays -> ARRAY (nested).

    Args:
        value: a metadata value (not a [`GGUFValue`][]).

    Returns:
        The type of a scalar, or of the items of an array.

    Raises:
        GGUFError: a value with no GGUF type (``None``, a dict, an int beyond 64 bits, ...).

    Examples:
        >>> " ".join(gguf_value_type(v).name for v in (True, 3, -3, 2**40, 0.5, "a", [-1], []))
        'BOOL UINT32 INT32 UINT64 FLOAT32 STRING INT32 STRING'
    """
    if isinstance(value, (np.ndarray, np.generic)):
        vtype = _NUMPY_VALUE_TYPES.get(value.dtype.newbyteorder("="))
        if vtype is None:
            raise GGUFError(f"no GGUF type for NumPy dtype {value.dtype}")
        return vtype
    if isinstance(value, bool):
        return GGUFValueType.BOOL
    if isinstance(value, str):
        return GGUFValueType.STRING
    if isinstance(value, float):
        return GGUFValueType.FLOAT32
    if isinstance(value, int):
        return _int_type([value])
    if isinstance(value, (list, tuple)):
        return _list_type(list(value))
    raise GGUFError(f"no GGUF type for a value of type {type(value).__name__}: {value!r}")


# --8<-- [end:gguf_value_type]


def _int_type(values: list[int]) -> GGUFValueType:
    lo, hi = min(values), max(values)
    for t in (GGUFValueType.UINT32, GGUFValueType.INT32, GGUFValueType.UINT64):
        if _INT_RANGES[t][0] <= lo and hi < _INT_RANGES[t][1]:
            return t
    if _INT_RANGES[GGUFValueType.INT64][0] <= lo and hi < _INT_RANGES[GGUFValueType.INT64][1]:
        return GGUFValueType.INT64
    raise GGUFError(f"integers in [{lo}, {hi}] do not fit any 64-bit GGUF type")


def _list_type(values: list) -> GGUFValueType:
    if not values:
        return GGUFValueType.STRING
    if all(isinstance(v, (list, tuple, np.ndarray)) for v in values):
        return GGUFValueType.ARRAY
    if all(isinstance(v, str) for v in values):
        return GGUFValueType.STRING
    if all(isinstance(v, (bool, np.bool_)) for v in values):
        return GGUFValueType.BOOL
    numbers = (int, float, np.integer, np.floating)
    if any(isinstance(v, bool) for v in values) or not all(isinstance(v, numbers) for v in values):
        raise GGUFError(f"a list mixes items of different types: {values[:8]!r}")
    if all(isinstance(v, (int, np.integer)) for v in values):
        return _int_type([int(v) for v in values])
    return GGUFValueType.FLOAT32


def _pack_string(s: str) -> bytes:
    raw = s.encode("utf-8")
    return struct.pack("<Q", len(raw)) + raw


def _pack_scalar(value: Any, vtype: GGUFValueType, key: str) -> bytes:
    if vtype == GGUFValueType.STRING:
        if not isinstance(value, str):
            raise GGUFError(f"key {key!r}: STRING value must be a str, got {value!r}")
        return _pack_string(value)
    if vtype in _INT_RANGES:
        if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
            raise GGUFError(f"key {key!r}: {vtype.name} value must be an int, got {value!r}")
        lo, hi = _INT_RANGES[vtype]
        if not lo <= int(value) < hi:
            raise GGUFError(f"key {key!r}: {value} does not fit {vtype.name}")
        return struct.pack(GGUF_SCALAR_FORMATS[vtype], int(value))
    if vtype == GGUFValueType.BOOL:
        if not isinstance(value, (bool, np.bool_)):
            raise GGUFError(f"key {key!r}: BOOL value must be a bool, got {value!r}")
        return struct.pack("<B", int(value))
    if vtype in (GGUFValueType.FLOAT32, GGUFValueType.FLOAT64):
        if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, float, np.number)):
            raise GGUFError(f"key {key!r}: {vtype.name} value must be a number, got {value!r}")
        try:
            return struct.pack(GGUF_SCALAR_FORMATS[vtype], float(value))
        except OverflowError:
            raise GGUFError(f"key {key!r}: {value} does not fit {vtype.name}") from None
    raise GGUFError(f"key {key!r}: {vtype.name} is not a scalar type")


def _is_array(value: Any) -> bool:
    return isinstance(value, (list, tuple, np.ndarray))


def _pack_array(items: Any, leaf_type: GGUFValueType | None, key: str) -> bytes:
    """Item type, length, items. ``leaf_type`` is the explicit type of the leaves, or None.

    A list whose items are all lists/arrays is nested: its item type is ARRAY and each item
    is written as item type, length, items (no type id of its own).
    """
    if isinstance(items, np.ndarray) and items.ndim != 1:
        raise GGUFError(f"key {key!r}: array values must be 1-D, got shape {items.shape}")
    n = len(items)
    if not isinstance(items, np.ndarray) and n and all(_is_array(v) for v in items):
        body = b"".join(_pack_array(v, leaf_type, key) for v in items)
        return struct.pack("<IQ", GGUFValueType.ARRAY, n) + body
    itype = GGUFValueType(leaf_type) if leaf_type is not None else gguf_value_type(items)
    if itype == GGUFValueType.ARRAY:
        raise GGUFError(f"key {key!r}: a list mixes arrays and scalars")
    head = struct.pack("<IQ", itype, n)
    if isinstance(items, np.ndarray) and itype in GGUF_ARRAY_DTYPES:
        return head + _pack_numpy(items, itype, key)
    return head + b"".join(_pack_scalar(v, itype, key) for v in items)


def _pack_numpy(items: np.ndarray, itype: GGUFValueType, key: str) -> bytes:
    """A 1-D NumPy array as ``itype`` items, refusing lossy conversions."""
    kind = items.dtype.kind
    if itype == GGUFValueType.BOOL:
        ok = kind == "b"
    elif itype in _INT_RANGES:
        lo, hi = _INT_RANGES[itype]
        ok = kind in "iu" and (not items.size or lo <= int(items.min()) and int(items.max()) < hi)
    else:
        ok = kind in "fiu"
    if not ok:
        raise GGUFError(f"key {key!r}: array of dtype {items.dtype} does not fit {itype.name}")
    return items.astype(GGUF_ARRAY_DTYPES[itype]).tobytes()


def _pack_value(value: Any, key: str) -> bytes:
    """Type id and value, typed by a [`GGUFValue`][] or by [`gguf_value_type`][]."""
    vtype = None
    if isinstance(value, GGUFValue):
        value, vtype = value.value, GGUFValueType(value.type)
    if _is_array(value):
        return struct.pack("<I", GGUFValueType.ARRAY) + _pack_array(value, vtype, key)
    vtype = vtype if vtype is not None else gguf_value_type(value)
    return struct.pack("<I", vtype) + _pack_scalar(value, vtype, key)


def _tensor_bytes(name: str, tensor: Any) -> tuple[tuple[int, ...], GGMLQuantizationType, bytes]:
    """Shape (NumPy order), ggml type and raw bytes of a tensor to write."""
    if isinstance(tensor, np.ndarray):
        if tensor.dtype != np.float32:
            raise GGUFError(
                f"tensor {name!r}: dtype {tensor.dtype}; write float32 arrays, or pass a "
                "QuantizedTensor for any other ggml type"
            )
        return tensor.shape, GGMLQuantizationType.F32, tensor.astype("<f4").tobytes()
    if not isinstance(tensor, QuantizedTensor):
        raise GGUFError(f"tensor {name!r}: expected a float32 array or a QuantizedTensor")
    qtype = GGMLQuantizationType(tensor.qtype)
    shape = tuple(int(n) for n in tensor.shape)
    block_size, type_size = GGML_QUANT_SIZES[qtype]
    if not shape or shape[-1] % block_size != 0:
        raise GGUFError(f"tensor {name!r}: shape {shape} does not fit {qtype.name} blocks")
    expected = (*shape[:-1], shape[-1] // block_size * type_size)
    data = np.asarray(tensor.data)
    if data.dtype != np.uint8 or data.shape != expected:
        raise GGUFError(f"tensor {name!r}: data must be uint8 of shape {expected}")
    return shape, qtype, data.tobytes()


# --8<-- [start:write_gguf]
def write_gguf(
    path: str | os.PathLike,
    metadata: dict[str, Any],
    tensors: dict[str, np.ndarray | QuantizedTensor],
    version: int = 3,
    alignment: int = GGUF_DEFAULT_ALIGNMENT,
) -> None:
    """Write a GGUF file: the exact inverse of [`read_gguf`][].

    Metadata values are typed by [`gguf_value_type`][] unless wrapped in a
    [`GGUFValue`][]. ``general.alignment`` is written when ``alignment`` is not 32 (or
    when ``metadata`` has it, in which case it must agree). Tensors are written in the order
    of ``tensors``, each padded to the alignment, as llama.cpp's writer does. Everything is
    encoded before a file is opened, so an error leaves no file behind; the bytes go to a
    temporary file renamed over ``path``, so tensors read earlier from ``path`` (views of its
    memory map) stay valid.

    Args:
        path: the file to write (replaced if it exists).
        metadata: key to value.
        tensors: GGUF tensor name to a float32 array (F32) or a ``QuantizedTensor``, shapes
            in NumPy order (1 to 4 dimensions).
        version: 2 or 3 (same layout).
        alignment: a power of two.

    Raises:
        GGUFError: a value with no GGUF type or out of its type's range, a bad tensor name,
            dtype or shape, a bad version or alignment.

    Examples:
        >>> import tempfile, pathlib
        >>> p = pathlib.Path(tempfile.mkdtemp()) / "t.gguf"
        >>> write_gguf(p, {"n": GGUFValue(3, GGUFValueType.UINT8)}, {}, alignment=64)
        >>> f = read_gguf(p)
        >>> f.metadata, f.value_types["n"].name, f.alignment
        ({'n': 3, 'general.alignment': 64}, 'UINT8', 64)
    """
    if version not in GGUF_VERSIONS:
        raise GGUFError(f"cannot write GGUF version {version}, only 2 or 3")
    if not isinstance(alignment, int) or alignment <= 0 or alignment & (alignment - 1):
        raise GGUFError(f"alignment {alignment} is not a power of 2")
    metadata = dict(metadata)
    if "general.alignment" in metadata:
        given = metadata["general.alignment"]
        given = given.value if isinstance(given, GGUFValue) else given
        if given != alignment:
            raise GGUFError(f"metadata general.alignment={given} but alignment={alignment}")
        metadata["general.alignment"] = GGUFValue(alignment, GGUFValueType.UINT32)
    elif alignment != GGUF_DEFAULT_ALIGNMENT:
        metadata["general.alignment"] = GGUFValue(alignment, GGUFValueType.UINT32)

    out = [GGUF_MAGIC, struct.pack("<IQQ", version, len(tensors), len(metadata))]
    for key, value in metadata.items():
        if not isinstance(key, str) or not key:
            raise GGUFError(f"metadata key {key!r} must be a non-empty str")
        out += [_pack_string(key), _pack_value(value, key)]

    blobs: list[bytes] = []
    offset = 0
    for name, tensor in tensors.items():
        if not isinstance(name, str) or not name or len(name.encode()) >= GGML_MAX_NAME:
            raise GGUFError(f"tensor name {name!r} must be a str of 1 to 63 bytes")
        shape, ttype, raw = _tensor_bytes(name, tensor)
        if not 1 <= len(shape) <= GGML_MAX_DIMS:
            raise GGUFError(f"tensor {name!r}: {len(shape)} dimensions, expected 1 to 4")
        ne = tuple(reversed(shape))  # ggml order: fastest-varying first
        out.append(_pack_string(name) + struct.pack(f"<I{len(ne)}Q", len(ne), *ne))
        out.append(struct.pack("<IQ", ttype, offset))
        blobs.append(raw + bytes(gguf_pad(len(raw), alignment) - len(raw)))
        offset += len(blobs[-1])

    head = b"".join(out)
    if tensors:
        head += bytes(gguf_pad(len(head), alignment) - len(head))
    # write a new file and rename it over ``path``: a GGUFFile already read from ``path`` keeps
    # mapping the old bytes (truncating a mapped file in place would crash its readers)
    tmp = f"{os.fspath(path)}.tmp-{os.getpid()}"
    try:
        with open(tmp, "wb") as f:
            f.write(head)
            for blob in blobs:
                f.write(blob)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


# --8<-- [end:write_gguf]
