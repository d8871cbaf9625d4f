"""Tiny random models for tests: hparams, seeded weights, written as GGUF or as a HF folder.

- :func:`tiny_hparams` and :func:`random_weights` make a model in memory (GGUF names).
- :func:`write_tiny_gguf` writes it as a float32 GGUF that llama.cpp can load (with the dummy
  vocabulary of :func:`reference.gguf.llama_metadata`).
- :func:`save_tiny_hf` builds a seeded random ``LlamaForCausalLM`` / ``Qwen2ForCausalLM`` /
  ``MistralForCausalLM`` with transformers and ``save_pretrained``'s it (safetensors).

Weights are drawn so that every term matters: matrices with std ``1/sqrt(n_in)``, norm gains
around 1, biases around 0.1. (transformers' default init, std 0.02, gives near-zero logits,
which would make an absolute tolerance meaningless.)
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from reference.hparams import (
    ROPE_TYPE_NEOX,
    ROPE_TYPE_NORM,
    SWA_TYPE_NONE,
    SWA_TYPE_STANDARD,
    LlamaHParams,
)


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
) -> LlamaHParams:
    """A small :class:`LlamaHParams`; ``qwen2`` gets NeoX RoPE, ``llama`` normal RoPE."""
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
        rope_type=ROPE_TYPE_NEOX if arch == "qwen2" else ROPE_TYPE_NORM,
        rope_freq_base_train=freq_base,
        n_swa=n_swa,
        swa_type=SWA_TYPE_STANDARD if n_swa > 0 else SWA_TYPE_NONE,
        tied_output=tied,
    )


def random_weights(
    hp: LlamaHParams,
    seed: int = 0,
    qkv_bias: bool | None = None,
    out_ffn_bias: bool = False,
    dtype=np.float32,
) -> dict[str, np.ndarray]:
    """Seeded random weights with GGUF names.

    ``qkv_bias`` (default: for qwen2) adds ``attn_q/k/v.bias``; ``out_ffn_bias`` adds
    ``attn_output.bias`` and the three FFN biases (llama's optional tensors).
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
        w[b + "ffn_norm.weight"] = gain(hp.n_embd)
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


def write_tiny_gguf(path: str | Path, hp: LlamaHParams, weights: dict) -> Path:
    """Write ``weights`` as a float32 GGUF llama.cpp can load (dummy SPM vocabulary)."""
    from reference.gguf import llama_metadata, write_gguf

    tensors = {k: np.asarray(v, dtype=np.float32) for k, v in weights.items()}
    write_gguf(str(path), llama_metadata(hp), tensors)
    return Path(path)


HF_CLASSES = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "mistral": "MistralForCausalLM",
}


def save_tiny_hf(
    path: str | Path,
    kind: str = "llama",
    seed: int = 0,
    vocab_size: int = 40,
    hidden_size: int = 32,
    num_hidden_layers: int = 2,
    num_attention_heads: int = 4,
    num_key_value_heads: int = 2,
    intermediate_size: int = 48,
    rope_theta: float = 10000.0,
    tie_word_embeddings: bool = False,
    sliding_window: int | None = None,
    rope_parameters: dict | None = None,
    **extra,
) -> Path:
    """Build a seeded random HF model of ``kind`` (llama, qwen2, mistral) and save it.

    ``rope_parameters`` entries (``rope_type``, ``factor`` ...) override the default RoPE.

    All parameters are redrawn in NumPy from ``seed`` (see the module docstring), so the
    folder's contents depend on the seed only, not on torch's RNG.
    """
    import torch
    import transformers

    cfg_cls = getattr(transformers, HF_CLASSES[kind].replace("ForCausalLM", "Config"))
    kwargs = dict(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        num_hidden_layers=num_hidden_layers,
        num_attention_heads=num_attention_heads,
        num_key_value_heads=num_key_value_heads,
        intermediate_size=intermediate_size,
        max_position_embeddings=256,
        rms_norm_eps=1e-5,
        tie_word_embeddings=tie_word_embeddings,
        rope_parameters={
            "rope_type": "default",
            "rope_theta": rope_theta,
            **(rope_parameters or {}),
        },
        **extra,
    )
    if kind == "mistral":
        kwargs["sliding_window"] = sliding_window
    config = cfg_cls(**kwargs)
    config._attn_implementation = "eager"
    model = getattr(transformers, HF_CLASSES[kind])(config)
    rng = np.random.default_rng(seed)
    state = {}
    for name, p in model.state_dict().items():
        if name == "lm_head.weight" and tie_word_embeddings:
            continue  # the same tensor as embed_tokens
        if name.endswith("norm.weight"):
            x = 1.0 + 0.1 * rng.normal(size=p.shape)
        elif name.endswith(".bias"):
            x = 0.1 * rng.normal(size=p.shape)
        elif name.endswith("embed_tokens.weight"):
            x = rng.normal(size=p.shape)
        else:
            x = rng.normal(0.0, 1.0 / np.sqrt(p.shape[-1]), size=p.shape)
        state[name] = torch.tensor(x, dtype=torch.float32)
    if tie_word_embeddings:
        state["lm_head.weight"] = state["model.embed_tokens.weight"]
    model.load_state_dict(state)
    model.save_pretrained(str(path))
    return Path(path)


