"""Where one generated token's time goes, in the MLX Context and in mlx-lm, phase by phase.

Usage::

    python scripts/token_phases.py                 # the tiny Llama, 400 tokens
    python scripts/token_phases.py --model tiny-mamba --tokens 1000
    python scripts/token_phases.py --depth 16000    # 16000 tokens in the cache first

A plain loop (decode one token, take the argmax, read it back: no pipelining, so each phase
is timed alone) on a shipped tiny model, whose forward costs almost nothing: what is left is
the host's work per token. For ours the phases are the Context's ``decode`` and, inside it,
the arrays the host hands the graph (``mx.array`` calls), the compiled graph's call and
``mx.async_eval``; then the argmax read back. For mlx-lm: the model call (building the graph
op by op), ``mx.async_eval``, and the read back. Medians in microseconds, the first quarter
of the tokens left out (warm-up).

Written for the GPU machine (``scripts/nvidia_bench.sh``), where ours took 1.1 ms a token
and mlx-lm 0.35: the phase that grows there is the one to fix.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections import defaultdict

import mlx.core as mx
import numpy as np

import accelerated.context as mlx_context
from llamaref.bench.peers import mlx_lm_model
from llamaref.bench.tiny import tiny_model
from reference.batch import Batch


class _TimedMLX:
    """``mlx.core`` as the Context module sees it, with ``array`` and ``async_eval`` timed."""

    def __init__(self, times: dict):
        self._times = times

    def __getattr__(self, name):
        real = getattr(mx, name)
        if name not in ("array", "async_eval"):
            return real

        def timed(*args, **kwargs):
            t = time.perf_counter()
            out = real(*args, **kwargs)
            self._times[f"  mx.{name}"].append(time.perf_counter() - t)
            return out

        return timed


def ours(name: str, n_tokens: int, depth: int = 0) -> dict:
    """Per-token phase times of the MLX Context after ``depth`` tokens (lists of seconds)."""
    hp, w = tiny_model(name)
    ctx = mlx_context.Context(hp, w, n_ctx=max(512, depth + n_tokens + 1))
    for i in range(0, depth, PREFILL):
        ctx.decode(Batch(token=list(_prompt(depth)[i:i + PREFILL]),
                         pos=list(range(i, min(depth, i + PREFILL)))))
    mx.synchronize()
    times = defaultdict(list)
    graph = ctx.graph

    def timed_graph(key):
        fn = graph(key)

        def call(*args):
            t = time.perf_counter()
            out = fn(*args)
            times["  graph call"].append(time.perf_counter() - t)
            return out

        return call

    ctx.graph = timed_graph
    real_mx, mlx_context.mx = mlx_context.mx, _TimedMLX(times)
    try:
        token = 1
        for i in range(n_tokens):
            t0 = time.perf_counter()
            ctx.decode(Batch(token=[token], pos=[depth + i]))
            t1 = time.perf_counter()
            token = int(mx.argmax(ctx.get_logits_ith_device(-1)).item())
            times["decode"].append(t1 - t0)
            times["argmax, read back"].append(time.perf_counter() - t1)
    finally:
        mlx_context.mx = real_mx
    return times


def mlx_lm(name: str, n_tokens: int, depth: int = 0) -> dict:
    """Per-token phase times of mlx-lm's model on the same weights (lists of seconds)."""
    from mlx_lm.models.cache import make_prompt_cache

    hp, w = tiny_model(name)
    model = mlx_lm_model(hp, w)
    cache = make_prompt_cache(model)
    for i in range(0, depth, PREFILL):
        model(mx.array(_prompt(depth)[i:i + PREFILL])[None], cache=cache)
        mx.eval([c.state for c in cache])
    times = defaultdict(list)
    y = mx.array([[1]])
    for _ in range(n_tokens):
        t0 = time.perf_counter()
        logits = model(y, cache=cache)
        t1 = time.perf_counter()
        token = mx.argmax(logits[:, -1, :], axis=-1)
        mx.async_eval(token)
        t2 = time.perf_counter()
        y = mx.array([[int(token.item())]])
        times["model call"].append(t1 - t0)
        times["async_eval"].append(t2 - t1)
        times["argmax, read back"].append(time.perf_counter() - t2)
    return times


PREFILL = 512  # the prompt's chunk, for both programs


def _prompt(depth: int) -> np.ndarray:
    """The tokens put in the cache before the timed loop (seeded; the same for both)."""
    return np.random.default_rng(0).integers(0, 256, size=depth)


def report(title: str, times: dict, n_tokens: int) -> None:
    """Medians per token (a phase called k times a token: k times its median)."""
    print(title)
    skip = n_tokens // 4
    for phase, values in times.items():
        per_token = len(values) / n_tokens
        kept = values[int(skip * per_token):]
        print(f"  {phase:22s} {statistics.median(kept) * 1e6 * per_token:8.1f} us"
              f"  ({per_token:g} a token)")


def main() -> None:
    """The command line: a shipped tiny model and a token count."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="tiny", help="tiny, tiny-mamba or tiny-mamba2")
    parser.add_argument("--tokens", type=int, default=400)
    parser.add_argument("--depth", type=int, default=0, help="tokens in the cache first")
    args = parser.parse_args()
    print("device:", mx.default_device())
    report("ours (MLX Context)", ours(args.model, args.tokens, args.depth), args.tokens)
    report("mlx-lm", mlx_lm(args.model, args.tokens, args.depth), args.tokens)


if __name__ == "__main__":
    main()
