r"""Twin of [`reference.ops.rows`][reference.ops.rows]: ``ggml_get_rows`` and ``ggml_set_rows`` on
MLX.

The row indices are bookkeeping (token ids, KV cell indices): they are validated on the host,
with the reference's own checks, before anything is gathered or written. The gather and the
scatter are MLX ops (``mx.take_along_axis``, indexed assignment).
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from accelerated.ops.convert import as_mx
from reference.ops.rows import _check_get_rows, _set_rows_targets


# --8<-- [start:get_rows]
def get_rows(a: mx.array, rows: mx.array) -> mx.array:
    """Twin of [`reference.ops.rows.get_rows`][reference.ops.rows.get_rows].

    ``rows`` is read on the host to be validated (an ``mx.array`` is evaluated for that); the
    gather is a lazy ``mx.take_along_axis``. float16/bfloat16 ``a`` gives float32, as in ggml.

    Examples:
        >>> import numpy as np
        >>> get_rows(np.arange(8.0).reshape(4, 2), np.array([3, 0, 3])).tolist()
        [[6.0, 7.0], [0.0, 1.0], [6.0, 7.0]]
    """
    a = as_mx(a)
    rows = np.asarray(rows)
    _check_get_rows(a.shape, rows)
    if a.dtype in (mx.float16, mx.bfloat16):
        a = a.astype(mx.float32)  # ggml's get_rows returns F32
    idx = mx.array(rows.astype(np.int32))[..., None]  # (..., n, 1)
    return mx.take_along_axis(a, idx, axis=-2)  # (..., n, n_cols)


# --8<-- [end:get_rows]


# --8<-- [start:set_rows]
def set_rows(dst: mx.array, src: mx.array, rows: mx.array) -> mx.array:
    """Twin of [`reference.ops.rows.set_rows`][reference.ops.rows.set_rows].

    MLX arrays are values, not buffers: the write is an indexed assignment on the ``dst``
    object (``dst[idx] = src``), which the caller sees, and ``dst`` is returned. A NumPy
    ``dst`` is converted first, so only the returned array holds the result then. Validation
    (shapes, range, repeated targets) happens on the host before anything is written.

    Examples:
        >>> import mlx.core as mx, numpy as np
        >>> k_cache = mx.zeros((4, 2), dtype=mx.float16)
        >>> _ = set_rows(k_cache, np.array([[1.0, 2.0], [3.0, 4.0]]), np.array([2, 0]))
        >>> k_cache.tolist(), k_cache.dtype
        ([[3.0, 4.0], [0.0, 0.0], [1.0, 2.0], [0.0, 0.0]], mlx.core.float16)
    """
    if not isinstance(dst, mx.array):
        dst = mx.array(dst)
    src = as_mx(src)
    rows = _set_rows_targets(dst, src, np.asarray(rows))  # (..., n)
    lead = src.shape[:-2]
    # one scatter: the leading indices broadcast against the row indices
    n = rows.shape[-1]
    grids = np.indices(lead + (n,))[:-1] if lead else []  # each (..., n)
    index = tuple(mx.array(g.astype(np.int32)) for g in grids) + (mx.array(rows.astype(np.int32)),)
    dst[index] = src.astype(dst.dtype)  # (..., n, n_cols) into (..., n_rows, n_cols)
    return dst


# --8<-- [end:set_rows]
