"""The twin keeps to what MLX's GPU rope kernel computes right (found on an NVIDIA H200).

``mx.fast.rope`` on a GPU turns a negative offset wrong (it adds it to an unsigned
position), and on CUDA fails to launch below 32 rotated dims once a ubatch has 128 tokens
([`accelerated.ops.rope.fast_rope_fits`][]; ``scripts/mlx_cuda_checks.py`` shows both).
MLX's CPU fallback of ``mx.fast.rope`` has neither limit, so these laws watch the calls
themselves: ``mx.fast.rope`` is wrapped to record every offset and rotated width it gets,
on the GPU code paths (``LLAMAREF_MLX_GPU_PATHS=1``), with CUDA pretended where a law is
about CUDA.

- **No negative offset reaches the kernel**: a context shift (deltas of -6) and a positive
  shift on a copy go through the cos/sin cache, and the logits after them equal the
  reference's.
- **On CUDA, few dims never reach it**: a model with 16 rotated dims decodes a 160-token
  prompt (the size that failed on the H200) without one call, and equals the reference; with
  64 dims the kernel is still used.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

import accelerated.ops.rope as A_rope
from accelerated.context import Context as MLXContext
from accelerated.device import GPU_PATHS_ENV
from reference.batch import Batch
from reference.context import Context as RefContext
from reference.context import context_shift
from tests.support.tiny_models import nmse, random_weights, tiny_hparams

TOL = 1e-6  # NMSE, float32 end to end, as tests/twin/test_llama.py


@pytest.fixture
def rope_calls(monkeypatch):
    """Every ``mx.fast.rope`` call's (smallest offset, rotated dims), on the GPU paths."""
    monkeypatch.setenv(GPU_PATHS_ENV, "1")
    calls = []
    fast_rope = mx.fast.rope

    def recording(x, dims, *args, offset, **kwargs):
        calls.append((int(mx.min(mx.array(offset)).item()), dims))
        return fast_rope(x, dims, *args, offset=offset, **kwargs)

    monkeypatch.setattr(mx.fast, "rope", recording)
    return calls


def pair(hp, n_ctx=256):
    """The reference and an eager twin (no compiled graph: the wrapper reads the offsets)."""
    w = random_weights(hp, seed=4)
    kw = dict(n_ctx=n_ctx, n_batch=n_ctx, n_ubatch=n_ctx, n_seq_max=2)
    return RefContext(hp, w, **kw), MLXContext(hp, w, graph_reuse=False, **kw)


def test_a_context_shift_gives_the_kernel_no_negative_offset(rope_calls):
    hp = tiny_hparams(n_layer=2, n_embd=128, n_head=2, n_head_kv=1)  # 64 rotated dims
    ref, acc = pair(hp)
    prompt = np.random.default_rng(5).integers(0, 32, 24).tolist()
    for ctx in (ref, acc):
        assert ctx.decode(Batch(token=prompt[:16])) == 0
        context_shift(ctx, 0, n_keep=2, n_discard=6)  # deltas of -6, applied at the next decode
        ctx.memory.seq_cp(0, 1, -1, -1)
        ctx.memory.seq_add(1, 4, -1, 3)
    n_before = len(rope_calls)
    for t in prompt[16:20]:
        b = Batch(token=[t, t], seq_id=[[0], [1]], logits=[True, True])
        assert ref.decode(b) == 0 and acc.decode(b) == 0
        assert nmse(ref.get_logits(), acc.get_logits()) <= TOL
    assert not acc.memory.get_has_shift()
    assert len(rope_calls) > n_before  # the kernel still turns the new tokens' q and k
    assert min(offset for offset, _ in rope_calls) >= 0


@pytest.mark.parametrize("head_dim", [16, 64])
def test_on_cuda_few_rotated_dims_never_reach_the_kernel(rope_calls, monkeypatch, head_dim):
    monkeypatch.setattr(A_rope, "on_cuda", lambda: True)
    hp = tiny_hparams(n_layer=1, n_embd=2 * head_dim, n_head=2, n_head_kv=1, n_ctx_train=512)
    ref, acc = pair(hp, n_ctx=256)
    prompt = np.random.default_rng(6).integers(0, 32, 160).tolist()
    for ctx in (ref, acc):
        assert ctx.decode(Batch(token=prompt, logits=[True] * len(prompt))) == 0
    assert nmse(ref.get_logits(), acc.get_logits()) <= TOL
    if head_dim < A_rope.CUDA_ROPE_MIN_DIMS:
        assert rope_calls == []
    else:
        assert {dims for _, dims in rope_calls} == {head_dim}
