"""The memory of a context: the KV cache as cells (``llama_kv_cells``, ``llama_kv_cache``),
or the recurrent memory (``llama_memory_recurrent``), behind one interface (``llama_memory_i``).

- [`reference.memory.interface`][reference.memory.interface]: the interface both implement, the
  memory context of a batch (``llama_memory_context_i``) and its status;
- [`reference.memory.kv_cells`][reference.memory.kv_cells]: the metadata of the cells (positions,
  sequence sets, pending shifts);
- [`reference.memory.kv_cache`][reference.memory.kv_cache]: the K/V tensors, streams, slot search,
  the memory API, the K-shift and the attention input of a ubatch;
- [`reference.memory.kq_mask`][reference.memory.kq_mask]: the KQ mask of a ubatch, the rule and
  its fast path;
- [`reference.memory.kv_cache_iswa`][reference.memory.kv_cache_iswa]: two KV caches, one for the
  full-attention layers and one for the sliding-window layers (``llama_kv_cache_iswa``);
- [`reference.memory.recurrent`][reference.memory.recurrent]: one cell of state rows per sequence
  (Mamba);
- [`reference.memory.state`][reference.memory.state]: save and restore;
- [`reference.memory.blob`][reference.memory.blob]: the bytes every memory saves its state in;
- [`create_memory`][]: which memory a model gets (``llama_model::create_memory``).
"""

import numpy as np
from numpy.typing import DTypeLike

from reference.hparams import MAMBA_ARCHS, SWA_TYPE_NONE, LlamaHParams, MambaHParams
from reference.memory.interface import Memory, MemoryContext, MemoryStatus
from reference.memory.kq_mask import set_input_kq_mask
from reference.memory.kv_cache import (
    KVCache,
    KVCacheAttnInput,
    KVCacheError,
    SlotInfo,
    build_rope_shift,
    k_shift_rope_params,
    kv_size_swa,
    n_ctx_seq,
)
from reference.memory.kv_cache_iswa import ISWAPlacement, KVCacheISWA, KVCacheISWAAttnInput
from reference.memory.kv_cells import KVCells, pos_div_shift, pos_div_shift_llamacpp
from reference.memory.recurrent import RecurrentMemory
from reference.memory.state import (
    LLAMA_STATE_SEQ_FLAGS_NONE,
    LLAMA_STATE_SEQ_FLAGS_PARTIAL_ONLY,
    LLAMA_STATE_SEQ_FLAGS_SWA_ONLY,
    StateError,
)

__all__ = [
    "LLAMA_STATE_SEQ_FLAGS_NONE",
    "LLAMA_STATE_SEQ_FLAGS_PARTIAL_ONLY",
    "LLAMA_STATE_SEQ_FLAGS_SWA_ONLY",
    "ISWAPlacement",
    "KVCache",
    "KVCacheAttnInput",
    "KVCacheError",
    "KVCacheISWA",
    "KVCacheISWAAttnInput",
    "KVCells",
    "Memory",
    "MemoryContext",
    "MemoryStatus",
    "RecurrentMemory",
    "SlotInfo",
    "StateError",
    "build_rope_shift",
    "create_memory",
    "k_shift_rope_params",
    "kv_size_swa",
    "n_ctx_seq",
    "pos_div_shift",
    "pos_div_shift_llamacpp",
    "set_input_kq_mask",
]


# --8<-- [start:create_memory]
def create_memory(hparams: LlamaHParams | MambaHParams, n_ctx_seq: int, n_seq_max: int = 1,
                  kv_unified: bool = True, swa_full: bool = True, n_ubatch: int = 512,
                  dtype: DTypeLike = np.float32) -> Memory:
    """The memory a model gets, chosen by its architecture (``llama_model::create_memory``).

    ``mamba`` / ``mamba2``: a [`RecurrentMemory`][] of ``max(1, n_seq_max)`` cells, one
    per sequence (``kv_unified``, ``swa_full`` and ``n_ctx_seq`` do not apply). A model with
    a sliding window (``swa_type`` set): a [`KVCacheISWA`][], a base cache of
    ``n_ctx_seq`` cells for its full-attention layers and a SWA cache for its SWA layers,
    even when every layer is SWA (the base cache then has no layers; llama.cpp builds the
    same pair for any ``swa_type``). Every other architecture: a [`KVCache`][] of
    ``n_ctx_seq`` cells per stream.

    Args:
        hparams: the model's hyperparameters.
        n_ctx_seq: cells per stream of a KV cache (llama_context's ``n_ctx_seq``).
        n_seq_max: the number of sequences.
        kv_unified: one KV stream for all sequences, or one per sequence.
        swa_full: with a sliding window, keep the full context.
        n_ubatch: the ubatch size (sizes a SWA cache).
        dtype: dtype of the K/V tensors or of the state rows.

    Examples:
        >>> from reference.testing import tiny_hparams, tiny_mamba_hparams
        >>> type(create_memory(tiny_hparams(), n_ctx_seq=256)).__name__
        'KVCache'
        >>> mem = create_memory(tiny_hparams(n_swa=4), n_ctx_seq=512, swa_full=False, n_ubatch=8)
        >>> type(mem).__name__, mem.kv_base.layers, mem.kv_swa.layers, mem.kv_swa.get_size()
        ('KVCacheISWA', (), (0, 1), 256)
        >>> mem = create_memory(tiny_mamba_hparams("mamba"), n_ctx_seq=256, n_seq_max=3)
        >>> type(mem).__name__, mem.get_size()
        ('RecurrentMemory', 3)
    """
    if hparams.arch in MAMBA_ARCHS:  # llama_memory_recurrent(mem_size = max(1, n_seq_max))
        return RecurrentMemory(hparams, mem_size=max(1, n_seq_max), n_seq_max=n_seq_max,
                               dtype=dtype)
    if hparams.swa_type != SWA_TYPE_NONE:
        return KVCacheISWA(hparams, kv_size=n_ctx_seq, n_seq_max=n_seq_max,
                           kv_unified=kv_unified, swa_full=swa_full, n_ubatch=n_ubatch,
                           dtype=dtype)
    return KVCache(hparams, kv_size=n_ctx_seq, n_seq_max=n_seq_max, kv_unified=kv_unified,
                   dtype=dtype)
# --8<-- [end:create_memory]
