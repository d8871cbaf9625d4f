r"""The backward ops and the Llama gradient: finite differences, torch autograd, transformers.

- Every op's backward against central finite differences in float64: for a random upstream
  gradient $G$, $\partial/\partial x_i \sum (f(x) \odot G)$ by $(L(x + h e_i) - L(x - h e_i)) /
  2h$ with $h = 10^{-6}$; the verdict is ``max|fd - ours| <= 1e-6 * max|fd|`` (truncation error
  $O(h^2)$ and cancellation $O(\epsilon / h)$ are both ~1e-10 relative here).
- The same backward against torch autograd on a float64 torch transcription of the forward
  (``oracle``), to ``1e-10`` relative.
- The whole model: our gradient of every tensor against transformers' ``loss.backward()`` on
  the same weights (``save_tiny_hf`` then ``load_hf``; HF's q/k rows are permuted for the
  interleaved RoPE, so their gradients are permuted alike) and the same tokens, with
  transformers in **float32**: even a float64 transformers model computes its RMS norms, its
  softmax and its RoPE tables in float32 (``LlamaRMSNorm`` casts to float32,
  ``eager_attention_forward`` takes the softmax in float32, ``LlamaRotaryEmbedding`` forces
  float32 angles), so float64 would not be tighter. Our gradient, in float64 and in float32,
  must agree to 1e-4 relative per tensor (max abs error over max abs value): float32 rounding
  (~6e-8 per op) amplified through two blocks, a softmax and the vocabulary's cross-entropy
  stays around 1e-6 (measured), so 1e-4 leaves margin and still catches any wrong formula,
  whose error is O(1). Exactness to rounding is the finite-difference test's job (float64).
"""

from __future__ import annotations

import ctypes
import re

import numpy as np
import pytest
from hypothesis import example, given
from hypothesis import strategies as st

from reference.hf import gguf_tensor_name, load_hf, permute
from reference.ops import (
    ROPE_TYPE_NEOX,
    ROPE_TYPE_NORM,
    add,
    build_attn_mha,
    cross_entropy_loss,
    cross_entropy_loss_back,
    get_rows,
    get_rows_back,
    mul,
    mul_mat,
    rms_norm,
    rope_back,
    rope_ext,
    scale,
    silu,
    soft_max_ext,
    soft_max_ext_back,
    swiglu,
)
from reference.ops.errors import OpIndexError, OpShapeError, OpValueError
from reference.ops.rope import RopeParams, rope_cache_init, rope_yarn_corr_dims
from reference.testing import random_weights, reference_logits, tiny_hparams
from reference.training.errors import TrainGraphError
from reference.training.grad import (
    add_back,
    attn_back,
    mul_back,
    mul_mat_back,
    rms_norm_back,
    scale_back,
    silu_back,
    swiglu_back,
)
from reference.training.llama_grad import loss_and_grads, train_forward
from tests.support.tiny_models import save_tiny_hf

H = 1e-6
FD_RTOL = 1e-6
TORCH_RTOL = 1e-10


def _fd(loss, x: np.ndarray) -> np.ndarray:
    """Central finite differences of the scalar ``loss`` at ``x`` (float64), every element."""
    out = np.zeros_like(x)
    for i in np.ndindex(x.shape):
        xp, xm = x.copy(), x.copy()
        xp[i] += H
        xm[i] -= H
        out[i] = (loss(xp) - loss(xm)) / (2 * H)
    return out


def _close(ours: np.ndarray, ref: np.ndarray, rtol: float) -> None:
    assert ours.shape == ref.shape
    err = np.max(np.abs(ours - ref)) if ours.size else 0.0
    assert err <= rtol * max(np.max(np.abs(ref)), 1e-12), (err, np.max(np.abs(ref)))


def _check_fd(f, args: list, i: int, grad_out: np.ndarray, ours: np.ndarray) -> None:
    """``ours`` is the gradient of ``sum(f(*args) * grad_out)`` for ``args[i]``."""

    def loss(x):
        a = list(args)
        a[i] = x
        return float(np.sum(f(*a) * grad_out))

    _close(ours, _fd(loss, args[i]), FD_RTOL)


def _rng(seed: int) -> np.random.Generator:
    return np.random.default_rng(seed)


seeds = st.integers(0, 2**32 - 1)


# ---------------------------------------------------------------------------------------------
# each op's backward against finite differences (float64)


@given(seeds, st.integers(1, 6), st.integers(2, 5), st.integers(1, 4))
def test_get_rows_back_is_a_scatter_add(seed, n, n_rows, n_cols):
    rng = _rng(seed)
    a = rng.standard_normal((n_rows, n_cols))
    rows = rng.integers(0, n_rows, n)  # repeats and misses on purpose
    g = rng.standard_normal((n, n_cols))
    _check_fd(get_rows, [a, rows], 0, g, get_rows_back(g, rows, n_rows))


