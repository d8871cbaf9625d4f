r"""What every command of the application shares: its error, its log line, and the flags
llama.cpp's tools share (the model, the context, the sampling), each defined once.

**The prompt** of every program goes through one place, as ``common_params_parse`` does for
every llama.cpp tool: a prompt file is read as ``-f`` reads it ([`read_prompt_file`][]: one
trailing newline dropped), then, unless ``--no-escape``, ``\n``, ``\t``, ``\xNN`` ... are
processed ([`process_escapes`][], ``common/arg.cpp``: ``params.escape`` is true by default).
A command adds ``-e/--escape`` and ``--no-escape`` with [`add_prompt_flags`][] and reads its
prompt through [`prompt_text`][].
"""

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


# ---- the prompt: escapes and prompt files, as common_params_parse ---------------------------

# llama.cpp's prompt flags (common/arg.cpp): one pair, in every tool, escapes on by default.
PROMPT_FLAGS: dict[str, tuple[tuple[str, ...], dict]] = {
    "escape": (("-e", "--escape"), dict(
        dest="escape", action="store_true", default=True,
        help="process escapes (\\n, \\r, \\t, \\', \\\", \\\\, \\xNN) in the prompt (default)")),
    "no_escape": (("--no-escape",), dict(
        dest="escape", action="store_false",
        help="do not process escapes in the prompt")),
}


def add_prompt_flags(container: Any) -> Any:
    """Add ``-e/--escape`` and ``--no-escape`` (``PROMPT_FLAGS``) to ``container``; returns it.

    Examples:
        >>> p = add_prompt_flags(argparse.ArgumentParser())
        >>> p.parse_args([]).escape, p.parse_args(["--no-escape"]).escape
        (True, False)
        >>> p.parse_args(["--no-escape", "-e"]).escape  # the last one wins, as llama.cpp
        True
    """
    for flags, kwargs in PROMPT_FLAGS.values():
        container.add_argument(*flags, **kwargs)
    return container


#: C's isspace: what strtol skips before a number
_C_SPACE = b" \t\n\v\f\r"
_HEX = b"0123456789abcdefABCDEF"


def _hex_pair(pair: bytes) -> int | None:
    r"""The byte ``\xNN`` stands for, or None: ``strtol(pair, &end, 16)`` with ``end`` after
    both characters (two hex digits, or a space or a sign then one hex digit)."""
    if len(pair) != 2 or pair[1] not in _HEX:
        return None
    if pair[0] in _HEX:
        return int(pair, 16)
    if pair[0] in _C_SPACE or pair[0] == ord("+"):
        return int(pair[1:], 16)
    if pair[0] == ord("-"):
        return -int(pair[1:], 16) & 0xFF  # char(val) of a negative long
    return None


# --8<-- [start:process_escapes]
def process_escapes(text: str) -> str:
    r"""llama.cpp's ``string_process_escapes``: ``\n``, ``\r``, ``\t``, ``\'``, ``\"``,
    ``\\`` and ``\xNN`` (a byte); any other backslash stays as it is.

    ``\xNN`` is read by ``strtol(.., 16)`` and must use both characters, so ``\x 9`` and
    ``\x+9`` are the byte 9 too, and ``\x-1`` the byte 0xFF, as in llama.cpp.

    Examples:
        >>> process_escapes(r"a\nb\tc\\d\x41\q")
        'a\nb\tc\\dA\\q'
        >>> process_escapes(r"\x4")  # one digit: not an escape
        '\\x4'
    """
    simple = {"n": b"\n", "r": b"\r", "t": b"\t", "'": b"'", '"': b'"', "\\": b"\\"}
    data, out, i = text.encode(), bytearray(), 0
    while i < len(data):
        c = chr(data[i])
        if c == "\\" and i + 1 < len(data):
            nxt = chr(data[i + 1])
            if nxt in simple:
                out += simple[nxt]
                i += 2
                continue
            value = _hex_pair(data[i + 2 : i + 4]) if nxt == "x" else None
            if value is not None:
                out.append(value)
                i += 4
                continue
        out.append(data[i])
        i += 1
    return out.decode("utf-8", errors="replace")
# --8<-- [end:process_escapes]


def read_prompt_file(path: str | Path) -> str:
    """The prompt in a file, as ``-f/--file`` reads it: the whole file, one trailing newline
    dropped (``common/arg.cpp``); bytes that are not UTF-8 become U+FFFD.

    Raises:
        OSError: the file cannot be read (``main`` reports it as one line).
    """
    text = Path(path).read_bytes().decode("utf-8", errors="replace")
    return text[:-1] if text.endswith("\n") else text


def prompt_text(args: argparse.Namespace, text: str) -> str:
    """A program's prompt after the flags: escapes processed unless ``--no-escape``
    (``args.escape``, from [`add_prompt_flags`][])."""
    return process_escapes(text) if args.escape else text
