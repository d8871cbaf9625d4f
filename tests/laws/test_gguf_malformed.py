"""The malformed-file corpus: every broken file is refused with a GGUFError, never a crash,
and never after allocating more than the file's size.

The broken files are generated from a valid tiny file built here byte by byte (independently
of ``write_gguf``), so that each corruption can be placed exactly.
"""

from __future__ import annotations

import struct
import tracemalloc
from pathlib import Path

import numpy as np
import pytest
from gguf import GGMLQuantizationType, GGUFValueType
from hypothesis import given, settings
from hypothesis import strategies as st

from reference.gguf import GGUFError, GGUFFile, read_gguf, write_gguf

Q = GGMLQuantizationType
V = GGUFValueType


# --- a tiny raw builder -------------------------------------------------------------------


def s(text: str | bytes) -> bytes:
    raw = text.encode() if isinstance(text, str) else text
    return struct.pack("<Q", len(raw)) + raw


def kv(key: str | bytes, vtype: int, payload: bytes) -> bytes:
    return s(key) + struct.pack("<I", vtype) + payload


def tinfo(name: str, ne: list[int], ttype: int, offset: int, n_dims: int | None = None) -> bytes:
    n = len(ne) if n_dims is None else n_dims
    return s(name) + struct.pack(f"<I{len(ne)}QIQ", n, *ne, ttype, offset)


def gguf_bytes(
    kvs: list[bytes],
    infos: list[bytes],
    data: bytes,
    version: int = 3,
    n_kv: int | None = None,
    n_tensors: int | None = None,
    alignment: int = 32,
) -> bytes:
    head = b"GGUF" + struct.pack(
        "<IQQ",
        version,
        len(infos) if n_tensors is None else n_tensors,
        len(kvs) if n_kv is None else n_kv,
    )
    body = head + b"".join(kvs) + b"".join(infos)
    body += bytes(-len(body) % alignment)
    return body + data


KVS = [
    kv("general.architecture", V.STRING, s("llama")),
    kv("u32", V.UINT32, struct.pack("<I", 7)),
    kv("f32", V.FLOAT32, struct.pack("<f", 0.5)),
    kv("flag", V.BOOL, b"\x01"),
    kv("tokens", V.ARRAY, struct.pack("<IQ", V.STRING, 3) + s("a") + s("bc") + s("")),
    kv("ints", V.ARRAY, struct.pack("<IQ", V.INT32, 2) + struct.pack("<ii", -1, 5)),
]
A = np.arange(8, dtype=np.float32).reshape(2, 4)  # tensor "a", ne = [4, 2]
B = np.arange(3, dtype=np.float32)  # tensor "b", ne = [3]
INFOS = [tinfo("a", [4, 2], Q.F32, 0), tinfo("b", [3], Q.F32, 32)]
DATA = A.tobytes() + B.tobytes()  # a: 32 bytes (already aligned), b: 12 bytes
VALID = gguf_bytes(KVS, INFOS, DATA)
DATA_OFFSET = len(VALID) - len(DATA)


def read_bytes(tmp_path: Path, raw: bytes, name: str = "x.gguf") -> GGUFFile:
    p = tmp_path / name
    p.write_bytes(raw)
    return read_gguf(p)


def refused(tmp_path: Path, raw: bytes, match: str) -> None:
    with pytest.raises(GGUFError, match=match):
        read_bytes(tmp_path, raw)


def test_the_valid_file_reads(tmp_path):
    f = read_bytes(tmp_path, VALID)
    assert f.metadata["tokens"] == ["a", "bc", ""] and f.metadata["u32"] == 7
    assert f.metadata["ints"].tolist() == [-1, 5] and f.metadata["flag"] is True
    np.testing.assert_array_equal(f.tensors["a"], A)
    np.testing.assert_array_equal(f.tensors["b"], B)
    assert f.data_offset == DATA_OFFSET and DATA_OFFSET % 32 == 0


# --- truncation ----------------------------------------------------------------------------


def test_truncated_at_every_byte_is_refused(tmp_path):
    """Every cut before the end of the last tensor's data is refused; cuts after it are not
    (only the trailing padding is missing, which llama.cpp does not need either)."""
    end_of_data = DATA_OFFSET + 32 + B.nbytes
    p = tmp_path / "cut.gguf"
    for cut in range(len(VALID)):
        p.write_bytes(VALID[:cut])
        if cut < end_of_data:
            with pytest.raises(GGUFError):
                read_gguf(p)
        else:
            assert read_gguf(p).tensors["b"].shape == (3,)


