"""The laws of decoding, as hypothesis properties of every Context and every model.

Each law is written once and runs on every flavour of ``tests/support/helpers.py`` (the
reference in float64: max error <= 1e-10, only rounding differs; the reference in float32 and
the MLX twin: NMSE <= 1e-10, what float32 rounding of a different summation order gives) and
on every model that has what it needs (``llama``; ``iswa``, a window on some layers, 1:1 as
Gemma 2, 5:1 as Gemma 3, or every layer; ``mamba`` and ``mamba2``, a recurrent state;
``qwen3moe``, Qwen3's per-head Q/K norms and a mixture of experts). Where
a law decodes a scenario on the twin, the reference decodes it too and the two agree
(NMSE <= 1e-6). "Alone" is one sequence decoded in one batch on a fresh Context, or for a
recurrent model the flavour's ``mamba_forward`` on a plain state, without a Context:

- **batched == unbatched**: each sequence's logits are those of the sequence decoded alone,
  whatever the interleaving, the cut into two batches, ``n_ubatch``, explicit or automatic
  positions, and the memory layout (one unified stream: ``split_simple``; one stream per
  sequence or a recurrent state: ``split_equal``);
- **chunked prefill == token by token == one prefill == alone**, whatever ``n_ubatch``;
- ``seq_cp`` then divergent continuations == independent decodes of the same prefix (shared
  cells, copied streams, or a shared state copied on write); ``seq_keep`` keeps one;
- **shifts** (models with the K-shift): after any mix of ``seq_add`` / ``seq_div`` /
  ``seq_rm`` / context shift on a one-layer model (where a cell's K and V depend only on its
  token and position), the next logits equal those of a *fresh* cache holding the same
  (token, position) cells; ``seq_div`` too (the law llama.cpp breaks, ``docs/divergences.md``);
- **failures change nothing**: return code 1 (no slot; a token of coupled sequences that a
  sequential split cannot place) and -1 (invalid batch, random or one of a list) leave the
  memory bit-identical, a pending K-shift still pending, and the continuation unchanged; a
  batch of embeddings decodes as its tokens, or is refused before any change by a model that
  takes token ids only; an abort (2) keeps the ubatches computed before it and removes the
  aborted one.

``split_seq`` is not exercised: the Context only uses it for embedding outputs, which it
never asks for (see ``reference/context.py``). The MLX Contexts run with their defaults, so
the ubatches go through the compiled, reused graphs. The laws of the memory's own operations
are in ``tests/laws/test_memory.py``, of its state in ``tests/laws/test_state.py``; both twins
in lock-step in ``tests/twin/test_lockstep.py``.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from reference.batch import Batch
from reference.context import ContextError
from tests.support.helpers import (
    CELLS,
    DECODE_MODELS,
    EMBD,
    K_SHIFT,
    N_VOCAB,
    RECURRENT,
    apply_op,
    apply_ops,
    assert_same,
    assert_twins_agree,
    decode_seq,
    every_flavour,
    for_layouts,
    for_models,
    fresh_cache,
    interleave,
    logits_ith,
    pending_shift,
    rows_of,
    seq_positions,
    snapshot,
)

tokens_st = st.lists(st.integers(0, N_VOCAB - 1), min_size=1, max_size=6)
every_model = for_models(models=DECODE_MODELS)


def splits_sequentially(model, kv_unified: bool) -> bool:
    """Whether the Context cuts ubatches with ``split_equal(sequential=True)``: a recurrent
    state, or one stream per sequence. A token of two sequences cannot be placed (rc 1)."""
    return model.has(RECURRENT) or not kv_unified


# ---- batched == unbatched, token by token == prefill ----------------------------------------


@st.composite
def interleavings(draw, model):
    """Sequences, an interleaving of their tokens (order inside each kept), and a cut."""
    seqs = draw(st.lists(model.prompt_st(1, 12), min_size=1, max_size=3))
    order = [s for s, t in enumerate(seqs) for _ in t]
    order = draw(st.permutations(order))
    cut = draw(st.integers(0, len(order)))
    return seqs, list(order), cut


@every_model
@every_flavour
@given(data=st.data(), n_ubatch=st.integers(1, 8), kv_unified=st.booleans(),
       auto_pos=st.booleans())
def test_batched_equals_unbatched(model, flavour, data, n_ubatch, kv_unified, auto_pos):
    variant = model.draw(data)
    seqs, order, cut = data.draw(interleavings(model), label="seqs, order, cut")
    n_seq = len(seqs)

    def batched(flavour) -> np.ndarray:
        """The interleaved tokens in two batches; every token's logits, in ``order``."""
        ctx = model.make(flavour, variant, n_ubatch=n_ubatch, n_seq_max=n_seq,
                         kv_unified=kv_unified)
        rows, k = [], [0] * n_seq
        for part in (order[:cut], order[cut:]):
            if not part:
                continue
            token, pos = [], []
            for s in part:
                token.append(seqs[s][k[s]])
                pos.append(k[s])
                k[s] += 1
            b = Batch(token=token, pos=None if auto_pos else pos, seq_id=[[s] for s in part],
                      logits=[True] * len(part))
            assert ctx.decode(b) == 0, ctx.last_error
            rows += [logits_ith(ctx, i) for i in range(len(part))]
        for s, t in enumerate(seqs):
            assert ctx.memory.seq_pos_max(s) == len(t) - 1
        return np.stack(rows)  # (n_tokens, n_vocab)

    got = batched(flavour)
    for s, t in enumerate(seqs):
        want = model.alone(flavour, t, variant)
        flavour.assert_close(want, got[[i for i, x in enumerate(order) if x == s]])
    assert_twins_agree(flavour, got, batched)


