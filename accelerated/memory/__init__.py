"""Twin of :mod:`reference.memory`: the KV cache with its tensors as MLX arrays.

The bookkeeping (cells, seq sets, slot search, the memory API, the KQ mask's rule, the state
layout) is the reference's, imported; only the K/V tensors and the array work on them (the
ubatch's writes and reads, the K-shift, stream copies) are MLX.
"""

from accelerated.memory.kv_cache import KVCache, KVCacheAttnInput, build_rope_shift

__all__ = ["KVCache", "KVCacheAttnInput", "build_rope_shift"]
