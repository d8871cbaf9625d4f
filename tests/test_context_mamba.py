"""Properties of Mamba and Mamba-2 decoded through :class:`reference.context.Context`.

The Context gives a recurrent model a :class:`reference.memory.recurrent.RecurrentMemory`
(one cell per sequence), splits batches with ``split_equal(sequential=True)`` and runs
:func:`reference.models.mamba.mamba_forward`. In float64 (rounding out of the way) the laws of
a recurrence must hold to ~1e-10, for both architectures:

- chunked prefill == token by token == one prefill, whatever ``n_ubatch``;
- several sequences interleaved in one batch == each decoded alone;
- ``seq_cp`` then divergent continuations == independent decodes;
- save, clear, restore, continue == uninterrupted (whole context and one sequence);
- a partial ``seq_rm`` returns False and changes nothing (cells and rows bit-identical);
- invalid batches (-1), coupled sequences (1), an aborted ubatch (2) change nothing.
"""

from __future__ import annotations

import copy

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from reference.batch import Batch
from reference.context import Context, ContextError, context_sizes, is_recurrent
from tests.tiny_models import mamba_reference_logits, random_mamba_weights, tiny_mamba_hparams

ARCHS = ("mamba", "mamba2")
TOL = 1e-10
N_VOCAB = 24


def _model(arch):
    kw = dict(n_vocab=N_VOCAB, n_embd=16, n_layer=2, d_state=4)
    if arch == "mamba2":
        kw.update(head_dim=8, n_group=2)
    hp = tiny_mamba_hparams(arch, **kw)
    return hp, random_mamba_weights(hp, seed=3, dtype=np.float64)


MODELS = {arch: _model(arch) for arch in ARCHS}


def new_ctx(arch, n_ubatch=64, n_seq_max=3, **kw) -> Context:
    hp, w = MODELS[arch]
    return Context(hp, w, n_ctx=256, n_batch=64, n_ubatch=n_ubatch, n_seq_max=n_seq_max,
                   dtype=np.float64, **kw)


def alone(arch, tokens) -> np.ndarray:
    """Every token's logits of one sequence, without the Context (SimpleRecurrentState)."""
    hp, w = MODELS[arch]
    return mamba_reference_logits(w, hp, tokens)  # (n_tokens, n_vocab)


def decode_all(ctx, tokens, seq=0, start=None) -> np.ndarray:
    n = len(tokens)
    pos = None if start is None else list(range(start, start + n))
    assert ctx.decode(Batch(token=list(tokens), pos=pos, seq_id=[[seq]] * n,
                            logits=[True] * n)) == 0
    return ctx.get_logits().copy()  # (n, n_vocab)


def snapshot(ctx):
    """Everything a failed operation must not change: cells, counters, rows, outputs."""
    mem = ctx.memory
    return (copy.deepcopy(mem.cells), mem.used, mem.head,
            [t.copy() for t in mem.r_l + mem.s_l], ctx.get_logits().copy())


def assert_same(a, b):
    assert a[0] == b[0] and a[1:3] == b[1:3]
    assert all(np.array_equal(x, y) for x, y in zip(a[3], b[3], strict=True))
    assert np.array_equal(a[4], b[4])


tokens_st = st.lists(st.integers(0, N_VOCAB - 1), min_size=1, max_size=12)
arch_st = st.sampled_from(ARCHS)
n_ubatch_st = st.sampled_from([1, 2, 3, 5, 64])


def test_the_context_picks_the_recurrent_memory():
    ctx = new_ctx("mamba", n_seq_max=4)
    assert is_recurrent(ctx.hparams) and type(ctx.memory).__name__ == "RecurrentMemory"
    assert ctx.memory.get_size() == 4 and ctx.memory.n_seq_max == 4
    assert ctx.memory_update() is False  # no K-shift
    hp = MODELS["mamba"][0]
    # the sizes are cparams: the same as for a KV cache model
    assert (ctx.n_ctx, ctx.n_batch, ctx.n_ubatch, ctx.n_seq_max) == tuple(
        context_sizes(256, 64, 64, 4, True, hp.n_ctx_train)[k]
        for k in ("n_ctx", "n_batch", "n_ubatch", "n_seq_max"))
    one = new_ctx("mamba2", n_seq_max=0)
    assert one.memory.get_size() == 1


