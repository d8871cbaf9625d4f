r"""LoRA: low-rank adapters trained with ggml-opt's optimizers, in llama.cpp's adapter format.

**What llama.cpp does with an adapter** (``llama_adapter_lora_init_impl`` in
``src/llama-adapter.cpp``, ``llm_graph_context::build_lora_mm`` in ``src/llama-graph.cpp``).
An adapter is a GGUF file with ``general.type = "adapter"``, ``general.architecture`` equal to
the model's, ``adapter.type = "lora"`` and ``adapter.lora.alpha`` (FLOAT32), and, for every
adapted weight ``<base>`` (a GGUF tensor name such as ``blk.0.attn_q.weight``), two F32
tensors ``<base>.lora_a`` and ``<base>.lora_b``. In NumPy order (ggml's ``ne`` reversed; the
same shapes as PEFT's ``lora_A.weight`` / ``lora_B.weight``), for $W$ of shape
``(n_out, n_in)`` and rank $r$:

$$ A \in \mathbb{R}^{r \times n_{in}} \ (\texttt{ne} = [n_{in}, r]), \qquad
   B \in \mathbb{R}^{n_{out} \times r} \ (\texttt{ne} = [r, n_{out}]). $$

Every matmul of the graph that goes through ``build_lora_mm`` (the Q/K/V and output
projections, the three FFN matrices, the lm_head) adds the adapter's term before its bias:

$$ y = W x + s\, B (A x), \qquad
   s = \begin{cases} \mathrm{adapter\_scale} \cdot \alpha / r & \alpha \ne 0 \\
   \mathrm{adapter\_scale} & \alpha = 0 \end{cases} $$

with $r$ = ``lora_b->ne[0]`` per weight (``llama_adapter_lora_weight::get_scale``, in float)
and ``adapter_scale`` the scale given to ``llama_set_adapters_lora`` (llama-cpp-python's
``lora_scale``, default 1). A missing ``adapter.lora.alpha`` reads as 0, so $s$ is the
adapter scale alone. ``llama-export-lora`` merges the same term into the weight:
$W' = W + s\,(BA)$ ([`merge_lora_weight`][]).

**Per matmul or merged.** $W x + s B(Ax) = (W + s BA) x$ exactly in real arithmetic; in float
the two differ by rounding only. The specification trains and evaluates the adapted model
with the merged weights $W'$ ([`lora_weights`][]): the forward and the backward of
[`reference.training.llama_grad`][reference.training.llama_grad] then run unchanged, and the
gradient of every $W'$ they return gives the adapter's gradient by the chain rule
([`lora_grads`][]). [`build_lora_mm`][] writes llama.cpp's per-matmul form out, and
``tests/laws/test_lora.py`` holds both to each other; ``tests/oracle/test_lora.py`` holds our
adapted logits to llama.cpp applying a file that [`save_lora_gguf`][] wrote.

**Training.** llama.cpp at the pinned commit applies adapters but does not train them
(``examples/training/finetune.cpp`` trains the model's F32 tensors). The specification trains
the adapters with ggml-opt's own AdamW / SGD kernels and gradient accumulation
([`reference.training.opt.OptContext`][reference.training.opt.OptContext]) over the tensors
$A$ and $B$ only; the base weights are frozen. Initialisation is PEFT's (and mlx-lm's):
$B = 0$, so the adapted model starts equal to the base model, and
$A \sim \mathcal{U}(-1/\sqrt{n_{in}}, 1/\sqrt{n_{in}})$ (``kaiming_uniform_(a=sqrt(5))``),
drawn in float64 from ``numpy.random.default_rng(seed)``, weight after weight in
[`lora_targets`][]'s order, then cast to the model's dtype.

**The API** (what ``llamaref finetune --lora-rank/--lora-alpha/--lora-out`` calls):

- [`init_lora`][]`(weights, hparams, rank, alpha, targets, seed)` -> [`LoraAdapter`][];
- [`lora_weights`][]`(weights, adapter)`: the adapted model's weight dict ($W'$ for every
  target, the other tensors shared), for
  [`train_forward`][reference.training.llama_grad.train_forward] or
  [`loss_and_grads`][reference.training.llama_grad.loss_and_grads];
- [`lora_grads`][]`(grads, adapter)`: $\partial L/\partial A$, $\partial L/\partial B$ from
  the gradients of the $W'$; [`lora_loss_and_grads`][] does both steps;
- [`LoraOptContext`][]: an ``OptContext`` over the adapter; its ``eval_backward(weights,
  grads)`` takes ``loss_and_grads``' gradients, steps the adapter and refreshes the $W'$ in
  ``weights``, so [`opt_epoch`][reference.training.epoch.opt_epoch] runs LoRA unchanged;
- [`merge_lora`][]`(weights, adapter)`: the full model with $W + sBA$ (``llama-export-lora``);
- [`save_lora_gguf`][]`(path, adapter)` / [`load_lora_gguf`][]`(path, weights, hparams)`.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
from gguf import GGUFValueType

from reference.gguf import GGUFError, GGUFValue, read_gguf, write_gguf
from reference.hparams import LlamaHParams
from reference.models.llama import get_weight, model_dtype
from reference.ops import add, mul_mat, scale
from reference.training.errors import TrainingError
from reference.training.llama_grad import loss_and_grads
from reference.training.opt import OptContext, OptimizerParams

# --8<-- [start:LORA_TARGETS]
#: The matrices that can carry an adapter: every ``build_lora_mm`` of the llama/qwen2 graph.
LORA_TARGET_KINDS = (
    "attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down", "output",
)
#: The default: the attention and FFN projections of every block (not the lm_head).
LORA_TARGETS = LORA_TARGET_KINDS[:-1]
LORA_A, LORA_B = ".lora_a", ".lora_b"  # the suffixes llama.cpp pairs tensors by
# --8<-- [end:LORA_TARGETS]


# --8<-- [start:LoraError]
class LoraError(TrainingError, ValueError):
    """LoRA arguments out of range, or an adapter that does not fit its model."""


class LoraFileError(LoraError, GGUFError):
    """A GGUF file that is not a llama.cpp LoRA adapter (the checks of
    ``llama_adapter_lora_init_impl``)."""
# --8<-- [end:LoraError]


def _check_pairs(tensors: dict, error: type[LoraError]) -> None:
    """Every ``.lora_a`` has its ``.lora_b``, both 2-D, with ``A.shape[0] == B.shape[1]``."""
    for name in tensors:
        if not name.endswith((LORA_A, LORA_B)):
            raise error(f"LoRA tensor {name!r} has unexpected suffix (need .lora_a or .lora_b)")
        base = name[: -len(LORA_A)]
        if base + LORA_A not in tensors or base + LORA_B not in tensors:
            raise error(f"LoRA tensor pair for {base!r} is missing one component")
        if base.endswith("token_embd.weight"):
            raise error(f"{base!r}: adapters of token_embd (A and B flipped in llama.cpp) "
                        "are not supported")
        a, b = tuple(tensors[base + LORA_A].shape), tuple(tensors[base + LORA_B].shape)
        if len(a) != 2 or len(b) != 2:
            raise error(f"{base!r}: lora_a and lora_b must be matrices, got shapes {a} and {b}")
        if a[0] != b[1]:
            raise error(f"{base!r}: lora_a tensor is not transposed: lora_a {a} must be "
                        f"(rank, n_in) and lora_b {b} (n_out, rank)")


# --8<-- [start:LoraAdapter]
@dataclass(eq=False)  # compare ``tensors`` explicitly: ``==`` of dicts of arrays is ambiguous
class LoraAdapter:
    r"""A LoRA adapter: the tensors of its GGUF file, its $\alpha$ and its architecture.

    Attributes:
        tensors: ``"<base>.lora_a"`` $A$ ``(rank, n_in)`` and ``"<base>.lora_b"`` $B$
            ``(n_out, rank)`` for every adapted weight ``<base>`` (a GGUF name such as
            ``"blk.0.attn_q.weight"``), in file order; the optimizer replaces the arrays.
        alpha: ``adapter.lora.alpha`` (a float32 value; 0 means "scale = adapter_scale").
        arch: ``general.architecture`` of the model it belongs to.

    Raises:
        LoraError: unpaired or mis-shaped tensors, or a non-finite ``alpha``.

    Examples:
        >>> ad = LoraAdapter({"blk.0.attn_q.weight.lora_a": np.zeros((2, 16)),
        ...                   "blk.0.attn_q.weight.lora_b": np.zeros((8, 2))}, 4.0, "llama")
        >>> ad.targets, ad.rank("blk.0.attn_q.weight")
        (['blk.0.attn_q.weight'], 2)
    """

    tensors: dict[str, np.ndarray]
    alpha: float
    arch: str

    def __post_init__(self) -> None:
        if not math.isfinite(self.alpha):
            raise LoraError(f"alpha must be finite, got {self.alpha}")
        _check_pairs(self.tensors, LoraError)

    @property
    def targets(self) -> list[str]:
        """The adapted weights' GGUF names, in file order."""
        return [name[: -len(LORA_A)] for name in self.tensors if name.endswith(LORA_A)]

    def a(self, target: str) -> np.ndarray:
        """$A$ of ``target`` ``(rank, n_in)``."""
        return self.tensors[target + LORA_A]

    def b(self, target: str) -> np.ndarray:
        """$B$ of ``target`` ``(n_out, rank)``."""
        return self.tensors[target + LORA_B]

    def rank(self, target: str) -> int:
        r"""$r$ = ``lora_b->ne[0]``, the rank llama.cpp divides $\alpha$ by."""
        return self.b(target).shape[1]
