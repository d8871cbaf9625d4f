"""What the host spends per generated token in each bookkeeping function, in the bench's loop.

Usage::

    python scripts/step_functions.py                        # the tiny Mamba, depth 0
    python scripts/step_functions.py --model tiny --depth 1000

Runs ``llamaref bench``'s ``tg`` (the pipelined [`Generator`][reference.tools.generate.Generator]
loop with the greedy device sampler) on a shipped tiny model with the MLX Context, five
times 1000 tokens, and times every call of the functions below with ``time.perf_counter``
around it (which adds about a microsecond to each). Prints each run's milliseconds per
token, then the median microseconds per call over the last run: ``decode`` holds the rest,
``process_ubatch`` is the graph's inputs, call and launch (``mx.async_eval``).

The medians are for comparing versions of the code on the same machine, run after run;
the timing wrappers make the loop slower than the bench's.
"""

from __future__ import annotations

import argparse
import functools
import statistics
import time
from collections import defaultdict

import accelerated.context as mlx_context
import reference.batch as batch_module
import reference.context as ref_context
import reference.tools.generate as generate_module
from llamaref.bench import ContextRunner, random_tokens
from llamaref.bench.tiny import tiny_model


def _wrap(owner, name: str, label: str, times: dict) -> None:
    """Replace ``owner.name`` by a wrapper that appends each call's seconds to ``times``."""
    f = getattr(owner, name)

    @functools.wraps(f)
    def timed(*args, **kwargs):
        t = time.perf_counter()
        out = f(*args, **kwargs)
        times[label].append(time.perf_counter() - t)
        return out

    setattr(owner, name, timed)


def main() -> None:
    """The command line: a shipped tiny model and a depth."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="tiny-mamba", help="tiny, tiny-mamba or tiny-mamba2")
    parser.add_argument("--depth", type=int, default=0, help="tokens in the cache first")
    parser.add_argument("--tokens", type=int, default=1000)
    parser.add_argument("-c", "--n-ctx", type=int, default=0,
                        help="the cache's cells (default: depth + tokens + 64)")
    args = parser.parse_args()

    hp, w = tiny_model(args.model)
    n_ctx = args.n_ctx or args.depth + args.tokens + 64
    runner = ContextRunner(mlx_context.Context, hp, w, n_ctx=n_ctx, n_batch=512)
    times: dict[str, list[float]] = defaultdict(list)
    memory = type(runner.ctx.memory)
    for owner, name, label in (
        (batch_module.BatchAllocr, "__init__", "BatchAllocr"),
        (memory, "init_batch", "memory.init_batch"),
        (memory, "backup", "memory.backup"),
        (ref_context.Context, "decode", "decode"),
        (ref_context.Context, "memory_update", "memory_update"),
        (mlx_context.Context, "process_ubatch", "process_ubatch"),
        (mlx_context.Context, "output_reserve", "output_reserve"),
        (mlx_context.Context, "output_set", "output_set"),
        (mlx_context.Context, "get_logits_ith_device", "get_logits_ith_device"),
        (generate_module.Generator, "_sample_async", "Generator._sample_async"),
    ):
        if hasattr(owner, name):
            _wrap(owner, name, label, times)
    if args.depth:
        runner.set_depth(random_tokens(args.depth, hp.n_vocab))
    runner.tg(1, 50)  # warm-up: the graphs are compiled
    for _ in range(5):
        times.clear()
        seconds = runner.tg(1, args.tokens)
        print(f"{1e3 * seconds / args.tokens:.3f} ms/token", end="  ")
    print()
    for label, values in sorted(times.items(), key=lambda kv: -statistics.median(kv[1])):
        median = 1e6 * statistics.median(values)
        print(f"{label:26s} {len(values):5d} calls  median {median:7.1f} µs")


if __name__ == "__main__":
    main()
