r"""The server's speculator: which drafter drafts for which slot, all slots in one call.

llama-server keeps one ``common_speculative`` for all its slots (``common/speculative.cpp``).
At each step every generating slot that may draft hands it a request (a [`DraftRequest`][],
``common_speculative_draft_params``: the slot's tokens, its last sampled token and the most
tokens it may draft), and one call drafts for all of them
(``common_speculative_draft``, ``speculative.cpp:2787-2870``, called from
``server-context.cpp:3021-3026``):

1. The drafters of ``--spec-type`` are asked in llama.cpp's order of preference
   (``speculative.cpp:2617-2627``), whatever order the flag lists them in:
   ``ngram-simple``, ``ngram-cache``, then ``draft-simple``.
2. Each drafter gets the requests that have no draft yet; a request that gets a non-empty
   draft is done, the others go to the next drafter.
3. A draft longer than its request's ``n_max`` is cut to it.

The drafters:

- **ngram-simple** ([`NgramSimple`][]): copy the tokens that followed the latest earlier
  occurrence of the slot's last ``size_n`` tokens
  ([`ngram_simple_draft`][reference.tools.lookup.ngram_simple_draft]); up to ``size_m``.
- **ngram-cache** ([`NgramCacheDrafter`][]): ``llama-lookup``'s three n-gram caches
  ([`ngram_cache_draft`][reference.tools.lookup.ngram_cache_draft]), 8 tokens at most: the
  slot's own context cache, and the static and dynamic caches read from ``-lcs``/``-lcd``
  (never written: llama-server does not save them either).
- **draft-simple** ([`DraftSimple`][]): a draft model's greedy proposals
  ([`draft_simple`][reference.tools.speculative.draft_simple]), every slot's rows in the
  same draft decodes, so a step costs $1 + \max_s |\text{draft}_s|$ draft decodes whatever
  the number of slots (plus, for a slot whose tokens the draft has not seen, one catch-up
  of them).

Whatever drafts, the target verifies with the same rule
([`sample_and_accept_n`][reference.tools.speculative.sample_and_accept_n]): a draft
changes how many target decodes an answer takes, never the answer.

**Where this differs from llama.cpp, on purpose.** ``ngram-cache``'s context cache, in
llama-server, is updated with the slot's *new* tokens alone
(``common_ngram_cache_update(cache, 1, 4, tokens_new, tokens_new.size())``,
``speculative.cpp:2098-2116``), so an n-gram is only counted when it lies wholly among
the tokens added since the last draft: with one new token a step (no draft accepted),
nothing after the prompt is ever learned. The cache also outlives the slot's request, so
the next request's drafts count the previous conversation's n-grams. Here the cache counts
every n-gram that ends in a new token, as ``llama-lookup`` does, and starts again when the
slot's tokens no longer extend those it has counted. Drafts only change speed, so answers
are the same either way.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from reference.batch import Batch
from reference.tools.lookup import (
    LLAMA_NGRAM_MAX,
    LLAMA_NGRAM_MIN,
    NgramCache,
    ngram_cache_draft,
    ngram_cache_update,
    ngram_simple_draft,
)
from reference.tools.speculative import (
    DraftSeq,
    SpeculativeError,
    draft_simple,
    draft_simple_chain,
)

#: every ``--spec-type`` name of the pinned llama.cpp (``speculative.cpp:34-44``)
SPEC_TYPES_LLAMA_CPP = ("none", "draft-simple", "draft-eagle3", "draft-mtp", "draft-dflash",
                        "draft-dspark", "ngram-simple", "ngram-map-k", "ngram-map-k4v",
                        "ngram-mod", "ngram-cache")
#: the drafters specified here, in llama.cpp's order of preference (``speculative.cpp:2617``)
SPEC_TYPES = ("ngram-simple", "ngram-cache", "draft-simple")
#: ``create_state_ngram_cache``'s fixed draft length (``speculative.cpp:2191``)
NGRAM_CACHE_N_DRAFT = 8


@dataclass(frozen=True)
class DraftRequest:
    """One slot's request (``common_speculative_draft_params``, ``server-context.cpp:
    3007-3014``): draft after ``id_last``, which will sit at position ``len(prompt)``, at most
    ``n_max`` tokens (``get_n_draft_max``).

    Attributes:
        seq_id: the slot's sequence.
        n_max: the most tokens the slot may draft (> 0).
        id_last: the slot's last sampled token (not yet in ``prompt``).
        prompt: the slot's tokens, positions 0 to ``len(prompt) - 1``.

    Examples:
        >>> r = DraftRequest(seq_id=0, n_max=4, id_last=3, prompt=[1, 2, 3, 4, 5, 1, 2])
        >>> NgramSimple(size_n=2, size_m=3).draft([r])  # (2, 3) was followed by 4 5 1
        {0: [4, 5, 1]}
    """

    seq_id: int
    n_max: int
    id_last: int
    prompt: list[int]


class NgramSimple:
    """``ngram-simple`` (``common_speculative_impl_ngram_simple``, ``speculative.cpp:
    1750-1794``): no state; drafts up to ``size_m`` tokens
    ([`ngram_simple_draft`][reference.tools.lookup.ngram_simple_draft] of each request).

    Examples:
        >>> NgramSimple(size_n=2, size_m=3).draft([DraftRequest(7, 4, 3, [1, 2, 3, 4, 5, 2])])
        {7: []}

        (six tokens are too few: ``ngram_simple_draft`` needs more than ``size_n + size_m + 1``)
    """

    name = "ngram-simple"

    def __init__(self, size_n: int = 12, size_m: int = 48):
        self.size_n, self.size_m = size_n, size_m
        self.n_max = size_m

    def draft(self, requests: list[DraftRequest]) -> dict[int, list[int]]:
        """Each request's draft, from its own tokens."""
        return {r.seq_id: ngram_simple_draft(r.prompt, r.id_last, self.size_n, self.size_m)
                for r in requests}

    def forget(self, seq_id: int) -> None:
        """Nothing is kept per slot."""


