"""Oracle: the K-quant quantizers of reference/quants_k.py against llama.cpp's own C.

The oracle is ggml itself: ``quantize_row_q2_K_ref`` ... ``quantize_row_q6_K_ref`` and
``ggml_quantize_chunk`` (what ``llama-quantize`` calls, without an importance matrix), through
ctypes in the ``libggml-base`` that llama-cpp-python ships (the pinned commit, compiled
without fused multiply-adds). Every comparison is byte for byte:

- on rows drawn as families (Gaussian, negative-only, positive with an offset, constant,
  zero, sparse, small integers and halves full of rounding ties, subnormal, mixed
  magnitudes, one outlier), each scaled by a power of ten from 1e-45 to 1e38;
- on rows of arbitrary finite float32 values (subnormals, signed zeros, the largest floats);
- round trip: ``reference.quants.dequantize`` of our blocks equals ggml's
  ``dequantize_row_*`` of ggml's blocks, bit for bit.

Non-finite weights are refused with a QuantError; the last tests pin down why (what ggml
does with them instead).
"""

from __future__ import annotations

import ctypes
import os

import numpy as np
import pytest
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from hypothesis import given
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from reference.quants import QuantError, dequantize
from reference.quants_k import K_QUANTIZERS, QK_K

T = GGMLQuantizationType
K_TYPES = [T.Q2_K, T.Q3_K, T.Q4_K, T.Q5_K, T.Q6_K]

# Overflow is part of what ggml computes on huge rows: the quantizers must stay silent about it.
pytestmark = [pytest.mark.oracle, pytest.mark.filterwarnings("error::RuntimeWarning")]


# ---------------------------------------------------------------------------------------------
# The oracle
# ---------------------------------------------------------------------------------------------


def _ggml_base() -> ctypes.CDLL:
    llama_cpp = pytest.importorskip("llama_cpp")
    lib_dir = os.path.join(os.path.dirname(llama_cpp.__file__), "lib")
    lib = ctypes.CDLL(os.path.join(lib_dir, "libggml-base.so"))
    p, i64 = ctypes.c_void_p, ctypes.c_int64
    lib.ggml_quantize_chunk.argtypes = [ctypes.c_int, p, p, i64, i64, i64, p]
    lib.ggml_quantize_chunk.restype = ctypes.c_size_t
    lib.ggml_validate_row_data.argtypes = [ctypes.c_int, p, ctypes.c_size_t]
    lib.ggml_validate_row_data.restype = ctypes.c_bool
    return lib


_LIB: list[ctypes.CDLL] = []


def lib() -> ctypes.CDLL:
    if not _LIB:
        _LIB.append(_ggml_base())
    return _LIB[0]


def _c_name(qtype: GGMLQuantizationType) -> str:
    return qtype.name.lower()[:-1] + "K"  # q4_K: ggml keeps the capital K


