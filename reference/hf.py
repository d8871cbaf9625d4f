r"""Load a HF checkpoint folder (``config.json`` + ``*.safetensors``) as GGUF-named weights.

This is what llama.cpp's ``convert_hf_to_gguf.py`` does, done once at load time and without
torch: read the config into [`reference.hparams.LlamaHParams`][reference.hparams.LlamaHParams],
rename every tensor to its GGUF name, and for ``llama`` permute the rows of ``q_proj`` and
``k_proj`` so that the interleaved ("normal") RoPE of the GGUF layout computes what HF's rotate-half
RoPE computes on the original rows (``LlamaModel.permute``).

Why the permutation works. HF's ``rotate_half`` pairs dimension $i$ of a head with
$i + n_{rot}/2$ (NeoX pairing) and rotates the pair by $p\,\theta_i$. GGUF's normal mode pairs
$2i$ with $2i+1$ and rotates them by $p\,\theta_i$. If the rows of $W_q$ (per head) are
reordered so that new row $2i$ is old row $i$ and new row $2i+1$ is old row $i + n_{rot}/2$,
then every pair meets the same angle in both layouts, and $q \cdot k$ is unchanged because
$q$ and $k$ are permuted alike:

$$
\mathrm{rope}_{\text{normal}}(P W x) = P\, \mathrm{rope}_{\text{neox}}(W x), \qquad
(P a) \cdot (P b) = a \cdot b .
$$

``qwen2`` keeps the HF layout and uses the NeoX mode instead (as llama.cpp does), and so do
``qwen3`` and ``qwen3moe`` (with the per-head ``q_norm``/``k_norm`` gains as
``attn_q_norm``/``attn_k_norm``), and ``gemma``, ``gemma2`` and ``gemma3``
([`gemma_hparams_from_hf`][]): their RMS norm gains are
stored plus one (HF's Gemma norm multiplies by $1 + w$), their norms around attention and FFN
have Gemma 2's names, and their query scale, window pattern, per-layer RoPE and soft-caps come
from the config.

Experts. Mixtral (``MixtralForCausalLM``, llama.cpp's ``llama`` with experts, Q/K permuted like
any llama) and Qwen3-MoE store a router (``block_sparse_moe.gate`` / ``mlp.gate``:
``ffn_gate_inp``) and one matrix per expert (``experts.{e}.w1/w3/w2`` /
``gate_proj/up_proj/down_proj``): they are stacked into GGUF's 3-D ``ffn_gate_exps``,
``ffn_up_exps``, ``ffn_down_exps`` ([`expert_tensor_name`][]), as ``convert_hf_to_gguf``
does.

RoPE settings. transformers 5 stores them in ``config["rope_parameters"]`` (``rope_theta``,
``rope_type``, ``partial_rotary_factor``, ``factor`` ...); older configs use ``rope_theta``
and ``rope_scaling`` at the top level. Both are read. ``linear`` and ``yarn`` map to
llama.cpp's scaling types; ``llama3`` is supported with per-dimension frequency factors
(the ``rope_freqs.weight`` tensor that ``convert_hf_to_gguf`` generates); other types are
refused with [`HFLoadError`][].
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
from pathlib import Path

import numpy as np
from numpy.typing import DTypeLike

from reference.common import LlamarefError
from reference.hparams import (
    GEMMA_ARCHS,
    QWEN3_ARCHS,
    ROPE_SCALING_TYPE_LINEAR,
    ROPE_SCALING_TYPE_YARN,
    ROPE_TYPE_NEOX,
    ROPE_TYPE_NORM,
    SWA_TYPE_NONE,
    SWA_TYPE_STANDARD,
    HParamsError,
    LlamaHParams,
    MambaHParams,
    swa_pattern,
)


class HFLoadError(LlamarefError, ValueError):
    """A HF checkpoint folder cannot be loaded (missing file, unsupported config, bad tensor)."""


# --8<-- [start:HF_ARCHS]
# HF "architectures" entry -> GGUF architecture
HF_ARCHS = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "llama",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "Qwen3MoeForCausalLM": "qwen3moe",
    "MixtralForCausalLM": "llama",  # llama.cpp's llama with n_expert > 0
    "GemmaForCausalLM": "gemma",
    "Gemma2ForCausalLM": "gemma2",
    "Gemma3ForCausalLM": "gemma3",  # model_type gemma3_text
}
# --8<-- [end:HF_ARCHS]

# --8<-- [start:HF_TENSOR_NAMES]
# HF tensor name -> GGUF tensor name (the weight/bias suffix is kept)
HF_TENSOR_NAMES = {
    "model.embed_tokens": "token_embd",
    "model.norm": "output_norm",
    "lm_head": "output",
}
HF_LAYER_TENSOR_NAMES = {  # model.layers.{il}.<key> -> blk.{il}.<value>
    "input_layernorm": "attn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "post_attention_layernorm": "ffn_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
    "self_attn.q_norm": "attn_q_norm",  # qwen3, qwen3moe
    "self_attn.k_norm": "attn_k_norm",  # qwen3, qwen3moe
    "mlp.gate": "ffn_gate_inp",  # qwen3moe's router
    "block_sparse_moe.gate": "ffn_gate_inp",  # Mixtral's router
}
# The experts: model.layers.{il}.<prefix>.experts.{e}.<key> -> blk.{il}.<value>, stacked over e
# (Qwen3-MoE: mlp.experts.{e}.gate_proj ...; Mixtral: block_sparse_moe.experts.{e}.w1 ...)
HF_EXPERT_TENSOR_NAMES = {
    "gate_proj": "ffn_gate_exps",
    "up_proj": "ffn_up_exps",
    "down_proj": "ffn_down_exps",
    "w1": "ffn_gate_exps",
    "w3": "ffn_up_exps",
    "w2": "ffn_down_exps",
}
HF_GEMMA2_LAYER_TENSOR_NAMES = {  # gemma2/gemma3: the norms around attention and FFN
    **HF_LAYER_TENSOR_NAMES,
    "post_attention_layernorm": "post_attention_norm",
    "pre_feedforward_layernorm": "ffn_norm",
    "post_feedforward_layernorm": "post_ffw_norm",
    "self_attn.q_norm": "attn_q_norm",  # gemma3
    "self_attn.k_norm": "attn_k_norm",  # gemma3
}
# --8<-- [end:HF_TENSOR_NAMES]


# --8<-- [start:gguf_tensor_name]
def gguf_tensor_name(hf_name: str, arch: str = "llama") -> str | None:
    """The GGUF name of a HF tensor, or None for tensors llama.cpp does not use.

    Gemma 2 and 3 name their four norms otherwise (gguf-py's ``tensor_mapping.py``: HF's
    ``post_attention_layernorm`` is ``post_attention_norm`` there, ``ffn_norm`` for the
    others); ``gemma``/``gemma2`` have no ``lm_head`` in llama.cpp (the converter skips it).

    Examples:
        >>> gguf_tensor_name("model.layers.3.self_attn.q_proj.bias")
        'blk.3.attn_q.bias'
        >>> gguf_tensor_name("lm_head.weight"), gguf_tensor_name("model.rotary_emb.inv_freq")
        ('output.weight', None)
        >>> gguf_tensor_name("model.layers.0.post_attention_layernorm.weight", "gemma2")
        'blk.0.post_attention_norm.weight'
    """
    base, _, suffix = hf_name.rpartition(".")
    if base == "lm_head" and arch in ("gemma", "gemma2"):
        return None
    if base in HF_TENSOR_NAMES:
        return f"{HF_TENSOR_NAMES[base]}.{suffix}"
    names = HF_GEMMA2_LAYER_TENSOR_NAMES if arch in ("gemma2", "gemma3") else HF_LAYER_TENSOR_NAMES
    m = re.fullmatch(r"model\.layers\.(\d+)\.(.+)", base)
    if m and m.group(2) in names:
        return f"blk.{m.group(1)}.{names[m.group(2)]}.{suffix}"
    return None
# --8<-- [end:gguf_tensor_name]


# --8<-- [start:expert_tensor_name]
def expert_tensor_name(hf_name: str) -> tuple[str, int] | None:
    """The GGUF name of a HF expert tensor and the expert's index, or None for another tensor.

    A HF checkpoint stores one matrix per expert (``...experts.{e}.gate_proj.weight``); a
    GGUF one 3-D tensor per layer, the experts stacked on the first axis
    (``ffn_gate_exps.weight`` ``(n_expert, n_ff_exp, n_embd)``), as the converter writes it.

    Examples:
        >>> expert_tensor_name("model.layers.1.mlp.experts.3.down_proj.weight")
        ('blk.1.ffn_down_exps.weight', 3)
        >>> expert_tensor_name("model.layers.0.block_sparse_moe.experts.7.w3.weight")
        ('blk.0.ffn_up_exps.weight', 7)
    """
    m = re.fullmatch(r"model\.layers\.(\d+)\.(?:mlp|block_sparse_moe)\.experts\.(\d+)\."
                     r"(\w+)\.weight", hf_name)
    if m is None or m.group(3) not in HF_EXPERT_TENSOR_NAMES:
        return None
    return f"blk.{m.group(1)}.{HF_EXPERT_TENSOR_NAMES[m.group(3)]}.weight", int(m.group(2))
# --8<-- [end:expert_tensor_name]


def _fused_experts(hf_name: str, t: np.ndarray) -> dict[str, np.ndarray]:
    """transformers 5's in-memory layout (``mlp.experts.gate_up_proj`` ``(n_expert, 2 n_ff,
    n_embd)``, gate first, and ``mlp.experts.down_proj``) as GGUF expert tensors; {} for
    another tensor."""
    m = re.fullmatch(r"model\.layers\.(\d+)\.mlp\.experts\.(gate_up_proj|down_proj)", hf_name)
    if m is None:
        return {}
    b = f"blk.{m.group(1)}."
    if m.group(2) == "down_proj":
        return {b + "ffn_down_exps.weight": t}
    n_ff = t.shape[1] // 2
    return {b + "ffn_gate_exps.weight": t[:, :n_ff], b + "ffn_up_exps.weight": t[:, n_ff:]}


# --8<-- [start:permute]
def permute(weights: np.ndarray, n_head: int, n_rot: int | None = None) -> np.ndarray:
    """Reorder the rows of each head from rotate-half (NeoX) pairs to interleaved pairs.

    ``convert_hf_to_gguf``'s ``LlamaModel.permute``: within every head, rows
    ``[0, n_rot/2)`` and ``[n_rot/2, n_rot)`` are interleaved, so new row ``2i`` is old row
    ``i`` and new row ``2i + 1`` is old row ``i + n_rot/2``. Rows past ``n_rot`` (partial
    rotation) are not rotated and stay where they are. Works for weights
    ``(n_head * d, n_in)`` and biases ``(n_head * d,)``.

    Args:
        weights: ``q_proj``/``k_proj`` weight or bias; leading axis ``n_head * d``.
        n_head: heads of that projection (``n_head_kv`` for ``k_proj``).
        n_rot: rotated dimensions per head; default: the whole head.

    Returns:
        The permuted array, same shape.

    Examples:
        >>> permute(np.arange(8), n_head=2).tolist()
        [0, 2, 1, 3, 4, 6, 5, 7]
        >>> permute(np.arange(6), n_head=1, n_rot=4).tolist()
        [0, 2, 1, 3, 4, 5]
    """
    d = weights.shape[0] // n_head
    n_rot = d if n_rot is None else n_rot
    w = weights.reshape(n_head, d, *weights.shape[1:]).copy()  # (n_head, d, ...)
    rot = w[:, :n_rot].reshape(n_head, 2, n_rot // 2, *weights.shape[1:])  # (n_head, 2, n_rot/2,..)
    w[:, :n_rot] = rot.swapaxes(1, 2).reshape(n_head, n_rot, *weights.shape[1:])
    return w.reshape(weights.shape)
# --8<-- [end:permute]


def _rope_parameters(config: dict) -> dict:
    """``rope_parameters`` (transformers 5), else the older top-level keys."""
    params = dict(config.get("rope_parameters") or config.get("rope_scaling") or {})
    if "rope_theta" not in params and "rope_theta" in config:
        params["rope_theta"] = config["rope_theta"]
    if "partial_rotary_factor" not in params and "partial_rotary_factor" in config:
        params["partial_rotary_factor"] = config["partial_rotary_factor"]
    if "rope_type" not in params and "type" in params:
        params["rope_type"] = params["type"]
    return params


# --8<-- [start:llama3_rope_factors]
def llama3_rope_factors(rope: dict, n_rot: int, freq_base: float) -> np.ndarray:
    r"""The ``rope_freqs.weight`` of a ``llama3`` RoPE config (``convert_hf_to_gguf``).

    Each frequency $\theta_i$ is divided by a factor: 1 for short wavelengths, ``factor``
    for long ones, and a smooth blend in between.

    Examples:
        >>> f = llama3_rope_factors({"factor": 8.0, "original_max_position_embeddings": 8192},
        ...                         n_rot=64, freq_base=500000.0)
        >>> f.shape, float(f[0]), float(f[-1])
        ((32,), 1.0, 8.0)
    """
    factor = rope.get("factor", 8.0)
    low_freq_factor = rope.get("low_freq_factor", 1.0)
    high_freq_factor = rope.get("high_freq_factor", 4.0)
    old_context_len = rope.get("original_max_position_embeddings", 8192)
    low_freq_wavelen = old_context_len / low_freq_factor
    high_freq_wavelen = old_context_len / high_freq_factor
    freqs = 1.0 / (freq_base ** (np.arange(0, n_rot, 2, dtype=np.float32) / n_rot))
    factors = []
    for freq in freqs:
        wavelen = 2 * math.pi / freq
        if wavelen < high_freq_wavelen:
            factors.append(1.0)
        elif wavelen > low_freq_wavelen:
            factors.append(factor)
        else:
            smooth = (old_context_len / wavelen - low_freq_factor) / (
                high_freq_factor - low_freq_factor
            )
            factors.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(factors, dtype=np.float32)  # (n_rot/2,)
# --8<-- [end:llama3_rope_factors]


# --8<-- [start:hparams_from_hf]
def hparams_from_hf(config: dict) -> LlamaHParams | MambaHParams:
    """Map a HF ``config.json`` (as a dict) to [`LlamaHParams`][].

    Llama, Mistral, Qwen2, Qwen3 and Qwen3-MoE, and Mixtral (a ``llama`` with experts, see
    ``_expert_fields``). Mamba and Mamba-2 configs go to [`mamba_hparams_from_hf`][], Gemma,
    Gemma 2 and Gemma 3 configs to [`gemma_hparams_from_hf`][].

    Args:
        config: the parsed ``config.json``.

    Returns:
        The hyperparameters, with llama.cpp's field names.

    Raises:
        HFLoadError: unknown architecture, unsupported RoPE type, a Qwen sliding window,
            Qwen3's attention biases, Qwen3-MoE's dense layers.

    Examples:
        >>> hp = hparams_from_hf({"architectures": ["MistralForCausalLM"], "vocab_size": 10,
        ...     "hidden_size": 8, "num_hidden_layers": 1, "num_attention_heads": 2,
        ...     "num_key_value_heads": 1, "intermediate_size": 16, "rms_norm_eps": 1e-5,
        ...     "max_position_embeddings": 64, "sliding_window": 4,
        ...     "rope_parameters": {"rope_type": "default", "rope_theta": 1e6}})
        >>> hp.arch, hp.n_rot, hp.n_swa, hp.rope_freq_base_train
        ('llama', 4, 4, 1000000.0)
    """
    archs = config.get("architectures") or []
    if len(archs) == 1 and archs[0] in HF_MAMBA_ARCHS:
        return mamba_hparams_from_hf(config)
    if len(archs) != 1 or archs[0] not in HF_ARCHS:
        supported = sorted([*HF_ARCHS, *HF_MAMBA_ARCHS])
        raise HFLoadError(f"unsupported architectures {archs}; supported: {supported}")
    hf_arch = archs[0]
    arch = HF_ARCHS[hf_arch]
    if arch in GEMMA_ARCHS:
        return gemma_hparams_from_hf(config)
    n_head = config["num_attention_heads"]
    # transformers' Qwen3Config has head_dim = 128 when the config does not say
    default_head_dim = 128 if hf_arch == "Qwen3ForCausalLM" else config["hidden_size"] // n_head
    head_dim = config.get("head_dim") or default_head_dim
    rope = _rope_parameters(config)
    n_rot = int(head_dim * rope.get("partial_rotary_factor", 1.0))
    scaling = _rope_scaling(rope)
    n_swa = 0
    if hf_arch in ("MistralForCausalLM", "MixtralForCausalLM"):
        n_swa = config.get("sliding_window") or 0
    if hf_arch.startswith("Qwen") and config.get("use_sliding_window"):
        name = hf_arch.removesuffix("ForCausalLM")
        raise HFLoadError(f"{name} with use_sliding_window=true is not supported")
    if arch in QWEN3_ARCHS and config.get("attention_bias"):
        raise HFLoadError(f"{arch}: attention_bias=true is not supported (llama.cpp's {arch} "
                          "has no Q/K/V biases)")
    experts = _expert_fields(arch, config)
    n_ctx_train = config.get("max_position_embeddings", 0)
    scaling.setdefault("n_ctx_orig_yarn", n_ctx_train)  # llama.cpp's default when no key
    try:
        hparams = LlamaHParams(
            arch=arch,
            n_vocab=config["vocab_size"],
            n_ctx_train=n_ctx_train,
            n_embd=config["hidden_size"],
            n_layer=config["num_hidden_layers"],
            n_head=n_head,
            n_head_kv=config.get("num_key_value_heads") or n_head,
            n_embd_head_k=head_dim,
            n_embd_head_v=head_dim,
            n_rot=n_rot,
            n_ff=config["intermediate_size"],
            f_norm_rms_eps=config["rms_norm_eps"],
            rope_type=ROPE_TYPE_NORM if arch == "llama" else ROPE_TYPE_NEOX,
            rope_freq_base_train=float(rope.get("rope_theta", 10000.0)),
            n_swa=n_swa,
            swa_type=SWA_TYPE_STANDARD if n_swa > 0 else SWA_TYPE_NONE,
            tied_output=bool(config.get("tie_word_embeddings", False)),
            **scaling,
            **experts,
        )
    except HParamsError as e:
        raise HFLoadError(f"inconsistent config.json: {e}") from e
    return _float32_fields(hparams)
# --8<-- [end:hparams_from_hf]


# --8<-- [start:expert_fields]
def _expert_fields(arch: str, config: dict) -> dict:
    """The experts of a Mixtral / Qwen3-MoE config, as ``LlamaHParams`` fields.

    Mixtral: ``num_local_experts`` experts of ``intermediate_size`` (llama.cpp's ``n_ff``),
    weights always normalised. Qwen3-MoE: ``num_experts`` of ``moe_intermediate_size``
    (``n_ff_exp``), normalised when ``norm_topk_prob`` (HF's default: false, which llama.cpp
    does not compute: such a model loads here but cannot be written as a GGUF).

    Raises:
        HFLoadError: Qwen3-MoE dense layers (``mlp_only_layers``, ``decoder_sparse_step``
            other than 1): llama.cpp's qwen3moe has experts in every layer.
    """
    if "num_local_experts" in config and arch == "llama":
        return dict(n_expert=config["num_local_experts"],
                    n_expert_used=config["num_experts_per_tok"])
    if arch != "qwen3moe":
        return {}
    if config.get("mlp_only_layers") or config.get("decoder_sparse_step", 1) != 1:
        raise HFLoadError("qwen3moe: dense layers (mlp_only_layers, decoder_sparse_step != 1) "
                          "are not supported: llama.cpp's qwen3moe has experts in every layer")
    return dict(
        n_expert=config.get("num_experts") or config["num_local_experts"],
        n_expert_used=config["num_experts_per_tok"],
        n_ff_exp=config["moe_intermediate_size"],
        expert_weights_norm=bool(config.get("norm_topk_prob", False)),
    )
# --8<-- [end:expert_fields]


def _rope_scaling(rope: dict) -> dict:
    """The ``LlamaHParams`` fields of a RoPE config's scaling (``rope_type``)."""
    rope_type = rope.get("rope_type", "default")
    # no scaling is written as llama.cpp reads a GGUF without the key: linear, factor 1
    scaling = dict(rope_scaling_type_train=ROPE_SCALING_TYPE_LINEAR)
    if rope_type == "linear":
        scaling = dict(
            rope_scaling_type_train=ROPE_SCALING_TYPE_LINEAR,
            rope_freq_scale_train=1.0 / rope["factor"],
        )
    elif rope_type == "yarn":
        scaling = dict(
            rope_scaling_type_train=ROPE_SCALING_TYPE_YARN,
            rope_freq_scale_train=1.0 / rope["factor"],
            n_ctx_orig_yarn=rope["original_max_position_embeddings"],
            yarn_beta_fast=rope.get("beta_fast", 32.0),
            yarn_beta_slow=rope.get("beta_slow", 1.0),
        )
        if "extrapolation_factor" in rope:
            scaling["yarn_ext_factor"] = rope["extrapolation_factor"]
    elif rope_type not in ("default", "llama3"):
        raise HFLoadError(
            f"unsupported RoPE type {rope_type!r}; supported: default, linear, yarn, llama3"
        )
    return scaling


# ---------------------------------------------------------------------------------------------
# Gemma, Gemma 2, Gemma 3 (convert_hf_to_gguf's GemmaModel, Gemma2Model, Gemma3Model)
# ---------------------------------------------------------------------------------------------

_GELU_TANH = "gelu_pytorch_tanh"  # llama.cpp's ggml_gelu is the tanh approximation


def _gemma_refusals(arch: str, config: dict) -> list[str]:
    """What in a Gemma config llama.cpp's graph does not compute (or its loader drops)."""
    act = config.get("hidden_activation") or config.get("hidden_act") or _GELU_TANH
    refusals = [
        (act != _GELU_TANH and not (arch == "gemma" and act == "gelu"),
         f"hidden activation {act!r} (llama.cpp computes {_GELU_TANH!r}; gemma's legacy "
         "'gelu' means it too)"),
        (bool(config.get("attention_bias")), "attention_bias=true (llama.cpp has no biases)"),
        (bool(config.get("use_bidirectional_attention")), "use_bidirectional_attention=true"),
        (arch in ("gemma", "gemma2") and not config.get("tie_word_embeddings", True),
         "tie_word_embeddings=false (llama.cpp's gemma/gemma2 reuse the embeddings)"),
        (arch == "gemma3" and config.get("attn_logit_softcapping") is not None,
         "attn_logit_softcapping (llama.cpp's gemma3 does not soft-cap attention)"),
        (arch == "gemma2" and not config.get("sliding_window"),
         "no sliding_window (llama.cpp's gemma2 always has SWA layers)"),
    ]
    return [f"{arch}: {message} is not supported" for refused, message in refusals if refused]


def _gemma_rope(arch: str, config: dict) -> tuple[dict, dict]:
    """The RoPE settings of the global and of the sliding layers.

    Gemma 3 (transformers 5) keeps one dict per layer type in ``rope_parameters``
    (``full_attention``, ``sliding_attention``); older configs have ``rope_theta``,
    ``rope_scaling`` (global) and ``rope_local_base_freq``. Gemma and Gemma 2 have one.
    """
    params = config.get("rope_parameters") or {}
    if "full_attention" in params or "sliding_attention" in params:
        full = dict(params.get("full_attention") or {})
        local = dict(params.get("sliding_attention") or {})
    else:
        full = _rope_parameters(config)
        local = {"rope_theta": config.get("rope_local_base_freq", 10000.0)}
    if arch != "gemma3":
        return full, full
    full.setdefault("rope_theta", 1_000_000.0)
    local.setdefault("rope_theta", 10000.0)
    return full, local


def _swa_layers_from_hf(arch: str, config: dict, n_layer: int) -> tuple[bool, ...]:
    """``layer_types`` (else ``sliding_window_pattern``, default 2 / 6) as per-layer flags."""
    types = config.get("layer_types")
    if types is None:
        n_pattern = config.get("sliding_window_pattern", 2 if arch == "gemma2" else 6)
        return swa_pattern(n_layer, n_pattern)
    unknown = set(types) - {"sliding_attention", "full_attention"}
    if len(types) != n_layer or unknown:
        raise HFLoadError(f"{arch}: layer_types must be {n_layer} of 'sliding_attention' / "
                          f"'full_attention', got {types}")
    return tuple(t == "sliding_attention" for t in types)


# --8<-- [start:gemma_hparams_from_hf]
def gemma_hparams_from_hf(config: dict) -> LlamaHParams:
    r"""Map a HF ``GemmaForCausalLM`` / ``Gemma2ForCausalLM`` / ``Gemma3ForCausalLM`` config.

    As the converter (``conversion/gemma.py``) and llama.cpp's loader read it:

    - ``head_dim`` is both head sizes; RoPE is NeoX (no permutation);
    - ``query_pre_attn_scalar`` $s$ (Gemma 2/3) gives ``f_attention_scale`` $= s^{-1/2}$,
      as HF computes. A GGUF cannot store it: llama.cpp derives it from the layer count
      ([`reference.hparams.gemma_attention_scale`][reference.hparams.gemma_attention_scale]),
      so [`reference.arch.llama_metadata`][reference.arch.llama_metadata] refuses to
      write a model whose $s$ gives another value;
    - ``layer_types`` (or ``sliding_window_pattern``) gives ``swa_layers``,
      ``sliding_window`` the window; Gemma 3 without a window or without a sliding layer
      has no SWA at all;
    - Gemma 3: the global layers take ``rope_parameters["full_attention"]`` (base and
      ``linear`` scaling), the sliding ones ``rope_parameters["sliding_attention"]``'s base
      (``rope_local_base_freq`` in older configs) and no scaling;
    - ``attn_logit_softcapping`` / ``final_logit_softcapping``: None is 0 (no cap).

    Raises:
        HFLoadError: what llama.cpp does not compute: another activation than the tanh GELU,
            biases, bidirectional attention, an untied Gemma/Gemma 2, Gemma 3's attention
            soft-cap, scaled RoPE on Gemma 3's sliding layers, a RoPE type other than
            ``default``/``linear``; malformed ``layer_types``.

    Examples:
        >>> hp = gemma_hparams_from_hf({"architectures": ["Gemma3ForCausalLM"],
        ...     "vocab_size": 10, "hidden_size": 8, "num_hidden_layers": 3,
        ...     "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 4,
        ...     "intermediate_size": 16, "rms_norm_eps": 1e-6, "query_pre_attn_scalar": 16,
        ...     "sliding_window": 4, "layer_types": ["sliding_attention", "full_attention",
        ...     "sliding_attention"], "rope_parameters": {
        ...         "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
        ...         "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}}})
        >>> hp.swa_layers, hp.f_attention_scale, hp.rope_freq_scale_train
        ((True, False, True), 0.25, 0.125)
        >>> hp.rope_freq_base_train_swa, hp.rope_freq_scale_train_swa
        (10000.0, 1.0)
    """
    arch = HF_ARCHS[config["architectures"][0]]
    for refusal in _gemma_refusals(arch, config):
        raise HFLoadError(refusal)
    n_layer = config["num_hidden_layers"]
    n_head = config["num_attention_heads"]
    head_dim = config.get("head_dim") or config["hidden_size"] // n_head
    full, local = _gemma_rope(arch, config)
    for rope in (full, local):
        if rope.get("rope_type", "default") not in ("default", "linear"):
            raise HFLoadError(f"{arch}: RoPE type {rope['rope_type']!r} is not supported "
                              "(default, linear)")
    if arch == "gemma3" and local.get("rope_type", "default") != "default":
        raise HFLoadError("gemma3: llama.cpp does not scale the RoPE of the sliding layers")
    fields: dict = {}
    swa_layers = _swa_layers_from_hf(arch, config, n_layer) if arch != "gemma" else ()
    n_swa = 0 if arch == "gemma" else config.get("sliding_window") or 0
    if arch == "gemma3" and not (n_swa > 0 and any(swa_layers)):
        n_swa, swa_layers = 0, ()  # the converter writes no window: llama.cpp has no SWA
    scaling = _rope_scaling(full)
    if n_swa > 0:
        freq_scale = scaling.get("rope_freq_scale_train", 1.0)
        fields.update(
            n_swa=n_swa, swa_type=SWA_TYPE_STANDARD, swa_layers=swa_layers,
            rope_freq_base_train_swa=float(local.get("rope_theta", 10000.0)),
            rope_freq_scale_train_swa=freq_scale if arch == "gemma2" else 1.0,
        )
    if arch != "gemma":
        fields["f_attention_scale"] = config.get("query_pre_attn_scalar", 256) ** -0.5
        fields["f_final_logit_softcapping"] = config.get("final_logit_softcapping") or 0.0
    if arch == "gemma2":
        fields["f_attn_logit_softcapping"] = config.get("attn_logit_softcapping") or 0.0
    n_ctx_train = config.get("max_position_embeddings", 0)
    try:
        hparams = LlamaHParams(
            arch=arch,
            n_vocab=config["vocab_size"],
            n_ctx_train=n_ctx_train,
            n_embd=config["hidden_size"],
            n_layer=n_layer,
            n_head=n_head,
            n_head_kv=config.get("num_key_value_heads") or n_head,
            n_embd_head_k=head_dim,
            n_embd_head_v=head_dim,
            n_rot=head_dim,
            n_ff=config["intermediate_size"],
            f_norm_rms_eps=config["rms_norm_eps"],
            rope_type=ROPE_TYPE_NEOX,
            rope_freq_base_train=float(full.get("rope_theta", 10000.0)),
            n_ctx_orig_yarn=n_ctx_train,
            tied_output=bool(config.get("tie_word_embeddings", True)),
            **scaling,
            **fields,
        )
    except HParamsError as e:
        raise HFLoadError(f"inconsistent config.json: {e}") from e
    return _float32_fields(hparams)
# --8<-- [end:gemma_hparams_from_hf]


def _float32_fields(hparams: LlamaHParams) -> LlamaHParams:
    """Round every float field to float32, as ``llama_hparams`` (and a GGUF file) holds it.

    Without this, a model loaded from HF and the same model converted to GGUF would differ
    in, say, ``f_norm_rms_eps`` (``1e-5`` against ``float32(1e-5)``).
    """
    floats = {
        f.name: float(np.float32(getattr(hparams, f.name)))
        for f in dataclasses.fields(hparams)
        if isinstance(getattr(hparams, f.name), float)
    }
    return dataclasses.replace(hparams, **floats)


def _read_safetensors(path: Path) -> dict[str, np.ndarray]:
    from safetensors.numpy import load_file

    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise HFLoadError(f"no *.safetensors file in {path}")
    tensors: dict[str, np.ndarray] = {}
    for f in files:
        try:
            tensors.update(load_file(str(f)))
        except Exception as e:  # bf16 and friends are not NumPy dtypes
            raise HFLoadError(f"cannot read {f.name} with safetensors.numpy: {e}") from e
    return tensors


# --8<-- [start:load_hf]
def load_hf(
    path: str | Path, dtype: DTypeLike = np.float32
) -> tuple[LlamaHParams, dict[str, np.ndarray]]:
    """Load a HF checkpoint folder as ``(hparams, weights)`` with GGUF tensor names.

    Args:
        path: folder with ``config.json`` and ``*.safetensors`` (float16/float32).
        dtype: dtype of the returned weights.

    Returns:
        ``(hparams, weights)``; ``llama`` Q/K rows are permuted for the normal RoPE mode;
        Gemma's RMS norm gains are stored as ``1 + w`` (HF's ``GemmaRMSNorm`` multiplies by
        $1 + w$, llama.cpp by the gain; the converter adds 1);
        ``output.weight`` is absent (and ``hparams.tied_output`` True) when the checkpoint
        has no ``lm_head``; a ``llama3`` RoPE adds ``rope_freqs.weight``.

    Raises:
        HFLoadError: missing files, unsupported config, or a missing/misshapen tensor.
    """
    path = Path(path)
    if not (path / "config.json").is_file():
        raise HFLoadError(f"no config.json in {path}")
    try:
        config = json.loads((path / "config.json").read_text())
    except json.JSONDecodeError as e:
        raise HFLoadError(f"{path / 'config.json'} is not valid JSON: {e}") from e
    try:
        hp = hparams_from_hf(config)
    except KeyError as e:
        raise HFLoadError(f"{path / 'config.json'} has no {e.args[0]!r}") from e
    if isinstance(hp, MambaHParams):
        return load_mamba_hf(path, hp, dtype)
    weights: dict[str, np.ndarray] = {}
    experts: dict[str, dict[int, np.ndarray]] = {}  # GGUF name -> expert -> matrix
    for hf_name, t in _read_safetensors(path).items():
        expert = expert_tensor_name(hf_name)
        if expert is not None:
            experts.setdefault(expert[0], {})[expert[1]] = t.astype(dtype)
            continue
        fused = _fused_experts(hf_name, t.astype(dtype))
        weights.update(fused)
        name = None if fused else gguf_tensor_name(hf_name, hp.arch)
        if name is None:
            continue
        if hp.arch in GEMMA_ARCHS and hf_name.endswith("norm.weight"):
            # HF's GemmaRMSNorm computes x * (1 + w): the converter stores 1 + w (in float32)
            t = t.astype(np.float32) + np.float32(1.0)
        t = t.astype(dtype)
        if hp.arch == "llama" and re.search(r"\.attn_q\.", name):
            t = permute(t, hp.n_head, hp.n_rot)
        elif hp.arch == "llama" and re.search(r"\.attn_k\.", name):
            t = permute(t, hp.n_head_kv, hp.n_rot)
        weights[name] = t
    weights.update(_stack_experts(experts, hp.n_expert))
    if "output.weight" not in weights and not hp.tied_output:
        hp = _replace(hp, tied_output=True)
    if "output.weight" in weights and hp.tied_output:
        del weights["output.weight"]  # a tied checkpoint that stored lm_head anyway
    if _rope_parameters(config).get("rope_type") == "llama3":
        rope = _rope_parameters(config)
        weights["rope_freqs.weight"] = llama3_rope_factors(rope, hp.n_rot, hp.rope_freq_base_train)
    _check_shapes(hp, weights)
    return hp, weights
# --8<-- [end:load_hf]


def _stack_experts(experts: dict[str, dict[int, np.ndarray]], n_expert: int) -> dict:
    """One ``(n_expert, rows, cols)`` tensor per GGUF name, expert ``e`` at index ``e``.

    Raises:
        HFLoadError: an expert missing, or more than ``n_expert``.
    """
    out = {}
    for name, mats in experts.items():
        if sorted(mats) != list(range(n_expert)):
            raise HFLoadError(f"{name}: experts {sorted(mats)} in the checkpoint, expected "
                              f"0..{n_expert - 1}")
        out[name] = np.stack([mats[e] for e in range(n_expert)])  # (n_expert, rows, cols)
    return out


def _replace(hp: LlamaHParams, **changes) -> LlamaHParams:
    from dataclasses import replace

    return replace(hp, **changes)


def _ffn_shapes(hp: LlamaHParams, b: str) -> dict[str, tuple[int, ...]]:
    """The FFN tensors of block ``b``: dense, or the router and the experts."""
    if not hp.n_expert:
        return {b + "ffn_gate.weight": (hp.n_ff, hp.n_embd),
                b + "ffn_up.weight": (hp.n_ff, hp.n_embd),
                b + "ffn_down.weight": (hp.n_embd, hp.n_ff)}
    n_ff, n_exp = hp.n_ff_expert(), hp.n_expert
    return {b + "ffn_gate_inp.weight": (n_exp, hp.n_embd),
            b + "ffn_gate_exps.weight": (n_exp, n_ff, hp.n_embd),
            b + "ffn_up_exps.weight": (n_exp, n_ff, hp.n_embd),
            b + "ffn_down_exps.weight": (n_exp, hp.n_embd, n_ff)}


def _check_shapes(hp: LlamaHParams, weights: dict[str, np.ndarray]) -> None:
    d = hp.n_embd_head_k
    expected = {"token_embd.weight": (hp.n_vocab, hp.n_embd), "output_norm.weight": (hp.n_embd,)}
    for il in range(hp.n_layer):
        b = f"blk.{il}."
        expected.update({
            b + "attn_norm.weight": (hp.n_embd,),
            b + "attn_q.weight": (hp.n_head * d, hp.n_embd),
            b + "attn_k.weight": (hp.n_head_kv * d, hp.n_embd),
            b + "attn_v.weight": (hp.n_head_kv * hp.n_embd_head_v, hp.n_embd),
            b + "attn_output.weight": (hp.n_embd, hp.n_head * hp.n_embd_head_v),
            b + "ffn_norm.weight": (hp.n_embd,),
        })
        expected.update(_ffn_shapes(hp, b))
        if hp.arch in QWEN3_ARCHS:
            expected[b + "attn_q_norm.weight"] = (d,)
            expected[b + "attn_k_norm.weight"] = (d,)
        if hp.arch in ("gemma2", "gemma3"):
            expected[b + "post_attention_norm.weight"] = (hp.n_embd,)
            expected[b + "post_ffw_norm.weight"] = (hp.n_embd,)
        if hp.arch == "gemma3":
            expected[b + "attn_q_norm.weight"] = (d,)
            expected[b + "attn_k_norm.weight"] = (d,)
    for name, shape in expected.items():
        if name not in weights:
            raise HFLoadError(f"missing tensor {name!r} (GGUF name)")
        if weights[name].shape != shape:
            raise HFLoadError(f"tensor {name!r} has shape {weights[name].shape}, expected {shape}")


# ---------------------------------------------------------------------------------------------
# Mamba and Mamba-2 (convert_hf_to_gguf's MambaModel and Mamba2Model, conversion/mamba.py)
# ---------------------------------------------------------------------------------------------

# --8<-- [start:HF_MAMBA_ARCHS]
# HF "architectures" entry -> GGUF architecture
HF_MAMBA_ARCHS = {
    "MambaForCausalLM": "mamba",
    "Mamba2ForCausalLM": "mamba2",
}
# --8<-- [end:HF_MAMBA_ARCHS]

# --8<-- [start:HF_MAMBA_TENSOR_NAMES]
# HF tensor name -> GGUF tensor name (gguf-py's tensor_mapping.py)
HF_MAMBA_TENSOR_NAMES = {
    "backbone.embeddings.weight": "token_embd.weight",
    "backbone.norm_f.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
}
HF_MAMBA_LAYER_TENSOR_NAMES = {  # backbone.layers.{il}.<key> -> blk.{il}.<value>
    "norm.weight": "attn_norm.weight",
    "mixer.in_proj.weight": "ssm_in.weight",
    "mixer.conv1d.weight": "ssm_conv1d.weight",  # (conv_dim, 1, d_conv) squeezed
    "mixer.conv1d.bias": "ssm_conv1d.bias",
    "mixer.x_proj.weight": "ssm_x.weight",  # Mamba-1
    "mixer.dt_proj.weight": "ssm_dt.weight",  # Mamba-1
    "mixer.dt_proj.bias": "ssm_dt.bias",  # Mamba-1
    "mixer.dt_bias": "ssm_dt.bias",  # Mamba-2
    "mixer.A_log": "ssm_a",  # stored as A = -exp(A_log); no .weight suffix
    "mixer.D": "ssm_d",  # no .weight suffix
    "mixer.norm.weight": "ssm_norm.weight",  # Mamba-2: (n_group, d_inner / n_group)
    "mixer.out_proj.weight": "ssm_out.weight",
}
# --8<-- [end:HF_MAMBA_TENSOR_NAMES]


# --8<-- [start:mamba_gguf_tensor_name]
def mamba_gguf_tensor_name(hf_name: str) -> str | None:
    """The GGUF name of a HF Mamba/Mamba-2 tensor, or None for tensors llama.cpp does not use.

    Mamba-Codestral's ``model.backbone.*`` / ``model.lm_head.*`` prefix is dropped first, as
    the converter does.

    Examples:
        >>> mamba_gguf_tensor_name("backbone.layers.2.mixer.A_log")
        'blk.2.ssm_a'
        >>> mamba_gguf_tensor_name("backbone.layers.0.mixer.dt_bias")
        'blk.0.ssm_dt.bias'
        >>> mamba_gguf_tensor_name("model.backbone.norm_f.weight"), mamba_gguf_tensor_name("x")
        ('output_norm.weight', None)
    """
    if hf_name.startswith(("model.backbone.", "model.lm_head.")):
        hf_name = hf_name.removeprefix("model.")
    if hf_name in HF_MAMBA_TENSOR_NAMES:
        return HF_MAMBA_TENSOR_NAMES[hf_name]
    m = re.fullmatch(r"backbone\.layers\.(\d+)\.(.+)", hf_name)
    if m and m.group(2) in HF_MAMBA_LAYER_TENSOR_NAMES:
        return f"blk.{m.group(1)}.{HF_MAMBA_LAYER_TENSOR_NAMES[m.group(2)]}"
    return None
# --8<-- [end:mamba_gguf_tensor_name]


def _json_float(value) -> float:
    """A float of ``config.json``; transformers writes infinity as ``{"__float__": "Infinity"}``."""
    return float(value["__float__"] if isinstance(value, dict) else value)


# --8<-- [start:mamba_hparams_from_hf]
def mamba_hparams_from_hf(config: dict) -> MambaHParams:
    r"""Map a HF ``MambaForCausalLM`` / ``Mamba2ForCausalLM`` config to [`MambaHParams`][].

    As the converter's ``set_gguf_parameters``: ``d_inner`` is ``intermediate_size`` (else
    ``expand * hidden_size``); Mamba-1's ``dt_rank`` is ``time_step_rank`` (``"auto"``:
    ``ceil(hidden_size / 16)``); Mamba-2's head count (``ssm_dt_rank``) is
    ``d_inner / head_dim`` and its groups ``n_groups``; ``n_ctx_train`` is the converter's
    arbitrary $2^{20}$ (a recurrent model has no trained context length).

    Raises:
        HFLoadError: a feature llama.cpp's graph does not have (``use_bias`` projections, no
            conv bias), a Mamba-2 ``time_step_limit`` other than ``(0, inf)`` (llama.cpp does
            not clamp $\Delta$), or inconsistent sizes.

    Examples:
        >>> hp = mamba_hparams_from_hf({"architectures": ["Mamba2ForCausalLM"],
        ...     "vocab_size": 48, "hidden_size": 32, "num_hidden_layers": 2, "state_size": 8,
        ...     "expand": 2, "head_dim": 8, "n_groups": 2, "conv_kernel": 4,
        ...     "layer_norm_epsilon": 1e-5})
        >>> hp.arch, hp.ssm_d_inner, hp.ssm_dt_rank, hp.ssm_n_group, hp.n_embd_r()
        ('mamba2', 64, 8, 2, 288)
    """
    arch = HF_MAMBA_ARCHS[config["architectures"][0]]
    n_embd = config["hidden_size"]
    d_inner = config.get("intermediate_size") or config.get("expand", 2) * n_embd
    if config.get("use_bias", False):
        raise HFLoadError(f"{arch}: use_bias=true (in_proj/out_proj biases) is not supported")
    if not config.get("use_conv_bias", True):
        raise HFLoadError(f"{arch}: use_conv_bias=false is not supported (llama.cpp needs it)")
    if arch == "mamba":
        dt_rank = config.get("time_step_rank", "auto")
        if dt_rank == "auto":
            dt_rank = -(n_embd // -16)
        n_group = 0
    else:
        limit = [_json_float(v) for v in config.get("time_step_limit") or (0.0, math.inf)]
        if limit[0] != 0.0 or math.isfinite(limit[1]):
            raise HFLoadError(f"mamba2: time_step_limit={limit} is not supported")
        dt_rank = d_inner // config.get("head_dim", 64)
        n_group = config.get("n_groups", 1)
    try:
        hp = MambaHParams(
            arch=arch,
            n_vocab=config["vocab_size"],
            n_embd=n_embd,
            n_layer=config["num_hidden_layers"],
            n_ctx_train=2**20,
            ssm_d_conv=config.get("conv_kernel", 4),
            ssm_d_inner=d_inner,
            ssm_d_state=config.get("state_size", 16 if arch == "mamba" else 128),
            ssm_dt_rank=dt_rank,
            ssm_n_group=n_group,
            f_norm_rms_eps=config.get("layer_norm_epsilon") or 1e-5,
            tied_output=bool(config.get("tie_word_embeddings", False)),
        )
    except HParamsError as e:
        raise HFLoadError(f"inconsistent config.json: {e}") from e
    return _float32_fields(hp)
# --8<-- [end:mamba_hparams_from_hf]


# --8<-- [start:mamba_gguf_tensor]
def mamba_gguf_tensor(name: str, t: np.ndarray, hp: MambaHParams) -> np.ndarray:
    r"""A HF Mamba tensor in its GGUF form (the converter's ``modify_tensors``).

    - ``A_log`` becomes $A = -e^{A_{log}}$ (the scan wants the negative decay rate);
    - the conv weight ``(conv_dim, 1, d_conv)`` is squeezed to ``(conv_dim, d_conv)``;
    - Mamba-2's ``A`` and ``D`` ``(n_head,)`` become ``(n_head, 1)`` (Mamba-1's shapes, and
      ``D`` broadcasts over ``head_dim``); its norm gain ``(d_inner,)`` becomes
      ``(n_group, d_inner / n_group)``.

    Args:
        name: the GGUF name ([`mamba_gguf_tensor_name`][]).
        t: the HF tensor.
        hp: the hyperparameters.

    Returns:
        The tensor to store under ``name``.

    Examples:
        >>> hp = mamba_hparams_from_hf({"architectures": ["Mamba2ForCausalLM"],
        ...     "vocab_size": 48, "hidden_size": 32, "num_hidden_layers": 1, "state_size": 8,
        ...     "head_dim": 16, "n_groups": 2})
        >>> mamba_gguf_tensor("blk.0.ssm_a", np.zeros(4, np.float32), hp).ravel()
        array([-1., -1., -1., -1.], dtype=float32)
        >>> mamba_gguf_tensor("blk.0.ssm_norm.weight", np.ones(64, np.float32), hp).shape
        (2, 32)
    """
    kind = name.split(".")[2] if name.startswith("blk.") else name
    if kind == "ssm_a":
        t = -np.exp(t)
    if kind == "ssm_conv1d" and name.endswith(".weight"):
        t = t.reshape(t.shape[0], t.shape[-1])  # (conv_dim, d_conv)
    if hp.arch == "mamba2" and kind in ("ssm_a", "ssm_d"):
        t = t.reshape(*t.shape, 1)  # (n_head, 1)
    if hp.arch == "mamba2" and kind == "ssm_norm":
        t = t.reshape(hp.ssm_n_group, -1)  # (n_group, d_inner / n_group)
    return t
# --8<-- [end:mamba_gguf_tensor]


# --8<-- [start:load_mamba_hf]
def load_mamba_hf(
    path: str | Path, hp: MambaHParams, dtype: DTypeLike = np.float32
) -> tuple[MambaHParams, dict[str, np.ndarray]]:
    """The weights of a HF Mamba/Mamba-2 folder with GGUF names and shapes.

    Called by [`load_hf`][] when ``config.json`` names a Mamba architecture.

    Args:
        path: folder with ``config.json`` and ``*.safetensors``.
        hp: the hyperparameters from [`mamba_hparams_from_hf`][].
        dtype: dtype of the returned weights.

    Returns:
        ``(hparams, weights)``; ``output.weight`` is absent (``hparams.tied_output`` True)
        when the checkpoint has no ``lm_head`` or ties it.

    Raises:
        HFLoadError: a missing or misshapen tensor.
    """
    weights: dict[str, np.ndarray] = {}
    for hf_name, t in _read_safetensors(Path(path)).items():
        name = mamba_gguf_tensor_name(hf_name)
        if name is not None:
            # A = -exp(A_log) in float32, as the converter (torch, float32 checkpoint)
            weights[name] = mamba_gguf_tensor(name, t.astype(np.float32), hp).astype(dtype)
    if "output.weight" not in weights and not hp.tied_output:
        hp = _replace(hp, tied_output=True)
    if "output.weight" in weights and hp.tied_output:
        del weights["output.weight"]  # a tied checkpoint that stored lm_head anyway
    _check_mamba_shapes(hp, weights)
    return hp, weights
# --8<-- [end:load_mamba_hf]


def _check_mamba_shapes(hp: MambaHParams, weights: dict[str, np.ndarray]) -> None:
    d_inner, d_state, d_conv = hp.ssm_d_inner, hp.ssm_d_state, hp.ssm_d_conv
    n_head, conv_dim = hp.n_head(), hp.conv_dim()
    expected = {"token_embd.weight": (hp.n_vocab, hp.n_embd), "output_norm.weight": (hp.n_embd,)}
    for il in range(hp.n_layer):
        b = f"blk.{il}."
        expected.update({
            b + "attn_norm.weight": (hp.n_embd,),
            b + "ssm_conv1d.weight": (conv_dim, d_conv),
            b + "ssm_conv1d.bias": (conv_dim,),
            b + "ssm_out.weight": (hp.n_embd, d_inner),
        })
        if hp.arch == "mamba":
            expected.update({
                b + "ssm_in.weight": (2 * d_inner, hp.n_embd),
                b + "ssm_x.weight": (hp.ssm_dt_rank + 2 * d_state, d_inner),
                b + "ssm_dt.weight": (d_inner, hp.ssm_dt_rank),
                b + "ssm_dt.bias": (d_inner,),
                b + "ssm_a": (d_inner, d_state),
                b + "ssm_d": (d_inner,),
            })
        else:
            expected.update({
                b + "ssm_in.weight": (d_inner + conv_dim + n_head, hp.n_embd),
                b + "ssm_dt.bias": (n_head,),
                b + "ssm_a": (n_head, 1),
                b + "ssm_d": (n_head, 1),
                b + "ssm_norm.weight": (hp.ssm_n_group, d_inner // hp.ssm_n_group),
            })
    for name, shape in expected.items():
        if name not in weights:
            raise HFLoadError(f"missing tensor {name!r} (GGUF name)")
        if weights[name].shape != shape:
            raise HFLoadError(f"tensor {name!r} has shape {weights[name].shape}, expected {shape}")
