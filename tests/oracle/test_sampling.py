"""Oracle: every sampler, and seeded chains, against llama.cpp's own (llama-cpp-python 0.3.36).

Each sampler is applied to the same ``llama_token_data_array`` (built with ctypes over a NumPy
structured array) by ``llama_sampler_apply`` and by :mod:`reference.sampling`; the surviving
ids (in order), their logits (bit for bit), their probabilities (float32 rounding), the
selected index and the sorted flag must agree. The chains (``common_sampler_init``'s default
order, and the mirostat ones) draw the same tokens from the same seed over many steps.

Logits are drawn distinct (llama.cpp's ``partial_sort`` leaves the order of ties unspecified).
"""

from __future__ import annotations

import ctypes

import llama_cpp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from reference import sampling as S
from reference.model_loader import default_model_path
from tests.support.llamacpp_lowlevel import silence_llama_log

pytestmark = pytest.mark.oracle

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
# inputs
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


probability = st.sampled_from([0.0, 0.05, 0.3, 0.5, 0.9, 0.95, 0.99, 1.0])
min_keep = st.sampled_from([0, 1, 3])


# ---------------------------------------------------------------------------------------------
# one sampler at a time
# ---------------------------------------------------------------------------------------------

@given(cur=candidates(), k=st.integers(-1, 320))
def test_top_k(cur, k):
    check(llama_cpp.llama_sampler_init_top_k(k), lambda c: S.top_k(c, k), cur)


@given(cur=candidates(), p=probability, keep=min_keep)
def test_top_p(cur, p, keep):
    check(llama_cpp.llama_sampler_init_top_p(p, keep), lambda c: S.top_p(c, p, keep), cur)


@given(seed=st.integers(0, 2**32 - 2), p=probability)
def test_top_p_large_unsorted(seed, p):
    """More than 1024 unsorted candidates: llama.cpp's bucket sort path."""
    cur = S.TokenDataArray.from_logits(distinct_logits(seed, 3000, 3.0))
    check(llama_cpp.llama_sampler_init_top_p(p, 0), lambda c: S.top_p(c, p), cur)


@given(cur=candidates(), p=probability, keep=min_keep)
def test_min_p(cur, p, keep):
    check(llama_cpp.llama_sampler_init_min_p(p, keep), lambda c: S.min_p(c, p, keep), cur)


@given(cur=candidates(), p=probability, keep=min_keep)
def test_typical(cur, p, keep):
    check(llama_cpp.llama_sampler_init_typical(p, keep), lambda c: S.typical(c, p, keep), cur)


@given(cur=candidates(), t=st.sampled_from([-1.0, 0.0, 0.3, 0.8, 1.0, 1.7]))
def test_temp(cur, t):
    check(llama_cpp.llama_sampler_init_temp(t), lambda c: S.temp(c, t), cur)


@given(cur=candidates(), t=st.sampled_from([0.0, 0.5, 0.8, 1.0, 1.5]),
       delta=st.sampled_from([0.0, 0.2, 0.5, 1.0]), exponent=st.sampled_from([0.5, 1.0, 2.0]))
def test_temp_ext(cur, t, delta, exponent):
    check(llama_cpp.llama_sampler_init_temp_ext(t, delta, exponent),
          lambda c: S.temp_ext(c, t, delta, exponent), cur)


@given(cur=candidates(), n=st.sampled_from([-1.0, 0.5, 1.0, 2.0, 3.0]))
def test_top_n_sigma(cur, n):
    check(llama_cpp.llama_sampler_init_top_n_sigma(n), lambda c: S.top_n_sigma(c, n), cur)


@given(cur=candidates(), data=st.data())
def test_logit_bias(cur, data):
    n = cur.size
    biases = data.draw(st.dictionaries(st.integers(0, n - 1),
                                       st.sampled_from([-np.inf, -2.5, 0.5, 3.0]), max_size=5))
    if biases:
        check(lc_logit_bias(n, biases), lambda c: S.logit_bias(c, biases), cur)


@given(cur=candidates())
def test_greedy(cur):
    check(llama_cpp.llama_sampler_init_greedy(), S.greedy, cur)


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