@given(seeds, st.sampled_from([((3, 4), (4,)), ((2, 6), (1, 3)), ((4, 2), (2, 2)), ((3,), (3,))]))
def test_add_mul_scale_back(seed, shapes):
    rng = _rng(seed)
    a, b = rng.standard_normal(shapes[0]), rng.standard_normal(shapes[1])
    g = rng.standard_normal(shapes[0])
    ga, gb = add_back(g, b.shape)
    _check_fd(add, [a, b], 0, g, ga)
    _check_fd(add, [a, b], 1, g, gb)
    ga, gb = mul_back(g, a, b)
    _check_fd(mul, [a, b], 0, g, ga)
    _check_fd(mul, [a, b], 1, g, gb)
    _check_fd(scale, [a, 0.7], 0, g, scale_back(g, 0.7))


@given(seeds, st.integers(1, 4), st.integers(2, 8), st.sampled_from([0.0, 1e-5, 0.3]))
def test_rms_norm_back(seed, n_rows, n, eps):
    rng = _rng(seed)
    x = rng.standard_normal((n_rows, n)) + 0.1
    g = rng.standard_normal((n_rows, n))
    _check_fd(rms_norm, [x, eps], 0, g, rms_norm_back(g, x, eps))


# (a's shape, b's shape): plain, one block per matrix, GQA-style blocks of 2 and 3
MUL_MAT_SHAPES = [
    ((3, 4), (2, 4)),
    ((2, 3, 4), (2, 5, 4)),
    ((2, 3, 4), (4, 2, 4)),
    ((1, 2, 2, 3), (2, 6, 1, 3)),
]


@given(seeds, st.sampled_from(MUL_MAT_SHAPES))
def test_mul_mat_back_with_block_broadcast(seed, shapes):
    rng = _rng(seed)
    a, b = rng.standard_normal(shapes[0]), rng.standard_normal(shapes[1])
    g = rng.standard_normal(mul_mat(a, b).shape)
    ga, gb = mul_mat_back(g, a, b)
    _check_fd(mul_mat, [a, b], 0, g, ga)
    _check_fd(mul_mat, [a, b], 1, g, gb)


ROPE_CASES = [
    dict(n_dims=4, mode=ROPE_TYPE_NORM),
    dict(n_dims=4, mode=ROPE_TYPE_NEOX, freq_base=500.0),
    dict(n_dims=2, mode=ROPE_TYPE_NORM, attn_factor=0.8),  # partial rotation: dims 2, 3 pass
    dict(n_dims=4, mode=ROPE_TYPE_NEOX, freq_scale=0.25, ext_factor=1.0, n_ctx_orig=16),
    dict(n_dims=4, mode=ROPE_TYPE_NORM, freq_factors=np.array([1.0, 3.0])),
]


@given(seeds, st.sampled_from(range(len(ROPE_CASES))))
def test_rope_back_is_the_inverse_rotation(seed, case):
    kw = dict(ROPE_CASES[case])
    ff = kw.pop("freq_factors", None)
    params = RopeParams(**kw)
    rng = _rng(seed)
    x = rng.standard_normal((3, 2, 4))  # (n_tokens, n_head, head_dim)
    pos = rng.integers(-5, 40, 3)
    g = rng.standard_normal(x.shape)
    ours = rope_back(g, pos, params, ff)
    _check_fd(lambda x_: rope_ext(x_, pos, params, ff), [x], 0, g, ours)
    # the transpose of a rotation by theta is the rotation by -theta, bit for bit
    assert np.array_equal(ours, rope_ext(g, -pos, params, ff))
    g32 = g.astype(np.float32)
    assert np.array_equal(rope_back(g32, pos, params, ff), rope_ext(g32, -pos, params, ff))


@given(seeds, st.integers(1, 3), st.integers(1, 4), st.sampled_from([1.0, 0.35]))
def test_soft_max_ext_back_with_scale_and_mask(seed, n_head, n_tokens, kq_scale):
    rng = _rng(seed)
    n_kv = n_tokens + 1
    x = rng.standard_normal((n_head, n_tokens, n_kv))
    mask = np.triu(np.full((n_tokens, n_kv), -np.inf), 2)  # causal, one cell of history
    g = rng.standard_normal(x.shape)
    y = soft_max_ext(x, mask, kq_scale)
    ours = soft_max_ext_back(g, y, kq_scale)
    _check_fd(lambda x_: soft_max_ext(x_, mask, kq_scale), [x], 0, g, ours)
    assert np.all(ours[..., np.isinf(mask)] == 0)  # a hidden key gets no gradient


