"""Laws of the Llama forward (float64, so rounding is out of the way) and its errors.

The oracles (llama.cpp, transformers) check the numbers; these check the structure: the
memory makes ubatch boundaries invisible, ``out_ids`` only selects rows, GQA is MHA with
shared heads, attention is causal and windowed, the HF Q/K permutation turns NeoX RoPE into
normal RoPE (also for a partial ``n_rot``), quantized weights are used as their dequantized
values.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from gguf import GGMLQuantizationType
from hypothesis import given
from hypothesis import strategies as st

from reference.hf import permute
from reference.hparams import ROPE_TYPE_NEOX, ROPE_TYPE_NORM
from reference.model_loader import load_model
from reference.models.llama import LlamaForwardError, greedy, llama_forward
from reference.models.simple_cache import KVCacheError, SimpleKVCache, build_kq_mask
from reference.quants import QuantizedTensor, quantize
from tests.support.tiny_models import (
    random_weights,
    reference_logits,
    tiny_hparams,
    write_tiny_gguf,
)

F64 = np.float64
TOL = 1e-10


def model(seed=0, **kwargs):
    hp = tiny_hparams(**kwargs)
    return hp, random_weights(hp, seed=seed, dtype=F64)


def tokens_for(hp, n, seed=1):
    return np.random.default_rng(seed).integers(0, hp.n_vocab, n)


@given(
    st.lists(st.integers(1, 5), min_size=1, max_size=5),
    st.sampled_from(["llama", "qwen2"]),
    st.integers(0, 3),
)
def test_ubatch_split_is_invisible(chunks, arch, seed):
    """Decoding a sequence in any chunks gives the logits of one ubatch (the memory's job)."""
    hp, w = model(seed, arch=arch)
    n = sum(chunks)
    tokens = tokens_for(hp, n, seed)
    full = reference_logits(w, hp, tokens)
    cache = SimpleKVCache(hp, n, F64)
    rows, start = [], 0
    for c in chunks:
        pos = np.arange(start, start + c)
        rows.append(llama_forward(w, hp, tokens[start : start + c], pos, cache.init_batch(pos)))
        start += c
    np.testing.assert_allclose(np.concatenate(rows), full, rtol=0, atol=TOL)


@given(st.lists(st.integers(0, 9), min_size=1, max_size=10, unique=True))
def test_out_ids_select_rows(out_ids):
    hp, w = model()
    tokens = tokens_for(hp, 10)
    full = reference_logits(w, hp, tokens)
    pos = np.arange(10)
    some = llama_forward(w, hp, tokens, pos, SimpleKVCache(hp, 10, F64).init_batch(pos), out_ids)
    np.testing.assert_allclose(some, full[out_ids], rtol=0, atol=TOL)


def test_float32_is_float64_rounded():
    hp, w64 = model()
    w32 = {k: v.astype(np.float32) for k, v in w64.items()}
    tokens = tokens_for(hp, 12)
    out64, out32 = reference_logits(w64, hp, tokens), reference_logits(w32, hp, tokens)
    assert out64.dtype == F64 and out32.dtype == np.float32
    np.testing.assert_allclose(out32, out64, rtol=0, atol=1e-4)


@pytest.mark.parametrize("n_head_kv", [1, 2])
def test_gqa_is_mha_with_shared_kv_heads(n_head_kv):
    """K/V heads repeated per group (head h reads KV head h // n_gqa) make an MHA model."""
    hp, w = model(n_head=4, n_head_kv=n_head_kv)
    hp_mha = dataclasses.replace(hp, n_head_kv=4)
    w_mha = dict(w)
    d, n_gqa = hp.n_embd_head_k, hp.n_gqa()
    for il in range(hp.n_layer):
        for t in ("attn_k", "attn_v"):
            x = w[f"blk.{il}.{t}.weight"].reshape(n_head_kv, d, hp.n_embd)
            w_mha[f"blk.{il}.{t}.weight"] = np.repeat(x, n_gqa, axis=0).reshape(-1, hp.n_embd)
    tokens = tokens_for(hp, 9)
    np.testing.assert_allclose(
        reference_logits(w, hp, tokens), reference_logits(w_mha, hp_mha, tokens), atol=TOL
    )


@given(st.integers(0, 8), st.integers(0, 31))
def test_causal(i, new_token):
    """Changing the token at position i changes no logits before i."""
    hp, w = model()
    tokens = tokens_for(hp, 9)
    changed = tokens.copy()
    changed[i] = new_token
    a, b = reference_logits(w, hp, tokens), reference_logits(w, hp, changed)
    np.testing.assert_allclose(a[:i], b[:i], rtol=0, atol=TOL)


@given(st.integers(1, 6), st.integers(0, 11), st.integers(0, 31))
def test_sliding_window(n_swa, i, new_token):
    """One layer with window n_swa: logits at p depend on tokens p - n_swa + 1 .. p only."""
    hp, w = model(n_layer=1, n_swa=n_swa)
    tokens = tokens_for(hp, 12)
    changed = tokens.copy()
    changed[i] = new_token
    a, b = reference_logits(w, hp, tokens), reference_logits(w, hp, changed)
    unaffected = [p for p in range(12) if p < i or p - i >= n_swa]
    np.testing.assert_allclose(a[unaffected], b[unaffected], rtol=0, atol=TOL)


def test_window_wider_than_sequence_changes_nothing():
    hp, w = model()
    tokens = tokens_for(hp, 10)
    hp_swa = dataclasses.replace(hp, n_swa=10, swa_type=1)
    np.testing.assert_allclose(
        reference_logits(w, hp, tokens), reference_logits(w, hp_swa, tokens), atol=TOL
    )


def test_tied_output_is_token_embd():
    hp, w = model()
    tied = {k: v for k, v in w.items() if k != "output.weight"}
    untied = {**tied, "output.weight": w["token_embd.weight"]}
    tokens = tokens_for(hp, 7)
    hp_tied = dataclasses.replace(hp, tied_output=True)
    np.testing.assert_array_equal(
        reference_logits(tied, hp_tied, tokens), reference_logits(untied, hp, tokens)
    )


@pytest.mark.parametrize("n_rot", [8, 4, 2])
def test_permuted_normal_rope_is_neox_rope(n_rot):
    """HF's layout under NeoX RoPE == permuted rows under normal RoPE, partial n_rot too."""
    hp_neox, w = model(n_embd=32, n_head=4, n_head_kv=2, n_rot=n_rot)
    hp_neox = dataclasses.replace(hp_neox, rope_type=ROPE_TYPE_NEOX)
    hp_norm = dataclasses.replace(hp_neox, rope_type=ROPE_TYPE_NORM)
    w_perm = dict(w)
    for il in range(hp_neox.n_layer):
        q, k = f"blk.{il}.attn_q.weight", f"blk.{il}.attn_k.weight"
        w_perm[q] = permute(w[q], hp_neox.n_head, n_rot)
        w_perm[k] = permute(w[k], hp_neox.n_head_kv, n_rot)
    tokens = tokens_for(hp_neox, 11)
    np.testing.assert_allclose(
        reference_logits(w, hp_neox, tokens), reference_logits(w_perm, hp_norm, tokens), atol=TOL
    )


@pytest.mark.parametrize("qtype", [GGMLQuantizationType.Q8_0, GGMLQuantizationType.Q4_1])
def test_quantized_weights_are_used_dequantized(qtype):
    hp, w = model(n_embd=32, n_ff=64)
    w32 = {k: v.astype(np.float32) for k, v in w.items()}
    wq = {
        k: QuantizedTensor(qtype, v.shape, quantize(v, qtype)) if v.ndim == 2 else v
        for k, v in w32.items()
    }
    wd = {k: v.dequantize() if isinstance(v, QuantizedTensor) else v for k, v in wq.items()}
    tokens = tokens_for(hp, 6)
    out_q, out_d = reference_logits(wq, hp, tokens), reference_logits(wd, hp, tokens)
    np.testing.assert_array_equal(out_q, out_d)


def test_gguf_roundtrip_through_load_model(tmp_path):
    hp = tiny_hparams(arch="qwen2", tied=True)
    w = random_weights(hp, seed=2)
    hp2, w2 = load_model(write_tiny_gguf(tmp_path / "m.gguf", hp, w))
    assert dataclasses.replace(hp2, f_norm_rms_eps=hp.f_norm_rms_eps, n_ctx_orig_yarn=0) == hp
    assert sorted(w2) == sorted(w)
    for k in w:
        np.testing.assert_array_equal(w2[k], w[k])


def test_greedy_is_argmax_of_the_full_forward():
    hp, w = model()
    out = greedy(w, hp, [1, 2, 3], n_predict=6)
    seq = [1, 2, 3] + out
    logits = reference_logits(w, hp, np.array(seq))
    assert out == logits[2:-1].argmax(-1).tolist()
    assert greedy(w, hp, [1, 2, 3], n_predict=6, stop=(out[2],)) == out[:2]


def test_kq_mask_is_causal_and_windowed():
    m = build_kq_mask(np.arange(5), np.array([3, 4]), n_swa=2, swa_type=1, dtype=F64)
    visible = (m == 0).tolist()
    assert visible == [[False, False, True, True, False], [False, False, False, True, True]]


def test_errors():
    hp, w = model()
    cache = SimpleKVCache(hp, 4, F64)
    with pytest.raises(LlamaForwardError, match="out of range"):
        llama_forward(w, hp, np.array([hp.n_vocab]), np.array([0]), None)
    with pytest.raises(LlamaForwardError, match="pos has shape"):
        llama_forward(w, hp, np.array([1, 2]), np.array([0]), None)
    with pytest.raises(LlamaForwardError, match="out_ids"):
        llama_forward(w, hp, np.array([1]), np.array([0]), None, out_ids=[1])
    with pytest.raises(LlamaForwardError, match="non-empty"):
        llama_forward(w, hp, np.array([], dtype=int), np.array([], dtype=int), None)
    with pytest.raises(LlamaForwardError, match="arch 'gpt2'"):
        llama_forward(w, dataclasses.replace(hp, arch="gpt2"), np.array([1]), np.array([0]), None)
    with pytest.raises(LlamaForwardError, match="missing weight 'blk.1.ffn_up.weight'"):
        broken = {k: v for k, v in w.items() if k != "blk.1.ffn_up.weight"}
        reference_logits(broken, hp, np.array([1]))
    with pytest.raises(KVCacheError, match="out of cells"):
        cache.init_batch(np.arange(5))
    assert cache.n_past == 0  # a refused ubatch leaves the cache as it was
    cache.init_batch(np.arange(2))
    with pytest.raises(KVCacheError, match="continue"):
        cache.init_batch(np.array([1]))
    assert cache.n_past == 2


def test_load_model_reads_a_hf_folder_without_torch(tmp_path):
    """A HF folder written with NumPy only: names mapped, llama's Q/K permuted, tied output."""
    import json

    from safetensors.numpy import save_file

    rng = np.random.default_rng(0)
    config = {
        "architectures": ["LlamaForCausalLM"], "vocab_size": 16, "hidden_size": 8,
        "num_hidden_layers": 1, "num_attention_heads": 2, "num_key_value_heads": 1,
        "intermediate_size": 12, "rms_norm_eps": 1e-5, "max_position_embeddings": 32,
        "tie_word_embeddings": True, "rope_theta": 5e5,
    }
    shapes = {
        "model.embed_tokens.weight": (16, 8), "model.norm.weight": (8,),
        "model.layers.0.input_layernorm.weight": (8,),
        "model.layers.0.post_attention_layernorm.weight": (8,),
        "model.layers.0.self_attn.q_proj.weight": (8, 8),
        "model.layers.0.self_attn.k_proj.weight": (4, 8),
        "model.layers.0.self_attn.v_proj.weight": (4, 8),
        "model.layers.0.self_attn.o_proj.weight": (8, 8),
        "model.layers.0.mlp.gate_proj.weight": (12, 8),
        "model.layers.0.mlp.up_proj.weight": (12, 8),
        "model.layers.0.mlp.down_proj.weight": (8, 12),
    }
    tensors = {k: rng.normal(size=s).astype(np.float32) for k, s in shapes.items()}
    save_file(tensors, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text(json.dumps(config))
    hp, w = load_model(tmp_path)
    assert (hp.arch, hp.tied_output, hp.rope_freq_base_train, hp.n_rot) == ("llama", True, 5e5, 4)
    assert "output.weight" not in w
    down = tensors["model.layers.0.mlp.down_proj.weight"]
    np.testing.assert_array_equal(w["blk.0.ffn_down.weight"], down)
    q = tensors["model.layers.0.self_attn.q_proj.weight"]
    np.testing.assert_array_equal(w["blk.0.attn_q.weight"], q[[0, 2, 1, 3, 4, 6, 5, 7]])
    k = tensors["model.layers.0.self_attn.k_proj.weight"]
    np.testing.assert_array_equal(w["blk.0.attn_k.weight"], k[[0, 2, 1, 3]])


def test_hparams_refuse_a_window_type_without_a_window():
    """n_swa = 0 with a window type would mask every cell: refused when the hparams are made."""
    import dataclasses

    from reference.hparams import SWA_TYPE_NONE, SWA_TYPE_STANDARD, HParamsError

    hp = tiny_hparams(n_swa=4)
    with pytest.raises(HParamsError, match="n_swa=0 and swa_type"):
        dataclasses.replace(hp, n_swa=0)
    with pytest.raises(HParamsError, match="swa_type=0"):
        dataclasses.replace(hp, swa_type=SWA_TYPE_NONE)
    assert dataclasses.replace(hp, n_swa=0, swa_type=SWA_TYPE_NONE).n_swa == 0
    assert dataclasses.replace(hp, n_swa=2, swa_type=SWA_TYPE_STANDARD).n_swa == 2
    with pytest.raises(HParamsError, match="n_rot=3"):
        dataclasses.replace(hp, n_rot=3)
