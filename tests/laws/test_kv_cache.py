"""KVCache (llama_kv_cache): memory ops, slot search, n_kv, K-shift, streams.

The KQ mask's laws are in ``tests/laws/test_kq_mask.py``.
"""

from __future__ import annotations

import dataclasses
import re

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import reference.memory.kv_cache as kv_cache_module
from reference.batch import Ubatch
from reference.common import LLAMA_MAX_SEQ
from reference.hparams import (
    SWA_TYPE_CHUNKED,
    SWA_TYPE_NONE,
    SWA_TYPE_STANDARD,
    SWA_TYPE_SYMMETRIC,
    is_masked_swa,
    rope_cparams,
)
from reference.memory import (
    KVCache,
    KVCacheError,
    MemoryStatus,
    SlotInfo,
    StateError,
    k_shift_rope_params,
    kv_size_swa,
    n_ctx_seq,
    pos_div_shift_llamacpp,
)
from reference.models.llama import llama_forward
from reference.ops import rope_ext
from tests.support.tiny_models import random_weights, tiny_hparams

N_SEQ = 3


def make_ubatch(pos, seq_id, token=None) -> Ubatch:
    """A ubatch of tokens at ``pos`` with sequence ids ``seq_id`` (ints or tuples)."""
    seq_id = tuple((s,) if isinstance(s, int) else tuple(s) for s in seq_id)
    n = len(pos)
    token = np.zeros(n, np.int32) if token is None else np.asarray(token, np.int32)
    return Ubatch(token=token, embd=None, pos=np.asarray(pos, np.int32), seq_id=seq_id,
                  seq_id_unq=tuple(sorted({s for ids in seq_id for s in ids})),
                  output=np.ones(n, bool), idx=np.arange(n), equal_seqs=False,
                  n_seq_tokens=1, n_seqs=n)


def decode_meta(cache: KVCache, ubatch: Ubatch) -> SlotInfo | None:
    """The bookkeeping of llama_decode for one ubatch: prepare, then apply."""
    sinfos = cache.prepare([ubatch])
    if sinfos is None:
        return None
    cache.apply_ubatch(sinfos[0], ubatch)
    return sinfos[0]


def snapshot(cache: KVCache):
    return (
        [(list(c.pos), [c.seq_get_all(i) for i in range(c.size())], list(c.shift))
         for c in cache.v_cells],
        list(cache.v_heads),
    )


def brute(cache: KVCache, stream: int = 0) -> list:
    """The cells of a stream as a list of (pos, set) or None."""
    c = cache.v_cells[stream]
    return [None if c.pos[i] == -1 else (c.pos[i], set(c.seq_get_all(i))) for i in range(c.size())]


def check_pos_min_max(cache: KVCache) -> None:
    for s in range(N_SEQ):
        cells = brute(cache, cache.seq_to_stream[s])
        ps = [c[0] for c in cells if c is not None and s in c[1]]
        assert cache.seq_pos_min(s) == (min(ps) if ps else -1)
        assert cache.seq_pos_max(s) == (max(ps) if ps else -1)


HP = tiny_hparams(n_layer=1)


def filled_cache(layout, kv_size=12, **kw) -> KVCache:
    """A cache whose cells hold ``layout``: one (pos, seqs) or None per cell, from cell 0
    (``kw``: more arguments of the cache, e.g. its window)."""
    cache = KVCache(HP, kv_size=kv_size, n_seq_max=N_SEQ, **kw)
    cells = cache.v_cells[0]
    for i, c in enumerate(layout):
        if c is not None:
            cells.pos_set(i, c[0])
            for s in sorted(c[1]):
                cells.seq_add(i, s)
    return cache


layout_st = st.lists(
    st.one_of(st.none(), st.tuples(st.integers(0, 15),
                                   st.sets(st.integers(0, N_SEQ - 1), min_size=1))),
    min_size=12, max_size=12)
pos_st = st.integers(-2, 17)
op_st = st.one_of(
    st.tuples(st.just("seq_rm"), st.integers(-1, N_SEQ - 1), pos_st, pos_st),
    st.tuples(st.just("seq_cp"), st.integers(0, N_SEQ - 1), st.integers(0, N_SEQ - 1),
              pos_st, pos_st),
    st.tuples(st.just("seq_keep"), st.integers(0, N_SEQ - 1)),
    st.tuples(st.just("seq_add"), st.integers(0, N_SEQ - 1), pos_st, pos_st, st.integers(-6, 6)),
    st.tuples(st.just("seq_div"), st.integers(0, N_SEQ - 1), pos_st, pos_st, st.integers(1, 4)),
)


def brute_op(model: list, op: tuple) -> None:
    """The memory ops on the brute-force model, from their definitions in llama.h."""
    name, *args = op

    def rng(p0, p1):
        return max(p0, 0), (10**9 if p1 < 0 else p1)

    for i, c in enumerate(model):
        if c is None:
            continue
        p, seqs = c
        if name == "seq_rm":
            s, p0, p1 = args
            lo, hi = rng(p0, p1)
            if lo <= p < hi and (s == -1 or s in seqs):
                seqs = set() if s == -1 else seqs - {s}
        elif name == "seq_cp":
            src, dst, p0, p1 = args
            lo, hi = rng(p0, p1)
            if lo <= p < hi and src in seqs:
                seqs = seqs | {dst}
        elif name == "seq_keep":
            seqs = seqs & {args[0]}
        elif name == "seq_add":
            s, p0, p1, d = args
            lo, hi = rng(p0, p1)
            if lo <= p < hi and s in seqs:
                p += d
                if p < 0:
                    seqs = set()
        elif name == "seq_div":
            s, p0, p1, d = args
            lo, hi = rng(p0, p1)
            if lo <= p < hi and s in seqs:
                p //= d
        model[i] = (p, seqs) if seqs else None


