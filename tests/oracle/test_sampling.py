r"""Oracle: every sampler, and seeded chains, against llama.cpp's own (llama-cpp-python 0.3.36).

Each sampler is applied to the same ``llama_token_data_array`` (built with ctypes over a NumPy
structured array) by ``llama_sampler_apply`` and by :mod:`reference.sampling`; the surviving
ids (in order), their logits (bit for bit), their probabilities (float32 rounding), the
selected index and the sorted flag must agree. The chains (``common_sampler_init``'s default
order, and the mirostat ones) draw the same tokens from the same seed over many steps.

Logits are drawn distinct (llama.cpp's ``partial_sort`` leaves the order of ties unspecified).

Every filter of ``llama-sampler.cpp`` compares a float32 quantity with a bound: ``top_p`` stops
at the first running sum ``>= p``, ``typical`` at the first ``> p``, ``min_p`` keeps
``logit >= max + logf(p)``, ``xtc`` removes the top candidates with ``p >= threshold`` (and is
off when ``threshold > 0.5`` or the draw ``> probability``), ``top_n_sigma`` masks
``logit < max - n*std``, ``mirostat_v2`` cuts at ``-log2f(p) > mu``. Random logits essentially
never make the two sides equal, so a ``>=`` written ``>`` passes every property test. Each
sampler's section therefore also has cases where the two sides are equal by construction:

- probabilities that are exact in float32: logits whose ``expf`` is exactly
  $1, \tfrac12, \tfrac14, \tfrac{5}{32}, \tfrac{3}{32}$ sum to 2, so their softmax is exactly
  ``P5`` = 0.5, 0.25, 0.125, 0.078125, 0.046875 and every running sum is exact too;
- bounds set to a value the sampler itself computes (a running sum, a probability, a draw);
- logits placed exactly on a bound, and one float32 step below it.

Each such case checks that llama.cpp itself lands on the boundary (its output size, its exact
probabilities) and that ours does the same (:func:`assert_same`).
"""

from __future__ import annotations

import ctypes

import llama_cpp
import numpy as np
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from llamaref.llamacpp import silence_llama_log
from reference import sampling as S
from reference.model_loader import default_model_path

pytestmark = pytest.mark.oracle

F32 = np.float32

TOKEN_DATA = np.dtype([("id", "<i4"), ("logit", "<f4"), ("p", "<f4")])
assert TOKEN_DATA.itemsize == ctypes.sizeof(llama_cpp.llama_token_data)


# ---------------------------------------------------------------------------------------------
# llama.cpp side
# ---------------------------------------------------------------------------------------------

def lc_apply(smpl, cur: S.TokenDataArray) -> S.TokenDataArray:
    """``llama_sampler_apply(smpl, cur)`` on a copy of ``cur``; the result as ours."""
    buf = np.zeros(cur.size, TOKEN_DATA)
    buf["id"], buf["logit"], buf["p"] = cur.ids, cur.logits, cur.p
    base = buf.ctypes.data
    arr = llama_cpp.llama_token_data_array(
        data=buf.ctypes.data_as(ctypes.POINTER(llama_cpp.llama_token_data)),
        size=cur.size, selected=cur.selected, sorted=cur.sorted)
    llama_cpp.llama_sampler_apply(smpl, ctypes.byref(arr))
    first = (ctypes.cast(arr.data, ctypes.c_void_p).value - base) // TOKEN_DATA.itemsize
    out = buf[first:first + arr.size]
    return S.TokenDataArray(out["id"].copy(), out["logit"].copy(), out["p"].copy(),
                            int(arr.selected), bool(arr.sorted))


class LcSampler:
    """A llama.cpp sampler that frees itself."""

    def __init__(self, ptr):
        assert ptr
        self.ptr = ptr

    def apply(self, cur):
        return lc_apply(self.ptr, cur)

    def accept(self, token):
        llama_cpp.llama_sampler_accept(self.ptr, token)

    def __del__(self):
        llama_cpp.llama_sampler_free(self.ptr)


def lc_chain(samplers: list) -> LcSampler:
    chain = llama_cpp.llama_sampler_chain_init(llama_cpp.llama_sampler_chain_default_params())
    for s in samplers:
        llama_cpp.llama_sampler_chain_add(chain, s)
    return LcSampler(chain)


