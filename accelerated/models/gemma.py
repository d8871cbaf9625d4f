r"""Twin of [`reference.models.gemma`][reference.models.gemma]: ``llm_build_gemma`` /
``llm_build_gemma2`` / ``llm_build_gemma3`` on MLX.

The same graphs, function for function, on ``accelerated.ops`` and the Llama twin's helpers
([`accelerated.models.llama`][accelerated.models.llama]: prepared weights,
[`linear`][accelerated.models.llama.linear], [`build_norm`][accelerated.models.llama.build_norm],
[`build_qkv`][accelerated.models.llama.build_qkv],
[`rope_in_graph`][accelerated.models.llama.rope_in_graph], the attention forms). What differs
is what differs there:

- weights are prepared once
  ([`accelerated.models.llama.prepare_weights`][accelerated.models.llama.prepare_weights]): the
  projections quantized or dense and transposed, the tied lm_head included; the norm gains
  (``attn_q_norm``, ``post_attention_norm``, ``post_ffw_norm``, ...) stay ``mx.array``;
- the graph is a pure function of MLX arrays ([`llm_build_gemma`][]), so
  [`accelerated.context.Context`][accelerated.context.Context] traces it with ``mx.compile``:
  positions, output ids and the cache tensors may be placeholders, the RoPE is the in-graph
  kernel, and the checks run on the host before ([`check_gemma_inputs`][]);
- the attention is MLX's fused kernel on a GPU and
  [`accelerated.models.llama.attn_grouped`][accelerated.models.llama.attn_grouped] on the CPU
  ([`accelerated.device.gpu_paths`][accelerated.device.gpu_paths] chooses); with
  Gemma 2's soft-cap both run the reference's op order (the fused kernel has no soft-cap);
- the result is a lazy float32 ``mx.array``.

What the Gemma graphs read of a layer's memory is what the Llama graph reads (``cpy_k``,
``get_k``, ``get_kq_mask`` of layer ``il``), so the iSWA cache's input, which sends a SWA
layer to its own cache and mask, serves them as it is.
"""

from __future__ import annotations

import math

import mlx.core as mx
import numpy as np
from numpy.typing import DTypeLike

from accelerated.device import gpu_paths
from accelerated.models.llama import (
    AttnInput,
    Weight,
    attn_grouped,
    build_inp_embd,
    build_norm,
    build_qkv,
    get_weight,
    index_array,
    kqv_out,
    linear,
    model_dtype,
    prepare_weights,
    rope_in_graph,
)
from accelerated.ops import add, build_attn_mha, geglu, scale, softcap
from reference.hparams import LlamaHParams, rope_cparams
from reference.models.gemma import (  # host-side pieces, imported as they are
    GEMMA_ARCHS,
    GEMMA_LAYER_TENSORS,
    gemma_kq_scale,
)
from reference.models.llama import LlamaForwardError, check_ubatch_inputs

__all__ = [
    "GEMMA_ARCHS",
    "GEMMA_LAYER_TENSORS",
    "build_attn_gemma",
    "build_ffn_geglu",
    "check_gemma_inputs",
    "gemma_forward",
    "gemma_kq_scale",
    "gemma_layer_weights",
    "llm_build_gemma",
]


