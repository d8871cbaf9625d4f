r"""``llamaref bench --profile MODE``: where the time of a token goes, measured six ways.

The bench's table says how fast a backend is; a profile says where the time goes. Each mode
is an instrument with its own loop, run on the backends the bench built from its flags
(``-m``, ``-n``, ``-d``, ``-c``, ``-r``, ``--backend``, ``--matmul``, ``--vs mlx-lm``),
and prints a Markdown table:

- ``ops``: the twin's forward op by op, in one ``pp`` and one ``tg`` ([`profile_ops`][]);
  a row per op: calls, ms, share.
- ``phases``: a generated token of the twin phase by phase, mlx-lm's beside it
  ([`token_phases`][]); a row per phase: µs per token, calls per token.
- ``steps``: the host's time per call of each bookkeeping function in the bench's ``tg``
  loop ([`step_times`][]); a row per function: calls, median µs.
- ``overlap``: ms per token with a busy wait added to each token's host work
  ([`host_overlap`][]); a row per wait, a column per program.
- ``nodes``: the graph nodes a generated token launches, by primitive
  ([`count_nodes`][]).
- ``depth``: ms per token, and the bookkeeping alone, against the cache's depth, and a
  decode that fails in a full cache ([`probe_depths`][]); a column per depth.

``ops`` (the bare ``--profile``) adds its tables after the bench's; the other modes run
instead of the bench's tests.

**How a mode measures.** No mode replaces a private method. Each names the public functions
and methods it times, and [`wrapped`][] replaces them only while the mode runs: the
originals are back on the way out, even after an error. A method is wrapped on the object
that is measured (the Context, its memory, the runner's sampler) when it can be, on its class
(``BatchAllocr.__init__``, mlx-lm's model call) when Python looks it up there. One hook
reaches past our functions, into MLX's: [`mlx_calls`][]. While a Context's
``process_ubatch`` runs, the ``mx`` that ``accelerated.context`` reads is a view of
``mlx.core`` with some functions wrapped, so its ``mx.array`` and ``mx.async_eval`` calls
can be timed (``phases``) or their graph exported (``nodes``). A wrapper costs about a
microsecond per call, so the timed loops run slower than the bench's: compare their numbers
with each other, on one machine.
"""

from __future__ import annotations

import collections
import functools
import inspect
import io
import os
import re
import statistics
import sys
import time
from collections import defaultdict
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import mlx.core as mx
import numpy as np

import accelerated.context as accelerated_context
import accelerated.ops as accelerated_ops
import accelerated.quants as quants
from accelerated.models import llama as accelerated_llama
from reference.batch import Batch, BatchAllocr
from reference.common import LlamarefError

__all__ = [
    "MODES", "ProfileError", "count_nodes", "depth_probe_table", "fill_cells", "host_overlap",
    "mlx_calls", "nodes_table", "probe_depths", "profile_ops", "profile_table", "run_profile",
    "step_times", "steps_table", "timed_calls", "token_phases", "wrapped",
]

MODES = {
    "ops": "the twin's forward op by op (one pp and one tg)",
    "phases": "a generated token of the twin phase by phase (mlx-lm's with --vs mlx-lm)",
    "steps": "host time per call of each bookkeeping function in the tg loop",
    "overlap": "ms per token with busy waits (--spins) added to each token's host work",
    "nodes": "graph nodes a generated token launches, by primitive",
    "depth": "ms per token and the bookkeeping alone at each depth (-d), a failed decode",
}
"""``--profile`` modes -> what each measures (the ``--help`` text)."""

PREFILL = 512
"""The chunk in which ``phases`` fills mlx-lm's cache to the depth (the bench's ``n_batch``)."""


class ProfileError(LlamarefError):
    """A profile cannot run as asked (a private name to wrap, a model without the part it
    measures, a decode that failed)."""


# ---------------------------------------------------------------------------------------------
# The hooks: public names wrapped while a mode runs
# ---------------------------------------------------------------------------------------------

Target = tuple[object, str, str]
"""``(owner, name, label)``: ``owner.name`` (a module, a class or an instance) is wrapped;
``label`` names it in the table."""


def _is_public(name: str) -> bool:
    """Public: no leading underscore, or a dunder (``__init__``, ``__call__``: how an object
    is made and called)."""
    return not name.startswith("_") or (name.startswith("__") and name.endswith("__"))


