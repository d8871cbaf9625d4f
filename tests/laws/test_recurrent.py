"""The recurrent memory (reference/memory/recurrent.py) against llama.cpp's rules.

The laws:
- every sequence operation follows ``llama_memory_recurrent`` (explicit cases read from the
  code at the pinned commit); invalid calls are refused before anything changes (on every
  memory: ``tests/laws/test_memory.py``);
- a partial ``seq_rm`` is refused without side effects;
- ``seq_cp`` shares, then a write to one sequence leaves the other's state unchanged;
- a new sequence starts from a zero state;
- ``prepare`` is all or nothing and restores the memory exactly;
- after any sequence of operations, the memory agrees with a brute-force model (a dict
  sequence -> shared group -> (position, state)): positions (``pos_min == pos_max``),
  states, and which sequences share a state;
- a state blob round trip is byte-identical; save, clear, restore, continue == continue
  uninterrupted; every refused blob leaves the memory bit-identical.

The "model" is a fake one: per token, each state row becomes a deterministic integer
function of the old row and the token (exact in float64), so states can be compared with ==.
"""

from __future__ import annotations

import copy
import re
from dataclasses import dataclass

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from reference.batch import Batch, BatchAllocr, Ubatch
from reference.common import LLAMA_MAX_SEQ
from reference.memory.interface import MemoryStatus
from reference.memory.recurrent import (
    MemCell,
    RecurrentMemory,
    RecurrentMemoryError,
    state_load_file,
    state_parse,
    state_read,
    state_save_file,
    state_write,
)
from reference.memory.state import StateError

POS_INF = 2**31 - 1

# ---------------------------------------------------------------------------------------------
# a stub of the hyperparameters and a fake model
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class StubHParams:
    """The three things the memory reads (+ ``arch``); a dataclass, for the fingerprint."""

    arch: str = "mamba"
    n_layer: int = 2
    n_r: int = 3
    n_s: int = 4

    def n_embd_r(self) -> int:
        return self.n_r

    def n_embd_s(self) -> int:
        return self.n_s


HP = StubHParams()


def step_r(r: np.ndarray, tok: int, il: int) -> np.ndarray:
    """One token's update of a conv-state row: integer valued, exact in float64."""
    return (r * 3 + tok + il + np.arange(r.shape[-1])) % 1009


def step_s(s: np.ndarray, tok: int, il: int) -> np.ndarray:
    """One token's update of an SSM-state row."""
    return (s * 7 + tok * (il + 2) + 1) % 1013


def fake_forward(mem: RecurrentMemory, ubatch: Ubatch) -> None:
    """What a Mamba layer does with the memory: read the states, scan the tokens, write back."""
    inp = mem.rs_input(ubatch)
    nst = ubatch.n_seq_tokens
    for il in range(mem.hparams.n_layer):
        r, s = inp.get_r(il), inp.get_s(il)  # (n_seqs, n_embd_r), (n_seqs, n_embd_s)
        assert r.shape == (ubatch.n_seqs, mem.hparams.n_embd_r())
        for k in range(ubatch.n_seqs):
            for tok in ubatch.token[k * nst: (k + 1) * nst]:
                r[k], s[k] = step_r(r[k], int(tok), il), step_s(s[k], int(tok), il)
        inp.cpy_r(il, r)
        inp.cpy_s(il, s)


def decode(mem: RecurrentMemory, tokens, seq_ids, n_ubatch: int = 4) -> bool:
    """llama_decode's memory steps: validate, split_equal(sequential), prepare, apply, forward."""
    batch = Batch(token=list(tokens), seq_id=[[s] for s in seq_ids])
    balloc = BatchAllocr(batch, n_vocab=1000, n_seq_max=mem.n_seq_max, memory=mem)
    ubatches = []
    while (ub := balloc.split_equal(n_ubatch, sequential=True)).n_tokens:
        ubatches.append(ub)
    assert balloc.n_used == len(tokens)
    placements = mem.prepare(ubatches)
    if placements is None:
        return False
    for ub, cells in zip(ubatches, placements, strict=True):
        mem.apply_ubatch(cells, ub)
        fake_forward(mem, ub)
    return True


def expected_state(tokens, init=None, hp=HP) -> tuple[list, list]:
    """The fake model's states after ``tokens`` from ``init`` (zeros when None)."""
    if init is None:
        init = ([np.zeros(hp.n_r)] * hp.n_layer, [np.zeros(hp.n_s)] * hp.n_layer)
    r, s = [x.copy() for x in init[0]], [x.copy() for x in init[1]]
    for il in range(hp.n_layer):
        for tok in tokens:
            r[il], s[il] = step_r(r[il], tok, il), step_s(s[il], tok, il)
    return r, s


def seq_state(mem: RecurrentMemory, seq_id: int) -> tuple[list, list] | None:
    """The state rows of ``seq_id`` (read from its tail cell's source row), None if empty."""
    tail = mem.cells[seq_id].tail
    if tail < 0:
        return None
    row = mem.cells[tail].src if mem.cells[tail].src >= 0 else tail
    return [r[row].copy() for r in mem.r_l], [s[row].copy() for s in mem.s_l]


def same_state(a, b) -> bool:
    return all(np.array_equal(x, y) for x, y in zip(a[0] + a[1], b[0] + b[1], strict=True))


def snapshot(mem: RecurrentMemory) -> tuple:
    """Everything of the memory, to compare bit for bit."""
    return (copy.deepcopy(mem.cells), mem.head, mem.used, mem.n, mem.rs_z,
            [x.copy() for x in mem.r_l], [x.copy() for x in mem.s_l])


def assert_same_snapshot(a: tuple, b: tuple) -> None:
    assert a[:5] == b[:5]
    for x, y in zip(a[5] + a[6], b[5] + b[6], strict=True):
        assert x.tobytes() == y.tobytes()


def new_mem(n_seq_max=3, mem_size=None, dtype=np.float64, hp=HP) -> RecurrentMemory:
    return RecurrentMemory(hp, mem_size or n_seq_max, n_seq_max, dtype=dtype)


def check_invariants(mem: RecurrentMemory) -> None:
    """Tails and cells agree (llama.cpp's NDEBUG "tails_verif"), ``used`` counts cells."""
    tails = [-1] * mem.size
    for i, cell in enumerate(mem.cells):
        for s in cell.seq_id:
            assert tails[s] == -1, f"seq {s} in two cells"
            tails[s] = i
        assert cell.is_empty() == (cell.pos < 0)
    assert tails == [cell.tail for cell in mem.cells]
    assert mem.used == sum(not c.is_empty() for c in mem.cells)


# ---------------------------------------------------------------------------------------------
# decode: zeros, copy on write, contiguous slots
# ---------------------------------------------------------------------------------------------


def test_new_sequence_starts_from_zeros():
    mem = new_mem()
    decode(mem, [5, 6, 7], [0, 0, 0])
    decode(mem, [8, 9], [1, 1])
    assert same_state(seq_state(mem, 0), expected_state([5, 6, 7]))
    assert same_state(seq_state(mem, 1), expected_state([8, 9]))
    # a removed sequence decoded again starts over from zeros, not from its old state
    assert mem.seq_rm(0, -1, -1)
    decode(mem, [1], [0])
    assert same_state(seq_state(mem, 0), expected_state([1]))
    assert mem.seq_pos_max(0) == 0
    check_invariants(mem)