@given(layout_st, st.lists(op_st, max_size=12))
def test_memory_ops_match_brute_force(layout, ops):
    cache = filled_cache(layout)
    model = [None if c is None else (c[0], set(c[1])) for c in layout]
    for op in ops:
        name, *args = op
        result = getattr(cache, name)(*args)
        if name == "seq_rm":
            assert result is True
        brute_op(model, op)
        assert brute(cache) == model
        check_pos_min_max(cache)


def test_seq_add_moves_every_sharing_sequence():
    cache = filled_cache([(0, {0, 1}), (1, {0, 1}), (2, {0})])
    cache.seq_add(0, 1, -1, 10)
    # cell 1 is shared: seq 1 moves with seq 0
    assert brute(cache)[:3] == [(0, {0, 1}), (11, {0, 1}), (12, {0})]
    assert cache.seq_pos_max(1) == 11


def test_seq_add_frees_cells_below_zero_and_moves_head():
    cache = filled_cache([(0, {0}), (1, {0}), (2, {0}), (3, {0})])
    cache.v_heads[0] = 4
    cache.seq_add(0, 0, 2, -1)  # pos 0 -> -1 is freed, pos 1 -> 0
    assert brute(cache)[:4] == [None, (0, {0}), (2, {0}), (3, {0})]
    assert cache.v_heads[0] == 0
    assert cache.v_cells[0].shift[:4].tolist() == [0, -1, 0, 0]


@pytest.mark.parametrize("shift,p0,p1", [(0, 0, 5), (3, 2, 2), (3, -5, 0)])
def test_seq_add_noops(shift, p0, p1):
    cache = filled_cache([(0, {0}), (1, {0})])
    cache.v_heads[0] = 2
    before = snapshot(cache)
    cache.seq_add(0, p0, p1, shift)
    assert snapshot(cache) == before and not cache.get_has_shift()


def test_seq_div_refuses_d_below_one_and_visits_position_zero():
    """``d < 1`` is refused before any change (llama.cpp divides by it); ``p0 < 0`` means
    0, so a cell at position 0 is divided too (to 0, shift 0) and sets the cells'
    ``has_shift`` flag, as llama.cpp's ``pos_div`` does for every cell it visits: the next
    ``init_update`` has an update to run (one that turns no key)."""
    cache = filled_cache([(0, {0}), (4, {1})])
    before = snapshot(cache)
    with pytest.raises(KVCacheError, match=r"^seq_div needs d >= 1, got 0$"):
        cache.seq_div(0, 0, -1, 0)
    assert snapshot(cache) == before
    assert cache.init_update().get_status() == MemoryStatus.NO_UPDATE
    cache.seq_div(0, -1, -1, 2)
    assert snapshot(cache) == before and not cache.get_has_shift()
    assert cache.init_update().get_status() == MemoryStatus.SUCCESS


def test_seq_cp_shares_cells_without_copying():
    cache = filled_cache([(0, {0}), (1, {0}), (2, {0})])
    k_before = cache.k_l[0].copy()
    cache.seq_cp(0, 2, 1, -1)
    assert brute(cache)[:3] == [(0, {0}), (1, {0, 2}), (2, {0, 2})]
    assert cache.seq_pos_min(2) == 1 and cache.v_cells[0].get_used() == 3
    np.testing.assert_array_equal(cache.k_l[0], k_before)


def test_seq_keep():
    cache = filled_cache([(0, {0, 1}), (1, {1}), (2, {0})])
    cache.seq_keep(0)
    assert brute(cache)[:3] == [(0, {0}), None, (2, {0})]


def test_seq_ids_in_range_per_mode():
    """Unified: every id < LLAMA_MAX_SEQ maps to stream 0; per-sequence: ids < n_seq_max."""
    assert KVCache(HP, 8, n_seq_max=2).seq_pos_max(255) == -1
    with pytest.raises(KVCacheError, match=r"out of range \[0, 2\)"):
        KVCache(HP, 8, n_seq_max=2, kv_unified=False).seq_pos_max(2)


def test_clear():
    cache = filled_cache([(0, {0}), (1, {1})])
    cache.k_l[0][:] = 1.0
    cache.clear(data=False)
    assert cache.seq_pos_max(0) == -1 and cache.k_l[0].max() == 1.0
    cache.clear()
    assert cache.k_l[0].max() == 0.0 and cache.can_shift()


def test_state_read_checks_its_flags_first():
    """``state_read`` refuses flags other than NONE and PARTIAL_ONLY before reading."""
    cache = filled_cache([(0, {0}), (1, {0})])
    data = cache.state_write(HP)
    cache.seq_rm(0, 1, -1)
    before = snapshot(cache)
    with pytest.raises(StateError, match=r"^state flags 2 not supported: 0 \(NONE\) or 1 "):
        cache.state_read(HP, data, flags=2)
    assert snapshot(cache) == before


# ---- slot search -------------------------------------------------------------------------


def test_find_slot_fills_from_head_and_wraps():
    cache = KVCache(HP, kv_size=6)
    s1 = decode_meta(cache, make_ubatch([0, 1, 2], [0, 0, 0]))
    assert s1.idxs == ((0, 1, 2),) and cache.v_heads == [3]
    cache.seq_rm(0, 1, 2)  # free cell 1: head goes back to 1
    assert cache.v_heads == [1]
    s2 = decode_meta(cache, make_ubatch([1, 3], [1, 1]))
    assert s2.idxs == ((1, 3),)  # non-contiguous
    assert cache.find_slot(make_ubatch([4, 5, 6], [1, 1, 1])) is None  # only 2 free cells
    assert cache.find_slot(make_ubatch([4, 5], [1, 1]), cont=True).idxs == ((4, 5),)


