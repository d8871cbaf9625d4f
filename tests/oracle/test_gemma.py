"""Gemma, Gemma 2, Gemma 3 against transformers and against llama.cpp.

**transformers** (torch CPU, eager attention): seeded random ``GemmaForCausalLM`` /
``Gemma2ForCausalLM`` / ``Gemma3ForCausalLM`` checkpoints with small windows (4 to 6) and a
32-token prompt, so that every SWA layer masks most of the prompt. Both sides compute in
float64 (transformers' Gemma norms still round to float32 inside: ``x.float()``), so the
differences are float32-sized (~1e-6 on logits of magnitude 1 to 30) and the bound, max abs
difference <= 1e-4, sits two orders above rounding and two below what any semantic slip gives
(a missing window, cap, norm or scale moves logits by > 1e-2, asserted below). Compared: the
prompt in one ubatch, token by token, in uneven chunks, and through
[`reference.context.Context`][reference.context.Context] (the iSWA memory, ubatches of 3).

**llama.cpp** (llama-cpp-python, f32 KV cache, no flash attention): random float32 GGUFs of
the three architectures written by our writer, 24-token prompts longer than the windows:
NMSE of the logits <= 1e-6 and the same argmax, prompt and token by token. ggml's GELU is a
float16 table (see ``reference.ops.ffn``), which costs ~1e-8 here. The comparison can fail:
ignoring the window, or flipping the per-layer pattern, costs NMSE > 1e-4. And a HF checkpoint
written as a GGUF by our writer runs in llama.cpp as transformers runs the checkpoint.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from reference.batch import Batch
from reference.context import Context
from reference.gguf import GGUFError
from reference.hf import load_hf
from reference.hparams import SWA_TYPE_NONE
from reference.model_loader import load_model
from tests.support.tiny_models import (
    chunked_logits,
    llamacpp_logits,
    nmse,
    random_gemma_weights,
    save_tiny_gemma_hf,
    tiny_gemma_hparams,
    write_tiny_gguf,
)

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
pytest.importorskip("llama_cpp")

N_HF_TOKENS = 32
GEMMA3_ROPE = {
    "full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 1e6},
    "sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
}

HF_CASES = {  # id -> (kind, config changes)
    "gemma-gqa2": ("gemma", {}),
    "gemma2-swa6-caps2-5": (
        "gemma2", dict(sliding_window=6, attn_logit_softcapping=2.0, final_logit_softcapping=5.0)
    ),
    "gemma2-swa4-mqa-default-caps": ("gemma2", dict(sliding_window=4, num_key_value_heads=1)),
    "gemma3-swa5-7layers-linear-cap8": (
        "gemma3",
        dict(sliding_window=5, num_hidden_layers=7, rope_parameters=GEMMA3_ROPE,
             final_logit_softcapping=8.0),
    ),
    "gemma3-layer_types-untied-qpas16": (
        "gemma3",
        dict(sliding_window=4, tie_word_embeddings=False, query_pre_attn_scalar=16,
             layer_types=["full_attention", "sliding_attention", "sliding_attention",
                          "full_attention"]),
    ),
    "gemma3-all-global": (
        "gemma3", dict(sliding_window=4, layer_types=["full_attention"] * 4)
    ),
}


def transformers_logits(path, tokens) -> np.ndarray:
    model = transformers.AutoModelForCausalLM.from_pretrained(
        path, attn_implementation="eager", dtype=torch.float64
    )
    model.eval()
    with torch.no_grad():
        return model(torch.tensor(np.asarray(tokens))[None]).logits[0].numpy()


@pytest.fixture(scope="module", params=sorted(HF_CASES))
def hf_case(request, tmp_path_factory):
    """The checkpoint, the prompt and transformers' logits (computed once per case)."""
    kind, changes = HF_CASES[request.param]
    path = save_tiny_gemma_hf(tmp_path_factory.mktemp("hf") / request.param, kind, seed=3,
                              **changes)
    tokens = np.random.default_rng(5).integers(0, 40, N_HF_TOKENS)
    return path, tokens, transformers_logits(path, tokens)


@pytest.mark.oracle
@pytest.mark.parametrize("chunks", [None, [1] * N_HF_TOKENS, [5, 7, 1, 19]],
                         ids=["prompt", "token-by-token", "chunked"])
def test_logits_match_transformers(hf_case, chunks):
    path, tokens, ref = hf_case
    hp, weights = load_hf(path, dtype=np.float64)
    out = chunked_logits(weights, hp, tokens, chunks)
    assert out.shape == ref.shape == (N_HF_TOKENS, hp.n_vocab)
    assert np.abs(out - ref).max() <= 1e-4


@pytest.mark.oracle
def test_context_matches_transformers(hf_case):
    """The same through the Context and the memory create_memory picks (iSWA for a window),
    8-token batches split into ubatches of 3, the SWA cache sized to the window."""
    path, tokens, ref = hf_case
    hp, weights = load_hf(path, dtype=np.float64)
    ctx = Context(hp, weights, n_ctx=256, n_batch=8, n_ubatch=3, swa_full=False,
                  dtype=np.float64)
    rows = []
    for start in range(0, N_HF_TOKENS, 8):
        part = tokens[start : start + 8]
        batch = Batch(token=list(part), pos=list(range(start, start + len(part))),
                      logits=[True] * len(part))
        assert ctx.decode(batch) == 0
        rows += [ctx.get_logits_ith(i) for i in range(len(part))]
    assert np.abs(np.array(rows) - ref).max() <= 1e-4


