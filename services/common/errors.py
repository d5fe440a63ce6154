"""The one place that maps exceptions to gRPC status codes (ARCHITECTURE.md, style rule 9).

`ErrorInterceptor` wraps every handler of a server: typed engine errors and ValueError become
INVALID_ARGUMENT / RESOURCE_EXHAUSTED / NOT_FOUND, a failed downstream call keeps its code
(UNAVAILABLE, DEADLINE_EXCEEDED, ...), a KV handshake refusal is FAILED_PRECONDITION, anything
else is INTERNAL and logged once with its stack. A `PeerUnavailableError` also names the peer
that failed in the trailing metadata key `pdserve-failed-peer`, so a router can tell a dead KV
source (retry the prefill elsewhere) from a dead decode worker. An error with a `retry_after_s`
attribute (a full queue) sends it as `retry-after` in the trailing metadata.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator

import grpc

from services.common import request_id
from services.engine.errors import (
    InvalidRequestError,
    KVHandshakeError,
    RequestNotFoundError,
    ResourceExhaustedError,
)

logger = logging.getLogger(__name__)


FAILED_PEER_KEY = "pdserve-failed-peer"
RETRY_AFTER_KEY = "retry-after"


class UnauthenticatedError(Exception):
    """The request lacks the API key or has a wrong one (-> UNAUTHENTICATED / HTTP 401)."""


class ServiceUnavailableError(Exception):
    """No healthy worker, or a peer died (-> UNAVAILABLE)."""


class PeerUnavailableError(ServiceUnavailableError):
    """A peer this call depended on (`peer`, HOST:PORT) failed (-> UNAVAILABLE, peer in the
    trailing metadata)."""

    def __init__(self, message: str, peer: str) -> None:
        super().__init__(message)
        self.peer = peer


def failed_peer(exc: grpc.RpcError) -> str | None:
    """The peer a PeerUnavailableError named in a call's trailing metadata, if any."""
    trailing = exc.trailing_metadata() if hasattr(exc, "trailing_metadata") else None
    # types-grpcio's `_Metadatum` lacks `__iter__`: at run time it is a (key, value) namedtuple.
    found = (value for key, value in trailing or () if key == FAILED_PEER_KEY)  # type: ignore[misc, has-type]
    return next(found, None)


def status_for(exc: BaseException) -> tuple[grpc.StatusCode, str]:
    """(code, details) for an exception raised inside a handler."""
    if isinstance(exc, grpc.RpcError) and hasattr(exc, "code"):
        return exc.code(), exc.details() or ""
    if isinstance(exc, KVHandshakeError):
        return grpc.StatusCode.FAILED_PRECONDITION, str(exc)
    if isinstance(exc, (InvalidRequestError, ValueError)):
        return grpc.StatusCode.INVALID_ARGUMENT, str(exc)
    if isinstance(exc, ResourceExhaustedError):
        return grpc.StatusCode.RESOURCE_EXHAUSTED, str(exc)
    if isinstance(exc, RequestNotFoundError):
        return grpc.StatusCode.NOT_FOUND, str(exc.args[0] if exc.args else exc)
    if isinstance(exc, ServiceUnavailableError):
        return grpc.StatusCode.UNAVAILABLE, str(exc)
    if isinstance(exc, TimeoutError):
        return grpc.StatusCode.DEADLINE_EXCEEDED, str(exc) or "deadline exceeded"
    if isinstance(exc, UnauthenticatedError):
        return grpc.StatusCode.UNAUTHENTICATED, str(exc)
    return grpc.StatusCode.INTERNAL, f"{type(exc).__name__}: {exc}"


def _abort(context: grpc.ServicerContext, exc: BaseException) -> None:
    code, details = status_for(exc)
    if code == grpc.StatusCode.INTERNAL:
        logger.exception("internal error in handler", exc_info=exc)
    else:
        logger.info("request failed: %s %s", code.name, details)
    if isinstance(exc, PeerUnavailableError):
        context.set_trailing_metadata(((FAILED_PEER_KEY, exc.peer),))
    retry_after = getattr(exc, "retry_after_s", None)
    if retry_after is not None:
        context.set_trailing_metadata(((RETRY_AFTER_KEY, str(retry_after)),))
    context.abort(code, details)


class ErrorInterceptor(grpc.ServerInterceptor):
    """Maps exceptions from unary, server-streaming and bidi handlers to gRPC statuses, and binds
    each call's request id (`x-request-id` metadata; `request_id.py`) while its handler runs, so the
    handler's log lines and the failure logged here carry it. `new_request_ids` (the router):
    a call without one gets a fresh id (the handler reads it from `request_id.current`)."""

    def __init__(self, new_request_ids: bool = False) -> None:
        self.new_request_ids = new_request_ids

    def intercept_service(self, continuation, handler_call_details):
        handler = continuation(handler_call_details)
        if handler is None:
            return None
        if handler.unary_unary:
            return grpc.unary_unary_rpc_method_handler(
                self._wrap_unary(handler.unary_unary),
                handler.request_deserializer,
                handler.response_serializer,
            )
        if handler.unary_stream:
            return grpc.unary_stream_rpc_method_handler(
                self._wrap_stream(handler.unary_stream),
                handler.request_deserializer,
                handler.response_serializer,
            )
        if handler.stream_stream:  # its request is the iterator of messages; wrapped alike
            return grpc.stream_stream_rpc_method_handler(
                self._wrap_stream(handler.stream_stream),
                handler.request_deserializer,
                handler.response_serializer,
            )
        return handler

    def _request_id(self, context: grpc.ServicerContext) -> str | None:
        found = request_id.from_metadata(context.invocation_metadata())
        return found or (request_id.new_request_id() if self.new_request_ids else None)

    def _wrap_unary(self, behavior: Callable) -> Callable:
        def wrapped(request, context):
            with request_id.bound(self._request_id(context)):
                try:
                    return behavior(request, context)
                except Exception as exc:  # noqa: BLE001 - the one place errors become statuses
                    if context.code() is not None:  # already aborted by the handler itself
                        raise
                    _abort(context, exc)

        return wrapped

    def _wrap_stream(self, behavior: Callable) -> Callable:
        def statuses(request, context) -> Iterator:
            try:
                yield from behavior(request, context)
            except Exception as exc:  # noqa: BLE001
                if context.code() is not None:
                    raise
                _abort(context, exc)

        def wrapped(request, context) -> Iterator:
            return request_id.bind_stream(statuses(request, context), self._request_id(context))

        return wrapped
