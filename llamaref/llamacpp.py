r"""llama.cpp itself, through llama-cpp-python's low-level API: the application's peer.

Everything of ours that runs llama.cpp goes through one class, [`LlamaCppContext`][]: one
``llama_context`` and the ``llama_model`` it was made from, behind the names of our Context.
It satisfies [`ContextLike`][reference.context_protocol.ContextLike], so a program of
[`reference.tools`][reference.tools] runs on it as on ours. This module is the one place that
loads the library ([`load_llama_cpp`][]), silences its log ([`silence_llama_log`][]) and picks
its threads ([`default_threads`][]). Its users:

- the oracle tests (``tests/oracle/``): llama.cpp's logits, return codes and memory against
  ours, on the float32 path the reference mirrors (``f32=True``, the default: f32 K and V
  caches, flash attention off, one thread);
- ``llamaref bench --vs llama.cpp``:
  [`LlamaCppRunner`][llamaref.bench.peers.LlamaCppRunner] times it with llama.cpp's own
  defaults (``f32=False``: f16 caches, flash attention ``auto``, as ``llama-bench`` runs it);
- ``llamaref batched-bench --vs llama.cpp`` and ``llamaref parallel --vs llama.cpp``:
  [`batched_bench`][reference.tools.batched_bench.batched_bench] and
  [`ParallelRun`][reference.tools.parallel.ParallelRun] run over it (``f32=False``);
- the scripts that measure llama.cpp (``scripts/passkey_grid.py``, ``scripts/measure_kld.py``).

How llama.cpp's C API (``llama.h``) maps to our names:

| ours | llama.cpp |
|---|---|
| ``LlamaCppContext(path, ...)`` | ``llama_model_load_from_file``, ``llama_init_from_model`` |
| ``decode(batch)`` | ``llama_batch_init``, ``llama_decode``, ``llama_batch_free`` |
| ``get_logits_ith(i)``, ``get_logits()`` | ``llama_get_logits_ith`` (rows copied) |
| ``synchronize()``, ``perf()`` | ``llama_synchronize``, ``llama_perf_context`` |
| ``memory.clear``, ``memory.seq_rm`` ... ``seq_pos_max``, ``can_shift`` | ``llama_memory_*`` |
| ``state_get_data``, ``state_seq_get_data[_ext]``, ... | ``llama_state_*`` |
| ``set_abort_callback(f)`` | ``llama_set_abort_callback`` |
| ``n_ctx``, ``n_ctx_seq``, ``n_batch``, ``n_ubatch``, ``n_seq_max`` | ``llama_n_ctx``, ... |
| ``n_vocab``, ``recurrent`` | ``llama_vocab_n_tokens``, ``llama_model_is_recurrent`` |
| ``tokenize``, ``is_eog`` | ``llama_tokenize``, ``llama_vocab_is_eog`` |
| ``sampler_sample(smpl, i)`` | ``llama_sampler_sample(smpl, ctx, i)`` |
| ``hparams`` | none: our reading of the same GGUF file |
| ``last_error`` | none (llama.cpp logs it): what the return code means |
| ``on_device`` | False: llama.cpp's logits are host memory |

What llama.cpp does at the pinned commit (``src/llama-context.cpp``, ``src/llama-batch.cpp``,
``src/llama-kv-cache.cpp``, ``src/llama-kv-cells.h``), found by reading the source and checked by
``tests/oracle/test_memory.py``:

- **n_ctx is padded to 256.** ``llama_context`` sets ``n_ctx = GGML_PAD(n_ctx, 256)``, so
  ``n_ctx=64`` gives a 256-cell cache (``llama_n_ctx``). With ``kv_unified=False`` every stream
  gets ``n_ctx_seq = GGML_PAD(n_ctx / n_seq_max, 256)`` cells and ``n_ctx`` becomes
  ``n_ctx_seq * n_seq_max``: ``n_ctx=256, n_seq_max=4`` gives four 256-cell streams and
  ``n_ctx = 1024``. Unified: ``n_ctx_seq = n_ctx``. Also ``n_batch = min(n_batch, n_ctx)``
  with the ``n_ctx`` asked for, *before* padding (``n_ctx=64`` caps ``n_batch`` at 64), and
  ``n_ubatch = min(n_ubatch, n_batch)``.
- **Positions.** With ``batch.pos == NULL`` each token gets ``pos_next[seq_id[0]]++``, starting
  from ``llama_memory_seq_pos_max(mem, s) + 1`` (the first seq id of the token decides).
  With explicit positions: for each sequence in the batch, if the memory holds it
  (``pos_max >= 0``), its smallest batch position must be ``pos_max + 1``; its positions must
  cover ``[min, max]`` without holes (repeats allowed); they must not decrease in batch order;
  a token's seq set must not split an earlier set ("incompatible sequence sets"); coupled
  sequences (a token in two) must have the same pos_min/pos_max in memory. An empty memory
  accepts any start position. Each failure: ``llama_decode`` returns **-1**, memory unchanged.
- **Other -1s.** A token id outside ``[0, n_vocab)``; a seq id outside ``[0, n_seq_max)``
  (also in unified mode: the batch check uses ``n_seq_max``). ``n_tokens == 0`` is -1 too, but
  ``n_tokens > n_batch`` is a ``GGML_ASSERT`` (process abort): [`LlamaCppContext.decode`][]
  refuses it first.
- **1 = no slot.** ``init_batch`` simulates placing every ubatch and restores the cells when one
  does not fit; the "optimize" retry is a no-op for the KV cache (``init_update`` ignores it);
  the memory is unchanged (pos_min/pos_max, and the continuation's logits, are as before).
- **Memory ops.** ``seq_rm`` on a KV cache always returns True (only recurrent memories
  return False). Out-of-range seq ids abort llama.cpp (``GGML_ASSERT``) (the memory accepts
  seq ids ``< 256`` in unified mode, ``< n_seq_max`` per stream); this wrapper raises
  [`LlamaCppError`][] instead. A cross-stream ``seq_cp`` (``kv_unified=False``) copies whole
  streams and asserts the range is the whole cache (``p0, p1 < 0``); it wipes the destination
  stream. ``seq_keep(s)`` only looks at the stream of ``s``: with ``kv_unified=False`` the
  other sequences, which live in other streams, are kept.
- **seq_div rotates K the wrong way.** ``llama_kv_cells::pos_div`` records
  ``shift += p_old - p_new`` while ``pos_add`` records ``shift += d = p_new - p_old``; the
  K-shift graph ropes K by ``shift``. After ``seq_div`` K is rotated by ``+(p_old - p_new)``
  instead of ``-(p_old - p_new)``: the logits of the next decode differ from a fresh decode at
  the divided positions. ``seq_add`` is right.

Ownership: a ``llama_batch`` is allocated by ``llama_batch_init`` for each decode and freed
with ``llama_batch_free`` right after (its pointers are restored first when ``pos``/``logits``
were set to NULL); [`LlamaCppContext.close`][] (or the end of a ``with`` block, or the
object's collection) frees the context and then the model.
"""

