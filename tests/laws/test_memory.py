"""The memory's laws over every model: one interface, the sequence operations, undo.

``llama_memory_i`` (reference/memory/interface.py): the KV cache, the iSWA pair and the
recurrent memory answer the same calls with the same signatures, in both twins, and the
Context never asks which it holds. Each law of this file is written once and runs on every
flavour of ``tests/support/helpers.py`` and every model that has what it needs (the
capabilities the models declare are checked here against their memories):

- the Context builds the model's memory, with the sizes a KV cache would get;
- ``seq_rm`` of part of a sequence: then re-decoding == a fresh decode, or (a recurrent
  state, which cannot forget its last tokens) False and nothing changed;
- a memory operation with an id or a divisor out of range raises a typed error before
  anything changes;
- ``remove_ubatch`` (an abort) puts the memory back as it was; ``init_update`` has work
  only when a K-shift is pending.

The laws of each memory's own rules are beside it: ``test_kv_cells.py``, ``test_kv_cache.py``,
``test_kv_cache_iswa.py``, ``test_recurrent.py``; the decode laws in ``test_decode.py``.
"""

from __future__ import annotations

import inspect

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from reference.batch import Batch, BatchAllocr
from reference.common import LLAMA_MAX_SEQ
from reference.context import Context, context_sizes, is_recurrent
from reference.memory import (
    KVCache,
    KVCacheError,
    KVCacheISWA,
    RecurrentMemory,
    create_memory,
)
from reference.memory.interface import Memory, MemoryContextError, MemoryStatus
from reference.memory.recurrent import RecurrentMemoryError
from reference.testing import tiny_hparams, tiny_mamba_hparams
from tests.support.helpers import (
    CELLS,
    K_SHIFT,
    N_VOCAB,
    PARTIAL_SEQ_RM,
    RECURRENT,
    STREAMS,
    SWA,
    assert_same,
    decode_seq,
    every_flavour,
    for_models,
    kv_caches,
    snapshot,
)

every_model = for_models()
tokens_st = st.lists(st.integers(0, N_VOCAB - 1), min_size=1, max_size=6)

METHODS = [name for name in vars(Memory) if not name.startswith("_") and callable(
    getattr(Memory, name))]


# ---- one interface --------------------------------------------------------------------------


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


@every_model
@every_flavour
def test_the_context_builds_the_models_memory(model, flavour):
    """The memory of the model's class, from the flavour's package; its sizes are cparams,
    whatever the memory."""
    ctx = model.make(flavour, n_seq_max=4, n_ctx=256, n_batch=64, n_ubatch=64)
    assert type(ctx.memory).__name__ == model.memory
    assert type(ctx.memory).__module__.startswith(f"{flavour.package}.memory.")
    assert ctx.memory_update() is False  # nothing pending
    hp = ctx.hparams
    assert (ctx.n_ctx, ctx.n_batch, ctx.n_ubatch, ctx.n_seq_max) == tuple(
        context_sizes(256, 64, 64, 4, True, hp.n_ctx_train)[k]
        for k in ("n_ctx", "n_batch", "n_ubatch", "n_seq_max"))


@every_model
@every_flavour
def test_the_declared_capabilities_are_the_memorys(model, flavour):
    """What a law may ask of a model (``tests/support/helpers.py``) is what its memory does."""
    ctx = model.make(flavour, n_seq_max=2)
    hp = ctx.hparams
    assert model.has(RECURRENT) == is_recurrent(hp)
    assert model.has(CELLS) == bool(kv_caches(ctx.memory))
    assert model.has(SWA) == any(bool(c.n_swa) for c in kv_caches(ctx.memory))
    if model.has(K_SHIFT):
        assert ctx.memory.can_shift()
    decode_seq(ctx, [1, 2, 3])
    assert ctx.memory.seq_rm(0, 1, -1) is model.has(PARTIAL_SEQ_RM)
    streams = model.make(flavour, n_seq_max=2, kv_unified=False)
    if model.has(STREAMS):
        assert all(c.get_n_stream() == 2 for c in kv_caches(streams.memory))


