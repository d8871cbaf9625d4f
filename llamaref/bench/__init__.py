r"""``llamaref bench``: prompt processing and generation speed, in the spirit of llama-bench.

Three tests, named as llama-bench and llama-batched-bench name them:

- ``pp{n}``: ``n`` random prompt tokens decoded in one batch (``n_batch = n_ubatch >= n``)
  into the cache; only the last token gets logits (``llama_batch_get_one``'s default),
  so the lm_head runs once.
- ``tg{n}``: ``n`` one-token decodes into a growing cache, each next token the greedy argmax
  of the last logits (llama-bench's ``test_gen``). Ours run the generation loop of
  ``llamaref generate``
  ([`reference.tools.generate.Generator`][reference.tools.generate.Generator]) with a greedy
  sampler: on the MLX twin the argmax stays on the device and the loop runs ahead (token
  $t + 1$ launched before token $t$ is read back), as mlx-lm's ``generate_step`` does.
- ``pl{n}`` (``--parallel``): ``n`` sequences decoded together, one token each per step, in
  one batch of ``n`` tokens, after a short prompt per sequence (not timed). The row reports
  the aggregate speed $n \cdot n_{\text{steps}} / t$.

**Depth** (``-d``, llama-bench's ``-d``/``--n-depth``): ``pp`` and ``tg`` run after $d$ random
tokens already in the cache, the row named ``tg64 @ d4096``. The cache is filled once per
depth and backend (not timed), and put back to that depth before every run (the later
positions removed; a recurrent state restored from a copy). Several depths
(``-d 0,1000,4000``) make a **depth table** too ([`depth_table`][]): milliseconds per
generated token at each depth, its growth $t(d_{\max}) / t(0)$, and the ratio to the peer.

**Models.** ``-m`` takes a GGUF file or a HF folder (default: SmolLM2), or the name of a
shipped tiny model (``tiny``, ``tiny-mamba``, ``tiny-mamba2``:
[`llamaref.bench.tiny`][llamaref.bench.tiny]), whose forward is so small that the table measures the
work around it.

Method: every test runs once to warm up (not timed), then ``repetitions`` times. When several
backends are asked for, their runs *alternate* (ours, the peer, ours, the peer, ...), so a
drift of the machine's load hits them alike. A row reports the median tokens per second over
the runs and their spread as the slowest and the fastest run (min – max). The time is
measured around the calls by `time.perf_counter`, whatever the context reports itself.

``--vs`` adds a peer on the same weights ([`llamaref.bench.peers`][llamaref.bench.peers]):
``mlx-lm`` (its own model, cache and loop, holding our tensors in the form the twin holds them,
``--matmul``: quantized, the MLX affine groups of
[`accelerated.quants.to_mlx`][accelerated.quants.to_mlx] go into ``nn.QuantizedLinear`` /
``nn.QuantizedEmbedding`` unchanged; dense, both dequantize them exactly to float32) or
``llama.cpp`` (through llama-cpp-python, on the same GGUF, with ``--threads`` CPU threads). A row
then also gives the ratio ours / peer of the medians. Only that ratio means something across
machines: absolute numbers depend on the machine and on the BLAS that MLX was built with.

``--profile`` says where the time goes instead of how fast (``--profile ops``, the bare
``--profile``: the twin's forward op by op; ``phases``, ``steps``, ``overlap``, ``nodes`` and
``depth``: the host's work around it), with the instruments of
[`llamaref.bench.profile`][llamaref.bench.profile].
"""

from __future__ import annotations

import argparse
import csv
import importlib.util
import inspect
import io
import json
import statistics
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from accelerated.context import Context as AccContext
from accelerated.sampling import PendingToken
from llamaref.bench.peers import (
    LlamaCppRunner,
    MLXLMRunner,
    PeerError,
    check_mlx_lm_model,
    mlx_lm_model,
)
from llamaref.bench.profile import MODES, ProfileError, profile_ops, run_mode, run_profile
from llamaref.bench.tiny import TINY_MODELS, tiny_model
from llamaref.common import CLIError
from reference.batch import Batch
from reference.context import Context
from reference.hparams import LlamaHParams
from reference.model_loader import default_model_path, load_model
from reference.testing import write_tiny_gguf, write_tiny_mamba_gguf
from reference.tools.generate import Generator

__all__ = [
    "BACKENDS", "PEERS", "Backend", "BenchRow", "ContextRunner", "LlamaCppRunner",
    "MLXLMRunner", "PeerError", "add_bench_command", "alternate", "check_mlx_lm_model",
    "dense_weights", "depth_table", "format_rows", "mlx_lm_model", "model_info",
    "profile_ops", "random_tokens", "run_bench", "twin_kwargs", "twin_matmul",
]

BACKENDS = ("reference", "accelerated")
"""Our backends: the NumPy specification and its MLX twin."""

PEERS = ("mlx-lm", "llama.cpp")
"""The peers ``--vs`` accepts."""

SEED = 1234
"""Seed of the random prompt tokens (the same tokens for every backend)."""

N_BATCH_MIN = 512
"""The smallest ``n_batch`` of a runner's context: a depth is filled this many at a time."""


# ---------------------------------------------------------------------------------------------
# Rows: one test on one backend, and the statistics of its runs
# ---------------------------------------------------------------------------------------------