@dataclass
class _SeqNgrams:
    """What a slot's context cache has counted: the tokens it has seen, and the counts."""

    seen: list[int] = field(default_factory=list)
    cache: NgramCache = field(default_factory=dict)


class NgramCacheDrafter:
    """``ngram-cache`` (``common_speculative_impl_ngram_cache``, ``speculative.cpp:
    2024-2157``): each slot's context cache, the shared static and dynamic caches.

    Args:
        nc_static: ``-lcs``'s cache (not updated).
        nc_dynamic: ``-lcd``'s cache (not updated).

    Examples:
        >>> d = NgramCacheDrafter()  # no files: the slot's own n-grams only
        >>> d.draft([DraftRequest(seq_id=0, n_max=8, id_last=3, prompt=[1, 2, 3, 4, 5, 1, 2])])
        {0: [4, 5, 1, 2, 3, 4, 5, 1]}
        >>> len(d.seqs[0].seen)  # it has counted the prompt and id_last
        8
    """

    name = "ngram-cache"

    def __init__(self, nc_static: NgramCache | None = None,
                 nc_dynamic: NgramCache | None = None):
        self.nc_static = nc_static or {}
        self.nc_dynamic = nc_dynamic or {}
        self.n_max = NGRAM_CACHE_N_DRAFT
        self.seqs: dict[int, _SeqNgrams] = {}

    def draft(self, requests: list[DraftRequest]) -> dict[int, list[int]]:
        """Each request's draft: its context cache brought up to ``prompt + [id_last]``,
        then ``common_ngram_cache_draft`` from ``[id_last]``."""
        out = {}
        for r in requests:
            inp = [*r.prompt, r.id_last]
            ctx_cache = self._counted(r.seq_id, inp)
            draft = [r.id_last]
            ngram_cache_draft(inp, draft, NGRAM_CACHE_N_DRAFT, LLAMA_NGRAM_MIN,
                              LLAMA_NGRAM_MAX, ctx_cache, self.nc_dynamic, self.nc_static)
            out[r.seq_id] = draft[1:]
        return out

    def _counted(self, seq_id: int, inp: list[int]) -> NgramCache:
        """The slot's context cache, having counted every n-gram of ``inp``: the new tokens
        are added when ``inp`` extends what was seen, else the count starts again."""
        seq = self.seqs.setdefault(seq_id, _SeqNgrams())
        if inp[:len(seq.seen)] != seq.seen:
            seq.seen, seq.cache = [], {}
        ngram_cache_update(seq.cache, LLAMA_NGRAM_MIN, LLAMA_NGRAM_MAX, inp,
                           len(inp) - len(seq.seen))
        seq.seen = list(inp)
        return seq.cache

    def forget(self, seq_id: int) -> None:
        """The slot was cleared: its counts go."""
        self.seqs.pop(seq_id, None)


