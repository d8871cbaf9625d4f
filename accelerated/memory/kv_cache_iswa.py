"""Twin of [`reference.memory.kv_cache_iswa`][reference.memory.kv_cache_iswa]: the iSWA pair of
caches with MLX tensors.

[`KVCacheISWA`][] *is* the reference's pair (a subclass): the split, the preparation of both
caches, the seq operations, the sizes, ``can_shift`` and the state envelope are inherited.
What differs is the class of its two caches: [`accelerated.memory.kv_cache.KVCache`][]
(head-major MLX tensors, the KQ mask built on the device), each over its own layers.

What a graph reads (``accelerated/context.py``'s compiled forward handles one cache today):

- ``mem.kv_base`` / ``mem.kv_swa``: the two MLX caches; ``cache.layers`` the model layers
  of each, ascending; ``cache.k_l[i]`` / ``cache.v_l[i]`` the head-major tensors
  ``(n_stream, n_head_kv, kv_size, d)`` of layer ``cache.layers[i]``
  (``cache.layer_id(il)`` gives ``i``); ``cache.n_swa`` / ``cache.swa_type`` the window of
  each (none for the base cache); ``cache.get_size()`` differs between them when
  ``swa_full`` is off;
- ``mctx.get_placement()``: an
  [`ISWAPlacement`][reference.memory.kv_cache_iswa.ISWAPlacement] ``(base, swa)`` of two
  ``SlotInfo``;
- ``mctx.graph_input()``: a
  [`KVCacheISWAAttnInput`][reference.memory.kv_cache_iswa.KVCacheISWAAttnInput] whose
  ``.base`` / ``.swa`` are the MLX
  [`KVCacheAttnInput`][accelerated.memory.kv_cache.KVCacheAttnInput] of each cache (their own
  ``k_idxs``, ``n_kv``, ``kq_mask_inputs(n_cols)``); layer ``il`` goes to ``.swa`` when
  ``hparams.is_swa(il)``. A compiled graph takes the two caches' tensors and the two masks'
  inputs, and gives back both caches' written tensors.
"""

from __future__ import annotations

from accelerated.memory.kv_cache import KVCache
from reference.memory import kv_cache_iswa as ref
from reference.memory.kv_cache_iswa import (  # bookkeeping, imported as it is
    ISWA_STATE_MAGIC,
    ISWA_STATE_VERSION,
    ISWAPlacement,
    KVCacheISWAAttnInput,
    parse_iswa_state,
)

__all__ = [
    "ISWA_STATE_MAGIC",
    "ISWA_STATE_VERSION",
    "ISWAPlacement",
    "KVCacheISWA",
    "KVCacheISWAAttnInput",
    "parse_iswa_state",
]


# --8<-- [start:KVCacheISWA]
class KVCacheISWA(ref.KVCacheISWA):
    """Twin of
    [`reference.memory.kv_cache_iswa.KVCacheISWA`][reference.memory.kv_cache_iswa.KVCacheISWA]: the
    same pair, MLX caches.

    Examples:
        >>> import dataclasses
        >>> from reference.hparams import swa_pattern
        >>> from reference.testing import tiny_hparams
        >>> hp = dataclasses.replace(tiny_hparams(n_layer=4, n_swa=4),
        ...                          swa_layers=swa_pattern(4, 2))
        >>> mem = KVCacheISWA(hp, kv_size=512, n_ubatch=8, swa_full=False)
        >>> type(mem.kv_swa).__module__, mem.kv_swa.layers, mem.kv_swa.k_l[0].shape
        ('accelerated.memory.kv_cache', (0, 2), (1, 2, 256, 4))
    """

    cache_class = KVCache
# --8<-- [end:KVCacheISWA]