# --8<-- [start:BenchRow]
@dataclass(frozen=True)
class BenchRow:
    """One line of the table: a test on a model and a backend, its speed over the runs.

    Attributes:
        model: the model's file or folder name.
        backend: ``reference``, ``accelerated``, ``mlx-lm`` or ``llama.cpp``.
        dtype: the type the forward's matmuls read (``Q4_1``, ``f32``, ...).
        test: ``pp512``, ``tg128``, ``pl8``, ...
        seconds: the wall time of each timed run.
        n_tokens: tokens per run (``n``; ``n * steps`` for ``pl{n}``).
        size: bytes of the weights as the backend holds them.
        n_params: number of parameters.
        baseline: median tokens per second of the peer on the same test, or None.

    Examples:
        >>> row = BenchRow("m", "accelerated", "Q4_1", "tg4", (2.0, 1.0, 4.0), 4, 0, 0, 1.0)
        >>> row.tokens_per_second, row.spread, row.ratio
        (2.0, (1.0, 4.0), 2.0)
    """

    model: str
    backend: str
    dtype: str
    test: str
    seconds: tuple[float, ...]
    n_tokens: int
    size: int = 0
    n_params: int = 0
    baseline: float | None = None

    @property
    def tokens_per_second(self) -> float:
        """Median over the runs (of the times: the median of an even count is a mean)."""
        return self.n_tokens / statistics.median(self.seconds)

    @property
    def spread(self) -> tuple[float, float]:
        """Tokens per second of the slowest and of the fastest run."""
        return self.n_tokens / max(self.seconds), self.n_tokens / min(self.seconds)

    @property
    def ratio(self) -> float | None:
        """Median tokens per second over the peer's median (None without a peer)."""
        return None if self.baseline is None else self.tokens_per_second / self.baseline

    def markdown(self) -> str:
        """The row as a Markdown table line (see `HEADER`)."""
        slowest, fastest = self.spread
        ratio = "" if self.ratio is None else f"{self.ratio:.2f}"
        return (
            f"| {self.model} | {self.backend} | {self.dtype} | {self.test} | "
            f"{self.tokens_per_second:.2f} | {slowest:.2f} – {fastest:.2f} | "
            f"{len(self.seconds)} | {ratio} | {_mib(self.size)} | {_millions(self.n_params)} |"
        )

    def as_dict(self) -> dict:
        """The row with its statistics, for ``-o json`` and ``-o csv``."""
        slowest, fastest = self.spread
        return {**asdict(self), "seconds": list(self.seconds),
                "tokens_per_second": self.tokens_per_second, "tps_min": slowest,
                "tps_max": fastest, "ratio": self.ratio}
# --8<-- [end:BenchRow]


HEADER = (
    "| model | backend | dtype | test | t/s (median) | t/s (min – max) | runs "
    "| ours / peer | size | params |\n"
    "|-------|---------|-------|------|-------------:|----------------:|-----:"
    "|--------------:|-----:|-------:|"
)


def _mib(n_bytes: int) -> str:
    return f"{n_bytes / 2**20:.2f} MiB"


def _millions(n: int) -> str:
    return f"{n / 1e6:.2f} M"


def format_rows(rows: list[BenchRow], output: str) -> str:
    """The rows as a Markdown table (``md``), a JSON list (``json``) or CSV (``csv``).

    Examples:
        >>> row = BenchRow("m", "reference", "f32", "pp8", (0.5,), 8)
        >>> format_rows([row], "md").splitlines()[2]
        '| m | reference | f32 | pp8 | 16.00 | 16.00 – 16.00 | 1 |  | 0.00 MiB | 0.00 M |'
        >>> format_rows([row], "csv").splitlines()[0].split(",")[:4]
        ['model', 'backend', 'dtype', 'test']
    """
    if output == "json":
        return json.dumps([r.as_dict() for r in rows], indent=2)
    if output == "csv":
        buf = io.StringIO()
        fields = list(rows[0].as_dict()) if rows else ["model"]
        writer = csv.DictWriter(buf, fieldnames=fields, lineterminator="\n")
        writer.writeheader()
        for r in rows:
            writer.writerow({**r.as_dict(), "seconds": " ".join(f"{s:.6f}" for s in r.seconds)})
        return buf.getvalue().rstrip("\n")
    return "\n".join([HEADER, *(r.markdown() for r in rows)])


# ---------------------------------------------------------------------------------------------
# Runners: one per backend, each test a method that returns the seconds of one run
# ---------------------------------------------------------------------------------------------


def random_tokens(n: int, n_vocab: int, seed: int = SEED) -> np.ndarray:
    """``n`` seeded random token ids in ``[0, n_vocab)`` (int32)."""
    return np.random.default_rng(seed).integers(0, n_vocab, n).astype(np.int32)  # (n,)


# --8<-- [start:greedy]
class GreedyHost:
    """The greedy sampler of the ``tg`` test on the host: the argmax of the NumPy row."""

    pipelined = False

    def sample(self, logits: np.ndarray) -> int:
        return int(np.argmax(logits))

    def accept(self, token: int) -> None:
        pass


class GreedyDevice(GreedyHost):
    """The greedy sampler on the MLX device: ``mx.argmax``, and only the token comes back.

    It can sample ahead (`sample_async`), so
    [`reference.tools.generate.Generator`][reference.tools.generate.Generator] runs its
    pipelined loop with it, as mlx-lm's ``generate_step`` with its greedy sampler.

    Examples:
        >>> import mlx.core as mx
        >>> g = GreedyDevice()
        >>> g.resolve(g.sample_async(mx.array([0.1, 3.0, -1.0]))), g.sample(mx.array([2.0, 1.0]))
        (1, 0)
    """

    pipelined = True

    def sample(self, logits) -> int:
        import mlx.core as mx

        return int(mx.argmax(logits).item())

    def sample_async(self, logits) -> PendingToken:
        import mlx.core as mx

        token = mx.argmax(logits).astype(mx.int32).reshape(1)  # (1,)
        mx.async_eval(token)  # its own event: SamplerChain.sample_async says why
        return PendingToken(token, token)

    def resolve(self, pending: PendingToken) -> int:
        return int(pending.chosen.item())

    def cancel(self, pending: PendingToken) -> None:
        pass
# --8<-- [end:greedy]


