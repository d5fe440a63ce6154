"""One request's timeline as the router sees it, and the router's Prometheus metrics for it.

Definitions (docs/architecture.md, as vLLM's and SGLang's serving benchmarks use them), all in
seconds on the monotonic clock, measured from when the router received the request:
TTFT = first token sent; E2E = last token sent; TPOT = (E2E - TTFT) / (tokens - 1) when more
than one token was generated; ITL = each gap between consecutive messages carrying tokens.

The legs (`Timings`, `messages.py`; `pdserve_request_leg_seconds{leg}`) split them:
    TTFT ~ router_queue + tokenize + prefill_queue + prefill
    E2E  ~ TTFT + decode_queue + kv_transfer + first_decode_step + decode
`prefill` and `first_decode_step` are the workers' own compute figures (first scheduled -> first
sampled token, `RequestMetrics` in the engine); each `*_queue` leg is the rest of its RPC's wait
as the router saw it: the network, the worker's queue, and on the decode side the wait for
blocks. What is left over (picking a worker, handing a message on) is the router's bookkeeping,
a fraction of a millisecond.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import grpc

from services.common import metrics
from services.router.flow.messages import Timings, Usage
from services.router.pool.path_calibration import DECODE_STATES, PATHS
from services.router.pool.serving_path import MODES, PathChoice

ROLE = "router"
LEGS = (
    "router_queue",
    "tokenize",
    "prefill_queue",
    "prefill",
    "kv_transfer",
    "decode_queue",
    "first_decode_step",
    "decode",
)


def create_series() -> None:
    """Creates the router's labelled series at start (metrics.create_router_series, the legs and
    the paths), so they read 0 (not absent) before the first request."""
    metrics.create_router_series(ROLE)
    for leg in LEGS:
        metrics.REQUEST_LEG_TIME.labels(ROLE, leg)
    for path in PATHS:
        metrics.REQUESTS_BY_PATH.labels(ROLE, path)
        for state in DECODE_STATES:
            metrics.PATH_CALIBRATION.labels(ROLE, path, state).set(1.0)
        for reason in MODES:
            metrics.PATH_DECISIONS.labels(ROLE, path, reason)


@dataclass
class RequestStats:
    """Timestamps, legs and counts for one request; `on_*` methods also record its metrics."""

    start: float = field(default_factory=time.monotonic)
    """When the request was received (time.monotonic seconds)."""
    path: str = "remote"
    """"remote" (prefilled on the prefill pool) or "local" (on its decode worker)."""
    choice: PathChoice | None = None
    """Why `path`, with each path's predicted TTFT when predicted."""
    prompt_tokens: int = 0
    cached_tokens: int = 0
    """Prompt tokens the prefill worker took from its prefix cache."""
    router_queue: float = 0.0
    tokenize: float = 0.0
    prefill_queue: float = 0.0
    prefill: float = 0.0
    kv_transfer: float = 0.0
    decode_queue: float = 0.0
    first_decode_step: float = 0.0
    decode_start: float | None = None
    """When the Decode call was sent."""
    first_decode_at: float | None = None
    """When the first token after the prefill's arrived."""
    first_token_at: float | None = None
    last_token_at: float | None = None
    num_tokens: int = 0
    counts_prompt: bool = True
    """Whether this sequence adds its prompt to `pdserve_prompt_tokens_total` (False for the
    2nd..nth choice of one prompt, which share the first one's)."""
    migrations: int = 0
    """Times the stream moved to another decode worker."""
    migration: float = 0.0
    """Seconds from the last token sent before each move to the next token sent, summed (a
    stall's wait for the watchdog included)."""
    migrating_since: float | None = None

    def on_started(self) -> None:
        """The router starts working on the request (its flow thread picked it up)."""
        self.router_queue = time.monotonic() - self.start

    def on_path(self, choice: PathChoice) -> None:
        """The request takes `choice.path` ("remote" or "local"); counted once per request."""
        self.path, self.choice = choice.path, choice
        metrics.REQUESTS_BY_PATH.labels(ROLE, choice.path).inc()
        metrics.PATH_DECISIONS.labels(ROLE, choice.path, choice.reason).inc()

    def on_tokenized(self, prompt_tokens: int, seconds: float) -> None:
        self.prompt_tokens, self.tokenize = prompt_tokens, seconds
        metrics.TOKENIZE_TIME.labels(ROLE).observe(seconds)

    def on_prefill(self, call_seconds: float, compute_seconds: float, cached_tokens: int) -> None:
        """A Prefill call took `call_seconds`, of which `compute_seconds` were its worker's
        compute (a retried or migrated prefill's figures add to the first one's; the usage's
        cached_tokens stay the first prefill's)."""
        self.prefill_queue += max(0.0, call_seconds - compute_seconds)
        self.prefill += compute_seconds
        if not self.migrations:
            self.cached_tokens = cached_tokens
        metrics.PREFILL_TIME.labels(ROLE).observe(call_seconds)

    def on_migrated(self, reason: str) -> None:
        """The stream's worker failed (`reason`, a MIGRATION_REASONS value): it moves on."""
        self.migrations += 1
        if self.migrating_since is None:  # the pause the client saw: from its last token
            self.migrating_since = self.last_token_at or time.monotonic()
        metrics.REQUEST_MIGRATIONS.labels(ROLE, reason).inc()

    def on_decode_started(self) -> None:
        self.decode_start = time.monotonic()

    def on_first_decode(self, kv_transfer: float, step_seconds: float) -> None:
        """The first Decode reply arrived: the KV pull took `kv_transfer` seconds and the step
        that computed its token `step_seconds` (both measured by the decode worker). After a
        migration only the first worker's figures are kept."""
        if self.first_decode_at is not None:
            return
        now = time.monotonic()
        assert self.decode_start is not None  # on_decode_started came first
        self.kv_transfer, self.first_decode_step, self.first_decode_at = (
            kv_transfer,
            step_seconds,
            now,
        )
        self.decode_queue = max(0.0, now - self.decode_start - kv_transfer - step_seconds)
        metrics.KV_TRANSFER_TIME.labels(ROLE).observe(kv_transfer)

    def on_local_prefill(self, compute_seconds: float, cached_tokens: int) -> None:
        """The local path's first Decode reply (the first token) arrived; its decode worker
        spent `compute_seconds` prefilling (from first scheduled to that token)."""
        assert self.decode_start is not None  # on_decode_started came first
        if self.migrations:  # a migrated stream's re-prefill: not the request's prefill
            self.on_first_decode(0.0, compute_seconds)
            return
        self.prefill_queue = max(0.0, time.monotonic() - self.decode_start - compute_seconds)
        self.prefill, self.cached_tokens = compute_seconds, cached_tokens

    def on_local_first_decode(self) -> None:
        """The local path's second token arrived: its step is the first decode step (measured
        here, from the first token's arrival; no decode queue, no KV transfer)."""
        now = time.monotonic()
        self.first_decode_step = now - (self.first_token_at or now)
        self.first_decode_at = now

    def on_tokens_sent(self, num_tokens: int) -> None:
        """Called just before a message carrying `num_tokens` (> 0) new tokens is handed over."""
        now = time.monotonic()
        if self.migrating_since is not None:
            self.migration += now - self.migrating_since
            self.migrating_since = None
        if self.first_token_at is None:
            self.first_token_at = now
            metrics.TIME_TO_FIRST_TOKEN.labels(ROLE).observe(now - self.start)
            # Its prompt is counted once it was prefilled: refused or failed requests add none.
            if self.counts_prompt:
                metrics.PROMPT_TOKENS.labels(ROLE).inc(self.prompt_tokens)
        else:
            assert self.last_token_at is not None  # set together with first_token_at
            metrics.INTER_TOKEN_LATENCY.labels(ROLE).observe(now - self.last_token_at)
        self.last_token_at = now
        self.num_tokens += num_tokens
        metrics.GENERATION_TOKENS.labels(ROLE).inc(num_tokens)

    def on_finished(self, finish_reason: str) -> None:
        """Records E2E, TPOT, the legs and the success counter (call before the final message
        is sent)."""
        end = self.last_token_at if self.last_token_at is not None else time.monotonic()
        ttft = (self.first_token_at or end) - self.start
        metrics.E2E_REQUEST_LATENCY.labels(ROLE).observe(end - self.start)
        if self.num_tokens > 1:
            tpot = (end - self.start - ttft) / (self.num_tokens - 1)
            metrics.TIME_PER_OUTPUT_TOKEN.labels(ROLE).observe(tpot)
        metrics.REQUEST_SUCCESS.labels(ROLE, finish_reason).inc()
        if self.counts_prompt:  # once per prompt, as pdserve_prompt_tokens_total counts it
            metrics.REQUEST_PROMPT_TOKENS.labels(ROLE).observe(self.prompt_tokens)
        metrics.REQUEST_GENERATION_TOKENS.labels(ROLE).observe(self.num_tokens)
        timings = self.timings()
        for leg in LEGS:
            metrics.REQUEST_LEG_TIME.labels(ROLE, leg).observe(getattr(timings, leg))

    def on_failed(self, code: grpc.StatusCode) -> None:
        count_error(code)

    def usage(self) -> Usage:
        return Usage(
            prompt_tokens=self.prompt_tokens,
            completion_tokens=self.num_tokens,
            cached_tokens=self.cached_tokens,
        )

    def timings(self) -> Timings:
        """Seconds; call after the last `on_tokens_sent`."""
        end = self.last_token_at if self.last_token_at is not None else time.monotonic()
        ttft = (self.first_token_at or end) - self.start
        decode = 0.0
        if self.first_decode_at is not None:
            decode = max(0.0, end - self.first_decode_at)
        return Timings(
            ttft=ttft,
            e2e=end - self.start,
            router_queue=self.router_queue,
            tokenize=self.tokenize,
            prefill_queue=self.prefill_queue,
            prefill=self.prefill,
            kv_transfer=self.kv_transfer,
            decode_queue=self.decode_queue,
            first_decode_step=self.first_decode_step,
            decode=decode,
            path=self.path,
            migrations=self.migrations,
            migration=self.migration,
            path_reason=self.choice.reason if self.choice else "mode",
            predicted_ttft_local=(self.choice and self.choice.local_s) or 0.0,
            predicted_ttft_remote=(self.choice and self.choice.remote_s) or 0.0,
        )


def count_error(code: grpc.StatusCode) -> None:
    """One request ended with `code`: in its flow, or refused before one started (a parse error,
    a wrong key, a full admission queue)."""
    metrics.REQUEST_ERRORS.labels(ROLE, code.name).inc()
