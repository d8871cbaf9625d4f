"""Three facts about MLX's GPU kernels that the twin works around, checked on the device.

Usage::

    python scripts/mlx_cuda_checks.py     # on a machine where MLX's default device is a GPU

Each check prints what it measured; none needs a model. Found on an NVIDIA H200 with MLX
0.32.4 (``scripts/nvidia_bench.sh``), explained from MLX's source (``mlx/backend/cuda/rope.cu``,
``mlx/backend/common/utils.cpp``):

1. ``mx.fast.rope`` with a vector of offsets adds each offset to the thread's unsigned
   position (``pos.y + batch_offset``), so a negative offset turns into one near 2^32: the
   K-shift of a context shift (negative deltas) rotates by nonsense. The Metal kernel has the
   same expression.
2. On CUDA the block of ``mx.fast.rope``'s general kernel is chosen by
   ``get_block_dims_common``, which gives the third axis up to 2^(10 - log2(n_dims / 2))
   threads; CUDA allows 64, so with ``n_dims < 32`` and 128 or more (token, head-group)
   pairs the launch fails (``cudaGraphAddKernelNode ... invalid argument``).
3. A compiled graph fuses elementwise ops into one kernel that NVRTC compiles with FMA
   contraction, so ``a * b + c`` compiled rounds once where the two kernels round twice: a
   compiled graph and the same ops run one by one agree to float32 rounding, not bit for bit.

And one question, not yet answered on a GPU (added after the H200 run):

4. Does making an array from host data wait for the GPU? MLX puts it in CUDA managed memory,
   and when its allocator hands back a freed device buffer for it, moves that buffer with a
   synchronous ``cudaMemcpy`` first (``mlx/backend/cuda/allocator.cpp``). If that waits for
   the work in flight, every token whose host inputs are larger than 8 bytes (the scalar
   pool's size) waits for the previous token's forward: the pipeline is gone.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np


def check_negative_offsets() -> None:
    """``mx.fast.rope`` by -3 against the rotation by +3 undone (the exact inverse)."""
    x = mx.random.normal((4, 2, 1, 64), key=mx.random.key(0))
    neg = mx.fast.rope(x, 64, traditional=True, base=10000.0, scale=1.0,
                       offset=mx.array([-3, -3, -3, -3], mx.int32))
    back = mx.fast.rope(neg, 64, traditional=True, base=10000.0, scale=1.0,
                        offset=mx.array([3, 3, 3, 3], mx.int32))
    err = float(mx.abs(back - x).max())
    print(f"1. rope by -3 then +3 returns x to {err:.3g} (a correct kernel: ~1e-6)")


def check_block_limit() -> None:
    """``mx.fast.rope`` on 256 tokens of 4 heads, with n_dims 16 and 32."""
    for n_dims in (16, 32):
        x = mx.random.normal((256, 4, 1, n_dims), key=mx.random.key(1))
        try:
            mx.eval(mx.fast.rope(x, n_dims, traditional=True, base=10000.0, scale=1.0,
                                 offset=mx.arange(256, dtype=mx.int32)))
            print(f"2. n_dims {n_dims}, 256 tokens: ran")
        except RuntimeError as e:
            print(f"2. n_dims {n_dims}, 256 tokens: {str(e)[:90]}")


def check_fused_rounding() -> None:
    """``a * b + c`` compiled and op by op: how many of 2^20 results differ in their bits."""
    a, b, c = (mx.random.normal((1 << 20,), key=mx.random.key(i)) for i in (2, 3, 4))
    eager = a * b + c
    fused = mx.compile(lambda a, b, c: a * b + c)(a, b, c)
    a64, b64, c64 = (np.array(t).astype(np.float64) for t in (a, b, c))
    fma = (a64 * b64 + c64).astype(np.float32)  # the product is exact in float64: one rounding
    diff = int(mx.sum(eager != fused))
    like_fma = int(np.sum(np.array(fused) == fma))
    print(f"3. a*b+c compiled vs op by op: {diff} of {1 << 20} differ; "
          f"compiled equals fma in {like_fma}")


def check_host_array_wait() -> None:
    """Time ``mx.array`` from host data while about 50 ms of GPU work is in flight."""
    import time

    gpu = mx.default_device() == mx.gpu
    size, steps = (4096, 60) if gpu else (256, 20)  # tens of milliseconds on an H200
    a = mx.random.normal((size, size), key=mx.random.key(5))
    mx.eval(a)
    for n in (1, 256, 4096):
        host = np.zeros(n, dtype=np.int32)
        freed = mx.arange(n, dtype=mx.int32) + 1  # a device buffer of the same size ...
        mx.eval(freed)
        del freed  # ... back in the allocator's cache, for mx.array to reuse
        y = a
        for _ in range(steps):  # a chain the device takes a while over
            y = (y @ a) * 1e-3
        mx.async_eval(y)
        t0 = time.perf_counter()
        x = mx.array(host)
        t1 = time.perf_counter()
        mx.eval(y)
        t2 = time.perf_counter()
        del x
        print(f"4. {4 * n:6d} bytes from the host: mx.array took {1e3 * (t1 - t0):.3f} ms "
              f"with {1e3 * (t2 - t0):.1f} ms of work in flight (a wait: about the latter)")


if __name__ == "__main__":
    print("device:", mx.default_device(), mx.device_info().get("device_name"))
    check_negative_offsets()
    check_fused_rounding()
    check_host_array_wait()
    check_block_limit()  # last: a failed launch may leave the device unusable
