r"""Generation: the loop of llama.cpp's ``llama-completion`` / ``llama-simple``, and chat turns.

Text generation is three verbs on a [`Context`][reference.context.Context], repeated:

1. **evaluate the prompt**: decode its tokens in batches of at most ``n_batch`` (only the last
   token asks for logits), and push each of them into the sampler's history, as
   ``llama-completion`` does ("push the prompt in the sampling context in order to apply
   repetition penalties later");
2. **sample** the next token from the last logits row
   ([`SamplerChain`][reference.sampling.SamplerChain]) and *accept* it (it joins the history that
   the penalties read);
3. **decode** that one token at the next position, and go back to 2, until an end-of-generation
   token (``llama_vocab_is_eog``), ``n_predict`` tokens, or a full context.

**Context shift.** When the next decode would fill the context (``n_past + n_new >= n_ctx``),
``llama-completion`` frees room instead of stopping: it keeps the first ``n_keep`` tokens
(the BOS token at least), discards half of the rest,

$$ n_{discard} = \left\lfloor \frac{n_{past} - n_{keep}}{2} \right\rfloor, $$

and moves the tail back ([`reference.context.context_shift`][reference.context.context_shift]:
``seq_rm`` then ``seq_add``; the keys are re-roped at the next decode). Generation goes on with
$n_{past} - n_{discard}$ tokens of context. llama.cpp's default at the pinned commit is *off*
(``ctx_shift = false`` in ``common.h``); ``llamaref generate`` turns it on unless
``--no-context-shift`` is given.

**Self-Extend** (``--grp-attn-n G --grp-attn-w W``, [`reference.tools.self_extend`][]). With
$G > 1$ there is no context shift: before every decode (a prompt chunk or a sampled token)
the loop of ``llama-completion`` groups each complete block of $W$ ungrouped positions
([`apply_group_attention`][reference.tools.self_extend.apply_group_attention]), so the cache holds
token $t$ at $\lfloor t/G \rfloor$ or $t - K(W - W/G)$
([`self_extend_positions`][reference.tools.self_extend.self_extend_positions]). Every token still
takes a cell: the context must hold them all, and generation stops when it is full.

**Chat keeps the cache.** A chat turn renders the whole conversation with the model's chat
template, tokenizes it, and compares it with the tokens already in the cache: only the new
suffix is decoded (``seq_rm`` drops whatever differs, e.g. a reply the template re-renders
differently). Turn $n$ then costs the new user message, not the whole history.

The loop is written once against the Context protocol: either twin's Context runs it. Which
twin runs it is the application's choice ([`llamaref.backends`][llamaref.backends]).

**Pipelined, on a device.** When the sampler runs on the device and can sample ahead (the MLX
sampler chain's ``pipelined``: no stage reads the history), [`Generator.generate`][] keeps
the token on the device, as mlx-lm's ``generate_step`` does: it decodes token $t$ before
reading it back ([`decode_token`][reference.context.Context.decode_token]), launches the sample of
token $t + 1$ behind it, and only then waits for token $t$. The device computes step
$t + 1$ while the host reads token $t$, yields it, and does the next step's bookkeeping. The
tokens, the cache and the sampler's state are the sequential loop's: a step decoded ahead is
undone (its draw taken back, and its position: ``seq_rm`` from a KV cache; a recurrent state
cannot drop a position, so its memory's ``backup``, taken before the step, is put back) when
generation stops at token $t$ (an end-of-generation token, ``n_predict``, the caller closing
the generator) or when the device's token was redone on the host; no step is taken ahead
when the next decode would need a context shift.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from reference.batch import Batch
from reference.common import LlamarefError
from reference.context import Context, ContextError, context_shift
from reference.tokenizer import StreamDecoder
from reference.tools.self_extend import (
    SWA_GROUPED,
    SelfExtendError,
    apply_group_attention,
    check_group_attention,
    check_self_extend_memory,
)

#: ``llama-completion`` keeps 4 cells free: a prompt longer than ``n_ctx - 4`` is refused here.
N_CTX_MARGIN = 4


class GenerateError(LlamarefError, ValueError):
    """A generation that cannot go on: a prompt that does not fit, a failed decode."""


def eog_tokens(tokenizer) -> list[int]:
    """Every end-of-generation token id (``llama_vocab_is_eog``), for ``--ignore-eos``."""
    return [t for t in range(tokenizer.n_vocab) if tokenizer.is_eog(t)]


# --8<-- [start:Perf]
@dataclass
class Perf:
    """What ``llama_perf_context_print`` reports: times in ms and token counts.

    A decode of more than one token counts as prompt evaluation, a one-token decode as
    evaluation (``llama_context::decode``'s bookkeeping).
    """

    t_load_ms: float = 0.0
    t_p_eval_ms: float = 0.0
    n_p_eval: int = 0
    t_eval_ms: float = 0.0
    n_eval: int = 0
    n_reused: int | None = None
    t_start: float = 0.0

    def add(self, n_tokens: int, seconds: float) -> None:
        """Count one successful decode of ``n_tokens`` that took ``seconds``."""
        if n_tokens > 1:
            self.t_p_eval_ms += 1e3 * seconds
            self.n_p_eval += n_tokens
        else:
            self.t_eval_ms += 1e3 * seconds
            self.n_eval += n_tokens

    def lines(self) -> list[str]:
        """The report, line by line, in ``llama_perf_context_print``'s format.

        Examples:
            >>> p = Perf(t_load_ms=12.5, t_p_eval_ms=40.0, n_p_eval=8, t_eval_ms=30.0, n_eval=3)
            >>> print(p.lines()[1])
            llama_perf_context_print: prompt eval time =      40.00 ms /     8 tokens (    5.00 ms per token,   200.00 tokens per second)
        """  # noqa: E501
        name = "llama_perf_context_print"
        total_ms = 1e3 * (time.perf_counter() - self.t_start) if self.t_start else 0.0
        out = [
            f"{name}:        load time = {self.t_load_ms:10.2f} ms",
            f"{name}: prompt eval time = {self.t_p_eval_ms:10.2f} ms / {self.n_p_eval:5d} tokens "
            f"({_per(self.t_p_eval_ms, self.n_p_eval)})",
            f"{name}:        eval time = {self.t_eval_ms:10.2f} ms / {self.n_eval:5d} runs   "
            f"({_per(self.t_eval_ms, self.n_eval)})",
            f"{name}:       total time = {total_ms:10.2f} ms / {self.n_p_eval + self.n_eval:5d} "
            "tokens",
        ]
        if self.n_reused is not None:
            out.append(f"{name}:    graphs reused = {self.n_reused:10d}")
        return out
# --8<-- [end:Perf]


def _per(ms: float, n: int) -> str:
    if n == 0 or ms == 0:
        return f"{'nan':>8s} ms per token, {'nan':>8s} tokens per second"
    return f"{ms / n:8.2f} ms per token, {1e3 * n / ms:8.2f} tokens per second"


# --8<-- [start:Generator]
class Generator:
    """One sequence (``seq_id`` 0) of a Context, a sampler, and the tokens in the cache.

    Args:
        ctx: a fresh [`Context`][reference.context.Context] (or its accelerated twin).
        sampler: a ``SamplerChain`` (``.sample(logits)``, ``.accept(token)``).
        n_keep: tokens kept at the start when the context shifts (``--keep``).
        shift: shift the context when it is full (True), or stop generating (False).
        perf: where decode times are counted.
        on_device: sample from ``ctx.get_logits_ith_device`` (an ``mx.array``; the MLX
            sampler) instead of the NumPy row.
        ga_n: Self-Extend's group size ``G`` (``--grp-attn-n``; 1: none).
        ga_w: Self-Extend's block width ``W`` (``--grp-attn-w``), a multiple of ``ga_n``.
        ga_swa: what Self-Extend does to a sliding-window model's SWA layers
            (``--grp-attn-swa``): ``"grouped"`` (llama.cpp: every cell's position, so the
            SWA cache must keep them all, ``--swa-full``) or ``"exact"`` (the full-attention
            layers only; [`reference.tools.self_extend`][] states both).

    Attributes:
        tokens: the tokens in the cache, in position order (``tokens[p]`` is at position
            ``p``; with Self-Extend at
            [`self_extend_positions`][reference.tools.self_extend.self_extend_positions]);
            ``len(tokens)`` is llama.cpp's ``n_past`` (without Self-Extend).
        ga_i: positions grouped so far (llama.cpp's ``ga_i``).

    Raises:
        SelfExtendError: ``ga_n > 1`` with ``shift`` (no context shift with Self-Extend), a
            bad ``ga_w`` or ``ga_swa``, or a memory that cannot move the positions
            ([`check_self_extend_memory`][reference.tools.self_extend.check_self_extend_memory]:
            a recurrent model, a SWA cache without ``--swa-full``).

    Examples:
        >>> import numpy as np
        >>> from reference.testing import tiny_hparams, random_weights
        >>> hp = tiny_hparams()
        >>> class Greedy:
        ...     def sample(self, logits): return int(np.argmax(logits))
        ...     def accept(self, token): pass
        >>> g = Generator(Context(hp, random_weights(hp), n_ctx=256), Greedy())
        >>> g.eval_prompt([1, 2, 3])
        >>> len(list(g.generate(5, is_eog=lambda t: False))), len(g.tokens)
        (5, 7)
    """

    def __init__(self, ctx: Context, sampler: Any, n_keep: int = 0, shift: bool = True,
                 perf: Perf | None = None, on_device: bool = False, ga_n: int = 1,
                 ga_w: int = 512, ga_swa: str = SWA_GROUPED):
        check_group_attention(ga_n, ga_w)
        if ga_n > 1 and shift:
            raise SelfExtendError("Self-Extend (--grp-attn-n > 1) replaces the context shift: "
                                  "use shift=False (--no-context-shift)")
        if ga_n > 1:
            check_self_extend_memory(ctx.memory, ctx.recurrent, ga_swa)
        self.ga_n, self.ga_w, self.ga_i, self.ga_swa = ga_n, ga_w, 0, ga_swa
        self.ctx = ctx
        self.on_device = on_device and ctx.on_device
        # the token can stay on the device: decode it before reading it back
        self.pipelined = self.on_device and getattr(sampler, "pipelined", False)
        self.sampler = sampler
        self.n_keep = n_keep
        self.shift = shift
        self.perf = perf if perf is not None else Perf()
        self.tokens: list[int] = []
        self.stopped: str | None = None  # why generate() stopped early, if it did
        self._ahead_backup = None  # a recurrent memory's backup before a step decoded ahead

    @property
    def n_past(self) -> int:
        """How many positions of the sequence are in the cache."""
        return len(self.tokens)

    def _decode(self, tokens: list[int], sync: bool = True) -> float:
        """Decode ``tokens`` after the cache; count the time (``sync``: wait for the work).

        Returns:
            When it started (``time.perf_counter``): without ``sync`` the caller counts the
            time once it has waited.
        """
        if self.ga_n > 1:
            self.group_attention()
        t0 = time.perf_counter()
        ret = self.ctx.decode(Batch(token=tokens))
        if ret != 0:
            raise self._error(len(tokens), ret)
        self.tokens.extend(tokens)
        if sync:
            self.ctx.synchronize()  # the time counted is the computation's, as llama.cpp's
            self.perf.add(len(tokens), time.perf_counter() - t0)
        return t0

    def group_attention(self) -> None:
        """Self-Extend before a decode: ``llama-completion``'s loop on sequence 0.

        ``n_past`` is the cache's (``seq_pos_max(0) + 1``), as the decode's positions are.
        """
        n_past = self.ctx.memory.seq_pos_max(0) + 1
        self.ga_i, _ = apply_group_attention(self.ctx.memory, self.ga_i, n_past, self.ga_n,
                                             self.ga_w, swa=self.ga_swa)

    def _error(self, n_tokens: int, ret: int) -> GenerateError:
        reason = self.ctx.last_error or "no reason given"
        return GenerateError(f"decode of {n_tokens} tokens at position {self.n_past} "
                             f"returned {ret}: {reason}")
    # --8<-- [end:Generator]

    # --8<-- [start:eval_prompt]
    def eval_prompt(self, tokens: list[int]) -> None:
        """Decode ``tokens`` after what is cached, ``n_batch`` at a time; accept each one.

        Raises:
            GenerateError: the tokens do not fit in the context (``n_ctx - 4``), or a decode
                failed.
        """
        tokens = [int(t) for t in tokens]
        if not tokens:
            raise GenerateError("nothing to decode: the prompt is empty")
        room = self.ctx.n_ctx - N_CTX_MARGIN
        if not self.ctx.recurrent and self.n_past + len(tokens) > room:
            raise GenerateError(f"the prompt needs {self.n_past + len(tokens)} positions and the "
                                f"context holds {room} (n_ctx {self.ctx.n_ctx} - "
                                f"{N_CTX_MARGIN}): use a larger -c/--ctx-size")
        for token in tokens:  # the prompt joins the penalties' history
            self.sampler.accept(token)
        for i in range(0, len(tokens), self.ctx.n_batch):
            self._decode(tokens[i : i + self.ctx.n_batch])
    # --8<-- [end:eval_prompt]

    # --8<-- [start:sample]
    def sample(self) -> int:
        """Sample from the last logits row and accept the token into the sampler."""
        if self.on_device:
            logits = self.ctx.get_logits_ith_device(-1)  # stays on the device
        else:
            logits = self.ctx.get_logits_ith(-1)  # (n_vocab,)
        token = int(self.sampler.sample(logits))
        self.sampler.accept(token)
        return token
    # --8<-- [end:sample]

    # --8<-- [start:shift_if_full]
    def shift_if_full(self, n_new: int) -> bool:
        """Make room for ``n_new`` tokens as ``llama-completion`` does; False if it cannot.

        When ``n_past + n_new >= n_ctx``: keep ``n_keep`` tokens, discard half of the rest
        ([`reference.context.context_shift`][reference.context.context_shift]), and forget them in
        `tokens`.
        """
        n_ctx = self.ctx.n_ctx
        if self.ctx.recurrent or self.n_past + n_new < n_ctx:
            return True  # a recurrent state has no cells to fill
        n_discard = (self.n_past - self.n_keep) // 2
        if not self.shift or n_discard < 1:
            return False
        context_shift(self.ctx, 0, self.n_keep, n_discard)
        del self.tokens[self.n_keep : self.n_keep + n_discard]
        return True
    # --8<-- [end:shift_if_full]

    # --8<-- [start:generate]
    def generate(self, n_predict: int, is_eog: Callable[[int], bool]) -> Iterator[int]:
        """Sample and decode up to ``n_predict`` tokens (-1: no limit); yield each one.

        Stops after an end-of-generation token (yielded, never decoded), after
        ``n_predict`` tokens, or when the context is full and cannot shift
        (`stopped` then says so). Call [`eval_prompt`][] first.

        With a pipelined sampler on a device (`pipelined`) the steps run ahead
        (`_generate_pipelined`): the same tokens, cache and sampler state.
        """
        self.stopped = None
        if self.pipelined:
            yield from self._generate_pipelined(n_predict, is_eog)
            return
        n = 0
        while n_predict < 0 or n < n_predict:
            token = self.sample()
            n += 1
            yield token
            if is_eog(token):
                return
            if n_predict >= 0 and n >= n_predict:
                return
            if not self.shift_if_full(1):
                self.stopped = (f"context full (n_ctx = {self.ctx.n_ctx}) and context shift "
                                "is disabled => stopping")
                return
            self._decode([token])
    # --8<-- [end:generate]

    # --8<-- [start:generate_pipelined]
    def _generate_pipelined(self, n_predict: int, is_eog: Callable[[int], bool]) -> Iterator[int]:
        """[`generate`][] with token $t$ decoded, and token $t + 1$ sampled, before $t$ is read.

        ``cur`` is the step being read back, ``ahead`` the step launched behind it (or None).
        Every way out undoes ``ahead`` (`_undo`), so what stays is what the sequential
        loop leaves; a ``cur`` left launched and not accepted (an exception on the way) is
        cancelled too, so the sampler counts no token that was never accepted.
        """
        n = 0
        cur, ahead = self._sample_async(), None
        cur_open = True  # cur is launched and not accepted yet
        t_cur = None  # when the decode that cur is sampled from started (None: counted)
        try:
            while True:
                n += 1
                more = n_predict < 0 or n < n_predict
                t0 = time.perf_counter()
                if more and self._can_run_ahead():
                    ahead = self._decode_ahead(cur)  # None if that decode failed
                token = self.sampler.resolve(cur)  # waits for token n
                if t_cur is not None:  # a sequential decode: its time ends with its token
                    self.perf.add(1, time.perf_counter() - t_cur)
                    t_cur = None
                if ahead is not None and cur.fell_back:  # the decode read another token
                    self._undo(ahead, draw_taken_back=True)  # resolve rewound the draws
                    ahead = None
                if ahead is not None:
                    self.tokens[-1] = token
                    self.perf.add(1, time.perf_counter() - t0)
                self.sampler.accept(token)
                cur_open = False
                yield token
                if is_eog(token) or not more:
                    return
                if ahead is None:  # not decoded yet: the sequential loop's step
                    if not self.shift_if_full(1):
                        self.stopped = (f"context full (n_ctx = {self.ctx.n_ctx}) and context "
                                        "shift is disabled => stopping")
                        return
                    t_cur = self._decode([token], sync=False)
                    cur = self._sample_async()
                else:
                    cur, ahead = ahead, None
                cur_open = True
        finally:
            if ahead is not None:
                self._undo(ahead)
            if cur_open:
                self.sampler.cancel(cur)

    def _sample_async(self):
        return self.sampler.sample_async(self.ctx.get_logits_ith_device(-1))

    def _can_run_ahead(self) -> bool:
        """A step can be undone, and needs no context shift first."""
        return (self.ga_n == 1  # a grouping cannot be undone
                and self.n_past + 1 < self.ctx.n_ctx)

    def _decode_ahead(self, cur):
        """Decode ``cur``'s token while it is on the device; launch the next sample behind it.

        A recurrent memory's ``backup`` is taken first, for `_undo` (on MLX it keeps the state
        rows, immutable arrays, and copies only the cells' bookkeeping). A failed decode
        changes nothing: the sequential step after the yield meets the same failure and
        raises it there.
        """
        backup = self.ctx.memory.backup() if self.ctx.recurrent else None
        if self.ctx.decode_token(cur.token) != 0:
            return None
        self.tokens.append(-1)  # known once cur resolves
        self._ahead_backup = backup
        return self._sample_async()

    def _undo(self, ahead, draw_taken_back: bool = False) -> None:
        """Take back a step decoded ahead: its position leaves the memory, its draw the RNG.

        A KV cache drops the position (``seq_rm``); a recurrent state, which cannot, gets
        back the backup taken before the step.
        """
        if not draw_taken_back:
            self.sampler.cancel(ahead)
        if self.ctx.recurrent:
            self.ctx.memory.restore(self._ahead_backup)
        else:
            self.ctx.memory.seq_rm(0, self.n_past - 1, -1)
        self._ahead_backup = None
        self.tokens.pop()
    # --8<-- [end:generate_pipelined]

    # --8<-- [start:sync_prefix]
    def sync_prefix(self, tokens: list[int]) -> list[int]:
        """Keep the longest cached prefix of ``tokens``; return the suffix left to decode.

        The cache keeps the common prefix (``seq_rm(0, n_common, -1)`` drops the rest); at
        least one token is always left to decode, so that its logits are fresh.

        Examples:
            >>> from reference.testing import tiny_hparams, random_weights
            >>> hp = tiny_hparams()
            >>> class S:
            ...     def accept(self, t): pass
            >>> g = Generator(Context(hp, random_weights(hp), n_ctx=256), S())
            >>> g.eval_prompt([1, 2, 3, 4])
            >>> g.sync_prefix([1, 2, 9, 9, 9]), g.tokens
            ([9, 9, 9], [1, 2])
            >>> g.sync_prefix([1, 2]), g.tokens
            ([2], [1])
        """
        if self.ga_n > 1:
            raise SelfExtendError("a prefix of a Self-Extended cache is not at its own "
                                  "positions: sync_prefix needs ga_n = 1")
        tokens = [int(t) for t in tokens]
        n_common = 0
        for a, b in zip(self.tokens, tokens, strict=False):
            if a != b:
                break
            n_common += 1
        n_common = min(n_common, len(tokens) - 1)
        if n_common < self.n_past:
            if not self.ctx.memory.seq_rm(0, n_common, -1):
                self.ctx.memory.clear()  # a recurrent memory refuses a partial removal
                n_common = 0
            del self.tokens[n_common:]
        return tokens[n_common:]
    # --8<-- [end:sync_prefix]


# --8<-- [start:ChatSession]
def chat_tokens(tokenizer: Any, messages: list[dict]) -> list[int]:
    r"""``messages`` rendered by the model's chat template, ready for the assistant's reply,
    as tokens (BOS added, special tokens parsed; a template that writes its own BOS does not
    get a second one).

    Examples:
        >>> from reference.model_loader import default_model_path
        >>> from reference.tokenizer import Tokenizer
        >>> tok = Tokenizer.from_gguf(default_model_path())
        >>> ids = chat_tokens(tok, [{"role": "user", "content": "Hi"}])
        >>> tok.detokenize(ids[-4:], unparse_special=True)
        '<|im_start|>assistant\n'
    """
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    tokens = tokenizer.tokenize(text, add_special=True, parse_special=True)
    bos = tokenizer.bos_id
    if len(tokens) >= 2 and tokens[0] == tokens[1] == bos:  # the template had its own BOS
        tokens = tokens[1:]
    return tokens


class ChatSession:
    """A conversation on a [`Generator`][]: render, decode the new suffix, reply.

    Args:
        generator: the generator (its cache holds the conversation so far).
        tokenizer: the model's tokenizer (``apply_chat_template``, ``tokenize``, ``is_eog``).
        system: an optional system prompt (the first message).
    """

    def __init__(self, generator: Generator, tokenizer: Any, system: str | None = None):
        self.generator = generator
        self.tokenizer = tokenizer
        self.messages: list[dict] = []
        if system:
            self.messages.append({"role": "system", "content": system})
        self.prompt_per_turn: list[int] = []  # length of the rendered conversation, per turn
        self.decoded_per_turn: list[int] = []  # how many of those each turn decoded

    def render(self) -> list[int]:
        """The conversation so far as tokens, ready for the assistant's reply."""
        return chat_tokens(self.tokenizer, self.messages)

    def turn(self, user: str, n_predict: int, emit: Callable[[str], None]) -> str:
        """Add ``user``'s message, decode only what the cache lacks, stream the reply.

        Returns:
            The reply (also added to the conversation).
        """
        self.messages.append({"role": "user", "content": user})
        tokens = self.render()
        suffix = self.generator.sync_prefix(tokens)
        self.generator.eval_prompt(suffix)
        self.prompt_per_turn.append(len(tokens))
        self.decoded_per_turn.append(len(suffix))
        stream = StreamDecoder(self.tokenizer)
        pieces = []
        for token in self.generator.generate(n_predict, self.tokenizer.is_eog):
            if self.tokenizer.is_eog(token):
                break
            piece = stream.push(token)
            pieces.append(piece)
            emit(piece)
        pieces.append(stream.flush())
        emit(pieces[-1])
        reply = "".join(pieces)
        self.messages.append({"role": "assistant", "content": reply})
        return reply
# --8<-- [end:ChatSession]


__all__ = [
    "ChatSession",
    "ContextError",
    "GenerateError",
    "Generator",
    "Perf",
    "eog_tokens",
]
