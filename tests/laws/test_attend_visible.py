r"""Attention that reads only the cells a token sees, RoPE's cache built once per forward, and a
tall weight's product in blocks: three ways the reference computes the same values faster.

- **Hidden cells add nothing**: ``attend_visible`` (each token's own cells, gathered) equals
  ``build_attn_mha`` over every cell, for any mask (rows fully hidden included), GQA, ALiBi and
  a soft-cap: to float64 rounding in float64, and in float32 no further from the float64 result
  than the full product is. The twin's ``attend_visible`` equals the reference's.
- **The switch is only a speed choice**: ``build_attn_mha`` takes the gathered form exactly
  when every token sees at most ``1 / FEW_CELLS`` of the cells (``sees_few_cells``), and its
  output is the full product's either way. Many tokens go in blocks whose gathered K and V are
  no larger than the cells in view.
- **One cache per forward**: ``graph_rope(pos, ...)(x)`` equals ``rope_ext(x, pos, ...)`` bit for
  bit (NORM and NEOX, YaRN, frequency factors, float32 and float64).
- **A tall weight in blocks**: ``mul_mat`` of a weight taller than ``TALL_BLOCK`` and a few rows
  equals the product in one piece.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from accelerated.ops import attention as A_attention
from reference.models.llama import graph_rope
from reference.ops import attention as R_attention
from reference.ops import matmul as R_matmul
from reference.ops.errors import OpShapeError
from reference.ops.rope import ROPE_TYPE_NEOX, ROPE_TYPE_NORM, rope_ext

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


@given(sparse_attention())
def test_the_twin_attends_the_visible_cells_as_the_reference(inputs):
    q, k, v, mask, kq_scale, max_bias, softcap = (
        a.astype(np.float32) if isinstance(a, np.ndarray) else a for a in inputs)
    ref = R_attention.attend_visible(q, k, v, mask, kq_scale, max_bias, softcap)
    twin = np.array(A_attention.attend_visible(q, k, v, mx.array(mask), kq_scale, max_bias,
                                               softcap))
    # two float32 evaluations of the same sums (MLX's softmax sums in float32)
    bound = 16 * EPS32 * np.max(np.abs(v)) * (1 + np.max(np.abs(q)) * np.max(np.abs(k)))
    assert np.max(np.abs(twin - ref), initial=0) <= bound


def test_both_twins_attend_in_the_same_blocks_and_refuse_the_same_shapes():
    rng = np.random.default_rng(4)
    n_tokens, n_kv = 40, 64  # each token sees 4 cells: blocks of 16 tokens in both twins
    mask = np.full((n_tokens, n_kv), -np.inf, np.float32)
    for t in range(n_tokens):
        mask[t, rng.choice(n_kv, 4, replace=False)] = 0.0
    q = rng.standard_normal((n_tokens, 4, 8)).astype(np.float32)
    k, v = rng.standard_normal((2, n_kv, 2, 8)).astype(np.float32)
    ref = R_attention.attend_visible(q, k, v, mask, 8 ** -0.5)
    twin = np.array(A_attention.attend_visible(q, k, v, mx.array(mask), 8 ** -0.5))
    np.testing.assert_allclose(twin, ref, rtol=0, atol=1e-5)
    for attend in (R_attention.attend_visible, A_attention.attend_visible):
        with pytest.raises(OpShapeError, match="one block"):
            attend(q, k.reshape(2, 32, 2, 8), v.reshape(2, 32, 2, 8), mask, 1.0)  # 4-D: streams
        with pytest.raises(OpShapeError):
            attend(q, k[:, :1], v, mask, 1.0)  # k and v disagree


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


@given(st.lists(st.integers(-5000, 100_000), min_size=1, max_size=12),
       st.sampled_from([ROPE_TYPE_NORM, ROPE_TYPE_NEOX]), st.sampled_from([np.float32, np.float64]),
       st.booleans(), st.booleans())
def test_graph_rope_is_rope_ext_bit_for_bit(pos, mode, dtype, yarn, factors):
    pos = np.array(pos, dtype=np.int32)
    rng = np.random.default_rng(len(pos))
    n_dims = 16
    kwargs = dict(mode=mode, n_ctx_orig=4096, freq_base=10000.0,
                  freq_scale=0.25 if yarn else 1.0, ext_factor=1.0 if yarn else 0.0,
                  attn_factor=1.0, beta_fast=32.0, beta_slow=1.0,
                  freq_factors=rng.uniform(1, 8, n_dims // 2) if factors else None)
    rope = graph_rope(pos, n_dims, **kwargs)
    for n_head in (4, 2):  # a q and a k: the second call reuses the cache
        x = rng.standard_normal((len(pos), n_head, 20)).astype(dtype)  # 4 dims pass through
        out = rope(x)
        assert out.dtype == dtype
        np.testing.assert_array_equal(out, rope_ext(x, pos, n_dims, **kwargs))


@pytest.mark.parametrize("n_rows", [1, 5, 63])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_a_tall_weight_in_blocks_is_the_product_in_one_piece(monkeypatch, n_rows, dtype):
    rng = np.random.default_rng(n_rows)
    a = rng.standard_normal((1000, 24)).astype(dtype)  # 1000 rows: blocks of 128, last short
    b = rng.standard_normal((n_rows, 24)).astype(dtype)
    monkeypatch.setattr(R_matmul, "TALL_BLOCK", 128)
    out = R_matmul.mul_mat(a, b)
    assert out.shape == (n_rows, 1000) and out.dtype == dtype and out.flags.c_contiguous
    tol = 1e-12 if dtype == np.float64 else 1e-5
    np.testing.assert_allclose(out, b @ a.T, rtol=tol, atol=tol)
