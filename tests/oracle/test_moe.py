"""Mixtures of experts (Mixtral, Qwen3-MoE) against transformers and llama.cpp.

Random ``MixtralForCausalLM`` / ``Qwen3MoeForCausalLM`` folders (``save_random_hf``) are
held to transformers, max abs <= 1e-4 in float32, for the prompt in one ubatch, token by
token, in chunks and through the Context; written as GGUF by our writer they read back bit
for bit and llama.cpp agrees to NMSE <= 1e-6. A Qwen3-MoE with ``norm_topk_prob = false``
matches transformers but cannot be written (llama.cpp's qwen3moe always normalises). Experts
stored as 3-D Q8_0 / Q4_0 tensors round-trip as stored and agree with llama.cpp by argmax
(>= 95 %) and KL divergence (<= 5e-3); transformers 5's fused ``gate_up_proj`` layout loads as
the per-expert one; a missing expert is named.

The tie order of the top-k (``ggml_argsort`` is ``std::sort``, not stable) is pinned by
llama.cpp itself: a router of zeros gives every expert the same probability; with 8 experts
llama.cpp picks experts 0 and 1 (insertion sort), with 32 experts 16 and 31 (introsort).
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from reference.arch import llama_metadata
from reference.gguf import GGUFError, write_gguf
from reference.hf import HFLoadError, hparams_from_hf, load_hf
from reference.model_loader import load_model
from reference.ops.moe import argsort_top_k
from reference.quants import GGMLQuantizationType, QuantizedTensor
from tests.oracle.test_qwen3 import N_TOKENS, check_against, hf_logits
from tests.support.tiny_models import (
    llamacpp_logits,
    nmse,
    random_weights,
    reference_logits,
    save_random_hf,
    tiny_hparams,
    write_tiny_gguf,
)

pytest.importorskip("transformers")

CASES = {
    "mixtral-4x2": ("MixtralForCausalLM", dict(num_local_experts=4, num_experts_per_tok=2)),
    "mixtral-8x3-tied": ("MixtralForCausalLM", dict(num_local_experts=8, num_experts_per_tok=3,
                                                    tie_word_embeddings=True)),
    "qwen3moe-8x2-norm": ("Qwen3MoeForCausalLM", dict(
        num_experts=8, num_experts_per_tok=2, moe_intermediate_size=16, head_dim=8,
        norm_topk_prob=True)),
}


@pytest.fixture(scope="module", params=sorted(CASES))
def moe(request, tmp_path_factory):
    cls, config = CASES[request.param]
    path = save_random_hf(tmp_path_factory.mktemp("moe") / request.param, cls, seed=4,
                          **config)
    tokens = np.random.default_rng(6).integers(0, 40, N_TOKENS)
    return path, tokens, hf_logits(path, tokens)


@pytest.mark.oracle
def test_moe_matches_transformers_and_llamacpp(moe, tmp_path):
    path, tokens, ref = moe
    check_against(path, ref, tokens, tmp_path)


@pytest.mark.oracle
def test_the_weights_normalisation_is_visible(moe):
    """Leaving the chosen weights unnormalised changes the logits: the criterion sees it."""
    path, tokens, ref = moe
    hp, weights = load_hf(path)
    assert hp.n_expert > 0 and hp.expert_weights_norm
    raw = dataclasses.replace(hp, expert_weights_norm=False)
    assert np.abs(reference_logits(weights, raw, tokens) - ref).max() > 1e-2


@pytest.mark.oracle
def test_qwen3moe_without_norm_topk_prob_matches_transformers_but_is_no_gguf(tmp_path):
    path = save_random_hf(tmp_path / "qwen3moe-raw", "Qwen3MoeForCausalLM", seed=4,
                          num_experts=8, num_experts_per_tok=2, moe_intermediate_size=16,
                          head_dim=8, norm_topk_prob=False)
    tokens = np.random.default_rng(6).integers(0, 40, N_TOKENS)
    hp, weights = load_hf(path)
    assert not hp.expert_weights_norm
    assert np.abs(reference_logits(weights, hp, tokens) - hf_logits(path, tokens)).max() <= 1e-4
    with pytest.raises(GGUFError, match="expert_weights_norm must be True"):
        llama_metadata(hp)


@pytest.mark.oracle
@pytest.mark.parametrize(("n_expert", "chosen"), [(8, [0, 1]), (32, [16, 31])])
def test_equal_router_probabilities_pick_experts_as_llamacpp(tmp_path, n_expert, chosen):
    hp = tiny_hparams("qwen3moe", n_vocab=64, n_embd=32, n_expert=n_expert, n_expert_used=2,
                      n_ff_exp=16)
    weights = random_weights(hp, seed=3)
    for il in range(hp.n_layer):
        weights[f"blk.{il}.ffn_gate_inp.weight"][:] = 0.0  # every expert 1/n_expert
    assert argsort_top_k(np.full((1, n_expert), 1.0 / n_expert), 2).tolist() == [chosen]
    path = write_tiny_gguf(tmp_path / "ties.gguf", hp, weights)
    tokens = np.random.default_rng(7).integers(0, 64, 12)
    out = reference_logits(weights, hp, tokens)
    assert nmse(llamacpp_logits(path, tokens), out) <= 1e-6
    if chosen != [0, 1]:
        # the order matters: experts 0, 1 (a stable sort's choice) in place of 16, 31 change
        # the logits (our forward on the swapped experts is the stable choice on these)
        perm = np.arange(n_expert)
        perm[[0, 1, *chosen]] = [*chosen, 0, 1]
        swapped = dict(weights)
        for name in weights:
            if "_exps." in name:
                swapped[name] = weights[name][perm]
        assert nmse(out, reference_logits(swapped, hp, tokens)) > 1e-3


def _kl(p_logits: np.ndarray, q_logits: np.ndarray) -> np.ndarray:
    """KL(P || Q) per row, from logits, in float64."""
    p = np.asarray(p_logits, np.float64)
    q = np.asarray(q_logits, np.float64)
    lp = p - p.max(-1, keepdims=True)
    lp -= np.log(np.exp(lp).sum(-1, keepdims=True))
    lq = q - q.max(-1, keepdims=True)
    lq -= np.log(np.exp(lq).sum(-1, keepdims=True))
    return (np.exp(lp) * (lp - lq)).sum(-1)


@pytest.mark.oracle
@pytest.mark.parametrize("qtype", [GGMLQuantizationType.Q8_0, GGMLQuantizationType.Q4_0],
                         ids=["q8_0", "q4_0"])
def test_quantized_experts_round_trip_and_run_in_llamacpp(tmp_path, qtype):
    """3-D quantized expert tensors: written and read back as stored, run one expert at a time
    (the values of their dequantization, bit for bit); llama.cpp, which also quantizes the
    activations inside its matmuls, agrees by argmax and KL divergence."""
    hp = tiny_hparams("qwen3moe", n_vocab=64, n_embd=64, n_expert=8, n_expert_used=2,
                      n_ff_exp=64)
    weights = random_weights(hp, seed=3)
    tensors = {k: QuantizedTensor.from_float(v, qtype) if "_exps" in k else v
               for k, v in weights.items()}
    path = tmp_path / "experts.gguf"
    write_gguf(str(path), llama_metadata(hp), tensors)
    hp2, w2 = load_model(path)
    assert all(hasattr(w2[k], "qtype") and len(w2[k].shape) == 3 for k in w2 if "_exps" in k)
    tokens = np.random.default_rng(7).integers(0, 64, N_TOKENS)
    out = reference_logits(w2, hp2, tokens)
    dense = {k: v.dequantize() if hasattr(v, "qtype") else v for k, v in w2.items()}
    np.testing.assert_array_equal(out, reference_logits(dense, hp2, tokens))
    ref = llamacpp_logits(path, tokens)
    assert (ref.argmax(-1) == out.argmax(-1)).mean() >= 0.95
    assert _kl(out, ref).mean() <= 5e-3


def test_the_fused_expert_layout_of_transformers_5_loads_as_the_per_expert_one(tmp_path):
    """transformers 5 holds Qwen3-MoE experts as ``mlp.experts.gate_up_proj`` (gate first) and
    ``mlp.experts.down_proj``; a folder saved that way gives the same GGUF tensors."""
    import shutil

    from safetensors.numpy import load_file, save_file

    path = save_random_hf(tmp_path / "per-expert", "Qwen3MoeForCausalLM", seed=4,
                          num_hidden_layers=1, num_experts=4, num_experts_per_tok=2,
                          moe_intermediate_size=16, head_dim=8, norm_topk_prob=True)
    hp, weights = load_hf(path)
    fused_dir = tmp_path / "fused"
    shutil.copytree(path, fused_dir)
    (st_file,) = fused_dir.glob("*.safetensors")
    tensors = load_file(str(st_file))
    e = "model.layers.0.mlp.experts"
    gate = np.stack([tensors.pop(f"{e}.{i}.gate_proj.weight") for i in range(4)])
    up = np.stack([tensors.pop(f"{e}.{i}.up_proj.weight") for i in range(4)])
    down = np.stack([tensors.pop(f"{e}.{i}.down_proj.weight") for i in range(4)])
    tensors[f"{e}.gate_up_proj"] = np.concatenate([gate, up], axis=1)  # (4, 2 * 16, 32)
    tensors[f"{e}.down_proj"] = down
    save_file(tensors, str(st_file))
    hp_fused, fused = load_hf(fused_dir)
    assert hp_fused == hp and sorted(fused) == sorted(weights)
    for name, w in weights.items():
        np.testing.assert_array_equal(fused[name], w)


def test_missing_experts_are_named(tmp_path):
    from safetensors.numpy import load_file, save_file

    path = save_random_hf(tmp_path / "m", "MixtralForCausalLM", seed=4, num_hidden_layers=1,
                          num_local_experts=4, num_experts_per_tok=2)
    (st_file,) = path.glob("*.safetensors")
    tensors = load_file(str(st_file))
    del tensors["model.layers.0.block_sparse_moe.experts.2.w3.weight"]
    save_file(tensors, str(st_file))
    with pytest.raises(HFLoadError, match=r"blk.0.ffn_up_exps.weight: experts \[0, 1, 3\]"):
        load_hf(path)


def test_moe_configs_are_read():
    base = {"vocab_size": 10, "hidden_size": 8, "num_hidden_layers": 1,
            "num_attention_heads": 2, "num_key_value_heads": 1, "intermediate_size": 16,
            "rms_norm_eps": 1e-6}
    mixtral = hparams_from_hf({**base, "architectures": ["MixtralForCausalLM"],
                               "num_local_experts": 4, "num_experts_per_tok": 2,
                               "sliding_window": None})
    assert (mixtral.arch, mixtral.n_expert, mixtral.n_expert_used, mixtral.n_ff_expert(),
            mixtral.rope_type, mixtral.expert_weights_norm) == ("llama", 4, 2, 16, 0, True)
    q = {**base, "architectures": ["Qwen3MoeForCausalLM"], "head_dim": 4,
         "num_local_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 6}
    hp = hparams_from_hf(q)
    assert (hp.arch, hp.n_expert, hp.n_ff_expert(), hp.expert_weights_norm) == (
        "qwen3moe", 8, 6, False)  # HF's default norm_topk_prob is false
    with pytest.raises(HFLoadError, match="qwen3moe: dense layers"):
        hparams_from_hf({**q, "mlp_only_layers": [0]})
    with pytest.raises(HFLoadError, match="qwen3moe: dense layers"):
        hparams_from_hf({**q, "decoder_sparse_step": 2})
