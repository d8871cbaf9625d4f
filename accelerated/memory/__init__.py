"""Twin of [`reference.memory`][reference.memory]: the KV cache and the recurrent memory with MLX
tensors.

The bookkeeping (cells, seq sets, slot search, the memory API, the memory interface, the KQ
mask's rule, the state layout) is the reference's, imported; only the tensors and the array
work on them (the ubatch's writes and reads, the K-shift, stream copies, the recurrent rows)
are MLX.
"""

import numpy as np
from numpy.typing import DTypeLike

from accelerated.memory.kv_cache import (
    GraphAttnInput,
    KVCache,
    KVCacheAttnInput,
    build_rope_shift,
)
from accelerated.memory.kv_cache_iswa import KVCacheISWA
from accelerated.memory.recurrent import RecurrentMemory
from reference.hparams import MAMBA_ARCHS, SWA_TYPE_NONE
from reference.memory import Memory

__all__ = [
    "GraphAttnInput",
    "KVCache",
    "KVCacheAttnInput",
    "KVCacheISWA",
    "RecurrentMemory",
    "build_rope_shift",
    "create_memory",
]


# --8<-- [start:create_memory]
def create_memory(hparams, n_ctx_seq: int, n_seq_max: int = 1, kv_unified: bool = True,
                  swa_full: bool = True, n_ubatch: int = 512,
                  dtype: DTypeLike = np.float32) -> Memory:
    """Twin of [`reference.memory.create_memory`][reference.memory.create_memory]: the same choice,
    MLX memories.

    The recurrent rows are float16 for a float16 ``dtype``, float32 otherwise (MLX's CPU
    float64 support is partial); the KV cache keeps ``dtype`` for its bookkeeping and
    stores float64 as float32
    ([`accelerated.ops.convert.mx_dtype`][accelerated.ops.convert.mx_dtype]). A model
    with a sliding window gets the MLX
    [`KVCacheISWA`][accelerated.memory.kv_cache_iswa.KVCacheISWA] (the MLX Context's compiled
    graph reads one cache only: see that module for what a graph over two reads).

    Examples:
        >>> from reference.testing import tiny_mamba_hparams
        >>> mem = create_memory(tiny_mamba_hparams("mamba"), n_ctx_seq=256, dtype=np.float64)
        >>> type(mem).__module__, mem.dtype
        ('accelerated.memory.recurrent', dtype('float32'))
    """
    if hparams.arch in MAMBA_ARCHS:
        state_dtype = np.float16 if np.dtype(dtype) == np.float16 else np.float32
        return RecurrentMemory(hparams, mem_size=max(1, n_seq_max), n_seq_max=n_seq_max,
                               dtype=state_dtype)
    if hparams.swa_type != SWA_TYPE_NONE:  # the pair, even when every layer is SWA
        return KVCacheISWA(hparams, kv_size=n_ctx_seq, n_seq_max=n_seq_max,
                           kv_unified=kv_unified, swa_full=swa_full, n_ubatch=n_ubatch,
                           dtype=dtype)
    return KVCache(hparams, kv_size=n_ctx_seq, n_seq_max=n_seq_max, kv_unified=kv_unified,
                   dtype=dtype)
# --8<-- [end:create_memory]
