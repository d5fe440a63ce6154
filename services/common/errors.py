"""The one place that maps exceptions to gRPC status codes (docs/architecture.md, "Errors").

`ErrorInterceptor` wraps every handler of a server: typed engine errors and ValueError become
INVALID_ARGUMENT / RESOURCE_EXHAUSTED / NOT_FOUND, a failed downstream call keeps its code
(UNAVAILABLE, DEADLINE_EXCEEDED, ...), a KV handshake refusal is FAILED_PRECONDITION, anything
else is INTERNAL and logged once with its stack. A `PeerUnavailableError` also names the peer
that failed in the trailing metadata key `pdserve-failed-peer`, so a router can tell a dead KV
source (retry the prefill elsewhere) from a dead decode worker. An error with a `retry_after_s`
attribute (a full queue) sends it as `retry-after` in the trailing metadata.

A handler grpc runs without a thread (`experimental_non_blocking`: it answers through a
callback and returns at once, as `Health.Watch` does) stays that way: wrapping it in a
generator would make grpc drive that generator on a server thread for the stream's whole life,
so a few hundred idle Watch calls (no API key needed) would take every thread.
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


class ShuttingDownError(ServiceUnavailableError):
    """This process is stopping (-> UNAVAILABLE, HTTP 503): a worker whose engine thread has
    stopped, or a router whose grace for running requests is over."""

    def __init__(self, message: str = "the router is shutting down; retry on another one") -> None:
        super().__init__(message)


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
    a call without one gets a fresh id (the handler reads it from `request_id.current`).

    A non-blocking stream handler is wrapped as a call, not a generator (module docstring): what
    it raises before returning is mapped here; what fails later, in its callbacks, is its own."""

    def __init__(self, new_request_ids: bool = False) -> None:
        self.new_request_ids = new_request_ids

    def intercept_service(self, continuation, handler_call_details):
        handler = continuation(handler_call_details)
        if handler is None:
            return None
        if handler.unary_unary:
            return grpc.unary_unary_rpc_method_handler(
                _keep_pool(self._wrap_call(handler.unary_unary), handler.unary_unary),
                handler.request_deserializer,
                handler.response_serializer,
            )
        if handler.unary_stream:
            return grpc.unary_stream_rpc_method_handler(
                self._wrap_any_stream(handler.unary_stream),
                handler.request_deserializer,
                handler.response_serializer,
            )
        if handler.stream_stream:  # its request is the iterator of messages; wrapped alike
            return grpc.stream_stream_rpc_method_handler(
                self._wrap_any_stream(handler.stream_stream),
                handler.request_deserializer,
                handler.response_serializer,
            )
        return handler

    def _request_id(self, context: grpc.ServicerContext) -> str | None:
        found = request_id.from_metadata(context.invocation_metadata())
        return found or (request_id.new_request_id() if self.new_request_ids else None)

    def _wrap_any_stream(self, behavior: Callable) -> Callable:
        """A stream handler wrapped the way grpc will run it: a non-blocking one (grpc reads
        the attribute off the handler it is given) as a call, any other as a generator."""
        if getattr(behavior, "experimental_non_blocking", False):
            wrapped = self._wrap_call(behavior)
            wrapped.experimental_non_blocking = True  # type: ignore[attr-defined]
        else:
            wrapped = self._wrap_stream(behavior)
        return _keep_pool(wrapped, behavior)

    def _wrap_call(self, behavior: Callable) -> Callable:
        """A unary handler, or a non-blocking stream handler (its extra argument is grpc's
        `send_response_callback`): both return once their work is handed over."""

        def wrapped(request, context, *callback):
            with request_id.bound(self._request_id(context)):
                try:
                    return behavior(request, context, *callback)
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


def _keep_pool(wrapped: Callable, behavior: Callable) -> Callable:
    """`wrapped` runs on the thread pool `behavior` asked grpc for (`experimental_thread_pool`),
    if any, not on the server's."""
    pool = getattr(behavior, "experimental_thread_pool", None)
    if pool is not None:
        wrapped.experimental_thread_pool = pool  # type: ignore[attr-defined]
    return wrapped
