"""Gemma, Gemma 2, Gemma 3 without oracles: the soft-cap op, the GGUF keys, the HF config
mapping, the per-layer SWA mask of the simple cache, and properties of the forward.

The oracle comparisons (transformers, llama.cpp) are in ``test_oracle_gemma.py``.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from reference.arch import gguf_representable_errors, hparams_from_gguf, llama_metadata
from reference.batch import Batch
from reference.context import Context
from reference.gguf import GGUFError
from reference.hf import HFLoadError, gemma_hparams_from_hf, hparams_from_hf
from reference.hparams import (
    ROPE_TYPE_NEOX,
    ROPE_TYPE_NORM,
    SWA_TYPE_NONE,
    SWA_TYPE_STANDARD,
    HParamsError,
    gemma_attention_scale,
    swa_pattern,
)
from reference.models.gemma import gemma_forward, llm_build_gemma
from reference.models.llama import LlamaForwardError
from reference.models.simple_cache import SimpleKVCache
from reference.ops import build_attn_mha, softcap, tanh
from reference.ops.errors import OpValueError
from tests.support.tiny_models import chunked_logits, random_gemma_weights, tiny_gemma_hparams

ARCHS = ("gemma", "gemma2", "gemma3")


def model(arch, seed=0, dtype=np.float64, **kwargs):
    hp = tiny_gemma_hparams(arch, **kwargs)
    return hp, random_gemma_weights(hp, seed=seed, dtype=dtype)


def small_window(arch, **kwargs):
    """A model whose SWA layers matter for prompts of ~20 tokens (and small caps)."""
    if arch == "gemma":
        return model(arch, **kwargs)
    kwargs.setdefault("n_layer", 4)
    kwargs.setdefault("n_swa", 4)
    if arch == "gemma2":
        kwargs.setdefault("attn_softcap", 2.0)
        kwargs.setdefault("final_softcap", 6.0)
    else:
        kwargs.setdefault("swa_layers", (True, True, False, True))
    return model(arch, **kwargs)


# ---------------------------------------------------------------------------------------------
# the soft-cap op


@given(x=st.floats(-1e6, 1e6), cap=st.floats(0.01, 1e3))
def test_softcap_is_c_tanh_x_over_c(x, cap):
    out = float(softcap(np.array([x]), cap)[0])
    assert abs(out - cap * np.tanh(x / cap)) <= 1e-6 * cap  # 1/c rounded to float32
    assert -cap <= out <= cap


def test_softcap_float32_is_ggmls_three_ops():
    """scale(1.0f / c), tanh, scale(c), each rounded to float32, exactly."""
    x = np.random.default_rng(0).normal(0, 40, 1000).astype(np.float32)
    c = np.float32(30.0)
    expected = np.tanh(x * (np.float32(1) / c)) * c
    out = softcap(x, 30.0)
    assert out.dtype == np.float32
    np.testing.assert_array_equal(out, expected)


def test_softcap_is_odd_and_near_identity_for_small_scores():
    x = np.linspace(-0.01, 0.01, 11)
    np.testing.assert_allclose(softcap(x, 50.0), x, atol=1e-9)
    np.testing.assert_array_equal(softcap(-x, 7.0), -softcap(x, 7.0))
    assert tanh(np.array([np.inf]))[0] == 1.0


@pytest.mark.parametrize("cap", [0.0, -1.0, np.inf, np.nan])
def test_softcap_refuses_a_cap_llama_cpp_would_divide_by(cap):
    with pytest.raises(OpValueError, match="the cap must be a positive finite number"):
        softcap(np.ones(3), cap)


def test_attention_without_a_cap_is_bit_identical_and_with_a_cap_caps_the_scores():
    rng = np.random.default_rng(1)
    q, k, v = rng.normal(0, 3, (5, 4, 8)), rng.normal(0, 3, (5, 2, 8)), rng.normal(size=(5, 2, 3))
    mask = np.triu(np.full((5, 5), -np.inf), 1)
    plain = build_attn_mha(q, k, v, mask, 0.5)
    np.testing.assert_array_equal(build_attn_mha(q, k, v, mask, 0.5, softcap=0.0), plain)
    capped = build_attn_mha(q, k, v, mask, 0.5, softcap=2.0)
    # picoGPT's line with the cap before the scale and the mask
    qh, kh, vh = q.transpose(1, 0, 2), np.repeat(k, 2, 1).transpose(1, 0, 2), np.repeat(v, 2, 1)
    s = 2.0 * np.tanh(qh @ kh.transpose(0, 2, 1) / 2.0) * 0.5 + mask
    w = np.exp(s - s.max(-1, keepdims=True))
    w /= w.sum(-1, keepdims=True)
    expected = (w @ vh.transpose(1, 0, 2)).transpose(1, 0, 2).reshape(5, -1)
    np.testing.assert_allclose(capped, expected, atol=1e-12)
    assert np.abs(capped - plain).max() > 1e-2


@pytest.mark.parametrize("cap", [1.0, 0.5])
def test_attention_caps_the_scores_with_a_cap_of_one_or_less(cap):
    """Any cap > 0 is applied (``softcap > 0`` in ``build_attn_mha``), however small."""
    rng = np.random.default_rng(2)
    q, k, v = rng.normal(0, 3, (3, 2, 8)), rng.normal(0, 3, (4, 1, 8)), rng.normal(size=(4, 1, 3))
    mask = np.triu(np.full((3, 4), -np.inf), 2)
    s = cap * np.tanh(q.transpose(1, 0, 2) @ k.transpose(1, 2, 0) / cap) * 0.5 + mask
    w = np.exp(s - s.max(-1, keepdims=True))
    w /= w.sum(-1, keepdims=True)
    expected = (w @ v.transpose(1, 0, 2)).transpose(1, 0, 2).reshape(3, -1)
    np.testing.assert_allclose(build_attn_mha(q, k, v, mask, 0.5, softcap=cap), expected,
                               atol=1e-12)


# ---------------------------------------------------------------------------------------------
# GGUF keys


def metadata(arch, **keys):
    md = {
        f"{arch}.context_length": 128, f"{arch}.embedding_length": 32,
        f"{arch}.block_count": 6, f"{arch}.feed_forward_length": 48,
        f"{arch}.attention.head_count": 4, f"{arch}.attention.head_count_kv": 2,
        f"{arch}.attention.key_length": 8, f"{arch}.attention.value_length": 8,
        f"{arch}.attention.layer_norm_rms_epsilon": 1e-6, f"{arch}.vocab_size": 64,
    }
    md.update({f"{arch}.{k}": v for k, v in keys.items()})
    return md


def test_gemma2_defaults():
    hp = hparams_from_gguf("gemma2", metadata("gemma2", **{"rope.freq_base": 5e5}))
    assert (hp.n_swa, hp.swa_type, hp.swa_layers) == (4096, SWA_TYPE_STANDARD, swa_pattern(6, 2))
    assert (hp.f_attn_logit_softcapping, hp.f_final_logit_softcapping) == (50.0, 30.0)
    assert hp.rope_freq_base_train_swa == 5e5  # = rope.freq_base when absent
    assert hp.rope_freq_scale_train_swa == hp.rope_freq_scale_train == 1.0
    assert hp.rope_type == ROPE_TYPE_NEOX and hp.tied_output
    assert hp.f_attention_scale == float(np.float32(1) / np.sqrt(np.float32(8)))  # 1/sqrt(d)


def test_gemma3_reads_its_swa_keys_only_with_a_window():
    none = hparams_from_gguf("gemma3", metadata(
        "gemma3", **{"attention.sliding_window_pattern": "not even read"}))
    assert (none.n_swa, none.swa_type, none.swa_layers, none.is_swa_any()) == (
        0, SWA_TYPE_NONE, (), False)
    assert none.f_final_logit_softcapping == 0.0 and none.f_attn_logit_softcapping == 0.0
    hp = hparams_from_gguf("gemma3", metadata(
        "gemma3", **{"attention.sliding_window": 8, "rope.scaling.type": "linear",
                     "rope.scaling.factor": 8.0}))
    assert hp.swa_layers == swa_pattern(6, 6) == (True,) * 5 + (False,)
    assert hp.rope_freq_base_train_swa == 10000.0
    # the RoPE scaling is for the global layers only
    assert (hp.rope_freq_scale_train, hp.rope_freq_scale_train_swa) == (0.125, 1.0)


def test_pattern_array_wins_over_n_pattern_and_is_padded_with_dense_layers():
    flags = np.array([False, True, True], dtype=bool)
    hp = hparams_from_gguf("gemma2", metadata("gemma2", **{
        "attention.sliding_window_pattern": flags}))
    assert hp.swa_layers == (False, True, True, False, False, False)
    for dtype in (np.int32, np.uint32):
        hp = hparams_from_gguf("gemma3", metadata("gemma3", **{
            "attention.sliding_window": 4,
            "attention.sliding_window_pattern": np.array([1, 0, 2, 0, 0, 1, 1, 1], dtype)}))
        assert hp.swa_layers == (True, False, True, False, False, True)  # items past n_layer
    hp = hparams_from_gguf("gemma2", metadata("gemma2", **{"attention.sliding_window_pattern": 3}))
    assert hp.swa_layers == swa_pattern(6, 3) == (True, True, False, True, True, False)


@pytest.mark.parametrize(("arch", "keys", "message"), [
    ("gemma2", {"attention.sliding_window_pattern": np.ones(3, np.float32)},
     "key 'gemma2.attention.sliding_window_pattern': an array must hold bool, int32 or uint32"),
    ("gemma2", {"attention.sliding_window_pattern": np.ones(513, bool)},
     "513 items exceed LLAMA_MAX_LAYERS = 512"),
    ("gemma3", {"attention.sliding_window": 4, "attention.sliding_window_pattern": True},
     "must be a uint32 n_pattern or an array of per-layer flags, got True"),
    ("gemma2", {"attention.sliding_window": 0},
     "key 'gemma2.attention.sliding_window': must be > 0"),
    ("gemma2", {"attn_logit_softcapping": 0.0},
     "key 'gemma2.attn_logit_softcapping': must be > 0 \\(llama.cpp divides by it\\)"),
    ("gemma2", {"final_logit_softcapping": -1.0}, "final_logit_softcapping': must be > 0"),
    ("gemma2", {"rope.freq_base_swa": "x"}, "must be a number"),
])
def test_malformed_gemma_keys(arch, keys, message):
    with pytest.raises(GGUFError, match=message):
        hparams_from_gguf(arch, metadata(arch, **keys))


def test_gemma_and_gemma2_files_must_not_have_an_output_tensor():
    for arch in ("gemma", "gemma2"):
        with pytest.raises(GGUFError, match="has output.weight, but llama.cpp's"):
            hparams_from_gguf(arch, metadata(arch), ["token_embd.weight", "output.weight"])
    assert not hparams_from_gguf("gemma3", metadata("gemma3"), ["output.weight"]).tied_output


def test_attention_scale_is_derived_from_the_layer_count():
    """The 27B layer counts scale by n_embd / n_head, the others by the head size."""
    assert gemma_attention_scale("gemma2", 46, 4608, 32, 128) == float(
        np.float32(1) / np.sqrt(np.float32(144)))
    assert gemma_attention_scale("gemma3", 62, 5376, 32, 128) == float(
        np.float32(1) / np.sqrt(np.float32(168)))
    assert gemma_attention_scale("gemma3", 46, 4608, 32, 128) == float(
        np.float32(1) / np.sqrt(np.float32(128)))
    hp = hparams_from_gguf("gemma2", metadata("gemma2", block_count=46, embedding_length=48))
    assert hp.f_attention_scale == float(np.float32(1) / np.sqrt(np.float32(12)))


@pytest.mark.parametrize("kwargs", [
    dict(arch="gemma"),
    dict(arch="gemma2", n_swa=4, attn_softcap=2.0, final_softcap=3.0, freq_base_swa=5e4),
    dict(arch="gemma2", n_layer=5, swa_layers=(True, True, False, False, True)),
    dict(arch="gemma3", n_layer=7, n_swa=8, final_softcap=8.0, tied=False),
    dict(arch="gemma3", n_layer=3),
])
def test_metadata_round_trip(kwargs):
    hp = tiny_gemma_hparams(**kwargs)
    md = llama_metadata(hp)
    names = ["token_embd.weight"] + ([] if hp.tied_output else ["output.weight"])
    assert hparams_from_gguf(hp.arch, md, names) == hp


def test_llama_metadata_refuses_what_a_gemma_file_cannot_say():
    hp = tiny_gemma_hparams("gemma2", n_swa=4)
    cases = [
        (dict(tied_output=False), "gemma2: llama.cpp reuses token_embd as the output"),
        (dict(f_attention_scale=0.1), "attention scale 0.1 is not"),
        (dict(rope_type=ROPE_TYPE_NORM), "rope_type=0, but llama.cpp's gemma2 uses 2"),
        (dict(rope_freq_scale_train_swa=0.5), "rope_freq_scale_train_swa=0.5, but"),
        (dict(f_final_logit_softcapping=0.0), "both caps must be > 0"),
    ]
    for changes, message in cases:
        with pytest.raises(GGUFError, match=message):
            llama_metadata(dataclasses.replace(hp, **changes))
    with pytest.raises(HParamsError, match="n_embd_head_k=4 must equal n_embd_head_v=2"):
        dataclasses.replace(hp, n_embd_head_v=2)
    g3 = tiny_gemma_hparams("gemma3", n_swa=4)
    assert gguf_representable_errors(dataclasses.replace(g3, f_attn_logit_softcapping=5.0)) == [
        "attention soft-capping needs gemma2"]
    llama = dataclasses.replace(tiny_gemma_hparams("gemma", n_swa=0), arch="llama",
                                rope_type=ROPE_TYPE_NORM, swa_layers=(True, False))
    assert gguf_representable_errors(llama) == [
        "a per-layer SWA pattern (swa_layers) needs gemma2 or gemma3"]


# ---------------------------------------------------------------------------------------------
# HF configs


def hf_config(kind="Gemma2ForCausalLM", **changes):
    config = {
        "architectures": [kind], "vocab_size": 10, "hidden_size": 8, "num_hidden_layers": 4,
        "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 4,
        "intermediate_size": 16, "rms_norm_eps": 1e-6, "query_pre_attn_scalar": 4,
        "sliding_window": 3, "hidden_activation": "gelu_pytorch_tanh",
        "attn_logit_softcapping": 50.0, "final_logit_softcapping": 30.0,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
    }
    if kind == "Gemma3ForCausalLM":
        config["attn_logit_softcapping"] = None
    return {**config, **changes}


def test_hf_gemma2_config():
    hp = hparams_from_hf(hf_config())
    assert (hp.arch, hp.rope_type, hp.swa_layers, hp.n_swa) == (
        "gemma2", ROPE_TYPE_NEOX, (True, False, True, False), 3)
    assert (hp.f_attention_scale, hp.f_attn_logit_softcapping) == (0.5, 50.0)
    assert llama_metadata(hp)  # the file llama.cpp would get says the same
    # query_pre_attn_scalar other than the head size: the reference runs it, a GGUF cannot
    odd = hparams_from_hf(hf_config(query_pre_attn_scalar=9))
    assert np.isclose(odd.f_attention_scale, 1 / 3)
    with pytest.raises(GGUFError, match="query_pre_attn_scalar must be the head size"):
        llama_metadata(odd)


def test_hf_gemma3_older_config_keys():
    config = hf_config("Gemma3ForCausalLM", num_hidden_layers=7, rope_parameters=None,
                       rope_theta=1e6, rope_local_base_freq=2e4, sliding_window_pattern=3,
                       rope_scaling={"rope_type": "linear", "factor": 4.0},
                       attn_logit_softcapping=None, final_logit_softcapping=None)
    hp = gemma_hparams_from_hf(config)
    assert hp.swa_layers == swa_pattern(7, 3)
    assert (hp.rope_freq_base_train, hp.rope_freq_base_train_swa) == (1e6, 2e4)
    assert (hp.rope_freq_scale_train, hp.rope_freq_scale_train_swa) == (0.25, 1.0)
    assert (hp.f_attn_logit_softcapping, hp.f_final_logit_softcapping) == (0.0, 0.0)
    no_window = gemma_hparams_from_hf({**config, "sliding_window": None})
    assert (no_window.swa_type, no_window.swa_layers) == (SWA_TYPE_NONE, ())


@pytest.mark.parametrize(("kind", "changes", "message"), [
    ("Gemma2ForCausalLM", dict(hidden_activation="gelu"), "hidden activation 'gelu'"),
    ("Gemma2ForCausalLM", dict(attention_bias=True), "attention_bias=true"),
    ("Gemma2ForCausalLM", dict(tie_word_embeddings=False), "tie_word_embeddings=false"),
    ("Gemma2ForCausalLM", dict(sliding_window=None), "no sliding_window"),
    ("Gemma3ForCausalLM", dict(use_bidirectional_attention=True), "use_bidirectional_attention"),
    ("Gemma3ForCausalLM", dict(attn_logit_softcapping=20.0), "does not soft-cap attention"),
    ("Gemma3ForCausalLM", dict(rope_parameters={
        "full_attention": {"rope_type": "default", "rope_theta": 1e6},
        "sliding_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4}}),
     "does not scale the RoPE of the sliding layers"),
    ("Gemma3ForCausalLM", dict(rope_parameters={
        "full_attention": {"rope_type": "yarn", "factor": 2.0}}), "RoPE type 'yarn'"),
    ("Gemma3ForCausalLM", dict(layer_types=["full_attention"]),
     "layer_types must be 4 of"),
])
def test_hf_refuses_what_llama_cpp_does_not_compute(kind, changes, message):
    with pytest.raises(HFLoadError, match=message):
        hparams_from_hf(hf_config(kind, **changes))


def test_hf_gemma_legacy_gelu_is_the_tanh_gelu():
    config = hf_config("GemmaForCausalLM", hidden_act="gelu", hidden_activation=None)
    assert hparams_from_hf(config).arch == "gemma"


# ---------------------------------------------------------------------------------------------
# the simple cache's per-layer mask and the forward


def test_simple_cache_masks_only_the_swa_layers_by_the_window():
    hp = tiny_gemma_hparams("gemma3", n_layer=3, n_swa=2, swa_layers=(True, False, True))
    inp = SimpleKVCache(hp, n_ctx=8).init_batch(np.arange(5))
    causal = np.triu(np.full((5, 5), -np.inf, np.float32), 1)
    np.testing.assert_array_equal(inp.get_kq_mask(1), causal)
    windowed = causal + np.tril(np.full((5, 5), -np.inf, np.float32), -2)
    for il in (0, 2):
        np.testing.assert_array_equal(inp.get_kq_mask(il), windowed)


@settings(max_examples=15, deadline=None)
@given(arch=st.sampled_from(ARCHS), cuts=st.sets(st.integers(1, 19), max_size=5))
def test_ubatch_split_is_invisible(arch, cuts):
    hp, w = small_window(arch)
    tokens = np.random.default_rng(2).integers(0, hp.n_vocab, 20)
    edges = [0, *sorted(cuts), 20]
    chunks = [b - a for a, b in zip(edges, edges[1:], strict=False)]
    one = chunked_logits(w, hp, tokens)
    np.testing.assert_allclose(chunked_logits(w, hp, tokens, chunks), one, rtol=0, atol=1e-12)


@pytest.mark.parametrize("arch", ARCHS)
def test_out_ids_select_rows(arch):
    hp, w = small_window(arch)
    tokens, pos = np.arange(12) % hp.n_vocab, np.arange(12)
    full = gemma_forward(w, hp, tokens, pos, SimpleKVCache(hp, 12, np.float64).init_batch(pos))
    out_ids = np.array([11, 3, 7])
    part = gemma_forward(w, hp, tokens, pos, SimpleKVCache(hp, 12, np.float64).init_batch(pos),
                         out_ids)
    np.testing.assert_allclose(part, full[out_ids], atol=1e-12)


@pytest.mark.parametrize("arch", ["gemma2", "gemma3"])
def test_the_window_and_the_caps_change_the_logits(arch):
    """Each Gemma 2/3 feature is live: removing it changes the logits past the window."""
    hp, w = small_window(arch)
    tokens = np.random.default_rng(3).integers(0, hp.n_vocab, 16)
    ref = chunked_logits(w, hp, tokens)
    variants = {"window": dict(n_swa=0, swa_type=SWA_TYPE_NONE, swa_layers=())}
    if arch == "gemma2":
        variants["attn cap"] = dict(f_attn_logit_softcapping=0.0)
        variants["final cap"] = dict(f_final_logit_softcapping=0.0)
    for name, changes in variants.items():
        out = chunked_logits(w, dataclasses.replace(hp, **changes), tokens)
        assert np.abs(out - ref).max() > 1e-2, name
        if name == "window":  # inside the window: nothing differs
            np.testing.assert_allclose(out[: hp.n_swa], ref[: hp.n_swa], atol=1e-12)
    if arch == "gemma2":
        assert np.abs(ref).max() <= hp.f_final_logit_softcapping


def test_swa_layers_use_the_swa_rope_base():
    hp, w = small_window("gemma3", freq_base=1e6)
    tokens = np.random.default_rng(4).integers(0, hp.n_vocab, 12)
    ref = chunked_logits(w, hp, tokens)
    same_base = dataclasses.replace(hp, rope_freq_base_train_swa=1e6)
    assert np.abs(chunked_logits(w, same_base, tokens) - ref).max() > 1e-3


def test_embeddings_input_is_scaled_except_by_gemma3():
    for arch in ARCHS:
        hp, w = small_window(arch)
        tokens, pos = np.array([3, 1, 4, 1, 5]), np.arange(5)
        embd = w["token_embd.weight"][tokens]
        by_ids = gemma_forward(w, hp, tokens, pos, SimpleKVCache(hp, 5, np.float64).init_batch(pos))
        given_embd = embd * np.sqrt(hp.n_embd) if arch == "gemma3" else embd
        by_embd = gemma_forward(w, hp, None, pos, SimpleKVCache(hp, 5, np.float64).init_batch(pos),
                                embd=given_embd)
        np.testing.assert_allclose(by_embd, by_ids, atol=1e-9)


def test_float32_is_float64_rounded():
    hp, w64 = small_window("gemma2")
    w32 = {k: v.astype(np.float32) for k, v in w64.items()}
    tokens = np.random.default_rng(5).integers(0, hp.n_vocab, 16)
    out32 = chunked_logits(w32, hp, tokens)
    assert out32.dtype == np.float32
    w_back = {k: v.astype(np.float64) for k, v in w32.items()}
    assert np.abs(out32 - chunked_logits(w_back, hp, tokens)).max() < 1e-3


def test_forward_errors():
    hp, w = model("gemma2")
    pos = np.arange(2)
    with pytest.raises(LlamaForwardError, match="arch 'llama' is not one of"):
        gemma_forward(w, dataclasses.replace(hp, arch="llama"), [1, 2], pos, None)
    with pytest.raises(LlamaForwardError, match="token id 99 out of range"):
        gemma_forward(w, hp, [1, 99], pos, None)
    missing = {k: v for k, v in w.items() if "post_ffw_norm" not in k}
    with pytest.raises(LlamaForwardError, match="missing weight 'blk.0.post_ffw_norm.weight'"):
        llm_build_gemma(missing, hp, np.array([1, 2]), pos,
                        SimpleKVCache(hp, 2, np.float64).init_batch(pos), np.arange(2))


@pytest.mark.parametrize("arch", ARCHS)
def test_context_matches_the_simple_cache(arch):
    """Through reference.context.Context (the memory create_memory picks: the iSWA cache for
    Gemma 2/3 with a window, with a SWA cache smaller than the prompt) in ubatches of 3."""
    hp, w = small_window(arch)
    tokens = np.random.default_rng(6).integers(0, hp.n_vocab, 22)
    ref = chunked_logits(w, hp, tokens)
    for swa_full in (True, False):
        ctx = Context(hp, w, n_ctx=256, n_batch=8, n_ubatch=3, swa_full=swa_full,
                      dtype=np.float64)
        rows = []
        for start in range(0, len(tokens), 8):
            part = tokens[start : start + 8]
            batch = Batch(token=list(part), pos=list(range(start, start + len(part))),
                          logits=[True] * len(part))
            assert ctx.decode(batch) == 0
            rows += [ctx.get_logits_ith(i) for i in range(len(part))]
        np.testing.assert_allclose(np.array(rows), ref, rtol=0, atol=1e-10)
