"""``llamaref batched``, ``llamaref parallel``, ``llamaref batched-bench``: many sequences.

The three commands of llama.cpp that serve several sequences from one context, with their
flag names and defaults (``common/arg.cpp``), on either backend:

- ``llamaref batched -p PROMPT -n 32 -np 4`` writes ``-np`` completions of one prompt
  (``examples/batched``, [`reference.tools.batched`][reference.tools.batched]); ``-n`` is the total
  length, prompt included. Without ``-kvu`` each sequence has its own KV stream and gets
  the prompt by ``seq_cp`` (llama.cpp's example needs ``-kvu`` there);
- ``llamaref parallel -np 4 -ns 16 -pps`` simulates a server with ``-np`` clients
  (``examples/parallel``, [`reference.tools.parallel`][reference.tools.parallel]): continuous
  batching, a shared system prompt, chunks halved when the cache is full;
- ``llamaref batched-bench -npp 128 -ntg 128 -npl 1,2,4,8`` prints the PP / TG / B table
  (``tools/batched-bench``, [`reference.tools.batched_bench`][reference.tools.batched_bench]),
  as markdown or JSONL.

llama.cpp's log lines go to stderr, what its ``LOG`` prints (the texts, the table) to
stdout; the last lines on stderr are ``llama_perf_context_print``'s report.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

from llamaref.backends import make_context, make_sampler, pick_backend, prepare_weights
from llamaref.common import (
    SAMPLING_FLAGS,
    CLIError,
    add_context_flags,
    add_prompt_flags,
    add_sampling_flags,
    log,
    model_path,
    prompt_text,
    read_prompt_file,
)
from llamaref.llamacpp import LlamaCppContext
from reference.common import LLAMA_DEFAULT_SEED, LLAMA_MAX_SEQ
from reference.model_loader import load_model
from reference.sampling import SamplerParams
from reference.tokenizer import load_tokenizer
from reference.tools.batched import (
    DEFAULT_N_PREDICT,
    DEFAULT_PROMPT,
    batched,
    check_batched,
    n_kv_required,
    report,
)
from reference.tools.batched import sampler_params as batched_sampler_params
from reference.tools.batched_bench import (
    batched_bench,
    header,
    n_ctx_required,
    row_jsonl,
    row_md,
)
from reference.tools.generate import Perf
from reference.tools.parallel import (
    DEFAULT_N_JUNK,
    K_PROMPTS,
    K_SYSTEM,
    ParallelRun,
    client_seeds,
    make_requests,
    totals,
)
from reference.tools.parallel import DEFAULT_N_PREDICT as PARALLEL_N_PREDICT


def _write(text: str) -> None:
    sys.stdout.write(text)
    sys.stdout.flush()


def _load(args: argparse.Namespace, tokenizer: bool = True):
    """``(path, hparams, weights, tokenizer, backend, t_load_ms)`` for ``--model``."""
    t0 = time.perf_counter()
    path = model_path(args)
    hparams, weights = load_model(path)
    tok = load_tokenizer(path) if tokenizer else None
    backend = pick_backend(args.backend, hparams)
    log(f"llamaref: backend {backend}" + (" (auto)" if args.backend == "auto" else ""))
    weights = prepare_weights(weights, backend)
    return path, hparams, weights, tok, backend, 1e3 * (time.perf_counter() - t0)


def _print_perf(ctx, t_load_ms: float, t_start: float) -> None:
    """``llama_perf_context_print`` from the Context's counters, on stderr."""
    p = ctx.perf()
    perf = Perf(t_load_ms=t_load_ms, t_p_eval_ms=p.t_p_eval_ms, n_p_eval=p.n_p_eval,
                t_eval_ms=p.t_eval_ms, n_eval=p.n_eval, n_reused=p.n_reused,
                t_start=t_start)
    for line in perf.lines():
        log(line)


def _check_seed(seed: int) -> int:
    if not -1 <= seed <= LLAMA_DEFAULT_SEED:
        raise CLIError(f"--seed = {seed} must be in [0, {LLAMA_DEFAULT_SEED}] "
                       "(or -1: a random seed)")
    return seed & LLAMA_DEFAULT_SEED


def _piece(tokenizer):
    """``common_token_to_piece``: a token's bytes, special tokens rendered."""
    return lambda token: tokenizer.token_to_piece(token, special=True)


# ---- batched ---------------------------------------------------------------------------------