def lc_logit_bias(n_vocab: int, biases: dict[int, float]):
    arr = (llama_cpp.llama_logit_bias * len(biases))(*[(t, b) for t, b in biases.items()])
    return llama_cpp.llama_sampler_init_logit_bias(n_vocab, len(biases), arr)


class LcVocab:
    """SmolLM2's vocabulary (``vocab_only``), with the tokenizer surface DRY needs."""

    def __init__(self):
        silence_llama_log()
        params = llama_cpp.llama_model_default_params()
        params.vocab_only = True
        self.model = llama_cpp.llama_model_load_from_file(str(default_model_path()).encode(),
                                                          params)
        assert self.model
        self.vocab = llama_cpp.llama_model_get_vocab(self.model)
        self.n_vocab = llama_cpp.llama_vocab_n_tokens(self.vocab)
        self._pieces = [self._piece(i) for i in range(self.n_vocab)]

    def _piece(self, token: int) -> bytes:
        buf = ctypes.create_string_buffer(256)
        n = llama_cpp.llama_token_to_piece(self.vocab, token, buf, 256, 0, True)
        return buf.raw[:n]

    def token_to_piece(self, token: int, special: bool = True) -> bytes:
        assert special  # DRY asks for the special-token text, as llama.cpp's detokenize(.., true)
        return self._pieces[token]

    def tokenize(self, text: bytes, add_special=False, parse_special=False) -> list[int]:
        out = (llama_cpp.llama_token * (len(text) + 8))()
        n = llama_cpp.llama_tokenize(self.vocab, text, len(text), out, len(out), add_special,
                                     parse_special)
        return list(out[:n])


@pytest.fixture(scope="module")
def vocab():
    return LcVocab()

# ---------------------------------------------------------------------------------------------
# inputs: random candidates, and probabilities exact in float32
# ---------------------------------------------------------------------------------------------

def distinct_logits(seed: int, n: int, scale: float) -> np.ndarray:
    """``n`` distinct float32 logits (ties would make llama.cpp's order unspecified)."""
    rng = np.random.default_rng(seed)
    pool = np.unique((rng.standard_normal(2 * n + 8) * scale).astype(np.float32))  # sorted
    return rng.choice(pool, n, replace=False)


@st.composite
def candidates(draw, max_n: int = 300):
    """A candidates array: random logits, unsorted, or sorted (as after ``top_k``)."""
    n = draw(st.integers(1, max_n))
    z = distinct_logits(draw(st.integers(0, 2**32 - 1)), n, draw(st.sampled_from([0.5, 2, 8])))
    cur = S.TokenDataArray.from_logits(z)
    if draw(st.booleans()):
        S.top_k(cur, n)
    return cur


def assert_same(ours: S.TokenDataArray, theirs: S.TokenDataArray) -> None:
    np.testing.assert_array_equal(ours.ids, theirs.ids)
    np.testing.assert_array_equal(ours.logits, theirs.logits)
    np.testing.assert_allclose(ours.p, theirs.p, rtol=2e-6, atol=1e-9)
    assert (ours.selected, ours.sorted) == (theirs.selected, theirs.sorted)


def copy(cur: S.TokenDataArray) -> S.TokenDataArray:
    return S.TokenDataArray(cur.ids.copy(), cur.logits.copy(), cur.p.copy(), cur.selected,
                            cur.sorted)


def check(lc_ptr, ours_fn, cur: S.TokenDataArray) -> S.TokenDataArray:
    theirs = LcSampler(lc_ptr).apply(cur)
    ours = copy(cur)
    ours_fn(ours)
    assert_same(ours, theirs)
    return ours


def both(lc_ptr, ours_fn, cur: S.TokenDataArray) -> S.TokenDataArray:
    """Apply llama.cpp's sampler and ours to copies of ``cur``; they must agree; llama.cpp's."""
    theirs = LcSampler(lc_ptr).apply(cur)
    ours = copy(cur)
    ours_fn(ours)
    assert_same(ours, theirs)
    return theirs


probability = st.sampled_from([0.0, 0.05, 0.3, 0.5, 0.9, 0.95, 0.99, 1.0])


min_keep = st.sampled_from([0, 1, 3])


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


