r"""The server's runtime: the thread that runs the scheduler, its inbox, and the counters.

llama.cpp splits its server in two: ``server_context::update_slots`` decides what each step
decodes, and ``server_queue::start_loop`` owns the thread that calls it, the queue of new
tasks and the locks (vLLM: ``Scheduler`` and ``EngineCore``; mlx-lm: ``BatchGenerator`` and
its server thread). The decision is the specification's
([`Scheduler`][reference.tools.server.scheduler.Scheduler]); this module is the other half:

- one thread owns the Context and the scheduler, and runs [`Engine.run`][]: it takes what
  the HTTP side left in the inbox (new tasks, cancellations, small jobs), then one
  [`Scheduler.step`][reference.tools.server.scheduler.Scheduler.step], and sleeps while
  there is nothing to do;
- the HTTP side, on any thread, only calls [`Engine.submit`][], [`Engine.cancel`][] and
  [`Engine.call`][] (a job run between two steps: the slot actions, ``/metrics``,
  ``/slots``); a task's results reach it through the task's own callback;
- [`Metrics`][] adds up the steps' reports into ``/metrics``'s counters, and
  [`slots_json`][] is the ``/slots`` view.
"""

from __future__ import annotations

import threading
import time
import traceback
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from llamaref.common import log
from reference.tools.server.errors import Unavailable
from reference.tools.server.scheduler import Scheduler, StepReport
from reference.tools.server.slot import Slot, SlotState, Task

SHUTTING_DOWN = "the server is shutting down"
CLOSE_POLL_S = 0.05  # how often a waiting caller looks at Engine.closing


# --8<-- [start:Metrics]
@dataclass
class Metrics:
    """``server_metrics``: the counters of ``/metrics`` (llama.cpp's names).

    Examples:
        >>> m = Metrics()
        >>> m.on_step(StepReport(busy=True, n_decode=1, n_batch_tokens=4, n_prompt_tokens=3,
        ...                      t_decode_ms=8.0, n_tokens_predicted=1))
        >>> m.n_prompt_tokens_processed_total, m.t_prompt_processing_total, m.n_decode_total
        (3, 6.0, 1)
    """

    n_prompt_tokens_processed_total: int = 0
    n_prompt_tokens_cached_total: int = 0
    t_prompt_processing_total: float = 0.0  # ms
    n_tokens_predicted_total: int = 0
    t_tokens_generation_total: float = 0.0  # ms
    n_decode_total: int = 0
    n_busy_slots_total: int = 0
    n_tokens_max: int = 0
    # since the last /metrics read (llama.cpp resets these "bucket" counters)
    n_prompt_tokens_processed: int = 0
    t_prompt_processing: float = 0.0
    n_tokens_predicted: int = 0
    t_tokens_generation: float = 0.0
    n_cache_misses: int = 0
    # speculative decoding (llama.cpp's spec_decode_* counters)
    n_draft_total: int = 0
    n_draft_accepted_total: int = 0
    n_draft_verified_total: int = 0

    def on_step(self, r: StepReport) -> None:
        """Add one step's report. A batch's decode time is split between its prompt and
        its generated tokens in proportion to their numbers, since one decode serves both."""
        self.n_prompt_tokens_cached_total += r.n_prompt_cached
        self.n_tokens_predicted_total += r.n_tokens_predicted
        self.n_tokens_predicted += r.n_tokens_predicted
        self.n_decode_total += r.n_decode
        self.n_busy_slots_total += r.n_busy_slots
        self.n_cache_misses += r.n_cache_misses
        self.n_draft_total += r.n_draft
        self.n_draft_accepted_total += r.n_draft_accepted
        self.n_draft_verified_total += r.n_draft_verified
        if r.n_batch_tokens == 0:
            return  # no batch, or its decode failed
        self.n_tokens_max = max(self.n_tokens_max, r.n_tokens_max)
        share = r.n_prompt_tokens / r.n_batch_tokens
        self.t_prompt_processing_total += r.t_decode_ms * share
        self.t_prompt_processing += r.t_decode_ms * share
        self.n_prompt_tokens_processed_total += r.n_prompt_tokens
        self.n_prompt_tokens_processed += r.n_prompt_tokens
        self.t_tokens_generation_total += r.t_decode_ms * (1 - share)
        self.t_tokens_generation += r.t_decode_ms * (1 - share)

    def reset_bucket(self) -> None:
        """After a ``/metrics`` read: the throughput counters start again."""
        self.n_prompt_tokens_processed = self.n_tokens_predicted = 0
        self.t_prompt_processing = self.t_tokens_generation = 0.0
