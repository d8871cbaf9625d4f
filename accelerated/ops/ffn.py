r"""Twin of [`reference.ops.ffn`][reference.ops.ffn]: ``ggml_silu``, ``ggml_gelu``, ``swiglu``,
``geglu`` on MLX.

The same formulas, written with MLX element-wise ops (lazy; fused by ``mx.compile`` when the
caller compiles the graph). GELU is the tanh approximation, computed in the input dtype like
the reference (not ggml's float16 table).
"""

from __future__ import annotations

import math

import mlx.core as mx

from accelerated.ops.convert import as_mx
from reference.ops.ffn import check_same_shape


# --8<-- [start:silu]
def silu(x: mx.array) -> mx.array:
    r"""Twin of [`reference.ops.ffn.silu`][reference.ops.ffn.silu].

    The same $x / (1 + e^{-x})$ form, so very negative ``x`` gives ``-0.0`` as in ggml.

    Examples:
        >>> import numpy as np
        >>> [round(v, 6) for v in silu(np.array([0.0, 1.0, -1000.0])).tolist()]
        [0.0, 0.731059, -0.0]
    """
    x = as_mx(x)
    return x / (1 + mx.exp(-x))


# --8<-- [end:silu]


# --8<-- [start:gelu]
def gelu(x: mx.array) -> mx.array:
    r"""Twin of [`reference.ops.ffn.gelu`][reference.ops.ffn.gelu].

    Examples:
        >>> import numpy as np
        >>> [round(v, 6) for v in gelu(np.array([-1.0, 0.0, 1.0])).tolist()]
        [-0.158808, 0.0, 0.841192]
    """
    x = as_mx(x)
    sqrt_2_over_pi = math.sqrt(2.0 / math.pi)
    return 0.5 * x * (1 + mx.tanh(sqrt_2_over_pi * x * (1 + 0.044715 * x * x)))


# --8<-- [end:gelu]


# --8<-- [start:swiglu]
def swiglu(a: mx.array, b: mx.array) -> mx.array:
    r"""Twin of [`reference.ops.ffn.swiglu`][reference.ops.ffn.swiglu].

    Examples:
        >>> import numpy as np
        >>> [round(v, 6) for v in swiglu(np.array([0.0, 1.0]), np.array([5.0, 2.0])).tolist()]
        [0.0, 1.462117]
    """
    a, b = as_mx(a), as_mx(b)
    check_same_shape(a, b, "swiglu")
    return silu(a) * b


# --8<-- [end:swiglu]


# --8<-- [start:geglu]
def geglu(a: mx.array, b: mx.array) -> mx.array:
    r"""Twin of [`reference.ops.ffn.geglu`][reference.ops.ffn.geglu].

    Examples:
        >>> import numpy as np
        >>> [round(v, 5) for v in geglu(np.array([1.0]), np.array([2.0])).tolist()]
        [1.68238]
    """
    a, b = as_mx(a), as_mx(b)
    check_same_shape(a, b, "geglu")
    return gelu(a) * b


# --8<-- [end:geglu]
