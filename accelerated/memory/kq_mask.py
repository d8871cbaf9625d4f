r"""Twin of [`reference.memory.kq_mask`][reference.memory.kq_mask]: the KQ mask built by MLX.

The rule and its host-side fast path are the reference's, imported
([`set_input_kq_mask`][reference.memory.kq_mask.set_input_kq_mask],
[`set_input_kq_mask_fast`][reference.memory.kq_mask.set_input_kq_mask_fast] and its helpers).
What differs is where the mask is made: on the device, inside the Context's compiled graph.

- [`kq_mask_device`][] evaluates the rule's formula in MLX on what the host gathers, the
  positions of the cells in view and whether each holds the token's sequence
  ([`KVCacheAttnInput.kq_mask_inputs`][accelerated.memory.kv_cache.KVCacheAttnInput.kq_mask_inputs]);
- [`prefix_inputs_device`][] makes a generation step's mask (and its cache rows) from two
  integers when the host's fast path says the token sees exactly the first $u$ cells
  ([`visible_prefix`][reference.memory.kq_mask.visible_prefix]).

``tests/twin/test_kq_mask.py`` holds both to the reference's mask, and the Context's logits
with and without the prefix form bit for bit.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from reference.hparams import is_masked_swa
from reference.memory.kq_mask import (  # bookkeeping, imported as it is
    holds_every_used_cell,
    set_input_kq_mask,
    set_input_kq_mask_fast,
    visible_prefix,
)

__all__ = [
    "holds_every_used_cell",
    "kq_mask_device",
    "prefix_inputs_device",
    "set_input_kq_mask",
    "set_input_kq_mask_fast",
    "visible_prefix",
]


# --8<-- [start:kq_mask_device]
def kq_mask_device(p_cell: mx.array, member: mx.array, pos: mx.array, n_swa: int,
                   swa_type: int) -> mx.array:
    r"""The KQ mask of
    [`reference.memory.kq_mask.set_input_kq_mask`][reference.memory.kq_mask.set_input_kq_mask],
    computed by MLX.

    The same formula, term for term, on what the host gathered
    ([`KVCacheAttnInput.kq_mask_inputs`][accelerated.memory.kv_cache.KVCacheAttnInput.kq_mask_inputs]):

    $$
    \mathrm{visible}_{ij} = member_{ij} \;\wedge\; pos_j \ne -1 \;\wedge\; pos_j \le p_i
    \;\wedge\; \neg\,\mathrm{is\_masked\_swa}(pos_j, p_i),
    $$

    where $member_{ij}$ says that column $j$'s cell is in token $i$'s stream and holds its
    (first) sequence. Its inputs are placeholders of the Context's compiled graph: on a GPU
    the mask never exists on the host. Positions are int32 here (llama.cpp's
    ``llama_pos``). ``tests/twin/test_kq_mask.py`` holds it equal to the reference's mask
    on random cell states.

    Args:
        p_cell: ``(n_cols,)`` int32, the position of each column's cell (-1: empty).
        member: ``(n_tokens, n_cols)`` bool.
        pos: ``(n_tokens,)`` int32, the tokens' positions.
        n_swa: sliding window (0: none).
        swa_type: one of ``SWA_TYPE_*``.

    Returns:
        ``(n_tokens, n_cols)`` float32: 0 where visible, $-\infty$ elsewhere.

    Examples:
        >>> p_cell = mx.array([0, 0, 1, -1])
        >>> member = mx.array([[True, False, True, False]])
        >>> kq_mask_device(p_cell, member, mx.array([1]), 0, 0).tolist()
        [[0.0, -inf, 0.0, -inf]]
    """
    p_c = p_cell[None, :]  # (1, n_cols)
    p_t = pos[:, None]  # (n_tokens, 1)
    swa = mx.array(is_masked_swa(n_swa, swa_type, p_c, p_t))  # (n_tokens, n_cols) or ()
    visible = member & (p_c != -1) & (p_c <= p_t) & mx.logical_not(swa)
    return mx.where(visible, mx.array(0.0, mx.float32), mx.array(-mx.inf, mx.float32))
# --8<-- [end:kq_mask_device]


# --8<-- [start:prefix_inputs_device]
def prefix_inputs_device(slot: mx.array, n_cols: int, kv_size: int,
                         n_head_kv: int) -> tuple[mx.array, mx.array]:
    r"""A one-token ubatch's cache rows and KQ mask, from two integers, when its mask is a
    prefix.

    ``slot`` is $[r_0, u]$: the row of the token's first head in a cache tensor seen as rows
    of $d$ (``head_rows(k_idxs, ...)[0, 0]``) and the number of first cells it sees, when it
    sees exactly those ([`visible_prefix`][reference.memory.kq_mask.visible_prefix]: a
    generation step in one conversation). Head $h$'s row is
    [`head_rows`][accelerated.memory.kv_cache.head_rows]'s
    $(s \cdot n\_head\_kv + h) \cdot kv\_size + c = r_0 + h \cdot kv\_size$, and the mask is
    $\mathrm{visible}_j = j < u$: the values [`kq_mask_device`][] makes from the cells, made
    in the graph from the two integers. So a generation step hands the device one array of
    two integers where the cells' form hands it the position of every cell in view, their
    membership and the token's rows.

    Args:
        slot: ``(2,)`` int32, $[r_0, u]$.
        n_cols: cells in view (one stream).
        kv_size: cells per stream.
        n_head_kv: KV heads.

    Returns:
        ``k_rows`` ``(1, n_head_kv)`` int32 and ``kq_mask`` ``(1, n_cols)`` float32.

    Examples:
        >>> rows, mask = prefix_inputs_device(mx.array([10, 3]), 5, kv_size=4, n_head_kv=2)
        >>> rows.tolist(), mask.tolist()  # stream 1, cell 2: head_rows gives [[10, 14]]
        ([[10, 14]], [[0.0, 0.0, 0.0, -inf, -inf]])
    """
    # the offsets of the heads and the column indices are constants of a traced graph
    # (NumPy-made, so no node computes them at each step); slices, not an index (a gather)
    heads = mx.array(np.arange(n_head_kv, dtype=np.int32) * kv_size)  # (n_head_kv,) h * kv_size
    k_rows = (slot[:1] + heads)[None, :]  # (1, n_head_kv)
    visible = mx.array(np.arange(n_cols, dtype=np.int32)) < slot[1:]  # (n_cols,)
    kq_mask = mx.where(visible, mx.array(0.0, mx.float32), mx.array(-mx.inf, mx.float32))
    return k_rows, kq_mask[None, :]  # (1, n_cols)
# --8<-- [end:prefix_inputs_device]
