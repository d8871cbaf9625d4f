"""Laws of reference/quants_iq.py: the grid I-quants (IQ2_XXS ... IQ1_M).

Three kinds of evidence that need no oracle (``tests/oracle/test_quants_iq.py`` holds the
comparisons with ``gguf.quants``):

- the tables: entries of each grid as written in ``ggml/src/ggml-common.h`` (first, second,
  middle and last, packed back into ggml's little-endian ``uint64``/``uint32``), the sign
  table's parity rule, and the lattice the IQ2 grids come from (E8);
- independent ports: each ``dequantize_row_iq*`` of ``ggml/src/ggml-quants.c`` transliterated
  loop for loop, one weight at a time in float32, against the vectorized functions on random
  blocks, bit for bit;
- laws and worked blocks: a power-of-two scale scales every weight exactly, an explicit sign
  bit negates exactly its weight, leading dimensions and strided inputs, hand-computed weights.
"""

from __future__ import annotations

import numpy as np
import pytest
from gguf import GGMLQuantizationType
from hypothesis import given
from hypothesis import strategies as st

from reference import quants_iq
from reference.quants_iq import (
    IQ1S_DELTA,
    IQ1S_GRID,
    IQ2S_GRID,
    IQ2XS_GRID,
    IQ2XXS_GRID,
    IQ3S_GRID,
    IQ3XXS_GRID,
    IQ_DEQUANTIZERS,
    KMASK_IQ2XS,
    KSIGNS_IQ2XS,
    QK_K,
    dequantize_iq1_m,
    dequantize_iq1_s,
    dequantize_iq2_s,
    dequantize_iq2_xs,
    dequantize_iq2_xxs,
    dequantize_iq3_s,
    dequantize_iq3_xxs,
)

T = GGMLQuantizationType
IQ_TYPES = [T.IQ2_XXS, T.IQ2_XS, T.IQ2_S, T.IQ3_XXS, T.IQ3_S, T.IQ1_S, T.IQ1_M]
F32 = np.float32


def assert_bits_equal(a: np.ndarray, b: np.ndarray) -> None:
    """Same shape, float32, and the same 32 bits everywhere but where both are NaN."""
    assert a.shape == b.shape
    assert a.dtype == b.dtype == np.float32
    nan = np.isnan(a)
    assert (nan == np.isnan(b)).all(), "NaN in different places"
    mismatch = (a.view(np.uint32) != b.view(np.uint32)) & ~nan
    assert not mismatch.any(), f"{mismatch.sum()} differing values, e.g. {a[mismatch][:4]}"


def f16_bits(value: float) -> bytes:
    """The two little-endian bytes of a float16."""
    return np.array([value], dtype="<f2").tobytes()


def block(qtype: GGMLQuantizationType, d: float = 1.0) -> np.ndarray:
    """An all-zero block of ``qtype`` whose super-block scale is ``d``."""
    raw = np.zeros(IQ_DEQUANTIZERS[qtype][1], dtype=np.uint8)
    set_scale(raw, qtype, np.frombuffer(f16_bits(d), dtype="<u2")[0])
    return raw


def set_scale(raw: np.ndarray, qtype: GGMLQuantizationType, bits: int) -> None:
    """Write the float16 super-block scale (bit pattern ``bits``) into every block of ``raw``.

    IQ1_M keeps it in the top nibble of each of its four ``uint16`` sub-block scale words;
    every other type in its first two bytes.
    """
    blocks = raw.reshape(-1, IQ_DEQUANTIZERS[qtype][1])
    if qtype == T.IQ1_M:
        for k in range(4):
            blocks[:, 49 + 2 * k] = (blocks[:, 49 + 2 * k] & 0x0F) | (((bits >> 4 * k) & 15) << 4)
    else:
        blocks[:, 0] = bits & 0xFF
        blocks[:, 1] = bits >> 8


# ---------------------------------------------------------------------------------------------
# The tables
# ---------------------------------------------------------------------------------------------

