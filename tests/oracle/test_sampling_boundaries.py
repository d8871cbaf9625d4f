r"""Oracle: the samplers exactly on their boundaries, against llama.cpp (llama-cpp-python 0.3.36).

Every filter of ``llama-sampler.cpp`` compares a float32 quantity with a bound: ``top_p`` stops
at the first running sum ``>= p``, ``typical`` at the first ``> p``, ``min_p`` keeps
``logit >= max + logf(p)``, ``xtc`` removes the top candidates with ``p >= threshold`` (and is
off when ``threshold > 0.5`` or the draw ``> probability``), ``top_n_sigma`` masks
``logit < max - n*std``, ``mirostat_v2`` cuts at ``-log2f(p) > mu``. Random logits (the
property tests of ``tests/oracle/test_sampling.py``) essentially never make the two sides
equal, so a ``>=`` written ``>`` passes all of them. Here the two sides are equal by
construction:

- probabilities that are exact in float32: logits whose ``expf`` is exactly
  $1, \tfrac12, \tfrac14, \tfrac{5}{32}, \tfrac{3}{32}$ sum to 2, so their softmax is exactly
  ``P5`` = 0.5, 0.25, 0.125, 0.078125, 0.046875 and every running sum is exact too;
- bounds set to a value the sampler itself computes (a running sum, a probability, a draw);
- logits placed exactly on a bound, and one float32 step below it.

Each case checks that llama.cpp itself lands on the boundary (its output size, its exact
probabilities) and that ours does the same (:func:`tests.oracle.test_sampling.assert_same`).
"""

from __future__ import annotations

import llama_cpp
import numpy as np
import pytest
from hypothesis import assume, given
from hypothesis import strategies as st

from reference import sampling as S
from tests.oracle.test_sampling import LcSampler, assert_same, copy, distinct_logits

pytestmark = pytest.mark.oracle

F32 = np.float32
P5 = np.array([0.5, 0.25, 0.125, 0.078125, 0.046875], F32)  # exact softmax of exact_logits(P5)
SHUFFLE = [2, 0, 4, 1, 3]  # an unsorted order of the five


def exact_logits(probs) -> np.ndarray:
    """Float32 logits, the largest 0, whose float32 softmax is exactly ``probs``.

    Needs the largest probability to be a power of two (then the weights ``p / p_max`` sum to
    ``1 / p_max`` exactly) and every weight to be a value ``expf`` returns exactly.
    """
    probs = np.asarray(probs, F32)
    out = []
    for w in probs / probs.max():
        z = F32(np.log(w))
        hits = [c for c in (z, np.nextafter(z, F32(0)), np.nextafter(z, F32(-np.inf)))
                if F32(np.exp(np.float64(c))) == w]
        assert hits, f"no float32 logit has expf == {w}"
        out.append(hits[0])
    return np.array(out, F32)


def p5(sorted_: bool) -> S.TokenDataArray:
    """``P5`` as a candidates array, token ``i`` with probability ``P5[i]``: sorted (as after
    ``top_k``) or in the order ``SHUFFLE``."""
    z = exact_logits(P5)
    if sorted_:
        cur = S.TokenDataArray.from_logits(z)
        S.top_k(cur, z.size)
        return cur
    return S.TokenDataArray(np.array(SHUFFLE, np.int32), z[SHUFFLE], np.zeros(5, F32))


def both(lc_ptr, ours_fn, cur: S.TokenDataArray) -> S.TokenDataArray:
    """Apply llama.cpp's sampler and ours to copies of ``cur``; they must agree; llama.cpp's."""
    theirs = LcSampler(lc_ptr).apply(cur)
    ours = copy(cur)
    ours_fn(ours)
    assert_same(ours, theirs)
    return theirs


def test_p5_is_exact():
    for sorted_ in (False, True):
        cur = p5(sorted_)
        S.softmax(cur, do_sort=True)
        np.testing.assert_array_equal(cur.p, P5)
    assert np.cumsum(P5, dtype=F32).tolist() == [0.5, 0.75, 0.875, 0.953125, 1.0]


