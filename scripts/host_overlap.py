"""How much host work per token hides behind the forward, in the MLX Context and in mlx-lm.

Usage::

    python scripts/host_overlap.py                  # depth 16000
    python scripts/host_overlap.py --depth 4000 --spins 0 250 500 1000

Adds a busy wait of ``X`` µs to each generated token's host work (at the start of the
Context's ``decode``; at the start of mlx-lm's model call) and prints the bench's ``tg64``
milliseconds per token (median of five runs, the two programs alternating) for each ``X``,
on the shipped tiny Llama in a 16384-cell cache. Where a token stays as long as without the
wait, that much host work runs while the device works on the previous step; where it grows
by ``X``, the host's work adds to the forward.
"""

from __future__ import annotations

import argparse
import statistics
import time

import accelerated.context as mlx_context
from llamaref.bench import ContextRunner, random_tokens
from llamaref.bench.peers import MLXLMRunner, mlx_lm_model
from llamaref.bench.tiny import tiny_model

SPIN_US = [0]  # the busy wait now added to each token, in µs


def _spin() -> None:
    end = time.perf_counter() + SPIN_US[0] * 1e-6
    while time.perf_counter() < end:
        pass


def main() -> None:
    """The command line: a depth and the waits to add."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--depth", type=int, default=16000)
    parser.add_argument("--spins", type=int, nargs="+", default=[0, 500, 1000, 2000, 0])
    parser.add_argument("--tokens", type=int, default=64)
    args = parser.parse_args()
    hp, w = tiny_model("tiny")

    decode = mlx_context.Context.decode

    def spun_decode(self, batch):
        _spin()
        return decode(self, batch)

    mlx_context.Context.decode = spun_decode
    model = mlx_lm_model(hp, w)
    call = type(model).__call__

    def spun_call(self, *a, **k):
        _spin()
        return call(self, *a, **k)

    type(model).__call__ = spun_call
    ours = ContextRunner(mlx_context.Context, hp, w, n_ctx=16384, n_batch=512)
    peer = MLXLMRunner(model)
    if args.depth:
        tokens = random_tokens(args.depth, hp.n_vocab)
        ours.set_depth(tokens)
        peer.set_depth(tokens)
    ours.tg(1, 16)
    peer.tg(1, 16)
    print("| added host work (µs) | MLX Context (ms / token) | mlx-lm (ms / token) |")
    print("|---:|---:|---:|")
    for spin in args.spins:
        SPIN_US[0] = spin
        a, b = [], []
        for _ in range(5):
            a.append(1e3 * ours.tg(1, args.tokens) / args.tokens)
            b.append(1e3 * peer.tg(1, args.tokens) / args.tokens)
        print(f"| {spin} | {statistics.median(a):.2f} | {statistics.median(b):.2f} |", flush=True)


if __name__ == "__main__":
    main()
