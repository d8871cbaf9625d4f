"""Laws of ``rope_ext`` and its comparison with three independent implementations.

Laws (float64, where rounding is out of the way): norms are kept, q.k depends only on the
position difference, NORMAL is NEOX after ``convert_hf_to_gguf``'s Q/K permutation.

The additivity laws run on every flavour of ``tests/support/helpers.py``, each on its own
``rope_ext`` (the reference's in float64 and in float32, the MLX twin's ``mx.fast.rope`` and
its YaRN cos/sin cache): rotations add up (``rope(rope(x, a), b) == rope(x, a + b)``, YaRN
included when its magnitude ``attn_factor * mscale`` is one, what a K-shift needs), and with
a magnitude $M$ other than one, additivity fails by exactly a factor $M$. float64 holds them to
~1e-10; float32 in the form and with the bound of llama.cpp's ``tests/test-rope.cpp``
(``sum|r1 - r2| / sum|r| < 1e-4``), at positions of a few thousands, where float32 angles
keep that bound.

Oracles: ggml's own CPU ``ggml_rope_ext`` and ``ggml_rope_yarn_corr_dims`` (the ``libggml``
that llama-cpp-python ships, called through ctypes), C's ``powf`` for the angles' recurrence,
HF transformers' ``apply_rotary_pos_emb`` (rotate_half) and HF's YaRN frequencies
(``_compute_yarn_parameters``).

The fast path of a forward's RoPE, ``graph_rope`` (one cos/sin cache per forward), is
``rope_ext`` bit for bit (NORM and NEOX, YaRN, frequency factors, float32 and float64).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import importlib
import math
import warnings

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from reference.models.llama import graph_rope
from reference.ops.rope import (
    ROPE_TYPE_NEOX,
    ROPE_TYPE_NORM,
    RopeError,
    RopeParams,
    rope_back,
    rope_cache,
    rope_ext,
    rope_theta,
    rope_yarn_corr_dims,
    rope_yarn_ramp,
)
from tests.support.ggml_cpu import ggml_cpu
from tests.support.helpers import Flavour, every_flavour

MODES = st.sampled_from([ROPE_TYPE_NORM, ROPE_TYPE_NEOX])


@st.composite
def rope_case(draw, max_pos: int = 100_000):
    """A random rope problem: x (n_tokens, n_head, head_dim) float64, pos, n_dims, mode, freqs."""
    head_dim = 2 * draw(st.integers(1, 40))
    n_dims = 2 * draw(st.integers(0, head_dim // 2))
    n_tokens = draw(st.integers(1, 5))
    n_head = draw(st.integers(1, 3))
    seed = draw(st.integers(0, 2**32 - 1))
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((n_tokens, n_head, head_dim))
    pos = np.array(draw(st.lists(st.integers(-max_pos, max_pos), min_size=n_tokens,
                                 max_size=n_tokens)), dtype=np.int32)
    params = dict(
        mode=draw(MODES),
        freq_base=draw(st.sampled_from([10000.0, 500000.0, 1e6, 100.0])),
        freq_scale=draw(st.sampled_from([1.0, 0.5, 0.25])),
    )
    if draw(st.booleans()) and n_dims > 0:
        params["freq_factors"] = rng.uniform(1.0, 8.0, n_dims // 2)
    return x, pos, n_dims, params


def rope(x, pos, n_dims, mode=ROPE_TYPE_NORM, freq_factors=None, **params) -> np.ndarray:
    """``rope_ext`` with its numbers spelled out, as the laws below draw them."""
    return rope_ext(x, pos, RopeParams(n_dims, mode, **params), freq_factors)


def head_norms(x: np.ndarray) -> np.ndarray:
    return np.linalg.norm(x, axis=-1)  # (n_tokens, n_head)


# --- laws -------------------------------------------------------------------------------------


@given(rope_case())
def test_rope_preserves_norms_per_head(case):
    x, pos, n_dims, params = case
    y = rope(x, pos, n_dims, **params)  # attn_factor 1, ext_factor 0
    np.testing.assert_allclose(head_norms(y), head_norms(x), rtol=1e-12)


@given(rope_case())
def test_pass_through_dims_are_copied_exactly(case):
    x, pos, n_dims, params = case
    y = rope(x, pos, n_dims, **params, attn_factor=0.7, ext_factor=1.0, n_ctx_orig=512)
    assert np.array_equal(y[..., n_dims:], x[..., n_dims:])


@given(rope_case(), st.floats(0.25, 4.0))
def test_attn_factor_scales_the_rotated_dims(case, attn_factor):
    x, pos, n_dims, params = case
    y = rope(x, pos, n_dims, **params, attn_factor=attn_factor)
    got = np.linalg.norm(y[..., :n_dims], axis=-1)
    np.testing.assert_allclose(got, attn_factor * np.linalg.norm(x[..., :n_dims], axis=-1),
                               rtol=1e-12)


@given(rope_case(max_pos=50_000), st.integers(-50_000, 50_000), st.integers(0, 2**32 - 1))
def test_qk_depends_only_on_position_difference(case, d, seed):
    q, pos_q, n_dims, params = case
    k = np.random.default_rng(seed).standard_normal(q.shape)
    pos_k = pos_q[::-1].copy()  # some other positions, one per token
    qk = np.einsum("thd,thd->th", rope(q, pos_q, n_dims, **params),
                   rope(k, pos_k, n_dims, **params))
    qk_d = np.einsum("thd,thd->th", rope(q, pos_q + d, n_dims, **params),
                     rope(k, pos_k + d, n_dims, **params))
    scale = head_norms(q) * head_norms(k)
    assert np.all(np.abs(qk_d - qk) <= 1e-10 * scale)


def flavour_rope(flavour: Flavour, x, pos, n_dims, **params) -> np.ndarray:
    """``rope_ext`` of the flavour's package on ``x`` in the flavour's dtype, as NumPy."""
    rope_ext_of = importlib.import_module(f"{flavour.package}.ops.rope").rope_ext
    freq_factors = params.pop("freq_factors", None)
    if freq_factors is not None:
        freq_factors = np.asarray(freq_factors, dtype=flavour.dtype)
    out = np.array(rope_ext_of(np.asarray(x, dtype=flavour.dtype), pos,
                               RopeParams(n_dims, **params), freq_factors))
    assert out.dtype == flavour.dtype
    return out


def rope_twice_and_once(flavour, x, a, b, n_dims, **params):
    """``rope(rope(x, a), b)`` and ``rope(x, a + b)``."""
    r0 = flavour_rope(flavour, x, a, n_dims, **params)
    twice = flavour_rope(flavour, r0, np.full_like(a, b), n_dims, **params)
    return twice, flavour_rope(flavour, x, a + b, n_dims, **params)


def assert_rope_close(flavour: Flavour, want, got, **f64_tol) -> None:
    """float64: ``np.testing.assert_allclose(got, want, **f64_tol)``; float32: test-rope.cpp's
    check, ``sum|want - got| / sum|want| < 1e-4`` and the same over ``sum|got|``."""
    if flavour.dtype == np.float64:
        np.testing.assert_allclose(got, want, **f64_tol)
        return
    diff = np.abs(want.astype(np.float64) - got).sum()
    for r in (want, got):
        assert diff <= 1e-4 * np.abs(r).astype(np.float64).sum()


def max_pos(flavour: Flavour, float64: int) -> int:
    """Positions up to ``float64`` in float64, up to test-rope's few thousands in float32."""
    return float64 if flavour.dtype == np.float64 else 2048


