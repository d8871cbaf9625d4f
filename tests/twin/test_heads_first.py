"""The twin's attention reads K and V as its cache holds them, heads first.

- **The same cells**: ``head_major_blocks(t, strm, n_kv)`` is ``head_major_view``'s cells (the
  reference's ``get_k`` layout) cut per stream and turned heads first, for one stream, streams
  in a row, and streams out of order.
- **The same values, bit for bit**: ``build_attn_mha_heads`` (the GPU path) equals
  ``build_attn_mha`` and ``attn_grouped_heads`` (the CPU path) equals ``attn_grouped``, with
  one stream or several, one token or several, ALiBi, and masked rows.
- **Both inputs**: the eager input and the traced graph's input give ``get_k``'s and
  ``get_v``'s cells heads first, on a cache of two streams.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from accelerated.memory.kv_cache import GraphAttnInput, KVCache, head_major_blocks, head_major_view
from accelerated.models.llama import attn_grouped, attn_grouped_heads
from accelerated.ops.attention import build_attn_mha, build_attn_mha_heads, stream_blocks
from reference.batch import Batch, BatchAllocr
from reference.testing import tiny_hparams


@pytest.mark.parametrize("strm", [(0,), (1, 2), (2, 0)])
def test_head_major_blocks_are_the_view_cut_per_stream(strm):
    t = mx.random.normal((3, 2, 8, 4), key=mx.random.key(0))  # 3 streams, 2 heads, 8 cells
    blocks = head_major_blocks(t, strm, 5)  # (ns, 2, 5, 4)
    view = head_major_view(t, strm, 5)  # (ns * 5, 2, 4)
    assert blocks.shape == (len(strm), 2, 5, 4)
    assert mx.array_equal(blocks, stream_blocks(view, len(strm)).transpose(0, 2, 1, 3)).item()


@st.composite
def attention_inputs(draw):
    ns, n_t, n_k = draw(st.integers(1, 3)), draw(st.integers(1, 3)), draw(st.integers(1, 6))
    n_head_kv, rep, d = draw(st.integers(1, 2)), draw(st.integers(1, 3)), draw(st.integers(1, 8))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    q = rng.standard_normal((ns * n_t, n_head_kv * rep, d)).astype(np.float32)
    k, v = rng.standard_normal((2, ns * n_k, n_head_kv, d)).astype(np.float32)
    visible = rng.random((ns * n_t, ns * n_k)) < 0.7  # a row may see nothing
    mask = np.where(visible, 0.0, -np.inf).astype(np.float32)
    return mx.array(q), mx.array(k), mx.array(v), mx.array(mask), ns


@given(attention_inputs(), st.sampled_from([0.0, 8.0]))
def test_the_gpu_path_heads_first_is_build_attn_mha_bit_for_bit(inputs, max_bias):
    q, k, v, mask, ns = inputs
    heads = [stream_blocks(t, ns).transpose(0, 2, 1, 3) for t in (k, v)]
    want = build_attn_mha(q, k, v, mask, 0.3, max_bias, n_stream=ns)
    assert mx.array_equal(build_attn_mha_heads(q, *heads, mask, 0.3, max_bias, ns), want).item()


@given(attention_inputs())
def test_the_cpu_path_heads_first_is_attn_grouped_bit_for_bit(inputs):
    q, k, v, mask, ns = inputs
    heads = [stream_blocks(t, ns).transpose(0, 2, 1, 3) for t in (k, v)]
    want = attn_grouped(q, k, v, mask, 0.3, n_stream=ns)
    assert mx.array_equal(attn_grouped_heads(q, *heads, mask, 0.3, n_stream=ns), want).item()


def test_every_attention_input_gives_the_cells_heads_first():
    """The eager input and the traced graph's input give get_k's cells, heads first."""
    hp = tiny_hparams()
    cache = KVCache(hp, kv_size=16, n_seq_max=2, kv_unified=False)
    ub = BatchAllocr(Batch(token=[1, 2, 3, 4], seq_id=[[0], [1], [0], [1]]), n_vocab=32,
                     n_seq_max=2, memory=cache).split_equal(8, sequential=True)
    sinfo = cache.prepare([ub])[0]
    cache.apply_ubatch(sinfo, ub)
    eager = cache.attn_input(ub, sinfo)
    graph = GraphAttnInput(cache.k_l, cache.v_l, mx.zeros((4, hp.n_head_kv), mx.int32),
                           eager.get_kq_mask(0), eager.n_kv, tuple(sinfo.strm), hp.n_head_kv)
    ns = len(sinfo.strm)
    assert ns == 2
    for inp in (eager, graph):
        for heads, flat in ((inp.get_k_heads(0), inp.get_k(0)), (inp.get_v_heads(0), inp.get_v(0))):
            assert mx.array_equal(heads, stream_blocks(flat, ns).transpose(0, 2, 1, 3)).item()