@pytest.mark.oracle
def test_every_gemma_feature_is_needed_to_match_transformers(hf_case):
    """Dropping the window, a cap, the RMS norm's +1 or the query scale breaks the match:
    the comparison above is not vacuous."""
    path, tokens, ref = hf_case
    hp, weights = load_hf(path, dtype=np.float64)
    variants = {"+1 of the norms": (hp, {k: (v - 1 if "norm" in k else v)
                                         for k, v in weights.items()})}
    if hp.arch != "gemma":
        variants["query scale"] = (dataclasses.replace(hp, f_attention_scale=0.5), weights)
    if hp.is_swa_any():
        no_window = dataclasses.replace(hp, n_swa=0, swa_type=SWA_TYPE_NONE, swa_layers=())
        variants["window"] = (no_window, weights)
    if hp.f_attn_logit_softcapping and hp.f_attn_logit_softcapping < 10:
        variants["attn cap"] = (dataclasses.replace(hp, f_attn_logit_softcapping=0.0), weights)
    if hp.f_final_logit_softcapping and hp.f_final_logit_softcapping < 10:
        variants["final cap"] = (dataclasses.replace(hp, f_final_logit_softcapping=0.0), weights)
    for name, (hp_v, w_v) in variants.items():
        assert np.abs(chunked_logits(w_v, hp_v, tokens) - ref).max() > 1e-2, name


@pytest.mark.oracle
def test_hf_checkpoint_as_our_gguf_runs_in_llamacpp_like_transformers(hf_case, tmp_path):
    """HF -> our loader -> our GGUF writer -> llama.cpp, held to transformers; where the
    config says what a GGUF cannot (query_pre_attn_scalar other than the head size), the
    writer refuses instead of writing another model."""
    path, tokens, ref = hf_case
    hp, weights = load_hf(path)
    if path.name.endswith("qpas16"):
        with pytest.raises(GGUFError, match="query_pre_attn_scalar must be the head size"):
            write_tiny_gguf(tmp_path / "m.gguf", hp, weights)
        return
    gguf = write_tiny_gguf(tmp_path / "m.gguf", hp, weights)
    assert nmse(ref, llamacpp_logits(gguf, tokens)) <= 1e-6


# ---------------------------------------------------------------------------------------------
# llama.cpp on GGUFs written by our writer

N_TOKENS = 24
GGUF_CONFIGS = {  # id -> tiny_gemma_hparams kwargs
    "gemma-gqa2": dict(arch="gemma"),
    "gemma2-swa4-caps1.5-5": dict(arch="gemma2", n_layer=4, n_swa=4, attn_softcap=1.5,
                                  final_softcap=5.0),
    "gemma2-swa5-mha-default-caps": dict(arch="gemma2", n_layer=3, n_head_kv=4, n_swa=5),
    "gemma3-swa4-7layers-base1e6": dict(arch="gemma3", n_layer=7, n_swa=4, freq_base=1e6),
    "gemma3-pattern-array-untied-cap8": dict(
        arch="gemma3", n_layer=4, n_swa=5, swa_layers=(True, False, False, True), tied=False,
        final_softcap=8.0, freq_base_swa=3e4),
    "gemma3-no-window": dict(arch="gemma3", n_layer=3),
}


@pytest.fixture(scope="module", params=sorted(GGUF_CONFIGS))
def tiny_gguf(request, tmp_path_factory):
    hp = tiny_gemma_hparams(n_vocab=64, n_embd=32, **GGUF_CONFIGS[request.param])
    weights = random_gemma_weights(hp, seed=len(request.param))
    path = write_tiny_gguf(tmp_path_factory.mktemp("gguf") / f"{request.param}.gguf", hp, weights)
    tokens = np.random.default_rng(7).integers(0, hp.n_vocab, N_TOKENS)
    return path, tokens, hp


@pytest.mark.oracle
@pytest.mark.parametrize("one_batch", [True, False], ids=["prompt", "token-by-token"])
def test_logits_match_llamacpp(tiny_gguf, one_batch):
    path, tokens, written = tiny_gguf
    hp, weights = load_model(path)
    assert hp == written  # what we wrote is what we read
    ref = llamacpp_logits(path, tokens, one_batch=one_batch)
    out = chunked_logits(weights, hp, tokens, None if one_batch else [1] * N_TOKENS)
    assert out.shape == ref.shape == (N_TOKENS, hp.n_vocab)
    assert nmse(ref, out) <= 1e-6
    np.testing.assert_array_equal(out.argmax(-1), ref.argmax(-1))


@pytest.mark.oracle
@pytest.mark.parametrize("config", [c for c in sorted(GGUF_CONFIGS) if "swa" in c])
def test_the_comparison_fails_when_the_window_is_ignored(config, tmp_path):
    """Without the window (or with the pattern flipped) our logits leave llama.cpp's."""
    hp = tiny_gemma_hparams(n_vocab=64, n_embd=32, **GGUF_CONFIGS[config])
    path = write_tiny_gguf(tmp_path / "m.gguf", hp, random_gemma_weights(hp, seed=1))
    tokens = np.random.default_rng(7).integers(0, hp.n_vocab, N_TOKENS)
    hp, weights = load_model(path)
    assert hp.is_swa_any() and not hp.is_swa_all()
    ref = llamacpp_logits(path, tokens)
    # the same SWA layers (and their RoPE base), with a window wider than the prompt
    no_window = chunked_logits(weights, dataclasses.replace(hp, n_swa=10**6), tokens)
    assert nmse(ref[: hp.n_swa], no_window[: hp.n_swa]) <= 1e-6  # the window is not full yet
    assert nmse(ref, no_window) > 1e-4
    flipped = dataclasses.replace(hp, swa_layers=tuple(not s for s in hp.swa_layers))
    assert nmse(ref, chunked_logits(weights, flipped, tokens)) > 1e-4
