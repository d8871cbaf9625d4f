r"""Speculative decoding: a draft proposes, the target verifies the proposal in one batch.

A large *target* model is slow per decode but a decode of $n$ tokens costs little more than
a decode of one. A cheap *draft* (a smaller model with the same vocabulary, or the
target's own first $k$ layers) proposes the next tokens $x_1 \dots x_n$; the target
decodes $[x_0, x_1, \dots, x_n]$ in **one** batch and so has its distributions
$p(\cdot \mid \dots x_{i-1})$ at every drafted position at once. A prefix of the draft is
kept, and the target always adds one token of its own, so one target decode yields between
1 and $n + 1$ tokens.

Three programs of llama.cpp, at the pinned commit, do this; each is written here once over
the [`Context`][reference.context.Context] protocol, so both twins run it:

- [`Speculative`][] (``examples/speculative/speculative.cpp``): draft model, **tree
  drafting** (``-np`` branches split where the draft's $k$-th candidate has probability
  above ``p_split``), all branches verified in one target batch on a unified KV cache kept
  in sync by ``seq_rm`` / ``seq_keep`` / ``seq_cp``; greedy or **stochastic** acceptance;
- [`SpeculativeSimple`][] (``examples/speculative-simple`` + ``common/speculative.cpp``'s
  ``draft-simple``): one sequence, greedy top-1 drafts of at most ``n_max`` tokens, cut
  where the draft's confidence falls below ``p_min``; a recurrent model (Mamba) rolls back
  by restoring a saved sequence state, as llama.cpp's ``PARTIAL_ONLY`` checkpoint;
- prompt-lookup decoding ([`reference.tools.lookup`][reference.tools.lookup], ``examples/lookup``),
  whose drafts come from n-gram statistics instead of a model.

**Greedy acceptance.** The target samples its own token at every position; a drafted
token is kept while it equals that token. The output is, token for token, what plain
greedy generation gives: only the number of target decodes changes.

**Stochastic acceptance** (Leviathan et al. 2023, Chen et al. 2023). The draft token is a
*sample* $x \sim q$ of the draft's distribution; with $u \sim U[0, 1)$ it is accepted when

$$ u \le \frac{p(x)}{q(x)}, $$

and on rejection the token is drawn from the residual

$$ r(y) = \frac{\max(0,\, p(y) - q(y))}{\sum_{z} \max(0,\, p(z) - q(z))}. $$

Then $P(\text{out} = y) = q(y) \min(1, p(y)/q(y)) + (1 - \beta)\, r(y) = p(y)$, where
$\beta = \sum_x \min(p(x), q(x))$ is the acceptance probability: the first term is
$\min(p(y), q(y))$, and $(1 - \beta)\, r(y) = p(y) - \min(p(y), q(y))$ because
$\sum_z \max(0, p(z) - q(z)) = 1 - \beta$. The output has the target's distribution
exactly, whatever the draft is. Several candidates $x_1 \dots x_m \sim q$ (a tree) are
verified one after the other, each against the residual left by the previous rejection
(SpecInfer's multi-step rule, [`verify_candidates`][]). $p$ and $q$ are the distributions
the two sampler chains end with (after top-k, top-p, temperature ...), as *functions of
the token id*: the candidate sets may differ, and where they do, llama.cpp's residual is
wrong ([`residual_llamacpp`][], divergence 21).
"""

from __future__ import annotations

import copy
import dataclasses
import math
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from reference.batch import Batch
from reference.common import LlamarefError
from reference.sampling import (
    Mt19937,
    SamplerChain,
    SamplerParams,
    discrete_distribution,
    get_rng_seed,
)

#: ``examples/speculative/speculative.cpp:17-18``: vocabulary sizes may differ by this much,
#: and token texts are compared from this id on
SPEC_VOCAB_MAX_SIZE_DIFFERENCE = 128
SPEC_VOCAB_CHECK_START_TOKEN_ID = 5


class SpeculativeError(LlamarefError, ValueError):
    """Speculative decoding that cannot run: bad parameters, contexts, or a failed decode.

    Raised before any state changes.
    """


class DraftVocabError(SpeculativeError):
    """A draft model whose vocabulary does not match the target's."""


# ---------------------------------------------------------------------------------------------
# the draft: another model with the same vocabulary, or the target's first layers
# ---------------------------------------------------------------------------------------------

# --8<-- [start:check_draft_vocab]
def check_draft_vocab(target: Any, draft: Any) -> None:
    """The vocabulary checks of ``speculative.cpp:109-165``: the draft must tokenize alike.

    Same tokenizer type, the same BOS / EOS (when added), ``|n_vocab`` difference``| <= 128``,
    and the same token text for every id from 5 on. (llama.cpp stores the vocabulary
    type in a ``bool``, so it only compares "type != 0"; here the types are compared.)

    Args:
        target: the target's tokenizer (``model``, ``n_vocab``, ``tokens``,
            ``add_bos``, ``bos_id``, ``add_eos``, ``eos_id``).
        draft: the draft's tokenizer.

    Raises:
        DraftVocabError: the first difference found, and what to change.

    Examples:
        >>> from types import SimpleNamespace as T
        >>> a = T(model="gpt2", n_vocab=8, tokens=list("abcdefgh"), add_bos=False,
        ...       bos_id=0, add_eos=False, eos_id=0)
        >>> check_draft_vocab(a, a)
        >>> b = T(**dict(vars(a), tokens=list("abcdefgX")))
        >>> check_draft_vocab(a, b)  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        reference.tools.speculative.DraftVocabError: the draft's token 7 is 'X', the target's ...
    """
    fix = ("use a draft model with the target's tokenizer (the same model family), or "
           "--draft-layers K to draft with the target's own first K layers")
    if target.model != draft.model:
        raise DraftVocabError(f"the draft's vocabulary type is {draft.model!r}, the "
                              f"target's {target.model!r}: {fix}")
    for name in ("bos", "eos"):
        add_t, add_d = getattr(target, f"add_{name}"), getattr(draft, f"add_{name}")
        id_t, id_d = getattr(target, f"{name}_id"), getattr(draft, f"{name}_id")
        if add_t != add_d or (add_t and id_t != id_d):
            raise DraftVocabError(f"{name.upper()} differs (add {add_t} / {add_d}, id {id_t} / "
                                  f"{id_d}; target / draft): {fix}")
    diff = abs(target.n_vocab - draft.n_vocab)
    if diff > SPEC_VOCAB_MAX_SIZE_DIFFERENCE:
        raise DraftVocabError(f"the vocabularies have {target.n_vocab} and {draft.n_vocab} "
                              f"tokens (difference {diff} > "
                              f"{SPEC_VOCAB_MAX_SIZE_DIFFERENCE}): {fix}")
    for i in range(SPEC_VOCAB_CHECK_START_TOKEN_ID, min(target.n_vocab, draft.n_vocab)):
        if target.tokens[i] != draft.tokens[i]:
            raise DraftVocabError(f"the draft's token {i} is {draft.tokens[i]!r}, the "
                                  f"target's {target.tokens[i]!r}: {fix}")
