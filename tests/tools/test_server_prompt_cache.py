"""The RAM prompt cache (reference/tools/server/prompt_cache.py), on a real tiny Context.

- save, then load into another sequence: the next decode's logits are those of the
  original sequence, bit for bit; the entry leaves the cache;
- a saved prompt some entry contains is skipped; entries the new prompt contains are
  dropped;
- the byte limit evicts the oldest first, and a state over the whole limit is not saved;
  for any sequence of saves the cache stays within the limit (a law, on stub states);
- ``update`` evicts over the token limit, raised by what the byte limit holds;
- load: ``f_keep < 0.25`` is not loaded, ``0.25`` is; an entry must beat the slot's own
  tokens in both ``f_keep`` and ``f_sim``;
- a corrupted entry: load reports it (an empty entry), the slot's sequence is empty, the
  entry stays and the cache goes on working;
- ``--cache-ram 0``: nothing is stored or loaded.
"""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from reference.batch import Batch
from reference.context import Context
from reference.testing import random_weights, tiny_hparams
from reference.tools.server.errors import InvalidRequest
from reference.tools.server.prompt_cache import MIB, CacheEntry, PromptCache

HP = tiny_hparams()
WEIGHTS = random_weights(HP)


def make_ctx() -> Context:
    return Context(HP, WEIGHTS, n_ctx=256, n_seq_max=4)


def decode(ctx: Context, seq_id: int, tokens: list[int], pos0: int = 0) -> np.ndarray:
    """Decode ``tokens`` at ``pos0...`` into ``seq_id``; the last token's logits."""
    n = len(tokens)
    batch = Batch(token=tokens, pos=list(range(pos0, pos0 + n)), seq_id=[[seq_id]] * n,
                  logits=[0] * (n - 1) + [1])
    assert ctx.decode(batch) == 0
    return ctx.get_logits()[-1].copy()


def filled(prompts: dict[int, list[int]]) -> Context:
    """A context with each sequence holding its prompt."""
    ctx = make_ctx()
    for seq_id, tokens in prompts.items():
        decode(ctx, seq_id, tokens)
    return ctx


def state_size(ctx: Context, seq_id: int) -> int:
    return len(ctx.state_seq_get_data_ext(seq_id, 0))


token_lists = st.lists(st.integers(1, HP.n_vocab - 1), min_size=1, max_size=24)


@settings(deadline=None, max_examples=15)
@given(token_lists, st.integers(1, HP.n_vocab - 1), st.integers(0, 3))
def test_save_then_load_continues_as_the_original(prompt, next_token, dest):
    # the blob restores into another context of the same model: the same cells, decoded
    # the same way, give bit-identical logits
    ctx = filled({0: prompt})
    cache = PromptCache(limit_mib=-1, limit_tokens=256)
    assert cache.save(ctx, 0, prompt)
    want = decode(ctx, 0, [next_token], pos0=len(prompt))
    other = make_ctx()
    entry = cache.load(other, dest, own_tokens=[], new_tokens=prompt + [next_token])
    assert entry is not None and entry.tokens == prompt and len(cache) == 0
    assert other.memory.seq_pos_max(dest) == len(prompt) - 1
    got = decode(other, dest, [next_token], pos0=len(prompt))
    np.testing.assert_array_equal(got, want)


def test_load_replaces_the_slot_own_sequence():
    # in the same context the restored sequence sits in other cells: equal to rounding
    a, b = [1, 2, 3, 4, 5, 6], [7, 8, 9, 10]
    ctx = filled({0: a, 1: b})
    cache = PromptCache(limit_mib=-1, limit_tokens=256)
    assert cache.save(ctx, 0, a)
    want = decode(ctx, 0, [11], pos0=len(a))
    entry = cache.load(ctx, 1, own_tokens=b, new_tokens=a + [11])
    assert entry.tokens == a
    assert (ctx.memory.seq_pos_min(1), ctx.memory.seq_pos_max(1)) == (0, len(a) - 1)
    got = decode(ctx, 1, [11], pos0=len(a))
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


