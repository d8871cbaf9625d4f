r"""``llamaref serve``: the flags of ``llama-server``, the model loaded on a thread while the
HTTP server already answers (503 "Loading model"), then the engine's loop over the
scheduler's steps.

Slots: with no ``-np`` the server runs 4 slots on one unified KV cache (``n_parallel = -1``
means "auto": 4 and ``kv_unified``, server.cpp:156-161); an explicit ``-np N`` gives every
slot its own KV stream of ``n_ctx / N`` cells unless ``-kvu``.
"""

from __future__ import annotations

import argparse
import math
import time
from pathlib import Path
from typing import Any

import uvicorn

from llamaref.backends import make_context, make_sampler, pick_backend, prepare_weights
from llamaref.common import CLIError, add_context_flags, add_sampling_flags, log, model_path
from llamaref.server.app import DEFAULT_BODY_LIMIT, ServerState, build_app, start_engine
from llamaref.server.engine import Engine
from reference.common import LLAMA_DEFAULT_SEED
from reference.model_loader import load_model
from reference.sampling import SamplerParams
from reference.tokenizer import load_tokenizer
from reference.tools.server.params import SlotParams
from reference.tools.server.scheduler import Scheduler, SchedulerConfig
from reference.tools.server.spans import user_delimiter

DEFAULT_N_SLOTS = 4  # server.cpp:156-161: n_parallel = -1 ("auto") means 4 unified slots


# --8<-- [start:scheduler_config]
def scheduler_config(args: argparse.Namespace) -> SchedulerConfig:
    """The scheduler's settings from the flags."""
    return SchedulerConfig(
        n_slots=n_slots(args), ctx_shift=args.context_shift,
        slot_prompt_similarity=args.slot_prompt_similarity,
        n_ctx_checkpoints=args.ctx_checkpoints, checkpoint_min_step=args.checkpoint_min_step,
        swa_full=args.swa_full, cache_ram_mib=args.cache_ram,
        cache_idle_slots=args.cache_idle_slots, n_cache_reuse=args.cache_reuse,
        prompt_budget=args.prompt_budget)
# --8<-- [end:scheduler_config]


def n_slots(args: argparse.Namespace) -> int:
    return DEFAULT_N_SLOTS if args.parallel < 0 else args.parallel


def kv_unified(args: argparse.Namespace) -> bool:
    """``-np`` unset: one unified cache; ``-np N``: a stream per slot unless ``-kvu``."""
    return args.parallel < 0 or args.kv_unified


def default_params(args: argparse.Namespace) -> SlotParams:
    """A request's defaults: the command line's sampling flags and ``-n``."""
    sampling = SamplerParams(
        seed=args.seed & LLAMA_DEFAULT_SEED, top_k=args.top_k, top_p=args.top_p,
        min_p=args.min_p, temp=args.temp, penalty_last_n=args.repeat_last_n,
        n_prev=max(64, args.repeat_last_n), penalty_repeat=args.repeat_penalty,
        penalty_freq=args.frequency_penalty, penalty_present=args.presence_penalty)
    return SlotParams(n_predict=args.n_predict, n_keep=args.keep, sampling=sampling)


def check_serve_flags(args: argparse.Namespace) -> None:
    """Refuse bad flag values before anything is loaded."""
    if args.parallel == 0 or args.parallel < -1:
        raise CLIError(f"-np/--parallel = {args.parallel}: use a number of slots >= 1 "
                       "(or -1: 4 slots on a unified cache)")
    for flag, value, low in (("-c/--ctx-size", args.ctx_size, 0),
                             ("-b/--batch-size", args.batch_size, 1),
                             ("-ub/--ubatch-size", args.ubatch_size, 1),
                             ("--ctx-checkpoints", args.ctx_checkpoints, 0),
                             ("--checkpoint-min-step", args.checkpoint_min_step, 0),
                             ("--cache-reuse", args.cache_reuse, 0),
                             ("--body-limit", args.body_limit, 1),
                             ("--max-queue", args.max_queue, 1),
                             ("--prompt-budget", args.prompt_budget, 0),
                             ("--port", args.port, 0)):
        if value < low:
            raise CLIError(f"{flag} = {value} must be >= {low}")
    if args.cache_ram < -1:
        raise CLIError(f"--cache-ram = {args.cache_ram}: MiB >= 0, or -1 for no limit")
    if not 0.0 <= args.slot_prompt_similarity <= 1.0:
        raise CLIError(f"-sps = {args.slot_prompt_similarity} must be in [0, 1]")
    for flag, value in (("temp", args.temp), ("top-p", args.top_p), ("min-p", args.min_p)):
        if not math.isfinite(value):
            raise CLIError(f"--{flag} must be finite, got {value}")
    if args.slot_save_path is not None and not Path(args.slot_save_path).is_dir():
        raise CLIError(f"--slot-save-path {args.slot_save_path}: no such directory")