# --8<-- [start:ContextRunner]
class ContextRunner:
    """Times a [`reference.context.Context`][reference.context.Context] (or its MLX twin) on the
    three tests.

    ``tg`` runs [`reference.tools.generate.Generator`][reference.tools.generate.Generator]
    with a greedy sampler ([`GreedyHost`][]; on the twin [`GreedyDevice`][], pipelined), the
    runner's ``sampler``.

    Args:
        context_cls: ``reference.context.Context`` or ``accelerated.context.Context``.
        hparams: the model's hyperparameters.
        weights: the weights as the context takes them.
        n_ctx: cells for ``pp``/``tg`` after the depth (padded by the context).
        n_batch: the largest ``pp`` batch (``n_ubatch`` is the same: one forward per test;
            at least [`N_BATCH_MIN`][], to fill a depth in few forwards).
        **context_kwargs: more arguments of the context (the twin's ``matmul``, ...).

    Examples:
        >>> from reference.testing import tiny_hparams, random_weights
        >>> from reference.context import Context
        >>> hp = tiny_hparams(n_layer=1)
        >>> runner = ContextRunner(Context, hp, random_weights(hp), n_ctx=64, n_batch=8)
        >>> runner.pp(random_tokens(8, hp.n_vocab)) > 0, len(runner.last_tokens)
        (True, 0)
        >>> runner.tg(1, 4) > 0, len(runner.last_tokens)
        (True, 4)
        >>> runner.set_depth(random_tokens(20, hp.n_vocab))
        >>> runner.tg(1, 4) > 0, runner.ctx.memory.seq_pos_max(0)
        (True, 23)
    """

    def __init__(self, context_cls: type[Context], hparams: LlamaHParams, weights: dict,
                 n_ctx: int, n_batch: int, **context_kwargs: object):
        self.context_cls, self.hparams, self.weights = context_cls, hparams, weights
        self.context_kwargs = context_kwargs
        n_batch = max(N_BATCH_MIN, n_batch)
        self.ctx = context_cls(hparams, weights, n_ctx=max(n_ctx, n_batch), n_batch=n_batch,
                               n_ubatch=n_batch, **context_kwargs)
        self.on_device = self.ctx.on_device
        self.depth_tokens: list[int] = []
        self._depth_state: bytes | None = None  # a recurrent memory's state at the depth
        self.last_tokens: list[int] = []  # what the last tg run generated
        # tg's greedy sampler (stateless: one serves every run)
        self.sampler = GreedyDevice() if self.on_device else GreedyHost()

    def _decode(self, ctx, batch: Batch) -> None:
        rc = ctx.decode(batch)
        if rc != 0:
            raise RuntimeError(f"decode returned {rc}: {ctx.last_error}")

    def _argmax(self, ctx, idxs: list[int]) -> list[int]:
        """The greedy tokens of batch indices ``idxs`` (on the device for the twin: one read)."""
        if self.on_device:
            import mlx.core as mx

            rows = mx.stack([ctx.get_logits_ith_device(i) for i in idxs])  # (n, n_vocab)
            return mx.argmax(rows, axis=-1).tolist()
        return [int(np.argmax(ctx.get_logits_ith(i))) for i in idxs]

    def set_depth(self, tokens: np.ndarray) -> None:
        """Fill the cache with ``tokens`` (not timed): ``pp`` and ``tg`` then start there."""
        ctx = self.ctx
        ctx.memory.clear(data=False)
        for i in range(0, len(tokens), ctx.n_batch):
            self._decode(ctx, Batch(token=tokens[i:i + ctx.n_batch]))
        ctx.synchronize()
        self.depth_tokens = [int(t) for t in tokens]
        recurrent = ctx.recurrent and len(tokens) > 0
        self._depth_state = ctx.state_seq_get_data(0) if recurrent else None

    def _rewind(self) -> None:
        """Back to the cache [`set_depth`][] left: later positions removed (a recurrent
        memory, which cannot remove a position, gets its state back)."""
        memory = self.ctx.memory
        if self._depth_state is not None:
            memory.clear(data=False)
            self.ctx.state_seq_set_data(self._depth_state, 0)
        elif not memory.seq_rm(0, len(self.depth_tokens), -1):
            memory.clear(data=False)  # a recurrent memory at depth 0

    def pp(self, tokens: np.ndarray) -> float:
        """Seconds to decode ``tokens`` in one batch after the depth (last logits only)."""
        self._rewind()
        batch = Batch(token=tokens)
        t0 = time.perf_counter()
        self._decode(self.ctx, batch)
        self.ctx.get_logits_ith(-1)  # the logits are on the host: the forward is done
        return time.perf_counter() - t0

    def tg(self, first_token: int, n_gen: int) -> float:
        """Seconds of ``n_gen`` greedy decodes after the depth: ``llamaref generate``'s loop.

        The first token is decoded as a one-token prompt, then ``n_gen`` tokens are
        generated, of which the last is not decoded: ``n_gen`` forwards, as llama-bench's
        ``tg`` and mlx-lm's ``generate_step`` count them.
        """
        self._rewind()
        gen = Generator(self.ctx, self.sampler, shift=False, on_device=self.on_device)
        gen.tokens = list(self.depth_tokens)  # what the cache holds
        t0 = time.perf_counter()
        gen.eval_prompt([int(first_token)])
        out = list(gen.generate(n_gen, is_eog=lambda token: False))
        seconds = time.perf_counter() - t0
        self.last_tokens = out
        return seconds

    def failed_decode(self) -> float:
        """Seconds of a decode that finds no slot (returns 1) in a full cache; then rewound.

        The cache is filled to its last cell first (not timed).
        """
        ctx = self.ctx
        self._rewind()
        n_free = ctx.memory.get_size() - len(self.depth_tokens)
        filler = random_tokens(n_free, self.hparams.n_vocab, seed=SEED + 1)
        for i in range(0, n_free, ctx.n_batch):
            self._decode(ctx, Batch(token=filler[i:i + ctx.n_batch]))
        ctx.synchronize()
        t0 = time.perf_counter()
        rc = ctx.decode(Batch(token=[1]))
        seconds = time.perf_counter() - t0
        if rc != 1:
            raise RuntimeError(f"a decode into a full cache returned {rc}, not 1")
        self._rewind()
        return seconds

    def parallel_context(self, n_seq: int, n_prompt: int, n_steps: int) -> Context:
        """A context for ``pl{n_seq}``: ``n_seq`` sequences, room for prompt and steps."""
        n_ctx = n_seq * (n_prompt + n_steps)
        return self.context_cls(self.hparams, self.weights, n_ctx=n_ctx,
                                n_batch=max(n_seq * n_prompt, n_seq), n_seq_max=n_seq,
                                **self.context_kwargs)

    def pl(self, ctx: Context, prompts: np.ndarray, n_steps: int) -> float:
        """Seconds of ``n_steps`` steps of one token per sequence, after the prompts.

        Args:
            ctx: a context from [`parallel_context`][].
            prompts: ``(n_seq, n_prompt)`` token ids, one prompt per sequence (not timed).
            n_steps: decode steps to time.
        """
        n_seq, n_prompt = prompts.shape
        ctx.memory.clear(data=False)
        seq_id = [[s] for s in range(n_seq) for _ in range(n_prompt)]
        last = [i % n_prompt == n_prompt - 1 for i in range(n_seq * n_prompt)]
        self._decode(ctx, Batch(token=prompts.reshape(-1), seq_id=seq_id, logits=last))
        tokens = self._argmax(ctx, [(s + 1) * n_prompt - 1 for s in range(n_seq)])
        seq_id = [[s] for s in range(n_seq)]
        t0 = time.perf_counter()
        for _ in range(n_steps):
            self._decode(ctx, Batch(token=tokens, seq_id=seq_id, logits=[True] * n_seq))
            tokens = self._argmax(ctx, list(range(n_seq)))
        return time.perf_counter() - t0
