r"""KV cells: the bookkeeping of a KV cache, ``llama_kv_cells`` (``src/llama-kv-cells.h``).

A KV cache of size $n$ is an array of $n$ *cells*. The key/value tensors hold one row per
cell; this class holds what each row *means*:

- ``pos[i]``: the position of the token stored in cell $i$, or $-1$ when the cell is empty;
- ``seq[i]``: the set of sequences that share the cell (a prompt decoded once and copied
  to several sequences with ``seq_cp`` is stored once, in cells whose set has several ids);
- ``shift[i]``: the position change accumulated since the keys were last re-roped
  (the K-shift, applied lazily by the cache's ``update``);
- ``seq_pos[s]``: the $(pos, i)$ pairs of the cells of sequence $s$, so that the smallest
  and largest position of a sequence are read without scanning the cells;
- ``used``: the indices of the non-empty cells, for ``used_max_p1`` (the ``n_kv`` rule).

Invariants (checked by the tests after every operation):

$$
pos_i = -1 \iff seq_i = \emptyset, \qquad
\mathrm{seq\_pos}[s] = \{(pos_i, i) : s \in seq_i\}, \qquad
\mathrm{used} = \{ i : pos_i \ne -1 \}.
$$

Every method has the name of its C++ twin and the same contract. One method differs on
purpose: :meth:`KVCells.pos_div` records the shift with the sign :meth:`KVCells.pos_add`
uses (new minus old); llama.cpp records old minus new there, which rotates the keys the
wrong way after ``seq_div`` (see :func:`pos_div_shift_llamacpp` and the K-shift chapter).
"""

from __future__ import annotations


# --8<-- [start:pos_div_shift]
def pos_div_shift(p_old: int, d: int) -> int:
    """The K-shift recorded when ``pos_div`` moves a cell from ``p_old`` to ``p_old // d``.

    The keys of the cell were roped at ``p_old``; to read as if roped at ``p_new`` they must
    turn by ``p_new - p_old`` (RoPE additivity), the sign ``pos_add`` records.

    Examples:
        >>> pos_div_shift(7, 2)
        -4
    """
    return p_old // d - p_old
# --8<-- [end:pos_div_shift]


# --8<-- [start:pos_div_shift_llamacpp]
def pos_div_shift_llamacpp(p_old: int, d: int) -> int:
    """The shift llama.cpp's ``llama_kv_cells::pos_div`` records: ``p_old - p_new``.

    The opposite of :func:`pos_div_shift`: at the pinned commit the keys of a divided cell
    are turned *forward* by ``p_old - p_new`` instead of back, so they end up roped at
    ``2 p_old - p_new`` rather than ``p_new``. Kept only to pin the divergence in tests.

    Examples:
        >>> pos_div_shift_llamacpp(7, 2)
        4
    """
    return p_old - p_old // d
# --8<-- [end:pos_div_shift_llamacpp]