def test_checkpoints_pass_through_and_count():
    ctx = filled({0: [1, 2, 3]})
    ckpt = SimpleNamespace(size=1000)
    cache = PromptCache(limit_mib=-1, limit_tokens=0)
    assert cache.save(ctx, 0, [1, 2, 3], [ckpt])
    assert cache.size() == state_size(ctx, 0) + 1000 and cache.n_tokens() == 3
    assert cache.load(ctx, 1, [], [1, 2, 3]).checkpoints == [ckpt]


def test_containment_rules():
    ctx = filled({0: [1, 2, 3, 4, 5, 6], 1: [1, 2, 9]})
    cache = PromptCache(limit_mib=-1, limit_tokens=0)
    assert cache.save(ctx, 0, [1, 2, 3, 4])
    assert not cache.save(ctx, 0, [1, 2])  # already contained in [1, 2, 3, 4]
    assert not cache.save(ctx, 0, [1, 2, 3, 4])
    assert cache.save(ctx, 1, [1, 2, 9])  # shares a prefix only: both kept
    assert cache.save(ctx, 0, [1, 2, 3, 4, 5, 6])  # contains [1, 2, 3, 4]: it is dropped
    assert [e.tokens for e in cache.entries] == [[1, 2, 9], [1, 2, 3, 4, 5, 6]]
    assert not cache.save(ctx, 0, [])


def test_byte_limit_evicts_the_oldest():
    prompts = {0: [1] * 10, 1: [2] * 10, 2: [3] * 10}
    ctx = filled(prompts)
    sizes = [state_size(ctx, s) for s in prompts]
    cache = PromptCache(limit_mib=(sum(sizes) - 1) / MIB, limit_tokens=0)
    for seq_id, tokens in prompts.items():
        assert cache.save(ctx, seq_id, tokens)
    assert [e.tokens[0] for e in cache.entries] == [2, 3]
    assert cache.size() == sizes[1] + sizes[2] <= cache.limit_size


def test_state_over_the_whole_limit_is_not_saved():
    ctx = filled({0: [1, 2], 1: [3] * 40})
    cache = PromptCache(limit_mib=(state_size(ctx, 0) + 100) / MIB, limit_tokens=0)
    assert cache.save(ctx, 0, [1, 2])
    assert not cache.save(ctx, 1, [3] * 40)
    assert [e.tokens for e in cache.entries] == [[1, 2]]


class StubContext:
    """A context whose sequence ``s`` has a state of ``sizes[s]`` bytes."""

    def __init__(self, sizes: list[int]):
        self.sizes = sizes

    def state_seq_get_data_ext(self, seq_id: int, flags: int) -> bytes:
        return bytes(self.sizes[seq_id])


@settings(deadline=None)
@given(st.integers(1, 400), st.lists(st.tuples(st.integers(0, 2), token_lists), max_size=12),
       st.lists(st.integers(1, 300), min_size=3, max_size=3))
def test_byte_limit_law(limit, saves, sizes):
    ctx, cache = StubContext(sizes), PromptCache(limit_mib=limit / MIB, limit_tokens=0)
    for k, (seq_id, tokens) in enumerate(saves):
        contained = any(e.tokens[:len(tokens)] == tokens for e in cache.entries)
        saved = cache.save(ctx, seq_id, tokens, [SimpleNamespace(size=0, k=k)])
        assert saved == (sizes[seq_id] <= limit and not contained)
        assert not saved or cache.entries[-1].tokens == tokens
        assert cache.size() <= cache.limit_size
        # entries stay in save order; none contains another's tokens as a prefix
        order = [e.checkpoints[0].k for e in cache.entries]
        assert order == sorted(order)
        kept = [e.tokens for e in cache.entries]
        assert not any(i != j and b[:len(a)] == a for i, a in enumerate(kept)
                       for j, b in enumerate(kept))


