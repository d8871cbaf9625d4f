r"""The recurrent memory: ``llama_memory_recurrent`` (``src/llama-memory-recurrent.cpp``).

A Mamba layer does not attend to its past: it carries it forward in two fixed-size states
per sequence, the convolution state (the last ``d_conv - 1`` inputs of the causal conv) and
the SSM state $h$ of the selective scan. After $t$ tokens a sequence *is* its state:

$$
h_t = f(h_{t-1}, x_t), \qquad h_{-1} = 0 .
$$

So where a KV cache keeps one cell per *token*, the recurrent memory keeps one cell per
*sequence*: a cell is the pair of state rows ``r_l[il][i]`` (``n_embd_r`` values, the conv
state) and ``s_l[il][i]`` (``n_embd_s`` values, the SSM state) of every layer, plus the
position of the last token the state has absorbed and the set of sequences that share it.
There are ``mem_size`` cells (llama.cpp: ``max(1, n_seq_max)``).

Two indices live side by side in ``cells``, as in llama.cpp: ``cells[i]`` is a *cell* (its
``pos``, ``seq_id`` set, ``src``), and ``cells[seq_id].tail`` is the cell that holds
sequence ``seq_id``'s state (-1: the sequence is empty). The two meanings share the array
only because there are as many cells as sequences.

What the memory operations mean for a state (see the chapter for the side-by-side table
with the KV cache):

- ``seq_rm``: a state cannot forget its last tokens. Removing a range that holds the
  sequence's last position but not its first (``0 < p0 <= pos < p1``) returns False and
  changes nothing; removing from 0 empties the sequence; a range that misses the last
  position touches nothing (there are no cells for earlier positions) and returns True.
- ``seq_cp``: the destination *shares* the source's cell (its ``tail`` points to it); the
  range is ignored, the whole state is shared. The first ubatch that writes to a shared cell
  copies it to a free cell first ([`RecurrentMemory.find_slot`][]): copy on write.
- ``seq_add`` / ``seq_div``: only the position of the tail cell changes. There is no K-shift
  (a state is not rotated by position), so ``can_shift`` is True and costs nothing.

Decoding a batch goes through the steps of the memory interface
([`reference.memory.interface`][reference.memory.interface]), the KV cache's steps with a range of
cells in place of a slot:

1. [`RecurrentMemory.init_batch`][] cuts the batch with ``split_equal(sequential=True)``
   (``n_seqs`` sequence sets of ``n_seq_tokens`` tokens, token ``t`` of set ``s`` at index
   ``s * n_seq_tokens + t``), and [`RecurrentMemory.prepare`][] runs
   [`RecurrentMemory.find_slot`][] on every ubatch, then restores the cells: all or
   nothing; each ubatch's placement is the ``range`` of cells its graph touches;
2. [`RecurrentMemory.apply_ubatch`][] runs ``find_slot`` for real: the ubatch's sequences
   get the contiguous cells ``head .. head + n_seqs - 1``, set ``s`` in cell ``head + s``,
   then moves the state rows as the graph's ``build_rs`` does (``s_copy``: each cell of
   ``head .. head + n`` takes the row of its ``src0``; a cell with no source takes the
   zeroed row ``rs_z``); [`RecurrentMemory.remove_ubatch`][] puts the cells and rows back
   as they were before it;
3. [`RecurrentMemory.graph_input`][] ([`RecurrentMemory.rs_input`][]) gives the model
   its [`RecurrentMemoryInput`][]: ``get_r``/``get_s`` read the ``n_seqs`` rows,
   ``cpy_r``/``cpy_s`` write the final states;
4. there is no update: [`RecurrentMemory.init_update`][] answers ``NO_UPDATE``.

The row moves are small array methods the MLX twin overrides
([`RecurrentMemory.move_rows`][], [`RecurrentMemory.save_rows`][],
[`RecurrentMemory.load_rows`][], [`RecurrentMemory.on_host`][]); the bookkeeping around
them is written once, here.

Where this differs from llama.cpp at the pinned commit (each with a test):

- ``seq_rm(-1, ...)``: llama.cpp checks ``(uint32_t) seq_id >= n_seq_max`` first, so a
  negative ``seq_id`` always returns False and its "every sequence" branch is dead code.
  Here ``-1`` means every sequence, as in the KV cache: the whole range empties the memory,
  an empty range is a no-op, anything else returns False.
- ``seq_add`` that moves the tail's position below 0: llama.cpp keeps the cell with a
  negative position, so ``seq_pos_max`` says -1 (empty) while the state survives, is not
  removed by ``seq_rm(seq, -1, -1)`` (``pos < p0 = 0``) and is continued by the next token
  at position 0. Here the cell is freed, as the KV cache frees a cell whose position goes
  below 0.
- the rows are moved when the ubatch is applied, not inside the next graph (llama.cpp's
  ``build_rs`` does it at the start of every layer of the graph that follows); the rows the
  model reads are the same.
- invalid calls (a sequence id out of ``[0, n_seq_max)``, ``d < 1``) raise
  [`RecurrentMemoryError`][] before anything changes; llama.cpp logs and returns False,
  ignores the call, or divides by zero.
- rollback snapshots (``n_rs_seq > 0``) are not modelled: llama.cpp enables them only for
  some hybrid architectures, never for Mamba (``llm_arch_supports_rs_rollback``).

State save/restore uses the header, checksum and refusal rules of
[`reference.memory.state`][reference.memory.state] with its own magic ``b"LRRS"``: see
[`state_write`][].
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

import numpy as np
from numpy.typing import ArrayLike, DTypeLike

from reference.batch import BatchAllocr, Ubatch
from reference.common import DTYPE_OF_GGML_TYPE, LLAMA_MAX_SEQ, POS_INF, LlamarefError
from reference.memory.blob import (
    BlobWriter,
    StateError,
    check_tokens,
    ggml_type_name,
    ggml_type_of,
    seal,
    unseal,
    write_atomic,
)
from reference.memory.interface import MemoryContext, MemoryStatus, batch_context
from reference.memory.state import (
    FILE_MAGIC,
    FILE_VERSION,
    LLAMA_STATE_SEQ_FLAGS_NONE,
    check_state_flags,
    hparams_fingerprint,
    read_layer_rows,
    write_layer_rows,
)

# --8<-- [start:constants]
RS_STATE_MAGIC = b"LRRS"  # a recurrent memory blob
RS_STATE_VERSION = 1
# --8<-- [end:constants]


# --8<-- [start:RecurrentMemoryError]
class RecurrentMemoryError(LlamarefError, ValueError):
    """An invalid call to the recurrent memory (a sequence id out of range, ``d < 1``, ...).

    Raised before anything changes.
    """
# --8<-- [end:RecurrentMemoryError]


# --8<-- [start:RecurrentHParams]
class RecurrentHParams(Protocol):
    """What the memory needs from the hyperparameters (``llama_hparams``).

    ``n_embd_r()``: values in one conv-state row; ``n_embd_s()``: values in one SSM-state
    row. ``arch`` and the dataclass fields identify the model in a saved state.
    """

    arch: str
    n_layer: int

    def n_embd_r(self) -> int: ...

    def n_embd_s(self) -> int: ...
# --8<-- [end:RecurrentHParams]


# --8<-- [start:MemCell]
@dataclass
class MemCell:
    """``llama_memory_recurrent::mem_cell``.

    Attributes:
        pos: position of the last token the cell's state has absorbed; -1 when empty.
        src: the row that holds this cell's state (itself after a ubatch; another row after
            the cell was moved or copied on write; -1 when it has no state: zeros).
        src0: ``src`` as it was when the last ubatch was placed: the row the graph copies
            from (``s_copy``).
        tail: used as *sequence* metadata: the cell of sequence ``i`` (-1: none).
        seq_id: the sequences that share this cell's state.
    """

    pos: int = -1
    src: int = -1
    src0: int = -1
    tail: int = -1
    seq_id: set[int] = field(default_factory=set)

    def has_seq_id(self, seq_id: int) -> bool:
        """Whether the cell holds ``seq_id``."""
        return seq_id in self.seq_id

    def is_empty(self) -> bool:
        """Whether no sequence holds the cell."""
        return not self.seq_id
# --8<-- [end:MemCell]


# --8<-- [start:RecurrentMemoryInput]
class RecurrentMemoryInput:
    """The recurrent-state input of one ubatch (``llm_graph_input_rs`` + the memory context).

    Implements the ``RecurrentInput`` protocol the Mamba models use. Built by
    [`RecurrentMemory.rs_input`][] after [`RecurrentMemory.apply_ubatch`][]: sequence set
    ``s`` of the ubatch (tokens ``s * n_seq_tokens ..``) owns cell ``head + s``, whose rows
    already hold its state (zeros for a sequence that starts fresh).

    Attributes:
        head: first cell of the ubatch.
        n_seqs: sequence sets of the ubatch.
        n_rs: cells ``head .. head + n_rs`` the ubatch's graph touches (``get_n_rs``).
        rs_z: the cell zeroed to give new sequences their zero state, -1 if none
            (``get_rs_z``).
        s_copy: the source row of each of those cells (``s_copy(i)``) ``(n_rs,)``.
    """

    def __init__(self, memory: RecurrentMemory, ubatch: Ubatch):
        if ubatch.n_seqs < 1 or memory.n < ubatch.n_seqs:
            raise RecurrentMemoryError(
                f"ubatch of {ubatch.n_seqs} sequence sets does not match the {memory.n} cells "
                "of the last apply_ubatch")
        self.memory = memory
        self.head = memory.head
        self.n_seqs = ubatch.n_seqs
        self.n_rs = memory.n
        self.rs_z = memory.rs_z
        self.s_copy = np.array([memory.cells[memory.head + i].src0 for i in range(memory.n)],
                               dtype=np.int32)  # (n_rs,)

    def get_r(self, il: int) -> np.ndarray:
        """Conv states of layer ``il``, one row per sequence set ``(n_seqs, n_embd_r)``."""
        return self.memory.r_l[il][self.head: self.head + self.n_seqs].copy()

    def get_s(self, il: int) -> np.ndarray:
        """SSM states of layer ``il``, one row per sequence set ``(n_seqs, n_embd_s)``."""
        return self.memory.s_l[il][self.head: self.head + self.n_seqs].copy()

    def cpy_r(self, il: int, r: np.ndarray) -> None:
        """Store the final conv states ``(n_seqs, n_embd_r)`` of layer ``il``."""
        self.memory.r_l[il][self.head: self.head + self.n_seqs] = r.reshape(self.n_seqs, -1)

    def cpy_s(self, il: int, s: np.ndarray) -> None:
        """Store the final SSM states ``(n_seqs, n_embd_s)`` of layer ``il``."""
        self.memory.s_l[il][self.head: self.head + self.n_seqs] = s.reshape(self.n_seqs, -1)
# --8<-- [end:RecurrentMemoryInput]


# --8<-- [start:RecurrentMemory]
class RecurrentMemory:
    """The recurrent memory (``llama_memory_recurrent``): one cell of state rows per sequence.

    Args:
        hparams: the model's hyperparameters (``n_layer``, ``n_embd_r()``, ``n_embd_s()``).
        mem_size: number of cells (llama.cpp: ``max(1, n_seq_max)``).
        n_seq_max: the number of sequences.
        dtype: dtype of the state rows (llama.cpp: float32).

    Raises:
        RecurrentMemoryError: ``mem_size < 1``, ``n_seq_max`` out of ``[1, LLAMA_MAX_SEQ]``.

    Examples:
        >>> from types import SimpleNamespace
        >>> hp = SimpleNamespace(arch="mamba", n_layer=2, n_embd_r=lambda: 6, n_embd_s=lambda: 8)
        >>> mem = RecurrentMemory(hp, mem_size=2, n_seq_max=2)
        >>> mem.r_l[0].shape, mem.s_l[1].shape, mem.seq_pos_max(0), mem.can_shift()
        ((2, 6), (2, 8), -1, True)
    """

    def __init__(self, hparams: RecurrentHParams, mem_size: int, n_seq_max: int = 1,
                 dtype: DTypeLike = np.float32):
        if mem_size < 1:
            raise RecurrentMemoryError(f"mem_size={mem_size} must be >= 1")
        if not 1 <= n_seq_max <= LLAMA_MAX_SEQ:
            raise RecurrentMemoryError(f"n_seq_max={n_seq_max} must be in [1, {LLAMA_MAX_SEQ}]")
        self.hparams = hparams
        self.n_seq_max = n_seq_max
        self.size = mem_size  # total number of cells, shared across all sequences
        self.head = 0  # the first cell of the last placed ubatch
        self.used = 0  # cells holding at least one sequence
        self.n = 0  # cells head .. head + n touched by the last placed ubatch
        self.rs_z = -1  # the cell zeroed for new sequences, -1 if none
        self._undo: tuple | None = None  # what remove_ubatch needs to undo the last ubatch
        self.dtype = np.dtype(dtype)
        self.cells = [MemCell() for _ in range(mem_size)]
        self.r_l = [np.zeros((mem_size, hparams.n_embd_r()), self.dtype)
                    for _ in range(hparams.n_layer)]  # (mem_size, n_embd_r) per layer
        self.s_l = [np.zeros((mem_size, hparams.n_embd_s()), self.dtype)
                    for _ in range(hparams.n_layer)]  # (mem_size, n_embd_s) per layer

    # ---- sizes and checks -------------------------------------------------------------------

    def get_size(self) -> int:
        """Number of cells."""
        return self.size

    def can_shift(self) -> bool:
        """``get_can_shift``: True, shifting a position is trivial (there is no K-shift)."""
        return True

    def _check_seq_id(self, seq_id: int, allow_all: bool = False) -> None:
        if allow_all and seq_id == -1:
            return
        if not 0 <= seq_id < self.n_seq_max:
            raise RecurrentMemoryError(
                f"seq_id={seq_id} out of range [0, {self.n_seq_max})"
                + (" (or -1 for all sequences)" if allow_all else ""))

    def _free_cell(self, cell: MemCell) -> None:
        """Forget a cell that has just lost its last sequence."""
        cell.pos = -1
        cell.src = -1
        self.used -= 1

    def _lower_head(self, new_head: int) -> None:
        # a freed cell before the head: the next search starts there
        if new_head != self.size and new_head < self.head:
            self.head = new_head

    # ---- the memory API ---------------------------------------------------------------------

    # --8<-- [start:clear]
    def clear(self, data: bool = True) -> None:
        """Empty every cell; with ``data`` also zero the state rows (``llama_memory_clear``).

        As llama.cpp, ``src0`` is left as it is: only the next ``find_slot`` reads it, after
        setting it.
        """
        for cell in self.cells:
            cell.pos = -1
            cell.seq_id.clear()
            cell.src = -1
            cell.tail = -1
        self.head = 0
        self.used = 0
        self._undo = None
        if data:
            for t in self.r_l + self.s_l:
                t.fill(0)
    # --8<-- [end:clear]

    # --8<-- [start:seq_rm]
    def seq_rm(self, seq_id: int, p0: int, p1: int) -> bool:
        """Remove the positions ``[p0, p1)`` of ``seq_id``, if a state can (``seq_rm``).

        ``p0 < 0`` means 0, ``p1 < 0`` means infinity. With the sequence's state at position
        ``pos`` (its tail cell):

        - ``0 < p0 <= pos < p1``: the last tokens but not all: **False, nothing changes** (a
          state cannot forget its last tokens);
        - ``p0 <= pos < p1`` (so ``p0 == 0``): the sequence leaves its cell (freed when no
          other sequence shares it);
        - otherwise (``pos < p0`` or ``p1 <= pos``): no cell is in the range: True, no change.

        ``seq_id == -1`` (every sequence): the whole range empties the memory, an empty
        range (``p0 == p1``) does nothing, any other range returns False (llama.cpp returns
        False for every negative ``seq_id``: a divergence). A sequence id that has no cell
        (``>= mem_size``) returns False, as llama.cpp.

        Raises:
            RecurrentMemoryError: ``seq_id`` out of ``[0, n_seq_max)`` and not -1.

        Examples:
            >>> from types import SimpleNamespace
            >>> hp = SimpleNamespace(arch="t", n_layer=1, n_embd_r=lambda: 1, n_embd_s=lambda: 1)
            >>> mem = RecurrentMemory(hp, mem_size=1)
            >>> mem.cells[0] = MemCell(pos=9, src=0, seq_id={0}); mem.cells[0].tail = 0
            >>> mem.used = 1
            >>> mem.seq_rm(0, 5, -1), mem.seq_pos_max(0)
            (False, 9)
            >>> mem.seq_rm(0, 0, 5), mem.seq_pos_max(0)
            (True, 9)
            >>> mem.seq_rm(0, -1, -1), mem.seq_pos_max(0)
            (True, -1)
        """
        self._check_seq_id(seq_id, allow_all=True)
        p0 = max(p0, 0)
        p1 = POS_INF if p1 < 0 else p1
        if seq_id >= self.size:
            return False  # llama.cpp: "could be fatal"
        if seq_id >= 0:
            tail_id = self.cells[seq_id].tail
            if tail_id >= 0:
                cell = self.cells[tail_id]
                # a partial removal at the end: the state holds the tokens it would forget
                if 0 < p0 <= cell.pos < p1:
                    return False
                # the tail is about to be cleared: the sequence has no state any more
                if p0 <= cell.pos < p1:
                    self.cells[seq_id].tail = -1
        elif p0 != p1 and (p0 != 0 or p1 != POS_INF):
            return False  # every sequence: all of it or nothing
        new_head = self.size
        for i, cell in enumerate(self.cells):
            if not p0 <= cell.pos < p1:
                continue
            if seq_id < 0:
                cell.seq_id.clear()
            elif cell.has_seq_id(seq_id):
                cell.seq_id.discard(seq_id)
            else:
                continue
            if cell.is_empty():
                self._free_cell(cell)
                new_head = min(new_head, i)
        if seq_id < 0 and p0 != p1:
            for cell in self.cells:
                cell.tail = -1
        self._lower_head(new_head)
        return True
    # --8<-- [end:seq_rm]

    # --8<-- [start:seq_cp]
    def seq_cp(self, seq_id_src: int, seq_id_dst: int, p0: int = -1, p1: int = -1) -> None:
        """Make ``seq_id_dst`` share the state of ``seq_id_src`` (``seq_cp``).

        The destination leaves its own cell (freed if nobody else holds it) and joins the
        source's tail cell; nothing is copied until a ubatch writes to the shared cell
        (copy on write, [`find_slot`][]). The range ``[p0, p1)`` is ignored: a state is
        all of a sequence's past. An empty source leaves the destination empty.

        Raises:
            RecurrentMemoryError: a sequence id out of ``[0, n_seq_max)``.

        Examples:
            >>> from types import SimpleNamespace
            >>> hp = SimpleNamespace(arch="t", n_layer=1, n_embd_r=lambda: 1, n_embd_s=lambda: 1)
            >>> mem = RecurrentMemory(hp, mem_size=2, n_seq_max=2)
            >>> mem.cells[0] = MemCell(pos=4, src=0, seq_id={0}); mem.cells[0].tail = 0
            >>> mem.used = 1
            >>> mem.seq_cp(0, 1, 2, 3)
            >>> mem.cells[1].tail, sorted(mem.cells[0].seq_id), mem.seq_pos_max(1)
            (0, [0, 1], 4)
        """
        self._check_seq_id(seq_id_src)
        self._check_seq_id(seq_id_dst)
        if seq_id_src == seq_id_dst:
            return
        if seq_id_src >= self.size or seq_id_dst >= self.size:
            return  # llama.cpp ignores ids that have no cell
        tail_src, tail_dst = self.cells[seq_id_src], self.cells[seq_id_dst]
        if tail_dst.tail >= 0:
            # the destination forgets its own state first
            cell_dst = self.cells[tail_dst.tail]
            cell_dst.seq_id.discard(seq_id_dst)
            tail_dst.tail = -1
            if cell_dst.is_empty():
                self._free_cell(cell_dst)
        if tail_src.tail >= 0:
            self.cells[tail_src.tail].seq_id.add(seq_id_dst)
            tail_dst.tail = tail_src.tail
    # --8<-- [end:seq_cp]

    # --8<-- [start:seq_keep]
    def seq_keep(self, seq_id: int) -> None:
        """Forget every sequence but ``seq_id`` (``seq_keep``).

        Every cell that does not hold ``seq_id`` is emptied; the cell that holds it keeps
        only it; every other sequence loses its tail.

        Raises:
            RecurrentMemoryError: ``seq_id`` out of ``[0, n_seq_max)``.
        """
        self._check_seq_id(seq_id)
        new_head = self.size
        for i, cell in enumerate(self.cells):
            if i != seq_id:
                cell.tail = -1
            if not cell.has_seq_id(seq_id):
                if cell.pos >= 0:
                    self.used -= 1
                cell.pos = -1
                cell.src = -1
                cell.seq_id.clear()
                new_head = min(new_head, i)
            else:
                cell.seq_id = {seq_id}
        self._lower_head(new_head)
    # --8<-- [end:seq_keep]

    # --8<-- [start:seq_add]
    def seq_add(self, seq_id: int, p0: int, p1: int, shift: int) -> None:
        """Add ``shift`` to the position of ``seq_id``'s state if it is in ``[p0, p1)``.

        Only the tail cell's position changes (there is no K-shift: a state does not depend
        on positions). Every sequence that shares the cell moves with it. No-op when
        ``shift == 0`` or the range is empty. A position that goes below 0 frees the cell
        (for every sequence that shares it), as in the KV cache; llama.cpp keeps the cell
        with a negative position (a divergence).

        Raises:
            RecurrentMemoryError: ``seq_id`` out of ``[0, n_seq_max)``.

        Examples:
            >>> from types import SimpleNamespace
            >>> hp = SimpleNamespace(arch="t", n_layer=1, n_embd_r=lambda: 1, n_embd_s=lambda: 1)
            >>> mem = RecurrentMemory(hp, mem_size=2, n_seq_max=2)
            >>> mem.cells[0] = MemCell(pos=4, src=0, seq_id={0, 1}); mem.cells[0].tail = 0
            >>> mem.cells[1].tail = 0; mem.used = 1
            >>> mem.seq_add(0, 0, -1, 3); mem.seq_pos_max(1)  # the shared cell moves for both
            7
            >>> mem.seq_add(1, 0, -1, -8); mem.seq_pos_max(0), mem.used  # below 0: freed
            (-1, 0)
        """
        self._check_seq_id(seq_id)
        if shift == 0:
            return
        p0 = max(p0, 0)
        p1 = POS_INF if p1 < 0 else p1
        if p0 == p1 or seq_id >= self.size:
            return
        tail_id = self.cells[seq_id].tail
        if tail_id < 0:
            return
        cell = self.cells[tail_id]
        if cell.has_seq_id(seq_id) and p0 <= cell.pos < p1:
            cell.pos += shift
            if cell.pos < 0:
                for s in cell.seq_id:
                    self.cells[s].tail = -1
                cell.seq_id.clear()
                self._free_cell(cell)
                self._lower_head(tail_id)
    # --8<-- [end:seq_add]

    # --8<-- [start:seq_div]
    def seq_div(self, seq_id: int, p0: int, p1: int, d: int) -> None:
        """Divide the position of ``seq_id``'s state by ``d`` if it is in ``[p0, p1)``.

        Integer division (positions are >= 0); only the tail cell changes, for every
        sequence that shares it. No-op when ``d == 1`` or the range is empty.

        Raises:
            RecurrentMemoryError: ``seq_id`` out of ``[0, n_seq_max)``; ``d < 1``.
        """
        self._check_seq_id(seq_id)
        if d < 1:
            raise RecurrentMemoryError(f"seq_div needs d >= 1, got {d}")
        if d == 1:
            return
        p0 = max(p0, 0)
        p1 = POS_INF if p1 < 0 else p1
        if p0 == p1 or seq_id >= self.size:
            return
        tail_id = self.cells[seq_id].tail
        if tail_id >= 0:
            cell = self.cells[tail_id]
            if cell.has_seq_id(seq_id) and p0 <= cell.pos < p1:
                cell.pos //= d
    # --8<-- [end:seq_div]

    # --8<-- [start:seq_pos_min]
    def seq_pos_min(self, seq_id: int) -> int:
        """Smallest position of ``seq_id``; -1 if it has none.

        A sequence has one cell, so this is also [`seq_pos_max`][]: a recurrent memory
        only knows the *last* position its state has absorbed.

        Raises:
            RecurrentMemoryError: ``seq_id`` out of ``[0, n_seq_max)``.
        """
        self._check_seq_id(seq_id)
        pos = [cell.pos for cell in self.cells if cell.has_seq_id(seq_id)]
        return min(pos) if pos else -1
    # --8<-- [end:seq_pos_min]

    # --8<-- [start:seq_pos_max]
    def seq_pos_max(self, seq_id: int) -> int:
        """Largest position of ``seq_id``; -1 if it has none.

        Raises:
            RecurrentMemoryError: ``seq_id`` out of ``[0, n_seq_max)``.
        """
        self._check_seq_id(seq_id)
        return max([-1] + [cell.pos for cell in self.cells if cell.has_seq_id(seq_id)])
    # --8<-- [end:seq_pos_max]

    # ---- placing ubatches -------------------------------------------------------------------

    def _snapshot(self) -> tuple:
        """The cells and counters, for `_restore` (one small cell per sequence).

        Field by field rather than ``copy.deepcopy`` (or ``dataclasses.replace``): a snapshot
        is taken twice per decode, and the generic copies cost several times more.
        """
        cells = [MemCell(c.pos, c.src, c.src0, c.tail, set(c.seq_id)) for c in self.cells]
        return cells, self.used, self.head, self.n, self.rs_z

    def _restore(self, snap: tuple) -> None:
        self.cells, self.used, self.head, self.n, self.rs_z = snap

    # --8<-- [start:backup]
    def backup(self) -> tuple:
        """The cells and every state row, for [`restore`][]."""
        return self._snapshot(), self.save_rows(range(self.size))

    def restore(self, backup: tuple) -> None:
        """Put back what [`backup`][] saved."""
        snap, rows = backup
        self._restore(snap)
        self.load_rows(range(self.size), rows)

    def save_rows(self, cells: range) -> list[np.ndarray]:
        """The array step of a backup: copies of the state rows of ``cells``, every layer."""
        return [t[cells.start: cells.stop].copy() for t in self.r_l + self.s_l]

    def load_rows(self, cells: range, saved: list[np.ndarray]) -> None:
        """Write back rows that [`save_rows`][] saved from ``cells``."""
        for t, rows in zip(self.r_l + self.s_l, saved, strict=True):
            t[cells.start: cells.stop] = rows
    # --8<-- [end:backup]

    # --8<-- [start:find_slot]
    def find_slot(self, ubatch: Ubatch) -> bool:
        """Give each sequence set of ``ubatch`` its own cell, contiguous (``find_slot``).

        Changes the cells (unlike
        [`reference.memory.KVCache.find_slot`][reference.memory.kv_cache.KVCache.find_slot]); the
        rows are moved later by [`apply_ubatch`][]. Steps, as llama.cpp:

        1. a set's extra sequence ids (``seq_id[i][1:]``, coupled sequences) leave their
           cells: after this ubatch they share the first id's state;
        2. each set's first sequence needs a cell it owns alone: if its tail is shared (after
           [`seq_cp`][]) or missing, it takes the next empty cell, which inherits the
           shared cell's ``pos`` and ``src`` (**copy on write**: the row is copied from
           ``src``, the shared cell is untouched);
        3. the cells are swapped so that set ``s`` is in cell ``min + s`` (tails follow);
        4. each set's cell gets the position of its last token and its sequence ids;
        5. ``rs_z``: the first cell of the range no cell reads from, which the graph zeroes
           to give sequences without a source their zero state; every cell of the range
           records its source in ``src0`` and becomes its own source.

        Returns:
            False when a sequence id has no cell (``>= mem_size``); the cells may then be
            partly changed ([`prepare`][] restores them).

        Raises:
            RecurrentMemoryError: the ubatch is not made of equal sequence sets.
        """
        n_seq_tokens, n_seqs = ubatch.n_seq_tokens, ubatch.n_seqs
        if n_seqs < 1 or n_seq_tokens * n_seqs != ubatch.n_tokens:
            raise RecurrentMemoryError(
                f"a recurrent memory takes equal sequence sets: {ubatch.n_tokens} tokens in "
                f"{n_seqs} sets of {n_seq_tokens}")
        cells = self.cells
        # enough unused cells before the head: better to start searching from the start
        if self.head > self.used + 2 * n_seqs:
            self.head = 0
        first = [s * n_seq_tokens for s in range(n_seqs)]  # first token of each set

        # 1. every id must have a cell; extra ids of a set leave their cells
        for i in first:
            for j, seq_id in enumerate(ubatch.seq_id[i]):
                if not 0 <= seq_id < self.size:
                    return False
                seq = cells[seq_id]
                if j > 0 and seq.tail >= 0:
                    cell = cells[seq.tail]
                    cell.seq_id.discard(seq_id)
                    seq.tail = -1
                    if cell.is_empty():
                        self._free_cell(cell)

        # 2. a cell of its own for each set's first sequence (copy on write)
        next_empty_cell = self._next_empty(self.head)
        lo, hi = self.size - 1, 0
        for s, i in enumerate(first):
            seq_id = ubatch.seq_id[i][0]
            seq_meta = cells[seq_id]
            has_cell = seq_meta.tail >= 0 and len(cells[seq_meta.tail].seq_id) == 1
            if not has_cell:
                empty_cell = cells[next_empty_cell]
                if not empty_cell.is_empty():
                    raise RecurrentMemoryError("no empty cell (llama.cpp: GGML_ASSERT)")
                if seq_meta.tail >= 0:
                    orig_cell = cells[seq_meta.tail]
                    empty_cell.pos = orig_cell.pos
                    empty_cell.src = orig_cell.src  # the row is copied from here
                    orig_cell.seq_id.discard(seq_id)
                    empty_cell.seq_id.add(seq_id)  # overwritten in step 4
                seq_meta.tail = next_empty_cell
                if s + 1 < n_seqs:
                    next_empty_cell = self._next_empty(next_empty_cell + 1)
            lo, hi = min(lo, seq_meta.tail), max(hi, seq_meta.tail)

        # 3. gather: set s goes to cell lo + s
        for s, i in enumerate(first):
            dst_id, src_id = lo + s, cells[ubatch.seq_id[i][0]].tail
            if dst_id != src_id:
                self._swap_cells(dst_id, src_id)

        # 4. the new positions and sequence sets
        for s, i in enumerate(first):
            cell = cells[lo + s]
            cell.pos = int(ubatch.pos[i + n_seq_tokens - 1])
            cell.seq_id = set(ubatch.seq_id[i])
            for seq_id in ubatch.seq_id[i]:
                cells[seq_id].tail = lo + s

        # 5. the zero row and the sources of the range
        self._stage_sources(lo, hi)
        self.head = lo
        self.n = hi - lo + 1
        self.used = sum(not cell.is_empty() for cell in cells)
        return self.n >= n_seqs
    # --8<-- [end:find_slot]

    def _next_empty(self, start: int) -> int:
        """The first empty cell from ``start`` on, wrapping (``start`` when none is)."""
        for k in range(self.size):
            i = (start + k) % self.size
            if self.cells[i].is_empty():
                return i
        return start % self.size

    def _swap_cells(self, a: int, b: int) -> None:
        """Swap the contents of cells ``a`` and ``b`` and every tail pointing at them."""
        ca, cb = self.cells[a], self.cells[b]
        ca.pos, cb.pos = cb.pos, ca.pos
        ca.src, cb.src = cb.src, ca.src
        ca.seq_id, cb.seq_id = cb.seq_id, ca.seq_id
        for cell in self.cells:
            if cell.tail == b:
                cell.tail = a
            elif cell.tail == a:
                cell.tail = b

    # --8<-- [start:stage_sources]
    def _stage_sources(self, lo: int, hi: int) -> None:
        """``find_slot``'s last step: pick ``rs_z``, record ``src0``, make ``src = i``."""
        refcounts = [0] * self.size
        for cell in self.cells:
            if cell.src >= 0:
                refcounts[cell.src] += 1
        self.rs_z = next((i for i in range(lo, hi + 1) if refcounts[i] == 0), -1)
        for i in range(lo, hi + 1):
            cell = self.cells[i]
            if cell.src < 0:
                if self.rs_z < 0:
                    raise RecurrentMemoryError("no zero row (llama.cpp: GGML_ASSERT(rs_z >= 0))")
                cell.src0 = self.rs_z  # no state: start from the zeroed row
            else:
                cell.src0 = cell.src
            cell.src = i  # avoid moving or clearing twice
    # --8<-- [end:stage_sources]

    # --8<-- [start:prepare]
    def prepare(self, ubatches: list[Ubatch]) -> list[range] | None:
        """Where every ubatch of a batch goes, placing them in order; changes nothing.

        ``llama_memory_recurrent::prepare``: [`find_slot`][] on each ubatch, then the
        cells, ``used`` and ``head`` are restored (whether it fit or not). Here ``n`` and
        ``rs_z`` are restored too.

        Returns:
            Per ubatch, the cells ``range(head, head + n)`` its graph touches; None when one
            does not fit (llama.cpp: False; decode's return code 1).
        """
        snap = self._snapshot()
        placements = []
        try:
            for ubatch in ubatches:
                if not self.find_slot(ubatch):
                    return None
                placements.append(range(self.head, self.head + self.n))
            return placements
        finally:
            self._restore(snap)
    # --8<-- [end:prepare]

    # --8<-- [start:init_batch]
    def init_batch(self, balloc: BatchAllocr, n_ubatch: int,
                   embd_all: bool = False) -> MemoryContext:
        """Split a validated batch and place every ubatch (``init_batch``).

        ``llama_memory_recurrent::init_batch`` always cuts with
        ``split_equal(sequential=True)``: the conv and the scan run on ``n_seqs`` sets of
        ``n_seq_tokens`` tokens; with ``split_seq`` when every token outputs embeddings
        (``embd_all``). Then [`prepare`][].

        Returns:
            A [`MemoryContext`][reference.memory.interface.MemoryContext] of the ubatches and their
            cell ranges; ``FAILED_PREPARE`` (decode's 1) when the batch cannot be split or
            does not fit, the cells then unchanged.
        """
        if embd_all:
            return batch_context(self, balloc, lambda: balloc.split_seq(n_ubatch))
        return batch_context(self, balloc, lambda: balloc.split_equal(n_ubatch, sequential=True))

    def init_update(self, rope_factors: np.ndarray | None = None) -> MemoryContext:
        """``NO_UPDATE``: a state is not rotated by position, there is nothing to update."""
        return MemoryContext(self, MemoryStatus.NO_UPDATE)

    def update(self, rope_factors: np.ndarray | None = None) -> bool:
        """Nothing to do (there is no K-shift); False."""
        return False
    # --8<-- [end:init_batch]

    # --8<-- [start:apply_ubatch]
    def apply_ubatch(self, placement: range, ubatch: Ubatch) -> None:
        """Place ``ubatch`` ([`find_slot`][]) and move the state rows (``build_rs``).

        ``placement`` is what [`prepare`][] found for the ubatch; ``find_slot`` runs again
        (as llama.cpp's ``apply``) and must land there. Then, for every layer and both
        states, as the graph of the ubatch does before the layer runs ([`move_rows`][]):
        zero row ``rs_z``, then every cell ``i`` of ``head .. head + n`` takes the row of
        its source ``src0`` (all rows are read before any is written). After this, cell
        ``head + s`` holds the state sequence set ``s`` continues from: its own, the shared
        one it copied on write, or zeros. What [`remove_ubatch`][] needs is kept.

        Raises:
            RecurrentMemoryError: the ubatch does not fit, or not at ``placement`` (call
                [`prepare`][] first); the memory is then unchanged.

        Examples:
            >>> from types import SimpleNamespace
            >>> from reference.batch import Batch, BatchAllocr
            >>> hp = SimpleNamespace(arch="t", n_layer=1, n_embd_r=lambda: 1, n_embd_s=lambda: 2)
            >>> mem = RecurrentMemory(hp, mem_size=2, n_seq_max=2)
            >>> b = Batch(token=[1, 2, 3], seq_id=[[0], [1], [0]])
            >>> ub = BatchAllocr(b, n_vocab=8, n_seq_max=2, memory=mem).split_equal(8, True)
            >>> [cells] = mem.prepare([ub]); cells, ub.n_seqs, ub.n_seq_tokens
            (range(0, 2), 2, 1)
            >>> mem.apply_ubatch(cells, ub)
            >>> inp = mem.graph_input(cells, ub)
            >>> inp.get_s(0).tolist()  # two new sequences: zeros
            [[0.0, 0.0], [0.0, 0.0]]
            >>> inp.cpy_s(0, np.ones((2, 2), np.float32))
            >>> mem.seq_pos_max(0), mem.seq_pos_max(1), mem.s_l[0].sum()
            (0, 0, np.float32(4.0))
        """
        snap = self._snapshot()
        if not self.find_slot(ubatch):
            self._restore(snap)
            raise RecurrentMemoryError(f"no cell for a sequence of {ubatch.seq_id_unq}: "
                                       f"seq ids must be < mem_size = {self.size}")
        cells = range(self.head, self.head + self.n)
        if cells != placement:
            self._restore(snap)
            raise RecurrentMemoryError(f"the ubatch lands in cells {cells}, not in its "
                                       f"placement {placement}: prepare() the ubatches in order")
        self._undo = (ubatch, cells, snap, self.save_rows(cells))
        self.move_rows(cells, [self.cells[i].src0 for i in cells], self.rs_z)
    # --8<-- [end:apply_ubatch]

    # --8<-- [start:move_rows]
    def move_rows(self, cells: range, src: list[int], rs_z: int) -> None:
        """The array step of [`apply_ubatch`][]: zero row ``rs_z``, then ``cells`` take ``src``.

        Args:
            cells: the cells of the ubatch, ``head .. head + n``.
            src: the source row of each of them (``src0``).
            rs_z: the row to zero first (-1: none).
        """
        for t in self.r_l + self.s_l:
            if rs_z >= 0:
                t[rs_z] = 0
            t[cells.start: cells.stop] = t[src]  # (n, n_embd_r or n_embd_s); reads first
    # --8<-- [end:move_rows]

    # --8<-- [start:remove_ubatch]
    def remove_ubatch(self, placement: range, ubatch: Ubatch) -> None:
        """Undo the last [`apply_ubatch`][], whose ubatch was not computed (an abort).

        A state cannot forget its last tokens (``seq_rm`` of a partial range returns
        False), so the cells and the state rows of ``placement`` are put back as they were
        before the ubatch was applied. llama.cpp's decode calls ``seq_rm(s, pos_min, -1)``,
        which the recurrent memory refuses for a sequence that goes on: the cell keeps the
        ubatch's last position over a state that was never computed (a divergence).

        Raises:
            RecurrentMemoryError: ``ubatch`` is not the last one applied (at ``placement``).
        """
        undo = self._undo
        if undo is None or undo[0] is not ubatch or undo[1] != placement:
            raise RecurrentMemoryError("remove_ubatch undoes the last apply_ubatch only, "
                                       "before anything else changes the memory")
        _, cells, snap, rows = undo
        self._restore(snap)
        self.load_rows(cells, rows)
        self._undo = None
    # --8<-- [end:remove_ubatch]

    # --8<-- [start:rs_input]
    def rs_input(self, ubatch: Ubatch) -> RecurrentMemoryInput:
        """The [`RecurrentMemoryInput`][] of ``ubatch`` (call after [`apply_ubatch`][])."""
        return RecurrentMemoryInput(self, ubatch)

    def graph_input(self, placement: range, ubatch: Ubatch) -> RecurrentMemoryInput:
        """The memory interface's name for [`rs_input`][] (the memory knows the cells)."""
        return self.rs_input(ubatch)
    # --8<-- [end:rs_input]

    # ---- state (the module's functions, below) ----------------------------------------------

    # --8<-- [start:state]
    @contextmanager
    def on_host(self) -> Iterator[None]:
        """The state rows as NumPy arrays inside the ``with``: already so in the reference.

        A twin whose rows live elsewhere overrides this to move them for the duration
        ([`accelerated.memory.recurrent.RecurrentMemory.on_host`][accelerated.memory.recurrent.RecurrentMemory.on_host]).
        """
        yield

    def state_write(self, hparams: RecurrentHParams, seq_id: int = -1,
                    flags: int = LLAMA_STATE_SEQ_FLAGS_NONE) -> bytes:
        """The memory, or one sequence, as bytes: the module's [`state_write`][].

        ``flags`` are checked and otherwise ignored: a recurrent state is all partial, so
        ``PARTIAL_ONLY`` writes it whole, the same bytes (``llama_memory_recurrent::state_write``
        ignores them too).
        """
        check_state_flags(flags)
        with self.on_host():
            return state_write(self, hparams, seq_id)

    def state_read(self, hparams: RecurrentHParams, data: bytes, dest_seq_id: int = -1,
                   flags: int = LLAMA_STATE_SEQ_FLAGS_NONE) -> None:
        """Restore a blob of [`state_write`][]: the module's [`state_read`][] (``flags`` as
        [`state_write`][])."""
        check_state_flags(flags)
        with self.on_host():
            state_read(self, hparams, data, dest_seq_id)

    def state_save_file(self, path: str | Path, hparams: RecurrentHParams, tokens: ArrayLike,
                        seq_id: int = -1) -> int:
        """Save to a file (the module's [`state_save_file`][]); its size."""
        with self.on_host():
            return state_save_file(path, self, hparams, tokens, seq_id)

    def state_load_file(self, path: str | Path, hparams: RecurrentHParams,
                        dest_seq_id: int = -1) -> np.ndarray:
        """Restore a file (the module's [`state_load_file`][]); its tokens."""
        with self.on_host():
            return state_load_file(path, self, hparams, dest_seq_id)
    # --8<-- [end:state]
