"""State save/restore across the twins: the laws of ``tests/test_state.py`` on MLX tensors.

A state written by one twin's Context restores in the other's (and in its own) and the
decode goes on as if uninterrupted:

- the whole memory (bytes and files) of a cache made ragged on purpose (several sequences
  interleaved, holes from ``seq_rm``, cells shared by ``seq_cp``, a K-shift still pending from
  ``seq_add``), in one stream or one stream per sequence; the restored state writes back the
  same bytes, and the next logits agree (NMSE <= 1e-6 across the twins, <= 1e-10 within one:
  a whole restore compacts the cells, so the attention sums run in another order);
- one sequence (bytes and files) restored under another id into a cache that already holds
  other sequences;
- a refused blob (truncated, corrupted, another model, a sequence that does not fit) raises
  :class:`reference.memory.state.StateError` and leaves the MLX tensors bit-identical;
- the same for Mamba and Mamba-2: the recurrent memory's MLX state rows, whole or one
  sequence, bytes or files, cross between the twins and the decode goes on.

``tests/test_twin_llama.py`` checks the simpler round trips (a plain two-sequence cache).
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from accelerated.context import Context as MLXContext
from reference.batch import Batch
from reference.context import Context as RefContext
from reference.memory.state import StateError
from tests.test_twin_properties import (
    ARCHS,
    N_VOCAB,
    SELF_TOL,
    TWIN_TOL,
    assert_close,
    assert_same,
    assert_same_mamba,
    make_mamba,
    mamba_snapshot,
    model,
    snapshot,
)
from tests.tiny_models import random_weights, tiny_hparams

N_SEQ = 3
CLASSES = {"reference": RefContext, "accelerated": MLXContext}


def make(cls, kv_unified: bool = True, n_seq_max: int = N_SEQ):
    hp, w = model(2)
    return cls(hp, w, n_ctx=256 * (1 if kv_unified else n_seq_max), n_ubatch=4,
               n_seq_max=n_seq_max, kv_unified=kv_unified)


def tol(a, b) -> float:
    return SELF_TOL if type(a) is type(b) else TWIN_TOL


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
    token, seq_id = [], []
    for k in range(max(map(len, seqs))):
        for s, t in enumerate(seqs):
            if k < len(t):
                token.append(t[k])
                seq_id.append([s])
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


@given(seqs=st.lists(seq_tokens, min_size=1, max_size=N_SEQ),
       ops=st.lists(memory_op, max_size=3), kv_unified=st.booleans(),
       src=st.sampled_from(list(CLASSES)), use_file=st.booleans())
def test_whole_state_crosses_and_continues(seqs, ops, kv_unified, src, use_file):
    a = make(CLASSES[src], kv_unified)
    tokens = fill(a, seqs, ops)
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "state.bin"
        if use_file:
            assert a.state_save_file(path, tokens) == path.stat().st_size
        blob = a.state_get_data()
        restored = []
        for cls in CLASSES.values():
            b = make(cls, kv_unified)
            fill(b, [[1, 2, 3]], [])  # not empty: the restore replaces everything
            if use_file:
                assert b.state_load_file(path).tolist() == tokens
            else:
                assert b.state_set_data(blob) == len(blob)
                np.testing.assert_array_equal(b.get_logits(), a.get_logits())
            assert b.memory.get_has_shift() == a.memory.get_has_shift()
            restored.append(b)
    for b in restored:
        if use_file:  # the file holds no logits: compare each sequence's cells and K/V
            for s in range(N_SEQ):
                assert b.state_seq_get_data(s) == a.state_seq_get_data(s)
        else:
            assert b.state_get_data() == blob  # the tensors came back bit for bit
    want = go_on(a)
    for b in restored:
        assert_close(want, go_on(b), tol(a, b))


@given(seqs=st.lists(seq_tokens, min_size=2, max_size=N_SEQ), s=st.integers(0, N_SEQ - 1),
       hole=st.tuples(st.integers(-1, 6), st.integers(-1, 6)), kv_unified=st.booleans(),
       src=st.sampled_from(list(CLASSES)), use_file=st.booleans())
def test_one_sequence_crosses_into_another_id(seqs, s, hole, kv_unified, src, use_file):
    s %= len(seqs)
    a = make(CLASSES[src], kv_unified, n_seq_max=N_SEQ + 1)  # a blob holds its stream count
    fill(a, seqs, [("seq_rm", s, *hole)])
    tokens = [1, 2, 3]
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "seq.bin"
        if use_file:
            a.state_seq_save_file(path, s, tokens)
        blob = a.state_seq_get_data(s)
        restored = []
        for cls in CLASSES.values():
            b = make(cls, kv_unified, n_seq_max=N_SEQ + 1)
            fill(b, [[7, 8, 9, 10], [11, 12]], [("seq_rm", 0, 1, 3)])  # holes before the head
            if use_file:
                assert b.state_seq_load_file(path, N_SEQ).tolist() == tokens
            else:
                assert b.state_seq_set_data(blob, N_SEQ) == len(blob)
            assert b.memory.seq_pos_min(N_SEQ) == a.memory.seq_pos_min(s)
            assert b.memory.seq_pos_max(N_SEQ) == a.memory.seq_pos_max(s)
            assert b.memory.seq_pos_max(0) == 3  # the other sequences are still there
            restored.append(b)
    assert a.decode(Batch(token=[4], seq_id=[[s]], logits=[True])) == 0
    for b in restored:
        assert b.decode(Batch(token=[4], seq_id=[[N_SEQ]], logits=[True])) == 0
        assert_close(a.get_logits(), b.get_logits(), tol(a, b))


def refused_blobs():
    """(name, blob, dest_seq_id) triples an MLX context holding two sequences must refuse."""
    src = make(MLXContext)
    fill(src, [[1, 2, 3, 4], [5, 6]], [])
    whole, seq = src.state_get_data(), src.state_seq_get_data(0)
    other_hp = tiny_hparams(n_vocab=N_VOCAB, n_layer=1, n_ctx_train=4096)
    other = MLXContext(other_hp, random_weights(other_hp), n_ctx=256, n_seq_max=N_SEQ)
    other.decode(Batch(token=[1, 2]))
    big = make(MLXContext)
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


@pytest.mark.parametrize("case", range(6))
def test_refused_blob_leaves_mlx_memory_bit_identical(case):
    name, blob, dest = refused_blobs()[case]
    ctx = make(MLXContext)
    fill(ctx, [[9, 8, 7, 6, 5, 4, 3, 2, 1] * 4, [4, 5, 6]], [("seq_add", 0, 3, 2)])
    before = snapshot(ctx)
    with pytest.raises(StateError):
        if dest is None:
            ctx.state_set_data(blob)
        else:
            ctx.state_seq_set_data(blob, dest)
    assert_same(before, snapshot(ctx))
    assert ctx.memory.get_has_shift()  # the pending K-shift is still pending


# ---- Mamba and Mamba-2: the recurrent memory's state rows ---------------------------------------


@given(arch=st.sampled_from(ARCHS), seqs=st.lists(seq_tokens, min_size=1, max_size=N_SEQ),
       src=st.sampled_from(list(CLASSES)), use_file=st.booleans(), one=st.booleans())
def test_mamba_state_crosses_and_continues(arch, seqs, src, use_file, one):
    """Whole memory or one sequence (restored under another id), bytes or file, either way."""
    a = make_mamba(arch, CLASSES[src], n_seq_max=N_SEQ + 1)
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
        for cls in CLASSES.values():
            b = make_mamba(arch, cls, n_seq_max=N_SEQ + 1)
            fill(b, [[9, 8], [7]], [])  # replaced (whole) or kept (one sequence)
            if use_file:
                got = b.state_seq_load_file(path, dest) if one else b.state_load_file(path)
                assert got.tolist() == [1, 2]
            elif one:
                assert b.state_seq_set_data(blob, dest) == len(blob)
            else:
                assert b.state_set_data(blob) == len(blob)
                assert b.state_get_data() == blob  # the rows came back bit for bit
            assert b.memory.seq_pos_max(dest) == a.memory.seq_pos_max(0)
            if one:
                assert b.memory.seq_pos_max(1) == 0  # the other sequences are still there
            restored.append(b)
    assert a.decode(Batch(token=[4, 5], seq_id=[[0], [0]], logits=[True, True])) == 0
    for b in restored:
        assert b.decode(Batch(token=[4, 5], seq_id=[[dest], [dest]], logits=[True, True])) == 0
        assert_close(a.get_logits(), b.get_logits(), tol(a, b))


@pytest.mark.parametrize("arch", ARCHS)
def test_mamba_refused_blob_leaves_mlx_rows_bit_identical(arch):
    src = make_mamba(arch, MLXContext)
    fill(src, [[1, 2, 3], [4]], [])
    whole, seq = src.state_get_data(), src.state_seq_get_data(0)
    other = make(MLXContext)  # a Llama context's blob
    fill(other, [[1, 2]], [])
    ctx = make_mamba(arch, MLXContext)
    fill(ctx, [[5, 6, 7, 8], [9]], [])
    before = mamba_snapshot(ctx)
    for blob, dest in ((whole[:-1], None), (seq[: len(seq) // 2], 2), (other.state_get_data(),
                       None), (other.state_seq_get_data(0), 2)):
        with pytest.raises(StateError):
            if dest is None:
                ctx.state_set_data(blob)
            else:
                ctx.state_seq_set_data(blob, dest)
        assert_same_mamba(before, mamba_snapshot(ctx))
