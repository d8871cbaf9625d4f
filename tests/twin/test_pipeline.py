"""The pipelined generation loop on MLX leaves what the sequential loop leaves.

:meth:`reference.tools.generate.Generator.generate` runs ahead on the MLX twin when the sampler can
(``SamplerChain.pipelined``): token $t$ is decoded from the device before it is read back,
and token $t + 1$ sampled behind it. The law: the same tokens, the same cells in the cache,
the same sampler state (history and draws) as the sequential loop on the same Context kind,
for every way generation stops (``n_predict``, an end-of-generation token, the caller
closing the generator, a full context with or without a shift) and when a device step is
redone on the host. A recurrent model (Mamba, Mamba-2) runs ahead too: its step decoded
ahead is undone by putting back the memory's backup, so the cells and the state rows, bit
for bit, are the sequential loop's. Also: the twin's lazy outputs read as the reference's,
and a device token decodes as its host id.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from accelerated import sampling as A
from accelerated.context import Context as MLXContext
from reference.batch import Batch
from reference.sampling import SamplerParams
from reference.testing import random_mamba_weights
from reference.tools.generate import Generator
from tests.support.helpers import cells_of as cells
from tests.support.tiny_models import random_weights, tiny_hparams, tiny_mamba_hparams

HP = tiny_hparams(n_layer=2, n_vocab=64)
W = random_weights(HP, seed=5)
PROMPT = [1, 7, 3, 9]
RECURRENT = {arch: (hp, random_mamba_weights(hp, seed=6)) for arch, hp in (
    ("mamba", tiny_mamba_hparams("mamba", n_vocab=64)),
    ("mamba2", tiny_mamba_hparams("mamba2", n_vocab=64, n_group=2)),
)}
MODELS = ["llama", *RECURRENT]


def run(pipelined: bool, params: SamplerParams, n_predict: int, n_ctx: int = 256,
        eog=(), stop_after: int | None = None, shift: bool = True, prompt=PROMPT,
        model: str = "llama"):
    hp, w = RECURRENT.get(model, (HP, W))
    ctx = MLXContext(hp, w, n_ctx=n_ctx)
    chain = A.SamplerChain.from_params(params, hp.n_vocab)
    gen = Generator(ctx, chain, shift=shift, on_device=True)
    assert gen.pipelined == chain.pipelined
    gen.pipelined = pipelined and gen.pipelined
    gen.eval_prompt(prompt)
    out = []
    it = gen.generate(n_predict, is_eog=lambda t: t in eog)
    for token in it:
        out.append(token)
        if stop_after is not None and len(out) == stop_after:
            it.close()
            break
    return out, gen, ctx, chain


def assert_same_run(a, b) -> None:
    (toks_a, gen_a, ctx_a, ch_a), (toks_b, gen_b, ctx_b, ch_b) = a, b
    assert toks_a == toks_b
    assert gen_a.tokens == gen_b.tokens
    assert gen_a.stopped == gen_b.stopped
    assert cells(ctx_a) == cells(ctx_b)
    assert list(ch_a.history) == list(ch_b.history)
    assert ch_a.rng_dist.uniform_double() == ch_b.rng_dist.uniform_double()  # same draws next
    if ctx_a.recurrent:  # a backup put back: the state rows are the sequential loop's, bit for bit
        for x, y in zip(ctx_a.memory.r_l + ctx_a.memory.s_l,
                        ctx_b.memory.r_l + ctx_b.memory.s_l, strict=True):
            assert np.array(x).tobytes() == np.array(y).tobytes()


SEEDED = SamplerParams(seed=11, temp=0.8, top_k=20)
GREEDY = SamplerParams(seed=3, temp=0.0)


@pytest.mark.parametrize("model", MODELS)
@pytest.mark.parametrize("params", [SEEDED, GREEDY], ids=["seeded", "greedy"])
def test_pipelined_equals_sequential_to_n_predict(params, model, monkeypatch):
    ahead = count_steps_ahead(monkeypatch)
    a = run(True, params, 12, model=model)
    assert ahead[0] == 11  # every step after the first ran ahead, recurrent ones too
    b = run(False, params, 12, model=model)
    assert_same_run(a, b)
    assert len(a[0]) == 12 and len(a[1].tokens) == len(PROMPT) + 11
    assert ctx_perf_counts(a) == ctx_perf_counts(b)


def count_steps_ahead(monkeypatch) -> list[int]:
    """Count the steps the loop decodes ahead (``Generator._decode_ahead``)."""
    calls = [0]
    real = Generator._decode_ahead

    def counted(self, cur):
        calls[0] += 1
        return real(self, cur)

    monkeypatch.setattr(Generator, "_decode_ahead", counted)
    return calls


def ctx_perf_counts(run_):
    return run_[1].perf.n_eval, run_[1].perf.n_p_eval


@pytest.mark.parametrize("model", MODELS)
def test_an_end_of_generation_token_undoes_the_step_decoded_ahead(model):
    toks, *_ = run(False, SEEDED, 10, model=model)
    eog = (toks[4],)
    a, b = run(True, SEEDED, 10, eog=eog, model=model), run(False, SEEDED, 10, eog=eog, model=model)
    assert_same_run(a, b)
    assert a[0][-1] == toks[4] and len(a[1].tokens) == len(PROMPT) + len(a[0]) - 1


@pytest.mark.parametrize("model", MODELS)
def test_closing_the_generator_undoes_the_step_decoded_ahead(model):
    a = run(True, SEEDED, 20, stop_after=5, model=model)
    b = run(False, SEEDED, 20, stop_after=5, model=model)
    assert_same_run(a, b)


@pytest.mark.parametrize("shift", [True, False])
def test_a_full_context_shifts_or_stops_as_the_sequential_loop(shift):
    prompt = list(range(1, 60)) * 4  # 236 tokens: the context (256) fills after 16 more
    a = run(True, SEEDED, 30, n_ctx=256, shift=shift, prompt=prompt)
    b = run(False, SEEDED, 30, n_ctx=256, shift=shift, prompt=prompt)
    assert_same_run(a, b)
    assert (len(a[0]) == 30) == shift


def every_third_device_step_fails(monkeypatch) -> list[int]:
    """Make every third device step claim a failed margin; returns the step counter (reset it
    to 0 between runs)."""
    calls = [0]
    real = A.SamplerChain._device_step

    def flaky(self, z, u):
        token, ok = real(self, z, u)
        calls[0] += 1
        return token, ok & mx.array(calls[0] % 3 != 0)

    monkeypatch.setattr(A.SamplerChain, "_device_step", flaky)
    return calls


@pytest.mark.parametrize("model", MODELS)
def test_a_step_redone_on_the_host_is_undone_and_decoded_again(monkeypatch, model):
    """Every third device step claims a failed margin: the loop undoes the decode that read
    the device's guess and goes on from the host's token."""
    calls = every_third_device_step_fails(monkeypatch)
    a = run(True, SEEDED, 12, model=model)
    calls[0] = 0
    b = run(False, SEEDED, 12, model=model)
    assert a[3].fallbacks >= 3
    assert_same_run(a, b)


PENALTIES = [
    SamplerParams(seed=11, temp=0.8, top_k=20, penalty_last_n=n, penalty_repeat=1.5,
                  penalty_freq=0.4, penalty_present=0.3)
    for n in (1, 2, 8)
] + [SamplerParams(seed=3, temp=0.0, penalty_last_n=3, penalty_present=20.0)]


@pytest.mark.parametrize("params", PENALTIES, ids=["last1", "last2", "last8", "greedy_last3"])
def test_chains_with_penalties_run_ahead_and_equal_the_sequential_loop(params):
    """The penalties read the history, which lacks the token read back last: the chain counts
    the launched, not yet accepted, token from the device, so each step sees the last
    ``penalty_last_n`` tokens as in the sequential loop (the window edges: 1, 2 and 8)."""
    assert A.SamplerChain.from_params(params, HP.n_vocab).pipelined
    a, b = run(True, params, 16), run(False, params, 16)
    assert_same_run(a, b)
    toks = b[0]
    eog = (toks[6],)
    assert_same_run(run(True, params, 16, eog=eog), run(False, params, 16, eog=eog))
    assert_same_run(run(True, params, 16, stop_after=5), run(False, params, 16, stop_after=5))
    assert a[3]._launched == [] and b[3]._launched == []


def test_penalties_with_steps_redone_on_the_host(monkeypatch):
    """A failed margin redoes the step on the host (whose history then has the previous
    token) and takes back the step launched behind it, with its count of the device token."""
    calls = every_third_device_step_fails(monkeypatch)
    a = run(True, PENALTIES[2], 16)
    calls[0] = 0
    b = run(False, PENALTIES[2], 16)
    assert a[3].fallbacks >= 3
    assert_same_run(a, b)
    assert a[3]._launched == []


def test_an_exception_in_the_loop_cancels_the_launched_step(monkeypatch):
    """A step launched and never accepted (the loop raised on the way) leaves no token for
    the next generation's penalties to count, and its draw is taken back."""
    ctx = MLXContext(HP, W, n_ctx=256)
    chain = A.SamplerChain.from_params(PENALTIES[2], HP.n_vocab)
    gen = Generator(ctx, chain, on_device=True)
    gen.eval_prompt(PROMPT)
    draws = chain.rng_dist.copy()
    monkeypatch.setattr(A.SamplerChain, "resolve", lambda self, p: 1 / 0)
    with pytest.raises(ZeroDivisionError):
        next(gen.generate(8, is_eog=lambda t: False))
    assert chain._launched == []
    assert chain.rng_dist.uniform_double() == draws.uniform_double()


