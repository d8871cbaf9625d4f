"""ggml itself, as an oracle: run one ggml op on the CPU backend through ctypes.

The oracle for the operators is ggml's CPU backend, the very code llama.cpp runs: the shared
libraries shipped in llama-cpp-python's wheel (built from the pinned commit), called through
ctypes on a one-op graph.
"""

from __future__ import annotations

import numpy as np
import pytest


class GgmlCpu:
    """Run one ggml op on the CPU backend: ``ggml("rms_norm", x, params=(1e-5,))``.

    Inputs are NumPy arrays (float32, float16 or int32; ``None`` for an absent tensor) whose
    shapes are reversed into ``ne``; the result is the float32 output in NumPy order, with as
    many dimensions as the largest input. One thread, so that results are deterministic.
    """

    _TYPES = {np.dtype(np.float32): 0, np.dtype(np.float16): 1, np.dtype(np.int32): 26}
    _NE_OFFSET = 16  # offsetof(struct ggml_tensor, ne): enum type, then a pointer

    def __init__(self) -> None:
        import ctypes
        import os

        llama_cpp = pytest.importorskip("llama_cpp")
        lib_dir = os.path.join(os.path.dirname(llama_cpp.__file__), "lib")
        self.ct = ctypes
        self.base = ctypes.CDLL(os.path.join(lib_dir, "libggml-base.so"), mode=ctypes.RTLD_GLOBAL)
        self.cpu = ctypes.CDLL(os.path.join(lib_dir, "libggml-cpu.so"), mode=ctypes.RTLD_GLOBAL)
        p, f32 = ctypes.c_void_p, ctypes.c_float

        class InitParams(ctypes.Structure):
            _fields_ = [
                ("mem_size", ctypes.c_size_t), ("mem_buffer", p), ("no_alloc", ctypes.c_bool),
            ]

        self.InitParams = InitParams
        signatures = {
            "ggml_init": ([InitParams], p), "ggml_free": ([p], None),
            "ggml_new_tensor_4d": ([p, ctypes.c_int] + [ctypes.c_int64] * 4, p),
            "ggml_get_data": ([p], p), "ggml_new_graph": ([p], p),
            "ggml_build_forward_expand": ([p, p], None),
            "ggml_soft_max_ext": ([p, p, p, f32, f32], p), "ggml_rms_norm": ([p, p, f32], p),
            "ggml_norm": ([p, p, f32], p), "ggml_gelu": ([p, p], p), "ggml_silu": ([p, p], p),
            "ggml_mul_mat": ([p, p, p], p), "ggml_add": ([p, p, p], p),
            "ggml_mul": ([p, p, p], p), "ggml_get_rows": ([p, p, p], p),
            "ggml_scale": ([p, p, f32], p),
            "ggml_rope_ext": ([p, p, p, p] + [ctypes.c_int] * 3 + [f32] * 6, p),
            "ggml_ssm_conv": ([p, p, p], p),
            "ggml_ssm_scan": ([p] * 8 + [ctypes.c_int64], p),
        }
        for name, (argtypes, restype) in signatures.items():
            fn = getattr(self.base, name)
            fn.argtypes, fn.restype = argtypes, restype
        compute = self.cpu.ggml_graph_compute_with_ctx
        compute.argtypes, compute.restype = [p, p, ctypes.c_int], ctypes.c_int

    def __call__(self, op: str, *arrays: np.ndarray | None, params: tuple = ()) -> np.ndarray:
        ct, base = self.ct, self.base
        ctx = base.ggml_init(self.InitParams(256 << 20, None, False))
        try:
            tensors = [None if a is None else self._tensor(ctx, a) for a in arrays]
            out = getattr(base, "ggml_" + op)(ctx, *tensors, *params)
            graph = base.ggml_new_graph(ctx)
            base.ggml_build_forward_expand(graph, out)
            assert self.cpu.ggml_graph_compute_with_ctx(ctx, graph, 1) == 0
            ne = list((ct.c_int64 * 4).from_address(out + self._NE_OFFSET))
            ndim = max(a.ndim for a in arrays if a is not None)
            shape = tuple(reversed(ne))[4 - ndim:]  # ggml ne reversed, leading 1s dropped
            data = (ct.c_float * int(np.prod(ne))).from_address(base.ggml_get_data(out))
            return np.ctypeslib.as_array(data).copy().reshape(shape)
        finally:
            base.ggml_free(ctx)

    def _tensor(self, ctx, a: np.ndarray):
        a = np.ascontiguousarray(a)
        ne = list(reversed(a.shape)) + [1] * (4 - a.ndim)
        t = self.base.ggml_new_tensor_4d(ctx, self._TYPES[a.dtype], *ne)
        self.ct.memmove(self.base.ggml_get_data(t), a.ctypes.data, a.nbytes)
        return t


_GGML: list[GgmlCpu] = []


def ggml_cpu() -> GgmlCpu:
    """The shared :class:`GgmlCpu` (skips the test when llama-cpp-python is not installed)."""
    if not _GGML:
        _GGML.append(GgmlCpu())
    return _GGML[0]