@given(seeds, st.integers(1, 12))
def test_silu_and_swiglu_back(seed, n):
    rng = _rng(seed)
    a, b = 3 * rng.standard_normal((2, n)), rng.standard_normal((2, n))
    g = rng.standard_normal((2, n))
    _check_fd(silu, [a], 0, g, silu_back(g, a))
    ga, gb = swiglu_back(g, a, b)
    _check_fd(swiglu, [a, b], 0, g, ga)
    _check_fd(swiglu, [a, b], 1, g, gb)


# (n_tokens, n_head, n_head_kv, d_k, d_v)
ATTN_SHAPES = [(3, 2, 2, 2, 2), (4, 4, 2, 2, 3), (3, 3, 1, 2, 2), (1, 2, 1, 3, 1)]


@given(seeds, st.sampled_from(ATTN_SHAPES))
def test_attn_back_with_gqa(seed, shape):
    n_tokens, n_head, n_head_kv, d_k, d_v = shape
    rng = _rng(seed)
    q = rng.standard_normal((n_tokens, n_head, d_k))
    k = rng.standard_normal((n_tokens, n_head_kv, d_k))
    v = rng.standard_normal((n_tokens, n_head_kv, d_v))
    mask = np.triu(np.full((n_tokens, n_tokens), -np.inf), 1)
    g = rng.standard_normal((n_tokens, n_head * d_v))
    grads = attn_back(g, q, k, v, mask, 0.6)
    args = [q, k, v, mask, 0.6]
    for i in range(3):
        _check_fd(build_attn_mha, args, i, g, grads[i])


@given(seeds, st.integers(1, 4), st.integers(2, 6), st.booleans())
def test_cross_entropy_loss_back(seed, n_rows, n_classes, one_hot):
    rng = _rng(seed)
    z = 2 * rng.standard_normal((n_rows, n_classes))
    if one_hot:
        labels = np.eye(n_classes)[rng.integers(0, n_classes, n_rows)]
    else:
        labels = rng.dirichlet(np.ones(n_classes), n_rows)  # soft labels, rows sum to 1
    ours = cross_entropy_loss_back(1.5, z, labels)
    _check_fd(lambda z_: cross_entropy_loss(z_, labels), [z], 0, np.float64(1.5), ours)


def test_cross_entropy_loss_is_the_mean_negative_log_likelihood():
    z = np.array([[2.0, 0.0, -1.0], [0.0, 0.0, 0.0]])
    labels = np.eye(3)[[0, 2]]
    expected = -(np.log(np.exp(2) / (np.exp(2) + 1 + np.exp(-1))) + np.log(1 / 3)) / 2
    assert abs(cross_entropy_loss(z, labels) - expected) < 1e-15


def test_bad_inputs_raise_typed_errors():
    g = np.ones((2, 3))
    with pytest.raises(OpIndexError, match="out of range"):
        get_rows_back(g, np.array([0, 5]), 4)
    with pytest.raises(OpShapeError):
        get_rows_back(g, np.array([0]), 4)
    with pytest.raises(OpValueError, match="ALiBi"):
        soft_max_ext_back(g, g, 1.0, max_bias=8.0)
    with pytest.raises(OpShapeError):
        rms_norm_back(g, np.ones((3, 2)), 1e-5)
    with pytest.raises(OpShapeError):
        mul_mat_back(np.ones((2, 2)), np.ones((3, 4)), np.ones((2, 4)))
    with pytest.raises(OpShapeError):
        cross_entropy_loss(np.ones((2, 3)), np.ones((2, 4)))


def test_cross_entropy_takes_only_one_2d_shape():
    for shape in [(4,), (1, 2, 3)]:  # the same shape for both, but not (n_rows, n_classes)
        with pytest.raises(OpShapeError, match="must both be"):
            cross_entropy_loss(np.ones(shape), np.ones(shape))
        with pytest.raises(OpShapeError, match="must both be"):
            cross_entropy_loss_back(1.0, np.ones(shape), np.ones(shape))


def test_cross_entropy_shape_errors_name_the_op_and_both_shapes():
    got = "got logits.shape=(2, 3), labels.shape=(2, 4)"
    for name, call in [
        ("cross_entropy_loss", lambda z, y: cross_entropy_loss(z, y)),
        ("cross_entropy_loss_back", lambda z, y: cross_entropy_loss_back(1.0, z, y)),
    ]:
        message = f"{name}: logits and labels must both be (n_rows, n_classes); {got}"
        with pytest.raises(OpShapeError, match="^" + re.escape(message) + "$"):
            call(np.ones((2, 3)), np.ones((2, 4)))


