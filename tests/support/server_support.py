"""What the server tests share: a tiny random model with SmolLM2's tokenizer, schedulers on
both twins (and engines, their runtime), greedy references, and a live server on a free
localhost port."""

from __future__ import annotations

import dataclasses
import functools
import signal
import threading
import time

import numpy as np

from accelerated.sampling import SamplerChain as MLXSamplerChain
from llamaref.backends import make_context as backend_context
from llamaref.backends import prepare_weights
from llamaref.server.app import DEFAULT_TIMEOUT, ServerState, build_app, start_engine
from llamaref.server.engine import Engine
from llamaref.server.main import Server, server_config
from reference.batch import Batch
from reference.context import Context
from reference.hparams import swa_pattern
from reference.model_loader import default_model_path
from reference.sampling import SamplerChain, SamplerParams
from reference.testing import (
    random_gemma_weights,
    random_mamba_weights,
    random_weights,
    tiny_gemma_hparams,
    tiny_hparams,
    tiny_mamba_hparams,
)
from reference.tokenizer import Tokenizer
from reference.tools.generate import Generator
from reference.tools.server.params import SlotParams
from reference.tools.server.results import Final
from reference.tools.server.scheduler import Scheduler, SchedulerConfig, StepReport
from reference.tools.server.spans import user_delimiter
from reference.tools.speculative import draft_layers

N_VOCAB = 49152  # SmolLM2's vocabulary: the tiny models speak its tokens


@functools.lru_cache(maxsize=1)
def tokenizer() -> Tokenizer:
    return Tokenizer.from_gguf(default_model_path())


@functools.cache
def model(kind: str = "llama"):
    """``(hparams, weights)`` of a tiny random model over SmolLM2's vocabulary."""
    if kind == "llama":
        hp = dataclasses.replace(tiny_hparams(n_vocab=N_VOCAB, n_embd=32, n_ff=48),
                                 n_ctx_train=4096)
        return hp, random_weights(hp, seed=3)
    if kind == "gemma":
        hp = tiny_gemma_hparams("gemma2", n_vocab=N_VOCAB, n_embd=32, n_ff=48, n_swa=8,
                                swa_layers=swa_pattern(2, 2), n_ctx_train=4096)
        return hp, random_gemma_weights(hp, seed=3)
    if kind in ("mamba", "mamba2"):
        hp = dataclasses.replace(tiny_mamba_hparams(kind), n_vocab=N_VOCAB)
        return hp, random_mamba_weights(hp, seed=3)
    if kind == "qwen3moe":  # Qwen3's Q/K norms and 4 experts, 2 per token
        hp = dataclasses.replace(tiny_hparams("qwen3moe", n_vocab=N_VOCAB, n_embd=32, n_ff=48,
                                              n_expert=4, n_expert_used=2, n_ff_exp=24),
                                 n_ctx_train=4096)
        return hp, random_weights(hp, seed=3)
    raise ValueError(kind)


@functools.cache
def prepared(backend: str, kind: str):
    hp, w = model(kind)
    return hp, prepare_weights(w, "accelerated") if backend == "mlx" else w


#: the Contexts every law runs on: the reference in float32 and float64, and the MLX twin
BACKENDS = ("reference", "reference64", "mlx")


def make_context(backend: str, kind: str = "llama", **kw):
    """A Context of ``backend`` (one of ``BACKENDS``) on the tiny model ``kind``."""
    hp, w = prepared(backend, kind)
    if backend == "mlx":
        return backend_context("accelerated", hp, w, **kw)
    return Context(hp, w, dtype=np.float64 if backend == "reference64" else np.float32, **kw)


def sampler_factory(backend: str):
    def make(params: SamplerParams):
        if backend == "mlx":
            return MLXSamplerChain.from_params(params, N_VOCAB), True
        return SamplerChain.from_params(params, N_VOCAB), False
    return make