# --8<-- [end:LoraAdapter]


# --8<-- [start:lora_scale]
def lora_scale(alpha: float, rank: int, adapter_scale: float = 1.0) -> np.float32:
    r"""``llama_adapter_lora_weight::get_scale``: $s = \mathrm{adapter\_scale}\cdot\alpha / r$,
    or ``adapter_scale`` when $\alpha = 0$; in float, left to right.

    Examples:
        >>> lora_scale(16.0, 8), lora_scale(0.0, 8), lora_scale(16.0, 8, adapter_scale=0.5)
        (np.float32(2.0), np.float32(1.0), np.float32(1.0))
    """
    f = np.float32
    if f(alpha) == 0:
        return f(adapter_scale)
    return f(adapter_scale) * f(alpha) / f(rank)
# --8<-- [end:lora_scale]


# --8<-- [start:lora_targets]
def lora_targets(
    weights: dict, hparams: LlamaHParams, targets: tuple[str, ...] = LORA_TARGETS
) -> list[str]:
    """The GGUF names of the weights that ``targets`` selects, block by block.

    Args:
        weights: the model's GGUF-named weights.
        hparams: its hyperparameters (``n_layer``, ``tied_output``).
        targets: kinds from ``LORA_TARGET_KINDS`` (default ``LORA_TARGETS``: ``attn_q``,
            ``attn_k``, ``attn_v``, ``attn_output``, ``ffn_gate``, ``ffn_up``,
            ``ffn_down``); ``"output"`` adds the lm_head.

    Returns:
        ``blk.0.*`` in ``LORA_TARGET_KINDS`` order, then ``blk.1.*`` ..., then
        ``output.weight`` (the order does not depend on the order of ``targets``).

    Raises:
        LoraError: an unknown or repeated kind, no kind, ``"output"`` with tied embeddings
            (the lm_head is ``token_embd``, which llama.cpp adapts with flipped A and B), or a
            selected weight the model does not have.

    Examples:
        >>> from reference.testing import tiny_hparams, random_weights
        >>> hp = tiny_hparams(n_layer=2)
        >>> lora_targets(random_weights(hp), hp, ("ffn_up", "attn_q"))
        ['blk.0.attn_q.weight', 'blk.0.ffn_up.weight', 'blk.1.attn_q.weight', 'blk.1.ffn_up.weight']
    """
    targets = tuple(targets)
    unknown = [t for t in targets if t not in LORA_TARGET_KINDS]
    if unknown or not targets or len(set(targets)) != len(targets):
        raise LoraError(f"LoRA targets must be distinct kinds from {LORA_TARGET_KINDS}, "
                        f"got {list(targets)}")
    if "output" in targets and hparams.tied_output:
        raise LoraError("'output' cannot be adapted: this model ties its lm_head to token_embd")
    kinds = [k for k in LORA_TARGET_KINDS if k in targets and k != "output"]
    names = [f"blk.{il}.{k}.weight" for il in range(hparams.n_layer) for k in kinds]
    names += ["output.weight"] if "output" in targets else []
    missing = [n for n in names if n not in weights]
    if missing:
        raise LoraError(f"the model has no {missing[0]!r} to adapt")
    return names