# ---------------------------------------------------------------------------------------------
# top_p: the first running sum >= p (and at least min_keep)
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("sorted_", [False, True])
@pytest.mark.parametrize("keep", [0, 2, 4])
@pytest.mark.parametrize("k, p", [(0, 0.5), (1, 0.75), (2, 0.875), (3, 0.953125)])
def test_top_p_stops_where_the_running_sum_equals_p(k, p, keep, sorted_):
    """Running sums 0.5, 0.75, 0.875, 0.953125: p equal to the k-th keeps k + 1 (``>=``)."""
    theirs = both(llama_cpp.llama_sampler_init_top_p(p, keep),
                  lambda c: S.top_p(c, p, keep), p5(sorted_))
    m = max(k + 1, keep)
    assert theirs.size == m and theirs.ids.tolist() == list(range(m))
    np.testing.assert_array_equal(theirs.p, P5[:m])


@given(seed=st.integers(0, 2**32 - 2), n=st.sampled_from([2, 7, 300, 1500]),
       sorted_=st.booleans(), data=st.data())
def test_top_p_with_p_a_running_sum_it_computes(seed, n, sorted_, data):
    """p = the float32 running sum top_p itself reaches at index k (more than 1024 unsorted
    candidates: llama.cpp's partial-sort path)."""
    cur = S.TokenDataArray.from_logits(distinct_logits(seed, n, 2.0))
    if sorted_:
        S.top_k(cur, n)
    ref = copy(cur)  # top_p's own steps: softmax in the current order, then sort
    S.softmax(ref, do_sort=False)
    S.top_k(ref, n)
    cum = np.cumsum(ref.p, dtype=F32)
    p = cum[data.draw(st.integers(0, n - 1))]
    assume(p < 1)
    theirs = both(llama_cpp.llama_sampler_init_top_p(p, 0), lambda c: S.top_p(c, p), cur)
    assert theirs.size == np.flatnonzero(cum >= p)[0] + 1


# ---------------------------------------------------------------------------------------------
# typical: the first running sum > p (strictly), in order of |-log p - H|
# ---------------------------------------------------------------------------------------------

TYPICAL_ORDER = [1, 0, 2, 3, 4]  # P5 by |-log p_i - H|, H = 1.2957: running sums 0.25, 0.75, ...


@pytest.mark.parametrize("sorted_", [False, True])
@pytest.mark.parametrize("keep", [0, 1, 3])
@pytest.mark.parametrize("k, p", [(0, 0.25), (1, 0.75), (2, 0.875), (3, 0.953125)])
def test_typical_needs_a_running_sum_strictly_above_p(k, p, keep, sorted_):
    """p equal to the k-th running sum keeps k + 2 (``>``), and at least min_keep."""
    theirs = both(llama_cpp.llama_sampler_init_typical(p, keep),
                  lambda c: S.typical(c, p, keep), p5(sorted_))
    m = max(k + 2, keep)
    assert theirs.size == m and not theirs.sorted
    assert theirs.ids.tolist() == TYPICAL_ORDER[:m]
    np.testing.assert_array_equal(theirs.p, P5[TYPICAL_ORDER[:m]])


def _typical_running_sums(cur: S.TokenDataArray) -> np.ndarray:
    """typical's steps: sorted softmax, entropy, order by |-log p - H|, float32 running sums."""
    ref = copy(cur)
    S.softmax(ref, do_sort=True)
    logp = np.log(ref.p.astype(np.float64)).astype(F32)
    entropy = np.cumsum(-ref.p * logp, dtype=F32)[-1]
    order = np.argsort(np.abs(-logp - entropy), kind="stable")
    return np.cumsum(ref.p[order], dtype=F32)


@given(seed=st.integers(0, 2**32 - 2), n=st.integers(2, 200), sorted_=st.booleans(),
       data=st.data())
def test_typical_with_p_a_running_sum_it_computes(seed, n, sorted_, data):
    cur = S.TokenDataArray.from_logits(distinct_logits(seed, n, 2.0))
    if sorted_:
        S.top_k(cur, n)
    cum = _typical_running_sums(cur)
    p = cum[data.draw(st.integers(0, n - 1))]
    assume(p < 1)
    theirs = both(llama_cpp.llama_sampler_init_typical(p, 0), lambda c: S.typical(c, p), cur)
    over = np.flatnonzero(cum > p)
    assert theirs.size == (over[0] + 1 if over.size else n)


