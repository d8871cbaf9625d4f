r"""Twin of [`reference.ops.loss`][reference.ops.loss]: ``ggml_cross_entropy_loss`` and its backward
on MLX.

Lazy MLX ops; the sums over a row are float32 (``mx.logsumexp``, ``mx.softmax(precise=True)``)
where ggml and the reference accumulate in double. [`cross_entropy_loss_ids`][] is the same
loss with the labels given as their ids, the one-hot rows ``ggml_opt`` builds left unbuilt (a
row of ``n_vocab`` floats per token): it is what the twin's training differentiates
([`accelerated.training.llama_grad.loss_and_grads`][accelerated.training.llama_grad.loss_and_grads]).
"""

from __future__ import annotations

import mlx.core as mx

from accelerated.ops.convert import as_mx
from reference.ops.loss import check_cross_entropy_args


# --8<-- [start:cross_entropy_loss]
def cross_entropy_loss(logits: mx.array, labels: mx.array) -> mx.array:
    r"""Twin of [`reference.ops.loss.cross_entropy_loss`][reference.ops.loss.cross_entropy_loss].

    $-\frac{1}{n_{rows}} \sum_t \sum_c \ell_{t,c}\,(z_{t,c} - \log\sum_{c'} e^{z_{t,c'}})$,
    a scalar ``mx.array`` in the dtype of ``logits``.

    Examples:
        >>> import numpy as np
        >>> round(cross_entropy_loss(np.zeros((2, 4)), np.eye(4)[[1, 3]]).item(), 6)  # log(4)
        1.386294
    """
    logits, labels = as_mx(logits), as_mx(labels)
    check_cross_entropy_args(logits.shape, labels.shape, "cross_entropy_loss")
    log_p = logits - mx.logsumexp(logits, axis=-1, keepdims=True)  # (n_rows, n_classes)
    return -mx.sum(log_p * labels.astype(logits.dtype)) / logits.shape[0]  # ()


# --8<-- [end:cross_entropy_loss]


# --8<-- [start:cross_entropy_loss_back]
def cross_entropy_loss_back(grad: float, logits: mx.array, labels: mx.array) -> mx.array:
    r"""Twin of
    [`reference.ops.loss.cross_entropy_loss_back`][reference.ops.loss.cross_entropy_loss_back].

    $\frac{\bar L}{n_{rows}} (\mathrm{softmax}(z_t) - \ell_t)$, the softmax's sum in float32.

    Examples:
        >>> import numpy as np
        >>> cross_entropy_loss_back(1.0, np.zeros((1, 4)), np.eye(4)[[2]]).tolist()
        [[0.25, 0.25, -0.75, 0.25]]
    """
    logits, labels = as_mx(logits), as_mx(labels)
    check_cross_entropy_args(logits.shape, labels.shape, "cross_entropy_loss_back")
    p = mx.softmax(logits, axis=-1, precise=True)  # (n_rows, n_classes)
    return ((p - labels.astype(logits.dtype)) * (grad / logits.shape[0])).astype(logits.dtype)


# --8<-- [end:cross_entropy_loss_back]


def cross_entropy_loss_ids(logits: mx.array, labels: mx.array) -> mx.array:
    r"""[`cross_entropy_loss`][] of one-hot labels, given as their ids.

    $\frac{1}{n}\sum_t \big(\log\sum_c e^{z_{t,c}} - z_{t,\ell_t}\big)$: the same loss as the
    product with the one-hot rows, without building them.

    Args:
        logits: $z$, ``(n_tokens, n_vocab)``.
        labels: the id of each row's label, ``(n_tokens,)`` integers in ``[0, n_vocab)``
            (the caller checks them).

    Returns:
        The scalar loss, lazy.

    Examples:
        >>> round(cross_entropy_loss_ids(mx.zeros((2, 4)), mx.array([1, 3])).item(), 6)
        1.386294
    """
    picked = mx.take_along_axis(logits, labels[:, None], axis=-1)[:, 0]  # (n_tokens,)
    return mx.mean(mx.logsumexp(logits, axis=-1) - picked)
