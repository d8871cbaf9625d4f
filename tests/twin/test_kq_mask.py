"""The MLX twin's KQ mask: built on the device, the reference's bit for bit.

:func:`accelerated.memory.kq_mask.kq_mask_device` evaluates the formula of
:func:`reference.memory.kq_mask.set_input_kq_mask` in MLX, on the cells' positions and the
sequence membership that :meth:`accelerated.memory.kv_cache.KVCacheAttnInput.kq_mask_inputs`
gathers. The laws:

- **The device mask is the rule**: on random cell states (several streams, shared cells,
  empty cells, every sliding-window kind) and random ubatches, the two masks are equal, and so
  is any narrower view of the first columns of each stream (what the Context's graph reads).
- **Prefix masks**: when a one-token ubatch's mask is "the first u cells"
  (:func:`reference.memory.kq_mask.visible_prefix`), the Context hands the graph the token's
  cache row and u (:func:`accelerated.memory.kq_mask.prefix_inputs_device`) instead of the
  positions and membership of every cell in view and the token's rows.
  ``prefix_inputs_device`` gives ``head_rows``'s rows and the mask ``kq_mask_device`` makes
  from the cells, for any row, view and u; prefix masks on and off give bit-identical logits
  and caches over scripts that go in and out of the prefix form (a hole left by ``seq_rm``, a
  second sequence, a context shift, a window that starts to hide cells, an iSWA memory), and a
  random script of such steps; token-by-token generation in one conversation uses the prefix
  form at every step after the prompt, and a step with a hole or a second sequence does not.

The reference's own laws of the mask (the rule, its fast path, the cache's mask on every
flavour) are in ``tests/laws/test_kq_mask.py``.
"""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import mlx.core as mx
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from accelerated.context import Context
from accelerated.memory.kq_mask import kq_mask_device, prefix_inputs_device
from accelerated.memory.kv_cache import KVCacheAttnInput, head_rows
from reference.batch import Batch
from reference.context import context_shift
from reference.hparams import (
    SWA_TYPE_CHUNKED,
    SWA_TYPE_NONE,
    SWA_TYPE_STANDARD,
    SWA_TYPE_SYMMETRIC,
    swa_pattern,
)
from reference.memory.kq_mask import set_input_kq_mask
from reference.memory.kv_cells import KVCells
from reference.testing import random_weights, tiny_hparams

# ---- the device mask is the rule -----------------------------------------------------------


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


# ---- prefix masks -------------------------------------------------------------------------

HP = tiny_hparams(n_layer=2, n_ctx_train=4096)
W = random_weights(HP, seed=5)
SWA = tiny_hparams(n_layer=2, n_swa=6, n_ctx_train=4096)  # one cache, a window of 6
WS = random_weights(SWA, seed=6)
ISWA = dataclasses.replace(SWA, swa_layers=swa_pattern(2, 2))  # base + SWA cache
WI = random_weights(ISWA, seed=7)


@settings(deadline=None)
@given(st.integers(1, 64), st.integers(1, 4), st.integers(1, 3), st.data())
def test_prefix_inputs_are_the_rows_and_mask_of_the_cells(kv_size, n_head_kv, n_stream, data):
    k = data.draw(st.integers(0, n_stream * kv_size - 1), label="k")
    n_cols = data.draw(st.integers(1, kv_size), label="n_cols")
    u = data.draw(st.integers(0, n_cols), label="u")
    want = head_rows(np.array([k]), kv_size, n_head_kv)  # (1, n_head_kv)
    rows, mask = prefix_inputs_device(mx.array([int(want[0, 0]), u], dtype=mx.int32), n_cols,
                                      kv_size, n_head_kv)
    assert rows.dtype == mx.int32 and mask.dtype == mx.float32
    assert rows.tolist() == want.tolist()
    p_cell = np.where(np.arange(n_cols) < u, np.arange(n_cols), -1).astype(np.int32)
    cells = kq_mask_device(mx.array(p_cell), mx.array([[True]]), mx.array([n_cols]), 0, 0)
    assert np.array_equal(np.array(mask), np.array(cells))


def pair(hp, w, **kw):
    kw = dict(dict(n_ctx=256, n_batch=256, n_ubatch=256), **kw)
    on, off = Context(hp, w, **kw), Context(hp, w, **kw)
    off.prefix_masks = False
    return on, off


def memories(ctx):
    mem = ctx.memory
    return mem.caches() if hasattr(mem, "caches") else (mem,)


def assert_same(on: Context, off: Context) -> None:
    """Bit-identical logits and cache tensors."""
    np.testing.assert_array_equal(on.get_logits(), off.get_logits())
    for a, b in zip(memories(on), memories(off), strict=True):
        for x, y in zip(a.k_l + a.v_l, b.k_l + b.v_l, strict=True):
            np.testing.assert_array_equal(np.array(x), np.array(y))