@contextmanager
def wrapped(targets: Sequence[Target], wrap: Callable[[str, Callable], object]) -> Iterator[None]:
    """Replace each ``owner.name`` by ``wrap(label, original)`` while inside.

    An owner is a module, a class (then every instance sees the wrapper) or an instance (then
    only it does). On exit, even after an error, each owner gets its own attribute back, or
    none where it had none (a method of an instance's class, one a class inherits).

    Args:
        targets: ``(owner, name, label)`` triples ([`Target`][]); public names only.
        wrap: makes the replacement from the label and the original attribute (a bound
            method when the owner is an instance).

    Raises:
        ProfileError: a private name, or one the owner lacks; raised before anything is
            replaced.

    Examples:
        >>> import types
        >>> m = types.SimpleNamespace(f=lambda x: x + 1)
        >>> seen = []
        >>> with wrapped([(m, "f", "f")], lambda label, f: lambda x: seen.append(label) or f(x)):
        ...     m.f(1)
        2
        >>> seen, m.f(1), seen
        (['f'], 2, ['f'])
        >>> with wrapped([(m, "_g", "g")], lambda label, f: f):
        ...     pass
        Traceback (most recent call last):
        ...
        llamaref.bench.profile.ProfileError: _g is private: a profile wraps public names only
    """
    for owner, name, _ in targets:
        if not _is_public(name):
            raise ProfileError(f"{name} is private: a profile wraps public names only")
        if not hasattr(owner, name):
            raise ProfileError(f"{owner!r} has no {name} to wrap")
    missing = object()
    saved: list[tuple[object, str, object]] = []
    try:
        for owner, name, label in targets:
            own = vars(owner).get(name, missing)  # the raw attribute: a staticmethod stays one
            replacement = wrap(label, getattr(owner, name))
            if isinstance(owner, type) and isinstance(inspect.getattr_static(owner, name),
                                                      staticmethod):
                replacement = staticmethod(replacement)
            saved.append((owner, name, own))
            setattr(owner, name, replacement)
        yield
    finally:
        for owner, name, own in reversed(saved):
            if own is missing:
                delattr(owner, name)
            else:
                setattr(owner, name, own)


def _timer(times: dict[str, list[float]]) -> Callable[[str, Callable], Callable]:
    """A ``wrap`` for [`wrapped`][] that appends each call's seconds to ``times[label]``."""
    def wrap(label: str, f: Callable) -> Callable:
        @functools.wraps(f)
        def timed(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return f(*args, **kwargs)
            finally:
                times[label].append(time.perf_counter() - t0)
        return timed
    return wrap


def timed_calls(targets: Sequence[Target], times: dict[str, list[float]]):
    """[`wrapped`][] with timers: each call of a target appends its seconds to
    ``times[label]`` (a ``defaultdict(list)``).

    Examples:
        >>> import types
        >>> from collections import defaultdict
        >>> m, times = types.SimpleNamespace(f=abs), defaultdict(list)
        >>> with timed_calls([(m, "f", "abs")], times):
        ...     m.f(-2), m.f(3)
        (2, 3)
        >>> len(times["abs"]), m.f is abs
        (2, True)
    """
    return wrapped(targets, _timer(times))


class _MLXView:
    """``mlx.core`` as one module sees it, with some of its functions replaced."""

    def __init__(self, replaced: dict[str, Callable]):
        self._replaced = replaced

    def __getattr__(self, name: str):
        return self._replaced[name] if name in self._replaced else getattr(mx, name)


@contextmanager
def mlx_calls(ctx: accelerated_context.Context, names: Sequence[str],
              wrap: Callable[[str, Callable], Callable]) -> Iterator[None]:
    """While inside, the ``mx.<name>`` calls of ``accelerated.context`` made during
    ``ctx.process_ubatch`` go through ``wrap(f"mx.{name}", mx.<name>)``.

    ``process_ubatch`` (the graph's inputs, its call, its launch) is wrapped on ``ctx``; for
    the length of each call the module's ``mx`` is a view of ``mlx.core`` with ``names``
    replaced. Only the MLX Context's own module is affected (MLX itself, mlx-lm and the
    other modules are not), and only inside that method: ``decode_token``'s
    ``isinstance(token, mx.array)`` runs outside it.

    Args:
        ctx: an [`accelerated.context.Context`][accelerated.context.Context].
        names: functions of ``mlx.core``, e.g. ``("array", "async_eval")``.
        wrap: as [`wrapped`][]'s.
    """
    view = _MLXView({name: wrap(f"mx.{name}", getattr(mx, name)) for name in names})

    def in_view(label: str, process_ubatch: Callable) -> Callable:
        def call(mctx):
            with wrapped([(accelerated_context, "mx", "mx")], lambda label, real: view):
                return process_ubatch(mctx)
        return call

    with wrapped([(ctx, "process_ubatch", "process_ubatch")], in_view):
        yield


def _decode(ctx, batch: Batch) -> None:
    if ctx.decode(batch) != 0:
        raise ProfileError(f"a decode failed: {ctx.last_error}")


# ---------------------------------------------------------------------------------------------
# ops: the twin's forward op by op
# ---------------------------------------------------------------------------------------------


def _profile_targets() -> dict[str, Callable]:
    """The functions to time: every public op of [`accelerated.ops`][accelerated.ops], the quantized
    matmul and dequantization of [`accelerated.quants`][accelerated.quants], the model's ``linear``
    (a matmul with a weight: quantized, dense or pre-transposed) and its in-graph attention and
    RoPE."""
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

    Each target (`_profile_targets`) is replaced, in every ``accelerated.*`` module
    that holds it, by a wrapper that first evaluates the op's pending inputs (their time
    goes to ``"(inputs: unwrapped work)"``: embedding rows, cache writes, reshapes), then
    calls the op and ``mx.eval``'s its result. An op called inside another (``soft_max_ext``
    inside ``build_attn_mha``) counts in the outer one. ``mx.compile`` is disabled inside
    (a compiled function then runs op by op, through the wrappers). The originals are put
    back on exit. Evaluating op by op removes MLX's overlap and fusion across ops: the shares
    say where the work is, the sum is slower than a normal run.
    """
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
    """A Markdown table ``op | calls | ms | share`` of [`profile_ops`][]' stats.

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


