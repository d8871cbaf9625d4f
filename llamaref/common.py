"""What every command of the application shares: its error, its log line, and the flags
llama.cpp's tools share (the model, the context, the sampling), each defined once."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from reference.common import LlamarefError
from reference.model_loader import default_model_path


class CLIError(LlamarefError):
    """A problem the user can fix; printed as one line, exit code 1."""


def add_model_flags(p: argparse.ArgumentParser) -> None:
    """``-m/--model`` and ``--backend``
    ([`llamaref.backends.pick_backend`][llamaref.backends.pick_backend])."""
    p.add_argument("-m", "--model", help="a GGUF file or a HF directory (default: SmolLM2)")
    p.add_argument("--backend", default="auto", choices=("auto", "accelerated", "reference"),
                   help="auto: accelerated (MLX) when MLX's default device is a GPU, else "
                        "reference (NumPy) (default: auto)")


def model_path(args: argparse.Namespace) -> Path:
    """``--model``, or the default model; the path must exist."""
    path = Path(args.model) if args.model else default_model_path()
    if not path.exists():
        raise CLIError(f"model not found: {path}")
    return path


def log(message: str) -> None:
    """One line of information on stderr."""
    print(message, file=sys.stderr, flush=True)


# llama.cpp's context flags with its defaults (common/arg.cpp), as every command names them.
# A command whose flag means something narrower (-c of perplexity: the chunk) changes the
# default or the help where it adds the flag (add_context_flags); the spelling stays.
CONTEXT_FLAGS: dict[str, tuple[tuple[str, ...], dict]] = {
    "ctx_size": (("-c", "--ctx-size"), dict(
        type=int, default=4096, metavar="N",
        help="context size, padded to 256 (default: 4096; 0 = the model's)")),
    "batch_size": (("-b", "--batch-size"), dict(
        type=int, default=2048, metavar="N", help="logical batch size (default: 2048)")),
    "ubatch_size": (("-ub", "--ubatch-size"), dict(
        type=int, default=512, metavar="N", help="physical batch size (default: 512)")),
    "parallel": (("-np", "--parallel"), dict(
        type=int, default=1, metavar="N", help="number of sequences (default: 1)")),
    "kv_unified": (("-kvu", "--kv-unified"), dict(
        dest="kv_unified", action="store_true", default=False,
        help="one KV stream shared by every sequence (default: one stream per sequence)")),
    "no_kv_unified": (("-no-kvu", "--no-kv-unified"), dict(
        dest="kv_unified", action="store_false", help="one KV stream per sequence")),
    "keep": (("--keep",), dict(
        type=int, default=0, metavar="N",
        help="prompt tokens kept when the context shifts (default: 0, -1 = all; BOS is "
             "always kept)")),
    "swa_full": (("-swa-full", "--swa-full"), dict(
        dest="swa_full", action="store_true",
        help="a sliding-window model keeps every position in its SWA cache (default: only "
             "what the window and one ubatch need, as llama.cpp)")),
}


def add_context_flags(container: Any, names: list[str], **changes: dict) -> Any:
    """Add the named ``CONTEXT_FLAGS`` to ``container`` (a parser or one of its argument
    groups), in that order; returns ``container``.

    Args:
        container: where the flags go.
        names: keys of ``CONTEXT_FLAGS``.
        **changes: per name, the keyword arguments of ``add_argument`` that differ for this
            command (a default, a help text).

    Examples:
        >>> p = argparse.ArgumentParser()
        >>> _ = add_context_flags(p, ["ctx_size", "ubatch_size"], ctx_size=dict(default=0))
        >>> vars(p.parse_args(["-ub", "64"]))
        {'ctx_size': 0, 'ubatch_size': 64}
    """
    unknown = set(changes) - set(names)
    if unknown:  # as Python refuses an unexpected keyword argument
        raise TypeError(f"add_context_flags() changes flags it does not add: {sorted(unknown)}")
    for name in names:
        flags, kwargs = CONTEXT_FLAGS[name]
        container.add_argument(*flags, **{**kwargs, **changes.get(name, {})})
    return container


# llama.cpp's sampling flags with its defaults (common/arg.cpp), as every command names them.
SAMPLING_FLAGS: dict[str, tuple[tuple[str, ...], dict]] = {
    "seed": (("-s", "--seed"), dict(type=int, default=-1, metavar="SEED",
                                    help="RNG seed (default: -1, a random seed)")),
    "temp": (("--temp", "--temperature"), dict(
        dest="temp", type=float, default=0.8, metavar="N",
        help="temperature (default: 0.80; <= 0 = greedy)")),
    "top_k": (("--top-k",), dict(type=int, default=40, metavar="N",
                                 help="top-k sampling (default: 40, 0 = disabled)")),
    "top_p": (("--top-p",), dict(type=float, default=0.95, metavar="N",
                                 help="top-p sampling (default: 0.95, 1.0 = disabled)")),
    "min_p": (("--min-p",), dict(type=float, default=0.05, metavar="N",
                                 help="min-p sampling (default: 0.05, 0.0 = disabled)")),
    "repeat_last_n": (("--repeat-last-n",), dict(
        type=int, default=64, metavar="N",
        help="last n tokens to penalize (default: 64, 0 = disabled)")),
    "repeat_penalty": (("--repeat-penalty",), dict(
        type=float, default=1.0, metavar="N",
        help="penalize repeated tokens (default: 1.00, 1.0 = disabled)")),
}


def add_sampling_flags(parser: argparse.ArgumentParser, names: list[str]):
    """Add the named ``SAMPLING_FLAGS`` to a group of ``parser``; returns the group, so a
    command can add flags of its own to it."""
    group = parser.add_argument_group("sampling (llama.cpp names and defaults)")
    for name in names:
        flags, kwargs = SAMPLING_FLAGS[name]
        group.add_argument(*flags, **kwargs)
    return group