@every_model
@every_flavour
@given(data=st.data(), n_ubatch=st.sampled_from([1, 2, 3, 5, 64]))
def test_token_by_token_equals_one_prefill(model, flavour, data, n_ubatch):
    """Any cut of the prompt (chunks, one token at a time, one batch) gives the logits of the
    prompt decoded alone."""
    variant = model.draw(data)
    tokens = data.draw(model.prompt_st(1, 12), label="tokens")

    def one_prefill(flavour) -> np.ndarray:
        return decode_seq(model.make(flavour, variant, n_ubatch=n_ubatch), tokens)

    want = model.alone(flavour, tokens, variant)
    one = one_prefill(flavour)
    cuts = sorted(data.draw(st.sets(st.integers(1, max(1, len(tokens) - 1)), max_size=4),
                            label="cuts"))
    chunked_ctx, rows, start = model.make(flavour, variant, n_ubatch=n_ubatch), [], 0
    for end in [c for c in cuts if c < len(tokens)] + [len(tokens)]:
        rows.append(decode_seq(chunked_ctx, tokens[start:end]))
        start = end
    tbt_ctx, tbt = model.make(flavour, variant, n_ubatch=n_ubatch), []
    for t in tokens:
        assert tbt_ctx.decode(Batch(token=[t])) == 0
        tbt.append(logits_ith(tbt_ctx, -1))
    for out in (one, np.concatenate(rows), np.stack(tbt)):
        flavour.assert_close(want, out)
    assert chunked_ctx.memory.seq_pos_max(0) == tbt_ctx.memory.seq_pos_max(0) == len(tokens) - 1
    assert_twins_agree(flavour, one, one_prefill)


# ---- seq_cp, seq_keep -------------------------------------------------------------------------


@every_model
@every_flavour
@given(data=st.data(), conts=st.lists(tokens_st, min_size=2, max_size=3), tail=tokens_st,
       kv_unified=st.booleans(), n_ubatch=st.integers(1, 8), keep=st.integers(0, 2))
