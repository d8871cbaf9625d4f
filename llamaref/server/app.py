r"""The HTTP surface of ``llamaref serve``: llama.cpp's endpoints and OpenAI's, on Starlette.

**Why Starlette (with uvicorn).** The server needs streaming responses (SSE), a request body
limit, our own error bodies for *every* failure (llama.cpp's ``{"error": {"code",
"message", "type"}}``), and nothing between the request and our field checks. Starlette is
the ASGI toolkit FastAPI is built on, without FastAPI's automatic pydantic validation, whose
422 bodies are not llama.cpp's and whose models would duplicate the field rules of
[`llamaref.server.schema`][llamaref.server.schema]. uvicorn runs it; both are small pure-Python
wheels. mlx-lm's server uses ``http.server`` threads, where a client that disconnects shows
up as a ``BrokenPipeError`` in the middle of a write; under ASGI a disconnect cancels the
response's task, and we cancel its tasks so the scheduler frees their slots.

**Threads.** The engine ([`llamaref.server.engine.Engine`][]) runs the scheduler's steps on
its own thread and owns the Context. A request handler parses the body, queues tasks, and
awaits their results on an ``asyncio.Queue`` fed from the engine's thread with
``loop.call_soon_threadsafe``. Slot actions, ``/slots`` and ``/metrics`` run on the engine's
thread between two steps ([`Engine.call`][llamaref.server.engine.Engine.call]). A failed
request's status and body come from [`llamaref.server.errors`][].

**Nothing CPU-bound on the event loop.** Parsing a body, tokenizing a prompt or rendering a
chat template can take seconds on a large request; all of it runs on a thread of its own
([`in_thread`][llamaref.server.app.in_thread]), so ``/health`` and every other client are
answered meanwhile. A prompt's text is measured in bytes before it is tokenized
([`check_prompt_bytes`][llamaref.server.app.check_prompt_bytes]).

**Clients that leave, and shutdown.** A request waiting for its results (queued, in prefill,
or generating; streamed or not) looks every ``RESULT_POLL_S`` at whether its client is still
there and whether the server is closing ([`next_result`][llamaref.server.app.next_result]):
a client that left cancels its tasks (one log line), a server that closes answers 503.

**Where a request comes from** ([`Guard`][llamaref.server.app.Guard]): the ``Host`` header
must name this server (DNS rebinding), a web page of another origin may change nothing
unless ``--cors-origins`` allows it, and a JSON endpoint refuses the form and plain-text
bodies a page can send without a CORS preflight.
"""

from __future__ import annotations

import asyncio
import hmac
import itertools
import os
import stat
import threading
import time
import traceback
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from starlette.applications import Starlette
from starlette.datastructures import Headers
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import ClientDisconnect, Request
from starlette.responses import HTMLResponse, JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from llamaref.common import log
from llamaref.server import formats, schema
from llamaref.server.engine import SHUTTING_DOWN, Engine, slots_json
from llamaref.server.errors import (
    BodyTooLarge,
    Forbidden,
    UnsupportedMediaType,
    error_json,
    http_status,
)
from reference.common import LlamarefError
from reference.tools.server.errors import (
    InvalidRequest,
    NotFound,
    NotSupported,
    ServerError,
    Unauthorized,
    Unavailable,
)
from reference.tools.server.params import SlotParams
from reference.tools.server.results import Failed, Final, Partial
from reference.tools.server.slot import Task
from reference.tools.server.spans import user_starts

STATIC = Path(__file__).parent / "static"
PUBLIC_PATHS = ("/", "/health", "/v1/health", "/index.html")
DEFAULT_BODY_LIMIT = 1 << 20  # 1 MiB
DEFAULT_TIMEOUT = 600  # s: llama-server's read timeout (-to/--timeout)
PROMPT_BYTES_PER_TOKEN = 32  # --max-prompt-bytes 0: this many bytes per token of a slot
#: the longest slot file name: 255 bytes less the temporary file's "." + 8 chars + ".tmp"
SLOT_NAME_MAX = 255 - 13
RESULT_POLL_S = 0.1  # how often a waiting request checks its client and the shutdown
LOCAL_HOSTS = ("localhost", "127.0.0.1", "::1")


