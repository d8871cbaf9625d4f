"""The server's runtime (llamaref/server/engine.py): the thread that drives the scheduler, its
inbox and the 503 rule, cancellations and jobs between steps, a step that raises, the
``/metrics`` counters and the ``/slots`` view; and llamaref/server/errors.py, the HTTP
status and body of each error type."""

from __future__ import annotations

import functools
import queue
import threading

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from llamaref.server.engine import Engine, Metrics, slots_json
from llamaref.server.errors import HTTP_ERRORS, BodyTooLarge, error_json, http_error, http_status
from reference.sampling import SamplerParams
from reference.tools.server.errors import (
    ExceedContextSize,
    InvalidRequest,
    NotFound,
    NotSupported,
    ServerError,
    Unauthorized,
    Unavailable,
)
from reference.tools.server.params import SlotParams
from reference.tools.server.results import Failed, Final
from reference.tools.server.scheduler import SchedulerError, StepReport
from reference.tools.server.slot import Task
from tests.support.server_support import (
    alone,
    greedy,
    make_engine,
    make_scheduler,
    run_scheduler,
    sampler_factory,
    tokenizer,
)


def prompt(i: int, words: int = 8) -> list[int]:
    return tokenizer().tokenize(" ".join(f"k{i}y{j}" for j in range(words)), add_special=True,
                                parse_special=True)


def until_idle(engine: Engine, max_turns: int = 10_000) -> None:
    """The loop's turns on this thread, until the scheduler has nothing to do."""
    for _ in range(max_turns):
        if not engine.turn():
            return
    raise AssertionError("the engine did not finish")


class Running:
    """``engine.run`` on its own thread, as ``llamaref serve`` runs it."""

    def __init__(self, engine: Engine):
        self.engine, self.stop = engine, threading.Event()
        self.thread = threading.Thread(target=engine.run, args=(self.stop,), daemon=True)

    def __enter__(self) -> Engine:
        self.thread.start()
        return self.engine

    def __exit__(self, *exc) -> None:
        self.stop.set()
        self.thread.join(10)
        assert not self.thread.is_alive()


# ---- the inbox and the 503 rule --------------------------------------------------------------

def test_the_queue_limit_answers_503():
    eng = make_engine(n_slots=1, max_queue=2)
    for i in range(2):
        eng.submit(Task(i, [1, 2], greedy(1), lambda r: None))
    with pytest.raises(Unavailable):
        eng.submit(Task(9, [1, 2], greedy(1), lambda r: None))


def test_the_queue_counts_tasks_until_they_get_a_slot():
    """Tasks in the inbox and tasks waiting in the scheduler count; a task given a slot, or
    dropped as cancelled, no longer does."""
    eng = make_engine(n_slots=1, max_queue=2)
    a, b = (Task(i + 1, prompt(i), greedy(20, ignore_eos=True), lambda r: None)
            for i in range(2))
    eng.submit(a)
    eng.submit(b)
    assert eng.n_queued == 2
    eng.turn()  # a gets the slot, b waits
    assert eng.n_queued == 1 and eng.scheduler.slots[0].task is a
    eng.submit(Task(3, prompt(3), greedy(1), lambda r: None))
    with pytest.raises(Unavailable):
        eng.submit(Task(4, prompt(4), greedy(1), lambda r: None))
    eng.cancel([b])
    eng.turn()
    assert eng.n_queued == 1


# ---- the thread -------------------------------------------------------------------------------

def test_the_thread_serves_tasks_and_jobs_and_stops():
    """Tasks submitted from another thread are answered as the scheduler answers them
    alone; ``call`` runs a job between steps and returns its value or raises its error."""
    eng = make_engine(n_slots=2)
    results: queue.Queue = queue.Queue()
    ps = [prompt(i) for i in range(3)]
    with Running(eng):
        for i, p in enumerate(ps):
            eng.submit(Task(i + 1, p, greedy(5), results.put))
        finals = {}
        while len(finals) < len(ps):
            r = results.get(timeout=120)
            if isinstance(r, Final):
                finals[r.task_id] = r
        assert eng.call(lambda: len(eng.scheduler.slots)) == 2
        with pytest.raises(ZeroDivisionError):
            eng.call(lambda: 1 / 0)
        assert eng.call(lambda: eng.metrics.n_tokens_predicted_total) == 15
    for i, p in enumerate(ps):
        assert finals[i + 1].tokens == alone("reference", p, 5)


