"""The MLX Context's generation, its caches written in place, against the launch before.

Usage::

    python scripts/cache_writes_ab.py                     # depths 0 1000 4000 8000 16000
    python scripts/cache_writes_ab.py --depths 4000 --runs 9
    python scripts/cache_writes_ab.py --depths 16000 --waiting    # and the waiting launch

``Context._launch`` hands ``mx.async_eval`` the logits and the last layer's attention
output; before 2026-11-26 it handed it the logits and the written caches, which MLX then held
until the whole step had run, so the next step's writes, launched behind it, copied each
cache tensor (see *Writing the caches in place* in docs/mlx.md). This runs both in one
process on the shipped tiny Llama in a 16384-cell cache (the bench's ``tg64`` loop, greedy,
pipelined), alternating run by run with mlx-lm beside them, and prints per depth the median
milliseconds per token of each, and the largest memory a launch allocated (MLX's peak over
its active memory around ``process_ubatch``): a copied cache tensor shows there as 2 MiB or
more. ``--waiting`` adds the launch that was tried and not kept: it waits, before each
launch, for the previous step's ``kqv_out`` (launched on its own, with the caches), then
launches the logits.
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


def _launch_waiting(self, logits, caches_read) -> None:
    """The waiting launch: the previous step's reads of the caches over first."""
    previous = getattr(self, "_previous_read", None)
    if previous is not None:
        mx.eval(previous)  # the previous step's kqv_out: its reads of the caches are done
    mx.async_eval(caches_read, *self.memory.k_l, *self.memory.v_l)
    mx.async_eval(logits)
    self._previous_read = caches_read


def tiny_pair(hp, w, depth: int) -> tuple[ContextRunner, MLXLMRunner]:
    """The MLX Context (a 16384-cell cache) and mlx-lm on the same weights, the same
    ``depth`` random tokens in both caches (not timed); ``scripts/prefix_mask_ab.py`` uses
    it too."""
    ours = ContextRunner(mlx_context.Context, hp, w, n_ctx=16384, n_batch=512)
    peer = MLXLMRunner(mlx_lm_model(hp, w))
    if depth:
        tokens = random_tokens(depth, hp.n_vocab)
        ours.set_depth(tokens)
        peer.set_depth(tokens)
    return ours, peer


def main() -> None:
    """The command line: depths and runs."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--depths", type=int, nargs="+", default=[0, 1000, 4000, 8000, 16000])
    parser.add_argument("--runs", type=int, default=7)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--waiting", action="store_true", help="run the waiting launch too")
    args = parser.parse_args()
    now = mlx_context.Context._launch
    launches = [("now", now), ("before", _launch_before)]
    if args.waiting:
        launches.append(("waiting", _launch_waiting))
    hp, w = tiny_model("tiny")
    peaks: list[int] = []
    process_ubatch = mlx_context.Context.process_ubatch

    def measured(self, mctx):
        before = mx.get_active_memory()
        mx.reset_peak_memory()
        out = process_ubatch(self, mctx)
        peaks.append(mx.get_peak_memory() - before)
        return out

    mlx_context.Context.process_ubatch = measured
    extra = " waiting (ms) |" if args.waiting else ""
    print("| depth | now (ms) | before (ms) | mlx-lm (ms) | now / before "
          "| now / mlx-lm | largest launch, now / before (KiB) |" + extra)
    print("|---:|---:|---:|---:|---:|---:|---:|" + ("---:|" if args.waiting else ""))
    for depth in args.depths:
        ours, peer = tiny_pair(hp, w, depth)
        ours.tg(1, 16)
        peer.tg(1, 16)
        times = {name: [] for name, _ in launches} | {"mlx-lm": []}
        peak = {name: 0 for name, _ in launches}
        for _ in range(args.runs):
            for name, launch in launches:
                mlx_context.Context._launch = launch
                peaks.clear()
                times[name].append(1e3 * ours.tg(1, args.tokens) / args.tokens)
                peak[name] = max(peak[name], *peaks)
            times["mlx-lm"].append(1e3 * peer.tg(1, args.tokens) / args.tokens)
        mlx_context.Context._launch = now
        med = {name: statistics.median(v) for name, v in times.items()}
        print(f"| {depth} | {med['now']:.2f} | {med['before']:.2f} | {med['mlx-lm']:.2f} "
              f"| {med['now'] / med['before']:.2f} | {med['now'] / med['mlx-lm']:.2f} "
              f"| {peak['now'] >> 10} / {peak['before'] >> 10} |"
              + (f" {med['waiting']:.2f} |" if args.waiting else ""), flush=True)


if __name__ == "__main__":
    main()