# --8<-- [end:RecurrentMemory]


# ---------------------------------------------------------------------------------------------
# state save / restore (llama_memory_recurrent::state_write / state_read)
# ---------------------------------------------------------------------------------------------


# --8<-- [start:RecurrentState]
@dataclass
class RecurrentState:
    """A recurrent memory blob, parsed.

    Attributes:
        arch: architecture name.
        fingerprint:
            [`reference.memory.state.hparams_fingerprint`][reference.memory.state.hparams_fingerprint]
            of the writer.
        r_type: ggml type of the conv-state rows; ``s_type`` of the SSM-state rows.
        seq_id: the saved sequence, -1 for the whole memory.
        pos: position of each saved cell ``(cell_count,)``.
        seq_ids: the sequence ids of each cell, ascending.
        r: per layer, the conv-state rows ``(cell_count, n_embd_r)``.
        s: per layer, the SSM-state rows ``(cell_count, n_embd_s)``.
    """

    arch: str
    fingerprint: bytes
    r_type: int
    s_type: int
    seq_id: int
    pos: list[int]
    seq_ids: list[tuple[int, ...]]
    r: list[np.ndarray]
    s: list[np.ndarray]

    @property
    def cell_count(self) -> int:
        """Number of saved cells."""
        return len(self.pos)
