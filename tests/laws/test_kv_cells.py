"""KVCells (llama_kv_cells) against a brute-force model: a list of (pos, set of seqs) cells."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from reference.common import LLAMA_MAX_SEQ
from reference.hparams import (
    SWA_TYPE_CHUNKED,
    SWA_TYPE_NONE,
    SWA_TYPE_STANDARD,
    SWA_TYPE_SYMMETRIC,
    is_masked_swa,
)
from reference.memory.kv_cache import KVCache
from reference.memory.kv_cells import (
    SEQ_POS_REBUILD,
    KVCells,
    pos_div_shift,
    pos_div_shift_llamacpp,
)
from reference.testing import tiny_hparams

N_CELLS = 8
N_SEQ = 3


def check_invariants(cells: KVCells) -> None:
    """The module's invariants, from the arrays: pos == -1 <=> no seqs, seq_pos, the counts."""
    used = cells.pos != -1
    assert (used == cells.seq.any(axis=1)).all()
    assert (cells.shift[~used] == 0).all()
    assert cells.get_used() == int(used.sum())
    assert cells.n_shifted == int(np.count_nonzero(cells.shift))
    for s in range(LLAMA_MAX_SEQ):
        pairs = sorted((int(cells.pos[i]), i) for i in np.flatnonzero(cells.seq[:, s]))
        assert cells.seq_pos[s] == pairs
        positions = [p for p, _ in pairs]
        assert cells.seq_pos_min(s) == (min(positions) if positions else -1)
        assert cells.seq_pos_max(s) == (max(positions) if positions else -1)
    idxs = np.flatnonzero(used)
    assert cells.used_max_p1() == (int(idxs[-1]) + 1 if idxs.size else 0)
    assert cells.used_min() == (int(idxs[0]) if idxs.size else 0)


def row(cells: KVCells, i: int) -> tuple[int, set[int], int]:
    return int(cells.pos[i]), set(cells.seq_get_all(i)), int(cells.shift[i])


seq_sets = st.sets(st.integers(0, N_SEQ - 1), min_size=1, max_size=N_SEQ)
cell_st = st.one_of(st.none(), st.tuples(st.integers(0, 20), seq_sets))
ops_st = st.lists(
    st.tuples(
        st.sampled_from(["seq_rm", "seq_keep", "pos_add", "pos_div", "seq_add", "rm"]),
        st.integers(0, N_CELLS - 1),
        st.integers(0, N_SEQ - 1),
        st.integers(-8, 8),
    ),
    max_size=30,
)


def build(init) -> tuple[KVCells, list]:
    cells = KVCells(N_CELLS)
    model = []
    for i, c in enumerate(init):
        if c is None:
            model.append(None)
            continue
        p, seqs = c
        cells.pos_set(i, p)
        for s in sorted(seqs):
            cells.seq_add(i, s)
        model.append([p, set(seqs), 0])
    return cells, model


@given(st.lists(cell_st, min_size=N_CELLS, max_size=N_CELLS), ops_st)
def test_cells_match_brute_force(init, ops):
    cells, model = build(init)
    check_invariants(cells)
    for op, i, s, d in ops:
        c = model[i]
        if op == "seq_rm" and c is not None and s in c[1]:
            c[1].discard(s)
            freed = not c[1]
            assert cells.seq_rm(i, s) == freed
            if freed:
                model[i] = None
        elif op == "seq_keep":
            if c is None:
                assert cells.seq_keep(i, s) is False
            elif s in c[1]:
                c[1] = {s}
                assert cells.seq_keep(i, s) is False
            else:
                model[i] = None
                assert cells.seq_keep(i, s) is True
        elif op == "pos_add" and c is not None:
            c[0] += d
            c[2] += d
            freed = c[0] < 0
            assert cells.pos_add(i, d) == freed
            if freed:
                model[i] = None
        elif op == "pos_div" and c is not None and d >= 1:
            p_new = c[0] // d
            c[2] += p_new - c[0]
            c[0] = p_new
            cells.pos_div(i, d)
        elif op == "seq_add" and c is not None and s not in c[1]:
            c[1].add(s)
            cells.seq_add(i, s)
        elif op == "rm" and c is not None:
            model[i] = None
            cells.rm(i)
        check_invariants(cells)
        for j in range(N_CELLS):
            if model[j] is None:
                assert cells.is_empty(j)
            else:
                assert row(cells, j) == tuple(model[j])


