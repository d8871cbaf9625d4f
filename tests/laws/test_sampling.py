"""Laws of the reference sampler chain (reference.sampling), without an oracle.

The oracle tests (tests/oracle/test_sampling.py) check each sampler against llama.cpp; these
state what each one means: which candidates survive, what the probabilities are, that the
draws are std::mt19937's, and that the chain checks its inputs before changing any state.
Some cases no oracle can reach: llama.cpp's generator cannot be made to return 0xFFFFFFFF or
a draw exactly on a running sum, so those feed our samplers a stub generator (``U32``,
``Draw``) and check the libstdc++ rule they implement (docs/mutation.md).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import math
import warnings
from types import SimpleNamespace

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from reference import sampling as S

F32 = np.float32


def distinct_logits(seed: int, n: int, scale: float = 3.0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    pool = np.unique((rng.standard_normal(2 * n + 8) * scale).astype(np.float32))
    return rng.choice(pool, n, replace=False)


logits = st.builds(distinct_logits, st.integers(0, 2**32 - 1), st.integers(2, 200))

# --------------------------------------------------------------------------------------------
# draws: std::mt19937 and libstdc++'s distributions
# --------------------------------------------------------------------------------------------

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

def test_uniform_double_clamped_below_one():
    assert U32(2**32 - 1, 2**32 - 1).uniform_double() == np.nextafter(1.0, 0.0)

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

@pytest.mark.parametrize("u, index", [(0.25, 0), (0.2500001, 1), (1e-9, 0), (0.9999, 1)])
def test_discrete_distribution_normalizes_and_takes_the_lower_bound(u, index):
    r"""Weights 1, 3 (not normalized): $c = (0.25, 1)$; the first $c_i \ge u$."""
    assert S.discrete_distribution(np.array([1.0, 3.0], F32), Draw(u)) == index

def test_the_default_seed_is_random():
    assert S.get_rng_seed(1234) == 1234
    seeds = {S.get_rng_seed(S.LLAMA_DEFAULT_SEED) for _ in range(64)}
    assert len(seeds) > 1 and all(0 <= s < 2**32 for s in seeds)  # a 32-bit seed

def test_copy_is_independent():
    rng = S.Mt19937(3)
    twin = rng.copy()
    assert [rng.next_u32() for _ in range(3)] == [twin.next_u32() for _ in range(3)]

# --------------------------------------------------------------------------------------------
# samplers: which candidates survive, with which logits
# --------------------------------------------------------------------------------------------

@given(z=logits)
def test_softmax_is_a_distribution_in_logit_order(z):
    cur = S.TokenDataArray.from_logits(z)
    S.softmax(cur, do_sort=True)
    assert abs(float(cur.p.sum()) - 1.0) < 1e-5
    assert np.all(np.diff(cur.logits) < 0) and np.all(np.diff(cur.p) <= 0)

def test_softmax_of_nothing_is_refused():
    """llama.cpp asserts ``cur_p->size > 0``; here a typed error."""
    empty = S.TokenDataArray(np.zeros(0, np.int32), np.zeros(0, F32), np.zeros(0, F32))
    with pytest.raises(S.SamplingError, match="^softmax of an empty candidates array$"):
        S.softmax(empty, do_sort=True)


def test_candidates_are_int32_ids_and_float32_logits():
    """``llama_token_data``: ``int32_t id``, ``float logit``, ``float p``; one row of logits."""
    cur = S.TokenDataArray.from_logits(np.array([[0.1, 0.2, 0.3]]))  # (1, 3) float64
    assert (cur.ids.dtype, cur.logits.dtype, cur.p.dtype) == (np.int32, F32, F32)
    assert cur.ids.tolist() == [0, 1, 2] and cur.logits.shape == (3,)


def test_sorting_keeps_ties_in_their_current_order():
    """A stable sort (llama.cpp's ``partial_sort`` leaves ties unspecified; we fix the order)."""
    z = np.zeros(100, F32)
    z[::3] = 1
    cur = S.TokenDataArray.from_logits(z)
    S.top_k(cur, 100)
    assert cur.ids.tolist() == [*range(0, 100, 3), *(i for i in range(100) if i % 3)]


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

def test_penalties_rule():
    cur = S.TokenDataArray.from_logits([2.0, -2.0, 1.0, 3.0])
    S.penalties(cur, [0, 1, 1, 3], 3, 2.0, 0.5, 0.25)  # the last 3: 1, 1, 3
    assert cur.logits.tolist() == [2.0, -2.0 * 2 - (2 * 0.5 + 0.25), 1.0, 3.0 / 2 - 0.75]
    assert not cur.sorted

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

# --------------------------------------------------------------------------------------------
# float32 arithmetic: the C library's expf, logf, log2f, powf (and double exp)
# --------------------------------------------------------------------------------------------

def test_the_c_math_library_is_loaded_with_float_signatures():
    """``float expf(float)``, ``logf``, ``log2f``, ``float powf(float, float)``: typed, so
    ctypes passes and returns single precision (an untyped call would pass doubles)."""
    libm = S._load_libm()
    assert libm is not None
    for name, n_args in (("expf", 1), ("logf", 1), ("log2f", 1), ("powf", 2)):
        fn = getattr(libm, name)
        assert fn.restype is ctypes.c_float and fn.argtypes == [ctypes.c_float] * n_args
    assert (libm.expf(0.0), libm.logf(0.5), libm.log2f(0.25), libm.powf(2.0, 0.5)) == (
        1.0, F32(np.log(0.5)), -2.0, F32(np.sqrt(2.0)))


def test_without_a_c_math_library(monkeypatch):
    """No library found, one that fails to load, or one without ``log2f``: None."""
    monkeypatch.setattr(ctypes.util, "find_library", lambda name: None)
    assert S._load_libm() is None
    monkeypatch.setattr(ctypes.util, "find_library", lambda name: "libm-missing.so")
    assert S._load_libm() is None
    no_log2f = SimpleNamespace(expf=SimpleNamespace(), logf=SimpleNamespace(),
                               powf=SimpleNamespace())
    monkeypatch.setattr(ctypes.util, "find_library", lambda name: "libm.so")
    monkeypatch.setattr(ctypes, "CDLL", lambda path: no_log2f)
    assert S._load_libm() is None


HELPERS = [(S._expf, np.exp, [-1.5, 0.0, -np.inf, 88.0]), (S._logf, np.log, [0.3, 1.0, 0.0]),
           (S._log2f, np.log2, [0.3, 0.25, 0.0])]


@pytest.mark.parametrize("libm", [True, False])
@pytest.mark.parametrize("fn, exact, x", HELPERS)
def test_float_helpers_are_elementwise_float32(monkeypatch, libm, fn, exact, x):
    """Any shape in, the same shape out; a scalar gives a ``np.float32``; the float32 argument
    is what C receives. Within an ulp of float64 rounded to float32 (the stand-in without a C
    library, which warns about nothing: ``logf(0)`` is ``-inf``, quietly)."""
    if not libm:
        monkeypatch.setattr(S, "_LIBM", None)
    z = np.array(x, F32)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        got = fn(z.reshape(-1, 1))
        one = fn(float(z[0]))
    with np.errstate(divide="ignore"):
        want = exact(z.astype(np.float64)).astype(F32)
    assert got.shape == (z.size, 1) and got.dtype == F32
    assert isinstance(one, np.float32) and one == got[0, 0]
    np.testing.assert_array_max_ulp(got.ravel(), want, maxulp=1)
    if not libm:
        np.testing.assert_array_equal(got.ravel(), want)


@pytest.mark.parametrize("libm", [True, False])
def test_powf_takes_float32_arguments(monkeypatch, libm):
    """``powf(0.1f, 2.0f)`` is the square of float32 0.1, not of double 0.1; ``powf(0, -1)`` is
    inf, quietly."""
    if not libm:
        monkeypatch.setattr(S, "_LIBM", None)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert S._powf(0.1, 2.0) == float(F32(np.float64(F32(0.1)) ** 2))
        assert S._powf(0.0, -1.0) == np.inf
        assert S._powf(2, 0.5) == float(F32(np.sqrt(2.0)))


@pytest.mark.parametrize("libm", [True, False])
def test_float_helpers_take_a_float_argument_and_stay_quiet(monkeypatch, libm):
    """The argument is rounded to float32 first (a C ``float`` parameter): ``logf(0.7f)`` is
    not ``log(0.7)`` rounded. Overflow and NaN come back as C gives them, with no warning."""
    if not libm:
        monkeypatch.setattr(S, "_LIBM", None)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert S._logf(0.7) == F32(-0.35667497) != F32(np.log(0.7))
        assert S._expf(89.0) == np.inf
        assert np.isnan(S._logf(-1.0)) and np.isnan(S._log2f(-1.0))


def test_sum_f32_adds_left_to_right_in_float32():
    """``float s = 0; for (...) s += x[i];``: 1 + 2^-24 rounds back to 1 at every step, where a
    pairwise sum (``np.sum``) adds the small terms first; nothing sums to 0."""
    x = np.array([1.0] + [2.0**-24] * 16, F32)
    assert S._sum_f32(x) == F32(1) and np.sum(x) > F32(1)
    empty = S._sum_f32(np.zeros(0, F32))
    assert empty == 0 and empty.dtype == F32


def test_exp_is_the_c_librarys_double_exp():
    x = np.array([[-0.5, 0.0], [-700.0, -1e-3]])
    got = S._exp(x)
    assert got.shape == (2, 2) and got.dtype == np.float64
    assert got.ravel().tolist() == [math.exp(v) for v in x.ravel().tolist()]


# --------------------------------------------------------------------------------------------
# DRY: repeats and sequence breakers
# --------------------------------------------------------------------------------------------

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

X, Y, W = 3, 4, 5  # "x y w": a breaker of three tokens, head x and tail (y, w)


@pytest.mark.parametrize("history, breakers, penalties", [
    # the repeat "x y w a b" is cut at the breaker: only "a b" counts, 2 ** (2 - 1)
    ([X, Y, W, 0, 1, X, Y, W, 0, 1], {X: [(Y, W)]}, {X: 2.0}),
    ([X, Y, W, 0, 1, X, Y, W, 0, 1], {}, {X: 2.0 ** (5 - 1)}),
    # a breaker that ends the history leaves nothing to repeat
    ([0, X, Y, W, 0, X, Y, W], {X: [(Y, W)]}, {}),
    # a head without its tail is no breaker
    ([0, 1, X, 0, 1], {X: [(Y,)]}, {X: 2.0}),
])
def test_dry_multi_token_breaker_limits_the_repeat(history, breakers, penalties):
    """The repeat may not reach back past the most recent complete breaker (head, then its
    tail in order, llama.cpp's ``rat(i - offset - 1)``); allowed length 1, base 2."""
    cur = S.TokenDataArray.from_logits(np.zeros(8, F32))
    S.dry(cur, history, 1.0, 2.0, 1, 64, breakers)
    want = np.zeros(8, F32)
    want[list(penalties)] = [-v for v in penalties.values()]
    np.testing.assert_array_equal(cur.logits, want)


def test_dry_sequence_breakers_read_special_token_text():
    """``common_token_to_piece(vocab, i, true)``: a breaker can match a special token's text."""

    class Vocab:
        n_vocab = 3

        def token_to_piece(self, token: int, special: bool = False) -> bytes:
            return [b"a", b"\n", b"<s>" if special else b""][token]

    assert S.dry_sequence_breakers(Vocab(), ["<s>"]) == {2: [()]}


class PieceVocab:
    """A vocabulary of given pieces whose ``tokenize`` takes one byte per token; DRY tokenizes
    a breaker's tail as ``common_tokenize(vocab, tail, false, false)``."""

    def __init__(self, *pieces: bytes):
        self.pieces = list(pieces)
        self.n_vocab = len(pieces)

    def token_to_piece(self, token: int, special: bool = False) -> bytes:
        return self.pieces[token]

    def tokenize(self, text: bytes, *, add_special, parse_special) -> list[int]:
        assert add_special is False and parse_special is False
        return [self.pieces.index(bytes([b])) for b in text]


def test_dry_sequence_breakers_every_token_and_every_prefix():
    """``get_overlapping_token_sequences``: every token that contains the breaker (not only the
    first), and in a token every position from which the rest of it is a prefix of the
    breaker ("xaa" ends with both "aa" and "a" of "aab": tails "b" and "ab"; "xaaa" with the
    same two, after a start that fails); not "ab", where the breaker's start is followed by
    something else."""
    a, b, xaa, za, qn, nn, _, xaaa = range(8)
    vocab = PieceVocab(b"a", b"b", b"xaa", b"za", b"q\n", b"\n\n", b"ab", b"xaaa")
    assert S.dry_sequence_breakers(vocab, ["aab", "\n"]) == {
        a: [(a, b)], xaa: [(b,), (a, b)], za: [(a, b)], xaaa: [(b,), (a, b)], qn: [()],
        nn: [()]}


def test_dry_sequence_breakers_are_cut_at_40_bytes():
    """A breaker of 41 bytes is matched as its first 40: a 40-byte token contains it."""
    a, b, a40 = range(3)
    vocab = PieceVocab(b"a", b"b", b"a" * 40)
    assert S.dry_sequence_breakers(vocab, ["a" * 40 + "b"]) == {a: [(a,) * 20], a40: [()]}

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

LETTERS = PieceVocab(*[bytes([c]) for c in b"abcdefghijklmnopqrstuvwxyz:*ABCDEFGHIJKL"])  # 40
HISTORY = [0, 1, 2, 26, 3, 4, 5, 6, 0, 3, 4, 5]  # ends repeating "3 4 5" (then 6); ":" is 26


BREAKERS = S.dry_sequence_breakers(LETTERS, ["\n", ":"])
STAGES = {  # each sampler with the parameters of CHAIN_PARAMS written out
    "penalties": lambda cur, history, rngs: S.penalties(cur, history, 8, 1.3, 0.2, 0.1),
    "dry": lambda cur, history, rngs: S.dry(cur, history, 0.8, 1.5, 1, 12, BREAKERS),
    "top_n_sigma": lambda cur, history, rngs: S.top_n_sigma(cur, 1.0),
    "top_k": lambda cur, history, rngs: S.top_k(cur, 5),
    "typ_p": lambda cur, history, rngs: S.typical(cur, 0.2, 6),
    "top_p": lambda cur, history, rngs: S.top_p(cur, 0.3, 6),
    "min_p": lambda cur, history, rngs: S.min_p(cur, 0.4, 6),
    "xtc": lambda cur, history, rngs: S.xtc(cur, 0.6, 0.04, 6, rngs["xtc"]),
    "temperature": lambda cur, history, rngs: S.temp_ext(cur, 0.9, 0.3, 1.5),
}
CHAIN_PARAMS = dict(
    penalty_last_n=8, penalty_repeat=1.3, penalty_freq=0.2, penalty_present=0.1,
    dry_multiplier=0.8, dry_base=1.5, dry_allowed_length=1, dry_penalty_last_n=12,
    dry_sequence_breakers=["\n", ":"], top_n_sigma=1.0, top_k=5, typ_p=0.2, top_p=0.3,
    min_p=0.4, min_keep=6, xtc_probability=0.6, xtc_threshold=0.04, temp=0.9,
    dynatemp_range=0.3, dynatemp_exponent=1.5, mirostat_tau=4.0, mirostat_eta=0.2)


def _by_hand(stage: str, z, history, rngs, mu):
    """The chain of one ``stage`` (with ``logit_bias`` first), each sampler called by hand;
    returns the candidates and mirostat's new mu."""
    cur = S.TokenDataArray.from_logits(z)
    S.logit_bias(cur, {2: 1.5, 7: -np.inf})
    if stage == "mirostat":
        S.temp(cur, 0.9)
        return cur, S.mirostat(cur, rngs["mirostat"], mu, 40, 4.0, 0.2)
    if stage == "mirostat_v2":
        S.temp(cur, 0.9)
        return cur, S.mirostat_v2(cur, rngs["mirostat"], mu, 4.0, 0.2)
    STAGES[stage](cur, history, rngs)
    S.dist(cur, rngs["dist"])
    return cur, mu


@pytest.mark.parametrize("stage", [*S.DEFAULT_SAMPLERS, "mirostat", "mirostat_v2"])
def test_the_chain_runs_each_sampler_with_its_parameters(stage):
    """``common_sampler_sample`` with one sampler (then ``dist``; or mirostat 1 or 2): that
    sampler called with its own parameters, the RNGs advancing step after step. Each
    parameter bites here (``min_keep`` above what the filters keep, a history ending in a
    repeat)."""
    mirostat = {"mirostat": 1, "mirostat_v2": 2}.get(stage, 0)
    samplers = [] if mirostat else [stage]
    params = S.SamplerParams(seed=7, logit_bias={2: 1.5, 7: -np.inf}, samplers=samplers,
                             mirostat=mirostat, **CHAIN_PARAMS)
    chain = S.SamplerChain.from_params(params, 40, tokenizer=LETTERS)
    rngs = {name: S.Mt19937(7) for name in ("dist", "xtc", "mirostat")}
    history, mu = list(HISTORY), chain.mu
    for t in history:
        chain.accept(t)
    for step in range(6):
        z = distinct_logits(step, 40, 2.0)
        z[6] = z.max() + 1  # the token DRY penalizes first
        token = chain.sample(z)
        cur, mu = _by_hand(stage, z, history, rngs, mu)
        assert token == cur.ids[cur.selected] and chain.mu == mu
        got = chain.cur
        assert (got.ids.tolist(), got.selected, got.sorted) == (cur.ids.tolist(), cur.selected,
                                                              cur.sorted)
        np.testing.assert_array_equal(got.logits, cur.logits)
        np.testing.assert_array_equal(got.p, cur.p)
        chain.accept(token)
        history.append(token)


@pytest.mark.parametrize("kw, keep", [
    ({}, 64), (dict(n_prev=10, penalty_last_n=5, dry_penalty_last_n=0), 32),
    (dict(n_prev=100), 100), (dict(penalty_last_n=100), 100), (dict(dry_penalty_last_n=100), 100),
])
def test_the_history_keeps_what_every_sampler_reads(kw, keep):
    """``max(32, n_prev, penalty_last_n, dry_penalty_last_n)`` tokens, the most recent last (the
    ring buffers of common_sampler, penalties and DRY in one); no candidates before a sample."""
    chain = S.SamplerChain.from_params(S.SamplerParams(seed=0, **kw), 10)
    assert chain.cur is None
    for t in range(300):
        chain.accept(t % 10)
    assert len(chain.history) == keep and chain.history[-1] == 9


@pytest.mark.parametrize("change, message", [
    ({"penalty_repeat": 0.0}, "penalty_repeat"),
    ({"penalty_freq": float("inf")}, "penalty_freq"),
    ({"mirostat": 3}, "mirostat"),
    ({"samplers": ["top_k", "nucleus"]}, "unknown sampler"),
    ({"logit_bias": {10: 1.0}}, "outside"),
    ({"logit_bias": {-1: 1.0}}, "outside"),
    ({"dry_multiplier": 0.8}, "tokenizer"),
    ({"penalty_repeat": 1e-310}, "penalty_repeat"),  # 1 / r overflows
    ({"dry_multiplier": 0.8, "dry_base": 1.0}, "tokenizer"),  # DRY on at base 1
    ({"dry_multiplier": 0.8, "dry_penalty_last_n": 1}, "tokenizer"),
])
def test_invalid_params_are_refused(change, message):
    with pytest.raises(S.SamplingError, match=message):
        S.SamplerChain.from_params(S.SamplerParams(**change), 10)


@pytest.mark.parametrize("change", [
    {"penalty_repeat": 1e-308}, {"logit_bias": {0: 1.0, 9: -1.0}},
    {"dry_multiplier": 0.8, "dry_base": 0.99}, {"dry_multiplier": 0.8, "dry_penalty_last_n": 0},
])
def test_params_on_the_edge_are_accepted(change):
    """Accepted: a tiny penalty whose inverse is finite, the first and last token biased, and
    DRY settings that turn it off (then no tokenizer is needed)."""
    S.SamplerChain.from_params(S.SamplerParams(**change), 10)


def test_the_refusals_say_what_to_do():
    with pytest.raises(S.SamplingError, match=r"^n_vocab must be positive, got 0$"):
        S.SamplerChain.from_params(S.SamplerParams(), 0)
    assert S.SamplerChain.from_params(S.SamplerParams(seed=0), 1).sample(np.zeros(1, F32)) == 0
    with pytest.raises(S.SamplingError) as e:
        S.SamplerChain.from_params(S.SamplerParams(dry_multiplier=0.8), 10)
    assert str(e.value) == ("DRY (dry_multiplier != 0) needs a tokenizer for its sequence "
                            "breakers; pass tokenizer=")

def test_invalid_inputs_are_refused_before_any_change():
    chain = S.SamplerChain.from_params(S.SamplerParams(seed=1), 10)
    state = chain.rng_dist.copy()
    with pytest.raises(S.SamplingError, match="shape"):
        chain.sample(np.zeros(9, np.float32))
    with pytest.raises(S.SamplingError, match="outside"):
        chain.accept(10)
    assert list(chain.history) == [] and chain.rng_dist.next_u32() == state.next_u32()


# --------------------------------------------------------------------------------------------
# totality: any finite parameters either are refused when the chain is built or sample a token
# --------------------------------------------------------------------------------------------

FINITE = st.one_of(st.floats(allow_nan=False, allow_infinity=False),
                   st.sampled_from([0.0, -1.0, 1e-310, 1e-40, 0.5, 1.0, 600.0, 1e30, 1e300]))


@st.composite
def finite_params(draw) -> S.SamplerParams:
    """Any finite ``common_params_sampling`` (DRY off: it needs a tokenizer)."""
    names = list(S.DEFAULT_SAMPLERS)
    return S.SamplerParams(
        seed=draw(st.integers(0, 2**32 - 2)), top_k=draw(st.integers(-3, 300)),
        top_p=draw(FINITE), min_p=draw(FINITE), typ_p=draw(FINITE),
        xtc_probability=draw(FINITE), xtc_threshold=draw(FINITE), temp=draw(FINITE),
        dynatemp_range=draw(FINITE), dynatemp_exponent=draw(FINITE),
        penalty_last_n=draw(st.integers(0, 8)), penalty_repeat=draw(FINITE),
        penalty_freq=draw(FINITE), penalty_present=draw(FINITE),
        mirostat=draw(st.integers(0, 2)), mirostat_tau=draw(FINITE), mirostat_eta=draw(FINITE),
        top_n_sigma=draw(FINITE), min_keep=draw(st.integers(0, 300)),
        logit_bias=draw(st.dictionaries(st.integers(0, 199), FINITE, max_size=4)),
        samplers=draw(st.lists(st.sampled_from([n for n in names if n != "dry"]),
                               max_size=10)))


@given(params=finite_params(), seed=st.integers(0, 2**32 - 1), n=st.integers(1, 200))
def test_the_chain_is_total_over_finite_parameters(params, seed, n):
    """Law: with finite parameters the chain is either refused when built (a SamplingError
    naming the parameter) or picks a token of the vocabulary at every step, accepting it,
    whatever the logits (overflowing ones included: a huge bias, a tiny temperature)."""
    try:
        chain = S.SamplerChain.from_params(params, n)
    except S.SamplingError:
        return
    rng = np.random.default_rng(seed)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # C computes these quietly
        for _ in range(4):
            z = (rng.standard_normal(n) * rng.choice([1.0, 1e3, 1e30])).astype(F32)
            token = chain.sample(z)
            assert 0 <= token < n
            chain.accept(token)