# --8<-- [end:RecurrentState]


def _check_hparams(memory: RecurrentMemory, hparams: RecurrentHParams) -> None:
    if hparams_fingerprint(hparams) != hparams_fingerprint(memory.hparams):
        raise StateError("hparams are not those of this memory")


# --8<-- [start:state_write]
def state_write(memory: RecurrentMemory, hparams: RecurrentHParams, seq_id: int = -1) -> bytes:
    r"""Save the whole recurrent memory, or one sequence, as bytes.

    ``llama_memory_recurrent::state_write`` in the envelope of
    [`reference.memory.state.state_write`][reference.memory.state.state_write] (little-endian):

    | field | type | value |
    |---|---|---|
    | magic, version, total size | 4 bytes, u32, u64 | ``b"LRRS"``, 1, bytes with checksum |
    | arch | u32 length + UTF-8 | ``hparams.arch`` |
    | fingerprint | 32 bytes | ``hparams_fingerprint(hparams)`` |
    | r_type, s_type | i32, i32 | ggml type of the rows (0 f32, 1 f16, 28 f64) |
    | seq_id | i32 | the saved sequence, -1 for all |
    | cell_count | u32 | saved cells (at most 1 for a sequence) |
    | *per cell* | i32, u32, i32 x n | ``pos``, ``n_seq_id``, the seq ids ascending |
    | s_trans, n_layer | u32, u32 | 0, ``n_layer`` |
    | *per layer* | | ``r_type`` i32, ``r_size_row`` u64, ``cell_count`` conv rows |
    | *per layer* | | ``s_type`` i32, ``s_size_row`` u64, ``cell_count`` SSM rows |
    | checksum | 32 bytes | SHA-256 of every byte before it |

    The saved cells are the non-empty ones in cell order (whole memory) or the one cell
    holding ``seq_id``; a sequence's cell is written with ``seq_id`` alone. The rows are
    read from each cell's ``src`` (where its state is), as llama.cpp.

    Args:
        memory: the memory to save.
        hparams: the model's hyperparameters (those of ``memory``).
        seq_id: the sequence to save, or -1 for the whole memory.

    Returns:
        The blob.

    Raises:
        StateError: ``seq_id`` out of range; ``hparams`` other than the memory's; a dtype
            with no ggml type.
    """
    _check_hparams(memory, hparams)
    if seq_id != -1 and not 0 <= seq_id < memory.n_seq_max:
        raise StateError(f"seq_id={seq_id} out of range [0, {memory.n_seq_max}) or -1")
    idxs = [i for i, c in enumerate(memory.cells)
            if (not c.is_empty() if seq_id == -1 else c.has_seq_id(seq_id))]
    t = ggml_type_of(memory.dtype)
    io = BlobWriter()
    io.write_string(hparams.arch)
    io.write_bytes(hparams_fingerprint(hparams))
    io.write("iiiI", t, t, seq_id, len(idxs))
    for i in idxs:
        ids = sorted(memory.cells[i].seq_id) if seq_id == -1 else [seq_id]
        io.write("iI", memory.cells[i].pos, len(ids))
        for s in ids:
            io.write("i", s)
    rows = [c.src if c.src >= 0 else i for i, c in ((i, memory.cells[i]) for i in idxs)]
    io.write("II", 0, hparams.n_layer)
    for tensors in (memory.r_l, memory.s_l):
        for x in tensors:
            write_layer_rows(io, x[rows])  # (cell_count, n_embd_r or n_embd_s)
    return seal(RS_STATE_MAGIC, RS_STATE_VERSION, io.getvalue())