@settings(deadline=None)
@given(arch=arch_st, tokens=tokens_st, n_ubatch=n_ubatch_st, data=st.data())
def test_chunked_prefill_equals_token_by_token_equals_one_prefill(arch, tokens, n_ubatch, data):
    ref = alone(arch, tokens)
    one = decode_all(new_ctx(arch, n_ubatch=n_ubatch), tokens)
    cuts = sorted(data.draw(st.sets(st.integers(1, max(1, len(tokens) - 1)), max_size=4)))
    chunked_ctx, rows, start = new_ctx(arch, n_ubatch=n_ubatch), [], 0
    for end in [c for c in cuts if c < len(tokens)] + [len(tokens)]:
        rows.append(decode_all(chunked_ctx, tokens[start:end]))
        start = end
    chunked = np.concatenate(rows)
    tbt_ctx = new_ctx(arch, n_ubatch=n_ubatch)
    tbt = np.concatenate([decode_all(tbt_ctx, [t]) for t in tokens])
    for out in (one, chunked, tbt):
        assert np.abs(out - ref).max() <= TOL
    assert chunked_ctx.memory.seq_pos_max(0) == len(tokens) - 1


@settings(deadline=None)
@given(arch=arch_st, seqs=st.lists(tokens_st, min_size=2, max_size=3), n_ubatch=n_ubatch_st,
       conts=st.lists(tokens_st, min_size=3, max_size=3))
def test_interleaved_sequences_equal_each_alone(arch, seqs, n_ubatch, conts):
    ctx = new_ctx(arch, n_ubatch=n_ubatch)
    token, pos, seq_id = [], [], []
    for k in range(max(map(len, seqs))):
        for s, t in enumerate(seqs):
            if k < len(t):
                token.append(t[k]), pos.append(k), seq_id.append([s])
    assert ctx.decode(Batch(token=token, pos=pos, seq_id=seq_id, logits=[True] * len(token))) == 0
    logits = ctx.get_logits()
    # continuations, all sequences in one batch again, positions from the memory
    token2 = [t for s in range(len(seqs)) for t in conts[s]]
    seq2 = [[s] for s in range(len(seqs)) for _ in conts[s]]
    assert ctx.decode(Batch(token=token2, seq_id=seq2, logits=[True] * len(token2))) == 0
    logits2 = ctx.get_logits()
    for s, t in enumerate(seqs):
        ref = alone(arch, list(t) + list(conts[s]))
        got = np.concatenate([logits[[i for i, x in enumerate(seq_id) if x == [s]]],
                              logits2[[i for i, x in enumerate(seq2) if x == [s]]]])
        assert np.abs(got - ref).max() <= TOL
        assert ctx.memory.seq_pos_max(s) == len(t) + len(conts[s]) - 1


@settings(deadline=None)
@given(arch=arch_st, prefix=tokens_st, branches=st.lists(tokens_st, min_size=3, max_size=3),
       n_ubatch=n_ubatch_st)
def test_seq_cp_then_divergence_equals_independent_decodes(arch, prefix, branches, n_ubatch):
    ctx = new_ctx(arch, n_ubatch=n_ubatch)
    decode_all(ctx, prefix)
    ctx.memory.seq_cp(0, 1, -1, -1)
    ctx.memory.seq_cp(1, 2, -1, -1)
    n = len(prefix)
    token = [t for b in branches for t in b]
    seq_id = [[s] for s, b in enumerate(branches) for _ in b]
    pos = [n + k for b in branches for k in range(len(b))]
    assert ctx.decode(Batch(token=token, pos=pos, seq_id=seq_id, logits=[True] * len(token))) == 0
    logits = ctx.get_logits()
    for s, b in enumerate(branches):
        ref = alone(arch, list(prefix) + list(b))[n:]
        assert np.abs(logits[[i for i, x in enumerate(seq_id) if x == [s]]] - ref).max() <= TOL
    # and after seq_keep, the kept branch goes on alone
    ctx.memory.seq_keep(1)
    more = decode_all(ctx, branches[0], seq=1)
    ref = alone(arch, list(prefix) + list(branches[1]) + list(branches[0]))[-len(branches[0]):]
    assert np.abs(more - ref).max() <= TOL


@settings(deadline=None)
@given(arch=arch_st, a=tokens_st, b=tokens_st, cont=tokens_st, whole=st.booleans())
def test_save_clear_restore_continue_equals_uninterrupted(arch, a, b, cont, whole):
    ctx = new_ctx(arch)
    decode_all(ctx, a, seq=0)
    decode_all(ctx, b, seq=1)
    if whole:
        blob = ctx.state_get_data()
        outputs = ctx.get_logits().copy()
        ctx.memory.clear()
        decode_all(ctx, cont, seq=2)  # something else in between
        assert ctx.state_set_data(blob) == len(blob)
        assert np.array_equal(ctx.get_logits(), outputs)
        assert ctx.memory.seq_pos_max(2) == -1
        dest = 0
    else:
        blob = ctx.state_seq_get_data(0)
        ctx.memory.clear()
        dest = 2  # a sequence blob restores into any sequence
        assert ctx.state_seq_set_data(blob, dest) == len(blob)
        assert ctx.memory.seq_pos_max(0) == ctx.memory.seq_pos_max(1) == -1
    got = decode_all(ctx, cont, seq=dest)
    ref = alone(arch, list(a) + list(cont))[len(a):]
    assert np.abs(got - ref).max() <= TOL
    if whole:
        ref1 = alone(arch, list(b) + list(cont))[len(b):]
        assert np.abs(decode_all(ctx, cont, seq=1) - ref1).max() <= TOL


