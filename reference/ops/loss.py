r"""``ggml_cross_entropy_loss`` and its backward: the loss that training appends to a model.

``ggml_opt`` ends the model's graph with one node, ``cross_entropy_loss(logits, labels)``, the
mean over the rows (tokens) of the cross-entropy of each row's softmax against its labels
(llama.cpp's labels are the one-hot rows of the next tokens):

$$ L = -\frac{1}{n_{rows}} \sum_{t} \sum_{c} \ell_{t,c}\, \log\mathrm{softmax}(z_t)_c , \qquad
   \bar z_t = \frac{\bar L}{n_{rows}} \big(\mathrm{softmax}(z_t) - \ell_t\big). $$

Its backward, ``ggml_cross_entropy_loss_back``, is where the gradient of training starts
([`reference.training.llama_grad`][reference.training.llama_grad]). As ggml's CPU kernels
(``ggml_compute_forward_cross_entropy_loss_f32`` and its ``_back``), the sums over a row are
accumulated in double; the loss's ``expf`` and ``logf`` are C's, rounded once to float (see
[`libm`][reference.ops.rope.libm]), so that the float32 loss is ggml's bit for bit.
"""

from __future__ import annotations

import numpy as np

from reference.ops.errors import OpShapeError
from reference.ops.rope import libm


def check_cross_entropy_args(logits_shape: tuple, labels_shape: tuple, op: str) -> None:
    """The loss's contract: logits and labels of one 2-D shape ``(n_rows, n_classes)``.

    Shared by both ops and by the MLX twin.

    Args:
        logits_shape: the shape of the logits.
        labels_shape: the shape of the labels.
        op: the op's name, for the message.

    Raises:
        OpShapeError: if the shapes are not the same 2-D shape.

    Examples:
        >>> check_cross_entropy_args((2, 3), (2, 4), "cross_entropy_loss")  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        reference.ops.errors.OpShapeError: cross_entropy_loss: logits and labels must both be ...
    """
    if len(logits_shape) != 2 or tuple(labels_shape) != tuple(logits_shape):
        raise OpShapeError(
            f"{op}: logits and labels must both be (n_rows, n_classes); got "
            f"logits.shape={tuple(logits_shape)}, labels.shape={tuple(labels_shape)}"
        )


def _log_softmax(logits: np.ndarray) -> np.ndarray:
    """``ggml_vec_log_soft_max_f32``: ``x - max - log(sum(exp(x - max)))``, the sum in double.

    ggml sums ``expf(x - max)`` in double and returns ``logf(sum)``: C converts the double sum
    to float for ``logf``, hence the rounding of the sum to the logits' dtype before the log.
    """
    shifted = logits - np.max(logits, axis=-1, keepdims=True)  # (n_rows, n_classes)
    total = np.sum(libm(np.exp, shifted), axis=-1, dtype=np.float64, keepdims=True)  # (n_rows, 1)
    return shifted - libm(np.log, total.astype(logits.dtype))  # (n_rows, n_classes)


# --8<-- [start:cross_entropy_loss]
def cross_entropy_loss(logits: np.ndarray, labels: np.ndarray) -> np.floating:
    r"""``ggml_cross_entropy_loss(logits, labels)``: the mean over rows of the cross-entropy.

    $$ L = -\frac{1}{n_{rows}} \sum_{t} \sum_{c} \ell_{t,c}\, \log\mathrm{softmax}(z_t)_c , $$

    with $\ell$ a probability row per token (llama.cpp's labels are one-hot rows of the next
    token). The log-softmax is $z - \max z - \log\sum e^{z - \max z}$, its sum accumulated in
    double, and so is each row's sum over the classes (``ggml_vec_sum_f32``); the rows' sums
    are then added in the logits' dtype and scaled by $-1/n_{rows}$
    (``ggml_compute_forward_cross_entropy_loss_f32``).

    Args:
        logits: $z$, ``(n_rows, n_classes)`` (``(n_tokens, n_vocab)``).
        labels: $\ell$, same shape.

    Returns:
        The scalar loss, in the dtype of ``logits``.

    Raises:
        OpShapeError: if the shapes are not the same 2-D shape.

    Examples:
        >>> import numpy as np
        >>> float(cross_entropy_loss(np.zeros((2, 4)), np.eye(4)[[1, 3]]))   # log(4)
        1.3862943611198906
    """
    check_cross_entropy_args(logits.shape, labels.shape, "cross_entropy_loss")
    terms = _log_softmax(logits) * labels.astype(logits.dtype)  # (n_rows, n_classes)
    per_row = np.sum(terms, axis=-1, dtype=np.float64).astype(logits.dtype)  # ggml_vec_sum_f32
    t = logits.dtype.type
    return t(np.sum(per_row, dtype=logits.dtype) * (t(-1) / t(logits.shape[0])))


# --8<-- [end:cross_entropy_loss]


# --8<-- [start:cross_entropy_loss_back]
def cross_entropy_loss_back(grad: float, logits: np.ndarray, labels: np.ndarray) -> np.ndarray:
    r"""``ggml_cross_entropy_loss_back``: the gradient of the mean cross-entropy for the logits.

    $$ \bar z_t = \frac{\bar L}{n_{rows}} \big(\mathrm{softmax}(z_t) - \ell_t\big) $$

    (for rows $\ell_t$ that sum to 1). $\bar L$ is the loss's own gradient: 1, or
    $1/\mathrm{opt\_period}$ when ggml-opt scales the loss for gradient accumulation.

    Args:
        grad: $\bar L$, a scalar.
        logits: the forward's ``(n_rows, n_classes)``.
        labels: the forward's labels, same shape.

    Returns:
        $\bar z$, shape and dtype of ``logits``.

    Raises:
        OpShapeError: if the shapes are not the same 2-D shape.

    Examples:
        >>> import numpy as np
        >>> cross_entropy_loss_back(1.0, np.zeros((1, 4)), np.eye(4)[[2]])
        array([[ 0.25,  0.25, -0.75,  0.25]])
    """
    check_cross_entropy_args(logits.shape, labels.shape, "cross_entropy_loss_back")
    t = logits.dtype.type
    e = np.exp(logits - np.max(logits, axis=-1, keepdims=True))  # (n_rows, n_classes)
    total = np.sum(e, axis=-1, dtype=np.float64, keepdims=True)  # ggml_float
    softmax = e * (1.0 / total).astype(logits.dtype)  # ggml_vec_scale_f32(1.0/sum)
    d_by_nr = t(grad) / t(logits.shape[0])
    return ((softmax - labels.astype(logits.dtype)) * d_by_nr).astype(logits.dtype, copy=False)


# --8<-- [end:cross_entropy_loss_back]
