r"""KV cells: the bookkeeping of a KV cache, ``llama_kv_cells`` (``src/llama-kv-cells.h``).

A KV cache of size $n$ is an array of $n$ *cells*. The key/value tensors hold one row per
cell; this class holds what each row *means*, in arrays as llama.cpp keeps them:

- ``pos`` ``(n,)`` int: the position of the token stored in cell $i$, or $-1$ when the cell
  is empty;
- ``seq`` ``(n, LLAMA_MAX_SEQ)`` bool: ``seq[i, s]`` when sequence $s$ holds cell $i$
  (llama.cpp's ``std::bitset<LLAMA_MAX_SEQ>`` per cell). A prompt decoded once and copied
  to several sequences with ``seq_cp`` is stored once, in cells whose row has several bits;
- ``shift`` ``(n,)`` int: the position change accumulated since the keys were last
  re-roped (the K-shift, applied lazily by the cache's ``update``);
- ``seq_pos[s]``: the $(pos_i, i)$ pairs of the cells of sequence $s$, as a sorted list
  (llama.cpp's ``std::set<std::pair<llama_pos, uint32_t>>``), so that the smallest and
  largest position of a sequence are its first and last pair, read without scanning the
  cells. The cell index is part of the pair because one sequence can hold a position twice
  (a cell being reused; the repeated positions of some vision models).

and three counts, kept so that no query scans the cells: ``n_used`` (non-empty cells, for
``get_used``), ``n_shifted`` (cells with a non-zero shift: a K-shift is pending) and the end
of the used range (``used_max_p1``, the ``n_kv`` rule).

Why a sorted list for ``seq_pos``, and not a count per position with a cached minimum and
maximum: when the smallest position leaves, a count map must scan for the next one; a list
kept sorted finds any pair by bisection, takes the next position of a generation (the
common case) at its end, and has the minimum and maximum at its two ends.

Invariants (checked by the tests after every operation):

$$
pos_i = -1 \iff \neg\exists s:\ seq_{i,s}, \qquad pos_i = -1 \implies shift_i = 0,
$$

$$
\mathrm{seq\_pos}[s] = \mathrm{sorted}\,\{(pos_i, i) : seq_{i,s}\}, \qquad
n_{used} = |\{ i : pos_i \ne -1 \}|, \qquad n_{shifted} = |\{ i : shift_i \ne 0 \}|.
$$

(Between ``pos_set`` and the ``seq_add`` that follows it a cell holds a position and no
sequence, as in llama.cpp.)

**One door for every change.** A method that changes cells computes their new rows and
hands them to ``_assign``, which writes them and brings ``seq_pos`` and the counts along.
Each method of llama.cpp (one cell: ``seq_rm(i, seq_id)``) has an array form that takes
cell indices (``seq_rm_cells(idxs, seq_id)``): the cache's operations over ranges of cells
call those, once, instead of looping over the cells.

**Undo journal.** A decode places its ubatches for real to see whether they fit, then puts
the cells back (all or nothing). Between [`KVCells.begin`][] and [`KVCells.rollback`][]
``_assign`` records the old row of each cell it touches, once: a failed decode costs what it
changed, not what the cache holds.

Every method has the name of its C++ twin and the same contract. One method differs on
purpose: [`KVCells.pos_div`][] records the shift with the sign [`KVCells.pos_add`][]
uses (new minus old); llama.cpp records old minus new there, which rotates the keys the
wrong way after ``seq_div`` (see [`pos_div_shift_llamacpp`][] and the K-shift chapter).
"""

from __future__ import annotations

from bisect import bisect_left, insort

import numpy as np
from numpy.typing import ArrayLike

from reference.common import LLAMA_MAX_SEQ

#: more pairs than this changing in one sequence: rebuild its ``seq_pos`` list in one sort
#: rather than bisect pair by pair (each insertion or deletion moves the list's tail)
SEQ_POS_REBUILD = 64


