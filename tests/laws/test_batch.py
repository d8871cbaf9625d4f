"""Batches: validation rules (one test per rule, with its message) and the laws of the splits.

The splits are checked by properties over random *valid* batches (hypothesis): every split
partitions the batch, keeps each sequence's tokens in order, respects ``n_ubatch``, and
``split_equal`` makes equal-length disjoint sequence sets. The validation reads the memory
through a strict fake that fails on anything but ``seq_pos_min`` / ``seq_pos_max``.
"""

from __future__ import annotations

from unittest import mock

import numpy as np
import pytest
from hypothesis import assume, given
from hypothesis import strategies as st

import reference.batch as B
from reference.batch import (
    LLAMA_MAX_SEQ,
    Batch,
    BatchAllocr,
    BatchError,
    Ubatch,
    output_ids,
    output_order,
)

N_VOCAB = 32


class FakeMemory:
    """A memory that is only a dict ``seq -> (pos_min, pos_max)``; reads are logged."""

    def __init__(self, ranges: dict[int, tuple[int, int]] | None = None):
        self.ranges = dict(ranges or {})
        self.calls: list[tuple[str, int]] = []

    def seq_pos_min(self, seq_id: int) -> int:
        self.calls.append(("seq_pos_min", seq_id))
        return self.ranges.get(seq_id, (-1, -1))[0]

    def seq_pos_max(self, seq_id: int) -> int:
        self.calls.append(("seq_pos_max", seq_id))
        return self.ranges.get(seq_id, (-1, -1))[1]

    def __getattr__(self, name):  # anything else (seq_rm, clear, ...) is a test failure
        raise AssertionError(f"batch validation touched memory.{name}")


def allocr(batch: Batch, n_seq_max: int = 4, memory=None, **kw) -> BatchAllocr:
    return BatchAllocr(batch, n_vocab=N_VOCAB, n_seq_max=n_seq_max, memory=memory, **kw)


def refused(batch: Batch, match: str, memory=None, **kw) -> None:
    """The batch is refused with ``match`` and the memory is left as it was."""
    before = None if memory is None else dict(memory.ranges)
    with pytest.raises(BatchError, match=match):
        allocr(batch, memory=memory, **kw)
    if memory is not None:
        assert memory.ranges == before


# ---------------------------------------------------------------------------------------------
# Batch construction: types and shapes
# ---------------------------------------------------------------------------------------------


def test_batch_defaults_are_left_unset():
    b = Batch(token=[1, 2, 3])
    assert b.n_tokens == 3 and b.pos is None and b.seq_id is None and b.logits is None
    assert b.token.dtype == np.int32


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(), "exactly one"),
        (dict(token=[1], embd=[[0.0]]), "exactly one"),
        (dict(token=[[1, 2]]), "token must be a 1-D"),
        (dict(token=[1.5]), "token must be a 1-D sequence of integers"),
        (dict(token=[True]), "not booleans"),
        (dict(token=[2**31]), "int32"),
        (dict(embd=[0.0, 1.0]), "embd must be a float array"),
        (dict(embd=[[1, 2]]), "embd must be a float array"),
        (dict(token=[1, 2], pos=[0]), "pos has 1 entries, the batch has 2"),
        (dict(token=[1, 2], seq_id=[[0]]), "seq_id has 1 entries"),
        (dict(token=[1, 2], seq_id=[[0], []]), r"seq_id\[1\] is empty"),
        (dict(token=[1], seq_id=[0]), r"seq_id\[0\] must be a list"),
        (dict(token=[1], seq_id=[[0.5]]), "must hold integers"),
        (dict(token=[1, 2], logits=[True]), "logits must be 2 booleans"),
        (dict(token=[1], logits=[0.5]), "logits must be 1 booleans"),
    ],
)
def test_batch_construction_refuses(kwargs, match):
    with pytest.raises(BatchError, match=match):
        Batch(**kwargs)


def test_batch_error_is_a_value_error():
    assert issubclass(BatchError, ValueError)


def test_duplicate_seq_ids_collapse_keeping_order():
    # llama.cpp keeps a token's seq ids in a set
    assert Batch(token=[1], seq_id=[[2, 0, 2]]).seq_id == ((2, 0),)


def test_logits_accepts_int8_flags():
    assert Batch(token=[1, 2], logits=np.array([1, 0], np.int8)).logits.tolist() == [True, False]


# ---------------------------------------------------------------------------------------------
# Filling: positions, seq ids, outputs
# ---------------------------------------------------------------------------------------------