def test_find_slot_cont_needs_consecutive_cells():
    cache = filled_cache([None, (0, {0}), None, None, (1, {0}), None], kv_size=6)
    assert cache.find_slot(make_ubatch([2, 3], [0, 0]), cont=True).idxs == ((2, 3),)
    assert cache.find_slot(make_ubatch([2, 3, 4], [0, 0, 0]), cont=True) is None
    assert cache.find_slot(make_ubatch([2, 3, 4], [0, 0, 0])).idxs == ((0, 2, 3),)


@pytest.mark.parametrize(
    "head,n_tokens,cont,found",
    [
        (2, 1, False, [2]),  # head == used + 2 n_tokens: the search starts at the head
        (3, 1, False, [0]),  # head > used + 2 n_tokens: it starts at 0
        (4, 2, False, [4, 5]),
        (5, 2, False, [0, 1]),
        (2, 2, True, [2, 3]),  # cont: the first window at or after the head
        (6, 3, True, [0, 1, 2]),  # none fits after the head: the first one
    ],
)
def test_slot_search_starts_at_head_unless_far_past_the_used_cells(head, n_tokens, cont, found):
    """llama.cpp's ``find_slot``: ``head_cur > get_used() + 2 n_tokens`` sends the search to
    cell 0; otherwise it starts at the head (the rule, its fast path and the loop agree)."""
    cache = filled_cache([None] * 8, kv_size=8)
    cache.v_heads[0] = head
    assert cache._find_cells(0, n_tokens, cont) == found
    assert cache._find_cells_fast(0, n_tokens, cont) == found
    assert cell_by_cell_search(cache, n_tokens, cont) == found


def cell_by_cell_search(cache: KVCache, n_tokens: int, cont: bool) -> list[int] | None:
    """llama.cpp's ``find_slot`` loop over one stream, a cell at a time from the head,
    wrapping once; a cell is usable when empty or hidden by its only sequence's window."""
    cells, size = cache.v_cells[0], cache.get_size()
    head = cache.v_heads[0]
    if head > cells.get_used() + 2 * n_tokens:
        head = 0

    def usable(i: int) -> bool:
        if int(cells.pos[i]) == -1:
            return True
        seqs = cells.seq_get_all(i)
        if len(seqs) != 1:
            return False
        (s,) = seqs
        return bool(is_masked_swa(cache.n_swa, cache.swa_type, cells.pos_get(i),
                                  cells.seq_pos_max(s) + 1))

    if n_tokens > size:
        return None
    if not cont:
        found = [i for i in [*range(head, size), *range(head)] if usable(i)]
        return found[:n_tokens] if len(found) >= n_tokens else None
    starts = [a for a in range(size - n_tokens + 1)
              if all(usable(i) for i in range(a, a + n_tokens))]
    after = [a for a in starts if a >= head]
    if not starts:
        return None
    a = after[0] if after else starts[0]
    return list(range(a, a + n_tokens))


@given(st.lists(st.one_of(st.none(), st.tuples(st.integers(0, 40),
                                                st.sets(st.integers(0, N_SEQ - 1), min_size=1))),
                min_size=16, max_size=16),
       st.integers(0, 15), st.integers(1, 10), st.booleans(),
       st.sampled_from([(None, None), (4, SWA_TYPE_STANDARD), (8, SWA_TYPE_CHUNKED),
                        (3, SWA_TYPE_SYMMETRIC)]),
       st.integers(1, 5))
@settings(deadline=None)
def test_the_slot_search_is_the_cell_by_cell_loop(layout, head, n_tokens, cont, swa, chunk):
    """``_find_cells_fast`` (array rule, read a chunk of cells at a time) finds the cells of
    llama.cpp's loop and of its rule ``_find_cells``, whatever the chunk size, head, window
    kind and cell states."""
    n_swa, swa_type = swa
    cache = filled_cache(layout, kv_size=16, n_pad=16, n_swa=n_swa, swa_type=swa_type)
    cache.v_heads[0] = head
    saved = kv_cache_module.FIND_CHUNK
    kv_cache_module.FIND_CHUNK = chunk
    try:
        got = cache._find_cells_fast(0, n_tokens, cont)
    finally:
        kv_cache_module.FIND_CHUNK = saved
    assert got == cell_by_cell_search(cache, n_tokens, cont)
    assert got == cache._find_cells(0, n_tokens, cont)


@given(st.lists(st.integers(1, 5), min_size=1, max_size=5), st.integers(6, 14))
@settings(deadline=None)
def test_prepare_is_all_or_nothing_and_restores(sizes, kv_size):
    cache = KVCache(HP, kv_size=kv_size, n_seq_max=N_SEQ)
    decode_meta(cache, make_ubatch([0, 1, 2], [0, (0, 1), 1]))
    cache.seq_rm(0, 0, 1)
    before = snapshot(cache)
    ubatches, p = [], 3
    for k, n in enumerate(sizes):
        ubatches.append(make_ubatch(list(range(p, p + n)), [k % N_SEQ] * n))
        p += n
    free = kv_size - cache.v_cells[0].get_used()
    sinfos = cache.prepare(ubatches)
    assert snapshot(cache) == before  # restored, success or not
    assert (sinfos is None) == (sum(sizes) > free)
    if sinfos is not None:  # the slots are those of placing the ubatches one by one
        for ub, sinfo in zip(ubatches, sinfos, strict=True):
            assert cache.find_slot(ub) == sinfo
            cache.apply_ubatch(sinfo, ub)
        used = [i for s in sinfos for i in s.idxs[0]]
        assert len(set(used)) == len(used)


