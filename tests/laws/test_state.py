"""State save/restore (reference/memory/state.py): round trips, continuation, refusals.

The laws:
- a blob round trip is byte-identical: write, read into a fresh cache, write again;
- save, clear, restore, continue == continue uninterrupted (the next logits), for the whole
  memory (unified and per-sequence streams, a pending K-shift, a pending stream copy) and
  for one sequence restored under another id or stream into a fragmented cache;
- across the twins: a state (bytes or file, whole or one sequence, of a cache made ragged
  on purpose, or of Mamba's state rows) written by one Context restores in every Context of
  its dtype, and the decode goes on the same way;
- a refused blob (another model, another dtype, truncated, corrupted, no room) leaves the
  memory bit-identical.

The Context-level laws run on every flavour of ``tests/support/helpers.py`` (reference float64 and
float32, MLX); the byte format, its refusals and the cell layout are checked on the
reference's ``KVCache`` directly.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import struct
import tempfile
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from reference.batch import Batch, BatchAllocr, Ubatch
from reference.memory import KVCache
from reference.memory.state import (
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
    ARCHS,
    N_VOCAB,
    assert_between,
    deep,
    every_flavour,
    interleave,
    llama_model,
    logits_ith,
    make,
    make_mamba,
    same_dtype,
)
from tests.support.helpers import assert_same as assert_same_ctx
from tests.support.helpers import snapshot as ctx_snapshot
from tests.support.tiny_models import random_weights, tiny_hparams

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
# save, clear, restore, continue == uninterrupted: every Context
# ---------------------------------------------------------------------------------------------


def state_ctx(flavour, kv_unified: bool = True, n_seq_max: int = N_SEQ):
    """A Context of the laws' tiny Llama with small ubatches, 256 cells per stream."""
    return make(flavour, n_ctx=256 * (1 if kv_unified else n_seq_max), n_ubatch=4,
                n_seq_max=n_seq_max, kv_unified=kv_unified)


def decode_batch(ctx, tokens, seq_ids) -> np.ndarray:
    """One batch, every token an output; its logits ``(n_tokens, n_vocab)`` in batch order."""
    batch = Batch(token=list(tokens), seq_id=[[s] for s in seq_ids], logits=[True] * len(tokens))
    assert ctx.decode(batch) == 0, ctx.last_error
    return ctx.get_logits().copy()


@every_flavour
@pytest.mark.parametrize("kv_unified", [True, False])
def test_whole_save_clear_restore_continue(flavour, kv_unified):
    """The cells come back where they were (0..n-1): the next logits are bit-exact."""
    cache, uninterrupted = state_ctx(flavour, kv_unified, 2), state_ctx(flavour, kv_unified, 2)
    for ctx in (cache, uninterrupted):
        decode_batch(ctx, PREFIX_TOKENS, PREFIX_SEQS)
    expected = decode_batch(uninterrupted, [6, 11], [0, 1])

    blob = cache.state_get_data()
    cache.memory.clear()
    assert cache.memory.seq_pos_max(0) == -1
    assert cache.state_set_data(blob) == len(blob)
    assert cache.state_get_data() == blob  # byte-identical round trip
    got = decode_batch(cache, [6, 11], [0, 1])
    assert got.tobytes() == expected.tobytes()  # bit-exact


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
# across the twins: a state written by one Context restores in every Context of its dtype
# ---------------------------------------------------------------------------------------------

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
    """Decode ``seqs`` interleaved in one batch, apply ``ops``; returns the batch's tokens."""
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


@every_flavour
@deep()
@given(seqs=st.lists(seq_tokens, min_size=1, max_size=N_SEQ),
       ops=st.lists(memory_op, max_size=3), kv_unified=st.booleans(), use_file=st.booleans())
