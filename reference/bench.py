"""``llamaref bench``: prompt processing and generation speed, in the spirit of llama-bench.

Two tests, as llama-bench names them:

- ``pp{n}``: one ubatch of ``n`` prompt tokens into an empty cache; only the last token gets
  logits (``llama_batch_get_one``'s default), so the lm_head runs once.
- ``tg{n}``: ``n`` tokens decoded one at a time into a growing cache, each with logits.

Each test runs ``repetitions`` times after one warm-up; a row reports the median tokens per
second and the spread (fastest and slowest run). Weights are dequantized once before timing
(the dtype column says which dtype the forward computes in), so a row measures the forward,
not the file format. Absolute numbers depend on the machine; compare rows taken in the same
run.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from reference.hparams import LlamaHParams
from reference.models.llama import llama_forward
from reference.models.simple_cache import SimpleKVCache


@dataclass(frozen=True)
class BenchRow:
    """One line of the table: a test on a model, its speed over the repetitions."""

    model: str
    backend: str
    dtype: str
    test: str
    seconds: tuple[float, ...]
    n_tokens: int

    @property
    def tokens_per_second(self) -> float:
        """Median over the repetitions."""
        return self.n_tokens / statistics.median(self.seconds)

    def markdown(self) -> str:
        """The row as a Markdown table line (see :data:`HEADER`)."""
        fastest, slowest = self.n_tokens / min(self.seconds), self.n_tokens / max(self.seconds)
        return (
            f"| {self.model} | {self.backend} | {self.dtype} | {self.test} | "
            f"{self.tokens_per_second:.2f} | {slowest:.2f} – {fastest:.2f} | {len(self.seconds)} |"
        )


HEADER = (
    "| model | backend | dtype | test | t/s (median) | t/s (slowest – fastest) | runs |\n"
    "|-------|---------|-------|------|--------------|-------------------------|------|"
)


def _time(run: Callable[[], object], repetitions: int) -> tuple[float, ...]:
    run()  # warm-up: caches, BLAS threads
    seconds = []
    for _ in range(repetitions):
        t0 = time.perf_counter()
        run()
        seconds.append(time.perf_counter() - t0)
    return tuple(seconds)


# --8<-- [start:bench_pp]
def bench_pp(weights: dict, hparams: LlamaHParams, n_prompt: int, repetitions: int):
    """Seconds of each ``pp{n_prompt}`` run: one ubatch, logits of the last token only.

    Examples:
        >>> from tests.tiny_models import tiny_hparams, random_weights
        >>> hp = tiny_hparams(n_layer=1)
        >>> len(bench_pp(random_weights(hp), hp, n_prompt=8, repetitions=3))
        3
    """
    tokens = np.arange(n_prompt) % hparams.n_vocab  # (n_prompt,)
    pos = np.arange(n_prompt)  # (n_prompt,)
    dtype = weights["token_embd.weight"].dtype

    out_ids = np.array([n_prompt - 1])  # (1,): the last token's logits only

    def run():
        cache = SimpleKVCache(hparams, n_prompt, dtype)
        llama_forward(weights, hparams, tokens, pos, cache.init_batch(pos), out_ids)

    return _time(run, repetitions)
# --8<-- [end:bench_pp]


# --8<-- [start:bench_tg]
def bench_tg(weights: dict, hparams: LlamaHParams, n_gen: int, repetitions: int):
    """Seconds of each ``tg{n_gen}`` run: ``n_gen`` one-token ubatches into a growing cache.

    Examples:
        >>> from tests.tiny_models import tiny_hparams, random_weights
        >>> hp = tiny_hparams(n_layer=1)
        >>> len(bench_tg(random_weights(hp), hp, n_gen=4, repetitions=2))
        2
    """
    dtype = weights["token_embd.weight"].dtype

    def run():
        cache = SimpleKVCache(hparams, n_gen, dtype)
        for i in range(n_gen):
            pos = np.array([i])  # (1,)
            token = np.array([i % hparams.n_vocab])  # (1,)
            llama_forward(weights, hparams, token, pos, cache.init_batch(pos))

    return _time(run, repetitions)
# --8<-- [end:bench_tg]


def dense_weights(weights: dict, dtype=np.float32) -> dict:
    """Every weight as a dense array of ``dtype`` (quantized ones dequantized once)."""
    return {
        name: (w.dequantize() if hasattr(w, "dequantize") else np.asarray(w)).astype(dtype)
        for name, w in weights.items()
    }


def run_bench(
    model_name: str, weights: dict, hparams: LlamaHParams, n_prompt: int, n_gen: int,
    repetitions: int,
) -> list[BenchRow]:
    """The ``pp`` and ``tg`` rows of one model on the reference backend (float32)."""
    weights = dense_weights(weights)
    rows = []
    if n_prompt > 0:
        seconds = bench_pp(weights, hparams, n_prompt, repetitions)
        rows.append(BenchRow(model_name, "reference", "f32", f"pp{n_prompt}", seconds, n_prompt))
    if n_gen > 0:
        seconds = bench_tg(weights, hparams, n_gen, repetitions)
        rows.append(BenchRow(model_name, "reference", "f32", f"tg{n_gen}", seconds, n_gen))
    return rows


# --8<-- [start:command]
def add_bench_command(subparsers) -> None:
    """Register ``llamaref bench`` on the CLI's subparsers (the CLI calls this)."""
    bench = subparsers.add_parser("bench", help="prompt processing (pp) and generation (tg) speed")
    bench.add_argument("--model", "-m", help="a GGUF file or a HF directory (default: SmolLM2)")
    bench.add_argument("-p", "--n-prompt", type=int, default=128, help="pp test size (0: skip)")
    bench.add_argument("-n", "--n-gen", type=int, default=32, help="tg test size (0: skip)")
    bench.add_argument("-r", "--repetitions", type=int, default=5, help="timed runs per test")
    bench.set_defaults(func=cmd_bench)


def cmd_bench(args: argparse.Namespace) -> int:
    """Time prompt processing and generation on the reference backend; print a table."""
    from reference.cli import CLIError, default_model_path
    from reference.model import load_model

    path = Path(args.model) if args.model else default_model_path()
    if not path.exists():
        raise CLIError(f"model not found: {path}")
    if args.repetitions < 1 or args.n_prompt < 0 or args.n_gen < 0:
        raise CLIError("-r must be >= 1, -p and -n must be >= 0")
    hparams, weights = load_model(path)
    rows = run_bench(path.name, weights, hparams, args.n_prompt, args.n_gen, args.repetitions)
    print(HEADER)
    for row in rows:
        print(row.markdown(), flush=True)
    return 0
# --8<-- [end:command]