def test_p5_is_exact():
    for sorted_ in (False, True):
        cur = p5(sorted_)
        S.softmax(cur, do_sort=True)
        np.testing.assert_array_equal(cur.p, P5)
    assert np.cumsum(P5, dtype=F32).tolist() == [0.5, 0.75, 0.875, 0.953125, 1.0]

# ---------------------------------------------------------------------------------------------
# greedy and dist: the first maximum; the first running sum that reaches the draw
# ---------------------------------------------------------------------------------------------

@given(cur=candidates())
def test_greedy(cur):
    check(llama_cpp.llama_sampler_init_greedy(), S.greedy, cur)


@pytest.mark.parametrize("z", [[1.0, 4.0, 4.0, 2.0], [4.0, 4.0], [-np.inf, 0.0, 0.0, -1.0]])
def test_greedy_and_zero_temperature_keep_the_first_maximum(z):
    cur = S.TokenDataArray.from_logits(np.array(z, F32))
    first = int(np.argmax(z))
    assert both(llama_cpp.llama_sampler_init_greedy(), S.greedy, cur).selected == first
    for t in (0.0, -1.0):
        theirs = both(llama_cpp.llama_sampler_init_temp(t), lambda c, t=t: S.temp(c, t), cur)
        assert np.flatnonzero(theirs.logits != -np.inf).tolist() == [first]


@given(seed=st.integers(0, 2**32 - 2), n=st.integers(1, 200))
def test_dist_draws_like_llama_cpp(seed, n):
    """Same seed, same candidates: the same selections, step after step (the RNG stream)."""
    theirs = LcSampler(llama_cpp.llama_sampler_init_dist(seed))
    rng = S.Mt19937(seed)
    for step in range(8):
        cur = S.TokenDataArray.from_logits(distinct_logits(seed + step, n, 2.0))
        ours = copy(cur)
        S.dist(ours, rng)
        assert_same(ours, theirs.apply(cur))


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

# ---------------------------------------------------------------------------------------------
# top_k: the k largest
# ---------------------------------------------------------------------------------------------

@given(cur=candidates(), k=st.integers(-1, 320))
def test_top_k(cur, k):
    check(llama_cpp.llama_sampler_init_top_k(k), lambda c: S.top_k(c, k), cur)


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
# top_p: the first running sum >= p (and at least min_keep)
# ---------------------------------------------------------------------------------------------

@given(cur=candidates(), p=probability, keep=min_keep)
def test_top_p(cur, p, keep):
    check(llama_cpp.llama_sampler_init_top_p(p, keep), lambda c: S.top_p(c, p, keep), cur)


@given(seed=st.integers(0, 2**32 - 2), p=probability)
def test_top_p_large_unsorted(seed, p):
    """More than 1024 unsorted candidates: llama.cpp's bucket sort path."""
    cur = S.TokenDataArray.from_logits(distinct_logits(seed, 3000, 3.0))
    check(llama_cpp.llama_sampler_init_top_p(p, 0), lambda c: S.top_p(c, p), cur)


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
# min_p: keep logit >= max + logf(p)
# ---------------------------------------------------------------------------------------------

@given(cur=candidates(), p=probability, keep=min_keep)
def test_min_p(cur, p, keep):
    check(llama_cpp.llama_sampler_init_min_p(p, keep), lambda c: S.min_p(c, p, keep), cur)


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

# ---------------------------------------------------------------------------------------------
# typical: the first running sum > p (strictly), in order of |-log p - H|
# ---------------------------------------------------------------------------------------------

def _typicality(cur: S.TokenDataArray) -> tuple[S.TokenDataArray, np.ndarray]:
    """typical's first steps: the sorted softmax, and each candidate's float32
    ``|-logf(p) - H|`` (the C library's ``logf``, as llama.cpp)."""
    ref = copy(cur)
    S.softmax(ref, do_sort=True)
    logp = S._logf(ref.p)
    entropy = np.cumsum(-ref.p * logp, dtype=F32)[-1]
    return ref, np.abs(-logp - entropy)


