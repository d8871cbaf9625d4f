"""The MLX twin of Qwen3 and of the mixtures of experts against the reference.

The ops (``accelerated/ops/moe.py``): ``mul_mat_id`` through ``mx.gather_mm`` /
``mx.gather_qmm`` (float and packed Q4_0/Q8_0 experts, one row per token or per expert),
``argsort_top_k`` (the reference's choice without ties and on rows of at most 16; equal
values of a longer row in index order, where the reference follows libstdc++'s introsort),
``build_moe_ffn`` (and its fast path on rows sorted by expert, as mlx-lm's ``SwitchGLU``);
each by test-backend-ops' verdict (``reference.common.MAX_NMSE_OP``).
End to end through the two Contexts, Qwen3, Qwen3-MoE and Mixtral (float experts, Q8_0
experts, both matmul forms): the same logits (NMSE <= 1e-6, float32), for a prefill and for
multi-sequence batches in small ubatches, both KV layouts.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from accelerated.context import Context as MLXContext
from accelerated.ops import moe as twin
from accelerated.quants import MLXQuantized, load_weight
from reference.batch import Batch
from reference.common import MAX_NMSE_OP, MAX_NMSE_TWIN
from reference.context import Context as RefContext
from reference.ops import moe
from reference.ops.errors import OpIndexError, OpValueError
from reference.quants import GGMLQuantizationType, QuantizedTensor
from tests.support.tiny_models import nmse, nmse_check, random_weights, tiny_hparams

Q = GGMLQuantizationType

# ---- ops --------------------------------------------------------------------------------------


@pytest.mark.parametrize("qtype", [None, Q.Q8_0, Q.Q4_0], ids=["f32", "q8_0", "q4_0"])
@pytest.mark.parametrize("n_b", [1, 2, 4], ids=["b-shared", "b-half", "b-per-expert"])
def test_mul_mat_id_twin(qtype, n_b):
    rng = np.random.default_rng(0)
    dense = rng.normal(size=(6, 8, 64)).astype(np.float32)
    as_ref = dense if qtype is None else QuantizedTensor.from_float(dense, qtype)
    as_twin = mx.array(dense) if qtype is None else load_weight(as_ref)
    assert qtype is None or isinstance(as_twin, MLXQuantized)  # stays packed
    b = rng.normal(size=(5, n_b, 64)).astype(np.float32)
    ids = rng.integers(0, 6, (5, 4)).astype(np.int32)
    nmse_check(moe.mul_mat_id(as_ref, b, ids), np.array(twin.mul_mat_id(as_twin, b, ids)),
               MAX_NMSE_OP["mul_mat"])
    with pytest.raises(OpIndexError, match=r"expert id 6 out of range \[0, 6\)"):
        twin.mul_mat_id(as_twin, b, np.full((5, 4), 6, np.int32))


def test_top_k_twin_is_the_reference_without_long_ties():
    rng = np.random.default_rng(1)
    for n in (4, 16, 40):
        x = rng.normal(size=(7, n)).astype(np.float32)
        np.testing.assert_array_equal(np.array(twin.argsort_top_k(x, 3)),
                                      moe.argsort_top_k(x, 3))
    ties = rng.integers(0, 3, (7, 16)).astype(np.float32)
    np.testing.assert_array_equal(np.array(twin.argsort_top_k(ties, 5)),
                                  moe.argsort_top_k(ties, 5))
    with pytest.raises(OpValueError, match=r"k=5 must be in \[1, 4\]"):
        twin.argsort_top_k(np.zeros((1, 4)), 5)
    assert twin.argsort_top_k(np.zeros((0, 4)), 2).shape == (0, 2)  # no rows: no outputs


def test_top_k_twin_breaks_long_ties_by_index():
    """The documented difference: 32 equal values give 0, 1 here, 16, 31 in the reference."""
    assert np.array(twin.argsort_top_k(np.zeros((1, 32)), 2)).tolist() == [[0, 1]]
    assert moe.argsort_top_k(np.zeros((1, 32)), 2).tolist() == [[16, 31]]


@pytest.mark.parametrize("gated", [True, False])
@pytest.mark.parametrize("before", [False, True])
def test_build_moe_ffn_twin(gated, before):
    rng = np.random.default_rng(2)
    up, gate = rng.normal(0, 0.2, size=(2, 8, 16, 32)).astype(np.float32)
    down = rng.normal(0, 0.2, size=(8, 32, 16)).astype(np.float32)
    router = rng.normal(size=(8, 32)).astype(np.float32)
    x = rng.normal(size=(9, 32)).astype(np.float32)
    want = moe.build_moe_ffn(x, router, up, gate if gated else None, down, 3,
                             weight_before_ffn=before)
    got = twin.build_moe_ffn(mx.array(x), mx.array(router), mx.array(up),
                             mx.array(gate) if gated else None, mx.array(down), 3,
                             weight_before_ffn=before)
    nmse_check(want, np.array(got), MAX_NMSE_OP["mul_mat"])


@pytest.mark.parametrize("qtype", [None, Q.Q4_0], ids=["f32", "q4_0"])
@pytest.mark.parametrize("before", [False, True])
def test_sorted_experts_are_the_experts(qtype, before):
    """The fast path (rows sorted by expert) gives the products of the plain one."""
    rng = np.random.default_rng(4)
    dense = rng.normal(0, 0.2, size=(3, 8, 64, 64)).astype(np.float32)  # up, gate, down
    exps = [mx.array(d) if qtype is None else load_weight(QuantizedTensor.from_float(d, qtype))
            for d in dense]
    n_tokens, k = 40, 3
    x = mx.array(rng.normal(size=(n_tokens, k if before else 1, 64)).astype(np.float32))
    selected = mx.array(rng.integers(0, 8, (n_tokens, k)).astype(np.int32))
    plain = np.array(twin.experts_ffn(x, *exps, selected))
    fast = np.array(twin.experts_sorted(x, *exps, selected))
    assert fast.shape == plain.shape == (n_tokens, k, 64)
    assert nmse(plain, fast) <= 1e-12


def test_many_tokens_take_the_sorted_path_and_equal_the_reference():
    rng = np.random.default_rng(6)
    up, gate = rng.normal(0, 0.2, size=(2, 8, 16, 32)).astype(np.float32)
    down = rng.normal(0, 0.2, size=(8, 32, 16)).astype(np.float32)
    router = rng.normal(size=(8, 32)).astype(np.float32)
    x = rng.normal(size=(50, 32)).astype(np.float32)  # 100 (token, expert) rows >= 64
    assert 50 * 2 >= twin.SORT_MIN_ROWS
    want = moe.build_moe_ffn(x, router, up, gate, down, 2)
    got = twin.build_moe_ffn(mx.array(x), mx.array(router), mx.array(up), mx.array(gate),
                             mx.array(down), 2)
    nmse_check(want, np.array(got), MAX_NMSE_OP["mul_mat"])


# ---- end to end through the Contexts ------------------------------------------------------------

MODELS = {
    "qwen3": dict(arch="qwen3"),
    "qwen3moe": dict(arch="qwen3moe", n_expert=8, n_expert_used=2, n_ff_exp=32),
    "mixtral": dict(arch="llama", n_expert=4, n_expert_used=2, n_ff=32),
}
PROMPT = np.random.default_rng(0).integers(0, 32, 40).tolist()  # 80 expert rows: sorted


def model(name: str, quantized: bool):
    hp = tiny_hparams(n_embd=32, n_ctx_train=4096, **MODELS[name])
    w = random_weights(hp, seed=5)
    if quantized:
        w = {k: QuantizedTensor.from_float(v, Q.Q8_0) if "_exps" in k else v
             for k, v in w.items()}
    return hp, w


def both(name, quantized, matmul="dense", **kwargs):
    hp, w = model(name, quantized)
    kwargs = dict(dict(n_ctx=128, n_batch=128, n_ubatch=128), **kwargs)
    return RefContext(hp, w, **kwargs), MLXContext(hp, w, matmul=matmul, **kwargs)


CASES = [(n, q, m) for n in MODELS for q in ((False, True) if n != "qwen3" else (False,))
         for m in ("dense", "quantized")]


@pytest.mark.parametrize(("name", "quantized", "matmul"), CASES,
                         ids=[f"{n}-{'q8' if q else 'f32'}-{m}" for n, q, m in CASES])
def test_prefill_equals_the_reference(name, quantized, matmul):
    ref, acc = both(name, quantized, matmul)
    batch = Batch(token=PROMPT, logits=[True] * len(PROMPT))
    assert ref.decode(batch) == 0 and acc.decode(batch) == 0
    assert nmse(ref.get_logits(), acc.get_logits()) <= MAX_NMSE_TWIN


@pytest.mark.parametrize("kv_unified", [True, False])
@pytest.mark.parametrize("name", sorted(MODELS))
def test_multi_sequence_small_ubatches_equal_the_reference(name, kv_unified):
    ref, acc = both(name, quantized=name != "qwen3", n_seq_max=3, n_ubatch=4,
                    kv_unified=kv_unified)
    rng = np.random.default_rng(3)
    tokens = rng.integers(0, 32, 18).tolist()
    batch = Batch(token=tokens, seq_id=[[i % 3] for i in range(18)], logits=[True] * 18)
    assert ref.decode(batch) == 0 and acc.decode(batch) == 0
    assert nmse(ref.get_logits(), acc.get_logits()) <= MAX_NMSE_TWIN
    more = Batch(token=[3, 4, 5], seq_id=[[0], [1], [2]], logits=[True] * 3)
    assert ref.decode(more) == 0 and acc.decode(more) == 0
    assert nmse(ref.get_logits(), acc.get_logits()) <= MAX_NMSE_TWIN