@given(st.lists(cell_st, min_size=N_CELLS, max_size=N_CELLS),
       st.lists(st.integers(0, N_CELLS - 1), max_size=N_CELLS, unique=True),
       st.lists(cell_st, min_size=N_CELLS, max_size=N_CELLS))
def test_cp_then_set_restores(init, idxs, other_init):
    """The slot-search backup: cp(idxs), overwrite those cells, set(idxs, backup) restores."""
    cells, _ = build(init)
    before = cells.copy()
    backup = cells.cp(idxs)
    other, _ = build(other_init)
    cells.set(idxs, other.cp(idxs))
    check_invariants(cells)
    cells.set(idxs, backup)
    check_invariants(cells)
    assert cells == before


def test_pos_add_records_shift_and_frees_below_zero():
    cells, _ = build([(3, {0, 1})] + [None] * (N_CELLS - 1))
    assert cells.pos_add(0, 2) is False
    assert (cells.pos_get(0), cells.get_shift(0), cells.get_has_shift()) == (5, 2, True)
    assert cells.pos_add(0, -6) is True
    assert cells.is_empty(0) and cells.seq_pos_max(0) == -1 and cells.seq_pos_max(1) == -1
    assert cells.get_has_shift()  # the flag stays until reset_shift
    cells.reset_shift()
    assert not cells.get_has_shift()


def test_pos_div_shift_sign_differs_from_llamacpp():
    """Divergence: pos 7 divided by 2 -> 3; keys must turn by 3 - 7 = -4, llama.cpp turns +4."""
    cells, _ = build([(7, {0})] + [None] * (N_CELLS - 1))
    cells.pos_div(0, 2)
    assert cells.pos_get(0) == 3
    assert cells.get_shift(0) == pos_div_shift(7, 2) == -4
    assert pos_div_shift_llamacpp(7, 2) == 4
    # keys roped at 7 then turned by llama.cpp's +4 end up at 11, not 3
    assert 7 + pos_div_shift_llamacpp(7, 2) == 11


def test_pos_add_and_div_accumulate():
    cells, _ = build([(10, {0})] + [None] * (N_CELLS - 1))
    cells.pos_add(0, 5)  # 15, shift 5
    cells.pos_div(0, 4)  # 3, shift 5 + (3 - 15) = -7: 10 - 7 == 3
    assert (cells.pos_get(0), cells.get_shift(0)) == (3, -7)


@pytest.mark.parametrize("p", [0, 1, 5, 100])
@pytest.mark.parametrize("d", [1, 2, 3, 7])
def test_pos_div_shift_moves_to_new_position(p, d):
    assert p + pos_div_shift(p, d) == p // d


# ---- array forms, the undo journal, the vectorized slot search ----------------------------


@given(st.lists(cell_st, min_size=N_CELLS, max_size=N_CELLS), ops_st)
def test_rollback_restores_everything(init, ops):
    """begin, any operations, rollback: the cells equal their copy taken before (all fields)."""
    cells, _ = build(init)
    before = cells.copy()
    cells.begin()
    for op, i, s, d in ops:
        if op == "seq_rm" and cells.seq_has(i, s):
            cells.seq_rm(i, s)
        elif op == "seq_keep":
            cells.seq_keep(i, s)
        elif op == "pos_add" and not cells.is_empty(i):
            cells.pos_add(i, d)
        elif op == "pos_div" and not cells.is_empty(i) and d >= 1:
            cells.pos_div(i, d)
        elif op == "seq_add" and not cells.is_empty(i) and not cells.seq_has(i, s):
            cells.seq_add(i, s)
        elif op == "rm" and not cells.is_empty(i):
            cells.rm(i)
        elif cells.is_empty(i):
            cells.pos_set(i, abs(d))
            cells.seq_add(i, s)
        check_invariants(cells)
    cells.rollback()
    check_invariants(cells)
    assert cells == before


@given(st.lists(cell_st, min_size=N_CELLS, max_size=N_CELLS), st.integers(0, N_SEQ - 1),
       st.integers(0, 20), st.integers(0, 21), st.integers(-8, 8))