@given(seeds, st.integers(2, 4), st.integers(2, 6), st.sampled_from([np.float32, np.float64]))
def test_cross_entropy_ignores_a_constant_added_to_a_row(seed, n_rows, n_classes, dtype):
    """Each row counts only through its differences, even shifted far past exp's range.

    The logits are multiples of 1/8 and the shifts +-1024, so the shifted logits are exact and
    ``z - max z`` is the same bit for bit: so must the loss and its gradient be. A row's own max
    keeps ``exp`` finite: e^2048 overflows, and e^-2048 (a row 2048 below another) underflows.
    """
    rng = _rng(seed)
    z = (rng.integers(-16, 17, (n_rows, n_classes)) / 8).astype(dtype)
    labels = rng.dirichlet(np.ones(n_classes), n_rows).astype(dtype)
    shifted = z + (1024 * (-1) ** np.arange(n_rows))[:, None].astype(dtype)
    assert cross_entropy_loss(shifted, labels) == cross_entropy_loss(z, labels)
    np.testing.assert_array_equal(cross_entropy_loss_back(1.5, shifted, labels),
                                  cross_entropy_loss_back(1.5, z, labels))


def test_cross_entropy_float32_sums_the_softmax_denominator_in_double():
    """One class at 1 and 1023 each below half an ulp of 1: a float32 sum would drop some.

    ggml accumulates ``sum(exp(z - max))`` in ``ggml_float`` (double): every tiny term counts,
    and the loss of the big class, ``log(sum)`` ~ 5e-5, is off by no more than the rounding of
    the sum to float (an ulp of 1, 1.2e-7) where a float32 accumulator that starts at 1 drops
    whole runs of the 5e-8 terms (7.6e-7 here).
    """
    z = np.full((1, 1024), -16.8, dtype=np.float32)  # e^-16.8 ~ 5.1e-8 < 2**-24
    z[0, 0] = 0.0
    labels = np.eye(1024, dtype=np.float32)[[0]]
    total = np.sum(np.exp(z.astype(np.float64)))
    loss = cross_entropy_loss(z, labels)
    assert loss.dtype == np.float32
    assert abs(loss - np.log(total)) < 1.5e-7
    grad = cross_entropy_loss_back(1.0, z, labels)
    assert grad.dtype == np.float32
    expected = np.exp(z.astype(np.float64)) / total - labels
    assert np.abs(grad - expected).max() < 1.5e-7  # the big class's 1/sum - 1, to ~1 ulp of 1


def test_cross_entropy_loss_back_rounds_each_step_to_float32_like_ggml():
    """All-zero logits: the softmax is exactly float32(1/3); then the float32 steps of ggml.

    ``ggml_vec_scale_f32(1.0/sum)`` scales by the float of the double reciprocal, then
    ``ggml_vec_sub_f32`` subtracts the labels and ``ggml_vec_scale_f32(d_by_nr)`` scales, each
    rounded to float32; in double, ``(1/3 - 1) * 1.5`` would round to -1 instead.
    """
    f = np.float32
    third = f(1.0 / 3.0)
    expected = np.array([[(third - f(1)) * f(1.5), third * f(1.5), third * f(1.5)]])
    ours = cross_entropy_loss_back(1.5, np.zeros((1, 3), f), np.eye(3, dtype=f)[[0]])
    assert ours.dtype == np.float32
    np.testing.assert_array_equal(ours, expected)
    assert ours[0, 0] != f(-1.0)


def test_cross_entropy_loss_sums_each_row_over_the_classes_in_double():
    """Soft labels: one big term and 1023 each below half an ulp of it, summed in double.

    ggml rounds each ``label * log_softmax`` to float (``ggml_vec_mul_f32``) and adds them in
    ``ggml_float`` (``ggml_vec_sum_f32``); a float32 sum would drop some small terms (~2 ulps).
    All-zero logits make every log-softmax ``-logf(1024)``.
    """
    labels = np.full((1, 1024), 1e-8, dtype=np.float32)  # 6.9e-8 terms; half an ulp of 6.9: 2.4e-7
    labels[0, 0] = 1 - 1023e-8
    terms = -np.float32(np.log(1024.0)) * labels  # float32 products
    expected = -np.float32(np.sum(terms, dtype=np.float64))
    assert cross_entropy_loss(np.zeros((1, 1024), np.float32), labels) == expected
    assert np.float32(np.sum(terms)) != -expected  # float32's own sum is not it


def test_cross_entropy_loss_subtracts_the_log_sum_in_float32():
    """``ggml_vec_log_soft_max_f32`` by hand: ``(x - max) - logf(sum)``, each rounded to float.

    Here the difference rounded once from double (``x - max - log(sum)``) is one ulp away.
    """
    f = np.float32
    z = np.array([[0.0, -1.0625, 1.0, 0.25]], f)
    shifted = z[0] - z.max()
    total = np.sum(np.exp(shifted.astype(np.float64)).astype(f), dtype=np.float64)  # expf
    log_sum = f(np.log(np.float64(f(total))))  # logf of the float sum
    expected = -(shifted[1] - log_sum)
    assert cross_entropy_loss(z, np.eye(4, dtype=f)[[1]]) == expected
    assert f(np.log(total) - shifted[1]) != expected