# --8<-- [end:lora_targets]


# --8<-- [start:init_lora]
def init_lora(
    weights: dict,
    hparams: LlamaHParams,
    rank: int,
    alpha: float,
    targets: tuple[str, ...] = LORA_TARGETS,
    seed: int = 0,
) -> LoraAdapter:
    r"""A new adapter: $B = 0$, $A \sim \mathcal{U}(-1/\sqrt{n_{in}}, 1/\sqrt{n_{in}})$ (PEFT).

    Args:
        weights: the base model (its dtype, ``token_embd``'s, is the adapter's).
        hparams: its hyperparameters.
        rank: $r \ge 1$, the same for every target.
        alpha: $\alpha$, rounded to float32 (as the file stores it); $s = \alpha / r$.
        targets: see [`lora_targets`][].
        seed: seeds ``numpy.random.default_rng``; $A$ is drawn target after target.

    Returns:
        The [`LoraAdapter`][]; the adapted model equals the base model exactly.

    Raises:
        LoraError: ``rank < 1``, a non-finite ``alpha``, or bad ``targets``.

    Examples:
        >>> from reference.testing import tiny_hparams, random_weights
        >>> hp = tiny_hparams(n_layer=1)
        >>> ad = init_lora(random_weights(hp), hp, rank=4, alpha=8.0, targets=("attn_q",))
        >>> ad.a("blk.0.attn_q.weight").shape, ad.b("blk.0.attn_q.weight").shape
        ((4, 16), (16, 4))
        >>> float(abs(ad.a("blk.0.attn_q.weight")).max()) <= 0.25, ad.b("blk.0.attn_q.weight").any()
        (True, np.False_)
    """
    if not isinstance(rank, (int, np.integer)) or rank < 1:
        raise LoraError(f"rank must be an integer >= 1, got {rank!r}")
    if not math.isfinite(alpha):
        raise LoraError(f"alpha must be finite, got {alpha}")
    names = lora_targets(weights, hparams, targets)
    dtype = model_dtype(weights)
    rng = np.random.default_rng(seed)
    tensors = {}
    for name in names:
        n_out, n_in = weights[name].shape
        bound = 1.0 / math.sqrt(n_in)
        tensors[name + LORA_A] = rng.uniform(-bound, bound, (rank, n_in)).astype(dtype)
        tensors[name + LORA_B] = np.zeros((n_out, rank), dtype)
    return LoraAdapter(tensors, float(np.float32(alpha)), hparams.arch)