# (first, second, middle, last) entries of each table in ggml/src/ggml-common.h.
HEADER_ENTRIES = {
    "IQ2XXS_GRID": (0x0808080808080808, 0x080808080808082B, 0x082B2B0808082B08, 0x2B2B2B1908081908),
    "IQ2XS_GRID": (0x0808080808080808, 0x080808080808082B, 0x190808080808192B, 0x2B2B2B2B2B2B2B2B),
    "IQ2S_GRID": (0x0808080808080808, 0x080808080808082B, 0x19080819082B1919, 0x2B2B2B2B2B2B2B2B),
    "IQ3XXS_GRID": (0x04040404, 0x04040414, 0x141C3E04, 0x3E341C04),
    "IQ3S_GRID": (0x01010101, 0x01010103, 0x05090507, 0x0F0F0101),
    "IQ1S_GRID": (0xFFFFFFFFFFFFFFFF, 0xFFFFFFFFFFFFFF01, 0x0000000000FF0100, 0x0101010101010101),
}
GRID_SHAPES = {
    "IQ2XXS_GRID": (256, 8),
    "IQ2XS_GRID": (512, 8),
    "IQ2S_GRID": (1024, 8),
    "IQ3XXS_GRID": (256, 4),
    "IQ3S_GRID": (512, 4),
    "IQ1S_GRID": (2048, 8),
}


