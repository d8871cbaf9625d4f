r"""A server slot: one sequence of the Context, the task it serves, and what it has cached.

llama.cpp's ``server_slot`` (``tools/server/server-context.cpp:95-708``). A slot owns the
sequence ``seq_id = id`` of the shared Context. Between requests it keeps the tokens whose
K/V (or recurrent state) the memory still holds, so the next request can start from their
longest common prefix.

**States** (``slot_state``): ``IDLE`` (no task) → ``STARTED`` (a task was given; its prompt
is not looked at yet) → ``PROCESSING_PROMPT`` (prompt chunks go into the batches) →
``DONE_PROMPT`` (the last prompt token is in the batch being decoded, with an output) →
``GENERATING`` (one sampled token per step) → ``IDLE``. A child of an ``n_cmpl > 1``
request waits in ``WAIT_OTHER`` until its parent's prompt is decoded, then receives a copy
of it (``seq_cp``) and samples from the same logits row.

**Choosing a slot** ([`select_slot`][]): a requested ``id_slot`` (modulo the number of slots,
as llama.cpp wraps it), else the idle slot whose cached tokens cover the largest share of the
new prompt (above ``slot_prompt_similarity``), else the least recently used idle slot.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

from reference.tools.server.params import SlotParams
from reference.tools.server.text import common_prefix


class SlotState(enum.Enum):
    """``slot_state``."""

    IDLE = 0
    WAIT_OTHER = 1
    STARTED = 2
    PROCESSING_PROMPT = 3
    DONE_PROMPT = 4
    GENERATING = 5


# --8<-- [start:Checkpoint]
@dataclass
class Checkpoint:
    """``server_prompt_checkpoint``: the partial state of a sequence (the SWA cache of an
    iSWA memory, the whole state of a recurrent one) before ``n_tokens`` prompt tokens were
    decoded past it.

    Attributes:
        n_tokens: how many of the slot's tokens the state covers.
        pos_min, pos_max: the sequence's positions in the memory when it was taken.
        data: ``state_seq_get_data_ext(seq, PARTIAL_ONLY)``.
        id_task: the task that created it.
    """

    n_tokens: int
    pos_min: int
    pos_max: int
    data: bytes
    id_task: int

    @property
    def size(self) -> int:
        """Bytes held."""
        return len(self.data)
# --8<-- [end:Checkpoint]


@dataclass
class Task:
    """One completion to serve (``server_task``).

    Attributes:
        id: unique per task.
        tokens: the prompt.
        params: the request's [`SlotParams`][reference.tools.server.params.SlotParams].
        emit: called by the scheduler, during a step, with each result of the task
            (``Partial``, ``Final`` or ``Failed`` of
            [`reference.tools.server.results`][reference.tools.server.results]): llama.cpp's
            ``send_partial_response`` / ``send_final_response`` to the queue of results
            that the server's runtime owns.
        index: the choice index in the response (prompt index times ``n_cmpl`` plus the
            completion's number).
        id_parent: for a child of an ``n_cmpl > 1`` request, the parent's id (else -1).
        children: the children of a parent.
        cancelled: the client went away
            ([`Scheduler.cancel`][reference.tools.server.scheduler.Scheduler.cancel]); the
            slot is freed at the next step.
        user_starts: where the prompt's user messages start (a chat request;
            [`reference.tools.server.spans.user_starts`][reference.tools.server.spans.user_starts]):
            checkpoints are taken there.
    """

    id: int
    tokens: list[int]
    params: SlotParams
    emit: Any
    index: int = 0
    id_parent: int = -1
    children: list[Task] = field(default_factory=list)
    cancelled: bool = False
    user_starts: list[int] = field(default_factory=list)


@dataclass
class Slot:
    """``server_slot``: a sequence of the Context and the task it serves.

    Attributes:
        id: the slot's number, also its ``seq_id``.
        n_ctx: the most tokens the slot may hold.
        tokens: the tokens the memory holds for this sequence, in position order
            (position ``i`` holds ``tokens[i]``).
        checkpoints: partial states, oldest first ([`Checkpoint`][]).
        t_last_used: when the slot was last released, by the scheduler's clock
            (least-recently-used choice).
        spec_draft: the drafted tokens in the batch being decoded (empty: no draft).
        spec_rows: the target's logits rows of ``[sampled, *spec_draft]`` decoded so far.
    """

    id: int
    n_ctx: int
    state: SlotState = SlotState.IDLE
    task: Task | None = None
    tokens: list[int] = field(default_factory=list)
    checkpoints: list[Checkpoint] = field(default_factory=list)
    t_last_used: float = -1.0
    # per task
    sampler: Any = None
    on_device: bool = False
    i_batch: int = -1
    sampled: int = -1
    n_decoded: int = 0
    n_prompt_cached: int = 0
    n_prompt_processed: int = 0
    generated: list[int] = field(default_factory=list)
    probs: list = field(default_factory=list)
    text: Any = None  # reference.tools.server.text.StopText
    content: str = ""  # the text generated so far, cut at a stop string
    n_sent: int = 0  # characters of ``content`` already streamed
    unsent_tokens: list[int] = field(default_factory=list)
    unsent_probs: list = field(default_factory=list)
    stop_type: str = "none"
    stopping_word: str = ""
    truncated: bool = False
    has_new_line: bool = False
    t_start_prompt: float = 0.0
    t_start_gen: float = 0.0
    t_prompt_ms: float = 0.0
    t_gen_ms: float = 0.0
    spec_draft: list[int] = field(default_factory=list)
    spec_rows: list = field(default_factory=list)

    @property
    def is_processing(self) -> bool:
        return self.state != SlotState.IDLE

    def reset_task_state(self) -> None:
        """Forget the previous task's counters (``server_slot::reset``)."""
        self.sampler, self.i_batch, self.sampled, self.n_decoded = None, -1, -1, 0
        self.n_prompt_cached = self.n_prompt_processed = 0
        self.generated, self.probs, self.content, self.n_sent = [], [], "", 0
        self.unsent_tokens, self.unsent_probs = [], []
        self.stop_type, self.stopping_word = "none", ""
        self.truncated = self.has_new_line = False
        self.t_prompt_ms = self.t_gen_ms = 0.0
        self.spec_draft, self.spec_rows = [], []


