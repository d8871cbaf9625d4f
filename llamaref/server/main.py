r"""``llamaref serve``: the flags of ``llama-server``, the model loaded on a thread while the
HTTP server already answers (503 "Loading model"), then the engine's loop over the
scheduler's steps.

Slots: with no ``-np`` the server runs 4 slots on one unified KV cache (``n_parallel = -1``
means "auto": 4 and ``kv_unified``, server.cpp:156-161); an explicit ``-np N`` gives every
slot its own KV stream of ``n_ctx / N`` cells unless ``-kvu``.

Transport: uvicorn's h11 protocol with a read deadline ([`read_timeout_protocol`][]: a
request's head and body must arrive within ``-to/--timeout`` seconds, so that a stalled
client cannot hold a connection forever), a [`Server`][llamaref.server.main.Server] whose
Ctrl-C / SIGTERM answers every waiting request 503 at once, and one listening socket per
``--host`` address ([`bind_sockets`][]).
"""

from __future__ import annotations

import argparse
import math
import socket
import time
from pathlib import Path
from typing import Any

import h11
import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

from llamaref.backends import make_context, make_sampler, pick_backend, prepare_weights
from llamaref.common import CLIError, add_context_flags, add_sampling_flags, log, model_path
from llamaref.server.app import (
    DEFAULT_BODY_LIMIT,
    DEFAULT_TIMEOUT,
    PROMPT_BYTES_PER_TOKEN,
    ServerState,
    begin_shutdown,
    build_app,
    default_allowed_hosts,
    start_engine,
)
from llamaref.server.engine import Engine
from reference.chat_template import ChatTemplateError, render_chat_template
from reference.common import LLAMA_DEFAULT_SEED
from reference.model_loader import load_model
from reference.sampling import SamplerParams
from reference.tokenizer import load_tokenizer
from reference.tools.lookup import ngram_cache_load
from reference.tools.server.params import SlotParams
from reference.tools.server.scheduler import Scheduler, SchedulerConfig
from reference.tools.server.spans import user_delimiter
from reference.tools.server.speculator import check_spec_setup
from reference.tools.speculative import SpeculativeError, check_draft_vocab, draft_layers

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
        prompt_budget=args.prompt_budget, draft_n_max=args.draft_max,
        draft_n_min=args.draft_min, draft_p_min=args.draft_p_min,
        spec_types=tuple(spec_type_list(args)), spec_ngram_size_n=args.spec_ngram_size_n,
        spec_ngram_size_m=args.spec_ngram_size_m)
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
                             ("--max-prompt-bytes", args.max_prompt_bytes, 0),
                             ("-to/--timeout", args.timeout, 1),
                             ("--port", args.port, 0)):
        if value < low:
            raise CLIError(f"{flag} = {value} must be >= {low}")
    check_draft_flags(args)
    if args.cache_ram < -1:
        raise CLIError(f"--cache-ram = {args.cache_ram}: MiB >= 0, or -1 for no limit")
    if not 0.0 <= args.slot_prompt_similarity <= 1.0:
        raise CLIError(f"-sps = {args.slot_prompt_similarity} must be in [0, 1]")
    for flag, value in (("temp", args.temp), ("top-p", args.top_p), ("min-p", args.min_p)):
        if not math.isfinite(value):
            raise CLIError(f"--{flag} must be finite, got {value}")
    if args.slot_save_path is not None and not Path(args.slot_save_path).is_dir():
        raise CLIError(f"--slot-save-path {args.slot_save_path}: no such directory")
    for host in split_csv(args.host) or [""]:
        if not host or host.endswith(".sock"):
            raise CLIError(f"--host {args.host!r}: give IP addresses or names, separated by "
                           "commas (UNIX sockets are not supported)")
    args.chat_template = chat_template(args)