@pytest.mark.parametrize("name", sorted(HEADER_ENTRIES))
def test_grid_entries_as_written_in_ggml_common_h(name):
    grid = getattr(quants_iq, name)
    assert grid.shape == GRID_SHAPES[name]
    n = len(grid)
    packed = np.ascontiguousarray(grid).view(f"<u{grid.shape[1]}")[:, 0]  # ggml's words
    assert [int(packed[i]) for i in (0, 1, n // 2, n - 1)] == list(HEADER_ENTRIES[name])


@pytest.mark.parametrize(
    "grid, values",
    [
        (IQ2XXS_GRID, {0x08, 0x19, 0x2B}),
        (IQ2XS_GRID, {0x08, 0x19, 0x2B}),
        (IQ2S_GRID, {0x08, 0x19, 0x2B}),
        (IQ3XXS_GRID, {4, 12, 20, 28, 36, 44, 52, 62}),
        (IQ3S_GRID, {1, 3, 5, 7, 9, 11, 13, 15}),
        (IQ1S_GRID, {-1, 0, 1}),
    ],
)
def test_grids_take_their_levels_and_have_distinct_points(grid, values):
    assert set(np.unique(grid).tolist()) == values
    assert len(np.unique(grid, axis=0)) == len(grid)


def test_ksigns_adds_the_parity_bit():
    # ggml-common.h's ksigns_iq2xs: the low 7 bits are the index, bit 7 makes the number of
    # set bits (minus signs) even.
    i = np.arange(128)
    assert KSIGNS_IQ2XS.dtype == np.uint8
    assert (KSIGNS_IQ2XS & 127 == i).all()
    assert all(bin(int(s)).count("1") % 2 == 0 for s in KSIGNS_IQ2XS)
    assert KSIGNS_IQ2XS[:8].tolist() == [0, 129, 130, 3, 132, 5, 6, 135]  # as in the header
    assert KMASK_IQ2XS.tolist() == [1, 2, 4, 8, 16, 32, 64, 128]
    assert IQ1S_DELTA == F32(0.125) and IQ1S_DELTA.dtype == np.float32


@pytest.mark.parametrize("grid", [IQ2XXS_GRID, IQ2XS_GRID])
def test_iq2_points_with_even_signs_lie_in_e8(grid):
    # Level l of a coordinate is the odd integer 2l+1 in the lattice (8, 25, 43 is its tuned
    # value); halved, a point with ksigns' signs is in E8's coset (Z + 1/2)^8 of even sum.
    level = {0x08: 0, 0x19: 1, 0x2B: 2}
    lattice = np.vectorize(level.get)(grid) * 2 + 1  # (n, 8) odd integers
    signs = np.where(KSIGNS_IQ2XS[:, None] & KMASK_IQ2XS, -1, 1)  # (128, 8)
    points = lattice[:, None, :] * signs[None, :, :] / 2  # (n, 128, 8)
    assert (points % 1 == 0.5).all()
    assert (points.sum(axis=-1) % 2 == 0).all()


def test_block_bytes_follow_the_structs():
    sizes = {t: size for t, (_, size) in IQ_DEQUANTIZERS.items()}
    assert sizes == {
        T.IQ2_XXS: 66, T.IQ2_XS: 74, T.IQ2_S: 82, T.IQ3_XXS: 98, T.IQ3_S: 110,
        T.IQ1_S: 50, T.IQ1_M: 56,
    }
    bpw = {t.name: 8 * size / QK_K for t, size in sizes.items()}
    assert bpw == {"IQ2_XXS": 2.0625, "IQ2_XS": 2.3125, "IQ2_S": 2.5625, "IQ3_XXS": 3.0625,
                   "IQ3_S": 3.4375, "IQ1_S": 1.5625, "IQ1_M": 1.75}


# ---------------------------------------------------------------------------------------------
# Literal ports of ggml's C loops (ggml/src/ggml-quants.c), one block, one weight at a time
# ---------------------------------------------------------------------------------------------


def _fp16(b: np.ndarray, o: int) -> np.float32:
    return np.frombuffer(b[o : o + 2].tobytes(), dtype="<f2")[0].astype(F32)


def _u16(b: np.ndarray, o: int) -> int:
    return int(b[o]) | int(b[o + 1]) << 8


def _u32(b: np.ndarray, o: int) -> int:
    return _u16(b, o) | _u16(b, o + 2) << 16


def _sgn(signs: int, j: int) -> np.float32:
    return F32(-1.0) if signs & int(KMASK_IQ2XS[j]) else F32(1.0)


def c_iq2_xxs(x: np.ndarray) -> list:
    y, d = [], _fp16(x, 0)
    for ib32 in range(8):
        aux0, aux1 = _u32(x, 2 + 8 * ib32), _u32(x, 2 + 8 * ib32 + 4)
        db = d * (F32(0.5) + F32(aux1 >> 28)) * F32(0.25)
        for l in range(4):
            grid = IQ2XXS_GRID[(aux0 >> 8 * l) & 255]
            signs = int(KSIGNS_IQ2XS[(aux1 >> 7 * l) & 127])
            y += [db * F32(grid[j]) * _sgn(signs, j) for j in range(8)]
    return y


def c_iq2_xs(x: np.ndarray) -> list:
    y, d = [], _fp16(x, 0)
    for ib32 in range(8):
        sc = int(x[66 + ib32])
        db = [d * (F32(0.5) + F32(s)) * F32(0.25) for s in (sc & 0xF, sc >> 4)]
        for l in range(4):
            q = _u16(x, 2 + 2 * (4 * ib32 + l))
            grid, signs = IQ2XS_GRID[q & 511], int(KSIGNS_IQ2XS[q >> 9])
            y += [db[l // 2] * F32(grid[j]) * _sgn(signs, j) for j in range(8)]
    return y


def c_iq2_s(x: np.ndarray) -> list:
    y, d = [], _fp16(x, 0)
    for ib32 in range(8):
        sc, qh = int(x[74 + ib32]), int(x[66 + ib32])
        db = [d * (F32(0.5) + F32(s)) * F32(0.25) for s in (sc & 0xF, sc >> 4)]
        for l in range(4):
            grid = IQ2S_GRID[int(x[2 + 4 * ib32 + l]) | (qh << (8 - 2 * l) & 0x300)]
            signs = int(x[34 + 4 * ib32 + l])
            y += [db[l // 2] * F32(grid[j]) * _sgn(signs, j) for j in range(8)]
    return y


def c_iq3_xxs(x: np.ndarray) -> list:
    y, d = [], _fp16(x, 0)
    for ib32 in range(8):
        aux32 = _u32(x, 66 + 4 * ib32)
        db = d * (F32(0.5) + F32(aux32 >> 28)) * F32(0.5)
        for l in range(4):
            signs = int(KSIGNS_IQ2XS[(aux32 >> 7 * l) & 127])
            grid1 = IQ3XXS_GRID[x[2 + 8 * ib32 + 2 * l]]
            grid2 = IQ3XXS_GRID[x[2 + 8 * ib32 + 2 * l + 1]]
            y += [db * F32(grid1[j]) * _sgn(signs, j) for j in range(4)]
            y += [db * F32(grid2[j]) * _sgn(signs, j + 4) for j in range(4)]
    return y


def c_iq3_s(x: np.ndarray) -> list:
    y, d = [], _fp16(x, 0)
    for ib32 in range(8):
        sc = int(x[106 + ib32 // 2])
        db = d * F32(1 + 2 * ((sc >> 4 * (ib32 % 2)) & 0xF))
        qh = int(x[66 + ib32])
        for l in range(4):
            q1, q2 = int(x[2 + 8 * ib32 + 2 * l]), int(x[2 + 8 * ib32 + 2 * l + 1])
            grid1 = IQ3S_GRID[q1 | ((qh << (8 - 2 * l)) & 256)]
            grid2 = IQ3S_GRID[q2 | ((qh << (7 - 2 * l)) & 256)]
            signs = int(x[74 + 4 * ib32 + l])
            y += [db * F32(grid1[j]) * _sgn(signs, j) for j in range(4)]
            y += [db * F32(grid2[j]) * _sgn(signs, j + 4) for j in range(4)]
    return y


def c_iq1_s(x: np.ndarray) -> list:
    y, d = [], _fp16(x, 0)
    for ib in range(8):
        qh = _u16(x, 34 + 2 * ib)
        dl = d * F32(2 * ((qh >> 12) & 7) + 1)
        delta = -IQ1S_DELTA if qh & 0x8000 else IQ1S_DELTA
        for l in range(4):
            grid = IQ1S_GRID[int(x[2 + 4 * ib + l]) | (((qh >> 3 * l) & 7) << 8)]
            y += [dl * (F32(grid[j]) + delta) for j in range(8)]
    return y


def c_iq1_m(x: np.ndarray) -> list:
    sc = [_u16(x, 48 + 2 * k) for k in range(4)]
    u16 = (sc[0] >> 12) | ((sc[1] >> 8) & 0x00F0) | ((sc[2] >> 4) & 0x0F00) | (sc[3] & 0xF000)
    y, d = [], np.array([u16], dtype="<u2").view("<f2")[0].astype(F32)
    for ib in range(8):
        dl1 = d * F32(2 * ((sc[ib // 2] >> (6 * (ib % 2) + 0)) & 0x7) + 1)
        dl2 = d * F32(2 * ((sc[ib // 2] >> (6 * (ib % 2) + 3)) & 0x7) + 1)
        qs, qh = [int(v) for v in x[4 * ib : 4 * ib + 4]], [int(v) for v in x[32 + 2 * ib :][:2]]
        idx = [qs[0] | ((qh[0] << 8) & 0x700), qs[1] | ((qh[0] << 4) & 0x700),
               qs[2] | ((qh[1] << 8) & 0x700), qs[3] | ((qh[1] << 4) & 0x700)]
        delta = [-IQ1S_DELTA if qh[0] & 0x08 else IQ1S_DELTA,
                 -IQ1S_DELTA if qh[0] & 0x80 else IQ1S_DELTA,
                 -IQ1S_DELTA if qh[1] & 0x08 else IQ1S_DELTA,
                 -IQ1S_DELTA if qh[1] & 0x80 else IQ1S_DELTA]
        for l in range(4):
            dl = dl1 if l < 2 else dl2
            y += [dl * (F32(IQ1S_GRID[idx[l]][j]) + delta[l]) for j in range(8)]
    return y


C_PORTS = {
    T.IQ2_XXS: c_iq2_xxs, T.IQ2_XS: c_iq2_xs, T.IQ2_S: c_iq2_s, T.IQ3_XXS: c_iq3_xxs,
    T.IQ3_S: c_iq3_s, T.IQ1_S: c_iq1_s, T.IQ1_M: c_iq1_m,
}


@pytest.mark.parametrize("qtype", IQ_TYPES)
@given(seed=st.integers(0, 2**32 - 1), scale=st.floats(-1e3, 1e3, width=16))
def test_dequantize_matches_a_literal_port_of_ggml_c(qtype, seed, scale):
    fn, size = IQ_DEQUANTIZERS[qtype]
    raw = np.random.default_rng(seed).integers(0, 256, size, dtype=np.uint8)
    set_scale(raw, qtype, int(np.array([scale], dtype="<f2").view("<u2")[0]))
    expected = np.array(C_PORTS[qtype](raw), dtype=np.float32)
    assert_bits_equal(fn(raw), expected)


# ---------------------------------------------------------------------------------------------
# Laws
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("qtype", IQ_TYPES)
@given(seed=st.integers(0, 2**32 - 1), e=st.integers(-10, 10))
def test_a_power_of_two_scale_scales_every_weight_exactly(qtype, seed, e):
    fn, size = IQ_DEQUANTIZERS[qtype]
    raw = np.random.default_rng(seed).integers(0, 256, size, dtype=np.uint8)
    set_scale(raw, qtype, 0x3C00)  # d = 1
    w1 = fn(raw)
    set_scale(raw, qtype, int(np.array([2.0**e], dtype="<f2").view("<u2")[0]))
    assert_bits_equal(fn(raw), w1 * F32(2.0**e))


# Byte ranges of the explicit sign bytes (bit j of a byte: weight j of its 8).
EXPLICIT_SIGNS = {T.IQ2_S: (34, 66), T.IQ3_S: (74, 106)}


@pytest.mark.parametrize("qtype", sorted(EXPLICIT_SIGNS))
@given(seed=st.integers(0, 2**32 - 1), k=st.integers(0, 255))
def test_an_explicit_sign_bit_negates_exactly_its_weight(qtype, seed, k):
    fn, size = IQ_DEQUANTIZERS[qtype]
    raw = np.random.default_rng(seed).integers(0, 256, size, dtype=np.uint8)
    set_scale(raw, qtype, 0x3C00)
    before = fn(raw)
    raw[EXPLICIT_SIGNS[qtype][0] + k // 8] ^= np.uint8(1 << (k % 8))
    after = fn(raw)
    assert after[k] == -before[k]
    assert_bits_equal(np.delete(after, k), np.delete(before, k))


def test_iq1_s_delta_sign_shifts_a_whole_sub_block():
    raw = block(T.IQ1_S)
    flipped = raw.copy()
    flipped[34 + 2 * 3 + 1] = 0x80  # bit 15 of qh[3]: sub-block 3 shifts by -1/8
    a, b = dequantize_iq1_s(raw), dequantize_iq1_s(flipped)
    assert (b[96:128] - a[96:128] == F32(-0.25)).all()  # dl * (g - 1/8) - dl * (g + 1/8)
    assert_bits_equal(np.delete(b, np.s_[96:128]), np.delete(a, np.s_[96:128]))


@pytest.mark.parametrize("qtype", IQ_TYPES)
def test_leading_dimensions_and_strided_blocks(qtype):
    fn, size = IQ_DEQUANTIZERS[qtype]
    raw = np.random.default_rng(7).integers(0, 256, (2, 3, size), dtype=np.uint8)
    set_scale(raw, qtype, 0x3C00)
    w = fn(raw)
    assert w.shape == (2, 3, QK_K) and w.dtype == np.float32
    for i in range(2):
        for j in range(3):
            assert_bits_equal(w[i, j], fn(raw[i, j]))
    wide = np.zeros((3, 2 * size), dtype=np.uint8)
    wide[:, ::2] = raw[0]
    assert_bits_equal(fn(wide[:, ::2]), w[0])  # a strided view, not a copy
    assert fn(raw[:0]).shape == (0, 3, QK_K)


# ---------------------------------------------------------------------------------------------
# Worked blocks (values computed by hand from the formulas)
# ---------------------------------------------------------------------------------------------


def test_worked_iq2_xxs():
    raw = block(T.IQ2_XXS, d=2.0)
    raw[2:6] = [1, 0, 0, 0]  # sub-block 0: grid points 1, 0, 0, 0
    aux1 = (3 << 28) | 1  # scale 3; group 0's sign index 1 -> ksigns 129: weights 0 and 7
    raw[6:10] = np.array([aux1], dtype="<u4").view(np.uint8)
    w = dequantize_iq2_xxs(raw)
    db = 2.0 * (0.5 + 3) * 0.25  # 1.75
    assert w[:8].tolist() == [-db * 43] + [db * 8] * 6 + [-db * 8]  # point 1 is (43, 8, ..., 8)
    assert w[8:32].tolist() == [db * 8] * 24
    assert w[32:].tolist() == [2.0 * 0.5 * 0.25 * 8] * 224


def test_worked_iq2_xs_and_iq2_s():
    raw = block(T.IQ2_XS)
    raw[2:4] = np.array([(5 << 9) | 2], dtype="<u2").view(np.uint8)  # point 2, signs 5
    raw[66] = 0x21  # sub-block 0: scale 1 for weights 0-15, scale 2 for 16-31
    w = dequantize_iq2_xs(raw)
    assert IQ2XS_GRID[2].tolist() == [0x19, 0x19, 8, 8, 8, 8, 8, 8]
    assert w[:8].tolist() == [-0.375 * 25, 0.375 * 25, -0.375 * 8] + [0.375 * 8] * 5
    assert w[16:18].tolist() == [0.625 * 8, 0.625 * 8]

    raw = block(T.IQ2_S)
    raw[2 + 4] = 0x01  # low 8 bits of the index of group 0 of sub-block 1
    raw[66 + 1] = 0b10  # qh[1]: bits 8-9 of that index are 2 -> point 513
    raw[34 + 4] = 0x80  # its sign byte: weight 7 negative
    raw[74 + 1] = 0x0F  # sub-block 1: scale 15 for its first 16 weights
    w = dequantize_iq2_s(raw)
    expected = [(15.5 * 0.25) * g for g in IQ2S_GRID[513].tolist()]
    expected[7] = -expected[7]
    assert w[32:40].tolist() == list(expected)


def test_worked_iq3_xxs_and_iq3_s():
    raw = block(T.IQ3_XXS, d=0.5)
    raw[2:4] = [255, 1]  # group 0 of sub-block 0: points 255 and 1
    raw[66:70] = np.array([(1 << 28) | 127], dtype="<u4").view(np.uint8)  # all 8 signs negative
    w = dequantize_iq3_xxs(raw)
    db = 0.5 * 1.5 * 0.5
    assert w[:8].tolist() == [-db * v for v in [4, 28, 52, 62, 20, 4, 4, 4]]

    raw = block(T.IQ3_S, d=0.25)
    raw[2 + 8 * 3 + 1] = 7  # sub-block 3, point 1 of group 0 (weights 100-103): low bits 7
    raw[66 + 3] = 0b10  # qh[3] bit 1: bit 8 of that index -> point 263
    raw[106 + 1] = 0x50  # scales byte 1, high nibble: sub-block 3 has scale 5 -> db = 0.25*11
    w = dequantize_iq3_s(raw)
    assert w[100:104].tolist() == [2.75 * v for v in IQ3S_GRID[263].tolist()]
    assert w[96:100].tolist() == [2.75] * 4  # point 0 is (1, 1, 1, 1)


def test_worked_iq1_s_and_iq1_m():
    raw = block(T.IQ1_S, d=0.5)
    raw[34:36] = np.array([(2 << 12) | (1 << 0)], dtype="<u2").view(np.uint8)  # dl = 0.5*5
    w = dequantize_iq1_s(raw)  # group 0 of sub-block 0 is point 256 (qs 0 | 1 << 8)
    assert w[:8].tolist() == [2.5 * (g + 0.125) for g in IQ1S_GRID[256].tolist()]
    assert w[8:16].tolist() == [2.5 * (-1 + 0.125)] * 8  # point 0 is all -1

    raw = block(T.IQ1_M, d=4.0)
    raw[32] = 0b1001_0000  # qh[0]: group 1 has index bits 1 (point 256) and delta -1/8
    raw[48] |= 0b010_000  # scale word 0, bits 3-5: sub-block 0's second half has scale 2
    w = dequantize_iq1_m(raw)
    assert w[:8].tolist() == [4.0 * (-1 + 0.125)] * 8  # dl1 = 4*1, point 0, delta +1/8
    assert w[8:16].tolist() == [4.0 * (g - 0.125) for g in IQ1S_GRID[256].tolist()]
    assert w[16:24].tolist() == [20.0 * (-1 + 0.125)] * 8  # dl2 = 4*5