def check_batched_flags(args: argparse.Namespace) -> None:
    """The values ``llamaref batched`` refuses before loading the model."""
    if not 1 <= args.parallel <= LLAMA_MAX_SEQ:
        raise CLIError(f"-np {args.parallel}: a context holds 1 to {LLAMA_MAX_SEQ} "
                       f"sequences (LLAMA_MAX_SEQ); use -np <= {LLAMA_MAX_SEQ}")
    if args.n_predict < 1:
        raise CLIError(f"-n {args.n_predict}: the total length (prompt included) must be "
                       ">= 1")
    if args.ubatch_size < 1:
        raise CLIError(f"-ub {args.ubatch_size} must be >= 1")
    args.seed = _check_seed(args.seed)


def batched_prompt(args: argparse.Namespace) -> str:
    """``batched``'s prompt (``-p``), escapes processed unless ``--no-escape``
    ([`llamaref.common.prompt_text`][llamaref.common.prompt_text])."""
    return prompt_text(args, args.prompt)


# --8<-- [start:cmd_batched]
def cmd_batched(args: argparse.Namespace) -> int:
    """``llama-batched``: ``-np`` completions of the prompt, decoded together."""
    check_batched_flags(args)
    text = batched_prompt(args)
    path, hp, weights, tok, backend, t_load_ms = _load(args)
    t_start = time.perf_counter() - t_load_ms / 1e3
    prompt = tok.tokenize(text, add_special=True, parse_special=True)
    n_req = n_kv_required(len(prompt), args.n_predict, args.parallel)
    n_ctx = n_req if args.kv_unified else args.parallel * args.n_predict
    n_batch = max(args.n_predict, args.parallel)
    ctx = make_context(backend, hp, weights, n_ctx=max(n_ctx, 1), n_batch=n_batch,
                       n_ubatch=args.ubatch_size, n_seq_max=args.parallel,
                       kv_unified=args.kv_unified)
    params = batched_sampler_params(args.top_k, args.top_p, args.min_keep,
                                    max(args.temp, 0.0), args.seed)
    chains = [make_sampler(backend, params, hp.n_vocab) for _ in range(args.parallel)]
    check_batched(ctx, len(prompt), args.n_predict, args.parallel)
    log(f"\nmain: n_predict = {args.n_predict}, n_ctx = {ctx.n_ctx}, n_batch = "
        f"{n_batch}, n_parallel = {args.parallel}, n_kv_req = {n_req}")
    res = batched(ctx, [c for c, _ in chains], prompt, args.n_predict, tok.is_eog,
                  on_device=chains[0][1], info=log)
    piece = _piece(tok)
    streams = [b"".join(piece(t) for t in s).decode("utf-8", errors="replace")
               for s in res.tokens]
    if args.parallel == 1:  # llama.cpp streams the only sequence after the prompt
        _write("\n" + text + streams[0] + "\n")
    else:
        _write(f"\n{text}\n\nmain: generating {args.parallel} sequences ...\n")
    out, line = report(text, streams, res.n_decode, res.seconds)
    _write(out)
    log(line)
    _print_perf(ctx, t_load_ms, t_start)
    return 0
# --8<-- [end:cmd_batched]


# ---- parallel --------------------------------------------------------------------------------

def check_parallel_flags(args: argparse.Namespace) -> None:
    """The values ``llamaref parallel`` refuses before loading the model."""
    if not 1 <= args.parallel <= LLAMA_MAX_SEQ - 1:
        raise CLIError(f"-np {args.parallel}: the clients and the system prompt need "
                       f"-np + 1 sequences, at most {LLAMA_MAX_SEQ} (LLAMA_MAX_SEQ); use "
                       f"1 <= -np <= {LLAMA_MAX_SEQ - 1}")
    if args.sequences < 0:
        raise CLIError(f"-ns {args.sequences} must be >= 0")
    for flag, value in (("-b/--batch-size", args.batch_size),
                        ("-ub/--ubatch-size", args.ubatch_size)):
        if value < 1:
            raise CLIError(f"{flag} = {value} must be >= 1")
    if args.ctx_size < 0:
        raise CLIError(f"-c {args.ctx_size} must be >= 0 (0: the model's n_ctx_train)")
    if args.file is not None and not Path(args.file).is_file():
        raise CLIError(f"-f {args.file}: no such file")
    _check_vs(args)
    args.seed = _check_seed(args.seed)