def check_draft_flags(args: argparse.Namespace) -> None:
    """The speculative flags: one draft at most (``-md`` or ``--draft-layers``), a draft
    file that exists, drafter types this server has, each with what it needs, and sizes
    and probabilities in range."""
    if args.model_draft is not None and args.draft_layers is not None:
        raise CLIError("give one draft: -md/--model-draft FILE or --draft-layers K, not both")
    if args.model_draft is not None and not Path(args.model_draft).exists():
        raise CLIError("-md/--model-draft: no such file or folder")
    if args.draft_layers is not None and args.draft_layers < 1:
        raise CLIError(f"--draft-layers = {args.draft_layers} must be >= 1")
    for flag, value in (("--draft-max", args.draft_max), ("--draft-min", args.draft_min)):
        if value < 0:
            raise CLIError(f"{flag} = {value} must be >= 0")
    if not 0.0 <= args.draft_p_min <= 1.0:
        raise CLIError(f"--draft-p-min = {args.draft_p_min} must be in [0, 1]")
    check_spec_types(args)


def spec_type_list(args: argparse.Namespace) -> list[str]:
    """``--spec-type``'s names, every use and every comma (empty: not given)."""
    return [t.strip() for v in args.spec_type or [] for t in v.split(",")]


def check_spec_types(args: argparse.Namespace) -> None:
    """``--spec-type`` as [`check_spec_setup`][reference.tools.server.speculator.check_spec_setup]
    has it; ``-lcs``/``-lcd`` only for ``ngram-cache``, as readable files; ``min-hits >= 1``."""
    types = spec_type_list(args)
    has_draft = args.model_draft is not None or args.draft_layers is not None
    try:
        check_spec_setup(types or (["draft-simple"] if has_draft else []), has_draft,
                         args.spec_ngram_size_n, args.spec_ngram_size_m)
    except SpeculativeError as e:
        raise CLIError(str(e)) from None
    for flag, path in (("-lcs/--lookup-cache-static", args.lookup_cache_static),
                       ("-lcd/--lookup-cache-dynamic", args.lookup_cache_dynamic)):
        if path is None:
            continue
        if "ngram-cache" not in types:
            raise CLIError(f"{flag} is read by --spec-type ngram-cache only")
        if not Path(path).is_file():
            raise CLIError(f"{flag}: no such file")
    if args.spec_ngram_min_hits < 1:
        raise CLIError(f"--spec-ngram-simple-min-hits = {args.spec_ngram_min_hits} must be "
                       ">= 1")


def load_ngram_caches(args: argparse.Namespace) -> dict:
    """``-lcs``/``-lcd``'s n-gram caches (read once; the server never writes them)."""
    return {name: ngram_cache_load(path) for name, path in (
        ("static", args.lookup_cache_static), ("dynamic", args.lookup_cache_dynamic))
        if path is not None}


def split_csv(value: str | None) -> list[str]:
    """A comma-separated flag's items, blanks dropped (``parse_csv_row``).

    Examples:
        >>> split_csv("a, b,,c"), split_csv(None)
        (['a', 'b', 'c'], [])
    """
    return [v.strip() for v in (value or "").split(",") if v.strip()]


def chat_template(args: argparse.Namespace) -> str | None:
    """``--chat-template`` or ``--chat-template-file``'s Jinja text, checked by rendering
    one user message (None: the model's own template).

    Raises:
        CLIError: the file cannot be read, or the template does not render.
    """
    text = args.chat_template
    if args.chat_template_file is not None:
        try:
            text = Path(args.chat_template_file).read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:
            raise CLIError(f"--chat-template-file {args.chat_template_file}: "
                           f"{type(e).__name__}: {e}") from None
    if text is None:
        return None
    try:
        render_chat_template(text, [{"role": "user", "content": "test"}], True,
                             bos_token="", eos_token="")
    except ChatTemplateError as e:
        raise CLIError(f"--chat-template: the template does not render: {e}") from None
    return text


