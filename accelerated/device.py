"""Which code path the twin takes on the device it runs on: one function,
[`gpu_paths`][accelerated.device.gpu_paths].

The twin computes some things one way on a GPU (Metal, CUDA) and another on MLX's CPU
device, where a fused kernel is only a fallback made of plain ops:

- the matmul weights
  ([`default_matmul`][accelerated.models.llama.default_matmul]): quantized on a GPU, dense
  and transposed on the CPU;
- the attention ([`build_attn`][accelerated.models.llama.build_attn]): MLX's fused kernel on
  a GPU, [`attn_grouped`][accelerated.models.llama.attn_grouped] on the CPU;
- RoPE ([`rope_fused`][accelerated.ops.rope.rope_fused]): ``mx.fast.rope`` on a GPU, the
  cos/sin cache on the CPU (built once per graph:
  [`graph_rope`][accelerated.models.llama.graph_rope]).

The environment variable ``LLAMAREF_MLX_GPU_PATHS=1`` makes the CPU device take the GPU
forms as well: MLX runs them there too (as their CPU fallbacks), so CI, which has no GPU,
executes the code that Metal and CUDA execute (``.ci/run`` runs the twin's tests once that
way).
"""

from __future__ import annotations

import os

import mlx.core as mx

GPU_PATHS_ENV = "LLAMAREF_MLX_GPU_PATHS"
"""The environment variable that makes the CPU device take the GPU code paths (``1``)."""


# --8<-- [start:gpu_paths]
def gpu_paths() -> bool:
    """Whether the twin takes its GPU code paths: on a GPU device, or when asked to.

    ``LLAMAREF_MLX_GPU_PATHS`` set to a non-zero integer asks for them on the CPU device.
    Read at each call, so a test can set it.

    Examples:
        >>> os.environ[GPU_PATHS_ENV] = "1"
        >>> gpu_paths()
        True
        >>> del os.environ[GPU_PATHS_ENV]
        >>> gpu_paths() == (mx.default_device() != mx.cpu)
        True
    """
    forced = os.environ.get(GPU_PATHS_ENV, "0").strip() or "0"
    return mx.default_device() != mx.cpu or bool(int(forced))
# --8<-- [end:gpu_paths]


# --8<-- [start:on_cuda]
def on_cuda() -> bool:
    """Whether MLX's default device is an NVIDIA GPU (MLX's CUDA backend).

    Some of MLX's CUDA kernels have limits its Metal kernels do not
    ([`accelerated.ops.rope.fast_rope_fits`][accelerated.ops.rope.fast_rope_fits]).

    Examples:
        >>> on_cuda() == (mx.default_device() == mx.gpu and mx.cuda.is_available())
        True
    """
    cuda = getattr(mx, "cuda", None)  # MLX's CUDA module (also in Metal and CPU builds)
    return mx.default_device() == mx.gpu and cuda is not None and cuda.is_available()
# --8<-- [end:on_cuda]
