"""``llamaref finetune``: llama.cpp's ``examples/training/finetune``, on either backend.

The flags are ``llama-finetune``'s (``common/arg.cpp``): ``-f`` (the text), ``-o`` (the
fine-tuned GGUF), ``-opt adamw|sgd``, ``-lr``, ``-lr-min``, ``-decay-epochs``, ``-wd``,
``-epochs``, ``-val-split``, ``-c``, ``-b``, ``-ub``, with llama.cpp's defaults. The model is
dequantized to float32 and every F32 tensor but the token embeddings is trained, as
``llama_opt_init`` does; the saved GGUF is all F32 with the source's metadata (tokenizer
included), so llama.cpp loads it
([`reference.training.save`][reference.training.save]).

On stderr: ``finetune``'s settings line, the ``epoch E lr=...`` lines (each new one once,
where llama.cpp logs it before every step), ``ggml_opt_epoch_callback_progress_bar``'s line
per datapoint ([`reference.training.result.progress_bar`][reference.training.result.progress_bar]),
and a final report: loss and accuracy per epoch, steps per second, peak memory
(``ru_maxrss``, MLX's peak on the accelerated backend) and the optimizer state (the gradient
accumulators, and AdamW's two moments; SGD keeps none). Beside the output, ``OUT.loss.png``
plots the training loss of every step and both losses per epoch. The semantics are
[`reference.training.finetune`][reference.training.finetune].

LoRA: ``--lora-rank N`` freezes the model and trains a rank-``N`` adapter on the attention
and FFN projections ([`reference.training.lora`][reference.training.lora]), with scale
``--lora-alpha / N`` (alpha defaults to ``N``: scale 1); ``--lora-out FILE`` receives the
adapter in llama.cpp's GGUF LoRA format (load it with ``--lora FILE`` in llama.cpp), and
``-o`` becomes optional: given, it receives the merged model ($W + sBA$).

Examples: ``llamaref finetune -f text.txt -o tuned.gguf -c 128 -b 128 -ub 128 -opt sgd -lr 1e-4``;
``llamaref finetune -f text.txt --lora-rank 8 --lora-out adapter.gguf -c 128 -ub 128 -lr 1e-3``.
"""

from __future__ import annotations

import argparse
import resource
import sys
import time
from pathlib import Path

import mlx.core as mx

from accelerated.training.finetune import TRAINER as MLX_TRAINER
from llamaref.backends import pick_backend, prepare_weights
from llamaref.common import (
    CLIError,
    add_context_flags,
    add_prompt_flags,
    log,
    model_path,
    prompt_text,
    read_prompt_file,
)
from reference.model_loader import load_model
from reference.tokenizer import load_tokenizer
from reference.training.finetune import (
    TRAINER,
    FinetuneParams,
    FinetuneResult,
    LoraParams,
    Trainer,
    check_finetune,
    finetune,
)
from reference.training.lora import save_lora_gguf
from reference.training.result import OptResult, progress_bar
from reference.training.save import model_save_to_file, source_metadata
from reference.training.schedule import lr_opt_init


def trainer_for(backend: str) -> Trainer:
    """The twin's [`Trainer`][reference.training.finetune.Trainer] for ``backend``."""
    return MLX_TRAINER if backend == "accelerated" else TRAINER


class ProgressBar:
    """``ggml_opt_epoch_callback_progress_bar`` on a stream; each loop's clock starts when the
    previous loop ends (``llama_opt_epoch``'s ``t_loop_start``)."""

    def __init__(self, out=None):
        self.out = out or sys.stderr
        self.t_start = time.perf_counter()

    def __call__(self, train: bool, result: OptResult, ibatch: int, ibatch_max: int,
                 batch_size: int) -> None:
        t_us = int((time.perf_counter() - self.t_start) * 1e6)
        self.out.write(progress_bar(train, result, ibatch, ibatch_max, batch_size, t_us))
        self.out.flush()
        if ibatch == ibatch_max:
            self.t_start = time.perf_counter()


class LrLog:
    """``finetune``'s log lines on stderr, each ``epoch E lr=...`` line once (llama.cpp
    repeats it before every optimizer step)."""

    def __init__(self, out=None):
        self.out = out or sys.stderr
        self.last = None

    def __call__(self, line: str) -> None:
        if line.startswith("epoch ") and line == self.last:
            return
        self.last = line if line.startswith("epoch ") else self.last
        self.out.write(line)
        self.out.flush()


