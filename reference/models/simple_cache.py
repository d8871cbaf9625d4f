r"""The simplest memory: one sequence, cell ``i`` holds position ``i``.

The model graph does not own its keys and values: it asks the *memory* for them, through the
attention input of [`reference.models.llama.AttnInput`][reference.models.llama.AttnInput]
(llama.cpp's ``llm_graph_input_attn_kv`` together with ``llama_kv_cache_context``). Per layer ``il``
the memory

1. stores the ubatch's new keys and values in its cells (``cpy_k`` / ``cpy_v``: a
   ``ggml_set_rows`` at the ubatch's cell indices ``k_idxs``),
2. hands back views of *all* the cells the ubatch may look at (``get_k`` / ``get_v``, shapes
   ``(n_kv, n_head_kv, d)``), and
3. hands back the additive KQ mask ``(n_tokens, n_kv)`` built from the cells' positions and
   sequence ids (``get_kq_mask``).

This module is that memory for the simplest case: a single sequence whose positions are
``0, 1, ..., n_past - 1``, stored in cells ``0 .. n_past - 1``, so the cell index *is* the
position. The KQ mask is then causal (a token at position $p$ sees a cell at position $p_k$
iff $p_k \le p$), narrowed by the sliding window when the model has one
([`is_masked_swa`][], llama.cpp's ``llama_hparams::is_masked_swa``):

$$
\mathrm{mask}_{t, j} =
\begin{cases} 0 & p_j \le p_t \text{ and not } \mathrm{swa\_masked}(p_j, p_t) \\
-\infty & \text{otherwise.} \end{cases}
$$

The real multi-sequence KV cache (cells with sequence sets, slot search, ``seq_rm`` ...)
implements the same three calls; the model does not change.
"""

from __future__ import annotations

import numpy as np
from numpy.typing import DTypeLike

from reference.hparams import SWA_TYPE_NONE, LlamaHParams, is_masked_swa
from reference.memory.kv_cache import KVCacheError  # the one error of every KV cache
from reference.ops import set_rows


# --8<-- [start:build_kq_mask]
def build_kq_mask(
    cell_pos: np.ndarray,
    pos: np.ndarray,
    n_swa: int = 0,
    swa_type: int = SWA_TYPE_NONE,
    dtype: DTypeLike = np.float32,
) -> np.ndarray:
    """The additive causal KQ mask of one sequence: 0 where visible, ``-inf`` where not.

    Args:
        cell_pos: positions held by the cells, shape ``(n_kv,)``.
        pos: positions of the ubatch's tokens, shape ``(n_tokens,)``.
        n_swa: sliding-window size (0: none).
        swa_type: one of ``SWA_TYPE_*``.
        dtype: dtype of the mask (the forward's dtype).

    Returns:
        The mask, shape ``(n_tokens, n_kv)``.

    Examples:
        >>> build_kq_mask(np.arange(3), np.array([1, 2]))
        array([[  0.,   0., -inf],
               [  0.,   0.,   0.]], dtype=float32)
        >>> from reference.hparams import SWA_TYPE_STANDARD
        >>> build_kq_mask(np.arange(3), np.array([2]), n_swa=2, swa_type=SWA_TYPE_STANDARD)
        array([[-inf,   0.,   0.]], dtype=float32)
    """
    mask = np.zeros((len(pos), len(cell_pos)), dtype=dtype)  # (n_tokens, n_kv)
    for i, p1 in enumerate(pos):
        for j, p0 in enumerate(cell_pos):
            if p0 > p1 or is_masked_swa(n_swa, swa_type, int(p0), int(p1)):
                mask[i, j] = -np.inf
    return mask
# --8<-- [end:build_kq_mask]