from __future__ import annotations

import ctypes
import os
from pathlib import Path
from types import ModuleType
from typing import Any

import numpy as np

from reference.arch import hparams_from_file
from reference.common import GGML_TYPE_F32, LLAMA_MAX_SEQ, LlamarefError
from reference.context import PerfContextData
from reference.gguf import read_gguf
from reference.hparams import LlamaHParams, MambaHParams

DECODE_RESULTS = {
    1: "no memory slot for the batch (llama.cpp restored the memory)",
    2: "aborted by the abort callback",
    -1: "invalid batch (llama.cpp logs why)",
}
"""What ``llama_decode``'s return codes other than 0 mean (``llama.h``); others: an error."""

_LOG_CALLBACK = None  # keeps the no-op logger alive for the process


class LlamaCppError(LlamarefError, ValueError):
    """llama.cpp cannot do what was asked: llama-cpp-python is missing, it cannot load the
    model or make the context, or the call would abort the process (a ``GGML_ASSERT``) and
    was refused first. Raised before anything changes."""


class LlamaCppOutputError(LlamarefError, IndexError):
    """``get_logits_ith`` asked for a row the last decode did not output."""


# --8<-- [start:load_llama_cpp]
def load_llama_cpp() -> ModuleType:
    """The ``llama_cpp`` module, its backend initialised and its log silenced.

    Raises:
        LlamaCppError: llama-cpp-python is not installed.
    """
    try:
        import llama_cpp
    except ImportError:
        raise LlamaCppError("running llama.cpp needs llama-cpp-python: pip install "
                            "'llamaref[oracles]'") from None
    silence_llama_log()
    llama_cpp.llama_backend_init()
    return llama_cpp