@given(seeds, st.booleans())
def test_cross_entropy_takes_the_labels_in_the_precision_of_the_logits(seed, one_hot):
    """float64 labels with float32 logits: the same as the labels rounded to float32 first."""
    rng = _rng(seed)
    z = (3 * rng.standard_normal((3, 7))).astype(np.float32)
    labels = np.eye(7)[rng.integers(0, 7, 3)] if one_hot else rng.dirichlet(np.ones(7), 3)
    labels32 = labels.astype(np.float32)
    assert cross_entropy_loss(z, labels) == cross_entropy_loss(z, labels32)
    back = cross_entropy_loss_back(1.5, z, labels)
    assert back.dtype == np.float32
    np.testing.assert_array_equal(back, cross_entropy_loss_back(1.5, z, labels32))


@given(seeds, st.integers(2, 7), st.integers(2, 60), st.booleans())
@example(seed=4, n_rows=7, n_classes=50, one_hot=True)  # a case where the order shows
def test_cross_entropy_loss_accumulates_the_rows_in_order(seed, n_rows, n_classes, one_hot):
    """The mean over rows is a float32 running sum of the rows' losses, like ggml's one thread.

    ``ggml_compute_forward_cross_entropy_loss_f32`` adds each row's sum to a float, in row order,
    then scales by ``-1/nr``; so the loss of n rows is the running float32 sum of the one-row
    losses times ``1/n``, bit for bit (up to 7 rows, where NumPy's sum is sequential too).
    """
    rng = _rng(seed)
    z = (4 * rng.standard_normal((n_rows, n_classes))).astype(np.float32)
    if one_hot:
        labels = np.eye(n_classes, dtype=np.float32)[rng.integers(0, n_classes, n_rows)]
    else:
        labels = rng.dirichlet(np.ones(n_classes), n_rows).astype(np.float32)
    running = np.float32(0)
    for i in range(n_rows):
        running = running + cross_entropy_loss(z[i : i + 1], labels[i : i + 1])
    assert cross_entropy_loss(z, labels) == running * (np.float32(1) / np.float32(n_rows))


# ---------------------------------------------------------------------------------------------
# the whole model against finite differences (float64)


@pytest.mark.parametrize("kw", [dict(), dict(tied=True, n_head_kv=1), dict(arch="qwen2"),
                                dict(n_swa=3), dict(rope_freqs=True)])
def test_model_gradient_matches_finite_differences(kw):
    rope_freqs = kw.pop("rope_freqs", False)
    hp = tiny_hparams(n_layer=2, **kw)
    w = random_weights(hp, seed=1, dtype=np.float64, out_ffn_bias=True)
    if rope_freqs:  # Llama 3's frequency factors: they change the forward, get no gradient
        w["rope_freqs.weight"] = np.array([1.0, 4.0])
    tokens, labels = np.array([1, 4, 9, 3, 7]), np.array([4, 9, 3, 7, 2])
    loss, grads, _ = loss_and_grads(w, hp, tokens, labels)
    rng = _rng(2)
    for name, tensor in grads.items():
        i = tuple(rng.integers(0, s) for s in tensor.shape)  # one element of every tensor

        def at(delta, name=name, i=i):
            moved = dict(w)
            moved[name] = w[name].copy()
            moved[name][i] += delta
            return loss_and_grads(moved, hp, tokens, labels)[0]

        fd = (at(1e-5) - at(-1e-5)) / 2e-5
        assert abs(fd - grads[name][i]) <= 1e-6 * max(abs(fd), np.abs(grads[name]).max())
    assert set(grads) == set(w) - {"rope_freqs.weight"}


@pytest.mark.parametrize("kw", [dict(), dict(n_swa=2), dict(arch="qwen2")])
def test_train_forward_is_the_inference_forward(kw):
    hp = tiny_hparams(n_layer=2, **kw)
    w = random_weights(hp, seed=4, dtype=np.float64)
    w["rope_freqs.weight"] = np.array([1.0, 2.0])
    tokens = [3, 1, 4, 1, 5, 9]
    logits, tape = train_forward(w, hp, np.array(tokens))
    assert np.abs(logits - reference_logits(w, hp, tokens)).max() < 1e-12
    assert len(tape.layers) == 2 and tape.layers[0].kq_mask.shape == (6, 6)