def run_profile(runner: Any, tokens: np.ndarray, n_gen: int) -> str:
    """Profile one ``pp`` run and ``n_gen`` tg steps (after a warm-up of each).

    Args:
        runner: a [`llamaref.bench.ContextRunner`][llamaref.bench.ContextRunner] of the twin
            (graph reuse off: op by op, through the wrappers).
        tokens: the ``pp`` prompt ``(n_prompt,)``; its first token starts ``tg``.
        n_gen: ``tg`` steps.

    Returns:
        Two [`profile_table`][]s, ``pp{n}`` then ``tg{n}``, a blank line apart.
    """
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
# phases: a generated token of the twin, phase by phase
# ---------------------------------------------------------------------------------------------

PHASES = ("decode", "in decode: mx.array", "in decode: graph call", "in decode: mx.async_eval",
          "argmax, read back")
"""The twin's phases, in the order of the table: ``decode`` holds the three below it."""


def token_phases(runner: Any, depth_tokens: np.ndarray, n_tokens: int) -> dict[str, list[float]]:
    """The seconds of each phase of ``n_tokens`` generated tokens of the MLX Context.

    A plain loop, one token at a time (decode one token, take the argmax on the device, read
    it back: no pipelining, so each phase is timed alone), after ``depth_tokens`` in the
    cache. The phases: the Context's ``decode`` and, inside it, the ``mx.array`` calls that
    hand the graph its host inputs and the ``mx.async_eval`` that launches it
    ([`mlx_calls`][]), and the compiled graph's call (the function ``ctx.graph`` returns,
    wrapped); then the argmax and its read back.

    Args:
        runner: a [`llamaref.bench.ContextRunner`][llamaref.bench.ContextRunner] of the twin.
        depth_tokens: put in the cache first (``set_depth``: not timed).
        n_tokens: tokens to generate.

    Returns:
        ``{phase: [seconds of each call]}`` over [`PHASES`][] (a phase called ``k`` times a
        token has ``k * n_tokens`` entries).

    Raises:
        ProfileError: a decode failed.
    """
    ctx = runner.ctx
    runner.set_depth(depth_tokens)
    times: dict[str, list[float]] = defaultdict(list)
    timer = _timer(times)

    def timed_graphs(label: str, graph: Callable) -> Callable:
        return lambda key: timer(label, graph(key))

    in_decode = mlx_calls(ctx, ("array", "async_eval"),
                          lambda label, f: timer(f"in decode: {label}", f))
    with in_decode, wrapped([(ctx, "graph", "in decode: graph call")], timed_graphs):
        token = 1
        for _ in range(n_tokens):
            t0 = time.perf_counter()
            _decode(ctx, Batch(token=[token]))
            t1 = time.perf_counter()
            token = int(mx.argmax(ctx.get_logits_ith_device(-1)).item())
            times["decode"].append(t1 - t0)
            times["argmax, read back"].append(time.perf_counter() - t1)
    return {phase: times[phase] for phase in PHASES if times[phase]}


