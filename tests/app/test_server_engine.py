"""The server's runtime (llamaref/server/engine.py): the thread that drives the scheduler, its
inbox and the 503 rule, cancellations and jobs between steps, a step that raises, the
``/metrics`` counters and the ``/slots`` view; and llamaref/server/errors.py, the HTTP
status and body of each error type."""

from __future__ import annotations

import queue
import threading

import pytest

from llamaref.server.engine import Engine, Metrics, slots_json
from llamaref.server.errors import HTTP_ERRORS, BodyTooLarge, error_json, http_error, http_status
from reference.tools.server.errors import (
    ExceedContextSize,
    InvalidRequest,
    NotFound,
    NotSupported,
    ServerError,
    Unauthorized,
    Unavailable,
)
from reference.tools.server.results import Failed, Final
from reference.tools.server.scheduler import SchedulerError, StepReport
from reference.tools.server.slot import Task
from tests.support.server_support import (
    alone,
    greedy,
    make_engine,
    make_scheduler,
    run_scheduler,
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
    assert isinstance(out[-1], Failed) and "Compute error: RuntimeError: a bug" in str(
        out[-1].error)
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
