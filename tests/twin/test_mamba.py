"""The accelerated Mamba / Mamba-2 forward and recurrent memory against the reference.

End to end on tiny random models (``tests.support.tiny_models``), float32: the twin's logits match
the reference's to NMSE <= 1e-6 for one prefill, token by token, and multi-sequence
``split_equal`` ubatches driven through both ``RecurrentMemory`` classes (copy on write
included); on the accelerated path alone, chunked decoding equals one prefill.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from accelerated.memory.recurrent import RecurrentMemory as TwinMemory
from accelerated.models import mamba as twin
from reference.batch import Batch, BatchAllocr
from reference.memory.recurrent import RecurrentMemory as RefMemory
from reference.models import mamba as ref
from tests.support.tiny_models import nmse, random_mamba_weights, tiny_mamba_hparams

TOL = 1e-6  # NMSE, float32 end to end

MODELS = {
    "mamba": dict(arch="mamba"),
    "mamba-bcrms-tied": dict(arch="mamba", dt_b_c_rms=True, tied=True),
    "mamba2": dict(arch="mamba2"),
    "mamba2-2groups": dict(arch="mamba2", n_group=2),
}


@pytest.fixture(params=list(MODELS), scope="module")
def model(request):
    hp = tiny_mamba_hparams(**MODELS[request.param])
    weights = random_mamba_weights(hp, seed=3)
    return hp, weights, twin.prepare_weights(weights)


def _tokens(hp, n: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, hp.n_vocab, size=n)


def _run_ref(weights, hp, tokens, chunks):
    state = ref.SimpleRecurrentState(hp, 1, np.float32)
    out, start = [], 0
    for n in chunks:
        out.append(ref.mamba_forward(weights, hp, tokens[start:start + n], state.init_batch()))
        start += n
    return np.concatenate(out), state


def _run_twin(weights, hp, tokens, chunks):
    state = twin.SimpleRecurrentState(hp, 1)
    out, start = [], 0
    for n in chunks:
        logits = twin.mamba_forward(weights, hp, tokens[start:start + n], state.init_batch())
        out.append(np.array(logits))
        start += n
    return np.concatenate(out), state


@pytest.mark.parametrize("chunks", [[13], [1] * 13, [5, 1, 7]], ids=["prefill", "tbt", "mixed"])
def test_twin_logits_match_reference(model, chunks):
    hp, weights, prepared = model
    tokens = _tokens(hp, 13)
    want, ref_state = _run_ref(weights, hp, tokens, chunks)
    got, twin_state = _run_twin(prepared, hp, tokens, chunks)
    assert got.shape == want.shape == (13, hp.n_vocab)
    assert nmse(want, got) <= TOL
    for il in range(hp.n_layer):  # the final states agree too
        assert nmse(ref_state.r_l[il], np.array(twin_state.r_l[il])) <= TOL
        assert nmse(ref_state.s_l[il], np.array(twin_state.s_l[il])) <= TOL


def test_twin_accepts_unprepared_weights(model):
    hp, weights, prepared = model
    tokens = _tokens(hp, 6, seed=1)
    a, _ = _run_twin(weights, hp, tokens, [6])
    b, _ = _run_twin(prepared, hp, tokens, [6])
    np.testing.assert_array_equal(a, b)


def test_twin_chunked_equals_whole(model):
    hp, _, prepared = model
    tokens = _tokens(hp, 16, seed=2)
    whole, _ = _run_twin(prepared, hp, tokens, [16])
    for chunks in ([1] * 16, [3, 5, 8], [15, 1]):
        part, _ = _run_twin(prepared, hp, tokens, chunks)
        assert nmse(whole, part) <= TOL, chunks


def test_twin_out_ids_and_errors(model):
    hp, _, prepared = model
    state = twin.SimpleRecurrentState(hp, 2)
    tokens = _tokens(hp, 6, seed=4).reshape(2, 3)
    all_rows = np.array(twin.mamba_forward(prepared, hp, tokens, state.init_batch()))
    state = twin.SimpleRecurrentState(hp, 2)
    some = np.array(twin.mamba_forward(prepared, hp, tokens, state.init_batch(),
                                       out_ids=np.array([5, 2])))
    np.testing.assert_allclose(some, all_rows[[5, 2]], rtol=0, atol=1e-6)
    with pytest.raises(ref.MambaForwardError, match="out of range"):
        twin.mamba_forward(prepared, hp, np.array([hp.n_vocab]), state.init_batch())


def _decode(mem, forward, weights, hp, tokens, seq_ids, n_ubatch):
    """llama_decode's steps for a recurrent model; returns the logits in batch order."""
    batch = Batch(token=list(tokens), seq_id=[[s] for s in seq_ids])
    balloc = BatchAllocr(batch, n_vocab=hp.n_vocab, n_seq_max=mem.n_seq_max, memory=mem)
    ubatches = []
    while (ub := balloc.split_equal(n_ubatch, sequential=True)).n_tokens:
        ubatches.append(ub)
    placements = mem.prepare(ubatches)
    assert placements is not None
    logits = np.zeros((len(tokens), hp.n_vocab), np.float32)
    n_seqs_seen = []
    for ub, cells in zip(ubatches, placements, strict=True):
        mem.apply_ubatch(cells, ub)
        out = forward(weights, hp, ub.token, mem.rs_input(ub), n_seqs=ub.n_seqs)
        logits[np.asarray(ub.idx)] = np.array(out)
        n_seqs_seen.append(ub.n_seqs)
    return logits, n_seqs_seen


