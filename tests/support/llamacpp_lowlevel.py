"""llama.cpp's context and memory through llama-cpp-python's low-level API: the oracle harness.

:class:`LlamaCppContext` wraps one ``llama_context`` with the method names of our
:class:`reference.context.Context` (``decode``, ``get_logits``, ``get_logits_ith``) and of the
memory API (``seq_rm``, ``seq_cp``, ``seq_keep``, ``seq_add``, ``seq_div``, ``seq_pos_min``,
``seq_pos_max``, ``clear``, ``can_shift``), so that one scenario script
(:mod:`tests.support.scenarios`) drives both. The context runs the plain float32 path the reference
mirrors: f32 K and V caches (``type_k = type_v = GGML_TYPE_F32``), flash attention disabled
(``flash_attn_type = LLAMA_FLASH_ATTN_TYPE_DISABLED``), 1 thread. llama.cpp's log is silenced.

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
  ``n_tokens > n_batch`` is a ``GGML_ASSERT`` (process abort): :meth:`decode` refuses it first.
- **1 = no slot.** ``init_batch`` simulates placing every ubatch and restores the cells when one
  does not fit; the "optimize" retry is a no-op for the KV cache (``init_update`` ignores it);
  the memory is unchanged (pos_min/pos_max, and the continuation's logits, are as before).
- **Memory ops.** ``seq_rm`` on a KV cache always returns True (only recurrent memories
  return False). Out-of-range seq ids abort llama.cpp (``GGML_ASSERT``) (the memory accepts
  seq ids ``< 256`` in unified mode, ``< n_seq_max`` per stream); this wrapper raises
  ``ValueError`` instead. A cross-stream ``seq_cp`` (``kv_unified=False``) copies whole streams
  and asserts the range is the whole cache (``p0, p1 < 0``); it wipes the destination stream.
  ``seq_keep(s)`` only looks at the stream of ``s``: with ``kv_unified=False`` the other
  sequences, which live in other streams, are kept.
- **seq_div rotates K the wrong way.** ``llama_kv_cells::pos_div`` records
  ``shift += p_old - p_new`` while ``pos_add`` records ``shift += d = p_new - p_old``; the
  K-shift graph ropes K by ``shift``. After ``seq_div`` K is rotated by ``+(p_old - p_new)``
  instead of ``-(p_old - p_new)``: the logits of the next decode differ from a fresh decode at
  the divided positions. ``seq_add`` is right.

Ownership: a ``llama_batch`` is allocated by ``llama_batch_init`` for each decode and freed
with ``llama_batch_free`` right after (its pointers are restored first when ``pos``/``logits``
were set to NULL); :meth:`LlamaCppContext.close` frees the context and the model.
"""

from __future__ import annotations

import ctypes
from pathlib import Path

import numpy as np

LLAMA_MAX_SEQ = 256  # llama.cpp's compile-time bound on seq ids (src/llama-cparams.h)
GGML_TYPE_F32 = 0

_LOG_CALLBACK = None  # keeps the no-op logger alive for the process


def silence_llama_log() -> None:
    """Install a no-op ``llama_log_set`` callback (once per process)."""
    global _LOG_CALLBACK
    import llama_cpp

    if _LOG_CALLBACK is None:
        _LOG_CALLBACK = llama_cpp.llama_log_callback(lambda level, text, user_data: None)
        llama_cpp.llama_log_set(_LOG_CALLBACK, ctypes.c_void_p(0))


def _field(batch, name):
    """``batch.name`` for our ``Batch`` (``token``...) or a plain object / dict."""
    if isinstance(batch, dict):
        return batch.get(name)
    return getattr(batch, name, None)