def test_chains_with_a_host_only_stage_do_not_run_ahead():
    chain = A.SamplerChain.from_params(SamplerParams(mirostat=2), 64)
    assert not chain.pipelined
    with pytest.raises(A.SamplingError, match="cannot sample ahead"):
        chain.sample_async(mx.zeros((64,)))
    assert A.SamplerChain.from_params(SEEDED, 64).pipelined


@pytest.mark.parametrize("model", MODELS)
def test_a_device_token_decodes_as_its_host_id(model, monkeypatch):
    """The graph reads the device token itself (it is not read back first), recurrent
    models included: the same logits, cells and (Mamba) state rows as the host id's."""
    hp, w = RECURRENT.get(model, (HP, W))
    host, dev = MLXContext(hp, w, n_ctx=64), MLXContext(hp, w, n_ctx=64)
    for ctx in (host, dev):
        assert ctx.decode(Batch(token=PROMPT)) == 0
    from_device = []  # per graph call: were the tokens decode_token's device token?
    real_graph = MLXContext.graph

    def graph(self, key):
        fn = real_graph(self, key)
        return lambda tokens, *args: (from_device.append(tokens is self._token_on_device),
                                      fn(tokens, *args))[1]

    monkeypatch.setattr(MLXContext, "graph", graph)
    token = mx.array([5], dtype=mx.int32)
    assert host.decode_token(5) == 0
    assert dev.decode_token(token) == 0
    assert from_device == [False, True]
    assert np.array_equal(host.get_logits(), dev.get_logits())
    assert cells(host) == cells(dev)
    if host.recurrent:
        for x, y in zip(host.memory.r_l + host.memory.s_l, dev.memory.r_l + dev.memory.s_l,
                        strict=True):
            assert np.array(x).tobytes() == np.array(y).tobytes()