def mlx_lm_phases(model: Any, depth_tokens: np.ndarray, n_tokens: int) -> dict[str, list[float]]:
    """The seconds of each phase of ``n_tokens`` tokens of mlx-lm's model, as
    [`token_phases`][]: its model call (the graph built op by op), ``mx.async_eval`` of the
    argmax, and the read back.

    Args:
        model: mlx-lm's model
            ([`llamaref.bench.peers.mlx_lm_model`][llamaref.bench.peers.mlx_lm_model]).
        depth_tokens: put in its cache first, ``PREFILL`` at a time.
        n_tokens: tokens to generate.
    """
    from mlx_lm.models.cache import make_prompt_cache

    cache = make_prompt_cache(model)
    for i in range(0, len(depth_tokens), PREFILL):
        model(mx.array(depth_tokens[i:i + PREFILL])[None], cache=cache)
        mx.eval([c.state for c in cache])
    times: dict[str, list[float]] = defaultdict(list)
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
    return dict(times)


def phases_table(title: str, times: dict[str, list[float]], n_tokens: int) -> str:
    """A Markdown table ``phase | µs / token | calls / token``: the median of each phase's
    calls after the first quarter of the tokens (warm-up), times its calls per token.

    Examples:
        >>> print(phases_table("ours", {"decode": [1.0, 2e-4, 3e-4, 4e-4]}, 4))
        | ours: phase | µs / token | calls / token |
        |---|---:|---:|
        | decode | 300.0 | 1 |
    """
    lines = [f"| {title}: phase | µs / token | calls / token |", "|---|---:|---:|"]
    skip = n_tokens // 4
    for phase, values in times.items():
        per_token = len(values) / n_tokens
        kept = values[int(skip * per_token):]
        lines.append(f"| {phase} | {statistics.median(kept) * 1e6 * per_token:.1f} "
                     f"| {per_token:g} |")
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------
# steps: the host's time per call of each bookkeeping function in the tg loop
# ---------------------------------------------------------------------------------------------


def step_targets(runner) -> list[Target]:
    """What ``steps`` times in a runner's ``tg`` loop: the batch's validation
    (``BatchAllocr``), the memory's ``init_batch`` (split, slot search) and ``backup`` (a
    recurrent memory's, before a step decoded ahead), the Context's ``decode`` (all of the
    others but the sampler), ``memory_update``, ``process_ubatch`` (the graph's inputs, call
    and launch), ``output_reserve``, ``output_set``, ``get_logits_ith_device`` (the twin's),
    and the sampler's ``sample_async`` (the twin's; the host's ``sample``)."""
    ctx, sampler = runner.ctx, runner.sampler
    targets: list[Target] = [(BatchAllocr, "__init__", "BatchAllocr")]
    targets += [(ctx.memory, name, f"memory.{name}") for name in ("init_batch", "backup")
                if hasattr(ctx.memory, name)]
    targets += [(ctx, name, name) for name in (
        "decode", "memory_update", "process_ubatch", "output_reserve", "output_set",
        "get_logits_ith_device") if hasattr(ctx, name)]
    name = "sample_async" if sampler.pipelined else "sample"
    return [*targets, (sampler, name, f"sampler.{name}")]


def step_times(runner, depth_tokens: np.ndarray, n_tokens: int, runs: int
               ) -> tuple[dict[str, list[float]], list[float]]:
    """The seconds of each call of [`step_targets`][] in the runner's ``tg`` loop.

    ``tg`` is the bench's generation (the
    [`reference.tools.generate.Generator`][reference.tools.generate.Generator] loop,
    pipelined with the twin's greedy device sampler), after ``depth_tokens``: one untimed
    warm-up of 50 tokens, then ``runs`` runs of ``n_tokens``.

    Returns:
        ``({label: [seconds of each call in the last run]}, [seconds per token of each run])``
        (the timers included).
    """
    runner.set_depth(depth_tokens)
    times: dict[str, list[float]] = defaultdict(list)
    per_token = []
    with timed_calls(step_targets(runner), times):
        runner.tg(1, min(50, n_tokens))  # warm-up: the graphs are compiled
        for _ in range(runs):
            times.clear()
            per_token.append(runner.tg(1, n_tokens) / n_tokens)
    return dict(times), per_token


