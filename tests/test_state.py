"""State save/restore (reference/memory/state.py): round trips, continuation, refusals.

The laws:
- a blob round trip is byte-identical: write, read into a fresh cache, write again;
- save, clear, restore, continue == continue uninterrupted (the next logits), for the whole
  memory (unified and per-sequence streams) and for one sequence restored under another id
  into a fragmented cache;
- a refused blob (another model, another dtype, truncated, corrupted, no room) leaves the
  memory bit-identical.
"""

from __future__ import annotations

import copy
import dataclasses
import struct
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
from tests.tiny_models import random_weights, tiny_hparams

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
    cells = [(list(c.pos), [set(s) for s in c.seq], list(c.shift), c.has_shift, set(c.used),
              copy.deepcopy(c.seq_pos)) for c in cache.v_cells]
    return (cells, list(cache.v_heads), list(cache.sc_info),
            [t.copy() for t in cache.k_l], [t.copy() for t in cache.v_l])


def assert_same(a, b) -> None:
    assert a[:3] == b[:3]
    for x, y in zip(a[3] + a[4], b[3] + b[4], strict=True):
        assert x.tobytes() == y.tobytes()


def cell_table(cache: KVCache, stream: int = 0) -> list[tuple[int, tuple[int, ...]]]:
    c = cache.v_cells[stream]
    return [(c.pos[i], tuple(sorted(c.seq[i]))) for i in range(c.size()) if c.pos[i] != -1]


HP = tiny_hparams(n_layer=2)
W32 = random_weights(HP, seed=1)
W64 = random_weights(HP, seed=1, dtype=np.float64)

# two sequences of different lengths, interleaved in one batch
PREFIX_TOKENS = [3, 9, 4, 1, 7, 2, 5, 8]
PREFIX_SEQS = [0, 1, 0, 1, 0, 1, 0, 0]


# ---------------------------------------------------------------------------------------------
# save, clear, restore, continue == uninterrupted
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kv_unified", [True, False])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_whole_save_clear_restore_continue(kv_unified, dtype):
    w = W32 if dtype == np.float32 else W64
    cache = KVCache(HP, kv_size=32, n_seq_max=2, kv_unified=kv_unified, dtype=dtype)
    decode(cache, w, HP, PREFIX_TOKENS, PREFIX_SEQS)
    uninterrupted = copy.deepcopy(cache)
    expected = decode(uninterrupted, w, HP, [6, 11], [0, 1])

    blob = state_write(cache, HP)
    cache.clear()
    assert cache.seq_pos_max(0) == -1
    state_read(cache, HP, blob)
    assert state_write(cache, HP) == blob  # byte-identical round trip
    got = decode(cache, w, HP, [6, 11], [0, 1])
    assert got.tobytes() == expected.tobytes()  # bit-exact


