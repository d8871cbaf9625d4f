r"""Twin of [`reference.context`][reference.context]: ``llama_context`` with MLX memory, forwards
and graphs.

[`Context`][] *is* the reference's context (a subclass): batch validation, splitting,
slot search, return codes, output ordering and the state layout are inherited. What
differs:

- the memory is made by [`accelerated.memory.create_memory`][accelerated.memory.create_memory], the
  factory the twin puts in place of the reference's:
  [`accelerated.memory.KVCache`][accelerated.memory.kv_cache.KVCache] (MLX K/V tensors, the same
  cells), for a model with a sliding window (Gemma 2/3's per-layer pattern, a Mistral-style
  ``n_swa``) the iSWA pair of two such caches
  [`accelerated.memory.KVCacheISWA`][accelerated.memory.kv_cache_iswa.KVCacheISWA], or for a
  recurrent model (Mamba, Mamba-2)
  [`accelerated.memory.recurrent.RecurrentMemory`][accelerated.memory.recurrent.RecurrentMemory]
  (MLX state rows, the same cells). All present the reference's memory interface, so ``decode``
  is inherited;
- the weights are prepared once
  ([`accelerated.models.llama.prepare_weights`][accelerated.models.llama.prepare_weights]: dense and
  transposed on the CPU device, the types MLX holds quantized on a GPU; ``matmul`` chooses);
- each Llama/Qwen2/Gemma ubatch runs one **graph**:
  [`accelerated.models.llama.llm_build_llama`][accelerated.models.llama.llm_build_llama] (or
  [`accelerated.models.gemma.llm_build_gemma`][accelerated.models.gemma.llm_build_gemma]) as a pure
  function of the ubatch's inputs and the cache tensors,

    $$ (\text{tokens}, \text{pos}, \text{out\_ids}, \text{kq\_mask}, \text{k\_rows},
       K_0 \dots K_{L-1}, V_0 \dots V_{L-1}) \mapsto
       (\text{logits}, K'_0 \dots K'_{L-1}, V'_0 \dots V'_{L-1}), $$

    traced once by ``mx.compile`` for each [`GraphKey`][] (the shapes: tokens or
    embeddings, ``n_tokens``, ``n_outputs``, ``n_kv``, the slot's streams) and kept in a small
    LRU cache. With an iSWA memory the graph takes the mask inputs, rows and K/V tensors of
    *both* caches ([`cache_parts`][]: the base cache's layers, then the SWA cache's), each
    cache with its own narrow view ([`kv_view`][]) and its own mask (the window on the SWA
    cache's), and the key holds both views (``n_kv``, ``n_kv_swa``).
    A ubatch whose key equals the previous ubatch's reuses its graph, the rule of
    llama.cpp's ``llm_graph_result::can_reuse``, and counts in ``perf().n_reused``.
    ``graph_reuse=False`` (or the environment variable ``LLAMA_GRAPH_REUSE_DISABLE=1``, as in
    llama.cpp) runs the same function uncompiled, op by op: the logits and caches are bit for
    bit the same on the CPU (``tests/twin/test_reuse.py``; Metal is untested); on CUDA a compiled
    kernel contracts ``a * b + c`` into one FMA, so there the two agree to float32 rounding
    (``scripts/mlx_cuda_checks.py``);
- a Mamba ubatch runs
  [`accelerated.models.mamba.llm_build_mamba`][accelerated.models.mamba.llm_build_mamba] as a graph
  too, ``(tokens, out_ids, r_0 \dots r_{L-1}, s_0 \dots s_{L-1}) \mapsto (\text{logits}, r', s')``
  on the state rows of the ubatch's cells (read and written back through the memory's input, outside
  the graph), compiled per ubatch shape (the key's ``n_kv`` is then the number of sequence sets);
  ``graph_reuse=False`` runs
  [`accelerated.models.mamba.mamba_forward`][accelerated.models.mamba.mamba_forward] op by op, with
  the same bits (on CUDA: to float32 rounding, as above);
- nothing waits for the device: a decode *launches* its ubatches (``mx.async_eval``) and
  returns (``Context._launch``: the logits, and the last layer's attention output, which
  launches the cache writes without holding the caches), and its logits rows stay on the
  device ([`Context.output_set`][]). They are
  copied to the host the first time they are read, so [`Context.get_logits`][] returns
  NumPy as the reference does; [`Context.get_logits_ith_device`][] gives the same row as
  an ``mx.array`` without a host copy, for a sampler that runs on the device, and
  [`Context.decode_token`][] decodes a token that a device sampler picked *before* it is
  read back: the generation loop
  ([`reference.tools.generate.Generator`][reference.tools.generate.Generator]) launches step
  $t + 1$ and only then reads token $t$, as mlx-lm's ``generate_step`` does;
  [`Context.synchronize`][] waits (``llama_synchronize``);
- the state methods are inherited: each memory runs the reference's state functions on
  NumPy copies of its tensors and puts the (possibly restored) tensors back as MLX arrays
  (its ``on_host``). Blobs are interchangeable between the two contexts.
"""

from __future__ import annotations

import os
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial

import mlx.core as mx
import numpy as np
from numpy.typing import DTypeLike