class DraftSimple:
    """``draft-simple`` (``common_speculative_impl_draft_simple``, ``speculative.cpp:
    179-452``) over a draft Context whose sequence ``s`` follows slot ``s``.

    ``config`` is read at each call (its ``draft_n_max``, ``draft_n_min``, ``draft_p_min``).
    The slot's tokens that the draft's sequence lacks (the drafted tokens the target
    accepted, a new prompt) are decoded with the first draft rows, in the same batch
    (llama-server instead mirrors every target batch into the draft,
    ``common_speculative_process``; the cache is the same). A slot whose missing tokens do
    not fit in that batch (a new prompt) is first caught up alone, ``n_batch`` tokens at a
    time. After drafting, the sequence holds the slot's tokens, ``id_last`` and the drafted
    tokens but the last, so that the next call finds the accepted ones there.

    Examples:
        >>> from reference.context import Context
        >>> from reference.testing import random_weights, tiny_hparams
        >>> from reference.tools.server.scheduler import SchedulerConfig
        >>> hp = tiny_hparams()
        >>> ctx_dft = Context(hp, random_weights(hp), n_ctx=64, n_seq_max=1)
        >>> d = DraftSimple(ctx_dft, hp.n_vocab, SchedulerConfig(draft_n_max=3, draft_p_min=0))
        >>> first = d.draft([DraftRequest(seq_id=0, n_max=3, id_last=5, prompt=[1, 2])])[0]
        >>> len(first), d.held[0] == [1, 2, 5, *first[:-1]]
        (3, True)
        >>> _ = d.draft([DraftRequest(0, 3, 7, [1, 2, 5, first[0]])])  # first[0] accepted
        >>> d.held[0][:5] == [1, 2, 5, first[0], 7]  # first[1:] dropped, 7 decoded after
        True
    """

    name = "draft-simple"

    def __init__(self, ctx_dft: Any, n_vocab: int, config: Any):
        self.ctx_dft, self.n_vocab, self.config = ctx_dft, n_vocab, config
        self.chains: dict[int, Any] = {}
        self.held: dict[int, list[int]] = {}  # seq_id -> the tokens its sequence holds
        self.shared: dict[int, int] = {}  # seq_id -> length of the slot's tokens last seen

    @property
    def n_max(self) -> int:
        return self.config.draft_n_max

    def draft(self, requests: list[DraftRequest]) -> dict[int, list[int]]:
        """Every request's draft, in shared draft decodes. A failed draft decode drops the
        requests' draft sequences and drafts nothing (the step goes on without drafts)."""
        cfg, mem = self.config, self.ctx_dft.memory
        if cfg.draft_n_max <= 0:
            return {}
        for r in requests:
            self.chains.setdefault(r.seq_id, draft_simple_chain(self.n_vocab))
        try:
            pending = self._pending(requests)
            seqs = [DraftSeq(r.seq_id, r.id_last, len(r.prompt), r.n_max, tuple(p))
                    for r, p in zip(requests, pending, strict=True)]
            out = draft_simple(self.ctx_dft, self.chains, seqs, cfg.draft_n_max,
                               cfg.draft_n_min, cfg.draft_p_min, self.n_vocab)
        except SpeculativeError:
            for r in requests:
                self.forget(r.seq_id)
            return {}
        for r in requests:
            kept = out[r.seq_id][:-1]
            if mem.seq_rm(r.seq_id, len(r.prompt) + 1 + len(kept), -1):
                self.held[r.seq_id] = [*r.prompt, r.id_last, *kept]
                self.shared[r.seq_id] = len(r.prompt) + 1
            else:
                self.forget(r.seq_id)
        return out

    def _pending(self, requests: list[DraftRequest]) -> list[list[int]]:
        """Each request's tokens that its draft sequence lacks, after dropping what the
        sequence holds beyond their common prefix; the longest are decoded here, alone,
        until the rest fit in one batch with a row for each ``id_last``."""
        pending = [self._cut(r.seq_id, r.prompt) for r in requests]
        room = self.ctx_dft.n_batch - len(requests)
        for i in sorted(range(len(requests)), key=lambda i: -len(pending[i])):
            if sum(map(len, pending)) <= room:
                break
            self._decode_alone(requests[i].seq_id, pending[i])
            pending[i] = []
        return pending

    def _cut(self, seq_id: int, want: list[int]) -> list[int]:
        """Drop what the draft's sequence holds past its common prefix with ``want``;
        return the rest of ``want``."""
        mem, held = self.ctx_dft.memory, self.held.get(seq_id, [])
        n = min(len(held), len(want))
        keep = min(self.shared.get(seq_id, 0), n)  # compared whole first (one C loop)
        if held[:keep] != want[:keep]:
            keep = 0
        while keep < n and held[keep] == want[keep]:
            keep += 1
        if not mem.seq_rm(seq_id, keep, -1):
            mem.seq_rm(seq_id, -1, -1)
            keep = 0
        self.held[seq_id] = list(want[:keep])
        return list(want[keep:])

    def _decode_alone(self, seq_id: int, tokens: list[int]) -> None:
        """Decode ``tokens`` after what the sequence holds, ``n_batch`` at a time."""
        step, start = self.ctx_dft.n_batch, len(self.held[seq_id])
        for i in range(0, len(tokens), step):
            chunk = tokens[i:i + step]
            p0 = start + i
            ret = self.ctx_dft.decode(Batch(token=chunk, pos=list(range(p0, p0 + len(chunk))),
                                            seq_id=[[seq_id]] * len(chunk),
                                            logits=[False] * len(chunk)))
            if ret != 0:
                raise SpeculativeError(f"the draft decode returned {ret}")
            self.held[seq_id].extend(chunk)

    def forget(self, seq_id: int) -> None:
        """The slot was cleared: its draft sequence is dropped too."""
        self.ctx_dft.memory.seq_rm(seq_id, -1, -1)
        self.held[seq_id] = []