# --8<-- [end:state_write]


# --8<-- [start:state_parse]
def state_parse(data: bytes) -> RecurrentState:
    """Parse a recurrent memory blob, checking magic, version, size and checksum first.

    Raises:
        StateError: bad magic (a KV cache blob included), another version, truncated or too
            long, checksum mismatch, an unknown row type, a layer block that disagrees with
            the header, bytes left over.
    """
    io = unseal(data, RS_STATE_MAGIC, RS_STATE_VERSION, "recurrent state blob")
    arch = io.read_string()
    fingerprint = io.read_bytes(32)
    r_type, s_type, seq_id, cell_count = io.read("iiiI")
    for t in (r_type, s_type):
        if t not in DTYPE_OF_GGML_TYPE:
            raise StateError(f"unsupported row type {ggml_type_name(t)}")
    pos, seq_ids = [], []
    for _ in range(cell_count):
        p, n_seq_id = io.read("iI")
        if n_seq_id > LLAMA_MAX_SEQ:
            raise StateError(f"a cell lists {n_seq_id} sequences")
        pos.append(p)
        seq_ids.append(tuple(io.read("i") for _ in range(n_seq_id)))
    s_trans, n_layer = io.read("II")
    if s_trans != 0:
        raise StateError("transposed S rows (s_trans = 1) are not supported")
    r = read_layer_rows(io, "conv", r_type, n_layer, cell_count)
    s = read_layer_rows(io, "ssm", s_type, n_layer, cell_count)
    if io.off != len(io.data):
        raise StateError(f"recurrent state blob has {len(io.data) - io.off} unread bytes")
    return RecurrentState(arch, fingerprint, r_type, s_type, seq_id, pos, seq_ids, r, s)
