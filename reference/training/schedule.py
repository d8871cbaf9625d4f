r"""The learning rate of each epoch: ``lr_opt`` in ``common/common.cpp``.

``finetune`` takes ``-lr`` ($\mathrm{lr}_0$, default $10^{-5}$), ``-lr-min`` (default $-1$:
no decay), ``-decay-epochs`` (default $-1$) and ``-epochs`` (default 2); ``lr_opt::init()``
runs once after parsing. When $0 < \mathrm{lr}_{min} < \mathrm{lr}_0$ it sets

$$
\begin{aligned}
n_{half} &= \log_2 \frac{\mathrm{lr}_0}{\mathrm{lr}_{min}}, \qquad s = n_{half} / E, \\
E &= \begin{cases} \mathrm{decay\_epochs} & 0 < \mathrm{decay\_epochs} < \mathrm{epochs}\\
  \mathrm{epochs} & \text{otherwise (and decay\_epochs} \leftarrow \mathrm{epochs)}\end{cases}
\end{aligned}
$$

so that the rate halves $n_{half}$ times over $E$ epochs. ``get_lr(epoch)``, constant within an
epoch (``epoch`` counts from 0):

$$
\mathrm{lr}(e) = \begin{cases}
\mathrm{lr}_0 & \mathrm{lr}_{min} \le 0 \\
\mathrm{lr}_{min} & e \ge \mathrm{decay\_epochs} \\
\mathrm{lr}_0 \cdot 0.5^{\,e\,s} & \text{otherwise.}
\end{cases}
$$

Quirks kept as llama.cpp has them: with $\mathrm{lr}_{min} \ge \mathrm{lr}_0 > 0$, ``init``
leaves ``decay_epochs`` and $s = 0$ alone, so the rate is $\mathrm{lr}_{min}$ from epoch
``decay_epochs`` on, and from the start when ``decay_epochs`` is left at $-1$. Everything is
``float`` (``std::log``, ``std::pow`` of floats). ``common_opt_lr_pars`` hands the rate to both
optimizers as $\alpha$, with ``-wd`` as their weight decay, and logs ``"epoch %.2g lr=%.2g"``
each time it is asked (before every optimizer step).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np

from reference.training.errors import ScheduleError
from reference.training.opt import AdamWParams, OptimizerParams, SGDParams

F32 = np.float32


def _logf(x: np.float32) -> np.float32:
    """``std::log`` of a float, correctly rounded."""
    return F32(np.log(np.float64(x)))


def _powf(x: np.float32, y: np.float32) -> np.float32:
    """``std::pow`` of two floats, correctly rounded."""
    return F32(np.power(np.float64(x), np.float64(y)))


# --8<-- [start:LrOpt]
@dataclass(frozen=True)
class LrOpt:
    """``struct lr_opt``: the schedule's flags, and what ``init()`` derives from them.

    Use [`lr_opt_init`][] to build one as ``finetune`` does; ``decay_epochs`` and
    ``scale_epoch`` are then the values after ``init()``.

    Examples:
        >>> LrOpt().lr0, LrOpt().epochs
        (1e-05, 2)
    """

    lr0: float = 1e-5  # -lr: learning rate at epoch 0
    lr_min: float = -1.0  # -lr-min: <= 0 means no decay
    decay_epochs: float = -1.0  # -decay-epochs
    wd: float = 0.0  # -wd
    epochs: int = 2  # -epochs
    scale_epoch: float = 0.0  # halvings per epoch (set by init)
# --8<-- [end:LrOpt]


# --8<-- [start:lr_opt_init]
def lr_opt_init(
    lr0: float = 1e-5,
    lr_min: float = -1.0,
    decay_epochs: float = -1.0,
    wd: float = 0.0,
    epochs: int = 2,
) -> LrOpt:
    """``lr_opt::init()`` on the parsed flags (defaults: ``finetune``'s).

    Raises:
        ScheduleError: if ``epochs`` is negative (an ``unsigned`` flag).

    Examples:
        >>> lr = lr_opt_init(lr0=1e-3, lr_min=1e-4, epochs=10)
        >>> lr.decay_epochs, round(lr.scale_epoch, 6)
        (10.0, 0.332193)
    """
    if epochs < 0:
        raise ScheduleError(f"epochs must be >= 0, got {epochs}")
    lr = LrOpt(float(F32(lr0)), float(F32(lr_min)), float(F32(decay_epochs)), wd, epochs)
    if not 0 < lr.lr_min < lr.lr0:
        return lr
    nhalf = _logf(F32(lr.lr0) / F32(lr.lr_min)) / _logf(F32(2))
    e = F32(epochs)
    if 0 < lr.decay_epochs < e:
        e = F32(lr.decay_epochs)
    return replace(lr, decay_epochs=float(e), scale_epoch=float(nhalf / e))
# --8<-- [end:lr_opt_init]


# --8<-- [start:get_lr]
def get_lr(lr: LrOpt, epoch: int) -> float:
    """``lr_opt::get_lr(epoch)``: the learning rate of epoch ``epoch`` (from 0), a float.

    Examples:
        >>> lr = lr_opt_init(lr0=1e-3, lr_min=1.25e-4, decay_epochs=3, epochs=5)
        >>> [f"{get_lr(lr, e):.3g}" for e in range(5)]
        ['0.001', '0.0005', '0.00025', '0.000125', '0.000125']
        >>> get_lr(lr_opt_init(lr0=1e-3), 7)   # no -lr-min: constant
        0.0010000000474974513
    """
    if lr.lr_min <= 0:
        return lr.lr0
    if F32(epoch) >= F32(lr.decay_epochs):
        return lr.lr_min
    return float(F32(lr.lr0) * _powf(F32(0.5), F32(epoch) * F32(lr.scale_epoch)))
# --8<-- [end:get_lr]


# --8<-- [start:lr_log_line]
def lr_log_line(epoch: int, lr: float) -> str:
    r"""The line ``get_lr`` logs (``LOG_INF("epoch %.2g lr=%.2g\n", ...)``).

    Examples:
        >>> lr_log_line(0, 1e-5)
        'epoch 0 lr=1e-05\n'
    """
    return f"epoch {epoch:.2g} lr={lr:.2g}\n"
# --8<-- [end:lr_log_line]


# --8<-- [start:opt_lr_pars]
def opt_lr_pars(lr: LrOpt, epoch: int) -> OptimizerParams:
    r"""``common_opt_lr_pars``: ggml-opt's defaults with $\alpha$ = ``get_lr(epoch)`` and
    ``wd`` = ``-wd``, for both optimizers.

    Examples:
        >>> p = opt_lr_pars(lr_opt_init(lr0=2e-4, wd=0.1), 0)
        >>> round(p.adamw.alpha, 8), p.sgd.wd, p.adamw.beta2
        (0.0002, 0.1, 0.999)
    """
    alpha = get_lr(lr, epoch)
    return OptimizerParams(
        adamw=AdamWParams(alpha=alpha, wd=lr.wd), sgd=SGDParams(alpha=alpha, wd=lr.wd)
    )
# --8<-- [end:opt_lr_pars]