# --8<-- [end:check_draft_vocab]


# --8<-- [start:draft_layers]
def draft_layers(hparams: Any, k: int) -> Any:
    """The hyperparameters of the target's first ``k`` layers: self-speculative drafting.

    The draft is a Context over the *same* weights with ``n_layer = k`` (and, for an
    iSWA model such as Gemma 2, the SWA pattern of those ``k`` layers): blocks
    ``0 .. k-1`` then the output norm and head (``output_norm``, ``output`` or the tied
    ``token_embd``), which the forward reads by name. It shares no cache with the target.

    Raises:
        SpeculativeError: ``k`` outside ``[1, n_layer]``.

    Examples:
        >>> from reference.testing import tiny_hparams
        >>> draft_layers(tiny_hparams(n_layer=3), 1).n_layer
        1
        >>> draft_layers(tiny_hparams(n_layer=3), 4)  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        reference.tools.speculative.SpeculativeError: --draft-layers 4: the target has 3 layers; ...
    """
    if not 1 <= k <= hparams.n_layer:
        raise SpeculativeError(f"--draft-layers {k}: the target has {hparams.n_layer} "
                               f"layers; use 1 <= K <= {hparams.n_layer}")
    changes: dict[str, Any] = {"n_layer": k}
    if getattr(hparams, "swa_layers", None):  # the per-layer SWA pattern of those layers
        changes["swa_layers"] = tuple(hparams.swa_layers[:k])
    return dataclasses.replace(hparams, **changes)
# --8<-- [end:draft_layers]


# ---------------------------------------------------------------------------------------------
# distributions and the acceptance rule
# ---------------------------------------------------------------------------------------------

# --8<-- [start:chain_probs]
def chain_probs(chain: SamplerChain, logits: np.ndarray) -> tuple[int, np.ndarray]:
    """``common_sampler_sample`` then ``common_sampler_get_candidates``, as a dense vector.

    The chain runs on the host (the reference chain's ``sample``, also for its MLX twin,
    whose candidates stay on the device); its last stage's probabilities over the
    candidates that survived are put at their token ids.

    Returns:
        ``(token, p)``: the chain's own pick, and ``p`` of shape ``(n_vocab,)`` float64,
        zero outside the candidates.

    Examples:
        >>> params = SamplerParams(seed=1, top_k=2, temp=1.0)
        >>> chain = SamplerChain.from_params(params, 4)
        >>> token, p = chain_probs(chain, np.array([0.0, 2.0, 1.0, -1.0], np.float32))
        >>> token, p.round(3).tolist()  # softmax of the top 2 logits
        (2, [0.0, 0.731, 0.269, 0.0])
    """
    token = SamplerChain.sample(chain, logits)
    cur = chain.cur
    p = np.zeros(chain.n_vocab, np.float64)  # (n_vocab,)
    p[cur.ids] = cur.p
    return token, p
# --8<-- [end:chain_probs]


# --8<-- [start:residual]
def residual(p: np.ndarray, q: np.ndarray) -> np.ndarray:
    r"""The residual distribution $r \propto \max(0, p - q)$, token id by token id.

    Args:
        p: ``(n_vocab,)`` target probabilities (zero outside its candidates).
        q: ``(n_vocab,)`` draft probabilities.

    Returns:
        ``(n_vocab,)``; ``p`` itself when $p \le q$ everywhere (then $p = q$ and a
        rejection cannot happen but for rounding).

    Examples:
        >>> residual(np.array([0.5, 0.5, 0.0]), np.array([0.0, 0.5, 0.5])).tolist()
        [1.0, 0.0, 0.0]
    """
    r = np.maximum(p - q, 0.0)  # (n_vocab,)
    total = r.sum()
    return r / total if total > 0 else p
# --8<-- [end:residual]


# --8<-- [start:residual_llamacpp]
def residual_llamacpp(p_ids: np.ndarray, p: np.ndarray, q_ids: np.ndarray,
                      q: np.ndarray) -> np.ndarray:
    """llama.cpp's residual (``speculative.cpp:330-361``): wrong when candidate sets differ.

    Both candidate lists are sorted by token id and subtracted **by list position**:
    ``p[i] = max(0, p[i] - q[i])`` for ``i < len(q)``, then normalized. When the target
    and the draft kept different tokens (a different top-k, top-p or min-p cut), entry
    ``i`` of one list is another token than entry ``i`` of the other, and the draft's
    probability of one token is taken off the target's probability of another.

    Args:
        p_ids: the target's candidate ids (any order).
        p: their probabilities.
        q_ids: the draft's candidate ids.
        q: their probabilities.

    Returns:
        ``(n_vocab,)`` dense, indexed by the target's candidate ids (``n_vocab`` =
        ``max(p_ids) + 1``).

    Examples:
        >>> # target keeps {0, 1}, draft keeps {1, 2}: q(1) is taken off p(0)
        >>> residual_llamacpp([0, 1], [0.6, 0.4], [1, 2], [0.3, 0.7]).round(3).tolist()
        [1.0, 0.0]
        >>> p, q = np.array([0.6, 0.4, 0.0]), np.array([0.0, 0.3, 0.7])
        >>> residual(p, q).round(3).tolist()  # token id by token id
        [0.857, 0.143, 0.0]
    """
    p_ids, q_ids = np.asarray(p_ids), np.asarray(q_ids)
    p_sorted = np.asarray(p, np.float64)[np.argsort(p_ids, kind="stable")]
    q_sorted = np.asarray(q, np.float64)[np.argsort(q_ids, kind="stable")]
    n = min(len(p_sorted), len(q_sorted))
    out = p_sorted.copy()
    out[:n] = np.maximum(0.0, p_sorted[:n] - q_sorted[:n])  # by position, not by id
    total = out.sum()  # llama.cpp divides by a zero sum too (NaN); here p is kept
    out = out / total if total > 0 else p_sorted
    dense = np.zeros(int(p_ids.max()) + 1, np.float64)
    dense[np.sort(p_ids)] = out
    return dense
# --8<-- [end:residual_llamacpp]


