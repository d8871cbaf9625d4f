"""The KQ mask (``llama_kv_cache::set_input_kq_mask``): the rule, its fast path, the cache's mask.

- **The definition**: the mask a cache of every flavour gives a placed ubatch is the
  definition written out in this file (visible iff non-empty, holds the token's first
  sequence, at or before the token, inside the window), over random cells, tokens of
  several sequences and every window kind.
- **The fast path is the rule**:
  :func:`reference.memory.kq_mask.set_input_kq_mask_fast` (one array expression per stream,
  the terms that hold for every cell left out) equals
  :func:`reference.memory.kq_mask.set_input_kq_mask` (one token and one cell at a time)
  exactly, for every cell state, window type, multi-sequence token and stream layout, in
  both dtypes; so do its helpers: ``visible_prefix``'s $u$ (a generation step in one
  conversation: the first $u$ cells) and ``holds_every_used_cell`` (membership is "not
  empty").
- **The window rule works on arrays**: ``is_masked_swa`` applied to arrays gives its
  scalar answer at each entry.

The MLX twin's device mask is held to the reference's in ``tests/twin/test_kq_mask.py``.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from accelerated.memory import KVCache as MLXKVCache
from reference.batch import Ubatch
from reference.hparams import (
    SWA_TYPE_CHUNKED,
    SWA_TYPE_NONE,
    SWA_TYPE_STANDARD,
    SWA_TYPE_SYMMETRIC,
    is_masked_swa,
)
from reference.memory import KVCache, SlotInfo
from reference.memory.kq_mask import (
    holds_every_used_cell,
    set_input_kq_mask,
    set_input_kq_mask_fast,
    visible_prefix,
)
from reference.memory.kv_cells import KVCells
from tests.support.helpers import Flavour, every_flavour
from tests.support.tiny_models import tiny_hparams

N_SEQ = 4
SWA_TYPES = [SWA_TYPE_NONE, SWA_TYPE_STANDARD, SWA_TYPE_CHUNKED, SWA_TYPE_SYMMETRIC]


# ---- the definition, on the cache of every flavour -----------------------------------------

N_SEQ_CACHE = 3
HP = tiny_hparams(n_layer=1)
CACHES = {"reference": KVCache, "accelerated": MLXKVCache}  # flavour.package -> its cache


def make_ubatch(pos, seq_id) -> Ubatch:
    """A ubatch of tokens at ``pos`` with sequence ids ``seq_id`` (tuples)."""
    n = len(pos)
    return Ubatch(token=np.zeros(n, np.int32), embd=None, pos=np.asarray(pos, np.int32),
                  seq_id=tuple(seq_id),
                  seq_id_unq=tuple(sorted({s for ids in seq_id for s in ids})),
                  output=np.ones(n, bool), idx=np.arange(n), equal_seqs=False,
                  n_seq_tokens=1, n_seqs=n)


def filled_cache(flavour: Flavour, layout, kv_size: int) -> KVCache:
    """A cache of ``flavour`` whose cells hold ``layout``: one (pos, seqs) or None per cell."""
    cache = CACHES[flavour.package](HP, kv_size=kv_size, n_seq_max=N_SEQ_CACHE,
                                    dtype=flavour.dtype)
    cells = cache.v_cells[0]
    for i, c in enumerate(layout):
        if c is not None:
            cells.pos_set(i, c[0])
            for s in sorted(c[1]):
                cells.seq_add(i, s)
    return cache


def placed(cache: KVCache, ubatch: Ubatch) -> SlotInfo | None:
    """The bookkeeping of llama_decode for one ubatch: prepare, then apply."""
    sinfos = cache.prepare([ubatch])
    if sinfos is None:
        return None
    cache.apply_ubatch(sinfos[0], ubatch)
    return sinfos[0]


def definition_mask(cache: KVCache, ubatch: Ubatch, sinfo: SlotInfo, n_kv: int) -> np.ndarray:
    """Visible iff non-empty, has the token's first seq, pos <= token pos, inside the window."""
    cols = [(s, j) for s in sinfo.strm for j in range(n_kv)]
    m = np.full((ubatch.n_tokens, len(cols)), -np.inf)
    for i in range(ubatch.n_tokens):
        seq = ubatch.seq_id[i][0]
        p = int(ubatch.pos[i])
        for c, (s, j) in enumerate(cols):
            cells = cache.v_cells[s]
            if cells.pos[j] == -1:
                continue
            cell_pos, cell_seqs = int(cells.pos[j]), set(cells.seq_get_all(j))
            in_window = not is_masked_swa(cache.n_swa, cache.swa_type, cell_pos, p)
            if (s == cache.seq_to_stream[seq] and in_window and seq in cell_seqs
                    and cell_pos <= p):
                m[i, c] = 0.0
    return m


layout_st = st.lists(
    st.one_of(st.none(), st.tuples(st.integers(0, 15),
                                   st.sets(st.integers(0, N_SEQ_CACHE - 1), min_size=1))),
    min_size=12, max_size=12)