def test_opt_period_scales_loss_and_gradient():
    hp = tiny_hparams(n_layer=1)
    w = random_weights(hp, seed=5, dtype=np.float64)
    l1, g1, _ = loss_and_grads(w, hp, [1, 2, 3], [2, 3, 4])
    l4, g4, _ = loss_and_grads(w, hp, [1, 2, 3], [2, 3, 4], opt_period=4)
    assert abs(l4 - l1 / 4) < 1e-15
    assert all(np.allclose(g4[n], g1[n] / 4, rtol=1e-14, atol=0) for n in g1)
    with pytest.raises(TrainGraphError, match="labels"):
        loss_and_grads(w, hp, [1, 2, 3], [2, 3, 99])
    with pytest.raises(TrainGraphError, match="opt_period"):
        loss_and_grads(w, hp, [1, 2, 3], [2, 3, 4], opt_period=0)


# ---------------------------------------------------------------------------------------------
# each op's backward against torch autograd (float64)


def _torch_grads(torch, f, args: list, grad_out: np.ndarray, which: list[int]) -> list:
    """torch autograd of ``sum(f(*args) * grad_out)`` for ``args[i]``, ``i`` in ``which``."""
    ts = [torch.tensor(a, dtype=torch.float64, requires_grad=i in which)
          if isinstance(a, np.ndarray) and a.dtype.kind == "f" else a for i, a in enumerate(args)]
    (f(*ts) * torch.tensor(grad_out)).sum().backward()
    return [ts[i].grad.numpy() for i in which]


@pytest.mark.oracle
def test_op_backwards_match_torch_autograd():
    torch = pytest.importorskip("torch")
    rng = _rng(7)
    g34 = rng.standard_normal((3, 4))
    a, b = rng.standard_normal((3, 4)), rng.standard_normal((4,))
    # get_rows
    table = rng.standard_normal((5, 4))
    rows = np.array([4, 0, 4])
    (ref,) = _torch_grads(torch, lambda t: t[torch.tensor(rows)], [table], g34, [0])
    _close(get_rows_back(g34, rows, 5), ref, TORCH_RTOL)
    # add, mul (b tiled over the rows), scale
    ga, gb = _torch_grads(torch, lambda x, y: x + y, [a, b], g34, [0, 1])
    _close(add_back(g34, b.shape)[1], gb, TORCH_RTOL)
    ga, gb = _torch_grads(torch, lambda x, y: x * y, [a, b], g34, [0, 1])
    ours = mul_back(g34, a, b)
    _close(ours[0], ga, TORCH_RTOL)
    _close(ours[1], gb, TORCH_RTOL)
    # rms_norm
    (ref,) = _torch_grads(
        torch, lambda x: x * torch.rsqrt((x * x).mean(-1, keepdim=True) + 1e-5), [a], g34, [0]
    )
    _close(rms_norm_back(g34, a, 1e-5), ref, TORCH_RTOL)
    # silu, swiglu
    ga, gb = _torch_grads(torch, lambda x, y: torch.nn.functional.silu(x) * y, [a, g34.copy()],
                          g34, [0, 1])
    ours = swiglu_back(g34, a, g34.copy())
    _close(ours[0], ga, TORCH_RTOL)
    _close(ours[1], gb, TORCH_RTOL)
    # mul_mat with GQA blocks: a's matrix i serves b's matrices 2i, 2i + 1
    ma, mb = rng.standard_normal((2, 3, 4)), rng.standard_normal((4, 5, 4))
    gm = rng.standard_normal((4, 5, 3))
    ga, gb = _torch_grads(
        torch, lambda x, y: y @ x.repeat_interleave(2, dim=0).transpose(-1, -2), [ma, mb], gm,
        [0, 1],
    )
    ours = mul_mat_back(gm, ma, mb)
    _close(ours[0], ga, TORCH_RTOL)
    _close(ours[1], gb, TORCH_RTOL)