# --8<-- [end:init_lora]


# --8<-- [start:check_lora]
def check_lora(adapter: LoraAdapter, weights: dict, hparams: LlamaHParams | None = None) -> None:
    """The checks ``llama_adapter_lora_init_impl`` makes of an adapter against a model.

    Raises:
        LoraError: the architectures differ (``hparams`` given), an adapted weight is not in
            the model, or $A$ / $B$ do not fit its shape ``(n_out, n_in)``.

    Examples:
        >>> ab = {"w.lora_a": np.zeros((2, 3)), "w.lora_b": np.zeros((4, 2))}
        >>> ad = LoraAdapter(ab, 1.0, "llama")
        >>> check_lora(ad, {"w": np.zeros((4, 3))})
        >>> check_lora(ad, {"w": np.zeros((3, 4))})  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        reference.training.lora.LoraError: tensor 'w' has incorrect shape: the model's is (3, 4)...
    """
    if hparams is not None and adapter.arch != hparams.arch:
        raise LoraError(f"model arch and LoRA arch mismatch: {hparams.arch!r} model, "
                        f"{adapter.arch!r} adapter")
    for name in adapter.targets:
        if name not in weights:
            raise LoraError(f"LoRA tensor {name!r} does not exist in base model "
                            "(hint: maybe wrong base model?)")
        shape = tuple(weights[name].shape)
        ba = (adapter.b(name).shape[0], adapter.a(name).shape[1])
        if shape != ba:
            raise LoraError(f"tensor {name!r} has incorrect shape: the model's is {shape}, the "
                            f"adapter's B A is {ba} (hint: maybe wrong base model?)")
# --8<-- [end:check_lora]