# ---- n_kv --------------------------------------------------------------------------------


@pytest.mark.parametrize("kv_size,n_pad,used_max_p1,n_kv", [
    (1024, 1, 0, 256), (1024, 1, 1, 256), (1024, 1, 256, 256), (1024, 1, 257, 512),
    (1024, 1, 1000, 1024), (16, 1, 3, 16), (2048, 512, 3, 512), (300, 1, 290, 300),
])
def test_n_kv_rule(kv_size, n_pad, used_max_p1, n_kv):
    cache = KVCache(HP, kv_size=kv_size, n_pad=n_pad)
    if used_max_p1:
        cache.v_cells[0].pos_set(used_max_p1 - 1, 0)
        cache.v_cells[0].seq_add(used_max_p1 - 1, 0)
    assert cache.get_n_kv(SlotInfo((0,), ((0,),))) == n_kv


def test_context_sizes():
    assert n_ctx_seq(512, 4, False) == (1024, 256)  # 128 cells padded to 256
    assert n_ctx_seq(2000, 3, False) == (2304, 768)
    assert kv_size_swa(4096, 256, 4, 512, True) == 1536
    assert kv_size_swa(4096, 256, 4, 512, False) == 768
    hp = tiny_hparams(n_layer=1, n_swa=4)
    assert KVCache(hp, 1024, swa_full=False, n_ubatch=8).get_size() == 256
    assert KVCache(hp, 1024, swa_full=True).get_size() == 1024


# ---- SWA ---------------------------------------------------------------------------------


def test_swa_reuses_masked_cells_and_purges():
    hp = tiny_hparams(n_layer=1, n_swa=2)
    cache = KVCache(hp, kv_size=4)
    decode_meta(cache, make_ubatch([0, 1, 2, 3], [0] * 4))
    # next pos is 4: cells at pos 0, 1, 2 are out of the window (4 - p >= 2)
    sinfo = decode_meta(cache, make_ubatch([4], [0]))
    assert sinfo.idxs == ((0,),)
    assert brute(cache) == [(4, {0}), (1, {0}), (2, {0}), (3, {0})]
    # pos 1 is now masked too; writing pos 5 over cell 1 purges every position <= 1
    sinfo = decode_meta(cache, make_ubatch([5], [0]))
    assert sinfo.idxs == ((1,),) and cache.seq_pos_min(0) == 2


def test_failed_prepare_restores_swa_purge_divergence():
    """Divergence: llama.cpp restores only the slot cells after a failed prepare.

    The first ubatch (pos 4) overwrites cell 0 (pos 1, out of the window) and the SWA purge
    then removes pos 0 from cell 1, outside the slot. llama.cpp puts back cell 0 only: after
    the failed decode pos 0 is gone (seq_pos_min 0 -> 1). Here the memory is as before.
    """
    hp = tiny_hparams(n_layer=1, n_swa=2)
    cache = KVCache(hp, kv_size=4)
    decode_meta(cache, make_ubatch([1, 0, 2, 3], [0] * 4))  # cell 1 holds pos 0
    before = snapshot(cache)
    ub1 = make_ubatch([4], [0])
    ub2 = make_ubatch([5, 6, 7, 8], [0] * 4)  # never fits
    assert cache.prepare([ub1, ub2]) is None
    assert snapshot(cache) == before and cache.seq_pos_min(0) == 0
    # llama.cpp's restore: back up only the slot's cells, apply, then put only them back
    sinfo = cache.find_slot(ub1)
    saved = cache.v_cells[0].cp(list(sinfo.idxs[0]))
    cache.apply_ubatch(sinfo, ub1)
    cache.v_cells[0].set(list(sinfo.idxs[0]), saved)
    assert sinfo.idxs == ((0,),) and cache.seq_pos_min(0) == 1 and brute(cache)[1] is None


# ---- K-shift -----------------------------------------------------------------------------


def shift_setup(dtype, n_swa=0):
    hp = tiny_hparams(n_layer=2, n_embd=16, n_head=4, n_head_kv=2, n_swa=n_swa, freq_base=100.0)
    cache = KVCache(hp, kv_size=16, n_seq_max=2, dtype=dtype)
    rng = np.random.default_rng(1)
    k_raw = rng.normal(size=(8, hp.n_head_kv, hp.n_embd_head_k)).astype(dtype)
    pos = np.arange(8)
    ub = make_ubatch(pos, [0, 0, 0, 0, 1, 1, 1, 1])
    ub = dataclasses.replace(ub, pos=np.array([0, 1, 2, 3, 0, 1, 2, 3], np.int32))
    sinfo = decode_meta(cache, ub)
    inp = cache.attn_input(ub, sinfo)
    k_roped = rope_ext(k_raw, ub.pos, rope_cparams(hp))
    for il in range(hp.n_layer):
        inp.cpy_k(il, k_roped)
    return hp, cache, k_raw, ub


def cell_keys(cache, il, hp):
    return cache.k_l[il][0].reshape(cache.get_size(), hp.n_head_kv, hp.n_embd_head_k)


