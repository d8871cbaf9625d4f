r"""Twin of [`reference.ops.softcap`][reference.ops.softcap]: ``ggml_tanh`` and logit soft-capping
on MLX.

The same three ops as llama.cpp and the reference, ``scale(tanh(scale(a, 1.0f / c)), c)``, with
``1.0f / c`` rounded to float32 on the host; lazy MLX element-wise ops (``mx.tanh``), fused
by ``mx.compile`` when the caller compiles the graph. MLX's ``tanh`` and NumPy's may differ in
the last bit of a float32 result.
"""

from __future__ import annotations

import math

import mlx.core as mx
import numpy as np

from accelerated.ops.convert import as_mx
from accelerated.ops.elementwise import scale
from reference.ops.errors import OpValueError


# --8<-- [start:tanh]
def tanh(a: mx.array) -> mx.array:
    r"""Twin of [`reference.ops.softcap.tanh`][reference.ops.softcap.tanh].

    ``mx.tanh``, lazy, in ``a``'s dtype.

    Examples:
        >>> [round(v, 6) for v in tanh(np.array([0.0, 1.0, -np.inf])).tolist()]
        [0.0, 0.761594, -1.0]
    """
    return mx.tanh(as_mx(a))


# --8<-- [end:tanh]


# --8<-- [start:softcap]
def softcap(a: mx.array, cap: float) -> mx.array:
    r"""Twin of [`reference.ops.softcap.softcap`][reference.ops.softcap.softcap].

    $c \tanh(a \cdot \mathrm{fl}(1/c))$ as three lazy MLX ops; the same check of ``cap``, on
    the host, before any array work.

    Raises:
        OpValueError: if ``cap`` is not a positive finite number.

    Examples:
        >>> [round(v, 4) for v in softcap(np.array([0.0, 1.0, 100.0, -1e9]), 30.0).tolist()]
        [0.0, 0.9996, 29.9237, -30.0]
        >>> softcap(np.ones(2), 0.0)  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        reference.ops.errors.OpValueError: softcap: the cap must be a positive ..., got 0.0
    """
    if not (math.isfinite(cap) and cap > 0):
        raise OpValueError(f"softcap: the cap must be a positive finite number, got {cap}")
    inv = float(np.float32(1.0) / np.float32(cap))  # 1.0f / c
    return scale(tanh(scale(a, inv)), cap)


# --8<-- [end:softcap]
