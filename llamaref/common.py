"""What every command of the application shares: its error, the model flag, its log line."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from reference.common import LlamarefError
from reference.model_loader import default_model_path


class CLIError(LlamarefError):
    """A problem the user can fix; printed as one line, exit code 1."""


def model_path(args: argparse.Namespace) -> Path:
    """``--model``, or the default model; the path must exist."""
    path = Path(args.model) if args.model else default_model_path()
    if not path.exists():
        raise CLIError(f"model not found: {path}")
    return path


def log(message: str) -> None:
    """One line of information on stderr."""
    print(message, file=sys.stderr, flush=True)


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
