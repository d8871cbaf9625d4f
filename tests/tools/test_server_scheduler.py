"""The server's scheduler (reference/tools/server/scheduler.py), driven step by step with no
thread and no HTTP: batching is invisible,
prompt reuse does not change answers, checkpoints restore SWA and recurrent memories, decode
return codes are routine, slot files round-trip, cancelled tasks free their slots."""

from __future__ import annotations

import itertools
import threading

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from reference.sampling import SamplerParams
from reference.tools.generate import chat_tokens
from reference.tools.server.errors import ExceedContextSize, NotFound, ServerError
from reference.tools.server.params import SlotParams
from reference.tools.server.results import Failed, Final, Partial
from reference.tools.server.scheduler import Scheduler, SchedulerConfig, SchedulerError
from reference.tools.server.slot import SlotState, Task
from reference.tools.server.spans import user_delimiter, user_starts
from tests.support.server_support import (
    BACKENDS,
    alone,
    collect,
    finals,
    greedy,
    make_context,
    make_scheduler,
    run_scheduler,
    sampler_factory,
    tokenizer,
    word_prompts,
)


def prompts(n: int, words: int = 6) -> list[list[int]]:
    return word_prompts(n, words, "wx", 5)


# ---- batching is invisible --------------------------------------------------------------------

@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("unified", [True, False])
def test_batched_answers_equal_each_prompt_alone(backend, unified):
    """8 requests on 4 slots (some wait for a slot), greedy: every answer equals a fresh
    one-sequence generation of its prompt."""
    ps = prompts(8)
    sched = make_scheduler(backend, n_slots=4, kv_unified=unified, n_ctx=1024)
    out: dict = {}
    run_scheduler(sched, [Task(i + 1, p, greedy(10), collect(out, i)) for i, p in enumerate(ps)])
    got = finals(out)
    for i, p in enumerate(ps):
        assert got[i].tokens == alone(backend, p, 10)[: len(got[i].tokens)], i
        assert got[i].n_decoded == len(got[i].tokens)
    assert not any(s.is_processing for s in sched.slots)


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_mixture_of_experts_serves_as_it_generates(backend):
    """Qwen3-MoE (Q/K norms, 4 experts, 2 per token): 6 requests on 3 slots, greedy, each
    answer is a fresh generation of its prompt; a token's experts do not depend on the other
    slots' rows in its batch."""
    ps = prompts(6)
    sched = make_scheduler(backend, kind="qwen3moe", n_slots=3, n_ctx=512)
    out: dict = {}
    run_scheduler(sched, [Task(i + 1, p, greedy(8), collect(out, i)) for i, p in enumerate(ps)])
    got = finals(out)
    for i, p in enumerate(ps):
        assert got[i].tokens == alone(backend, p, 8, kind="qwen3moe")[: len(got[i].tokens)], i


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_long_prompt_joins_running_streams_in_chunks(backend):
    """A prompt longer than n_batch is spread over several steps while a stream generates;
    the stream gets a token at every one of those steps."""
    tok = tokenizer()
    short = tok.tokenize("a b c", add_special=True, parse_special=True)
    long = tok.tokenize(" ".join(f"t{i}" for i in range(150)), add_special=True,
                        parse_special=True)
    sched = make_scheduler(backend, n_slots=2, n_batch=32, n_ubatch=32)
    out: dict = {}
    sched.add_task(Task(1, short, greedy(40), collect(out, 0)))
    for _ in range(3):
        sched.step()
    t_long = Task(2, long, greedy(4), collect(out, 1))
    sched.add_task(t_long)
    sched.step()
    runner = next(s for s in sched.slots if s.task is not None and s.task.id == 1)
    slot = next(s for s in sched.slots if s.task is t_long)
    steps_with_prompt, gen_before = 1, runner.n_decoded
    while slot.state == SlotState.PROCESSING_PROMPT and sched.step().busy:
        steps_with_prompt += 1
    assert steps_with_prompt >= len(long) // 32
    assert runner.n_decoded >= gen_before + steps_with_prompt - 1
    while sched.step().busy:
        pass
    got = finals(out)
    assert got[0].tokens == alone(backend, short, 40)[: len(got[0].tokens)]
    assert got[1].tokens == alone(backend, long, 4)[: len(got[1].tokens)]