def steps_table(title: str, times: dict[str, list[float]], per_token: list[float]) -> str:
    """A Markdown table ``function | calls | median µs``, slowest first, and a line with the
    milliseconds per token of each run.

    Examples:
        >>> print(steps_table("ours", {"decode": [3e-4, 5e-4], "output_set": [1e-5]}, [1e-3]))
        | ours: function | calls | median µs |
        |---|---:|---:|
        | decode | 2 | 400.0 |
        | output_set | 1 | 10.0 |
        <BLANKLINE>
        ms / token of each run (the timers included): 1.000
    """
    lines = [f"| {title}: function | calls | median µs |", "|---|---:|---:|"]
    for label, values in sorted(times.items(), key=lambda kv: -statistics.median(kv[1])):
        lines.append(f"| {label} | {len(values)} | {1e6 * statistics.median(values):.1f} |")
    runs = " ".join(f"{1e3 * s:.3f}" for s in per_token)
    return "\n".join(lines) + f"\n\nms / token of each run (the timers included): {runs}"


# ---------------------------------------------------------------------------------------------
# overlap: how much host work per token hides behind the forward
# ---------------------------------------------------------------------------------------------


def token_entry(runner) -> tuple[object, str]:
    """Where a generated token's host work starts: a Context's ``decode`` (on the runner's
    Context), mlx-lm's model call (on its model's class: Python looks ``__call__`` up there).

    Raises:
        ProfileError: a runner with neither (llama.cpp's).
    """
    if hasattr(runner, "ctx"):
        return runner.ctx, "decode"
    if hasattr(runner, "model"):
        return type(runner.model), "__call__"
    raise ProfileError(f"{type(runner).__name__}: no Context and no mlx-lm model to add "
                       "host work to")


def host_overlap(runners: dict[str, object], depth_tokens: np.ndarray, n_tokens: int,
                 spins: Sequence[int], runs: int) -> str:
    r"""Milliseconds per generated token with a busy wait added to each token's host work.

    The wait (``X`` µs of ``time.perf_counter`` polling) runs at the start of each token's
    host work ([`token_entry`][]). Where a token stays as long as without it, that much host
    work runs while the device works on the previous step; where it grows by ``X``, the
    host's work adds to the forward. Each program runs its ``tg`` (``n_tokens``, after
    ``depth_tokens``) ``runs`` times per wait, the programs alternating; a cell is the median.

    Args:
        runners: name -> runner with ``set_depth`` and ``tg`` (ours, mlx-lm's).
        depth_tokens: put in every cache first (not timed).
        n_tokens: tokens per run.
        spins: the waits, in µs, one row each (repeat the first last to see the noise).
        runs: runs per program and wait.

    Returns:
        A Markdown table ``added host work (µs) | <name> (ms / token) | ...`` (the first
        header ``added host work (µs) @ d<depth>`` after a depth).
    """
    spin_us = [0]

    def busy_first(label: str, f: Callable) -> Callable:
        def spun(*args, **kwargs):
            end = time.perf_counter() + spin_us[0] * 1e-6
            while time.perf_counter() < end:
                pass
            return f(*args, **kwargs)
        return spun

    targets = [(*token_entry(r), name) for name, r in runners.items()]
    for r in runners.values():
        r.set_depth(depth_tokens)
    at = f" @ d{len(depth_tokens)}" if len(depth_tokens) else ""
    lines = [f"| added host work (µs){at} | "
             + " | ".join(f"{n} (ms / token)" for n in runners) + " |",
             "|---:|" + "---:|" * len(runners)]
    with wrapped(targets, busy_first):
        for r in runners.values():
            r.tg(1, 16)  # warm-up
        for us in spins:
            spin_us[0] = us
            ms: dict[str, list[float]] = {name: [] for name in runners}
            for _ in range(runs):
                for name, r in runners.items():
                    ms[name].append(1e3 * r.tg(1, n_tokens) / n_tokens)
            lines.append(f"| {us} | " + " | ".join(f"{statistics.median(v):.2f}"
                                                  for v in ms.values()) + " |")
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------
# nodes: the graph a generated token launches
# ---------------------------------------------------------------------------------------------


