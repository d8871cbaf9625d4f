r"""The server's scheduler: many slots on one Context, continuous batching under a token
budget, prompt reuse, checkpoints, and ``llama_decode``'s return codes handled as routine.

llama.cpp's ``server_context::update_slots`` (``tools/server/server-context.cpp:2852-3760``).
The [`Scheduler`][] decides and decodes; it owns no thread and waits for nothing. Whoever
drives it hands it tasks ([`Scheduler.add_task`][]), tells it which were abandoned
([`Scheduler.cancel`][]) and calls [`Scheduler.step`][] while there is work; each task's
results go to the task's own callback, and each step reports what it did (for the server's
counters). llama.cpp's ``server_queue::start_loop`` plays that part on a thread; ours is
``llamaref serve``'s runtime (``llamaref/server/engine.py``), and the tests call ``step``
directly. A step:

1. **Admit** waiting tasks to free slots ([`select_slot`][reference.tools.server.slot.select_slot]),
   children of an ``n_cmpl > 1`` request with them (they all need a free slot at once).
2. **Shift** the context of a generating slot that is full, where the memory can shift
   (``--context-shift``): ``n_keep`` tokens kept, ``n_discard`` dropped.
3. **Batch** the last sampled token of every generating slot, then fill the rest of the
   token budget ``n_batch`` with chunks of the prompts being processed. A long new prompt
   is spread over several steps, and the streams already generating advance at every one of
   them (mlx-lm prefills in separate passes, which stalls its running streams).
4. **Decode** the batch ``n_batch`` tokens at a time. A decode that answers 1 (no room in
   the KV cache) is routine: with a unified cache one idle slot's cells are purged, else the
   chunk is halved, and the same offset is retried. Only ``n_batch = 1`` still failing, or an
   error (< 0), fails the requests being processed; they get the error, their slots are
   cleared, and the server goes on.
5. **Sample** for each slot whose output row is in the chunk; check stop strings, the
   end-of-generation token and the limits; stream the new text; finish and release. A
   sampler chain that cannot be built or raises fails its own task alone (its slot keeps
   what it decoded); the other slots go on.

Given the same Context, tasks and clock, a step does the same thing every time: the only
time it reads is the ``clock`` it was given (for the timings and ``t_max_predict_ms``).

**Prompt reuse.** A new task's prompt is compared with the tokens its slot holds:
``cache_prompt`` keeps their longest common prefix; ``n_cache_reuse`` moves later matching
chunks into place by KV shifting. For memories that cannot drop a suffix (the SWA part of an
iSWA cache, a recurrent state), a *checkpoint* saved before the prompt's end is restored
(``PARTIAL_ONLY``) when what the memory holds no longer matches; without one, the prompt is
processed again from the start. A failed restore also falls back to processing again.

**Speculative decoding.** With a draft Context, each generating slot drafts up to
``draft_n_max`` tokens (``draft-simple``'s greedy rule,
[`draft_greedy`][reference.tools.speculative.draft_greedy]) before the batch is built, puts
``[sampled, draft...]`` into the same batch as the other slots, and once its rows are
decoded verifies them with
[`sample_and_accept_n`][reference.tools.speculative.sample_and_accept_n]; each accepted token
is then processed as a plain one, and the slot's tokens and cells are cut to what plain
decoding leaves. Answers, and seeded samples, are those without a draft.
"""

from __future__ import annotations

import os
import time
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np

from reference.batch import Batch
from reference.common import LlamarefError
from reference.memory import LLAMA_STATE_SEQ_FLAGS_PARTIAL_ONLY
from reference.sampling import SamplerParams, SamplingError
from reference.tools.server.errors import (
    ExceedContextSize,
    InvalidRequest,
    NotFound,
    ServerError,
    Unavailable,
)
from reference.tools.server.prompt_cache import PromptCache
from reference.tools.server.results import Failed, Final, Partial, Timings, TokenOutput, TokenProb
from reference.tools.server.slot import Checkpoint, Slot, SlotState, Task, select_slot
from reference.tools.server.speculator import DraftRequest, check_spec_setup, make_speculator
from reference.tools.server.text import StopText, common_prefix
from reference.tools.speculative import (
    SPEC_VOCAB_MAX_SIZE_DIFFERENCE,
    SpeculativeError,
    sample_and_accept_n,
)


class SchedulerError(ServerError):
    """A request the scheduler cannot serve at all (not a bad field: a bad server setup)."""


def sampling_failure(e: Exception) -> ServerError:
    """The error a task gets when its sampler chain raised: a
    [`SamplingError`][reference.sampling.SamplingError] says what was wrong with the
    parameters (its message is ours); anything else is a bug, reported without the exception's
    text.

    Examples:
        >>> from reference.sampling import SamplingError
        >>> str(sampling_failure(SamplingError("mirostat must be 0, 1 or 2, got 3")))
        'Sampling failed: mirostat must be 0, 1 or 2, got 3'
        >>> str(sampling_failure(ZeroDivisionError("float division by zero")))
        'Sampling failed: an internal error of the sampler chain (ZeroDivisionError)'
    """
    if isinstance(e, SamplingError):
        return InvalidRequest(f"Sampling failed: {e}")
    return ServerError(f"Sampling failed: an internal error of the sampler chain "
                       f"({type(e).__name__})")


# --8<-- [start:check_draft]
def check_draft(ctx: Any, draft: Any, config: SchedulerConfig) -> None:
    """A server setup that can speculate: drafter types it knows, a draft Context exactly
    when ``draft-simple`` is asked for, one the slots can use, and sizes in range.

    The target must be able to drop the rejected tokens of a draft from a sequence
    (``common_context_can_seq_rm``): a recurrent memory cannot. llama-server, at the pinned
    commit, saves and restores a ``PARTIAL_ONLY`` checkpoint around each draft there
    (``server-context.cpp:3905-3925``); this specification refuses speculation instead.
    """
    types = spec_types(config, draft)
    if types and ctx.recurrent:
        raise SchedulerError("speculative decoding needs a target whose cache can drop "
                             "rejected draft tokens; a recurrent model (Mamba) cannot: "
                             "serve it without speculative decoding")
    try:
        check_spec_setup(config.spec_types or types, draft is not None,
                         config.spec_ngram_size_n, config.spec_ngram_size_m)
    except SpeculativeError as e:
        raise SchedulerError(str(e)) from None
    if config.draft_n_max < 0 or config.draft_n_min < 0 or not (
            0.0 <= config.draft_p_min <= 1.0):
        raise SchedulerError(f"--draft-max = {config.draft_n_max} and --draft-min = "
                             f"{config.draft_n_min} must be >= 0 and --draft-p-min = "
                             f"{config.draft_p_min} in [0, 1]")
    if draft is None:
        return
    if draft.n_seq_max < config.n_slots:
        raise SchedulerError(f"{config.n_slots} slots need a draft Context with n_seq_max "
                             f">= {config.n_slots}, got {draft.n_seq_max}")
    if abs(draft.n_vocab - ctx.n_vocab) > SPEC_VOCAB_MAX_SIZE_DIFFERENCE:
        raise SchedulerError(f"the draft's vocabulary ({draft.n_vocab} tokens) is not the "
                             f"target's ({ctx.n_vocab}): use a draft of the same family")


