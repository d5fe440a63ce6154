"""HTTP statuses and OpenAI error bodies for the exceptions of the request flow.

The status follows the gRPC code that `services.common.errors.status_for` gives an exception,
so the HTTP and gRPC APIs always agree; a bad-input message names its field first
("temperature: must be ..."), and that field is the error's `param`.
"""

from __future__ import annotations

import logging
import re

import grpc
from starlette.responses import JSONResponse

from services.common.errors import status_for
from services.engine.errors import InvalidRequestError
from services.router.openai import bodies

logger = logging.getLogger(__name__)

_HTTP_STATUS = {
    grpc.StatusCode.INVALID_ARGUMENT: (400, "invalid_request_error"),
    grpc.StatusCode.UNAUTHENTICATED: (401, "authentication_error"),
    grpc.StatusCode.NOT_FOUND: (404, "not_found_error"),
    grpc.StatusCode.RESOURCE_EXHAUSTED: (429, "rate_limit_error"),
    grpc.StatusCode.UNAVAILABLE: (503, "service_unavailable"),
    grpc.StatusCode.DEADLINE_EXCEEDED: (504, "timeout"),
    grpc.StatusCode.CANCELLED: (499, "cancelled"),
}
_PARAM = re.compile(r"[\w.\[\]-]+(?=: )")  # a field, or a header (x-slo-itl-ms)
_HTTP_NAMES = {"prompt_token_ids": "prompt", "chat.messages": "messages", "chat": "messages"}
_GRPC_FIELD = re.compile(r"^(prompt_token_ids|chat\.messages|chat)(?=$|[.\[])")


class ModelNotFoundError(LookupError):
    """The request names another model than the served one (-> 404, param `model`)."""


class BodyTooLargeError(InvalidRequestError):
    """A request body over the limit (-> 413, param `body`)."""

    def __init__(self, message: str) -> None:
        super().__init__("body", message)


def http_error_code(exc: BaseException) -> grpc.StatusCode:
    """The gRPC code an HTTP error counts under in `pdserve_request_errors_total{code}` (a 404
    for an unknown model is NOT_FOUND; a 413 is INVALID_ARGUMENT, as every bad input)."""
    if isinstance(exc, ModelNotFoundError):
        return grpc.StatusCode.NOT_FOUND
    return status_for(exc)[0]


def http_error(exc: BaseException) -> tuple[int, dict]:
    """(HTTP status, OpenAI error body) for an exception from the request flow."""
    if isinstance(exc, ModelNotFoundError):
        return 404, bodies.error_body(str(exc), "not_found_error", 404, "model")
    if isinstance(exc, BodyTooLargeError):
        return 413, bodies.error_body(str(exc), "invalid_request_error", 413, "body")
    code, details = status_for(exc)
    status, kind = _HTTP_STATUS.get(code, (500, "server_error"))
    if status == 500:
        logger.error("internal error serving HTTP request", exc_info=exc)
    if status == 504:
        details = f"the request did not finish within the router's request_timeout ({details})"
    match = _PARAM.match(details or "") if status == 400 else None
    param = None
    if match:  # the flow names gRPC fields; an HTTP client sent these under its own names
        param = _GRPC_FIELD.sub(lambda m: _HTTP_NAMES[m.group(1)], match.group())
        details = param + details[match.end() :]
    return status, bodies.error_body(details or code.name, kind, status, param)


def error_response(exc: BaseException) -> JSONResponse:
    """The JSON error response; 429 says when to retry, 413 closes the unread body's
    connection."""
    status, body = http_error(exc)
    headers = {}
    retry_after = getattr(exc, "retry_after_s", None)
    if retry_after is not None:
        headers["Retry-After"] = str(retry_after)
    if status == 413:
        headers["Connection"] = "close"
    return JSONResponse(body, status, headers=headers)
