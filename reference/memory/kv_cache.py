r"""The unified KV cache: ``llama_kv_cache`` (``src/llama-kv-cache.cpp``) in NumPy.

The cache stores, per layer $l$, one key row and one value row per *cell*:

$$
K_l, V_l \in \mathbb{R}^{n_{stream} \times kv\_size \times n_{embd\_k\_gqa}},
$$

(``k_l[il]`` and ``v_l[il]``; V is stored like K, one row per cell: llama.cpp's
``v_trans = false`` layout, the one it uses with flash attention; the transposed layout
holds the same numbers). What each row means is kept by [`KVCells`][], one per stream.

Streams. With ``kv_unified=True`` there is one stream of ``kv_size`` cells shared by every
sequence: sequences can share cells (``seq_cp`` costs nothing). With ``kv_unified=False``
there are ``n_seq_max`` streams of ``kv_size`` cells each, sequence $s$ living in stream $s$
(``seq_to_stream``); ``kv_size`` is then llama_context's ``n_ctx_seq`` (see
[`n_ctx_seq`][]), and ``seq_cp`` between streams copies the whole stream at the next
[`KVCache.update`][].

Decoding a batch goes through these steps, as in llama.cpp; they are the memory interface
([`reference.memory.interface`][reference.memory.interface]) that the recurrent memory implements
too:

1. [`KVCache.init_batch`][] cuts the batch into ubatches (``split_simple`` for one stream,
   ``split_equal(sequential=True)`` for one stream per sequence) and [`KVCache.prepare`][]
   finds a slot (a [`SlotInfo`][]: cell indices) for every ubatch by placing them one
   after the other, then restores the cells: all or nothing;
2. [`KVCache.apply_ubatch`][] writes the ubatch's positions and sequence ids into its
   slot;
3. [`KVCache.graph_input`][] ([`KVCache.attn_input`][]) gives the model its
   [`KVCacheAttnInput`][]: it writes the new K/V rows into the slot and reads the first
   ``n_kv`` cells back with the KQ mask
   ([`reference.memory.kq_mask`][reference.memory.kq_mask]); [`KVCache.remove_ubatch`][]
   undoes a ubatch that was applied but not computed;
4. [`KVCache.update`][], before the next batch, re-ropes the keys of the cells whose
   position changed (``seq_add``/``seq_div``): the lazy K-shift.

Layers. A cache holds the K/V tensors of the model layers it is given (``layers``, llama.cpp's
layer ``filter``; all of them by default), ``k_l[i]`` for layer ``layers[i]``
([`KVCache.layer_id`][] is ``map_layer_ids``), and its own window (``n_swa``, ``swa_type``).
A model with sliding-window layers gets two such caches
([`reference.memory.kv_cache_iswa`][reference.memory.kv_cache_iswa]); its state blob carries its
own layers only.

The array work of these steps is in small methods the MLX twin overrides
([`KVCache.copy_stream`][], [`KVCache.apply_k_shift`][], [`KVCache.on_host`][]); the
bookkeeping around them is written once, here.

The memory API (``seq_rm``, ``seq_cp``, ``seq_keep``, ``seq_add``, ``seq_div``,
``seq_pos_min``, ``seq_pos_max``, ``clear``, ``can_shift``) has llama.cpp's edge cases;
where llama.cpp asserts, [`KVCacheError`][] is raised before anything changes.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
from numpy.typing import ArrayLike, DTypeLike

from reference.batch import BatchAllocr
from reference.common import LLAMA_MAX_SEQ, POS_INF, LlamarefError
from reference.hparams import SWA_TYPE_NONE, LlamaHParams, is_masked_swa, rope_cparams
from reference.memory import state as state_io
from reference.memory.interface import MemoryContext, MemoryStatus, batch_context
from reference.memory.kq_mask import set_input_kq_mask_fast
from reference.memory.kv_cells import KVCells
from reference.ops import rope_ext, set_rows
from reference.ops.rope import RopeParams

# How many cells the slot search of a decode reads at a time (KVCache._find_cells_fast): it
# stops at the first chunk where it has found its cells, so its cost does not grow with the
# cache.
FIND_CHUNK = 256


# --8<-- [start:KVCacheError]
class KVCacheError(LlamarefError, ValueError):
    """An invalid call to the KV cache (a sequence id out of range, ``d < 1``, ...), or a
    ubatch the simple cache of [`reference.models.simple_cache`][reference.models.simple_cache]
    cannot hold (positions that do not continue its sequence, out of cells).

    Raised before anything changes; llama.cpp aborts (``GGML_ASSERT``) in these cases.
    """
# --8<-- [end:KVCacheError]


# --8<-- [start:ggml_pad]
def ggml_pad(x: int, n: int) -> int:
    """``GGML_PAD(x, n)``: ``x`` rounded up to a multiple of ``n``.

    Examples:
        >>> ggml_pad(1, 256), ggml_pad(256, 256), ggml_pad(257, 256)
        (256, 256, 512)
    """
    return (x + n - 1) // n * n
# --8<-- [end:ggml_pad]


# --8<-- [start:n_ctx_seq]
def n_ctx_seq(n_ctx: int, n_seq_max: int, kv_unified: bool) -> tuple[int, int]:
    """The context size and the cells per stream, as ``llama_context`` derives them.

    ``n_ctx`` is padded to 256; a unified cache has one stream of ``n_ctx`` cells; otherwise
    each of the ``n_seq_max`` streams gets ``n_ctx / n_seq_max`` cells padded to 256, and
    ``n_ctx`` becomes their total.

    Args:
        n_ctx: the requested context size.
        n_seq_max: the number of sequences.
        kv_unified: one shared stream (True) or one stream per sequence.

    Returns:
        ``(n_ctx, n_ctx_seq)``; ``n_ctx_seq`` is the ``kv_size`` of [`KVCache`][].

    Examples:
        >>> n_ctx_seq(100, 1, True), n_ctx_seq(1000, 4, False), n_ctx_seq(256, 3, False)
        ((256, 256), (1024, 256), (768, 256))
    """
    n_ctx = ggml_pad(n_ctx, 256)
    if kv_unified:
        return n_ctx, n_ctx
    per_seq = ggml_pad(n_ctx // n_seq_max, 256)
    return per_seq * n_seq_max, per_seq
# --8<-- [end:n_ctx_seq]


# --8<-- [start:kv_size_swa]
def kv_size_swa(kv_size: int, n_swa: int, n_seq_max: int, n_ubatch: int, kv_unified: bool) -> int:
    """The size of a cache of sliding-window layers when ``swa_full`` is false.

    ``llama_kv_cache_iswa``: a SWA layer only ever needs the last ``n_swa`` positions of each
    sequence plus the ubatch being written, so its cache holds
    ``GGML_PAD(min(kv_size, n_swa * n_seqs + n_ubatch), 256)`` cells (``n_seqs`` is
    ``n_seq_max`` for a unified cache, 1 per stream otherwise). llama.cpp's ``kv_size`` is
    always a multiple of 256; for other sizes the result is also capped at ``kv_size``.

    Examples:
        >>> kv_size_swa(4096, 128, 2, 512, True), kv_size_swa(64, 4, 1, 8, True)
        (768, 64)
    """
    n_seqs = n_seq_max if kv_unified else 1
    return min(kv_size, ggml_pad(min(kv_size, n_swa * n_seqs + n_ubatch), 256))
# --8<-- [end:kv_size_swa]


# --8<-- [start:cache_layers]
def cache_layers(hparams: LlamaHParams, layers: Sequence[int] | None) -> tuple[int, ...]:
    """The model layers a cache holds: ``layers`` checked, or all of them when None.

    llama.cpp's ``llama_kv_cache`` takes a layer ``filter`` callback and keeps a tensor pair
    for the layers it accepts, with ``map_layer_ids`` from the model's layer index to its
    own; the list of accepted layers is that filter here.

    Raises:
        KVCacheError: a layer out of ``[0, n_layer)``, repeated, or out of order.

    Examples:
        >>> from reference.testing import tiny_hparams
        >>> cache_layers(tiny_hparams(n_layer=3), None), cache_layers(tiny_hparams(), [1])
        ((0, 1, 2), (1,))
    """
    if layers is None:
        return tuple(range(hparams.n_layer))
    layers = tuple(int(il) for il in layers)
    if any(not 0 <= il < hparams.n_layer for il in layers) or list(layers) != sorted(set(layers)):
        raise KVCacheError(f"layers {list(layers)} must be ascending, distinct layers of the "
                           f"model's {hparams.n_layer}")
    return layers
# --8<-- [end:cache_layers]


# --8<-- [start:SlotInfo]
@dataclass(frozen=True)
class SlotInfo:
    """Where a ubatch goes (``llama_kv_cache::slot_info``).

    Attributes:
        strm: the stream of each sequence set of the ubatch (one entry when unified).
        idxs: per entry of ``strm``, the cell index of each of its tokens; the tokens of the
            ubatch are ``idxs[0]`` then ``idxs[1]`` ...
    """

    strm: tuple[int, ...]
    idxs: tuple[tuple[int, ...], ...]

    @property
    def s0(self) -> int:
        """First stream touched."""
        return min(self.strm)

    @property
    def s1(self) -> int:
        """Last stream touched."""
        return max(self.strm)

    def n_stream(self) -> int:
        """Number of sequence sets (streams) of the slot."""
        return len(self.strm)

    def size(self) -> int:
        """Tokens per stream."""
        return len(self.idxs[0])
# --8<-- [end:SlotInfo]


# --8<-- [start:k_shift_rope_params]
def k_shift_rope_params(hparams: LlamaHParams, il: int | None = None) -> RopeParams:
    r"""The [`RopeParams`][] of the K-shift of layer ``il``: [`rope_cparams`][], magnitude 1.

    ``rope_cparams(hparams, il)``: a SWA layer may turn with its own base and scale
    (``llama_model::get_rope_freq_base(cparams, il)`` in ``build_graph_shift``); ``il = None``
    gives the non-SWA values.

    A K-shift must only *turn* the keys: by additivity,
    $R(\Delta)\,R(p)\,k = R(p + \Delta)\,k$. With YaRN, ``rope_ext`` also multiplies by
    $m = 1 + 0.1 \ln(1/s)$ (``rope_yarn``); the keys already carry it from the forward, so the
    shift divides ``attn_factor`` by $m$. llama.cpp's ``build_rope_shift`` passes the
    forward's ``attn_factor`` and so scales the keys by $m$ at every K-shift (a divergence).

    Examples:
        >>> from reference.testing import tiny_hparams
        >>> k_shift_rope_params(tiny_hparams()).attn_factor
        1.0
    """
    params = rope_cparams(hparams, il)
    if params.ext_factor != 0.0:
        mscale = 1.0 + 0.1 * np.log(1.0 / params.freq_scale)
        params = replace(params, attn_factor=params.attn_factor / mscale)
    return params
# --8<-- [end:k_shift_rope_params]


# --8<-- [start:build_rope_shift]
def build_rope_shift(
    k: np.ndarray, shift: np.ndarray, hparams: LlamaHParams, rope_factors: np.ndarray | None = None,
    il: int | None = None,
) -> np.ndarray:
    r"""The K-shift of one layer's keys: turn each cell's key by its recorded shift.

    ``llama_kv_cache::build_rope_shift``: ``rope_ext`` with the model's RoPE parameters on
    the first ``n_rot`` dims of every head, the positions being the shifts. Exact by RoPE
    additivity: a key roped at $p$ and turned by $\Delta$ is the key roped at $p + \Delta$.

    Args:
        k: keys of the cells ``(n_cells, n_head_kv, n_embd_head_k)``.
        shift: the shift of each cell ``(n_cells,)`` (0 for untouched cells).
        hparams: the model's hyperparameters (RoPE type, base, scaling).
        rope_factors: the model's ``rope_freqs.weight`` or None.
        il: the layer (its RoPE base and scale: [`k_shift_rope_params`][]); None: the
            non-SWA values.

    Returns:
        The turned keys, same shape and dtype.

    Examples:
        >>> from reference.testing import tiny_hparams
        >>> hp = tiny_hparams(n_embd=8, n_head=2, n_head_kv=1)
        >>> k = np.random.default_rng(0).normal(size=(1, 1, 4))
        >>> kp = rope_ext(k, np.array([3]), rope_cparams(hp))
        >>> k5 = rope_ext(k, np.array([5]), rope_cparams(hp))
        >>> bool(np.allclose(build_rope_shift(kp, np.array([2]), hp), k5, atol=1e-12))
        True
    """
    return rope_ext(k, shift, k_shift_rope_params(hparams, il), rope_factors)
# --8<-- [end:build_rope_shift]


# --8<-- [start:KVCacheAttnInput]
class KVCacheAttnInput:
    """The attention input of one ubatch (``llm_graph_input_attn_kv`` + the cache context).

    Implements [`reference.models.llama.AttnInput`][reference.models.llama.AttnInput]. Built by
    [`KVCache.attn_input`][] after [`KVCache.apply_ubatch`][]; ``n_kv`` and the mask are fixed then,
    as llama.cpp fixes them when it builds the graph.

    - ``k_idxs``: the global row of each token, ``stream * kv_size + cell`` (``k_idxs``);
    - ``get_k``/``get_v``: the first ``n_kv`` cells of each stream of the slot, streams
      concatenated: ``(len(strm) * n_kv, n_head_kv, d)``;
    - ``get_kq_mask``: [`set_input_kq_mask`][reference.memory.kq_mask.set_input_kq_mask] with
      the cache's own window, computed by its fast path; the same for every layer of the
      cache (all of them are SWA layers when its ``n_swa > 0``).

    ``il`` is the model's layer index; the cache maps it to its own tensors
    ([`KVCache.layer_id`][]).

    With several streams the ubatch's tokens come stream after stream, in equal blocks, and
    the views and the mask put the streams' cells block after block; ``n_stream`` tells the
    attention to run once per stream (``build_attn_mha``'s ``n_stream``), as llama.cpp's 4-D
    views do, reading only the mask's diagonal blocks (a token sees nothing in another
    stream's block).
    """

    def __init__(self, cache: KVCache, ubatch, sinfo: SlotInfo):
        self.cache, self.sinfo, self.ubatch = cache, sinfo, ubatch
        self.n_stream = sinfo.n_stream()  # one attention per stream
        self.n_kv = cache.get_n_kv(sinfo)
        kv_size = cache.get_size()
        self.k_idxs = np.array(
            [s * kv_size + i for s, idxs in zip(sinfo.strm, sinfo.idxs, strict=True) for i in idxs],
            dtype=np.int64,
        )  # (n_tokens,)
        self.set_kq_mask()

    def set_kq_mask(self) -> None:
        """Build the ubatch's KQ mask: the array step of the input.

        The rule is [`set_input_kq_mask`][reference.memory.kq_mask.set_input_kq_mask]; the
        cache computes it by its fast path,
        [`set_input_kq_mask_fast`][reference.memory.kq_mask.set_input_kq_mask_fast]. The MLX
        twin replaces only this step (it builds the mask on the device, lazily).
        """
        cache, ubatch, sinfo = self.cache, self.ubatch, self.sinfo
        self.kq_mask = set_input_kq_mask_fast(
            cache.v_cells, cache.seq_to_stream, np.asarray(ubatch.pos), ubatch.seq_id,
            sinfo.strm, self.n_kv, cache.n_swa, cache.swa_type, cache.dtype,
        )  # (n_tokens, n_stream_ubatch * n_kv)

    def _rows(self, t: np.ndarray) -> np.ndarray:
        return t.reshape(-1, t.shape[-1])  # (n_stream * kv_size, n_embd_gqa), a view

    def cpy_k(self, il: int, k_cur: np.ndarray) -> None:
        """Store ``k_cur`` ``(n_tokens, n_head_kv, d_k)`` in the slot's cells of layer ``il``."""
        k = self.cache.k_l[self.cache.layer_id(il)]
        set_rows(self._rows(k), k_cur.reshape(len(self.k_idxs), -1), self.k_idxs)

    def cpy_v(self, il: int, v_cur: np.ndarray) -> None:
        """Store ``v_cur`` ``(n_tokens, n_head_kv, d_v)`` in the slot's cells of layer ``il``."""
        v = self.cache.v_l[self.cache.layer_id(il)]
        set_rows(self._rows(v), v_cur.reshape(len(self.k_idxs), -1), self.k_idxs)

    def _view(self, t: np.ndarray, d: int) -> np.ndarray:
        n_head_kv = self.cache.hparams.n_head_kv
        strm = self.sinfo.strm
        if len(strm) == 1:  # one stream: a view of the cache, as llama.cpp's get_k
            return t[strm[0], : self.n_kv].reshape(-1, n_head_kv, d)  # (n_kv, n_head_kv, d)
        s0 = strm[0]
        if list(strm) == list(range(s0, s0 + len(strm))):  # consecutive: a view, no copy
            blocks = t[s0 : s0 + len(strm), : self.n_kv]  # (ns, n_kv, n_embd_gqa)
        else:
            blocks = t[np.asarray(strm), : self.n_kv]  # (ns, n_kv, n_embd_gqa)
        return blocks.reshape(len(strm), self.n_kv, n_head_kv, d)  # (ns, n_kv, n_head_kv, d)

    def get_k(self, il: int) -> np.ndarray:
        """Keys of layer ``il`` in view: ``(n_kv, n_head_kv, d_k)`` for one stream, else
        ``(ns, n_kv, n_head_kv, d_k)``, the streams' cells side by side (the attention takes
        either: [`build_attn_mha`][reference.ops.attention.build_attn_mha])."""
        k = self.cache.k_l[self.cache.layer_id(il)]
        return self._view(k, self.cache.hparams.n_embd_head_k)

    def get_v(self, il: int) -> np.ndarray:
        """Values of layer ``il`` in view, shaped as ``get_k``'s keys (``d_v`` last)."""
        v = self.cache.v_l[self.cache.layer_id(il)]
        return self._view(v, self.cache.hparams.n_embd_head_v)

    def get_kq_mask(self, il: int) -> np.ndarray:
        """The KQ mask ``(n_tokens, ns * n_kv)`` (the same for every layer)."""
        return self.kq_mask
# --8<-- [end:KVCacheAttnInput]


# --8<-- [start:KVCache]
class KVCache:
    """The KV cache (``llama_kv_cache``): K/V tensors per layer, cells per stream.

    Args:
        hparams: the model's hyperparameters (sizes, RoPE for the K-shift, ``n_swa``).
        kv_size: cells per stream (llama_context's ``n_ctx_seq``, see [`n_ctx_seq`][]).
        n_seq_max: the number of sequences (and of streams when not unified).
        kv_unified: one stream shared by all sequences, or one per sequence.
        n_pad: ``kv_size`` must be a multiple of it; ``n_kv`` is padded to
            ``max(n_pad, 256)`` (llama.cpp creates the llama cache with ``n_pad = 1``).
        swa_full: with ``n_swa > 0`` and ``swa_full=False`` the cache keeps only
            [`kv_size_swa`][] cells (every layer of this cache is a SWA layer).
        n_ubatch: the ubatch size, used by [`kv_size_swa`][].
        dtype: dtype of K, V and the mask.
        layers: the model's layers this cache holds, ascending (llama.cpp's layer
            ``filter``); None: all of them. ``k_l[i]`` / ``v_l[i]`` belong to layer
            ``layers[i]`` ([`layer_id`][] maps a model layer to ``i``, ``map_layer_ids``);
            a state blob carries these layers only.
        n_swa: the window of this cache; None: ``hparams.n_swa``. The base cache of an
            iSWA pair ([`reference.memory.kv_cache_iswa`][reference.memory.kv_cache_iswa])
            has none (0 with ``swa_type = SWA_TYPE_NONE``).
        swa_type: the window type of this cache; None: ``hparams.swa_type``.

    Raises:
        KVCacheError: ``kv_size`` not a positive multiple of ``n_pad``, ``n_seq_max`` out of
            ``[1, LLAMA_MAX_SEQ]``, ``layers`` not ascending layers of the model, a window
            (``n_swa``, ``swa_type``) half set.

    Examples:
        >>> from reference.testing import tiny_hparams
        >>> cache = KVCache(tiny_hparams(), kv_size=8, n_seq_max=2)
        >>> cache.k_l[0].shape, cache.get_n_stream(), cache.seq_pos_max(0)
        ((1, 8, 8), 1, -1)
        >>> odd = KVCache(tiny_hparams(n_layer=3), kv_size=8, layers=[1])
        >>> len(odd.k_l), odd.layer_id(1)
        (1, 0)
    """

    def __init__(
        self,
        hparams: LlamaHParams,
        kv_size: int,
        n_seq_max: int = 1,
        kv_unified: bool = True,
        n_pad: int = 1,
        swa_full: bool = True,
        n_ubatch: int = 512,
        dtype: DTypeLike = np.float32,
        layers: Sequence[int] | None = None,
        n_swa: int | None = None,
        swa_type: int | None = None,
    ):
        if not 1 <= n_seq_max <= LLAMA_MAX_SEQ:
            raise KVCacheError(f"n_seq_max={n_seq_max} must be in [1, {LLAMA_MAX_SEQ}]")
        if kv_size <= 0 or n_pad <= 0 or kv_size % n_pad:
            raise KVCacheError(f"kv_size={kv_size} must be a positive multiple of n_pad={n_pad}")
        self.hparams = hparams
        self.n_seq_max = n_seq_max
        self.kv_unified = kv_unified
        self.n_stream = 1 if kv_unified else n_seq_max
        self.n_pad = n_pad
        self.layers = cache_layers(hparams, layers)
        self.map_layer_ids = {il: i for i, il in enumerate(self.layers)}
        self.n_swa = hparams.n_swa if n_swa is None else n_swa
        self.swa_type = hparams.swa_type if swa_type is None else swa_type
        if self.n_swa < 0 or (self.n_swa > 0) != (self.swa_type != SWA_TYPE_NONE):
            raise KVCacheError(f"n_swa={self.n_swa} and swa_type={self.swa_type} disagree: a "
                               "window needs n_swa > 0 and a window type, no window neither")
        if self.swa_type != SWA_TYPE_NONE and not swa_full:
            kv_size = kv_size_swa(kv_size, self.n_swa, n_seq_max, n_ubatch, kv_unified)
        self.dtype = np.dtype(dtype)
        self.v_cells = [KVCells(kv_size) for _ in range(self.n_stream)]
        self.v_heads = [0] * self.n_stream
        # every sequence id maps to stream 0, unless there is one stream per sequence
        self.seq_to_stream = [0] * LLAMA_MAX_SEQ if kv_unified else list(range(n_seq_max))
        shape_k = (self.n_stream, kv_size, hparams.n_embd_k_gqa())
        shape_v = (self.n_stream, kv_size, hparams.n_embd_v_gqa())
        self.k_l = [np.zeros(shape_k, self.dtype) for _ in self.layers]
        self.v_l = [np.zeros(shape_v, self.dtype) for _ in self.layers]
        self.sc_info: list[tuple[int, int]] = []  # pending stream copies (ssrc, sdst)

    # ---- sizes ---------------------------------------------------------------------------

    def layer_id(self, il: int) -> int:
        """The index in ``k_l`` / ``v_l`` of the model's layer ``il`` (``map_layer_ids.at(il)``).

        Raises:
            KVCacheError: the cache does not hold layer ``il``.
        """
        try:
            return self.map_layer_ids[il]
        except KeyError:
            raise KVCacheError(f"layer {il} is not in this cache (its layers: "
                               f"{list(self.layers)})") from None

    def get_size(self) -> int:
        """Cells per stream."""
        return self.v_cells[0].size()

    def get_n_stream(self) -> int:
        """Number of streams."""
        return self.n_stream

    def get_has_shift(self) -> bool:
        """Whether a K-shift is pending: some used cell has a non-zero recorded shift.

        llama.cpp answers with the cells' ``has_shift`` flag, which stays set when the
        shifted cells were freed since (moved below 0, removed) or their shifts cancelled:
        a K-shift that turns no key. Here such a flag does not count, so the answer depends
        only on the cells' positions and shifts, which a state blob saves: a restored memory
        answers as the one it was saved from ([`reference.memory.state`][reference.memory.state]).
        O(1): the cells count their non-zero shifts (``n_shifted``).
        """
        return any(cells.n_shifted > 0 for cells in self.v_cells)

    def can_shift(self) -> bool:
        """Whether positions can be shifted (``get_can_shift``): True for this cache."""
        return True

    def _check_seq_id(self, seq_id: int, allow_all: bool = False) -> None:
        if allow_all and seq_id == -1:
            return
        if not 0 <= seq_id < len(self.seq_to_stream):
            raise KVCacheError(
                f"seq_id={seq_id} out of range [0, {len(self.seq_to_stream)})"
                + (" (or -1 for all sequences)" if allow_all else "")
            )

    # ---- the memory API --------------------------------------------------------------------

    # --8<-- [start:clear]
    def clear(self, data: bool = True) -> None:
        """Empty every cell; with ``data`` also zero the K/V tensors (``llama_memory_clear``)."""
        for s in range(self.n_stream):
            self.v_cells[s].reset()
            self.v_heads[s] = 0
        if data:
            for t in self.k_l + self.v_l:
                t.fill(0)
    # --8<-- [end:clear]

    # --8<-- [start:seq_rm]
    def seq_rm(self, seq_id: int, p0: int, p1: int) -> bool:
        """Remove the cells of ``seq_id`` with ``p0 <= pos < p1`` (``llama_memory_seq_rm``).

        ``seq_id == -1`` matches every sequence (whole cells are emptied); ``p0 < 0`` means
        0, ``p1 < 0`` means infinity. A cell shared with another sequence only loses
        ``seq_id``. Always True for this cache (a recurrent memory may refuse).

        Raises:
            KVCacheError: ``seq_id`` out of range and not -1.
        """
        self._check_seq_id(seq_id, allow_all=True)
        p0 = max(p0, 0)
        p1 = POS_INF if p1 < 0 else p1
        streams = range(self.n_stream) if seq_id == -1 else [self.seq_to_stream[seq_id]]
        for s in streams:
            cells = self.v_cells[s]
            idxs = cells.seq_cells(seq_id, p0, p1)  # the cells of seq_id in [p0, p1)
            if seq_id == -1:
                cells.rm_cells(idxs)
                freed = idxs
            else:
                freed = cells.seq_rm_cells(idxs, seq_id)
            self._lower_head(s, freed)
        return True

    def _lower_head(self, stream: int, freed: np.ndarray) -> None:
        """A freed cell before the head: the next search starts there."""
        if freed.size and freed[0] < self.v_heads[stream]:
            self.v_heads[stream] = int(freed[0])
    # --8<-- [end:seq_rm]

    # --8<-- [start:seq_cp]
    def seq_cp(self, seq_id_src: int, seq_id_dst: int, p0: int, p1: int) -> None:
        """Give ``seq_id_dst`` the cells of ``seq_id_src`` with ``p0 <= pos < p1``.

        In one stream nothing is copied: ``seq_id_dst`` joins the cells' sequence sets.
        Across streams (``kv_unified=False``) the destination stream is emptied and gets the
        source's cells of ``seq_id_src`` (as ``seq_id_dst``, same indices, same pending
        shifts); the K/V rows are copied at the next [`update`][]. Only a full copy is
        supported there.

        Raises:
            KVCacheError: a sequence id out of range; a partial range across streams.
        """
        self._check_seq_id(seq_id_src)
        self._check_seq_id(seq_id_dst)
        s0 = self.seq_to_stream[seq_id_src]
        s1 = self.seq_to_stream[seq_id_dst]
        if s0 == s1:
            if seq_id_src == seq_id_dst:
                return
            p0 = max(p0, 0)
            p1 = POS_INF if p1 < 0 else p1
            cells = self.v_cells[s0]
            idxs = cells.seq_cells(seq_id_src, p0, p1)
            # llama.cpp asserts the cell lacks dst; a cell already shared keeps it
            cells.seq_add_cells(idxs[~cells.seq[idxs, seq_id_dst]], seq_id_dst)
            return
        size = self.get_size()
        if (0 < p0 and p0 + 1 < size) or (0 < p1 and p1 + 1 < size):
            raise KVCacheError(
                f"seq_cp across streams copies whole sequences: got [{p0}, {p1}), use p0 = p1 = -1"
            )
        self.sc_info.append((s0, s1))  # the K/V copy happens at the next update()
        src, dst = self.v_cells[s0], self.v_cells[s1]
        dst.reset()
        idxs = np.flatnonzero(src.seq[:, seq_id_src])  # every cell of seq_id_src
        shift = src.shift[idxs]  # (n,)
        dst.pos_set_cells(idxs, src.pos[idxs] - shift)
        dst.seq_add_cells(idxs, seq_id_dst)
        dst.pos_add_cells(idxs[shift != 0], shift[shift != 0])  # the same pending shifts
        self.v_heads[s1] = self.v_heads[s0]
    # --8<-- [end:seq_cp]

    # --8<-- [start:seq_keep]
    def seq_keep(self, seq_id: int) -> None:
        """Remove every sequence but ``seq_id`` from the cells of its stream.

        Raises:
            KVCacheError: ``seq_id`` out of range.
        """
        self._check_seq_id(seq_id)
        s = self.seq_to_stream[seq_id]
        cells = self.v_cells[s]
        freed = cells.seq_keep_cells(np.flatnonzero(cells.pos != -1), seq_id)
        self._lower_head(s, freed)
    # --8<-- [end:seq_keep]

    # --8<-- [start:seq_add]
    def seq_add(self, seq_id: int, p0: int, p1: int, shift: int) -> None:
        """Add ``shift`` to the positions of the cells of ``seq_id`` in ``[p0, p1)``.

        A cell is moved once, for *every* sequence that shares it (its position is one
        number): sharing sequences move too. A cell whose position goes below 0 is freed.
        No-op when ``shift == 0`` or the range is empty (``p0 == p1`` after ``p0 < 0 -> 0``,
        ``p1 < 0 -> inf``). The keys are re-roped at the next [`update`][]. The search head
        goes to the first freed cell, else to 0.

        Raises:
            KVCacheError: ``seq_id`` out of range.
        """
        self._check_seq_id(seq_id)
        s = self.seq_to_stream[seq_id]
        cells = self.v_cells[s]
        if shift == 0:
            return
        p0 = max(p0, 0)
        p1 = POS_INF if p1 < 0 else p1
        if p0 == p1:
            return
        freed = cells.pos_add_cells(cells.seq_cells(seq_id, p0, p1), shift)
        self.v_heads[s] = int(freed[0]) if freed.size else 0
    # --8<-- [end:seq_add]

    # --8<-- [start:seq_div]
    def seq_div(self, seq_id: int, p0: int, p1: int, d: int) -> None:
        """Divide the positions of the cells of ``seq_id`` in ``[p0, p1)`` by ``d``.

        Integer division (positions are >= 0). No-op when ``d == 1`` or the range is empty.
        Records the shift ``p // d - p`` (llama.cpp: the opposite sign; see the K-shift
        chapter).

        Raises:
            KVCacheError: ``seq_id`` out of range; ``d < 1`` (llama.cpp divides by it anyway).
        """
        self._check_seq_id(seq_id)
        if d < 1:
            raise KVCacheError(f"seq_div needs d >= 1, got {d}")
        cells = self.v_cells[self.seq_to_stream[seq_id]]
        if d == 1:
            return
        p0 = max(p0, 0)
        p1 = POS_INF if p1 < 0 else p1
        if p0 == p1:
            return
        cells.pos_div_cells(cells.seq_cells(seq_id, p0, p1), d)
    # --8<-- [end:seq_div]

    # --8<-- [start:seq_pos_min]
    def seq_pos_min(self, seq_id: int) -> int:
        """Smallest position of ``seq_id`` in the cache; -1 if it has none.

        Raises:
            KVCacheError: ``seq_id`` out of range.
        """
        self._check_seq_id(seq_id)
        return self.v_cells[self.seq_to_stream[seq_id]].seq_pos_min(seq_id)
    # --8<-- [end:seq_pos_min]

    # --8<-- [start:seq_pos_max]
    def seq_pos_max(self, seq_id: int) -> int:
        """Largest position of ``seq_id`` in the cache; -1 if it has none.

        Raises:
            KVCacheError: ``seq_id`` out of range.
        """
        self._check_seq_id(seq_id)
        return self.v_cells[self.seq_to_stream[seq_id]].seq_pos_max(seq_id)
    # --8<-- [end:seq_pos_max]

    # ---- placing ubatches -------------------------------------------------------------------

    # --8<-- [start:find_slot]
    def find_slot(self, ubatch, cont: bool = False) -> SlotInfo | None:
        """Cells for the tokens of ``ubatch``, without changing anything; None if none fit.

        ``llama_kv_cache::find_slot``. Per stream of the ubatch, the search starts at the
        stream's head (or at 0 when there are more than ``2 n_tokens`` free cells before
        it) and wraps around once. A cell can be used when it is empty, or when its only
        sequence has moved so far that the sliding window hides the cell from that
        sequence's next position (``is_masked_swa(pos, seq_pos_max + 1)``): such a cell
        is overwritten. ``cont=True`` asks for ``n_tokens`` consecutive cells (llama.cpp's
        decode uses ``cont=False``).

        With several streams the ubatch is ``n_seqs`` equal sets of tokens, set ``s`` of
        sequence ``seq_id_unq[s]`` (``split_equal``).

        Raises:
            KVCacheError: with several streams, a ubatch not made of equal one-sequence sets.
        """
        n_tokens, n_seqs = ubatch.n_tokens, 1
        if self.n_stream > 1:
            n_seqs = len(ubatch.seq_id_unq)
            if n_tokens % n_seqs:
                raise KVCacheError(f"{n_tokens} tokens do not split into {n_seqs} equal sets")
            n_tokens //= n_seqs
        strm, idxs = [], []
        for s in range(n_seqs):
            seq_id = ubatch.seq_id_unq[s]
            if self.n_stream > 1:
                set_ids = ubatch.seq_id[s * n_tokens: (s + 1) * n_tokens]
                if any(ids != (seq_id,) for ids in set_ids):
                    raise KVCacheError(f"token set {s} is not all of sequence {seq_id} alone")
            stream = self.seq_to_stream[seq_id]
            found = self._find_cells_fast(stream, n_tokens, cont)
            if found is None:
                return None
            strm.append(stream)
            idxs.append(tuple(found))
        return SlotInfo(tuple(strm), tuple(idxs))
    # --8<-- [end:find_slot]

    # --8<-- [start:find_cells]
    def _find_cells(self, stream: int, n_tokens: int, cont: bool) -> list[int] | None:
        r"""The search of ``find_slot`` in one stream: llama.cpp's loop, a cell at a time.

        From the head $h$ (or 0, when there are more than ``2 n_tokens`` free cells before
        it), a cell at a time, wrapping around once; a cell can be used when it is empty or
        hidden from its only sequence's next position by the window ([`_is_usable`][]):

        - ``cont=False``: the first ``n_tokens`` usable cells in the order
          $h, h+1, \dots, size-1, 0, \dots, h-1$;
        - ``cont=True``: the first window $[a, a + n_{tokens})$ of usable cells (not
          wrapping past the end) with $a \ge h$, else the first one with $a < h$.

        None when there are not enough usable cells (or ``n_tokens > size``). Every decode
        calls the fast path, [`_find_cells_fast`][].
        """
        cells = self.v_cells[stream]
        size = cells.size()
        head = self.v_heads[stream]
        # enough free cells before the head: better to fill the cache from the start
        if head > cells.get_used() + 2 * n_tokens:
            head = 0
        if n_tokens > size:
            return None
        if not cont:
            order = [*range(head, size), *range(head)]  # from the head, wrapping around once
            found = [i for i in order if self._is_usable(cells, i)]
            return found[:n_tokens] if len(found) >= n_tokens else None
        starts = [a for a in range(size - n_tokens + 1)
                  if all(self._is_usable(cells, i) for i in range(a, a + n_tokens))]
        if not starts:
            return None
        after = [a for a in starts if a >= head]
        a = after[0] if after else starts[0]
        return list(range(a, a + n_tokens))

    def _is_usable(self, cells: KVCells, i: int) -> bool:
        r"""Whether cell ``i`` can take a token: it is empty, or its only sequence $s$ has
        moved so far that the window hides the cell from $s$'s next position,
        $\mathrm{is\_masked\_swa}(pos_i,\ \mathrm{seq\_pos\_max}(s) + 1)$; such a cell
        is overwritten."""
        if cells.is_empty(i):
            return True
        if cells.seq_count(i) != 1:
            return False
        p_next = cells.seq_pos_max(cells.seq_get(i)) + 1
        return bool(is_masked_swa(self.n_swa, self.swa_type, cells.pos_get(i), p_next))
    # --8<-- [end:find_cells]

    # --8<-- [start:find_cells_fast]
    def _find_cells_fast(self, stream: int, n_tokens: int, cont: bool) -> list[int] | None:
        r"""Fast path of [`_find_cells`][]: the same cells, from the array of usable cells.

        ``cont=False`` (every decode) reads the cells in the rule's order a chunk at a time
        (``FIND_CHUNK`` cells, or ``2 n_tokens`` if more) and stops at the chunk where it
        has found enough: a decode whose head cell is free reads one chunk, not the whole
        cache. ``cont=True`` counts the usable cells of every window at once (a cumulative
        sum). ``tests/laws/test_kv_cache.py::test_the_slot_search_is_the_cell_by_cell_loop``
        holds it to the rule for every chunk size, head, window kind and cell state.
        """
        cells = self.v_cells[stream]
        size = cells.size()
        head = self.v_heads[stream]
        # enough free cells before the head: better to fill the cache from the start
        if head > cells.get_used() + 2 * n_tokens:
            head = 0
        if n_tokens > size:
            return None
        if not cont:
            step = max(FIND_CHUNK, 2 * n_tokens)
            found: list[int] = []
            for end, start in ((size, head), (head, 0)):  # head .. size - 1, then 0 .. head - 1
                for lo in range(start, end, step):
                    hi = min(lo + step, end)
                    found += (lo + np.flatnonzero(self._can_use(cells, lo, hi))).tolist()
                    if len(found) >= n_tokens:
                        return found[:n_tokens]
            return None
        usable = self._can_use(cells, 0, size)  # (size,)
        n_usable = np.concatenate([[0], np.cumsum(usable)])  # (size + 1,) usable in [0, j)
        starts = np.flatnonzero(n_usable[n_tokens:] - n_usable[:-n_tokens] == n_tokens)
        if not starts.size:
            return None
        after = starts[starts >= head]
        a = int(after[0] if after.size else starts[0])
        return list(range(a, a + n_tokens))

    def _can_use(self, cells: KVCells, lo: int, hi: int) -> np.ndarray:
        r"""[`_is_usable`][] for every cell of ``lo .. hi``, as arrays: empty, or held by
        one sequence whose sliding window no longer reaches it.

        $$ u_i = pos_i = -1 \;\vee\; \big(|seq_i| = 1 \wedge
           \mathrm{is\_masked\_swa}(pos_i,\ \mathrm{seq\_pos\_max}(s_i) + 1)\big) $$

        with $s_i$ the only sequence of cell $i$. Returns ``(hi - lo,)`` bool.
        """
        pos = cells.pos[lo:hi]  # (hi - lo,)
        usable = pos == -1  # (hi - lo,)
        if self.swa_type == SWA_TYPE_NONE:  # without a window no held cell is hidden
            return usable
        # the sequences that hold cells: a cell's row has its bits among them only
        live = np.array([s for s, pairs in enumerate(cells.seq_pos) if pairs], dtype=np.int64)
        if not live.size:
            return usable
        held = cells.seq[lo:hi, live]  # (hi - lo, n_live)
        alone = held.sum(axis=1) == 1  # (hi - lo,) one sequence
        s_only = np.argmax(held, axis=1)  # (hi - lo,) which one (among live)
        p_next = np.array([cells.seq_pos_max(s) + 1 for s in live.tolist()])[s_only]
        return usable | (alone & is_masked_swa(self.n_swa, self.swa_type, pos, p_next))
    # --8<-- [end:find_cells_fast]

    # --8<-- [start:apply_ubatch]
    def apply_ubatch(self, placement: SlotInfo, ubatch) -> None:
        """Write the ubatch's positions and sequence ids into the cells of its slot.

        ``placement`` is the ubatch's [`SlotInfo`][] (from [`prepare`][]).

        ``llama_kv_cache::apply_ubatch``. A cell being reused (SWA-masked, one sequence) is
        emptied first; then, so that every position between a sequence's ``pos_min`` and
        ``pos_max`` stays present, every cell of that sequence at or below the largest
        overwritten position is removed (``seq_rm``). The head moves past the slot.
        """
        seq_pos_max_rm: dict[int, int] = {}
        n = placement.size()
        for s, (stream, idxs) in enumerate(zip(placement.strm, placement.idxs, strict=True)):
            cells = self.v_cells[stream]
            idxs = np.array(idxs, dtype=np.int64)  # (n,) the set's cells
            tokens = range(s * n, (s + 1) * n)  # the set's tokens in the ubatch
            reused = idxs[cells.pos[idxs] != -1]  # each held by one sequence (find_slot)
            for idx in reused.tolist():
                seq_id = cells.seq_get(idx)
                seq_pos_max_rm[seq_id] = max(seq_pos_max_rm.get(seq_id, -1), cells.pos_get(idx))
            cells.rm_cells(reused)
            seq = np.zeros((n, LLAMA_MAX_SEQ), dtype=bool)  # each token's sequences
            for j, i in enumerate(tokens):
                seq[j, list(ubatch.seq_id[i])] = True
            cells.fill_cells(idxs, ubatch.pos[s * n: (s + 1) * n], seq)  # pos_set, seq_add
        for seq_id, p_max in sorted(seq_pos_max_rm.items()):
            cells = self.v_cells[self.seq_to_stream[seq_id]]
            if cells.seq_pos_min(seq_id) <= p_max:
                self.seq_rm(seq_id, cells.seq_pos_min(seq_id), p_max + 1)
        for stream, idxs in zip(placement.strm, placement.idxs, strict=True):
            self.v_heads[stream] = idxs[-1] + 1
    # --8<-- [end:apply_ubatch]

    # --8<-- [start:prepare]
    def prepare(self, ubatches: list) -> list[SlotInfo] | None:
        """Slots for all ``ubatches`` or for none: place them in order, then restore.

        ``llama_kv_cache::prepare``: each ubatch is placed ([`find_slot`][] then
        [`apply_ubatch`][]) so that the next one sees it; then the cells and heads are
        restored. Returns None when a ubatch does not fit (decode's return code 1).

        llama.cpp restores only the cells of the slots, so the SWA purge of
        [`apply_ubatch`][] (which touches other cells) and the heads of streams other
        than stream 0 are not restored after a failure. Here the cells and heads are
        restored exactly (a divergence; decode's "memory unchanged" holds), by the cells'
        undo journal ([`undone`][]): the cost is what the ubatches changed. The purge leaks
        after a success too: when a later ubatch of the batch reuses a cell whose position
        an earlier ubatch's window still needs, llama.cpp computes the earlier ubatch without
        it, and its logits depend on ``n_ubatch`` (``tests/oracle/test_iswa.py``,
        ``test_llamacpp_prepare_leaks_the_swa_purge_divergence``); here they do not.
        """
        res: list[SlotInfo] = []
        with self.undone():
            for k, ubatch in enumerate(ubatches):
                sinfo = self.find_slot(ubatch, cont=False)
                if sinfo is None:
                    return None
                res.append(sinfo)
                if k + 1 < len(ubatches):  # only a next ubatch reads where this one went
                    self.apply_ubatch(sinfo, ubatch)
        return res

    @contextmanager
    def undone(self) -> Iterator[None]:
        """Whatever changes the cells and heads inside the ``with`` is undone on leaving it.

        The journal of every stream's [`KVCells`][] (``begin`` / ``rollback``) and a
        copy of the heads (one number per stream).
        """
        heads = list(self.v_heads)
        for cells in self.v_cells:
            cells.begin()
        try:
            yield
        finally:
            for cells in self.v_cells:
                cells.rollback()
            self.v_heads = heads
    # --8<-- [end:prepare]

    # --8<-- [start:init_batch]
    def init_batch(self, balloc: BatchAllocr, n_ubatch: int,
                   embd_all: bool = False) -> MemoryContext:
        """Split a validated batch and place every ubatch (``llama_kv_cache::init_batch``).

        One stream: ``split_simple`` (the next ``n_ubatch`` tokens in batch order). One
        stream per sequence: ``split_equal(sequential=True)`` (equal runs of consecutive
        sequences, each ubatch touching each stream once). Then [`prepare`][].

        Args:
            balloc: the validated batch.
            n_ubatch: the most tokens per ubatch.
            embd_all: every token outputs embeddings (no effect on the KV cache's split).

        Returns:
            A [`MemoryContext`][reference.memory.interface.MemoryContext] of the ubatches and their
            [`SlotInfo`][]; ``FAILED_PREPARE`` (decode's 1) when the batch cannot be split
            or a ubatch finds no slot, the cells then unchanged.
        """
        if self.n_stream == 1:
            return batch_context(self, balloc, lambda: balloc.split_simple(n_ubatch))
        return batch_context(self, balloc, lambda: balloc.split_equal(n_ubatch, sequential=True))
    # --8<-- [end:init_batch]

    # --8<-- [start:init_update]
    def init_update(self, rope_factors: np.ndarray | None = None) -> MemoryContext:
        """The pending update, if any (``llama_kv_cache::init_update``).

        ``NO_UPDATE`` when no position changed since the last update (the cells'
        ``has_shift`` flags, as llama.cpp) and no stream copy is pending; otherwise a context
        whose ``apply()`` runs [`update`][].
        """
        if not any(cells.get_has_shift() for cells in self.v_cells) and not self.sc_info:
            return MemoryContext(self, MemoryStatus.NO_UPDATE)
        return MemoryContext(self, MemoryStatus.SUCCESS, rope_factors=rope_factors)
    # --8<-- [end:init_update]

    # --8<-- [start:get_n_kv]
    def get_n_kv(self, sinfo: SlotInfo) -> int:
        r"""How many cells of each stream the ubatch reads (``get_n_kv``).

        The used range padded to 256 (or to ``n_pad`` when larger), at least 256, at most
        the stream size, maximised over the slot's streams:

        $$ n_{kv} = \max_s \min\big(size,\ \max(P,\ \lceil used\_max\_p1_s / P \rceil P)\big),
           \quad P = \max(n_{pad}, 256). $$

        The padding keeps the graph's shapes constant across batches; the extra cells are
        masked out.
        """
        n_pad_cur = max(self.n_pad, 256)
        result = 0
        for stream in sinfo.strm:
            cells = self.v_cells[stream]
            padded = max(n_pad_cur, ggml_pad(cells.used_max_p1(), n_pad_cur))
            result = max(result, min(cells.size(), padded))
        return result
    # --8<-- [end:get_n_kv]

    # --8<-- [start:attn_input]
    def attn_input(self, ubatch, sinfo: SlotInfo) -> KVCacheAttnInput:
        """The [`KVCacheAttnInput`][] of ``ubatch`` (call after [`apply_ubatch`][])."""
        return KVCacheAttnInput(self, ubatch, sinfo)

    def graph_input(self, placement: SlotInfo, ubatch) -> KVCacheAttnInput:
        """The memory interface's name for [`attn_input`][] (placement first)."""
        return self.attn_input(ubatch, placement)
    # --8<-- [end:attn_input]

    # --8<-- [start:remove_ubatch]
    def remove_ubatch(self, placement: SlotInfo, ubatch) -> None:
        """Undo an applied ubatch that was not computed: ``seq_rm(s, pos_min_s, -1)``.

        llama.cpp's decode does this when a ubatch's compute fails or is aborted, for the
        *first* seq id of each token only; a token shared by several sequences then stays
        in the others, its K/V possibly unwritten. Here every seq id of the ubatch is
        cleaned (a divergence, see [`reference.context`][reference.context]'s chapter). The
        placement is not needed: positions say what to remove.
        """
        pos_min: dict[int, int] = {}
        for p, ids in zip(ubatch.pos.tolist(), ubatch.seq_id, strict=True):
            for s in ids:
                pos_min[s] = min(pos_min.get(s, p), p)
        for s, p in sorted(pos_min.items()):
            self.seq_rm(s, p, -1)
    # --8<-- [end:remove_ubatch]

    # --8<-- [start:update]
    def update(self, rope_factors: np.ndarray | None = None) -> bool:
        """Apply the pending stream copies, then the K-shift (``llama_kv_cache::update``).

        Stream copies (from ``seq_cp`` across streams) copy the K/V rows of the whole
        stream ([`copy_stream`][]). The K-shift turns the key of every cell with a non-zero
        recorded shift by that shift ([`apply_k_shift`][]), in every layer, then forgets
        the shifts. (llama.cpp turns every cell, by 0 for the others: the identity, except
        that under YaRN it rescales them, see [`k_shift_rope_params`][].)

        Args:
            rope_factors: the model's ``rope_freqs.weight``, if it has one.

        Returns:
            True when a K-shift turned some key.
        """
        for ssrc, sdst in self.sc_info:
            self.copy_stream(ssrc, sdst)
        self.sc_info = []
        if not self.get_has_shift():
            for cells in self.v_cells:  # a flag set by shifts that turn no key: forget it
                if cells.get_has_shift():
                    cells.reset_shift()
            return False
        for s, cells in enumerate(self.v_cells):
            rows = np.flatnonzero(cells.shift)  # (n_rows,) the cells that owe a turn (non-empty)
            if rows.size:
                self.apply_k_shift(s, rows.tolist(), cells.shift[rows], rope_factors)
            cells.reset_shift()
        return True
    # --8<-- [end:update]

    # --8<-- [start:apply_k_shift]
    def apply_k_shift(self, stream: int, rows: list[int], shift: np.ndarray,
                      rope_factors: np.ndarray | None = None) -> None:
        """The array step of [`update`][]: turn the keys of ``rows`` of ``stream`` by ``shift``.

        In every layer of the cache, [`build_rope_shift`][] with that layer's RoPE parameters
        on the rows' keys, written back in place.

        Args:
            stream: the stream.
            rows: cell indices ``(n_rows,)``.
            shift: the shift of each row ``(n_rows,)``.
            rope_factors: the model's ``rope_freqs.weight`` or None.
        """
        hp = self.hparams
        for il, k in zip(self.layers, self.k_l, strict=True):
            k_rows = k[stream, rows].reshape(len(rows), hp.n_head_kv, hp.n_embd_head_k)
            k_rows = build_rope_shift(k_rows, shift, hp, rope_factors, il)
            k[stream, rows] = k_rows.reshape(len(rows), -1)  # (n_rows, n_embd_k_gqa)

    def copy_stream(self, ssrc: int, sdst: int) -> None:
        """The other array step of [`update`][]: stream ``sdst``'s K/V rows become ``ssrc``'s."""
        for t in self.k_l + self.v_l:
            t[sdst] = t[ssrc]
    # --8<-- [end:apply_k_shift]

    # ---- state (reference/memory/state.py) --------------------------------------------------

    # --8<-- [start:state]
    @contextmanager
    def on_host(self) -> Iterator[None]:
        """The K/V tensors as NumPy arrays inside the ``with``: already so in the reference.

        The state functions of [`reference.memory.state`][reference.memory.state] read and write
        ``k_l``/``v_l`` as NumPy; a twin whose tensors live elsewhere overrides this to move them
        for the duration
        ([`accelerated.memory.KVCache.on_host`][accelerated.memory.kv_cache.KVCache.on_host]).
        """
        yield

    def state_write(self, hparams: LlamaHParams, seq_id: int = -1,
                    flags: int = state_io.LLAMA_STATE_SEQ_FLAGS_NONE) -> bytes:
        """The memory, or one sequence, as bytes:
        [`reference.memory.state.state_write`][reference.memory.state.state_write].

        ``flags``: a cache alone has no partial state, so ``PARTIAL_ONLY`` writes everything,
        the same bytes (``llama_kv_cache::state_write`` ignores its flags).
        """
        state_io.check_state_flags(flags)
        with self.on_host():
            return state_io.state_write(self, hparams, seq_id)

    def state_read(self, hparams: LlamaHParams, data: bytes, dest_seq_id: int = -1,
                   flags: int = state_io.LLAMA_STATE_SEQ_FLAGS_NONE) -> None:
        """Restore a blob of [`state_write`][]:
        [`reference.memory.state.state_read`][reference.memory.state.state_read] (``flags`` as
        [`state_write`][])."""
        self.state_apply(self.state_prepare(hparams, data, dest_seq_id, flags), dest_seq_id)

    def state_prepare(self, hparams: LlamaHParams, data: bytes, dest_seq_id: int = -1,
                      flags: int = state_io.LLAMA_STATE_SEQ_FLAGS_NONE) -> state_io.KVState:
        """The checks of [`state_read`][], nothing changed:
        [`reference.memory.state.state_prepare`][reference.memory.state.state_prepare]."""
        state_io.check_state_flags(flags)
        return state_io.state_prepare(self, hparams, data, dest_seq_id)

    def state_apply(self, state: state_io.KVState, dest_seq_id: int = -1) -> None:
        """Restore what [`state_prepare`][] accepted:
        [`reference.memory.state.state_apply`][reference.memory.state.state_apply]."""
        with self.on_host():
            state_io.state_apply(self, state, dest_seq_id)

    def state_save_file(self, path: str | Path, hparams: LlamaHParams, tokens: ArrayLike,
                        seq_id: int = -1) -> int:
        """Save to a file
        ([`reference.memory.state.state_save_file`][reference.memory.state.state_save_file]); its
        size."""
        with self.on_host():
            return state_io.state_save_file(path, self, hparams, tokens, seq_id)

    def state_load_file(self, path: str | Path, hparams: LlamaHParams,
                        dest_seq_id: int = -1) -> np.ndarray:
        """Restore a file
        ([`reference.memory.state.state_load_file`][reference.memory.state.state_load_file]); its
        tokens."""
        with self.on_host():
            return state_io.state_load_file(path, self, hparams, dest_seq_id)
    # --8<-- [end:state]
# --8<-- [end:KVCache]
