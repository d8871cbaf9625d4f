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

from reference.ops import (
    add,
    geglu,
    gelu,
    get_rows,
    get_rows_back,
    mul,
    mul_mat,
    scale,
    set_rows,
    silu,
    swiglu,
)
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


def test_mul_mat_2d_weight_serves_every_matrix_of_a_3d_b():
    w = np.arange(12.0).reshape(3, 4)
    x = np.arange(24.0).reshape(2, 3, 4)  # two sequences of three rows
    out = mul_mat(w, x)
    assert out.shape == (2, 3, 3)
    np.testing.assert_array_equal(out, x @ w.T)


def test_mul_mat_single_3d_matrix_against_a_2d_b():
    """ggml pads both to 4 dims; the result has as many dims as the larger operand."""
    a = np.arange(6.0).reshape(1, 3, 2)  # one matrix, ne2 = 1
    b = np.array([[1.0, 10.0], [2.0, 20.0]])
    out = mul_mat(a, b)
    assert out.shape == (1, 2, 3)
    np.testing.assert_array_equal(out[0], b @ a[0].T)


@pytest.mark.parametrize("n", [1, R_matmul.FEW_ROWS - 1, R_matmul.FEW_ROWS, 100])
def test_mul_mat_2d_is_every_dot_product_below_and_beyond_few_rows(n):
    """Small integers: every dot product is exact, whatever the summation order."""
    rng = np.random.default_rng(n)
    a = rng.integers(-4, 5, (7, 5)).astype(np.float64)
    b = rng.integers(-4, 5, (n, 5)).astype(np.float64)
    out = mul_mat(a, b)
    expected = np.array([[sum(a[m, k] * b[i, k] for k in range(5)) for m in range(7)]
                         for i in range(n)])
    assert out.shape == (n, 7)
    np.testing.assert_array_equal(out, expected)


@pytest.mark.parametrize("a_dtype, b_dtype",
                         [(np.float16, np.float32), (np.float64, np.float32),
                          (np.float32, np.float64)])
@pytest.mark.parametrize("n", [2, R_matmul.FEW_ROWS + 1])
def test_mul_mat_result_dtype_is_numpy_promotion_of_both(a_dtype, b_dtype, n):
    a, b = np.ones((3, 4), dtype=a_dtype), np.ones((n, 4), dtype=b_dtype)
    out = mul_mat(a, b)
    assert out.dtype == np.result_type(a_dtype, b_dtype)
    np.testing.assert_array_equal(out, 4)


def test_mul_mat_empty_batches():
    """A leading dim of b is a multiple of a's: 0 is a multiple of any, only 0 of 0."""
    assert mul_mat(np.zeros((0, 3, 4)), np.zeros((0, 2, 4))).shape == (0, 2, 3)
    assert mul_mat(np.zeros((2, 3, 4)), np.zeros((0, 2, 4))).shape == (0, 2, 3)
    with pytest.raises(OpShapeError, match="multiple"):
        mul_mat(np.zeros((0, 3, 4)), np.zeros((1, 2, 4)))


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


def test_get_rows_keeps_the_dtype_of_integer_tables():
    """Only a floating ``a`` narrower than float32 is widened (ggml's I32 get_rows stays I32)."""
    for dtype in (np.int8, np.int16, np.int32, np.int64):
        out = get_rows(np.arange(6, dtype=dtype).reshape(3, 2), np.array([2, 0]))
        assert out.dtype == dtype
        np.testing.assert_array_equal(out, [[4, 5], [0, 1]])


def test_get_rows_needs_a_matrix_and_matching_leading_dims():
    with pytest.raises(OpShapeError, match=r"^get_rows: need a \(\.\.\., n_rows, n_cols\)"):
        get_rows(np.zeros(4), np.array([0]))
    with pytest.raises(OpShapeError, match=r"a\.shape=\(2, 4, 3\), rows\.shape=\(2,\)$"):
        get_rows(np.zeros((2, 4, 3)), np.array([0, 1]))


