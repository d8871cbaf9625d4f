"""Per-token host cost of a Context against the depth of its KV cache (issue 12).

On a tiny model the forward costs little, so what a generated token costs is mostly the
bookkeeping around it: batch validation, the slot search, the KQ mask, the rollback of a
failed decode. This probe fills the cache of a Context to a depth and times greedy
generation there, then times one failed decode (return 1) in a full cache.

The cache is filled through its cells (positions ``0 .. depth - 1`` of sequence 0, the
search head after them) rather than by decoding ``depth`` tokens: what a decode at that
depth costs does not depend on how the cells got there, and a prefill of 16k tokens with
the reference forward would dominate the run. The K/V rows stay zero.

Usage::

    python scripts/overhead_probe.py                    # both Contexts, n_ctx 8192 and 16384
    python scripts/overhead_probe.py --ctx reference --n-ctx 16384 --profile 8000

Importable: `probe` takes a Context factory and returns the table as a dict.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import time
from collections.abc import Callable, Sequence

import numpy as np

from reference.batch import Batch, BatchAllocr
from reference.testing import random_weights, tiny_hparams

DEPTHS = (0, 1000, 4000, 8000, 16000)


def tiny_llama(n_ctx_train: int = 32768):
    """The probe's model: a 2-layer tiny Llama, n_embd 64 (hyperparameters, weights)."""
    hp = tiny_hparams(n_layer=2, n_embd=64, n_head=4, n_head_kv=2, n_ff=128, n_vocab=256,
                      n_ctx_train=n_ctx_train)
    return hp, random_weights(hp, seed=0)


def context_factory(kind: str, n_ctx: int) -> Callable[[], object]:
    """A factory of fresh Contexts of ``kind`` (``"reference"`` or ``"mlx"``) on the tiny model."""
    hp, w = tiny_llama()
    if kind == "reference":
        from reference.context import Context
    else:
        from accelerated.context import Context
    return lambda: Context(hp, w, n_ctx=n_ctx, n_batch=512, n_ubatch=512)


def fill(ctx, depth: int) -> None:
    """Put positions ``0 .. depth - 1`` of sequence 0 in cells ``0 .. depth - 1``."""
    mem = ctx.memory
    mem.clear(data=False)
    cells = mem.v_cells[0]
    for i in range(depth):
        cells.pos_set(i, i)
        cells.seq_add(i, 0)
    mem.v_heads[0] = depth


def _generate(ctx, n: int, clock: Callable[[], float] = time.perf_counter) -> list[float]:
    """Greedy generation of ``n`` tokens; the time of each (decode + reading its logits)."""
    times = []
    token = 1
    for _ in range(n):
        t0 = clock()
        if ctx.decode(Batch(token=[token])) != 0:
            raise RuntimeError(f"decode failed: {ctx.last_error}")
        token = int(np.argmax(ctx.get_logits_ith(-1)))
        times.append(clock() - t0)
    return times


def _bookkeeping(ctx, n: int, clock: Callable[[], float] = time.perf_counter) -> list[float]:
    """The host bookkeeping of ``n`` generated tokens, without the forward: the time of each.

    What ``decode`` does around the model for one token: validate the batch
    (``BatchAllocr``), split and place it (``init_batch``: the slot search), write its cells
    (``apply``) and build the forward's input (``graph_input``: the rows and the KQ mask).
    """
    mem = ctx.memory
    times = []
    for _ in range(n):
        t0 = clock()
        balloc = BatchAllocr(Batch(token=[1]), n_vocab=ctx.n_vocab, n_seq_max=1, memory=mem)
        mctx = mem.init_batch(balloc, 512)
        mctx.apply()
        mctx.graph_input()
        times.append(clock() - t0)
    return times


