r"""The iSWA cache: ``llama_kv_cache_iswa`` (``src/llama-kv-cache-iswa.cpp``) in NumPy.

A model whose layers attend through a sliding window (SWA layers) next to layers that see
the whole context (Gemma 2: one of each; Gemma 3: five SWA layers per full one) gets two
[`KVCache`][reference.memory.kv_cache.KVCache]s, each over its own layers
([`KVCache`][reference.memory.kv_cache.KVCache]'s ``layers``: llama.cpp's layer ``filter``):

| cache | layers | window | cells per stream |
|---|---|---|---|
| base | ``not hparams.is_swa(il)`` | none (``SWA_TYPE_NONE``) | $kv\_size$ (``n_ctx_seq``) |
| SWA | ``hparams.is_swa(il)`` | ``n_swa``, ``swa_type`` | $kv\_size_{swa}$ |

$$
kv\_size_{swa} = \mathrm{PAD}\big(\min(kv\_size,\ n_{swa} \cdot n_{seqs} + n_{ubatch}),\ 256\big),
\qquad n_{seqs} = n_{seq\_max} \text{ if unified, else } 1,
$$

or $kv\_size$ with ``swa_full`` ([`kv_size_swa`][reference.memory.kv_cache.kv_size_swa]). A SWA
layer only ever reads the last $n_{swa}$ positions of a sequence, so its cache may forget
the rest: a cell whose only sequence has moved past the window is reused by the slot search
once the window hides it from the sequence's next position
(``is_masked_swa(pos, seq_pos_max + 1)``, `KVCache._can_use`). The base cache keeps every
position.

The rules ([`KVCacheISWA`][] implements the memory interface
[`reference.memory.interface.Memory`][reference.memory.interface.Memory]):

- ``init_batch`` splits the batch *once* and prepares both caches: ``split_simple`` on one
  stream, falling back to ``split_equal`` when a cache finds no slot for it; one stream per
  sequence: ``split_equal(sequential=True)``. A placement is a pair of slots, one per cache
  ([`ISWAPlacement`][]); if either cache has no room the batch is refused (decode's 1) and
  neither changed;
- ``seq_rm``, ``seq_cp``, ``seq_keep``, ``seq_add``, ``seq_div``, ``clear`` go to both
  caches; ``seq_pos_min`` / ``seq_pos_max`` come from the SWA cache (the base cache holds a
  superset of its positions);
- ``can_shift``: both caches can, *and* they have the same size (``get_can_shift``): a SWA
  cache that forgot positions cannot follow a context shift; ``update`` (the K-shift, with
  each layer's own RoPE base and scale) runs on both;
- the graph input ([`KVCacheISWAAttnInput`][], ``llm_graph_input_attn_kv_iswa``) holds one
  input per cache, two KQ masks per ubatch, and sends ``get_k``/``get_v``/``cpy_k``/``cpy_v``/
  ``get_kq_mask`` of layer ``il`` to the SWA cache when ``hparams.is_swa(il)``, else to
  the base cache;
- state: ``state_write(flags=NONE)`` writes the base cache then the SWA cache (as
  llama.cpp); ``PARTIAL_ONLY`` (alias ``SWA_ONLY``) the SWA cache only, the partial state a
  server keeps per checkpoint while the base cache's part of the sequence stays in place.

What differs from llama.cpp:

- the state blob is llamaref's ([`reference.memory.state`][reference.memory.state]): the two
  caches' blobs in an envelope (magic ``LRIS``, flags, each part's layers, checksum:
  [`KVCacheISWA.state_write`][reference.memory.kv_cache_iswa.KVCacheISWA.state_write]), so
  that a partial blob read without ``PARTIAL_ONLY`` (or the reverse) or a part written for
  other layers is refused. llama.cpp writes the two blobs back to
  back, and reading one with the other flag fails somewhere inside (or, for two caches of
  the same shape, loads the SWA part into the base cache);
- a refused restore changes nothing: every part is checked (and its room found) before any
  is written. llama.cpp restores the base cache before it reads the SWA part, and clears
  the destination on a failure;
- a model whose every layer is SWA (our Mistral-style ``llama`` models with ``n_swa > 0``)
  gets this pair too, with a base cache of no layers, as ``llama_model::create_memory``
  builds it for any ``swa_type``: its cells still bound the context at ``kv_size``
  positions, and ``can_shift`` is False when ``swa_full`` is off.
"""

