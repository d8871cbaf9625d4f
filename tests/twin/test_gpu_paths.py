"""``LLAMAREF_MLX_GPU_PATHS=1``: the CPU device takes every code path a GPU takes.

The MLX twin chooses by device in one function (:func:`accelerated.device.gpu_paths`):
quantized matmul weights and MLX's fused attention on a GPU, dense transposed weights and the
grouped attention on the CPU. With the variable set, a Context on the CPU holds its weights
as a GPU does and its graph calls the fused attention; its logits stay within the attention
threshold of the CPU form's. CI runs the whole twin suite once that way (``.ci/run``).
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

import accelerated.models.llama as acc_llama
from accelerated.context import Context
from accelerated.device import GPU_PATHS_ENV, gpu_paths
from accelerated.models.llama import TransposedWeight, default_matmul
from reference.batch import Batch
from tests.support.tiny_models import nmse, random_weights, tiny_hparams

HP = tiny_hparams(n_layer=2)
W = random_weights(HP, seed=2)


def logits(ctx) -> np.ndarray:
    assert ctx.decode(Batch(token=[1, 4, 9, 2], logits=[True] * 4)) == 0
    return ctx.get_logits()


@pytest.mark.parametrize("value, forced", [("1", True), ("0", False), ("", False)])
def test_the_variable_is_read_in_one_place(monkeypatch, value, forced):
    monkeypatch.setenv(GPU_PATHS_ENV, value)
    on_gpu = mx.default_device() != mx.cpu
    assert gpu_paths() == (forced or on_gpu)
    assert default_matmul() == ("quantized" if forced or on_gpu else "dense")


def test_the_cpu_takes_the_gpu_forms_and_computes_the_same(monkeypatch):
    calls = []
    real = acc_llama.build_attn_mha_heads
    monkeypatch.setattr(acc_llama, "build_attn_mha_heads",
                        lambda *a, **kw: calls.append(1) or real(*a, **kw))
    monkeypatch.delenv(GPU_PATHS_ENV, raising=False)
    if gpu_paths():
        pytest.skip("the default device is a GPU: its paths are the GPU's already")
    cpu = Context(HP, W, n_ctx=32, graph_reuse=False)
    assert isinstance(cpu.mlx_weights["blk.0.attn_q.weight"], TransposedWeight)
    want = logits(cpu)
    assert not calls
    monkeypatch.setenv(GPU_PATHS_ENV, "1")
    gpu = Context(HP, W, n_ctx=32, graph_reuse=False)
    assert isinstance(gpu.mlx_weights["blk.0.attn_q.weight"], mx.array)
    got = logits(gpu)
    assert len(calls) == HP.n_layer
    assert nmse(want, got) < 5e-4
