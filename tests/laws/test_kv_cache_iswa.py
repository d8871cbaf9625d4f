"""The iSWA memory (reference/memory/kv_cache_iswa.py): two caches, one memory.

What is checked, on tiny ``llama``-arch models with a per-layer SWA pattern (1:1 as Gemma 2,
5:1 as Gemma 3, and every layer SWA as our Mistral-style models), windows of 4 to 8 and
prompts longer than the window (the ``iswa`` model of ``tests/support/helpers.py``):

- sizes: the SWA cache's ``PAD(min(kv_size, n_swa * n_seqs + n_ubatch), 256)``, ``swa_full``,
  each cache's layers, ``create_memory``'s choice;
- the forward through the pair equals the cache-free forward with one mask per layer kind
  (``reference_logits``), and differs from the all-layers-windowed one;
- SWA cells are reused once masked while the base cache keeps every position;
  ``seq_pos_min/max`` come from the SWA cache; seq ops reach both caches (each cache's cells
  equal those of one plain cache under the same ops);
- a decode with no slot in either cache (rc 1) changes nothing, whichever cache is full;
- the K-shift turns each layer with its own RoPE base (and the model's ``rope_freqs``);
  ``can_shift`` only with equal sizes; ``clear`` empties both caches;
- the defaults of the pair, the split ``init_batch`` chooses, and the state envelope
  (``parse_iswa_state``): its parts, and each field refused with its reason.

The laws every model obeys (batched == unbatched, token by token == prefill, ``seq_cp``
branches, the K-shift == a fresh cache, failures change nothing, abort) run on this model
too, in ``tests/laws/test_decode.py`` and ``tests/laws/test_memory.py``; its state laws in
``tests/laws/test_state.py``; the twin against the reference in ``tests/twin/test_iswa.py``.
"""

from __future__ import annotations

import dataclasses
import re

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from reference.batch import Batch, BatchAllocr
from reference.common import LLAMA_MAX_SEQ
from reference.context import ContextError, context_shift
from reference.hparams import SWA_TYPE_NONE, rope_cparams
from reference.memory import (
    KVCache,
    KVCacheError,
    KVCacheISWA,
    KVCacheISWAAttnInput,
    MemoryStatus,
    StateError,
    create_memory,
    kv_size_swa,
)
from reference.memory.blob import BlobWriter, seal
from reference.memory.kv_cache_iswa import ISWA_STATE_MAGIC, ISWA_STATE_VERSION, parse_iswa_state
from reference.ops import rope_ext
from reference.testing import reference_logits, tiny_hparams
from tests.support.helpers import (  # noqa: F401  (PATTERNS: tests/twin/test_iswa.py's too)
    ISWA,
    N_VOCAB,
    PATTERNS,
    REF_F32,
    REF_F64,
    every_flavour,
    iswa_model,
)

#: the flavours of the laws that compare with the NumPy cache-free forward (the twin against it:
#: ``tests/twin/test_iswa.py``)
ISWA_FLAVOURS = (REF_F64, REF_F32)
every_iswa_flavour = pytest.mark.parametrize("flavour", ISWA_FLAVOURS, ids=str)

#: the patterns of the laws (``"one"``, a single SWA layer, is the K-shift laws')
LAW_PATTERNS = ("1:1", "5:1", "all")
patterns_st = st.sampled_from(LAW_PATTERNS)
n_swa_st = st.integers(4, 8)
tokens_st = st.lists(st.integers(0, N_VOCAB - 1), min_size=9, max_size=14)


def make_iswa(flavour, pattern: str = "1:1", n_swa: int = 4, **kwargs):
    """A Context of the iSWA model (``n_ctx = n_batch = n_ubatch = 256`` unless told)."""
    return ISWA.make(flavour, (pattern, n_swa), **kwargs)


def decode(ctx, tokens, seq: int = 0) -> np.ndarray:
    """Decode ``tokens`` for sequence ``seq`` in one batch; every token's logits."""
    n = len(tokens)
    assert ctx.decode(Batch(token=list(tokens), seq_id=[[seq]] * n,
                            logits=[True] * n)) == 0, ctx.last_error
    return ctx.get_logits().copy()  # (n, n_vocab)


def cell_table(cache: KVCache, stream: int = 0) -> list[tuple[int, tuple[int, ...]]]:
    """The (pos, seq ids) of every non-empty cell of a stream, sorted."""
    c = cache.v_cells[stream]
    return sorted((int(c.pos[i]), tuple(sorted(c.seq_get_all(i)))) for i in range(c.size())
                  if c.pos[i] != -1)


