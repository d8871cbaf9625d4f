r"""Prompt-lookup decoding: drafts from n-gram statistics (``examples/lookup``).

Text that repeats material (code being edited, a passage being summarised or quoted)
predicts itself: after the tokens "*... def foo(*" the next tokens are likely those that
followed the same tokens before. ``llama-lookup`` drafts them from counts, with no draft
model at all, and the target verifies the draft in one batch as in
[`reference.tools.speculative`][reference.tools.speculative] (greedy matching: the output is plain
generation's, token for token).

**The n-gram cache** (``common/ngram-cache.{h,cpp}``). A key is an n-gram of
$n \in [1, 4]$ tokens, padded to 4 slots with ``LLAMA_TOKEN_NULL``; its value counts the
tokens seen right after it:

$$ C[t_{i-n} \dots t_{i-1}][t_i] \mathrel{+}= 1 \quad \text{for every } i
   \text{ and } n = 1 \dots 4. $$

Three caches are consulted, in order, for the token that follows the current sequence
(the input plus what is drafted so far), ``common_ngram_cache_draft``:

1. the **context** cache (this generation's prompt and output) with *lax* thresholds;
2. the **dynamic** cache (earlier generations, ``-lcd``) with *strict* thresholds;
3. the **static** cache (a large corpus, ``-lcs``) alone, on the last 2 tokens.

For 1 and 2 the longest n-gram is tried first ($n = 4, 3, 2, 1$). Among its followers the
token maximizing $C(t) \cdot s(t)$ is the candidate, where $s(t) = 100\, C_{static}(t)$
when the static cache knows $t$ after the last 2 tokens, else 1; it is drafted when the
n-gram has been seen often enough and the candidate is frequent enough,

$$ \sum_t C(t) \ge \text{min\_sample\_size}[n-1], \qquad
   100\, C(t^*) \ge \text{min\_percent}[n-1] \sum_t C(t), $$

with lax thresholds $(2, 2, 1, 1)$ and $(66, 50, 50, 50)\%$, strict $(4, 3, 2, 2)$ and
$(75, 66, 66, 66)\%$ (``ngram-cache.cpp:60-63``). Drafting stops at the first position
where no cache proposes a token, or after ``n_draft`` tokens.

**The file format** (``ngram-cache.cpp:200-258``): records, each the 4 int32 tokens of the
key, an int32 count of followers, then that many (int32 token, int32 count) pairs; no
header. Loading a dynamic cache, merging this run's context cache into it (counts add) and
saving it back lets later runs draft from earlier ones.
"""

from __future__ import annotations

import struct
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from reference.batch import Batch
from reference.common import LlamarefError
from reference.sampling import SamplerChain, SamplerParams
from reference.tools.speculative import (
    SpecStats,
    SpeculativeError,
    check_prompt,
    decode_checked,
    never_eog,
)

LLAMA_NGRAM_MIN = 1  # common/ngram-cache.h:9-11
LLAMA_NGRAM_MAX = 4
LLAMA_NGRAM_STATIC = 2
LLAMA_TOKEN_NULL = -1

# ngram-cache.cpp:60-63: index n - 1
DRAFT_MIN_SAMPLE_SIZE_LAX = (2, 2, 1, 1)
DRAFT_MIN_PERCENT_LAX = (66, 50, 50, 50)
DRAFT_MIN_SAMPLE_SIZE_STRICT = (4, 3, 2, 2)
DRAFT_MIN_PERCENT_STRICT = (75, 66, 66, 66)

#: an n-gram (4 token slots) -> follower token -> count
NgramCache = dict[tuple[int, ...], dict[int, int]]


class NgramCacheError(LlamarefError, ValueError):
    """An n-gram cache file that cannot be read (llama.cpp asserts)."""


# --8<-- [start:ngram]
def ngram(tokens) -> tuple[int, ...]:
    """``common_ngram``: up to 4 tokens, padded with ``LLAMA_TOKEN_NULL``.

    Examples:
        >>> ngram([5, 6])
        (5, 6, -1, -1)
    """
    tokens = [int(t) for t in tokens]
    return tuple(tokens + [LLAMA_TOKEN_NULL] * (LLAMA_NGRAM_MAX - len(tokens)))
# --8<-- [end:ngram]