def ggml_quantize_row_ref(x: np.ndarray, qtype: GGMLQuantizationType) -> np.ndarray:
    """``quantize_row_<type>_ref`` over all rows of float32 ``x`` ``(n_rows, n)`` at once."""
    x = np.ascontiguousarray(x, dtype=np.float32)
    block, size = GGML_QUANT_SIZES[qtype]
    out = np.zeros((x.shape[0], x.shape[1] // block * size), dtype=np.uint8)
    fn = getattr(lib(), f"quantize_row_{_c_name(qtype)}_ref")
    fn.argtypes, fn.restype = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64], None
    fn(x.ctypes.data, out.ctypes.data, x.size)
    return out


def ggml_quantize_chunk(x: np.ndarray, qtype: GGMLQuantizationType) -> np.ndarray:
    """``ggml_quantize_chunk(type, x, dst, 0, n_rows, n_per_row, NULL)``: llama-quantize's call."""
    x = np.ascontiguousarray(x, dtype=np.float32)
    block, size = GGML_QUANT_SIZES[qtype]
    out = np.zeros((x.shape[0], x.shape[1] // block * size), dtype=np.uint8)
    written = lib().ggml_quantize_chunk(
        int(qtype), x.ctypes.data, out.ctypes.data, 0, x.shape[0], x.shape[1], None
    )
    assert written == out.size
    return out


def ggml_dequantize(raw: np.ndarray, qtype: GGMLQuantizationType) -> np.ndarray:
    """``dequantize_row_<type>`` over all rows of ``raw`` ``(n_rows, n_bytes)`` at once."""
    raw = np.ascontiguousarray(raw, dtype=np.uint8)
    block, size = GGML_QUANT_SIZES[qtype]
    out = np.zeros((raw.shape[0], raw.shape[1] // size * block), dtype=np.float32)
    fn = getattr(lib(), f"dequantize_row_{_c_name(qtype)}")
    fn.argtypes, fn.restype = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64], None
    fn(raw.ctypes.data, out.ctypes.data, out.size)
    return out


def ggml_validate(raw: np.ndarray, qtype: GGMLQuantizationType) -> bool:
    """``ggml_validate_row_data``: llama-quantize's check of every block it writes."""
    raw = np.ascontiguousarray(raw, dtype=np.uint8)
    return bool(lib().ggml_validate_row_data(int(qtype), raw.ctypes.data, raw.size))


def assert_bytes_equal(ours: np.ndarray, theirs: np.ndarray, qtype: GGMLQuantizationType):
    assert ours.dtype == np.uint8 and ours.shape == theirs.shape
    size = GGML_QUANT_SIZES[qtype][1]
    differ = (ours != theirs).reshape(-1, size).any(axis=-1)
    assert not differ.any(), f"{qtype.name}: blocks {np.flatnonzero(differ)[:4]} differ"


def assert_floats_equal(a: np.ndarray, b: np.ndarray) -> None:
    """The same float32 bits everywhere, except that a NaN only has to meet a NaN."""
    assert a.shape == b.shape and a.dtype == b.dtype == np.float32
    nan = np.isnan(a)
    assert (nan == np.isnan(b)).all(), "NaN in different places"
    assert (a.view(np.uint32) == b.view(np.uint32))[~nan].all()


# ---------------------------------------------------------------------------------------------
# The inputs
# ---------------------------------------------------------------------------------------------

F32_MAX = float(np.finfo(np.float32).max)
KINDS = (
    "gaussian", "negative only", "positive with offset", "constant", "zero", "sparse",
    "integers", "halves", "subnormal", "mixed magnitudes", "one outlier",
)


def family_row(kind: str, n: int, exponent: int, seed: int) -> np.ndarray:
    """One row of ``n`` finite float32 weights of the given family, scaled by 10**exponent."""
    rng = np.random.default_rng(seed)
    g = rng.standard_normal(n)
    x = {
        "gaussian": g,
        "negative only": -np.abs(g),
        "positive with offset": np.abs(g) + 1.0,
        "constant": np.full(n, g[0]),
        "zero": np.zeros(n) * np.sign(g),  # zeros of both signs
        "sparse": np.where(rng.random(n) < 0.03, g, 0.0),
        "integers": rng.integers(-8, 8, n).astype(np.float64),
        "halves": rng.integers(-16, 16, n) / 2.0,
        "subnormal": g * 1e-40 * 10.0 ** -exponent,  # 1e-40 after the scaling below
        "mixed magnitudes": g * 10.0 ** rng.uniform(-20, 20, n),
        "one outlier": np.where(np.arange(n) == rng.integers(n), 1e3, g),
    }[kind] * 10.0**exponent
    return np.clip(x, -F32_MAX, F32_MAX).astype(np.float32)


@st.composite
def family_rows(draw) -> np.ndarray:
    """``(n_rows, n)`` float32: 1-2 rows of 1-3 super-blocks, each row of one family."""
    n_rows, n_blocks = draw(st.integers(1, 2)), draw(st.integers(1, 3))
    exponent = draw(st.integers(-45, 38))
    rows = [
        family_row(draw(st.sampled_from(KINDS)), n_blocks * QK_K, exponent,
                   draw(st.integers(0, 2**32 - 1)))
        for _ in range(n_rows)
    ]
    return np.stack(rows)


any_finite_rows = hnp.arrays(
    np.float32, (1, QK_K),
    elements=st.floats(width=32, allow_nan=False, allow_infinity=False),
)


# ---------------------------------------------------------------------------------------------
# Byte for byte
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("qtype", K_TYPES, ids=lambda t: t.name)
@given(x=family_rows())
def test_quantize_equals_ggml_ref_on_families(qtype, x):
    assert_bytes_equal(K_QUANTIZERS[qtype](x), ggml_quantize_row_ref(x, qtype), qtype)


@pytest.mark.parametrize("qtype", K_TYPES, ids=lambda t: t.name)
@given(x=any_finite_rows)
def test_quantize_equals_ggml_ref_on_any_finite_floats(qtype, x):
    assert_bytes_equal(K_QUANTIZERS[qtype](x), ggml_quantize_row_ref(x, qtype), qtype)


@pytest.mark.parametrize("qtype", K_TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("kind", KINDS)
def test_quantize_equals_ggml_quantize_chunk_on_each_family(qtype, kind):
    """Every family at three scales, through llama-quantize's own entry point."""
    x = np.stack([family_row(kind, 2 * QK_K, e, seed) for seed, e in enumerate((-30, 0, 30))])
    assert_bytes_equal(K_QUANTIZERS[qtype](x), ggml_quantize_chunk(x, qtype), qtype)


@pytest.mark.parametrize("qtype", K_TYPES, ids=lambda t: t.name)
@given(x=family_rows())
def test_round_trip_equals_ggml(qtype, x):
    """dequantize(ours) is bit-identical to ggml's dequantize_row_* of ggml's blocks."""
    with np.errstate(all="ignore"):  # huge rows give infinite scales, and inf * 0 = NaN
        ours = dequantize(K_QUANTIZERS[qtype](x), qtype)
        theirs = ggml_dequantize(ggml_quantize_row_ref(x, qtype), qtype)
    assert_floats_equal(ours, theirs)


# ---------------------------------------------------------------------------------------------
# The contract
# ---------------------------------------------------------------------------------------------


def test_k_quantizers_cover_the_k_types_with_ggml_block_sizes():
    assert list(K_QUANTIZERS) == K_TYPES
    x = np.zeros((2, 3, 2 * QK_K), dtype=np.float32)
    for qtype, quantize in K_QUANTIZERS.items():
        assert quantize(x).shape == (2, 3, 2 * GGML_QUANT_SIZES[qtype][1])
        assert quantize(x[0, 0, :QK_K]).shape == (GGML_QUANT_SIZES[qtype][1],)


@pytest.mark.parametrize("qtype", K_TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("dtype", [np.float16, np.float64])
def test_other_float_dtypes_are_quantized_as_float32(qtype, dtype):
    x = family_row("gaussian", QK_K, 0, 7).astype(dtype)[None]
    expected = ggml_quantize_row_ref(x.astype(np.float32), qtype)
    assert_bytes_equal(K_QUANTIZERS[qtype](x), expected, qtype)


@pytest.mark.parametrize("qtype", K_TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf], ids=["nan", "inf", "-inf"])
def test_non_finite_weights_are_refused(qtype, bad):
    x = np.ones((2, 2 * QK_K), dtype=np.float32)
    x[1, 300] = bad
    x[1, 400] = np.nan
    name = qtype.name
    message = (
        f"cannot quantize to {name}: weight (1, 300) is {np.float32(bad)}; only finite "
        f"weights can be quantized (ggml's quantize_row_{name[:2].lower()}_K_ref would write "
        f"an infinite scale or wrong quants)"
    )
    with pytest.raises(QuantError) as raised:
        K_QUANTIZERS[qtype](x)
    assert str(raised.value) == message


@pytest.mark.parametrize("qtype", K_TYPES, ids=lambda t: t.name)
def test_a_float64_beyond_float32_is_refused_as_infinite(qtype):
    x = np.zeros(QK_K)
    x[5] = 1e39
    with pytest.raises(QuantError, match=r"weight \(5,\) is inf;"):
        K_QUANTIZERS[qtype](x)


@pytest.mark.parametrize("qtype", K_TYPES, ids=lambda t: t.name)
def test_bad_shapes_and_dtypes_are_refused(qtype):
    name = qtype.name
    quantize = K_QUANTIZERS[qtype]
    with pytest.raises(QuantError) as raised:
        quantize(np.zeros((2, 300), dtype=np.float32))
    assert str(raised.value) == (
        f"rows of 300 weights are not a whole number of {name} super-blocks (256 weights each)"
    )
    with pytest.raises(QuantError) as raised:
        quantize(np.zeros(256, dtype=np.int32))
    assert str(raised.value) == (
        f"quantizing to {name} needs a float array with at least one dimension, "
        f"got int32 of shape (256,)"
    )
    with pytest.raises(QuantError, match="at least one dimension, got float32 of shape"):
        quantize(np.float32(1.0))


# ---------------------------------------------------------------------------------------------
# Why non-finite weights are refused: what ggml does with them
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("qtype", [T.Q2_K, T.Q4_K, T.Q5_K], ids=lambda t: t.name)
def test_ggml_turns_an_infinite_weight_into_a_block_its_validator_rejects(qtype):
    x = family_row("gaussian", QK_K, 0, 3)[None]
    x[0, 7] = np.inf
    assert not ggml_validate(ggml_quantize_row_ref(x, qtype), qtype)


@pytest.mark.parametrize("qtype", K_TYPES, ids=lambda t: t.name)
def test_ggml_turns_a_nan_weight_into_a_valid_but_wrong_block(qtype):
    """The NaN passes llama-quantize's validation and spoils its finite neighbours too."""
    x = family_row("gaussian", QK_K, 0, 3)[None]
    clean = ggml_dequantize(ggml_quantize_row_ref(x, qtype), qtype)
    x[0, 0] = np.nan
    with np.errstate(all="ignore"):
        raw = ggml_quantize_row_ref(x, qtype)
    assert ggml_validate(raw, qtype)
    spoiled = ggml_dequantize(raw, qtype)[0, 1:]
    error, clean_error = np.abs(spoiled - x[0, 1:]).max(), np.abs(clean[0, 1:] - x[0, 1:]).max()
    assert error > 2 * clean_error


# ---- Q5_0 and Q5_1: llama-quantize's fallbacks for Q4_K / Q5_K rows of no whole super-block ----

@pytest.mark.parametrize("qtype", [T.Q5_0, T.Q5_1], ids=lambda t: t.name)
@pytest.mark.parametrize("kind", KINDS)
def test_q5_quantizers_are_ggmls(qtype, kind):
    """``quantize_row_q5_0_ref`` / ``quantize_row_q5_1_ref`` byte for byte against ggml's C,
    and against ``gguf.quants`` but for the sign of a zero scale or minimum: ggml keeps the
    first of equal zeros (and starts Q5_0's search from +0), NumPy's min/max may not."""
    import gguf.quants as gq

    from reference.quants import quantize

    x = np.stack([family_row(kind, 256, e, seed) for seed, e in enumerate((0, -3, 3))])
    ours = quantize(x, qtype)
    assert_bytes_equal(ours, ggml_quantize_chunk(x, qtype), qtype)
    with np.errstate(all="ignore"):
        theirs = gq.quantize(x, qtype)
    if kind != "zero":
        assert ours.tobytes() == theirs.tobytes()