# --8<-- [end:state_parse]


# --8<-- [start:state_check]
def state_check(memory: RecurrentMemory, hparams: RecurrentHParams, state: RecurrentState,
                dest_seq_id: int) -> None:
    """Everything that must hold for ``state`` to be restored into ``memory``.

    Same architecture and hyperparameters, same row dtype, a whole blob for a whole restore
    and a sequence blob for a sequence restore, the destination in range and with a cell
    (``< mem_size``), ``n_layer`` and row widths of this memory, at most ``mem_size`` cells
    (one for a sequence), positions >= 0, sequence ids in range, ascending, and each in one
    cell only (llama.cpp: "duplicate tail").

    Raises:
        StateError: the first rule that fails, named.
    """
    _check_hparams(memory, hparams)
    if state.arch != hparams.arch:
        raise StateError(f"blob written for architecture {state.arch!r}, this model is "
                         f"{hparams.arch!r}")
    if state.fingerprint != hparams_fingerprint(hparams):
        raise StateError("blob written for other hyperparameters: another model")
    want = ggml_type_of(memory.dtype)
    if (state.r_type, state.s_type) != (want, want):
        raise StateError(f"dtype mismatch: blob {ggml_type_name(state.r_type)}/"
                         f"{ggml_type_name(state.s_type)}, this memory {ggml_type_name(want)}")
    if dest_seq_id != -1 and not 0 <= dest_seq_id < min(memory.n_seq_max, memory.size):
        raise StateError(f"dest_seq_id={dest_seq_id} out of range "
                         f"[0, {min(memory.n_seq_max, memory.size)}) or -1")
    if (state.seq_id == -1) != (dest_seq_id == -1):
        kind = "the whole memory" if state.seq_id == -1 else f"sequence {state.seq_id}"
        raise StateError(f"blob holds {kind}: restore it with dest_seq_id "
                         + ("-1" if state.seq_id == -1 else ">= 0"))
    limit = memory.size if dest_seq_id == -1 else 1
    if state.cell_count > limit:
        raise StateError(f"does not fit: {state.cell_count} cells, at most {limit} here")
    # llama.cpp's state_read_data checks n_layer first, whatever the cell count
    if len(state.r) != memory.hparams.n_layer:
        raise StateError(f"blob has {len(state.r)} layers, the model {memory.hparams.n_layer}")
    n_r, n_s = memory.hparams.n_embd_r(), memory.hparams.n_embd_s()
    for il, (r, s) in enumerate(zip(state.r, state.s, strict=True)):
        if r.shape[1] != n_r or s.shape[1] != n_s:
            raise StateError(f"layer {il}: rows of {r.shape[1]}/{s.shape[1]} elements "
                             f"(conv/ssm), this memory holds {n_r}/{n_s}")
    seen: set[int] = set()
    for j, (pos, ids) in enumerate(zip(state.pos, state.seq_ids, strict=True)):
        if pos < 0:
            raise StateError(f"cell {j}: position {pos} < 0")
        if not ids or list(ids) != sorted(set(ids)):
            raise StateError(f"cell {j}: sequence ids {ids} not ascending and unique")
        if state.seq_id != -1 and ids != (state.seq_id,):
            raise StateError(f"cell {j}: sequence ids {ids} in a blob of sequence {state.seq_id}")
        for sid in ids:
            if not 0 <= sid < min(memory.n_seq_max, memory.size):
                raise StateError(f"cell {j}: seq_id {sid} out of range "
                                 f"[0, {min(memory.n_seq_max, memory.size)})")
            if sid in seen:
                raise StateError(f"cell {j}: seq_id {sid} is in two cells (duplicate tail)")
            seen.add(sid)
