r"""``llamaref bench``: prompt processing and generation speed, in the spirit of llama-bench.

Three tests, named as llama-bench and llama-batched-bench name them:

- ``pp{n}``: ``n`` random prompt tokens decoded in one batch (``n_batch = n_ubatch >= n``)
  into an empty cache; only the last token gets logits (``llama_batch_get_one``'s default),
  so the lm_head runs once. The memory is cleared before every run.
- ``tg{n}``: ``n`` one-token decodes into a growing cache, the first into an empty one
  (llama-bench's ``test_gen``); each next token is the greedy argmax of the last logits
  (on the device when the context offers ``get_logits_ith_device``).
- ``pl{n}`` (``--parallel``): ``n`` sequences decoded together, one token each per step, in
  one batch of ``n`` tokens, after a short prompt per sequence (not timed). The row reports
  the aggregate speed $n \cdot n_{\text{steps}} / t$.

Method: every test runs once to warm up (not timed), then ``repetitions`` times. When several
backends are asked for, their runs *alternate* (ours, mlx-lm, ours, mlx-lm, ...), so a drift
of the machine's load hits them alike. A row reports the median tokens per second over the
runs and their spread as the slowest and the fastest run (min – max). The time is measured
around the decode calls by :func:`time.perf_counter`, whatever the context reports itself.

``--vs mlx-lm`` adds the peer: mlx-lm's own Llama (``mlx_lm.models.llama``), its KV cache
(``make_prompt_cache``) and its generation loop (``generate_step``, greedy), built on *the
same weights at the same precision*, held in the same form as the twin holds them
(:func:`mlx_lm_model`; ``--matmul``): quantized, the MLX affine groups of
:func:`accelerated.quants.to_mlx` go into ``nn.QuantizedLinear`` / ``nn.QuantizedEmbedding``
unchanged; dense, both dequantize them exactly to float32. A row then also gives the ratio
ours / mlx-lm of the medians. Only that ratio
means something across machines: absolute numbers depend on the machine and on the BLAS
that MLX was built with.

``--profile`` says where the accelerated forward spends its time (:func:`profile_ops`).
"""

from __future__ import annotations

import argparse
import csv
import importlib.util
import inspect
import io
import json
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

import accelerated.ops as accelerated_ops
import accelerated.quants as quants
from accelerated.context import Context as AccContext
from accelerated.models import llama as accelerated_llama
from accelerated.quants import MLXQuantized, load_weight
from llamaref.common import CLIError
from reference.batch import Batch
from reference.common import LlamarefError
from reference.context import Context
from reference.hparams import LlamaHParams
from reference.model import default_model_path, load_model

if TYPE_CHECKING:
    import mlx.nn as nn

BACKENDS = ("reference", "accelerated")
"""Our backends: the NumPy specification and its MLX twin."""

PEERS = ("mlx-lm",)
"""The peers ``--vs`` accepts."""

SEED = 1234
"""Seed of the random prompt tokens (the same tokens for every backend)."""


# ---------------------------------------------------------------------------------------------
# Rows: one test on one backend, and the statistics of its runs
# ---------------------------------------------------------------------------------------------


