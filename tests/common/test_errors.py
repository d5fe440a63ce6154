"""The error interceptor and grpc's non-blocking stream handlers: kept non-blocking (no thread
held), their errors still mapped, the request id bound while they run, their own pool kept."""

from __future__ import annotations

from concurrent import futures

import grpc
import pytest

from services.common import request_id
from services.common.errors import ErrorInterceptor
from services.engine.errors import InvalidRequestError


def _non_blocking(behavior):
    behavior.experimental_non_blocking = True
    return behavior


def test_a_non_blocking_stream_stays_non_blocking_and_its_errors_are_mapped():
    seen: list[str | None] = []
    callbacks = []  # the open streams: each answers through its callback, from any thread

    @_non_blocking
    def watch(request, context, send_response_callback):
        seen.append(request_id.current.get())
        if request == b"bad":
            raise InvalidRequestError("prompt", "bad")
        callbacks.append(send_response_callback)  # before the client can see "first"
        send_response_callback(b"first")  # ... and returns: no thread held for the stream

    handlers = grpc.method_handlers_generic_handler(
        "t.T", {"W": grpc.unary_stream_rpc_method_handler(watch)}
    )
    # One thread: two open streams only work if neither holds it.
    server = grpc.server(futures.ThreadPoolExecutor(1), interceptors=[ErrorInterceptor()])
    server.add_generic_rpc_handlers((handlers,))
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    channel = grpc.insecure_channel(f"127.0.0.1:{port}")
    try:
        md = (("x-request-id", "rid-w"),)
        streams = [channel.unary_stream("/t.T/W")(b"x", metadata=md, timeout=10) for _ in "ab"]
        assert [next(stream) for stream in streams] == [b"first", b"first"]
        for callback in callbacks:  # a later answer, then the end, from this thread
            callback(b"later")
            callback(None)
        assert [list(stream) for stream in streams] == [[b"later"], [b"later"]]
        assert seen == ["rid-w", "rid-w"]  # bound while the handler ran
        with pytest.raises(grpc.RpcError) as err:
            list(channel.unary_stream("/t.T/W")(b"bad", timeout=10))
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "bad" in (err.value.details() or "")
    finally:
        channel.close()
        server.stop(0)


def test_the_interceptor_keeps_what_grpc_reads_off_a_handler():
    pool = futures.ThreadPoolExecutor(1)

    @_non_blocking
    def watch(request, context, send_response_callback):
        pass

    def stream(request, context):
        yield b""

    stream.experimental_thread_pool = pool  # type: ignore[attr-defined]
    interceptor = ErrorInterceptor()
    for behavior, non_blocking in ((watch, True), (stream, False)):
        handler = interceptor.intercept_service(
            lambda _, b=behavior: grpc.unary_stream_rpc_method_handler(b), None
        )
        wrapped = handler.unary_stream
        assert wrapped is not behavior  # wrapped all the same: errors are mapped here
        assert getattr(wrapped, "experimental_non_blocking", False) is non_blocking
    assert handler.unary_stream.experimental_thread_pool is pool
    pool.shutdown()
