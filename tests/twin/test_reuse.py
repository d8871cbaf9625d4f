"""Graph reuse in the accelerated Context: compiled graphs change nothing, and are counted.

- **Identity**: ``graph_reuse=True`` (each ubatch's graph traced once by ``mx.compile`` and
  reused) and ``graph_reuse=False`` (the same function run op by op) give bit-identical
  logits and K/V caches over multi-step, multi-sequence decodes, in both KV modes, with small
  ubatches, embeddings and a K-shift in between (a property over random decode scripts too).
- **Counting** (``perf().n_reused``, llama.cpp's rule: a ubatch reuses the graph when its
  shapes equal the previous ubatch's): token-by-token generation reuses every step after the
  first; the step where the attention view grows past 256 cells does not; reuse off counts
  nothing, and ``LLAMA_GRAPH_REUSE_DISABLE=1`` turns it off as in llama.cpp.
- **The narrow view is exact**: reading the used cells padded to ``KV_VIEW_PAD`` instead of
  llama.cpp's ``n_kv`` changes no bit of the logits or caches.
- **Bounded**: the compiled graphs kept never exceed ``graph_cache_size`` (least recently
  used out), however many shapes go through.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import accelerated.context
from accelerated.context import KV_VIEW_PAD, Context, ContextError, GraphKey
from reference.batch import Batch
from reference.context import context_shift
from tests.support.tiny_models import random_weights, tiny_hparams

HP = tiny_hparams(n_layer=2, n_ctx_train=4096)
W = random_weights(HP, seed=11, out_ffn_bias=True)
QWEN = tiny_hparams("qwen2", n_layer=2, n_ctx_train=4096)
WQ = random_weights(QWEN, seed=12)


def pair(hp=HP, w=W, **kw):
    kw = dict(dict(n_ctx=512, n_batch=512, n_ubatch=512), **kw)
    return Context(hp, w, graph_reuse=True, **kw), Context(hp, w, graph_reuse=False, **kw)


def assert_same(on: Context, off: Context) -> None:
    """Bit-identical outputs and cache tensors."""
    np.testing.assert_array_equal(on.get_logits(), off.get_logits())
    for a, b in zip(on.memory.k_l + on.memory.v_l, off.memory.k_l + off.memory.v_l, strict=True):
        np.testing.assert_array_equal(np.array(a), np.array(b))


def decode_both(on: Context, off: Context, batch: Batch) -> None:
    assert on.decode(batch) == 0 and off.decode(batch) == 0
    assert_same(on, off)


def interleaved(n_seq: int, n_each: int, seed: int) -> Batch:
    rng = np.random.default_rng(seed)
    seq_id = [[s] for _ in range(n_each) for s in range(n_seq)]
    tokens = rng.integers(0, 32, len(seq_id)).tolist()
    return Batch(token=tokens, seq_id=seq_id, logits=[True] * len(tokens))


@pytest.mark.parametrize("kv_unified", [True, False])
@pytest.mark.parametrize("hp,w", [(HP, W), (QWEN, WQ)], ids=["llama", "qwen2"])
def test_reuse_on_and_off_are_bit_identical(hp, w, kv_unified):
    on, off = pair(hp, w, n_seq_max=3, n_ubatch=4, kv_unified=kv_unified)
    decode_both(on, off, interleaved(3, 5, seed=0))  # 15 tokens in ubatches of <= 4
    for step in range(6):  # every sequence goes on one token at a time
        toks = np.random.default_rng(step).integers(0, 32, 3).tolist()
        decode_both(on, off, Batch(token=toks, seq_id=[[0], [1], [2]], logits=[True] * 3))
    assert on.perf().n_reused > 0 and off.perf().n_reused == 0


def test_reuse_on_and_off_agree_with_embeddings_and_a_k_shift():
    on, off = pair(n_seq_max=2)
    embd = np.random.default_rng(3).standard_normal((5, HP.n_embd)).astype(np.float32)
    decode_both(on, off, Batch(embd=embd, logits=[True] * 5))
    decode_both(on, off, Batch(token=[1, 2, 3, 4, 5, 6], seq_id=[[0]] * 6))
    for ctx in (on, off):
        context_shift(ctx, 0, n_keep=1, n_discard=4)  # a K-shift pending for the next decode
    for t in (7, 8, 9):
        decode_both(on, off, Batch(token=[t]))


@settings(max_examples=6)
@given(st.lists(st.tuples(st.integers(1, 3), st.integers(1, 4)), min_size=1, max_size=4),
       st.integers(1, 6))
def test_reuse_never_changes_a_bit(script, n_ubatch):
    """Law: for any script of decodes (sequences x tokens each), on == off, bit for bit."""
    on, off = pair(n_seq_max=3, n_ubatch=n_ubatch, kv_unified=False)
    for i, (n_seq, n_each) in enumerate(script):
        decode_both(on, off, interleaved(n_seq, n_each, seed=i))


def test_token_by_token_generation_reuses_every_step_after_the_first():
    ctx = Context(HP, W, n_ctx=512)
    assert ctx.decode(Batch(token=list(range(10)))) == 0
    assert ctx.perf().n_reused == 0  # the first graph is built
    for t in range(8):
        assert ctx.decode(Batch(token=[t])) == 0
    assert ctx.perf().n_reused == 7  # the first one-token step has a new shape


def test_a_grown_n_kv_is_not_a_reuse():
    ctx = Context(HP, W, n_ctx=512, n_batch=512)
    assert ctx.decode(Batch(token=[1] * 255)) == 0  # cells 0..254: n_kv = 256
    keys = []
    for t in range(3):
        assert ctx.decode(Batch(token=[t])) == 0
        keys.append(ctx._prev_key)
    # pos 255 fills cell 255 (a view of 256 cells); pos 256 needs a wider view, the next
    # multiple of KV_VIEW_PAD (llama.cpp's n_kv would jump to 512): a new graph; then reuse
    assert [k.n_kv for k in keys] == [256, 256 + KV_VIEW_PAD, 256 + KV_VIEW_PAD]
    assert ctx.perf().n_reused == 1


def test_the_narrow_view_is_exact(monkeypatch):
    """Reading only the used cells (padded to KV_VIEW_PAD) instead of llama.cpp's n_kv gives
    bit-identical logits and caches: the dropped columns are masked for every token."""
    narrow = Context(HP, W, n_ctx=512, n_seq_max=3)
    monkeypatch.setattr(accelerated.context, "KV_VIEW_PAD", 4096)  # the view = n_kv
    full = Context(HP, W, n_ctx=512, n_seq_max=3)
    for i, (n_seq, n_each) in enumerate([(3, 5), (2, 1), (1, 1), (3, 2)]):
        batch = interleaved(n_seq, n_each, seed=i)
        monkeypatch.setattr(accelerated.context, "KV_VIEW_PAD", 64)
        assert narrow.decode(batch) == 0
        monkeypatch.setattr(accelerated.context, "KV_VIEW_PAD", 4096)
        assert full.decode(batch) == 0
        assert np.array_equal(narrow.get_logits(), full.get_logits())
    assert narrow._prev_key.n_kv == 64 and full._prev_key.n_kv == 256
    for a, b in zip(narrow.memory.k_l + narrow.memory.v_l, full.memory.k_l + full.memory.v_l,
                    strict=True):
        assert np.array_equal(np.array(a), np.array(b))


def test_reuse_off_counts_nothing_and_the_environment_turns_it_off(monkeypatch):
    ctx = Context(HP, W, n_ctx=256, graph_reuse=False)
    for t in range(4):
        assert ctx.decode(Batch(token=[t])) == 0
    assert ctx.perf().n_reused == 0 and not ctx._graphs
    monkeypatch.setenv("LLAMA_GRAPH_REUSE_DISABLE", "1")
    assert not Context(HP, W, n_ctx=256).graph_reuse
    monkeypatch.setenv("LLAMA_GRAPH_REUSE_DISABLE", "0")
    assert Context(HP, W, n_ctx=256).graph_reuse


def test_the_graph_cache_is_bounded_least_recently_used_out():
    ctx = Context(HP, W, n_ctx=256, graph_cache_size=2)
    for n in (3, 4, 5, 4, 6):  # five prompts of four shapes
        ctx.memory.clear()
        assert ctx.decode(Batch(token=list(range(n)))) == 0
        assert len(ctx._graphs) <= 2
    assert [k.n_tokens for k in ctx._graphs] == [4, 6]  # the two most recently used
    assert isinstance(next(iter(ctx._graphs)), GraphKey)
    with pytest.raises(ContextError, match="graph_cache_size"):
        Context(HP, W, graph_cache_size=0)


def test_perf_reset_restarts_the_reuse_count():
    ctx = Context(HP, W, n_ctx=256)
    for t in range(3):
        assert ctx.decode(Batch(token=[t])) == 0
    assert ctx.perf().n_reused == 2
    ctx.perf_reset()
    assert ctx.perf().n_reused == 0
    assert ctx.decode(Batch(token=[5])) == 0
    assert ctx.perf().n_reused == 1  # the graph itself survives a reset


@pytest.mark.parametrize("kw", [
    dict(n_dims=16, mode=0),
    dict(n_dims=12, mode=0, freq_base=500000.0, attn_factor=0.5, ff=True),
    dict(n_dims=16, mode=2, n_ctx_orig=2048, freq_scale=0.25, ext_factor=1.0),  # YaRN
], ids=["norm", "freq-factors", "yarn-neox"])
def test_the_in_graph_rope_is_rope_ext_bit_for_bit(kw):
    """The compiled graph cannot read positions on the host; its rope is rope_ext's maths."""
    import mlx.core as mx

    from accelerated.models.llama import rope_in_graph
    from accelerated.ops import rope_ext
    from reference.ops.rope import RopeParams

    kw = dict(kw)
    ff = mx.array(np.linspace(1, 4, 8).astype(np.float32)) if kw.pop("ff", False) else None
    x = mx.random.normal((5, 3, 16), key=mx.random.key(1))
    pos = np.array([0, 3, 100, 4000, 7])
    rope = RopeParams(**kw)
    want = rope_ext(x, pos, rope, ff)
    assert mx.array_equal(rope_in_graph(x, mx.array(pos), rope, ff), want).item()