# --8<-- [start:BenchRow]
@dataclass(frozen=True)
class BenchRow:
    """One line of the table: a test on a model and a backend, its speed over the runs.

    Attributes:
        model: the model's file or folder name.
        backend: ``reference``, ``accelerated`` or ``mlx-lm``.
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
        """The row as a Markdown table line (see :data:`HEADER`)."""
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
    "| ours / mlx-lm | size | params |\n"
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


# --8<-- [start:ContextRunner]
class ContextRunner:
    """Times a :class:`reference.context.Context` (or its MLX twin) on the three tests.

    Args:
        context_cls: ``reference.context.Context`` or ``accelerated.context.Context``.
        hparams: the model's hyperparameters.
        weights: the weights as the context takes them.
        n_ctx: cells for ``pp``/``tg`` (padded by the context).
        n_batch: the largest ``pp`` batch (``n_ubatch`` is the same: one forward per test).
        **context_kwargs: more arguments of the context (the twin's ``matmul``, ...).

    Examples:
        >>> from reference.testing import tiny_hparams, random_weights
        >>> from reference.context import Context
        >>> hp = tiny_hparams(n_layer=1)
        >>> runner = ContextRunner(Context, hp, random_weights(hp), n_ctx=16, n_batch=8)
        >>> runner.pp(random_tokens(8, hp.n_vocab)) > 0, len(runner.last_tokens)
        (True, 0)
        >>> runner.tg(1, 4) > 0, len(runner.last_tokens)
        (True, 4)
    """

    def __init__(self, context_cls: type[Context], hparams: LlamaHParams, weights: dict,
                 n_ctx: int, n_batch: int, **context_kwargs: object):
        self.context_cls, self.hparams, self.weights = context_cls, hparams, weights
        self.context_kwargs = context_kwargs
        n_batch = max(1, n_batch)
        self.ctx = context_cls(hparams, weights, n_ctx=max(n_ctx, n_batch), n_batch=n_batch,
                               n_ubatch=n_batch, **context_kwargs)
        self.last_tokens: list[int] = []  # what the last tg run generated

    def _decode(self, ctx, batch: Batch) -> None:
        rc = ctx.decode(batch)
        if rc != 0:
            raise RuntimeError(f"decode returned {rc}: {ctx.last_error}")

    def _argmax(self, ctx, i: int) -> int:
        if hasattr(ctx, "get_logits_ith_device"):  # the MLX twin: argmax on the device
            import mlx.core as mx

            return int(mx.argmax(ctx.get_logits_ith_device(i)).item())
        return int(np.argmax(ctx.get_logits_ith(i)))

    def pp(self, tokens: np.ndarray) -> float:
        """Seconds to decode ``tokens`` in one batch into an empty cache (last logits only)."""
        self.ctx.memory.clear(data=False)
        batch = Batch(token=tokens)
        t0 = time.perf_counter()
        self._decode(self.ctx, batch)
        self.ctx.get_logits_ith(-1)  # the logits are on the host: the forward is done
        return time.perf_counter() - t0

    def tg(self, first_token: int, n_gen: int) -> float:
        """Seconds of ``n_gen`` one-token decodes from an empty cache, greedy."""
        self.ctx.memory.clear(data=False)
        token, out = int(first_token), []
        t0 = time.perf_counter()
        for _ in range(n_gen):
            self._decode(self.ctx, Batch(token=[token]))
            token = self._argmax(self.ctx, -1)
            out.append(token)
        seconds = time.perf_counter() - t0
        self.last_tokens = out
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
            ctx: a context from :meth:`parallel_context`.
            prompts: ``(n_seq, n_prompt)`` token ids, one prompt per sequence (not timed).
            n_steps: decode steps to time.
        """
        n_seq, n_prompt = prompts.shape
        ctx.memory.clear(data=False)
        seq_id = [[s] for s in range(n_seq) for _ in range(n_prompt)]
        last = [i % n_prompt == n_prompt - 1 for i in range(n_seq * n_prompt)]
        self._decode(ctx, Batch(token=prompts.reshape(-1), seq_id=seq_id, logits=last))
        tokens = [self._argmax(ctx, (s + 1) * n_prompt - 1) for s in range(n_seq)]
        seq_id = [[s] for s in range(n_seq)]
        t0 = time.perf_counter()
        for _ in range(n_steps):
            self._decode(ctx, Batch(token=tokens, seq_id=seq_id, logits=[True] * n_seq))
            tokens = [self._argmax(ctx, s) for s in range(n_seq)]
        return time.perf_counter() - t0
# --8<-- [end:ContextRunner]


# ---------------------------------------------------------------------------------------------
# The peer: mlx-lm on the same weights
# ---------------------------------------------------------------------------------------------


class PeerError(LlamarefError, ValueError):
    """The peer cannot run this model from these weights (or is not installed)."""


def check_mlx_lm_model(hparams) -> None:
    """Refuse a model that ``mlx_lm.models.llama`` cannot run exactly from GGUF weights.

    Raises:
        PeerError: not ``llama``; sliding window, RoPE scaling or a custom attention scale.

    Examples:
        >>> from reference.testing import tiny_hparams
        >>> check_mlx_lm_model(tiny_hparams("qwen2"))
        Traceback (most recent call last):
        ...
        llamaref.bench.PeerError: --vs mlx-lm runs arch 'llama' only; this model is 'qwen2'
    """
    arch = getattr(hparams, "arch", None)
    if arch != "llama":
        raise PeerError(f"--vs mlx-lm runs arch 'llama' only; this model is {arch!r}")
    if hparams.n_swa or hparams.rope_freq_scale_train != 1.0 or hparams.f_attention_scale:
        raise PeerError("--vs mlx-lm: this llama uses a sliding window, RoPE scaling or a "
                        "custom attention scale, which the peer's llama does not build the same")
    if hparams.n_rot != hparams.n_embd_head_k:
        raise PeerError("--vs mlx-lm: partial RoPE (n_rot < head_dim) is not mlx-lm's llama")


# --8<-- [start:mlx_lm_model]
def mlx_lm_model(hparams: LlamaHParams, weights: dict, matmul: str = "quantized") -> nn.Module:
    """mlx-lm's Llama holding *our* weights, in the form our MLX twin holds them.

    ``rope_traditional=True``: GGUF stores Q and K permuted for the interleaved RoPE
    (llama.cpp's "normal" mode), which is MLX's ``traditional`` RoPE. Each weight goes
    through :func:`accelerated.quants.load_weight`: with ``matmul="quantized"`` a Q4_0, Q4_1
    or Q8_0 tensor becomes :class:`accelerated.quants.MLXQuantized` (lossless) and its layer
    ``nn.QuantizedLinear`` / ``nn.QuantizedEmbedding`` with that ``w_q``, ``scales`` and
    ``biases``; with ``matmul="dense"`` every weight is dequantized (exactly) to float32 and
    the layers stay ``nn.Linear`` / ``nn.Embedding``. Other weights are float32 either way.

    Args:
        hparams: a llama (:func:`check_mlx_lm_model`).
        weights: GGUF-named weights (NumPy arrays or quantized tensors).
        matmul: ``"quantized"`` or ``"dense"``, as the twin's ``matmul``.

    Returns:
        ``mlx_lm.models.llama.Model``, parameters evaluated.

    Raises:
        PeerError: see :func:`check_mlx_lm_model`; a weight with a bias.
    """
    import mlx.core as mx
    import mlx.nn as nn
    from mlx_lm.models import llama

    check_mlx_lm_model(hparams)
    w = {name: load_weight(t, mx.float32, keep_quantized=matmul == "quantized")
         for name, t in weights.items()}
    if any(name.endswith(".bias") for name in w):
        raise PeerError("--vs mlx-lm: this llama has biases; mlx-lm's llama has none")
    tied = "output.weight" not in w
    args = llama.ModelArgs(
        model_type="llama", hidden_size=hparams.n_embd, num_hidden_layers=hparams.n_layer,
        intermediate_size=hparams.n_ff, num_attention_heads=hparams.n_head,
        num_key_value_heads=hparams.n_head_kv, head_dim=hparams.n_embd_head_k,
        rms_norm_eps=hparams.f_norm_rms_eps, vocab_size=hparams.n_vocab,
        rope_theta=hparams.rope_freq_base_train, rope_traditional=True,
        tie_word_embeddings=tied, max_position_embeddings=hparams.n_ctx_train,
    )
    model = llama.Model(args)
    gguf_names = _mlx_lm_names(hparams.n_layer, tied)
    by_path = {path: w[name] for path, name in gguf_names.items()}

    def quantize_as_ours(path, module):  # nn.quantize's predicate: our bits per layer
        q = by_path.get(path + ".weight")
        return {"group_size": q.group_size, "bits": q.bits} if isinstance(q, MLXQuantized) \
            else False

    nn.quantize(model, class_predicate=quantize_as_ours)
    params = []
    for path, value in by_path.items():
        if isinstance(value, MLXQuantized):
            prefix = path.removesuffix(".weight")
            params += [(path, value.w_q), (prefix + ".scales", value.scales),
                       (prefix + ".biases", value.biases)]
        else:
            params.append((path, value.astype(mx.float32)))
    model.load_weights(params, strict=True)
    mx.eval(model.parameters())
    return model
# --8<-- [end:mlx_lm_model]


def _mlx_lm_names(n_layer: int, tied: bool) -> dict[str, str]:
    """mlx-lm parameter path -> GGUF tensor name."""
    names = {"model.embed_tokens.weight": "token_embd.weight",
             "model.norm.weight": "output_norm.weight"}
    if not tied:
        names["lm_head.weight"] = "output.weight"
    per_layer = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
                 "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
                 "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
                 "mlp.down_proj": "ffn_down", "input_layernorm": "attn_norm",
                 "post_attention_layernorm": "ffn_norm"}
    for il in range(n_layer):
        for ours, gguf in per_layer.items():
            names[f"model.layers.{il}.{ours}.weight"] = f"blk.{il}.{gguf}.weight"
    return names


