r"""``ggml_tanh`` and logit soft-capping, as Gemma 2 and Gemma 3 build it.

Soft-capping squashes a score $s$ smoothly into $(-c, c)$:

$$
\mathrm{softcap}(s, c) = c \tanh\!\left(\frac{s}{c}\right),
$$

close to the identity for $|s| \ll c$ (its slope at 0 is 1) and never beyond $\pm c$. Gemma 2
caps the attention scores (``attn_logit_softcapping``, $c = 50$) and the final logits
(``final_logit_softcapping``, $c = 30$); Gemma 3 only the final logits, when its config has a
cap.

ggml has no soft-cap op: llama.cpp builds it from three, ``ggml_scale(x, 1.0f / c)``,
``ggml_tanh``, ``ggml_scale(x, c)`` (``build_attn_mha`` in ``src/llama-graph.cpp`` for the
attention scores, the end of ``llm_build_gemma2`` / ``gemma3`` in ``src/models/`` for the
logits). [`softcap`][] is that sequence, with ``1.0f / c`` computed in float32 as ggml does.
"""

from __future__ import annotations

import numpy as np

from reference.ops.elementwise import scale
from reference.ops.errors import OpValueError


# --8<-- [start:tanh]
def tanh(a: np.ndarray) -> np.ndarray:
    r"""``ggml_tanh(a)``: the hyperbolic tangent of every element, in ``a``'s dtype.

    Args:
        a: any shape, floating point.

    Returns:
        $\tanh(a)$, same shape and dtype.

    Examples:
        >>> tanh(np.array([0.0, 1.0, -np.inf]))
        array([ 0.        ,  0.76159416, -1.        ])
    """
    return np.tanh(a)


# --8<-- [end:tanh]


# --8<-- [start:softcap]
def softcap(a: np.ndarray, cap: float) -> np.ndarray:
    r"""Logit soft-capping $c \tanh(a / c)$, as llama.cpp's three ops compute it.

    $$ \mathrm{softcap}(a, c) = \mathrm{scale}\big(\tanh(\mathrm{scale}(a, \mathrm{fl}(1/c))),
       c\big) $$

    where $\mathrm{fl}(1/c)$ is ``1.0f / c`` rounded to float32 (a float32 ``a`` then gets
    exactly ggml's result; a float64 ``a`` the same formula with that factor).

    Args:
        a: scores or logits, any shape.
        cap: the cap $c > 0$ (``f_attn_logit_softcapping`` / ``f_final_logit_softcapping``).

    Returns:
        Same shape and dtype as ``a``, every element in $[-c, c]$.

    Raises:
        OpValueError: if ``cap`` is not a positive finite number (llama.cpp would divide by
            it: a zero cap makes every score $0 \cdot \tanh(\pm\infty) = 0$, or NaN).

    Examples:
        >>> softcap(np.array([0.0, 1.0, 100.0, -1e9]), 30.0).round(4)
        array([  0.    ,   0.9996,  29.9237, -30.    ])
        >>> softcap(np.ones(2), 0.0)  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        reference.ops.errors.OpValueError: softcap: the cap must be a positive ..., got 0.0
    """
    if not (np.isfinite(cap) and cap > 0):
        raise OpValueError(f"softcap: the cap must be a positive finite number, got {cap}")
    inv = float(np.float32(1.0) / np.float32(cap))  # 1.0f / c
    return scale(tanh(scale(a, inv)), cap)


# --8<-- [end:softcap]
