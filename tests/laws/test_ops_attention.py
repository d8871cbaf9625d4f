"""soft_max_ext (mask, scale, ALiBi) and build_attn_mha (causality, GQA, the order of ops).

And build_attn_mha's fast path, ``attend_visible``:

- **Hidden cells add nothing**: ``attend_visible`` (each token's own cells, gathered) equals
  ``build_attn_mha`` over every cell, for any mask (rows fully hidden included), GQA, ALiBi and
  a soft-cap: to float64 rounding in float64, and in float32 no further from the float64 result
  than the full product is (the twin's is held to the reference's in ``tests/twin/test_ops.py``).
- **The switch is only a speed choice**: ``build_attn_mha`` takes the gathered form exactly
  when every token sees at most ``1 / FEW_CELLS`` of the cells (``sees_few_cells``), and its
  output is the full product's either way. Many tokens go in blocks whose gathered K and V are
  no larger than the cells in view.
"""

from __future__ import annotations

import re

import numpy as np
import pytest
from hypothesis import example, given
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from reference.ops import attention as R_attention
from reference.ops import build_attn_mha, soft_max_ext
from reference.ops.attention import alibi_slopes
from reference.ops.errors import OpShapeError, OpValueError

logits = st.floats(-30, 30, allow_nan=False, width=64)


@st.composite
def kq_and_mask(draw, min_visible: int = 1):
    """kq (n_head, n_tokens, n_kv) and a random 0/-inf mask with min_visible keys per row."""
    n_head, n_tokens, n_kv = (draw(st.integers(1, 4)), draw(st.integers(1, 5)),
                              draw(st.integers(1, 8)))
    kq = draw(hnp.arrays(np.float64, (n_head, n_tokens, n_kv), elements=logits))
    visible = draw(hnp.arrays(np.bool_, (n_tokens, n_kv)))
    if min_visible:
        visible[np.arange(n_tokens), draw(st.integers(0, n_kv - 1))] = True
    return kq, np.where(visible, 0.0, -np.inf)


def causal_mask(n_tokens: int, n_kv: int) -> np.ndarray:
    """Token t (at position n_kv - n_tokens + t) sees keys 0 .. n_kv - n_tokens + t."""
    pos_q = np.arange(n_kv - n_tokens, n_kv)[:, None]
    return np.where(np.arange(n_kv)[None, :] <= pos_q, 0.0, -np.inf)  # (n_tokens, n_kv)


# ----------------------------------------------------------------------------- soft_max_ext


@given(kq_and_mask(), st.floats(0.01, 4.0))
def test_softmax_rows_sum_to_one(kq_mask, scale):
    kq, mask = kq_mask
    p = soft_max_ext(kq, mask, scale)
    assert p.shape == kq.shape and np.all(p >= 0)
    np.testing.assert_allclose(p.sum(axis=-1), 1.0, rtol=1e-12)


@given(kq_and_mask(), st.data())
def test_softmax_is_shift_invariant(kq_mask, data):
    kq, mask = kq_mask
    shift = data.draw(hnp.arrays(np.float64, kq.shape[:-1] + (1,), elements=logits))
    np.testing.assert_allclose(soft_max_ext(kq + shift, mask), soft_max_ext(kq, mask),
                               rtol=1e-10, atol=1e-14)


@given(kq_and_mask())
def test_masked_positions_get_exactly_zero(kq_mask):
    kq, mask = kq_mask
    for dtype in (np.float64, np.float32):
        p = soft_max_ext(kq.astype(dtype), mask.astype(dtype))
        assert np.all(p[:, np.isinf(mask)] == 0.0)


@given(kq_and_mask(), st.floats(0.01, 4.0))
def test_scale_multiplies_before_the_mask(kq_mask, scale):
    kq, mask = kq_mask
    np.testing.assert_allclose(soft_max_ext(kq, mask, scale), soft_max_ext(scale * kq, mask),
                               rtol=1e-12, atol=1e-300)


def _soft_max_written_out(x, full_mask, scale, max_bias):
    """ggml's softmax with nothing shared or in place: a mask of x's own shape, new arrays."""
    n_head = x.shape[-3]
    slope = alibi_slopes(n_head, max_bias).astype(x.dtype).reshape(n_head, 1, 1)
    w = x * x.dtype.type(scale) + slope * full_mask.astype(x.dtype)
    row_max = np.max(w, axis=-1, keepdims=True)
    e = np.exp(w - np.where(np.isfinite(row_max), row_max, x.dtype.type(0)))
    total = np.sum(e, axis=-1, dtype=np.float64, keepdims=True)
    with np.errstate(divide="ignore"):
        return e * np.where(total > 0, 1.0 / total, 0.0).astype(x.dtype)


@given(st.data(), st.sampled_from([np.float32, np.float64]), st.sampled_from([0.0, 8.0]))
def test_mask_over_the_leading_dims_is_read_as_ggml_reads_it(data, dtype, max_bias):
    """A mask with leading dims of 1, of x's own, or repeated (row i % dm, ggml's broadcast)
    gives, bit for bit, the softmax with that mask written out to x's shape."""
    n_stream, n_head = data.draw(st.integers(1, 3)), data.draw(st.sampled_from([1, 2, 4]))
    n_tokens, n_kv = data.draw(st.integers(1, 4)), data.draw(st.integers(1, 7))
    x = data.draw(hnp.arrays(dtype, (n_stream, n_head, n_tokens, n_kv), elements=logits))
    dm_stream = data.draw(st.sampled_from([1, n_stream]))
    dm_head = data.draw(st.sampled_from([d for d in (1, 2, n_head) if n_head % d == 0]))
    visible = data.draw(hnp.arrays(np.bool_, (dm_stream, dm_head, n_tokens + 1, n_kv)))
    mask = np.where(visible, 0.0, -np.inf).astype(dtype)  # one padding row, as llama.cpp's
    s, h = np.ix_(np.arange(n_stream) % dm_stream, np.arange(n_head) % dm_head)
    full = mask[s, h][:, :, :n_tokens]  # (n_stream, n_head, n_tokens, n_kv)
    got = soft_max_ext(x, mask, 0.125, max_bias)
    np.testing.assert_array_equal(got, _soft_max_written_out(x, full, 0.125, max_bias))
    assert got.dtype == dtype


def test_softmax_small_example_and_no_mask():
    x = np.log(np.array([[1.0, 2.0, 5.0]]))
    np.testing.assert_allclose(soft_max_ext(x), [[0.125, 0.25, 0.625]], rtol=1e-15)
    p = soft_max_ext(np.array([[1000.0, 1000.0]], dtype=np.float32))  # no overflow
    np.testing.assert_array_equal(p, [[0.5, 0.5]])


