"""Does a big compiled MLX graph, merely kept alive, slow down the launch of a small one?

Usage::

    python scripts/mlx_big_graph_alive.py            # a 5000-op graph held
    python scripts/mlx_big_graph_alive.py 500        # or another size

Plain MLX, none of our code: a compiled function of 50 small ops is called and launched
(``mx.async_eval``) 2000 times, and the median host time of a call and launch is printed
three times: before, while a compiled function of N ops (traced and run once) is held,
and after it is deleted. On the 2-core VM of ``docs/performance.md`` the middle figure
was 25 to 35 % above the other two for N = 5000. That is why the MLX Context does not
keep the compiled graph of a Mamba prompt, whose scan makes it thousands of nodes
(``accelerated.context.MAMBA_COMPILE_MAX_SEQ_TOKENS``).
"""

from __future__ import annotations

import gc
import statistics
import sys
import time

import mlx.core as mx

W = mx.random.normal((64, 64))


def small(x: mx.array) -> mx.array:
    """50 small ops: a (1, 64) row through sin, a matmul and an add, 50 times."""
    for _ in range(50):
        x = (mx.sin(x) @ W + 1).reshape(1, 64)
    return x


def launch_time(fn) -> float:
    """Median microseconds of ``fn``'s call plus ``mx.async_eval``, the first 500 left out."""
    x = mx.ones((1, 64))
    times = []
    for _ in range(2000):
        t = time.perf_counter()
        y = fn(x)
        mx.async_eval(y)
        times.append(time.perf_counter() - t)
        mx.eval(y)
    return 1e6 * statistics.median(times[500:])


def main() -> None:
    """The command line: the big graph's op count."""
    n_ops = int(sys.argv[1]) if len(sys.argv) > 1 else 5000
    mx.eval(W)
    fn = mx.compile(small)
    print(f"before:          {launch_time(fn):7.1f} us")

    def big(x: mx.array) -> mx.array:
        for _ in range(n_ops):
            x = mx.sin(x[:, :64]) * 2 + x[:, :64]
        return x

    held = mx.compile(big)
    mx.eval(held(mx.ones((8, 64))))
    print(f"{n_ops}-op graph held: {launch_time(fn):7.1f} us")
    del held
    gc.collect()
    print(f"after deleting:  {launch_time(fn):7.1f} us")


if __name__ == "__main__":
    main()