def test_seq_cp_branches_equal_independent_decodes(model, flavour, data, conts, tail,
                                                   kv_unified, n_ubatch, keep):
    """Shared cells (one stream), copied streams (one per sequence, copied at the next update)
    or a shared state (copied on write by the next ubatch), each copy from the prefix or from
    an earlier copy: every branch goes on as if alone, all in one interleaved batch; after
    ``seq_keep`` the kept one too, and the others are gone where they shared its stream."""
    variant = model.draw(data)
    prefix = data.draw(model.prompt_st(1, 6), label="prefix")
    n_seq = len(conts)
    keep = keep % n_seq
    sources = [data.draw(st.integers(0, s - 1), label=f"seq_cp source of {s}")
               for s in range(1, n_seq)]
    token, seq_id = interleave(conts)  # the continuations interleaved in one batch

    def branched(flavour):
        ctx = model.make(flavour, variant, n_seq_max=n_seq, kv_unified=kv_unified,
                         n_ubatch=n_ubatch)
        assert ctx.decode(Batch(token=prefix)) == 0
        for s, src in enumerate(sources, start=1):
            ctx.memory.seq_cp(src, s, -1, -1)
        assert ctx.decode(Batch(token=token, seq_id=seq_id, logits=[True] * len(token))) == 0
        return ctx, ctx.get_logits().copy()  # (n_tokens, n_vocab)

    ctx, logits = branched(flavour)
    for s, c in enumerate(conts):
        want = model.alone(flavour, prefix + c, variant)[len(prefix):]
        flavour.assert_close(want, rows_of(logits, seq_id, s))
    assert_twins_agree(flavour, logits, lambda f: branched(f)[1])
    ctx.memory.seq_keep(keep)
    one_pool = kv_unified or model.has(RECURRENT)  # of cells or states, for every sequence
    for s in range(n_seq):
        gone = one_pool and s != keep
        assert ctx.memory.seq_pos_max(s) == (-1 if gone else len(prefix) + len(conts[s]) - 1)
    n = len(tail)
    assert ctx.decode(Batch(token=tail, seq_id=[[keep]] * n, logits=[True] * n)) == 0
    want = model.alone(flavour, prefix + conts[keep] + tail, variant)[-n:]
    flavour.assert_close(want, ctx.get_logits())


# ---- shifts: the cache after seq_add / seq_div / context shift == a fresh cache ---------------


pos_st = st.integers(-1, 14)
ops_st = st.lists(st.one_of(
    st.tuples(st.just("seq_add"), pos_st, pos_st, st.integers(-8, 8)),
    st.tuples(st.just("seq_div"), pos_st, pos_st, st.integers(1, 4)),
    st.tuples(st.just("seq_rm"), pos_st, pos_st, st.just(0)),
    st.tuples(st.just("shift"), st.integers(0, 6), st.integers(1, 6), st.just(0)),
), min_size=1, max_size=3)


@for_models(K_SHIFT, models=DECODE_MODELS)
@every_flavour
@given(data=st.data(), ops=ops_st, cont=tokens_st, kv_unified=st.booleans())
def test_shifted_cache_equals_fresh_decode_at_shifted_positions(model, flavour, data, ops,
                                                                cont, kv_unified):
    variant = model.draw(data, one_layer=True)
    prompt = data.draw(model.prompt_st(1, 12), label="prompt")
    cells = [(t, p) for p, t in enumerate(prompt)]
    for op in ops:
        cells = apply_op(cells, op)

    def shifted(flavour):
        """The prompt, then ``ops``; returns the Context and the continuation's logits."""
        ctx = model.make(flavour, variant, n_seq_max=2, kv_unified=kv_unified)
        assert ctx.decode(Batch(token=prompt)) == 0
        apply_ops(ctx, ops)
        assert seq_positions(ctx, 0) == sorted(p for _, p in cells)
        assert ctx.decode(Batch(token=cont, logits=[True] * len(cont))) == 0
        return ctx, ctx.get_logits().copy()

    ctx, got = shifted(flavour)
    assert not pending_shift(ctx.memory)  # the K-shift ran
    fresh = fresh_cache(flavour, cells, model, variant)
    assert fresh.decode(Batch(token=cont, logits=[True] * len(cont))) == 0
    flavour.assert_close(fresh.get_logits(), got)
    assert_twins_agree(flavour, got, lambda f: shifted(f)[1])


