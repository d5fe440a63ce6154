"""Sending one benchmark request and timing it: over an OpenAI-compatible HTTP server's streaming
`/v1/completions` (aiohttp, as `vllm bench serve` sends it, so both systems are driven alike) or
over pdserve's gRPC `Generate` (grpc.aio).

Timeline rules, as vLLM's benchmark has them: the clock starts when the request is sent; the
first chunk that carries generated text (HTTP) or token ids (gRPC) gives TTFT; every later such
chunk adds one ITL gap; the last one gives E2E. Output tokens come from the server's usage (the
HTTP usage chunk, `stream_options.include_usage`; gRPC's final `usage`), cached prompt tokens
from `usage.prompt_tokens_details.cached_tokens` (vLLM: `--enable-prompt-tokens-details`) or
pdserve's `cached_tokens`. A non-200 answer, an in-band error or a broken stream is an error
named by what happened (`HTTP 429`, `UNAVAILABLE`, ...).
"""

from __future__ import annotations

import json
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from services.bench.dataset import BenchRequest
from services.bench.stats import RequestResult, Slo

Send = Callable[[BenchRequest], Awaitable[RequestResult]]


@dataclass(frozen=True)
class Target:
    """Where requests go: `base_url` (HTTP) or `grpc` (HOST:PORT), the model name to send, and
    what every request asks for besides its prompt and length."""

    base_url: str | None = None
    grpc: str | None = None
    model: str = ""
    api_key: str | None = None
    ignore_eos: bool = True
    timeout_s: float = 600.0
    objectives: Slo | None = None
    """Sent with every HTTP request as headers (`objective_headers`, the TTFT one for the
    request's own prompt length); gRPC sends the same objectives as GenerateRequest fields."""


def objective_headers(slo: Slo | None, prompt_len: int) -> dict[str, str]:
    """The objectives of `slo` for a request of `prompt_len` tokens as llm-d's per-request
    headers (milliseconds): {"x-slo-ttft-ms": ..., "x-slo-tpot-ms": ..., "x-slo-itl-ms": ...},
    each only when `slo` has it. pdserve's router chooses the serving path by the TTFT one and
    its scheduler budgets each step by the others; a server that does not know them ignores
    them."""
    out: dict[str, str] = {}
    if slo is None:
        return out
    if (ttft := slo.ttft_for(prompt_len)) is not None:
        out["x-slo-ttft-ms"] = f"{ttft * 1e3:g}"
    if slo.tpot is not None:
        out["x-slo-tpot-ms"] = f"{slo.tpot * 1e3:g}"
    if slo.itl is not None:
        out["x-slo-itl-ms"] = f"{slo.itl * 1e3:g}"
    return out


class _Timeline:
    """Arrival times of a request's token-carrying chunks."""

    def __init__(self, result: RequestResult) -> None:
        self.result = result
        self.start = time.perf_counter()
        self.last: float | None = None

    def chunk(self) -> None:
        now = time.perf_counter()
        if self.last is None:
            self.result.ttft = now - self.start
        else:
            self.result.itl.append(now - self.last)
        self.last = now

    def end(self) -> None:
        self.result.e2e = (self.last or time.perf_counter()) - self.start


def http_sender(target: Target, session: Any) -> Send:
    """`send(request)` over `session` (an aiohttp.ClientSession) to `target.base_url`."""
    url = target.base_url.rstrip("/") + "/v1/completions"  # type: ignore[union-attr]
    auth = {"Authorization": f"Bearer {target.api_key}"} if target.api_key else {}

    async def send(request: BenchRequest) -> RequestResult:
        body = {
            "model": target.model,
            "prompt": request.prompt,
            "max_tokens": request.output_len,
            "temperature": 0.0,
            "stream": True,
            "stream_options": {"include_usage": True},
            "ignore_eos": target.ignore_eos,
        }
        result = RequestResult(prompt_len=request.prompt_len, output_len=request.output_len)
        timeline = _Timeline(result)
        headers = {**auth, **objective_headers(target.objectives, request.prompt_len)}
        try:
            async with session.post(url, json=body, headers=headers) as response:
                if response.status != 200:
                    result.error = f"HTTP {response.status}"
                    return result
                async for line in response.content:
                    _http_event(line, result, timeline)
            result.ok = not result.error
        except Exception as exc:  # noqa: BLE001 - a failed request is a data point
            result.error = _describe(exc)
        finally:
            timeline.end()
        return result

    return send


def _describe(exc: BaseException) -> str:
    """ "ClientConnectorError: Cannot connect to host ..." (cut to 160 characters)."""
    text = str(exc)
    return f"{type(exc).__name__}: {text}"[:160] if text else type(exc).__name__


def _http_event(line: bytes, result: RequestResult, timeline: _Timeline) -> None:
    """One SSE line of a streamed completion."""
    line = line.strip()
    if not line.startswith(b"data: ") or line == b"data: [DONE]":
        return
    event = json.loads(line[6:])
    if "error" in event:
        result.error = str(event["error"].get("type") or "error")
        return
    for choice in event.get("choices") or ():
        if choice.get("text"):
            timeline.chunk()
        if choice.get("timings"):
            result.timings = choice["timings"]
    if usage := event.get("usage"):
        result.output_tokens = usage.get("completion_tokens", 0)
        details = usage.get("prompt_tokens_details") or {}
        result.cached_tokens = details.get("cached_tokens") or 0


def grpc_sender(target: Target, channel: Any) -> Send:
    """`send(request)` over `channel` (a grpc.aio channel to `target.grpc`)."""
    from services.common.convert import timings_to_dict
    from services.common.pb import common_pb2, generate_pb2, generate_pb2_grpc
    from services.router.openai.protocol import OBJECTIVE_HEADERS

    stub = generate_pb2_grpc.GenerationStub(channel)
    metadata = (("authorization", f"Bearer {target.api_key}"),) if target.api_key else None

    async def send(request: BenchRequest) -> RequestResult:
        message = generate_pb2.GenerateRequest(
            text=request.prompt,
            sampling=common_pb2.SamplingParams(
                max_tokens=request.output_len, temperature=0.0, ignore_eos=target.ignore_eos
            ),
        )
        for header, ms in objective_headers(target.objectives, request.prompt_len).items():
            setattr(message, OBJECTIVE_HEADERS[header], float(ms))
        result = RequestResult(prompt_len=request.prompt_len, output_len=request.output_len)
        timeline = _Timeline(result)
        try:
            call = stub.Generate(message, timeout=target.timeout_s, metadata=metadata)
            async for reply in call:
                if reply.token_ids:
                    timeline.chunk()
                if reply.finish_reason:
                    result.output_tokens = reply.usage.completion_tokens
                    result.cached_tokens = reply.usage.cached_tokens
                    result.timings = timings_to_dict(reply.timings)
            result.ok = True
        except Exception as exc:  # noqa: BLE001 - a failed request is a data point
            code = getattr(exc, "code", None)
            result.error = code().name if callable(code) else _describe(exc)
        finally:
            timeline.end()
        return result

    return send
