"""The memory of a context: the KV cache as cells (``llama_kv_cells``, ``llama_kv_cache``).

- :mod:`reference.memory.kv_cells`: the metadata of the cells (positions, sequence sets,
  pending shifts);
- :mod:`reference.memory.kv_cache`: the K/V tensors, streams, slot search, the memory API,
  the K-shift, the KQ mask and the attention input of a ubatch.
"""

from reference.memory.kv_cache import (
    KVCache,
    KVCacheAttnInput,
    KVCacheError,
    SlotInfo,
    build_rope_shift,
    k_shift_rope_params,
    kv_size_swa,
    n_ctx_seq,
    set_input_kq_mask,
)
from reference.memory.kv_cells import KVCells, pos_div_shift, pos_div_shift_llamacpp

__all__ = [
    "KVCache",
    "KVCacheAttnInput",
    "KVCacheError",
    "KVCells",
    "SlotInfo",
    "build_rope_shift",
    "k_shift_rope_params",
    "kv_size_swa",
    "n_ctx_seq",
    "pos_div_shift",
    "pos_div_shift_llamacpp",
    "set_input_kq_mask",
]
