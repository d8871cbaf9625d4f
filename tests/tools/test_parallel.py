"""``reference.tools.parallel`` (llama.cpp's examples/parallel) on both twins.

The law: with greedy sampling every request's tokens are exactly what plain greedy
generation gives for its whole prompt alone (the system prompt, shared or not, then the
request), whatever the schedule: clients starting and ending at different steps
(continuous batching), one KV stream or one per sequence, and a cache so small that
chunks are halved (cache misses > 0) -- on each flavour, and on Mamba / Mamba-2 (the
system prompt's state copied by ``seq_cp``, sequences removed whole). Then llama.cpp's
finish rules, its request draws and its errors.
"""

from __future__ import annotations

import numpy as np
import pytest

from reference.sampling import SamplerChain
from reference.tools.batched import sampler_params
from reference.tools.generate import Generator
from reference.tools.parallel import (
    K_ANSWERS,
    K_PROMPTS,
    K_QUESTIONS,
    K_SYSTEM,
    ParallelError,
    ParallelRun,
    Request,
    make_requests,
)
from tests.support.helpers import ARCHS, FLAVOURS, REF_F64, every_flavour, make, make_mamba


def greedy(flavour):
    """A greedy chain of the flavour's twin (it has ``reset``): ``(sampler, on_device)``."""
    params = sampler_params(temp=0.0, seed=1)
    if flavour.package == "accelerated":
        from accelerated.sampling import SamplerChain as MLXChain

        return MLXChain.from_params(params, 32), True
    return SamplerChain.from_params(params, 32), False


def alone(ctx, flavour, prompt, n: int) -> list[int]:
    sampler, on_device = greedy(flavour)
    gen = Generator(ctx, sampler, shift=False, on_device=on_device)
    gen.eval_prompt(prompt)
    return list(gen.generate(n, lambda t: False))


def scenario(seed: int, n_seq: int, lo: int, hi: int):
    """A system prompt (BOS first) and ``n_seq`` requests of random lengths in [lo, hi)."""
    r = np.random.default_rng(seed)
    system = [1] + [int(t) for t in r.integers(4, 32, 20)]
    reqs = [Request(f"q{i}", 0, "", [int(t) for t in r.integers(4, 32, int(r.integers(lo, hi)))])
            for i in range(n_seq)]
    return system, reqs


def simulate(ctx, flavour, system, reqs, n_clients, n_predict, n_batch, pps, eog=()):
    chains = [greedy(flavour) for _ in range(n_clients)]
    run = ParallelRun(ctx, [c for c, _ in chains], system, reqs, n_predict, n_batch, pps,
                      lambda t: t in eog, lambda t: b"x", on_device=chains[0][1])
    run.run()
    return run


def assert_each_is_alone(run, new_ctx, flavour, system, reqs, pps):
    """Every request's tokens = greedy generation of its whole prompt alone."""
    assert len(run.finished) == len(reqs)
    for f in run.finished:
        prompt = (system if pps else []) + reqs[f.seq_id].tokens
        assert f.tokens == alone(new_ctx(), flavour, prompt, len(f.tokens)), f.seq_id


@every_flavour
@pytest.mark.parametrize("kv_unified", [True, False], ids=["unified", "per-seq"])
@pytest.mark.parametrize("pps", [True, False], ids=["pps", "no-pps"])
def test_every_request_is_plain_greedy_generation(flavour, kv_unified, pps):
    """3 clients, 5 requests, an end-of-generation token that ends some of them early:
    requests start and end at different steps, and join the running batch."""
    system, reqs = scenario(3, 5, 4, 30)
    if not pps:  # the system text is in every request's prompt
        reqs = [Request(r.input, 0, "", system + r.tokens) for r in reqs]
    ctx = make(flavour, n_seq_max=4, kv_unified=kv_unified)
    run = simulate(ctx, flavour, system, reqs, 3, 12, 64, pps, eog=(24,))
    assert sorted(len(f.tokens) for f in run.finished) != [13] * 5  # some ended early
    assert_each_is_alone(run, lambda: make(flavour), flavour, system, reqs, pps)
    assert run.n_total_prompt == sum(len(r.tokens) for r in reqs)
    assert run.n_total_gen == sum(f.n_decoded for f in run.finished)
    assert run.n_cache_miss == 0