# --8<-- [start:build_lora_mm]
def build_lora_mm(
    w: np.ndarray, x: np.ndarray, a: np.ndarray, b: np.ndarray, s: float
) -> np.ndarray:
    r"""``build_lora_mm``: $y = W x + s\, B (A x)$, the matmul of an adapted weight at inference.

    Args:
        w: $W$ ``(n_out, n_in)``.
        x: the activations ``(n_tokens, n_in)``.
        a: $A$ ``(rank, n_in)``.
        b: $B$ ``(n_out, rank)``.
        s: [`lora_scale`][].

    Returns:
        ``(n_tokens, n_out)``; equal to ``mul_mat(merge_lora_weight(w, a, b, s), x)`` up to
        rounding.

    Examples:
        >>> w, x = np.eye(2), np.array([[1.0, 2.0]])
        >>> build_lora_mm(w, x, np.array([[1.0, 0.0]]), np.array([[0.0], [1.0]]), 0.5)
        array([[1. , 2.5]])
    """
    y = mul_mat(w, x)  # (n_tokens, n_out)
    ab = mul_mat(b, mul_mat(a, x))  # (n_tokens, rank) -> (n_tokens, n_out)
    return add(y, scale(ab, s))
# --8<-- [end:build_lora_mm]


# --8<-- [start:merge_lora_weight]
def merge_lora_weight(w: np.ndarray, a: np.ndarray, b: np.ndarray, s: float) -> np.ndarray:
    r"""$W' = W + s\,(BA)$ in ``w``'s dtype, in ``llama-export-lora``'s order: ``delta =
    mul_mat(transpose(A), B)``, scaled by $s$, added to $W$.

    Examples:
        >>> merge_lora_weight(np.eye(2), np.array([[1.0, 0.0]]), np.array([[0.0], [1.0]]), 0.5)
        array([[1. , 0. ],
               [0.5, 1. ]])
    """
    delta = mul_mat(np.ascontiguousarray(a.T), b)  # (n_out, n_in) = B A
    return add(scale(delta.astype(w.dtype, copy=False), s), w)
# --8<-- [end:merge_lora_weight]


# --8<-- [start:lora_weights]
def lora_weights(weights: dict, adapter: LoraAdapter, adapter_scale: float = 1.0) -> dict:
    r"""The adapted model's weights: $W' = W + s\,BA$ for every target, the rest shared.

    Args:
        weights: the base model (quantized targets are dequantized; it is not modified).
        adapter: the [`LoraAdapter`][].
        adapter_scale: ``llama_set_adapters_lora``'s scale.

    Returns:
        A new dict: the targets as arrays of the model's dtype, every other entry the base's
        own object. Its forward is llama.cpp's forward with the adapter applied.

    Raises:
        LoraError: the adapter does not fit the model ([`check_lora`][]).

    Examples:
        >>> from reference.testing import tiny_hparams, random_weights
        >>> hp = tiny_hparams(n_layer=1)
        >>> w = random_weights(hp)
        >>> w2 = lora_weights(w, init_lora(w, hp, rank=2, alpha=4.0))
        >>> name = "blk.0.ffn_up.weight"        # B = 0: W' = W exactly
        >>> bool((w2[name] == w[name]).all()), w2["token_embd.weight"] is w["token_embd.weight"]
        (True, True)
    """
    check_lora(adapter, weights)
    dtype = model_dtype(weights)
    out = dict(weights)
    for name in adapter.targets:
        s = lora_scale(adapter.alpha, adapter.rank(name), adapter_scale)
        a, b = adapter.a(name).astype(dtype), adapter.b(name).astype(dtype)
        out[name] = merge_lora_weight(get_weight(weights, name, dtype), a, b, s)
    return out
# --8<-- [end:lora_weights]


# --8<-- [start:merge_lora]
def merge_lora(weights: dict, adapter: LoraAdapter, adapter_scale: float = 1.0) -> dict:
    """``llama-export-lora``: a full model with the adapter merged into its weights.

    The same dict as [`lora_weights`][] (merging is what the specification's adapted forward
    does); write it with the model writer to get a model that needs no adapter.

    Raises:
        LoraError: the adapter does not fit the model.
    """
    return lora_weights(weights, adapter, adapter_scale)
# --8<-- [end:merge_lora]


