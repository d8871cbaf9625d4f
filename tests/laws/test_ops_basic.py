"""mul_mat, get_rows/set_rows, add/mul/scale and the activations (silu, gelu, swiglu, geglu).

The two broadcasting rules of ggml are pinned with small explicit examples: ``mul_mat``
broadcasts ``a`` by blocks (``np.repeat``), ``add``/``mul`` tile ``b`` (``np.tile``).
"""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from reference.ops import add, geglu, gelu, get_rows, mul, mul_mat, scale, set_rows, silu, swiglu
from reference.ops import matmul as R_matmul
from reference.ops.errors import OpError, OpIndexError, OpShapeError, OpTypeError
from tests.support.ggml_cpu import ggml_cpu

finite = st.floats(-10, 10, allow_nan=False, width=64)


# ----------------------------------------------------------------------------- mul_mat


def test_mul_mat_is_b_times_a_transposed():
    a = np.arange(6.0).reshape(3, 2)  # (M=3, K=2): three rows of K
    b = np.array([[1.0, 10.0], [2.0, 20.0]])  # (N=2, K=2)
    expected = np.array([[a_row @ b_row for a_row in a] for b_row in b])  # (N, M)
    np.testing.assert_array_equal(mul_mat(a, b), expected)
    assert mul_mat(a, b).shape == (2, 3)


def test_mul_mat_broadcasts_a_by_blocks_not_tiles():
    a = np.array([10.0, 20.0]).reshape(2, 1, 1)  # two matrices of a
    b = np.ones((6, 1, 1))  # six matrices of b: r2 = 3
    out = mul_mat(a, b)[:, 0, 0]
    np.testing.assert_array_equal(out, [10, 10, 10, 20, 20, 20])  # i02 = i12 // r2
    assert not np.array_equal(out, [10, 20, 10, 20, 10, 20])  # not numpy-style tiling


def test_mul_mat_broadcasts_dim_3_by_blocks_too():
    a = np.array([1.0, 2.0]).reshape(2, 1, 1, 1)  # (ne3=2, ne2=1, M=1, K=1)
    b = np.ones((4, 3, 1, 1))  # (ne3=4, ne2=3, N=1, K=1)
    out = mul_mat(a, b)[:, :, 0, 0]  # (4, 3)
    np.testing.assert_array_equal(out, [[1] * 3, [1] * 3, [2] * 3, [2] * 3])


def test_mul_mat_missing_leading_dims_count_as_one():
    w = np.arange(6.0).reshape(3, 2)  # one weight for every matrix of b
    x = np.arange(24.0).reshape(2, 2, 3, 2)
    np.testing.assert_array_equal(mul_mat(w, x), x @ w.T)