def test_whole_state_crosses_and_continues(flavour, seqs, ops, kv_unified, use_file):
    """The whole memory (bytes or file) of a cache made ragged on purpose (sequences
    interleaved, holes from ``seq_rm``, cells shared by ``seq_cp``, a K-shift still pending
    from ``seq_add``), one stream or one per sequence, restores in a Context that held
    something else: the same bytes back, and the next logits agree (the law's bound within a
    flavour: a whole restore compacts the cells, so the attention sums run in another order;
    NMSE <= 1e-6 across the twins)."""
    a = state_ctx(flavour, kv_unified)
    tokens = fill(a, seqs, ops)
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "state.bin"
        if use_file:
            assert a.state_save_file(path, tokens) == path.stat().st_size
        blob = a.state_get_data()
        restored = []
        for f in same_dtype(flavour):
            b = state_ctx(f, kv_unified)
            fill(b, [[1, 2, 3]], [])  # not empty: the restore replaces everything
            if use_file:
                assert b.state_load_file(path).tolist() == tokens
            else:
                assert b.state_set_data(blob) == len(blob)
                np.testing.assert_array_equal(b.get_logits(), a.get_logits())
                for i in (0, -1):  # the restored rows, on the device too
                    np.testing.assert_array_equal(logits_ith(b, i), a.get_logits_ith(i))
            assert b.memory.get_has_shift() == a.memory.get_has_shift()
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


@every_flavour
@deep()
@given(seqs=st.lists(seq_tokens, min_size=2, max_size=N_SEQ), s=st.integers(0, N_SEQ - 1),
       hole=st.tuples(st.integers(-1, 6), st.integers(-1, 6)), kv_unified=st.booleans(),
       use_file=st.booleans())
def test_one_sequence_crosses_into_another_id(flavour, seqs, s, hole, kv_unified, use_file):
    """One sequence (bytes or file) restored under another id into a Context that already
    holds other sequences, with holes before its head; the decode goes on the same way."""
    s %= len(seqs)
    a = state_ctx(flavour, kv_unified, n_seq_max=N_SEQ + 1)  # a blob holds its stream count
    fill(a, seqs, [("seq_rm", s, *hole)])
    tokens = [1, 2, 3]
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "seq.bin"
        if use_file:
            a.state_seq_save_file(path, s, tokens)
        blob = a.state_seq_get_data(s)
        restored = []
        for f in same_dtype(flavour):
            b = state_ctx(f, kv_unified, n_seq_max=N_SEQ + 1)
            fill(b, [[7, 8, 9, 10], [11, 12]], [("seq_rm", 0, 1, 3)])  # holes before the head
            if use_file:
                assert b.state_seq_load_file(path, N_SEQ).tolist() == tokens
            else:
                assert b.state_seq_set_data(blob, N_SEQ) == len(blob)
            assert b.memory.seq_pos_min(N_SEQ) == a.memory.seq_pos_min(s)
            assert b.memory.seq_pos_max(N_SEQ) == a.memory.seq_pos_max(s)
            assert b.memory.seq_pos_max(0) == 3  # the other sequences are still there
            restored.append((f, b))
    assert a.decode(Batch(token=[4], seq_id=[[s]], logits=[True])) == 0
    for f, b in restored:
        assert b.decode(Batch(token=[4], seq_id=[[N_SEQ]], logits=[True])) == 0
        assert_between(flavour, f, a.get_logits(), b.get_logits())