def test_whole_restore_compacts_a_fragmented_cache():
    cache = KVCache(HP, kv_size=32, n_seq_max=2)
    decode(cache, W64 if cache.dtype == np.float64 else W32, HP, PREFIX_TOKENS, PREFIX_SEQS)
    cache.seq_rm(0, 1, 3)  # holes
    before = cell_table(cache)
    fresh = KVCache(HP, kv_size=32, n_seq_max=2)
    state_read(fresh, HP, state_write(cache, HP))
    c = fresh.v_cells[0]
    assert cell_table(fresh) == before  # same cells, same order
    assert sorted(c.used) == list(range(len(before)))  # at 0..n-1
    assert fresh.seq_pos_min(0) == cache.seq_pos_min(0)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_seq_restore_into_another_id_of_a_fragmented_cache(dtype):
    w = W32 if dtype == np.float32 else W64
    cache = KVCache(HP, kv_size=32, n_seq_max=4, dtype=dtype)
    # three sequences interleaved: the cells of each are scattered
    decode(cache, w, HP, [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11],
           [0, 1, 2, 0, 1, 2, 0, 1, 1, 0, 1])
    uninterrupted = copy.deepcopy(cache)
    expected = decode(uninterrupted, w, HP, [12], [1])

    blob = state_write(cache, HP, seq_id=1)
    cache.seq_rm(1, -1, -1)
    cache.seq_rm(0, 1, 3)  # more holes
    decode(cache, w, HP, [13, 14], [2, 2])  # the holes before the head get reused
    state_read(cache, HP, blob, dest_seq_id=3)
    idxs = sorted(i for i, s in enumerate(cache.v_cells[0].seq) if 3 in s)
    assert idxs != list(range(idxs[0], idxs[0] + len(idxs)))  # really not contiguous
    assert (cache.seq_pos_min(3), cache.seq_pos_max(3)) == (0, 4)
    assert cache.seq_pos_max(1) == -1
    got = decode(cache, w, HP, [12], [3])
    # the same cells at other indices: the attention sums the same terms in another order
    # (exact zeros of the masked cells fall elsewhere), so float32 agrees to rounding only
    tol = 1e-12 if dtype == np.float64 else 1e-5
    np.testing.assert_allclose(got, expected, rtol=tol, atol=tol)
    assert state_write(cache, HP, seq_id=3) != blob  # it says seq 3 now ...
    fresh = KVCache(HP, kv_size=32, n_seq_max=4, dtype=dtype)
    state_read(fresh, HP, blob, dest_seq_id=1)
    assert state_write(fresh, HP, seq_id=1) == blob  # ... and round trips under seq 1


def test_seq_restore_into_another_stream():
    cache = KVCache(HP, kv_size=32, n_seq_max=2, kv_unified=False)
    decode(cache, W32, HP, PREFIX_TOKENS, PREFIX_SEQS)
    expected = decode(copy.deepcopy(cache), W32, HP, [6], [0])
    blob = state_write(cache, HP, seq_id=0)
    assert [st.cell_count for st in state_parse(blob).streams] == [5, 0]
    fresh = KVCache(HP, kv_size=32, n_seq_max=2, kv_unified=False)
    state_read(fresh, HP, blob, dest_seq_id=1)  # stream 0 -> stream 1
    assert fresh.seq_pos_max(0) == -1 and fresh.seq_pos_max(1) == 4
    assert decode(fresh, W32, HP, [6], [1]).tobytes() == expected.tobytes()


def test_pending_k_shift_is_saved():
    cache = KVCache(HP, kv_size=32, n_seq_max=2)
    decode(cache, W32, HP, PREFIX_TOKENS, PREFIX_SEQS)
    cache.seq_rm(0, 0, 2)
    cache.seq_add(0, 2, -1, -2)  # pending until the next update()
    assert cache.get_has_shift()
    uninterrupted = copy.deepcopy(cache)
    expected = decode(uninterrupted, W32, HP, [6], [0])
    blob = state_write(cache, HP)
    fresh = KVCache(HP, kv_size=32, n_seq_max=2)
    state_read(fresh, HP, blob)
    assert fresh.get_has_shift()
    assert state_write(fresh, HP) == blob
    # whole restore compacts: the two freed cells are gone, so the layout differs
    np.testing.assert_allclose(decode(fresh, W32, HP, [6], [0]), expected, rtol=1e-5, atol=1e-5)


def test_pending_stream_copy_is_resolved_when_saving():
    cache = KVCache(HP, kv_size=32, n_seq_max=2, kv_unified=False)
    decode(cache, W32, HP, [3, 9, 4], [0, 0, 0])
    cache.seq_cp(0, 1, -1, -1)  # K/V copied at the next update()
    assert cache.sc_info
    uninterrupted = copy.deepcopy(cache)
    expected = decode(uninterrupted, W32, HP, [6, 7], [0, 1])
    fresh = KVCache(HP, kv_size=32, n_seq_max=2, kv_unified=False)
    state_read(fresh, HP, state_write(cache, HP))
    assert not fresh.sc_info
    got = decode(fresh, W32, HP, [6, 7], [0, 1])
    assert got.tobytes() == expected.tobytes()


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