# ---------------------------------------------------------------------------------------------
# min_p: keep logit >= max + logf(p)
# ---------------------------------------------------------------------------------------------

def _on_the_bound(z_max: float, p: float) -> np.ndarray:
    """max, a logit above the bound, one exactly on it, one a float32 step below, one far below."""
    z_max = F32(z_max)
    bound = z_max + F32(np.log(np.float64(F32(p))))  # float32: max_logit + logf(p)
    return np.array([z_max, z_max - F32(0.0625), bound, np.nextafter(bound, F32(-np.inf)),
                     bound - F32(1)], F32)


@pytest.mark.parametrize("sorted_", [False, True])
@pytest.mark.parametrize("z_max", [0.0, 1.5, -3.25, 12.0])
@pytest.mark.parametrize("p", [0.05, 0.25, 0.5, 0.9])
def test_min_p_keeps_a_logit_exactly_on_the_bound(p, z_max, sorted_):
    z = _on_the_bound(z_max, p)
    cur = S.TokenDataArray.from_logits(z if sorted_ else z[SHUFFLE])
    if sorted_:
        S.top_k(cur, z.size)
    theirs = both(llama_cpp.llama_sampler_init_min_p(p, 0), lambda c: S.min_p(c, p), cur)
    assert sorted(theirs.logits.tolist(), reverse=True) == z[:3].tolist()


@pytest.mark.parametrize("sorted_", [False, True])
@pytest.mark.parametrize("keep", [2, 3, 4, 5])
def test_min_p_min_keep_at_the_count_that_passes(keep, sorted_):
    """Three pass: min_keep 3 still filters in place (unsorted, order kept); 4 and 5 take the
    sorted path, which stops at the first index >= min_keep below the bound."""
    z = _on_the_bound(0.0, 0.25)
    cur = S.TokenDataArray.from_logits(z if sorted_ else z[SHUFFLE])
    if sorted_:
        S.top_k(cur, z.size)
    theirs = both(llama_cpp.llama_sampler_init_min_p(0.25, keep),
                  lambda c: S.min_p(c, 0.25, keep), cur)
    assert theirs.size == max(3, keep)
    assert theirs.sorted == (sorted_ or keep > 3)


# ---------------------------------------------------------------------------------------------
# xtc: remove the top candidates with p >= threshold, but the last of them
# ---------------------------------------------------------------------------------------------

def _lc_xtc(probability: float, threshold: float, keep: int, seed: int = 1):
    return llama_cpp.llama_sampler_init_xtc(probability, threshold, keep, seed)


@pytest.mark.parametrize("sorted_", [False, True])
@pytest.mark.parametrize("j, threshold", [(1, 0.25), (2, 0.125), (3, 0.078125)])
def test_xtc_removes_the_top_candidates_down_to_p_equal_to_the_threshold(j, threshold,
                                                                         sorted_):
    """P5 with threshold P5[j]: the first j candidates are removed, P5[j] stays (``>=``)."""
    theirs = both(_lc_xtc(1.0, threshold, 0),
                  lambda c: S.xtc(c, 1.0, threshold, 0, S.Mt19937(1)), p5(sorted_))
    assert theirs.ids.tolist() == list(range(j, 5))


@pytest.mark.parametrize("keep, applied", [(3, True), (4, False)])
def test_xtc_min_keep_equal_to_what_remains(keep, applied):
    """threshold 0.125 leaves 3 candidates: min_keep 3 allows it (``>=``), 4 does not."""
    theirs = both(_lc_xtc(1.0, 0.125, keep),
                  lambda c: S.xtc(c, 1.0, 0.125, keep, S.Mt19937(1)), p5(False))
    assert theirs.size == (3 if applied else 5)


def test_xtc_threshold_one_half_is_still_on():
    """Two weights ``expf`` rounds to 1 (logits 0 and -1e-9, distinct, so no tie in the
    sort): p = 0.5, 0.5, 0. threshold 0.5 is on (off is ``> 0.5``) and removes the first."""
    cur = S.TokenDataArray.from_logits(np.array([-1e-9, -np.inf, 0.0], F32))
    theirs = both(_lc_xtc(1.0, 0.5, 0), lambda c: S.xtc(c, 1.0, 0.5, 0, S.Mt19937(1)), cur)
    assert theirs.ids.tolist() == [0, 1] and theirs.p.tolist() == [0.5, 0.0]


