r"""``ggml_norm`` and ``ggml_rms_norm``: normalization over the last axis (ggml's rows).

Both ops normalize every row (the last axis, ggml's ``ne[0]``) of length $n$ on its own and
have no weight: the model multiplies by its norm weight afterwards with ``ggml_mul`` (and adds
a bias with ``ggml_add`` for layer norm).

Layer norm without weight (``ggml_norm``):

$$
\mu = \frac{1}{n}\sum_i x_i,\qquad
\sigma^2 = \frac{1}{n}\sum_i (x_i - \mu)^2,\qquad
\mathrm{norm}(x)_i = \frac{x_i - \mu}{\sqrt{\sigma^2 + \epsilon}}.
$$

RMS norm (``ggml_rms_norm``, Llama's norm):

$$
\mathrm{rms\_norm}(x)_i = \frac{x_i}{\sqrt{\frac{1}{n}\sum_j x_j^2 + \epsilon}}.
$$

**Precision, as in ggml's CPU kernels** (``ggml_compute_forward_norm_f32`` and
``ggml_compute_forward_rms_norm_f32`` in ``ggml-cpu/ops.cpp``): the *sums* are accumulated in
``ggml_float`` (double), everything else is float. For ``rms_norm`` each square $x_i^2$ is
computed in float, summed in double, the mean is rounded to float, and
$1/\sqrt{\text{mean} + \epsilon}$ is computed in float and multiplies $x$. For ``norm`` the sum
of $x$ is accumulated in double and rounded to float (``ggml_vec_sum_f32``), the mean is
computed in float, $x - \mu$ in float, the squares in float summed in double
(``ggml_vec_cvar_f32``), the variance rounded to float. The functions below do the same,
with "float" meaning the input dtype (so float64 inputs are computed wholly in float64).
"""

from __future__ import annotations

import numpy as np


def _sum_wide(x: np.ndarray) -> np.ndarray:
    """Sum over the last axis accumulated in double (ggml_float), keepdims."""
    return np.sum(x, axis=-1, dtype=np.float64, keepdims=True)  # (..., 1)


# --8<-- [start:norm]
def norm(x: np.ndarray, eps: float) -> np.ndarray:
    r"""``ggml_norm(x, eps)``: layer norm of every row, without weight or bias.

    Args:
        x: ``(..., n)``, e.g. ``(n_tokens, n_embd)``; floating point.
        eps: $\epsilon \ge 0$ added to the variance (``f_norm_eps`` in ``llama_hparams``).

    Returns:
        $(x - \mu) / \sqrt{\sigma^2 + \epsilon}$ per row, same shape and dtype as ``x``.

    Examples:
        >>> import numpy as np
        >>> norm(np.array([[1.0, 2.0, 3.0]]), eps=0.0) * np.sqrt(2 / 3)
        array([[-1.,  0.,  1.]])
    """
    dtype = x.dtype.type
    n = x.shape[-1]
    mean = _sum_wide(x).astype(x.dtype) / dtype(n)  # (..., 1) float sum, float mean
    y = x - mean  # (..., n)
    variance = (_sum_wide(y * y) / n).astype(x.dtype)  # (..., 1) squares summed in double
    return y * (dtype(1) / np.sqrt(variance + dtype(eps)))  # (..., n)


# --8<-- [end:norm]


# --8<-- [start:rms_norm]
def rms_norm(x: np.ndarray, eps: float) -> np.ndarray:
    r"""``ggml_rms_norm(x, eps)``: every row divided by its root mean square.

    Args:
        x: ``(..., n)``, e.g. ``(n_tokens, n_embd)``; floating point.
        eps: $\epsilon \ge 0$ added to the mean square (``f_norm_rms_eps``).

    Returns:
        $x / \sqrt{\overline{x^2} + \epsilon}$ per row, same shape and dtype as ``x``.

    Examples:
        >>> import numpy as np
        >>> rms_norm(np.array([[3.0, 4.0]]), eps=0.0) * np.sqrt(12.5)
        array([[3., 4.]])
    """
    dtype = x.dtype.type
    mean = (_sum_wide(x * x) / x.shape[-1]).astype(x.dtype)  # (..., 1) squares summed in double
    return x * (dtype(1) / np.sqrt(mean + dtype(eps)))  # (..., n)


# --8<-- [end:rms_norm]