# --8<-- [end:Metrics]


def slots_json(slots: list[Slot], speculative: bool = False) -> list[dict]:
    """``GET /slots``: one object per slot (llama.cpp's fields); ``speculative``: the slots
    draft (llama-server's ``can_speculate()``: the server has a draft model).

    Examples:
        >>> [s["id"] for s in slots_json([Slot(0, 64), Slot(1, 64)])]
        [0, 1]
        >>> slots_json([Slot(0, 64)], speculative=True)[0]["speculative"]
        True
    """
    out = []
    for s in slots:
        task = s.task
        out.append({
            "id": s.id, "n_ctx": s.n_ctx, "speculative": speculative,
            "is_processing": s.is_processing, "id_task": task.id if task else -1,
            "n_prompt_tokens": len(task.tokens) if task else 0,
            "n_prompt_tokens_processed": s.n_prompt_processed,
            "n_prompt_tokens_cache": s.n_prompt_cached,
            "n_tokens_cached": len(s.tokens), "n_checkpoints": len(s.checkpoints),
            "next_token": [{"has_next_token": s.state == SlotState.GENERATING,
                            "has_new_line": s.has_new_line,
                            "n_remain": (task.params.n_predict - s.n_decoded
                                         if task and task.params.n_predict > 0 else -1),
                            "n_decoded": s.n_decoded}],
        })
    return out


