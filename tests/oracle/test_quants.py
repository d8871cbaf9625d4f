"""Oracle: every block format of reference/quants.py against ggml's C and ``gguf.quants``.

Two oracles, both live:

- **ggml's own** ``dequantize_row_*`` (``ggml/src/ggml-quants.c`` at the pinned commit), called
  through ctypes in the ``libggml-base`` that llama-cpp-python ships. This is the
  specification itself, and the only oracle for Q8_K, which ``gguf.quants`` does not read.
- ``gguf.quants.dequantize`` (gguf 0.19.0), for every type it reads.

Each type is checked bit for bit (float32 bit patterns; a NaN only has to be a NaN where the
oracle has one) on three kinds of input:

- any bytes at all, drawn by hypothesis (infinite and NaN float16 scales included);
- blocks whose scale fields hypothesis draws finite (so no block is lost to a NaN);
- edge blocks: zero and negative-zero scales, the extreme float16 / float32 / E8M0 / UE4M3
  scales, all-zero and all-max quants, and every byte value in every position.

The plain-float types and the older laws against gguf stay in tests/laws/test_quants.py;
the grid I-quants, once registered in ``DEQUANTIZE``, join the raw-bytes oracles here.
"""

from __future__ import annotations

import ctypes
import os
import warnings

import numpy as np
import pytest
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from hypothesis import given
from hypothesis import strategies as st

from reference import quants
from reference.quants import BLOCK_LAYOUTS, BlockLayout, dequantize

T = GGMLQuantizationType

# The types whose scale fields are known here: (byte offset, encoding) of each scale field.
SCALE_FIELDS: dict[GGMLQuantizationType, tuple[tuple[int, str], ...]] = {
    T.Q4_0: ((0, "f16"),),
    T.Q4_1: ((0, "f16"), (2, "f16")),
    T.Q5_0: ((0, "f16"),),
    T.Q5_1: ((0, "f16"), (2, "f16")),
    T.Q8_0: ((0, "f16"),),
    T.Q2_K: ((80, "f16"), (82, "f16")),
    T.Q3_K: ((108, "f16"),),
    T.Q4_K: ((0, "f16"), (2, "f16")),
    T.Q5_K: ((0, "f16"), (2, "f16")),
    T.Q6_K: ((208, "f16"),),
    T.Q8_K: ((0, "f32"),),
    T.TQ1_0: ((52, "f16"),),
    T.TQ2_0: ((64, "f16"),),
    T.IQ4_NL: ((0, "f16"),),
    T.IQ4_XS: ((0, "f16"),),
    T.MXFP4: ((0, "e8m0"),),
    T.NVFP4: ((0, "ue4m3"), (1, "ue4m3"), (2, "ue4m3"), (3, "ue4m3")),
}
SIMPLE = list(SCALE_FIELDS)
FLOATS = [T.F32, T.F16, T.BF16]
# Whatever else the dispatch table reads (the grid I-quants, once registered) joins in.
QUANTIZED = SIMPLE + [t for t in quants.DEQUANTIZE if t not in SIMPLE and t not in FLOATS]
NOT_IN_GGUF = {T.Q8_K}  # gguf.quants raises NotImplementedError for these
IN_GGUF = [t for t in QUANTIZED if t not in NOT_IN_GGUF]

# Special values of each scale encoding, as the bytes of the field.
SPECIAL_SCALES: dict[str, dict[str, bytes]] = {
    "f16": {
        "zero": bytes.fromhex("0000"),
        "negative zero": bytes.fromhex("0080"),
        "one": bytes.fromhex("003c"),
        "largest (65504)": bytes.fromhex("ff7b"),
        "most negative (-65504)": bytes.fromhex("fffb"),
        "smallest subnormal (2^-24)": bytes.fromhex("0100"),
        "largest subnormal": bytes.fromhex("ff03"),
        "smallest normal (2^-14)": bytes.fromhex("0004"),
        "infinity": bytes.fromhex("007c"),
        "-infinity": bytes.fromhex("00fc"),
        "NaN": bytes.fromhex("007e"),
    },
    "f32": {
        "zero": np.float32(0).tobytes(),
        "negative zero": np.float32(-0.0).tobytes(),
        "one": np.float32(1).tobytes(),
        "FLT_MAX": np.finfo(np.float32).max.tobytes(),
        "smallest subnormal": np.uint32(1).tobytes(),
        "smallest normal": np.finfo(np.float32).tiny.tobytes(),
        "infinity": np.float32(np.inf).tobytes(),
        "NaN": np.float32(np.nan).tobytes(),
    },
    # E8M0: a bare exponent, 2^(e - 127); ggml halves it (its E2M1 table is doubled)
    "e8m0": {f"e = {e}": bytes([e]) for e in (0, 1, 2, 126, 127, 128, 253, 254, 255)},
    # UE4M3: 4 exponent bits (bias 7), 3 mantissa bits; bit 7 is not a sign
    "ue4m3": {
        f"0x{b:02X}": bytes([b])
        for b in (0x00, 0x01, 0x07, 0x08, 0x38, 0x77, 0x78, 0x7E, 0x7F, 0x80, 0x81, 0xB8, 0xFF)
    },
}
# A scale field holding 1 (1/2 for the halved E8M0 and UE4M3 of ggml's FP4 types).
UNIT_SCALE = {"f16": bytes.fromhex("003c"), "f32": np.float32(1).tobytes(), "e8m0": bytes([127]),
              "ue4m3": bytes([0x38])}