class Speculator:
    """``common_speculative`` for the server: drafters in order of preference.

    Args:
        drafters: drafters with ``name``, ``n_max``, ``draft(requests)`` and
            ``forget(seq_id)``, in llama.cpp's order of preference (see [`make_speculator`][]).

    Attributes:
        n_drafts: drafter name -> drafts it made (``#gen drafts``).
        n_tokens: drafter name -> tokens it drafted (``#gen tokens``).

    Examples:
        >>> spec = Speculator([NgramSimple(size_n=2, size_m=3), NgramCacheDrafter()])
        >>> spec.draft([DraftRequest(0, 2, 3, [1, 2, 3, 4, 5, 1, 2]),  # cut to n_max = 2
        ...             DraftRequest(1, 4, 9, [9, 8, 9, 8])])  # ngram-simple finds none
        {0: [4, 5], 1: [8, 9, 8, 9]}
        >>> spec.n_drafts, spec.n_tokens
        ({'ngram-simple': 1, 'ngram-cache': 1}, {'ngram-simple': 2, 'ngram-cache': 4})
    """

    def __init__(self, drafters: list[Any]):
        self.drafters = drafters
        self.n_drafts = {d.name: 0 for d in drafters}
        self.n_tokens = {d.name: 0 for d in drafters}

    @property
    def types(self) -> list[str]:
        return [d.name for d in self.drafters]

    @property
    def n_max(self) -> int:
        """The longest draft any drafter makes (``common_speculative_n_max``)."""
        return max((d.n_max for d in self.drafters), default=0)

    # --8<-- [start:speculator_draft]
    def draft(self, requests: list[DraftRequest]) -> dict[int, list[int]]:
        """``common_speculative_draft``: each request's draft from the first drafter that
        makes a non-empty one, cut to the request's ``n_max``.

        Returns:
            ``seq_id`` -> draft, for the requests that got one.
        """
        out: dict[int, list[int]] = {}
        todo = [r for r in requests if r.n_max > 0]
        for d in self.drafters:
            if not todo:
                break
            got, rest = d.draft(todo), []
            for r in todo:
                draft = got.get(r.seq_id, [])[:r.n_max]
                if draft:
                    out[r.seq_id] = draft
                    self.n_drafts[d.name] += 1
                    self.n_tokens[d.name] += len(draft)
                else:
                    rest.append(r)
            todo = rest
        return out
    # --8<-- [end:speculator_draft]

    def forget(self, seq_id: int) -> None:
        """Slot ``seq_id`` was cleared: every drafter drops what it kept for it."""
        for d in self.drafters:
            d.forget(seq_id)


