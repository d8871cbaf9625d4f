r"""What one completion request asks of its slot: llama.cpp's ``task_params``.

The HTTP layer parses a request body into a [`SlotParams`][] (field by field, with llama.cpp's
names, aliases and limits); the scheduler reads nothing else. Defaults are the server's
(``tools/server/server-task.h:50-99`` and the sampling defaults of ``common/common.h``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from reference.sampling import SamplerParams


# --8<-- [start:SlotParams]
@dataclass
class SlotParams:
    """One request's parameters.

    Attributes:
        n_predict: the most tokens to generate (-1: until end of generation or the context
            is full; 0: only evaluate the prompt into the cache).
        n_keep: prompt tokens kept by a context shift (-1: the whole prompt).
        n_discard: tokens dropped by a context shift (0: half of what is not kept).
        stop: text-level stop strings; the first full match ends the generation and is
            cut from the content.
        cache_prompt: reuse the longest common prefix of the slot's cached tokens.
        n_cache_reuse: the shortest chunk moved by KV shifting (0: off; ``--cache-reuse``).
        n_probs: how many top candidates to report with each token (0: none).
        post_sampling_probs: report the sampler's candidates (True) or the softmax of the
            raw logits (False).
        ignore_eos: end-of-generation tokens are sampled as ordinary tokens (their logit
            gets ``-inf``).
        n_cmpl: completions sharing the prompt (alias ``n``), each on its own slot.
        id_slot: the slot to use (-1: chosen by the server).
        t_max_predict_ms: a time limit for the generation phase (-1: none).
        stream: send each token as it is generated.
        include_usage: with ``stream``, send a last chunk with ``usage`` (OpenAI).
        return_tokens: report the token ids too.
        timings_per_token: report the timings with each partial result.
        sampling: the sampler chain's parameters.
    """

    n_predict: int = -1
    n_keep: int = 0
    n_discard: int = 0
    stop: list[str] = field(default_factory=list)
    cache_prompt: bool = True
    n_cache_reuse: int = 0
    n_probs: int = 0
    post_sampling_probs: bool = False
    ignore_eos: bool = False
    n_cmpl: int = 1
    id_slot: int = -1
    t_max_predict_ms: int = -1
    stream: bool = False
    include_usage: bool = False
    return_tokens: bool = False
    timings_per_token: bool = False
    sampling: SamplerParams = field(default_factory=SamplerParams)
# --8<-- [end:SlotParams]