# --8<-- [start:pos_div_shift]
def pos_div_shift(p_old, d: int):
    """The K-shift recorded when ``pos_div`` moves a cell from ``p_old`` to ``p_old // d``.

    The keys of the cell were roped at ``p_old``; to read as if roped at ``p_new`` they must
    turn by ``p_new - p_old`` (RoPE additivity), the sign ``pos_add`` records. ``p_old`` may
    be an array (one shift per cell).

    Examples:
        >>> pos_div_shift(7, 2)
        -4
    """
    return p_old // d - p_old
# --8<-- [end:pos_div_shift]


# --8<-- [start:pos_div_shift_llamacpp]
def pos_div_shift_llamacpp(p_old: int, d: int) -> int:
    """The shift llama.cpp's ``llama_kv_cells::pos_div`` records: ``p_old - p_new``.

    The opposite of [`pos_div_shift`][]: at the pinned commit the keys of a divided cell
    are turned *forward* by ``p_old - p_new`` instead of back, so they end up roped at
    ``2 p_old - p_new`` rather than ``p_new``. Kept only to pin the divergence in tests.

    Examples:
        >>> pos_div_shift_llamacpp(7, 2)
        4
    """
    return p_old - p_old // d
# --8<-- [end:pos_div_shift_llamacpp]


def _idx(idxs: ArrayLike) -> np.ndarray:
    return np.asarray(idxs, dtype=np.int64).reshape(-1)  # (k,)


def _pairs(pos: np.ndarray, idxs: np.ndarray) -> list[tuple[int, int]]:
    """``seq_pos`` pairs ``(pos, i)`` of the cells ``idxs``, as Python ints."""
    return list(zip(pos.tolist(), idxs.tolist(), strict=True))


