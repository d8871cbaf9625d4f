"""The laws of decoding, as hypothesis properties of every Context.

Each law runs on every flavour of ``tests/support/helpers.py``: the reference in float64 (max error
<= 1e-10: only rounding differs), the reference in float32 and the MLX twin (NMSE <= 1e-10,
what float32 rounding of a different summation order gives). Where a law decodes a scenario
on the twin, the reference decodes it too and the two agree (NMSE <= 1e-6):

- **batched == unbatched**: each sequence's logits are those of the sequence decoded alone,
  whatever the interleaving, the cut into two batches, ``n_ubatch``, explicit or automatic
  positions, and the cache layout (one unified stream: ``split_simple``; one stream per
  sequence: ``split_equal``);
- **token by token == one prefill**;
- **shifts**: after any mix of ``seq_add`` / ``seq_div`` / ``seq_rm`` / context shift on a
  one-layer model (where a cell's K and V depend only on its token and position), the next
  logits equal those of a *fresh* cache holding the same (token, position) cells: the
  K-shift; ``seq_div`` too (the law llama.cpp breaks, ``docs/divergences.md``);
- ``seq_cp`` then divergent continuations == independent decodes of the same prefix;
  ``seq_keep``; partial ``seq_rm`` then re-decode == fresh decode;
- return code 1 (no slot) and -1 (invalid batch) leave the memory bit-identical, a pending
  K-shift still pending, and the continuation unchanged; an abort (2) keeps the ubatches
  computed before it and removes the aborted one.

``split_seq`` is not exercised: the Context only uses it for embedding outputs, which it
never asks for (see ``reference/context.py``). The MLX Contexts run with their defaults, so
the ubatches go through the compiled, reused graphs. Mamba's laws are in
``tests/laws/test_context_mamba.py``; both twins in lock-step in ``tests/twin/test_lockstep.py``.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from reference.batch import Batch
from tests.support.helpers import (
    N_VOCAB,
    alone,
    apply_op,
    apply_ops,
    assert_same,
    assert_twins_agree,
    decode_seq,
    every_flavour,
    fresh_cache,
    interleave,
    logits_ith,
    make,
    seq_positions,
    snapshot,
)

tokens_st = st.lists(st.integers(0, N_VOCAB - 1), min_size=1, max_size=6)


def n_ctx(kv_unified: bool, n_seq: int) -> int:
    """256 cells per stream."""
    return 256 * (1 if kv_unified else n_seq)


# ---- batched == unbatched, token by token == prefill ----------------------------------------


@st.composite
def interleavings(draw):
    """Sequences, an interleaving of their tokens (order inside each kept), and a cut."""
    seqs = draw(st.lists(tokens_st, min_size=1, max_size=3))
    order = [s for s, t in enumerate(seqs) for _ in t]
    order = draw(st.permutations(order))
    cut = draw(st.integers(0, len(order)))
    return seqs, list(order), cut


@every_flavour
@given(case=interleavings(), n_ubatch=st.integers(1, 8), kv_unified=st.booleans(),
       auto_pos=st.booleans())
def test_batched_equals_unbatched(flavour, case, n_ubatch, kv_unified, auto_pos):
    seqs, order, cut = case
    n_seq = len(seqs)

    def batched(flavour) -> np.ndarray:
        """The interleaved tokens in two batches; every token's logits, in ``order``."""
        ctx = make(flavour, n_ubatch=n_ubatch, n_seq_max=n_seq, kv_unified=kv_unified,
                   n_ctx=n_ctx(kv_unified, n_seq))
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
            assert ctx.decode(b) == 0
            rows += [logits_ith(ctx, i) for i in range(len(part))]
        return np.stack(rows)  # (n_tokens, n_vocab)

    got = batched(flavour)
    for s, t in enumerate(seqs):
        flavour.assert_close(alone(flavour, t), got[[i for i, x in enumerate(order) if x == s]])
    assert_twins_agree(flavour, got, batched)