def test_fully_masked_row_is_zeros_not_nan():
    kq = np.zeros((2, 2, 3))
    mask = np.array([[0.0, -np.inf, -np.inf], [-np.inf, -np.inf, -np.inf]])
    with np.errstate(all="raise"):
        p = soft_max_ext(kq, mask)
    np.testing.assert_array_equal(p[:, 1], 0.0)
    np.testing.assert_array_equal(p[:, 0], [[1, 0, 0], [1, 0, 0]])


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_weights_are_probabilities_even_in_a_row_with_a_nan_score(dtype):
    """A NaN score (a NaN in ``q`` or ``k``) never turns the row's other weights into
    unnormalized exponentials: every weight that is not NaN lies in [0, 1]."""
    x = np.array([[[np.nan, 2.0, 3.0, 0.5], [1.0, np.nan, -1.0, 4.0]]], dtype=dtype)
    with np.errstate(invalid="ignore"):
        p = soft_max_ext(x, np.zeros((2, 4), dtype=dtype))
    assert np.isnan(p[0, 0, 0]) and np.isnan(p[0, 1, 1])
    finite = p[~np.isnan(p)]
    assert np.all((finite >= 0) & (finite <= 1))


def test_mask_padding_rows_are_ignored_and_mask_tiles_over_leading_dims():
    rng = np.random.default_rng(0)
    kq = rng.standard_normal((2, 3, 2, 4))  # (n_stream=2, n_head=3, n_tokens=2, n_kv=4)
    mask = causal_mask(2, 4)
    padded = np.vstack([mask, np.full((6, 4), -np.inf)])  # GGML_KQ_MASK_PAD-style rows
    p = soft_max_ext(kq, padded)
    np.testing.assert_array_equal(p, soft_max_ext(kq, mask))
    per_stream = np.stack([mask, np.zeros_like(mask)])[:, None]  # (2, 1, 2, 4)
    p2 = soft_max_ext(kq, per_stream)
    np.testing.assert_array_equal(p2[0], p[0])
    np.testing.assert_array_equal(p2[1], soft_max_ext(kq[1]))


def _alibi_formula(n_head: int, max_bias: float) -> np.ndarray:
    n_head_log2 = 2 ** int(np.floor(np.log2(n_head)))
    m0 = 2.0 ** (-max_bias / n_head_log2)
    m1 = 2.0 ** (-max_bias / 2.0 / n_head_log2)
    return np.array([m0 ** (h + 1) if h < n_head_log2 else m1 ** (2 * (h - n_head_log2) + 1)
                     for h in range(n_head)])


@pytest.mark.parametrize("n_head", [1, 3, 5, 6, 8, 12, 20])
@pytest.mark.parametrize("max_bias", [8.0, 1.5])
def test_alibi_slopes_match_the_formula(n_head, max_bias):
    np.testing.assert_allclose(alibi_slopes(n_head, max_bias), _alibi_formula(n_head, max_bias),
                               rtol=1e-6)  # float32 powf


@pytest.mark.parametrize("n_head", [1, 3, 8, 12])
@pytest.mark.parametrize("max_bias", [8.0, 1.0, 0.5, 0.0, -2.0])
def test_alibi_slopes_are_float32_and_one_unless_max_bias_is_positive(n_head, max_bias):
    """ggml computes the slopes in float32 (``powf``) only for ``max_bias > 0``; any other
    bias, negative included, gives slope 1 (a small positive bias does not)."""
    got = alibi_slopes(n_head, max_bias)
    assert got.dtype == np.float32 and got.shape == (n_head,)
    if max_bias > 0.0:
        np.testing.assert_allclose(got, _alibi_formula(n_head, max_bias), rtol=1e-6)
        assert (got < 1.0).all()
    else:
        np.testing.assert_array_equal(got, 1.0)


def _powf(x: float, y: float) -> np.float32:
    """C's ``powf``, as ggml calls it (through ctypes: NumPy may round differently)."""
    import ctypes
    import ctypes.util

    libm = ctypes.CDLL(ctypes.util.find_library("m"))
    libm.powf.argtypes, libm.powf.restype = [ctypes.c_float, ctypes.c_float], ctypes.c_float
    return np.float32(libm.powf(x, y))


@pytest.mark.parametrize("n_head, max_bias", [(12, 8.0), (24, 8.0), (40, 8.0), (7, 0.3)])
def test_alibi_slopes_are_cs_powf_bit_for_bit(n_head, max_bias):
    """``ggml_compute_forward_soft_max_f32``: ``m0 = powf(2, -max_bias/H)``,
    ``m1 = powf(2, -max_bias/2/H)``, slope ``powf(m0, h+1)`` or ``powf(m1, 2(h-H)+1)``, each a
    float32 ``powf``; a power taken in double and rounded once differs in the last bit for
    these heads (12 heads: head 9)."""
    big_h = 1 << int(np.floor(np.log2(n_head)))
    m0 = _powf(2.0, np.float32(-max_bias / big_h))
    m1 = _powf(2.0, np.float32(-(max_bias / 2.0) / big_h))
    expected = [_powf(m0, h + 1) if h < big_h else _powf(m1, 2 * (h - big_h) + 1)
                for h in range(n_head)]
    np.testing.assert_array_equal(alibi_slopes(n_head, max_bias), np.array(expected))


def test_alibi_slopes_need_a_head():
    with pytest.raises(OpShapeError, match="n_head must be at least 1, got 0"):
        alibi_slopes(0, 8.0)


def test_alibi_slopes_for_12_heads_explicitly():
    """n_head = 12: H = 8, m0 = 2^-1, m1 = 2^-1/2; heads 8.. take the odd powers of m1."""
    expected = [2.0 ** -(h + 1) for h in range(8)] + [2.0 ** -(k / 2) for k in (1, 3, 5, 7)]
    np.testing.assert_allclose(alibi_slopes(12, 8.0), expected, rtol=1e-6)
    np.testing.assert_array_equal(alibi_slopes(12, 0.0), 1.0)


def test_alibi_slope_multiplies_the_mask_per_head():
    rng = np.random.default_rng(3)
    kq = rng.standard_normal((6, 3, 5))  # (n_head=6, n_tokens=3, n_kv=5)
    pos = np.arange(5)
    distance = -np.abs(pos[2:, None] - pos[None, :]).astype(np.float64)  # (3, 5): tokens 2..4
    mask = np.where(np.isfinite(causal_mask(3, 5)), distance, -np.inf)  # ALiBi + causal
    slopes = _alibi_formula(6, 8.0)
    expected = np.stack([soft_max_ext(0.5 * kq[h] + slopes[h] * mask) for h in range(6)])
    np.testing.assert_allclose(soft_max_ext(kq, mask, 0.5, max_bias=8.0), expected, rtol=1e-6)