def test_truncation_message_says_where(tmp_path):
    refused(tmp_path, VALID[:30], r"header claims n_kv=6 and n_tensors=2, which need at least")
    infos_at = 24 + sum(len(k) for k in KVS)  # where tensor "a"'s info starts
    cut = infos_at + 8 + 1 + 4 + 3  # inside ne[0] of "a"
    refused(tmp_path, VALID[:cut], f"file truncated at byte {cut - 3}: ne of tensor 'a' needs 8")
    refused(tmp_path, VALID[: DATA_OFFSET + 40], r"tensor 'b' starts at data offset 32: its 12")


# --- header --------------------------------------------------------------------------------


def test_bad_magic(tmp_path):
    refused(tmp_path, b"GGUG" + VALID[4:], r"bad magic at byte 0: b'GGUG'")
    refused(tmp_path, b"FUGG" + VALID[4:], "bad magic")


@pytest.mark.parametrize(
    "version, match",
    [
        (0, "unknown GGUF version 0"),
        (1, "version 1 at byte 4 is not supported"),
        (4, "unknown GGUF version 4"),
        (0xFFFFFFFF, "unknown GGUF version 4294967295"),
        (0x03000000, "big-endian"),
    ],
)
def test_bad_versions(tmp_path, version, match):
    refused(tmp_path, gguf_bytes(KVS, INFOS, DATA, version=version), match)


def test_version_2_reads(tmp_path):
    assert read_bytes(tmp_path, gguf_bytes(KVS, INFOS, DATA, version=2)).version == 2


@pytest.mark.parametrize(
    "n_kv, n_tensors",
    [(2**64 - 1, 2), (6, 2**64 - 1), (2**40, 0), (0, 2**40), (7, 2), (6, 3), (1000, 2)],
)
def test_absurd_counts(tmp_path, n_kv, n_tensors):
    raw = gguf_bytes(KVS, INFOS, DATA, n_kv=n_kv, n_tensors=n_tensors)
    with pytest.raises(GGUFError):
        read_bytes(tmp_path, raw)


def test_absurd_count_message(tmp_path):
    raw = gguf_bytes(KVS, INFOS, DATA, n_kv=2**40)
    refused(tmp_path, raw, r"header claims n_kv=1099511627776 and n_tensors=2")


# --- key/value pairs -----------------------------------------------------------------------


def with_kv(extra: bytes, **kw) -> bytes:
    return gguf_bytes([*KVS, extra], INFOS, DATA, **kw)


@pytest.mark.parametrize(
    "extra, match",
    [
        (kv("x", 13, b"\0" * 8), "key 'x': unknown value type 13"),
        (kv("x", 0xFFFFFFFF, b"\0" * 8), "unknown value type 4294967295"),
        (kv("x", V.ARRAY, struct.pack("<IQ", 77, 0)), "unknown array item type 77"),
        (kv("x", V.ARRAY, struct.pack("<IQ", V.UINT8, 2**63)), "claims 9223372036854775808 items"),
        (kv("x", V.ARRAY, struct.pack("<IQ", V.STRING, 2**40)), "the array 'x' at byte"),
        (kv("x", V.ARRAY, struct.pack("<IQ", V.ARRAY, 2**40)), "at least 12 bytes"),
        (kv("x", V.STRING, struct.pack("<Q", 2**62)), "the value of 'x' at byte"),
        (kv("x", V.STRING, s(b"\xff\xfe")), "not valid UTF-8"),
        (kv(b"\xc3", V.UINT8, b"\x01"), "key 6 at byte .* is not valid UTF-8"),
        (kv("", V.UINT8, b"\x01"), "key 6 at byte .* is empty"),
        (kv("u32", V.UINT8, b"\x01"), "duplicate key 'u32'"),
        (kv("x", V.BOOL, b"\x02"), "BOOL at byte .* is 2"),
        (kv("x", V.ARRAY, struct.pack("<IQ", V.BOOL, 2) + b"\x01\x07"), "BOOL array"),
        (kv("general.alignment", V.UINT64, struct.pack("<Q", 32)), "must be a UINT32"),
        (kv("general.alignment", V.UINT32, struct.pack("<I", 24)), "24, not a power of 2"),
        (kv("general.alignment", V.UINT32, struct.pack("<I", 0)), "0, not a power of 2"),
    ],
)
def test_bad_kv(tmp_path, extra, match):
    refused(tmp_path, with_kv(extra), match)


