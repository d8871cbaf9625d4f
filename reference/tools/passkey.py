r"""Passkey retrieval: llama.cpp's ``examples/passkey/passkey.cpp``.

A number hidden in a long, repetitive text, and a question at the end: the model can only
answer by attending to the one sentence that holds it, however far back it is. It is the
test the Self-Extend paper uses to show that grouped positions still reach far tokens.

**The prompt** ([`passkey_prompt`][]): a fixed prefix, ``n_junk`` copies of a junk sentence
(the pass-key sentence inserted before copy ``i_pos``), and the question. The key and its
place come from C's unseeded ``rand()`` (glibc, [`GlibcRand`][]) unless ``--pos`` is given:
``i_pos = rand() % n_junk``, then ``passkey = rand() % 50000 + 1`` (30887 at position 133 by
default; 39384 with ``--pos``).

**The context** holds every token: $n_{ctx} = n_{ctx\_train} \cdot G + n_{keep}$, padded
to 256 ([`passkey_n_ctx`][]); the loop then works with ``n_ctx - n_keep``.

**The fill** ([`passkey_fill`][]) decodes the prompt in chunks of ``n_batch`` tokens at
explicit positions. With $G > 1$, before chunk $c \ge 1$ the previous chunk (at
$[n_{past} - B, n_{past})$, $B$ = ``n_batch``) is moved and divided::

    seq_add(0, n_past - B,           n_past,           ib*bd)   // back to its token index
    seq_div(0, n_past - B + ib*bd,   n_past + ib*bd,   G)       // grouped
    n_past = seq_pos_max(0) + 1

with $ib = c - 1$ and $bd = (B/G)(G - 1)$: every chunk but the last ends at
$\lfloor t / G \rfloor$ and the last one follows them contiguously, the same closed form as
``llama-completion``'s loop with $W = B$
([`self_extend_positions`][reference.tools.self_extend.self_extend_positions]). A prompt longer than
``n_ctx`` is shifted in by ``n_batch`` tokens at a time (``seq_rm`` after ``n_keep``, then
``seq_add``), and room for the answer is made the same way.

**The answer**: 16 greedy tokens, each decoded at ``n_past++``; the key is found when its
digits are in them ([`PasskeyResult.found`][]). Printout: llama.cpp's lines on the
information stream, the answer on the output stream.

Where this differs from ``passkey.cpp``: the divided keys are rotated the right way (our
``seq_div``; llama.cpp's rotates them to $2p - p/G$, divergence 7), and ``n_ctx`` can be given
(``passkey.cpp`` always uses the formula above; with $G = 1$ its fill then runs past the
cache for prompts longer than $n_{ctx\_train}$, whose last chunk fails to decode).
"""

from __future__ import annotations

import codecs
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from reference.batch import Batch
from reference.common import LlamarefError
from reference.memory.kv_cache import n_ctx_seq

PROMPT_PREFIX = ("There is an important info hidden inside a lot of irrelevant text. Find it and "
                 "memorize them. I will quiz you about the important information there.")
PROMPT_SUFFIX = " What is the pass key? The pass key is"
JUNK = " The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."

#: tokens generated for the answer (``n_predict``)
N_PREDICT = 16


class PasskeyError(LlamarefError, ValueError):
    """Bad passkey parameters, or a decode that failed (with llama.cpp's message)."""


# --8<-- [start:GlibcRand]
class GlibcRand:
    r"""C's ``rand()`` as glibc computes it, seeded with 1 (``passkey.cpp`` never seeds it).

    The additive feedback generator of glibc's ``random_r`` (TYPE_3: $r_i = r_{i-31} +
    r_{i-3} \bmod 2^{32}$, output $r_i \gg 1$), its 34 first words from a Lehmer generator.

    Examples:
        >>> r = GlibcRand()
        >>> r(), r()
        (1804289383, 846930886)
    """

    def __init__(self, seed: int = 1):
        r = [seed]
        for i in range(1, 31):  # 16807 * r mod (2^31 - 1), Schrage's way as glibc
            hi, lo = divmod(r[i - 1], 127773)
            word = 16807 * lo - 2836 * hi
            r.append(word + 2147483647 if word < 0 else word)
        r += r[:3]  # r[31..33] = r[0..2]
        for i in range(34, 344):  # the first 310 outputs are thrown away
            r.append((r[i - 31] + r[i - 3]) & 0xFFFFFFFF)
        self._r = r

    def __call__(self) -> int:
        r = self._r
        r.append((r[-31] + r[-3]) & 0xFFFFFFFF)
        del r[0]
        return r[-1] >> 1
