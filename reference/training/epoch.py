r"""One epoch of fine-tuning: ``llama_opt_epoch`` over a dataset, datapoint by datapoint.

``llama_context::opt_epoch`` (``src/llama-context.cpp``) walks the datapoints **in order**:
``[0, idata_split)`` with backward passes and optimizer steps, then ``[idata_split, ndata)``
forward only, each result into its own ``ggml_opt_result`` and each ubatch reported to a
callback (``finetune`` passes the progress bar to both). Every datapoint is one context of
``n_ctx`` tokens with the memory cleared first.

The specification runs the configuration in which llama.cpp trains every projection:
``n_ubatch == n_ctx`` (``cparams.training``), so one datapoint is one ubatch and, since
``n_batch <= n_ctx``, ``opt_period = n_batch / n_ubatch = 1``: one optimizer step per training
datapoint. (llama.cpp accumulates gradients over several ubatches only when ``n_ubatch <
n_ctx``, the mode in which K and V get no gradient.) ``ibatch`` counts ubatches from 1 in
each loop, ``ibatch_max`` is the loop's length.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from reference.hparams import LlamaHParams
from reference.ops.loss import cross_entropy_loss
from reference.training.errors import DatasetError
from reference.training.llama_grad import loss_and_grads, train_forward
from reference.training.opt import OptContext
from reference.training.result import OptResult

#: ``ggml_opt_epoch_callback``: (train, result, ibatch, ibatch_max, batch_size)
EpochCallback = Callable[[bool, OptResult, int, int, int], None]


def _eval_datapoint(weights: dict, hparams: LlamaHParams, tokens, labels, opt_period: int):
    """The forward graph of ggml-opt (``backward = false``): loss and logits, no gradient."""
    logits, _ = train_forward(weights, hparams, tokens)
    onehot = np.zeros(logits.shape, dtype=logits.dtype)  # (n_tokens, n_vocab)
    onehot[np.arange(len(logits)), np.asarray(labels)] = 1  # not np.eye(n_vocab): n_vocab^2
    t = logits.dtype.type
    return float(cross_entropy_loss(logits, onehot) * (t(1) / t(opt_period))), logits


# --8<-- [start:epoch_loop]
def check_epoch_args(opt_ctx: OptContext, data: np.ndarray, labels: np.ndarray,
                     idata_split: int) -> None:
    """What ``llama_opt_epoch`` asserts, as a
    [`DatasetError`][reference.training.errors.DatasetError].

    Examples:
        >>> check_epoch_args(OptContext({}), np.zeros((2, 4)), np.zeros((2, 4)), 3)
        Traceback (most recent call last):
        ...
        reference.training.errors.DatasetError: need labels of data's shape (2, 4) and 0 <= ...
    """
    ndata = len(data)
    if labels.shape != data.shape or not 0 <= idata_split <= ndata:
        raise DatasetError(
            f"need labels of data's shape {data.shape} and 0 <= idata_split <= {ndata}; got "
            f"{labels.shape} and {idata_split}"
        )
    if opt_ctx.opt_period != 1:
        raise DatasetError("with n_ubatch == n_ctx every datapoint is one step: opt_period is 1")


def epoch_loop(train_step: Callable, eval_step: Callable, data: np.ndarray, labels: np.ndarray,
               idata_split: int, opt_period: int, result_train: OptResult,
               result_eval: OptResult, callback: EpochCallback | None = None) -> None:
    """The loop of ``llama_opt_epoch``, whatever computes a datapoint: ``data[:idata_split]``
    through ``train_step(tokens, labels) -> (loss, predicted ids)`` (which also steps the
    optimizer), the rest through ``eval_step`` (no gradient), in order, no shuffling; each
    datapoint's loss and predictions go to its [`OptResult`][reference.training.result.OptResult]
    and to ``callback``. Both twins' [`opt_epoch`][] run it.

    Examples:
        >>> r_t, r_v, seen = OptResult(), OptResult(), []
        >>> step = lambda tokens, target: (1.0, np.asarray(target))
        >>> epoch_loop(step, step, np.zeros((3, 2)), np.ones((3, 2)), 2, 1, r_t, r_v,
        ...            lambda train, result, i, n, b: seen.append((train, i, n)))
        >>> seen, r_t.ndata, r_v.ndata
        ([(True, 1, 2), (True, 2, 2), (False, 1, 1)], 4, 2)
    """
    ndata = len(data)
    n_ctx = data.shape[1] if data.ndim == 2 else 0
    for idata in range(idata_split):
        loss, predicted = train_step(data[idata], labels[idata])
        result_train.add(loss, predicted, labels[idata], opt_period)
        if callback:
            callback(True, result_train, idata + 1, idata_split, n_ctx)
    for idata in range(idata_split, ndata):
        loss, predicted = eval_step(data[idata], labels[idata])
        result_eval.add(loss, predicted, labels[idata], opt_period)
        if callback:
            callback(False, result_eval, idata - idata_split + 1, ndata - idata_split, n_ctx)
# --8<-- [end:epoch_loop]


# --8<-- [start:opt_epoch]
def opt_epoch(
    weights: dict,
    hparams: LlamaHParams,
    opt_ctx: OptContext,
    data: np.ndarray,
    labels: np.ndarray,
    idata_split: int,
    result_train: OptResult,
    result_eval: OptResult,
    callback: EpochCallback | None = None,
) -> None:
    """``llama_opt_epoch``: train on ``data[:idata_split]``, then evaluate ``data[idata_split:]``.

    Args:
        weights: GGUF-named weights; the trainable ones are updated in place (new arrays).
        hparams: their hyperparameters.
        opt_ctx: the optimizer state ([`OptContext`][reference.training.opt.OptContext]),
            ``opt_period == 1``.
        data: datapoints ``(ndata, n_ctx)`` (from
            [`opt_dataset_init`][reference.training.dataset.opt_dataset_init]).
        labels: their next tokens, same shape.
        idata_split: the first validation datapoint.
        result_train: accumulates the training ubatches.
        result_eval: accumulates the validation ubatches.
        callback: called after every ubatch with ``(train, result, ibatch, ibatch_max,
            batch_size)``.

    Raises:
        DatasetError: if ``idata_split`` is outside ``[0, ndata]`` (llama.cpp asserts), the
            shapes differ, or ``opt_ctx.opt_period != 1``.

    Examples:
        >>> from reference.testing import tiny_hparams, random_weights
        >>> from reference.training.dataset import opt_dataset_init
        >>> hp = tiny_hparams(n_layer=1)
        >>> w = random_weights(hp, seed=0)
        >>> data, labels = opt_dataset_init(np.arange(30) % 32, n_ctx=8)
        >>> train, val = OptResult(), OptResult()
        >>> opt_epoch(w, hp, OptContext(w), data, labels, 4, train, val)
        >>> len(data), train.ndata, val.ndata
        (5, 32, 8)
    """
    check_epoch_args(opt_ctx, data, labels, idata_split)

    def train_step(tokens, target):
        loss, grads, logits = loss_and_grads(weights, hparams, tokens, target)
        opt_ctx.eval_backward(weights, grads)
        return loss, logits.argmax(-1)

    def eval_step(tokens, target):
        loss, logits = _eval_datapoint(weights, hparams, tokens, target, opt_ctx.opt_period)
        return loss, logits.argmax(-1)

    epoch_loop(train_step, eval_step, data, labels, idata_split, opt_ctx.opt_period,
               result_train, result_eval, callback)
# --8<-- [end:opt_epoch]