def test_array_forms_equal_the_per_cell_loop(init, s, p0, p1, d):
    """The cache's range operations over ``seq_cells``: the same as llama.cpp's loop."""
    for op in ["seq_rm", "seq_add", "pos_add", "pos_div", "seq_keep"]:
        fast, _ = build(init)
        slow, _ = build(init)
        if op == "seq_keep":
            freed = fast.seq_keep_cells(np.flatnonzero(fast.pos != -1), s).tolist()
            expect = [i for i in range(N_CELLS) if slow.seq_keep(i, s)]
        elif op == "seq_rm":
            freed = fast.seq_rm_cells(fast.seq_cells(s, p0, p1), s).tolist()
            expect = [i for i in range(N_CELLS)
                      if slow.pos_in(i, p0, p1) and slow.seq_has(i, s) and slow.seq_rm(i, s)]
        elif op == "seq_add":
            t = (s + 1) % N_SEQ
            idxs = fast.seq_cells(s, p0, p1)
            freed = fast.seq_add_cells(idxs[~fast.seq[idxs, t]], t) or []
            expect = []
            for i in range(N_CELLS):
                if slow.pos_in(i, p0, p1) and slow.seq_has(i, s) and not slow.seq_has(i, t):
                    slow.seq_add(i, t)
        elif op == "pos_add":
            freed = fast.pos_add_cells(fast.seq_cells(s, p0, p1), d).tolist()
            expect = [i for i in range(N_CELLS)
                      if slow.pos_in(i, p0, p1) and slow.seq_has(i, s) and slow.pos_add(i, d)]
        else:
            freed = fast.pos_div_cells(fast.seq_cells(s, p0, p1), abs(d) + 1) or []
            expect = []
            for i in range(N_CELLS):
                if slow.pos_in(i, p0, p1) and slow.seq_has(i, s):
                    slow.pos_div(i, abs(d) + 1)
        check_invariants(fast)
        assert freed == expect, op
        assert fast == slow, op


def find_cells_loop(cache, stream: int, n_tokens: int, cont: bool) -> list[int] | None:
    """llama.cpp's ``find_slot`` loop, one cell at a time, as written there."""
    cells = cache.v_cells[stream]
    size = cells.size()
    head_cur = cache.v_heads[stream]
    if head_cur > cells.get_used() + 2 * n_tokens:
        head_cur = 0
    if n_tokens > size:
        return None

    def can_use(idx):
        if cells.is_empty(idx):
            return True
        if cells.seq_count(idx) == 1:
            p_next = cells.seq_pos_max(cells.seq_get(idx)) + 1
            return is_masked_swa(cache.n_swa, cache.swa_type, cells.pos_get(idx), p_next)
        return False

    n_tested, n_test, idxs = 0, (n_tokens if cont else 1), []
    while True:
        if head_cur + n_test > size:
            n_tested += size - head_cur
            head_cur = 0
            continue
        for _ in range(n_test):
            idx = head_cur
            head_cur += 1
            n_tested += 1
            if can_use(idx):
                idxs.append(idx)
            elif cont:
                break
        if len(idxs) == n_tokens:
            return idxs
        if cont:
            idxs.clear()
        if n_tested >= size:
            return None


@given(st.lists(st.one_of(st.none(), st.tuples(st.integers(0, 30), seq_sets)),
                min_size=1, max_size=20),
       st.integers(0, 20), st.integers(1, 8), st.booleans(),
       st.sampled_from([SWA_TYPE_NONE, SWA_TYPE_STANDARD, SWA_TYPE_CHUNKED, SWA_TYPE_SYMMETRIC]),
       st.integers(1, 8))
def test_vectorized_slot_search_equals_the_loop(init, head, n_tokens, cont, swa_type, n_swa):
    cache = KVCache(tiny_hparams(n_layer=1), kv_size=len(init), n_seq_max=N_SEQ)
    cache.swa_type, cache.n_swa = swa_type, n_swa
    cells = cache.v_cells[0]
    for i, c in enumerate(init):
        if c is not None:
            cells.pos_set(i, c[0])
            for s in sorted(c[1]):
                cells.seq_add(i, s)
    cache.v_heads[0] = min(head, len(init))
    loop = find_cells_loop(cache, 0, n_tokens, cont)
    assert cache._find_cells_fast(0, n_tokens, cont) == cache._find_cells(0, n_tokens, cont) == loop


# ---- the one-cell methods' contracts, and what equality compares --------------------------


