r"""The server's error types: llama.cpp's ``error_type``, one class each.

llama.cpp names what went wrong with a request by an ``error_type``
(``tools/server/server-common.h``): an invalid request, a prompt over the context, a missing
slot... Each class here is one of them, and says *what* failed. Which HTTP status and which
JSON body a client then receives is the application's choice: ``llamaref serve`` writes
llama.cpp's (``format_error_response``; [`llamaref.server.errors`][]).
"""

from __future__ import annotations

from reference.common import LlamarefError


# --8<-- [start:ServerError]
class ServerError(LlamarefError):
    """``ERROR_TYPE_SERVER``: something failed on our side.

    Examples:
        >>> isinstance(ExceedContextSize(300, 256), InvalidRequest)
        True
    """


class InvalidRequest(ServerError, ValueError):
    """``ERROR_TYPE_INVALID_REQUEST``: a malformed request or a bad field value."""


class ExceedContextSize(InvalidRequest):
    """``ERROR_TYPE_EXCEED_CONTEXT_SIZE``: the prompt does not fit the slot's context.

    Attributes:
        n_prompt_tokens: the prompt's length.
        n_ctx: the slot's context.

    Examples:
        >>> e = ExceedContextSize(300, 256)
        >>> e.n_ctx, str(e)
        (256, 'request (300 tokens) exceeds the available context size (256 tokens), \
try increasing it')
    """

    def __init__(self, n_prompt_tokens: int, n_ctx: int):
        super().__init__(f"request ({n_prompt_tokens} tokens) exceeds the available context "
                         f"size ({n_ctx} tokens), try increasing it")
        self.n_prompt_tokens, self.n_ctx = n_prompt_tokens, n_ctx


class Unauthorized(ServerError):
    """``ERROR_TYPE_AUTHENTICATION``: a missing or wrong API key."""


class NotFound(ServerError, LookupError):
    """``ERROR_TYPE_NOT_FOUND``: no such path, slot or file."""


class NotSupported(ServerError):
    """``ERROR_TYPE_NOT_SUPPORTED``: a feature this server was not started with."""


class Unavailable(ServerError):
    """``ERROR_TYPE_UNAVAILABLE``: loading, the queue is full, or the slot is busy."""
# --8<-- [end:ServerError]
