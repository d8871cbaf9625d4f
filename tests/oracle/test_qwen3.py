"""Qwen3 (per-head Q/K RMS norms) against transformers and llama.cpp.

Each case saves a seeded random ``Qwen3ForCausalLM`` with ``save_pretrained``, loads the folder
with :func:`reference.hf.load_hf` and compares the logits of a 24-token prompt with
transformers' (torch CPU, float32, eager): max abs difference <= 1e-4, for the prompt in one
ubatch, token by token, in chunks, and through the Context. The model is then written as a
GGUF by our writer: read back it gives the same logits bit for bit, and llama.cpp on that file
agrees to NMSE <= 1e-6 (f32 KV cache).

The random HF folders come from ``tests/support/tiny_models.py``'s ``save_random_hf``
(any HF causal LM class, parameters redrawn in NumPy from a seed).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pytest

from reference.batch import Batch
from reference.context import Context
from reference.hf import HFLoadError, hparams_from_hf, load_hf
from reference.model_loader import load_model
from tests.support.tiny_models import (
    chunked_logits,
    llamacpp_logits,
    nmse,
    reference_logits,
    save_random_hf,
    write_tiny_gguf,
)

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

N_TOKENS = 24
CHUNKS = [5, 1, 7, 11]


def hf_logits(path: str | Path, tokens) -> np.ndarray:
    """transformers' logits of every token (float32, eager attention)."""
    model = transformers.AutoModelForCausalLM.from_pretrained(
        str(path), attn_implementation="eager", dtype=torch.float32)
    model.eval()
    with torch.no_grad():
        return model(torch.tensor(np.asarray(tokens))[None]).logits[0].numpy()


def context_logits(hp, weights, tokens) -> np.ndarray:
    """Every token's logits through the reference Context, fed in :data:`CHUNKS`."""
    ctx = Context(hp, weights, n_ctx=64, n_batch=64, n_ubatch=8)
    rows, start = [], 0
    for n in CHUNKS:
        part = [int(t) for t in tokens[start:start + n]]
        assert ctx.decode(Batch(token=part, logits=[True] * n)) == 0, ctx.last_error
        rows.append(ctx.get_logits().copy())
        start += n
    return np.concatenate(rows)  # (n_tokens, n_vocab)


def check_against(path, ref, tokens, tmp_path) -> None:
    """The checks every HF model gets: one ubatch, token by token, chunks, the Context,
    max abs <= 1e-4 against transformers; the GGUF round trip bit for bit; llama.cpp on it."""
    hp, weights = load_hf(path)
    assert sum(CHUNKS) == len(tokens)
    for out in (reference_logits(weights, hp, tokens),
                reference_logits(weights, hp, tokens, one_batch=False),
                chunked_logits(weights, hp, tokens, CHUNKS),
                context_logits(hp, weights, tokens)):
        assert out.shape == ref.shape
        assert np.abs(out - ref).max() <= 1e-4
    gguf = write_tiny_gguf(tmp_path / "model.gguf", hp, weights)
    hp2, w2 = load_model(gguf)
    assert dataclasses.replace(hp2, n_ctx_orig_yarn=hp.n_ctx_orig_yarn) == hp
    np.testing.assert_array_equal(reference_logits(w2, hp2, tokens),
                                  reference_logits(weights, hp, tokens))
    assert nmse(reference_logits(w2, hp2, tokens), llamacpp_logits(gguf, tokens)) <= 1e-6


CASES = {
    "gqa2": {},
    "tied-mqa-base1e6": dict(tie_word_embeddings=True, num_key_value_heads=1,
                             rope_parameters={"rope_type": "default", "rope_theta": 1e6}),
    "head_dim16": dict(head_dim=16),
}


@pytest.fixture(scope="module", params=sorted(CASES))
def qwen3(request, tmp_path_factory):
    path = save_random_hf(tmp_path_factory.mktemp("qwen3") / request.param, "Qwen3ForCausalLM",
                          seed=3, **CASES[request.param])
    tokens = np.random.default_rng(5).integers(0, 40, N_TOKENS)
    return path, tokens, hf_logits(path, tokens)


@pytest.mark.oracle
def test_qwen3_matches_transformers_and_llamacpp(qwen3, tmp_path):
    path, tokens, ref = qwen3
    check_against(path, ref, tokens, tmp_path)


@pytest.mark.oracle
def test_qwen3_needs_its_qk_norms(qwen3):
    """Without the per-head norms (gains 1 and no normalisation) the logits differ: the
    criterion sees them."""
    path, tokens, ref = qwen3
    hp, weights = load_hf(path)
    as_qwen2 = dataclasses.replace(hp, arch="qwen2")
    assert np.abs(reference_logits(weights, as_qwen2, tokens) - ref).max() > 1e-2


def test_qwen3_config_is_read():
    base = {"architectures": ["Qwen3ForCausalLM"], "vocab_size": 10, "hidden_size": 8,
            "num_hidden_layers": 1, "num_attention_heads": 2, "num_key_value_heads": 1,
            "head_dim": 8, "intermediate_size": 16, "rms_norm_eps": 1e-6}
    hp = hparams_from_hf(base)
    assert (hp.arch, hp.rope_type, hp.n_embd_head_k, hp.n_rot) == ("qwen3", 2, 8, 8)
    no_head_dim = {k: v for k, v in base.items() if k != "head_dim"}
    assert hparams_from_hf(no_head_dim).n_embd_head_k == 128  # transformers' Qwen3 default
    with pytest.raises(HFLoadError, match="Qwen3 with use_sliding_window=true"):
        hparams_from_hf({**base, "use_sliding_window": True})
    with pytest.raises(HFLoadError, match="qwen3: attention_bias=true is not supported"):
        hparams_from_hf({**base, "attention_bias": True})