# ---- sizes and the choice of memory ------------------------------------------------------------


@pytest.mark.parametrize(("kv_size", "n_swa", "n_seq_max", "n_ubatch", "unified", "want"), [
    (4096, 128, 2, 512, True, 768),  # PAD(2 * 128 + 512, 256)
    (4096, 128, 2, 512, False, 768),  # one sequence per stream: PAD(128 + 512, 256)
    (4096, 4, 1, 8, True, 256),  # a small window still takes 256 cells
    (4096, 1024, 4, 512, True, 4096),  # capped at the base size
    (1024, 300, 1, 300, True, 768),  # PAD(600, 256)
])
def test_swa_cache_size(kv_size, n_swa, n_seq_max, n_ubatch, unified, want):
    hp, _ = iswa_model("1:1", 4)
    hp = dataclasses.replace(hp, n_swa=n_swa)
    mem = KVCacheISWA(hp, kv_size, n_seq_max=n_seq_max, kv_unified=unified,
                      swa_full=False, n_ubatch=n_ubatch)
    assert kv_size_swa(kv_size, n_swa, n_seq_max, n_ubatch, unified) == want
    assert (mem.kv_base.get_size(), mem.kv_swa.get_size()) == (kv_size, want)
    full = KVCacheISWA(hp, kv_size, n_seq_max=n_seq_max, kv_unified=unified, swa_full=True,
                       n_ubatch=n_ubatch)
    assert full.kv_swa.get_size() == kv_size


@pytest.mark.parametrize("pattern", LAW_PATTERNS)
def test_each_cache_holds_its_layers(pattern):
    hp, _ = iswa_model(pattern, 4)
    mem = create_memory(hp, n_ctx_seq=512, n_ubatch=8, swa_full=False)
    assert isinstance(mem, KVCacheISWA)
    assert mem.kv_swa.layers == tuple(il for il in range(hp.n_layer) if hp.is_swa(il))
    assert mem.kv_base.layers == tuple(il for il in range(hp.n_layer) if not hp.is_swa(il))
    assert len(mem.kv_base.k_l) == len(mem.kv_base.layers)
    assert (mem.kv_base.n_swa, mem.kv_base.swa_type) == (0, SWA_TYPE_NONE)
    assert (mem.kv_swa.n_swa, mem.kv_swa.swa_type) == (hp.n_swa, hp.swa_type)
    assert not mem.can_shift()  # 512 base cells, 256 SWA cells
    assert create_memory(hp, n_ctx_seq=512, swa_full=True).can_shift()


def test_the_pair_defaults():
    """Told only the model and the size, the pair is llama_context's default: one sequence
    in one unified stream (any id up to ``LLAMA_MAX_SEQ``), a SWA cache as large as the base
    (``swa_full``), any size (``n_pad`` 1), float32 tensors; and, when not full, a SWA cache
    sized for ubatches of 512."""
    hp, _ = iswa_model("1:1", 4)
    mem = KVCacheISWA(hp, kv_size=15)
    assert (mem.n_seq_max, mem.dtype) == (1, np.float32)
    for cache in mem.caches():
        assert (cache.get_size(), cache.get_n_stream(), cache.n_seq_max) == (15, 1, 1)
        assert cache.seq_pos_max(LLAMA_MAX_SEQ - 1) == -1  # unified: every id is in range
        assert all(t.dtype == np.float32 for t in cache.k_l + cache.v_l)
    assert mem.can_shift()
    with pytest.raises(KVCacheError, match="kv_size=15 must be a positive multiple of n_pad=2"):
        KVCacheISWA(hp, kv_size=15, n_pad=2)  # n_pad reaches the caches
    assert KVCacheISWA(hp, kv_size=1024).kv_swa.get_size() == 1024  # not PAD(4 + 512, 256)
    wide = KVCacheISWA(dataclasses.replace(hp, n_swa=256), kv_size=2048, swa_full=False)
    assert wide.kv_swa.get_size() == 768  # PAD(256 + 512, 256); 513 would need 1024


def test_a_model_without_window_gets_one_cache():
    assert type(create_memory(tiny_hparams(), n_ctx_seq=256)) is KVCache
    with pytest.raises(KVCacheError) as err:
        KVCacheISWA(tiny_hparams(), kv_size=256)
    assert str(err.value) == "an iSWA cache needs a model with a sliding window (swa_type)"


