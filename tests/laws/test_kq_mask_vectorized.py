"""The vectorized KQ mask equals its per-cell definition on random cell states.

:func:`reference.memory.kv_cache.set_input_kq_mask` computes the mask of a ubatch as one
array expression per stream; :func:`set_input_kq_mask_per_cell` is the same rule written
one token and one cell at a time (the readable definition). They must agree exactly for
every cell state, SWA type, multi-sequence token and stream layout.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from reference.hparams import (
    SWA_TYPE_CHUNKED,
    SWA_TYPE_NONE,
    SWA_TYPE_STANDARD,
    SWA_TYPE_SYMMETRIC,
    is_masked_swa,
)
from reference.memory.kv_cache import (
    set_input_kq_mask,
    set_input_kq_mask_per_cell,
    visible_prefix,
)
from reference.memory.kv_cells import KVCells

N_SEQ = 4
SWA_TYPES = [SWA_TYPE_NONE, SWA_TYPE_STANDARD, SWA_TYPE_CHUNKED, SWA_TYPE_SYMMETRIC]


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
def test_vectorized_mask_equals_per_cell_rule(case, dtype):
    fast = set_input_kq_mask(*case, dtype=dtype)
    slow = set_input_kq_mask_per_cell(*case, dtype=dtype)
    assert fast.dtype == slow.dtype == dtype
    assert fast.shape == slow.shape
    assert np.array_equal(fast, slow)


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
    """One conversation with holes, and a token at its sequence's last position (9: the mask
    leaves the causal term out) or before it (6, 4: the term is needed): the per-cell rule."""
    cells = KVCells(12)
    for i, p in enumerate([0, 1, -1, 3, 4, -1, 9, 7]):
        if p >= 0:
            cells.pos_set(i, p)
            cells.seq_add(i, 0)
    case = ([cells], [0], np.array([p_token]), ((0,),), (0,), 10, 0, SWA_TYPE_NONE)
    fast = set_input_kq_mask(*case)
    assert np.array_equal(fast, set_input_kq_mask_per_cell(*case))
    assert fast.shape == (1, 10)


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
def test_a_visible_prefix_is_the_mask_of_the_per_cell_rule(case):
    """When ``visible_prefix`` gives u, the per-cell rule shows every token the first u
    cells and nothing else; and the vectorized mask (which then takes the shortcut) equals
    the rule either way."""
    v_cells, seq_to_stream, pos, seq_id, strm, n_kv, n_swa, swa_type = case
    slow = set_input_kq_mask_per_cell(*case)
    assert np.array_equal(set_input_kq_mask(*case), slow)
    s_tok = np.array([ids[0] for ids in seq_id])
    u = visible_prefix(v_cells[0], s_tok, pos, n_swa, swa_type)
    if u is not None:
        expected = np.where(np.arange(n_kv) < u, 0.0, -np.inf)[None, :]
        assert np.array_equal(slow, np.broadcast_to(expected, slow.shape).astype(np.float32))


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
