r"""Many completions of one prompt: llama.cpp's ``examples/batched``.

``llama-batched -p PROMPT -n N -np P`` writes ``P`` continuations of the same prompt at once
(``examples/batched/batched.cpp``). Three ideas make it cheaper than ``P`` runs:

1. **The prompt is decoded once.** With one KV stream for every sequence
   (``--kv-unified``), each prompt token enters the batch with the *whole* list of sequence
   ids $\{0, \dots, P-1\}$ (``batch.add(tok, i, seq_ids, false)``, batched.cpp:122-130): one
   cell per token, shared by all $P$ sequences. With one stream per sequence (the default,
   ``kv_unified = false``) a token may not belong to several streams: llama.cpp's decode
   refuses "coupled sequences" (``split_equal`` with ``sequential``,
   ``src/llama-batch.cpp:542-546``), so ``llama-batched`` fails there without ``-kvu``,
   and on a recurrent model (Mamba) always (``src/llama-memory-recurrent.cpp:445``).
   Here the prompt is then decoded on sequence 0 and ``seq_cp(0, i)`` copies it to every
   other sequence (the approach batched.cpp keeps commented out, :156-160): a whole
   stream, or the recurrent *state* after the prompt.
2. **One sampler chain per stream**, ``top_k -> top_p -> temp -> dist`` (batched.cpp:76-85),
   every one seeded with ``--seed``: with a fixed seed and the same first logits all
   streams start alike; ``LLAMA_DEFAULT_SEED`` gives each chain its own random seed.
3. **One decode per step for all streams**: every live stream adds its sampled token at
   position ``n_cur`` on its own sequence, with an output, and the batch goes through one
   ``llama_decode``.

**The stop rule** (batched.cpp:180-202). ``n_predict`` is the *total* length, prompt
included; ``n_cur`` starts at the prompt's length. A stream whose sampled token is an
end-of-generation token, or that samples at ``n_cur == n_predict``, is finished and that
token is *not* kept. So every stream holds at most ``n_predict - n_prompt`` tokens, and the
cache needs

$$ n_{kv} = n_{prompt} + (n_{predict} - n_{prompt}) \cdot P $$

cells in one stream (batched.cpp:62), or $n_{predict}$ cells in each of $P$ streams.

The algorithm is written once against the Context protocol: either twin runs it, with
either twin's sampler.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from reference.batch import Batch
from reference.common import LLAMA_DEFAULT_SEED, LlamarefError
from reference.sampling import SamplerParams

#: batched.cpp:24-25: the defaults it sets before parsing the flags
DEFAULT_PROMPT = "Hello my name is"
DEFAULT_N_PREDICT = 32


class BatchedError(LlamarefError, ValueError):
    """A batched run that cannot start (too many streams, too small a context, a prompt
    longer than ``n_predict``) or a decode that failed."""


# --8<-- [start:n_kv_required]
def n_kv_required(n_prompt: int, n_predict: int, n_parallel: int) -> int:
    """Cells one KV stream needs for ``n_parallel`` completions (batched.cpp:62).

    The prompt once, then ``n_predict - n_prompt`` tokens for each stream.

    Examples:
        >>> n_kv_required(n_prompt=5, n_predict=32, n_parallel=4)
        113
    """
    return n_prompt + (n_predict - n_prompt) * n_parallel
# --8<-- [end:n_kv_required]


# --8<-- [start:sampler_params]
def sampler_params(top_k: int = 40, top_p: float = 0.95, min_keep: int = 0,
                   temp: float = 0.80,
                   seed: int = LLAMA_DEFAULT_SEED) -> SamplerParams:
    """The chain of one stream: ``top_k -> top_p -> temp -> dist``.

    batched.cpp:76-85 builds it by hand (no penalties, no ``min_p``), from
    ``common_params_sampling``'s values; ``temp <= 0`` keeps only the largest logit
    (greedy, still one draw).

    Examples:
        >>> from reference.sampling import SamplerChain
        >>> SamplerChain.from_params(sampler_params(), 8).stages
        ['top_k', 'top_p', 'temperature', 'dist']
    """
    return SamplerParams(seed=seed, top_k=top_k, top_p=top_p, min_keep=min_keep,
                         temp=temp, samplers=["top_k", "top_p", "temperature"])
# --8<-- [end:sampler_params]


# --8<-- [start:check_batched]
def check_batched(ctx: Any, n_prompt: int, n_predict: int, n_parallel: int) -> None:
    """Refuse a run that cannot work on ``ctx``, before anything is decoded.

    Raises:
        BatchedError: ``n_parallel < 1``; more streams than the context has sequences
            (``n_seq_max``); an empty prompt or one longer than ``n_predict`` (the total
            length); a KV cache too small: one stream needs [`n_kv_required`][] cells
            (batched.cpp:104-108), one stream per sequence ``n_predict`` cells each.
    """
    if n_parallel < 1:
        raise BatchedError(f"-np {n_parallel}: at least one stream is needed")
    if n_parallel > ctx.n_seq_max:
        raise BatchedError(f"-np {n_parallel} streams but the context holds "
                           f"{ctx.n_seq_max} sequences: reduce -np or make the context "
                           f"with n_seq_max >= {n_parallel}")
    if n_prompt < 1 or n_prompt > n_predict:
        raise BatchedError(f"the prompt has {n_prompt} tokens and -n {n_predict} is the "
                           "total length, prompt included: increase -n")
    if ctx.recurrent:
        return  # one state per sequence, whatever the length
    need = n_kv_required(n_prompt, n_predict, n_parallel)
    if ctx.kv_unified and need > ctx.n_ctx:
        raise BatchedError(f"n_kv_req ({need}) > n_ctx ({ctx.n_ctx}): the KV cache is "
                           "not big enough; either reduce -np or increase n_ctx")
    if not ctx.kv_unified and n_predict > ctx.n_ctx_seq:
        raise BatchedError(f"each stream needs n_predict = {n_predict} cells and holds "
                           f"{ctx.n_ctx_seq}: reduce -n or increase n_ctx")
# --8<-- [end:check_batched]


# --8<-- [start:decode_prompt]
def decode_prompt(ctx: Any, tokens: Sequence[int], n_parallel: int) -> None:
    """Decode the prompt once for ``n_parallel`` sequences; logits of its last token.

    One KV stream: every token carries the seq ids ``0..n_parallel-1``
    (batched.cpp:122-149). One stream per sequence, or a recurrent memory: decode on
    sequence 0, then ``seq_cp(0, i)`` for the others (a whole-stream copy done at the
    next decode, or a copy of the state).

    Raises:
        BatchedError: the decode failed (llama.cpp: "llama_decode() failed").

    Examples:
        >>> from reference.context import Context
        >>> from reference.testing import tiny_hparams, random_weights
        >>> hp = tiny_hparams()
        >>> ctx = Context(hp, random_weights(hp), n_ctx=64, n_seq_max=3)
        >>> decode_prompt(ctx, [1, 2, 3], 3)
        >>> [ctx.memory.seq_pos_max(s) for s in range(3)]
        [2, 2, 2]
    """
    n = len(tokens)
    shared = ctx.kv_unified and not ctx.recurrent
    seq_ids = list(range(n_parallel)) if shared else [0]
    batch = Batch(token=list(tokens), pos=list(range(n)), seq_id=[seq_ids] * n,
                  logits=[i == n - 1 for i in range(n)])
    ret = ctx.decode(batch)
    if ret != 0:
        raise BatchedError(f"llama_decode() failed on the prompt ({ret}): "
                           f"{ctx.last_error or 'no reason given'}")
    if not shared:
        for i in range(1, n_parallel):
            ctx.memory.seq_cp(0, i, -1, -1)
# --8<-- [end:decode_prompt]


# --8<-- [start:BatchedResult]
@dataclass
class BatchedResult:
    """What a batched run produced.

    Attributes:
        tokens: per stream, the tokens it kept (prompt and stop token excluded).
        finished_at: per stream, ``n_cur`` when it finished (-1: the loop ended first).
        n_decode: tokens decoded after the prompt (batched.cpp's ``n_decode``).
        seconds: time of the main loop (``t_main_end - t_main_start``).
    """

    tokens: list[list[int]]
    finished_at: list[int]
    n_decode: int = 0
    seconds: float = 0.0
# --8<-- [end:BatchedResult]


def logits_row(ctx: Any, i: int, on_device: bool):
    """Row ``i`` of the last decode: on the device for an MLX sampler, else NumPy."""
    if on_device:
        return ctx.get_logits_ith_device(i)
    return ctx.get_logits_ith(i)  # (n_vocab,)


# --8<-- [start:batched]
def batched(ctx: Any, samplers: Sequence[Any], prompt: Sequence[int],
            n_predict: int, is_eog: Callable[[int], bool],
            on_device: bool = False,
            info: Callable[[str], None] | None = None) -> BatchedResult:
    """``len(samplers)`` completions of ``prompt``, decoded together (batched.cpp).

    Args:
        ctx: a fresh Context (either twin) with ``n_seq_max >= len(samplers)``.
        samplers: one chain per stream (``.sample(logits)``, ``.accept(token)``).
        prompt: the prompt's tokens (BOS included when the vocabulary adds it).
        n_predict: the total length of every sequence, prompt included.
        is_eog: ``llama_vocab_is_eog``.
        on_device: the samplers take the MLX row (``get_logits_ith_device``).
        info: llama.cpp's log lines ("stream i finished at n_cur = ...").

    Returns:
        The tokens of every stream, where each one stopped, and the count and time of
        the decodes after the prompt.

    Raises:
        BatchedError: from [`check_batched`][] (before anything is decoded), or a
            decode that failed.

    Examples:
        >>> import numpy as np
        >>> from reference.context import Context
        >>> from reference.testing import tiny_hparams, random_weights
        >>> hp = tiny_hparams()
        >>> class Greedy:
        ...     def sample(self, logits): return int(np.argmax(logits))
        ...     def accept(self, token): pass
        >>> ctx = Context(hp, random_weights(hp), n_ctx=64, n_seq_max=2)
        >>> res = batched(ctx, [Greedy(), Greedy()], [1, 2, 3], 8, lambda t: False)
        >>> [len(t) for t in res.tokens], res.finished_at, res.n_decode
        ([5, 5], [8, 8], 10)
        >>> res.tokens[0] == res.tokens[1]  # greedy: the same continuation
        True
    """
    n_parallel, n_prompt = len(samplers), len(prompt)
    check_batched(ctx, n_prompt, n_predict, n_parallel)
    decode_prompt(ctx, prompt, n_parallel)
    res = BatchedResult([[] for _ in samplers], [-1] * n_parallel)
    i_batch = [n_prompt - 1] * n_parallel  # every stream samples the prompt's row
    n_cur = n_prompt
    t0 = time.perf_counter()
    while n_cur <= n_predict:
        batch = step(ctx, samplers, i_batch, n_cur, n_predict, is_eog, res,
                     on_device, info)
        if batch is None:  # all streams are finished
            break
        n_cur += 1
        ret = ctx.decode(batch)
        if ret != 0:
            raise BatchedError(f"failed to eval, return code {ret}: "
                               f"{ctx.last_error}")
    ctx.synchronize()
    res.seconds = time.perf_counter() - t0
    return res
# --8<-- [end:batched]


# --8<-- [start:step]
def step(ctx: Any, samplers: Sequence[Any], i_batch: list[int], n_cur: int,
         n_predict: int, is_eog: Callable[[int], bool], res: BatchedResult,
         on_device: bool = False,
         info: Callable[[str], None] | None = None) -> Batch | None:
    """Sample every live stream; the batch of their new tokens (None if none is live).

    batched.cpp:184-217: stream ``i`` samples the row ``i_batch[i]``; an
    end-of-generation token or ``n_cur == n_predict`` finishes it (``i_batch[i] = -1``,
    the token dropped); otherwise the token goes at position ``n_cur`` on sequence
    ``i``, with an output, and ``i_batch[i]`` becomes its index in the new batch.
    """
    token, seq_id = [], []
    for i, smpl in enumerate(samplers):
        if i_batch[i] < 0:
            continue  # the stream has already finished
        new_token = int(smpl.sample(logits_row(ctx, i_batch[i], on_device)))
        smpl.accept(new_token)  # llama_sampler_sample accepts it too
        if is_eog(new_token) or n_cur == n_predict:
            i_batch[i] = -1
            res.finished_at[i] = n_cur
            if info is not None and len(samplers) > 1:
                info(f"main: stream {i} finished at n_cur = {n_cur}")
            continue
        res.tokens[i].append(new_token)
        i_batch[i] = len(token)
        token.append(new_token)
        seq_id.append([i])
        res.n_decode += 1
    if not token:
        return None
    n = len(token)
    return Batch(token=token, pos=[n_cur] * n, seq_id=seq_id, logits=[True] * n)
# --8<-- [end:step]


# --8<-- [start:report]
def report(prompt_text: str, streams: Sequence[str], n_decode: int,
           seconds: float) -> tuple[str, str]:
    r"""batched.cpp's closing printout: the sequences (stdout) and the speed line.

    ``"sequence %d:\n\n%s%s\n\n"`` per stream when there are several (:233-238),
    then ``"main: decoded %d tokens in %.2f s, speed: %.2f t/s"`` (:243).

    Examples:
        >>> out, line = report("Hi", [" a", " b"], 4, 2.0)
        >>> print(out, end="")
        <BLANKLINE>
        sequence 0:
        <BLANKLINE>
        Hi a
        <BLANKLINE>
        sequence 1:
        <BLANKLINE>
        Hi b
        <BLANKLINE>
        >>> line
        'main: decoded 4 tokens in 2.00 s, speed: 2.00 t/s'
    """
    out = ""
    if len(streams) > 1:
        out = "\n" + "".join(f"sequence {i}:\n\n{prompt_text}{s}\n\n"
                             for i, s in enumerate(streams))
    speed = n_decode / seconds if seconds > 0 else float("inf")
    return out, (f"main: decoded {n_decode} tokens in {seconds:.2f} s, "
                 f"speed: {speed:.2f} t/s")
# --8<-- [end:report]


__all__ = [
    "DEFAULT_N_PREDICT",
    "DEFAULT_PROMPT",
    "BatchedError",
    "BatchedResult",
    "batched",
    "check_batched",
    "decode_prompt",
    "logits_row",
    "n_kv_required",
    "report",
    "sampler_params",
    "step",
]
