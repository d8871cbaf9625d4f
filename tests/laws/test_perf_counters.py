"""``Context.perf()`` / ``perf_reset()``: llama.cpp's ``llama_perf_context`` counters.

As ``llama_context::synchronize`` accounts them: a successful decode of one token adds to
*eval* (``n_eval`` += 1, ``t_eval_ms``), a decode of more tokens to *prompt eval*
(``n_p_eval`` += its tokens, ``t_p_eval_ms``); the counts read at least 1 (llama.cpp's
``max(1, n)``); ``t_load_ms`` is fixed by the first decode; failed decodes count nothing;
``perf_reset`` restarts the counters and the clock. Both twins; the reference never reuses
a graph (it builds none), so its ``n_reused`` stays 0.
"""

from __future__ import annotations

import time

import pytest

from accelerated.context import Context as MLXContext
from reference.batch import Batch
from reference.context import Context as RefContext
from reference.context import PerfContextData
from tests.support.tiny_models import random_weights, tiny_hparams

HP = tiny_hparams(n_layer=1, n_ctx_train=4096)
W = random_weights(HP, seed=4)


@pytest.fixture(params=[RefContext, MLXContext], ids=["reference", "accelerated"])
def ctx(request):
    return request.param(HP, W, n_ctx=256, n_batch=64, n_ubatch=4)


def test_fresh_counters_read_like_llama_cpp(ctx):
    p = ctx.perf()
    assert isinstance(p, PerfContextData)
    assert (p.n_p_eval, p.n_eval, p.n_reused) == (1, 1, 0)  # max(1, 0), as llama.cpp
    assert p.t_p_eval_ms == p.t_eval_ms == p.t_load_ms == 0.0
    assert p.p_eval_tokens_per_second == p.eval_tokens_per_second == 0.0


def test_prompt_decodes_and_one_token_decodes_go_to_their_own_counters(ctx):
    assert ctx.decode(Batch(token=list(range(10)))) == 0  # 10 tokens in 3 ubatches: prompt
    p = ctx.perf()
    assert (p.n_p_eval, p.n_eval) == (10, 1) and p.t_p_eval_ms > 0 and p.t_eval_ms == 0
    assert p.t_load_ms > 0
    for t in range(3):
        assert ctx.decode(Batch(token=[t])) == 0
    q = ctx.perf()
    assert (q.n_p_eval, q.n_eval) == (10, 3) and q.t_eval_ms > 0
    assert q.t_p_eval_ms == p.t_p_eval_ms and q.t_load_ms == p.t_load_ms  # fixed once
    assert q.eval_tokens_per_second == pytest.approx(3e3 / q.t_eval_ms)
    assert q.p_eval_tokens_per_second == pytest.approx(1e4 / q.t_p_eval_ms)


def test_failed_decodes_count_nothing(ctx):
    assert ctx.decode(Batch(token=[1, 2])) == 0
    before = ctx.perf()
    assert ctx.decode(Batch(token=[5], pos=[9])) == -1  # a hole in sequence 0
    assert ctx.decode(Batch(token=[99])) == -1  # a token out of the vocabulary
    after = ctx.perf()
    assert (after.n_p_eval, after.n_eval) == (before.n_p_eval, before.n_eval)
    assert after.t_eval_ms == before.t_eval_ms and after.t_p_eval_ms == before.t_p_eval_ms


def test_perf_reset_restarts_counters_and_clock_but_keeps_the_load_time(ctx):
    assert ctx.decode(Batch(token=[1, 2, 3])) == 0
    load, start = ctx.perf().t_load_ms, ctx.perf().t_start_ms
    time.sleep(0.002)
    ctx.perf_reset()
    p = ctx.perf()
    assert (p.n_p_eval, p.n_eval, p.n_reused, p.t_p_eval_ms, p.t_eval_ms) == (1, 1, 0, 0, 0)
    assert p.t_start_ms > start and p.t_load_ms == load


def test_the_reference_builds_no_graph_so_it_reuses_none():
    ref, acc = RefContext(HP, W, n_ctx=256), MLXContext(HP, W, n_ctx=256)
    for ctx in (ref, acc):
        for t in range(5):
            assert ctx.decode(Batch(token=[t])) == 0
    assert ref.perf().n_reused == 0 and acc.perf().n_reused == 4
