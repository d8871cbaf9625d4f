"""The Llama forward against llama.cpp itself (llama-cpp-python), on random float32 GGUFs.

Each configuration is a tiny random model written with our GGUF writer and loaded by both
llama.cpp and :func:`reference.model_loader.load_model`. llama.cpp runs with an f32 KV cache and
flash attention off, so both sides compute the same float32 graph; what is left is the
summation order of the matmuls. Criteria (per configuration, for the prompt in one ubatch
and for one token per ubatch): NMSE of the logits <= 1e-6 and the same argmax everywhere.

Not covered here: a partial ``n_rot`` (llama.cpp's llama and qwen2 graphs assert
``n_rot == n_embd_head``) and the sliding window (llama.cpp's ``llama`` arch has no SWA
layers; Mistral's window is checked against transformers instead).
"""

from __future__ import annotations

import numpy as np
import pytest

from reference.model_loader import load_model
from tests.support.tiny_models import (
    llamacpp_logits,
    nmse,
    random_weights,
    reference_logits,
    tiny_hparams,
    write_tiny_gguf,
)

pytest.importorskip("llama_cpp")

N_TOKENS = 24

CONFIGS = {  # id -> (tiny_hparams kwargs, random_weights kwargs)
    "llama-mha-base1e4": (dict(n_head=4, n_head_kv=4, freq_base=10000.0), {}),
    "llama-gqa2-base5e5-tied": (dict(n_head=4, n_head_kv=2, freq_base=500000.0, tied=True), {}),
    "llama-gqa4-biases": (
        dict(n_embd=64, n_head=8, n_head_kv=2, n_ff=96),
        dict(out_ffn_bias=True),
    ),
    "qwen2-gqa2-base1e6": (dict(arch="qwen2", n_head=4, n_head_kv=2, freq_base=1e6), {}),
    "qwen2-gqa4-tied": (dict(arch="qwen2", n_head=4, n_head_kv=1, tied=True), {}),
}


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def tiny_gguf(request, tmp_path_factory):
    hp_kwargs, w_kwargs = CONFIGS[request.param]
    hp = tiny_hparams(n_vocab=64, n_embd=hp_kwargs.pop("n_embd", 32), **hp_kwargs)
    weights = random_weights(hp, seed=len(request.param), **w_kwargs)
    path = write_tiny_gguf(tmp_path_factory.mktemp("gguf") / f"{request.param}.gguf", hp, weights)
    tokens = np.random.default_rng(7).integers(0, hp.n_vocab, N_TOKENS)
    return path, tokens


@pytest.mark.oracle
@pytest.mark.parametrize("one_batch", [True, False], ids=["prompt", "token-by-token"])
def test_logits_match_llamacpp(tiny_gguf, one_batch):
    path, tokens = tiny_gguf
    hp, weights = load_model(path)
    ref = llamacpp_logits(path, tokens, one_batch=one_batch)
    out = reference_logits(weights, hp, tokens, one_batch=one_batch)
    assert out.shape == ref.shape == (N_TOKENS, hp.n_vocab)
    assert nmse(ref, out) <= 1e-6
    np.testing.assert_array_equal(out.argmax(-1), ref.argmax(-1))


@pytest.mark.oracle
def test_the_comparison_can_fail(tiny_gguf):
    """A wrong RoPE base is visible: the criterion is not vacuous."""
    import dataclasses

    path, tokens = tiny_gguf
    hp, weights = load_model(path)
    wrong = dataclasses.replace(hp, rope_freq_base_train=hp.rope_freq_base_train * 0.01)
    ref = llamacpp_logits(path, tokens)
    assert nmse(ref, reference_logits(weights, wrong, tokens)) > 1e-4


@pytest.mark.oracle
def test_llamacpp_ignores_the_sliding_window_of_a_llama_gguf(tmp_path):
    """Known divergence: ``llama.attention.sliding_window`` is read by us, ignored by llama.cpp.

    llama.cpp's ``llama`` architecture has no SWA layers, so a Mistral-style file with a window
    runs with full attention there. The specification applies the window (as transformers'
    Mistral does, see tests/oracle/test_transformers.py). Positions before the window fills
    agree; after it, llama.cpp equals our forward *without* the window.
    """
    import dataclasses

    from reference.hparams import SWA_TYPE_NONE

    n_swa = 4
    hp = tiny_hparams(n_vocab=64, n_embd=32, n_head=4, n_head_kv=2, n_swa=n_swa)
    weights = random_weights(hp, seed=3)
    path = write_tiny_gguf(tmp_path / "swa.gguf", hp, weights)
    hp_file, weights_file = load_model(path)
    assert hp_file.n_swa == n_swa  # the key is in the file and we read it
    tokens = np.random.default_rng(5).integers(0, hp.n_vocab, 12)
    theirs = llamacpp_logits(path, tokens)
    ours = reference_logits(weights_file, hp_file, tokens)
    no_window = dataclasses.replace(hp_file, n_swa=0, swa_type=SWA_TYPE_NONE)
    ours_full = reference_logits(weights_file, no_window, tokens)
    assert nmse(theirs[:n_swa], ours[:n_swa]) <= 1e-6  # window not yet full: no difference
    assert nmse(theirs[n_swa:], ours[n_swa:]) > 1e-4  # ours is windowed, theirs is not
    assert nmse(theirs, ours_full) <= 1e-6
