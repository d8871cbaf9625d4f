r"""The backward of every op the Llama forward uses, as ggml computes it.

``ggml_build_backward_expand`` walks the forward graph from the loss back to the parameters
and, for every node, asks ``ggml_compute_backward`` (``ggml/src/ggml.c``) for the gradient of
its sources. Each function here is one of those rules, named after the ggml op (or backward
op) that computes it. With $y = f(x)$ and an upstream gradient $\bar y = \partial L /
\partial y$ (ggml's ``grad``), a rule returns $\bar x = (\partial y / \partial x)^T \bar y$.
The rules that are ggml ops of their own sit beside their forwards in
[`reference.ops`][reference.ops]: [`rope_back`][reference.ops.rope.rope_back],
[`soft_max_ext_back`][reference.ops.attention.soft_max_ext_back],
[`get_rows_back`][reference.ops.rows.get_rows_back] and
[`cross_entropy_loss_back`][reference.ops.loss.cross_entropy_loss_back]; this module has the
others, and the table of them all.

| forward op | backward (``ggml_compute_backward``) | here |
|---|---|---|
| ``get_rows(a, rows)`` | ``get_rows_back``: scatter-add into ``a``'s rows | ``ops.rows`` |
| ``add(a, b)`` | $\bar a = \bar y$, $\bar b$ = ``repeat_back`` | [`add_back`][] |
| ``mul(a, b)`` | $\bar a = \bar y \odot b$, $\bar b$ = ``repeat_back(a*grad)`` | [`mul_back`][] |
| ``scale(a, s)`` | $\bar a = s\,\bar y$ | [`scale_back`][] |
| ``rms_norm(x)`` | ``rms_norm_back`` | [`rms_norm_back`][] |
| ``mul_mat(a, b)`` | two ``out_prod``, block sums for the broadcast | [`mul_mat_back`][] |
| ``rope_ext(x, pos)`` | ``rope_ext_back``: the inverse rotation | ``ops.rope`` |
| ``soft_max_ext(x, mask, s)`` | ``soft_max_ext_back`` (mask: none) | ``ops.attention`` |
| ``silu(x)`` | ``silu_back`` | [`silu_back`][] |
| ``swiglu_split(a, b)`` | ``silu_back`` and ``mul`` | [`swiglu_back`][] |
| ``build_attn_mha`` | the rules above, in reverse op order | [`attn_back`][] |
| ``cross_entropy_loss`` | ``cross_entropy_loss_back`` | ``ops.loss`` |

Permutes, transposes, reshapes and ``cont`` move gradients back unchanged (permuted back),
so they appear here only as NumPy ``transpose``/``reshape``.

What ggml refuses, the specification refuses too: a gradient for the softmax mask, for the
RoPE frequency factors, for ALiBi (``max_bias > 0``: ``soft_max_ext_back`` asserts it is 0),
for the attention soft-cap (``tanh`` has no backward) and for the fused single-tensor
``swiglu``.

Every rule is dtype-generic like the forward ops: float32 as ggml's CPU backend, float64 for
the finite-difference checks.
"""

from __future__ import annotations

import numpy as np

from reference.ops.attention import check_attn_args, soft_max_ext, soft_max_ext_back
from reference.ops.elementwise import repeat_reps
from reference.ops.errors import OpShapeError
from reference.ops.ffn import silu
from reference.ops.matmul import mul_mat, mul_mat_leading


