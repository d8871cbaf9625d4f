r"""Throughput of many sequences at once: llama.cpp's ``tools/batched-bench``.

``llama-batched-bench -npp 128,256 -ntg 128 -npl 1,2,4,8`` measures, for every combination
of a prompt length ``PP``, a generation length ``TG`` and a number of parallel sequences
``B``, how fast a context processes the prompts and then generates (batched-bench.cpp):

1. **PP**: ``B`` prompts of ``PP`` random tokens (``rand() % n_vocab``), each on its own
   sequence at positions ``0..PP-1``, only the last token of each with an output, decoded
   ``n_batch`` tokens at a time into an empty memory. With ``-pps`` (prompt shared) one
   prompt on sequence 0 is decoded and ``seq_cp(0, i)`` gives it to the others; with one
   KV stream per sequence the copies are made by one more decode (a dummy token on
   sequence 0, then removed) (batched-bench.cpp:135-175).
2. **TG**: ``TG`` steps of one batch of ``B`` tokens, one per sequence at position
   ``PP + i``, all with outputs (the pattern ``0123 0123 ...``); with ``-tgs`` one
   sequence after the other, one token per decode (:179-213).

A row is skipped when the memory cannot hold it: it needs

$$ N_{KV} = \begin{cases} (PP \text{ if unified else } B \cdot PP) + B \cdot TG &
\text{with -pps} \\ B\,(PP + TG) & \text{otherwise} \end{cases} $$

cells (:129-133). The columns (:219-225): ``T_PP`` and ``T_TG`` the two times,
$S_{PP} = (PP \text{ or } B \cdot PP) / T_{PP}$ (prompt tokens processed per second),
$S_{TG} = B \cdot TG / T_{TG}$ (tokens generated per second, all sequences together),
$T = T_{PP} + T_{TG}$ and $S$ the total tokens over $T$.

The context must have ``n_seq_max >= max(npl)`` (llama.cpp sets it). The random tokens are
glibc's ``rand()`` from its default seed, as in llama.cpp (after 16 for the warm-up), so
both decode the same tokens. On a recurrent memory the shared prompt's copies need no
extra decode (a state is copied at once), and the dummy token could not be removed
(a recurrent memory refuses a partial ``seq_rm``): it is skipped there.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from reference.common import LlamarefError
from reference.tools.parallel import PendingBatch
from reference.tools.passkey import GlibcRand


class BatchedBenchError(LlamarefError, ValueError):
    """Bad bench lists (empty, non-positive values, more sequences than the context
    holds) or a decode that failed."""


# --8<-- [start:n_ctx_required]
def n_ctx_required(pp: int, tg: int, pl: int, pps: bool, kv_unified: bool) -> int:
    """Cells a row needs (batched-bench.cpp:129): its ``N_KV`` column.

    Examples:
        >>> n_ctx_required(128, 128, 4, pps=False, kv_unified=False)
        1024
        >>> n_ctx_required(128, 128, 4, pps=True, kv_unified=True)
        640
    """
    if pps:
        return (pp if kv_unified else pl * pp) + pl * tg
    return pl * (pp + tg)
# --8<-- [end:n_ctx_required]


# --8<-- [start:BenchRow]
@dataclass(frozen=True)
class BenchRow:
    """One line of the table: sizes, times (s) and speeds (tokens/s)."""

    pp: int
    tg: int
    pl: int
    n_kv: int
    t_pp: float
    t_tg: float
    is_pp_shared: bool

    @property
    def speed_pp(self) -> float:
        """``S_PP``: prompt tokens per second (one prompt when shared)."""
        n = self.pp if self.is_pp_shared else self.pl * self.pp
        return n / self.t_pp if self.t_pp > 0 else 0.0

    @property
    def speed_tg(self) -> float:
        """``S_TG``: generated tokens per second, every sequence together."""
        return self.pl * self.tg / self.t_tg if self.t_tg > 0 else 0.0

    @property
    def t(self) -> float:
        """``T``: both phases."""
        return self.t_pp + self.t_tg

    @property
    def speed(self) -> float:
        """``S``: all tokens over ``T``."""
        n = (self.pp if self.is_pp_shared else self.pl * self.pp) + self.pl * self.tg
        return n / self.t if self.t > 0 else 0.0
# --8<-- [end:BenchRow]


# --8<-- [start:decode_helper]
def decode_helper(ctx: Any, batch: PendingBatch, n_batch: int,
                  synchronize: bool) -> None:
    """Decode ``batch`` in chunks of ``n_batch`` (batched-bench.cpp:82-98).

    Raises:
        BatchedBenchError: a chunk did not decode (llama.cpp stops there too).
    """
    for i in range(0, len(batch), n_batch):
        n_tokens = min(n_batch, len(batch) - i)
        ret = ctx.decode(batch.sub(i, n_tokens))
        if ret != 0:
            raise BatchedBenchError(f"failed to decode the batch, n_batch = {n_batch}, "
                                    f"ret = {ret}: increase -c")
        if synchronize:
            ctx.synchronize()
# --8<-- [end:decode_helper]


# --8<-- [start:bench_row]
def bench_row(ctx: Any, pp: int, tg: int, pl: int, pps: bool, tgs: bool,
              rand: Callable[[], int], n_batch: int) -> BenchRow:
    """Time one (PP, TG, B) combination (batched-bench.cpp:135-225)."""
    n_vocab = ctx.n_vocab
    batch = PendingBatch()
    for j in range(1 if pps else pl):
        for i in range(pp):
            batch.add(rand() % n_vocab, i, j, i == pp - 1)
    ctx.memory.clear(False)
    t0 = time.perf_counter()
    decode_helper(ctx, batch, n_batch, False)
    ctx.synchronize()
    t_pp = time.perf_counter() - t0
    if pps:
        for i in range(1, pl):
            ctx.memory.seq_cp(0, i, -1, -1)
        if not ctx.kv_unified and not ctx.recurrent:
            dummy = PendingBatch()  # one decode applies the stream copies
            dummy.add(rand() % n_vocab, pp, 0, True)
            decode_helper(ctx, dummy, n_batch, True)
            ctx.memory.seq_rm(0, pp, -1)
    t0 = time.perf_counter()
    for step in tg_batches(pp, tg, pl, tgs):
        batch = PendingBatch()
        for pos, seq in step:
            batch.add(rand() % n_vocab, pos, seq, True)
        decode_helper(ctx, batch, n_batch, True)
    t_tg = time.perf_counter() - t0
    n_kv = n_ctx_required(pp, tg, pl, pps, ctx.kv_unified)
    return BenchRow(pp, tg, pl, n_kv, t_pp, t_tg, pps)


def tg_batches(pp: int, tg: int, pl: int,
               tgs: bool) -> Iterator[list[tuple[int, int]]]:
    """The (pos, seq) pairs of each generation decode: ``0123 0123 ...`` or, with
    ``-tgs``, ``0 0 0 ... 1 1 1 ...`` one token per decode.

    Examples:
        >>> list(tg_batches(4, 2, 2, tgs=False))
        [[(4, 0), (4, 1)], [(5, 0), (5, 1)]]
        >>> list(tg_batches(4, 2, 2, tgs=True))
        [[(4, 0)], [(5, 0)], [(4, 1)], [(5, 1)]]
    """
    if tgs:
        for j in range(pl):
            for i in range(tg):
                yield [(pp + i, j)]
    else:
        for i in range(tg):
            yield [(pp + i, j) for j in range(pl)]
# --8<-- [end:bench_row]


# --8<-- [start:batched_bench]
def batched_bench(ctx: Any, n_pp: Sequence[int], n_tg: Sequence[int],
                  n_pl: Sequence[int], pps: bool = False, tgs: bool = False,
                  n_batch: int | None = None,
                  rand: Callable[[], int] | None = None) -> Iterator[BenchRow]:
    """Every row of the table that fits, PP outermost, then TG, then B.

    Args:
        ctx: a Context (either twin) with ``n_seq_max >= max(n_pl)``.
        n_pp: ``-npp``, the prompt lengths.
        n_tg: ``-ntg``, the generation lengths.
        n_pl: ``-npl``, the numbers of sequences.
        pps: ``-pps``, one prompt shared by every sequence.
        tgs: ``-tgs``, generate for one sequence after the other.
        n_batch: tokens per decode (default: ``ctx.n_batch``).
        rand: the token source (default: glibc's ``rand()`` from seed 1).

    Raises:
        BatchedBenchError: a value ``< 1`` in a list, more sequences than the context
            holds (before anything is decoded), or a failed decode.

    Examples:
        >>> from reference.context import Context
        >>> from reference.testing import tiny_hparams, random_weights
        >>> hp = tiny_hparams()
        >>> ctx = Context(hp, random_weights(hp), n_ctx=256, n_seq_max=8)
        >>> rows = list(batched_bench(ctx, [32], [4], [1, 4, 8]))
        >>> [(r.pp, r.tg, r.pl, r.n_kv) for r in rows]  # B = 8 needs 288 cells
        [(32, 4, 1, 36), (32, 4, 4, 144)]
    """
    check_lists(ctx, n_pp, n_tg, n_pl)
    rand = rand or GlibcRand()
    n_batch = n_batch or ctx.n_batch
    warm_up(ctx, rand, n_batch)
    for pp in n_pp:
        for tg in n_tg:
            for pl in n_pl:
                if n_ctx_required(pp, tg, pl, pps, ctx.kv_unified) > ctx.n_ctx:
                    continue
                yield bench_row(ctx, pp, tg, pl, pps, tgs, rand, n_batch)


def check_lists(ctx: Any, n_pp: Sequence[int], n_tg: Sequence[int],
                n_pl: Sequence[int]) -> None:
    """Positive values, and no more sequences than the context has."""
    for flag, values in (("-npp", n_pp), ("-ntg", n_tg), ("-npl", n_pl)):
        bad = [v for v in values if v < 1]
        if bad:
            raise BatchedBenchError(f"{flag} {bad[0]}: every value must be >= 1")
    fits = [pl for pl in n_pl if pl <= ctx.n_seq_max]
    if len(fits) < len(n_pl):
        raise BatchedBenchError(f"-npl {max(n_pl)} needs {max(n_pl)} sequences and the "
                                f"context has {ctx.n_seq_max}: make it with "
                                f"n_seq_max >= {max(n_pl)}")


def warm_up(ctx: Any, rand: Callable[[], int], n_batch: int) -> None:
    """16 random tokens on sequence 0, no output (batched-bench.cpp:100-112)."""
    batch = PendingBatch()
    for i in range(16):
        batch.add(rand() % ctx.n_vocab, i, 0, False)
    ctx.memory.clear(False)
    decode_helper(ctx, batch, n_batch, True)
# --8<-- [end:batched_bench]


# --8<-- [start:format]
def header(config: dict) -> list[str]:
    """The configuration line and the table's head (batched-bench.cpp:116-119).

    Examples:
        >>> for line in header(dict(n_kv_max=512, n_batch=2048, n_ubatch=512,
        ...                         flash_attn=0, is_pp_shared=0, is_tg_separate=0,
        ...                         n_gpu_layers=0, n_threads=2, n_threads_batch=2))[2:]:
        ...     print(line)
        |    PP |     TG |    B |   N_KV |   T_PP s | S_PP t/s |   T_TG s | S_TG t/s |      T s |    S t/s |
        |-------|--------|------|--------|----------|----------|----------|----------|----------|----------|
    """  # noqa: E501
    cfg = ", ".join(f"{k} = {v}" for k, v in config.items() if k != "pp")
    names = ("PP", "TG", "B", "N_KV", "T_PP s", "S_PP t/s", "T_TG s", "S_TG t/s",
             "T s", "S t/s")
    widths = (6, 6, 4, 6, 8, 8, 8, 8, 8, 8)
    head = "|" + " | ".join(f"{n:>{w}s}" for n, w in zip(names, widths, strict=True))
    rule = "|" + "-|-".join("-" * w for w in widths)
    return [f"main: {cfg}", "", head + " |", rule + "-|"]


def row_md(r: BenchRow) -> str:
    """A row as batched-bench.cpp:235 prints it.

    Examples:
        >>> row_md(BenchRow(128, 32, 4, 640, 0.5, 2.0, True))
        '|   128 |     32 |    4 |    640 |    0.500 |   256.00 |    2.000 |    64.00 |    2.500 |   102.40 |'
    """  # noqa: E501
    return (f"|{r.pp:6d} | {r.tg:6d} | {r.pl:4d} | {r.n_kv:6d} | {r.t_pp:8.3f} | "
            f"{r.speed_pp:8.2f} | {r.t_tg:8.3f} | {r.speed_tg:8.2f} | {r.t:8.3f} | "
            f"{r.speed:8.2f} |")


def row_jsonl(r: BenchRow, config: dict) -> str:
    """A row as one JSON line (batched-bench.cpp:228-233): the configuration's keys,
    then ``pp, tg, pl, n_kv, t_pp, speed_pp, t_tg, speed_tg, t, speed`` (floats as
    ``%f``).

    Examples:
        >>> row_jsonl(BenchRow(8, 4, 2, 24, 0.25, 0.5, False), {"n_kv_max": 256})
        ... # doctest: +ELLIPSIS
        '{"n_kv_max": 256, "pp": 8, "tg": 4, "pl": 2, "n_kv": 24, "t_pp": 0.250000, ...}'
    """
    values = dict(config, pp=r.pp, tg=r.tg, pl=r.pl, n_kv=r.n_kv, t_pp=r.t_pp,
                  speed_pp=r.speed_pp, t_tg=r.t_tg, speed_tg=r.speed_tg, t=r.t,
                  speed=r.speed)
    items = (f"{json.dumps(k)}: {v:f}" if isinstance(v, float)
             else f"{json.dumps(k)}: {json.dumps(v)}" for k, v in values.items())
    return "{" + ", ".join(items) + "}"
# --8<-- [end:format]


__all__ = [
    "BatchedBenchError",
    "BenchRow",
    "batched_bench",
    "bench_row",
    "check_lists",
    "decode_helper",
    "header",
    "n_ctx_required",
    "row_jsonl",
    "row_md",
    "tg_batches",
    "warm_up",
]