def spec_types(config: SchedulerConfig, draft: Any) -> tuple[str, ...]:
    """The drafter types the server uses: ``--spec-type``'s, or ``draft-simple`` when only
    a draft model is given (llama-server then ignores the draft model: it needs
    ``--spec-type draft-simple``, ``common/arg.cpp:565-573``)."""
    types = tuple(t for t in config.spec_types if t != "none")
    if not config.spec_types and draft is not None:
        return ("draft-simple",)
    return types
# --8<-- [end:check_draft]


# --8<-- [start:SchedulerConfig]
@dataclass
class SchedulerConfig:
    """The server flags the scheduler reads (``common_params``; llama.cpp's defaults).

    Attributes:
        n_slots: ``-np`` (slots; the Context needs ``n_seq_max >= n_slots``).
        ctx_shift: ``--context-shift`` (off by default in the server).
        slot_prompt_similarity: ``-sps``.
        n_ctx_checkpoints: ``--ctx-checkpoints`` (per slot).
        checkpoint_min_step: ``--checkpoint-min-step``.
        swa_full: ``--swa-full`` (then no SWA checkpoints are needed).
        cache_ram_mib: ``--cache-ram`` (MiB; -1 no limit; 0 off).
        cache_idle_slots: ``--cache-idle-slots`` (needs the RAM cache).
        n_cache_reuse: ``--cache-reuse`` (the default of a request's ``n_cache_reuse``).
        prompt_budget: the most prompt tokens a step takes while some slot is generating
            (0: as many as ``n_batch`` leaves, as llama.cpp). Ours, not llama.cpp's: a
            smaller budget bounds the time of a step, so the streams keep their pace while
            a long prompt arrives, and the prompt takes more steps.
        draft_n_max: ``--spec-draft-n-max`` (``--draft-max``): the most tokens a slot
            drafts per step (with a draft Context).
        draft_n_min: ``--spec-draft-n-min`` (``--draft-min``): shorter drafts are dropped.
        draft_p_min: ``--spec-draft-p-min`` (``--draft-p-min``): drafting stops at a token
            whose draft probability is below this.
        spec_types: ``--spec-type``: the drafters (see
            [`reference.tools.server.speculator`][reference.tools.server.speculator]);
            empty: ``draft-simple`` with a draft Context, else none.
        spec_ngram_size_n: ``--spec-ngram-simple-size-n``: the n-gram ``ngram-simple``
            looks up.
        spec_ngram_size_m: ``--spec-ngram-simple-size-m``: the most tokens it copies.
    """

    n_slots: int = 4
    ctx_shift: bool = False
    slot_prompt_similarity: float = 0.10
    n_ctx_checkpoints: int = 32
    checkpoint_min_step: int = 8192
    swa_full: bool = False
    cache_ram_mib: float = 8192
    cache_idle_slots: bool = True
    n_cache_reuse: int = 0
    prompt_budget: int = 0
    draft_n_max: int = 3
    draft_n_min: int = 0
    draft_p_min: float = 0.0
    spec_types: tuple[str, ...] = ()
    spec_ngram_size_n: int = 12
    spec_ngram_size_m: int = 48
# --8<-- [end:SchedulerConfig]


# --8<-- [start:StepReport]
@dataclass
class StepReport:
    """What one [`Scheduler.step`][] did: llama.cpp's ``server_metrics`` calls
    (``on_prompt_eval``, ``on_prediction``, ``on_decoded``) as data, for the server's
    counters to add up.

    Attributes:
        busy: some slot had work (False: nothing to do until a task arrives).
        n_decode: ``llama_decode`` calls that succeeded.
        n_busy_slots: busy slots, summed over those calls.
        n_cache_misses: decodes that answered 1 (no room) and were retried.
        n_prompt_cached: prompt tokens the tasks started in this step found cached.
        n_tokens_predicted: tokens sampled.
        n_batch_tokens: tokens of the step's batch, once all of it is decoded (0 when there
            was no batch or its decode failed; the fields below are then 0 too).
        n_prompt_tokens: of which prompt tokens (the rest are the generating slots' tokens).
        t_decode_ms: the time the batch took to decode, by the scheduler's clock.
        n_tokens_max: the most tokens a slot holds after the decode.
        n_draft: tokens drafted in this step (``spec_decode_num_draft_tokens_total``).
        n_draft_accepted: drafted tokens the target accepted
            (``spec_decode_num_accepted_tokens_total``).
        n_draft_verified: drafts verified (``spec_decode_num_drafts_total``).
    """

    busy: bool = False
    n_decode: int = 0
    n_busy_slots: int = 0
    n_cache_misses: int = 0
    n_prompt_cached: int = 0
    n_tokens_predicted: int = 0
    n_batch_tokens: int = 0
    n_prompt_tokens: int = 0
    t_decode_ms: float = 0.0
    n_tokens_max: int = 0
    n_draft: int = 0
    n_draft_accepted: int = 0
    n_draft_verified: int = 0
# --8<-- [end:StepReport]