@functools.cache
def refused_blobs(flavour) -> list[tuple[str, bytes, int | None]]:
    """(name, blob, dest_seq_id) triples a Context holding two sequences must refuse."""
    src = state_ctx(flavour)
    fill(src, [[1, 2, 3, 4], [5, 6]], [])
    whole, seq = src.state_get_data(), src.state_seq_get_data(0)
    other_hp, other_w = llama_model(1, flavour.dtype)  # another model: one layer
    other = flavour.make(other_hp, other_w, n_ctx=256, n_seq_max=N_SEQ)
    other.decode(Batch(token=[1, 2]))
    big = state_ctx(flavour)
    big.decode(Batch(token=list(range(N_VOCAB)) * 7))  # 224 cells: more than the target's room
    flipped = bytearray(whole)
    flipped[len(flipped) // 2] ^= 0xFF
    return [
        ("truncated", whole[:-1], None),
        ("truncated seq", seq[: len(seq) // 2], 2),
        ("corrupted", bytes(flipped), None),
        ("another model", other.state_get_data(), None),
        ("another model seq", other.state_seq_get_data(0), 2),
        ("does not fit", big.state_seq_get_data(0), 2),
    ]


@every_flavour
@pytest.mark.parametrize("case", range(6))
def test_refused_blob_leaves_the_memory_bit_identical(flavour, case):
    name, blob, dest = refused_blobs(flavour)[case]
    ctx = state_ctx(flavour)
    fill(ctx, [[9, 8, 7, 6, 5, 4, 3, 2, 1] * 4, [4, 5, 6]], [("seq_add", 0, 3, 2)])
    before = ctx_snapshot(ctx)
    with pytest.raises(StateError):
        if dest is None:
            ctx.state_set_data(blob)
        else:
            ctx.state_seq_set_data(blob, dest)
    assert_same_ctx(before, ctx_snapshot(ctx))
    assert ctx.memory.get_has_shift()  # the pending K-shift is still pending


@every_flavour
@deep()
@given(arch=st.sampled_from(ARCHS), seqs=st.lists(seq_tokens, min_size=1, max_size=N_SEQ),
       use_file=st.booleans(), one=st.booleans())
def test_mamba_state_crosses_and_continues(flavour, arch, seqs, use_file, one):
    """The recurrent memory's state rows: whole memory or one sequence (restored under
    another id), bytes or file, into every Context of the dtype; the decode goes on."""
    a = make_mamba(flavour, arch, n_seq_max=N_SEQ + 1)
    fill(a, seqs, [])
    dest = N_SEQ if one else 0
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "state.bin"
        if use_file and one:
            a.state_seq_save_file(path, 0, [1, 2])
        elif use_file:
            a.state_save_file(path, [1, 2])
        blob = a.state_seq_get_data(0) if one else a.state_get_data()
        restored = []
        for f in same_dtype(flavour):
            b = make_mamba(f, arch, n_seq_max=N_SEQ + 1)
            fill(b, [[9, 8], [7]], [])  # replaced (whole) or kept (one sequence)
            if use_file:
                got = b.state_seq_load_file(path, dest) if one else b.state_load_file(path)
                assert got.tolist() == [1, 2]
            elif one:
                assert b.state_seq_set_data(blob, dest) == len(blob)
            else:
                assert b.state_set_data(blob) == len(blob)
                assert b.state_get_data() == blob  # the rows came back bit for bit
                for i in (0, -1):  # the restored rows, on the device too
                    np.testing.assert_array_equal(logits_ith(b, i), a.get_logits_ith(i))
            assert b.memory.seq_pos_max(dest) == a.memory.seq_pos_max(0)
            if one:
                assert b.memory.seq_pos_max(1) == 0  # the other sequences are still there
            restored.append((f, b))
    assert a.decode(Batch(token=[4, 5], seq_id=[[0], [0]], logits=[True, True])) == 0
    for f, b in restored:
        assert b.decode(Batch(token=[4, 5], seq_id=[[dest], [dest]], logits=[True, True])) == 0
        assert_between(flavour, f, a.get_logits(), b.get_logits())


@every_flavour
@pytest.mark.parametrize("arch", ARCHS)
def test_mamba_refused_blob_leaves_the_rows_bit_identical(flavour, arch):
    src = make_mamba(flavour, arch)
    fill(src, [[1, 2, 3], [4]], [])
    whole, seq = src.state_get_data(), src.state_seq_get_data(0)
    other = state_ctx(flavour)  # a Llama context's blob
    fill(other, [[1, 2]], [])
    ctx = make_mamba(flavour, arch)
    fill(ctx, [[5, 6, 7, 8], [9]], [])
    before = ctx_snapshot(ctx)
    for blob, dest in ((whole[:-1], None), (seq[: len(seq) // 2], 2), (other.state_get_data(),
                       None), (other.state_seq_get_data(0), 2)):
        with pytest.raises(StateError):
            if dest is None:
                ctx.state_set_data(blob)
            else:
                ctx.state_seq_set_data(blob, dest)
        assert_same_ctx(before, ctx_snapshot(ctx))


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

    data = path.read_bytes()
    before = snapshot(fresh)
    for bad in (data[:-1], data[:20], b"LRKV" + data[4:]):
        path.write_bytes(bad)
        with pytest.raises(StateError):
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