# --8<-- [start:ngram_cache_update]
def ngram_cache_update(cache: NgramCache, ngram_min: int, ngram_max: int, inp: list[int],
                       nnew: int) -> None:
    r"""Count the followers of the last ``nnew`` tokens of ``inp`` (``ngram-cache.cpp:12-52``).

    For each size $n$ and each $i \in [\max(|inp| - nnew, n), |inp|)$:
    ``cache[inp[i-n:i]][inp[i]] += 1``.

    Examples:
        >>> c = {}
        >>> ngram_cache_update(c, 1, 2, [1, 2, 1, 2], nnew=4)
        >>> c[ngram([1])], c[ngram([1, 2])], c[ngram([2, 1])]
        ({2: 2}, {1: 1}, {2: 1})
    """
    n_inp = len(inp)
    for n in range(ngram_min, ngram_max + 1):
        for i in range(max(n_inp - nnew, n), n_inp):
            part = cache.setdefault(ngram(inp[i - n:i]), {})
            part[inp[i]] = part.get(inp[i], 0) + 1
# --8<-- [end:ngram_cache_update]


# --8<-- [start:try_draft]
def try_draft_static(nc_static: NgramCache, ngram_static: tuple[int, ...]) -> int:
    """The static cache alone (``ngram-cache.cpp:66-95``): the most frequent follower of
    the last 2 tokens, if seen at least 2 times and at least 50% of the time.

    Examples:
        >>> try_draft_static({ngram([1, 2]): {7: 3, 8: 1}}, ngram([1, 2]))
        7
    """
    part = nc_static.get(ngram_static)
    if part is None:
        return LLAMA_TOKEN_NULL
    max_token, max_count = LLAMA_TOKEN_NULL, 0
    for token, count in part.items():
        if count > max_count:  # ties: the first in the map's order
            max_token, max_count = token, count
    total = sum(part.values())
    k = LLAMA_NGRAM_STATIC - 1
    if total < DRAFT_MIN_SAMPLE_SIZE_LAX[k] or 100 * max_count < DRAFT_MIN_PERCENT_LAX[k] * total:
        return LLAMA_TOKEN_NULL
    return max_token


def try_draft(nc_primary: NgramCache, ngrams_primary: list[tuple[int, ...]],
              part_static: dict[int, int], min_sample_size, min_percent) -> int:
    """A primary cache (context or dynamic), validated by the static counts
    (``ngram-cache.cpp:98-144``): the longest n-gram whose best follower passes.

    ``ngrams_primary[n - 1]`` is the last $n$ tokens. The best follower maximizes
    ``count * (100 * static_count or 1)``.

    Examples:
        >>> cache = {ngram([4]): {5: 1, 6: 1}, ngram([3, 4]): {6: 2}}
        >>> try_draft(cache, [ngram([4]), ngram([3, 4])], {}, (2, 2, 1, 1), (66, 50, 50, 50))
        6
    """
    for i in range(len(ngrams_primary) - 1, -1, -1):
        part = nc_primary.get(ngrams_primary[i])
        if part is None:
            continue
        max_token, max_count, max_static, total = LLAMA_TOKEN_NULL, 0, 0, 0
        for token, count in part.items():
            static = 100 * part_static[token] if token in part_static else 1
            if count * static > max_count * max_static:
                max_token, max_count, max_static = token, count, static
            total += count
        if total < min_sample_size[i] or 100 * max_count < min_percent[i] * total:
            continue
        return max_token
    return LLAMA_TOKEN_NULL
# --8<-- [end:try_draft]


# --8<-- [start:ngram_cache_draft]
def ngram_cache_draft(inp: list[int], draft: list[int], n_draft: int, ngram_min: int,
                      ngram_max: int, nc_context: NgramCache, nc_dynamic: NgramCache,
                      nc_static: NgramCache) -> None:
    """Extend ``draft`` (``[last sampled token]``) by up to ``n_draft`` tokens
    (``common_ngram_cache_draft``, ``ngram-cache.cpp:146-198``).

    The sequence looked up is ``inp + draft[1:]``; context cache (lax), dynamic cache
    (strict), then static cache, until none proposes a token.

    Examples:
        >>> inp = [1, 2, 3, 1, 2, 3, 1, 2]
        >>> ctx = {}
        >>> ngram_cache_update(ctx, 1, 4, inp, len(inp))
        >>> draft = [inp[-1]]
        >>> ngram_cache_draft(inp, draft, 3, 1, 4, ctx, {}, {})
        >>> draft
        [2, 3, 1, 2]
    """
    if len(draft) != 1:
        raise SpeculativeError(f"the draft starts as [last token], got {len(draft)} tokens")
    if len(inp) < LLAMA_NGRAM_STATIC:
        return
    while len(draft) - 1 < n_draft:
        seq = inp + draft[1:]
        part_static = nc_static.get(ngram(seq[-LLAMA_NGRAM_STATIC:]), {})
        ngrams_cd = [ngram(seq[len(seq) - n:]) for n in range(ngram_min, ngram_max + 1)]
        token = try_draft(nc_context, ngrams_cd, part_static, DRAFT_MIN_SAMPLE_SIZE_LAX,
                          DRAFT_MIN_PERCENT_LAX)
        if token == LLAMA_TOKEN_NULL:
            token = try_draft(nc_dynamic, ngrams_cd, part_static,
                              DRAFT_MIN_SAMPLE_SIZE_STRICT, DRAFT_MIN_PERCENT_STRICT)
        if token == LLAMA_TOKEN_NULL:
            token = try_draft_static(nc_static, ngram(seq[-LLAMA_NGRAM_STATIC:]))
        if token == LLAMA_TOKEN_NULL:
            return
        draft.append(token)