def test_one_cell_methods_at_positions_zero_and_one():
    """Each one-cell method on cells at positions 0 and 1 (positions, not -1 markers)."""
    cells, _ = build([(0, {0, 1}), (1, {0, 1}), (1, {2})] + [None] * (N_CELLS - 3))
    assert cells.seq_rm(1, 0) is False and row(cells, 1) == (1, {1}, 0)
    cells.seq_add(1, 2)
    assert row(cells, 1) == (1, {1, 2}, 0)
    assert cells.pos_add(1, 0) is False and row(cells, 1) == (1, {1, 2}, 0)
    cells.pos_div(1, 2)
    assert row(cells, 1) == (0, {1, 2}, -1)
    cells.pos_div(0, 3)
    assert row(cells, 0) == (0, {0, 1}, 0)
    cells.shift_set(2, 5)
    assert row(cells, 2) == (1, {2}, 5) and cells.get_has_shift()
    cells.rm(2)
    assert cells.is_empty(2)
    check_invariants(cells)


def test_shift_set_records_a_restored_shift():
    """``shift_set`` gives a cell its pending shift; only a non-zero one sets ``has_shift``."""
    cells, _ = build([(4, {0}), (5, {0})] + [None] * (N_CELLS - 2))
    cells.shift_set(0, 0)
    assert row(cells, 0) == (4, {0}, 0) and not cells.get_has_shift() and cells.n_shifted == 0
    cells.shift_set(1, -3)
    assert row(cells, 1) == (5, {0}, -3) and cells.get_has_shift() and cells.n_shifted == 1
    check_invariants(cells)


def test_one_cell_methods_refuse_what_llamacpp_asserts():
    """llama.cpp's ``assert``s on the cell (empty or not, has ``seq_id`` or not) hold here,
    checked before anything changes."""
    cells, _ = build([(3, {0}), None] + [None] * (N_CELLS - 2))
    cells.pos_set(2, 7)  # a position, no sequence yet
    before = cells.copy()
    refused = [
        lambda: cells.rm(1),  # empty
        lambda: cells.seq_rm(1, 0),  # empty
        lambda: cells.seq_rm(0, 1),  # lacks seq 1
        lambda: cells.seq_add(1, 0),  # empty
        lambda: cells.seq_add(0, 0),  # has seq 0 already
        lambda: cells.pos_set(0, 4),  # not empty
        lambda: cells.pos_set(2, 4),  # has a position (no sequence yet)
        lambda: cells.pos_add(1, 1),  # empty
        lambda: cells.pos_div(1, 2),  # empty
        lambda: cells.shift_set(1, 1),  # empty
        lambda: cells.pos_get(1),  # empty
        lambda: cells.get_shift(1),  # empty
    ]
    for k, call in enumerate(refused):
        with pytest.raises(AssertionError):
            call()
        assert cells == before, k