@pytest.mark.parametrize(
    "x_shape, mask_shape",
    [((2, 3, 4), (3, 5)), ((2, 3, 4), (2, 4)), ((2, 3, 4), (3, 3, 4)), ((2, 3, 4), (4,))],
)
def test_softmax_rejects_bad_masks(x_shape, mask_shape):
    with pytest.raises(OpShapeError, match="soft_max_ext"):
        soft_max_ext(np.zeros(x_shape), np.zeros(mask_shape))


def test_alibi_needs_a_mask():
    with pytest.raises(OpShapeError, match="ALiBi"):
        soft_max_ext(np.zeros((2, 3, 4)), None, max_bias=8.0)


@pytest.mark.parametrize("max_bias", [8.0, 1.0, 0.5])
def test_alibi_of_any_positive_bias_needs_a_mask(max_bias):
    with pytest.raises(OpShapeError, match=r"^soft_max_ext: ALiBi \(max_bias > 0\) needs a mask$"):
        soft_max_ext(np.zeros((2, 3, 4)), None, max_bias=max_bias)


def test_softmax_of_one_row_and_of_a_scalar():
    """A 1-D ``x`` is one row; a 0-D one has no row to normalize."""
    np.testing.assert_allclose(soft_max_ext(np.log(np.array([1.0, 3.0]))), [0.25, 0.75],
                               rtol=1e-15)
    with pytest.raises(OpShapeError, match="^soft_max_ext: x must have at least one dimension$"):
        soft_max_ext(np.array(1.0))


@pytest.mark.parametrize("x_shape, mask_shape", [((3, 4), (1, 3, 4)), ((2, 3, 4), (1, 1, 3, 4))])
def test_softmax_rejects_a_mask_with_more_dims_than_x(x_shape, mask_shape):
    with pytest.raises(OpShapeError, match=r"^soft_max_ext: mask must be \(\.\.\., n_rows"):
        soft_max_ext(np.zeros(x_shape), np.zeros(mask_shape))


def _alibi_mask(n_tokens: int, n_kv: int) -> np.ndarray:
    """Causal, with ggml's ALiBi distances -|i - j| where visible (token t at n_kv-n_tokens+t)."""
    pos_q = np.arange(n_kv - n_tokens, n_kv)[:, None]
    distance = -np.abs(pos_q - np.arange(n_kv)[None, :]).astype(np.float64)
    return np.where(np.isfinite(causal_mask(n_tokens, n_kv)), distance, -np.inf)


@pytest.mark.parametrize("max_bias", [0.0, 8.0, 0.5])
def test_a_2d_x_is_one_head(max_bias):
    """``(n_tokens, n_kv)`` is head 0 of 1: the same as ``(1, n_tokens, n_kv)``, ALiBi slope
    ``m_0`` included."""
    rng = np.random.default_rng(14)
    x, mask = rng.standard_normal((3, 6)), _alibi_mask(3, 6)
    got = soft_max_ext(x, mask, 0.7, max_bias)
    assert got.shape == (3, 6)
    np.testing.assert_array_equal(got, soft_max_ext(x[None], mask, 0.7, max_bias)[0])
    slope = 2.0 ** -max_bias if max_bias else 1.0
    np.testing.assert_allclose(got, soft_max_ext(0.7 * x + slope * mask), rtol=1e-6)


@pytest.mark.parametrize("max_bias", [1.0, 0.5, 0.25])
def test_alibi_of_a_small_bias_still_applies_its_slopes(max_bias):
    """Any ``max_bias > 0`` turns ALiBi on, one at most 1 too."""
    rng = np.random.default_rng(15)
    kq, mask = rng.standard_normal((6, 3, 5)), _alibi_mask(3, 5)
    slopes = _alibi_formula(6, max_bias)
    expected = np.stack([soft_max_ext(kq[h] + slopes[h] * mask) for h in range(6)])
    got = soft_max_ext(kq, mask, 1.0, max_bias)
    np.testing.assert_allclose(got, expected, rtol=1e-6)
    assert not np.allclose(got, soft_max_ext(kq, mask), rtol=1e-3)


@pytest.mark.parametrize("n_head, max_bias", [(6, 8.0), (4, 1.5), (12, 0.3)])
def test_float32_alibi_is_computed_in_float32(n_head, max_bias):
    """With ALiBi distances (not only 0 / -inf) the float32 softmax is the float32 formula bit
    for bit: ``slope * mask`` rounded to float32, then added to ``scale * x``."""
    rng = np.random.default_rng(16)
    x = (4 * rng.standard_normal((2, n_head, 5, 40))).astype(np.float32)
    mask = _alibi_mask(5, 40).astype(np.float32)
    got = soft_max_ext(x, mask, 0.125, max_bias)
    assert got.dtype == np.float32
    full = np.broadcast_to(mask, x.shape)
    np.testing.assert_array_equal(got, _soft_max_written_out(x, full, 0.125, max_bias))


def test_mask_padding_rows_are_ignored_for_3d_x_too():
    """Rows past ``n_tokens`` are never read, whatever ``n_kv`` and ``n_head`` are."""
    rng = np.random.default_rng(17)
    kq = rng.standard_normal((3, 2, 5))  # (n_head=3, n_tokens=2, n_kv=5)
    mask = causal_mask(2, 5)
    padded = np.vstack([mask, np.full((6, 5), -np.inf)])
    np.testing.assert_array_equal(soft_max_ext(kq, padded, 0.5), soft_max_ext(kq, mask, 0.5))


@pytest.mark.parametrize("mask_shape", [
    (2, 4, 128, 256),  # a mask of x's own shape
    (128, 256),  # one mask shared by every head and stream
    (2, 1, 128, 256),  # one per stream, shared by the heads
    (1, 4, 128, 256),  # one per head, shared by the streams
])
def test_softmax_makes_one_array_of_xs_size(mask_shape):
    """Without ALiBi, ``w = scale * x`` is the only array of ``x``'s size made: the mask is
    read as it is (broadcast, not copied per head) and every later step works in place."""
    import tracemalloc

    rng = np.random.default_rng(18)
    x = rng.standard_normal((2, 4, 128, 256)).astype(np.float32)  # 1 MiB
    mask = np.where(rng.random(mask_shape) < 0.5, -np.inf, 0.0).astype(np.float32)
    mask[..., 0] = 0.0
    tracemalloc.start()
    try:
        got = soft_max_ext(x, mask, 0.5)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    np.testing.assert_array_equal(got, _soft_max_written_out(
        x, np.broadcast_to(mask, x.shape), 0.5, 0.0))
    assert peak < x.nbytes * 5 // 4  # measured: x.nbytes + ~70 KB (the float64 sum's buffer)


