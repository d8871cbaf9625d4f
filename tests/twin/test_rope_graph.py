r"""RoPE in the twin's graph, and the token a pipelined sampler launches.

- **ggml's angles, bit for bit**: the twin's ``rope_theta`` (a cumulative product on MLX's
  CPU device) equals the reference's float32 recurrence $\theta_{j+1} = \mathrm{fl}(\theta_j
  s)$ at every position and dimension tried, to the last bit.
- **Pairs turned in one expression**: the twin's ``rotate_pairs`` equals the reference's bit
  for bit (NORM and NEOX, with an untouched tail).
- **One cache per graph changes nothing**: ``graph_rope(pos, ...)(x)``, whose cos/sin cache is
  built once for every ``q`` and ``k`` of a graph, equals ``rope_in_graph(x, pos, ...)`` and the
  op-level ``rope_ext`` bit for bit, on the CPU paths and on the GPU paths
  (``LLAMAREF_MLX_GPU_PATHS=1``: ``mx.fast.rope``), with and without YaRN and frequency factors.
- **The sampled token is launched on its own**: ``SamplerChain.sample_async`` and the bench's
  ``GreedyDevice`` return a token that is already scheduled, so reading it back does not wait
  for a step launched after it; the tokens stay the sequential loop's
  (``tests/twin/test_pipeline.py``).
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from accelerated.device import GPU_PATHS_ENV
from accelerated.models.llama import graph_rope, rope_in_graph
from accelerated.ops import rope as A_rope
from accelerated.sampling import SamplerChain
from llamaref.bench import GreedyDevice
from reference.ops import rope as R_rope
from reference.sampling import SamplerParams

positions = st.lists(st.integers(-(2**24), 2**24), min_size=1, max_size=40)


@given(pos=positions, half=st.integers(1, 128),
       freq_base=st.floats(2.0, 1e7, allow_nan=False, allow_infinity=False))
def test_rope_theta_is_ggmls_float32_recurrence_bit_for_bit(pos, half, freq_base):
    pos = np.array(pos, dtype=np.int32)
    ref = R_rope.rope_theta(pos, 2 * half, freq_base, np.float32)  # (n_tokens, half)
    twin = np.array(A_rope.rope_theta(mx.array(pos), 2 * half, freq_base, np.float32))
    assert twin.dtype == np.float32
    np.testing.assert_array_equal(twin, ref)


@pytest.mark.parametrize("gpu", [False, True], ids=["cpu_paths", "gpu_paths"])
@given(data=st.data())
def test_graph_rope_equals_rope_per_call(gpu, data):
    with pytest.MonkeyPatch.context() as monkeypatch:
        monkeypatch.setenv(GPU_PATHS_ENV, "1" if gpu else "0")
        _graph_rope_equals_rope_per_call(data)


def _graph_rope_equals_rope_per_call(data):
    n_tokens = data.draw(st.integers(1, 6), "n_tokens")
    n_head = data.draw(st.integers(1, 4), "n_head")
    half = data.draw(st.integers(1, 8), "half")
    head_dim = 2 * half + data.draw(st.sampled_from([0, 0, 2, 6]), "tail")
    n_dims = 2 * half
    mode = data.draw(st.sampled_from([R_rope.ROPE_TYPE_NORM, R_rope.ROPE_TYPE_NEOX]), "mode")
    params = dict(
        mode=mode, freq_base=data.draw(st.sampled_from([1e4, 5e5]), "base"),
        freq_scale=data.draw(st.sampled_from([1.0, 0.25]), "freq_scale"),
        attn_factor=data.draw(st.sampled_from([1.0, 0.9]), "attn_factor"),
    )
    if data.draw(st.booleans(), "yarn"):
        params.update(ext_factor=1.0, n_ctx_orig=2048, beta_fast=32.0, beta_slow=1.0)
    ff = None
    if data.draw(st.booleans(), "freq_factors"):
        ff = mx.array(
            data.draw(st.lists(st.floats(1.0, 8.0), min_size=half, max_size=half), "ff"),
            dtype=mx.float32)
    rope = R_rope.RopeParams(n_dims, **params)
    # a graph's positions are a batch's: never negative (the batch checks refuse them, and
    # MLX's GPU rope kernel would turn them wrong: A_rope.fast_rope_fits)
    pos_np = np.array(data.draw(st.lists(st.integers(0, 40000), min_size=n_tokens,
                                         max_size=n_tokens), "pos"), dtype=np.int32)
    seed = data.draw(st.integers(0, 2**31 - 1), "seed")
    q = mx.random.normal((n_tokens, n_head, head_dim), key=mx.random.key(seed))
    k = mx.random.normal((n_tokens, 1, head_dim), key=mx.random.key(seed + 1))
    pos = mx.array(pos_np)
    turn = graph_rope(pos, rope, ff)
    for x in (q, k):  # one cache, two tensors
        once = turn(x)
        assert mx.array_equal(once, rope_in_graph(x, pos, rope, ff)).item()
        assert mx.array_equal(once, A_rope.rope_ext(x, pos_np, rope, ff)).item()
    compiled = mx.compile(lambda p, x: graph_rope(p, rope, ff)(x))
    assert mx.array_equal(compiled(pos, q), turn(q)).item()


@pytest.mark.parametrize("make", [
    lambda: SamplerChain.from_params(SamplerParams(seed=7), 6),
    GreedyDevice,
], ids=["SamplerChain", "GreedyDevice"])
def test_sample_async_launches_its_token(make, monkeypatch):
    launched = []
    real = mx.async_eval
    monkeypatch.setattr(mx, "async_eval", lambda *a: (launched.extend(a), real(*a))[1])
    sampler = make()
    logits = mx.array([0.1, 2.0, -1.0, 0.5, 0.0, 1.9])
    pending = sampler.sample_async(logits)
    assert any(t is pending.token for t in launched)
    assert any(t is pending.chosen for t in launched)
    assert sampler.resolve(pending) in range(6)


@given(data=st.data())
def test_rotate_pairs_is_the_references_bit_for_bit(data):
    """The twin turns NORM pairs in one expression (x c + swapped x (-s, s)): the reference's
    x0 c - x1 s and x0 s + x1 c to the last bit, for NORM and NEOX, with an untouched tail."""
    half = data.draw(st.integers(1, 16), "half")
    tail = data.draw(st.sampled_from([0, 2, 8]), "tail")
    mode = data.draw(st.sampled_from([R_rope.ROPE_TYPE_NORM, R_rope.ROPE_TYPE_NEOX]), "mode")
    n_tokens, n_head = data.draw(st.integers(1, 5), "n_tokens"), data.draw(st.integers(1, 3))
    rng = np.random.default_rng(data.draw(st.integers(0, 2**32 - 1), "seed"))
    x = rng.standard_normal((n_tokens, n_head, 2 * half + tail)).astype(np.float32)
    theta = rng.uniform(-1e4, 1e4, (n_tokens, half)).astype(np.float32)
    c, s = np.cos(theta), np.sin(theta)
    ref = R_rope.rotate_pairs(x, c, s, 2 * half, mode)
    twin = A_rope.rotate_pairs(mx.array(x), mx.array(c), mx.array(s), 2 * half, mode)
    np.testing.assert_array_equal(np.array(twin), ref)