def _check_vs(args: argparse.Namespace) -> None:
    """``--vs llama.cpp`` reads a GGUF file; ``--threads`` goes with it."""
    if args.threads is not None and (args.threads < 1 or args.vs != "llama.cpp"):
        raise CLIError("--threads sets llama.cpp's threads: a count >= 1 with --vs llama.cpp")
    if args.vs == "llama.cpp" and model_path(args).is_dir():
        raise CLIError("--vs llama.cpp reads a GGUF file; this model is a directory")


# --8<-- [start:llamacpp_peer]
def llamacpp_peer(args: argparse.Namespace, path: Path, n_seq_max: int) -> LlamaCppContext:
    """``--vs llama.cpp``: llama.cpp's own context on the same file with our sizes
    (``-c``, ``-b``, ``-ub``, ``-kvu``) and its defaults (f16 KV cache, the file's quantized
    matmuls, flash attention ``auto``), ``--threads`` threads (default: every core)."""
    return LlamaCppContext(path, n_ctx=args.ctx_size, n_batch=args.batch_size,
                           n_ubatch=args.ubatch_size, n_seq_max=n_seq_max,
                           kv_unified=args.kv_unified, n_threads=args.threads, f32=False)
# --8<-- [end:llamacpp_peer]


def prompt_lines(args: argparse.Namespace) -> list[str] | None:
    """The prompts of ``-f FILE`` or ``-p``, escapes processed unless ``--no-escape``
    ([`llamaref.common.prompt_text`][llamaref.common.prompt_text]), split on newlines as
    ``std::getline`` (a final newline adds no empty prompt); None: the built-in ones."""
    text = args.prompt if args.file is None else read_prompt_file(args.file)
    text = prompt_text(args, text)
    if not text:
        return None
    lines = text.split("\n")
    return lines[:-1] if text.endswith("\n") else lines


# --8<-- [start:cmd_parallel]
def cmd_parallel(args: argparse.Namespace) -> int:
    """``llama-parallel``: ``-ns`` requests from ``-np`` clients, served together."""
    check_parallel_flags(args)
    path, hp, weights, tok, backend, t_load_ms = _load(args)
    t_start = time.perf_counter() - t_load_ms / 1e3
    prompts = prompt_lines(args)
    for i, line in enumerate(prompts or []):
        log(f"{i + 1:3d} prompt: {line}")
    system = tok.tokenize(K_SYSTEM, add_special=True, parse_special=True)
    requests = make_requests(args.sequences, args.junk, prompts or K_PROMPTS,
                             args.is_pp_shared,
                             lambda text: tok.tokenize(text, add_special=False,
                                                       parse_special=True))
    ctx = make_context(backend, hp, weights, n_ctx=args.ctx_size, n_batch=args.batch_size,
                       n_ubatch=args.ubatch_size, n_seq_max=args.parallel + 1,
                       kv_unified=args.kv_unified)
    chains = [make_sampler(backend, _parallel_sampler(args, seed), hp.n_vocab, tok)
              for seed in client_seeds(args.seed, args.parallel)]
    run = ParallelRun(ctx, [c for c, _ in chains], system, requests, args.n_predict,
                      args.batch_size, args.is_pp_shared, tok.is_eog, _piece(tok),
                      on_device=chains[0][1], info=log)
    log(f"main: Simulating parallel requests from clients:\nmain: n_parallel = "
        f"{args.parallel}, n_sequences = {args.sequences}, cont_batching = 1, "
        f"system tokens = {len(system)}\n")
    run.run()
    log("")
    for line in totals(run, args.file, str(path)):
        log(line)
    log("")
    _print_perf(ctx, t_load_ms, t_start)
    if args.vs == "llama.cpp":
        del ctx  # one model in memory at a time
        peer = llamacpp_peer(args, path, n_seq_max=args.parallel + 1)
        chains = [make_sampler("reference", _parallel_sampler(args, seed), hp.n_vocab, tok)
                  for seed in client_seeds(args.seed, args.parallel)]
        theirs = ParallelRun(peer, [c for c, _ in chains], system, requests, args.n_predict,
                             args.batch_size, args.is_pp_shared, tok.is_eog, _piece(tok),
                             info=lambda line: None)
        theirs.run()
        log(f"the same schedule on llama.cpp ({peer.n_threads} threads, its defaults, our "
            "samplers on its logits):")
        for line in totals(theirs, args.file, str(path))[4:]:
            log(line)
        ours_t = (run.n_total_prompt + run.n_total_gen) / max(run.seconds, 1e-9)
        theirs_t = (theirs.n_total_prompt + theirs.n_total_gen) / max(theirs.seconds, 1e-9)
        log(f"Total speed ours / llama.cpp: {ours_t / theirs_t:.2f}")
    return 0