@every_flavour
@given(data=st.data(), ext_factor=st.sampled_from([0.0, 0.5, 1.0]))
def test_additivity(flavour, data, ext_factor):
    """rope(rope(x, a), b) == rope(x, a + b): without YaRN (float64: positions to 100000), and
    with YaRN when the magnitude ``attn_factor * mscale`` is one (a K-shift's rope), where the
    angle is linear in the position."""
    p = max_pos(flavour, 100_000)
    x, a, n_dims, params = data.draw(rope_case(max_pos=p))
    b = data.draw(st.integers(-p, p))
    if ext_factor != 0.0:
        mscale = 1.0 + 0.1 * math.log(1.0 / params["freq_scale"])
        params = dict(params, ext_factor=ext_factor, n_ctx_orig=512, attn_factor=1.0 / mscale)
    twice, once = rope_twice_and_once(flavour, x, a, b, n_dims, **params)
    assert_rope_close(flavour, once, twice, rtol=0, atol=1e-10 * max(1.0, np.abs(x).max()))


@every_flavour
@given(data=st.data(), freq_scale=st.sampled_from([0.5, 0.25, 0.125]),
       ext=st.sampled_from([0.5, 1.0]), n_ctx_orig=st.sampled_from([512, 2048]))
def test_additivity_with_yarn_holds_only_when_the_magnitude_is_one(flavour, data, freq_scale,
                                                                   ext, n_ctx_orig):
    """YaRN's angle is linear in p (additive), but its mscale multiplies on every call."""
    p = max_pos(flavour, 4096)
    x, a, n_dims, params = data.draw(rope_case(max_pos=p))
    b = data.draw(st.integers(-p, p))
    params = dict(params, freq_scale=freq_scale, ext_factor=ext, n_ctx_orig=n_ctx_orig)
    mscale = 1.0 + 0.1 * math.log(1.0 / freq_scale)  # YaRN's magnitude correction
    x = x.astype(flavour.dtype)

    # attn_factor * mscale == 1 (what a K-shift needs): additive
    twice, once = rope_twice_and_once(flavour, x, a, b, n_dims, **params, attn_factor=1 / mscale)
    assert_rope_close(flavour, once, twice, rtol=0, atol=1e-10 * max(1.0, np.abs(x).max()))
    # attn_factor == 1: twice applies M^2, once applies M: off by exactly M on the rotated dims
    twice, once = rope_twice_and_once(flavour, x, a, b, n_dims, **params, attn_factor=1.0)
    assert_rope_close(flavour, mscale * once[..., :n_dims], twice[..., :n_dims],
                      rtol=1e-9, atol=1e-9)
    np.testing.assert_array_equal(twice[..., n_dims:], x[..., n_dims:])  # copied through
    if n_dims > 0 and np.abs(x[..., :n_dims]).max() > 1e-3:
        assert np.abs(twice - once).max() > 1e-3 * (mscale - 1.0) * np.abs(x[..., :n_dims]).max()


