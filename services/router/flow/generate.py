"""The router's request flow: validate -> Prefill -> first token -> Decode stream -> text.

Transport-free: `GenerateFlow.generate` takes a `GenerationRequest` (a plain dataclass,
`messages.py`), an absolute deadline and a `CancelScope`, and yields `GenerationOutput`s. The gRPC
servicer and the HTTP API both drive it, each converting its own wire format; neither
re-implements any step. Its calls to the workers go through `router/pool/worker_calls.py`.

One request's path through the workers (timeouts, cancels, releases, the retry) is
`router/flow/run.py`.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Generator

import grpc

from services.common.errors import ServiceUnavailableError, status_for
from services.config.migration import MigrationConfig
from services.config.roles import RouterConfig
from services.router.flow.admission import AdmissionGate
from services.router.flow.cancel import CancelScope
from services.router.flow.context import FlowContext
from services.router.flow.messages import GenerationOutput, GenerationRequest
from services.router.flow.prompt import ModelInfo
from services.router.flow.request_stats import count_error, create_series
from services.router.flow.run import RequestRun
from services.router.flow.siblings import Siblings
from services.router.flow.watchdog import StallWatchdog
from services.router.pool.routing import Routing
from services.router.pool.serving_path import ServingPaths
from services.router.pool.worker_pool import WorkerPool

logger = logging.getLogger(__name__)

# grpc reports a huge time_remaining (not None) for a call without a deadline.
NO_CLIENT_DEADLINE_S = 1e8
SHUTTING_DOWN = "the router is shutting down"  # UNAVAILABLE: what a stopping router answers
DEADLINE_SLACK_S = 0.25  # more than a loopback or LAN call's transit; less than any real deadline


class GenerateFlow:
    """Runs Generate requests against a worker pool.

    `model`: tokenizer, vocab size and max_model_len for validation and detokenization.
    `request_timeout`: seconds allowed to a request whose client set no deadline.
    `migration`: when a stream moves to another decode worker (`migration.py`); its stall
    timeout drives the flow's watchdog (`start()` / `close()`).
    """

    def __init__(
        self,
        model: ModelInfo,
        pool: WorkerPool,
        request_timeout: float = RouterConfig.request_timeout,
        routing: Routing | None = None,
        max_queued_requests: int = RouterConfig.max_queued_requests,
        disaggregation: str = RouterConfig.disaggregation,
        max_local_prefill_tokens: int | None = None,
        migration: MigrationConfig | None = None,
        slo_ttft_ms: float | None = None,
    ) -> None:
        if not request_timeout > 0:
            raise ValueError(f"request_timeout: must be > 0 seconds, got {request_timeout!r}")
        routing = routing if routing is not None else Routing(pool, "round_robin")
        migration = migration if migration is not None else MigrationConfig()
        self.request_timeout = request_timeout
        self.watchdog = StallWatchdog(pool.is_unhealthy, migration.stream_stall_timeout)
        self.stopping = threading.Event()  # set on shutdown: new requests get UNAVAILABLE
        self._active: set[CancelScope] = set()  # scopes of the requests in flight
        self._lock = threading.Lock()
        create_series()
        self.admission = AdmissionGate(
            pool.decode_slots, max_queued_requests, lambda: pool.decode_slots(healthy_only=False)
        )
        self.context = FlowContext(
            model,
            pool,
            routing,
            self.watchdog,
            migration,
            ServingPaths(disaggregation, max_local_prefill_tokens, slo_ttft_ms),
        )
        """The model, pool, routing and policies each request's run uses (held once, here)."""

    @property
    def model(self) -> ModelInfo:
        return self.context.model

    @property
    def pool(self) -> WorkerPool:
        return self.context.pool

    @property
    def routing(self) -> Routing:
        return self.context.routing

    @property
    def migration(self) -> MigrationConfig:
        return self.context.migration

    def start(self) -> None:
        """Starts the progress watchdog (the pool's health checks drive its verdicts)."""
        self.watchdog.start()

    def close(self) -> None:
        self.watchdog.close()

    @property
    def num_active(self) -> int:
        """Requests in flight."""
        return len(self._active)

    def end_all(self, reason: str = SHUTTING_DOWN) -> int:
        """Ends every request in flight with UNAVAILABLE `reason` (not a client cancel: each
        is counted and reported as the server's doing); returns how many."""
        with self._lock:
            scopes = list(self._active)
        for scope in scopes:
            scope.cancel(ServiceUnavailableError(reason))
        return len(scopes)

    def deadline_for(self, time_remaining: float | None) -> float:
        """Absolute `time.monotonic()` deadline for a client with `time_remaining` seconds left
        (None or no deadline: the router's request_timeout)."""
        if time_remaining is None or time_remaining >= NO_CLIENT_DEADLINE_S:
            time_remaining = self.request_timeout
        return time.monotonic() + time_remaining

    def generate(
        self,
        request: GenerationRequest,
        deadline: float,
        scope: CancelScope | None = None,
        admit: bool = True,
        siblings: Siblings | None = None,
        leader: bool = True,
        received: float | None = None,
    ) -> Generator[GenerationOutput, None, None]:
        """Streams the completion; the last output has finish_reason, usage and timings.

        `admit`: take one unit of the admission gate for the request's life (False: the caller
        holds units for it, as the HTTP API does for all the choices of one request).
        `siblings`: the group of the n sequences of one prompt (`siblings.py`), this one its
        `leader` or not. `received`: when the request arrived (time.monotonic() seconds; default
        now), where its timings start.
        Raises (when iterated): OverloadedError when the gate is full, InvalidRequestError
        for a request the model cannot take (the field named: `prompt.prepare_request`),
        ServiceUnavailableError with no workers, when the router is shutting down, or when a
        worker failed past what migration covers, TimeoutError past the deadline,
        RequestCancelledError when `scope` is cancelled, grpc.RpcError from a worker.
        Closing the generator early cancels whatever is in flight.
        """
        scope = scope if scope is not None else CancelScope()
        try:
            if self.stopping.is_set():
                raise ServiceUnavailableError(SHUTTING_DOWN)
            ticket = self.admission.admit() if admit else None
        except Exception as exc:  # refused before any work: still counted under its code
            count_error(status_for(exc)[0])
            raise
        with self._lock:
            self._active.add(scope)
        run = RequestRun(self.context, request, deadline, scope, siblings, leader, received)
        finished = False
        try:
            for output in run.outputs():
                if output.finish_reason and not finished:
                    finished = True
                    _log_finished(output)
                yield output
        except BaseException as exc:  # GeneratorExit too: the consumer went away
            if not finished:
                code = self._failure_code(exc, deadline)
                run.stats.on_failed(code)
                gone = isinstance(exc, GeneratorExit)
                why = "the client went away" if gone else status_for(exc)[1]
                logger.info("request failed: %s %s", code.name, why)
            raise
        finally:
            scope.cancel()  # anything still in flight is no longer wanted
            with self._lock:
                self._active.discard(scope)
            if ticket is not None:
                ticket.release()

    @staticmethod
    def _failure_code(exc: BaseException, deadline: float) -> grpc.StatusCode:
        """The code for the error counter; a cancel caused by the deadline counts as
        DEADLINE_EXCEEDED. A gRPC client's own deadline reaches the router as a cancel, a little
        before the router's copy of it (which started when the call arrived): a cancel within
        DEADLINE_SLACK_S of the deadline is the deadline's."""
        code = grpc.StatusCode.CANCELLED if isinstance(exc, GeneratorExit) else status_for(exc)[0]
        if code == grpc.StatusCode.CANCELLED and time.monotonic() >= deadline - DEADLINE_SLACK_S:
            return grpc.StatusCode.DEADLINE_EXCEEDED
        return code


def _log_finished(output: GenerationOutput) -> None:
    """One INFO line per finished sequence (its request id is on the record)."""
    timings, usage = output.timings, output.usage
    assert timings is not None and usage is not None  # the last output carries both
    path = f"{timings.path} ({timings.path_reason}"
    if timings.path_reason in ("predicted", "objective"):
        path += f": TTFT local {timings.predicted_ttft_local:.3f}s"
        path += f", remote {timings.predicted_ttft_remote:.3f}s"
    logger.info(
        "request finished: %s, path=%s), prompt_tokens=%d, completion_tokens=%d, "
        "cached_tokens=%d, ttft=%.3fs, e2e=%.3fs",
        output.finish_reason,
        path,
        usage.prompt_tokens,
        usage.completion_tokens,
        usage.cached_tokens,
        timings.ttft,
        timings.e2e,
    )
