"""Laws of the reference sampler chain (reference.sampling), without an oracle.

The oracle tests (tests/oracle/test_sampling.py) check each sampler against llama.cpp; these
state what each one means: which candidates survive, what the probabilities are, that the
draws are std::mt19937's, and that the chain checks its inputs before changing any state.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from reference import sampling as S


def distinct_logits(seed: int, n: int, scale: float = 3.0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    pool = np.unique((rng.standard_normal(2 * n + 8) * scale).astype(np.float32))
    return rng.choice(pool, n, replace=False)


logits = st.builds(distinct_logits, st.integers(0, 2**32 - 1), st.integers(2, 200))


# --------------------------------------------------------------------------------------------
# draws
# --------------------------------------------------------------------------------------------

def test_mt19937_is_std_mt19937():
    """The C++ standard fixes it: the 10000th output of a default-seeded mt19937 is 4123659995."""
    rng = S.Mt19937(5489)
    for _ in range(9999):
        rng.next_u32()
    assert rng.next_u32() == 4123659995


@given(seed=st.integers(0, 2**32 - 2))
def test_uniform_double_is_two_outputs_over_2_pow_64(seed):
    a, b = S.Mt19937(seed), S.Mt19937(seed)
    u = a.uniform_double()
    x0, x1 = b.next_u32(), b.next_u32()
    assert 0.0 <= u < 1.0
    assert u == min((x0 + x1 * 2.0**32) / 2.0**64, np.nextafter(1.0, 0.0))


def test_the_default_seed_is_random():
    assert S.get_rng_seed(1234) == 1234
    seeds = {S.get_rng_seed(S.LLAMA_DEFAULT_SEED) for _ in range(8)}
    assert len(seeds) > 1


def test_copy_is_independent():
    rng = S.Mt19937(3)
    twin = rng.copy()
    assert [rng.next_u32() for _ in range(3)] == [twin.next_u32() for _ in range(3)]


# --------------------------------------------------------------------------------------------
# samplers
# --------------------------------------------------------------------------------------------

@given(z=logits)
def test_softmax_is_a_distribution_in_logit_order(z):
    cur = S.TokenDataArray.from_logits(z)
    S.softmax(cur, do_sort=True)
    assert abs(float(cur.p.sum()) - 1.0) < 1e-5
    assert np.all(np.diff(cur.logits) < 0) and np.all(np.diff(cur.p) <= 0)


@given(z=logits, k=st.integers(-2, 250))
def test_top_k_keeps_the_k_largest(z, k):
    cur = S.TokenDataArray.from_logits(z)
    S.top_k(cur, k)
    if k <= 0:
        assert cur.size == z.size and not cur.sorted
    else:
        assert cur.ids.tolist() == np.argsort(-z)[: min(k, z.size)].tolist()


@given(z=logits, p=st.floats(0.01, 0.99))
def test_top_p_keeps_the_smallest_prefix_with_mass_p(z, p):
    cur = S.TokenDataArray.from_logits(z)
    S.top_p(cur, p)
    full = S.TokenDataArray.from_logits(z)
    S.softmax(full, do_sort=True)
    cum = np.cumsum(full.p, dtype=np.float32)
    m = cur.size
    assert cur.ids.tolist() == full.ids[:m].tolist()
    assert m == z.size or cum[m - 1] >= np.float32(p)
    assert m == 1 or cum[m - 2] < np.float32(p)


@given(z=logits, p=st.floats(0.001, 1.0))
def test_min_p_keeps_those_within_factor_p_of_the_top(z, p):
    cur = S.TokenDataArray.from_logits(z)
    S.min_p(cur, p)
    bound = z.max() + np.float32(np.log(np.float32(p)))
    assert cur.ids.tolist() == np.flatnonzero(z >= bound).tolist()  # order kept


@given(z=logits, t=st.floats(0.05, 5.0))
def test_temp_divides(z, t):
    cur = S.TokenDataArray.from_logits(z)
    S.temp(cur, t)
    np.testing.assert_array_equal(cur.logits, z / np.float32(t))


@given(z=logits)
def test_zero_temperature_then_dist_is_greedy(z):
    cur = S.TokenDataArray.from_logits(z)
    S.temp(cur, 0.0)
    S.dist(cur, S.Mt19937(0))
    assert cur.ids[cur.selected] == np.argmax(z)


@given(z=logits, seed=st.integers(0, 2**32 - 2))
def test_dist_picks_where_the_running_mass_reaches_the_draw(z, seed):
    cur = S.TokenDataArray.from_logits(z)
    S.dist(cur, S.Mt19937(seed))
    u = S.Mt19937(seed).uniform_double()
    e = np.exp(z.astype(np.float64) - z.max())
    running = np.cumsum(e)
    i = cur.selected
    assert running[i] >= u * running[-1] * (1 - 1e-6)
    assert i == 0 or running[i - 1] <= u * running[-1] * (1 + 1e-6)


def test_penalties_rule():
    cur = S.TokenDataArray.from_logits([2.0, -2.0, 1.0, 3.0])
    S.penalties(cur, [0, 1, 1, 3], 3, 2.0, 0.5, 0.25)  # the last 3: 1, 1, 3
    assert cur.logits.tolist() == [2.0, -2.0 * 2 - (2 * 0.5 + 0.25), 1.0, 3.0 / 2 - 0.75]
    assert not cur.sorted


def test_dry_penalizes_the_token_that_would_extend_a_repeat():
    """llama.cpp's example: a b c c b c y a b c; 'c' would extend 'a b c' (3), 'y' 'b c' (2)."""
    a, b, c, y = 0, 1, 2, 3
    cur = S.TokenDataArray.from_logits(np.zeros(4, np.float32))
    S.dry(cur, [a, b, c, c, b, c, y, a, b, c], 1.0, 2.0, 2, 64, {})
    assert cur.logits.tolist() == [0.0, 0.0, -(2.0 ** (3 - 2)), -(2.0 ** (2 - 2))]


