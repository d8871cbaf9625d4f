"""Properties of Mamba and Mamba-2 decoded through every Context.

The Context gives a recurrent model a ``RecurrentMemory`` (one cell per sequence; MLX state
rows in the twin, the same cells), splits batches with ``split_equal(sequential=True)`` and
runs its ``mamba_forward``. Each law runs on every flavour of ``tests/support/helpers.py``
(reference float64: max error <= 1e-10; reference float32 and MLX: NMSE <= 1e-10), for both
architectures; where a law decodes a scenario on the twin, the reference decodes it too
and the two agree (NMSE <= 1e-6):

- chunked prefill == token by token == one prefill, whatever ``n_ubatch``, and == the
  flavour's ``mamba_forward`` on a plain ``SimpleRecurrentState`` (no Context);
- several sequences interleaved in one batch == each decoded alone;
- ``seq_cp`` then divergent continuations == independent decodes (the copy shares the state,
  the next ubatch copies it on write); after ``seq_keep`` the kept one goes on alone;
- save, clear, restore, continue == uninterrupted (whole context and one sequence; files);
- a partial ``seq_rm`` returns False and changes nothing (cells and rows bit-identical);
- invalid batches (-1), coupled sequences (1), an aborted ubatch (2) change nothing.

State blobs that cross between the twins: ``tests/laws/test_state.py``.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from reference.batch import Batch
from reference.context import ContextError, context_sizes, is_recurrent
from tests.support.helpers import (
    ARCHS,
    N_VOCAB,
    assert_same,
    assert_twins_agree,
    decode_seq,
    deep,
    every_flavour,
    interleave,
    logits_ith,
    make_mamba,
    mamba_alone,
    mamba_model,
    rows_of,
    snapshot,
)

tokens_st = st.lists(st.integers(0, N_VOCAB - 1), min_size=1, max_size=12)
arch_st = st.sampled_from(ARCHS)
n_ubatch_st = st.sampled_from([1, 2, 3, 5, 64])


@every_flavour
def test_the_context_picks_the_recurrent_memory(flavour):
    ctx = make_mamba(flavour, "mamba", n_seq_max=4)
    assert is_recurrent(ctx.hparams)
    assert type(ctx.memory).__name__ == "RecurrentMemory"
    assert type(ctx.memory).__module__ == f"{flavour.package}.memory.recurrent"
    assert ctx.memory.get_size() == 4 and ctx.memory.n_seq_max == 4
    assert ctx.memory_update() is False  # no K-shift
    hp = mamba_model("mamba", flavour.dtype)[0]
    # the sizes are cparams: the same as for a KV cache model
    assert (ctx.n_ctx, ctx.n_batch, ctx.n_ubatch, ctx.n_seq_max) == tuple(
        context_sizes(256, 64, 64, 4, True, hp.n_ctx_train)[k]
        for k in ("n_ctx", "n_batch", "n_ubatch", "n_seq_max"))
    one = make_mamba(flavour, "mamba2", n_seq_max=0)
    assert one.memory.get_size() == 1


@every_flavour
@given(arch=arch_st, tokens=tokens_st, n_ubatch=n_ubatch_st, data=st.data())
def test_chunked_prefill_equals_token_by_token_equals_one_prefill(flavour, arch, tokens,
                                                                  n_ubatch, data):
    """A recurrent state carries everything: any cut of the prompt gives the same logits."""
    want = mamba_alone(flavour, arch, tokens)
    one = decode_seq(make_mamba(flavour, arch, n_ubatch=n_ubatch), tokens)
    cuts = sorted(data.draw(st.sets(st.integers(1, max(1, len(tokens) - 1)), max_size=4)))
    chunked_ctx, rows, start = make_mamba(flavour, arch, n_ubatch=n_ubatch), [], 0
    for end in [c for c in cuts if c < len(tokens)] + [len(tokens)]:
        rows.append(decode_seq(chunked_ctx, tokens[start:end]))
        start = end
    tbt_ctx, tbt = make_mamba(flavour, arch, n_ubatch=n_ubatch), []
    for t in tokens:
        assert tbt_ctx.decode(Batch(token=[t])) == 0
        tbt.append(logits_ith(tbt_ctx, -1))
    for out in (one, np.concatenate(rows), np.stack(tbt)):
        flavour.assert_close(want, out)
    assert chunked_ctx.memory.seq_pos_max(0) == len(tokens) - 1
    assert_twins_agree(flavour, one,
                       lambda f: decode_seq(make_mamba(f, arch, n_ubatch=n_ubatch), tokens))


@every_flavour
@given(arch=arch_st, seqs=st.lists(tokens_st, min_size=2, max_size=3), n_ubatch=n_ubatch_st,
       conts=st.lists(tokens_st, min_size=3, max_size=3))
def test_interleaved_sequences_equal_each_alone(flavour, arch, seqs, n_ubatch, conts):
    """``split_equal(sequential=True)`` cuts the batch into equal sets: each sequence's logits
    are those it gets alone, over two batches (explicit positions, then from the memory)."""
    token, seq_id = interleave(seqs)
    pos = [sum(x == s for x in seq_id[:i]) for i, s in enumerate(seq_id)]
    token2 = [t for s in range(len(seqs)) for t in conts[s]]
    seq2 = [[s] for s in range(len(seqs)) for _ in conts[s]]

    def interleaved(flavour) -> np.ndarray:
        ctx = make_mamba(flavour, arch, n_ubatch=n_ubatch)
        out = []
        for b in (Batch(token=token, pos=pos, seq_id=seq_id, logits=[True] * len(token)),
                  Batch(token=token2, seq_id=seq2, logits=[True] * len(token2))):
            assert ctx.decode(b) == 0
            out.append(ctx.get_logits().copy())
        for s, t in enumerate(seqs):
            assert ctx.memory.seq_pos_max(s) == len(t) + len(conts[s]) - 1
        return np.concatenate(out)  # (n_tokens of both batches, n_vocab)

    got = interleaved(flavour)
    first, second = got[:len(token)], got[len(token):]
    for s, t in enumerate(seqs):
        want = mamba_alone(flavour, arch, list(t) + list(conts[s]))
        flavour.assert_close(want, np.concatenate([rows_of(first, seq_id, s),
                                                   rows_of(second, seq2, s)]))
    assert_twins_agree(flavour, got, interleaved)


@every_flavour
@given(arch=arch_st, prefix=tokens_st, branches=st.lists(tokens_st, min_size=3, max_size=3),
       n_ubatch=n_ubatch_st, keep=st.integers(0, 2), more=tokens_st)
def test_seq_cp_then_divergence_equals_independent_decodes(flavour, arch, prefix, branches,
                                                           n_ubatch, keep, more):
    """``seq_cp`` shares the state, the next ubatch copies it on write; after ``seq_keep``
    the kept branch goes on alone."""
    n = len(prefix)
    token = [t for b in branches for t in b]
    seq_id = [[s] for s, b in enumerate(branches) for _ in b]
    pos = [n + k for b in branches for k in range(len(b))]

    def branched(flavour):
        ctx = make_mamba(flavour, arch, n_ubatch=n_ubatch)
        decode_seq(ctx, prefix)
        ctx.memory.seq_cp(0, 1, -1, -1)
        ctx.memory.seq_cp(1, 2, -1, -1)
        assert ctx.decode(Batch(token=token, pos=pos, seq_id=seq_id,
                                logits=[True] * len(token))) == 0
        return ctx, ctx.get_logits().copy()

    ctx, logits = branched(flavour)
    for s, b in enumerate(branches):
        want = mamba_alone(flavour, arch, list(prefix) + list(b))[n:]
        flavour.assert_close(want, rows_of(logits, seq_id, s))
    assert_twins_agree(flavour, logits, lambda f: branched(f)[1])
    ctx.memory.seq_keep(keep)
    assert [ctx.memory.seq_pos_max(s) == -1 for s in range(3)] == [s != keep for s in range(3)]
    got = decode_seq(ctx, more, seq=keep)
    want = mamba_alone(flavour, arch, list(prefix) + list(branches[keep]) + list(more))
    flavour.assert_close(want[-len(more):], got)


@every_flavour
@deep()
@given(arch=arch_st, a=tokens_st, b=tokens_st, cont=tokens_st, whole=st.booleans())
def test_save_clear_restore_continue_equals_uninterrupted(flavour, arch, a, b, cont, whole):
    ctx = make_mamba(flavour, arch)
    decode_seq(ctx, a, seq=0)
    decode_seq(ctx, b, seq=1)
    if whole:
        blob = ctx.state_get_data()
        outputs = ctx.get_logits().copy()
        ctx.memory.clear()
        decode_seq(ctx, cont, seq=2)  # something else in between
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
    got = decode_seq(ctx, cont, seq=dest)
    flavour.assert_close(mamba_alone(flavour, arch, list(a) + list(cont))[len(a):], got)
    if whole:
        want = mamba_alone(flavour, arch, list(b) + list(cont))[len(b):]
        flavour.assert_close(want, decode_seq(ctx, cont, seq=1))


@every_flavour
@pytest.mark.parametrize("arch", ARCHS)
def test_state_files_through_the_context(flavour, arch, tmp_path):
    ctx = make_mamba(flavour, arch)
    decode_seq(ctx, [1, 2, 3, 4], seq=1)
    ctx.state_seq_save_file(tmp_path / "s.bin", 1, [1, 2, 3, 4])
    ctx.state_save_file(tmp_path / "w.bin", [9])
    ctx.memory.clear()
    assert ctx.state_seq_load_file(tmp_path / "s.bin", 0).tolist() == [1, 2, 3, 4]
    assert ctx.memory.seq_pos_max(0) == 3 and ctx.memory.seq_pos_max(1) == -1
    assert ctx.state_load_file(tmp_path / "w.bin").tolist() == [9]
    assert ctx.memory.seq_pos_max(0) == -1 and ctx.memory.seq_pos_max(1) == 3


@every_flavour
@given(arch=arch_st, tokens=st.lists(st.integers(0, N_VOCAB - 1), min_size=2, max_size=10),
       data=st.data())
def test_partial_seq_rm_is_refused_without_side_effects(flavour, arch, tokens, data):
    ctx = make_mamba(flavour, arch)
    decode_seq(ctx, tokens)
    last = len(tokens) - 1
    p0 = data.draw(st.integers(1, last))
    p1 = data.draw(st.sampled_from([-1, last + 1, last + 5]))
    before = snapshot(ctx)
    assert ctx.memory.seq_rm(0, p0, p1) is False
    assert_same(before, snapshot(ctx))
    more = decode_seq(ctx, [1, 2])
    flavour.assert_close(mamba_alone(flavour, arch, list(tokens) + [1, 2])[-2:], more)
    assert ctx.memory.seq_rm(0, -1, -1) is True  # the whole sequence: a zero state again
    flavour.assert_close(mamba_alone(flavour, arch, [3, 4]), decode_seq(ctx, [3, 4]))


@every_flavour
@pytest.mark.parametrize("arch", ARCHS)
def test_bad_batches_change_nothing(flavour, arch):
    """-1 for invalid batches, 1 for a token of two coupled sequences (``split_equal`` with
    ``sequential=True`` cannot split them; no recurrent model decodes them, as llama.cpp),
    an error for embeddings; the cells and rows are bit-identical after each, and the decode
    goes on as if they never happened."""
    ctx = make_mamba(flavour, arch)
    decode_seq(ctx, [1, 2, 3, 4])
    ctx.memory.seq_cp(0, 1, -1, -1)  # sequence 1 shares sequence 0's state; 2 is empty
    before = snapshot(ctx)
    bad = [
        Batch(token=[1], pos=[4], seq_id=[[3]]),  # more sequences than n_seq_max
        Batch(token=[1], pos=[6]),  # a gap
        Batch(token=[1], pos=[2]),  # a state cannot rewind
        Batch(token=[1], pos=[3]),  # nor repeat its last position
        Batch(token=[N_VOCAB], pos=[4]),  # token id out of range
        Batch(token=[1, 2], pos=[4, 6]),  # a hole inside the batch
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
    decode_seq(ctx, [5], seq=1)  # sequence 1 has its own state now
    ctx.memory.seq_cp(0, 2, -1, -1)  # sequence 2 shares sequence 0's
    before = snapshot(ctx)
    assert ctx.decode(Batch(token=[1], pos=[5], seq_id=[[1, 0]])) == -1  # 0 goes on at 4
    assert_same(before, snapshot(ctx))
    assert ctx.decode(Batch(token=[7], pos=[4], seq_id=[[0, 2]])) == 1
    assert_same(before, snapshot(ctx))
    flavour.assert_close(mamba_alone(flavour, arch, [1, 2, 3, 4, 5, 6])[-2:],
                         decode_seq(ctx, [5, 6], seq=2))
    flavour.assert_close(mamba_alone(flavour, arch, [1, 2, 3, 4, 5, 9])[-1:],
                         decode_seq(ctx, [9], seq=1))


@every_flavour
@given(arch=arch_st, prompt=tokens_st, cont=st.lists(st.integers(0, N_VOCAB - 1), min_size=2,
       max_size=8), n_ubatch=st.integers(1, 4), abort_at=st.integers(0, 3))
def test_abort_keeps_earlier_ubatches_and_removes_the_aborted_one(flavour, arch, prompt, cont,
                                                                  n_ubatch, abort_at):
    """rc 2: the ubatches computed before the abort stay (their state rows too), the aborted
    one is removed, and the decode goes on as if only the kept tokens had come."""
    calls = []
    ctx = make_mamba(flavour, arch, n_ubatch=n_ubatch,
                     abort_callback=lambda: calls.append(1) is None and len(calls) > abort_at)
    ctx.abort_callback, saved = None, ctx.abort_callback
    decode_seq(ctx, prompt)
    ctx.abort_callback = saved
    n_ub = -(-len(cont) // n_ubatch)
    rc = ctx.decode(Batch(token=cont, logits=[True] * len(cont)))
    kept = len(cont) if abort_at >= n_ub else abort_at * n_ubatch
    assert rc == (0 if abort_at >= n_ub else 2)
    if rc == 2:
        assert ctx.n_outputs == 0
    assert ctx.memory.seq_pos_max(0) == len(prompt) + kept - 1
    ctx.abort_callback = None
    want = mamba_alone(flavour, arch, list(prompt) + list(cont[:kept]) + [1])[-1:]
    flavour.assert_close(want, decode_seq(ctx, [1]))