# ---------------------------------------------------------------------------------------------
# Running the oracles and comparing


def nmse(ref: np.ndarray, out: np.ndarray) -> float:
    """Normalized mean squared error ``sum((ref - out)^2) / sum(ref^2)`` (test-backend-ops)."""
    ref = np.asarray(ref, dtype=np.float64)
    out = np.asarray(out, dtype=np.float64)
    return float(((ref - out) ** 2).sum() / (ref**2).sum())


def llamacpp_logits(path: str | Path, tokens, one_batch: bool = True, n_ctx: int = 512):
    """Logits of every token from llama.cpp (llama-cpp-python) at positions ``0..n-1``.

    ``one_batch``: the whole prompt in one ``llama_decode``; otherwise one token per decode.
    llama.cpp runs with an f32 KV cache (``type_k = type_v = 0``), flash attention disabled
    (the plain ``mul_mat``/``soft_max_ext`` path that the reference mirrors), 2 threads.
    """
    import llama_cpp

    tokens = [int(t) for t in tokens]
    n = len(tokens)
    llm = llama_cpp.Llama(
        model_path=str(path),
        n_ctx=max(n_ctx, n),
        n_batch=max(n, 1),
        n_ubatch=max(n, 1),
        logits_all=True,
        type_k=0,
        type_v=0,
        flash_attn=False,
        n_threads=2,
        n_threads_batch=2,
        verbose=False,
    )
    try:
        if one_batch:
            llm.eval(tokens)
        else:
            for t in tokens:
                llm.eval([t])
        return np.array(llm.scores[:n], dtype=np.float32)  # (n_tokens, n_vocab)
    finally:
        llm.close()


def reference_logits(weights: dict, hp: LlamaHParams, tokens, one_batch: bool = True) -> np.ndarray:
    """Our logits of every token at positions ``0..n-1`` (one ubatch, or one per token)."""
    from reference.models.llama import llama_forward, model_dtype
    from reference.models.simple_cache import SimpleKVCache

    tokens = np.asarray(tokens, dtype=np.int64)
    n = len(tokens)
    cache = SimpleKVCache(hp, n, model_dtype(weights))
    if one_batch:
        pos = np.arange(n)
        return llama_forward(weights, hp, tokens, pos, cache.init_batch(pos))
    rows = []
    for i in range(n):
        pos = np.array([i])
        rows.append(llama_forward(weights, hp, tokens[i : i + 1], pos, cache.init_batch(pos))[0])
    return np.stack(rows)  # (n_tokens, n_vocab)


