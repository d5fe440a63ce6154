"""The Prefill RPC of one request: a picked worker, its retry, its cancel and its stall.

A worker that answers UNAVAILABLE (dead, draining) or that the watchdog cut (stalled while
failing its health checks) is marked unhealthy and the call goes once to another healthy worker,
waiting up to `--migration-wait` seconds for one when none is left (a restarted one counts).
A cancel (client, deadline, shutdown) releases whatever the worker may have pinned by the
request's id.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import grpc

from services.common.errors import ServiceUnavailableError
from services.router.flow.cancel import CancelScope, RequestCancelledError
from services.router.flow.context import FlowContext
from services.router.flow.prompt import PreparedRequest
from services.router.flow.request_stats import RequestStats
from services.router.flow.siblings import Siblings
from services.router.flow.watchdog import StalledCallError
from services.router.pool.worker_calls import PrefillReply, WorkerRequest, start_prefill


class PrefillCall:
    """The Prefill RPC of one request, its retry included. `remaining()` gives the seconds left
    until the request's deadline (raises TimeoutError when none are); `release_kv(request_id,
    address)` unpins what a prefill worker may hold for the request; `siblings`/`leader`: the
    request's group of n sequences and whether it leads it; `stats` its timings."""

    def __init__(
        self,
        context: FlowContext,
        scope: CancelScope,
        stats: RequestStats,
        remaining: Callable[[], float],
        release_kv: Callable[[str, str], None],
        siblings: Siblings | None = None,
        leader: bool = True,
    ) -> None:
        self.context = context
        self.scope = scope
        self.stats = stats
        self._remaining = remaining
        self._release_kv = release_kv
        self.siblings = siblings
        self.leader = leader
        self.prefill_address = ""  # the worker of the latest attempt

    def run(
        self, prepared: PreparedRequest, resumed: list[int], engine_request_id: str
    ) -> PrefillReply:
        """Runs the Prefill RPC (of the prompt, plus a migrated request's `resumed` outputs) as
        `engine_request_id` on a picked worker (`prefill_address` once it returns);
        cancellable through the scope. A worker that answers UNAVAILABLE (dead, draining, or
        stalled while unhealthy) is marked unhealthy and the call goes once to another healthy
        worker, waiting up to `--migration-wait` for one (a restarted worker counts) when none
        is left."""
        routing = self.context.routing
        context_ids = prepared.prompt_token_ids + resumed
        num_prompt = len(context_ids)
        prefer = None
        if self.siblings is not None and not self.leader:
            waited = time.monotonic()
            prefer = self.siblings.prefill_worker(self._remaining())
            self.stats.router_queue += time.monotonic() - waited  # behind the leader's prefill
        for attempt in (1, 2):
            self.prefill_address, _ = routing.pick_prefill(
                context_ids, prepared.cache_salt, prefer if attempt == 1 else None
            )
            try:
                response = self._call_prefill(prepared, resumed, engine_request_id)
            except grpc.RpcError as exc:
                if not self._worker_went_away(exc):
                    raise
                self.context.pool.mark_unhealthy(self.prefill_address)
                # another healthy worker at once, or the first to turn up (a restarted one)
                wait = min(self.context.migration.migration_wait, self._remaining())
                if attempt == 2 or not self.context.pool.wait_healthy("prefill", wait):
                    raise ServiceUnavailableError(
                        f"prefill worker {self.prefill_address}: {exc.details()}"
                        + ("" if attempt == 2 else f"; no other within {wait:.3g} s")
                    ) from exc
                continue
            finally:
                routing.prefill_done(self.prefill_address, num_prompt)
            routing.learn_routed(self.prefill_address, context_ids, prepared.cache_salt)
            if self.siblings is not None and self.leader:
                self.siblings.prefilled(self.prefill_address)
            return response
        raise AssertionError("unreachable")

    def _worker_went_away(self, exc: grpc.RpcError) -> bool:
        """UNAVAILABLE (dead, draining), or CANCELLED by the worker's side (a server that is
        stopping cancels the calls it still has) while this request was not cancelled."""
        code = exc.code()
        return code == grpc.StatusCode.UNAVAILABLE or (
            code == grpc.StatusCode.CANCELLED
            and not self.scope.cancelled
            and not isinstance(exc, RequestCancelledError)
        )

    def _call_prefill(
        self, prepared: PreparedRequest, resumed: list[int], rid: str
    ) -> PrefillReply:
        request = WorkerRequest(
            rid, prepared.prompt_token_ids, prepared.params, prepared.cache_salt, resumed
        )
        self.scope.check()
        start = time.monotonic()
        future = self.scope.track(
            start_prefill(self.context.pool, self.prefill_address, request, self._remaining())
        )
        try:
            with self.context.watchdog.watch(self.prefill_address, future) as watch:
                response = future.result()
        except grpc.FutureCancelledError:
            # The worker may have pinned the prompt KV just as we cancelled: release it by id
            # (a release that arrives before the pin is remembered and applied to it).
            self._release_kv(rid, self.prefill_address)
            if watch.stalled and not self.scope.cancelled:
                raise StalledCallError(self.prefill_address) from None
            raise self.scope.error() from None
        except grpc.RpcError as exc:
            if exc.code() == grpc.StatusCode.DEADLINE_EXCEEDED:
                self._release_kv(rid, self.prefill_address)
            raise
        finally:
            self.scope.untrack(future)
        self.stats.on_prefill(
            time.monotonic() - start, response.compute_seconds, response.num_cached_tokens
        )
        return response