def probe(ctx_factory: Callable[[], object], depths: Sequence[int] = DEPTHS, n_gen: int = 16,
          n_warmup: int = 3, failed_decode: int = 5,
          clock: Callable[[], float] = time.perf_counter) -> dict:
    """Milliseconds per generated token at each depth, and the time of one failed decode.

    Args:
        ctx_factory: makes a fresh Context (one per depth).
        depths: cache depths to measure at (those that do not fit ``n_ctx`` are skipped).
        n_gen: tokens timed at each depth (after ``n_warmup`` untimed ones).
        n_warmup: tokens generated first (graph compiles, caches).
        failed_decode: time this many decodes in a full cache (each must return 1; a failed
            decode changes nothing, so it is the same one each time) and keep the median.
        clock: ``time.perf_counter`` (wall) or ``time.process_time`` (CPU time of the
            process, steadier on a shared machine).

    Returns:
        ``{"ms_per_token": {depth: median ms}, "bookkeeping_ms": {depth: median ms},
        "failed_decode_ms": ms or None, "n_ctx": n}``; ``bookkeeping_ms`` is the host work
        of a token without the forward (`_bookkeeping`).
    """
    out: dict = {"ms_per_token": {}, "bookkeeping_ms": {}, "failed_decode_ms": None}
    for depth in depths:
        ctx = ctx_factory()
        n_ctx = ctx.memory.get_size()
        out["n_ctx"] = n_ctx
        if depth + n_warmup + 2 * n_gen > n_ctx:  # generation, then bookkeeping
            continue
        fill(ctx, depth)
        _generate(ctx, n_warmup)
        out["ms_per_token"][depth] = 1e3 * float(np.median(_generate(ctx, n_gen, clock)))
        ctx.synchronize()  # the last forward, launched, must not run beside the bookkeeping
        out["bookkeeping_ms"][depth] = 1e3 * float(np.median(_bookkeeping(ctx, n_gen, clock)))
    if failed_decode:
        ctx = ctx_factory()
        n_ctx = ctx.memory.get_size()
        fill(ctx, n_ctx)
        times = []
        for _ in range(failed_decode):
            t0 = clock()
            ret = ctx.decode(Batch(token=[1]))
            times.append(clock() - t0)
            if ret != 1:
                raise RuntimeError(f"a decode in a full cache returned {ret}, expected 1")
        out["failed_decode_ms"] = 1e3 * float(np.median(times))
    return out


def profile_at(ctx_factory: Callable[[], object], depth: int, n_gen: int = 32,
               top: int = 15) -> str:
    """A cProfile of ``n_gen`` generated tokens at ``depth``, by total time: the top lines."""
    ctx = ctx_factory()
    fill(ctx, depth)
    _generate(ctx, 3)
    prof = cProfile.Profile()
    prof.enable()
    _generate(ctx, n_gen)
    prof.disable()
    s = io.StringIO()
    pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(top)
    return s.getvalue()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ctx", choices=["reference", "mlx", "both"], default="both")
    ap.add_argument("--n-ctx", type=int, nargs="+", default=[8192, 16384])
    ap.add_argument("--depths", type=int, nargs="+", default=list(DEPTHS))
    ap.add_argument("--n-gen", type=int, default=16)
    ap.add_argument("--failed-repeats", type=int, default=5,
                    help="failed decodes timed in a full cache (median); 0: none")
    ap.add_argument("--clock", choices=["wall", "process"], default="wall",
                    help="wall time, or the process's CPU time (steadier on a busy machine)")
    ap.add_argument("--profile", type=int, default=None, metavar="DEPTH",
                    help="print a cProfile of generation at DEPTH (first --n-ctx) instead")
    args = ap.parse_args()
    kinds = ["reference", "mlx"] if args.ctx == "both" else [args.ctx]
    if args.profile is not None:
        for kind in kinds:
            print(f"== {kind}, n_ctx {args.n_ctx[0]}, depth {args.profile}")
            print(profile_at(context_factory(kind, args.n_ctx[0]), args.profile))
        return
    depths = sorted(args.depths)
    print("| Context | n_ctx | ms | " + " | ".join(f"d{d}" for d in depths)
          + " | d_last/d0 | failed decode (ms) |")
    print("|---|---|---|" + "---|" * len(depths) + "---|---|")
    for n_ctx in args.n_ctx:
        for kind in kinds:
            clock = time.perf_counter if args.clock == "wall" else time.process_time
            res = probe(context_factory(kind, n_ctx), depths, n_gen=args.n_gen, clock=clock,
                        failed_decode=args.failed_repeats)
            for what, key in (("per token", "ms_per_token"), ("bookkeeping", "bookkeeping_ms")):
                ms = res[key]
                cols = [f"{ms[d]:.2f}" if d in ms else "-" for d in depths]
                ratio = ms[max(ms)] / ms[0] if 0 in ms else float("nan")
                failed = (f"{res['failed_decode_ms']:.1f}" if key == "ms_per_token"
                          and res["failed_decode_ms"] is not None else "")
                print(f"| {kind} | {res['n_ctx']} | {what} | " + " | ".join(cols)
                      + f" | {ratio:.2f} | {failed} |", flush=True)


if __name__ == "__main__":
    main()
