r"""Twin of [`reference.training.opt`][reference.training.opt]: ggml-opt's AdamW and SGD steps as
MLX ops, and the optimizer state on MLX.

The formulas are ggml's (``ggml_compute_forward_opt_step_adamw_f32`` /
``_sgd_f32``), operation for operation, in float32 — not ``mlx.optimizers``' ``AdamW``, which
differs in three places: it folds the bias corrections into the learning rate, decays the
weights *before* the update with ``1 - lr * wd`` applied separately, and puts $\epsilon$ after
its own corrected square root; with the same operations in the same order every step here
rounds as ggml's does. The host-side pieces (the parameter classes, their checks, the bias
corrections computed once per step, the trainable-parameter rule) are the reference's; the
moments and the gradient accumulators are ``mx.array``.
"""

from __future__ import annotations

from collections.abc import Callable

import mlx.core as mx
import numpy as np

import reference.training.opt as ref_opt
from reference.ops.errors import OpShapeError
from reference.training.opt import (  # host-side, imported as they are
    OPTIMIZERS,
    AdamWParams,
    OptimizerParams,
    SGDParams,
    adamw_bias_corrections,
    check_optimizer_params,
)

__all__ = [
    "OPTIMIZERS",
    "AdamWParams",
    "OptContext",
    "OptimizerParams",
    "SGDParams",
    "adamw_bias_corrections",
    "check_optimizer_params",
    "opt_step_adamw",
    "opt_step_sgd",
    "trainable_params",
]

F32 = np.float32


def _check_same_shapes(op: str, w: mx.array, *others: mx.array) -> None:
    """``GGML_ASSERT(ggml_are_same_shape(src0, src0_grad))`` and friends, as an exception."""
    if any(tuple(o.shape) != tuple(w.shape) for o in others):
        raise OpShapeError(f"{op}: every operand must have the weights' shape {tuple(w.shape)}, "
                           f"got {[tuple(o.shape) for o in others]}")


def _f(x) -> float:
    """A host scalar rounded to float32 (exact as a Python float, so MLX keeps it)."""
    return float(F32(x))


# --8<-- [start:opt_step_adamw]
def opt_step_adamw(
    w: mx.array,
    g: mx.array,
    m: mx.array,
    v: mx.array,
    params: AdamWParams,
    beta1h: float,
    beta2h: float,
) -> tuple[mx.array, mx.array, mx.array]:
    r"""Twin of [`reference.training.opt.opt_step_adamw`][reference.training.opt.opt_step_adamw].
    float32 MLX ops, lazy.

    Examples:
        >>> w, m, v = mx.ones(2), mx.zeros(2), mx.zeros(2)
        >>> b1h, b2h = adamw_bias_corrections(0.9, 0.999, 1)
        >>> opt_step_adamw(w, mx.array([0.5, -2.0]), m, v, AdamWParams(alpha=0.1), b1h, b2h)[0]
        array([0.9, 1.1], dtype=float32)
    """
    w, g, m, v = (mx.array(a).astype(mx.float32) for a in (w, g, m, v))
    _check_same_shapes("opt_step_adamw", w, g, m, v)
    alpha, beta1, beta2, eps = F32(params.alpha), F32(params.beta1), F32(params.beta2), F32(
        params.eps)
    keep = _f(F32(1) - alpha * F32(params.wd))
    m = m * _f(beta1) + g * _f(F32(1) - beta1)
    v = v * _f(beta2) + g * g * _f(F32(1) - beta2)
    mh = m * _f(beta1h)
    vh = mx.sqrt(v * _f(beta2h)) + _f(eps)
    return w * keep - _f(alpha) * mh / vh, m, v
# --8<-- [end:opt_step_adamw]


# --8<-- [start:opt_step_sgd]
def opt_step_sgd(w: mx.array, g: mx.array, params: SGDParams) -> mx.array:
    r"""Twin of [`reference.training.opt.opt_step_sgd`][reference.training.opt.opt_step_sgd].
    float32 MLX ops, lazy.

    Examples:
        >>> opt_step_sgd(mx.array([1.0, 2.0]), mx.array([10.0, 0.0]), SGDParams(alpha=0.1, wd=0.5))
        array([-0.05, 1.9], dtype=float32)
    """
    w, g = mx.array(w).astype(mx.float32), mx.array(g).astype(mx.float32)
    _check_same_shapes("opt_step_sgd", w, g)
    keep = _f(F32(1) - F32(params.alpha) * F32(params.wd))
    return w * keep - _f(params.alpha) * g
# --8<-- [end:opt_step_sgd]


def _is_f32(t) -> bool:
    """An F32 tensor: a float32 ``mx.array``, or a float32/float64 NumPy array."""
    if isinstance(t, mx.array):
        return t.dtype == mx.float32
    return isinstance(t, np.ndarray) and t.dtype in (np.float32, np.float64)


# --8<-- [start:trainable_params]
def trainable_params(
    weights: dict, param_filter: Callable[[str, np.ndarray], bool] | None = None
) -> list[str]:
    """Twin of [`reference.training.opt.trainable_params`][reference.training.opt.trainable_params].
    float32 ``mx.array`` count as F32.

    Examples:
        >>> trainable_params({"token_embd.weight": mx.ones(2), "output_norm.weight": mx.ones(2),
        ...                   "x": mx.ones(2, dtype=mx.int32)})
        ['output_norm.weight']
    """
    frozen = ("token_embd.weight", "rope_freqs.weight")  # FIXME in llama_set_param
    return sorted(
        name for name, t in weights.items()
        if _is_f32(t) and name not in frozen and (param_filter is None or param_filter(name, t))
    )
# --8<-- [end:trainable_params]


# --8<-- [start:OptContext]
class OptContext(ref_opt.OptContext):
    """Twin of [`reference.training.opt.OptContext`][reference.training.opt.OptContext]: the
    reference's counters and rules, inherited; only the arrays are MLX's (the filter, the
    kernels and the zeros), and every ubatch ends with ``mx.eval`` of the accumulators, moments
    and updated weights, so the graph never grows across steps.

    Examples:
        >>> w = {"output_norm.weight": mx.ones(2)}
        >>> ctx = OptContext(w, "sgd", opt_period=2,
        ...                  get_opt_pars=lambda: OptimizerParams(sgd=SGDParams(alpha=0.5)))
        >>> g = {"output_norm.weight": mx.array([1.0, -1.0])}
        >>> ctx.eval_backward(w, g), w["output_norm.weight"].tolist()
        (False, [1.0, 1.0])
        >>> ctx.eval_backward(w, g), w["output_norm.weight"].tolist(), ctx.iter
        (True, [0.0, 2.0], 2)
    """

    trainable = staticmethod(trainable_params)
    step_adamw = staticmethod(opt_step_adamw)
    step_sgd = staticmethod(opt_step_sgd)

    @staticmethod
    def zeros_like(w: mx.array) -> mx.array:
        """A float32 zero tensor of ``w``'s shape (an accumulator or a moment)."""
        return mx.zeros(w.shape, mx.float32)

    def settle(self, weights: dict) -> None:
        """Evaluate what the ubatch changed."""
        mx.eval(self.grad_accs, self.m, self.v, [weights[n] for n in self.params])
# --8<-- [end:OptContext]
