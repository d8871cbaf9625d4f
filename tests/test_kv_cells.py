"""KVCells (llama_kv_cells) against a brute-force model: a list of (pos, set of seqs) cells."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from reference.memory.kv_cells import KVCells, pos_div_shift, pos_div_shift_llamacpp

N_CELLS = 8
N_SEQ = 3


def check_invariants(cells: KVCells) -> None:
    """pos == -1 <=> no seqs; seq_pos, used and the min/max agree with the cells."""
    for i in range(cells.size()):
        assert (cells.pos[i] == -1) == (not cells.seq[i])
        if cells.pos[i] == -1:
            assert cells.shift[i] == 0
    assert cells.used == {i for i in range(cells.size()) if cells.pos[i] != -1}
    for s in range(N_SEQ):
        pairs = {(cells.pos[i], i) for i in range(cells.size()) if s in cells.seq[i]}
        assert cells.seq_pos.get(s, set()) == pairs
        positions = [p for p, _ in pairs]
        assert cells.seq_pos_min(s) == (min(positions) if positions else -1)
        assert cells.seq_pos_max(s) == (max(positions) if positions else -1)
    assert cells.used_max_p1() == (max(cells.used) + 1 if cells.used else 0)


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
                assert (cells.pos[j], cells.seq[j], cells.shift[j]) == tuple(model[j])


@given(st.lists(cell_st, min_size=N_CELLS, max_size=N_CELLS),
       st.lists(st.integers(0, N_CELLS - 1), max_size=N_CELLS, unique=True),
       st.lists(cell_st, min_size=N_CELLS, max_size=N_CELLS))
def test_cp_then_set_restores(init, idxs, other_init):
    """The slot-search backup: cp(idxs), overwrite those cells, set(idxs, backup) restores."""
    cells, _ = build(init)
    before = (list(cells.pos), [set(s) for s in cells.seq], set(cells.used))
    backup = cells.cp(idxs)
    other, _ = build(other_init)
    cells.set(idxs, other.cp(idxs))
    check_invariants(cells)
    cells.set(idxs, backup)
    check_invariants(cells)
    assert (cells.pos, cells.seq, cells.used) == before


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