# --8<-- [end:ContextRunner]


# ---------------------------------------------------------------------------------------------
# Running the tests: warm-up, alternation, rows
# ---------------------------------------------------------------------------------------------


@dataclass
class ModelInfo:
    """What the rows say about the model."""

    name: str
    size: int
    n_params: int
    dtype: str


def model_info(name: str, weights: dict) -> ModelInfo:
    """Size (bytes as stored), parameter count, and the most common 2-D weight type.

    Examples:
        >>> model_info("m", {"a": np.zeros((2, 3), np.float32)})
        ModelInfo(name='m', size=24, n_params=6, dtype='F32')
    """
    size = n_params = 0
    kinds: dict[str, int] = {}
    for w in weights.values():
        n = int(np.prod(w.shape))
        n_params += n
        data = getattr(w, "data", w)
        size += int(np.asarray(data).nbytes)
        if len(w.shape) == 2:
            qtype = getattr(w, "qtype", None)
            kind = qtype.name if qtype is not None else np.dtype(w.dtype).name.upper()
            kind = {"FLOAT32": "F32", "FLOAT16": "F16", "FLOAT64": "F64"}.get(kind, kind)
            kinds[kind] = kinds.get(kind, 0) + n
    dtype = max(kinds, key=kinds.get) if kinds else "F32"
    return ModelInfo(name, size, n_params, dtype)


@dataclass
class Backend:
    """A runner with the labels of its rows (and a note printed under the table)."""

    name: str
    runner: object
    dtype: str
    size: int = 0
    peer: bool = False
    contexts: dict = field(default_factory=dict)
    note: str = ""


def alternate(backends: list[Backend], run: Callable[[Backend], float],
              repetitions: int) -> dict[str, tuple[float, ...]]:
    """One warm-up each, then ``repetitions`` rounds of one run per backend, in turn.

    Examples:
        >>> b = [Backend("a", None, "f32", 0), Backend("b", None, "f32", 0)]
        >>> calls = []
        >>> alternate(b, lambda x: calls.append(x.name) or 1.0, 2)
        {'a': (1.0, 1.0), 'b': (1.0, 1.0)}
        >>> calls
        ['a', 'b', 'a', 'b', 'a', 'b']
    """
    for b in backends:
        run(b)  # warm-up: kernels, caches, BLAS threads
    seconds: dict[str, list[float]] = {b.name: [] for b in backends}
    for _ in range(repetitions):
        for b in backends:
            seconds[b.name].append(run(b))
    return {name: tuple(s) for name, s in seconds.items()}


def _rows(info: ModelInfo, backends: list[Backend], test: str, n_tokens: int,
          seconds: dict[str, tuple[float, ...]]) -> list[BenchRow]:
    peer = next((b.name for b in backends if b.peer), None)
    baseline = n_tokens / statistics.median(seconds[peer]) if peer else None
    return [BenchRow(info.name, b.name, b.dtype, test, seconds[b.name], n_tokens, b.size,
                     info.n_params, None if b.peer else baseline) for b in backends]


def test_name(kind: str, n: int, depth: int = 0) -> str:
    """llama-bench's test names: ``pp512``, ``tg128``, and ``tg128 @ d4096`` after a depth.

    Examples:
        >>> test_name("tg", 64), test_name("tg", 64, 4096)
        ('tg64', 'tg64 @ d4096')
    """
    return f"{kind}{n}" if depth == 0 else f"{kind}{n} @ d{depth}"


