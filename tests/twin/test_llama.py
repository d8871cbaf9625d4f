"""The accelerated Llama/Qwen2 twin (MLX forward + MLX KV cache) against the reference.

Direct comparisons, end to end through the two Contexts, on Llama, Qwen2 (biases) and tied
variants: the same logits (NMSE <= 1e-6 in float32) for a prefill and for multi-sequence
batches split into small ubatches in both KV modes; the lazy K-shift after
``context_shift``; the device logits (``get_logits_ith_device``) with ``get_logits_ith``'s
rows and errors; and SmolLM2-135M Q4_1 giving the reference's greedy continuation with both
matmul formulations (dense transposed, the CPU default; quantized, the Metal default).

The *laws* (batched == unbatched, token by token == prefill, shifts, state crossings) are
written once in the law files and run on every Context flavour, MLX included
(``tests/laws/test_decode.py``, ``tests/laws/test_memory.py``, ``tests/laws/test_state.py``);
the lock-step machine is ``tests/twin/test_lockstep.py``.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from accelerated.context import Context as MLXContext
from accelerated.models.llama import TransposedWeight, prepare_weights
from accelerated.quants import MLXQuantized
from reference.batch import Batch
from reference.context import Context as RefContext
from reference.context import ContextError, context_shift
from tests.support.tiny_models import nmse, random_weights, tiny_hparams

TOL = 1e-6  # NMSE, float32 end to end

MODELS = {
    "llama-gqa": (tiny_hparams(n_layer=2, n_ctx_train=4096), {"seed": 1, "out_ffn_bias": True}),
    "qwen2-bias": (tiny_hparams("qwen2", n_layer=2, n_ctx_train=4096), {"seed": 2}),
    "llama-tied": (tiny_hparams(n_layer=2, tied=True, n_ctx_train=4096), {"seed": 3}),
}
PROMPT = np.random.default_rng(0).integers(0, 32, 24).tolist()


def model(name):
    hp, kw = MODELS[name]
    return hp, random_weights(hp, **kw)


def pair(name, **kwargs):
    hp, w = model(name)
    kwargs = dict(dict(n_ctx=256, n_batch=256, n_ubatch=256), **kwargs)
    return RefContext(hp, w, **kwargs), MLXContext(hp, w, **kwargs)


def multi_seq_batch(n_seq: int = 3, n_each: int = 7) -> Batch:
    """Interleaved tokens of ``n_seq`` sequences, every token an output."""
    rng = np.random.default_rng(5)
    tokens, seq_ids = [], []
    for _ in range(n_each):
        for s in range(n_seq):
            tokens.append(int(rng.integers(0, 32)))
            seq_ids.append([s])
    return Batch(token=tokens, seq_id=seq_ids, logits=[True] * len(tokens))


@pytest.mark.parametrize("name", MODELS)
def test_prefill_logits_equal_the_reference(name):
    ref, acc = pair(name)
    batch = Batch(token=PROMPT, logits=[True] * len(PROMPT))
    assert ref.decode(batch) == 0 and acc.decode(batch) == 0
    out = acc.get_logits()
    assert isinstance(out, np.ndarray) and out.shape == (len(PROMPT), 32)
    assert nmse(ref.get_logits(), out) <= TOL


@pytest.mark.parametrize("kv_unified", [True, False])
@pytest.mark.parametrize("name", MODELS)
def test_multi_sequence_small_ubatches_equal_the_reference(name, kv_unified):
    ref, acc = pair(name, n_seq_max=3, n_ubatch=4, kv_unified=kv_unified)
    batch = multi_seq_batch()
    assert ref.decode(batch) == 0 and acc.decode(batch) == 0
    assert nmse(ref.get_logits(), acc.get_logits()) <= TOL
    # a second batch continues every sequence
    more = Batch(token=[3, 4, 5], seq_id=[[0], [1], [2]], logits=[True] * 3)
    assert ref.decode(more) == 0 and acc.decode(more) == 0
    assert nmse(ref.get_logits(), acc.get_logits()) <= TOL


@pytest.mark.parametrize("name", MODELS)
def test_context_shift_then_decode_equals_the_reference(name):
    ref, acc = pair(name, n_seq_max=2)
    for ctx in (ref, acc):
        assert ctx.decode(Batch(token=PROMPT[:16])) == 0
        context_shift(ctx, 0, n_keep=2, n_discard=6)  # K-shift pending: applied at next decode
        ctx.memory.seq_cp(0, 1, -1, -1)
        ctx.memory.seq_add(1, 4, -1, 3)  # a second, positive shift on a shared copy
    assert acc.memory.get_has_shift()
    for t in PROMPT[16:20]:
        b = Batch(token=[t, t], seq_id=[[0], [1]], logits=[True, True])
        assert ref.decode(b) == 0 and acc.decode(b) == 0
        assert nmse(ref.get_logits(), acc.get_logits()) <= TOL
    assert not acc.memory.get_has_shift()


@pytest.mark.parametrize("kv_unified", [True, False])
def test_device_logits_are_the_host_rows_with_the_same_index_rules(kv_unified):
    hp, w = model("llama-gqa")
    acc = MLXContext(hp, w, n_ctx=256, n_seq_max=3, n_ubatch=4, kv_unified=kv_unified)
    with pytest.raises(ContextError, match="no logits"):
        acc.get_logits_ith_device(0)
    batch = multi_seq_batch()  # split out of batch order when not unified
    batch = Batch(token=batch.token, seq_id=batch.seq_id,
                  logits=[i % 3 != 1 for i in range(len(batch.token))])
    assert acc.decode(batch) == 0
    n = len(batch.token)
    for i in [*range(n), *range(-acc.n_outputs, 0)]:
        if i >= 0 and not batch.logits[i]:
            with pytest.raises(ContextError, match="batch.logits"):
                acc.get_logits_ith_device(i)
            continue
        row = acc.get_logits_ith_device(i)
        assert isinstance(row, mx.array) and row.shape == (hp.n_vocab,)
        np.testing.assert_array_equal(np.array(row), acc.get_logits_ith(i))
    for bad in (n, -acc.n_outputs - 1):
        with pytest.raises(ContextError, match="invalid logits id"):
            acc.get_logits_ith_device(bad)
    # a refused batch keeps the previous outputs, on the device too
    before = np.array(acc.get_logits_ith_device(-1))
    assert acc.decode(Batch(token=[99])) == -1
    np.testing.assert_array_equal(np.array(acc.get_logits_ith_device(-1)), before)
    # an aborted decode leaves none
    acc.abort_callback = lambda: True
    assert acc.decode(Batch(token=[1], seq_id=[[0]])) == 2
    with pytest.raises(ContextError):
        acc.get_logits_ith_device(-1)


# ---- SmolLM2-135M Q4_1 -------------------------------------------------------------------

N_GREEDY = 64


def greedy(ctx, prompt, n):
    assert ctx.decode(Batch(token=prompt)) == 0
    out = []
    for _ in range(n):
        t = int(np.argmax(ctx.get_logits()[-1]))
        out.append(t)
        assert ctx.decode(Batch(token=[t])) == 0
    return out


N_GREEDY_QUANTIZED = 8  # the quantized formulation, a shorter continuation


def test_smollm2_q4_1_greedy_equals_the_reference_in_both_matmul_formulations():
    from reference.model_loader import default_model_path, load_model

    hp, weights = load_model(default_model_path())
    quantized = prepare_weights(weights, "quantized")
    assert isinstance(quantized["blk.0.attn_q.weight"], MLXQuantized)  # runs quantized
    assert isinstance(prepare_weights(quantized, "dense")["output.weight"], TransposedWeight)
    dense = {k: v.dequantize() if hasattr(v, "dequantize") else v for k, v in weights.items()}
    prompt = [1, 504, 3458, 282]
    n_ctx = 256
    ref_tokens = greedy(RefContext(hp, dense, n_ctx=n_ctx), prompt, N_GREEDY)
    acc = MLXContext(hp, weights, n_ctx=n_ctx, matmul="dense")
    assert greedy(acc, prompt, N_GREEDY) == ref_tokens
    # one graph for the one-token steps, and one more once the cells outgrow the first
    # KV_VIEW_PAD (64) of the attention view: 4 + 64 tokens cross it once
    assert acc.perf().n_reused == N_GREEDY - 2
    acc_q = MLXContext(hp, quantized, n_ctx=n_ctx, matmul="quantized")
    assert greedy(acc_q, prompt, N_GREEDY_QUANTIZED) == ref_tokens[:N_GREEDY_QUANTIZED]