@given(cur=candidates(), p=probability, keep=min_keep)
def test_typical(cur, p, keep):
    """Candidates whose typicality ties (equal p, or equally far either side of H) are left
    out, as ties of logits are: llama.cpp's ``std::sort`` orders them as it happens to."""
    score = _typicality(cur)[1]
    assume(np.unique(score).size == score.size)
    check(llama_cpp.llama_sampler_init_typical(p, keep), lambda c: S.typical(c, p, keep), cur)


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
    ref, score = _typicality(cur)
    order = np.argsort(score, kind="stable")
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


@pytest.mark.parametrize("p", [0.1, 0.6])
def test_typical_orders_equal_probabilities_by_logit(p):
    """Logits 0 and -1e-9 differ but have the same ``expf`` (1): equal p, equal typicality.
    llama.cpp sorts by logit first, and its std::sort (insertion sort below 17 elements)
    keeps that order: token 1 (logit 0) comes before token 0."""
    cur = S.TokenDataArray.from_logits(np.array([-1e-9, 0.0, -3.0], F32))
    theirs = both(llama_cpp.llama_sampler_init_typical(p, 0), lambda c: S.typical(c, p), cur)
    assert theirs.ids.tolist()[:2] == [1, 0][: theirs.size]


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

# ---------------------------------------------------------------------------------------------
# temp and temp_ext: logits over a (dynamic) temperature
# ---------------------------------------------------------------------------------------------

@given(cur=candidates(), t=st.sampled_from([-1.0, 0.0, 0.3, 0.8, 1.0, 1.7]))
def test_temp(cur, t):
    check(llama_cpp.llama_sampler_init_temp(t), lambda c: S.temp(c, t), cur)


@given(cur=candidates(), t=st.sampled_from([0.0, 0.5, 0.8, 1.0, 1.5]),
       delta=st.sampled_from([0.0, 0.2, 0.5, 1.0]), exponent=st.sampled_from([0.5, 1.0, 2.0]))
def test_temp_ext(cur, t, delta, exponent):
    check(llama_cpp.llama_sampler_init_temp_ext(t, delta, exponent),
          lambda c: S.temp_ext(c, t, delta, exponent), cur)


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


@pytest.mark.parametrize("z, t, delta, exponent", [
    # glibc's logf(0.94261795) is -0.059094217, one ulp from the correctly rounded -0.05909422:
    # with logf computed in float64 and rounded, the first logit came out 10.604663, not 10.604665
    ([-1.7335205078125, 1.065408706665039], 0.5, 0.5, 2.0),
    ([2.047576427459717, -2.1303813457489014, -4.504391670227051, -14.372381210327148],
     0.5, 0.5, 1.0),  # logf again: 31.962425 for 31.962421
    ([-0.06506262719631195, 0.1581435203552246, 0.07542653381824493, -0.39726534485816956],
     0.5, 0.5, 0.5),  # glibc's expf (in the softmax): 0.15929746 for 0.15929748
    ([0.1789407581090927, 0.13059493899345398, -0.22432757914066315, -0.5112590193748474],
     1.5, 0.2, 0.5),  # glibc's powf: 0.1055821 for 0.10558209
])
def test_temp_ext_takes_the_c_librarys_logf_expf_powf(z, t, delta, exponent):
    r"""Dynamic temperature divides every logit by $T' = T_{\min} + (T_{\max} - T_{\min})\,
    h^{\kappa}$, so one ulp of any ``expf`` (the softmax), ``logf`` (the entropy) or ``powf``
    moves every logit. glibc's are not correctly rounded: in each of these cases float64
    rounded to float32 gave logits 1 to 2 ulp from llama.cpp's, where the C library's own
    functions give them bit for bit (the hypothesis case behind this was 27.067583 for
    llama.cpp's 27.067585)."""
    cur = S.TokenDataArray.from_logits(np.array(z, F32))
    theirs = both(llama_cpp.llama_sampler_init_temp_ext(t, delta, exponent),
                  lambda c: S.temp_ext(c, t, delta, exponent), cur)
    ours = copy(cur)
    S.temp_ext(ours, t, delta, exponent)
    np.testing.assert_array_equal(ours.p, theirs.p)


@given(cur=st.builds(lambda seed, n: S.TokenDataArray.from_logits(distinct_logits(seed, n, 3.0)),
                     st.integers(0, 2**32 - 2), st.integers(2, 300)))
