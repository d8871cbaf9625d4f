"""The conversions every part of the twin makes: arrays
([`as_mx`][accelerated.ops.convert.as_mx]) and dtypes
([`MX_DTYPES`][accelerated.ops.convert.MX_DTYPES], the twin's one map from NumPy dtypes to
MLX's).

The ops take NumPy arrays as well as ``mx.array`` (the property tests feed both twins the same
NumPy data). ``mx.array(x)`` of an ``mx.array`` is not free: it adds a copy (an ``AsType``
node) to the graph, which a compiled graph keeps and evaluates at every call. On a tiny
model, where a token's graph is a few hundred small nodes, MLX's host work per node is what a
token costs (``docs/performance.md``, "Fewer nodes per token"), so an input that is already an
``mx.array`` is used as it is.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
from numpy.typing import DTypeLike

from reference.ops.errors import OpTypeError

MX_DTYPES: dict[np.dtype, mx.Dtype] = {
    np.dtype(np.bool_): mx.bool_,
    np.dtype(np.int8): mx.int8,
    np.dtype(np.int16): mx.int16,
    np.dtype(np.int32): mx.int32,
    np.dtype(np.int64): mx.int64,
    np.dtype(np.uint8): mx.uint8,
    np.dtype(np.uint16): mx.uint16,
    np.dtype(np.uint32): mx.uint32,
    np.dtype(np.uint64): mx.uint64,
    np.dtype(np.float16): mx.float16,
    np.dtype(np.float32): mx.float32,
    np.dtype(np.float64): mx.float64,
}
"""The MLX dtype of each NumPy dtype: the twin's one dtype map."""


def as_mx(x) -> mx.array:
    """``x`` itself when it is an ``mx.array``, else ``mx.array(x)`` (float64 becomes float32).

    Examples:
        >>> a = mx.zeros((2,))
        >>> as_mx(a) is a, as_mx(np.array([1.0, 2.0])).dtype
        (True, mlx.core.float32)
    """
    return x if isinstance(x, mx.array) else mx.array(x)


# --8<-- [start:mx_dtype]
def to_mx_dtype(dtype: DTypeLike | mx.Dtype) -> mx.Dtype:
    """The MLX dtype of a NumPy dtype, as it is (``np.float64`` -> ``mx.float64``); an MLX
    dtype is returned unchanged.

    Raises:
        OpTypeError: a dtype MLX has no counterpart of (complex, strings, objects).

    Examples:
        >>> to_mx_dtype(np.float64), to_mx_dtype("float16"), to_mx_dtype(mx.int32)
        (mlx.core.float64, mlx.core.float16, mlx.core.int32)
    """
    if isinstance(dtype, mx.Dtype):
        return dtype
    dt = np.dtype(dtype)
    if dt not in MX_DTYPES:
        raise OpTypeError(f"MLX has no dtype for NumPy's {dt}")
    return MX_DTYPES[dt]


def mx_dtype(dtype: DTypeLike) -> mx.Dtype:
    """The MLX dtype that tensors of NumPy ``dtype`` are stored in on the device: float16 as
    it is, anything else float32 (float64 included: MLX's GPUs have no float64).

    The weights, the KV cache and the embeddings of a float64 reference run are float32 in
    the twin.

    Examples:
        >>> mx_dtype(np.float64), mx_dtype(np.float16)
        (mlx.core.float32, mlx.core.float16)
    """
    dt = np.dtype(dtype)
    return to_mx_dtype(dt) if dt == np.float16 else mx.float32
# --8<-- [end:mx_dtype]