# --8<-- [start:LlamaCppContext]
class LlamaCppContext:
    """One llama.cpp context (f32 KV cache, no flash attention) behind our Context's names.

    Args:
        model_path: a GGUF file (e.g. from ``tests.support.tiny_models.write_tiny_gguf``).
        n_ctx: requested context size (llama.cpp pads it, see the module docstring).
        n_batch: the most tokens one ``decode`` may take.
        n_ubatch: the most tokens one compute step takes.
        n_seq_max: sequence ids allowed in a batch are ``0..n_seq_max-1``.
        kv_unified: one KV stream for all sequences (True) or one per sequence.
        swa_full: full-size SWA cache (no effect on models without SWA layers).
        n_threads: CPU threads.

    Raises:
        RuntimeError: llama.cpp could not load the model or create the context.
    """

    def __init__(
        self,
        model_path: str | Path,
        n_ctx: int,
        n_batch: int,
        n_ubatch: int,
        n_seq_max: int = 1,
        kv_unified: bool = True,
        swa_full: bool = True,
        n_threads: int = 1,
    ):
        import llama_cpp

        self._ll = llama_cpp
        silence_llama_log()
        llama_cpp.llama_backend_init()
        mparams = llama_cpp.llama_model_default_params()
        self._model = llama_cpp.llama_model_load_from_file(str(model_path).encode(), mparams)
        if not self._model:
            raise RuntimeError(f"llama.cpp could not load {model_path}")
        cparams = llama_cpp.llama_context_default_params()
        cparams.n_ctx = n_ctx
        cparams.n_batch = n_batch
        cparams.n_ubatch = n_ubatch
        cparams.n_seq_max = n_seq_max
        cparams.kv_unified = kv_unified
        cparams.swa_full = swa_full
        cparams.type_k = GGML_TYPE_F32
        cparams.type_v = GGML_TYPE_F32
        cparams.flash_attn_type = llama_cpp.LLAMA_FLASH_ATTN_TYPE_DISABLED
        cparams.n_threads = n_threads
        cparams.n_threads_batch = n_threads
        self._ctx = llama_cpp.llama_init_from_model(self._model, cparams)
        if not self._ctx:
            llama_cpp.llama_model_free(self._model)
            raise RuntimeError("llama.cpp could not create the context")
        self._mem = llama_cpp.llama_get_memory(self._ctx)
        vocab = llama_cpp.llama_model_get_vocab(self._model)
        self.n_vocab = llama_cpp.llama_vocab_n_tokens(vocab)
        self.n_ctx = llama_cpp.llama_n_ctx(self._ctx)
        self.n_ctx_seq = llama_cpp.llama_n_ctx_seq(self._ctx)
        self.n_batch = llama_cpp.llama_n_batch(self._ctx)
        self.n_ubatch = llama_cpp.llama_n_ubatch(self._ctx)
        self.n_seq_max = llama_cpp.llama_n_seq_max(self._ctx)
        self.kv_unified = kv_unified
        self._outputs: list[int] = []  # batch indices with logits, of the last decode

    # -- decoding ----------------------------------------------------------------------------

    def decode(self, batch) -> int:
        """``llama_decode`` of a batch given as our ``Batch`` (or any object / dict with the
        fields ``token``, ``pos``, ``seq_id``, ``logits``; ``None`` = llama.cpp's default).

        Args:
            batch: ``token`` (n_tokens,) ints; ``pos`` None or (n_tokens,) ints; ``seq_id``
                None (all seq 0) or one list of seq ids per token; ``logits`` None (last
                token only) or (n_tokens,) bools.

        Returns:
            llama.cpp's return code: 0 ok, 1 no KV slot, 2 aborted, -1 invalid batch.

        Raises:
            ValueError: an empty batch or more than ``n_batch`` tokens (llama.cpp asserts),
                or ``pos=None`` with a seq id outside ``[0, n_seq_max)`` (llama.cpp would
                index out of bounds while filling positions).
        """
        ll = self._ll
        token = [int(t) for t in _field(batch, "token")]
        pos, seq_id, logits = (_field(batch, k) for k in ("pos", "seq_id", "logits"))
        n = len(token)
        if n == 0 or n > self.n_batch:
            raise ValueError(f"a batch needs 1..n_batch={self.n_batch} tokens, got {n}")
        seq_id = [[0] for _ in range(n)] if seq_id is None else [list(s) for s in seq_id]
        if pos is None and any(not 0 <= s[0] < self.n_seq_max for s in seq_id):
            raise ValueError("pos=None needs every first seq id in [0, n_seq_max)")
        n_seq_alloc = max(1, max(len(s) for s in seq_id))
        b = ll.llama_batch_init(n, 0, n_seq_alloc)
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
            rc = int(ll.llama_decode(self._ctx, b))
        finally:
            b.pos, b.logits = pos_ptr, logits_ptr  # llama_batch_free frees these
            ll.llama_batch_free(b)
        if rc == 0:
            self._outputs = [
                i for i in range(n) if (logits[i] if logits is not None else i == n - 1)
            ]
        return rc

    def get_logits_ith(self, i: int) -> np.ndarray:
        """A copy of the logits of batch index ``i`` (negative: counted from the last output).

        Returns:
            (n_vocab,) float32.

        Raises:
            IndexError: ``i`` is not an output of the last successful decode.
        """
        ptr = self._ll.llama_get_logits_ith(self._ctx, int(i))
        if not ptr:
            raise IndexError(f"batch index {i} has no logits in the last decode")
        return np.ctypeslib.as_array(ptr, shape=(self.n_vocab,)).copy()  # (n_vocab,)

    def get_logits(self) -> np.ndarray:
        """The logits of every output of the last decode, in batch order: (n_outputs, n_vocab)."""
        return np.stack([self.get_logits_ith(i) for i in self._outputs])  # (n_outputs, n_vocab)

    # -- memory ------------------------------------------------------------------------------

    def _check_seq(self, seq_id: int, allow_all: bool = False) -> None:
        """Raise ``ValueError`` where llama.cpp's memory would ``GGML_ASSERT``."""
        n = LLAMA_MAX_SEQ if self.kv_unified else self.n_seq_max
        if not (0 <= seq_id < n or (allow_all and seq_id == -1)):
            raise ValueError(f"seq_id {seq_id} out of range [0, {n})")

    def seq_rm(self, seq_id: int, p0: int, p1: int) -> bool:
        """``llama_memory_seq_rm``: drop ``seq_id`` (-1: all) from cells with ``p0 <= pos < p1``."""
        self._check_seq(seq_id, allow_all=True)
        return bool(self._ll.llama_memory_seq_rm(self._mem, seq_id, p0, p1))

    def seq_cp(self, seq_id_src: int, seq_id_dst: int, p0: int, p1: int) -> None:
        """``llama_memory_seq_cp``: add ``seq_id_dst`` to the cells of ``seq_id_src`` in range."""
        self._check_seq(seq_id_src)
        self._check_seq(seq_id_dst)
        if not self.kv_unified and seq_id_src != seq_id_dst and (p0 >= 0 or p1 >= 0):
            raise ValueError("llama.cpp copies across streams only for the whole range (-1, -1)")
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
            raise ValueError(f"d must be positive, got {d}")
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

    @property
    def memory(self) -> LlamaCppContext:
        """The memory API lives on the wrapper itself (``ctx.memory.seq_rm(...)`` works)."""
        return self

    # -- state -------------------------------------------------------------------------------

    def state_get_data(self) -> bytes:
        """``llama_state_get_size`` + ``llama_state_get_data``: the whole context state."""
        n = self._ll.llama_state_get_size(self._ctx)
        buf = (ctypes.c_uint8 * n)()
        written = self._ll.llama_state_get_data(self._ctx, buf, n)
        return bytes(buf[:written])

    def state_set_data(self, blob: bytes) -> int:
        """``llama_state_set_data``: bytes read (0 on failure)."""
        buf = (ctypes.c_uint8 * len(blob)).from_buffer_copy(blob)
        return int(self._ll.llama_state_set_data(self._ctx, buf, len(blob)))

    def state_seq_get_data(self, seq_id: int) -> bytes:
        """``llama_state_seq_get_size`` + ``llama_state_seq_get_data``: one sequence's state."""
        self._check_seq(seq_id)
        n = self._ll.llama_state_seq_get_size(self._ctx, seq_id)
        buf = (ctypes.c_uint8 * n)()
        written = self._ll.llama_state_seq_get_data(self._ctx, buf, n, seq_id)
        return bytes(buf[:written])

    def state_seq_set_data(self, blob: bytes, dest_seq_id: int) -> int:
        """``llama_state_seq_set_data``: bytes read (0 on failure)."""
        self._check_seq(dest_seq_id)
        buf = (ctypes.c_uint8 * len(blob)).from_buffer_copy(blob)
        return int(self._ll.llama_state_seq_set_data(self._ctx, buf, len(blob), dest_seq_id))

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

    # -- lifetime ----------------------------------------------------------------------------

    def close(self) -> None:
        """Free the context and the model (idempotent)."""
        if getattr(self, "_ctx", None):
            self._ll.llama_free(self._ctx)
            self._ctx = None
        if getattr(self, "_model", None):
            self._ll.llama_model_free(self._model)
            self._model = None

    def __enter__(self) -> LlamaCppContext:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self):
        self.close()


# --8<-- [end:LlamaCppContext]
