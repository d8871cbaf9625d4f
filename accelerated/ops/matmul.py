r"""Twin of [`reference.ops.matmul`][reference.ops.matmul]: ``ggml_mul_mat`` on MLX.

Same convention (``mul_mat(a, b) = b @ a^T``, block broadcast of ``a``'s leading dimensions,
``np.repeat`` not ``np.tile``). ``mx.matmul`` only broadcasts size-1 dimensions, so ``a`` is
repeated with ``mx.repeat`` first, exactly as the reference does with ``np.repeat``. The
product is lazy and runs in float32 (MLX's CPU backend calls its bundled BLAS; Metal uses its
own GEMM kernels), so the result differs from NumPy's by summation order only. The
reference's `FEW_ROWS` rule (which operand BLAS packs) is about OpenBLAS and does not apply to
MLX's kernels: the twin imports the constant and computes every product one way.
"""

from __future__ import annotations

import mlx.core as mx

from accelerated.ops.convert import as_mx
from reference.ops.matmul import FEW_ROWS as FEW_ROWS  # the reference's rule, not used here
from reference.ops.matmul import TALL_BLOCK as TALL_BLOCK  # the reference's rule, not used here
from reference.ops.matmul import mul_mat_leading


# --8<-- [start:mul_mat]
def mul_mat(a: mx.array, b: mx.array) -> mx.array:
    """Twin of [`reference.ops.matmul.mul_mat`][reference.ops.matmul.mul_mat].

    Lazy ``mx.matmul``; ``a`` is block-repeated with ``mx.repeat`` (no copy is made when every
    ratio is 1). The shape checks raise the reference's
    [`OpShapeError`][reference.ops.errors.OpShapeError] with the same rule (``ggml_can_mul_mat``).

    Examples:
        >>> import numpy as np
        >>> mul_mat(np.array([[1.0, 0.0], [0.0, 2.0], [1.0, 1.0]]), np.array([[1.0, 2.0]]))
        array([[1, 4, 3]], dtype=float32)
    """
    a, b = as_mx(a), as_mx(b)
    a_lead, b_lead = mul_mat_leading(a.shape, b.shape)
    a = a.reshape(a_lead + a.shape[-2:])  # (..., M, K) with as many dims as b
    for axis, (da, db) in enumerate(zip(a_lead, b_lead, strict=True)):
        if da and db != da:
            a = mx.repeat(a, db // da, axis=axis)  # (..., M, K) with b's leading dims
    return b.reshape(b_lead + b.shape[-2:]) @ mx.swapaxes(a, -1, -2)  # (..., N, M)


# --8<-- [end:mul_mat]