def test_a_cancel_through_the_inbox_frees_the_slot():
    eng = make_engine(n_slots=1)
    out: list = []
    t1 = Task(1, prompt(0), greedy(1000, ignore_eos=True, stream=True), out.append)
    eng.submit(t1)
    eng.submit(Task(2, prompt(1), greedy(3), out.append))
    for _ in range(5):
        eng.turn()
    assert eng.scheduler.slots[0].task is t1
    eng.cancel([t1])
    until_idle(eng)
    assert isinstance(out[-1], Final) and out[-1].task_id == 2
    assert not any(s.is_processing for s in eng.scheduler.slots)


def test_a_step_that_raises_fails_its_requests_and_the_loop_goes_on(monkeypatch):
    eng = make_engine(n_slots=2)
    out: list = []
    sched = eng.scheduler
    decode = sched._decode

    def broken(batch, n_gen):
        monkeypatch.setattr(sched, "_decode", decode)  # once
        raise RuntimeError("a bug")
    monkeypatch.setattr(sched, "_decode", broken)
    eng.submit(Task(1, prompt(0), greedy(3), out.append))
    until_idle(eng)
    assert isinstance(out[-1], Failed) and str(out[-1].error).startswith("Compute error")
    assert "a bug" not in str(out[-1].error)  # no exception's text in an error body
    assert eng.last_error == "RuntimeError: a bug"
    eng.submit(Task(2, prompt(0), greedy(3), out.append))
    until_idle(eng)
    assert isinstance(out[-1], Final) and out[-1].tokens == alone("reference", prompt(0), 3)


# ---- /metrics and /slots ------------------------------------------------------------------------

def test_the_metrics_add_up_the_steps_reports():
    """The engine's counters equal the sums of the reports of the same steps run on a
    scheduler alone."""
    ps = [prompt(i, 6 + i) for i in range(3)]
    eng = make_engine(n_slots=2)
    for i, p in enumerate(ps):
        eng.submit(Task(i + 1, p, greedy(4), lambda r: None))
    until_idle(eng)
    tasks = [Task(i + 1, p, greedy(4), lambda r: None) for i, p in enumerate(ps)]
    reports = run_scheduler(make_scheduler(n_slots=2), tasks)
    m = eng.metrics
    assert m.n_decode_total == sum(r.n_decode for r in reports) > 0
    assert m.n_prompt_tokens_processed_total == sum(r.n_prompt_tokens for r in reports)
    assert m.n_prompt_tokens_cached_total == sum(r.n_prompt_cached for r in reports)
    assert m.n_prompt_tokens_processed_total + m.n_prompt_tokens_cached_total == sum(
        len(p) for p in ps)
    assert m.n_tokens_predicted_total == m.n_tokens_predicted == 12
    assert m.n_busy_slots_total == sum(r.n_busy_slots for r in reports)
    assert m.n_tokens_max == max(len(p) for p in ps) + 4 - 1
    m.reset_bucket()
    assert m.n_tokens_predicted == 0 and m.n_tokens_predicted_total == 12


def test_the_metrics_publish_the_speculative_counters():
    """The steps' draft counts add up into llama-server's ``spec_decode_*`` counters of
    ``/metrics``."""
    from llamaref.server.app import prometheus

    eng = make_engine(n_slots=1)
    eng.metrics = Metrics()
    for n, acc, ver in ((3, 2, 1), (3, 0, 1), (0, 0, 0)):
        eng.metrics.on_step(StepReport(n_draft=n, n_draft_accepted=acc, n_draft_verified=ver))
    text = prometheus(eng)
    for name, value in (("spec_decode_num_drafts_total", 2),
                        ("spec_decode_num_draft_tokens_total", 6),
                        ("spec_decode_num_accepted_tokens_total", 2)):
        assert f"# TYPE llamacpp:{name} counter" in text
        assert f"llamacpp:{name} {value}\n" in text


def test_metrics_split_a_decode_between_prompt_and_generation():
    m = Metrics()
    m.on_step(StepReport(busy=True, n_decode=2, n_busy_slots=3, n_batch_tokens=8,
                         n_prompt_tokens=6, t_decode_ms=20.0, n_tokens_max=40))
    m.on_step(StepReport(busy=True, n_cache_misses=1, n_tokens_predicted=1))  # a failed batch
    assert (m.t_prompt_processing_total, m.t_tokens_generation_total) == (15.0, 5.0)
    assert (m.n_decode_total, m.n_busy_slots_total, m.n_cache_misses) == (2, 3, 1)
    assert (m.n_prompt_tokens_processed, m.n_tokens_max, m.n_tokens_predicted) == (6, 40, 1)