# --8<-- [start:verify_candidates]
def verify_candidates(p: np.ndarray, candidates: list[tuple[int, np.ndarray]],
                      rng: Mt19937) -> tuple[int, int]:
    r"""Stochastic verification of drafted tokens $x_i \sim q_i$ against the target's $p$.

    For each candidate in turn: draw $u$, accept $x_i$ when $u\, q_i(x_i) \le p(x_i)$ (that
    is $u \le p/q$); else replace $p$ by the residual $\max(0, p - q_i)$, normalized
    ([`residual`][]), and try the next. When every candidate is rejected the token is
    drawn from what is left of $p$. With one candidate this is the rejection-sampling rule;
    with several it is SpecInfer's: the output is distributed as $p$ exactly, when the
    candidates were drawn independently from their $q_i$.

    Args:
        p: ``(n_vocab,)`` the target's distribution at this position.
        candidates: ``(token, q)`` pairs, ``q`` the ``(n_vocab,)`` distribution the token
            was drawn from.
        rng: the draws ($u$, and the final token).

    Returns:
        ``(k, token)``: the index of the accepted candidate, or -1 and the token drawn
        from the residual.

    Examples:
        >>> p, q = np.array([0.25, 0.75]), np.array([0.75, 0.25])
        >>> rng = Mt19937(3)
        >>> [verify_candidates(p, [(0, q)], rng) for _ in range(4)]
        [(0, 0), (-1, 1), (-1, 1), (0, 0)]
    """
    for k, (token, q) in enumerate(candidates):
        u = rng.uniform_double()
        if u * q[token] <= p[token]:
            return k, int(token)
        p = residual(p, q)
    return -1, draw(p, rng)
# --8<-- [end:verify_candidates]


# --8<-- [start:draw]
def draw(q: np.ndarray, rng: Mt19937) -> int:
    """One token from the dense distribution ``q`` (``std::discrete_distribution``).

    Examples:
        >>> draw(np.array([0.0, 0.0, 1.0]), Mt19937(0))
        2
    """
    return discrete_distribution(q, rng)
# --8<-- [end:draw]


# ---------------------------------------------------------------------------------------------
# statistics, as llama.cpp prints them
# ---------------------------------------------------------------------------------------------

# --8<-- [start:SpecStats]
@dataclass
class SpecStats:
    r"""The counters of the speculative examples (``speculative.cpp:638-646``).

    ``n_drafted`` is what each program counts: drafted tokens (speculative-simple,
    lookup), or draft decode *steps* (speculative: with ``-np > 1`` a step drafts one
    token per branch). ``accept = 100 n_accept / n_drafted``.

    Examples:
        >>> s = SpecStats(n_draft=3, n_input=4, n_predict=10, n_drafted=8, n_accept=6)
        >>> print("\n".join(s.lines()[3:]))
        n_draft   = 3
        n_predict = 10
        n_drafted = 8
        n_accept  = 6
        accept    = 75.000%
    """

    n_draft: int = 0
    n_input: int = 0
    n_predict: int = 0
    n_drafted: int = 0
    n_accept: int = 0
    t_enc_s: float = 0.0
    t_dec_s: float = 0.0

    @property
    def accept(self) -> float:
        """``100 n_accept / n_drafted`` in percent (NaN before any draft)."""
        return 100.0 * self.n_accept / self.n_drafted if self.n_drafted else math.nan

    def lines(self) -> list[str]:
        """``encoded ...``, ``decoded ...``, a blank line, then the counters."""
        return [
            f"encoded {self.n_input:4d} tokens in {self.t_enc_s:8.3f} seconds, speed: "
            f"{_rate(self.n_input, self.t_enc_s):8.3f} t/s",
            f"decoded {self.n_predict:4d} tokens in {self.t_dec_s:8.3f} seconds, speed: "
            f"{_rate(self.n_predict, self.t_dec_s):8.3f} t/s",
            "",
            f"n_draft   = {self.n_draft}",
            f"n_predict = {self.n_predict}",
            f"n_drafted = {self.n_drafted}",
            f"n_accept  = {self.n_accept}",
            f"accept    = {self.accept:.3f}%",
        ]
# --8<-- [end:SpecStats]


def _rate(n: int, seconds: float) -> float:
    return n / seconds if seconds > 0 else math.nan


def never_eog(token: int) -> bool:
    """The ``is_eog`` of no vocabulary: no token ends generation (the default of the loops).

    Examples:
        >>> never_eog(2)
        False
    """
    return False


def decode_checked(ctx: Any, batch: Batch, what: str) -> None:
    """``ctx.decode(batch)``, or a SpeculativeError that says why (llama.cpp ignores it)."""
    ret = ctx.decode(batch)
    if ret != 0:
        raise SpeculativeError(f"the {what} decode of {batch.n_tokens} tokens returned {ret}: "
                               f"{ctx.last_error or 'no reason given'}")


def check_prompt(ctx: Any, tokens: list[int], n_predict: int, n_draft: int) -> int:
    """``prompt too long (%d tokens, max %d)``: the prompt must leave 4 cells free.

    Returns:
        ``n_predict``, capped so that a round of ``n_draft`` drafted tokens always fits
        in a KV cache (-1: no limit; a recurrent memory has no cells to run out of).
    """
    if len(tokens) < 1:
        raise SpeculativeError("the prompt is empty: give at least one token")
    room = ctx.n_ctx - 4
    if len(tokens) > room:
        raise SpeculativeError(f"prompt too long ({len(tokens)} tokens, max {room}): use a "
                               "larger -c/--ctx-size")
    if ctx.recurrent:
        return n_predict
    room = ctx.n_ctx - len(tokens) - n_draft - 2
    if room < 1:
        raise SpeculativeError(f"no room to generate: n_ctx {ctx.n_ctx} holds the prompt "
                               f"({len(tokens)} tokens) but not a draft of {n_draft}: use a "
                               "larger -c/--ctx-size")
    return room if n_predict < 0 else min(n_predict, room)


def draft_simple_chain(n_vocab: int) -> SamplerChain:
    """The draft sampler of ``draft-simple`` (``common/speculative.cpp:231-238``):
    ``top_k = 10`` at temperature 1, then ``dist`` (whose pick is ignored: the draft
    takes the most probable candidate)."""
    params = SamplerParams(seed=0, top_k=10, samplers=["top_k"])
    return SamplerChain.from_params(params, n_vocab)


# --8<-- [start:draft_greedy]
@dataclass(frozen=True)
class DraftSeq:
    """One sequence's share of a ``draft-simple`` call (``common_speculative_draft_params``):
    draft after ``id_last``, decoded at ``pos0`` on ``seq_id``, at most ``n_max`` tokens;
    ``pending``: tokens the draft's sequence still lacks before ``id_last`` (at positions
    ``pos0 - len(pending)`` on), decoded in the same first batch.

    Examples:
        >>> DraftSeq(seq_id=1, id_last=5, pos0=2, n_max=3, pending=(1, 2))  # 1 2 5 at 0 1 2
        DraftSeq(seq_id=1, id_last=5, pos0=2, n_max=3, pending=(1, 2))
    """

    seq_id: int
    id_last: int
    pos0: int
    n_max: int
    pending: tuple[int, ...] = ()