def test_fill_defaults_seq0_last_output_pos_from_memory():
    mem = FakeMemory({0: (0, 9)})
    a = allocr(Batch(token=[1, 2, 3]), memory=mem)
    assert a.batch.pos.tolist() == [10, 11, 12]
    assert a.batch.seq_id == ((0,), (0,), (0,))
    assert a.batch.logits.tolist() == [False, False, True]
    assert a.n_outputs == 1


def test_fill_pos_each_sequence_continues_its_memory():
    mem = FakeMemory({0: (0, 4), 2: (3, 7)})
    b = Batch(token=[1, 2, 3, 4, 5, 6], seq_id=[[0], [1], [2], [0], [2], [1]])
    assert allocr(b, memory=mem).batch.pos.tolist() == [5, 0, 8, 6, 9, 1]


def test_fill_pos_coupled_token_advances_only_its_first_sequence():
    # seq 1's counter does not move for the tokens that list 0 first: its own token comes
    # back to position 0 after 0 and 1, which llama.cpp then refuses as "decreasing"
    b = Batch(token=[1, 2, 3], seq_id=[[0, 1], [0, 1], [1]])
    refused(b, "sequence 1 positions are decreasing", memory=FakeMemory())
    ok = Batch(token=[1, 2, 3], seq_id=[[0, 1], [0, 1], [0]])
    assert allocr(ok, memory=FakeMemory()).batch.pos.tolist() == [0, 1, 2]


@pytest.mark.parametrize("n_tokens", [1, 2])
def test_fill_pos_reaches_the_largest_int32_and_no_further(n_tokens):
    """Positions run up to ``2**31 - 1`` (the largest ``llama_pos``) and no further, for one
    token (a generation step) and for several."""
    last = 2**31 - 1
    a = allocr(Batch(token=[1] * n_tokens), memory=FakeMemory({0: (0, last - n_tokens)}))
    assert a.batch.pos.tolist() == list(range(last - n_tokens + 1, last + 1))
    refused(Batch(token=[1] * n_tokens), "int32",
            memory=FakeMemory({0: (0, last - n_tokens + 1)}))


def test_fill_pos_without_memory_starts_at_zero():
    assert allocr(Batch(token=[1, 2], seq_id=[[3], [3]])).batch.pos.tolist() == [0, 1]


def test_output_all_overrides_flags():
    a = allocr(Batch(token=[1, 2, 3], logits=[False, True, False]), output_all=True)
    assert a.batch.logits.all() and a.n_outputs == 3


def test_embd_batch_is_carried_into_ubatches():
    embd = np.arange(12, dtype=np.float64).reshape(3, 4)
    a = allocr(Batch(embd=embd, seq_id=[[0], [1], [0]]), n_embd=4)
    us = drain(a.split_equal, 8, True)  # one token of each sequence, then the rest of seq 0
    assert [u.idx.tolist() for u in us] == [[0, 1], [2]]
    assert us[0].token is None
    np.testing.assert_array_equal(us[0].embd, embd[[0, 1]])
    assert us[0].embd.dtype == np.float64


def test_the_callers_batch_is_not_modified():
    b = Batch(token=[1, 2])
    allocr(b, memory=FakeMemory({0: (0, 3)}))
    assert b.pos is None and b.seq_id is None and b.logits is None


def test_seq_pos_of_a_sequence_not_in_the_batch_is_minus_one():
    balloc = allocr(Batch(token=[1] * 3, seq_id=[[0], [0], [2]]))
    assert [balloc.seq_pos_min(s) for s in range(4)] == [0, -1, 0, -1]
    assert [balloc.seq_pos_max(s) for s in range(4)] == [1, -1, 0, -1]


# ---------------------------------------------------------------------------------------------
# Validation: one test per rule of llama_batch_allocr::init (return code -1)
# ---------------------------------------------------------------------------------------------


def test_empty_batch():
    refused(Batch(token=[]), r"n_tokens == 0")


def test_embd_width_must_match_the_model():
    refused(Batch(embd=np.zeros((2, 3), np.float32)), "embd row width 3 does not match the "
            "decoder input 4", n_embd=4)


@pytest.mark.parametrize("bad", [-1, N_VOCAB])
def test_token_out_of_vocab(bad):
    refused(Batch(token=[1, bad]), rf"invalid token\[1\] = {bad}: token ids must be in \[0, 32\)")


@pytest.mark.parametrize("bad", [-1, 4])
def test_seq_id_out_of_range(bad):
    refused(Batch(token=[1, 2], seq_id=[[0], [0, bad]]),
            rf"invalid seq_id\[1\]\[1\] = {bad}: seq ids must be in \[0, 4\)")


def test_seq_id_range_is_checked_before_positions_are_filled():
    # llama.cpp fills positions first (pos_next[seq_id] out of bounds: undefined behaviour)
    mem = FakeMemory({0: (0, 3)})
    refused(Batch(token=[1], seq_id=[[7]]), r"invalid seq_id\[0\]\[0\] = 7", memory=mem)
    assert ("seq_pos_max", 7) not in mem.calls


