r"""The KQ mask of a ubatch: ``llama_kv_cache::set_input_kq_mask`` (``src/llama-kv-cache.cpp``).

The mask says which cells of the cache each token of a ubatch may attend to: 0 where token
$i$ sees cell $j$, $-\infty$ where it does not (the softmax turns $-\infty$ into a weight of
exactly 0). Token $i$ at position $p_i$, whose *first* sequence id is $s_i$
(``seq_id[i][0]``, as llama.cpp), sees cell $j$ of its stream iff

$$
\mathrm{visible}_{ij} = pos_j \ne -1 \;\wedge\; seq_{j, s_i} \;\wedge\; pos_j \le p_i
\;\wedge\; \neg\,\mathrm{is\_masked\_swa}(pos_j, p_i):
$$

the cell is not empty, holds the token's sequence, comes at or before it (causal), and is
inside the sliding window when the cache has one
([`is_masked_swa`][reference.hparams.is_masked_swa]). The columns are the first ``n_kv``
cells of each stream of the ubatch's slot, block after block; a token sees nothing in
another stream's block.

[`set_input_kq_mask`][] is that rule, one token and one cell at a time: the statement to
read. [`set_input_kq_mask_fast`][] is its fast path, the one the cache calls
([`reference.memory.kv_cache.KVCacheAttnInput`][reference.memory.kv_cache.KVCacheAttnInput]):
the formula as one array expression per stream, which leaves out each term that is true for
every cell, and with no pass over the cells at all for a generation step in one
conversation ([`visible_prefix`][]). A property test holds the two equal on random cell
states (``tests/laws/test_kq_mask.py``).
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np
from numpy.typing import DTypeLike

from reference.hparams import SWA_TYPE_NONE, is_masked_swa
from reference.memory.kv_cells import KVCells


# --8<-- [start:set_input_kq_mask]
def set_input_kq_mask(
    v_cells: list[KVCells],
    seq_to_stream: list[int],
    pos: np.ndarray,
    seq_id: tuple[tuple[int, ...], ...],
    strm: tuple[int, ...],
    n_kv: int,
    n_swa: int,
    swa_type: int,
    dtype: DTypeLike = np.float32,
) -> np.ndarray:
    r"""The KQ mask of a ubatch: 0 where token $i$ may attend to a cell, $-\infty$ elsewhere.

    ``llama_kv_cache::set_input_kq_mask``, one token and one cell at a time: token $i$ sees
    cell $j$ of its stream iff the cell is not empty, holds the token's first sequence
    $s_i$, has $pos_j \le p_i$ and is not hidden by the window (the module docstring's
    formula). This is llama.cpp's loop, without its reuse of the previous row of the same
    sequence. The cache calls its fast path, [`set_input_kq_mask_fast`][].

    Args:
        v_cells: the cells of every stream.
        seq_to_stream: stream of each sequence id.
        pos: positions of the ubatch ``(n_tokens,)``.
        seq_id: sequence ids of each token.
        strm: the streams of the ubatch's slot
            ([`SlotInfo.strm`][reference.memory.kv_cache.SlotInfo]).
        n_kv: cells per stream in view
            ([`KVCache.get_n_kv`][reference.memory.kv_cache.KVCache.get_n_kv]).
        n_swa: sliding window (0: none).
        swa_type: one of ``SWA_TYPE_*``.
        dtype: mask dtype.

    Returns:
        The mask ``(n_tokens, len(strm) * n_kv)``: stream ``strm[b]``'s cells are columns
        ``b * n_kv`` to ``(b + 1) * n_kv - 1``.

    Examples:
        >>> cells = KVCells(3)
        >>> for i, (p, s) in enumerate([(0, 0), (0, 1), (1, 0)]):
        ...     cells.pos_set(i, p); cells.seq_add(i, s)
        >>> set_input_kq_mask([cells], [0, 0], np.array([1, 1]), ((0,), (1,)), (0,), 3, 0, 0)
        array([[  0., -inf,   0.],
               [-inf,   0., -inf]], dtype=float32)
    """
    n_tokens = len(pos)
    mask = np.full((n_tokens, len(strm) * n_kv), -np.inf, dtype=dtype)  # (n_tokens, ns * n_kv)
    for i in range(n_tokens):
        s_i = seq_id[i][0]
        p_i = int(pos[i])
        block = strm.index(seq_to_stream[s_i])
        cells = v_cells[seq_to_stream[s_i]]
        for j in range(n_kv):
            if cells.is_empty(j) or not cells.seq_has(j, s_i):
                continue
            p_j = cells.pos_get(j)
            if p_j > p_i or is_masked_swa(n_swa, swa_type, p_j, p_i):
                continue
            mask[i, block * n_kv + j] = 0.0
    return mask
# --8<-- [end:set_input_kq_mask]


# --8<-- [start:set_input_kq_mask_fast]
def set_input_kq_mask_fast(
    v_cells: list[KVCells],
    seq_to_stream: list[int],
    pos: np.ndarray,
    seq_id: tuple[tuple[int, ...], ...],
    strm: tuple[int, ...],
    n_kv: int,
    n_swa: int,
    swa_type: int,
    dtype: DTypeLike = np.float32,
) -> np.ndarray:
    r"""Fast path of [`set_input_kq_mask`][]: the same mask, one array expression per stream.

    Each block of the mask is the rule's formula over the arrays of its cells, for all
    tokens at once ([`is_masked_swa`][reference.hparams.is_masked_swa] is written with
    operators that work elementwise on arrays). A term that is true for every cell is left
    out, since each is a pass over the block:

    - the token's own stream, when every token is in the block's stream (one stream: always);
    - $seq_{j, s_i}$, when each token's sequence holds every used cell of the stream
      ([`holds_every_used_cell`][]: one conversation), where it is $pos_j \ne -1$;
    - then also $pos_j \le p_i$, when no token comes before the last position of its
      sequence (a generation step: the cell's position is at most that last position, which
      ``seq_pos_max`` gives in O(1));
    - the window, when there is none.

    When all of those are left out, the window hides no cell and no cell before the last
    used one is empty, the block is $u$ zeros then $-\infty$ ([`visible_prefix`][]: a
    generation step in one conversation), made with no pass over the cells at all.

    ``tests/laws/test_kq_mask.py::test_set_input_kq_mask_fast_is_the_rule`` holds it equal
    to the rule on random cell states: every window type, tokens of several sequences,
    several streams, both dtypes. Same arguments and result as [`set_input_kq_mask`][].

    Examples:
        >>> cells = KVCells(3)
        >>> for i, (p, s) in enumerate([(0, 0), (0, 1), (1, 0)]):
        ...     cells.pos_set(i, p); cells.seq_add(i, s)
        >>> args = ([cells], [0, 0], np.array([1, 1]), ((0,), (1,)), (0,), 3, 0, 0)
        >>> set_input_kq_mask_fast(*args)
        array([[  0., -inf,   0.],
               [-inf,   0., -inf]], dtype=float32)
        >>> bool(np.array_equal(set_input_kq_mask_fast(*args), set_input_kq_mask(*args)))
        True
    """
    s_tok = np.array([ids[0] for ids in seq_id], dtype=np.int64)  # (n_tokens,)
    p_tok = np.asarray(pos, dtype=np.int64)[:, None]  # (n_tokens, 1)
    stream_tok = np.asarray(seq_to_stream)[s_tok]  # (n_tokens,)
    zero, minus_inf = np.dtype(dtype).type(0), np.dtype(dtype).type(-np.inf)
    blocks = []
    for stream in strm:
        cells = v_cells[stream]
        own = stream_tok == stream  # (n_tokens,): the token is in this block's stream
        u = visible_prefix(cells, s_tok, p_tok[:, 0], n_swa, swa_type) if own.all() else None
        if u is not None:  # every token sees the first u cells: no pass over the cells
            block = np.full((len(s_tok), n_kv), minus_inf, dtype=dtype)  # (n_tokens, n_kv)
            block[:, :u] = zero
            blocks.append(block)
            continue
        p_cell = cells.pos[None, :n_kv]  # (1, n_kv)
        holds_all = holds_every_used_cell(cells, s_tok)  # s_i holds every non-empty cell
        visible = p_cell != -1  # (1, n_kv)
        last = max(cells.seq_pos_max(s) for s in set(s_tok.tolist()))  # the sequences' last
        if not (holds_all and p_tok.min() >= last):  # else: every non-empty cell is at or before
            visible = visible & (p_cell <= p_tok)  # (n_tokens, n_kv)
        if not own.all():
            visible = visible & own[:, None]
        if not holds_all:  # else: the cell holds s_i iff it is not empty
            visible = visible & cells.seq[:n_kv, s_tok].T  # the cell holds s_i
        if swa_type != SWA_TYPE_NONE:
            visible = visible & ~np.asarray(is_masked_swa(n_swa, swa_type, p_cell, p_tok))
        visible = np.broadcast_to(visible, (len(s_tok), n_kv))  # (n_tokens, n_kv)
        blocks.append(np.where(visible, zero, minus_inf))  # in dtype
    return blocks[0] if len(blocks) == 1 else np.concatenate(blocks, axis=1)
# --8<-- [end:set_input_kq_mask_fast]


# --8<-- [start:holds_every_used_cell]
def holds_every_used_cell(cells: KVCells, seq_ids: Iterable[int]) -> bool:
    r"""Fast path of [`set_input_kq_mask`][]'s membership term: whether each sequence of
    ``seq_ids`` holds every used cell of ``cells``.

    Then, for those sequences, "cell $j$ holds $s$" is "cell $j$ is not empty", and the mask
    need not read $s$'s column of the membership matrix (the matrix is cells by
    ``LLAMA_MAX_SEQ``: a column is one byte from each of ``n_kv`` rows, the slowest part of
    a one-token mask at depth). O(1) per sequence: the count of its ``seq_pos`` pairs
    against ``get_used()``. [`set_input_kq_mask_fast`][] and the MLX twin's mask inputs use
    it; ``tests/laws/test_kq_mask.py::test_holding_every_used_cell_means_not_empty`` holds
    the two statements equal.

    Examples:
        >>> cells = KVCells(4)
        >>> for i in range(3):
        ...     cells.pos_set(i, i); cells.seq_add(i, 0)
        >>> cells.seq_add(1, 1)
        >>> holds_every_used_cell(cells, [0]), holds_every_used_cell(cells, [0, 1])
        (True, False)
    """
    n_used = cells.get_used()
    return all(len(cells.seq_pos[s]) == n_used for s in set(np.asarray(seq_ids).tolist()))
# --8<-- [end:holds_every_used_cell]


# --8<-- [start:visible_prefix]
def visible_prefix(cells: KVCells, s_tok: np.ndarray, p_tok: np.ndarray, n_swa: int,
                   swa_type: int) -> int | None:
    r"""Fast path of [`set_input_kq_mask`][] for a generation step: $u$ when every token
    sees exactly the first $u$ cells of ``cells``; else None.

    The mask of a generation step in one conversation, which is most of the masks a
    program builds, has this form. Token $i$ of sequence $s_i$ at position $p_i$ (the
    tokens of one stream) sees cell $j$ iff it is not empty, holds $s_i$, comes at or
    before $p_i$ and is not hidden by the window. When

    1. each $s_i$ holds every used cell ([`holds_every_used_cell`][]), "holds $s_i$" is
       "not empty";
    2. no token comes before the last position of the sequences, every used cell is at or
       before $p_i$;
    3. the window of the last token keeps the sequences' first position, every window
       keeps every used cell: each window type hides a cell by its distance $p_i - pos_j$
       (one side of a bound: ``is_masked_swa``), and no distance is larger than that one;
    4. no cell before the last used one is empty (``get_used() == used_max_p1()``: no hole
       left by a removal), the non-empty cells are the first $u$ = ``used_max_p1``;

    then $\mathrm{visible}_{ij} = j < u$ for every token: one integer says the whole mask.
    O(1): each test reads counts that the cells keep.
    ``tests/laws/test_kq_mask.py::test_a_visible_prefix_is_the_mask_of_the_rule`` holds $u$
    to the rule on conversations at and near this form.

    Args:
        cells: the cells of the tokens' stream.
        s_tok: the first sequence id of each token ``(n_tokens,)``.
        p_tok: the position of each token ``(n_tokens,)``.
        n_swa: sliding window (0: none).
        swa_type: one of ``SWA_TYPE_*``.

    Returns:
        $u$, or None when the visible cells are not the same first cells for every token.

    Examples:
        >>> cells = KVCells(8)
        >>> for i in range(3):
        ...     cells.pos_set(i, i); cells.seq_add(i, 0)
        >>> visible_prefix(cells, np.array([0]), np.array([2]), 0, SWA_TYPE_NONE)
        3
        >>> visible_prefix(cells, np.array([0]), np.array([1]), 0, SWA_TYPE_NONE)  # before 2
        >>> visible_prefix(cells, np.array([0]), np.array([2]), 2, 1)  # a window of 2 (standard)
        >>> cells.rm(1)  # a hole
        >>> visible_prefix(cells, np.array([0]), np.array([2]), 0, SWA_TYPE_NONE)
    """
    n_used = cells.get_used()
    if n_used != cells.used_max_p1():  # 4
        return None
    seqs = set(np.asarray(s_tok).tolist())
    if not holds_every_used_cell(cells, seqs):  # 1
        return None
    if n_used == 0:  # no cell: nothing to see
        return 0
    # every sequence holds the same cells (1), so the same first and last position
    first, last = cells.seq_pos_min(min(seqs)), cells.seq_pos_max(min(seqs))
    p = np.asarray(p_tok).tolist()
    # 3: the last token is the farthest from the first position, so checked alone
    if min(p) < last or is_masked_swa(n_swa, swa_type, first, max(p)):  # 2, 3
        return None
    return n_used
# --8<-- [end:visible_prefix]