# --8<-- [start:lora_grads]
def lora_grads(grads: dict, adapter: LoraAdapter, adapter_scale: float = 1.0) -> dict:
    r"""The gradients of $A$ and $B$ from the gradient $G = \partial L / \partial W'$.

    With $W' = W + s\,BA$ and $dL = \langle G, dW' \rangle$ (the Frobenius product),

    $$ dL = s\langle G, dB\,A\rangle + s\langle G, B\,dA\rangle
          = \langle s\,G A^T, dB\rangle + \langle s\,B^T G, dA\rangle, $$

    so $\partial L/\partial B = s\,G A^T$ ``(n_out, rank)`` and $\partial L/\partial A =
    s\,B^T G$ ``(rank, n_in)``. (Applied per matmul, $y = Wx + sB(Ax)$ gives the same:
    $G = \sum_t \bar y_t x_t^T$ either way.) At $B = 0$ the gradient of $A$ is zero; $B$
    moves first.

    Args:
        grads: GGUF name -> gradient, as
            [`loss_and_grads`][reference.training.llama_grad.loss_and_grads] returns them for
            [`lora_weights`][]'s dict; must hold every target.
        adapter: the adapter the forward used.
        adapter_scale: the scale the forward used.

    Returns:
        Adapter tensor name (``"<base>.lora_a"``, ``"<base>.lora_b"``) -> gradient.

    Raises:
        LoraError: a target has no gradient, or one not of its weight's shape.

    Examples:
        >>> ab = {"w.lora_a": np.ones((1, 2)), "w.lora_b": np.full((2, 1), 3.0)}
        >>> ad = LoraAdapter(ab, 2.0, "llama")
        >>> g = lora_grads({"w": np.array([[1.0, 0.0], [0.0, 0.0]])}, ad)   # s = 2
        >>> g["w.lora_a"], g["w.lora_b"]
        (array([[6., 0.]]), array([[2.],
               [0.]]))
    """
    out = {}
    for name in adapter.targets:
        a, b = adapter.a(name), adapter.b(name)
        g = grads.get(name)
        if g is None or g.shape != (b.shape[0], a.shape[1]):
            raise LoraError(f"need the gradient of {name!r} of shape {(b.shape[0], a.shape[1])}"
                            f", got {None if g is None else g.shape}")
        s = g.dtype.type(lora_scale(adapter.alpha, adapter.rank(name), adapter_scale))
        out[name + LORA_A] = s * (b.T.astype(g.dtype) @ g)  # (rank, n_in)
        out[name + LORA_B] = s * (g @ a.T.astype(g.dtype))  # (n_out, rank)
    return out
# --8<-- [end:lora_grads]


# --8<-- [start:lora_loss_and_grads]
def lora_loss_and_grads(
    weights: dict,
    adapter: LoraAdapter,
    hparams: LlamaHParams,
    tokens: np.ndarray,
    labels: np.ndarray,
    opt_period: int = 1,
    adapter_scale: float = 1.0,
) -> tuple[float, dict, np.ndarray]:
    """One ubatch of LoRA training: the adapted model's loss, the adapter's gradients, logits.

    [`lora_weights`][], then [`loss_and_grads`][reference.training.llama_grad.loss_and_grads],
    then [`lora_grads`][].

    Raises:
        LoraError: the adapter does not fit the model.
        TrainGraphError: bad labels or ``opt_period`` (as ``loss_and_grads``).

    Examples:
        >>> from reference.testing import tiny_hparams, random_weights
        >>> hp = tiny_hparams(n_layer=1)
        >>> w = random_weights(hp)
        >>> loss, g, _ = lora_loss_and_grads(w, init_lora(w, hp, 2, 4.0), hp, [1, 2], [2, 3])
        >>> a, b = g["blk.0.attn_q.weight.lora_a"], g["blk.0.attn_q.weight.lora_b"]
        >>> len(g), bool(a.any()), bool(b.any())          # B = 0: only B gets a gradient
        (14, False, True)
    """
    adapted = lora_weights(weights, adapter, adapter_scale)
    loss, grads, logits = loss_and_grads(adapted, hparams, tokens, labels, opt_period)
    return loss, lora_grads(grads, adapter, adapter_scale), logits
# --8<-- [end:lora_loss_and_grads]


