"""The grid I-quants of reference/quants_iq.py against ``gguf.quants`` (gguf-py's NumPy port).

- the tables: every grid point, the sign table, the IQ1 shift and the block sizes equal the
  ones ``gguf.quants`` builds (``init_grid`` unpacks its ``grid_hex``), so a transcription
  slip cannot hide;
- the weights: bit-identical to ``gguf.quants.dequantize`` on random raw bytes (any float16
  scale, NaN and infinities included: NaN where it has NaN, the same bits elsewhere), on
  random blocks with finite scales (every bit), and on edge blocks (zero scales of both
  signs, the extreme float16 exponents, every sign bit set, all-zero and all-one bytes).
"""

from __future__ import annotations

import gguf.quants as gq
import numpy as np
import pytest
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from hypothesis import given
from hypothesis import strategies as st

from reference import quants_iq
from reference.quants_iq import IQ_DEQUANTIZERS, KSIGNS_IQ2XS, QK_K

T = GGMLQuantizationType
IQ_TYPES = [T.IQ2_XXS, T.IQ2_XS, T.IQ2_S, T.IQ3_XXS, T.IQ3_S, T.IQ1_S, T.IQ1_M]
GRID_OF = {
    T.IQ2_XXS: "IQ2XXS_GRID",
    T.IQ2_XS: "IQ2XS_GRID",
    T.IQ2_S: "IQ2S_GRID",
    T.IQ3_XXS: "IQ3XXS_GRID",
    T.IQ3_S: "IQ3S_GRID",
    T.IQ1_S: "IQ1S_GRID",
    T.IQ1_M: "IQ1S_GRID",  # IQ1_M reads IQ1_S's grid
}

# A float16 scale that is a signalling NaN makes NumPy's multiply warn "invalid value" (in
# gguf.quants as here); random bytes hold many.
pytestmark = [pytest.mark.oracle, pytest.mark.filterwarnings("ignore:invalid value:RuntimeWarning")]


def assert_bits_equal(a: np.ndarray, b: np.ndarray, nan_equal: bool = False) -> None:
    """Same shape, float32, same 32 bits everywhere (but where both are NaN, if allowed)."""
    assert a.shape == b.shape
    assert a.dtype == b.dtype == np.float32
    nan = np.isnan(a) if nan_equal else np.zeros(a.shape, dtype=bool)
    assert (nan == (np.isnan(b) & nan_equal)).all(), "NaN in different places"
    mismatch = (a.view(np.uint32) != b.view(np.uint32)) & ~nan
    assert not mismatch.any(), f"{mismatch.sum()} differing values, e.g. {a[mismatch][:4]}"


def ours(raw: np.ndarray, qtype: GGMLQuantizationType) -> np.ndarray:
    """Rows of raw bytes ``(..., n_blocks * type_size)`` -> ``(..., n_blocks * 256)``."""
    fn, size = IQ_DEQUANTIZERS[qtype]
    lead, n_blocks = raw.shape[:-1], raw.shape[-1] // size
    return fn(raw.reshape(*lead, n_blocks, size)).reshape(*lead, n_blocks * QK_K)


def gguf_grid(qtype: GGMLQuantizationType) -> np.ndarray:
    cls = gq._type_traits[qtype]
    cls.init_grid()
    return cls.grid.reshape(cls.grid_shape)


def set_scale_bits(raw: np.ndarray, qtype: GGMLQuantizationType, bits: np.ndarray) -> None:
    """Write float16 bit patterns ``bits`` (one per block) as the blocks' super-block scale."""
    blocks = raw.reshape(-1, IQ_DEQUANTIZERS[qtype][1])
    bits = np.broadcast_to(np.asarray(bits, dtype=np.uint16), (len(blocks),))
    if qtype == T.IQ1_M:  # the top nibble of each of the four uint16 scale words
        for k in range(4):
            nibble = ((bits >> 4 * k) & 15).astype(np.uint8)
            blocks[:, 49 + 2 * k] = (blocks[:, 49 + 2 * k] & 0x0F) | (nibble << 4)
    else:
        blocks[:, 0:2] = bits.astype("<u2").view(np.uint8).reshape(-1, 2)


# ---------------------------------------------------------------------------------------------
# The tables
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("qtype", IQ_TYPES)
def test_grid_equals_gguf(qtype):
    grid = getattr(quants_iq, GRID_OF[qtype])
    expected = gguf_grid(qtype)
    assert grid.shape == expected.shape
    assert (grid.astype(np.float32) == expected).all()


def test_sign_table_and_shift_equal_gguf():
    assert KSIGNS_IQ2XS.tobytes() == gq.IQ2_XXS.ksigns
    assert quants_iq.IQ1S_DELTA == gq.IQ1_S.delta
    assert quants_iq.IQ1M_DELTA == gq.IQ1_M.delta