def layout_of(qtype: GGMLQuantizationType) -> BlockLayout:
    """Ours, or gguf's sizes for a type registered without a layout (the grid I-quants)."""
    return BLOCK_LAYOUTS.get(qtype) or BlockLayout(*GGML_QUANT_SIZES[qtype])


# ---------------------------------------------------------------------------------------------
# The oracles
# ---------------------------------------------------------------------------------------------


def _ggml_base() -> ctypes.CDLL:
    llama_cpp = pytest.importorskip("llama_cpp")
    lib_dir = os.path.join(os.path.dirname(llama_cpp.__file__), "lib")
    return ctypes.CDLL(os.path.join(lib_dir, "libggml-base.so"))


_LIB: list[ctypes.CDLL] = []


def ggml_dequantize(raw: np.ndarray, qtype: GGMLQuantizationType) -> np.ndarray:
    """ggml's ``dequantize_row_<type>`` on the bytes ``raw`` (``(..., n_bytes)``), as float32.

    The exported C function of ggml-quants.c (``dequantize_row_q2_K``, ``..._iq4_xs``, ...),
    run over all rows at once (the rows are contiguous whole blocks).
    """
    if not _LIB:
        _LIB.append(_ggml_base())
    name = "dequantize_row_" + qtype.name.lower()
    if name.endswith("_k"):
        name = name[:-2] + "_K"  # q2_K ... q8_K keep ggml's capital K
    fn = getattr(_LIB[0], name)
    fn.argtypes, fn.restype = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64], None
    layout = layout_of(qtype)
    raw = np.ascontiguousarray(raw, dtype=np.uint8)
    n_blocks = raw.shape[-1] // layout.type_size
    out = np.zeros((*raw.shape[:-1], n_blocks * layout.block_size), np.float32)
    fn(raw.ctypes.data, out.ctypes.data, out.size)
    return out


def gguf_dequantize(raw: np.ndarray, qtype: GGMLQuantizationType) -> np.ndarray:
    import gguf.quants as gq

    with np.errstate(invalid="ignore", over="ignore"), warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        return gq.dequantize(raw, qtype)


def ours(raw: np.ndarray, qtype: GGMLQuantizationType) -> np.ndarray:
    with np.errstate(invalid="ignore", over="ignore"):
        return dequantize(raw, qtype)


def assert_same_nan_by_nan(a: np.ndarray, b: np.ndarray, what: str = "") -> None:
    """Same shape, float32, NaN exactly where the other has NaN, the same bits elsewhere."""
    assert a.shape == b.shape, what
    assert a.dtype == b.dtype == np.float32, what
    nan = np.isnan(a)
    assert np.array_equal(nan, np.isnan(b)), f"{what}: NaN at different places"
    bits_a = np.where(nan, np.float32(0), a).view(np.uint32)
    bits_b = np.where(nan, np.float32(0), b).view(np.uint32)
    differ = bits_a != bits_b
    assert not differ.any(), (
        f"{what}: {differ.sum()} differing values, e.g. ours {a[differ][:4]} vs {b[differ][:4]}"
    )


def check_both_oracles(raw: np.ndarray, qtype: GGMLQuantizationType, what: str = "") -> None:
    mine = ours(raw, qtype)
    assert_same_nan_by_nan(mine, ggml_dequantize(raw, qtype), f"{qtype.name} vs ggml {what}")
    if qtype not in NOT_IN_GGUF:
        assert_same_nan_by_nan(mine, gguf_dequantize(raw, qtype), f"{qtype.name} vs gguf {what}")


# ---------------------------------------------------------------------------------------------
# Coverage
# ---------------------------------------------------------------------------------------------

