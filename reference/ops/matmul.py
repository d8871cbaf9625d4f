r"""``ggml_mul_mat``: the one matrix product every layer is made of.

ggml has a single matrix product, ``ggml_mul_mat(ctx, a, b)``, and its convention is not
NumPy's. Both operands are read as *rows of length K*: ``a`` has ``ne = [K, M, ne2, ne3]``
(M rows of K: this is how every weight matrix is stored, one output feature per row) and
``b`` has ``ne = [K, N, ne2', ne3']`` (N rows of K: one activation vector per row). The
result has ``ne = [M, N, ne2', ne3']``: for every row of ``b``, its dot product with every
row of ``a``. In NumPy order (the reverse of ``ne``):

$$
a \in \mathbb{R}^{\dots \times M \times K},\quad
b \in \mathbb{R}^{\dots \times N \times K},\qquad
\mathrm{mul\_mat}(a, b)_{\dots, n, m} = \sum_{k} b_{\dots, n, k}\, a_{\dots, m, k},
$$

that is ``b @ a.T``. "``a`` is the weight": ``mul_mat(W, x)`` with ``W`` of shape
``(n_out, n_in)`` (the GGUF shape of ``blk.0.attn_q``, read in NumPy order) and ``x`` of shape
``(n_tokens, n_in)`` gives ``(n_tokens, n_out)``.

**Broadcasting is by blocks, not by tiling.** ``ggml_can_mul_mat`` asks that each leading
dimension of ``b`` be a *multiple* of ``a``'s (``ne12 % ne02 == 0``, ``ne13 % ne03 == 0``), and
the CPU kernel maps the ``i12``-th matrix of ``b`` to the ``i02 = i12 / r2``-th matrix of ``a``
with ``r2 = ne12 / ne02`` (the same for dimension 3). Each matrix of ``a`` therefore serves a
*contiguous block* of ``r2`` matrices of ``b`` (``np.repeat``), not every ``ne02``-th one
(``np.tile``). This is what makes grouped-query attention work without copying K and V:
with ``n_head`` query heads and ``n_head_kv`` KV heads, query head ``h`` meets KV head
``h // (n_head / n_head_kv)``. The element-wise ops broadcast the other way (see
``reference.ops.elementwise``).

Precision: the specification computes in the dtype of its inputs (NumPy's ``matmul``, a
float32 BLAS for float32). ggml's CPU ``vec_dot_f32`` also sums float32 products; for
float16 or quantized weights ggml first converts ``b`` to the weight's ``vec_dot_type``
(F16, Q8_0, Q8_1, ...) and the result differs from a float32 product by that rounding.

**Few rows (a decode step, a draft to verify).** For a 2-D weight and fewer than
`FEW_ROWS` rows of ``b``, the product is computed as $(a\, b^T)^T$ (``_few_rows``, a fast
path): the same dot products, but BLAS's ``gemm`` packs its *second* operand into cache-sized
panels, so ``b @ a.T`` copies the whole weight on every call while ``a @ b.T`` copies only the
few rows of ``b``. Without it a decode of 2 tokens cost almost twice one token, and
speculative and parallel decoding live on that cost (``docs/performance.md`` has the
measurements). A tall weight (the output layer's 49152 rows) is multiplied ``TALL_BLOCK``
rows at a time, so that the transpose of each block's product is copied while it is still in
cache.

**A block of ``b`` as one matrix.** The ``r`` matrices of ``b`` that meet the same matrix of
``a`` in the innermost leading dimension (in attention, the query heads of one KV head) are
stacked into one matrix of ``r * N`` rows and multiplied once: the same dot products, in
fewer and larger BLAS calls (32 sequences decoding together: 32 rows against their cells,
SmolLM2's 3 query heads per KV head). With one row each (``N = 1``, one token's decode) the
rows are left apart: three matrix-vector products cost what one product of three rows costs.
"""

from __future__ import annotations

import numpy as np

from reference.ops.errors import OpShapeError


def _pad_leading(shape: tuple[int, ...], n: int) -> tuple[int, ...]:
    """``shape`` left-padded with 1s to ``n`` dimensions (ggml tensors always have four)."""
    return (1,) * (n - len(shape)) + tuple(shape)


def mul_mat_leading(a_shape: tuple, b_shape: tuple) -> tuple[tuple, tuple]:
    """``ggml_can_mul_mat``: the leading dims of ``a`` and ``b``, padded to the same count.

    Pure shape bookkeeping, shared with the MLX twin and with the backward of ``mul_mat``
    ([`reference.training.grad.mul_mat_back`][reference.training.grad.mul_mat_back]).

    Args:
        a_shape: ``(..., M, K)``.
        b_shape: ``(..., N, K)``.

    Returns:
        ``(a_lead, b_lead)``: the leading dimensions, left-padded with 1s to one count.

    Raises:
        OpShapeError: not matrices, different ``K``, or leading dimensions of ``a`` that do
            not divide ``b``'s (ggml broadcasts ``a`` over ``b`` only).

    Examples:
        >>> mul_mat_leading((2, 5, 8), (3, 2, 4, 8))
        ((1, 2), (3, 2))
    """
    a_shape, b_shape = tuple(a_shape), tuple(b_shape)
    if len(a_shape) < 2 or len(b_shape) < 2:
        raise OpShapeError(f"mul_mat needs matrices: got a.shape={a_shape}, b.shape={b_shape}")
    if a_shape[-1] != b_shape[-1]:
        raise OpShapeError(
            f"mul_mat: a and b must have the same row length K (last axis): "
            f"a.shape={a_shape}, b.shape={b_shape}"
        )
    n = max(len(a_shape), len(b_shape))
    a_lead = _pad_leading(a_shape[:-2], n - 2)
    b_lead = _pad_leading(b_shape[:-2], n - 2)
    for da, db in zip(a_lead, b_lead, strict=True):
        if (db % da != 0) if da else (db != 0):
            raise OpShapeError(
                f"mul_mat: each leading dimension of b must be a multiple of a's "
                f"(ggml_can_mul_mat): a.shape={a_shape}, b.shape={b_shape}"
            )
    return a_lead, b_lead