def test_pos_div_is_integer_division_at_any_position():
    """Positions are int64: the division is exact beyond float64's 2**53 as well."""
    p = 2**62 + 1
    cells, _ = build([None] * N_CELLS)
    cells.pos_set(0, p)
    cells.seq_add(0, 0)
    cells.pos_div(0, 3)
    assert (cells.pos_get(0), cells.get_shift(0)) == (p // 3, p // 3 - p)
    check_invariants(cells)


def test_equality_compares_every_field():
    """Cells that differ in one field only compare unequal (the tests' snapshots rely on it)."""

    def one_cell(pos=5, seqs=(0,), shift=0, has_shift=False) -> KVCells:
        cells = KVCells(2)
        cells.pos_set(0, pos)
        for s in seqs:
            cells.seq_add(0, s)
        if shift:
            cells.shift_set(0, shift)
        cells.has_shift = has_shift or bool(shift)
        return cells

    base = one_cell()
    assert base == one_cell() and base == base.copy()
    assert base != one_cell(seqs=(1,))  # seq (and seq_pos) only
    assert one_cell(seqs=()) != one_cell(pos=6, seqs=())  # pos only: same counts, no seq_pos
    assert one_cell(shift=1) != one_cell(shift=2)  # shift only: same n_shifted, same flag
    assert base != one_cell(has_shift=True)  # the flag only
    counts = base.copy()
    counts.n_used += 1
    assert base != counts
    pairs = base.copy()
    pairs.seq_pos[0] = []
    assert base != pairs


# ---- reset, the used range, the flag, ranges of many cells ---------------------------------


def test_new_and_reset_cells_are_empty_without_shift():
    """``reset``: every cell empty, no shift, ``has_shift`` false, no used cell
    (``used_max_p1() == 0``), as new cells; a default ``KVCells`` has no cell (llama.cpp's
    empty vectors)."""
    assert KVCells().size() == 0
    fresh = KVCells(N_CELLS)
    cells, _ = build([(3, {0, 1}), None, (5, {2})] + [None] * (N_CELLS - 3))
    cells.pos_add(2, 4)
    cells.reset()
    for c in (fresh, cells):
        assert c.get_has_shift() is False
        assert (c.used_max_p1(), c.get_used(), c.n_shifted) == (0, 0, 0)
        check_invariants(c)
    assert cells == fresh


def test_reset_shift_forgets_every_shift():
    """``reset_shift``: every cell's shift back to 0, the flag false; positions and sequences
    stay."""
    cells, _ = build([(3, {0}), (4, {1}), (9, {2})] + [None] * (N_CELLS - 3))
    cells.pos_add(0, 2)
    cells.pos_div(1, 2)
    cells.pos_add(2, -10)  # freed
    cells.reset_shift()
    assert cells.get_has_shift() is False and cells.n_shifted == 0
    assert [row(cells, i) for i in (0, 1)] == [(5, {0}, 0), (2, {1}, 0)]
    assert [cells.get_shift(i) for i in (0, 1)] == [0, 0]
    check_invariants(cells)


def test_used_max_p1_follows_the_last_used_cell():
    """``used_max_p1``: the last non-empty cell plus one, whatever that cell's position (0
    and 1 are positions, not markers), from ``pos_set`` on; 0 again once every cell is
    freed."""
    cells = KVCells(N_CELLS)
    for i, p in [(2, 1), (5, 0), (6, 1)]:
        cells.pos_set(i, p)
        assert cells.used_max_p1() == i + 1
        cells.seq_add(i, 0)
        assert cells.used_max_p1() == i + 1
    cells.rm(6)
    assert cells.used_max_p1() == 6
    assert cells.seq_rm(5, 0) is True and cells.used_max_p1() == 3
    assert cells.pos_add(2, -2) is True and cells.used_max_p1() == 0
    check_invariants(cells)


def test_freed_cells_leave_every_sequence():
    """``pos_add`` below 0 frees the cell: no sequence holds it any more, and its position
    is in no sequence's ``seq_pos`` (llama.cpp: ``seq[i].reset()``, ``pos[i] = -1``)."""
    cells, _ = build([(1, {0, 2}), (6, {1})] + [None] * (N_CELLS - 2))
    freed = cells.pos_add_cells([0, 1], -3)
    assert freed.tolist() == [0]
    assert cells.is_empty(0) and cells.seq_get_all(0) == frozenset()
    assert row(cells, 1) == (3, {1}, -3)
    assert [cells.seq_pos_max(s) for s in range(N_SEQ + 1)] == [-1, 3, -1, -1]
    assert cells.get_used() == 1
    check_invariants(cells)


def test_a_range_of_many_cells_keeps_seq_pos_sorted():
    """More than ``SEQ_POS_REBUILD`` pairs of one sequence changing at once (a long prompt, a
    range operation over it): ``seq_pos`` is still the sorted ``(pos, cell)`` pairs."""
    n = 2 * SEQ_POS_REBUILD + 6
    cells = KVCells(n)
    idxs = np.arange(n)
    seq = np.zeros((n, LLAMA_MAX_SEQ), bool)
    seq[:, 0] = True
    seq[::2, 1] = True
    cells.fill_cells(idxs, 3 * (n - idxs), seq)  # positions falling along the cells
    check_invariants(cells)
    assert (cells.seq_pos_min(0), cells.seq_pos_max(0)) == (3, 3 * n)
    assert cells.seq_pos[0][:2] == [(3, n - 1), (6, n - 2)]
    cells.pos_add_cells(cells.seq_cells(0, 0, 3 * n + 1), 5)
    check_invariants(cells)
    assert cells.seq_pos_max(1) == 3 * n + 5
    cells.seq_rm_cells(cells.seq_cells(1, 0, 3 * n + 6), 1)
    check_invariants(cells)
    assert cells.seq_pos[1] == [] and cells.get_used() == n


def test_one_position_for_every_cell():
    """A single position given for several cells is the position of each of them."""
    cells = KVCells(N_CELLS)
    cells.pos_set_cells([1, 4, 6], 7)
    cells.seq_add_cells([1, 4, 6], 2)
    assert [row(cells, i) for i in (1, 4, 6)] == [(7, {2}, 0)] * 3
    assert cells.seq_pos[2] == [(7, 1), (7, 4), (7, 6)]
    check_invariants(cells)