def make_scheduler(backend: str = "reference", kind: str = "llama", n_slots: int = 4,
                   n_ctx: int = 1024, kv_unified: bool = True, n_batch: int = 64,
                   n_ubatch: int = 32, swa_full: bool = False, clock=None,
                   **config) -> Scheduler:
    """A scheduler on a fresh Context; ``config``: more ``SchedulerConfig`` fields;
    ``clock``: the scheduler's clock (None: ``time.perf_counter``)."""
    ctx = make_context(backend, kind, n_ctx=n_ctx, n_seq_max=n_slots, kv_unified=kv_unified,
                       n_batch=n_batch, n_ubatch=n_ubatch, swa_full=swa_full)
    return Scheduler(ctx, tokenizer(), sampler_factory(backend),
                     SchedulerConfig(n_slots=n_slots, swa_full=swa_full, **config),
                     clock=clock or time.perf_counter)


def make_draft(backend: str = "reference", kind: str = "llama", draft: str = "layers:1",
               n_slots: int = 4, n_ctx: int = 1024, kv_unified: bool = True,
               n_batch: int = 64, n_ubatch: int = 32, swa_full: bool = False):
    """A draft Context for the tiny model ``kind``: ``"layers:K"``, the target's first K
    layers (``--draft-layers K``); ``"other"``, another random model of the same vocabulary
    (a draft that disagrees often)."""
    hp, w = prepared(backend, kind)
    if draft.startswith("layers:"):
        hp = draft_layers(hp, int(draft.split(":")[1]))
    elif draft == "other":
        w = {"llama": random_weights, "gemma": random_gemma_weights,
             "mamba": random_mamba_weights, "mamba2": random_mamba_weights}[kind](hp, seed=11)
        w = prepare_weights(w, "accelerated") if backend == "mlx" else w
    else:
        raise ValueError(draft)
    kw = dict(n_ctx=n_ctx, n_seq_max=n_slots, kv_unified=kv_unified, n_batch=n_batch,
              n_ubatch=n_ubatch, swa_full=swa_full)
    if backend == "mlx":
        return backend_context("accelerated", hp, w, **kw)
    return Context(hp, w, dtype=np.float64 if backend == "reference64" else np.float32, **kw)


def make_spec_scheduler(backend: str = "reference", kind: str = "llama",
                        draft: str | None = "layers:1", n_slots: int = 4, n_ctx: int = 1024,
                        kv_unified: bool = True, n_batch: int = 64, n_ubatch: int = 32,
                        swa_full: bool = False, tok=None, clock=None, ngram_caches=None,
                        **config) -> Scheduler:
    """``make_scheduler`` with a draft Context (``make_draft``'s ``draft``; None: no draft
    model, for the n-gram drafters of ``spec_types``); ``tok``: the tokenizer the scheduler
    sees (None: SmolLM2's)."""
    kw = dict(n_ctx=n_ctx, kv_unified=kv_unified, n_batch=n_batch, n_ubatch=n_ubatch,
              swa_full=swa_full)
    ctx = make_context(backend, kind, n_seq_max=n_slots, **kw)
    return Scheduler(ctx, tok or tokenizer(), sampler_factory(backend),
                     SchedulerConfig(n_slots=n_slots, swa_full=swa_full, **config),
                     clock=clock or time.perf_counter, ngram_caches=ngram_caches,
                     draft=None if draft is None else make_draft(backend, kind, draft,
                                                                 n_slots=n_slots, **kw))


def word_prompts(n: int, words: int = 6, letters: str = "wx", spread: int = 5
                 ) -> list[list[int]]:
    """``n`` distinct prompts of ``words`` to ``words + spread - 1`` made-up words
    (``w0x0 w0x1 ...``), tokenized with BOS."""
    tok = tokenizer()
    a, b = letters
    return [tok.tokenize(" ".join(f"{a}{i}{b}{j}" for j in range(words + i % spread)),
                         add_special=True, parse_special=True) for i in range(n)]


def collect(out: dict, i: int):
    """A task callback that appends task ``i``'s results to ``out[i]``."""
    return lambda r: out.setdefault(i, []).append(r)