def test_the_mlx_twin_builds_the_pair_of_mlx_caches():
    from accelerated.memory import KVCache as MLXKVCache
    from accelerated.memory import KVCacheISWA as MLXKVCacheISWA
    from accelerated.memory import create_memory as mlx_create_memory

    hp, _ = iswa_model("5:1", 4)
    mem = mlx_create_memory(hp, n_ctx_seq=512, n_ubatch=8, swa_full=False)
    assert isinstance(mem, MLXKVCacheISWA)
    assert type(mem.kv_base) is MLXKVCache and type(mem.kv_swa) is MLXKVCache
    assert (len(mem.kv_base.k_l), len(mem.kv_swa.k_l), mem.kv_swa.get_size()) == (1, 5, 256)


# ---- the forward through the pair --------------------------------------------------------------


@given(pattern=patterns_st, n_swa=n_swa_st, tokens=tokens_st)
def test_pair_equals_the_cache_free_forward(pattern, n_swa, tokens):
    """One mask per layer kind: the Context through the two caches gives the logits of the
    cache-free forward (``SimpleKVCache``, a windowed mask for SWA layers only)."""
    hp, w = iswa_model(pattern, n_swa)
    got = decode(make_iswa(REF_F64, pattern, n_swa, n_ubatch=3), tokens)
    REF_F64.assert_close(reference_logits(w, hp, tokens), got)


@pytest.mark.parametrize("pattern", ["1:1", "5:1"])
def test_the_dispatch_matters(pattern):
    """Windowing every layer, or none, is another model: the law above could fail."""
    hp, w = iswa_model(pattern, 4)
    tokens = np.random.default_rng(2).integers(0, N_VOCAB, 12).tolist()
    got = decode(make_iswa(REF_F64, pattern, 4), tokens)
    for other in (dataclasses.replace(hp, swa_layers=()),
                  dataclasses.replace(hp, n_swa=0, swa_type=SWA_TYPE_NONE, swa_layers=())):
        assert np.abs(reference_logits(w, other, tokens) - got)[4:].max() > 1e-3


def test_graph_input_sends_each_layer_to_its_cache():
    hp, _ = iswa_model("5:1", 4)
    mem = KVCacheISWA(hp, kv_size=16)
    mctx = mem.init_batch(_balloc(mem, list(range(1, 9))), n_ubatch=8)
    mctx.apply()
    inp = mctx.graph_input()
    assert isinstance(inp, KVCacheISWAAttnInput)
    for il in range(hp.n_layer):
        assert inp.layer_input(il) is (inp.swa if hp.is_swa(il) else inp.base)
    last = [(inp.get_kq_mask(il)[-1] == 0).sum() for il in range(hp.n_layer)]
    assert last == [4, 4, 4, 4, 4, 8]  # token at pos 7: window 4, or all 8 positions


@pytest.mark.parametrize(("unified", "want"), [(True, [[1, 0, 1, 0]]),
                                               (False, [[1, 1], [0, 0]])])
def test_init_batch_splits_as_llama_cpp(unified, want):
    """One stream: ``split_simple``, the batch in order; one stream per sequence:
    ``split_equal(sequential=True)``, each ubatch consecutive sequences (1 then 0: two)."""
    hp, _ = iswa_model("1:1", 4)
    mem = KVCacheISWA(hp, kv_size=16, n_seq_max=2, kv_unified=unified)
    batch = Batch(token=[1, 2, 3, 4], seq_id=[[1], [0], [1], [0]])
    mctx = mem.init_batch(BatchAllocr(batch, n_vocab=N_VOCAB, n_seq_max=2, memory=mem),
                          n_ubatch=4)
    assert mctx.get_status() is MemoryStatus.SUCCESS
    assert [[ids[0] for ids in ub.seq_id] for ub in mctx.ubatches] == want


def _balloc(mem, tokens, seq: int = 0):
    batch = Batch(token=tokens, seq_id=[[seq]] * len(tokens))
    return BatchAllocr(batch, n_vocab=N_VOCAB, n_seq_max=mem.n_seq_max, memory=mem)


# ---- cell reuse, positions, seq ops ------------------------------------------------------------