@every_flavour
@given(tokens=st.lists(st.integers(0, N_VOCAB - 1), min_size=1, max_size=10))
def test_token_by_token_equals_one_prefill(flavour, tokens):
    ctx = make(flavour)
    rows = []
    for t in tokens:
        assert ctx.decode(Batch(token=[t])) == 0
        rows.append(logits_ith(ctx, -1))
    prefill = alone(flavour, tokens)
    flavour.assert_close(prefill, np.stack(rows))
    assert_twins_agree(flavour, prefill, lambda f: alone(f, tokens))


# ---- shifts: the cache after seq_add / seq_div / context shift == a fresh cache ---------------


pos_st = st.integers(-1, 14)
ops_st = st.lists(st.one_of(
    st.tuples(st.just("seq_add"), pos_st, pos_st, st.integers(-8, 8)),
    st.tuples(st.just("seq_div"), pos_st, pos_st, st.integers(1, 4)),
    st.tuples(st.just("seq_rm"), pos_st, pos_st, st.just(0)),
    st.tuples(st.just("shift"), st.integers(0, 6), st.integers(1, 6), st.just(0)),
), min_size=1, max_size=3)


@every_flavour
@given(prompt=st.lists(st.integers(0, N_VOCAB - 1), min_size=1, max_size=12), ops=ops_st,
       cont=tokens_st, kv_unified=st.booleans())
def test_shifted_cache_equals_fresh_decode_at_shifted_positions(flavour, prompt, ops, cont,
                                                                kv_unified):
    cells = [(t, p) for p, t in enumerate(prompt)]
    for op in ops:
        cells = apply_op(cells, op)

    def shifted(flavour):
        """The prompt, then ``ops``; returns the Context and the continuation's logits."""
        ctx = make(flavour, n_layer=1, n_seq_max=2, kv_unified=kv_unified,
                   n_ctx=n_ctx(kv_unified, 2))
        assert ctx.decode(Batch(token=prompt)) == 0
        apply_ops(ctx, ops)
        assert seq_positions(ctx, 0) == sorted(p for _, p in cells)
        assert ctx.decode(Batch(token=cont, logits=[True] * len(cont))) == 0
        return ctx, ctx.get_logits().copy()

    ctx, got = shifted(flavour)
    assert not ctx.memory.get_has_shift()  # the K-shift ran
    fresh = fresh_cache(flavour, cells)
    assert fresh.decode(Batch(token=cont, logits=[True] * len(cont))) == 0
    flavour.assert_close(fresh.get_logits(), got)
    assert_twins_agree(flavour, got, lambda f: shifted(f)[1])


@every_flavour
@given(prompt=st.lists(st.integers(0, N_VOCAB - 1), min_size=2, max_size=12),
       d=st.integers(2, 4), cont=tokens_st)