def check_finetune_flags(args: argparse.Namespace) -> None:
    """What ``llamaref finetune`` refuses before the model is read."""
    if args.lora_rank is None and (args.lora_alpha is not None or args.lora_out is not None):
        raise CLIError("--lora-alpha and --lora-out need --lora-rank N (the adapter's rank)")
    if args.lora_rank is not None and args.lora_rank < 1:
        raise CLIError(f"--lora-rank = {args.lora_rank} must be >= 1")
    if args.lora_rank is not None and args.lora_out is None:
        raise CLIError("--lora-rank trains an adapter: give its file with --lora-out FNAME")
    if args.file is None:
        raise CLIError("no text: give it with -f FILE")
    if not Path(args.file).is_file():
        raise CLIError(f"-f {args.file}: no such file")
    if args.output is None and args.lora_rank is None:
        raise CLIError("no output file: give it with -o OUT.gguf")
    if args.ctx_size < 0:
        raise CLIError(f"-c/--ctx-size = {args.ctx_size} must be >= 0 (0: the model's)")
    if args.epochs < 0:
        raise CLIError(f"-epochs = {args.epochs} must be >= 0")


def plot_path(output: str | Path) -> Path:
    """The loss plot beside the output: ``OUT.gguf`` -> ``OUT.loss.png``.

    Examples:
        >>> str(plot_path("runs/tuned.gguf"))
        'runs/tuned.loss.png'
    """
    output = Path(output)
    return output.with_name(output.stem + ".loss.png")


def plot_losses(result: FinetuneResult, path: Path) -> None:
    """Training loss per step, and training / validation loss per epoch, as a PNG.

    Raises:
        CLIError: matplotlib is not installed.
    """
    try:
        import matplotlib
    except ImportError:
        raise CLIError("the loss plot needs matplotlib: pip install 'llamaref[bench]'") from None

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    steps, ends = [], []
    for e in result.epochs:
        start = len(steps)
        steps += list(e.train_losses)
        ends.append(start + len(e.train_losses))
    ax.plot(range(1, len(steps) + 1), steps, lw=1, alpha=0.6, label="train (per step)")
    ax.plot(ends, [e.train_loss[0] for e in result.epochs], "o-", label="train (epoch mean)")
    val = [(x, e.val_loss[0]) for x, e in zip(ends, result.epochs, strict=True) if e.val_losses]
    if val:
        ax.plot(*zip(*val, strict=True), "s-", label="validation (epoch mean)")
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("cross-entropy loss")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def peak_rss_mib() -> float:
    """``getrusage(RUSAGE_SELF).ru_maxrss`` in MiB (Linux reports KiB, macOS bytes)."""
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return rss / (1 << 20) if sys.platform == "darwin" else rss / 1024


def _mib(nbytes: int) -> str:
    return f"{nbytes / (1 << 20):.2f} MiB"


def report_lines(result: FinetuneResult, backend: str, optimizer: str, seconds: float) -> list:
    """The final report: per-epoch results, speed, memory."""
    lines = []
    for e in result.epochs:
        val = (f"val loss={e.val_loss[0]:.5f} acc={100 * e.val_accuracy[0]:.2f}%"
               if e.val_losses else "no validation data")
        lines.append(f"epoch {e.epoch}: lr={e.lr:.2g} train loss={e.train_loss[0]:.5f} "
                     f"acc={100 * e.train_accuracy[0]:.2f}% {val}")
    lines.append(f"{result.n_steps} steps in {seconds:.2f} s = "
                 f"{result.n_steps / seconds if seconds > 0 else 0.0:.3f} steps/s ({backend})")
    lines.append(f"optimizer {optimizer}: trainable {_mib(result.trainable_nbytes)}, "
                 f"gradients {_mib(result.grad_nbytes)}, moments {_mib(result.moments_nbytes)}")
    peak = f"peak memory: {peak_rss_mib():.1f} MiB (max RSS)"
    if backend == "accelerated":
        peak += f", MLX peak {_mib(mx.get_peak_memory())}"
    lines.append(peak)
    return lines


def cmd_finetune(args: argparse.Namespace) -> int:
    """Fine-tune a model on a text and save it, as ``llama-finetune``."""
    check_finetune_flags(args)
    path = model_path(args)
    if args.output is not None and not path.is_file():
        raise CLIError(f"-o writes a GGUF with the source's metadata and tokenizer: -m must be a "
                       f"GGUF file, not the folder {path} (convert it first)")
    hparams, weights = load_model(path)
    tokenizer = load_tokenizer(path)
    text = prompt_text(args, read_prompt_file(args.file))
    tokens = tokenizer.tokenize(text, add_special=True, parse_special=False)
    n_ctx = args.ctx_size or hparams.n_ctx_train
    lr = lr_opt_init(args.learning_rate, args.learning_rate_min, args.decay_epochs,
                     args.weight_decay, args.epochs)
    params = FinetuneParams(n_ctx, args.batch_size, args.ubatch_size, args.optimizer, lr,
                            args.val_split)
    lora = None
    if args.lora_rank is not None:
        alpha = float(args.lora_rank) if args.lora_alpha is None else args.lora_alpha
        lora = LoraParams(args.lora_rank, alpha)
    check_finetune(hparams, len(tokens), params, lora, weights)  # every refusal before the work
    backend = pick_backend(args.backend, hparams)
    log(f"llamaref: backend {backend}" + (" (auto)" if args.backend == "auto" else "")
        + f", {len(tokens)} tokens")
    metadata = source_metadata(path) if args.output is not None else None
    f32 = prepare_weights(weights, "reference")  # dequantized: the tensors ggml-opt trains
    t0 = time.perf_counter()
    result = finetune(f32, hparams, tokens, params, trainer_for(backend), ProgressBar(),
                      LrLog(), lora)
    seconds = time.perf_counter() - t0
    saved = []
    if result.adapter is not None:
        save_lora_gguf(args.lora_out, result.adapter)
        saved.append(args.lora_out)
    if args.output is not None:
        model_save_to_file(args.output, result.weights, hparams, metadata)
        saved.append(args.output)
    plot = plot_path(args.output or args.lora_out)
    plot_losses(result, plot)
    for line in report_lines(result, backend, args.optimizer, seconds):
        log(line)
    log(f"saved {', '.join(map(str, saved))} and {plot}")
    return 0