# --8<-- [end:cmd_parallel]


def _parallel_sampler(args: argparse.Namespace, seed: int) -> SamplerParams:
    """``common_params_sampling`` of one client."""
    return SamplerParams(seed=seed, n_prev=max(64, args.repeat_last_n), top_k=args.top_k,
                         top_p=args.top_p, min_p=args.min_p, temp=max(args.temp, 0.0),
                         penalty_last_n=args.repeat_last_n,
                         penalty_repeat=args.repeat_penalty)


# ---- batched-bench ---------------------------------------------------------------------------

def check_bench_flags(args: argparse.Namespace) -> None:
    """The lists ``llamaref batched-bench`` refuses before loading the model."""
    for flag, values in (("-npp", args.npp), ("-ntg", args.ntg), ("-npl", args.npl)):
        if any(v < 1 for v in values):
            raise CLIError(f"{flag} {','.join(map(str, values))}: every value must be >= 1")
    if args.npl and max(args.npl) > LLAMA_MAX_SEQ:
        raise CLIError(f"-npl {max(args.npl)}: a context holds at most {LLAMA_MAX_SEQ} "
                       f"sequences (LLAMA_MAX_SEQ); use -npl values <= {LLAMA_MAX_SEQ}")
    for flag, value in (("-b/--batch-size", args.batch_size),
                        ("-ub/--ubatch-size", args.ubatch_size)):
        if value < 1:
            raise CLIError(f"{flag} = {value} must be >= 1")
    if args.ctx_size < 0:
        raise CLIError(f"-c {args.ctx_size} must be >= 0 (0: the model's n_ctx_train)")
    _check_vs(args)


# --8<-- [start:cmd_batched_bench]
def cmd_batched_bench(args: argparse.Namespace) -> int:
    """``llama-batched-bench``: the PP / TG / B table, markdown or JSONL, on stdout."""
    check_bench_flags(args)
    path, hp, weights, _, backend, t_load_ms = _load(args, tokenizer=False)
    t_start = time.perf_counter() - t_load_ms / 1e3
    ctx = make_context(backend, hp, weights, n_ctx=args.ctx_size, n_batch=args.batch_size,
                       n_ubatch=args.ubatch_size, n_seq_max=max(args.npl, default=1),
                       kv_unified=args.kv_unified)
    need = [n_ctx_required(pp, tg, pl, args.is_pp_shared, ctx.kv_unified)
            for pp in args.npp for tg in args.ntg for pl in args.npl]
    if need and min(need) > ctx.n_ctx:
        raise CLIError(f"no row fits: the smallest needs {min(need)} cells and the context "
                       f"has {ctx.n_ctx}: increase -c")
    threads = os.cpu_count() or 1
    config = dict(n_kv_max=ctx.n_ctx, n_batch=args.batch_size, n_ubatch=ctx.n_ubatch,
                  flash_attn=0, is_pp_shared=int(args.is_pp_shared),
                  is_tg_separate=int(args.is_tg_separate), n_gpu_layers=0,
                  n_threads=threads, n_threads_batch=threads)
    jsonl = args.output_format == "jsonl"
    if not jsonl:
        _write("\n" + "\n".join(header(config)) + "\n")
    config.pop("is_tg_separate")  # not a JSONL key (batched-bench.cpp:229)
    rows = batched_bench(ctx, args.npp, args.ntg, args.npl, args.is_pp_shared,
                         args.is_tg_separate, n_batch=ctx.n_batch)
    ours = []
    for row in rows:
        ours.append(row)
        _write((row_jsonl(row, config) if jsonl else row_md(row)) + "\n")
    _write("\n")
    _print_perf(ctx, t_load_ms, t_start)
    if args.vs == "llama.cpp":
        del ctx  # one model in memory at a time
        _batched_bench_llamacpp(args, path, backend, ours, jsonl)
    return 0
# --8<-- [end:cmd_batched_bench]