def test_n_seq_max_above_llama_max_seq():
    with pytest.raises(BatchError, match=f"n_seq_max = 300 > {LLAMA_MAX_SEQ}"):
        BatchAllocr(Batch(token=[1]), n_vocab=N_VOCAB, n_seq_max=300)


def test_token_ids_are_checked_before_seq_ids():
    refused(Batch(token=[N_VOCAB], seq_id=[[9]]), "invalid token")


@pytest.mark.parametrize("start", [3, 6, 0])
def test_first_position_must_be_pos_max_plus_one(start):
    mem = FakeMemory({0: (0, 4)})
    refused(Batch(token=[1, 2], pos=[start, start + 1]), f"X = 4, the batch starts sequence 0 "
            f"at Y = {start}; it is required that Y = X \\+ 1", memory=mem)


def test_first_position_pos_max_plus_one_is_accepted():
    a = allocr(Batch(token=[1, 2], pos=[5, 6]), memory=FakeMemory({0: (0, 4)}))
    assert a.seq_pos_min(0) == 5 and a.seq_pos_max(0) == 6


def test_an_empty_sequence_may_start_anywhere():
    a = allocr(Batch(token=[1, 2], pos=[7, 8], seq_id=[[1], [1]]),
               memory=FakeMemory({0: (0, 4)}))
    assert a.batch.pos.tolist() == [7, 8]


def test_positions_with_a_hole():
    refused(Batch(token=[1, 2], pos=[0, 2]), "sequence 0 positions are not continuous: the "
            r"batch has 2 distinct positions in \[0, 2\]")


def test_a_repeated_position_is_allowed():
    # llama.cpp counts the *set* of positions: 0, 0, 1 has no hole
    a = allocr(Batch(token=[1, 2, 3], pos=[0, 0, 1]))
    assert a.seq_pos[0] == {0, 1}


@pytest.mark.parametrize("ranges, shown", [
    ({0: (0, 4), 1: (1, 4)}, r"\[1, 4\] vs \[0, 4\]"),  # same end, different start
    ({0: (0, 4)}, r"\[-1, -1\] vs \[0, 4\]"),  # sequence 1 is empty: no position rule for it
])
def test_coupled_sequences_that_diverged(ranges, shown):
    # (different ends are caught before, by the position rule: one token cannot be X + 1 of both)
    refused(Batch(token=[1], pos=[5], seq_id=[[0, 1]]), r"sequence 1 is coupled to 0 in the "
            r"input batch, but they have diverged: memory positions " + shown,
            memory=FakeMemory(ranges))


def test_coupled_sequences_with_the_same_range():
    mem = FakeMemory({0: (2, 4), 1: (2, 4)})
    a = allocr(Batch(token=[1], pos=[5], seq_id=[[0, 1]]), memory=mem)
    assert a.seq_cpl == {(1, 0)} and a.has_cpl


def test_coupled_check_needs_a_memory():
    a = allocr(Batch(token=[1, 2], pos=[0, 1], seq_id=[[0, 1], [0, 1]]))
    assert a.has_cpl


def test_decreasing_positions():
    # the example of llama.cpp's comment: seq 0 goes 4 5 6 3
    b = Batch(token=[1] * 7, pos=[4, 5, 0, 1, 6, 2, 3], seq_id=[[0], [0], [1], [1], [0], [1], [0]])
    refused(b, r"sequence 0 positions are decreasing \(not allowed\): position 3 at batch "
            r"index 6 after 6")


def test_partial_sequence_subsets_are_accepted_although_llama_cpp_comments_otherwise():
    # llama.cpp's comment marks this "invalid", but its check (intersect the seq sets of a
    # sequence's tokens, refuse when empty) cannot fail: each set contains the sequence
    b = Batch(token=[1, 2, 3], pos=[0, 1, 1], seq_id=[[0, 1, 2], [0, 1], [1, 2]])
    assert allocr(b).n_tokens == 3


def test_n_batch():
    refused(Batch(token=[1, 2, 3]), "n_tokens_all = 3 > n_batch = 2", n_batch=2)
    assert allocr(Batch(token=[1, 2, 3]), n_batch=3).n_tokens == 3


def test_negative_position_is_refused():
    # divergence: llama.cpp accepts it and writes -1 into a KV cell, which marks it empty
    refused(Batch(token=[1], pos=[-1]), r"pos\[0\] = -1 is negative")