@every_flavour
@given(layout_st, st.lists(st.tuples(st.integers(0, 18),
                                     st.sets(st.integers(0, N_SEQ_CACHE - 1), min_size=1)),
                           min_size=1, max_size=4, unique_by=lambda t: t[0]),
       st.sampled_from([(0, 0), (3, SWA_TYPE_STANDARD), (4, SWA_TYPE_CHUNKED),
                        (4, SWA_TYPE_SYMMETRIC)]))
@settings(deadline=None)
def test_mask_equals_definition(flavour, layout, tokens, swa):
    n_swa, swa_type = swa
    cache = filled_cache(flavour, layout, kv_size=16)
    cache.n_swa, cache.swa_type = n_swa, swa_type
    ub = make_ubatch([p for p, _ in tokens], [tuple(sorted(s)) for _, s in tokens])
    sinfo = placed(cache, ub)
    if sinfo is None:
        return
    inp = cache.attn_input(ub, sinfo)
    want = definition_mask(cache, ub, sinfo, inp.n_kv)
    np.testing.assert_array_equal(np.asarray(inp.get_kq_mask(0)), want)
    rule = set_input_kq_mask(cache.v_cells, cache.seq_to_stream, ub.pos, ub.seq_id, sinfo.strm,
                             inp.n_kv, n_swa, swa_type)
    np.testing.assert_array_equal(rule, want)


# ---- the fast path is the rule -------------------------------------------------------------


@st.composite
def mask_case(draw):
    """Streams of random cells, a ubatch of random tokens, the streams of its slot."""
    unified = draw(st.booleans())
    n_stream = 1 if unified else N_SEQ
    size = draw(st.integers(1, 12))
    seq_to_stream = [0] * N_SEQ if unified else list(range(N_SEQ))
    v_cells = []
    for stream in range(n_stream):
        cells = KVCells(size)
        seqs_here = list(range(N_SEQ)) if unified else [stream]
        for i in range(size):
            if draw(st.booleans()):
                cells.pos_set(i, draw(st.integers(0, 20)))
                for s in draw(st.sets(st.sampled_from(seqs_here), min_size=1)):
                    cells.seq_add(i, s)
        v_cells.append(cells)
    n_tokens = draw(st.integers(1, 6))
    seq_id = tuple(tuple(draw(st.lists(st.integers(0, N_SEQ - 1), min_size=1, max_size=3,
                                       unique=True)))
                   for _ in range(n_tokens))
    pos = np.array([draw(st.integers(0, 24)) for _ in range(n_tokens)])
    # the slot's streams: those of the tokens, maybe more, in any order
    needed = {seq_to_stream[ids[0]] for ids in seq_id}
    extra = draw(st.sets(st.integers(0, n_stream - 1)))
    strm = tuple(draw(st.permutations(sorted(needed | extra))))
    n_kv = draw(st.integers(1, size))
    swa_type = draw(st.sampled_from(SWA_TYPES))
    n_swa = 0 if swa_type == SWA_TYPE_NONE else draw(st.integers(1, 8))
    return v_cells, seq_to_stream, pos, seq_id, strm, n_kv, n_swa, swa_type


@given(mask_case(), st.sampled_from([np.float32, np.float64]))
def test_set_input_kq_mask_fast_is_the_rule(case, dtype):
    fast = set_input_kq_mask_fast(*case, dtype=dtype)
    rule = set_input_kq_mask(*case, dtype=dtype)
    assert fast.dtype == rule.dtype == dtype
    assert fast.shape == rule.shape
    assert np.array_equal(fast, rule)


@pytest.mark.parametrize("swa_type", SWA_TYPES)
def test_is_masked_swa_is_elementwise(swa_type):
    """The scalar rule of hparams applied to arrays gives the scalar answer at each entry."""
    n_swa = 4
    p0 = np.arange(12)[None, :]  # (1, 12) cells
    p1 = np.arange(12)[:, None]  # (12, 1) tokens
    masked = np.broadcast_to(is_masked_swa(n_swa, swa_type, p0, p1), (12, 12))
    expected = [[is_masked_swa(n_swa, swa_type, a, b) for a in range(12)] for b in range(12)]
    assert masked.tolist() == expected


@pytest.mark.parametrize("p_token", [9, 6, 4])
def test_a_token_after_its_sequence_needs_no_causal_term(p_token):
    """One conversation with holes, and a token at its sequence's last position (9: the fast
    path leaves the causal term out) or before it (6, 4: the term is needed): the rule."""
    cells = KVCells(12)
    for i, p in enumerate([0, 1, -1, 3, 4, -1, 9, 7]):
        if p >= 0:
            cells.pos_set(i, p)
            cells.seq_add(i, 0)
    case = ([cells], [0], np.array([p_token]), ((0,),), (0,), 10, 0, SWA_TYPE_NONE)
    fast = set_input_kq_mask_fast(*case)
    assert np.array_equal(fast, set_input_kq_mask(*case))
    assert fast.shape == (1, 10)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("other", ["its own sequence", "the token's sequence"])