# ---------------------------------------------------------------------------------------------
# Mamba and Mamba-2


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
    """A small :class:`reference.hparams.MambaHParams` with ``d_inner = 2 * n_embd``.

    Mamba-1: ``dt_rank`` defaults to ``ceil(n_embd / 16)``; Mamba-2: ``n_head = d_inner /
    head_dim`` heads (``ssm_dt_rank``) in ``n_group`` groups.
    """
    from reference.hparams import MambaHParams

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
    from reference.gguf import mamba_metadata, write_gguf

    tensors = {k: np.asarray(v, dtype=np.float32) for k, v in weights.items()}
    write_gguf(str(path), mamba_metadata(hp), tensors)
    return Path(path)


def save_tiny_mamba_hf(
    path: str | Path,
    kind: str = "mamba",
    seed: int = 0,
    vocab_size: int = 48,
    hidden_size: int = 32,
    num_hidden_layers: int = 2,
    state_size: int = 8,
    conv_kernel: int = 4,
    head_dim: int = 8,
    n_groups: int = 1,
    time_step_rank: int | None = None,
    tie_word_embeddings: bool = False,
    chunk_size: int = 4,
) -> Path:
    """Build a seeded random ``MambaForCausalLM`` (``kind="mamba"``) or ``Mamba2ForCausalLM``
    (``"mamba2"``) and ``save_pretrained`` it; ``expand = 2``.

    Parameters are redrawn in NumPy from ``seed`` (:func:`_mamba_param`). Mamba-2's
    ``chunk_size`` is small so that its chunked SSD prefill crosses chunk boundaries.
    """
    import torch
    import transformers

    common = dict(
        vocab_size=vocab_size, hidden_size=hidden_size, num_hidden_layers=num_hidden_layers,
        state_size=state_size, conv_kernel=conv_kernel, expand=2, layer_norm_epsilon=1e-5,
        use_bias=False, use_conv_bias=True, tie_word_embeddings=tie_word_embeddings,
    )
    if kind == "mamba":
        config = transformers.MambaConfig(
            time_step_rank=time_step_rank or -(hidden_size // -16), **common
        )
        model = transformers.MambaForCausalLM(config)
    else:
        config = transformers.Mamba2Config(
            num_heads=2 * hidden_size // head_dim, head_dim=head_dim, n_groups=n_groups,
            chunk_size=chunk_size, **common
        )
        model = transformers.Mamba2ForCausalLM(config)
    rng = np.random.default_rng(seed)
    state = {}
    for name, p in model.state_dict().items():
        if name == "lm_head.weight" and tie_word_embeddings:
            continue
        x = _mamba_param(rng, name, tuple(p.shape), state_size)
        state[name] = torch.tensor(x, dtype=torch.float32)
    if tie_word_embeddings:
        state["lm_head.weight"] = state["backbone.embeddings.weight"]
    model.load_state_dict(state)
    model.save_pretrained(str(path))
    return Path(path)


def mamba_reference_logits(weights: dict, hp, tokens, chunks=None, dtype=None) -> np.ndarray:
    """Our logits of every token of one sequence, fed in ``chunks`` (sizes; None: one ubatch).

    Uses :class:`reference.models.mamba.SimpleRecurrentState` in ``dtype`` (default: the
    weights' dtype). ``chunks=[1] * n`` is token by token.
    """
    from reference.models.llama import model_dtype
    from reference.models.mamba import SimpleRecurrentState, mamba_forward

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


def mamba_transformers_logits(path: str | Path, tokens, chunks=None) -> np.ndarray:
    """transformers' logits (torch CPU, float32, the pure-torch Mamba path) of every token.

    ``chunks``: prompt chunk sizes fed through ``cache_params`` (None: one forward without a
    cache). A chunk of one token takes transformers' recurrent single-step path.
    """
    import torch
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32)
    model.eval()
    ids = torch.tensor([list(int(t) for t in tokens)])
    with torch.no_grad():
        if chunks is None:
            return model(ids).logits[0].numpy()
        rows, start, cache = [], 0, None
        for n in chunks:
            kwargs = dict(use_cache=True, cache_position=torch.arange(start, start + n))
            if cache is not None:
                kwargs["cache_params"] = cache
            out = model(ids[:, start : start + n], **kwargs)
            cache = out.cache_params
            rows.append(out.logits[0].numpy())
            start += n
        return np.concatenate(rows)  # (n_tokens, n_vocab)