def test_update_token_limit_and_its_raise():
    entry = [CacheEntry([k] * 10, bytes(100)) for k in range(3)]  # 10 bytes a token
    cache = PromptCache(limit_mib=-1, limit_tokens=15)
    cache.entries = list(entry)
    cache.update()
    assert cache.entries == [entry[2]]
    cache = PromptCache(limit_mib=1000 / MIB, limit_tokens=15)  # holds 100 tokens
    cache.entries = list(entry)
    cache.update()
    assert cache.entries == entry
    cache = PromptCache(limit_mib=250 / MIB, limit_tokens=15)  # bytes first: 2 entries
    cache.entries = list(entry)
    cache.update()
    assert cache.entries == entry[1:]


def test_f_keep_below_a_quarter_is_not_loaded():
    prompt = [1, 2, 3, 4, 5, 6, 7, 8]
    ctx = filled({0: prompt})
    cache = PromptCache(limit_mib=-1, limit_tokens=0)
    assert cache.save(ctx, 0, prompt)
    assert cache.load(ctx, 1, [], [1, 9, 9]) is None  # f_keep 1/8
    assert ctx.memory.seq_pos_max(1) == -1 and len(cache) == 1
    assert cache.load(ctx, 1, [], [1, 2, 9]).tokens == prompt  # f_keep 2/8 == 0.25


def test_entry_must_beat_the_slot_in_keep_and_similarity():
    ctx = filled({0: [1, 2, 3, 4], 1: [1, 2, 3, 5]})
    cache = PromptCache(limit_mib=-1, limit_tokens=0)
    assert cache.save(ctx, 0, [1, 2, 3, 4])
    new = [1, 2, 3, 6]
    assert cache.load(ctx, 1, own_tokens=[1, 2, 3, 5], new_tokens=new) is None  # a tie
    assert cache.load(ctx, 1, own_tokens=[1, 2, 7, 5], new_tokens=new).tokens == [1, 2, 3, 4]


def test_corrupted_entry_clears_the_slot_and_the_cache_goes_on():
    ctx = filled({0: [1, 2, 3, 4], 1: [5, 6, 7], 2: [8, 9, 10]})
    cache = PromptCache(limit_mib=-1, limit_tokens=0)
    assert cache.save(ctx, 0, [1, 2, 3, 4])
    cache.entries[0].data = cache.entries[0].data[:-10]
    entry = cache.load(ctx, 1, own_tokens=[5, 6, 7], new_tokens=[1, 2, 3])
    assert entry is not None and entry.tokens == [] and entry.checkpoints == []
    assert ctx.memory.seq_pos_max(1) == -1 and len(cache) == 1
    assert cache.save(ctx, 2, [8, 9, 10])
    assert cache.load(ctx, 1, own_tokens=[], new_tokens=[8, 9, 10, 11]).tokens == [8, 9, 10]
    assert ctx.memory.seq_pos_max(1) == 2


def test_cache_ram_zero_is_off():
    ctx = filled({0: [1, 2, 3]})
    cache = PromptCache(limit_mib=0, limit_tokens=256)
    assert not cache.save(ctx, 0, [1, 2, 3]) and len(cache) == 0 and cache.size() == 0
    assert cache.load(ctx, 1, [], [1, 2, 3]) is None


def test_clear_and_errors():
    ctx = filled({0: [1, 2, 3]})
    cache = PromptCache(limit_mib=-1, limit_tokens=0)
    assert cache.save(ctx, 0, [1, 2, 3])
    with pytest.raises(InvalidRequest, match="new prompt is empty"):
        cache.load(ctx, 1, [], [])
    assert len(cache) == 1
    cache.clear()
    assert len(cache) == 0 and cache.n_tokens() == 0
    with pytest.raises(InvalidRequest, match="token limit must be >= 0"):
        PromptCache(limit_mib=-1, limit_tokens=-1)