def test_dry_sequence_breaker_limits_the_repeat():
    """'a b c d a b c d a b': 'c' would extend a 6-token repeat; with 'd' a breaker the repeat
    counts only from the last 'd' (2 tokens)."""
    a, b, c, d = 0, 1, 2, 3
    history = [a, b, c, d, a, b, c, d, a, b]
    free = S.TokenDataArray.from_logits(np.zeros(4, np.float32))
    S.dry(free, history, 1.0, 2.0, 2, 64, {})
    broken = S.TokenDataArray.from_logits(np.zeros(4, np.float32))
    S.dry(broken, history, 1.0, 2.0, 2, 64, {d: [()]})
    assert free.logits[c] == -(2.0 ** (6 - 2)) and broken.logits[c] == -1.0


def test_order_matters():
    """top_p then top_k is not top_k then top_p."""
    z = np.log(np.array([0.4, 0.3, 0.2, 0.1], np.float32))
    first = S.TokenDataArray.from_logits(z)
    S.top_k(first, 2)
    S.top_p(first, 0.7)  # renormalized: 0.57, 0.43 -> both needed
    second = S.TokenDataArray.from_logits(z)
    S.top_p(second, 0.7)  # 0.4 + 0.3 >= 0.7 -> two
    S.top_k(second, 1)
    assert first.ids.tolist() == [0, 1] and second.ids.tolist() == [0]


# --------------------------------------------------------------------------------------------
# the chain
# --------------------------------------------------------------------------------------------

def test_default_order_is_common_h():
    chain = S.SamplerChain.from_params(S.SamplerParams(seed=0, logit_bias={1: 1.0}), 4)
    assert chain.stages == ["logit_bias", "penalties", "dry", "top_n_sigma", "top_k", "typ_p",
                            "top_p", "min_p", "xtc", "temperature", "dist"]
    miro = S.SamplerChain.from_params(S.SamplerParams(seed=0, mirostat=2), 4)
    assert miro.stages == ["temp", "mirostat_v2"]


@given(seed=st.integers(0, 2**32 - 2))
def test_same_seed_same_tokens_and_reset_replays(seed):
    chain = S.SamplerChain.from_params(S.SamplerParams(seed=seed, penalty_repeat=1.2), 50)
    rows = [distinct_logits(i, 50) for i in range(8)]

    def run():
        out = []
        for z in rows:
            out.append(chain.sample(z))
            chain.accept(out[-1])
        return out

    first = run()
    chain.reset()
    assert run() == first


@pytest.mark.parametrize("change, message", [
    ({"penalty_repeat": 0.0}, "penalty_repeat"),
    ({"penalty_freq": float("inf")}, "penalty_freq"),
    ({"mirostat": 3}, "mirostat"),
    ({"samplers": ["top_k", "nucleus"]}, "unknown sampler"),
    ({"logit_bias": {10: 1.0}}, "outside"),
    ({"dry_multiplier": 0.8}, "tokenizer"),
])
def test_invalid_params_are_refused(change, message):
    with pytest.raises(S.SamplingError, match=message):
        S.SamplerChain.from_params(S.SamplerParams(**change), 10)


def test_invalid_inputs_are_refused_before_any_change():
    chain = S.SamplerChain.from_params(S.SamplerParams(seed=1), 10)
    state = chain.rng_dist.copy()
    with pytest.raises(S.SamplingError, match="shape"):
        chain.sample(np.zeros(9, np.float32))
    with pytest.raises(S.SamplingError, match="outside"):
        chain.accept(10)
    assert list(chain.history) == [] and chain.rng_dist.next_u32() == state.next_u32()
