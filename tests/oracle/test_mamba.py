"""Mamba and Mamba-2 against the real things: transformers (torch CPU) and llama.cpp.

Random ``MambaForCausalLM`` / ``Mamba2ForCausalLM`` models are saved with ``save_pretrained``,
loaded by :func:`reference.hf.load_hf`, then

- compared with transformers' logits (its pure-torch path; no CUDA kernels here): max abs
  difference <= 1e-4, for one prefill, token by token and chunked prefill;
- written as GGUF by our writer and run in llama.cpp (llama-cpp-python): NMSE <= 1e-6, for
  one prefill and token by token.

transformers' Mamba-1 cannot continue a cached sequence with a chunk of several tokens (its
torch scan takes no initial state and restarts from zero), so our chunked prefill is compared
with transformers' one-pass prefill; for Mamba-2 transformers' own chunked prefill is
compared too.
"""

from __future__ import annotations

import numpy as np
import pytest

from reference.arch import hparams_from_file
from reference.gguf import read_gguf
from reference.hf import HFLoadError, hparams_from_hf, load_hf
from tests.support.tiny_models import (
    llamacpp_logits,
    mamba_reference_logits,
    mamba_transformers_logits,
    nmse,
    random_mamba_weights,
    save_tiny_mamba_hf,
    tiny_mamba_hparams,
    write_tiny_mamba_gguf,
)

pytestmark = pytest.mark.oracle

CONFIGS = {
    "mamba-h32-s8": dict(kind="mamba", hidden_size=32, state_size=8),
    "mamba-h64-s16-tied": dict(kind="mamba", hidden_size=64, state_size=16,
                               tie_word_embeddings=True),
    "mamba2-h32-s8-g1-hd8": dict(kind="mamba2", hidden_size=32, state_size=8, n_groups=1,
                                 head_dim=8),
    "mamba2-h64-s16-g2-hd16": dict(kind="mamba2", hidden_size=64, state_size=16, n_groups=2,
                                   head_dim=16),
}
N_TOKENS = 13
CHUNKS = [5, 1, 4, 3]  # crosses Mamba-2's chunk_size=4 inside and between chunks
ATOL = 1e-4
NMSE_MAX = 1e-6


@pytest.fixture(scope="module", params=list(CONFIGS))
def hf_model(request, tmp_path_factory):
    """(folder, hparams, weights, tokens, transformers prefill logits, config) of a config."""
    pytest.importorskip("transformers")
    path = tmp_path_factory.mktemp(request.param)
    save_tiny_mamba_hf(path, seed=len(request.param), **CONFIGS[request.param])
    hp, weights = load_hf(path)
    tokens = np.random.default_rng(7).integers(0, hp.n_vocab, N_TOKENS)
    ref = mamba_transformers_logits(path, tokens)
    return path, hp, weights, tokens, ref, CONFIGS[request.param]


def test_loader_maps_the_config(hf_model):
    _, hp, weights, _, _, cfg = hf_model
    assert hp.arch == cfg["kind"]
    assert (hp.n_embd, hp.ssm_d_inner, hp.ssm_d_state) == (
        cfg["hidden_size"], 2 * cfg["hidden_size"], cfg["state_size"])
    assert hp.tied_output == ("output.weight" not in weights) == cfg.get(
        "tie_word_embeddings", False)
    assert all(np.all(weights[f"blk.{il}.ssm_a"] < 0) for il in range(hp.n_layer))
    if hp.arch == "mamba2":
        assert hp.ssm_n_group == cfg["n_groups"]
        assert hp.n_head() == 2 * cfg["hidden_size"] // cfg["head_dim"]


def test_transformers_prefill(hf_model):
    _, hp, weights, tokens, ref, _ = hf_model
    ours = mamba_reference_logits(weights, hp, tokens)
    assert np.abs(ours - ref).max() <= ATOL
    assert np.abs(ref).max() > 1.0  # logits that are not all near zero


def test_transformers_token_by_token(hf_model):
    path, hp, weights, tokens, ref, _ = hf_model
    ours = mamba_reference_logits(weights, hp, tokens, chunks=[1] * N_TOKENS)
    hf_steps = mamba_transformers_logits(path, tokens, chunks=[1] * N_TOKENS)
    assert np.abs(ours - hf_steps).max() <= ATOL
    assert np.abs(ours - ref).max() <= ATOL


def test_transformers_chunked_prefill(hf_model):
    path, hp, weights, tokens, ref, _ = hf_model
    ours = mamba_reference_logits(weights, hp, tokens, chunks=CHUNKS)
    assert np.abs(ours - ref).max() <= ATOL
    if hp.arch == "mamba2":  # transformers' Mamba-1 cannot continue a cache with a chunk
        hf_chunks = mamba_transformers_logits(path, tokens, chunks=CHUNKS)
        assert np.abs(ours - hf_chunks).max() <= ATOL


def test_llamacpp_prefill_and_token_by_token(hf_model, tmp_path):
    pytest.importorskip("llama_cpp")
    _, hp, weights, tokens, _, _ = hf_model
    gguf = write_tiny_mamba_gguf(tmp_path / "m.gguf", hp, weights)
    assert hparams_from_file(read_gguf(gguf)) == hp
    ours = mamba_reference_logits(weights, hp, tokens)
    assert nmse(llamacpp_logits(gguf, tokens), ours) <= NMSE_MAX
    ours_steps = mamba_reference_logits(weights, hp, tokens, chunks=[1] * N_TOKENS)
    assert nmse(llamacpp_logits(gguf, tokens, one_batch=False), ours_steps) <= NMSE_MAX


def test_llamacpp_dt_b_c_rms(tmp_path):
    """FalconMamba's flag: RMS-normalized dt, B and C (no HF class here: GGUF only)."""
    pytest.importorskip("llama_cpp")
    hp = tiny_mamba_hparams("mamba", n_embd=32, dt_b_c_rms=True)
    weights = random_mamba_weights(hp, seed=3)
    tokens = np.random.default_rng(1).integers(0, hp.n_vocab, 9)
    gguf = write_tiny_mamba_gguf(tmp_path / "falcon.gguf", hp, weights)
    ours = mamba_reference_logits(weights, hp, tokens)
    assert nmse(llamacpp_logits(gguf, tokens), ours) <= NMSE_MAX
    plain = mamba_reference_logits(weights, tiny_mamba_hparams("mamba", n_embd=32), tokens)
    assert nmse(ours, plain) > 1e-3  # the flag matters


def test_refuses_what_llamacpp_cannot_run():
    base = {"architectures": ["Mamba2ForCausalLM"], "vocab_size": 32, "hidden_size": 16,
            "num_hidden_layers": 1, "state_size": 8, "head_dim": 8}
    assert hparams_from_hf(base).n_head() == 4
    with pytest.raises(HFLoadError, match="use_bias"):
        hparams_from_hf({**base, "use_bias": True})
    with pytest.raises(HFLoadError, match="time_step_limit"):
        hparams_from_hf({**base, "time_step_limit": [0.0, 0.1]})
    with pytest.raises(HFLoadError, match="ssm_dt_rank"):
        hparams_from_hf({**base, "head_dim": 5})
