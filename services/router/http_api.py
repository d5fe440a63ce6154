"""OpenAI-compatible HTTP API (stdlib `ThreadingHTTPServer`), in-process over `GenerateFlow`.

Routes: POST /v1/completions, POST /v1/chat/completions (JSON, or Server-Sent Events with
`"stream": true`: `data: {chunk}\\n\\n` ... `data: [DONE]\\n\\n`), GET /health, GET /v1/models.
Errors: {"error": {"message", "type", ...}} with the HTTP status of the gRPC code that
`services.common.errors.status_for` gives the exception (bad input 400, overload 429,
unavailable 503, deadline 504, anything else 500). A client that disconnects has its request
cancelled, so workers free its blocks.
"""

from __future__ import annotations

import json
import logging
import re
import select
import socket
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import grpc

from services.common.errors import status_for
from services.common.pb import generate_pb2
from services.router import openai_protocol as oai
from services.router import openai_responses as bodies
from services.router.cancel import CancelScope
from services.router.generate import GenerateFlow

logger = logging.getLogger(__name__)

MAX_BODY_BYTES = 16 * 1024 * 1024
DISCONNECT_POLL_S = 0.25
_HTTP_STATUS = {
    grpc.StatusCode.INVALID_ARGUMENT: (400, "invalid_request_error"),
    grpc.StatusCode.NOT_FOUND: (404, "not_found_error"),
    grpc.StatusCode.RESOURCE_EXHAUSTED: (429, "rate_limit_error"),
    grpc.StatusCode.UNAVAILABLE: (503, "service_unavailable"),
    grpc.StatusCode.DEADLINE_EXCEEDED: (504, "timeout"),
    grpc.StatusCode.CANCELLED: (499, "cancelled"),
}
_ROUTES = {"/v1/completions": False, "/v1/chat/completions": True}  # path -> chat


def http_error(exc: BaseException) -> tuple[int, dict]:
    """(HTTP status, OpenAI error body) for an exception from the request flow."""
    code, details = status_for(exc)
    status, kind = _HTTP_STATUS.get(code, (500, "server_error"))
    if status == 500:
        logger.error("internal error serving HTTP request", exc_info=exc)
    # Every bad-input error names its field first ("temperature: must be ..."): that is `param`.
    param = re.match(r"[\w.\[\]]+(?=: )", details or "") if status == 400 else None
    return status, bodies.error_body(details or code.name, kind, status, param and param.group())


class _DisconnectWatcher:
    """Cancels `scope` when the client closes its connection while the request runs.

    The request body has been read in full, so the socket turning readable with nothing to
    peek at means EOF. (Pipelined bytes would sit in the handler's buffer, not the socket.)
    """

    def __init__(self, sock: socket.socket, scope: CancelScope) -> None:
        self._sock, self._scope = sock, scope
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._run, name="http-disconnect", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._done.is_set():
            try:
                readable, _, _ = select.select([self._sock], [], [], DISCONNECT_POLL_S)
                if not readable:
                    continue
                if not self._sock.recv(1, socket.MSG_PEEK):
                    self._scope.cancel()
                    return
                self._done.wait(DISCONNECT_POLL_S)  # pipelined bytes: EOF cannot show yet
            except (OSError, ValueError):  # socket closed under us: the request is over anyway
                return

    def stop(self) -> None:
        self._done.set()


