"""The laws of the mixture-of-experts ops and hyperparameters (``reference/ops/moe.py``).

- ``mul_mat_id`` is its definition, ``out[t, e] = as_[ids[t, e]] @ b[t, e % n_b]`` (float64,
  rounding only), and bit for bit the same for quantized experts as for their values (read
  one expert at a time: experts no row names may hold anything);
- ``argsort`` is libstdc++'s ``std::sort`` (verified against g++ once, and against llama.cpp in
  ``tests/oracle/test_moe.py``): rows of at most 16 keep equal values in index order; its
  fast path is the same, bit for bit, on tie-heavy rows;
- ``build_moe_ffn`` equals the per-token sum of its formula (float64);
- the experts' hyperparameters: errors, GGUF keys written and read back, the forward's
  errors.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from reference.arch import hparams_from_gguf, llama_metadata
from reference.gguf import GGUFError
from reference.hparams import HParamsError
from reference.models.llama import LlamaForwardError, llama_forward
from reference.models.simple_cache import SimpleKVCache
from reference.ops.errors import OpIndexError, OpShapeError, OpTypeError, OpValueError
from reference.ops.ffn import silu
from reference.ops.moe import (
    argsort,
    argsort_fast,
    argsort_top_k,
    build_moe_ffn,
    moe_weights,
    mul_mat_id,
)
from reference.quants import GGMLQuantizationType, QuantizedTensor
from reference.testing import random_weights, tiny_hparams

# ---- mul_mat_id -------------------------------------------------------------------------------


@given(seed=st.integers(0, 2**16), n_tokens=st.integers(1, 5), n_as=st.integers(1, 6),
       n_ids=st.integers(1, 4), shared=st.booleans())
def test_mul_mat_id_is_its_definition(seed, n_tokens, n_as, n_ids, shared):
    rng = np.random.default_rng(seed)
    as_ = rng.normal(size=(n_as, 3, 5))
    n_b = 1 if shared else n_ids
    b = rng.normal(size=(n_tokens, n_b, 5))
    ids = rng.integers(0, n_as, (n_tokens, n_ids)).astype(np.int32)
    out = mul_mat_id(as_, b, ids)
    assert out.shape == (n_tokens, n_ids, 3) and out.dtype == np.float64
    for t in range(n_tokens):
        for e in range(n_ids):
            row = b[t, e % n_b][None]  # (1, K)
            np.testing.assert_allclose(out[t, e], (row @ as_[ids[t, e]].T)[0], rtol=1e-12,
                                       atol=1e-14)


def test_mul_mat_id_reads_only_the_chosen_experts_of_a_quantized_tensor():
    rng = np.random.default_rng(0)
    dense = rng.normal(size=(4, 8, 32)).astype(np.float32)
    q = QuantizedTensor.from_float(dense, GGMLQuantizationType.Q8_0)
    b = rng.normal(size=(3, 1, 32)).astype(np.float32)
    ids = np.array([[0, 2], [2, 0], [0, 0]], dtype=np.int32)
    want = mul_mat_id(q.dequantize(), b, ids)
    np.testing.assert_array_equal(mul_mat_id(q, b, ids), want)
    poisoned = q.data.copy()
    poisoned[[1, 3]] = 0xFF  # experts 1 and 3: NaN scales, never read
    got = mul_mat_id(QuantizedTensor(q.qtype, q.shape, poisoned), b, ids)
    np.testing.assert_array_equal(got, want)


def test_mul_mat_id_refuses_bad_arguments():
    as_, b = np.zeros((4, 3, 2)), np.zeros((5, 1, 2))
    with pytest.raises(OpIndexError, match=r"expert id 4 out of range \[0, 4\)"):
        mul_mat_id(as_, b, np.full((5, 2), 4))
    with pytest.raises(OpIndexError, match=r"expert id -1"):
        mul_mat_id(as_, b, np.full((5, 2), -1))
    with pytest.raises(OpTypeError, match="ids must be integers"):
        mul_mat_id(as_, b, np.zeros((5, 2)))
    with pytest.raises(OpShapeError, match="one row per token"):
        mul_mat_id(as_, b, np.zeros((4, 2), np.int32))
    with pytest.raises(OpShapeError, match="a multiple of b's 2 rows"):
        mul_mat_id(as_, np.zeros((5, 2, 2)), np.zeros((5, 3), np.int32))
    with pytest.raises(OpShapeError, match="same row length K"):
        mul_mat_id(as_, np.zeros((5, 1, 3)), np.zeros((5, 2), np.int32))
    with pytest.raises(OpShapeError, match="3-D as_"):
        mul_mat_id(np.zeros((3, 2)), b, np.zeros((5, 2), np.int32))


# ---- argsort, top-k -----------------------------------------------------------------------------


def test_short_rows_keep_equal_values_in_index_order():
    x = np.array([[0.5, 0.2, 0.5, 0.9, 0.2, 0.5]], dtype=np.float32)
    assert argsort(x).tolist() == [[3, 0, 2, 5, 1, 4]]
    assert argsort(x, "asc").tolist() == [[1, 4, 0, 2, 5, 3]]
    assert argsort(np.zeros(16)).tolist() == list(range(16))


def test_long_rows_of_equal_values_come_in_introsorts_order():
    """libstdc++'s introsort on 17+ equal values (g++ 12-14 give this order; llama.cpp picks
    16 and 31 of 32 equal router probabilities, tests/oracle/test_moe.py)."""
    assert argsort(np.zeros(17)).tolist()[:4] == [8, 16, 15, 14]
    assert argsort(np.zeros(32)).tolist()[:4] == [16, 31, 30, 29]
    assert argsort_top_k(np.zeros((2, 32)), 2).tolist() == [[16, 31], [16, 31]]


@given(seed=st.integers(0, 2**16), n=st.integers(1, 80), n_values=st.integers(1, 6),
       order=st.sampled_from(["asc", "desc"]))
def test_argsort_fast_is_argsort(seed, n, n_values, order):
    rng = np.random.default_rng(seed)
    x = rng.integers(0, n_values, (3, n)).astype(np.float32)  # many ties
    x[1] = rng.normal(size=n)  # none
    want = argsort(x, order)
    np.testing.assert_array_equal(argsort_fast(x, order), want)
    srt = np.take_along_axis(x, want, axis=-1)
    assert (np.diff(srt) <= 0).all() if order == "desc" else (np.diff(srt) >= 0).all()


def test_argsort_refuses_bad_arguments():
    with pytest.raises(OpValueError, match="order must be 'asc' or 'desc'"):
        argsort(np.zeros(3), "up")
    with pytest.raises(OpShapeError, match="at least one axis"):
        argsort_fast(np.float32(1.0))
    assert argsort_fast(np.zeros((0, 20))).shape == (0, 20)  # no rows: nothing to sort
    with pytest.raises(OpValueError, match=r"k=4 must be in \[1, 3\]"):
        argsort_top_k(np.zeros((1, 3)), 4)
    with pytest.raises(OpValueError, match=r"k=0"):
        argsort_top_k(np.zeros((1, 3)), 0)


# ---- routing and build_moe_ffn ------------------------------------------------------------------


def test_normalised_weights_sum_to_one_and_keep_their_ratios():
    probs = np.array([[0.1, 0.4, 0.3, 0.2], [0.25, 0.25, 0.25, 0.25]], dtype=np.float32)
    sel, w = moe_weights(probs, 2, norm_w=True)
    assert sel.tolist() == [[1, 2], [0, 1]]
    np.testing.assert_allclose(w.sum(-1), 1.0, rtol=1e-6)
    np.testing.assert_allclose(w[0, 0] / w[0, 1], 4 / 3, rtol=1e-6)
    _, raw = moe_weights(probs, 2, norm_w=False, w_scale=2.0)
    np.testing.assert_allclose(raw[0], [0.8, 0.6], rtol=1e-6)
    _, tiny = moe_weights(np.zeros((1, 3), np.float32), 2, norm_w=True)
    assert tiny.tolist() == [[0.0, 0.0]]  # the sum is clamped: no division by zero


@given(seed=st.integers(0, 2**16), k=st.integers(1, 4), before=st.booleans(),
       norm=st.booleans())
def test_build_moe_ffn_is_its_formula(seed, k, before, norm):
    rng = np.random.default_rng(seed)
    n_exp, n_ff, n_embd, n_tok = 4, 6, 5, 3
    gate_inp = rng.normal(size=(n_exp, n_embd))
    up, gate = rng.normal(size=(2, n_exp, n_ff, n_embd))
    down = rng.normal(size=(n_exp, n_embd, n_ff))
    x = rng.normal(size=(n_tok, n_embd))
    out = build_moe_ffn(x, gate_inp, up, gate, down, k, norm_w=norm, weight_before_ffn=before)
    for t in range(n_tok):
        logits = gate_inp @ x[t]
        p = np.exp(logits - logits.max())
        p /= p.sum()
        chosen = np.argsort(-p, kind="stable")[:k]
        w = p[chosen] / (p[chosen].sum() if norm else 1.0)
        want = np.zeros(n_embd)
        for e, we in zip(chosen, w, strict=True):
            xi = we * x[t] if before else x[t]
            y = down[e] @ (silu(gate[e] @ xi) * (up[e] @ xi))
            want += y if before else we * y
        np.testing.assert_allclose(out[t], want, rtol=1e-10, atol=1e-12)


def test_without_gate_experts_the_activation_is_silu_of_up():
    rng = np.random.default_rng(1)
    up, down = rng.normal(size=(3, 4, 2)), rng.normal(size=(3, 2, 4))
    x, gate_inp = rng.normal(size=(1, 2)), np.array([[9.0, 0.0], [0.0, 0.0], [0.0, 0.0]])
    x = np.abs(x)
    out = build_moe_ffn(x, gate_inp, up, None, down, 1)
    np.testing.assert_allclose(out[0], down[0] @ silu(up[0] @ x[0]), rtol=1e-12)


def test_a_ubatch_without_rows_gives_no_rows():
    """The last layer runs on the output rows only: a ubatch may have none."""
    rng = np.random.default_rng(2)
    up, gate = rng.normal(size=(2, 4, 6, 3))
    out = build_moe_ffn(np.zeros((0, 3)), rng.normal(size=(4, 3)), up, gate,
                        rng.normal(size=(4, 3, 6)), 2)
    assert out.shape == (0, 3)


def test_build_moe_ffn_refuses_experts_of_another_count():
    with pytest.raises(OpShapeError, match="up_exps has 3 experts, the router ffn_gate_inp 4"):
        build_moe_ffn(np.zeros((1, 2)), np.zeros((4, 2)), np.zeros((3, 4, 2)), None,
                      np.zeros((4, 2, 4)), 2)


# ---- hyperparameters, GGUF keys, the forward -----------------------------------------------------


def test_expert_hyperparameters_are_checked():
    with pytest.raises(HParamsError, match=r"n_expert_used=3 must be in \[1, n_expert=2\]"):
        tiny_hparams("llama", n_expert=2, n_expert_used=3)
    with pytest.raises(HParamsError, match="qwen3moe: n_expert must be > 0"):
        tiny_hparams("qwen3moe")
    with pytest.raises(HParamsError, match="qwen2: no mixture of experts"):
        tiny_hparams("qwen2", n_expert=4, n_expert_used=2)
    with pytest.raises(HParamsError, match="llama: n_ff_exp is qwen3moe's"):
        tiny_hparams("llama", n_expert=4, n_expert_used=2, n_ff_exp=8)
    with pytest.raises(HParamsError, match="need experts"):
        tiny_hparams("llama", n_expert_used=2)
    with pytest.raises(HParamsError, match="exceeds LLAMA_MAX_EXPERTS=1024"):
        tiny_hparams("llama", n_expert=1025, n_expert_used=2)
    with pytest.raises(HParamsError, match="qwen3: n_embd_head_k=4, n_embd_head_v=4 and n_rot=2"):
        tiny_hparams("qwen3", n_rot=2)


@pytest.mark.parametrize("kwargs", [
    dict(arch="qwen3"),
    dict(arch="qwen3moe", n_expert=8, n_expert_used=2, n_ff_exp=12),
    dict(arch="qwen3moe", n_expert=8, n_expert_used=2),
    dict(arch="llama", n_expert=4, n_expert_used=2),
    dict(arch="llama"),
], ids=["qwen3", "qwen3moe", "qwen3moe-default-width", "mixtral", "llama"])
def test_gguf_keys_read_back(kwargs):
    hp = tiny_hparams(eps=2.0**-16, n_ctx_train=64, **kwargs)
    md = llama_metadata(hp)
    back = hparams_from_gguf(hp.arch, md)
    assert back.n_expert == hp.n_expert and back.n_expert_used == hp.n_expert_used
    assert back.n_ff_expert() == hp.n_ff_expert() and back.rope_type == hp.rope_type
    assert (f"{hp.arch}.expert_count" in md) == (hp.n_expert > 0)


def test_a_gguf_cannot_say_unnormalised_experts():
    hp = tiny_hparams("qwen3moe", n_expert=4, n_expert_used=2)
    import dataclasses

    with pytest.raises(GGUFError, match="expert_weights_norm must be True"):
        llama_metadata(dataclasses.replace(hp, expert_weights_norm=False))


def test_forward_names_a_missing_or_misshapen_expert_tensor():
    hp = tiny_hparams("qwen3moe", n_layer=1, n_expert=4, n_expert_used=2)
    w = random_weights(hp, seed=0)
    pos = np.arange(2)

    def inp():
        return SimpleKVCache(hp, 4).init_batch(pos)

    bad = dict(w)
    del bad["blk.0.ffn_up_exps.weight"]
    with pytest.raises(LlamaForwardError, match="missing weight 'blk.0.ffn_up_exps.weight'"):
        llama_forward(bad, hp, np.array([1, 2]), pos, inp())
    bad["blk.0.ffn_up_exps.weight"] = w["blk.0.ffn_up_exps.weight"][0]
    with pytest.raises(LlamaForwardError, match="must be 3-D"):
        llama_forward(bad, hp, np.array([1, 2]), pos, inp())
    del bad["blk.0.ffn_up_exps.weight"]
    del w["blk.0.attn_q_norm.weight"]
    with pytest.raises(LlamaForwardError, match="missing weight 'blk.0.attn_q_norm.weight'"):
        llama_forward(w, hp, np.array([1, 2]), pos, inp())