@every_iswa_flavour
def test_swa_cells_are_reused_while_the_base_keeps_everything(flavour):
    """300 positions through a 256-cell SWA cache: the SWA cache forgets the oldest (masked)
    ones, the base cache keeps all; the logits stay those of the cache-free forward."""
    pattern, n_swa = "1:1", 4
    hp, w = iswa_model(pattern, n_swa, flavour.dtype)
    ctx = make_iswa(flavour, pattern, n_swa, n_ctx=512, n_batch=64, n_ubatch=8,
                    swa_full=False)
    tokens = np.random.default_rng(0).integers(0, N_VOCAB, 300).tolist()
    out = np.concatenate([decode(ctx, tokens[i:i + 60]) for i in range(0, 300, 60)])
    mem = ctx.memory
    assert mem.kv_swa.get_size() == 256 and mem.kv_swa.v_cells[0].get_used() <= 256
    assert mem.kv_base.v_cells[0].get_used() == 300
    assert (mem.kv_base.seq_pos_min(0), mem.kv_base.seq_pos_max(0)) == (0, 299)
    assert mem.seq_pos_min(0) == mem.kv_swa.seq_pos_min(0) > 0  # from the SWA cache
    assert mem.seq_pos_max(0) == 299
    flavour.assert_close(reference_logits(w, hp, tokens)[-60:], out[-60:])


ops_st = st.lists(st.tuples(
    st.sampled_from(["seq_rm", "seq_cp", "seq_keep", "seq_add", "seq_div"]),
    st.integers(0, 2), st.integers(0, 2), st.integers(-1, 12), st.integers(-1, 14),
    st.integers(-3, 3)), max_size=6)


@given(ops=ops_st)
def test_seq_ops_reach_both_caches(ops):
    """Each cache's cells are those of one plain cache under the same ops (``swa_full``:
    no cell reused, so the layouts agree)."""
    hp, _ = iswa_model("1:1", 4)
    mem = KVCacheISWA(hp, kv_size=64, n_seq_max=3)
    plain = KVCache(dataclasses.replace(hp, n_swa=0, swa_type=SWA_TYPE_NONE, swa_layers=()),
                    kv_size=64, n_seq_max=3)
    for m in (mem, plain):
        for s, n in ((0, 10), (1, 6)):
            mctx = m.init_batch(_balloc(m, [1] * n, s), n_ubatch=4)
            while True:
                mctx.apply()
                if not mctx.next():
                    break
    for name, s0, s1, p0, p1, x in ops:
        for m in (mem, plain):
            if name == "seq_rm":
                m.seq_rm(s0, p0, p1)
            elif name == "seq_cp":
                m.seq_cp(s0, s1, p0, p1)
            elif name == "seq_keep":
                m.seq_keep(s0)
            elif name == "seq_add":
                m.seq_add(s0, p0, p1, x)
            else:
                m.seq_div(s0, p0, p1, abs(x) + 1)
    for cache in mem.caches():
        assert cell_table(cache) == cell_table(plain)
        assert cache.v_cells[0].shift.tolist() == plain.v_cells[0].shift.tolist()
    for s in range(3):
        assert (mem.seq_pos_min(s), mem.seq_pos_max(s)) == (plain.seq_pos_min(s),
                                                             plain.seq_pos_max(s))


@pytest.mark.parametrize("data", [None, True, False], ids=["default", "data", "cells-only"])
def test_clear_empties_both_caches(data):
    """``clear`` empties every cell of both caches; with ``data`` (the default, as
    ``llama_memory_clear``'s) it also zeroes their K/V tensors, without it they stay."""
    hp, _ = iswa_model("1:1", 4)
    mem = KVCacheISWA(hp, kv_size=16, n_seq_max=2)
    mctx = mem.init_batch(_balloc(mem, list(range(1, 7)), seq=1), n_ubatch=8)
    mctx.apply()
    for cache in mem.caches():
        for t in cache.k_l + cache.v_l:
            t.fill(1.5)
    mem.clear() if data is None else mem.clear(data)
    for cache in mem.caches():
        assert cache.v_cells[0].get_used() == 0 and cell_table(cache) == []
        assert (cache.seq_pos_min(1), cache.seq_pos_max(1)) == (-1, -1)
        kept = 0.0 if data in (None, True) else 1.5
        assert all((t == kept).all() for t in cache.k_l + cache.v_l)


# ---- no slot in either cache ---------------------------------------------------------------