def draft_simple(ctx_dft: Any, chains: dict[int, SamplerChain], seqs: list[DraftSeq],
                 n_max: int, n_min: int, p_min: float, n_vocab: int) -> dict[int, list[int]]:
    r"""``draft-simple``'s ``draft()`` (``common/speculative.cpp:308-413``): every sequence
    drafts in the same draft decodes.

    The first decode holds each sequence's ``pending`` tokens and its ``id_last`` at its
    ``pos0`` (only ``id_last`` outputs); each later decode holds one row per sequence still
    drafting. A sequence proposes the most probable candidate of its chain (top-10 at
    temperature 1, [`draft_simple_chain`][], reset at each call) while that probability is
    at least ``p_min`` and its draft is shorter than both ``n_max`` and its own ``n_max``;
    each proposal is decoded when the sequence drafts on after it. So a call costs
    $1 + \max_s |\text{draft}_s|$ decodes at most, whatever the number of sequences. A
    draft shorter than ``n_min`` is dropped. Afterwards the draft's cache holds, for each
    sequence, its ``pending`` tokens, ``id_last`` from ``pos0``, and at least every drafted
    token but the last; a sequence that may draft nothing (``n_max <= 0``) is not decoded.

    Returns:
        ``seq_id`` -> its draft (every sequence of ``seqs`` has an entry, maybe empty).

    Raises:
        SpeculativeError: a draft decode failed (the cache may hold part of the drafts).

    Examples:
        >>> from reference.context import Context
        >>> from reference.testing import random_weights, tiny_hparams
        >>> hp = tiny_hparams()
        >>> ctx = Context(hp, random_weights(hp), n_ctx=64, n_seq_max=2)
        >>> chains = {s: draft_simple_chain(hp.n_vocab) for s in (0, 1)}
        >>> seqs = [DraftSeq(0, id_last=5, pos0=2, n_max=3, pending=(1, 2)),
        ...         DraftSeq(1, id_last=7, pos0=0, n_max=1)]
        >>> out = draft_simple(ctx, chains, seqs, 4, n_min=0, p_min=0.0, n_vocab=hp.n_vocab)
        >>> len(out[0]), len(out[1])
        (3, 1)
        >>> ctx.memory.seq_pos_max(0), ctx.memory.seq_pos_max(1)  # every draft but the last
        (4, 0)
    """
    out: dict[int, list[int]] = {s.seq_id: [] for s in seqs}
    going = [s for s in seqs if min(n_max, s.n_max) > 0]
    if not going:
        return out
    tok, pos, seq, logits, rows = [], [], [], [], []
    for s in going:
        chains[s.seq_id].reset()
        n = len(s.pending)
        tok += [*s.pending, s.id_last]
        pos += range(s.pos0 - n, s.pos0 + 1)
        seq += [[s.seq_id]] * (n + 1)
        logits += [False] * n + [True]
        rows.append(len(tok) - 1)
    decode_checked(ctx_dft, Batch(token=tok, pos=pos, seq_id=seq, logits=logits), "draft")
    while going:
        going_next = []
        for row, s in zip(rows, going, strict=True):
            chain, draft = chains[s.seq_id], out[s.seq_id]
            _, q = chain_probs(chain, _widen(ctx_dft.get_logits_ith(row), n_vocab))
            token = int(np.argmax(q))
            if q[token] < p_min:  # only very confident drafts
                continue
            chain.accept(token)
            draft.append(token)
            if len(draft) < min(n_max, s.n_max):
                going_next.append(s)
        going, rows = going_next, list(range(len(going_next)))
        if going:
            decode_checked(ctx_dft, Batch(
                token=[out[s.seq_id][-1] for s in going],
                pos=[s.pos0 + len(out[s.seq_id]) for s in going],
                seq_id=[[s.seq_id] for s in going], logits=[True] * len(going)), "draft")
    return {k: v if len(v) >= n_min else [] for k, v in out.items()}


def draft_greedy(ctx_dft: Any, chain: SamplerChain, id_last: int, pos0: int, n_max: int,
                 n_min: int, p_min: float, n_vocab: int, seq_id: int = 0) -> list[int]:
    """[`draft_simple`][] for one sequence: the draft after ``id_last`` (decoded at
    ``pos0`` on ``seq_id``), at most ``n_max`` tokens, ``[]`` when shorter than ``n_min``.

    Raises:
        SpeculativeError: a draft decode failed (the cache may hold part of the draft).
    """
    return draft_simple(ctx_dft, {seq_id: chain}, [DraftSeq(seq_id, id_last, pos0, n_max)],
                        n_max, n_min, p_min, n_vocab)[seq_id]
# --8<-- [end:draft_greedy]


# --8<-- [start:sample_and_accept_n]
def sample_and_accept_n(sample: Callable[[int], int], draft: list[int],
                        is_eog: Callable[[int], bool] = never_eog) -> list[int]:
    """``common_sampler_sample_and_accept_n`` (``common/sampling.cpp:678-710``): the
    greedy-match acceptance rule.

    ``sample(i)`` samples (and accepts into the target's chain) the token of the target's
    output row ``i``, where row ``i`` follows the draft's first ``i`` tokens. The target
    samples row by row while its token equals the drafted one (never past an
    end-of-generation token before the last row); after a full match it adds the token of
    row ``len(draft)``. So 1 to ``len(draft) + 1`` tokens are returned, and every one is
    the target's own sample: with the same rows, plain decoding gives the same tokens.

    Examples:
        >>> rows = [5, 6, 9, 4]  # the target's token at each row
        >>> sample_and_accept_n(rows.__getitem__, [5, 6, 7])  # 7 rejected: 9 instead
        [5, 6, 9]
        >>> sample_and_accept_n(rows.__getitem__, [5, 6, 9])  # all kept, plus one
        [5, 6, 9, 4]
        >>> sample_and_accept_n(rows.__getitem__, [])
        [5]
    """
    ids: list[int] = []
    for i, want in enumerate(draft):
        token = sample(i)
        ids.append(token)
        if token != want or (is_eog(token) and i + 1 < len(draft)):
            return ids
    return [*ids, sample(len(draft))]
# --8<-- [end:sample_and_accept_n]


# ---------------------------------------------------------------------------------------------
# examples/speculative: a draft model, tree drafting, greedy or stochastic verification
# ---------------------------------------------------------------------------------------------