@pytest.mark.parametrize("arch", ARCHS)
def test_state_files_through_the_context(arch, tmp_path):
    ctx = new_ctx(arch)
    decode_all(ctx, [1, 2, 3, 4], seq=1)
    ctx.state_seq_save_file(tmp_path / "s.bin", 1, [1, 2, 3, 4])
    ctx.state_save_file(tmp_path / "w.bin", [9])
    ctx.memory.clear()
    assert ctx.state_seq_load_file(tmp_path / "s.bin", 0).tolist() == [1, 2, 3, 4]
    assert ctx.memory.seq_pos_max(0) == 3 and ctx.memory.seq_pos_max(1) == -1
    assert ctx.state_load_file(tmp_path / "w.bin").tolist() == [9]
    assert ctx.memory.seq_pos_max(0) == -1 and ctx.memory.seq_pos_max(1) == 3


@settings(deadline=None)
@given(arch=arch_st, tokens=st.lists(st.integers(0, N_VOCAB - 1), min_size=2, max_size=10),
       data=st.data())
def test_partial_seq_rm_is_refused_without_side_effects(arch, tokens, data):
    ctx = new_ctx(arch)
    decode_all(ctx, tokens)
    last = len(tokens) - 1
    p0 = data.draw(st.integers(1, last))
    p1 = data.draw(st.sampled_from([-1, last + 1, last + 5]))
    before = snapshot(ctx)
    assert ctx.memory.seq_rm(0, p0, p1) is False
    assert_same(before, snapshot(ctx))
    more = decode_all(ctx, [1, 2])
    assert np.abs(more - alone(arch, list(tokens) + [1, 2])[-2:]).max() <= TOL


@pytest.mark.parametrize("arch", ARCHS)
def test_bad_batches_change_nothing(arch):
    ctx = new_ctx(arch)
    decode_all(ctx, [1, 2, 3, 4])
    ctx.memory.seq_cp(0, 1, -1, -1)
    before = snapshot(ctx)
    bad = [
        Batch(token=[1], pos=[4], seq_id=[[3]]),  # more sequences than n_seq_max: -1
        Batch(token=[1], pos=[6]),  # a gap
        Batch(token=[1], pos=[2]),  # a state cannot rewind
        Batch(token=[N_VOCAB], pos=[4]),  # token id out of range
        Batch(token=[1], pos=[4], seq_id=[[0, 2]]),  # coupled to an empty sequence
    ]
    for batch in bad:
        assert ctx.decode(batch) == -1 and ctx.last_error
        assert_same(before, snapshot(ctx))
    # coupled sequences with equal ranges are valid, but split_equal(sequential) cannot
    # split them: no recurrent model decodes them (1, as llama.cpp)
    assert ctx.decode(Batch(token=[1], pos=[4], seq_id=[[0, 1]])) == 1
    assert_same(before, snapshot(ctx))
    with pytest.raises(ContextError, match="token ids only"):
        ctx.decode(Batch(embd=np.zeros((1, 16))))
    assert_same(before, snapshot(ctx))
    more = decode_all(ctx, [5, 6], seq=1)
    assert np.abs(more - alone(arch, [1, 2, 3, 4, 5, 6])[-2:]).max() <= TOL


@settings(deadline=None)
@given(arch=arch_st, prompt=tokens_st, cont=st.lists(st.integers(0, N_VOCAB - 1), min_size=2,
       max_size=8), n_ubatch=st.sampled_from([1, 2, 3]), abort_at=st.integers(0, 3))
def test_abort_keeps_earlier_ubatches_and_removes_the_aborted_one(arch, prompt, cont, n_ubatch,
                                                                  abort_at):
    calls = []
    ctx = new_ctx(arch, n_ubatch=n_ubatch,
                  abort_callback=lambda: calls.append(1) is None and len(calls) > abort_at)
    ctx.abort_callback, saved = None, ctx.abort_callback
    decode_all(ctx, prompt)
    ctx.abort_callback = saved
    n_ub = -(-len(cont) // n_ubatch)
    rc = ctx.decode(Batch(token=cont, logits=[True] * len(cont)))
    kept = min(abort_at, n_ub) * n_ubatch
    if abort_at >= n_ub:
        assert rc == 0
        kept = len(cont)
    else:
        assert rc == 2 and ctx.n_outputs == 0
    assert ctx.memory.seq_pos_max(0) == len(prompt) + kept - 1
    ctx.abort_callback = None
    rest = decode_all(ctx, [1])
    ref = alone(arch, list(prompt) + list(cont[:kept]) + [1])[-1:]
    assert np.abs(rest - ref).max() <= TOL