def test_row_errors_name_the_op_the_range_and_the_culprits():
    with pytest.raises(OpIndexError,
                       match=r"^get_rows: row index out of range \[0, 4\): min=-1, max=4$"):
        get_rows(np.zeros((4, 2)), np.array([4, -1]))
    with pytest.raises(OpIndexError,
                       match=r"^set_rows: row index out of range \[0, 3\): min=0, max=3$"):
        set_rows(np.zeros((3, 2)), np.ones((2, 2)), np.array([0, 3]))
    with pytest.raises(OpTypeError,
                       match=r"^get_rows: rows must be integers \(ggml I32/I64\), got float64$"):
        get_rows(np.zeros((4, 2)), np.array([1.0]))
    with pytest.raises(OpTypeError, match=r"^set_rows: rows must be integers"):
        set_rows(np.zeros((3, 2)), np.ones((1, 2)), np.array([1.0]))
    with pytest.raises(OpIndexError, match=r"^set_rows: a target row repeats: rows\[\]=\[1 1\]$"):
        set_rows(np.zeros((3, 2)), np.ones((2, 2)), np.array([1, 1]))


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


def test_set_rows_one_set_of_rows_serves_every_leading_index():
    dst = np.zeros((3, 4, 2))  # (ne2=3, n_rows=4, n_cols=2)
    src = np.arange(1.0, 13.0).reshape(3, 2, 2)  # (ne2=3, n=2, 2)
    set_rows(dst, src, np.array([3, 1]))  # rows (n,): ne11 = 1, the same rows for every i2
    for i2 in range(3):
        np.testing.assert_array_equal(dst[i2, [3, 1]], src[i2])
        np.testing.assert_array_equal(dst[i2, [0, 2]], 0)


def test_set_rows_4d_tiles_rows_modulo_both_leading_dims():
    dst = np.zeros((4, 3, 5, 1))  # (ne3=4, ne2=3, n_rows=5, n_cols=1)
    src = np.arange(1.0, 25.0).reshape(4, 3, 2, 1)  # (ne3=4, ne2=3, n=2, 1)
    rows = np.array([[[0, 1], [2, 3], [4, 0]], [[1, 2], [3, 4], [0, 2]]])  # (ne12=2, ne11=3, 2)
    set_rows(dst, src, rows)
    for i3, i2 in np.ndindex(4, 3):
        r = rows[i3 % 2, i2 % 3]  # i12 = i03 % ne12, i11 = i02 % ne11
        np.testing.assert_array_equal(dst[i3, i2, r, 0], src[i3, i2, :, 0])
        np.testing.assert_array_equal(np.delete(dst[i3, i2, :, 0], r), 0)


@pytest.mark.parametrize(
    "dst_shape, src_shape, rows_shape",
    [
        ((3, 2), (2, 3), (2,)),  # n_cols differ
        ((3, 2), (2, 2), (3,)),  # n differs
        ((3, 2), (2, 2), ()),  # rows is a scalar
        ((3, 2), (2, 2), (1, 2)),  # rows has more leading dims than src has
        ((4, 3, 2), (4, 2, 2), (3, 2)),  # 3 sets of rows do not tile 4 matrices
        ((4, 3, 2), (4, 2, 2), (0, 2)),  # no set of rows at all
        ((2, 3, 2), (4, 2, 2), (2,)),  # src has other leading dims than dst
    ],
)
def test_set_rows_rejects_shapes_that_do_not_fit(dst_shape, src_shape, rows_shape):
    dst = np.zeros(dst_shape)
    with pytest.raises(OpShapeError, match=r"^set_rows: need dst \(\.\.\., n_rows, n_cols\)"):
        set_rows(dst, np.ones(src_shape), np.zeros(rows_shape, dtype=np.int64))
    assert not dst.any()