# --8<-- [start:LoraOptContext]
class LoraOptContext(OptContext):
    """ggml-opt over an adapter: the base frozen, $A$ and $B$ stepped by AdamW or SGD.

    An [`OptContext`][reference.training.opt.OptContext] whose parameters are
    ``adapter.tensors``. Its ``eval_backward(weights, grads)`` takes what the training loop
    has: ``weights``, the adapted model's dict (from [`lora_weights`][]), and ``grads``, the
    gradients ``loss_and_grads`` computed on it. It turns them into the adapter's gradients
    ([`lora_grads`][]), accumulates and steps as ``OptContext`` does, and after a step writes
    the new $W'$ into ``weights``, so that
    [`opt_epoch`][reference.training.epoch.opt_epoch] trains an adapter unchanged. The base
    weights (kept from construction) are never written.

    Args:
        weights: the base model.
        adapter: the adapter to train (its arrays are replaced at each step).
        optimizer: ``"adamw"`` or ``"sgd"``.
        opt_period: ubatches per optimizer step.
        get_opt_pars: called before every step.
        adapter_scale: the scale of the adapted forward.

    Raises:
        LoraError: the adapter does not fit the model.
        OptParamsError: as ``OptContext``.

    Examples:
        >>> from reference.testing import tiny_hparams, random_weights
        >>> from reference.training.llama_grad import loss_and_grads
        >>> from reference.training.opt import SGDParams
        >>> hp = tiny_hparams(n_layer=1)
        >>> base = random_weights(hp)
        >>> ad = init_lora(base, hp, rank=2, alpha=2.0)
        >>> ctx = LoraOptContext(base, ad, "sgd",
        ...                      get_opt_pars=lambda: OptimizerParams(sgd=SGDParams(alpha=0.5)))
        >>> w = lora_weights(base, ad)
        >>> loss0, grads, _ = loss_and_grads(w, hp, [1, 2, 3], [2, 3, 4])
        >>> ctx.eval_backward(w, grads), bool(ad.b("blk.0.attn_q.weight").any())
        (True, True)
        >>> loss1, _, _ = loss_and_grads(w, hp, [1, 2, 3], [2, 3, 4])
        >>> loss1 < loss0
        True
    """

    def __init__(
        self,
        weights: dict,
        adapter: LoraAdapter,
        optimizer: str = "adamw",
        opt_period: int = 1,
        get_opt_pars: Callable[[], OptimizerParams] | None = None,
        adapter_scale: float = 1.0,
    ):
        check_lora(adapter, weights)
        super().__init__(adapter.tensors, optimizer, opt_period, get_opt_pars)
        self.base = dict(weights)  # the frozen weights W
        self.adapter = adapter
        self.adapter_scale = adapter_scale

    def eval_backward(self, weights: dict, grads: dict) -> bool:
        """One ubatch: ``grads`` of the $W'$ -> the adapter's; accumulate; step; refresh $W'$.

        Returns whether the optimizer stepped.

        Raises:
            LoraError: a target's gradient is missing or mis-shaped (nothing changes).
            OptParamsError: as ``OptContext.eval_backward`` (nothing changes).
        """
        adapter_grads = lora_grads(grads, self.adapter, self.adapter_scale)
        stepped = super().eval_backward(self.adapter.tensors, adapter_grads)
        if stepped:
            adapted = lora_weights(self.base, self.adapter, self.adapter_scale)
            weights.update({name: adapted[name] for name in self.adapter.targets})
        return stepped
# --8<-- [end:LoraOptContext]


# --8<-- [start:save_lora_gguf]
def save_lora_gguf(path: str | os.PathLike, adapter: LoraAdapter) -> None:
    """Write ``adapter`` as llama.cpp's LoRA adapter GGUF (what ``convert_lora_to_gguf.py`` writes).

    Metadata: ``general.architecture`` (``adapter.arch``), ``general.type = "adapter"``,
    ``adapter.type = "lora"``, ``adapter.lora.alpha`` (FLOAT32). Tensors: ``<base>.lora_a``
    ``ne = [n_in, rank]`` and ``<base>.lora_b`` ``ne = [rank, n_out]``, F32, in the adapter's
    order. Load it with ``llama_adapter_lora_init`` (llama-cpp-python: ``Llama(...,
    lora_path=path)``) or [`load_lora_gguf`][].

    Raises:
        GGUFError: from the writer (a name too long for GGUF, ...); no file is left then.

    Examples:
        >>> import tempfile, pathlib
        >>> p = pathlib.Path(tempfile.mkdtemp()) / "lora.gguf"
        >>> ab = {"w.lora_a": np.ones((1, 2)), "w.lora_b": np.ones((3, 1))}
        >>> save_lora_gguf(p, LoraAdapter(ab, 8.0, "llama"))
        >>> f = read_gguf(p)
        >>> f.metadata["general.type"], f.value_types["adapter.lora.alpha"].name
        ('adapter', 'FLOAT32')
        >>> f.tensors["w.lora_a"].shape, f.tensors["w.lora_b"].shape
        ((1, 2), (3, 1))
    """
    metadata = {
        "general.architecture": adapter.arch,
        "general.type": "adapter",
        "adapter.type": "lora",
        "adapter.lora.alpha": GGUFValue(adapter.alpha, GGUFValueType.FLOAT32),
    }
    tensors = {name: np.ascontiguousarray(t, np.float32) for name, t in adapter.tensors.items()}
    write_gguf(path, metadata, tensors)
