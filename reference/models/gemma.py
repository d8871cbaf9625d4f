r"""The Gemma blocks: llama.cpp's ``llm_build_gemma``, ``llm_build_gemma2``, ``llm_build_gemma3``.

The graphs of ``src/models/gemma.cpp``, ``gemma2.cpp`` and ``gemma3.cpp`` (text), built from
the helpers of [`reference.models.llama`][reference.models.llama]. They are Llama's block with
five changes, and Gemma 2 / 3 add four more. For a ubatch of tokens $t$ at positions $p$, with
$\mathrm{n}(x, g) = \mathrm{rms\_norm}(x) \odot g$:

$$
\begin{aligned}
x^{(0)} &= \sqrt{n_{embd}}\; E[t]
  && \text{scaled embedding (Gemma 3: token ids only)} \\
h &= \mathrm{n}(x^{(l)}, g_{attn}),\quad q, k, v = h W_q^T,\; h W_k^T,\; h W_v^T \\
q, k &= \mathrm{n}(q, g_{q}),\; \mathrm{n}(k, g_{k})
  && \text{Gemma 3: per head, over } d \\
q, k &= \mathrm{rope}_{neox}(q, p; \theta_l),\; \mathrm{rope}_{neox}(k, p; \theta_l)
  && \theta_l\text{: the SWA base on SWA layers} \\
s &= (\sigma\, q) K^T,\quad s \leftarrow c_a \tanh(s / c_a)
  && \sigma = \texttt{f\_attention\_scale};\ \text{Gemma 2: soft-cap} \\
a &= \mathrm{softmax}(s + M_l)\, V\, W_o^T
  && M_l\text{: windowed on SWA layers} \\
y &= x^{(l)} + \mathrm{n}(a, g_{attn\_post})
  && \text{Gemma 1: } y = x^{(l)} + a \\
f &= \left(\mathrm{gelu}(u W_{gate}^T) \odot u W_{up}^T\right) W_{down}^T,
  \quad u = \mathrm{n}(y, g_{ffn}) && \text{GeGLU} \\
x^{(l+1)} &= y + \mathrm{n}(f, g_{ffn\_post})
  && \text{Gemma 1: } y + f \\
\mathrm{logits} &= c_f \tanh\!\left(\mathrm{n}(x^{(L)}, g_{out})\, E^T / c_f\right)
  && \text{tied; the cap when } c_f > 0
\end{aligned}
$$

What differs, and where llama.cpp says so:

| | ``gemma`` | ``gemma2`` | ``gemma3`` |
|---|---|---|---|
| embedding scale $\sqrt{n_{embd}}$ | yes | yes | token ids only (``ubatch.token``) |
| RoPE | NeoX | NeoX, per layer | NeoX, per layer |
| query scale $\sigma$ | $1/\sqrt{n_{embd\_head\_v}}$ | ``f_attention_scale`` | the same |
| ``attn_q_norm`` / ``attn_k_norm`` | | | yes |
| ``post_attention_norm`` / ``post_ffw_norm`` | | yes | yes |
| attention soft-cap $c_a$ | | ``f_attn_logit_softcapping`` | |
| final soft-cap $c_f$ | | ``f_final_logit_softcapping`` | when $> 0$ |
| output | ``token_embd`` | ``token_embd`` | ``output`` or ``token_embd`` |

- **The query scale** is applied to $q$ (``ggml_scale(Qcur, ...)``) and ``build_attn`` then
  gets ``kq_scale = 1``; the soft-cap therefore acts on $\sigma\, q \cdot k$.
  ``f_attention_scale`` is not in a GGUF: llama.cpp derives it from the layer count
  ([`reference.hparams.gemma_attention_scale`][reference.hparams.gemma_attention_scale]);
  HF's ``query_pre_attn_scalar`` $s$ means $\sigma = s^{-1/2}$ ([`reference.hf`][reference.hf]).
- **Per-layer RoPE**: a SWA layer rotates with ``rope_freq_base_train_swa`` /
  ``rope_freq_scale_train_swa`` (``llama_model::get_rope_freq_base``, through
  [`reference.hparams.rope_cparams`][reference.hparams.rope_cparams] with ``il``); Gemma 3's
  global layers alone carry the RoPE scaling.
- **GeGLU** is ``build_ffn(..., LLM_FFN_GELU, LLM_FFN_PAR)``: ``ggml_geglu_split``, the tanh
  GELU ([`reference.ops.geglu`][reference.ops.geglu]; ggml's CPU kernel looks it up in a
  float16 table, see [`reference.ops.ffn`][reference.ops.ffn]).
- **Soft-capping** is [`reference.ops.softcap`][reference.ops.softcap]: on the scores inside
  ``build_attn_mha``, and on the logits at the end.
- **The memory**: Gemma 2 and Gemma 3 with a window use the iSWA cache
  (``build_attn_inp_kv_iswa``): the SWA layers read one cache, the others another. The graph
  only asks the attention input for layer ``il``'s K, V and mask, so any memory that answers
  per layer serves it ([`SimpleKVCache`][reference.models.simple_cache.SimpleKVCache] masks
  the SWA layers by the window).

Only the output rows go through the last layer's tail (``inp_out_ids``), as in
[`reference.models.llama.llm_build_llama`][reference.models.llama.llm_build_llama].
"""