GRID_IQUANTS = {T.IQ2_XXS, T.IQ2_XS, T.IQ2_S, T.IQ3_XXS, T.IQ3_S, T.IQ1_S, T.IQ1_M}


@pytest.mark.oracle
def test_every_type_gguf_reads_is_read_here():
    """Every type ``gguf.quants`` dequantizes (the grid I-quants aside: reference/quants_iq.py)
    is in the dispatch table, and so is Q8_K, which ggml reads and gguf does not."""
    import gguf.quants as gq

    in_gguf = set(gq._type_traits) | {T.F32, T.F16}  # F32/F16 are gguf's plain views
    assert in_gguf - GRID_IQUANTS <= set(quants.DEQUANTIZE)
    assert T.Q8_K in quants.DEQUANTIZE
    assert set(SIMPLE) | set(FLOATS) == in_gguf - GRID_IQUANTS | {T.Q8_K}


# ---------------------------------------------------------------------------------------------
# Random bytes
# ---------------------------------------------------------------------------------------------


@st.composite
def raw_rows(draw, qtype: GGMLQuantizationType) -> np.ndarray:
    """uint8 ``(n_rows, n_blocks * type_size)``: any bytes at all, drawn by hypothesis."""
    n_rows, n_blocks = draw(st.integers(1, 3)), draw(st.integers(1, 3))
    size = layout_of(qtype).type_size * n_blocks
    data = draw(st.binary(min_size=n_rows * size, max_size=n_rows * size))
    return np.frombuffer(data, np.uint8).reshape(n_rows, size).copy()


