"""Context (llama_context): sizes, decode's return codes and atomicity, outputs, abort,
context_shift's contract, on the reference and the tiny Llama (the laws of the return codes
over every Context and model: ``tests/laws/test_decode.py``)."""

from __future__ import annotations

import copy

import numpy as np
import pytest

from reference.batch import Batch
from reference.context import Context, ContextError, context_shift, context_sizes
from reference.memory import KVCache, KVCacheError
from tests.support.helpers import assert_same, snapshot
from tests.support.tiny_models import random_weights, tiny_hparams

HP = tiny_hparams(n_layer=2, n_ctx_train=4096)
W = random_weights(HP, seed=3)
RNG = np.random.default_rng(0)
PROMPT = RNG.integers(0, HP.n_vocab, 40).tolist()


def make(**kwargs) -> Context:
    kwargs = dict(dict(n_ctx=256, n_batch=256, n_ubatch=256), **kwargs)
    return Context(HP, W, **kwargs)


# ---- sizes ----------------------------------------------------------------------------------


def test_defaults_are_llamacpps():
    ctx = Context(HP, W)
    assert (ctx.n_ctx, ctx.n_batch, ctx.n_ubatch, ctx.n_seq_max) == (512, 512, 512, 1)
    assert isinstance(ctx.memory, KVCache) and ctx.get_memory() is ctx.memory
    assert ctx.memory.get_size() == 512 and ctx.memory.get_n_stream() == 1


@pytest.mark.parametrize(
    "args, expected",
    [
        ((0, 2048, 512, 1, True), dict(n_ctx=4096, n_batch=2048, n_ubatch=512)),  # n_ctx_train
        ((100, 2048, 0, 1, True), dict(n_ctx=256, n_batch=100, n_ubatch=100)),
        ((300, 64, 128, 1, True), dict(n_ctx=512, n_batch=64, n_ubatch=64)),
        ((256, 512, 512, 0, True), dict(n_seq_max=1)),
        ((600, 512, 512, 3, False), dict(n_ctx=768, n_ctx_seq=256)),
    ],
)
def test_context_sizes_follow_llama_context(args, expected):
    sizes = context_sizes(*args, n_ctx_train=4096)
    assert {k: sizes[k] for k in expected} == expected


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(n_ctx=-1), "n_ctx"),
        (dict(n_batch=0), "n_batch"),
        (dict(n_ubatch=-3), "n_ubatch"),
        (dict(n_seq_max=257), "LLAMA_MAX_SEQ"),
        (dict(n_seq_max=1.5), "n_seq_max"),
    ],
)
def test_bad_sizes_raise_context_error(kwargs, match):
    with pytest.raises(ContextError, match=match):
        make(**kwargs)


# ---- return codes ---------------------------------------------------------------------------


def test_decode_ok_appends_the_batch_and_outputs_in_batch_order():
    ctx = make(n_seq_max=2, n_ubatch=3)
    b = Batch(token=PROMPT[:6], seq_id=[[0], [1], [0], [1], [0], [1]],
              logits=[True, False, True, True, False, True])
    assert ctx.decode(b) == 0
    assert ctx.memory.seq_pos_max(0) == 2 and ctx.memory.seq_pos_max(1) == 2
    assert ctx.get_logits().shape == (4, HP.n_vocab) and ctx.n_outputs == 4
    for row, i in enumerate([0, 2, 3, 5]):
        np.testing.assert_array_equal(ctx.get_logits()[row], ctx.get_logits_ith(i))
    np.testing.assert_array_equal(ctx.get_logits_ith(-1), ctx.get_logits_ith(5))
    np.testing.assert_array_equal(ctx.get_logits_ith(-4), ctx.get_logits_ith(0))


def test_no_slot_returns_1_restores_the_cells_and_keeps_the_outputs():
    ctx = make(n_ubatch=32)
    prompt = RNG.integers(0, HP.n_vocab, 200).tolist()
    assert ctx.decode(Batch(token=prompt)) == 0
    before = snapshot(ctx)
    assert ctx.decode(Batch(token=prompt[:100])) == 1  # 56 cells left: the 4th ubatch fails
    assert_same(before, snapshot(ctx))
    assert ctx.decode(Batch(token=PROMPT[:5], logits=[True] * 5)) == 0
    straight = make(n_ubatch=32)
    straight.decode(Batch(token=prompt))
    straight.decode(Batch(token=PROMPT[:5], logits=[True] * 5))
    np.testing.assert_array_equal(ctx.get_logits(), straight.get_logits())


