r"""What an epoch reports: ggml-opt's loss and accuracy with uncertainties, and the progress line.

``ggml_opt_eval`` appends to a ``ggml_opt_result`` after every ubatch (a *physical batch*): its
loss (a float, the ubatch's mean cross-entropy scaled by $1/\mathrm{opt\_period}$), the
argmax predictions, and the number of rows whose prediction equals the label's argmax;
``ndata`` counts rows (tokens). Then (``ggml_opt_result_loss`` / ``_accuracy``), with $B$
batches, losses $\ell_b$ rescaled by ``opt_period`` (in float), and $n$ rows:

$$
\bar\ell = \frac{1}{B}\sum_b \ell_b,\qquad
\sigma_{\bar\ell} = \sqrt{\frac{\overline{\ell^2} - \bar\ell^2}{B - 1}},\qquad
a = \frac{n_{correct}}{n},\qquad \sigma_a = \sqrt{\frac{a(1 - a)}{n - 1}},
$$

sums in double, but each square $\ell_b^2$ is rounded to float before it is added
(``loss_scaled*loss_scaled`` is a float product): identical losses therefore give an
uncertainty of the order of $\sqrt{2^{-24}}\,\bar\ell$, not 0, and NaN when the rounding
makes the variance negative, exactly as llama.cpp prints them. $\sigma_{\bar\ell}$ is NaN
with fewer than 2 batches (and the loss 0 with none), $\sigma_a$ with fewer than 2 rows.

``ggml_opt_epoch_callback_progress_bar`` prints after every ubatch, to stderr::

    train: [████▉   ] data=0000040/0000064 loss=3.46574±0.00012 acc=4.38±1.62% t=00:00:01 ETA=...

an 8-cell bar of eighth blocks (U+2588 full .. U+258F one eighth), ``data`` =
``ibatch * batch_size`` with ``batch_size`` the ubatch's tokens, the elapsed time and the ETA
$t \cdot (\mathrm{ibatch\_max} - \mathrm{ibatch}) / \mathrm{ibatch}$ in integer microseconds, and
a newline after the last ubatch. ``llama_opt_epoch`` passes ``ibatch = idata *
ubatch_per_ctx + pos / n_ubatch + 1`` and ``ibatch_max = ndata_in_loop * ubatch_per_ctx``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from reference.training.errors import TrainingError


# --8<-- [start:OptResult]
@dataclass
class OptResult:
    """``ggml_opt_result``: what the ubatches of an epoch (train or validation) produced.

    Examples:
        >>> r = OptResult()
        >>> r.add(np.float32(2.0), np.array([1, 2]), np.array([1, 3]), opt_period=1)
        >>> r.add(np.float32(3.0), np.array([0, 0]), np.array([0, 0]), opt_period=1)
        >>> r.loss(), r.accuracy()
        ((2.5, 0.5), (0.75, 0.25))
    """

    ndata: int = 0  # rows (tokens) seen
    losses: list[float] = field(default_factory=list)  # one float per ubatch, as ggml stores it
    pred: list[int] = field(default_factory=list)
    ncorrect: int = 0
    opt_period: int = -1
    loss_per_datapoint: bool = False

    def add(
        self, loss: float, pred: np.ndarray, label_ids: np.ndarray, opt_period: int,
        loss_per_datapoint: bool = True,
    ) -> None:
        """The result half of ``ggml_opt_eval`` for one ubatch.

        Args:
            loss: the ubatch's (scaled) loss, as the loss node holds it.
            pred: ``argmax(logits)`` per row ``(n_rows,)``.
            label_ids: ``argmax(labels)`` per row ``(n_rows,)``.
            opt_period: the context's ``opt_period``.
            loss_per_datapoint: True for the cross-entropy loss.

        Raises:
            TrainingError: the batch size or ``opt_period`` changed within one result
                (ggml asserts), or ``pred`` and ``label_ids`` differ in length.
        """
        n = len(pred)
        if len(label_ids) != n:
            raise TrainingError(f"pred ({n}) and label_ids ({len(label_ids)}) differ in length")
        if self.ndata == 0:
            self.loss_per_datapoint, self.opt_period = loss_per_datapoint, opt_period
        elif (self.loss_per_datapoint, self.opt_period) != (loss_per_datapoint, opt_period):
            raise TrainingError("loss type or opt_period changed within one result")
        if self.ndata != n * len(self.losses):
            raise TrainingError("varying batch size not supported (ggml_opt_eval asserts)")
        self.ndata += n
        self.losses.append(float(np.float32(loss)))
        self.pred.extend(int(p) for p in pred)
        self.ncorrect += int(np.sum(np.asarray(pred) == np.asarray(label_ids)))

    def loss(self) -> tuple[float, float]:
        """``ggml_opt_result_loss``: the mean loss per ubatch and its uncertainty."""
        nbatches = len(self.losses)
        if nbatches == 0:
            return 0.0, math.nan
        scale = self.opt_period if self.loss_per_datapoint else 1
        scaled = [np.float32(x) * np.float32(scale) for x in self.losses]  # float
        total = sum(float(x) for x in scaled)  # accumulated in double, in order
        total_sq = sum(float(x * x) for x in scaled)  # each square rounded to float first
        mean = total / nbatches
        loss = mean if self.loss_per_datapoint else total
        if nbatches < 2:
            return loss, math.nan
        var_sum = total_sq / nbatches - mean * mean  # variance without Bessel's correction
        with np.errstate(invalid="ignore"):  # a rounding-negative variance gives NaN, as in C
            if self.loss_per_datapoint:
                return loss, float(np.sqrt(var_sum / (nbatches - 1)))
            return loss, float(np.sqrt(var_sum * nbatches / (nbatches - 1)))

    def accuracy(self) -> tuple[float, float]:
        """``ggml_opt_result_accuracy``: the fraction of rows predicted right, and its error."""
        if self.ndata == 0:
            return math.nan, math.nan  # 0.0 / 0.0 in C
        a = self.ncorrect / self.ndata
        if self.ndata < 2:
            return a, math.nan
        return a, math.sqrt(a * (1.0 - a) / (self.ndata - 1))

    def reset(self) -> None:
        """``ggml_opt_result_reset`` (``finetune`` calls it after every epoch)."""
        self.ndata, self.losses, self.pred, self.ncorrect = 0, [], [], 0
# --8<-- [end:OptResult]


def _c_f(x: float, prec: int) -> str:
    """C's ``%.{prec}lf``: as Python's, but NaN prints ``nan`` or ``-nan`` by its sign (glibc)."""
    if math.isnan(x):
        return "-nan" if math.copysign(1.0, x) < 0 else "nan"
    return f"{x:.{prec}f}"


def _hms(us: int) -> str:
    """Microseconds as ``%02ld:%02ld:%02ld`` (hours, minutes, seconds; truncated)."""
    s = us // 1_000_000
    return f"{s // 3600:02d}:{s % 3600 // 60:02d}:{s % 60:02d}"


# --8<-- [start:progress_bar]
BAR_BLOCKS = ("\u2588", "\u2589", "\u258a", "\u258b", "\u258c", "\u258d", "\u258e", "\u258f")


def progress_bar_cells(ibatch: int, ibatch_max: int) -> str:
    """The 8 cells of the bar: cell ``j`` shows how far ``ibatch`` has come in its eighth.

    Cell ``j`` shows fill level $k$ (eighths) for the largest $k$ with
    ``ibatch_max * (8j + k) / 8 < 8 * ibatch`` (integer division). The comparison is strict,
    so the last cell of a finished loop shows 7/8, as llama.cpp prints it.

    Examples:
        >>> progress_bar_cells(1, 16), progress_bar_cells(16, 16)   # never quite full
        ('▍       ', '███████▉')
    """
    cells = []
    for j in range(8):
        # the first fill level k (8/8 .. 1/8) with ibatch_max*(8j + k)/8 < 8*ibatch
        level = next((k for k in range(8, 0, -1) if ibatch_max * (8 * j + k) // 8 < 8 * ibatch), 0)
        cells.append(BAR_BLOCKS[8 - level] if level else " ")
    return "".join(cells)


def progress_bar(
    train: bool, result: OptResult, ibatch: int, ibatch_max: int, batch_size: int, t_us: int
) -> str:
    r"""``ggml_opt_epoch_callback_progress_bar``: the text it writes to stderr for one ubatch.

    Args:
        train: the training loop (``"train: "``) or the validation loop (``"val:   "``).
        result: the loop's result so far.
        ibatch: ubatches done, from 1.
        ibatch_max: ubatches in the loop.
        batch_size: tokens per ubatch (``inputs->ne[1]``).
        t_us: microseconds since the loop started.

    Returns:
        The line, ending in ``" \r"``, plus ``"\n"`` after the last ubatch.

    Examples:
        >>> r = OptResult()
        >>> r.add(np.float32(3.5), np.array([1, 2, 3, 4]), np.array([1, 0, 0, 0]), opt_period=1)
        >>> line = progress_bar(True, r, 1, 4, 4, 2_500_000)
        >>> line[:48]
        'train: [█▉      ] data=0000004/0000016 loss=3.50'
        >>> line[48:]
        '000±nan acc=25.00±25.00% t=00:00:02 ETA=00:00:07 \r'
    """
    loss, loss_unc = result.loss()
    acc, acc_unc = result.accuracy()
    eta_us = t_us * (ibatch_max - ibatch) // ibatch
    line = (
        f"{'train: ' if train else 'val:   '}[{progress_bar_cells(ibatch, ibatch_max)}] "
        f"data={ibatch * batch_size:07d}/{ibatch_max * batch_size:07d} "
        f"loss={_c_f(loss, 5)}±{_c_f(loss_unc, 5)} "
        f"acc={_c_f(100.0 * acc, 2)}±{_c_f(100.0 * acc_unc, 2)}% "
        f"t={_hms(t_us)} ETA={_hms(eta_us)} \r"
    )
    return line + "\n" if ibatch == ibatch_max else line
# --8<-- [end:progress_bar]
