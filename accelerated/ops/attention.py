r"""Twin of [`reference.ops.attention`][reference.ops.attention]: ``ggml_soft_max_ext`` (and its
backward) and ``build_attn_mha`` on MLX.

``soft_max_ext`` is written with MLX ops (``mx.softmax(..., precise=True)``, which
accumulates in float32 where ggml and the reference sum in double). ``build_attn_mha`` uses
MLX's fused kernel ``mx.fast.scaled_dot_product_attention``: it computes
$\mathrm{softmax}(\mathrm{scale}\,QK^T + \mathrm{mask})\,V$ with the same grouped-query mapping
as ``mul_mat``'s block broadcast (query head $h$ reads KV head
$\lfloor h / (n_\text{head}/n_\text{head\_kv}) \rfloor$) and an additive float mask; ALiBi is
folded into that mask per head (slope times mask). The fused kernel returns NaN for a row
whose keys are all hidden; the twin replaces such rows with zeros, as the reference does.
The ALiBi slopes are the reference's
([`reference.ops.attention.alibi_slopes`][reference.ops.attention.alibi_slopes], a tiny host-side
array).
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from accelerated.ops.convert import as_mx
from accelerated.ops.softcap import softcap as softcap_op
from reference.ops.attention import FEW_CELLS as FEW_CELLS  # the reference's rule
from reference.ops.attention import alibi_slopes as _alibi_slopes_ref
from reference.ops.attention import (
    check_attn_args,
    check_soft_max_args,
    check_soft_max_back_args,
    check_visible_args,
    tile_reps,
    visible_block,
)
from reference.ops.attention import sees_few_cells as sees_few_cells  # host-side, as it is
from reference.ops.attention import visible_cells as visible_cells  # host-side, as it is


# --8<-- [start:alibi_slopes]
def alibi_slopes(n_head: int, max_bias: float) -> mx.array:
    r"""Twin of [`reference.ops.attention.alibi_slopes`][reference.ops.attention.alibi_slopes].

    Computed by the reference on the host (``n_head`` float32 values) and moved to MLX.

    Examples:
        >>> alibi_slopes(4, 8.0).tolist()
        [0.25, 0.0625, 0.015625, 0.00390625]
    """
    return mx.array(_alibi_slopes_ref(n_head, max_bias))  # (n_head,)


# --8<-- [end:alibi_slopes]


# --8<-- [start:soft_max_ext]
def soft_max_ext(
    x: mx.array,
    mask: mx.array | None = None,
    scale: float = 1.0,
    max_bias: float = 0.0,
) -> mx.array:
    r"""Twin of [`reference.ops.attention.soft_max_ext`][reference.ops.attention.soft_max_ext].

    Lazy MLX ops; the row sum is float32 (``mx.softmax(precise=True)``) instead of double. A
    fully masked row is zeros, as in the reference.

    Examples:
        >>> import numpy as np
        >>> causal = np.array([[0.0, -np.inf, -np.inf], [0.0, 0.0, -np.inf]])
        >>> soft_max_ext(np.zeros((1, 2, 3)), causal).tolist()
        [[[1.0, 0.0, 0.0], [0.5, 0.5, 0.0]]]
    """
    x = as_mx(x)
    mask = None if mask is None else as_mx(mask)
    check_soft_max_args(x, mask, max_bias)
    w = x * scale  # (..., n_head, n_tokens, n_kv)
    if mask is not None:
        n_head = x.shape[-3] if x.ndim >= 3 else 1  # a 2-D x is head 0 of 1
        slope = alibi_slopes(n_head, max_bias).astype(x.dtype)  # (n_head,)
        slope = slope.reshape((n_head, 1, 1)[3 - min(x.ndim, 3):])  # (n_head, 1, 1)
        m = mx.tile(mask[..., : x.shape[-2], :], list(tile_reps(mask.shape, x.shape)))
        w = w + slope * m.astype(x.dtype)  # (..., n_head, n_tokens, n_kv)
    visible = mx.max(w, axis=-1, keepdims=True) > -mx.inf  # (..., n_tokens, 1)
    p = mx.softmax(w, axis=-1, precise=True)  # NaN in a fully masked row
    return mx.where(visible, p, mx.array(0, dtype=x.dtype))  # (..., n_head, n_tokens, n_kv)


# --8<-- [end:soft_max_ext]


# --8<-- [start:soft_max_ext_back]
def soft_max_ext_back(
    grad: mx.array, y: mx.array, scale: float = 1.0, max_bias: float = 0.0
) -> mx.array:
    r"""Twin of
    [`reference.ops.attention.soft_max_ext_back`][reference.ops.attention.soft_max_ext_back].

    Lazy MLX ops, the row's dot product summed in float32.

    Examples:
        >>> import numpy as np
        >>> soft_max_ext_back(np.array([1.0, 0.0]), np.array([0.5, 0.5]), scale=2.0).tolist()
        [0.5, -0.5]
    """
    grad, y = as_mx(grad), as_mx(y)
    check_soft_max_back_args(grad.shape, y.shape, max_bias)
    dot = mx.sum(y * grad, axis=-1, keepdims=True)  # (..., 1)
    return ((grad - dot) * y * scale).astype(y.dtype)  # (..., n_kv)


# --8<-- [end:soft_max_ext_back]


# --8<-- [start:stream_blocks]
def stream_blocks(x: mx.array, n_stream: int) -> mx.array:
    """Twin of [`reference.ops.attention.stream_blocks`][reference.ops.attention.stream_blocks].

    Examples:
        >>> stream_blocks(mx.arange(6).reshape(6, 1), 2)[:, :, 0].tolist()
        [[0, 1, 2], [3, 4, 5]]
    """
    return x.reshape((n_stream, x.shape[0] // n_stream) + tuple(x.shape[1:]))


def stream_mask(kq_mask: mx.array, n_stream: int) -> mx.array:
    """Twin of [`reference.ops.attention.stream_mask`][reference.ops.attention.stream_mask].

    The diagonal blocks, sliced one stream at a time (``n_stream`` is static in a graph).

    Examples:
        >>> stream_mask(mx.arange(16.0).reshape(4, 4), 2)[:, 0].tolist()
        [[[0.0, 1.0], [4.0, 5.0]], [[10.0, 11.0], [14.0, 15.0]]]
    """
    if n_stream == 1:
        return kq_mask[None, None]  # (1, 1, n_tokens, n_kv)
    n_t, n_k = kq_mask.shape[0] // n_stream, kq_mask.shape[1] // n_stream
    blocks = [kq_mask[s * n_t:(s + 1) * n_t, s * n_k:(s + 1) * n_k] for s in range(n_stream)]
    return mx.stack(blocks)[:, None]  # (n_stream, 1, n_tokens/ns, n_kv)
# --8<-- [end:stream_blocks]


# --8<-- [start:build_attn_mha]
def build_attn_mha(
    q: mx.array,
    k: mx.array,
    v: mx.array,
    kq_mask: mx.array,
    kq_scale: float,
    max_bias: float = 0.0,
    softcap: float = 0.0,
    n_stream: int = 1,
) -> mx.array:
    r"""Twin of [`reference.ops.attention.build_attn_mha`][reference.ops.attention.build_attn_mha].

    One fused ``mx.fast.scaled_dot_product_attention`` call instead of ``mul_mat``,
    ``soft_max_ext``, ``mul_mat``: GQA is native (no repeat of K/V), the softmax accumulates
    in float32, and ALiBi enters as a per-head additive mask. Rows with no visible key are
    zeros, as in the reference.

    With a soft-cap ($c > 0$, Gemma 2) the fused kernel cannot apply $c \tanh(QK^T / c)$
    between the product and the softmax: the reference's op sequence runs instead, on MLX
    ([`softcap`][accelerated.ops.softcap.softcap] then [`soft_max_ext`][]), with the query
    heads of a KV group as rows of one product (`_attn_softcapped`).

    Examples:
        >>> import numpy as np
        >>> rng = np.random.default_rng(0)
        >>> q = rng.standard_normal((2, 4, 8)).astype(np.float32)   # (n_tokens, n_head, d_k)
        >>> k = rng.standard_normal((2, 2, 8)).astype(np.float32)   # (n_kv, n_head_kv, d_k)
        >>> v = rng.standard_normal((2, 2, 3)).astype(np.float32)   # (n_kv, n_head_kv, d_v)
        >>> causal = np.array([[0.0, -np.inf], [0.0, 0.0]], dtype=np.float32)
        >>> out = build_attn_mha(q, k, v, causal, kq_scale=8 ** -0.5)
        >>> out.shape, bool(np.allclose(np.array(out[0]).reshape(4, 3), v[0, [0, 0, 1, 1]]))
        ((2, 12), True)
    """
    q, k, v, kq_mask = as_mx(q), as_mx(k), as_mx(v), as_mx(kq_mask)
    check_attn_args(q, k, v, kq_mask, n_stream)
    if softcap > 0.0:
        return _attn_softcapped(q, k, v, kq_mask, kq_scale, max_bias, softcap, n_stream)
    ns = n_stream
    if k.ndim == 3:  # one flat block of cells: cut it per stream (a view)
        k, v = stream_blocks(k, ns), stream_blocks(v, ns)  # (ns, n_kv/ns, n_head_kv, d)
    return build_attn_mha_heads(q, k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3), kq_mask,
                                kq_scale, max_bias, ns)


# --8<-- [end:build_attn_mha]


# --8<-- [start:build_attn_mha_heads]
def build_attn_mha_heads(
    q: mx.array,
    k_heads: mx.array,
    v_heads: mx.array,
    kq_mask: mx.array,
    kq_scale: float,
    max_bias: float = 0.0,
    n_stream: int = 1,
) -> mx.array:
    r"""[`build_attn_mha`][] (no soft-cap) with K and V heads first, as the cache holds them.

    The fused kernel takes K and V as ``(n_stream, n_head_kv, n_kv, d)``, and the twin's
    cache stores them that way; the cells in view are then a slice of the cache
    ([`accelerated.memory.kv_cache.head_major_blocks`][accelerated.memory.kv_cache.head_major_blocks]),
    where the reference's layout ``(n_kv, n_head_kv, d)`` costs views (graph nodes) one way
    and back. The same call, so the same values as ``build_attn_mha``. The shapes are the
    cache's own and are not checked here.

    Args:
        q: ``(n_tokens, n_head, d_k)``.
        k_heads: ``(n_stream, n_head_kv, n_kv / n_stream, d_k)``.
        v_heads: ``(n_stream, n_head_kv, n_kv / n_stream, d_v)``.
        kq_mask: ``(n_tokens_pad >= n_tokens, n_kv)``.
        kq_scale: the scale of $QK^T$.
        max_bias: ALiBi maximum bias; 0 for none.
        n_stream: the KV streams.

    Returns:
        ``(n_tokens, n_head * d_v)``.
    """
    n_tokens, n_head, _ = q.shape
    ns = n_stream
    mask = stream_mask(kq_mask[:n_tokens].astype(q.dtype), ns)  # (ns, 1, n_tokens/ns, n_kv/ns)
    visible = mx.max(mask, axis=-1, keepdims=True) > -mx.inf  # (ns, 1, n_tokens/ns, 1)
    if max_bias > 0.0:
        slope = alibi_slopes(n_head, max_bias).astype(q.dtype)  # (n_head,)
        mask = slope[:, None, None] * mask  # (ns, n_head, n_tokens/ns, n_kv/ns)
    out = mx.fast.scaled_dot_product_attention(
        stream_blocks(q, ns).transpose(0, 2, 1, 3),  # (ns, n_head, n_tokens/ns, d_k)
        k_heads,  # (ns, n_head_kv, n_kv/ns, d_k)
        v_heads,  # (ns, n_head_kv, n_kv/ns, d_v)
        scale=kq_scale,
        mask=mask,
    )  # (ns, n_head, n_tokens/ns, d_v)
    out = mx.where(visible, out, mx.array(0, dtype=out.dtype))  # fully masked rows: zeros
    return out.transpose(0, 2, 1, 3).reshape(n_tokens, -1)  # (n_tokens, n_head * d_v)


# --8<-- [end:build_attn_mha_heads]


# --8<-- [start:attend_visible]
def attend_visible(
    q: mx.array,
    k: mx.array,
    v: mx.array,
    kq_mask: mx.array,
    kq_scale: float,
    max_bias: float = 0.0,
    softcap: float = 0.0,
) -> mx.array:
    r"""Twin of [`reference.ops.attention.attend_visible`][reference.ops.attention.attend_visible].

    Each token's cells are found on the host
    ([`visible_cells`][reference.ops.attention.visible_cells] reads the mask back), then
    gathered and attended on the device. The twin's
    [`build_attn_mha`][] does not take this form: a compiled graph cannot have shapes that
    depend on the mask's values, and the fused kernel already runs every cell at device speed.
    It is the reference's form on MLX, held to the reference by the tests, with its checks
    and its blocks of tokens.

    Examples:
        >>> rng = np.random.default_rng(0)
        >>> q, k, v = (rng.standard_normal(s).astype(np.float32)
        ...            for s in ((3, 4, 8), (6, 2, 8), (6, 2, 8)))
        >>> m = np.full((3, 6), -np.inf, np.float32); m[0, 0] = m[1, [1, 3]] = m[2, 2:] = 0.0
        >>> full = build_attn_mha(q, k, v, m, 8 ** -0.5)
        >>> mx.allclose(attend_visible(q, k, v, m, 8 ** -0.5), full, atol=1e-6).item()
        True
    """
    q, k, v, kq_mask = as_mx(q), as_mx(k), as_mx(v), as_mx(kq_mask)
    check_visible_args(q, k, v, kq_mask)
    n_tokens, n_head, d_k = q.shape
    n_head_kv = k.shape[1]
    r = n_head // n_head_kv  # query heads per KV head
    idx, mask = visible_cells(np.asarray(kq_mask[:n_tokens]))  # host: (n_tokens, n_vis)
    n_vis = idx.shape[1]
    per_block = visible_block(k.shape[0], n_vis)  # the reference's blocks and memory bound
    if n_tokens > per_block:
        return mx.concatenate([
            attend_visible(q[i:i + per_block], k, v, kq_mask[i:i + per_block], kq_scale,
                           max_bias, softcap)
            for i in range(0, n_tokens, per_block)])  # (n_tokens, n_head * d_v)
    idx = mx.array(idx)
    k_t = k[idx].transpose(0, 2, 3, 1)  # (n_tokens, n_head_kv, d_k, n_vis): token t's cells
    v_t = v[idx].transpose(0, 2, 1, 3)  # (n_tokens, n_head_kv, n_vis, d_v)
    q_t = q.reshape(n_tokens, n_head_kv, r, d_k)  # the r query heads of one KV head as rows
    kq = (q_t @ k_t).reshape(n_tokens, n_head, 1, n_vis)  # (n_tokens, n_head, 1, n_vis)
    if softcap > 0.0:
        kq = softcap_op(kq, softcap)
    kq = soft_max_ext(kq, mx.array(mask)[:, None, None, :], kq_scale, max_bias)  # as kq
    kqv = kq.reshape(n_tokens, n_head_kv, r, n_vis) @ v_t  # (n_tokens, n_head_kv, r, d_v)
    return kqv.reshape(n_tokens, -1)  # (n_tokens, n_head * d_v)
# --8<-- [end:attend_visible]


def _attn_softcapped(q: mx.array, k: mx.array, v: mx.array, kq_mask: mx.array, kq_scale: float,
                     max_bias: float, cap: float, n_stream: int) -> mx.array:
    """``build_attn_mha`` with a soft-cap: ``mul_mat``, ``softcap``, ``soft_max_ext``,
    ``mul_mat`` as the reference orders them, one attention per stream; GQA by grouping the
    query heads of a KV head."""
    n_tokens, n_head, d_k = q.shape
    n_kv, n_head_kv, d_v = v.shape
    ns, rep = n_stream, n_head // n_head_kv
    n_t, n_k = n_tokens // ns, n_kv // ns  # tokens and cells of one stream
    qg = stream_blocks(q, ns).transpose(0, 2, 1, 3).reshape(ns, n_head_kv, rep * n_t, d_k)
    kq = qg @ stream_blocks(k, ns).transpose(0, 2, 3, 1)  # (ns, hkv, rep * n_t, n_k)
    kq = softcap_op(kq.reshape(ns, n_head, n_t, n_k), cap)  # (ns, n_head, n_t, n_k)
    mask = stream_mask(kq_mask[:n_tokens], ns)  # (ns, 1, n_t, n_k)
    kq = soft_max_ext(kq, mask, kq_scale, max_bias)  # (ns, n_head, n_t, n_k)
    kqv = kq.reshape(ns, n_head_kv, rep * n_t, n_k) @ stream_blocks(v, ns).transpose(0, 2, 1, 3)
    kqv = kqv.reshape(ns, n_head, n_t, d_v)
    return kqv.transpose(0, 2, 1, 3).reshape(n_tokens, n_head * d_v)  # (n_tokens, n_head * d_v)