# --8<-- [start:load_engine]
def load_engine(args: argparse.Namespace, state: ServerState) -> Engine:
    """Load the model and build the Context, the scheduler, the engine that drives it and
    the request defaults."""
    path = model_path(args)
    hparams, weights = load_model(path)
    tokenizer = load_tokenizer(path)
    if getattr(args, "chat_template", None) is not None:
        tokenizer.chat_template = args.chat_template  # --chat-template(-file)
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

    draft = load_draft(args, backend, hparams, weights, tokenizer, ctx, swa_full)

    def sampler_for(params: SamplerParams):
        return make_sampler(backend, params, hparams.n_vocab, tokenizer)
    engine = Engine(Scheduler(ctx, tokenizer, sampler_for, config, draft=draft,
                              ngram_caches=load_ngram_caches(args)),
                    max_queue=args.max_queue)
    state.tokenizer, state.n_vocab = tokenizer, hparams.n_vocab
    state.user_delimiter = user_delimiter(tokenizer)
    state.aliases = state.aliases or [Path(path).name]  # -a a,b: set by new_state
    state.model_name = state.aliases[0]
    state.model_path = str(path)
    state.defaults = default_params(args)
    state.props = {"chat_template": tokenizer.chat_template or "",
                   "bos_token": _piece(tokenizer, tokenizer.bos_id),
                   "eos_token": _piece(tokenizer, tokenizer.eos_id),
                   "build_info": "llamaref", "backend": backend,
                   "n_ctx": ctx.n_ctx, "kv_unified": kv_unified(args)}
    return engine
# --8<-- [end:load_engine]


def load_draft(args: argparse.Namespace, backend: str, hparams: Any, weights: Any,
               tokenizer: Any, ctx: Any, swa_full: bool) -> Any:
    """The slots' draft Context (None without ``-md`` or ``--draft-layers``): ``-md``'s
    model (its vocabulary checked against the target's) or the target's first
    ``--draft-layers`` layers over the same prepared weights, with the target's context
    size, sequences and cache layout."""
    if args.model_draft is None and args.draft_layers is None:
        return None
    if args.draft_layers is not None:
        d_hparams, d_weights = draft_layers(hparams, args.draft_layers), weights
    else:
        d_hparams, d_weights = load_model(args.model_draft)
        check_draft_vocab(tokenizer, load_tokenizer(args.model_draft))
        pick_backend(backend, d_hparams)  # the draft must run there too
        d_weights = prepare_weights(d_weights, backend)
    swa_full = swa_full and bool(getattr(d_hparams, "n_swa", 0))
    return make_context(backend, d_hparams, d_weights, n_ctx=ctx.n_ctx,
                        n_batch=args.batch_size, n_ubatch=args.ubatch_size,
                        n_seq_max=ctx.n_seq_max, kv_unified=ctx.kv_unified,
                        swa_full=swa_full)


def _piece(tokenizer: Any, token: int | None) -> str:
    if token is None:
        return ""
    return tokenizer.token_to_piece(token, special=True).decode("utf-8", "replace")


def new_state(args: argparse.Namespace) -> ServerState:
    """The handlers' shared state from the flags (no model yet)."""
    hosts = split_csv(args.host)
    allowed = split_csv(args.allowed_hosts)
    return ServerState(
        api_key=split_csv(args.api_key) or None, body_limit=args.body_limit,
        slot_save_path=Path(args.slot_save_path) if args.slot_save_path else None,
        metrics_enabled=args.metrics, slots_enabled=args.slots,
        max_prompt_bytes=args.max_prompt_bytes, cors_origins=split_csv(args.cors_origins),
        allowed_hosts=(None if "*" in allowed else
                       [h.lower() for h in allowed] if allowed else default_allowed_hosts(hosts)),
        ui=args.ui, tags=split_csv(args.tags), aliases=split_csv(args.alias))


# ---- transport ----------------------------------------------------------------------------------