@pytest.mark.parametrize("n_ubatch", [1, 3, 256])
def test_decoding_embeddings_equals_decoding_their_tokens(n_ubatch):
    """A batch of embeddings is a batch of tokens whose get_rows was done by the caller."""
    tokens = np.array(PROMPT[:9])
    by_tokens, by_embd = make(n_ubatch=n_ubatch), make(n_ubatch=n_ubatch)
    logits = [True] * len(tokens)
    assert by_tokens.decode(Batch(token=tokens, logits=logits)) == 0
    embd = W["token_embd.weight"][tokens]  # (n_tokens, n_embd)
    assert by_embd.decode(Batch(embd=embd, logits=logits)) == 0
    np.testing.assert_array_equal(by_embd.get_logits(), by_tokens.get_logits())
    # and the two kinds of batch continue the same memory
    assert by_embd.decode(Batch(token=[PROMPT[9]])) == by_tokens.decode(Batch(embd=W[
        "token_embd.weight"][[PROMPT[9]]])) == 0
    np.testing.assert_array_equal(by_embd.get_logits(), by_tokens.get_logits())


def test_embeddings_of_the_wrong_width_are_an_invalid_batch():
    ctx = make()
    before = snapshot(ctx)
    assert ctx.decode(Batch(embd=np.zeros((2, HP.n_embd + 1)))) == -1
    assert "embd row width" in ctx.last_error
    assert_same(snapshot(ctx), before)


# ---- abort ----------------------------------------------------------------------------------


@pytest.mark.parametrize("n_done", [0, 1, 3])
def test_abort_keeps_the_computed_ubatches_and_removes_the_aborted_one(n_done):
    calls = []

    def abort():
        calls.append(1)
        return len(calls) > n_done

    ctx = make(n_seq_max=2, n_ubatch=4, abort_callback=abort)
    tokens = PROMPT[:20]
    seq_id = [[i % 2] for i in range(20)]  # ubatches of 4: 2 tokens of each sequence
    assert ctx.decode(Batch(token=tokens, seq_id=seq_id, logits=[True] * 20)) == 2
    assert len(calls) == n_done + 1
    assert ctx.n_outputs == 0 and ctx.get_logits().shape == (0, HP.n_vocab)
    with pytest.raises(ContextError, match="no logits"):
        ctx.get_logits_ith(-1)
    for s in (0, 1):
        n = 2 * n_done
        assert (ctx.memory.seq_pos_min(s), ctx.memory.seq_pos_max(s)) == ((0, n - 1) if n else
                                                                            (-1, -1))
    used = sum(c.get_used() for c in ctx.memory.v_cells)
    assert used == 4 * n_done  # no cell of the aborted ubatch is left
    # the kept ubatches are what a decode of those tokens alone would have left
    ctx.abort_callback = None
    cont = [[0], [1]]
    assert ctx.decode(Batch(token=[7, 8], seq_id=cont, logits=[True, True])) == 0
    ref = make(n_seq_max=2)
    if n_done:
        ref.decode(Batch(token=tokens[:4 * n_done], seq_id=seq_id[:4 * n_done]))
    ref.decode(Batch(token=[7, 8], seq_id=cont, logits=[True, True]))
    np.testing.assert_allclose(ctx.get_logits(), ref.get_logits(), rtol=1e-5, atol=1e-5)


def test_abort_cleans_every_sequence_of_a_shared_token():
    """llama.cpp removes only ``seq_id[i][0]`` of the aborted tokens; we remove all of them."""
    ctx = make(n_seq_max=2, abort_callback=lambda: True)
    assert ctx.decode(Batch(token=[1, 2], seq_id=[[0, 1], [0, 1]])) == 2
    assert [ctx.memory.seq_pos_max(s) for s in (0, 1)] == [-1, -1]
    assert ctx.memory.v_cells[0].get_used() == 0


# ---- outputs --------------------------------------------------------------------------------


def test_get_logits_ith_errors_say_why():
    ctx = make()
    with pytest.raises(ContextError, match="no logits"):
        ctx.get_logits_ith(0)
    assert ctx.decode(Batch(token=[1, 2, 3], logits=[False, True, False])) == 0
    with pytest.raises(ContextError, match=r"batch.logits\[0\] != true"):
        ctx.get_logits_ith(0)
    with pytest.raises(ContextError, match=r"out of range \[0, 3\)"):
        ctx.get_logits_ith(3)
    with pytest.raises(ContextError, match="negative index"):
        ctx.get_logits_ith(-2)
    np.testing.assert_array_equal(ctx.get_logits_ith(-1), ctx.get_logits_ith(1))
    with pytest.raises(ValueError):
        ctx.get_logits()[0, 0] = 1.0  # read-only


