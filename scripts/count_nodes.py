"""How many graph nodes one generated token launches in the MLX Context, by primitive.

Usage::

    python scripts/count_nodes.py                  # the tiny Llama
    python scripts/count_nodes.py tiny-mamba       # or tiny-mamba2

Decodes four one-token steps on a shipped tiny model and, at the fourth, writes what the
Context hands ``mx.async_eval`` (the logits and every tensor the step wrote) with
``mx.export_to_dot``: every primitive between the step's inputs and those outputs, as the
compiled graph launches them (fused elementwise ops count as one ``Compiled...`` node). On a
small model each node costs the host a microsecond or two whatever its size
(``docs/performance.md``, "Fewer nodes per token"), so this count is a part of the
per-token time. mlx-lm's counts in the docs were taken the same way on its model call.
"""

from __future__ import annotations

import collections
import io
import re
import sys

import mlx.core as mx

import accelerated.context as mlx_context
from llamaref.bench.tiny import tiny_model
from reference.batch import Batch


class _Capturing:
    """``mlx.core`` as the Context module sees it, with ``async_eval`` writing its graph."""

    def __init__(self, dots: list[str]):
        self._dots = dots

    def __getattr__(self, name):
        real = getattr(mx, name)
        if name != "async_eval":
            return real

        def async_eval(*arrays):
            flat = [a for x in arrays for a in (x if isinstance(x, (list, tuple)) else [x])]
            buf = io.StringIO()
            mx.export_to_dot(buf, *flat)
            self._dots.append(buf.getvalue())
            return real(*arrays)

        return async_eval


def count(name: str) -> collections.Counter:
    """Primitive -> nodes in the fourth generated token's graph of shipped model ``name``."""
    hp, w = tiny_model(name)
    dots: list[str] = []
    real_mx, mlx_context.mx = mlx_context.mx, _Capturing(dots)
    try:
        ctx = mlx_context.Context(hp, w, n_ctx=512)
        for t in range(4):
            dots.clear()
            assert ctx.decode(Batch(token=[t + 1])) == 0
    finally:
        mlx_context.mx = real_mx
    labels = re.findall(r'label ="([^"]+)"', dots[-1])
    return collections.Counter(label.split()[0] for label in labels
                               if not label.startswith("{"))


def main() -> None:
    """The command line: a shipped tiny model's name."""
    name = sys.argv[1] if len(sys.argv) > 1 else "tiny"
    nodes = count(name)
    print(f"{name}: {sum(nodes.values())} nodes")
    for primitive, n in nodes.most_common():
        print(f"{n:5d}  {primitive}")


if __name__ == "__main__":
    main()