# --8<-- [start:run_bench]
def run_bench(info: ModelInfo, hparams: LlamaHParams, backends: list[Backend], n_prompt: int,
              n_gen: int, repetitions: int, parallel: tuple[int, ...] = (),
              pl_prompt: int = 16, pl_gen: int = 32,
              log: Callable[[BenchRow], None] | None = None,
              depths: tuple[int, ...] = (0,)) -> list[BenchRow]:
    """The ``pp``, ``tg`` and ``pl`` rows of every backend, runs alternating.

    Args:
        info: the model's labels ([`model_info`][]).
        hparams: its hyperparameters.
        backends: the runners (ours first, the peer last).
        n_prompt: ``pp`` size (0: skip).
        n_gen: ``tg`` size (0: skip).
        repetitions: timed runs per test and backend.
        parallel: the ``pl`` sequence counts.
        pl_prompt: prompt tokens per sequence before the ``pl`` steps.
        pl_gen: timed steps of a ``pl`` run.
        log: called with each finished row (e.g. to print it at once).
        depths: tokens in the cache before ``pp`` and ``tg`` (``-d``), each in turn.

    Returns:
        The rows, depth by depth and test by test, backend by backend.

    Examples:
        >>> from reference.testing import tiny_hparams, random_weights
        >>> from reference.context import Context
        >>> hp = tiny_hparams(n_layer=1)
        >>> w = random_weights(hp)
        >>> b = [Backend("reference", ContextRunner(Context, hp, w, 32, 8), "f32", 0)]
        >>> rows = run_bench(model_info("m", w), hp, b, 8, 4, 2, parallel=(2,), pl_gen=3,
        ...                  depths=(0, 16))
        >>> [(r.test, r.n_tokens, len(r.seconds)) for r in rows]
        [('pp8', 8, 2), ('tg4', 4, 2), ('pp8 @ d16', 8, 2), ('tg4 @ d16', 4, 2), ('pl2', 6, 2)]
    """
    log = log or (lambda row: None)
    rows: list[BenchRow] = []

    def add(test, n_tokens, seconds):
        for row in _rows(info, backends, test, n_tokens, seconds):
            rows.append(row)
            log(row)

    for depth in depths:
        if n_prompt == 0 and n_gen == 0:
            break
        filler = random_tokens(depth, hparams.n_vocab, seed=SEED + 2)  # (depth,)
        for b in backends:
            b.runner.set_depth(filler)
        if n_prompt > 0:
            tokens = random_tokens(n_prompt, hparams.n_vocab)  # (n_prompt,)
            add(test_name("pp", n_prompt, depth), n_prompt,
                alternate(backends, lambda b, t=tokens: b.runner.pp(t), repetitions))
        if n_gen > 0:
            first = int(random_tokens(1, hparams.n_vocab)[0])
            add(test_name("tg", n_gen, depth), n_gen,
                alternate(backends, lambda b, f=first: b.runner.tg(f, n_gen), repetitions))
    for n_seq in parallel:
        prompts = random_tokens(n_seq * pl_prompt, hparams.n_vocab).reshape(n_seq, pl_prompt)
        for b in backends:
            b.contexts["pl"] = b.runner.parallel_context(n_seq, pl_prompt, pl_gen)
        add(f"pl{n_seq}", n_seq * pl_gen, alternate(
            backends, lambda b, p=prompts: b.runner.pl(b.contexts["pl"], p, pl_gen), repetitions))
        for b in backends:
            b.contexts.pop("pl")  # free the cache before the next size
    return rows
# --8<-- [end:run_bench]


# ---------------------------------------------------------------------------------------------
# Plot
# ---------------------------------------------------------------------------------------------


# --8<-- [start:plot_rows]
def plot_rows(rows: list[BenchRow], path: Path, title: str = "") -> None:
    """A PNG: t/s per test and backend (bars, min – max as error bars), and the ``pl``
    scaling curve (aggregate t/s against sequences, log2 axis) when there are ``pl`` rows.

    Raises:
        ValueError: no rows.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    if not rows:
        raise ValueError("nothing to plot: no rows")
    single = [r for r in rows if not r.test.startswith("pl")]
    parallel = [r for r in rows if r.test.startswith("pl")]
    panels = [p for p in (single, parallel) if p]
    fig, axes = plt.subplots(1, len(panels), figsize=(6 * len(panels), 4.2), squeeze=False)
    if single:
        _plot_bars(axes[0][0], single)
    if parallel:
        _plot_scaling(axes[0][-1], parallel)
    if title:
        fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
# --8<-- [end:plot_rows]


def _backends(rows: list[BenchRow]) -> list[str]:
    return list(dict.fromkeys(r.backend for r in rows))


def _plot_bars(ax, rows: list[BenchRow]) -> None:
    tests, backends = list(dict.fromkeys(r.test for r in rows)), _backends(rows)
    width = 0.8 / len(backends)
    for j, backend in enumerate(backends):
        for i, test in enumerate(tests):
            r = next((r for r in rows if r.test == test and r.backend == backend), None)
            if r is None:
                continue
            lo, hi = r.spread
            x = i + (j - (len(backends) - 1) / 2) * width
            ax.bar(x, r.tokens_per_second, width, color=f"C{j}",
                   yerr=[[r.tokens_per_second - lo], [hi - r.tokens_per_second]], capsize=3,
                   label=backend if i == 0 else None)
            if r.ratio is not None:
                ax.annotate(f"{r.ratio:.2f}×", (x, hi), ha="center", va="bottom", fontsize=8)
    ax.set_xticks(range(len(tests)), tests)
    ax.set_ylabel("tokens / s (median; bars: min – max)")
    ax.set_title("pp and tg (label: ours / peer)", fontsize=10)
    ax.legend(fontsize=8)


def _plot_scaling(ax, rows: list[BenchRow]) -> None:
    for j, backend in enumerate(_backends(rows)):
        rs = sorted((r for r in rows if r.backend == backend), key=lambda r: int(r.test[2:]))
        n = [int(r.test[2:]) for r in rs]
        tps = [r.tokens_per_second for r in rs]
        err = [[t - r.spread[0] for t, r in zip(tps, rs, strict=True)],
               [r.spread[1] - t for t, r in zip(tps, rs, strict=True)]]
        ax.errorbar(n, tps, yerr=err, marker="o", color=f"C{j}", capsize=3, label=backend)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("sequences decoded together")
    ax.set_ylabel("aggregate tokens / s")
    ax.set_title("parallel decoding (one token per sequence per step)", fontsize=10)
    ax.legend(fontsize=8)


# ---------------------------------------------------------------------------------------------
# The command
# ---------------------------------------------------------------------------------------------


# --8<-- [start:command]
def add_bench_command(subparsers) -> None:
    """Register ``llamaref bench`` on the CLI's subparsers (the CLI calls this)."""
    bench = subparsers.add_parser(
        "bench", help="prompt processing (pp), generation (tg) and parallel (pl) speed")
    bench.add_argument("--model", "-m",
                       help="a GGUF file, a HF directory, or a shipped tiny model: "
                            f"{', '.join(TINY_MODELS)} (default: SmolLM2)")
    bench.add_argument("-p", "--n-prompt", type=int, default=512, help="pp test size (0: skip)")
    bench.add_argument("-n", "--n-gen", type=int, default=128, help="tg test size (0: skip)")
    bench.add_argument("-d", "--n-depth", default="0",
                       help="comma-separated tokens in the cache before pp and tg, e.g. "
                            "0,1000,4000 (several: a depth table too)")
    bench.add_argument("-c", "--n-ctx", type=int, default=0,
                       help="cache size for pp and tg (default: the deepest depth + the "
                            "larger of -p and -n)")
    bench.add_argument("-r", "--repetitions", type=int, default=5, help="timed runs per test")
    bench.add_argument("--backend", default="accelerated",
                       help="comma-separated: reference, accelerated (default: accelerated)")
    bench.add_argument("--vs", help="a peer to run alternately on the same weights: "
                                    f"{' or '.join(PEERS)}")
    bench.add_argument("--threads", type=int, default=0,
                       help="llama.cpp's CPU threads (default: every core)")
    bench.add_argument("--matmul", choices=("dense", "quantized"),
                       help="matmul weights of the twin and the peer (default: quantized, "
                            "4-bit groups in both)")
    bench.add_argument("--parallel", default="",
                       help="comma-separated sequence counts for the pl test, e.g. 1,2,4,8")
    bench.add_argument("--pl-prompt", type=int, default=16, help="pl prompt per sequence")
    bench.add_argument("--pl-gen", type=int, default=32, help="pl timed steps")
    bench.add_argument("--failed-decode", action="store_true",
                       help="also time, for ours, a decode that finds no slot in a full cache")
    bench.add_argument("-o", "--output", choices=("md", "json", "csv"), default="md")
    bench.add_argument("--plot", help="write a PNG here (and the Markdown table as .md)")
    bench.add_argument("--profile", nargs="?", const="ops", choices=tuple(MODES),
                       metavar="MODE",
                       help="where the time goes, instead of how fast: "
                            + "; ".join(f"{m}: {what}" for m, what in MODES.items())
                            + " (bare --profile: ops, after the table; the others run "
                              "instead of the tests)")
    bench.add_argument("--spins", default="0,500,1000,2000,0",
                       help="--profile overlap: comma-separated µs of busy wait added to "
                            "each token's host work, one row each")
    bench.set_defaults(func=cmd_bench)