from accelerated.memory import KVCache, KVCacheISWA, create_memory
from accelerated.memory.kq_mask import kq_mask_device, prefix_inputs_device
from accelerated.memory.kv_cache import GraphAttnInput, head_rows
from accelerated.models.gemma import GEMMA_ARCHS, check_gemma_inputs, llm_build_gemma
from accelerated.models.llama import default_matmul, llm_build_llama, prepare_weights
from accelerated.models.mamba import check_mamba_inputs, llm_build_mamba, mamba_forward
from reference import context as ref
from reference.batch import Batch  # noqa: F401 (the examples)
from reference.context import (
    ContextError,
    PerfContextData,
    context_shift,
    context_sizes,
    is_recurrent,
)
from reference.hparams import MAMBA_ARCHS, LlamaHParams, MambaHParams
from reference.memory import MemoryContext
from reference.models.llama import check_forward_inputs

__all__ = [
    "GRAPH_CACHE_SIZE",
    "CachePart",
    "Context",
    "ContextError",
    "GraphKey",
    "KV_VIEW_PAD",
    "MAMBA_COMPILE_MAX_SEQ_TOKENS",
    "PerfContextData",
    "cache_parts",
    "context_shift",
    "context_sizes",
    "is_recurrent",
    "kv_caches",
    "kv_view",
]

# Compiled graphs kept per context (least recently used first out). Token-by-token
# generation needs one; a prompt of several ubatches one more per distinct ubatch size.
GRAPH_CACHE_SIZE = 8
# The most tokens per sequence of a Mamba ubatch whose graph is compiled and kept; a longer
# one (a prompt) runs its graph op by op (Context.graph says why).
MAMBA_COMPILE_MAX_SEQ_TOKENS = 16
KV_VIEW_PAD = 64  # the step of the attention width the twin's graph reads, in cells


# --8<-- [start:GraphKey]
@dataclass(frozen=True)
class GraphKey:
    """What fixes the topology of a ubatch's graph: two ubatches with equal keys share it.

    llama.cpp (``llm_graph_params::allow_reuse`` and the inputs' ``can_reuse``) compares the
    ubatch's ``n_tokens``, its sequence sets, ``n_outputs``, tokens vs embeddings and the
    KQ mask's shape (``n_kv`` and the streams). The same here; every other input (token ids,
    positions, which rows output, the mask's values, the cells written) is an array
    argument of the graph.

    Attributes:
        embd: the ubatch carries embeddings instead of token ids.
        n_tokens: tokens of the ubatch.
        n_outputs: tokens that get logits.
        n_kv: cells of each stream the graph reads ([`kv_view`][]: the used range padded
            to ``KV_VIEW_PAD``, at most llama.cpp's ``get_n_kv``); with an iSWA memory, of
            the base cache.
        strm: the streams of the slot.
        n_kv_swa: with an iSWA memory, the cells of each stream the SWA layers read in the
            SWA cache (its own view); 0 without one.
        prefix: for each cache part, whether its mask and rows come from two integers
            ([`accelerated.memory.kq_mask.prefix_inputs_device`][accelerated.memory.kq_mask.prefix_inputs_device]:
            a generation step in one conversation) instead of the cells' positions and
            membership; ``()``: none does.

    Examples:
        >>> GraphKey(False, 1, 1, 64, (0,)) == GraphKey(False, 1, 1, 64, (0,))  # reused
        True
        >>> GraphKey(False, 1, 1, 64, (0,)) == GraphKey(False, 1, 1, 128, (0,))  # wider view
        False
    """

    embd: bool
    n_tokens: int
    n_outputs: int
    n_kv: int
    strm: tuple[int, ...]
    n_kv_swa: int = 0
    prefix: tuple[bool, ...] = ()
# --8<-- [end:GraphKey]