def finals(out: dict) -> dict:
    """Each task's last result, which must be its ``Final``."""
    res = {}
    for i, rs in out.items():
        assert isinstance(rs[-1], Final), rs[-1]
        res[i] = rs[-1]
    return res


def make_engine(*args, max_queue: int = 1024, **kw) -> Engine:
    """The runtime around ``make_scheduler(*args, **kw)`` (no thread started)."""
    return Engine(make_scheduler(*args, **kw), max_queue=max_queue)


def greedy(n_predict: int, **kw) -> SlotParams:
    return SlotParams(n_predict=n_predict, sampling=SamplerParams(temp=0.0), **kw)


def alone(backend: str, prompt: list[int], n_predict: int, kind: str = "llama",
          n_ctx: int = 1024) -> list[int]:
    """``llamaref generate`` on one prompt: a fresh one-sequence Context, greedy."""
    ctx = make_context(backend, kind, n_ctx=n_ctx, n_batch=64, n_ubatch=32)
    sampler, on_device = sampler_factory(backend)(SamplerParams(temp=0.0))
    gen = Generator(ctx, sampler, shift=False, on_device=on_device)
    gen.eval_prompt(prompt)
    out = []
    for t in gen.generate(n_predict, tokenizer().is_eog):
        out.append(t)
        if tokenizer().is_eog(t):
            break
    return out


def decode_all(ctx, tokens: list[int], seq: int = 0) -> np.ndarray:
    """Logits of the last token after decoding ``tokens`` on sequence ``seq`` from 0."""
    ctx.decode(Batch(token=tokens, pos=list(range(len(tokens))), seq_id=[[seq]] * len(tokens),
                     logits=[False] * (len(tokens) - 1) + [True]))
    return np.asarray(ctx.get_logits_ith(0))


def run_scheduler(sched: Scheduler, tasks, max_steps: int = 100_000) -> list[StepReport]:
    """Add ``tasks``, then step until the scheduler has nothing to do; the steps' reports."""
    for t in tasks:
        sched.add_task(t)
    reports = []
    for _ in range(max_steps):
        reports.append(sched.step())
        if not reports[-1].busy:
            return reports
    raise AssertionError("the scheduler did not finish")


class LiveServer:
    """uvicorn on a free port in a thread, with an engine thread behind it (the transport of
    ``llamaref serve``: its read deadline and its shutdown)."""

    def __init__(self, factory, read_timeout: float = DEFAULT_TIMEOUT,
                 state: ServerState | None = None, **state_kw):
        """``factory``: builds the Engine (on the engine's thread, as MLX needs);
        ``read_timeout``: ``--timeout``; ``state``: the server's state (``llamaref
        serve``'s, from ``new_state``; None: the tiny model's); ``state_kw``: more
        ``ServerState`` fields."""
        self.state = state or ServerState(
            tokenizer=tokenizer(), n_vocab=N_VOCAB, model_name="tiny",
            user_delimiter=user_delimiter(tokenizer()), **state_kw)
        self.app = build_app(self.state)
        start_engine(self.state, factory)
        for _ in range(3000):
            if self.state.engine is not None or self.state.load_error:
                break
            time.sleep(0.01)
        assert self.state.engine is not None, self.state.load_error
        self.engine = self.state.engine
        config = server_config(self.app, read_timeout, host="127.0.0.1", port=0)
        self.server = Server(config, self.state)
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        for _ in range(500):
            if self.server.started:
                break
            time.sleep(0.01)
        sock = self.server.servers[0].sockets[0]
        self.port = sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"

    def interrupt(self) -> None:
        """What Ctrl-C does to ``llamaref serve``."""
        self.server.handle_exit(signal.SIGINT, None)

    def close(self) -> None:
        self.server.should_exit = True
        self.thread.join(5)
        self.state.stop.set()
        if self.state.thread is not None:
            self.state.thread.join(5)
