"""OpenAI-compatible HTTP API: a Starlette (ASGI) app over `GenerateFlow`.

Routes: POST /v1/completions, POST /v1/chat/completions (JSON, or Server-Sent Events with
`"stream": true`: `data: {chunk}\\n\\n` ... `data: [DONE]\\n\\n`), GET /v1/models, GET
/v1/models/{model}, GET /health, GET /metrics. A trailing slash and a query string are ignored.
`OpenAIApp` is a plain ASGI app: `router/openai/http_server.py` serves it, and a Ray Serve ingress
can mount it.

Errors: OpenAI's {"error": {"message", "type", "param", "code"}} with the HTTP status of the
gRPC code that `services.common.errors.status_for` gives (bad input 400 with the field in
`param`, a wrong key 401, an unknown model or route 404, overload 429 with Retry-After, no
workers 503, deadline 504, anything else 500). Order of checks, cheapest first: route, API key,
body size (413 before reading), JSON, fields, model, admission; the first token of every choice
is awaited before the 200, so a prompt refused while tokenizing still gets its 400.
A client that disconnects has its sequences cancelled, so workers free their blocks.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import threading
import time
from collections.abc import Callable
from typing import Any

import grpc
from prometheus_client import CONTENT_TYPE_LATEST, REGISTRY, generate_latest
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route
from starlette.types import Receive, Scope, Send

from services.common import request_id
from services.common.errors import ShuttingDownError, UnauthenticatedError
from services.config.roles import RouterConfig
from services.engine.errors import InvalidRequestError
from services.router.api_key import bearer_matches
from services.router.flow.cancel import CancelScope
from services.router.flow.generate import GenerateFlow
from services.router.flow.messages import GenerationRequest
from services.router.flow.request_stats import count_error
from services.router.flow.siblings import Siblings
from services.router.openai import bodies
from services.router.openai import protocol as oai
from services.router.openai.errors import (
    BodyTooLargeError,
    ModelNotFoundError,
    error_response,
    http_error_code,
)
from services.router.openai.render import ChoiceEnd, ChoiceRenderer, sse_body
from services.router.openai.threads import FlowThreads

logger = logging.getLogger(__name__)

MAX_FLOW_THREADS = 1024  # sequences whose flows run at once (admission bounds them first)
SHUTDOWN_MARGIN_S = 0.5  # before the shutdown grace ends: time to send the 503s


class OpenAIApp:
    """The OpenAI-compatible ASGI app of a router: `await app(scope, receive, send)`."""

    def __init__(self, flow: GenerateFlow, config: RouterConfig) -> None:
        self.flow = flow
        self.model_name = config.model
        self.max_body = config.http.max_body_bytes
        self.max_n = config.max_n
        self._key = config.api_key.encode() if config.api_key else None
        self.threads = FlowThreads(MAX_FLOW_THREADS)
        self.stopping = False
        self._active: set[_Ending] = set()  # requests in flight (cut at shutdown)
        routes = [
            Route("/v1/completions", self.completions, methods=["POST"]),
            Route("/v1/chat/completions", self.chat_completions, methods=["POST"]),
            Route("/v1/models", self.models, methods=["GET"]),
            Route("/v1/models/{model:path}", self.model, methods=["GET"]),
            Route("/health", self.health, methods=["GET"]),
            Route("/metrics", self.metrics, methods=["GET"]),
        ]
        self._app = Starlette(
            routes=routes, exception_handlers={HTTPException: self._http_exception}
        )

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            path = scope["path"]
            if len(path) > 1 and path.endswith("/"):
                scope = {**scope, "path": path.rstrip("/")}
            if scope["path"].startswith("/v1/") and not self._authorized(scope):
                error = UnauthenticatedError("authorization: missing or wrong API key")
                count_error(grpc.StatusCode.UNAUTHENTICATED)
                await error_response(error)(scope, receive, send)
                return
        await self._app(scope, receive, send)

    def _authorized(self, scope: Scope) -> bool:
        """A bearer token equal to the key (compared in constant time), or no key set."""
        if self._key is None:
            return True
        return bearer_matches(dict(scope["headers"]).get(b"authorization", b""), self._key)

    async def _http_exception(self, request: Request, exc: Exception) -> Response:
        assert isinstance(exc, HTTPException)
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        message = f"path: no route {request.method} {request.url.path}"
        if exc.status_code != 404:
            message = f"method: {exc.detail} ({request.method} {request.url.path})"
        body = bodies.error_body(message, kind, exc.status_code)
        return JSONResponse(body, exc.status_code, headers=exc.headers)

    # -- small routes ---------------------------------------------------------------------------

    async def health(self, request: Request) -> Response:
        return JSONResponse({"status": "ok"})

    async def metrics(self, request: Request) -> Response:
        """The router process's Prometheus metrics (as its /metrics port serves them)."""
        return Response(generate_latest(REGISTRY), media_type=CONTENT_TYPE_LATEST)

    async def models(self, request: Request) -> Response:
        max_model_len = self.flow.model.max_model_len
        return JSONResponse(bodies.models_body(self.model_name, max_model_len))

    async def model(self, request: Request) -> Response:
        name = request.path_params["model"]
        if name != self.model_name:
            return error_response(self._unknown_model(name))
        return JSONResponse(bodies.model_card(self.model_name, self.flow.model.max_model_len))

    def _unknown_model(self, name: str) -> ModelNotFoundError:
        return ModelNotFoundError(
            f"model: the model {name!r} does not exist (served: {self.model_name!r})"
        )

    # -- generation -----------------------------------------------------------------------------

    async def completions(self, request: Request) -> Response:
        return await self._generate(request, chat=False)

    async def chat_completions(self, request: Request) -> Response:
        return await self._generate(request, chat=True)

    async def _generate(self, request: Request, chat: bool) -> Response:
        received = time.monotonic()  # each choice's timings start here
        rid = request_id.accept(request.headers.get(request_id.HEADER))
        rid = rid or request_id.new_request_id()
        with request_id.bound(rid):
            response = await self._generate_bound(request, chat, received, rid)
        response.headers[request_id.HEADER] = rid
        return response

    async def _generate_bound(
        self, request: Request, chat: bool, received: float, rid: str
    ) -> Response:
        try:
            parsed = dataclasses.replace(
                oai.parse_request(await self._read_json(request), chat, self.max_n),
                request_id=rid,
            )
            parsed = oai.with_objectives(parsed, request.headers)
            if parsed.model is not None and parsed.model != self.model_name:
                raise self._unknown_model(parsed.model)
            ticket = self.flow.admission.admit(parsed.num_choices)
        except ClientDisconnect:
            count_error(grpc.StatusCode.CANCELLED)
            return Response(status_code=499)  # nobody reads it
        except Exception as exc:  # noqa: BLE001 - every refusal becomes an error body
            code = http_error_code(exc)
            count_error(code)  # refused before any flow: counted (and logged) here
            logger.info("request refused: %s %s", code.name, exc)
            return error_response(exc)
        end = _Ending([CancelScope() for _ in range(parsed.num_choices)], ticket.release)
        self._active.add(end)
        end.watcher = asyncio.create_task(self._end_on_disconnect(request.receive, end))
        try:
            if parsed.stream:
                return await self._stream(parsed, end, received)
            return await self._complete(parsed, end, received)
        except BaseException:  # cancelled (shutdown past its grace): stop the flows
            end()
            raise
        finally:
            if not parsed.stream:
                end()

    async def _end_on_disconnect(self, receive: Receive, end: _Ending) -> None:
        """Ends the request when its client disconnects, or once its response is complete
        (after the body, `receive` brings only `http.disconnect`, and brings it then too). This
        also covers a response whose body was never iterated because the client was gone."""
        try:
            while (await receive())["type"] != "http.disconnect":
                pass
        finally:
            end()
            self._active.discard(end)

    def _renderers(
        self, parsed: oai.OpenAIRequest, requests: list[GenerationRequest]
    ) -> list[ChoiceRenderer]:
        tokenizer = self.flow.model.tokenizer
        out = []
        for index, request in enumerate(requests):
            echo = ""
            if parsed.echo:
                ids = list(request.token_ids or ())
                echo = request.text or (tokenizer.decode(ids) if tokenizer and ids else "")
            out.append(ChoiceRenderer(parsed, self.model_name, index, tokenizer, echo))
        return out

    def _flows(
        self,
        parsed: oai.OpenAIRequest,
        requests: list[GenerationRequest],
        scopes: list[CancelScope],
        received: float,
    ) -> list[Any]:
        deadline = self.flow.deadline_for(None)
        groups = [Siblings() for _ in parsed.prompts]  # the n choices of each prompt
        return [
            request_id.bind_stream(
                self.flow.generate(
                    request,
                    deadline,
                    scope,
                    admit=False,
                    siblings=groups[index // parsed.n] if parsed.n > 1 else None,
                    leader=index % parsed.n == 0,
                    received=received,
                ),
                parsed.request_id,
            )
            for index, (request, scope) in enumerate(zip(requests, scopes, strict=True))
        ]

    async def _complete(self, parsed: oai.OpenAIRequest, end: _Ending, received: float) -> Response:
        requests = parsed.choice_requests()  # built once: renderers and flows share them
        flows = self._flows(parsed, requests, end.scopes, received)
        renderers = self._renderers(parsed, requests)
        sources = [r.whole(flow) for r, flow in zip(renderers, flows, strict=True)]
        try:
            results = await self.threads.run(sources)
        except Exception as exc:  # noqa: BLE001
            end()
            return error_response(ShuttingDownError() if self.stopping else exc)
        choices = [r[0][0] for r in results]
        usages = [r[0][1] for r in results]
        return JSONResponse(bodies.response_body(parsed, self.model_name, choices, usages))

    async def _stream(self, parsed: oai.OpenAIRequest, end: _Ending, received: float) -> Response:
        requests = parsed.choice_requests()  # built once: renderers and flows share them
        flows = self._flows(parsed, requests, end.scopes, received)
        renderers = self._renderers(parsed, requests)
        sources = [r.chunks(flow) for r, flow in zip(renderers, flows, strict=True)]
        events = self.threads.merged(sources)
        started: set[int] = set()
        head: list[tuple[int, bytes | ChoiceEnd]] = []
        try:
            while len(started) < len(sources):  # every choice's first chunk, before the 200
                index, item = await events.__anext__()
                started.add(index)
                head.append((index, item))
        except Exception as exc:  # noqa: BLE001
            end()
            return error_response(ShuttingDownError() if self.stopping else exc)
        body = sse_body(parsed, self.model_name, head, events, end, lambda: self.stopping)
        return StreamingResponse(
            body, media_type="text/event-stream", headers={"Cache-Control": "no-cache"}
        )

    async def _read_json(self, request: Request) -> Any:
        """The body as JSON: 413 past `max_body` bytes (by Content-Length before reading, or as
        chunks arrive), 400 naming `body` when it is not JSON."""
        length = request.headers.get("content-length")
        if length is not None and (not length.isdigit() or int(length) > self.max_body):
            raise BodyTooLargeError(f"at most {self.max_body} bytes, Content-Length {length}")
        chunks, size = [], 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > self.max_body:
                raise BodyTooLargeError(f"more than {self.max_body} bytes")
            chunks.append(chunk)
        if not size:
            raise InvalidRequestError("body", "is empty; send a JSON object")
        try:
            return json.loads(b"".join(chunks))
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise InvalidRequestError("body", f"invalid JSON ({exc})") from None
        except RecursionError:
            raise InvalidRequestError("body", "JSON nested too deeply") from None

    def begin_shutdown(self, grace_s: float) -> None:
        """The server stops accepting: running requests get `grace_s` seconds (less a margin
        to answer), then their flows are cut and each ends with a 503 "shutting down" (in-band
        for a stream, then `[DONE]`) instead of a dropped connection."""
        self.stopping = True
        timer = threading.Timer(max(grace_s - SHUTDOWN_MARGIN_S, 0.0), self._cut_all)
        timer.daemon = True
        timer.start()

    def _cut_all(self) -> None:
        for end in list(self._active):
            end()

    def close(self) -> None:
        """Cuts whatever still runs and waits for the flow threads (after the server stopped)."""
        self._cut_all()
        self.threads.close()


class _Ending:
    """Ends one HTTP request's flows (idempotent, any thread): cancels every choice's scope
    and gives its admission units back."""

    def __init__(self, scopes: list[CancelScope], release: Callable[[], None]) -> None:
        self.scopes, self._release = scopes, release
        self.watcher: asyncio.Task | None = None  # holds the disconnect watcher alive

    def __call__(self) -> None:
        for scope in self.scopes:
            scope.cancel()
        self._release()