# --8<-- [start:batched_bench_llamacpp]
def _batched_bench_llamacpp(args: argparse.Namespace, path: Path, backend: str, ours: list,
                            jsonl: bool) -> None:
    """``--vs llama.cpp``: the same rows by the same code on llama.cpp's own context, then
    S_TG side by side with the ratio ours / llama.cpp (above 1: ours is faster)."""
    peer = llamacpp_peer(args, path, n_seq_max=max(args.npl, default=1))
    config = dict(n_kv_max=peer.n_ctx, n_batch=peer.n_batch, n_ubatch=peer.n_ubatch,
                  flash_attn=-1, is_pp_shared=int(args.is_pp_shared),
                  is_tg_separate=int(args.is_tg_separate), n_gpu_layers=0,
                  n_threads=peer.n_threads, n_threads_batch=peer.n_threads)
    if not jsonl:
        _write(f"## llama.cpp ({peer.n_threads} threads, its defaults: f16 KV cache, the "
               f"file's quantized matmuls)\n\n" + "\n".join(header(config)[2:]) + "\n")
    config.pop("is_tg_separate")
    theirs = {}
    for row in batched_bench(peer, args.npp, args.ntg, args.npl, args.is_pp_shared,
                             args.is_tg_separate, n_batch=peer.n_batch):
        theirs[row.pp, row.tg, row.pl] = row
        _write((row_jsonl(row, config) if jsonl else row_md(row)) + "\n")
    if jsonl:
        return
    _write(f"\n| PP | TG | B | S_TG llamaref ({backend}) | S_TG llama.cpp | ratio |\n"
           "|---:|---:|---:|---:|---:|---:|\n")
    for row in ours:
        peer_row = theirs.get((row.pp, row.tg, row.pl))
        if peer_row is not None and peer_row.speed_tg > 0:
            _write(f"| {row.pp} | {row.tg} | {row.pl} | {row.speed_tg:.2f} | "
                   f"{peer_row.speed_tg:.2f} | {row.speed_tg / peer_row.speed_tg:.2f} |\n")
# --8<-- [end:batched_bench_llamacpp]


# ---- the parsers -----------------------------------------------------------------------------

def _int_list(text: str) -> list[int]:
    """``-npp 128,256``: llama.cpp's ``string_split<int>(value, ',')``."""
    try:
        return [int(v) for v in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of "
                                         "integers") from None


# -c of these examples: 0 is the model's training context, as in llama.cpp's examples
_CTX_SIZE_TRAIN = dict(default=0, help="context size (default: 0 = the model's n_ctx_train)")


def _add_common(p: argparse.ArgumentParser) -> None:
    p.add_argument("-m", "--model", help="a GGUF file or a HF directory (default: SmolLM2)")
    p.add_argument("--backend", default="auto", choices=("auto", "accelerated", "reference"),
                   help="auto: accelerated (MLX) when MLX's default device is a GPU, else "
                        "reference (NumPy) (default: auto)")
    add_context_flags(p, ["kv_unified", "no_kv_unified", "ubatch_size"])


def _add_sampling(p: argparse.ArgumentParser, common: bool) -> None:
    if not common:
        s = add_sampling_flags(p, ["seed", "temp", "top_k", "top_p"])
        s.add_argument("--min-keep", type=int, default=0, metavar="N",
                       help="candidates top-p keeps at least (default: 0)")
        return
    add_sampling_flags(p, list(SAMPLING_FLAGS))