@pytest.mark.parametrize("seed", [1, 42, 12345])
def test_xtc_applies_when_the_draw_equals_probability(seed):
    """probability = the first ``uniform_real_distribution<float>`` draw: applied (skipped is
    ``draw > probability``); the next draw is compared with the same probability."""
    probability = float(S.Mt19937(seed).uniform_float())
    theirs_s = LcSampler(_lc_xtc(probability, 0.25, 0, seed))
    rng = S.Mt19937(seed)
    sizes = []
    for _ in range(3):
        cur = p5(True)
        ours = copy(cur)
        S.xtc(ours, probability, 0.25, 0, rng)
        theirs = theirs_s.apply(cur)
        assert_same(ours, theirs)
        sizes.append(theirs.size)
    assert sizes[0] == 4


# ---------------------------------------------------------------------------------------------
# top_n_sigma: mask logit < max - n*std
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("z, n, kept", [
    ([0.0, 2.0], 2.0, [0.0, 2.0]),  # mean 1, std 1: the bound 2 - 2*1 = 0 is a logit
    ([2.0, -np.inf, 0.0, -np.inf], 2.0, [2.0, -np.inf, 0.0, -np.inf]),  # -inf not in std
    ([0.0, 2.0], 1.0, [-np.inf, 2.0]),
    ([-1.0, 3.0], 1.0, [-np.inf, 3.0]),  # mean 1, std 2: bound 1
    ([-1.0, 3.0], 2.0, [-1.0, 3.0]),  # bound -1 is a logit
    ([-1.0, 3.0, 1.0], 0.0, [-1.0, 3.0, 1.0]),  # n <= 0: off
    ([5.0], 1.0, [5.0]),
])
def test_top_n_sigma_keeps_a_logit_exactly_on_the_bound(z, n, kept):
    cur = S.TokenDataArray.from_logits(np.array(z, F32))
    theirs = both(llama_cpp.llama_sampler_init_top_n_sigma(n), lambda c: S.top_n_sigma(c, n),
                  cur)
    assert theirs.logits.tolist() == kept


# ---------------------------------------------------------------------------------------------
# ties where the order is specified: greedy and temp <= 0 keep the first maximum
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("z", [[1.0, 4.0, 4.0, 2.0], [4.0, 4.0], [-np.inf, 0.0, 0.0, -1.0]])
def test_greedy_and_zero_temperature_keep_the_first_maximum(z):
    cur = S.TokenDataArray.from_logits(np.array(z, F32))
    first = int(np.argmax(z))
    assert both(llama_cpp.llama_sampler_init_greedy(), S.greedy, cur).selected == first
    for t in (0.0, -1.0):
        theirs = both(llama_cpp.llama_sampler_init_temp(t), lambda c, t=t: S.temp(c, t), cur)
        assert np.flatnonzero(theirs.logits != -np.inf).tolist() == [first]


@pytest.mark.parametrize("k", [0, 1, 2, 3, 4, 5])
def test_top_k_with_ties_at_the_cut(k):
    """Ties at the k-th place: llama.cpp's partial_sort picks any of the tied ids, so the
    kept logits (and k) must agree, and each kept id must carry its own logit."""
    z = np.array([1.0, 3.0, 2.0, 3.0, 2.0], F32)
    cur = S.TokenDataArray.from_logits(z)
    theirs = LcSampler(llama_cpp.llama_sampler_init_top_k(k)).apply(cur)
    ours = copy(cur)
    S.top_k(ours, k)
    np.testing.assert_array_equal(ours.logits, theirs.logits)
    assert (ours.size, ours.sorted) == (theirs.size, theirs.sorted) == (k or 5, k > 0)
    np.testing.assert_array_equal(z[theirs.ids], theirs.logits)
    np.testing.assert_array_equal(z[ours.ids], ours.logits)


