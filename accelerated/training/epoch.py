r"""Twin of [`reference.training.epoch`][reference.training.epoch]: ``llama_opt_epoch`` with the MLX
gradient and optimizer.

The same loop, the same order and the same results: the only differences are that the
datapoint's loss and gradients come from
[`accelerated.training.llama_grad.loss_and_grads`][accelerated.training.llama_grad.loss_and_grads],
the step from [`accelerated.training.opt.OptContext`][accelerated.training.opt.OptContext], and the
predictions are taken on the device and copied to the host for
[`reference.training.result.OptResult`][reference.training.result.OptResult].
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from accelerated.training.llama_grad import _cross_entropy, loss_and_grads, train_forward
from accelerated.training.opt import OptContext
from reference.hparams import LlamaHParams
from reference.training.epoch import EpochCallback  # the callback type, imported as it is
from reference.training.errors import DatasetError
from reference.training.result import OptResult

__all__ = ["EpochCallback", "opt_epoch"]


def _eval_datapoint(weights: dict, hparams: LlamaHParams, tokens, labels, opt_period: int):
    """The forward graph of ggml-opt (``backward = false``): loss and logits, no gradient."""
    logits, _ = train_forward(weights, hparams, tokens)
    label_ids = mx.array(np.asarray(labels, dtype=np.int32))
    loss = _cross_entropy(logits, label_ids) * (1.0 / opt_period)
    return float(loss.item()), logits


def _argmax(logits: mx.array) -> np.ndarray:
    """The predictions, on the host."""
    return np.array(mx.argmax(logits, axis=-1))


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
    """Twin of [`reference.training.epoch.opt_epoch`][reference.training.epoch.opt_epoch]. MLX
    weights and optimizer state.

    Examples:
        >>> from reference.testing import tiny_hparams, random_weights
        >>> from reference.training.dataset import opt_dataset_init
        >>> hp = tiny_hparams(n_layer=1)
        >>> w = {k: mx.array(v) for k, v in random_weights(hp, seed=0).items()}
        >>> data, labels = opt_dataset_init(np.arange(30) % 32, n_ctx=8)
        >>> train, val = OptResult(), OptResult()
        >>> opt_epoch(w, hp, OptContext(w), data, labels, 4, train, val)
        >>> len(data), train.ndata, val.ndata
        (5, 32, 8)
    """
    ndata = len(data)
    if labels.shape != data.shape or not 0 <= idata_split <= ndata:
        raise DatasetError(
            f"need labels of data's shape {data.shape} and 0 <= idata_split <= {ndata}; got "
            f"{labels.shape} and {idata_split}"
        )
    if opt_ctx.opt_period != 1:
        raise DatasetError("with n_ubatch == n_ctx every datapoint is one step: opt_period is 1")
    n_ctx = data.shape[1] if data.ndim == 2 else 0
    for idata in range(idata_split):
        loss, grads, logits = loss_and_grads(weights, hparams, data[idata], labels[idata])
        result_train.add(loss, _argmax(logits), labels[idata], opt_ctx.opt_period)
        opt_ctx.eval_backward(weights, grads)
        if callback:
            callback(True, result_train, idata + 1, idata_split, n_ctx)
    for idata in range(idata_split, ndata):
        loss, logits = _eval_datapoint(weights, hparams, data[idata], labels[idata],
                                       opt_ctx.opt_period)
        result_eval.add(loss, _argmax(logits), labels[idata], opt_ctx.opt_period)
        if callback:
            callback(False, result_eval, idata - idata_split + 1, ndata - idata_split, n_ctx)
# --8<-- [end:opt_epoch]