@pytest.mark.parametrize("dtype,tol", [(np.float64, 1e-12), (np.float32, 2e-6)])
def test_k_shift_after_seq_add_is_rope_at_new_positions(dtype, tol):
    hp, cache, k_raw, ub = shift_setup(dtype)
    cache.seq_add(0, 1, -1, 5)  # seq 0: pos 1, 2, 3 -> 6, 7, 8
    assert cache.update() is True and not cache.get_has_shift()
    new_pos = np.array([cache.v_cells[0].pos[i] for i in range(8)])
    assert new_pos.tolist() == [0, 6, 7, 8, 0, 1, 2, 3]
    expected = rope_ext(k_raw, new_pos, rope_cparams(hp))
    for il in range(hp.n_layer):
        err = np.abs(cell_keys(cache, il, hp)[:8] - expected).max()
        assert err < tol, err
    assert cache.update() is False


@pytest.mark.parametrize("dtype,tol", [(np.float64, 1e-12), (np.float32, 2e-6)])
def test_k_shift_after_seq_div_is_rope_at_new_positions(dtype, tol):
    hp, cache, k_raw, ub = shift_setup(dtype)
    cache.seq_add(1, 0, -1, 9)  # seq 1: pos 9..12
    cache.seq_div(1, 0, -1, 3)  # seq 1: pos 3, 3, 3, 4
    cache.update()
    new_pos = np.array(cache.v_cells[0].pos[:8])
    assert new_pos.tolist() == [0, 1, 2, 3, 3, 3, 3, 4]
    expected = rope_ext(k_raw, new_pos, rope_cparams(hp))
    assert np.abs(cell_keys(cache, 0, hp)[:8] - expected).max() < tol
    # llama.cpp's pos_div sign: turn by 9 (seq_add) then by p_old - p_new of the division
    llama_shift = np.array([0, 0, 0, 0] + [9 + pos_div_shift_llamacpp(p + 9, 3) for p in range(4)])
    llama_k = rope_ext(rope_ext(k_raw, ub.pos, rope_cparams(hp)), llama_shift, rope_cparams(hp))
    assert (np.array(ub.pos) + llama_shift).tolist()[4:] == [15, 17, 19, 20]  # 2 p_old - p_new
    assert np.abs(llama_k[4:] - expected[4:]).max() > 0.1


def test_k_shift_magnitude_under_yarn_divergence():
    """Divergence: llama.cpp's K-shift applies YaRN's magnitude factor again."""
    hp = dataclasses.replace(tiny_hparams(n_layer=1), rope_scaling_type_train=2,
                             rope_freq_scale_train=0.25, n_ctx_orig_yarn=32)
    rng = np.random.default_rng(0)
    k_raw = rng.normal(size=(3, hp.n_head_kv, hp.n_embd_head_k))
    p, d = np.array([1, 2, 3]), np.array([4, 4, 4])
    roped = rope_ext(k_raw, p, rope_cparams(hp))
    target = rope_ext(k_raw, p + d, rope_cparams(hp))
    ours = rope_ext(roped, d, k_shift_rope_params(hp))
    theirs = rope_ext(roped, d, rope_cparams(hp))
    assert np.abs(ours - target).max() < 1e-12
    mscale = 1 + 0.1 * np.log(4.0)
    np.testing.assert_allclose(np.linalg.norm(theirs), mscale * np.linalg.norm(target))


# ---- streams -----------------------------------------------------------------------------


def test_seq_cp_across_streams_copies_at_update():
    cache = KVCache(HP, kv_size=4, n_seq_max=2, kv_unified=False)
    decode_meta(cache, make_ubatch([0, 1], [0, 0]))
    cache.k_l[0][0, :2] = 7.0
    cache.seq_add(0, 1, -1, 2)  # pending shift in stream 0
    with pytest.raises(KVCacheError):
        cache.seq_cp(0, 1, 1, -1)
    cache.seq_cp(0, 1, -1, -1)
    assert brute(cache, 1) == [(0, {1}), (3, {1}), None, None]
    assert cache.v_cells[1].shift[:2].tolist() == [0, 2] and cache.k_l[0][1].max() == 0.0
    cache.update()
    np.testing.assert_array_equal(cache.k_l[0][1], cache.k_l[0][0])


# ---- end to end with the model -------------------------------------------------------------


def forward(cache, w, hp, tokens, pos, seq_id):
    ub = make_ubatch(pos, seq_id, tokens)
    sinfo = decode_meta(cache, ub)
    return llama_forward(w, hp, ub.token, ub.pos, cache.attn_input(ub, sinfo))


@pytest.mark.parametrize("kv_unified", [True, False])
def test_two_sequences_in_one_ubatch_equal_each_alone(kv_unified):
    hp = tiny_hparams(n_layer=1)
    w = random_weights(hp, seed=3, dtype=np.float64)
    a, b = [3, 1, 4, 1, 5], [9, 2, 6, 5, 3]
    alone = []
    for toks in (a, b):
        cache = KVCache(hp, kv_size=16, dtype=np.float64)
        alone.append(forward(cache, w, hp, toks, list(range(5)), [0] * 5))
    cache = KVCache(hp, kv_size=16, n_seq_max=2, kv_unified=kv_unified, dtype=np.float64)
    if kv_unified:  # interleaved
        toks = [t for pair in zip(a, b, strict=True) for t in pair]
        pos = [p for p in range(5) for _ in range(2)]
        seqs = [0, 1] * 5
        out = forward(cache, w, hp, toks, pos, seqs)
        got = [out[0::2], out[1::2]]
    else:  # split_equal: the tokens of seq 0, then those of seq 1
        out = forward(cache, w, hp, a + b, list(range(5)) * 2, [0] * 5 + [1] * 5)
        got = [out[:5], out[5:]]
    for g, e in zip(got, alone, strict=True):
        assert np.abs(g - e).max() < 1e-10
    # continue both sequences one more token each: still equal
    nxt = forward(cache, w, hp, [7, 8], [5, 5], [0, 1])
    for s, toks in enumerate((a, b)):
        ref = KVCache(hp, kv_size=16, dtype=np.float64)
        e = forward(ref, w, hp, toks + [7 + s], list(range(6)), [0] * 6)[-1]
        assert np.abs(nxt[s] - e).max() < 1e-10


