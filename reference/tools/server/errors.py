r"""The server's error types: llama.cpp's ``error_type`` with its HTTP status.

llama.cpp answers every failed request with one JSON object
(``tools/server/server-common.cpp:36-78``)::

    {"error": {"code": 400, "message": "...", "type": "invalid_request_error"}}

where ``code`` is also the HTTP status. Each class here is one ``error_type``; the HTTP layer
turns any of them into that body with [`ServerError.to_json`][].
"""

from __future__ import annotations

from reference.common import LlamarefError


# --8<-- [start:ServerError]
class ServerError(LlamarefError):
    """``ERROR_TYPE_SERVER`` (500): something failed on our side.

    Examples:
        >>> InvalidRequest("Field 'top_k': must be an integer").to_json()
        {'error': {'code': 400, 'message': "Field 'top_k': must be an integer", \
'type': 'invalid_request_error'}}
    """

    code = 500
    type = "server_error"

    def to_json(self) -> dict:
        """The body llama.cpp sends: ``{"error": {"code", "message", "type"}}``."""
        return {"error": {"code": self.code, "message": str(self), "type": self.type}}


class InvalidRequest(ServerError, ValueError):
    """``ERROR_TYPE_INVALID_REQUEST`` (400): a malformed request or a bad field value."""

    code = 400
    type = "invalid_request_error"


class ExceedContextSize(InvalidRequest):
    """``ERROR_TYPE_EXCEED_CONTEXT_SIZE`` (400): the prompt does not fit the slot's context.

    The body also carries ``n_prompt_tokens`` and ``n_ctx`` (server-task.cpp:1501-1508).

    Examples:
        >>> e = ExceedContextSize(300, 256)
        >>> e.to_json()["error"]["n_ctx"], str(e)
        (256, 'request (300 tokens) exceeds the available context size (256 tokens), \
try increasing it')
    """

    type = "exceed_context_size_error"

    def __init__(self, n_prompt_tokens: int, n_ctx: int):
        super().__init__(f"request ({n_prompt_tokens} tokens) exceeds the available context "
                         f"size ({n_ctx} tokens), try increasing it")
        self.n_prompt_tokens, self.n_ctx = n_prompt_tokens, n_ctx

    def to_json(self) -> dict:
        body = super().to_json()
        body["error"].update(n_prompt_tokens=self.n_prompt_tokens, n_ctx=self.n_ctx)
        return body


class Unauthorized(ServerError):
    """``ERROR_TYPE_AUTHENTICATION`` (401): a missing or wrong API key."""

    code = 401
    type = "authentication_error"


class NotFound(ServerError, LookupError):
    """``ERROR_TYPE_NOT_FOUND`` (404): no such path, slot or file."""

    code = 404
    type = "not_found_error"


class NotSupported(ServerError):
    """``ERROR_TYPE_NOT_SUPPORTED`` (501): a feature this server was not started with."""

    code = 501
    type = "not_supported_error"


class Unavailable(ServerError):
    """``ERROR_TYPE_UNAVAILABLE`` (503): loading, or the queue is full."""

    code = 503
    type = "unavailable_error"
# --8<-- [end:ServerError]