def both(on: Context, off: Context, batch: Batch) -> int:
    """Decode ``batch`` in both; the number of graphs ``on`` holds with a prefix part."""
    assert on.decode(batch) == off.decode(batch) == 0
    assert_same(on, off)
    return sum(any(key.prefix) for key in on._graphs)


def tokens(n: int, seed: int) -> list[int]:
    return np.random.default_rng(seed).integers(0, 32, n).tolist()


@pytest.mark.parametrize("hp,w", [(HP, W), (SWA, WS), (ISWA, WI)], ids=["llama", "swa", "iswa"])
def test_prefix_masks_on_and_off_are_bit_identical(hp, w):
    on, off = pair(hp, w, n_seq_max=2)
    both(on, off, Batch(token=tokens(5, 0)))
    for t in tokens(4, 1):  # generation: the prefix form (inside the window of 6 at first)
        both(on, off, Batch(token=[t]))
    for ctx in (on, off):
        ctx.memory.seq_rm(0, 2, 3)  # a hole: the cells' form
    both(on, off, Batch(token=[7], pos=[9]))
    both(on, off, Batch(token=tokens(3, 2), seq_id=[[1]] * 3))  # a second sequence
    both(on, off, Batch(token=[3], seq_id=[[1]], pos=[3]))
    for ctx in (on, off):
        ctx.memory.seq_rm(1, -1, -1)
        ctx.memory.seq_rm(0, -1, -1)
    both(on, off, Batch(token=tokens(8, 3)))
    for ctx in (on, off):
        context_shift(ctx, 0, n_keep=1, n_discard=3)  # a K-shift, then holes
    for t in tokens(6, 4):
        both(on, off, Batch(token=[t]))


def test_generation_in_one_conversation_takes_the_prefix_form():
    on, off = pair(HP, W, n_seq_max=2)
    assert both(on, off, Batch(token=tokens(6, 0))) == 0  # a prompt: the cells' form
    for t in tokens(5, 1):
        assert both(on, off, Batch(token=[t])) == 1  # one graph, reused every step
    prefix_key = on._prev_key
    assert not any(any(key.prefix) for key in off._graphs)
    for ctx in (on, off):
        ctx.memory.seq_rm(0, 1, 3)  # a hole at cells 1 and 2
    before = dict(on._graphs)
    both(on, off, Batch(token=[4], pos=[11]))  # to cell 1 (the head goes back to the
    new = [key for key in on._graphs if key not in before]  # hole); cell 2 stays empty
    assert len(new) == 1 and not any(new[0].prefix)  # so: the cells' form
    assert both(on, off, Batch(token=[5], pos=[12])) == 1  # cell 2: the prefix form again
    assert on._prev_key == prefix_key and any(prefix_key.prefix)


@st.composite
def script(draw):
    """Steps on sequences 0 and 1: prompts, tokens, removals, copies, shifts."""
    steps = []
    for _ in range(draw(st.integers(1, 12))):
        kind = draw(st.sampled_from(["prompt", "token", "token", "token", "rm", "cp", "shift"]))
        seq = draw(st.integers(0, 1))
        if kind == "prompt":
            steps.append((kind, seq, draw(st.lists(st.integers(0, 31), min_size=2, max_size=6))))
        elif kind == "token":
            steps.append((kind, seq, draw(st.integers(0, 31))))
        elif kind == "rm":
            p0 = draw(st.integers(-1, 12))
            steps.append((kind, seq, (p0, draw(st.integers(-1, 14)))))
        else:
            steps.append((kind, seq, draw(st.integers(1, 3))))
    return steps


def next_pos(ctx: Context, seq: int) -> int:
    return ctx.memory.seq_pos_max(seq) + 1


@settings(max_examples=15, deadline=None)
@given(script(), st.sampled_from(["llama", "swa", "iswa"]))
def test_prefix_masks_change_nothing_on_random_scripts(steps, name):
    hp, w = {"llama": (HP, W), "swa": (SWA, WS), "iswa": (ISWA, WI)}[name]
    on, off = pair(hp, w, n_seq_max=2, n_ctx=64, n_batch=64, n_ubatch=64)
    for kind, seq, arg in steps:
        if kind in ("prompt", "token"):
            toks = arg if kind == "prompt" else [arg]
            p = next_pos(on, seq)
            batch = Batch(token=toks, seq_id=[[seq]] * len(toks),
                          pos=list(range(p, p + len(toks))))
            rets = on.decode(batch), off.decode(batch)
            assert rets[0] == rets[1]
            if rets[0] == 0:
                assert_same(on, off)
        elif kind == "rm":
            for ctx in (on, off):
                ctx.memory.seq_rm(seq, *arg)
        elif kind == "cp":
            for ctx in (on, off):
                ctx.memory.seq_cp(seq, 1 - seq, -1, -1)
        elif on.memory.seq_pos_max(seq) > arg + 1 and on.memory.can_shift():
            for ctx in (on, off):
                context_shift(ctx, seq, n_keep=1, n_discard=arg)
