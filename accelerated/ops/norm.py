r"""Twin of [`reference.ops.norm`][reference.ops.norm]: ``ggml_norm`` and ``ggml_rms_norm`` on MLX.

Both use MLX's fused kernels, ``mx.fast.layer_norm`` (no weight, no bias) and
``mx.fast.rms_norm`` (no weight), which compute the same formulas over the last axis.

**Precision.** ggml (and the reference) accumulate the sums in double. MLX accumulates in
float32 (its CPU and Metal kernels keep a float32 running sum for float32 input, and a
float32 sum for float16/bfloat16 input too). For rows of a few thousand elements the
relative difference is around $10^{-7}$, far inside the twin registry's NMSE bound.
"""

from __future__ import annotations

import mlx.core as mx

from accelerated.ops.convert import as_mx


# --8<-- [start:norm]
def norm(x: mx.array, eps: float) -> mx.array:
    r"""Twin of [`reference.ops.norm.norm`][reference.ops.norm.norm].

    ``mx.fast.layer_norm(x, None, None, eps)``: the same mean and biased variance, summed in
    float32 instead of double.

    Examples:
        >>> import numpy as np
        >>> np.allclose(norm(np.array([[1.0, 2.0, 3.0]]), eps=0.0), [[-1.2247449, 0, 1.2247449]])
        True
    """
    return mx.fast.layer_norm(as_mx(x), None, None, eps)  # (..., n)


# --8<-- [end:norm]


# --8<-- [start:rms_norm]
def rms_norm(x: mx.array, eps: float) -> mx.array:
    r"""Twin of [`reference.ops.norm.rms_norm`][reference.ops.norm.rms_norm].

    ``mx.fast.rms_norm(x, None, eps)``: $x / \sqrt{\overline{x^2} + \epsilon}$, the mean
    square summed in float32 instead of double.

    Examples:
        >>> import numpy as np
        >>> np.allclose(rms_norm(np.array([[3.0, 4.0]]), eps=0.0), [[3 / 12.5**0.5, 4 / 12.5**0.5]])
        True
    """
    return mx.fast.rms_norm(as_mx(x), None, eps)  # (..., n)


# --8<-- [end:rms_norm]
