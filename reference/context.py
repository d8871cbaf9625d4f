r"""The context: ``llama_context`` (``src/llama-context.cpp``) and ``llama_decode``.

A [`Context`][] ties a model (hyperparameters and weights) to a memory and runs batches
through them. Its one verb is [`Context.decode`][], which mirrors
``llama_context::decode`` step by step:

1. **validate** the batch ([`BatchAllocr`][reference.batch.BatchAllocr]: token and seq id ranges,
   positions that continue the memory, ``n_tokens <= n_batch``); any failure returns
   $-1$ and changes nothing;
2. **update the memory** (``memory_update``): what memory ops left pending is applied now,
   for a KV cache the stream copies and the K-shift that ``seq_add`` / ``seq_div``
   recorded ([`update`][reference.memory.kv_cache.KVCache.update]);
3. **split and prepare** (``memory.init_batch``): the memory cuts the batch into ubatches of
   at most ``n_ubatch`` tokens and finds a place for every one of them, all or nothing; no
   valid split or no room returns $1$ with the memory exactly as it was;
4. per ubatch: **apply** it to the memory, **compute** the forward (which reads and writes
   the memory through the ubatch's graph input), gather the logits of its output tokens.
   An ``abort_callback`` that answers True stops here with $2$: the ubatches already
   computed stay in the memory, the aborted one is removed (``remove_ubatch``);
5. put the output rows back into **batch order** (``out_ids``).

Return codes (``llama_decode``):

| code | meaning | memory after | outputs after |
|---|---|---|---|
| 0 | success | the batch appended | the batch's outputs |
| 1 | no KV slot for some ubatch (or no valid split) | cells as before | the previous decode's |
| 2 | aborted by ``abort_callback`` | earlier ubatches kept | none |
| -1 | invalid batch | unchanged | the previous decode's |

**One memory interface.** ``decode`` never asks which memory it holds. The memory is made
by [`create_memory`][reference.memory.create_memory] from the architecture, as
``llama_model::create_memory``: a [`KVCache`][reference.memory.kv_cache.KVCache] for ``llama`` /
``qwen2``, a pair of them ([`KVCacheISWA`][reference.memory.kv_cache_iswa.KVCacheISWA]: the
full-attention layers' and the sliding-window layers') for a model with a window, a
[`RecurrentMemory`][reference.memory.recurrent.RecurrentMemory] of ``max(1, n_seq_max)`` cells,
one per sequence, for ``mamba`` / ``mamba2``. All answer the calls of
``llama_memory_i`` ([`reference.memory.interface`][reference.memory.interface]):

| ``decode`` calls | llama.cpp | KV cache | recurrent memory |
|---|---|---|---|
| ``init_update`` | ``init_update`` | K-shift, stream copies | ``NO_UPDATE`` |
| ``init_batch`` | ``init_batch`` | a ``SlotInfo`` per ubatch | a range of cells per ubatch |
| ``mctx.apply()`` | ``mctx->apply()`` | pos, seq ids into the slot | cells placed, rows moved |
| ``mctx.graph_input()`` | ``build_attn_inp_kv`` / ``build_rs_inp`` | K/V, KQ mask | state rows |
| ``mctx.remove_ubatch()`` | ``seq_rm(s, pos_min, -1)`` | that ``seq_rm`` | cells, rows put back |
| ``state_write``, ``state_read`` | the same | [`reference.memory.state`][reference.memory.state] |
its own blob |

The memory also chooses the split (``init_batch``): ``split_simple`` for a one-stream KV
cache, ``split_equal(sequential=True)`` for one stream per sequence and for a recurrent
memory, whose conv and scan need ``n_seqs`` sequence sets of equal length (llama.cpp uses
``split_seq`` there only when every token outputs embeddings, which this Context never
asks).

What the context does choose is the **forward**, by architecture, as
``llama_model::build_graph``: [`llama_forward`][reference.models.llama.llama_forward] or
[`mamba_forward`][reference.models.mamba.mamba_forward], both fed by ``mctx.graph_input()``.

Where the undo of an aborted ubatch differs from llama.cpp: llama.cpp removes the
positions of each token's *first* seq id only (here every seq id of the ubatch); and a
recurrent memory refuses llama.cpp's partial ``seq_rm``, so there the cell keeps the
ubatch's position over a state that was never computed, while here the cells and rows are
put back.

The sizes follow ``llama_context``'s constructor: ``n_ctx`` is padded to 256 (per stream
when not unified, [`n_ctx_seq`][reference.memory.kv_cache.n_ctx_seq]); ``n_batch`` is capped by the
``n_ctx`` asked for (a causal model never needs a longer batch); ``n_ubatch`` by
``n_batch``.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
from numpy.typing import DTypeLike

from reference.batch import Batch, BatchAllocr, BatchError
from reference.common import LLAMA_MAX_SEQ, LlamarefError
from reference.hparams import MAMBA_ARCHS, LlamaHParams, MambaHParams
from reference.memory import Memory, MemoryContext, MemoryStatus, create_memory, n_ctx_seq
from reference.memory.state import (
    LLAMA_STATE_SEQ_FLAGS_NONE,
    context_state_read,
    context_state_write,
    seq_state_read,
    seq_state_write,
)
from reference.models.gemma import GEMMA_ARCHS, gemma_forward
from reference.models.llama import get_weight, llama_forward, model_dtype
from reference.models.mamba import mamba_forward


# --8<-- [start:ContextError]
class ContextError(LlamarefError, ValueError):
    """A bad context parameter, or a request for outputs the context does not hold.

    Raised before anything changes.
    """
# --8<-- [end:ContextError]


# --8<-- [start:PerfContextData]
@dataclass(frozen=True)
class PerfContextData:
    """The context's timings and counters (``llama_perf_context_data``).

    ``llama_context`` accumulates them when it synchronizes after a decode: a decode of one
    token counts as *eval* (generation), a decode of more than one as *prompt eval*.

    Attributes:
        t_start_ms: when the counters started (context creation or the last
            [`Context.perf_reset`][]), ``time.perf_counter()`` in ms.
        t_load_ms: from context creation to the end of the first decode that computed tokens
            (llama.cpp measures from the model load; a Context receives a loaded model).
        t_p_eval_ms: time spent in decodes of more than one token.
        t_eval_ms: time spent in decodes of one token.
        n_p_eval: tokens of those prompt decodes; at least 1, as llama.cpp, so that a rate
            never divides by zero.
        n_eval: number of one-token decodes; at least 1, as llama.cpp.
        n_reused: ubatches whose compute graph was reused (``n_reused``). The reference
            builds no graph and leaves it at 0; the MLX twin counts its compiled graphs.

    Examples:
        >>> from reference.testing import tiny_hparams, random_weights
        >>> from reference.batch import Batch
        >>> hp = tiny_hparams()
        >>> ctx = Context(hp, random_weights(hp), n_ctx=64)
        >>> ctx.decode(Batch(token=[1, 2, 3])), ctx.decode(Batch(token=[4]))
        (0, 0)
        >>> p = ctx.perf()
        >>> p.n_p_eval, p.n_eval, p.n_reused  # a 3-token prompt, one generated token
        (3, 1, 0)
    """

    t_start_ms: float
    t_load_ms: float
    t_p_eval_ms: float
    t_eval_ms: float
    n_p_eval: int
    n_eval: int
    n_reused: int

    @property
    def p_eval_tokens_per_second(self) -> float:
        """Prompt processing speed: ``1e3 * n_p_eval / t_p_eval_ms`` (0 before any)."""
        return 1e3 * self.n_p_eval / self.t_p_eval_ms if self.t_p_eval_ms > 0 else 0.0

    @property
    def eval_tokens_per_second(self) -> float:
        """Generation speed: ``1e3 * n_eval / t_eval_ms`` (0 before any)."""
        return 1e3 * self.n_eval / self.t_eval_ms if self.t_eval_ms > 0 else 0.0
# --8<-- [end:PerfContextData]


# --8<-- [start:is_recurrent]
def is_recurrent(hparams: LlamaHParams | MambaHParams) -> bool:
    """Whether the model keeps recurrent states instead of a KV cache (``llm_arch_is_recurrent``).

    Examples:
        >>> from reference.testing import tiny_hparams, tiny_mamba_hparams
        >>> is_recurrent(tiny_hparams()), is_recurrent(tiny_mamba_hparams("mamba2"))
        (False, True)
    """
    return hparams.arch in MAMBA_ARCHS
# --8<-- [end:is_recurrent]


# --8<-- [start:cparams]
def context_sizes(
    n_ctx: int, n_batch: int, n_ubatch: int, n_seq_max: int, kv_unified: bool, n_ctx_train: int
) -> dict[str, int]:
    """The sizes ``llama_context`` derives from the parameters asked for (``cparams``).

    - ``n_ctx = 0`` means the model's ``n_ctx_train``; ``n_ubatch = 0`` means ``n_batch``;
      ``n_seq_max = 0`` means 1 (llama.cpp: ``max(1, n_seq_max)``);
    - ``n_batch = min(n_ctx, n_batch)`` with the ``n_ctx`` *asked for* (before padding):
      with causal attention a batch never needs more tokens than the context holds;
    - ``n_ubatch = min(n_batch, n_ubatch)``;
    - ``n_ctx`` is padded to 256, and split into streams by
      [`n_ctx_seq`][reference.memory.kv_cache.n_ctx_seq].

    Args:
        n_ctx: context size asked for (0: ``n_ctx_train``).
        n_batch: logical batch size (most tokens per [`Context.decode`][]).
        n_ubatch: physical batch size (most tokens per forward; 0: ``n_batch``).
        n_seq_max: number of sequences (0: 1).
        kv_unified: one KV stream for all sequences, or one per sequence.
        n_ctx_train: the model's training context (the default ``n_ctx``).

    Returns:
        ``{"n_ctx", "n_ctx_seq", "n_batch", "n_ubatch", "n_seq_max"}``.

    Raises:
        ContextError: a negative size, ``n_batch == 0``, ``n_seq_max > LLAMA_MAX_SEQ``.

    Examples:
        >>> context_sizes(64, 2048, 512, 1, True, n_ctx_train=4096)
        {'n_ctx': 256, 'n_ctx_seq': 256, 'n_batch': 64, 'n_ubatch': 64, 'n_seq_max': 1}
        >>> context_sizes(100, 512, 0, 3, False, n_ctx_train=4096)["n_ctx"]
        768
        >>> context_sizes(256, 512, 512, 300, True, n_ctx_train=4096)  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        reference.context.ContextError: n_seq_max = 300 must be <= 256 (LLAMA_MAX_SEQ)
    """
    for name, value in (("n_ctx", n_ctx), ("n_batch", n_batch), ("n_ubatch", n_ubatch),
                        ("n_seq_max", n_seq_max)):
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 0:
            raise ContextError(f"{name} = {value!r} must be a non-negative integer")
    if n_batch == 0:
        raise ContextError("n_batch = 0: a batch must be able to hold at least one token")
    n_seq_max = max(1, int(n_seq_max))
    if n_seq_max > LLAMA_MAX_SEQ:
        raise ContextError(f"n_seq_max = {n_seq_max} must be <= {LLAMA_MAX_SEQ} (LLAMA_MAX_SEQ)")
    n_ctx = int(n_ctx) if n_ctx else int(n_ctx_train)
    n_batch = min(n_ctx, int(n_batch))
    n_ubatch = min(n_batch, int(n_ubatch) if n_ubatch else n_batch)
    n_ctx_padded, per_stream = n_ctx_seq(n_ctx, n_seq_max, kv_unified)
    return dict(n_ctx=n_ctx_padded, n_ctx_seq=per_stream, n_batch=n_batch, n_ubatch=n_ubatch,
                n_seq_max=n_seq_max)
# --8<-- [end:cparams]


# --8<-- [start:Context]
class Context:
    """``llama_context``: a model, its memory, and the outputs of the last decode.

    The memory is chosen by the architecture, as ``llama_model::create_memory`` does
    ([`create_memory`][]): a [`KVCache`][reference.memory.kv_cache.KVCache] for ``llama`` /
    ``qwen2``, a [`RecurrentMemory`][reference.memory.recurrent.RecurrentMemory] of ``n_seq_max``
    cells for ``mamba`` / ``mamba2`` ([`is_recurrent`][]).

    Args:
        hparams: the model's hyperparameters ([`LlamaHParams`][reference.hparams.LlamaHParams] or
            [`MambaHParams`][reference.hparams.MambaHParams]).
        weights: GGUF-named weights. Float arrays are cast once to ``dtype``; quantized
            tensors stay quantized (the forward then computes in float32).
        n_ctx: context size (0: ``hparams.n_ctx_train``); padded to 256 ([`context_sizes`][]).
        n_batch: the most tokens one [`decode`][] takes (capped by ``n_ctx``).
        n_ubatch: the most tokens one forward computes (capped by ``n_batch``; 0: ``n_batch``).
        n_seq_max: how many sequences (``seq_id`` in ``[0, n_seq_max)``).
        kv_unified: one KV stream shared by every sequence (True) or one per sequence
            (no effect on a recurrent memory).
        swa_full: with a sliding-window model, keep the full context in the cache (True) or
            only what the window needs.
        dtype: dtype of the KV cache (or of the recurrent state rows) and of the computation
            (float32 as llama.cpp's CPU backend; float64 for property tests).
        abort_callback: called with no argument before each ubatch is computed; True aborts
            the decode (return code 2), like ``llama_set_abort_callback``.

    Raises:
        ContextError: a bad size ([`context_sizes`][]).

    Examples:
        >>> from reference.testing import tiny_hparams, random_weights
        >>> hp = tiny_hparams()
        >>> ctx = Context(hp, random_weights(hp), n_ctx=64, n_seq_max=2)
        >>> ctx.n_ctx, ctx.n_batch, ctx.n_ubatch, ctx.n_seq_max
        (256, 64, 64, 2)
        >>> ctx.decode(Batch(token=[1, 2, 3], logits=[True, False, True]))
        0
        >>> ctx.get_logits().shape, ctx.memory.seq_pos_max(0)
        ((2, 32), 2)
        >>> from reference.testing import tiny_mamba_hparams, random_mamba_weights
        >>> mp = tiny_mamba_hparams("mamba2")
        >>> rctx = Context(mp, random_mamba_weights(mp), n_ctx=64, n_seq_max=3)
        >>> type(rctx.memory).__name__, rctx.memory.get_size()
        ('RecurrentMemory', 3)
    """

    on_device = False
    """No ``get_logits_ith_device``: the logits are NumPy rows on the host
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
    ):
        sizes = context_sizes(n_ctx, n_batch, n_ubatch, n_seq_max, kv_unified,
                              hparams.n_ctx_train)
        self.hparams = hparams
        self.dtype = np.dtype(dtype)
        self.weights = {
            name: w.astype(self.dtype) if isinstance(w, np.ndarray) and w.dtype != self.dtype
            and np.issubdtype(w.dtype, np.floating) else w
            for name, w in weights.items()
        }
        self._n_ctx = sizes["n_ctx"]
        self._n_ctx_seq = sizes["n_ctx_seq"]
        self._n_batch = sizes["n_batch"]
        self._n_ubatch = sizes["n_ubatch"]
        self._n_seq_max = sizes["n_seq_max"]
        self.kv_unified = kv_unified
        self.abort_callback = abort_callback
        self.last_error: str | None = None  # why the last decode did not return 0
        self._memory: Memory = self.create_memory(
            hparams, n_ctx_seq=self._n_ctx_seq, n_seq_max=self._n_seq_max,
            kv_unified=kv_unified, swa_full=swa_full, n_ubatch=self._n_ubatch, dtype=self.dtype)
        compute = model_dtype(self.weights)
        self.rope_factors = get_weight(self.weights, "rope_freqs.weight", compute, required=False)
        self._logits = np.zeros((0, hparams.n_vocab), compute)  # (n_outputs, n_vocab)
        self._output_ids = np.zeros(0, np.int64)  # (n_tokens of the last batch,)
        self._t_created_ms = time.perf_counter() * 1e3
        self._t_load_ms = 0.0
        self._has_evaluated_once = False
        self.perf_reset()

    # ---- sizes (llama_n_ctx, llama_n_batch, ...) ----------------------------------------------

    @property
    def n_ctx(self) -> int:
        """Total cells (``llama_n_ctx``): padded to 256, summed over the streams."""
        return self._n_ctx

    @property
    def n_ctx_seq(self) -> int:
        """Cells per stream (``llama_n_ctx_seq``): ``n_ctx`` when unified."""
        return self._n_ctx_seq

    @property
    def n_batch(self) -> int:
        """The most tokens one [`decode`][] accepts (``llama_n_batch``)."""
        return self._n_batch

    @property
    def n_ubatch(self) -> int:
        """The most tokens one forward computes (``llama_n_ubatch``)."""
        return self._n_ubatch

    @property
    def n_seq_max(self) -> int:
        """The number of sequences (``llama_n_seq_max``)."""
        return self._n_seq_max

    @property
    def n_vocab(self) -> int:
        """Width of a logits row."""
        return self.hparams.n_vocab

    @property
    def n_outputs(self) -> int:
        """Rows of logits the last successful decode produced."""
        return len(self._logits)

    @property
    def memory(self) -> Memory:
        """The memory (``llama_get_memory``): ``seq_rm``, ``seq_cp``, ``seq_add``, ..."""
        return self._memory

    def get_memory(self) -> Memory:
        """``llama_get_memory(ctx)``: the same as [`memory`][]."""
        return self._memory

    @property
    def recurrent(self) -> bool:
        """Whether the architecture keeps recurrent states ([`is_recurrent`][])."""
        return is_recurrent(self.hparams)