def test_a_token_sees_nothing_in_another_streams_block(dtype, other):
    """A generation step in stream 0 (the prefix shortcut) with stream 1 in the slot too:
    stream 1's block is all -inf for the token, whatever its cells hold (its own
    sequence, or cells labelled with the token's sequence at earlier positions), and the
    mask has the slot's dtype."""
    cells = [KVCells(4), KVCells(4)]
    for i in range(3):
        cells[0].pos_set(i, i)
        cells[0].seq_add(i, 0)
        cells[1].pos_set(i, i)
        cells[1].seq_add(i, 1 if other == "its own sequence" else 0)
    case = (cells, [0, 1, 2, 3], np.array([3]), ((0,),), (0, 1), 4, 0, SWA_TYPE_NONE)
    expected = np.array([[0, 0, 0, -np.inf] + [-np.inf] * 4], dtype=dtype)
    for mask in (set_input_kq_mask(*case, dtype=dtype), set_input_kq_mask_fast(*case, dtype=dtype)):
        assert mask.dtype == dtype
        assert np.array_equal(mask, expected)


@st.composite
def conversation_case(draw):
    """One stream in which a conversation (sequence 0, maybe also 1) fills the first cells,
    sometimes with a hole or a cell of another sequence, and a ubatch of one or two tokens
    at or past its last position: the masks that ``visible_prefix`` describes, and their
    near misses."""
    size = draw(st.integers(1, 16))
    n_used = draw(st.integers(0, size))
    cells = KVCells(size)
    shared = draw(st.booleans())  # sequence 1 holds the conversation too (a copied prompt)
    positions = draw(st.lists(st.integers(0, 30), min_size=n_used, max_size=n_used))
    for i, p in enumerate(positions):
        cells.pos_set(i, p)
        cells.seq_add(i, 0)
        if shared:
            cells.seq_add(i, 1)
    if n_used and draw(st.booleans()):  # a hole, a cell that sequence 2 shares, or a cell
        i = draw(st.integers(0, n_used - 1))  # that sequence 1 does not hold
        change = draw(st.sampled_from(["hole", "seq 2", "not seq 1"]))
        if change == "hole":
            cells.rm(i)
        elif change == "seq 2":
            cells.seq_add(i, 2)
        elif shared:
            cells.seq_rm(i, 1)
    last = max(positions, default=-1)
    n_tokens = draw(st.integers(1, 2))
    seq_id = tuple((draw(st.sampled_from([0, 1] if shared else [0])),) for _ in range(n_tokens))
    pos = np.array([last + draw(st.integers(-2, 2)) for _ in range(n_tokens)]).clip(0)
    swa_type = draw(st.sampled_from(SWA_TYPES))
    n_swa = 0 if swa_type == SWA_TYPE_NONE else draw(st.integers(1, 40))
    n_kv = draw(st.integers(max(1, cells.used_max_p1()), size))
    return [cells], [0, 0, 0, 0], pos, seq_id, (0,), n_kv, n_swa, swa_type


@given(conversation_case())
def test_a_visible_prefix_is_the_mask_of_the_rule(case):
    """When ``visible_prefix`` gives u, the rule shows every token the first u cells and
    nothing else; and the fast path (which then takes the shortcut) equals the rule either
    way."""
    v_cells, seq_to_stream, pos, seq_id, strm, n_kv, n_swa, swa_type = case
    rule = set_input_kq_mask(*case)
    fast = set_input_kq_mask_fast(*case)
    assert fast.dtype == rule.dtype == np.float32
    assert np.array_equal(fast, rule)
    s_tok = np.array([ids[0] for ids in seq_id])
    u = visible_prefix(v_cells[0], s_tok, pos, n_swa, swa_type)
    if u is not None:
        expected = np.where(np.arange(n_kv) < u, 0.0, -np.inf)[None, :]
        assert np.array_equal(rule, np.broadcast_to(expected, rule.shape).astype(np.float32))


@given(conversation_case(), st.sets(st.integers(0, 2), min_size=1))
def test_holding_every_used_cell_means_not_empty(case, seqs):
    """``holds_every_used_cell`` (counts only) is True exactly when, for each sequence,
    "the cell holds it" is "the cell is not empty" on every cell: the membership term the
    fast path then leaves out."""
    cells = case[0][0]
    used = cells.pos != -1  # (size,)
    expected = all(np.array_equal(cells.seq[:, s], used) for s in seqs)
    assert holds_every_used_cell(cells, sorted(seqs)) is expected


@pytest.mark.parametrize("swa_type", SWA_TYPES)
@pytest.mark.parametrize("n_used", [1, 7, 200])
def test_a_generation_step_in_one_conversation_is_a_prefix(swa_type, n_used):
    """The common case takes the shortcut: a conversation in the first cells, the next token
    after it, a window that hides none of it (or none)."""
    cells = KVCells(256)
    for i in range(n_used):
        cells.pos_set(i, i)
        cells.seq_add(i, 0)
    n_swa = 0 if swa_type == SWA_TYPE_NONE else 1024
    assert visible_prefix(cells, np.array([0]), np.array([n_used - 1]), n_swa, swa_type) \
        == n_used
    if swa_type != SWA_TYPE_NONE and n_used > 4:  # a window of 4 hides the first cells
        assert visible_prefix(cells, np.array([0]), np.array([n_used - 1]), 4, swa_type) \
            is None