def test_create_memory_defaults():
    """What ``create_memory`` builds when told only the context size: one sequence in one
    unified stream (any id up to ``LLAMA_MAX_SEQ``), the full context in the SWA cache,
    float32 tensors, and a SWA cache sized for ubatches of 512 when not full; a dtype given
    reaches the tensors of every memory."""
    kv = create_memory(tiny_hparams(), n_ctx_seq=64)
    iswa = create_memory(tiny_hparams(n_swa=4), n_ctx_seq=64)
    for cache in (kv, iswa.kv_base, iswa.kv_swa):
        assert (cache.get_size(), cache.get_n_stream(), cache.n_seq_max) == (64, 1, 1)
        assert cache.seq_pos_max(LLAMA_MAX_SEQ - 1) == -1  # unified: every id is in range
        assert all(t.dtype == np.float32 for t in cache.k_l + cache.v_l)
    full = create_memory(tiny_hparams(n_swa=4), n_ctx_seq=1024)  # not PAD(4 + 512, 256) = 768
    assert full.kv_swa.get_size() == 1024
    # a window of 256 for one sequence: PAD(256 + 512, 256) = 768 cells (513 would need 1024)
    swa = create_memory(tiny_hparams(n_swa=256), n_ctx_seq=2048, swa_full=False)
    assert (swa.kv_base.get_size(), swa.kv_swa.get_size()) == (2048, 768)
    rec = create_memory(tiny_mamba_hparams("mamba"), n_ctx_seq=64)
    assert (rec.get_size(), rec.n_seq_max) == (1, 1)
    assert all(t.dtype == np.float32 for t in rec.r_l + rec.s_l)
    kv, iswa, rec = (create_memory(hp, n_ctx_seq=64, dtype=np.float64) for hp in (
        tiny_hparams(), tiny_hparams(n_swa=4), tiny_mamba_hparams("mamba")))
    tensors = kv.k_l + kv.v_l + iswa.kv_base.k_l + iswa.kv_swa.v_l + rec.r_l + rec.s_l
    assert all(t.dtype == np.float64 for t in tensors)  # a dtype given reaches every memory


@for_models(RECURRENT)
@every_flavour
def test_a_recurrent_memory_has_a_cell_per_sequence(model, flavour):
    ctx = model.make(flavour, n_seq_max=4)
    assert ctx.memory.get_size() == 4 and ctx.memory.n_seq_max == 4
    assert model.make(flavour, n_seq_max=0).memory.get_size() == 1


# ---- seq_rm ---------------------------------------------------------------------------------


@for_models(PARTIAL_SEQ_RM)
@every_flavour
@given(data=st.data(), k=st.integers(0, 14), cont=tokens_st, kv_unified=st.booleans())
def test_partial_seq_rm_then_redecode_equals_fresh(model, flavour, data, k, cont, kv_unified):
    variant = model.draw(data)
    prompt = data.draw(model.prompt_st(1, 12), label="prompt")
    k = min(k, len(prompt))
    ctx = model.make(flavour, variant, kv_unified=kv_unified, n_ubatch=3)
    assert ctx.decode(Batch(token=prompt)) == 0
    assert ctx.memory.seq_rm(0, k, -1) is True
    assert ctx.memory.seq_pos_max(0) == k - 1
    n = len(cont)
    assert ctx.decode(Batch(token=cont, logits=[True] * n)) == 0
    flavour.assert_close(model.alone(flavour, prompt[:k] + cont, variant)[k:], ctx.get_logits())