@every_flavour
@pytest.mark.parametrize("full", ["base", "swa"])
def test_no_slot_in_either_cache_changes_nothing(flavour, full):
    """rc 1 whichever cache has no room, the other one prepared and restored: the memory's
    state bytes are those before, and the decode goes on as if nothing happened."""
    ctx = make_iswa(flavour, "1:1", 4, n_ctx=512, n_batch=512, n_ubatch=16, n_seq_max=2,
                    swa_full=False)  # base 512 cells, SWA 256
    tokens = np.random.default_rng(1).integers(0, N_VOCAB, 250).tolist()
    decode(ctx, tokens)
    if full == "swa":  # shared cells are never reused: the SWA cache has 6 free cells
        ctx.memory.seq_cp(0, 1, -1, -1)
        extra = [5] * 10
    else:  # the SWA cache reuses cells; the base has 262 free
        extra = [5] * 270
    before = ctx.state_get_data()
    assert ctx.decode(Batch(token=extra)) == 1
    assert ctx.state_get_data() == before
    ok = decode(ctx, [7, 8])
    fresh = make_iswa(flavour, "1:1", 4, n_ctx=512, n_batch=512, n_ubatch=16, n_seq_max=2,
                      swa_full=False)
    decode(fresh, tokens)
    flavour.assert_close(decode(fresh, [7, 8]), ok)


# ---- the K-shift -------------------------------------------------------------------------------


