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
It also bounds a request's headers (MAX_HEADER_BYTES, else 431), which uvicorn's httptools
parser would buffer without limit.
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
from services.config.http import HttpConfig
from services.router.openai.bodies import error_body

logger = logging.getLogger(__name__)

LISTEN_BACKLOG = 2048  # bursts of new clients queue in the kernel instead of being reset
LINGER_S = 2.0  # after a refusal: how long the client's remaining bytes are read and dropped
MAX_HEADER_BYTES = 64 * 1024  # request line + headers; longer ones get 431 (uvicorn sets none)


class _DeadlineProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol plus a request-receipt deadline (`read_timeout` seconds)."""

    read_timeout: float = HttpConfig.read_timeout  # set per server by `_protocol_class`

    _receipt_deadline: TimerHandle | None = None
    _in_headers = True  # the parser has not seen the current request's headers end yet
    _header_bytes = 0  # bytes received since the current request began, while _in_headers
    _header_tail = b""  # the last 3 of those bytes (the blank line may span two chunks)
    _lingering = False  # refused and half-closed: reading until the client closes (or LINGER_S)

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm()  # the first request's bytes must arrive in time too

    def data_received(self, data: bytes) -> None:
        if self._lingering:  # refused: what the client still sends is read and dropped
            return
        if self._in_headers:
            # Counted before parsing, up to the blank line that ends them: headers that arrive
            # whole in one chunk are bounded too (the parser would have served them).
            seen = self._header_tail + data
            end = seen.find(b"\r\n\r\n")
            self._header_bytes += len(data) if end < 0 else end + 4 - len(self._header_tail)
            self._header_tail = seen[-3:]
            if self._header_bytes > MAX_HEADER_BYTES:
                if not self.transport.is_closing():  # headers this long are an attack
                    self._refuse(
                        431,
                        "Request Header Fields Too Large",
                        "headers",
                        f"longer than {MAX_HEADER_BYTES} bytes",
                    )
                return
        super().data_received(data)

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._arm()

    def on_headers_complete(self) -> None:
        self._in_headers = False
        super().on_headers_complete()

    def on_message_complete(self) -> None:
        self._disarm()
        self._in_headers, self._header_bytes = True, 0  # the next request's headers
        self._header_tail = b""
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
            message = f"the request did not arrive within {self.read_timeout:g} s"
            self._refuse(408, "Request Timeout", "body", message)
        else:
            self.transport.close()

    def _refuse(self, status: int, reason: str, param: str, message: str) -> None:
        """Answers `status` with an OpenAI error body naming `param`, and closes."""
        error = error_body(f"{param}: {message}", "invalid_request_error", status, param)
        body = json.dumps(error).encode()
        self.transport.write(
            b"HTTP/1.1 %d %s\r\ncontent-type: application/json\r\nconnection: close\r\n"
            b"content-length: %d\r\n\r\n%s" % (status, reason.encode(), len(body), body)
        )
        # A lingering close, as HTTP servers do: closing with the client's bytes unread would
        # reset the connection, and the client could lose the answer before reading it.
        if not self.transport.can_write_eof():
            self.transport.close()
            return
        self.transport.write_eof()
        self._lingering = True
        self.loop.call_later(LINGER_S, self.transport.close)


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
        self.shutdown_timeout = config.shutdown_timeout
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