def test_slots_json_shows_each_slot():
    sched = make_scheduler(n_slots=2)
    sched.add_task(Task(7, prompt(0), greedy(10, id_slot=1), lambda r: None))
    for _ in range(3):
        sched.step()
    idle, busy = slots_json(sched.slots)
    assert (idle["id"], idle["is_processing"], idle["id_task"]) == (0, False, -1)
    assert (busy["is_processing"], busy["id_task"], busy["n_prompt_tokens"]) == (
        True, 7, len(prompt(0)))
    nxt = busy["next_token"][0]
    assert nxt["has_next_token"] and (nxt["n_decoded"], nxt["n_remain"]) == (3, 7)
    assert busy["n_tokens_cached"] == len(sched.slots[1].tokens)


# ---- errors as HTTP ----------------------------------------------------------------------------

@pytest.mark.parametrize("error, status, kind", [
    (ServerError("x"), 500, "server_error"),
    (SchedulerError("x"), 500, "server_error"),
    (InvalidRequest("x"), 400, "invalid_request_error"),
    (ExceedContextSize(300, 256), 400, "exceed_context_size_error"),
    (BodyTooLarge("x"), 413, "invalid_request_error"),
    (Unauthorized("x"), 401, "authentication_error"),
    (NotFound("x"), 404, "not_found_error"),
    (NotSupported("x"), 501, "not_supported_error"),
    (Unavailable("x"), 503, "unavailable_error"),
])
def test_each_error_type_has_its_status_and_body(error, status, kind):
    assert http_error(error) == (status, kind) and http_status(error) == status
    body = error_json(error)["error"]
    assert (body["code"], body["type"], body["message"]) == (status, kind, str(error))
    if isinstance(error, ExceedContextSize):
        assert (body["n_prompt_tokens"], body["n_ctx"]) == (300, 256)
    else:
        assert set(body) == {"code", "message", "type"}


def test_every_error_type_is_in_the_table():
    assert set(HTTP_ERRORS) >= {ServerError, InvalidRequest, ExceedContextSize, Unauthorized,
                                NotFound, NotSupported, Unavailable}


# ---- one request's sampler never hurts another (issue 31, item 1) -------------------------------

@functools.cache
def alone_cached(i: int, n: int) -> tuple[int, ...]:
    return tuple(alone("reference", prompt(i), n))


def run_with_witnesses(sched, other: SlotParams, n_witnesses: int = 2, n: int = 4):
    """Greedy witnesses and one other task, concurrent on ``sched``; the results by task."""
    out: dict = {}
    tasks = [Task(i + 1, prompt(i), greedy(n), out.setdefault(i + 1, []).append)
             for i in range(n_witnesses)]
    tasks.append(Task(99, prompt(7), other, out.setdefault(99, []).append))
    run_scheduler(sched, tasks)
    return out


def assert_witnesses_alone(out: dict, n_witnesses: int = 2, n: int = 4) -> None:
    for i in range(n_witnesses):
        assert isinstance(out[i + 1][-1], Final)
        assert tuple(out[i + 1][-1].tokens) == alone_cached(i, n)


def test_a_sampler_that_cannot_be_built_fails_its_own_task_alone():
    """``repeat_penalty: 1e-310`` (a chain that refuses to be built) fails that task with
    its own error; the others are served as if alone."""
    sched = make_scheduler(n_slots=3, n_ctx=256)
    other = SlotParams(n_predict=4, sampling=SamplerParams(penalty_repeat=1e-310))
    out = run_with_witnesses(sched, other)
    assert isinstance(out[99][-1], Failed) and "penalty_repeat" in str(out[99][-1].error)
    assert http_status(out[99][-1].error) == 400
    assert_witnesses_alone(out)


class Breaks:
    """A sampler chain that raises on its ``n``-th token."""

    def __init__(self, chain, n: int):
        self.chain, self.n, self.cur = chain, n, None

    def sample(self, logits):
        self.n -= 1
        if self.n == 0:
            raise ZeroDivisionError("float division by zero")
        return self.chain.sample(logits)

    def accept(self, token):
        self.chain.accept(token)