def add_finetune_command(sub) -> None:
    """Register ``llamaref finetune`` on the CLI's subparsers (the CLI calls this)."""
    p = sub.add_parser(
        "finetune", help="fine-tune a model on a text (like llama-finetune)",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description="llama.cpp's examples/training/finetune: datapoints of -c tokens (stride "
                    "-c/2), AdamW or SGD on every F32 tensor but the token embeddings, the "
                    "model saved as an F32 GGUF; a progress line per datapoint and a report "
                    "on stderr, the loss plot beside the output (OUT.loss.png).",
        epilog="examples:\n  llamaref finetune -f text.txt -o tuned.gguf -c 128 -b 128 -ub 128 "
               "-opt sgd -lr 1e-4 -epochs 2\n"
               "  llamaref finetune -f text.txt --lora-rank 8 --lora-out adapter.gguf -c 128 "
               "-ub 128 -lr 1e-3")
    p.add_argument("-m", "--model", help="a GGUF file or a HF directory (default: SmolLM2)")
    p.add_argument("--backend", default="auto", choices=("auto", "accelerated", "reference"),
                   help="auto: accelerated (MLX) when MLX's default device is a GPU, else "
                        "reference (NumPy) (default: auto)")
    p.add_argument("-f", "--file", metavar="FNAME",
                   help="the training text (one trailing newline dropped, escapes processed "
                        "unless --no-escape, as llama.cpp's -f)")
    add_prompt_flags(p)
    p.add_argument("-o", "--output", "--output-file", dest="output", metavar="FNAME",
                   help="the fine-tuned model (GGUF)")
    add_context_flags(
        p, ["ctx_size", "batch_size", "ubatch_size"],
        ctx_size=dict(default=0, help="tokens per datapoint (default: 0 = the model's context)"),
        batch_size=dict(help="logical batch size (default: 2048; clamped to -c)"),
        ubatch_size=dict(help="physical batch size (default: 512; must reach -c)"))
    o = p.add_argument_group("optimizer (llama.cpp names and defaults)")
    o.add_argument("-opt", "--optimizer", default="adamw", choices=("adamw", "sgd"),
                   help="adamw or sgd (default: adamw)")
    o.add_argument("-lr", "--learning-rate", type=float, default=1e-5, metavar="ALPHA",
                   help="adamw or sgd optimizer alpha (default: 1e-05); sgd wants ~10x")
    o.add_argument("-lr-min", "--learning-rate-min", type=float, default=-1.0, metavar="ALPHA",
                   help="(if > 0) final learning rate after decay (default: -1)")
    o.add_argument("-decay-epochs", "--learning-rate-decay-epochs", dest="decay_epochs",
                   type=float, default=-1.0, metavar="N",
                   help="(if > 0) decay the learning rate to -lr-min over this many epochs "
                        "(default: -1)")
    o.add_argument("-wd", "--weight-decay", type=float, default=0.0, metavar="WD",
                   help="weight decay, 0 is off (default: 0)")
    o.add_argument("-epochs", "--epochs", type=int, default=2, metavar="N",
                   help="number of epochs (default: 2)")
    o.add_argument("-val-split", "--val-split", type=float, default=0.05, metavar="FRACTION",
                   help="fraction of the datapoints used for validation (default: 0.05)")
    lo = p.add_argument_group("LoRA")
    lo.add_argument("--lora-rank", type=int, default=None, metavar="N",
                    help="train a LoRA adapter of rank N instead of the model (default: off)")
    lo.add_argument("--lora-alpha", type=float, default=None, metavar="N",
                    help="the adapter's alpha; its scale is alpha / rank (default: the rank)")
    lo.add_argument("--lora-out", default=None, metavar="FNAME",
                    help="the adapter's GGUF file (llama.cpp's LoRA format); -o is then "
                         "optional and receives the merged model")
    p.set_defaults(func=cmd_finetune)