@every_flavour
def test_a_full_cache_halves_the_chunk_and_the_texts_do_not_change(flavour):
    """256 cells for 3 clients with long prompts: some chunks do not fit, are halved and
    retried (cache misses), and succeed once a client that finished in an earlier chunk
    has given its cells back. The schedule and the texts stay the greedy ones."""
    system, reqs = scenario(10, 4, 31, 99)
    ctx = make(flavour, n_ctx=256, n_batch=256, n_ubatch=256, n_seq_max=4)
    run = simulate(ctx, flavour, system, reqs, 3, 13, 16, True, eog=(21,))
    assert run.n_cache_miss > 0
    assert [f.n_cache_miss for f in run.finished][-1] == run.n_cache_miss
    assert_each_is_alone(run, lambda: make(flavour), flavour, system, reqs, True)


@pytest.mark.parametrize("flavour", [f for f in FLAVOURS if f.name != "ref-f64"], ids=str)
@pytest.mark.parametrize("arch", ARCHS)
def test_mamba_shares_the_system_state(flavour, arch):
    system, reqs = scenario(5, 4, 4, 20)
    ctx = make_mamba(flavour, arch, n_seq_max=3)
    run = simulate(ctx, flavour, system, reqs, 2, 8, 64, True, eog=(9,))
    assert_each_is_alone(run, lambda: make_mamba(flavour, arch, n_seq_max=1), flavour,
                         system, reqs, True)


def test_finish_rules_are_llamacpps():
    """More than 2 decoded tokens before an end-of-generation token counts; ``User:`` in
    the response ends it (cut there); the sequence goes back to the system prompt."""
    flavour = REF_F64
    system, reqs = scenario(3, 1, 10, 11)
    full = alone(make(flavour), flavour, system + reqs[0].tokens, 13)
    first = full[0]  # an EOG at the first sampled token does not end the request
    ctx = make(flavour, n_seq_max=2)
    run = simulate(ctx, flavour, system, reqs, 1, 12, 64, True, eog=(first,))
    later = [k for k, t in enumerate(full) if t == first and k >= 3]
    k = later[0] if later else 12  # the token sampled after k decodes
    assert run.finished[0].tokens == full[:k + 1] and run.finished[0].n_decoded == k
    assert ctx.memory.seq_pos_max(1) == ctx.memory.seq_pos_max(0) == len(system) - 1

    mark = full[5]
    j = full.index(mark)
    run = ParallelRun(make(flavour, n_seq_max=2), [greedy(flavour)[0]], system, reqs, 12,
                      64, True, lambda t: False, lambda t: b"User:" if t == mark else b"ab")
    run.run()
    assert run.finished[0].response == b"ab" * j  # cut at "User:"
    assert run.finished[0].n_decoded == max(j, 3)


def test_requests_are_drawn_as_llamacpp_draws_them():
    """The first outputs of g++'s ``std::mt19937(1234)`` are 822569775 2137449171
    2671936806 3512589365 1880026316 2629000564 3373089432 3312965625 3349970575 ...: with
    ``--junk 4`` request 0 takes question 6 (% 9), 3 pairs (% 4), pairs 6, 5, 16 (% 20);
    request 1 question 7 and no pair; request 2 question 6 and 3 pairs."""
    reqs = make_requests(3, n_junk=4)
    assert [r.input for r in reqs] == [K_PROMPTS[6], K_PROMPTS[7], K_PROMPTS[6]]
    assert [r.n_junk for r in reqs] == [3, 0, 3]
    pairs = "".join(f"User:\n{K_QUESTIONS[q]}\nAssistant:\n {K_ANSWERS[q]}\n"
                    for q in (6, 5, 16))
    assert reqs[0].prompt == K_SYSTEM + pairs + f"User:\n{K_PROMPTS[6]}\nAssistant:\n"
    shared = make_requests(3, n_junk=4, pps=True)
    assert [r.prompt for r in shared] == [r.prompt[len(K_SYSTEM):] for r in reqs]


@pytest.mark.parametrize(("kw", "n_clients", "n_predict", "message"), [
    (dict(n_seq_max=3), 3, 8, "-np 3 clients need 4 sequences"),
    (dict(n_seq_max=4), 3, 300, "the longest request needs 325 cells"),
    (dict(n_seq_max=4, kv_unified=False), 3, 240, "one sequence's KV stream holds 256"),
])
def test_errors_come_before_any_decode(kw, n_clients, n_predict, message):
    system, reqs = scenario(3, 2, 4, 5)
    ctx = make(REF_F64, **kw)
    with pytest.raises(ParallelError, match=message):
        simulate(ctx, REF_F64, system, reqs, n_clients, n_predict, 64, True)
    assert all(ctx.memory.seq_pos_max(s) == -1 for s in range(ctx.n_seq_max))