from __future__ import annotations

import math

import numpy as np
from numpy.typing import DTypeLike

from reference.hparams import GEMMA_ARCHS, LlamaHParams, rope_cparams
from reference.models.llama import (
    AttnInput,
    LlamaForwardError,
    build_inp_embd,
    build_norm,
    build_qkv,
    check_ubatch_inputs,
    get_weight,
    model_dtype,
)
from reference.ops import add, build_attn_mha, geglu, get_rows, mul_mat, rope_ext, scale, softcap

__all__ = [
    "GEMMA_ARCHS",
    "GEMMA_LAYER_TENSORS",
    "build_attn_gemma",
    "build_ffn_geglu",
    "gemma_forward",
    "gemma_kq_scale",
    "gemma_layer_weights",
    "llm_build_gemma",
]


# --8<-- [start:GEMMA_LAYER_TENSORS]
# A block's tensors: llama_layer's field name -> (GGUF name after "blk.{il}.", the archs that
# create it). All are required where they exist; there are no biases.
GEMMA_LAYER_TENSORS = {
    "attn_norm": ("attn_norm.weight", GEMMA_ARCHS),
    "wq": ("attn_q.weight", GEMMA_ARCHS),
    "wk": ("attn_k.weight", GEMMA_ARCHS),
    "wv": ("attn_v.weight", GEMMA_ARCHS),
    "wo": ("attn_output.weight", GEMMA_ARCHS),
    "attn_q_norm": ("attn_q_norm.weight", ("gemma3",)),
    "attn_k_norm": ("attn_k_norm.weight", ("gemma3",)),
    "attn_post_norm": ("post_attention_norm.weight", ("gemma2", "gemma3")),
    "ffn_norm": ("ffn_norm.weight", GEMMA_ARCHS),
    "ffn_gate": ("ffn_gate.weight", GEMMA_ARCHS),
    "ffn_up": ("ffn_up.weight", GEMMA_ARCHS),
    "ffn_down": ("ffn_down.weight", GEMMA_ARCHS),
    "ffn_post_norm": ("post_ffw_norm.weight", ("gemma2", "gemma3")),
}
"""A block's tensors: ``llama_layer``'s field name -> (GGUF name after ``blk.{il}.``, the
architectures that create it)."""
# --8<-- [end:GEMMA_LAYER_TENSORS]