def test_lazy_outputs_read_as_the_reference_rules():
    """n_outputs, the row index rules and a refused batch read without a host copy; a
    refused batch keeps the previous (lazy) outputs; the host copy is made once."""
    ctx = MLXContext(HP, W, n_ctx=64, n_seq_max=2)
    assert ctx.decode(Batch(token=[1, 2, 3], logits=[True, False, True])) == 0
    assert ctx.n_outputs == 2 and ctx._host_stale
    row = np.array(ctx.get_logits_ith_device(-1))
    assert ctx._host_stale  # the device row did not copy the host logits
    assert ctx.decode(Batch(token=[4], pos=[9])) == -1  # refused: outputs kept
    assert np.array_equal(ctx.get_logits_ith(2), row)
    assert not ctx._host_stale and ctx.get_logits().shape == (2, HP.n_vocab)


def test_a_step_launched_behind_another_writes_the_caches_in_place():
    """Decodes launched back to back, each behind one still running: no write copies a cache.

    MLX writes into a buffer in place only when nothing else holds it, and ``mx.async_eval``
    holds the arrays it is given until what it launched has run: the Context launches the
    logits and the last layer's attention output, not the caches (``Context._launch``). A
    copied tensor shows as a peak of MLX's memory of at least its size during the launch; in
    place, a launch allocates only the step's small intermediates. With the caches launched
    too, most of these launches copy.
    """
    hp = tiny_hparams(n_layer=2, n_embd=128, n_head=8, n_head_kv=8, n_vocab=64)
    ctx = MLXContext(hp, random_weights(hp, seed=1), n_ctx=4096, n_batch=512)
    depth = 4000
    rng = np.random.default_rng(0)
    for p0 in range(0, depth, 512):
        n = min(512, depth - p0)
        ctx.decode(Batch(token=rng.integers(0, 64, n).tolist(), pos=list(range(p0, p0 + n))))
    ctx.synchronize()
    tensor_bytes = ctx.memory.k_l[0].nbytes
    peaks = []
    for i in range(8):  # launched one behind the other: nothing is read in between
        before = mx.get_active_memory()
        mx.reset_peak_memory()
        assert ctx.decode(Batch(token=[1], pos=[depth + i])) == 0
        peaks.append(mx.get_peak_memory() - before)
    ctx.synchronize()
    assert max(peaks) < tensor_bytes / 2, (peaks, tensor_bytes)
