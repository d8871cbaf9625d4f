"""Twin of [`reference.memory.kv_cache`][reference.memory.kv_cache]: ``llama_kv_cache`` with MLX K/V
tensors.

[`KVCache`][] *is* the reference's cache (a subclass): the cells, streams, slot search,
``seq_*`` operations, the memory interface (``init_batch``, ``prepare``, ``apply_ubatch``,
``remove_ubatch``, ``update``) and the state methods are inherited unchanged. What differs
is the array steps they call:

- ``k_l[il]`` / ``v_l[il]`` are ``mx.array`` laid out **head by head**,
  ``(n_stream, n_head_kv, kv_size, d)``, where the reference (and llama.cpp) keeps one row per
  cell with the heads side by side, ``(n_stream, kv_size, n_head_kv * d)``: the attention reads
  each KV head's keys as one contiguous ``(n_kv, d)`` block, a matrix MLX's matmul takes as it
  is, where a head's strided slice of the cell rows is first copied (the copy cost a fifth of
  the attention at 16k cells; ``docs/performance.md``). ``get_k``/``get_v`` still return the
  reference's ``(n_kv, n_head_kv, d)`` shape, as a transposed view ([`to_head_major`][] and
  [`to_cell_major`][] convert whole tensors, [`head_rows`][] says where a cell's heads go).
  MLX arrays are values, so a write replaces the list entry (``k_l[il] = ...``) instead of
  writing through a NumPy view;
- the KQ mask is built on the device
  ([`kq_mask_device`][accelerated.memory.kq_mask.kq_mask_device]): the host gathers what the
  formula reads, the positions of the cells in view and whether each holds the token's
  sequence ([`KVCacheAttnInput.kq_mask_inputs`][]), and MLX evaluates the formula of
  [`reference.memory.kq_mask.set_input_kq_mask`][reference.memory.kq_mask.set_input_kq_mask] on
  them, inside the Context's compiled graph; ``get_k``/``get_v`` slice the MLX tensors;
- [`GraphAttnInput`][] is the same input as a *value*: it holds its own list of K/V
  tensors (graph placeholders when the forward is traced), so a compiled forward takes the
  cache tensors in and gives the written ones back ([`accelerated.context`][accelerated.context]);
- the K-shift of ``update`` ([`KVCache.apply_k_shift`][]) is [`build_rope_shift`][] on
  MLX (``accelerated.ops.rope_ext``), applied to the shifted rows with one scatter per
  layer; a stream copy ([`KVCache.copy_stream`][]) replaces the stream in each tensor;
- [`KVCache.on_host`][] gives the reference's state functions NumPy tensors for the
  duration, so a blob written by either cache restores in the other.

The tensors compute in float32 (MLX's CPU float64 support is partial): a ``dtype`` of
float64 is stored as float32; float16/bfloat16 are kept.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import mlx.core as mx
import numpy as np
from numpy.typing import DTypeLike

from accelerated.memory.kq_mask import kq_mask_device
from accelerated.ops import rope_ext, set_rows
from accelerated.ops.convert import mx_dtype
from reference.hparams import LlamaHParams
from reference.memory import kv_cache as ref
from reference.memory.kq_mask import holds_every_used_cell, visible_prefix
from reference.memory.kv_cache import (  # bookkeeping, imported as it is
    FIND_CHUNK,
    POS_INF,
    KVCacheError,
    SlotInfo,
    cache_layers,
    ggml_pad,
    k_shift_rope_params,
    kv_size_swa,
    n_ctx_seq,
)

__all__ = [
    "FIND_CHUNK",
    "POS_INF",
    "KVCache",
    "KVCacheAttnInput",
    "KVCacheError",
    "GraphAttnInput",
    "SlotInfo",
    "build_rope_shift",
    "cache_layers",
    "ggml_pad",
    "head_major_blocks",
    "head_major_view",
    "head_rows",
    "k_shift_rope_params",
    "kv_size_swa",
    "n_ctx_seq",
    "to_cell_major",
    "to_head_major",
]

# --8<-- [start:head_major]
def to_head_major(t: np.ndarray | mx.array, n_head_kv: int, dtype: mx.Dtype) -> mx.array:
    """The reference's K or V tensor ``(n_stream, kv_size, n_head_kv * d)`` in the twin's
    layout ``(n_stream, n_head_kv, kv_size, d)``, contiguous.

    Examples:
        >>> t = np.arange(12.0).reshape(1, 3, 4)  # 3 cells, 2 heads of 2
        >>> to_head_major(t, 2, mx.float32)[0, 1].tolist()  # head 1 of each cell
        [[2.0, 3.0], [6.0, 7.0], [10.0, 11.0]]
    """
    n_stream, kv_size, _ = t.shape
    t = mx.array(t).astype(dtype).reshape(n_stream, kv_size, n_head_kv, -1)
    return mx.contiguous(t.transpose(0, 2, 1, 3))  # (n_stream, n_head_kv, kv_size, d)


def to_cell_major(t: mx.array, dtype: DTypeLike) -> np.ndarray:
    """The inverse of [`to_head_major`][]: NumPy ``(n_stream, kv_size, n_head_kv * d)``.

    Examples:
        >>> t = np.arange(12.0).reshape(1, 3, 4)
        >>> bool((to_cell_major(to_head_major(t, 2, mx.float32), np.float64) == t).all())
        True
    """
    n_stream, n_head_kv, kv_size, d = t.shape
    rows = t.transpose(0, 2, 1, 3).reshape(n_stream, kv_size, n_head_kv * d)
    return np.array(rows).astype(dtype)


def head_rows(k_idxs: np.ndarray, kv_size: int, n_head_kv: int) -> np.ndarray:
    r"""Where the heads of a cell go in a head-major tensor seen as rows of ``d``.

    Token $i$ is stored in global row ``k_idxs[i]`` $= s \cdot kv\_size + c$ (stream $s$, cell
    $c$; the reference's [`KVCacheAttnInput`][] index); in ``t.reshape(-1, d)`` of a
    ``(n_stream, n_head_kv, kv_size, d)`` tensor its head $h$ is row
    $(s \cdot n\_head\_kv + h) \cdot kv\_size + c$. Host bookkeeping (NumPy): the compiled
    graph gets the rows as an input ([`GraphAttnInput`][]).

    Args:
        k_idxs: ``(n_tokens,)`` global rows.
        kv_size: cells per stream.
        n_head_kv: KV heads.

    Returns:
        ``(n_tokens, n_head_kv)`` row indices.

    Examples:
        >>> head_rows(np.array([1, 6]), kv_size=4, n_head_kv=2).tolist()  # cell 1; stream 1 cell 2
        [[1, 5], [10, 14]]
    """
    k_idxs = np.asarray(k_idxs)
    stream, cell = k_idxs // kv_size, k_idxs % kv_size  # (n_tokens,) each
    heads = np.arange(n_head_kv)[None, :]  # (1, n_head_kv)
    return (stream[:, None] * n_head_kv + heads) * kv_size + cell[:, None]  # (n_tokens, n_head_kv)


def head_major_view(t: mx.array, strm: tuple[int, ...], n_kv: int) -> mx.array:
    """The first ``n_kv`` cells of streams ``strm`` in the reference's shape, without a copy.

    ``t[s, :, :n_kv]`` is each head's contiguous block ``(n_head_kv, n_kv, d)``; the
    transpose to ``(n_kv, n_head_kv, d)`` is a view, which the attention transposes back,
    so its matmuls read the blocks as they are. Several streams are concatenated (a copy,
    as in the reference).

    Examples:
        >>> t = mx.arange(16.0).reshape(1, 2, 4, 2)  # 1 stream, 2 heads, 4 cells, d = 2
        >>> head_major_view(t, (0,), 2).tolist()  # cells 0 and 1, both heads
        [[[0.0, 1.0], [8.0, 9.0]], [[2.0, 3.0], [10.0, 11.0]]]
    """
    if len(strm) == 1:
        block = t[strm[0], :, :n_kv]  # (n_head_kv, n_kv, d)
    else:
        block = mx.concatenate([t[s, :, :n_kv] for s in strm], axis=1)  # (n_head_kv, ns*n_kv, d)
    return block.transpose(1, 0, 2)  # (ns * n_kv, n_head_kv, d)


def head_major_blocks(t: mx.array, strm: tuple[int, ...], n_kv: int) -> mx.array:
    """The first ``n_kv`` cells of streams ``strm`` as the cache holds them, heads first:
    ``(len(strm), n_head_kv, n_kv, d)``.

    One stream, or several in a row, is a slice of the cache: one graph node, where
    [`head_major_view`][] and the attention's turn back take up to five (a slice, a squeeze,
    a transpose, and the attention's reshape and transpose). Other streams are concatenated.

    Examples:
        >>> t = mx.arange(16.0).reshape(1, 2, 4, 2)  # 1 stream, 2 heads, 4 cells, d = 2
        >>> head_major_blocks(t, (0,), 2).tolist()  # cells 0 and 1 of each head
        [[[[0.0, 1.0], [2.0, 3.0]], [[8.0, 9.0], [10.0, 11.0]]]]
        >>> mx.array_equal(head_major_blocks(t, (0,), 2)[0].transpose(1, 0, 2),
        ...                head_major_view(t, (0,), 2)).item()
        True
    """
    first = strm[0]
    if strm == tuple(range(first, first + len(strm))):
        return t[first:first + len(strm), :, :n_kv]  # (ns, n_head_kv, n_kv, d): a view
    return mx.concatenate([t[s:s + 1, :, :n_kv] for s in strm], axis=0)  # (ns, hkv, n_kv, d)
# --8<-- [end:head_major]


# --8<-- [start:build_rope_shift]
def build_rope_shift(
    k: mx.array, shift: np.ndarray, hparams: LlamaHParams, rope_factors: mx.array | None = None,
    il: int | None = None,
) -> mx.array:
    """Twin of
    [`reference.memory.kv_cache.build_rope_shift`][reference.memory.kv_cache.build_rope_shift].
    ``rope_ext`` on MLX.

    Args:
        k: keys of the cells ``(n_cells, n_head_kv, n_embd_head_k)``.
        shift: the shift of each cell ``(n_cells,)``.
        hparams: the model's hyperparameters.
        rope_factors: the model's ``rope_freqs.weight`` or None.
        il: the layer, for its RoPE base and scale (None: the non-SWA values).

    Returns:
        The turned keys, same shape.

    Examples:
        >>> from reference.testing import tiny_hparams
        >>> from reference.hparams import rope_cparams
        >>> hp = tiny_hparams(n_embd=8, n_head=2, n_head_kv=1)
        >>> k = np.random.default_rng(0).normal(size=(1, 1, 4)).astype(np.float32)
        >>> kp = rope_ext(k, np.array([3]), rope_cparams(hp))
        >>> k5 = rope_ext(k, np.array([5]), rope_cparams(hp))
        >>> bool(mx.allclose(build_rope_shift(kp, np.array([2]), hp), k5, atol=1e-6))
        True
    """
    if rope_factors is not None:
        rope_factors = mx.array(rope_factors)
    return rope_ext(k, np.asarray(shift), k_shift_rope_params(hparams, il), rope_factors)
# --8<-- [end:build_rope_shift]


# --8<-- [start:KVCacheAttnInput]
class KVCacheAttnInput(ref.KVCacheAttnInput):
    """Twin of
    [`reference.memory.kv_cache.KVCacheAttnInput`][reference.memory.kv_cache.KVCacheAttnInput] on
    MLX tensors.

    ``n_kv`` and ``k_idxs`` are the reference's (host bookkeeping). The mask is built on the
    device ([`kq_mask_device`][accelerated.memory.kq_mask.kq_mask_device]) from
    [`kq_mask_inputs`][], when it is first asked for:
    the Context's graph builds its own from those inputs for the narrower view it reads
    ([`accelerated.context.kv_view`][accelerated.context.kv_view]), so then the full-width mask is
    never made. ``cpy_k``/``cpy_v`` scatter into the flattened ``(n_stream * kv_size, n_embd_gqa)``
    tensor and store the result back in the cache's list; ``get_k``/``get_v`` are MLX slices (lazy).

    Examples:
        >>> from reference.testing import tiny_hparams
        >>> from reference.batch import Batch, BatchAllocr
        >>> hp = tiny_hparams()
        >>> cache = KVCache(hp, kv_size=16)
        >>> ub = BatchAllocr(Batch(token=[1, 2]), n_vocab=32, n_seq_max=1,
        ...                  memory=cache).split_simple(8)
        >>> sinfo = cache.prepare([ub])[0]
        >>> cache.apply_ubatch(sinfo, ub)
        >>> inp = cache.attn_input(ub, sinfo)
        >>> inp.get_kq_mask(0).shape, inp.get_k(0).shape[1:]
        ((2, 16), (2, 4))
    """

    def set_kq_mask(self) -> None:
        """Twin of the reference's step: no NumPy mask; [`kq_mask`][] builds it on demand."""
        self._kq_mask: mx.array | None = None

    def kq_mask_inputs(self, n_cols: int) -> tuple[np.ndarray, np.ndarray]:
        """What [`kq_mask_device`][accelerated.memory.kq_mask.kq_mask_device] reads, for the
        first ``n_cols`` cells of each stream.

        When the slot is one stream and each token's sequence holds every used cell of it
        ([`holds_every_used_cell`][reference.memory.kq_mask.holds_every_used_cell]: one
        conversation, the common case), ``member`` is the test that a cell is not empty,
        which the mask's formula makes anyway: it is returned as a ``(n_tokens, 1)``
        column of True, and the host reads no column of the membership matrix (the slowest
        part of the inputs at depth; ``docs/performance.md``).

        Returns:
            ``p_cell`` ``(ns * n_cols,)`` int32 and ``member`` ``(n_tokens, ns * n_cols)``
            bool (or ``(n_tokens, 1)``, as above), the streams of the slot block after block
            (as the mask's columns).
        """
        cache, seq_id = self.cache, self.ubatch.seq_id
        s_tok = np.array([ids[0] for ids in seq_id], dtype=np.int64)  # (n_tokens,)
        if len(self.sinfo.strm) == 1:
            cells = cache.v_cells[self.sinfo.strm[0]]
            if holds_every_used_cell(cells, s_tok):
                return (cells.pos[:n_cols].astype(np.int32),  # (n_cols,)
                        np.ones((len(s_tok), 1), dtype=bool))  # (n_tokens, 1)
        stream_tok = np.asarray(cache.seq_to_stream)[s_tok]  # (n_tokens,)
        p_cell, member = [], []
        for stream in self.sinfo.strm:
            cells = cache.v_cells[stream]
            p_cell.append(cells.pos[:n_cols])  # (n_cols,)
            member.append(cells.seq[:n_cols, s_tok].T & (stream_tok == stream)[:, None])
        return (np.concatenate(p_cell).astype(np.int32),  # (ns * n_cols,)
                np.concatenate(member, axis=1))  # (n_tokens, ns * n_cols)

    def kq_mask_prefix(self) -> int | None:
        """$u$ when every token of the ubatch sees exactly the first $u$ cells of the slot's
        one stream ([`visible_prefix`][reference.memory.kq_mask.visible_prefix]); None for
        any other mask, or a slot over several streams. O(1)."""
        if len(self.sinfo.strm) != 1:
            return None
        s_tok = np.array([ids[0] for ids in self.ubatch.seq_id], dtype=np.int64)  # (n_tokens,)
        return visible_prefix(self.cache.v_cells[self.sinfo.strm[0]], s_tok, self.ubatch.pos,
                              self.cache.n_swa, self.cache.swa_type)

    @property
    def kq_mask(self) -> mx.array:
        """The KQ mask ``(n_tokens, ns * n_kv)``, built on the device the first time."""
        if self._kq_mask is None:
            p_cell, member = self.kq_mask_inputs(self.n_kv)
            pos = mx.array(np.asarray(self.ubatch.pos, dtype=np.int32))  # (n_tokens,)
            cache = self.cache
            self._kq_mask = kq_mask_device(mx.array(p_cell), mx.array(member), pos,
                                           cache.n_swa, cache.swa_type)
        return self._kq_mask

    def _store(self, tensors: list, il: int, cur: mx.array) -> None:
        i = self.cache.layer_id(il)  # the cache's own index of the model's layer il
        t = tensors[i]  # (n_stream, n_head_kv, kv_size, d)
        n_stream, n_head_kv, kv_size, d = t.shape
        rows = t.reshape(-1, d)  # (n_stream * n_head_kv * kv_size, d)
        idx = head_rows(self.k_idxs, kv_size, n_head_kv)  # (n_tokens, n_head_kv)
        set_rows(rows, mx.array(cur).reshape(-1, d), idx.reshape(-1))
        tensors[i] = rows.reshape(t.shape)  # (n_stream, n_head_kv, kv_size, d)

    def cpy_k(self, il: int, k_cur: mx.array) -> None:
        """Store ``k_cur`` ``(n_tokens, n_head_kv, d_k)`` in the slot's cells of layer ``il``."""
        self._store(self.cache.k_l, il, k_cur)

    def cpy_v(self, il: int, v_cur: mx.array) -> None:
        """Store ``v_cur`` ``(n_tokens, n_head_kv, d_v)`` in the slot's cells of layer ``il``."""
        self._store(self.cache.v_l, il, v_cur)

    def get_k(self, il: int) -> mx.array:
        """Keys of layer ``il`` in view: ``(ns * n_kv, n_head_kv, d_k)``."""
        return head_major_view(self.cache.k_l[self.cache.layer_id(il)], self.sinfo.strm, self.n_kv)

    def get_v(self, il: int) -> mx.array:
        """Values of layer ``il`` in view: ``(ns * n_kv, n_head_kv, d_v)``."""
        return head_major_view(self.cache.v_l[self.cache.layer_id(il)], self.sinfo.strm, self.n_kv)

    def get_k_heads(self, il: int) -> mx.array:
        """``get_k``'s cells as the cache holds them: ``(ns, n_head_kv, n_kv, d_k)``."""
        return head_major_blocks(self.cache.k_l[self.cache.layer_id(il)], self.sinfo.strm,
                                 self.n_kv)

    def get_v_heads(self, il: int) -> mx.array:
        """``get_v``'s cells as the cache holds them: ``(ns, n_head_kv, n_kv, d_v)``."""
        return head_major_blocks(self.cache.v_l[self.cache.layer_id(il)], self.sinfo.strm,
                                 self.n_kv)

    def get_kq_mask(self, il: int) -> mx.array:
        """The KQ mask ``(n_tokens, ns * n_kv)`` as an ``mx.array`` (the same for every layer)."""
        return self.kq_mask
# --8<-- [end:KVCacheAttnInput]


# --8<-- [start:GraphAttnInput]
class GraphAttnInput:
    """The attention input of one ubatch as a pure value, for a traced (compiled) forward.

    Implements [`reference.models.llama.AttnInput`][reference.models.llama.AttnInput] on its own
    lists ``k_l``/``v_l`` (one head-major ``(n_stream, n_head_kv, kv_size, d)`` tensor per
    layer, as [`KVCache`][] holds them):
    ``cpy_k``/``cpy_v`` replace a layer's entry by the scattered tensor, so after the forward
    ``k_l``/``v_l`` are the written cache, to be returned by the graph and stored by the caller. The
    ubatch's geometry (``n_kv``, ``strm``) is static; ``k_rows`` and ``kq_mask`` are arrays (inputs
    of the graph). Nothing is read on the host.

    Args:
        k_l: K tensors, one per layer.
        v_l: V tensors, one per layer.
        k_rows: where each token's heads go in a tensor seen as rows of ``d``
            ([`head_rows`][] of the reference's ``k_idxs``), ``(n_tokens, n_head_kv)``.
        kq_mask: the KQ mask ``(n_tokens, len(strm) * n_kv)``.
        n_kv: cells of each stream in view.
        strm: the streams of the ubatch's slot.
        n_head_kv: KV heads.

    Examples:
        >>> k = [mx.zeros((1, 1, 4, 2))]  # 1 stream, 1 head, 4 cells, d = 2
        >>> inp = GraphAttnInput(k, [mx.zeros((1, 1, 4, 2))], mx.array([[2]]), mx.zeros((1, 4)),
        ...                      4, (0,), 1)
        >>> inp.cpy_k(0, mx.ones((1, 1, 2)))
        >>> inp.k_l[0][0, 0, :, 0].tolist(), k[0].sum().item(), inp.get_k(0).shape
        ([0.0, 0.0, 1.0, 0.0], 0.0, (4, 1, 2))
    """

    def __init__(self, k_l: list, v_l: list, k_rows: mx.array, kq_mask: mx.array, n_kv: int,
                 strm: tuple[int, ...], n_head_kv: int):
        self.k_l, self.v_l = list(k_l), list(v_l)
        self.k_rows = k_rows  # (n_tokens, n_head_kv)
        self.kq_mask = kq_mask  # (n_tokens, ns * n_kv)
        self.n_kv = n_kv
        self.strm = tuple(strm)
        self.n_stream = len(self.strm)  # one attention per stream
        self.n_head_kv = n_head_kv

    def _store(self, tensors: list, il: int, cur: mx.array) -> None:
        t = tensors[il]  # (n_stream, n_head_kv, kv_size, d)
        d = t.shape[-1]
        rows = t.reshape(-1, d)  # (n_stream * n_head_kv * kv_size, d)
        rows[self.k_rows.reshape(-1)] = cur.reshape(-1, d).astype(t.dtype)  # set_rows
        tensors[il] = rows.reshape(t.shape)  # (n_stream, n_head_kv, kv_size, d)

    def cpy_k(self, il: int, k_cur: mx.array) -> None:
        """Store ``k_cur`` ``(n_tokens, n_head_kv, d_k)`` at ``k_rows`` of layer ``il``."""
        self._store(self.k_l, il, k_cur)

    def cpy_v(self, il: int, v_cur: mx.array) -> None:
        """Store ``v_cur`` ``(n_tokens, n_head_kv, d_v)`` at ``k_rows`` of layer ``il``."""
        self._store(self.v_l, il, v_cur)

    def get_k(self, il: int) -> mx.array:
        """Keys of layer ``il`` in view: ``(ns * n_kv, n_head_kv, d_k)``."""
        return head_major_view(self.k_l[il], self.strm, self.n_kv)

    def get_v(self, il: int) -> mx.array:
        """Values of layer ``il`` in view: ``(ns * n_kv, n_head_kv, d_v)``."""
        return head_major_view(self.v_l[il], self.strm, self.n_kv)

    def get_k_heads(self, il: int) -> mx.array:
        """``get_k``'s cells as the cache holds them: ``(ns, n_head_kv, n_kv, d_k)``."""
        return head_major_blocks(self.k_l[il], self.strm, self.n_kv)

    def get_v_heads(self, il: int) -> mx.array:
        """``get_v``'s cells as the cache holds them: ``(ns, n_head_kv, n_kv, d_v)``."""
        return head_major_blocks(self.v_l[il], self.strm, self.n_kv)

    def get_kq_mask(self, il: int) -> mx.array:
        """The KQ mask ``(n_tokens, ns * n_kv)`` (the same for every layer)."""
        return self.kq_mask
# --8<-- [end:GraphAttnInput]


# --8<-- [start:KVCache]
class KVCache(ref.KVCache):
    """Twin of [`reference.memory.kv_cache.KVCache`][reference.memory.kv_cache.KVCache]: the same
    cells, MLX tensors.

    Constructor arguments are the reference's; ``k_l``/``v_l`` become ``mx.array`` zeros
    laid out head by head, ``(n_stream, n_head_kv, kv_size, d)`` (the module docstring says
    why; dtype by [`mx_dtype`][accelerated.ops.convert.mx_dtype]). Every bookkeeping method
    is inherited.

    Examples:
        >>> from reference.testing import tiny_hparams
        >>> cache = KVCache(tiny_hparams(), kv_size=16, n_seq_max=2, kv_unified=False)
        >>> cache.k_l[0].shape, cache.k_l[0].dtype, cache.get_n_stream()
        ((2, 2, 16, 4), mlx.core.float32, 2)
    """

    def __init__(self, hparams: LlamaHParams, *args, **kwargs):
        super().__init__(hparams, *args, **kwargs)
        dt = mx_dtype(self.dtype)
        self.k_l = [to_head_major(t, hparams.n_head_kv, dt) for t in self.k_l]
        self.v_l = [to_head_major(t, hparams.n_head_kv, dt) for t in self.v_l]

    def clear(self, data: bool = True) -> None:
        """Empty every cell; with ``data`` also zero the K/V tensors (``llama_memory_clear``).

        The tensors are replaced by zeros of their own kind: MLX normally, NumPy while the
        reference's state functions work on NumPy copies ([`on_host`][]).
        """
        super().clear(data=False)
        if data:
            on_host = bool(self.k_l) and isinstance(self.k_l[0], np.ndarray)
            zeros = np.zeros_like if on_host else mx.zeros_like
            self.k_l = [zeros(t) for t in self.k_l]
            self.v_l = [zeros(t) for t in self.v_l]

    def attn_input(self, ubatch, sinfo: SlotInfo) -> KVCacheAttnInput:
        """The MLX [`KVCacheAttnInput`][] of ``ubatch`` (call after ``apply_ubatch``).

        ``graph_input`` (inherited) returns it too.
        """
        return KVCacheAttnInput(self, ubatch, sinfo)

    # --8<-- [start:apply_k_shift]
    def apply_k_shift(self, stream: int, rows: list[int], shift: np.ndarray,
                      rope_factors: np.ndarray | None = None) -> None:
        """Twin of
        [`reference.memory.kv_cache.KVCache.apply_k_shift`][reference.memory.kv_cache.KVCache.apply_k_shift]
        on MLX tensors.

        The shifted rows of each layer are gathered, turned ([`build_rope_shift`][]) and
        scattered back; the bookkeeping around it (which rows, by how much, forgetting the
        shifts) is the reference's ``update``.
        """
        hp = self.hparams
        kv_size = self.get_size()
        cells = stream * kv_size + np.asarray(rows, dtype=np.int32)  # (n_rows,) global rows
        idx = mx.array(head_rows(cells, kv_size, hp.n_head_kv))  # (n_rows, n_head_kv)
        for i, (il, k) in enumerate(zip(self.layers, self.k_l, strict=True)):
            flat = k.reshape(-1, hp.n_embd_head_k)  # (n_stream * n_head_kv * kv_size, d_k)
            k_rows = build_rope_shift(flat[idx], shift, hp, rope_factors, il)  # (n_rows, hkv, d_k)
            flat[idx.reshape(-1)] = k_rows.reshape(-1, hp.n_embd_head_k).astype(k.dtype)
            self.k_l[i] = flat.reshape(k.shape)

    def copy_stream(self, ssrc: int, sdst: int) -> None:
        """Twin of
        [`reference.memory.kv_cache.KVCache.copy_stream`][reference.memory.kv_cache.KVCache.copy_stream]:
        a new array per layer."""
        for tensors in (self.k_l, self.v_l):
            for il, t in enumerate(tensors):
                t[sdst] = t[ssrc]
                tensors[il] = t
    # --8<-- [end:apply_k_shift]

    # --8<-- [start:on_host]
    @contextmanager
    def on_host(self) -> Iterator[None]:
        """The K/V tensors as NumPy (``self.dtype``) inside the ``with``, MLX again after.

        The reference's state functions run on them (``state_write``, ``state_read`` and
        the file forms are inherited), in the reference's layout ([`to_cell_major`][]); a
        restore comes back as MLX tensors, head-major again, even after an error.
        Re-entrant: inside, the tensors are already on the host.
        """
        if not self.k_l or isinstance(self.k_l[0], np.ndarray):  # no layers, or on the host
            yield
            return
        dt, n_head_kv = mx_dtype(self.dtype), self.hparams.n_head_kv
        self.k_l = [to_cell_major(t, self.dtype) for t in self.k_l]
        self.v_l = [to_cell_major(t, self.dtype) for t in self.v_l]
        try:
            yield
        finally:
            self.k_l = [to_head_major(t, n_head_kv, dt) for t in self.k_l]
            self.v_l = [to_head_major(t, n_head_kv, dt) for t in self.v_l]
    # --8<-- [end:on_host]
# --8<-- [end:KVCache]
