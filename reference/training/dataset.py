r"""The training data: datapoints cut from one tokenized text, and the train/validation split.

``finetune`` tokenizes its ``-f`` text (with BOS) and calls ``common_opt_dataset_init(ctx,
tokens, stride = n_ctx / 2)`` (``common/common.cpp``). With $N$ tokens:

$$
\begin{aligned}
n_{data} &= \left\lfloor \frac{N - n_{ctx} - 1}{\mathrm{stride}} \right\rfloor, \\
\mathrm{data}_i &= t[i\,\mathrm{stride} : i\,\mathrm{stride} + n_{ctx}], \\
\mathrm{labels}_i &= t[i\,\mathrm{stride} + 1 : i\,\mathrm{stride} + n_{ctx} + 1],
\end{aligned}
$$

so datapoints overlap by half a context and every label is the next token. (The formula leaves
out the last window that would still fit; the specification keeps llama.cpp's count.)
ggml-opt asserts $n_{data} > 0$: a text needs at least $n_{ctx} + 1 + \mathrm{stride}$ tokens.
In C the subtraction is unsigned, so a shorter text wraps around instead of failing cleanly;
here it raises [`DatasetError`][reference.training.errors.DatasetError] with the count needed.

**The split.** ``idata_split = ndata * (1 - val_split)`` in float, truncated
(``-val-split``, default 0.05): datapoints ``[0, idata_split)`` train, ``[idata_split,
ndata)`` validate, in order, every epoch. There is **no shuffling**: ``llama_opt_epoch``
reads datapoint ``idata`` as it is (``ggml_opt_dataset_get_batch_host``).
"""

from __future__ import annotations

import numpy as np

from reference.training.errors import DatasetError


# --8<-- [start:dataset_ndata]
def dataset_ndata(n_tokens: int, n_ctx: int, stride: int) -> int:
    """The number of datapoints ``common_opt_dataset_init`` cuts:
    ``(n_tokens - n_ctx - 1) / stride``.

    Raises:
        DatasetError: if ``n_ctx`` or ``stride`` is not positive, or the text is too short for
            one datapoint (the message says how many tokens are needed).

    Examples:
        >>> dataset_ndata(100, 32, 16)
        4
        >>> dataset_ndata(48, 32, 16)  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        reference.training.errors.DatasetError: 48 tokens ... at least 49 tokens are needed
    """
    if n_ctx <= 0 or stride <= 0:
        raise DatasetError(f"n_ctx and stride must be positive, got n_ctx={n_ctx}, stride={stride}")
    needed = n_ctx + 1 + stride
    if n_tokens < needed:
        raise DatasetError(
            f"{n_tokens} tokens cannot make a datapoint of n_ctx={n_ctx} with stride {stride}: "
            f"at least {needed} tokens are needed"
        )
    return (n_tokens - n_ctx - 1) // stride
# --8<-- [end:dataset_ndata]


# --8<-- [start:opt_dataset_init]
def opt_dataset_init(
    tokens: np.ndarray, n_ctx: int, stride: int | None = None
) -> tuple[np.ndarray, np.ndarray]:
    """``common_opt_dataset_init``: the datapoints and their labels (the next tokens).

    Args:
        tokens: the tokenized text ``(N,)``.
        n_ctx: tokens per datapoint (the context size).
        stride: distance between datapoint starts; ``finetune``'s ``n_ctx // 2`` by default.

    Returns:
        ``(data, labels)``, each ``(ndata, n_ctx)`` int32 (ggml's I32 dataset).

    Raises:
        DatasetError: as [`dataset_ndata`][].

    Examples:
        >>> data, labels = opt_dataset_init(np.arange(12), n_ctx=4)
        >>> data.tolist(), labels[0].tolist()
        ([[0, 1, 2, 3], [2, 3, 4, 5], [4, 5, 6, 7]], [1, 2, 3, 4])
    """
    tokens = np.asarray(tokens)
    stride = n_ctx // 2 if stride is None else stride
    ndata = dataset_ndata(len(tokens), n_ctx, stride)
    starts = np.arange(ndata)[:, None] * stride + np.arange(n_ctx)  # (ndata, n_ctx)
    return tokens[starts].astype(np.int32), tokens[starts + 1].astype(np.int32)
# --8<-- [end:opt_dataset_init]


# --8<-- [start:idata_split]
def idata_split(ndata: int, val_split: float) -> int:
    r"""``finetune``'s split point: ``(int64_t)(ndata * (1.0f - val_split))``, in float.

    ``llama_opt_epoch`` asserts $0 \le$ ``idata_split`` $\le n_{data}$.

    Raises:
        DatasetError: if the truncated split falls outside ``[0, ndata]`` or is not finite (a
            ``val_split`` a little outside ``[0, 1]`` can still truncate into range, as in C).

    Examples:
        >>> idata_split(20, 0.05), idata_split(10, 0.05), idata_split(3, 0.0)
        (19, 9, 3)
    """
    split = np.float32(ndata) * (np.float32(1) - np.float32(val_split))  # float arithmetic
    if not np.isfinite(split) or not 0 <= int(split) <= ndata:  # int(): toward zero
        raise DatasetError(
            f"val_split={val_split} puts the split at {split}, outside [0, ndata={ndata}]"
        )
    return int(split)
# --8<-- [end:idata_split]
