r"""The RAM prompt cache (``--cache-ram``): slot states parked in memory and brought back.

llama.cpp's ``server_prompt_cache`` (``tools/server/server-task.cpp:1691-1900``,
``server-task.h:588-640``) keeps a list of entries, oldest first. An entry is a prompt (its
tokens and its context checkpoints) and the bytes of the sequence state that holds it
(``llama_state_seq_get_data_ext(ctx, seq_id, 0)``). Its size is the state's bytes plus the
checkpoints' sizes.

When a task picks a slot it is about to reuse for another prompt, the server parks the
slot's prompt and looks for a better one (``get_available_slot``,
``server-context.cpp:1616-1636``)::

    slot.prompt_save(cache)                      # PromptCache.save
    if not slot.prompt_load(cache, task.tokens): # PromptCache.load
        slot.prompt_clear()                      # seq_rm(id, -1, -1), tokens = []
    cache.update()                               # PromptCache.update

**Save** (``prompt_save`` / ``alloc``, ``server-context.cpp:258-282``,
``server-task.cpp:1711-1791``): an empty slot is not saved; neither is a prompt some entry
already contains (the prompt is a prefix of the entry's tokens), nor a state larger than the
whole byte limit. Entries the new prompt contains (their tokens are a prefix of it) are
dropped, then the oldest entries are evicted until the new one fits the byte limit.

**Load** (``server-task.cpp:1793-1868``): with $\mathrm{lcp}$ the common prefix of an
entry's tokens and the new prompt, an entry is a candidate when
$f_\mathrm{keep} = \mathrm{lcp} / |\mathrm{entry}| \ge 0.25$ (a large prompt is not thrown
away for a small overlap); the chosen one beats the best so far, starting from the slot's own
tokens, in both $f_\mathrm{keep}$ and $f_\mathrm{sim} = \mathrm{lcp} / |\mathrm{new}|$ (strictly;
an empty slot has $f_\mathrm{keep} = -1$). Ratios are float32 divisions, as in C++. The
chosen state is restored into the slot's sequence (``llama_state_seq_set_data_ext``) and the
entry leaves the cache: its prompt is now the slot's. A refused restore leaves the entry in
the cache; the server clears the slot (``prompt_clear``), which [`PromptCache.load`][] does.

**Update** (``server-task.cpp:1870-1900``): evict the oldest entries over the byte limit,
then over the token limit, which grows to what the byte limit holds at the current average
bytes per token. The server builds the cache with ``--cache-ram`` MiB (-1: no limit; 0: no
cache at all, ``server-context.cpp:1333``) and ``n_ctx`` tokens (``:1340``).

Not modelled: the draft model's state (``data.drft``), and the allocation failure that
shrinks the limit to 40% of the current size.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from reference.common import LlamarefError
from reference.memory import LLAMA_STATE_SEQ_FLAGS_NONE
from reference.tools.server.errors import InvalidRequest
from reference.tools.server.text import common_prefix

MIB = 1024 * 1024

#: an entry that keeps less than this fraction of its tokens is not loaded
F_KEEP_MIN = np.float32(0.25)


def checkpoint_size(checkpoint: Any) -> int:
    """The bytes of a context checkpoint (``common_prompt_checkpoint::size()``).

    Args:
        checkpoint: any object with ``size``: an int attribute or a method returning one.

    Returns:
        Its size in bytes.

    Examples:
        >>> from types import SimpleNamespace
        >>> checkpoint_size(SimpleNamespace(size=100))
        100
        >>> checkpoint_size(SimpleNamespace(size=lambda: 7))  # a method, as in C++
        7
    """
    size = checkpoint.size
    return int(size() if callable(size) else size)


def ratio(num: int, den: int) -> np.float32:
    """``float(num) / den`` in float32, as the C++ computes ``f_keep`` and ``f_sim``.

    Examples:
        >>> 99999 / 100000 < 100000 / 100001, bool(ratio(99999, 100000) < ratio(100000, 100001))
        (True, False)
    """
    return np.float32(num) / np.float32(den)


# --8<-- [start:CacheEntry]
@dataclass
class CacheEntry:
    """``server_prompt_cache_state``: a prompt and the sequence state holding it.

    Attributes:
        tokens: the prompt's tokens (everything the slot had cached, generated ones too).
        data: ``state_seq_get_data_ext(seq_id, 0)`` of the slot's sequence.
        checkpoints: the slot's context checkpoints, passed through untouched.

    Examples:
        >>> from types import SimpleNamespace
        >>> CacheEntry([1, 2], b"abcd", [SimpleNamespace(size=10)]).size()
        14
    """

    tokens: list[int]
    data: bytes
    checkpoints: list = field(default_factory=list)

    def size(self) -> int:
        """Bytes held: the state plus the checkpoints."""
        return len(self.data) + sum(checkpoint_size(c) for c in self.checkpoints)
# --8<-- [end:CacheEntry]


# --8<-- [start:PromptCache]
class PromptCache:
    """``server_prompt_cache``: entries oldest first, limited in bytes and in tokens.

    Args:
        limit_mib: ``--cache-ram``: the byte limit in MiB (a fraction allowed); negative: no
            limit; 0: the cache is off (nothing is saved or loaded).
        limit_tokens: the token limit (0: none); the server passes ``n_ctx``.

    Raises:
        InvalidRequest: a negative ``limit_tokens``.

    Examples:
        >>> from reference.batch import Batch
        >>> from reference.context import Context
        >>> from reference.testing import random_weights, tiny_hparams
        >>> hp = tiny_hparams()
        >>> ctx = Context(hp, random_weights(hp), n_ctx=64, n_seq_max=2)
        >>> ctx.decode(Batch(token=[1, 2, 3, 4], pos=[0, 1, 2, 3], seq_id=[[0]] * 4))
        0
        >>> cache = PromptCache(limit_mib=-1, limit_tokens=64)
        >>> cache.save(ctx, 0, [1, 2, 3, 4]), cache.n_tokens()
        (True, 4)
        >>> entry = cache.load(ctx, 1, own_tokens=[], new_tokens=[1, 2, 3, 9])
        >>> entry.tokens, ctx.memory.seq_pos_max(1), len(cache)
        ([1, 2, 3, 4], 3, 0)
    """

    def __init__(self, limit_mib: float, limit_tokens: int):
        if limit_tokens < 0:
            raise InvalidRequest(f"prompt cache token limit must be >= 0 (0: none), "
                                 f"got {limit_tokens}")
        self.enabled = limit_mib != 0
        self.limit_size = int(MIB * limit_mib) if limit_mib > 0 else 0  # bytes, 0: none
        self.limit_tokens = limit_tokens
        self.entries: list[CacheEntry] = []  # oldest first

    def __len__(self) -> int:
        return len(self.entries)

    def size(self) -> int:
        """Bytes held by all entries (``server_prompt_cache::size``)."""
        return sum(e.size() for e in self.entries)

    def n_tokens(self) -> int:
        """Tokens of all entries (``server_prompt_cache::n_tokens``)."""
        return sum(len(e.tokens) for e in self.entries)

    def clear(self) -> None:
        """Drop every entry."""
        self.entries.clear()
    # --8<-- [end:PromptCache]

    # --8<-- [start:save]
    def save(self, ctx: Any, seq_id: int, tokens: Sequence[int],
             checkpoints: Sequence = ()) -> bool:
        """Park a slot's prompt and its sequence state (``prompt_save`` + ``alloc``).

        Args:
            ctx: the [`Context`][reference.context.Context] the slot decodes into.
            seq_id: the slot's sequence.
            tokens: the tokens that sequence holds.
            checkpoints: the slot's context checkpoints (objects with a ``size``).

        Returns:
            True if an entry was added; False when the cache is off, ``tokens`` is empty,
            an entry already contains ``tokens``, or the state alone exceeds the byte limit
            (the cache is unchanged then).

        Raises:
            StateError: a ``seq_id`` the context does not have (nothing changed).
        """
        if not self.enabled or not tokens:
            return False
        if any(common_prefix(e.tokens, tokens) == len(tokens) for e in self.entries):
            return False  # the prompt is already in the cache
        data = ctx.state_seq_get_data_ext(seq_id, LLAMA_STATE_SEQ_FLAGS_NONE)
        new = CacheEntry(list(tokens), data, list(checkpoints))
        if self.limit_size > 0 and new.size() > self.limit_size:
            return False  # would flush the whole cache for one over-limit entry
        self.entries = [e for e in self.entries
                        if common_prefix(e.tokens, tokens) != len(e.tokens)]
        while self.entries and self.limit_size > 0 and self.size() + new.size() > self.limit_size:
            self.entries.pop(0)
        self.entries.append(new)
        return True
    # --8<-- [end:save]

    # --8<-- [start:load]
    def best(self, own_tokens: Sequence[int], new_tokens: Sequence[int]) -> CacheEntry | None:
        """The entry that keeps more and matches more of ``new_tokens`` than the slot's own
        tokens do (the search of ``server_prompt_cache::load``).

        Args:
            own_tokens: the tokens the slot holds now.
            new_tokens: the new prompt (not empty).

        Returns:
            The best entry (the oldest on a tie), or None.

        Raises:
            InvalidRequest: an empty ``new_tokens``.
        """
        if not new_tokens:
            raise InvalidRequest("the new prompt is empty: nothing to compare the cache with")
        lcp = common_prefix(own_tokens, new_tokens)
        f_keep_best = ratio(lcp, len(own_tokens)) if own_tokens else np.float32(-1.0)
        f_sim_best = ratio(lcp, len(new_tokens))
        found = None
        for entry in self.entries:
            lcp = common_prefix(entry.tokens, new_tokens)
            f_keep, f_sim = ratio(lcp, len(entry.tokens)), ratio(lcp, len(new_tokens))
            if f_keep >= F_KEEP_MIN and f_keep_best < f_keep and f_sim_best < f_sim:
                f_keep_best, f_sim_best, found = f_keep, f_sim, entry
        return found

    def load(self, ctx: Any, seq_id: int, own_tokens: Sequence[int],
             new_tokens: Sequence[int]) -> CacheEntry | None:
        """Bring back the best entry for ``new_tokens`` into the slot's sequence
        (``prompt_load``, and ``prompt_clear`` when the restore fails).

        Args:
            ctx: the [`Context`][reference.context.Context] the slot decodes into.
            seq_id: the slot's sequence.
            own_tokens: the tokens that sequence holds now.
            new_tokens: the new prompt (not empty).

        Returns:
            None when no entry beats the slot's own tokens: the slot is unchanged.
            Otherwise what the sequence holds now (take its ``tokens`` and ``checkpoints``
            as the slot's): the entry restored, which left the cache; or, when its restore
            was refused, an empty entry (``tokens == []``): the sequence was cleared and the
            refused entry stays in the cache, as in llama.cpp.

        Raises:
            InvalidRequest: an empty ``new_tokens`` (nothing changed).
        """
        if not self.enabled:
            return None
        entry = self.best(own_tokens, new_tokens)
        if entry is None:
            return None
        try:
            ctx.state_seq_set_data_ext(entry.data, seq_id, LLAMA_STATE_SEQ_FLAGS_NONE)
        except LlamarefError:
            ctx.memory.seq_rm(seq_id, -1, -1)
            return CacheEntry([], b"")
        self.entries.remove(entry)
        return entry
    # --8<-- [end:load]

    # --8<-- [start:update]
    def update(self) -> None:
        """Evict the oldest entries over the limits (``server_prompt_cache::update``).

        First the byte limit; then the token limit, raised to ``limit_size / bytes per
        token`` (the current average, at least 1) when the byte limit would hold more.

        Examples:
            >>> cache = PromptCache(limit_mib=-1, limit_tokens=5)
            >>> cache.entries = [CacheEntry([1, 2, 3], b""), CacheEntry([4, 5, 6], b"")]
            >>> cache.update(); [e.tokens for e in cache.entries]
            [[4, 5, 6]]
        """
        while self.entries and self.limit_size > 0 and self.size() > self.limit_size:
            self.entries.pop(0)
        size_per_token = max(np.float32(1.0), ratio(self.size(), max(1, self.n_tokens())))
        limit_tokens = self.limit_tokens
        if self.limit_size > 0:
            limit_tokens = max(limit_tokens, int(np.float32(self.limit_size) / size_per_token))
        while self.entries and self.limit_tokens > 0 and self.n_tokens() > limit_tokens:
            self.entries.pop(0)
    # --8<-- [end:update]


__all__ = ["F_KEEP_MIN", "CacheEntry", "PromptCache", "checkpoint_size", "ratio"]