def test_block_sizes_equal_gguf():
    assert set(IQ_DEQUANTIZERS) == set(IQ_TYPES)
    for qtype, (_, size) in IQ_DEQUANTIZERS.items():
        assert GGML_QUANT_SIZES[qtype] == (QK_K, size), qtype.name


# ---------------------------------------------------------------------------------------------
# The weights
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("qtype", IQ_TYPES)
@given(data=st.data())
def test_random_raw_bytes_bit_identical_to_gguf(qtype, data):
    size = IQ_DEQUANTIZERS[qtype][1]
    n_rows = data.draw(st.integers(1, 3), label="n_rows")
    n_blocks = data.draw(st.integers(1, 3), label="n_blocks")
    raw = data.draw(st.binary(min_size=n_rows * n_blocks * size, max_size=n_rows * n_blocks * size))
    raw = np.frombuffer(raw, dtype=np.uint8).reshape(n_rows, n_blocks * size)
    assert_bits_equal(ours(raw, qtype), gq.dequantize(raw, qtype), nan_equal=True)


@pytest.mark.parametrize("qtype", IQ_TYPES)
@pytest.mark.parametrize("seed", range(3))
def test_random_blocks_with_finite_scales_bit_identical_to_gguf(qtype, seed):
    rng = np.random.default_rng(seed)
    size = IQ_DEQUANTIZERS[qtype][1]
    raw = rng.integers(0, 256, (4, 8 * size), dtype=np.uint8)
    scale = rng.standard_normal(32) * 10.0 ** rng.integers(-7, 4, 32)  # subnormal to large
    set_scale_bits(raw, qtype, scale.astype("<f2").view("<u2"))
    w = ours(raw, qtype)
    assert np.isfinite(w).all()
    assert_bits_equal(w, gq.dequantize(raw, qtype))


# float16 bit patterns of the super-block scale at the edges of the format
EDGE_SCALES = {
    "+0": 0x0000,
    "-0": 0x8000,
    "smallest subnormal": 0x0001,
    "largest subnormal": 0x03FF,
    "smallest normal": 0x0400,
    "largest finite": 0x7BFF,
    "most negative": 0xFBFF,
    "+inf": 0x7C00,
    "-inf": 0xFC00,
    "nan": 0x7E00,
}

# Per type, the bytes (offset, mask) that hold sign bits: each set, every sign is minus.
SIGN_BITS = {
    T.IQ2_XXS: [(2 + 8 * b + 4 + k, m) for b in range(8) for k, m in enumerate([255] * 3 + [15])],
    T.IQ2_XS: [(2 + 2 * k + 1, 0xFE) for k in range(32)],
    T.IQ2_S: [(34 + k, 0xFF) for k in range(32)],
    T.IQ3_XXS: [(66 + 4 * b + k, m) for b in range(8) for k, m in enumerate([255] * 3 + [15])],
    T.IQ3_S: [(74 + k, 0xFF) for k in range(32)],
    T.IQ1_S: [(34 + 2 * b + 1, 0x80) for b in range(8)],  # the shift's sign
    T.IQ1_M: [(32 + k, 0x88) for k in range(16)],
}


def edge_blocks(qtype: GGMLQuantizationType) -> dict[str, np.ndarray]:
    """Named raw blocks ``(n, type_size)``: each edge scale over random quants, and more."""
    size = IQ_DEQUANTIZERS[qtype][1]
    rng = np.random.default_rng(0)
    cases = {}
    for name, bits in EDGE_SCALES.items():
        raw = rng.integers(0, 256, (4, size), dtype=np.uint8)
        set_scale_bits(raw, qtype, bits)
        cases[f"scale {name}"] = raw
        signs = raw.copy()
        for offset, mask in SIGN_BITS[qtype]:
            signs[:, offset] |= mask
        cases[f"scale {name}, every sign bit set"] = signs
    cases["all zero bytes"] = np.zeros((1, size), dtype=np.uint8)
    cases["all one bytes"] = np.full((1, size), 0xFF, dtype=np.uint8)
    return cases


@pytest.mark.parametrize("qtype", IQ_TYPES)
def test_edge_blocks_bit_identical_to_gguf(qtype):
    for name, raw in edge_blocks(qtype).items():
        expected = gq.dequantize(raw, qtype)
        try:
            assert_bits_equal(ours(raw, qtype), expected, nan_equal=True)
        except AssertionError as e:
            raise AssertionError(f"{qtype.name}, {name}: {e}") from e


def test_every_sign_bit_set_makes_every_weight_negative():
    # The sign masks above are what the test claims they are (IQ1 has no signs, only shifts).
    for qtype in [T.IQ2_XXS, T.IQ2_XS, T.IQ2_S, T.IQ3_XXS, T.IQ3_S]:
        w = ours(edge_blocks(qtype)["scale smallest normal, every sign bit set"], qtype)
        assert (w < 0).all(), qtype.name
