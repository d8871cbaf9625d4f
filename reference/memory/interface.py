r"""One memory interface: ``llama_memory_i`` and ``llama_memory_context_i`` (``llama-memory.h``).

A context does not know which memory it holds. llama.cpp's ``llama_context::decode`` talks to
a ``llama_memory_i``: the KV cache of an attention model and the recurrent memory of a Mamba
model answer the same calls, and what differs (cells per token or per sequence, a slot or a
range of cells, a K-shift or none) stays inside each. Here
[`KVCache`][reference.memory.kv_cache.KVCache], the pair of caches of a sliding-window model
[`KVCacheISWA`][reference.memory.kv_cache_iswa.KVCacheISWA] and
[`RecurrentMemory`][reference.memory.recurrent.RecurrentMemory] implement [`Memory`][]:

| ours | llama.cpp |
|---|---|
| ``init_batch(balloc, n_ubatch)`` | ``llama_memory_i::init_batch``: split, then ``prepare`` |
| ``prepare(ubatches)`` | ``prepare``: a placement per ubatch, or None (all or nothing) |
| ``apply_ubatch(placement, ubatch)`` | ``apply_ubatch(sinfo, ubatch)`` / ``find_slot(ubatch)`` |
| ``graph_input(placement, ubatch)`` | the graph's ``build_attn_inp_kv`` / ``build_rs_inp`` |
| ``remove_ubatch(placement, ubatch)`` | decode's ``seq_rm(s, pos_min, -1)`` after an abort |
| ``init_update(rope_factors)``, ``update`` | ``init_update``; the K-shift and stream copies |
| ``can_shift()``, ``get_size()`` | ``get_can_shift()``, ``get_size()`` |
| ``clear``, ``seq_rm/cp/keep/add/div``, ``seq_pos_min/max`` | the same |
| ``state_write(hparams, seq_id, flags)``, ``state_read(..., dest_seq_id, flags)`` | the same |
| ``state_save_file``, ``state_load_file`` | ``llama_state_save_file`` / ``load_file`` |

A *placement* is where a ubatch goes: a [`SlotInfo`][reference.memory.kv_cache.SlotInfo] (one cell
per token) for the KV cache, a ``range`` of cells (one per sequence set) for the recurrent
memory. `Memory.init_batch` returns a [`MemoryContext`][] that holds the ubatches
with their placements and a [`MemoryStatus`][]; decode walks it as llama.cpp does::

    mctx = memory.init_batch(balloc, n_ubatch)      # FAILED_PREPARE: return 1
    while True:
        mctx.apply()                                # cells (and state rows) of this ubatch
        logits = forward(mctx.get_ubatch(), mctx.graph_input())
        if not mctx.next():
            break

Who builds which memory is ``llama_model::create_memory``:
[`reference.memory.create_memory`][reference.memory.create_memory].
"""

from __future__ import annotations

from collections.abc import Callable
from enum import IntEnum
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from reference.batch import BatchAllocr, Ubatch
from reference.common import LlamarefError


# --8<-- [start:MemoryStatus]
class MemoryStatus(IntEnum):
    """``llama_memory_status``: what a [`MemoryContext`][] holds.

    ``SUCCESS``: ubatches placed (or an update to apply); ``NO_UPDATE``: nothing to update;
    ``FAILED_PREPARE``: no valid split or no room: ``llama_decode`` returns 1;
    ``FAILED_COMPUTE``: never produced here (llama.cpp: a failed graph compute).
    """

    SUCCESS = 0
    NO_UPDATE = 1
    FAILED_PREPARE = 2
    FAILED_COMPUTE = 3
# --8<-- [end:MemoryStatus]


class MemoryContextError(LlamarefError, RuntimeError):
    """A failed [`MemoryContext`][] was asked to apply (llama.cpp asserts)."""