# --8<-- [end:state_check]


# --8<-- [start:state_read]
def state_read(memory: RecurrentMemory, hparams: RecurrentHParams, data: bytes,
               dest_seq_id: int = -1) -> None:
    """Restore a blob of [`state_write`][]; everything is checked before anything changes.

    Whole blob: the memory is cleared (rows zeroed) and the saved cells become cells
    ``0 .. n-1``, each its own source. Sequence blob: ``dest_seq_id`` is removed, then its
    cell is placed by [`RecurrentMemory.find_slot`][] on a one-token ubatch at the saved
    position (as ``state_read_meta``) and the rows are written there; an empty sequence blob
    just empties ``dest_seq_id``. llama.cpp removes ``dest_seq_id`` before it knows the blob
    fits and clears it on a failed read; here a refused blob changes nothing.

    Raises:
        StateError: any refusal ([`state_parse`][], [`state_check`][]); the memory is
            then bit-identical to before.
    """
    state = state_parse(data)
    state_check(memory, hparams, state, dest_seq_id)
    if dest_seq_id == -1:
        _state_read_whole(memory, state)
    else:
        _state_read_seq(memory, state, dest_seq_id)
# --8<-- [end:state_read]


def _state_read_whole(memory: RecurrentMemory, state: RecurrentState) -> None:
    memory.clear(data=True)
    for i in range(state.cell_count):
        cell = memory.cells[i]
        cell.pos = state.pos[i]
        cell.seq_id = set(state.seq_ids[i])
        cell.src = i  # the restored rows are where they belong
        for sid in state.seq_ids[i]:
            memory.cells[sid].tail = i
    for il in range(memory.hparams.n_layer if state.cell_count else 0):
        memory.r_l[il][: state.cell_count] = state.r[il]
        memory.s_l[il][: state.cell_count] = state.s[il]
    memory.head = 0
    memory.used = state.cell_count


