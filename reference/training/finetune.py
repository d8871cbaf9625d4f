r"""The fine-tune driver: ``examples/training/finetune.cpp``, written once over both twins.

``finetune`` tokenizes its text with BOS, cuts datapoints of ``n_ctx`` tokens with stride
``n_ctx / 2`` ([`reference.training.dataset`][reference.training.dataset]), splits them
(``-val-split``), initializes the optimizer (``llama_opt_init``), then for each epoch runs
``llama_opt_epoch`` ([`reference.training.epoch`][reference.training.epoch]) with the learning
rate of that epoch ([`reference.training.schedule`][reference.training.schedule]), prints a
newline and resets both results, and finally saves the model
([`reference.training.save`][reference.training.save]).

**Batch sizes.** ``llama_opt_init`` uses ``n_batch = min(n_batch, n_ctx)`` and ``n_ubatch =
min(n_ubatch, n_batch)``, asserts ``n_ctx % n_batch == 0`` and ``n_batch % n_ubatch == 0``,
and trains the K and V projections only when ``n_ubatch == n_ctx`` (otherwise their
gradient path goes through the KV cache, which has none). The specification runs that case
only: one datapoint is one ubatch and one optimizer step. [`finetune_batch_sizes`][] turns
each assert into a [`FinetuneError`][] and refuses ``n_ubatch < n_ctx`` by name.

**Two twins, one driver.** The array work of an epoch is the twin's; everything else (the
dataset, the split, the schedule, the results, the log lines) is here. A [`Trainer`][] names
the twin's pieces: how the weights go onto the device and back, its optimizer context and
its ``opt_epoch``. [`TRAINER`][] is the reference's;
[`accelerated.training.finetune.TRAINER`][accelerated.training.finetune.TRAINER] the MLX one.

**LoRA.** With [`LoraParams`][] the model stays frozen and a low-rank adapter is trained
instead ([`reference.training.lora`][reference.training.lora]): the epochs run on the adapted
weights $W + sBA$ and the twin's LoRA optimizer context steps $A$ and $B$. (llama.cpp's
``finetune`` at the pinned commit has no LoRA training; the adapter it would load is what
[`reference.training.lora.save_lora_gguf`][reference.training.lora.save_lora_gguf] writes.)
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from reference.hparams import LlamaHParams
from reference.training.dataset import idata_split, opt_dataset_init
from reference.training.epoch import EpochCallback, opt_epoch
from reference.training.errors import TrainGraphError, TrainingError
from reference.training.lora import (
    LORA_TARGETS,
    LoraAdapter,
    LoraError,
    LoraOptContext,
    init_lora,
    lora_targets,
    lora_weights,
)
from reference.training.opt import OPTIMIZERS, OptContext, check_optimizer_params
from reference.training.result import OptResult
from reference.training.schedule import LrOpt, get_lr, lr_log_line, lr_opt_init, opt_lr_pars

TRAINABLE_ARCHS = ("llama", "qwen2")  # the archs reference.training.llama_grad differentiates


class FinetuneError(TrainingError, ValueError):
    """Fine-tune arguments llama.cpp would reject (an assert) or the specification does not run."""


# --8<-- [start:FinetuneParams]
@dataclass(frozen=True)
class FinetuneParams:
    """``finetune``'s flags, with llama.cpp's defaults (``common_params``).

    Examples:
        >>> p = FinetuneParams(n_ctx=64)
        >>> p.optimizer, round(p.lr.lr0, 8), p.lr.epochs, p.val_split, p.n_batch, p.n_ubatch
        ('adamw', 1e-05, 2, 0.05, 2048, 512)
    """

    n_ctx: int  # -c: tokens per datapoint (llama.cpp: 0 = the model's n_ctx_train)
    n_batch: int = 2048  # -b
    n_ubatch: int = 512  # -ub
    optimizer: str = "adamw"  # -opt
    lr: LrOpt = field(default_factory=lr_opt_init)  # -lr -lr-min -decay-epochs -wd -epochs
    val_split: float = 0.05  # -val-split
# --8<-- [end:FinetuneParams]


# --8<-- [start:LoraParams]
@dataclass(frozen=True)
class LoraParams:
    r"""``--lora-rank``, ``--lora-alpha``: train an adapter of rank $r$ and scale
    $s = \alpha / r$ on ``targets`` (see
    [`reference.training.lora.init_lora`][reference.training.lora.init_lora]).

    Examples:
        >>> LoraParams(rank=8, alpha=16.0).targets[:2]
        ('attn_q', 'attn_k')
    """

    rank: int
    alpha: float
    targets: tuple[str, ...] = LORA_TARGETS
    seed: int = 0
# --8<-- [end:LoraParams]


# --8<-- [start:finetune_batch_sizes]
def finetune_batch_sizes(n_ctx: int, n_batch: int, n_ubatch: int) -> tuple[int, int]:
    """``llama_opt_init``'s effective ``(n_batch, n_ubatch)``, its asserts as errors.

    Raises:
        FinetuneError: a non-positive size, ``n_ctx % n_batch != 0``, ``n_batch % n_ubatch
            != 0``, or ``n_ubatch < n_ctx`` (llama.cpp then trains without K/V gradients,
            a mode the specification does not run).

    Examples:
        >>> finetune_batch_sizes(64, 2048, 512)   # both clamped to n_ctx = 64
        (64, 64)
        >>> finetune_batch_sizes(1024, 2048, 512)  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        reference.training.finetune.FinetuneError: n_ubatch = 512 < n_ctx = 1024: ...
    """
    if min(n_ctx, n_batch, n_ubatch) <= 0:
        raise FinetuneError(f"n_ctx, n_batch and n_ubatch must be positive, got {n_ctx}, "
                            f"{n_batch}, {n_ubatch}")
    n_batch = min(n_batch, n_ctx)
    n_ubatch = min(n_ubatch, n_batch)
    if n_ctx % n_batch:
        raise FinetuneError(f"n_ctx = {n_ctx} must be a multiple of n_batch = {n_batch} "
                            "(llama_opt_init asserts)")
    if n_batch % n_ubatch:
        raise FinetuneError(f"n_batch = {n_batch} must be a multiple of n_ubatch = {n_ubatch} "
                            "(llama_opt_init asserts)")
    if n_ubatch != n_ctx:
        raise FinetuneError(
            f"n_ubatch = {n_ubatch} < n_ctx = {n_ctx}: llama.cpp then trains without gradients "
            f"for K and V; the specification trains every projection: use -ub {n_ctx} -b {n_ctx} "
            f"(or -c {n_ubatch})"
        )
    return n_batch, n_ubatch
# --8<-- [end:finetune_batch_sizes]


# --8<-- [start:check_finetune]
def check_finetune(
    hparams: LlamaHParams, n_tokens: int, params: FinetuneParams, lora: LoraParams | None = None,
    weights: dict | None = None,
) -> tuple[int, int]:
    """Everything ``finetune`` would assert, before anything runs.

    With ``lora`` (and the ``weights`` it adapts), the adapter's arguments too.

    Returns:
        ``(ndata, idata_split)``.

    Raises:
        FinetuneError: bad batch sizes ([`finetune_batch_sizes`][]).
        TrainGraphError: an architecture other than llama / qwen2, or experts.
        OptParamsError: an unknown optimizer, or a learning rate / weight decay out of range.
        DatasetError: a text too short for one datapoint (with the count needed) or a
            split out of range.
        LoraError: a rank below 1, a non-finite alpha, or targets the model does not have.

    Examples:
        >>> from reference.testing import tiny_hparams
        >>> check_finetune(tiny_hparams(), 200, FinetuneParams(n_ctx=16))
        (22, 20)
    """
    if hparams.arch not in TRAINABLE_ARCHS:
        raise TrainGraphError(f"fine-tuning runs {TRAINABLE_ARCHS} models, not {hparams.arch!r}")
    if hparams.n_expert:
        raise TrainGraphError(f"fine-tuning runs dense models; this {hparams.arch} has "
                              f"{hparams.n_expert} experts (no gradient of mul_mat_id here)")
    finetune_batch_sizes(params.n_ctx, params.n_batch, params.n_ubatch)
    if params.optimizer not in OPTIMIZERS:
        check_optimizer_params(opt_lr_pars(params.lr, 0), params.optimizer)  # names it
    for epoch in range(params.lr.epochs):
        check_optimizer_params(opt_lr_pars(params.lr, epoch), params.optimizer)
    if lora is not None:
        _check_lora_params(lora, hparams, weights)
    data, _ = opt_dataset_init(np.zeros(n_tokens, np.int32), params.n_ctx, params.n_ctx // 2)
    return len(data), idata_split(len(data), params.val_split)


def _check_lora_params(lora: LoraParams, hparams: LlamaHParams, weights: dict | None) -> None:
    if not isinstance(lora.rank, (int, np.integer)) or lora.rank < 1:
        raise LoraError(f"the LoRA rank must be an integer >= 1, got {lora.rank!r}")
    if not np.isfinite(lora.alpha):
        raise LoraError(f"the LoRA alpha must be finite, got {lora.alpha}")
    if weights is not None:
        lora_targets(weights, hparams, lora.targets)
# --8<-- [end:check_finetune]


# --8<-- [start:Trainer]
@dataclass(frozen=True)
class Trainer:
    """The array work of a fine-tune, as one twin does it.

    Attributes:
        name: ``"reference"`` or ``"accelerated"``.
        to_device: host float32 weights -> the twin's weights (new arrays: the caller's are
            never modified).
        to_host: the twin's weights -> NumPy float32 arrays.
        opt_context: [`reference.training.opt.OptContext`][reference.training.opt.OptContext]
            or its twin (same constructor).
        opt_epoch: [`reference.training.epoch.opt_epoch`][reference.training.epoch.opt_epoch] or
            its twin (same signature).
        lora_context:
            [`reference.training.lora.LoraOptContext`][reference.training.lora.LoraOptContext]
            or the twin's: ``(host weights, adapter, optimizer, opt_period, get_opt_pars)``,
            stepping the adapter from the gradients ``opt_epoch`` computes on the twin.
    """

    name: str
    to_device: Callable[[dict], dict]
    to_host: Callable[[dict], dict]
    opt_context: Callable[..., OptContext]
    opt_epoch: Callable[..., None]
    lora_context: Callable[..., OptContext]
# --8<-- [end:Trainer]


def _host_copy(weights: dict) -> dict:
    """Every tensor as a fresh float32 NumPy array (integer tensors as they are)."""
    return {name: np.array(w, dtype=np.float32) if np.issubdtype(np.asarray(w).dtype, np.floating)
            else np.asarray(w) for name, w in weights.items()}


TRAINER = Trainer("reference", _host_copy, _host_copy, OptContext, opt_epoch, LoraOptContext)
"""The reference's [`Trainer`][]: NumPy weights, the chain rule by hand."""