# --8<-- [start:gemma_layer_weights]
def gemma_layer_weights(weights: dict, il: int, dtype: DTypeLike, arch: str) -> dict:
    """The weights of block ``il`` of a ``gemma``/``gemma2``/``gemma3`` model.

    As ``load_arch_tensors``: norms ``(n_embd,)`` (``attn_q_norm``/``attn_k_norm``
    ``(n_embd_head_k,)``), projections as in
    [`reference.models.llama.layer_weights`][reference.models.llama.layer_weights]; only the
    fields of ``arch`` (see `GEMMA_LAYER_TENSORS`), every one required. The Q/K/V biases
    [`build_qkv`][reference.models.llama.build_qkv] looks for are None.

    Raises:
        LlamaForwardError: a missing weight.

    Examples:
        >>> sorted(gemma_layer_weights({}, 0, np.float32, "gemma3"))
        Traceback (most recent call last):
        ...
        reference.models.llama.LlamaForwardError: missing weight 'blk.0.attn_norm.weight'
    """
    layer = {
        field: get_weight(weights, f"blk.{il}.{name}", dtype)
        for field, (name, archs) in GEMMA_LAYER_TENSORS.items()
        if arch in archs
    }
    return {**layer, "bq": None, "bk": None, "bv": None}
# --8<-- [end:gemma_layer_weights]


# --8<-- [start:gemma_kq_scale]
def gemma_kq_scale(hparams: LlamaHParams) -> float:
    r"""The factor of $q$: $1/\sqrt{n_{embd\_head\_v}}$ for ``gemma``, ``f_attention_scale``
    for ``gemma2``/``gemma3`` ($1/\sqrt{n_{embd\_head\_k}}$ when it is 0), in float32.

    ``llm_build_gemma`` computes ``1.0f / sqrtf(float(n_embd_head))`` with
    ``n_embd_head = n_embd_head_v``; Gemma 2/3 read ``hparams.f_attention_scale``.

    Examples:
        >>> from reference.testing import tiny_gemma_hparams
        >>> gemma_kq_scale(tiny_gemma_hparams("gemma", head_dim=16))
        0.25
    """
    if hparams.arch == "gemma" or not hparams.f_attention_scale:
        d = hparams.n_embd_head_v if hparams.arch == "gemma" else hparams.n_embd_head_k
        return float(np.float32(1.0) / np.sqrt(np.float32(d)))
    return hparams.f_attention_scale
# --8<-- [end:gemma_kq_scale]


# --8<-- [start:build_attn_gemma]
def build_attn_gemma(
    inp: AttnInput,
    wo: np.ndarray,
    q_cur: np.ndarray,
    k_cur: np.ndarray,
    v_cur: np.ndarray,
    attn_softcap: float,
    il: int,
) -> np.ndarray:
    """``build_attn`` as the Gemma graphs call it: ``kq_scale = 1``, the soft-cap, no biases.

    As [`reference.models.llama.build_attn`][reference.models.llama.build_attn]: stores
    ``k_cur``/``v_cur``, reads back layer ``il``'s K, V and mask (windowed on a SWA layer),
    then ``build_attn_mha`` with the soft-cap of ``hparams.attn_soft_cap``, then ``wo``.

    Args:
        inp: the attention input of the ubatch.
        wo: output projection ``(n_embd, n_head * d_v)``.
        q_cur: roped, already scaled queries ``(n_tokens, n_head, d_k)``.
        k_cur: roped keys ``(n_tokens, n_head_kv, d_k)``.
        v_cur: values ``(n_tokens, n_head_kv, d_v)``.
        attn_softcap: $c_a$ (``f_attn_logit_softcapping``), 0 for none.
        il: layer index.

    Returns:
        ``(n_tokens, n_embd)``.
    """
    inp.cpy_k(il, k_cur)
    inp.cpy_v(il, v_cur)
    k = inp.get_k(il)  # (n_kv, n_head_kv, d_k)
    v = inp.get_v(il)  # (n_kv, n_head_kv, d_v)
    kq_mask = inp.get_kq_mask(il)  # (n_tokens, n_kv)
    cur = build_attn_mha(q_cur, k, v, kq_mask, 1.0, softcap=attn_softcap,
                         n_stream=inp.n_stream)  # (n_tokens, n_head * d_v)
    return mul_mat(wo, cur)  # (n_tokens, n_embd)