def _state_read_seq(memory: RecurrentMemory, state: RecurrentState, dest_seq_id: int) -> None:
    memory.seq_rm(dest_seq_id, -1, -1)
    if state.cell_count == 0:
        return
    ubatch = Ubatch(token=np.zeros(1, np.int32), embd=None,
                    pos=np.array(state.pos, np.int32), seq_id=((dest_seq_id,),),
                    seq_id_unq=(dest_seq_id,), output=np.zeros(1, bool),
                    idx=np.arange(1), equal_seqs=True, n_seq_tokens=1, n_seqs=1)
    ok = memory.find_slot(ubatch)
    assert ok, "state_check guarantees a cell for dest_seq_id"
    cell = memory.head
    memory.cells[cell].src = cell
    for il in range(memory.hparams.n_layer):
        memory.r_l[il][cell] = state.r[il][0]
        memory.s_l[il][cell] = state.s[il][0]


# --8<-- [start:state_save_file]
def state_save_file(path: str | Path, memory: RecurrentMemory, hparams: RecurrentHParams,
                    tokens: ArrayLike, seq_id: int = -1) -> int:
    """Save the memory (or one sequence) and its tokens to a file; returns its size.

    The file layout of
    [`reference.memory.state.state_save_file`][reference.memory.state.state_save_file] (magic
    ``b"LRSF"``, the tokens, a blob, a checksum) with a recurrent blob inside, written atomically.

    Raises:
        StateError: token ids beyond int32; as [`state_write`][].
    """
    toks = check_tokens(tokens)
    body = BlobWriter()
    body.write("I", toks.size)
    body.write_array(toks.astype(np.int32))
    body.write_bytes(state_write(memory, hparams, seq_id))
    data = seal(FILE_MAGIC, FILE_VERSION, body.getvalue())
    write_atomic(path, data)
    return len(data)
# --8<-- [end:state_save_file]


# --8<-- [start:state_load_file]
def state_load_file(path: str | Path, memory: RecurrentMemory, hparams: RecurrentHParams,
                    dest_seq_id: int = -1) -> np.ndarray:
    """Restore a file of [`state_save_file`][]; returns its tokens ``(n,)`` int32.

    Raises:
        StateError: a refused file or blob (memory unchanged). OSError: unreadable file.
    """
    io = unseal(Path(path).read_bytes(), FILE_MAGIC, FILE_VERSION, "state file")
    tokens = io.read_array(np.dtype(np.int32), (io.read("I"),))
    state_read(memory, hparams, io.read_bytes(len(io.data) - io.off), dest_seq_id)
    return tokens
# --8<-- [end:state_load_file]