def test_temp_ext_probabilities_bit_for_bit(cur):
    theirs = LcSampler(llama_cpp.llama_sampler_init_temp_ext(0.8, 0.5, 1.0)).apply(cur)
    ours = copy(cur)
    S.temp_ext(ours, 0.8, 0.5, 1.0)
    np.testing.assert_array_equal(ours.p, theirs.p)

# ---------------------------------------------------------------------------------------------
# top_n_sigma: mask logit < max - n*std
# ---------------------------------------------------------------------------------------------

@given(cur=candidates(), n=st.sampled_from([-1.0, 0.5, 1.0, 2.0, 3.0]))
def test_top_n_sigma(cur, n):
    check(llama_cpp.llama_sampler_init_top_n_sigma(n), lambda c: S.top_n_sigma(c, n), cur)


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


@pytest.mark.parametrize("z, kept", [
    ([0.0, 2.0, -np.inf], [-np.inf, 2.0, -np.inf]),  # -inf left out of mean and std: bound 1
    ([-np.inf, -np.inf, -np.inf], [-np.inf, -np.inf, -np.inf]),  # nothing valid: std 0
])
def test_top_n_sigma_with_minus_infinity(z, kept):
    cur = S.TokenDataArray.from_logits(np.array(z, F32))
    theirs = both(llama_cpp.llama_sampler_init_top_n_sigma(1.0), lambda c: S.top_n_sigma(c, 1.0),
                  cur)
    assert theirs.logits.tolist() == kept

# ---------------------------------------------------------------------------------------------
# xtc: remove the top candidates with p >= threshold, but the last of them
# ---------------------------------------------------------------------------------------------

@given(cur=candidates(), seed=st.integers(0, 2**32 - 2),
       p=st.sampled_from([0.3, 0.7, 1.0]), t=st.sampled_from([0.01, 0.1, 0.2, 0.6]),
       keep=st.sampled_from([0, 1, 2]))
def test_xtc(cur, seed, p, t, keep):
    theirs = LcSampler(llama_cpp.llama_sampler_init_xtc(p, t, keep, seed))
    rng = S.Mt19937(seed)
    for _ in range(4):  # the draws advance alike
        ours = copy(cur)
        S.xtc(ours, p, t, keep, rng)
        assert_same(ours, theirs.apply(cur))


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


@pytest.mark.parametrize("threshold", [0.3, 0.5])
def test_xtc_two_candidates_both_above_the_threshold(threshold):
    """Two candidates are enough; when every candidate is above the threshold, all but the
    last are removed."""
    cur = S.TokenDataArray.from_logits(np.array([-1e-9, 0.0], F32))  # p = 0.5, 0.5
    theirs = both(_lc_xtc(1.0, threshold, 0),
                  lambda c: S.xtc(c, 1.0, threshold, 0, S.Mt19937(1)), cur)
    assert theirs.ids.tolist() == [0]

# ---------------------------------------------------------------------------------------------
# mirostat and mirostat_v2: cut at a surprise mu, then draw
# ---------------------------------------------------------------------------------------------

@given(seed=st.integers(0, 2**32 - 2), n=st.integers(2, 300),
       tau=st.sampled_from([1.0, 3.0, 5.0]), eta=st.sampled_from([0.1, 0.5]))
def test_mirostat(seed, n, tau, eta):
    theirs = LcSampler(llama_cpp.llama_sampler_init_mirostat(n, seed, tau, eta, 100))
    rng, mu = S.Mt19937(seed), 2.0 * tau
    for step in range(6):
        cur = S.TokenDataArray.from_logits(distinct_logits(seed + step, n, 3.0))
        ours = copy(cur)
        mu = S.mirostat(ours, rng, mu, n, tau, eta)
        assert_same(ours, theirs.apply(cur))


def test_mirostat_k_overflowing_int_keeps_one_candidate():
    r"""Here $\hat k \approx 2.4 \cdot 10^9$: C's ``int(k)`` is INT_MIN on x86, so top_k(1)."""
    cur = S.TokenDataArray.from_logits(np.array([-2.5094783, -3.4137785], F32))
    theirs = LcSampler(llama_cpp.llama_sampler_init_mirostat(2, 1, 20.0, 0.1, 100)).apply(cur)
    ours = copy(cur)
    S.mirostat(ours, S.Mt19937(1), 40.0, 2, 20.0, 0.1)
    assert_same(ours, theirs)
    assert theirs.size == 1