class MLXLMRunner:
    """Times mlx-lm on the three tests: its model, its KV cache, its ``generate_step``.

    Args:
        model: from :func:`mlx_lm_model`.
    """

    def __init__(self, model: nn.Module):
        self.model = model
        self.last_tokens: list[int] = []

    def pp(self, tokens: np.ndarray) -> float:
        """Seconds of mlx-lm's prompt processing into a fresh cache.

        ``generate_step(max_tokens=0)`` is mlx-lm's prefill: the prompt but its last token
        (cache only: the lm_head is never evaluated for those rows), then the last token with
        logits and its greedy token, evaluated.
        """
        import mlx.core as mx
        from mlx_lm.generate import generate_step, generation_stream
        from mlx_lm.models.cache import make_prompt_cache

        cache = make_prompt_cache(self.model)
        prompt = mx.array(tokens)
        t0 = time.perf_counter()
        for _ in generate_step(prompt, self.model, max_tokens=0, prompt_cache=cache):
            pass
        mx.synchronize(generation_stream)
        return time.perf_counter() - t0

    def tg(self, first_token: int, n_gen: int) -> float:
        """Seconds of ``n_gen`` one-token forwards from a fresh cache, greedy.

        ``generate_step`` with a one-token prompt and ``max_tokens = n_gen - 1`` runs
        ``n_gen`` forwards (the prompt's, then one per token yielded; its next step is
        launched before a token is yielded); the last is waited for.
        """
        import mlx.core as mx
        from mlx_lm.generate import generate_step, generation_stream
        from mlx_lm.models.cache import make_prompt_cache

        cache = make_prompt_cache(self.model)
        prompt = mx.array([int(first_token)], dtype=mx.int32)
        t0 = time.perf_counter()
        out = [int(t) for t, _ in generate_step(prompt, self.model, max_tokens=n_gen - 1,
                                                prompt_cache=cache)]
        mx.synchronize(generation_stream)  # the last forward was launched, not waited for
        seconds = time.perf_counter() - t0
        self.last_tokens = out
        return seconds

    def parallel_context(self, n_seq: int, n_prompt: int, n_steps: int) -> None:
        """Nothing to build: mlx-lm's cache is made per run (see :meth:`pl`)."""
        return None

    def pl(self, ctx: None, prompts: np.ndarray, n_steps: int) -> float:
        """Seconds of ``n_steps`` batched steps (batch ``n_seq``), after the prompts.

        The model is called on ``(n_seq, 1)`` tokens with mlx-lm's cache, and the greedy
        tokens are taken on the device; as ``generate_step``, the next step is launched
        (``mx.async_eval``) before the previous tokens are read back.
        """
        import mlx.core as mx
        from mlx_lm.models.cache import make_prompt_cache

        cache = make_prompt_cache(self.model)
        logits = self.model(mx.array(prompts), cache=cache)  # (n_seq, n_prompt, n_vocab)
        y = mx.argmax(logits[:, -1, :], axis=-1)  # (n_seq,)
        mx.eval(y)
        t0 = time.perf_counter()
        for _ in range(n_steps):
            y_next = mx.argmax(self.model(y[:, None], cache=cache)[:, -1, :], axis=-1)
            mx.async_eval(y_next)
            y.tolist()
            y = y_next
        y.tolist()
        return time.perf_counter() - t0


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
    """A runner with the labels of its rows."""

    name: str
    runner: object
    dtype: str
    size: int = 0
    peer: bool = False
    contexts: dict = field(default_factory=dict)


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


