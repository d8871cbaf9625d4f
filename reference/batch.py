r"""Batches and ubatches: ``llama_batch``, its validation, and the three ubatch splits.

This module mirrors ``src/llama-batch.cpp`` (``llama_batch_allocr``, ``llama_batch_compat``) and
the batch handling of ``llama_context::decode`` at the pinned commit.

A **batch** is what the caller hands to ``llama_decode``: ``n_tokens`` entries, each a token id
(or an embedding row), a position, one or more sequence ids, and an *output* flag (llama.cpp's
``logits`` array: does this token get a row of logits). Positions, sequence ids and output flags
may be left out; llama.cpp then fills them:

- ``pos``: each token continues its (first) sequence, starting at ``memory.seq_pos_max(s) + 1``;
- ``seq_id``: every token belongs to sequence 0;
- ``logits``: only the last token outputs.

The **allocator** (``llama_batch_allocr::init``) checks the batch against the memory and
refuses it (``llama_decode`` returns ``-1``, nothing changed) unless

1. every token id is in $[0, n_\mathrm{vocab})$ and every seq id in $[0, n_\mathrm{seq\_max})$;
2. for every sequence $s$ whose memory is not empty, the first position of $s$ in the batch is
   exactly $\mathrm{pos\_max}(s) + 1$ (an *empty* sequence may start anywhere);
3. the positions of $s$ in the batch have no holes:
   $\max_s - \min_s + 1 \le |\{\text{distinct positions of } s\}|$ (repeats are allowed);
4. sequences that share a token ("coupled") have the same ``[pos_min, pos_max]`` in memory;
5. the positions of every sequence never decrease in batch order.

Then the allocator cuts the batch into **ubatches** (micro-batches, at most ``n_ubatch``
tokens each) that the memory places and the model computes one at a time:

- ``split_simple``: the next ``n_ubatch`` unused tokens, in batch order. Used by
  ``llama_kv_cache`` with one stream (``kv_unified=True``, or ``n_seq_max == 1``), and first
  by the iSWA cache when unified.
- ``split_equal``: ``n_seqs`` disjoint sequence sets side by side, ``n_seq_tokens`` tokens
  each. Used by ``llama_kv_cache`` with one stream per sequence (``sequential=True``), by the
  iSWA cache as its fallback (``sequential=not kv_unified``), and by the recurrent and hybrid
  memories when not every token outputs.
- ``split_seq``: one sequence set at a time (narrowing to subsets), in batch order. Used by
  the recurrent and hybrid memories when every token outputs (embeddings).

Every ubatch records ``idx``, the batch index of each of its tokens, and the allocator
records ``out_ids``, the batch indices of the output tokens in the order the splits met
them. ``llama_context::decode`` stores the logits rows in that order and then sorts them
back into batch order ([`output_ids`][]), so ``get_logits()`` row $k$ is the $k$-th output
token of the batch.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from reference.common import LLAMA_MAX_SEQ, POS_INF, LlamarefError


# --8<-- [start:BatchError]
class BatchError(LlamarefError, ValueError):
    """The batch is invalid: ``llama_decode`` would return ``-1`` and change nothing."""
# --8<-- [end:BatchError]


# --8<-- [start:SeqPosMemory]
class SeqPosMemory(Protocol):
    """What batch validation reads from the memory (``llama_memory_i``), and nothing more.

    ``seq_pos_min(s)`` / ``seq_pos_max(s)`` are the smallest / largest position the memory
    holds for sequence ``s``, or ``-1`` when it holds none.
    """

    def seq_pos_min(self, seq_id: int) -> int: ...

    def seq_pos_max(self, seq_id: int) -> int: ...
# --8<-- [end:SeqPosMemory]


# ---------------------------------------------------------------------------------------------
# llama_batch
# ---------------------------------------------------------------------------------------------


_INT32 = np.iinfo(np.int32)


def _int_array(name: str, values, n_tokens: int | None) -> np.ndarray:
    """``values`` as a 1-D int32 array (of length ``n_tokens`` when given), or BatchError."""
    arr = np.asarray(values)
    if arr.size == 0:
        arr = arr.astype(np.int32)
    if arr.ndim != 1 or arr.dtype.kind not in "iub":  # signed, unsigned, bool
        raise BatchError(f"{name} must be a 1-D sequence of integers, got shape {arr.shape} "
                         f"of {arr.dtype}")
    if arr.dtype == bool:
        raise BatchError(f"{name} must hold integers, not booleans")
    if arr.dtype != np.int32 and arr.size:  # an int32 array fits by construction
        if arr.min() < _INT32.min or arr.max() > _INT32.max:
            raise BatchError(f"{name} must fit in int32 (llama_token / llama_pos are int32_t)")
    if n_tokens is not None and arr.shape[0] != n_tokens:
        raise BatchError(f"{name} has {arr.shape[0]} entries, the batch has {n_tokens} tokens")
    return arr.astype(np.int32)


def _seq_ids(seq_id, n_tokens: int) -> tuple[tuple[int, ...], ...]:
    """Per token, its seq ids as a tuple, first occurrence kept (llama.cpp keeps a set)."""
    if len(seq_id) != n_tokens:
        raise BatchError(f"seq_id has {len(seq_id)} entries, the batch has {n_tokens} tokens")
    out = []
    for i, ids in enumerate(seq_id):
        # tuple/list first: the Sequence check (an ABC) is slow, and they are Sequences
        if isinstance(ids, (int, np.integer)) or not (
                isinstance(ids, (tuple, list, np.ndarray)) or isinstance(ids, Sequence)):
            raise BatchError(f"seq_id[{i}] must be a list of seq ids (e.g. [0]), got {ids!r}")
        if len(ids) == 0:
            raise BatchError(f"seq_id[{i}] is empty: every token needs at least one seq id")
        for s in ids:
            if isinstance(s, bool) or not isinstance(s, (int, np.integer)):
                raise BatchError(f"seq_id[{i}] must hold integers, got {s!r}")
        out.append(tuple(dict.fromkeys(int(s) for s in ids)))
    return tuple(out)


def _flat_seq_ids(seq_id: tuple[tuple[int, ...], ...]) -> tuple[np.ndarray, ...]:
    """The seq ids of a batch as one flat list in batch order, with where each came from.

    Returns:
        ``(tok, k, sid)``, each ``(n_entries,)``: entry ``j`` is ``seq_id[tok[j]][k[j]]``
        ``== sid[j]`` (``k == 0``: a token's first seq id). ``sid`` is an object array when
        some id does not fit in int64 (only range checks read it then).
    """
    tok = np.array([i for i, ids in enumerate(seq_id) for _ in ids], dtype=np.int64)
    k = np.array([k for ids in seq_id for k in range(len(ids))], dtype=np.int64)
    sid = np.array([s for ids in seq_id for s in ids], dtype=None if seq_id else np.int64)
    return tok, k, sid  # each (n_entries,)


# --8<-- [start:Batch]
@dataclass(frozen=True, eq=False)
class Batch:
    """``llama_batch``: the input of one ``llama_decode`` call.

    Exactly one of ``token`` and ``embd`` is given. Lists are accepted and stored as arrays.
    Construction checks types and shapes only; the checks that need the vocabulary, the
    context or the memory happen in [`BatchAllocr`][].

    Attributes:
        token: ``(n_tokens,)`` int32 token ids, or None when ``embd`` is given.
        embd: ``(n_tokens, n_embd)`` float input embeddings, or None when ``token`` is given.
        pos: ``(n_tokens,)`` int32 positions, or None to continue each sequence from memory.
        seq_id: per token, a tuple of its sequence ids (duplicates dropped, order kept; the
            first one is the one that picks the position when ``pos`` is None), or None for
            "every token in sequence 0".
        logits: ``(n_tokens,)`` bool, does the token output (llama.cpp's ``logits``, the
            "output" flags), or None for "only the last token".

    Raises:
        BatchError: neither or both of ``token`` / ``embd``; wrong shapes or types; a token
            with no seq id.

    Examples:
        >>> b = Batch(token=[5, 6, 7], seq_id=[[0], [0, 1], [1]])
        >>> b.n_tokens, b.token.dtype, b.seq_id
        (3, dtype('int32'), ((0,), (0, 1), (1,)))
        >>> Batch(token=[1], embd=[[0.5]])
        Traceback (most recent call last):
        ...
        reference.batch.BatchError: a batch holds either token ids or embeddings: give exactly one
    """

    token: np.ndarray | None = None
    embd: np.ndarray | None = None
    pos: np.ndarray | None = None
    seq_id: tuple[tuple[int, ...], ...] | None = None
    logits: np.ndarray | None = None

    def __post_init__(self) -> None:
        if (self.token is None) == (self.embd is None):
            raise BatchError("a batch holds either token ids or embeddings: give exactly one")
        if self.token is not None:
            object.__setattr__(self, "token", _int_array("token", self.token, None))
        else:
            embd = np.asarray(self.embd)
            if embd.ndim != 2 or not np.issubdtype(embd.dtype, np.floating):
                raise BatchError(f"embd must be a float array (n_tokens, n_embd), got shape "
                                 f"{embd.shape} of {embd.dtype}")
            object.__setattr__(self, "embd", embd)  # (n_tokens, n_embd)
        n_tokens = self.n_tokens
        if self.pos is not None:
            object.__setattr__(self, "pos", _int_array("pos", self.pos, n_tokens))
        if self.seq_id is not None:
            object.__setattr__(self, "seq_id", _seq_ids(self.seq_id, n_tokens))
        if self.logits is not None:
            logits = np.asarray(self.logits)
            if logits.shape != (n_tokens,) or not (
                logits.dtype == bool or np.issubdtype(logits.dtype, np.integer)
            ):
                raise BatchError(f"logits must be {n_tokens} booleans, got shape "
                                 f"{logits.shape} of {logits.dtype}")
            object.__setattr__(self, "logits", logits != 0)

    @property
    def n_tokens(self) -> int:
        """Number of entries in the batch."""
        return len(self.token) if self.token is not None else len(self.embd)

    @classmethod
    def _checked(cls, **fields) -> Batch:
        """A batch of fields that are already what construction makes of them (arrays of
        the right types and shapes, ``seq_id`` a tuple of tuples), built without checking
        them again: [`BatchAllocr`][] fills a batch it has validated on every decode."""
        batch = object.__new__(cls)
        for name, value in fields.items():
            object.__setattr__(batch, name, value)
        return batch
# --8<-- [end:Batch]


# ---------------------------------------------------------------------------------------------
# Validation: llama_batch_allocr::init, one rule per function
# ---------------------------------------------------------------------------------------------


# --8<-- [start:check_tokens]
def check_tokens(token: np.ndarray, n_vocab: int) -> None:
    """Every token id is in ``[0, n_vocab)``.

    Args:
        token: ``(n_tokens,)`` token ids.
        n_vocab: vocabulary size.

    Raises:
        BatchError: ``invalid token[i] = id``, for the first bad id.

    Examples:
        >>> check_tokens(np.array([0, 9]), n_vocab=10)
        >>> check_tokens(np.array([0, 10]), n_vocab=10)
        Traceback (most recent call last):
        ...
        reference.batch.BatchError: invalid token[1] = 10: token ids must be in [0, 10)
    """
    bad = (token < 0) | (token >= n_vocab)  # (n_tokens,)
    if bad.any():
        i = int(np.argmax(bad))  # the first bad one
        raise _invalid_token(i, int(token[i]), n_vocab)
# --8<-- [end:check_tokens]


def _invalid_token(i: int, token: int, n_vocab: int) -> BatchError:
    return BatchError(f"invalid token[{i}] = {token}: token ids must be in [0, {n_vocab})")


def _invalid_seq_id(i: int, k: int, seq_id: int, n_seq_max: int) -> BatchError:
    return BatchError(f"invalid seq_id[{i}][{k}] = {seq_id}: seq ids must be in "
                      f"[0, {n_seq_max}) (n_seq_max = {n_seq_max})")


def _negative_pos(i: int, pos: int) -> BatchError:
    return BatchError(f"pos[{i}] = {pos} is negative: positions must be >= 0 (-1 marks an "
                      f"empty KV cell)")


_POS_OVERFLOW = "pos must fit in int32 (llama_token / llama_pos are int32_t)"


# --8<-- [start:check_seq_ids]
def check_seq_ids(seq_id: tuple[tuple[int, ...], ...], n_seq_max: int) -> None:
    """Every seq id is in ``[0, n_seq_max)``, and ``n_seq_max <= LLAMA_MAX_SEQ``.

    Args:
        seq_id: per token, its seq ids.
        n_seq_max: the context's ``n_seq_max`` (``llama_n_seq_max``).

    Raises:
        BatchError: ``invalid seq_id[i][s] = id``, for the first bad id.

    Examples:
        >>> check_seq_ids(((0,), (0, 1)), n_seq_max=2)
        >>> check_seq_ids(((0,), (0, 2)), n_seq_max=2)  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        reference.batch.BatchError: invalid seq_id[1][1] = 2: seq ids must be in [0, 2) ...
    """
    _check_n_seq_max(n_seq_max)
    tok, k, sid = _flat_seq_ids(seq_id)
    bad = (sid < 0) | (sid >= n_seq_max)  # (n_entries,)
    if bad.any():
        j = int(np.argmax(bad))  # the first bad one, in batch order
        raise _invalid_seq_id(tok[j], k[j], sid[j], n_seq_max)
# --8<-- [end:check_seq_ids]


def _check_n_seq_max(n_seq_max: int) -> None:
    if n_seq_max > LLAMA_MAX_SEQ:
        raise BatchError(f"n_seq_max = {n_seq_max} > {LLAMA_MAX_SEQ} (LLAMA_MAX_SEQ)")


# --8<-- [start:fill_pos]
def fill_pos(seq_id: tuple[tuple[int, ...], ...], memory: SeqPosMemory | None) -> np.ndarray:
    """Positions for a batch given without them (``llama_batch_compat::init``).

    Each token takes the next position of its *first* sequence: a counter per sequence that
    starts at ``memory.seq_pos_max(s) + 1`` (0 without a memory) and advances only for the
    tokens whose first seq id is ``s``. A token with seq ids ``(0, 1)`` advances sequence 0's
    counter only.

    Args:
        seq_id: per token, its seq ids (already range-checked).
        memory: the memory, or None (every sequence starts at 0).

    Returns:
        ``(n_tokens,)`` int32 positions.

    Examples:
        >>> class Mem:  # sequence 0 holds positions 0..4, sequence 1 is empty
        ...     def seq_pos_min(self, s): return 0 if s == 0 else -1
        ...     def seq_pos_max(self, s): return 4 if s == 0 else -1
        >>> fill_pos(((0,), (1,), (0,), (1,), (0, 1)), Mem()).tolist()
        [5, 0, 6, 1, 7]
    """
    first = np.array([ids[0] for ids in seq_id], dtype=np.int64)  # (n_tokens,)
    pos = np.empty(len(seq_id), dtype=np.int64)  # (n_tokens,)
    for s in dict.fromkeys(first.tolist()):  # each sequence, in order of appearance
        mine = first == s  # (n_tokens,) the tokens whose first id is s
        start = (memory.seq_pos_max(s) if memory is not None else -1) + 1
        pos[mine] = start + np.arange(np.count_nonzero(mine))  # start, start + 1, ...
    if pos.size and pos.max() > POS_INF:  # the largest int32
        raise BatchError(_POS_OVERFLOW)
    return pos.astype(np.int32)
# --8<-- [end:fill_pos]


# --8<-- [start:fill_outputs]
def fill_outputs(logits: np.ndarray | None, n_tokens: int, output_all: bool) -> np.ndarray:
    """The output flags: given, else only the last token; all of them when ``output_all``.

    ``output_all`` is ``cparams.embeddings``: an embeddings context outputs every token
    (llama.cpp overrides the flags with a warning).

    Args:
        logits: ``(n_tokens,)`` bool, or None.
        n_tokens: batch size.
        output_all: force every flag on.

    Returns:
        ``(n_tokens,)`` bool.

    Examples:
        >>> fill_outputs(None, 3, output_all=False).tolist()
        [False, False, True]
        >>> fill_outputs(np.array([True, False, False]), 3, output_all=True).tolist()
        [True, True, True]
    """
    if output_all:
        return np.ones(n_tokens, dtype=bool)  # (n_tokens,)
    if logits is None:
        return np.arange(n_tokens) == n_tokens - 1  # (n_tokens,)
    return logits.copy()
# --8<-- [end:fill_outputs]


# --8<-- [start:check_positions]
def check_positions(
    seq_pos: dict[int, set[int]], memory: SeqPosMemory | None
) -> None:
    """Each sequence continues its memory, and its batch positions have no holes.

    For a sequence ``s`` with positions in the batch: when the memory holds ``s``
    (``X = memory.seq_pos_max(s) >= 0``), its smallest batch position ``Y`` must be ``X + 1``;
    an empty sequence may start anywhere. Then ``max - min + 1`` may not exceed the number
    of *distinct* positions of ``s`` (a hole); a repeated position is allowed.

    Args:
        seq_pos: ``seq_pos[s]``, the set of positions of sequence ``s`` in the batch.
        memory: the memory, or None.

    Raises:
        BatchError: inconsistent sequence positions, or positions not continuous.

    Examples:
        >>> class Mem:
        ...     def seq_pos_min(self, s): return 0
        ...     def seq_pos_max(self, s): return 4
        >>> check_positions({0: {5, 6}}, Mem())
        >>> check_positions({0: {6, 7}}, Mem())  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        reference.batch.BatchError: the tokens of sequence 0 ... X = 4, ... Y = 6; ... Y = X + 1
    """
    for s in sorted(seq_pos):
        p_min, p_max = min(seq_pos[s]), max(seq_pos[s])
        p0 = memory.seq_pos_max(s) if memory is not None else -1
        if p0 >= 0 and p_min != p0 + 1:
            raise BatchError(
                f"the tokens of sequence {s} in the input batch have inconsistent sequence "
                f"positions: the last position stored in the memory for sequence {s} is "
                f"X = {p0}, the batch starts sequence {s} at Y = {p_min}; it is required "
                f"that Y = X + 1")
        if p_max - p_min + 1 > len(seq_pos[s]):
            raise BatchError(f"sequence {s} positions are not continuous: the batch has "
                             f"{len(seq_pos[s])} distinct positions in [{p_min}, {p_max}]")
# --8<-- [end:check_positions]


# --8<-- [start:check_coupled]
def check_coupled(seq_cpl: set[tuple[int, int]], memory: SeqPosMemory | None) -> None:
    """Sequences that share a token of the batch must have the same range in memory.

    ``(s1, s0)`` in ``seq_cpl`` means a token lists ``s0`` first and ``s1`` after it
    (llama.cpp's ``seq_cpl[s1][s0]``). Both must have equal ``seq_pos_min`` and
    ``seq_pos_max`` in the memory, else they "have diverged" and one token cannot continue
    both. Checked only when there is a memory.

    Args:
        seq_cpl: the coupled pairs ``(s1, s0)``.
        memory: the memory, or None.

    Raises:
        BatchError: the first pair (by ``s1``, then ``s0``) that diverged.

    Examples:
        >>> class Mem:  # sequence 1 is one token behind sequence 0
        ...     def seq_pos_min(self, s): return 0
        ...     def seq_pos_max(self, s): return 4 - s
        >>> check_coupled({(1, 0)}, Mem())  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        reference.batch.BatchError: sequence 1 is coupled to 0 ... diverged: ... [0, 3] vs [0, 4]
    """
    if memory is None:
        return
    for s1, s0 in sorted(seq_cpl):
        r1 = (memory.seq_pos_min(s1), memory.seq_pos_max(s1))
        r0 = (memory.seq_pos_min(s0), memory.seq_pos_max(s0))
        if r1 != r0:
            raise BatchError(
                f"sequence {s1} is coupled to {s0} in the input batch, but they have diverged: "
                f"memory positions [{r1[0]}, {r1[1]}] vs [{r0[0]}, {r0[1]}]")
# --8<-- [end:check_coupled]


# --8<-- [start:check_seq_order]
def check_seq_order(seq_id: tuple[tuple[int, ...], ...], pos: np.ndarray) -> None:
    r"""In batch order, the positions of each sequence never decrease.

    With $t_1 < t_2 < \dots$ the tokens of sequence $s$ in batch order, the batch is refused
    at the first $t_{k+1}$ (in batch order, over all sequences) with
    $pos_{t_{k+1}} < pos_{t_k}$. All sequences are checked at once: the (token, seq id)
    entries are grouped by sequence, keeping batch order inside a group, and each entry is
    compared with the one before it in its group.

    llama.cpp also intersects, per sequence, the seq sets of its tokens and refuses the
    batch when the intersection becomes empty ("incompatible sequence sets"). That test
    cannot fail: every set that holds ``s`` contains ``s``, so it is not computed here; a
    test shows the example its comment calls invalid being accepted.

    Args:
        seq_id: per token, its seq ids.
        pos: ``(n_tokens,)`` positions.

    Raises:
        BatchError: ``sequence s positions are decreasing``.

    Examples:
        >>> check_seq_order(((0,), (1,), (0,)), np.array([4, 0, 5]))
        >>> check_seq_order(((0,), (0,)), np.array([5, 4]))  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        reference.batch.BatchError: sequence 0 positions are decreasing (not allowed): ...
    """
    tok, _, sid = _flat_seq_ids(seq_id)
    p = np.asarray(pos, dtype=np.int64)[tok]  # (n_entries,) the position of each entry
    # the entries grouped by sequence, batch order kept inside a group: each entry's
    # predecessor in its group is the previous token of the same sequence
    order = np.argsort(sid, kind="stable")  # (n_entries,)
    same_seq = sid[order][1:] == sid[order][:-1]  # (n_entries - 1,)
    drop = same_seq & (p[order][1:] < p[order][:-1])  # (n_entries - 1,)
    if drop.any():
        at = np.flatnonzero(drop)
        j = int(np.argmin(order[1:][at]))  # the first drop in batch order
        bad, before = order[1:][at[j]], order[:-1][at[j]]
        raise BatchError(f"sequence {sid[bad]} positions are decreasing (not allowed): "
                         f"position {p[bad]} at batch index {tok[bad]} after {p[before]}")
# --8<-- [end:check_seq_order]


# --8<-- [start:check_n_batch]
def check_n_batch(n_tokens: int, n_batch: int) -> None:
    """A batch may hold at most ``n_batch`` tokens (the logical batch size).

    ``n_batch`` bounds one ``llama_decode`` call (outputs buffers are sized for it);
    ``n_ubatch <= n_batch`` bounds one graph computation. llama.cpp *asserts* this
    (``GGML_ASSERT(n_tokens_all <= cparams.n_batch)``: the process aborts) when the batch
    comes through ``llama_decode(llama_batch)``; the reference refuses it like any other
    invalid batch (return code ``-1``).

    Args:
        n_tokens: tokens in the batch.
        n_batch: the context's ``n_batch``.

    Raises:
        BatchError: ``n_tokens > n_batch``.

    Examples:
        >>> check_n_batch(512, 512)
        >>> check_n_batch(513, 512)  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        reference.batch.BatchError: n_tokens_all = 513 > n_batch = 512: ...
    """
    if n_tokens > n_batch:
        raise BatchError(f"n_tokens_all = {n_tokens} > n_batch = {n_batch}: split the batch "
                         f"or raise n_batch")
# --8<-- [end:check_n_batch]


# --8<-- [start:fill_fields]
def fill_fields(batch: Batch, n_vocab: int, n_seq_max: int, memory: SeqPosMemory | None
                ) -> tuple[tuple[tuple[int, ...], ...], np.ndarray, dict[int, set[int]],
                           set[tuple[int, int]]]:
    """Check the ids, fill the missing ``seq_id`` and ``pos``, and gather what the memory
    rules read: [`BatchAllocr`][]'s first step.

    [`check_tokens`][], [`check_seq_ids`][], then the positions: given ones must be
    ``>= 0``, missing ones come from [`fill_pos`][]. From the (token, seq id) entries: the
    positions of each sequence and the coupled pairs.

    Returns:
        ``(seq_id, pos, seq_pos, seq_cpl)``: the filled ``seq_id`` and ``(n_tokens,)`` int32
        ``pos``; ``seq_pos[s]``, the set of positions of sequence ``s``, sequences in order
        of appearance; the coupled pairs ``(s1, s0)`` (a token lists ``s0`` first, then
        ``s1``: llama.cpp's ``seq_cpl[s1][s0]``).

    Raises:
        BatchError: the first rule broken, in that order.

    Examples:
        >>> class Mem:  # sequence 0 holds positions 0..4, sequence 1 is empty
        ...     def seq_pos_min(self, s): return 0 if s == 0 else -1
        ...     def seq_pos_max(self, s): return 4 if s == 0 else -1
        >>> seq_id, pos, seq_pos, seq_cpl = fill_fields(
        ...     Batch(token=[7, 8, 9], seq_id=[[0, 1], [1], [0]]), n_vocab=10, n_seq_max=2,
        ...     memory=Mem())
        >>> pos.tolist(), seq_pos, seq_cpl
        ([5, 0, 6], {0: {5, 6}, 1: {0, 5}}, {(1, 0)})
    """
    n_tokens = batch.n_tokens
    if batch.token is not None:
        check_tokens(batch.token, n_vocab)
    seq_id = batch.seq_id if batch.seq_id is not None else ((0,),) * n_tokens
    check_seq_ids(seq_id, n_seq_max)
    if batch.pos is not None:
        pos = batch.pos
        if pos.min() < 0:
            i = int(np.argmax(pos < 0))
            raise _negative_pos(i, int(pos[i]))
    else:
        pos = fill_pos(seq_id, memory)

    tok, k, sid = _flat_seq_ids(seq_id)
    p = pos[tok]  # (n_entries,) the position of each (token, seq id) entry
    seq_pos = {s: set(p[sid == s].tolist()) for s in dict.fromkeys(sid.tolist())}
    s0 = sid[k == 0][tok]  # (n_entries,) the first seq id of each entry's token
    seq_cpl = set(zip(sid[k > 0].tolist(), s0[k > 0].tolist(), strict=True))
    return seq_id, pos, seq_pos, seq_cpl
# --8<-- [end:fill_fields]


# --8<-- [start:fill_fields_one_token]
def fill_fields_one_token(batch: Batch, n_vocab: int, n_seq_max: int,
                          memory: SeqPosMemory | None
                          ) -> tuple[tuple[tuple[int, ...]], np.ndarray, dict[int, set[int]],
                                     set[tuple[int, int]]]:
    r"""Fast path of [`fill_fields`][] for a batch of one token (a generation step), on Python
    scalars.

    [`BatchAllocr`][] takes this path when ``n_tokens == 1``: the same checks in the same
    order, with the same messages, and the same results. For one token they are plain: its
    position, when not given, is $\mathrm{pos\_max}(s_0) + 1$ of its first sequence $s_0$;
    every sequence it lists has that one position; it couples each later seq id to $s_0$.
    (And [`check_seq_order`][] has no two tokens to compare.) Why a second path: each array
    rule costs a few NumPy calls whatever the batch size, a fixed cost that a generation
    step would pay per token, where the scalar checks cost a fraction of it
    (``docs/performance.md``). The property test
    ``tests/laws/test_batch.py::test_one_token_fields_are_the_array_rules`` holds the two
    paths equal on every one-token batch it draws, refusals included.

    Returns:
        ``(seq_id, pos, seq_pos, seq_cpl)`` as [`fill_fields`][] returns them.

    Raises:
        BatchError: the first rule the token breaks.

    Examples:
        >>> class Mem:  # sequence 0 holds positions 0..4
        ...     def seq_pos_min(self, s): return 0 if s == 0 else -1
        ...     def seq_pos_max(self, s): return 4 if s == 0 else -1
        >>> seq_id, pos, seq_pos, seq_cpl = fill_fields_one_token(
        ...     Batch(token=[7], seq_id=[[0, 1]]), n_vocab=10, n_seq_max=2, memory=Mem())
        >>> seq_id, pos.tolist(), seq_pos, seq_cpl
        (((0, 1),), [5], {0: {5}, 1: {5}}, {(1, 0)})
    """
    if batch.token is not None:
        token = int(batch.token[0])
        if not 0 <= token < n_vocab:
            raise _invalid_token(0, token, n_vocab)
    ids = batch.seq_id[0] if batch.seq_id is not None else (0,)
    _check_n_seq_max(n_seq_max)
    for k, s in enumerate(ids):
        if not 0 <= s < n_seq_max:
            raise _invalid_seq_id(0, k, s, n_seq_max)
    if batch.pos is not None:
        pos = batch.pos  # (1,)
        if pos[0] < 0:
            raise _negative_pos(0, int(pos[0]))
    else:
        p = (memory.seq_pos_max(ids[0]) if memory is not None else -1) + 1
        if p > POS_INF:
            raise BatchError(_POS_OVERFLOW)
        pos = np.array([p], dtype=np.int32)  # (1,)
    p = int(pos[0])
    return (ids,), pos, {s: {p} for s in ids}, {(s1, ids[0]) for s1 in ids[1:]}
# --8<-- [end:fill_fields_one_token]


# ---------------------------------------------------------------------------------------------
# llama_ubatch
# ---------------------------------------------------------------------------------------------


# --8<-- [start:Ubatch]
@dataclass(frozen=True, eq=False)
class Ubatch:
    """``llama_ubatch``: the tokens of one graph computation, copied out of the batch.

    Attributes:
        token: ``(n_tokens,)`` int32, or None when the batch holds embeddings.
        embd: ``(n_tokens, n_embd)`` float, or None.
        pos: ``(n_tokens,)`` int32.
        seq_id: per token, its seq ids (``n_seq_id[i] = len(seq_id[i])``).
        seq_id_unq: the distinct seq ids of the ubatch, ascending.
        output: ``(n_tokens,)`` bool, does the token output.
        idx: ``(n_tokens,)`` int, the batch index of each token (``data->batch_idxs``).
        equal_seqs: made by ``split_equal`` or ``split_seq``: ``n_seqs`` sets of
            ``n_seq_tokens`` tokens, set after set.
        n_seq_tokens: tokens per sequence set (``1`` for ``split_simple``, where
            every token counts as its own set; ``n_tokens`` for ``split_seq``).
        n_seqs: sequence sets (``n_tokens / n_seq_tokens``).

    A ubatch with ``n_tokens == 0`` means "no more tokens" (or, for ``split_equal``, "cannot
    split"; [`BatchAllocr.n_used`][] tells which).
    """

    token: np.ndarray | None
    embd: np.ndarray | None
    pos: np.ndarray
    seq_id: tuple[tuple[int, ...], ...]
    seq_id_unq: tuple[int, ...]
    output: np.ndarray
    idx: np.ndarray
    equal_seqs: bool
    n_seq_tokens: int
    n_seqs: int

    @property
    def n_tokens(self) -> int:
        """Total tokens: ``n_seq_tokens * n_seqs``."""
        return len(self.pos)
# --8<-- [end:Ubatch]


def _empty_ubatch() -> Ubatch:
    """The ``{}`` llama.cpp returns when a split has nothing (more) to give."""
    return Ubatch(token=np.empty(0, np.int32), embd=None, pos=np.empty(0, np.int32),
                  seq_id=(), seq_id_unq=(), output=np.empty(0, bool),
                  idx=np.empty(0, np.int64), equal_seqs=False, n_seq_tokens=0, n_seqs=0)


# ---------------------------------------------------------------------------------------------
# llama_batch_allocr
# ---------------------------------------------------------------------------------------------


# --8<-- [start:BatchAllocr]
class BatchAllocr:
    """``llama_batch_allocr``: a validated, filled batch and the state of its splitting.

    Construction is ``llama_batch_allocr::init`` (with ``llama_batch_compat``'s filling of
    missing fields): it fills ``pos``/``seq_id``/``logits``, checks the batch against the
    memory, and computes the per-sequence statistics. It reads the memory only through
    [`SeqPosMemory`][] and never changes it. Then ``split_reset`` followed by repeated
    ``split_simple`` / ``split_equal`` / ``split_seq`` calls cut the batch into ubatches.

    Args:
        batch: the caller's batch.
        n_vocab: vocabulary size (token ids must be below it).
        n_seq_max: the context's ``n_seq_max``.
        memory: the memory to continue (``seq_pos_min`` / ``seq_pos_max``), or None.
        output_all: an embeddings context: every token outputs.
        n_embd: the model's input width, checked against an embeddings batch; None skips.
        n_batch: the context's ``n_batch``; None skips the size check.

    Attributes:
        batch: the filled batch (``pos``, ``seq_id`` and ``logits`` never None).
        n_outputs: how many tokens output.
        seq_pos: ``seq_pos[s]``, the set of positions of sequence ``s`` in the batch.
        seq_cpl: coupled pairs ``(s1, s0)``: a token lists ``s0`` first and then ``s1``.
        seq_set: per token, its seq ids as a frozenset.
        seq_set_map: per distinct seq set, the batch indices that carry it, ascending.
        used: ``(n_tokens,)`` bool, the tokens already put in a ubatch.
        n_used: ``used.sum()``.
        out_ids: batch indices of the output tokens, in the order the splits emitted them.
        split_error: why the last split gave up early, or None.

    Raises:
        BatchError: any validation rule (the message says which); see the module docstring.

    Examples:
        >>> balloc = BatchAllocr(Batch(token=[3, 4, 5, 6], seq_id=[[0], [1], [0], [1]]),
        ...                      n_vocab=10, n_seq_max=2)
        >>> balloc.batch.pos.tolist(), balloc.n_outputs
        ([0, 0, 1, 1], 1)
        >>> balloc.split_simple(3).idx.tolist(), balloc.split_simple(3).idx.tolist()
        ([0, 1, 2], [3])
        >>> balloc.split_simple(3).n_tokens
        0
    """

    def __init__(
        self,
        batch: Batch,
        *,
        n_vocab: int,
        n_seq_max: int,
        memory: SeqPosMemory | None = None,
        output_all: bool = False,
        n_embd: int | None = None,
        n_batch: int | None = None,
    ) -> None:
        n_tokens = batch.n_tokens
        if n_tokens == 0:
            raise BatchError("n_tokens == 0: the batch is empty")
        if batch.embd is not None and n_embd is not None and batch.embd.shape[1] != n_embd:
            raise BatchError(f"embd row width {batch.embd.shape[1]} does not match the decoder "
                             f"input {n_embd}")
        # rule 1, the filled fields, and what the memory rules read (one token: on scalars)
        fill = fill_fields_one_token if n_tokens == 1 else fill_fields
        seq_id, pos, seq_pos, seq_cpl = fill(batch, n_vocab, n_seq_max, memory)
        output = fill_outputs(batch.logits, n_tokens, output_all)

        check_positions(seq_pos, memory)
        check_coupled(seq_cpl, memory)
        if n_tokens > 1:  # one token has no order to break
            check_seq_order(seq_id, pos)
        if n_batch is not None:
            check_n_batch(n_tokens, n_batch)

        # every field is checked: the filled batch is built without checking it again
        self.batch = Batch._checked(token=batch.token, embd=batch.embd, pos=pos,
                                    seq_id=seq_id, logits=output)
        self.n_seq_max = n_seq_max
        self.n_outputs = int(output.sum())
        self.seq_pos = seq_pos
        self.seq_cpl = seq_cpl
        self.has_cpl = bool(seq_cpl)
        self.seq_set = [frozenset(ids) for ids in seq_id]
        self.seq_set_map: dict[frozenset[int], list[int]] = {}
        for i, cur in enumerate(self.seq_set):
            self.seq_set_map.setdefault(cur, []).append(i)
        self.split_reset()

    @property
    def n_tokens(self) -> int:
        """Tokens in the batch (``get_n_tokens``)."""
        return self.batch.n_tokens

    @property
    def n_used(self) -> int:
        """Tokens already placed in a ubatch since ``split_reset`` (``get_n_used``)."""
        return int(self.used.sum())

    def seq_pos_min(self, seq_id: int) -> int:
        """Smallest position of ``seq_id`` in the batch, -1 if absent."""
        return min(self.seq_pos[seq_id]) if seq_id in self.seq_pos else -1

    def seq_pos_max(self, seq_id: int) -> int:
        """Largest position of ``seq_id`` in the batch, -1 if absent."""
        return max(self.seq_pos[seq_id]) if seq_id in self.seq_pos else -1

    def split_reset(self) -> None:
        """Forget the splitting so far: no token used, no output emitted."""
        self.used = np.zeros(self.n_tokens, dtype=bool)  # (n_tokens,)
        self.out_ids: list[int] = []
        self.split_error: str | None = None

    def ubatch_add(self, idxs: list[int], n_seqs: int, equal_seqs: bool) -> Ubatch:
        """Copy the batch entries ``idxs`` into a ubatch of ``n_seqs`` sequence sets.

        Records the output tokens in `out_ids`. Marking ``idxs`` as used is the
        caller's job.
        """
        b = self.batch
        ix = np.asarray(idxs, dtype=np.int64)  # (n_tokens_ubatch,)
        seq_id = tuple(b.seq_id[i] for i in idxs)
        output = b.logits[ix]  # (n_tokens_ubatch,)
        self.out_ids.extend(int(i) for i in ix[output])
        return Ubatch(
            token=b.token[ix] if b.token is not None else None,  # (n_tokens_ubatch,)
            embd=b.embd[ix] if b.embd is not None else None,  # (n_tokens_ubatch, n_embd)
            pos=b.pos[ix],  # (n_tokens_ubatch,)
            seq_id=seq_id,
            seq_id_unq=tuple(sorted({s for ids in seq_id for s in ids})),
            output=output,
            idx=ix,
            equal_seqs=equal_seqs,
            n_seq_tokens=len(idxs) // n_seqs,
            n_seqs=n_seqs,
        )
# --8<-- [end:BatchAllocr]

    # --8<-- [start:split_simple]
    def split_simple(self, n_ubatch: int) -> Ubatch:
        """The next ``n_ubatch`` unused tokens, in batch order (``split_simple``).

        No constraint on sequences: each token counts as its own sequence set
        (``n_seqs = n_tokens``, ``n_seq_tokens = 1``, ``equal_seqs = False``).

        Args:
            n_ubatch: the most tokens in one ubatch.

        Returns:
            The next ubatch; ``n_tokens == 0`` once every token is used.

        Examples:
            >>> balloc = BatchAllocr(Batch(token=[1, 2, 3, 4, 5]), n_vocab=8, n_seq_max=1)
            >>> [balloc.split_simple(2).idx.tolist() for _ in range(4)]
            [[0, 1], [2, 3], [4], []]
        """
        unused = np.flatnonzero(~self.used)
        if unused.size == 0:
            return _empty_ubatch()
        # from the first unused token on, the next n_ubatch tokens (they are all unused)
        idxs = list(range(int(unused[0]), min(int(unused[0]) + n_ubatch, self.n_tokens)))
        self.used[idxs] = True
        return self.ubatch_add(idxs, len(idxs), equal_seqs=False)
    # --8<-- [end:split_simple]

    # --8<-- [start:split_equal]
    def split_equal(self, n_ubatch: int, sequential: bool, n_keep_tail: int = 0) -> Ubatch:
        """Sequence sets side by side, the same number of tokens from each (``split_equal``).

        1. Walk the unused tokens in batch order and collect up to ``n_ubatch`` pairwise
           disjoint sequence sets (with ``sequential``, each next set must be the single
           sequence ``previous + 1``).
        2. Take one token from every set, round after round, while every set still has an
           unused token and one more round fits in ``n_ubatch``.
        3. With ``n_keep_tail > 0``, keep only the leading sets whose remaining tokens are
           0 or at least ``n_keep_tail`` (recurrent rollback), and give the others' tokens
           back.
        4. The ubatch is set 0's tokens, then set 1's, ... (``n_seqs`` sets of
           ``n_seq_tokens``), so it is *not* in batch order across sets.

        With ``sequential`` and coupled sequences (a token in several sequences) there is no
        valid split: the result is empty while tokens remain unused, which the memory
        reports as "failed to find a suitable split" (``llama_decode`` returns 1).

        llama.cpp stops collecting sets only when it holds ``n_ubatch + 1`` of them, so with
        more than ``n_ubatch`` disjoint sets its ubatch holds ``n_ubatch + 1`` tokens. The
        reference stops at ``n_ubatch`` sets (see "Divergences" in the batch chapter).

        Args:
            n_ubatch: the most tokens in one ubatch.
            sequential: sets must be consecutive single sequences (one stream per sequence).
            n_keep_tail: the trailing tokens of a sequence that must stay in one ubatch.

        Returns:
            The next ubatch; ``n_tokens == 0`` when done (or when no valid split exists).

        Examples:
            >>> b = Batch(token=[1, 2, 3, 4, 5], seq_id=[[0], [1], [0], [1], [0]])
            >>> balloc = BatchAllocr(b, n_vocab=8, n_seq_max=2)
            >>> u = balloc.split_equal(4, sequential=True)
            >>> u.idx.tolist(), u.n_seqs, u.n_seq_tokens
            ([0, 2, 1, 3], 2, 2)
            >>> balloc.split_equal(4, sequential=True).idx.tolist()
            [4]
        """
        if sequential and self.has_cpl:
            self.split_error = ("sequential split is not supported when there are coupled "
                                "sequences in the input batch (use a unified KV cache)")
            return _empty_ubatch()

        # 1. the non-overlapping sequence sets of this ubatch
        cur_seq_set: list[frozenset[int]] = []
        last_seq_id = -1
        for i in np.flatnonzero(~self.used).tolist():
            add = all(not (cur & self.seq_set[i]) for cur in cur_seq_set)
            if sequential:
                add = add and (not cur_seq_set or self.batch.seq_id[i][0] == last_seq_id + 1)
            if add:
                cur_seq_set.append(self.seq_set[i])
                last_seq_id = self.batch.seq_id[i][0]
                if len(cur_seq_set) >= n_ubatch:  # llama.cpp: > n_ubatch (see docstring)
                    break
        n_seqs = len(cur_seq_set)
        if n_seqs == 0:
            return _empty_ubatch()

        # 2. rounds of one token per set; pending[s] = the unused batch indices of set s
        pending = [[i for i in self.seq_set_map[cur] if not self.used[i]] for cur in cur_seq_set]
        idxs_per_seq: list[list[int]] = [[] for _ in range(n_seqs)]
        while all(len(idxs_per_seq[s]) < len(pending[s]) for s in range(n_seqs)):
            for s in range(n_seqs):
                idxs_per_seq[s].append(pending[s][len(idxs_per_seq[s])])
            if (len(idxs_per_seq[0]) + 1) * n_seqs > n_ubatch:
                break

        # 3. keep the trailing n_keep_tail tokens of each sequence together
        if n_keep_tail > 0:
            n_seqs = self._keep_tail(idxs_per_seq, pending, n_ubatch, n_keep_tail)
            idxs_per_seq = idxs_per_seq[:n_seqs]

        # 4. concatenate the sets
        idxs = [i for per_seq in idxs_per_seq for i in per_seq]
        self.used[idxs] = True
        return self.ubatch_add(idxs, n_seqs, equal_seqs=True)
    # --8<-- [end:split_equal]

    def _keep_tail(self, idxs_per_seq, pending, n_ubatch: int, n_keep_tail: int) -> int:
        """``split_equal``'s ``n_keep_tail`` step: how many leading sets to keep (edits set 0)."""
        if n_ubatch <= n_keep_tail:
            raise ValueError(f"n_ubatch = {n_ubatch} must exceed n_keep_tail = {n_keep_tail}")

        def n_remaining(s: int) -> int:
            return len(pending[s]) - len(idxs_per_seq[s])

        n_keep = 0
        while n_keep < len(idxs_per_seq):
            remaining = n_remaining(n_keep)
            if remaining != 0 and remaining < n_keep_tail:
                break
            n_keep += 1
        if n_keep == 0:
            # every set violates the rule: finish set 0 if it fits, else leave n_keep_tail
            first = idxs_per_seq[0]
            if len(first) + n_remaining(0) <= n_ubatch:
                first.extend(pending[0][len(first):])
            else:
                while n_remaining(0) < n_keep_tail:
                    first.pop()
            n_keep = 1
        return n_keep

    # --8<-- [start:split_seq]
    def split_seq(self, n_ubatch: int) -> Ubatch:
        """One sequence set per ubatch, narrowing to subsets (``split_seq``).

        Start at the first unused token with its seq set $S$; walk on in batch order and
        take every unused token whose seq set is a subset of $S$, and let $S$ become that
        token's set. Up to ``n_ubatch`` tokens; ``n_seqs = 1``.

        Args:
            n_ubatch: the most tokens in one ubatch.

        Returns:
            The next ubatch; ``n_tokens == 0`` once every token is used.

        Examples:
            >>> b = Batch(token=[1, 2, 3, 4, 5], pos=[0, 1, 2, 2, 3],
            ...           seq_id=[[0, 1], [0, 1], [0], [1], [0]])
            >>> balloc = BatchAllocr(b, n_vocab=8, n_seq_max=2)
            >>> [balloc.split_seq(8).idx.tolist() for _ in range(3)]
            [[0, 1, 2, 4], [3], []]
        """
        unused = np.flatnonzero(~self.used)
        if unused.size == 0:
            return _empty_ubatch()
        cur_idx = int(unused[0])
        cur_seq_set = self.seq_set[cur_idx]
        idxs = [cur_idx]
        self.used[cur_idx] = True
        for i in range(cur_idx + 1, self.n_tokens):
            if len(idxs) >= n_ubatch:
                break
            if self.used[i] or not self.seq_set[i] <= cur_seq_set:
                continue
            idxs.append(i)
            self.used[i] = True
            cur_seq_set = self.seq_set[i]
        return self.ubatch_add(idxs, 1, equal_seqs=True)
    # --8<-- [end:split_seq]


# ---------------------------------------------------------------------------------------------
# Outputs: from split order back to batch order
# ---------------------------------------------------------------------------------------------


# --8<-- [start:output_ids]
def output_ids(out_ids: Sequence[int], n_tokens: int) -> np.ndarray:
    """Row of each batch token in the batch-ordered outputs, -1 for non-output tokens.

    The model writes one logits row per output token, ubatch after ubatch, in the order of
    ``out_ids``. ``llama_context::decode`` then sorts the rows by batch index (a selection
    sort whose swaps it applies lazily), so the final row of batch index ``i`` is the number
    of output tokens before ``i``: ``output_ids[i]``. ``get_logits_ith(i)`` reads that row.

    Args:
        out_ids: batch indices of the output tokens, in split order.
        n_tokens: tokens in the batch.

    Returns:
        ``(n_tokens,)`` int, the output row of each token or -1.

    Examples:
        >>> output_ids([2, 0, 3], n_tokens=5).tolist()
        [0, -1, 1, 2, -1]
    """
    ids = np.full(n_tokens, -1, dtype=np.int64)  # (n_tokens,)
    ids[np.sort(np.asarray(out_ids, dtype=np.int64))] = np.arange(len(out_ids))
    return ids
# --8<-- [end:output_ids]


# --8<-- [start:output_order]
def output_order(out_ids: Sequence[int]) -> np.ndarray:
    """The permutation that puts rows written in split order into batch order.

    Args:
        out_ids: batch indices of the output tokens, in split order.

    Returns:
        ``(n_outputs,)`` int: ``rows_in_batch_order = rows_in_split_order[perm]``.

    Examples:
        >>> out_ids = [2, 0, 3]
        >>> rows = np.array(["row of 2", "row of 0", "row of 3"])
        >>> rows[output_order(out_ids)].tolist()
        ['row of 0', 'row of 2', 'row of 3']
    """
    return np.argsort(np.asarray(out_ids, dtype=np.int64), kind="stable")
# --8<-- [end:output_order]