# --8<-- [start:EpochReport]
@dataclass(frozen=True)
class EpochReport:
    """What one epoch produced: its learning rate, both results, the per-step losses.

    ``train_losses`` / ``val_losses`` hold one loss per ubatch (one per datapoint), in order.
    """

    epoch: int
    lr: float
    train_loss: tuple[float, float]  # ggml_opt_result_loss: mean, uncertainty
    train_accuracy: tuple[float, float]
    val_loss: tuple[float, float]
    val_accuracy: tuple[float, float]
    train_losses: tuple[float, ...]
    val_losses: tuple[float, ...]

    @classmethod
    def from_results(cls, epoch: int, lr: float, train: OptResult, val: OptResult):
        """Read both results (before ``finetune`` resets them)."""
        return cls(epoch, lr, train.loss(), train.accuracy(), val.loss(), val.accuracy(),
                   tuple(train.losses), tuple(val.losses))
# --8<-- [end:EpochReport]


# --8<-- [start:FinetuneResult]
@dataclass
class FinetuneResult:
    """The trained weights (NumPy float32), one [`EpochReport`][] per epoch, and the optimizer
    state's size.

    The sizes count what ggml-opt allocates per trainable tensor beyond the weights: the
    gradient accumulator (``grad_nbytes``), and for AdamW the two moments
    (``moments_nbytes``; SGD keeps none). With LoRA, ``weights`` is the adapted model
    ($W + sBA$ on the targets) and ``adapter`` the trained adapter.
    """

    weights: dict
    epochs: list[EpochReport]
    n_steps: int
    trainable_nbytes: int
    grad_nbytes: int
    moments_nbytes: int
    adapter: LoraAdapter | None = None