# --8<-- [start:repeat_back]
def repeat_back(grad: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
    r"""``ggml_repeat_back``: the gradient of ``repeat(b, a)`` (ggml's tiling) for ``b``.

    ``add``/``mul`` tile ``b`` over ``a`` (``b[i % n_b]`` along every dimension), so each
    element of ``b`` was used once per tile: its gradient is the sum over the tiles,

    $$ \bar b_j = \sum_{t} \bar y_{t\,n_b + j} . $$

    Args:
        grad: the gradient of the repeated tensor, shape ``S``.
        shape: ``b``'s shape (repeatable into ``S``).

    Returns:
        ``(shape)``, dtype of ``grad``.

    Raises:
        OpShapeError: if ``shape`` does not repeat into ``grad.shape``.

    Examples:
        >>> import numpy as np
        >>> repeat_back(np.arange(8.0).reshape(2, 4), (2,))   # tiles [x, y, x, y] per row
        array([12., 16.])
    """
    b_shape, reps = repeat_reps(grad.shape, shape, "repeat_back")
    split = [n for r, nb in zip(reps, b_shape, strict=True) for n in (r, nb)]
    out = grad.reshape(split).sum(axis=tuple(range(0, 2 * len(reps), 2)))  # b_shape
    return out.reshape(shape).astype(grad.dtype, copy=False)


# --8<-- [end:repeat_back]


# --8<-- [start:add_back]
def add_back(
    grad: np.ndarray, b_shape: tuple[int, ...]
) -> tuple[np.ndarray, np.ndarray]:
    r"""The gradients of ``add(a, b)`` (``GGML_OP_ADD``): $\bar a = \bar y$,
    $\bar b = \mathrm{repeat\_back}(\bar y)$.

    Args:
        grad: $\bar y$, ``a``'s shape.
        b_shape: ``b``'s shape (a bias ``(n,)``, or ``a``'s own shape for a residual add).

    Returns:
        ``(grad_a, grad_b)``.

    Examples:
        >>> import numpy as np
        >>> add_back(np.ones((3, 2)), (2,))[1]
        array([3., 3.])
    """
    return grad, repeat_back(grad, b_shape)


# --8<-- [end:add_back]


# --8<-- [start:mul_back]
def mul_back(grad: np.ndarray, a: np.ndarray, b: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    r"""The gradients of ``mul(a, b)`` (``GGML_OP_MUL``), with ``b`` tiled to ``a``'s shape.

    $$ \bar a = \bar y \odot \mathrm{repeat}(b), \qquad
       \bar b = \mathrm{repeat\_back}(a \odot \bar y). $$

    For a norm gain $g$ ``(n_embd,)`` times activations ``(n_tokens, n_embd)``, $\bar g$ sums
    over the tokens.

    Args:
        grad: $\bar y$, ``a``'s shape.
        a: the forward's ``a``.
        b: the forward's ``b``.

    Returns:
        ``(grad_a, grad_b)``, the shapes of ``a`` and ``b``.

    Examples:
        >>> import numpy as np
        >>> a, b = np.array([[1.0, 2.0], [3.0, 4.0]]), np.array([5.0, 6.0])
        >>> ga, gb = mul_back(np.ones((2, 2)), a, b)
        >>> ga, gb
        (array([[5., 6.],
               [5., 6.]]), array([4., 6.]))
    """
    b_shape, reps = repeat_reps(a.shape, b.shape, "mul_back")
    b_tiled = np.tile(b.reshape(b_shape), reps).astype(a.dtype, copy=False)  # a.shape
    return grad * b_tiled, repeat_back(a * grad, b.shape)


# --8<-- [end:mul_back]


# --8<-- [start:scale_back]
def scale_back(grad: np.ndarray, s: float) -> np.ndarray:
    r"""The gradient of ``scale(a, s)`` (``GGML_OP_SCALE``): $\bar a = s\,\bar y$.

    Examples:
        >>> import numpy as np
        >>> scale_back(np.array([1.0, 2.0]), 0.5)
        array([0.5, 1. ])
    """
    return (grad * grad.dtype.type(s)).astype(grad.dtype, copy=False)


# --8<-- [end:scale_back]


# --8<-- [start:rms_norm_back]
def rms_norm_back(grad: np.ndarray, x: np.ndarray, eps: float) -> np.ndarray:
    r"""``ggml_rms_norm_back``: the gradient of ``rms_norm(x, eps)`` for ``x``, per row.

    With $y = x\,r$, $r = (\overline{x^2} + \epsilon)^{-1/2}$ over a row of length $n$,
    $\partial r / \partial x_i = -r^3 x_i / n$, so

    $$ \bar x = r\left(\bar y - x\,\frac{\sum_j x_j \bar y_j}{\sum_j x_j^2 + n\epsilon}\right). $$

    Precision as ``ggml_compute_forward_rms_norm_back_f32``: both sums accumulated in double,
    ``mean_eps = float(sum_xx)/n + eps`` and ``sum_eps = float(sum_xx) + eps*n`` in float,
    ``rrms = 1/sqrtf(mean_eps)``, ``dx = (dz + x * (float(-sum_xdz) / sum_eps)) * rrms``.

    Args:
        grad: $\bar y$, ``(..., n)``.
        x: the forward's input, same shape.
        eps: the forward's $\epsilon$.

    Returns:
        $\bar x$, same shape and dtype as ``x``.

    Raises:
        OpShapeError: if the shapes differ.

    Examples:
        >>> import numpy as np
        >>> x = np.array([[3.0, 4.0]])
        >>> rms_norm_back(np.array([[4.0, -3.0]]), x, 0.0) * np.sqrt(12.5)   # orthogonal to x
        array([[ 4., -3.]])
        >>> rms_norm_back(x, x, 0.0)                                          # along x: none
        array([[0., 0.]])
    """
    if grad.shape != x.shape:
        raise OpShapeError(f"rms_norm_back: grad {grad.shape} and x {x.shape} differ")
    t = x.dtype.type
    n = x.shape[-1]
    sum_xx = np.sum(x * x, axis=-1, dtype=np.float64, keepdims=True).astype(x.dtype)  # (..., 1)
    sum_xdz = np.sum(x * grad, axis=-1, dtype=np.float64, keepdims=True).astype(x.dtype)
    mean_eps = sum_xx / t(n) + t(eps)  # (..., 1)
    sum_eps = sum_xx + t(eps) * t(n)  # (..., 1)
    rrms = t(1) / np.sqrt(mean_eps)  # (..., 1)
    scale_x = -sum_xdz / sum_eps  # (..., 1)
    return ((grad + x * scale_x) * rrms).astype(x.dtype, copy=False)  # (..., n)


# --8<-- [end:rms_norm_back]


def _sum_blocks(x: np.ndarray, a_lead: tuple, b_lead: tuple) -> np.ndarray:
    """Sum the matrices of ``x`` (leading dims ``b_lead``) over each block of ``a_lead``.

    The inverse of ``mul_mat``'s block broadcast: matrix ``i`` of ``a`` served ``b``'s
    matrices ``i*r .. i*r + r - 1``, so its gradient is the sum of theirs (ggml: a 4-D view
    of the ``out_prod`` with the block as dimension 3, then ``repeat_back``).
    """
    split = [n for da, db in zip(a_lead, b_lead, strict=True) for n in (da, db // da if da else 1)]
    x = x.reshape(tuple(split) + x.shape[-2:])  # (..., da, r, M, K)
    return x.sum(axis=tuple(range(1, 2 * len(a_lead), 2)))  # (..., da, M, K)


# --8<-- [start:mul_mat_back]
def mul_mat_back(
    grad: np.ndarray, a: np.ndarray, b: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    r"""The gradients of ``mul_mat(a, b)`` $= b\,a^T$ (``GGML_OP_MUL_MAT``).

    With $y_{nm} = \sum_k b_{nk} a_{mk}$ per matrix:

    $$ \bar b = \bar y\, a, \qquad \bar a = \sum_{\text{block}} \bar y^T b . $$

    ggml builds both with ``ggml_out_prod`` (``out_prod(b, grad)`` for ``a``,
    ``out_prod(a, transpose(grad))`` for ``b``). Where ``a`` was block-broadcast over ``b``'s
    leading dimensions (GQA: KV head $g$ serves query heads $g\,n_{gqa} \dots
    (g+1)\,n_{gqa} - 1$), $\bar a$ sums the gradients of the matrices it served.

    Args:
        grad: $\bar y$, ``(..., N, M)`` (``b``'s leading dimensions).
        a: ``(..., M, K)``, leading dimensions dividing ``b``'s.
        b: ``(..., N, K)``.

    Returns:
        ``(grad_a, grad_b)`` with the shapes of ``a`` and ``b``.

    Raises:
        OpShapeError: if ``a`` and ``b`` cannot be multiplied or ``grad`` is not the
            product's shape.

    Examples:
        >>> import numpy as np
        >>> W, x = np.array([[1.0, 2.0], [3.0, 4.0], [5.0, 6.0]]), np.array([[1.0, -1.0]])
        >>> gW, gx = mul_mat_back(np.array([[1.0, 0.0, 1.0]]), W, x)
        >>> gW
        array([[ 1., -1.],
               [ 0.,  0.],
               [ 1., -1.]])
        >>> gx
        array([[6., 8.]])
    """
    a_lead, b_lead = mul_mat_leading(a.shape, b.shape)
    if grad.shape != b.shape[:-1] + a.shape[-2:-1]:
        raise OpShapeError(
            f"mul_mat_back: grad must have the product's shape {b.shape[:-1] + a.shape[-2:-1]}, "
            f"got {grad.shape}"
        )
    grad_b = mul_mat(np.swapaxes(a, -1, -2), grad)  # (..., N, K): grad @ a, a block-broadcast
    outer = np.swapaxes(grad, -1, -2) @ b  # (..., M, K) per matrix of b
    grad_a = _sum_blocks(outer, a_lead, b_lead).reshape(a.shape)  # (..., M, K)
    return grad_a.astype(a.dtype, copy=False), grad_b.astype(b.dtype, copy=False)


# --8<-- [end:mul_mat_back]


# --8<-- [start:silu_back]
def silu_back(grad: np.ndarray, x: np.ndarray) -> np.ndarray:
    r"""``ggml_silu_back``: the gradient of ``silu(x)`` $= x\,\sigma(x)$ for ``x``.

    $$ \bar x = \bar y\, \sigma(x)\big(1 + x\,(1 - \sigma(x))\big),
       \qquad \sigma(x) = \frac{1}{1 + e^{-x}}, $$

    as ``ggml_silu_backward_f32`` writes it (``dy*s*(1 + x*(1 - s))``).

    Args:
        grad: $\bar y$, any shape.
        x: the forward's input, same shape.

    Returns:
        $\bar x$, same shape and dtype as ``x``.

    Raises:
        OpShapeError: if the shapes differ.

    Examples:
        >>> import numpy as np
        >>> silu_back(np.ones(3), np.array([0.0, 1000.0, -1000.0]))   # the last is -0.0, as in C
        array([ 0.5,  1. , -0. ])
    """
    if grad.shape != x.shape:
        raise OpShapeError(f"silu_back: grad {grad.shape} and x {x.shape} differ")
    t = x.dtype.type
    with np.errstate(over="ignore"):  # e^{-x} = inf for very negative x: s = 0, as in C
        s = t(1) / (t(1) + np.exp(-x))
    return (grad * s * (t(1) + x * (t(1) - s))).astype(x.dtype, copy=False)


# --8<-- [end:silu_back]


# --8<-- [start:swiglu_back]
def swiglu_back(grad: np.ndarray, a: np.ndarray, b: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    r"""The gradients of ``swiglu_split(a, b)`` $= \mathrm{silu}(a) \odot b$.

    ``ggml_compute_backward`` (``GGML_GLU_OP_SWIGLU``) composes it from other ops:

    $$ \bar a = \mathrm{silu\_back}(\bar y \odot b,\ a), \qquad
       \bar b = \mathrm{silu}(a) \odot \bar y . $$

    Only the split form has a backward (the fused single-tensor ``swiglu`` asserts).

    Args:
        grad: $\bar y$, ``(n_tokens, n_ff)``.
        a: the gate projection of the forward.
        b: the up projection of the forward.

    Returns:
        ``(grad_a, grad_b)``.

    Raises:
        OpShapeError: if the shapes differ.

    Examples:
        >>> import numpy as np
        >>> swiglu_back(np.array([1.0]), np.array([0.0]), np.array([3.0]))
        (array([1.5]), array([0.]))
    """
    if not grad.shape == a.shape == b.shape:
        raise OpShapeError(f"swiglu_back: grad {grad.shape}, a {a.shape}, b {b.shape} differ")
    return silu_back(grad * b, a), silu(a) * grad


# --8<-- [end:swiglu_back]


# --8<-- [start:attn_back]
def attn_back(
    grad: np.ndarray,
    q: np.ndarray,
    k: np.ndarray,
    v: np.ndarray,
    kq_mask: np.ndarray,
    kq_scale: float,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    r"""The gradients of ``build_attn_mha(q, k, v, kq_mask, kq_scale)`` for ``q``, ``k``, ``v``.

    The forward ([`reference.ops.attention.build_attn_mha`][reference.ops.attention.build_attn_mha])
    is ``kq = mul_mat(k, q)``, ``p = soft_max_ext(kq, mask, kq_scale)``,
    ``kqv = mul_mat(v^T, p)`` per head, with GQA by ``mul_mat``'s block broadcast (query head
    $h$ reads KV head $\lfloor h / n_{gqa} \rfloor$). The backward runs the same ops in
    reverse, each by its rule:

    $$
    \bar p = \bar o\, V^T,\quad \bar V = \sum_{h \in g} p_h^T \bar o_h,\quad
    \bar s = \mathrm{scale}\cdot p \odot (\bar p - \textstyle\sum_j p_j \bar p_j),\quad
    \bar q = \bar s\, K,\quad \bar K = \sum_{h \in g} \bar s_h^T q_h ,
    $$

    where $\sum_{h \in g}$ sums the query heads that share KV head $g$. The probabilities
    $p$ are recomputed from the inputs (ggml keeps the forward's tensor; the values are the
    same). No gradient flows into the mask. ALiBi and the soft-cap have no backward in ggml
    and are not arguments here.

    Args:
        grad: $\bar o$, ``(n_tokens, n_head * d_v)``.
        q: the forward's queries ``(n_tokens, n_head, d_k)``.
        k: keys ``(n_kv, n_head_kv, d_k)``.
        v: values ``(n_kv, n_head_kv, d_v)``.
        kq_mask: the forward's mask ``(n_tokens_pad >= n_tokens, n_kv)``.
        kq_scale: the forward's scale.

    Returns:
        ``(grad_q, grad_k, grad_v)`` with the shapes of ``q``, ``k``, ``v``.

    Raises:
        OpShapeError: if the shapes do not fit (as ``build_attn_mha``).

    Examples:
        >>> import numpy as np
        >>> rng = np.random.default_rng(0)
        >>> q = rng.standard_normal((3, 4, 2))                      # 4 query heads
        >>> k, v = rng.standard_normal((3, 2, 2)), rng.standard_normal((3, 2, 2))  # 2 KV heads
        >>> causal = np.triu(np.full((3, 3), -np.inf), 1)
        >>> gq, gk, gv = attn_back(np.ones((3, 8)), q, k, v, causal, 0.5)
        >>> gq.shape, gk.shape, gv.shape
        ((3, 4, 2), (3, 2, 2), (3, 2, 2))
        >>> bool(np.allclose(gv.sum(axis=0), 3 * 2))  # 3 tokens x 2 heads per KV head, weight 1
        True
    """
    check_attn_args(q, k, v, kq_mask)
    n_tokens, n_head, _ = q.shape
    d_v = v.shape[-1]
    if grad.shape != (n_tokens, n_head * d_v):
        raise OpShapeError(f"attn_back: grad must be {(n_tokens, n_head * d_v)}, got {grad.shape}")
    qh = q.transpose(1, 0, 2)  # (n_head, n_tokens, d_k)
    kh = k.transpose(1, 0, 2)  # (n_head_kv, n_kv, d_k)
    v_t = v.transpose(1, 2, 0)  # (n_head_kv, d_v, n_kv)
    p = soft_max_ext(mul_mat(kh, qh), kq_mask, kq_scale)  # (n_head, n_tokens, n_kv)
    # kqv = mul_mat(v^T, p), then permuted to (n_tokens, n_head, d_v) and flattened
    grad_kqv = grad.reshape(n_tokens, n_head, d_v).transpose(1, 0, 2)  # (n_head, n_tokens, d_v)
    grad_v_t, grad_p = mul_mat_back(grad_kqv, v_t, p)  # (n_head_kv, d_v, n_kv), like p
    grad_kq = soft_max_ext_back(grad_p, p, kq_scale)  # (n_head, n_tokens, n_kv)
    grad_kh, grad_qh = mul_mat_back(grad_kq, kh, qh)  # like kh, like qh
    return (
        grad_qh.transpose(1, 0, 2),  # (n_tokens, n_head, d_k)
        grad_kh.transpose(1, 0, 2),  # (n_kv, n_head_kv, d_k)
        grad_v_t.transpose(2, 0, 1),  # (n_kv, n_head_kv, d_v)
    )


# --8<-- [end:attn_back]
