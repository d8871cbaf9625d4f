"""The MLX Context against the reference on the iSWA memory.

The iSWA memory's laws run on every flavour, the MLX one included: those every model obeys in
``tests/laws/test_decode.py``, ``test_memory.py`` and ``test_state.py`` (the ``iswa`` model of
``tests/support/helpers.py``), its own in ``tests/laws/test_kv_cache_iswa.py``. Here, twin
against reference (NMSE <= ``MAX_NMSE_TWIN``) on the same tiny ``llama``-arch models with a
per-layer SWA pattern (1:1, 5:1, every layer SWA) and windows of 4 to 8: the same scenarios
decoded by both, the small SWA cache that forgets masked cells, the K-shift with another RoPE
base on the SWA layers, and graph reuse on == off bit for bit when the base cache holds no
layer.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from accelerated.context import Context as MLXContext
from accelerated.context import cache_parts, kv_caches
from reference.batch import Batch
from reference.common import MAX_NMSE_TWIN
from reference.context import Context as RefContext
from reference.context import context_shift
from reference.hparams import swa_pattern
from reference.testing import nmse, random_weights, reference_logits, tiny_hparams
from tests.laws import test_kv_cache_iswa as laws
from tests.support.helpers import MLX, REF_F32, interleave

N_VOCAB = laws.N_VOCAB
patterns_st, n_swa_st, tokens_st = laws.patterns_st, laws.n_swa_st, laws.tokens_st
few = settings(max_examples=8, deadline=None)  # each example builds and compiles Contexts


def assert_twin(want, got) -> None:
    want, got = np.asarray(want), np.asarray(got)
    assert want.shape == got.shape and np.isfinite(got).all()
    assert nmse(want, got) <= MAX_NMSE_TWIN, f"NMSE {nmse(want, got):.3g}"


# ---- the twin against the reference --------------------------------------------------------


def pair(pattern: str, n_swa: int, **kwargs):
    kwargs = dict(dict(n_ctx=256, n_batch=256, n_ubatch=256), **kwargs)
    return laws.make_iswa(REF_F32, pattern, n_swa, **kwargs), laws.make_iswa(MLX, pattern, n_swa,
                                                                            **kwargs)


@pytest.mark.parametrize("pattern", laws.LAW_PATTERNS)
def test_the_graph_reads_the_caches_that_hold_layers(pattern):
    _, acc = pair(pattern, 4)
    parts = cache_parts(acc.memory)
    assert [p.layers for p in parts] == [c.layers for c in kv_caches(acc.memory) if c.layers]
    assert [p.swa for p in parts] == ([True] if pattern == "all" else [False, True])


@few
@given(pattern=patterns_st, n_swa=n_swa_st,
       seqs=st.lists(tokens_st, min_size=1, max_size=3), n_ubatch=st.integers(1, 7),
       kv_unified=st.booleans())
def test_multi_sequence_decodes_equal_the_reference(pattern, n_swa, seqs, n_ubatch, kv_unified):
    token, seq_id = interleave(seqs)
    ref, acc = pair(pattern, n_swa, n_ubatch=n_ubatch, n_seq_max=len(seqs),
                    kv_unified=kv_unified, n_ctx=256 * (1 if kv_unified else len(seqs)))
    batch = Batch(token=token, seq_id=seq_id, logits=[True] * len(token))
    assert ref.decode(batch) == 0 and acc.decode(batch) == 0
    assert_twin(ref.get_logits(), acc.get_logits())
    step = Batch(token=[1] * len(seqs), seq_id=[[s] for s in range(len(seqs))],
                 logits=[True] * len(seqs))
    for _ in range(3):
        assert ref.decode(step) == 0 and acc.decode(step) == 0
        assert_twin(ref.get_logits(), acc.get_logits())


def test_a_small_swa_cache_equals_the_cache_free_forward():
    """The reference law with the twin's bound: 300 positions through a 256-cell SWA cache."""
    pattern, n_swa = "1:1", 4
    hp, w = laws.iswa_model(pattern, n_swa, np.dtype(np.float32))
    _, acc = pair(pattern, n_swa, n_ctx=512, n_batch=64, n_ubatch=8, swa_full=False)
    tokens = np.random.default_rng(0).integers(0, N_VOCAB, 300).tolist()
    out = np.concatenate([laws.decode(acc, tokens[i:i + 60]) for i in range(0, 300, 60)])
    assert acc.memory.kv_swa.get_size() == 256 and acc.memory.kv_base.v_cells[0].get_used() == 300
    assert_twin(reference_logits(w, hp, tokens)[-60:], out[-60:])


@pytest.mark.parametrize("pattern", ["1:1", "all"])
def test_a_k_shift_with_its_own_swa_rope_base_equals_the_reference(pattern):
    n_layer, n_pattern = laws.PATTERNS[pattern]
    hp = dataclasses.replace(
        tiny_hparams(n_vocab=N_VOCAB, n_layer=n_layer, n_swa=6, n_ctx_train=4096),
        swa_layers=swa_pattern(n_layer, n_pattern), rope_freq_base_train_swa=100.0)
    w = random_weights(hp, seed=3)
    ref, acc = (cls(hp, w, n_ctx=256, n_seq_max=2) for cls in (RefContext, MLXContext))
    tokens = np.random.default_rng(1).integers(0, N_VOCAB, 16).tolist()
    for ctx in (ref, acc):
        laws.decode(ctx, tokens)
        context_shift(ctx, 0, n_keep=2, n_discard=5)
        ctx.memory.seq_cp(0, 1, -1, -1)
        ctx.memory.seq_add(1, 4, -1, 3)
    for t in (3, 4, 5):
        b = Batch(token=[t, t], seq_id=[[0], [1]], logits=[True, True])
        assert ref.decode(b) == 0 and acc.decode(b) == 0
        assert_twin(ref.get_logits(), acc.get_logits())


@pytest.mark.parametrize("pattern", laws.LAW_PATTERNS)
def test_reuse_on_and_off_are_bit_identical(pattern):
    hp, w = laws.iswa_model(pattern, 5, np.dtype(np.float32))
    kw = dict(n_ctx=256, n_seq_max=2, n_ubatch=3, kv_unified=False)
    on, off = MLXContext(hp, w, graph_reuse=True, **kw), MLXContext(hp, w, graph_reuse=False, **kw)
    token, seq_id = interleave([list(range(1, 12)), list(range(3, 10))])
    batches = [Batch(token=token, seq_id=seq_id, logits=[True] * len(token))]
    batches += [Batch(token=[t, t + 1], seq_id=[[0], [1]], logits=[True, True]) for t in range(5)]
    for batch in batches:
        assert on.decode(batch) == 0 and off.decode(batch) == 0
        np.testing.assert_array_equal(on.get_logits(), off.get_logits())
        for a, b in zip(kv_caches(on.memory), kv_caches(off.memory), strict=True):
            for x, y in zip(a.k_l + a.v_l, b.k_l + b.v_l, strict=True):
                np.testing.assert_array_equal(np.array(x), np.array(y))
    assert on.perf().n_reused > 0