# --8<-- [end:Context]

    # --8<-- [start:create_memory]
    create_memory = staticmethod(create_memory)
    """The memory factory (``llama_model::create_memory``):
    [`reference.memory.create_memory`][reference.memory.create_memory]; the MLX twin puts its own
    here."""
    # --8<-- [end:create_memory]

    # ---- decode -------------------------------------------------------------------------------

    # --8<-- [start:memory_update]
    def memory_update(self) -> bool:
        """Apply what memory ops left pending (``llama_context::memory_update``).

        ``init_update`` says whether there is anything (a KV cache: a K-shift or a stream
        copy; a recurrent memory: never, a state is not rotated by position); if so, its
        context's ``apply()`` does it. [`decode`][] calls this after validating the batch;
        calling it earlier changes nothing that a later decode could see.

        Returns:
            True when a K-shift turned some key.
        """
        mctx = self._memory.init_update(self.rope_factors)
        if mctx.get_status() is not MemoryStatus.SUCCESS:
            return False
        return mctx.apply()
    # --8<-- [end:memory_update]

    # --8<-- [start:decode]
    def decode(self, batch: Batch) -> int:
        """Run ``batch`` through the model, appending it to the memory (``llama_decode``).

        Args:
            batch: the tokens, their positions (None: continue each sequence), seq ids
                (None: sequence 0) and output flags (None: the last token).

        Returns:
            0 on success; 1 when the KV cache has no slot for the batch (memory cells
            unchanged, outputs of the previous decode kept); 2 when ``abort_callback``
            aborted it (ubatches computed before stay in the memory, none of the aborted
            ubatch; no outputs); -1 when the batch is invalid (nothing changed; the reason is
            in `last_error`).

        A batch may carry token ids or input embeddings ``(n_tokens, n_embd)``; a bad batch
        never raises, it returns -1.

        Raises:
            ContextError: an embeddings batch for a Mamba model (its forward,
                [`mamba_forward`][reference.models.mamba.mamba_forward], takes token ids only);
                nothing changed.

        Examples:
            >>> from reference.testing import tiny_hparams, random_weights
            >>> hp = tiny_hparams()
            >>> ctx = Context(hp, random_weights(hp), n_ctx=256, n_seq_max=2)
            >>> ctx.decode(Batch(token=[1, 2, 3, 4], seq_id=[[0], [1], [0], [1]]))
            0
            >>> ctx.decode(Batch(token=[5], pos=[7]))  # sequence 0 must go on at 2
            -1
            >>> ctx.last_error  # doctest: +ELLIPSIS
            'the tokens of sequence 0 in the input batch have inconsistent ...'
        """
        if batch.embd is not None and self.hparams.arch in MAMBA_ARCHS:
            raise ContextError("this Context runs Mamba on token ids only: mamba_forward "
                               "takes no input embeddings")
        t_start = time.perf_counter()
        # 1. validate: llama_batch_allocr::init (and n_tokens_all <= n_batch)
        try:
            balloc = BatchAllocr(batch, n_vocab=self.n_vocab, n_seq_max=self._n_seq_max,
                                 memory=self._memory, n_embd=self.hparams.n_embd,
                                 n_batch=self._n_batch)
        except BatchError as err:
            self.last_error = str(err)
            return -1
        self.last_error = None
        # 2. what memory ops left pending (K-shift, stream copies)
        self.memory_update()
        # 3. ubatches, and a place in the memory for each of them, or nothing
        mctx = self._memory.init_batch(balloc, self._n_ubatch)
        if mctx.get_status() is not MemoryStatus.SUCCESS:
            self.last_error = mctx.error
            return 1
        # the previous outputs are gone from here on
        self.output_reserve(balloc.n_tokens)
        # 4. one forward per ubatch
        rows = []
        while True:
            mctx.apply()
            if self.abort_callback is not None and self.abort_callback():
                mctx.remove_ubatch()
                self.last_error = "aborted by abort_callback"
                return 2
            rows.append(self.process_ubatch(mctx))
            if not mctx.next():
                break
        # 5. outputs in batch order
        self.output_set(rows, balloc.out_ids)
        self._perf_add(balloc.n_tokens, t_start)
        return 0
    # --8<-- [end:decode]

    # --8<-- [start:outputs]
    def output_reserve(self, n_tokens: int) -> None:
        """Forget the previous outputs: a batch of ``n_tokens`` is about to run.

        ``llama_context::output_reserve``. [`decode`][] calls it once the batch has a
        place in the memory; a batch refused before (-1, 1) keeps the previous outputs.
        """
        self._logits = self._logits[:0]
        self._output_ids = np.full(n_tokens, -1, dtype=np.int64)  # (n_tokens,)

    def output_set(self, rows: list, out_ids: Sequence[int]) -> None:
        """Map batch index to output row (``output_ids``), and put the ubatches' logits rows
        where it says.

        ``llama_context::decode``'s output mappings: the outputs are kept in batch order, so
        ``output_ids[b]`` is the rank of batch token ``b`` among the output tokens (-1 for a
        token without output). The ubatches computed their rows in split order, row ``i``
        for batch token ``out_ids[i]``: it goes to row ``output_ids[out_ids[i]]``.

        Args:
            rows: what [`process_ubatch`][] returned, ubatch after ubatch.
            out_ids: the batch indices of the output tokens in that order
                (`out_ids`).

        The MLX twin keeps the rows on the device here and moves them only when they are
        read (llama.cpp too reorders them lazily, in ``output_reorder``).
        """
        out_ids = np.asarray(out_ids, np.int64)  # (n_outputs,) batch indices, split order
        self._output_ids[np.sort(out_ids)] = np.arange(len(out_ids))  # batch index -> row
        split_rows = np.concatenate(rows)  # (n_outputs, n_vocab), split order
        self._logits = np.empty_like(split_rows)
        self._logits[self._output_ids[out_ids]] = split_rows  # (n_outputs, n_vocab), batch order
    # --8<-- [end:outputs]

    # --8<-- [start:decode_token]
    def decode_token(self, token, seq_id: int = 0) -> int:
        """Decode one sampled token after the end of sequence ``seq_id``: the generation step.

        ``decode(Batch(token=[token], seq_id=[[seq_id]]))``, with the same return codes.
        The MLX twin also takes a token that is still on the device (a scalar ``mx.array``
        from its sampler): it launches the step without reading the token back, so the
        generation loop can read token $t$ while step $t + 1$ computes
        ([`Generator`][reference.tools.generate.Generator]).

        Examples:
            >>> from reference.testing import tiny_hparams, random_weights
            >>> hp = tiny_hparams()
            >>> ctx = Context(hp, random_weights(hp), n_ctx=64)
            >>> ctx.decode(Batch(token=[1, 2])), ctx.decode_token(3), ctx.memory.seq_pos_max(0)
            (0, 0, 2)
        """
        return self.decode(Batch(token=[int(token)], seq_id=[[seq_id]]))

    def synchronize(self) -> None:
        """Wait until the last decode is computed (``llama_synchronize``).

        NumPy computes as it goes: when [`decode`][] returns, its work is done, so here
        there is nothing to wait for. The MLX twin's decode only launches its work.
        """
    # --8<-- [end:decode_token]

    # --8<-- [start:process_ubatch]
    def process_ubatch(self, mctx: MemoryContext) -> np.ndarray:
        """The forward of the memory context's current ubatch, applied: its logits rows.

        The forward is chosen by the architecture (``llama_model::build_graph``) and gets
        its memory input from the memory context (``mctx.graph_input()``):

        - Llama / Qwen2: the ubatch's K/V are written into its slot and the first ``n_kv``
          cells of each stream are read through the KQ mask
          ([`KVCacheAttnInput`][reference.memory.kv_cache.KVCacheAttnInput]);
        - Gemma / Gemma 2 / Gemma 3: the same per layer, the SWA layers from the SWA cache of
          an iSWA memory ([`gemma_forward`][reference.models.gemma.gemma_forward]);
        - Mamba / Mamba-2: the states of the ubatch's ``n_seqs`` sequence sets are read from
          their cells and the final ones written back
          ([`RecurrentMemoryInput`][reference.memory.recurrent.RecurrentMemoryInput]).

        Only the output tokens go through the last layer's FFN and the lm_head
        (``out_ids``).

        Returns:
            ``(n_outputs_ubatch, n_vocab)``.
        """
        ubatch = mctx.get_ubatch()
        out_ids = np.flatnonzero(ubatch.output)  # (n_outputs_ubatch,)
        inp = mctx.graph_input()
        if self.hparams.arch in MAMBA_ARCHS:
            return mamba_forward(self.weights, self.hparams, ubatch.token, inp, out_ids,
                                 n_seqs=ubatch.n_seqs)
        if self.hparams.arch in GEMMA_ARCHS:
            return gemma_forward(self.weights, self.hparams, ubatch.token, ubatch.pos, inp,
                                 out_ids, embd=ubatch.embd)
        return llama_forward(self.weights, self.hparams, ubatch.token, ubatch.pos, inp,
                             out_ids, embd=ubatch.embd)
    # --8<-- [end:process_ubatch]

    # ---- performance (llama_perf_context) -----------------------------------------------------

    # --8<-- [start:perf]
    def _perf_add(self, n_tokens: int, t_start: float, t_end: float | None = None) -> None:
        """Account a successful decode of ``n_tokens`` that started at ``t_start`` (seconds)
        and whose work was done at ``t_end`` (None: now).

        ``llama_context::synchronize``: one token is *eval*, more is *prompt eval*; the first
        decode also fixes ``t_load_ms``.
        """
        t_end = time.perf_counter() if t_end is None else t_end
        dt_ms = (t_end - t_start) * 1e3
        if n_tokens == 1:
            self._t_eval_ms += dt_ms
            self._n_eval += 1
        elif n_tokens > 1:
            self._t_p_eval_ms += dt_ms
            self._n_p_eval += n_tokens
        if n_tokens > 0 and not self._has_evaluated_once:
            self._t_load_ms = t_end * 1e3 - self._t_created_ms
            self._has_evaluated_once = True

    def perf(self) -> PerfContextData:
        """The timings and counters since the last [`perf_reset`][] (``llama_perf_context``).

        Only decodes that returned 0 count (their time from validation to the last output).

        Examples:
            >>> from reference.testing import tiny_hparams, random_weights
            >>> hp = tiny_hparams()
            >>> ctx = Context(hp, random_weights(hp), n_ctx=64)
            >>> ctx.decode(Batch(token=[1, 2, 3])), ctx.decode(Batch(token=[4]))
            (0, 0)
            >>> p = ctx.perf()
            >>> p.n_p_eval, p.n_eval, p.n_reused, p.t_eval_ms > 0
            (3, 1, 0, True)
        """
        return PerfContextData(
            t_start_ms=self._t_start_ms, t_load_ms=self._t_load_ms,
            t_p_eval_ms=self._t_p_eval_ms, t_eval_ms=self._t_eval_ms,
            n_p_eval=max(1, self._n_p_eval), n_eval=max(1, self._n_eval),
            n_reused=max(0, self._n_reused),
        )

    def perf_reset(self) -> None:
        """Restart the counters (``llama_perf_context_reset``); ``t_load_ms`` is kept."""
        self._t_start_ms = time.perf_counter() * 1e3
        self._t_p_eval_ms = self._t_eval_ms = 0.0
        self._n_p_eval = self._n_eval = 0
        self._n_reused = 0
    # --8<-- [end:perf]

    # ---- outputs ------------------------------------------------------------------------------

    # --8<-- [start:get_logits]
    def get_logits(self) -> np.ndarray:
        """The logits of the last successful decode, one row per output token, in batch order.

        Returns:
            ``(n_outputs, n_vocab)``, read-only (empty before any decode and after an abort).
        """
        view = self._logits.view()
        view.flags.writeable = False
        return view
    # --8<-- [end:get_logits]

    # --8<-- [start:get_logits_ith]
    def get_logits_ith(self, i: int) -> np.ndarray:
        """The logits of batch token ``i`` of the last decode (``llama_get_logits_ith``).

        ``i >= 0`` is a *batch index* and that token must have had its output flag set;
        ``i < 0`` counts from the last *output*: row ``n_outputs + i`` (``-1`` is the last
        output token, whatever its batch index).

        Args:
            i: batch index, or negative output index.

        Returns:
            ``(n_vocab,)``, read-only.

        Raises:
            ContextError: no outputs; ``i`` outside the last batch; token ``i`` had no output
                (llama.cpp logs the same reasons and returns NULL).

        Examples:
            >>> from reference.testing import tiny_hparams, random_weights
            >>> hp = tiny_hparams()
            >>> ctx = Context(hp, random_weights(hp), n_ctx=64)
            >>> ctx.decode(Batch(token=[1, 2, 3], logits=[True, False, True]))
            0
            >>> bool((ctx.get_logits_ith(2) == ctx.get_logits_ith(-1)).all())
            True
            >>> ctx.get_logits_ith(1)
            Traceback (most recent call last):
            ...
            reference.context.ContextError: invalid logits id 1: batch.logits[1] != true
        """
        return self.get_logits()[self.output_row(i)]

    def output_row(self, i: int) -> int:
        """The row of [`get_logits`][] that holds batch token ``i``, or the errors of
        [`get_logits_ith`][] (which reads that row)."""
        n_outputs = self.n_outputs
        if n_outputs == 0:
            raise ContextError(f"invalid logits id {i}: no logits (no successful decode with "
                               f"outputs)")
        if i < 0:
            j = n_outputs + i
            if j < 0:
                raise ContextError(f"invalid logits id {i}: negative index out of range "
                                   f"[-{n_outputs}, 0)")
        elif i >= len(self._output_ids):
            raise ContextError(f"invalid logits id {i}: out of range [0, "
                               f"{len(self._output_ids)}) (tokens of the last batch)")
        else:
            j = int(self._output_ids[i])
            if j < 0:
                raise ContextError(f"invalid logits id {i}: batch.logits[{i}] != true")
        return j
    # --8<-- [end:get_logits_ith]


    # ---- state (reference/memory/state.py) ---------------------------------------------------

    # --8<-- [start:state]
    def state_get_data(self) -> bytes:
        """The last decode's outputs and the memory, as bytes (``llama_state_get_data``).

        See
        [`reference.memory.state.context_state_write`][reference.memory.state.context_state_write]
        for the layout; the memory writes its own blob (``memory.state_write``).
        """
        return context_state_write(self._memory, self.hparams, self._logits, self._output_ids)

    def state_set_data(self, data: bytes) -> int:
        """Restore [`state_get_data`][]'s bytes (``llama_state_set_data``); returns their size.

        Raises:
            StateError: a refused blob; nothing changed.
        """
        logits, output_ids = context_state_read(self._memory, self.hparams, data)
        n_vocab = self.n_vocab
        self._logits = logits if logits is not None else self._logits[:0].reshape(0, n_vocab)
        self._output_ids = np.asarray(output_ids, dtype=np.int64)
        return len(data)

    def state_seq_get_data(self, seq_id: int) -> bytes:
        """One sequence's cells and K/V, or its state rows (``llama_state_seq_get_data``):
        [`state_seq_get_data_ext`][] with no flags."""
        return self.state_seq_get_data_ext(seq_id, LLAMA_STATE_SEQ_FLAGS_NONE)

    def state_seq_set_data(self, data: bytes, dest_seq_id: int) -> int:
        """Restore a sequence blob into ``dest_seq_id`` (``llama_state_seq_set_data``):
        [`state_seq_set_data_ext`][] with no flags.

        Returns:
            The size of ``data``.

        Raises:
            StateError: a refused blob (no slot, another model, corrupted); nothing changed.
        """
        return self.state_seq_set_data_ext(data, dest_seq_id, LLAMA_STATE_SEQ_FLAGS_NONE)

    def state_seq_get_data_ext(self, seq_id: int, flags: int = LLAMA_STATE_SEQ_FLAGS_NONE) -> bytes:
        """One sequence's state with ``flags`` (``llama_state_seq_get_data_ext``).

        ``LLAMA_STATE_SEQ_FLAGS_PARTIAL_ONLY`` (alias ``SWA_ONLY``) keeps only the partial
        state: the SWA cache of an iSWA memory (the base cache's part of the sequence is
        expected to stay in place); the whole state for any other memory. Layout:
        [`reference.memory.state.seq_state_write`][reference.memory.state.seq_state_write].

        Raises:
            StateError: flags other than 0 and 1 (``ON_DEVICE`` is not supported); a bad
                ``seq_id``.

        Examples:
            >>> import dataclasses
            >>> from reference.hparams import swa_pattern
            >>> from reference.memory import LLAMA_STATE_SEQ_FLAGS_PARTIAL_ONLY
            >>> from reference.testing import random_weights, tiny_hparams
            >>> hp = dataclasses.replace(tiny_hparams(n_swa=2), swa_layers=swa_pattern(2, 2))
            >>> ctx = Context(hp, random_weights(hp), n_ctx=256)
            >>> ctx.decode(Batch(token=[1, 2, 3, 4]))
            0
            >>> partial = ctx.state_seq_get_data_ext(0, LLAMA_STATE_SEQ_FLAGS_PARTIAL_ONLY)
            >>> ctx.decode(Batch(token=[5, 6], pos=[4, 5])), ctx.memory.seq_rm(0, 4, -1)
            (0, True)
            >>> ctx.state_seq_set_data_ext(partial, 0, 1) == len(partial)
            True
            >>> ctx.memory.seq_pos_min(0), ctx.memory.seq_pos_max(0)  # the window of pos 3
            (2, 3)
        """
        return seq_state_write(self._memory, self.hparams, seq_id, flags)

    def state_seq_set_data_ext(self, data: bytes, dest_seq_id: int,
                               flags: int = LLAMA_STATE_SEQ_FLAGS_NONE) -> int:
        """Restore a blob of [`state_seq_get_data_ext`][] written with the same ``flags`` into
        ``dest_seq_id`` (``llama_state_seq_set_data_ext``); returns its size.

        A partial blob goes back onto a sequence whose base-cache part is still present (the
        positions up to the checkpoint's last one); that part is not checked, as in llama.cpp.

        Raises:
            StateError: no sequence-state magic; other flags than the blob's; a blob that
                does not fit, belongs to another model or is corrupted. Nothing changed then
                (llama.cpp returns 0 and has cleared ``dest_seq_id``:
                [`reference.memory.state.seq_state_read`][reference.memory.state.seq_state_read]).
        """
        seq_state_read(self._memory, self.hparams, data, dest_seq_id, flags)
        return len(data)

    def state_save_file(self, path, tokens) -> int:
        """Save the memory and ``tokens`` to ``path`` (``llama_state_save_file``); its size."""
        return self._memory.state_save_file(path, self.hparams, tokens)

    def state_load_file(self, path) -> np.ndarray:
        """Restore a file of [`state_save_file`][]; returns its tokens."""
        return self._memory.state_load_file(path, self.hparams)

    def state_seq_save_file(self, path, seq_id: int, tokens) -> int:
        """Save one sequence and ``tokens`` to ``path`` (``llama_state_seq_save_file``)."""
        return self._memory.state_save_file(path, self.hparams, tokens, seq_id)

    def state_seq_load_file(self, path, dest_seq_id: int) -> np.ndarray:
        """Restore a sequence file into ``dest_seq_id``; returns its tokens."""
        return self._memory.state_load_file(path, self.hparams, dest_seq_id)
    # --8<-- [end:state]