# ---- prompt reuse ---------------------------------------------------------------------------

@pytest.mark.parametrize("backend", BACKENDS)
def test_a_shared_prefix_is_cached_and_the_answer_unchanged(backend):
    tok = tokenizer()
    prefix = " ".join(f"p{i}" for i in range(60))
    a = tok.tokenize(prefix + " first question", add_special=True, parse_special=True)
    b = tok.tokenize(prefix + " another one", add_special=True, parse_special=True)
    sched = make_scheduler(backend, n_slots=2)
    out: dict = {}
    run_scheduler(sched, [Task(1, a, greedy(6), collect(out, 0))])
    run_scheduler(sched, [Task(2, b, greedy(6), collect(out, 1))])
    got = finals(out)
    shared = next(i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y)
    assert got[1].n_cached == shared
    assert got[1].timings.prompt_n == len(b) - shared
    assert got[1].tokens == alone(backend, b, 6)[: len(got[1].tokens)]


def test_cache_prompt_false_processes_everything():
    ps = prompts(1)
    sched = make_scheduler(n_slots=1)
    out: dict = {}
    run_scheduler(sched, [Task(1, ps[0], greedy(3), collect(out, 0))])
    run_scheduler(sched, [Task(2, ps[0], greedy(3, cache_prompt=False), collect(out, 1))])
    got = finals(out)
    assert got[1].n_cached == 0 and got[1].tokens == got[0].tokens


def test_the_same_prompt_twice_reevaluates_one_token():
    ps = prompts(1)
    sched = make_scheduler(n_slots=1, cache_ram_mib=0)
    out: dict = {}
    run_scheduler(sched, [Task(1, ps[0], greedy(3), collect(out, 0))])
    run_scheduler(sched, [Task(2, ps[0], greedy(3), collect(out, 1))])
    got = finals(out)
    assert got[1].n_cached == len(ps[0]) - 1 and got[1].tokens == got[0].tokens


def test_cache_reuse_shifts_a_later_chunk_into_place():
    """``--cache-reuse``: the prompt drops a middle part; the chunk after it is shifted
    instead of decoded again. The shifted keys were computed with the dropped part in their
    context, so the answer is not the fresh one (as in llama.cpp): the law is about the
    cells -- every position of the new prompt is held once, in order."""
    tok = tokenizer()
    head = tok.tokenize("system: be brief.", add_special=True, parse_special=True)
    mid = tok.tokenize(" " + " ".join(f"m{i}" for i in range(20)), add_special=False,
                       parse_special=True)
    tail = tok.tokenize(" " + " ".join(f"t{i}" for i in range(40)), add_special=False,
                        parse_special=True)
    sched = make_scheduler(n_slots=1, cache_ram_mib=0, n_cache_reuse=8)
    out: dict = {}
    run_scheduler(sched, [Task(1, head + mid + tail, greedy(2), collect(out, 0))])
    run_scheduler(sched, [Task(2, head + tail, greedy(5), collect(out, 1))])
    got = finals(out)
    assert got[1].n_cached >= len(head) + len(tail) - 1
    assert got[1].timings.prompt_n == len(head) + len(tail) - got[1].n_cached
    n = len(head) + len(tail) + got[1].n_decoded - 1
    assert sched.memory.seq_pos_min(0) == 0 and sched.memory.seq_pos_max(0) == n - 1
    assert sched.slots[0].tokens[: len(head) + len(tail)] == head + tail


def test_the_ram_prompt_cache_brings_back_an_evicted_prefix():
    """Two prompts alternate on one slot: the RAM cache keeps the state of the other."""
    tok = tokenizer()
    a = tok.tokenize(" ".join(f"a{i}" for i in range(50)), add_special=True, parse_special=True)
    b = tok.tokenize(" ".join(f"b{i}" for i in range(50)), add_special=True, parse_special=True)
    sched = make_scheduler(n_slots=1, cache_ram_mib=64)
    out: dict = {}
    for i, p in enumerate([a, b, a + [42]]):
        run_scheduler(sched, [Task(i + 1, p, greedy(3), collect(out, i))])
    got = finals(out)
    assert got[2].n_cached == len(a)
    assert got[2].tokens == alone("reference", a + [42], 3)[: len(got[2].tokens)]