# --8<-- [start:Branch]
@dataclass
class Branch:
    """``seq_draft`` (``speculative.cpp:20-32``): one branch of the draft tree.

    Attributes:
        active: still a candidate path in the verification.
        drafting: still drafting in this round.
        skip: created in this drafting step (it drafts from the next step on).
        i_batch_dft: its row in the last draft batch (the logits it drafts from).
        i_batch_tgt: its rows in the target batch; ``i_batch_tgt[i]`` predicts
            ``tokens[i]``.
        tokens: drafted tokens.
        dists: ``(n_vocab,)`` draft distribution each token was drawn from.
        chain: the branch's draft sampler.
    """

    active: bool = False
    drafting: bool = False
    skip: bool = False
    i_batch_dft: int = 0
    i_batch_tgt: list[int] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)
    dists: list[np.ndarray] = field(default_factory=list)
    chain: Any = None
# --8<-- [end:Branch]


class _BatchBuilder:
    """``common_batch``: tokens, positions, seq id lists, output flags; ``add_seq``."""

    def __init__(self):
        self.token, self.pos, self.seq_id = [], [], []

    def __len__(self) -> int:
        return len(self.token)

    def add(self, token: int, pos: int, seq_id: int) -> None:
        self.token.append(int(token))
        self.pos.append(int(pos))
        self.seq_id.append([seq_id])

    def add_seq(self, i: int, seq_id: int) -> None:
        self.seq_id[i].append(seq_id)

    def batch(self) -> Batch:
        n = len(self.token)
        return Batch(token=self.token, pos=self.pos, seq_id=self.seq_id, logits=[True] * n)