def test_validation_reads_the_memory_only_through_seq_pos():
    mem = FakeMemory({0: (0, 4), 1: (0, 4)})
    a = allocr(Batch(token=[1, 2, 3], seq_id=[[0, 1], [0], [1]], pos=[5, 6, 6]), memory=mem)
    assert a.n_tokens == 3
    assert mem.ranges == {0: (0, 4), 1: (0, 4)}
    assert {name for name, _ in mem.calls} <= {"seq_pos_min", "seq_pos_max"}


# ---------------------------------------------------------------------------------------------
# The splits: explicit cases
# ---------------------------------------------------------------------------------------------


def drain(split, *args) -> list[Ubatch]:
    out = []
    while True:
        u = split(*args)
        if u.n_tokens == 0:
            return out
        out.append(u)


def two_seq_batch() -> BatchAllocr:
    # seq 0 has 3 tokens, seq 1 has 2, interleaved
    return allocr(Batch(token=[10, 20, 11, 21, 12], seq_id=[[0], [1], [0], [1], [0]],
                        logits=[False, True, False, True, True]))


def test_split_simple_takes_tokens_in_batch_order():
    a = two_seq_batch()
    us = drain(a.split_simple, 2)
    assert [u.idx.tolist() for u in us] == [[0, 1], [2, 3], [4]]
    assert [(u.n_seqs, u.n_seq_tokens, u.equal_seqs) for u in us] == [(2, 1, False)] * 2 + [
        (1, 1, False)]
    assert us[0].seq_id_unq == (0, 1) and us[2].seq_id_unq == (0,)
    assert a.out_ids == [1, 3, 4]


def test_split_equal_groups_sets_and_round_robins():
    a = two_seq_batch()
    us = drain(a.split_equal, 4, True)
    assert [u.idx.tolist() for u in us] == [[0, 2, 1, 3], [4]]
    assert [u.token.tolist() for u in us] == [[10, 11, 20, 21], [12]]
    assert [(u.n_seqs, u.n_seq_tokens) for u in us] == [(2, 2), (1, 1)]
    assert a.out_ids == [1, 3, 4]


def test_split_equal_out_ids_are_in_split_order_and_output_ids_sorts_them():
    a = allocr(Batch(token=[10, 20, 11, 21], seq_id=[[0], [1], [0], [1]], logits=[1, 1, 1, 1]))
    drain(a.split_equal, 4, False)
    assert a.out_ids == [0, 2, 1, 3]
    assert output_ids(a.out_ids, 4).tolist() == [0, 1, 2, 3]
    assert output_order(a.out_ids).tolist() == [0, 2, 1, 3]


def test_split_equal_sequential_needs_consecutive_seq_ids():
    a = allocr(Batch(token=[1, 2, 3], seq_id=[[0], [2], [1]]))
    assert [u.seq_id_unq for u in drain(a.split_equal, 8, True)] == [(0, 1), (2,)]
    b = allocr(Batch(token=[1, 2, 3], seq_id=[[0], [2], [1]]))
    assert [u.seq_id_unq for u in drain(b.split_equal, 8, False)] == [(0, 1, 2)]


def test_split_equal_sequential_refuses_coupled_sequences():
    a = allocr(Batch(token=[1, 2], pos=[0, 1], seq_id=[[0, 1], [0]]))
    assert a.split_equal(8, sequential=True).n_tokens == 0
    assert a.n_used == 0 < a.n_tokens  # the memory reports "no suitable split": decode -> 1
    assert "coupled" in a.split_error
    assert a.split_equal(8, sequential=False).n_tokens == 1  # {0,1} and {0} overlap


def test_split_equal_stops_at_n_ubatch_sets_divergence():
    # three single-token sequences, n_ubatch = 2: llama.cpp collects sets until it holds
    # n_ubatch + 1 = 3 of them and emits a ubatch of 3 tokens; the reference emits 2 + 1
    a = allocr(Batch(token=[1, 2, 3], seq_id=[[0], [1], [2]]))
    assert [u.n_tokens for u in drain(a.split_equal, 2, True)] == [2, 1]


def test_split_equal_keep_tail():
    # seq 0: 5 tokens, seq 1: 2 tokens; n_keep_tail = 2 keeps each sequence's last 2 together
    b = Batch(token=[1] * 7, seq_id=[[0], [0], [0], [0], [0], [1], [1]])
    a = allocr(b)
    us = drain(a.split_equal, 4, True, 2)
    assert [u.idx.tolist() for u in us] == [[0, 1, 5, 6], [2, 3, 4]]


def test_keep_tail_needs_n_ubatch_above_it():
    """``GGML_ASSERT(n_ubatch > n_keep_tail)``: equal is refused."""
    with pytest.raises(ValueError, match="n_ubatch = 2 must exceed n_keep_tail = 2"):
        allocr(Batch(token=[1] * 3, seq_id=[[0], [0], [0]])).split_equal(2, True, 2)