@every_flavour
@given(data=st.data(), attn_factor=st.floats(0.5, 2.0))
def test_additivity_fails_for_attn_factor_not_one(flavour, data, attn_factor):
    p = max_pos(flavour, 4096)
    x, a, n_dims, params = data.draw(rope_case(max_pos=p))
    b = data.draw(st.integers(-p, p))
    twice, once = rope_twice_and_once(flavour, x, a, b, n_dims, **params,
                                      attn_factor=attn_factor)
    assert_rope_close(flavour, attn_factor * once[..., :n_dims], twice[..., :n_dims],
                      rtol=1e-9, atol=1e-9)


@every_flavour
def test_rope_test_cpp_additivity(flavour):
    """tests/test-rope.cpp, modes 0 and 2: rope by p0 = 100 + i, then by p1 = 33 - 100 = -67,
    versus rope by p2 = 33 + i; x uniform in [-1, 1], ne = {2*128, 32, 73}, n_rot 128 (half the
    head rotates), ggml_rope's defaults (n_ctx_orig 0, base 10000, beta_fast = beta_slow = 0).
    The check is theirs: sum|r1 - r2| / sum|r1| < 1e-4 and the same over sum|r2|.
    """
    n_rot, n_past_0, n_past_2 = 128, 100, 33
    x = np.random.default_rng(0).uniform(-1.0, 1.0, (73, 32, 2 * n_rot)).astype(flavour.dtype)
    i = np.arange(73, dtype=np.int32)
    defaults = dict(n_ctx_orig=0, freq_base=10000.0, freq_scale=1.0, ext_factor=0.0,
                    attn_factor=1.0, beta_fast=0.0, beta_slow=0.0)
    for mode in (ROPE_TYPE_NORM, ROPE_TYPE_NEOX):
        r1, r2 = rope_twice_and_once(flavour, x, n_past_0 + i, n_past_2 - n_past_0, n_rot,
                                     mode=mode, **defaults)
        diff = np.abs(r1.astype(np.float64) - r2).sum()
        assert diff / np.abs(r1).astype(np.float64).sum() < 1e-4
        assert diff / np.abs(r2).astype(np.float64).sum() < 1e-4
        assert diff > 0  # rounding is there; the law holds to the bound, not exactly