# --8<-- [start:context_shift]
def context_shift(ctx_or_memory: Context | Memory, seq_id: int, n_keep: int,
                  n_discard: int) -> None:
    r"""Drop ``n_discard`` positions after the first ``n_keep`` and shift the rest back.

    llama.cpp's examples (``main``, ``server``) free room in a full context this way::

        seq_rm (seq_id, n_keep, n_keep + n_discard)
        seq_add(seq_id, n_keep + n_discard, -1, -n_discard)

    A cell at $p \ge n_{keep} + n_{discard}$ moves to $p - n_{discard}$; its key, roped at $p$,
    is turned by $-n_{discard}$ at the next decode, which by RoPE additivity is the key
    roped at $p - n_{discard}$. The sequence stays contiguous: $[0, n_{keep})$ then the
    shifted tail.

    Args:
        ctx_or_memory: a [`Context`][] or its memory.
        seq_id: the sequence to shift (``>= 0``).
        n_keep: positions kept at the start (``>= 0``).
        n_discard: positions dropped after them (``>= 1``).

    Raises:
        ContextError: a negative ``seq_id`` / ``n_keep``, ``n_discard < 1``, or a memory that
            cannot shift (``can_shift()`` is False).
        KVCacheError: ``seq_id`` out of the memory's range (before any change).

    Examples:
        >>> from reference.testing import tiny_hparams, random_weights
        >>> hp = tiny_hparams()
        >>> ctx = Context(hp, random_weights(hp), n_ctx=64)
        >>> ctx.decode(Batch(token=list(range(10))))
        0
        >>> context_shift(ctx, 0, n_keep=2, n_discard=3)
        >>> ctx.memory.seq_pos_min(0), ctx.memory.seq_pos_max(0)
        (0, 6)
    """
    memory = ctx_or_memory.memory if isinstance(ctx_or_memory, Context) else ctx_or_memory
    if seq_id < 0:
        raise ContextError(f"context_shift needs one sequence, got seq_id = {seq_id}")
    if n_keep < 0 or n_discard < 1:
        raise ContextError(f"context_shift needs n_keep >= 0 and n_discard >= 1, got "
                           f"n_keep = {n_keep}, n_discard = {n_discard}")
    if not memory.can_shift():
        raise ContextError("this memory cannot shift positions (can_shift() is False)")
    memory.seq_pos_max(seq_id)  # raises KVCacheError for a bad seq_id, before any change
    memory.seq_rm(seq_id, n_keep, n_keep + n_discard)
    memory.seq_add(seq_id, n_keep + n_discard, -1, -n_discard)
# --8<-- [end:context_shift]