# --8<-- [end:build_attn_gemma]


# --8<-- [start:build_ffn_geglu]
def build_ffn_geglu(cur: np.ndarray, layer: dict) -> np.ndarray:
    r"""Gemma's FFN, ``build_ffn(..., LLM_FFN_GELU, LLM_FFN_PAR)`` (GeGLU, no biases).

    $$ y = \left(\mathrm{gelu}(x W_{gate}^T) \odot x W_{up}^T\right) W_{down}^T $$

    Args:
        cur: normed activations ``(n_tokens, n_embd)``.
        layer: [`gemma_layer_weights`][] of the block.

    Returns:
        ``(n_tokens, n_embd)``.

    Examples:
        >>> layer = {"ffn_up": np.eye(2), "ffn_gate": np.eye(2), "ffn_down": np.eye(2)}
        >>> build_ffn_geglu(np.array([[0.0, 1.0]]), layer).round(4)
        array([[0.    , 0.8412]])
    """
    up = mul_mat(layer["ffn_up"], cur)  # (n_tokens, n_ff)
    gate = mul_mat(layer["ffn_gate"], cur)  # (n_tokens, n_ff)
    cur = geglu(gate, up)  # (n_tokens, n_ff)
    return mul_mat(layer["ffn_down"], cur)  # (n_tokens, n_embd)
# --8<-- [end:build_ffn_geglu]


def _attention(
    layer: dict, cur: np.ndarray, pos: np.ndarray, hparams: LlamaHParams, inp_attn: AttnInput,
    il: int,
) -> np.ndarray:
    """The self-attention of block ``il``: Q/K/V, Gemma 3's Q/K norms, RoPE, scale, attend."""
    eps = hparams.f_norm_rms_eps
    q, k, v = build_qkv(layer, cur, hparams.n_embd_head_k, hparams.n_head, hparams.n_head_kv)
    if hparams.arch == "gemma3":
        q = build_norm(q, layer["attn_q_norm"], eps)  # (n_tokens, n_head, d): per head
        k = build_norm(k, layer["attn_k_norm"], eps)  # (n_tokens, n_head_kv, d)
    # gemma: the context's base and scale on every layer; gemma2/3: the SWA ones on SWA layers
    rope = rope_cparams(hparams, None if hparams.arch == "gemma" else il)
    q = rope_ext(q, pos, rope)  # (n_tokens, n_head, d)
    k = rope_ext(k, pos, rope)  # (n_tokens, n_head_kv, d)
    q = scale(q, gemma_kq_scale(hparams))  # ggml_scale(Qcur, f_attention_scale)
    return build_attn_gemma(inp_attn, layer["wo"], q, k, v, hparams.f_attn_logit_softcapping, il)


