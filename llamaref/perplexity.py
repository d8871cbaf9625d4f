r"""``llamaref perplexity``: llama-perplexity's files and console lines, on either backend.

The numbers and the bytes are the specification's
([`reference.tools.perplexity`][reference.tools.perplexity]): which chunks are decoded, how
every token is scored, what a base file's records hold. What is here is what
``llama-perplexity`` does around them:

- the base file by path: ``--kl-divergence-base FILE`` is written under a temporary name
  beside ``FILE`` and renamed once complete, so a failed run leaves nothing behind
  ([`run_perplexity`][]); reading one checks its header and size before anything runs
  ([`read_logits_file`][]);
- the console lines, with llama.cpp's text: the running ``[i]ppl,`` estimates on stdout and
  ``Final estimate: PPL = x +/- y`` on stderr ([`final_line`][]); in a KL-divergence run the
  per-chunk table ([`kld_chunk_line`][]) and, from 100 scored tokens on, the three sections of
  statistics ([`kld_report`][]) on stdout;
- the command and its flags ([`cmd_perplexity`][]).

Examples: ``llamaref perplexity -f wiki.test.raw -c 512``,
``llamaref perplexity --kl-divergence-base base.bin --kl-divergence``.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import BinaryIO

import numpy as np

from llamaref.backends import make_context, pick_backend, prepare_weights
from llamaref.common import (
    CLIError,
    add_context_flags,
    add_model_flags,
    add_prompt_flags,
    log,
    model_path,
    prompt_text,
    read_prompt_file,
)
from reference.context import Context
from reference.model_loader import load_model
from reference.tokenizer import load_tokenizer
from reference.tools.perplexity import (
    KLDStats,
    LogitsFile,
    LogitsFileError,
    PerplexityResult,
    PerplexitySums,
    context_params,
    kl_divergence,
    kl_divergence_plan,
    median,
    percentile,
    perplexity,
    perplexity_plan,
    plan_chunks,
    read_logits,
)

Emit = Callable[[str], None]

#: the header of the per-chunk table of a KL-divergence run
KLD_TABLE_HEADER = ("chunk             PPL               ln(PPL(Q)/PPL(base))          "
                    "KL Divergence              Δp RMS            Same top p")
#: llama.cpp prints the final sections only from this many tokens on
KLD_MIN_COUNT = 100


def _quiet(_: str) -> None:
    return None


def _write(text: str) -> None:
    sys.stdout.write(text)
    sys.stdout.flush()


# ---- the console lines ---------------------------------------------------------------------

# --8<-- [start:console_lines]
def timing_line(name: str, seconds: float, n_chunk: int, n_seq: int) -> str:
    """llama-perplexity's ``%.2f seconds per pass - ETA`` line, after the first decodes.

    Examples:
        >>> timing_line("perplexity", 1.5, 10000, 4)
        'perplexity: 1.50 seconds per pass - ETA 1 hours 2.50 minutes'
    """
    total = int(seconds * n_chunk / n_seq)
    hours = f"{total // 3600} hours " if total >= 3600 else ""
    return (f"{name}: {seconds:.2f} seconds per pass - ETA {hours}{total % 3600 / 60.0:.2f} "
            "minutes")


def final_line(sums: PerplexitySums) -> str:
    r"""``Final estimate: PPL = x +/- y`` (or llama.cpp's complaint when $\sigma^2 \le 0$).

    Examples:
        >>> s = PerplexitySums()
        >>> s.add(np.array([1.0, 2.0, 3.0]))
        >>> final_line(s)
        'Final estimate: PPL = 7.3891 +/- 4.26607'
    """
    if math.isnan(sums.uncertainty):
        return "Unexpected negative standard deviation of log(prob)"
    return f"Final estimate: PPL = {sums.ppl:.4f} +/- {sums.uncertainty:.5f}"


def kld_chunk_line(stats: KLDStats, chunk: int) -> str:
    """The per-chunk row of the table: the running values after chunk ``chunk`` (from 1)."""
    ppl, ppl_unc = stats.ppl()
    ratio, ratio_unc = stats.log_ppl_ratio()
    kld, kld_unc = stats.mean_kld()
    rms, rms_unc = stats.rms_p_diff()
    top, top_unc = stats.same_top()
    return (f"{chunk:4d}    {ppl:9.4f} ± {ppl_unc:9.4f}    {ratio:10.5f} ± {ratio_unc:10.5f}"
            f"    {kld:10.5f} ± {kld_unc:10.5f}    {100 * rms:6.3f} ± {100 * rms_unc:6.3f} %"
            f"    {100 * top:6.3f} ± {100 * top_unc:6.3f} %")


def kld_report(stats: KLDStats) -> list[str]:
    """The three final sections, line by line (perplexity.cpp:1890-1984)."""
    return _ppl_section(stats) + [""] + _kld_section(stats) + [""] + _p_section(stats)
# --8<-- [end:console_lines]


def _ppl_section(stats: KLDStats) -> list[str]:
    (ppl, ppl_unc), (ppl_base, ppl_base_unc) = stats.ppl(), stats.ppl_base()
    ratio, ratio_unc = stats.log_ppl_ratio()
    diff, diff_unc = stats.ppl_diff()
    return [
        "====== Perplexity statistics ======",
        f"Mean PPL(Q)                   : {ppl:10.6f} ± {ppl_unc:10.6f}",
        f"Mean PPL(base)                : {ppl_base:10.6f} ± {ppl_base_unc:10.6f}",
        f"Cor(ln(PPL(Q)), ln(PPL(base))): {100 * stats.correlation():6.2f}%",
        f"Mean ln(PPL(Q)/PPL(base))     : {ratio:10.6f} ± {ratio_unc:10.6f}",
        f"Mean PPL(Q)/PPL(base)         : {math.exp(ratio):10.6f} ± "
        f"{math.exp(ratio) * ratio_unc:10.6f}",
        f"Mean PPL(Q)-PPL(base)         : {diff:10.6f} ± {diff_unc:10.6f}",
    ]


def _kld_section(stats: KLDStats) -> list[str]:
    v = stats.sorted_kld()
    mean, unc = stats.mean_kld()
    lines = ["====== KL divergence statistics ======",
             f"Mean    KLD: {mean:10.6f} ± {unc:10.6f}", f"Maximum KLD: {v[-1]:10.6f}"]
    for label, frac in (("99.9%", 0.999), ("99.0%", 0.990), ("95.0%", 0.950),
                        ("90.0%", 0.900)):
        lines.append(f"{label}   KLD: {percentile(v, frac):10.6f}")
    lines.append(f"Median  KLD: {median(v):10.6f}")
    for label, frac in (("10.0%", 0.100), (" 5.0%", 0.050), (" 1.0%", 0.010),
                        (" 0.1%", 0.001)):
        lines.append(f"{label}   KLD: {percentile(v, frac):10.6f}")
    return lines + [f"Minimum KLD: {v[0]:10.6f}"]


def _p_section(stats: KLDStats) -> list[str]:
    v = stats.sorted_p_diff()
    mean, unc = stats.mean_p_diff()
    lines = ["====== Token probability statistics ======",
             f"Mean    Δp: {100 * mean:6.3f} ± {100 * unc:5.3f} %",
             f"Maximum Δp: {100 * v[-1]:6.3f}%"]
    for label, frac in (("99.9%", 0.999), ("99.0%", 0.990), ("95.0%", 0.950),
                        ("90.0%", 0.900), ("75.0%", 0.750)):
        lines.append(f"{label}   Δp: {100 * percentile(v, frac):6.3f}%")
    lines.append(f"Median  Δp: {100 * median(v):6.3f}%")
    for label, frac in (("25.0%", 0.250), ("10.0%", 0.100), (" 5.0%", 0.050),
                        (" 1.0%", 0.010), (" 0.1%", 0.001)):
        lines.append(f"{label}   Δp: {100 * percentile(v, frac):6.3f}%")
    rms, rms_unc = stats.rms_p_diff()
    top, top_unc = stats.same_top()
    return lines + [f"Minimum Δp: {100 * v[0]:6.3f}%",
                    f"RMS Δp    : {100 * rms:6.3f} ± {100 * rms_unc:5.3f} %",
                    f"Same top p: {100 * top:6.3f} ± {100 * top_unc:5.3f} %"]


# ---- the base file by path -----------------------------------------------------------------

@contextmanager
def _open_base(path: Path) -> Iterator[BinaryIO]:
    """``path`` open for binary reading; an OS error becomes a [`LogitsFileError`][]."""
    try:
        stream = open(path, "rb")  # noqa: SIM115 (closed below)
    except OSError as e:
        raise LogitsFileError(f"{path}: cannot read the base logits file ({e.strerror})") from e
    with stream:
        yield stream


# --8<-- [start:read_logits_file]
def read_logits_file(path: str | os.PathLike, n_vocab: int) -> LogitsFile:
    """Read and check the base file at ``path`` against a model of ``n_vocab`` tokens
    ([`read_logits`][reference.tools.perplexity.read_logits] on the open file).

    Raises:
        LogitsFileError: a file that cannot be read, and every refusal of
            [`read_logits`][reference.tools.perplexity.read_logits].

    Examples:
        >>> read_logits_file("/nonexistent.bin", 32)
        Traceback (most recent call last):
        ...
        reference.tools.perplexity.LogitsFileError: /nonexistent.bin: cannot read the base logits file (No such file or directory)
    """  # noqa: E501
    path = Path(path)
    with _open_base(path) as stream:
        return read_logits(stream, n_vocab, str(path))
# --8<-- [end:read_logits_file]


def _temp_path(path: Path) -> Path:
    return path.with_name(f".{path.name}.{os.getpid()}.tmp")


@contextmanager
def _written_atomically(path: Path) -> Iterator[BinaryIO]:
    """A stream onto a temporary file beside ``path``, renamed to ``path`` when the block
    ends and removed when it raises."""
    temp = _temp_path(path)
    try:
        with open(temp, "wb") as stream:
            yield stream
    except BaseException:
        temp.unlink(missing_ok=True)
        raise
    os.replace(temp, path)


# ---- the two runs --------------------------------------------------------------------------

# --8<-- [start:run_perplexity]
def run_perplexity(ctx: Context, tokens: Sequence[int], n_ctx: int, n_batch: int = 2048,
                   n_chunks: int = -1, ppl_stride: int = 0, bos: int | None = None,
                   base_path: str | os.PathLike | None = None, out: Emit = _quiet,
                   info: Emit = _quiet) -> PerplexityResult:
    """``llama-perplexity``: [`perplexity`][reference.tools.perplexity.perplexity] with its
    file and its lines.

    Args:
        ctx: as [`perplexity`][reference.tools.perplexity.perplexity].
        tokens: as [`perplexity`][reference.tools.perplexity.perplexity].
        n_ctx: as [`perplexity`][reference.tools.perplexity.perplexity].
        n_batch: as [`perplexity`][reference.tools.perplexity.perplexity].
        n_chunks: as [`perplexity`][reference.tools.perplexity.perplexity].
        ppl_stride: as [`perplexity`][reference.tools.perplexity.perplexity].
        bos: as [`perplexity`][reference.tools.perplexity.perplexity].
        base_path: write the base logits file there (``--kl-divergence-base``); standard
            mode only. Written to a temporary name and renamed once complete.
        out: receives what llama.cpp prints on stdout: the running ``[i]ppl,`` estimates,
            then a newline.
        info: receives llama.cpp's log lines (stderr), the final estimate among them.

    Raises:
        PerplexityError: as [`perplexity_plan`][reference.tools.perplexity.perplexity_plan]
            (before anything is written or printed), a failed decode (the temporary file
            is removed).

    Examples:
        >>> from reference.context import Context
        >>> from reference.testing import tiny_hparams, random_weights
        >>> hp = tiny_hparams()
        >>> ctx = Context(hp, random_weights(hp), **context_params(8, 16))
        >>> text = np.random.default_rng(0).integers(3, 32, 40)
        >>> printed = []
        >>> res = run_perplexity(ctx, text, n_ctx=8, n_batch=16, bos=1, out=printed.append)
        >>> print("".join(printed).strip())
        [1]105.6618,[2]56.7590,[3]44.2787,[4]45.0933,[5]51.0980,
    """
    tokens = np.asarray(tokens, dtype=np.int32)
    plan = perplexity_plan(ctx, len(tokens), n_ctx, n_batch, n_chunks, ppl_stride,
                           base_path is not None)
    info(f"perplexity: calculating perplexity over {plan.n_chunk} chunks, n_ctx={n_ctx}, "
         f"batch_size={plan.n_batch}, n_seq={plan.n_seq}")
    t0 = time.perf_counter()

    def on_chunk(chunk: int, sums: PerplexitySums) -> None:
        if chunk == 0:
            info(timing_line("perplexity", time.perf_counter() - t0, plan.n_chunk, plan.n_seq))
        out(f"[{chunk + 1}]{sums.ppl:.4f},")

    if base_path is None:
        result = perplexity(ctx, tokens, n_ctx, n_batch, n_chunks, ppl_stride, bos,
                            on_chunk=on_chunk)
    else:
        info(f"perplexity: saving all logits to {Path(base_path)}")
        with _written_atomically(Path(base_path)) as stream:
            result = perplexity(ctx, tokens, n_ctx, n_batch, n_chunks, ppl_stride, bos,
                                base=stream, on_chunk=on_chunk)
    out("\n")
    info(final_line(result.sums))
    return result
# --8<-- [end:run_perplexity]


# --8<-- [start:run_kl_divergence]
def run_kl_divergence(ctx: Context, base_path: str | os.PathLike, n_batch: int = 2048,
                      bos: int | None = None, out: Emit = _quiet,
                      info: Emit = _quiet) -> KLDStats:
    """``llama-perplexity --kl-divergence``:
    [`kl_divergence`][reference.tools.perplexity.kl_divergence] against the base file at
    ``base_path``, with its table and report.

    ``out`` receives the per-chunk table and, from ``KLD_MIN_COUNT`` (100) scored tokens
    on, the three sections of [`kld_report`][]; ``info`` the log lines.

    Raises:
        LogitsFileError: see [`read_logits_file`][] (checked against ``ctx.n_vocab``).
        PerplexityError: a context too small for the file's ``n_ctx``; a failed decode.

    Examples:
        >>> import tempfile
        >>> from reference.context import Context
        >>> from reference.testing import tiny_hparams, random_weights
        >>> hp = tiny_hparams()
        >>> ctx = Context(hp, random_weights(hp), **context_params(8, 16))
        >>> text = np.random.default_rng(0).integers(3, 32, 40)
        >>> path = Path(tempfile.mkdtemp()) / "base.bin"
        >>> _ = run_perplexity(ctx, text, n_ctx=8, n_batch=16, bos=1, base_path=path)
        >>> stats = run_kl_divergence(ctx, path, 16, bos=1)
        >>> stats.count, bool(abs(stats.mean_kld()[0]) < 1e-4), stats.n_same_top
        (15, True, 15)
    """
    path = Path(base_path)
    with _open_base(path) as stream:
        base = read_logits(stream, ctx.n_vocab, str(path))
        plan = kl_divergence_plan(ctx, base, n_batch)
        info(f"kl_divergence: computing over {plan.n_chunk} chunks, n_ctx={plan.n_ctx}, "
             f"batch_size={plan.n_batch}, n_seq={plan.n_seq}")
        t0 = time.perf_counter()

        def on_chunk(chunk: int, stats: KLDStats) -> None:
            if chunk == 0:
                info(timing_line("kl_divergence", time.perf_counter() - t0, plan.n_chunk,
                                 plan.n_seq))
                out("\n" + KLD_TABLE_HEADER + "\n")
            out(kld_chunk_line(stats, chunk + 1) + "\n")

        stats = kl_divergence(ctx, base, stream, n_batch, bos, on_chunk=on_chunk)
    out("\n")
    if stats.count >= KLD_MIN_COUNT:
        out("\n".join(kld_report(stats)) + "\n")
    return stats
# --8<-- [end:run_kl_divergence]


# ---- the command ---------------------------------------------------------------------------

# --8<-- [start:cmd_perplexity]
def cmd_perplexity(args: argparse.Namespace) -> int:
    """Perplexity of a text, or KL divergence against a base file, as ``llama-perplexity``.

    Everything is checked (flags, the text's length, the base file's header and size) before
    the weights are prepared; a base file is written under a temporary name and renamed once
    complete, so a failed run leaves nothing behind.
    """
    check_perplexity_flags(args)
    path = model_path(args)
    hparams, weights = load_model(path)
    tokenizer = load_tokenizer(path)
    bos = tokenizer.bos_id if tokenizer.add_bos else None  # llama_vocab_get_add_bos
    if args.kl_divergence:
        base = read_logits_file(args.kl_divergence_base, hparams.n_vocab)
        if args.ctx_size is not None and args.ctx_size < base.n_ctx:
            raise CLIError(f"{Path(args.kl_divergence_base)} was computed with n_ctx = "
                           f"{base.n_ctx}, the context is {args.ctx_size}: increase it with -c")
        n_ctx = base.n_ctx
    else:
        text = prompt_text(args, read_prompt_file(args.file))
        tokens = tokenizer.tokenize(text, add_special=True, parse_special=False)
        n_ctx = 512 if args.ctx_size is None else args.ctx_size
        plan_chunks(len(tokens), n_ctx, args.batch_size, args.chunks, args.ppl_stride)
    backend = pick_backend(args.backend, hparams)
    log(f"llamaref: backend {backend}" + (" (auto)" if args.backend == "auto" else ""))
    ctx = make_context(backend, hparams, prepare_weights(weights, backend),
                       n_ubatch=args.ubatch_size, **context_params(n_ctx, args.batch_size))
    if args.kl_divergence:
        run_kl_divergence(ctx, args.kl_divergence_base, args.batch_size, bos, out=_write,
                          info=log)
    else:
        run_perplexity(ctx, tokens, n_ctx, args.batch_size, args.chunks, args.ppl_stride, bos,
                       base_path=args.kl_divergence_base, out=_write, info=log)
    return 0
# --8<-- [end:cmd_perplexity]


def check_perplexity_flags(args: argparse.Namespace) -> None:
    """The flag combinations ``llamaref perplexity`` refuses, before anything is read."""
    if args.ctx_size is not None and args.ctx_size <= 0:
        raise CLIError(f"-c/--ctx-size = {args.ctx_size}: perplexity requires a context > 0")
    if args.batch_size < 1 or args.ubatch_size < 1:
        raise CLIError("-b/--batch-size and -ub/--ubatch-size must be >= 1")
    if args.kl_divergence and args.kl_divergence_base is None:
        raise CLIError("--kl-divergence needs the base file: --kl-divergence-base FILE")
    if args.kl_divergence and args.ppl_stride:
        raise CLIError("--kl-divergence compares the standard chunks: drop --ppl-stride")
    if not args.kl_divergence and args.file is None:
        raise CLIError("no text: give it with -f FILE")
    if args.ppl_stride and args.kl_divergence_base is not None:
        raise CLIError("--kl-divergence-base writes the standard chunks: drop --ppl-stride")
    if args.file is not None and not Path(args.file).is_file():
        raise CLIError(f"-f {args.file}: no such file")


def add_perplexity_command(sub) -> None:
    """Register ``llamaref perplexity`` on the CLI's subparsers (the CLI calls this)."""
    p = sub.add_parser(
        "perplexity", help="perplexity of a text, or KL divergence (like llama-perplexity)",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description="llama-perplexity's procedure: chunks of -c tokens, the first replaced by "
                    "BOS when the vocabulary adds one, the second half of each scored; the "
                    "running [i] estimates on stdout, the final estimate on stderr.",
        epilog="examples:\n"
               "  llamaref perplexity -f wiki.test.raw -c 512\n"
               "  llamaref perplexity -f text.txt -c 256 --kl-divergence-base base.bin "
               "--backend reference\n"
               "  llamaref perplexity --kl-divergence-base base.bin --kl-divergence "
               "--backend accelerated")
    add_model_flags(p)
    p.add_argument("-f", "--file", metavar="FNAME",
                   help="the text to evaluate (one trailing newline dropped, escapes processed "
                        "unless --no-escape, as llama.cpp's -f)")
    add_prompt_flags(p)
    add_context_flags(
        p, ["ctx_size", "batch_size", "ubatch_size"],
        ctx_size=dict(default=None,
                      help="tokens per chunk (default: 512; with --kl-divergence, the file's)"),
        batch_size=dict(help="logical batch size: b / c chunks share one decode "
                             "(default: 2048)"))
    p.add_argument("--chunks", type=int, default=-1, metavar="N",
                   help="max number of chunks to process (default: -1 = all)")
    p.add_argument("--ppl-stride", type=int, default=0, metavar="N",
                   help="strided perplexity: slide the window by N, score its last N tokens "
                        "(default: 0 = off)")
    p.add_argument("--kl-divergence-base", "--save-all-logits", dest="kl_divergence_base",
                   metavar="FNAME", help="the base logits file: written by a perplexity run, "
                                         "read with --kl-divergence")
    p.add_argument("--kl-divergence", action="store_true",
                   help="compute the KL divergence to the logits of --kl-divergence-base")
    p.set_defaults(func=cmd_perplexity)