# --8<-- [end:FinetuneResult]


# --8<-- [start:header_line]
def header_line(params: FinetuneParams) -> str:
    r"""``finetune``'s ``LOG_INF`` line with its settings (``-min-epochs`` is ``decay_epochs``).

    Examples:
        >>> line = header_line(FinetuneParams(n_ctx=64))
        >>> line[:45]
        '-optimizer adamw -lr0 1e-05 -wd 0 -lr-min -1 '
        >>> line[45:]
        '-min-epochs -1 -epochs 2 -period 1 -val 0.05\n'
    """
    lr = params.lr
    n_batch, n_ubatch = min(params.n_batch, params.n_ctx), params.n_ubatch
    n_ubatch = min(n_ubatch, n_batch)
    return (f"-optimizer {params.optimizer} -lr0 {lr.lr0:.2g} -wd {lr.wd:.2g} "
            f"-lr-min {lr.lr_min:.2g} -min-epochs {lr.decay_epochs:.2g} -epochs {lr.epochs} "
            f"-period {n_batch / n_ubatch:.2g} -val {params.val_split:.2g}\n")
# --8<-- [end:header_line]


def _nbytes(tensors: dict) -> int:
    return int(sum(int(np.prod(t.shape)) * 4 for t in tensors.values()))  # float32