def _rows(mem, il):
    return np.array(mem.r_l[il]), np.array(mem.s_l[il])


@pytest.mark.parametrize("n_ubatch", [6, 9])
def test_twin_memory_split_equal_matches_reference(model, n_ubatch):
    """Three sequences, interleaved, then seq_cp (copy on write) and a second batch."""
    hp, weights, prepared = model
    mems = {"ref": RefMemory(hp, mem_size=4, n_seq_max=4),
            "twin": TwinMemory(hp, mem_size=4, n_seq_max=4)}
    forwards = {"ref": (ref.mamba_forward, weights), "twin": (twin.mamba_forward, prepared)}
    seq_ids = [0, 1, 2] * 4 + [0, 1]  # 14 tokens: 5, 5 and 4 per sequence
    tokens = _tokens(hp, len(seq_ids), seed=5)
    second = ([3, 0, 3, 0, 1], _tokens(hp, 5, seed=6))  # seq 3 is a copy of seq 1
    got = {}
    for name, mem in mems.items():
        fwd, w = forwards[name]
        first, seen = _decode(mem, fwd, w, hp, tokens, seq_ids, n_ubatch)
        assert max(seen) >= 2  # some ubatch really holds several sequence sets
        mem.seq_cp(1, 3, -1, -1)
        nxt, _ = _decode(mem, fwd, w, hp, second[1], second[0], n_ubatch)
        got[name] = (first, nxt)
    for a, b in zip(got["ref"], got["twin"], strict=True):
        assert nmse(a, b) <= TOL
    for il in range(hp.n_layer):
        for a, b in zip(_rows(mems["ref"], il), _rows(mems["twin"], il), strict=True):
            assert nmse(a, b) <= TOL
    assert [c.seq_id for c in mems["ref"].cells] == [c.seq_id for c in mems["twin"].cells]


def test_twin_memory_backup_restore_and_clear():
    hp = tiny_mamba_hparams("mamba2")
    mem = TwinMemory(hp, mem_size=2, n_seq_max=2)
    _decode(mem, twin.mamba_forward, twin.prepare_weights(random_mamba_weights(hp)), hp,
            _tokens(hp, 4), [0, 1, 0, 1], 4)
    before = [np.array(t) for t in mem.r_l + mem.s_l]
    saved = mem.backup()
    mem.clear()
    assert all(not np.array(t).any() for t in mem.r_l + mem.s_l)
    assert mem.seq_pos_max(0) == -1
    mem.restore(saved)
    assert mem.seq_pos_max(0) == 1
    for a, b in zip(before, mem.r_l + mem.s_l, strict=True):
        np.testing.assert_array_equal(a, np.array(b))


def test_twin_memory_rejects_float64():
    from reference.memory.recurrent import RecurrentMemoryError

    with pytest.raises(RecurrentMemoryError, match="float64"):
        TwinMemory(tiny_mamba_hparams(), mem_size=1, dtype=np.float64)


def test_twin_state_rows_are_mlx():
    hp = tiny_mamba_hparams()
    mem = TwinMemory(hp, mem_size=2, n_seq_max=2)
    assert all(isinstance(t, mx.array) for t in mem.r_l + mem.s_l)