@given(st.data())
def test_tile_reps_repeat_the_mask_over_x_as_ggml_reads_it(data):
    """``np.tile(mask, tile_reps(mask, x))`` has ``x``'s shape and holds mask row ``i % dm`` at
    ``x``'s index ``i`` of every leading dimension (rows and columns once)."""
    ndim_x = data.draw(st.integers(2, 4))
    x_shape = tuple(data.draw(st.lists(st.integers(1, 6), min_size=ndim_x, max_size=ndim_x)))
    ndim_m = data.draw(st.integers(2, ndim_x))
    lead = [data.draw(st.sampled_from([d for d in range(1, dx + 1) if dx % d == 0]))
            for dx in x_shape[ndim_x - ndim_m:-2]]
    mask_shape = tuple(lead) + x_shape[-2:]
    mask = np.arange(np.prod(mask_shape), dtype=np.float64).reshape(mask_shape)
    reps = R_attention.tile_reps(mask_shape, x_shape)
    assert len(reps) == ndim_x and all(type(r) is int for r in reps) and reps[-2:] == (1, 1)
    tiled = np.tile(mask, reps)
    assert tiled.shape == x_shape
    full_lead = (1,) * (ndim_x - ndim_m) + tuple(lead)
    index = np.ix_(*[np.arange(dx) % dm for dx, dm in zip(x_shape[:-2], full_lead, strict=True)])
    np.testing.assert_array_equal(tiled, mask.reshape(full_lead + x_shape[-2:])[index])


def test_soft_max_ext_back_defaults_and_dtype():
    """Scale 1 by default; the gradient has ``y``'s dtype (float32 stays float32)."""
    rng = np.random.default_rng(19)
    y = soft_max_ext(rng.standard_normal((2, 3, 5)))
    grad = rng.standard_normal(y.shape)
    expected = (grad - np.sum(y * grad, axis=-1, keepdims=True)) * y
    np.testing.assert_allclose(R_attention.soft_max_ext_back(grad, y), expected, rtol=1e-12)
    y32, g32 = y.astype(np.float32), grad.astype(np.float32)
    got = R_attention.soft_max_ext_back(g32, y32, 0.5)
    assert got.dtype == np.float32
    np.testing.assert_allclose(got, 0.5 * expected, rtol=1e-5, atol=1e-6)


def test_soft_max_ext_back_refuses_a_gradient_of_another_shape():
    y = np.full((2, 3), 1 / 3)
    with pytest.raises(OpShapeError, match=r"^soft_max_ext_back: grad \(2, 4\) and y \(2, 3\) "
                                           r"differ$"):
        R_attention.soft_max_ext_back(np.zeros((2, 4)), y)
    with pytest.raises(OpValueError, match=r"^soft_max_ext_back: ggml has no backward for "
                                           r"ALiBi \(max_bias != 0\)$"):
        R_attention.soft_max_ext_back(y, y, 1.0, max_bias=0.5)


# ----------------------------------------------------------------------------- build_attn_mha


