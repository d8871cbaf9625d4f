r"""``ggml_get_rows`` and ``ggml_set_rows``: gather rows, scatter rows.

Two indexing ops carry everything that is looked up or stored by index in llama.cpp:

- ``ggml_get_rows(a, rows)`` gathers rows of ``a``: the token embedding lookup
  (``get_rows(token_embd, tokens)``) and the selection of the rows whose logits are output.
  In NumPy order ``a`` is ``(..., n_rows, n_cols)`` and ``rows`` is ``(..., n)``; the result
  is ``(..., n, n_cols)`` with $\mathrm{out}_{\dots, i} = a_{\dots, \mathrm{rows}_{\dots, i}}$.
  Leading dimensions must match exactly (``a->ne[2] == b->ne[1]``, ``a->ne[3] == b->ne[2]``):
  there is no broadcasting here.
- ``ggml_set_rows(dst, src, rows)`` scatters: $\mathrm{dst}_{\dots, \mathrm{rows}_i} \leftarrow
  \mathrm{src}_{\dots, i}$, converting to ``dst``'s type (``from_float``). This is how the KV
  cache stores the new K and V of a ubatch into its cells. ``rows`` is ``(n,)`` for one set of
  target rows, or ``(..., n)`` with leading dimensions that tile into ``src``'s (``i11 = i02 %
  ne11`` in the CPU kernel).
- ``ggml_get_rows_back(grad, rows, n_rows)`` is ``get_rows``' backward, used by training
  ([`reference.training`][reference.training]): a scatter-add of the gradient's rows into the
  rows they were gathered from.

All three check every index: ggml asserts ``0 <= row < n_rows``, the specification raises
[`OpIndexError`][reference.ops.errors.OpIndexError] (NumPy's negative indices would silently wrap).
"""

from __future__ import annotations

import numpy as np

from reference.ops.errors import OpIndexError, OpShapeError, OpTypeError


def _check_row_indices(rows: np.ndarray, n_rows: int, op: str) -> None:
    """Raise unless ``rows`` holds integers in ``[0, n_rows)``."""
    if not np.issubdtype(rows.dtype, np.integer):
        raise OpTypeError(f"{op}: rows must be integers (ggml I32/I64), got {rows.dtype}")
    if rows.size and (rows.min() < 0 or rows.max() >= n_rows):
        raise OpIndexError(
            f"{op}: row index out of range [0, {n_rows}): min={rows.min()}, max={rows.max()}"
        )


def check_get_rows(a_shape: tuple, rows: np.ndarray) -> None:
    """``get_rows``'s contract on the host: shapes, then every index in range.

    Shared with the MLX twin, which validates on the host before it gathers.

    Args:
        a_shape: the shape of ``a``, ``(..., n_rows, n_cols)``.
        rows: the row indices ``(..., n)``, with ``a``'s leading dimensions.

    Raises:
        OpShapeError: ``a`` has fewer than 2 dims, or the leading dimensions differ.
        OpTypeError: ``rows`` is not an integer array.
        OpIndexError: a row index is out of ``[0, n_rows)``.

    Examples:
        >>> check_get_rows((4, 2), np.array([3, 0]))
        >>> check_get_rows((4, 2), np.array([4]))
        Traceback (most recent call last):
        ...
        reference.ops.errors.OpIndexError: get_rows: row index out of range [0, 4): min=4, max=4
    """
    if len(a_shape) < 2 or tuple(a_shape[:-2]) != rows.shape[:-1]:
        raise OpShapeError(
            f"get_rows: need a (..., n_rows, n_cols) and rows (..., n) with the same leading "
            f"dimensions; got a.shape={tuple(a_shape)}, rows.shape={rows.shape}"
        )
    _check_row_indices(rows, a_shape[-2], "get_rows")


