"""LoRA adapters against llama.cpp applying them (llama-cpp-python 0.3.36).

Each case is a tiny random float32 model written with our GGUF writer and an adapter with
random non-zero $A$ and $B$ written by ``save_lora_gguf``; llama.cpp loads both
(``Llama(model_path=..., lora_path=..., lora_scale=...)``: ``llama_adapter_lora_init`` then
``llama_set_adapters_lora``) and applies the adapter per matmul (``build_lora_mm``). We
compute the logits of the merged weights ``lora_weights``. Criteria as for the base model
(tests/oracle/test_llamacpp.py): NMSE <= 1e-6 and the same argmax, with an f32 KV cache; and
the adapter must matter (NMSE between the base and the adapted logits > 1e-2), so the
agreement is not the base model's agreement again.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from gguf import GGMLQuantizationType

from reference.arch import llama_metadata
from reference.gguf import write_gguf
from reference.model_loader import load_model
from reference.quants import QuantizedTensor
from reference.training.lora import (
    LORA_TARGET_KINDS,
    LoraError,
    LoraFileError,
    init_lora,
    load_lora_gguf,
    lora_weights,
    merge_lora,
    save_lora_gguf,
)
from tests.support.tiny_models import (
    llamacpp_logits,
    nmse,
    random_weights,
    reference_logits,
    tiny_hparams,
    write_tiny_gguf,
)

pytest.importorskip("llama_cpp")

N_TOKENS = 16

MODELS = {  # id -> tiny_hparams kwargs
    "llama-gqa2": dict(n_head=4, n_head_kv=2),
    "llama-tied": dict(n_head=4, n_head_kv=4, tied=True),
    "qwen2-gqa2": dict(arch="qwen2", n_head=4, n_head_kv=2),
}

ADAPTERS = {  # id -> (rank, alpha, adapter_scale, targets)
    "r4-a16": (4, 16.0, 1.0, None),  # s = 4
    "r3-alpha0": (3, 0.0, 1.0, ("attn_q", "attn_v", "ffn_down")),  # alpha 0: s = adapter_scale
    "r2-a3-scale0.5-all": (2, 3.0, 0.5, LORA_TARGET_KINDS),  # s = 0.75, the lm_head too
}


def _llamacpp_loads_adapter(model_path, lora_path) -> bool:
    """Whether ``llama_adapter_lora_init`` accepts the adapter for the model.

    Low-level on purpose: llama-cpp-python 0.3.36's ``Llama(lora_path=...)`` tests the
    returned pointer with ``is None``, but ctypes gives a NULL ``POINTER`` object, so a refused
    adapter reaches ``llama_set_adapters_lora`` as NULL and the process dies (SIGSEGV).
    """
    import llama_cpp

    llama_cpp.llama_backend_init()
    params = llama_cpp.llama_model_default_params()
    model = llama_cpp.llama_model_load_from_file(str(model_path).encode(), params)
    assert model, f"llama.cpp cannot load {model_path}"
    try:
        adapter = llama_cpp.llama_adapter_lora_init(model, str(lora_path).encode())
        if adapter:
            llama_cpp.llama_adapter_lora_free(adapter)
        return bool(adapter)
    finally:
        llama_cpp.llama_model_free(model)


def _random_adapter(weights, hp, rank, alpha, targets, seed):
    """An adapter with random A and B (B = 0 would test nothing), |s B A| ~ 0.3 |W|."""
    kw = {} if targets is None else dict(targets=tuple(t for t in targets
                                                     if not (t == "output" and hp.tied_output)))
    adapter = init_lora(weights, hp, rank, alpha, seed=seed, **kw)
    rng = np.random.default_rng(seed + 1)
    s = alpha / rank if alpha else 1.0
    for name in adapter.targets:
        a, b = adapter.a(name), adapter.b(name)
        n_in = a.shape[1]
        adapter.tensors[name + ".lora_a"] = rng.normal(0, 1 / np.sqrt(n_in), a.shape).astype(
            np.float32)
        adapter.tensors[name + ".lora_b"] = rng.normal(0, 0.3 / (s * np.sqrt(rank)), b.shape
                                                       ).astype(np.float32)
    return adapter


@pytest.fixture(scope="module", params=sorted(MODELS))
def tiny_model(request, tmp_path_factory):
    hp = tiny_hparams(n_vocab=64, n_embd=32, **MODELS[request.param])
    weights = random_weights(hp, seed=len(request.param))
    path = write_tiny_gguf(tmp_path_factory.mktemp("lora") / f"{request.param}.gguf", hp, weights)
    tokens = np.random.default_rng(3).integers(0, hp.n_vocab, N_TOKENS)
    return path, tokens


@pytest.mark.oracle
@pytest.mark.parametrize("case", sorted(ADAPTERS))
def test_adapter_logits_match_llamacpp(tiny_model, case, tmp_path):
    path, tokens = tiny_model
    hp, weights = load_model(path)
    rank, alpha, adapter_scale, targets = ADAPTERS[case]
    adapter = _random_adapter(weights, hp, rank, alpha, targets, seed=rank)
    save_lora_gguf(tmp_path / "lora.gguf", adapter)
    theirs = llamacpp_logits(path, tokens, lora_path=tmp_path / "lora.gguf",
                             lora_scale=adapter_scale)
    ours = reference_logits(lora_weights(weights, adapter, adapter_scale), hp, tokens)
    base = reference_logits(weights, hp, tokens)
    assert nmse(base, ours) > 1e-2  # the adapter matters
    assert nmse(theirs, ours) <= 1e-6
    np.testing.assert_array_equal(theirs.argmax(-1), ours.argmax(-1))


@pytest.mark.oracle
def test_an_adapter_on_a_quantized_base(tmp_path):
    """Q8_0 projections, an F32 adapter: what ``finetune --lora`` on SmolLM2 produces.

    llama.cpp quantizes the activations of the Q8_0 matmuls $W x$ (to Q8_0), not those of the
    adapter's F32 matmuls; we dequantize $W$ and add $sBA$. So the criterion is the quantized
    one (argmax agreement, NMSE <= 1e-3): measured 1.2e-4 adapted, 9e-5 for the base alone,
    against 0.25 between the base and the adapted model.
    """
    hp = tiny_hparams(n_vocab=64, n_embd=64, n_head=4, n_head_kv=2, n_ff=96)
    w = random_weights(hp, seed=2)
    quantized = {name: QuantizedTensor.from_float(t, GGMLQuantizationType.Q8_0)
                 if name.startswith("blk.") and t.ndim == 2 else t for name, t in w.items()}
    write_gguf(tmp_path / "q8.gguf", llama_metadata(hp), quantized)
    hp, weights = load_model(tmp_path / "q8.gguf")
    assert isinstance(weights["blk.0.attn_q.weight"], QuantizedTensor)
    tokens = np.random.default_rng(3).integers(0, hp.n_vocab, N_TOKENS)
    adapter = _random_adapter(weights, hp, 4, 16.0, None, seed=4)
    save_lora_gguf(tmp_path / "lora.gguf", adapter)
    theirs = llamacpp_logits(tmp_path / "q8.gguf", tokens, lora_path=tmp_path / "lora.gguf")
    ours = reference_logits(lora_weights(weights, adapter), hp, tokens)
    assert nmse(reference_logits(weights, hp, tokens), ours) > 1e-2
    assert nmse(theirs, ours) <= 1e-3
    assert (theirs.argmax(-1) == ours.argmax(-1)).mean() >= 0.9


@pytest.mark.oracle
def test_a_merged_model_equals_llamacpp_applying_the_adapter(tiny_model, tmp_path):
    """``merge_lora`` (``llama-export-lora``'s $W + s BA$) written as a plain model."""
    path, tokens = tiny_model
    hp, weights = load_model(path)
    adapter = _random_adapter(weights, hp, 4, 16.0, None, seed=5)
    save_lora_gguf(tmp_path / "lora.gguf", adapter)
    merged = write_tiny_gguf(tmp_path / "merged.gguf", hp, merge_lora(weights, adapter, 0.5))
    theirs = llamacpp_logits(path, tokens, lora_path=tmp_path / "lora.gguf", lora_scale=0.5)
    assert nmse(theirs, llamacpp_logits(merged, tokens)) <= 1e-6
    assert nmse(theirs, llamacpp_logits(path, tokens)) > 1e-2


@pytest.mark.oracle
def test_the_comparison_can_fail(tiny_model, tmp_path):
    """A wrong alpha is visible in the logits; a wrong layout or arch is refused by both sides."""
    path, tokens = tiny_model
    hp, weights = load_model(path)
    adapter = _random_adapter(weights, hp, 4, 16.0, None, seed=4)
    save_lora_gguf(tmp_path / "lora.gguf", adapter)
    theirs = llamacpp_logits(path, tokens, lora_path=tmp_path / "lora.gguf")
    wrong = dataclasses.replace(adapter, alpha=8.0)
    assert nmse(theirs, reference_logits(lora_weights(weights, wrong), hp, tokens)) > 1e-4

    # A stored as (n_in, rank), B A undefined: llama.cpp refuses it, and so do we.
    tensors = dict(adapter.tensors)
    name = adapter.targets[0]
    tensors[name + ".lora_a"] = np.ascontiguousarray(tensors[name + ".lora_a"].T)
    md = {"general.architecture": hp.arch, "general.type": "adapter", "adapter.type": "lora",
          "adapter.lora.alpha": 16.0}
    write_gguf(tmp_path / "transposed.gguf", md, tensors)
    assert _llamacpp_loads_adapter(path, tmp_path / "lora.gguf")  # the helper can say yes
    assert not _llamacpp_loads_adapter(path, tmp_path / "transposed.gguf")
    with pytest.raises(LoraFileError, match="not transposed"):
        load_lora_gguf(tmp_path / "transposed.gguf")

    # An adapter of another architecture: llama.cpp refuses it, and so do we.
    other = dataclasses.replace(adapter, arch="qwen2" if hp.arch == "llama" else "llama")
    save_lora_gguf(tmp_path / "other.gguf", other)
    assert not _llamacpp_loads_adapter(path, tmp_path / "other.gguf")
    with pytest.raises(LoraError, match="arch mismatch"):
        load_lora_gguf(tmp_path / "other.gguf", weights, hp)