# --8<-- [start:gemma_layer_weights]
def gemma_layer_weights(weights: dict, il: int, dtype: DTypeLike, arch: str) -> dict:
    """Twin of
    [`reference.models.gemma.gemma_layer_weights`][reference.models.gemma.gemma_layer_weights].
    Prepared weights, same fields.

    Examples:
        >>> gemma_layer_weights({}, 0, np.float32, "gemma3")
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


# --8<-- [start:build_attn_gemma]
def build_attn_gemma(
    inp: AttnInput,
    wo: Weight,
    q_cur: mx.array,
    k_cur: mx.array,
    v_cur: mx.array,
    attn_softcap: float,
    il: int,
) -> mx.array:
    """Twin of [`reference.models.gemma.build_attn_gemma`][reference.models.gemma.build_attn_gemma].
    ``inp`` holds MLX tensors.

    The attention form by device, as
    [`accelerated.models.llama.build_attn`][accelerated.models.llama.build_attn]: the fused
    [`accelerated.ops.build_attn_mha`][accelerated.ops.attention.build_attn_mha] on a GPU,
    [`accelerated.models.llama.attn_grouped`][accelerated.models.llama.attn_grouped] on the CPU;
    ``kq_scale = 1`` (the queries come scaled) and the soft-cap ``attn_softcap``.

    Returns:
        ``(n_tokens, n_embd)``.
    """
    inp.cpy_k(il, k_cur)
    inp.cpy_v(il, v_cur)
    k = inp.get_k(il)  # (n_kv, n_head_kv, d_k)
    v = inp.get_v(il)  # (n_kv, n_head_kv, d_v)
    kq_mask = inp.get_kq_mask(il)  # (n_tokens, n_kv)
    mha = build_attn_mha if gpu_paths() else attn_grouped
    cur = mha(q_cur, k, v, kq_mask, 1.0, softcap=attn_softcap,
              n_stream=inp.n_stream)  # (n_tokens, n_head * d_v)
    kqv_out(inp, il, cur)
    return linear(wo, cur)  # (n_tokens, n_embd)
# --8<-- [end:build_attn_gemma]


# --8<-- [start:build_ffn_geglu]
def build_ffn_geglu(cur: mx.array, layer: dict) -> mx.array:
    """Twin of [`reference.models.gemma.build_ffn_geglu`][reference.models.gemma.build_ffn_geglu].
    GeGLU on prepared weights.

    Examples:
        >>> layer = {"ffn_up": mx.eye(2), "ffn_gate": mx.eye(2), "ffn_down": mx.eye(2)}
        >>> [round(x, 4) for x in build_ffn_geglu(mx.array([[0.0, 1.0]]), layer).tolist()[0]]
        [0.0, 0.8412]
    """
    up = linear(layer["ffn_up"], cur)  # (n_tokens, n_ff)
    gate = linear(layer["ffn_gate"], cur)  # (n_tokens, n_ff)
    cur = geglu(gate, up)  # (n_tokens, n_ff)
    return linear(layer["ffn_down"], cur)  # (n_tokens, n_embd)
# --8<-- [end:build_ffn_geglu]


def _attention(
    layer: dict, cur: mx.array, pos: mx.array, hparams: LlamaHParams, inp_attn: AttnInput,
    il: int,
) -> mx.array:
    """The self-attention of block ``il``: Q/K/V, Gemma 3's Q/K norms, RoPE, scale, attend."""
    eps = hparams.f_norm_rms_eps
    q, k, v = build_qkv(layer, cur, hparams.n_embd_head_k, hparams.n_head, hparams.n_head_kv)
    if hparams.arch == "gemma3":
        q = build_norm(q, layer["attn_q_norm"], eps)  # (n_tokens, n_head, d): per head
        k = build_norm(k, layer["attn_k_norm"], eps)  # (n_tokens, n_head_kv, d)
    # gemma: the context's base and scale on every layer; gemma2/3: the SWA ones on SWA layers
    rope = rope_cparams(hparams, None if hparams.arch == "gemma" else il)
    q = rope_in_graph(q, pos, rope)  # (n_tokens, n_head, d)
    k = rope_in_graph(k, pos, rope)  # (n_tokens, n_head_kv, d)
    q = scale(q, gemma_kq_scale(hparams))  # ggml_scale(Qcur, f_attention_scale)
    return build_attn_gemma(inp_attn, layer["wo"], q, k, v, hparams.f_attn_logit_softcapping, il)


# --8<-- [start:llm_build_gemma]
def llm_build_gemma(
    weights: dict,
    hparams: LlamaHParams,
    tokens: np.ndarray | None,
    pos: np.ndarray,
    inp_attn: AttnInput,
    out_ids: np.ndarray | None,
    embd: np.ndarray | None = None,
) -> mx.array:
    """Twin of [`reference.models.gemma.llm_build_gemma`][reference.models.gemma.llm_build_gemma].
    On prepared weights.

    A pure function of MLX arrays, as
    [`accelerated.models.llama.llm_build_llama`][accelerated.models.llama.llm_build_llama]:
    ``tokens``/``embd``, ``pos``, ``out_ids`` and the cache tensors of ``inp_attn`` may be graph
    placeholders; the inputs must have been checked ([`check_gemma_inputs`][]). ``out_ids``
    None means every row, in order (no ``get_rows``).

    Returns:
        logits ``(n_outputs, n_vocab)`` float32, lazy.
    """
    dtype = model_dtype(weights)
    arch, eps = hparams.arch, hparams.f_norm_rms_eps
    post_norms = arch in ("gemma2", "gemma3")
    pos = index_array(pos)  # (n_tokens,)
    out_ids = None if out_ids is None else index_array(out_ids)  # (n_outputs,)
    inpL = build_inp_embd(weights, tokens, embd, dtype)  # (n_tokens, n_embd)
    # Gemma 3 does not scale embeddings given as input (e.g. an image encoder's)
    embd_scale = 1.0 if arch == "gemma3" and tokens is None else math.sqrt(hparams.n_embd)
    inpL = scale(inpL, float(np.float32(embd_scale)))  # sqrtf(n_embd)
    for il in range(hparams.n_layer):
        layer = gemma_layer_weights(weights, il, dtype, arch)
        cur = build_norm(inpL, layer["attn_norm"], eps)
        cur = _attention(layer, cur, pos, hparams, inp_attn, il)  # (n_tokens, n_embd)
        if il == hparams.n_layer - 1 and out_ids is not None:
            # only the output rows go on: llama.cpp's inp_out_ids (get_rows)
            cur = mx.take(cur, out_ids, axis=0)  # (n_outputs, n_embd)
            inpL = mx.take(inpL, out_ids, axis=0)  # (n_outputs, n_embd)
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
    logits = linear(output, cur)  # (n_outputs, n_vocab)
    if hparams.f_final_logit_softcapping > 0:
        logits = softcap(logits, hparams.f_final_logit_softcapping)
    return logits