def silence_llama_log() -> None:
    """Install a no-op ``llama_log_set`` callback (once per process)."""
    global _LOG_CALLBACK
    import llama_cpp

    if _LOG_CALLBACK is None:
        _LOG_CALLBACK = llama_cpp.llama_log_callback(lambda level, text, user_data: None)
        llama_cpp.llama_log_set(_LOG_CALLBACK, ctypes.c_void_p(0))


def default_threads() -> int:
    """llama.cpp's threads when none are asked for: every core, as OpenBLAS uses.

    Examples:
        >>> default_threads() >= 1
        True
    """
    return os.cpu_count() or 1
# --8<-- [end:load_llama_cpp]


def _field(batch, name):
    """``batch.name`` for our ``Batch`` (``token``...) or a plain object / dict."""
    if isinstance(batch, dict):
        return batch.get(name)
    return getattr(batch, name, None)


# --8<-- [start:LlamaCppContext]
class LlamaCppContext:
    """One llama.cpp context and its model behind our Context's names.

    Args:
        model_path: a GGUF file.
        n_ctx: requested context size (llama.cpp pads it, see the module docstring).
        n_batch: the most tokens one ``decode`` may take.
        n_ubatch: the most tokens one compute step takes.
        n_seq_max: sequence ids allowed in a batch are ``0..n_seq_max-1``.
        kv_unified: one KV stream for all sequences (True) or one per sequence.
        swa_full: full-size SWA cache (no effect on models without SWA layers).
        n_threads: CPU threads for prompts and generation; 0 or None: [`default_threads`][].
        f32: f32 K and V caches and no flash attention, the float32 path the reference
            computes (True, to compare logits); False keeps llama.cpp's own defaults (f16
            caches, flash attention ``auto``), as ``llama-bench`` runs it.

    ``n_vocab``, ``n_ctx``, ``n_ctx_seq``, ``n_batch``, ``n_ubatch``, ``n_seq_max`` and
    ``n_threads`` are llama.cpp's own, after its padding and caps; ``recurrent`` is
    ``llama_model_is_recurrent``; ``last_error`` says what the last ``decode``'s return code
    means (None after a success).

    Raises:
        LlamaCppError: llama-cpp-python is missing, or llama.cpp could not load the model or
            create the context.

    Examples:
        >>> import tempfile, pathlib
        >>> from reference.batch import Batch
        >>> from reference.testing import tiny_hparams, random_weights, write_tiny_gguf
        >>> hp = tiny_hparams(n_layer=1)
        >>> path = write_tiny_gguf(pathlib.Path(tempfile.mkdtemp()) / "t.gguf", hp,
        ...                        random_weights(hp))
        >>> with LlamaCppContext(path, n_ctx=64, n_batch=8, n_ubatch=8) as ctx:
        ...     rc = ctx.decode(Batch(token=[1, 2, 3]))
        ...     rc, ctx.n_ctx, ctx.get_logits_ith(-1).shape, ctx.memory.seq_pos_max(0)
        (0, 256, (32,), 2)
    """

    on_device = False

    def __init__(
        self,
        model_path: str | Path,
        n_ctx: int,
        n_batch: int,
        n_ubatch: int,
        n_seq_max: int = 1,
        kv_unified: bool = True,
        swa_full: bool = True,
        n_threads: int | None = 1,
        f32: bool = True,
    ):
        self._ctx = self._model = None  # what close() frees, once made
        self._ll = ll = load_llama_cpp()
        self.path = Path(model_path)
        self._model = ll.llama_model_load_from_file(str(model_path).encode(),
                                                    ll.llama_model_default_params())
        if not self._model:
            raise LlamaCppError(f"llama.cpp could not load {model_path}")
        cparams = ll.llama_context_default_params()
        cparams.n_ctx, cparams.n_batch, cparams.n_ubatch = n_ctx, n_batch, n_ubatch
        cparams.n_seq_max, cparams.kv_unified, cparams.swa_full = n_seq_max, kv_unified, swa_full
        cparams.n_threads = cparams.n_threads_batch = n_threads or default_threads()
        if f32:
            cparams.type_k = cparams.type_v = GGML_TYPE_F32
            cparams.flash_attn_type = ll.LLAMA_FLASH_ATTN_TYPE_DISABLED
        self._ctx = ll.llama_init_from_model(self._model, cparams)
        if not self._ctx:
            self.close()
            raise LlamaCppError("llama.cpp could not create a context of these sizes")
        self._mem = ll.llama_get_memory(self._ctx)
        self._vocab = ll.llama_model_get_vocab(self._model)
        self.n_vocab = ll.llama_vocab_n_tokens(self._vocab)
        self.n_ctx = ll.llama_n_ctx(self._ctx)
        self.n_ctx_seq = ll.llama_n_ctx_seq(self._ctx)
        self.n_batch = ll.llama_n_batch(self._ctx)
        self.n_ubatch = ll.llama_n_ubatch(self._ctx)
        self.n_seq_max = ll.llama_n_seq_max(self._ctx)
        self.n_threads = ll.llama_n_threads(self._ctx)
        self.kv_unified = kv_unified
        self.recurrent = bool(ll.llama_model_is_recurrent(self._model))
        self.last_error: str | None = None
        self._hparams: LlamaHParams | MambaHParams | None = None
        self._outputs: list[int] = []  # batch indices with logits, of the last decode
        self._abort_cb = None  # keeps the abort callback alive

    @property
    def hparams(self) -> LlamaHParams | MambaHParams:
        """The model's hyperparameters, as our loader reads the same GGUF (read when first
        asked: llama.cpp itself does not need them).

        Raises:
            GGUFError: our reader does not support this file's architecture.
        """
        if self._hparams is None:
            self._hparams = hparams_from_file(read_gguf(self.path))
        return self._hparams

    # -- decoding ----------------------------------------------------------------------------

    def decode(self, batch: Any) -> int:
        """``llama_decode`` of a batch given as our ``Batch`` (or any object / dict with the
        fields ``token``, ``pos``, ``seq_id``, ``logits``; ``None`` = llama.cpp's default).

        Args:
            batch: ``token`` (n_tokens,) ints; ``pos`` None or (n_tokens,) ints; ``seq_id``
                None (all seq 0) or one list of seq ids per token; ``logits`` None (last
                token only) or (n_tokens,) bools.

        Returns:
            llama.cpp's return code: 0 ok, 1 no KV slot, 2 aborted, -1 invalid batch
            ([`DECODE_RESULTS`][]; ``last_error`` says which).

        Raises:
            LlamaCppError: an empty batch or more than ``n_batch`` tokens (llama.cpp
                asserts), or ``pos=None`` with a seq id outside ``[0, n_seq_max)`` (llama.cpp
                would index out of bounds while filling positions).
        """
        token = [int(t) for t in _field(batch, "token")]
        pos, seq_id, logits = (_field(batch, k) for k in ("pos", "seq_id", "logits"))
        n = len(token)
        if n == 0 or n > self.n_batch:
            raise LlamaCppError(f"a batch needs 1..n_batch={self.n_batch} tokens, got {n}")
        seq_id = [[0] for _ in range(n)] if seq_id is None else [list(s) for s in seq_id]
        if pos is None and any(not 0 <= s[0] < self.n_seq_max for s in seq_id):
            raise LlamaCppError("pos=None needs every first seq id in [0, n_seq_max)")
        rc = self._llama_decode(token, pos, seq_id, logits)
        self.last_error = None if rc == 0 else DECODE_RESULTS.get(rc, f"error {rc}")
        if rc == 0:
            self._outputs = [
                i for i in range(n) if (logits[i] if logits is not None else i == n - 1)
            ]
        return rc

    def _llama_decode(self, token: list[int], pos, seq_id: list[list[int]], logits) -> int:
        """One ``llama_batch`` filled, decoded and freed; ``pos``/``logits`` None: NULL."""
        ll, n = self._ll, len(token)
        b = ll.llama_batch_init(n, 0, max(1, max(len(s) for s in seq_id)))
        pos_ptr, logits_ptr = b.pos, b.logits
        try:
            b.n_tokens = n
            for i in range(n):
                b.token[i] = token[i]
                b.n_seq_id[i] = len(seq_id[i])
                for k, s in enumerate(seq_id[i]):
                    b.seq_id[i][k] = int(s)
                if pos is not None:
                    b.pos[i] = int(pos[i])
                if logits is not None:
                    b.logits[i] = 1 if logits[i] else 0
            if pos is None:
                b.pos = ctypes.cast(None, type(pos_ptr))
            if logits is None:
                b.logits = ctypes.cast(None, type(logits_ptr))
            return int(ll.llama_decode(self._ctx, b))
        finally:
            b.pos, b.logits = pos_ptr, logits_ptr  # llama_batch_free frees these
            ll.llama_batch_free(b)

    def get_logits_ith(self, i: int) -> np.ndarray:
        """A copy of the logits of batch index ``i`` (negative: counted from the last output).

        Returns:
            (n_vocab,) float32.

        Raises:
            LlamaCppOutputError: ``i`` is not an output of the last successful decode.
        """
        ptr = self._ll.llama_get_logits_ith(self._ctx, int(i))
        if not ptr:
            raise LlamaCppOutputError(f"batch index {i} has no logits in the last decode")
        return np.ctypeslib.as_array(ptr, shape=(self.n_vocab,)).copy()  # (n_vocab,)

    def get_logits(self) -> np.ndarray:
        """The logits of every output of the last decode, in batch order: (n_outputs, n_vocab)."""
        rows = [self.get_logits_ith(i) for i in self._outputs]
        return np.stack(rows) if rows else np.zeros((0, self.n_vocab), np.float32)

    def synchronize(self) -> None:
        """``llama_synchronize``: wait until the last decode's work is done."""
        self._ll.llama_synchronize(self._ctx)

    def perf(self) -> PerfContextData:
        """``llama_perf_context``: llama.cpp's own timings and counters."""
        d = self._ll.llama_perf_context(self._ctx)
        return PerfContextData(t_start_ms=d.t_start_ms, t_load_ms=d.t_load_ms,
                               t_p_eval_ms=d.t_p_eval_ms, t_eval_ms=d.t_eval_ms,
                               n_p_eval=d.n_p_eval, n_eval=d.n_eval, n_reused=d.n_reused)

    # -- memory ------------------------------------------------------------------------------

    @property
    def memory(self) -> LlamaCppContext:
        """The memory API lives on the wrapper itself (``ctx.memory.seq_rm(...)`` works)."""
        return self

    def _check_seq(self, seq_id: int, allow_all: bool = False) -> None:
        """Raise ``LlamaCppError`` where llama.cpp's memory would ``GGML_ASSERT``."""
        n = LLAMA_MAX_SEQ if self.kv_unified else self.n_seq_max
        if not (0 <= seq_id < n or (allow_all and seq_id == -1)):
            raise LlamaCppError(f"seq_id {seq_id} out of range [0, {n})")

    def seq_rm(self, seq_id: int, p0: int, p1: int) -> bool:
        """``llama_memory_seq_rm``: drop ``seq_id`` (-1: all) from cells with ``p0 <= pos < p1``."""
        self._check_seq(seq_id, allow_all=True)
        return bool(self._ll.llama_memory_seq_rm(self._mem, seq_id, p0, p1))

    def seq_cp(self, seq_id_src: int, seq_id_dst: int, p0: int, p1: int) -> None:
        """``llama_memory_seq_cp``: add ``seq_id_dst`` to the cells of ``seq_id_src`` in range."""
        self._check_seq(seq_id_src)
        self._check_seq(seq_id_dst)
        if not self.kv_unified and seq_id_src != seq_id_dst and (p0 >= 0 or p1 >= 0):
            raise LlamaCppError("llama.cpp copies across streams only for the whole range "
                                "(-1, -1)")
        self._ll.llama_memory_seq_cp(self._mem, seq_id_src, seq_id_dst, p0, p1)

    def seq_keep(self, seq_id: int) -> None:
        """``llama_memory_seq_keep``: drop every sequence but ``seq_id``."""
        self._check_seq(seq_id)
        self._ll.llama_memory_seq_keep(self._mem, seq_id)

    def seq_add(self, seq_id: int, p0: int, p1: int, shift: int) -> None:
        """``llama_memory_seq_add``: ``pos += shift`` for ``seq_id``'s cells in ``[p0, p1)``."""
        self._check_seq(seq_id)
        self._ll.llama_memory_seq_add(self._mem, seq_id, p0, p1, shift)

    def seq_div(self, seq_id: int, p0: int, p1: int, d: int) -> None:
        """``llama_memory_seq_div``: ``pos //= d`` for ``seq_id``'s cells in ``[p0, p1)``."""
        self._check_seq(seq_id)
        if d <= 0:
            raise LlamaCppError(f"d must be positive, got {d}")
        self._ll.llama_memory_seq_div(self._mem, seq_id, p0, p1, d)

    def seq_pos_min(self, seq_id: int) -> int:
        """``llama_memory_seq_pos_min``: the smallest position of ``seq_id``, -1 if none."""
        self._check_seq(seq_id)
        return int(self._ll.llama_memory_seq_pos_min(self._mem, seq_id))

    def seq_pos_max(self, seq_id: int) -> int:
        """``llama_memory_seq_pos_max``: the largest position of ``seq_id``, -1 if none."""
        self._check_seq(seq_id)
        return int(self._ll.llama_memory_seq_pos_max(self._mem, seq_id))

    def clear(self, data: bool = True) -> None:
        """``llama_memory_clear``: empty every cell (``data``: also zero the buffers)."""
        self._ll.llama_memory_clear(self._mem, data)

    def can_shift(self) -> bool:
        """``llama_memory_can_shift``."""
        return bool(self._ll.llama_memory_can_shift(self._mem))

    # -- state -------------------------------------------------------------------------------

    def state_get_data(self) -> bytes:
        """``llama_state_get_size`` + ``llama_state_get_data``: the whole context state."""
        n = self._ll.llama_state_get_size(self._ctx)
        buf = (ctypes.c_uint8 * n)()
        written = self._ll.llama_state_get_data(self._ctx, buf, n)
        return bytes(buf[:written])

    def state_set_data(self, data: bytes) -> int:
        """``llama_state_set_data``: bytes read (0 on failure)."""
        buf = (ctypes.c_uint8 * len(data)).from_buffer_copy(data)
        return int(self._ll.llama_state_set_data(self._ctx, buf, len(data)))

    def state_seq_get_data(self, seq_id: int) -> bytes:
        """``llama_state_seq_get_size`` + ``llama_state_seq_get_data``: one sequence's state."""
        self._check_seq(seq_id)
        n = self._ll.llama_state_seq_get_size(self._ctx, seq_id)
        buf = (ctypes.c_uint8 * n)()
        written = self._ll.llama_state_seq_get_data(self._ctx, buf, n, seq_id)
        return bytes(buf[:written])

    def state_seq_set_data(self, data: bytes, dest_seq_id: int) -> int:
        """``llama_state_seq_set_data``: bytes read (0 on failure)."""
        self._check_seq(dest_seq_id)
        buf = (ctypes.c_uint8 * len(data)).from_buffer_copy(data)
        return int(self._ll.llama_state_seq_set_data(self._ctx, buf, len(data), dest_seq_id))

    def state_seq_get_data_ext(self, seq_id: int, flags: int = 0) -> bytes:
        """``llama_state_seq_get_size_ext`` + ``llama_state_seq_get_data_ext``
        (``flags``: ``LLAMA_STATE_SEQ_FLAGS_*``, e.g. 1: the SWA part only)."""
        self._check_seq(seq_id)
        n = self._ll.llama_state_seq_get_size_ext(self._ctx, seq_id, flags)
        buf = (ctypes.c_uint8 * n)()
        written = self._ll.llama_state_seq_get_data_ext(self._ctx, buf, n, seq_id, flags)
        return bytes(buf[:written])

    def state_seq_set_data_ext(self, data: bytes, dest_seq_id: int, flags: int = 0) -> int:
        """``llama_state_seq_set_data_ext``: bytes read (0 on failure)."""
        self._check_seq(dest_seq_id)
        buf = (ctypes.c_uint8 * len(data)).from_buffer_copy(data)
        return int(self._ll.llama_state_seq_set_data_ext(self._ctx, buf, len(data),
                                                         dest_seq_id, flags))

    # -- abort -------------------------------------------------------------------------------

    def set_abort_callback(self, callback) -> None:
        """``llama_set_abort_callback``: ``callback()`` (no argument) answering True aborts.

        ggml's CPU backend asks it after each graph node, so an aborted ``llama_decode``
        returns 2 after computing part of a ubatch's graph. None removes the callback.
        """
        ll = self._ll
        if callback is None:
            self._abort_cb = None
            ll.llama_set_abort_callback(self._ctx, ll.ggml_abort_callback(0), None)
            return
        self._abort_cb = ll.ggml_abort_callback(lambda data: bool(callback()))  # kept alive
        ll.llama_set_abort_callback(self._ctx, self._abort_cb, None)

    # -- vocabulary and samplers -------------------------------------------------------------

    def tokenize(self, text: str, add_special: bool = True,
                 parse_special: bool = False) -> list[int]:
        """``llama_tokenize`` (``common_tokenize``): llama.cpp's tokens of ``text``."""
        data = text.encode()
        n_max = len(data) + 8  # a token per byte, and the special tokens added
        out = (self._ll.llama_token * n_max)()
        n = self._ll.llama_tokenize(self._vocab, data, len(data), out, n_max, add_special,
                                    parse_special)
        if n < 0:
            raise LlamaCppError(f"llama_tokenize needs room for {-n} tokens, had {n_max}")
        return list(out[:n])

    def is_eog(self, token: int) -> bool:
        """``llama_vocab_is_eog``: the token ends a generation."""
        return bool(self._ll.llama_vocab_is_eog(self._vocab, token))

    def sampler_sample(self, smpl, i: int) -> int:
        """``llama_sampler_sample(smpl, ctx, i)``: a llama.cpp sampler (chain) applied to the
        logits of batch index ``i``, its token accepted."""
        return int(self._ll.llama_sampler_sample(smpl, ctypes.c_void_p(self._ctx), i))

    # -- lifetime ----------------------------------------------------------------------------

    def close(self) -> None:
        """Free the context, then the model (idempotent)."""
        if self._ctx:
            self._ll.llama_free(self._ctx)
            self._ctx = None
        if self._model:
            self._ll.llama_model_free(self._model)
            self._model = None

    def __enter__(self) -> LlamaCppContext:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self):
        if hasattr(self, "_ctx"):  # __init__ got as far as its first line
            self.close()
# --8<-- [end:LlamaCppContext]
