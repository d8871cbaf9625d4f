"""The MLX Context's generation, its caches written in place, against the launch before.

Usage::

    python scripts/cache_writes_ab.py                     # depths 0 1000 4000 8000 16000
    python scripts/cache_writes_ab.py --depths 4000 --runs 9

``Context._launch`` hands ``mx.async_eval`` the logits and the last layer's attention
output; before 2026-11-26 it handed it the logits and the written caches, which MLX then held
until the whole step had run, so the next step's writes, launched behind it, copied each
cache tensor (see *Writing the caches in place* in docs/mlx.md). This runs both in one
process on the shipped tiny Llama in a 16384-cell cache (the bench's ``tg64`` loop, greedy,
pipelined), alternating run by run with mlx-lm beside them, and prints per depth the median
milliseconds per token of each, and the largest memory a launch allocated (MLX's peak over
its active memory around ``process_ubatch``): a copied cache tensor shows there as 2 MiB or
more.
"""

from __future__ import annotations

import argparse
import statistics

import mlx.core as mx

import accelerated.context as mlx_context
from llamaref.bench import ContextRunner, random_tokens
from llamaref.bench.peers import MLXLMRunner, mlx_lm_model
from llamaref.bench.tiny import tiny_model


def _launch_before(self, logits, caches_read) -> None:
    """The launch before: the logits and the written caches (a plain KV cache's)."""
    mx.async_eval(logits, *self.memory.k_l, *self.memory.v_l)


def main() -> None:
    """The command line: depths and runs."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--depths", type=int, nargs="+", default=[0, 1000, 4000, 8000, 16000])
    parser.add_argument("--runs", type=int, default=7)
    parser.add_argument("--tokens", type=int, default=64)
    args = parser.parse_args()
    hp, w = tiny_model("tiny")
    now = mlx_context.Context._launch
    peaks: list[int] = []
    process_ubatch = mlx_context.Context.process_ubatch

    def measured(self, mctx):
        before = mx.get_active_memory()
        mx.reset_peak_memory()
        out = process_ubatch(self, mctx)
        peaks.append(mx.get_peak_memory() - before)
        return out

    mlx_context.Context.process_ubatch = measured
    print("| depth | now (ms) | before (ms) | mlx-lm (ms) | now / before "
          "| now / mlx-lm | largest launch, now / before (KiB) |")
    print("|---:|---:|---:|---:|---:|---:|---:|")
    for depth in args.depths:
        ours = ContextRunner(mlx_context.Context, hp, w, n_ctx=16384, n_batch=512)
        peer = MLXLMRunner(mlx_lm_model(hp, w))
        if depth:
            tokens = random_tokens(depth, hp.n_vocab)
            ours.set_depth(tokens)
            peer.set_depth(tokens)
        ours.tg(1, 16)
        peer.tg(1, 16)
        times = {"now": [], "before": [], "mlx-lm": []}
        peak = {"now": 0, "before": 0}
        for _ in range(args.runs):
            for name, launch in (("now", now), ("before", _launch_before)):
                mlx_context.Context._launch = launch
                peaks.clear()
                times[name].append(1e3 * ours.tg(1, args.tokens) / args.tokens)
                peak[name] = max(peak[name], *peaks)
            times["mlx-lm"].append(1e3 * peer.tg(1, args.tokens) / args.tokens)
        mlx_context.Context._launch = now
        med = {name: statistics.median(v) for name, v in times.items()}
        print(f"| {depth} | {med['now']:.2f} | {med['before']:.2f} | {med['mlx-lm']:.2f} "
              f"| {med['now'] / med['before']:.2f} | {med['now'] / med['mlx-lm']:.2f} "
              f"| {peak['now'] >> 10} / {peak['before'] >> 10} |", flush=True)


if __name__ == "__main__":
    main()