@given(seed=st.integers(0, 2**32 - 2), n=st.integers(1, 300),
       tau=st.sampled_from([1.0, 3.0, 5.0]), eta=st.sampled_from([0.1, 0.5]))
def test_mirostat_v2(seed, n, tau, eta):
    theirs = LcSampler(llama_cpp.llama_sampler_init_mirostat_v2(seed, tau, eta))
    rng, mu = S.Mt19937(seed), 2.0 * tau
    for step in range(6):
        cur = S.TokenDataArray.from_logits(distinct_logits(seed + step, n, 3.0))
        ours = copy(cur)
        mu = S.mirostat_v2(ours, rng, mu, tau, eta)
        assert_same(ours, theirs.apply(cur))


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
# penalties: repeat, frequency and presence over the last n tokens
# ---------------------------------------------------------------------------------------------

@given(cur=candidates(max_n=60), data=st.data(), last_n=st.sampled_from([-1, 0, 1, 8, 64]),
       repeat=st.sampled_from([1.0, 1.1, 1.5, 0.8]), freq=st.sampled_from([0.0, 0.3]),
       present=st.sampled_from([0.0, 0.5, -0.2]))
def test_penalties(cur, data, last_n, repeat, freq, present):
    history = data.draw(st.lists(st.integers(0, cur.size - 1), max_size=80))
    theirs = LcSampler(llama_cpp.llama_sampler_init_penalties(cur.size, last_n, repeat, freq,
                                                              present))
    for t in history:
        theirs.accept(t)
    ours = copy(cur)
    S.penalties(ours, history, last_n, repeat, freq, present)
    assert_same(ours, theirs.apply(cur))


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

# ---------------------------------------------------------------------------------------------
# logit_bias and dry
# ---------------------------------------------------------------------------------------------

@given(cur=candidates(), data=st.data())
def test_logit_bias(cur, data):
    n = cur.size
    biases = data.draw(st.dictionaries(st.integers(0, n - 1),
                                       st.sampled_from([-np.inf, -2.5, 0.5, 3.0]), max_size=5))
    if biases:
        check(lc_logit_bias(n, biases), lambda c: S.logit_bias(c, biases), cur)


def _dry_history(vocab: LcVocab, data) -> list[int]:
    """A token history with repeats and, sometimes, sequence breakers (newline, colon)."""
    words = [vocab.tokenize(w.encode()) for w in
             (" the cat", " sat", " on the mat", ":", "\n", " cat", " the")]
    pieces = data.draw(st.lists(st.sampled_from(words), min_size=1, max_size=30))
    return [t for piece in pieces for t in piece]


@given(data=st.data(), multiplier=st.sampled_from([0.0, 0.8, 2.0]),
       base=st.sampled_from([0.9, 1.0, 1.75, 3.0]), allowed=st.sampled_from([0, 1, 2, 3]),
       last_n=st.sampled_from([-1, 0, 16, 64]),
       breakers=st.sampled_from([["\n", ":", '"', "*"], ["\n"], ["the cat", ":"], []]))
def test_dry(vocab, data, multiplier, base, allowed, last_n, breakers):
    history = _dry_history(vocab, data)
    c_breakers = (ctypes.c_char_p * max(len(breakers), 1))(*[b.encode() for b in breakers])
    theirs = LcSampler(llama_cpp.llama_sampler_init_dry(
        vocab.vocab, multiplier, base, allowed, last_n, c_breakers, len(breakers)))
    for t in history:
        theirs.accept(t)
    processed = S.dry_sequence_breakers(vocab, breakers) if multiplier != 0 else {}
    z = distinct_logits(len(history), vocab.n_vocab, 2.0)
    cur = S.TokenDataArray.from_logits(z)
    ours = copy(cur)
    S.dry(ours, history, multiplier, base, allowed, last_n, processed)
    assert_same(ours, theirs.apply(cur))