# --8<-- [end:llm_build_gemma]


# --8<-- [start:check_gemma_inputs]
def check_gemma_inputs(
    hparams: LlamaHParams,
    tokens: np.ndarray | None,
    pos: np.ndarray,
    out_ids: np.ndarray | None,
    embd: np.ndarray | None,
) -> tuple[np.ndarray | None, np.ndarray, np.ndarray, np.ndarray | None]:
    """The host-side checks of
    [`reference.models.gemma.gemma_forward`][reference.models.gemma.gemma_forward], before any
    array work: the arch, then
    [`reference.models.llama.check_forward_inputs`][reference.models.llama.check_forward_inputs]'
    checks of the ubatch.

    Shared by [`gemma_forward`][] and the Context, which then runs the traced graph.

    Returns:
        ``(tokens, pos, out_ids, embd)`` as int64 / float arrays; ``out_ids`` defaults to every
        token.

    Raises:
        LlamaForwardError: an arch not in ``GEMMA_ARCHS``, or a bad ubatch.

    Examples:
        >>> from reference.testing import tiny_gemma_hparams, tiny_hparams
        >>> check_gemma_inputs(tiny_gemma_hparams("gemma3"), [3, 4], [0, 1], None, None)[2]
        array([0, 1])
        >>> check_gemma_inputs(tiny_hparams(), [3], [0], None, None)  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        reference.models.llama.LlamaForwardError: arch 'llama' is not one of ('gemma', ...)
    """
    if hparams.arch not in GEMMA_ARCHS:
        raise LlamaForwardError(f"arch {hparams.arch!r} is not one of {GEMMA_ARCHS}")
    return check_ubatch_inputs(hparams, tokens, pos, out_ids, embd)
# --8<-- [end:check_gemma_inputs]


# --8<-- [start:gemma_forward]
def gemma_forward(
    weights: dict,
    hparams: LlamaHParams,
    tokens: np.ndarray | None,
    pos: np.ndarray,
    inp_attn: AttnInput,
    out_ids: np.ndarray | None = None,
    embd: np.ndarray | None = None,
) -> mx.array:
    """Twin of [`reference.models.gemma.gemma_forward`][reference.models.gemma.gemma_forward]. The
    same checks, then MLX.

    ``weights`` may be raw (prepared on every call then) or prepared once by
    [`accelerated.models.llama.prepare_weights`][accelerated.models.llama.prepare_weights].

    Returns:
        logits ``(n_outputs, n_vocab)``, a lazy float32 ``mx.array``.

    Raises:
        LlamaForwardError: as the reference.

    Examples:
        >>> from reference.testing import tiny_gemma_hparams, random_gemma_weights
        >>> hp = tiny_gemma_hparams("gemma2", n_swa=2)
        >>> w = prepare_weights(random_gemma_weights(hp, seed=0))
        >>> gemma_forward(w, hp, np.array([99]), np.array([3]), None)
        Traceback (most recent call last):
        ...
        reference.models.llama.LlamaForwardError: token id 99 out of range [0, 32)
    """
    tokens, pos, out_ids, embd = check_gemma_inputs(hparams, tokens, pos, out_ids, embd)
    weights = prepare_weights(weights)
    return llm_build_gemma(weights, hparams, tokens, pos, inp_attn, out_ids, embd)
# --8<-- [end:gemma_forward]