def count_nodes(runner: Any, depth_tokens: np.ndarray, n_steps: int = 4) -> collections.Counter:
    """Primitive -> nodes in the graph the ``n_steps``-th one-token decode launches.

    What the MLX Context hands ``mx.async_eval`` at that step (the logits and what carries
    the step's writes) is written with ``mx.export_to_dot``: every primitive between the
    step's inputs and those outputs, as the compiled graph launches them (fused elementwise
    ops count as one ``Compiled...`` node). On a small model each node costs the host a
    microsecond or two whatever its size, so the count is a part of the per-token time.

    Args:
        runner: a [`llamaref.bench.ContextRunner`][llamaref.bench.ContextRunner] of the twin.
        depth_tokens: put in the cache first.
        n_steps: one-token decodes; the last is counted (the first ones trace the graphs).

    Raises:
        ProfileError: a decode failed.
    """
    ctx = runner.ctx
    runner.set_depth(depth_tokens)
    dots: list[str] = []

    def exported(label: str, async_eval: Callable) -> Callable:
        def launch(*arrays):
            flat = [a for x in arrays for a in (x if isinstance(x, (list, tuple)) else [x])]
            buf = io.StringIO()
            mx.export_to_dot(buf, *flat)
            dots.append(buf.getvalue())
            return async_eval(*arrays)
        return launch

    with mlx_calls(ctx, ("async_eval",), exported):
        for t in range(n_steps):
            dots.clear()
            _decode(ctx, Batch(token=[t + 1]))
    ctx.synchronize()
    labels = re.findall(r'label ="([^"]+)"', "".join(dots))
    return collections.Counter(label.split()[0] for label in labels if not label.startswith("{"))


def nodes_table(title: str, nodes: collections.Counter) -> str:
    """A Markdown table ``primitive | nodes``, most first, and the total.

    Examples:
        >>> print(nodes_table("tiny", collections.Counter({"Add": 2, "Matmul": 5})))
        | tiny: primitive | nodes |
        |---|---:|
        | Matmul | 5 |
        | Add | 2 |
        | total | 7 |
    """
    lines = [f"| {title}: primitive | nodes |", "|---|---:|"]
    lines += [f"| {primitive} | {n} |" for primitive, n in nodes.most_common()]
    return "\n".join([*lines, f"| total | {sum(nodes.values())} |"])


# ---------------------------------------------------------------------------------------------
# depth: the per-token cost of a Context against the depth of its cache
# ---------------------------------------------------------------------------------------------

DEPTH_BATCH = 512
"""``n_batch`` and ``n_ubatch`` of the Contexts ``depth`` makes, and the ubatch size its
bookkeeping asks ``init_batch`` for."""


def fill_cells(ctx, depth: int) -> None:
    """Put positions ``0 .. depth - 1`` of sequence 0 in cells ``0 .. depth - 1`` (the search
    head after them); the K/V rows stay as they are.

    What a decode at a depth costs does not depend on how the cells got there, and a prefill
    of 16k tokens with the reference forward would take longer than the measurement.

    Raises:
        ProfileError: the memory has no KV cells (a recurrent memory).

    Examples:
        >>> from reference.context import Context
        >>> from reference.testing import tiny_hparams, random_weights
        >>> hp = tiny_hparams(n_layer=1)
        >>> ctx = Context(hp, random_weights(hp), n_ctx=64)
        >>> fill_cells(ctx, 10)
        >>> ctx.memory.seq_pos_max(0), ctx.decode(Batch(token=[1])), ctx.memory.seq_pos_max(0)
        (9, 0, 10)
    """
    memory = ctx.memory
    if not hasattr(memory, "v_cells"):
        raise ProfileError(f"{type(memory).__name__} has no KV cells to fill: --profile depth "
                           "measures a KV cache (llama, qwen2, gemma)")
    memory.clear(data=False)
    cells = memory.v_cells[0]
    for i in range(depth):
        cells.pos_set(i, i)
        cells.seq_add(i, 0)
    memory.v_heads[0] = depth


def _generate(ctx, n: int) -> list[float]:
    """Greedy generation of ``n`` tokens; the seconds of each (decode + reading its logits)."""
    times = []
    token = 1
    for _ in range(n):
        t0 = time.perf_counter()
        _decode(ctx, Batch(token=[token]))
        token = int(np.argmax(ctx.get_logits_ith(-1)))
        times.append(time.perf_counter() - t0)
    return times


