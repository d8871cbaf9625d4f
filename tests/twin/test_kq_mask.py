"""The KQ mask the MLX twin builds on the device is the reference's, bit for bit.

:func:`accelerated.memory.kv_cache.kq_mask_device` evaluates the formula of
:func:`reference.memory.kv_cache.set_input_kq_mask` in MLX, on the cells' positions and the
sequence membership that :meth:`accelerated.memory.kv_cache.KVCacheAttnInput.kq_mask_inputs`
gathers. On random cell states (several streams, shared cells, empty cells, every
sliding-window kind) and random ubatches, the two masks are equal, and so is any narrower
view of the first columns of each stream (what the Context's graph reads).
"""

from __future__ import annotations

from types import SimpleNamespace

import mlx.core as mx
import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from accelerated.memory.kv_cache import KVCacheAttnInput, kq_mask_device
from reference.hparams import (
    SWA_TYPE_CHUNKED,
    SWA_TYPE_NONE,
    SWA_TYPE_STANDARD,
    SWA_TYPE_SYMMETRIC,
)
from reference.memory.kv_cache import set_input_kq_mask
from reference.memory.kv_cells import KVCells


@st.composite
def mask_cases(draw):
    n_stream = draw(st.integers(1, 3))
    n_seq = draw(st.integers(1, 4))
    size = draw(st.integers(1, 24))
    seq_to_stream = [s % n_stream for s in range(n_seq)] if n_stream > 1 else [0] * n_seq
    v_cells = []
    for _ in range(n_stream):
        cells = KVCells(size)
        for i in range(size):
            if draw(st.booleans()):
                cells.pos_set(i, draw(st.integers(0, 40)))
                for s in draw(st.sets(st.integers(0, n_seq - 1), min_size=1, max_size=n_seq)):
                    cells.seq_add(i, s)
        v_cells.append(cells)
    n_tokens = draw(st.integers(1, 5))
    seq_id = tuple(tuple(draw(st.lists(st.integers(0, n_seq - 1), min_size=1, max_size=2,
                                       unique=True))) for _ in range(n_tokens))
    pos = np.array([draw(st.integers(0, 45)) for _ in range(n_tokens)])
    strm = tuple(sorted({seq_to_stream[ids[0]] for ids in seq_id}))
    swa_type = draw(st.sampled_from([SWA_TYPE_NONE, SWA_TYPE_STANDARD, SWA_TYPE_CHUNKED,
                                     SWA_TYPE_SYMMETRIC]))
    n_swa = 0 if swa_type == SWA_TYPE_NONE else draw(st.integers(1, 8))
    n_kv = draw(st.integers(1, size))
    return v_cells, seq_to_stream, pos, seq_id, strm, n_kv, n_swa, swa_type


def device_mask(v_cells, seq_to_stream, pos, seq_id, strm, n_kv, n_swa, swa_type):
    inp = SimpleNamespace(cache=SimpleNamespace(v_cells=v_cells, seq_to_stream=seq_to_stream),
                          ubatch=SimpleNamespace(seq_id=seq_id), sinfo=SimpleNamespace(strm=strm))
    p_cell, member = KVCacheAttnInput.kq_mask_inputs(inp, n_kv)
    return np.array(kq_mask_device(mx.array(p_cell), mx.array(member),
                                   mx.array(pos.astype(np.int32)), n_swa, swa_type))


@settings(max_examples=200, deadline=None)
@given(mask_cases())
def test_the_device_mask_is_the_reference_mask(case):
    want = set_input_kq_mask(*case)  # (n_tokens, ns * n_kv)
    got = device_mask(*case)
    assert got.dtype == want.dtype and got.shape == want.shape
    assert np.array_equal(got, want)


@settings(max_examples=100, deadline=None)
@given(mask_cases(), st.data())
def test_a_narrower_view_is_the_first_columns_of_each_stream(case, data):
    v_cells, seq_to_stream, pos, seq_id, strm, n_kv, n_swa, swa_type = case
    n_view = data.draw(st.integers(1, n_kv))
    full = set_input_kq_mask(*case).reshape(len(pos), len(strm), n_kv)
    got = device_mask(v_cells, seq_to_stream, pos, seq_id, strm, n_view, n_swa, swa_type)
    assert np.array_equal(got, full[:, :, :n_view].reshape(len(pos), -1))


def test_one_sequence_holding_every_cell_needs_no_membership_columns():
    """The common case (one conversation): the token's sequence holds every used cell, so
    the host hands a (n_tokens, 1) column of True, and the mask is still the reference's."""
    cells = KVCells(8)
    for i in range(5):
        cells.pos_set(i, i)
        cells.seq_add(i, 0)
    case = ([cells], [0], np.array([5]), ((0,),), (0,), 8, 0, SWA_TYPE_NONE)
    inp = SimpleNamespace(cache=SimpleNamespace(v_cells=[cells], seq_to_stream=[0]),
                          ubatch=SimpleNamespace(seq_id=((0,),)), sinfo=SimpleNamespace(strm=(0,)))
    p_cell, member = KVCacheAttnInput.kq_mask_inputs(inp, 8)
    assert member.shape == (1, 1) and member.all()
    assert np.array_equal(device_mask(*case), set_input_kq_mask(*case))
    cells.seq_add(2, 1)  # another sequence shares a cell: still every cell of sequence 0
    assert KVCacheAttnInput.kq_mask_inputs(inp, 8)[1].shape == (1, 1)
    cells.seq_add(3, 1)
    cells.seq_rm(3, 0)  # cell 3 now holds only sequence 1: the columns are read
    assert KVCacheAttnInput.kq_mask_inputs(inp, 8)[1].shape == (1, 8)
    assert np.array_equal(device_mask(*case), set_input_kq_mask(*case))