# --8<-- [end:GlibcRand]


# --8<-- [start:passkey_prompt]
def choose_passkey(n_junk: int, i_pos: int = -1, rand: Callable[[], int] | None = None
                   ) -> tuple[int, int]:
    """``(i_pos, passkey)`` as ``passkey.cpp`` draws them (``i_pos = -1``: random).

    Examples:
        >>> choose_passkey(250), choose_passkey(250, 90)
        ((133, 30887), (90, 39384))
    """
    rand = rand or GlibcRand()
    if i_pos == -1:
        i_pos = rand() % n_junk
    return i_pos, rand() % 50000 + 1


def passkey_prompt(n_junk: int, i_pos: int, passkey: int) -> str:
    """The prompt: prefix, ``n_junk`` junk sentences with the key before number ``i_pos``,
    the question (``i_pos >= n_junk``: no key at all).

    Examples:
        >>> p = passkey_prompt(3, 1, 42)
        >>> p.count("The grass is green"), p.count("The pass key is 42."), p.endswith("key is")
        (3, 1, True)
    """
    prompt = PROMPT_PREFIX
    for i in range(n_junk):
        if i % n_junk == i_pos:
            prompt += f" The pass key is {passkey}. Remember it. {passkey} is the pass key."
        prompt += JUNK
    return prompt + PROMPT_SUFFIX
# --8<-- [end:passkey_prompt]


def passkey_n_ctx(n_ctx_train: int, n_grp: int, n_keep: int) -> int:
    """The cells ``passkey.cpp`` asks for: ``n_ctx_train * n_grp + n_keep``, padded to 256.

    Examples:
        >>> passkey_n_ctx(8192, 1, 32), passkey_n_ctx(8192, 4, 32)
        (8448, 33024)
    """
    return n_ctx_seq(n_ctx_train * n_grp + n_keep, 1, True)[0]


@dataclass
class PasskeyResult:
    """What one passkey run did.

    Attributes:
        passkey: the number hidden.
        i_pos: the junk sentence it was put before.
        n_junk: junk sentences.
        n_tokens_prefix: tokens of the prefix (with BOS).
        n_tokens_all: tokens of the prompt (with BOS).
        answer: the generated tokens (at most 16).
        text: their text.
        n_decode: tokens decoded after the prompt.
        t_decode_s: seconds of that generation.
    """

    passkey: int
    i_pos: int
    n_junk: int
    n_tokens_prefix: int
    n_tokens_all: int
    answer: list[int] = field(default_factory=list)
    text: str = ""
    n_decode: int = 0
    t_decode_s: float = 0.0

    @property
    def found(self) -> bool:
        """The key's digits are in the answer."""
        return str(self.passkey) in self.text


def _check(n_junk: int, n_keep: int, i_pos: int, n_grp: int, n_batch: int) -> None:
    if n_junk < 1:
        raise PasskeyError(f"--junk {n_junk} must be >= 1")
    if n_keep < 0:
        raise PasskeyError(f"--keep {n_keep} must be >= 0")
    if i_pos < -1:
        raise PasskeyError(f"--pos {i_pos} must be >= 0 (or -1: random)")
    if n_grp < 1:
        raise PasskeyError(f"--grp-attn-n {n_grp} must be >= 1")
    if n_batch < 1 or n_batch % n_grp != 0:
        raise PasskeyError(f"n_batch must be divisible by n_grp: -b {n_batch}, "
                           f"--grp-attn-n {n_grp}")


