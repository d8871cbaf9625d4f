"""Mamba and Mamba-2 through the accelerated Context, against the reference Context.

The accelerated Context gives a recurrent model its MLX ``RecurrentMemory``
and :func:`accelerated.models.mamba.mamba_forward`; the bookkeeping (``split_equal``, one cell
per sequence, copy on write) is the reference's. On tiny random models, float32:

- the same logits as the reference Context (NMSE <= 1e-6) for multi-sequence batches cut
  into small ubatches, and after ``seq_cp`` (the copy continues the shared state);
- the accelerated path's own laws: batched == each sequence alone; token by token == prefill;
- state blobs (whole context, one sequence, files) cross from either twin to the other and
  continue the same way; the device logits are the NumPy rows.
"""

from __future__ import annotations

import numpy as np
import pytest

from accelerated.context import Context as MLXContext
from reference.batch import Batch
from reference.context import Context as RefContext
from tests.tiny_models import nmse, random_mamba_weights, tiny_mamba_hparams

TOL = 1e-6  # NMSE, float32 end to end

MODELS = {
    "mamba": dict(arch="mamba"),
    "mamba2": dict(arch="mamba2", n_group=2),
}


def model(name):
    hp = tiny_mamba_hparams(**MODELS[name])
    return hp, random_mamba_weights(hp, seed=5)


def pair(name, **kw):
    hp, w = model(name)
    kw = dict(dict(n_ctx=256, n_seq_max=3, n_ubatch=4), **kw)
    return RefContext(hp, w, **kw), MLXContext(hp, w, **kw)


def interleaved(n_seq: int = 3, n_each: int = 5, seed: int = 0) -> Batch:
    rng = np.random.default_rng(seed)
    seq_id = [[s] for _ in range(n_each) for s in range(n_seq)]
    tokens = rng.integers(0, 32, len(seq_id)).tolist()
    return Batch(token=tokens, seq_id=seq_id, logits=[True] * len(tokens))


def decode_both(ref, acc, batch):
    assert ref.decode(batch) == 0 and acc.decode(batch) == 0
    assert nmse(ref.get_logits(), acc.get_logits()) <= TOL


@pytest.mark.parametrize("name", MODELS)
def test_multi_sequence_small_ubatches_equal_the_reference(name):
    ref, acc = pair(name)
    assert type(acc.memory).__module__ == "accelerated.memory.recurrent"
    decode_both(ref, acc, interleaved())
    decode_both(ref, acc, Batch(token=[3, 4, 5], seq_id=[[0], [1], [2]], logits=[True] * 3))
    decode_both(ref, acc, Batch(token=[6, 7], seq_id=[[2], [2]], logits=[True, True]))


@pytest.mark.parametrize("name", MODELS)
def test_seq_cp_continues_the_shared_state_like_the_reference(name):
    ref, acc = pair(name)
    decode_both(ref, acc, Batch(token=[1, 2, 3, 4], seq_id=[[0]] * 4))
    for ctx in (ref, acc):
        ctx.memory.seq_cp(0, 1, -1, -1)
    b = Batch(token=[9, 9, 8], seq_id=[[0], [1], [1]], logits=[True] * 3)
    decode_both(ref, acc, b)
    # the copy went on from the same state: sequence 1's first row is sequence 0's row
    rows = acc.get_logits()
    np.testing.assert_allclose(rows[0], rows[1], rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("name", MODELS)
def test_accelerated_batched_equals_unbatched(name):
    hp, w = model(name)
    batch = interleaved(seed=1)
    acc = MLXContext(hp, w, n_ctx=256, n_seq_max=3, n_ubatch=4)
    assert acc.decode(batch) == 0
    batched = acc.get_logits()
    seq_of = np.array([ids[0] for ids in batch.seq_id])
    for s in range(3):
        alone = MLXContext(hp, w, n_ctx=256)
        toks = [t for t, q in zip(batch.token, seq_of, strict=True) if q == s]
        assert alone.decode(Batch(token=toks, logits=[True] * len(toks))) == 0
        assert nmse(alone.get_logits(), batched[seq_of == s]) <= TOL


@pytest.mark.parametrize("name", MODELS)
def test_accelerated_token_by_token_equals_prefill(name):
    hp, w = model(name)
    prompt = np.random.default_rng(2).integers(0, 32, 12).tolist()
    prefill = MLXContext(hp, w, n_ctx=256)
    assert prefill.decode(Batch(token=prompt, logits=[True] * len(prompt))) == 0
    step = MLXContext(hp, w, n_ctx=256)
    rows = []
    for t in prompt:
        assert step.decode(Batch(token=[t])) == 0
        rows.append(np.array(step.get_logits_ith_device(-1)))
    assert nmse(prefill.get_logits(), np.stack(rows)) <= TOL


@pytest.mark.parametrize("name", MODELS)
def test_state_crosses_between_the_twins(name, tmp_path):
    hp, w = model(name)
    kw = dict(n_ctx=256, n_seq_max=2)
    batch = Batch(token=[1, 2, 3, 4, 5, 6], seq_id=[[0]] * 4 + [[1]] * 2, logits=[True] * 6)
    nxt = Batch(token=[7, 8], seq_id=[[0], [0]], logits=[True, True])
    for src_cls, dst_cls in ((RefContext, MLXContext), (MLXContext, RefContext)):
        src = src_cls(hp, w, **kw)
        assert src.decode(batch) == 0
        blob, seq_blob = src.state_get_data(), src.state_seq_get_data(0)
        dst = dst_cls(hp, w, **kw)
        assert dst.state_set_data(blob) == len(blob)
        np.testing.assert_array_equal(dst.get_logits(), src.get_logits())
        assert dst.state_get_data() == blob  # the rows came back bit for bit
        assert src.decode(nxt) == 0 and dst.decode(nxt) == 0
        assert nmse(src.get_logits(), dst.get_logits()) <= TOL
        one = dst_cls(hp, w, **kw)  # sequence 0 restored into sequence 1
        assert one.state_seq_set_data(seq_blob, 1) == len(seq_blob)
        assert one.decode(Batch(token=[7, 8], seq_id=[[1], [1]], logits=[True, True])) == 0
        assert nmse(src.get_logits(), one.get_logits()) <= TOL
        src.state_seq_save_file(tmp_path / "seq.bin", 1, [5, 6])
        again = dst_cls(hp, w, **kw)
        assert again.state_seq_load_file(tmp_path / "seq.bin", 0).tolist() == [5, 6]
        assert again.memory.seq_pos_max(0) == 1


def test_device_logits_after_a_restore_are_the_restored_rows():
    hp, w = model("mamba")
    src = MLXContext(hp, w, n_ctx=256)
    assert src.decode(Batch(token=[1, 2, 3], logits=[True] * 3)) == 0
    dst = MLXContext(hp, w, n_ctx=256)
    dst.state_set_data(src.state_get_data())
    for i in (0, 1, -1):
        np.testing.assert_array_equal(np.array(dst.get_logits_ith_device(i)),
                                      src.get_logits_ith(i))