@given(
    st.integers(1, 3), st.integers(1, 3), st.integers(1, 3), st.integers(1, 4),
    st.integers(1, 4), st.integers(1, 5), st.integers(0, 2**31 - 1),
)
def test_mul_mat_block_broadcast_law(n_a, r2, r3, m, n, k, seed):
    """mul_mat(a, b)[i3, i2] == b[i3, i2] @ a[i3 // r3, i2 // r2].T for every matrix."""
    rng = np.random.default_rng(seed)
    a = rng.standard_normal((1, n_a, m, k))
    b = rng.standard_normal((r3, n_a * r2, n, k))
    out = mul_mat(a, b)
    assert out.shape == (r3, n_a * r2, n, m)
    for i3 in range(r3):
        for i2 in range(n_a * r2):
            np.testing.assert_allclose(out[i3, i2], b[i3, i2] @ a[0, i2 // r2].T, rtol=1e-12)


@pytest.mark.parametrize(
    "a_shape, b_shape",
    [
        ((3, 2), (4, 3)),  # K differs
        ((2, 3, 4), (3, 3, 4)),  # 3 is not a multiple of 2
        ((4, 3, 4), (2, 3, 4)),  # b has fewer matrices than a
        ((4,), (2, 4)),  # a is not a matrix
        ((0, 3, 4), (2, 3, 4)),  # a has no matrices, b has some
    ],
)
def test_mul_mat_rejects_bad_shapes(a_shape, b_shape):
    with pytest.raises(OpShapeError, match="mul_mat"):
        mul_mat(np.zeros(a_shape), np.zeros(b_shape))


def test_op_errors_are_the_builtin_kinds():
    assert issubclass(OpShapeError, ValueError) and issubclass(OpShapeError, OpError)
    assert issubclass(OpIndexError, IndexError) and issubclass(OpTypeError, TypeError)


# ----------------------------------------------------------------------------- get_rows / set_rows


def test_get_rows_gathers_in_order_with_repeats():
    a = np.arange(12.0).reshape(4, 3)
    np.testing.assert_array_equal(get_rows(a, np.array([2, 2, 0])), a[[2, 2, 0]])


def test_get_rows_leading_dims_match_exactly():
    a = np.arange(24.0).reshape(2, 4, 3)  # (ne2=2, n_rows=4, n_cols=3)
    rows = np.array([[0, 3], [1, 1]])  # (ne2=2, n=2)
    out = get_rows(a, rows)
    np.testing.assert_array_equal(out, np.stack([a[0, [0, 3]], a[1, [1, 1]]]))
    with pytest.raises(OpShapeError):
        get_rows(a, np.array([0, 1]))  # rows must have a's leading dims


def test_get_rows_of_float16_returns_float32_like_ggml():
    a = np.array([[1.5, 2.0]], dtype=np.float16)
    out = get_rows(a, np.array([0]))
    assert out.dtype == np.float32
    assert get_rows(a.astype(np.float64), np.array([0])).dtype == np.float64


@pytest.mark.parametrize("bad", [[4], [-1], [0, 7]])
def test_get_rows_rejects_out_of_range_rows(bad):
    with pytest.raises(OpIndexError, match=r"out of range \[0, 4\)"):
        get_rows(np.zeros((4, 2)), np.array(bad))


def test_get_rows_rejects_float_rows():
    with pytest.raises(OpTypeError):
        get_rows(np.zeros((4, 2)), np.array([1.0]))


def test_set_rows_writes_in_place_and_converts_dtype():
    dst = np.zeros((5, 2), dtype=np.float16)
    src = np.array([[1.0001, 2.0], [3.0, 65519.0]], dtype=np.float32)  # 65519 rounds to 65504
    out = set_rows(dst, src, np.array([4, 1]))
    assert out is dst
    np.testing.assert_array_equal(dst[[4, 1]], src.astype(np.float16))
    np.testing.assert_array_equal(dst[[0, 2, 3]], 0)


def test_set_rows_validates_before_writing():
    dst = np.zeros((3, 2))
    for rows, err in [([0, 3], OpIndexError), ([1, 1], OpIndexError), ([0.0, 1.0], OpTypeError)]:
        with pytest.raises(err):
            set_rows(dst, np.ones((2, 2)), np.array(rows))
        np.testing.assert_array_equal(dst, 0)  # nothing was written, not even row 0
    with pytest.raises(OpShapeError):
        set_rows(dst, np.ones((2, 3)), np.array([0, 1]))  # n_cols differ
    with pytest.raises(OpShapeError):
        set_rows(dst, np.ones((2, 2)), np.array([0, 1, 2]))  # n differs


def test_set_rows_tiles_rows_over_leading_dims():
    dst = np.zeros((4, 3, 1))  # (ne2=4, n_rows=3, n_cols=1)
    src = np.arange(8.0).reshape(4, 2, 1)  # (ne2=4, n=2, 1)
    rows = np.array([[0, 1], [2, 0]])  # (ne11=2, n=2): used for ne2 = 0, 1, 0, 1 (modulo)
    set_rows(dst, src, rows)
    for i2 in range(4):
        np.testing.assert_array_equal(dst[i2, rows[i2 % 2], 0], src[i2, :, 0])


@given(st.data(), st.integers(1, 8), st.integers(1, 4))
def test_get_rows_after_set_rows_reads_back(data, n_rows, n_cols):
    n = data.draw(st.integers(0, n_rows))
    rows = np.array(data.draw(st.permutations(range(n_rows)))[:n], dtype=np.int64)
    src = data.draw(hnp.arrays(np.float64, (len(rows), n_cols), elements=finite))
    dst = np.full((n_rows, n_cols), np.nan)
    set_rows(dst, src, rows)
    np.testing.assert_array_equal(get_rows(dst, rows.astype(np.int32)), src)
    assert np.isnan(np.delete(dst, rows, axis=0)).all()  # other rows untouched


# ----------------------------------------------------------------------------- add / mul / scale


def test_add_tiles_b_unlike_mul_mat():
    a = np.zeros((1, 6))
    b = np.array([1.0, 2.0, 3.0])
    np.testing.assert_array_equal(add(a, b), [[1, 2, 3, 1, 2, 3]])  # i0 % 3, i.e. np.tile


def test_mul_tiles_b_along_every_dim():
    a = np.ones((4, 4))
    b = np.array([[1.0, 2.0], [3.0, 4.0]])
    expected = [[1, 2, 1, 2], [3, 4, 3, 4], [1, 2, 1, 2], [3, 4, 3, 4]]
    np.testing.assert_array_equal(mul(a, b), expected)


@given(st.data())
def test_add_mul_repeat_law(data):
    """add(a, b)[i] == a[i] + b[i mod b.shape] for every index i."""
    b_shape = data.draw(st.lists(st.integers(1, 3), min_size=1, max_size=3))
    reps = data.draw(st.lists(st.integers(1, 3), min_size=len(b_shape), max_size=len(b_shape)))
    extra = data.draw(st.lists(st.integers(1, 2), max_size=1))
    a_shape = tuple(extra) + tuple(n * r for n, r in zip(b_shape, reps, strict=True))
    a = data.draw(hnp.arrays(np.float64, a_shape, elements=finite))
    b = data.draw(hnp.arrays(np.float64, tuple(b_shape), elements=finite))
    s, p = add(a, b), mul(a, b)
    for idx in np.ndindex(*a_shape):
        bi = tuple(i % n for i, n in zip(idx[len(extra):], b_shape, strict=True))
        assert s[idx] == a[idx] + b[bi]
        assert p[idx] == a[idx] * b[bi]


def test_add_agrees_with_numpy_where_numpy_broadcasts():
    rng = np.random.default_rng(0)
    x = rng.standard_normal((3, 5, 4)).astype(np.float32)
    w = rng.standard_normal((4,)).astype(np.float32)
    np.testing.assert_array_equal(add(x, w), x + w)
    np.testing.assert_array_equal(mul(x, w[None, None, :]), x * w)


@pytest.mark.parametrize("b_shape", [(4,), (3, 2), (1, 2, 3)])
def test_add_mul_reject_unrepeatable_b(b_shape):
    a = np.zeros((2, 3))
    with pytest.raises(OpShapeError, match="repeat"):
        add(a, np.zeros(b_shape))
    with pytest.raises(OpShapeError):
        mul(a, np.zeros(b_shape))


def test_result_has_a_dtype():
    a = np.ones(4, dtype=np.float32)
    assert add(a, np.ones(2, dtype=np.float16)).dtype == np.float32
    assert mul(a, np.ones(1, dtype=np.float64)).dtype == np.float32
    assert scale(a, 1 / 3).dtype == np.float32
    np.testing.assert_array_equal(scale(np.arange(3.0), -2.0), [0.0, -2.0, -4.0])


# ----------------------------------------------------------------------------- activations


def _gelu_formula(x: float) -> float:
    return 0.5 * x * (1.0 + math.tanh(math.sqrt(2.0 / math.pi) * x * (1.0 + 0.044715 * x * x)))


def test_gelu_matches_the_tanh_formula():
    xs = np.linspace(-12, 12, 2001)
    expected = np.array([_gelu_formula(x) for x in xs])
    # For x << 0, 1 + tanh(u) cancels: any evaluation of this formula has an absolute error
    # of up to |x|/2 * eps there (the rounding of tanh), whatever its relative error.
    for dtype, rtol in [(np.float64, 1e-14), (np.float32, 2e-6)]:
        atol = 0.5 * np.abs(xs).max() * np.finfo(dtype).eps
        np.testing.assert_allclose(gelu(xs.astype(dtype)), expected, rtol=rtol, atol=atol)
    assert gelu(xs.astype(np.float32)).dtype == np.float32


def test_gelu_fp16_table_divergence_is_float16_sized():
    """ggml's CPU gelu (GGML_GELU_FP16) looks the value up in a float16 table; the spec does not.

    Emulating the table (round x to f16, GELU, round to f16; identity/zero beyond +-10) the
    difference is float16 rounding (ulp 2^-10 ~ 1e-3, amplified where x gelu'(x)/gelu(x) is
    large): a few 1e-3 relative where |gelu| > 0.01.
    """
    xs = np.linspace(-9.99, 9.99, 4001).astype(np.float32)
    x16 = xs.astype(np.float16).astype(np.float64)
    table = gelu(x16).astype(np.float16).astype(np.float32)
    spec = gelu(xs)
    big = np.abs(spec) > 1e-2
    rel = np.abs(table[big] - spec[big]) / np.abs(spec[big])
    assert 1e-4 < rel.max() < 5e-3  # measured 2.6e-3: it is there, and it is float16-sized


def test_silu_matches_the_formula_and_saturates_quietly():
    xs = np.linspace(-30, 30, 601)
    np.testing.assert_allclose(silu(xs), xs / (1 + np.exp(-xs)), rtol=1e-15)
    with np.errstate(over="raise", invalid="raise"):  # exp(-x) overflowing is not an error
        out = silu(np.array([-1000.0, 1000.0], dtype=np.float32))
    np.testing.assert_array_equal(out, [-0.0, 1000.0])


@given(hnp.arrays(np.float64, st.integers(1, 16), elements=finite),
       hnp.arrays(np.float64, st.integers(1, 16), elements=finite))
def test_glu_split_forms(a, b):
    n = min(a.size, b.size)
    a, b = a[:n], b[:n]
    np.testing.assert_array_equal(swiglu(a, b), silu(a) * b)
    np.testing.assert_array_equal(geglu(a, b), gelu(a) * b)


def test_glu_reject_different_shapes():
    with pytest.raises(OpShapeError, match="swiglu"):
        swiglu(np.zeros(3), np.zeros(4))
    with pytest.raises(OpShapeError, match="geglu"):
        geglu(np.zeros((2, 3)), np.zeros((3, 2)))


@pytest.mark.oracle
def test_activations_match_torch():
    torch = pytest.importorskip("torch")
    f = torch.nn.functional
    xs = np.linspace(-12, 12, 1001)
    t = torch.from_numpy(xs)
    np.testing.assert_allclose(silu(xs), f.silu(t).numpy(), rtol=1e-14, atol=1e-300)
    # atol: the cancellation of 1 + tanh(u) for x << 0 (see test_gelu_matches_the_tanh_formula)
    np.testing.assert_allclose(gelu(xs), f.gelu(t, approximate="tanh").numpy(), rtol=1e-14,
                               atol=2e-15)


def _f32(rng: np.random.Generator, *shape: int) -> np.ndarray:
    return rng.standard_normal(shape).astype(np.float32)


@pytest.mark.oracle
def test_mul_mat_matches_ggml_including_block_broadcast():
    ggml, rng = ggml_cpu(), np.random.default_rng(10)
    a, b = _f32(rng, 2, 5, 32), _f32(rng, 3, 6, 4, 32)  # a broadcast over 3 x (2 -> 6)
    out = ggml("mul_mat", a, b)
    assert out.shape == (3, 6, 4, 5)
    np.testing.assert_allclose(out, mul_mat(a, b), rtol=1e-5, atol=1e-5)


@pytest.mark.oracle
def test_add_mul_scale_get_rows_match_ggml_exactly():
    ggml, rng = ggml_cpu(), np.random.default_rng(11)
    a, b = _f32(rng, 4, 6, 9), _f32(rng, 2, 3, 9)  # b tiled into a
    np.testing.assert_array_equal(ggml("add", a, b), add(a, b))
    np.testing.assert_array_equal(ggml("mul", a, b), mul(a, b))
    np.testing.assert_array_equal(ggml("scale", a, params=(0.37,)), scale(a, 0.37))
    rows = np.array([6, 0, 3, 3], dtype=np.int32)
    embd = _f32(rng, 7, 5)
    np.testing.assert_array_equal(ggml("get_rows", embd, rows), get_rows(embd, rows))
    np.testing.assert_array_equal(ggml("get_rows", embd.astype(np.float16), rows),
                                  get_rows(embd.astype(np.float16), rows))


@pytest.mark.oracle
def test_silu_matches_ggml_and_gelu_shows_the_fp16_table():
    ggml = ggml_cpu()
    x = np.linspace(-12, 12, 10001, dtype=np.float32)
    np.testing.assert_allclose(ggml("silu", x), silu(x), rtol=1e-6, atol=1e-6)
    ours, theirs = gelu(x), ggml("gelu", x)
    big = np.abs(ours) > 1e-2
    rel = np.abs(theirs[big] - ours[big]) / np.abs(ours[big])
    assert 1e-4 < rel.max() < 5e-3  # measured 2.8e-3: the float16 table (docs/ops/activations)
    x16 = x.astype(np.float16)  # ggml's table, emulated: exact where x is a float16 in (-10, 10)
    inside = (np.abs(x) < 10) & (x16.astype(np.float32) == x)
    table = gelu(x16.astype(np.float64)).astype(np.float16).astype(np.float32)
    np.testing.assert_array_equal(theirs[inside], table[inside])


# ----------------------------------------------------------------------------- mul_mat, few rows


@pytest.mark.parametrize("n_rows", [1, 5, 63])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_a_tall_weight_in_blocks_is_the_product_in_one_piece(monkeypatch, n_rows, dtype):
    """``mul_mat``'s fast path for few rows, $(a b^T)^T$ ``TALL_BLOCK`` rows of ``a`` at a
    time, is the product in one piece."""
    rng = np.random.default_rng(n_rows)
    a = rng.standard_normal((1000, 24)).astype(dtype)  # 1000 rows: blocks of 128, last short
    b = rng.standard_normal((n_rows, 24)).astype(dtype)
    monkeypatch.setattr(R_matmul, "TALL_BLOCK", 128)
    out = R_matmul.mul_mat(a, b)
    assert out.shape == (n_rows, 1000) and out.dtype == dtype and out.flags.c_contiguous
    tol = 1e-12 if dtype == np.float64 else 1e-5
    np.testing.assert_allclose(out, b @ a.T, rtol=tol, atol=tol)