def test_seq_cp_shares_then_copies_on_write():
    mem = new_mem()
    decode(mem, [5, 6, 7], [0, 0, 0])
    base = seq_state(mem, 0)
    mem.seq_cp(0, 1, -1, -1)
    assert mem.cells[0].tail == mem.cells[1].tail  # shared: one cell, no copy
    assert mem.cells[mem.cells[0].tail].seq_id == {0, 1}
    assert mem.seq_pos_max(1) == 2
    decode(mem, [9], [1])  # write to seq 1: copy on write
    assert mem.cells[0].tail != mem.cells[1].tail
    assert same_state(seq_state(mem, 0), base)  # seq 0 untouched
    assert same_state(seq_state(mem, 1), expected_state([9], base))
    decode(mem, [4, 4], [0, 0])
    assert same_state(seq_state(mem, 0), expected_state([4, 4], base))
    assert same_state(seq_state(mem, 1), expected_state([9], base))
    check_invariants(mem)


def test_seq_cp_then_both_in_one_ubatch():
    """Two sequences sharing a cell, both written by one ubatch: each gets its own cell."""
    mem = new_mem()
    decode(mem, [5, 6], [0, 0])
    base = seq_state(mem, 0)
    mem.seq_cp(0, 1)
    mem.seq_cp(0, 2)
    decode(mem, [1, 2, 3, 4, 5, 6], [0, 1, 2, 0, 1, 2])
    for s, toks in ((0, [1, 4]), (1, [2, 5]), (2, [3, 6])):
        assert same_state(seq_state(mem, s), expected_state(toks, base))
        assert mem.seq_pos_min(s) == mem.seq_pos_max(s) == 3
    check_invariants(mem)


def test_find_slot_gathers_sets_into_contiguous_cells():
    """Sequences scattered over the cells are swapped into ``head .. head + n_seqs``; the
    rows follow their sequences."""
    mem = new_mem(n_seq_max=4)
    decode(mem, [1], [3])
    decode(mem, [2], [1])
    decode(mem, [3], [2])
    assert mem.seq_rm(1, -1, -1)  # a hole
    decode(mem, [4, 5], [2, 3])
    assert [mem.cells[s].tail for s in (2, 3)] == [mem.head, mem.head + 1]
    assert same_state(seq_state(mem, 2), expected_state([3, 4]))
    assert same_state(seq_state(mem, 3), expected_state([1, 5]))
    check_invariants(mem)


def test_ubatch_layout_of_split_equal():
    """Set ``s`` of a ``split_equal`` ubatch is tokens ``s * n_seq_tokens ..`` and cell
    ``head + s``."""
    mem = new_mem()
    batch = Batch(token=[10, 20, 11, 21], seq_id=[[0], [1], [0], [1]])
    ub = BatchAllocr(batch, n_vocab=100, n_seq_max=3, memory=mem).split_equal(8, True)
    assert ub.token.tolist() == [10, 11, 20, 21] and (ub.n_seqs, ub.n_seq_tokens) == (2, 2)
    mem.apply_ubatch(mem.prepare([ub])[0], ub)
    assert [mem.cells[s].tail for s in (0, 1)] == [mem.head, mem.head + 1]
    inp = mem.rs_input(ub)
    assert inp.get_s(0).shape == (2, HP.n_s) and not inp.get_s(0).any()  # zeros: new seqs
    assert inp.rs_z >= 0 and inp.s_copy.tolist() == [inp.rs_z] * inp.n_rs


def test_coupled_sequences_share_the_state():
    """A set whose tokens belong to several sequences (find_slot's ``j > 0``): after the
    ubatch they all hold the first id's cell (llama.cpp: "cells from seq_ids that become
    shared")."""
    mem = new_mem()
    decode(mem, [7], [1])  # seq 1 had a state of its own: it is dropped
    ub = Ubatch(token=np.array([3, 4]), embd=None, pos=np.array([0, 1]),
                seq_id=((0, 1), (0, 1)), seq_id_unq=(0, 1), output=np.ones(2, bool),
                idx=np.arange(2), equal_seqs=True, n_seq_tokens=2, n_seqs=1)
    [cells] = mem.prepare([ub])
    mem.apply_ubatch(cells, ub)
    fake_forward(mem, ub)
    assert mem.cells[0].tail == mem.cells[1].tail
    assert mem.cells[mem.cells[0].tail].seq_id == {0, 1}
    assert same_state(seq_state(mem, 1), expected_state([3, 4]))
    assert mem.seq_pos_max(1) == 1
    check_invariants(mem)


def test_size_equal_n_seq_max_always_has_room():
    """With one cell per sequence id, every valid ubatch fits (a shared cell frees one)."""
    mem = new_mem(n_seq_max=2)
    decode(mem, [1], [0])
    mem.seq_cp(0, 1)
    assert decode(mem, [2, 3], [0, 1])
    assert mem.used == 2


# ---------------------------------------------------------------------------------------------
# the sequence operations, case by case
# ---------------------------------------------------------------------------------------------


def mem_at(pos: int, n_seq_max: int = 2) -> RecurrentMemory:
    """Seq 0 with its state at position ``pos``."""
    mem = new_mem(n_seq_max)
    decode(mem, list(range(1, pos + 2)), [0] * (pos + 1))
    assert mem.seq_pos_max(0) == pos
    return mem


@pytest.mark.parametrize(
    ("p0", "p1", "ok", "pos_after"),
    [
        (-1, -1, True, -1),  # everything
        (0, POS_INF, True, -1),
        (0, 10, True, -1),  # [0, 10) holds pos 9: the whole sequence
        (0, 9, True, 9),  # misses the last position: no cell in range, nothing removed
        (0, 5, True, 9),
        (5, -1, False, 9),  # the end but not the start: refused
        (9, 10, False, 9),
        (1, 100, False, 9),
        (10, -1, True, 9),  # after the last position: nothing
        (3, 5, True, 9),  # the middle: nothing (only the last position has a cell)
        (4, 4, True, 9),
        (0, 0, True, 9),  # p1 == 0 is an empty range, not infinity
        (5, 9, True, 9),  # p1 == pos: the last position is not in the range
        (9, 9, True, 9),
    ],
)
def test_seq_rm_cases(p0, p1, ok, pos_after):
    mem = mem_at(9)
    before = snapshot(mem)
    assert mem.seq_rm(0, p0, p1) is ok
    assert mem.seq_pos_min(0) == mem.seq_pos_max(0) == pos_after
    if pos_after == 9:
        assert_same_snapshot(snapshot(mem), before)  # refused or no-op: nothing changed
    check_invariants(mem)


def test_seq_rm_of_a_shared_cell_keeps_it_for_the_other():
    mem = mem_at(4)
    mem.seq_cp(0, 1)
    assert not mem.seq_rm(1, 2, -1)
    assert mem.seq_rm(1, -1, -1)
    assert mem.seq_pos_max(1) == -1 and mem.seq_pos_max(0) == 4 and mem.used == 1
    check_invariants(mem)


def test_seq_rm_all_sequences():
    """``seq_id = -1`` (a divergence: llama.cpp returns False for every negative id)."""
    mem = mem_at(4)
    decode(mem, [1, 2], [1, 1])
    before = snapshot(mem)
    assert mem.seq_rm(-1, 2, 5) is False
    assert mem.seq_rm(-1, 0, 5) is False  # from the start, but not to the end
    assert mem.seq_rm(-1, 2, -1) is False  # to the end, but not from the start
    assert mem.seq_rm(-1, 3, 3) is True
    assert_same_snapshot(snapshot(mem), before)
    assert mem.seq_rm(-1, -1, -1) is True
    assert mem.used == 0 and mem.seq_pos_max(0) == mem.seq_pos_max(1) == -1
    check_invariants(mem)


def test_seq_rm_id_without_a_cell_returns_false():
    mem = new_mem(n_seq_max=3, mem_size=2)
    assert mem.seq_rm(2, -1, -1) is False