def test_seq_add_then_decode_equals_fresh_decode_at_shifted_positions():
    """1 layer: cached K/V depend only on the token and the position, so shifting is exact."""
    hp = tiny_hparams(n_layer=1)
    w = random_weights(hp, seed=5, dtype=np.float64)
    toks = [4, 8, 15, 16, 23]
    cache = KVCache(hp, kv_size=16, dtype=np.float64)
    forward(cache, w, hp, toks, list(range(5)), [0] * 5)
    cache.seq_rm(0, 1, 3)  # drop positions 1, 2
    cache.seq_add(0, 3, -1, -2)  # 3, 4 -> 1, 2
    cache.update()
    got = forward(cache, w, hp, [42 % hp.n_vocab], [3], [0])
    fresh = KVCache(hp, kv_size=16, dtype=np.float64)
    e = forward(fresh, w, hp, [4, 16, 23, 42 % hp.n_vocab], [0, 1, 2, 3], [0] * 4)[-1]
    assert np.abs(got[0] - e).max() < 1e-10


# ---- construction, ids and layers: defaults and refusals ------------------------------------


def refused(message: str):
    """``pytest.raises`` of a KVCacheError whose whole message is ``message``."""
    return pytest.raises(KVCacheError, match=f"^{re.escape(message)}$")


def test_defaults_of_a_cache():
    """One shared stream, one sequence, no padding, a ubatch of 512 for the SWA size."""
    cache = KVCache(HP, 7)
    assert (cache.n_seq_max, cache.n_pad, cache.kv_unified, cache.get_n_stream()) == (1, 1, True, 1)
    assert KVCache(HP, 8, n_seq_max=2, kv_unified=False).kv_unified is False
    hp = tiny_hparams(n_layer=1, n_swa=256)
    assert KVCache(hp, 4096, swa_full=False).get_size() == kv_size_swa(4096, 256, 1, 512, True)
    assert KVCache(hp, 4096, swa_full=False).get_size() == 768  # 256 + 512, not padded up
    # a shared stream holds the windows of every sequence, one stream per sequence its own
    assert KVCache(hp, 4096, n_seq_max=2, swa_full=False).get_size() == 1024
    assert KVCache(hp, 4096, n_seq_max=2, kv_unified=False, swa_full=False).get_size() == 768


@pytest.mark.parametrize("kw,message", [
    (dict(n_seq_max=0), f"n_seq_max=0 must be in [1, {LLAMA_MAX_SEQ}]"),
    (dict(n_seq_max=LLAMA_MAX_SEQ + 1),
     f"n_seq_max={LLAMA_MAX_SEQ + 1} must be in [1, {LLAMA_MAX_SEQ}]"),
    (dict(kv_size=0), "kv_size=0 must be a positive multiple of n_pad=1"),
    (dict(kv_size=-4), "kv_size=-4 must be a positive multiple of n_pad=1"),
    (dict(kv_size=8, n_pad=0), "kv_size=8 must be a positive multiple of n_pad=0"),
    (dict(kv_size=8, n_pad=3), "kv_size=8 must be a positive multiple of n_pad=3"),
    (dict(n_swa=-1, swa_type=SWA_TYPE_NONE),
     f"n_swa=-1 and swa_type={SWA_TYPE_NONE} disagree: a window needs n_swa > 0 and a window "
     "type, no window neither"),
    (dict(n_swa=4, swa_type=SWA_TYPE_NONE),
     f"n_swa=4 and swa_type={SWA_TYPE_NONE} disagree: a window needs n_swa > 0 and a window "
     "type, no window neither"),
    (dict(n_swa=0, swa_type=SWA_TYPE_STANDARD),
     f"n_swa=0 and swa_type={SWA_TYPE_STANDARD} disagree: a window needs n_swa > 0 and a "
     "window type, no window neither"),
    (dict(layers=[HP.n_layer]), f"layers [{HP.n_layer}] must be ascending, distinct layers of "
     f"the model's {HP.n_layer}"),
    (dict(layers=[-1]), f"layers [-1] must be ascending, distinct layers of the model's "
     f"{HP.n_layer}"),
])
def test_construction_refuses_with_its_message(kw, message):
    """Each refused argument, with the message that names it."""
    kw = {"kv_size": 8, **kw}
    with refused(message):
        KVCache(HP, **kw)


def test_construction_accepts_the_bounds():
    """The edges of each range are accepted: ``LLAMA_MAX_SEQ`` sequences, one cell, a window
    of one position, the last layer alone."""
    assert KVCache(HP, 8, n_seq_max=LLAMA_MAX_SEQ, kv_unified=False).get_n_stream() == LLAMA_MAX_SEQ
    assert KVCache(HP, 1).get_size() == 1
    assert KVCache(HP, 8, n_swa=1, swa_type=SWA_TYPE_STANDARD).n_swa == 1
    hp = tiny_hparams(n_layer=3)
    assert KVCache(hp, 8, layers=[2]).layers == (2,)


@pytest.mark.parametrize("layers", [[1, 0], [0, 0], [0, 1, 1]])
def test_layers_must_ascend_without_repeats(layers):
    hp = tiny_hparams(n_layer=3)
    with refused(f"layers {layers} must be ascending, distinct layers of the model's 3"):
        KVCache(hp, 8, layers=layers)