# --8<-- [start:run_bench]
def run_bench(info: ModelInfo, hparams: LlamaHParams, backends: list[Backend], n_prompt: int,
              n_gen: int, repetitions: int, parallel: tuple[int, ...] = (),
              pl_prompt: int = 16, pl_gen: int = 32,
              log: Callable[[BenchRow], None] | None = None) -> list[BenchRow]:
    """The ``pp``, ``tg`` and ``pl`` rows of every backend, runs alternating.

    Args:
        info: the model's labels (:func:`model_info`).
        hparams: its hyperparameters.
        backends: the runners (ours first, the peer last).
        n_prompt: ``pp`` size (0: skip).
        n_gen: ``tg`` size (0: skip).
        repetitions: timed runs per test and backend.
        parallel: the ``pl`` sequence counts.
        pl_prompt: prompt tokens per sequence before the ``pl`` steps.
        pl_gen: timed steps of a ``pl`` run.
        log: called with each finished row (e.g. to print it at once).

    Returns:
        The rows, test by test, backend by backend.

    Examples:
        >>> from reference.testing import tiny_hparams, random_weights
        >>> from reference.context import Context
        >>> hp = tiny_hparams(n_layer=1)
        >>> w = random_weights(hp)
        >>> b = [Backend("reference", ContextRunner(Context, hp, w, 8, 8), "f32", 0)]
        >>> rows = run_bench(model_info("m", w), hp, b, 8, 4, 2, parallel=(2,), pl_gen=3)
        >>> [(r.test, r.n_tokens, len(r.seconds)) for r in rows]
        [('pp8', 8, 2), ('tg4', 4, 2), ('pl2', 6, 2)]
    """
    log = log or (lambda row: None)
    rows: list[BenchRow] = []

    def add(test, n_tokens, seconds):
        for row in _rows(info, backends, test, n_tokens, seconds):
            rows.append(row)
            log(row)

    if n_prompt > 0:
        tokens = random_tokens(n_prompt, hparams.n_vocab)  # (n_prompt,)
        add(f"pp{n_prompt}", n_prompt,
            alternate(backends, lambda b: b.runner.pp(tokens), repetitions))
    if n_gen > 0:
        first = int(random_tokens(1, hparams.n_vocab)[0])
        add(f"tg{n_gen}", n_gen,
            alternate(backends, lambda b: b.runner.tg(first, n_gen), repetitions))
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
# Profile: where the accelerated forward spends its time
# ---------------------------------------------------------------------------------------------


