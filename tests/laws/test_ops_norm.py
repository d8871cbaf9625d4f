"""norm and rms_norm: against a float64 formula, their invariances, ggml's double accumulation."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import assume, given
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from reference.ops import norm, rms_norm

rows = hnp.arrays(
    np.float64,
    hnp.array_shapes(min_dims=1, max_dims=3, min_side=2, max_side=16),
    elements=st.floats(-100, 100, allow_nan=False, width=64),
)
TINY = 1e-30  # eps small enough to vanish next to any mean square we draw, but not zero


def _rms_norm_f64(x: np.ndarray, eps: float) -> np.ndarray:
    x = x.astype(np.float64)
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps)


def _norm_f64(x: np.ndarray, eps: float) -> np.ndarray:
    x = x.astype(np.float64)
    y = x - x.mean(axis=-1, keepdims=True)
    return y / np.sqrt(np.mean(y * y, axis=-1, keepdims=True) + eps)


def _spread(x: np.ndarray) -> bool:
    """Every row has some size (rms) and some spread (std): the norms are well conditioned."""
    rms = np.sqrt(np.mean(x * x, axis=-1))
    return bool(np.all(rms > 1e-3) and np.all(x.std(axis=-1) > 1e-3 * (rms + 1)))


@given(rows, st.sampled_from([0.0, 1e-6, 1e-5, 0.5]))
def test_rms_norm_matches_the_formula_in_float64(x, eps):
    assume(np.all(np.mean(x * x, axis=-1) + eps > 1e-6))
    np.testing.assert_allclose(rms_norm(x, eps), _rms_norm_f64(x, eps), rtol=1e-13, atol=1e-15)


@given(rows, st.sampled_from([0.0, 1e-5, 0.5]))
def test_norm_matches_the_formula_in_float64(x, eps):
    assume(_spread(x))
    np.testing.assert_allclose(norm(x, eps), _norm_f64(x, eps), rtol=1e-10, atol=1e-12)


def test_float32_against_float64_formula():
    rng = np.random.default_rng(1)
    x = (rng.standard_normal((64, 4096)) * 3 + 0.5).astype(np.float32)
    for op, ref in [(rms_norm, _rms_norm_f64), (norm, _norm_f64)]:
        out = op(x, 1e-5)
        assert out.dtype == np.float32
        err = np.abs(out - ref(x, 1e-5)).max()
        assert err < 2e-6, (op.__name__, err)  # measured ~5e-7: float32 rounding only


def test_rms_norm_sums_in_double_like_ggml():
    """A long row whose squares a float32 running sum would absorb: ggml sums in double.

    One large value followed by many small ones: in float32, 4096**2 + 1 == 4096**2, so a
    float32 accumulator drops every small square; ggml_float (double) keeps them.
    """
    n = 1 << 20
    x = np.ones(n, dtype=np.float32)
    x[0] = 4096.0
    expected = _rms_norm_f64(x, 0.0)
    naive_sum = np.cumsum(x * x, dtype=np.float32)[-1]  # sequential float32 accumulation
    assert abs(naive_sum / n - 17.0) > 0.9  # 4096**2 + 1 == 4096**2: it lost ~1/17 of the sum
    np.testing.assert_allclose(rms_norm(x, 0.0), expected, rtol=1e-6)


@given(rows, st.floats(1e-3, 1e3))
def test_rms_norm_is_scale_invariant(x, c):
    assume(np.all(np.mean(x * x, axis=-1) > 1e-6))
    np.testing.assert_allclose(rms_norm(c * x, TINY), rms_norm(x, TINY), rtol=1e-12, atol=1e-14)


@given(rows, st.floats(1e-3, 1e3), st.floats(-50, 50))
def test_norm_is_scale_and_shift_invariant(x, c, shift):
    assume(_spread(x))
    base = norm(x, TINY)
    np.testing.assert_allclose(norm(c * x, TINY), base, rtol=1e-8, atol=1e-9)
    np.testing.assert_allclose(norm(x + shift, TINY), base, rtol=1e-8, atol=1e-9)


@given(rows)
def test_outputs_are_normalized(x):
    assume(_spread(x))
    y = rms_norm(x, TINY)
    np.testing.assert_allclose(np.mean(y * y, axis=-1), 1.0, rtol=1e-12)
    z = norm(x, TINY)
    np.testing.assert_allclose(np.mean(z, axis=-1), 0.0, atol=1e-12)
    np.testing.assert_allclose(np.mean(z * z, axis=-1), 1.0, rtol=1e-10)


def test_eps_bounds_the_gain_of_a_zero_row():
    x = np.zeros((2, 8), dtype=np.float32)
    np.testing.assert_array_equal(rms_norm(x, 1e-6), 0.0)
    np.testing.assert_array_equal(norm(x, 1e-6), 0.0)
    x[1] = 1e-4  # mean square 1e-8, much less than eps: output ~ x / sqrt(eps)
    np.testing.assert_allclose(rms_norm(x, 1e-6)[1], 1e-4 / np.sqrt(1e-6 + 1e-8), rtol=1e-6)


@pytest.mark.oracle
def test_norms_match_torch():
    torch = pytest.importorskip("torch")
    f = torch.nn.functional
    rng = np.random.default_rng(2)
    x = rng.standard_normal((5, 7, 96))
    t = torch.from_numpy(x)
    np.testing.assert_allclose(rms_norm(x, 1e-5), f.rms_norm(t, (96,), eps=1e-5).numpy(),
                               rtol=1e-12, atol=1e-14)
    np.testing.assert_allclose(norm(x, 1e-5), f.layer_norm(t, (96,), eps=1e-5).numpy(),
                               rtol=1e-12, atol=1e-14)


@pytest.mark.oracle
def test_norms_match_ggml_cpu():
    """ggml itself (llama-cpp-python's libggml-cpu): rms_norm bit-exact, norm to the last bit."""
    from tests.support.ggml_cpu import ggml_cpu

    ggml = ggml_cpu()
    rng = np.random.default_rng(12)
    x = (rng.standard_normal((3, 5, 576)) * 4 + 1).astype(np.float32)  # SmolLM2's n_embd
    np.testing.assert_array_equal(ggml("rms_norm", x, params=(1e-5,)), rms_norm(x, 1e-5))
    # bit-exact on this machine; ggml_vec_cvar_f32 adds SIMD partial sums whose width depends
    # on the CPU (SSE/AVX2/AVX512), so allow last-bit differences elsewhere
    np.testing.assert_allclose(ggml("norm", x, params=(1e-5,)), norm(x, 1e-5), rtol=0, atol=1e-6)