# --8<-- [start:SimpleKVCacheContext]
class SimpleKVCacheContext:
    """The attention input of one ubatch, as the simple cache prepares it.

    Implements [`reference.models.llama.AttnInput`][reference.models.llama.AttnInput]. ``k_idxs``
    are the cells the ubatch writes (here: its positions); ``n_kv`` is the number of cells it may
    read (here: all used cells, ``n_past`` after the ubatch); one sequence, so one stream.

    Two masks, as llama.cpp's iSWA cache builds one per cache: the causal one for the dense
    layers and, when some layer is SWA (``hparams.is_swa(il)``, Gemma 2/3's pattern), the
    causal one narrowed by the window for those layers. Every layer reads all ``n_kv`` cells:
    a cell outside the window is masked, not dropped.
    """

    n_stream = 1

    def __init__(self, cache: SimpleKVCache, pos: np.ndarray):
        self.cache = cache
        self.k_idxs = np.asarray(pos, dtype=np.int64)  # (n_tokens,)
        self.n_kv = int(self.k_idxs[-1]) + 1
        hp = cache.hparams
        cells = np.arange(self.n_kv)  # cell i holds position i
        self.kq_mask = build_kq_mask(cells, self.k_idxs, dtype=cache.dtype)  # (n_tokens, n_kv)
        self.kq_mask_swa = self.kq_mask
        if hp.is_swa_any():
            self.kq_mask_swa = build_kq_mask(
                cells, self.k_idxs, hp.n_swa, hp.swa_type, cache.dtype
            )  # (n_tokens, n_kv)

    def cpy_k(self, il: int, k_cur: np.ndarray) -> None:
        """Store ``k_cur`` ``(n_tokens, n_head_kv, d_k)`` of layer ``il`` at ``k_idxs``."""
        set_rows(self.cache.k_l[il], k_cur.reshape(len(self.k_idxs), -1), self.k_idxs)

    def cpy_v(self, il: int, v_cur: np.ndarray) -> None:
        """Store ``v_cur`` ``(n_tokens, n_head_kv, d_v)`` of layer ``il`` at ``k_idxs``."""
        set_rows(self.cache.v_l[il], v_cur.reshape(len(self.k_idxs), -1), self.k_idxs)

    def get_k(self, il: int) -> np.ndarray:
        """View of the keys of layer ``il``: ``(n_kv, n_head_kv, d_k)``."""
        hp = self.cache.hparams
        return self.cache.k_l[il][: self.n_kv].reshape(self.n_kv, hp.n_head_kv, hp.n_embd_head_k)

    def get_v(self, il: int) -> np.ndarray:
        """View of the values of layer ``il``: ``(n_kv, n_head_kv, d_v)``."""
        hp = self.cache.hparams
        return self.cache.v_l[il][: self.n_kv].reshape(self.n_kv, hp.n_head_kv, hp.n_embd_head_v)

    def get_kq_mask(self, il: int) -> np.ndarray:
        """The KQ mask ``(n_tokens, n_kv)`` for layer ``il``: windowed for a SWA layer.

        Examples:
            >>> from reference.testing import tiny_gemma_hparams
            >>> hp = tiny_gemma_hparams("gemma2", n_layer=2, n_swa=2)  # layer 0 SWA, 1 dense
            >>> inp = SimpleKVCache(hp, n_ctx=4).init_batch(np.arange(3))
            >>> inp.get_kq_mask(0)[2], inp.get_kq_mask(1)[2]
            (array([-inf,   0.,   0.], dtype=float32), array([0., 0., 0.], dtype=float32))
        """
        return self.kq_mask_swa if self.cache.hparams.is_swa(il) else self.kq_mask
# --8<-- [end:SimpleKVCacheContext]


# --8<-- [start:SimpleKVCache]
class SimpleKVCache:
    """A KV cache for one sequence: cell ``i`` holds position ``i``.

    Per layer, ``k_l[il]`` is ``(n_ctx, n_head_kv * n_embd_head_k)`` and ``v_l[il]`` is
    ``(n_ctx, n_head_kv * n_embd_head_v)``: one row per cell, as llama.cpp's ``k_l``/``v_l``
    (non-transposed V). ``n_past`` cells are in use.

    Args:
        hparams: the model's hyperparameters.
        n_ctx: number of cells (the longest sequence it can hold).
        dtype: dtype of the stored K/V (float32 by default: llama.cpp with ``type_k=f32``).

    Examples:
        >>> from reference.hparams import LlamaHParams
        >>> hp = LlamaHParams(arch="llama", n_vocab=8, n_ctx_train=16, n_embd=8, n_layer=1,
        ...     n_head=2, n_head_kv=1, n_embd_head_k=4, n_embd_head_v=4, n_rot=4, n_ff=16,
        ...     f_norm_rms_eps=1e-5)
        >>> cache = SimpleKVCache(hp, n_ctx=16)
        >>> ctx = cache.init_batch(np.array([0, 1, 2]))
        >>> ctx.get_k(0).shape, ctx.get_kq_mask(0).shape, cache.n_past
        ((3, 1, 4), (3, 3), 3)
        >>> cache.init_batch(np.array([5]))  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        reference.memory.kv_cache.KVCacheError: positions must continue ...
    """

    def __init__(self, hparams: LlamaHParams, n_ctx: int, dtype: DTypeLike = np.float32):
        self.hparams = hparams
        self.n_ctx = n_ctx
        self.dtype = np.dtype(dtype)
        n_layer = hparams.n_layer
        self.k_l = [np.zeros((n_ctx, hparams.n_embd_k_gqa()), self.dtype) for _ in range(n_layer)]
        self.v_l = [np.zeros((n_ctx, hparams.n_embd_v_gqa()), self.dtype) for _ in range(n_layer)]
        self.n_past = 0

    def init_batch(self, pos: np.ndarray) -> SimpleKVCacheContext:
        """Reserve cells for a ubatch at positions ``pos`` and return its attention input.

        Args:
            pos: positions of the ubatch, shape ``(n_tokens,)``; must be
                ``n_past, n_past + 1, ...``.

        Returns:
            The [`SimpleKVCacheContext`][] to pass to the forward.

        Raises:
            KVCacheError: if the positions do not continue the sequence or do not fit; the
                cache is left unchanged.
        """
        pos = np.asarray(pos, dtype=np.int64)
        expected = np.arange(self.n_past, self.n_past + len(pos))
        if len(pos) == 0 or not np.array_equal(pos, expected):
            raise KVCacheError(
                f"positions must continue the sequence: expected {self.n_past}, "
                f"{self.n_past + 1}, ... but got {pos.tolist()}"
            )
        if pos[-1] >= self.n_ctx:
            raise KVCacheError(f"out of cells: position {int(pos[-1])} >= n_ctx = {self.n_ctx}")
        self.n_past += len(pos)
        return SimpleKVCacheContext(self, pos)
# --8<-- [end:SimpleKVCache]
