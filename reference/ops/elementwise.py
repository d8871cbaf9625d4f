r"""``ggml_add``, ``ggml_mul``, ``ggml_scale``: element-wise ops and ggml's *repeat* broadcast.

``ggml_add(a, b)`` and ``ggml_mul(a, b)`` produce a tensor of ``a``'s shape. ``b`` need not
have that shape: it must be *repeatable* into ``a`` (``ggml_can_repeat(b, a)``): every
dimension of ``a`` is a multiple of ``b``'s (missing leading dimensions of ``b`` count as 1).
``b`` is then **tiled**, as ``ggml_repeat`` would: the CPU kernel reads
``b[i % b.shape[d]]`` along every dimension ``d`` (``i11 = i01 % ne11``, ...):

$$
\mathrm{add}(a, b)_{i_0 \dots i_{r-1}} = a_{i_0 \dots i_{r-1}} +
    b_{i_0 \bmod n_0,\ \dots,\ i_{r-1} \bmod n_{r-1}}.
$$

NumPy's broadcasting is the special case where each dimension of ``b`` is 1 or equal to
``a``'s (a norm weight ``(n_embd,)`` times activations ``(n_tokens, n_embd)``). The general
case is ``np.tile`` (``[x, y]`` repeated to ``[x, y, x, y]``), the opposite of
``mul_mat``'s block broadcast (``np.repeat``: ``[x, x, y, y]``).

``ggml_scale(a, s)`` multiplies by a scalar: $\mathrm{scale}(a, s) = s\,a$.

The result has ``a``'s dtype; ``b`` is converted to it first (ggml converts an F16 ``b`` to
F32 when ``a`` is F32).
"""

from __future__ import annotations

import numpy as np

from reference.ops.errors import OpShapeError


def repeat_reps(a_shape: tuple, b_shape: tuple, op: str) -> tuple[tuple, tuple]:
    """``ggml_can_repeat(b, a)``: ``b``'s shape left-padded with 1s, and the tile counts.

    Pure shape bookkeeping, shared with the MLX twin and with the backward of the broadcast
    ([`reference.training.grad.repeat_back`][reference.training.grad.repeat_back]).

    Args:
        a_shape: the shape of ``a``, the one the result has.
        b_shape: the shape of ``b``, tiled over ``a``.
        op: the op's name, for the messages.

    Returns:
        ``(b_shape, reps)``: ``b``'s shape with as many dimensions as ``a``'s, and how many
        times each dimension of ``b`` repeats.

    Raises:
        OpShapeError: ``b`` has more dimensions than ``a``, or a dimension of ``a`` is not a
            multiple of ``b``'s.

    Examples:
        >>> repeat_reps((4, 6), (3,), "add")
        ((1, 3), (4, 2))
    """
    a_shape, b_shape = tuple(a_shape), tuple(b_shape)
    if len(b_shape) > len(a_shape):
        raise OpShapeError(
            f"{op}: b cannot be repeated into a, it has more dimensions: "
            f"a.shape={a_shape}, b.shape={b_shape}"
        )
    b_shape = (1,) * (len(a_shape) - len(b_shape)) + b_shape
    if any((na % nb != 0) if nb else (na != 0) for na, nb in zip(a_shape, b_shape, strict=True)):
        raise OpShapeError(
            f"{op}: b cannot be repeated into a (ggml_can_repeat: every dimension of a must be "
            f"a multiple of b's): a.shape={a_shape}, b.shape={b_shape}"
        )
    reps = tuple(na // nb if nb else 1 for na, nb in zip(a_shape, b_shape, strict=True))
    return b_shape, reps


def _repeat_like(b: np.ndarray, a: np.ndarray, op: str) -> np.ndarray:
    """``ggml_repeat(b, a)``: ``b`` tiled to ``a``'s shape, in ``a``'s dtype."""
    b_shape, reps = repeat_reps(a.shape, b.shape, op)
    return np.tile(b.reshape(b_shape), reps).astype(a.dtype, copy=False)  # a.shape


# --8<-- [start:add]
def add(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """``ggml_add(a, b)``: ``a + b`` with ``b`` tiled to ``a``'s shape.

    Args:
        a: any shape ``S``.
        b: a shape that repeats into ``S`` (each dimension divides ``S``'s, after left-padding
            with 1s).

    Returns:
        ``a + repeat(b)``, shape ``S``, dtype of ``a``.

    Raises:
        OpShapeError: if ``b`` cannot be repeated into ``a``.

    Examples:
        >>> import numpy as np
        >>> add(np.zeros((2, 4)), np.array([1.0, 2.0]))   # tiled, not np.repeat
        array([[1., 2., 1., 2.],
               [1., 2., 1., 2.]])
    """
    return a + _repeat_like(b, a, "add")


# --8<-- [end:add]


# --8<-- [start:mul]
def mul(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """``ggml_mul(a, b)``: ``a * b`` with ``b`` tiled to ``a``'s shape.

    This is how norm weights are applied: ``mul(rms_norm(x, eps), attn_norm)`` with
    ``x`` of shape ``(n_tokens, n_embd)`` and ``attn_norm`` of shape ``(n_embd,)``.

    Args:
        a: any shape ``S``.
        b: a shape that repeats into ``S``.

    Returns:
        ``a * repeat(b)``, shape ``S``, dtype of ``a``.

    Raises:
        OpShapeError: if ``b`` cannot be repeated into ``a``.

    Examples:
        >>> import numpy as np
        >>> mul(np.ones((1, 4)), np.array([[1.0, 2.0]]))
        array([[1., 2., 1., 2.]])
    """
    return a * _repeat_like(b, a, "mul")


# --8<-- [end:mul]


# --8<-- [start:scale]
def scale(a: np.ndarray, s: float) -> np.ndarray:
    """``ggml_scale(a, s)``: every element multiplied by the scalar ``s``.

    Args:
        a: any shape.
        s: the factor (a float parameter of the op in ggml).

    Returns:
        ``s * a``, same shape and dtype as ``a``.

    Examples:
        >>> import numpy as np
        >>> scale(np.array([1.0, -2.0], dtype=np.float32), 0.5)
        array([ 0.5, -1. ], dtype=float32)
    """
    return (a * a.dtype.type(s)).astype(a.dtype, copy=False)


# --8<-- [end:scale]
