"""The one conversion every twin op makes on its inputs.

The ops take NumPy arrays as well as ``mx.array`` (the property tests feed both twins the same
NumPy data). ``mx.array(x)`` of an ``mx.array`` is not free: it adds a copy (an ``AsType``
node) to the graph, which a compiled graph keeps and evaluates at every call. On a tiny
model, where a token's graph is a few hundred small nodes, MLX's host work per node is what a
token costs (``docs/performance.md``, "Fewer nodes per token"), so an input that is already an
``mx.array`` is used as it is.
"""

from __future__ import annotations

import mlx.core as mx


def as_mx(x) -> mx.array:
    """``x`` itself when it is an ``mx.array``, else ``mx.array(x)`` (float64 becomes float32).

    Examples:
        >>> import numpy as np
        >>> a = mx.zeros((2,))
        >>> as_mx(a) is a, as_mx(np.array([1.0, 2.0])).dtype
        (True, mlx.core.float32)
    """
    return x if isinstance(x, mx.array) else mx.array(x)