# --8<-- [end:ngram_cache_draft]


# --8<-- [start:ngram_simple_draft]
def ngram_simple_draft(tokens: list[int], sampled: int, size_n: int, size_m: int) -> list[int]:
    """``ngram-simple``'s draft (``common_ngram_simple_draft``, ``ngram-map.cpp:49-110``):
    copy what followed the last time the current n-gram appeared.

    The pattern is the last ``size_n - 1`` tokens of ``tokens`` and ``sampled``. The latest
    earlier occurrence is searched backwards from ``start = len(tokens) - size_n - 1`` down to
    1 (an occurrence at 0 is never found: llama.cpp uses 0 for "no match"); the draft is the
    ``min(size_m, len(tokens) - (j + size_n))`` tokens after the occurrence at ``j``, and
    nothing when that is fewer than ``size_n`` or when ``tokens`` has at most
    ``size_n + size_m + 1`` tokens.

    Examples:
        >>> ngram_simple_draft([9, 1, 2, 3, 4, 5, 6, 7, 8, 1, 2], 3, size_n=3, size_m=4)
        [4, 5, 6, 7]
        >>> ngram_simple_draft([1, 2, 3, 4, 5, 6, 7, 8, 1, 2], 3, size_n=3, size_m=4)  # at 0
        []
    """
    cur_len = len(tokens)
    if cur_len <= size_n + size_m + 1:
        return []
    pattern = [*tokens[cur_len - size_n + 1:], sampled]
    for j in range(cur_len - size_n - 1, 0, -1):
        if tokens[j:j + size_n] == pattern:
            n_copy = min(size_m, cur_len - (j + size_n))
            return tokens[j + size_n:j + size_n + n_copy] if n_copy >= size_n else []
    return []
# --8<-- [end:ngram_simple_draft]


# --8<-- [start:ngram_cache_io]
def ngram_cache_save(cache: NgramCache, path: str | Path) -> None:
    """``common_ngram_cache_save``: the records, int32 little-endian, no header.

    Examples:
        >>> import tempfile, os
        >>> path = os.path.join(tempfile.mkdtemp(), "c.bin")
        >>> ngram_cache_save({ngram([1, 2]): {3: 4}}, path)
        >>> os.path.getsize(path), ngram_cache_load(path)
        (28, {(1, 2, -1, -1): {3: 4}})
    """
    out = bytearray()
    for key, part in cache.items():
        out += struct.pack(f"<{LLAMA_NGRAM_MAX}ii", *key, len(part))
        for token, count in part.items():
            out += struct.pack("<ii", token, count)
    Path(path).write_bytes(bytes(out))


def ngram_cache_load(path: str | Path) -> NgramCache:
    """``common_ngram_cache_load``.

    Raises:
        OSError: the file cannot be opened (llama.cpp: ``Unable to open file``).
        NgramCacheError: a truncated record or a count <= 0 (llama.cpp asserts).
    """
    data = Path(path).read_bytes()
    cache: NgramCache = {}
    head = struct.calcsize(f"<{LLAMA_NGRAM_MAX}ii")
    off = 0
    while off < len(data):
        if off + head > len(data):
            raise NgramCacheError(f"{path}: truncated record at byte {off}: not an n-gram "
                                  "cache file of llama-lookup")
        *key, n = struct.unpack_from(f"<{LLAMA_NGRAM_MAX}ii", data, off)
        off += head
        if n <= 0 or off + 8 * n > len(data):
            raise NgramCacheError(f"{path}: bad follower count {n} at byte {off - 4}: not an "
                                  "n-gram cache file of llama-lookup")
        pairs = struct.unpack_from(f"<{2 * n}i", data, off)
        off += 8 * n
        part = dict(zip(pairs[0::2], pairs[1::2], strict=True))
        if min(part.values()) <= 0:
            raise NgramCacheError(f"{path}: a count <= 0 near byte {off}: corrupted cache")
        cache[tuple(key)] = part
    return cache


