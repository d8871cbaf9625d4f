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

from accelerated.ops.loss import cross_entropy_loss_ids
from accelerated.training.llama_grad import loss_and_grads, train_forward
from accelerated.training.opt import OptContext
from reference.hparams import LlamaHParams
from reference.training.epoch import (  # the callback type and the loop, imported as they are
    EpochCallback,
    check_epoch_args,
    epoch_loop,
)
from reference.training.result import OptResult

__all__ = ["EpochCallback", "check_epoch_args", "epoch_loop", "opt_epoch"]


def _eval_datapoint(weights: dict, hparams: LlamaHParams, tokens, labels, opt_period: int):
    """The forward graph of ggml-opt (``backward = false``): loss and logits, no gradient."""
    logits, _ = train_forward(weights, hparams, tokens)
    label_ids = mx.array(np.asarray(labels, dtype=np.int32))
    loss = cross_entropy_loss_ids(logits, label_ids) * (1.0 / opt_period)
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
    check_epoch_args(opt_ctx, data, labels, idata_split)

    def train_step(tokens, target):
        loss, grads, logits = loss_and_grads(weights, hparams, tokens, target)
        opt_ctx.eval_backward(weights, grads)
        return loss, _argmax(logits)

    def eval_step(tokens, target):
        loss, logits = _eval_datapoint(weights, hparams, tokens, target, opt_ctx.opt_period)
        return loss, _argmax(logits)

    epoch_loop(train_step, eval_step, data, labels, idata_split, opt_ctx.opt_period,
               result_train, result_eval, callback)
# --8<-- [end:opt_epoch]