def cmd_bench(args: argparse.Namespace) -> int:
    """Run the tests on every backend asked for; print the table (and plot, profile)."""
    path, backends_asked, parallel, depths = _check_args(args)
    try:
        hparams, weights, backends, info = _build(
            path, backends_asked, args.vs, args.n_prompt, args.n_gen, args.matmul,
            n_ctx=args.n_ctx or max(depths) + max(args.n_prompt, args.n_gen, 1),
            threads=args.threads)
    except PeerError as e:
        raise CLIError(str(e)) from e
    if args.profile not in (None, "ops"):  # an instrument: its own loop, its own table
        _cmd_instrument(args, hparams, backends, depths)
        return 0
    streaming = args.output == "md" and not args.plot
    if streaming:
        print(HEADER, flush=True)
    rows = run_bench(info, hparams, backends, args.n_prompt, args.n_gen, args.repetitions,
                     parallel, args.pl_prompt, args.pl_gen,
                     log=(lambda r: print(r.markdown(), flush=True)) if streaming else None,
                     depths=depths)
    if not streaming:
        print(format_rows(rows, args.output))
    failed = {}
    if args.failed_decode:
        failed = {b.name: [b.runner.failed_decode() for _ in range(args.repetitions)]
                  for b in backends if hasattr(b.runner, "failed_decode")}
    extra = []
    if args.output == "md":
        if len(depths) > 1 or failed:
            extra.append(depth_table(rows, failed))
        extra += [f"{b.name}: {b.note}" for b in backends if b.note]
        print("\n" + "\n\n".join(extra) if extra else "", end="\n" if extra else "")
    if args.plot:
        plot = Path(args.plot)
        plot_rows(rows, plot, title=f"{info.name}: llamaref bench")
        plot.with_suffix(".md").write_text("\n\n".join([format_rows(rows, "md"), *extra])
                                           + "\n")
    if args.profile == "ops":
        _cmd_profile(args, hparams, weights, backends)
    return 0
# --8<-- [end:command]


def _check_args(args):
    """Validate before loading anything; returns (path, backends, parallel sizes, depths)."""
    if args.repetitions < 1 or args.n_prompt < 0 or args.n_gen < 0 or args.n_ctx < 0:
        raise CLIError("-r must be >= 1, -p, -n and -c must be >= 0")
    if args.n_prompt == 0 and args.n_gen == 0 and not args.parallel:
        raise CLIError("nothing to run: -p and -n are 0 and no --parallel")
    backends = [b.strip() for b in args.backend.split(",") if b.strip()]
    unknown = [b for b in backends if b not in BACKENDS]
    if unknown or not backends:
        raise CLIError(f"unknown backend {', '.join(unknown) or '(none)'}; "
                       f"choose from {', '.join(BACKENDS)}")
    if args.vs is not None:
        if args.vs not in PEERS:
            raise CLIError(f"--vs {args.vs}: the peers are {', '.join(PEERS)}")
        needs = {"mlx-lm": ("mlx_lm", "bench"), "llama.cpp": ("llama_cpp", "oracles")}
        module, extra = needs[args.vs]
        if importlib.util.find_spec(module) is None:
            raise CLIError(f"--vs {args.vs} needs {module}: pip install 'llamaref[{extra}]'")
    if args.threads < 0 or (args.threads and args.vs != "llama.cpp"):
        raise CLIError("--threads sets llama.cpp's threads: a count >= 1 with --vs llama.cpp")
    parallel = _counts("--parallel", args.parallel, "sequence counts like 1,2,4,8")
    depths = _counts("-d", args.n_depth, "depths like 0,1000,4000") or (0,)
    if any(n < 1 for n in parallel) or (parallel and (args.pl_prompt < 1 or args.pl_gen < 1)):
        raise CLIError("--parallel counts, --pl-prompt and --pl-gen must be >= 1")
    if any(d < 0 for d in depths) or len(set(depths)) != len(depths):
        raise CLIError(f"-d {args.n_depth}: depths must be distinct and >= 0")
    if args.n_ctx and max(depths) + max(args.n_prompt, args.n_gen) > args.n_ctx:
        raise CLIError(f"-c {args.n_ctx} holds no depth of {max(depths)} tokens and "
                       f"{max(args.n_prompt, args.n_gen)} more")
    if args.plot and importlib.util.find_spec("matplotlib") is None:
        raise CLIError("--plot needs matplotlib: pip install 'llamaref[bench]'")
    _check_profile(args, backends)
    if args.model in TINY_MODELS:
        return args.model, backends, parallel, depths
    path = Path(args.model) if args.model else default_model_path()
    if not path.exists():
        raise CLIError(f"model not found: {path}")
    return path, backends, parallel, depths


