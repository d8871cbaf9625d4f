"""The HF loader and the Llama forward against transformers (torch CPU, float32, eager).

Each case saves a seeded random ``LlamaForCausalLM`` / ``Qwen2ForCausalLM`` /
``MistralForCausalLM`` with ``save_pretrained``, loads the folder with
:func:`reference.hf.load_hf` (GGUF names, llama's Q/K permuted for the normal RoPE mode) and
compares the logits of a 40-token prompt: max abs difference <= 1e-4.

Not covered: a partial ``partial_rotary_factor`` (transformers' Llama applies
``q * cos`` with ``cos`` of the rotated width only, which fails to broadcast; the partial
case is a property in ``test_llama.py`` instead).
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from reference.hf import HFLoadError, hparams_from_hf, load_hf
from tests.support.tiny_models import HF_CLASSES, reference_logits, save_tiny_hf

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

N_TOKENS = 40
LLAMA3 = dict(
    rope_type="llama3",
    factor=8.0,
    low_freq_factor=1.0,
    high_freq_factor=4.0,
    original_max_position_embeddings=16,
)

CASES = {
    "llama-gqa2": ("llama", {}),
    "llama-mqa-tied-base5e5": (
        "llama",
        dict(num_key_value_heads=1, tie_word_embeddings=True, rope_theta=500000.0),
    ),
    "llama-biases": ("llama", dict(attention_bias=True, mlp_bias=True)),
    "llama-head_dim": ("llama", dict(head_dim=16)),
    "llama-rope-linear": ("llama", dict(rope_parameters=dict(rope_type="linear", factor=2.0))),
    "llama-rope-llama3": ("llama", dict(rope_parameters=LLAMA3, rope_theta=500000.0)),
    "llama-rope-yarn": (
        "llama",
        dict(
            rope_parameters=dict(rope_type="yarn", factor=4.0, original_max_position_embeddings=64)
        ),
    ),
    "qwen2": ("qwen2", dict(rope_theta=1e6)),
    "qwen2-tied": ("qwen2", dict(tie_word_embeddings=True, num_key_value_heads=4)),
    "mistral-swa8": ("mistral", dict(sliding_window=8)),
}


def transformers_logits(path, tokens) -> np.ndarray:
    cls = getattr(transformers, HF_CLASSES[path.name.split("-")[0]])
    model = cls.from_pretrained(path, attn_implementation="eager", dtype=torch.float32)
    model.eval()
    with torch.no_grad():
        return model(torch.tensor(np.asarray(tokens))[None]).logits[0].numpy()


@pytest.fixture(scope="module", params=sorted(CASES))
def hf_dir(request, tmp_path_factory):
    kind, kwargs = CASES[request.param]
    path = tmp_path_factory.mktemp("hf") / f"{kind}-{request.param}"
    save_tiny_hf(path, kind, seed=3, **kwargs)
    tokens = np.random.default_rng(5).integers(0, 40, N_TOKENS)
    return path, tokens


@pytest.mark.oracle
def test_logits_match_transformers(hf_dir):
    path, tokens = hf_dir
    hp, weights = load_hf(path)
    ref = transformers_logits(path, tokens)
    out = reference_logits(weights, hp, tokens)
    assert out.shape == ref.shape
    assert np.abs(out - ref).max() <= 1e-4


@pytest.mark.oracle
def test_token_by_token_matches_transformers(hf_dir):
    path, tokens = hf_dir
    hp, weights = load_hf(path)
    ref = transformers_logits(path, tokens)
    out = reference_logits(weights, hp, tokens, one_batch=False)
    assert np.abs(out - ref).max() <= 1e-4


@pytest.mark.oracle
def test_sliding_window_is_what_makes_mistral_match(tmp_path):
    """Without the window the logits of positions >= sliding_window differ: SWA is tested."""
    path = save_tiny_hf(tmp_path / "mistral-swa", "mistral", seed=3, sliding_window=8)
    tokens = np.random.default_rng(5).integers(0, 40, N_TOKENS)
    hp, weights = load_hf(path)
    ref = transformers_logits(path, tokens)
    no_swa = dataclasses.replace(hp, n_swa=0, swa_type=0)
    out = reference_logits(weights, no_swa, tokens)
    assert np.abs(out[:8] - ref[:8]).max() <= 1e-4  # inside the window: identical
    assert np.abs(out[8:] - ref[8:]).max() > 1e-2


@pytest.mark.oracle
def test_unpermuted_llama_weights_do_not_match(tmp_path):
    """The Q/K permutation is needed: NEOX-layout rows under normal RoPE give other logits."""
    from reference.hf import permute

    path = save_tiny_hf(tmp_path / "llama-perm", "llama", seed=3)
    tokens = np.random.default_rng(5).integers(0, 40, N_TOKENS)
    hp, weights = load_hf(path)
    undone = dict(weights)
    for name, w in weights.items():
        if ".attn_q." in name or ".attn_k." in name:
            n = hp.n_head if ".attn_q." in name else hp.n_head_kv
            inverse = np.argsort(permute(np.arange(w.shape[0]), n))
            undone[name] = w[inverse]
    ref = transformers_logits(path, tokens)
    assert np.abs(reference_logits(undone, hp, tokens) - ref).max() > 1e-2


def test_refuses_unsupported_configs():
    base = {
        "architectures": ["LlamaForCausalLM"], "vocab_size": 10, "hidden_size": 8,
        "num_hidden_layers": 1, "num_attention_heads": 2, "intermediate_size": 16,
        "rms_norm_eps": 1e-5,
    }
    with pytest.raises(HFLoadError, match="unsupported RoPE type 'dynamic'"):
        hparams_from_hf({**base, "rope_parameters": {"rope_type": "dynamic", "factor": 2.0}})
    with pytest.raises(HFLoadError, match="unsupported architectures"):
        hparams_from_hf({**base, "architectures": ["GPT2LMHeadModel"]})
    with pytest.raises(HFLoadError, match="use_sliding_window"):
        hparams_from_hf({**base, "architectures": ["Qwen2ForCausalLM"], "use_sliding_window": True})
    # the older top-level keys are read too
    scaling = {"type": "linear", "factor": 4.0}
    old = hparams_from_hf({**base, "rope_theta": 123.0, "rope_scaling": scaling})
    assert (old.rope_freq_base_train, old.rope_freq_scale_train) == (123.0, 0.25)


def test_missing_files(tmp_path):
    with pytest.raises(HFLoadError, match="no config.json"):
        load_hf(tmp_path)
