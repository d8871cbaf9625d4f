r"""Twin of [`reference.sampling`][reference.sampling]: the sampler chain with its array work on the
device.

Everything but the arrays is the reference's: [`SamplerParams`][reference.sampling.SamplerParams],
the chain that ``common_sampler_init`` builds, the history, the ``std::mt19937`` draws and every
single sampler are imported. [`SamplerChain`][] keeps that bookkeeping and runs the common chain --
``logit_bias``, ``penalties``, ``top_k``, ``top_p``, ``min_p``, ``temperature`` and ``dist`` (``temp
<= 0`` included, which is greedy) -- as MLX ops on the logits where they are, as llama.cpp's
*backend sampling* (``backend_apply`` in ``llama-sampler.cpp``) does in its ggml graph: the penalty
counts come from the history as a small array, the uniform draw is taken on the host by the same RNG
and enters as a scalar, and only the chosen token id leaves, with one ``.item()``.

A chain with an active sampler that has no device twin -- DRY, typical, XTC, top-n-sigma,
dynamic temperature, mirostat, or ``min_keep > 1`` -- runs the reference on the host for the
whole step (a disabled sampler is a no-op and does not count).

**The law, exactly.** The device computes softmaxes and running sums in float32 in its own
order, the reference in llama.cpp's (float32 left to right, or double in ``dist``), so
probabilities differ by rounding. Everything else is decided by the same IEEE float32
operations (adds, products, quotients, comparisons of logits), bit for bit. The only
decisions that depend on rounded probabilities are ``top_p``'s cut and ``dist``'s pick; the
device checks the margin of both: with $L$ nonzero terms $e^{z_i - z_{\max}}$ (removed
candidates add exact zeros), the running sums next to the cut must be farther than

$$
\delta_{\text{top-p}} = (4L + 32)\,2^{-24}, \qquad
\delta_{\text{dist}} = (2L + 32)\,2^{-24} \cdot S
$$

from its threshold ($p$, or $u S$ with $S$ the total mass), which bounds the rounding
error of both sides (a sum of $L$ terms in any order errs by at most $(L-1)\,2^{-24}$
of the total; ``exp`` by a few ulps). When a margin is not met (a draw within about $10^{-5}$
of a cumulative boundary with 40 candidates) the device returns $-1$ and the step is redone
by the reference on the host with the *same* draw (the RNG is rewound). The bound is the
worst case, so it grows with $L$: after ``top_k = 40`` (the default) $\delta \approx
10^{-5}$ and about 1% of steps fall back (9 of 1000 measured, 2000-token vocabulary, normal
logits of scale 3), but a ``top_p`` over a whole vocabulary (``top_k <= 0``) has
$\delta \approx 10^{-3}$ to $10^{-2}$ and nearly always falls back. So, for distinct
finite logits, the device chain picks exactly the reference's token, every step; the cost of
the guarantee is a rare host step, counted in `SamplerChain.fallbacks`. The law assumes
the device's float32 ``+ - * /`` are correctly rounded (MLX's CPU backend; Metal's precise
math). Tied logits at a cut are ordered by id in the reference and arbitrarily here.

**Leaving the token on the device.** [`SamplerChain.sample_async`][] takes the step's
draw and launches the step, but does not read the token: it returns a
[`PendingToken`][] whose ``token`` the MLX Context can decode at once
([`accelerated.context.Context.decode_token`][accelerated.context.Context.decode_token]);
[`SamplerChain.resolve`][] reads it back later (and redoes a step whose margin failed on the host,
as [`SamplerChain.sample`][] does). The generation loop
([`reference.tools.generate.Generator`][reference.tools.generate.Generator]) uses this to
launch step $t + 1$ before it reads token $t$. Penalties read the history, which lacks token
$t$ then: the chain counts the tokens it launched and that were not accepted yet from the
device (``token``), so step $t + 1$ sees the same last ``penalty_last_n`` tokens as in the
sequential loop. A chain with a stage that runs only on the host (DRY, mirostat, XTC, ...)
cannot run ahead:
[`SamplerChain.pipelined`][] is False there.
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx
import numpy as np

from reference.sampling import (
    DEFAULT_SAMPLERS,
    F32,
    LLAMA_DEFAULT_SEED,
    Mt19937,
    SamplerParams,
    SamplingError,
    TokenDataArray,
    discrete_distribution,
    dist,
    dry,
    dry_sequence_breakers,
    get_rng_seed,
    greedy,
    logit_bias,
    min_p,
    mirostat,
    mirostat_v2,
    penalties,
    softmax,
    temp,
    temp_ext,
    top_k,
    top_n_sigma,
    top_p,
    typical,
    xtc,
)
from reference.sampling import SamplerChain as _ReferenceChain

__all__ = [
    "DEFAULT_SAMPLERS", "F32", "LLAMA_DEFAULT_SEED", "Mt19937", "PendingToken", "SamplerChain",
    "SamplerParams",
    "SamplingError", "TokenDataArray", "discrete_distribution", "dist", "dry",
    "dry_sequence_breakers", "get_rng_seed", "greedy", "logit_bias", "min_p", "mirostat",
    "mirostat_v2", "penalties", "softmax", "temp", "temp_ext", "top_k", "top_n_sigma", "top_p",
    "typical", "xtc",
]

_EPS = 2.0**-24


_HOST_ONLY = ("dry", "top_n_sigma", "typ_p", "xtc", "temp", "mirostat", "mirostat_v2")


def _is_noop(stage: str, p: SamplerParams) -> bool:
    """Whether ``stage`` leaves every candidate as it is with these parameters."""
    off = {
        "dry": p.dry_multiplier == 0 or p.dry_base < 1 or p.dry_penalty_last_n <= 0,
        "top_n_sigma": p.top_n_sigma <= 0,
        "typ_p": F32(p.typ_p) >= 1,
        "xtc": p.xtc_probability <= 0 or F32(p.xtc_threshold) > F32(0.5),
        "top_k": p.top_k <= 0,
        "top_p": F32(p.top_p) >= 1,
        "min_p": F32(p.min_p) <= 0,
        "penalties": p.penalty_last_n <= 0 or (p.penalty_repeat == 1 and p.penalty_freq == 0
                                               and p.penalty_present == 0),
    }
    return off.get(stage, False)


def _active_stages(params: SamplerParams, stages: list[str]) -> list[str] | None:
    """The stages that do something, or None when one of them has no device twin."""
    active = [stage for stage in stages if not _is_noop(stage, params)]
    dynatemp = "temperature" in active and params.dynatemp_range > 0
    if params.min_keep > 1 or dynatemp or any(stage in _HOST_ONLY for stage in active):
        return None
    return active


class _Cands:
    """The device candidates: ids, logits and a keep mask, all ``(L,)``, in array order."""

    def __init__(self, ids: mx.array, z: mx.array, keep: mx.array, is_sorted: bool):
        self.ids, self.z, self.keep, self.sorted = ids, z, keep, is_sorted

    @property
    def length(self) -> int:
        return self.ids.shape[0]

    def masked(self) -> mx.array:
        return mx.where(self.keep, self.z, -mx.inf)  # (L,)

    def permute(self, order: mx.array) -> None:
        self.ids, self.z, self.keep = self.ids[order], self.z[order], self.keep[order]


# --8<-- [start:device_stages]
def _device_logit_bias(c: _Cands, bias: mx.array) -> None:
    r"""$z_i + \beta_{id_i}$ with a dense bias row (0 where unbiased: $z + 0 = z$)."""
    c.z = c.z + bias[c.ids]  # (L,)


def _device_penalties(c: _Cands, counts: mx.array, p: SamplerParams) -> None:
    """The repetition/frequency/presence rule with counts gathered from a dense row."""
    n = counts[c.ids].astype(mx.float32)  # (L,)
    r = mx.array(F32(p.penalty_repeat))
    scaled = mx.where(c.z <= 0, c.z * r, c.z / r)
    penalized = scaled - (n * mx.array(F32(p.penalty_freq)) + mx.array(F32(p.penalty_present)))
    c.z = mx.where(n > 0, penalized, c.z)  # (L,)
    c.sorted = False


def _device_top_k(c: _Cands, k: int) -> None:
    """Keep the $k$ largest (kept) logits, sorted descending: a static length $k$."""
    k = min(k, c.length)
    if c.sorted:
        order = mx.arange(k)
    else:
        key = -c.masked()
        order = mx.argpartition(key, kth=k - 1)[:k] if k < c.length else mx.arange(c.length)
        order = order[mx.argsort(key[order])]  # (k,)
    c.permute(order)
    c.sorted = True


def _first_true(mask: mx.array) -> mx.array:
    """The index of the first True (0 if none), as a signed int32 scalar."""
    return mx.argmax(mask.astype(mx.int32)).astype(mx.int32)


def _exp(c: _Cands) -> tuple[mx.array, mx.array]:
    r"""$e^{z_i - z_{\max}}$ over the kept candidates (0 elsewhere), and how many are not 0.

    Only the nonzero terms of a sum round ($s + 0 = s$ exactly), so the margins count them.
    """
    z = c.masked()
    e = mx.where(c.keep, mx.exp(z - mx.max(z)), 0.0)  # (L,)
    return e, mx.sum(e > 0).astype(mx.float32)


def _device_top_p(c: _Cands, p: float) -> mx.array:
    """The nucleus cut, and whether every running sum is clear of $p$ by the margin."""
    e, n_terms = _exp(c)
    pr = e / mx.sum(e)  # (L,)
    if not c.sorted:
        order = mx.argsort(-c.masked())  # (L,)
        c.permute(order)
        pr = pr[order]
        c.sorted = True
    cs = mx.cumsum(pr)  # (L,)
    p32, delta = mx.array(F32(p)), (4 * n_terms + 32) * _EPS
    hit = cs >= p32
    first = _first_true(hit)  # the first index with cs >= p
    found = mx.any(hit)
    last = mx.where(found, first, c.length - 1)
    prev = mx.where(last > 0, cs[mx.maximum(last - 1, 0)], 0.0)
    ok = (p32 - prev > delta) & mx.where(found, cs[last] - p32 > delta, True)
    c.keep = c.keep & (mx.arange(c.length) <= last)
    return ok


def _device_min_p(c: _Cands, p: float) -> None:
    r"""$z_i \ge \max z + \mathrm{logf}(p)$: the same float32 add and comparisons."""
    max_logit = mx.maximum(mx.max(c.masked()), mx.array(-np.finfo(np.float32).max))
    log_p = mx.array(np.log(np.float64(F32(p))).astype(F32))
    c.keep = c.keep & (c.z >= max_logit + log_p)


def _device_temp(c: _Cands, t: float) -> None:
    r"""$z / T$, or for $T \le 0$ every logit but the first (kept) maximum to $-\infty$."""
    t = F32(t)
    if t > 0:
        c.z = c.z / mx.array(t)
        return
    first = mx.argmax(c.masked()).astype(mx.int32)
    c.z = mx.where(mx.arange(c.length) == first, c.z, -mx.inf)


def _device_dist(c: _Cands, u: float) -> tuple[mx.array, mx.array]:
    """The token whose running mass first reaches $uS$, and whether it is clear by the margin."""
    e, n_terms = _exp(c)
    cs = mx.cumsum(e)  # (L,)
    total = cs[-1]
    target = total * mx.array(np.float32(u))
    hit = (cs >= target) & c.keep
    first = _first_true(hit)
    prev = mx.where(first > 0, cs[mx.maximum(first - 1, 0)], 0.0)
    delta = (2 * n_terms + 32) * _EPS * total
    ok = mx.any(hit) & (cs[first] - target > delta) & (target - prev > delta) & (total > 0)
    return c.ids[first], ok


# --8<-- [end:device_stages]


# --8<-- [start:PendingToken]
@dataclass
class PendingToken:
    """A sampled token that may still be on the device ([`SamplerChain.sample_async`][]).

    Attributes:
        token: ``(1,)`` int32 ``mx.array``: the device's pick, or 0 when a margin failed
            (a valid id, so that a decode launched with it reads in range; that decode is
            undone when the token resolves otherwise).
        chosen: ``(1,)`` int32: the pick, or -1 when the step must be redone on the host.
        logits: ``(n_vocab,)`` the logits it was sampled from (for the host redo).
        rewind: the draw generator before this step's draw.
        fell_back: set by [`SamplerChain.resolve`][]: the step was redone on the host, so
            ``token`` was not the token.
    """

    token: mx.array
    chosen: mx.array
    logits: mx.array | None = None
    rewind: Mt19937 | None = None
    fell_back: bool = False
# --8<-- [end:PendingToken]


def _index_of(pendings: list[PendingToken], pending: PendingToken) -> int:
    """Where ``pending`` is in ``pendings`` (by identity), or -1."""
    return next((i for i, p in enumerate(pendings) if p is pending), -1)


class SamplerChain(_ReferenceChain):
    """Twin of [`reference.sampling.SamplerChain`][reference.sampling.SamplerChain]: the same chain,
    sampled on the device.

    Attributes:
        device_stages: the stages run on the device, or None when the chain runs on the host.
        fallbacks: how many steps were redone on the host because a margin was not met.

    Examples:
        >>> logits = np.array([0.5, 2.0, 1.0, -1.0], np.float32)  # (n_vocab,)
        >>> chain = SamplerChain.from_params(SamplerParams(seed=42), 4)
        >>> chain.device_stages
        ['top_k', 'top_p', 'min_p', 'temperature', 'dist']
        >>> [chain.sample(mx.array(logits)) for _ in range(6)]  # the reference's tokens
        [2, 1, 2, 1, 1, 1]
    """

    def __init__(self, params: SamplerParams, n_vocab: int, stages: list[str], breakers: dict):
        super().__init__(params, n_vocab, stages, breakers)
        self.device_stages = _active_stages(params, stages)
        self.fallbacks = 0
        self._launched: list[PendingToken] = []  # launched, not yet accepted: oldest first
        bias = np.zeros(n_vocab, np.float32)
        for token, b in params.logit_bias.items():
            bias[token] = F32(b)
        self._bias = mx.array(bias)

    # --8<-- [start:sample]
    def sample(self, logits: mx.array | np.ndarray) -> int:
        """Twin of ``reference.sampling.SamplerChain.sample``: the same token, chosen on device.

        Args:
            logits: ``(n_vocab,)`` logits, an ``mx.array`` (e.g. from
                ``ctx.get_logits_ith_device(i)``) or NumPy.

        Returns:
            The token id the reference chain picks for the same logits, history and draws.

        Raises:
            SamplingError: the logits do not have shape ``(n_vocab,)``.

        Examples:
            >>> from reference.sampling import SamplerParams
            >>> chain = SamplerChain.from_params(SamplerParams(seed=7), n_vocab=3)
            >>> chain.sample(mx.array([0.5, 9.0, 1.0]))
            1
        """
        shape = tuple(logits.shape) if hasattr(logits, "shape") else np.shape(logits)
        if shape != (self.n_vocab,):
            raise SamplingError(f"logits must have shape ({self.n_vocab},), got {shape}")
        if self.device_stages is None:
            return super().sample(np.asarray(logits, dtype=np.float32))
        rewind = self.rng_dist.copy()
        token, ok = self._device_step(mx.array(logits, dtype=mx.float32),
                                      self.rng_dist.uniform_double())
        chosen = int(mx.where(ok, token, -1).item())  # the one transfer
        if chosen >= 0:
            self.cur = None  # the candidates stayed on the device
            return chosen
        self.fallbacks += 1
        self.rng_dist = rewind
        return super().sample(np.asarray(logits, dtype=np.float32))

    # --8<-- [end:sample]

    # --8<-- [start:sample_async]
    @property
    def pipelined(self) -> bool:
        """Whether a step can be launched before the previous token is read back.

        True when every stage runs on the device. The penalties read the history: a step
        launched before the previous token is accepted counts that token from the device
        (``_counts``).
        """
        return self.device_stages is not None

    def sample_async(self, logits: mx.array) -> PendingToken:
        """Launch [`sample`][] on the device; read nothing back (see [`pipelined`][]).

        The step's uniform draw is taken now, in the same order as [`sample`][] takes it.

        The token is launched on its own (``mx.async_eval``), behind the decode it is sampled
        from. MLX gives everything one ``async_eval`` launches a single completion event, so
        a token left for the next decode to compute (it reads the token as its input) would
        carry that decode's event, and reading it back would wait for the whole next step:
        the host's work for a step could never overlap the device's (measured on the tiny
        Llama at depth 4000: ``docs/performance.md``, *A token launched on its own*).

        Examples:
            >>> chain = SamplerChain.from_params(SamplerParams(seed=42), 4)
            >>> p = chain.sample_async(mx.array([0.5, 2.0, 1.0, -1.0]))
            >>> chain.resolve(p), p.fell_back  # the token sample() gives with this seed
            (2, False)
        """
        if not self.pipelined:
            raise SamplingError("this chain cannot sample ahead: it runs on the host or reads "
                                "the history (penalties); use sample()")
        z = mx.array(logits, dtype=mx.float32)  # (n_vocab,)
        rewind = self.rng_dist.copy()
        token, ok = self._device_step(z, self.rng_dist.uniform_double())
        chosen = mx.where(ok, token, -1).astype(mx.int32).reshape(1)  # (1,)
        pending = PendingToken(mx.maximum(chosen, 0), chosen, z, rewind)
        mx.async_eval(pending.token, pending.chosen)  # its own event (see above)
        self._launched.append(pending)
        return pending

    def resolve(self, pending: PendingToken) -> int:
        """The token of a [`sample_async`][] step: read back, or redone on the host.

        A redo rewinds the draws to the step's, as [`sample`][] does, so every later draw
        is the reference's; ``pending.fell_back`` then says that ``pending.token`` was not the
        token. The history is not touched: call [`accept`][reference.sampling.SamplerChain.accept].
        """
        chosen = int(pending.chosen.item())  # the one transfer
        if chosen >= 0:
            self.cur = None
            return chosen
        self.fallbacks += 1
        pending.fell_back = True
        # the steps launched after this one read its device token: the loop takes them back
        self._launched = self._launched[:_index_of(self._launched, pending) + 1]
        self.rng_dist = pending.rewind
        return _ReferenceChain.sample(self, np.asarray(pending.logits, dtype=np.float32))

    def cancel(self, pending: PendingToken) -> None:
        """Forget a launched step that the loop will not use: its draw is taken back."""
        self.rng_dist = pending.rewind
        i = _index_of(self._launched, pending)
        if i >= 0:
            del self._launched[i]

    def accept(self, token: int) -> None:
        """Twin of
        [`reference.sampling.SamplerChain.accept`][reference.sampling.SamplerChain.accept]: the
        oldest launched step, whose token this is, leaves the launched list."""
        super().accept(token)
        if self._launched:
            self._launched.pop(0)

    def reset(self) -> None:
        """Twin of [`reference.sampling.SamplerChain.reset`][reference.sampling.SamplerChain.reset];
        launched steps are forgotten."""
        super().reset()
        self._launched = []
    # --8<-- [end:sample_async]

    def _device_step(self, z: mx.array, u: float) -> tuple[mx.array, mx.array]:
        p = self.params
        c = _Cands(mx.arange(self.n_vocab, dtype=mx.int32), z, mx.ones(z.shape, dtype=mx.bool_),
                   False)
        ok = mx.array(True)
        for stage in self.device_stages:
            if stage == "logit_bias":
                _device_logit_bias(c, self._bias)
            elif stage == "penalties":
                _device_penalties(c, self._counts(), p)
            elif stage == "top_k":
                _device_top_k(c, p.top_k)
            elif stage == "top_p":
                ok = ok & _device_top_p(c, p.top_p)
            elif stage == "min_p":
                _device_min_p(c, p.min_p)
            elif stage == "temperature":
                _device_temp(c, p.temp)
        token, ok_dist = _device_dist(c, u)
        return token, ok & ok_dist & mx.any(c.keep)

    def _counts(self) -> mx.array:
        """The last ``penalty_last_n`` tokens as a dense count row (a small scatter).

        The newest are the launched steps' tokens not accepted yet (on the device: a step
        launched ahead of the previous token's read), then the history's, up to
        ``penalty_last_n`` in all: what the history holds at this step in the sequential loop.
        """
        n = self.params.penalty_last_n
        pending = [p.token for p in self._launched][-n:]  # (1,) each, on the device
        recent = list(self.history)[-(n - len(pending)):] if n > len(pending) else []
        tokens, counts = np.unique(np.asarray(recent, dtype=np.int32), return_counts=True)
        dense = mx.zeros((self.n_vocab,), dtype=mx.int32)
        if tokens.size:
            dense = dense.at[mx.array(tokens)].add(mx.array(counts.astype(np.int32)))
        if pending:
            dense = dense.at[mx.concatenate(pending)].add(1)  # repeated ids add up
        return dense