# --8<-- [start:finetune]
def finetune(
    weights: dict,
    hparams: LlamaHParams,
    tokens: np.ndarray,
    params: FinetuneParams,
    trainer: Trainer = TRAINER,
    callback: EpochCallback | None = None,
    log: Callable[[str], None] | None = None,
    lora: LoraParams | None = None,
) -> FinetuneResult:
    """``finetune``'s main loop on one twin: dataset, optimizer, epochs, results.

    Args:
        weights: GGUF-named float32 weights (dequantize first; they are not modified).
        hparams: their hyperparameters (``llama`` / ``qwen2``).
        tokens: the tokenized text, BOS first (``common_tokenize(ctx, text, true)``).
        params: the flags ([`FinetuneParams`][]).
        trainer: the twin ([`TRAINER`][] or the MLX one).
        callback: ``llama_opt_epoch``'s callback for both loops (e.g. the progress bar).
        log: receives ``finetune``'s log lines: the settings, ``"epoch E lr=..."`` before
            every optimizer step (``lr_opt::get_lr``), and the newline after every epoch.
        lora: train a LoRA adapter instead of the model ([`LoraParams`][]).

    Returns:
        A [`FinetuneResult`][].

    Raises:
        FinetuneError, TrainGraphError, OptParamsError, DatasetError, LoraError: as
            [`check_finetune`][], before any work.

    Examples:
        >>> from reference.testing import tiny_hparams, random_weights
        >>> hp = tiny_hparams(n_layer=1)
        >>> w = random_weights(hp, seed=0)
        >>> tokens = np.arange(60) % 32
        >>> p = FinetuneParams(n_ctx=16, lr=lr_opt_init(lr0=1e-2, epochs=2), val_split=0.25)
        >>> out = finetune(w, hp, tokens, p)
        >>> [len(e.train_losses) for e in out.epochs], out.n_steps
        ([3, 3], 6)
        >>> out.epochs[1].val_loss[0] < out.epochs[0].val_loss[0]
        True
    """
    log = log or (lambda line: None)
    tokens = np.asarray(tokens)
    _, split = check_finetune(hparams, len(tokens), params, lora, weights)
    data, labels = opt_dataset_init(tokens, params.n_ctx, params.n_ctx // 2)
    log(header_line(params))
    adapter = None
    if lora is not None:
        adapter = init_lora(weights, hparams, lora.rank, lora.alpha, lora.targets, lora.seed)
        w = trainer.to_device(lora_weights(weights, adapter))
    else:
        w = trainer.to_device(weights)
    lr = params.lr
    state = {"epoch": 0}

    def get_opt_pars():  # common_opt_lr_pars: get_lr logs its line every time
        log(lr_log_line(state["epoch"], get_lr(lr, state["epoch"])))
        return opt_lr_pars(lr, state["epoch"])

    if adapter is not None:
        opt_ctx = trainer.lora_context(weights, adapter, params.optimizer, 1, get_opt_pars)
    else:
        opt_ctx = trainer.opt_context(w, params.optimizer, 1, get_opt_pars)
    reports = []
    for epoch in range(lr.epochs):
        state["epoch"] = epoch
        result_train, result_eval = OptResult(), OptResult()
        trainer.opt_epoch(w, hparams, opt_ctx, data, labels, split, result_train, result_eval,
                          callback)
        log("\n")
        reports.append(EpochReport.from_results(epoch, get_lr(lr, epoch), result_train,
                                                result_eval))
    grads = _nbytes(opt_ctx.grad_accs)  # one accumulator per trainable tensor
    return FinetuneResult(trainer.to_host(w), reports, opt_ctx.iter - 1, grads, grads,
                          _nbytes(opt_ctx.m) + _nbytes(opt_ctx.v), adapter)
# --8<-- [end:finetune]
