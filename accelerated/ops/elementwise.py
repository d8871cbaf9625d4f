r"""Twin of [`reference.ops.elementwise`][reference.ops.elementwise]: ``ggml_add``, ``ggml_mul``,
``ggml_scale`` on MLX.

The same *repeat* broadcast: ``b`` is tiled (``mx.tile``) to ``a``'s shape, then the op is
applied lazily; the result has ``a``'s dtype.
"""

from __future__ import annotations

import mlx.core as mx

from accelerated.ops.convert import as_mx
from reference.ops.elementwise import repeat_reps


def _repeat_like(b: mx.array, a: mx.array, op: str) -> mx.array:
    """``ggml_repeat(b, a)``: ``b`` tiled to ``a``'s shape, in ``a``'s dtype.

    When only dimensions of size 1 repeat (a norm's weight or a bias over the rows), MLX's
    own broadcasting in the elementwise op is that repeat: ``b`` is returned as it is, and the
    graph gets no reshape or tile node for it.
    """
    b_shape, reps = repeat_reps(a.shape, b.shape, op)
    if all(r == 1 or nb == 1 for r, nb in zip(reps, b_shape, strict=True)):
        return b if b.dtype == a.dtype else b.astype(a.dtype)  # broadcast by the op
    return mx.tile(b.reshape(b_shape), list(reps)).astype(a.dtype)  # a.shape


# --8<-- [start:add]
def add(a: mx.array, b: mx.array) -> mx.array:
    """Twin of [`reference.ops.elementwise.add`][reference.ops.elementwise.add].

    Lazy; ``b`` tiled with ``mx.tile`` (MLX's own broadcasting would only cover size-1
    dimensions).

    Examples:
        >>> import numpy as np
        >>> add(np.zeros((2, 4)), np.array([1.0, 2.0])).tolist()
        [[1.0, 2.0, 1.0, 2.0], [1.0, 2.0, 1.0, 2.0]]
    """
    a, b = as_mx(a), as_mx(b)
    return a + _repeat_like(b, a, "add")


# --8<-- [end:add]


# --8<-- [start:mul]
def mul(a: mx.array, b: mx.array) -> mx.array:
    """Twin of [`reference.ops.elementwise.mul`][reference.ops.elementwise.mul].

    Lazy; ``b`` tiled with ``mx.tile``.

    Examples:
        >>> import numpy as np
        >>> mul(np.ones((1, 4)), np.array([[1.0, 2.0]])).tolist()
        [[1.0, 2.0, 1.0, 2.0]]
    """
    a, b = as_mx(a), as_mx(b)
    return a * _repeat_like(b, a, "mul")


# --8<-- [end:mul]


# --8<-- [start:scale]
def scale(a: mx.array, s: float) -> mx.array:
    """Twin of [`reference.ops.elementwise.scale`][reference.ops.elementwise.scale].

    Lazy; the Python scalar is cast to ``a``'s dtype by MLX's promotion rules.

    Examples:
        >>> import numpy as np
        >>> scale(np.array([1.0, -2.0], dtype=np.float32), 0.5).tolist()
        [0.5, -1.0]
    """
    a = as_mx(a)
    return (a * s).astype(a.dtype)


# --8<-- [end:scale]
