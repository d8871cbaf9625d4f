"""The oracles' side of the tiny models: HF folders and llama.cpp / transformers logits.

The models themselves (hparams, seeded weights, GGUF writers, our own logits and the NMSE
verdict) live in :mod:`reference.testing`, where doctests and docs pages can use them; they
are imported here so that a test finds every tiny-model helper in one place.

- :func:`save_tiny_hf` builds a seeded random ``LlamaForCausalLM`` / ``Qwen2ForCausalLM`` /
  ``MistralForCausalLM`` with transformers and ``save_pretrained``'s it (safetensors);
  :func:`save_tiny_gemma_hf` the same for ``GemmaForCausalLM`` / ``Gemma2ForCausalLM`` /
  ``Gemma3ForCausalLM``;
  :func:`save_tiny_mamba_hf` the same for ``MambaForCausalLM`` / ``Mamba2ForCausalLM``.
- :func:`llamacpp_logits` and :func:`mamba_transformers_logits` run the oracles.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from reference.testing import (  # noqa: F401  (re-exported for the tests)
    _mamba_param,
    chunked_logits,
    mamba_reference_logits,
    nmse,
    nmse_check,
    random_gemma_weights,
    random_mamba_weights,
    random_weights,
    reference_logits,
    tiny_gemma_hparams,
    tiny_hparams,
    tiny_mamba_hparams,
    write_tiny_gguf,
    write_tiny_mamba_gguf,
)

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
    return save_redrawn(model, path, seed)


def save_redrawn(model, path: str | Path, seed: int, norm_center: float = 1.0) -> Path:
    """Redraw every parameter of the transformers ``model`` in NumPy from ``seed`` and
    ``save_pretrained`` it to ``path``: norm gains ``norm_center`` + N(0, 0.1²) (Gemma stores
    ``1 + w``: centre 0), biases N(0, 0.1²), embeddings N(0, 1), matrices and experts
    N(0, 1/n_in); a tied ``lm_head`` is the embeddings themselves."""
    import torch

    rng = np.random.default_rng(seed)
    tied = model.config.tie_word_embeddings
    state = {}
    for name, p in model.state_dict().items():
        if name == "lm_head.weight" and tied:
            continue  # the same tensor as embed_tokens
        if name.endswith("norm.weight"):
            x = norm_center + 0.1 * rng.normal(size=p.shape)
        elif name.endswith(".bias"):
            x = 0.1 * rng.normal(size=p.shape)
        elif name.endswith("embed_tokens.weight"):
            x = rng.normal(size=p.shape)
        else:
            x = rng.normal(0.0, 1.0 / np.sqrt(p.shape[-1]), size=p.shape)
        state[name] = torch.tensor(x, dtype=torch.float32)
    if tied:
        state["lm_head.weight"] = state["model.embed_tokens.weight"]
    model.load_state_dict(state)
    model.save_pretrained(str(path))
    return Path(path)


def save_random_hf(path: str | Path, cls_name: str, seed: int = 0, **config) -> Path:
    """Build a ``transformers.<cls_name>`` from ``config`` (plus small defaults) and save it
    with every parameter redrawn from ``seed`` ([`save_redrawn`][])."""
    import transformers

    config = dict(dict(vocab_size=40, hidden_size=32, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, intermediate_size=48,
                       max_position_embeddings=256, rms_norm_eps=1e-6), **config)
    cfg = getattr(transformers, cls_name.replace("ForCausalLM", "Config"))(**config)
    cfg._attn_implementation = "eager"
    return save_redrawn(getattr(transformers, cls_name)(cfg), path, seed)


def save_tiny_gemma_hf(
    path: str | Path,
    kind: str = "gemma2",
    seed: int = 0,
    vocab_size: int = 40,
    hidden_size: int = 32,
    num_hidden_layers: int = 4,
    num_attention_heads: int = 4,
    num_key_value_heads: int = 2,
    head_dim: int = 8,
    intermediate_size: int = 48,
    **extra,
) -> Path:
    """Build a seeded random ``GemmaForCausalLM`` / ``Gemma2ForCausalLM`` /
    ``Gemma3ForCausalLM`` (``kind``: gemma, gemma2, gemma3) and save it.

    ``extra`` goes to the config (``sliding_window``, ``layer_types``, ``rope_parameters``,
    ``query_pre_attn_scalar`` (default: ``head_dim``), the soft-caps ...). Norm weights are
    HF's $w$ of $x (1 + w)$, drawn around 0; the rest as in :func:`save_tiny_hf`.
    """
    import transformers

    cls = {"gemma": "Gemma", "gemma2": "Gemma2", "gemma3": "Gemma3Text"}[kind]
    if kind != "gemma":  # the released models scale by the head size (HF's default is 256)
        extra.setdefault("query_pre_attn_scalar", head_dim)
    config = getattr(transformers, f"{cls}Config")(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        num_hidden_layers=num_hidden_layers,
        num_attention_heads=num_attention_heads,
        num_key_value_heads=num_key_value_heads,
        head_dim=head_dim,
        intermediate_size=intermediate_size,
        max_position_embeddings=256,
        rms_norm_eps=1e-6,
        **extra,
    )
    config._attn_implementation = "eager"
    model_cls = "Gemma3ForCausalLM" if kind == "gemma3" else f"{cls}ForCausalLM"
    model = getattr(transformers, model_cls)(config)
    return save_redrawn(model, path, seed, norm_center=0.0)


# ---------------------------------------------------------------------------------------------
# Running the oracles and comparing


def llamacpp_logits(path: str | Path, tokens, one_batch: bool = True, n_ctx: int = 512,
                    lora_path: str | Path | None = None, lora_scale: float = 1.0):
    """Logits of every token from llama.cpp (llama-cpp-python) at positions ``0..n-1``.

    ``one_batch``: the whole prompt in one ``llama_decode``; otherwise one token per decode.
    ``lora_path``: a LoRA adapter llama.cpp applies with ``lora_scale``.
    llama.cpp runs with an f32 KV cache (``type_k = type_v = 0``), flash attention disabled
    (the plain ``mul_mat``/``soft_max_ext`` path that the reference mirrors), 2 threads.
    """
    import llama_cpp

    tokens = [int(t) for t in tokens]
    n = len(tokens)
    llm = llama_cpp.Llama(
        model_path=str(path),
        lora_path=None if lora_path is None else str(lora_path),
        lora_scale=lora_scale,
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


# ---------------------------------------------------------------------------------------------
# Mamba and Mamba-2


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