def test_seq_cp_ignores_the_range_and_empties_dst_for_an_empty_src():
    mem = mem_at(6, n_seq_max=3)
    mem.seq_cp(0, 1, 2, 3)  # the range is ignored: the whole state is shared
    assert mem.seq_pos_max(1) == 6
    decode(mem, [3], [2])
    mem.seq_cp(1, 2)  # seq 2's own cell is freed
    assert mem.used == 1 and mem.seq_pos_max(2) == 6
    mem.seq_rm(0, -1, -1)
    mem.seq_rm(1, -1, -1)
    mem.seq_cp(0, 2)  # an empty source: dst ends empty
    assert mem.seq_pos_max(2) == -1 and mem.used == 0
    check_invariants(mem)


def test_seq_keep():
    mem = mem_at(3, n_seq_max=3)
    mem.seq_cp(0, 1)
    decode(mem, [5, 6], [2, 2])
    mem.seq_keep(1)
    assert [mem.seq_pos_max(s) for s in range(3)] == [-1, 3, -1]
    assert mem.used == 1 and mem.cells[mem.cells[1].tail].seq_id == {1}
    check_invariants(mem)


def test_seq_add_and_div_move_positions_only():
    mem = mem_at(9)
    mem.seq_cp(0, 1)
    before = snapshot(mem)
    mem.seq_add(0, 0, 9, 5)  # pos 9 not in [0, 9): nothing
    mem.seq_add(0, 3, 3, 5)  # empty range
    mem.seq_add(0, 0, -1, 0)  # no shift
    mem.seq_div(0, 10, -1, 2)
    mem.seq_div(0, 0, -1, 1)
    assert_same_snapshot(snapshot(mem), before)
    mem.seq_add(0, 5, 10, 3)
    assert mem.seq_pos_max(0) == mem.seq_pos_max(1) == 12  # the shared cell moves for both
    mem.seq_div(1, -1, -1, 5)
    assert mem.seq_pos_min(0) == mem.seq_pos_max(0) == 2
    for a, b in zip(before[5] + before[6], mem.r_l + mem.s_l, strict=True):
        assert np.array_equal(a, b)  # no K-shift: the rows never change
    assert mem.can_shift()


def test_seq_add_below_zero_frees_the_cell():
    """A divergence: llama.cpp keeps the cell at a negative position (seq_pos_max says -1
    but the state survives, and seq_rm(s, -1, -1) cannot remove it)."""
    mem = mem_at(4)
    mem.seq_cp(0, 1)
    mem.seq_add(1, -1, -1, -10)
    assert mem.seq_pos_max(0) == mem.seq_pos_max(1) == -1 and mem.used == 0
    decode(mem, [1], [0])
    assert same_state(seq_state(mem, 0), expected_state([1]))  # from zeros
    check_invariants(mem)


def assert_blank(mem: RecurrentMemory, cell: int) -> None:
    """An empty cell is as llama.cpp leaves it: no position, no source, no sequence."""
    c = mem.cells[cell]
    assert (c.pos, c.src, c.seq_id) == (-1, -1, set()), f"cell {cell}: {c}"


def test_emptied_cells_are_blank():
    """``seq_rm``, ``seq_keep``, ``seq_add`` below 0 and ``clear`` leave a freed cell as a
    new one (``pos = -1``, ``src = -1``); ``clear`` also resets the counters and, by
    default, zeroes every row."""
    mem = mem_at(4, n_seq_max=3)
    decode(mem, [1], [1])
    mem.seq_rm(0, -1, -1)
    assert_blank(mem, 0)
    decode(mem, [2], [2])
    mem.seq_keep(2)
    assert [c.tail for c in mem.cells] == [-1, -1, 0] and mem.used == 1
    assert_blank(mem, 1)
    assert_blank(mem, 2)
    mem.seq_add(2, -1, -1, -5)
    assert_blank(mem, 0)
    assert mem.used == 0
    check_invariants(mem)
    mem = busy_mem()
    mem.clear()
    for i in range(mem.size):
        assert_blank(mem, i)
        assert mem.cells[i].tail == -1
    assert (mem.head, mem.used) == (0, 0)
    assert all(not x.any() for x in mem.r_l + mem.s_l)
    mem = busy_mem()
    rows = [x.copy() for x in mem.r_l + mem.s_l]
    mem.clear(data=False)  # the cells only
    assert all(np.array_equal(a, b) for a, b in zip(rows, mem.r_l + mem.s_l, strict=True))
    decode(mem, [1], [1])
    assert mem.cells[1].tail == 0  # the search starts again at cell 0


def test_seq_keep_counts_the_cells_it_frees():
    mem = new_mem(3)
    decode(mem, [1, 2], [0, 1])  # two cells at position 0
    mem.seq_keep(2)  # a sequence without a cell: every cell goes
    assert mem.used == 0 and [mem.seq_pos_max(s) for s in range(3)] == [-1, -1, -1]
    check_invariants(mem)


def test_seq_add_and_div_range_edges():
    """``[p0, p1)`` includes ``p0`` and excludes ``p1``; ``p0 < 0`` is 0, ``p1 < 0`` is
    infinity (``p1 == 0`` is an empty range); any shift but 0 moves, any ``d`` but 1
    divides; position 0 is a position (not freed)."""
    mem = mem_at(0)
    mem.seq_add(0, 0, 0, 5)  # empty range
    mem.seq_div(0, 0, 0, 2)
    assert mem.seq_pos_max(0) == 0
    mem.seq_add(0, -1, -1, 1)  # pos 0 is in [0, inf)
    assert mem.seq_pos_max(0) == 1
    mem.seq_add(0, -3, -1, 8)
    assert mem.seq_pos_max(0) == 9
    mem.seq_add(0, 0, 9, 5)  # 9 not in [0, 9)
    mem.seq_div(0, 0, 0, 2)  # [0, 0) is empty
    mem.seq_div(0, 0, 9, 2)
    mem.seq_div(0, 0, 5, 2)
    assert mem.seq_pos_max(0) == 9
    mem.seq_div(0, 9, 10, 2)  # 9 in [9, 10)
    assert mem.seq_pos_max(0) == 4
    mem.seq_add(0, 4, 5, -4)  # down to 0: kept
    assert mem.seq_pos_min(0) == mem.seq_pos_max(0) == 0 and mem.used == 1
    check_invariants(mem)
    with pytest.raises(RecurrentMemoryError, match=r"^seq_div needs d >= 1, got 0$"):
        mem.seq_div(0, -1, -1, 0)


def test_ids_without_a_cell_are_ignored():
    """``seq_id >= mem_size`` (possible when ``n_seq_max > mem_size``): ``seq_cp``,
    ``seq_add`` and ``seq_div`` do nothing, as llama.cpp."""
    mem = new_mem(n_seq_max=3, mem_size=2)
    decode(mem, [1, 2], [0, 1])
    before = snapshot(mem)
    mem.seq_cp(2, 0)
    mem.seq_cp(0, 2)
    mem.seq_cp(1, 2)
    mem.seq_add(2, 0, -1, 1)
    mem.seq_div(2, 0, -1, 2)
    assert_same_snapshot(snapshot(mem), before)


def test_constructor_refusals():
    """``mem_size >= 1`` and ``n_seq_max`` in ``[1, LLAMA_MAX_SEQ]``, both bounds accepted."""
    with pytest.raises(RecurrentMemoryError, match=r"^mem_size=0 must be >= 1$"):
        RecurrentMemory(HP, 0, 1)
    with pytest.raises(RecurrentMemoryError, match=r"^n_seq_max=0 must be in \[1, 256\]$"):
        RecurrentMemory(HP, 1, 0)
    with pytest.raises(RecurrentMemoryError, match=r"^n_seq_max=257 must be in \[1, 256\]$"):
        RecurrentMemory(HP, 1, LLAMA_MAX_SEQ + 1)
    assert RecurrentMemory(HP, 1, LLAMA_MAX_SEQ).n_seq_max == LLAMA_MAX_SEQ
    assert RecurrentMemory(HP, 1, 1).get_size() == 1