# --8<-- [start:load_engine]
def load_engine(args: argparse.Namespace, state: ServerState) -> Engine:
    """Load the model and build the Context, the scheduler, the engine that drives it and
    the request defaults."""
    path = model_path(args)
    hparams, weights = load_model(path)
    tokenizer = load_tokenizer(path)
    backend = pick_backend(args.backend, hparams)
    log(f"llamaref serve: backend {backend}")
    weights = prepare_weights(weights, backend)
    slots = n_slots(args)
    swa_full = args.swa_full
    if swa_full and not getattr(hparams, "n_swa", 0):
        log("llamaref serve: --swa-full has no effect: the model has no sliding window")
        swa_full = False
    ctx = make_context(backend, hparams, weights, n_ctx=args.ctx_size,
                       n_batch=args.batch_size, n_ubatch=args.ubatch_size, n_seq_max=slots,
                       kv_unified=kv_unified(args), swa_full=swa_full)
    config = scheduler_config(args)
    config.swa_full = swa_full
    if config.ctx_shift and not ctx.memory.can_shift():
        log("llamaref serve: this memory cannot shift positions: context shift disabled")
        config.ctx_shift = False

    def sampler_for(params: SamplerParams):
        return make_sampler(backend, params, hparams.n_vocab, tokenizer)
    engine = Engine(Scheduler(ctx, tokenizer, sampler_for, config), max_queue=args.max_queue)
    state.tokenizer, state.n_vocab = tokenizer, hparams.n_vocab
    state.user_delimiter = user_delimiter(tokenizer)
    state.model_name = args.alias or Path(path).name
    state.model_path = str(path)
    state.defaults = default_params(args)
    state.props = {"chat_template": tokenizer.chat_template or "",
                   "bos_token": _piece(tokenizer, tokenizer.bos_id),
                   "eos_token": _piece(tokenizer, tokenizer.eos_id),
                   "build_info": "llamaref", "backend": backend,
                   "n_ctx": ctx.n_ctx, "kv_unified": kv_unified(args)}
    return engine
# --8<-- [end:load_engine]


def _piece(tokenizer: Any, token: int | None) -> str:
    if token is None:
        return ""
    return tokenizer.token_to_piece(token, special=True).decode("utf-8", "replace")


def new_state(args: argparse.Namespace) -> ServerState:
    """The handlers' shared state from the flags (no model yet)."""
    return ServerState(
        api_key=args.api_key, body_limit=args.body_limit,
        slot_save_path=Path(args.slot_save_path) if args.slot_save_path else None,
        metrics_enabled=args.metrics, slots_enabled=args.slots)


def cmd_serve(args: argparse.Namespace) -> int:
    """Answer HTTP at once; load the model on a thread; serve until interrupted."""
    check_serve_flags(args)
    state = new_state(args)
    app = build_app(state)

    t0 = time.perf_counter()

    def load() -> Engine:
        try:
            engine = load_engine(args, state)
        except Exception as e:  # the server stays up and reports it on every request
            log(f"llamaref serve: error: {type(e).__name__}: {e}")
            raise
        log(f"llamaref serve: model loaded in {time.perf_counter() - t0:.1f} s; "
            f"{len(engine.scheduler.slots)} slots of {engine.scheduler.slots[0].n_ctx} "
            "tokens")
        return engine
    start_engine(state, load)
    log(f"llamaref serve: listening on http://{args.host}:{args.port}")
    uvicorn.run(app, host=args.host, port=args.port, log_level="warning",
                timeout_graceful_shutdown=1)
    state.stop.set()
    return 0