def _bookkeeping(ctx, n: int) -> list[float]:
    """The host bookkeeping of ``n`` generated tokens, without the forward: seconds of each.

    What ``decode`` does around the model for one token: validate the batch
    (``BatchAllocr``), split and place it (``init_batch``: the slot search), write its cells
    (``apply``) and build the forward's input (``graph_input``: the rows and the KQ mask).
    """
    memory = ctx.memory
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        balloc = BatchAllocr(Batch(token=[1]), n_vocab=ctx.n_vocab, n_seq_max=1, memory=memory)
        mctx = memory.init_batch(balloc, DEPTH_BATCH)
        mctx.apply()
        mctx.graph_input()
        times.append(time.perf_counter() - t0)
    return times


def _failed_decode_ms(ctx_factory: Callable[[], object], repeats: int) -> float:
    """Median ms of a decode in a full cache (each must return 1, and changes nothing)."""
    ctx = ctx_factory()
    fill_cells(ctx, ctx.memory.get_size())
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        ret = ctx.decode(Batch(token=[1]))
        times.append(time.perf_counter() - t0)
        if ret != 1:
            raise ProfileError(f"a decode in a full cache returned {ret}, expected 1")
    return 1e3 * float(np.median(times))


def probe_depths(ctx_factory: Callable[[], object], depths: Sequence[int], n_gen: int = 16,
                 n_warmup: int = 3, failed_decode: int = 5) -> dict:
    """Milliseconds per generated token at each depth, and the time of one failed decode.

    At each depth a fresh Context is filled through its cells ([`fill_cells`][]), generates
    ``n_warmup`` tokens, then ``n_gen`` timed ones (greedy, each decode and its logits read
    back), then times its bookkeeping alone for ``n_gen`` tokens (`_bookkeeping`: batch
    checks, slot search, placement, KQ-mask inputs).

    Args:
        ctx_factory: makes a fresh Context (one per depth).
        depths: cache depths (those that do not leave room for the tokens are skipped).
        n_gen: tokens timed at each depth.
        n_warmup: tokens generated first (graph compiles, caches).
        failed_decode: time this many decodes in a full cache and keep the median (0: none).

    Returns:
        ``{"ms_per_token": {depth: median ms}, "bookkeeping_ms": {depth: median ms},
        "failed_decode_ms": ms or None, "n_ctx": cells}``.

    Raises:
        ProfileError: a recurrent memory, or a decode that failed (or did not fail in a full
            cache).

    Examples:
        >>> from reference.context import Context
        >>> from reference.testing import tiny_hparams, random_weights
        >>> hp = tiny_hparams(n_layer=1)
        >>> w = random_weights(hp)
        >>> out = probe_depths(lambda: Context(hp, w, n_ctx=64), (0, 32), n_gen=2,
        ...                    failed_decode=1)
        >>> sorted(out["ms_per_token"]), sorted(out["bookkeeping_ms"]), out["failed_decode_ms"] > 0
        ([0, 32], [0, 32], True)
    """
    out: dict = {"ms_per_token": {}, "bookkeeping_ms": {}, "failed_decode_ms": None}
    for depth in depths:
        ctx = ctx_factory()
        out["n_ctx"] = ctx.memory.get_size()
        if depth + n_warmup + 2 * n_gen > out["n_ctx"]:  # generation, then bookkeeping
            continue
        fill_cells(ctx, depth)
        _generate(ctx, n_warmup)
        out["ms_per_token"][depth] = 1e3 * float(np.median(_generate(ctx, n_gen)))
        ctx.synchronize()  # the last forward, launched, must not run beside the bookkeeping
        out["bookkeeping_ms"][depth] = 1e3 * float(np.median(_bookkeeping(ctx, n_gen)))
    if failed_decode:
        out["failed_decode_ms"] = _failed_decode_ms(ctx_factory, failed_decode)
    return out


