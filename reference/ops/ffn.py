r"""``ggml_silu``, ``ggml_gelu`` and the gated forms ``ggml_swiglu_split``, ``ggml_geglu_split``.

The feed-forward block of a Llama layer is
$\mathrm{ffn\_down}\big(\mathrm{silu}(\mathrm{ffn\_gate}\,x) \odot \mathrm{ffn\_up}\,x\big)$:
an activation of one projection gates another. The activations:

$$
\mathrm{silu}(x) = \frac{x}{1 + e^{-x}},\qquad
\mathrm{gelu}(x) = \tfrac12 x\Big(1 + \tanh\big(\sqrt{2/\pi}\,x\,(1 + 0.044715\,x^2)\big)\Big),
$$

and the gated (GLU) forms $\mathrm{swiglu}(a, b) = \mathrm{silu}(a) \odot b$,
$\mathrm{geglu}(a, b) = \mathrm{gelu}(a) \odot b$.

``gelu`` is the tanh approximation, the one ``ggml_gelu`` computes (``ggml_gelu_f32`` in
``ggml-cpu/vec.h``); ggml's exact form is the separate op ``ggml_gelu_erf``.

**Divergence (precision).** ggml's CPU backend is compiled with ``GGML_GELU_FP16`` defined
(``vec.h``): for float32 input it returns ``x`` when ``x >= 10``, ``0`` when ``x <= -10``, and
otherwise rounds ``x`` to float16, looks GELU up in a 65536-entry float16 table and converts the
float16 result back. Its GELU is therefore only float16-accurate (relative error up to
about $3 \times 10^{-3}$ where $|\mathrm{gelu}(x)| > 0.01$). The specification computes the
formula in the input dtype; ``geglu`` is affected the same way (``ggml_vec_geglu_f32``).
``silu`` has no table: ggml computes it in float.

**Split and fused forms.** The functions here take the two halves as two arrays, like
``ggml_swiglu_split(ctx, a, b)`` / ``ggml_geglu_split``, which is what ``build_ffn`` uses for
Llama (``LLM_FFN_SILU`` + ``LLM_FFN_PAR``). ggml also has a fused single-tensor form,
``ggml_swiglu(ctx, x)``, for checkpoints that store gate and up as one matrix: it splits ``x``
along its last axis into halves, ``swiglu(x[..., :n], x[..., n:])`` (``ggml_swiglu_swapped``
takes the halves the other way round).
"""

from __future__ import annotations

import numpy as np

from reference.ops.errors import OpShapeError


# --8<-- [start:silu]
def silu(x: np.ndarray) -> np.ndarray:
    r"""``ggml_silu(x)``: $x / (1 + e^{-x})$, also called swish.

    For very negative ``x`` (below about -88 in float32) $e^{-x}$ overflows to ``inf`` and the
    result is ``-0.0``, as in ggml; the overflow warning is silenced on purpose.

    Args:
        x: any shape, floating point.

    Returns:
        Same shape and dtype.

    Examples:
        >>> import numpy as np
        >>> silu(np.array([0.0, 1.0, -1000.0]))
        array([ 0.        ,  0.73105858, -0.        ])
    """
    with np.errstate(over="ignore"):
        return x / (x.dtype.type(1) + np.exp(-x))


# --8<-- [end:silu]


# --8<-- [start:gelu]
def gelu(x: np.ndarray) -> np.ndarray:
    r"""``ggml_gelu(x)``: GELU, tanh approximation.

    $\tfrac12 x (1 + \tanh(\sqrt{2/\pi}\, x (1 + 0.044715 x^2)))$, computed in the input
    dtype. ggml's CPU kernel uses a float16 lookup table instead (see the module docstring).

    Args:
        x: any shape, floating point.

    Returns:
        Same shape and dtype.

    Examples:
        >>> import numpy as np
        >>> gelu(np.array([-1.0, 0.0, 1.0]))
        array([-0.15880801,  0.        ,  0.84119199])
    """
    t = x.dtype.type
    sqrt_2_over_pi = t(np.sqrt(2.0 / np.pi))
    return t(0.5) * x * (t(1) + np.tanh(sqrt_2_over_pi * x * (t(1) + t(0.044715) * x * x)))


# --8<-- [end:gelu]


def check_same_shape(a: np.ndarray, b: np.ndarray, op: str) -> None:
    """The two halves of a gated unit have one shape (``ggml_are_same_shape``).

    Shared with the MLX twin.

    Raises:
        OpShapeError: the shapes differ.

    Examples:
        >>> check_same_shape(np.zeros((2, 3)), np.zeros((3, 2)), "swiglu")  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        reference.ops.errors.OpShapeError: swiglu: a and b must have the same shape, got (2, 3) ...
    """
    if a.shape != b.shape:
        raise OpShapeError(f"{op}: a and b must have the same shape, got {a.shape} and {b.shape}")


# --8<-- [start:swiglu]
def swiglu(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    r"""``ggml_swiglu_split(a, b)``: $\mathrm{silu}(a) \odot b$.

    Args:
        a: the gate projection, e.g. ``(n_tokens, n_ff)``.
        b: the up projection, same shape as ``a``.

    Returns:
        Same shape as ``a``.

    Raises:
        OpShapeError: if the shapes differ.

    Examples:
        >>> import numpy as np
        >>> swiglu(np.array([0.0, 1.0]), np.array([5.0, 2.0]))
        array([0.        , 1.46211716])
    """
    check_same_shape(a, b, "swiglu")
    return silu(a) * b


# --8<-- [end:swiglu]


# --8<-- [start:geglu]
def geglu(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    r"""``ggml_geglu_split(a, b)``: $\mathrm{gelu}(a) \odot b$ (Gemma's feed-forward).

    Args:
        a: the gate projection, e.g. ``(n_tokens, n_ff)``.
        b: the up projection, same shape as ``a``.

    Returns:
        Same shape as ``a``.

    Raises:
        OpShapeError: if the shapes differ.

    Examples:
        >>> import numpy as np
        >>> geglu(np.array([1.0]), np.array([2.0]))
        array([1.68238398])
    """
    check_same_shape(a, b, "geglu")
    return gelu(a) * b


# --8<-- [end:geglu]