def _check_profile(args, backends: list[str]) -> None:
    """Validate ``--profile`` and ``--spins`` against the other flags (a one-line CLIError)."""
    mode = args.profile
    if mode is None:
        return
    if mode in ("ops", "phases", "nodes") and "accelerated" not in backends:
        raise CLIError(f"--profile profiles the accelerated backend ({mode}): add it to "
                       "--backend")
    if mode == "ops":
        return
    if args.output != "md" or args.plot or args.parallel or args.failed_decode:
        raise CLIError(f"--profile {mode} runs instead of the tests and prints Markdown: leave "
                       "out -o, --plot, --parallel and --failed-decode")
    if args.vs is not None and (mode not in ("phases", "overlap") or args.vs != "mlx-lm"):
        raise CLIError(f"--vs {args.vs}: --profile {mode} "
                       + ("compares with mlx-lm only" if mode in ("phases", "overlap")
                          else "measures ours only"))
    if mode != "nodes" and args.n_gen < 1:
        raise CLIError(f"--profile {mode} times -n generated tokens: give -n >= 1")
    if mode == "overlap" and any(us < 0 for us in _counts("--spins", args.spins,
                                                          "waits in µs like 0,500,1000")):
        raise CLIError(f"--spins {args.spins}: waits must be >= 0 µs")


def _counts(flag: str, text: str, example: str) -> tuple[int, ...]:
    """A comma-separated list of integers, or a one-line CLIError.

    Examples:
        >>> _counts("-d", "0, 1000", "depths")
        (0, 1000)
    """
    try:
        return tuple(int(n) for n in text.split(",") if n.strip())
    except ValueError:
        raise CLIError(f"{flag} {text!r}: give {example}") from None


# --8<-- [start:depth_table]
def depth_table(rows: list[BenchRow], failed: dict[str, list[float]] | None = None) -> str:
    r"""Milliseconds per generated token at each depth, per backend, from the ``tg`` rows.

    Each cell is the median ms per token; for ours, the ratio to the peer's at the same
    depth follows in brackets (ours / peer, in *time*: below 1 is faster than the peer). The
    last columns: the growth $t(d_{\max}) / t(d_0)$ from the shallowest to the deepest depth,
    and, with ``failed`` (``--failed-decode``), the median ms of a decode that found no slot
    in the full cache.

    Examples:
        >>> rows = [BenchRow("m", b, "F32", t, (s,), 10) for b, t, s in [
        ...     ("accelerated", "tg10", 0.02), ("mlx-lm", "tg10", 0.025),
        ...     ("accelerated", "tg10 @ d4000", 0.03), ("mlx-lm", "tg10 @ d4000", 0.03)]]
        >>> print(depth_table(rows, {"accelerated": [0.004]}))
        | ms / token | d0 | d4000 | d4000 / d0 | failed decode (ms) |
        |---|---:|---:|---:|---:|
        | accelerated | 2.00 (0.80×) | 3.00 (1.00×) | 1.50 | 4.0 |
        | mlx-lm | 2.50 | 3.00 | 1.20 |  |
    """
    failed = failed or {}
    tg = [r for r in rows if r.test.startswith("tg")]
    depth = {r.test: int(r.test.split(" @ d")[1]) if " @ d" in r.test else 0 for r in tg}
    depths = sorted(set(depth.values()))
    peer = {depth[r.test]: r for r in tg if r.backend in PEERS}
    lines = ["| ms / token | " + " | ".join(f"d{d}" for d in depths)
             + f" | d{depths[-1]} / d{depths[0]} |" + (" failed decode (ms) |" if failed else ""),
             "|---|" + "---:|" * (len(depths) + 1) + ("---:|" if failed else "")]
    for backend in dict.fromkeys(r.backend for r in tg):
        ms = {depth[r.test]: 1e3 / r.tokens_per_second for r in tg if r.backend == backend}
        cells = []
        for d in depths:
            ratio = ""
            if d in peer and peer[d].backend != backend and d in ms:
                ratio = f" ({ms[d] / (1e3 / peer[d].tokens_per_second):.2f}×)"
            cells.append(f"{ms[d]:.2f}{ratio}" if d in ms else "")
        growth = f"{ms[depths[-1]] / ms[depths[0]]:.2f}" if len(ms) == len(depths) else ""
        line = f"| {backend} | " + " | ".join(cells) + f" | {growth} |"
        if failed:
            f = failed.get(backend)
            line += f" {1e3 * statistics.median(f):.1f} |" if f else "  |"
        lines.append(line)
    return "\n".join(lines)
# --8<-- [end:depth_table]


def twin_matmul(matmul: str | None) -> str:
    """The matmul form of the twin and the peer: ``matmul``, or ``"quantized"``.

    The comparison that counts is quantized weights in both (Q4_0/Q4_1/Q8_0 as MLX affine
    groups, read by ``mx.quantized_matmul``), whatever the twin's Context picks for itself
    on the device
    ([`accelerated.models.llama.default_matmul`][accelerated.models.llama.default_matmul]: dense on
    a CPU).

    Examples:
        >>> twin_matmul(None), twin_matmul("dense")
        ('quantized', 'dense')
    """
    return "quantized" if matmul is None else matmul


