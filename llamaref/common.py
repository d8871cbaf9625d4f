"""What every command of the application shares: its error, the model flag, its log line."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from reference.common import LlamarefError
from reference.model import default_model_path


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