def add_serve_command(sub) -> None:
    """``llamaref serve`` and its flags (llama-server's names and defaults)."""
    p = sub.add_parser("serve", help="an OpenAI-compatible server (like llama-server)",
                       description="llama.cpp's server: slots on one KV cache, continuous "
                                   "batching, prompt caching, OpenAI and llama.cpp endpoints.")
    p.add_argument("-m", "--model", help="a GGUF file or a HF directory (default: SmolLM2)")
    p.add_argument("--backend", default="auto", choices=("auto", "accelerated", "reference"),
                   help="auto: accelerated (MLX) on a GPU, else reference (default: auto)")
    p.add_argument("-a", "--alias", help="the model name in responses (default: file name)")
    net = p.add_argument_group("HTTP")
    net.add_argument("--host", default="127.0.0.1", help="address (default: 127.0.0.1)")
    net.add_argument("--port", type=int, default=8080, help="port (default: 8080)")
    net.add_argument("--api-key", help="require this key (Authorization: Bearer KEY)")
    net.add_argument("--body-limit", type=int, default=DEFAULT_BODY_LIMIT, metavar="BYTES",
                     help=f"largest request body (default: {DEFAULT_BODY_LIMIT})")
    net.add_argument("--max-queue", type=int, default=1024, metavar="N",
                     help="waiting requests before new ones get 503 (default: 1024)")
    net.add_argument("--metrics", dest="metrics", action="store_true", default=True,
                     help="GET /metrics (default: on)")
    net.add_argument("--no-metrics", dest="metrics", action="store_false")
    net.add_argument("--no-slots", dest="slots", action="store_false", default=True,
                     help="turn off GET /slots")
    net.add_argument("--slot-save-path", metavar="DIR",
                     help="directory of /slots/{id}?action=save|restore files")
    c = p.add_argument_group("slots and memory (llama-server's names and defaults)")
    add_context_flags(
        c, ["parallel", "kv_unified", "ctx_size", "batch_size", "ubatch_size"],
        parallel=dict(default=-1, help="slots (default: -1 = 4 slots on a unified KV cache)"),
        kv_unified=dict(help="with -np N: one KV cache shared by all slots"),
        ctx_size=dict(help="context size of all slots together (default: 4096; 0 = the "
                           "model's)"),
        batch_size=dict(help="tokens per step, all slots together (default: 2048)"))
    c.add_argument("--prompt-budget", type=int, default=0, metavar="N",
                   help="most prompt tokens per step while a slot generates (ours, not "
                        "llama.cpp's; default: 0 = what -b leaves)")
    c.add_argument("-n", "--n-predict", type=int, default=-1, metavar="N",
                   help="default n_predict of a request (default: -1 = no limit)")
    add_context_flags(c, ["keep"], keep=dict(help="default n_keep of a request (default: 0)"))
    c.add_argument("--context-shift", action="store_true",
                   help="shift a full slot's context instead of stopping (default: off)")
    c.add_argument("-sps", "--slot-prompt-similarity", type=float, default=0.10, metavar="F",
                   help="reuse the slot whose cache covers more than this share of the "
                        "prompt (default: 0.10; 0 = least recently used)")
    c.add_argument("--cache-reuse", type=int, default=0, metavar="N",
                   help="shortest cached chunk moved by KV shifting (default: 0 = off)")
    c.add_argument("--cache-ram", "-cram", type=float, default=8192, metavar="MiB",
                   help="RAM prompt cache (default: 8192 MiB; 0 = off, -1 = no limit)")
    c.add_argument("--no-cache-idle-slots", dest="cache_idle_slots", action="store_false",
                   default=True, help="do not move idle slots into the RAM cache")
    c.add_argument("-ctxcp", "--ctx-checkpoints", "--swa-checkpoints", type=int, default=32,
                   metavar="N", help="checkpoints per slot (SWA / recurrent; default: 32)")
    c.add_argument("-cms", "--checkpoint-min-step", type=int, default=8192, metavar="N",
                   help="tokens between checkpoints (default: 8192)")
    add_context_flags(c, ["swa_full"], swa_full=dict(
        help="full-size SWA cache: no checkpoints needed, context shift possible"))
    s = add_sampling_flags(p, ["seed", "temp", "top_k", "top_p", "min_p", "repeat_last_n",
                               "repeat_penalty"])
    s.add_argument("--presence-penalty", type=float, default=0.0, metavar="N")
    s.add_argument("--frequency-penalty", type=float, default=0.0, metavar="N")
    p.set_defaults(func=cmd_serve)