@pytest.mark.parametrize("seq_id, n_ubatch, n_keep_tail, ubatches", [
    # two rounds of 2 sets fill n_ubatch = 4; each set has exactly n_keep_tail = 2 left:
    # not "< n_keep_tail", so both stay
    ([[0]] * 4 + [[1]] * 4, 4, 2, [[0, 1, 4, 5], [2, 3, 6, 7]]),
    # set 0 has 2 left (< 3) and 2 + 2 == n_ubatch: it is finished in this ubatch
    ([[0]] * 4 + [[1]] * 3, 4, 3, [[0, 1, 2, 3], [4, 5, 6]]),
    # one set, 4 taken and 1 left (< 2), 4 + 1 > n_ubatch: give back until 2 are left
    ([[0]] * 5, 4, 2, [[0, 1, 2], [3, 4]]),
])
def test_split_equal_keep_tail_on_its_boundaries(seq_id, n_ubatch, n_keep_tail, ubatches):
    """``n_keep_tail`` exactly on each comparison of ``llama_batch_allocr::split_equal``
    (``remaining < n_keep_tail``, ``idxs.size() + n_remaining(0) <= n_ubatch``,
    ``while (n_remaining(0) < n_keep_tail)``): the ubatches llama.cpp makes."""
    a = allocr(Batch(token=[1] * len(seq_id), seq_id=seq_id))
    us = drain(a.split_equal, n_ubatch, True, n_keep_tail)
    assert [u.idx.tolist() for u in us] == ubatches


def test_split_seq_narrows_to_subsets():
    a = allocr(Batch(token=[1] * 5, pos=[0, 1, 2, 2, 3], seq_id=[[0, 1], [0, 1], [0], [1], [0]]))
    us = drain(a.split_seq, 8)
    assert [u.idx.tolist() for u in us] == [[0, 1, 2, 4], [3]]
    assert all(u.n_seqs == 1 and u.equal_seqs and u.n_seq_tokens == u.n_tokens for u in us)


def test_split_seq_respects_n_ubatch():
    a = two_seq_batch()
    assert [u.idx.tolist() for u in drain(a.split_seq, 2)] == [[0, 2], [1, 3], [4]]


def test_split_reset_starts_over():
    a = two_seq_batch()
    drain(a.split_simple, 2)
    a.split_reset()
    assert a.n_used == 0 and a.out_ids == []
    assert a.split_seq(8).idx.tolist() == [0, 2, 4]


# ---------------------------------------------------------------------------------------------
# The splits: laws over random valid batches
# ---------------------------------------------------------------------------------------------


@st.composite
def valid_batches(draw, coupled: bool = True):
    """A valid batch (and its memory): an optional prefix shared by a group of sequences,
    then single-sequence tokens in random interleaving, each sequence continuing its memory."""
    n_seq_max = draw(st.integers(1, 5))
    seqs = list(range(n_seq_max))
    group = draw(st.permutations(seqs).map(lambda p: p[: draw(st.integers(1, n_seq_max))]))
    if not coupled:
        group = group[:1]
    n_prefix = draw(st.integers(0, 4))
    mem_max = {s: draw(st.integers(-1, 6)) for s in seqs}
    for s in group:
        mem_max[s] = mem_max[group[0]]
    ranges = {s: (0, p) for s, p in mem_max.items() if p >= 0}
    tail = draw(st.lists(st.sampled_from(seqs), max_size=14))
    assume(n_prefix + len(tail) > 0)

    nxt = {s: mem_max[s] + 1 for s in seqs}
    pos, seq_id = [], []
    for _ in range(n_prefix):
        pos.append(nxt[group[0]])
        seq_id.append(list(group))
        for s in group:
            nxt[s] += 1
    for s in tail:
        pos.append(nxt[s])
        seq_id.append([s])
        nxt[s] += 1
    n = len(pos)
    token = draw(st.lists(st.integers(0, N_VOCAB - 1), min_size=n, max_size=n))
    logits = draw(st.lists(st.booleans(), min_size=n, max_size=n))
    batch = Batch(token=token, pos=pos, seq_id=seq_id, logits=logits)
    return batch, n_seq_max, FakeMemory(ranges)