# --8<-- [start:Speculative]
class Speculative:
    r"""``llama-speculative``: a draft model drafts a tree, the target verifies it in one batch.

    Each round (``speculative.cpp:242-632``):

    1. **verify** the last target batch, position by position: greedy (``temp <= 0``):
       the target's token, kept while a branch drafted it; stochastic: the branches'
       tokens at this depth are verified by [`verify_candidates`][];
    2. **sync the caches** on the kept branch ``s_keep``: draft ``seq_keep(s_keep)``,
       ``seq_cp(s_keep, 0)``, ``seq_keep(0)``; target the same after
       ``seq_rm(s_keep, n_past_tgt, -1)``; the draft decodes the new token;
    3. **draft** up to ``n_draft`` tokens: each drafting branch reads its draft logits;
       while its $f$-th most probable candidate ($f = 1 \dots 7$) has probability above
       ``p_split`` and fewer than ``n_seq_dft`` branches exist, the branch splits
       (``seq_cp`` in the draft, ``add_seq`` of its target rows); the target batch holds
       at most ``n_draft + 1`` tokens in all;
    4. **evaluate** the target on the whole tree in one batch (``seq_cp(0, s)`` first, so
       every branch sees the prefix).

    Where it differs from llama.cpp, on purpose:

    - stochastic drafts are *samples* of the draft's distribution (one independent draw
      per branch), and the residual is taken token id by token id: the output has the
      target's distribution exactly. llama.cpp drafts the $k$-th most probable token and
      subtracts by list position ([`residual_llamacpp`][], divergence 21);
    - greedy drafts rank the draft's candidates by the ``draft-simple`` chain (top-10 at
      temperature 1, [`draft_simple_chain`][]): with the target's greedy chain the
      temperature stage leaves one candidate, so llama.cpp's tree never splits at
      ``temp = 0``;
    - the contexts must be unified with ``n_seq_max >= n_seq_dft`` (a tree batch couples
      sequences; llama.cpp cannot enable ``--kv-unified`` for this example);
    - generation stops at exactly ``n_predict`` tokens, or at the first end-of-generation
      token (llama.cpp checks between rounds and may print up to ``n_draft`` more).

    Args:
        ctx_tgt: the target's Context (either twin).
        ctx_dft: the draft's Context.
        params: the target's sampling parameters (the draft's too when stochastic).
        n_draft: tokens to draft per round (``--draft-max``, default 3).
        n_seq_dft: most branches (``-np``, default 1: a chain).
        p_split: split threshold (``--draft-p-split``, default 0.10).
        is_eog: end-of-generation test.

    Raises:
        SpeculativeError: a recurrent model (no partial ``seq_rm``: use
            [`SpeculativeSimple`][]), contexts that are not unified or have too few
            sequences, different ``n_ctx``, ``n_draft < 1``, ``n_seq_dft < 1``.

    Examples:
        >>> from reference.context import Context
        >>> from reference.testing import tiny_hparams, random_weights
        >>> hp = tiny_hparams(n_layer=2)
        >>> w = random_weights(hp, seed=1)
        >>> tgt = Context(hp, w, n_ctx=64, n_seq_max=2)
        >>> dft = Context(draft_layers(hp, 1), w, n_ctx=64, n_seq_max=2)
        >>> spec = Speculative(tgt, dft, SamplerParams(temp=0.0), n_draft=4, n_seq_dft=2)
        >>> out = list(spec.generate([1, 2, 3], n_predict=12))
        >>> len(out), spec.stats.n_predict
        (12, 12)
    """

    def __init__(self, ctx_tgt: Any, ctx_dft: Any, params: SamplerParams, n_draft: int = 3,
                 n_seq_dft: int = 1, p_split: float = 0.10,
                 is_eog: Callable[[int], bool] = never_eog):
        _check_contexts(ctx_tgt, ctx_dft, n_seq_dft, n_draft)
        self.ctx_tgt, self.ctx_dft = ctx_tgt, ctx_dft
        self.params, self.n_draft, self.n_seq_dft = params, n_draft, n_seq_dft
        self.p_split, self.is_eog = p_split, is_eog
        self.n_vocab = ctx_tgt.n_vocab
        self.stochastic = params.temp > 0
        self.smpl = SamplerChain.from_params(params, self.n_vocab)
        self.rng = Mt19937(get_rng_seed(params.seed))  # speculative.cpp:69
        self.stats = SpecStats(n_draft=n_draft)
        self.drafts = [Branch() for _ in range(n_seq_dft)]
        self.batch_tgt = _BatchBuilder()
        self.batch_dft = _BatchBuilder()
        self.n_split = 0  # branches created, over the whole run
    # --8<-- [end:Speculative]

    # --8<-- [start:generate]
    def generate(self, prompt: list[int], n_predict: int = -1) -> Iterator[int]:
        """Decode ``prompt`` with both models, then yield each generated token.

        Stops after ``n_predict`` tokens (-1: no limit), an end-of-generation token
        (yielded), or when a KV cache could not hold another round. `stats` holds the
        counters.
        """
        n_predict = check_prompt(self.ctx_tgt, prompt, n_predict, self.n_draft)
        t0 = time.perf_counter()
        self.eval_prompt(prompt)
        t1 = time.perf_counter()
        self.stats.n_input, self.stats.t_enc_s = len(prompt), t1 - t0
        self.drafts[0].i_batch_tgt = [0]
        try:
            while True:
                tokens, done = self.verify(n_predict)
                yield from tokens
                if done:
                    return
                self.sync_kv(tokens[-1])
                self.draft(tokens[-1])
                self.eval_target()
        finally:
            self.stats.t_dec_s = time.perf_counter() - t1
    # --8<-- [end:generate]

    def eval_prompt(self, prompt: list[int]) -> None:
        """Target: ``prompt[:-1]`` then the last token; draft: all of it (:192-202)."""
        for token in prompt:
            self.smpl.accept(token)
        if len(prompt) > 1:
            decode_checked(self.ctx_tgt, Batch(token=prompt[:-1]), "target prompt")
        decode_checked(self.ctx_tgt, Batch(token=prompt[-1:]), "target prompt")
        decode_checked(self.ctx_dft, Batch(token=prompt), "draft prompt")
        self.n_past_tgt = self.n_past_dft = len(prompt)

    # --8<-- [start:verify]
    def verify(self, n_predict: int) -> tuple[list[int], bool]:
        """Step 1: the accepted drafted tokens, then the target's own token.

        Returns:
            ``(tokens, done)``: ``done`` when ``n_predict`` or an end of generation is
            reached (the caches are then left as they are).
        """
        self.i_dft, self.s_keep = 0, 0
        out = []
        while True:
            accepted, token = self.verify_one()
            self.smpl.accept(token)
            out.append(token)
            self.stats.n_predict += 1
            if self.is_eog(token) or self.stats.n_predict == n_predict:
                return out, True
            if not accepted:
                return out, False
            self.stats.n_accept += 1
            self.n_past_tgt += 1
            self.n_past_dft += 1
            self.i_dft += 1

    def verify_one(self) -> tuple[bool, int]:
        """The target's token at depth ``i_dft``, and whether a branch drafted it."""
        row = self.drafts[self.s_keep].i_batch_tgt[self.i_dft]
        logits = self.ctx_tgt.get_logits_ith(row)
        token, p = chain_probs(self.smpl, logits)
        live = [s for s, d in enumerate(self.drafts) if d.active]
        for s in live:  # a branch that drafted nothing at this depth is done
            if self.i_dft >= len(self.drafts[s].tokens):
                self.drafts[s].active = False
        live = [s for s in live if self.drafts[s].active]
        if self.stochastic and live:
            cands = [(self.drafts[s].tokens[self.i_dft], self.drafts[s].dists[self.i_dft])
                     for s in live]
            _, token = verify_candidates(p, cands, self.rng)
        accepted = False
        for s in live:  # the branches that drafted the token stay; the last one is kept
            if self.drafts[s].tokens[self.i_dft] == token:
                self.s_keep, accepted = s, True
            else:
                self.drafts[s].active = False
        return accepted, token
    # --8<-- [end:verify]

    # --8<-- [start:sync_kv]
    def sync_kv(self, token: int) -> None:
        """Step 2 (:447-483): keep branch ``s_keep`` as sequence 0 in both caches; the
        draft decodes ``token``, the first token of the next target batch."""
        mem_dft, mem_tgt, s = self.ctx_dft.memory, self.ctx_tgt.memory, self.s_keep
        mem_dft.seq_keep(s)
        mem_dft.seq_cp(s, 0, -1, -1)
        mem_dft.seq_keep(0)
        mem_tgt.seq_rm(s, self.n_past_tgt, -1)
        mem_tgt.seq_keep(s)
        mem_tgt.seq_cp(s, 0, -1, -1)
        mem_tgt.seq_keep(0)
        for d in self.drafts:
            d.active, d.tokens, d.i_batch_tgt, d.dists = False, [], [], []
        self.drafts[0].tokens, self.drafts[0].dists = [token], [None]  # erased at step 4
        self.drafts[0].i_batch_tgt = [0]
        mem_dft.seq_rm(0, self.n_past_dft, -1)
        decode_checked(self.ctx_dft, Batch(token=[token], pos=[self.n_past_dft], seq_id=[[0]]),
                "draft")
        self.n_past_dft += 1
    # --8<-- [end:sync_kv]

    # --8<-- [start:draft]
    def draft(self, token: int) -> None:
        """Step 3 (:489-609): grow the tree, one draft decode per depth."""
        d0 = self.drafts[0]
        d0.chain = (copy.deepcopy(self.smpl) if self.stochastic
                    else draft_simple_chain(self.n_vocab))
        for d in self.drafts:
            d.active = d.drafting = False
        d0.active = d0.drafting = True
        d0.i_batch_dft = 0
        self.n_seq_cur, n_past_cur = 1, self.n_past_dft
        self.batch_tgt = _BatchBuilder()
        self.batch_tgt.add(token, self.n_past_tgt, 0)
        for i in range(self.n_draft):
            self.batch_dft = _BatchBuilder()
            for d in self.drafts:
                d.skip = False
            for s in range(self.n_seq_dft):
                if self.drafts[s].drafting and not self.drafts[s].skip:
                    self.draft_branch(s, i, n_past_cur)
            if len(self.batch_dft) == 0:
                break
            decode_checked(self.ctx_dft, self.batch_dft.batch(), "draft")
            n_past_cur += 1
            self.stats.n_drafted += 1  # one per draft decode, as llama.cpp counts
            if len(self.batch_tgt) > self.n_draft:
                break

    def draft_branch(self, s: int, i: int, n_past_cur: int) -> None:
        """Branch ``s`` drafts at depth ``i``, splitting where the draft hesitates."""
        d = self.drafts[s]
        logits = self.ctx_dft.get_logits_ith(d.i_batch_dft)
        _, q = chain_probs(d.chain, _widen(logits, self.n_vocab))
        ranked = np.argsort(-q, kind="stable")  # candidates by probability
        group = [s] + self.split(s, q[ranked])
        for k, b in enumerate(group):
            br = self.drafts[b]
            token = draw(q, self.rng) if self.stochastic else int(ranked[k])
            br.chain.accept(token)
            br.tokens.append(token)
            br.dists.append(q)
            br.i_batch_tgt.append(len(self.batch_tgt))
            self.batch_tgt.add(token, self.n_past_tgt + i + 1, b)
            br.i_batch_dft = len(self.batch_dft)
            self.batch_dft.add(token, n_past_cur, b)
            if len(self.batch_tgt) > self.n_draft:
                br.drafting = False

    def split(self, s: int, q_ranked: np.ndarray) -> list[int]:
        """New branches copied from ``s`` while ``q_ranked[f] > p_split``, ``f = 1..7``."""
        new = []
        for f in range(1, min(8, len(q_ranked))):
            if not (self.n_seq_cur < self.n_seq_dft and q_ranked[f] > self.p_split):
                break
            n = self.n_seq_cur
            self.ctx_dft.memory.seq_rm(n, -1, -1)
            self.ctx_dft.memory.seq_cp(s, n, -1, -1)
            for t in self.drafts[s].i_batch_tgt:
                self.batch_tgt.add_seq(t, n)
            src = self.drafts[s]
            self.drafts[n] = Branch(active=True, drafting=True, skip=True,
                                    i_batch_dft=src.i_batch_dft,
                                    i_batch_tgt=list(src.i_batch_tgt), tokens=list(src.tokens),
                                    dists=list(src.dists), chain=copy.deepcopy(src.chain))
            new.append(n)
            self.n_seq_cur += 1
            self.n_split += 1
        return new
    # --8<-- [end:draft]

    # --8<-- [start:eval_target]
    def eval_target(self) -> None:
        """Step 4 (:611-631): every branch sees the prefix; one target decode of the tree."""
        mem = self.ctx_tgt.memory
        mem.seq_keep(0)
        for s in range(1, self.n_seq_dft):
            mem.seq_cp(0, s, -1, -1)
        decode_checked(self.ctx_tgt, self.batch_tgt.batch(), "target")
        self.n_past_tgt += 1
        for d in self.drafts:  # the first token was the target's own: not a draft
            if d.active:
                del d.tokens[0], d.dists[0]
    # --8<-- [end:eval_target]