def _finite_bits(n_bits: int, n_exponent: int) -> st.SearchStrategy[bytes]:
    """The little-endian bytes of any finite IEEE float of ``n_bits``, drawn as its bits.

    A draw whose exponent is all ones (an infinity or a NaN) loses the top exponent bit, so
    every finite value, subnormals and the largest included, can be drawn, without rejection.
    """
    top_exponent_bit = 1 << (n_bits - 2)
    all_ones = ((1 << n_exponent) - 1) << (n_bits - 1 - n_exponent)

    def finite(bits: int) -> bytes:
        if bits & all_ones == all_ones:
            bits &= ~top_exponent_bit
        return bits.to_bytes(n_bits // 8, "little")

    return st.integers(0, 2**n_bits - 1).map(finite)


FINITE_SCALE = {
    "f16": _finite_bits(16, 5),
    "f32": _finite_bits(32, 8),
    "e8m0": st.binary(min_size=1, max_size=1),  # every code is finite
    "ue4m3": st.binary(min_size=1, max_size=1),
}


@st.composite
def finite_blocks(draw, qtype: GGMLQuantizationType) -> np.ndarray:
    """Like `raw_rows`, with every scale field of every block drawn finite."""
    raw = draw(raw_rows(qtype))
    blocks = raw.reshape(-1, layout_of(qtype).type_size)
    for block in blocks:
        for offset, kind in SCALE_FIELDS[qtype]:
            field = draw(FINITE_SCALE[kind])
            block[offset : offset + len(field)] = np.frombuffer(field, np.uint8)
    return raw


@pytest.mark.oracle
@pytest.mark.parametrize("qtype", QUANTIZED, ids=lambda t: t.name)
@given(data=st.data())
def test_random_bytes_match_ggml_nan_by_nan(qtype, data):
    raw = data.draw(raw_rows(qtype))
    assert_same_nan_by_nan(ours(raw, qtype), ggml_dequantize(raw, qtype), qtype.name)


@pytest.mark.oracle
@pytest.mark.parametrize("qtype", IN_GGUF, ids=lambda t: t.name)
@given(data=st.data())
def test_random_bytes_match_gguf_nan_by_nan(qtype, data):
    raw = data.draw(raw_rows(qtype))
    assert_same_nan_by_nan(ours(raw, qtype), gguf_dequantize(raw, qtype), qtype.name)


@pytest.mark.oracle
@pytest.mark.parametrize("qtype", SIMPLE, ids=lambda t: t.name)
@given(data=st.data())
def test_blocks_with_finite_scales_are_bit_identical(qtype, data):
    """Finite scales: no NaN anywhere, and every value bit-identical to both oracles."""
    raw = data.draw(finite_blocks(qtype))
    layout = layout_of(qtype)
    w = ours(raw, qtype)
    assert w.shape == (raw.shape[0], raw.shape[1] // layout.type_size * layout.block_size)
    assert not np.isnan(w).any()
    check_both_oracles(raw, qtype)


# ---------------------------------------------------------------------------------------------
# Edge blocks
# ---------------------------------------------------------------------------------------------


def edge_blocks(qtype: GGMLQuantizationType) -> dict[str, np.ndarray]:
    """Named single blocks: each special scale value with all-zero and all-max quants, in
    every scale field at once and in the first one only (the others 1.0 or a unit exponent).
    """
    size = layout_of(qtype).type_size
    fields = SCALE_FIELDS[qtype]
    kind = fields[0][1]
    cases = {}
    for fill_name, fill in (("all-zero quants", 0x00), ("all-max quants", 0xFF)):
        for name, value in SPECIAL_SCALES[kind].items():
            for where in ("every scale", "first scale"):
                if where == "first scale" and len(fields) == 1:
                    continue
                block = np.full(size, fill, np.uint8)
                for i, (offset, _) in enumerate(fields):
                    v = value if where == "every scale" or i == 0 else UNIT_SCALE[kind]
                    block[offset : offset + len(v)] = np.frombuffer(v, np.uint8)
                cases[f"{fill_name}, {where} {name}"] = block
    cases["all bytes 0x00"] = np.zeros(size, np.uint8)
    cases["all bytes 0xFF"] = np.full(size, 0xFF, np.uint8)
    cases["all bytes 0x55"] = np.full(size, 0x55, np.uint8)
    cases["all bytes 0xAA"] = np.full(size, 0xAA, np.uint8)
    return cases


@pytest.mark.oracle
@pytest.mark.parametrize("qtype", SIMPLE, ids=lambda t: t.name)
def test_edge_blocks_match_both_oracles(qtype):
    cases = edge_blocks(qtype)
    assert len(cases) >= 20
    for name, block in cases.items():
        check_both_oracles(block, qtype, name)


@pytest.mark.oracle
@pytest.mark.parametrize("qtype", QUANTIZED, ids=lambda t: t.name)
def test_every_byte_value_in_every_position_matches_both_oracles(qtype):
    """256 blocks: byte k of block i is (i + 37 k) mod 256, so each position takes every value
    (scales included: float16 infinities and NaNs, every E8M0 and UE4M3 code)."""
    size = layout_of(qtype).type_size
    i, k = np.arange(256)[:, None], np.arange(size)[None, :]
    raw = ((i + 37 * k) % 256).astype(np.uint8)  # (256, type_size): one block per row
    check_both_oracles(raw, qtype)
    check_both_oracles(raw.reshape(4, 64 * size), qtype, "as 4 rows of 64 blocks")


# ---------------------------------------------------------------------------------------------
# Known values of the scale encodings, read through ggml itself
# ---------------------------------------------------------------------------------------------


@pytest.mark.oracle
def test_mxfp4_e8m0_scales_are_halved_powers_of_two_in_ggml_too():
    """Weight 1 (E2M1 code 2, doubled value 2) of an MXFP4 block reads 2 * 2^(e - 128)."""
    e = np.arange(256)
    raw = np.zeros((256, 17), np.uint8)
    raw[:, 0] = e
    raw[:, 1] = 0x02  # weight 0: code 2 (doubled value 2); weight 16: code 0
    with np.errstate(over="ignore"):  # e = 255: 2 * 2^127 is infinity in float32
        expected = np.ldexp(np.float32(2), (e - 128).astype(np.int32)).astype(np.float32)
    for w in (ours(raw, T.MXFP4), ggml_dequantize(raw, T.MXFP4)):
        assert np.array_equal(w[:, 0].view(np.uint32), expected.view(np.uint32))


@pytest.mark.oracle
def test_nvfp4_ue4m3_codes_read_as_ggml_reads_them():
    """Each UE4M3 code as sub-block scale, times E2M1 code 2 (doubled value 2)."""
    code = np.arange(256)
    raw = np.zeros((256, 36), np.uint8)
    raw[:, 0] = code
    raw[:, 4] = 0x02
    mine, theirs = ours(raw, T.NVFP4)[:, 0], ggml_dequantize(raw, T.NVFP4)[:, 0]
    assert np.array_equal(mine.view(np.uint32), theirs.view(np.uint32))
    # 0x7F (E4M3's NaN) and 0x00 read 0; bit 7 is ignored, so 0xFF is 0x7F's twin that is not
    # caught: 1.875 * 2^8 (times the doubled 2, halved)
    assert mine[0x00] == mine[0x7F] == mine[0x80] == 0
    assert mine[0x38] == 1.0 and mine[0xB8] == 1.0  # 2^0
    assert mine[0x7E] == 448.0 and mine[0xFF] == 480.0
    assert mine[0x01] == 2.0**-9  # smallest subnormal
