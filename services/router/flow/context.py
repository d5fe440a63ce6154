"""What one request's run needs of the router: the model, the pool and its routing, the stall
watchdog, the migration policy and the serving-path rule. Built once by `GenerateFlow`."""

from __future__ import annotations

from dataclasses import dataclass

from services.config.migration import MigrationConfig
from services.router.flow.prompt import ModelInfo
from services.router.flow.watchdog import StallWatchdog
from services.router.pool.routing import Routing
from services.router.pool.worker_pool import WorkerPool


@dataclass(frozen=True)
class FlowContext:
    """The router's collaborators a `RequestRun` uses; `disaggregation` and
    `max_local_prefill_tokens` are `--disaggregation` and `--max-local-prefill-tokens`."""

    model: ModelInfo
    pool: WorkerPool
    routing: Routing
    watchdog: StallWatchdog
    migration: MigrationConfig
    disaggregation: str
    max_local_prefill_tokens: int

    def path_for(self, num_prompt_tokens: int) -> str:
        """ "local" (prefill on the decode worker) or "remote" (on the prefill pool) for a prompt
        (`--disaggregation`). The router has no view of the decode workers' prefix caches, so
        `auto` counts the whole prompt as uncached: a long prompt whose prefix a decode worker
        holds still goes to the prefill pool (whose cache the index does see)."""
        if self.disaggregation == "never":
            return "local"
        if self.disaggregation == "always":
            return "remote"
        return "local" if num_prompt_tokens <= self.max_local_prefill_tokens else "remote"