def _profile_targets() -> dict[str, Callable]:
    """The functions to time: every public op of :mod:`accelerated.ops`, the quantized matmul
    and dequantization of :mod:`accelerated.quants`, the model's ``linear`` (a matmul with a
    weight: quantized, dense or pre-transposed) and its in-graph attention and RoPE."""
    targets = {name: getattr(accelerated_ops, name) for name in accelerated_ops.__all__
               if callable(getattr(accelerated_ops, name))}
    for name in ("quantized_matmul", "dequantize_mlx"):
        if hasattr(quants, name):
            targets[name] = getattr(quants, name)
    if hasattr(accelerated_llama, "linear"):  # every matmul with a weight, in any form
        targets["linear (matmul)"] = accelerated_llama.linear
    # the graph's own attention and RoPE (no host-side checks, so a traced graph can call them)
    for name in ("attn_grouped", "rope_in_graph"):
        if hasattr(accelerated_llama, name):
            targets[name] = getattr(accelerated_llama, name)
    return targets


# --8<-- [start:profile_ops]
@contextmanager
def profile_ops(stats: dict[str, list[float]]) -> Iterator[None]:
    """Time every accelerated op while inside: ``stats[op] = [calls, seconds]``.

    Each target (:func:`_profile_targets`) is replaced, in every ``accelerated.*`` module
    that holds it, by a wrapper that first evaluates the op's pending inputs (their time
    goes to ``"(inputs: unwrapped work)"``: embedding rows, cache writes, reshapes), then
    calls the op and ``mx.eval``'s its result. An op called inside another (``soft_max_ext``
    inside ``build_attn_mha``) counts in the outer one. ``mx.compile`` is disabled inside
    (a compiled function then runs op by op, through the wrappers). The originals are put
    back on exit. Evaluating op by op removes MLX's overlap and fusion across ops: the shares
    say where the work is, the sum is slower than a normal run.
    """
    import os

    import mlx.core as mx

    targets = _profile_targets()
    originals = {id(f): name for name, f in targets.items()}
    depth = [0]

    def arrays(values):
        return [v for v in values if isinstance(v, mx.array)]

    def wrap(name, fn):
        def timed(*args, **kwargs):
            if depth[0]:
                return fn(*args, **kwargs)
            t0 = time.perf_counter()
            mx.eval(arrays(args) + arrays(kwargs.values()))
            t1 = time.perf_counter()
            depth[0] += 1
            try:
                out = fn(*args, **kwargs)
                mx.eval(out)
            finally:
                depth[0] -= 1
            t2 = time.perf_counter()
            for key, dt in (("(inputs: unwrapped work)", t1 - t0), (name, t2 - t1)):
                entry = stats.setdefault(key, [0, 0.0])
                entry[0] += key == name
                entry[1] += dt
            return out
        return timed

    patched = []
    for module in [m for n, m in list(sys.modules.items()) if n.startswith("accelerated")]:
        for attr, value in list(vars(module).items()):
            name = originals.get(id(value))
            if name is not None and callable(value):
                patched.append((module, attr, value))
                setattr(module, attr, wrap(name, value))
    mx.disable_compile()
    try:
        yield
    finally:
        for module, attr, value in patched:
            setattr(module, attr, value)
        if not os.environ.get("MLX_DISABLE_COMPILE"):
            mx.enable_compile()