def _widen(logits: np.ndarray, n_vocab: int) -> np.ndarray:
    """The draft's logits over the target's vocabulary (sizes may differ by <= 128):
    tokens the draft lacks get ``-inf``, tokens the target lacks are dropped."""
    logits = np.asarray(logits, np.float32)
    if logits.shape[0] == n_vocab:
        return logits
    out = np.full(n_vocab, -np.inf, np.float32)  # (n_vocab,)
    m = min(n_vocab, logits.shape[0])
    out[:m] = logits[:m]
    return out


def _check_contexts(ctx_tgt: Any, ctx_dft: Any, n_seq_dft: int, n_draft: int) -> None:
    if n_draft < 1 or n_seq_dft < 1:
        raise SpeculativeError(f"--draft-max = {n_draft} and -np = {n_seq_dft} must be >= 1")
    for name, ctx in (("target", ctx_tgt), ("draft", ctx_dft)):
        if ctx.recurrent:
            raise SpeculativeError(f"the {name} model is recurrent: a tree needs partial "
                                   "seq_rm; use speculative-simple, which rolls back a "
                                   "saved state")
        if ctx.n_seq_max < n_seq_dft or (n_seq_dft > 1 and not ctx.kv_unified):
            raise SpeculativeError(f"-np {n_seq_dft} needs the {name} context unified with "
                                   f"n_seq_max >= {n_seq_dft} (it has {ctx.n_seq_max}, "
                                   f"unified={ctx.kv_unified})")


# ---------------------------------------------------------------------------------------------
# examples/speculative-simple: draft-simple, greedy top-1 drafts, checkpoints
# ---------------------------------------------------------------------------------------------

# --8<-- [start:Checkpoint]
@dataclass
class Checkpoint:
    """``common_prompt_checkpoint``: where the target was, and saved sequence states.

    A recurrent memory refuses a partial ``seq_rm`` (its state cannot forget its last
    tokens); llama.cpp's ``speculative-simple`` saves the sequence's state before the
    target evaluates a draft (``LLAMA_STATE_SEQ_FLAGS_PARTIAL_ONLY``) and restores it when
    only part of the draft is accepted.

    Attributes:
        n_tokens: tokens in the target context (``prompt_tgt``) when saved.
        pos_max: the sequence's last position then.
        tgt, dft: ``state_seq_get_data`` blobs of the target and the draft, or None.
    """

    n_tokens: int = 0
    pos_max: int = -1
    tgt: bytes | None = None
    dft: bytes | None = None
# --8<-- [end:Checkpoint]