@for_models(K_SHIFT, models=DECODE_MODELS)
@every_flavour
@given(data=st.data(), d=st.integers(2, 4), cont=tokens_st)
def test_seq_div_equals_fresh_decode_at_divided_positions(model, flavour, data, d, cont):
    """The law llama.cpp breaks (it turns K by ``p_old - p_new``; tests/oracle/test_memory.py)."""
    variant = model.draw(data, one_layer=True)
    prompt = data.draw(model.prompt_st(2, 12), label="prompt")
    ctx = model.make(flavour, variant, n_seq_max=2)
    assert ctx.decode(Batch(token=prompt)) == 0
    ctx.memory.seq_div(0, 0, -1, d)
    assert pending_shift(ctx.memory)
    fresh = fresh_cache(flavour, [(t, p // d) for p, t in enumerate(prompt)], model, variant)
    for c in (ctx, fresh):
        assert c.decode(Batch(token=cont, logits=[True] * len(cont))) == 0
    flavour.assert_close(fresh.get_logits(), ctx.get_logits())


# ---- failures change nothing ----------------------------------------------------------------


@for_models(CELLS, models=DECODE_MODELS)
@every_flavour
@given(data=st.data(), n_ubatch=st.sampled_from([5, 16, 32, 64]), extra=st.integers(57, 120),
       kv_unified=st.booleans())
def test_no_slot_leaves_memory_bit_identical(model, flavour, data, n_ubatch, extra, kv_unified):
    """rc 1 (200 cells used of 256, then 57 to 120 more): the ubatches placed before the one
    that found no slot are undone; the memory is bit-identical and the continuation too."""
    variant = model.draw(data)
    rng = np.random.default_rng(extra)
    prompt = rng.integers(0, N_VOCAB, 200).tolist()
    ctx = model.make(flavour, variant, n_ubatch=n_ubatch, kv_unified=kv_unified)
    assert ctx.decode(Batch(token=prompt)) == 0
    before = snapshot(ctx)
    assert ctx.decode(Batch(token=rng.integers(0, N_VOCAB, extra).tolist())) == 1
    assert_same(before, snapshot(ctx))
    assert ctx.decode(Batch(token=[1, 2], logits=[True, True])) == 0
    straight = model.make(flavour, variant, n_ubatch=n_ubatch, kv_unified=kv_unified)
    assert straight.decode(Batch(token=prompt)) == 0
    assert straight.decode(Batch(token=[1, 2], logits=[True, True])) == 0
    np.testing.assert_array_equal(straight.get_logits(), ctx.get_logits())


batch_st = st.fixed_dictionaries({
    "token": st.lists(st.integers(-1, N_VOCAB), min_size=1, max_size=5),
    "pos": st.one_of(st.none(), st.lists(st.integers(0, 8), min_size=5, max_size=5)),
    "seq_id": st.one_of(st.none(), st.lists(st.lists(st.integers(-1, 2), min_size=1,
                                                      max_size=2), min_size=5, max_size=5)),
})


@every_model
@every_flavour
@given(data=st.data(), b=batch_st, kv_unified=st.booleans())
def test_invalid_batch_changes_nothing(model, flavour, data, b, kv_unified):
    """A random batch, mostly invalid (-1). A token of two sequences that a sequential split
    cannot place (one stream per sequence, a recurrent state; as llama.cpp): 1. Either
    failure leaves the memory bit-identical."""
    variant = model.draw(data)
    prompt = data.draw(st.lists(model.prompt_st(1, 6), min_size=2, max_size=2), label="prompt")
    ctx = model.make(flavour, variant, n_seq_max=2, kv_unified=kv_unified)
    for s, t in enumerate(prompt):
        assert ctx.decode(Batch(token=t, seq_id=[[s]] * len(t), logits=[True] * len(t))) == 0
    n = len(b["token"])
    batch = Batch(token=b["token"], pos=None if b["pos"] is None else b["pos"][:n],
                  seq_id=None if b["seq_id"] is None else b["seq_id"][:n])
    ctx.memory_update()
    before = snapshot(ctx)
    rc = ctx.decode(batch)
    sequential = splits_sequentially(model, kv_unified)
    assert rc in (0, -1) or (rc == 1 and sequential), (rc, ctx.last_error)
    if rc != 0:
        assert_same(before, snapshot(ctx))
    else:
        assert ctx.n_outputs == 1


#: seq 0 holds positions 0 .. P - 1; seq 1 is its copy, one token further; seq 2 its copy
P = 10
BAD_BATCHES = {
    "a gap": Batch(token=[1], pos=[P + 2]),
    "the last position again": Batch(token=[1], pos=[P - 1]),
    "a position back": Batch(token=[1], pos=[P - 2]),
    "a hole inside the batch": Batch(token=[1, 2], pos=[P, P + 2]),
    "decreasing": Batch(token=[1, 2], pos=[P + 1, P]),
    "token id out of range": Batch(token=[N_VOCAB], pos=[P]),
    "seq id >= n_seq_max": Batch(token=[1], pos=[0], seq_id=[[4]]),
    "negative seq id": Batch(token=[1], seq_id=[[-1]]),
    "coupled to an empty sequence": Batch(token=[1], pos=[P], seq_id=[[0, 3]]),
    "coupled to a sequence that went on": Batch(token=[1], pos=[P + 1], seq_id=[[1, 0]]),
    "more tokens than n_batch": Batch(token=list(range(20)) * 14),
}


def three_sequences(model, flavour, kv_unified: bool = True):
    """A Context of ``model`` with n_seq_max = 4: seq 0 holds ``1 .. P``, seq 1 is its copy
    that went on with token 5, seq 2 its copy, seq 3 is empty."""
    ctx = model.make(flavour, n_seq_max=4, kv_unified=kv_unified)
    decode_seq(ctx, list(range(1, P + 1)))
    ctx.memory.seq_cp(0, 1, -1, -1)
    ctx.memory.seq_cp(0, 2, -1, -1)
    decode_seq(ctx, [5], seq=1)
    return ctx


def assert_three_sequences_go_on(model, flavour, ctx) -> None:
    """Sequences 2 and 1 of :func:`three_sequences` go on as if alone."""
    prompt = list(range(1, P + 1))
    flavour.assert_close(model.alone(flavour, prompt + [7])[-1:], decode_seq(ctx, [7], seq=2))
    flavour.assert_close(model.alone(flavour, prompt + [5, 9])[-1:], decode_seq(ctx, [9], seq=1))


@every_model
@every_flavour
@pytest.mark.parametrize("bad", list(BAD_BATCHES))
def test_invalid_batch_returns_minus_1_and_changes_nothing(model, flavour, bad):
    """Each batch of the list is refused (-1, with a message) before anything changes, and
    the sequences go on as if it never came."""
    ctx = three_sequences(model, flavour)
    before = snapshot(ctx)
    assert ctx.decode(BAD_BATCHES[bad]) == -1
    assert ctx.last_error
    assert_same(before, snapshot(ctx))
    assert_three_sequences_go_on(model, flavour, ctx)


@for_layouts(models=DECODE_MODELS)
@every_flavour
def test_a_token_of_coupled_sequences_decodes_or_returns_1(model, kv_unified, flavour):
    """Two sequences with equal ranges (seq 2 is a copy of seq 0) share a token: one stream
    decodes it for both; a sequential split cannot place it: 1 (as llama.cpp, which no
    recurrent model decodes), the memory bit-identical, the sequences go on."""
    ctx = three_sequences(model, flavour, kv_unified)
    ctx.memory_update()  # the copy into another stream, if any
    before = snapshot(ctx)
    rc = ctx.decode(Batch(token=[7], pos=[P], seq_id=[[0, 2]], logits=[True]))
    if splits_sequentially(model, kv_unified):
        assert rc == 1 and "coupled" in ctx.last_error
        assert_same(before, snapshot(ctx))
        assert_three_sequences_go_on(model, flavour, ctx)
    else:
        assert rc == 0 and ctx.memory.seq_pos_max(0) == ctx.memory.seq_pos_max(2) == P
        want = model.alone(flavour, list(range(1, P + 1)) + [7])[-1:]
        flavour.assert_close(want, ctx.get_logits())


@every_model
@every_flavour
def test_a_batch_of_embeddings_decodes_as_its_tokens_or_is_refused(model, flavour):
    """``Batch(embd=token_embd[tokens])`` is the batch of ``tokens`` whose ``get_rows`` the
    caller did; a model that takes token ids only refuses it (``ContextError``) before
    anything changes."""
    hp, w = model.weights(flavour.dtype)
    tokens = [3, 1, 4, 1, 5]
    embd = np.asarray(w["token_embd.weight"])[tokens]  # (n_tokens, n_embd)
    ctx = model.make(flavour)
    decode_seq(ctx, [2, 7])
    if model.has(EMBD):
        assert ctx.decode(Batch(embd=embd, logits=[True] * len(tokens))) == 0
        want = model.alone(flavour, [2, 7] + tokens)[2:]
        flavour.assert_close(want, ctx.get_logits())
        return
    before = snapshot(ctx)
    with pytest.raises(ContextError, match="token ids only"):
        ctx.decode(Batch(embd=embd))
    assert_same(before, snapshot(ctx))


@for_layouts(K_SHIFT, models=DECODE_MODELS)
@every_flavour
def test_invalid_batch_after_a_pending_shift_keeps_the_shift_pending(model, kv_unified,
                                                                     flavour):
    """A rejected batch returns before the memory update: the K-shift stays pending and the
    keys stay roped at the old positions."""
    variant = model.one_layer[0]
    ctx = model.make(flavour, variant, n_seq_max=2, kv_unified=kv_unified)
    assert ctx.decode(Batch(token=[1, 2, 3, 4, 5, 6])) == 0
    ctx.memory.seq_add(0, 2, -1, 3)
    before = snapshot(ctx)
    assert ctx.decode(Batch(token=[7], pos=[4])) == -1  # seq 0 must go on at 9
    assert pending_shift(ctx.memory)
    assert_same(before, snapshot(ctx))
    assert ctx.decode(Batch(token=[7], logits=[True])) == 0
    cells = [(1, 0), (2, 1), (3, 5), (4, 6), (5, 7), (6, 8)]
    fresh = fresh_cache(flavour, cells, model, variant)
    assert fresh.decode(Batch(token=[7], logits=[True])) == 0
    flavour.assert_close(fresh.get_logits(), ctx.get_logits())


@every_model
@every_flavour
@given(data=st.data(), cont=st.lists(st.integers(0, N_VOCAB - 1), min_size=2, max_size=9),
       n_ubatch=st.integers(1, 4), abort_at=st.integers(0, 3))
def test_abort_keeps_earlier_ubatches_and_removes_the_aborted_one(model, flavour, data, cont,
                                                                  n_ubatch, abort_at):
    """rc 2: the ubatches computed before the abort stay (their cells and K/V, or their state
    rows), the aborted one is removed, and the decode goes on as if only the kept tokens had
    come."""
    variant = model.draw(data)
    prompt = data.draw(model.prompt_st(1, 12), label="prompt")
    calls = []

    def abort() -> bool:
        calls.append(1)
        return len(calls) > abort_at

    ctx = model.make(flavour, variant, n_ubatch=n_ubatch)
    decode_seq(ctx, prompt)
    ctx.abort_callback = abort
    n_ub = -(-len(cont) // n_ubatch)
    rc = ctx.decode(Batch(token=cont, logits=[True] * len(cont)))
    kept = len(cont) if abort_at >= n_ub else abort_at * n_ubatch
    assert rc == (0 if abort_at >= n_ub else 2)
    if rc == 2:
        assert ctx.n_outputs == 0
    assert ctx.memory.seq_pos_max(0) == len(prompt) + kept - 1
    ctx.abort_callback = None
    want = model.alone(flavour, list(prompt) + list(cont[:kept]) + [1], variant)[-1:]
    flavour.assert_close(want, decode_seq(ctx, [1]))