@pytest.mark.parametrize("with_factors", [False, True], ids=["no-factors", "rope-factors"])
def test_k_shift_turns_each_layer_with_its_own_base(with_factors):
    """A SWA layer with another RoPE base (Gemma 3's local 10 000) is re-roped with it; the
    model's ``rope_freqs`` given to ``init_update`` reach the K-shift of both caches (the
    update of ``Context.memory_update``)."""
    hp, _ = iswa_model("1:1", 4)
    hp = dataclasses.replace(hp, rope_freq_base_train=1e4, rope_freq_base_train_swa=100.0)
    rng = np.random.default_rng(3)
    factors = rng.uniform(1.0, 4.0, hp.n_embd_head_k // 2) if with_factors else None
    mem = KVCacheISWA(hp, kv_size=16)
    mctx = mem.init_batch(_balloc(mem, list(range(6))), n_ubatch=8)
    mctx.apply()
    raw = rng.normal(size=(hp.n_layer, 6, hp.n_head_kv, hp.n_embd_head_k))
    for il in range(hp.n_layer):  # keys roped at their positions, as a forward writes them
        cache = mem.kv_swa if hp.is_swa(il) else mem.kv_base
        k = rope_ext(raw[il], np.arange(6), rope_cparams(hp, il), factors)
        cache.k_l[cache.layer_id(il)][0, :6] = k.reshape(6, -1)
    nothing = mem.init_update(factors)
    assert nothing.get_status() is MemoryStatus.NO_UPDATE and nothing.memory is mem
    mem.seq_add(0, 2, -1, 5)
    update = mem.init_update(factors)
    assert update.get_status() is MemoryStatus.SUCCESS
    assert update.apply() is True
    assert mem.init_update(factors).get_status() is MemoryStatus.NO_UPDATE
    want_pos = np.array([0, 1, 7, 8, 9, 10])
    for il in range(hp.n_layer):
        cache = mem.kv_swa if hp.is_swa(il) else mem.kv_base
        want = rope_ext(raw[il], want_pos, rope_cparams(hp, il), factors).reshape(6, -1)
        np.testing.assert_allclose(cache.k_l[cache.layer_id(il)][0, :6], want, atol=1e-5)
    assert rope_cparams(hp, 0).freq_base != rope_cparams(hp, 1).freq_base


@every_flavour
def test_context_shift_needs_equal_sizes(flavour):
    small = make_iswa(flavour, "1:1", 4, n_ctx=512, n_ubatch=8, swa_full=False)
    decode(small, [1, 2, 3, 4, 5, 6])
    with pytest.raises(ContextError, match="cannot shift"):
        context_shift(small, 0, 1, 2)
    full = make_iswa(flavour, "1:1", 4, n_ctx=512, n_ubatch=8, swa_full=True)
    decode(full, [1, 2, 3, 4, 5, 6])
    context_shift(full, 0, 1, 2)
    assert (full.memory.seq_pos_min(0), full.memory.seq_pos_max(0)) == (0, 3)
    assert cell_table(full.memory.kv_base) == cell_table(full.memory.kv_swa)


# ---- the state envelope ------------------------------------------------------------------------


def _envelope(*fields, parts=((0, b"base"), (1, b"swa!")), tail=b"", magic=ISWA_STATE_MAGIC,
              version=ISWA_STATE_VERSION) -> bytes:
    """A sealed iSWA blob: ``fields`` (struct format, value) of the header, then each part as
    one layer and its bytes (or the fields alone when ``parts`` is empty), then ``tail``."""
    body = BlobWriter()
    for fmt, value in fields:
        body.write(fmt, value)
    for il, blob in parts:
        body.write("IiQ", 1, il, len(blob))
        body.write_bytes(blob)
    body.write_bytes(tail)
    return seal(magic, version, body.getvalue())


WHOLE, PAIR = (("I", 0), ("I", 2)), [(0,), (1,)]

#: blobs that ``parse_iswa_state(blob, 0, [(0,), (1,)])`` refuses, and the exact reason
ENVELOPE_REFUSALS = {
    "magic": (_envelope(*WHOLE, magic=b"LRKV"),
              "bad magic b'LRKV': not a iSWA blob (expected b'LRIS')"),
    "version": (_envelope(*WHOLE, version=ISWA_STATE_VERSION + 1),
                f"iSWA blob format version {ISWA_STATE_VERSION + 1} (written by a newer "
                f"llamaref): this reader knows version {ISWA_STATE_VERSION}"),
    "partial": (_envelope(("I", 1), ("I", 1), parts=[(1, b"swa!")]),
                "a partial (PARTIAL_ONLY) blob cannot be read with flags 0 (whole (NONE)): "
                "use the flags it was written with"),
    "flags 2**31": (_envelope(("I", 2**31), ("I", 2)),
                    "a flags 2147483648 blob cannot be read with flags 0 (whole (NONE)): "
                    "use the flags it was written with"),
    "3 parts": (_envelope(("I", 0), ("I", 3)), "blob has 3 parts, a read with flags 0 expects 2"),
    "2**31 parts": (_envelope(("I", 0), ("I", 2**31)),
                    "blob has 2147483648 parts, a read with flags 0 expects 2"),
    "2**16 + 1 layers": (_envelope(*WHOLE, ("I", 2**16 + 1), parts=()),
                         "part 0 lists 65537 layers"),
    "2**32 - 1 layers": (_envelope(*WHOLE, ("I", 2**32 - 1), parts=()),
                         "part 0 lists 4294967295 layers"),
    "2**16 layers": (_envelope(*WHOLE, ("I", 2**16), *[("i", 0)] * 2**16, parts=()),
                     f"part 0 holds layers {[0] * 2**16}, this cache [0]"),
    "layer -1": (_envelope(*WHOLE, parts=[(-1, b"base"), (1, b"swa!")]),
                 "part 0 holds layers [-1], this cache [0]"),
    "other layers": (_envelope(*WHOLE, parts=[(0, b"base"), (0, b"swa!")]),
                     "part 1 holds layers [0], this cache [1]"),
    "size 2**63": (_envelope(*WHOLE, ("I", 1), ("i", 0), ("Q", 2**63), parts=()),
                   "iSWA blob truncated at byte 24: 9223372036854775808 bytes needed at offset 24"),
    "unread": (_envelope(*WHOLE, tail=b"xyz"), "iSWA blob has 3 unread bytes"),
}


def test_parse_iswa_state_reads_its_parts():
    """The parts in order, for the flags they were written with; not for the others."""
    assert parse_iswa_state(_envelope(*WHOLE), 0, PAIR) == [b"base", b"swa!"]
    partial = _envelope(("I", 1), ("I", 1), parts=[(1, b"swa!")])
    assert parse_iswa_state(partial, 1, [(1,)]) == [b"swa!"]
    with pytest.raises(StateError, match=re.escape(
            "a whole (NONE) blob cannot be read with flags 1 (partial (PARTIAL_ONLY))")):
        parse_iswa_state(_envelope(*WHOLE), 1, [(1,)])


@pytest.mark.parametrize("case", list(ENVELOPE_REFUSALS))
def test_parse_iswa_state_refuses_each_field(case):
    """Each field of the envelope is checked, with the reason in the error; a count that
    does not fit a 32-bit signed integer is read as the unsigned count it was written as."""
    blob, reason = ENVELOPE_REFUSALS[case]
    with pytest.raises(StateError) as err:
        parse_iswa_state(blob, 0, PAIR)
    assert str(err.value) == reason