@pytest.mark.oracle
def test_rope_softmax_attention_loss_backwards_match_torch_autograd():
    torch = pytest.importorskip("torch")
    rng = _rng(8)
    # rope (NEOX halves) through our own cos/sin cache
    x = rng.standard_normal((3, 2, 6))
    pos = np.array([0, 7, 31])
    g = rng.standard_normal(x.shape)
    corr = rope_yarn_corr_dims(4, 0, 10000.0, 32.0, 1.0, np.float64)
    c, s = (torch.tensor(t)[:, None, :] for t in
            rope_cache_init(pos, 4, 10000.0, 1.0, None, corr, 0.0, 1.0, np.float64))

    def rope_neox(t):
        x0, x1, rest = t[..., :2], t[..., 2:4], t[..., 4:]
        return torch.cat([x0 * c - x1 * s, x0 * s + x1 * c, rest], dim=-1)

    (ref,) = _torch_grads(torch, rope_neox, [x], g, [0])
    _close(rope_back(g, pos, RopeParams(n_dims=4, mode=ROPE_TYPE_NEOX)), ref, TORCH_RTOL)
    # softmax with scale and mask
    kq = rng.standard_normal((2, 3, 3))
    mask = np.triu(np.full((3, 3), -np.inf), 1)
    gk = rng.standard_normal(kq.shape)
    (ref,) = _torch_grads(
        torch, lambda t: torch.softmax(0.3 * t + torch.tensor(mask), dim=-1), [kq], gk, [0]
    )
    _close(soft_max_ext_back(gk, soft_max_ext(kq, mask, 0.3), 0.3), ref, TORCH_RTOL)
    # attention with GQA: 4 query heads on 2 KV heads, picoGPT's one line per head
    q, k, v = (rng.standard_normal((5, n, 3)) for n in (4, 2, 2))
    causal = np.triu(np.full((5, 5), -np.inf), 1)
    go = rng.standard_normal((5, 12))

    def attention(q_, k_, v_):
        kk, vv = (t.repeat_interleave(2, dim=1).transpose(0, 1) for t in (k_, v_))
        p = torch.softmax(0.5 * q_.transpose(0, 1) @ kk.transpose(1, 2) + torch.tensor(causal), -1)
        return (p @ vv).transpose(0, 1).reshape(5, 12)

    refs = _torch_grads(torch, attention, [q, k, v], go, [0, 1, 2])
    for ours, ref in zip(attn_back(go, q, k, v, causal, 0.5), refs, strict=True):
        _close(ours, ref, TORCH_RTOL)
    # cross-entropy, mean over rows
    z = rng.standard_normal((4, 7))
    labels = rng.integers(0, 7, 4)
    zt = torch.tensor(z, requires_grad=True)
    torch.nn.functional.cross_entropy(zt, torch.tensor(labels)).backward()
    onehot = np.eye(7)[labels]
    _close(cross_entropy_loss_back(1.0, z, onehot), zt.grad.numpy(), TORCH_RTOL)
    assert abs(cross_entropy_loss(z, onehot) - torch.nn.functional.cross_entropy(
        torch.tensor(z), torch.tensor(labels)).item()) < 1e-14


def _ggml_with_loss_ops():
    """ggml's CPU backend (see ``tests.support.ggml_cpu``) with the two loss ops declared."""
    from tests.support.ggml_cpu import ggml_cpu

    ggml = ggml_cpu()
    for name, n_args in [("ggml_cross_entropy_loss", 3), ("ggml_cross_entropy_loss_back", 4)]:
        fn = getattr(ggml.base, name)
        fn.argtypes, fn.restype = [ctypes.c_void_p] * n_args, ctypes.c_void_p
    return ggml


@pytest.mark.oracle
def test_cross_entropy_matches_ggml_cpu():
    """ggml itself: the loss bit-exact, its gradient to a few float32 ulps.

    The loss takes C's ``expf`` and ``logf`` of single values, sums each row in double and, up
    to 7 rows, adds the rows in order as NumPy does. The gradient's softmax goes through
    ggml's SIMD ``ggml_v_expf``, which may differ from ``expf`` in the last bit.
    """
    ggml = _ggml_with_loss_ops()
    rng = _rng(13)
    for n_rows, n_classes in [(1, 3), (3, 7), (5, 100), (7, 1000), (4, 5000)]:
        z = (3 * rng.standard_normal((n_rows, n_classes))).astype(np.float32)
        onehot = np.eye(n_classes, dtype=np.float32)[rng.integers(0, n_classes, n_rows)]
        soft = rng.dirichlet(np.full(n_classes, 0.3), n_rows).astype(np.float32)
        assert ggml("cross_entropy_loss", z, onehot)[0, 0] == cross_entropy_loss(z, onehot)
        assert ggml("cross_entropy_loss", z, soft)[0, 0] == cross_entropy_loss(z, soft)
        for labels in (onehot, soft):
            ref = ggml("cross_entropy_loss_back", np.array([1.5], np.float32), z, labels)
            ours = cross_entropy_loss_back(1.5, z, labels)
            assert ours.dtype == np.float32
            assert np.abs(ours - ref).max() <= 4e-7 * np.abs(ref).max()
    # all-zero logits: expf(0) = 1 exactly, so here the gradient is bit-exact too
    z, onehot = np.zeros((2, 3), np.float32), np.eye(3, dtype=np.float32)[[0, 2]]
    np.testing.assert_array_equal(
        ggml("cross_entropy_loss_back", np.array([1.5], np.float32), z, onehot),
        cross_entropy_loss_back(1.5, z, onehot))


# ---------------------------------------------------------------------------------------------
# the whole model against transformers' loss.backward()