def test_a_sampler_that_raises_fails_its_own_slot_alone():
    """A chain that raises at run time fails its task (no exception text in the error); its
    slot is released with the cache of what it decoded; the other slots go on unchanged."""
    make = sampler_factory("reference")

    def factory(params):
        chain, on_device = make(params)
        return (Breaks(chain, 3) if params.seed == 1234 else chain), on_device
    sched = make_scheduler(n_slots=3, n_ctx=256)
    sched.make_sampler = factory
    other = SlotParams(n_predict=8, sampling=SamplerParams(seed=1234, temp=0.0))
    out = run_with_witnesses(sched, other)
    (failed,) = [r for r in out[99] if isinstance(r, Failed)]
    assert str(failed.error) == ("Sampling failed: an internal error of the sampler chain "
                                 "(ZeroDivisionError)")
    assert http_status(failed.error) == 500
    assert_witnesses_alone(out)
    slot = next(s for s in sched.slots if s.tokens[:len(prompt(7))] == prompt(7))
    assert not slot.is_processing
    assert sched.memory.seq_pos_max(slot.id) == len(slot.tokens) - 1  # its cache is whole


FINITE = st.one_of(st.floats(allow_nan=False, allow_infinity=False),
                   st.sampled_from([0.0, -1.0, 1e-310, 1e-40, 1e-30, 0.5, 600.0, 1e30, 1e300]))


@st.composite
def sampler_params(draw) -> SamplerParams:
    """Any finite sampler parameters (the server's parser refuses some; the scheduler must
    survive all of them)."""
    return SamplerParams(
        seed=draw(st.integers(0, 2**32 - 1)), top_k=draw(st.integers(-5, 60)),
        top_p=draw(FINITE), min_p=draw(FINITE), typ_p=draw(FINITE),
        xtc_probability=draw(FINITE), xtc_threshold=draw(FINITE), temp=draw(FINITE),
        dynatemp_range=draw(FINITE), dynatemp_exponent=draw(FINITE),
        penalty_repeat=draw(FINITE), penalty_freq=draw(FINITE), penalty_present=draw(FINITE),
        mirostat=draw(st.integers(0, 2)), mirostat_tau=draw(FINITE),
        mirostat_eta=draw(FINITE), top_n_sigma=draw(FINITE), min_keep=draw(st.integers(0, 5)),
        logit_bias=draw(st.dictionaries(st.integers(0, 49151), FINITE, max_size=3)))


@settings(deadline=None, max_examples=12)
@given(params=sampler_params())
def test_law_other_requests_sampler_never_changes_the_witnesses(params):
    """Law: whatever the sampler parameters of one request, the concurrent greedy requests
    (the witnesses) get the answers they get alone, and that request ends (served or failed
    with its own error)."""
    sched = make_scheduler(n_slots=3, n_ctx=256)
    out = run_with_witnesses(sched, SlotParams(n_predict=3, sampling=params))
    assert isinstance(out[99][-1], Final | Failed)
    assert_witnesses_alone(out)


# ---- slots: a failed restore keeps the slot, an idle slot has decoded nothing -----------------

def test_a_failed_restore_keeps_the_slot(tmp_path):
    """A file the loader refuses (junk, or no such file) leaves the slot's tokens and cells
    as they were, and its next request still finds them cached; the error names neither
    the path nor the file's bytes."""
    sched = make_scheduler(n_slots=2, n_ctx=256, cache_ram_mib=0, cache_idle_slots=False)
    out: list = []
    run_scheduler(sched, [Task(1, prompt(0), greedy(4, id_slot=0), out.append)])
    before = list(sched.slots[0].tokens)
    (tmp_path / "junk.bin").write_bytes(b"root:x:0:0:root:/root:/bin/bash\n")
    for name, kind in (("junk.bin", InvalidRequest), ("missing.bin", NotFound)):
        with pytest.raises(kind) as e:
            sched.slot_restore(0, str(tmp_path / name))
        assert str(tmp_path) not in str(e.value) and "root" not in str(e.value)
        assert sched.slots[0].tokens == before
        assert sched.memory.seq_pos_max(0) == len(before) - 1
    conv = before + [out[-1].tokens[-1]]
    run_scheduler(sched, [Task(2, conv, greedy(3, id_slot=0), out.append)])
    assert out[-1].n_cached == len(before)
    assert out[-1].tokens == alone("reference", conv, 3)


def test_an_idle_slot_has_decoded_nothing():
    """``/slots``: a released slot reports ``n_decoded`` 0 (llama.cpp resets it), while the
    final result kept the count."""
    sched = make_scheduler(n_slots=2, n_ctx=256)
    out: list = []
    run_scheduler(sched, [Task(1, prompt(0), greedy(5, id_slot=1), out.append)])
    assert out[-1].n_decoded == 5
    view = slots_json(sched.slots)
    assert [s["next_token"][0]["n_decoded"] for s in view] == [0, 0]
