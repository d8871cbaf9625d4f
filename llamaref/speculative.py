"""``llamaref speculative``, ``speculative-simple`` and ``lookup``: llama.cpp's examples.

The flags are llama.cpp's (``common/arg.cpp``): ``-md/--model-draft`` (the draft GGUF),
``--draft-max`` (``--spec-draft-n-max``, default 3), ``--draft-min`` (default 0),
``--draft-p-min`` (default 0.0), ``--draft-p-split`` (default 0.10), ``-np/--parallel``
(tree branches, default 1), ``-lcs`` / ``-lcd`` (lookup's static and dynamic n-gram
caches), and the sampling flags with llama.cpp's defaults (``--temp 0.8`` ...). One
addition: ``--draft-layers K`` drafts with the target's own first K layers instead of a
draft model, so any model can draft for itself.

The prompt and the generated text go to stdout; the statistics (``n_drafted``,
``n_accept``, ``accept = %``) to stderr, line by line as llama.cpp prints them. The
semantics are [`reference.tools.speculative`][reference.tools.speculative] and
[`reference.tools.lookup`][reference.tools.lookup]; every check (flags, the draft's vocabulary, the
cache files) runs before any weight is prepared.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from llamaref.backends import make_context, pick_backend, prepare_weights
from llamaref.common import (
    CLIError,
    add_context_flags,
    add_prompt_flags,
    add_sampling_flags,
    log,
    model_path,
    prompt_text,
    read_prompt_file,
)
from reference.common import LLAMA_DEFAULT_SEED
from reference.model_loader import load_model
from reference.sampling import SamplerParams
from reference.tokenizer import StreamDecoder, load_tokenizer
from reference.tools.lookup import Lookup, ngram_cache_load, ngram_cache_merge, ngram_cache_save
from reference.tools.speculative import (
    Speculative,
    SpeculativeSimple,
    check_draft_vocab,
    draft_layers,
)


def _write(text: str) -> None:
    sys.stdout.write(text)
    sys.stdout.flush()


def check_flags(args: argparse.Namespace) -> None:
    """The values the examples refuse, before anything is loaded."""
    if args.n_predict < -1:
        raise CLIError(f"-n/--n-predict = {args.n_predict} must be >= -1")
    if args.draft_max < (0 if args.command == "lookup" else 1):
        raise CLIError(f"--draft-max = {args.draft_max} must be >= 1")
    if not -1 <= args.seed <= LLAMA_DEFAULT_SEED:
        raise CLIError(f"--seed = {args.seed} must be in [0, {LLAMA_DEFAULT_SEED}] (or -1)")
    if args.ctx_size < 0 or args.batch_size < 1 or args.ubatch_size < 1:
        raise CLIError("-c/--ctx-size must be >= 0, -b and -ub >= 1")
    if args.command != "lookup":
        if (args.model_draft is None) == (args.draft_layers is None):
            raise CLIError(f"{args.command} needs one draft: -md/--model-draft FILE or "
                           "--draft-layers K (the target's first K layers)")
        if args.model_draft is not None and not Path(args.model_draft).exists():
            raise CLIError(f"draft model not found: {args.model_draft}")
    if getattr(args, "parallel", 1) < 1:
        raise CLIError(f"-np/--parallel = {args.parallel} must be >= 1")
    if args.command == "lookup" and args.lookup_cache_static is not None \
            and not Path(args.lookup_cache_static).is_file():
        raise CLIError(f"failed to open static lookup cache: {args.lookup_cache_static}")


def sampler_params(args: argparse.Namespace) -> SamplerParams:
    """``common_params_sampling`` from the flags."""
    return SamplerParams(seed=args.seed & LLAMA_DEFAULT_SEED, top_k=args.top_k,
                         top_p=args.top_p, min_p=args.min_p, temp=max(args.temp, 0.0))


def read_prompt(args: argparse.Namespace) -> str:
    """The prompt: the argument, ``-p``, or ``-f FILE`` (one trailing newline dropped), escapes
    processed unless ``--no-escape``, as ``common_params_parse``
    ([`llamaref.common.prompt_text`][llamaref.common.prompt_text])."""
    if args.file is not None:
        return prompt_text(args, read_prompt_file(args.file))
    prompt = args.prompt if args.prompt is not None else args.prompt_flag
    if prompt is None:
        raise CLIError("no prompt: give it as an argument, with -p/--prompt or -f/--file")
    return prompt_text(args, prompt)


# --8<-- [start:load_pair]
def load_pair(args: argparse.Namespace, n_seq_max: int = 1):
    """The target's and the draft's Contexts, and the tokenizer.

    The draft is ``-md``'s model (its vocabulary checked against the target's first) or
    the target's first ``--draft-layers`` layers over the same prepared weights.
    """
    path = model_path(args)
    hparams, weights = load_model(path)
    tokenizer = load_tokenizer(path)
    if args.draft_layers is not None:
        d_hparams, d_weights = draft_layers(hparams, args.draft_layers), None
    else:
        d_hparams, d_weights = load_model(args.model_draft)
        check_draft_vocab(tokenizer, load_tokenizer(args.model_draft))
    backend = pick_backend(args.backend, hparams)
    pick_backend(backend, d_hparams)  # the draft must run there too
    log(f"llamaref: backend {backend}" + (" (auto)" if args.backend == "auto" else ""))
    weights = prepare_weights(weights, backend)
    d_weights = weights if d_weights is None else prepare_weights(d_weights, backend)
    sizes = dict(n_ctx=args.ctx_size, n_batch=args.batch_size, n_ubatch=args.ubatch_size,
                 n_seq_max=n_seq_max, kv_unified=True)
    return (make_context(backend, hparams, weights, **sizes),
            make_context(backend, d_hparams, d_weights, **sizes), tokenizer)
# --8<-- [end:load_pair]


def run(spec, tokenizer, prompt: str, n_predict: int) -> None:
    """Echo the prompt, stream the generated text, print the statistics on stderr."""
    tokens = tokenizer.tokenize(prompt, add_special=True, parse_special=True)
    _write(prompt)
    stream = StreamDecoder(tokenizer)
    for token in spec.generate(tokens, n_predict):
        if tokenizer.is_eog(token):
            break
        _write(stream.push(token))
    _write(stream.flush() + "\n\n")
    for line in spec.stats.lines():
        log(line)


# --8<-- [start:cmd_speculative]
def cmd_speculative(args: argparse.Namespace) -> int:
    """``llama-speculative``: draft model, tree of ``-np`` branches."""
    check_flags(args)
    prompt = read_prompt(args)
    ctx_tgt, ctx_dft, tokenizer = load_pair(args, n_seq_max=args.parallel)
    spec = Speculative(ctx_tgt, ctx_dft, sampler_params(args), n_draft=args.draft_max,
                       n_seq_dft=args.parallel, p_split=args.draft_p_split,
                       is_eog=tokenizer.is_eog)
    run(spec, tokenizer, prompt, args.n_predict)
    return 0


def cmd_speculative_simple(args: argparse.Namespace) -> int:
    """``llama-speculative-simple`` with the ``draft-simple`` drafter."""
    check_flags(args)
    prompt = read_prompt(args)
    ctx_tgt, ctx_dft, tokenizer = load_pair(args)
    spec = SpeculativeSimple(ctx_tgt, ctx_dft, sampler_params(args), n_max=args.draft_max,
                             n_min=args.draft_min, p_min=args.draft_p_min,
                             is_eog=tokenizer.is_eog)
    run(spec, tokenizer, prompt, args.n_predict)
    return 0


def cmd_lookup(args: argparse.Namespace) -> int:
    """``llama-lookup``: drafts from the n-gram caches; ``-lcd`` is updated at the end."""
    check_flags(args)
    prompt = read_prompt(args)
    t0 = time.perf_counter()
    nc_static = ngram_cache_load(args.lookup_cache_static) if args.lookup_cache_static else {}
    lcd = args.lookup_cache_dynamic
    nc_dynamic = ngram_cache_load(lcd) if lcd and Path(lcd).is_file() else {}
    t_flat_ms = 1e3 * (time.perf_counter() - t0)
    path = model_path(args)
    hparams, weights = load_model(path)
    tokenizer = load_tokenizer(path)
    backend = pick_backend(args.backend, hparams)
    log(f"llamaref: backend {backend}" + (" (auto)" if args.backend == "auto" else ""))
    ctx = make_context(backend, hparams, prepare_weights(weights, backend),
                       n_ctx=args.ctx_size, n_batch=args.batch_size, n_ubatch=args.ubatch_size)
    look = Lookup(ctx, sampler_params(args), n_draft=args.draft_max, nc_static=nc_static,
                  nc_dynamic=nc_dynamic, is_eog=tokenizer.is_eog)
    look.stats.t_draft_flat_ms += t_flat_ms
    run(look, tokenizer, prompt, args.n_predict)
    if lcd:  # lookup.cpp:225-227: the context cache joins the dynamic cache
        ngram_cache_merge(look.nc_dynamic, look.nc_context)
        ngram_cache_save(look.nc_dynamic, lcd)
    return 0
# --8<-- [end:cmd_speculative]


def _add_common(p: argparse.ArgumentParser, draft: bool) -> None:
    p.add_argument("prompt", nargs="?", help="the prompt (or -p, -f)")
    p.add_argument("-p", "--prompt", dest="prompt_flag", metavar="PROMPT", help="the prompt")
    p.add_argument("-f", "--file", metavar="FNAME", help="read the prompt from a file")
    add_prompt_flags(p)
    p.add_argument("-m", "--model", help="the target: a GGUF file or a HF directory "
                                         "(default: SmolLM2)")
    p.add_argument("--backend", default="auto", choices=("auto", "accelerated", "reference"),
                   help="auto: accelerated (MLX) when MLX's default device is a GPU, else "
                        "reference (NumPy) (default: auto)")
    p.add_argument("-n", "--n-predict", dest="n_predict", type=int, default=-1, metavar="N",
                   help="tokens to predict (default: -1 = until end of generation or a "
                        "full context)")
    add_context_flags(p, ["ctx_size", "batch_size", "ubatch_size"])
    p.add_argument("--draft-max", "--spec-draft-n-max", "--draft", "--draft-n",
                   dest="draft_max", type=int, default=3, metavar="N",
                   help="tokens to draft per round (default: 3)")
    if draft:
        p.add_argument("-md", "--model-draft", "--spec-draft-model", dest="model_draft",
                       metavar="FNAME", help="the draft model: a GGUF with the target's "
                                             "vocabulary")
        p.add_argument("--draft-layers", type=int, default=None, metavar="K",
                       help="draft with the target's own first K layers (instead of -md)")
    add_sampling_flags(p, ["seed", "temp", "top_k", "top_p", "min_p"])


def add_speculative_commands(sub) -> None:
    """Register ``speculative``, ``speculative-simple`` and ``lookup`` (the CLI calls this)."""
    fmt = argparse.RawDescriptionHelpFormatter
    p = sub.add_parser(
        "speculative", help="speculative decoding with a draft model (like llama-speculative)",
        formatter_class=fmt,
        description="A draft model drafts up to --draft-max tokens (a tree of -np branches, "
                    "split where the draft's k-th candidate is above --draft-p-split); the "
                    "target verifies them in one batch. --temp <= 0: greedy, the output is "
                    "plain generation's; --temp > 0: exact rejection sampling.",
        epilog="examples:\n"
               "  llamaref speculative -p 'The capital of France' -n 64 --draft-layers 8 "
               "--temp 0\n"
               "  llamaref speculative -m big.gguf -md small.gguf -np 3 --draft-max 8 "
               "-p 'Once upon a time'")
    _add_common(p, draft=True)
    add_context_flags(p, ["parallel"],
                      parallel=dict(help="most draft branches (default: 1 = no tree)"))
    p.add_argument("--draft-p-split", "--spec-draft-p-split", dest="draft_p_split", type=float,
                   default=0.10, metavar="P",
                   help="split a branch where a candidate's probability is above P "
                        "(default: 0.10)")
    p.set_defaults(func=cmd_speculative)

    p = sub.add_parser(
        "speculative-simple", formatter_class=fmt,
        help="greedy draft-simple speculation (like llama-speculative-simple)",
        description="The draft proposes its top token (top-10 at temperature 1) while its "
                    "probability is >= --draft-p-min, up to --draft-max tokens; shorter than "
                    "--draft-min: dropped. A recurrent model (Mamba) rolls back by restoring "
                    "a saved state.",
        epilog="example:\n"
               "  llamaref speculative-simple -p 'def fib(n):' -n 64 --draft-layers 8 "
               "--draft-max 6 --temp 0")
    _add_common(p, draft=True)
    p.add_argument("--draft-min", "--spec-draft-n-min", dest="draft_min", type=int, default=0,
                   metavar="N", help="drop drafts shorter than N (default: 0)")
    p.add_argument("--draft-p-min", "--spec-draft-p-min", dest="draft_p_min", type=float,
                   default=0.0, metavar="P",
                   help="stop drafting below this probability (default: 0.00)")
    p.set_defaults(func=cmd_speculative_simple)

    p = sub.add_parser(
        "lookup", formatter_class=fmt,
        help="prompt-lookup decoding from n-gram caches (like llama-lookup)",
        description="Drafts come from n-gram counts of the prompt and the output (and of "
                    "-lcd / -lcs caches); the target verifies them in one batch.",
        epilog="example:\n"
               "  llamaref lookup -f code.txt -n 128 --temp 0 --draft-max 8 -lcd dyn.bin")
    _add_common(p, draft=False)
    p.add_argument("-lcs", "--lookup-cache-static", metavar="FNAME",
                   help="static n-gram cache (not updated by generation)")
    p.add_argument("-lcd", "--lookup-cache-dynamic", metavar="FNAME",
                   help="dynamic n-gram cache (read if present, updated at the end)")
    p.set_defaults(func=cmd_lookup)