def test_nesting_deeper_than_the_limit(tmp_path):
    deep = struct.pack("<IQ", V.ARRAY, 1) * 9 + struct.pack("<IQ", V.UINT8, 0)
    refused(tmp_path, with_kv(kv("x", V.ARRAY, deep)), "nested deeper than 8")
    ok = struct.pack("<IQ", V.ARRAY, 1) * 7 + struct.pack("<IQ", V.UINT8, 1) + b"\x05"
    f = read_bytes(tmp_path, with_kv(kv("x", V.ARRAY, ok)))
    inner = f.metadata["x"]
    for _ in range(7):
        inner = inner[0]
    assert inner.tolist() == [5]


# --- tensor infos and data -----------------------------------------------------------------


def with_infos(infos: list[bytes], data: bytes = DATA, kvs=KVS, alignment: int = 32) -> bytes:
    return gguf_bytes(kvs, infos, data, alignment=alignment)


B_INFO = INFOS[1]


@pytest.mark.parametrize(
    "info, match",
    [
        (tinfo("a", [4, 2], Q.F32, 0, n_dims=5), "n_dims is 5, expected 1 to 4"),
        (tinfo("a", [], Q.F32, 0), "n_dims is 0"),
        (tinfo("a", [2**62, 4], Q.F32, 0), r"more than INT64_MAX elements"),
        (tinfo("a", [2**32, 2**31], Q.F32, 0), r"more than INT64_MAX elements"),
        (tinfo("a", [2**64 - 1, 1], Q.F32, 0), "negative dimension"),
        (tinfo("a", [4, 2], 5, 0), "unknown ggml type 5"),  # Q4_3: removed from ggml
        (tinfo("a", [4, 2], 42, 0), "unknown ggml type 42"),  # Q2_0: unknown to gguf-py
        (tinfo("a", [4, 2], 2**31, 0), "unknown ggml type 2147483648"),
        (tinfo("a", [4, 2], Q.Q8_0, 0), "ne\\[0\\]=4 is not a multiple of the block size 32"),
        (tinfo("a", [4, 2], Q.F32, 2**60), "starts at data offset 1152921504606846976"),
        (tinfo("a", [4, 2], Q.F32, 64), "starts at data offset 64, expected 0"),
        (tinfo("a", [4, 2], Q.F32, 4), "data offset 4: not a multiple of the alignment 32"),
        (tinfo("a" * 64, [4, 2], Q.F32, 0), "is empty or too long"),
        (tinfo("", [4, 2], Q.F32, 0), "is empty or too long"),
        (tinfo("a", [4, 2, 100], Q.F32, 0), "end past the end of the file"),
    ],
)
def test_bad_tensor_info(tmp_path, info, match):
    refused(tmp_path, with_infos([info, B_INFO]), match)


def test_bad_tensor_layout(tmp_path):
    a = INFOS[0]
    refused(tmp_path, with_infos([a, tinfo("a", [3], Q.F32, 32)]), "duplicate tensor name 'a'")
    refused(tmp_path, with_infos([a, tinfo("b", [3], Q.F32, 0)]), "'b' .* overlaps")
    refused(tmp_path, with_infos([B_INFO, a]), "'b' starts at data offset 32, expected 0")
    refused(tmp_path, with_infos([a, tinfo("b", [3], Q.F32, 2**64 - 32)]), "'b' starts at")
    big = tinfo("b", [2**40], Q.F32, 32)
    refused(tmp_path, with_infos([a, big]), "'b' starts at data offset 32: its 4398046511104")


def test_zero_element_tensor_is_allowed(tmp_path):
    raw = with_infos([*INFOS, tinfo("z", [0, 5], Q.F32, 64)], data=DATA + bytes(20))
    f = read_bytes(tmp_path, raw)
    assert f.tensors["z"].shape == (5, 0)


