"""One request's timeline as the router sees it, and the router's Prometheus metrics for it.

Definitions (ARCHITECTURE.md, as vLLM's and SGLang's serving benchmarks use them), all in
seconds on the monotonic clock, measured from when the router received the request:
TTFT = first token sent; E2E = last token sent; TPOT = (E2E - TTFT) / (tokens - 1) when more
than one token was generated; ITL = each gap between consecutive messages carrying tokens.
The legs add up to about E2E: tokenize + prefill + (first token sent) + kv_transfer + decode,
where decode is the Decode RPC's time to its last token minus the KV pull it reports.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import grpc

from services.common import metrics
from services.common.pb import generate_pb2

ROLE = "router"


@dataclass
class RequestStats:
    """Timestamps and counts for one request; every `on_*` method also records its metrics."""

    start: float = field(default_factory=time.monotonic)
    """When the request was received (time.monotonic seconds)."""
    prompt_tokens: int = 0
    cached_tokens: int = 0
    """Prompt tokens the prefill worker took from its prefix cache."""
    tokenize: float = 0.0
    prefill: float = 0.0
    kv_transfer: float = 0.0
    decode_start: float | None = None
    first_token_at: float | None = None
    last_token_at: float | None = None
    num_tokens: int = 0

    def on_tokenized(self, prompt_tokens: int, seconds: float) -> None:
        self.prompt_tokens, self.tokenize = prompt_tokens, seconds
        metrics.TOKENIZE_TIME.labels(ROLE).observe(seconds)
        metrics.PROMPT_TOKENS.labels(ROLE).inc(prompt_tokens)

    def on_prefill(self, seconds: float, cached_tokens: int = 0) -> None:
        self.prefill, self.cached_tokens = seconds, cached_tokens
        metrics.PREFILL_TIME.labels(ROLE).observe(seconds)

    def on_decode_started(self) -> None:
        self.decode_start = time.monotonic()

    def on_kv_transfer(self, seconds: float) -> None:
        self.kv_transfer = seconds
        metrics.KV_TRANSFER_TIME.labels(ROLE).observe(seconds)

    def on_tokens_sent(self, num_tokens: int) -> None:
        """Called just before a message carrying `num_tokens` (> 0) new tokens is handed over."""
        now = time.monotonic()
        if self.first_token_at is None:
            self.first_token_at = now
            metrics.TIME_TO_FIRST_TOKEN.labels(ROLE).observe(now - self.start)
        else:
            assert self.last_token_at is not None  # set together with first_token_at
            metrics.INTER_TOKEN_LATENCY.labels(ROLE).observe(now - self.last_token_at)
        self.last_token_at = now
        self.num_tokens += num_tokens
        metrics.GENERATION_TOKENS.labels(ROLE).inc(num_tokens)

    def on_finished(self, finish_reason: str) -> None:
        """Records E2E, TPOT and the success counter (call before the final message is sent)."""
        end = self.last_token_at if self.last_token_at is not None else time.monotonic()
        ttft = (self.first_token_at or end) - self.start
        metrics.E2E_REQUEST_LATENCY.labels(ROLE).observe(end - self.start)
        if self.num_tokens > 1:
            tpot = (end - self.start - ttft) / (self.num_tokens - 1)
            metrics.TIME_PER_OUTPUT_TOKEN.labels(ROLE).observe(tpot)
        metrics.REQUEST_SUCCESS.labels(ROLE, finish_reason).inc()
        metrics.REQUEST_PROMPT_TOKENS.labels(ROLE).observe(self.prompt_tokens)
        metrics.REQUEST_GENERATION_TOKENS.labels(ROLE).observe(self.num_tokens)

    def on_failed(self, code: grpc.StatusCode) -> None:
        metrics.REQUEST_ERRORS.labels(ROLE, code.name).inc()

    def usage(self) -> generate_pb2.Usage:
        return generate_pb2.Usage(
            prompt_tokens=self.prompt_tokens,
            completion_tokens=self.num_tokens,
            cached_tokens=self.cached_tokens,
        )

    def timings(self) -> generate_pb2.Timings:
        """Seconds; call after the last `on_tokens_sent`."""
        end = self.last_token_at if self.last_token_at is not None else time.monotonic()
        ttft = (self.first_token_at or end) - self.start
        decode = 0.0
        if self.decode_start is not None:
            decode = max(0.0, end - self.decode_start - self.kv_transfer)
        return generate_pb2.Timings(
            ttft=ttft,
            e2e=end - self.start,
            tokenize=self.tokenize,
            prefill=self.prefill,
            kv_transfer=self.kv_transfer,
            decode=decode,
        )