def set_rows_targets(dst: np.ndarray, src: np.ndarray, rows: np.ndarray) -> np.ndarray:
    """``set_rows``'s target rows ``(..., n)``: checked, then tiled over ``src``'s leading dims.

    Shapes, range and repeated targets are all checked here, on the host, before anything is
    written. Shared with the MLX twin.

    Args:
        dst: the destination ``(..., n_rows, n_cols)`` (only its shape is read).
        src: the rows to write ``(..., n, n_cols)`` (only its shape is read).
        rows: the target rows, ``(n,)`` or ``(..., n)`` tiling into ``src``'s leading dims.

    Returns:
        The target rows ``(..., n)`` with ``src``'s leading dimensions.

    Raises:
        OpShapeError: shapes that ``ggml_set_rows`` asserts on.
        OpTypeError: ``rows`` is not an integer array.
        OpIndexError: a row index out of range, or a target row that repeats.

    Examples:
        >>> set_rows_targets(np.zeros((2, 5, 3)), np.zeros((2, 2, 3)), np.array([4, 0])).tolist()
        [[4, 0], [4, 0]]
    """
    _check_set_rows_shapes(dst, src, rows)
    _check_row_indices(rows, dst.shape[-2], "set_rows")
    lead = tuple(src.shape[:-2])
    rows_lead = (1,) * (len(lead) - (rows.ndim - 1)) + rows.shape[:-1]
    rows = np.tile(rows.reshape(rows_lead + rows.shape[-1:]),
                   tuple(s // r for s, r in zip(lead, rows_lead, strict=True)) + (1,))  # (..., n)
    for idx in np.ndindex(*lead):
        if len(np.unique(rows[idx])) != rows.shape[-1]:
            raise OpIndexError(f"set_rows: a target row repeats: rows{list(idx)}={rows[idx]}")
    return rows


# --8<-- [start:get_rows]
def get_rows(a: np.ndarray, rows: np.ndarray) -> np.ndarray:
    """``ggml_get_rows(a, rows)``: the rows of ``a`` named by ``rows``, in that order.

    ggml returns F32 for any floating-point ``a`` (F16, BF16 and quantized rows are converted
    on the way out); here a floating ``a`` narrower than float32 is returned as float32, and
    float32/float64 keep their dtype.

    Args:
        a: ``(..., n_rows, n_cols)``, e.g. ``token_embd`` of shape ``(n_vocab, n_embd)``.
        rows: integer array ``(..., n)``; its leading dimensions must equal ``a``'s.

    Returns:
        ``(..., n, n_cols)``.

    Raises:
        OpShapeError: if ``a`` has fewer than 2 dimensions or the leading dimensions differ.
        OpTypeError: if ``rows`` is not an integer array.
        OpIndexError: if a row index is negative or ``>= n_rows``.

    Examples:
        >>> import numpy as np
        >>> token_embd = np.arange(8.0).reshape(4, 2)   # (n_vocab=4, n_embd=2)
        >>> get_rows(token_embd, np.array([3, 0, 3]))
        array([[6., 7.],
               [0., 1.],
               [6., 7.]])
    """
    rows = np.asarray(rows)
    check_get_rows(a.shape, rows)
    if np.issubdtype(a.dtype, np.floating) and a.dtype.itemsize < 4:
        a = a.astype(np.float32)  # ggml's get_rows returns F32
    return np.take_along_axis(a, rows[..., None], axis=-2)  # (..., n, n_cols)


# --8<-- [end:get_rows]


def check_get_rows_back(grad_shape: tuple, rows: np.ndarray, n_rows: int) -> None:
    """[`get_rows_back`][]'s contract on the host: shapes, integer rows, every index in range.

    Shared with the MLX twin.

    Args:
        grad_shape: the shape of the gradient, ``(n, n_cols)``.
        rows: the forward's row indices ``(n,)``.
        n_rows: rows of the forward's ``a``.

    Raises:
        OpShapeError: ``grad`` is not 2-D or ``rows`` does not have one entry per row.
        OpTypeError: ``rows`` is not an integer array.
        OpIndexError: a row index is out of ``[0, n_rows)``.

    Examples:
        >>> check_get_rows_back((2, 3), np.array([0, 5]), 4)
        Traceback (most recent call last):
        ...
        reference.ops.errors.OpIndexError: get_rows_back: row index out of range [0, 4): [0, 5]
    """
    if len(grad_shape) != 2 or rows.shape != tuple(grad_shape[:1]):
        raise OpShapeError(
            f"get_rows_back: need grad (n, n_cols) and rows (n,); got grad.shape={grad_shape}, "
            f"rows.shape={rows.shape}"
        )
    if not np.issubdtype(rows.dtype, np.integer):
        raise OpTypeError(f"get_rows_back: rows must be integers, got {rows.dtype}")
    if rows.size and (rows.min() < 0 or rows.max() >= n_rows):
        raise OpIndexError(f"get_rows_back: row index out of range [0, {n_rows}): {rows.tolist()}")


# --8<-- [start:get_rows_back]
def get_rows_back(grad: np.ndarray, rows: np.ndarray, n_rows: int) -> np.ndarray:
    r"""``ggml_get_rows_back``: the gradient of ``get_rows(a, rows)`` with respect to ``a``.

    The forward copies row ``rows[i]`` of ``a`` to row ``i``; the backward adds row ``i`` of
    the gradient into row ``rows[i]`` (a *scatter-add*: a token that appears twice gets both
    rows' gradients, a token that does not appear gets zeros):

    $$ \bar a_r = \sum_{i:\ \mathrm{rows}_i = r} \bar y_i . $$

    CPU kernel: ``ggml_compute_forward_get_rows_back_f32`` (zero ``dst``, then accumulate).

    Args:
        grad: $\bar y$, ``(n, n_cols)``.
        rows: integer ``(n,)``, each in ``[0, n_rows)``.
        n_rows: rows of ``a`` (e.g. ``n_vocab`` for ``token_embd``).

    Returns:
        $\bar a$, ``(n_rows, n_cols)``, dtype of ``grad``.

    Raises:
        OpShapeError: if ``grad`` is not 2-D or ``rows`` does not have one entry per row.
        OpTypeError: if ``rows`` is not an integer array.
        OpIndexError: if a row index is out of range.

    Examples:
        >>> import numpy as np
        >>> get_rows_back(np.array([[1.0, 2.0], [10.0, 20.0], [5.0, 5.0]]), np.array([2, 0, 2]), 4)
        array([[10., 20.],
               [ 0.,  0.],
               [ 6.,  7.],
               [ 0.,  0.]])
    """
    rows = np.asarray(rows)
    check_get_rows_back(grad.shape, rows, n_rows)
    out = np.zeros((n_rows, grad.shape[1]), dtype=grad.dtype)  # (n_rows, n_cols)
    np.add.at(out, rows, grad)  # unbuffered: repeated rows add up
    return out


# --8<-- [end:get_rows_back]


# --8<-- [start:set_rows]
def set_rows(dst: np.ndarray, src: np.ndarray, rows: np.ndarray) -> np.ndarray:
    """``ggml_set_rows(dst, src, rows)``: row ``i`` of ``src`` goes to row ``rows[i]`` of ``dst``.

    The write is in place and converts to ``dst``'s dtype (float32 -> float16 rounds to
    nearest even, as ggml's ``from_float``). Everything is validated before anything is
    written: on error ``dst`` is unchanged.

    Repeated indices are rejected: ggml splits the rows of ``src`` between threads, so which
    of two writes to the same row lands last is not defined there, and the KV cache never
    writes one cell twice in a ubatch.

    Args:
        dst: ``(..., n_rows, n_cols)``, modified in place (e.g. one layer's K cache
            ``(n_ctx, n_embd_k_gqa)``).
        src: ``(..., n, n_cols)`` with the same leading dimensions as ``dst``.
        rows: integer ``(n,)``, or ``(..., n)`` whose leading dimensions tile into ``src``'s
            (each a divisor of ``src``'s, indexed modulo as in ggml).

    Returns:
        ``dst`` itself.

    Raises:
        OpShapeError: if the shapes do not fit together.
        OpTypeError: if ``rows`` is not an integer array.
        OpIndexError: if a row index is out of range or a target row repeats.

    Examples:
        >>> import numpy as np
        >>> k_cache = np.zeros((4, 2), dtype=np.float16)   # (n_ctx=4, n_embd_k_gqa=2)
        >>> k_cur = np.array([[1.0, 2.0], [3.0, 4.0]], dtype=np.float32)   # (n_tokens=2, 2)
        >>> set_rows(k_cache, k_cur, np.array([2, 0]))
        array([[3., 4.],
               [0., 0.],
               [1., 2.],
               [0., 0.]], dtype=float16)
    """
    rows = set_rows_targets(dst, src, np.asarray(rows))  # (..., n)
    lead = src.shape[:-2]
    for idx in np.ndindex(*lead):
        dst[idx][rows[idx]] = src[idx]  # converts to dst.dtype
    return dst


# --8<-- [end:set_rows]


def _check_set_rows_shapes(dst: np.ndarray, src: np.ndarray, rows: np.ndarray) -> None:
    """The shape asserts of ``ggml_set_rows``, as exceptions."""
    ok = (
        dst.ndim >= 2
        and src.ndim == dst.ndim
        and src.shape[:-2] == dst.shape[:-2]
        and src.shape[-1] == dst.shape[-1]
        and rows.ndim >= 1
        and rows.shape[-1] == src.shape[-2]
        and rows.ndim - 1 <= src.ndim - 2
    )
    if ok:
        lead = src.shape[:-2][len(src.shape) - 2 - (rows.ndim - 1):]
        ok = all(r and s % r == 0 for s, r in zip(lead, rows.shape[:-1], strict=True))
    if not ok:
        raise OpShapeError(
            f"set_rows: need dst (..., n_rows, n_cols), src (..., n, n_cols) with dst's leading "
            f"dimensions and n_cols, rows (n,) or (..., n) tiling into them; got "
            f"dst.shape={dst.shape}, src.shape={src.shape}, rows.shape={rows.shape}"
        )