# ---------------------------------------------------------------------------------------------
# mirostat_v2: cut at the first surprise -log2 p > mu
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("seed", [0, 7, 99])
@pytest.mark.parametrize("tau", [1.0, 1.5])
def test_mirostat_v2_keeps_a_candidate_whose_surprise_equals_mu(seed, tau):
    """P5's surprises are 1, 2, 3, ...: mu = 2 tau = 2 (or 3) keeps P5[1] (or P5[2]) too."""
    theirs_s = LcSampler(llama_cpp.llama_sampler_init_mirostat_v2(seed, tau, 0.1))
    rng, mu = S.Mt19937(seed), 2.0 * tau
    theirs = theirs_s.apply(p5(False))
    ours = copy(p5(False))
    S.mirostat_v2(ours, rng, mu, tau, 0.1)
    assert_same(ours, theirs)
    assert theirs.size == int(2 * tau)


P3 = np.array([0.5, 0.3125, 0.1875], F32)  # exact too; -log2 of 0.3125 rounds *down* in float32


@pytest.mark.parametrize("k", [1, 2])
def test_mirostat_v2_compares_the_float32_surprise(k):
    """mu = the float32 ``-log2f(P3[k])``, which is below the exact surprise: candidate k is
    kept (its float32 surprise is not ``> mu``), k + 1 is cut."""
    mu = F32(-np.log2(np.float64(P3[k])))
    assert -np.log2(np.float64(P3[k])) > mu
    tau = float(mu / F32(2))
    z = exact_logits(P3)
    cur = S.TokenDataArray.from_logits(z[::-1])
    theirs = LcSampler(llama_cpp.llama_sampler_init_mirostat_v2(3, tau, 0.1)).apply(cur)
    ours = copy(cur)
    S.mirostat_v2(ours, S.Mt19937(3), float(mu), tau, 0.1)
    assert_same(ours, theirs)
    assert theirs.size == k + 1


# ---------------------------------------------------------------------------------------------
# edges the random candidates never draw: empty arrays, -inf logits, two candidates
# ---------------------------------------------------------------------------------------------

EMPTY_OK = {  # samplers llama.cpp applies to an empty array (softmax-based ones assert)
    "greedy": (llama_cpp.llama_sampler_init_greedy, S.greedy),
    "min_p": (lambda: llama_cpp.llama_sampler_init_min_p(0.05, 0), lambda c: S.min_p(c, 0.05)),
    "top_k": (lambda: llama_cpp.llama_sampler_init_top_k(5), lambda c: S.top_k(c, 5)),
    "temp": (lambda: llama_cpp.llama_sampler_init_temp(0.0), lambda c: S.temp(c, 0.0)),
    "top_n_sigma": (lambda: llama_cpp.llama_sampler_init_top_n_sigma(1.0),
                    lambda c: S.top_n_sigma(c, 1.0)),
    "xtc": (lambda: _lc_xtc(1.0, 0.1, 0), lambda c: S.xtc(c, 1.0, 0.1, 0, S.Mt19937(1))),
    "dist": (lambda: llama_cpp.llama_sampler_init_dist(1), lambda c: S.dist(c, S.Mt19937(1))),
}


@pytest.mark.parametrize("name", sorted(EMPTY_OK))
def test_empty_candidates(name):
    make, ours_fn = EMPTY_OK[name]
    empty = S.TokenDataArray(np.zeros(0, np.int32), np.zeros(0, F32), np.zeros(0, F32))
    both(make(), ours_fn, empty)


@pytest.mark.parametrize("sorted_", [False, True])
@pytest.mark.parametrize("p", [0.0, -0.5])
@pytest.mark.parametrize("inf", [False, True])
def test_min_p_off_for_p_at_most_zero(p, sorted_, inf):
    """Off before anything is computed: with a +inf logit, p = 0 would give the bound
    ``inf + logf(0)`` = NaN, and the sorted pass would sort."""
    z = distinct_logits(5, 20, 2.0)
    if inf:
        z[7] = np.inf
    cur = S.TokenDataArray.from_logits(z)
    if sorted_:
        S.top_k(cur, 20)
    theirs = both(llama_cpp.llama_sampler_init_min_p(p, 0), lambda c: S.min_p(c, p), cur)
    assert theirs.size == 20 and theirs.sorted == sorted_