def test_seq_div_equals_fresh_decode_at_divided_positions(flavour, prompt, d, cont):
    """The law llama.cpp breaks (it turns K by ``p_old - p_new``; tests/oracle/test_memory.py)."""
    ctx = make(flavour, n_layer=1, n_seq_max=2)
    assert ctx.decode(Batch(token=prompt)) == 0
    ctx.memory.seq_div(0, 0, -1, d)
    assert ctx.memory.get_has_shift()
    fresh = fresh_cache(flavour, [(t, p // d) for p, t in enumerate(prompt)])
    for c in (ctx, fresh):
        assert c.decode(Batch(token=cont, logits=[True] * len(cont))) == 0
    flavour.assert_close(fresh.get_logits(), ctx.get_logits())


# ---- seq_cp, seq_keep, seq_rm ---------------------------------------------------------------


@every_flavour
@given(prefix=tokens_st, conts=st.lists(tokens_st, min_size=2, max_size=3),
       tail=tokens_st, kv_unified=st.booleans(), n_ubatch=st.integers(1, 8),
       keep=st.integers(0, 2))
def test_seq_cp_branches_equal_independent_decodes(flavour, prefix, conts, tail, kv_unified,
                                                   n_ubatch, keep):
    """Shared cells (one stream) or copied streams (one per sequence, copied at the next
    update): every branch goes on as if alone; after ``seq_keep`` the kept one too."""
    n_seq = len(conts)
    keep = keep % n_seq
    ctx = make(flavour, n_seq_max=n_seq, kv_unified=kv_unified, n_ubatch=n_ubatch,
               n_ctx=n_ctx(kv_unified, n_seq))
    assert ctx.decode(Batch(token=prefix)) == 0
    for s in range(1, n_seq):
        ctx.memory.seq_cp(0, s, -1, -1)
    token, seq_id = interleave(conts)  # the continuations interleaved in one batch
    assert ctx.decode(Batch(token=token, seq_id=seq_id, logits=[True] * len(token))) == 0
    for s, c in enumerate(conts):
        rows = np.stack([ctx.get_logits_ith(i) for i, x in enumerate(seq_id) if x == [s]])
        flavour.assert_close(alone(flavour, prefix + c)[len(prefix):], rows)
    # seq_keep: the kept branch goes on as if alone; with one stream the others are gone
    ctx.memory.seq_keep(keep)
    for s in range(n_seq):
        gone = kv_unified and s != keep
        assert ctx.memory.seq_pos_max(s) == (-1 if gone else len(prefix) + len(conts[s]) - 1)
    n = len(tail)
    assert ctx.decode(Batch(token=tail, seq_id=[[keep]] * n, logits=[True] * n)) == 0
    flavour.assert_close(alone(flavour, prefix + conts[keep] + tail)[-n:], ctx.get_logits())


@every_flavour
@given(prompt=st.lists(st.integers(0, N_VOCAB - 1), min_size=1, max_size=12),
       k=st.integers(0, 12), cont=tokens_st, kv_unified=st.booleans())
def test_partial_seq_rm_then_redecode_equals_fresh(flavour, prompt, k, cont, kv_unified):
    k = min(k, len(prompt))
    ctx = make(flavour, kv_unified=kv_unified, n_ubatch=3)
    assert ctx.decode(Batch(token=prompt)) == 0
    assert ctx.memory.seq_rm(0, k, -1) is True
    assert ctx.memory.seq_pos_max(0) == k - 1
    n = len(cont)
    assert ctx.decode(Batch(token=cont, logits=[True] * n)) == 0
    flavour.assert_close(alone(flavour, prompt[:k] + cont)[k:], ctx.get_logits())


# ---- failures change nothing ----------------------------------------------------------------


@every_flavour
@given(n_ubatch=st.sampled_from([5, 16, 32, 64]), extra=st.integers(57, 120),
       kv_unified=st.booleans())
def test_no_slot_leaves_memory_bit_identical(flavour, n_ubatch, extra, kv_unified):
    """rc 1 (200 cells used of 256, then 57 to 120 more): the ubatches placed before the one
    that found no slot are undone; the memory is bit-identical and the continuation too."""
    rng = np.random.default_rng(extra)
    prompt = rng.integers(0, N_VOCAB, 200).tolist()
    ctx = make(flavour, n_ubatch=n_ubatch, kv_unified=kv_unified)
    assert ctx.decode(Batch(token=prompt)) == 0
    before = snapshot(ctx)
    assert ctx.decode(Batch(token=rng.integers(0, N_VOCAB, extra).tolist())) == 1
    assert_same(before, snapshot(ctx))
    assert ctx.decode(Batch(token=[1, 2], logits=[True, True])) == 0
    straight = make(flavour, n_ubatch=n_ubatch, kv_unified=kv_unified)
    assert straight.decode(Batch(token=prompt)) == 0
    assert straight.decode(Batch(token=[1, 2], logits=[True, True])) == 0
    np.testing.assert_array_equal(straight.get_logits(), ctx.get_logits())


batch_st = st.fixed_dictionaries({
    "token": st.lists(st.integers(-1, N_VOCAB), min_size=1, max_size=5),
    "pos": st.one_of(st.none(), st.lists(st.integers(0, 8), min_size=5, max_size=5)),
    "seq_id": st.one_of(st.none(), st.lists(st.lists(st.integers(-1, 2), min_size=1,
                                                      max_size=2), min_size=5, max_size=5)),
})


@every_flavour
@given(prompt=st.lists(tokens_st, min_size=2, max_size=2), b=batch_st,
       kv_unified=st.booleans())
def test_invalid_batch_changes_nothing(flavour, prompt, b, kv_unified):
    """A random batch, mostly invalid (-1). With one stream per sequence, a token of two
    sequences cannot be split (``split_equal(sequential=True)``, as llama.cpp): 1. Either
    failure leaves the memory bit-identical."""
    ctx = make(flavour, n_seq_max=2, kv_unified=kv_unified, n_ctx=n_ctx(kv_unified, 2))
    for s, t in enumerate(prompt):
        assert ctx.decode(Batch(token=t, seq_id=[[s]] * len(t), logits=[True] * len(t))) == 0
    n = len(b["token"])
    batch = Batch(token=b["token"], pos=None if b["pos"] is None else b["pos"][:n],
                  seq_id=None if b["seq_id"] is None else b["seq_id"][:n])
    ctx.memory_update()
    before = snapshot(ctx)
    rc = ctx.decode(batch)
    assert rc in (0, -1) or (rc == 1 and not kv_unified), (rc, ctx.last_error)
    if rc != 0:
        assert_same(before, snapshot(ctx))
    else:
        assert ctx.n_outputs == 1


@every_flavour
@pytest.mark.parametrize("kv_unified", [True, False])
def test_invalid_batch_after_a_pending_shift_keeps_the_shift_pending(flavour, kv_unified):
    """A rejected batch returns before the memory update: the K-shift stays pending and the
    keys stay roped at the old positions."""
    ctx = make(flavour, n_layer=1, n_seq_max=2, kv_unified=kv_unified,
               n_ctx=n_ctx(kv_unified, 2))
    assert ctx.decode(Batch(token=[1, 2, 3, 4, 5, 6])) == 0
    ctx.memory.seq_add(0, 2, -1, 3)
    before = snapshot(ctx)
    assert ctx.decode(Batch(token=[7], pos=[4])) == -1  # seq 0 must go on at 9
    assert ctx.memory.get_has_shift()
    assert_same(before, snapshot(ctx))
    assert ctx.decode(Batch(token=[7], logits=[True])) == 0
    fresh = fresh_cache(flavour, [(1, 0), (2, 1), (3, 5), (4, 6), (5, 7), (6, 8)])
    assert fresh.decode(Batch(token=[7], logits=[True])) == 0
    flavour.assert_close(fresh.get_logits(), ctx.get_logits())


@every_flavour
@given(prompt=tokens_st, cont=st.lists(st.integers(0, N_VOCAB - 1), min_size=2, max_size=9),
       n_ubatch=st.integers(1, 4), abort_at=st.integers(0, 3))
def test_abort_keeps_earlier_ubatches_and_removes_the_aborted_one(flavour, prompt, cont,
                                                                  n_ubatch, abort_at):
    """rc 2: the ubatches computed before the abort stay (their cells and K/V), the aborted
    one is removed, and the decode goes on as if only the kept tokens had come."""
    calls = []

    def abort() -> bool:
        calls.append(1)
        return len(calls) > abort_at

    ctx = make(flavour, n_ubatch=n_ubatch)
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
    straight = make(flavour, n_ubatch=n_ubatch)
    want = decode_seq(straight, list(prompt) + list(cont[:kept]) + [1])[-1:]
    flavour.assert_close(want, decode_seq(ctx, [1]))