def test_a_new_memory_is_empty():
    """As llama.cpp's constructor leaves it: one sequence by default, ``head = used = n = 0``,
    ``rs_z = -1``, every cell blank and every tail -1, the rows zero; there is no ubatch to
    undo and no ubatch to give an input to."""
    mem = RecurrentMemory(HP, 2)
    assert mem.n_seq_max == 1
    assert (mem.size, mem.head, mem.used, mem.n, mem.rs_z) == (2, 0, 0, 0, -1)
    for i in range(2):
        assert_blank(mem, i)
        assert mem.cells[i].tail == -1
    assert all(x.shape[0] == 2 and not x.any() for x in mem.r_l + mem.s_l)
    with pytest.raises(RecurrentMemoryError, match=r"^remove_ubatch undoes the last apply_ubatch"):
        mem.remove_ubatch(range(0, 1), one_seq_ubatch(0, [0]))
    with pytest.raises(RecurrentMemoryError, match=r"^ubatch of 1 sequence sets does not match "
                                                   r"the 0 cells of the last apply_ubatch$"):
        mem.rs_input(one_seq_ubatch(0, [0]))


def test_rs_input_is_that_of_the_last_applied_ubatch():
    """``llm_graph_input_rs`` of the ubatch just applied: its ``n_seqs`` sets read cells
    ``head ..``, ``s_copy`` is an ``int32`` tensor (``GGML_TYPE_I32``) of ``n_rs`` sources;
    a ubatch with no set, or with more sets than the cells the last apply placed, is
    refused by name."""
    mem = new_mem()
    ub = one_seq_ubatch(0, [0, 1])
    [cells] = mem.prepare([ub])
    mem.apply_ubatch(cells, ub)
    inp = mem.rs_input(ub)
    assert (inp.head, inp.n_seqs, inp.n_rs) == (mem.head, 1, 1)
    assert inp.s_copy.dtype == np.int32 and inp.s_copy.tolist() == [inp.rs_z]
    fake_forward(mem, ub)
    ub2 = one_seq_ubatch(0, [2])  # the sequence goes on: its own row, no zero row
    [cells2] = mem.prepare([ub2])
    mem.apply_ubatch(cells2, ub2)
    inp2 = mem.rs_input(ub2)
    assert (inp2.rs_z, mem.rs_z) == (-1, -1) and inp2.s_copy.tolist() == [mem.head]
    two = Ubatch(**{**ub2.__dict__, "n_seq_tokens": 1, "n_seqs": 2})
    none = Ubatch(**{**ub2.__dict__, "n_seqs": 0})
    for bad, n in ((two, 2), (none, 0)):
        with pytest.raises(RecurrentMemoryError, match=rf"^ubatch of {n} sequence sets does not "
                                                       r"match the 1 cells of the last "
                                                       r"apply_ubatch$"):
            mem.graph_input(cells2, bad)


def test_refusals_name_the_id_and_its_range():
    """An id out of range is named with the range; ``-1`` is offered where it means every
    sequence (``seq_rm``) and only there."""
    mem = new_mem()
    with pytest.raises(RecurrentMemoryError, match=r"^seq_id=-2 out of range \[0, 3\) "
                                                   r"\(or -1 for all sequences\)$"):
        mem.seq_rm(-2, -1, -1)
    with pytest.raises(RecurrentMemoryError, match=r"^seq_id=3 out of range \[0, 3\)$"):
        mem.seq_cp(0, 3)
    with pytest.raises(RecurrentMemoryError, match=r"^seq_id=-1 out of range \[0, 3\)$"):
        mem.seq_keep(-1)


def test_seq_rm_reaches_cells_after_an_empty_one():
    """The removal visits every cell, not only those up to the first one out of range."""
    mem = new_mem()
    decode(mem, [1, 2, 3], [0, 1, 2])
    assert [mem.cells[s].tail for s in range(3)] == [0, 1, 2]
    assert mem.seq_rm(0, -1, -1)
    assert mem.seq_rm(2, -1, -1)  # cell 2, after the empty cell 0
    assert mem.seq_pos_max(2) == -1 and mem.used == 1
    assert_blank(mem, 2)
    assert mem.seq_rm(-1, -1, -1)  # every sequence: cell 1, after the empty cell 0
    assert mem.used == 0 and mem.seq_pos_max(1) == -1
    assert_blank(mem, 1)
    check_invariants(mem)


def cell_of_a_new_sequence(mem: RecurrentMemory, seq_ids: list[int]) -> list[int]:
    """The cells new sequences ``seq_ids`` (one token each, one ubatch) are placed in."""
    assert decode(mem, [1] * len(seq_ids), seq_ids, n_ubatch=len(seq_ids))
    return [mem.cells[s].tail for s in seq_ids]


def test_a_placement_is_the_range_of_its_cells():
    """``find_slot``'s ``head .. head + n``: from the lowest to the highest cell its sets
    hold (llama.cpp: ``min = size - 1``, ``max = 0``, then every set's cell); new sequences
    take the empty cells in order from the head, and set ``s`` ends in cell ``head + s``."""
    mem = new_mem(n_seq_max=4)
    b = Batch(token=[1, 2], seq_id=[[0], [1]])
    ub = BatchAllocr(b, n_vocab=100, n_seq_max=4, memory=mem).split_equal(8, True)
    assert mem.prepare([ub]) == [range(0, 2)]  # cells 0 and 1 of 4
    decode(mem, [1], [0])
    assert mem.prepare([one_seq_ubatch(0, [1])]) == [range(0, 1)]  # cell 0 alone
    decode(mem, [1, 2, 3], [1, 2, 3], n_ubatch=3)
    assert [mem.cells[s].tail for s in range(4)] == [0, 1, 2, 3]
    assert mem.prepare([one_seq_ubatch(3, [1])]) == [range(3, 4)]  # the last cell alone
    mem.seq_rm(1, -1, -1)
    mem.seq_rm(2, -1, -1)
    assert mem.prepare([one_seq_ubatch(1, [0])]) == [range(1, 2)]  # the first empty cell
    assert mem.prepare([one_seq_ubatch(2, [0])]) == [range(1, 2)]
    check_invariants(mem)


def test_a_freed_cell_after_the_head_leaves_the_head():
    """``seq_rm`` lowers the head to a cell it frees before it, never raises it: the next
    new sequence takes the first empty cell from the head (llama.cpp's ``new_head``)."""
    mem = new_mem(n_seq_max=6)
    decode(mem, [1, 2, 3, 4], [0, 1, 2, 3], n_ubatch=4)  # cells 0..3, head 0
    assert mem.head == 0
    mem.seq_rm(1, -1, -1)  # cells 1 and 3 freed, both after the head
    mem.seq_rm(3, -1, -1)
    assert mem.head == 0
    assert cell_of_a_new_sequence(mem, [4]) == [1]