def ngram_cache_merge(target: NgramCache, add: NgramCache) -> None:
    """``common_ngram_cache_merge``: add ``add``'s counts into ``target``.

    Examples:
        >>> a = {ngram([1]): {2: 1}}
        >>> ngram_cache_merge(a, {ngram([1]): {2: 2, 3: 1}})
        >>> a
        {(1, -1, -1, -1): {2: 3, 3: 1}}
    """
    for key, part in add.items():
        merged = target.setdefault(key, {})
        for token, count in part.items():
            merged[token] = merged.get(token, 0) + count
# --8<-- [end:ngram_cache_io]


# --8<-- [start:LookupStats]
@dataclass
class LookupStats(SpecStats):
    """``llama-lookup``'s counters (``lookup.cpp:231-242``): drafting times too."""

    t_draft_flat_ms: float = 0.0
    t_draft_ms: float = 0.0

    def lines(self) -> list[str]:
        us = 1e3 * self.t_draft_ms / self.n_drafted if self.n_drafted else float("nan")
        tps = self.n_drafted / (1e-3 * self.t_draft_ms) if self.t_draft_ms else float("nan")
        return super().lines()[:3] + [
            f"n_draft      = {self.n_draft}",
            f"n_predict    = {self.n_predict}",
            f"n_drafted    = {self.n_drafted}",
            f"t_draft_flat = {self.t_draft_flat_ms:.2f} ms",
            f"t_draft      = {self.t_draft_ms:.2f} ms, {us:.2f} us per token, "
            f"{tps:.2f} tokens per second",
            f"n_accept     = {self.n_accept}",
            f"accept       = {self.accept:.3f}%",
        ]
# --8<-- [end:LookupStats]