# --8<-- [end:save_lora_gguf]


def _as_f32(name: str, t) -> np.ndarray:
    """A writable float32 copy of a tensor of the file (non-F32 types dequantized)."""
    try:
        return np.array(t.dequantize() if hasattr(t, "dequantize") else t, np.float32)
    except (ValueError, TypeError) as e:  # QuantError is a ValueError
        raise LoraFileError(f"LoRA tensor {name!r}: cannot read its data: {e}") from e


# --8<-- [start:load_lora_gguf]
def load_lora_gguf(
    path: str | os.PathLike, weights: dict | None = None, hparams: LlamaHParams | None = None
) -> LoraAdapter:
    """Read a LoRA adapter GGUF with ``llama_adapter_lora_init_impl``'s checks.

    ``general.type`` must be ``"adapter"``, ``adapter.type`` ``"lora"``,
    ``general.architecture`` a string, ``adapter.lora.alpha`` FLOAT32 if present (absent: 0,
    as llama.cpp reads it); every tensor ends in ``.lora_a`` or ``.lora_b`` (``*_norm.weight``
    tensors are skipped, as llama.cpp skips them) and comes with its partner, shapes
    ``(rank, n_in)`` and ``(n_out, rank)``. With ``weights`` (and ``hparams``), the adapter is
    also checked against the model ([`check_lora`][]).

    Args:
        path: the file.
        weights: the base model, or None.
        hparams: its hyperparameters (for the architecture), or None.

    Returns:
        The [`LoraAdapter`][], tensors as float32 arrays (copies, not views of the file;
        F16 or quantized tensors, which llama.cpp accepts too and ``convert_lora_to_gguf.py``
        writes by default, dequantized).

    Raises:
        GGUFError: the file is not a well-formed GGUF.
        LoraFileError: it is a GGUF but not a LoRA adapter llama.cpp would load.
        LoraError: it does not fit ``weights`` / ``hparams``.
        OSError: the file cannot be opened.

    Examples:
        >>> import tempfile, pathlib
        >>> p = pathlib.Path(tempfile.mkdtemp()) / "model.gguf"
        >>> write_gguf(p, {"general.architecture": "llama"}, {"w": np.ones((2, 2), np.float32)})
        >>> load_lora_gguf(p)  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        reference.training.lora.LoraFileError: ...: expect general.type to be 'adapter', but got:...
    """
    f = read_gguf(path)
    md = f.metadata
    if md.get("general.type") != "adapter":
        raise LoraFileError(f"{f.path}: expect general.type to be 'adapter', but got: "
                            f"{md.get('general.type')!r}")
    if md.get("adapter.type") != "lora":
        raise LoraFileError(f"{f.path}: expect adapter.type to be 'lora', but got: "
                            f"{md.get('adapter.type')!r}")
    arch = f.arch  # GGUFError when missing
    if "adapter.lora.alpha" in md and f.value_types["adapter.lora.alpha"] != GGUFValueType.FLOAT32:
        raise LoraFileError(f"{f.path}: adapter.lora.alpha must be FLOAT32, got "
                            f"{f.value_types['adapter.lora.alpha'].name}")
    if "adapter.alora.invocation_tokens" in md:
        raise LoraFileError(f"{f.path}: activated LoRA (adapter.alora.invocation_tokens) is "
                            "not supported")
    tensors = {n: t for n, t in f.tensors.items() if not n.endswith("_norm.weight")}
    try:
        _check_pairs(tensors, LoraFileError)
    except LoraFileError as e:
        raise LoraFileError(f"{f.path}: {e}") from None
    tensors = {name: _as_f32(name, t) for name, t in tensors.items()}
    adapter = LoraAdapter(tensors, float(md.get("adapter.lora.alpha", 0.0)), arch)
    if weights is not None:
        check_lora(adapter, weights, hparams)
    return adapter
# --8<-- [end:load_lora_gguf]