# --8<-- [end:profile_ops]


def profile_table(stats: dict[str, list[float]], total: float, title: str) -> str:
    """A Markdown table ``op | calls | ms | share`` of :func:`profile_ops`' stats.

    The row ``(outside the ops)`` is the rest of the measured ``total``: host bookkeeping
    (batch validation, slot search, masks), graph building and the logits' copy.

    Examples:
        >>> print(profile_table({"mul_mat": [2, 0.003]}, 0.004, "tg"))
        | tg: op | calls | ms | share |
        |---|---:|---:|---:|
        | mul_mat | 2 | 3.00 | 75.0 % |
        | (outside the ops) |  | 1.00 | 25.0 % |
        | total |  | 4.00 | 100.0 % |
    """
    lines = [f"| {title}: op | calls | ms | share |", "|---|---:|---:|---:|"]
    rest = total - sum(s for _, s in stats.values())
    for name, (calls, s) in sorted(stats.items(), key=lambda kv: -kv[1][1]):
        lines.append(f"| {name} | {calls or ''} | {1e3 * s:.2f} | {100 * s / total:.1f} % |")
    lines.append(f"| (outside the ops) |  | {1e3 * rest:.2f} | {100 * rest / total:.1f} % |")
    lines.append(f"| total |  | {1e3 * total:.2f} | 100.0 % |")
    return "\n".join(lines)


def run_profile(runner: ContextRunner, tokens: np.ndarray, n_gen: int) -> str:
    """Profile one ``pp`` run and ``n_gen`` tg steps (after a warm-up of each)."""
    runner.pp(tokens)
    runner.tg(int(tokens[0]), min(n_gen, 2))
    tables = []
    for title, run in ((f"pp{len(tokens)}", lambda: runner.pp(tokens)),
                       (f"tg{n_gen}", lambda: runner.tg(int(tokens[0]), n_gen))):
        stats: dict[str, list[float]] = {}
        with profile_ops(stats):
            total = run()
        tables.append(profile_table(stats, total, title))
    return "\n\n".join(tables)


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
    ax.set_title("pp and tg (label: ours / mlx-lm)", fontsize=10)
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
    bench.add_argument("--model", "-m", help="a GGUF file or a HF directory (default: SmolLM2)")
    bench.add_argument("-p", "--n-prompt", type=int, default=512, help="pp test size (0: skip)")
    bench.add_argument("-n", "--n-gen", type=int, default=128, help="tg test size (0: skip)")
    bench.add_argument("-r", "--repetitions", type=int, default=5, help="timed runs per test")
    bench.add_argument("--backend", default="accelerated",
                       help="comma-separated: reference, accelerated (default: accelerated)")
    bench.add_argument("--vs", help="a peer to run alternately on the same weights: mlx-lm")
    bench.add_argument("--matmul", choices=("dense", "quantized"),
                       help="matmul weights of the twin and the peer (default: quantized, "
                            "4-bit groups in both)")
    bench.add_argument("--parallel", default="",
                       help="comma-separated sequence counts for the pl test, e.g. 1,2,4,8")
    bench.add_argument("--pl-prompt", type=int, default=16, help="pl prompt per sequence")
    bench.add_argument("--pl-gen", type=int, default=32, help="pl timed steps")
    bench.add_argument("-o", "--output", choices=("md", "json", "csv"), default="md")
    bench.add_argument("--plot", help="write a PNG here (and the Markdown table as .md)")
    bench.add_argument("--profile", action="store_true",
                       help="where the accelerated forward spends its time")
    bench.set_defaults(func=cmd_bench)