@for_models(lacking=(PARTIAL_SEQ_RM,))
@every_flavour
@given(tokens=st.lists(st.integers(0, N_VOCAB - 1), min_size=2, max_size=10), data=st.data())
def test_partial_seq_rm_is_refused_without_side_effects(model, flavour, tokens, data):
    """A state cannot forget its last tokens: False, cells and rows bit-identical; the whole
    sequence can go, and it starts again from a zero state."""
    ctx = model.make(flavour)
    decode_seq(ctx, tokens)
    last = len(tokens) - 1
    p0 = data.draw(st.integers(1, last))
    p1 = data.draw(st.sampled_from([-1, last + 1, last + 5]))
    before = snapshot(ctx)
    assert ctx.memory.seq_rm(0, p0, p1) is False
    assert_same(before, snapshot(ctx))
    more = decode_seq(ctx, [1, 2])
    flavour.assert_close(model.alone(flavour, list(tokens) + [1, 2])[-2:], more)
    assert ctx.memory.seq_rm(0, -1, -1) is True  # the whole sequence: a zero state again
    flavour.assert_close(model.alone(flavour, [3, 4]), decode_seq(ctx, [3, 4]))


# ---- bad arguments ------------------------------------------------------------------------------

#: memory calls with an id (``n``: the first out of range) or a divisor out of range
BAD_CALLS = {
    "seq_rm(-2)": lambda m, n: m.seq_rm(-2, -1, -1),
    "seq_rm(n)": lambda m, n: m.seq_rm(n, 0, 1),
    "seq_cp(0, n)": lambda m, n: m.seq_cp(0, n, -1, -1),
    "seq_cp(-1, 0)": lambda m, n: m.seq_cp(-1, 0, -1, -1),
    "seq_keep(-1)": lambda m, n: m.seq_keep(-1),
    "seq_keep(n)": lambda m, n: m.seq_keep(n),
    "seq_add(n)": lambda m, n: m.seq_add(n, 0, -1, 1),
    "seq_div(d=0)": lambda m, n: m.seq_div(0, 0, -1, 0),
    "seq_div(d=-2)": lambda m, n: m.seq_div(0, 0, 5, -2),
    "seq_div(-1)": lambda m, n: m.seq_div(-1, 0, -1, 2),
    "seq_pos_min(-1)": lambda m, n: m.seq_pos_min(-1),
    "seq_pos_min(n)": lambda m, n: m.seq_pos_min(n),
    "seq_pos_max(-1)": lambda m, n: m.seq_pos_max(-1),
    "seq_pos_max(n)": lambda m, n: m.seq_pos_max(n),
}


@every_model
@every_flavour
@pytest.mark.parametrize("call", list(BAD_CALLS))
def test_bad_arguments_raise_before_any_change(model, flavour, call):
    """The memory's typed error before anything changes. Ids run to
    ``LLAMA_MAX_SEQ`` in one unified KV stream, to ``n_seq_max`` in a recurrent memory (and
    per-stream caches: ``test_kv_cache.py::test_seq_ids_in_range_per_mode``)."""
    ctx = model.make(flavour, n_seq_max=3)
    decode_seq(ctx, [1, 2, 3, 4])
    ctx.memory.seq_cp(0, 1, -1, -1)
    n = LLAMA_MAX_SEQ if model.has(CELLS) else 3
    before = snapshot(ctx)
    error = RecurrentMemoryError if model.has(RECURRENT) else KVCacheError
    with pytest.raises(error):
        BAD_CALLS[call](ctx.memory, n)
    assert_same(before, snapshot(ctx))


# ---- undo and update -----------------------------------------------------------------------


def balloc_of(mem, tokens, seq_ids) -> BatchAllocr:
    batch = Batch(token=tokens, seq_id=[[s] for s in seq_ids])
    return BatchAllocr(batch, n_vocab=N_VOCAB, n_seq_max=mem.n_seq_max, memory=mem)


