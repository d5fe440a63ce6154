"""What one request's run needs of the router: the model, the pool and its routing, the stall
watchdog, the migration policy and the serving-path rule. Built once by `GenerateFlow`."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from services.common import metrics
from services.common.errors import ServiceUnavailableError
from services.config.migration import MigrationConfig
from services.router.flow.prompt import ModelInfo
from services.router.flow.watchdog import StallWatchdog
from services.router.pool.path_calibration import PathCalibration, decode_state
from services.router.pool.path_prediction import PathLoad
from services.router.pool.routing import Routing
from services.router.pool.serving_path import PathChoice, ServingPaths
from services.router.pool.worker_pool import WorkerPool


@dataclass(frozen=True)
class FlowContext:
    """The router's collaborators a `RequestRun` uses; `paths` is `--disaggregation` and
    `--max-local-prefill-tokens`, `calibration` what the router has seen of its predictions."""

    model: ModelInfo
    pool: WorkerPool
    routing: Routing
    watchdog: StallWatchdog
    migration: MigrationConfig
    paths: ServingPaths
    calibration: PathCalibration = field(default_factory=PathCalibration)

    def choose_path(
        self,
        prompt_ids: Sequence[int],
        cache_salt: str = "",
        ttft_objective_ms: float | None = None,
        itl_objective_ms: float = 0.0,
        tpot_objective_ms: float = 0.0,
    ) -> PathChoice:
        """The serving path of a prompt (`serving_path.py`), from the workers routing would
        pick now and what this router has in flight on them, for the request's TTFT objective
        (milliseconds; None: the router's) and the ITL / TPOT objectives its stream states
        (milliseconds; 0: none), which size its local chunks (`WorkerView.for_stream`). A local
        choice names its decode worker (`PathChoice.decode`), which the request then takes."""
        if self.paths.disaggregation != "auto":
            return self.paths.choose(PathLoad(len(prompt_ids)), None, None)
        try:
            prefill, cached, decode, decode_cached = self.routing.peek(prompt_ids, cache_salt)
        except ServiceUnavailableError:  # a pool without workers: the length rule says which
            return self.paths.choose(PathLoad(len(prompt_ids)), None, None)
        routing = self.routing
        load = PathLoad(
            len(prompt_ids),
            prefill_cached=cached,
            prefill_queued=routing.queued_tokens[prefill],
            decode_rows=routing.in_flight[decode],
            decode_context=routing.decode_context[decode],
            local_queued=routing.local_queued[decode],
            decode_cached=decode_cached,
        )
        decode_view = self.pool.view(decode)
        if decode_view is not None:
            decode_view = decode_view.for_stream(
                itl_objective_ms / 1000 or None, tpot_objective_ms / 1000 or None
            )
        choice = self.paths.choose(
            load, self.pool.view(prefill), decode_view, self.calibration, ttft_objective_ms
        )
        return choice.on(decode) if choice.path == "local" else choice

    def first_token(self, choice: PathChoice, seconds: float) -> None:
        """A request reached its first token `seconds` after `choice` was made: a predicted
        choice's path calibrates the next predictions (`PathCalibration`)."""
        predicted = choice.local_s if choice.path == "local" else choice.remote_s
        if choice.reason in ("predicted", "objective") and predicted is not None:
            streaming = choice.streaming
            self.calibration.observe(choice.path, predicted / choice.scale, seconds, streaming)
            ratio = self.calibration.scale(choice.path, streaming)
            state = decode_state(streaming)
            metrics.PATH_CALIBRATION.labels("router", choice.path, state).set(ratio)