class _Handler(BaseHTTPRequestHandler):
    """One HTTP request; `server.flow` and `server.model_name` come from `HttpApi`."""

    protocol_version = "HTTP/1.1"
    server: _Server

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - stdlib signature
        logger.debug("http %s - %s", self.address_string(), format % args)

    def _send_json(self, status: int, body: dict) -> None:
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        if status >= 400:  # a refused body may be unread: never parse it as the next request
            self.send_header("Connection", "close")
            self.close_connection = True
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self) -> None:
        if self.path == "/health":
            self._send_json(200, {"status": "ok"})
        elif self.path == "/v1/models":
            max_model_len = self.server.flow.model.max_model_len
            self._send_json(200, bodies.models_body(self.server.model_name, max_model_len))
        else:
            self._send_json(
                404, bodies.error_body(f"path: no route {self.path}", "not_found_error", 404)
            )

    def do_POST(self) -> None:
        chat = _ROUTES.get(self.path)
        if chat is None:
            self._send_json(
                404, bodies.error_body(f"path: no route {self.path}", "not_found_error", 404)
            )
            return
        try:
            request = oai.parse_request(self._read_json(), chat)
        except ValueError as exc:
            self._send_json(*http_error(exc))
            return
        scope = CancelScope()
        watcher = _DisconnectWatcher(self.connection, scope)
        responses = self.server.flow.generate(
            request.generate, self.server.flow.deadline_for(None), scope
        )
        try:
            if request.stream:
                self._stream(request, responses)
            else:
                self._complete(request, responses)
        except ConnectionError as exc:  # the client went away while we answered
            logger.info("http client %s gone: %s", self.address_string(), exc)
            self.close_connection = True
        finally:
            watcher.stop()
            responses.close()  # no-op when finished; otherwise cancels downstream work

    def _read_json(self) -> Any:
        """The request body as JSON; ValueError (-> 400) naming `body` when unreadable."""
        try:
            length = int(self.headers.get("Content-Length", "0"))
        except ValueError:
            raise ValueError("body: bad Content-Length") from None
        if not 0 < length <= MAX_BODY_BYTES:
            raise ValueError(f"body: Content-Length must be in [1, {MAX_BODY_BYTES}]")
        try:
            return json.loads(self.rfile.read(length))
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise ValueError(f"body: invalid JSON ({exc})") from None

    def _complete(
        self, request: oai.OpenAIRequest, responses: Iterator[generate_pb2.GenerateResponse]
    ) -> None:
        try:
            messages = list(responses)
        except Exception as exc:  # noqa: BLE001 - every failure becomes an error body
            self._send_json(*http_error(exc))
            return
        last = messages[-1]
        text = "".join(m.text for m in messages)
        entries = [lp for m in messages for lp in m.logprobs]
        token_ids = [lp.token_id for lp in entries]
        logprobs = bodies.logprobs_body(
            request, entries, self._token_text, self._text_offsets(token_ids, 0, len(text))
        )
        body = bodies.response_body(
            request, self.server.model_name, text, last.finish_reason, last.usage, logprobs
        )
        self._send_json(200, body)

    def _token_text(self, token_id: int) -> str:
        tokenizer = self.server.flow.model.tokenizer
        return tokenizer.decode([token_id]) if tokenizer is not None else ""

    def _text_offsets(self, token_ids: list[int], first: int, text_len: int) -> list[int]:
        """Where tokens first.. of the completion `token_ids` start in its text: the length of
        the text of the tokens before each (a character split across tokens starts at the
        first of them); capped at the text sent, which a stop string may have cut."""
        tokenizer = self.server.flow.model.tokenizer
        if tokenizer is None:
            return [0] * (len(token_ids) - first)
        return [
            min(len(tokenizer.decode(token_ids[:i]).rstrip("\ufffd")), text_len)
            for i in range(first, len(token_ids))
        ]

    def _stream(
        self, request: oai.OpenAIRequest, responses: Iterator[generate_pb2.GenerateResponse]
    ) -> None:
        """SSE: the first message is awaited before the 200 so bad input still gets a 400."""
        try:
            first = next(responses)
        except Exception as exc:  # noqa: BLE001
            self._send_json(*http_error(exc))
            return
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Cache-Control", "no-cache")
        self.send_header("Connection", "close")  # the stream's end is the connection's end
        self.end_headers()
        self.close_connection = True
        try:
            self._write_events(request, first, responses)
        except ConnectionError:
            raise  # the client left (do_POST closes the flow, which cancels downstream work)
        except Exception as exc:  # noqa: BLE001 - headers are out; report in-band
            self._event(http_error(exc)[1])
            self._event_done()

    def _write_events(
        self,
        request: oai.OpenAIRequest,
        first: generate_pb2.GenerateResponse,
        responses: Iterator[generate_pb2.GenerateResponse],
    ) -> None:
        model, message, is_first = self.server.model_name, first, True
        token_ids: list[int] = []  # every token streamed so far, for logprobs' text offsets
        text_len = 0
        while True:
            finish = message.finish_reason or None
            first_new = len(token_ids)
            token_ids += [lp.token_id for lp in message.logprobs]
            text_len += len(message.text)
            if message.text or finish or is_first or (request.logprobs and message.logprobs):
                offsets = (
                    self._text_offsets(token_ids, first_new, text_len) if request.logprobs else ()
                )
                logprobs = bodies.logprobs_body(
                    request, message.logprobs, self._token_text, offsets
                )
                self._event(
                    bodies.chunk_body(request, model, message.text, finish, is_first, logprobs)
                )
                is_first = False
            if finish:
                if request.include_usage:
                    self._event(bodies.usage_chunk_body(request, model, message.usage))
                self._event_done()
                for _ in responses:  # let the flow end its downstream calls cleanly
                    pass
                return
            message = next(responses)

    def _event(self, body: dict) -> None:
        self.wfile.write(b"data: " + json.dumps(body).encode() + b"\n\n")
        self.wfile.flush()

    def _event_done(self) -> None:
        self.wfile.write(b"data: [DONE]\n\n")
        self.wfile.flush()


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    request_queue_size = 256  # listen backlog; the stdlib default of 5 resets bursts of clients
    flow: GenerateFlow
    model_name: str


class HttpApi:
    """The running HTTP server (serving on a daemon thread until `close()`)."""

    def __init__(self, flow: GenerateFlow, host: str, port: int, model_name: str) -> None:
        """Binds host:port (0 picks a free port); raises OSError naming `http_port` when it
        cannot."""
        try:
            self._server = _Server((host, port), _Handler)
        except OSError as exc:
            raise OSError(f"http_port: cannot bind {host}:{port} ({exc.strerror})") from None
        self._server.flow = flow
        self._server.model_name = model_name
        self.host = host
        self.port = self._server.server_address[1]
        self._thread = threading.Thread(
            target=self._server.serve_forever, name="router-http", daemon=True
        )
        self._thread.start()

    @property
    def url(self) -> str:
        """http://HOST:PORT"""
        return f"http://{self.host}:{self.port}"

    def close(self) -> None:
        """Stops accepting and closes the listening socket (in-flight handlers run out)."""
        self._server.shutdown()
        self._server.server_close()