# --8<-- [start:llm_build_gemma]
def llm_build_gemma(
    weights: dict,
    hparams: LlamaHParams,
    tokens: np.ndarray | None,
    pos: np.ndarray,
    inp_attn: AttnInput,
    out_ids: np.ndarray,
    embd: np.ndarray | None = None,
) -> np.ndarray:
    """The graph of ``llm_build_gemma`` / ``llm_build_gemma2`` / ``llm_build_gemma3``
    (by ``hparams.arch``) for one ubatch.

    Args:
        weights: GGUF-named weights (arrays or quantized tensors).
        hparams: the model's hyperparameters (``arch`` one of `GEMMA_ARCHS`).
        tokens: token ids ``(n_tokens,)``, or None when ``embd`` is given.
        pos: their positions ``(n_tokens,)``.
        inp_attn: the memory's attention input for this ubatch (per layer K, V, mask).
        out_ids: indices (into the ubatch) of the tokens that get logits ``(n_outputs,)``.
        embd: input embeddings ``(n_tokens, n_embd)`` instead of token ids.

    Returns:
        logits ``(n_outputs, n_vocab)`` in the dtype of
        [`model_dtype`][reference.models.llama.model_dtype].
    """
    dtype = model_dtype(weights)
    arch, eps = hparams.arch, hparams.f_norm_rms_eps
    post_norms = arch in ("gemma2", "gemma3")

    inpL = build_inp_embd(weights, tokens, embd, dtype)  # (n_tokens, n_embd)
    # Gemma 3 does not scale embeddings given as input (e.g. an image encoder's)
    embd_scale = 1.0 if arch == "gemma3" and tokens is None else math.sqrt(hparams.n_embd)
    inpL = scale(inpL, float(np.float32(embd_scale)))  # sqrtf(n_embd)
    for il in range(hparams.n_layer):
        layer = gemma_layer_weights(weights, il, dtype, arch)
        cur = build_norm(inpL, layer["attn_norm"], eps)
        cur = _attention(layer, cur, pos, hparams, inp_attn, il)  # (n_tokens, n_embd)
        if il == hparams.n_layer - 1:
            # only the output rows go on: llama.cpp's inp_out_ids
            cur = get_rows(cur, out_ids)  # (n_outputs, n_embd)
            inpL = get_rows(inpL, out_ids)  # (n_outputs, n_embd)
        if post_norms:
            cur = build_norm(cur, layer["attn_post_norm"], eps)
        sa_out = add(cur, inpL)
        cur = build_norm(sa_out, layer["ffn_norm"], eps)
        cur = build_ffn_geglu(cur, layer)
        if post_norms:
            cur = build_norm(cur, layer["ffn_post_norm"], eps)
        inpL = add(cur, sa_out)

    cur = build_norm(inpL, get_weight(weights, "output_norm.weight", dtype), eps)
    output = get_weight(weights, "output.weight", dtype, required=False)
    if output is None:  # tied: the lm_head is token_embd (always for gemma and gemma2)
        output = get_weight(weights, "token_embd.weight", dtype)
    logits = mul_mat(output, cur)  # (n_outputs, n_vocab)
    if hparams.f_final_logit_softcapping > 0:
        logits = softcap(logits, hparams.f_final_logit_softcapping)
    return logits
# --8<-- [end:llm_build_gemma]


# --8<-- [start:gemma_forward]
def gemma_forward(
    weights: dict,
    hparams: LlamaHParams,
    tokens: np.ndarray | None,
    pos: np.ndarray,
    inp_attn: AttnInput,
    out_ids: np.ndarray | None = None,
    embd: np.ndarray | None = None,
) -> np.ndarray:
    """One forward pass of a ubatch of a Gemma model: checks the inputs, then
    [`llm_build_gemma`][].

    The arguments and their checks are those of
    [`reference.models.llama.llama_forward`][reference.models.llama.llama_forward].

    Returns:
        logits ``(n_outputs, n_vocab)``.

    Raises:
        LlamaForwardError: an arch not in `GEMMA_ARCHS`, or inputs
            [`check_forward_inputs`][reference.models.llama.check_forward_inputs] refuses.

    Examples:
        >>> from reference.testing import tiny_gemma_hparams, random_gemma_weights
        >>> from reference.models.simple_cache import SimpleKVCache
        >>> hp = tiny_gemma_hparams("gemma2", n_swa=2)
        >>> w = random_gemma_weights(hp, seed=0)
        >>> pos = np.arange(4)
        >>> logits = gemma_forward(w, hp, np.array([1, 5, 7, 2]), pos,
        ...                        SimpleKVCache(hp, n_ctx=8).init_batch(pos))
        >>> logits.shape, bool(np.abs(logits).max() <= hp.f_final_logit_softcapping)
        ((4, 32), True)
    """
    if hparams.arch not in GEMMA_ARCHS:
        raise LlamaForwardError(f"arch {hparams.arch!r} is not one of {GEMMA_ARCHS}")
    tokens, pos, out_ids, embd = check_ubatch_inputs(hparams, tokens, pos, out_ids, embd)
    return llm_build_gemma(weights, hparams, tokens, pos, inp_attn, out_ids, embd)
# --8<-- [end:gemma_forward]
