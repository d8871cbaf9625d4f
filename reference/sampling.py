r"""The sampler chain: how llama.cpp turns a row of logits into one token.

Mirrors ``src/llama-sampler.cpp`` (the samplers) and ``common/sampling.cpp``
(``common_sampler_init``, which builds the chain from ``common_params_sampling``) at the pinned
commit. A *sampler* edits a candidates array, ``llama_token_data_array``: token ids, their
logits $z_i$, their probabilities $p_i$, a ``selected`` index and a ``sorted`` flag that says
the candidates are in descending logit order. Filters shrink the array, transforms change
logits, and the last sampler (``dist``, ``mirostat``) sets ``selected``.

Most samplers look at the softmax of what is left,

$$
p_i = \frac{e^{z_i - z_{\max}}}{\sum_j e^{z_j - z_{\max}}},
$$

so their *order* matters: ``top_p`` after ``top_k`` keeps the nucleus of 40 renormalized
candidates, not of the whole vocabulary; temperature before ``min_p`` would change which tokens
pass. llama.cpp's common default order is

    logit_bias, penalties, dry, top_n_sigma, top_k, typ_p, top_p, min_p, xtc, temperature, dist

(``mirostat`` 1 or 2 replaces everything after ``logit_bias`` by ``temp`` and the mirostat
sampler). With ``temp <= 0`` common does *not* switch to ``greedy``: the temperature sampler
keeps only the largest logit and ``dist`` picks it, still consuming one draw of its RNG.

**Arithmetic, as llama.cpp's CPU code.** Logits and probabilities are float32; ``expf``,
``logf``, ``log2f`` and ``powf`` are the C library's own, called through ``ctypes``: glibc's are
not correctly rounded (``logf`` differs from the correctly rounded value on about 0.7 % of
inputs in (0, 1), ``expf`` and ``powf`` on about 0.07 %), and dynamic temperature, which
divides every logit by a power of an entropy, shows each of those ulps. Where no C math
library can be loaded, float64 rounded to float32 stands in. Sums run left to right in the
type the C++ uses (``float`` in ``softmax``/``top_p``, ``double`` in ``dist``). Sorting is
stable (ties keep their current order); llama.cpp's ``std::partial_sort`` leaves tied
candidates in an unspecified order, so tests use distinct logits where the order of ties
would show.

**Draws.** Every RNG is a ``std::mt19937`` seeded with the 32-bit seed (``get_rng_seed``:
``LLAMA_DEFAULT_SEED = 0xFFFFFFFF`` means a random seed). ``dist`` draws
``std::uniform_real_distribution<double>(0, 1)``: libstdc++'s ``generate_canonical<double, 53>``
takes two 32-bit outputs, $u = (a + b\,2^{32}) / 2^{64}$ (rounded to double, clamped below 1).
[`Mt19937`][] reproduces those numbers with NumPy's MT19937 bit generator, so a seeded chain
here picks the tokens a seeded llama.cpp chain picks.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import math
import secrets
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from reference.common import LLAMA_DEFAULT_SEED, LlamarefError

DEFAULT_SAMPLERS = ("penalties", "dry", "top_n_sigma", "top_k", "typ_p", "top_p", "min_p", "xtc",
                    "temperature")
F32 = np.float32


class SamplingError(LlamarefError, ValueError):
    """Invalid sampling parameters or inputs (raised before any state changes)."""


# ---------------------------------------------------------------------------------------------
# float32 helpers: the C library's expf/logf/log2f/powf, left-to-right sums
# ---------------------------------------------------------------------------------------------

def _load_libm() -> ctypes.CDLL | None:
    """The C math library llama.cpp calls (glibc's ``libm.so.6`` on Linux), its float
    functions typed; None where it cannot be loaded."""
    path = ctypes.util.find_library("m")
    try:
        libm = ctypes.CDLL(path) if path else None
    except OSError:
        return None
    for name, n_args in (("expf", 1), ("logf", 1), ("log2f", 1), ("powf", 2)):
        fn = getattr(libm, name, None)
        if fn is None:
            return None
        fn.restype, fn.argtypes = ctypes.c_float, [ctypes.c_float] * n_args
    return libm


_LIBM = _load_libm()


def _libm_f32(name: str, x, fallback: Callable[[np.ndarray], np.ndarray]) -> np.ndarray:
    """The C function ``name`` (``float -> float``) elementwise over float32 ``x`` (any shape;
    a scalar gives a ``np.float32``); ``fallback`` (float64 in, rounded to float32) where there
    is no C math library."""
    x = np.asarray(x, F32)
    if _LIBM is None:
        with np.errstate(over="ignore", divide="ignore", invalid="ignore"):
            return fallback(x.astype(np.float64)).astype(F32)[()]
    fn = getattr(_LIBM, name)
    return np.fromiter(map(fn, x.ravel().tolist()), F32, count=x.size).reshape(x.shape)[()]


def _expf(x) -> np.ndarray:
    """``expf`` elementwise: float32 in (the argument is rounded to float32 first, as C's
    ``float`` parameter does), float32 out."""
    return _libm_f32("expf", x, np.exp)


def _logf(x) -> np.ndarray:
    """``logf`` elementwise (``logf(0) = -inf``), float32 in and out."""
    return _libm_f32("logf", x, np.log)


def _log2f(x) -> np.ndarray:
    """``log2f`` elementwise (``log2f(0) = -inf``), float32 in and out."""
    return _libm_f32("log2f", x, np.log2)


def _powf(x, y) -> float:
    """``powf(x, y)`` with both arguments rounded to float32; NaN where C gives NaN."""
    x, y = F32(x), F32(y)
    if _LIBM is None:
        with np.errstate(all="ignore"):
            return float(F32(np.power(np.float64(x), np.float64(y))))
    return float(_LIBM.powf(float(x), float(y)))


def _exp(x: np.ndarray) -> np.ndarray:
    """``exp`` in double elementwise: the C library's (``math.exp`` calls it), which NumPy's own
    vectorized ``exp`` is not (they differ by an ulp on a few percent of inputs)."""
    x = np.asarray(x, np.float64)
    return np.fromiter(map(math.exp, x.ravel().tolist()), np.float64, count=x.size).reshape(x.shape)


def _sum_f32(x: np.ndarray) -> np.float32:
    """``float s = 0; for (...) s += x[i];``: a left-to-right float32 sum (not pairwise)."""
    return np.cumsum(x, dtype=F32)[-1] if x.size else F32(0)


def _c_int(x: float) -> int:
    """C's ``int(float)`` on x86: truncation; NaN and out-of-range give ``INT_MIN``."""
    if not math.isfinite(x) or not -2.0**31 <= x < 2.0**31:
        return -(2**31)
    return int(x)


# ---------------------------------------------------------------------------------------------
# std::mt19937 and the libstdc++ distributions
# ---------------------------------------------------------------------------------------------

# --8<-- [start:Mt19937]
class Mt19937:
    r"""``std::mt19937`` seeded with a 32-bit seed, and libstdc++'s uniform distributions.

    The state is MT19937's ``init_genrand``: $x_0 = s$,
    $x_i = 1812433253\,(x_{i-1} \oplus (x_{i-1} \gg 30)) + i \bmod 2^{32}$; NumPy's
    ``MT19937`` bit generator then produces the same 32-bit outputs as ``std::mt19937``.

    Examples:
        >>> rng = Mt19937(5489)  # std::mt19937's default seed
        >>> int(rng.next_u32())
        3499211612
        >>> round(Mt19937(42).uniform_double(), 12)
        0.796542984288
    """

    def __init__(self, seed: int):
        key = np.empty(624, dtype=np.uint32)
        x = seed & 0xFFFFFFFF
        key[0] = x
        for i in range(1, 624):
            x = (1812433253 * (x ^ (x >> 30)) + i) & 0xFFFFFFFF
            key[i] = x
        self._bitgen = np.random.MT19937()
        self._bitgen.state = {"bit_generator": "MT19937", "state": {"key": key, "pos": 624}}

    def next_u32(self) -> int:
        """One 32-bit output (``rng()``)."""
        return int(self._bitgen.random_raw())

    def uniform_double(self) -> float:
        r"""``std::uniform_real_distribution<double>(0, 1)(rng)``: two outputs $a, b$ give
        $\mathrm{fl}_{64}(a + b\,2^{32}) / 2^{64}$, or the largest double below 1 if that is 1."""
        a = float(self.next_u32())
        b = float(self.next_u32())
        u = (a + b * 4294967296.0) / 18446744073709551616.0
        return u if u < 1.0 else math.nextafter(1.0, 0.0)

    def uniform_float(self) -> np.float32:
        r"""``std::uniform_real_distribution<float>(0, 1)(rng)``: one output $a$ gives
        $\mathrm{fl}_{32}(a) / 2^{32}$, or the largest float below 1 if that is 1."""
        u = F32(self.next_u32()) / F32(4294967296.0)
        return u if u < 1 else np.nextafter(F32(1), F32(0))

    def copy(self) -> Mt19937:
        """An independent copy of the state (draws from it do not advance this one)."""
        twin = Mt19937.__new__(Mt19937)
        twin._bitgen = np.random.MT19937()
        twin._bitgen.state = self._bitgen.state
        return twin


# --8<-- [end:Mt19937]


def get_rng_seed(seed: int) -> int:
    """``get_rng_seed``: ``LLAMA_DEFAULT_SEED`` (0xFFFFFFFF) means a random 32-bit seed.

    Examples:
        >>> get_rng_seed(7), 0 <= get_rng_seed(0xFFFFFFFF) < 2**32
        (7, True)
    """
    return secrets.randbits(32) if seed == LLAMA_DEFAULT_SEED else seed & 0xFFFFFFFF


def discrete_distribution(p: np.ndarray, rng: Mt19937) -> int:
    r"""``std::discrete_distribution<int>(p)(rng)`` as libstdc++ computes it.

    Fewer than 2 weights: returns 0 *without drawing*. Otherwise the weights are normalized in
    double, $c_i = \sum_{j \le i} p_j / \sum_j p_j$ (left to right, $c_{n-1} := 1$), a
    ``generate_canonical<double, 53>`` draw $u$ is taken and the index is the first $i$ with
    $c_i \ge u$ (``lower_bound``).

    Examples:
        >>> rng = Mt19937(5)
        >>> discrete_distribution(np.array([0.2, 0.8]), rng)
        0
        >>> discrete_distribution(np.array([1.0]), rng)  # one weight: no draw
        0
    """
    if p.size < 2:
        return 0
    w = p.astype(np.float64)
    cp = np.cumsum(w / np.cumsum(w)[-1])  # (n,) double partial sums
    cp[-1] = 1.0
    return int(np.searchsorted(cp, rng.uniform_double(), side="left"))


# ---------------------------------------------------------------------------------------------
# the candidates array
# ---------------------------------------------------------------------------------------------

# --8<-- [start:TokenDataArray]
@dataclass
class TokenDataArray:
    """``llama_token_data_array``: the candidates a sampler edits in place.

    Attributes:
        ids: ``(size,)`` int32 token ids, in the array's current order.
        logits: ``(size,)`` float32 logits.
        p: ``(size,)`` float32 probabilities (valid after a sampler computed them).
        selected: index into the array of the chosen token, ``-1`` before a choice.
        sorted: the candidates are in descending logit order.
    """

    ids: np.ndarray
    logits: np.ndarray
    p: np.ndarray
    selected: int = -1
    sorted: bool = False

    @classmethod
    def from_logits(cls, logits) -> TokenDataArray:
        """All ``n_vocab`` tokens in id order with ``p = 0``, unsorted (``set_logits``).

        Examples:
            >>> cur = TokenDataArray.from_logits([1.0, 3.0, 2.0])
            >>> cur.ids.tolist(), cur.size, cur.sorted
            ([0, 1, 2], 3, False)
        """
        z = np.array(logits, dtype=F32).reshape(-1)  # (n_vocab,)
        return cls(np.arange(z.size, dtype=np.int32), z, np.zeros_like(z))

    @property
    def size(self) -> int:
        return int(self.ids.size)

    def take(self, index: np.ndarray) -> None:
        """Keep the candidates at ``index`` (in that order)."""
        self.ids, self.logits, self.p = self.ids[index], self.logits[index], self.p[index]


# --8<-- [end:TokenDataArray]


def _sort(cur: TokenDataArray, k: int) -> None:
    """``llama_token_data_array_partial_sort_inplace``: keep the top ``k``, descending, stable."""
    order = np.argsort(-cur.logits, kind="stable")[:k]  # (k,)
    cur.take(order)
    cur.sorted = True


def softmax(cur: TokenDataArray, do_sort: bool) -> None:
    r"""``llama_sampler_softmax_impl``: $p_i = e^{z_i - z_{\max}} / \sum_j e^{z_j - z_{\max}}$.

    Sorts first when ``do_sort`` and not yet sorted. ``expf`` per candidate, the sum
    accumulated left to right in float32, each $p_i$ divided by it in float32.

    Examples:
        >>> cur = TokenDataArray.from_logits([0.0, 0.0])
        >>> softmax(cur, do_sort=False); cur.p.tolist()
        [0.5, 0.5]
    """
    if cur.size == 0:
        raise SamplingError("softmax of an empty candidates array")
    if do_sort and not cur.sorted:
        _sort(cur, cur.size)
    max_l = cur.logits[0] if cur.sorted else cur.logits.max()
    e = _expf(cur.logits - max_l)  # (size,) float32
    cur.p = e / _sum_f32(e)  # (size,)


# ---------------------------------------------------------------------------------------------
# the samplers
# ---------------------------------------------------------------------------------------------

# --8<-- [start:greedy]
def greedy(cur: TokenDataArray) -> None:
    r"""``llama_sampler_init_greedy``: select $\arg\max_i z_i$.

    Ties: the first maximum in the array's current order (a strict ``>`` scan).

    Examples:
        >>> cur = TokenDataArray.from_logits([1.0, 3.0, 3.0])
        >>> greedy(cur); cur.selected
        1
    """
    cur.selected = int(np.argmax(cur.logits)) if cur.size else 0


# --8<-- [end:greedy]


# --8<-- [start:dist]
def dist(cur: TokenDataArray, rng: Mt19937) -> None:
    r"""``llama_sampler_init_dist``: draw a candidate with probability $p_i$ (softmax).

    $e_i = \mathrm{expf}(z_i - z_{\max})$ in float32, $S = \sum_i e_i$ in double; one draw
    $u$ (``uniform_real_distribution<double>``); ``selected`` is the first $i$ (in the
    array's current order, sorted or not) with $\sum_{j \le i} e_j \ge u\,S$ (running sum in
    double); then $p_i = e_i / S$. An empty array selects $-1$ and draws nothing; a single
    candidate is selected but the draw is still taken, as llama.cpp keeps its RNG aligned with
    backend sampling.

    Examples:
        >>> cur = TokenDataArray.from_logits([0.0, 10.0, 0.0])
        >>> dist(cur, Mt19937(1)); int(cur.ids[cur.selected])
        1
    """
    if cur.size == 0:
        cur.selected = -1
        return
    cur.selected = 0
    if cur.size == 1:
        rng.uniform_double()
        cur.p = np.ones(1, F32)
        return
    max_l = cur.logits[0] if cur.sorted else cur.logits.max()
    e = _expf(cur.logits - max_l)  # (size,) float32
    running = np.cumsum(e.astype(np.float64))  # (size,) double running sums
    total = running[-1]
    target = total * rng.uniform_double()
    hits = np.flatnonzero(running >= target)
    cur.selected = int(hits[0]) if hits.size else cur.size - 1
    cur.p = (e.astype(np.float64) / total).astype(F32)


# --8<-- [end:dist]


# --8<-- [start:top_k]
def top_k(cur: TokenDataArray, k: int) -> None:
    r"""``llama_sampler_init_top_k``: keep the $k$ largest logits, sorted descending.

    $k \le 0$: no-op (the array stays as it is, unsorted if it was). $k >$ size: $k$ = size
    (everything kept, but sorted). Ties at the $k$-th place: the earlier candidate wins here;
    llama.cpp's ``partial_sort`` leaves that unspecified.

    Examples:
        >>> cur = TokenDataArray.from_logits([1.0, 3.0, 2.0])
        >>> top_k(cur, 2); cur.ids.tolist(), cur.sorted
        ([1, 2], True)
    """
    if k <= 0:
        return
    k = min(k, cur.size)
    if not cur.sorted:
        _sort(cur, k)
    else:
        cur.take(np.arange(k))


# --8<-- [end:top_k]


# --8<-- [start:top_p]
def top_p(cur: TokenDataArray, p: float, min_keep: int = 0) -> None:
    r"""``llama_sampler_init_top_p``: the nucleus, the fewest top candidates with mass $\ge p$.

    Softmax in the current order, sort descending, then keep the first $m$ candidates where
    $m$ is the smallest index with $\sum_{i < m} p_i \ge p$ (float32 running sum) and
    $m \ge$ ``min_keep``; everything if the sum never gets there. $p \ge 1$: no-op (no
    softmax either).

    Examples:
        >>> cur = TokenDataArray.from_logits(np.log([0.5, 0.3, 0.2]))
        >>> top_p(cur, 0.75); cur.ids.tolist()
        [0, 1]
    """
    p = F32(p)
    if p >= 1:
        return
    softmax(cur, do_sort=False)
    if not cur.sorted:
        _sort(cur, cur.size)
    cum = np.cumsum(cur.p, dtype=F32)  # (size,) float32 running sums
    ok = (cum >= p) & (np.arange(1, cur.size + 1) >= min_keep)
    hits = np.flatnonzero(ok)
    cur.take(np.arange(hits[0] + 1 if hits.size else cur.size))


# --8<-- [end:top_p]


# --8<-- [start:min_p]
def min_p(cur: TokenDataArray, p: float, min_keep: int = 0) -> None:
    r"""``llama_sampler_init_min_p``: keep $i$ with $p_i \ge p \cdot p_{\max}$.

    Decided on logits, $z_i \ge z_{\max} + \mathrm{logf}(p)$ in float32, without a softmax.
    Unsorted input: filtered in place, the order kept, when at least ``min_keep`` (and at
    least one) pass; otherwise (and for sorted input) the array is sorted and cut at the first
    candidate below the bound at index $\ge$ ``min_keep``. $p \le 0$: no-op.

    Examples:
        >>> cur = TokenDataArray.from_logits(np.log([0.2, 0.5, 0.01, 0.29]))
        >>> min_p(cur, 0.1); cur.ids.tolist()
        [0, 1, 3]
    """
    p = F32(p)
    if p <= 0 or cur.size == 0:
        return
    if not cur.sorted:
        max_logit = max(F32(-np.finfo(F32).max), cur.logits.max())
        keep = np.flatnonzero(cur.logits >= max_logit + _logf(p))
        if keep.size and keep.size >= min_keep:
            cur.take(keep)
            return
        _sort(cur, cur.size)
    below = (cur.logits < cur.logits[0] + _logf(p)) & (np.arange(cur.size) >= min_keep)
    below[0] = False  # the first token always passes
    hits = np.flatnonzero(below)
    cur.take(np.arange(hits[0] if hits.size else cur.size))


# --8<-- [end:min_p]


# --8<-- [start:typical]
def typical(cur: TokenDataArray, p: float, min_keep: int = 0) -> None:
    r"""``llama_sampler_init_typical``: locally typical sampling.

    With entropy $H = -\sum_i p_i \log p_i$ (with $0 \log 0 = 0$), candidates are ordered by
    $|-\log p_i - H|$ ascending (stable here; ``std::sort`` in llama.cpp) and the first $m$ are
    kept, $m$ the smallest count whose mass is $> p$ (strictly) with $m \ge$ ``min_keep``.
    The result is not sorted by logit. $p \ge 1$: no-op. A candidate of probability 0 has
    distance $\infty$ and comes last; llama.cpp computes $0 \cdot (-\infty)$ = NaN there, which
    makes $H$ and every distance NaN (docs/divergences.md, 19).

    Examples:
        >>> cur = TokenDataArray.from_logits(np.log([0.5, 0.3, 0.2]))
        >>> typical(cur, 0.5); cur.ids.tolist()
        [1, 0]
    """
    p = F32(p)
    if p >= 1:
        return
    softmax(cur, do_sort=True)
    with np.errstate(invalid="ignore", divide="ignore"):
        # 0 log 0 = 0 (the limit), where llama.cpp's 0 * -inf makes H NaN (divergence 19)
        entropy = _sum_f32(np.where(cur.p > 0, -cur.p * _logf(cur.p), F32(0)))
        shifted = np.abs(-_logf(cur.p) - entropy)  # (size,): inf for p = 0, sorted last
    order = np.argsort(shifted, kind="stable")  # (size,)
    cum = np.cumsum(cur.p[order], dtype=F32)  # (size,)
    ok = (cum > p) & ((min_keep == 0) | (np.arange(cur.size) >= min_keep - 1))
    hits = np.flatnonzero(ok)
    cur.take(order[: hits[0] + 1 if hits.size else cur.size])
    cur.sorted = False


# --8<-- [end:typical]


# --8<-- [start:temp]
def temp(cur: TokenDataArray, t: float) -> None:
    r"""``llama_sampler_init_temp``: $z_i \leftarrow z_i / T$ (float32 division).

    $T \le 0$: keep the size but set every logit to $-\infty$ except the first maximum in the
    current order (so a later ``dist`` can only pick it).

    Examples:
        >>> cur = TokenDataArray.from_logits([1.0, 4.0, 4.0])
        >>> temp(cur, 0.0); cur.logits.tolist()
        [-inf, 4.0, -inf]
    """
    if cur.size == 0:
        return
    t = F32(t)
    if t <= 0:
        keep = int(np.argmax(cur.logits))
        z = np.full_like(cur.logits, -np.inf)
        z[keep] = cur.logits[keep]
        cur.logits = z
        return
    cur.logits = cur.logits / t


# --8<-- [end:temp]


# --8<-- [start:temp_ext]
def temp_ext(cur: TokenDataArray, t: float, delta: float, exponent: float) -> None:
    r"""``llama_sampler_init_temp_ext``: dynamic temperature ("dynatemp").

    $\delta \le 0$: plain [`temp`][]. Otherwise (and size $> 1$), with the normalized entropy
    $h = H / \log n$ of the sorted softmax, the temperature is
    $T' = \max(0, T - \delta) + 2\delta'\, h^{\kappa}$ where $2\delta' = (T+\delta) - \max(0,
    T-\delta)$ and $\kappa$ = ``exponent``; then ``temp(T')`` and the probabilities are
    recomputed in double.

    All in float32, as llama.cpp: $H = -\sum_{p_i > 0} p_i\,\mathrm{logf}(p_i)$ accumulated
    left to right, $\log n$ as $-\mathrm{logf}(1/n)$, $h^{\kappa}$ by ``powf``, each the C
    library's (one ulp of any of them moves every logit); the recomputed probabilities with
    the C library's double ``exp``.

    Examples:
        >>> cur = TokenDataArray.from_logits([2.0, 4.0])
        >>> temp_ext(cur, 2.0, 0.0, 1.0); cur.logits.tolist()
        [1.0, 2.0]
    """
    t, delta, exponent = F32(t), F32(delta), F32(exponent)
    if delta <= 0:
        temp(cur, t)
        return
    if cur.size <= 1:
        return
    min_temp, max_temp = max(F32(0), t - delta), t + delta
    max_entropy = -_logf(F32(1) / F32(cur.size))
    softmax(cur, do_sort=True)
    q = cur.p[cur.p > 0]
    entropy = -_sum_f32(q * _logf(q))  # = llama.cpp's `entropy -= p * logf(p)`: negation is exact
    dyn = min_temp + (max_temp - min_temp) * F32(_powf(entropy / max_entropy, exponent))
    temp(cur, dyn)
    e = _exp(cur.logits.astype(np.float64) - float(cur.logits[0]))  # (size,) double
    cur.p = (e.astype(F32).astype(np.float64) / np.cumsum(e)[-1]).astype(F32)


# --8<-- [end:temp_ext]


# --8<-- [start:xtc]
def xtc(cur: TokenDataArray, probability: float, threshold: float, min_keep: int,
        rng: Mt19937) -> None:
    r"""``llama_sampler_init_xtc``: "exclude top choices".

    With chance ``probability`` (one ``uniform_real_distribution<float>`` draw $c$, applied
    when $c \le$ ``probability``), every top candidate with $p_i \ge$ ``threshold`` but the
    last of them is removed, if at least ``min_keep`` remain. Disabled (no draw) when
    ``probability <= 0``, ``threshold > 0.5`` or fewer than 2 candidates.

    Examples:
        >>> cur = TokenDataArray.from_logits(np.log([0.5, 0.3, 0.2]))
        >>> xtc(cur, 1.0, 0.25, 1, Mt19937(0)); cur.ids.tolist()
        [1, 2]
    """
    probability, threshold = F32(probability), F32(threshold)
    if probability <= 0 or threshold > F32(0.5) or cur.size < 2:
        return
    if rng.uniform_float() > probability:
        return
    softmax(cur, do_sort=True)
    above = cur.p >= threshold
    pos_last = cur.size - 1 if above.all() else int(np.argmin(above)) - 1
    pos_last = max(pos_last, 0)
    if cur.size - pos_last >= min_keep and pos_last > 0:
        cur.take(np.arange(pos_last, cur.size))


# --8<-- [end:xtc]


# --8<-- [start:top_n_sigma]
def top_n_sigma(cur: TokenDataArray, n: float) -> None:
    r"""``llama_sampler_init_top_n_sigma``: keep $z_i \ge z_{\max} - n\sigma$.

    $\sigma$ is the population standard deviation of the finite-or-$+\infty$ logits
    ($-\infty$ ones are skipped); removed candidates get $z_i = -\infty$ (the size does not
    change). $n \le 0$ or size $\le 1$: no-op.

    Examples:
        >>> cur = TokenDataArray.from_logits([0.0, 1.0, 2.0, 10.0])
        >>> top_n_sigma(cur, 1.0); cur.logits.tolist()
        [-inf, -inf, -inf, 10.0]
    """
    n = F32(n)
    if n <= 0 or cur.size <= 1:
        return
    z = cur.logits
    valid = z[z != -np.inf]
    mx = max(z[0], valid.max()) if valid.size else z[0]
    mean = _sum_f32(valid) / F32(valid.size) if valid.size else F32(0)
    acc = 0.0
    for d in (valid - mean).astype(np.float64):  # float acc += double pow(d, 2)
        acc = float(F32(acc + d * d))
    std = F32(math.sqrt(F32(acc) / F32(valid.size))) if valid.size else F32(0)
    cur.logits = np.where(z < mx - n * std, F32(-np.inf), z)


# --8<-- [end:top_n_sigma]


# --8<-- [start:mirostat]
def mirostat(cur: TokenDataArray, rng: Mt19937, mu: float, n_vocab: int, tau: float,
             eta: float, m: int = 100) -> float:
    r"""``llama_sampler_init_mirostat`` (Mirostat 1.0); selects a token and returns the new $\mu$.

    Estimates the Zipf exponent $\hat s = \sum t_i b_i / \sum t_i^2$ with
    $t_i = \log\frac{i+2}{i+1}$, $b_i = \log\frac{p_i}{p_{i+1}}$ over the top $m$ tokens,
    keeps the top $k = \left(\frac{\hat\epsilon\, 2^{\mu}}{1 - N^{-\hat\epsilon}}\right)^{1/\hat s}$
    ($\hat\epsilon = \hat s - 1$, $N$ = ``n_vocab``, at least 1), draws with
    ``std::discrete_distribution`` and updates $\mu \leftarrow \mu - \eta(-\log_2 p - \tau)$.

    Examples:
        >>> cur = TokenDataArray.from_logits([0.0, 5.0, 1.0])
        >>> mu = mirostat(cur, Mt19937(0), 10.0, 3, 5.0, 0.1); int(cur.ids[cur.selected])
        1
    """
    softmax(cur, do_sort=True)
    sum_ti_bi, sum_ti_sq = F32(0), F32(0)
    with np.errstate(all="ignore"):  # p = 0 (a -inf logit) makes b_i inf, quietly in C
        for i in range(min(m - 1, cur.size - 1)):
            t_i = _logf(F32(i + 2) / F32(i + 1))
            b_i = _logf(cur.p[i] / cur.p[i + 1])
            sum_ti_bi += t_i * b_i
            sum_ti_sq += t_i * t_i
        s_hat = sum_ti_bi / sum_ti_sq
        eps_hat = s_hat - F32(1)
        num = eps_hat * F32(_powf(2, mu))
        den = F32(1) - F32(_powf(n_vocab, -eps_hat))
        k = F32(_powf(num / den, F32(1) / s_hat))
    top_k(cur, max(_c_int(float(k)), 1))
    softmax(cur, do_sort=True)
    cur.selected = discrete_distribution(cur.p, rng)
    return _mirostat_update(cur, mu, tau, eta)


def _mirostat_update(cur: TokenDataArray, mu: float, tau: float, eta: float) -> float:
    r"""$\mu - \eta\,(-\log_2 p_{sel} - \tau)$ in float32."""
    surprise = -_log2f(cur.p[cur.selected])
    return float(F32(mu) - F32(eta) * (surprise - F32(tau)))


# --8<-- [end:mirostat]


# --8<-- [start:mirostat_v2]
def mirostat_v2(cur: TokenDataArray, rng: Mt19937, mu: float, tau: float, eta: float) -> float:
    r"""``llama_sampler_init_mirostat_v2``: selects a token and returns the new $\mu$.

    Sorted softmax, cut at the first candidate with surprise $-\log_2 p_i > \mu$ (at least one
    kept), softmax again, draw with ``std::discrete_distribution``, update
    $\mu \leftarrow \mu - \eta(-\log_2 p - \tau)$.

    Examples:
        >>> cur = TokenDataArray.from_logits([0.0, 5.0, 1.0])
        >>> mu = mirostat_v2(cur, Mt19937(0), 10.0, 5.0, 0.1); int(cur.ids[cur.selected])
        1
    """
    softmax(cur, do_sort=True)
    surprise = -_log2f(cur.p)  # (size,)
    over = np.flatnonzero(surprise > F32(mu))
    cur.take(np.arange(max(int(over[0]) if over.size else cur.size, 1)))
    softmax(cur, do_sort=True)
    cur.selected = discrete_distribution(cur.p, rng)
    return _mirostat_update(cur, mu, tau, eta)


# --8<-- [end:mirostat_v2]


# --8<-- [start:penalties]
def penalties(cur: TokenDataArray, last_tokens: Sequence[int], penalty_last_n: int,
              penalty_repeat: float, penalty_freq: float, penalty_present: float) -> None:
    r"""``llama_sampler_init_penalties``: repetition, frequency and presence penalties.

    With $c_i$ the count of token $i$ among the last ``penalty_last_n`` accepted tokens, every
    candidate with $c_i > 0$ becomes

    $$
    z_i \leftarrow \begin{cases} z_i \cdot r & z_i \le 0 \\ z_i / r & z_i > 0 \end{cases}
    \; - \; (c_i \alpha_{freq} + \alpha_{present}).
    $$

    Disabled when ``penalty_last_n <= 0`` or $r = 1, \alpha_{freq} = \alpha_{present} = 0$
    (llama.cpp clamps a negative ``penalty_last_n`` to 0). Clears ``sorted`` (always, when
    enabled).

    Examples:
        >>> cur = TokenDataArray.from_logits([2.0, -2.0, 1.0])
        >>> penalties(cur, [0, 1, 1], 64, 2.0, 0.5, 0.0); cur.logits.tolist()
        [0.5, -5.0, 1.0]
    """
    r, a_freq, a_present = F32(penalty_repeat), F32(penalty_freq), F32(penalty_present)
    if penalty_last_n <= 0 or (r == 1 and a_freq == 0 and a_present == 0):
        return
    cur.sorted = False
    recent = np.asarray(list(last_tokens)[-penalty_last_n:], dtype=np.int64)
    if recent.size == 0:
        return
    ids, counts = np.unique(recent, return_counts=True)
    where = np.searchsorted(ids, cur.ids)  # (size,)
    hit = (where < ids.size) & (ids[np.minimum(where, ids.size - 1)] == cur.ids)
    c = np.where(hit, counts[np.minimum(where, ids.size - 1)], 0).astype(F32)  # (size,)
    z = cur.logits
    scaled = np.where(z <= 0, z * r, z / r)
    penalized = scaled - (c * a_freq + F32(1) * a_present)
    cur.logits = np.where(hit, penalized, z).astype(F32)


# --8<-- [end:penalties]


# --8<-- [start:dry]
def dry(cur: TokenDataArray, last_tokens: Sequence[int], dry_multiplier: float, dry_base: float,
        dry_allowed_length: int, dry_penalty_last_n: int,
        breakers: dict[int, list[tuple[int, ...]]]) -> None:
    r"""``llama_sampler_init_dry``: "Don't Repeat Yourself" (ported from koboldcpp).

    Over the last $N$ = ``dry_penalty_last_n`` tokens, for every earlier occurrence of the
    context's suffix of length $L \ge$ ``dry_allowed_length`` (capped at the distance to the
    last sequence breaker), the token $t$ that followed it would extend the repetition; it is
    penalized by $z_t \leftarrow z_t - m\, b^{L_t - a}$ with $L_t$ the longest such $L$,
    $m$ = ``dry_multiplier``, $b$ = ``dry_base``, $a$ = ``dry_allowed_length`` (exponent
    clamped so the power stays finite). Single-token sequence breakers are never penalized.
    ``breakers`` maps a head token to the token tails of the breakers it starts
    ([`dry_sequence_breakers`][]). Disabled when $m = 0$, $b < 1$ or $N \le 0$. Clears
    ``sorted`` when a penalty pass runs.

    Examples:
        >>> cur = TokenDataArray.from_logits([0.0, 0.0, 0.0])
        >>> dry(cur, [0, 1, 2, 0, 1], 1.0, 2.0, 2, 64, {}); cur.logits.tolist()
        [0.0, 0.0, -1.0]
    """
    mult, base = F32(dry_multiplier), F32(dry_base)
    if mult == 0 or base < 1 or dry_penalty_last_n <= 0:
        return
    recent = list(last_tokens)[-dry_penalty_last_n:]
    n = len(recent)
    if n <= dry_allowed_length:
        return
    rat = recent[::-1]  # rat[i]: the i-th token from the end
    rep_limit = _dry_rep_limit(rat, breakers)
    if rep_limit < dry_allowed_length:
        return
    max_repeat = _dry_max_repeat(rat, rep_limit, dry_allowed_length)
    max_exponent = 0
    if base > F32(1.000001):
        max_exponent = _c_int(float(F32(88.7228391) / _logf(base)))
    z = cur.logits.copy()
    for i in np.flatnonzero(np.isin(cur.ids, list(max_repeat))).tolist():
        tok = int(cur.ids[i])
        if any(len(t) == 0 for t in breakers.get(tok, ())):
            continue
        exp = max_repeat[tok] - dry_allowed_length
        if max_exponent > 0 and exp > max_exponent:
            exp = max_exponent
        with np.errstate(over="ignore"):  # a penalty beyond FLT_MAX is inf, quietly in C
            z[i] = z[i] - F32(float(mult) * float(base) ** exp)
    cur.logits = z
    cur.sorted = False


def _dry_rep_limit(rat: list[int], breakers: dict[int, list[tuple[int, ...]]]) -> int:
    """Step 1: the distance back to the most recent complete sequence breaker (or $N$)."""
    for i, tok in enumerate(rat):
        longest = -1
        for tail in breakers.get(tok, ()):
            if longest < len(tail) <= i and all(t == rat[i - o - 1] for o, t in enumerate(tail)):
                longest = len(tail)
        if longest >= 0:
            return i - longest
    return len(rat)


def _dry_max_repeat(rat: list[int], rep_limit: int, allowed: int) -> dict[int, int]:
    r"""Steps 2-3: $Z_k$ = length of the match between the suffix and the text $k$ tokens
    earlier (the Z-algorithm's values, computed naively), capped at ``rep_limit``; the token
    after each match of length $\\ge$ ``allowed`` gets the longest such length."""
    n, out = len(rat), {}
    for k in range(1, n):
        z = 0
        while z + k < n and rat[z] == rat[z + k]:
            z += 1
        z = min(z, rep_limit)
        if z >= allowed:
            out[rat[k - 1]] = max(out.get(rat[k - 1], 0), z)
    return out


def dry_sequence_breakers(tokenizer: Any, sequence_breakers: Sequence[str]) -> dict[int, list]:
    """``get_overlapping_token_sequences`` for each breaker: {head token: [token tails]}.

    A token whose text contains the breaker is a single-token breaker (empty tail). A token
    whose text *ends* with a proper prefix of the breaker is the head of a multi-token
    breaker; the rest of the breaker is tokenized (at most 20 tokens) as the tail. Breakers
    are truncated to 40 bytes; empty ones are skipped.

    Args:
        tokenizer: has ``n_vocab`` and ``token_to_piece(i, special=True) -> bytes``; and
            ``tokenize(text: bytes, add_special=False, parse_special=False) -> list[int]``
            when a breaker has more than one byte.
        sequence_breakers: the breaker strings (UTF-8).

    Returns:
        The processed breakers, as [`dry`][] takes them.
    """
    pieces = [bytes(tokenizer.token_to_piece(i, special=True)) for i in range(tokenizer.n_vocab)]
    out: dict[int, list[tuple[int, ...]]] = {}
    for text in sequence_breakers:
        s = text.encode("utf-8")[:40]
        if s:
            _overlapping_sequences(tokenizer, pieces, s, out)
    return out


def _overlapping_sequences(tokenizer, pieces: list[bytes], s: bytes, out: dict) -> None:
    for tok, word in enumerate(pieces):
        if s in word:
            _add_tail(out, tok, ())
            continue
        pos = word.find(s[:1])
        while pos != -1:
            i = 1
            while i < len(s) and i + pos < len(word) and word[pos + i] == s[i]:
                i += 1
            if i == len(s) or i + pos >= len(word):  # the word ends with a prefix of s
                tail = []
                if i < len(s):
                    tail = tokenizer.tokenize(s[i:], add_special=False, parse_special=False)
                _add_tail(out, tok, tuple(tail[:20]))
            pos = word.find(s[:1], pos + 1)


def _add_tail(out: dict, tok: int, tail: tuple[int, ...]) -> None:
    if tail not in out.setdefault(tok, []):
        out[tok].append(tail)


# --8<-- [end:dry]


# --8<-- [start:logit_bias]
def logit_bias(cur: TokenDataArray, biases: dict[int, float]) -> None:
    r"""``llama_sampler_init_logit_bias``: $z_t \leftarrow z_t + \beta_t$ for each biased token.

    A bias of $-\infty$ bans a token (it stays a candidate with $p = 0$). Tokens that are not
    candidates are ignored. Order and ``sorted`` are untouched.

    Examples:
        >>> cur = TokenDataArray.from_logits([1.0, 2.0])
        >>> logit_bias(cur, {1: -np.inf}); cur.logits.tolist()
        [1.0, -inf]
    """
    if not biases:
        return
    z = cur.logits.copy()
    for i in np.flatnonzero(np.isin(cur.ids, list(biases))).tolist():
        z[i] = z[i] + F32(biases[int(cur.ids[i])])
    cur.logits = z


# --8<-- [end:logit_bias]


# ---------------------------------------------------------------------------------------------
# common_params_sampling and the chain
# ---------------------------------------------------------------------------------------------

# --8<-- [start:SamplerParams]
@dataclass
class SamplerParams:
    """``common_params_sampling``: the names and defaults of ``common/common.h``.

    ``samplers`` lists the chain after ``logit_bias`` in order; ``dist`` is always appended
    (unless ``mirostat`` is 1 or 2, which replaces the whole list by ``temp`` + mirostat).
    ``dry_penalty_last_n`` defaults to 64 as in ``common.h``; a negative value is clamped to 0
    (disabled) by ``llama_sampler_init_dry`` itself, as is a negative ``penalty_last_n``.
    """

    seed: int = LLAMA_DEFAULT_SEED
    n_prev: int = 64
    min_keep: int = 0
    top_k: int = 40
    top_p: float = 0.95
    min_p: float = 0.05
    xtc_probability: float = 0.0
    xtc_threshold: float = 0.10
    typ_p: float = 1.0
    temp: float = 0.80
    dynatemp_range: float = 0.0
    dynatemp_exponent: float = 1.0
    penalty_last_n: int = 64
    penalty_repeat: float = 1.0
    penalty_freq: float = 0.0
    penalty_present: float = 0.0
    dry_multiplier: float = 0.0
    dry_base: float = 1.75
    dry_allowed_length: int = 2
    dry_penalty_last_n: int = 64
    dry_sequence_breakers: list[str] = field(default_factory=lambda: ["\n", ":", '"', "*"])
    mirostat: int = 0
    mirostat_tau: float = 5.0
    mirostat_eta: float = 0.1
    top_n_sigma: float = -1.0
    logit_bias: dict[int, float] = field(default_factory=dict)
    samplers: list[str] = field(default_factory=lambda: list(DEFAULT_SAMPLERS))


# --8<-- [end:SamplerParams]


def _check_params(params: SamplerParams, n_vocab: int) -> None:
    """``common_sampler_init``'s checks (and ours), before anything is built."""
    r = params.penalty_repeat
    if not (math.isfinite(r) and r > 0 and math.isfinite(1.0 / r)):
        raise SamplingError(f"penalty_repeat must be finite and greater than 0, got {r}")
    for name in ("penalty_freq", "penalty_present"):
        if not math.isfinite(getattr(params, name)):
            raise SamplingError(f"{name} must be finite, got {getattr(params, name)}")
    if n_vocab <= 0:
        raise SamplingError(f"n_vocab must be positive, got {n_vocab}")
    if params.mirostat not in (0, 1, 2):
        raise SamplingError(f"mirostat must be 0, 1 or 2, got {params.mirostat}")
    unknown = [s for s in params.samplers if s not in DEFAULT_SAMPLERS]
    if unknown:
        raise SamplingError(f"unknown sampler names {unknown}; known: {list(DEFAULT_SAMPLERS)}")
    bad = [t for t in params.logit_bias if not 0 <= t < n_vocab]
    if bad:
        raise SamplingError(f"logit_bias tokens {bad} are outside [0, {n_vocab})")


def _dry_enabled(params: SamplerParams) -> bool:
    return (params.mirostat == 0 and "dry" in params.samplers and params.dry_multiplier != 0
            and params.dry_base >= 1 and params.dry_penalty_last_n > 0)


class SamplerChain:
    r"""``common_sampler``: the chain ``common_sampler_init`` builds, its history and RNGs.

    Attributes:
        params: the [`SamplerParams`][] it was built from.
        n_vocab: the vocabulary size.
        stages: the chain's sampler names in order (``logit_bias`` first when there are
            biases, ``dist``/``mirostat``/``mirostat_v2`` last).
        history: the last ``max(32, n_prev, penalty_last_n, dry_penalty_last_n)`` accepted
            tokens, most recent last (llama.cpp's ring buffers of ``common_sampler``,
            ``penalties`` and ``dry`` in one).
        rng_dist, rng_xtc, rng_mirostat: the ``std::mt19937`` of ``dist``, ``xtc`` and
            mirostat, each seeded by its own ``get_rng_seed(seed)`` call, as in llama.cpp.
        mu: mirostat's $\mu$ (``2 tau`` after a reset); updated by ``sample``.
        cur: the candidates of the last ``sample`` (for the top-n probabilities).

    Examples:
        >>> logits = np.array([0.5, 2.0, 1.0, -1.0], np.float32)  # (n_vocab,)
        >>> greedy_like = SamplerChain.from_params(SamplerParams(seed=42, temp=0.0), 4)
        >>> greedy_like.sample(logits)  # temp <= 0 keeps only the largest logit
        1
        >>> chain = SamplerChain.from_params(SamplerParams(seed=42), 4)
        >>> [chain.sample(logits) for _ in range(6)]  # the same draws as llama.cpp's seed 42
        [2, 1, 2, 1, 1, 1]
    """

    def __init__(self, params: SamplerParams, n_vocab: int, stages: list[str], breakers: dict):
        self.params, self.n_vocab, self.stages, self.breakers = params, n_vocab, stages, breakers
        keep = max(32, params.n_prev, params.penalty_last_n, params.dry_penalty_last_n)
        self.history: deque[int] = deque(maxlen=keep)
        self.cur: TokenDataArray | None = None
        self.reset()

    @classmethod
    def from_params(
        cls, params: SamplerParams, n_vocab: int, tokenizer: Any = None
    ) -> SamplerChain:
        """``common_sampler_init``: validate ``params`` and build the chain.

        Args:
            params: the sampling parameters.
            n_vocab: the vocabulary size (the length of every logits row).
            tokenizer: needed only when DRY is on, for its sequence breakers
                (see [`dry_sequence_breakers`][]).

        Returns:
            The chain, its RNGs seeded.

        Raises:
            SamplingError: invalid parameters, unknown sampler names, a biased token outside
                the vocabulary, or DRY on without a tokenizer.

        Examples:
            >>> chain = SamplerChain.from_params(SamplerParams(seed=1), n_vocab=4)
            >>> chain.stages[:4], chain.stages[-2:]
            (['penalties', 'dry', 'top_n_sigma', 'top_k'], ['temperature', 'dist'])
        """
        _check_params(params, n_vocab)
        breakers: dict = {}
        if _dry_enabled(params):
            if tokenizer is None:
                raise SamplingError("DRY (dry_multiplier != 0) needs a tokenizer for its "
                                    "sequence breakers; pass tokenizer=")
            breakers = dry_sequence_breakers(tokenizer, params.dry_sequence_breakers)
        stages = ["logit_bias"] if params.logit_bias else []
        if params.mirostat == 0:
            stages += list(params.samplers) + ["dist"]
        else:
            stages += ["temp", "mirostat" if params.mirostat == 1 else "mirostat_v2"]
        return cls(params, n_vocab, stages, breakers)

    # --8<-- [start:sample]
    def sample(self, logits: np.ndarray) -> int:
        """``common_sampler_sample``: run every stage on the logits and return the token.

        Args:
            logits: ``(n_vocab,)`` float32 logits of one output.

        Returns:
            The selected token id. The history is not touched: call [`accept`][].

        Raises:
            SamplingError: the logits do not have shape ``(n_vocab,)``.

        Examples:
            >>> chain = SamplerChain.from_params(SamplerParams(seed=1, temp=0.0), n_vocab=3)
            >>> chain.sample(np.array([0.5, 2.0, 1.0], np.float32))
            1
        """
        cur = TokenDataArray.from_logits(self._check_logits(logits))
        for stage in self.stages:
            self._apply(stage, cur)
        self.cur = cur
        return int(cur.ids[cur.selected])

    # --8<-- [end:sample]

    def _check_logits(self, logits) -> np.ndarray:
        z = np.asarray(logits, dtype=F32)
        if z.shape != (self.n_vocab,):
            raise SamplingError(f"logits must have shape ({self.n_vocab},), got {z.shape}")
        return z

    def _apply(self, stage: str, cur: TokenDataArray) -> None:
        p = self.params
        table: dict[str, Callable[[], object]] = {
            "logit_bias": lambda: logit_bias(cur, p.logit_bias),
            "penalties": lambda: penalties(cur, self.history, p.penalty_last_n, p.penalty_repeat,
                                           p.penalty_freq, p.penalty_present),
            "dry": lambda: dry(cur, self.history, p.dry_multiplier, p.dry_base,
                               p.dry_allowed_length, p.dry_penalty_last_n, self.breakers),
            "top_n_sigma": lambda: top_n_sigma(cur, p.top_n_sigma),
            "top_k": lambda: top_k(cur, p.top_k),
            "typ_p": lambda: typical(cur, p.typ_p, p.min_keep),
            "top_p": lambda: top_p(cur, p.top_p, p.min_keep),
            "min_p": lambda: min_p(cur, p.min_p, p.min_keep),
            "xtc": lambda: xtc(cur, p.xtc_probability, p.xtc_threshold, p.min_keep,
                               self.rng_xtc),
            "temperature": lambda: temp_ext(cur, p.temp, p.dynatemp_range, p.dynatemp_exponent),
            "temp": lambda: temp(cur, p.temp),
            "dist": lambda: dist(cur, self.rng_dist),
        }
        if stage == "mirostat":
            self.mu = mirostat(cur, self.rng_mirostat, self.mu, self.n_vocab, p.mirostat_tau,
                               p.mirostat_eta)
        elif stage == "mirostat_v2":
            self.mu = mirostat_v2(cur, self.rng_mirostat, self.mu, p.mirostat_tau,
                                  p.mirostat_eta)
        else:
            table[stage]()

    def accept(self, token: int) -> None:
        """``common_sampler_accept``: append ``token`` to the history (penalties, DRY).

        Raises:
            SamplingError: ``token`` is outside ``[0, n_vocab)``.
        """
        if not 0 <= token < self.n_vocab:
            raise SamplingError(f"token {token} is outside [0, {self.n_vocab})")
        self.history.append(int(token))

    def reset(self) -> None:
        """``common_sampler_reset``: clear the history, reseed the RNGs, reset mirostat's mu."""
        self.history.clear()
        seed = self.params.seed
        self.rng_dist = Mt19937(get_rng_seed(seed))
        self.rng_xtc = Mt19937(get_rng_seed(seed))
        self.rng_mirostat = Mt19937(get_rng_seed(seed))
        self.mu = float(F32(2) * F32(self.params.mirostat_tau))

