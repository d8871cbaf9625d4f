"""The laws of decoding, as hypothesis properties of the reference Context.

Each test states one law and checks it in float64 (to ~1e-10: only rounding differs) and in
float32 (NMSE <= 1e-10, what float32 rounding of a different summation order gives):

- **batched == unbatched**: each sequence's logits are those of the sequence decoded alone,
  whatever the interleaving, the cut into two batches, ``n_ubatch``, and the cache layout
  (one unified stream: ``split_simple``; one stream per sequence: ``split_equal``);
- **token by token == one prefill**;
- **shifts**: after any mix of ``seq_add`` / ``seq_div`` / ``seq_rm`` / context shift on a
  one-layer model (where a cell's K and V depend only on its token and position), the next
  logits equal those of a *fresh* cache holding the same (token, position) cells;
- ``seq_cp`` then divergent continuations == independent decodes of the same prefix;
  ``seq_keep``; partial ``seq_rm`` then re-decode == fresh decode;
- return code 1 leaves the memory bit-identical and the continuation unchanged; return code
  -1 changes nothing.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from reference.batch import Batch
from reference.context import Context, context_shift
from tests.test_context import assert_same, snapshot
from tests.tiny_models import nmse, random_weights, tiny_hparams

N_VOCAB = 32
MODELS = {}


def model(n_layer: int, dtype):
    key = (n_layer, np.dtype(dtype).name)
    if key not in MODELS:
        hp = tiny_hparams(n_vocab=N_VOCAB, n_layer=n_layer, n_ctx_train=4096)
        MODELS[key] = hp, random_weights(hp, seed=7, dtype=dtype)
    return MODELS[key]


def make(n_layer=2, dtype=np.float64, **kwargs) -> Context:
    hp, w = model(n_layer, dtype)
    kwargs = dict(dict(n_ctx=256, n_batch=256, n_ubatch=256), **kwargs)
    return Context(hp, w, dtype=dtype, **kwargs)


def assert_close(ref: np.ndarray, out: np.ndarray) -> None:
    """float64: max error <= 1e-10 (relative to the logits' scale); float32: NMSE <= 1e-10."""
    assert ref.shape == out.shape
    if ref.dtype == np.float64:
        scale = max(1.0, float(np.abs(ref).max()))
        assert float(np.abs(ref - out).max()) <= 1e-10 * scale
    else:
        assert nmse(ref, out) <= 1e-10


def alone(tokens, n_layer=2, dtype=np.float64, pos0=0) -> np.ndarray:
    """Logits of every token of one sequence decoded alone, in one batch, from ``pos0``."""
    ctx = make(n_layer, dtype)
    n = len(tokens)
    assert ctx.decode(Batch(token=list(tokens), pos=list(range(pos0, pos0 + n)),
                            logits=[True] * n)) == 0
    return ctx.get_logits().copy()  # (n_tokens, n_vocab)


tokens_st = st.lists(st.integers(0, N_VOCAB - 1), min_size=1, max_size=6)
dtypes = pytest.mark.parametrize("dtype", [np.float64, np.float32])


# ---- batched == unbatched -------------------------------------------------------------------


@st.composite
def interleavings(draw):
    """Sequences, an interleaving of their tokens (order inside each kept), and a cut."""
    seqs = draw(st.lists(tokens_st, min_size=1, max_size=3))
    order = [s for s, t in enumerate(seqs) for _ in t]
    order = draw(st.permutations(order))
    cut = draw(st.integers(0, len(order)))
    return seqs, list(order), cut


@dtypes
@given(case=interleavings(), n_ubatch=st.integers(1, 8), kv_unified=st.booleans(),
       auto_pos=st.booleans())
def test_batched_equals_unbatched(dtype, case, n_ubatch, kv_unified, auto_pos):
    seqs, order, cut = case
    n_seq = len(seqs)
    ctx = make(dtype=dtype, n_ubatch=n_ubatch, n_seq_max=n_seq, kv_unified=kv_unified,
               n_ctx=256 * (1 if kv_unified else n_seq))
    got: dict[int, list] = {s: [] for s in range(n_seq)}
    k = [0] * n_seq
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
        for i, s in enumerate(part):
            got[s].append(ctx.get_logits_ith(i))
    for s, t in enumerate(seqs):
        assert_close(alone(t, dtype=dtype), np.stack(got[s]))


@dtypes
@given(tokens=st.lists(st.integers(0, N_VOCAB - 1), min_size=1, max_size=10))
def test_token_by_token_equals_one_prefill(dtype, tokens):
    ctx = make(dtype=dtype)
    rows = []
    for t in tokens:
        assert ctx.decode(Batch(token=[t])) == 0
        rows.append(ctx.get_logits_ith(-1))
    assert_close(alone(tokens, dtype=dtype), np.stack(rows))


# ---- shifts: the cache after seq_add / seq_div / context shift == a fresh cache ---------------


def fresh_cache(cells: list[tuple[int, int]], dtype) -> Context:
    """A one-layer context whose sequence 0 holds exactly ``cells`` = (token, pos) pairs.

    Decode can only append contiguous positions, so each contiguous run is decoded as
    sequence 1 (an empty sequence may start anywhere), copied to 0 and removed from 1.
    """
    ctx = make(n_layer=1, dtype=dtype, n_seq_max=2)
    cells = sorted(cells, key=lambda c: c[1])
    runs: list[list[tuple[int, int]]] = []
    for c in cells:
        if runs and c[1] <= runs[-1][-1][1] + 1:
            runs[-1].append(c)
        else:
            runs.append([c])
    for run in runs:
        assert ctx.decode(Batch(token=[t for t, _ in run], pos=[p for _, p in run],
                                seq_id=[[1]] * len(run))) == 0
        ctx.memory.seq_cp(1, 0, -1, -1)
        ctx.memory.seq_rm(1, -1, -1)
    return ctx


def apply_op(cells: list[tuple[int, int]], op: tuple) -> list[tuple[int, int]]:
    """The op on a list of (token, pos) cells of one sequence, from llama.h's definitions."""
    name, p0, p1, x = op
    lo, hi = max(p0, 0), (10**9 if p1 < 0 else p1)
    out = []
    for t, p in cells:
        if lo <= p < hi:
            if name == "seq_rm":
                continue
            p = p + x if name == "seq_add" else p // x
            if p < 0:
                continue
        out.append((t, p))
    return out


pos_st = st.integers(-1, 14)
ops_st = st.lists(st.one_of(
    st.tuples(st.just("seq_add"), pos_st, pos_st, st.integers(-8, 8)),
    st.tuples(st.just("seq_div"), pos_st, pos_st, st.integers(1, 4)),
    st.tuples(st.just("seq_rm"), pos_st, pos_st, st.just(0)),
    st.tuples(st.just("shift"), st.integers(0, 6), st.integers(1, 6), st.just(0)),
), min_size=1, max_size=3)


@dtypes
@given(prompt=st.lists(st.integers(0, N_VOCAB - 1), min_size=1, max_size=12), ops=ops_st,
       cont=tokens_st)
def test_shifted_cache_equals_fresh_decode_at_shifted_positions(dtype, prompt, ops, cont):
    ctx = make(n_layer=1, dtype=dtype, n_seq_max=2)
    assert ctx.decode(Batch(token=prompt)) == 0
    cells = [(t, p) for p, t in enumerate(prompt)]
    for op in ops:
        name, a, b, x = op
        if name == "shift":  # n_keep = a, n_discard = b
            context_shift(ctx, 0, a, b)
            cells = apply_op(apply_op(cells, ("seq_rm", a, a + b, 0)), ("seq_add", a + b, -1, -b))
        else:
            if name == "seq_rm":
                ctx.memory.seq_rm(0, a, b)
            else:
                getattr(ctx.memory, name)(0, a, b, x)
            cells = apply_op(cells, op)
    mem_pos = sorted(c.pos[i] for c in ctx.memory.v_cells for i in range(c.size())
                     if c.seq_has(i, 0))
    assert mem_pos == sorted(p for _, p in cells)
    fresh = fresh_cache(cells, dtype)
    n = len(cont)
    for c in (ctx, fresh):
        assert c.decode(Batch(token=cont, logits=[True] * n)) == 0
    assert_close(fresh.get_logits(), ctx.get_logits())


@given(prompt=st.lists(st.integers(0, N_VOCAB - 1), min_size=2, max_size=12),
       d=st.integers(2, 4), cont=tokens_st)
def test_seq_div_equals_fresh_decode_at_divided_positions(prompt, d, cont):
    """The law llama.cpp breaks (it turns K by ``p_old - p_new``; tests/test_oracle_memory.py)."""
    ctx = make(n_layer=1, n_seq_max=2)
    ctx.decode(Batch(token=prompt))
    ctx.memory.seq_div(0, 0, -1, d)
    fresh = fresh_cache([(t, p // d) for p, t in enumerate(prompt)], np.float64)
    for c in (ctx, fresh):
        assert c.decode(Batch(token=cont, logits=[True] * len(cont))) == 0
    assert_close(fresh.get_logits(), ctx.get_logits())


# ---- seq_cp, seq_keep, seq_rm ---------------------------------------------------------------


@dtypes
@given(prefix=tokens_st, conts=st.lists(tokens_st, min_size=2, max_size=3),
       tail=tokens_st, kv_unified=st.booleans(), n_ubatch=st.integers(1, 8),
       keep=st.integers(0, 2))
def test_seq_cp_branches_equal_independent_decodes(dtype, prefix, conts, tail, kv_unified,
                                                   n_ubatch, keep):
    n_seq = len(conts)
    keep = keep % n_seq
    ctx = make(dtype=dtype, n_seq_max=n_seq, kv_unified=kv_unified, n_ubatch=n_ubatch,
               n_ctx=256 * (1 if kv_unified else n_seq))
    assert ctx.decode(Batch(token=prefix)) == 0
    for s in range(1, n_seq):
        ctx.memory.seq_cp(0, s, -1, -1)
    token, seq_id, where = [], [], []
    for k in range(max(map(len, conts))):  # the continuations interleaved in one batch
        for s, c in enumerate(conts):
            if k < len(c):
                where.append((s, len(token)))
                token.append(c[k])
                seq_id.append([s])
    assert ctx.decode(Batch(token=token, seq_id=seq_id, logits=[True] * len(token))) == 0
    for s, c in enumerate(conts):
        rows = np.stack([ctx.get_logits_ith(i) for s2, i in where if s2 == s])
        assert_close(alone(prefix + c, dtype=dtype)[len(prefix):], rows)
    # seq_keep: the kept branch goes on as if alone; with one stream the others are gone
    ctx.memory.seq_keep(keep)
    for s in range(n_seq):
        gone = kv_unified and s != keep
        assert ctx.memory.seq_pos_max(s) == (-1 if gone else len(prefix) + len(conts[s]) - 1)
    n = len(tail)
    assert ctx.decode(Batch(token=tail, seq_id=[[keep]] * n, logits=[True] * n)) == 0
    full = prefix + conts[keep] + tail
    assert_close(alone(full, dtype=dtype)[-n:], ctx.get_logits())


@dtypes
@given(prompt=st.lists(st.integers(0, N_VOCAB - 1), min_size=1, max_size=12),
       k=st.integers(0, 12), cont=tokens_st, kv_unified=st.booleans())
def test_partial_seq_rm_then_redecode_equals_fresh(dtype, prompt, k, cont, kv_unified):
    k = min(k, len(prompt))
    ctx = make(dtype=dtype, kv_unified=kv_unified, n_ubatch=3)
    assert ctx.decode(Batch(token=prompt)) == 0
    assert ctx.memory.seq_rm(0, k, -1) is True
    assert ctx.memory.seq_pos_max(0) == k - 1
    n = len(cont)
    assert ctx.decode(Batch(token=cont, logits=[True] * n)) == 0
    assert_close(alone(prompt[:k] + cont, dtype=dtype)[k:], ctx.get_logits())


# ---- failures change nothing ----------------------------------------------------------------


@given(n_ubatch=st.sampled_from([5, 32, 64]), extra=st.integers(57, 120),
       kv_unified=st.booleans())
def test_no_slot_leaves_memory_bit_identical(n_ubatch, extra, kv_unified):
    rng = np.random.default_rng(extra)
    ctx = make(dtype=np.float32, n_ubatch=n_ubatch, kv_unified=kv_unified)
    assert ctx.decode(Batch(token=rng.integers(0, N_VOCAB, 200).tolist())) == 0
    before = snapshot(ctx)
    assert ctx.decode(Batch(token=rng.integers(0, N_VOCAB, extra).tolist())) == 1
    assert_same(before, snapshot(ctx))
    assert ctx.decode(Batch(token=[1, 2], logits=[True, True])) == 0
    straight = make(dtype=np.float32, n_ubatch=n_ubatch, kv_unified=kv_unified)
    straight.decode(Batch(token=np.random.default_rng(extra).integers(0, N_VOCAB, 200).tolist()))
    straight.decode(Batch(token=[1, 2], logits=[True, True]))
    np.testing.assert_array_equal(straight.get_logits(), ctx.get_logits())


batch_st = st.fixed_dictionaries({
    "token": st.lists(st.integers(-1, N_VOCAB), min_size=1, max_size=5),
    "pos": st.one_of(st.none(), st.lists(st.integers(0, 8), min_size=5, max_size=5)),
    "seq_id": st.one_of(st.none(), st.lists(st.lists(st.integers(-1, 2), min_size=1,
                                                      max_size=2), min_size=5, max_size=5)),
})


@given(prompt=st.lists(tokens_st, min_size=2, max_size=2), b=batch_st)
def test_invalid_batch_changes_nothing(prompt, b):
    ctx = make(dtype=np.float32, n_seq_max=2)
    for s, t in enumerate(prompt):
        assert ctx.decode(Batch(token=t, seq_id=[[s]] * len(t), logits=[True] * len(t))) == 0
    n = len(b["token"])
    batch = Batch(token=b["token"], pos=None if b["pos"] is None else b["pos"][:n],
                  seq_id=None if b["seq_id"] is None else b["seq_id"][:n])
    ctx.memory_update()
    before = snapshot(ctx)
    rc = ctx.decode(batch)
    assert rc in (0, -1)
    if rc == -1:
        assert_same(before, snapshot(ctx))
    else:
        assert ctx.n_outputs == 1