# --8<-- [start:ServerState]
@dataclass
class ServerState:
    """What the handlers share.

    Attributes:
        engine: the scheduler's thread, once the model is loaded (None while loading: every
            endpoint answers 503 "Loading model").
        tokenizer: the model's tokenizer.
        model_name: the ``model`` reported in responses (``--alias`` or the file name).
        model_path: the file or directory loaded.
        defaults: the request defaults from the command line's sampling flags.
        api_key: ``--api-key``: one key, or a list of keys (None: no key needed).
        slot_save_path: ``--slot-save-path`` (None: slot actions answer 501).
        body_limit: the largest request body, in bytes.
        metrics_enabled: ``--metrics``.
        slots_enabled: ``GET /slots`` (``--no-slots`` turns it off).
        n_vocab: the vocabulary size.
        props: extra ``/props`` fields (chat template, BOS/EOS, build).
        load_error: why the model did not load (the server stays up and says so).
        user_delimiter: the chat template's user-message opening, as tokens (checkpoints go
            where it matches in a chat prompt; [`reference.tools.server.spans`][]).
        max_prompt_bytes: the most bytes of text in a request's prompt or messages, checked
            before tokenizing (0: ``PROMPT_BYTES_PER_TOKEN`` per token of a slot).
        allowed_hosts: the names and addresses the ``Host`` header may give (None: any).
        cors_origins: web origins allowed besides the server's own (``*``: any;
            ``localhost``: any page served from this machine).
        ui: the chat page at ``/`` (``--no-ui``: 404).
        aliases: every name of the model (``--alias a,b``; the first is ``model_name``).
        tags: ``--tags``, reported in ``/v1/models``.
        t_start: when the server started (``/metrics``' ``Process-Start-Time-Unix``).
        closing: set when the server begins to shut down.
    """

    engine: Engine | None = None
    tokenizer: Any = None
    model_name: str = "llamaref"
    model_path: str = ""
    defaults: SlotParams = field(default_factory=SlotParams)
    api_key: str | list[str] | None = None
    slot_save_path: Path | None = None
    body_limit: int = DEFAULT_BODY_LIMIT
    metrics_enabled: bool = True
    slots_enabled: bool = True
    n_vocab: int = 0
    props: dict = field(default_factory=dict)
    load_error: str | None = None
    user_delimiter: list[int] = field(default_factory=list)
    max_prompt_bytes: int = 0
    allowed_hosts: list[str] | None = None
    cors_origins: list[str] = field(default_factory=list)
    ui: bool = True
    aliases: list[str] = field(default_factory=list)
    tags: list[str] = field(default_factory=list)
    t_start: float = field(default_factory=time.time)
    closing: threading.Event = field(default_factory=threading.Event)
    task_ids: Any = field(default_factory=lambda: itertools.count(1))
    stop: threading.Event = field(default_factory=threading.Event)
    thread: threading.Thread | None = None
# --8<-- [end:ServerState]


def error_response(e: ServerError) -> JSONResponse:
    """llama.cpp's error body with its HTTP status."""
    return JSONResponse(error_json(e), status_code=http_status(e))


class ClientGone(LlamarefError):
    """The client closed its connection before its answer was ready."""


def _engine(state: ServerState) -> Engine:
    if state.closing.is_set():
        raise Unavailable(SHUTTING_DOWN)
    if state.engine is None:
        if state.load_error:
            raise ServerError("the model failed to load (the server's log says why)")
        raise Unavailable("Loading model")
    return state.engine


def api_keys(state: ServerState) -> list[str]:
    """The keys a request may give (``--api-key k1,k2``: any of them)."""
    if state.api_key is None:
        return []
    return [state.api_key] if isinstance(state.api_key, str) else list(state.api_key)


def key_matches(key: str | None, keys: list[str]) -> bool:
    """Whether ``key`` is one of ``keys``, compared in constant time (``hmac.compare_digest``
    on every key, so the time taken says nothing of how much of a key was right).

    Examples:
        >>> key_matches("sekret", ["other", "sekret"]), key_matches("sekre", ["sekret"])
        (True, False)
        >>> key_matches(None, ["sekret"])
        False
    """
    given = (key or "").encode("utf-8", "surrogatepass")
    found = False
    for k in keys:
        found |= hmac.compare_digest(given, k.encode("utf-8", "surrogatepass"))
    return found and key is not None


def _check_key(state: ServerState, request: Request) -> None:
    keys = api_keys(state)
    if not keys or request.url.path in PUBLIC_PATHS:
        return
    auth = request.headers.get("authorization", "")
    key = auth[7:] if auth.lower().startswith("bearer ") else request.headers.get("x-api-key")
    if not key_matches(key, keys):
        raise Unauthorized("Invalid API Key")


async def in_thread(fn: Callable, *args: Any) -> Any:
    """``fn(*args)`` on a new daemon thread, awaited: the event loop goes on answering
    meanwhile. Unlike ``asyncio.to_thread`` the thread is not joined when the loop closes, so
    a shutdown never waits for a tokenization or an engine job in progress."""
    loop = asyncio.get_running_loop()
    future = loop.create_future()

    def settle(ok: bool, value: Any) -> None:
        if future.done():
            return
        if ok:
            future.set_result(value)
        else:
            future.set_exception(value)

    def run() -> None:
        try:
            ok, value = True, fn(*args)
        except BaseException as e:  # handed back to the awaiting request
            ok, value = False, e
        try:
            loop.call_soon_threadsafe(settle, ok, value)
        except RuntimeError:  # the loop has closed: nobody waits any more
            pass
    threading.Thread(target=run, daemon=True, name="llamaref-request").start()
    return await future


async def _raw_body(state: ServerState, request: Request) -> bytes:
    """The request body, refused beyond the body limit before it is all read."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > state.body_limit:
        raise BodyTooLarge(f"the request body ({declared} bytes) is over the limit of "
                                  f"{state.body_limit} bytes (--body-limit)")
    chunks, n = [], 0
    async for chunk in request.stream():
        n += len(chunk)
        if n > state.body_limit:
            raise BodyTooLarge(f"the request body is over the limit of "
                                      f"{state.body_limit} bytes (--body-limit)")
        chunks.append(chunk)
    return b"".join(chunks)


async def _body(state: ServerState, request: Request) -> dict:
    """The JSON body (parsed on a thread)."""
    raw = await _raw_body(state, request)
    return await in_thread(schema.parse_json, raw, state.body_limit)


def text_bytes(value: Any) -> int:
    """The UTF-8 bytes of every string in a JSON value (keys included), without recursion.

    Examples:
        >>> text_bytes(["héllo", [1, 2, "x"], {"role": "user", "content": "hi"}])
        24
    """
    n, stack = 0, [value]
    while stack:
        v = stack.pop()
        if isinstance(v, str):
            n += len(v.encode("utf-8", "surrogatepass"))
        elif isinstance(v, list):
            stack.extend(v)
        elif isinstance(v, dict):
            stack.extend(v.keys())
            stack.extend(v.values())
    return n


def prompt_bytes_limit(state: ServerState, engine: Engine) -> int:
    """``--max-prompt-bytes``, or ``PROMPT_BYTES_PER_TOKEN`` per token of a slot."""
    if state.max_prompt_bytes > 0:
        return state.max_prompt_bytes
    return PROMPT_BYTES_PER_TOKEN * engine.scheduler.slots[0].n_ctx


def check_prompt_bytes(name: str, value: Any, limit: int) -> None:
    """Refuse a prompt (or messages, or content) of more than ``limit`` bytes of text,
    before any of it is tokenized.

    Raises:
        InvalidRequest: naming the field, its size and the limit.

    Examples:
        >>> check_prompt_bytes("prompt", "x" * 10, 10)
        >>> check_prompt_bytes("prompt", ["x" * 6, "y" * 5], 10)
        Traceback (most recent call last):
        ...
        reference.tools.server.errors.InvalidRequest: Field 'prompt': 11 bytes of text, over \