def depth_probe_table(results: dict[str, dict], depths: Sequence[int]) -> str:
    """A Markdown table of [`probe_depths`][]' results, two rows per Context: ``per token``
    and ``bookkeeping``, ms at each depth, the growth from the first depth to the last, and
    the failed decode (on the ``per token`` row).

    Args:
        results: Context name -> [`probe_depths`][]' result.
        depths: the columns.

    Examples:
        >>> r = {"ms_per_token": {0: 1.0, 8: 1.5}, "bookkeeping_ms": {0: 0.1, 8: 0.1},
        ...      "failed_decode_ms": 2.0, "n_ctx": 16}
        >>> print(depth_probe_table({"reference": r}, (0, 8)))
        | Context | n_ctx | ms | d0 | d8 | d_last/d0 | failed decode (ms) |
        |---|---|---|---|---|---|---|
        | reference | 16 | per token | 1.00 | 1.50 | 1.50 | 2.0 |
        | reference | 16 | bookkeeping | 0.10 | 0.10 | 1.00 |  |
    """
    lines = ["| Context | n_ctx | ms | " + " | ".join(f"d{d}" for d in depths)
             + " | d_last/d0 | failed decode (ms) |",
             "|---|---|---|" + "---|" * len(depths) + "---|---|"]
    for name, res in results.items():
        for what, key in (("per token", "ms_per_token"), ("bookkeeping", "bookkeeping_ms")):
            ms = res[key]
            cols = [f"{ms[d]:.2f}" if d in ms else "-" for d in depths]
            ratio = ms[max(ms)] / ms[0] if 0 in ms else float("nan")
            failed = (f"{res['failed_decode_ms']:.1f}" if key == "ms_per_token"
                      and res["failed_decode_ms"] is not None else "")
            lines.append(f"| {name} | {res['n_ctx']} | {what} | " + " | ".join(cols)
                         + f" | {ratio:.2f} | {failed} |")
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------
# The modes, from the bench's runners
# ---------------------------------------------------------------------------------------------


def _context_factory(runner, n_ctx: int) -> Callable[[], object]:
    """Fresh Contexts like the runner's (class, weights, keyword arguments) with ``n_ctx``
    cells and ``DEPTH_BATCH``-token batches."""
    return lambda: runner.context_cls(runner.hparams, runner.weights, n_ctx=n_ctx,
                                      n_batch=DEPTH_BATCH, n_ubatch=DEPTH_BATCH,
                                      **runner.context_kwargs)


def run_mode(mode: str, ours: dict[str, object], peer: tuple[str, object] | None,
             filler: Callable[[int], np.ndarray], depths: Sequence[int], n_tokens: int,
             runs: int, n_ctx: int = 0, spins: Sequence[int] = (0,)) -> str:
    """The tables of ``--profile mode`` (every mode of [`MODES`][] but ``ops``).

    ``depth`` makes one table, a column per depth; the other modes make theirs at each
    depth in turn, titled by backend and depth (``accelerated @ d4000``).

    Args:
        mode: ``phases``, ``steps``, ``overlap``, ``nodes`` or ``depth``.
        ours: backend name -> [`llamaref.bench.ContextRunner`][llamaref.bench.ContextRunner]
            (``phases`` and ``nodes`` use ``"accelerated"``).
        peer: ``(name, runner)`` of mlx-lm (``phases``, ``overlap``), or None.
        filler: the tokens a cache holds at a depth: ``filler(depth)``, ``(depth,)``.
        depths: ``-d``.
        n_tokens: generated tokens per run (``-n``; ``depth``: timed at each depth).
        runs: timed runs (``-r``; ``depth``: failed decodes timed).
        n_ctx: the cells of ``depth``'s Contexts.
        spins: ``overlap``'s waits in µs.

    Raises:
        ProfileError: an unknown mode, or one the model cannot run (``depth`` on a recurrent
            memory).
    """
    if mode == "depth":
        results = {name: probe_depths(_context_factory(r, n_ctx), depths, n_gen=n_tokens,
                                      failed_decode=runs) for name, r in ours.items()}
        return depth_probe_table(results, depths)
    if mode not in MODES or mode == "ops":
        raise ProfileError(f"--profile {mode}: run_mode runs {', '.join(MODES)} but ops")
    tables = []
    for depth in depths:
        tokens = filler(depth)  # (depth,)
        at = "" if depth == 0 else f" @ d{depth}"
        if mode == "phases":
            tables.append(phases_table(f"accelerated{at}", token_phases(
                ours["accelerated"], tokens, n_tokens), n_tokens))
            if peer is not None:
                tables.append(phases_table(f"{peer[0]}{at}", mlx_lm_phases(
                    peer[1].model, tokens, n_tokens), n_tokens))
        elif mode == "steps":
            tables += [steps_table(f"{name}{at}", *step_times(r, tokens, n_tokens, runs))
                       for name, r in ours.items()]
        elif mode == "overlap":
            runners = {**ours, **dict([peer] if peer is not None else [])}
            tables.append(host_overlap(runners, tokens, n_tokens, spins, runs))
        else:  # nodes
            tables.append(nodes_table(f"accelerated{at}",
                                      count_nodes(ours["accelerated"], tokens)))
    return "\n\n".join(tables)