def check_partition(a: BatchAllocr, us: list[Ubatch], n_ubatch: int) -> None:
    """Each token exactly once; each sequence in batch order; outputs all emitted once."""
    order = np.concatenate([u.idx for u in us])
    assert sorted(order.tolist()) == list(range(a.n_tokens))
    assert all(0 < u.n_tokens <= n_ubatch for u in us)
    for s in a.seq_pos:
        seen = [i for i in order.tolist() if s in a.batch.seq_id[i]]
        assert seen == sorted(seen)
    assert sorted(a.out_ids) == np.flatnonzero(a.batch.logits).tolist()
    assert len(a.out_ids) == a.n_outputs == sum(int(u.output.sum()) for u in us)
    for u in us:  # a ubatch is a faithful copy of its batch entries
        np.testing.assert_array_equal(u.token, a.batch.token[u.idx])
        np.testing.assert_array_equal(u.pos, a.batch.pos[u.idx])
        assert u.seq_id == tuple(a.batch.seq_id[i] for i in u.idx)
        assert u.seq_id_unq == tuple(sorted({s for ids in u.seq_id for s in ids}))
        assert u.n_tokens == u.n_seqs * u.n_seq_tokens


@given(valid_batches(), st.integers(1, 9))
def test_valid_batches_validate_and_leave_memory_alone(case, n_ubatch):
    batch, n_seq_max, mem = case
    before = dict(mem.ranges)
    a = allocr(batch, n_seq_max=n_seq_max, memory=mem)
    assert mem.ranges == before
    np.testing.assert_array_equal(a.batch.pos, batch.pos)


@given(valid_batches(coupled=False))
def test_auto_positions_equal_the_continuation_of_each_sequence(case):
    batch, n_seq_max, mem = case
    auto = Batch(token=batch.token, seq_id=batch.seq_id, logits=batch.logits)
    a = allocr(auto, n_seq_max=n_seq_max, memory=mem)
    np.testing.assert_array_equal(a.batch.pos, batch.pos)


@given(valid_batches(), st.integers(1, 9))
def test_split_simple_partitions_in_batch_order(case, n_ubatch):
    batch, n_seq_max, mem = case
    a = allocr(batch, n_seq_max=n_seq_max, memory=mem)
    us = drain(a.split_simple, n_ubatch)
    check_partition(a, us, n_ubatch)
    assert np.concatenate([u.idx for u in us]).tolist() == list(range(a.n_tokens))
    assert all(u.n_tokens == n_ubatch for u in us[:-1])
    assert a.out_ids == sorted(a.out_ids)


@given(valid_batches(), st.integers(1, 9), st.booleans())
def test_split_equal_makes_equal_disjoint_sequence_sets(case, n_ubatch, sequential):
    batch, n_seq_max, mem = case
    a = allocr(batch, n_seq_max=n_seq_max, memory=mem)
    us = drain(a.split_equal, n_ubatch, sequential)
    if sequential and a.has_cpl:
        assert us == [] and a.n_used == 0
        return
    check_partition(a, us, n_ubatch)
    for u in us:
        assert u.equal_seqs and u.n_seqs <= n_ubatch
        blocks = [u.seq_id[k * u.n_seq_tokens:(k + 1) * u.n_seq_tokens] for k in range(u.n_seqs)]
        sets = [frozenset(block[0]) for block in blocks]
        assert all(frozenset(ids) == sets[k] for k, block in enumerate(blocks) for ids in block)
        assert all(not (x & y) for i, x in enumerate(sets) for y in sets[i + 1:])
        if sequential:
            firsts = [min(x) for x in sets]
            assert all(len(x) == 1 for x in sets)
            assert firsts == list(range(firsts[0], firsts[0] + len(firsts)))


@given(valid_batches(coupled=False), st.integers(0, 3), st.integers(1, 9))
def test_split_equal_keep_tail_keeps_each_sequence_tail_together(case, n_keep_tail, extra):
    batch, n_seq_max, mem = case
    n_ubatch = n_keep_tail + extra
    a = allocr(batch, n_seq_max=n_seq_max, memory=mem)
    us = drain(a.split_equal, n_ubatch, True, n_keep_tail)
    check_partition(a, us, n_ubatch)
    where = {int(i): k for k, u in enumerate(us) for i in u.idx}
    for idxs in a.seq_set_map.values():
        tail = idxs[-n_keep_tail:] if n_keep_tail else []
        assert len({where[i] for i in tail}) <= 1


@given(valid_batches(), st.integers(1, 9))
def test_split_seq_makes_one_narrowing_sequence_set(case, n_ubatch):
    batch, n_seq_max, mem = case
    a = allocr(batch, n_seq_max=n_seq_max, memory=mem)
    us = drain(a.split_seq, n_ubatch)
    check_partition(a, us, n_ubatch)
    for u in us:
        assert u.n_seqs == 1 and u.n_seq_tokens == u.n_tokens
        assert u.idx.tolist() == sorted(u.idx.tolist())
        sets = [frozenset(ids) for ids in u.seq_id]
        assert all(later <= earlier for earlier, later in zip(sets, sets[1:], strict=False))