the limit of 10 bytes (--max-prompt-bytes)
    """
    n = text_bytes(value)
    if n > limit:
        raise InvalidRequest(f"Field '{name}': {n} bytes of text, over the limit of {limit} "
                             "bytes (--max-prompt-bytes)")


def endpoint(fn: Callable) -> Callable:
    """Wrap a handler: API key, the loading state, typed errors as llama.cpp's bodies, and a
    client that left as one log line."""
    async def handler(request: Request) -> Response:
        state: ServerState = request.app.state.server
        try:
            _check_key(state, request)
            return await fn(state, request)
        except ServerError as e:
            return error_response(e)
        except (ClientGone, ClientDisconnect):
            log(f"llamaref serve: {request.method} {request.url.path}: the client left; "
                "its request is cancelled")
            return Response(status_code=499)  # nobody reads it (nginx's "client closed")
    handler.__name__ = fn.__name__
    return handler


# ---- simple endpoints -------------------------------------------------------------------------

async def health(state: ServerState, request: Request) -> Response:
    """``GET /health``: ``{"status": "ok"}`` once the model is loaded (503 before)."""
    _engine(state)
    return JSONResponse({"status": "ok"})


async def models(state: ServerState, request: Request) -> Response:
    """``GET /v1/models``: the one model served (OpenAI's list format), with its
    ``--alias`` names and ``--tags``."""
    engine = _engine(state)
    n_ctx_train = engine.scheduler.ctx.hparams.n_ctx_train
    return JSONResponse({"object": "list", "data": [{
        "id": state.model_name, "object": "model", "created": int(engine.t_start),
        "owned_by": "llamaref", "aliases": state.aliases or [state.model_name],
        "tags": state.tags, "meta": {"n_vocab": state.n_vocab,
                                     "n_ctx_train": n_ctx_train}}]})


async def props(state: ServerState, request: Request) -> Response:
    """``GET /props``: the server's settings (server-context.cpp:4580-4626)."""
    slots = _engine(state).scheduler.slots
    d = state.defaults
    return JSONResponse({
        "default_generation_settings": {"n_ctx": slots[0].n_ctx,
                                        "params": formats.generation_settings(d)},
        "total_slots": len(slots), "model_alias": state.model_name,
        "model_path": state.model_path, "modalities": {"vision": False, "audio": False},
        **state.props})


async def tokenize(state: ServerState, request: Request) -> Response:
    """``POST /tokenize`` (the text measured first, tokenized on a thread)."""
    engine = _engine(state)
    body = await _body(state, request)
    check_prompt_bytes("content", body.get("content"), prompt_bytes_limit(state, engine))
    return JSONResponse(await in_thread(schema.parse_tokenize, body, state.tokenizer))


async def detokenize(state: ServerState, request: Request) -> Response:
    """``POST /detokenize``."""
    _engine(state)
    body = await _body(state, request)

    def run() -> dict:
        tokens = schema.parse_detokenize(body, state.n_vocab)
        return schema.detokenize_response(tokens, state.tokenizer)
    return JSONResponse(await in_thread(run))


async def index(state: ServerState, request: Request) -> Response:
    """``GET /``: the chat page (``--no-ui``: 404, as llama-server without its web UI)."""
    if not state.ui:
        raise NotFound("File Not Found")
    return HTMLResponse((STATIC / "index.html").read_text(encoding="utf-8"))


# ---- slots and metrics --------------------------------------------------------------------------

async def slots_get(state: ServerState, request: Request) -> Response:
    """``GET /slots`` (``?fail_on_no_slot=1``: 503 when no slot is idle)."""
    engine = _engine(state)
    if not state.slots_enabled:
        raise NotSupported("This server does not support slots endpoint.")
    info = await in_thread(engine.call, lambda: slots_json(
        engine.scheduler.slots, speculative=engine.scheduler.speculator is not None))
    if request.query_params.get("fail_on_no_slot") in ("1", "true") and all(
            s["is_processing"] for s in info):
        raise Unavailable("no slot available")
    return JSONResponse(info)


def slot_file_name(name: Any) -> str:
    """A slot file's name: ``fs_validate_filename``'s rules
    ([`validate_filename`][llamaref.server.schema.validate_filename]), and at most
    ``SLOT_NAME_MAX`` bytes, so that the temporary file written beside it
    ([`write_atomic`][reference.memory.blob.write_atomic]) still has a legal name.

    Raises:
        InvalidRequest: naming the rule that was broken.

    Examples:
        >>> slot_file_name("slot1.bin")
        'slot1.bin'
        >>> slot_file_name("x" * 243)
        Traceback (most recent call last):
        ...
        reference.tools.server.errors.InvalidRequest: Invalid filename: 243 bytes; a slot \
file's name is at most 242 bytes of UTF-8
    """
    name = schema.validate_filename(name)
    n = len(name.encode("utf-8"))
    if n > SLOT_NAME_MAX:
        raise InvalidRequest(f"Invalid filename: {n} bytes; a slot file's name is at most "
                             f"{SLOT_NAME_MAX} bytes of UTF-8")
    return name


def check_slot_file(path: Path, name: str) -> None:
    """A file to restore must be a regular file of the slot directory: a symbolic link
    (which could lead out of it), a directory or a device is refused, and nothing of the
    file is read here.

    Raises:
        NotFound: no such file.
        InvalidRequest: not a regular file.
    """
    try:
        mode = os.lstat(path).st_mode
    except FileNotFoundError:
        raise NotFound(f"Unable to restore slot: no file named {name!r}") from None
    except OSError:
        raise InvalidRequest(f"Unable to restore slot: {name!r} cannot be read") from None
    if not stat.S_ISREG(mode):
        kind = "a symbolic link" if stat.S_ISLNK(mode) else "not a regular file"
        raise InvalidRequest(f"Unable to restore slot: {name!r} is {kind}; only regular "
                             "files of --slot-save-path are restored")


async def _slot_file_job(engine: Engine, fn: Callable[[], dict], action: str,
                         name: str) -> dict:
    """Run a save or restore on the engine's thread; its failures become messages that
    name the file as the client gave it, never the server's directory nor an exception's
    text (those go to the log)."""
    try:
        return await in_thread(engine.call, fn)
    except ServerError as e:
        if e.__cause__ is None:
            raise  # the scheduler's own message (no such slot, busy, too long)
        log(f"llamaref serve: slot {action} {name!r}: {type(e.__cause__).__name__}: "
            f"{e.__cause__}")
        if isinstance(e, NotFound):
            raise NotFound(f"Unable to restore slot: no file named {name!r}") from None
        raise InvalidRequest(f"Unable to {action} slot: {name!r} is not a slot file this "
                             "server can load") from None
    except OSError as e:
        log(f"llamaref serve: slot {action} {name!r}: {type(e).__name__}: {e}")
        raise ServerError(f"Unable to {action} slot: the file {name!r} could not be "
                          "written") from None


async def slots_action(state: ServerState, request: Request) -> Response:
    """``POST /slots/{id}?action=save|restore|erase``."""
    engine = _engine(state)
    sched = engine.scheduler
    raw_id = request.path_params["id_slot"]
    try:
        id_slot = int(raw_id)
    except ValueError:
        raise InvalidRequest(f"Invalid slot ID: {raw_id!r}") from None
    action = request.query_params.get("action", "")
    if action not in ("save", "restore", "erase"):
        raise InvalidRequest(f"Invalid action: {action!r} (save, restore or erase)")
    if action == "erase":
        return JSONResponse(await in_thread(engine.call, lambda: sched.slot_erase(id_slot)))
    if state.slot_save_path is None:
        raise NotSupported("This server does not support slot save/restore: start it with "
                           "--slot-save-path")
    body = await _body(state, request)
    name = slot_file_name(body.get("filename"))
    path = state.slot_save_path / name
    if action == "save":
        out = await _slot_file_job(engine, lambda: sched.slot_save(id_slot, str(path)),
                                   action, name)
    else:
        check_slot_file(path, name)
        out = await _slot_file_job(engine, lambda: sched.slot_restore(id_slot, str(path)),
                                   action, name)
    return JSONResponse({**out, "filename": name})


async def metrics(state: ServerState, request: Request) -> Response:
    """``GET /metrics``: Prometheus text with llama.cpp's ``llamacpp:`` names, and its
    ``Process-Start-Time-Unix`` header (the server's start, in whole seconds)."""
    engine = _engine(state)
    if not state.metrics_enabled:
        raise NotSupported("This server does not support metrics endpoint: start it with "
                           "--metrics")

    def snapshot() -> str:
        text = prometheus(engine)
        engine.metrics.reset_bucket()
        return text
    text = await in_thread(engine.call, snapshot)
    return Response(text, media_type="text/plain; version=0.0.4",
                    headers={"Process-Start-Time-Unix": str(int(state.t_start))})


# --8<-- [start:prometheus]
def prometheus(engine: Engine) -> str:
    """The ``/metrics`` text: llama.cpp's ``llamacpp:`` counters and gauges
    (server-context.cpp, ``handle_metrics``)."""
    m, sched = engine.metrics, engine.scheduler
    busy = sum(s.is_processing for s in sched.slots)
    rows = [
        ("counter", "prompt_tokens_total", "Number of prompt tokens processed.",
         m.n_prompt_tokens_processed_total),
        ("counter", "prompt_tokens_cached_total", "Number of prompt tokens taken from the cache.",
         m.n_prompt_tokens_cached_total),
        ("counter", "prompt_seconds_total", "Prompt process time",
         m.t_prompt_processing_total / 1e3),
        ("counter", "tokens_predicted_total", "Number of generation tokens processed.",
         m.n_tokens_predicted_total),
        ("counter", "tokens_predicted_seconds_total", "Predict process time",
         m.t_tokens_generation_total / 1e3),
        ("counter", "n_decode_total", "Total number of llama_decode() calls",
         m.n_decode_total),
        ("gauge", "n_tokens_max", "Largest observed n_tokens.", m.n_tokens_max),
        ("gauge", "n_busy_slots_per_decode", "Average number of busy slots per llama_decode()",
         m.n_busy_slots_total / max(1, m.n_decode_total)),
        ("gauge", "prompt_tokens_seconds", "Average prompt throughput in tokens/s.",
         1e3 * m.n_prompt_tokens_processed / m.t_prompt_processing
         if m.t_prompt_processing else 0.0),
        ("gauge", "predicted_tokens_seconds", "Average generation throughput in tokens/s.",
         1e3 * m.n_tokens_predicted / m.t_tokens_generation if m.t_tokens_generation else 0.0),
        ("gauge", "requests_processing", "Number of requests processing.", busy),
        ("gauge", "requests_deferred", "Number of requests deferred.", len(sched.waiting)),
        ("counter", "kv_cache_misses_total", "Decodes retried because the KV cache was full.",
         m.n_cache_misses),
        ("counter", "spec_decode_num_drafts_total", "Number of drafts verified.",
         m.n_draft_verified_total),
        ("counter", "spec_decode_num_draft_tokens_total", "Number of tokens drafted.",
         m.n_draft_total),
        ("counter", "spec_decode_num_accepted_tokens_total",
         "Number of drafted tokens accepted.", m.n_draft_accepted_total),
    ]
    lines = []
    for kind, name, help_text, value in rows:
        lines += [f"# HELP llamacpp:{name} {help_text}", f"# TYPE llamacpp:{name} {kind}",
                  f"llamacpp:{name} {value}"]
    return "\n".join(lines) + "\n"
# --8<-- [end:prometheus]


# ---- completions ------------------------------------------------------------------------------

# --8<-- [start:submit]
def submit(state: ServerState, prompts: list[list[int]], params: SlotParams,
           loop: asyncio.AbstractEventLoop, results: asyncio.Queue,
           chat: bool = False) -> list[Task]:
    """One task per prompt and completion (``n_cmpl``: children sharing the parent's
    prompt through ``seq_cp``); their results go to ``results``. A chat prompt's user
    messages are located, for the checkpoints.

    Raises:
        ExceedContextSize: a prompt does not fit a slot (checked before anything is queued).
        Unavailable: the queue is full.
    """
    engine = _engine(state)
    n_ctx = engine.scheduler.slots[0].n_ctx
    for tokens in prompts:
        if len(tokens) >= n_ctx:
            raise schema.ExceedContextSize(len(tokens), n_ctx)

    def emit(result):
        loop.call_soon_threadsafe(results.put_nowait, result)
    tasks: list[Task] = []
    for i, tokens in enumerate(prompts):
        parent = Task(next(state.task_ids), list(tokens), params, emit, index=i * params.n_cmpl,
                      user_starts=user_starts(tokens, state.user_delimiter) if chat else [])
        for j in range(1, params.n_cmpl):
            child = Task(next(state.task_ids), list(tokens), params, emit,
                         index=i * params.n_cmpl + j, id_parent=parent.id)
            parent.children.append(child)
        tasks.append(parent)
    submitted = []
    try:
        for t in tasks:
            engine.submit(t)
            submitted.append(t)
    except Unavailable:
        engine.cancel(submitted)
        raise
    return [t2 for t in tasks for t2 in (t, *t.children)]
# --8<-- [end:submit]


async def next_result(request: Request | None, engine: Engine, tasks: list[Task],
                      results: asyncio.Queue) -> Any:
    """The next result of ``tasks``. While none comes, every ``RESULT_POLL_S``: a server
    that is shutting down cancels them (503), and a client that has left (``request``
    given) cancels them too, whether they are queued, in prefill or generating.

    Raises:
        Unavailable: the server is shutting down.
        ClientGone: the client closed its connection.
    """
    while True:
        try:
            return await asyncio.wait_for(results.get(), timeout=RESULT_POLL_S)
        except asyncio.TimeoutError:
            pass
        if engine.closing.is_set():
            engine.cancel(tasks)
            raise Unavailable(SHUTTING_DOWN)
        if request is not None and await request.is_disconnected():
            engine.cancel(tasks)
            raise ClientGone()


async def _collect(request: Request, engine: Engine, tasks: list[Task],
                   results: asyncio.Queue) -> list:
    """Every task's final result, in choice order; a client that leaves cancels them.

    Raises:
        ServerError: a task failed (its error).
    """
    finals: dict[int, Final] = {}
    while len(finals) < len(tasks):
        r = await next_result(request, engine, tasks, results)
        if isinstance(r, Failed):
            engine.cancel(tasks)
            raise r.error
        if isinstance(r, Final):
            finals[r.index] = r
    return [finals[k] for k in sorted(finals)]


@dataclass
class Kind:
    """One completion endpoint's response format."""

    name: str  # "native", "oai_cmpl", "oai_chat"
    done_marker: bool  # "data: [DONE]" at the end of a stream


NATIVE, OAI_CMPL, OAI_CHAT = Kind("native", False), Kind("oai_cmpl", True), Kind("oai_chat", True)


def parse_request(state: ServerState, engine: Engine, body: dict,
                  kind: Kind) -> tuple[SlotParams, list[list[int]]]:
    """A completion request's parameters and prompts (run on a thread: it tokenizes). The
    prompt's text is measured before it is tokenized."""
    n_parallel = len(engine.scheduler.slots)
    limit = prompt_bytes_limit(state, engine)
    if kind is OAI_CHAT:
        check_prompt_bytes("messages", body.get("messages"), limit)
    else:
        check_prompt_bytes("prompt", body.get("prompt"), limit)
    params = schema.parse_completion(body, state.defaults, n_parallel=n_parallel,
                                     n_vocab=state.n_vocab, tokenizer=state.tokenizer,
                                     oai_chat=kind is OAI_CHAT)
    if kind is OAI_CHAT:
        return params, [schema.parse_chat(body, state.tokenizer)]
    if "prompt" not in body:
        raise InvalidRequest("Field 'prompt': is required")
    return params, schema.parse_prompt(body["prompt"], state.tokenizer, state.n_vocab)


async def _complete(state: ServerState, request: Request, kind: Kind) -> Response:
    engine = _engine(state)
    body = await _body(state, request)
    params, prompts = await in_thread(parse_request, state, engine, body, kind)
    loop = asyncio.get_running_loop()
    results: asyncio.Queue = asyncio.Queue()
    tasks = submit(state, prompts, params, loop, results, chat=kind is OAI_CHAT)
    meta = Meta(kind, state.model_name, int(time.time()),
                formats.gen_cmpl_id(chat=kind is OAI_CHAT), params,
                {t.index: t.tokens for t in tasks}, state.tokenizer)
    if not params.stream:
        finals = await _collect(request, engine, tasks, results)
        return JSONResponse(meta.response(finals))
    # llama.cpp answers a stream's first failure as a plain error (its status, not 200),
    # so the first result is awaited here, watching the client while the task is queued
    first = await next_result(request, engine, tasks, results)
    if isinstance(first, Failed):
        engine.cancel(tasks)
        return error_response(first.error)
    return StreamingResponse(_stream(meta, engine, tasks, first, results),
                             media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache"})


# --8<-- [start:Meta]
@dataclass
class Meta:
    """One response's envelope and the choice of format (native, OpenAI completion, chat)."""

    kind: Kind
    model: str
    created: int
    id: str
    params: SlotParams
    prompts: dict
    tokenizer: Any

    @property
    def post(self) -> bool:
        return self.params.post_sampling_probs

    def head(self) -> dict:
        return dict(model=self.model, cmpl_id=self.id, created=self.created)

    def final(self, r: Final, stream: bool) -> list[dict]:
        """A final result's objects (one answer, or a stream's last events)."""
        k = self.kind
        if k is NATIVE:
            prompt = self.tokenizer.detokenize(self.prompts.get(r.index, []))
            return [formats.completion_final(r, self.params, model=self.model, prompt=prompt)]
        if k is OAI_CMPL:
            return [formats.oai_completion_final(r, stream=stream, post_sampling=self.post,
                                                 **self.head())]
        if not stream:
            return [formats.oai_chat_final(r, post_sampling=self.post, **self.head())]
        return formats.oai_chat_final_chunks(r, include_usage=False, send_role=False,
                                             **self.head())

    def partial(self, r: Partial) -> list[dict]:
        if self.kind is NATIVE:
            return [formats.completion_partial(r, self.post)]
        if self.kind is OAI_CMPL:
            return [formats.oai_completion_partial(r, post_sampling=self.post, **self.head())]
        return formats.oai_chat_partial(r, post_sampling=self.post, send_role=False,
                                        **self.head())

    def usage(self, finals: list[Final]) -> dict:
        """OpenAI's ``usage`` of all choices: every prompt counted once, every completion."""
        n = self.params.n_cmpl
        firsts = [f for f in finals if f.index % n == 0]
        prompt = sum(f.n_prompt for f in firsts)
        completion = sum(f.n_decoded for f in finals)
        return {"completion_tokens": completion, "prompt_tokens": prompt,
                "total_tokens": prompt + completion,
                "prompt_tokens_details": {"cached_tokens": sum(f.n_cached for f in firsts)}}

    def response(self, finals: list[Final]) -> Any:
        """The non-streamed answer: one object, several choices merged (OpenAI), or an array
        of native results."""
        objs = [o for f in finals for o in self.final(f, stream=False)]
        if self.kind is NATIVE:
            return objs[0] if len(objs) == 1 else objs
        merged = formats.merge_results(objs, oai=True)
        merged["usage"] = self.usage(finals)
        return merged

    def start(self, tasks: list[Task]) -> list[dict]:
        """A chat stream opens with a role delta per choice."""
        if self.kind is not OAI_CHAT:
            return []
        return [{"choices": [{"finish_reason": None, "index": t.index,
                              "delta": {"role": "assistant", "content": None}}],
                 "created": self.created, "id": self.id, "model": self.model,
                 "system_fingerprint": formats.SYSTEM_FINGERPRINT,
                 "object": "chat.completion.chunk"} for t in sorted(tasks, key=lambda t: t.index)]

    def end(self, finals: list[Final]) -> list[dict]:
        """With ``stream_options.include_usage``: a last chunk with the usage and, as
        llama-server sends them, the timings of the last choice to finish."""
        if self.kind is NATIVE or not self.params.include_usage:
            return []
        obj = "chat.completion.chunk" if self.kind is OAI_CHAT else "text_completion"
        return [formats.usage_chunk(obj, **self.head(), usage=self.usage(finals),
                                    timings=finals[-1].timings)]
# --8<-- [end:Meta]


async def _stream(meta: Meta, engine: Engine, tasks: list[Task], first,
                  results: asyncio.Queue) -> AsyncIterator[bytes]:
    """The SSE events of a streamed completion. A client that disconnects cancels this
    generator (Starlette stops the response); its tasks are then cancelled."""
    finals: list[Final] = []
    try:
        for chunk in meta.start(tasks):
            yield formats.sse(chunk)
        r = first
        while True:
            if isinstance(r, Failed):
                yield formats.sse(error_json(r.error))
                engine.cancel(tasks)
                return
            if isinstance(r, Final):
                finals.append(r)
                for chunk in meta.final(r, stream=True):
                    yield formats.sse(chunk)
                if len(finals) == len(tasks):
                    break
            else:
                for chunk in meta.partial(r):
                    yield formats.sse(chunk)
            try:  # a client that leaves is Starlette's to notice: it cancels this generator
                r = await next_result(None, engine, tasks, results)
            except Unavailable as e:
                yield formats.sse(error_json(e))
                return
        for chunk in meta.end(finals):
            yield formats.sse(chunk)
        if meta.kind.done_marker:
            yield formats.SSE_DONE
    finally:
        if len(finals) < len(tasks):
            engine.cancel(tasks)


async def completion(state: ServerState, request: Request) -> Response:
    """``POST /completion``, ``/completions``: llama.cpp's native format."""
    return await _complete(state, request, NATIVE)


async def v1_completions(state: ServerState, request: Request) -> Response:
    """``POST /v1/completions``: OpenAI's text completions."""
    return await _complete(state, request, OAI_CMPL)


async def v1_chat(state: ServerState, request: Request) -> Response:
    """``POST /v1/chat/completions``: OpenAI's chat completions."""
    return await _complete(state, request, OAI_CHAT)


# ---- the application ----------------------------------------------------------------------

ROUTES = [
    ("/", index, ["GET"]),
    ("/index.html", index, ["GET"]),
    ("/health", health, ["GET"]),
    ("/v1/health", health, ["GET"]),
    ("/models", models, ["GET"]),
    ("/v1/models", models, ["GET"]),
    ("/props", props, ["GET"]),
    ("/completion", completion, ["POST"]),
    ("/completions", completion, ["POST"]),
    ("/v1/completions", v1_completions, ["POST"]),
    ("/chat/completions", v1_chat, ["POST"]),
    ("/v1/chat/completions", v1_chat, ["POST"]),
    ("/tokenize", tokenize, ["POST"]),
    ("/detokenize", detokenize, ["POST"]),
    ("/slots", slots_get, ["GET"]),
    ("/slots/{id_slot}", slots_action, ["POST"]),
    ("/metrics", metrics, ["GET"]),
]


async def _http_error(request: Request, exc: HTTPException) -> Response:
    if exc.status_code == 404:
        return error_response(NotFound("File Not Found"))
    if exc.status_code == 405:
        e = InvalidRequest(f"Method {request.method} is not allowed on {request.url.path}")
        return JSONResponse({"error": {"code": 405, "message": str(e),
                                       "type": "invalid_request_error"}}, status_code=405)
    return JSONResponse({"error": {"code": exc.status_code, "message": str(exc.detail),
                                   "type": "invalid_request_error"}},
                        status_code=exc.status_code)


async def _server_error(request: Request, exc: Exception) -> Response:
    """A bug: the traceback goes to the log, the client gets a fixed message (an exception's
    text may carry a path or a file's bytes)."""
    log(f"llamaref serve: {request.method} {request.url.path}: "
        + "".join(traceback.format_exception(exc)).rstrip())
    return error_response(ServerError("Internal server error (the server's log has the "
                                      "details)"))


# ---- where a request comes from ---------------------------------------------------------------

#: the bodies a web page may send to another origin without a CORS preflight
SIMPLE_TYPES = ("text/plain", "application/x-www-form-urlencoded", "multipart/form-data")
STATE_CHANGING = ("POST", "PUT", "PATCH", "DELETE")
CORS_METHODS = "GET, POST, OPTIONS"
CORS_HEADERS = "Authorization, Content-Type, X-Api-Key"


def host_name(host: str) -> str:
    """The name or address of a ``Host`` header, without its port, in lower case.

    Examples:
        >>> host_name("LocalHost:8080"), host_name("[::1]:8080"), host_name("127.0.0.1")
        ('localhost', '::1', '127.0.0.1')
    """
    host = host.strip().lower()
    if host.startswith("["):
        return host[1:host.find("]")] if "]" in host else host
    return host.rsplit(":", 1)[0] if host.count(":") == 1 else host


def default_allowed_hosts(hosts: list[str]) -> list[str] | None:
    """The ``Host`` names a server bound to ``hosts`` answers to: the bound addresses and
    this machine's names; None (any) when bound to every interface (``0.0.0.0``, ``::``),
    where the addresses a client may use are not known.

    Examples:
        >>> default_allowed_hosts(["127.0.0.1"])
        ['127.0.0.1', 'localhost', '::1']
        >>> default_allowed_hosts(["0.0.0.0"]) is None
        True
    """
    if any(h in ("0.0.0.0", "::", "") for h in hosts):
        return None
    out = [host_name(h) for h in hosts]
    return out + [h for h in LOCAL_HOSTS if h not in out]


def origin_allowed(origin: str, host: str, cors_origins: list[str]) -> bool:
    """Whether a web page of ``origin`` may use this server: its own origin (the page at
    ``/``), one listed in ``--cors-origins``, any with ``*``, or any page of this machine
    with ``localhost``.

    Examples:
        >>> origin_allowed("http://127.0.0.1:8080", "127.0.0.1:8080", [])
        True
        >>> origin_allowed("https://evil.example", "127.0.0.1:8080", [])
        False
        >>> origin_allowed("https://app.example", "127.0.0.1:8080", ["https://app.example"])
        True
        >>> origin_allowed("http://localhost:3000", "127.0.0.1:8080", ["localhost"])
        True
    """
    origin = origin.strip().lower().rstrip("/")
    if "*" in cors_origins or origin in (o.lower().rstrip("/") for o in cors_origins):
        return True
    parts = urlsplit(origin)
    if parts.netloc and parts.netloc == host.strip().lower():
        return True
    return "localhost" in cors_origins and (parts.hostname or "") in LOCAL_HOSTS


def check_origin(state: ServerState, method: str, headers: Headers) -> bool:
    """The rules of where a request may come from; returns whether the request's
    ``Origin`` is allowed (its response then carries CORS headers).

    1. ``Host`` must be one of ``allowed_hosts``: a page of another site that renames
       itself to this address (DNS rebinding) is refused.
    2. A state-changing request (``POST``...) whose ``Origin`` is another site's is refused
       unless ``--cors-origins`` allows it.
    3. A ``POST`` whose body is a form or plain text (what a page may send anywhere without
       asking) and that a browser marks as coming from another site (``Sec-Fetch-Site:
       cross-site`` or ``same-site``, sent by browsers even where an older one leaves out
       ``Origin``) is refused unless its ``Origin`` is allowed: the endpoints take JSON.
       A client that is not a browser (``curl -d``, which sends a form type) sends neither
       header and is served, as llama-server serves it.

    Raises:
        Forbidden: rule 1 or 2. UnsupportedMediaType: rule 3.
    """
    host = headers.get("host", "")
    if state.allowed_hosts is not None and host and host_name(host) not in state.allowed_hosts:
        raise Forbidden(f"Host {host_name(host)!r} is not a name of this server "
                        "(--allowed-hosts)")
    origin = headers.get("origin")
    allowed = origin is not None and origin_allowed(origin, host, state.cors_origins)
    if method not in STATE_CHANGING:
        return allowed
    if origin is not None and not allowed:
        raise Forbidden(f"Origin {origin!r} may not use this server (--cors-origins)")
    media = headers.get("content-type", "").split(";")[0].strip().lower()
    from_other_site = headers.get("sec-fetch-site", "").lower() in ("cross-site", "same-site")
    if media in SIMPLE_TYPES and not allowed and (origin is not None or from_other_site):
        raise UnsupportedMediaType(f"Content-Type {media!r}: this endpoint takes JSON; send "
                                   "Content-Type: application/json")
    return allowed


def cors_headers(origin: str, preflight: Headers | None = None) -> dict[str, str]:
    """The CORS headers of a response to an allowed ``origin`` (a preflight's too)."""
    out = {"Access-Control-Allow-Origin": origin, "Vary": "Origin"}
    if preflight is not None:
        out.update({"Access-Control-Allow-Methods": CORS_METHODS,
                    "Access-Control-Allow-Headers": preflight.get(
                        "access-control-request-headers", CORS_HEADERS),
                    "Access-Control-Max-Age": "600"})
    return out


class Guard:
    """ASGI middleware that applies [`check_origin`][llamaref.server.app.check_origin]
    to every request, answers CORS preflights (``OPTIONS``, 204; with the CORS headers
    when the origin is allowed, so that the browser goes on), and adds the CORS headers to
    the responses of allowed origins."""

    def __init__(self, app: Any, state: ServerState):
        self.app, self.state = app, state

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = Headers(scope=scope)
        method = scope["method"]
        try:
            allowed = check_origin(self.state, method if method != "OPTIONS" else "GET",
                                   headers)
        except ServerError as e:
            return await error_response(e)(scope, receive, send)
        origin = headers.get("origin", "")
        if method == "OPTIONS":
            extra = cors_headers(origin, headers) if allowed else {}
            return await Response(status_code=204, headers=extra)(scope, receive, send)
        if not allowed:
            return await self.app(scope, receive, send)

        async def send_with_cors(message: dict) -> None:
            if message["type"] == "http.response.start":
                message["headers"] = list(message.get("headers", [])) + [
                    (k.lower().encode(), v.encode("latin-1"))
                    for k, v in cors_headers(origin).items()]
            await send(message)
        await self.app(scope, receive, send_with_cors)


def build_app(state: ServerState) -> Starlette:
    """The Starlette application over ``state`` (the engine thread is started by
    [`start_engine`][])."""
    app = Starlette(routes=[Route(path, endpoint(fn), methods=methods)
                            for path, fn, methods in ROUTES],
                    middleware=[Middleware(Guard, state=state)],
                    exception_handlers={HTTPException: _http_error, Exception: _server_error})
    app.state.server = state
    return app


def begin_shutdown(state: ServerState) -> None:
    """The server begins to shut down: new requests and every waiting one answer 503 at
    once ([`Engine.close`][llamaref.server.engine.Engine.close]), and the engine stops after
    the step it is in."""
    state.closing.set()
    if state.engine is not None:
        state.engine.close()
    state.stop.set()


# --8<-- [start:start_engine]
def start_engine(state: ServerState, factory: Callable[[], Engine]) -> threading.Thread:
    """Build the engine with ``factory`` on a new thread and run its loop there
    ([`Engine.run`][llamaref.server.engine.Engine.run]).

    MLX keeps its streams per thread, and an array made lazily on one thread cannot be
    evaluated on another: the Context is made on the thread that will use it. Until
    ``factory`` returns, every endpoint answers 503 "Loading model"; if it raises, the
    server stays up and every endpoint says why (500).
    """
    def main():
        try:
            engine = factory()
        except Exception as e:
            state.load_error = f"{type(e).__name__}: {e}"
            return
        state.engine = engine
        engine.run(state.stop)
    state.thread = threading.Thread(target=main, daemon=True, name="llamaref-engine")
    state.thread.start()
    return state.thread
# --8<-- [end:start_engine]
