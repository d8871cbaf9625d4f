"""Twin of :mod:`reference.context`: ``llama_context`` with the MLX KV cache and forward.

:class:`Context` *is* the reference's context (a subclass): batch validation, splitting,
slot search, return codes, output ordering and the state layout are inherited. What
differs:

- the memory is :class:`accelerated.memory.KVCache` (MLX K/V tensors, the same cells);
- each ubatch runs :func:`accelerated.models.llama.llama_forward` on weights prepared once
  (:func:`accelerated.models.llama.prepare_weights`: Q4_0/Q4_1/Q8_0 stay quantized); its
  logits are evaluated and brought back as NumPy rows, so :meth:`Context.get_logits` returns
  NumPy as the reference does;
- the state functions of :mod:`reference.memory.state` read and write ``memory.k_l`` /
  ``v_l`` as NumPy arrays, so each state method runs them on NumPy copies of the tensors and
  puts the (possibly restored) tensors back as MLX arrays: blobs are interchangeable between
  the two contexts.

Only ``llama`` / ``qwen2`` run here; Mamba (recurrent memory) stays on the reference path:
constructing this Context for a Mamba model raises :class:`reference.context.ContextError`.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import contextmanager

import mlx.core as mx
import numpy as np
from numpy.typing import DTypeLike

from accelerated.memory import KVCache
from accelerated.memory.kv_cache import mx_dtype
from accelerated.models.llama import llama_forward, prepare_weights
from reference import context as ref
from reference.batch import Ubatch
from reference.context import ContextError, context_shift, context_sizes, is_recurrent
from reference.hparams import LlamaHParams

__all__ = ["Context", "ContextError", "context_shift", "context_sizes", "is_recurrent"]


# --8<-- [start:Context]
class Context(ref.Context):
    """Twin of :class:`reference.context.Context` on MLX (llama / qwen2 only).

    Same constructor arguments. ``dtype`` sets the reference bookkeeping's dtype (state
    blobs, logits); the MLX tensors and the forward compute in float32.

    Raises:
        ContextError: a recurrent (Mamba) model, or a bad size.

    Examples:
        >>> from tests.tiny_models import tiny_hparams, random_weights
        >>> from reference.batch import Batch
        >>> hp = tiny_hparams()
        >>> ctx = Context(hp, random_weights(hp), n_ctx=64, n_seq_max=2)
        >>> ctx.decode(Batch(token=[1, 2, 3], logits=[True, False, True]))
        0
        >>> type(ctx.get_logits()).__name__, ctx.get_logits().shape, ctx.memory.seq_pos_max(0)
        ('ndarray', (2, 32), 2)
    """

    def __init__(
        self,
        hparams: LlamaHParams,
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
        if is_recurrent(hparams):
            raise ContextError(
                f"the accelerated Context runs llama/qwen2 only; {hparams.arch!r} is recurrent: "
                "use reference.context.Context for Mamba"
            )
        super().__init__(hparams, weights, n_ctx=n_ctx, n_batch=n_batch, n_ubatch=n_ubatch,
                         n_seq_max=n_seq_max, kv_unified=kv_unified, swa_full=swa_full,
                         dtype=dtype, abort_callback=abort_callback)
        # the reference built a NumPy KVCache; the twin takes its place, empty as it is
        self._memory = KVCache(hparams, kv_size=self._n_ctx_seq, n_seq_max=self._n_seq_max,
                               kv_unified=kv_unified, swa_full=swa_full,
                               n_ubatch=self._n_ubatch, dtype=self.dtype)
        self.mlx_weights = prepare_weights(self.weights)

    # --8<-- [start:process_ubatch]
    def process_ubatch(self, ubatch: Ubatch, sinfo) -> np.ndarray:
        """Twin of :meth:`reference.context.Context.process_ubatch`: the MLX forward.

        Returns:
            The ubatch's logits rows ``(n_outputs_ubatch, n_vocab)`` as NumPy (evaluated).
        """
        out_ids = np.flatnonzero(ubatch.output)  # (n_outputs_ubatch,)
        inp_attn = self._memory.attn_input(ubatch, sinfo)
        logits = llama_forward(self.mlx_weights, self.hparams, ubatch.token, ubatch.pos,
                               inp_attn, out_ids, embd=ubatch.embd)  # (n_outputs, n_vocab)
        mx.eval(logits, *self._memory.k_l, *self._memory.v_l)
        return np.array(logits).astype(self._logits.dtype, copy=False)
    # --8<-- [end:process_ubatch]

    # --8<-- [start:state]
    @contextmanager
    def _numpy_memory(self):
        """The cache tensors as NumPy (``memory.dtype``) inside, MLX again after."""
        mem = self._memory
        dt = mx_dtype(mem.dtype)
        mem.k_l = [np.array(t).astype(mem.dtype) for t in mem.k_l]
        mem.v_l = [np.array(t).astype(mem.dtype) for t in mem.v_l]
        try:
            yield
        finally:
            mem.k_l = [mx.array(t).astype(dt) for t in mem.k_l]
            mem.v_l = [mx.array(t).astype(dt) for t in mem.v_l]

    def state_get_data(self) -> bytes:
        """:meth:`reference.context.Context.state_get_data` on NumPy copies of the tensors."""
        with self._numpy_memory():
            return super().state_get_data()

    def state_set_data(self, data: bytes) -> int:
        """:meth:`reference.context.Context.state_set_data`, restoring into MLX tensors."""
        with self._numpy_memory():
            return super().state_set_data(data)

    def state_seq_get_data(self, seq_id: int) -> bytes:
        """:meth:`reference.context.Context.state_seq_get_data` on NumPy copies."""
        with self._numpy_memory():
            return super().state_seq_get_data(seq_id)

    def state_seq_set_data(self, data: bytes, dest_seq_id: int) -> int:
        """:meth:`reference.context.Context.state_seq_set_data`, restoring into MLX tensors."""
        with self._numpy_memory():
            return super().state_seq_set_data(data, dest_seq_id)

    def state_save_file(self, path, tokens) -> int:
        """:meth:`reference.context.Context.state_save_file` on NumPy copies."""
        with self._numpy_memory():
            return super().state_save_file(path, tokens)

    def state_load_file(self, path) -> np.ndarray:
        """:meth:`reference.context.Context.state_load_file`, restoring into MLX tensors."""
        with self._numpy_memory():
            return super().state_load_file(path)

    def state_seq_save_file(self, path, seq_id: int, tokens) -> int:
        """:meth:`reference.context.Context.state_seq_save_file` on NumPy copies."""
        with self._numpy_memory():
            return super().state_seq_save_file(path, seq_id, tokens)

    def state_seq_load_file(self, path, dest_seq_id: int) -> np.ndarray:
        """:meth:`reference.context.Context.state_seq_load_file`, restoring into MLX tensors."""
        with self._numpy_memory():
            return super().state_seq_load_file(path, dest_seq_id)
    # --8<-- [end:state]
# --8<-- [end:Context]