# --8<-- [start:check_spec_setup]
def check_spec_setup(types: list[str] | tuple[str, ...], has_draft: bool, size_n: int = 12,
                     size_m: int = 48) -> None:
    """A ``--spec-type`` list the server can run: names llama.cpp knows and this
    specification has, ``draft-simple`` exactly when there is a draft model, and
    ``ngram-simple``'s sizes in llama.cpp's ranges (``common/arg.cpp``: 1 to 1024).

    Args:
        types: drafter names as given (``none`` is allowed and means nothing).
        has_draft: whether a draft model is given (``-md`` or ``--draft-layers``).
        size_n: ``--spec-ngram-simple-size-n``.
        size_m: ``--spec-ngram-simple-size-m``.

    Raises:
        SpeculativeError: the first rule that fails, named.

    Examples:
        >>> check_spec_setup(["ngram-simple", "none"], has_draft=False)
        >>> check_spec_setup(["ngram-mod"], has_draft=False)  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        reference.tools.speculative.SpeculativeError: --spec-type ngram-mod: not available ...
    """
    for t in types:
        if t not in SPEC_TYPES_LLAMA_CPP:
            raise SpeculativeError(f"--spec-type {t!r}: unknown; llama-server's types are "
                                   f"{', '.join(SPEC_TYPES_LLAMA_CPP)}")
        if t != "none" and t not in SPEC_TYPES:
            raise SpeculativeError(f"--spec-type {t}: not available here; use "
                                   f"{', '.join(SPEC_TYPES)}")
    if "draft-simple" in types and not has_draft:
        raise SpeculativeError("--spec-type draft-simple needs a draft: -md FILE or "
                               "--draft-layers K")
    if has_draft and "draft-simple" not in types:
        raise SpeculativeError(f"a draft model is given but --spec-type {','.join(types)} "
                               "does not use it: add draft-simple")
    for flag, value in (("--spec-ngram-simple-size-n", size_n),
                        ("--spec-ngram-simple-size-m", size_m)):
        if not 1 <= value <= 1024:
            raise SpeculativeError(f"{flag} = {value} must be between 1 and 1024")
# --8<-- [end:check_spec_setup]


def make_speculator(types: list[str] | tuple[str, ...], config: Any, n_vocab: int,
                    ctx_dft: Any = None,
                    ngram_caches: Mapping[str, NgramCache] | None = None) -> Speculator | None:
    """The speculator of ``--spec-type`` (None when it names no drafter).

    Args:
        types: drafter names (``none`` is ignored); their order does not matter.
        config: the scheduler's config (``draft_*``, ``spec_ngram_size_n/m``).
        n_vocab: the target's vocabulary size.
        ctx_dft: the draft Context, for ``draft-simple``.
        ngram_caches: ``{"static": ..., "dynamic": ...}`` for ``ngram-cache``.

    Raises:
        SpeculativeError: a setup [`check_spec_setup`][] refuses.

    Examples:
        >>> from reference.tools.server.scheduler import SchedulerConfig
        >>> make_speculator(["ngram-cache", "ngram-simple"], SchedulerConfig(), 32).types
        ['ngram-simple', 'ngram-cache']
        >>> make_speculator(["none"], SchedulerConfig(), 32) is None
        True
    """
    check_spec_setup(types, ctx_dft is not None, config.spec_ngram_size_n,
                     config.spec_ngram_size_m)
    caches = ngram_caches or {}
    drafters: list[Any] = []
    for t in SPEC_TYPES:
        if t not in types:
            continue
        if t == "ngram-simple":
            drafters.append(NgramSimple(config.spec_ngram_size_n, config.spec_ngram_size_m))
        elif t == "ngram-cache":
            drafters.append(NgramCacheDrafter(caches.get("static"), caches.get("dynamic")))
        else:
            drafters.append(DraftSimple(ctx_dft, n_vocab, config))
    return Speculator(drafters) if drafters else None


__all__ = [
    "NGRAM_CACHE_N_DRAFT",
    "SPEC_TYPES",
    "SPEC_TYPES_LLAMA_CPP",
    "DraftRequest",
    "DraftSimple",
    "NgramCacheDrafter",
    "NgramSimple",
    "Speculator",
    "check_spec_setup",
    "make_speculator",
]
