"""State save/restore (reference/memory/state.py and the memories' ``state_write`` /
``state_read``): round trips, continuation, refusals, on every memory.

The laws every model obeys (``llama``, ``iswa``, ``mamba``, ``mamba2``; on every flavour of
``tests/support/helpers.py``: the reference in float64 and float32, the MLX twin):

- save, clear, restore, continue == continue uninterrupted (the next logits, bit for bit
  after a whole restore), for the whole memory and for one sequence under another id;
- across the twins: a state (bytes or file, whole or one sequence, of a memory made ragged on
  purpose: sequences interleaved, holes from ``seq_rm``, cells shared by ``seq_cp``, a K-shift
  still pending) written by one Context restores in every Context of its dtype, and the
  decode goes on the same way;
- a sequence's blob is llama.cpp's (``u32 0xaf143cd8``, ``i32 seq_id``, then the memory's
  state); a memory with one part writes the same bytes with ``PARTIAL_ONLY``;
- a refused blob (truncated, corrupted, another model or architecture, no room, bad magic,
  unknown flags) raises ``StateError`` and leaves the memory bit-identical.

The KV cache's own (on the tiny Llama): a restore into a fragmented cache or another stream,
a pending K-shift or stream copy, and, on the reference's ``KVCache`` directly, the byte
format, its refusals and the cell layout. The iSWA pair's own (``llama_state_seq_flags``:
``PARTIAL_ONLY`` alias ``SWA_ONLY`` keeps the SWA cache only): its whole state is its base
cache then its SWA cache, a sequence's state brings back the window, a partial state restores
onto the base part (a server's checkpoint, also after the SWA cache reused cells), the flags'
refusals. The recurrent memory's byte format: ``tests/laws/test_recurrent.py``.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import re
import struct
import tempfile
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from reference.batch import Batch, BatchAllocr, Ubatch
from reference.memory import (
    LLAMA_STATE_SEQ_FLAGS_NONE,
    LLAMA_STATE_SEQ_FLAGS_PARTIAL_ONLY,
    LLAMA_STATE_SEQ_FLAGS_SWA_ONLY,
    KVCache,
    KVCacheISWA,
)
from reference.memory.kv_cache_iswa import parse_iswa_state
from reference.memory.state import (
    SEQ_STATE_MAGIC,
    StateError,
    context_state_read,
    context_state_write,
    state_load_file,
    state_parse,
    state_read,
    state_save_file,
    state_write,
)
from reference.models.llama import llama_forward
from tests.support.helpers import (
    CELLS,
    ISWA,
    K_SHIFT,
    LLAMA,
    MAMBA,
    MLX,
    MODELS,
    N_VOCAB,
    REF_F32,
    SWA,
    assert_between,
    decode_seq,
    deep,
    every_flavour,
    for_models,
    interleave,
    iswa_model,
    logits_ith,
    pending_shift,
    same_dtype,
)
from tests.support.helpers import assert_same as assert_same_ctx
from tests.support.helpers import snapshot as ctx_snapshot
from tests.support.tiny_models import random_weights, tiny_hparams

NONE, PARTIAL = LLAMA_STATE_SEQ_FLAGS_NONE, LLAMA_STATE_SEQ_FLAGS_PARTIAL_ONLY
every_model = for_models()

# ---------------------------------------------------------------------------------------------
# helpers: llama_decode's steps on a KVCache, snapshots
# ---------------------------------------------------------------------------------------------


def decode(cache: KVCache, w: dict, hp, tokens, seq_ids, n_ubatch: int = 4) -> np.ndarray:
    """Decode one batch (every token outputs); logits ``(n_tokens, n_vocab)`` in batch order."""
    batch = Batch(token=list(tokens), seq_id=[[s] for s in seq_ids], logits=[True] * len(tokens))
    balloc = BatchAllocr(batch, n_vocab=hp.n_vocab, n_seq_max=cache.n_seq_max, memory=cache)
    cache.update()
    ubatches = []
    while True:
        if cache.get_n_stream() == 1:
            ub = balloc.split_simple(n_ubatch)
        else:
            ub = balloc.split_equal(n_ubatch, sequential=False)
        if ub.n_tokens == 0:
            break
        ubatches.append(ub)
    sinfos = cache.prepare(ubatches)
    assert sinfos is not None, "no KV slot"
    out = np.zeros((len(tokens), hp.n_vocab), dtype=cache.dtype)
    for ub, sinfo in zip(ubatches, sinfos, strict=True):
        cache.apply_ubatch(sinfo, ub)
        logits = llama_forward(w, hp, ub.token, ub.pos, cache.attn_input(ub, sinfo))
        out[ub.idx] = logits
    return out


def snapshot(cache: KVCache):
    """Everything a restore could change."""
    cells = [c.copy() for c in cache.v_cells]  # KVCells compare all their fields
    return (cells, list(cache.v_heads), list(cache.sc_info),
            [t.copy() for t in cache.k_l], [t.copy() for t in cache.v_l])


def assert_same(a, b) -> None:
    assert a[:3] == b[:3]
    for x, y in zip(a[3] + a[4], b[3] + b[4], strict=True):
        assert x.tobytes() == y.tobytes()


def cell_table(cache: KVCache, stream: int = 0) -> list[tuple[int, tuple[int, ...]]]:
    c = cache.v_cells[stream]
    return [(int(c.pos[i]), tuple(sorted(c.seq_get_all(i)))) for i in range(c.size())
            if c.pos[i] != -1]


HP = tiny_hparams(n_layer=2)
W32 = random_weights(HP, seed=1)
W64 = random_weights(HP, seed=1, dtype=np.float64)

# two sequences of different lengths, interleaved in one batch
PREFIX_TOKENS = [3, 9, 4, 1, 7, 2, 5, 8]
PREFIX_SEQS = [0, 1, 0, 1, 0, 1, 0, 0]
N_SEQ = 3


# ---------------------------------------------------------------------------------------------
# every model: save, clear, restore, continue == uninterrupted
# ---------------------------------------------------------------------------------------------


def state_ctx(flavour, kv_unified: bool = True, n_seq_max: int = N_SEQ, model=LLAMA,
              variant=None):
    """A Context of ``model`` (the laws' tiny Llama unless told) with small ubatches, 256
    cells per stream."""
    return model.make(flavour, variant, n_ubatch=4, n_seq_max=n_seq_max, kv_unified=kv_unified)


def decode_batch(ctx, tokens, seq_ids) -> np.ndarray:
    """One batch, every token an output; its logits ``(n_tokens, n_vocab)`` in batch order."""
    batch = Batch(token=list(tokens), seq_id=[[s] for s in seq_ids], logits=[True] * len(tokens))
    assert ctx.decode(batch) == 0, ctx.last_error
    return ctx.get_logits().copy()


seq_tokens = st.lists(st.integers(0, N_VOCAB - 1), min_size=1, max_size=6)
memory_op = st.one_of(
    st.tuples(st.just("seq_rm"), st.integers(0, N_SEQ - 1), st.integers(-1, 6),
              st.integers(-1, 6)),
    st.tuples(st.just("seq_add"), st.integers(0, N_SEQ - 1), st.integers(-1, 6),
              st.integers(-3, 3)),
    st.tuples(st.just("seq_cp"), st.integers(0, N_SEQ - 1), st.integers(0, N_SEQ - 1),
              st.just(0)),
)


def fill(ctx, seqs: list[list[int]], ops) -> list[int]:
    """Decode ``seqs`` interleaved in one batch, apply ``ops``; returns the batch's tokens.
    (A partial ``seq_rm`` of a recurrent state returns False and changes nothing.)"""
    token, seq_id = interleave(seqs)
    assert ctx.decode(Batch(token=token, seq_id=seq_id, logits=[True] * len(token))) == 0
    mem = ctx.memory
    for name, s, a, b in ops:
        if name == "seq_rm":
            mem.seq_rm(s, a, b)
        elif name == "seq_add":
            mem.seq_add(s, a, -1, b)  # pending until the next decode
        elif a != s:  # seq_cp into an emptied sequence, as llama.cpp's examples do
            mem.seq_rm(a, -1, -1)
            mem.seq_cp(s, a, -1, -1)
    return token


def go_on(ctx) -> np.ndarray:
    """One more token for every sequence (automatic positions); its logits."""
    b = Batch(token=[5 + s for s in range(N_SEQ)], seq_id=[[s] for s in range(N_SEQ)],
              logits=[True] * N_SEQ)
    assert ctx.decode(b) == 0
    return ctx.get_logits().copy()  # (N_SEQ, n_vocab)


@every_model
@every_flavour
@deep()
@given(data=st.data(), cont=seq_tokens, whole=st.booleans(), kv_unified=st.booleans())
def test_save_clear_restore_continue_equals_uninterrupted(model, flavour, data, cont, whole,
                                                          kv_unified):
    """Two sequences interleaved; the whole memory, or sequence 0 alone (restored as
    sequence 2), saved, the memory cleared (something else decoded in between), restored:
    the decode goes on as the uninterrupted one, bit for bit after a whole restore (the
    cells come back where they were, 0 .. n - 1; an iSWA memory's SWA cache then searches
    its slots from cell 0 and reuses a masked cell there: the same logits to rounding)."""
    variant = model.draw(data)
    a, b = (data.draw(model.prompt_st(1, 12), label=name) for name in ("a", "b"))

    def filled():
        ctx = state_ctx(flavour, kv_unified, model=model, variant=variant)
        fill(ctx, [a, b], [])
        return ctx

    ctx, uninterrupted = filled(), filled()
    if whole:
        blob = ctx.state_get_data()
        outputs = ctx.get_logits().copy()
        ctx.memory.clear()
        decode_seq(ctx, cont, seq=2)  # something else in between
        assert ctx.state_set_data(blob) == len(blob)
        np.testing.assert_array_equal(ctx.get_logits(), outputs)  # the outputs come back too
        assert ctx.state_get_data() == blob  # byte-identical round trip
        assert ctx.memory.seq_pos_max(2) == -1
        for s in (0, 1):
            got, straight = decode_seq(ctx, cont, seq=s), decode_seq(uninterrupted, cont, seq=s)
            if model.has(SWA):  # the restored SWA cache reuses masked cells from cell 0
                flavour.assert_close(straight, got)
            else:
                assert got.tobytes() == straight.tobytes()
        return
    blob = ctx.state_seq_get_data(0)
    ctx.memory.clear()
    assert ctx.state_seq_set_data(blob, 2) == len(blob)  # a sequence blob goes anywhere
    assert ctx.memory.seq_pos_max(0) == ctx.memory.seq_pos_max(1) == -1
    flavour.assert_close(decode_seq(uninterrupted, cont, seq=0), decode_seq(ctx, cont, seq=2))


@every_model
@every_flavour
@deep()
@given(data=st.data(), seqs=st.lists(seq_tokens, min_size=1, max_size=N_SEQ),
       ops=st.lists(memory_op, max_size=3), kv_unified=st.booleans(), use_file=st.booleans())
def test_whole_state_crosses_and_continues(model, flavour, data, seqs, ops, kv_unified,
                                           use_file):
    """The whole memory (bytes or file) of a memory made ragged on purpose (sequences
    interleaved, holes from ``seq_rm``, cells shared by ``seq_cp``, a K-shift still pending
    from ``seq_add``), one stream or one per sequence, restores in a Context that held
    something else: the same bytes back, and the next logits agree (the law's bound within a
    flavour: a whole restore compacts the cells, so the attention sums run in another order;
    NMSE <= 1e-6 across the twins)."""
    variant = model.draw(data)
    seqs = [data.draw(model.prompt_st(len(t), len(t)), label=f"seq {s}")
            for s, t in enumerate(seqs)]  # the iSWA's are longer than the window
    a = state_ctx(flavour, kv_unified, model=model, variant=variant)
    tokens = fill(a, seqs, ops)
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "state.bin"
        if use_file:
            assert a.state_save_file(path, tokens) == path.stat().st_size
        blob = a.state_get_data()
        restored = []
        for f in same_dtype(flavour):
            b = state_ctx(f, kv_unified, model=model, variant=variant)
            fill(b, [[1, 2, 3]], [])  # not empty: the restore replaces everything
            if use_file:
                assert b.state_load_file(path).tolist() == tokens
            else:
                assert b.state_set_data(blob) == len(blob)
                np.testing.assert_array_equal(b.get_logits(), a.get_logits())
                for i in (0, -1):  # the restored rows, on the device too
                    np.testing.assert_array_equal(logits_ith(b, i), a.get_logits_ith(i))
            assert pending_shift(b.memory) == pending_shift(a.memory)
            restored.append((f, b))
    for _, b in restored:
        if use_file:  # the file holds no logits: compare each sequence's cells and K/V
            for s in range(N_SEQ):
                assert b.state_seq_get_data(s) == a.state_seq_get_data(s)
        else:
            assert b.state_get_data() == blob  # the tensors came back bit for bit
    want = go_on(a)
    for f, b in restored:
        assert_between(flavour, f, want, go_on(b))


@every_model
@every_flavour
@deep()
@given(data=st.data(), seqs=st.lists(seq_tokens, min_size=2, max_size=N_SEQ),
       s=st.integers(0, N_SEQ - 1), hole=st.tuples(st.integers(-1, 6), st.integers(-1, 6)),
       kv_unified=st.booleans(), use_file=st.booleans())
def test_one_sequence_crosses_into_another_id(model, flavour, data, seqs, s, hole, kv_unified,
                                              use_file):
    """One sequence (bytes or file) restored under another id into a Context that already
    holds other sequences, with holes before its head; the decode goes on the same way (an
    iSWA memory brings back the window of the last position only: ``seq_pos_min`` differs,
    :func:`test_a_sequence_state_brings_back_the_window`)."""
    variant = model.draw(data)
    seqs = [data.draw(model.prompt_st(len(t), len(t)), label=f"seq {k}")
            for k, t in enumerate(seqs)]
    s %= len(seqs)
    a = state_ctx(flavour, kv_unified, N_SEQ + 1, model, variant)  # a blob holds its streams
    fill(a, seqs, [("seq_rm", s, *hole)])
    tokens = [1, 2, 3]
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "seq.bin"
        if use_file:
            a.state_seq_save_file(path, s, tokens)
        blob = a.state_seq_get_data(s)
        restored = []
        for f in same_dtype(flavour):
            b = state_ctx(f, kv_unified, N_SEQ + 1, model, variant)
            fill(b, [[7, 8, 9, 10], [11, 12]], [("seq_rm", 0, 1, 3)])  # holes before the head
            if use_file:
                assert b.state_seq_load_file(path, N_SEQ).tolist() == tokens
            else:
                assert b.state_seq_set_data(blob, N_SEQ) == len(blob)
            if not model.has(SWA):
                assert b.memory.seq_pos_min(N_SEQ) == a.memory.seq_pos_min(s)
            assert b.memory.seq_pos_max(N_SEQ) == a.memory.seq_pos_max(s)
            assert b.memory.seq_pos_max(0) == 3  # the other sequences are still there
            assert b.memory.seq_pos_max(1) == 1
            restored.append((f, b))
    assert a.decode(Batch(token=[4, 5], seq_id=[[s], [s]], logits=[True, True])) == 0
    for f, b in restored:
        assert b.decode(Batch(token=[4, 5], seq_id=[[N_SEQ], [N_SEQ]], logits=[True, True])) == 0
        assert_between(flavour, f, a.get_logits(), b.get_logits())


@every_model
@every_flavour
def test_state_files_round_trip(model, flavour, tmp_path):
    """A sequence's file restores under another id, the whole file restores everything; the
    tokens come back and the decode goes on."""
    src = state_ctx(flavour, n_seq_max=2, model=model)
    prompt = list(range(1, 12))
    decode_batch(src, prompt, [1] * len(prompt))
    n = src.state_seq_save_file(tmp_path / "seq.bin", 1, prompt)
    n_whole = src.state_save_file(tmp_path / "whole.bin", [9, 9])
    assert n == (tmp_path / "seq.bin").stat().st_size
    assert n_whole == (tmp_path / "whole.bin").stat().st_size
    want = decode_seq(src, [3], seq=1)
    dst = state_ctx(flavour, n_seq_max=2, model=model)
    decode_batch(dst, [4, 5], [1, 1])  # replaced by the whole file, kept by the sequence's
    assert dst.state_seq_load_file(tmp_path / "seq.bin", 0).tolist() == prompt
    assert (dst.memory.seq_pos_max(0), dst.memory.seq_pos_max(1)) == (10, 1)
    flavour.assert_close(want, decode_seq(dst, [3], seq=0))
    assert dst.state_load_file(tmp_path / "whole.bin").tolist() == [9, 9]
    assert (dst.memory.seq_pos_max(0), dst.memory.seq_pos_max(1)) == (-1, 10)
    flavour.assert_close(want, decode_seq(dst, [3], seq=1))


# ---------------------------------------------------------------------------------------------
# every model: the sequence blob, PARTIAL_ONLY, refusals
# ---------------------------------------------------------------------------------------------


def test_flags_are_llama_h():
    assert (NONE, PARTIAL, LLAMA_STATE_SEQ_FLAGS_SWA_ONLY) == (0, 1, 1)


@every_model
@every_flavour
def test_seq_blob_is_magic_seq_id_then_the_memory(model, flavour):
    """``u32 0xaf143cd8``, ``i32 seq_id``, then the memory's state; ``state_seq_get_data`` is
    the ``_ext`` form with no flags; a partial state is shorter where there is a SWA cache."""
    ctx = state_ctx(flavour, model=model, variant=model.variants[-1])
    decode_seq(ctx, list(range(1, 10)), seq=2)
    blob = ctx.state_seq_get_data_ext(2, NONE)
    assert struct.unpack("<Ii", blob[:8]) == (SEQ_STATE_MAGIC, 2)
    assert blob[8:] == ctx.memory.state_write(ctx.hparams, 2, NONE)
    assert ctx.state_seq_get_data(2) == blob  # llama_state_seq_get_data = _ext(..., 0)
    partial = ctx.state_seq_get_data_ext(2, PARTIAL)
    assert partial[8:] == ctx.memory.state_write(ctx.hparams, 2, PARTIAL)
    assert (len(partial) < len(blob)) == model.has(SWA)


@for_models(lacking=(SWA,))
@every_flavour
def test_partial_is_everything_for_a_single_memory(model, flavour):
    """A plain KV cache and a recurrent memory have no partial part: the same bytes, and a
    partial read is a whole read."""
    ctx = state_ctx(flavour, n_seq_max=2, model=model)
    decode_seq(ctx, [1, 2, 3, 4], seq=1)
    whole = ctx.state_seq_get_data_ext(1, NONE)
    assert ctx.state_seq_get_data_ext(1, PARTIAL) == whole
    before = ctx.state_get_data()
    assert ctx.state_seq_set_data_ext(whole, 1, PARTIAL) == len(whole)
    assert ctx.state_get_data() == before


#: the model whose blobs are of another architecture (another memory, or another arch)
FOREIGN = {"llama": MAMBA, "iswa": LLAMA, "mamba": LLAMA, "mamba2": MAMBA}
#: name: (dest_seq_id or None for a whole read, flags, the error's message): the refusals of
#: every model; "does not fit" needs cells (a recurrent memory has one per sequence, always)
REFUSALS = {
    "truncated": (None, NONE, "truncated"),
    "truncated seq": (2, NONE, "truncated"),
    "header only": (2, NONE, "truncated"),
    "corrupted": (None, NONE, "checksum"),
    "bad magic": (2, NONE, "magic"),
    "another model": (None, NONE, "hyperparameters"),
    "another model seq": (2, NONE, "hyperparameters"),
    "another architecture": (None, NONE, "magic|architecture"),
    "another architecture seq": (2, NONE, "magic|architecture"),
    "dest out of range": (-5, NONE, "out of range"),
    "unknown flags": (2, 2, "flags 2 not supported"),
    "does not fit": (2, NONE, "does not fit"),
}


@functools.cache
def refused_blob(model, flavour, name: str) -> bytes:
    """The blob of refusal ``name`` (a key of :data:`REFUSALS`) for a Context of ``model``."""
    src = state_ctx(flavour, model=model)
    fill(src, [[1, 2, 3, 4], [5, 6]], [])
    whole, seq = src.state_get_data(), src.state_seq_get_data(0)
    if name.startswith(("another model", "another architecture")):
        other = (model.make(flavour, model.other, n_seq_max=N_SEQ)
                 if name.startswith("another model")
                 else FOREIGN[model.name].make(flavour, n_seq_max=N_SEQ))
        other.decode(Batch(token=[1, 2]))
        return other.state_seq_get_data(0) if name.endswith("seq") else other.state_get_data()
    if name == "does not fit":
        big = state_ctx(flavour, model=model)
        big.decode(Batch(token=list(range(N_VOCAB)) * 7))  # 224 cells: more than the room
        return big.state_seq_get_data(0)
    flipped = bytearray(whole)
    flipped[len(flipped) // 2] ^= 0xFF
    return {"truncated": whole[:-1], "truncated seq": seq[: len(seq) // 2],
            "header only": seq[:6], "corrupted": bytes(flipped),
            "bad magic": b"\0\0\0\0" + seq[4:]}.get(name, seq)


@pytest.mark.parametrize(("model", "name"), [
    (m, name) for m in MODELS for name in REFUSALS if name != "does not fit" or m.has(CELLS)],
    ids=lambda x: str(x).replace(" ", "-"))
@every_flavour
def test_refused_blob_leaves_the_memory_bit_identical(model, name, flavour):
    """``StateError`` with a message that says why, and the memory (cells, tensors, outputs,
    a pending K-shift) is what it was."""
    dest, flags, message = REFUSALS[name]
    blob = refused_blob(model, flavour, name)
    ctx = state_ctx(flavour, model=model)
    ops = [("seq_add", 0, 3, 2)] if model.has(K_SHIFT) else []
    fill(ctx, [[9, 8, 7, 6, 5, 4, 3, 2, 1] * 4, [4, 5, 6]], ops)
    before = ctx_snapshot(ctx)
    with pytest.raises(StateError, match=message):
        if dest is None:
            ctx.state_set_data(blob)
        else:
            ctx.state_seq_set_data_ext(blob, dest, flags)
    assert_same_ctx(before, ctx_snapshot(ctx))
    assert pending_shift(ctx.memory) == model.has(K_SHIFT)  # still pending


# ---------------------------------------------------------------------------------------------
# the KV cache's: a fragmented cache, another stream, a pending K-shift or stream copy
# ---------------------------------------------------------------------------------------------


@every_flavour
def test_seq_restore_into_another_id_of_a_fragmented_cache(flavour):
    def interleaved():
        # three sequences interleaved: the cells of each are scattered
        ctx = state_ctx(flavour, n_seq_max=4)
        decode_batch(ctx, [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11], [0, 1, 2, 0, 1, 2, 0, 1, 1, 0, 1])
        return ctx

    cache, uninterrupted = interleaved(), interleaved()
    expected = decode_batch(uninterrupted, [12], [1])

    blob = cache.state_seq_get_data(1)
    cache.memory.seq_rm(1, -1, -1)
    cache.memory.seq_rm(0, 1, 3)  # more holes
    decode_batch(cache, [13, 14], [2, 2])  # the holes before the head get reused
    assert cache.state_seq_set_data(blob, 3) == len(blob)
    idxs = np.flatnonzero(cache.memory.v_cells[0].seq[:, 3]).tolist()
    assert idxs != list(range(idxs[0], idxs[0] + len(idxs)))  # really not contiguous
    assert (cache.memory.seq_pos_min(3), cache.memory.seq_pos_max(3)) == (0, 4)
    assert cache.memory.seq_pos_max(1) == -1
    got = decode_batch(cache, [12], [3])
    # the same cells at other indices: the attention sums the same terms in another order
    # (exact zeros of the masked cells fall elsewhere), so float32 agrees to rounding only
    tol = 1e-12 if flavour.dtype == np.float64 else 1e-5
    np.testing.assert_allclose(got, expected, rtol=tol, atol=tol)
    flavour.assert_close(expected, got)
    assert cache.state_seq_get_data(3) != blob  # it says seq 3 now ...
    fresh = state_ctx(flavour, n_seq_max=4)
    assert fresh.state_seq_set_data(blob, 1) == len(blob)
    assert fresh.state_seq_get_data(1) == blob  # ... and round trips under seq 1


@every_flavour
def test_seq_restore_into_another_stream(flavour):
    cache, uninterrupted = state_ctx(flavour, False, 2), state_ctx(flavour, False, 2)
    for ctx in (cache, uninterrupted):
        decode_batch(ctx, PREFIX_TOKENS, PREFIX_SEQS)
    expected = decode_batch(uninterrupted, [6], [0])
    blob = cache.state_seq_get_data(0)
    # the memory blob follows llama_context's header (u32 magic, i32 seq_id)
    assert [st.cell_count for st in state_parse(blob[8:]).streams] == [5, 0]
    fresh = state_ctx(flavour, False, 2)
    assert fresh.state_seq_set_data(blob, 1) == len(blob)  # stream 0 -> stream 1
    assert fresh.memory.seq_pos_max(0) == -1 and fresh.memory.seq_pos_max(1) == 4
    assert decode_batch(fresh, [6], [1]).tobytes() == expected.tobytes()


@every_flavour
def test_pending_k_shift_is_saved(flavour):
    def shifted():
        ctx = state_ctx(flavour, n_seq_max=2)
        decode_batch(ctx, PREFIX_TOKENS, PREFIX_SEQS)
        ctx.memory.seq_rm(0, 0, 2)
        ctx.memory.seq_add(0, 2, -1, -2)  # pending until the next update
        assert ctx.memory.get_has_shift()
        return ctx

    cache, uninterrupted = shifted(), shifted()
    expected = decode_batch(uninterrupted, [6], [0])
    blob = cache.state_get_data()
    fresh = state_ctx(flavour, n_seq_max=2)
    assert fresh.state_set_data(blob) == len(blob)
    assert fresh.memory.get_has_shift()
    assert fresh.state_get_data() == blob
    # whole restore compacts: the two freed cells are gone, so the layout differs
    got = decode_batch(fresh, [6], [0])
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-5)
    flavour.assert_close(expected, got)


@every_flavour
def test_pending_stream_copy_is_resolved_when_saving(flavour):
    def copied():
        ctx = state_ctx(flavour, False, 2)
        decode_batch(ctx, [3, 9, 4], [0, 0, 0])
        ctx.memory.seq_cp(0, 1, -1, -1)  # K/V copied at the next update
        assert ctx.memory.sc_info
        return ctx

    cache, uninterrupted = copied(), copied()
    expected = decode_batch(uninterrupted, [6, 7], [0, 1])
    fresh = state_ctx(flavour, False, 2)
    blob = cache.state_get_data()
    assert fresh.state_set_data(blob) == len(blob)
    assert not fresh.memory.sc_info
    got = decode_batch(fresh, [6, 7], [0, 1])
    assert got.tobytes() == expected.tobytes()


# ---------------------------------------------------------------------------------------------
# the iSWA pair's: base then SWA, the window, a partial state, the flags' refusals
# ---------------------------------------------------------------------------------------------

iswa_prompt_st = st.lists(st.integers(0, N_VOCAB - 1), min_size=9, max_size=14)
tail_st = st.lists(st.integers(0, N_VOCAB - 1), min_size=1, max_size=5)
patterns_st = st.sampled_from(["1:1", "5:1", "all"])
n_swa_st = st.integers(4, 8)


def make_iswa(flavour, pattern: str = "1:1", n_swa: int = 4, **kwargs):
    """A Context of the iSWA model (``n_ctx = n_batch = n_ubatch = 256`` unless told)."""
    return ISWA.make(flavour, (pattern, n_swa), **kwargs)


def memory_blob(ctx) -> bytes:
    """The memory's part of the context's whole state (outputs left out)."""
    return ctx.memory.state_write(ctx.hparams)


@every_flavour
def test_whole_state_is_base_then_swa(flavour):
    ctx = make_iswa(flavour, "5:1", 4, n_ctx=512, n_batch=512, n_ubatch=8, swa_full=False)
    tokens = np.random.default_rng(4).integers(0, N_VOCAB, 270).tolist()
    decode_seq(ctx, tokens)
    mem = ctx.memory
    base, swa = parse_iswa_state(memory_blob(ctx), NONE, [mem.kv_base.layers,
                                                          mem.kv_swa.layers])
    assert base == mem.kv_base.state_write(ctx.hparams)
    assert swa == mem.kv_swa.state_write(ctx.hparams)
    assert state_parse(base).streams[0].pos == list(range(270))  # every position
    swa_pos = state_parse(swa).streams[0].pos  # the SWA cache has forgotten the oldest
    assert len(swa_pos) <= 256 and max(swa_pos) == 269
    [part] = parse_iswa_state(mem.state_write(ctx.hparams, 0, PARTIAL), PARTIAL,
                              [mem.kv_swa.layers])
    assert state_parse(part).streams[0].pos == [266, 267, 268, 269]  # the window of 269


@every_flavour
@given(pattern=patterns_st, n_swa=n_swa_st, prompt=iswa_prompt_st)
def test_a_sequence_state_brings_back_the_window(flavour, pattern, n_swa, prompt):
    """Restored under another id: the SWA part brings back the window of the last position,
    the base part everything; another sequence stays."""
    src = make_iswa(flavour, pattern, n_swa, n_seq_max=2)
    decode_seq(src, prompt, seq=0)
    blob = src.state_seq_get_data_ext(0, NONE)
    dst = make_iswa(flavour, pattern, n_swa, n_seq_max=2)
    decode_seq(dst, [5, 6, 7], seq=0)  # another sequence stays
    assert dst.state_seq_set_data_ext(blob, 1, NONE) == len(blob)
    assert (dst.memory.seq_pos_min(1), dst.memory.seq_pos_max(1)) == (len(prompt) - n_swa,
                                                                      len(prompt) - 1)
    assert dst.memory.kv_base.seq_pos_min(1) == 0
    assert dst.memory.seq_pos_max(0) == 2


def rewind_and_restore(ctx, partial: bytes, n_prompt: int, seq: int = 0) -> None:
    """Roll the sequence back to the checkpoint (both caches), then restore its SWA part."""
    assert ctx.memory.seq_rm(seq, n_prompt, -1)
    assert ctx.state_seq_set_data_ext(partial, seq, PARTIAL) == len(partial)


@every_flavour
@given(pattern=st.sampled_from(["1:1", "5:1"]), n_swa=n_swa_st, prompt=iswa_prompt_st,
       detour=tail_st, tail=tail_st)
def test_partial_state_restores_onto_the_base_part(flavour, pattern, n_swa, prompt, detour,
                                                    tail):
    """A server's checkpoint: save the SWA part at the end of the prompt, go on, roll both
    caches back to the prompt, restore the SWA part: the continuation is the uninterrupted
    one."""
    ctx = make_iswa(flavour, pattern, n_swa)
    decode_seq(ctx, prompt)
    partial = ctx.state_seq_get_data_ext(0, PARTIAL)
    want = decode_seq(make_iswa(flavour, pattern, n_swa), prompt + tail)[len(prompt):]
    decode_seq(ctx, detour)
    rewind_and_restore(ctx, partial, len(prompt))
    assert ctx.memory.seq_pos_max(0) == len(prompt) - 1
    assert ctx.memory.seq_pos_min(0) == len(prompt) - n_swa  # only the window came back
    flavour.assert_close(want, decode_seq(ctx, tail))


@every_flavour
def test_partial_state_after_cells_were_reused(flavour):
    """The same, past the SWA cache's size: the detour overwrote the checkpoint's cells."""
    kw = dict(n_ctx=512, n_batch=64, n_ubatch=8, swa_full=False)
    rng = np.random.default_rng(5)
    prompt, detour, tail = (rng.integers(0, N_VOCAB, n).tolist() for n in (200, 260, 4))
    ctx = make_iswa(flavour, "1:1", 4, **kw)
    for i in range(0, len(prompt), 50):
        decode_seq(ctx, prompt[i:i + 50])
    partial = ctx.state_seq_get_data_ext(0, PARTIAL)
    for i in range(0, len(detour), 52):
        decode_seq(ctx, detour[i:i + 52])
    assert ctx.memory.kv_swa.seq_pos_min(0) > 199  # the window of 199 is gone from the cache
    rewind_and_restore(ctx, partial, len(prompt))
    uninterrupted = make_iswa(flavour, "1:1", 4, **kw)
    for i in range(0, len(prompt), 50):
        decode_seq(uninterrupted, prompt[i:i + 50])
    flavour.assert_close(decode_seq(uninterrupted, tail), decode_seq(ctx, tail))


@pytest.mark.parametrize(("writer", "reader"), [(MLX, REF_F32), (REF_F32, MLX)], ids=str)
@pytest.mark.parametrize("flags", [NONE, PARTIAL])
def test_a_state_crosses_the_twins(writer, reader, flags):
    """A sequence state written by one twin restores in the other (same dtype) and goes on as
    the writer goes on, onto the base part for a partial state; the whole state too."""
    prompt, tail = list(range(1, 16)), [4, 2, 9]
    src = make_iswa(writer, "5:1", 4)
    decode_seq(src, prompt)
    blob, whole = src.state_seq_get_data_ext(0, flags), src.state_get_data()
    want = decode_seq(src, tail)
    dst = make_iswa(reader, "5:1", 4)
    decode_seq(dst, prompt + [7, 7])  # the base part, for a partial state, and a detour
    assert dst.memory.seq_rm(0, len(prompt), -1)
    assert dst.state_seq_set_data_ext(blob, 0, flags) == len(blob)
    assert_between(writer, reader, want, decode_seq(dst, tail))
    other = make_iswa(reader, "5:1", 4)
    assert other.state_set_data(whole) == len(whole)
    assert_between(writer, reader, want, decode_seq(other, tail))


def flag_refusals(flavour):
    """(name, blob, dest_seq_id, flags, message): the refusals of the flags, for a
    two-sequence iSWA context (those of every model: :data:`REFUSALS`)."""
    src = make_iswa(flavour, "1:1", 4, n_seq_max=2)
    decode_seq(src, list(range(1, 13)))
    whole = src.state_seq_get_data_ext(0, NONE)
    partial = src.state_seq_get_data_ext(0, PARTIAL)
    other_hp, other_w = iswa_model("1:1", 5, flavour.dtype)
    other = flavour.make(other_hp, other_w, n_ctx=256, n_seq_max=2)
    decode_seq(other, list(range(1, 13)))
    return [
        ("partial blob, whole read", partial, 1, NONE, "cannot be read with flags 0"),
        ("whole blob, partial read", whole, 1, PARTIAL, "cannot be read with flags 1"),
        ("another model, partial", other.state_seq_get_data_ext(0, PARTIAL), 1, PARTIAL,
         "hyperparameters"),
    ]


@every_flavour
def test_every_refusal_of_the_flags_changes_nothing(flavour):
    for name, blob, dest, flags, message in flag_refusals(flavour):
        ctx = make_iswa(flavour, "1:1", 4, n_seq_max=2)
        decode_seq(ctx, [7, 7, 1, 2, 3, 4, 5, 6, 8], seq=0)
        decode_seq(ctx, [2] * 200, seq=1)
        before = ctx.state_get_data()
        with pytest.raises(StateError, match=message):
            ctx.state_seq_set_data_ext(blob, dest, flags)
        assert ctx.state_get_data() == before, name


@every_flavour
def test_a_refused_swa_part_leaves_the_restored_base_untouched(flavour):
    """The base part fits, the SWA part does not: nothing is written (llama.cpp restores the
    base before it finds the SWA part has no room)."""
    src = make_iswa(flavour, "1:1", 4, n_seq_max=3)
    decode_seq(src, list(range(1, 10)))
    blob = src.state_seq_get_data_ext(0, NONE)
    hp, w = iswa_model("1:1", 4, flavour.dtype)
    ctx = flavour.make(hp, w, n_ctx=512, n_batch=512, n_ubatch=8, n_seq_max=3,
                       swa_full=False)  # base 512 cells, SWA 256
    decode_seq(ctx, np.random.default_rng(7).integers(0, N_VOCAB, 253).tolist(), seq=1)
    ctx.memory.seq_cp(1, 2, -1, -1)  # shared cells: the SWA cache cannot reuse its 253
    before = ctx.state_get_data()
    assert ctx.memory.kv_base.get_size() - ctx.memory.kv_base.v_cells[0].get_used() >= 9
    with pytest.raises(StateError, match="does not fit"):
        ctx.state_seq_set_data_ext(blob, 0, NONE)
    assert ctx.state_get_data() == before
    assert isinstance(ctx.memory, KVCacheISWA)


# ---------------------------------------------------------------------------------------------
# a whole restore compacts
# ---------------------------------------------------------------------------------------------


def test_whole_restore_compacts_a_fragmented_cache():
    cache = KVCache(HP, kv_size=32, n_seq_max=2)
    decode(cache, W64 if cache.dtype == np.float64 else W32, HP, PREFIX_TOKENS, PREFIX_SEQS)
    cache.seq_rm(0, 1, 3)  # holes
    before = cell_table(cache)
    fresh = KVCache(HP, kv_size=32, n_seq_max=2)
    state_read(fresh, HP, state_write(cache, HP))
    c = fresh.v_cells[0]
    assert cell_table(fresh) == before  # same cells, same order
    assert np.flatnonzero(c.pos != -1).tolist() == list(range(len(before)))  # at 0..n-1
    assert fresh.seq_pos_min(0) == cache.seq_pos_min(0)


# ---------------------------------------------------------------------------------------------
# SWA: masked cells of a sequence are not saved
# ---------------------------------------------------------------------------------------------


def test_swa_masked_cells_are_not_saved():
    hp = tiny_hparams(n_layer=2, n_swa=3)
    w = random_weights(hp, seed=2, dtype=np.float64)
    cache = KVCache(hp, kv_size=32, n_seq_max=2, dtype=np.float64)
    decode(cache, w, hp, list(range(1, 9)), [0] * 8)
    expected = decode(copy.deepcopy(cache), w, hp, [20], [0])

    seq_blob = state_write(cache, hp, seq_id=0)
    whole_blob = state_write(cache, hp)
    # pos_max = 7, window 3: positions <= 4 are hidden from position 7 -> cells 5, 6, 7 only
    assert state_parse(seq_blob).streams[0].pos == [5, 6, 7]
    assert state_parse(whole_blob).streams[0].pos == list(range(8))  # a whole save keeps all
    row = 2 * hp.n_layer * hp.n_embd_k_gqa() * 8 + 16  # K+V rows, the cell (pos, n, shift, id)
    assert len(whole_blob) - len(seq_blob) == 5 * row

    fresh = KVCache(hp, kv_size=32, n_seq_max=2, dtype=np.float64)
    state_read(fresh, hp, seq_blob, dest_seq_id=1)
    assert fresh.seq_pos_min(1) == 5
    got = decode(fresh, w, hp, [20], [1])
    np.testing.assert_allclose(got, expected, rtol=1e-12, atol=1e-12)


# ---------------------------------------------------------------------------------------------
# byte round trip, as a law over random memories
# ---------------------------------------------------------------------------------------------


def _ubatch(pos, seq_id) -> Ubatch:
    n = len(pos)
    return Ubatch(token=np.zeros(n, np.int32), embd=None, pos=np.array(pos, np.int32),
                  seq_id=tuple((s,) for s in seq_id), seq_id_unq=tuple(sorted(set(seq_id))),
                  output=np.ones(n, bool), idx=np.arange(n), equal_seqs=False,
                  n_seq_tokens=1, n_seqs=n)


ops = st.lists(st.one_of(
    st.tuples(st.just("add_tokens"), st.integers(0, 2), st.integers(1, 3)),
    st.tuples(st.just("rm"), st.integers(0, 2), st.integers(-1, 5), st.integers(-1, 8)),
    st.tuples(st.just("cp"), st.integers(0, 2), st.integers(0, 2)),
    st.tuples(st.just("shift"), st.integers(0, 2), st.integers(-3, 3)),
), max_size=12)


@deep()
@given(ops=ops, seed=st.integers(0, 2**16), n_swa=st.sampled_from([0, 3]))
def test_blob_round_trip_is_byte_identical(ops, seed, n_swa):
    hp = tiny_hparams(n_layer=1, n_swa=n_swa)
    rng = np.random.default_rng(seed)
    cache = KVCache(hp, kv_size=16, n_seq_max=3)
    for op in ops:
        if op[0] == "add_tokens":
            _, s, n = op
            p0 = cache.seq_pos_max(s) + 1
            ub = _ubatch(list(range(p0, p0 + n)), [s] * n)
            sinfos = cache.prepare([ub])
            if sinfos is None:
                continue
            cache.apply_ubatch(sinfos[0], ub)
            for t in cache.k_l + cache.v_l:
                t[0, list(sinfos[0].idxs[0])] = rng.normal(size=(n, t.shape[-1]))
        elif op[0] == "rm":
            cache.seq_rm(op[1], op[2], op[3])
        elif op[0] == "cp":
            cache.seq_cp(op[1], op[2], -1, -1)
        else:
            cache.seq_add(op[1], 0, -1, op[2])
    blob = state_write(cache, hp)
    fresh = KVCache(hp, kv_size=16, n_seq_max=3)
    state_read(fresh, hp, blob)
    assert state_write(fresh, hp) == blob
    assert cell_table(fresh) == cell_table(cache)
    for s in range(3):
        seq_blob = state_write(cache, hp, seq_id=s)
        other = KVCache(hp, kv_size=16, n_seq_max=3)
        state_read(other, hp, seq_blob, dest_seq_id=s)
        assert state_write(other, hp, seq_id=s) == seq_blob


# ---------------------------------------------------------------------------------------------
# refusals: each leaves the memory bit-identical
# ---------------------------------------------------------------------------------------------


def _small_blob_and_target():
    hp = tiny_hparams(n_layer=1, n_embd=8, n_head=2, n_head_kv=1)
    src = KVCache(hp, kv_size=8, n_seq_max=2)
    ub = _ubatch([0, 1, 0], [0, 0, 1])
    src.apply_ubatch(src.prepare([ub])[0], ub)
    for t in src.k_l + src.v_l:
        t[0, :3] = np.arange(3 * t.shape[-1]).reshape(3, -1)
    target = KVCache(hp, kv_size=8, n_seq_max=2)
    ub = _ubatch([0, 1], [1, 1])
    target.apply_ubatch(target.prepare([ub])[0], ub)
    target.k_l[0][0, :2] = 7.0
    return hp, state_write(src, hp), state_write(src, hp, seq_id=0), target


def _refused(target, hp, data, match: str, dest_seq_id: int = -1) -> None:
    before = snapshot(target)
    with pytest.raises(StateError, match=match):
        state_read(target, hp, data, dest_seq_id)
    assert_same(before, snapshot(target))


def test_refuses_every_truncation():
    hp, blob, seq_blob, target = _small_blob_and_target()
    for data, dest in ((blob, -1), (seq_blob, 1)):
        for n in range(len(data)):
            _refused(target, hp, data[:n], "truncated", dest)
        _refused(target, hp, data + b"\0", "after its end", dest)


def test_refuses_every_flipped_byte():
    hp, blob, seq_blob, target = _small_blob_and_target()
    for data, dest in ((blob, -1), (seq_blob, 1)):
        for i in range(len(data)):
            bad = bytearray(data)
            bad[i] ^= 0x10
            # magic, version, size: their own message; anywhere else: the checksum
            match = "magic|version|truncated|after its end|smaller" if i < 16 else "checksum"
            _refused(target, hp, bytes(bad), match, dest)


def test_refuses_bad_magic_and_future_version():
    hp, blob, _, target = _small_blob_and_target()
    _refused(target, hp, b"GGSN" + blob[4:], "bad magic")
    future = blob[:4] + struct.pack("<I", 2) + blob[8:]
    _refused(target, hp, future, "version 2 \\(written by a newer llamaref\\)")


@pytest.mark.parametrize("change, match", [
    (dict(n_layer=2), "other hyperparameters"),
    (dict(n_head_kv=2), "other hyperparameters"),
    (dict(freq_base=500000.0), "other hyperparameters"),
    (dict(n_swa=2), "other hyperparameters"),
    (dict(arch="qwen2"), "architecture 'qwen2'"),
])
def test_refuses_another_model(change, match):
    hp, _, _, target = _small_blob_and_target()
    kw = dict(n_layer=1, n_embd=8, n_head=2, n_head_kv=1) | change
    hp_other = tiny_hparams(**kw)
    other = KVCache(hp_other, kv_size=8, n_seq_max=2)
    _refused(target, hp, state_write(other, hp_other), match)


def test_refuses_another_dtype_and_stream_layout():
    hp, _, _, target = _small_blob_and_target()
    f64 = KVCache(hp, kv_size=8, n_seq_max=2, dtype=np.float64)
    _refused(target, hp, state_write(f64, hp), "dtype mismatch")
    split = KVCache(hp, kv_size=8, n_seq_max=2, kv_unified=False)
    _refused(target, hp, state_write(split, hp), "n_stream mismatch")


def test_refuses_wrong_kind_and_ids():
    hp, blob, seq_blob, target = _small_blob_and_target()
    _refused(target, hp, blob, "dest_seq_id -1", dest_seq_id=0)
    _refused(target, hp, seq_blob, "dest_seq_id >= 0", dest_seq_id=-1)
    _refused(target, hp, seq_blob, "out of range", dest_seq_id=256)
    four = KVCache(hp, kv_size=8, n_seq_max=4)
    ub = _ubatch([0], [3])
    four.apply_ubatch(four.prepare([ub])[0], ub)
    _refused(target, hp, state_write(four, hp), "seq_id 3 out of range")
    _refused(target, hp, state_write(four, hp, seq_id=3), "out of range", dest_seq_id=3)


def test_refuses_a_sequence_that_does_not_fit():
    hp = tiny_hparams(n_layer=1)
    big = KVCache(hp, kv_size=16, n_seq_max=3)
    ub = _ubatch(list(range(6)), [0] * 6)
    big.apply_ubatch(big.prepare([ub])[0], ub)
    small = KVCache(hp, kv_size=8, n_seq_max=3)
    ub = _ubatch([0, 0, 1, 1, 2, 0], [1, 2, 1, 2, 1, 0])  # 2 free cells; seq 0 holds 1
    small.apply_ubatch(small.prepare([ub])[0], ub)
    _refused(small, hp, state_write(big, hp, seq_id=0),
             r"does not fit: sequence needs 6 cells, stream 0 has 2 free \(\+1 of sequence 0",
             dest_seq_id=0)
    assert small.seq_pos_max(0) == 0  # seq 0 kept its cell
    blob = state_write(big, hp)
    _refused(KVCache(hp, kv_size=4, n_seq_max=3), hp, blob, "does not fit")
    # without seq 2 there is room: 5 free cells + the 3 of seq 1, which the restore replaces
    small.seq_rm(2, -1, -1)
    state_read(small, hp, state_write(big, hp, seq_id=0), dest_seq_id=1)
    assert (small.seq_pos_min(1), small.seq_pos_max(1)) == (0, 5)


def test_refuses_hparams_of_another_memory():
    hp, blob, _, target = _small_blob_and_target()
    with pytest.raises(StateError, match="not those of this memory"):
        state_write(target, tiny_hparams())
    _refused(target, tiny_hparams(), blob, "not those of this memory")


# ---------------------------------------------------------------------------------------------
# files and the context state
# ---------------------------------------------------------------------------------------------


def test_state_file_round_trip_and_refusals(tmp_path: Path):
    cache = KVCache(HP, kv_size=32, n_seq_max=2)
    decode(cache, W32, HP, PREFIX_TOKENS, PREFIX_SEQS)
    expected = decode(copy.deepcopy(cache), W32, HP, [6], [1])
    path = tmp_path / "session.bin"
    size = state_save_file(path, cache, HP, PREFIX_TOKENS)
    assert path.stat().st_size == size
    assert sorted(p.name for p in tmp_path.iterdir()) == ["session.bin"]  # no temp file left

    cache.clear()
    assert state_load_file(path, cache, HP).tolist() == PREFIX_TOKENS
    assert decode(cache, W32, HP, [6], [1]).tobytes() == expected.tobytes()

    seq_path = tmp_path / "seq1.bin"
    toks = [t for t, s in zip(PREFIX_TOKENS, PREFIX_SEQS, strict=True) if s == 1]
    state_save_file(seq_path, cache, HP, toks, seq_id=1)
    fresh = KVCache(HP, kv_size=32, n_seq_max=2)
    assert state_load_file(seq_path, fresh, HP, dest_seq_id=0).tolist() == toks
    assert fresh.seq_pos_max(0) == cache.seq_pos_max(1)

    from reference.memory.blob import seal
    from reference.memory.state import FILE_MAGIC, FILE_VERSION

    data = path.read_bytes()
    before = snapshot(fresh)
    refusals = (
        (data[:-1], f"state file truncated at byte {len(data) - 1}"),
        (data[:20], "state file truncated at byte 20"),
        (b"LRKV" + data[4:], "bad magic b'LRKV': not a state file"),
        (seal(FILE_MAGIC, FILE_VERSION, struct.pack("<I", 2**32 - 1) + bytes(8)),
         f"state file truncated at byte 12: {(2**32 - 1) * 4} bytes needed at offset 4"),
    )
    for bad, message in refusals:
        path.write_bytes(bad)
        with pytest.raises(StateError, match=re.escape(message)):
            state_load_file(path, fresh, HP)
        assert_same(before, snapshot(fresh))


def test_context_state_round_trip():
    cache = KVCache(HP, kv_size=32, n_seq_max=2)
    logits = decode(cache, W32, HP, PREFIX_TOKENS, PREFIX_SEQS)
    output_ids = np.arange(len(PREFIX_TOKENS))
    blob = context_state_write(cache, HP, logits, output_ids)
    fresh = KVCache(HP, kv_size=32, n_seq_max=2)
    got_logits, got_ids = context_state_read(fresh, HP, blob)
    assert got_logits.tobytes() == logits.tobytes() and got_logits.dtype == logits.dtype
    assert got_ids.tolist() == output_ids.tolist()
    assert context_state_write(fresh, HP, got_logits, got_ids) == blob
    assert context_state_read(fresh, HP, context_state_write(fresh, HP, None, []))[0] is None
    before = snapshot(fresh)
    for n in range(0, len(blob), 97):
        with pytest.raises(StateError):
            context_state_read(fresh, HP, blob[:n])
        assert_same(before, snapshot(fresh))


def test_context_state_layout_and_refusals_by_message():
    """The context blob is the documented layout, field by field; output ids are any int32
    and nothing beyond; each crafted fault is refused with its whole message, the memory
    unchanged."""
    from reference.memory.blob import seal
    from reference.memory.state import CONTEXT_MAGIC, CONTEXT_VERSION

    cache = KVCache(HP, kv_size=32, n_seq_max=2)
    decode(cache, W32, HP, PREFIX_TOKENS, PREFIX_SEQS)
    logits = np.arange(2 * HP.n_vocab, dtype=np.float32).reshape(2, HP.n_vocab)
    ids = [-2**31, 2**31 - 1, -1]
    mem = cache.state_write(HP)
    rows, ids_bytes = logits.tobytes(), np.array(ids, "<i4").tobytes()

    def body(has=1, head=(0, 2, HP.n_vocab), n_ids=3, ids_bytes=ids_bytes, n_mem=None,
             tail=b""):
        out = struct.pack("<I", has) + (struct.pack("<iII", *head) + rows if has else b"")
        n_mem = len(mem) if n_mem is None else n_mem
        return out + struct.pack("<I", n_ids) + ids_bytes + struct.pack("<Q", n_mem) + mem + tail

    blob = context_state_write(cache, HP, logits, ids)
    assert blob == seal(CONTEXT_MAGIC, CONTEXT_VERSION, body())
    assert context_state_write(cache, HP, None, []) == seal(
        CONTEXT_MAGIC, CONTEXT_VERSION, body(has=0, n_ids=0, ids_bytes=b""))
    got_logits, got_ids = context_state_read(cache, HP, blob)
    assert got_logits.tobytes() == logits.tobytes() and got_ids.tolist() == ids
    for bad in ([2**31], [-2**31 - 1], [0, 2**31, 5], [2**64], ["a"]):
        with pytest.raises(StateError, match="^output ids must fit an int32$"):
            context_state_write(cache, HP, logits, bad)

    n_body = len(body())
    cases = [
        (blob[:20], "context state truncated at byte 20: the header says "
                    f"{n_body + 48} bytes"),
        (seal(CONTEXT_MAGIC, CONTEXT_VERSION, body(head=(-1, 2, HP.n_vocab))),
         "unsupported logits type ggml type -1"),
        (seal(CONTEXT_MAGIC, CONTEXT_VERSION, body(head=(0, 2**32 - 1, HP.n_vocab))),
         f"context state truncated at byte {n_body}: {(2**32 - 1) * HP.n_vocab * 4} bytes "
         "needed at offset 16"),
        (seal(CONTEXT_MAGIC, CONTEXT_VERSION, body(n_ids=2**32 - 1)),
         f"context state truncated at byte {n_body}: {(2**32 - 1) * 4} bytes needed at "
         f"offset {20 + logits.nbytes}"),
        (seal(CONTEXT_MAGIC, CONTEXT_VERSION, body(n_mem=2**63 + 1)),
         f"context state truncated at byte {n_body}: {2**63 + 1} bytes needed at offset "
         f"{n_body - len(mem)}"),
        (seal(CONTEXT_MAGIC, CONTEXT_VERSION, body(tail=b"\0\0\0")),
         "context state has 3 unread bytes"),
    ]
    before = snapshot(cache)
    for data, message in cases:
        with pytest.raises(StateError, match=f"^{re.escape(message)}$"):
            context_state_read(cache, HP, data)
        assert_same(before, snapshot(cache))


def test_a_sequence_blob_header_is_eight_bytes():
    """``u32 magic | i32 seq_id``: seven bytes are a truncated header; eight are a header
    whose memory state is empty, refused by the memory; the id is signed (-1: the whole
    memory)."""
    from reference.memory.state import seq_state_read, seq_state_write

    cache = KVCache(HP, kv_size=8, n_seq_max=2)
    whole = seq_state_write(cache, HP, -1)  # seq_id -1: every sequence, an i32 of -1
    assert whole == struct.pack("<Ii", SEQ_STATE_MAGIC, -1) + cache.state_write(HP)
    head = struct.pack("<Ii", SEQ_STATE_MAGIC, 1)
    with pytest.raises(StateError, match="^sequence state truncated at byte 7: the header "
                                         "needs 8$"):
        seq_state_read(cache, HP, head[:7], 0)
    with pytest.raises(StateError, match="^state blob truncated at byte 0: the header needs "
                                         "16 bytes$"):
        seq_state_read(cache, HP, head, 0)


def test_write_refuses_bad_arguments():
    with pytest.raises(StateError, match="seq_id=5 out of range"):
        state_write(KVCache(HP, kv_size=8, n_seq_max=2, kv_unified=False), HP, seq_id=5)
    with pytest.raises(StateError, match="logits must be"):
        context_state_write(KVCache(HP, kv_size=8), HP, np.zeros(3), [])
    assert dataclasses.replace(HP) == HP  # hparams untouched


# ---- regression: a pending shift across a state round trip (issue 10)


def test_freed_shift_is_not_pending_after_a_round_trip():
    """test_whole_state_crosses_and_continues found it (``seqs=[[0]], ops=[("seq_add", 0, 0, -1)]``,
    ``kv_unified=False``): ``seq_add`` moved the only cell below 0, which freed it. llama.cpp's
    ``has_shift`` flag stays set with no key left to turn; the restored memory, rebuilt from
    the saved cells, said False. ``get_has_shift`` now answers from the cells (a used cell
    with a non-zero shift), so the source and the restored memory agree, and so do the next
    logits."""
    from reference.context import Context

    def make():
        return Context(HP, W32, n_ctx=768, n_ubatch=4, n_seq_max=3, kv_unified=False)

    src = make()
    assert src.decode(Batch(token=[0], seq_id=[[0]], logits=[True])) == 0
    src.memory.seq_add(0, 0, -1, -1)  # position 0 -> -1: the cell is freed
    assert src.memory.v_cells[0].get_has_shift()  # llama.cpp's flag: set
    assert not src.memory.get_has_shift()  # nothing left to turn
    dst = make()
    assert dst.decode(Batch(token=[1, 2, 3])) == 0
    dst.state_set_data(src.state_get_data())
    assert dst.memory.get_has_shift() == src.memory.get_has_shift()
    assert dst.state_get_data() == src.state_get_data()
    go_on = Batch(token=[5, 6, 7], seq_id=[[0], [1], [2]], logits=[True] * 3)
    assert src.decode(go_on) == 0 and dst.decode(go_on) == 0
    assert src.get_logits().tobytes() == dst.get_logits().tobytes()
    assert not src.memory.v_cells[0].get_has_shift()  # the update forgot the flag


def test_cancelled_shift_is_not_pending():
    cache = KVCache(HP, kv_size=32)
    decode(cache, W32, HP, [3, 9, 4], [0, 0, 0])
    cache.seq_add(0, 1, -1, 2)
    assert cache.get_has_shift()
    cache.seq_add(0, 3, -1, -2)  # back where they were: shift 0
    assert not cache.get_has_shift() and cache.update() is False


# ---------------------------------------------------------------------------------------------
# the byte layout, written by hand from state_write's table; crafted blobs (checksum valid)
# ---------------------------------------------------------------------------------------------

HP_SMALL = tiny_hparams(n_layer=1, n_embd=8, n_head=2, n_head_kv=1)  # rows of 4 elements


def hand_blob(cells, k, v, *, hp=HP_SMALL, seq_id=-1, n_stream=1, k_type=0, v_type=0,
              v_trans=0, layers=None, extra=b"", arch=None, fields=None, more=()) -> bytes:
    """A memory blob written field by field as ``state_write``'s docstring lays it out:
    stream 0 holds ``cells`` ``[(pos, shift, seq_ids)]`` and the f32 rows ``k`` and ``v``
    ``(cell_count, width)`` of one layer, the streams of ``more`` (each ``(cells, k, v)``)
    come next, the others hold nothing. ``layers`` replaces stream 0's layer blocks
    ``[(type, size_row, rows)]``; ``fields`` sets a u32 as written (``n_stream``,
    ``cell_count``, ``n_seq_id``, ``n_layer``: a value no writer writes); ``extra`` goes
    before the checksum."""
    from reference.memory.blob import BlobWriter, seal
    from reference.memory.state import hparams_fingerprint

    fields = fields or {}
    body = BlobWriter()
    body.write_string(hp.arch if arch is None else arch)
    body.write_bytes(hparams_fingerprint(hp))
    body.write("iiIi", k_type, v_type, fields.get("n_stream", n_stream), seq_id)
    for i, (cells_s, k_s, v_s) in enumerate([(cells, k, v), *more]):
        body.write("I", fields.get("cell_count", len(cells_s)) if i == 0 else len(cells_s))
        if not cells_s:
            continue
        for pos, shift, ids in cells_s:
            body.write("iIi", pos, fields.get("n_seq_id", len(ids)), shift)
            for s in ids:
                body.write("i", s)
        blocks = layers if layers is not None and i == 0 else [
            (0, 4 * r.shape[1], r) for r in (np.float32(k_s), np.float32(v_s))]
        body.write("II", v_trans, fields.get("n_layer", len(blocks) // 2))
        for t, size_row, rows in blocks:
            body.write("iQ", t, size_row)
            body.write_bytes(np.ascontiguousarray(rows).tobytes())
    for _ in range(n_stream - 1 - len(more)):
        body.write("I", 0)
    body.write_bytes(extra)
    return seal(b"LRKV", 1, body.getvalue())


def ragged_cache(**kwargs) -> KVCache:
    """Cells ``0: (0, {0})``, a hole, ``2: (2, {0, 1})``, ``3: pos 3 of {2}, shift 3``; key
    row ``i`` is ``i, i + .25, ...``, value rows the negatives."""
    cache = KVCache(HP_SMALL, kv_size=8, n_seq_max=3, **kwargs)
    ub = _ubatch([0, 1, 2, 0], [0, 0, 0, 2])
    cache.apply_ubatch(cache.prepare([ub])[0], ub)
    cache.k_l[0][0, :4] = np.arange(16).reshape(4, 4) / 4
    cache.v_l[0][0, :4] = -cache.k_l[0][0, :4]
    cache.seq_rm(0, 1, 2)  # the hole: cell 1
    cache.seq_cp(0, 1, 2, -1)  # cell 2 shared
    cache.seq_add(2, 0, -1, 3)  # cell 3 moved, its K-shift pending
    return cache


def test_blob_bytes_are_the_documented_layout():
    """Whole and per-sequence blobs are byte for byte the table of ``state_write``: the
    non-empty cells in cell order with their shift and sorted ids (one id for a sequence),
    then ``v_trans = 0``, ``n_layer``, each layer's type, row size and rows; parsed back field
    by field; a restore compacts them and writes the same bytes again."""
    cache = ragged_cache()
    k, v = cache.k_l[0][0], cache.v_l[0][0]
    whole = state_write(cache, HP_SMALL)
    assert whole == hand_blob([(0, 0, (0,)), (2, 0, (0, 1)), (3, 3, (2,))], k[[0, 2, 3]],
                              v[[0, 2, 3]])
    assert state_write(cache, HP_SMALL, seq_id=0) == hand_blob(
        [(0, 0, (0,)), (2, 0, (0,))], k[[0, 2]], v[[0, 2]], seq_id=0)
    assert state_write(cache, HP_SMALL, seq_id=2) == hand_blob(
        [(3, 3, (2,))], k[[3]], v[[3]], seq_id=2)
    assert state_write(cache, HP_SMALL, seq_id=1) == hand_blob(
        [(2, 0, (1,))], k[[2]], v[[2]], seq_id=1)
    empty = hand_blob([], None, None, seq_id=0)
    assert state_write(KVCache(HP_SMALL, kv_size=8, n_seq_max=3), HP_SMALL, seq_id=0) == empty
    emptied = ragged_cache()
    state_read(emptied, HP_SMALL, empty, dest_seq_id=0)  # an empty sequence empties dest_seq_id
    assert cell_table(emptied) == [(2, (1,)), (3, (2,))]

    state = state_parse(whole)
    assert (state.arch, state.k_type, state.v_type, state.n_stream, state.seq_id) == (
        "llama", 0, 0, 1, -1)
    from reference.memory.state import hparams_fingerprint
    assert state.fingerprint == hparams_fingerprint(HP_SMALL)
    (st,) = state.streams
    assert (st.cell_count, st.pos, st.shift, st.seq_ids) == (3, [0, 2, 3], [0, 0, 3],
                                                             [(0,), (0, 1), (2,)])
    assert [r.tobytes() for r in st.k + st.v] == [k[[0, 2, 3]].tobytes(), v[[0, 2, 3]].tobytes()]
    assert st.k[0].dtype == np.float32 and st.k[0].shape == (3, 4)

    fresh = KVCache(HP_SMALL, kv_size=8, n_seq_max=3)
    state_read(fresh, HP_SMALL, whole)
    c = fresh.v_cells[0]
    assert cell_table(fresh) == [(0, (0,)), (2, (0, 1)), (3, (2,))]
    assert c.pos[:4].tolist() == [0, 2, 3, -1]  # compacted
    assert [c.get_shift(i) for i in range(3)] == [0, 0, 3] and fresh.get_has_shift()
    assert fresh.k_l[0][0, :3].tobytes() == k[[0, 2, 3]].tobytes()
    assert fresh.v_l[0][0, :3].tobytes() == v[[0, 2, 3]].tobytes()
    assert not fresh.k_l[0][0, 3:].any() and fresh.v_heads == [0]
    assert state_write(fresh, HP_SMALL) == whole


ROW = np.zeros((1, 4), np.float32)
TRUNCATED = r"state blob truncated at byte \d+: {} bytes needed at offset \d+"  # (a pattern)
#: name: (hand_blob's arguments, dest_seq_id, the whole message); the checksum is valid, so
#: each blob reaches the rule it breaks; the target is ragged_cache() (8 cells, 3 sequences)
CRAFTED = {
    "unknown row type": (dict(cells=[], k=None, v=None, k_type=99),
                         -1, "unsupported row type ggml type 99"),
    "unknown value type": (dict(cells=[], k=None, v=None, v_type=99),
                           -1, "unsupported row type ggml type 99"),
    "too many seq ids": (dict(cells=[(0, 0, range(2**16 + 1))], k=ROW, v=ROW),
                         -1, "a cell lists 65537 sequences"),
    "transposed V": (dict(cells=[(0, 0, (0,))], k=ROW, v=ROW, v_trans=1),
                     -1, "transposed V rows (v_trans = 1) are not supported"),
    "key type": (dict(cells=[(0, 0, (0,))], k=None, v=None,
                      layers=[(1, 8, ROW.astype(np.float16)), (0, 16, ROW)]),
                 -1, "layer 0 key rows are float16 (ggml type 1), the header says float32 "
                     "(ggml type 0)"),
    "value row size": (dict(cells=[(0, 0, (0,))], k=None, v=None,
                            layers=[(0, 16, ROW), (0, 15, ROW)]),
                       -1, "layer 0 value row size 15 is not a whole number of float32 "
                           "elements"),
    "bytes left": (dict(cells=[(0, 0, (0,))], k=ROW, v=ROW, extra=b"\0\0"),
                   -1, "state blob has 2 unread bytes before its checksum"),
    "too many cells": (dict(cells=[(i, 0, (0,)) for i in range(9)], k=np.zeros((9, 4)),
                            v=np.zeros((9, 4))),
                       -1, "does not fit: stream 0 needs 9 cells, the cache has 8"),
    "two layers": (dict(cells=[(0, 0, (0,))], k=None, v=None, layers=[(0, 16, ROW)] * 4),
                   -1, "blob has 2 layers, the cache 1"),
    "key width": (dict(cells=[(0, 0, (0,))], k=np.zeros((1, 8)), v=ROW),
                  -1, "layer 0: rows of 8/4 elements (K/V), the cache holds 4/4"),
    "value width": (dict(cells=[(0, 0, (0,))], k=ROW, v=np.zeros((1, 2))),
                    -1, "layer 0: rows of 4/2 elements (K/V), the cache holds 4/4"),
    "negative position": (dict(cells=[(0, 0, (0,)), (-1, 0, (0,))], k=np.zeros((2, 4)),
                               v=np.zeros((2, 4))),
                          -1, "stream 0 cell 1: position -1 < 0"),
    "no seq id": (dict(cells=[(0, 0, ())], k=ROW, v=ROW),
                  -1, "stream 0 cell 0: sequence ids () not ascending and unique"),
    "seq ids descending": (dict(cells=[(0, 0, (0,)), (1, 0, (1, 0))], k=np.zeros((2, 4)),
                                v=np.zeros((2, 4))),
                           -1, "stream 0 cell 1: sequence ids (1, 0) not ascending and unique"),
    "seq id twice": (dict(cells=[(0, 0, (1, 1))], k=ROW, v=ROW),
                     -1, "stream 0 cell 0: sequence ids (1, 1) not ascending and unique"),
    "seq id out of range": (dict(cells=[(0, 0, (0, 3))], k=ROW, v=ROW),
                            -1, "stream 0 cell 0: seq_id 3 out of range [0, 3)"),
    "seq id below 0": (dict(cells=[(0, 0, (-1,))], k=ROW, v=ROW),
                       -1, "stream 0 cell 0: seq_id -1 out of range [0, 3)"),
    "another seq's cell": (dict(cells=[(0, 0, (1,))], k=ROW, v=ROW, seq_id=2),
                           0, "stream 0 cell 0: sequence ids (1,) in a blob of sequence 2"),
    "a shared cell": (dict(cells=[(0, 0, (1, 2))], k=ROW, v=ROW, seq_id=2),
                      0, "stream 0 cell 0: sequence ids (1, 2) in a blob of sequence 2"),
    "another architecture": (dict(cells=[], k=None, v=None, arch="qwen2"),
                             -1, "blob written for architecture 'qwen2', this model is 'llama'"),
    "f16 cache": (dict(cells=[], k=None, v=None, k_type=1, v_type=1),
                  -1, "cache dtype mismatch: blob K float16 (ggml type 1), V float16 (ggml "
                      "type 1); this cache float32 (ggml type 0)"),
    "f16 values": (dict(cells=[], k=None, v=None, v_type=1),
                   -1, "cache dtype mismatch: blob K float32 (ggml type 0), V float16 (ggml "
                       "type 1); this cache float32 (ggml type 0)"),
    "two streams": (dict(cells=[], k=None, v=None, n_stream=2),
                    -1, "n_stream mismatch: blob 2, cache 1"),
    "whole into a sequence": (dict(cells=[], k=None, v=None),
                              1, "blob holds the whole memory: restore it with dest_seq_id -1"),
    "sequence as whole": (dict(cells=[], k=None, v=None, seq_id=2),
                          -1, "blob holds sequence 2: restore it with dest_seq_id >= 0"),
    "dest below 0": (dict(cells=[], k=None, v=None, seq_id=2),
                     -2, "dest_seq_id=-2 out of range [0, 256) or -1"),
    "dest too large": (dict(cells=[], k=None, v=None, seq_id=2),
                       256, "dest_seq_id=256 out of range [0, 256) or -1"),
    # u32 fields at values no writer writes (beyond int32): read as unsigned, never negative
    "n_stream 2**32 - 1": (dict(cells=[], k=None, v=None, fields=dict(n_stream=2**32 - 1)),
                           -1, TRUNCATED.format(4)),
    "cell_count 2**32 - 1": (dict(cells=[(0, 0, (0,))], k=ROW, v=ROW,
                                  fields=dict(cell_count=2**32 - 1)), -1, TRUNCATED.format(12)),
    "n_seq_id 2**32 - 1": (dict(cells=[(0, 0, (0,))], k=ROW, v=ROW,
                                fields=dict(n_seq_id=2**32 - 1)),
                           -1, "a cell lists 4294967295 sequences"),
    "n_layer 2**32 - 1": (dict(cells=[(0, 0, (0,))], k=ROW, v=ROW,
                               fields=dict(n_layer=2**32 - 1)), -1, TRUNCATED.format(12)),
    "key type -1": (dict(cells=[(0, 0, (0,))], k=None, v=None,
                         layers=[(-1, 16, ROW), (0, 16, ROW)]),
                    -1, "layer 0 key rows are ggml type -1, the header says float32 (ggml type 0)"),
    "row size 2**63 + 16": (dict(cells=[(0, 0, (0,))], k=None, v=None,
                                 layers=[(0, 2**63 + 16, ROW), (0, 16, ROW)]),
                            -1, TRUNCATED.format(2**63 + 16)),
    "65536 seq ids are listed": (dict(cells=[(0, 0, range(2**16))], k=ROW, v=ROW),
                                 -1, "stream 0 cell 0: seq_id 3 out of range [0, 3)"),
    "no room": (dict(cells=[(i, 0, (2,)) for i in range(7)], k=np.zeros((7, 4)),
                     v=np.zeros((7, 4)), seq_id=2),
                0, "does not fit: sequence needs 7 cells, stream 0 has 5 free (+2 of sequence 0 "
                   "it replaces)"),
}


@pytest.mark.parametrize("name", CRAFTED)
def test_refuses_crafted_blobs_with_their_exact_message(name):
    """A blob that passes the checksum but breaks one rule of ``state_parse`` /
    ``state_check`` / the slot search: ``StateError`` with exactly its message, the memory
    unchanged (its pending shift, hole and shared cell included)."""
    kwargs, dest, message = CRAFTED[name]
    target = ragged_cache()
    pattern = message if "truncated" in message else re.escape(message)
    _refused(target, HP_SMALL, hand_blob(**kwargs), f"^{pattern}$", dest)
    assert cell_table(target) == [(0, (0,)), (2, (0, 1)), (3, (2,))]


def test_refusals_say_exactly_why_and_a_full_cache_restores():
    """The messages of ``state_write`` and ``state_check`` word for word; a sequence blob
    with cells in two streams is refused; a blob exactly as large as the cache restores."""
    from reference.memory.state import hparams_fingerprint

    def exactly(message: str) -> str:
        return f"^{re.escape(message)}$"

    cache = ragged_cache()
    for seq_id in (256, -2):
        with pytest.raises(StateError, match=exactly(f"seq_id={seq_id} out of range [0, 256) "
                                                     "or -1")):
            state_write(cache, HP_SMALL, seq_id=seq_id)
    with pytest.raises(StateError, match=exactly("hparams are not those of this memory")):
        state_write(cache, tiny_hparams())
    whole = state_write(cache, HP_SMALL)
    _refused(cache, tiny_hparams(), whole, exactly("hparams are not those of this memory"))
    _refused(cache, HP_SMALL, whole[:10],
             exactly("state blob truncated at byte 10: the header needs 16 bytes"))
    other = dataclasses.replace(HP_SMALL, rope_freq_base_train=5e5)
    fp_blob, fp = hand_blob([], None, None, hp=other), hparams_fingerprint
    _refused(cache, HP_SMALL, state_write(KVCache(other, kv_size=8), other), exactly(
        f"blob written for other hyperparameters (fingerprint {fp(other).hex()[:16]}..., "
        f"this model {fp(HP_SMALL).hex()[:16]}...): another model"))
    assert state_write(KVCache(other, kv_size=8, n_seq_max=3), other) == fp_blob

    split = KVCache(HP_SMALL, kv_size=8, n_seq_max=2, kv_unified=False)  # seq s in stream s
    two = hand_blob([(0, 0, (0,))], ROW, ROW, seq_id=0, n_stream=2,
                    more=[([(1, 0, (0,))], ROW, ROW)])
    _refused(split, HP_SMALL, two, exactly("a sequence blob with cells in more than one stream"),
             dest_seq_id=0)
    wrong = hand_blob([(0, 0, (1,))], ROW, ROW, n_stream=2)  # seq 1 lives in stream 1
    _refused(split, HP_SMALL, wrong, exactly("stream 0 cell 0: seq_id 1 lives in stream 1"))
    # the cells go to dest_seq_id's stream, whichever stream the blob holds them in
    moved = hand_blob([], None, None, seq_id=1, n_stream=2, more=[([(5, 0, (1,))], ROW, ROW)])
    state_read(split, HP_SMALL, moved, dest_seq_id=0)
    assert cell_table(split, 0) == [(5, (0,))] and cell_table(split, 1) == []
    moved = hand_blob([(5, 0, (1,))], ROW, ROW, seq_id=1, n_stream=2)
    state_read(split, HP_SMALL, moved, dest_seq_id=1)
    assert cell_table(split, 1) == [(5, (1,))]

    full = hand_blob([(i, 0, (0,)) for i in range(8)], np.ones((8, 4)), np.ones((8, 4)))
    state_read(cache, HP_SMALL, full)
    assert cache.seq_pos_max(0) == 7 and cache.v_cells[0].get_used() == 8
    assert state_write(cache, HP_SMALL) == full


def test_restores_are_independent_of_what_the_memory_held():
    """A whole restore leaves the memory as a restore into a fresh cache (the rows of the
    cells it frees are zeroed, as llama.cpp's ``clear(true)``); a sequence restore first
    applies the pending stream copies (``seq_cp`` across streams), then writes its rows."""
    whole = state_write(ragged_cache(), HP_SMALL)
    used, fresh = ragged_cache(), KVCache(HP_SMALL, kv_size=8, n_seq_max=3)
    used.k_l[0][0] = used.v_l[0][0] = 9.0  # every cell, the empty ones too
    state_read(used, HP_SMALL, whole)
    state_read(fresh, HP_SMALL, whole)
    assert_same(snapshot(used), snapshot(fresh))

    split = KVCache(HP_SMALL, kv_size=8, n_seq_max=2, kv_unified=False)
    ub = _ubatch([0, 1], [0, 0])
    split.apply_ubatch(split.prepare([ub])[0], ub)
    split.k_l[0][0, :2] = split.v_l[0][0, :2] = [[1.0], [2.0]]
    split.seq_cp(0, 1, -1, -1)  # stream 0 -> 1: the rows are copied at the next update
    assert split.sc_info == [(0, 1)]
    rows = np.full((1, 4), 5.0)
    state_read(split, HP_SMALL, hand_blob([(7, 0, (0,))], rows, rows, seq_id=0, n_stream=2),
               dest_seq_id=0)
    assert split.sc_info == [] and cell_table(split, 1) == [(0, (1,)), (1, (1,))]
    for t in (split.k_l[0], split.v_l[0]):
        assert t[1, :2].tolist() == [[1.0] * 4, [2.0] * 4]  # the copy, done first
        assert t[0, np.flatnonzero(split.v_cells[0].seq[:, 0])].tolist() == [[5.0] * 4]


def test_prepare_checks_everything_and_changes_nothing():
    """``state_prepare`` (what a memory of several caches runs on each part before it applies
    any): the slot search of a sequence blob, tried and undone; a whole blob changes no
    stream of a cache with one stream per sequence."""
    from reference.memory.state import state_prepare

    split = KVCache(HP_SMALL, kv_size=8, n_seq_max=2, kv_unified=False)
    ub = _ubatch([0, 1, 0, 1], [0, 0, 1, 1])
    for sinfo, u in zip(split.prepare([ub]), [ub], strict=True):
        split.apply_ubatch(sinfo, u)
    before = snapshot(split)
    state_prepare(split, HP_SMALL, state_write(split, HP_SMALL))
    assert_same(before, snapshot(split))
    cache = ragged_cache()
    before = snapshot(cache)
    seven = hand_blob([(i, 0, (1,)) for i in range(7)], np.zeros((7, 4)), np.zeros((7, 4)),
                      seq_id=1)
    message = ("does not fit: sequence needs 7 cells, stream 0 has 5 free (+1 of sequence 1 it "
               "replaces)")  # seq 1's cell stays: seq 0 holds it too
    with pytest.raises(StateError, match=f"^{re.escape(message)}$"):
        state_prepare(cache, HP_SMALL, seven, 1)
    assert_same(before, snapshot(cache))
    six = hand_blob([(i, 0, (1,)) for i in range(6)], np.zeros((6, 4)), np.zeros((6, 4)),
                    seq_id=1)
    state_read(cache, HP_SMALL, six, 0)  # fits: 5 free + cell 0, which only seq 0 held
    assert (cache.seq_pos_min(0), cache.seq_pos_max(0), cache.v_cells[0].get_used()) == (0, 5, 8)


# ---------------------------------------------------------------------------------------------
# the bytes of a blob (reference/memory/blob.py): the frame, the reader, tokens, files
# ---------------------------------------------------------------------------------------------


def _frame(version: int = 3, total: int | None = None, body: bytes = b"") -> bytes:
    """A header ``TEST | version | total`` and ``body``, with no checksum of its own."""
    head = b"TEST" + struct.pack("<IQ", version, 48 + len(body) if total is None else total)
    return head + body


def test_unseal_names_the_first_fault_of_a_frame():
    """``magic | version | total size | body | sha256``: a blob is checked in that order,
    each fault refused by its whole message; a frame of exactly 48 bytes (an empty body)
    and a body read to its last byte are fine."""
    from reference.memory.blob import seal, unseal

    blob = seal(b"TEST", 3, b"abc")
    assert len(blob) == 51 and blob[:16] == _frame(body=b"abc")[:16]
    io = unseal(blob, b"TEST", 3, "test blob")
    assert io.read_bytes(3) == b"abc" and io.off == len(io.data) == 3
    assert unseal(seal(b"TEST", 3, b""), b"TEST", 3, "test blob").data.nbytes == 0
    flipped = blob[:20] + bytes([blob[20] ^ 1]) + blob[21:]
    short = _frame(total=47, body=bytes(31))  # 47 bytes that say 47: no room for the checksum
    cases = [
        (blob[:15], "test blob truncated at byte 15: the header needs 16 bytes"),
        (blob[:16], "test blob truncated at byte 16: the header says 51 bytes"),
        (b"TESU" + blob[4:], "bad magic b'TESU': not a test blob (expected b'TEST')"),
        (seal(b"TEST", 4, b"abc"), "test blob format version 4 (written by a newer llamaref): "
                                   "this reader knows version 3"),
        (seal(b"TEST", 2, b"abc"), "test blob format version 2: this reader knows version 3"),
        (blob[:-1], "test blob truncated at byte 50: the header says 51 bytes"),
        (blob + b"\0\0", "test blob has 2 bytes after its end (51 bytes)"),
        (short, "test blob size 47 is smaller than its header and checksum"),
        (flipped, "test blob checksum mismatch: the bytes are corrupted"),
        # version and size are unsigned (u32, u64): a top bit set is a large number
        (seal(b"TEST", 2**32 - 1, b""), "test blob format version 4294967295 (written by a "
                                        "newer llamaref): this reader knows version 3"),
        (_frame(total=2**63 + 51, body=b"abc"),
         f"test blob truncated at byte 19: the header says {2**63 + 51} bytes"),
    ]
    for data, message in cases:
        with pytest.raises(StateError, match=f"^{re.escape(message)}$"):
            unseal(data, b"TEST", 3, "test blob")


def test_the_reader_refuses_a_read_past_the_end_by_name():
    """``llama_io_read_buffer``'s "unexpectedly reached end of buffer", with where: the
    body's length, the bytes asked, the offset. Reading to the last byte is fine."""
    from reference.memory.blob import BlobReader, BlobWriter

    io = BlobWriter()
    io.write("Ii", 7, -7)
    io.write_string("né")
    io.write_array(np.arange(3, dtype=">i4"))  # big-endian in, little-endian out
    data = io.getvalue()
    assert data[8:15] == b"\x03\x00\x00\x00n\xc3\xa9" and data[15:19] == b"\x00" * 4
    rd = BlobReader(data, "test blob")
    assert rd.read("Ii") == (7, -7) and rd.read_string() == "né"
    a = rd.read_array(np.dtype(np.int32), (3,))
    assert a.tolist() == [0, 1, 2] and a.dtype == np.int32 and rd.off == len(data)
    assert rd.read_bytes(0) == b""
    for n in (1, -1):
        with pytest.raises(StateError, match=f"^test blob truncated at byte 27: {n} bytes "
                                             "needed at offset 27$"):
            rd.read_bytes(n)
    bad = BlobReader(struct.pack("<I", 2) + b"\xff\xfe", "test blob")
    assert bad.read_string() == "\ufffd\ufffd"  # invalid UTF-8 is replaced, not an error
    huge = BlobReader(struct.pack("<I", 2**31) + b"ab", "test blob")  # a u32 length
    with pytest.raises(StateError, match="^test blob truncated at byte 6: 2147483648 bytes "
                                         "needed at offset 4$"):
        huge.read_string()


def test_state_file_tokens_are_int32():
    """A state file stores its tokens as int32 (``llama_token``): every int32 is kept,
    anything beyond is refused; the tokens are flattened."""
    from reference.memory.blob import check_tokens

    assert check_tokens([-2**31, 2**31 - 1]).tolist() == [-2**31, 2**31 - 1]
    assert check_tokens([[1, 2], [3, 4]]).tolist() == [1, 2, 3, 4]
    assert check_tokens([]).size == 0
    for tokens in ([], np.array([5, 6], dtype=np.int32), [np.uint8(7)]):
        assert check_tokens(tokens).dtype == np.int64
    for bad in ([2**31], [-2**31 - 1], [0, 2**31], [2**63], [-2**70], ["7a"]):
        with pytest.raises(StateError, match="^token ids must fit an int32$"):
            check_tokens(bad)


def test_row_types_are_ggml_types():
    from reference.memory.blob import ggml_type_name, ggml_type_of

    assert [ggml_type_of(t) for t in (np.float32, np.float16, np.float64)] == [0, 1, 28]
    with pytest.raises(StateError, match=r"^cache dtype int32 has no ggml type here "
                                         r"\(float32, float16, float64\)$"):
        ggml_type_of(np.int32)
    assert ggml_type_name(1) == "float16 (ggml type 1)" and ggml_type_name(2) == "ggml type 2"


def test_a_file_is_replaced_through_a_temporary_file_beside_it(tmp_path, monkeypatch):
    """The temporary file is in the target's folder (so the rename never crosses file
    systems, whatever the system's temporary folder), and nothing of it stays: on success
    it is the file, on failure it is removed and the old file is left as it was."""
    from reference.memory.blob import write_atomic

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "no such folder"))
    path = tmp_path / "state.bin"
    write_atomic(path, b"old")
    write_atomic(path, b"new")
    assert path.read_bytes() == b"new" and [p.name for p in tmp_path.iterdir()] == ["state.bin"]
    (tmp_path / "a folder").mkdir()
    with pytest.raises(OSError):
        write_atomic(tmp_path / "a folder", b"x")  # a rename over a folder fails
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a folder", "state.bin"]
    assert list((tmp_path / "a folder").iterdir()) == [] and path.read_bytes() == b"new"