@pytest.mark.parametrize("history, allowed, penalties", [
    ([0, 0, 0, 0], 2, {0: 2.0}),  # a run: the match one token back is 3 long, 2 ** (3 - 2)
    ([0, 1], 0, {1: 1.0}),  # allowed length 0: a match of length 0 still counts, 2 ** 0
    ([0, 1, 0, 1, 0], 0, {0: 1.0, 1: 8.0}),
    ([0, 1, 2, 3, 0, 1, 2], 1, {3: 4.0}),
])
def test_dry_runs_and_allowed_length_zero(vocab, history, allowed, penalties):
    """Explicit histories (no breakers): llama.cpp's penalties, and ours the same."""
    theirs = LcSampler(llama_cpp.llama_sampler_init_dry(
        vocab.vocab, 1.0, 2.0, allowed, 64, (ctypes.c_char_p * 1)(), 0))
    for t in history:
        theirs.accept(t)
    cur = S.TokenDataArray.from_logits(np.zeros(8, F32))
    ours = copy(cur)
    S.dry(ours, history, 1.0, 2.0, allowed, 64, {})
    got = theirs.apply(cur)
    assert_same(ours, got)
    want = np.zeros(8, F32)
    want[list(penalties)] = [-v for v in penalties.values()]
    np.testing.assert_array_equal(got.logits, want)


@pytest.mark.parametrize("history, base, allowed, last_n", [
    ([0, 1, 2, 0, 1, 2, 0, 1], 1.0000001, 1, 64),  # base at most 1.000001: exponent not clamped
    ([0, 1], 2.0, 0, 1),  # one token to look at: nothing repeats, but the pass runs
    ([0, 1], 2.0, 2, 64),  # no more tokens than the allowed length: nothing runs
    ([0, 1, 0], 2.0, 2, 64),
    # repeats longer than FLOAT_MAX_LOG / log(base): the exponent is clamped there, and the
    # penalty stays finite (3^80, 1.5^218, 1e20^1); base 2 reaches inf all the same
    ([0, 1] * 60, 3.0, 2, 200), ([0, 1] * 115, 1.5, 2, 300), ([0, 1] * 4, 1e20, 1, 64),
    ([0, 1] * 80, 2.0, 2, 200),
])
def test_dry_edges_and_the_sorted_flag(vocab, history, base, allowed, last_n):
    """Sorted input: llama.cpp clears ``sorted`` only when the penalty pass runs."""
    theirs = LcSampler(llama_cpp.llama_sampler_init_dry(
        vocab.vocab, 1.0, base, allowed, last_n, (ctypes.c_char_p * 1)(), 0))
    for t in history:
        theirs.accept(t)
    cur = S.TokenDataArray.from_logits(np.arange(8, dtype=F32)[::-1].copy())
    S.top_k(cur, 8)
    ours = copy(cur)
    S.dry(ours, history, 1.0, base, allowed, last_n, {})
    assert_same(ours, theirs.apply(cur))


# ---------------------------------------------------------------------------------------------
# empty candidates: the samplers llama.cpp applies to an empty array
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

# ---------------------------------------------------------------------------------------------
# whole chains: common_sampler_init's order, seeded, many steps with accept
# ---------------------------------------------------------------------------------------------

def lc_common_chain(params: S.SamplerParams, n_vocab: int, vocab: LcVocab | None) -> LcSampler:
    """The chain ``common_sampler_init`` builds (no grammar), through the C API."""
    p, out = params, []
    if p.logit_bias:
        out.append(lc_logit_bias(n_vocab, p.logit_bias))
    if p.mirostat:
        out.append(llama_cpp.llama_sampler_init_temp(p.temp))
        out.append(llama_cpp.llama_sampler_init_mirostat(n_vocab, p.seed, p.mirostat_tau,
                                                         p.mirostat_eta, 100)
                   if p.mirostat == 1 else
                   llama_cpp.llama_sampler_init_mirostat_v2(p.seed, p.mirostat_tau,
                                                            p.mirostat_eta))
        return lc_chain(out)
    breakers = (ctypes.c_char_p * 4)(*[b.encode() for b in p.dry_sequence_breakers])
    make = {
        "penalties": lambda: llama_cpp.llama_sampler_init_penalties(
            n_vocab, p.penalty_last_n, p.penalty_repeat, p.penalty_freq, p.penalty_present),
        "dry": lambda: llama_cpp.llama_sampler_init_dry(
            vocab.vocab if vocab else None, p.dry_multiplier, p.dry_base, p.dry_allowed_length,
            p.dry_penalty_last_n, breakers, len(p.dry_sequence_breakers)),
        "top_n_sigma": lambda: llama_cpp.llama_sampler_init_top_n_sigma(p.top_n_sigma),
        "top_k": lambda: llama_cpp.llama_sampler_init_top_k(p.top_k),
        "typ_p": lambda: llama_cpp.llama_sampler_init_typical(p.typ_p, p.min_keep),
        "top_p": lambda: llama_cpp.llama_sampler_init_top_p(p.top_p, p.min_keep),
        "min_p": lambda: llama_cpp.llama_sampler_init_min_p(p.min_p, p.min_keep),
        "xtc": lambda: llama_cpp.llama_sampler_init_xtc(p.xtc_probability, p.xtc_threshold,
                                                        p.min_keep, p.seed),
        "temperature": lambda: llama_cpp.llama_sampler_init_temp_ext(
            p.temp, p.dynatemp_range, p.dynatemp_exponent),
    }
    out += [make[name]() for name in p.samplers]
    out.append(llama_cpp.llama_sampler_init_dist(p.seed))
    return lc_chain(out)