FEW_ROWS = 64  # below it, mul_mat of a 2-D weight packs the rows of b, not the weight
TALL_BLOCK = 4096  # rows of a weight per product on the few-rows path (see _few_rows)


def _few_rows(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    r"""Fast path of [`mul_mat`][]: ``b @ a^T`` ``(N, M)`` for a 2-D weight ``a`` and few
    rows ``b``, as $(a\, b^T)^T$ (the module docstring's *Few rows*), ``TALL_BLOCK`` rows of
    ``a`` at a time.

    The product $a\, b^T$ is ``(M, N)``; its transpose is copied into the result while it is
    still in cache. Whole, a tall weight's product (the output layer: 49152 rows against 32
    tokens, 6 MiB) is copied back from memory in a strided walk, which is slower
    (``docs/performance.md``). The same dot products, summed in BLAS's order:
    ``tests/laws/test_ops_basic.py::test_a_tall_weight_in_blocks_is_the_product_in_one_piece``
    holds it to the product in one piece.

    Examples:
        >>> a = np.arange(6.0).reshape(3, 2); b = np.ones((1, 2))
        >>> _few_rows(a, b)
        array([[1., 5., 9.]])
    """
    out = np.empty((b.shape[0], a.shape[0]), dtype=np.result_type(a, b))  # (N, M)
    for i in range(0, a.shape[0], TALL_BLOCK):
        out[:, i:i + TALL_BLOCK] = (a[i:i + TALL_BLOCK] @ b.T).T  # (N, block)
    return out


# --8<-- [start:mul_mat]
def mul_mat(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """``ggml_mul_mat(a, b)``: every row of ``b`` dotted with every row of ``a``.

    Args:
        a: the "weight", shape ``(..., M, K)`` (ggml ``ne = [K, M, ...]``). Each leading
            dimension must divide the matching one of ``b`` (missing ones count as 1).
        b: the "activations", shape ``(..., N, K)`` (ggml ``ne = [K, N, ...]``).

    Returns:
        ``b @ a^T`` of shape ``(..., N, M)`` with ``b``'s leading dimensions; the matrix
        ``a[..., i, :, :]`` is used for the block of ``b``-matrices ``i * r .. (i + 1) * r - 1``
        where ``r = b.shape[d] // a.shape[d]`` (block broadcast, ``i02 = i12 / r2`` in ggml).

    Raises:
        OpShapeError: if an operand has fewer than 2 dimensions, if the K dimensions differ,
            or if a leading dimension of ``b`` is not a multiple of ``a``'s.

    Examples:
        >>> import numpy as np
        >>> W = np.array([[1.0, 0.0], [0.0, 2.0], [1.0, 1.0]])  # (n_out=3, n_in=2)
        >>> x = np.array([[1.0, 2.0]])                           # (n_tokens=1, n_in=2)
        >>> mul_mat(W, x)
        array([[1., 4., 3.]])
        >>> k = np.arange(2.0).reshape(2, 1, 1)   # 2 KV heads, one key each
        >>> q = np.ones((4, 1, 1))                # 4 query heads
        >>> mul_mat(k, q)[:, 0, 0]                # heads 0,1 see KV head 0; 2,3 see KV head 1
        array([0., 0., 1., 1.])
    """
    a_lead, b_lead = mul_mat_leading(a.shape, b.shape)
    if a.ndim == 2 and b.ndim == 2 and b.shape[0] < FEW_ROWS:
        # a weight and a few rows: (a b^T)^T, so that gemm packs b, not a (module docstring)
        return _few_rows(a, b)  # (N, M)
    # block broadcast: matrix i of a serves matrices i*r .. i*r + r-1 of b. Each leading dim
    # db of b is split into (da, r) and a gets a size-1 axis in the place of r, so matmul's
    # own broadcasting pairs them: the same products as np.repeat(a, r, axis), without
    # copying a (in attention, a is the K or V of every cell in view)
    a_blocks = [n for da in a_lead for n in (da, 1)]
    b_blocks = [n for da, db in zip(a_lead, b_lead, strict=True)
                for n in (da, db // da if da else 1)]
    a = a.reshape(tuple(a_blocks) + a.shape[-2:])  # (..., da, 1, M, K)
    b = b.reshape(tuple(b_blocks) + b.shape[-2:])  # (..., da, r, N, K)
    n, k = b.shape[-2:]
    r = b.shape[-3] if b.ndim >= 3 else 1  # b's matrices per matrix of a (innermost)
    if r > 1 and n > 1:
        # the r matrices of b that share one matrix of a (the query heads of one KV head)
        # are one matrix of r*N rows: one product where there were r, the same dot products
        # (attention: fewer and larger products; one row each is as fast as it is)
        b = b.reshape(b.shape[:-3] + (1, r * n, k))  # (..., da, 1, r*N, K)
    out = b @ np.swapaxes(a, -1, -2)  # (..., da, r, N, M) or (..., da, 1, r*N, M)
    return out.reshape(b_lead + (n, out.shape[-1]))  # (..., N, M)


# --8<-- [end:mul_mat]
