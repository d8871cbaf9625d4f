r"""Twin of [`reference.memory.recurrent`][reference.memory.recurrent]: the recurrent memory with
MLX state rows.

The cell bookkeeping (``find_slot``, ``seq_rm``/``seq_cp``/``seq_keep``/``seq_add``/
``seq_div``, copy on write, ``rs_z``, ``src0``) and the memory interface (``init_batch``,
``prepare``, ``apply_ubatch``, ``remove_ubatch``, ``backup``/``restore``, the state methods)
are inherited from
[`reference.memory.recurrent.RecurrentMemory`][reference.memory.recurrent.RecurrentMemory], never
rewritten. Only the array steps they call differ:

- ``r_l[il]`` ``(mem_size, n_embd_r)`` and ``s_l[il]`` ``(mem_size, n_embd_s)`` are
  ``mx.array``. MLX arrays are values, so a write replaces a layer's array in the list by a new
  (lazy) one instead of writing into a buffer; nothing else holds a reference to the rows.
- [`RecurrentMemory.move_rows`][] (the row moves of ``apply_ubatch``) is one gather per
  layer and state (``mx.take``), lazy like the graph that reads them, and skipped when every
  row stays in place (a sequence going on in its cell);
  [`RecurrentMemory.save_rows`][] keeps the arrays themselves (values: no copy).
- [`RecurrentMemoryInput`][] hands the model ``mx.array`` rows and takes lazy ones back.
- State save/restore is the reference's code run on host copies of the rows
  ([`RecurrentMemory.on_host`][]), so a blob written by either memory restores in the
  other; parsing and checking blobs are imported.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import mlx.core as mx
import numpy as np
from numpy.typing import ArrayLike, DTypeLike

from accelerated.ops.convert import as_mx, to_mx_dtype
from reference.batch import Ubatch
from reference.memory import recurrent as ref
from reference.memory.recurrent import (
    POS_INF,
    RS_STATE_MAGIC,
    RS_STATE_VERSION,
    MemCell,
    RecurrentHParams,
    RecurrentMemoryError,
    RecurrentState,
    state_check,
    state_parse,
)

__all__ = [
    "POS_INF",
    "RS_STATE_MAGIC",
    "RS_STATE_VERSION",
    "MemCell",
    "RecurrentHParams",
    "RecurrentMemory",
    "RecurrentMemoryError",
    "RecurrentMemoryInput",
    "RecurrentState",
    "state_check",
    "state_load_file",
    "state_parse",
    "state_read",
    "state_save_file",
    "state_write",
]

#: the dtypes the recurrent state rows can have on the device
_STATE_DTYPES = (np.dtype(np.float32), np.dtype(np.float16))


def _put_rows(t: mx.array, start: int, rows: mx.array) -> mx.array:
    """``t`` with rows ``start .. start + len(rows)`` replaced by ``rows`` (a new array).

    Rows that are all of ``t`` (one sequence in a one-cell memory: every generation step of
    a single chat) replace it whole, with no update node in the step's graph.
    """
    rows = rows.astype(t.dtype)  # no node when it is t's dtype
    if start == 0 and rows.shape == t.shape:
        return rows
    return mx.slice_update(t, rows, mx.array([start]), axes=(0,))


def _get_rows(t: mx.array, start: int, n: int) -> mx.array:
    """Rows ``start .. start + n`` of ``t``; ``t`` itself when they are all of it (no
    slice node)."""
    return t if start == 0 and n == t.shape[0] else t[start: start + n]


# --8<-- [start:RecurrentMemoryInput]
class RecurrentMemoryInput(ref.RecurrentMemoryInput):
    """Twin of
    [`reference.memory.recurrent.RecurrentMemoryInput`][reference.memory.recurrent.RecurrentMemoryInput].

    ``get_r``/``get_s`` return lazy slices of the memory's ``mx.array`` rows (no copy is
    needed: MLX arrays are values); ``cpy_r``/``cpy_s`` replace the layer's array by one with
    the ubatch's rows written (``mx.slice_update``). The constructor is the reference's.
    """

    def get_r(self, il: int) -> mx.array:
        """Conv states of layer ``il``, one row per sequence set ``(n_seqs, n_embd_r)``."""
        return _get_rows(self.memory.r_l[il], self.head, self.n_seqs)

    def get_s(self, il: int) -> mx.array:
        """SSM states of layer ``il``, one row per sequence set ``(n_seqs, n_embd_s)``."""
        return _get_rows(self.memory.s_l[il], self.head, self.n_seqs)

    def cpy_r(self, il: int, r: mx.array) -> None:
        """Store the final conv states ``(n_seqs, n_embd_r)`` of layer ``il``."""
        self.memory.r_l[il] = _put_rows(self.memory.r_l[il], self.head, self._rows(r))

    def cpy_s(self, il: int, s: mx.array) -> None:
        """Store the final SSM states ``(n_seqs, n_embd_s)`` of layer ``il``."""
        self.memory.s_l[il] = _put_rows(self.memory.s_l[il], self.head, self._rows(s))

    def _rows(self, x: mx.array) -> mx.array:
        """``x`` as ``(n_seqs, -1)`` rows (no reshape node when it is already)."""
        x = as_mx(x)
        return x if x.ndim == 2 and x.shape[0] == self.n_seqs else x.reshape(self.n_seqs, -1)
# --8<-- [end:RecurrentMemoryInput]


# --8<-- [start:RecurrentMemory]
class RecurrentMemory(ref.RecurrentMemory):
    """Twin of
    [`reference.memory.recurrent.RecurrentMemory`][reference.memory.recurrent.RecurrentMemory].

    The same cells and API; ``r_l``/``s_l`` are lists of ``mx.array``. ``dtype`` is float32
    (llama.cpp's) or float16; ``self.dtype`` stays the NumPy dtype, as in the reference.

    Raises:
        RecurrentMemoryError: as the reference; also a ``dtype`` other than float32/float16.

    Examples:
        >>> from types import SimpleNamespace
        >>> hp = SimpleNamespace(arch="mamba", n_layer=2, n_embd_r=lambda: 6, n_embd_s=lambda: 8)
        >>> mem = RecurrentMemory(hp, mem_size=2, n_seq_max=2)
        >>> mem.r_l[0].shape, mem.s_l[1].dtype, mem.seq_pos_max(0), mem.can_shift()
        ((2, 6), mlx.core.float32, -1, True)
    """

    def __init__(self, hparams: RecurrentHParams, mem_size: int, n_seq_max: int = 1,
                 dtype: DTypeLike = np.float32):
        if np.dtype(dtype) not in _STATE_DTYPES:
            raise RecurrentMemoryError(f"dtype {np.dtype(dtype)} is not float32 or float16")
        super().__init__(hparams, mem_size, n_seq_max, dtype)
        mx_dtype = to_mx_dtype(self.dtype)
        self.r_l = [mx.zeros((mem_size, hparams.n_embd_r()), mx_dtype)
                    for _ in range(hparams.n_layer)]  # (mem_size, n_embd_r) per layer
        self.s_l = [mx.zeros((mem_size, hparams.n_embd_s()), mx_dtype)
                    for _ in range(hparams.n_layer)]  # (mem_size, n_embd_s) per layer

    # --8<-- [start:clear]
    def clear(self, data: bool = True) -> None:
        """Twin of
        [`reference.memory.recurrent.RecurrentMemory.clear`][reference.memory.recurrent.RecurrentMemory.clear]:
        rows become zeros."""
        super().clear(data=False)
        if data:  # NumPy rows while the reference's state_read runs (_on_host)
            on_host = bool(self.r_l) and isinstance(self.r_l[0], np.ndarray)
            zeros = np.zeros_like if on_host else mx.zeros_like
            self.r_l = [zeros(t) for t in self.r_l]
            self.s_l = [zeros(t) for t in self.s_l]
    # --8<-- [end:clear]

    # --8<-- [start:save_rows]
    def save_rows(self, cells: range) -> tuple[list, list]:
        """Twin of
        [`reference.memory.recurrent.RecurrentMemory.save_rows`][reference.memory.recurrent.RecurrentMemory.save_rows].

        The rows are immutable values: keeping the arrays (not copies) is the backup.
        """
        return list(self.r_l), list(self.s_l)

    def load_rows(self, cells: range, saved: tuple[list, list]) -> None:
        """Twin of
        [`reference.memory.recurrent.RecurrentMemory.load_rows`][reference.memory.recurrent.RecurrentMemory.load_rows]."""
        r_l, s_l = saved
        self.r_l, self.s_l = list(r_l), list(s_l)
    # --8<-- [end:save_rows]

    # --8<-- [start:move_rows]
    def move_rows(self, cells: range, src: list[int], rs_z: int) -> None:
        """Twin of
        [`reference.memory.recurrent.RecurrentMemory.move_rows`][reference.memory.recurrent.RecurrentMemory.move_rows].

        Per layer and state, a zeroed ``rs_z`` row then one gather ``t[src]`` written over
        ``cells`` (the gather reads the array before the write, as the reference's fancy
        indexing). Nothing is evaluated here: the moves are lazy and run with the ubatch's
        graph, so a decode does not wait for the previous one. A move that changes nothing
        (no ``rs_z``, every cell its own source: a sequence that goes on in its cell, the
        common step of generation) adds no work at all. ``apply_ubatch`` (``find_slot``, the
        check of the placement, the undo) is the reference's.

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
            >>> inp.cpy_s(0, mx.ones((2, 2)))
            >>> mem.seq_pos_max(0), mem.seq_pos_max(1), mem.s_l[0].sum().item()
            (0, 0, 4.0)
        """
        if rs_z < 0 and list(src) == list(cells):
            return  # every row stays where it is
        idx = mx.array(src, dtype=mx.int32)  # (n,)
        for rows in (self.r_l, self.s_l):
            for il, t in enumerate(rows):
                if rs_z >= 0:
                    t = _put_rows(t, rs_z, mx.zeros((1, t.shape[1]), t.dtype))
                rows[il] = _put_rows(t, cells.start, mx.take(t, idx, axis=0))  # (size, n_embd)
    # --8<-- [end:move_rows]

    # --8<-- [start:rs_input]
    def rs_input(self, ubatch: Ubatch) -> RecurrentMemoryInput:
        """Twin of
        [`reference.memory.recurrent.RecurrentMemory.rs_input`][reference.memory.recurrent.RecurrentMemory.rs_input]."""
        return RecurrentMemoryInput(self, ubatch)
    # --8<-- [end:rs_input]

    # --8<-- [start:on_host]
    @contextmanager
    def on_host(self) -> Iterator[None]:
        """The rows as NumPy inside the ``with``, MLX again after (even on an error).

        The reference's state functions run on them (the state methods are inherited).
        Re-entrant: inside, the rows are already on the host.
        """
        if self.r_l and isinstance(self.r_l[0], np.ndarray):
            yield
            return
        mx_dtype = self.r_l[0].dtype if self.r_l else mx.float32
        self.r_l = [np.array(t) for t in self.r_l]
        self.s_l = [np.array(t) for t in self.s_l]
        try:
            yield
        finally:
            self.r_l = [mx.array(np.asarray(t)).astype(mx_dtype) for t in self.r_l]
            self.s_l = [mx.array(np.asarray(t)).astype(mx_dtype) for t in self.s_l]
    # --8<-- [end:on_host]
# --8<-- [end:RecurrentMemory]


# --8<-- [start:state_write]
def state_write(memory: RecurrentMemory, hparams: RecurrentHParams, seq_id: int = -1) -> bytes:
    """Twin of [`reference.memory.recurrent.state_write`][reference.memory.recurrent.state_write].
    ``memory.state_write``.

    The memory's method runs the reference on host rows ([`RecurrentMemory.on_host`][]).

    Examples:
        >>> from reference.testing import tiny_mamba_hparams
        >>> hp = tiny_mamba_hparams("mamba")
        >>> state_write(RecurrentMemory(hp, mem_size=1), hp)[:4]
        b'LRRS'
    """
    return memory.state_write(hparams, seq_id)
# --8<-- [end:state_write]


# --8<-- [start:state_read]
def state_read(memory: RecurrentMemory, hparams: RecurrentHParams, data: bytes,
               dest_seq_id: int = -1) -> None:
    """Twin of [`reference.memory.recurrent.state_read`][reference.memory.recurrent.state_read].
    ``memory.state_read``.

    A refused blob raises [`reference.memory.blob.StateError`][reference.memory.blob.StateError]
    and changes nothing.
    """
    memory.state_read(hparams, data, dest_seq_id)
# --8<-- [end:state_read]


# --8<-- [start:state_save_file]
def state_save_file(path: str | Path, memory: RecurrentMemory, hparams: RecurrentHParams,
                    tokens: ArrayLike, seq_id: int = -1) -> int:
    """Twin of
    [`reference.memory.recurrent.state_save_file`][reference.memory.recurrent.state_save_file].
    ``memory.state_save_file``."""
    return memory.state_save_file(path, hparams, tokens, seq_id)
# --8<-- [end:state_save_file]


# --8<-- [start:state_load_file]
def state_load_file(path: str | Path, memory: RecurrentMemory, hparams: RecurrentHParams,
                    dest_seq_id: int = -1) -> np.ndarray:
    """Twin of
    [`reference.memory.recurrent.state_load_file`][reference.memory.recurrent.state_load_file].
    ``memory.state_load_file``."""
    return memory.state_load_file(path, hparams, dest_seq_id)
# --8<-- [end:state_load_file]