@given(st.lists(st.booleans(), min_size=1, max_size=12), st.randoms(use_true_random=False))
def test_output_ids_put_rows_back_in_batch_order(flags, rnd):
    outs = [i for i, f in enumerate(flags) if f]
    out_ids = outs[:]
    rnd.shuffle(out_ids)
    rows = np.array(out_ids)  # row k of the split-order output holds token out_ids[k]
    assert rows[output_order(out_ids)].tolist() == outs
    ids = output_ids(out_ids, len(flags))
    assert [ids[i] for i in outs] == list(range(len(outs)))
    assert all(ids[i] == -1 for i, f in enumerate(flags) if not f)


# ---------------------------------------------------------------------------------------------
# Oracle: llama.cpp's own split decisions, read from its LLAMA_BATCH_DEBUG=2 log
# ---------------------------------------------------------------------------------------------

SPLIT_CASES = [
    # (kv_unified, n_seq_max, n_ubatch, seq_id per token, pos)
    (True, 2, 3, [[0], [1], [0], [1], [0], [0], [1]], [0, 0, 1, 1, 2, 3, 2]),
    (False, 2, 3, [[0], [1], [0], [1], [0], [0], [1]], [0, 0, 1, 1, 2, 3, 2]),
    (False, 2, 4, [[0], [1], [0], [1], [0], [0], [1]], [0, 0, 1, 1, 2, 3, 2]),
    (False, 3, 4, [[2], [0], [1], [1], [0], [2], [0]], [0, 0, 0, 1, 1, 1, 2]),
    (True, 2, 3, [[0, 1], [0, 1], [0], [1]], [0, 1, 2, 2]),
]


def llamacpp_splits(tmp_path, kv_unified, n_seq_max, n_ubatch, seq_id, pos):
    """The ubatches (as batch indices) that llama_decode makes of a batch, and its rc."""
    import ctypes
    import os

    import llama_cpp
    import llama_cpp._logger

    from tests.support.tiny_models import random_weights, tiny_hparams, write_tiny_gguf

    hp = tiny_hparams()
    path = write_tiny_gguf(tmp_path / "tiny.gguf", hp, random_weights(hp))
    lines: list[str] = []

    @llama_cpp.llama_log_callback
    def log(level, text, user_data):
        lines.append(text.decode(errors="replace"))

    old = os.environ.get("LLAMA_BATCH_DEBUG")
    os.environ["LLAMA_BATCH_DEBUG"] = "2"  # read when the context builds its batch allocator
    llama_cpp.llama_log_set(log, ctypes.c_void_p(0))
    model = ctx = None
    try:
        model = llama_cpp.llama_model_load_from_file(
            str(path).encode(), llama_cpp.llama_model_default_params())
        cp = llama_cpp.llama_context_default_params()
        cp.n_ctx, cp.n_batch, cp.n_ubatch = 64 * n_seq_max, 16, n_ubatch
        cp.n_seq_max, cp.kv_unified, cp.type_k, cp.type_v = n_seq_max, kv_unified, 0, 0
        ctx = llama_cpp.llama_init_from_model(model, cp)
        n = len(seq_id)
        b = llama_cpp.llama_batch_init(n, 0, n_seq_max)
        b.n_tokens = n
        for i, ids in enumerate(seq_id):
            b.token[i], b.pos[i], b.n_seq_id[i], b.logits[i] = i + 1, pos[i], len(ids), 1
            for k, s in enumerate(ids):
                b.seq_id[i][k] = s
        lines.clear()
        rc = llama_cpp.llama_decode(ctx, b)
        llama_cpp.llama_batch_free(b)
    finally:
        if ctx is not None:
            llama_cpp.llama_free(ctx)
        if model is not None:
            llama_cpp.llama_model_free(model)
        llama_cpp.llama_log_set(llama_cpp._logger.llama_log_callback, ctypes.c_void_p(0))
        if old is None:
            del os.environ["LLAMA_BATCH_DEBUG"]
        else:
            os.environ["LLAMA_BATCH_DEBUG"] = old
    splits: list[list[int]] = []
    for line in "".join(lines).splitlines():
        if "added ubatch to split" in line:
            splits.append([])
        elif splits and " id = " in line:  # token id i + 1 is batch index i
            splits[-1].append(int(line.split(" id = ")[1].split()[0]) - 1)
    return rc, splits


def reference_splits(kv_unified, n_seq_max, n_ubatch, seq_id, pos):
    a = allocr(Batch(token=[i + 1 for i in range(len(seq_id))], pos=pos, seq_id=seq_id),
               n_seq_max=n_seq_max, memory=FakeMemory())
    # llama_kv_cache::init_batch: one stream -> split_simple, else split_equal(sequential)
    us = drain(a.split_simple, n_ubatch) if kv_unified else drain(a.split_equal, n_ubatch, True)
    return [u.idx.tolist() for u in us]


