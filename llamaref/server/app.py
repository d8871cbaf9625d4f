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
"""

from __future__ import annotations

import asyncio
import itertools
import os
import threading
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import HTMLResponse, JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from llamaref.server import formats, schema
from llamaref.server.engine import Engine, slots_json
from llamaref.server.errors import BodyTooLarge, error_json, http_status
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
        api_key: ``--api-key`` (None: no key needed).
        slot_save_path: ``--slot-save-path`` (None: slot actions answer 501).
        body_limit: the largest request body, in bytes.
        metrics_enabled: ``--metrics``.
        slots_enabled: ``GET /slots`` (``--no-slots`` turns it off).
        n_vocab: the vocabulary size.
        props: extra ``/props`` fields (chat template, BOS/EOS, build).
        load_error: why the model did not load (the server stays up and says so).
        user_delimiter: the chat template's user-message opening, as tokens (checkpoints go
            where it matches in a chat prompt; [`reference.tools.server.spans`][]).
    """

    engine: Engine | None = None
    tokenizer: Any = None
    model_name: str = "llamaref"
    model_path: str = ""
    defaults: SlotParams = field(default_factory=SlotParams)
    api_key: str | None = None
    slot_save_path: Path | None = None
    body_limit: int = DEFAULT_BODY_LIMIT
    metrics_enabled: bool = True
    slots_enabled: bool = True
    n_vocab: int = 0
    props: dict = field(default_factory=dict)
    load_error: str | None = None
    user_delimiter: list[int] = field(default_factory=list)
    task_ids: Any = field(default_factory=lambda: itertools.count(1))
    stop: threading.Event = field(default_factory=threading.Event)
    thread: threading.Thread | None = None
# --8<-- [end:ServerState]


def error_response(e: ServerError) -> JSONResponse:
    """llama.cpp's error body with its HTTP status."""
    return JSONResponse(error_json(e), status_code=http_status(e))


def _engine(state: ServerState) -> Engine:
    if state.engine is None:
        if state.load_error:
            raise ServerError(f"the model failed to load: {state.load_error}")
        raise Unavailable("Loading model")
    return state.engine


def _check_key(state: ServerState, request: Request) -> None:
    if state.api_key is None or request.url.path in PUBLIC_PATHS:
        return
    auth = request.headers.get("authorization", "")
    key = auth[7:] if auth.lower().startswith("bearer ") else request.headers.get("x-api-key")
    if key != state.api_key:
        raise Unauthorized("Invalid API Key")


async def _body(state: ServerState, request: Request) -> dict:
    """The JSON body, refused beyond the body limit before it is all read."""
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
    return schema.parse_json(b"".join(chunks), state.body_limit)


def endpoint(fn: Callable) -> Callable:
    """Wrap a handler: API key, the loading state, and typed errors as llama.cpp's bodies."""
    async def handler(request: Request) -> Response:
        state: ServerState = request.app.state.server
        try:
            _check_key(state, request)
            return await fn(state, request)
        except ServerError as e:
            return error_response(e)
    handler.__name__ = fn.__name__
    return handler


# ---- simple endpoints -------------------------------------------------------------------------

async def health(state: ServerState, request: Request) -> Response:
    """``GET /health``: ``{"status": "ok"}`` once the model is loaded (503 before)."""
    _engine(state)
    return JSONResponse({"status": "ok"})