N_TOKENS = 12
HF_CASES = {
    "llama-gqa": ("llama", dict(num_key_value_heads=2)),
    "llama-tied-mqa": ("llama", dict(num_key_value_heads=1, tie_word_embeddings=True)),
    "qwen2-biases": ("qwen2", dict(num_key_value_heads=2)),
    "mistral-swa": ("mistral", dict(num_key_value_heads=2, sliding_window=5)),
    "llama3-rope-freqs": (  # rope_freqs.weight: frequency factors, never trained
        "llama",
        dict(num_key_value_heads=2, rope_theta=500000.0, rope_parameters=dict(
            rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
            original_max_position_embeddings=64)),  # factors [1, 8]
    ),
}


@pytest.fixture(scope="module", params=sorted(HF_CASES))
def hf_case(request, tmp_path_factory):
    pytest.importorskip("transformers")
    kind, kwargs = HF_CASES[request.param]
    path = tmp_path_factory.mktemp("hf") / f"{kind}-{request.param}"
    save_tiny_hf(path, kind, seed=11, vocab_size=24, hidden_size=16, intermediate_size=20,
                 **kwargs)
    ids = np.random.default_rng(12).integers(0, 24, N_TOKENS + 1)
    return path, kind, ids[:-1], ids[1:]


def _hf_grads(
    path, kind: str, tokens, labels, dtype_name: str, permute_qk: bool = True
) -> tuple[float, dict]:
    """transformers' mean cross-entropy of ``labels`` and ``loss.backward()``, GGUF-named."""
    import torch
    import transformers

    from tests.support.tiny_models import HF_CLASSES

    dtype = getattr(torch, dtype_name)
    model = getattr(transformers, HF_CLASSES[kind]).from_pretrained(
        path, attn_implementation="eager", dtype=dtype
    )
    logits = model(torch.tensor(np.asarray(tokens))[None]).logits[0]
    loss = torch.nn.functional.cross_entropy(logits, torch.tensor(np.asarray(labels)))
    loss.backward()
    cfg = model.config
    grads = {}
    for name, p in model.named_parameters():  # a tied lm_head is embed_tokens itself
        g = p.grad.double().numpy()
        gguf = gguf_tensor_name(name)
        if permute_qk and kind != "qwen2" and (".attn_q." in gguf or ".attn_k." in gguf):
            heads = cfg.num_attention_heads if ".attn_q." in gguf else cfg.num_key_value_heads
            g = permute(g, heads)  # the rows were permuted at load: so are their gradients
        grads[gguf] = g
    return loss.item(), grads


@pytest.mark.oracle
@pytest.mark.parametrize("dtype", ["float64", "float32"])
def test_model_gradient_matches_transformers(hf_case, dtype):
    path, kind, tokens, labels = hf_case
    rtol = 1e-4
    hp, weights = load_hf(path)
    weights = {k: v.astype(dtype) for k, v in weights.items()}
    assert hp.n_head_kv < hp.n_head  # GQA
    loss, grads, _ = loss_and_grads(weights, hp, tokens, labels)
    ref_loss, ref = _hf_grads(path, kind, tokens, labels, "float32")
    assert abs(loss - ref_loss) <= rtol * abs(ref_loss)
    assert set(grads) == set(ref) == set(weights) - {"rope_freqs.weight"}
    for name in sorted(ref):
        err = np.abs(grads[name] - ref[name]).max() / np.abs(ref[name]).max()
        assert err <= rtol, (name, err)


@pytest.mark.oracle
def test_unpermuted_gradients_do_not_match(tmp_path):
    """The permutation of q/k gradients is needed: the test above could fail."""
    pytest.importorskip("transformers")
    path = save_tiny_hf(tmp_path / "llama", "llama", seed=11, vocab_size=24, hidden_size=16,
                        intermediate_size=20)
    ids = np.random.default_rng(12).integers(0, 24, N_TOKENS + 1)
    hp, weights = load_hf(path)
    weights = {k: v.astype(np.float64) for k, v in weights.items()}
    _, grads, _ = loss_and_grads(weights, hp, ids[:-1], ids[1:])
    _, ref = _hf_grads(path, "llama", ids[:-1], ids[1:], "float32", permute_qk=False)
    g = ref["blk.0.attn_q.weight"]
    assert np.abs(grads["blk.0.attn_q.weight"] - g).max() > 1e-3 * np.abs(g).max()


def test_a_mixture_of_experts_is_refused_before_training():
    """Mixtral loads as ``llama``, but its FFN is ``mul_mat_id``: fine-tuning refuses it up
    front, by name, instead of failing on a missing dense FFN weight."""
    from reference.training.finetune import FinetuneParams, check_finetune

    hp = tiny_hparams(n_expert=4, n_expert_used=2)
    with pytest.raises(TrainGraphError, match="^fine-tuning runs dense models; this llama has "
                                              "4 experts"):
        check_finetune(hp, 200, FinetuneParams(n_ctx=16))