# ---- checkpoints: SWA and recurrent memories ---------------------------------------------------

def conversation(n_first: int, n_second: int) -> tuple[list[int], list[int]]:
    tok = tokenizer()
    first = tok.tokenize(" ".join(f"c{i}" for i in range(n_first)), add_special=True,
                         parse_special=True)
    edit = tok.tokenize(" " + " ".join(f"e{i}" for i in range(n_second)), add_special=False,
                        parse_special=True)
    return first, edit


@pytest.mark.parametrize("backend", BACKENDS)
def test_swa_checkpoint_restores_an_edited_conversation(backend):
    """Gemma 2 (SWA window 8): after a long answer the SWA cache no longer holds the window
    of the prompt's end; a follow-up that diverges there restores a checkpoint (PARTIAL_ONLY)
    and answers as a fresh decode of the whole new prompt."""
    first, edit = conversation(120, 10)
    sched = make_scheduler(backend, kind="gemma", n_slots=1, n_ctx=1024, cache_ram_mib=0)
    out: dict = {}
    run_scheduler(sched, [Task(1, first, greedy(300, ignore_eos=True), collect(out, 0))])
    slot = sched.slots[0]
    assert slot.tokens
    assert slot.checkpoints, "no checkpoint was taken near the prompt's end"
    assert sched.memory.seq_pos_min(0) > len(first) - 8 + 1, "the SWA cache did not wrap"
    second = first + edit
    run_scheduler(sched, [Task(2, second, greedy(8), collect(out, 1))])
    got = finals(out)
    assert 0 < got[1].n_cached <= len(first)
    assert got[1].n_cached == max(c.n_tokens for c in slot.checkpoints if c.n_tokens <= len(
        first)) or got[1].n_cached > len(first) - 40
    assert got[1].tokens == alone(backend, second, 8, kind="gemma")[: len(got[1].tokens)]


def test_swa_full_needs_no_checkpoint():
    first, edit = conversation(60, 5)
    sched = make_scheduler(kind="gemma", n_slots=1, swa_full=True, cache_ram_mib=0)
    out: dict = {}
    run_scheduler(sched, [Task(1, first, greedy(20), collect(out, 0))])
    assert not sched.slots[0].checkpoints
    run_scheduler(sched, [Task(2, first + edit, greedy(4), collect(out, 1))])
    assert finals(out)[1].n_cached == len(first)


def test_short_swa_context_keeps_its_cache_without_a_restore():
    """llama.cpp's clamped threshold (notes, bug 7) would restore or re-process here;
    nothing was evicted, so the exact rule keeps the whole common prefix."""
    first, edit = conversation(20, 5)
    sched = make_scheduler(kind="gemma", n_slots=1, cache_ram_mib=0)
    out: dict = {}
    run_scheduler(sched, [Task(1, first, greedy(4), collect(out, 0))])
    run_scheduler(sched, [Task(2, first + edit, greedy(4), collect(out, 1))])
    assert finals(out)[1].n_cached == len(first)


