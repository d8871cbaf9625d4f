"""The MLX Context's generation with prefix masks on and off, mlx-lm beside them.

Usage::

    python scripts/prefix_mask_ab.py                      # depths 0 1000 4000 8000 16000
    python scripts/prefix_mask_ab.py --depths 16000 --runs 9

A one-token ubatch whose mask is the first u cells (``visible_prefix``: a generation step in
one conversation) hands the graph two integers, the token's cache row and u, and the graph
makes the rows and the mask from them (``prefix_inputs_device``); with
``Context.prefix_masks = False`` it hands it the positions of every cell in view, their
membership and the token's rows, as before 2026-11-26. This runs both in one process on the
shipped tiny Llama in a 16384-cell cache (the bench's ``tg64`` loop, greedy, pipelined),
alternating run by run with mlx-lm beside them, and prints per depth the median
milliseconds per token of each. Which of the two forms runs first changes from run to run:
a run right after mlx-lm's was slower (8 % at depth 8000 in two runs where the prefix form
always went first).
"""

from __future__ import annotations

import argparse
import statistics

import accelerated.context as mlx_context
from llamaref.bench import ContextRunner, random_tokens
from llamaref.bench.peers import MLXLMRunner, mlx_lm_model
from llamaref.bench.tiny import tiny_model


def tiny_pair(hp, w, depth: int) -> tuple[ContextRunner, MLXLMRunner]:
    """The MLX Context (a 16384-cell cache) and mlx-lm on the same weights, the same
    ``depth`` random tokens in both caches (not timed)."""
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
    args = parser.parse_args()
    hp, w = tiny_model("tiny")
    print("| depth | prefix (ms) | cells (ms) | mlx-lm (ms) | prefix / cells "
          "| prefix / mlx-lm | cells / mlx-lm |")
    print("|---:|---:|---:|---:|---:|---:|---:|")
    for depth in args.depths:
        ours, peer = tiny_pair(hp, w, depth)
        for form in (True, False):  # both graphs traced before the timed runs
            ours.ctx.prefix_masks = form
            ours.tg(1, 16)
        peer.tg(1, 16)
        times: dict[str, list[float]] = {"prefix": [], "cells": [], "mlx-lm": []}
        for run in range(args.runs):
            forms = (("prefix", True), ("cells", False))
            for name, form in forms if run % 2 == 0 else forms[::-1]:  # either goes first
                ours.ctx.prefix_masks = form
                times[name].append(1e3 * ours.tg(1, args.tokens) / args.tokens)
            times["mlx-lm"].append(1e3 * peer.tg(1, args.tokens) / args.tokens)
        med = {name: statistics.median(v) for name, v in times.items()}
        print(f"| {depth} | {med['prefix']:.2f} | {med['cells']:.2f} | {med['mlx-lm']:.2f} "
              f"| {med['prefix'] / med['cells']:.2f} | {med['prefix'] / med['mlx-lm']:.2f} "
              f"| {med['cells'] / med['mlx-lm']:.2f} |", flush=True)


if __name__ == "__main__":
    main()
