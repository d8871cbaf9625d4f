"""Batches: cases that mutation testing showed the laws of tests/laws/test_batch.py leave open.

The laws (every split partitions the batch, tails stay together, ...) hold for several
splittings; these pin the one ``llama_batch_allocr::split_equal`` makes when ``n_keep_tail``
sits exactly on one of its comparisons (``src/llama-batch.cpp``: ``remaining < n_keep_tail``,
``idxs.size() + n_remaining(0) <= n_ubatch``, ``while (n_remaining(0) < n_keep_tail)``).
"""

from __future__ import annotations

import pytest

from reference.batch import Batch, BatchAllocr


def allocr(seq_id: list[list[int]]) -> BatchAllocr:
    return BatchAllocr(Batch(token=[1] * len(seq_id), seq_id=seq_id), n_vocab=8, n_seq_max=4)


def drain(balloc: BatchAllocr, n_ubatch: int, n_keep_tail: int) -> list[list[int]]:
    out = []
    while (u := balloc.split_equal(n_ubatch, True, n_keep_tail)).n_tokens:
        out.append(u.idx.tolist())
    return out


def test_seq_pos_of_a_sequence_not_in_the_batch_is_minus_one():
    balloc = allocr([[0], [0], [2]])
    assert [balloc.seq_pos_min(s) for s in range(4)] == [0, -1, 0, -1]
    assert [balloc.seq_pos_max(s) for s in range(4)] == [1, -1, 0, -1]


def test_keep_tail_needs_n_ubatch_above_it():
    """``GGML_ASSERT(n_ubatch > n_keep_tail)``: equal is refused."""
    with pytest.raises(ValueError, match="n_ubatch = 2 must exceed n_keep_tail = 2"):
        allocr([[0], [0], [0]]).split_equal(2, True, 2)


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
    assert drain(allocr(seq_id), n_ubatch, n_keep_tail) == ubatches