class Engine:
    """A [`Scheduler`][reference.tools.server.scheduler.Scheduler] driven by one thread,
    fed through a locked inbox (``server_queue``).

    Args:
        scheduler: the slots and the decode step; from now on only the engine's thread
            touches it.
        max_queue: the most tasks submitted and not yet given a slot (``--max-queue``);
            beyond, [`submit`][llamaref.server.engine.Engine.submit] refuses with 503.

    Attributes:
        metrics: the ``/metrics`` counters, updated after every step.
        t_start: when the engine was made (wall clock, ``/v1/models``'s ``created``).
        last_error: the last exception a step raised and the loop survived.

    Examples:
        >>> from reference.context import Context
        >>> from reference.sampling import SamplerChain, SamplerParams
        >>> from reference.tools.server.params import SlotParams
        >>> from reference.tools.server.scheduler import SchedulerConfig
        >>> from reference.testing import tiny_hparams, random_weights
        >>> hp = tiny_hparams()
        >>> class Tok:
        ...     def token_to_piece(self, t, special=False): return b"ab"[t % 2:t % 2 + 1]
        ...     def is_eog(self, t): return False
        >>> ctx = Context(hp, random_weights(hp), n_ctx=256, n_seq_max=2)
        >>> engine = Engine(Scheduler(ctx, Tok(), lambda p: (SamplerChain.from_params(p, 32),
        ...                           False), SchedulerConfig(n_slots=2)))
        >>> stop = threading.Event()
        >>> thread = threading.Thread(target=engine.run, args=(stop,))
        >>> thread.start()
        >>> done = threading.Event()
        >>> params = SlotParams(n_predict=4, sampling=SamplerParams(temp=0.0))
        >>> engine.submit(Task(1, [1, 2, 3], params, lambda r: done.set() if hasattr(
        ...     r, "stop_type") else None))
        >>> done.wait(60), engine.call(lambda: engine.metrics.n_tokens_predicted_total)
        (True, 4)
        >>> stop.set(); thread.join()
    """

    def __init__(self, scheduler: Scheduler, max_queue: int = 1024):
        self.scheduler = scheduler
        self.max_queue = max_queue
        self.metrics = Metrics()
        self.t_start = time.time()
        self.last_error: str | None = None
        self._inbox: deque[tuple[str, Any]] = deque()
        self._lock = threading.Lock()  # guards the inbox and the two counts below
        self._wake = threading.Event()
        self._n_inbox_tasks = 0  # tasks in the inbox
        self._n_waiting = 0  # tasks the scheduler holds without a slot, after the last step
        self.closing = threading.Event()  # set by close(): the server is shutting down

    # ---- the HTTP side's calls (any thread) --------------------------------------------------

    @property
    def n_queued(self) -> int:
        """Tasks submitted and not yet given a slot (the 503 rule counts these)."""
        with self._lock:
            return self._n_inbox_tasks + self._n_waiting

    def submit(self, task: Task) -> None:
        """Queue a task (with its children, if any); thread-safe.

        Raises:
            Unavailable: ``max_queue`` tasks are already waiting.
        """
        with self._lock:
            if self._n_inbox_tasks + self._n_waiting >= self.max_queue:
                raise Unavailable(f"the queue is full ({self.max_queue} waiting "
                                  "requests); try again later")
            self._inbox.append(("task", task))
            self._n_inbox_tasks += 1
        self._wake.set()

    def cancel(self, tasks: list[Task]) -> None:
        """The client of ``tasks`` went away: the scheduler drops them (and their children)
        at its next step; thread-safe."""
        with self._lock:
            self._inbox.extend(("cancel", t.id) for t in tasks)
        self._wake.set()

    def call(self, fn: Callable[[], Any]) -> Any:
        """Run ``fn`` on the engine's thread between two steps and return its result (or
        raise its exception); thread-safe. Used by the slot actions, ``/slots`` and
        ``/metrics``.

        Raises:
            Unavailable: the server is shutting down
                ([`close`][llamaref.server.engine.Engine.close]) before ``fn`` has run: a
                caller never waits on a step that will not come.
        """
        done = threading.Event()
        box: dict = {}

        def job():
            try:
                box["value"] = fn()
            except BaseException as e:  # handed back to the caller
                box["error"] = e
            done.set()
        with self._lock:
            self._inbox.append(("call", job))
        self._wake.set()
        while not done.wait(CLOSE_POLL_S):
            if self.closing.is_set():
                raise Unavailable(SHUTTING_DOWN)
        if "error" in box:
            raise box["error"]
        return box.get("value")

    def close(self) -> None:
        """The server is shutting down: every [`call`][llamaref.server.engine.Engine.call]
        still waiting answers 503 at once, and so do the requests that wait on results
        (they poll [`closing`][llamaref.server.engine.Engine]); the loop stops after the
        step it is in."""
        self.closing.set()
        self._wake.set()

    # ---- the engine's thread -------------------------------------------------------------------

    # --8<-- [start:run]
    def run(self, stop: threading.Event) -> None:
        """The loop (``server_queue::start_loop``): take the inbox, step while there is
        work, sleep until something arrives."""
        while not stop.is_set() and not self.closing.is_set():
            if not self.turn():
                self._wake.wait(0.05)
                self._wake.clear()

    def turn(self) -> bool:
        """One turn of the loop: hand the inbox to the scheduler, then one step; returns
        whether the scheduler had work. A step that raises (a bug) fails the requests
        being processed, and the loop goes on."""
        self._drain_inbox()
        try:
            report = self.scheduler.step()
            busy = report.busy
        except Exception as e:  # a bug must not take the server down: fail and go on
            self.last_error = f"{type(e).__name__}: {e}"
            log("llamaref serve: error in a step: " + traceback.format_exc().rstrip())
            report, busy = self.scheduler.report, True
            # the exception's text stays in the log: an error body never carries it
            self.scheduler.fail_processing("Compute error (the server's log has the details)")
        self.metrics.on_step(report)
        with self._lock:
            self._n_waiting = len(self.scheduler.waiting)
        return busy
    # --8<-- [end:run]

    def _drain_inbox(self) -> None:
        """New tasks and cancellations to the scheduler, jobs run, in the order they came."""
        with self._lock:
            items, self._inbox = list(self._inbox), deque()
            self._n_waiting += self._n_inbox_tasks
            self._n_inbox_tasks = 0
        for kind, item in items:
            if kind == "task":
                self.scheduler.add_task(item)
            elif kind == "cancel":
                self.scheduler.cancel(item)
            else:
                item()