@pytest.mark.oracle
@pytest.mark.parametrize("case", SPLIT_CASES)
def test_splits_match_llama_cpp(tmp_path, case):
    pytest.importorskip("llama_cpp")
    rc, theirs = llamacpp_splits(tmp_path, *case)
    assert rc == 0
    assert theirs == reference_splits(*case)


@pytest.mark.oracle
def test_split_equal_overflow_of_llama_cpp_is_pinned(tmp_path):
    # three single-token sequences, one stream each, n_ubatch = 2: llama.cpp emits one ubatch
    # of 3 tokens (more than n_ubatch); the reference emits 2 + 1
    pytest.importorskip("llama_cpp")
    case = (False, 3, 2, [[0], [1], [2]], [0, 0, 0])
    rc, theirs = llamacpp_splits(tmp_path, *case)
    assert rc == 0 and theirs == [[0, 1, 2]]
    assert reference_splits(*case) == [[0, 1], [2]]


@pytest.mark.oracle
def test_coupled_sequences_without_unified_cache_give_rc_1(tmp_path):
    pytest.importorskip("llama_cpp")
    rc, theirs = llamacpp_splits(tmp_path, False, 2, 4, [[0, 1], [0]], [0, 1])
    assert rc == 1 and theirs == []
    a = allocr(Batch(token=[1, 2], pos=[0, 1], seq_id=[[0, 1], [0]]), n_seq_max=2)
    assert a.split_equal(4, sequential=True).n_tokens == 0 and a.n_used < a.n_tokens


# ---------------------------------------------------------------------------------------------
# One token: the scalar path is the array path
# ---------------------------------------------------------------------------------------------


@st.composite
def one_token_cases(draw):
    """A one-token batch, valid or not, and a memory that it may or may not continue: ids
    around the ranges' edges, duplicate and coupled seq ids, positions given or filled,
    sequences held up to the largest int32 position (filling past it overflows)."""
    n_seq_max = draw(st.sampled_from([1, 2, 3, 5, LLAMA_MAX_SEQ, LLAMA_MAX_SEQ + 1]))
    seq_ids = st.integers(-2, 6) | st.sampled_from([LLAMA_MAX_SEQ - 1, LLAMA_MAX_SEQ])
    seq_id = draw(st.none() | st.lists(seq_ids, min_size=1, max_size=4).map(lambda s: [s]))
    pos = draw(st.none() | st.integers(-3, 12).map(lambda p: [p]))
    ranges = {}
    for s in range(6):
        p_max = draw(st.integers(-1, 10) | st.just(2**31 - 1))
        if p_max >= 0:
            ranges[s] = (draw(st.integers(0, p_max)), p_max)
    memory = draw(st.none() | st.just(FakeMemory(ranges)))
    batch = Batch(token=[draw(st.integers(-2, N_VOCAB + 1))], pos=pos, seq_id=seq_id,
                  logits=draw(st.none() | st.booleans().map(lambda b: [b])))
    return batch, n_seq_max, memory


def outcome(fill, batch, n_seq_max, memory):
    """What ``fill`` makes of the batch: its four results, or its refusal's message."""
    try:
        seq_id, pos, seq_pos, seq_cpl = fill(batch, N_VOCAB, n_seq_max, memory)
    except BatchError as err:
        return str(err)
    return seq_id, pos.dtype, pos.tolist(), list(seq_pos.items()), seq_cpl


@given(one_token_cases())
def test_one_token_fields_are_the_array_rules(case):
    """``fill_fields_one_token`` refuses what ``fill_fields`` refuses, with its message, and
    fills what it fills; the whole allocator then agrees (the order rule, skipped for one
    token, has nothing to refuse there)."""
    batch, n_seq_max, memory = case
    scalar = outcome(B.fill_fields_one_token, batch, n_seq_max, memory)
    assert scalar == outcome(B.fill_fields, batch, n_seq_max, memory)

    def build():
        try:
            a = allocr(batch, n_seq_max=n_seq_max, memory=memory, n_batch=1)
        except BatchError as err:
            return str(err)
        return (a.batch.token.tolist(), a.batch.pos.tolist(), a.batch.seq_id,
                a.batch.logits.tolist(), a.n_outputs, list(a.seq_pos.items()), a.seq_cpl,
                a.seq_set, a.seq_set_map)

    with mock.patch.object(B, "fill_fields_one_token", B.fill_fields):
        arrays = build()
    assert build() == arrays
    if not isinstance(scalar, str):
        B.check_seq_order(scalar[0], np.array(scalar[2]))
