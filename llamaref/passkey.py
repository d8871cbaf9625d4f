"""``llamaref passkey``: llama.cpp's passkey-retrieval example, on either backend.

The flags are ``llama-passkey``'s: ``--junk`` (junk sentences, default 250), ``--pos`` (the
sentence the key goes before, default random), ``--keep`` (tokens kept when shifting, default
32), ``-gan/--grp-attn-n`` (Self-Extend's group size, default 1), ``-b/--batch-size`` (the chunk,
also Self-Extend's block, default 2048). One addition: ``-c/--ctx-size`` sets the cache
(default 0: ``passkey.cpp``'s ``n_ctx_train * G + n_keep``).

llama.cpp's information lines go to stderr, the 16-token answer to stdout; the last line on
stderr says whether the key was found. The semantics are
[`reference.tools.passkey`][reference.tools.passkey].

Examples: ``llamaref passkey --junk 250 --pos 90 --grp-attn-n 2``.
"""

from __future__ import annotations

import argparse
import sys

from llamaref.backends import make_context, pick_backend, prepare_weights
from llamaref.common import CLIError, add_context_flags, add_prompt_flags, log, model_path
from reference.model_loader import load_model
from reference.tokenizer import load_tokenizer
from reference.tools.passkey import run_passkey


def check_passkey_flags(args: argparse.Namespace) -> None:
    """The values ``llama-passkey`` cannot run with, refused before the model is loaded."""
    if args.junk < 1:
        raise CLIError(f"--junk {args.junk} must be >= 1")
    if args.pos < -1:
        raise CLIError(f"--pos {args.pos} must be >= 0 (or -1: random)")
    if args.keep < 0:
        raise CLIError(f"--keep {args.keep} must be >= 0")
    if args.grp_attn_n < 1:
        raise CLIError(f"--grp-attn-n {args.grp_attn_n} must be >= 1")
    if args.batch_size < 1 or args.batch_size % args.grp_attn_n != 0:
        raise CLIError(f"n_batch must be divisible by n_grp: -b {args.batch_size}, "
                       f"--grp-attn-n {args.grp_attn_n}")
    if args.ctx_size < 0 or args.ubatch_size < 1:
        raise CLIError("-c/--ctx-size must be >= 0 and -ub/--ubatch-size >= 1")


# --8<-- [start:cmd_passkey]
def cmd_passkey(args: argparse.Namespace) -> int:
    """Run the passkey example; exit 0 whether or not the key is found (as llama.cpp)."""
    check_passkey_flags(args)
    path = model_path(args)
    hparams, weights = load_model(path)
    tokenizer = load_tokenizer(path)
    backend = pick_backend(args.backend, hparams)
    log(f"llamaref: backend {backend}" + (" (auto)" if args.backend == "auto" else ""))
    weights = prepare_weights(weights, backend)

    def new_context(n_ctx: int, n_batch: int):
        return make_context(backend, hparams, weights, n_ctx=n_ctx, n_batch=n_batch,
                            n_ubatch=min(args.ubatch_size, n_batch))

    def out(text: str) -> None:
        sys.stdout.write(text)
        sys.stdout.flush()

    res = run_passkey(new_context, tokenizer, hparams.n_ctx_train, n_junk=args.junk,
                      n_keep=args.keep, i_pos=args.pos, n_grp=args.grp_attn_n,
                      n_batch=args.batch_size, n_ctx=args.ctx_size or None, out=out, info=log)
    log(f"llamaref: passkey {res.passkey} {'found' if res.found else 'NOT found'} in the answer")
    return 0
# --8<-- [end:cmd_passkey]


def add_passkey_command(sub) -> None:
    """Register ``llamaref passkey`` on the CLI's subparsers (the CLI calls this)."""
    p = sub.add_parser("passkey", help="passkey retrieval in a long text (like llama-passkey)",
                       description="llama.cpp's examples/passkey: a pass key hidden in junk "
                                   "text, 16 greedy tokens to find it; --grp-attn-n G > 1 groups "
                                   "the positions (Self-Extend).")
    p.add_argument("-m", "--model", help="a GGUF file or a HF directory (default: SmolLM2)")
    p.add_argument("--backend", default="auto", choices=("auto", "accelerated", "reference"),
                   help="auto: accelerated (MLX) when MLX's default device is a GPU, else "
                        "reference (NumPy) (default: auto)")
    p.add_argument("--junk", type=int, default=250, metavar="N",
                   help="number of times to repeat the junk text (default: 250)")
    p.add_argument("--pos", type=int, default=-1, metavar="N",
                   help="position of the passkey in the junk text (default: -1 = random)")
    add_context_flags(p, ["keep"], keep=dict(
        default=32, help="tokens kept at the start when the prompt is shifted in (default: 32)"))
    p.add_argument("-gan", "--grp-attn-n", type=int, default=1, metavar="N",
                   help="group-attention factor (default: 1)")
    add_context_flags(
        p, ["batch_size", "ubatch_size", "ctx_size"],
        batch_size=dict(help="chunk size, also the grouped block (default: 2048)"),
        ctx_size=dict(default=0, help="cache size (default: 0 = n_ctx_train * G + --keep, as "
                                      "llama-passkey)"))
    add_prompt_flags(p)  # accepted as by every llama.cpp tool: the prompt is built, not given
    p.set_defaults(func=cmd_passkey)
