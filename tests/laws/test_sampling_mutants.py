"""Laws of reference.sampling that no oracle can reach: draws chosen by hand, dtypes.

Mutation testing (docs/mutation.md) left these alive: llama.cpp's RNG cannot be made to
return 0xFFFFFFFF or a draw exactly on a running sum, so these cases feed our samplers a
stub generator and check the libstdc++ rule they implement.
"""

from __future__ import annotations

import numpy as np
import pytest

from reference import sampling as S

F32 = np.float32


class U32(S.Mt19937):
    """An ``Mt19937`` whose 32-bit outputs are given."""

    def __init__(self, *outputs: int):
        self.outputs = list(outputs)

    def next_u32(self) -> int:
        return self.outputs.pop(0)


class Draw:
    """A generator whose ``uniform_double`` draws are given."""

    def __init__(self, *u: float):
        self.u = list(u)

    def uniform_double(self) -> float:
        return self.u.pop(0)


@pytest.mark.parametrize("x, u", [
    (0, 0.0), (2**31, 0.5),
    (2**32 - 129, float(np.nextafter(F32(1), F32(0)))),  # rounds down to 1 - 2^-24 in float32
    (2**32 - 128, float(np.nextafter(F32(1), F32(0)))),  # rounds to 2^32: 1.0, clamped
    (2**32 - 1, float(np.nextafter(F32(1), F32(0)))),
])
def test_uniform_float_is_one_output_over_2_pow_32_clamped_below_one(x, u):
    r"""libstdc++'s ``generate_canonical<float, 24>``: $\mathrm{fl}_{32}(x) / 2^{32}$, and the
    largest float below 1 when that rounds to 1."""
    got = U32(x).uniform_float()
    assert got == F32(u) and got.dtype == F32


def test_uniform_double_clamped_below_one():
    assert U32(2**32 - 1, 2**32 - 1).uniform_double() == np.nextafter(1.0, 0.0)


@pytest.mark.parametrize("u, index", [(0.25, 0), (0.2500001, 1), (1e-9, 0), (0.9999, 1)])
def test_discrete_distribution_normalizes_and_takes_the_lower_bound(u, index):
    r"""Weights 1, 3 (not normalized): $c = (0.25, 1)$; the first $c_i \ge u$."""
    assert S.discrete_distribution(np.array([1.0, 3.0], F32), Draw(u)) == index


@pytest.mark.parametrize("u, index", [(0.5, 0), (0.5000001, 1), (0.75, 1), (0.7500001, 2)])
def test_dist_selects_where_the_running_sum_reaches_the_target(u, index):
    """Weights 1, 1/2, 1/2 (sum 2): the target $2u$ equal to a running sum selects it."""
    cur = S.TokenDataArray.from_logits(np.log(np.array([1.0, 0.5, 0.5], F32)))
    S.dist(cur, Draw(u))
    assert cur.selected == index


def test_xtc_off_at_probability_zero_draws_nothing():
    """``probability <= 0``: off before the draw (a draw of exactly 0 would pass ``<= 0``)."""
    rng = U32(0)
    cur = S.TokenDataArray.from_logits(np.array([0.0, -0.5, -3.0], F32))
    S.xtc(cur, 0.0, 0.1, 0, rng)
    assert cur.size == 3 and rng.outputs == [0]


def test_samplers_keep_float32():
    """``llama_token_data`` holds floats: no sampler may widen logits or p to double."""
    z = np.array([1.5, -0.5, 0.25, 3.0, -2.0], F32)
    runs = {
        "penalties": lambda c: S.penalties(c, [0, 1, 1], 64, 1.1, 0.3, 0.2),
        "temp_ext": lambda c: S.temp_ext(c, 0.8, 0.5, 1.0),
        "top_n_sigma": lambda c: S.top_n_sigma(c, 1.0),
        "typical": lambda c: S.typical(c, 0.9),
        "top_p": lambda c: S.top_p(c, 0.9),
        "dist": lambda c: S.dist(c, S.Mt19937(0)),
        "mirostat_v2": lambda c: S.mirostat_v2(c, S.Mt19937(0), 10.0, 5.0, 0.1),
        "logit_bias": lambda c: S.logit_bias(c, {1: 2.0}),
    }
    for name, run in runs.items():
        for logits in (z, z[:1]):
            cur = S.TokenDataArray.from_logits(logits)
            run(cur)
            assert (cur.logits.dtype, cur.p.dtype) == (F32, F32), (name, logits.size)


def test_dry_sequence_breakers_read_special_token_text():
    """``common_token_to_piece(vocab, i, true)``: a breaker can match a special token's text."""

    class Vocab:
        n_vocab = 3

        def token_to_piece(self, token: int, special: bool = False) -> bytes:
            return [b"a", b"\n", b"<s>" if special else b""][token]

    assert S.dry_sequence_breakers(Vocab(), ["<s>"]) == {2: [()]}