# --8<-- [start:passkey_fill]
def passkey_fill(ctx: Any, tokens: list[int], n_ctx: int, n_batch: int, n_grp: int, n_keep: int,
                 info: Callable[[str], None]) -> int:
    """Decode the prompt into sequence 0 of ``ctx`` as ``passkey.cpp`` does; return ``n_past``.

    Args:
        ctx: a Context with room for ``n_ctx + n_keep`` cells.
        tokens: the prompt.
        n_ctx: ``llama_n_ctx - n_keep``.
        n_batch: tokens per chunk (a multiple of ``n_grp``).
        n_grp: the group size ``G``.
        n_keep: tokens kept at the start when the prompt is shifted in.
        info: where the ``processed`` / ``shifting`` lines go.

    Raises:
        PasskeyError: a decode failed (``llama_decode() failed``).
    """
    mem, n_past, n_all = ctx.memory, 0, len(tokens)
    for i in range(0, n_ctx, n_batch):
        if i > 0 and n_grp > 1:  # group the previous chunk: it ends at t // n_grp
            ib = i // n_batch - 1
            bd = (n_batch // n_grp) * (n_grp - 1)
            mem.seq_add(0, n_past - n_batch, n_past, ib * bd)
            mem.seq_div(0, n_past - n_batch + ib * bd, n_past + ib * bd, n_grp)
            n_past = mem.seq_pos_max(0) + 1
        n_past = _decode_chunk(ctx, tokens, i, n_batch, n_past)
        info(f"main: processed: [{i:6d}, {min(i + n_batch, n_all):6d})")
        if i + n_batch >= n_all:
            break
    for i in range(n_ctx, n_all, n_batch):  # what does not fit: shift it in
        info(f"main: shifting KV cache with {n_batch}")
        mem.seq_rm(0, n_keep, n_keep + n_batch)
        mem.seq_add(0, n_keep + n_batch, n_ctx, -n_batch)
        n_past = _decode_chunk(ctx, tokens, i, n_batch, mem.seq_pos_max(0) + 1)
        info(f"main: processed: [{i:6d}, {min(i + n_batch, n_all):6d})")
    n_discard = n_past - n_ctx + N_PREDICT
    if n_discard > 0:  # room for the answer
        info(f"main: shifting KV cache with {n_discard} to free space for the answer")
        mem.seq_rm(0, n_keep, n_keep + n_discard)
        mem.seq_add(0, n_keep + n_discard, n_ctx, -n_discard)
        n_past = mem.seq_pos_max(0) + 1
    return n_past


def _decode_chunk(ctx, tokens: list[int], i: int, n_batch: int, n_past: int) -> int:
    """Tokens ``[i, i + n_batch)`` at ``n_past, n_past + 1, ...``; logits only for the
    prompt's very last token."""
    chunk = tokens[i : i + n_batch]
    last = i + n_batch >= len(tokens)
    batch = Batch(token=chunk, pos=list(range(n_past, n_past + len(chunk))),
                  logits=[last and j == len(chunk) - 1 for j in range(len(chunk))])
    if ctx.decode(batch) != 0:
        raise PasskeyError("main: llama_decode() failed ("
                           f"{ctx.last_error or 'no slot'})")
    return n_past + len(chunk)
# --8<-- [end:passkey_fill]


# --8<-- [start:run_passkey]
def run_passkey(
    new_context: Callable[..., Any],
    tokenizer: Any,
    n_ctx_train: int,
    n_junk: int = 250,
    n_keep: int = 32,
    i_pos: int = -1,
    n_grp: int = 1,
    n_batch: int = 2048,
    n_ctx: int | None = None,
    out: Callable[[str], None] = lambda s: None,
    info: Callable[[str], None] = lambda s: None,
) -> PasskeyResult:
    """The passkey example: prompt, context, fill, 16 greedy tokens, llama.cpp's printout.

    Args:
        new_context: makes the Context: ``new_context(n_ctx=..., n_batch=...)``.
        tokenizer: the model's tokenizer (``tokenize``, ``token_to_piece``, ``is_eog``).
        n_ctx_train: the model's trained context (``llama_model_n_ctx_train``).
        n_junk: junk sentences (``--junk``).
        n_keep: tokens kept when shifting (``--keep``).
        i_pos: the junk sentence the key goes before (``--pos``; -1: random).
        n_grp: the group size (``--grp-attn-n``).
        n_batch: tokens per chunk (``-b``), a multiple of ``n_grp``.
        n_ctx: cells asked for; None: ``n_ctx_train * n_grp + n_keep`` as ``passkey.cpp``.
        out: the answer's text, piece by piece (llama.cpp's ``LOG``, stdout).
        info: the other lines (``LOG_INF``, stderr).

    Returns:
        The [`PasskeyResult`][].

    Raises:
        PasskeyError: bad parameters (before any context is made), or a failed decode.
    """
    _check(n_junk, n_keep, i_pos, n_grp, n_batch)
    i_pos, passkey = choose_passkey(n_junk, i_pos)
    prompt = passkey_prompt(n_junk, i_pos, passkey)
    tokens = list(tokenizer.tokenize(prompt, add_special=True, parse_special=False))
    n_prefix = len(tokenizer.tokenize(PROMPT_PREFIX, add_special=True, parse_special=False))
    ctx = new_context(n_ctx=passkey_n_ctx(n_ctx_train, n_grp, n_keep) if n_ctx is None
                      else n_ctx, n_batch=n_batch)
    if ctx.recurrent or not ctx.memory.can_shift():
        raise PasskeyError("passkey groups and shifts the positions of a KV cache: a "
                           "recurrent model has none")
    n_kv_req = ctx.n_ctx
    res = PasskeyResult(passkey, i_pos, n_junk, n_prefix, len(tokens))
    info(f"\nmain: n_len = {len(tokens) + N_PREDICT}, n_ctx = {n_kv_req - n_keep}, n_kv_req = "
         f"{n_kv_req}, n_grp = {n_grp}, n_batch = {n_batch}, n_junk = {n_junk}, i_pos = {i_pos}")
    info(f"\nprefix tokens: {n_prefix}\nprompt tokens: {len(tokens)}")
    n_past = passkey_fill(ctx, tokens, n_kv_req - n_keep, n_batch, n_grp, n_keep, info)
    info(f"\nmain: passkey = {passkey}, inserted at position {i_pos} / {n_junk} (token pos: "
         f"~{i_pos * len(tokens) // n_junk})\n")
    info(PROMPT_SUFFIX)
    _answer(ctx, tokenizer, n_past, res, out)
    info(f"main: decoded {res.n_decode} tokens in {res.t_decode_s:.2f} s, speed: "
         f"{res.n_decode / max(res.t_decode_s, 1e-9):.2f} t/s")
    return res
# --8<-- [end:run_passkey]


# --8<-- [start:passkey_answer]
def _answer(ctx, tokenizer, n_past: int, res: PasskeyResult, out) -> None:
    """The main loop: greedy tokens, each decoded at ``n_past++``, until EOG or 16."""
    utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")
    t0 = time.perf_counter()
    for _ in range(N_PREDICT + 1):
        token = int(np.argmax(ctx.get_logits_ith(-1)))  # the greedy sampler
        if tokenizer.is_eog(token) or len(res.answer) == N_PREDICT:
            break
        piece = utf8.decode(tokenizer.token_to_piece(token, special=True))
        res.answer.append(token)
        res.text += piece
        out(piece)
        res.n_decode += 1
        if ctx.decode(Batch(token=[token], pos=[n_past], logits=[True])) != 0:
            raise PasskeyError("main : failed to eval, return code 1")
        n_past += 1
    res.text += utf8.decode(b"", final=True)
    out("\n")
    res.t_decode_s = time.perf_counter() - t0
# --8<-- [end:passkey_answer]


__all__ = [
    "GlibcRand",
    "JUNK",
    "N_PREDICT",
    "PROMPT_PREFIX",
    "PROMPT_SUFFIX",
    "PasskeyError",
    "PasskeyResult",
    "choose_passkey",
    "passkey_fill",
    "passkey_n_ctx",
    "passkey_prompt",
    "run_passkey",
]