# --8<-- [start:KVCells]
class KVCells:
    """The metadata of ``size`` KV cells (``llama_kv_cells``), as arrays.

    Args:
        size: number of cells (``resize``); all start empty.

    Attributes:
        pos: ``(size,)`` int64, the position of each cell, -1 when empty.
        seq: ``(size, LLAMA_MAX_SEQ)`` bool, ``seq[i, s]``: sequence ``s`` holds cell ``i``.
        shift: ``(size,)`` int64, the pending K-shift of each cell.
        seq_pos: per sequence id, its ``(pos, i)`` pairs, sorted.
        has_shift: llama.cpp's flag: some position changed since ``reset_shift``.
        n_used: number of non-empty cells.
        n_shifted: number of cells with a non-zero shift.

    Positions are int64 (llama.cpp: int32) so that no shift wraps around.

    Examples:
        >>> cells = KVCells(4)
        >>> cells.pos_set(0, 5); cells.seq_add(0, 0); cells.seq_add(0, 1)
        >>> cells.pos_get(0), sorted(cells.seq_get_all(0)), cells.get_used()
        (5, [0, 1], 1)
        >>> cells.seq_pos_min(1), cells.seq_pos_max(1), cells.seq_pos_max(2)
        (5, 5, -1)
        >>> cells.pos_add(0, -6)   # below 0: the cell is freed
        True
        >>> cells.is_empty(0), cells.seq_pos_max(0)
        (True, -1)
    """

    def __init__(self, size: int = 0):
        self.resize(size)

    # ---- size and reset --------------------------------------------------------------

    def resize(self, n: int) -> None:
        """Make ``n`` empty cells (``resize``)."""
        self.pos = np.full(n, -1, dtype=np.int64)  # (n,)
        self.shift = np.zeros(n, dtype=np.int64)  # (n,)
        self.seq = np.zeros((n, LLAMA_MAX_SEQ), dtype=bool)  # (n, LLAMA_MAX_SEQ)
        self.reset()

    def reset(self) -> None:
        """Empty every cell, drop every shift (``reset``); forget any journal."""
        self.pos.fill(-1)
        self.shift.fill(0)
        self.seq.fill(False)
        self.has_shift = False
        self.seq_pos: list[list[tuple[int, int]]] = [[] for _ in range(LLAMA_MAX_SEQ)]
        self.n_used = 0
        self.n_shifted = 0
        self._used_max_p1 = 0
        self._journal: dict[int, tuple] | None = None
        self._journal_has_shift = False

    def reset_shift(self) -> None:
        """Forget the accumulated shifts, once the keys are re-roped (``reset_shift``)."""
        self.has_shift = False
        self.shift.fill(0)
        self.n_shifted = 0

    def size(self) -> int:
        """Number of cells."""
        return len(self.pos)

    def copy(self) -> KVCells:
        """A deep copy (the tests' snapshots; a decode's rollback uses the journal)."""
        new = KVCells.__new__(KVCells)
        new.pos, new.shift, new.seq = self.pos.copy(), self.shift.copy(), self.seq.copy()
        new.has_shift = self.has_shift
        new.seq_pos = [list(pairs) for pairs in self.seq_pos]
        new.n_used, new.n_shifted, new._used_max_p1 = self.n_used, self.n_shifted, self._used_max_p1
        new._journal, new._journal_has_shift = None, False
        return new

    def __eq__(self, other: object) -> bool:
        """Same cells (positions, sequences, shifts, flag) and same derived structures."""
        if not isinstance(other, KVCells):
            return NotImplemented
        return (np.array_equal(self.pos, other.pos) and np.array_equal(self.seq, other.seq)
                and np.array_equal(self.shift, other.shift) and self.has_shift == other.has_shift
                and self.seq_pos == other.seq_pos
                and (self.n_used, self.n_shifted, self._used_max_p1)
                == (other.n_used, other.n_shifted, other._used_max_p1))

    __hash__ = None  # mutable

    # ---- queries ---------------------------------------------------------------------

    def is_empty(self, i: int) -> bool:
        """Whether cell ``i`` holds no token."""
        return bool(self.pos[i] == -1)

    def get_used(self) -> int:
        """Number of non-empty cells."""
        return self.n_used

    def used_min(self) -> int:
        """Index of the first non-empty cell; 0 when all are empty (a scan: no decode asks)."""
        used = np.flatnonzero(self.pos != -1)
        return int(used[0]) if used.size else 0

    def used_max_p1(self) -> int:
        """Index of the last non-empty cell plus one; 0 when all are empty."""
        return self._used_max_p1

    def get_has_shift(self) -> bool:
        """Whether some position changed since the last ``reset_shift`` (llama.cpp's flag).

        The flag stays set when the shifted cells are freed since or their shifts cancel;
        ``n_shifted > 0`` says whether some cell still owes a turn of its key.
        """
        return self.has_shift

    def seq_count(self, i: int) -> int:
        """Number of sequences sharing the non-empty cell ``i``."""
        return int(np.count_nonzero(self.seq[i]))

    def seq_get_all(self, i: int) -> frozenset[int]:
        """The sequences cell ``i`` is visible to."""
        return frozenset(np.flatnonzero(self.seq[i]).tolist())

    def seq_has(self, i: int, seq_id: int) -> bool:
        """Whether cell ``i`` belongs to ``seq_id``."""
        return bool(self.seq[i, seq_id])

    def seq_get(self, i: int) -> int:
        """The only sequence of cell ``i`` (call only when ``seq_count(i) == 1``)."""
        assert self.seq_count(i) == 1
        return int(np.argmax(self.seq[i]))

    def seq_pos_min(self, seq_id: int) -> int:
        """Smallest position of ``seq_id`` in the cells; -1 when it has none. O(1)."""
        pairs = self.seq_pos[seq_id]
        return pairs[0][0] if pairs else -1

    def seq_pos_max(self, seq_id: int) -> int:
        """Largest position of ``seq_id`` in the cells; -1 when it has none. O(1)."""
        pairs = self.seq_pos[seq_id]
        return pairs[-1][0] if pairs else -1

    def pos_get(self, i: int) -> int:
        """Position of the non-empty cell ``i``."""
        assert self.pos[i] != -1
        return int(self.pos[i])

    def get_shift(self, i: int) -> int:
        """Accumulated shift of the non-empty cell ``i``."""
        assert self.pos[i] != -1
        return int(self.shift[i])

    def pos_in(self, i: int, p0: int, p1: int) -> bool:
        """Whether cell ``i`` is non-empty with ``p0 <= pos < p1``."""
        return bool(p0 <= self.pos[i] < p1)

    def seq_cells(self, seq_id: int, p0: int, p1: int) -> np.ndarray:
        r"""The cells of ``seq_id`` (every non-empty cell when -1) with ``p0 <= pos < p1``.

        $\{ i : p_0 \le pos_i < p_1 \wedge seq_{i, s} \}$, ascending: the cells the cache's
        loop ``if cells.pos_in(i, p0, p1) and cells.seq_has(i, seq_id)`` visits.
        ``p0 >= 0`` (an empty cell's -1 is never in range).
        """
        assert p0 >= 0
        in_range = (self.pos >= p0) & (self.pos < p1)  # (n,)
        if seq_id != -1:
            in_range &= self.seq[:, seq_id]
        return np.flatnonzero(in_range)

    # ---- save / restore of some cells ------------------------------------------------

    def cp(self, idxs: ArrayLike) -> KVCells:
        """The cells ``idxs`` as a new [`KVCells`][] of ``len(idxs)`` cells (``cp``)."""
        idxs = _idx(idxs)
        assert not self.shift[idxs].any()
        res = KVCells(len(idxs))
        res._assign(np.arange(len(idxs)), self.pos[idxs], self.seq[idxs], self.shift[idxs])
        return res

    def set(self, idxs: ArrayLike, other: KVCells) -> None:
        """Overwrite the cells ``idxs`` with the cells of ``other`` (``set``)."""
        idxs = _idx(idxs)
        assert len(idxs) == other.size()
        self._assign(idxs, other.pos, other.seq, self.shift[idxs])

    # ---- updates, one cell (llama.cpp's methods) --------------------------------------

    def rm(self, i: int) -> None:
        """Empty the non-empty cell ``i`` (all its sequences)."""
        assert self.pos[i] != -1
        self.rm_cells([i])

    def seq_rm(self, i: int, seq_id: int) -> bool:
        """Remove ``seq_id`` from cell ``i`` (which has it); True if the cell became empty."""
        assert self.seq[i, seq_id] and self.pos[i] != -1
        return bool(self.seq_rm_cells([i], seq_id).size)

    def seq_keep(self, i: int, seq_id: int) -> bool:
        """Keep only ``seq_id`` in cell ``i``; True if the cell became empty (lacked it)."""
        return bool(self.seq_keep_cells([i], seq_id).size)

    def seq_add(self, i: int, seq_id: int) -> None:
        """Add ``seq_id`` to the non-empty cell ``i`` (which lacks it)."""
        assert self.pos[i] != -1 and not self.seq[i, seq_id]
        self.seq_add_cells([i], seq_id)

    def pos_set(self, i: int, p: int) -> None:
        """Give the empty cell ``i`` position ``p`` (no sequence yet; no shift recorded)."""
        assert self.pos[i] == -1 and not self.seq[i].any()
        self.pos_set_cells([i], [p])

    def pos_add(self, i: int, d: int) -> bool:
        """Move the non-empty cell ``i`` by ``d``; free it if it goes below 0 (then True).

        Records the shift ``d`` (the keys must turn by ``d``) and sets ``has_shift``.
        """
        assert self.pos[i] != -1
        return bool(self.pos_add_cells([i], d).size)

    def pos_div(self, i: int, d: int) -> None:
        """Divide the position of the non-empty cell ``i`` by ``d`` (integer division).

        Records the shift ``p_new - p_old`` ([`pos_div_shift`][]), as [`pos_add`][]
        does; llama.cpp records ``p_old - p_new`` here (a divergence, see the module).
        """
        assert self.pos[i] != -1
        self.pos_div_cells([i], d)

    def shift_set(self, i: int, shift: int) -> None:
        """Give the non-empty cell ``i`` a pending shift (a restored state's ``shift`` field)."""
        assert self.pos[i] != -1
        self.shift_set_cells([i], [shift])

    # ---- updates, many cells at once (the cache's range operations) -------------------

    def rm_cells(self, idxs: ArrayLike) -> None:
        """Empty the non-empty cells ``idxs`` (all their sequences)."""
        k = len(_idx(idxs))
        self._assign(idxs, np.full(k, -1), np.zeros((k, LLAMA_MAX_SEQ), bool), np.zeros(k))

    def seq_rm_cells(self, idxs: ArrayLike, seq_id: int) -> np.ndarray:
        """Remove ``seq_id`` from the cells ``idxs`` (which have it); the cells left empty."""
        idxs = _idx(idxs)
        seq = self.seq[idxs]  # (k, LLAMA_MAX_SEQ), a copy
        seq[:, seq_id] = False
        emptied = ~seq.any(axis=1)  # (k,)
        self._assign(idxs, np.where(emptied, -1, self.pos[idxs]), seq, self.shift[idxs])
        return idxs[emptied]

    def seq_keep_cells(self, idxs: ArrayLike, seq_id: int) -> np.ndarray:
        """Keep only ``seq_id`` in the cells ``idxs``; the non-empty ones that lacked it are
        emptied and returned."""
        idxs = _idx(idxs)
        has = self.seq[idxs, seq_id]  # (k,)
        seq = np.zeros((len(idxs), LLAMA_MAX_SEQ), bool)
        seq[has, seq_id] = True
        emptied = ~has & (self.pos[idxs] != -1)  # (k,)
        self._assign(idxs, np.where(has, self.pos[idxs], -1), seq, self.shift[idxs])
        return idxs[emptied]

    def seq_add_cells(self, idxs: ArrayLike, seq_id: int) -> None:
        """Add ``seq_id`` to the non-empty cells ``idxs`` (which lack it)."""
        idxs = _idx(idxs)
        seq = self.seq[idxs]  # (k, LLAMA_MAX_SEQ), a copy
        seq[:, seq_id] = True
        self._assign(idxs, self.pos[idxs], seq, self.shift[idxs])

    def fill_cells(self, idxs: ArrayLike, pos: ArrayLike, seq: np.ndarray) -> None:
        """Give the empty cells ``idxs`` the positions ``pos`` ``(k,)`` and the sequences
        ``seq`` ``(k, LLAMA_MAX_SEQ)`` (no shift): a ubatch's ``pos_set`` then ``seq_add`` of
        each token, as one write."""
        self._assign(idxs, pos, seq, np.zeros(len(_idx(idxs))))

    def pos_set_cells(self, idxs: ArrayLike, pos: ArrayLike) -> None:
        """Give the empty cells ``idxs`` the positions ``pos`` (no sequence, no shift)."""
        k = len(_idx(idxs))
        self._assign(idxs, pos, np.zeros((k, LLAMA_MAX_SEQ), bool), np.zeros(k))

    def pos_add_cells(self, idxs: ArrayLike, d: ArrayLike) -> np.ndarray:
        """Move the non-empty cells ``idxs`` by ``d`` (one number, or one per cell).

        Records the shift and sets ``has_shift`` (when some cell moves); the cells that go
        below 0 are freed and returned.
        """
        idxs = _idx(idxs)
        pos = self.pos[idxs] + d  # (k,)
        below = pos < 0  # (k,)
        seq = self.seq[idxs]  # (k, LLAMA_MAX_SEQ), a copy
        seq[below] = False
        if idxs.size:
            self.has_shift = True
        self._assign(idxs, np.where(below, -1, pos), seq, self.shift[idxs] + d)
        return idxs[below]

    def shift_set_cells(self, idxs: ArrayLike, shift: ArrayLike) -> None:
        """Give the non-empty cells ``idxs`` the pending shifts ``shift`` (a restored state)."""
        idxs = _idx(idxs)
        shift = np.asarray(shift, dtype=np.int64)  # (k,)
        if shift.any():
            self.has_shift = True
        self._assign(idxs, self.pos[idxs], self.seq[idxs], shift)

    def pos_div_cells(self, idxs: ArrayLike, d: int) -> None:
        """Divide the positions of the non-empty cells ``idxs`` by ``d``; record the shifts."""
        idxs = _idx(idxs)
        p_old = self.pos[idxs]  # (k,)
        if idxs.size:
            self.has_shift = True
        self._assign(idxs, p_old // d, self.seq[idxs], self.shift[idxs] + pos_div_shift(p_old, d))

    # ---- the undo journal -----------------------------------------------------------------

    def begin(self) -> None:
        """Start recording: [`rollback`][] will put back every cell changed from now on."""
        assert self._journal is None, "journals do not nest"
        self._journal = {}
        self._journal_has_shift = self.has_shift

    def rollback(self) -> None:
        """Put back the cells changed since [`begin`][] (and ``has_shift``); stop recording."""
        journal, self._journal = self._journal, None
        if journal:
            pos, seq, shift = zip(*journal.values(), strict=True)
            self._assign(list(journal), np.array(pos), np.array(seq), np.array(shift))
        self.has_shift = self._journal_has_shift

    def commit(self) -> None:
        """Keep the changes since [`begin`][]; stop recording."""
        self._journal = None

    # ---- the one door: write rows, keep seq_pos and the counts -----------------------------

    def _assign(self, idxs: ArrayLike, pos: ArrayLike, seq: ArrayLike, shift: ArrayLike) -> None:
        """Write new rows into the distinct cells ``idxs``: ``pos`` ``(k,)``, ``seq``
        ``(k, LLAMA_MAX_SEQ)``, ``shift`` ``(k,)``; an emptied cell's shift becomes 0."""
        idxs = _idx(idxs)
        if idxs.size == 0:
            return
        pos = np.asarray(pos, np.int64)
        if pos.shape != idxs.shape:  # one position for every cell
            pos = np.broadcast_to(pos, idxs.shape)  # (k,)
        shift = np.where(pos == -1, 0, shift).astype(np.int64, copy=False)  # (k,), broadcast
        old_pos, old_seq, old_shift = self.pos[idxs], self.seq[idxs], self.shift[idxs]  # copies
        if self._journal is not None:
            for j, i in enumerate(idxs.tolist()):
                self._journal.setdefault(i, (old_pos[j], old_seq[j], old_shift[j]))
        self.pos[idxs], self.seq[idxs], self.shift[idxs] = pos, seq, shift
        self.n_used += int(np.count_nonzero(pos != -1)) - int(np.count_nonzero(old_pos != -1))
        self.n_shifted += int(np.count_nonzero(shift)) - int(np.count_nonzero(old_shift))
        self._track_used_max_p1(idxs[pos != -1])
        seq = self.seq[idxs]  # (k, LLAMA_MAX_SEQ), as written
        for s in np.flatnonzero(old_seq.any(axis=0) | seq.any(axis=0)).tolist():
            # the pairs of s that change: those of the cells that left s or moved, and back
            stay = old_seq[:, s] & seq[:, s] & (old_pos == pos)  # (k,)
            out, into = old_seq[:, s] & ~stay, seq[:, s] & ~stay  # (k,)
            if out.any() or into.any():
                self._seq_pos_update(s, _pairs(old_pos[out], idxs[out]),
                                     _pairs(pos[into], idxs[into]))

    def _track_used_max_p1(self, filled: np.ndarray) -> None:
        """Keep ``used_max_p1`` after a write: past the new cells, or back to the last used one."""
        if filled.size:
            self._used_max_p1 = max(self._used_max_p1, int(filled.max()) + 1)
        if self._used_max_p1 and self.pos[self._used_max_p1 - 1] == -1:
            used = np.flatnonzero(self.pos[: self._used_max_p1] != -1)  # the last cell was freed
            self._used_max_p1 = int(used[-1]) + 1 if used.size else 0

    def _seq_pos_update(self, s: int, out: list[tuple[int, int]],
                        into: list[tuple[int, int]]) -> None:
        """Take the pairs ``out`` from ``seq_pos[s]`` and put the pairs ``into`` in."""
        pairs = self.seq_pos[s]
        if len(out) + len(into) > SEQ_POS_REBUILD:  # a range operation: one sort
            idxs = np.flatnonzero(self.seq[:, s])
            order = np.lexsort((idxs, self.pos[idxs]))  # by position, then cell index
            pairs[:] = zip(self.pos[idxs][order].tolist(), idxs[order].tolist(), strict=True)
            return
        for pair in out:
            k = bisect_left(pairs, pair)
            assert pairs[k] == pair
            del pairs[k]
        for pair in into:
            insort(pairs, pair)
# --8<-- [end:KVCells]