def twin_kwargs(matmul: str, **extra) -> dict:
    """The twin Context's keyword arguments ``matmul`` and ``extra``, those it takes.

    Examples:
        >>> twin_kwargs("dense", graph_reuse=False, no_such_argument=1)
        {'matmul': 'dense', 'graph_reuse': False}
    """
    params = inspect.signature(AccContext).parameters
    kwargs = {"matmul": matmul, **extra}
    return {k: v for k, v in kwargs.items() if k in params}


def _dtype_label(dtype: str, dense: bool) -> str:
    """``Q4_1`` read as such, or ``Q4_1→F32`` when dequantized (exactly) before timing."""
    return f"{dtype}→F32" if dense and dtype not in ("F32", "F64") else dtype


def _build(path: Path | str, names: list[str], vs: str | None, n_prompt: int, n_gen: int,
           matmul: str | None = None, n_ctx: int | None = None, threads: int = 0):
    """Load the model and make a runner per backend (and the peer's, last)."""
    if isinstance(path, str):  # a shipped tiny model
        hparams, weights = tiny_model(path)
    else:
        hparams, weights = load_model(path)
    if vs == "mlx-lm":
        check_mlx_lm_model(hparams)  # before building anything
    info = model_info(path if isinstance(path, str) else path.name, weights)
    n_ctx = n_ctx or max(n_prompt, n_gen, 1)
    matmul = twin_matmul(matmul)
    backends = []
    for name in names:
        if name == "reference":  # dequantized once: the rows time the forward, not the format
            dense = dense_weights(weights)
            runner = ContextRunner(Context, hparams, dense, n_ctx, n_prompt)
            backends.append(Backend(name, runner, _dtype_label(info.dtype, True), _size(dense)))
        else:
            runner = ContextRunner(AccContext, hparams, weights, n_ctx, n_prompt,
                                   **twin_kwargs(matmul))
            backends.append(Backend(name, runner, _dtype_label(info.dtype, matmul == "dense"),
                                    _mlx_size(runner.ctx)))
    if vs == "mlx-lm":
        model = mlx_lm_model(hparams, weights, matmul)
        backends.append(Backend(vs, MLXLMRunner(model), _dtype_label(info.dtype,
                                matmul == "dense"), _mlx_lm_size(model), peer=True))
    elif vs == "llama.cpp":
        gguf = _gguf_of(path, hparams, weights)
        runner = LlamaCppRunner(gguf, n_ctx, max(N_BATCH_MIN, n_prompt), threads or None)
        sizes = (f"n_ctx {n_ctx} and n_batch {max(N_BATCH_MIN, n_prompt)} as ours"
                 if n_prompt or n_gen else "the same cache and batch sizes as ours")
        backends.append(Backend(vs, runner, info.dtype, info.size, peer=True, note=(
            f"n_threads {runner.n_threads}, {sizes}, KV cache f16 (llama.cpp's default)")))
    return hparams, weights, backends, info


def _gguf_of(path: Path | str, hparams, weights: dict) -> Path:
    """The GGUF file llama.cpp reads: the model's own, or a tiny model written once (float32)."""
    if not isinstance(path, str):
        if path.suffix != ".gguf":
            raise PeerError("--vs llama.cpp reads a GGUF file; this model is a directory")
        return path
    out = Path(tempfile.mkdtemp(prefix="llamaref-bench-")) / f"{path}.gguf"
    write = write_tiny_mamba_gguf if hparams.arch in ("mamba", "mamba2") else write_tiny_gguf
    return write(out, hparams, weights)


def _size(weights: dict) -> int:
    return sum(int(np.asarray(w).nbytes) for w in weights.values())


def _mlx_size(ctx) -> int:
    """Bytes of the twin's prepared weights (every MLX array they hold)."""
    import mlx.core as mx

    total = 0
    for w in ctx.mlx_weights.values():
        arrays = [w] if isinstance(w, mx.array) else [v for v in vars(w).values()
                                                      if isinstance(v, mx.array)]
        total += sum(a.nbytes for a in arrays)
    return total


def _mlx_lm_size(model) -> int:
    from mlx.utils import tree_flatten

    return sum(a.nbytes for _, a in tree_flatten(model.parameters()))


def _cmd_instrument(args, hparams, backends: list[Backend], depths: tuple[int, ...]) -> None:
    """Run ``--profile MODE`` (every mode but ``ops``) on the backends built; print its tables.

    The depth tokens are the bench's (the same seed as ``run_bench``'s depths).
    """
    ours = {b.name: b.runner for b in backends if not b.peer}
    peer = next(((b.name, b.runner) for b in backends if b.peer), None)
    n_ctx = args.n_ctx or max(depths) + max(args.n_prompt, args.n_gen, 1)
    try:
        text = run_mode(args.profile, ours, peer,
                        lambda d: random_tokens(d, hparams.n_vocab, seed=SEED + 2), depths,
                        n_tokens=args.n_gen, runs=args.repetitions, n_ctx=n_ctx,
                        spins=_counts("--spins", args.spins, "waits in µs"))
    except ProfileError as e:
        raise CLIError(str(e)) from e
    print(text)


def _cmd_profile(args, hparams, weights, backends: list[Backend]) -> None:
    """Profile a fresh twin context (graph reuse off: op by op, through the wrappers)."""
    n_prompt, n_gen = args.n_prompt or 32, args.n_gen or 8
    kwargs = twin_kwargs(twin_matmul(args.matmul), graph_reuse=False)
    runner = ContextRunner(AccContext, hparams, weights, max(n_prompt, n_gen), n_prompt,
                           **kwargs)
    text = run_profile(runner, random_tokens(n_prompt, hparams.n_vocab), n_gen)
    print("\n" + text)
    if args.plot:
        plot = Path(args.plot)
        plot.with_name(plot.stem + "-profile.md").write_text(text + "\n")


def dense_weights(weights: dict, dtype=np.float32) -> dict:
    """Every weight as a dense array of ``dtype`` (quantized ones dequantized once).

    Examples:
        >>> dense_weights({"a": np.ones(2, np.float64)})["a"].dtype
        dtype('float32')
    """
    return {
        name: (w.dequantize() if hasattr(w, "dequantize") else np.asarray(w)).astype(dtype)
        for name, w in weights.items()
    }
