"""The tokenizer's error: every refusal of the package is a
[`TokenizerError`][reference.tokenizer.errors.TokenizerError]."""

from __future__ import annotations

from reference.common import LlamarefError


class TokenizerError(LlamarefError, ValueError):
    """A vocabulary, a request or a chat template that the tokenizer cannot handle.

    The message says what was wrong: an unknown tokenizer model or pre-tokenizer, a token id
    out of range, a missing file or key, a template that does not render.
    """