def test_outputs_survive_failed_decodes_and_are_replaced_by_the_next_success():
    ctx = make()
    assert ctx.decode(Batch(token=[1, 2, 3], logits=[True, True, False])) == 0
    first = ctx.get_logits().copy()
    assert ctx.decode(Batch(token=[1], pos=[9])) == -1
    np.testing.assert_array_equal(ctx.get_logits(), first)
    assert ctx.decode(Batch(token=[4], logits=[False])) == 0  # no output at all
    assert ctx.n_outputs == 0
    with pytest.raises(ContextError, match="no logits"):
        ctx.get_logits_ith(-1)


def test_float64_context_computes_in_float64():
    ctx = make(dtype=np.float64)
    assert ctx.decode(Batch(token=[1, 2])) == 0
    assert ctx.get_logits().dtype == np.float64 and ctx.memory.k_l[0].dtype == np.float64


# ---- context_shift --------------------------------------------------------------------------


def test_context_shift_is_seq_rm_then_seq_add():
    a, b = make(), make()
    for ctx in (a, b):
        ctx.decode(Batch(token=PROMPT[:30]))
    context_shift(a, 0, n_keep=4, n_discard=10)
    b.memory.seq_rm(0, 4, 14)
    b.memory.seq_add(0, 14, -1, -10)
    assert_same(snapshot(a), snapshot(b))
    assert (a.memory.seq_pos_min(0), a.memory.seq_pos_max(0)) == (0, 19)


@pytest.mark.parametrize(
    "args, error",
    [
        ((-1, 2, 3), ContextError),
        ((0, -1, 3), ContextError),
        ((0, 2, 0), ContextError),
        ((1, 2, 3), KVCacheError),  # per-stream memory of one sequence: seq ids < 1
    ],
)
def test_context_shift_refuses_bad_arguments_before_any_change(args, error):
    ctx = make(kv_unified=False)
    ctx.decode(Batch(token=PROMPT[:10]))
    before = snapshot(ctx)
    with pytest.raises(error):
        context_shift(ctx.memory, *args)
    assert_same(before, snapshot(ctx))


def test_context_shift_refuses_a_memory_that_cannot_shift():
    ctx = make()
    mem = copy.copy(ctx.memory)
    mem.can_shift = lambda: False
    with pytest.raises(ContextError, match="can_shift"):
        context_shift(mem, 0, 1, 1)


# ---- state (thin methods over reference/memory/state.py) ------------------------------------


def test_state_save_clear_restore_continue_equals_uninterrupted(tmp_path):
    ctx = make(n_seq_max=2)
    ctx.decode(Batch(token=PROMPT[:12], logits=[True] * 12))
    blob, seq_blob = ctx.state_get_data(), ctx.state_seq_get_data(0)
    ctx.state_save_file(tmp_path / "s.bin", PROMPT[:12])
    outputs = ctx.get_logits().copy()
    ctx.decode(Batch(token=PROMPT[12:16], logits=[True] * 4))
    straight = ctx.get_logits().copy()

    ctx.memory.clear()
    assert ctx.state_set_data(blob) == len(blob)
    np.testing.assert_array_equal(ctx.get_logits(), outputs)  # the outputs come back too
    np.testing.assert_array_equal(ctx.get_logits_ith(11), outputs[11])
    assert ctx.state_get_data() == blob
    ctx.decode(Batch(token=PROMPT[12:16], logits=[True] * 4))
    np.testing.assert_array_equal(ctx.get_logits(), straight)

    ctx.memory.clear()
    assert ctx.state_seq_set_data(seq_blob, 1) == len(seq_blob)
    assert (ctx.memory.seq_pos_max(0), ctx.memory.seq_pos_max(1)) == (-1, 11)
    ctx.decode(Batch(token=PROMPT[12:16], seq_id=[[1]] * 4, logits=[True] * 4))
    np.testing.assert_array_equal(ctx.get_logits(), straight)

    ctx.memory.clear()
    assert ctx.state_load_file(tmp_path / "s.bin").tolist() == PROMPT[:12]
    assert ctx.memory.seq_pos_max(0) == 11