def run_both(params: S.SamplerParams, n_vocab: int, steps: int, vocab=None, logits_seed=0):
    ours = S.SamplerChain.from_params(params, n_vocab, tokenizer=vocab)
    theirs = lc_common_chain(params, n_vocab, vocab)
    rng = np.random.default_rng(logits_seed)
    got, want = [], []
    for _ in range(steps):
        z = (rng.standard_normal(n_vocab) * 3).astype(np.float32)
        if got:  # make repeats likely, so penalties and DRY matter
            z[got[-3:]] += 4.0
        cur = theirs.apply(S.TokenDataArray.from_logits(z))
        want.append(int(cur.ids[cur.selected]))
        got.append(ours.sample(z))
        ours.accept(got[-1])
        theirs.accept(want[-1])
    return got, want


@given(seed=st.integers(0, 2**32 - 2), temp=st.sampled_from([0.0, 0.5, 0.8, 1.5]),
       top_k=st.sampled_from([0, 1, 40]), top_p=st.sampled_from([0.5, 0.95, 1.0]),
       min_p=st.sampled_from([0.0, 0.05, 0.2]),
       penalty_repeat=st.sampled_from([1.0, 1.3]), penalty_freq=st.sampled_from([0.0, 0.4]))
def test_default_chain_draws_like_llama_cpp(seed, temp, top_k, top_p, min_p, penalty_repeat,
                                            penalty_freq):
    params = S.SamplerParams(seed=seed, temp=temp, top_k=top_k, top_p=top_p, min_p=min_p,
                             penalty_repeat=penalty_repeat, penalty_freq=penalty_freq,
                             logit_bias={3: -np.inf, 5: 2.0})
    got, want = run_both(params, 500, 40, logits_seed=seed)
    assert got == want


@settings(max_examples=10)  # a 49152-token vocabulary: each example is ~0.5 s
@given(seed=st.integers(0, 2**32 - 2), xtc_p=st.sampled_from([0.0, 0.5]),
       typ_p=st.sampled_from([1.0, 0.9]), sigma=st.sampled_from([-1.0, 2.0]),
       dynatemp=st.sampled_from([0.0, 0.5]), dry_multiplier=st.sampled_from([0.0, 0.8]))
def test_full_chain_with_every_sampler(vocab, seed, xtc_p, typ_p, sigma, dynatemp,
                                       dry_multiplier):
    params = S.SamplerParams(seed=seed, xtc_probability=xtc_p, typ_p=typ_p, top_n_sigma=sigma,
                             dynatemp_range=dynatemp, dry_multiplier=dry_multiplier,
                             penalty_present=0.3)
    got, want = run_both(params, vocab.n_vocab, 12, vocab=vocab, logits_seed=seed)
    assert got == want


@given(seed=st.integers(0, 2**32 - 2), mirostat=st.sampled_from([1, 2]),
       tau=st.sampled_from([2.0, 5.0]))
def test_mirostat_chains_draw_like_llama_cpp(seed, mirostat, tau):
    params = S.SamplerParams(seed=seed, mirostat=mirostat, mirostat_tau=tau)
    got, want = run_both(params, 300, 30, logits_seed=seed)
    assert got == want
