r"""Errors as HTTP: the status and the JSON body a client gets for each error type.

The server's specification says *what* failed ([`reference.tools.server.errors`][]: an
invalid request, a prompt over the context, a busy slot...); this module says how a client
hears of it. llama.cpp answers every failed request with one JSON object
(``format_error_response``, ``tools/server/server-common.cpp:36-78``)::

    {"error": {"code": 400, "message": "...", "type": "invalid_request_error"}}

where ``code`` is also the HTTP status. ``HTTP_ERRORS`` is that table, from error class to
``(status, type)``; a subclass not in it takes its nearest base's row.
"""

from __future__ import annotations

from reference.tools.server.errors import (
    ExceedContextSize,
    InvalidRequest,
    NotFound,
    NotSupported,
    ServerError,
    Unauthorized,
    Unavailable,
)


class BodyTooLarge(InvalidRequest):
    """A request body over ``--body-limit`` (413 with ``invalid_request_error``)."""


class UnsupportedMediaType(InvalidRequest):
    """A JSON endpoint's body sent as a form or plain text (415): the content types a web
    page may send to another origin without asking first (a CORS "simple request")."""


class Forbidden(ServerError):
    """A request refused for where it comes from: a ``Host`` this server does not answer
    to, or a web page's ``Origin`` outside ``--cors-origins`` (403, llama.cpp's
    ``permission_error``)."""


# --8<-- [start:HTTP_ERRORS]
#: error class -> (HTTP status, the body's ``type``): llama.cpp's ``format_error_response``
HTTP_ERRORS: dict[type[ServerError], tuple[int, str]] = {
    ServerError: (500, "server_error"),
    InvalidRequest: (400, "invalid_request_error"),
    ExceedContextSize: (400, "exceed_context_size_error"),
    BodyTooLarge: (413, "invalid_request_error"),
    UnsupportedMediaType: (415, "invalid_request_error"),
    Forbidden: (403, "permission_error"),
    Unauthorized: (401, "authentication_error"),
    NotFound: (404, "not_found_error"),
    NotSupported: (501, "not_supported_error"),
    Unavailable: (503, "unavailable_error"),
}


def http_error(e: ServerError) -> tuple[int, str]:
    """``(status, type)`` of an error: the row of its class, or of its nearest base.

    Examples:
        >>> from reference.tools.server.scheduler import SchedulerError
        >>> http_error(Unavailable("Loading model")), http_error(SchedulerError("no"))
        ((503, 'unavailable_error'), (500, 'server_error'))
    """
    for cls in type(e).__mro__:
        if cls in HTTP_ERRORS:
            return HTTP_ERRORS[cls]
    return HTTP_ERRORS[ServerError]


def http_status(e: ServerError) -> int:
    """The HTTP status of an error (also the body's ``code``)."""
    return http_error(e)[0]


def error_json(e: ServerError) -> dict:
    """The body llama.cpp sends: ``{"error": {"code", "message", "type"}}``; a prompt over
    the context adds ``n_prompt_tokens`` and ``n_ctx`` (server-task.cpp:1501-1508).

    Examples:
        >>> error_json(InvalidRequest("Field 'top_k': must be an integer"))
        {'error': {'code': 400, 'message': "Field 'top_k': must be an integer", \
'type': 'invalid_request_error'}}
        >>> error_json(ExceedContextSize(300, 256))["error"]["n_ctx"]
        256
    """
    code, kind = http_error(e)
    body = {"code": code, "message": str(e), "type": kind}
    if isinstance(e, ExceedContextSize):
        body.update(n_prompt_tokens=e.n_prompt_tokens, n_ctx=e.n_ctx)
    return {"error": body}
# --8<-- [end:HTTP_ERRORS]