@every_model
@every_flavour
def test_remove_ubatch_puts_the_memory_back(model, flavour):
    """An applied ubatch that was not computed (an abort) is removed: the cells (and a
    recurrent memory's state rows, copied on write) are those before it."""
    ctx = model.make(flavour, n_seq_max=2, n_ubatch=4)
    assert ctx.decode(Batch(token=[1, 2, 3], seq_id=[[0], [1], [0]])) == 0
    mem = ctx.memory
    before = snapshot(ctx)
    mctx = mem.init_batch(balloc_of(mem, [4, 5], [1, 0]), n_ubatch=4)
    assert mctx.apply() is True
    assert mem.seq_pos_max(1) == 1  # the first ubatch holds the token of sequence 1
    mctx.remove_ubatch()
    assert_same(before, snapshot(ctx))
    for cache in kv_caches(mem):
        assert all(np.isfinite(np.array(k)).all() for k in cache.k_l)


@for_models(RECURRENT)
@every_flavour
def test_recurrent_remove_ubatch_undoes_the_last_apply_only(model, flavour):
    ctx = model.make(flavour, n_seq_max=2, n_ubatch=4)
    assert ctx.decode(Batch(token=[1, 2, 3], seq_id=[[0], [1], [0]])) == 0
    mem = ctx.memory
    before = snapshot(ctx)
    mctx = mem.init_batch(balloc_of(mem, [4, 5], [1, 0]), n_ubatch=4)
    mctx.apply()
    with pytest.raises(RecurrentMemoryError, match="last apply_ubatch"):
        mem.remove_ubatch(mctx.get_placement(), mctx.ubatches[0].__class__(
            **mctx.get_ubatch().__dict__))  # an equal ubatch, not the one applied
    mctx.remove_ubatch()
    assert_same(before, snapshot(ctx))


@every_model
@every_flavour
def test_init_update_statuses(model, flavour):
    """``NO_UPDATE`` with nothing pending; after ``seq_add``, an update that turns the keys
    where there are keys to turn (a recurrent state has none), then nothing again."""
    ctx = model.make(flavour)
    mem = ctx.memory
    assert mem.init_update().get_status() is MemoryStatus.NO_UPDATE
    decode_seq(ctx, [1, 2, 3])
    mem.seq_add(0, 1, -1, 2)
    update = mem.init_update()
    if model.has(K_SHIFT):
        assert update.get_status() is MemoryStatus.SUCCESS and update.apply() is True
    else:
        assert update.get_status() is MemoryStatus.NO_UPDATE
    assert mem.init_update().get_status() is MemoryStatus.NO_UPDATE


@pytest.mark.parametrize("memory", ["kv", "iswa"])
def test_a_batch_that_cannot_be_split_is_refused(memory):
    """Coupled sequences on one stream per sequence have no split: ``FAILED_PREPARE`` with
    the split's own reason, the memory untouched."""
    hp = tiny_hparams(n_swa=4 if memory == "iswa" else 0)
    mem = create_memory(hp, n_ctx_seq=16, n_seq_max=2, kv_unified=False)
    batch = Batch(token=[1, 2], seq_id=[[0, 1], [0, 1]])
    balloc = BatchAllocr(batch, n_vocab=N_VOCAB, n_seq_max=2, memory=mem)
    mctx = mem.init_batch(balloc, n_ubatch=4)
    assert mctx.get_status() is MemoryStatus.FAILED_PREPARE and mctx.memory is mem
    assert mctx.error == balloc.split_error and "coupled sequences" in mctx.error
    assert (mem.seq_pos_max(0), mem.seq_pos_max(1)) == (-1, -1)


def test_a_failed_memory_context_cannot_apply():
    cache = create_memory(tiny_hparams(), n_ctx_seq=4)
    mctx = cache.init_batch(balloc_of(cache, [1] * 5, [0] * 5), n_ubatch=8)
    assert mctx.get_status() is MemoryStatus.FAILED_PREPARE and mctx.memory is cache
    assert mctx.error == "failed to find a memory slot for a batch of 5"
    with pytest.raises(MemoryContextError, match="failed memory context"):
        mctx.apply()
    assert cache.seq_pos_max(0) == -1
