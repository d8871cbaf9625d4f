r"""Twin of [`reference.ops.rows`][reference.ops.rows]: ``ggml_get_rows``, ``ggml_set_rows`` and
``ggml_get_rows_back`` on MLX.

The row indices are bookkeeping (token ids, KV cell indices): they are validated on the host,
with the reference's own checks, before anything is gathered or written. The gather and the
scatters are MLX ops (``mx.take_along_axis``, indexed assignment, ``.at[].add``).
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from accelerated.ops.convert import as_mx
from reference.ops.rows import check_get_rows, check_get_rows_back, set_rows_targets


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
    check_get_rows(a.shape, rows)
    if a.dtype in (mx.float16, mx.bfloat16):
        a = a.astype(mx.float32)  # ggml's get_rows returns F32
    idx = mx.array(rows.astype(np.int32))[..., None]  # (..., n, 1)
    return mx.take_along_axis(a, idx, axis=-2)  # (..., n, n_cols)


# --8<-- [end:get_rows]


# --8<-- [start:get_rows_back]
def get_rows_back(grad: mx.array, rows: mx.array, n_rows: int) -> mx.array:
    """Twin of [`reference.ops.rows.get_rows_back`][reference.ops.rows.get_rows_back].

    ``rows`` is read on the host to be validated; the scatter-add is MLX's ``.at[rows].add``,
    which adds the gradients of a row gathered twice.

    Examples:
        >>> import numpy as np
        >>> g = np.array([[1.0, 2.0], [10.0, 20.0], [5.0, 5.0]])
        >>> get_rows_back(g, np.array([2, 0, 2]), 4).tolist()
        [[10.0, 20.0], [0.0, 0.0], [6.0, 7.0], [0.0, 0.0]]
    """
    grad = as_mx(grad)
    rows = np.asarray(rows)
    check_get_rows_back(grad.shape, rows, n_rows)
    out = mx.zeros((n_rows, grad.shape[1]), dtype=grad.dtype)  # (n_rows, n_cols)
    return out.at[mx.array(rows.astype(np.int32))].add(grad)  # repeated rows add up


# --8<-- [end:get_rows_back]


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
    rows = set_rows_targets(dst, src, np.asarray(rows))  # (..., n)
    lead = src.shape[:-2]
    # one scatter: the leading indices broadcast against the row indices
    n = rows.shape[-1]
    grids = np.indices(lead + (n,))[:-1] if lead else []  # each (..., n)
    index = tuple(mx.array(g.astype(np.int32)) for g in grids) + (mx.array(rows.astype(np.int32)),)
    dst[index] = src.astype(dst.dtype)  # (..., n, n_cols) into (..., n_rows, n_cols)
    return dst


# --8<-- [end:set_rows]