# --8<-- [start:kv_view]
def kv_view(memory: KVCache, sinfo, n_kv: int) -> int:
    """How many cells of each stream the twin's graph reads: a narrower view than ``n_kv``.

    llama.cpp reads ``n_kv`` cells
    ([`reference.memory.KVCache.get_n_kv`][reference.memory.kv_cache.KVCache.get_n_kv]: the used
    range padded to 256), and masks the unused ones. Every cell at or past a stream's
    ``used_max_p1`` is empty, so masked for every token: reading only the used range padded to
    ``KV_VIEW_PAD`` gives the same attention (the dropped columns add ``exp(-inf) = 0``) for a
    quarter of the work early in a generation. The price is a new graph every ``KV_VIEW_PAD`` cells
    instead of every 256.

    Examples:
        >>> from reference.testing import tiny_hparams
        >>> from reference.batch import Batch, BatchAllocr
        >>> cache = KVCache(tiny_hparams(), kv_size=512)
        >>> ub = BatchAllocr(Batch(token=[1, 2, 3]), n_vocab=32, n_seq_max=1,
        ...                  memory=cache).split_simple(8)
        >>> sinfo = cache.prepare([ub])[0]
        >>> cache.apply_ubatch(sinfo, ub)
        >>> cache.get_n_kv(sinfo), kv_view(cache, sinfo, cache.get_n_kv(sinfo))
        (256, 64)
    """
    used = max(memory.v_cells[s].used_max_p1() for s in sinfo.strm)
    return min(n_kv, max(KV_VIEW_PAD, -(-used // KV_VIEW_PAD) * KV_VIEW_PAD))
# --8<-- [end:kv_view]


# --8<-- [start:kv_parts]
@dataclass(frozen=True)
class CachePart:
    """One KV cache as the traced graph sees it: static for the life of a Context.

    A plain [`KVCache`][] is one part over every layer; an iSWA memory
    ([`accelerated.memory.KVCacheISWA`][accelerated.memory.kv_cache_iswa.KVCacheISWA]) two, its
    base cache (the layers that see the whole context, no window) then its SWA cache. A cache of
    no layers (the base cache of a model whose every layer is SWA) is no part: the graph has
    nothing to read or write there.

    Attributes:
        layers: the model layers of the cache, ascending (``k_l[i]`` is layer ``layers[i]``).
        n_swa: the cache's window (0: none).
        swa_type: the cache's window type.
        swa: the SWA cache of an iSWA pair (its view is ``GraphKey.n_kv_swa``).
    """

    layers: tuple[int, ...]
    n_swa: int
    swa_type: int
    swa: bool


def kv_caches(memory) -> tuple[KVCache, ...]:
    """The KV caches of a memory: ``(base, swa)`` of an iSWA pair, else the cache itself.

    Examples:
        >>> from reference.testing import tiny_gemma_hparams, tiny_hparams
        >>> len(kv_caches(create_memory(tiny_hparams(), n_ctx_seq=256)))
        1
        >>> [c.layers for c in kv_caches(create_memory(tiny_gemma_hparams(n_swa=4), 256))]
        [(1,), (0,)]
    """
    return memory.caches() if isinstance(memory, KVCacheISWA) else (memory,)


def cache_parts(memory) -> tuple[CachePart, ...]:
    """The [`CachePart`][]s of a memory's caches that hold layers, in [`kv_caches`][] order.

    Examples:
        >>> from reference.testing import tiny_gemma_hparams
        >>> hp = tiny_gemma_hparams("gemma3", n_layer=3, n_swa=4, swa_layers=(True, True, False))
        >>> [(p.layers, p.n_swa, p.swa) for p in cache_parts(create_memory(hp, n_ctx_seq=256))]
        [((2,), 0, False), ((0, 1), 4, True)]
        >>> hp = tiny_gemma_hparams("gemma3", n_layer=3, n_swa=4)  # every layer SWA (5 of 6)
        >>> [(p.layers, p.swa) for p in cache_parts(create_memory(hp, n_ctx_seq=256))]
        [((0, 1, 2), True)]
    """
    iswa = isinstance(memory, KVCacheISWA)
    return tuple(CachePart(cache.layers, cache.n_swa, cache.swa_type, iswa and i == 1)
                 for i, cache in enumerate(kv_caches(memory)) if cache.layers)
# --8<-- [end:kv_parts]


class _LayerRoute:
    """The attention input of a traced graph over one [`GraphAttnInput`][] per cache part.

    Layer ``il`` goes to the input of the cache that holds it, at that cache's own index, as
    [`reference.memory.kv_cache_iswa.KVCacheISWAAttnInput`][reference.memory.kv_cache_iswa.KVCacheISWAAttnInput]
    sends it to the base or the SWA cache (with one part over every layer: to it, at ``il``).
    """

    def __init__(self, inputs: list[GraphAttnInput], parts: tuple[CachePart, ...]):
        self.route = {il: (inp, i) for inp, part in zip(inputs, parts, strict=True)
                      for i, il in enumerate(part.layers)}
        self.n_stream = inputs[0].n_stream  # every part places the ubatch on the same streams
        self.kqv: mx.array | None = None  # the last attention output shown (kqv_out)

    def kqv_out(self, il: int, kqv: mx.array) -> None:
        """Keep layer ``il``'s attention output: the layers come in order, so after the
        forward ``kqv`` is the last layer's, which has every cache write among its inputs."""
        self.kqv = kqv

    def cpy_k(self, il: int, k_cur: mx.array) -> None:
        inp, i = self.route[il]
        inp.cpy_k(i, k_cur)

    def cpy_v(self, il: int, v_cur: mx.array) -> None:
        inp, i = self.route[il]
        inp.cpy_v(i, v_cur)

    def get_k(self, il: int) -> mx.array:
        inp, i = self.route[il]
        return inp.get_k(i)

    def get_v(self, il: int) -> mx.array:
        inp, i = self.route[il]
        return inp.get_v(i)

    def get_k_heads(self, il: int) -> mx.array:
        inp, i = self.route[il]
        return inp.get_k_heads(i)

    def get_v_heads(self, il: int) -> mx.array:
        inp, i = self.route[il]
        return inp.get_v_heads(i)

    def get_kq_mask(self, il: int) -> mx.array:
        inp, i = self.route[il]
        return inp.get_kq_mask(i)


def _llama_graph(weights: dict, hparams: LlamaHParams, parts: tuple[CachePart, ...],
                 key: GraphKey, x: mx.array, pos: mx.array, out_ids: mx.array,
                 *arrays: mx.array) -> tuple[mx.array, ...]:
    """The ubatch's forward as a pure function: ``(logits, *K', *V')`` from the inputs and caches.

    ``x`` is the token ids ``(n_tokens,)`` or the embeddings ``(n_tokens, n_embd)``. Then, for
    each cache part (``parts``: the base cache then the SWA cache of an iSWA memory, or the one
    cache), ``p_cell`` and ``member``, what its KQ mask is built from in the graph
    ([`accelerated.memory.kq_mask.kq_mask_device`][accelerated.memory.kq_mask.kq_mask_device],
    with the part's own window), and ``k_rows``, where the tokens' heads are written in it
    ([`accelerated.memory.kv_cache.head_rows`][accelerated.memory.kv_cache.head_rows]); or,
    for a part of ``key.prefix``, the one ``slot`` both are made from
    ([`accelerated.memory.kq_mask.prefix_inputs_device`][accelerated.memory.kq_mask.prefix_inputs_device]).
    Then, part after part, its K tensors and its V tensors (head-major, one per layer of the
    part). The forward is the architecture's:
    [`llm_build_gemma`][accelerated.models.gemma.llm_build_gemma] for Gemma, else
    [`llm_build_llama`][accelerated.models.llama.llm_build_llama]. Returned:
    the logits, then each part's written K then V tensors, in the same order, then the last
    layer's attention output (``kqv_out``: every cache write is an input of it; see
    ``Context._launch``).
    """
    prefix = key.prefix or (False,) * len(parts)
    n_in = sum(1 if pre else 3 for pre in prefix)  # the parts' slot, or p_cell, member, k_rows
    inputs, i, off = [], 0, n_in
    for part, pre in zip(parts, prefix, strict=True):
        n = len(part.layers)
        k_l, v_l = arrays[off:off + n], arrays[off + n:off + 2 * n]
        off += 2 * n
        n_kv = key.n_kv_swa if part.swa else key.n_kv
        if pre:
            kv_size = k_l[0].shape[2]  # (n_stream, n_head_kv, kv_size, d)
            k_rows, kq_mask = prefix_inputs_device(arrays[i], n_kv, kv_size, hparams.n_head_kv)
            i += 1
        else:
            p_cell, member, k_rows = arrays[i:i + 3]
            kq_mask = kq_mask_device(p_cell, member, pos, part.n_swa, part.swa_type)
            i += 3
        inputs.append(GraphAttnInput(k_l, v_l, k_rows, kq_mask, n_kv, key.strm,
                                     hparams.n_head_kv))
    tokens, embd = (None, x) if key.embd else (x, None)
    if key.n_outputs == key.n_tokens:  # the ids are ascending: every row, in order
        out_ids = None
    build = llm_build_gemma if hparams.arch in GEMMA_ARCHS else llm_build_llama
    route = _LayerRoute(inputs, parts)
    logits = build(weights, hparams, tokens, pos, route, out_ids, embd)
    return (logits, *[t for inp in inputs for t in (*inp.k_l, *inp.v_l)], route.kqv)


class _RowsInput:
    """A recurrent input on its own state rows, for a traced graph (as [`GraphAttnInput`][]).

    ``get_r``/``get_s`` return the rows given (placeholders when traced); ``cpy_r``/``cpy_s``
    replace them, so after the forward ``r``/``s`` are the written rows.
    """

    def __init__(self, r: list, s: list):
        self.r, self.s = list(r), list(s)

    def get_r(self, il: int) -> mx.array:
        return self.r[il]

    def get_s(self, il: int) -> mx.array:
        return self.s[il]

    def cpy_r(self, il: int, r: mx.array) -> None:
        self.r[il] = r

    def cpy_s(self, il: int, s: mx.array) -> None:
        self.s[il] = s


def _mamba_graph(weights: dict, hparams: MambaHParams, key: GraphKey, tokens: mx.array,
                 out_ids: mx.array, *rows: mx.array) -> tuple[mx.array, ...]:
    """A Mamba ubatch as a pure function: ``(logits, *r', *s')`` from the tokens and the
    conv and SSM state rows of its ``key.n_kv`` sequence sets (``rows``: the ``n_layer``
    conv rows, then the ``n_layer`` SSM rows)."""
    n_layer = hparams.n_layer
    inp = _RowsInput(rows[:n_layer], rows[n_layer:])
    if key.n_outputs == key.n_tokens:  # the ids are ascending: every row, in order
        out_ids = None
    logits = llm_build_mamba(weights, hparams, tokens, key.n_kv, inp, out_ids)
    return (logits, *inp.r, *inp.s)


# --8<-- [start:Context]
class Context(ref.Context):
    """Twin of [`reference.context.Context`][reference.context.Context] on MLX: Llama/Qwen2,
    Gemma/Gemma 2/Gemma 3 and Mamba/Mamba-2.

    Same constructor arguments, and three of its own. ``dtype`` sets the reference
    bookkeeping's dtype (state blobs, logits); the MLX tensors and the forward compute in
    float32 (a float16 ``dtype`` keeps a float16 cache).

    Args:
        graph_reuse: trace each ubatch's graph once with ``mx.compile`` and reuse it
            (True), or build and run it op by op every time (False: llama.cpp's
            ``graph_reuse_disable``). Results are bit for bit the same (on CUDA, to
            float32 rounding: its compiled kernels fuse multiply-adds). The environment
            variable ``LLAMA_GRAPH_REUSE_DISABLE`` set to a non-zero integer turns it off.
        matmul: ``"dense"`` or ``"quantized"`` matmul weights
            ([`accelerated.models.llama.prepare_weights`][accelerated.models.llama.prepare_weights]);
            None:
            [`accelerated.models.llama.default_matmul`][accelerated.models.llama.default_matmul]
            (dense on the CPU device). With ``"quantized"``, Q6_K and Q2_K weights not yet
            prepared stay packed within their stated bound (``bounded``,
            [`accelerated.quants.load_weight`][accelerated.quants.load_weight]), as every
            other GGUF type MLX holds exactly.
        graph_cache_size: how many compiled graphs to keep (least recently used out).

    Raises:
        ContextError: a bad size, or ``graph_cache_size < 1``.

    Examples:
        >>> from reference.testing import tiny_hparams, random_weights
        >>> hp = tiny_hparams()
        >>> ctx = Context(hp, random_weights(hp), n_ctx=64, n_seq_max=2)
        >>> ctx.decode(Batch(token=[1, 2, 3], logits=[True, False, True]))
        0
        >>> type(ctx.get_logits()).__name__, ctx.get_logits().shape, ctx.memory.seq_pos_max(0)
        ('ndarray', (2, 32), 2)
        >>> [ctx.decode(Batch(token=[t])) for t in (4, 5, 6)], ctx.perf().n_reused
        ([0, 0, 0], 2)
    """

    on_device = True
    """[`get_logits_ith_device`][] gives a row as an ``mx.array``
    ([`ContextLike.on_device`][reference.context_protocol.ContextLike.on_device])."""

    def __init__(
        self,
        hparams: LlamaHParams | MambaHParams,
        weights: dict,
        n_ctx: int = 512,
        n_batch: int = 2048,
        n_ubatch: int = 512,
        n_seq_max: int = 1,
        kv_unified: bool = True,
        swa_full: bool = True,
        dtype: DTypeLike = np.float32,
        abort_callback: Callable[[], bool] | None = None,
        graph_reuse: bool = True,
        matmul: str | None = None,
        graph_cache_size: int = GRAPH_CACHE_SIZE,
    ):
        if graph_cache_size < 1:
            raise ContextError(f"graph_cache_size = {graph_cache_size} must be >= 1")
        super().__init__(hparams, weights, n_ctx=n_ctx, n_batch=n_batch, n_ubatch=n_ubatch,
                         n_seq_max=n_seq_max, kv_unified=kv_unified, swa_full=swa_full,
                         dtype=dtype, abort_callback=abort_callback)
        matmul = matmul or default_matmul()
        self.mlx_weights = prepare_weights(self.weights, matmul, bounded=matmul == "quantized")
        disabled = os.environ.get("LLAMA_GRAPH_REUSE_DISABLE", "0").strip() or "0"
        self.graph_reuse = bool(graph_reuse) and not int(disabled)
        self.graph_cache_size = graph_cache_size
        self._graphs: OrderedDict[GraphKey, Callable] = OrderedDict()
        self._prev_key: GraphKey | None = None
        self._no_logits = self._logits  # (0, n_vocab): no outputs, in the logits' dtype
        self._device_rows: tuple[list[mx.array], np.ndarray] | None = None  # rows, out_ids
        self._logits_device: mx.array | None = None  # (n_outputs, n_vocab), batch order
        self._host_stale = False  # the host copy (self._logits) lags the device rows
        self._token_on_device: mx.array | None = None  # decode_token's token, (1,) int32
        self._every_row: dict[int, mx.array] = {}  # _ids_input's aranges, by size
        self._parts = () if self.recurrent else cache_parts(self._memory)  # the graph's caches
        # a one-token ubatch whose mask is the first u cells hands the graph [r_0, u] for
        # a cache part, not the cells' positions, membership and rows (_llama_ubatch);
        # False: always the cells' form (the two are compared in tests and benchmarks)
        self.prefix_masks = True

    create_memory = staticmethod(create_memory)
    """The memory factory: [`accelerated.memory.create_memory`][accelerated.memory.create_memory]
    (MLX tensors)."""
# --8<-- [end:Context]

    # --8<-- [start:decode]
    def output_reserve(self, n_tokens: int) -> None:
        """Twin of
        [`reference.context.Context.output_reserve`][reference.context.Context.output_reserve]; the
        device rows go too.

        The previous outputs are dropped without being read: the device may still be
        computing them.
        """
        self._device_rows, self._logits_device, self._host_stale = None, None, False
        self._logits = self._no_logits
        self._output_ids = np.full(n_tokens, -1, dtype=np.int64)  # (n_tokens,)

    def output_set(self, rows: list[mx.array], out_ids: Sequence[int]) -> None:
        """Twin of [`reference.context.Context.output_set`][reference.context.Context.output_set]:
        the rows stay on the device.

        ``rows`` are the ubatches' lazy ``mx.array`` rows ([`process_ubatch`][]); they are
        put in batch order (by ``output_ids``) on the device when [`get_logits_ith_device`][]
        first asks, and copied to the host when [`get_logits`][] (or a state write) first
        asks.
        """
        out_ids = np.asarray(out_ids, np.int64)  # (n_outputs,)
        self._device_rows, self._logits_device, self._host_stale = (list(rows), out_ids), None, True
        self._output_ids[np.sort(out_ids)] = np.arange(len(out_ids))  # batch index -> row

    def decode_token(self, token: int | mx.array, seq_id: int = 0) -> int:
        """Twin of
        [`reference.context.Context.decode_token`][reference.context.Context.decode_token]:
        ``token`` may be on the device.

        A scalar ``mx.array`` token is not read back: the batch is validated with the id 0
        in its place (positions and sequences are what validation reads; a token picked by
        a sampler over this model's ``n_vocab`` logits is in range by construction), and the
        graph reads the device token. Without graph reuse a recurrent model's forward
        ([`mamba_forward`][accelerated.models.mamba.mamba_forward]) takes host ids: there the
        token is read back first.
        """
        if not isinstance(token, mx.array):
            return super().decode_token(token, seq_id)
        if self.recurrent and not self.graph_reuse:
            return super().decode_token(token.item(), seq_id)
        self._token_on_device = token.reshape(1).astype(mx.int32)  # (1,)
        try:
            return super().decode_token(0, seq_id)
        finally:
            self._token_on_device = None

    def synchronize(self) -> None:
        """Twin of [`reference.context.Context.synchronize`][reference.context.Context.synchronize]:
        wait for the last decode.

        Its outputs and everything it wrote into the memory are computed when this returns.
        """
        self._wait()
        self._perf_flush(wait=False)

    def _wait(self) -> None:
        rows = self._device_rows[0] if self._device_rows is not None else []
        # the K/V tensors of every cache, or a recurrent memory's state rows
        mems = (self._memory,) if self.recurrent else kv_caches(self._memory)
        tensors = [t for mem in mems for name in ("k_l", "v_l", "r_l", "s_l")
                   for t in getattr(mem, name, [])]
        mx.eval(*rows, *tensors)

    @property
    def n_outputs(self) -> int:
        """Rows of logits the last successful decode produced (read without a host copy)."""
        if self._host_stale:
            return len(self._device_rows[1])
        return len(self._logits)

    def get_logits(self) -> np.ndarray:
        """Twin of [`reference.context.Context.get_logits`][reference.context.Context.get_logits]:
        the device rows, on the host.

        The first call after a decode waits for it and copies its rows.
        """
        self._sync_host()
        return super().get_logits()

    def _sync_host(self) -> None:
        if self._host_stale:
            self._logits = np.array(self._device_logits()).astype(self._no_logits.dtype,
                                                                   copy=False)
            self._host_stale = False
            self._perf_flush(wait=False)  # the rows are computed: the decode is done
    # --8<-- [end:decode]

    # --8<-- [start:process_ubatch]
    def process_ubatch(self, mctx: MemoryContext) -> np.ndarray:
        """Twin of
        [`reference.context.Context.process_ubatch`][reference.context.Context.process_ubatch]: the
        MLX forward.

        Llama/Qwen2/Gemma: the ubatch's graph ([`graph`][]) on its inputs and the cache
        tensors (of both caches of an iSWA memory); the written tensors replace the caches'.
        Mamba: its graph on the state rows of the ubatch's cells (`_mamba_ubatch`). The work
        is launched (``mx.async_eval``), not waited for.

        Returns:
            The ubatch's logits rows ``(n_outputs_ubatch, n_vocab)``, a lazy ``mx.array``.
        """
        ubatch = mctx.get_ubatch()
        out_ids = np.flatnonzero(ubatch.output)  # (n_outputs_ubatch,)
        if self.hparams.arch in MAMBA_ARCHS:
            return self._mamba_ubatch(mctx, out_ids)
        return self._llama_ubatch(mctx, out_ids)
    # --8<-- [end:process_ubatch]

    def _mamba_ubatch(self, mctx: MemoryContext, out_ids: np.ndarray) -> mx.array:
        """Run one Mamba ubatch through its graph; the memory takes the written state rows.

        The graph reads the rows of the ubatch's cells (``inp.get_r``: lazy slices) and
        returns the new ones, which the memory's input writes back (``inp.cpy_r``). The key
        is the ubatch's shape: tokens, outputs, and the sequence sets as ``n_kv``.
        """
        ubatch, inp, n_layer = mctx.get_ubatch(), mctx.graph_input(), self.hparams.n_layer
        if not self.graph_reuse:
            logits = mamba_forward(self.mlx_weights, self.hparams, ubatch.token, inp, out_ids,
                                   n_seqs=ubatch.n_seqs)
        else:
            # mamba_forward's checks, then the traced graph
            check_mamba_inputs(self.hparams, ubatch.token, out_ids, ubatch.n_seqs)
            key = GraphKey(False, len(ubatch.token), len(out_ids), ubatch.n_seqs, ())
            rows = [inp.get_r(il) for il in range(n_layer)] + [
                inp.get_s(il) for il in range(n_layer)]
            if self._token_on_device is not None:  # decode_token's, not read back
                tokens = self._token_on_device  # (1,)
            else:
                tokens = mx.array(np.asarray(ubatch.token, np.int32))  # (n_tokens,)
            outs = self.graph(key)(tokens, self._ids_input(out_ids, len(ubatch.token)), *rows)
            del rows
            for il in range(n_layer):
                inp.cpy_r(il, outs[1 + il])
                inp.cpy_s(il, outs[1 + n_layer + il])
            logits = outs[0]
        mem = self._memory
        mx.async_eval(logits, *mem.r_l, *mem.s_l)
        return logits

    def _ids_input(self, out_ids: np.ndarray, n_tokens: int) -> mx.array:
        """``out_ids`` as a graph input ``(n_outputs,)`` int32. When every token outputs they
        are ``0 .. n_tokens - 1`` (generation's one row): a kept ``mx.arange`` of that size,
        not a new array every step."""
        if len(out_ids) != n_tokens:
            return mx.array(out_ids.astype(np.int32))
        ids = self._every_row.get(n_tokens)
        if ids is None:
            ids = self._every_row[n_tokens] = mx.arange(n_tokens, dtype=mx.int32)
        return ids

    # --8<-- [start:graph]
    def graph(self, key: GraphKey) -> Callable:
        """The graph function for ``key``: compiled and cached, or plain when reuse is off.

        A key equal to the previous ubatch's counts as a reuse (``n_reused``). The cache
        holds at most ``graph_cache_size`` compiled graphs, least recently used out.

        A Mamba ubatch of more than ``MAMBA_COMPILE_MAX_SEQ_TOKENS`` tokens per sequence (a
        prompt) is not compiled: its scan is a loop over those tokens, so its graph grows
        with them (thousands of nodes for a 512-token ubatch), is traced for one use, and
        while such a compiled graph is held MLX runs every other graph slower (the tiny
        Mamba's token, after a 1000-token prompt in 512-token ubatches; the same slowdown
        with any compiled graph of thousands of nodes kept alive, measured in
        ``docs/performance.md``). A Llama graph has the same nodes at every size.
        """
        if self.hparams.arch in MAMBA_ARCHS:
            build = partial(_mamba_graph, self.mlx_weights, self.hparams, key)
            if key.n_tokens // key.n_kv > MAMBA_COMPILE_MAX_SEQ_TOKENS:
                return build  # a prompt's graph: see the docstring
        else:
            build = partial(_llama_graph, self.mlx_weights, self.hparams, self._parts, key)
        if not self.graph_reuse:
            return build
        if key == self._prev_key and key in self._graphs:
            self._n_reused += 1
        self._prev_key = key
        fn = self._graphs.get(key)
        if fn is None:
            fn = mx.compile(build)
            self._graphs[key] = fn
            while len(self._graphs) > self.graph_cache_size:
                self._graphs.popitem(last=False)
        self._graphs.move_to_end(key)
        return fn
    # --8<-- [end:graph]

    def _llama_ubatch(self, mctx: MemoryContext, out_ids: np.ndarray) -> mx.array:
        """Run one Llama/Qwen2/Gemma ubatch through its graph; the caches take the written
        tensors.

        With an iSWA memory the graph reads both caches: each with its own slot, view
        ([`kv_view`][]) and mask inputs (the SWA cache's mask with the window).
        """
        ubatch = mctx.get_ubatch()
        check = check_gemma_inputs if self.hparams.arch in GEMMA_ARCHS else check_forward_inputs
        tokens, pos, out_ids, embd = check(self.hparams, ubatch.token, ubatch.pos, out_ids,
                                           ubatch.embd)
        cache_inputs = self._cache_inputs(mctx)  # (base, swa) of an iSWA memory, or one
        views, host, prefix = [0, 0], [], []  # the view of each cache; the parts' graph inputs
        for i, (cache, sinfo, inp) in enumerate(cache_inputs):
            views[i] = kv_view(cache, sinfo, inp.n_kv)  # the columns past it would all be masked
            if not cache.layers:
                continue
            u = inp.kq_mask_prefix() if len(pos) == 1 and self.prefix_masks else None
            if u is not None:  # the mask is the first u cells: two integers say it all
                stream, cell = divmod(int(inp.k_idxs[0]), cache.get_size())
                # head 0's row, head_rows(inp.k_idxs, ...)[0, 0] in Python ints
                r_0 = stream * self.hparams.n_head_kv * cache.get_size() + cell
                host.append(mx.array([r_0, u], dtype=mx.int32))  # the slot
            else:
                p_cell, member = inp.kq_mask_inputs(views[i])  # the mask is built in the graph
                k_rows = head_rows(inp.k_idxs, cache.get_size(), self.hparams.n_head_kv)
                host += [mx.array(p_cell), mx.array(member), mx.array(k_rows.astype(np.int32))]
            prefix.append(u is not None)
        strm = tuple(cache_inputs[0][1].strm)  # the same streams in both caches
        key = GraphKey(embd is not None, len(pos), len(out_ids), views[0], strm, views[1],
                       tuple(prefix) if any(prefix) else ())
        if embd is not None:
            x = mx.array(embd, mx.float32)  # (n_tokens, n_embd)
        elif self._token_on_device is not None:  # decode_token's, not read back
            x = self._token_on_device  # (1,)
        else:
            x = mx.array(tokens.astype(np.int32))  # (n_tokens,)
        caches = [c for c in kv_caches(self._memory) if c.layers]
        kv = [t for c in caches for t in (*c.k_l, *c.v_l)]
        outs = self.graph(key)(x, mx.array(pos.astype(np.int32)),
                               self._ids_input(out_ids, len(pos)), *host, *kv)
        # the graph holds the old tensors now: with no other reference left, the writes into
        # them can reuse their buffers (MLX donates an input that nothing else holds)
        del kv
        off = 1
        for c in caches:
            n = len(c.layers)
            c.k_l[:] = outs[off:off + n]
            c.v_l[:] = outs[off + n:off + 2 * n]
            off += 2 * n
        self._launch(outs[0], outs[-1])
        return outs[0]

    # --8<-- [start:launch]
    def _launch(self, logits: mx.array, caches_read: mx.array) -> None:
        """Launch a ubatch's graph: its logits, and ``caches_read``, nothing else.

        The graph writes its tokens' K and V rows into the cache tensors, and MLX writes in
        place only into a buffer that nothing else holds: otherwise it copies the whole
        tensor first (every cell, not only those in view). ``mx.async_eval`` holds the
        arrays it is given until everything it launched has run, so launching the written
        caches themselves, as this Context did, kept them held while the next step was
        launched behind: each write of that step copied its tensor, four copies of 2 MiB a
        token for the tiny Llama in a 16384-cell cache. ``caches_read`` is the last layer's
        attention output (``kqv_out``): every write of the graph is an input of it, so
        launching it launches them all, even in a ubatch with no logits rows.

        An op also holds the buffers it reads until it has run. A step's reads of a cache
        are over before the next step's write into it is launched as long as the graph has
        more nodes than MLX keeps in flight (``mx.async_eval`` waits once about 100 are
        queued): 131 for the tiny Llama. A one-layer model's graph is shorter, and there
        some writes still copy.
        """
        mx.async_eval(logits, caches_read)
    # --8<-- [end:launch]

    def _cache_inputs(self, mctx: MemoryContext) -> list[tuple]:
        """``(cache, slot, input)`` of each KV cache for the ubatch, in [`kv_caches`][] order.

        An iSWA memory places a ubatch in both caches
        ([`reference.memory.kv_cache_iswa.ISWAPlacement`][reference.memory.kv_cache_iswa.ISWAPlacement])
        and its input holds one input per cache (``.base``, ``.swa``).
        """
        sinfo, inp = mctx.get_placement(), mctx.graph_input()  # host bookkeeping
        if isinstance(self._memory, KVCacheISWA):
            return [(self._memory.kv_base, sinfo.base, inp.base),
                    (self._memory.kv_swa, sinfo.swa, inp.swa)]
        return [(self._memory, sinfo, inp)]

    # --8<-- [start:perf]
    def decode(self, batch) -> int:
        """Twin of [`reference.context.Context.decode`][reference.context.Context.decode]; first
        accounts the previous decode.

        A decode here only launches its work, so its time cannot be taken when it returns
        (`_perf_add`). It ends, at the latest, when the next decode starts: a generation
        loop reads the sampled token (which waits for the work) before it decodes it.
        """
        self._perf_flush(wait=False)
        return super().decode(batch)

    def _perf_add(self, n_tokens: int, t_start: float, t_end: float | None = None) -> None:
        """Twin of `reference.context.Context._perf_add`: keep the decode pending.

        llama.cpp accounts a decode in ``llama_synchronize``, from its start to the end of its
        compute. The same here: the pending decode is accounted when the host next waits for
        it ([`synchronize`][], a host read of the logits, [`perf`][]), or when the next
        decode starts, whichever comes first.
        """
        if t_end is not None:
            return super()._perf_add(n_tokens, t_start, t_end)
        self._perf_flush(wait=False)
        self._perf_pending = (n_tokens, t_start)

    def _perf_flush(self, wait: bool) -> None:
        """Account the pending decode now (after waiting for its work when ``wait``)."""
        pending, self._perf_pending = getattr(self, "_perf_pending", None), None
        if pending is None:
            return
        if wait:
            self._wait()
        super()._perf_add(*pending, time.perf_counter())

    def perf(self):
        """Twin of [`reference.context.Context.perf`][reference.context.Context.perf]: waits for the
        pending decode."""
        self._perf_flush(wait=True)
        return super().perf()

    def perf_reset(self) -> None:
        """Twin of [`reference.context.Context.perf_reset`][reference.context.Context.perf_reset]: a
        pending decode is dropped."""
        self._perf_pending = None
        super().perf_reset()
    # --8<-- [end:perf]

    # --8<-- [start:get_logits_ith_device]
    def get_logits_ith_device(self, i: int) -> mx.array:
        """The logits of batch token ``i`` of the last decode, on the device: ``(n_vocab,)``.

        The same row and index rules as [`get_logits_ith`][reference.context.Context.get_logits_ith]
        (``i < 0`` counts from the last output) and the same errors, without a host copy: a sampler
        that runs in MLX can pick the token there, and only the token leaves the device.

        Raises:
            ContextError: as [`get_logits_ith`][reference.context.Context.get_logits_ith].

        Examples:
            >>> from reference.testing import tiny_hparams, random_weights
            >>> hp = tiny_hparams()
            >>> ctx = Context(hp, random_weights(hp), n_ctx=64)
            >>> ctx.decode(Batch(token=[1, 2, 3], logits=[True, False, True]))
            0
            >>> row = ctx.get_logits_ith_device(-1)
            >>> type(row).__name__, row.shape
            ('array', (32,))
            >>> bool((np.array(row) == ctx.get_logits_ith(2)).all())
            True
        """
        j = self.output_row(i)  # the index checks, with the reference's errors
        if self._logits_device is None:
            self._logits_device = self._device_logits()
        return self._logits_device[j]

    def _device_logits(self) -> mx.array:
        """The last decode's rows on the device in batch order (from NumPy after a restore)."""
        if self._device_rows is None:  # restored by state_set_data: only the host copy exists
            return mx.array(self._logits)
        rows, out_ids = self._device_rows
        stacked = rows[0] if len(rows) == 1 else mx.concatenate(rows)  # (n_outputs, n_vocab)
        if len(out_ids) == 1:  # one row is in order (a generation step)
            return stacked
        dest = self._output_ids[out_ids]  # (n_outputs,) where each split row goes (output_set)
        if (dest == np.arange(len(dest))).all():
            return stacked
        order = np.empty_like(dest)
        order[dest] = np.arange(len(dest))  # batch-order row r is split row order[r]
        return mx.take(stacked, mx.array(order.astype(np.int32)), axis=0)
    # --8<-- [end:get_logits_ith_device]

    # --8<-- [start:state]
    def state_get_data(self) -> bytes:
        """[`reference.context.Context.state_get_data`][reference.context.Context.state_get_data],
        the device rows copied first."""
        self._sync_host()
        return super().state_get_data()

    def state_set_data(self, data: bytes) -> int:
        """[`reference.context.Context.state_set_data`][reference.context.Context.state_set_data];
        the device logits then follow.

        The memory restores into its MLX tensors itself (its ``on_host``); the restored
        logits exist on the host only until [`get_logits_ith_device`][] asks for them.
        """
        n = super().state_set_data(data)
        self._device_rows, self._logits_device, self._host_stale = None, None, False
        return n
    # --8<-- [end:state]
