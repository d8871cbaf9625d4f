"""Twin of :mod:`reference.memory`: the KV cache and the recurrent memory with MLX tensors.

The bookkeeping (cells, seq sets, slot search, the memory API, the KQ mask's rule, the state
layout) is the reference's, imported; only the tensors and the array work on them (the
ubatch's writes and reads, the K-shift, stream copies, the recurrent rows) are MLX.
"""

from accelerated.memory.kv_cache import (
    GraphAttnInput,
    KVCache,
    KVCacheAttnInput,
    build_rope_shift,
)

__all__ = ["GraphAttnInput", "KVCache", "KVCacheAttnInput", "build_rope_shift"]