def test_min_p_when_every_logit_is_minus_infinity():
    """The unsorted pass starts from ``max_logit = -FLT_MAX`` (not -inf), so nothing passes
    and the sorted pass keeps everything, sorted (in an order of ties llama.cpp leaves open).
    """
    cur = S.TokenDataArray.from_logits(np.full(4, -np.inf, F32))
    theirs = LcSampler(llama_cpp.llama_sampler_init_min_p(0.1, 0)).apply(cur)
    ours = copy(cur)
    S.min_p(ours, 0.1)
    assert (ours.size, ours.sorted) == (theirs.size, theirs.sorted) == (4, True)
    assert sorted(ours.ids.tolist()) == sorted(theirs.ids.tolist())


@pytest.mark.parametrize("p", [0.1, 0.6])
def test_typical_orders_equal_probabilities_by_logit(p):
    """Logits 0 and -1e-9 differ but have the same ``expf`` (1): equal p, equal typicality.
    llama.cpp sorts by logit first, and its std::sort (insertion sort below 17 elements)
    keeps that order: token 1 (logit 0) comes before token 0."""
    cur = S.TokenDataArray.from_logits(np.array([-1e-9, 0.0, -3.0], F32))
    theirs = both(llama_cpp.llama_sampler_init_typical(p, 0), lambda c: S.typical(c, p), cur)
    assert theirs.ids.tolist()[:2] == [1, 0][: theirs.size]


@pytest.mark.parametrize("z", [[1.0, 0.25], [0.5, -np.inf, 2.0, -np.inf]])
def test_temp_ext_two_candidates_and_zero_probabilities(z):
    """Two candidates are enough for dynatemp; p = 0 (a -inf logit) is left out of the
    entropy (``if (prob > 0)``). Probabilities bit for bit."""
    cur = S.TokenDataArray.from_logits(np.array(z, F32))
    theirs = both(llama_cpp.llama_sampler_init_temp_ext(0.8, 0.5, 1.0),
                  lambda c: S.temp_ext(c, 0.8, 0.5, 1.0), cur)
    ours = copy(cur)
    S.temp_ext(ours, 0.8, 0.5, 1.0)
    np.testing.assert_array_equal(ours.p, theirs.p)
    assert ours.p.dtype == F32


@given(cur=st.builds(lambda seed, n: S.TokenDataArray.from_logits(distinct_logits(seed, n, 3.0)),
                     st.integers(0, 2**32 - 2), st.integers(2, 300)))
def test_temp_ext_probabilities_bit_for_bit(cur):
    theirs = LcSampler(llama_cpp.llama_sampler_init_temp_ext(0.8, 0.5, 1.0)).apply(cur)
    ours = copy(cur)
    S.temp_ext(ours, 0.8, 0.5, 1.0)
    np.testing.assert_array_equal(ours.p, theirs.p)


@pytest.mark.parametrize("z, kept", [
    ([0.0, 2.0, -np.inf], [-np.inf, 2.0, -np.inf]),  # -inf left out of mean and std: bound 1
    ([-np.inf, -np.inf, -np.inf], [-np.inf, -np.inf, -np.inf]),  # nothing valid: std 0
])
def test_top_n_sigma_with_minus_infinity(z, kept):
    cur = S.TokenDataArray.from_logits(np.array(z, F32))
    theirs = both(llama_cpp.llama_sampler_init_top_n_sigma(1.0), lambda c: S.top_n_sigma(c, 1.0),
                  cur)
    assert theirs.logits.tolist() == kept


def _penalized(cur, history, repeat, freq, present):
    lc = LcSampler(llama_cpp.llama_sampler_init_penalties(cur.size, 64, repeat, freq, present))
    for t in history:
        lc.accept(t)
    ours = copy(cur)
    S.penalties(ours, history, 64, repeat, freq, present)
    theirs = lc.apply(cur)
    assert_same(ours, theirs)
    assert ours.logits.dtype == F32
    return theirs


@pytest.mark.parametrize("repeat, freq, present, off", [
    (1.0, 0.0, 0.0, True), (2.0, 0.0, 0.0, False), (1.0, 1.0, 0.0, False),
    (1.0, 0.0, 1.0, False)])
def test_penalties_off_only_when_all_three_are_neutral(repeat, freq, present, off):
    """Off: the array is untouched and stays sorted; on: ``sorted`` is cleared."""
    cur = S.TokenDataArray.from_logits(distinct_logits(1, 6, 2.0))
    S.top_k(cur, 6)
    theirs = _penalized(cur, [0, 3, 3], repeat, freq, present)
    assert theirs.sorted == off