def cmd_bench(args: argparse.Namespace) -> int:
    """Run the tests on every backend asked for; print the table (and plot, profile)."""
    path, backends_asked, parallel = _check_args(args)
    try:
        hparams, weights, backends, info = _build(path, backends_asked, args.vs,
                                                  args.n_prompt, args.n_gen, args.matmul)
    except PeerError as e:
        raise CLIError(str(e)) from e
    streaming = args.output == "md" and not args.plot
    if streaming:
        print(HEADER, flush=True)
    rows = run_bench(info, hparams, backends, args.n_prompt, args.n_gen, args.repetitions,
                     parallel, args.pl_prompt, args.pl_gen,
                     log=(lambda r: print(r.markdown(), flush=True)) if streaming else None)
    if not streaming:
        print(format_rows(rows, args.output))
    if args.plot:
        plot = Path(args.plot)
        plot_rows(rows, plot, title=f"{info.name}: llamaref bench")
        plot.with_suffix(".md").write_text(format_rows(rows, "md") + "\n")
    if args.profile:
        _cmd_profile(args, hparams, weights, backends)
    return 0
# --8<-- [end:command]


def _check_args(args):
    """Validate before loading anything; returns (path, backends, parallel sizes)."""
    if args.repetitions < 1 or args.n_prompt < 0 or args.n_gen < 0:
        raise CLIError("-r must be >= 1, -p and -n must be >= 0")
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
        if importlib.util.find_spec("mlx_lm") is None:
            raise CLIError("--vs mlx-lm needs mlx-lm: pip install 'llamaref[bench]'")
    try:
        parallel = tuple(int(n) for n in args.parallel.split(",") if n.strip())
    except ValueError:
        raise CLIError(f"--parallel {args.parallel!r}: give sequence counts like 1,2,4,8") \
            from None
    if any(n < 1 for n in parallel) or (parallel and (args.pl_prompt < 1 or args.pl_gen < 1)):
        raise CLIError("--parallel counts, --pl-prompt and --pl-gen must be >= 1")
    if args.plot and importlib.util.find_spec("matplotlib") is None:
        raise CLIError("--plot needs matplotlib: pip install 'llamaref[bench]'")
    if args.profile and "accelerated" not in backends:
        raise CLIError("--profile profiles the accelerated backend: add it to --backend")
    path = Path(args.model) if args.model else default_model_path()
    if not path.exists():
        raise CLIError(f"model not found: {path}")
    return path, backends, parallel


def twin_matmul(matmul: str | None) -> str:
    """The matmul form of the twin and the peer: ``matmul``, or ``"quantized"``.

    The comparison that counts is quantized weights in both (Q4_0/Q4_1/Q8_0 as MLX affine
    groups, read by ``mx.quantized_matmul``), whatever the twin's Context picks for itself
    on the device (:func:`accelerated.models.llama.default_matmul`: dense on a CPU).

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


def _build(path: Path, names: list[str], vs: str | None, n_prompt: int, n_gen: int,
           matmul: str | None = None):
    """Load the model and make a runner per backend (and the peer's, last)."""
    hparams, weights = load_model(path)
    if vs is not None:
        check_mlx_lm_model(hparams)  # before building anything
    info = model_info(path.name, weights)
    n_ctx = max(n_prompt, n_gen, 1)
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
    if vs is not None:
        model = mlx_lm_model(hparams, weights, matmul)
        backends.append(Backend(vs, MLXLMRunner(model), _dtype_label(info.dtype,
                                matmul == "dense"), _mlx_lm_size(model), peer=True))
    return hparams, weights, backends, info


def _size(weights: dict) -> int:
    return sum(int(np.asarray(w).nbytes) for w in weights.values())


def _mlx_size(ctx) -> int:
    """Bytes of the twin's prepared weights (every MLX array they hold)."""
    import mlx.core as mx

    total = 0
    for w in getattr(ctx, "mlx_weights", {}).values():
        arrays = [w] if isinstance(w, mx.array) else [v for v in vars(w).values()
                                                      if isinstance(v, mx.array)]
        total += sum(a.nbytes for a in arrays)
    return total


def _mlx_lm_size(model) -> int:
    from mlx.utils import tree_flatten

    return sum(a.nbytes for _, a in tree_flatten(model.parameters()))


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