from __future__ import annotations

from pathlib import Path
from typing import NamedTuple

import numpy as np
from numpy.typing import ArrayLike, DTypeLike

from reference.batch import BatchAllocr, Ubatch
from reference.hparams import SWA_TYPE_NONE, LlamaHParams
from reference.memory import state as state_io
from reference.memory.blob import BlobWriter, StateError, check_tokens, seal, unseal
from reference.memory.interface import MemoryContext, MemoryStatus, batch_context
from reference.memory.kv_cache import KVCache, KVCacheAttnInput, KVCacheError, SlotInfo, kv_size_swa

# --8<-- [start:constants]
ISWA_STATE_MAGIC = b"LRIS"  # an iSWA blob: the parts of the two caches
ISWA_STATE_VERSION = 1
# --8<-- [end:constants]


# --8<-- [start:ISWAPlacement]
class ISWAPlacement(NamedTuple):
    """Where a ubatch goes in each cache: a [`SlotInfo`][reference.memory.kv_cache.SlotInfo] per
    cache (``llama_kv_cache_iswa_context``'s ``sinfos_base`` / ``sinfos_swa``)."""

    base: SlotInfo
    swa: SlotInfo
# --8<-- [end:ISWAPlacement]


# --8<-- [start:KVCacheISWAAttnInput]
class KVCacheISWAAttnInput:
    """The attention input of one ubatch over the two caches (``llm_graph_input_attn_kv_iswa``).

    Implements [`reference.models.llama.AttnInput`][reference.models.llama.AttnInput]: layer
    ``il`` reads and writes the SWA cache's input when ``hparams.is_swa(il)``, else the base
    cache's. Each input has its own ``n_kv``, cells and KQ mask (the SWA one with the window).

    Attributes:
        base: the base cache's [`KVCacheAttnInput`][reference.memory.kv_cache.KVCacheAttnInput].
        swa: the SWA cache's.

    Examples:
        >>> from reference.batch import Batch, BatchAllocr
        >>> from reference.hparams import swa_pattern
        >>> from reference.testing import tiny_hparams
        >>> import dataclasses
        >>> hp = dataclasses.replace(tiny_hparams(n_swa=2), swa_layers=swa_pattern(2, 2))
        >>> mem = KVCacheISWA(hp, kv_size=8)
        >>> balloc = BatchAllocr(Batch(token=[1, 2, 3]), n_vocab=32, n_seq_max=1, memory=mem)
        >>> mctx = mem.init_batch(balloc, n_ubatch=8)
        >>> _ = mctx.apply()
        >>> inp = mctx.graph_input()
        >>> (inp.get_kq_mask(0)[2] == 0).tolist()[:3], (inp.get_kq_mask(1)[2] == 0).tolist()[:3]
        ([False, True, True], [True, True, True])
    """

    def __init__(self, hparams: LlamaHParams, base: KVCacheAttnInput, swa: KVCacheAttnInput):
        self.hparams, self.base, self.swa = hparams, base, swa
        self.n_stream = base.n_stream  # both caches place the ubatch on the same streams

    def layer_input(self, il: int) -> KVCacheAttnInput:
        """The input of the cache that holds layer ``il``."""
        return self.swa if self.hparams.is_swa(il) else self.base

    def cpy_k(self, il: int, k_cur) -> None:
        """Store ``k_cur`` ``(n_tokens, n_head_kv, d_k)`` in layer ``il``'s cache."""
        self.layer_input(il).cpy_k(il, k_cur)

    def cpy_v(self, il: int, v_cur) -> None:
        """Store ``v_cur`` ``(n_tokens, n_head_kv, d_v)`` in layer ``il``'s cache."""
        self.layer_input(il).cpy_v(il, v_cur)

    def get_k(self, il: int):
        """Keys of layer ``il`` in view, ``n_kv`` of its cache: ``(n_kv, n_head_kv, d_k)``, or
        ``(ns, n_kv, n_head_kv, d_k)`` for several streams (``KVCacheAttnInput.get_k``)."""
        return self.layer_input(il).get_k(il)

    def get_v(self, il: int):
        """Values of layer ``il`` in view, shaped as ``get_k``'s keys (``d_v`` last)."""
        return self.layer_input(il).get_v(il)

    def get_kq_mask(self, il: int):
        """The KQ mask of layer ``il``'s cache ``(n_tokens, ns * n_kv)``: ``self_kq_mask_swa``
        for a SWA layer, ``self_kq_mask`` otherwise."""
        return self.layer_input(il).get_kq_mask(il)
