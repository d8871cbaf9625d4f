r"""ggml-opt's optimizers, the trainable-parameter filter and gradient accumulation.

**What is trained** (``llama_set_param`` in ``src/llama-context.cpp``): every model tensor of
type F32 that the user's ``param_filter`` accepts, except ``token_embd.weight`` and
``rope_freqs.weight`` (both marked FIXME there). Norm gains, biases, every projection of every
block, ``output_norm`` and ``output`` are trained; quantized and F16 tensors are not. With
**tied embeddings** there is no ``output.weight``: llama.cpp's ``model->output`` is the
``token_embd.weight`` tensor itself (``TENSOR_DUPLICATED``), named ``token_embd.weight``, so
the name check skips it and the lm_head stays frozen.

**Gradient accumulation.** ``opt_init`` sets ``opt_period = n_batch / n_ubatch``. Every
ubatch is one ``ggml_opt_eval``: its loss is the ubatch's mean cross-entropy scaled by
$1/\mathrm{opt\_period}$, and its gradient is added into one accumulator per parameter; the
accumulators start from zero with each period, and the ``opt_period``-th ubatch of a period
runs the optimizer step on their sum, which is the gradient of the mean loss over the whole
period:

$$
g = \sum_{u=1}^{\mathrm{opt\_period}} \nabla \frac{L_u}{\mathrm{opt\_period}}
  = \nabla \frac{1}{\mathrm{opt\_period}} \sum_u L_u .
$$

(In llama.cpp ``n_batch <= n_ctx``, so ``opt_period > 1`` needs ``n_ubatch < n_ctx``: the mode in
which K and V get no gradient. When every projection is trained, ``opt_period`` is 1.)

**Divergence: llama.cpp never zeroes the accumulators.** ``llama_opt_epoch`` builds its graphs
anew for every ubatch (non-static graphs), so ``ggml_opt_build`` always accumulates into
persistent tensors, zeroed only when they are first allocated; the reset at the start of a
period (``ggml_opt_alloc``: ``ggml_graph_reset(opt_ctx->gb_grad)``) is a no-op because
``ggml_opt_eval`` has already set ``gb_grad`` to NULL. The $t$-th optimizer step of a run
therefore uses $\sum_{s \le t} g_s$, every gradient since ``llama_opt_init``. The
specification zeroes the accumulators with each period, as ggml-opt's code intends (and as its
static graphs do); ``tests/laws/test_training_opt.py`` runs llama.cpp and shows both facts: one
step equals the specification's, two steps equal the cumulative variant.

**AdamW** (``ggml_compute_forward_opt_step_adamw_f32``; ``iter`` counts optimizer steps from
1, ``ggml_opt_eval`` passes the bias corrections):

$$
\begin{aligned}
m &\leftarrow \beta_1 m + (1 - \beta_1)\, g, \qquad
v \leftarrow \beta_2 v + (1 - \beta_2)\, g^2, \\
\hat\beta_1 &= \frac{1}{1 - \beta_1^{\,iter}}, \qquad
  \hat\beta_2 = \frac{1}{1 - \beta_2^{\,iter}}, \\
w &\leftarrow w\,(1 - \alpha\,\mathrm{wd}) - \alpha\,
  \frac{m \hat\beta_1}{\sqrt{v \hat\beta_2} + \epsilon} .
\end{aligned}
$$

The decay is decoupled and scaled by $\alpha$; $\epsilon$ is outside the square root.

**SGD** (``ggml_compute_forward_opt_step_sgd_f32``; the parameters tensor holds
$[\alpha, \mathrm{wd}]$, wd itself, and the kernel computes the keep factor):

$$ w \leftarrow w\,(1 - \alpha\,\mathrm{wd}) - \alpha\, g . $$

No momentum. All of it in float (the weights' dtype here: float32 as ggml, float64 for
property tests), including ``powf`` for the corrections.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from reference.ops.errors import OpShapeError
from reference.training.errors import OptParamsError

OPTIMIZERS = ("adamw", "sgd")  # ggml_opt_optimizer_name of GGML_OPT_OPTIMIZER_TYPE_*


# --8<-- [start:OptimizerParams]
@dataclass(frozen=True)
class AdamWParams:
    """``ggml_opt_optimizer_params.adamw``, with ``ggml_opt_get_default_optimizer_params``'s
    defaults."""

    alpha: float = 1e-3  # learning rate
    beta1: float = 0.9
    beta2: float = 0.999
    eps: float = 1e-8
    wd: float = 0.0  # weight decay, in [0, 1]


@dataclass(frozen=True)
class SGDParams:
    """``ggml_opt_optimizer_params.sgd``."""

    alpha: float = 1e-3
    wd: float = 0.0


@dataclass(frozen=True)
class OptimizerParams:
    """``ggml_opt_optimizer_params``: what ``get_opt_pars`` returns before every step.

    Examples:
        >>> OptimizerParams().adamw.beta2, OptimizerParams(sgd=SGDParams(wd=0.1)).sgd.alpha
        (0.999, 0.001)
    """

    adamw: AdamWParams = field(default_factory=AdamWParams)
    sgd: SGDParams = field(default_factory=SGDParams)
# --8<-- [end:OptimizerParams]


# --8<-- [start:check_optimizer_params]
def check_optimizer_params(params: OptimizerParams, optimizer: str) -> None:
    r"""``ggml_opt_eval``'s asserts on the parameters of the optimizer in use.

    AdamW: $\alpha > 0$, $\beta_1, \beta_2 \in [0, 1]$, $\epsilon \ge 0$,
    $\mathrm{wd} \in [0, 1]$. SGD: $\alpha > 0$, $\mathrm{wd} \in [0, 1]$. (NaN fails every
    comparison, as in C.)

    Raises:
        OptParamsError: naming the first value out of its range, or an unknown optimizer.

    Examples:
        >>> check_optimizer_params(OptimizerParams(sgd=SGDParams(wd=2.0)), "adamw")   # sgd unused
        >>> check_optimizer_params(OptimizerParams(sgd=SGDParams(wd=2.0)), "sgd")
        Traceback (most recent call last):
        ...
        reference.training.errors.OptParamsError: sgd.wd must be in [0, 1], got 2.0
    """
    if optimizer not in OPTIMIZERS:
        raise OptParamsError(f"optimizer must be one of {OPTIMIZERS}, got {optimizer!r}")
    p = params.adamw if optimizer == "adamw" else params.sgd
    checks = [("alpha", p.alpha > 0.0, "> 0"), ("wd", 0.0 <= p.wd <= 1.0, "in [0, 1]")]
    if optimizer == "adamw":
        checks[1:1] = [
            ("beta1", 0.0 <= p.beta1 <= 1.0, "in [0, 1]"),
            ("beta2", 0.0 <= p.beta2 <= 1.0, "in [0, 1]"),
            ("eps", p.eps >= 0.0, ">= 0"),
        ]
    for name, ok, domain in checks:
        if not ok:
            raise OptParamsError(f"{optimizer}.{name} must be {domain}, got {getattr(p, name)}")
# --8<-- [end:check_optimizer_params]


# --8<-- [start:adamw_bias_corrections]
def adamw_bias_corrections(
    beta1: float, beta2: float, iter: int, dtype=np.float32
) -> tuple[np.floating, np.floating]:
    r"""$\hat\beta_1 = 1/(1 - \beta_1^{iter})$ and $\hat\beta_2 = 1/(1 - \beta_2^{iter})$ in float.

    ``ggml_opt_eval``: ``1.0f / (1.0f - powf(beta, iter))``; ``powf`` is evaluated in double and
    rounded once (a correctly rounded C library).

    Examples:
        >>> [round(float(b), 4) for b in adamw_bias_corrections(0.9, 0.999, 1)]   # 1 - 0.999f
        [10.0, 1000.0129]
        >>> [round(float(b), 4) for b in adamw_bias_corrections(0.9, 0.999, 2)]
        [5.2632, 500.2599]
    """
    t = np.dtype(dtype).type

    def correction(beta: float) -> np.floating:
        powf = t(np.power(np.float64(t(beta)), np.float64(t(iter))))
        return t(1) / (t(1) - powf)

    return correction(beta1), correction(beta2)
# --8<-- [end:adamw_bias_corrections]


def _check_same_shapes(op: str, w: np.ndarray, *others: np.ndarray) -> None:
    """``GGML_ASSERT(ggml_are_same_shape(src0, src0_grad))`` and friends, as an exception."""
    if any(np.shape(o) != w.shape for o in others):
        raise OpShapeError(f"{op}: every operand must have the weights' shape {w.shape}, got "
                           f"{[np.shape(o) for o in others]}")


# --8<-- [start:opt_step_adamw]
def opt_step_adamw(
    w: np.ndarray,
    g: np.ndarray,
    m: np.ndarray,
    v: np.ndarray,
    params: AdamWParams,
    beta1h: float,
    beta2h: float,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    r"""``ggml_opt_step_adamw``: one AdamW update of one tensor (see the module docstring).

    Args:
        w: the weights, any shape.
        g: their (accumulated) gradient, same shape.
        m: first moment, same shape (zeros before the first step).
        v: second moment, same shape.
        params: $\alpha, \beta_1, \beta_2, \epsilon, \mathrm{wd}$.
        beta1h: $\hat\beta_1$ from [`adamw_bias_corrections`][].
        beta2h: $\hat\beta_2$.

    Returns:
        The new ``(w, m, v)``, in ``w``'s dtype (the inputs are not modified).

    Raises:
        OpShapeError: if ``g``, ``m`` or ``v`` is not ``w``'s shape (ggml asserts).

    Examples:
        >>> w, m, v = (np.ones(2, np.float32), np.zeros(2, np.float32), np.zeros(2, np.float32))
        >>> b1h, b2h = adamw_bias_corrections(0.9, 0.999, 1)
        >>> g = np.array([0.5, -2.0], np.float32)
        >>> opt_step_adamw(w, g, m, v, AdamWParams(alpha=0.1), b1h, b2h)[0]
        array([0.9, 1.1], dtype=float32)
    """
    _check_same_shapes("opt_step_adamw", w, g, m, v)
    t = w.dtype.type
    alpha, beta1, beta2, eps = t(params.alpha), t(params.beta1), t(params.beta2), t(params.eps)
    keep = t(1) - alpha * t(params.wd)
    m = m * beta1 + g * (t(1) - beta1)
    v = v * beta2 + g * g * (t(1) - beta2)
    mh = m * t(beta1h)
    vh = np.sqrt(v * t(beta2h)) + eps
    return w * keep - alpha * mh / vh, m, v
# --8<-- [end:opt_step_adamw]


# --8<-- [start:opt_step_sgd]
def opt_step_sgd(w: np.ndarray, g: np.ndarray, params: SGDParams) -> np.ndarray:
    r"""``ggml_opt_step_sgd``: $w (1 - \alpha\,\mathrm{wd}) - \alpha g$, in ``w``'s dtype.

    Raises:
        OpShapeError: if ``g`` is not ``w``'s shape.

    Examples:
        >>> opt_step_sgd(np.array([1.0, 2.0]), np.array([10.0, 0.0]), SGDParams(alpha=0.1, wd=0.5))
        array([-0.05,  1.9 ])
    """
    _check_same_shapes("opt_step_sgd", w, g)
    t = w.dtype.type
    keep = t(1) - t(params.alpha) * t(params.wd)
    return w * keep - t(params.alpha) * g
# --8<-- [end:opt_step_sgd]


# --8<-- [start:trainable_params]
def trainable_params(
    weights: dict, param_filter: Callable[[str, np.ndarray], bool] | None = None
) -> list[str]:
    """The names of the tensors ``llama_opt_init`` marks as parameters, sorted.

    F32 tensors (float64 arrays stand for F32 in property tests) accepted by ``param_filter``
    (``llama_opt_param_filter``; default: all, ``llama_opt_param_filter_all``), except
    ``token_embd.weight`` and ``rope_freqs.weight``. With tied embeddings the lm_head is
    ``token_embd.weight`` and is not trained.

    Examples:
        >>> from reference.testing import tiny_hparams, random_weights
        >>> names = trainable_params(random_weights(tiny_hparams(n_layer=1, tied=True)))
        >>> "token_embd.weight" in names, "output.weight" in names, len(names)
        (False, False, 10)
    """
    def is_f32(t) -> bool:
        return isinstance(t, np.ndarray) and t.dtype in (np.float32, np.float64)

    frozen = ("token_embd.weight", "rope_freqs.weight")  # FIXME in llama_set_param
    return sorted(
        name for name, t in weights.items()
        if is_f32(t) and name not in frozen and (param_filter is None or param_filter(name, t))
    )
# --8<-- [end:trainable_params]


# --8<-- [start:OptContext]
class OptContext:
    """The optimizer state of ggml-opt for one model: ``iter``, ``opt_i``, accumulators, momenta.

    Feed it one ubatch's gradients at a time with
    [`eval_backward`][reference.training.opt.OptContext.eval_backward]; every
    ``opt_period``-th call runs the optimizer on the accumulated gradients and updates the
    trainable entries of ``weights`` (new arrays replace the old ones, as ggml updates the
    model's tensors in place).

    Args:
        weights: GGUF-named weights; the trainable ones are chosen by [`trainable_params`][].
        optimizer: ``"adamw"`` (default) or ``"sgd"``.
        opt_period: ubatches per optimizer step (``n_batch / n_ubatch``).
        get_opt_pars: called before every step (``ggml_opt_get_optimizer_params``);
            default: [`OptimizerParams`][]'s defaults.
        param_filter: ``llama_opt_param_filter``.

    Raises:
        OptParamsError: unknown optimizer or ``opt_period < 1``.

    Examples:
        >>> w = {"output_norm.weight": np.ones(2, np.float32)}
        >>> ctx = OptContext(w, "sgd", opt_period=2,
        ...                  get_opt_pars=lambda: OptimizerParams(sgd=SGDParams(alpha=0.5)))
        >>> g = {"output_norm.weight": np.array([1.0, -1.0], np.float32)}
        >>> ctx.eval_backward(w, g), w["output_norm.weight"]       # first ubatch: accumulate
        (False, array([1., 1.], dtype=float32))
        >>> ctx.eval_backward(w, g), w["output_norm.weight"], ctx.iter
        (True, array([0., 2.], dtype=float32), 2)

    The array work goes through four class attributes, which the MLX twin replaces and
    nothing else: `trainable` ([`trainable_params`][]), `step_adamw`, `step_sgd` (the kernels)
    and `zeros_like`; `settle` runs after every ubatch (here nothing: NumPy has computed).
    """

    trainable = staticmethod(trainable_params)
    step_adamw = staticmethod(opt_step_adamw)
    step_sgd = staticmethod(opt_step_sgd)
    zeros_like = staticmethod(np.zeros_like)

    def settle(self, weights: dict) -> None:
        """After a ubatch: nothing to wait for (the MLX twin evaluates its lazy arrays)."""

    def __init__(
        self,
        weights: dict,
        optimizer: str = "adamw",
        opt_period: int = 1,
        get_opt_pars: Callable[[], OptimizerParams] | None = None,
        param_filter: Callable[[str, np.ndarray], bool] | None = None,
    ):
        if optimizer not in OPTIMIZERS:
            raise OptParamsError(f"optimizer must be one of {OPTIMIZERS}, got {optimizer!r}")
        if opt_period < 1:
            raise OptParamsError(f"opt_period must be at least 1, got {opt_period}")
        self.optimizer = optimizer
        self.opt_period = opt_period
        self.get_opt_pars = get_opt_pars or OptimizerParams
        self.params = self.trainable(weights, param_filter)
        self.iter = 1  # optimizer steps taken + 1 (AdamW's bias corrections)
        self.opt_i = 0  # ubatches into the current period
        zeros = {name: self.zeros_like(weights[name]) for name in self.params}
        self.grad_accs = dict(zeros)
        self.m = dict(zeros) if optimizer == "adamw" else {}
        self.v = dict(zeros) if optimizer == "adamw" else {}

    def eval_backward(self, weights: dict, grads: dict) -> bool:
        """One ubatch: accumulate its gradients; at the end of a period, step.

        ``grads`` must hold every trainable name (a missing one means the graph gave it no
        gradient: it counts as zero, as ggml's zeroed accumulator). Returns whether the
        optimizer stepped.

        Raises:
            OptParamsError: if ``get_opt_pars()`` returns values out of range; nothing has
                changed then (not even the accumulators).
            OpShapeError: if a gradient does not have its tensor's shape (checked first).
        """
        for name in self.params:
            if name in grads:
                _check_same_shapes(f"gradient of {name}", weights[name], grads[name])
        stepping = (self.opt_i + 1) % self.opt_period == 0
        pars = self.get_opt_pars() if stepping else None
        if stepping:
            check_optimizer_params(pars, self.optimizer)
        for name in self.params:
            if self.opt_i == 0:
                self.grad_accs[name] = self.zeros_like(weights[name])  # a new period
            if name in grads:
                self.grad_accs[name] = self.grad_accs[name] + grads[name]
        if stepping:
            self._step(weights, pars)
        self.settle(weights)
        self.opt_i = (self.opt_i + 1) % self.opt_period
        return stepping

    def _step(self, weights: dict, pars: OptimizerParams) -> None:
        """The optimizer over every trainable tensor, then ``iter += 1``."""
        if self.optimizer == "adamw":
            dtype = np.float32  # ggml's float; a float64 model keeps its own
            if self.params and isinstance(weights[self.params[0]], np.ndarray):
                dtype = weights[self.params[0]].dtype
            b1h, b2h = adamw_bias_corrections(pars.adamw.beta1, pars.adamw.beta2, self.iter, dtype)
            for name in self.params:
                weights[name], self.m[name], self.v[name] = self.step_adamw(
                    weights[name], self.grad_accs[name], self.m[name], self.v[name],
                    pars.adamw, b1h, b2h,
                )
        else:
            for name in self.params:
                weights[name] = self.step_sgd(weights[name], self.grad_accs[name], pars.sgd)
        self.iter += 1
# --8<-- [end:OptContext]
