"""The device sampler chain picks exactly the reference chain's token (accelerated.sampling).

The law (see :mod:`accelerated.sampling`): for the same logits, history and seed, every step's
token is the reference's. Steps whose draw or nucleus cut lies within the rounding margin are
redone on the host, so the equality is exact; such steps are rare, which is checked too, so
the device path is what is being tested.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from accelerated import sampling as A
from reference import sampling as R


def distinct_logits(seed: int, n: int, scale: float) -> np.ndarray:
    rng = np.random.default_rng(seed)
    pool = np.unique((rng.standard_normal(2 * n + 8) * scale).astype(np.float32))
    return rng.choice(pool, n, replace=False)


def run_both(params: R.SamplerParams, n_vocab: int, steps: int, seed: int, as_mx: bool = True):
    ref = R.SamplerChain.from_params(params, n_vocab)
    dev = A.SamplerChain.from_params(params, n_vocab)
    got, want = [], []
    for step in range(steps):
        z = distinct_logits(seed + step, n_vocab, 3.0)
        if want:  # make repeats likely, so the penalties matter
            z[want[-2:]] += 2.0
        want.append(ref.sample(z))
        got.append(dev.sample(mx.array(z) if as_mx else z))
        ref.accept(want[-1])
        dev.accept(got[-1])
    return got, want, dev


device_params = st.builds(
    R.SamplerParams,
    seed=st.integers(0, 2**32 - 2),
    temp=st.sampled_from([0.0, -1.0, 0.5, 0.8, 1.0, 1.7]),
    top_k=st.sampled_from([0, 1, 5, 40, 1000]),
    top_p=st.sampled_from([0.3, 0.9, 0.95, 1.0]),
    min_p=st.sampled_from([0.0, 0.05, 0.3]),
    penalty_last_n=st.sampled_from([0, 8, 64]),
    penalty_repeat=st.sampled_from([1.0, 1.2, 0.9]),
    penalty_freq=st.sampled_from([0.0, 0.5]),
    penalty_present=st.sampled_from([0.0, 0.3]),
    logit_bias=st.sampled_from([{}, {2: -np.inf}, {0: 5.0, 7: -1.5}]),
    samplers=st.sampled_from([list(R.DEFAULT_SAMPLERS),
                              ["temperature", "min_p", "top_p", "top_k", "penalties"],
                              ["min_p", "temperature"]]),
)


@given(params=device_params, n_vocab=st.sampled_from([16, 300, 3000]),
       seed=st.integers(0, 2**16))
def test_device_chain_picks_the_reference_token(params, n_vocab, seed):
    got, want, dev = run_both(params, n_vocab, 10, seed)
    assert dev.device_stages is not None  # the device path ran
    assert got == want


def test_fallbacks_are_rare_after_top_k():
    """With the default chain (top_k = 40) the margins are about 1e-5: the device decides
    nearly every step (about 1% fall back)."""
    got, want, dev = run_both(R.SamplerParams(seed=21, penalty_repeat=1.1), 5000, 60, 0)
    assert got == want
    assert dev.fallbacks <= 3


def test_numpy_logits_are_accepted_too():
    got, want, _ = run_both(R.SamplerParams(seed=3), 100, 10, 0, as_mx=False)
    assert got == want


def test_a_draw_on_a_boundary_is_redone_on_the_host():
    """top_p = 0.8 on probabilities 0.5, 0.3, 0.2: the cut is exactly at the threshold, inside
    the margin; every step falls back, and still picks the reference's token."""
    z = np.log(np.array([0.5, 0.3, 0.2], np.float32))
    params = R.SamplerParams(seed=11, top_p=0.8, min_p=0.0, top_k=0, temp=1.0)
    ref, dev = R.SamplerChain.from_params(params, 3), A.SamplerChain.from_params(params, 3)
    for _ in range(20):
        assert dev.sample(mx.array(z)) == ref.sample(z)
    assert dev.fallbacks == 20


def test_the_rng_stays_aligned_after_fallbacks():
    """A fallback rewinds the draw: the streams of both chains stay in step."""
    params = R.SamplerParams(seed=5, top_p=0.8, min_p=0.0, top_k=0, temp=1.0)
    ref, dev = R.SamplerChain.from_params(params, 3), A.SamplerChain.from_params(params, 3)
    boundary = np.log(np.array([0.5, 0.3, 0.2], np.float32))
    assert dev.sample(mx.array(boundary)) == ref.sample(boundary)
    assert dev.rng_dist.next_u32() == ref.rng_dist.next_u32()


@pytest.mark.parametrize("change", [
    {"dry_multiplier": 0.8}, {"typ_p": 0.9}, {"xtc_probability": 0.5}, {"top_n_sigma": 1.0},
    {"dynatemp_range": 0.5}, {"mirostat": 1}, {"mirostat": 2}, {"min_keep": 3},
])
def test_chains_without_a_device_twin_run_on_the_host(change):
    tok = _ByteTokenizer(40)
    params = R.SamplerParams(seed=9, **change)
    ref = R.SamplerChain.from_params(params, 40, tokenizer=tok)
    dev = A.SamplerChain.from_params(params, 40, tokenizer=tok)
    assert dev.device_stages is None
    for step in range(6):
        z = distinct_logits(step, 40, 3.0)
        a, b = ref.sample(z), dev.sample(mx.array(z))
        assert a == b
        ref.accept(a)
        dev.accept(b)


def test_wrong_logits_shape_is_refused():
    dev = A.SamplerChain.from_params(R.SamplerParams(seed=1), 10)
    with pytest.raises(R.SamplingError, match="shape"):
        dev.sample(mx.zeros((11,)))


class _ByteTokenizer:
    """Token i is the byte i (enough for DRY's single-character breakers)."""

    def __init__(self, n_vocab: int):
        self.n_vocab = n_vocab

    def token_to_piece(self, i: int, special: bool = True) -> bytes:
        return bytes([i])

    def tokenize(self, text: bytes, add_special=False, parse_special=False) -> list[int]:
        return list(text)
