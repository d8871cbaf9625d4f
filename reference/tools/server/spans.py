r"""Where the user messages of a chat prompt start: the places a checkpoint is worth most.

A follow-up turn usually shares the conversation up to a user message and differs after it
(an edited message, a regenerated answer, a template that re-renders the previous answer). A
checkpoint taken right before a user message lets such a turn restore there instead of
processing the whole conversation again. llama.cpp finds these places by matching the
chat template's *user delimiter* (e.g. ``<|im_start|>user\n`` for ChatML) on the prompt's
tokens (``common_chat_msg_delimiters::split``, ``common/chat.cpp:153-186``); a position
where it matches is a *user start* (``common_chat_msg_spans::is_user_start``).

llama.cpp reads the delimiter off its template analyser. Here it is read off the template
by rendering: the conversation ``[user, assistant]`` and the same followed by a user message
``S``; what the second adds between the first's end and ``S`` is the user delimiter
([`user_delimiter`][]).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from reference.common import LlamarefError

SENTINEL = "\u2063llamaref-user\u2063"  # a text no template changes (invisible separators)


# --8<-- [start:user_delimiter]
def user_delimiter(tokenizer: Any) -> list[int]:
    r"""The tokens that open a user message in the model's chat template; ``[]`` when the
    tokenizer has no template or the template does not render a user message after an
    assistant one as a plain continuation.

    Examples:
        >>> from reference.model_loader import default_model_path
        >>> from reference.tokenizer import Tokenizer
        >>> tok = Tokenizer.from_gguf(default_model_path())
        >>> tok.detokenize(user_delimiter(tok), unparse_special=True)
        '<|im_start|>user\n'
    """
    if getattr(tokenizer, "chat_template", None) is None:
        return []
    turn = [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]
    try:
        before = tokenizer.apply_chat_template(turn, add_generation_prompt=False)
        after = tokenizer.apply_chat_template(
            turn + [{"role": "user", "content": SENTINEL}], add_generation_prompt=False)
    except LlamarefError:
        return []
    end = after.find(SENTINEL)
    if end < 0 or not after.startswith(before) or end <= len(before):
        return []
    return tokenizer.tokenize(after[len(before):end], add_special=False, parse_special=True)
# --8<-- [end:user_delimiter]


# --8<-- [start:user_starts]
def user_starts(tokens: Sequence[int], delimiter: Sequence[int]) -> list[int]:
    """The positions where ``delimiter`` matches in ``tokens``, left to right (``split``'s
    scan for the user role: every position is tried, as llama.cpp's loop does).

    Examples:
        >>> user_starts([7, 1, 2, 5, 1, 2, 1, 2], [1, 2])
        [1, 4, 6]
        >>> user_starts([1, 2, 3], [])
        []
    """
    d = list(delimiter)
    if not d:
        return []
    out, i, n = [], 0, len(d)
    tokens = list(tokens)
    while i + n <= len(tokens):
        if tokens[i:i + n] == d:
            out.append(i)
        i += 1
    return out
# --8<-- [end:user_starts]
