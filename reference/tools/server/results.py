r"""What the scheduler sends back for a task: partial results while it generates, one final
result, or an error. llama.cpp's ``server_task_result_cmpl_partial`` / ``_final``
(``tools/server/server-task.cpp``), without the JSON: the HTTP layer writes the formats.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from reference.tools.server.errors import ServerError

#: ``std::numeric_limits<float>::lowest()``: llama.cpp's log of a zero probability
FLT_LOWEST = -3.4028234663852886e38


def logarithm(p: float) -> float:
    """``completion_token_output::logarithm``: ``log(p)``, with ``p == 0`` mapped to the
    lowest float (JSON has no ``-inf``).

    Examples:
        >>> logarithm(1.0), logarithm(0.0) == FLT_LOWEST
        (0.0, True)
    """
    return FLT_LOWEST if p == 0.0 else math.log(p)


# --8<-- [start:results]
@dataclass
class TokenProb:
    """One candidate: its id, its bytes, its probability."""

    id: int
    piece: bytes
    prob: float


@dataclass
class TokenOutput:
    """``completion_token_output``: a generated token, its probability and the top
    ``n_probs`` candidates (pre-sampling: the softmax of the raw logits; post-sampling: the
    sampler chain's candidates, zeros dropped)."""

    id: int
    piece: bytes
    prob: float
    top: list[TokenProb] = field(default_factory=list)


@dataclass
class Timings:
    """``result_timings``: the prompt and generation phases of one task (the HTTP layer
    adds the per-token times and rates)."""

    cache_n: int = 0
    prompt_n: int = 0
    prompt_ms: float = 0.0
    predicted_n: int = 0
    predicted_ms: float = 0.0


@dataclass
class Partial:
    """New text of a streaming task (held-back stop-string prefixes are not in it yet).

    ``return_tokens`` is the request's: the native format reports ``tokens`` only then.
    """

    task_id: int
    index: int
    id_slot: int
    content: str
    tokens: list[int]
    probs: list[TokenOutput]
    n_decoded: int
    n_prompt: int
    timings: Timings | None = None
    return_tokens: bool = True


@dataclass
class Final:
    """The end of a task.

    Attributes:
        content: the whole text (non-streaming) or the text not sent yet (streaming).
        tokens: the generated tokens (all of them, or the unsent ones when streaming).
        stop_type: ``"eos"`` (end of generation), ``"word"`` (a stop string), ``"limit"``
            (``n_predict``, the context, the time limit) or ``"none"``.
        stopping_word: the stop string that matched ("" otherwise).
        n_decoded: tokens generated.
        n_prompt: prompt tokens.
        n_cached: prompt tokens taken from the cache (``n_prompt_tokens_cache``).
        n_tokens_cached: tokens the slot holds at the end (``tokens_cached``).
        truncated: a context shift dropped tokens, or the context filled up.
        has_new_line: the generated text contains a newline.
    """

    task_id: int
    index: int
    id_slot: int
    content: str
    tokens: list[int]
    stop_type: str
    stopping_word: str
    n_decoded: int
    n_prompt: int
    n_cached: int
    n_tokens_cached: int
    truncated: bool
    has_new_line: bool
    timings: Timings
    probs: list[TokenOutput] = field(default_factory=list)


@dataclass
class Failed:
    """A task that could not be served; ``error`` says why (its ``code`` and ``type``)."""

    task_id: int
    index: int
    error: ServerError
# --8<-- [end:results]