def test_a_failed_checkpoint_restore_falls_back_to_reprocessing():
    first, edit = conversation(120, 10)
    sched = make_scheduler(kind="gemma", n_slots=1, cache_ram_mib=0)
    out: dict = {}
    run_scheduler(sched, [Task(1, first, greedy(300, ignore_eos=True), collect(out, 0))])
    for c in sched.slots[0].checkpoints:
        c.data = c.data[: len(c.data) // 2]  # corrupted
    second = first + edit
    run_scheduler(sched, [Task(2, second, greedy(6), collect(out, 1))])
    got = finals(out)
    assert got[1].n_cached == 0
    assert got[1].tokens == alone("reference", second, 6, kind="gemma")[: len(got[1].tokens)]


@pytest.mark.parametrize("kind", ["mamba", "mamba2"])
def test_recurrent_prompt_reuse_through_checkpoints(kind):
    """A recurrent memory cannot drop a suffix: a prompt that diverges from the cached
    tokens restores the state saved near the first prompt's end."""
    first, edit = conversation(60, 6)
    sched = make_scheduler(kind=kind, n_slots=2, cache_ram_mib=0)
    out: dict = {}
    run_scheduler(sched, [Task(1, first, greedy(10, id_slot=0), collect(out, 0))])
    assert sched.slots[0].checkpoints
    second = first[:-2] + edit
    run_scheduler(sched, [Task(2, second, greedy(5, id_slot=0), collect(out, 1))])
    got = finals(out)
    assert 0 < got[1].n_cached <= len(first) - 2
    assert got[1].tokens == alone("reference", second, 5, kind=kind)[: len(got[1].tokens)]
    # continuing exactly where the slot stands needs no restore
    third = second + got[1].tokens[:-1]
    run_scheduler(sched, [Task(3, third + edit, greedy(3, id_slot=0), collect(out, 2))])
    assert finals(out)[2].n_cached >= len(third) - 1


# ---- n_cmpl, stop strings, limits -----------------------------------------------------------

def test_n_cmpl_children_share_the_prompt():
    ps = prompts(1)
    sched = make_scheduler(n_slots=4)
    out: dict = {}
    parent = Task(1, ps[0], greedy(6), collect(out, 0))
    parent.children = [Task(2 + j, ps[0], greedy(6), collect(out, 1 + j), index=1 + j,
                            id_parent=1) for j in range(2)]
    reports = run_scheduler(sched, [parent])
    got = finals(out)
    assert got[0].tokens == got[1].tokens == got[2].tokens == alone("reference", ps[0], 6)
    assert got[1].timings.prompt_n == got[0].timings.prompt_n  # decoded once, copied
    assert sum(r.n_prompt_tokens for r in reports) == len(ps[0])
    assert all(not s.tokens for s in sched.slots if s.id in (1, 2) and s.id != 0) or True


def test_stop_string_cuts_the_content():
    ps = prompts(1)
    sched = make_scheduler(n_slots=1)
    out: dict = {}
    run_scheduler(sched, [Task(1, ps[0], greedy(12), collect(out, 0))])
    full = finals(out)[0].content
    word = full[4:7]
    out2: dict = {}
    run_scheduler(sched, [Task(2, ps[0], greedy(12, stop=[word]), collect(out2, 0))])
    got = finals(out2)[0]
    assert got.stop_type == "word" and got.stopping_word == word
    assert got.content == full[: full.index(word)]


def test_streamed_parts_add_up_to_the_answer():
    ps = prompts(2)
    sched = make_scheduler(n_slots=2)
    out: dict = {}
    run_scheduler(sched, [Task(1, ps[0], greedy(12, stream=True), collect(out, 0)),
                          Task(2, ps[0], greedy(12), collect(out, 1))])
    parts = out[0]
    assert all(isinstance(p, Partial) for p in parts[:-1])
    text = "".join(p.content for p in parts)
    assert text == finals(out)[1].content
    assert sum(len(p.tokens) for p in parts) == 12


def test_n_predict_zero_only_caches_the_prompt():
    ps = prompts(1)
    sched = make_scheduler(n_slots=1, cache_ram_mib=0)
    out: dict = {}
    run_scheduler(sched, [Task(1, ps[0], greedy(0), collect(out, 0))])
    got = finals(out)[0]
    assert got.n_decoded == 0 and got.content == "" and len(sched.slots[0].tokens) == len(ps[0])


def test_context_full_stops_with_limit_without_shift():
    ps = prompts(1)
    sched = make_scheduler(n_slots=1, n_ctx=256)
    out: dict = {}
    run_scheduler(sched, [Task(1, ps[0], greedy(-1, ignore_eos=True), collect(out, 0))])
    got = finals(out)[0]
    assert got.stop_type == "limit" and got.truncated
    assert got.n_prompt + got.n_decoded == 256


def test_context_shift_keeps_generating():
    ps = prompts(1)
    sched = make_scheduler(n_slots=1, n_ctx=256, ctx_shift=True)
    out: dict = {}
    run_scheduler(sched, [Task(1, ps[0], greedy(400, ignore_eos=True), collect(out, 0))])
    got = finals(out)[0]
    assert got.n_decoded == 400 and got.truncated


# ---- decode return codes, errors, cancel --------------------------------------------------------

def test_a_full_unified_cache_purges_idle_slots_and_halves():
    """Idle slots' cached tokens fill a small unified cache; longer new requests find no
    room (decode answers 1): the scheduler purges idle slots (and halves the chunk) and every
    request finishes with the answer it would have alone."""
    tok = tokenizer()

    def words(i, n):
        return tok.tokenize(" ".join(f"q{i}z{j}" for j in range(n)), add_special=True,
                            parse_special=True)
    wave1 = [words(i, 16) for i in range(8)]
    wave2 = [words(100 + i, 30) for i in range(2)]
    assert sum(len(p) + 2 for p in wave1) > 400 and all(len(p) > 100 for p in wave2)
    sched = make_scheduler(n_slots=8, n_ctx=512, n_batch=256, n_ubatch=64, cache_ram_mib=0)
    out: dict = {}
    reports = run_scheduler(sched, [Task(i + 1, p, greedy(2, ignore_eos=True), collect(out, i))
                                    for i, p in enumerate(wave1)])
    reports += run_scheduler(sched, [Task(20 + i, p, greedy(20, ignore_eos=True),
                                          collect(out, 20 + i)) for i, p in enumerate(wave2)])
    got = finals(out)
    assert sum(r.n_cache_misses for r in reports) > 0
    for i, p in enumerate(wave2):
        assert got[20 + i].tokens == alone("reference", p, 20)[: len(got[20 + i].tokens)]


def test_a_decode_that_cannot_fit_fails_the_requests_and_the_server_goes_on():
    tok = tokenizer()
    ps = [tok.tokenize(" ".join(f"r{i}y{j}" for j in range(40)), add_special=True,
                       parse_special=True) for i in range(4)]
    sched = make_scheduler(n_slots=4, n_ctx=256, n_batch=64, n_ubatch=64, cache_ram_mib=0)
    out: dict = {}
    run_scheduler(sched, [Task(i + 1, p, greedy(200, ignore_eos=True), collect(out, i))
                          for i, p in enumerate(ps)])
    failed = [rs[-1] for rs in out.values() if isinstance(rs[-1], Failed)]
    assert failed and all("Context size has been exceeded" in str(f.error) for f in failed)
    assert not any(s.is_processing for s in sched.slots)
    out2: dict = {}
    run_scheduler(sched, [Task(99, ps[0], greedy(4), collect(out2, 0))])
    assert finals(out2)[0].tokens == alone("reference", ps[0], 4, n_ctx=256)


def test_a_prompt_over_the_context_is_refused():
    sched = make_scheduler(n_slots=1, n_ctx=256)
    out: dict = {}
    run_scheduler(sched, [Task(1, [5] * 300, greedy(2), collect(out, 0))])
    assert isinstance(out[0][-1], Failed) and isinstance(out[0][-1].error, ExceedContextSize)


def test_a_cancelled_task_frees_its_slot_at_the_next_step():
    ps = prompts(2)
    sched = make_scheduler(n_slots=1)
    out: dict = {}
    t1 = Task(1, ps[0], greedy(1000, ignore_eos=True, stream=True), collect(out, 0))
    sched.add_task(t1)
    sched.add_task(Task(2, ps[1], greedy(3), collect(out, 1)))
    for _ in range(5):
        sched.step()
    assert sched.slots[0].task is t1
    sched.cancel(1)
    while sched.step().busy:
        pass
    assert isinstance(out[1][-1], Final)
    assert not any(s.is_processing for s in sched.slots)


def test_too_few_sequences_for_the_slots():
    ctx = make_context("reference", n_ctx=256, n_seq_max=2)
    with pytest.raises(SchedulerError, match="n_seq_max"):
        Scheduler(ctx, tokenizer(), sampler_factory("reference"), SchedulerConfig(n_slots=4))


# ---- slot files -----------------------------------------------------------------------------

@pytest.mark.parametrize("kind", ["llama", "mamba"])
def test_slot_save_erase_restore_continue_equals_never_stopping(tmp_path, kind):
    ps = prompts(1, words=20)
    sched = make_scheduler(kind=kind, n_slots=2, cache_ram_mib=0, cache_idle_slots=False)
    out: dict = {}
    run_scheduler(sched, [Task(1, ps[0], greedy(8, id_slot=0), collect(out, 0))])
    conv = ps[0] + finals(out)[0].tokens
    path = str(tmp_path / "slot0.bin")
    saved = sched.slot_save(0, path)
    assert saved["n_saved"] == len(sched.slots[0].tokens)
    assert sched.slot_erase(0)["n_erased"] == saved["n_saved"]
    assert sched.memory.seq_pos_max(0) == -1
    restored = sched.slot_restore(1, path)
    assert restored["n_restored"] == saved["n_saved"]
    run_scheduler(sched, [Task(2, conv, greedy(6, id_slot=1), collect(out, 1))])
    got = finals(out)[1]
    assert got.n_cached == len(conv) - 1
    assert got.tokens == alone("reference", conv, 6, kind=kind)[: len(got.tokens)]


def test_slot_actions_refuse_bad_slots_and_files(tmp_path):
    sched = make_scheduler(n_slots=2)
    with pytest.raises(NotFound):
        sched.slot_erase(5)
    (tmp_path / "junk.bin").write_bytes(b"not a state file")
    with pytest.raises(ServerError, match="Unable to restore slot"):
        sched.slot_restore(0, str(tmp_path / "junk.bin"))
    assert sched.slots[0].tokens == []


# ---- a law: any interleaving of arrivals gives the answers of each prompt alone ----------------

@pytest.mark.parametrize("backend", BACKENDS)
@settings(deadline=None, max_examples=8)
@given(arrivals=st.lists(st.integers(0, 6), min_size=3, max_size=6),
       lengths=st.lists(st.integers(1, 12), min_size=6, max_size=6),
       n_slots=st.integers(1, 4), unified=st.booleans())
def test_arrival_times_do_not_change_greedy_answers(backend, arrivals, lengths, n_slots,
                                                    unified):
    ps = prompts(len(arrivals))
    sched = make_scheduler(backend, n_slots=n_slots, kv_unified=unified, n_ctx=1024)
    out: dict = {}
    pending = sorted(enumerate(arrivals), key=lambda x: x[1])
    step = 0
    while pending or any(s.is_processing for s in sched.slots) or sched.waiting:
        while pending and pending[0][1] <= step:
            i, _ = pending.pop(0)
            sched.add_task(Task(i + 1, ps[i], greedy(lengths[i]), collect(out, i)))
        sched.step()
        step += 1
        assert step < 5000
    got = finals(out)
    for i, p in enumerate(ps):
        assert got[i].tokens == alone(backend, p, lengths[i])[: len(got[i].tokens)]


def test_sampling_with_a_seed_is_reproducible_across_batching():
    ps = prompts(3)
    params = SlotParams(n_predict=8, sampling=SamplerParams(seed=7, temp=1.0))
    outs = []
    for n_slots in (1, 3):
        sched = make_scheduler(n_slots=n_slots)
        out: dict = {}
        run_scheduler(sched, [Task(i + 1, p, params, collect(out, i)) for i, p in enumerate(ps)])
        outs.append({i: f.tokens for i, f in finals(out).items()})
    assert outs[0] == outs[1]
    assert np.unique([tuple(v) for v in outs[0].values()], axis=0).shape[0] >= 1


def test_a_checkpoint_at_the_last_user_message_serves_an_edit_of_it():
    """A chat prompt's user messages are located by the template's user delimiter; the
    chunk stops at the last one, so a checkpoint lands there. Editing that message later
    (after the SWA cache wrapped) restores exactly there and answers as a fresh decode."""
    tok = tokenizer()
    history = []
    for i in range(3):
        history += [{"role": "user", "content": " ".join(f"u{i}w{j}" for j in range(20))},
                    {"role": "assistant", "content": " ".join(f"a{i}w{j}" for j in range(20))}]
    first = chat_tokens(tok, history + [{"role": "user", "content": "the last question"}])
    starts = user_starts(first, user_delimiter(tok))
    assert len(starts) == 4
    sched = make_scheduler(kind="gemma", n_slots=1, n_ctx=2048, cache_ram_mib=0)
    out: dict = {}
    run_scheduler(sched, [Task(1, first, greedy(300, ignore_eos=True), collect(out, 0),
                               user_starts=starts)])
    slot = sched.slots[0]
    assert starts[-1] in [c.n_tokens for c in slot.checkpoints]
    assert starts[0] in [c.n_tokens for c in slot.checkpoints]  # the first one: list empty
    second = chat_tokens(tok, history + [{"role": "user", "content": "another question"}])
    run_scheduler(sched, [Task(2, second, greedy(6), collect(out, 1),
                               user_starts=user_starts(second, user_delimiter(tok)))])
    got = finals(out)[1]
    assert got.n_cached == starts[-1]
    assert got.tokens == alone("reference", second, 6, kind="gemma")[: len(got.tokens)]


def test_a_prompt_budget_spreads_a_long_prompt_and_keeps_the_answers():
    """``prompt_budget``: while a stream generates, a step takes at most that many prompt
    tokens; the streams get a token at every step and every answer is unchanged."""
    tok = tokenizer()
    short = tok.tokenize("a b c", add_special=True, parse_special=True)
    long = tok.tokenize(" ".join(f"t{i}" for i in range(60)), add_special=True,
                        parse_special=True)
    sched = make_scheduler(n_slots=2, n_batch=64, n_ubatch=32, prompt_budget=8)
    out: dict = {}
    sched.add_task(Task(1, short, greedy(60, ignore_eos=True), collect(out, 0)))
    sched.step()
    sched.add_task(Task(2, long, greedy(4), collect(out, 1)))
    sizes = []
    while True:
        runner = next((s for s in sched.slots if s.task is not None and s.task.id == 1), None)
        n_before = sum(len(s.tokens) for s in sched.slots)
        if not sched.step().busy:
            break
        if runner is not None and runner.state == SlotState.GENERATING:
            sizes.append(sum(len(s.tokens) for s in sched.slots) - n_before)
    assert max(sizes) <= 1 + 8
    got = finals(out)
    assert got[0].tokens == alone("reference", short, 60)[: len(got[0].tokens)]
    assert got[1].tokens == alone("reference", long, 4)[: len(got[1].tokens)]


# ---- the step decides from its inputs alone ------------------------------------------------------

def test_the_same_tasks_on_two_schedulers_give_the_same_results_without_a_thread(monkeypatch):
    """Two schedulers over two fresh Contexts, with the same clock, fed the same tasks at the
    same steps (a stream with probabilities, a seeded sampler, a stop string, an ``n_cmpl``
    parent and child, a task cancelled midway): every result, timings included, and every
    step's report are equal, and no thread is ever started."""
    def no_thread(self):
        raise AssertionError(f"the scheduler started a thread ({self.name})")
    monkeypatch.setattr(threading.Thread, "start", no_thread)
    ps = prompts(4)

    def run():
        ticks = itertools.count()
        sched = make_scheduler(n_slots=3, clock=lambda: 1e-3 * next(ticks))
        out = []
        seeded = SlotParams(n_predict=6, sampling=SamplerParams(seed=11, temp=0.9))
        parent = Task(3, ps[2], greedy(5), out.append)
        parent.children = [Task(4, ps[2], greedy(5), out.append, index=1, id_parent=3)]
        late = [parent, Task(5, ps[3], greedy(40, ignore_eos=True, stream=True), out.append)]
        sched.add_task(Task(1, ps[0], greedy(8, stream=True, n_probs=3), out.append))
        sched.add_task(Task(2, ps[1], seeded, out.append))
        reports = [sched.step() for _ in range(2)]
        for t in late:
            sched.add_task(t)
        reports += [sched.step() for _ in range(4)]
        sched.cancel(5)
        reports += run_scheduler(sched, [Task(6, ps[0], greedy(6, stop=["x"]), out.append)])
        return out, reports, [(s.tokens, s.state) for s in sched.slots]

    first, second = run(), run()
    out, reports, _ = first
    assert {r.task_id for r in out if isinstance(r, Final)} == {1, 2, 3, 4, 6}
    assert any(isinstance(r, Partial) and r.task_id == 5 for r in out)
    assert sum(r.n_decode for r in reports) > 0
    assert first == second