def test_a_layer_not_in_the_cache_is_refused_with_the_cache_layers():
    cache = KVCache(tiny_hparams(n_layer=3), 8, layers=[0, 2])
    assert (cache.layer_id(0), cache.layer_id(2)) == (0, 1)
    with refused("layer 1 is not in this cache (its layers: [0, 2])"):
        cache.layer_id(1)


def test_seq_id_refusals_name_the_range():
    """An id out of range is refused; the operations that take -1 for every sequence say so."""
    cache = KVCache(HP, 8, n_seq_max=2, kv_unified=False)
    with refused("seq_id=2 out of range [0, 2) (or -1 for all sequences)"):
        cache.seq_rm(2, 0, -1)
    with refused("seq_id=-2 out of range [0, 2) (or -1 for all sequences)"):
        cache.seq_rm(-2, 0, -1)
    with refused("seq_id=2 out of range [0, 2)"):
        cache.seq_pos_max(2)
    with refused("seq_id=-1 out of range [0, 2)"):
        cache.seq_pos_max(-1)


# ---- seq_rm over streams, clear ----------------------------------------------------------


def per_stream_cache() -> KVCache:
    """Three sequences, one stream each, positions 0..3 in cells 0..3 of each stream."""
    cache = KVCache(HP, 8, n_seq_max=N_SEQ, kv_unified=False)
    for s in range(N_SEQ):
        decode_meta(cache, make_ubatch(list(range(4)), [s] * 4))
    return cache


def test_seq_rm_of_every_sequence_reaches_every_stream():
    """``seq_id = -1`` matches every sequence, in every stream; ``p1 < 0`` is the end."""
    cache = per_stream_cache()
    assert cache.seq_rm(-1, 2, -1) is True
    assert [cache.seq_pos_max(s) for s in range(N_SEQ)] == [1] * N_SEQ
    cache.seq_rm(-1, -5, -1)
    assert [cache.seq_pos_max(s) for s in range(N_SEQ)] == [-1] * N_SEQ
    assert [c.get_used() for c in cache.v_cells] == [0] * N_SEQ


@pytest.mark.parametrize("p0,p1", [(2, 0), (1, 1), (0, 0)])
def test_seq_rm_of_an_empty_range_removes_nothing(p0, p1):
    """``p1 = 0`` is an end like any other (only ``p1 < 0`` means the end of the sequence):
    ``[p0, p1)`` is empty and nothing is removed."""
    cache = per_stream_cache()
    before = snapshot(cache)
    cache.seq_rm(1, p0, p1)
    cache.seq_rm(-1, p0, p1)
    assert snapshot(cache) == before


def test_clear_puts_the_head_back_to_the_first_cell():
    """After ``clear`` the next ubatch goes to cell 0 (llama.cpp: ``v_heads[s] = 0``)."""
    cache = filled_cache([])
    for p in range(3):
        decode_meta(cache, make_ubatch([p], [0]))
    cache.clear()
    assert list(decode_meta(cache, make_ubatch([0], [0])).idxs[0]) == [0]


# ---- the attention input ------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_the_kq_mask_has_the_cache_dtype(dtype):
    cache = KVCache(HP, 8, dtype=dtype)
    ub = make_ubatch([0, 1], [0, 0])
    assert cache.attn_input(ub, decode_meta(cache, ub)).get_kq_mask(0).dtype == dtype


def test_sequences_in_streams_apart_equal_each_alone():
    """One ubatch of sequences 0 and 2 in a cache of three streams (streams not side by side):
    each token's output is that of its sequence decoded alone."""
    hp = tiny_hparams(n_layer=1)
    w = random_weights(hp, seed=3, dtype=np.float64)
    a, b = [3, 1, 4, 1, 5], [9, 2, 6, 5, 3]
    alone = []
    for toks in (a, b):
        cache = KVCache(hp, kv_size=16, dtype=np.float64)
        alone.append(forward(cache, w, hp, toks, list(range(5)), [0] * 5))
    cache = KVCache(hp, kv_size=16, n_seq_max=3, kv_unified=False, dtype=np.float64)
    out = forward(cache, w, hp, a + b, list(range(5)) * 2, [0] * 5 + [2] * 5)
    for g, e in zip([out[:5], out[5:]], alone, strict=True):
        assert np.abs(g - e).max() < 1e-10


@pytest.mark.parametrize("p0,p1", [(0, 2), (1, 3), (2, 0), (3, 1)])
def test_seq_cp_in_one_stream_copies_its_range_only(p0, p1):
    """``[p0, p1)`` with ``p1 = 0`` empty: only ``p1 < 0`` means the end."""
    cache = filled_cache([(p, {0}) for p in range(4)])
    cache.seq_cp(0, 1, p0, p1)
    assert [sorted(c[1]) for c in brute(cache)[:4]] == [
        [0, 1] if p0 <= p < p1 else [0] for p in range(4)]


@pytest.mark.parametrize("p0,p1,ok", [
    (-1, -1, True), (0, -1, True), (0, 0, True), (7, 7, True), (-1, 8, True),
    (1, -1, False), (6, -1, False), (-1, 6, False), (-1, 1, False),
])
def test_seq_cp_across_streams_takes_whole_sequences_only(p0, p1, ok):
    """llama.cpp's bound: ``p0`` and ``p1`` each ``<= 0`` or ``>= size - 1`` (a full copy);
    anything else is refused before a change."""
    cache = per_stream_cache()
    before = snapshot(cache)
    if ok:
        cache.seq_cp(0, 1, p0, p1)
        assert cache.seq_pos_max(1) == 3 and cache.v_cells[1].seq_get_all(0) == frozenset({1})
    else:
        with refused(f"seq_cp across streams copies whole sequences: got [{p0}, {p1}), "
                     "use p0 = p1 = -1"):
            cache.seq_cp(0, 1, p0, p1)
        assert snapshot(cache) == before