async def models(state: ServerState, request: Request) -> Response:
    """``GET /v1/models``: the one model served (OpenAI's list format)."""
    engine = _engine(state)
    n_ctx_train = engine.scheduler.ctx.hparams.n_ctx_train
    return JSONResponse({"object": "list", "data": [{
        "id": state.model_name, "object": "model", "created": int(engine.t_start),
        "owned_by": "llamaref", "meta": {"n_vocab": state.n_vocab,
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
    """``POST /tokenize``."""
    _engine(state)
    body = await _body(state, request)
    return JSONResponse(schema.parse_tokenize(body, state.tokenizer))


async def detokenize(state: ServerState, request: Request) -> Response:
    """``POST /detokenize``."""
    _engine(state)
    body = await _body(state, request)
    tokens = schema.parse_detokenize(body, state.n_vocab)
    return JSONResponse(schema.detokenize_response(tokens, state.tokenizer))


async def index(state: ServerState, request: Request) -> Response:
    """``GET /``: the chat page."""
    return HTMLResponse((STATIC / "index.html").read_text(encoding="utf-8"))


# ---- slots and metrics --------------------------------------------------------------------------

async def slots_get(state: ServerState, request: Request) -> Response:
    """``GET /slots`` (``?fail_on_no_slot=1``: 503 when no slot is idle)."""
    engine = _engine(state)
    if not state.slots_enabled:
        raise NotSupported("This server does not support slots endpoint.")
    info = await asyncio.to_thread(engine.call, lambda: slots_json(engine.scheduler.slots))
    if request.query_params.get("fail_on_no_slot") in ("1", "true") and all(
            s["is_processing"] for s in info):
        raise Unavailable("no slot available")
    return JSONResponse(info)


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
        return JSONResponse(await asyncio.to_thread(engine.call,
                                                    lambda: sched.slot_erase(id_slot)))
    if state.slot_save_path is None:
        raise NotSupported("This server does not support slot save/restore: start it with "
                           "--slot-save-path")
    body = await _body(state, request)
    name = schema.validate_filename(body.get("filename"))
    path = str(state.slot_save_path / name)
    if action == "save":
        out = await asyncio.to_thread(engine.call, lambda: sched.slot_save(id_slot, path))
    else:
        if not os.path.isfile(path):
            raise NotFound(f"Unable to restore slot: no file named {name!r}")
        out = await asyncio.to_thread(engine.call, lambda: sched.slot_restore(id_slot, path))
    return JSONResponse({**out, "filename": name})


async def metrics(state: ServerState, request: Request) -> Response:
    """``GET /metrics``: Prometheus text with llama.cpp's ``llamacpp:`` names."""
    engine = _engine(state)
    if not state.metrics_enabled:
        raise NotSupported("This server does not support metrics endpoint: start it with "
                           "--metrics")

    def snapshot() -> str:
        text = prometheus(engine)
        engine.metrics.reset_bucket()
        return text
    text = await asyncio.to_thread(engine.call, snapshot)
    return Response(text, media_type="text/plain; version=0.0.4")


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


async def _collect(request: Request, engine: Engine, tasks: list[Task],
                   results: asyncio.Queue) -> list:
    """Every task's final result, in choice order; a client that leaves cancels them.

    Raises:
        ServerError: a task failed (its error).
    """
    finals: dict[int, Final] = {}
    while len(finals) < len(tasks):
        try:
            r = await asyncio.wait_for(results.get(), timeout=0.5)
        except asyncio.TimeoutError:
            if await request.is_disconnected():
                engine.cancel(tasks)
                raise asyncio.CancelledError() from None
            continue
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


async def _complete(state: ServerState, request: Request, kind: Kind) -> Response:
    engine = _engine(state)
    body = await _body(state, request)
    n_parallel = len(engine.scheduler.slots)
    params = schema.parse_completion(body, state.defaults, n_parallel=n_parallel,
                                     n_vocab=state.n_vocab, tokenizer=state.tokenizer,
                                     oai_chat=kind is OAI_CHAT)
    if kind is OAI_CHAT:
        prompts = [schema.parse_chat(body, state.tokenizer)]
    else:
        if "prompt" not in body:
            raise InvalidRequest("Field 'prompt': is required")
        prompts = schema.parse_prompt(body["prompt"], state.tokenizer, state.n_vocab)
    loop = asyncio.get_running_loop()
    results: asyncio.Queue = asyncio.Queue()
    tasks = submit(state, prompts, params, loop, results, chat=kind is OAI_CHAT)
    meta = Meta(kind, state.model_name, int(time.time()),
                formats.gen_cmpl_id(chat=kind is OAI_CHAT), params,
                {t.index: t.tokens for t in tasks}, state.tokenizer)
    if not params.stream:
        finals = await _collect(request, engine, tasks, results)
        return JSONResponse(meta.response(finals))
    first = await results.get()
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
        """With ``stream_options.include_usage``: a last chunk with the usage."""
        if self.kind is NATIVE or not self.params.include_usage:
            return []
        obj = "chat.completion.chunk" if self.kind is OAI_CHAT else "text_completion"
        return [{"choices": [], "created": self.created, "id": self.id, "model": self.model,
                 "system_fingerprint": formats.SYSTEM_FINGERPRINT, "object": obj,
                 "usage": self.usage(finals)}]
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
            r = await results.get()
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
    return error_response(ServerError(f"{type(exc).__name__}: {exc}"))


def build_app(state: ServerState) -> Starlette:
    """The Starlette application over ``state`` (the engine thread is started by
    [`start_engine`][])."""
    app = Starlette(routes=[Route(path, endpoint(fn), methods=methods)
                            for path, fn, methods in ROUTES],
                    exception_handlers={HTTPException: _http_error, Exception: _server_error})
    app.state.server = state
    return app


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
