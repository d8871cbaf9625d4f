r"""Twin of [`reference.models.llama`][reference.models.llama]: ``llm_build_llama`` /
``llm_build_qwen2`` / ``llm_build_qwen3`` / ``llm_build_qwen3moe`` on MLX.

The same graph, function for function, on ``accelerated.ops``. What differs:

- weights are prepared once by [`prepare_weights`][]: GGUF tensors of the types MLX holds
  exactly ([`accelerated.quants.EXACT_TYPES`][accelerated.quants.EXACT_TYPES]: Q4_0, Q4_1, Q5_0,
  Q5_1, Q8_0, Q4_K, Q5_K, Q3_K, IQ4_NL, IQ4_XS, TQ2_0, MXFP4) become
  [`accelerated.quants.MLXQuantized`][accelerated.quants.MLXQuantized] (lossless) and every matmul
  with them is [`accelerated.quants.quantized_matmul`][accelerated.quants.quantized_matmul]; other
  tensors are ``mx.array`` (float32; other GGUF types dequantized once at load);
- ``get_rows`` on a quantized ``token_embd`` gathers the *packed* rows of the needed tokens
  and dequantizes only those ([`accelerated.quants.take_rows`][accelerated.quants.take_rows]),
  the same values as the reference's full
  dequantization; a tied lm_head runs quantized on the packed table;
- on the CPU device the matmul weights are dequantized once and stored *transposed*,
  ``(n_in, n_out)`` ([`TransposedWeight`][], ``matmul="dense"``): MLX's Linux CPU backend
  calls a reference BLAS, and ``x @ W^T`` with ``W^T`` contiguous is its fastest product
  (ahead of ``mx.quantized_matmul`` and of a transposed view at every size measured in
  ``docs/mlx.md``); the values are the same (dequantization is exact), only the summation
  order of the float32 products changes;
- the graph is a pure function of MLX arrays ([`llm_build_llama`][]): positions, output
  ids and token ids may be ``mx.array`` placeholders, so the Context can trace it once with
  ``mx.compile`` and reuse it (host-side checks happen before, in [`llama_forward`][] or the
  Context); inside it ``rope_ext`` and ``get_rows`` are their fused MLX kernels without the
  host validation ([`rope_in_graph`][], ``mx.take``);
- on the CPU device the attention is [`attn_grouped`][] (bit for bit what MLX's CPU
  fallback of the fused kernel computes, in fewer and larger matmuls);
- those choices by device (the matmul form, the attention form, RoPE's cos/sin once per
  graph: [`graph_rope`][]) are made by one function,
  [`gpu_paths`][accelerated.device.gpu_paths]: the environment variable
  ``LLAMAREF_MLX_GPU_PATHS=1`` makes the CPU device take the GPU forms too, so that CI,
  which has no GPU, runs the code that Metal and CUDA run;
- a mixture of experts runs its experts through ``mx.gather_mm`` / ``mx.gather_qmm``
  ([`accelerated.ops.moe`][accelerated.ops.moe]): the 3-D ``ffn_*_exps`` stay as prepared
  (packed when their type is exact) and a token reads only its experts;
- the result is a lazy ``mx.array`` (the caller evaluates it, e.g. ``np.array(logits)``).

Compute is float32 (MLX's dtype), whatever the dtype of the reference weights.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

import mlx.core as mx
import numpy as np
from numpy.typing import DTypeLike

from accelerated.device import gpu_paths
from accelerated.memory.kv_cache import KVCache
from accelerated.ops import add, mul, mul_mat, rms_norm, swiglu
from accelerated.ops import softcap as softcap_op
from accelerated.ops.attention import build_attn_mha_heads, stream_blocks, stream_mask
from accelerated.ops.convert import as_mx, mx_dtype
from accelerated.ops.moe import build_moe_ffn
from accelerated.ops.rope import fast_rope_fits, rope_cache, rope_fused, rotate_pairs
from accelerated.quants import (
    MLXQuantized,
    dequantize_mlx,
    load_weight,
    quantized_matmul,
    take_rows,
)
from reference.batch import Batch, BatchAllocr
from reference.hparams import QWEN3_ARCHS, LlamaHParams
from reference.models.llama import (  # host-side pieces, imported as they are
    EXPERT_TENSORS,
    LLAMA_LAYER_TENSORS,
    MOE_LAYER_TENSORS,
    QWEN3_LAYER_TENSORS,
    SUPPORTED_ARCHS,
    AttnInput,
    LlamaForwardError,
    check_forward_inputs,
    check_ubatch_inputs,
    get_expert_weight,
    layer_tensors,
    model_dtype,
    rope_cparams,
)
from reference.ops.rope import RopeParams

__all__ = [
    "EXPERT_TENSORS",
    "LINEAR_TENSORS",
    "LLAMA_LAYER_TENSORS",
    "MOE_LAYER_TENSORS",
    "QWEN3_LAYER_TENSORS",
    "SUPPORTED_ARCHS",
    "AttnInput",
    "LlamaForwardError",
    "TransposedWeight",
    "attn_grouped",
    "build_attn",
    "build_ffn",
    "build_inp_embd",
    "build_norm",
    "build_qkv",
    "check_ubatch_inputs",
    "get_expert_weight",
    "get_weight",
    "greedy",
    "layer_weights",
    "linear",
    "llama_forward",
    "llm_build_llama",
    "model_dtype",
    "default_matmul",
    "prepare_weights",
    "rope_cparams",
    "graph_rope",
    "rope_in_graph",
    "attn_grouped_heads",
]


# --8<-- [start:TransposedWeight]
@dataclass(frozen=True, eq=False)
class TransposedWeight:
    """A matmul weight ``W`` ``(n_out, n_in)`` stored as its transpose ``wt`` ``(n_in, n_out)``.

    ``ggml_mul_mat(W, x) = x @ W^T = x @ wt``: with ``wt`` contiguous the CPU BLAS streams
    the weights along its inner loop (see the module docstring).
    """

    wt: mx.array

    @property
    def shape(self) -> tuple[int, int]:
        """The logical shape of ``W``: ``(n_out, n_in)``."""
        return (self.wt.shape[1], self.wt.shape[0])
# --8<-- [end:TransposedWeight]


Weight = mx.array | MLXQuantized | TransposedWeight

# The GGUF tensors used as matmul weights (``blk.{il}.<name>.weight`` and ``output.weight``):
# the ones ``matmul="dense"`` stores transposed.
LINEAR_TENSORS = frozenset({
    "attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down", "output",
    "ssm_in", "ssm_x", "ssm_dt", "ssm_out",
})


# --8<-- [start:default_matmul]
def default_matmul() -> str:
    """``"quantized"`` on a GPU (Metal, CUDA), ``"dense"`` on the CPU device
    ([`gpu_paths`][accelerated.device.gpu_paths]).

    On Linux MLX's CPU backend multiplies with a reference BLAS, where float32 ``x @ W^T``
    with ``W^T`` stored contiguous beats ``mx.quantized_matmul`` at every size measured
    (``docs/mlx.md``); on Metal the quantized kernels read 4-8x less memory.

    Examples:
        >>> default_matmul() in ("dense", "quantized")
        True
    """
    return "quantized" if gpu_paths() else "dense"
# --8<-- [end:default_matmul]


# --8<-- [start:prepare_weights]
def prepare_weights(weights: dict, matmul: str = "quantized", bounded: bool = False) -> dict:
    """The weights as the MLX forward uses them, converted once.

    Args:
        weights: GGUF-named weights: NumPy arrays,
            [`reference.quants.QuantizedTensor`][reference.quants.QuantizedTensor] or already
            prepared values (kept as they are).
        matmul: how the matmul weights (`LINEAR_TENSORS`) are held: ``"quantized"``
            (the exact types of [`accelerated.quants.load_weight`][accelerated.quants.load_weight]
            as [`MLXQuantized`][], other types dense float32) or
            ``"dense"`` (every one dequantized to float32 and stored as a
            [`TransposedWeight`][]; [`accelerated.context.Context`][accelerated.context.Context]
            picks [`default_matmul`][]). With ``"dense"`` and tied embeddings (no
            ``output.weight``), ``output.weight`` is added: the transposed dense ``token_embd``
            (which stays as it is for the row gather).
        bounded: with ``"quantized"``, keep Q6_K and Q2_K packed too, requantized within the
            bound [`accelerated.quants.load_weight`][accelerated.quants.load_weight] states
            (their values change); otherwise they are dequantized, exactly.

    Returns:
        The same keys (plus a tied ``output.weight`` for ``"dense"``); values
        [`MLXQuantized`][], [`TransposedWeight`][] or float32 ``mx.array``.

    Raises:
        ValueError: an unknown ``matmul``.

    Examples:
        >>> w = prepare_weights({"a.weight": np.ones((2, 3), np.float64)})
        >>> w["a.weight"].dtype, w["a.weight"].shape
        (mlx.core.float32, (2, 3))
        >>> prepare_weights({"blk.0.attn_q.weight": np.ones((2, 3))}, "dense")[
        ...     "blk.0.attn_q.weight"].wt.shape
        (3, 2)
    """
    if matmul not in ("dense", "quantized"):
        raise ValueError(f"matmul must be 'dense' or 'quantized', got {matmul!r}")
    out = {}
    for name, w in weights.items():
        if isinstance(w, (mx.array, MLXQuantized, TransposedWeight)):
            out[name] = w
        elif isinstance(w, np.ndarray) and not np.issubdtype(w.dtype, np.floating):
            out[name] = mx.array(w)
        else:
            out[name] = load_weight(w, mx.float32, bounded=bounded and matmul == "quantized")
        if matmul == "dense" and _is_linear(name) and not isinstance(out[name], TransposedWeight):
            out[name] = _transposed(out[name])
    if matmul == "dense" and "output.weight" not in out and "token_embd.weight" in out:
        out["output.weight"] = _transposed(out["token_embd.weight"])  # the tied lm_head
    return out
# --8<-- [end:prepare_weights]


def _is_linear(name: str) -> bool:
    parts = name.split(".")
    return len(parts) >= 2 and parts[-1] == "weight" and parts[-2] in LINEAR_TENSORS


def _transposed(w: mx.array | MLXQuantized) -> TransposedWeight:
    """``w`` dense float32, stored transposed and contiguous (evaluated now, once)."""
    wt = mx.contiguous(weight_values(w).T)  # (n_in, n_out)
    mx.eval(wt)
    return TransposedWeight(wt)


# --8<-- [start:get_weight]
def get_weight(
    weights: dict, name: str, dtype: DTypeLike, required: bool = True
) -> Weight | None:
    """Twin of [`reference.models.llama.get_weight`][reference.models.llama.get_weight]. Not
    dequantized.

    A prepared [`MLXQuantized`][] or [`TransposedWeight`][] is returned as it is (it
    is used by [`linear`][] as it is); a dense one as an ``mx.array`` of ``dtype`` (float64
    gives float32, MLX's dtype).

    Raises:
        LlamaForwardError: if a required weight is missing.

    Examples:
        >>> get_weight({}, "a.bias", np.float32, required=False) is None
        True
        >>> get_weight({"a": np.ones(2)}, "a", np.float64).dtype
        mlx.core.float32
    """
    w = weights.get(name)
    if w is None:
        if required:
            raise LlamaForwardError(f"missing weight {name!r}")
        return None
    if isinstance(w, (MLXQuantized, TransposedWeight)):
        return w
    return as_mx(w).astype(mx_dtype(dtype))
# --8<-- [end:get_weight]


# --8<-- [start:linear]
def linear(w: Weight, cur: mx.array) -> mx.array:
    """``ggml_mul_mat(w, cur)``: ``cur @ w.T``, quantized or pre-transposed when ``w`` is.

    Examples:
        >>> linear(mx.array([[1.0, 0.0], [0.0, 2.0]]), mx.array([[3.0, 4.0]])).tolist()
        [[3.0, 8.0]]
        >>> linear(TransposedWeight(mx.array([[1.0, 0.0], [0.0, 2.0]])), mx.array([[3.0, 4.0]]))
        array([[3, 8]], dtype=float32)
    """
    if isinstance(w, MLXQuantized):
        return quantized_matmul(cur, w)  # (n_tokens, n_out)
    if isinstance(w, TransposedWeight):
        return cur @ w.wt  # (n_tokens, n_out)
    return mul_mat(w, cur)  # (n_tokens, n_out)
# --8<-- [end:linear]


# --8<-- [start:layer_weights]
def layer_weights(
    weights: dict, il: int, dtype: DTypeLike, hparams: LlamaHParams | None = None
) -> dict:
    """Twin of [`reference.models.llama.layer_weights`][reference.models.llama.layer_weights].
    Prepared weights, same fields (the experts as prepared: ``mx.array`` or ``MLXQuantized``).

    Examples:
        >>> layer_weights({}, 0, np.float32)
        Traceback (most recent call last):
        ...
        reference.models.llama.LlamaForwardError: missing weight 'blk.0.attn_norm.weight'
    """
    return {
        field: get_weight(weights, f"blk.{il}.{name}", dtype, required)
        for field, (name, required) in layer_tensors(hparams).items()
    }
# --8<-- [end:layer_weights]


def _bias(cur: mx.array, b: Weight | None) -> mx.array:
    return cur if b is None else add(cur, b)


def weight_values(w: Weight) -> mx.array:
    """The float32 values of a prepared weight, in its logical shape.

    A [`MLXQuantized`][] weight dequantized, a [`TransposedWeight`][] transposed back, a plain
    array as it is: the form elementwise operands (norm gains, ``rope_freqs``) and gathers
    need. Shared with the Mamba graph.

    Examples:
        >>> w = mx.arange(6, dtype=mx.float32).reshape(2, 3)
        >>> weight_values(TransposedWeight(w.T)).tolist() == w.tolist()
        True
    """
    if isinstance(w, MLXQuantized):
        return dequantize_mlx(w)
    if isinstance(w, TransposedWeight):
        return w.wt.T
    return w


# --8<-- [start:build_norm]
def build_norm(cur: mx.array, mw: Weight, eps: float) -> mx.array:
    """Twin of [`reference.models.llama.build_norm`][reference.models.llama.build_norm].

    Examples:
        >>> [round(x, 4) for x in build_norm(mx.array([[3.0, 4.0]]), mx.array([1.0, 2.0]), 0.0)
        ...  .tolist()[0]]
        [0.8485, 2.2627]
    """
    return mul(rms_norm(cur, eps), weight_values(mw))
# --8<-- [end:build_norm]


# --8<-- [start:build_qkv]
def build_qkv(
    layer: dict, cur: mx.array, n_embd_head: int, n_head: int, n_head_kv: int
) -> tuple[mx.array, mx.array, mx.array]:
    """Twin of [`reference.models.llama.build_qkv`][reference.models.llama.build_qkv]. Quantized
    matmuls where quantized.

    Examples:
        >>> layer = {"wq": mx.ones((4, 2)), "wk": mx.ones((2, 2)), "wv": mx.ones((2, 2)),
        ...          "bq": None, "bk": None, "bv": mx.array([0.0, 1.0])}
        >>> q, k, v = build_qkv(layer, mx.array([[1.0, 2.0]]), 2, 2, 1)
        >>> q.shape, k.shape, v.tolist()
        ((1, 2, 2), (1, 1, 2), [[[3.0, 4.0]]])
    """
    n_tokens = cur.shape[0]
    q = _bias(linear(layer["wq"], cur), layer["bq"])  # (n_tokens, n_head * d)
    k = _bias(linear(layer["wk"], cur), layer["bk"])  # (n_tokens, n_head_kv * d)
    v = _bias(linear(layer["wv"], cur), layer["bv"])  # (n_tokens, n_head_kv * d)
    q = q.reshape(n_tokens, n_head, n_embd_head)  # (n_tokens, n_head, d)
    k = k.reshape(n_tokens, n_head_kv, n_embd_head)  # (n_tokens, n_head_kv, d)
    v = v.reshape(n_tokens, n_head_kv, n_embd_head)  # (n_tokens, n_head_kv, d)
    return q, k, v
# --8<-- [end:build_qkv]


# --8<-- [start:attn_grouped]
def attn_grouped(
    q: mx.array, k: mx.array, v: mx.array, kq_mask: mx.array, kq_scale: float,
    softcap: float = 0.0,
    n_stream: int = 1,
) -> mx.array:
    r"""[`accelerated.ops.build_attn_mha`][accelerated.ops.attention.build_attn_mha] for the CPU:
    the query heads of a KV group as rows.

    MLX's CPU backend has no fused attention kernel: ``mx.fast.scaled_dot_product_attention``
    falls back to ``matmul``, ``softmax(precise=True)``, ``matmul``, batched over the
    ``n_head / n_head_kv`` query heads that share a KV head. Here those query heads are
    stacked as extra rows of one product per KV head, $(r \cdot n_{tokens}) \times d$ by
    $d \times n_{kv}$: the same dot products in the same order (bit for bit the fallback's
    result, ``tests/twin/test_reuse.py``), in ``n_head_kv`` BLAS calls instead of
    ``n_head``, which for one token costs half the time. Rows with no visible key are zeros.

    With a soft-cap $c > 0$ (Gemma 2) the scores are capped before the scale and the mask,
    as in the reference: $s = c \tanh(q k^T / c)$, then $\mathrm{softmax}(\sigma s + M)$
    (``q`` is not scaled first then).

    Args:
        q: ``(n_tokens, n_head, d_k)``.
        k: ``(n_kv, n_head_kv, d_k)``.
        v: ``(n_kv, n_head_kv, d_v)``.
        kq_mask: ``(n_tokens, n_kv)`` additive mask.
        kq_scale: the $1/\sqrt{d_k}$ factor.
        softcap: the attention soft-cap $c$; 0 for none.
        n_stream: KV streams: one attention per stream, as
            [`reference.ops.attention.build_attn_mha`][reference.ops.attention.build_attn_mha].

    Returns:
        ``(n_tokens, n_head * d_v)``.

    Examples:
        >>> from accelerated.ops import build_attn_mha
        >>> r = [mx.random.normal(s, key=mx.random.key(i))
        ...      for i, s in enumerate([(3, 4, 8), (5, 2, 8), (5, 2, 8)])]
        >>> mask = mx.zeros((3, 5))
        >>> mx.array_equal(attn_grouped(*r, mask, 0.3), build_attn_mha(*r, mask, 0.3)).item()
        True
    """
    ns = n_stream
    # the cells cut per stream, heads first: (ns, n_head_kv, n_kv/ns, d)
    k_heads = stream_blocks(k, ns).transpose(0, 2, 1, 3)  # (ns, hkv, n_k, d_k)
    v_heads = stream_blocks(v, ns).transpose(0, 2, 1, 3)  # (ns, hkv, n_k, d_v)
    return attn_grouped_heads(q, k_heads, v_heads, kq_mask, kq_scale, softcap, ns)
# --8<-- [end:attn_grouped]


# --8<-- [start:attn_grouped_heads]
def attn_grouped_heads(
    q: mx.array, k_heads: mx.array, v_heads: mx.array, kq_mask: mx.array, kq_scale: float,
    softcap: float = 0.0,
    n_stream: int = 1,
) -> mx.array:
    r"""[`attn_grouped`][] with K and V heads first, as the cache holds them.

    ``k_heads`` and ``v_heads`` are ``(n_stream, n_head_kv, n_kv / n_stream, d)``: the cells in
    view are then a slice of the cache
    ([`accelerated.memory.kv_cache.head_major_blocks`][accelerated.memory.kv_cache.head_major_blocks])
    and no view turns them to the reference's layout and back. The same products, so the
    same values as ``attn_grouped``.

    Examples:
        >>> r = [mx.random.normal(s, key=mx.random.key(i))
        ...      for i, s in enumerate([(3, 4, 8), (5, 2, 8), (5, 2, 8)])]
        >>> mask = mx.zeros((3, 5))
        >>> heads = [t.transpose(1, 0, 2)[None] for t in r[1:]]   # (1, 2, 5, 8) each
        >>> mx.array_equal(attn_grouped_heads(r[0], *heads, mask, 0.3),
        ...                attn_grouped(*r, mask, 0.3)).item()
        True
    """
    n_tokens, n_head, d_k = q.shape
    ns, n_head_kv, n_k, d_v = v_heads.shape
    rep = n_head // n_head_kv
    n_t = n_tokens // ns  # tokens of one stream
    mask = stream_mask(kq_mask[:n_tokens].astype(q.dtype), ns)[:, None]  # (ns,1,1,n_t,n_k)
    visible = mx.max(mask, axis=-1, keepdims=True) > -mx.inf  # (ns, 1, 1, n_t, 1)
    if softcap <= 0.0:
        q = q * mx.array(kq_scale, q.dtype)  # the fallback scales q first
    # (ns, hkv, rep * n_t, d): with one token per stream the transpose moves a size-1 axis,
    # so the rows are already in that order and a reshape is the whole move (no copy)
    if n_t == 1:
        q = q.reshape(ns, n_head_kv, rep, d_k)
    else:
        q = q.reshape(ns, n_t, n_head_kv, rep, d_k).transpose(0, 2, 3, 1, 4)  # (ns,hkv,rep,n_t,d)
        q = q.reshape(ns, n_head_kv, rep * n_t, d_k)
    kq = q @ k_heads.swapaxes(-1, -2)  # (ns, hkv, rep * n_t, n_k)
    if softcap > 0.0:  # the capped raw scores, then the scale (soft_max_ext's order)
        kq = softcap_op(kq, softcap) * mx.array(kq_scale, q.dtype)  # (ns, hkv, r*n_t, n_k)
    kq = kq.reshape(ns, n_head_kv, rep, n_t, n_k) + mask  # (ns, hkv, rep, n_t, n_k)
    kq = mx.softmax(kq, axis=-1, precise=True).reshape(ns, n_head_kv, rep * n_t, n_k)
    kqv = kq @ v_heads  # (ns, hkv, rep * n_t, d_v)
    kqv = kqv.reshape(ns, n_head_kv, rep, n_t, d_v)
    kqv = mx.where(visible, kqv, mx.array(0, kqv.dtype))  # fully masked rows: zeros
    if n_t == 1:  # the transpose would move a size-1 axis again
        return kqv.reshape(n_tokens, n_head * d_v)  # (n_tokens, n_head * d_v)
    return kqv.transpose(0, 3, 1, 2, 4).reshape(n_tokens, n_head * d_v)  # (n_tokens, n_head*d_v)
# --8<-- [end:attn_grouped_heads]


# --8<-- [start:build_attn]
def build_attn(
    inp: AttnInput,
    wo: Weight,
    wo_b: Weight | None,
    q_cur: mx.array,
    k_cur: mx.array,
    v_cur: mx.array,
    kq_scale: float,
    il: int,
) -> mx.array:
    """Twin of [`reference.models.llama.build_attn`][reference.models.llama.build_attn]. ``inp``
    holds MLX tensors.

    The attention is MLX's fused kernel
    ([`accelerated.ops.build_attn_mha`][accelerated.ops.attention.build_attn_mha]) on a GPU and
    [`attn_grouped`][] on the CPU device, where the fused kernel is a fallback
    ([`gpu_paths`][accelerated.device.gpu_paths] chooses).

    Returns:
        ``(n_tokens, n_embd)``.
    """
    inp.cpy_k(il, k_cur)
    inp.cpy_v(il, v_cur)
    # the reference's get_k / get_v, as the cache holds them: (ns, n_head_kv, n_kv, d)
    k = inp.get_k_heads(il)  # (ns, n_head_kv, n_kv, d_k)
    v = inp.get_v_heads(il)  # (ns, n_head_kv, n_kv, d_v)
    kq_mask = inp.get_kq_mask(il)  # (n_tokens, ns * n_kv)
    if gpu_paths():
        cur = build_attn_mha_heads(q_cur, k, v, kq_mask, kq_scale, n_stream=inp.n_stream)
    else:
        cur = attn_grouped_heads(q_cur, k, v, kq_mask, kq_scale, n_stream=inp.n_stream)
    kqv_out(inp, il, cur)
    return _bias(linear(wo, cur), wo_b)  # (n_tokens, n_embd)
# --8<-- [end:build_attn]


# --8<-- [start:kqv_out]
def kqv_out(inp: AttnInput, il: int, kqv: mx.array) -> None:
    """Show layer ``il``'s attention output (llama.cpp's ``kqv_out``) to an input that asks.

    Shared with the Gemma graphs.

    Only the Context's graph input asks (it has a ``kqv_out`` method). Every cache write
    of the forward is an input of the last layer's, so the Context launches the writes by
    launching it, without handing MLX the caches themselves (``Context._launch``, in
    [`accelerated.context`][accelerated.context]).
    """
    see = getattr(inp, "kqv_out", None)
    if see is not None:
        see(il, kqv)
# --8<-- [end:kqv_out]


# --8<-- [start:build_ffn]
def build_ffn(cur: mx.array, layer: dict) -> mx.array:
    """Twin of [`reference.models.llama.build_ffn`][reference.models.llama.build_ffn]. SwiGLU.

    Examples:
        >>> layer = {"ffn_up": mx.eye(2), "ffn_gate": mx.eye(2), "ffn_down": mx.eye(2),
        ...          "ffn_up_b": None, "ffn_gate_b": None, "ffn_down_b": None}
        >>> [round(x, 4) for x in build_ffn(mx.array([[0.0, 1.0]]), layer).tolist()[0]]
        [0.0, 0.7311]
    """
    up = _bias(linear(layer["ffn_up"], cur), layer["ffn_up_b"])  # (n_tokens, n_ff)
    gate = _bias(linear(layer["ffn_gate"], cur), layer["ffn_gate_b"])  # (n_tokens, n_ff)
    cur = swiglu(gate, up)  # (n_tokens, n_ff)
    return _bias(linear(layer["ffn_down"], cur), layer["ffn_down_b"])  # (n_tokens, n_embd)
# --8<-- [end:build_ffn]


# --8<-- [start:build_inp_embd]
def build_inp_embd(
    weights: dict, tokens: np.ndarray | None, embd: np.ndarray | None, dtype: DTypeLike
) -> mx.array:
    """Twin of [`reference.models.llama.build_inp_embd`][reference.models.llama.build_inp_embd].

    A quantized ``token_embd`` is not dequantized whole: the packed rows of ``tokens`` are
    gathered, then dequantized (the same values, row by row). ``tokens`` may be an
    ``mx.array`` (a placeholder of a traced graph): the ids are checked on the host before
    ([`reference.models.llama.check_forward_inputs`][reference.models.llama.check_forward_inputs]),
    so the gather is a plain ``mx.take``.

    Examples:
        >>> w = {"token_embd.weight": mx.eye(3)}
        >>> build_inp_embd(w, np.array([2, 0]), None, np.float32).tolist()
        [[0.0, 0.0, 1.0], [1.0, 0.0, 0.0]]
    """
    if embd is not None:
        return as_mx(embd).astype(mx_dtype(dtype))  # (n_tokens, n_embd)
    tok_embd = get_weight(weights, "token_embd.weight", dtype)
    idx = index_array(tokens)  # (n_tokens,)
    if isinstance(tok_embd, MLXQuantized):
        return take_rows(tok_embd, idx)  # (n_tokens, n_embd)
    return mx.take(weight_values(tok_embd), idx, axis=0)  # (n_tokens, n_embd)
# --8<-- [end:build_inp_embd]


def index_array(ids) -> mx.array:
    """Host ids (NumPy, list) or a graph placeholder, as an int32 ``mx.array``.

    Positions, token ids and output rows enter a (possibly traced) graph through it; shared
    with the Gemma graphs.

    Examples:
        >>> index_array([3, 1]).dtype, index_array(mx.array([2], dtype=mx.int64)).dtype
        (mlx.core.int32, mlx.core.int32)
    """
    if isinstance(ids, mx.array):
        return ids.astype(mx.int32)
    return mx.array(np.asarray(ids, dtype=np.int32))


# --8<-- [start:rope_in_graph]
def rope_in_graph(
    x: mx.array, pos: mx.array, params: RopeParams, freq_factors: mx.array | None = None
) -> mx.array:
    r"""[`accelerated.ops.rope_ext`][accelerated.ops.rope.rope_ext] without its host-side checks,
    for a traced graph.

    The same computation (``mx.fast.rope`` with one offset per token, or the YaRN cos/sin
    cache); ``pos`` may be a placeholder, which ``rope_ext`` would have to read on the host
    to validate. ``x`` is ``(n_tokens, n_head, head_dim)``, float32; the caller has checked
    the arguments (``rope_ext`` does, on the same hyperparameters, in the K-shift).

    Examples:
        >>> from accelerated.ops import rope_ext
        >>> x = mx.random.normal((3, 2, 8), key=mx.random.key(0))
        >>> pos, p = np.array([0, 5, 9]), RopeParams(8)
        >>> mx.array_equal(rope_in_graph(x, mx.array(pos), p), rope_ext(x, pos, p)).item()
        True
    """
    pos = index_array(pos)  # (n_tokens,)
    if params.n_dims == 0:
        return x
    n_tokens, n_head, head_dim = x.shape
    if params.ext_factor == 0.0:
        y = rope_fused(x.reshape(n_tokens, n_head, 1, head_dim), pos, params,
                       freq_factors)  # (n_tokens, n_head, 1, head_dim)
        return y.reshape(n_tokens, n_head, head_dim)
    cos_theta, sin_theta = rope_cache(pos, params, freq_factors)  # (n_tokens, n_dims/2) each
    return rotate_pairs(x, cos_theta, sin_theta, params.n_dims, params.mode)
# --8<-- [end:rope_in_graph]


# --8<-- [start:graph_rope]
def graph_rope(
    pos: mx.array, params: RopeParams, freq_factors: mx.array | None = None
) -> Callable[[mx.array], mx.array]:
    r"""Twin of [`reference.models.llama.graph_rope`][reference.models.llama.graph_rope].
    The RoPE of one graph's tokens, as the function that turns each ``q`` and ``k``.

    Every ``q`` and ``k`` of every layer turns by the same angles: they depend on the
    positions and the hyperparameters only. On a GPU without YaRN each tensor is one
    ``mx.fast.rope`` kernel, which computes its angles inside: [`rope_in_graph`][] per call
    (where the kernel launches for any token count:
    [`accelerated.ops.rope.fast_rope_fits`][accelerated.ops.rope.fast_rope_fits]).
    Elsewhere the cos/sin cache
    ([`accelerated.ops.rope.rope_cache_init`][accelerated.ops.rope.rope_cache_init]) is built
    once per graph and each tensor only rotates its pairs
    ([`accelerated.ops.rope.rotate_pairs`][accelerated.ops.rope.rotate_pairs]): the values of
    [`rope_in_graph`][] (the CPU device and YaRN build that same cache), in one cache where
    each call built its own. A graph node costs the host a microsecond or two whatever its
    size, and on a small model those nodes are much of what a token costs
    (``docs/performance.md``, "Fewer nodes per token"). The arguments after ``pos`` are
    [`rope_in_graph`][]'s.

    Args:
        pos: ``(n_tokens,)`` positions (a placeholder of a traced graph).

    Examples:
        >>> x = mx.random.normal((3, 4, 8), key=mx.random.key(0))  # (n_tokens, n_head, d)
        >>> pos, p = mx.array([0, 5, 9]), RopeParams(8)
        >>> mx.array_equal(graph_rope(pos, p)(x), rope_in_graph(x, pos, p)).item()
        True
    """
    n_dims = params.n_dims
    if n_dims == 0 or (params.ext_factor == 0.0 and gpu_paths() and fast_rope_fits(n_dims)):
        return partial(rope_in_graph, pos=pos, params=params, freq_factors=freq_factors)
    cos_theta, sin_theta = rope_cache(index_array(pos), params, freq_factors)  # (n_tokens, n/2)
    return partial(rotate_pairs, cos_theta=cos_theta, sin_theta=sin_theta, n_dims=n_dims,
                   mode=params.mode)
# --8<-- [end:graph_rope]


# --8<-- [start:build_moe]
def build_moe(cur: mx.array, layer: dict, hparams: LlamaHParams) -> mx.array:
    """Twin of [`reference.models.llama.build_moe`][reference.models.llama.build_moe].

    The experts run through ``mx.gather_mm`` / ``mx.gather_qmm``
    ([`accelerated.ops.moe.build_moe_ffn`][accelerated.ops.moe.build_moe_ffn])."""
    return build_moe_ffn(cur, weight_values(layer["ffn_gate_inp"]), layer["ffn_up_exps"],
                         layer["ffn_gate_exps"], layer["ffn_down_exps"],
                         hparams.n_expert_used, norm_w=hparams.expert_weights_norm)
# --8<-- [end:build_moe]


# --8<-- [start:llm_build_llama]
def llm_build_llama(
    weights: dict,
    hparams: LlamaHParams,
    tokens: np.ndarray | None,
    pos: np.ndarray,
    inp_attn: AttnInput,
    out_ids: np.ndarray | None,
    embd: np.ndarray | None = None,
) -> mx.array:
    """Twin of [`reference.models.llama.llm_build_llama`][reference.models.llama.llm_build_llama].
    On prepared weights.

    A pure function of MLX arrays: ``tokens``/``embd``, ``pos`` and ``out_ids`` may be host
    arrays or graph placeholders, and ``inp_attn`` may hold placeholders for the cache
    tensors
    ([`accelerated.memory.kv_cache.GraphAttnInput`][accelerated.memory.kv_cache.GraphAttnInput]);
    nothing is read on the host, so [`accelerated.context.Context`][accelerated.context.Context] can
    trace it with ``mx.compile``. The inputs must have been checked
    ([`reference.models.llama.check_forward_inputs`][reference.models.llama.check_forward_inputs]).
    ``out_ids`` None means every row, in order: the output rows' ``get_rows`` is the identity
    then and is left out of the graph (the Context passes None when every token of a ubatch
    has logits, as in generation).

    Returns:
        logits ``(n_outputs, n_vocab)`` float32, lazy.
    """
    dtype = model_dtype(weights)
    n_embd_head = hparams.n_embd_head_k
    kq_scale = hparams.f_attention_scale or 1.0 / math.sqrt(n_embd_head)
    rope = rope_cparams(hparams)
    rope_factors = get_weight(weights, "rope_freqs.weight", dtype, required=False)
    if rope_factors is not None:
        rope_factors = weight_values(rope_factors)
    eps = hparams.f_norm_rms_eps
    pos = index_array(pos)  # (n_tokens,)
    out_ids = None if out_ids is None else index_array(out_ids)  # (n_outputs,)
    inpL = build_inp_embd(weights, tokens, embd, dtype)  # (n_tokens, n_embd)
    turn = graph_rope(pos, rope, rope_factors)  # RoPE for every q and k
    for il in range(hparams.n_layer):
        layer = layer_weights(weights, il, dtype, hparams)
        inpSA = inpL
        cur = build_norm(inpL, layer["attn_norm"], eps)
        q, k, v = build_qkv(layer, cur, n_embd_head, hparams.n_head, hparams.n_head_kv)
        if hparams.arch in QWEN3_ARCHS:  # per head, before RoPE
            q = build_norm(q, layer["attn_q_norm"], eps)  # (n_tokens, n_head, d)
            k = build_norm(k, layer["attn_k_norm"], eps)  # (n_tokens, n_head_kv, d)
        q = turn(q)  # (n_tokens, n_head, d)
        k = turn(k)  # (n_tokens, n_head_kv, d)
        cur = build_attn(inp_attn, layer["wo"], layer["bo"], q, k, v, kq_scale, il)
        if il == hparams.n_layer - 1 and out_ids is not None:
            # only the output rows go on: llama.cpp's inp_out_ids (get_rows)
            cur = mx.take(cur, out_ids, axis=0)  # (n_outputs, n_embd)
            inpSA = mx.take(inpSA, out_ids, axis=0)  # (n_outputs, n_embd)
        ffn_inp = add(cur, inpSA)
        cur = build_norm(ffn_inp, layer["ffn_norm"], eps)
        cur = build_moe(cur, layer, hparams) if hparams.n_expert else build_ffn(cur, layer)
        inpL = add(cur, ffn_inp)
    cur = build_norm(inpL, get_weight(weights, "output_norm.weight", dtype), eps)
    output = get_weight(weights, "output.weight", dtype, required=False)
    if output is None:  # tied embeddings: the lm_head is token_embd
        output = get_weight(weights, "token_embd.weight", dtype)
    logits = linear(output, cur)  # (n_outputs, n_vocab)
    return _bias(logits, get_weight(weights, "output.bias", dtype, required=False))
# --8<-- [end:llm_build_llama]


# --8<-- [start:llama_forward]
def llama_forward(
    weights: dict,
    hparams: LlamaHParams,
    tokens: np.ndarray | None,
    pos: np.ndarray,
    inp_attn: AttnInput,
    out_ids: np.ndarray | None = None,
    embd: np.ndarray | None = None,
) -> mx.array:
    """Twin of [`reference.models.llama.llama_forward`][reference.models.llama.llama_forward]. The
    same checks, then MLX.

    ``weights`` may be raw (NumPy / quantized tensors: [`prepare_weights`][] runs on every
    call then) or prepared once by [`prepare_weights`][] (what a caller should do).

    Returns:
        logits ``(n_outputs, n_vocab)``, a lazy float32 ``mx.array``.

    Raises:
        LlamaForwardError: as the reference (arch, tokens/embd, ranges, shapes).

    Examples:
        >>> from reference.testing import tiny_hparams, random_weights
        >>> from accelerated.memory import KVCache
        >>> hp = tiny_hparams(n_layer=1)
        >>> w = prepare_weights(random_weights(hp, seed=0))
        >>> llama_forward(w, hp, np.array([99]), np.array([3]), None)
        Traceback (most recent call last):
        ...
        reference.models.llama.LlamaForwardError: token id 99 out of range [0, 32)
    """
    tokens, pos, out_ids, embd = check_forward_inputs(hparams, tokens, pos, out_ids, embd)
    weights = prepare_weights(weights)
    return llm_build_llama(weights, hparams, tokens, pos, inp_attn, out_ids, embd)
# --8<-- [end:llama_forward]


# --8<-- [start:greedy]
def greedy(
    weights: dict,
    hparams: LlamaHParams,
    prompt: list[int],
    n_predict: int,
    stop: tuple[int, ...] = (),
    n_ctx: int | None = None,
) -> list[int]:
    """Twin of [`reference.models.llama.greedy`][reference.models.llama.greedy]. The MLX forward and
    KV cache.

    The single-sequence cache is [`accelerated.memory.KVCache`][accelerated.memory.kv_cache.KVCache]
    with one stream; the argmax is taken on the host after each step.

    Examples:
        >>> from reference.testing import tiny_hparams, random_weights
        >>> from reference.models.llama import greedy as ref_greedy
        >>> hp = tiny_hparams(n_layer=1)
        >>> w = random_weights(hp, seed=0)
        >>> greedy(w, hp, [1], n_predict=5) == ref_greedy(w, hp, [1], n_predict=5)
        True
    """
    weights = prepare_weights(weights)
    cache = KVCache(hparams, kv_size=n_ctx or len(prompt) + n_predict)
    tokens = [int(t) for t in prompt]
    out: list[int] = []
    while len(out) < n_predict:
        balloc = BatchAllocr(Batch(token=tokens), n_vocab=hparams.n_vocab, n_seq_max=1,
                             memory=cache)
        mctx = cache.init_batch(balloc, n_ubatch=len(tokens))  # one ubatch, its slot
        mctx.apply()
        ubatch = mctx.get_ubatch()
        logits = llama_forward(weights, hparams, ubatch.token, ubatch.pos, mctx.graph_input(),
                               [len(tokens) - 1])
        token = int(mx.argmax(logits[-1]).item())
        if token in stop:
            break
        out.append(token)
        tokens = [token]
    return out
# --8<-- [end:greedy]