class Scheduler:
    """The slots, the waiting tasks and the decode step of one Context (``server_context``).

    Args:
        ctx: a Context (either twin) with ``n_seq_max >= config.n_slots``.
        tokenizer: the model's tokenizer (``token_to_piece``, ``is_eog``).
        make_sampler: builds a sampler chain from a
            [`SamplerParams`][reference.sampling.SamplerParams]; returns
            ``(sampler, on_device)`` (``on_device``: it takes the MLX row).
        config: the server flags ([`SchedulerConfig`][]).
        clock: the time in seconds (``time.perf_counter``): the only time the scheduler
            reads, for the results' timings, ``t_max_predict_ms`` and the least recently
            used slot.
        draft: a draft Context (``-md`` or ``--draft-layers``) with the target's vocabulary
            and ``n_seq_max >= config.n_slots``: every generating slot then speculates
            (see "Speculative decoding" above). None: no speculation.

    Raises:
        SchedulerError: a Context with fewer sequences than slots; a draft that cannot
            serve (too few sequences, another vocabulary, bad ``draft_*`` flags, or a
            recurrent target, whose memory cannot drop rejected tokens).

    Examples:
        >>> from reference.context import Context
        >>> from reference.sampling import SamplerChain
        >>> from reference.tools.server.params import SlotParams
        >>> from reference.testing import tiny_hparams, random_weights
        >>> hp = tiny_hparams()
        >>> class Tok:
        ...     def token_to_piece(self, t, special=False): return b"ab"[t % 2:t % 2 + 1]
        ...     def is_eog(self, t): return False
        >>> ctx = Context(hp, random_weights(hp), n_ctx=256, n_seq_max=2)
        >>> sched = Scheduler(ctx, Tok(), lambda p: (SamplerChain.from_params(p, 32), False),
        ...                   SchedulerConfig(n_slots=2))
        >>> out = []
        >>> params = SlotParams(n_predict=4, sampling=SamplerParams(temp=0.0))
        >>> sched.add_task(Task(1, [1, 2, 3], params, out.append))
        >>> while sched.step().busy: pass
        >>> out[-1].n_decoded, out[-1].stop_type, len(out[-1].content)
        (4, 'limit', 4)
    """

    def __init__(self, ctx: Any, tokenizer: Any,
                 make_sampler: Callable[[SamplerParams], tuple[Any, bool]],
                 config: SchedulerConfig | None = None,
                 clock: Callable[[], float] = time.perf_counter, draft: Any = None,
                 ngram_caches: dict | None = None):
        config = config or SchedulerConfig()
        if ctx.n_seq_max < config.n_slots or config.n_slots < 1:
            raise SchedulerError(f"{config.n_slots} slots need a Context with n_seq_max >= "
                                 f"{config.n_slots}, got {ctx.n_seq_max}")
        check_draft(ctx, draft, config)
        try:
            self.speculator = make_speculator(spec_types(config, draft), config, ctx.n_vocab,
                                              draft, ngram_caches)
        except SpeculativeError as e:
            raise SchedulerError(str(e)) from None
        self.draft = draft
        self.ctx, self.tokenizer, self.make_sampler, self.config = (
            ctx, tokenizer, make_sampler, config)
        self.clock = clock
        self.memory = ctx.memory
        self.n_batch = ctx.n_batch
        self.n_ubatch = ctx.n_ubatch
        n_ctx_slot = min(ctx.n_ctx_seq, ctx.hparams.n_ctx_train or ctx.n_ctx_seq)
        self.slots = [Slot(i, n_ctx_slot) for i in range(config.n_slots)]
        self.recurrent = ctx.recurrent
        n_swa = 0 if self.recurrent or not ctx.hparams.swa_type else ctx.hparams.n_swa
        self.n_swa = 0 if config.swa_full else n_swa
        self.do_checkpoints = config.n_ctx_checkpoints > 0 and (self.recurrent or self.n_swa > 0)
        self.prompt_cache = (PromptCache(config.cache_ram_mib, n_ctx_slot)
                             if config.cache_ram_mib != 0 else None)
        self.waiting: deque[Task] = deque()
        self.report = StepReport()  # the step in progress, or the last one

    # ---- what the driver hands in ------------------------------------------------------------

    def add_task(self, task: Task) -> None:
        """A new task (with its children, if any) waits for a slot; it is admitted at the
        next [`step`][reference.tools.server.scheduler.Scheduler.step] that finds one."""
        self.waiting.append(task)

    def cancel(self, id_task: int) -> None:
        """The client of task ``id_task`` went away: it and its children are dropped at the
        next step, which frees their slots (their cache is kept). An id that is not waiting
        or running (a task already finished) changes nothing."""
        for task in self._tasks():
            if task.id == id_task:
                for t in (task, *task.children):
                    t.cancelled = True

    def _tasks(self) -> Iterator[Task]:
        """Every task the scheduler holds: waiting (with their children) and running."""
        for task in self.waiting:
            yield task
            yield from task.children
        for slot in self.slots:
            if slot.task is not None:
                yield slot.task

    # ---- one step --------------------------------------------------------------------------

    # --8<-- [start:step]
    def step(self) -> StepReport:
        """One turn of ``update_slots``; returns what it did (``busy`` False: nothing to do
        until a task is added)."""
        self.report = report = StepReport()
        self._drop_cancelled()
        self._launch_waiting()
        if not any(s.is_processing for s in self.slots):
            return report
        self._context_shift()
        batch, n_gen = self._build_batch()
        report.busy = True
        if len(batch.token) == 0:
            report.busy = any(s.is_processing for s in self.slots)
            return report
        self._decode(batch, n_gen)
        return report
    # --8<-- [end:step]

    def _drop_cancelled(self) -> None:
        """A client that went away frees its slot now (its cache is kept)."""
        for slot in self.slots:
            if slot.task is not None and slot.task.cancelled:
                self._release(slot)
        self.waiting = deque(t for t in self.waiting if not t.cancelled)

    # ---- admission ---------------------------------------------------------------------------

    def _launch_waiting(self) -> None:
        """Give waiting tasks, in order, to free slots; a task that cannot start waits
        (with those behind it that need the same slot)."""
        launched = False
        for task in list(self.waiting):
            slot = select_slot(self.slots, task.tokens, task.params.id_slot,
                               self.config.slot_prompt_similarity)
            if slot is None:
                continue
            children = []
            if task.children:
                free = [s for s in self.slots if not s.is_processing and s is not slot]
                if len(free) < len(task.children):
                    continue
                children = free[: len(task.children)]
            self.waiting.remove(task)
            error = self._check_task(task, slot)
            samplers = self._make_samplers(task) if error is None else []
            if isinstance(samplers, ServerError):
                error = samplers
            if error is not None:
                for t in [task, *task.children]:
                    t.emit(Failed(t.id, t.index, error))
                continue
            self._update_prompt_cache(slot, task)
            self._launch(slot, task, SlotState.STARTED, samplers[0])
            for child_slot, child, sampler in zip(children, task.children, samplers[1:],
                                                  strict=True):
                self._launch(child_slot, child, SlotState.WAIT_OTHER, sampler)
            launched = True
        if launched and self.prompt_cache is not None and self.config.cache_idle_slots:
            self._cache_idle_slots()

    def _check_task(self, task: Task, slot: Slot) -> ServerError | None:
        """The checks of ``launch_slot_with_task`` / the start of prompt processing."""
        if not task.tokens:
            return InvalidRequest("the prompt is empty")
        if len(task.tokens) >= slot.n_ctx:
            return ExceedContextSize(len(task.tokens), slot.n_ctx)
        return None

    def _make_samplers(self, task: Task) -> list[tuple[Any, bool]] | ServerError:
        """The sampler chains of a task and its children, built before anything changes; a
        chain that cannot be built fails this task only (its error, or a
        [`ServerError`][reference.tools.server.errors.ServerError] that names no exception
        text for an unexpected one)."""
        try:
            return [self.make_sampler(t.params.sampling) for t in (task, *task.children)]
        except Exception as e:  # noqa: BLE001 - one request's sampler must not stop the others
            return sampling_failure(e)

    def _launch(self, slot: Slot, task: Task, state: SlotState,
                sampler: tuple[Any, bool]) -> None:
        slot.reset_task_state()
        slot.task, slot.state = task, state
        slot.sampler, slot.on_device = sampler
        slot.text = StopText(task.params.stop)
        slot.t_start_prompt = self.clock()

    def _update_prompt_cache(self, slot: Slot, task: Task) -> None:
        """``--cache-ram``: save what the slot holds, then load the saved state that covers
        the new prompt best (server-context.cpp:1600-1646)."""
        if self.prompt_cache is None or not task.params.cache_prompt:
            return
        f_keep = (common_prefix(slot.tokens, task.tokens) / len(slot.tokens)
                  if slot.tokens else 1.0)
        if slot.tokens and f_keep >= 0.5:
            return  # the slot's own cache is good enough
        if slot.tokens:
            self.prompt_cache.save(self.ctx, slot.id, slot.tokens, slot.checkpoints)
        entry = self.prompt_cache.load(self.ctx, slot.id, slot.tokens, task.tokens)
        if entry is not None:  # restored (or, after a failed restore, an empty slot)
            slot.tokens, slot.checkpoints = list(entry.tokens), list(entry.checkpoints)
        self.prompt_cache.update()

    def _cache_idle_slots(self) -> None:
        """``--cache-idle-slots``: idle slots are saved to the RAM cache and, on a unified
        cache, cleared, so their cells serve the running requests."""
        for slot in self.slots:
            if slot.is_processing or not slot.tokens:
                continue
            self.prompt_cache.save(self.ctx, slot.id, slot.tokens, slot.checkpoints)
            if self.ctx.kv_unified:
                self._clear(slot)

    # ---- context shift -------------------------------------------------------------------------

    def _context_shift(self) -> None:
        """Free room in a full slot by dropping tokens after ``n_keep`` (server-context.cpp:
        2891-2957); only with ``--context-shift`` and a memory that can shift."""
        if not self.config.ctx_shift or not self.memory.can_shift():
            return
        for slot in self.slots:
            if slot.state != SlotState.GENERATING or len(slot.tokens) + 1 < slot.n_ctx:
                continue
            params, n_prompt = slot.task.params, len(slot.task.tokens)
            if slot.task.children or slot.task.id_parent >= 0:
                continue  # parent/child tasks cannot shift (llama.cpp refuses too)
            add_bos = 1 if self.tokenizer.bos_id is not None and slot.tokens[:1] == [
                self.tokenizer.bos_id] else 0
            n_keep = (n_prompt if params.n_keep < 0 else params.n_keep) + add_bos
            n_keep = min(slot.n_ctx - 4, n_keep)
            n_left = len(slot.tokens) - n_keep
            n_discard = params.n_discard or n_left // 2
            n_discard = max(0, min(n_discard, max(0, n_left - 1)))
            if n_discard == 0:
                continue
            self.memory.seq_rm(slot.id, n_keep, n_keep + n_discard)
            self.memory.seq_add(slot.id, n_keep + n_discard, len(slot.tokens), -n_discard)
            del slot.tokens[n_keep:n_keep + n_discard]
            slot.checkpoints.clear()
            slot.truncated = True

    # ---- the batch -----------------------------------------------------------------------------

    # --8<-- [start:build_batch]
    def _build_batch(self) -> tuple[Batch, int]:
        """The generating slots' tokens (each with its draft), then prompt chunks up to
        ``n_batch`` tokens (or ``prompt_budget`` prompt tokens while some slot generates)."""
        tok, pos, seq, out = [], [], [], []
        generating = [s for s in self.slots if s.state == SlotState.GENERATING]
        drafts = self._drafts(generating)
        for slot in generating:
            # a slot's rows never straddle two n_batch chunks
            draft = drafts.get(slot.id, [])[:max(0, self.n_batch - len(tok) - 1)]
            self.report.n_draft += len(draft)
            slot.i_batch = len(tok)
            for t in (slot.sampled, *draft):
                tok.append(t)
                pos.append(len(slot.tokens))
                seq.append([slot.id])
                out.append(True)
                slot.tokens.append(t)
            slot.spec_draft, slot.spec_rows = draft, []
        n_gen = len(tok)
        budget = self.config.prompt_budget
        limit = min(self.n_batch, n_gen + budget) if budget > 0 and n_gen else self.n_batch
        for slot in self.slots:
            if len(tok) >= limit:
                break
            if slot.state == SlotState.STARTED:
                if not self._start_prompt(slot):
                    continue
            if slot.state != SlotState.PROCESSING_PROMPT:
                continue
            self._add_prompt_chunk(slot, tok, pos, seq, out, limit)
        return Batch(token=tok, pos=pos, seq_id=seq, logits=out), n_gen
    # --8<-- [end:build_batch]

    # --8<-- [start:draft]
    def _drafts(self, generating: list[Slot]) -> dict[int, list[int]]:
        """The drafts of the generating slots, in one call of the speculator (none
        without one).

        A slot may draft at most ``n_ctx - n_tokens - 2`` tokens, and one less than the
        tokens ``n_predict`` still allows (``get_n_draft_max``); each drafter has its own
        limit too (``--draft-max`` for ``draft-simple``, ``size_m`` for ``ngram-simple``,
        8 for ``ngram-cache``).
        """
        if self.speculator is None:
            return {}
        requests = []
        for slot in generating:
            params = slot.task.params
            n = slot.n_ctx - len(slot.tokens) - 2
            if params.n_predict > 0:
                n = min(n, params.n_predict - slot.n_decoded - 1)
            if n > 0:
                requests.append(DraftRequest(slot.id, n, slot.sampled, slot.tokens))
        return self.speculator.draft(requests) if requests else {}
    # --8<-- [end:draft]

    # --8<-- [start:start_prompt]
    def _start_prompt(self, slot: Slot) -> bool:
        """Decide how much of the cached tokens the new prompt keeps (``cache_prompt``,
        ``n_cache_reuse``, checkpoints), drop the rest from the memory. False: the task
        finished here (``n_predict = 0`` does not sample, it only caches the prompt... it
        still needs the decode, so this returns True for it)."""
        task, params = slot.task, slot.task.params
        n_past = common_prefix(slot.tokens, task.tokens) if params.cache_prompt else 0
        n_reuse = params.n_cache_reuse or self.config.n_cache_reuse
        if params.cache_prompt and n_reuse > 0 and self.memory.can_shift():
            n_past = self._cache_reuse(slot, task.tokens, n_past, n_reuse)
        n_past = self._restore_if_needed(slot, n_past, len(task.tokens))
        if n_past == len(task.tokens):  # [TAG_PROMPT_LOGITS]: evaluate at least one token
            n_past -= 1
        if not self.memory.seq_rm(slot.id, n_past, -1):
            self._clear(slot)  # a memory that cannot drop a suffix: start again
            n_past = 0
        del slot.tokens[n_past:]
        slot.checkpoints = [c for c in slot.checkpoints if c.n_tokens <= n_past]
        slot.n_prompt_cached = n_past
        self.report.n_prompt_cached += n_past
        slot.state = SlotState.PROCESSING_PROMPT
        return True
    # --8<-- [end:start_prompt]

    def _cache_reuse(self, slot: Slot, prompt: list[int], n_past: int, n_reuse: int) -> int:
        """``--cache-reuse``: chunks of at least ``n_reuse`` cached tokens that reappear later
        in the prompt are shifted into place (server-context.cpp:3209-3262)."""
        cache = slot.tokens
        head_c = head_p = n_past
        while head_c < len(cache) and head_p < len(prompt):
            n_match = 0
            while (head_c + n_match < len(cache) and head_p + n_match < len(prompt)
                   and cache[head_c + n_match] == prompt[head_p + n_match]):
                n_match += 1
            if n_match >= n_reuse:
                kv_shift = head_p - head_c
                self.memory.seq_rm(slot.id, head_p, head_c)
                self.memory.seq_add(slot.id, head_c, head_c + n_match, kv_shift)
                for i in range(n_match):
                    cache[head_p + i] = cache[head_c + i]
                n_past += n_match
                head_c += n_match
                head_p += n_match
            else:
                head_c += 1
        del cache[n_past:]
        return n_past

    # --8<-- [start:restore_if_needed]
    def _restore_if_needed(self, slot: Slot, n_past: int, n_prompt: int) -> int:
        r"""How many cached tokens the memory can really continue from.

        The first token decoded is at position $p = n_{past}$ (or $n_{past} - 1$ when the whole
        prompt is cached, see [TAG_PROMPT_LOGITS]). A SWA layer lets it see the keys at
        $p - n_{swa} < q \le p$, so the cache must still hold $q_{min} = \max(0, p - n_{swa} + 1)$;
        a recurrent state must be exactly the state after position $p - 1$. When that is not
        so, the newest checkpoint taken at or before $p$ is restored (``PARTIAL_ONLY``) and
        decoding resumes from it; without one (or if the restore fails), from the start.

        llama.cpp tests ``pos_min >= max(0, p - n_swa)``, which is also true when nothing was
        evicted (a short context has ``pos_min = 0 >= 0``) and then restores or re-processes
        for nothing (notes, bug 7); the test here is the exact one.
        """
        if n_past == 0 or not (self.recurrent or self.n_swa > 0):
            return n_past
        p = n_past if n_past < n_prompt else n_past - 1
        if self.recurrent:
            ok = self.memory.seq_pos_max(slot.id) == p - 1
        else:
            ok = self.memory.seq_pos_min(slot.id) <= max(0, p - self.n_swa + 1)
        if ok:
            return n_past
        for ckpt in reversed(slot.checkpoints):
            if ckpt.n_tokens > p or ckpt.n_tokens == 0:
                continue
            try:
                self.ctx.state_seq_set_data_ext(ckpt.data, slot.id,
                                                LLAMA_STATE_SEQ_FLAGS_PARTIAL_ONLY)
            except LlamarefError:
                break  # a checkpoint that does not fit: process the prompt again
            return ckpt.n_tokens
        self._clear(slot)
        return 0
    # --8<-- [end:restore_if_needed]

    # --8<-- [start:add_prompt_chunk]
    def _add_prompt_chunk(self, slot: Slot, tok, pos, seq, out, limit: int) -> None:
        """Prompt tokens of ``slot`` until the batch holds ``limit`` tokens; a checkpoint
        of the memory *before* the chunk when the memory needs one (server-context.cpp:
        3441-3620).

        With checkpoints on, a chunk also stops where a checkpoint is wanted next: at the
        start of the last user message, at a user message at least ``checkpoint_min_step``
        tokens past the last checkpoint, and ``4 + n_ubatch`` and ``4`` tokens before the
        prompt's end. The next chunk then checkpoints before it is decoded.
        """
        task, prompt = slot.task, slot.task.tokens
        starts = set(task.user_starts)
        last_user = task.user_starts[-1] if task.user_starts else -1
        do_ckpt = self.do_checkpoints and task.params.n_predict != 0
        min_step = self.config.checkpoint_min_step
        n_start, n_prev = len(slot.tokens), len(tok)
        while len(slot.tokens) < len(prompt) and len(tok) < limit:
            i = len(slot.tokens)
            tok.append(prompt[i])
            pos.append(i)
            seq.append([slot.id])
            out.append(False)
            slot.tokens.append(prompt[i])
            if not do_ckpt:
                continue
            n = len(slot.tokens)
            if n in starts and (n == last_user or not slot.checkpoints
                                or n > slot.checkpoints[-1].n_tokens + min_step):
                break
            if any(len(prompt) == n + min(self.n_batch, off) for off in (4 + self.n_ubatch, 4)):
                break
        slot.n_prompt_processed += len(tok) - n_prev
        done = len(slot.tokens) == len(prompt)
        if done:
            slot.state = SlotState.DONE_PROMPT
            out[-1] = True
            slot.i_batch = len(tok) - 1
        if not do_ckpt:
            return
        near_end = len(prompt) < len(slot.tokens) + self.n_ubatch
        if not (done or near_end or n_start in starts):
            return  # no ordinary mid-prompt checkpoints
        pos_min = self.memory.seq_pos_min(slot.id)
        if pos_min >= 0 and (not slot.checkpoints or n_start == last_user or near_end
                             or n_start > slot.checkpoints[-1].n_tokens + min_step):
            self._create_checkpoint(slot, n_start, pos_min)
    # --8<-- [end:add_prompt_chunk]

    def _create_checkpoint(self, slot: Slot, n_tokens: int, pos_min: int) -> None:
        """``create_checkpoint`` (server-context.cpp:2290-2354): thin out checkpoints of other
        tasks closer than ``checkpoint_min_step`` when the list is full, evict the oldest,
        replace one at the same ``n_tokens``, then save the partial state."""
        cps, limit = slot.checkpoints, self.config.n_ctx_checkpoints
        if len(cps) + 1 >= limit:
            kept, last = [], -1
            for c in cps:
                if (c.id_task != slot.task.id and last >= 0
                        and c.n_tokens <= last + self.config.checkpoint_min_step):
                    continue
                last = c.n_tokens
                kept.append(c)
            cps[:] = kept
        while len(cps) >= limit:
            cps.pop(0)
        cps[:] = [c for c in cps if c.n_tokens != n_tokens]
        data = self.ctx.state_seq_get_data_ext(slot.id, LLAMA_STATE_SEQ_FLAGS_PARTIAL_ONLY)
        cps.append(Checkpoint(n_tokens, pos_min, self.memory.seq_pos_max(slot.id), data,
                              slot.task.id))

    # ---- decode ------------------------------------------------------------------------------

    # --8<-- [start:decode]
    def _decode(self, batch: Batch, n_gen: int) -> None:
        """Decode ``batch`` in chunks of ``n_batch``; on 1 (cache full) purge an idle slot or
        halve the chunk and retry the same offset (server-context.cpp:3628-3722)."""
        n_total, n_batch, off = len(batch.token), self.n_batch, 0
        report = self.report
        t0 = self.clock()
        while off < n_total:
            n = min(n_batch, n_total - off)
            sub = Batch(token=batch.token[off:off + n], pos=batch.pos[off:off + n],
                        seq_id=batch.seq_id[off:off + n], logits=batch.logits[off:off + n])
            ret = self.ctx.decode(sub)
            if ret != 0:
                if ret < 0 or (ret == 1 and n_batch == 1):
                    self.fail_processing("Context size has been exceeded." if ret == 1
                                         else "Invalid input batch." if ret == -1
                                         else "Compute error.")
                    return
                report.n_cache_misses += 1
                if not self._purge_idle_slot():
                    n_batch = max(1, n_batch // 2)
                continue
            report.n_decode += 1
            report.n_busy_slots += sum(s.is_processing for s in self.slots)
            self._post_decode(off, n)
            off += n
            n_batch = self.n_batch
        report.t_decode_ms = 1e3 * (self.clock() - t0)
        report.n_batch_tokens, report.n_prompt_tokens = n_total, n_total - n_gen
        report.n_tokens_max = max((len(s.tokens) for s in self.slots), default=0)
    # --8<-- [end:decode]

    def _purge_idle_slot(self) -> bool:
        """``try_clear_idle_slots``: with a unified cache, drop one idle slot's cells."""
        if not self.ctx.kv_unified:
            return False
        for slot in self.slots:
            if not slot.is_processing and slot.tokens:
                if self.prompt_cache is not None:
                    self.prompt_cache.save(self.ctx, slot.id, slot.tokens, slot.checkpoints)
                self._clear(slot)
                return True
        return False

    def fail_processing(self, message: str) -> None:
        """A decode that cannot succeed: every request being processed gets the error
        (a [`ServerError`][reference.tools.server.errors.ServerError] saying ``message``),
        its slot is released and cleared; the server goes on. The driver calls it too, when
        a step raised (a bug must not take the server down)."""
        for slot in self.slots:
            if slot.is_processing:
                task = slot.task
                task.emit(Failed(task.id, task.index, ServerError(message)))
                self._release(slot)
                self._clear(slot)

    def _post_decode(self, off: int, n: int) -> None:
        """Children of a parent whose prompt is done get its sequence; then every slot with
        an output row in ``[off, off + n)`` samples (``post_decode``)."""
        for slot in self.slots:
            if slot.state == SlotState.DONE_PROMPT and slot.task.children and off <= (
                    slot.i_batch) < off + n:
                for child in self.slots:
                    if (child.state == SlotState.WAIT_OTHER
                            and child.task.id_parent == slot.task.id):
                        self.memory.seq_rm(child.id, -1, -1)
                        self.memory.seq_cp(slot.id, child.id, -1, -1)
                        child.tokens = list(slot.tokens)
                        child.i_batch = slot.i_batch
                        child.n_prompt_cached = slot.n_prompt_cached
                        child.n_prompt_processed = slot.n_prompt_processed
                        child.t_start_prompt = slot.t_start_prompt
                        child.state = SlotState.DONE_PROMPT
        for slot in self.slots:
            if slot.state == SlotState.GENERATING and slot.spec_draft:
                self._collect_rows(slot, off, n)
                continue
            if not off <= slot.i_batch < off + n:
                continue
            if slot.state == SlotState.DONE_PROMPT:
                now = self.clock()
                slot.t_prompt_ms = 1e3 * (now - slot.t_start_prompt)
                slot.t_start_gen = now
                slot.state = SlotState.GENERATING
                if slot.task.params.n_predict == 0:
                    self._finish(slot, "limit")
                    continue
            elif slot.state != SlotState.GENERATING:
                continue
            self._sample(slot, slot.i_batch - off)
            slot.i_batch = -1

    def _collect_rows(self, slot: Slot, off: int, n: int) -> None:
        """Keep the rows of ``[sampled, *draft]`` that chunk ``[off, off + n)`` decoded; once
        all are there, verify the draft."""
        first = slot.i_batch + len(slot.spec_rows)
        want_host = not slot.on_device or slot.task.params.n_probs > 0
        for r in range(max(first, off), min(slot.i_batch + len(slot.spec_draft) + 1, off + n)):
            host = np.array(self.ctx.get_logits_ith(r - off)) if want_host else None
            row = self.ctx.get_logits_ith_device(r - off) if slot.on_device else host
            slot.spec_rows.append((row, host))
        if len(slot.spec_rows) == len(slot.spec_draft) + 1:
            slot.i_batch = -1
            self._verify(slot)

    # --8<-- [start:verify]
    def _verify(self, slot: Slot) -> None:
        """``common_sampler_sample_and_accept_n`` on the slot's rows, then each accepted
        token is processed as a plain one would be (server-context.cpp:3878-3990).

        The slot's tokens and its cells are cut to what plain decoding would hold: the
        tokens before each processed token while processing it (so the context limit is
        checked alike), and after the last one, the tokens up to it, without it. A stop
        inside the accepted tokens (a stop string, an end-of-generation token, ``n_predict``)
        ends the answer there, and the later accepted tokens leave the cache. (llama.cpp
        keeps them in the slot's cache; the answer is the same.)
        """
        draft, rows = slot.spec_draft, slot.spec_rows
        slot.spec_draft, slot.spec_rows = [], []
        base = len(slot.tokens) - len(draft)  # the tokens through the sampled one
        outputs: list[TokenOutput] = []

        def sample(i: int) -> int:
            row, host = rows[i]
            token, output = self._sample_from(slot, row, lambda: host)
            outputs.append(output)
            return token

        try:
            ids = sample_and_accept_n(sample, draft, self.tokenizer.is_eog)
        except Exception as e:  # noqa: BLE001 - one request's sampler must not stop the others
            del slot.tokens[base:]
            self.memory.seq_rm(slot.id, base, -1)
            task = slot.task
            self._release(slot)
            task.emit(Failed(task.id, task.index, sampling_failure(e)))
            return
        self.report.n_draft_accepted += len(ids) - 1
        self.report.n_draft_verified += 1
        del slot.tokens[base:]
        for i, (token, output) in enumerate(zip(ids, outputs, strict=True)):
            if i:
                slot.tokens.append(ids[i - 1])
            if self._process_token(slot, token, output):
                break
        self.memory.seq_rm(slot.id, len(slot.tokens), -1)
    # --8<-- [end:verify]

    # ---- sampling and text ---------------------------------------------------------------------

    # --8<-- [start:sample]
    def _sample(self, slot: Slot, row: int) -> None:
        """Sample, accept, and process the token (``process_token``). A sampler that raises
        fails this slot's task alone: the slot is released with its cache (which holds what
        was decoded), and the other slots go on."""
        try:
            token, output = self._sample_token(slot, row)
        except Exception as e:  # noqa: BLE001 - one request's sampler must not stop the others
            task = slot.task
            self._release(slot)
            task.emit(Failed(task.id, task.index, sampling_failure(e)))
            return
        self._process_token(slot, token, output)

    def _process_token(self, slot: Slot, token: int, output: TokenOutput) -> bool:
        """``process_token``: the token joins the answer; stop strings, end of generation
        and the limits are checked, the new text streamed. True: the task finished."""
        params = slot.task.params
        slot.sampled = token
        slot.n_decoded += 1
        self.report.n_tokens_predicted += 1
        slot.generated.append(token)
        text, stop_word = slot.text.push(output.piece)
        is_eog = self.tokenizer.is_eog(token)
        slot.unsent_tokens.append(token)
        if params.n_probs > 0:
            slot.unsent_probs.append(output)
            slot.probs.append(output)
        stop = None
        if stop_word is not None:
            slot.stopping_word, stop = stop_word, "word"
        elif is_eog:
            stop = "eos"
        elif not self.config.ctx_shift and len(slot.tokens) + 1 >= slot.n_ctx:
            slot.truncated, stop = True, "limit"
        elif params.n_predict > 0 and slot.n_decoded >= params.n_predict:
            stop = "limit"
        if "\n" in text:
            slot.has_new_line = True
            if (params.t_max_predict_ms > 0 and stop is None and 1e3 * (
                    self.clock() - slot.t_start_gen) > params.t_max_predict_ms):
                stop = "limit"
        slot.content += text
        if stop is not None and stop != "word":
            slot.content += slot.text.flush()  # held partial matches are text after all
        if params.stream and (len(slot.content) > slot.n_sent or params.n_probs > 0):
            self._send_partial(slot)  # the last token too: the final result has no text
        if stop is not None:
            self._finish(slot, stop)
        return stop is not None
    # --8<-- [end:sample]

    def _sample_token(self, slot: Slot, row: int) -> tuple[int, TokenOutput]:
        """The sampler's token for output ``row``, accepted, with its probabilities."""
        logits = (self.ctx.get_logits_ith_device(row) if slot.on_device
                  else self.ctx.get_logits_ith(row))
        return self._sample_from(slot, logits, lambda: self.ctx.get_logits_ith(row))

    def _sample_from(self, slot: Slot, logits: Any,
                     host: Callable[[], Any]) -> tuple[int, TokenOutput]:
        """The sampler's token for a row (``logits`` as the sampler takes them; ``host()``
        the same row on the host, read only for ``n_probs``), accepted, with its
        probabilities."""
        token = int(slot.sampler.sample(logits))
        slot.sampler.accept(token)
        output = TokenOutput(token, self.tokenizer.token_to_piece(token, special=False), 0.0)
        if slot.task.params.n_probs > 0:
            self._token_probs(slot, host(), output)
        return token, output

    def _token_probs(self, slot: Slot, host: Any, output: TokenOutput) -> None:
        """The token's probability and the top ``n_probs`` candidates: the softmax of the
        raw logits, or the sampler's candidates (``post_sampling_probs``; zeros dropped)."""
        n = slot.task.params.n_probs
        if slot.task.params.post_sampling_probs and getattr(slot.sampler, "cur", None) is not None:
            cur = slot.sampler.cur
            ids, p = np.asarray(cur.ids), np.asarray(cur.p, np.float64)
            order = np.argsort(-p, kind="stable")
        else:
            z = np.asarray(host, np.float64)
            p = np.exp(z - z.max())
            p /= p.sum()
            ids = np.arange(p.size)
            order = np.argsort(-p, kind="stable")
        sel = np.nonzero(ids == output.id)[0]
        output.prob = float(p[sel[0]]) if sel.size else 0.0
        top = []
        for i in order[:n]:
            if slot.task.params.post_sampling_probs and p[i] == 0:
                break
            top.append(TokenProb(int(ids[i]),
                                 self.tokenizer.token_to_piece(int(ids[i]), special=False),
                                 float(p[i])))
        output.top = top

    def _send_partial(self, slot: Slot) -> None:
        """Stream the text not sent yet, with its tokens (and their probabilities)."""
        task = slot.task
        timings = self._timings(slot) if task.params.timings_per_token else None
        task.emit(Partial(task.id, task.index, slot.id, slot.content[slot.n_sent:],
                          slot.unsent_tokens, slot.unsent_probs, slot.n_decoded,
                          len(task.tokens), timings, task.params.return_tokens))
        slot.n_sent = len(slot.content)
        slot.unsent_tokens, slot.unsent_probs = [], []

    def _timings(self, slot: Slot) -> Timings:
        gen_ms = 1e3 * (self.clock() - slot.t_start_gen) if slot.t_start_gen else 0.0
        return Timings(cache_n=slot.n_prompt_cached, prompt_n=slot.n_prompt_processed,
                       prompt_ms=slot.t_prompt_ms, predicted_n=slot.n_decoded,
                       predicted_ms=gen_ms)

    # --8<-- [start:finish]
    def _finish(self, slot: Slot, stop_type: str) -> None:
        """Send the final result and release the slot (``send_final_response``)."""
        task, params = slot.task, slot.task.params
        slot.stop_type = stop_type
        timings = self._timings(slot)
        slot.t_gen_ms = timings.predicted_ms
        if params.stream:
            content, tokens, probs = (slot.content[slot.n_sent:], slot.unsent_tokens,
                                      slot.unsent_probs)
        else:
            content, tokens, probs = slot.content, list(slot.generated), list(slot.probs)
        final = Final(task.id, task.index, slot.id, content, tokens, stop_type,
                      slot.stopping_word, slot.n_decoded, len(task.tokens),
                      slot.n_prompt_cached, len(slot.tokens), slot.truncated,
                      slot.has_new_line, timings, probs)
        self._release(slot)
        task.emit(final)
    # --8<-- [end:finish]

    def _release(self, slot: Slot) -> None:
        """``server_slot::release``: the slot is idle; a child's sequence is dropped (the
        parent's cache is enough)."""
        task = slot.task
        if task is not None and task.id_parent >= 0:
            self._clear(slot)
        slot.task, slot.state, slot.i_batch = None, SlotState.IDLE, -1
        slot.n_decoded = 0  # an idle slot has decoded nothing (server_slot::release)
        slot.t_last_used = self.clock()

    def _clear(self, slot: Slot) -> None:
        """``prompt_clear``: drop the slot's sequence and forget its tokens (in the draft
        too)."""
        self.memory.seq_rm(slot.id, -1, -1)
        slot.tokens, slot.checkpoints = [], []
        if self.speculator is not None:
            self.speculator.forget(slot.id)

    # ---- the slot actions ------------------------------------------------------------------

    def slot_save(self, id_slot: int, path: str) -> dict:
        """``/slots/{id}?action=save``: the slot's sequence and tokens to ``path``."""
        slot = self._idle_slot(id_slot)
        t0 = self.clock()
        n_written = self.ctx.state_seq_save_file(path, slot.id, slot.tokens)
        return {"id_slot": slot.id, "n_saved": len(slot.tokens), "n_written": n_written,
                "timings": {"save_ms": 1e3 * (self.clock() - t0)}}

    def slot_restore(self, id_slot: int, path: str) -> dict:
        """``/slots/{id}?action=restore``: a saved sequence back into the slot. A file that is
        missing, does not load or does not fit leaves the slot as it was (its tokens, its
        checkpoints and its cells), and the error names neither the path nor the file's
        bytes."""
        slot = self._idle_slot(id_slot)
        t0 = self.clock()
        kept = (list(slot.tokens), list(slot.checkpoints),
                self.ctx.state_seq_get_data(slot.id) if slot.tokens else b"")
        try:
            tokens = self._load_slot_file(slot, path)
        except ServerError:
            self._put_back(slot, kept)
            raise
        slot.tokens, slot.checkpoints = tokens, []
        return {"id_slot": slot.id, "n_restored": len(tokens), "n_read": os.path.getsize(path),
                "timings": {"restore_ms": 1e3 * (self.clock() - t0)}}

    def _load_slot_file(self, slot: Slot, path: str) -> list[int]:
        """The slot's sequence replaced by the file's; its tokens."""
        self.memory.seq_rm(slot.id, -1, -1)
        try:
            tokens = [int(t) for t in self.ctx.state_seq_load_file(path, slot.id)]
        except FileNotFoundError:
            raise NotFound("Unable to restore slot: no such file") from None
        except (LlamarefError, OSError, ValueError):
            raise InvalidRequest("Unable to restore slot: the file is not a slot file of "
                                 "this model and context") from None
        if len(tokens) >= slot.n_ctx:
            raise InvalidRequest(f"Unable to restore slot: {len(tokens)} tokens do not fit "
                                 f"the slot's context ({slot.n_ctx})")
        return tokens

    def _put_back(self, slot: Slot, kept: tuple[list[int], list[Checkpoint], bytes]) -> None:
        """The slot as it was before a failed restore."""
        tokens, checkpoints, data = kept
        self.memory.seq_rm(slot.id, -1, -1)
        if data:
            self.ctx.state_seq_set_data(data, slot.id)
        slot.tokens, slot.checkpoints = tokens, checkpoints

    def slot_erase(self, id_slot: int) -> dict:
        """``/slots/{id}?action=erase``: forget the slot's cache."""
        slot = self._idle_slot(id_slot)
        n = len(slot.tokens)
        self._clear(slot)
        return {"id_slot": slot.id, "n_erased": n}

    def _idle_slot(self, id_slot: int) -> Slot:
        if not 0 <= id_slot < len(self.slots):
            raise NotFound(f"Invalid slot ID: {id_slot} (this server has {len(self.slots)} "
                           "slots)")
        slot = self.slots[id_slot]
        if slot.is_processing:
            raise Unavailable(f"slot {id_slot} is busy")
        return slot