# --8<-- [start:MemoryContext]
class MemoryContext:
    """``llama_memory_context_i``: the ubatches of one batch and their placements, or an update.

    Made by `Memory.init_batch` (or `Memory.init_update`), read by the context.
    Only [`apply`][] changes the memory, as in llama.cpp.

    Attributes:
        memory: the memory the context belongs to.
        status: a [`MemoryStatus`][].
        ubatches: the ubatches of the batch, in order (none for an update).
        placements: where each ubatch goes (a ``SlotInfo`` or a ``range`` of cells).
        error: why the status is a failure, else None.
        rope_factors: the model's ``rope_freqs.weight`` for an update's K-shift.

    Examples:
        >>> from reference.testing import tiny_hparams
        >>> from reference.batch import Batch, BatchAllocr
        >>> from reference.memory import KVCache
        >>> cache = KVCache(tiny_hparams(), kv_size=8)
        >>> balloc = BatchAllocr(Batch(token=[1, 2, 3]), n_vocab=32, n_seq_max=1, memory=cache)
        >>> mctx = cache.init_batch(balloc, n_ubatch=2)
        >>> mctx.get_status().name, [ub.n_tokens for ub in mctx.ubatches]
        ('SUCCESS', [2, 1])
        >>> mctx.apply(), mctx.get_placement().idxs, mctx.next(), mctx.next()
        (True, ((0, 1),), True, False)
    """

    def __init__(self, memory: Memory, status: MemoryStatus = MemoryStatus.SUCCESS,
                 ubatches: list[Ubatch] | tuple = (), placements: list | tuple = (),
                 error: str | None = None, rope_factors: np.ndarray | None = None):
        self.memory = memory
        self.status = status
        self.ubatches = list(ubatches)
        self.placements = list(placements)
        self.error = error
        self.rope_factors = rope_factors
        self.i_cur = 0

    def get_status(self) -> MemoryStatus:
        """The status (``get_status``)."""
        return self.status

    def get_ubatch(self) -> Ubatch:
        """The current ubatch (``get_ubatch``)."""
        return self.ubatches[self.i_cur]

    def get_placement(self) -> Any:
        """Where the current ubatch goes: a ``SlotInfo`` or a ``range`` of cells."""
        return self.placements[self.i_cur]

    def next(self) -> bool:
        """Move to the next ubatch; False when there is none (``next``)."""
        self.i_cur += 1
        return self.i_cur < len(self.ubatches)

    def apply(self) -> bool:
        """Apply the current ubatch to the memory, or the update (``apply``).

        Returns:
            For a batch, True. For an update, whether a K-shift turned some key
            (`Memory.update`; llama.cpp returns True for any applied update).

        Raises:
            MemoryContextError: the status is a failure (nothing to apply).
        """
        if self.status in (MemoryStatus.FAILED_PREPARE, MemoryStatus.FAILED_COMPUTE):
            raise MemoryContextError(f"cannot apply a failed memory context: {self.error}")
        if not self.ubatches:  # no ubatches: an update
            return self.memory.update(self.rope_factors)
        self.memory.apply_ubatch(self.get_placement(), self.get_ubatch())
        return True

    def graph_input(self) -> Any:
        """What the forward reads and writes for the current ubatch (after [`apply`][]).

        A [`KVCacheAttnInput`][reference.memory.kv_cache.KVCacheAttnInput] (K/V and the KQ mask)
        from a KV cache, a [`RecurrentMemoryInput`][reference.memory.recurrent.RecurrentMemoryInput]
        (the state rows) from a recurrent memory.
        """
        return self.memory.graph_input(self.get_placement(), self.get_ubatch())

    def remove_ubatch(self) -> None:
        """Undo the current ubatch, applied but not computed (`Memory.remove_ubatch`)."""
        self.memory.remove_ubatch(self.get_placement(), self.get_ubatch())
# --8<-- [end:MemoryContext]


# --8<-- [start:batch_context]
def batch_context(memory: Memory, balloc: BatchAllocr,
                  split: Callable[[], Ubatch]) -> MemoryContext:
    """``init_batch``'s common part: cut the whole batch with ``split``, then ``prepare`` it.

    Each memory picks its ``split`` (the next ubatch of ``balloc``); this splits until every
    token is used or the split gives nothing (no valid split), and asks the memory for a
    placement of every ubatch, all or nothing.

    Returns:
        A [`MemoryContext`][]; ``FAILED_PREPARE`` when some tokens cannot be split (coupled
        sequences on a per-sequence split) or some ubatch finds no room. Nothing changed then.
    """
    balloc.split_reset()
    ubatches = []
    while balloc.n_used < balloc.n_tokens and (ubatch := split()).n_tokens:
        ubatches.append(ubatch)
    if balloc.n_used < balloc.n_tokens:
        return MemoryContext(memory, MemoryStatus.FAILED_PREPARE,
                             error=balloc.split_error or "failed to find a suitable split")
    placements = memory.prepare(ubatches)
    if placements is None:
        return MemoryContext(memory, MemoryStatus.FAILED_PREPARE,
                             error=f"failed to find a memory slot for a batch of {balloc.n_tokens}")
    return MemoryContext(memory, MemoryStatus.SUCCESS, ubatches, placements)
# --8<-- [end:batch_context]


# --8<-- [start:Memory]
class Memory(Protocol):
    """``llama_memory_i``: what a context asks of its memory (see the table above)."""

    hparams: Any
    n_seq_max: int

    def init_batch(self, balloc: BatchAllocr, n_ubatch: int,
                   embd_all: bool = False) -> MemoryContext: ...

    def init_update(self, rope_factors: np.ndarray | None = None) -> MemoryContext: ...

    def prepare(self, ubatches: list[Ubatch]) -> list | None: ...

    def apply_ubatch(self, placement: Any, ubatch: Ubatch) -> None: ...

    def graph_input(self, placement: Any, ubatch: Ubatch) -> Any: ...

    def remove_ubatch(self, placement: Any, ubatch: Ubatch) -> None: ...

    def update(self, rope_factors: np.ndarray | None = None) -> bool: ...

    def can_shift(self) -> bool: ...

    def get_size(self) -> int: ...

    def clear(self, data: bool = True) -> None: ...

    def seq_rm(self, seq_id: int, p0: int, p1: int) -> bool: ...

    def seq_cp(self, seq_id_src: int, seq_id_dst: int, p0: int, p1: int) -> None: ...

    def seq_keep(self, seq_id: int) -> None: ...

    def seq_add(self, seq_id: int, p0: int, p1: int, shift: int) -> None: ...

    def seq_div(self, seq_id: int, p0: int, p1: int, d: int) -> None: ...

    def seq_pos_min(self, seq_id: int) -> int: ...

    def seq_pos_max(self, seq_id: int) -> int: ...

    def state_write(self, hparams: Any, seq_id: int = -1, flags: int = 0) -> bytes: ...

    def state_read(self, hparams: Any, data: bytes, dest_seq_id: int = -1,
                   flags: int = 0) -> None: ...

    def state_save_file(self, path: str | Path, hparams: Any, tokens: Any,
                        seq_id: int = -1) -> int: ...

    def state_load_file(self, path: str | Path, hparams: Any,
                        dest_seq_id: int = -1) -> np.ndarray: ...
# --8<-- [end:Memory]
