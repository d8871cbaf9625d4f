"""One memory interface (reference/memory/interface.py): the KV cache and the recurrent memory
answer the same calls, with the same signatures, and the Context never asks which it holds.
"""

from __future__ import annotations

import inspect

import numpy as np
import pytest

from reference.batch import Batch, BatchAllocr
from reference.context import Context
from reference.memory import KVCache, KVCacheISWA, RecurrentMemory, create_memory
from reference.memory.interface import Memory, MemoryContextError, MemoryStatus
from reference.memory.recurrent import RecurrentMemoryError
from reference.testing import (
    random_mamba_weights,
    random_weights,
    tiny_hparams,
    tiny_mamba_hparams,
)

METHODS = [name for name in vars(Memory) if not name.startswith("_") and callable(
    getattr(Memory, name))]


def memory_classes():
    classes = [KVCache, KVCacheISWA, RecurrentMemory]
    try:
        from accelerated.memory import KVCache as MLXKVCache
        from accelerated.memory import KVCacheISWA as MLXKVCacheISWA
        from accelerated.memory import RecurrentMemory as MLXRecurrentMemory
    except ImportError:  # no MLX here
        return classes
    return classes + [MLXKVCache, MLXKVCacheISWA, MLXRecurrentMemory]


@pytest.mark.parametrize("cls", memory_classes(), ids=lambda c: f"{c.__module__}.{c.__name__}")
@pytest.mark.parametrize("name", METHODS)
def test_every_memory_has_the_interface_signatures(cls, name):
    want = list(inspect.signature(getattr(Memory, name)).parameters)
    got = list(inspect.signature(getattr(cls, name)).parameters)
    assert got == want, f"{cls.__name__}.{name}{got} is not Memory.{name}{want}"


def test_context_decode_never_asks_which_memory():
    for name in ("decode", "memory_update", "process_ubatch", "state_get_data",
                 "state_set_data", "state_seq_get_data", "state_seq_set_data",
                 "state_save_file", "state_load_file"):
        src = inspect.getsource(getattr(Context, name))
        body = src.split('"""')[-1]  # the code after the docstring
        for word in ("recurrent", "KVCache", "RecurrentMemory", "isinstance"):
            assert word not in body, f"Context.{name} mentions {word}"


def kv_batch(mem, tokens, seq_ids):
    batch = Batch(token=tokens, seq_id=[[s] for s in seq_ids])
    return BatchAllocr(batch, n_vocab=32, n_seq_max=mem.n_seq_max, memory=mem)


def test_a_failed_memory_context_cannot_apply():
    cache = create_memory(tiny_hparams(), n_ctx_seq=4)
    mctx = cache.init_batch(kv_batch(cache, [1] * 5, [0] * 5), n_ubatch=8)
    assert mctx.get_status() is MemoryStatus.FAILED_PREPARE
    assert mctx.error == "failed to find a memory slot for a batch of 5"
    with pytest.raises(MemoryContextError, match="failed memory context"):
        mctx.apply()
    assert cache.seq_pos_max(0) == -1


def test_init_update_statuses():
    cache = create_memory(tiny_hparams(), n_ctx_seq=8)
    assert cache.init_update().get_status() is MemoryStatus.NO_UPDATE
    mctx = cache.init_batch(kv_batch(cache, [1, 2, 3], [0, 0, 0]), n_ubatch=8)
    mctx.apply()
    cache.seq_add(0, 1, -1, 2)
    update = cache.init_update()
    assert update.get_status() is MemoryStatus.SUCCESS and update.apply() is True
    assert cache.init_update().get_status() is MemoryStatus.NO_UPDATE
    mem = create_memory(tiny_mamba_hparams("mamba"), n_ctx_seq=8, n_seq_max=2)
    mem.seq_add(0, 0, -1, 2)
    assert mem.init_update().get_status() is MemoryStatus.NO_UPDATE


def test_recurrent_remove_ubatch_puts_cells_and_rows_back():
    hp = tiny_mamba_hparams("mamba2")
    ctx = Context(hp, random_mamba_weights(hp), n_ctx=256, n_ubatch=4, n_seq_max=2)
    assert ctx.decode(Batch(token=[1, 2, 3], seq_id=[[0], [1], [0]])) == 0
    mem = ctx.memory
    before = [t.copy() for t in mem.r_l + mem.s_l], [c.pos for c in mem.cells]
    mctx = mem.init_batch(kv_batch(mem, [4, 5], [1, 0]), n_ubatch=4)
    mctx.apply()
    assert mem.seq_pos_max(1) == 1
    with pytest.raises(RecurrentMemoryError, match="last apply_ubatch"):
        mem.remove_ubatch(mctx.get_placement(), mctx.ubatches[0].__class__(
            **mctx.get_ubatch().__dict__))  # an equal ubatch, not the one applied
    mctx.remove_ubatch()
    assert [c.pos for c in mem.cells] == before[1]
    for a, b in zip(before[0], mem.r_l + mem.s_l, strict=True):
        assert a.tobytes() == b.tobytes()


def test_kv_remove_ubatch_forgets_the_ubatch_positions():
    hp = tiny_hparams()
    ctx = Context(hp, random_weights(hp), n_ctx=64, n_seq_max=2)
    assert ctx.decode(Batch(token=[1, 2], seq_id=[[0], [0]])) == 0
    mctx = ctx.memory.init_batch(kv_batch(ctx.memory, [3, 4], [0, 1]), n_ubatch=8)
    mctx.apply()
    assert (ctx.memory.seq_pos_max(0), ctx.memory.seq_pos_max(1)) == (2, 0)
    mctx.remove_ubatch()
    assert (ctx.memory.seq_pos_max(0), ctx.memory.seq_pos_max(1)) == (1, -1)
    assert np.isfinite(ctx.memory.k_l[0]).all()
