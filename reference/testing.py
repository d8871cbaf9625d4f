r"""Tiny random models and the twin verdict: what doctests, docs pages and tests build on.

A specification needs examples that run, and examples need models. This module makes them
in memory, seeded, in a few milliseconds:

- [`tiny_hparams`][] / [`random_weights`][]: a Llama (or Qwen2, Qwen3, a sliding-window
  Llama, a Mixtral or a Qwen3-MoE) with GGUF tensor names;
  [`tiny_gemma_hparams`][] / [`random_gemma_weights`][]: a Gemma, Gemma 2 or Gemma 3 (with
  its SWA pattern and soft-caps);
  [`tiny_mamba_hparams`][] / [`random_mamba_weights`][]: a Mamba or Mamba-2;
- [`write_tiny_gguf`][] / [`write_tiny_mamba_gguf`][]: the same written as a float32
  GGUF that llama.cpp can load (with the dummy vocabulary of
  [`reference.arch.spm_dummy_vocab`][reference.arch.spm_dummy_vocab]);
- [`reference_logits`][] / [`mamba_reference_logits`][]: every token's logits through
  the simple caches of [`reference.models`][reference.models], the baseline the Context is held to;
- [`nmse`][] and [`nmse_check`][]: test-backend-ops' verdict on a twin's output,

    $$ \mathrm{NMSE}(a, b) = \frac{\sum_i (a_i - b_i)^2}{\sum_i a_i^2}, $$

    after NaN (fails) and infinities (must match) are taken out. The thresholds are
    `reference.common.MAX_NMSE_OP` and friends.

Weights are drawn so that every term matters: matrices with std ``1/sqrt(n_in)``, norm gains
around 1, biases around 0.1. (transformers' default init, std 0.02, gives near-zero logits,
which would make an absolute tolerance meaningless.)
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
from numpy.typing import ArrayLike

from reference.arch import llama_metadata, mamba_metadata
from reference.gguf import write_gguf
from reference.hparams import (
    GEMMA_ARCHS,
    QWEN3_ARCHS,
    ROPE_TYPE_NEOX,
    ROPE_TYPE_NORM,
    SWA_TYPE_NONE,
    SWA_TYPE_STANDARD,
    LlamaHParams,
    MambaHParams,
    gemma_attention_scale,
    swa_pattern,
)
from reference.models.gemma import GEMMA_LAYER_TENSORS, gemma_forward
from reference.models.llama import llama_forward, model_dtype
from reference.models.mamba import SimpleRecurrentState, mamba_forward
from reference.models.simple_cache import SimpleKVCache


def tiny_hparams(
    arch: str = "llama",
    n_vocab: int = 32,
    n_embd: int = 16,
    n_layer: int = 2,
    n_head: int = 4,
    n_head_kv: int = 2,
    head_dim: int | None = None,
    n_rot: int | None = None,
    n_ff: int = 24,
    freq_base: float = 10000.0,
    n_swa: int = 0,
    tied: bool = False,
    eps: float = 1e-5,
    n_ctx_train: int = 128,
    n_expert: int = 0,
    n_expert_used: int = 0,
    n_ff_exp: int = 0,
) -> LlamaHParams:
    """A small [`LlamaHParams`][]; ``qwen2``, ``qwen3`` and ``qwen3moe`` get NeoX RoPE,
    ``llama`` normal RoPE.

    ``n_expert > 0`` makes a mixture of experts (``llama``: Mixtral; ``qwen3moe``), with
    ``n_expert_used`` experts per token and, for ``qwen3moe``, experts ``n_ff_exp`` wide.
    For a Gemma model as llama.cpp reads it, use [`tiny_gemma_hparams`][].

    Examples:
        >>> hp = tiny_hparams("qwen3moe", n_expert=4, n_expert_used=2, n_ff_exp=8)
        >>> hp.rope_type, hp.n_ff_expert()
        (2, 8)
    """
    head_dim = head_dim or n_embd // n_head
    return LlamaHParams(
        arch=arch,
        n_vocab=n_vocab,
        n_ctx_train=n_ctx_train,
        n_embd=n_embd,
        n_layer=n_layer,
        n_head=n_head,
        n_head_kv=n_head_kv,
        n_embd_head_k=head_dim,
        n_embd_head_v=head_dim,
        n_rot=n_rot or head_dim,
        n_ff=n_ff,
        f_norm_rms_eps=eps,
        rope_type=ROPE_TYPE_NORM if arch == "llama" else ROPE_TYPE_NEOX,
        rope_freq_base_train=freq_base,
        n_swa=n_swa,
        swa_type=SWA_TYPE_STANDARD if n_swa > 0 else SWA_TYPE_NONE,
        tied_output=tied,
        n_expert=n_expert,
        n_expert_used=n_expert_used,
        n_ff_exp=n_ff_exp,
    )


# --8<-- [start:tiny_gemma_hparams]
def tiny_gemma_hparams(
    arch: str = "gemma2",
    n_vocab: int = 32,
    n_embd: int = 16,
    n_layer: int = 2,
    n_head: int = 4,
    n_head_kv: int = 2,
    head_dim: int | None = None,
    n_ff: int = 24,
    freq_base: float = 10000.0,
    freq_base_swa: float | None = None,
    n_swa: int | None = None,
    swa_layers: tuple[bool, ...] | None = None,
    attn_softcap: float | None = None,
    final_softcap: float | None = None,
    tied: bool = True,
    eps: float = 1e-6,
    n_ctx_train: int = 128,
) -> LlamaHParams:
    """A small Gemma (``gemma``, ``gemma2`` or ``gemma3``), as llama.cpp would read it back.

    Every field llama.cpp derives is set as its loader sets it (NeoX RoPE, the attention scale
    of [`reference.hparams.gemma_attention_scale`][reference.hparams.gemma_attention_scale], the
    SWA RoPE scale, tied output for gemma/gemma2), so
    [`reference.arch.llama_metadata`][reference.arch.llama_metadata] writes it and
    reading the file gives it back.

    Args:
        arch: ``"gemma"``, ``"gemma2"`` or ``"gemma3"``.
        freq_base_swa: RoPE base of the SWA layers; default: gemma2 ``freq_base``, gemma3
            10000.
        n_swa: the window; default: gemma2 4096, gemma/gemma3 0 (none).
        swa_layers: the per-layer SWA flags; default: gemma2 ``swa_pattern(n_layer, 2)``,
            gemma3 ``swa_pattern(n_layer, 6)`` (with a window).
        attn_softcap: gemma2's attention cap (default 50).
        final_softcap: the final logit cap (default: gemma2 30, gemma3 0).
        tied: no ``output.weight`` (must be True for gemma and gemma2).

    Examples:
        >>> hp = tiny_gemma_hparams("gemma3", n_layer=7, n_swa=4)
        >>> [hp.is_swa(il) for il in range(7)], hp.rope_freq_base_train_swa
        ([True, True, True, True, True, False, True], 10000.0)
    """
    head_dim = head_dim or n_embd // n_head
    if n_swa is None:
        n_swa = 4096 if arch == "gemma2" else 0
    window = arch in ("gemma2", "gemma3") and n_swa > 0
    if not window:  # gemma, or gemma3 without a window: no SWA keys at all
        swa_layers, freq_base_swa = (), 0.0
    if swa_layers is None:
        swa_layers = swa_pattern(n_layer, 2 if arch == "gemma2" else 6)
    if freq_base_swa is None:
        freq_base_swa = freq_base if arch == "gemma2" else 10000.0
    f32 = float(np.float32(eps))  # as a GGUF stores it
    return LlamaHParams(
        arch=arch,
        n_vocab=n_vocab,
        n_ctx_train=n_ctx_train,
        n_embd=n_embd,
        n_layer=n_layer,
        n_head=n_head,
        n_head_kv=n_head_kv,
        n_embd_head_k=head_dim,
        n_embd_head_v=head_dim,
        n_rot=head_dim,
        n_ff=n_ff,
        f_norm_rms_eps=f32,
        rope_type=ROPE_TYPE_NEOX,
        rope_freq_base_train=freq_base,
        rope_scaling_type_train=1,  # "linear" with factor 1: what a file without the key says
        n_ctx_orig_yarn=n_ctx_train,
        n_swa=n_swa,
        swa_type=SWA_TYPE_STANDARD if n_swa > 0 else SWA_TYPE_NONE,
        swa_layers=swa_layers,
        rope_freq_base_train_swa=freq_base_swa,
        rope_freq_scale_train_swa=1.0 if window else 0.0,
        f_attention_scale=0.0 if arch == "gemma" else gemma_attention_scale(
            arch, n_layer, n_embd, n_head, head_dim),
        f_attn_logit_softcapping=(50.0 if attn_softcap is None else attn_softcap)
        if arch == "gemma2" else 0.0,
        f_final_logit_softcapping={"gemma2": 30.0, "gemma3": 0.0}.get(arch, 0.0)
        if final_softcap is None else final_softcap,
        tied_output=tied,
    )
# --8<-- [end:tiny_gemma_hparams]


# --8<-- [start:random_gemma_weights]
def random_gemma_weights(hp: LlamaHParams, seed: int = 0, dtype=np.float32) -> dict:
    """Seeded random Gemma weights with GGUF names (llama.cpp's: norms are gains near 1).

    The tensors of [`GEMMA_LAYER_TENSORS`][reference.models.gemma.GEMMA_LAYER_TENSORS] for
    ``hp.arch``, matrices with std ``1/sqrt(n_in)``, embeddings N(0, 1), and
    ``output.weight`` unless ``hp.tied_output``.
    """
    rng = np.random.default_rng(seed)
    d = hp.n_embd_head_k
    shapes = {
        "attn_norm": (hp.n_embd,), "wq": (hp.n_head * d, hp.n_embd),
        "wk": (hp.n_head_kv * d, hp.n_embd), "wv": (hp.n_head_kv * d, hp.n_embd),
        "wo": (hp.n_embd, hp.n_head * d), "attn_q_norm": (d,), "attn_k_norm": (d,),
        "attn_post_norm": (hp.n_embd,), "ffn_norm": (hp.n_embd,),
        "ffn_gate": (hp.n_ff, hp.n_embd), "ffn_up": (hp.n_ff, hp.n_embd),
        "ffn_down": (hp.n_embd, hp.n_ff), "ffn_post_norm": (hp.n_embd,),
    }
    w = {"token_embd.weight": rng.normal(size=(hp.n_vocab, hp.n_embd))}
    for il in range(hp.n_layer):
        for field, (name, archs) in GEMMA_LAYER_TENSORS.items():
            if hp.arch not in archs:
                continue
            shape = shapes[field]
            if len(shape) == 1:  # a norm gain
                w[f"blk.{il}.{name}"] = 1.0 + 0.1 * rng.normal(size=shape)
            else:
                w[f"blk.{il}.{name}"] = rng.normal(0.0, 1.0 / np.sqrt(shape[1]), shape)
    w["output_norm.weight"] = 1.0 + 0.1 * rng.normal(size=hp.n_embd)
    if not hp.tied_output:
        w["output.weight"] = rng.normal(0.0, 1.0 / np.sqrt(hp.n_embd), (hp.n_vocab, hp.n_embd))
    return {k: v.astype(dtype) for k, v in w.items()}
# --8<-- [end:random_gemma_weights]


def random_weights(
    hp: LlamaHParams,
    seed: int = 0,
    qkv_bias: bool | None = None,
    out_ffn_bias: bool = False,
    dtype=np.float32,
) -> dict[str, np.ndarray]:
    """Seeded random weights with GGUF names.

    ``qkv_bias`` (default: for qwen2) adds ``attn_q/k/v.bias``; ``out_ffn_bias`` adds
    ``attn_output.bias`` and the three FFN biases (llama's optional tensors). ``qwen3`` and
    ``qwen3moe`` get ``attn_q_norm``/``attn_k_norm`` gains ``(d,)``; a model with experts
    gets the router ``ffn_gate_inp`` and the 3-D ``ffn_{gate,up,down}_exps`` instead of the
    dense FFN (the draws of a dense llama/qwen2 are as they always were).
    """
    rng = np.random.default_rng(seed)
    qkv_bias = hp.arch == "qwen2" if qkv_bias is None else qkv_bias
    d = hp.n_embd_head_k

    def mat(n_out, n_in):
        return rng.normal(0.0, 1.0 / np.sqrt(n_in), (n_out, n_in))

    def gain(n):
        return 1.0 + 0.1 * rng.normal(size=n)

    w = {"token_embd.weight": rng.normal(size=(hp.n_vocab, hp.n_embd))}
    for il in range(hp.n_layer):
        b = f"blk.{il}."
        w[b + "attn_norm.weight"] = gain(hp.n_embd)
        w[b + "attn_q.weight"] = mat(hp.n_head * d, hp.n_embd)
        w[b + "attn_k.weight"] = mat(hp.n_head_kv * d, hp.n_embd)
        w[b + "attn_v.weight"] = mat(hp.n_head_kv * d, hp.n_embd)
        w[b + "attn_output.weight"] = mat(hp.n_embd, hp.n_head * d)
        if qkv_bias:
            w[b + "attn_q.bias"] = 0.1 * rng.normal(size=hp.n_head * d)
            w[b + "attn_k.bias"] = 0.1 * rng.normal(size=hp.n_head_kv * d)
            w[b + "attn_v.bias"] = 0.1 * rng.normal(size=hp.n_head_kv * d)
        if hp.arch in QWEN3_ARCHS:
            w[b + "attn_q_norm.weight"] = gain(d)
            w[b + "attn_k_norm.weight"] = gain(d)
        w[b + "ffn_norm.weight"] = gain(hp.n_embd)
        if hp.n_expert:
            w.update(_random_experts(hp, b, mat))
            continue
        w[b + "ffn_gate.weight"] = mat(hp.n_ff, hp.n_embd)
        w[b + "ffn_up.weight"] = mat(hp.n_ff, hp.n_embd)
        w[b + "ffn_down.weight"] = mat(hp.n_embd, hp.n_ff)
        if out_ffn_bias:
            w[b + "attn_output.bias"] = 0.1 * rng.normal(size=hp.n_embd)
            w[b + "ffn_gate.bias"] = 0.1 * rng.normal(size=hp.n_ff)
            w[b + "ffn_up.bias"] = 0.1 * rng.normal(size=hp.n_ff)
            w[b + "ffn_down.bias"] = 0.1 * rng.normal(size=hp.n_embd)
    w["output_norm.weight"] = gain(hp.n_embd)
    if not hp.tied_output:
        w["output.weight"] = mat(hp.n_vocab, hp.n_embd)
    return {k: v.astype(dtype) for k, v in w.items()}


def _random_experts(hp: LlamaHParams, b: str, mat) -> dict:
    """The router and the experts of one block (prefix ``b``), each expert drawn as a matrix."""
    n_ff = hp.n_ff_expert()
    return {
        b + "ffn_gate_inp.weight": mat(hp.n_expert, hp.n_embd),
        b + "ffn_gate_exps.weight": np.stack([mat(n_ff, hp.n_embd) for _ in range(hp.n_expert)]),
        b + "ffn_up_exps.weight": np.stack([mat(n_ff, hp.n_embd) for _ in range(hp.n_expert)]),
        b + "ffn_down_exps.weight": np.stack([mat(hp.n_embd, n_ff) for _ in range(hp.n_expert)]),
    }


def write_tiny_gguf(path: str | Path, hp: LlamaHParams, weights: dict) -> Path:
    """Write ``weights`` as a float32 GGUF llama.cpp can load (dummy SPM vocabulary)."""
    tensors = {k: np.asarray(v, dtype=np.float32) for k, v in weights.items()}
    write_gguf(str(path), llama_metadata(hp), tensors)
    return Path(path)


def reference_logits(weights: dict, hp: LlamaHParams, tokens, one_batch: bool = True) -> np.ndarray:
    """Our logits of every token at positions ``0..n-1`` (one ubatch, or one per token)."""
    chunks = None if one_batch else [1] * len(tokens)
    return chunked_logits(weights, hp, tokens, chunks)


def chunked_logits(weights: dict, hp: LlamaHParams, tokens, chunks=None) -> np.ndarray:
    """Our logits of every token at positions ``0..n-1``, fed in ``chunks`` (ubatch sizes;
    None: one ubatch) through a [`SimpleKVCache`][reference.models.simple_cache.SimpleKVCache];
    the Gemma forward for gemma archs, else the Llama one."""
    tokens = np.asarray(tokens, dtype=np.int64)
    n = len(tokens)
    chunks = chunks or [n]
    if sum(chunks) != n:
        raise ValueError(f"chunks {chunks} do not add up to {n} tokens")
    forward = gemma_forward if hp.arch in GEMMA_ARCHS else llama_forward
    cache = SimpleKVCache(hp, n, model_dtype(weights))
    rows, start = [], 0
    for size in chunks:
        pos = np.arange(start, start + size)
        rows.append(forward(weights, hp, tokens[start : start + size], pos, cache.init_batch(pos)))
        start += size
    return np.concatenate(rows)  # (n_tokens, n_vocab)


def tiny_mamba_hparams(
    arch: str = "mamba",
    n_vocab: int = 32,
    n_embd: int = 16,
    n_layer: int = 2,
    d_state: int = 8,
    d_conv: int = 4,
    dt_rank: int | None = None,
    head_dim: int = 8,
    n_group: int = 1,
    dt_b_c_rms: bool = False,
    tied: bool = False,
    eps: float = 1e-5,
):
    """A small [`reference.hparams.MambaHParams`][reference.hparams.MambaHParams] with ``d_inner = 2
    * n_embd``.

    Mamba-1: ``dt_rank`` defaults to ``ceil(n_embd / 16)``; Mamba-2: ``n_head = d_inner /
    head_dim`` heads (``ssm_dt_rank``) in ``n_group`` groups.
    """
    d_inner = 2 * n_embd
    if arch == "mamba2":
        dt_rank = d_inner // head_dim
    return MambaHParams(
        arch=arch,
        n_vocab=n_vocab,
        n_embd=n_embd,
        n_layer=n_layer,
        n_ctx_train=2**20,
        ssm_d_conv=d_conv,
        ssm_d_inner=d_inner,
        ssm_d_state=d_state,
        ssm_dt_rank=dt_rank or -(n_embd // -16),
        ssm_n_group=n_group if arch == "mamba2" else 0,
        ssm_dt_b_c_rms=dt_b_c_rms,
        f_norm_rms_eps=float(np.float32(eps)),  # as a GGUF stores it
        tied_output=tied,
    )


def _mamba_param(rng: np.random.Generator, name: str, shape: tuple[int, ...], d_state: int):
    """One random parameter by its (HF or GGUF) name, drawn so that every term matters.

    ``A_log``: the log of 1..d_state-ish rates (as Mamba's init, jittered); ``dt`` biases
    around -1 (softplus ~ 0.3); ``D`` and norm gains around 1; conv weights with std
    ``1/sqrt(d_conv)``; matrices with std ``1/sqrt(n_in)``; embeddings N(0, 1).
    """
    if name.endswith("A_log"):
        return np.log(rng.uniform(0.5, d_state, size=shape))
    if name.endswith(("dt_bias", "dt_proj.bias", "ssm_dt.bias")):
        return rng.normal(-1.0, 0.5, size=shape)
    if name.endswith(("mixer.D", "ssm_d")) or name.endswith("norm.weight") or "norm_f" in name:
        return 1.0 + 0.1 * rng.normal(size=shape)
    if name.endswith(".bias"):
        return 0.1 * rng.normal(size=shape)
    if "conv1d" in name:
        return rng.normal(0.0, 1.0 / np.sqrt(shape[-1]), size=shape)
    if "embed" in name or name.startswith("token_embd"):
        return rng.normal(size=shape)
    return rng.normal(0.0, 1.0 / np.sqrt(shape[-1]), size=shape)


def random_mamba_weights(hp, seed: int = 0, dtype=np.float32) -> dict[str, np.ndarray]:
    """Seeded random Mamba/Mamba-2 weights with GGUF names and shapes (``ssm_a < 0``)."""
    rng = np.random.default_rng(seed)
    d_inner, d_state, d_conv = hp.ssm_d_inner, hp.ssm_d_state, hp.ssm_d_conv
    n_head, conv_dim = hp.n_head(), hp.conv_dim()
    shapes = {"token_embd.weight": (hp.n_vocab, hp.n_embd)}
    for il in range(hp.n_layer):
        b = f"blk.{il}."
        shapes[b + "attn_norm.weight"] = (hp.n_embd,)
        if hp.arch == "mamba":
            shapes[b + "ssm_in.weight"] = (2 * d_inner, hp.n_embd)
        else:
            shapes[b + "ssm_in.weight"] = (d_inner + conv_dim + n_head, hp.n_embd)
        shapes[b + "ssm_conv1d.weight"] = (conv_dim, d_conv)
        shapes[b + "ssm_conv1d.bias"] = (conv_dim,)
        if hp.arch == "mamba":
            shapes[b + "ssm_x.weight"] = (hp.ssm_dt_rank + 2 * d_state, d_inner)
            shapes[b + "ssm_dt.weight"] = (d_inner, hp.ssm_dt_rank)
            shapes[b + "ssm_dt.bias"] = (d_inner,)
            shapes[b + "ssm_a.A_log"] = (d_inner, d_state)
            shapes[b + "ssm_d"] = (d_inner,)
        else:
            shapes[b + "ssm_dt.bias"] = (n_head,)
            shapes[b + "ssm_a.A_log"] = (n_head, 1)
            shapes[b + "ssm_d"] = (n_head, 1)
            shapes[b + "ssm_norm.weight"] = (hp.ssm_n_group, d_inner // hp.ssm_n_group)
        shapes[b + "ssm_out.weight"] = (hp.n_embd, d_inner)
    shapes["output_norm.weight"] = (hp.n_embd,)
    if not hp.tied_output:
        shapes["output.weight"] = (hp.n_vocab, hp.n_embd)
    w = {}
    for name, shape in shapes.items():
        x = _mamba_param(rng, name, shape, d_state)
        if name.endswith(".A_log"):
            name, x = name.removesuffix(".A_log"), -np.exp(x)
        w[name] = x.astype(dtype)
    return w


def write_tiny_mamba_gguf(path: str | Path, hp, weights: dict) -> Path:
    """Write Mamba weights as a float32 GGUF llama.cpp can load (dummy SPM vocabulary)."""
    tensors = {k: np.asarray(v, dtype=np.float32) for k, v in weights.items()}
    write_gguf(str(path), mamba_metadata(hp), tensors)
    return Path(path)


def mamba_reference_logits(weights: dict, hp, tokens, chunks=None, dtype=None) -> np.ndarray:
    """Our logits of every token of one sequence, fed in ``chunks`` (sizes; None: one ubatch).

    Uses
    [`reference.models.mamba.SimpleRecurrentState`][reference.models.mamba.SimpleRecurrentState] in
    ``dtype`` (default: the weights' dtype). ``chunks=[1] * n`` is token by token.
    """
    tokens = np.asarray(tokens, dtype=np.int64)
    state = SimpleRecurrentState(hp, 1, dtype or model_dtype(weights))
    chunks = chunks or [len(tokens)]
    if sum(chunks) != len(tokens):
        raise ValueError(f"chunks {chunks} do not add up to {len(tokens)} tokens")
    rows, start = [], 0
    for n in chunks:
        rows.append(mamba_forward(weights, hp, tokens[start : start + n], state.init_batch()))
        start += n
    return np.concatenate(rows)  # (n_tokens, n_vocab)


# --8<-- [start:nmse]
def nmse(ref: ArrayLike, out: ArrayLike) -> float:
    """test-backend-ops' error: NaN or mismatched infinities give ``inf``, else the NMSE.

    Examples:
        >>> nmse(np.array([1.0, 2.0]), np.array([1.0, 2.0]))
        0.0
        >>> round(nmse(np.array([3.0, 4.0]), np.array([3.0, 4.5])), 6)
        0.01
        >>> nmse(np.array([1.0, -np.inf]), np.array([1.0, np.inf]))
        inf
    """
    a = np.asarray(ref, dtype=np.float64)
    b = np.asarray(out, dtype=np.float64)
    if a.shape != b.shape or np.isnan(a).any() or np.isnan(b).any():
        return math.inf
    inf_a, inf_b = np.isinf(a), np.isinf(b)
    if (inf_a != inf_b).any() or (np.sign(a[inf_a]) != np.sign(b[inf_b])).any():
        return math.inf
    a, b = a[~inf_a], b[~inf_b]
    err, den = float(np.sum((a - b) ** 2)), float(np.sum(a * a))
    return err / den if den > 0 else (0.0 if err == 0 else math.inf)
# --8<-- [end:nmse]


# --8<-- [start:nmse_check]
def nmse_check(ref: ArrayLike, out: ArrayLike, max_nmse: float) -> float:
    """test-backend-ops' verdict: NaN fails, infinities match, then NMSE <= ``max_nmse``.

    Args:
        ref: the reference's output.
        out: the twin's output, of the same shape.
        max_nmse: the threshold (`reference.common.MAX_NMSE_OP`).

    Returns:
        The measured NMSE (0.0 when the reference is all zeros and the twin matches).

    Raises:
        AssertionError: a shape mismatch, a NaN, infinities that differ, or NMSE above
            ``max_nmse``; the message says which.

    Examples:
        >>> nmse_check(np.array([3.0, 4.0]), np.array([3.0, 4.0]), 1e-7)
        0.0
        >>> nmse_check(np.array([3.0, 4.0]), np.array([3.0, 4.5]), 1e-7)
        Traceback (most recent call last):
        ...
        AssertionError: NMSE 1.000e-02 > 1e-07
    """
    a = np.asarray(ref, dtype=np.float64)
    b = np.asarray(out, dtype=np.float64)
    inf_a, inf_b = np.isinf(a), np.isinf(b)
    problems = [
        (a.shape != b.shape, f"shape {b.shape} != reference {a.shape}"),
        (np.isnan(a).any(), "NaN in the reference"),
        (np.isnan(b).any(), "NaN in the twin"),
    ]
    for failed, message in problems:  # checked in order: a shape mismatch stops the rest
        if failed:
            raise AssertionError(message)
    if (inf_a != inf_b).any():
        raise AssertionError("infinities at different positions")
    if (np.sign(a[inf_a]) != np.sign(b[inf_b])).any():
        raise AssertionError("infinities of different signs")
    value = nmse(a, b)
    if not value <= max_nmse:  # an explicit raise, not assert: it must hold under python -O
        raise AssertionError(f"NMSE {value:.3e} > {max_nmse:.0e}")
    return value
# --8<-- [end:nmse_check]