@pytest.mark.parametrize(("n_freed", "new", "cells"), [
    (3, [9], [9]),  # head 8 == used 6 + 2: the search starts at the head
    (4, [9], [0]),  # head 8 > used 5 + 2: it starts at cell 0
    (5, [9, 10], [9, 10]),  # two sets: head 8 == used 4 + 2 * 2
    (6, [9, 10], [0, 1]),  # head 8 > used 3 + 2 * 2
])
def test_the_search_starts_at_the_head_unless_enough_cells_are_free_before(n_freed, new, cells):
    """``find_slot`` starts at cell 0 when ``head > used + 2 n_seqs``, at the head otherwise
    (llama.cpp: "if we have enough unused cells before the current head")."""
    mem = new_mem(n_seq_max=12)
    decode(mem, list(range(1, 10)), list(range(9)), n_ubatch=9)  # sequence s in cell s
    for s in range(n_freed):
        mem.seq_rm(s, -1, -1)
    decode(mem, [5], [8])  # sequence 8 goes on: the head is its cell
    assert mem.head == 8 and mem.used == 9 - n_freed
    assert cell_of_a_new_sequence(mem, new) == cells
    assert mem.rs_z == cells[0]  # the zero row: the first cell of the range no cell reads
    for i in set(range(n_freed)) - set(cells):
        assert_blank(mem, i)  # the cells outside the range are left as they were
    check_invariants(mem)


# ---------------------------------------------------------------------------------------------
# prepare: all or nothing
# ---------------------------------------------------------------------------------------------


def one_seq_ubatch(seq_id: int, pos: list[int]) -> Ubatch:
    n = len(pos)
    return Ubatch(token=np.ones(n, np.int32), embd=None, pos=np.array(pos), seq_id=((seq_id,),) * n,
                  seq_id_unq=(seq_id,), output=np.zeros(n, bool), idx=np.arange(n),
                  equal_seqs=True, n_seq_tokens=n, n_seqs=1)


def test_prepare_is_all_or_nothing():
    mem = new_mem(n_seq_max=3, mem_size=2)  # seq 2 has no cell
    decode(mem, [1, 2], [0, 1])
    mem.seq_cp(0, 1)
    before = snapshot(mem)
    assert mem.prepare([one_seq_ubatch(1, [2]), one_seq_ubatch(0, [2])])  # fits ...
    assert_same_snapshot(snapshot(mem), before)  # ... and changes nothing
    assert not mem.prepare([one_seq_ubatch(1, [2]), one_seq_ubatch(2, [0])])
    assert_same_snapshot(snapshot(mem), before)
    with pytest.raises(RecurrentMemoryError, match="no cell"):
        mem.apply_ubatch(range(0, 1), one_seq_ubatch(2, [0]))
    assert_same_snapshot(snapshot(mem), before)


def test_apply_ubatch_refuses_a_placement_it_does_not_land_in():
    """``apply_ubatch`` runs ``find_slot`` again, as llama.cpp's ``apply``: landing anywhere
    but the placement ``prepare`` gave (a ubatch applied out of order) is refused by name,
    the memory unchanged."""
    mem = busy_mem()
    before = snapshot(mem)
    ub = one_seq_ubatch(0, [5])
    [cells] = mem.prepare([ub])
    wrong = range(cells.start + 1, cells.stop + 1)
    with pytest.raises(RecurrentMemoryError, match="^" + re.escape(
            f"the ubatch lands in cells {cells}, not in its placement {wrong}: "
            "prepare() the ubatches in order") + "$"):
        mem.apply_ubatch(wrong, ub)
    assert_same_snapshot(snapshot(mem), before)


def test_remove_ubatch_undoes_the_last_apply_once():
    msg = (r"^remove_ubatch undoes the last apply_ubatch only, "
           r"before anything else changes the memory$")
    mem = busy_mem()
    before = snapshot(mem)
    ub = one_seq_ubatch(0, [5])
    [cells] = mem.prepare([ub])
    mem.apply_ubatch(cells, ub)
    mem.remove_ubatch(cells, ub)
    assert_same_snapshot(snapshot(mem), before)
    with pytest.raises(RecurrentMemoryError, match=msg):
        mem.remove_ubatch(cells, ub)  # already undone
    mem.apply_ubatch(cells, ub)
    mem.clear()
    with pytest.raises(RecurrentMemoryError, match=msg):
        mem.remove_ubatch(cells, ub)  # the memory changed since


def test_backup_restore_puts_back_cells_and_rows():
    mem = busy_mem()
    before = snapshot(mem)
    saved = mem.backup()
    decode(mem, [7, 8, 9], [0, 1, 2])
    mem.seq_rm(2, -1, -1)
    mem.restore(saved)
    assert_same_snapshot(snapshot(mem), before)
    rows = mem.save_rows(range(mem.size))
    with pytest.raises(ValueError):
        mem.load_rows(range(mem.size), rows[:-1])  # one array per layer and state


def test_init_batch_splits_by_sequence_when_every_token_embeds():
    """llama.cpp's ``init_batch``: ``split_seq(n_ubatch)`` when every token outputs an
    embedding (``embd_all``), ``split_equal(n_ubatch, sequential=True)`` otherwise; then
    every ubatch is placed, and nothing changes until one is applied."""
    mem = new_mem()
    batch = Batch(token=[1, 2, 3, 4], seq_id=[[0], [1], [0], [1]])

    def split(n_ubatch: int, embd_all: bool) -> list[list[int]]:
        balloc = BatchAllocr(batch, n_vocab=100, n_seq_max=3, memory=mem)
        mctx = mem.init_batch(balloc, n_ubatch, embd_all=embd_all)
        assert mctx.get_status() == MemoryStatus.SUCCESS
        assert len(mctx.placements) == len(mctx.ubatches)
        return [ub.idx.tolist() for ub in mctx.ubatches]

    before = snapshot(mem)
    assert split(8, embd_all=True) == [[0, 2], [1, 3]]  # one sequence per ubatch
    assert split(1, embd_all=True) == [[0], [1], [2], [3]]
    assert split(8, embd_all=False) == [[0, 2, 1, 3]]  # two sets of two tokens
    assert_same_snapshot(snapshot(mem), before)


def test_update_has_nothing_to_do():
    mem = busy_mem()
    before = snapshot(mem)
    assert mem.update() is False
    update = mem.init_update()
    assert update.get_status() == MemoryStatus.NO_UPDATE and update.memory is mem
    assert update.apply() is False  # nothing turned
    assert_same_snapshot(snapshot(mem), before)


def test_find_slot_refuses_unequal_sets():
    mem = new_mem()
    ub = one_seq_ubatch(0, [0, 1])
    bad = Ubatch(**{**ub.__dict__, "n_seqs": 2})
    with pytest.raises(RecurrentMemoryError, match="equal sequence sets"):
        mem.find_slot(bad)


# ---------------------------------------------------------------------------------------------
# random operations against a brute-force model
# ---------------------------------------------------------------------------------------------