@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")
def test_penalties_multiply_a_zero_logit():
    """``logit <= 0`` is multiplied: with an infinite penalty 0 * inf is NaN (0 / inf is 0)."""
    cur = S.TokenDataArray.from_logits(np.array([0.0, 1.0], F32))
    theirs = _penalized(cur, [0, 1], np.inf, 0.0, 0.0)
    assert np.isnan(theirs.logits[0]) and theirs.logits[1] == 0.0


def test_penalties_in_float32():
    """0.7 - (1 * 0.1 + 1 * 0.5) rounds differently in float32 than in double."""
    cur = S.TokenDataArray.from_logits(np.array([0.7, -1.0], F32))
    theirs = _penalized(cur, [0], 1.0, 0.1, 0.5)
    assert theirs.logits[0] == F32(0.7) - (F32(1) * F32(0.1) + F32(1) * F32(0.5))


@pytest.mark.parametrize("threshold", [0.3, 0.5])
def test_xtc_two_candidates_both_above_the_threshold(threshold):
    """Two candidates are enough; when every candidate is above the threshold, all but the
    last are removed."""
    cur = S.TokenDataArray.from_logits(np.array([-1e-9, 0.0], F32))  # p = 0.5, 0.5
    theirs = both(_lc_xtc(1.0, threshold, 0),
                  lambda c: S.xtc(c, 1.0, threshold, 0, S.Mt19937(1)), cur)
    assert theirs.ids.tolist() == [0]


@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")
@pytest.mark.parametrize("z", [distinct_logits(3, 50, 2.0) + F32(60), [1.0, np.inf, 0.5],
                               [np.inf, np.inf]])
def test_dist_far_from_zero_and_at_infinity(z):
    """Large logits need the max subtracted (expf overflows at 88.7); a +inf logit makes
    every weight NaN, no running sum reaches the target, and the last candidate is taken."""
    cur = S.TokenDataArray.from_logits(np.asarray(z, F32))
    theirs = both(llama_cpp.llama_sampler_init_dist(3), lambda c: S.dist(c, S.Mt19937(3)), cur)
    if np.isinf(z).any():
        assert theirs.selected == cur.size - 1


def test_mirostat_k_overflowing_int_keeps_one_candidate():
    r"""Here $\hat k \approx 2.4 \cdot 10^9$: C's ``int(k)`` is INT_MIN on x86, so top_k(1)."""
    cur = S.TokenDataArray.from_logits(np.array([-2.5094783, -3.4137785], F32))
    theirs = LcSampler(llama_cpp.llama_sampler_init_mirostat(2, 1, 20.0, 0.1, 100)).apply(cur)
    ours = copy(cur)
    S.mirostat(ours, S.Mt19937(1), 40.0, 2, 20.0, 0.1)
    assert_same(ours, theirs)
    assert theirs.size == 1


# ---------------------------------------------------------------------------------------------
# Divergence 19: typical with a zero-probability candidate (docs/divergences.md)
# ---------------------------------------------------------------------------------------------

def test_typical_with_a_zero_probability_divergence():
    """A candidate with p = 0 makes llama.cpp's entropy NaN (0 * -inf), so every distance
    |-log p - H| is NaN and ``std::sort`` orders by NaN keys: what it keeps depends on
    libstdc++'s introsort, the zero-probability token included. We take 0 log 0 = 0 (the
    limit): the entropy is that of the other candidates, the zero-probability one sorts last,
    and it changes nothing about which others are kept. Measured: llama.cpp keeps 14 of the 17
    candidates, token 16 (p = 0) among them.
    """
    logits = np.linspace(0.0, -4.0, 17).astype(F32)
    logits[-1] = -np.inf  # p = 0
    cur = S.TokenDataArray.from_logits(logits)
    theirs = LcSampler(llama_cpp.llama_sampler_init_typical(0.5, 1)).apply(copy(cur))
    ours = copy(cur)
    S.typical(ours, 0.5, 1)
    without = S.TokenDataArray.from_logits(logits[:-1])  # the same, the p = 0 token left out
    S.typical(without, 0.5, 1)
    assert ours.ids.tolist() == without.ids.tolist() and 16 not in ours.ids.tolist()
    assert theirs.size == 14 and 16 in theirs.ids.tolist()