@given(rope_case())
def test_normal_mode_is_neox_after_the_gguf_qk_permutation(case):
    """convert_hf_to_gguf permutes each head's Q/K rows from halves to interleaved pairs, so
    rope NORMAL on GGUF activations is rope NEOX on HF activations, permuted."""
    x, pos, n_dims, params = case
    params = dict(params)
    del params["mode"]
    n_tokens, n_head, head_dim = x.shape

    def permute(weights, n_head):  # LlamaModel.permute (conversion/llama.py), n_head_kv = n_head
        return (weights.reshape(n_head, 2, weights.shape[0] // n_head // 2, *weights.shape[1:])
                .swapaxes(1, 2)
                .reshape(weights.shape))

    def to_gguf(v):  # permute the first n_dims dims of every head (all of them when n_dims = hd)
        out = v.copy()
        rows = v[..., :n_dims].reshape(n_tokens, n_head * n_dims).T  # (n_head*n_dims, n_tokens)
        if n_dims > 0:
            out[..., :n_dims] = permute(rows, n_head).T.reshape(n_tokens, n_head, n_dims)
        return out

    neox = rope(x, pos, n_dims, ROPE_TYPE_NEOX, **params)
    norm = rope(to_gguf(x), pos, n_dims, ROPE_TYPE_NORM, **params)
    assert np.array_equal(norm, to_gguf(neox))  # the same arithmetic on the same pairs: exact


@given(st.integers(1, 64).map(lambda h: 2 * h), st.sampled_from([10000.0, 500000.0, 1e6]),
       st.integers(-(2**24), 2**24))
def test_theta_recurrence_error_bound_float32(n_dims, freq_base, p):
    """ggml's theta_j = fl(theta_{j-1} * fl(b^fl(-2/n))) stays within j (2 + 2 ln(b) / n) 2^-24
    relative of the exact p b^(-2j/n): theta_scale carries the rounding of the exponent
    (|2 ln(b) / n| u) and of powf (u), raised to the power j, and each of the j products rounds
    (u). In float64 the recurrence is the closed form to ~1e-15."""
    j = np.arange(n_dims // 2)
    exact = p * freq_base ** (-2.0 * j / n_dims)
    got = rope_theta(np.array([p]), n_dims, freq_base, np.float32)[0].astype(np.float64)
    bound = j * (2.0 + 2.0 * math.log(freq_base) / n_dims) * 2.0**-24 * np.abs(exact)
    assert np.all(np.abs(got - exact) <= bound)
    got64 = rope_theta(np.array([p]), n_dims, freq_base, np.float64)[0]
    assert np.all(np.abs(got64 - exact) <= 1e-14 * np.abs(exact))


@functools.cache
def _libm() -> ctypes.CDLL:
    """C's math library, whose ``powf`` ``ggml_rope_cache_init`` calls."""
    libm = ctypes.CDLL(ctypes.util.find_library("m"))
    libm.powf.argtypes, libm.powf.restype = [ctypes.c_float, ctypes.c_float], ctypes.c_float
    return libm


@pytest.mark.parametrize("freq_base", [10000.0, 500000.0, 1e6, 100.0])
def test_theta_is_ggml_float32_recurrence_bit_for_bit(freq_base):
    """``theta_scale = powf(freq_base, -2.0f/n_dims)`` (C's powf, through ctypes), then
    ``theta *= theta_scale`` once per pair, every product rounded to float32: the angles of
    ``ggml_rope_cache_init`` exactly, for every even ``n_dims`` up to 256. (NumPy's own float32
    ``power`` is one ulp off for some of these exponents, e.g. base 1e4 and n_dims 64; a float64
    recurrence rounded at the end is within the error bound above but not these bits.)"""
    pos = np.array([0, 1, -7, 4099, 123457, -(2**24) + 3])
    for n_dims in range(2, 258, 2):
        scale = np.float32(_libm().powf(freq_base, np.float32(-2.0) / np.float32(n_dims)))
        want = np.empty((len(pos), n_dims // 2), np.float32)
        theta = pos.astype(np.float32)
        for j in range(n_dims // 2):
            want[:, j] = theta
            theta = theta * scale  # float32 * float32: one rounding
        got = rope_theta(pos, n_dims, freq_base, np.float32)
        assert got.dtype == np.float32
        np.testing.assert_array_equal(got, want, err_msg=f"n_dims={n_dims}")


def test_float16_input_is_computed_in_float32_and_rounded_back():
    x = np.random.default_rng(1).standard_normal((3, 2, 8)).astype(np.float16)
    pos = np.array([0, 5, -9])
    y = rope_ext(x, pos, RopeParams(8, ROPE_TYPE_NEOX))
    assert y.dtype == np.float16
    assert np.array_equal(y, rope_ext(x.astype(np.float32), pos, RopeParams(8, ROPE_TYPE_NEOX))
                          .astype(np.float16))


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("yarn", [False, True])
def test_angles_and_cos_sin_cache_are_in_the_compute_dtype(dtype, yarn):
    """float32 (ggml) or float64 throughout, whatever the dtype of ``freq_factors``."""
    other = np.float64 if dtype == np.float32 else np.float32
    params = RopeParams(16, n_ctx_orig=512, freq_scale=0.25 if yarn else 1.0,
                        ext_factor=1.0 if yarn else 0.0, attn_factor=0.9)
    pos = np.array([0, 3, -17, 4000])
    assert rope_theta(pos, 16, 10000.0, dtype).dtype == dtype
    for freq_factors in (None, np.linspace(1.0, 4.0, 8, dtype=other)):
        cos_theta, sin_theta = rope_cache(pos, params, freq_factors, dtype)
        assert cos_theta.dtype == sin_theta.dtype == dtype
        assert cos_theta.shape == sin_theta.shape == (4, 8)


@pytest.mark.parametrize("mode", [ROPE_TYPE_NORM, ROPE_TYPE_NEOX])
def test_float32_pairs_rotate_in_float32(mode):
    """ggml's ``rotate_pairs`` in float32: ``x_a c - x_b s`` and ``x_a s + x_b c`` with every
    product and sum rounded to float32 (no wider intermediate), ``s`` negated for the backward;
    the result has the input's dtype."""
    rng = np.random.default_rng(5)
    x = rng.standard_normal((6, 3, 20)).astype(np.float32)
    pos = rng.integers(-3000, 3000, 6)
    params = RopeParams(16, mode, attn_factor=0.9)
    if mode == ROPE_TYPE_NORM:
        a, b = np.s_[..., 0:16:2], np.s_[..., 1:16:2]
    else:
        a, b = np.s_[..., 0:8], np.s_[..., 8:16]
    cos_theta, sin_theta = rope_cache(pos, params)
    c = cos_theta[:, None, :]
    for op, s in ((rope_ext, sin_theta[:, None, :]), (rope_back, -sin_theta[:, None, :])):
        y = op(x, pos, params)
        assert y.dtype == np.float32
        np.testing.assert_array_equal(y[a], x[a] * c - x[b] * s)
        np.testing.assert_array_equal(y[b], x[a] * s + x[b] * c)
        np.testing.assert_array_equal(y[..., 16:], x[..., 16:])
        wide = (x[a].astype(np.float64) * c - x[b].astype(np.float64) * s).astype(np.float32)
        assert not np.array_equal(y[a], wide)  # the rounding of each step shows


def test_zero_n_dims_and_a_zero_context_compute_quietly():
    """``n_dims = 0`` (no pairs: ``-2/0`` in theta_scale, ``0 * log 0`` in the correction dims)
    and ggml_rope's ``n_ctx_orig = 0`` (``log 0 = -inf``; ``0/0`` with test-rope.cpp's zero
    betas) are legal arguments: rope copies or rotates as C does, without a floating-point
    warning."""
    x = np.random.default_rng(3).standard_normal((3, 2, 8))
    pos = np.array([0, 7, -2])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for dtype in (np.float32, np.float64):
            xd = x.astype(dtype)
            for mode in (ROPE_TYPE_NORM, ROPE_TYPE_NEOX):
                np.testing.assert_array_equal(rope_ext(xd, pos, RopeParams(0, mode)), xd)
                np.testing.assert_array_equal(rope_back(xd, pos, RopeParams(0, mode)), xd)
            for betas in (dict(), dict(beta_fast=0.0, beta_slow=0.0)):
                y = rope_ext(xd, pos, RopeParams(8, n_ctx_orig=0, **betas))
                np.testing.assert_allclose(head_norms(y), head_norms(xd), rtol=1e-6)
                assert not np.array_equal(y[1:], xd[1:])


def _yarn_angles_in_double(pos, n_dims, n_ctx_orig, freq_base, freq_scale, ext_factor,
                           beta_fast, beta_slow):
    """YaRN's angles from its formulas, in double: the closed form p b^(-2j/n), the correction
    dims of ggml_rope_yarn_corr_dims (math.log), the ramp, the blend."""
    def corr_dim(beta):
        return n_dims * math.log(n_ctx_orig / (beta * 2 * math.pi)) / (2 * math.log(freq_base))

    low = max(0.0, math.floor(corr_dim(beta_fast)))
    high = min(n_dims - 1.0, math.ceil(corr_dim(beta_slow)))
    j = np.arange(n_dims // 2)
    extrap = pos[:, None] * freq_base ** (-2.0 * j / n_dims)
    mix = (1.0 - np.clip((j - low) / max(0.001, high - low), 0.0, 1.0)) * ext_factor
    return freq_scale * extrap * (1.0 - mix) + extrap * mix


@pytest.mark.parametrize("n_ctx_orig", [4096, 17206])
@pytest.mark.parametrize("ext_factor", [1.0, 0.5])
def test_yarn_in_float64_is_its_formulas_in_double(n_ctx_orig, ext_factor):
    """float64 YaRN is computed in float64 all the way, correction dims and ramp included: at
    n_ctx_orig 17206 float32's correction dims would be (30, 55), double's are (30, 56)."""
    n_dims, base, scale, attn = 128, 10000.0, 0.25, 0.9
    x = np.random.default_rng(4).standard_normal((43, 1, n_dims))
    pos = np.arange(0, 43 * 97, 97)
    got = rope_ext(x, pos, RopeParams(n_dims, ROPE_TYPE_NORM, n_ctx_orig, base, scale,
                                      ext_factor, attn, 32.0, 1.0))
    theta = _yarn_angles_in_double(pos, n_dims, n_ctx_orig, base, scale, ext_factor, 32.0, 1.0)
    m = attn * (1.0 + 0.1 * math.log(1.0 / scale))
    z = (x[..., 0::2] + 1j * x[..., 1::2]) * m * np.exp(1j * theta)[:, None, :]
    np.testing.assert_allclose(got[..., 0::2], z.real, rtol=0, atol=1e-9)
    np.testing.assert_allclose(got[..., 1::2], z.imag, rtol=0, atol=1e-9)


def test_extra_leading_dims():
    x = np.random.default_rng(2).standard_normal((2, 4, 3, 16))  # (batch, n_tokens, ...)
    pos = np.array([3, 1, 4, 1])
    y = rope_ext(x, pos, RopeParams(12))
    assert np.array_equal(y[1], rope_ext(x[1], pos, RopeParams(12)))


def test_corr_dims_match_the_c_formula():
    # n_dims ln(n_ctx_orig / (2 pi beta)) / (2 ln b): 128 ln(4096/(64 pi))/(2 ln 1e4) = 20.94
    assert rope_yarn_corr_dims(128, 4096, 10000.0, 32.0, 1.0) == (20.0, 46.0)
    # low is clamped below at 0, high above at n_dims - 1 ...
    assert rope_yarn_corr_dims(8, 64, 10.0, 32.0, 1.0) == (0.0, 5.0)
    # ... but not the other way round: low may exceed high (then every pair extrapolates)
    assert rope_yarn_corr_dims(8, 1_000_000, 10.0, 32.0, 1.0) == (14.0, 7.0)
    # n_ctx_orig = 0 (ggml_rope's default): log(0) = -inf, exactly as in C
    assert rope_yarn_corr_dims(128, 0, 10000.0, 32.0, 1.0) == (0.0, -math.inf)


def ggml_rope_yarn_corr_dims(n_dims, n_ctx_orig, freq_base, beta_fast, beta_slow):
    """ggml's own ``ggml_rope_yarn_corr_dims`` (``ggml.c``), through ctypes."""
    fn = ggml_cpu().base.ggml_rope_yarn_corr_dims
    fn.argtypes = [ctypes.c_int, ctypes.c_int] + [ctypes.c_float] * 3 + [ctypes.c_void_p]
    fn.restype = None
    dims = np.zeros(2, np.float32)
    fn(n_dims, n_ctx_orig, freq_base, beta_fast, beta_slow, dims.ctypes.data)
    return float(dims[0]), float(dims[1])


@pytest.mark.oracle
@pytest.mark.parametrize(
    "args",
    [
        (128, 4096, 10000.0, 32.0, 1.0),
        (64, 2048, 500000.0, 32.0, 1.0),
        (8, 64, 10.0, 32.0, 1.0),  # low clamped at 0
        (8, 1_000_000, 10.0, 32.0, 1.0),  # high clamped at n_dims - 1, below low
        (4, 10_000_000, 10000.0, 32.0, 1.0),  # ceil d(beta_slow) = 4 = n_dims: clamped to 3
        # d(beta_slow) = 55.0000008 in double: float32's logf gives ceil 55, double would give 56
        (128, 17206, 10000.0, 32.0, 1.0),
        (128, 218548, 500000.0, 32.0, 1.0),  # the same at base 5e5: 51, not 52
        (128, 0, 10000.0, 32.0, 1.0),  # ggml_rope's n_ctx_orig = 0: (0, -inf)
        (128, 0, 10000.0, 0.0, 0.0),  # test-rope.cpp's betas: 0/0, NaN through MAX and MIN
        (0, 0, 10000.0, 32.0, 1.0),  # no rotated dims: 0 * log(0)
    ],
)
def test_corr_dims_match_ggml(args):
    np.testing.assert_array_equal(rope_yarn_corr_dims(*args), ggml_rope_yarn_corr_dims(*args))


def _ramp_in_c(low: float, high: float, i0: int, dt: type) -> float:
    """``rope_yarn_ramp`` of ``ops.cpp`` one pair at a time, every step in ``dt``:
    ``y = (i0 / 2 - low) / MAX(0.001f, high - low); return 1 - MIN(1, MAX(0, y))``."""
    y = (dt(i0 // 2) - dt(low)) / max(dt(0.001), dt(high) - dt(low))
    return dt(1) - min(dt(1), max(dt(0), y))


@given(low=st.floats(-4, 40, width=32), width=st.floats(0, 40, width=32),
       dtype=st.sampled_from([np.float32, np.float64]))
def test_yarn_ramp_is_computed_in_its_dtype_pair_by_pair(low, width, dtype):
    """Each step rounds to ``dtype`` (float32 in ggml) and so does the result: evaluating in
    double and rounding once differs for non-integer corrections."""
    high = low + width
    i0 = np.arange(0, 96, 2)
    got = rope_yarn_ramp(low, high, i0, dtype)
    assert got.dtype == dtype and got.shape == i0.shape
    expected = np.array([_ramp_in_c(low, high, i, dtype) for i in i0], dtype=dtype)
    np.testing.assert_array_equal(got, expected)


def test_yarn_ramp_at_a_non_integer_low():
    """The case that separates float32 from double: 1 - (7 - 0.3f) / (9.7f - 0.3f) is
    0.287234 in float32 and 0.28723404 when evaluated in double and rounded once."""
    got = rope_yarn_ramp(0.3, 9.7, np.array([14]))
    assert got.dtype == np.float32 and got[0] == np.float32(0.287234)


@pytest.mark.parametrize("op", [rope_ext, rope_back])
@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(n_dims=3), r"^n_dims must be even and in \[0, head_dim=16\], got 3$"),
        (dict(n_dims=18), "head_dim=16"),
        (dict(n_dims=-2), "even"),
        (dict(mode=1), r"^mode must be ROPE_TYPE_NORM \(0\) or ROPE_TYPE_NEOX \(2\), got 1 "
                       r"\(multi-section rope is not part of this specification\)$"),
        (dict(mode=8), "mode"),
        (dict(pos=np.arange(3)), r"pos must have shape \(n_tokens,\) = \(2,\)"),
        (dict(pos=np.array([0.0, 1.0])), "integer"),
        (dict(freq_factors=np.ones(3)), r"^freq_factors must have shape \(>= 4,\), got \(3,\)$"),
        (dict(freq_factors=np.ones((4, 1))), r"^freq_factors must have shape \(>= 4,\)"),
        (dict(x=np.ones((2, 16))), "n_tokens, n_head, head_dim"),
    ],
)
def test_errors(op, kwargs, match):
    """rope_ext and its backward refuse the same arguments, with the same messages."""
    args = dict(x=np.ones((2, 1, 16), np.float32), pos=np.arange(2), n_dims=8)
    args.update(kwargs)
    x, pos, freq_factors = args.pop("x"), args.pop("pos"), args.pop("freq_factors", None)
    with pytest.raises(RopeError, match=match) as info:
        op(x, pos, RopeParams(**args), freq_factors)
    assert isinstance(info.value, ValueError)


# --- oracle: ggml's own CPU rope, through the libggml that llama-cpp-python ships -------------


def ggml_rope_ext(x, pos, n_dims, mode, n_ctx_orig, freq_base, freq_scale, ext_factor,
                  attn_factor, beta_fast, beta_slow, freq_factors=None):
    """ggml's own ``ggml_rope_ext`` on its CPU backend (one thread), via
    tests/support/ggml_cpu.py."""
    x = np.ascontiguousarray(x, dtype=np.float32)  # (n_tokens, n_head, head_dim)
    pos = np.ascontiguousarray(pos, dtype=np.int32)
    if freq_factors is not None:
        freq_factors = np.ascontiguousarray(freq_factors, dtype=np.float32)
    params = (n_dims, mode, n_ctx_orig, freq_base, freq_scale, ext_factor, attn_factor,
              beta_fast, beta_slow)
    return ggml_cpu()("rope_ext", x, pos, freq_factors, params=params)


GGML_CASES = {
    "norm": dict(n_dims=128),
    "neox": dict(n_dims=128, mode=ROPE_TYPE_NEOX),
    "norm-partial-64": dict(n_dims=64),
    "neox-partial-96": dict(n_dims=96, mode=ROPE_TYPE_NEOX),
    "linear-0.25": dict(n_dims=128, freq_scale=0.25),
    "freq_factors": dict(n_dims=128, freq_factors="random"),
    "base-5e5-attn-0.9": dict(n_dims=128, mode=ROPE_TYPE_NEOX, freq_base=500000.0,
                              attn_factor=0.9),
    "yarn": dict(n_dims=128, ext_factor=1.0, freq_scale=0.25, n_ctx_orig=4096),
    "yarn-neox-half": dict(n_dims=128, mode=ROPE_TYPE_NEOX, ext_factor=0.5, freq_scale=0.125,
                           n_ctx_orig=2048, attn_factor=0.9, freq_base=500000.0),
    "yarn-ctx0": dict(n_dims=64, ext_factor=1.0, freq_scale=0.5),
    # correction dims (30, 55) in float32, (30, 56) in double: see test_corr_dims_match_ggml
    "yarn-corr-dims-float32": dict(n_dims=128, ext_factor=1.0, freq_scale=0.25,
                                   n_ctx_orig=17206),
}


@pytest.mark.oracle
@pytest.mark.parametrize("name", list(GGML_CASES))
def test_matches_ggml_cpu_rope(name):
    """Agreement with ggml's CPU rope to about one float32 ulp of the output.

    Not bit-exact, for two measured reasons: the compiler fuses ``x0*cos - x1*sin`` into
    ``fma(x0, cos, -(x1*sin))`` (and YaRN's blend into ``fma(theta_interp, 1 - r, ...)``),
    and glibc's ``cosf``/``sinf`` are not correctly rounded (~1% of values one ulp off).
    With YaRN the fused blend can round the angle differently: one ulp of the angle.
    """
    kw = dict(n_dims=128, mode=ROPE_TYPE_NORM, n_ctx_orig=0, freq_base=10000.0, freq_scale=1.0,
              ext_factor=0.0, attn_factor=1.0, beta_fast=32.0, beta_slow=1.0)
    kw.update(GGML_CASES[name])
    rng = np.random.default_rng(list(GGML_CASES).index(name))
    if kw.get("freq_factors") == "random":
        kw["freq_factors"] = rng.uniform(1.0, 8.0, kw["n_dims"] // 2).astype(np.float32)
    x = rng.uniform(-1.0, 1.0, (48, 4, 128)).astype(np.float32)
    for pos in (np.arange(48), np.arange(48) * 37 - 1000, rng.integers(-200_000, 200_000, 48)):
        pos = pos.astype(np.int32)
        want = ggml_rope_ext(x, pos, **kw)
        got = rope(x, pos, **kw)
        m = kw["attn_factor"] * (1.0 + 0.1 * math.log(1.0 / kw["freq_scale"]))
        tol = np.full(x.shape, 2.0**-22 * m)  # two ulps at |out| ~ 1
        if kw["ext_factor"] != 0.0:  # one ulp of the angle of each pair, on both dims of it
            theta = np.abs(pos).astype(np.float32)[:, None] * np.ones(kw["n_dims"] // 2, np.float32)
            tol_pair = 2.0 * m * np.spacing(theta)[:, None, :]  # (n_tokens, 1, n_dims/2)
            tol[..., : kw["n_dims"]] += np.repeat(tol_pair, 2, axis=-1)
        assert np.all(np.abs(got - want) <= tol), (name, np.abs(got - want).max())
        assert np.array_equal(got[..., kw["n_dims"]:], want[..., kw["n_dims"]:])


@pytest.mark.oracle
def test_ggml_itself_passes_test_rope_and_agrees_with_the_reference_on_it():
    """test-rope.cpp's construction through ggml itself; our r1 agrees with ggml's r1."""
    x = np.random.default_rng(0).uniform(-1.0, 1.0, (73, 32, 256)).astype(np.float32)
    i = np.arange(73, dtype=np.int32)
    kw = dict(n_ctx_orig=0, freq_base=10000.0, freq_scale=1.0, ext_factor=0.0, attn_factor=1.0,
              beta_fast=0.0, beta_slow=0.0)
    for mode in (ROPE_TYPE_NORM, ROPE_TYPE_NEOX):
        g0 = ggml_rope_ext(x, 100 + i, 128, mode, **kw)
        g1 = ggml_rope_ext(g0, np.full(73, -67, np.int32), 128, mode, **kw)
        g2 = ggml_rope_ext(x, 33 + i, 128, mode, **kw)
        assert np.abs(g1 - g2).astype(np.float64).sum() / np.abs(g1).sum() < 1e-4
        r1 = rope(rope(x, 100 + i, 128, mode, **kw), np.full(73, -67), 128, mode, **kw)
        assert np.abs(r1 - g1).max() <= 2 * 2.0**-22  # two ops, each within two ulps


# --- oracle: HF transformers (rotate_half, NEOX layout) ---------------------------------------


def _hf_apply(x, pos, n_dims, inv_freq, attention_scaling=1.0):
    """HF's recipe: freqs = pos * inv_freq, emb = cat(freqs, freqs), rotate_half; a partial
    rotation rotates x[..., :n_dims] and concatenates the rest (as HF's Phi / StableLM do)."""
    torch = pytest.importorskip("torch")
    llama = pytest.importorskip("transformers.models.llama.modeling_llama")
    dtype = torch.float64 if x.dtype == np.float64 else torch.float32
    xt = torch.from_numpy(x).to(dtype).transpose(0, 1)[None]  # (1, n_head, n_tokens, head_dim)
    freqs = torch.from_numpy(pos).to(dtype)[:, None] * inv_freq.to(dtype)[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)[None]  # (1, n_tokens, n_dims)
    cos, sin = emb.cos() * attention_scaling, emb.sin() * attention_scaling
    rot, rest = xt[..., :n_dims], xt[..., n_dims:]
    q_embed, _ = llama.apply_rotary_pos_emb(rot, rot, cos, sin, unsqueeze_dim=1)
    out = torch.cat((q_embed, rest), dim=-1)[0].transpose(0, 1)  # (n_tokens, n_head, head_dim)
    return out.numpy()


@pytest.mark.oracle
@given(rope_case(max_pos=8192))
def test_neox_matches_hf_rotate_half_float64(case):
    torch = pytest.importorskip("torch")
    x, pos, n_dims, params = case
    params.pop("freq_factors", None)
    base = params["freq_base"]
    # HF: inv_freq = 1 / base^(arange(0, dim, 2) / dim); linear scaling divides it by the factor
    inv_freq = 1.0 / (base ** (torch.arange(0, n_dims, 2, dtype=torch.float64) / n_dims))
    inv_freq = inv_freq * params["freq_scale"]
    want = _hf_apply(x, pos, n_dims, inv_freq)
    params["mode"] = ROPE_TYPE_NEOX
    got = rope(x, pos, n_dims, **params)
    # both angles are within ~4 eps relative of p b^(-2j/n) (ggml's recurrence, HF's pow)
    tol = 8 * 2.0**-52 * max(1.0, float(np.abs(pos).max())) * max(1.0, np.abs(x).max())
    assert np.abs(got - want).max() <= tol


@pytest.mark.oracle
@pytest.mark.parametrize("factor, orig, base", [(4.0, 4096, 10000.0), (8.0, 2048, 500000.0),
                                                (16.0, 8192, 1e6)])
def test_yarn_matches_hf_yarn(factor, orig, base):
    """HF's YaRN (rope_type "yarn") is ggml's with ext_factor 1, freq_scale 1/factor,
    n_ctx_orig = original_max_position_embeddings, beta 32/1: ramp, corr dims and mscale.
    HF computes its inv_freq in float32, hence the tolerance (angle ~ p * 1e-7)."""
    pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    from transformers.modeling_rope_utils import _compute_yarn_parameters

    head_dim = 64
    config = transformers.LlamaConfig(
        hidden_size=head_dim * 2, num_attention_heads=2, head_dim=head_dim,
        max_position_embeddings=int(orig * factor),
        rope_parameters=dict(rope_type="yarn", rope_theta=base, factor=factor,
                             original_max_position_embeddings=orig),
    )
    inv_freq, attention_factor = _compute_yarn_parameters(config)
    x = np.random.default_rng(0).standard_normal((32, 2, head_dim))
    pos = np.arange(0, 32 * 61, 61)
    want = _hf_apply(x, pos, head_dim, inv_freq.double(), attention_factor)
    got = rope_ext(x, pos, RopeParams(head_dim, ROPE_TYPE_NEOX, n_ctx_orig=orig, freq_base=base,
                                      freq_scale=1.0 / factor, ext_factor=1.0, attn_factor=1.0))
    assert np.abs(got - want).max() <= 2e-7 * pos.max() * np.abs(x).max()
    # and without YaRN's ramp (plain linear interpolation) the difference is large
    linear = rope_ext(x, pos, RopeParams(head_dim, ROPE_TYPE_NEOX, freq_base=base,
                                         freq_scale=1.0 / factor))
    assert np.abs(linear - want).max() > 0.1


# ---- graph_rope: one cos/sin cache per forward -------------------------------------------


@given(st.lists(st.integers(-5000, 100_000), min_size=1, max_size=12),
       st.sampled_from([ROPE_TYPE_NORM, ROPE_TYPE_NEOX]), st.sampled_from([np.float32, np.float64]),
       st.booleans(), st.booleans())
def test_graph_rope_is_rope_ext_bit_for_bit(pos, mode, dtype, yarn, factors):
    pos = np.array(pos, dtype=np.int32)
    rng = np.random.default_rng(len(pos))
    n_dims = 16
    params = RopeParams(n_dims, mode, n_ctx_orig=4096, freq_base=10000.0,
                        freq_scale=0.25 if yarn else 1.0, ext_factor=1.0 if yarn else 0.0,
                        attn_factor=1.0, beta_fast=32.0, beta_slow=1.0)
    freq_factors = rng.uniform(1, 8, n_dims // 2) if factors else None
    turn = graph_rope(pos, params, freq_factors)
    for n_head in (4, 2):  # a q and a k: the second call reuses the cache
        x = rng.standard_normal((len(pos), n_head, 20)).astype(dtype)  # 4 dims pass through
        out = turn(x)
        assert out.dtype == dtype
        np.testing.assert_array_equal(out, rope_ext(x, pos, params, freq_factors))