class Model:
    """The spec of the spec: sequence -> group; group -> (pos, state). Sharing = one group."""

    def __init__(self, n_seq: int):
        self.n_seq = n_seq
        self.group: dict[int, int] = {}
        self.data: dict[int, tuple[int, tuple]] = {}
        self.next_gid = 0

    def _new(self, pos, state) -> int:
        self.next_gid += 1
        self.data[self.next_gid] = (pos, state)
        return self.next_gid

    def _gc(self):
        alive = set(self.group.values())
        self.data = {g: d for g, d in self.data.items() if g in alive}

    def pos(self, s) -> int:
        return self.data[self.group[s]][0] if s in self.group else -1

    def decode(self, toks_per_seq: dict[int, list[int]]):
        for s, toks in toks_per_seq.items():
            old = self.data[self.group[s]] if s in self.group else None
            first = self.pos(s) + 1
            state = expected_state(toks, old[1] if old else None)
            self.group[s] = self._new(first + len(toks) - 1, state)
        self._gc()

    def seq_rm(self, s, p0, p1) -> bool:
        p0, p1 = max(p0, 0), (POS_INF if p1 < 0 else p1)
        if s == -1:
            if p0 == p1:
                return True
            if (p0, p1) != (0, POS_INF):
                return False
            self.group.clear()
        elif s in self.group:
            pos = self.pos(s)
            if 0 < p0 <= pos < p1:
                return False
            if p0 <= pos < p1:
                del self.group[s]
        self._gc()
        return True

    def seq_cp(self, src, dst):
        if src == dst:
            return
        self.group.pop(dst, None)
        if src in self.group:
            self.group[dst] = self.group[src]
        self._gc()

    def seq_keep(self, s):
        self.group = {s: self.group[s]} if s in self.group else {}
        self._gc()

    def seq_add(self, s, p0, p1, shift):
        p0, p1 = max(p0, 0), (POS_INF if p1 < 0 else p1)
        if shift == 0 or p0 == p1 or s not in self.group:
            return
        g = self.group[s]
        pos, state = self.data[g]
        if p0 <= pos < p1:
            if pos + shift < 0:
                self.group = {t: h for t, h in self.group.items() if h != g}
            else:
                self.data[g] = (pos + shift, state)
        self._gc()

    def seq_div(self, s, p0, p1, d):
        p0, p1 = max(p0, 0), (POS_INF if p1 < 0 else p1)
        if d == 1 or p0 == p1 or s not in self.group:
            return
        g = self.group[s]
        pos, state = self.data[g]
        if p0 <= pos < p1:
            self.data[g] = (pos // d, state)


def assert_agrees(mem: RecurrentMemory, model: Model) -> None:
    check_invariants(mem)
    for s in range(model.n_seq):
        assert mem.seq_pos_min(s) == mem.seq_pos_max(s) == model.pos(s), f"seq {s}"
        got = seq_state(mem, s)
        if s not in model.group:
            assert got is None
            continue
        assert same_state(got, model.data[model.group[s]][1]), f"state of seq {s}"
        for t in range(model.n_seq):  # the same cell exactly when the same group
            if t in model.group:
                shared = mem.cells[s].tail == mem.cells[t].tail
                assert shared == (model.group[s] == model.group[t]), f"sharing {s}, {t}"


N_SEQ = 3
seq = st.integers(0, N_SEQ - 1)
pos_arg = st.integers(-1, 12)
ops = st.one_of(
    st.tuples(st.just("decode"), st.dictionaries(seq, st.lists(st.integers(1, 50),
                                                               min_size=1, max_size=3),
                                                 min_size=1, max_size=N_SEQ)),
    st.tuples(st.just("seq_rm"), st.integers(-1, N_SEQ - 1), pos_arg, pos_arg),
    st.tuples(st.just("seq_cp"), seq, seq),
    st.tuples(st.just("seq_keep"), seq),
    st.tuples(st.just("seq_add"), seq, pos_arg, pos_arg, st.integers(-8, 8)),
    st.tuples(st.just("seq_div"), seq, pos_arg, pos_arg, st.integers(1, 4)),
    st.tuples(st.just("save_clear_restore")),
    st.tuples(st.just("seq_save_restore"), seq, seq),
)


def run_op(mem: RecurrentMemory, model: Model, op) -> None:
    name, *args = op
    if name == "decode":
        toks_per_seq = args[0]
        # interleave the sequences' tokens in one batch
        order = [(s, t) for k in range(3) for s, toks in sorted(toks_per_seq.items())
                 for t in toks[k: k + 1]]
        assert decode(mem, [t for _, t in order], [s for s, _ in order], n_ubatch=4)
        model.decode({s: list(toks) for s, toks in toks_per_seq.items()})
    elif name == "seq_rm":
        assert mem.seq_rm(*args) == model.seq_rm(*args)
    elif name == "seq_cp":
        mem.seq_cp(*args, -1, -1)
        model.seq_cp(*args)
    elif name == "save_clear_restore":
        blob = state_write(mem, HP)
        mem.clear()
        state_read(mem, HP, blob)
        assert state_write(mem, HP) == blob
    elif name == "seq_save_restore":
        src, dst = args
        blob = state_write(mem, HP, seq_id=src)
        state_read(mem, HP, blob, dest_seq_id=dst)
        g = model.group.get(src)  # read before dst (maybe src) is removed
        model.group.pop(dst, None)
        if g is not None:
            model.group[dst] = model._new(*model.data[g])
        model._gc()
    else:
        getattr(mem, name)(*args)
        getattr(model, name)(*args)


@given(st.lists(ops, max_size=12))
def test_random_operations_agree_with_the_brute_force_model(op_list):
    mem, model = new_mem(N_SEQ), Model(N_SEQ)
    for op in op_list:
        run_op(mem, model, op)
        assert_agrees(mem, model)


# ---------------------------------------------------------------------------------------------
# state save / restore
# ---------------------------------------------------------------------------------------------


def busy_mem(dtype=np.float64) -> RecurrentMemory:
    """Three sequences, two sharing a cell, in fragmented cells."""
    mem = new_mem(3, dtype=dtype)
    decode(mem, [1, 2, 3], [2, 2, 2])
    decode(mem, [4], [0])
    decode(mem, [5, 6], [1, 1])
    mem.seq_rm(0, -1, -1)
    mem.seq_cp(1, 0)
    return mem


def test_state_round_trip_is_byte_identical():
    mem = busy_mem()
    blob = state_write(mem, HP)
    fresh = new_mem(3)
    state_read(fresh, HP, blob)
    assert state_write(fresh, HP) == blob
    assert state_parse(blob).cell_count == 2
    for s in range(3):
        seq_blob = state_write(mem, HP, seq_id=s)
        other = new_mem(3)
        state_read(other, HP, seq_blob, dest_seq_id=s)
        assert state_write(other, HP, seq_id=s) == seq_blob


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_save_clear_restore_continue_equals_uninterrupted(dtype):
    mem = busy_mem(dtype)
    blob = state_write(mem, HP)
    decode(mem, [7, 8, 9, 10], [0, 1, 2, 0])
    want = [seq_state(mem, s) for s in range(3)]
    mem2 = busy_mem(dtype)
    decode(mem2, [11, 12], [1, 2])  # diverge, then go back
    mem2.clear()
    state_read(mem2, HP, blob)
    decode(mem2, [7, 8, 9, 10], [0, 1, 2, 0])
    for s in range(3):
        assert same_state(seq_state(mem2, s), want[s])
        assert mem2.seq_pos_max(s) == mem.seq_pos_max(s)


def test_sequence_restore_under_another_id_continues_identically():
    mem = busy_mem()
    blob = state_write(mem, HP, seq_id=1)
    decode(mem, [7, 8], [1, 1])
    want = seq_state(mem, 1)
    other = new_mem(3)
    decode(other, [9], [0])
    decode(other, [9, 9], [2, 2])
    state_read(other, HP, blob, dest_seq_id=2)  # replaces seq 2
    decode(other, [7, 8], [2, 2])
    assert same_state(seq_state(other, 2), want)
    assert other.seq_pos_max(2) == mem.seq_pos_max(1)
    assert same_state(seq_state(other, 0), expected_state([9]))
    check_invariants(other)


def test_empty_sequence_blob_empties_the_destination():
    mem = busy_mem()
    blob = state_write(new_mem(3), HP, seq_id=0)
    state_read(mem, HP, blob, dest_seq_id=2)
    assert mem.seq_pos_max(2) == -1


def test_whole_restore_replaces_cells_and_rows():
    """As ``state_read_meta``: clear with the rows, the saved cells at ``0 .. n-1``, the
    head at 0; the same memory whatever was there before."""
    src = new_mem(3)
    decode(src, [4, 5], [1, 1])
    blob = state_write(src, HP)
    for dirty in (True, False):
        mem = busy_mem() if dirty else new_mem(3)
        state_read(mem, HP, blob)
        assert (mem.head, mem.used) == (0, 1)
        assert [(c.pos, c.src, c.tail, c.seq_id) for c in mem.cells] == [
            (1, 0, -1, {1}), (-1, -1, 0, set()), (-1, -1, -1, set())]
        for x in mem.r_l + mem.s_l:
            assert not x[1:].any()  # rows without a cell are zero
        assert same_state(seq_state(mem, 1), seq_state(src, 1))
    state_read(mem, HP, state_write(new_mem(3), HP))  # an empty memory
    assert (mem.head, mem.used) == (0, 0)
    assert all(not x.any() for x in mem.r_l + mem.s_l)
    decode(mem, [1], [2])
    assert mem.cells[2].tail == 0


def test_state_file_round_trip(tmp_path):
    mem = busy_mem()
    path = tmp_path / "rs.bin"
    n = state_save_file(path, mem, HP, [1, 2, 3])
    assert path.stat().st_size == n
    fresh = new_mem(3)
    assert state_load_file(path, fresh, HP).tolist() == [1, 2, 3]
    assert state_write(fresh, HP) == state_write(mem, HP)
    path1 = tmp_path / "seq.bin"
    state_save_file(path1, mem, HP, [4], seq_id=1)
    assert state_load_file(path1, fresh, HP, dest_seq_id=2).tolist() == [4]
    assert same_state(seq_state(fresh, 2), seq_state(mem, 1))


def _reseal(blob: bytes, body: bytes) -> bytes:
    """A blob with another body but a valid checksum (to reach the checks after it)."""
    import hashlib
    import struct

    head = blob[:4] + struct.pack("<IQ", 1, 16 + len(body) + 32) + body
    return head + hashlib.sha256(head).digest()


def refused_blobs() -> list[tuple[str, bytes, int, str]]:
    """(name, blob, dest_seq_id, the whole message) for every refusal."""
    import struct

    from reference.memory import KVCache
    from reference.memory.state import state_write as kv_state_write
    from tests.support.tiny_models import tiny_hparams

    mem = busy_mem()
    whole = state_write(mem, HP)
    seq1 = state_write(mem, HP, seq_id=1)
    kv_hp = tiny_hparams(n_layer=1)
    big = new_mem(5)
    decode(big, [1, 2, 3, 4], [0, 1, 3, 4])
    twice = busy_mem()  # a broken memory: seq 2 in two cells
    twice.cells[1] = MemCell(pos=3, src=1, seq_id={2})
    twice.used = 3
    # the body: arch (4 + 5 bytes), fingerprint (32), r_type at 41, s_type, seq_id,
    # cell_count at 53, the cells, s_trans, n_layer, the layer blocks
    body = whole[16:-32]
    r99 = _reseal(whole, body[:41] + struct.pack("<i", 99) + body[45:])
    empty = state_write(new_mem(3), HP)[16:-32]  # no cell: n_layer at 61, blocks of 12 bytes
    one_layer = _reseal(whole, empty[:61] + struct.pack("<I", 1) + empty[65:77] + empty[89:101])
    return [
        ("kv blob", kv_state_write(KVCache(kv_hp, kv_size=8), kv_hp), -1,
         "bad magic b'LRKV': not a recurrent state blob (expected b'LRRS')"),
        ("truncated", whole[:-5], -1,
         f"recurrent state blob truncated at byte {len(whole) - 5}: the header says "
         f"{len(whole)} bytes"),
        ("corrupted", whole[:40] + bytes([whole[40] ^ 1]) + whole[41:], -1,
         "recurrent state blob checksum mismatch: the bytes are corrupted"),
        ("other arch", state_write(new_mem(3, hp=StubHParams(arch="mamba2")),
                                   StubHParams(arch="mamba2")), -1,
         "blob written for architecture 'mamba2', this model is 'mamba'"),
        ("other hparams", state_write(new_mem(3, hp=StubHParams(n_s=5)), StubHParams(n_s=5)),
         -1, "blob written for other hyperparameters: another model"),
        ("other dtype", state_write(new_mem(3, dtype=np.float32), HP), -1,
         "dtype mismatch: blob float32 (ggml type 0)/float32 (ggml type 0), "
         "this memory float64 (ggml type 28)"),
        ("unknown row type", r99, -1, "unsupported row type ggml type 99"),
        ("seq blob as whole", seq1, -1, "blob holds sequence 1: restore it with dest_seq_id >= 0"),
        ("whole blob as seq", whole, 1,
         "blob holds the whole memory: restore it with dest_seq_id -1"),
        ("dest out of range", seq1, 3, "dest_seq_id=3 out of range [0, 3) or -1"),
        ("too many cells", state_write(big, HP), -1, "does not fit: 4 cells, at most 3 here"),
        ("two cells for a sequence", state_write(twice, HP, seq_id=2), 1,
         "does not fit: 2 cells, at most 1 here"),
        ("duplicate tail", state_write(twice, HP), -1,
         "cell 1: seq_id 2 is in two cells (duplicate tail)"),
        # llama.cpp's state_read_data checks n_layer before it looks at cell_count
        ("other n_layer, no cell", one_layer, -1, "blob has 1 layers, the model 2"),
        ("version", whole[:4] + b"\x02" + whole[5:], -1,
         "recurrent state blob format version 2 (written by a newer llamaref): this reader "
         "knows version 1"),
    ]


@pytest.mark.parametrize("case", refused_blobs(), ids=lambda c: c[0])
def test_refused_blobs_leave_the_memory_bit_identical(case):
    _, blob, dest, message = case
    mem = busy_mem()
    before = snapshot(mem)
    with pytest.raises(StateError, match=f"^{re.escape(message)}$"):
        state_read(mem, HP, blob, dest_seq_id=dest)
    assert_same_snapshot(snapshot(mem), before)


def crafted_blob(cells, seq_id: int = -1, s_trans: int = 0, widths=(HP.n_r, HP.n_s),
                 n_seq_field=None, count_field=None, n_layer_field=None, layers: bool = True,
                 extra: bytes = b"", blocks: bytes | None = None) -> bytes:
    """A blob of the documented layout written by hand (HP's arch and fingerprint, float64
    rows of zeros): ``cells`` as ``(pos, seq_ids)``; the ``*_field`` arguments replace a
    count as written (a cell's sequences, the cells, the layers); ``layers=False`` ends the
    body after ``n_layer``; ``blocks`` replaces the layer blocks. The header is 57 bytes:
    arch (4 + 5), fingerprint (32), the types, ``seq_id`` and the cell count (16)."""
    import struct

    from reference.memory.blob import seal
    from reference.memory.recurrent import RS_STATE_MAGIC, RS_STATE_VERSION
    from reference.memory.state import hparams_fingerprint

    body = struct.pack("<I", len(HP.arch)) + HP.arch.encode() + hparams_fingerprint(HP)
    count = len(cells) if count_field is None else count_field
    body += struct.pack("<iiiI", 28, 28, seq_id, count)
    for pos, ids in cells:
        n = len(ids) if n_seq_field is None else n_seq_field
        body += struct.pack("<iI", pos, n) + b"".join(struct.pack("<i", i) for i in ids)
    n_layer = HP.n_layer if n_layer_field is None else n_layer_field
    body += struct.pack("<II", s_trans, n_layer)
    for width in widths if layers and blocks is None else ():
        for _ in range(HP.n_layer):
            body += struct.pack("<iQ", 28, 8 * width) + bytes(8 * width * len(cells))
    return seal(RS_STATE_MAGIC, RS_STATE_VERSION, body + (blocks or b"") + extra)


def layer_block(ggml_type: int, size_row: int, n_cells: int = 1) -> bytes:
    """One layer's block: its type, its row size in bytes, ``n_cells`` rows of zeros."""
    import struct

    return struct.pack("<iQ", ggml_type, size_row) + bytes(size_row * n_cells)


def crafted_refusals() -> list[tuple[str, bytes, int, str]]:
    """(name, blob, dest_seq_id, the whole message): each rule of ``state_parse`` and
    ``state_check`` that a blob of the right kind, model and dtype can still break."""
    ids256 = tuple(range(256))
    return [
        ("negative position", crafted_blob([(-1, (0,))]), -1, "cell 0: position -1 < 0"),
        ("no sequence", crafted_blob([(2, ())]), -1,
         "cell 0: sequence ids () not ascending and unique"),
        ("descending ids", crafted_blob([(2, (1, 0))]), -1,
         "cell 0: sequence ids (1, 0) not ascending and unique"),
        ("repeated id", crafted_blob([(2, (0, 2)), (4, (1, 1))]), -1,
         "cell 1: sequence ids (1, 1) not ascending and unique"),
        ("another sequence's cell", crafted_blob([(2, (2,))], seq_id=1), 0,
         "cell 0: sequence ids (2,) in a blob of sequence 1"),
        ("two sequences in a sequence blob", crafted_blob([(2, (1, 2))], seq_id=1), 0,
         "cell 0: sequence ids (1, 2) in a blob of sequence 1"),
        ("seq id out of range", crafted_blob([(2, (0,)), (3, (3,))]), -1,
         "cell 1: seq_id 3 out of range [0, 3)"),
        ("negative seq id", crafted_blob([(2, (-1,))]), -1,
         "cell 0: seq_id -1 out of range [0, 3)"),
        ("256 sequences: read, then out of range", crafted_blob([(2, ids256)]), -1,
         "cell 0: seq_id 3 out of range [0, 3)"),
        ("257 sequences", crafted_blob([(2, (0,))], n_seq_field=257), -1,
         "a cell lists 257 sequences"),
        ("2**32 - 1 sequences (a u32)", crafted_blob([(2, (0,))], n_seq_field=2**32 - 1), -1,
         "a cell lists 4294967295 sequences"),
        # a u32 count of 2**31 cells: the first cell reads s_trans and n_layer as its position
        # and its 2 sequences, and the first id is past the end (byte 65)
        ("2**31 cells (a u32)", crafted_blob([], count_field=2**31, layers=False), -1,
         "recurrent state blob truncated at byte 65: 4 bytes needed at offset 65"),
        # a u32 count of 2**31 layers: the first layer block is past the end (byte 77)
        ("2**31 layers (a u32)", crafted_blob([(2, (0,))], n_layer_field=2**31, layers=False),
         -1, "recurrent state blob truncated at byte 77: 12 bytes needed at offset 77"),
        ("transposed", crafted_blob([(2, (0,))], s_trans=1), -1,
         "transposed S rows (s_trans = 1) are not supported"),
        ("conv rows of another width", crafted_blob([(2, (0,))], widths=(4, 4)), -1,
         "layer 0: rows of 4/4 elements (conv/ssm), this memory holds 3/4"),
        ("ssm rows of another width", crafted_blob([(2, (0,))], widths=(3, 5)), -1,
         "layer 0: rows of 3/5 elements (conv/ssm), this memory holds 3/4"),
        ("bytes after the last layer", crafted_blob([(2, (0,))], extra=bytes(3)), -1,
         "recurrent state blob has 3 unread bytes"),
        ("conv rows of another type", crafted_blob([(2, (0,))], blocks=layer_block(0, 12)), -1,
         "layer 0 conv rows are float32 (ggml type 0), the header says float64 (ggml type 28)"),
        ("ssm row size not whole elements",
         crafted_blob([(2, (0,))], blocks=2 * layer_block(28, 24) + layer_block(28, 20)), -1,
         "layer 0 ssm row size 20 is not a whole number of float64 elements"),
    ]


@pytest.mark.parametrize("case", crafted_refusals(), ids=lambda c: c[0])
def test_crafted_blobs_are_refused_by_name(case):
    """Each rule named by its whole message, the memory bit-identical; the same layout
    with every rule kept is restored (the crafting is right)."""
    _, blob, dest, message = case
    mem = busy_mem()
    before = snapshot(mem)
    with pytest.raises(StateError, match="^" + re.escape(message) + "$"):
        state_read(mem, HP, blob, dest_seq_id=dest)
    assert_same_snapshot(snapshot(mem), before)


def test_a_crafted_blob_that_keeps_every_rule_is_restored():
    """Position 0 is a position (one token absorbed), in a whole blob and a sequence blob."""
    mem = busy_mem()
    state_read(mem, HP, crafted_blob([(0, (0, 2)), (5, (1,))]))
    assert [mem.seq_pos_max(s) for s in range(3)] == [0, 5, 0]
    assert mem.cells[0].tail == mem.cells[2].tail == 0 and mem.cells[1].tail == 1
    state_read(mem, HP, crafted_blob([(0, (1,))], seq_id=1), dest_seq_id=2)
    assert [mem.seq_pos_max(s) for s in range(3)] == [0, 5, 0]
    assert mem.cells[2].tail not in (mem.cells[0].tail, mem.cells[1].tail)
    check_invariants(mem)


def test_refused_file_leaves_memory_unchanged(tmp_path):
    mem = busy_mem()
    path = tmp_path / "rs.bin"
    state_save_file(path, mem, HP, [1])
    data = path.read_bytes()
    path.write_bytes(data[:-1] + bytes([data[-1] ^ 1]))
    target = new_mem(3)
    decode(target, [3], [0])
    before = snapshot(target)
    with pytest.raises(StateError, match="checksum"):
        state_load_file(path, target, HP)
    assert_same_snapshot(snapshot(target), before)


def test_refused_files_name_the_file(tmp_path):
    """A file that is not a state file, or whose token count runs past its end."""
    import struct

    from reference.memory.blob import seal
    from reference.memory.state import FILE_MAGIC, FILE_VERSION

    target = busy_mem()
    before = snapshot(target)
    path = tmp_path / "rs.bin"
    path.write_bytes(state_write(target, HP))  # a bare blob is not a file
    with pytest.raises(StateError, match=r"^bad magic b'LRRS': not a state file "):
        state_load_file(path, target, HP)
    data = seal(FILE_MAGIC, FILE_VERSION, struct.pack("<I", 2**31) + bytes(8))
    path.write_bytes(data)
    with pytest.raises(StateError, match=f"^state file truncated at byte 12: {4 * 2**31} bytes "
                                         "needed at offset 4$"):
        state_load_file(path, target, HP)
    assert_same_snapshot(snapshot(target), before)


def test_state_write_refusals():
    """A sequence out of range, or the hyperparameters of another model, each by its whole
    message (a blob is written for the memory's own model; reading checks the same)."""
    mem = busy_mem()
    with pytest.raises(StateError, match=r"^seq_id=3 out of range \[0, 3\) or -1$"):
        state_write(mem, HP, seq_id=3)
    with pytest.raises(StateError, match="^hparams are not those of this memory$"):
        state_write(mem, StubHParams(n_layer=3))
    before = snapshot(mem)
    with pytest.raises(StateError, match="^hparams are not those of this memory$"):
        state_read(mem, StubHParams(n_layer=3), state_write(mem, HP))
    assert_same_snapshot(snapshot(mem), before)
