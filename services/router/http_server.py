"""The HTTP server under the OpenAI API: uvicorn (httptools parser, uvloop) on its own thread.

Why uvicorn: it is what vLLM's and SGLang's OpenAI servers run, so the serving benchmark
compares like with like, and its per-message cost is small (a streamed token is one ASGI `send`
on an event loop, no thread per connection). It handles keep-alive, chunked request bodies,
pipelining and graceful shutdown; idle and stalled connections cost no thread.

What uvicorn lacks is a deadline for receiving a request: its keep-alive timer stops at the
first byte, so a client that sends half its headers or half its body and stalls holds the
connection forever (the Slowloris attack). `_DeadlineProtocol` adds one: from a request's
first byte (or the connection's opening) to its last body byte at most `read_timeout` seconds,
else 408 (when no response has started) and the connection is closed. The application sees the
close as `http.disconnect`, which cancels nothing yet started: the body was never complete.
"""

from __future__ import annotations

import asyncio
import json
import logging
import socket
import threading
from asyncio import TimerHandle
from typing import Any

import uvicorn
import uvloop
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from services.common import metrics
from services.common.http_config import HttpConfig
from services.router.openai_responses import error_body

logger = logging.getLogger(__name__)

LISTEN_BACKLOG = 2048  # bursts of new clients queue in the kernel instead of being reset


class _DeadlineProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol plus a request-receipt deadline (`read_timeout` seconds)."""

    read_timeout: float = HttpConfig.read_timeout  # set per server by `_protocol_class`

    _receipt_deadline: TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm()  # the first request's bytes must arrive in time too

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._arm()

    def on_message_complete(self) -> None:
        self._disarm()
        super().on_message_complete()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)

    def _arm(self) -> None:
        self._disarm()
        self._receipt_deadline = self.loop.call_later(self.read_timeout, self._receipt_expired)

    def _disarm(self) -> None:
        if self._receipt_deadline is not None:
            self._receipt_deadline.cancel()
            self._receipt_deadline = None

    def _receipt_expired(self) -> None:
        self._receipt_deadline = None
        if self.transport.is_closing():
            return
        metrics.HTTP_READ_TIMEOUTS.inc()
        if self.cycle is None or not self.cycle.response_started:
            message = f"body: the request did not arrive within {self.read_timeout:g} s"
            body = json.dumps(error_body(message, "invalid_request_error", 408, "body")).encode()
            self.transport.write(
                b"HTTP/1.1 408 Request Timeout\r\ncontent-type: application/json\r\n"
                b"connection: close\r\ncontent-length: %d\r\n\r\n%s" % (len(body), body)
            )
        self.transport.close()


def _protocol_class(read_timeout: float) -> type[_DeadlineProtocol]:
    return type("DeadlineProtocol", (_DeadlineProtocol,), {"read_timeout": read_timeout})


def bind(host: str, port: int) -> socket.socket:
    """A listening TCP socket on host:port (0: a free port). OSError names `http_port`."""
    try:
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(LISTEN_BACKLOG)
    except OSError as exc:
        raise OSError(f"http_port: cannot bind {host}:{port} ({exc.strerror})") from None
    sock.setblocking(False)
    return sock


class HttpServer:
    """An ASGI `app` served on host:port by uvicorn on a daemon thread until `close()`.

    Raises OSError naming `http_port` when the port cannot be bound.
    """

    def __init__(self, app: Any, host: str, port: int, config: HttpConfig) -> None:
        self._sock = bind(host, port)
        self.host, self.port = host, self._sock.getsockname()[1]
        uv_config = uvicorn.Config(
            app,
            http=_protocol_class(config.read_timeout),
            lifespan="off",
            timeout_keep_alive=max(1, round(config.keep_alive_timeout)),
            timeout_graceful_shutdown=max(1, round(config.shutdown_timeout)),
            access_log=False,
            log_config=None,
            server_header=False,
        )
        self._server = uvicorn.Server(uv_config)
        self._started = threading.Event()
        self._thread = threading.Thread(target=self._run, name="router-http", daemon=True)
        self._thread.start()
        self._started.wait(10.0)

    def _run(self) -> None:
        loop = uvloop.new_event_loop()
        asyncio.set_event_loop(loop)
        loop.call_soon(self._started.set)
        try:
            loop.run_until_complete(self._server.serve(sockets=[self._sock]))
        finally:
            loop.close()

    @property
    def url(self) -> str:
        """http://HOST:PORT"""
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"

    def close(self, timeout: float | None = None) -> None:
        """Stops accepting, lets running requests and streams finish (at most the config's
        `shutdown_timeout` seconds, then cuts them) and returns when the server has stopped
        (or after `timeout` seconds)."""
        self._server.should_exit = True
        self._thread.join(timeout)
        self._sock.close()