@given(st.data(), st.integers(1, 8), st.integers(1, 4))
def test_get_rows_after_set_rows_reads_back(data, n_rows, n_cols):
    n = data.draw(st.integers(0, n_rows))
    rows = np.array(data.draw(st.permutations(range(n_rows)))[:n], dtype=np.int64)
    src = data.draw(hnp.arrays(np.float64, (len(rows), n_cols), elements=finite))
    dst = np.full((n_rows, n_cols), np.nan)
    set_rows(dst, src, rows)
    np.testing.assert_array_equal(get_rows(dst, rows.astype(np.int32)), src)
    assert np.isnan(np.delete(dst, rows, axis=0)).all()  # other rows untouched


@given(st.data(), st.integers(1, 6), st.integers(1, 3))
def test_get_rows_back_adds_each_gradient_row_into_its_source_row(data, n_rows, n_cols):
    rows = np.array(data.draw(st.lists(st.integers(0, n_rows - 1), max_size=8)), dtype=np.int64)
    grad = data.draw(hnp.arrays(np.float32, (len(rows), n_cols),
                                elements=st.floats(-10, 10, width=32)))
    out = get_rows_back(grad, rows, n_rows)
    expected = np.zeros((n_rows, n_cols), dtype=np.float32)
    for i, r in enumerate(rows):
        expected[r] += grad[i]
    assert out.dtype == np.float32
    np.testing.assert_array_equal(out, expected)


def test_get_rows_back_of_no_rows_is_zero():
    out = get_rows_back(np.zeros((0, 3), dtype=np.float32), np.array([], dtype=np.int32), 4)
    assert out.dtype == np.float32
    np.testing.assert_array_equal(out, np.zeros((4, 3)))


def test_get_rows_back_rejects_what_get_rows_cannot_have_produced():
    g = np.ones((2, 3))
    for grad, rows in [(np.ones(3), [0, 1, 2]), (np.ones((2, 3, 1)), [0, 1]), (g, [0])]:
        with pytest.raises(OpShapeError, match=r"^get_rows_back: need grad \(n, n_cols\)"):
            get_rows_back(grad, np.array(rows), 4)
    with pytest.raises(OpTypeError, match=r"^get_rows_back: rows must be integers, got float64$"):
        get_rows_back(g, np.array([0.0, 1.0]), 4)
    for bad in ([-1, 0], [0, 4]):
        with pytest.raises(OpIndexError,
                           match=rf"^get_rows_back: row index out of range \[0, 4\): \{bad}$"):
            get_rows_back(g, np.array(bad), 4)


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


@pytest.mark.parametrize("op, name", [(add, "add"), (mul, "mul")])
def test_add_mul_errors_name_the_op(op, name):
    with pytest.raises(OpShapeError, match=rf"^{name}: b cannot be repeated into a, it has more"):
        op(np.zeros((2, 3)), np.zeros((1, 2, 3)))
    with pytest.raises(OpShapeError, match=rf"^{name}: b cannot be repeated into a \(ggml_can"):
        op(np.zeros((2, 3)), np.zeros((4,)))


def test_add_mul_an_empty_b_repeats_only_into_an_empty_a():
    """Per dimension, a 0 of b repeats only into a 0 of a (0 = k * 0), with no division by 0."""
    a, b = np.zeros((0, 3)), np.zeros((0, 3))
    for op in (add, mul):
        assert op(a, b).shape == (0, 3)
        assert op(np.zeros((2, 0, 3)), b).shape == (2, 0, 3)
        with pytest.raises(OpShapeError, match="multiple"):
            op(np.zeros((1, 3)), b)


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


@pytest.mark.parametrize("op, name", [(swiglu, "swiglu"), (geglu, "geglu")])
def test_glu_errors_name_the_op_and_both_shapes(op, name):
    with pytest.raises(OpShapeError, match=rf"^{name}: a and b must have the same shape, "
                                           r"got \(2, 3\) and \(3, 2\)$"):
        op(np.zeros((2, 3)), np.zeros((3, 2)))


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