# --8<-- [end:KVCacheISWAAttnInput]


# --8<-- [start:KVCacheISWA]
class KVCacheISWA:
    """Two KV caches, for the full-attention and the SWA layers (``llama_kv_cache_iswa``).

    Args:
        hparams: the model's hyperparameters; ``swa_type`` must be set
            (``hparams.is_swa(il)`` says which layers are SWA).
        kv_size: cells per stream of the base cache (llama_context's ``n_ctx_seq``).
        n_seq_max: the number of sequences (and of streams when not unified).
        kv_unified: one stream shared by all sequences, or one per sequence.
        swa_full: the SWA cache gets ``kv_size`` cells too; otherwise
            [`kv_size_swa`][reference.memory.kv_cache.kv_size_swa].
        n_ubatch: the ubatch size (sizes the SWA cache).
        n_pad: as [`KVCache`][reference.memory.kv_cache.KVCache] (llama.cpp: 1).
        dtype: dtype of K, V and the masks.

    Raises:
        KVCacheError: a model without a window type; as
            [`KVCache`][reference.memory.kv_cache.KVCache].

    Examples:
        >>> import dataclasses
        >>> from reference.hparams import swa_pattern
        >>> from reference.testing import tiny_hparams
        >>> hp = dataclasses.replace(tiny_hparams(n_layer=6, n_swa=4),
        ...                          swa_layers=swa_pattern(6, 6))
        >>> mem = KVCacheISWA(hp, kv_size=1024, n_ubatch=8, swa_full=False)
        >>> mem.kv_base.layers, mem.kv_swa.layers
        ((5,), (0, 1, 2, 3, 4))
        >>> mem.kv_base.get_size(), mem.kv_swa.get_size(), mem.can_shift()
        (1024, 256, False)
    """

    cache_class: type[KVCache] = KVCache  # the twin puts its own cache class here
    input_class: type = KVCacheISWAAttnInput

    def __init__(self, hparams: LlamaHParams, kv_size: int, n_seq_max: int = 1,
                 kv_unified: bool = True, swa_full: bool = True, n_ubatch: int = 512,
                 n_pad: int = 1, dtype: DTypeLike = np.float32):
        if hparams.swa_type == SWA_TYPE_NONE:
            raise KVCacheError("an iSWA cache needs a model with a sliding window (swa_type)")
        self.hparams = hparams
        self.n_seq_max = n_seq_max
        self.kv_unified = kv_unified
        self.dtype = np.dtype(dtype)
        layers_swa = [il for il in range(hparams.n_layer) if hparams.is_swa(il)]
        layers_base = [il for il in range(hparams.n_layer) if not hparams.is_swa(il)]
        size_swa = kv_size if swa_full else kv_size_swa(
            kv_size, hparams.n_swa, n_seq_max, n_ubatch, kv_unified)
        common = dict(n_seq_max=n_seq_max, kv_unified=kv_unified, n_pad=n_pad, dtype=dtype)
        self.kv_base = self.cache_class(hparams, kv_size, layers=layers_base, n_swa=0,
                                        swa_type=SWA_TYPE_NONE, **common)
        self.kv_swa = self.cache_class(hparams, size_swa, layers=layers_swa, **common)

    def get_base(self) -> KVCache:
        """The cache of the full-attention layers (``get_base``)."""
        return self.kv_base

    def get_swa(self) -> KVCache:
        """The cache of the SWA layers (``get_swa``)."""
        return self.kv_swa

    def caches(self) -> tuple[KVCache, KVCache]:
        """``(base, swa)``, in the order llama.cpp visits them."""
        return self.kv_base, self.kv_swa

    # ---- sizes -----------------------------------------------------------------------------

    def get_size(self) -> int:
        """Cells per stream of the base cache (the context's size)."""
        return self.kv_base.get_size()

    def get_n_stream(self) -> int:
        """Number of streams (the same in both caches)."""
        return self.kv_base.get_n_stream()

    def can_shift(self) -> bool:
        """Both caches can shift and have the same size (``get_can_shift``)."""
        return (self.kv_base.can_shift() and self.kv_swa.can_shift()
                and self.kv_base.get_size() == self.kv_swa.get_size())

    # ---- the memory API: both caches ---------------------------------------------------------

    # --8<-- [start:seq_ops]
    def clear(self, data: bool = True) -> None:
        """Empty both caches (``clear``)."""
        for cache in self.caches():
            cache.clear(data)

    def seq_rm(self, seq_id: int, p0: int, p1: int) -> bool:
        """``seq_rm`` in both caches; True when both did it (always, for KV caches)."""
        return all([cache.seq_rm(seq_id, p0, p1) for cache in self.caches()])

    def seq_cp(self, seq_id_src: int, seq_id_dst: int, p0: int, p1: int) -> None:
        """``seq_cp`` in both caches.

        The base cache goes first: it refuses everything the SWA cache would (a partial copy
        across streams is judged against the cache size, and the base cache is the larger),
        so a refusal comes before any change.
        """
        for cache in self.caches():
            cache.seq_cp(seq_id_src, seq_id_dst, p0, p1)

    def seq_keep(self, seq_id: int) -> None:
        """``seq_keep`` in both caches."""
        for cache in self.caches():
            cache.seq_keep(seq_id)

    def seq_add(self, seq_id: int, p0: int, p1: int, shift: int) -> None:
        """``seq_add`` in both caches (each re-ropes its keys at its next update)."""
        for cache in self.caches():
            cache.seq_add(seq_id, p0, p1, shift)

    def seq_div(self, seq_id: int, p0: int, p1: int, d: int) -> None:
        """``seq_div`` in both caches."""
        for cache in self.caches():
            cache.seq_div(seq_id, p0, p1, d)

    def seq_pos_min(self, seq_id: int) -> int:
        """Smallest position of ``seq_id``, from the SWA cache (the base holds a superset)."""
        return self.kv_swa.seq_pos_min(seq_id)

    def seq_pos_max(self, seq_id: int) -> int:
        """Largest position of ``seq_id``, from the SWA cache."""
        return self.kv_swa.seq_pos_max(seq_id)
    # --8<-- [end:seq_ops]

    # ---- placing ubatches ------------------------------------------------------------------

    # --8<-- [start:init_batch]
    def init_batch(self, balloc: BatchAllocr, n_ubatch: int,
                   embd_all: bool = False) -> MemoryContext:
        """Split once, prepare both caches (``llama_kv_cache_iswa::init_batch``).

        One stream: ``split_simple``; if the split or a cache's ``prepare`` fails,
        ``split_equal`` (non sequential) is tried next. One stream per sequence:
        ``split_equal(sequential=True)``. ``FAILED_PREPARE`` (decode's 1) when nothing
        works; neither cache changed then.
        """
        if self.kv_unified:
            mctx = batch_context(self, balloc, lambda: balloc.split_simple(n_ubatch))
            if mctx.get_status() == MemoryStatus.SUCCESS:
                return mctx
        sequential = not self.kv_unified
        return batch_context(self, balloc, lambda: balloc.split_equal(n_ubatch, sequential))

    def prepare(self, ubatches: list[Ubatch]) -> list[ISWAPlacement] | None:
        """A slot in each cache for every ubatch, or None (each cache restores itself)."""
        sinfos_base = self.kv_base.prepare(ubatches)
        if sinfos_base is None:
            return None
        sinfos_swa = self.kv_swa.prepare(ubatches)
        if sinfos_swa is None:
            return None
        return [ISWAPlacement(b, s) for b, s in zip(sinfos_base, sinfos_swa, strict=True)]
    # --8<-- [end:init_batch]

    def apply_ubatch(self, placement: ISWAPlacement, ubatch: Ubatch) -> None:
        """Write the ubatch's cells in both caches (each reuses its own masked cells)."""
        self.kv_base.apply_ubatch(placement.base, ubatch)
        self.kv_swa.apply_ubatch(placement.swa, ubatch)

    def graph_input(self, placement: ISWAPlacement, ubatch: Ubatch) -> KVCacheISWAAttnInput:
        """The [`KVCacheISWAAttnInput`][] of ``ubatch`` (after [`apply_ubatch`][])."""
        return self.input_class(self.hparams, self.kv_base.attn_input(ubatch, placement.base),
                                self.kv_swa.attn_input(ubatch, placement.swa))

    def remove_ubatch(self, placement: ISWAPlacement, ubatch: Ubatch) -> None:
        """Undo an applied ubatch that was not computed, in both caches."""
        self.kv_base.remove_ubatch(placement.base, ubatch)
        self.kv_swa.remove_ubatch(placement.swa, ubatch)

    # --8<-- [start:update]
    def init_update(self, rope_factors: np.ndarray | None = None) -> MemoryContext:
        """``NO_UPDATE`` when neither cache has a pending update, else one for both."""
        if all(cache.init_update().get_status() == MemoryStatus.NO_UPDATE
               for cache in self.caches()):
            return MemoryContext(self, MemoryStatus.NO_UPDATE)
        return MemoryContext(self, MemoryStatus.SUCCESS, rope_factors=rope_factors)

    def update(self, rope_factors: np.ndarray | None = None) -> bool:
        """Stream copies and K-shift in both caches; True when some key was turned."""
        turned = [cache.update(rope_factors) for cache in self.caches()]
        return any(turned)
    # --8<-- [end:update]

    # ---- state -------------------------------------------------------------------------------

    # --8<-- [start:state]
    def state_parts(self, flags: int) -> tuple[KVCache, ...]:
        """The caches a state with ``flags`` holds: base then SWA, or the SWA one alone."""
        state_io.check_state_flags(flags)
        if flags & state_io.LLAMA_STATE_SEQ_FLAGS_PARTIAL_ONLY:
            return (self.kv_swa,)
        return self.kv_base, self.kv_swa

    def state_write(self, hparams: LlamaHParams, seq_id: int = -1,
                    flags: int = state_io.LLAMA_STATE_SEQ_FLAGS_NONE) -> bytes:
        """The memory, or one sequence, as bytes (``llama_kv_cache_iswa::state_write``).

        | field | type |
        |---|---|
        | magic ``b"LRIS"``, version, total size | 4 bytes, u32, u64 |
        | flags, n_part | u32, u32 (2: base then SWA; 1: SWA, for ``PARTIAL_ONLY``) |
        | *per part* | ``n_layer`` u32, its layers i32 each, size u64, the cache's blob |
        | checksum | SHA-256 of every byte before it |

        Each part is its cache's blob
        ([`reference.memory.state.state_write`][reference.memory.state.state_write]: a
        sequence's cells that the cache's window hides are not saved).

        Raises:
            StateError: flags other than 0 and 1; as the caches' ``state_write``.

        Examples:
            >>> import dataclasses
            >>> from reference.hparams import swa_pattern
            >>> from reference.testing import tiny_hparams
            >>> hp = dataclasses.replace(tiny_hparams(n_swa=2), swa_layers=swa_pattern(2, 2))
            >>> mem = KVCacheISWA(hp, kv_size=8)
            >>> whole, partial = mem.state_write(hp, 0), mem.state_write(hp, 0, flags=1)
            >>> whole[:4], len(whole) > len(partial)
            (b'LRIS', True)
        """
        parts = self.state_parts(flags)
        body = BlobWriter()
        body.write("II", flags, len(parts))
        for cache in parts:
            blob = cache.state_write(hparams, seq_id)
            body.write("I", len(cache.layers))
            for il in cache.layers:
                body.write("i", il)
            body.write("Q", len(blob))
            body.write_bytes(blob)
        return seal(ISWA_STATE_MAGIC, ISWA_STATE_VERSION, body.getvalue())

    def state_read(self, hparams: LlamaHParams, data: bytes, dest_seq_id: int = -1,
                   flags: int = state_io.LLAMA_STATE_SEQ_FLAGS_NONE) -> None:
        """Restore a blob of [`state_write`][] written with the same ``flags``.

        Every part is checked, and a sequence's room found, in both caches before either
        changes ([`reference.memory.state.state_prepare`][reference.memory.state.state_prepare]).

        Raises:
            StateError: flags other than 0 and 1; a blob that is not an iSWA blob, truncated
                or corrupted; written with other flags (a partial blob for a whole read, or
                the reverse); a part for other layers; any refusal of a part. The memory is
                then exactly as before.
        """
        parts = self.state_parts(flags)
        blobs = parse_iswa_state(data, flags, [cache.layers for cache in parts])
        states = [cache.state_prepare(hparams, blob, dest_seq_id)
                  for cache, blob in zip(parts, blobs, strict=True)]
        for cache, st in zip(parts, states, strict=True):
            cache.state_apply(st, dest_seq_id)

    def state_save_file(self, path: str | Path, hparams: LlamaHParams, tokens: ArrayLike,
                        seq_id: int = -1) -> int:
        """Save to a file: [`state_write`][]'s blob in the file of
        [`reference.memory.state.state_file_write`][reference.memory.state.state_file_write]; its
        size."""
        check_tokens(tokens)
        return state_io.state_file_write(path, tokens, self.state_write(hparams, seq_id))

    def state_load_file(self, path: str | Path, hparams: LlamaHParams,
                        dest_seq_id: int = -1) -> np.ndarray:
        """Restore a file of [`state_save_file`][]; its tokens."""
        tokens, blob = state_io.state_file_read(path)
        self.state_read(hparams, blob, dest_seq_id)
        return tokens
    # --8<-- [end:state]