# --8<-- [start:select_slot]
def select_slot(slots: list[Slot], tokens: list[int], id_slot: int,
                similarity: float) -> Slot | None:
    r"""``get_available_slot``: the slot a new task goes to, or None (the task waits).

    1. A requested slot (``id_slot >= 0``, taken modulo the number of slots as llama.cpp
       does, server-context.cpp:1501-1511): that slot if it is idle, else None.
    2. With ``similarity > 0``: the idle slot whose cached tokens share the largest
       fraction $f = \mathrm{lcp}/|\text{prompt}|$ of the new prompt, if $f$ exceeds
       ``similarity``.
    3. The least recently used idle slot (among ties the last one, as ``<=`` picks it).

    Examples:
        >>> a, b = Slot(0, 64, tokens=[1, 2, 3, 4]), Slot(1, 64, tokens=[1, 9])
        >>> select_slot([a, b], [1, 2, 3, 7], -1, 0.1).id  # 3 of 4 tokens cached in slot 0
        0
        >>> a.t_last_used, b.t_last_used = 5.0, 2.0
        >>> select_slot([a, b], [8, 8], -1, 0.1).id  # nothing shared: least recently used
        1
        >>> select_slot([a, b], [8], 5, 0.1).id  # slot 5 of 2 wraps to slot 1
        1
    """
    if id_slot >= 0:
        slot = slots[id_slot % len(slots)]
        return None if slot.is_processing else slot
    idle = [s for s in slots if not s.is_processing]
    if not idle:
        return None
    if similarity != 0 and tokens:
        best, f_best = None, 0.0
        for s in idle:
            if not s.tokens:
                continue
            f = common_prefix(s.tokens, tokens) / len(tokens)
            if f > f_best and f > similarity:
                best, f_best = s, f
        if best is not None:
            return best
    lru = idle[0]
    for s in idle:
        if s.t_last_used <= lru.t_last_used:
            lru = s
    return lru
# --8<-- [end:select_slot]
