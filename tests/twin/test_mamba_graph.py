"""The MLX Context runs a Mamba / Mamba-2 ubatch as one compiled graph, reused, bit for bit.

As for Llama (``tests/twin/test_reuse.py``): the graph of a ubatch shape is traced once by
``mx.compile`` and reused; with ``graph_reuse=False`` the same forward runs op by op
(:func:`accelerated.models.mamba.mamba_forward`), and the logits and states are the same bits.
"""

from __future__ import annotations

import numpy as np
import pytest

from accelerated.context import MAMBA_COMPILE_MAX_SEQ_TOKENS, Context
from reference.batch import Batch
from tests.support.tiny_models import random_mamba_weights, tiny_mamba_hparams


def run(hp, w, reuse: bool):
    ctx = Context(hp, w, n_ctx=64, n_seq_max=2, graph_reuse=reuse)
    assert ctx.decode(Batch(token=[1, 2, 3, 4, 5, 6], seq_id=[[0], [1]] * 3,
                            logits=[True] * 6)) == 0
    out = [ctx.get_logits().copy()]
    for t in (7, 8, 9):
        assert ctx.decode(Batch(token=[t, t + 1], seq_id=[[0], [1]], logits=[True, True])) == 0
        out.append(ctx.get_logits().copy())
    assert ctx.decode(Batch(token=[3])) == 0  # one sequence: another shape
    out.append(ctx.get_logits().copy())
    mem = ctx.memory
    return np.concatenate(out), [np.array(t) for t in (*mem.r_l, *mem.s_l)], ctx.perf().n_reused


@pytest.mark.parametrize("arch", ["mamba", "mamba2"])
def test_the_compiled_mamba_graph_is_the_op_by_op_forward(arch):
    hp = tiny_mamba_hparams(arch)
    w = random_mamba_weights(hp, seed=4)
    (logits, states, reused), (want, want_states, none) = run(hp, w, True), run(hp, w, False)
    assert logits.tobytes() == want.tobytes()
    assert all(a.tobytes() == b.tobytes() for a, b in zip(states, want_states, strict=True))
    assert reused == 2 and none == 0  # the three two-sequence steps share one graph


@pytest.mark.parametrize("arch", ["mamba", "mamba2"])
def test_a_prompt_graph_runs_uncompiled_and_is_not_kept(arch):
    """A ubatch of more than MAMBA_COMPILE_MAX_SEQ_TOKENS tokens per sequence (a prompt: its
    graph grows with its tokens) runs the same traced function op by op and is not kept;
    the generation step after it is compiled and kept. The same bits as without reuse."""
    hp = tiny_mamba_hparams(arch)
    w = random_mamba_weights(hp, seed=4)
    n = MAMBA_COMPILE_MAX_SEQ_TOKENS + 1
    prompt = (np.arange(2 * n) % hp.n_vocab).tolist()
    got = {}
    for reuse in (True, False):
        ctx = Context(hp, w, n_ctx=128, n_seq_max=2, graph_reuse=reuse)
        assert ctx.decode(Batch(token=prompt, seq_id=[[0]] * n + [[1]] * n)) == 0
        rows = [ctx.get_logits().copy()]
        if reuse:
            assert not ctx._graphs  # n tokens in each of two sequences: not compiled
        assert ctx.decode(Batch(token=[1, 2], seq_id=[[0], [1]], logits=[True, True])) == 0
        rows.append(ctx.get_logits().copy())
        if reuse:
            assert [(k.n_tokens, k.n_kv) for k in ctx._graphs] == [(2, 2)]
        mem = ctx.memory
        got[reuse] = [a.tobytes() for a in (*rows, *(np.array(t) for t in (*mem.r_l, *mem.s_l)))]
    assert got[True] == got[False]