# --8<-- [end:KVCacheISWA]


# --8<-- [start:parse_iswa_state]
def parse_iswa_state(data: bytes, flags: int, layers: list[tuple[int, ...]]) -> list[bytes]:
    """The parts of an iSWA blob, checked against what a read with ``flags`` expects.

    Args:
        data: a blob of [`KVCacheISWA.state_write`][].
        flags: the flags of the read.
        layers: the layers of each cache the read restores, in order.

    Returns:
        The caches' blobs, in order.

    Raises:
        StateError: bad magic, version, size or checksum; other flags; another number of
            parts; a part for other layers; bytes left over.

    Examples:
        >>> parse_iswa_state(b"LRKV" + bytes(60), 0, [(0,), (1,)])
        Traceback (most recent call last):
        ...
        reference.memory.blob.StateError: bad magic b'LRKV': not a iSWA blob (expected b'LRIS')
    """
    io = unseal(data, ISWA_STATE_MAGIC, ISWA_STATE_VERSION, "iSWA blob")
    blob_flags, n_part = io.read("II")
    if blob_flags != flags:
        kinds = {0: "whole (NONE)", 1: "partial (PARTIAL_ONLY)"}
        raise StateError(f"a {kinds.get(blob_flags, f'flags {blob_flags}')} blob cannot be read "
                         f"with flags {flags} ({kinds[flags]}): use the flags it was written with")
    if n_part != len(layers):
        raise StateError(f"blob has {n_part} parts, a read with flags {flags} expects "
                         f"{len(layers)}")
    blobs = []
    for i, want in enumerate(layers):
        n_layer = io.read("I")
        if n_layer > 2**16:
            raise StateError(f"part {i} lists {n_layer} layers")
        got = tuple(io.read("i") for _ in range(n_layer))
        if got != tuple(want):
            raise StateError(f"part {i} holds layers {list(got)}, this cache {list(want)}")
        blobs.append(io.read_bytes(io.read("Q")))
    if io.off != len(io.data):
        raise StateError(f"iSWA blob has {len(io.data) - io.off} unread bytes")
    return blobs
# --8<-- [end:parse_iswa_state]