# --8<-- [start:Lookup]
class Lookup:
    """``llama-lookup``: drafts from the n-gram caches, verified by greedy matching.

    Each round (``lookup.cpp:127-221``): sample the target at the rows of the last batch
    while the token equals the draft (each token joins ``inp`` and the context cache);
    cut the cache at ``n_past``; draft from the caches ([`ngram_cache_draft`][]); decode
    ``[last token, draft...]`` in one batch.

    A recurrent memory cannot cut a partial draft: the sequence's state is saved before
    each batch and, after a partial acceptance, restored and the accepted tokens decoded
    again (as ``speculative-simple``'s ``PARTIAL_ONLY`` checkpoint).

    Args:
        ctx: the model's Context (either twin).
        params: sampling parameters.
        n_draft: most drafted tokens per round (``--draft-max``, default 3).
        nc_static: the ``-lcs`` cache (empty if not given).
        nc_dynamic: the ``-lcd`` cache (empty if not given).
        is_eog: end-of-generation test.

    Attributes:
        nc_context: this run's cache (the prompt and every generated token).

    Examples:
        >>> from reference.context import Context
        >>> from reference.testing import tiny_hparams, random_weights
        >>> hp = tiny_hparams()
        >>> look = Lookup(Context(hp, random_weights(hp, seed=7), n_ctx=64),
        ...               SamplerParams(temp=0.0), n_draft=4)
        >>> len(list(look.generate([1, 2, 3, 1, 2, 3], n_predict=20)))
        20
    """

    def __init__(self, ctx: Any, params: SamplerParams, n_draft: int = 3,
                 nc_static: NgramCache | None = None, nc_dynamic: NgramCache | None = None,
                 is_eog: Callable[[int], bool] = never_eog):
        if n_draft < 0:
            raise SpeculativeError(f"--draft-max = {n_draft} must be >= 0")
        self.ctx, self.n_draft, self.is_eog = ctx, n_draft, is_eog
        self.smpl = SamplerChain.from_params(params, ctx.n_vocab)
        self.nc_context: NgramCache = {}
        self.nc_static = nc_static if nc_static is not None else {}
        self.nc_dynamic = nc_dynamic if nc_dynamic is not None else {}
        self.stats = LookupStats(n_draft=n_draft)
        self.ckpt: tuple[int, bytes] | None = None  # (n_past, state) before the last batch
        self.n_restored = 0
    # --8<-- [end:Lookup]

    # --8<-- [start:lookup_generate]
    def generate(self, prompt: list[int], n_predict: int = -1) -> Iterator[int]:
        """Yield each generated token; stop after ``n_predict`` (-1: no limit) or an
        end-of-generation token."""
        n_predict = check_prompt(self.ctx, prompt, n_predict, self.n_draft)
        t0 = time.perf_counter()
        inp = [int(t) for t in prompt]
        ngram_cache_update(self.nc_context, LLAMA_NGRAM_MIN, LLAMA_NGRAM_MAX, inp, len(inp))
        self.stats.t_draft_flat_ms += 1e3 * (time.perf_counter() - t0)
        t0 = time.perf_counter()
        for token in inp:
            self.smpl.accept(token)
        if len(inp) > 1:
            decode_checked(self.ctx, Batch(token=inp[:-1]), "prompt")
        decode_checked(self.ctx, Batch(token=inp[-1:]), "prompt")
        t1 = time.perf_counter()
        self.stats.n_input, self.stats.t_enc_s = len(inp), t1 - t0
        n_past, draft = len(inp), []
        try:
            while True:
                i_dft = 0
                while True:
                    token = self.smpl.sample(self.ctx.get_logits_ith(i_dft))
                    self.smpl.accept(token)
                    self.stats.n_predict += 1
                    yield token
                    inp.append(token)
                    self._update(inp)
                    if self.is_eog(token) or self.stats.n_predict == n_predict:
                        return
                    if i_dft < len(draft) and token == draft[i_dft]:
                        self.stats.n_accept += 1
                        n_past += 1
                        i_dft += 1
                        continue
                    draft = [token]
                    break
                self.cut(inp, n_past)
                draft = self.draft(inp, draft)
                self.verify_batch(draft, n_past)
                n_past += 1
                draft = draft[1:]
        finally:
            self.stats.t_dec_s = time.perf_counter() - t1
    # --8<-- [end:lookup_generate]

    def _update(self, inp: list[int]) -> None:
        t0 = time.perf_counter()
        ngram_cache_update(self.nc_context, LLAMA_NGRAM_MIN, LLAMA_NGRAM_MAX, inp, 1)
        self.stats.t_draft_ms += 1e3 * (time.perf_counter() - t0)

    # --8<-- [start:lookup_round]
    def draft(self, inp: list[int], draft: list[int]) -> list[int]:
        """[`ngram_cache_draft`][] from the three caches, timed."""
        t0 = time.perf_counter()
        ngram_cache_draft(inp, draft, self.n_draft, LLAMA_NGRAM_MIN, LLAMA_NGRAM_MAX,
                          self.nc_context, self.nc_dynamic, self.nc_static)
        self.stats.t_draft_ms += 1e3 * (time.perf_counter() - t0)
        self.stats.n_drafted += len(draft) - 1
        return draft

    def verify_batch(self, draft: list[int], n_past: int) -> None:
        """``[draft[0] @ n_past, draft[i] @ n_past + i ...]``, every row an output."""
        if self.ctx.recurrent:
            self.ckpt = (n_past, self.ctx.state_seq_get_data(0))
        n = len(draft)
        decode_checked(self.ctx, Batch(token=draft, pos=list(range(n_past, n_past + n)),
                                logits=[True] * n), "target")

    def cut(self, inp: list[int], n_past: int) -> None:
        """Drop the rejected drafts: ``seq_rm(0, n_past, -1)``, or, where a recurrent
        memory refuses, the saved state and the accepted tokens decoded again."""
        if self.ctx.memory.seq_rm(0, n_past, -1):
            return
        n_saved, blob = self.ckpt
        self.ctx.state_seq_set_data(blob, 0)
        replay = Batch(token=inp[n_saved:n_past], pos=list(range(n_saved, n_past)))
        decode_checked(self.ctx, replay, "target (replay)")
        self.n_restored += 1
    # --8<-- [end:lookup_round]


__all__ = [
    "LLAMA_NGRAM_MAX",
    "LLAMA_NGRAM_MIN",
    "LLAMA_NGRAM_STATIC",
    "Lookup",
    "LookupStats",
    "NgramCache",
    "NgramCacheError",
    "ngram",
    "ngram_cache_draft",
    "ngram_cache_load",
    "ngram_cache_merge",
    "ngram_cache_save",
    "ngram_cache_update",
    "ngram_simple_draft",
    "try_draft",
    "try_draft_static",
]