@pytest.mark.parametrize("arch", ["mamba", "mamba2"])
@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_1", "Q4_0", "F16"])
def test_twin_quantized_weights_match_reference(arch, qtype):
    """Matrices quantized: exact types run in mx.quantized_matmul, others dequantized at load;
    the reference dequantizes the same tensors, so the logits agree as closely."""
    from gguf import GGMLQuantizationType

    from accelerated.quants import MLXQuantized
    from reference.quants import QuantizedTensor

    hp = tiny_mamba_hparams(arch, n_embd=32)
    weights = random_mamba_weights(hp, seed=7)
    for name, w in list(weights.items()):
        if name.endswith(("ssm_in.weight", "ssm_x.weight", "ssm_out.weight", "token_embd.weight",
                          "output.weight")):
            weights[name] = QuantizedTensor.from_float(w, GGMLQuantizationType[qtype])
    prepared = twin.prepare_weights(weights)
    n_quantized = sum(isinstance(w, MLXQuantized) for w in prepared.values())
    assert n_quantized == (0 if qtype == "F16" else 2 * hp.n_layer + 2 + (arch == "mamba") * 2)
    tokens = _tokens(hp, 9, seed=8)
    for chunks in ([9], [4, 1, 4]):
        want, _ = _run_ref(weights, hp, tokens, chunks)
        got, _ = _run_twin(prepared, hp, tokens, chunks)
        assert nmse(want, got) <= TOL


@pytest.mark.parametrize("seq_id", [-1, 1])
def test_twin_state_blob_round_trips_both_ways(seq_id, tmp_path):
    """A blob written by one memory restores in the other: rows equal bit for bit."""
    from accelerated.memory import recurrent as twin_rec
    from reference.memory import recurrent as ref_rec

    hp = tiny_mamba_hparams("mamba2")
    weights = random_mamba_weights(hp)
    mems = {"ref": RefMemory(hp, mem_size=3, n_seq_max=3),
            "twin": TwinMemory(hp, mem_size=3, n_seq_max=3)}
    _decode(mems["twin"], twin.mamba_forward, twin.prepare_weights(weights), hp,
            _tokens(hp, 6), [0, 1, 2] * 2, 6)
    blob = twin_rec.state_write(mems["twin"], hp, seq_id)
    dest = -1 if seq_id == -1 else 0
    ref_rec.state_read(mems["ref"], hp, blob, dest)
    if seq_id == -1:  # the whole memory: the reference writes back the very same blob
        assert ref_rec.state_write(mems["ref"], hp) == blob
    # and back: the reference's blob into a fresh twin, through a file
    path = tmp_path / "state.bin"
    ref_rec.state_save_file(path, mems["ref"], hp, [1, 2, 3], dest)
    fresh = TwinMemory(hp, mem_size=3, n_seq_max=3)
    np.testing.assert_array_equal(twin_rec.state_load_file(path, fresh, hp, dest), [1, 2, 3])
    assert all(isinstance(t, mx.array) for t in fresh.r_l + fresh.s_l)
    src = mems["twin"].cells[mems["twin"].cells[seq_id if seq_id >= 0 else 0].tail].src
    dst = fresh.cells[fresh.cells[max(dest, 0)].tail].src
    for a, b in zip(mems["twin"].r_l + mems["twin"].s_l, fresh.r_l + fresh.s_l, strict=True):
        np.testing.assert_array_equal(np.array(a)[src], np.array(b)[dst])
    assert fresh.seq_pos_max(max(dest, 0)) == mems["twin"].seq_pos_max(max(seq_id, 0)) == 1


def test_twin_state_refused_blob_changes_nothing():
    from accelerated.memory import recurrent as twin_rec
    from reference.memory.state import StateError

    hp = tiny_mamba_hparams("mamba")
    mem = TwinMemory(hp, mem_size=2, n_seq_max=2)
    _decode(mem, twin.mamba_forward, twin.prepare_weights(random_mamba_weights(hp)), hp,
            _tokens(hp, 2), [0, 1], 2)
    before = [np.array(t) for t in mem.r_l + mem.s_l]
    blob = twin_rec.state_write(mem, hp)
    with pytest.raises(StateError):
        twin_rec.state_read(mem, hp, blob[:-1] + bytes([blob[-1] ^ 1]))
    assert all(isinstance(t, mx.array) for t in mem.r_l + mem.s_l)
    for a, b in zip(before, mem.r_l + mem.s_l, strict=True):
        np.testing.assert_array_equal(a, np.array(b))