# --8<-- [start:KVCells]
class KVCells:
    """The metadata of ``size`` KV cells (``llama_kv_cells``).

    Args:
        size: number of cells (``resize``); all start empty.

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
        self.pos: list[int] = [-1] * n
        self.shift: list[int] = [0] * n
        self.seq: list[set[int]] = [set() for _ in range(n)]
        self.reset()

    def reset(self) -> None:
        """Empty every cell, drop every shift (``reset``)."""
        n = len(self.pos)
        self.pos[:] = [-1] * n
        self.shift[:] = [0] * n
        for s in self.seq:
            s.clear()
        self.has_shift = False
        self.used: set[int] = set()
        self.seq_pos: dict[int, set[tuple[int, int]]] = {}

    def reset_shift(self) -> None:
        """Forget the accumulated shifts, once the keys are re-roped (``reset_shift``)."""
        self.has_shift = False
        self.shift[:] = [0] * len(self.shift)

    def size(self) -> int:
        """Number of cells."""
        return len(self.pos)

    def copy(self) -> KVCells:
        """A deep copy (the backup a failed slot search restores).

        Field by field rather than ``copy.deepcopy``: the backup is taken on every decode,
        and a generic deep copy of 4096 cells costs ~0.3 s where this costs a few ms.
        """
        new = KVCells.__new__(KVCells)
        new.pos = list(self.pos)
        new.shift = list(self.shift)
        new.seq = [set(s) for s in self.seq]
        new.has_shift = self.has_shift
        new.used = set(self.used)
        new.seq_pos = {s: set(ps) for s, ps in self.seq_pos.items()}
        return new

    # ---- queries ---------------------------------------------------------------------

    def is_empty(self, i: int) -> bool:
        """Whether cell ``i`` holds no token."""
        return self.pos[i] == -1

    def get_used(self) -> int:
        """Number of non-empty cells."""
        return len(self.used)

    def used_min(self) -> int:
        """Index of the first non-empty cell; 0 when all are empty."""
        return min(self.used) if self.used else 0

    def used_max_p1(self) -> int:
        """Index of the last non-empty cell plus one; 0 when all are empty."""
        return max(self.used) + 1 if self.used else 0

    def get_has_shift(self) -> bool:
        """Whether some position changed since the last ``reset_shift``."""
        return self.has_shift

    def seq_count(self, i: int) -> int:
        """Number of sequences sharing the non-empty cell ``i``."""
        return len(self.seq[i])

    def seq_get_all(self, i: int) -> frozenset[int]:
        """The sequences cell ``i`` is visible to."""
        return frozenset(self.seq[i])

    def seq_has(self, i: int, seq_id: int) -> bool:
        """Whether cell ``i`` belongs to ``seq_id``."""
        return seq_id in self.seq[i]

    def seq_get(self, i: int) -> int:
        """The only sequence of cell ``i`` (call only when ``seq_count(i) == 1``)."""
        assert len(self.seq[i]) == 1
        return next(iter(self.seq[i]))

    def seq_pos_min(self, seq_id: int) -> int:
        """Smallest position of ``seq_id`` in the cells; -1 when it has none."""
        pairs = self.seq_pos.get(seq_id)
        return min(pairs)[0] if pairs else -1

    def seq_pos_max(self, seq_id: int) -> int:
        """Largest position of ``seq_id`` in the cells; -1 when it has none."""
        pairs = self.seq_pos.get(seq_id)
        return max(pairs)[0] if pairs else -1

    def pos_get(self, i: int) -> int:
        """Position of the non-empty cell ``i``."""
        assert self.pos[i] != -1
        return self.pos[i]

    def get_shift(self, i: int) -> int:
        """Accumulated shift of the non-empty cell ``i``."""
        assert self.pos[i] != -1
        return self.shift[i]

    def pos_in(self, i: int, p0: int, p1: int) -> bool:
        """Whether cell ``i`` is non-empty with ``p0 <= pos < p1``."""
        return p0 <= self.pos[i] < p1

    # ---- save / restore of some cells (the slot search's backup, the state) ----------

    def cp(self, idxs: list[int]) -> KVCells:
        """The cells ``idxs`` as a new :class:`KVCells` of ``len(idxs)`` cells (``cp``)."""
        res = KVCells(len(idxs))
        for j, i in enumerate(idxs):
            assert self.shift[i] == 0
            res.pos[j] = self.pos[i]
            res.seq[j] = set(self.seq[i])
        return res

    def set(self, idxs: list[int], other: KVCells) -> None:
        """Overwrite the cells ``idxs`` with the cells of ``other`` (``set``)."""
        assert len(idxs) == other.size()
        for j, i in enumerate(idxs):
            if self.pos[i] != -1:
                self._seq_pos_rm(i)
            self.pos[i] = other.pos[j]
            self.seq[i] = set(other.seq[j])
            if self.pos[i] != -1:
                self.used.add(i)
                self._seq_pos_add(i)
            else:
                self.used.discard(i)

    # ---- updates ---------------------------------------------------------------------

    def rm(self, i: int) -> None:
        """Empty the non-empty cell ``i`` (all its sequences)."""
        assert self.pos[i] != -1
        self._seq_pos_rm(i)
        self.seq[i].clear()
        self.pos[i] = -1
        self.shift[i] = 0
        self.used.discard(i)

    def seq_rm(self, i: int, seq_id: int) -> bool:
        """Remove ``seq_id`` from cell ``i`` (which has it); True if the cell became empty."""
        assert seq_id in self.seq[i] and self.pos[i] != -1
        self.seq[i].discard(seq_id)
        self._seq_pos_dec(seq_id, i)
        if not self.seq[i]:
            self.pos[i] = -1
            self.shift[i] = 0
            self.used.discard(i)
            return True
        return False

    def seq_keep(self, i: int, seq_id: int) -> bool:
        """Keep only ``seq_id`` in cell ``i``; True if the cell became empty (lacked it)."""
        if seq_id in self.seq[i]:
            self._seq_pos_rm(i)
            self.seq[i] = {seq_id}
            self._seq_pos_inc(seq_id, i)
            return False
        if self.seq[i]:
            self._seq_pos_rm(i)
            self.seq[i].clear()
            self.pos[i] = -1
            self.shift[i] = 0
            self.used.discard(i)
            return True
        return False

    def seq_add(self, i: int, seq_id: int) -> None:
        """Add ``seq_id`` to the non-empty cell ``i`` (which lacks it)."""
        assert self.pos[i] != -1 and seq_id not in self.seq[i]
        self.seq[i].add(seq_id)
        self._seq_pos_inc(seq_id, i)

    def pos_set(self, i: int, p: int) -> None:
        """Give the empty cell ``i`` position ``p`` (no sequence yet; no shift recorded)."""
        assert self.pos[i] == -1 and not self.seq[i]
        self.pos[i] = p
        self.used.add(i)

    def pos_add(self, i: int, d: int) -> bool:
        """Move the non-empty cell ``i`` by ``d``; free it if it goes below 0 (then True).

        Records the shift ``d`` (the keys must turn by ``d``) and sets ``has_shift``.
        """
        assert self.pos[i] != -1
        self._seq_pos_rm(i)
        self.pos[i] += d
        self.shift[i] += d
        self.has_shift = True
        if self.pos[i] < 0:
            self.seq[i].clear()
            self.pos[i] = -1
            self.shift[i] = 0
            self.used.discard(i)
            return True
        self._seq_pos_add(i)
        return False

    def pos_div(self, i: int, d: int) -> None:
        """Divide the position of the non-empty cell ``i`` by ``d`` (integer division).

        Records the shift ``p_new - p_old`` (:func:`pos_div_shift`), as :meth:`pos_add`
        does; llama.cpp records ``p_old - p_new`` here (a divergence, see the module).
        """
        assert self.pos[i] != -1
        p_old = self.pos[i]
        self._seq_pos_rm(i)
        self.pos[i] = p_old // d
        self.shift[i] += pos_div_shift(p_old, d)
        self._seq_pos_add(i)
        self.has_shift = True

    # ---- seq_pos maintenance (one cell at a time) --------------------------------------

    def _seq_pos_dec(self, s: int, i: int) -> None:
        self.seq_pos[s].remove((self.pos[i], i))
        if not self.seq_pos[s]:
            del self.seq_pos[s]

    def _seq_pos_inc(self, s: int, i: int) -> None:
        self.seq_pos.setdefault(s, set()).add((self.pos[i], i))

    def _seq_pos_rm(self, i: int) -> None:
        for s in self.seq[i]:
            self._seq_pos_dec(s, i)

    def _seq_pos_add(self, i: int) -> None:
        for s in self.seq[i]:
            self._seq_pos_inc(s, i)
# --8<-- [end:KVCells]