def _naive_attention(q, k, v, mask, kq_scale):
    """Per token, per head, with the KV head of query head h = h // (n_head // n_head_kv)."""
    n_tokens, n_head, _ = q.shape
    n_gqa = n_head // k.shape[1]
    out = np.zeros((n_tokens, n_head, v.shape[2]))
    for t in range(n_tokens):
        for h in range(n_head):
            s = kq_scale * (k[:, h // n_gqa, :] @ q[t, h]) + mask[t]  # (n_kv,)
            w = np.exp(s - s.max())
            out[t, h] = (w / w.sum()) @ v[:, h // n_gqa, :]
    return out.reshape(n_tokens, -1)


@st.composite
def attn_inputs(draw):
    n_head_kv, n_gqa = draw(st.integers(1, 3)), draw(st.integers(1, 3))
    n_tokens = draw(st.integers(1, 4))
    n_kv = n_tokens + draw(st.integers(0, 4))
    d_k, d_v = draw(st.integers(1, 6)), draw(st.integers(1, 5))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    q = rng.standard_normal((n_tokens, n_head_kv * n_gqa, d_k))
    k = rng.standard_normal((n_kv, n_head_kv, d_k))
    v = rng.standard_normal((n_kv, n_head_kv, d_v))
    return q, k, v, causal_mask(n_tokens, n_kv), 1.0 / np.sqrt(d_k)


@given(attn_inputs())
def test_attention_matches_the_naive_loop(inputs):
    q, k, v, mask, kq_scale = inputs
    np.testing.assert_allclose(build_attn_mha(q, k, v, mask, kq_scale),
                               _naive_attention(q, k, v, mask, kq_scale), rtol=1e-10, atol=1e-12)


@given(attn_inputs(), st.data())
def test_causal_later_kv_never_changes_earlier_outputs(inputs, data):
    q, k, v, mask, kq_scale = inputs
    n_tokens, n_kv = mask.shape
    t = data.draw(st.integers(0, n_tokens - 1))  # change the K/V of token t ...
    j = n_kv - n_tokens + t  # ... stored in cell j
    k2, v2 = k.copy(), v.copy()
    k2[j:] += 5.0
    v2[j:] -= 7.0
    before = build_attn_mha(q, k, v, mask, kq_scale)
    after = build_attn_mha(q, k2, v2, mask, kq_scale)
    np.testing.assert_array_equal(after[:t], before[:t])  # tokens before t: bit-identical
    assert not np.allclose(after[t], before[t])  # token t itself sees its own (changed) V


@given(attn_inputs())
def test_gqa_equals_kv_heads_repeated(inputs):
    q, k, v, mask, kq_scale = inputs
    n_gqa = q.shape[1] // k.shape[1]
    k_rep = np.repeat(k, n_gqa, axis=1)  # KV head g serves query heads g*n_gqa .. g*n_gqa+n_gqa-1
    v_rep = np.repeat(v, n_gqa, axis=1)
    np.testing.assert_allclose(build_attn_mha(q, k, v, mask, kq_scale),
                               build_attn_mha(q, k_rep, v_rep, mask, kq_scale),
                               rtol=1e-12, atol=1e-14)


def test_gqa_is_not_kv_heads_tiled():
    rng = np.random.default_rng(5)
    q = rng.standard_normal((2, 4, 3))
    k, v = rng.standard_normal((2, 2, 3)), rng.standard_normal((2, 2, 3))
    mask = np.zeros((2, 2))
    tiled = build_attn_mha(q, np.tile(k, (1, 2, 1)), np.tile(v, (1, 2, 1)), mask, 0.5)
    assert not np.allclose(build_attn_mha(q, k, v, mask, 0.5), tiled)


def test_attention_output_layout_is_heads_side_by_side():
    q = np.zeros((1, 2, 1))  # uniform weights: the output is the mean of the visible V
    k = np.zeros((2, 2, 1))
    v = np.array([[[1.0, 2.0], [3.0, 4.0]], [[5.0, 6.0], [7.0, 8.0]]])  # (n_kv, n_head_kv, d_v)
    out = build_attn_mha(q, k, v, np.zeros((1, 2)), 1.0)
    np.testing.assert_allclose(out, [[3.0, 4.0, 5.0, 6.0]])  # [head 0 (d_v), head 1 (d_v)]


def test_attention_float32_stays_float32():
    rng = np.random.default_rng(6)
    q = rng.standard_normal((3, 4, 8)).astype(np.float32)
    k = rng.standard_normal((5, 2, 8)).astype(np.float32)
    v = rng.standard_normal((5, 2, 8)).astype(np.float32)
    mask = causal_mask(3, 5).astype(np.float32)
    out = build_attn_mha(q, k, v, mask, 8 ** -0.5)
    assert out.dtype == np.float32
    ref = _naive_attention(*(a.astype(np.float64) for a in (q, k, v, mask)), 8 ** -0.5)
    nmse = np.sum((out - ref) ** 2) / np.sum(ref**2)
    assert nmse < 1e-12  # measured ~1e-14 (test-backend-ops allows 5e-4 for attention)


@pytest.mark.parametrize(
    "q_shape, k_shape, v_shape, mask_shape",
    [
        ((2, 4, 8), (3, 3, 8), (3, 3, 5), (2, 3)),  # n_head 4 not a multiple of n_head_kv 3
        ((2, 4, 8), (3, 2, 7), (3, 2, 5), (2, 3)),  # d_k differs
        ((2, 4, 8), (3, 2, 8), (4, 2, 5), (2, 3)),  # n_kv of v differs
        ((2, 4, 8), (3, 2, 8), (3, 2, 5), (1, 3)),  # fewer mask rows than tokens
        ((2, 4, 8), (3, 2, 8), (3, 2, 5), (2, 4)),  # mask n_kv differs
        ((2, 32), (3, 2, 8), (3, 2, 5), (2, 3)),  # q not split into heads
    ],
)
def test_attention_rejects_bad_shapes(q_shape, k_shape, v_shape, mask_shape):
    with pytest.raises(OpShapeError, match="build_attn_mha"):
        build_attn_mha(np.zeros(q_shape), np.zeros(k_shape), np.zeros(v_shape),
                       np.zeros(mask_shape), 1.0)


@pytest.mark.oracle
def test_attention_matches_torch_sdpa_with_gqa():
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(7)
    n_tokens, n_kv, n_head, n_head_kv, d = 5, 9, 6, 2, 16
    q = rng.standard_normal((n_tokens, n_head, d))
    k = rng.standard_normal((n_kv, n_head_kv, d))
    v = rng.standard_normal((n_kv, n_head_kv, d))
    mask = causal_mask(n_tokens, n_kv)
    t = [torch.from_numpy(a.transpose(1, 0, 2).copy()) for a in (q, k, v)]  # (head, seq, d)
    ref = torch.nn.functional.scaled_dot_product_attention(
        *t, attn_mask=torch.from_numpy(mask), scale=d**-0.5, enable_gqa=True
    )  # (n_head, n_tokens, d)
    ref = ref.numpy().transpose(1, 0, 2).reshape(n_tokens, -1)
    np.testing.assert_allclose(build_attn_mha(q, k, v, mask, d**-0.5), ref, rtol=1e-12,
                               atol=1e-13)


@pytest.mark.oracle
def test_softmax_matches_torch():
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(8)
    x = rng.standard_normal((3, 4, 7)) * 10
    np.testing.assert_allclose(soft_max_ext(x, scale=0.3),
                               torch.softmax(torch.from_numpy(0.3 * x), dim=-1).numpy(),
                               rtol=1e-13, atol=1e-300)


@pytest.mark.oracle
def test_soft_max_ext_matches_ggml_cpu_with_mask_scale_and_alibi():
    from tests.support.ggml_cpu import ggml_cpu

    ggml = ggml_cpu()
    rng = np.random.default_rng(13)
    kq = (rng.standard_normal((2, 6, 3, 40)) * 4).astype(np.float32)  # 6 heads: ALiBi m1 used
    causal = causal_mask(3, 40)
    distance = -np.abs(np.arange(37, 40)[:, None] - np.arange(40)[None, :])  # ALiBi mask
    alibi = np.where(np.isfinite(causal), distance, -np.inf).astype(np.float32)
    padded = np.vstack([causal, np.full((5, 40), -np.inf)]).astype(np.float32)
    for mask, max_bias in [(padded, 0.0), (alibi, 8.0)]:
        ours = soft_max_ext(kq, mask, 0.125, max_bias)
        theirs = ggml("soft_max_ext", kq, mask, params=(0.125, max_bias))
        nmse = np.sum((ours - theirs) ** 2) / np.sum(theirs**2)
        assert nmse < 1e-12  # measured ~8e-15; test-backend-ops allows 1e-6 for softmax
        hidden = ~np.isfinite(mask[:3])
        assert np.all(theirs[..., hidden] == 0) and np.all(ours[..., hidden] == 0)


@pytest.mark.oracle
def test_fully_masked_row_is_nan_in_ggml_and_zeros_here():
    """The documented divergence: ggml's soft_max returns NaN, the specification zeros."""
    from tests.support.ggml_cpu import ggml_cpu

    kq = np.zeros((2, 2, 4), dtype=np.float32)
    mask = np.array([[0, 0, -np.inf, -np.inf], [-np.inf] * 4], dtype=np.float32)
    with np.errstate(invalid="ignore"):
        theirs = ggml_cpu()("soft_max_ext", kq, mask, params=(1.0, 0.0))
    assert np.isnan(theirs[:, 1]).all() and np.allclose(theirs[:, 0], [0.5, 0.5, 0, 0])
    ours = soft_max_ext(kq, mask)
    assert np.array_equal(ours[:, 1], np.zeros((2, 4)))
    np.testing.assert_array_equal(ours[:, 0], theirs[:, 0])


def test_keys_cut_per_stream_give_the_rows_of_the_flat_form():
    """The cache hands several streams over as ``(n_stream, n_kv, n_head_kv, d)``: the same
    rows as the flat ``(n_stream * n_kv, ...)`` form; a block count that is not
    ``n_stream`` is refused."""
    rng = np.random.default_rng(5)
    ns, n_kv, h, d = 3, 4, 2, 8
    q = rng.standard_normal((ns * 2, 4, d))
    k = rng.standard_normal((ns, n_kv, h, d))
    v = rng.standard_normal((ns, n_kv, h, 5))
    mask = np.where(rng.random((ns * 2, ns * n_kv)) < 0.3, -np.inf, 0.0)
    mask[:, ::n_kv] = 0.0
    flat = build_attn_mha(q, k.reshape(-1, h, d), v.reshape(-1, h, 5), mask, 0.3, n_stream=ns)
    assert np.array_equal(build_attn_mha(q, k, v, mask, 0.3, n_stream=ns), flat)
    with pytest.raises(OpShapeError, match="one block per stream"):
        build_attn_mha(q, k, v, mask, 0.3, n_stream=1)


@pytest.mark.parametrize("n_stream", [1, 2, 3, 4])
def test_stream_mask_is_the_diagonal_blocks(n_stream):
    """Stream ``s``'s tokens at stream ``s``'s cells, for every stream; one stream is the mask
    itself (a view, not a copy per layer)."""
    rng = np.random.default_rng(20)
    tb, cb = 2, 3  # tokens and cells per stream
    mask = rng.standard_normal((n_stream * tb, n_stream * cb))
    got = R_attention.stream_mask(mask, n_stream)
    assert got.shape == (n_stream, 1, tb, cb)
    for s in range(n_stream):
        np.testing.assert_array_equal(got[s, 0], mask[s * tb:(s + 1) * tb, s * cb:(s + 1) * cb])
    assert np.shares_memory(got, mask) is (n_stream == 1)


def test_streams_whose_tokens_see_few_cells_give_the_rows_of_the_flat_form():
    """Two streams of 64 cells whose tokens each see 2: cut as streams (4-D) or flat, the rows
    are each stream's own attention over its own cells."""
    rng = np.random.default_rng(21)
    ns, n_kv, h, d = 2, 64, 2, 8
    q = rng.standard_normal((ns * 3, 4, d))
    k, v = rng.standard_normal((ns, n_kv, h, d)), rng.standard_normal((ns, n_kv, h, 5))
    mask = np.full((ns * 3, ns * n_kv), -np.inf)
    for t in range(ns * 3):
        s = t // 3
        mask[t, s * n_kv + rng.choice(n_kv, 2, replace=False)] = 0.0
    assert R_attention.sees_few_cells(mask)
    blocked = build_attn_mha(q, k, v, mask, 0.3, n_stream=ns)
    flat = build_attn_mha(q, k.reshape(-1, h, d), v.reshape(-1, h, 5), mask, 0.3, n_stream=ns)
    assert np.array_equal(blocked, flat)
    for s in range(ns):
        rows = slice(s * 3, (s + 1) * 3)
        own = full_product(q[rows], k[s], v[s], mask[rows, s * n_kv:(s + 1) * n_kv], 0.3,
                           0.0, 0.0)
        np.testing.assert_allclose(blocked[rows], own, rtol=1e-12, atol=1e-13)


def test_attention_defaults_to_no_alibi_no_cap_one_stream():
    """``build_attn_mha``'s defaults change nothing: a mask of distances (where a slope would
    show) is added as it is, the scores are not capped, all tokens are one stream."""
    rng = np.random.default_rng(22)
    q, k, v = (3 * rng.standard_normal(s) for s in ((3, 4, 8), (5, 2, 8), (5, 2, 3)))
    mask = _alibi_mask(3, 5)
    got = build_attn_mha(q, k, v, mask, 0.4)
    np.testing.assert_array_equal(got, build_attn_mha(q, k, v, mask, 0.4, 0.0, 0.0, 1))
    np.testing.assert_allclose(got, _naive_attention(q, k, v, mask, 0.4), rtol=1e-10,
                               atol=1e-12)


@pytest.mark.parametrize("max_bias, softcap", [(8.0, 0.0), (0.0, 5.0), (8.0, 5.0), (0.5, 1.0)])
def test_gathered_attention_keeps_alibi_and_the_cap(monkeypatch, max_bias, softcap):
    """When ``build_attn_mha`` gathers (32 sequences, each seeing 1/32 of the cells), ALiBi and
    the soft-cap reach the gathered form: the output is the full product's."""
    mask = parallel_mask(32, 16, 32)
    pos = np.arange(mask.shape[1])
    mask = np.where(np.isfinite(mask), -(np.abs(pos[None, :] - pos[-32:, None]) % 7), -np.inf)
    rng = np.random.default_rng(23)
    q = 2 * rng.standard_normal((32, 6, 8))
    k, v = 2 * rng.standard_normal((2, mask.shape[1], 2, 8))
    calls, original = [], R_attention.attend_visible

    def counting(*args):
        calls.append(args[5:])
        return original(*args)

    monkeypatch.setattr(R_attention, "attend_visible", counting)
    out = R_attention.build_attn_mha(q, k, v, mask, 8 ** -0.5, max_bias, softcap)
    assert calls == [(max_bias, softcap)]
    np.testing.assert_allclose(out, full_product(q, k, v, mask, 8 ** -0.5, max_bias, softcap),
                               rtol=1e-12, atol=1e-13)
    plain = full_product(q, k, v, mask, 8 ** -0.5, 0.0, 0.0)
    assert not np.allclose(out, plain, rtol=1e-6, atol=1e-8)


@pytest.mark.parametrize("case, expected", [
    ((1, 32, [0, 5]), True),  # one token (generation) sees 2 of 32 cells: exactly 1/16
    ((1, 32, [0, 5, 9]), False),  # 3 of 32
    ((2, 32, [0, 5], [1, 6]), True),  # two tokens, 2 of 32 each (4 in all: the widest row counts)
    ((2, 32, [0, 5], [1, 6, 7]), False),  # the widest sees 3
    ((2, 1), True),  # nothing visible: 0 cells is few
    ((2, 0), False),  # no cells: nothing to gather
    ((0, 4), False),  # no tokens
])
def test_sees_few_cells_counts_the_widest_row(case, expected):
    n_tokens, n_kv, *rows = case  # the cells each token sees
    mask = np.full((n_tokens, n_kv), -np.inf, dtype=np.float32)
    for t, cells in enumerate(rows):
        mask[t, cells] = -1e30  # finite: visible, however low
    assert R_attention.sees_few_cells(mask) is expected


@pytest.mark.parametrize("q_shape, k_shape, v_shape, mask_shape, n_stream, message", [
    ((2, 4, 8), (1, 3, 2, 8), (3, 2, 5), (2, 3), 1, r"q must be 3-D \(tokens, heads, dim\), k and "
     r"v 3-D too or 4-D \(streams, cells, heads, dim\)"),  # k cut as streams, v not
    ((2, 4, 8), (3, 2, 8), (1, 3, 2, 5), (2, 3), 1, "q must be 3-D .*k and v 3-D too"),  # v cut
    ((2, 4, 8), (2, 3, 2, 8), (2, 4, 2, 5), (2, 8), 2,
     r"4-D k and v need one block per stream \(n_stream=2\)"),  # blocks of different sizes
    ((2, 4, 8), (3, 0, 8), (3, 0, 5), (2, 3), 1, "n_head=4 must be a multiple of n_head_kv=0"),
    ((3, 4, 8), (4, 2, 8), (4, 2, 5), (3, 4), 2,
     "n_stream=2 must be >= 1 and divide n_tokens=3 and n_kv=4"),  # the tokens do not split
    ((2, 4, 8), (3, 2, 8), (3, 2, 5), (2, 3), 2, "n_stream=2 must be >= 1"),  # the cells do not
    ((2, 4, 8), (4, 2, 8), (4, 2, 5), (2, 4), 0, "n_stream=0 must be >= 1"),
])
def test_attention_names_the_shape_it_refuses(q_shape, k_shape, v_shape, mask_shape, n_stream,
                                              message):
    with pytest.raises(OpShapeError, match="^build_attn_mha: " + message):
        build_attn_mha(np.zeros(q_shape), np.zeros(k_shape), np.zeros(v_shape),
                       np.zeros(mask_shape), 1.0, n_stream=n_stream)


# ----------------------------------------------------------------------------- attend_visible

EPS32 = float(np.finfo(np.float32).eps)


@st.composite
def sparse_attention(draw, max_kv: int = 40):
    """q, k, v (float64), a 0/-inf mask (or ALiBi distances), kq_scale, max_bias, softcap."""
    n_tokens, n_kv = draw(st.integers(1, 6)), draw(st.integers(1, max_kv))
    n_head_kv, r, d = draw(st.integers(1, 3)), draw(st.integers(1, 3)), draw(st.integers(1, 8))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    q = rng.standard_normal((n_tokens, n_head_kv * r, d))
    k = rng.standard_normal((n_kv, n_head_kv, d))
    v = rng.standard_normal((n_kv, n_head_kv, d))
    density = draw(st.sampled_from([0.0, 0.05, 0.2, 0.5, 1.0]))
    visible = rng.random((n_tokens, n_kv)) < density  # a row may see nothing
    max_bias = draw(st.sampled_from([0.0, 0.0, 8.0]))
    # with ALiBi the mask holds -|i - j| where visible (ggml's distances), else 0
    dist = -np.abs(np.arange(n_kv)[None, :] - np.arange(n_tokens)[:, None]) if max_bias else 0.0
    mask = np.where(visible, dist, -np.inf).astype(np.float64)
    softcap = draw(st.sampled_from([0.0, 0.0, 5.0]))
    return q, k, v, mask, d ** -0.5, max_bias, softcap


def full_product(q, k, v, mask, kq_scale, max_bias, softcap) -> np.ndarray:
    """build_attn_mha over every cell (the gathered form switched off)."""
    with pytest.MonkeyPatch.context() as m:
        m.setattr(R_attention, "FEW_CELLS", 10**9)
        return R_attention.build_attn_mha(q, k, v, mask, kq_scale, max_bias, softcap)


@given(sparse_attention())
def test_hidden_cells_add_nothing_float64(inputs):
    q, k, v, mask, kq_scale, max_bias, softcap = inputs
    full = full_product(*inputs)
    gathered = R_attention.attend_visible(q, k, v, mask, kq_scale, max_bias, softcap)
    assert gathered.shape == full.shape and gathered.dtype == np.float64
    np.testing.assert_allclose(gathered, full, rtol=1e-12, atol=1e-13)
    hidden = np.all(np.isinf(mask), axis=1)  # a token that sees nothing: zeros, as in full
    assert np.all(gathered[hidden] == 0.0)


@given(sparse_attention())
def test_hidden_cells_add_nothing_float32(inputs):
    q, k, v, mask, kq_scale, max_bias, softcap = inputs
    exact = full_product(*inputs)  # float64
    f32 = [a.astype(np.float32) for a in (q, k, v, mask)]
    full = full_product(*f32, kq_scale, max_bias, softcap)
    gathered = R_attention.attend_visible(*f32, kq_scale, max_bias, softcap)
    assert gathered.dtype == np.float32
    # as close to the float64 result as the full float32 product, up to a few roundings of v
    bound = 4 * np.max(np.abs(full - exact), initial=0) + 8 * EPS32 * np.max(np.abs(v))
    assert np.max(np.abs(gathered - exact), initial=0) <= bound


def parallel_mask(n_seq: int, n_prompt: int, n_gen: int) -> np.ndarray:
    """The mask of one decode step of ``n_seq`` sequences in a unified cache, laid out as
    parallel decoding places them: every prompt's cells, then one cell per sequence per step."""
    n_kv = n_seq * (n_prompt + n_gen)
    mask = np.full((n_seq, n_kv), -np.inf)
    for s in range(n_seq):
        mask[s, s * n_prompt:(s + 1) * n_prompt] = 0.0
        mask[s, n_seq * n_prompt + s::n_seq] = 0.0
    return mask


@pytest.mark.parametrize("n_seq, n_prompt, n_gen, gathered", [
    (32, 16, 32, True),  # each sequence sees 48 of 1536 cells
    (4, 16, 32, False),  # 48 of 192: a quarter
    (1, 16, 32, False),  # one sequence sees every cell
])
def test_build_attn_mha_gathers_only_when_tokens_see_few_cells(monkeypatch, n_seq, n_prompt,
                                                              n_gen, gathered):
    mask = parallel_mask(n_seq, n_prompt, n_gen)
    assert R_attention.sees_few_cells(mask) is gathered
    rng = np.random.default_rng(0)
    q = rng.standard_normal((n_seq, 6, 8))
    k, v = rng.standard_normal((2, mask.shape[1], 2, 8))
    calls, original = [], R_attention.attend_visible

    def counting(*args):
        calls.append(args)
        return original(*args)

    monkeypatch.setattr(R_attention, "attend_visible", counting)
    out = R_attention.build_attn_mha(q, k, v, mask, 8 ** -0.5)
    assert bool(calls) is gathered
    np.testing.assert_allclose(out, full_product(q, k, v, mask, 8 ** -0.5, 0.0, 0.0),
                               rtol=1e-12, atol=1e-13)


def test_many_tokens_go_in_blocks_whose_copies_fit_the_view(monkeypatch):
    """40 tokens that see 4 of 64 cells each: blocks of 64 // 4 = 16 tokens, so a block's
    gathered K and V (16 tokens x 4 cells) are no larger than the 64 cells in view."""
    rng = np.random.default_rng(3)
    n_tokens, n_kv = 40, 64
    mask = np.full((n_tokens, n_kv), -np.inf)
    for t in range(n_tokens):
        mask[t, rng.choice(n_kv, 4, replace=False)] = 0.0
    q = rng.standard_normal((n_tokens, 4, 8))
    k, v = rng.standard_normal((2, n_kv, 2, 8))
    calls, original = [], R_attention.attend_visible

    def counting(q, *rest):
        calls.append(len(q))
        return original(q, *rest)

    monkeypatch.setattr(R_attention, "attend_visible", counting)
    out = counting(q, k, v, mask, 8 ** -0.5)
    assert calls == [40, 16, 16, 8]
    np.testing.assert_allclose(out, full_product(q, k, v, mask, 8 ** -0.5, 0.0, 0.0),
                               rtol=1e-12, atol=1e-13)


def test_visible_cells_pads_with_a_hidden_cell():
    mask = np.array([[0.0, -np.inf, -np.inf, -2.0], [-np.inf] * 4, [0.0, 0.0, 0.0, -np.inf]])
    idx, vis = R_attention.visible_cells(mask)
    assert idx.tolist() == [[0, 3, 0], [0, 0, 0], [0, 1, 2]]
    assert vis.tolist() == [[0.0, -2.0, -np.inf], [-np.inf] * 3, [0.0, 0.0, 0.0]]
    assert not R_attention.sees_few_cells(np.zeros((0, 4)))  # no tokens: nothing to gather


def _visible_cells_row_by_row(kq_mask):
    """Each row's visible cells in order, then cell 0 at -inf up to the widest row (>= 1)."""
    cells = [np.flatnonzero(row > -np.inf) for row in kq_mask]
    n_vis = max([1] + [len(c) for c in cells])
    idx = np.zeros((len(cells), n_vis), dtype=np.intp)
    mask = np.full((len(cells), n_vis), -np.inf, dtype=kq_mask.dtype)
    for t, c in enumerate(cells):
        idx[t, :len(c)], mask[t, :len(c)] = c, kq_mask[t, c]
    return idx, mask


@given(hnp.arrays(st.sampled_from([np.float32, np.float64]),
                  st.tuples(st.integers(0, 5), st.integers(1, 9)),
                  elements=st.sampled_from([-np.inf, -np.inf, 0.0, -1.0, -3.5])))
@example(np.where(np.eye(3, 5, dtype=bool), 0.0, -np.inf).astype(np.float32))  # one cell each
@example(np.full((2, 4), -np.inf))  # nothing visible: one hidden cell
@example(np.zeros((0, 3)))  # no tokens
def test_visible_cells_are_each_rows_cells_padded_to_the_widest_row(kq_mask):
    """``n_vis`` is the most cells a row sees (at least 1), the values keep the mask's dtype."""
    idx, mask = R_attention.visible_cells(kq_mask)
    want_idx, want_mask = _visible_cells_row_by_row(kq_mask)
    assert idx.dtype == np.intp and mask.dtype == kq_mask.dtype
    assert idx.shape == mask.shape == want_idx.shape
    np.testing.assert_array_equal(idx, want_idx)
    np.testing.assert_array_equal(mask, want_mask)


def test_gathered_form_defaults_to_no_alibi_and_no_cap():
    """``attend_visible``'s defaults are ``build_attn_mha``'s: a mask of distances (not only
    0 / -inf, so that a slope would show) is added as it is, and the scores are not capped."""
    rng = np.random.default_rng(11)
    q, k, v = (3 * rng.standard_normal(s) for s in ((3, 4, 8), (6, 2, 8), (6, 2, 5)))
    mask = np.full((3, 6), -np.inf)
    mask[0, [0, 2]], mask[1, [1, 3, 4]], mask[2, [2, 5]] = [0.0, -2.0], [-1.0, 0.0, -3.0], -4.0
    got = R_attention.attend_visible(q, k, v, mask, 8 ** -0.5)
    np.testing.assert_array_equal(got, R_attention.attend_visible(q, k, v, mask, 8 ** -0.5,
                                                                  0.0, 0.0))
    np.testing.assert_allclose(got, full_product(q, k, v, mask, 8 ** -0.5, 0.0, 0.0),
                               rtol=1e-12, atol=1e-13)
    assert not np.allclose(got, full_product(q, k, v, mask, 8 ** -0.5, 1.0, 0.0))


@pytest.mark.parametrize("cap", [1.0, 0.25])
def test_gathered_form_applies_a_cap_of_one_or_less(cap):
    """Any positive cap is applied, however small (``softcap > 0``, as ``build_attn_mha``)."""
    rng = np.random.default_rng(12)
    q, k, v = (3 * rng.standard_normal(s) for s in ((2, 2, 8), (5, 1, 8), (5, 1, 4)))
    mask = np.where(rng.random((2, 5)) < 0.5, -np.inf, 0.0)
    mask[:, 0] = 0.0
    got = R_attention.attend_visible(q, k, v, mask, 8 ** -0.5, 0.0, cap)
    np.testing.assert_allclose(got, full_product(q, k, v, mask, 8 ** -0.5, 0.0, cap),
                               rtol=1e-12, atol=1e-13)
    assert not np.allclose(got, full_product(q, k, v, mask, 8 ** -0.5, 0.0, 0.0))


@pytest.mark.parametrize("k_shape, v_shape, n_kv", [
    ((1, 4, 2, 8), (1, 4, 2, 5), 4),  # one stream, but cut as streams: 4-D
    ((0, 2, 8), (0, 2, 5), 0),  # no cell at all
])
def test_gathered_form_refuses_keys_that_are_not_one_block_of_cells(k_shape, v_shape, n_kv):
    q = np.zeros((2, 4, 8))
    with pytest.raises(OpShapeError, match=r"^attend_visible: k must be one block of cells "
                       r"\(n_kv >= 1, n_head_kv, d_k\); got " + re.escape(str(k_shape)) + "$"):
        R_attention.attend_visible(q, np.zeros(k_shape), np.zeros(v_shape),
                                   np.zeros((2, n_kv)), 1.0)


@given(st.integers(1, 300), st.integers(1, 300))
@example(3, 2)  # two tokens' cells would outgrow the view: one token a block
@example(16, 40)  # a token sees more cells than the view holds (padding): still one
def test_visible_block_is_the_most_tokens_whose_cells_fit_the_view(n_kv, n_vis):
    """At least one token a block; more only while their gathered cells fit in ``n_kv``."""
    per_block = R_attention.visible_block(n_kv, n_vis)
    assert per_block >= 1
    assert per_block == 1 or per_block * n_vis <= n_kv
    assert (per_block + 1) * n_vis > n_kv