# ---- heads, reuse of window cells, per-stream sets ---------------------------------------


def test_seq_add_moves_the_head_to_the_first_freed_cell_else_to_zero():
    """llama.cpp's ``seq_add``: ``head = new_head != size ? new_head : 0``, so the next
    search starts at the first cell freed, or at cell 0 when none was."""
    cache = filled_cache([None, (0, {0}), (1, {0}), None, (0, {1}), (1, {1}), (2, {1})])
    cache.seq_add(1, 0, -1, -1)  # frees cell 4 (position 0 - 1)
    assert list(decode_meta(cache, make_ubatch([9], [2])).idxs[0]) == [4]
    cache = filled_cache([None, (0, {0}), (1, {0})])
    cache.v_heads[0] = 3
    cache.seq_add(0, 0, -1, 2)  # frees nothing
    assert list(decode_meta(cache, make_ubatch([9], [2])).idxs[0]) == [0]


def test_a_reused_window_purges_up_to_its_largest_overwritten_position():
    """Reused window cells: every cell of the sequence at or below the largest overwritten
    position goes (llama.cpp's ``seq_pos_min(s) <= seq_pos_max_rm[s]``), the largest of the
    ubatch's (3, not the last one overwritten, 1)."""
    cache = filled_cache([(3, {0}), (1, {0}), (2, {0}), (4, {0})], kv_size=4, n_swa=2,
                         swa_type=SWA_TYPE_STANDARD)
    sinfo = decode_meta(cache, make_ubatch([5, 6], [0, 0]))
    assert sinfo.idxs == ((0, 1),)
    assert brute(cache) == [(5, {0}), (6, {0}), None, (4, {0})]
    # a position held twice: the other cell at the overwritten position itself goes too
    cache = filled_cache([(3, {0}), (3, {0}), (4, {0}), (5, {0})], kv_size=4, n_swa=2,
                         swa_type=SWA_TYPE_STANDARD)
    assert decode_meta(cache, make_ubatch([6], [0])).idxs == ((0,),)
    assert brute(cache) == [(6, {0}), None, (4, {0}), (5, {0})]


@pytest.mark.parametrize("seq_ids,message", [
    ([0, 0, 1], "3 tokens do not split into 2 equal sets"),
    ([0, 1, 0, 1], "token set 0 is not all of sequence 0 alone"),
    ([0, (0, 1), 1, 1], "token set 0 is not all of sequence 0 alone"),
])
def test_a_ubatch_over_streams_must_be_equal_one_sequence_sets(seq_ids, message):
    """With one stream per sequence a ubatch is equal sets of one sequence each (``split_equal``);
    anything else is refused, before any cell changes."""
    cache = KVCache(HP, 8, n_seq_max=2, kv_unified=False)
    before = snapshot(cache)
    with refused(message):
        cache.find_slot(make_ubatch(list(range(len(seq_ids))), seq_ids), cont=False)
    assert snapshot(cache) == before


def test_an_update_context_shifts_keys_with_the_model_rope_factors():
    """``init_update(rope_factors)``: a context of this cache, ``NO_UPDATE`` with nothing to
    do; after ``seq_add`` its ``apply()`` re-ropes the keys with the model's ``rope_freqs``
    (as if roped at the new positions with them)."""
    rng = np.random.default_rng(5)
    factors = rng.uniform(1.0, 4.0, HP.n_embd_head_k // 2)
    cache = KVCache(HP, kv_size=8)
    decode_meta(cache, make_ubatch(list(range(4)), [0] * 4))
    raw = rng.normal(size=(4, HP.n_head_kv, HP.n_embd_head_k))
    cache.k_l[0][0, :4] = rope_ext(raw, np.arange(4), rope_cparams(HP, 0), factors).reshape(4, -1)
    nothing = cache.init_update(factors)
    assert nothing.get_status() is MemoryStatus.NO_UPDATE and nothing.memory is cache
    cache.seq_add(0, 2, -1, 5)
    update = cache.init_update(factors)
    assert update.get_status() is MemoryStatus.SUCCESS and update.memory is cache
    assert update.apply() is True
    want = rope_ext(raw, np.array([0, 1, 7, 8]), rope_cparams(HP, 0), factors).reshape(4, -1)
    np.testing.assert_allclose(cache.k_l[0][0, :4], want, atol=1e-5)


def test_a_stream_copy_at_update_leaves_the_other_streams():
    """``seq_cp`` from stream 0 to stream 2: at ``update`` stream 2's K/V rows become
    stream 0's; stream 1's stay as they were."""
    cache = KVCache(HP, kv_size=4, n_seq_max=3, kv_unified=False)
    for s in range(3):
        decode_meta(cache, make_ubatch([0], [s]))
        cache.k_l[0][s] = s + 1.0
        cache.v_l[0][s] = 10.0 * (s + 1)
    cache.seq_cp(0, 2, -1, -1)
    cache.update()
    np.testing.assert_array_equal(cache.k_l[0][2], cache.k_l[0][0])
    np.testing.assert_array_equal(cache.v_l[0][2], cache.v_l[0][0])
    assert (cache.k_l[0][1] == 2.0).all() and (cache.v_l[0][1] == 20.0).all()
    assert (cache.k_l[0][0] == 1.0).all() and brute(cache, 1)[0] == (0, {1})