def test_quantized_tensor_size_and_view(tmp_path):
    """A Q8_0 tensor of 2 rows of 32 weights is 2 * 34 bytes, viewed as (2, 34) uint8."""
    data = np.random.default_rng(0).integers(0, 256, 68, dtype=np.uint8).tobytes()
    raw = with_infos([tinfo("q", [32, 2], Q.Q8_0, 0)], data=data)
    q = read_bytes(tmp_path, raw).tensors["q"]
    assert q.shape == (2, 32) and q.data.shape == (2, 34)
    assert q.data.tobytes() == data
    refused(tmp_path, raw[:-1], "'q' starts at data offset 0: its 68 bytes end past")


def test_the_writer_produces_the_builders_bytes(tmp_path):
    """The hand-built valid file is exactly what write_gguf writes for the same content."""
    f = read_bytes(tmp_path, VALID)
    meta = {k: v for k, v in f.metadata.items()}
    from reference.gguf import GGUFValue

    meta["u32"] = GGUFValue(7, V.UINT32)
    write_gguf(tmp_path / "w.gguf", meta, {"a": A, "b": B})
    assert (tmp_path / "w.gguf").read_bytes() == VALID + bytes(-len(VALID) % 32)


# --- no crash, no huge allocation ----------------------------------------------------------


def peak_allocation(path: Path) -> tuple[int, BaseException | None]:
    tracemalloc.start()
    tracemalloc.reset_peak()
    err: BaseException | None = None
    try:
        read_gguf(path)
    except GGUFError as e:
        err = e
    finally:
        _, peak = tracemalloc.get_traced_memory()
        tracemalloc.stop()
    return peak, err


HUGE = [
    gguf_bytes(KVS, INFOS, DATA, n_kv=2**63),
    gguf_bytes(KVS, INFOS, DATA, n_tensors=2**63),
    with_kv(kv("x", V.ARRAY, struct.pack("<IQ", V.UINT64, 2**61))),
    with_kv(kv("x", V.ARRAY, struct.pack("<IQ", V.STRING, 2**61))),
    with_kv(kv("x", V.ARRAY, struct.pack("<IQ", V.ARRAY, 2**60))),
    with_kv(kv("x", V.STRING, struct.pack("<Q", 2**63))),
    with_kv(kv("x", V.ARRAY, struct.pack("<IQ", V.UINT8, len(VALID)))),  # just too many
    with_infos([tinfo("a", [2**31, 2**31], Q.F32, 0), B_INFO]),
]


@pytest.mark.parametrize("i", range(len(HUGE)))
def test_no_allocation_larger_than_the_file(tmp_path, i):
    p = tmp_path / "huge.gguf"
    p.write_bytes(HUGE[i])
    peak, err = peak_allocation(p)
    assert isinstance(err, GGUFError)
    assert peak < len(HUGE[i]) + 64 * 1024, (peak, err)


def test_allocation_of_a_valid_read_is_small(tmp_path):
    """Tensor data are views of a memory map: reading does not copy them."""
    p = tmp_path / "big.gguf"
    write_gguf(p, {"k": 1}, {"w": np.zeros((256, 1024), np.float32)})  # 1 MiB of data
    peak, err = peak_allocation(p)
    assert err is None and peak < 64 * 1024


@settings(max_examples=300)
@given(
    edits=st.lists(
        st.tuples(st.integers(0, len(VALID) - 1), st.integers(0, 255)), min_size=1, max_size=8
    ),
    cut=st.none() | st.integers(0, len(VALID)),
)
def test_random_byte_mutations_never_crash(tmp_path_factory, edits, cut):
    """Every mutated file is either a valid GGUFFile or a GGUFError; nothing else."""
    raw = bytearray(VALID)
    for pos, byte in edits:
        raw[pos] = byte
    raw = bytes(raw[:cut])
    p = tmp_path_factory.mktemp("mut") / "m.gguf"
    p.write_bytes(raw)
    peak, err = peak_allocation(p)  # any other exception propagates and fails the test
    assert peak < len(raw) + 256 * 1024
    if err is None:
        f = read_gguf(p)
        for t in f.tensors.values():
            assert t.size * 4 <= len(raw) if isinstance(t, np.ndarray) else t.data.size <= len(raw)


@settings(max_examples=100)
@given(data=st.binary(max_size=200))
def test_random_bytes_after_a_valid_header(tmp_path_factory, data):
    """A valid header followed by noise: refused or read, never a crash."""
    raw = b"GGUF" + struct.pack("<IQQ", 3, 1, 2) + data
    p = tmp_path_factory.mktemp("noise") / "n.gguf"
    p.write_bytes(raw)
    peak_allocation(p)