def read_timeout_protocol(timeout: float) -> type[H11Protocol]:
    """uvicorn's h11 protocol with a read deadline: a request's head and body must arrive
    within ``timeout`` seconds of its first byte (of the connection's opening, for its
    first request), or the connection is closed, as llama-server's read timeout closes a
    socket that stalls. uvicorn's own ``timeout_keep_alive`` only covers the wait *between*
    two requests; a client that sends half a head, half a body or nothing at all would
    otherwise hold its connection forever (slowloris)."""

    class ReadTimeoutH11Protocol(H11Protocol):
        read_timeout = timeout
        _read_timer: Any = None

        def connection_made(self, transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            self._update_read_timer()

        def data_received(self, data: bytes) -> None:
            super().data_received(data)
            self._update_read_timer()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            self._update_read_timer()

        def connection_lost(self, exc: Exception | None) -> None:
            self._cancel_read_timer()
            super().connection_lost(exc)

        def _reading(self) -> bool:
            """A request is on its way in: its head is incomplete (nothing yet, on a new
            connection) or its body is."""
            if self.transport.is_closing():
                return False
            state = self.conn.their_state
            if state is h11.SEND_BODY:
                return True
            return state is h11.IDLE and (self.cycle is None
                                          or bool(self.conn.trailing_data[0]))

        def _update_read_timer(self) -> None:
            if not self._reading():
                self._cancel_read_timer()
            elif self._read_timer is None:
                self._read_timer = self.loop.call_later(self.read_timeout,
                                                        self._read_timed_out)

        def _cancel_read_timer(self) -> None:
            if self._read_timer is not None:
                self._read_timer.cancel()
                self._read_timer = None

        def _read_timed_out(self) -> None:
            self._read_timer = None
            if self._reading():
                self.transport.close()

    return ReadTimeoutH11Protocol


class Server(uvicorn.Server):
    """uvicorn's server, whose shutdown (Ctrl-C, SIGTERM) first tells every request that
    waits on the engine to answer 503 ([`begin_shutdown`][llamaref.server.app.begin_shutdown]):
    uvicorn's graceful shutdown then finds them done instead of cancelling them."""

    def __init__(self, config: uvicorn.Config, state: ServerState):
        super().__init__(config)
        self.state = state

    def handle_exit(self, sig: int, frame: Any) -> None:
        begin_shutdown(self.state)
        super().handle_exit(sig, frame)


def server_config(app: Any, timeout: float = DEFAULT_TIMEOUT, **kw: Any) -> uvicorn.Config:
    """uvicorn's settings: the read deadline, 1 s of graceful shutdown, warnings only."""
    return uvicorn.Config(app, http=read_timeout_protocol(timeout), log_level="warning",
                          timeout_graceful_shutdown=1, **kw)


def bind_sockets(hosts: list[str], port: int) -> list[socket.socket]:
    """One listening socket per address of ``--host`` (IPv6 ones only IPv6, so that
    ``::`` and ``0.0.0.0`` can share a port).

    Raises:
        CLIError: an address cannot be bound (in use, not this machine's, unknown name).
    """
    socks = []
    try:
        for host in hosts:
            family = socket.AF_INET6 if ":" in host else socket.AF_INET
            sock = socket.socket(family, socket.SOCK_STREAM)
            socks.append(sock)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if family == socket.AF_INET6:
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            sock.bind((host, port))
            sock.set_inheritable(True)
    except OSError as e:
        for sock in socks:
            sock.close()
        raise CLIError(f"--host {host} --port {port}: cannot listen there: "
                       f"{e.strerror or e}") from None
    return socks


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
    socks = bind_sockets(split_csv(args.host), args.port)
    start_engine(state, load)
    for sock in socks:
        host, port = sock.getsockname()[:2]
        log(f"llamaref serve: listening on http://{f'[{host}]' if ':' in host else host}:{port}")
    server = Server(server_config(app, args.timeout), state)
    try:
        server.run(sockets=socks)
    except KeyboardInterrupt:  # uvicorn raises the captured Ctrl-C again once it is done
        pass
    begin_shutdown(state)
    return 0


def add_serve_command(sub) -> None:
    """``llamaref serve`` and its flags (llama-server's names and defaults)."""
    p = sub.add_parser("serve", help="an OpenAI-compatible server (like llama-server)",
                       description="llama.cpp's server: slots on one KV cache, continuous "
                                   "batching, prompt caching, OpenAI and llama.cpp endpoints.")
    p.add_argument("-m", "--model", help="a GGUF file or a HF directory (default: SmolLM2)")
    p.add_argument("--backend", default="auto", choices=("auto", "accelerated", "reference"),
                   help="auto: accelerated (MLX) on a GPU, else reference (default: auto)")
    p.add_argument("-a", "--alias", help="the model's names in responses, comma-separated "
                                         "(the first is reported; default: file name)")
    p.add_argument("--tags", help="the model's tags, comma-separated (in /v1/models)")
    template = p.add_mutually_exclusive_group()
    template.add_argument("--chat-template", metavar="JINJA_TEMPLATE",
                          help="a Jinja chat template instead of the model's")
    template.add_argument("--chat-template-file", metavar="JINJA_TEMPLATE_FILE",
                          help="a file of a Jinja chat template instead of the model's")
    net = p.add_argument_group("HTTP")
    net.add_argument("--host", default="127.0.0.1",
                     help="addresses to listen on, comma-separated (default: 127.0.0.1)")
    net.add_argument("--port", type=int, default=8080, help="port (default: 8080)")
    net.add_argument("--api-key", help="require one of these keys, comma-separated "
                                       "(Authorization: Bearer KEY)")
    net.add_argument("-to", "--timeout", type=float, default=DEFAULT_TIMEOUT, metavar="N",
                     help="seconds a request's head and body may take to arrive "
                          f"(default: {DEFAULT_TIMEOUT})")
    net.add_argument("--max-prompt-bytes", type=int, default=0, metavar="BYTES",
                     help="most bytes of text in a prompt, checked before tokenizing "
                          f"(default: 0 = {PROMPT_BYTES_PER_TOKEN} per token of a slot)")
    net.add_argument("--cors-origins", metavar="ORIGINS",
                     help="web origins (scheme://host:port) whose pages may use this "
                          "server, comma-separated; '*' any, 'localhost' this machine's "
                          "(default: none but the server's own)")
    net.add_argument("--allowed-hosts", metavar="HOSTS",
                     help="names the Host header may give, comma-separated; '*' any "
                          "(default: the --host addresses and localhost; any with 0.0.0.0)")
    net.add_argument("--ui", "--webui", dest="ui", action="store_true", default=True,
                     help="the chat page at / (default: on)")
    net.add_argument("--no-ui", "--no-webui", dest="ui", action="store_false")
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
    d = p.add_argument_group("speculative decoding in the slots (llama-server's names)")
    d.add_argument("-md", "--model-draft", "--spec-draft-model", dest="model_draft",
                   metavar="FNAME",
                   help="draft model (GGUF or HF folder) with the target's vocabulary")
    d.add_argument("--draft-layers", type=int, default=None, metavar="K",
                   help="draft with the target's own first K layers (instead of -md)")
    d.add_argument("--draft-max", "--spec-draft-n-max", "--draft", "--draft-n",
                   dest="draft_max", type=int, default=3, metavar="N",
                   help="most tokens a slot drafts per step (default: 3)")
    d.add_argument("--draft-min", "--spec-draft-n-min", dest="draft_min", type=int,
                   default=0, metavar="N", help="drop drafts shorter than N (default: 0)")
    d.add_argument("--draft-p-min", "--spec-draft-p-min", dest="draft_p_min", type=float,
                   default=0.0, metavar="P",
                   help="stop drafting below this probability (default: 0.00)")
    d.add_argument("--spec-type", action="append", metavar="TYPES",
                   help="comma list of drafters: ngram-simple, ngram-cache, draft-simple "
                        "(default: draft-simple with a draft model, else none)")
    d.add_argument("--spec-ngram-simple-size-n", dest="spec_ngram_size_n", type=int,
                   default=12, metavar="N", help="ngram-simple: n-gram looked up (default: 12)")
    d.add_argument("--spec-ngram-simple-size-m", dest="spec_ngram_size_m", type=int,
                   default=48, metavar="N",
                   help="ngram-simple: most tokens drafted (default: 48)")
    d.add_argument("--spec-ngram-simple-min-hits", dest="spec_ngram_min_hits", type=int,
                   default=1, metavar="N",
                   help="accepted for llama-server's command lines; ngram-simple does not "
                        "read it (nor does llama.cpp's)")
    d.add_argument("-lcs", "--lookup-cache-static", metavar="FNAME",
                   help="ngram-cache: static n-gram cache (llama-lookup-create's file)")
    d.add_argument("-lcd", "--lookup-cache-dynamic", metavar="FNAME",
                   help="ngram-cache: dynamic n-gram cache (read, not updated)")
    s = add_sampling_flags(p, ["seed", "temp", "top_k", "top_p", "min_p", "repeat_last_n",
                               "repeat_penalty"])
    s.add_argument("--presence-penalty", type=float, default=0.0, metavar="N")
    s.add_argument("--frequency-penalty", type=float, default=0.0, metavar="N")
    p.set_defaults(func=cmd_serve)
