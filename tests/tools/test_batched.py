"""``reference.tools.batched`` (llama.cpp's examples/batched) on both twins.

The law: with greedy sampling every stream is exactly what plain greedy generation
(``reference.tools.generate.Generator``) gives for the prompt alone -- on each flavour, with one
KV stream (the prompt's tokens carry every seq id) and with one stream per sequence (the
prompt copied by ``seq_cp``), and on Mamba / Mamba-2 (the state copied by ``seq_cp``).
Seeded sampling too: a stream with seed ``s`` samples what a lone chain with seed ``s``
samples. Then the stop rule, and the errors, raised before anything is decoded.
"""

from __future__ import annotations

import pytest

from reference.sampling import SamplerChain
from reference.tools.batched import BatchedError, batched, n_kv_required, sampler_params
from reference.tools.generate import Generator
from tests.support.helpers import ARCHS, FLAVOURS, MLX, REF_F64, every_flavour, make, make_mamba

PROMPT = [1, 5, 9, 2, 17]
N_PREDICT = 21  # the total length: 16 tokens per stream


def chain(flavour, seed: int = 1, temp: float = 0.0):
    """The stream's chain of the flavour's twin: ``(sampler, on_device)``."""
    params = sampler_params(temp=temp, seed=seed)
    if flavour.package == "accelerated":
        from accelerated.sampling import SamplerChain as MLXChain

        return MLXChain.from_params(params, 32), True
    return SamplerChain.from_params(params, 32), False


def never(token: int) -> bool:
    return False


def alone(ctx, flavour, prompt, n: int, seed: int = 1, temp: float = 0.0) -> list[int]:
    """``n`` tokens of plain generation of ``prompt`` on a fresh ``ctx``."""
    sampler, on_device = chain(flavour, seed, temp)
    gen = Generator(ctx, sampler, shift=False, on_device=on_device)
    gen.eval_prompt(prompt)
    return list(gen.generate(n, never))


def run(ctx, flavour, n_parallel: int, seeds=None, temp: float = 0.0, **kw):
    chains = [chain(flavour, s, temp) for s in (seeds or [1] * n_parallel)]
    return batched(ctx, [c for c, _ in chains], PROMPT, N_PREDICT, never,
                   on_device=chains[0][1], **kw)


@every_flavour
@pytest.mark.parametrize("kv_unified", [True, False], ids=["unified", "per-seq"])
def test_greedy_streams_are_plain_greedy_generation(flavour, kv_unified):
    ctx = make(flavour, n_seq_max=3, kv_unified=kv_unified)
    res = run(ctx, flavour, 3)
    want = alone(make(flavour), flavour, PROMPT, N_PREDICT - len(PROMPT))
    assert res.tokens == [want] * 3
    assert res.finished_at == [N_PREDICT] * 3 and res.n_decode == 3 * len(want)
    # the prompt is in the cache once (unified: shared cells) or once per stream
    cells = sum(int((c.pos >= 0).sum()) for c in ctx.memory.v_cells)
    n_gen = len(want)  # every kept token is decoded (the one sampled at n_predict is not kept)
    assert cells == (len(PROMPT) * (1 if kv_unified else 3)) + 3 * n_gen


@pytest.mark.parametrize("flavour", [f for f in FLAVOURS if f.name != "ref-f64"], ids=str)
@pytest.mark.parametrize("arch", ARCHS)
def test_mamba_streams_share_the_prompt_state(flavour, arch):
    ctx = make_mamba(flavour, arch, n_seq_max=3)
    res = run(ctx, flavour, 3)
    want = alone(make_mamba(flavour, arch, n_seq_max=1), flavour, PROMPT,
                 N_PREDICT - len(PROMPT))
    assert res.tokens == [want] * 3


@pytest.mark.parametrize("flavour", [REF_F64, MLX], ids=str)
def test_seeded_streams_sample_what_a_lone_chain_samples(flavour):
    """Three seeds, temperature 0.8: each stream is its seed's lone generation (and the
    seeds give different texts, so the streams are not copies of one another)."""
    seeds = [11, 12, 13]
    res = run(make(flavour, n_seq_max=3), flavour, 3, seeds=seeds, temp=0.8)
    n = N_PREDICT - len(PROMPT)
    want = [alone(make(flavour), flavour, PROMPT, n, seed=s, temp=0.8) for s in seeds]
    assert res.tokens == want
    assert len({tuple(t) for t in want}) == 3


def test_the_stop_rule_is_llamacpps():
    """An end-of-generation token finishes its stream and is not kept; ``n_predict`` is
    the total length; a prompt of ``n_predict`` tokens samples once and stops."""
    flavour = REF_F64
    ctx = make(flavour, n_seq_max=2)
    full = alone(make(flavour), flavour, PROMPT, N_PREDICT - len(PROMPT))
    eog = full[4]
    chains = [chain(flavour)[0] for _ in range(2)]
    res = batched(ctx, chains, PROMPT, N_PREDICT, lambda t: t == eog)
    k = full.index(eog)
    assert res.tokens == [full[:k]] * 2
    assert res.finished_at == [len(PROMPT) + k] * 2
    res = batched(make(flavour, n_seq_max=2), chains, PROMPT, len(PROMPT), never)
    assert res.tokens == [[], []] and res.n_decode == 0


@pytest.mark.parametrize(("kw", "n_predict", "n_parallel", "message"), [
    (dict(n_seq_max=2), 21, 3, "-np 3 streams but the context holds 2 sequences"),
    (dict(n_seq_max=3), 4, 3, "the prompt has 5 tokens and -n 4"),
    (dict(n_seq_max=3), 100, 3, "n_kv_req (290) > n_ctx (256)"),
    (dict(n_seq_max=3, kv_unified=False), 300, 3, "each stream needs n_predict = 300"),
])
def test_errors_come_before_any_decode(kw, n_predict, n_parallel, message):
    ctx = make(REF_F64, **kw)
    chains = [chain(REF_F64)[0] for _ in range(n_parallel)]
    with pytest.raises(BatchedError, match=message.replace("(", r"\(").replace(")", r"\)")):
        batched(ctx, chains, PROMPT, n_predict, never)
    assert all(ctx.memory.seq_pos_max(s) == -1 for s in range(ctx.n_seq_max))


def test_n_kv_required_is_batched_cpps():
    assert n_kv_required(5, 21, 3) == 5 + 16 * 3