def add_parallel_commands(sub) -> None:
    """Register ``batched``, ``parallel`` and ``batched-bench`` (the CLI calls this)."""
    fmt = argparse.RawDescriptionHelpFormatter
    b = sub.add_parser(
        "batched", help="several completions of one prompt (like llama-batched)",
        formatter_class=fmt,
        description="llama.cpp's examples/batched: the prompt decoded once, -np streams "
                    "sampled and decoded together; -n is the total length, prompt included.",
        epilog="example:\n  llamaref batched -p \"Hello my name is\" -n 32 -np 4 -kvu")
    _add_common(b)
    b.add_argument("-p", "--prompt", default=DEFAULT_PROMPT,
                   help=f"the prompt (default: {DEFAULT_PROMPT!r})")
    add_prompt_flags(b)
    b.add_argument("-n", "--n-predict", "--predict", dest="n_predict", type=int,
                   default=DEFAULT_N_PREDICT, metavar="N",
                   help=f"total length of each sequence, prompt included "
                        f"(default: {DEFAULT_N_PREDICT})")
    add_context_flags(b, ["parallel"])
    _add_sampling(b, common=False)
    b.set_defaults(func=cmd_batched)

    p = sub.add_parser(
        "parallel", help="a server with many clients (like llama-parallel)",
        formatter_class=fmt,
        description="llama.cpp's examples/parallel: -ns requests from -np clients with "
                    "continuous batching; -pps shares the system prompt; chunks of -b "
                    "tokens, halved when the KV cache is full (a cache miss).",
        epilog="examples:\n  llamaref parallel -np 4 -ns 16 -pps -n 64\n"
               "  llamaref parallel -np 8 -ns 32 -f questions.txt -c 4096 -kvu")
    _add_common(p)
    add_context_flags(p, ["parallel"], parallel=dict(help="number of clients (default: 1)"))
    p.add_argument("-ns", "--sequences", type=int, default=1, metavar="N",
                   help="number of requests (default: 1)")
    p.add_argument("-pps", dest="is_pp_shared", action="store_true",
                   help="share the system prompt in the KV cache (default: off)")
    p.add_argument("--junk", type=int, default=DEFAULT_N_JUNK, metavar="N",
                   help=f"junk question/answer pairs per request are drawn in [0, N) "
                        f"(default: {DEFAULT_N_JUNK})")
    p.add_argument("-p", "--prompt", default="",
                   help="questions, one per line (default: the built-in nine)")
    p.add_argument("-f", "--file", metavar="FNAME", help="read the questions from a file")
    add_prompt_flags(p)
    p.add_argument("-n", "--n-predict", "--predict", dest="n_predict", type=int,
                   default=PARALLEL_N_PREDICT, metavar="N",
                   help=f"most tokens per response (default: {PARALLEL_N_PREDICT}, "
                        "-1 = no limit)")
    add_context_flags(p, ["ctx_size", "batch_size"], ctx_size=_CTX_SIZE_TRAIN,
                      batch_size=dict(help="tokens per decode (default: 2048)"))
    p.add_argument("--vs", choices=("llama.cpp",), default=None,
                   help="then run the same requests on llama.cpp (llama-cpp-python, the same "
                        "GGUF, its defaults) and print its totals and the speed ratio")
    p.add_argument("--threads", type=int, default=None, metavar="N",
                   help="llama.cpp's CPU threads with --vs llama.cpp (default: every core)")
    _add_sampling(p, common=True)
    p.set_defaults(func=cmd_parallel)

    bb = sub.add_parser(
        "batched-bench", help="the PP / TG / B throughput table (like llama-batched-bench)",
        formatter_class=fmt,
        description="llama.cpp's tools/batched-bench: for every -npp, -ntg and -npl, "
                    "prompt processing and generation speed of B sequences at once.",
        epilog="examples:\n  llamaref batched-bench -c 2048 -npp 128 -ntg 128 "
               "-npl 1,2,4,8,16,32 [-pps]\n"
               "  llamaref batched-bench -c 8192 -npp 128 -ntg 32 -npl 1,8,32 --vs llama.cpp")
    _add_common(bb)
    add_context_flags(bb, ["ctx_size", "batch_size"], ctx_size=_CTX_SIZE_TRAIN)
    for flag, what in (("-npp", "prompt sizes"), ("-ntg", "generated tokens"),
                       ("-npl", "parallel sequences")):
        bb.add_argument(flag, type=_int_list, action="extend", default=[],
                        metavar="n0,n1,...", help=f"{what} (lists add up; default: none)")
    bb.add_argument("-pps", dest="is_pp_shared", action="store_true",
                    help="one prompt shared by every sequence (default: off)")
    bb.add_argument("-tgs", dest="is_tg_separate", action="store_true",
                    help="generate for one sequence after the other (default: off)")
    bb.add_argument("--output-format", choices=("md", "jsonl"), default="md",
                    help="markdown table or one JSON line per row (default: md)")
    bb.add_argument("--vs", choices=("llama.cpp",), default=None,
                    help="run the same rows on llama.cpp (llama-cpp-python, the same GGUF, "
                         "its defaults) and print S_TG side by side")
    bb.add_argument("--threads", type=int, default=None, metavar="N",
                    help="llama.cpp's CPU threads with --vs llama.cpp (default: every core)")
    bb.set_defaults(func=cmd_batched_bench)