# --8<-- [start:SpeculativeSimple]
class SpeculativeSimple:
    r"""``llama-speculative-simple`` with the ``draft-simple`` drafter: greedy drafts.

    Each round (``speculative-simple.cpp:162-341``):

    1. if no draft is pending, the draft decodes the last token and drafts greedily
       ([`draft_tokens`][]): the top candidate of top-10 at temperature 1, while its
       probability is at least ``p_min`` and fewer than ``n_max`` tokens (and the
       remaining budget) are drafted; a draft shorter than ``n_min`` is dropped;
    2. the target decodes ``[id_last, draft...]`` in one batch, every row an output, and
       the draft mirrors that batch (``process``, only the last row an output);
    3. ``common_sampler_sample_and_accept_n``: the target samples at each row, keeps
       going while its token equals the draft's (never past an end-of-generation token
       before the last row), and adds one token of its own after a full match;
    4. accepted tokens are committed and both caches cut at ``n_past``
       (``seq_rm(0, n_past, -1)``).

    With a recurrent target or draft (``use_ckpt``), a partial acceptance cannot be cut:
    the saved states are restored (:266-289), and the accepted tokens become the next
    round's draft, which the target then accepts in full.

    Args:
        ctx_tgt: the target's Context (one sequence).
        ctx_dft: the draft's Context.
        params: the target's sampling parameters.
        n_max: most tokens per draft (``--draft-max``, default 3).
        n_min: drafts shorter than this are dropped (``--draft-min``, default 0).
        p_min: the least probability of a drafted token (``--draft-p-min``, default 0).
        is_eog: end-of-generation test.

    Raises:
        SpeculativeError: ``n_max < 1``, ``n_min < 0``, ``p_min`` outside ``[0, 1]``.

    Examples:
        >>> from reference.context import Context
        >>> from reference.testing import tiny_hparams, random_weights
        >>> hp = tiny_hparams(n_layer=2)
        >>> w = random_weights(hp, seed=1)
        >>> tgt = Context(hp, w, n_ctx=64)
        >>> dft = Context(draft_layers(hp, 1), w, n_ctx=64)
        >>> spec = SpeculativeSimple(tgt, dft, SamplerParams(temp=0.0), n_max=4)
        >>> len(list(spec.generate([1, 2, 3], n_predict=10)))
        10
    """

    def __init__(self, ctx_tgt: Any, ctx_dft: Any, params: SamplerParams, n_max: int = 3,
                 n_min: int = 0, p_min: float = 0.0, is_eog: Callable[[int], bool] = never_eog):
        if n_max < 1 or n_min < 0 or not 0.0 <= p_min <= 1.0:
            raise SpeculativeError(f"--draft-max = {n_max} must be >= 1, --draft-min = {n_min} "
                                   f">= 0 and --draft-p-min = {p_min} in [0, 1]")
        self.ctx_tgt, self.ctx_dft = ctx_tgt, ctx_dft
        self.n_max, self.n_min, self.p_min, self.is_eog = n_max, n_min, p_min, is_eog
        self.smpl = SamplerChain.from_params(params, ctx_tgt.n_vocab)
        self.smpl_dft = draft_simple_chain(ctx_tgt.n_vocab)
        self.use_ckpt = ctx_tgt.recurrent or ctx_dft.recurrent
        self.stats = SpecStats(n_draft=n_max)
        self.n_restored = 0  # rounds undone from a checkpoint
    # --8<-- [end:SpeculativeSimple]

    # --8<-- [start:simple_generate]
    def generate(self, prompt: list[int], n_predict: int = -1) -> Iterator[int]:
        """Yield each generated token; stop after ``n_predict`` (-1: no limit) or an
        end-of-generation token."""
        n_predict = check_prompt(self.ctx_tgt, prompt, n_predict, self.n_max)
        t0 = time.perf_counter()
        for token in prompt:
            self.smpl.accept(token)
        if len(prompt) > 1:  # the prompt but its last token, mirrored into the draft
            head = Batch(token=prompt[:-1], logits=[False] * (len(prompt) - 2) + [True])
            decode_checked(self.ctx_tgt, head, "target prompt")
            decode_checked(self.ctx_dft, head, "draft prompt")
        t1 = time.perf_counter()
        self.stats.n_input, self.stats.t_enc_s = len(prompt), t1 - t0
        self.id_last, self.prompt_tgt = prompt[-1], list(prompt[:-1])
        self.n_past, self.n_out = len(prompt) - 1, 0
        draft: list[int] = []
        try:
            while True:
                if not draft:
                    draft = self.new_draft(n_predict)
                ids = self.verify(draft)
                if ids is None:  # partial acceptance on a recurrent memory: replay
                    draft = self.replay
                    continue
                draft = []
                for token in ids:
                    self.prompt_tgt.append(self.id_last)
                    self.id_last = token
                    self.n_out += 1
                    yield token
                    if self.is_eog(token) or self.n_out == n_predict:
                        return
                self.ctx_tgt.memory.seq_rm(0, self.n_past, -1)
                self.ctx_dft.memory.seq_rm(0, self.n_past, -1)
        finally:
            self.stats.t_dec_s = time.perf_counter() - t1
    # --8<-- [end:simple_generate]

    # --8<-- [start:new_draft]
    def new_draft(self, n_predict: int) -> list[int]:
        """Step 1: a checkpoint, then a draft within the context and ``n_predict``."""
        mem = self.ctx_tgt.memory
        self.ckpt = Checkpoint(len(self.prompt_tgt), mem.seq_pos_max(0))
        if self.ctx_dft.recurrent:
            self.ckpt.dft = self.ctx_dft.state_seq_get_data(0)
        n_draft_max = self.ctx_tgt.n_ctx - self.n_past - 2
        if n_predict >= 0:
            n_draft_max = min(n_draft_max, n_predict - self.n_out - 1)
        draft = self.draft_tokens(max(n_draft_max, 0))
        if draft and self.ctx_tgt.recurrent:
            self.ckpt.tgt = self.ctx_tgt.state_seq_get_data(0)
        if self.ckpt.dft is not None:
            self.ctx_dft.state_seq_set_data(self.ckpt.dft, 0)
        self.ctx_dft.memory.seq_rm(0, self.ckpt.pos_max + 1, -1)
        return draft

    def draft_tokens(self, n_budget: int) -> list[int]:
        """``draft-simple``'s ``draft()`` (``common/speculative.cpp:308-413``).

        ``n_budget = 0`` means no budget (llama.cpp: ``dp.n_max > 0 && ...``); here a
        zero budget drafts nothing, so that the draft never runs past ``n_predict``.
        """
        if n_budget == 0:
            return []
        return draft_greedy(self.ctx_dft, self.smpl_dft, self.id_last, self.n_past,
                            min(self.n_max, n_budget), self.n_min, self.p_min,
                            self.ctx_tgt.n_vocab)
    # --8<-- [end:new_draft]

    # --8<-- [start:simple_verify]
    def verify(self, draft: list[int]) -> list[int] | None:
        """Steps 2-3: the accepted tokens (then the target's own), or None after a
        partial acceptance that a recurrent memory had to undo."""
        n = len(draft)
        tokens = [self.id_last, *draft]
        batch = Batch(token=tokens, pos=list(range(self.n_past, self.n_past + n + 1)),
                      logits=[True] * (n + 1))
        decode_checked(self.ctx_tgt, batch, "target")
        mirror = Batch(token=tokens, pos=batch.pos, logits=[False] * n + [True])
        decode_checked(self.ctx_dft, mirror, "draft")
        self.n_past += 1
        saved = copy.deepcopy(self.smpl) if self.use_ckpt else None
        ids = self.sample_and_accept_n(draft)
        if self.use_ckpt and len(ids) - 1 < n:
            self.restore(saved)
            self.replay = ids
            return None
        self.n_past += len(ids) - 1
        self.stats.n_drafted += n
        self.stats.n_accept += len(ids) - 1
        self.stats.n_predict += len(ids)
        return ids

    def sample_and_accept_n(self, draft: list[int]) -> list[int]:
        """``common_sampler_sample_and_accept_n`` (``common/sampling.cpp:678-710``)."""
        def sample(i: int) -> int:
            token = int(self.smpl.sample(self.ctx_tgt.get_logits_ith(i)))
            self.smpl.accept(token)
            return token
        return sample_and_accept_n(sample, draft, self.is_eog)

    def restore(self, saved: SamplerChain) -> None:
        """Undo a round (:266-289): saved states back, both caches cut, sampler back."""
        for ctx, blob in ((self.ctx_tgt, self.ckpt.tgt), (self.ctx_dft, self.ckpt.dft)):
            if blob is not None:
                ctx.state_seq_set_data(blob, 0)
            ctx.memory.seq_rm(0, self.ckpt.pos_max + 1, -1)
        del self.prompt_tgt[self.ckpt.n_tokens:]
        self.smpl = saved
        self.n_restored += 1
        self.n_past = len(self.prompt_tgt)
    # --8<-- [end:simple_verify]


__all__ = [
    "Branch",
    "Checkpoint",
    "DraftVocabError",
    "SpecStats",
    "Speculative",
    "SpeculativeError",
    "SpeculativeSimple",
    "chain_probs",
    "check_draft_vocab",
    "draw",
    "DraftSeq",
    "draft_greedy",
    "draft_simple",
    "draft_layers",
    "draft_simple_chain",
    "residual",
    "residual_llamacpp",
    "sample_and_accept_n",
    "verify_candidates",
]
